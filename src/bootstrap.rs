//! Envoy v3 bootstrap files (YAML or JSON) -> the settings Portico starts from.
//!
//! The file is decoded with the full Envoy schema, so unknown fields and malformed values are
//! errors, as they are for Envoy. Fields that are valid Envoy but that Portico does not implement
//! are reported once per path in [`Bootstrap::warnings`]: an istio-agent bootstrap carries many
//! (stats tags, runtime layers, tracing) and must still load.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap as BootstrapProto;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{ClusterDiscoveryType, DiscoveryType};
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::api_config_source::ApiType;
use envoy_types::pb::envoy::config::core::v3::config_source::ConfigSourceSpecifier;
use envoy_types::pb::envoy::config::core::v3::grpc_service::TargetSpecifier;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::core::v3::{ConfigSource, SocketAddress};
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::google::protobuf::{value::Kind as StructKind, Struct, Value as StructValue};
use prost_reflect::{DynamicMessage, Value as ReflectValue};
use serde_json::{Map, Value as Json};

use crate::protojson::{self, ProtoJsonError};

const BOOTSTRAP_TYPE: &str = "envoy.config.bootstrap.v3.Bootstrap";

/// The syntax of a bootstrap file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Yaml,
    Json,
}

impl Format {
    /// The format implied by the file extension, as Envoy decides it; None when the extension
    /// says nothing (then [`load`] tries JSON, then YAML).
    pub fn from_path(path: &Path) -> Option<Format> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "yaml" | "yml" => Some(Format::Yaml),
            "json" => Some(Format::Json),
            _ => None,
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Yaml => "YAML",
            Format::Json => "JSON",
        })
    }
}

/// A loaded bootstrap: the full proto (for the parts later translated elsewhere, e.g. static
/// listeners and clusters) plus the settings Portico acts on directly.
#[derive(Debug, Clone)]
pub struct Bootstrap {
    pub proto: BootstrapProto,
    pub node: Node,
    /// None when the bootstrap has no admin section or no address in it (no admin listener).
    pub admin_address: Option<SocketAddr>,
    pub ads: Option<AdsConfig>,
    pub lds_via_ads: bool,
    pub cds_via_ads: bool,
    /// One per distinct path of a field that is set but not implemented, in field-number order.
    pub warnings: Vec<String>,
}

