//! `udpa.type.v1.TypedStruct` / `xds.type.v3.TypedStruct`: a filter config given as its type
//! URL and its fields in a `google.protobuf.Struct` (istiod wraps some of Istio's filters this
//! way). Here the Struct becomes the JSON a proto-JSON decoder reads.

use envoy_types::pb::google::protobuf::{value::Kind, Any, Struct, Value};
use prost::Message;
use serde_json::Value as Json;

#[derive(Clone, PartialEq, prost::Message)]
struct TypedStruct {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(message, optional, tag = "2")]
    value: Option<Struct>,
}

/// The wrapped config's fields as JSON; an error unless `a` is a TypedStruct.
pub fn value_json(a: &Any) -> Result<Json, String> {
    if !super::telemetry::TYPED_STRUCTS.contains(&a.type_url.as_str()) {
        return Err(format!("unexpected config type {}", a.type_url));
    }
    let ts = TypedStruct::decode(a.value.as_slice())
        .map_err(|e| format!("cannot decode {}: {e}", a.type_url))?;
    Ok(struct_json(&ts.value.unwrap_or_default()))
}

pub fn struct_json(s: &Struct) -> Json {
    Json::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value(v)))
            .collect(),
    )
}

fn value(v: &Value) -> Json {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Json::Null,
        Some(Kind::NumberValue(n)) => crate::protojson::number_to_json(*n),
        Some(Kind::StringValue(s)) => Json::String(s.clone()),
        Some(Kind::BoolValue(b)) => Json::Bool(*b),
        Some(Kind::StructValue(s)) => struct_json(s),
        Some(Kind::ListValue(l)) => Json::Array(l.values.iter().map(value).collect()),
    }
}

/// A TypedStruct (xds.type.v3) wrapping `json` as the config of `type_url`.
#[cfg(test)]
pub fn wrap_json(type_url: &str, json: &Json) -> Any {
    fn to_value(j: &Json) -> Value {
        let kind = match j {
            Json::Null => Kind::NullValue(0),
            Json::Bool(b) => Kind::BoolValue(*b),
            Json::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
            Json::String(s) => Kind::StringValue(s.clone()),
            Json::Array(a) => Kind::ListValue(envoy_types::pb::google::protobuf::ListValue {
                values: a.iter().map(to_value).collect(),
            }),
            Json::Object(o) => Kind::StructValue(Struct {
                fields: o.iter().map(|(k, v)| (k.clone(), to_value(v))).collect(),
            }),
        };
        Value { kind: Some(kind) }
    }
    let Kind::StructValue(s) = to_value(json).kind.unwrap_or(Kind::NullValue(0)) else {
        return Any::default();
    };
    Any {
        type_url: "type.googleapis.com/xds.type.v3.TypedStruct".into(),
        value: TypedStruct {
            type_url: type_url.into(),
            value: Some(s),
        }
        .encode_to_vec(),
    }
}
