//! `/config_dump?resource=&mask=&name_regex=`: the dump narrowed as Envoy narrows it.
//!
//! - `resource=<field>`: the items of that repeated field of whichever config has it, each
//!   with its own `@type` (`...ClustersConfigDump.DynamicCluster`); 404 when no config has
//!   it, 400 when it is not repeated.
//! - `mask=<path>[,<path>...]`: a FieldMask, applied to each item (with `resource`) or to each
//!   top-level config (configs it cannot apply to are left out; 400 when it applies to none).
//!   A path goes through singular message fields only, and into `Any`s (as Envoy's).
//! - `name_regex=<re>`: only resources whose name matches the whole regex.
//!
//! Configs left empty are left out, and an empty dump is `{}`, as Envoy's.

use prost_reflect::{Cardinality, Kind, MessageDescriptor};
use serde_json::{Map, Value};

/// A narrowing that cannot be done: Envoy's status and message.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    pub status: u16,
    pub message: String,
}

fn refused(status: u16, message: String) -> Refused {
    Refused { status, message }
}

#[derive(Debug, Default)]
pub struct Narrow {
    pub resource: Option<String>,
    pub mask: Vec<Vec<String>>,
    pub name_regex: Option<regex::Regex>,
}

impl Narrow {
    pub fn from_params(params: &[(String, String)]) -> Result<Narrow, Refused> {
        let mut n = Narrow::default();
        for (k, v) in params {
            match k.as_str() {
                "resource" => n.resource = Some(v.clone()),
                "mask" => {
                    n.mask = v
                        .split(',')
                        .filter(|p| !p.is_empty())
                        .map(|p| p.split('.').map(str::to_string).collect())
                        .collect()
                }
                "name_regex" if !v.is_empty() => {
                    let re = regex::Regex::new(&format!("^(?:{v})$")).map_err(|e| {
                        refused(400, format!("Error while parsing name_regex from {v}: {e}"))
                    })?;
                    n.name_regex = Some(re);
                }
                _ => {}
            }
        }
        Ok(n)
    }

    pub fn is_empty(&self) -> bool {
        self.resource.is_none() && self.mask.is_empty() && self.name_regex.is_none()
    }

    /// `dump` (`{"configs": [...]}`) narrowed.
    pub fn apply(&self, dump: Value) -> Result<Value, Refused> {
        let configs = match dump {
            Value::Object(mut o) => match o.remove("configs") {
                Some(Value::Array(a)) => a,
                _ => Vec::new(),
            },
            _ => Vec::new(),
        };
        let out = match &self.resource {
            Some(field) => self.resource_items(configs, field)?,
            None => self.whole_configs(configs)?,
        };
        if out.is_empty() {
            return Ok(Value::Object(Map::new()));
        }
        Ok(serde_json::json!({ "configs": out }))
    }

    fn resource_items(&self, configs: Vec<Value>, field: &str) -> Result<Vec<Value>, Refused> {
        let Some(config) = configs
            .into_iter()
            .find(|c| c.get(field).is_some() || declares(c, field))
        else {
            return Err(refused(404, format!("{field} not found in config dump")));
        };
        let parent = type_name(&config).unwrap_or_default().to_string();
        let item_type = item_type(&parent, field).ok_or_else(|| {
            refused(
                400,
                format!(
                    "{field} is not a repeated field. Use ?mask={field} to get only this field"
                ),
            )
        })?;
        let desc = crate::protojson::message_descriptor(&item_type).ok();
        if let Some(d) = &desc {
            if let Some(bad) = self.mask.iter().find(|p| !valid_path(d, p)) {
                return Err(refused(
                    400,
                    format!(
                        "FieldMask path '{}' is not valid for {item_type}",
                        bad.join(".")
                    ),
                ));
            }
        }
        let items = match config {
            Value::Object(mut o) => match o.remove(field) {
                Some(Value::Array(a)) => a,
                _ => Vec::new(),
            },
            _ => Vec::new(),
        };
        Ok(items
            .into_iter()
            .filter(|i| self.name_matches(i))
            .map(|i| {
                let mut typed = Map::new();
                typed.insert(
                    "@type".into(),
                    Value::String(format!("type.googleapis.com/{item_type}")),
                );
                if let Value::Object(o) = i {
                    typed.extend(o);
                }
                let typed = Value::Object(typed);
                if self.mask.is_empty() {
                    typed
                } else {
                    trim(&typed, &self.mask)
                }
            })
            .collect())
    }