/// The identity sent to the control plane in every DiscoveryRequest.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Node {
    pub id: String,
    pub cluster: String,
    /// `node.metadata` as JSON (istiod reads ISTIO_VERSION, LABELS, ... from it).
    pub metadata: Map<String, Json>,
    pub locality: Option<Locality>,
    pub user_agent_name: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Locality {
    pub region: String,
    pub zone: String,
    pub sub_zone: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdsConfig {
    /// The static cluster the ADS stream connects to.
    pub cluster_name: String,
    pub set_node_on_first_message_only: bool,
    /// `api_type: DELTA_GRPC` (incremental xDS, istio-agent's default since Istio 1.22)
    /// rather than GRPC (state of the world).
    pub delta: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("cannot read bootstrap file {}: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    /// The text is not YAML/JSON at all.
    #[error("{}bootstrap is not valid {format}: {message}", file_prefix(file))]
    Syntax {
        file: Option<PathBuf>,
        format: Format,
        message: String,
    },
    /// The document does not fit the Envoy schema, or uses it in a way Portico rejects.
    /// `path` is the field path ("" for the whole document).
    #[error("{}{}", file_prefix(file), at(path, message))]
    Invalid {
        file: Option<PathBuf>,
        path: String,
        message: String,
    },
}

impl BootstrapError {
    /// The field path the error is about, if it is about one.
    pub fn field_path(&self) -> Option<&str> {
        match self {
            BootstrapError::Invalid { path, .. } if !path.is_empty() => Some(path),
            _ => None,
        }
    }

    fn with_file(mut self, path: &Path) -> Self {
        match &mut self {
            BootstrapError::Syntax { file, .. } | BootstrapError::Invalid { file, .. } => {
                *file = Some(path.to_owned());
            }
            BootstrapError::Read { .. } => {}
        }
        self
    }
}

impl From<ProtoJsonError> for BootstrapError {
    fn from(err: ProtoJsonError) -> Self {
        BootstrapError::Invalid {
            file: None,
            path: err.path().to_owned(),
            message: err.reason(),
        }
    }
}

fn file_prefix(file: &Option<PathBuf>) -> String {
    file.as_ref()
        .map(|f| format!("{}: ", f.display()))
        .unwrap_or_default()
}

fn at(path: &str, message: &str) -> String {
    if path.is_empty() {
        message.to_owned()
    } else {
        format!("{path}: {message}")
    }
}

fn invalid(path: impl Into<String>, message: impl Into<String>) -> BootstrapError {
    BootstrapError::Invalid {
        file: None,
        path: path.into(),
        message: message.into(),
    }
}

/// Reads and checks the bootstrap at `path`; the format follows the extension, and for other
/// extensions JSON is tried first, then YAML.
pub fn load(path: &Path) -> Result<Bootstrap, BootstrapError> {
    let text = std::fs::read_to_string(path).map_err(|error| BootstrapError::Read {
        path: path.to_owned(),
        error,
    })?;
    let result = match Format::from_path(path) {
        Some(format) => parse(&text, format),
        // Envoy reads any file not named .yaml/.yml as JSON.
        None => parse(&text, Format::Json),
    };
    let bootstrap = result.map_err(|e| e.with_file(path))?;
    tracing::debug!(
        file = %path.display(),
        warnings = bootstrap.warnings.len(),
        "loaded bootstrap"
    );
    Ok(bootstrap)
}

/// Parses and checks bootstrap text. Warnings are returned, not logged: the caller decides how
/// to show them (`--mode validate` prints them, the server logs them).
pub fn parse(text: &str, format: Format) -> Result<Bootstrap, BootstrapError> {
    // One descriptor pool for the whole parse; it is dropped (and its memory freed) after.
    let _pool = crate::protojson::pool().map_err(|e| invalid("", e.to_string()))?;
    let syntax = |message: String| BootstrapError::Syntax {
        file: None,
        format,
        message,
    };
    let value = match format {
        Format::Json => serde_json::from_str::<Json>(text).map_err(|e| syntax(e.to_string()))?,
        Format::Yaml => {
            // Merge keys are not applied: Envoy 1.40 reports `<<` as an unknown field.
            let yaml: serde_yaml::Value =
                serde_yaml::from_str(text).map_err(|e| syntax(e.to_string()))?;
            serde_json::to_value(yaml).map_err(|e| syntax(e.to_string()))?
        }
    };
    from_value(value, None)
}

/// As [`load`], with Envoy's `--config-yaml` merged over the file: both are read as
/// Bootstrap protos and the second is merged into the first with protobuf's merge (set
/// scalars replace, messages merge field by field, repeated fields append, a oneof takes the
/// override's member), as Envoy's `MergeFrom` does.
pub fn load_with_override(path: &Path, config_yaml: &str) -> Result<Bootstrap, BootstrapError> {
    load_with(path, Some(config_yaml), false)
}

/// As [`load_with_override`] (`config_yaml` None or blank: none), and with Envoy's
/// `--allow-unknown-static-fields` when `allow_unknown` is set: fields the schema does not
/// know, in the file or the override, are dropped with a warning naming each, instead of
/// refusing the bootstrap. pilot-agent always passes the flag.
pub fn load_with(
    path: &Path,
    config_yaml: Option<&str>,
    allow_unknown: bool,
) -> Result<Bootstrap, BootstrapError> {
    let config_yaml = config_yaml.filter(|y| !y.trim().is_empty());
    if config_yaml.is_none() && !allow_unknown {
        return load(path);
    }
    let text = std::fs::read_to_string(path).map_err(|error| BootstrapError::Read {
        path: path.to_owned(),
        error,
    })?;
    let format = Format::from_path(path).unwrap_or(Format::Json);
    let _pool = crate::protojson::pool().map_err(|e| invalid("", e.to_string()))?;
    let yaml = |text: &str, format| -> Result<Json, BootstrapError> {
        let syntax = |message: String| BootstrapError::Syntax {
            file: None,
            format,
            message,
        };
        let yaml: serde_yaml::Value =
            serde_yaml::from_str(text).map_err(|e| syntax(e.to_string()))?;
        serde_json::to_value(yaml).map_err(|e| syntax(e.to_string()))
    };
    let mut base = match format {
        Format::Json => {
            serde_json::from_str::<Json>(&text).map_err(|e| BootstrapError::Syntax {
                file: Some(path.to_owned()),
                format,
                message: e.to_string(),
            })?
        }
        Format::Yaml => yaml(&text, format).map_err(|e| e.with_file(path))?,
    };
    let mut unknown = Vec::new();
    if allow_unknown {
        unknown = protojson::strip_unknown_fields(BOOTSTRAP_TYPE, &mut base)?;
    }
    // JSON is YAML: Envoy reads the flag's text as YAML whatever it holds.
    let mut over = match config_yaml {
        Some(y) => yaml(y, Format::Yaml)?,
        None => Json::Null,
    };
    if allow_unknown && !over.is_null() {
        let dropped = protojson::strip_unknown_fields(BOOTSTRAP_TYPE, &mut over)?;
        unknown.extend(dropped.into_iter().map(|p| format!("--config-yaml {p}")));
    }
    let over = match over {
        Json::Null => None,
        over => Some(protojson::dynamic_from_json(BOOTSTRAP_TYPE, &over)?),
    };
    let mut b = from_value(base, over).map_err(|e| e.with_file(path))?;
    // Envoy logs these as warnings and goes on.
    b.warnings.splice(
        0..0,
        unknown
            .into_iter()
            .map(|p| format!("{p}: unknown field, ignored (--allow-unknown-static-fields)")),
    );
    Ok(b)
}

fn from_value(
    value: Json,
    over: Option<prost_reflect::DynamicMessage>,
) -> Result<Bootstrap, BootstrapError> {
    if value.is_null() {
        return Err(invalid("", "bootstrap is empty"));
    }
    let mut dynamic = protojson::dynamic_from_json(BOOTSTRAP_TYPE, &value)?;
    if let Some(over) = over {
        use prost::Message;
        dynamic
            .merge(over.encode_to_vec().as_slice())
            .map_err(|e| invalid("", format!("cannot merge --config-yaml: {e}")))?;
    }
    let proto: BootstrapProto = dynamic.transcode_to().map_err(|e| {
        invalid(
            "",
            format!("decoded bootstrap does not match the generated {BOOTSTRAP_TYPE}: {e}"),
        )
    })?;
    let warnings = unimplemented_fields(&dynamic);

    let admin_address = admin_address(&proto)?;
    let cluster_names = check_clusters(&proto)?;
    let (ads, lds_via_ads, cds_via_ads) = dynamic_resources(&proto, &cluster_names)?;

    Ok(Bootstrap {
        node: node(&proto),
        admin_address,
        ads,
        lds_via_ads,
        cds_via_ads,
        warnings,
        proto,
    })
}

// ---------------------------------------------------------------------------------------------
// What Portico implements. Fields not named here are warned about when set.

#[derive(Clone, Copy)]
enum Rule {
    /// Implemented (or checked elsewhere, like static listeners): accept the whole subtree.
    Accept,
    /// Only the named fields are implemented; look at each.
    Fields(&'static [(&'static str, Rule)]),
}

use Rule::{Accept, Fields};

const BOOTSTRAP_RULE: Rule = Fields(&[
    // The tag rules name Envoy's own stats in Prometheus (`admin::stats::TagRules`).
    (
        "stats_config",
        Fields(&[
            ("stats_tags", Accept),
            ("use_all_default_tags", Accept),
            // Which stats exist (`admin::stats::StatsMatcher`).
            ("stats_matcher", Accept),
        ]),
    ),
    (
        "node",
        Fields(&[
            ("id", Accept),
            ("cluster", Accept),
            ("metadata", Accept),
            ("locality", Accept),
            ("user_agent_name", Accept),
        ]),
    ),
    (
        "admin",
        Fields(&[
            ("address", Accept),
            // Written per admin request (`admin::access_logs`).
            ("access_log", Accept),
            ("access_log_path", Accept),
            // Envoy's CPU profiler output (`/cpuprofiler`, which Portico has not): no effect
            // on traffic, so istio-agent's path is not worth a warning.
            ("profile_path", Accept),
        ]),
    ),
    (
        "static_resources",
        Fields(&[
            ("clusters", CLUSTER_RULE),
            // The gateway's listener translation validates listeners and warns itself.
            ("listeners", Accept),
        ]),
    ),
    (
        "dynamic_resources",
        Fields(&[
            ("ads_config", Accept),
            ("lds_config", Accept),
            ("cds_config", Accept),
        ]),
    ),
    // The default tracer driver (translated by the server, `telemetry::trace`).
    ("tracing", Fields(&[("http", Accept)])),
    // The global downstream connection limit; anything else in it is refused by the server.
    ("overload_manager", Accept),
    // Checked by the server (`bootstrap_extensions`): the two istio-agent writes.
    ("bootstrap_extensions", Accept),
    // Static and admin layers (`/runtime`, `/runtime_modify`); the server refuses the others.
    ("layered_runtime", Accept),
    // statsd over UDP is flushed; the other sinks are accepted without effect, with a
    // warning (`admin::sinks`).
    ("stats_sinks", Accept),
    ("stats_flush_interval", Accept),
    ("stats_flush_on_admin", Accept),
    ("stats_eviction_interval", Accept),
    // Envoy's own log line format (as `--log-format`): Portico keeps its own lines.
    ("application_log_config", Accept),
    // Envoy's lazy creation of stats and of per-worker cluster state: memory tuning Portico
    // has no counterpart of (its per-cluster state is built with the snapshot).
    ("deferred_stat_options", Accept),
    (
        "cluster_manager",
        Fields(&[
            ("enable_deferred_cluster_creation", Accept),
            // Envoy's ejection event file (istio-agent: /dev/stdout). Portico does not write
            // it; ejections are counted on /stats (`outlier_detection.ejections_*`) and shown
            // on /clusters. A diagnostic only: routing is unchanged.
            ("outlier_detection", Accept),
        ]),
    ),
]);

