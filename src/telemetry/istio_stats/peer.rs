//! Istio's peer metadata: a workload's identity as Istio's telemetry labels read it (istio-proxy's
//! `WorkloadMetadataObject`), where it comes from (the gateway's own bootstrap `node.metadata`,
//! an endpoint's `istio.workload` metadata, a peer's `x-envoy-peer-metadata` header or
//! `baggage`), and the header value the gateway announces itself with.

use std::collections::BTreeMap;
use std::sync::Arc;

use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use prost::Message;

/// `x-envoy-peer-metadata-id`: the peer's node id (names parsed once, for the request path).
pub static PEER_ID_HEADER_NAME: http::HeaderName =
    http::HeaderName::from_static("x-envoy-peer-metadata-id");
/// `x-envoy-peer-metadata`: base64 of a serialized `google.protobuf.Struct`.
pub static PEER_HEADER_NAME: http::HeaderName =
    http::HeaderName::from_static("x-envoy-peer-metadata");

const CANONICAL_NAME: &str = "service.istio.io/canonical-name";
const CANONICAL_REVISION: &str = "service.istio.io/canonical-revision";
const OWNER_PREFIX: &str = "kubernetes://apis/apps/v1/namespaces/";

/// The owner kinds istio-proxy recognises in `OWNER` (`.../<kind>s/<workload>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WorkloadType {
    #[default]
    Unknown,
    Pod,
    Deployment,
    Job,
    CronJob,
}

impl WorkloadType {
    fn suffix(self) -> Option<&'static str> {
        match self {
            WorkloadType::Unknown => None,
            WorkloadType::Pod => Some("pod"),
            WorkloadType::Deployment => Some("deployment"),
            WorkloadType::Job => Some("job"),
            WorkloadType::CronJob => Some("cronjob"),
        }
    }

    fn from_suffix(s: &str) -> WorkloadType {
        match s {
            "pod" => WorkloadType::Pod,
            "deployment" => WorkloadType::Deployment,
            "job" => WorkloadType::Job,
            "cronjob" => WorkloadType::CronJob,
            _ => WorkloadType::Unknown,
        }
    }

    /// istio-proxy's `parseOwner`: strip `s/<workload>` and read the last path segment.
    fn parse_owner(owner: &str, workload: &str) -> WorkloadType {
        if owner.len() > workload.len() + 2 {
            let head = &owner[..owner.len() - workload.len() - 2];
            if let Some(i) = head.rfind('/') {
                return WorkloadType::from_suffix(&head[i + 1..]);
            }
        }
        WorkloadType::Unknown
    }
}

/// One workload's identity as Istio's telemetry reads it. Empty strings are "not known".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PeerInfo {
    /// The pod (`NAME`).
    pub instance: String,
    pub cluster: String,
    pub namespace: String,
    pub workload: String,
    pub canonical_name: String,
    pub canonical_revision: String,
    pub app: String,
    pub version: String,
    pub workload_type: WorkloadType,
    /// The SPIFFE identity, when known (endpoint metadata carries none).
    pub identity: String,
    /// `additional_labels` the peer metadata filter was asked to keep.
    pub labels: Vec<(String, String)>,
}

fn string_of(v: &Value) -> &str {
    match &v.kind {
        Some(Kind::StringValue(s)) => s,
        _ => "",
    }
}