    fn whole_configs(&self, configs: Vec<Value>) -> Result<Vec<Value>, Refused> {
        let mut out = Vec::new();
        let mut applied = false;
        for mut c in configs {
            if self.name_regex.is_some() {
                if let Value::Object(o) = &mut c {
                    for (k, v) in o.iter_mut() {
                        if !is_resource_list(k) {
                            continue;
                        }
                        if let Value::Array(items) = v {
                            items.retain(|i| self.name_matches(i));
                        }
                    }
                    o.retain(|_, v| !matches!(v, Value::Array(a) if a.is_empty()));
                }
            }
            if self.mask.is_empty() {
                out.push(c);
                continue;
            }
            let desc = type_name(&c).and_then(|t| crate::protojson::message_descriptor(t).ok());
            let Some(desc) = desc else { continue };
            if !self.mask.iter().all(|p| valid_path(&desc, p)) {
                continue;
            }
            applied = true;
            let t = trim(&c, &self.mask);
            // A config the mask left nothing of (beyond its type) is left out.
            if t.as_object().is_some_and(|o| o.len() > 1) {
                out.push(t);
            }
        }
        if !self.mask.is_empty() && !applied {
            let mask: Vec<String> = self.mask.iter().map(|p| p.join(".")).collect();
            return Err(refused(
                400,
                format!(
                    "FieldMask {} could not be successfully applied to any configs.",
                    mask.join(",")
                ),
            ));
        }
        Ok(out)
    }

    fn name_matches(&self, item: &Value) -> bool {
        let Some(re) = &self.name_regex else {
            return true;
        };
        resource_name(item).is_some_and(|n| re.is_match(n))
    }
}

fn type_name(v: &Value) -> Option<&str> {
    v.get("@type")?
        .as_str()?
        .strip_prefix("type.googleapis.com/")
}

/// The config's message declares `field` (an empty repeated field is not rendered).
fn declares(config: &Value, field: &str) -> bool {
    type_name(config)
        .and_then(|t| crate::protojson::message_descriptor(t).ok())
        .is_some_and(|d| d.get_field_by_name(field).is_some())
}

/// The repeated resource fields of the dump's configs, and their items' message names.
const ITEMS: &[(&str, &str)] = &[
    ("static_clusters", "StaticCluster"),
    ("dynamic_active_clusters", "DynamicCluster"),
    ("dynamic_warming_clusters", "DynamicCluster"),
    ("static_listeners", "StaticListener"),
    ("dynamic_listeners", "DynamicListener"),
    ("static_route_configs", "StaticRouteConfig"),
    ("dynamic_route_configs", "DynamicRouteConfig"),
    ("inline_scoped_route_configs", "InlineScopedRouteConfigs"),
    ("dynamic_scoped_route_configs", "DynamicScopedRouteConfigs"),
    ("static_secrets", "StaticSecret"),
    ("dynamic_active_secrets", "DynamicSecret"),
    ("dynamic_warming_secrets", "DynamicSecret"),
    ("static_endpoint_configs", "StaticEndpointConfig"),
    ("dynamic_endpoint_configs", "DynamicEndpointConfig"),
    ("ecds_filters", "EcdsFilterConfig"),
];

fn is_resource_list(field: &str) -> bool {
    ITEMS.iter().any(|(f, _)| *f == field)
}

/// `envoy.admin.v3.ClustersConfigDump` + `dynamic_active_clusters` ->
/// `envoy.admin.v3.ClustersConfigDump.DynamicCluster`; None for a field that is not a list of
/// resources.
fn item_type(parent: &str, field: &str) -> Option<String> {
    let (_, item) = ITEMS.iter().find(|(f, _)| *f == field)?;
    Some(format!("{parent}.{item}"))
}

/// A resource's name: its own `name`, or its payload's (`cluster.name`,
/// `route_config.name`, `endpoint_config.cluster_name`, `active_state.listener.name`).
fn resource_name(item: &Value) -> Option<&str> {
    if let Some(n) = item.get("name").and_then(Value::as_str) {
        return Some(n);
    }
    let o = item.as_object()?;
    o.values().find_map(|v| {
        v.get("name")
            .or_else(|| v.get("cluster_name"))
            .and_then(Value::as_str)
    })
}

/// Whether `path` names a field of `desc` through singular message fields (or into an
/// `Any`, whose contents are not known here).
fn valid_path(desc: &MessageDescriptor, path: &[String]) -> bool {
    let mut d = desc.clone();
    for (i, part) in path.iter().enumerate() {
        let Some(f) = d.get_field_by_name(part) else {
            return false;
        };
        if i + 1 == path.len() {
            return true;
        }
        if f.cardinality() == Cardinality::Repeated || f.is_map() {
            return false;
        }
        match f.kind() {
            Kind::Message(m) if m.full_name() == "google.protobuf.Any" => return true,
            Kind::Message(m) => d = m,
            _ => return false,
        }
    }
    true
}