const CLUSTER_RULE: Rule = Fields(&[
    ("name", Accept),
    ("type", Accept),
    ("connect_timeout", Accept),
    ("lb_policy", Accept),
    (
        "load_assignment",
        Fields(&[
            ("cluster_name", Accept),
            (
                "endpoints",
                Fields(&[
                    ("locality", Accept),
                    ("load_balancing_weight", Accept),
                    (
                        "lb_endpoints",
                        Fields(&[
                            (
                                "endpoint",
                                Fields(&[(
                                    "address",
                                    Fields(&[
                                        (
                                            "socket_address",
                                            Fields(&[("address", Accept), ("port_value", Accept)]),
                                        ),
                                        // Dialled by the ADS and SDS clients (istio-agent's
                                        // xds-grpc and sds-grpc); not by the HTTP data path.
                                        ("pipe", Accept),
                                    ]),
                                )]),
                            ),
                            ("load_balancing_weight", Accept),
                            ("health_status", Accept),
                        ]),
                    ),
                ]),
            ),
        ]),
    ),
    ("eds_cluster_config", Accept),
    ("typed_extension_protocol_options", Accept),
    ("http2_protocol_options", Accept),
    ("dns_lookup_family", Accept),
    ("respect_dns_ttl", Accept),
    ("dns_refresh_rate", Accept),
    // Accepted now, implemented by later work; warning about them would be noise.
    ("upstream_connection_options", Accept),
    ("circuit_breakers", Accept),
    ("max_requests_per_connection", Accept),
    // Translated (or refused field by field) with the cluster.
    ("health_checks", Accept),
    ("transport_socket", Accept),
    ("alt_stat_name", Accept),
]);

/// Warnings for every set field outside the implemented subset, one per path with list and
/// map positions collapsed to `[*]`, so N clusters with circuit breakers warn once.
fn unimplemented_fields(bootstrap: &DynamicMessage) -> Vec<String> {
    let mut seen = HashSet::new();
    let mut warnings = Vec::new();
    walk(
        bootstrap,
        BOOTSTRAP_RULE,
        &mut String::new(),
        &mut seen,
        &mut warnings,
    );
    warnings
}

fn walk(
    msg: &DynamicMessage,
    rule: Rule,
    path: &mut String,
    seen: &mut HashSet<String>,
    warnings: &mut Vec<String>,
) {
    let Fields(allowed) = rule else {
        return;
    };
    for (field, value) in msg.fields() {
        let len = path.len();
        if !path.is_empty() {
            path.push('.');
        }
        path.push_str(field.name());
        match allowed.iter().find(|(name, _)| *name == field.name()) {
            None => {
                if seen.insert(path.clone()) {
                    warnings.push(format!(
                        "bootstrap field '{path}' is not implemented by Portico and is ignored"
                    ));
                }
            }
            Some((_, Accept)) => {}
            Some((_, sub @ Fields(_))) => match value {
                ReflectValue::Message(m) => walk(m, *sub, path, seen, warnings),
                ReflectValue::List(items) => {
                    path.push_str("[*]");
                    for item in items {
                        if let ReflectValue::Message(m) = item {
                            walk(m, *sub, path, seen, warnings);
                        }
                    }
                }
                ReflectValue::Map(entries) => {
                    path.push_str("[*]");
                    for item in entries.values() {
                        if let ReflectValue::Message(m) = item {
                            walk(m, *sub, path, seen, warnings);
                        }
                    }
                }
                // A rule with sub-fields on a scalar is a table mistake; nothing to walk.
                _ => {}
            },
        }
        path.truncate(len);
    }
}

// ---------------------------------------------------------------------------------------------
// Semantic checks: what the schema allows but Portico cannot run.

fn admin_address(proto: &BootstrapProto) -> Result<Option<SocketAddr>, BootstrapError> {
    let Some(address) = proto.admin.as_ref().and_then(|a| a.address.as_ref()) else {
        return Ok(None);
    };
    match &address.address {
        Some(AddressKind::SocketAddress(sa)) => {
            let path = "admin.address.socket_address";
            let ip: IpAddr = sa.address.parse().map_err(|_| {
                invalid(
                    format!("{path}.address"),
                    format!("{:?} is not an IP address", sa.address),
                )
            })?;
            let port = match sa.port_specifier {
                Some(PortSpecifier::PortValue(port)) => port,
                Some(PortSpecifier::NamedPort(_)) => {
                    return Err(invalid(
                        format!("{path}.named_port"),
                        "named ports are not supported; use port_value",
                    ))
                }
                // Envoy requires the port (port_specifier is a required oneof); 0 is ephemeral.
                None => {
                    return Err(invalid(
                        format!("{path}.port_value"),
                        "port_value is required",
                    ))
                }
            };
            let port = u16::try_from(port).map_err(|_| {
                invalid(
                    format!("{path}.port_value"),
                    format!("port {port} is out of range 0..=65535"),
                )
            })?;
            Ok(Some(SocketAddr::new(ip, port)))
        }
        Some(AddressKind::Pipe(_)) | Some(AddressKind::EnvoyInternalAddress(_)) | None => {
            Err(invalid(
                "admin.address",
                "pipe and internal admin addresses are not supported; use a socket_address",
            ))
        }
    }
}

