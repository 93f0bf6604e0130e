//! Istio's standard metrics (`istio.stats`, istio-proxy's `stats.PluginConfig`) and the peer
//! metadata they are labelled with (`istio.metadata_exchange`).
//!
//! - [`StatsConfig`]: the plugin config, translated from every encoding istiod has used (a
//!   plain `Any`; a `udpa.type.v1`/`xds.type.v3` `TypedStruct` whose `value` is the config as
//!   a `google.protobuf.Struct`; the older null-VM Wasm filter whose `configuration` is a
//!   `StringValue` holding the config as JSON, itself possibly inside a `TypedStruct`).
//! - [`peer`]: who the gateway is (its bootstrap node) and who its peers are (exchanged
//!   headers, endpoint metadata).
//! - [`store`]: the metrics themselves, labelled as istio-proxy labels them, kept without a lock
//!   on the request path and rendered for `/stats/prometheus` and `/stats`.
//!
//! Metrics never change where a request goes or whether it is allowed, so what Portico cannot
//! evaluate is accepted and reported as istio-proxy reports a failed expression: `unknown`
//! (see [`Attr`]).

pub mod peer;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::google::protobuf::{value::Kind, Any, Struct, Value};
use prost::Message;
use serde_json::Value as Json;

pub use peer::{LocalNode, PeerInfo, Peers};
pub use store::Store;

pub const STATS_TYPE: &str = "type.googleapis.com/stats.PluginConfig";
pub const PEER_METADATA_TYPE: &str = "type.googleapis.com/io.istio.http.peer_metadata.Config";
const TYPED_STRUCTS: [&str; 2] = [
    "type.googleapis.com/udpa.type.v1.TypedStruct",
    "type.googleapis.com/xds.type.v3.TypedStruct",
];
const WASM_TYPES: [&str; 2] = [
    "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
    "type.googleapis.com/envoy.extensions.filters.network.wasm.v3.Wasm",
];
const STRING_VALUE_TYPE: &str = "type.googleapis.com/google.protobuf.StringValue";

/// `udpa.type.v1.TypedStruct` / `xds.type.v3.TypedStruct` with its value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TypedStruct {
    #[prost(string, tag = "1")]
    pub type_url: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<Struct>,
}

/// istio/proxy's `stats.PluginConfig` (source/extensions/filters/http/istio_stats/config.proto).
#[derive(Clone, PartialEq, prost::Message)]
struct PluginConfigPb {
    #[prost(bool, tag = "6")]
    disable_host_header_fallback: bool,
    #[prost(message, optional, tag = "7")]
    tcp_reporting_duration: Option<envoy_types::pb::google::protobuf::Duration>,
    #[prost(message, repeated, tag = "8")]
    metrics: Vec<MetricConfigPb>,
    #[prost(message, repeated, tag = "9")]
    definitions: Vec<MetricDefinitionPb>,
    #[prost(int32, tag = "10")]
    reporter: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct MetricConfigPb {
    #[prost(map = "string, string", tag = "1")]
    dimensions: std::collections::HashMap<String, String>,
    #[prost(string, tag = "2")]
    name: String,
    #[prost(string, repeated, tag = "3")]
    tags_to_remove: Vec<String>,
    #[prost(string, tag = "4")]
    r#match: String,
    #[prost(bool, tag = "5")]
    drop: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
struct MetricDefinitionPb {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    value: String,
    #[prost(int32, tag = "3")]
    r#type: i32,
}

/// Who reports: istio-proxy's `Reporter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reporter {
    /// `UNSPECIFIED` on an outbound (or direction-less) listener: istio-proxy's client sidecar,
    /// `reporter="source"`. Every gateway listener istiod renders is outbound, so this is the
    /// gateway's reporter. (An `INBOUND` listener would report `destination`; a gateway has
    /// none, and Portico reports `source` for it too.)
    Source,
    /// `SERVER_GATEWAY` (waypoints): `reporter="waypoint"`, source labels from the downstream
    /// peer, destination labels from the upstream peer.
    Waypoint,
}

impl Reporter {
    pub fn label(self) -> &'static str {
        match self {
            Reporter::Source => "source",
            Reporter::Waypoint => "waypoint",
        }
    }
}

/// The standard metrics, in istio-proxy's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Metric {
    RequestsTotal,
    RequestDuration,
    RequestBytes,
    ResponseBytes,
    TcpOpened,
    TcpClosed,
    TcpSent,
    TcpReceived,
    /// gRPC messages each way (from the grpc_stats filter's filter state).
    RequestMessages,
    ResponseMessages,
}

impl Metric {
    pub const ALL: [Metric; 10] = [
        Metric::RequestsTotal,
        Metric::RequestDuration,
        Metric::RequestBytes,
        Metric::ResponseBytes,
        Metric::TcpOpened,
        Metric::TcpClosed,
        Metric::TcpSent,
        Metric::TcpReceived,
        Metric::RequestMessages,
        Metric::ResponseMessages,
    ];