/// `v` with only the mask's paths (and every `@type` on the way).
fn trim(v: &Value, mask: &[Vec<String>]) -> Value {
    let Some(o) = v.as_object() else {
        return v.clone();
    };
    let mut out = Map::new();
    if let Some(t) = o.get("@type") {
        out.insert("@type".into(), t.clone());
    }
    for path in mask {
        let Some((head, rest)) = path.split_first() else {
            continue;
        };
        let Some(child) = o.get(head) else { continue };
        let value = if rest.is_empty() {
            child.clone()
        } else {
            let sub = trim(child, &[rest.to_vec()]);
            match (out.get_mut(head), sub) {
                (Some(Value::Object(have)), Value::Object(more)) => {
                    have.extend(more);
                    continue;
                }
                (_, sub) => sub,
            }
        };
        out.insert(head.clone(), value);
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn dump() -> Value {
        json!({"configs": [
            {"@type": "type.googleapis.com/envoy.admin.v3.BootstrapConfigDump",
             "bootstrap": {"node": {"id": "n", "cluster": "c"}}},
            {"@type": "type.googleapis.com/envoy.admin.v3.ClustersConfigDump",
             "version_info": "1",
             "static_clusters": [{"cluster": {"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", "name": "xds-grpc"}}],
             "dynamic_active_clusters": [
                {"version_info": "1", "cluster": {"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", "name": "alpha", "type": "EDS"}},
                {"version_info": "1", "cluster": {"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", "name": "beta", "type": "EDS"}}
             ]},
            {"@type": "type.googleapis.com/envoy.admin.v3.ListenersConfigDump",
             "version_info": "1",
             "dynamic_listeners": [{"name": "0.0.0.0_80", "active_state": {"version_info": "1", "listener": {"name": "0.0.0.0_80"}}}]}
        ]})
    }

    fn narrow(q: &str) -> Result<Value, Refused> {
        Narrow::from_params(&crate::admin::params(q))?.apply(dump())
    }

    #[test]
    fn resource_items_are_typed_and_filtered_by_whole_name() {
        let v = narrow("resource=dynamic_active_clusters&name_regex=alpha").expect("ok");
        let c = v["configs"].as_array().expect("configs");
        assert_eq!(c.len(), 1);
        assert_eq!(
            c[0]["@type"],
            "type.googleapis.com/envoy.admin.v3.ClustersConfigDump.DynamicCluster"
        );
        assert_eq!(
            narrow("resource=dynamic_active_clusters&name_regex=alp").expect("ok"),
            json!({})
        );
        let v = narrow("resource=dynamic_active_clusters&mask=cluster.name").expect("ok");
        assert_eq!(
            v["configs"][1],
            json!({"@type": "type.googleapis.com/envoy.admin.v3.ClustersConfigDump.DynamicCluster",
                   "cluster": {"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", "name": "beta"}})
        );
    }

    #[test]
    fn refusals_as_envoy_words_them() {
        assert_eq!(
            narrow("resource=nothing").err().map(|r| r.status),
            Some(404)
        );
        let r = narrow("resource=bootstrap").err().expect("refused");
        assert_eq!(
            (r.status, r.message.as_str()),
            (
                400,
                "bootstrap is not a repeated field. Use ?mask=bootstrap to get only this field"
            )
        );
        assert_eq!(
            narrow("mask=dynamic_active_clusters.cluster.name")
                .err()
                .map(|r| r.status),
            Some(400)
        );
        assert_eq!(
            narrow("resource=dynamic_listeners&mask=nope")
                .err()
                .map(|r| r.status),
            Some(400)
        );
    }

    #[test]
    fn masks_and_regexes_over_whole_configs() {
        let v = narrow("mask=static_clusters").expect("ok");
        let c = v["configs"].as_array().expect("configs");
        assert_eq!(c.len(), 1);
        assert!(c[0].get("dynamic_active_clusters").is_none());
        let v = narrow("mask=bootstrap.node.id").expect("ok");
        assert_eq!(v["configs"][0]["bootstrap"], json!({"node": {"id": "n"}}));
        let v = narrow("name_regex=beta").expect("ok");
        let c = v["configs"].as_array().expect("configs");
        assert_eq!(c.len(), 3);
        assert!(c[1].get("static_clusters").is_none());
        assert_eq!(
            c[1]["dynamic_active_clusters"].as_array().map(Vec::len),
            Some(1)
        );
        assert!(c[2].get("dynamic_listeners").is_none());
    }
}