/// Checks static clusters and returns their names (ADS must name one of them).
fn check_clusters(proto: &BootstrapProto) -> Result<HashSet<String>, BootstrapError> {
    let clusters = proto
        .static_resources
        .as_ref()
        .map(|s| s.clusters.as_slice())
        .unwrap_or_default();
    let mut first_index: HashMap<&str, usize> = HashMap::new();
    for (i, cluster) in clusters.iter().enumerate() {
        let at = format!("static_resources.clusters[{i}]");
        if cluster.name.is_empty() {
            return Err(invalid(
                format!("{at}.name"),
                "cluster name must not be empty",
            ));
        }
        if let Some(first) = first_index.insert(&cluster.name, i) {
            return Err(invalid(
                format!("{at}.name"),
                format!(
                    "duplicate cluster name {:?} (also static_resources.clusters[{first}].name)",
                    cluster.name
                ),
            ));
        }
        let discovery = match &cluster.cluster_discovery_type {
            // proto3 default: an absent `type` is STATIC, as in Envoy.
            None => DiscoveryType::Static,
            Some(ClusterDiscoveryType::Type(t)) => match DiscoveryType::try_from(*t) {
                Ok(
                    d @ (DiscoveryType::Static
                    | DiscoveryType::StrictDns
                    | DiscoveryType::LogicalDns
                    | DiscoveryType::Eds),
                ) => d,
                Ok(other) => {
                    return Err(invalid(
                        format!("{at}.type"),
                        format!(
                            "{} clusters are not supported (supported: STATIC, STRICT_DNS, LOGICAL_DNS, EDS)",
                            other.as_str_name()
                        ),
                    ))
                }
                Err(_) => {
                    return Err(invalid(
                        format!("{at}.type"),
                        format!("unknown cluster type {t}"),
                    ))
                }
            },
            Some(ClusterDiscoveryType::ClusterType(custom)) => {
                return Err(invalid(
                    format!("{at}.cluster_type"),
                    format!("custom cluster type {:?} is not supported", custom.name),
                ))
            }
        };
        check_endpoints(cluster, &at, discovery)?;
    }
    Ok(first_index.into_keys().map(str::to_owned).collect())
}

fn check_endpoints(
    cluster: &envoy_types::pb::envoy::config::cluster::v3::Cluster,
    at: &str,
    discovery: DiscoveryType,
) -> Result<(), BootstrapError> {
    let Some(assignment) = &cluster.load_assignment else {
        return Ok(());
    };
    for (l, locality) in assignment.endpoints.iter().enumerate() {
        for (e, lb_endpoint) in locality.lb_endpoints.iter().enumerate() {
            let Some(HostIdentifier::Endpoint(endpoint)) = &lb_endpoint.host_identifier else {
                continue;
            };
            // Pipes are for the ADS and SDS clients (istio-agent's sds-grpc and xds-grpc);
            // internal addresses are warned about by the field walk.
            let Some(AddressKind::SocketAddress(sa)) =
                endpoint.address.as_ref().and_then(|a| a.address.as_ref())
            else {
                continue;
            };
            let path = format!(
                "{at}.load_assignment.endpoints[{l}].lb_endpoints[{e}].endpoint.address.socket_address"
            );
            check_endpoint_address(sa, &path, discovery)?;
        }
    }
    Ok(())
}

fn check_endpoint_address(
    sa: &SocketAddress,
    path: &str,
    discovery: DiscoveryType,
) -> Result<(), BootstrapError> {
    if sa.address.is_empty() {
        return Err(invalid(
            format!("{path}.address"),
            "address must not be empty",
        ));
    }
    if discovery == DiscoveryType::Static && sa.address.parse::<IpAddr>().is_err() {
        return Err(invalid(
            format!("{path}.address"),
            format!(
                "{:?} is not an IP address (STATIC clusters need IP literals; use STRICT_DNS for host names)",
                sa.address
            ),
        ));
    }
    match &sa.port_specifier {
        Some(PortSpecifier::PortValue(port)) if *port <= 65535 => Ok(()),
        Some(PortSpecifier::PortValue(port)) => Err(invalid(
            format!("{path}.port_value"),
            format!("port {port} is out of range 0..=65535"),
        )),
        Some(PortSpecifier::NamedPort(_)) => Err(invalid(
            format!("{path}.named_port"),
            "named ports are not supported; use port_value",
        )),
        None => Err(invalid(
            format!("{path}.port_value"),
            "port_value is required",
        )),
    }
}

/// Returns the ADS settings and whether LDS and CDS come over ADS.
fn dynamic_resources(
    proto: &BootstrapProto,
    cluster_names: &HashSet<String>,
) -> Result<(Option<AdsConfig>, bool, bool), BootstrapError> {
    let Some(dynamic) = &proto.dynamic_resources else {
        return Ok((None, false, false));
    };
    let ads = match &dynamic.ads_config {
        None => None,
        Some(config) => {
            let path = "dynamic_resources.ads_config";
            let delta = match ApiType::try_from(config.api_type) {
                Ok(ApiType::Grpc) => false,
                Ok(ApiType::DeltaGrpc) => true,
                // 0 is the deprecated placeholder value: the file did not say GRPC.
                Ok(_) if config.api_type == 0 => {
                    return Err(invalid(
                        format!("{path}.api_type"),
                        "api_type must be set to GRPC or DELTA_GRPC",
                    ))
                }
                Ok(other) => {
                    return Err(invalid(
                        format!("{path}.api_type"),
                        format!(
                            "{} is not supported for ADS; use GRPC or DELTA_GRPC",
                            other.as_str_name()
                        ),
                    ))
                }
                Err(_) => {
                    return Err(invalid(
                        format!("{path}.api_type"),
                        format!("unknown api_type {}", config.api_type),
                    ))
                }
            };
            if config.transport_api_version == 1 {
                return Err(invalid(
                    format!("{path}.transport_api_version"),
                    "V2 xDS transport protocol version is deprecated; use V3",
                ));
            }
            if !config.cluster_names.is_empty() {
                return Err(invalid(
                    format!("{path}.cluster_names"),
                    "API configs of type GRPC must not have a cluster name specified",
                ));
            }
            let [service] = config.grpc_services.as_slice() else {
                return Err(invalid(
                    format!("{path}.grpc_services"),
                    format!(
                        "exactly one gRPC service is required, found {}",
                        config.grpc_services.len()
                    ),
                ));
            };
            let cluster_name = match &service.target_specifier {
                Some(TargetSpecifier::EnvoyGrpc(grpc)) => &grpc.cluster_name,
                Some(TargetSpecifier::GoogleGrpc(_)) => {
                    return Err(invalid(
                        format!("{path}.grpc_services[0].google_grpc"),
                        "google_grpc is not supported; use envoy_grpc with a static cluster",
                    ))
                }
                None => {
                    return Err(invalid(
                        format!("{path}.grpc_services[0]"),
                        "envoy_grpc.cluster_name is required",
                    ))
                }
            };
            if !cluster_names.contains(cluster_name) {
                return Err(invalid(
                    format!("{path}.grpc_services[0].envoy_grpc.cluster_name"),
                    format!("cluster {cluster_name:?} is not defined in static_resources.clusters"),
                ));
            }
            let node_named = proto
                .node
                .as_ref()
                .is_some_and(|n| !n.id.is_empty() && !n.cluster.is_empty());
            if !node_named {
                return Err(invalid("node", "ads: node 'id' and 'cluster' are required"));
            }
            Some(AdsConfig {
                cluster_name: cluster_name.clone(),
                set_node_on_first_message_only: config.set_node_on_first_message_only,
                delta,
            })
        }
    };
    let lds = via_ads(
        dynamic.lds_config.as_ref(),
        "dynamic_resources.lds_config",
        ads.is_some(),
    )?;
    let cds = via_ads(
        dynamic.cds_config.as_ref(),
        "dynamic_resources.cds_config",
        ads.is_some(),
    )?;
    Ok((ads, lds, cds))
}