    /// The reported name (`istio_requests_total`).
    pub fn name(self) -> &'static str {
        match self {
            Metric::RequestsTotal => "istio_requests_total",
            Metric::RequestDuration => "istio_request_duration_milliseconds",
            Metric::RequestBytes => "istio_request_bytes",
            Metric::ResponseBytes => "istio_response_bytes",
            Metric::TcpOpened => "istio_tcp_connections_opened_total",
            Metric::TcpClosed => "istio_tcp_connections_closed_total",
            Metric::TcpSent => "istio_tcp_sent_bytes_total",
            Metric::TcpReceived => "istio_tcp_received_bytes_total",
            Metric::RequestMessages => "istio_request_messages_total",
            Metric::ResponseMessages => "istio_response_messages_total",
        }
    }

    /// The name a `metrics[].name` override uses (`requests_total`).
    fn config_name(self) -> &'static str {
        &self.name()["istio_".len()..]
    }

    pub fn is_histogram(self) -> bool {
        matches!(
            self,
            Metric::RequestDuration | Metric::RequestBytes | Metric::ResponseBytes
        )
    }
}

listed_enum! {
/// istio-proxy's standard tags, in the order it adds them to a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tag {
    Reporter,
    SourceWorkload,
    SourceCanonicalService,
    SourceCanonicalRevision,
    SourceWorkloadNamespace,
    SourcePrincipal,
    SourceApp,
    SourceVersion,
    SourceCluster,
    DestinationWorkload,
    DestinationWorkloadNamespace,
    DestinationPrincipal,
    DestinationApp,
    DestinationVersion,
    DestinationService,
    DestinationCanonicalService,
    DestinationCanonicalRevision,
    DestinationServiceName,
    DestinationServiceNamespace,
    DestinationCluster,
    RequestProtocol,
    ResponseCode,
    GrpcResponseStatus,
    ResponseFlags,
    ConnectionSecurityPolicy,
}
}

impl Tag {
    /// An HTTP request's tags: all of them.
    pub const HTTP: [Tag; 25] = Tag::ALL;

    /// The gRPC message counters' tags: istio-proxy adds them before it knows the protocol,
    /// code and flags, so they stop at `destination_cluster`.
    pub const PEERS: [Tag; 20] = {
        let mut t = [Tag::Reporter; 20];
        let mut i = 0;
        while i < 20 {
            t[i] = Tag::HTTP[i];
            i += 1;
        }
        t
    };

    /// A TCP connection's tags: the HTTP ones without the response code and gRPC status.
    pub const TCP: [Tag; 23] = {
        let mut t = [Tag::Reporter; 23];
        let (mut i, mut n) = (0, 0);
        while i < Tag::HTTP.len() {
            if !matches!(Tag::HTTP[i], Tag::ResponseCode | Tag::GrpcResponseStatus) {
                t[n] = Tag::HTTP[i];
                n += 1;
            }
            i += 1;
        }
        t
    };

    pub fn name(self) -> &'static str {
        use Tag::*;
        match self {
            Reporter => "reporter",
            SourceWorkload => "source_workload",
            SourceCanonicalService => "source_canonical_service",
            SourceCanonicalRevision => "source_canonical_revision",
            SourceWorkloadNamespace => "source_workload_namespace",
            SourcePrincipal => "source_principal",
            SourceApp => "source_app",
            SourceVersion => "source_version",
            SourceCluster => "source_cluster",
            DestinationWorkload => "destination_workload",
            DestinationWorkloadNamespace => "destination_workload_namespace",
            DestinationPrincipal => "destination_principal",
            DestinationApp => "destination_app",
            DestinationVersion => "destination_version",
            DestinationService => "destination_service",
            DestinationCanonicalService => "destination_canonical_service",
            DestinationCanonicalRevision => "destination_canonical_revision",
            DestinationServiceName => "destination_service_name",
            DestinationServiceNamespace => "destination_service_namespace",
            DestinationCluster => "destination_cluster",
            RequestProtocol => "request_protocol",
            ResponseCode => "response_code",
            GrpcResponseStatus => "grpc_response_status",
            ResponseFlags => "response_flags",
            ConnectionSecurityPolicy => "connection_security_policy",
        }
    }

    fn from_name(n: &str) -> Option<Tag> {
        Tag::HTTP.into_iter().find(|t| t.name() == n)
    }
}

/// A request attribute a dimension reads that is only known while the request's headers are
/// (the request path captures these into `StreamInfo::istio_attributes`, in this order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Capture {
    /// `request.host` (`:authority`); also the `destination_service` fallback.
    Host,
    Method,
    /// `request.path`: path and query.
    Path,
    /// `request.url_path`: the path without its query.
    UrlPath,
    Scheme,
    /// `request.headers['name']` (lower case); `request.useragent`, `request.referer` and
    /// `request.id` are headers too.
    Header(http::HeaderName),
}

/// A field of a peer's metadata, as CEL reads `upstream_peer.<field>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerField {
    Workload,
    Namespace,
    Cluster,
    Service,
    Revision,
    App,
    Version,
    Name,
    Identity,
    Type,
    Label(String),
}

