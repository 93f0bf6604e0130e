//! Proto-JSON <-> prost conversion for every Envoy v3 message, driven by the descriptor set that
//! build.rs extracts from envoy-types.
//!
//! Decoding goes through prost-reflect's `DynamicMessage`, whose errors say what is wrong but not
//! where. When decoding fails, `locate` re-checks the JSON piece by piece against the
//! descriptors to find the innermost offending field, so every error names a path such as
//! `static_resources.clusters[0].connect_timeout`.

use std::sync::{Arc, Mutex, Weak};

use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use prost_reflect::{
    DescriptorPool, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, ReflectMessage,
    SerializeOptions,
};
use serde_json::Value as Json;

/// build.rs strips source comments from envoy-types' set (3.3 MB -> ~0.7 MB) and adds the
/// well-known types and TypedStruct it lacks.
static DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/envoy_descriptors.bin"));

/// Decoded once and kept: it costs ~18 MB RSS and 30-100 ms to decode, and with glibc malloc
/// dropping it does not give that memory back to the OS anyway (measured: RSS stays at the
/// high-water mark after drop), so decoding per call would only add latency.
/// The decoded pool while someone holds it. It costs ~18 MB, and is needed only to read the
/// bootstrap and to render `/config_dump`, so it is not kept for the life of the process: the
/// first caller decodes it, later callers share it while any holder is alive.
static POOL: Mutex<Weak<DescriptorPool>> = Mutex::new(Weak::new());

const TYPE_URL_KEY: &str = "@type";

#[derive(Debug, thiserror::Error)]
pub enum ProtoJsonError {
    /// Cannot happen with a build that passed build.rs's checks; kept as an error rather than a
    /// panic because the bytes come from outside this crate.
    #[error("the embedded Envoy descriptor set is invalid: {0}")]
    Descriptors(#[source] prost_reflect::DescriptorError),
    #[error("unknown message type '{0}'")]
    UnknownMessage(String),
    /// The JSON does not match the message; `path` is empty when the whole value is wrong.
    #[error("{}", at(path, message))]
    Invalid { path: String, message: String },
    /// The encoded message does not decode as the requested prost type: the Rust type and the
    /// proto name given to `from_json`/`to_json` disagree.
    #[error("cannot decode as {type_name}: {source}")]
    Decode {
        type_name: String,
        #[source]
        source: prost::DecodeError,
    },
}

impl ProtoJsonError {
    /// The field path the error is about ("" for the whole message), for callers that want to
    /// prefix it with a resource name or file.
    pub fn path(&self) -> &str {
        match self {
            ProtoJsonError::Invalid { path, .. } => path,
            _ => "",
        }
    }