impl PeerInfo {
    /// istio-proxy's `convertStructToWorkloadMetadata`: from node metadata or a peer's
    /// exchanged metadata (`NAME`, `NAMESPACE`, `OWNER`, `WORKLOAD_NAME`, `CLUSTER_ID`,
    /// `LABELS`). `additional` names further labels to keep.
    pub fn from_struct(s: &Struct, additional: &[String]) -> PeerInfo {
        let mut p = PeerInfo::default();
        let mut owner = "";
        for (k, v) in &s.fields {
            match k.as_str() {
                "NAME" => p.instance = string_of(v).to_string(),
                "NAMESPACE" => p.namespace = string_of(v).to_string(),
                "OWNER" => owner = string_of(v),
                "WORKLOAD_NAME" => p.workload = string_of(v).to_string(),
                "CLUSTER_ID" => p.cluster = string_of(v).to_string(),
                "LABELS" => {
                    if let Some(Kind::StructValue(l)) = &v.kind {
                        for (lk, lv) in &l.fields {
                            match lk.as_str() {
                                CANONICAL_NAME => p.canonical_name = string_of(lv).to_string(),
                                CANONICAL_REVISION => {
                                    p.canonical_revision = string_of(lv).to_string()
                                }
                                "app" => p.app = string_of(lv).to_string(),
                                "version" => p.version = string_of(lv).to_string(),
                                other if additional.iter().any(|a| a == other) => p
                                    .labels
                                    .push((other.to_string(), string_of(lv).to_string())),
                                _ => {}
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        p.labels.sort();
        p.workload_type = WorkloadType::parse_owner(owner, &p.workload);
        p
    }

    /// istio-proxy's `convertEndpointMetadata`: the endpoint's `istio` filter metadata field
    /// `workload`, `name;namespace;canonical_service;canonical_revision;cluster`. Fewer than
    /// five parts: None.
    pub fn from_endpoint(s: &str) -> Option<PeerInfo> {
        let parts: Vec<&str> = s.split(';').collect();
        if parts.len() < 5 {
            return None;
        }
        Some(PeerInfo {
            cluster: parts[4].to_string(),
            namespace: parts[1].to_string(),
            workload: parts[0].to_string(),
            canonical_name: parts[2].to_string(),
            canonical_revision: parts[3].to_string(),
            ..PeerInfo::default()
        })
    }

    /// istio-proxy's `convertBaggageToWorkloadMetadata` (the deprecated baggage discovery):
    /// `k8s.namespace.name=..,service.name=..` style pairs, also the short tokens.
    pub fn from_baggage(s: &str) -> PeerInfo {
        let mut p = PeerInfo::default();
        for prop in s.split(',') {
            let (k, v) = prop.trim().split_once('=').unwrap_or((prop.trim(), ""));
            let v = v.to_string();
            match k {
                "namespace" | "k8s.namespace.name" => p.namespace = v,
                "cluster" | "k8s.cluster.name" => p.cluster = v,
                "service" | "service.name" => p.canonical_name = v,
                "revision" | "service.version" => p.canonical_revision = v,
                "app" | "app.name" => p.app = v,
                "version" | "app.version" => p.version = v,
                "workload" => p.workload = v,
                "k8s.deployment.name" => {
                    p.workload = v;
                    p.workload_type = WorkloadType::Deployment;
                }
                "k8s.pod.name" => {
                    p.workload = v;
                    p.workload_type = WorkloadType::Pod;
                }
                "k8s.job.name" => {
                    p.workload = v;
                    p.workload_type = WorkloadType::Job;
                }
                "k8s.cronjob.name" => {
                    p.workload = v;
                    p.workload_type = WorkloadType::CronJob;
                }
                "type" => p.workload_type = WorkloadType::from_suffix(&v),
                "name" | "k8s.instance.name" => p.instance = v,
                _ => {}
            }
        }
        p
    }

    /// The peer's `x-envoy-peer-metadata` value: base64 (with padding) of a serialized Struct.
    /// None when it is not one.
    pub fn from_header(value: &[u8], additional: &[String]) -> Option<PeerInfo> {
        let bytes = base64_decode(value)?;
        let s = Struct::decode(bytes.as_slice()).ok()?;
        Some(PeerInfo::from_struct(&s, additional))
    }

    /// istio-proxy's `owner()`: `kubernetes://apis/apps/v1/namespaces/<ns>/<kind>s/<workload>`.
    fn owner(&self) -> Option<String> {
        let suffix = self.workload_type.suffix()?;
        Some(format!(
            "{OWNER_PREFIX}{}/{suffix}s/{}",
            self.namespace, self.workload
        ))
    }

    /// istio-proxy's `convertWorkloadMetadataToStruct`, serialized deterministically (map keys
    /// sorted, as protobuf's deterministic serialization writes them): the bytes the
    /// `x-envoy-peer-metadata` header carries in base64.
    pub fn to_struct_bytes(&self) -> Vec<u8> {
        let mut top: BTreeMap<&str, Field> = BTreeMap::new();
        let mut put = |k: &'static str, v: &str| {
            if !v.is_empty() {
                top.insert(k, Field::Str(v.to_string()));
            }
        };
        put("NAME", &self.instance);
        put("NAMESPACE", &self.namespace);
        put("WORKLOAD_NAME", &self.workload);
        put("CLUSTER_ID", &self.cluster);
        let mut labels: BTreeMap<&str, &str> = BTreeMap::new();
        for (k, v) in [
            (CANONICAL_NAME, &self.canonical_name),
            (CANONICAL_REVISION, &self.canonical_revision),
            ("app", &self.app),
            ("version", &self.version),
        ] {
            if !v.is_empty() {
                labels.insert(k, v);
            }
        }
        for (k, v) in &self.labels {
            labels.insert(k, v);
        }
        top.insert(
            "LABELS",
            Field::Struct(
                labels
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
        );
        if let Some(owner) = self.owner() {
            top.insert("OWNER", Field::Str(owner));
        }
        let mut out = Vec::new();
        for (k, v) in top {
            let value = match v {
                Field::Str(s) => string_value(&s),
                Field::Struct(fields) => {
                    let mut inner = Vec::new();
                    for (lk, lv) in &fields {
                        map_entry(&mut inner, lk, &string_value(lv));
                    }
                    // Value.struct_value = 5.
                    let mut v = Vec::new();
                    prost::encoding::encode_key(
                        5,
                        prost::encoding::WireType::LengthDelimited,
                        &mut v,
                    );
                    prost::encoding::encode_varint(inner.len() as u64, &mut v);
                    v.extend_from_slice(&inner);
                    v
                }
            };
            map_entry(&mut out, k, &value);
        }
        out
    }

    /// The `x-envoy-peer-metadata` value this workload announces itself with.
    pub fn header_value(&self) -> String {
        base64_encode(&self.to_struct_bytes())
    }
}

enum Field {
    Str(String),
    Struct(Vec<(String, String)>),
}

/// A `google.protobuf.Value` with `string_value` (field 3), encoded.
fn string_value(s: &str) -> Vec<u8> {
    let mut v = Vec::new();
    prost::encoding::string::encode(3, &s.to_string(), &mut v);
    v
}

/// One `fields` map entry of a Struct (field 1: {1: key, 2: value}).
fn map_entry(out: &mut Vec<u8>, key: &str, value: &[u8]) {
    let mut entry = Vec::new();
    prost::encoding::string::encode(1, &key.to_string(), &mut entry);
    prost::encoding::encode_key(2, prost::encoding::WireType::LengthDelimited, &mut entry);
    prost::encoding::encode_varint(value.len() as u64, &mut entry);
    entry.extend_from_slice(value);
    prost::encoding::encode_key(1, prost::encoding::WireType::LengthDelimited, out);
    prost::encoding::encode_varint(entry.len() as u64, out);
    out.extend_from_slice(&entry);
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as Envoy's `Base64::encode` writes it.
pub fn base64_encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        out.push(B64[(n >> 18) as usize & 63] as char);
        out.push(B64[(n >> 12) as usize & 63] as char);
        out.push(if chunk.len() > 1 {
            B64[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if chunk.len() > 2 {
            B64[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

/// Standard base64, padding optional (istio-proxy decodes with `decodeWithoutPadding`).
pub fn base64_decode(data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(data.len() * 3 / 4);
    let mut acc = 0u32;
    let mut bits = 0;
    for &c in data {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => break,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// The gateway itself, from its bootstrap `node`: the source labels of every metric it
/// reports, the `node.*` attributes of metric dimensions, and what it announces upstream.
/// Built once when the server starts and handed to the request path (never a global).
#[derive(Debug, Default)]
pub struct LocalNode {
    pub id: String,
    pub cluster: String,
    pub peer: PeerInfo,
    /// `ISTIO_VERSION` (the `istio_build` gauge's `tag`).
    pub istio_version: String,
    /// `node.metadata`, its string fields (for `node.metadata['X']` dimensions).
    pub metadata: Vec<(String, String)>,
    /// `x-envoy-peer-metadata` as this gateway sends it (without additional labels).
    pub header_value: String,
    /// The id and `header_value` as header values, made once (None: not valid in a header,
    /// and each request's insert refuses it as before). The metadata is some hundreds of
    /// bytes of base64, checked and copied on every request otherwise.
    pub values: Option<(http::HeaderValue, http::HeaderValue)>,
}

impl LocalNode {
    pub fn new(id: &str, cluster: &str, metadata: Option<&Struct>) -> LocalNode {
        let empty = Struct::default();
        let md = metadata.unwrap_or(&empty);
        let peer = PeerInfo::from_struct(md, &[]);
        let mut strings: Vec<(String, String)> = md
            .fields
            .iter()
            .filter_map(|(k, v)| match &v.kind {
                Some(Kind::StringValue(s)) => Some((k.clone(), s.clone())),
                _ => None,
            })
            .collect();
        strings.sort();
        let header_value = peer.header_value();
        let values = http::HeaderValue::from_str(id)
            .ok()
            .zip(http::HeaderValue::from_str(&header_value).ok());
        LocalNode {
            id: id.to_string(),
            cluster: cluster.to_string(),
            header_value,
            values,
            istio_version: md
                .fields
                .get("ISTIO_VERSION")
                .map(|v| string_of(v).to_string())
                .unwrap_or_default(),
            peer,
            metadata: strings,
        }
    }

    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// What the peer metadata filter keeps per request: the peers it found.
#[derive(Debug, Clone, Default)]
pub struct Peers {
    pub downstream: Option<Arc<PeerInfo>>,
    pub upstream: Option<Arc<PeerInfo>>,
}