impl PeerField {
    pub fn get<'a>(&self, p: &'a PeerInfo) -> &'a str {
        match self {
            PeerField::Workload => &p.workload,
            PeerField::Namespace => &p.namespace,
            PeerField::Cluster => &p.cluster,
            PeerField::Service => &p.canonical_name,
            PeerField::Revision => &p.canonical_revision,
            PeerField::App => &p.app,
            PeerField::Version => &p.version,
            PeerField::Name => &p.instance,
            PeerField::Identity => &p.identity,
            PeerField::Type => match p.workload_type {
                peer::WorkloadType::Pod => "pod",
                peer::WorkloadType::Deployment => "deployment",
                peer::WorkloadType::Job => "job",
                peer::WorkloadType::CronJob => "cronjob",
                peer::WorkloadType::Unknown => "unknown",
            },
            PeerField::Label(l) => match l.as_str() {
                "app" => &p.app,
                "version" => &p.version,
                "service.istio.io/canonical-name" => &p.canonical_name,
                "service.istio.io/canonical-revision" => &p.canonical_revision,
                _ => p
                    .labels
                    .iter()
                    .find(|(k, _)| k == l)
                    .map_or("", |(_, v)| v.as_str()),
            },
        }
    }
}

/// A dimension's value expression (istio-proxy evaluates CEL). Portico evaluates the literal
/// strings and the attributes Istio's documentation uses; any other expression is accepted
/// with a warning and its dimension reports `unknown` — what istio-proxy reports for an
/// expression that fails to evaluate. Metrics never change routing or access, so refusing the
/// listener for a label Portico cannot compute would do more harm than the missing label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attr {
    Literal(Arc<str>),
    /// Index into [`StatsConfig::captures`].
    Request(usize),
    ResponseCode,
    /// `response.grpc_status`.
    GrpcStatus,
    /// `response.code_details`.
    CodeDetails,
    /// `node.id`, `node.cluster`, `node.metadata['X']`: the gateway's bootstrap node.
    NodeId,
    NodeCluster,
    NodeMetadata(String),
    UpstreamPeer(PeerField),
    DownstreamPeer(PeerField),
    /// `xds.cluster_name`.
    ClusterName,
    /// `xds.route_name`.
    RouteName,
    /// `connection.requested_server_name`.
    Sni,
    /// `connection.mtls`.
    Mtls,
    /// `source.address`, `destination.address`, `upstream.address`.
    SourceAddress,
    DestinationAddress,
    UpstreamAddress,
    Unknown,
}

/// The process's Istio telemetry: every metric, and who the gateway is.
#[derive(Debug, Default)]
pub struct Istio {
    pub store: Store,
    pub node: LocalNode,
}

impl Istio {
    /// From the bootstrap's `node` (its id and `metadata`).
    pub fn new(node: Option<&envoy_types::pb::envoy::config::core::v3::Node>) -> Istio {
        Istio {
            store: Store::new(),
            node: match node {
                Some(n) => LocalNode::new(&n.id, &n.cluster, n.metadata.as_ref()),
                None => LocalNode::new("", "", None),
            },
        }
    }
}

/// The Istio filters of one connection manager.
#[derive(Debug, Clone, Default)]
pub struct IstioFilters {
    /// `istio.stats`: report Istio's request metrics.
    pub stats: Option<Arc<StatsConfig>>,
    /// `istio.metadata_exchange`: exchange peer metadata headers.
    pub peer_metadata: Option<Arc<PeerMetadataConfig>>,
}

/// How one metric's labels differ from the standard set.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricPlan {
    pub drop: bool,
    /// Standard tags replaced (Some) or removed (None), in any order.
    pub overrides: Vec<(Tag, Option<Attr>)>,
    /// Tags added after the standard ones, in order.
    pub additions: Vec<(Arc<str>, Attr)>,
}

impl MetricPlan {
    fn set_override(&mut self, t: Tag, a: Option<Attr>) {
        match self.overrides.iter_mut().find(|(k, _)| *k == t) {
            Some(slot) => slot.1 = a,
            None => self.overrides.push((t, a)),
        }
    }
}

/// A translated `stats.PluginConfig`.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsConfig {
    pub reporter: Reporter,
    /// `disable_host_header_fallback`: without the cluster's `istio` service metadata,
    /// `destination_service` is not read from the Host header (istiod sets it on gateways).
    pub disable_host_header_fallback: bool,
    /// `tcp_reporting_duration` (default 5 s as istio-proxy's): how often a long TCP
    /// connection's byte counters are brought up to date.
    pub tcp_reporting_duration: Duration,
    /// Per metric, in [`Metric::ALL`] order.
    pub plans: Vec<MetricPlan>,
    /// What the request path keeps of each request for the dimensions (and the Host fallback).
    pub captures: Vec<Capture>,
    /// Index in `captures` of the Host header, when the fallback may read it.
    pub host_capture: Option<usize>,
    /// What was accepted without effect, to log once.
    pub warnings: Vec<String>,
}

impl Default for StatsConfig {
    fn default() -> Self {
        StatsConfig {
            reporter: Reporter::Source,
            disable_host_header_fallback: false,
            tcp_reporting_duration: Duration::from_secs(5),
            plans: vec![MetricPlan::default(); Metric::ALL.len()],
            captures: Vec::new(),
            host_capture: None,
            warnings: Vec::new(),
        }
        .with_host_capture()
    }
}