fn via_ads(
    source: Option<&ConfigSource>,
    path: &str,
    have_ads: bool,
) -> Result<bool, BootstrapError> {
    let Some(source) = source else {
        return Ok(false);
    };
    let used = match &source.config_source_specifier {
        Some(ConfigSourceSpecifier::Ads(_)) => {
            if !have_ads {
                // Envoy warns and runs without this subscription.
                tracing::warn!(
                    "{path}: ADS is selected but dynamic_resources.ads_config is not set; skipping"
                );
                return Ok(false);
            }
            return Ok(true);
        }
        Some(ConfigSourceSpecifier::ApiConfigSource(_)) => "api_config_source",
        Some(ConfigSourceSpecifier::PathConfigSource(_)) => "path_config_source",
        Some(_) => "this config source",
        None => "no config source",
    };
    Err(invalid(
        path,
        format!("{used} is not supported; only ADS is (ads: {{}})"),
    ))
}

fn node(proto: &BootstrapProto) -> Node {
    let Some(node) = &proto.node else {
        return Node::default();
    };
    Node {
        id: node.id.clone(),
        cluster: node.cluster.clone(),
        metadata: node
            .metadata
            .as_ref()
            .map(struct_to_json)
            .unwrap_or_default(),
        locality: node.locality.as_ref().map(|l| Locality {
            region: l.region.clone(),
            zone: l.zone.clone(),
            sub_zone: l.sub_zone.clone(),
        }),
        user_agent_name: node.user_agent_name.clone(),
    }
}

fn struct_to_json(s: &Struct) -> Map<String, Json> {
    s.fields
        .iter()
        .map(|(k, v)| (k.clone(), struct_value_to_json(v)))
        .collect()
}