    /// The error without its path.
    pub fn reason(&self) -> String {
        match self {
            ProtoJsonError::Invalid { message, .. } => message.clone(),
            other => other.to_string(),
        }
    }
}

fn at(path: &str, message: &str) -> String {
    if path.is_empty() {
        message.to_owned()
    } else {
        format!("{path}: {message}")
    }
}

/// The descriptor pool of every Envoy v3 message (plus well-known types and TypedStruct).
/// Cheap while a caller holds the returned `Arc` (hold one across a batch of conversions);
/// otherwise it decodes the pool again (tens of milliseconds).
pub fn pool() -> Result<Arc<DescriptorPool>, ProtoJsonError> {
    let mut slot = POOL.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(pool) = slot.upgrade() {
        return Ok(pool);
    }
    let decoded =
        Arc::new(DescriptorPool::decode(DESCRIPTORS).map_err(ProtoJsonError::Descriptors)?);
    *slot = Arc::downgrade(&decoded);
    Ok(decoded)
}

/// The descriptor of the message named `full_name`, e.g. "envoy.config.cluster.v3.Cluster".
pub fn message_descriptor(full_name: &str) -> Result<MessageDescriptor, ProtoJsonError> {
    pool()?
        .get_message_by_name(full_name)
        .ok_or_else(|| ProtoJsonError::UnknownMessage(full_name.to_owned()))
}

/// Proto-JSON -> prost message `M`, whose full proto name is `full_name`.
///
/// Accepts what Envoy accepts: proto (snake_case) or lowerCamelCase field names, `@type` inside
/// `Any`, durations as "1.5s", enums by name or number. Unknown fields are errors.
pub fn from_json<M: Message + Default>(full_name: &str, value: &Json) -> Result<M, ProtoJsonError> {
    let dynamic = dynamic_from_json(full_name, value)?;
    M::decode(dynamic.encode_to_vec().as_slice()).map_err(|source| ProtoJsonError::Decode {
        type_name: full_name.to_owned(),
        source,
    })
}

/// Like [`from_json`], but keeps the reflective message, for walks over the fields that are set.
pub fn dynamic_from_json(full_name: &str, value: &Json) -> Result<DynamicMessage, ProtoJsonError> {
    let desc = message_descriptor(full_name)?;
    DynamicMessage::deserialize(desc.clone(), value).map_err(|err| {
        let (path, message) =
            locate(&desc, value).unwrap_or_else(|| (String::new(), err.to_string()));
        ProtoJsonError::Invalid { path, message }
    })
}

/// Envoy's `--allow-unknown-static-fields`: removes from `value` (proto-JSON of `full_name`)
/// every field its message does not have, inside `Any`s of known types too, and returns where
/// each was (`admin.adress`), for the warnings Envoy logs instead of refusing the file.
pub fn strip_unknown_fields(
    full_name: &str,
    value: &mut Json,
) -> Result<Vec<String>, ProtoJsonError> {
    let desc = message_descriptor(full_name)?;
    let mut removed = Vec::new();
    strip_message(&desc, value, &mut String::new(), &mut removed);
    Ok(removed)
}

fn strip_message(
    desc: &MessageDescriptor,
    value: &mut Json,
    path: &mut String,
    out: &mut Vec<String>,
) {
    if has_special_json_mapping(desc) {
        return;
    }
    let Json::Object(fields) = value else {
        // Not an object: the decode reports it.
        return;
    };
    let is_any = desc.full_name() == "google.protobuf.Any";
    let desc = if is_any {
        let name = fields
            .get(TYPE_URL_KEY)
            .and_then(Json::as_str)
            .map(|t| type_url_message_name(t).to_owned());
        match name.and_then(|n| desc.parent_pool().get_message_by_name(&n)) {
            // Packed as {"@type", "value"}, or a type the decode will report.
            Some(inner) if !has_special_json_mapping(&inner) => inner,
            _ => return,
        }
    } else {
        desc.clone()
    };
    fields.retain(|key, _| {
        let known = (is_any && key == TYPE_URL_KEY)
            || desc.get_field_by_json_name(key).is_some()
            || desc.get_field_by_name(key).is_some();
        if !known {
            let mut at = path.clone();
            push_field(&mut at, key);
            out.push(at);
        }
        known
    });
    for (key, item) in fields.iter_mut() {
        let Some(field) = desc
            .get_field_by_json_name(key)
            .or_else(|| desc.get_field_by_name(key))
        else {
            continue;
        };
        let len = path.len();
        push_field(path, field.name());
        match (field.kind(), item) {
            (Kind::Message(entry), Json::Object(entries)) if field.is_map() => {
                if let Kind::Message(m) = entry.map_entry_value_field().kind() {
                    for (k, v) in entries.iter_mut() {
                        let at = path.len();
                        path.push_str(&format!("[{k:?}]"));
                        strip_message(&m, v, path, out);
                        path.truncate(at);
                    }
                }
            }
            (Kind::Message(m), Json::Array(elements)) if field.is_list() => {
                for (i, e) in elements.iter_mut().enumerate() {
                    let at = path.len();
                    path.push_str(&format!("[{i}]"));
                    strip_message(&m, e, path, out);
                    path.truncate(at);
                }
            }
            (Kind::Message(m), item) if !field.is_list() && !field.is_map() => {
                strip_message(&m, item, path, out)
            }
            _ => {}
        }
        path.truncate(len);
    }
}

/// prost message -> proto-JSON in Envoy's /config_dump style: proto field names, `Any` expanded
/// with `@type`, fields at their default value omitted.
pub fn to_json<M: Message>(full_name: &str, msg: &M) -> Result<Json, ProtoJsonError> {
    let desc = message_descriptor(full_name)?;
    let dynamic =
        DynamicMessage::decode(desc, msg.encode_to_vec().as_slice()).map_err(|source| {
            ProtoJsonError::Decode {
                type_name: full_name.to_owned(),
                source,
            }
        })?;
    dynamic_to_json(&dynamic)
}

/// An `Any` -> proto-JSON: `{"@type": type_url, ...fields of the packed message}`.
pub fn any_to_json(any: &Any) -> Result<Json, ProtoJsonError> {
    // Resolve first so that an unknown type gets a clear error rather than serde's.
    message_descriptor(type_url_message_name(&any.type_url))?;
    to_json("google.protobuf.Any", any)
}

/// A reflective message -> proto-JSON, in the same style as [`to_json`].
pub fn dynamic_to_json(msg: &DynamicMessage) -> Result<Json, ProtoJsonError> {
    let options = SerializeOptions::new()
        .use_proto_field_name(true)
        .skip_default_fields(true);
    let mut json = msg
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(|err| {
            // The usual cause is an Any whose type is not in the pool; name where it sits.
            let path = unresolvable_any(msg, &mut String::new()).unwrap_or_default();
            ProtoJsonError::Invalid {
                path,
                message: err.to_string(),
            }
        })?;
    integral_floats_as_integers(&mut json);
    Ok(json)
}

/// A proto double as JSON the way Envoy prints it: `1`, not `1.0`. Struct values (node
/// metadata, TypedStruct) are all doubles, so this matters for /config_dump and for metadata
/// that holds ports or counts.
pub fn number_to_json(n: f64) -> Json {
    // Beyond 2^53 doubles stop being exact integers; keep them as floats.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    if n.fract() == 0.0 && n.abs() <= EXACT {
        // The cast is exact: n is integral and within i64's exactly representable range.
        Json::from(n as i64)
    } else {
        serde_json::Number::from_f64(n).map_or(Json::Null, Json::Number)
    }
}