impl StatsConfig {
    pub fn plan(&self, m: Metric) -> &MetricPlan {
        &self.plans[m as usize]
    }

    fn with_host_capture(mut self) -> Self {
        self.host_capture = if self.disable_host_header_fallback {
            None
        } else {
            Some(self.capture(Capture::Host))
        };
        self
    }

    fn capture(&mut self, c: Capture) -> usize {
        match self.captures.iter().position(|x| *x == c) {
            Some(i) => i,
            None => {
                self.captures.push(c);
                self.captures.len() - 1
            }
        }
    }

    /// Translates a filter's config: `stats.PluginConfig` in any of its encodings.
    pub fn from_any(a: &Any) -> Result<StatsConfig, String> {
        match a.type_url.as_str() {
            STATS_TYPE => {
                let pb = PluginConfigPb::decode(a.value.as_slice())
                    .map_err(|e| format!("stats.PluginConfig: cannot decode: {e}"))?;
                Ok(StatsConfig::from_proto(&pb))
            }
            t if TYPED_STRUCTS.contains(&t) => {
                let ts = TypedStruct::decode(a.value.as_slice())
                    .map_err(|e| format!("TypedStruct: cannot decode: {e}"))?;
                let json = ts.value.as_ref().map_or(Json::Null, struct_to_json);
                match ts.type_url.as_str() {
                    STATS_TYPE => StatsConfig::from_json(&json),
                    t if WASM_TYPES.contains(&t) => StatsConfig::from_wasm_json(&json),
                    other => Err(format!("TypedStruct of {other} is not stats.PluginConfig")),
                }
            }
            t if WASM_TYPES.contains(&t) => {
                use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
                let w = Wasm::decode(a.value.as_slice())
                    .map_err(|e| format!("Wasm: cannot decode: {e}"))?;
                match w.config.and_then(|c| c.configuration) {
                    None => Ok(StatsConfig::default()),
                    Some(c) => StatsConfig::from_wasm_configuration(&c),
                }
            }
            other => Err(format!("{other} is not stats.PluginConfig")),
        }
    }

    /// The Wasm plugin's `configuration`: a StringValue of JSON (istiod up to 1.17), or the
    /// plugin config itself.
    fn from_wasm_configuration(c: &Any) -> Result<StatsConfig, String> {
        if c.type_url == STRING_VALUE_TYPE {
            let s = String::decode(c.value.as_slice())
                .map_err(|e| format!("configuration: cannot decode StringValue: {e}"))?;
            return StatsConfig::from_json_text(&s);
        }
        StatsConfig::from_any(c).map_err(|e| format!("configuration: {e}"))
    }

    /// A TypedStruct-wrapped Wasm filter, as JSON: `config.configuration`.
    fn from_wasm_json(w: &Json) -> Result<StatsConfig, String> {
        let c = &w["config"]["configuration"];
        match c.get("@type").and_then(Json::as_str) {
            None => Ok(StatsConfig::default()),
            Some(STRING_VALUE_TYPE) => {
                StatsConfig::from_json_text(c["value"].as_str().unwrap_or(""))
            }
            Some(STATS_TYPE) => StatsConfig::from_json(c),
            Some(other) => Err(format!(
                "configuration: {other} is not a StringValue or stats.PluginConfig"
            )),
        }
    }

    fn from_json_text(s: &str) -> Result<StatsConfig, String> {
        if s.trim().is_empty() {
            return Ok(StatsConfig::default());
        }
        let j: Json =
            serde_json::from_str(s).map_err(|e| format!("configuration: not JSON: {e}"))?;
        StatsConfig::from_json(&j)
    }

    fn from_proto(pb: &PluginConfigPb) -> StatsConfig {
        let mut raw = Raw {
            disable_host_header_fallback: pb.disable_host_header_fallback,
            tcp_reporting_duration: pb
                .tcp_reporting_duration
                .as_ref()
                .and_then(|d| crate::units::duration(d).ok()),
            reporter_gateway: pb.reporter == 1,
            metrics: Vec::new(),
            definitions: pb.definitions.iter().map(|d| d.name.clone()).collect(),
            warnings: Vec::new(),
        };
        for m in &pb.metrics {
            let mut dims: Vec<(String, String)> = m
                .dimensions
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            dims.sort();
            raw.metrics.push(RawMetric {
                name: m.name.clone(),
                dimensions: dims,
                tags_to_remove: m.tags_to_remove.clone(),
                drop: m.drop,
                has_match: !m.r#match.is_empty(),
            });
        }
        raw.build()
    }