fn struct_value_to_json(v: &StructValue) -> Json {
    match &v.kind {
        None | Some(StructKind::NullValue(_)) => Json::Null,
        Some(StructKind::NumberValue(n)) => protojson::number_to_json(*n),
        Some(StructKind::StringValue(s)) => Json::String(s.clone()),
        Some(StructKind::BoolValue(b)) => Json::Bool(*b),
        Some(StructKind::StructValue(s)) => Json::Object(struct_to_json(s)),
        Some(StructKind::ListValue(l)) => {
            Json::Array(l.values.iter().map(struct_value_to_json).collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GATEWAY_YAML: &str = include_str!("../tests/data/bootstrap/gateway.yaml");

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/bootstrap")
            .join(name)
    }

    fn yaml_err(text: &str) -> String {
        match parse(text, Format::Yaml) {
            Ok(b) => panic!("expected an error, got {:?}", b.warnings),
            Err(e) => e.to_string(),
        }
    }

    /// A valid bootstrap with one static xDS cluster, to which tests add the piece under test.
    const ADS_BASE: &str = r#"
node: {id: gw, cluster: gateways}
dynamic_resources:
  ads_config:
    api_type: GRPC
    grpc_services: [{envoy_grpc: {cluster_name: xds}}]
  lds_config: {ads: {}}
  cds_config: {ads: {}}
static_resources:
  clusters:
  - name: xds
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: xds
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 10.0.0.1, port_value: 15010}}}
"#;

    #[test]
    fn good_yaml() {
        let b = parse(GATEWAY_YAML, Format::Yaml).unwrap();
        assert_eq!(
            b.node.id,
            "router~10.0.0.5~portico-gw-0.gateways~gateways.svc.cluster.local"
        );
        assert_eq!(b.node.cluster, "portico-gw.gateways");
        assert_eq!(b.node.user_agent_name, "portico");
        assert_eq!(b.node.metadata["ISTIO_VERSION"], "1.22.1");
        // Struct numbers are doubles; they come back as JSON integers, as Envoy prints them.
        assert_eq!(
            b.node.metadata["ENVOY_STATUS_PORT"],
            serde_json::json!(15021)
        );
        assert_eq!(b.node.metadata["LABELS"]["app"], "portico-gw");
        assert_eq!(
            b.node.locality,
            Some(Locality {
                region: "eu-west1".into(),
                zone: "eu-west1-c".into(),
                sub_zone: String::new()
            })
        );
        assert_eq!(b.admin_address, Some("127.0.0.1:15000".parse().unwrap()));
        assert_eq!(
            b.ads,
            Some(AdsConfig {
                cluster_name: "xds-grpc".into(),
                set_node_on_first_message_only: true,
                delta: false
            })
        );
        assert!(b.lds_via_ads && b.cds_via_ads);
        assert_eq!(b.warnings, Vec::<String>::new());
        let clusters = &b.proto.static_resources.as_ref().unwrap().clusters;
        assert_eq!(clusters.len(), 3);
        assert_eq!(
            clusters[0]
                .connect_timeout
                .as_ref()
                .map(|d| (d.seconds, d.nanos)),
            Some((1, 0))
        );
        assert_eq!(
            clusters[1]
                .connect_timeout
                .as_ref()
                .map(|d| (d.seconds, d.nanos)),
            Some((0, 500_000_000))
        );
    }

    #[test]
    fn good_json() {
        let text = r#"{
          "node": {"id": "gw-1", "cluster": "gw", "metadata": {"ISTIO_VERSION": "1.22.1"}},
          "admin": {"address": {"socket_address": {"address": "::1", "port_value": 9901}}},
          "static_resources": {"clusters": [{
            "name": "web", "type": "LOGICAL_DNS", "connect_timeout": "1.5s",
            "load_assignment": {"cluster_name": "web", "endpoints": [{"lb_endpoints": [
              {"endpoint": {"address": {"socket_address": {"address": "web.example.com", "port_value": 443}}}}
            ]}]}
          }]}
        }"#;
        let b = parse(text, Format::Json).unwrap();
        assert_eq!(b.node.id, "gw-1");
        assert_eq!(b.node.metadata["ISTIO_VERSION"], "1.22.1");
        assert_eq!(b.admin_address, Some("[::1]:9901".parse().unwrap()));
        assert_eq!(b.ads, None);
        assert!(!b.lds_via_ads && !b.cds_via_ads);
        assert!(b.warnings.is_empty(), "{:?}", b.warnings);
    }

    #[test]
    fn lower_camel_case_field_names() {
        let text = r#"
node: {id: gw-1, cluster: gateways, userAgentName: portico}
admin: {address: {socketAddress: {address: 127.0.0.1, portValue: 15000}}}
dynamicResources:
  adsConfig:
    apiType: GRPC
    setNodeOnFirstMessageOnly: true
    grpcServices: [{envoyGrpc: {clusterName: xds}}]
  ldsConfig: {ads: {}, resourceApiVersion: V3}
  cdsConfig: {ads: {}}
staticResources:
  clusters:
  - name: xds
    connectTimeout: 0.25s
    lbPolicy: ROUND_ROBIN
    typedExtensionProtocolOptions:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicitHttpConfig: {http2ProtocolOptions: {}}
    loadAssignment:
      clusterName: xds
      endpoints:
      - lbEndpoints:
        - endpoint: {address: {socketAddress: {address: 10.0.0.1, portValue: 15010}}}
    circuitBreakers: {thresholds: [{maxConnections: 10}]}
    outlierDetection: {consecutive5xx: 3}
"#;
        let b = parse(text, Format::Yaml).unwrap();
        assert_eq!(b.node.user_agent_name, "portico");
        assert_eq!(b.admin_address, Some("127.0.0.1:15000".parse().unwrap()));
        assert_eq!(b.ads.as_ref().map(|a| a.cluster_name.as_str()), Some("xds"));
        assert!(b.lds_via_ads && b.cds_via_ads);
        // Warnings use proto (snake_case) names whatever spelling the file used.
        assert_eq!(
            b.warnings,
            vec![
                "bootstrap field 'static_resources.clusters[*].outlier_detection' is not implemented by Portico and is ignored"
            ]
        );
    }

    #[test]
    fn unknown_field_is_an_error_naming_its_path() {
        let err = yaml_err(
            "admin:\n  adress:\n    socket_address: {address: 127.0.0.1, port_value: 1}\n",
        );
        assert_eq!(err, "admin.adress: unknown field");

        let err = yaml_err(&format!("{ADS_BASE}    health_chekcs: []\n"));
        assert_eq!(
            err,
            "static_resources.clusters[0].health_chekcs: unknown field"
        );
    }

    #[test]
    fn unknown_field_inside_typed_config_names_its_path() {
        let text = r#"
static_resources:
  listeners:
  - name: l
    address: {socket_address: {address: 0.0.0.0, port_value: 8080}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefx: ingress
"#;
        assert_eq!(
            yaml_err(text),
            "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.stat_prefx: unknown field"
        );
    }

    #[test]
    fn bad_duration_names_its_path() {
        let err = yaml_err(&ADS_BASE.replace("connect_timeout: 1s", "connect_timeout: 5x"));
        assert_eq!(
            err,
            r#"static_resources.clusters[0].connect_timeout: invalid duration "5x""#
        );
    }

    #[test]
    fn malformed_values_name_their_path() {
        let err = yaml_err(&ADS_BASE.replace("type: STATIC", "type: STATICK"));
        assert!(
            err.starts_with(r#"static_resources.clusters[0].type: unknown value "STATICK""#),
            "{err}"
        );
        let err = yaml_err(&ADS_BASE.replace("port_value: 15010", "port_value: http"));
        assert_eq!(
            err,
            "static_resources.clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.port_value: expected an integer (uint32), found string \"http\""
        );
    }

    #[test]
    fn enum_by_number_is_accepted() {
        let b = parse(
            &ADS_BASE.replace("api_type: GRPC", "api_type: 2"),
            Format::Yaml,
        )
        .unwrap();
        assert_eq!(b.ads.map(|a| a.cluster_name), Some("xds".to_owned()));
    }

    #[test]
    fn bad_admin_ip() {
        let err = yaml_err(
            "admin: {address: {socket_address: {address: localhost, port_value: 15000}}}\n",
        );
        assert_eq!(
            err,
            r#"admin.address.socket_address.address: "localhost" is not an IP address"#
        );
        let err = yaml_err(
            "admin: {address: {socket_address: {address: 127.0.0.1, port_value: 70000}}}\n",
        );
        assert_eq!(
            err,
            "admin.address.socket_address.port_value: port 70000 is out of range 0..=65535"
        );
        let err = yaml_err("admin: {address: {pipe: {path: /tmp/admin.sock}}}\n");
        assert_eq!(
            err,
            "admin.address: pipe and internal admin addresses are not supported; use a socket_address"
        );
    }

    #[test]
    fn ads_cluster_missing() {
        let err = yaml_err(&ADS_BASE.replace("cluster_name: xds}", "cluster_name: istiod}"));
        assert_eq!(
            err,
            r#"dynamic_resources.ads_config.grpc_services[0].envoy_grpc.cluster_name: cluster "istiod" is not defined in static_resources.clusters"#
        );
    }

    #[test]
    fn delta_is_accepted_and_rest_api_types_are_rejected() {
        let b = parse(
            &ADS_BASE.replace("api_type: GRPC", "api_type: DELTA_GRPC"),
            Format::Yaml,
        )
        .expect("DELTA_GRPC is accepted");
        assert!(b.ads.as_ref().is_some_and(|a| a.delta));
        let b = parse(ADS_BASE, Format::Yaml).expect("GRPC is accepted");
        assert!(b.ads.as_ref().is_some_and(|a| !a.delta));
        let err = yaml_err(&ADS_BASE.replace("api_type: GRPC", "api_type: REST"));
        assert_eq!(
            err,
            "dynamic_resources.ads_config.api_type: REST is not supported for ADS; use GRPC or DELTA_GRPC"
        );
        let err = yaml_err(&ADS_BASE.replace("    api_type: GRPC\n", ""));
        assert_eq!(
            err,
            "dynamic_resources.ads_config.api_type: api_type must be set to GRPC or DELTA_GRPC"
        );
    }

    #[test]
    fn grpc_services_must_be_one_envoy_grpc() {
        let err = yaml_err(&ADS_BASE.replace(
            "grpc_services: [{envoy_grpc: {cluster_name: xds}}]",
            "grpc_services: []",
        ));
        assert_eq!(
            err,
            "dynamic_resources.ads_config.grpc_services: exactly one gRPC service is required, found 0"
        );
        let err = yaml_err(&ADS_BASE.replace(
            "{envoy_grpc: {cluster_name: xds}}",
            "{google_grpc: {target_uri: 'istiod:15012', stat_prefix: x}}",
        ));
        assert_eq!(
            err,
            "dynamic_resources.ads_config.grpc_services[0].google_grpc: google_grpc is not supported; use envoy_grpc with a static cluster"
        );
    }

    #[test]
    fn lds_and_cds_must_use_ads() {
        let err = yaml_err(&ADS_BASE.replace(
            "lds_config: {ads: {}}",
            "lds_config: {path_config_source: {path: /etc/lds.yaml}}",
        ));
        assert_eq!(
            err,
            "dynamic_resources.lds_config: path_config_source is not supported; only ADS is (ads: {})"
        );
        let err = yaml_err(&ADS_BASE.replace(
            "cds_config: {ads: {}}",
            "cds_config: {api_config_source: {api_type: GRPC, grpc_services: [{envoy_grpc: {cluster_name: xds}}]}}",
        ));
        assert_eq!(
            err,
            "dynamic_resources.cds_config: api_config_source is not supported; only ADS is (ads: {})"
        );
        // ADS selected without ads_config: Envoy warns and runs without LDS.
        let b = parse(
            "dynamic_resources:\n  lds_config: {ads: {}}\n",
            Format::Yaml,
        )
        .expect("accepted with a warning");
        assert!(!b.lds_via_ads);
    }

    #[test]
    fn duplicate_and_empty_cluster_names() {
        let text = r#"
static_resources:
  clusters:
  - {name: a, connect_timeout: 1s}
  - {name: b, connect_timeout: 1s}
  - {name: a, connect_timeout: 1s}
"#;
        assert_eq!(
            yaml_err(text),
            r#"static_resources.clusters[2].name: duplicate cluster name "a" (also static_resources.clusters[0].name)"#
        );
        assert_eq!(
            yaml_err("static_resources: {clusters: [{connect_timeout: 1s}]}\n"),
            "static_resources.clusters[0].name: cluster name must not be empty"
        );
    }

    #[test]
    fn static_endpoints_need_ip_literals_and_ports() {
        let err = yaml_err(&ADS_BASE.replace("address: 10.0.0.1", "address: istiod.istio-system"));
        assert_eq!(
            err,
            "static_resources.clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.address: \"istiod.istio-system\" is not an IP address (STATIC clusters need IP literals; use STRICT_DNS for host names)"
        );
        // The same host name is fine for a DNS cluster.
        let dns = ADS_BASE
            .replace("address: 10.0.0.1", "address: istiod.istio-system")
            .replace("type: STATIC", "type: STRICT_DNS");
        assert!(parse(&dns, Format::Yaml).is_ok());

        // Port 0 is valid to Envoy (its rule is only <= 65535).
        assert!(parse(
            &ADS_BASE.replace("port_value: 15010", "port_value: 0"),
            Format::Yaml
        )
        .is_ok());
        let err = yaml_err(&ADS_BASE.replace(", port_value: 15010", ""));
        assert!(
            err.ends_with("socket_address.port_value: port_value is required"),
            "{err}"
        );
    }

    #[test]
    fn unsupported_cluster_type_is_an_error() {
        let err = yaml_err(&ADS_BASE.replace("type: STATIC", "type: ORIGINAL_DST"));
        assert_eq!(
            err,
            "static_resources.clusters[0].type: ORIGINAL_DST clusters are not supported (supported: STATIC, STRICT_DNS, LOGICAL_DNS, EDS)"
        );
    }

    #[test]
    fn warnings_are_listed_once_per_path() {
        let text = r#"
flags_path: /etc/envoy/flags
stats_config: {use_all_default_tags: false}
node: {id: n, client_features: [envoy.lb.does_not_support_overprovisioning]}
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: 0}}
  ignore_global_conn_limit: true
static_resources:
  secrets: [{name: s}]
  listeners:
  - name: anything-goes-here
    address: {socket_address: {address: 0.0.0.0, port_value: 8080}}
    per_connection_buffer_limit_bytes: 1024
  clusters:
  - name: a
    connect_timeout: 1s
    circuit_breakers: {thresholds: [{max_connections: 1}]}
    health_checks: [{timeout: 1s, interval: 1s, tcp_health_check: {}}]
    load_assignment:
      cluster_name: a
      endpoints:
      - priority: 1
        lb_endpoints:
        - endpoint:
            address: {socket_address: {address: 10.0.0.1, port_value: 80}}
            hostname: a.local
  - name: b
    connect_timeout: 1s
    health_checks: [{timeout: 1s, interval: 1s, tcp_health_check: {}}]
    load_assignment:
      cluster_name: b
      endpoints:
      - priority: 1
        lb_endpoints:
        - endpoint:
            address: {socket_address: {address: 10.0.0.2, port_value: 80}}
            hostname: b.local
"#;
        let b = parse(text, Format::Yaml).unwrap();
        let msg =
            |p: &str| format!("bootstrap field '{p}' is not implemented by Portico and is ignored");
        assert_eq!(
            b.warnings,
            vec![
                msg("node.client_features"),
                msg("static_resources.clusters[*].load_assignment.endpoints[*].lb_endpoints[*].endpoint.hostname"),
                msg("static_resources.clusters[*].load_assignment.endpoints[*].priority"),
                msg("static_resources.secrets"),
                msg("flags_path"),
                msg("admin.ignore_global_conn_limit"),
            ]
        );
        assert_eq!(b.admin_address, Some("127.0.0.1:0".parse().unwrap()));
    }

    /// istio/istio's golden renders of every pilot-agent option: what a 1.30 pod starts with
    /// warns only about what an option asks of a feature Portico lacks.
    #[test]
    fn istio_golden_bootstraps_warn_only_for_features_portico_lacks() {
        let dir = fixture("istio");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            n += 1;
            let b = load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let allowed: &[&str] = match name.as_str() {
                // Load reports to the control plane (LRS) and histogram buckets.
                "lrs_golden.json" => &["cluster_manager.load_stats_config"],
                "stats_inclusion_golden.json" => &["stats_config.histogram_bucket_settings"],
                _ => &[],
            };
            for w in &b.warnings {
                assert!(
                    allowed.iter().any(|a| w.contains(&format!("'{a}'"))),
                    "{name}: {w}"
                );
            }
        }
        assert!(n >= 30, "{n} goldens");
    }

    #[test]
    fn istio_agent_bootstrap_loads_without_warnings() {
        let b = load(&fixture("istio-agent.json")).unwrap();
        assert_eq!(b.node.cluster, "istio-ingressgateway.istio-system");
        assert!(b.node.id.starts_with("router~10.244.0.17~"));
        assert_eq!(b.node.metadata["ISTIO_VERSION"], "1.22.1");
        assert_eq!(b.node.metadata["LABELS"]["istio"], "ingressgateway");
        assert_eq!(b.node.metadata["PROXY_CONFIG"]["proxyAdminPort"], 15000);
        assert_eq!(b.admin_address, Some("127.0.0.1:15000".parse().unwrap()));
        assert_eq!(
            b.ads,
            Some(AdsConfig {
                cluster_name: "xds-grpc".into(),
                set_node_on_first_message_only: true,
                delta: false
            })
        );
        assert!(b.lds_via_ads && b.cds_via_ads);
        let names: Vec<&str> = b
            .proto
            .static_resources
            .as_ref()
            .unwrap()
            .clusters
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "prometheus_stats",
                "agent",
                "sds-grpc",
                "xds-grpc",
                "zipkin"
            ]
        );

        // Every section istio-agent writes is implemented or checked: nothing is ignored.
        assert!(b.warnings.is_empty(), "{:?}", b.warnings);
    }

    #[test]
    fn load_names_the_file_and_picks_the_format() {
        let dir =
            std::env::temp_dir().join(format!("portico-bootstrap-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();

        let bad = dir.join("bad.yaml");
        std::fs::write(&bad, "admin: {adress: {}}\n").unwrap();
        let err = load(&bad).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("{}: admin.adress: unknown field", bad.display())
        );
        assert_eq!(err.field_path(), Some("admin.adress"));

        // No known extension: JSON only, as Envoy reads it.
        let json = dir.join("bootstrap.conf");
        std::fs::write(&json, r#"{"node": {"id": "j"}}"#).unwrap();
        assert_eq!(load(&json).unwrap().node.id, "j");
        let yaml = dir.join("bootstrap");
        std::fs::write(&yaml, "node:\n  id: y\n").unwrap();
        assert!(load(&yaml).is_err());

        // A .json file is parsed as JSON only, so YAML in it is a syntax error.
        let wrong = dir.join("wrong.json");
        std::fs::write(&wrong, "node:\n  id: y\n").unwrap();
        let err = load(&wrong).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "{}: bootstrap is not valid JSON: ",
                wrong.display()
            )),
            "{err}"
        );

        let missing = dir.join("missing.yaml");
        let err = load(&missing).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "cannot read bootstrap file {}: ",
                missing.display()
            )),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn format_from_extension() {
        assert_eq!(
            Format::from_path(Path::new("a/envoy.yaml")),
            Some(Format::Yaml)
        );
        assert_eq!(
            Format::from_path(Path::new("envoy.YML")),
            Some(Format::Yaml)
        );
        assert_eq!(
            Format::from_path(Path::new("envoy-rev.json")),
            Some(Format::Json)
        );
        assert_eq!(Format::from_path(Path::new("envoy.conf")), None);
        assert_eq!(Format::from_path(Path::new("envoy")), None);
        // Envoy reads a file with any other extension as JSON only.
        let dir = std::env::temp_dir().join(format!("portico-fmt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let conf = dir.join("bootstrap.conf");
        std::fs::write(&conf, "node:\n  id: y\n").expect("write");
        assert!(load(&conf).is_err(), "YAML in a .conf file is not JSON");
    }

    #[test]
    fn empty_and_malformed_documents() {
        assert_eq!(yaml_err(""), "bootstrap is empty");
        let err = yaml_err("node: [unclosed\n");
        assert!(err.starts_with("bootstrap is not valid YAML: "), "{err}");
        assert_eq!(
            yaml_err("- just\n- a list\n"),
            "expected an object (envoy.config.bootstrap.v3.Bootstrap), found a list"
        );
    }

    #[test]
    fn yaml_merge_keys_are_unknown_fields_as_in_envoy() {
        let text = r#"
static_resources:
  clusters:
  - &base {name: a, connect_timeout: 2s}
  - <<: *base
    name: b
"#;
        let err = yaml_err(text);
        assert!(err.contains("<<"), "{err}");
    }

    #[test]
    fn allowed_unknown_fields_are_dropped_with_a_warning_each() {
        let dir = std::env::temp_dir().join(format!("portico-unknown-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("b.yaml");
        let text = r#"
node: {id: n, cluster: c, not_a_node_field: 1}
admin: {address: {socket_address: {address: 127.0.0.1, port_value: 15000}}}
future_top_level: {x: 1}
static_resources:
  clusters:
  - name: a
    type: STATIC
    load_assignment: {cluster_name: a, endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 1}}}, weird: true}]}]}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
        new_knob: 3