fn integral_floats_as_integers(json: &mut Json) {
    match json {
        Json::Number(n) if n.is_f64() => {
            if let Some(f) = n.as_f64() {
                *json = number_to_json(f);
            }
        }
        Json::Array(items) => items.iter_mut().for_each(integral_floats_as_integers),
        Json::Object(fields) => fields.values_mut().for_each(integral_floats_as_integers),
        _ => {}
    }
}

/// "type.googleapis.com/envoy.config.cluster.v3.Cluster" -> "envoy.config.cluster.v3.Cluster".
fn type_url_message_name(type_url: &str) -> &str {
    type_url.rsplit('/').next().unwrap_or(type_url)
}

/// Finds the first `Any` below `msg` whose packed type is not in the pool or does not decode.
fn unresolvable_any(msg: &DynamicMessage, path: &mut String) -> Option<String> {
    if msg.descriptor().full_name() == "google.protobuf.Any" {
        let type_url = msg
            .get_field_by_name("type_url")
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let value = msg
            .get_field_by_name("value")
            .and_then(|v| v.as_bytes().cloned())
            .unwrap_or_default();
        let Some(desc) = msg
            .descriptor()
            .parent_pool()
            .get_message_by_name(type_url_message_name(&type_url))
        else {
            return Some(path.clone());
        };
        return match DynamicMessage::decode(desc, value) {
            Ok(inner) => unresolvable_any(&inner, path),
            Err(_) => Some(path.clone()),
        };
    }
    for (field, value) in msg.fields() {
        let len = path.len();
        push_field(path, field.name());
        let found = match value {
            prost_reflect::Value::Message(m) => unresolvable_any(m, path),
            prost_reflect::Value::List(items) => items.iter().enumerate().find_map(|(i, item)| {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                let found = item.as_message().and_then(|m| unresolvable_any(m, path));
                path.truncate(len);
                found
            }),
            prost_reflect::Value::Map(entries) => entries.iter().find_map(|(key, item)| {
                let len = path.len();
                path.push_str(&format!("[{}]", map_key_text(key)));
                let found = item.as_message().and_then(|m| unresolvable_any(m, path));
                path.truncate(len);
                found
            }),
            _ => None,
        };
        path.truncate(len);
        if found.is_some() {
            return found;
        }
    }
    None
}