    /// The config as proto-JSON (TypedStruct values, Wasm JSON strings); both field name
    /// spellings. Keys of older configs (`debug`, `stat_prefix`, `field_separator`, ...) are
    /// reserved in the proto and ignored here as istio-proxy ignores them.
    pub fn from_json(j: &Json) -> Result<StatsConfig, String> {
        let get = |a: &str, b: &str| j.get(a).or_else(|| j.get(b));
        if !j.is_object() && !j.is_null() {
            return Err("stats.PluginConfig: expected a JSON object".into());
        }
        let flag = |v: Option<&Json>| match v {
            Some(Json::Bool(b)) => Ok(*b),
            Some(Json::String(s)) if s == "true" => Ok(true),
            Some(Json::String(s)) if s == "false" || s.is_empty() => Ok(false),
            None | Some(Json::Null) => Ok(false),
            Some(other) => Err(format!("expected a bool, got {other}")),
        };
        let tcp = match get("tcp_reporting_duration", "tcpReportingDuration") {
            None | Some(Json::Null) => None,
            Some(Json::String(s)) => Some(
                parse_json_duration(s)
                    .ok_or_else(|| format!("tcp_reporting_duration: invalid duration '{s}'"))?,
            ),
            Some(other) => return Err(format!("tcp_reporting_duration: invalid duration {other}")),
        };
        let reporter_gateway = match get("reporter", "reporter") {
            None | Some(Json::Null) => false,
            Some(Json::String(s)) if s == "UNSPECIFIED" => false,
            Some(Json::String(s)) if s == "SERVER_GATEWAY" => true,
            Some(Json::Number(n)) => n.as_i64() == Some(1),
            Some(other) => return Err(format!("reporter: unknown value {other}")),
        };
        let mut raw = Raw {
            disable_host_header_fallback: flag(get(
                "disable_host_header_fallback",
                "disableHostHeaderFallback",
            ))
            .map_err(|e| format!("disable_host_header_fallback: {e}"))?,
            tcp_reporting_duration: tcp,
            reporter_gateway,
            metrics: Vec::new(),
            definitions: Vec::new(),
            warnings: Vec::new(),
        };
        if let Some(defs) = get("definitions", "definitions").and_then(Json::as_array) {
            for d in defs {
                raw.definitions
                    .push(d["name"].as_str().unwrap_or_default().to_string());
            }
        }
        match get("metrics", "metrics") {
            None | Some(Json::Null) => {}
            Some(Json::Array(ms)) => {
                for (i, m) in ms.iter().enumerate() {
                    let at = format!("metrics[{i}]");
                    let mut dims = Vec::new();
                    if let Some(d) = m.get("dimensions") {
                        let Some(obj) = d.as_object() else {
                            return Err(format!("{at}.dimensions: expected an object"));
                        };
                        for (k, v) in obj {
                            let Some(v) = v.as_str() else {
                                return Err(format!("{at}.dimensions.{k}: expected a string"));
                            };
                            dims.push((k.clone(), v.to_string()));
                        }
                    }
                    dims.sort();
                    let remove = m
                        .get("tags_to_remove")
                        .or_else(|| m.get("tagsToRemove"))
                        .and_then(Json::as_array)
                        .map(|a| {
                            a.iter()
                                .filter_map(|t| t.as_str().map(str::to_string))
                                .collect()
                        })
                        .unwrap_or_default();
                    raw.metrics.push(RawMetric {
                        name: m["name"].as_str().unwrap_or_default().to_string(),
                        dimensions: dims,
                        tags_to_remove: remove,
                        drop: flag(m.get("drop")).map_err(|e| format!("{at}.drop: {e}"))?,
                        has_match: m
                            .get("match")
                            .and_then(Json::as_str)
                            .is_some_and(|s| !s.is_empty()),
                    });
                }
            }
            Some(_) => return Err("metrics: expected a list".into()),
        }
        Ok(raw.build())
    }
}

/// The config's fields, whichever encoding they came in.
struct Raw {
    disable_host_header_fallback: bool,
    tcp_reporting_duration: Option<Duration>,
    reporter_gateway: bool,
    metrics: Vec<RawMetric>,
    definitions: Vec<String>,
    warnings: Vec<String>,
}

struct RawMetric {
    name: String,
    /// Sorted by tag name, as istio-proxy orders them.
    dimensions: Vec<(String, String)>,
    tags_to_remove: Vec<String>,
    drop: bool,
    has_match: bool,
}