"#;
        std::fs::write(&f, text).unwrap();
        // Without the flag the first unknown field refuses the file, as Envoy.
        assert!(load(&f).unwrap_err().to_string().contains("unknown field"));
        let b = load_with(&f, None, true).expect("accepted with the flag");
        let mut unknown: Vec<&str> = b
            .warnings
            .iter()
            .filter(|w| w.contains("--allow-unknown-static-fields"))
            .map(|w| w.split(':').next().unwrap_or(""))
            .collect();
        unknown.sort_unstable();
        assert_eq!(
            unknown,
            [
                "future_top_level",
                "node.not_a_node_field",
                "static_resources.clusters[0].load_assignment.endpoints[0].lb_endpoints[0].weird",
                "static_resources.clusters[0].typed_extension_protocol_options[\"envoy.extensions.upstreams.http.v3.HttpProtocolOptions\"].new_knob",
            ]
        );
        assert_eq!(b.node.id, "n");
        // What is known is kept, inside the Any too.
        let c = &b.proto.static_resources.as_ref().unwrap().clusters[0];
        assert_eq!(c.name, "a");
        assert!(c
            .typed_extension_protocol_options
            .contains_key("envoy.extensions.upstreams.http.v3.HttpProtocolOptions"));
        // The override's unknown fields too; malformed known fields still refuse.
        let b = load_with(&f, Some("node: {id: m, also_unknown: 2}"), true).unwrap();
        assert_eq!(b.node.id, "m");
        assert!(b
            .warnings
            .iter()
            .any(|w| w.starts_with("--config-yaml node.also_unknown: unknown field")));
        std::fs::write(&f, "node: {id: 5s, cluster: [1]}\n").unwrap();
        assert!(load_with(&f, None, true).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
