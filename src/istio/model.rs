//! The Istio and Kubernetes objects the file-fed control plane reads (issue 4, work in
//! progress): only the fields the gateway translation uses, in the objects' own camelCase.
//! Unknown fields are kept out of the model, not rejected: operators' files carry many fields
//! a gateway ignores (status, annotations, sidecar-only settings).

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Metadata {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// `istio.io/dry-run` on an AuthorizationPolicy.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// RFC 3339, as Kubernetes writes it; istiod orders VirtualServices by it.
    #[serde(default)]
    pub creation_timestamp: Option<String>,
    /// The object's apiVersion (istiod names configs by it in route metadata).
    #[serde(skip)]
    pub api_version: String,
}

/// `networking.istio.io` Gateway.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GatewaySpec {
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
    #[serde(default)]
    pub servers: Vec<Server>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Server {
    pub port: ServerPort,
    #[serde(default)]
    pub hosts: Vec<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub tls: Option<ServerTls>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServerPort {
    pub number: u32,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub protocol: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServerTls {
    /// SIMPLE (the default), MUTUAL, OPTIONAL_MUTUAL, ISTIO_MUTUAL, PASSTHROUGH,
    /// AUTO_PASSTHROUGH.
    #[serde(default)]
    pub mode: Option<String>,
    /// A Kubernetes Secret, served over SDS as `kubernetes://<name>`.
    #[serde(default)]
    pub credential_name: Option<String>,
    #[serde(default)]
    pub https_redirect: bool,
    /// TLS_AUTO, TLSV1_0 .. TLSV1_3.
    #[serde(default)]
    pub min_protocol_version: Option<String>,
    #[serde(default)]
    pub max_protocol_version: Option<String>,
    #[serde(default)]
    pub cipher_suites: Vec<String>,
    #[serde(default)]
    pub ecdh_curves: Vec<String>,
    /// Client certificate SANs a MUTUAL server accepts.
    #[serde(default)]
    pub subject_alt_names: Vec<String>,
    #[serde(default)]
    pub verify_certificate_spki: Vec<String>,
    #[serde(default)]
    pub verify_certificate_hash: Vec<String>,
    /// File paths on the gateway pod (the pre-SDS way); only credentialName is served.
    #[serde(default)]
    pub server_certificate: Option<String>,
    #[serde(default)]
    pub private_key: Option<String>,
}

/// `networking.istio.io` VirtualService.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct VirtualServiceSpec {
    #[serde(default)]
    pub hosts: Vec<String>,
    #[serde(default)]
    pub gateways: Vec<String>,
    #[serde(default)]
    pub http: Vec<HttpRoute>,
    /// Opaque TCP routes (TCP servers, and TLS servers that terminate).
    #[serde(default)]
    pub tcp: Vec<TcpRoute>,
    /// SNI routes (PASSTHROUGH servers).
    #[serde(default)]
    pub tls: Vec<TlsRoute>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TcpRoute {
    #[serde(default, rename = "match")]
    pub matches: Vec<L4Match>,
    #[serde(default)]
    pub route: Vec<RouteDestination>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TlsRoute {
    #[serde(default, rename = "match")]
    pub matches: Vec<TlsMatch>,
    #[serde(default)]
    pub route: Vec<RouteDestination>,
}

/// The parts of an L4 match a gateway evaluates (source criteria are for sidecars).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct L4Match {
    #[serde(default)]
    pub port: Option<u32>,
    #[serde(default)]
    pub gateways: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TlsMatch {
    #[serde(default)]
    pub sni_hosts: Vec<String>,
    #[serde(default)]
    pub port: Option<u32>,
    #[serde(default)]
    pub gateways: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HttpRoute {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default, rename = "match")]
    pub matches: Vec<HttpMatch>,
    #[serde(default)]
    pub route: Vec<RouteDestination>,
    #[serde(default)]
    pub redirect: Option<Redirect>,
    #[serde(default)]
    pub direct_response: Option<DirectResponse>,
    #[serde(default)]
    pub delegate: Option<serde_yaml::Value>,
    #[serde(default)]
    pub rewrite: Option<Rewrite>,
    #[serde(default)]
    pub timeout: Option<String>,
    #[serde(default)]
    pub retries: Option<Retries>,
    #[serde(default)]
    pub fault: Option<Fault>,
    #[serde(default)]
    pub mirror: Option<Destination>,
    #[serde(default)]
    pub mirror_percentage: Option<Percent>,
    #[serde(default)]
    pub mirrors: Vec<Mirror>,
    #[serde(default)]
    pub headers: Option<Headers>,
    #[serde(default)]
    pub cors_policy: Option<CorsPolicy>,
}

/// Istio's StringMatch: one of exact, prefix, regex (checked when translated).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StringMatch {
    #[serde(default)]
    pub exact: Option<String>,
    #[serde(default)]
    pub prefix: Option<String>,
    #[serde(default)]
    pub regex: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HttpMatch {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub uri: Option<StringMatch>,
    #[serde(default)]
    pub method: Option<StringMatch>,
    #[serde(default)]
    pub authority: Option<StringMatch>,
    #[serde(default)]
    pub headers: BTreeMap<String, StringMatch>,
    #[serde(default)]
    pub query_params: BTreeMap<String, StringMatch>,
    #[serde(default)]
    pub without_headers: BTreeMap<String, StringMatch>,
    #[serde(default)]
    pub scheme: Option<StringMatch>,
    #[serde(default)]
    pub ignore_uri_case: bool,
    /// Restricts this match to these gateways (overrides the VirtualService's list).
    #[serde(default)]
    pub gateways: Vec<String>,
    #[serde(default)]
    pub port: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RouteDestination {
    pub destination: Destination,
    #[serde(default)]
    pub weight: Option<u32>,
    #[serde(default)]
    pub headers: Option<Headers>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Destination {
    pub host: String,
    #[serde(default)]
    pub subset: Option<String>,
    #[serde(default)]
    pub port: Option<PortSelector>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PortSelector {
    pub number: u32,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Rewrite {
    #[serde(default)]
    pub uri: Option<String>,
    #[serde(default)]
    pub authority: Option<String>,
    #[serde(default)]
    pub uri_regex_rewrite: Option<RegexRewrite>,
}

/// `networking.istio.io` DestinationRule.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DestinationRuleSpec {
    pub host: String,
    #[serde(default)]
    pub traffic_policy: Option<TrafficPolicy>,
    #[serde(default)]
    pub subsets: Vec<Subset>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Subset {
    pub name: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub traffic_policy: Option<TrafficPolicy>,
}

/// Kubernetes `v1` Service: the registry's names and ports.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceSpec {
    #[serde(default)]
    pub ports: Vec<ServicePort>,
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServicePort {
    #[serde(default)]
    pub name: Option<String>,
    pub port: u32,
    #[serde(default)]
    pub target_port: Option<serde_yaml::Value>,
    #[serde(default)]
    pub protocol: Option<String>,
}

/// `discovery.k8s.io/v1` EndpointSlice: a service's pod addresses. The service is named by the
/// `kubernetes.io/service-name` label. Subsets need pod labels: an endpoint either references a
/// Pod object in the directory (`targetRef`), or carries the labels itself in `labels` (a
/// Portico extension for files written by hand; not a Kubernetes field). Open question for the
/// translation: which of the two the bookinfo example uses.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EndpointSlice {
    #[serde(default)]
    pub address_type: Option<String>,
    #[serde(default)]
    pub endpoints: Vec<SliceEndpoint>,
    #[serde(default)]
    pub ports: Vec<SlicePort>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SliceEndpoint {
    #[serde(default)]
    pub addresses: Vec<String>,
    #[serde(default)]
    pub conditions: Option<Conditions>,
    #[serde(default)]
    pub target_ref: Option<TargetRef>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Conditions {
    #[serde(default)]
    pub ready: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TargetRef {
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SlicePort {
    #[serde(default)]
    pub name: Option<String>,
    pub port: u32,
    #[serde(default)]
    pub protocol: Option<String>,
}

/// `v1` Pod: only its labels and IP matter (subset selection).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    #[serde(default, rename = "podIP")]
    pub pod_ip: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Redirect {
    #[serde(default)]
    pub uri: Option<String>,
    #[serde(default)]
    pub authority: Option<String>,
    #[serde(default)]
    pub port: Option<u32>,
    #[serde(default)]
    pub derive_port: Option<String>,
    #[serde(default)]
    pub scheme: Option<String>,
    #[serde(default)]
    pub redirect_code: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DirectResponse {
    pub status: u32,
    #[serde(default)]
    pub body: Option<DirectBody>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DirectBody {
    #[serde(default)]
    pub string: Option<String>,
    /// Base64, as in the CRD.
    #[serde(default)]
    pub bytes: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RegexRewrite {
    #[serde(rename = "match")]
    pub pattern: String,
    #[serde(default)]
    pub rewrite: String,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Retries {
    #[serde(default)]
    pub attempts: Option<i64>,
    #[serde(default)]
    pub per_try_timeout: Option<String>,
    #[serde(default)]
    pub retry_on: Option<String>,
    #[serde(default)]
    pub retry_remote_localities: Option<bool>,
}

/// Istio's `Percent` (a double, 0-100).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct Percent {
    #[serde(default)]
    pub value: f64,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Fault {
    #[serde(default)]
    pub delay: Option<FaultDelay>,
    #[serde(default)]
    pub abort: Option<FaultAbort>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FaultDelay {
    #[serde(default)]
    pub fixed_delay: Option<String>,
    #[serde(default)]
    pub percentage: Option<Percent>,
    /// Deprecated integer percent, still honoured by istiod.
    #[serde(default)]
    pub percent: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FaultAbort {
    #[serde(default)]
    pub http_status: Option<u32>,
    #[serde(default)]
    pub grpc_status: Option<String>,
    #[serde(default)]
    pub percentage: Option<Percent>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Mirror {
    pub destination: Destination,
    #[serde(default)]
    pub percentage: Option<Percent>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Headers {
    #[serde(default)]
    pub request: Option<HeaderOps>,
    #[serde(default)]
    pub response: Option<HeaderOps>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HeaderOps {
    #[serde(default)]
    pub set: BTreeMap<String, String>,
    #[serde(default)]
    pub add: BTreeMap<String, String>,
    #[serde(default)]
    pub remove: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CorsPolicy {
    #[serde(default)]
    pub allow_origins: Vec<StringMatch>,
    /// Deprecated exact-origin list.
    #[serde(default)]
    pub allow_origin: Vec<String>,
    #[serde(default)]
    pub allow_methods: Vec<String>,
    #[serde(default)]
    pub allow_headers: Vec<String>,
    #[serde(default)]
    pub expose_headers: Vec<String>,
    #[serde(default)]
    pub max_age: Option<String>,
    #[serde(default)]
    pub allow_credentials: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TrafficPolicy {
    #[serde(default)]
    pub load_balancer: Option<LoadBalancer>,
    #[serde(default)]
    pub connection_pool: Option<ConnectionPool>,
    #[serde(default)]
    pub outlier_detection: Option<OutlierDetection>,
    #[serde(default)]
    pub tls: Option<serde_yaml::Value>,
    #[serde(default)]
    pub port_level_settings: Vec<PortTrafficPolicy>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PortTrafficPolicy {
    #[serde(default)]
    pub port: Option<PortSelector>,
    #[serde(default)]
    pub load_balancer: Option<LoadBalancer>,
    #[serde(default)]
    pub connection_pool: Option<ConnectionPool>,
    #[serde(default)]
    pub outlier_detection: Option<OutlierDetection>,
    #[serde(default)]
    pub tls: Option<serde_yaml::Value>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancer {
    #[serde(default)]
    pub simple: Option<String>,
    #[serde(default)]
    pub consistent_hash: Option<ConsistentHash>,
    /// Slow start for round robin and least request (a duration such as `60s`).
    #[serde(default)]
    pub warmup_duration_secs: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConsistentHash {
    #[serde(default)]
    pub http_header_name: Option<String>,
    #[serde(default)]
    pub http_cookie: Option<HttpCookie>,
    #[serde(default)]
    pub use_source_ip: Option<bool>,
    #[serde(default)]
    pub http_query_parameter_name: Option<String>,
    #[serde(default)]
    pub ring_hash: Option<RingHash>,
    #[serde(default)]
    pub maglev: Option<Maglev>,
    /// Deprecated: ring hash with this minimum size.
    #[serde(default)]
    pub minimum_ring_size: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HttpCookie {
    pub name: String,
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub ttl: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RingHash {
    #[serde(default)]
    pub minimum_ring_size: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Maglev {
    #[serde(default)]
    pub table_size: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionPool {
    #[serde(default)]
    pub tcp: Option<TcpSettings>,
    #[serde(default)]
    pub http: Option<HttpSettings>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TcpSettings {
    #[serde(default)]
    pub max_connections: Option<u32>,
    #[serde(default)]
    pub connect_timeout: Option<String>,
    #[serde(default)]
    pub tcp_keepalive: Option<TcpKeepalive>,
    #[serde(default)]
    pub max_connection_duration: Option<String>,
    #[serde(default)]
    pub idle_timeout: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct TcpKeepalive {
    #[serde(default)]
    pub probes: Option<u32>,
    #[serde(default)]
    pub time: Option<String>,
    #[serde(default)]
    pub interval: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HttpSettings {
    #[serde(default)]
    pub http1_max_pending_requests: Option<u32>,
    #[serde(default)]
    pub http2_max_requests: Option<u32>,
    #[serde(default)]
    pub max_requests_per_connection: Option<u32>,
    #[serde(default)]
    pub max_retries: Option<u32>,
    #[serde(default)]
    pub idle_timeout: Option<String>,
    #[serde(default)]
    pub h2_upgrade_policy: Option<String>,
    #[serde(default)]
    pub max_concurrent_streams: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OutlierDetection {
    /// Deprecated alias of consecutive5xxErrors (as gateway errors in old Istio).
    #[serde(default)]
    pub consecutive_errors: Option<u32>,
    #[serde(default)]
    pub consecutive_5xx_errors: Option<u32>,
    #[serde(default)]
    pub consecutive_gateway_errors: Option<u32>,
    #[serde(default)]
    pub interval: Option<String>,
    #[serde(default)]
    pub base_ejection_time: Option<String>,
    #[serde(default)]
    pub max_ejection_percent: Option<u32>,
    #[serde(default)]
    pub min_health_percent: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceEntrySpec {
    #[serde(default)]
    pub hosts: Vec<String>,
    #[serde(default)]
    pub ports: Vec<ServiceEntryPort>,
    #[serde(default)]
    pub location: Option<String>,
    #[serde(default)]
    pub resolution: Option<String>,
    #[serde(default)]
    pub endpoints: Vec<WorkloadEntrySpec>,
    #[serde(default)]
    pub workload_selector: Option<WorkloadSelector>,
    #[serde(default)]
    pub export_to: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ServiceEntryPort {
    pub number: u32,
    #[serde(default)]
    pub protocol: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub target_port: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadSelector {
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadEntrySpec {
    #[serde(default)]
    pub address: String,
    #[serde(default)]
    pub ports: BTreeMap<String, u32>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub weight: Option<u32>,
    #[serde(default)]
    pub locality: Option<String>,
}

/// Kubernetes `v1` Secret: its keys, base64-decoded (`data`) or as written (`stringData`,
/// which wins, as the API server merges it). Never printed: Debug shows the key names only.
#[derive(Clone, Default, PartialEq)]
pub struct SecretData {
    pub type_: Option<String>,
    pub data: BTreeMap<String, Vec<u8>>,
}

impl std::fmt::Debug for SecretData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretData")
            .field("type", &self.type_)
            .field("keys", &self.data.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl SecretData {
    /// A key that is present and not empty (istiod treats empty values as missing).
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.data
            .get(key)
            .map(Vec::as_slice)
            .filter(|v| !v.is_empty())
    }

    /// Reads a Secret's top-level `type`, `data` and `stringData`. The messages name keys,
    /// never values: a secret's content must not reach a log.
    fn parse(rest: &BTreeMap<String, serde_yaml::Value>) -> Result<SecretData, String> {
        use base64::Engine;
        let mut out = SecretData::default();
        match rest.get("type") {
            None | Some(serde_yaml::Value::Null) => {}
            Some(serde_yaml::Value::String(t)) => out.type_ = Some(t.clone()),
            Some(_) => return Err("type: must be a string".into()),
        }
        let map = |field: &str| -> Result<Vec<(String, String)>, String> {
            match rest.get(field) {
                None | Some(serde_yaml::Value::Null) => Ok(Vec::new()),
                Some(serde_yaml::Value::Mapping(m)) => m
                    .iter()
                    .map(|(k, v)| match (k, v) {
                        (serde_yaml::Value::String(k), serde_yaml::Value::String(v)) => {
                            Ok((k.clone(), v.clone()))
                        }
                        (serde_yaml::Value::String(k), _) => {
                            Err(format!("{field}.{k}: must be a string"))
                        }
                        _ => Err(format!("{field}: keys must be strings")),
                    })
                    .collect(),
                Some(_) => Err(format!("{field}: must be a map of strings")),
            }
        };
        for (k, v) in map("data")? {
            // The API server stores standard base64; line breaks are tolerated in files.
            let compact: String = v.split_ascii_whitespace().collect();
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(compact.as_bytes())
                .map_err(|_| format!("data.{k}: not valid base64"))?;
            out.data.insert(k, bytes);
        }
        for (k, v) in map("stringData")? {
            out.data.insert(k, v.into_bytes());
        }
        Ok(out)
    }
}

/// One object of any kind the control plane reads.
#[derive(Debug, Clone, PartialEq)]
// A config directory holds tens to thousands of objects, read once per change: boxing the
// larger specs would buy nothing measurable.
#[allow(clippy::large_enum_variant)]
pub enum Object {
    Gateway(Metadata, GatewaySpec),
    VirtualService(Metadata, VirtualServiceSpec),
    DestinationRule(Metadata, DestinationRuleSpec),
    Service(Metadata, ServiceSpec),
    EndpointSlice(Metadata, EndpointSlice),
    Pod(Metadata, PodStatus),
    ServiceEntry(Metadata, ServiceEntrySpec),
    WorkloadEntry(Metadata, WorkloadEntrySpec),
    Secret(Metadata, SecretData),
    AuthorizationPolicy(Metadata, super::authz::AuthorizationPolicySpec),
    RequestAuthentication(Metadata, super::authn::RequestAuthenticationSpec),
    /// Istio's mesh config: the `mesh` key of a ConfigMap (`istio` in `istio-system`).
    MeshConfig(Metadata, super::authz::MeshConfig),
    /// Read and checked; no effect at a gateway (see [`PeerAuthenticationSpec`]).
    PeerAuthentication(Metadata, PeerAuthenticationSpec),
}

/// `security.istio.io` PeerAuthentication. istiod applies it to the inbound listeners of
/// sidecars and waypoints only: a gateway's listeners take their TLS from the Gateway's
/// servers, so at a gateway it changes nothing, and this control plane reads it only to
/// check it (a typo is still reported).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PeerAuthenticationSpec {
    #[serde(default)]
    pub selector: Option<super::authz::WorkloadSelector>,
    #[serde(default)]
    pub mtls: Option<PeerMtls>,
    #[serde(default)]
    pub port_level_mtls: BTreeMap<String, PeerMtls>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerMtls {
    #[serde(default)]
    pub mode: Option<PeerMtlsMode>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum PeerMtlsMode {
    Unset,
    Disable,
    Permissive,
    Strict,
}

impl Object {
    pub fn kind(&self) -> &'static str {
        match self {
            Object::Gateway(..) => "Gateway",
            Object::VirtualService(..) => "VirtualService",
            Object::DestinationRule(..) => "DestinationRule",
            Object::Service(..) => "Service",
            Object::EndpointSlice(..) => "EndpointSlice",
            Object::Pod(..) => "Pod",
            Object::ServiceEntry(..) => "ServiceEntry",
            Object::WorkloadEntry(..) => "WorkloadEntry",
            Object::Secret(..) => "Secret",
            Object::AuthorizationPolicy(..) => "AuthorizationPolicy",
            Object::RequestAuthentication(..) => "RequestAuthentication",
            Object::MeshConfig(..) => "ConfigMap",
            Object::PeerAuthentication(..) => "PeerAuthentication",
        }
    }

    pub fn metadata(&self) -> &Metadata {
        match self {
            Object::Gateway(m, _)
            | Object::VirtualService(m, _)
            | Object::DestinationRule(m, _)
            | Object::Service(m, _)
            | Object::EndpointSlice(m, _)
            | Object::Pod(m, _)
            | Object::ServiceEntry(m, _)
            | Object::WorkloadEntry(m, _)
            | Object::Secret(m, _)
            | Object::AuthorizationPolicy(m, _)
            | Object::RequestAuthentication(m, _)
            | Object::MeshConfig(m, _)
            | Object::PeerAuthentication(m, _) => m,
        }
    }
}

/// An object that could not be read: file, kind, name and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub file: String,
    pub kind: String,
    pub name: String,
    pub reason: String,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} '{}': {}",
            self.file, self.kind, self.name, self.reason
        )
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope {
    #[serde(default)]
    api_version: String,
    #[serde(default)]
    kind: String,
    #[serde(default)]
    metadata: Metadata,
    #[serde(default)]
    spec: serde_yaml::Value,
    #[serde(default)]
    status: serde_yaml::Value,
    /// EndpointSlice keeps its content at the top level, not under `spec`.
    #[serde(flatten)]
    rest: BTreeMap<String, serde_yaml::Value>,
}

const ISTIO_VERSIONS: [&str; 3] = [
    "networking.istio.io/v1",
    "networking.istio.io/v1beta1",
    "networking.istio.io/v1alpha3",
];

/// Reads every document of one YAML file. Good objects come back in `ok`; each bad one is
/// reported and skipped, so one typo does not take the rest of the file down.
pub fn parse_file(file: &str, text: &str) -> (Vec<Object>, Vec<Invalid>) {
    let mut ok = Vec::new();
    let mut bad = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = match serde_yaml::Value::deserialize(doc) {
            Ok(serde_yaml::Value::Null) => continue,
            Ok(v) => v,
            Err(e) => {
                bad.push(Invalid {
                    file: file.into(),
                    kind: "?".into(),
                    name: format!("document {i}"),
                    reason: format!("not YAML: {e}"),
                });
                // The parser cannot resynchronise after a syntax error.
                break;
            }
        };
        let env: Envelope = match serde_yaml::from_value(value) {
            Ok(e) => e,
            Err(e) => {
                bad.push(Invalid {
                    file: file.into(),
                    kind: "?".into(),
                    name: format!("document {i}"),
                    reason: e.to_string(),
                });
                continue;
            }
        };
        let mut env = env;
        env.metadata.api_version = env.api_version.clone();
        let invalid = |reason: String| Invalid {
            file: file.into(),
            kind: env.kind.clone(),
            name: format!(
                "{}/{}",
                env.metadata.namespace.as_deref().unwrap_or("default"),
                env.metadata.name
            ),
            reason,
        };
        let istio = ISTIO_VERSIONS.contains(&env.api_version.as_str());
        let parsed = match (env.kind.as_str(), istio, env.api_version.as_str()) {
            ("Gateway", true, _) => {
                spec(&env.spec).map(|s| Object::Gateway(env.metadata.clone(), s))
            }
            ("VirtualService", true, _) => {
                spec(&env.spec).map(|s| Object::VirtualService(env.metadata.clone(), s))
            }
            ("DestinationRule", true, _) => {
                spec(&env.spec).map(|s| Object::DestinationRule(env.metadata.clone(), s))
            }
            ("ServiceEntry", true, _) => {
                spec(&env.spec).map(|s| Object::ServiceEntry(env.metadata.clone(), s))
            }
            ("WorkloadEntry", true, _) => {
                spec(&env.spec).map(|s| Object::WorkloadEntry(env.metadata.clone(), s))
            }
            ("Service", _, "v1") => {
                spec(&env.spec).map(|s| Object::Service(env.metadata.clone(), s))
            }
            ("EndpointSlice", _, "discovery.k8s.io/v1") => {
                let top = serde_yaml::to_value(&env.rest).map_err(|e| e.to_string());
                top.and_then(|v| spec(&v))
                    .map(|s| Object::EndpointSlice(env.metadata.clone(), s))
            }
            ("AuthorizationPolicy", _, "security.istio.io/v1" | "security.istio.io/v1beta1") => {
                spec(&env.spec).map(|s| Object::AuthorizationPolicy(env.metadata.clone(), s))
            }
            ("RequestAuthentication", _, "security.istio.io/v1" | "security.istio.io/v1beta1") => {
                spec(&env.spec).map(|s| Object::RequestAuthentication(env.metadata.clone(), s))
            }
            ("PeerAuthentication", _, "security.istio.io/v1" | "security.istio.io/v1beta1") => {
                spec(&env.spec).map(|s| Object::PeerAuthentication(env.metadata.clone(), s))
            }
            ("ConfigMap", _, "v1") => match env.rest.get("data").and_then(|d| d.get("mesh")) {
                Some(serde_yaml::Value::String(mesh)) => serde_yaml::from_str(mesh)
                    .map_err(|e| format!("data.mesh: {e}"))
                    .map(|m| Object::MeshConfig(env.metadata.clone(), m)),
                _ => Err(
                    "unsupported ConfigMap: only Istio's mesh config (data.mesh) is read".into(),
                ),
            },
            ("Pod", _, "v1") => spec(&env.status).map(|s| Object::Pod(env.metadata.clone(), s)),
            // Like EndpointSlice, a Secret keeps its content at the top level.
            ("Secret", _, "v1") => {
                SecretData::parse(&env.rest).map(|s| Object::Secret(env.metadata.clone(), s))
            }
            (kind, _, version) => Err(format!("unsupported kind {kind} in {version}")),
        };
        match parsed {
            Ok(_) if env.metadata.name.is_empty() => {
                bad.push(invalid("metadata.name is required".into()));
            }
            Ok(o) => ok.push(o),
            Err(e) => bad.push(invalid(e)),
        }
    }
    (ok, bad)
}

/// Deserialises one object's body, naming the field that is wrong (`spec.http[0].route: ...`).
fn spec<T: serde::de::DeserializeOwned>(v: &serde_yaml::Value) -> Result<T, String> {
    serde_path_to_error::deserialize(v.clone()).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            format!("spec: {inner}")
        } else {
            format!("spec.{path}: {inner}")
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOOKINFO: &str = r#"
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: { name: bookinfo-gateway, namespace: default }
spec:
  selector: { istio: ingressgateway }
  servers:
  - port: { number: 8080, name: http, protocol: HTTP }
    hosts: ["*"]
---
apiVersion: networking.istio.io/v1beta1
kind: VirtualService
metadata: { name: reviews }
spec:
  hosts: ["*"]
  gateways: [bookinfo-gateway]
  http:
  - match:
    - headers: { end-user: { exact: jason } }
      uri: { prefix: /reviews }
    route:
    - destination: { host: reviews, subset: v2, port: { number: 9080 } }
  - route:
    - destination: { host: reviews, subset: v1 }
      weight: 50
    - destination: { host: reviews, subset: v3 }
      weight: 50
---
apiVersion: networking.istio.io/v1alpha3
kind: DestinationRule
metadata: { name: reviews }
spec:
  host: reviews
  subsets:
  - { name: v1, labels: { version: v1 } }
  - { name: v2, labels: { version: v2 } }
---
apiVersion: v1
kind: Service
metadata: { name: reviews, labels: { app: reviews } }
spec:
  selector: { app: reviews }
  ports: [{ name: http, port: 9080 }]
"#;

    #[test]
    fn bookinfo_objects_are_read_in_every_api_version() {
        let (ok, bad) = parse_file("bookinfo.yaml", BOOKINFO);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(ok.len(), 4);
        let Object::VirtualService(m, vs) = &ok[1] else {
            panic!("{:?}", ok[1]);
        };
        assert_eq!(m.name, "reviews");
        assert_eq!(
            vs.http[0].matches[0].headers.get("end-user"),
            Some(&StringMatch {
                exact: Some("jason".into()),
                ..Default::default()
            })
        );
        assert_eq!(vs.http[1].route[1].weight, Some(50));
        let Object::DestinationRule(_, dr) = &ok[2] else {
            panic!("{:?}", ok[2]);
        };
        assert_eq!(
            dr.subsets[1].labels.get("version").map(String::as_str),
            Some("v2")
        );
    }

    #[test]
    fn endpoint_slices_and_pods_are_read() {
        let text = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: { name: reviews-abc, labels: { kubernetes.io/service-name: reviews } }
addressType: IPv4
ports: [{ name: http, port: 9080, protocol: TCP }]
endpoints:
- addresses: [10.1.0.7]
  conditions: { ready: true }
  targetRef: { kind: Pod, name: reviews-v1-xyz }
- addresses: [10.1.0.8]
  labels: { app: reviews, version: v2 }
---
apiVersion: v1
kind: Pod
metadata: { name: reviews-v1-xyz, labels: { app: reviews, version: v1 } }
status: { podIP: 10.1.0.7 }
"#;
        let (ok, bad) = parse_file("eps.yaml", text);
        assert!(bad.is_empty(), "{bad:?}");
        let Object::EndpointSlice(m, es) = &ok[0] else {
            panic!("{:?}", ok[0]);
        };
        assert_eq!(
            m.labels
                .get("kubernetes.io/service-name")
                .map(String::as_str),
            Some("reviews")
        );
        assert_eq!(es.ports[0].port, 9080);
        assert_eq!(
            es.endpoints[0].target_ref.as_ref().map(|t| t.name.as_str()),
            Some("reviews-v1-xyz")
        );
        assert_eq!(
            es.endpoints[1].labels.get("version").map(String::as_str),
            Some("v2")
        );
        let Object::Pod(p, st) = &ok[1] else {
            panic!("{:?}", ok[1]);
        };
        assert_eq!(p.labels.get("version").map(String::as_str), Some("v1"));
        assert_eq!(st.pod_ip.as_deref(), Some("10.1.0.7"));
    }

    #[test]
    fn a_bad_object_is_reported_by_file_kind_and_name_and_the_rest_is_kept() {
        let text = r#"
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: { name: broken }
spec:
  hosts: ["*"]
  http:
  - route:
    - destination: { subset: v1 }
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: { name: fine }
spec: { host: reviews }
---
apiVersion: apps/v1
kind: Deployment
metadata: { name: app }
"#;
        let (ok, bad) = parse_file("routes.yaml", text);
        assert_eq!(ok.len(), 1);
        assert_eq!(bad.len(), 2, "{bad:?}");
        assert_eq!(
            (bad[0].kind.as_str(), bad[0].name.as_str()),
            ("VirtualService", "default/broken")
        );
        assert!(bad[0].reason.contains("host"), "{}", bad[0]);
        assert!(bad[0]
            .to_string()
            .starts_with("routes.yaml: VirtualService 'default/broken': "));
        assert!(
            bad[1].reason.contains("unsupported kind Deployment"),
            "{}",
            bad[1]
        );
    }
}