impl Raw {
    /// istio-proxy's `Config` constructor: drops, then removed tags, then dimensions
    /// (overriding a standard tag, or added after them).
    fn build(self) -> StatsConfig {
        let mut cfg = StatsConfig {
            reporter: if self.reporter_gateway {
                Reporter::Waypoint
            } else {
                Reporter::Source
            },
            disable_host_header_fallback: self.disable_host_header_fallback,
            tcp_reporting_duration: self
                .tcp_reporting_duration
                .unwrap_or(Duration::from_secs(5)),
            plans: vec![MetricPlan::default(); Metric::ALL.len()],
            captures: Vec::new(),
            host_capture: None,
            warnings: self.warnings,
        }
        .with_host_capture();
        for d in &self.definitions {
            cfg.warnings.push(format!(
                "definitions '{d}': custom metric definitions are not reported by Portico"
            ));
        }
        for m in &self.metrics {
            // Which metrics this override applies to: one by name, or all.
            let targets: Vec<Metric> = if m.name.is_empty() {
                Metric::ALL.to_vec()
            } else {
                match Metric::ALL.iter().find(|x| x.config_name() == m.name) {
                    Some(x) => vec![*x],
                    None => {
                        cfg.warnings.push(format!(
                            "metrics '{}': not a standard metric; ignored",
                            m.name
                        ));
                        continue;
                    }
                }
            };
            if m.has_match {
                cfg.warnings.push(format!(
                    "metrics '{}': match is not implemented (as in istio-proxy)",
                    m.name
                ));
            }
            if m.drop {
                for t in &targets {
                    cfg.plans[*t as usize].drop = true;
                }
                continue;
            }
            for tag in &m.tags_to_remove {
                let Some(t) = Tag::from_name(tag) else {
                    cfg.warnings
                        .push(format!("tags_to_remove: '{tag}' is not a standard tag"));
                    continue;
                };
                for x in &targets {
                    cfg.plans[*x as usize].set_override(t, None);
                }
            }
            for (tag, expr) in &m.dimensions {
                let attr = cfg.parse_attr(expr);
                match Tag::from_name(tag) {
                    Some(t) => {
                        for x in &targets {
                            cfg.plans[*x as usize].set_override(t, Some(attr.clone()));
                        }
                    }
                    None => {
                        let name: Arc<str> = Arc::from(tag.as_str());
                        for x in &targets {
                            cfg.plans[*x as usize]
                                .additions
                                .push((name.clone(), attr.clone()));
                        }
                    }
                }
            }
        }
        cfg
    }
}

impl StatsConfig {
    /// A dimension's expression (see [`Attr`]).
    pub fn parse_attr(&mut self, expr: &str) -> Attr {
        let e = expr.trim();
        if let Some(lit) = string_literal(e) {
            return Attr::Literal(Arc::from(lit));
        }
        let index = |s: &str, head: &str| -> Option<String> {
            let rest = s.strip_prefix(head)?.strip_prefix('[')?.strip_suffix(']')?;
            string_literal(rest.trim()).map(str::to_string)
        };
        if let Some(h) = index(e, "request.headers") {
            let lower = h.to_ascii_lowercase();
            if lower == ":authority" || lower == "host" {
                return Attr::Request(self.capture(Capture::Host));
            }
            if let Ok(name) = http::HeaderName::from_bytes(lower.as_bytes()) {
                return Attr::Request(self.capture(Capture::Header(name)));
            }
        }
        if let Some(k) = index(e, "node.metadata") {
            return Attr::NodeMetadata(k);
        }
        for (head, up) in [("upstream_peer", true), ("downstream_peer", false)] {
            let field = if let Some(l) = index(e, &format!("{head}.labels")) {
                Some(PeerField::Label(l))
            } else {
                match e.strip_prefix(head).and_then(|r| r.strip_prefix('.')) {
                    Some("workload" | "workload_name") => Some(PeerField::Workload),
                    Some("namespace") => Some(PeerField::Namespace),
                    Some("cluster" | "cluster_id") => Some(PeerField::Cluster),
                    Some("service" | "canonical_service") => Some(PeerField::Service),
                    Some("revision" | "canonical_revision") => Some(PeerField::Revision),
                    Some("app") => Some(PeerField::App),
                    Some("version") => Some(PeerField::Version),
                    Some("name") => Some(PeerField::Name),
                    Some("identity") => Some(PeerField::Identity),
                    Some("type") => Some(PeerField::Type),
                    _ => None,
                }
            };
            if let Some(f) = field {
                return if up {
                    Attr::UpstreamPeer(f)
                } else {
                    Attr::DownstreamPeer(f)
                };
            }
        }
        let header = |n: &'static str| Capture::Header(http::HeaderName::from_static(n));
        let a = match e {
            "request.host" => Attr::Request(self.capture(Capture::Host)),
            "request.method" => Attr::Request(self.capture(Capture::Method)),
            "request.path" => Attr::Request(self.capture(Capture::Path)),
            "request.url_path" => Attr::Request(self.capture(Capture::UrlPath)),
            "request.scheme" => Attr::Request(self.capture(Capture::Scheme)),
            "request.useragent" => Attr::Request(self.capture(header("user-agent"))),
            "request.referer" => Attr::Request(self.capture(header("referer"))),
            "request.id" => Attr::Request(self.capture(header("x-request-id"))),
            "response.code" => Attr::ResponseCode,
            "response.grpc_status" => Attr::GrpcStatus,
            "response.code_details" => Attr::CodeDetails,
            "node.id" => Attr::NodeId,
            "node.cluster" => Attr::NodeCluster,
            "xds.cluster_name" => Attr::ClusterName,
            "xds.route_name" => Attr::RouteName,
            "connection.requested_server_name" => Attr::Sni,
            "connection.mtls" => Attr::Mtls,
            "source.address" => Attr::SourceAddress,
            "destination.address" => Attr::DestinationAddress,
            "upstream.address" => Attr::UpstreamAddress,
            _ => {
                self.warnings.push(format!(
                    "dimension expression '{expr}' is not supported by Portico; the dimension reports 'unknown'"
                ));
                Attr::Unknown
            }
        };
        a
    }
}