fn map_key_text(key: &prost_reflect::MapKey) -> String {
    match key {
        prost_reflect::MapKey::String(s) => format!("{s:?}"),
        prost_reflect::MapKey::Bool(b) => b.to_string(),
        prost_reflect::MapKey::I32(n) => n.to_string(),
        prost_reflect::MapKey::I64(n) => n.to_string(),
        prost_reflect::MapKey::U32(n) => n.to_string(),
        prost_reflect::MapKey::U64(n) => n.to_string(),
    }
}

fn push_field(path: &mut String, name: &str) {
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(name);
}

// ---------------------------------------------------------------------------------------------
// Locating a decode error.
//
// The checks below reuse prost-reflect itself on smaller and smaller pieces of the input (one
// field of one message at a time), so they can never disagree with the real decoder about what
// is valid; they only add the "where".

/// Returns the path and message of the innermost invalid piece of `value`, or None if every
/// piece is valid on its own (then the problem is a combination, e.g. two members of a oneof,
/// and the caller reports prost-reflect's message at the message's own path).
fn locate(desc: &MessageDescriptor, value: &Json) -> Option<(String, String)> {
    let mut path = String::new();
    locate_in_message(desc, value, &mut path)
}

fn locate_in_message(
    desc: &MessageDescriptor,
    value: &Json,
    path: &mut String,
) -> Option<(String, String)> {
    if has_special_json_mapping(desc) {
        return DynamicMessage::deserialize(desc.clone(), value)
            .err()
            .map(|err| (path.clone(), describe(desc, value, &err.to_string())));
    }
    if desc.full_name() == "google.protobuf.Any" {
        return locate_in_any(desc, value, path);
    }
    let Json::Object(fields) = value else {
        return Some((
            path.clone(),
            format!(
                "expected an object ({}), found {}",
                desc.full_name(),
                kind_of(value)
            ),
        ));
    };
    for (key, item) in fields {
        let Some(field) = desc
            .get_field_by_json_name(key)
            .or_else(|| desc.get_field_by_name(key))
        else {
            let mut at = path.clone();
            push_field(&mut at, key);
            return Some((at, "unknown field".to_owned()));
        };
        let len = path.len();
        push_field(path, field.name());
        let found = locate_in_field(desc, &field, key, item, path);
        path.truncate(len);
        if found.is_some() {
            return found;
        }
    }
    // Each field is fine alone; report combinations (oneof conflicts, duplicates) here.
    DynamicMessage::deserialize(desc.clone(), value)
        .err()
        .map(|err| (path.clone(), err.to_string()))
}

fn locate_in_any(
    desc: &MessageDescriptor,
    value: &Json,
    path: &mut String,
) -> Option<(String, String)> {
    let Json::Object(fields) = value else {
        return Some((
            path.clone(),
            format!(
                "expected an object with \"@type\", found {}",
                kind_of(value)
            ),
        ));
    };
    let Some(type_url) = fields.get(TYPE_URL_KEY) else {
        return Some((path.clone(), "Any is missing \"@type\"".to_owned()));
    };
    let Some(type_url) = type_url.as_str() else {
        return Some((
            path.clone(),
            format!("\"@type\" must be a string, found {}", kind_of(type_url)),
        ));
    };
    let name = type_url_message_name(type_url);
    let Some(inner) = desc.parent_pool().get_message_by_name(name) else {
        return Some((
            path.clone(),
            format!("unknown type \"{type_url}\" in \"@type\""),
        ));
    };
    if has_special_json_mapping(&inner) || inner.full_name() == "google.protobuf.Any" {
        // Such types are packed as {"@type": ..., "value": <their JSON form>}.
        let Some(packed) = fields.get("value") else {
            return Some((path.clone(), format!("Any of {name} needs a \"value\" key")));
        };
        return locate_in_message(&inner, packed, path);
    }
    let mut rest = fields.clone();
    rest.remove(TYPE_URL_KEY);
    locate_in_message(&inner, &Json::Object(rest), path)
}

