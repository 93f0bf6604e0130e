//! Istio config in, xDS out: the file-fed control plane.
//!
//! `model` reads Istio and Kubernetes objects from YAML; `translate` turns them into the
//! listeners, routes, clusters and endpoint assignments istiod would send an ingress gateway
//! (pure, unit-tested, golden-tested); the ADS server and the directory watch serve the result.

pub mod authn;
pub mod authz;
pub mod model;
pub mod server;
pub mod translate;
pub mod validate;
pub mod watch;

use std::collections::BTreeMap;
use std::path::Path;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::google::protobuf::Any;

pub use model::{Invalid, Object};

/// The objects read from a config directory, in file order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Config {
    pub objects: Vec<Object>,
    /// The file each object came from (same index), for reports; may be shorter.
    pub files: Vec<String>,
}

impl Config {
    pub fn file_of(&self, i: usize) -> &str {
        self.files.get(i).map(String::as_str).unwrap_or("")
    }
}

/// Reads every `*.yaml`, `*.yml` and `*.json` file in `dir` (not recursive, sorted by name).
/// Objects that cannot be read are returned as `Invalid` and left out; an unreadable
/// directory is an error.
pub fn load_dir(dir: &Path) -> std::io::Result<(Config, Vec<Invalid>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && matches!(
                    p.extension().and_then(|e| e.to_str()),
                    Some("yaml" | "yml" | "json")
                )
        })
        .collect();
    files.sort();
    let mut config = Config::default();
    let mut invalid = Vec::new();
    for path in files {
        let shown = path.display().to_string();
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let (ok, bad) = model::parse_file(&shown, &text);
                config
                    .files
                    .extend(std::iter::repeat_n(shown.clone(), ok.len()));
                config.objects.extend(ok);
                invalid.extend(bad);
            }
            Err(e) => invalid.push(Invalid {
                file: shown,
                kind: "?".into(),
                name: "?".into(),
                reason: format!("cannot read: {e}"),
            }),
        }
    }
    Ok((config, invalid))
}

/// What the control plane knows about the proxy asking: its id and the metadata istio-agent
/// puts in the node (LABELS select the Gateways; NAMESPACE scopes short host names).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeInfo {
    pub id: String,
    pub labels: BTreeMap<String, String>,
    pub namespace: Option<String>,
}

impl NodeInfo {
    pub fn from_node(node: &Node) -> NodeInfo {
        use envoy_types::pb::google::protobuf::value::Kind;
        let field = |k: &str| node.metadata.as_ref().and_then(|m| m.fields.get(k));
        let labels = match field("LABELS").and_then(|v| v.kind.as_ref()) {
            Some(Kind::StructValue(s)) => s
                .fields
                .iter()
                .filter_map(|(k, v)| match &v.kind {
                    Some(Kind::StringValue(s)) => Some((k.clone(), s.clone())),
                    _ => None,
                })
                .collect(),
            _ => BTreeMap::new(),
        };
        let namespace = match field("NAMESPACE").and_then(|v| v.kind.as_ref()) {
            Some(Kind::StringValue(s)) => Some(s.clone()),
            // istio-agent's node id is type~ip~pod.namespace~namespace.svc.cluster.local.
            _ => node
                .id
                .split('~')
                .nth(2)
                .and_then(|p| p.rsplit_once('.'))
                .map(|(_, ns)| ns.to_string()),
        };
        NodeInfo {
            id: node.id.clone(),
            labels,
            namespace,
        }
    }
}

/// The xDS for one gateway, by type then resource name. Names sort, so output is stable.
#[derive(Clone, Default, PartialEq)]
pub struct Xds {
    pub listeners: BTreeMap<String, Any>,
    pub routes: BTreeMap<String, Any>,
    pub clusters: BTreeMap<String, Any>,
    pub endpoints: BTreeMap<String, Any>,
    /// SDS secrets (`kubernetes://<name>`): private keys, so Debug shows names only.
    pub secrets: BTreeMap<String, Any>,
}

impl std::fmt::Debug for Xds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = |m: &BTreeMap<String, Any>| m.keys().cloned().collect::<Vec<_>>();
        f.debug_struct("Xds")
            .field("listeners", &names(&self.listeners))
            .field("routes", &names(&self.routes))
            .field("clusters", &names(&self.clusters))
            .field("endpoints", &names(&self.endpoints))
            .field("secrets", &names(&self.secrets))
            .finish()
    }
}

impl Xds {
    /// The resources of one xDS type URL (LDS, RDS, CDS, EDS, SDS), or None for other types.
    pub fn by_type(&self, type_url: &str) -> Option<&BTreeMap<String, Any>> {
        use crate::xds::types;
        match type_url {
            types::LISTENER => Some(&self.listeners),
            types::ROUTE => Some(&self.routes),
            types::CLUSTER => Some(&self.clusters),
            types::ENDPOINT => Some(&self.endpoints),
            types::SECRET => Some(&self.secrets),
            _ => None,
        }
    }
}

/// Options that are the control plane's, not the config's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// The address gateway listeners bind (istiod: 0.0.0.0). The listener names keep
    /// istiod's `0.0.0.0_<port>` form either way.
    pub bind_address: String,
    /// The cluster domain for short host names (`reviews` -> `reviews.<ns>.svc.<domain>`).
    pub domain: String,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            bind_address: "0.0.0.0".into(),
            domain: "cluster.local".into(),
        }
    }
}

/// The xDS istiod would send the gateway `node` for `config`, and every object left out with
/// the reason (file, kind, name, field).
pub fn translate(config: &Config, node: &NodeInfo, options: &Options) -> (Xds, Vec<Invalid>) {
    translate::translate(config, node, options)
}