/// `'text'` or `"text"` (no escapes inside).
fn string_literal(s: &str) -> Option<&str> {
    let b = s.as_bytes();
    if b.len() >= 2 && (b[0] == b'\'' || b[0] == b'"') && b[b.len() - 1] == b[0] {
        let inner = &s[1..s.len() - 1];
        if !inner.contains(b[0] as char) && !inner.contains('\\') {
            return Some(inner);
        }
    }
    None
}

/// Proto-JSON durations: `"15s"`, `"0.5s"`.
fn parse_json_duration(s: &str) -> Option<Duration> {
    let secs: f64 = s.strip_suffix('s')?.parse().ok()?;
    (secs >= 0.0 && secs.is_finite()).then(|| Duration::from_secs_f64(secs))
}

/// A `google.protobuf.Struct` as JSON.
pub fn struct_to_json(s: &Struct) -> Json {
    Json::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value_to_json(v)))
            .collect(),
    )
}

fn value_to_json(v: &Value) -> Json {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Json::Null,
        Some(Kind::NumberValue(n)) => {
            serde_json::Number::from_f64(*n).map_or(Json::Null, Json::Number)
        }
        Some(Kind::StringValue(s)) => Json::String(s.clone()),
        Some(Kind::BoolValue(b)) => Json::Bool(*b),
        Some(Kind::StructValue(s)) => struct_to_json(s),
        Some(Kind::ListValue(l)) => Json::Array(l.values.iter().map(value_to_json).collect()),
    }
}