/// `key`/`item` is one entry of an object decoded as `parent`; `path` already ends in the field.
fn locate_in_field(
    parent: &MessageDescriptor,
    field: &FieldDescriptor,
    key: &str,
    item: &Json,
    path: &mut String,
) -> Option<(String, String)> {
    if item.is_null() {
        // Proto-JSON null means "not set" for every field kind (but google.protobuf.Value,
        // where it is a value); either way prost-reflect accepts it.
        return single_field_error(parent, key, item).map(|e| (path.clone(), e));
    }
    if field.is_map() {
        let Json::Object(entries) = item else {
            return Some((
                path.clone(),
                format!("expected an object (map), found {}", kind_of(item)),
            ));
        };
        let Kind::Message(entry) = field.kind() else {
            return single_field_error(parent, key, item).map(|e| (path.clone(), e));
        };
        let value_field = entry.map_entry_value_field();
        for (map_key, map_value) in entries {
            let len = path.len();
            path.push_str(&format!("[{map_key:?}]"));
            let single = Json::Object([(map_key.clone(), map_value.clone())].into_iter().collect());
            let found = match (value_field.kind(), single_field_error(parent, key, &single)) {
                (_, None) => None,
                (Kind::Message(m), Some(err)) => {
                    locate_in_message(&m, map_value, path).or_else(|| Some((path.clone(), err)))
                }
                (_, Some(err)) => {
                    Some((path.clone(), describe_field(&value_field, map_value, &err)))
                }
            };
            path.truncate(len);
            if found.is_some() {
                return found;
            }
        }
        return single_field_error(parent, key, item).map(|e| (path.clone(), e));
    }
    if field.is_list() {
        let Json::Array(elements) = item else {
            return Some((
                path.clone(),
                format!("expected a list, found {}", kind_of(item)),
            ));
        };
        for (i, element) in elements.iter().enumerate() {
            let len = path.len();
            path.push_str(&format!("[{i}]"));
            let found = locate_in_element(parent, field, key, element, path, true);
            path.truncate(len);
            if found.is_some() {
                return found;
            }
        }
        return single_field_error(parent, key, item).map(|e| (path.clone(), e));
    }
    locate_in_element(parent, field, key, item, path, false)
}

/// One value of a singular field, or one element of a repeated one.
fn locate_in_element(
    parent: &MessageDescriptor,
    field: &FieldDescriptor,
    key: &str,
    element: &Json,
    path: &mut String,
    in_list: bool,
) -> Option<(String, String)> {
    if let Kind::Message(m) = field.kind() {
        return locate_in_message(&m, element, path);
    }
    let probe = if in_list {
        Json::Array(vec![element.clone()])
    } else {
        element.clone()
    };
    single_field_error(parent, key, &probe)
        .map(|err| (path.clone(), describe_field(field, element, &err)))
}

/// Decodes `{key: item}` as `parent`, so the field is checked exactly as the full decode would.
fn single_field_error(parent: &MessageDescriptor, key: &str, item: &Json) -> Option<String> {
    let single = Json::Object([(key.to_owned(), item.clone())].into_iter().collect());
    DynamicMessage::deserialize(parent.clone(), &single)
        .err()
        .map(|err| err.to_string())
}

/// Messages whose proto-JSON form is not an object of their fields.
fn has_special_json_mapping(desc: &MessageDescriptor) -> bool {
    matches!(
        desc.full_name(),
        "google.protobuf.Duration"
            | "google.protobuf.Timestamp"
            | "google.protobuf.FieldMask"
            | "google.protobuf.Struct"
            | "google.protobuf.Value"
            | "google.protobuf.ListValue"
            | "google.protobuf.BoolValue"
            | "google.protobuf.BytesValue"
            | "google.protobuf.DoubleValue"
            | "google.protobuf.FloatValue"
            | "google.protobuf.Int32Value"
            | "google.protobuf.Int64Value"
            | "google.protobuf.StringValue"
            | "google.protobuf.UInt32Value"
            | "google.protobuf.UInt64Value"
    )
}