/// `io.istio.http.peer_metadata.Config`, as far as Portico acts on it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PeerMetadataConfig {
    /// Discovery methods for the downstream peer (request headers), in precedence order.
    pub downstream_discovery: Vec<Discovery>,
    /// For the upstream peer (response headers).
    pub upstream_discovery: Vec<Discovery>,
    /// `downstream_propagation` with `istio_headers`: the gateway's metadata on the response,
    /// when the request carried the peer's.
    pub downstream_propagation: Option<Propagation>,
    /// `upstream_propagation` with `istio_headers`: on every request sent upstream.
    pub upstream_propagation: Option<Propagation>,
    pub additional_labels: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Discovery {
    /// `istio_headers`: `x-envoy-peer-metadata[-id]` (removed once read).
    IstioHeaders,
    /// `baggage` (deprecated): the `baggage` header.
    Baggage,
    /// `workload_discovery`: needs Istio's workload metadata xDS, which Portico does not
    /// subscribe to; it finds nothing, as istio-proxy finds nothing without that bootstrap
    /// extension.
    WorkloadDiscovery,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Propagation {
    /// `skip_external_clusters`: not to clusters whose `istio` metadata says `external`.
    pub skip_external_clusters: bool,
}

mod pmpb {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Config {
        #[prost(message, repeated, tag = "1")]
        pub downstream_discovery: Vec<DiscoveryMethod>,
        #[prost(message, repeated, tag = "2")]
        pub upstream_discovery: Vec<DiscoveryMethod>,
        #[prost(message, repeated, tag = "3")]
        pub downstream_propagation: Vec<PropagationMethod>,
        #[prost(message, repeated, tag = "4")]
        pub upstream_propagation: Vec<PropagationMethod>,
        #[prost(bool, tag = "5")]
        pub shared_with_upstream: bool,
        #[prost(string, repeated, tag = "6")]
        pub additional_labels: Vec<String>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Empty {}
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct IstioHeaders {
        #[prost(bool, tag = "1")]
        pub skip_external_clusters: bool,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct DiscoveryMethod {
        #[prost(message, optional, tag = "1")]
        pub baggage: Option<Empty>,
        #[prost(message, optional, tag = "2")]
        pub workload_discovery: Option<Empty>,
        #[prost(message, optional, tag = "3")]
        pub istio_headers: Option<IstioHeaders>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PropagationMethod {
        #[prost(message, optional, tag = "1")]
        pub istio_headers: Option<IstioHeaders>,
    }
}

impl PeerMetadataConfig {
    /// From the plain `Any` or a TypedStruct holding it (istiod 1.22+).
    pub fn from_any(a: &Any) -> Result<PeerMetadataConfig, String> {
        if a.type_url == PEER_METADATA_TYPE {
            let pb = pmpb::Config::decode(a.value.as_slice())
                .map_err(|e| format!("peer_metadata.Config: cannot decode: {e}"))?;
            let disc = |v: &[pmpb::DiscoveryMethod]| {
                v.iter()
                    .filter_map(|m| {
                        if m.istio_headers.is_some() {
                            Some(Discovery::IstioHeaders)
                        } else if m.baggage.is_some() {
                            Some(Discovery::Baggage)
                        } else if m.workload_discovery.is_some() {
                            Some(Discovery::WorkloadDiscovery)
                        } else {
                            None
                        }
                    })
                    .collect()
            };
            let prop = |v: &[pmpb::PropagationMethod]| {
                v.iter().find_map(|m| {
                    m.istio_headers.as_ref().map(|h| Propagation {
                        skip_external_clusters: h.skip_external_clusters,
                    })
                })
            };
            return Ok(PeerMetadataConfig {
                downstream_discovery: disc(&pb.downstream_discovery),
                upstream_discovery: disc(&pb.upstream_discovery),
                downstream_propagation: prop(&pb.downstream_propagation),
                upstream_propagation: prop(&pb.upstream_propagation),
                additional_labels: pb.additional_labels,
            });
        }
        if TYPED_STRUCTS.contains(&a.type_url.as_str()) {
            let ts = TypedStruct::decode(a.value.as_slice())
                .map_err(|e| format!("TypedStruct: cannot decode: {e}"))?;
            if ts.type_url == PEER_METADATA_TYPE {
                let j = ts.value.as_ref().map_or(Json::Null, struct_to_json);
                return Ok(PeerMetadataConfig::from_json(&j));
            }
        }
        Err(format!(
            "{} is not io.istio.http.peer_metadata.Config",
            a.type_url
        ))
    }

    fn from_json(j: &Json) -> PeerMetadataConfig {
        let get = |a: &str, b: &str| j.get(a).or_else(|| j.get(b)).and_then(Json::as_array);
        let disc = |v: Option<&Vec<Json>>| {
            v.map(|v| {
                v.iter()
                    .filter_map(|m| {
                        if m.get("istio_headers")
                            .or_else(|| m.get("istioHeaders"))
                            .is_some()
                        {
                            Some(Discovery::IstioHeaders)
                        } else if m.get("baggage").is_some() {
                            Some(Discovery::Baggage)
                        } else if m
                            .get("workload_discovery")
                            .or_else(|| m.get("workloadDiscovery"))
                            .is_some()
                        {
                            Some(Discovery::WorkloadDiscovery)
                        } else {
                            None
                        }
                    })
                    .collect()
            })
            .unwrap_or_default()
        };
        let prop = |v: Option<&Vec<Json>>| {
            v.and_then(|v| {
                v.iter().find_map(|m| {
                    m.get("istio_headers")
                        .or_else(|| m.get("istioHeaders"))
                        .map(|h| Propagation {
                            skip_external_clusters: h
                                .get("skip_external_clusters")
                                .or_else(|| h.get("skipExternalClusters"))
                                .and_then(Json::as_bool)
                                .unwrap_or(false),
                        })
                })
            })
        };
        PeerMetadataConfig {
            downstream_discovery: disc(get("downstream_discovery", "downstreamDiscovery")),
            upstream_discovery: disc(get("upstream_discovery", "upstreamDiscovery")),
            downstream_propagation: prop(get("downstream_propagation", "downstreamPropagation")),
            upstream_propagation: prop(get("upstream_propagation", "upstreamPropagation")),
            additional_labels: get("additional_labels", "additionalLabels")
                .map(|v| {
                    v.iter()
                        .filter_map(|s| s.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// The 1.18-era null-VM `envoy.wasm.metadata_exchange` plugin: it exchanged the headers
    /// both ways, as `istio_headers` discovery and propagation do.
    pub fn legacy_wasm() -> PeerMetadataConfig {
        PeerMetadataConfig {
            downstream_discovery: vec![Discovery::IstioHeaders],
            upstream_discovery: vec![Discovery::IstioHeaders],
            downstream_propagation: Some(Propagation::default()),
            upstream_propagation: Some(Propagation::default()),
            additional_labels: Vec::new(),
        }
    }
}

/// The `istio` filter metadata of a cluster, as Istio's telemetry reads it (istiod writes
/// `services: [{host, name, namespace}]`, and `external`/`disable_mx` flags for the peer
/// metadata filter).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IstioClusterMetadata {
    /// The first service's `host`, `name` (else the host up to its first dot) and
    /// `namespace`.
    pub service: Option<IstioService>,
    pub external: bool,
    pub disable_mx: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IstioService {
    pub host: Arc<str>,
    pub name: Arc<str>,
    pub namespace: Arc<str>,
}

impl IstioClusterMetadata {
    /// From the cluster's `metadata.filter_metadata["istio"]`; None without it.
    pub fn from_metadata(s: &Struct) -> IstioClusterMetadata {
        fn str_of(v: Option<&Value>) -> Option<&str> {
            match v.and_then(|v| v.kind.as_ref()) {
                Some(Kind::StringValue(s)) => Some(s.as_str()),
                _ => None,
            }
        }
        let flag = |k: &str| {
            matches!(
                s.fields.get(k).and_then(|v| v.kind.as_ref()),
                Some(Kind::BoolValue(true))
            )
        };
        let service = match s.fields.get("services").and_then(|v| v.kind.as_ref()) {
            Some(Kind::ListValue(l)) => match l.values.first().and_then(|v| v.kind.as_ref()) {
                Some(Kind::StructValue(svc)) => {
                    let host = str_of(svc.fields.get("host")).unwrap_or("");
                    let name = match str_of(svc.fields.get("name")) {
                        Some(n) => n,
                        None => host.split('.').next().unwrap_or(""),
                    };
                    Some(IstioService {
                        host: Arc::from(host),
                        name: Arc::from(name),
                        namespace: Arc::from(str_of(svc.fields.get("namespace")).unwrap_or("")),
                    })
                }
                _ => None,
            },
            _ => None,
        };
        IstioClusterMetadata {
            service,
            external: flag("external"),
            disable_mx: flag("disable_mx"),
        }
    }
}

#[cfg(test)]
mod tests;