/// A scalar or enum field's value was rejected: say so in Envoy's terms where prost-reflect's
/// wording is too terse or serde-internal.
fn describe_field(field: &FieldDescriptor, value: &Json, err: &str) -> String {
    match field.kind() {
        Kind::Enum(e) => match value {
            Json::String(name) => {
                let names: Vec<String> = e.values().map(|v| v.name().to_owned()).collect();
                format!(
                    "unknown value {name:?} for enum {} (expected one of {})",
                    e.full_name(),
                    names.join(", ")
                )
            }
            Json::Number(n) => format!("{n} is not a valid enum number"),
            _ => format!("expected an enum name or number, found {}", kind_of(value)),
        },
        Kind::Message(m) => describe(&m, value, err),
        Kind::String => format!("expected a string, found {}", kind_of(value)),
        Kind::Bool => format!("expected true or false, found {}", kind_of(value)),
        Kind::Bytes => format!("expected base64-encoded bytes ({err})"),
        Kind::Double | Kind::Float => format!("expected a number, found {}", kind_of(value)),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => integer(value, "int32"),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => integer(value, "int64"),
        Kind::Uint32 | Kind::Fixed32 => integer(value, "uint32"),
        Kind::Uint64 | Kind::Fixed64 => integer(value, "uint64"),
    }
}

/// For fields of message types with a special JSON form (durations, wrappers, ...).
fn describe(desc: &MessageDescriptor, value: &Json, err: &str) -> String {
    match (desc.full_name(), value) {
        ("google.protobuf.Duration", Json::String(s)) => format!("invalid duration {s:?}"),
        ("google.protobuf.Duration", _) => format!(
            "expected a duration string such as \"1.5s\", found {}",
            kind_of(value)
        ),
        ("google.protobuf.Timestamp", Json::String(s)) => format!("invalid timestamp {s:?}"),
        ("google.protobuf.StringValue", _) => {
            format!("expected a string, found {}", kind_of(value))
        }
        ("google.protobuf.BoolValue", _) => {
            format!("expected true or false, found {}", kind_of(value))
        }
        ("google.protobuf.DoubleValue" | "google.protobuf.FloatValue", _) => {
            format!("expected a number, found {}", kind_of(value))
        }
        ("google.protobuf.Int32Value", _) => integer(value, "int32"),
        ("google.protobuf.Int64Value", _) => integer(value, "int64"),
        ("google.protobuf.UInt32Value", _) => integer(value, "uint32"),
        ("google.protobuf.UInt64Value", _) => integer(value, "uint64"),
        _ => format!("{err} (found {})", kind_of(value)),
    }
}

/// Proto-JSON integers may be numbers or decimal strings; tell range errors from type errors.
fn integer(value: &Json, type_name: &str) -> String {
    let numeric = match value {
        Json::Number(_) => true,
        Json::String(s) => s.trim().parse::<f64>().is_ok(),
        _ => false,
    };
    if numeric {
        format!("{} is not a valid {type_name}", kind_of(value))
    } else {
        format!(
            "expected an integer ({type_name}), found {}",
            kind_of(value)
        )
    }
}

fn kind_of(value: &Json) -> String {
    match value {
        Json::Null => "null".to_owned(),
        Json::Bool(b) => format!("boolean {b}"),
        Json::Number(n) => format!("number {n}"),
        Json::String(s) if s.chars().count() > 60 => "a string".to_owned(),
        Json::String(s) => format!("string {s:?}"),
        Json::Array(_) => "a list".to_owned(),
        Json::Object(_) => "an object".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
    use serde_json::json;

    const CLUSTER: &str = "envoy.config.cluster.v3.Cluster";
    const HCM: &str =
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";

    fn err<M: Message + Default + std::fmt::Debug>(name: &str, value: Json) -> String {
        from_json::<M>(name, &value).unwrap_err().to_string()
    }

    #[test]
    fn pool_has_what_envoy_configs_need() {
        let pool = pool().unwrap();
        for name in [
            "envoy.config.bootstrap.v3.Bootstrap",
            "google.protobuf.Any",
            "google.protobuf.Duration",
            "google.protobuf.FieldMask",
            "google.protobuf.Struct",
            "udpa.type.v1.TypedStruct",
            "xds.type.v3.TypedStruct",
            HCM,
        ] {
            assert!(pool.get_message_by_name(name).is_some(), "{name} missing");
        }
        // build.rs strips comments but must keep custom options (a future /config_dump
        // redaction reads `udpa.annotations.sensitive`).
        let key = pool
            .get_message_by_name("envoy.extensions.transport_sockets.tls.v3.TlsCertificate")
            .and_then(|m| m.get_field_by_name("private_key"))
            .unwrap();
        assert!(key
            .options()
            .extensions()
            .any(|(ext, _)| ext.full_name() == "udpa.annotations.sensitive"));
        assert!(pool
            .files()
            .all(|f| f.file_descriptor_proto().source_code_info.is_none()));
    }

    #[test]
    fn cluster_round_trip_in_config_dump_style() {
        let input = json!({
            "name": "outbound|80||web.default.svc.cluster.local",
            "type": "EDS",
            "connectTimeout": "1.5s",
            "edsClusterConfig": {"edsConfig": {"ads": {}, "resourceApiVersion": "V3"}},
            "lbPolicy": 1,
            "perConnectionBufferLimitBytes": 32768,
            "typedExtensionProtocolOptions": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicitHttpConfig": {"http2ProtocolOptions": {}}
                }
            },
            "metadata": {"filterMetadata": {"istio": {"services": [{"port": 80, "weight": 0.5}]}}}
        });
        let cluster: Cluster = from_json(CLUSTER, &input).unwrap();
        assert_eq!(cluster.name, "outbound|80||web.default.svc.cluster.local");
        assert_eq!(cluster.lb_policy, 1);
        let out = to_json(CLUSTER, &cluster).unwrap();
        assert_eq!(
            out,
            json!({
                "name": "outbound|80||web.default.svc.cluster.local",
                "type": "EDS",
                "connect_timeout": "1.500s",
                "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
                "lb_policy": "LEAST_REQUEST",
                "per_connection_buffer_limit_bytes": 32768,
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}}
                    }
                },
                "metadata": {"filter_metadata": {"istio": {"services": [{"port": 80, "weight": 0.5}]}}}
            })
        );
    }

    #[test]
    fn typed_struct_inside_any() {
        let input = json!({
            "name": "istio.stats",
            "typed_config": {
                "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
                "type_url": "type.googleapis.com/stats.PluginConfig",
                "value": {"disable_host_header_fallback": true}
            }
        });
        let name = "envoy.extensions.filters.network.http_connection_manager.v3.HttpFilter";
        let filter: envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpFilter =
            from_json(name, &input).unwrap();
        assert_eq!(to_json(name, &filter).unwrap(), input);
    }

    #[test]
    fn any_to_json_expands_with_type() {
        let hcm = HttpConnectionManager {
            stat_prefix: "ingress_http".into(),
            ..Default::default()
        };
        let any = Any {
            type_url: format!("type.googleapis.com/{HCM}"),
            value: hcm.encode_to_vec(),
        };
        assert_eq!(
            any_to_json(&any).unwrap(),
            json!({"@type": format!("type.googleapis.com/{HCM}"), "stat_prefix": "ingress_http"})
        );
        // Istio's own filter configs are in the pool now (build.rs); a type nobody ships is not.
        let unknown = Any {
            type_url: "type.googleapis.com/example.NotShipped".into(),
            value: vec![],
        };
        assert_eq!(
            any_to_json(&unknown).unwrap_err().to_string(),
            "unknown message type 'example.NotShipped'"
        );
    }

    #[test]
    fn to_json_names_the_unresolvable_any() {
        let input = json!({
            "name": "l",
            "filter_chains": [{"filters": [{"name": "hcm", "typed_config": {
                "@type": format!("type.googleapis.com/{HCM}"),
                "stat_prefix": "x"
            }}]}]
        });
        let name = "envoy.config.listener.v3.Listener";
        let mut listener: envoy_types::pb::envoy::config::listener::v3::Listener =
            from_json(name, &input).unwrap();
        if let Some(
            envoy_types::pb::envoy::config::listener::v3::filter::ConfigType::TypedConfig(any),
        ) = &mut listener.filter_chains[0].filters[0].config_type
        {
            any.type_url = "type.googleapis.com/istio.Unknown".into();
        }
        let err = to_json(name, &listener).unwrap_err();
        assert_eq!(err.path(), "filter_chains[0].filters[0].typed_config");
    }

    #[test]
    fn error_paths() {
        assert_eq!(
            err::<Cluster>(CLUSTER, json!({"name": "a", "connect_timeout": "5x"})),
            r#"connect_timeout: invalid duration "5x""#
        );
        assert_eq!(
            err::<Cluster>(CLUSTER, json!({"name": "a", "connect_timeout": 5})),
            r#"connect_timeout: expected a duration string such as "1.5s", found number 5"#
        );
        assert_eq!(
            err::<Cluster>(CLUSTER, json!({"name": "a", "lb_policy": "FASTEST"})),
            "lb_policy: unknown value \"FASTEST\" for enum envoy.config.cluster.v3.Cluster.LbPolicy \
             (expected one of ROUND_ROBIN, LEAST_REQUEST, RING_HASH, RANDOM, MAGLEV, CLUSTER_PROVIDED, LOAD_BALANCING_POLICY_CONFIG)"
        );
        assert_eq!(
            err::<Cluster>(
                CLUSTER,
                json!({"name": "a", "maxRequestsPerConnection": "one"})
            ),
            r#"max_requests_per_connection: expected an integer (uint32), found string "one""#
        );
        assert_eq!(
            err::<Cluster>(
                CLUSTER,
                json!({"name": "a", "type": "STATIC", "cluster_type": {"name": "x"}})
            ),
            "multiple fields provided for oneof 'cluster_discovery_type'"
        );
        assert_eq!(
            err::<Cluster>(CLUSTER, json!({"typed_extension_protocol_options": {"x": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {"max_concurrent_streams": -1}}
            }}})),
            "typed_extension_protocol_options[\"x\"].explicit_http_config.http2_protocol_options.max_concurrent_streams: number -1 is not a valid uint32"
        );
        assert_eq!(
            err::<Cluster>(
                CLUSTER,
                json!({"typed_extension_protocol_options": {"x": {"explicit_http_config": {}}}})
            ),
            r#"typed_extension_protocol_options["x"]: Any is missing "@type""#
        );
        assert_eq!(
            err::<Cluster>(
                CLUSTER,
                json!({"typed_extension_protocol_options": {"x": {"@type": "type.googleapis.com/nope.Nope"}}})
            ),
            r#"typed_extension_protocol_options["x"]: unknown type "type.googleapis.com/nope.Nope" in "@type""#
        );
        let route = "envoy.config.route.v3.RouteConfiguration";
        assert_eq!(
            err::<RouteConfiguration>(
                route,
                json!({"virtual_hosts": [{"name": "v", "domains": ["a", 7]}]})
            ),
            "virtual_hosts[0].domains[1]: expected a string, found number 7"
        );
        assert_eq!(
            err::<RouteConfiguration>(route, json!({"virtual_hosts": {"name": "v"}})),
            "virtual_hosts: expected a list, found an object"
        );
    }

    #[test]
    fn unknown_message_type() {
        assert_eq!(
            err::<Cluster>("envoy.config.cluster.v3.Clutser", json!({})),
            "unknown message type 'envoy.config.cluster.v3.Clutser'"
        );
    }
}
