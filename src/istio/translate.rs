//! Istio objects to the xDS istiod sends an ingress gateway. Pure: config and node in,
//! resources and problems out.
//!
//! The output follows istiod's gateway translation (pilot/pkg/networking/core): names
//! (`0.0.0.0_<port>`, `http.<port>`, `<host>:<port>`, `outbound|<port>|<subset>|<fqdn>`), the
//! fields it sets and their defaults (timeout 0s, the default retry policy, LEAST_REQUEST,
//! maximal circuit breakers). It is built as proto-JSON first, so golden files and the
//! istiod dumps compare field by field, then encoded through the descriptor pool.
//!
//! Left out on purpose: Istio's own Envoy extensions (istio.stats, metadata exchange), which
//! upstream Envoy and Portico do not have; the auto-mTLS transport socket match unless an
//! endpoint carries `security.istio.io/tlsMode: istio` (no sidecars in a file-fed mesh).

use std::collections::{BTreeMap, BTreeSet};

use envoy_types::pb::google::protobuf::Any;
use serde_json::{json, Map, Value as Json};

use super::model::*;
use super::{Config, Invalid, NodeInfo, Options, Xds};
use crate::xds::types;

/// The resources by type URL, then name, as proto-JSON (snake_case field names).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct XdsJson {
    pub listeners: BTreeMap<String, Json>,
    pub routes: BTreeMap<String, Json>,
    pub clusters: BTreeMap<String, Json>,
    pub endpoints: BTreeMap<String, Json>,
}

pub fn translate(config: &Config, node: &NodeInfo, options: &Options) -> (Xds, Vec<Invalid>) {
    // Every resource is encoded through the descriptor pool; decoding the pool is the slow
    // part, so one stays alive for the whole translation.
    let _pool = crate::protojson::pool();
    let (out, mut invalid) = translate_json(config, node, options);
    let mut xds = Xds::default();
    let sections = [
        (&out.listeners, &mut xds.listeners, types::LISTENER),
        (&out.routes, &mut xds.routes, types::ROUTE),
        (&out.clusters, &mut xds.clusters, types::CLUSTER),
        (&out.endpoints, &mut xds.endpoints, types::ENDPOINT),
    ];
    for (from, to, type_url) in sections {
        for (name, value) in from {
            match encode(type_url, value) {
                Ok(any) => {
                    to.insert(name.clone(), any);
                }
                // Only a bug here can produce JSON the descriptors refuse; say which.
                Err(e) => invalid.push(Invalid {
                    file: String::new(),
                    kind: type_url.rsplit('.').next().unwrap_or(type_url).to_string(),
                    name: name.clone(),
                    reason: format!("cannot encode: {e}"),
                }),
            }
        }
    }
    (xds, invalid)
}

/// One resource's proto-JSON as an `Any` of `type_url`.
pub fn encode(type_url: &str, value: &Json) -> Result<Any, crate::protojson::ProtoJsonError> {
    let full_name = type_url.trim_start_matches("type.googleapis.com/");
    let msg = crate::protojson::dynamic_from_json(full_name, value)?;
    Ok(Any {
        type_url: type_url.to_string(),
        value: prost::Message::encode_to_vec(&msg),
    })
}

// ---------------------------------------------------------------------------------------
// The service registry: Kubernetes Services with their EndpointSlices (or Pods), and
// ServiceEntries with their endpoints and WorkloadEntries.

#[derive(Debug, Clone, PartialEq)]
struct Endpoint {
    address: String,
    port: u32,
    labels: BTreeMap<String, String>,
    /// The workload's name and namespace, for istio's `workload` endpoint metadata.
    workload: String,
    namespace: String,
    weight: u32,
    locality: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resolution {
    /// Endpoints by EDS (Kubernetes services, ServiceEntry STATIC).
    Eds,
    StrictDns,
    LogicalDns,
}

#[derive(Debug, Clone)]
struct Service {
    fqdn: String,
    name: String,
    namespace: String,
    resolution: Resolution,
    /// Service port, its name, and the endpoints behind it.
    ports: Vec<(u32, Option<String>, Vec<Endpoint>)>,
}

#[derive(Default)]
struct Registry {
    services: BTreeMap<String, Service>,
}

fn fqdn(host: &str, namespace: &str, options: &Options) -> String {
    if host.contains('.') || host.contains('*') {
        host.to_string()
    } else {
        format!("{host}.{namespace}.svc.{}", options.domain)
    }
}

fn ns(m: &Metadata) -> &str {
    m.namespace.as_deref().unwrap_or("default")
}

fn api_version(m: &Metadata) -> &str {
    if m.api_version.is_empty() {
        "networking.istio.io/v1"
    } else {
        &m.api_version
    }
}

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Where an object came from, for reports. The model does not keep files; name and kind
/// are what an operator searches for.
fn invalid(kind: &str, m: &Metadata, reason: String) -> Invalid {
    Invalid {
        file: String::new(),
        kind: kind.to_string(),
        name: format!("{}/{}", ns(m), m.name),
        reason,
    }
}

/// istiod names a Deployment's pods by the Deployment: the pod name up to its ReplicaSet's
/// `pod-template-hash` (`reviews-v3-7d99fd7978-x4k2p` -> `reviews-v3`); other pods by name.
fn workload_name(pod: &str, labels: &BTreeMap<String, String>) -> String {
    labels
        .get("pod-template-hash")
        .and_then(|h| pod.find(&format!("-{h}-")).map(|i| pod[..i].to_string()))
        .unwrap_or_else(|| pod.to_string())
}

fn build_registry(config: &Config, options: &Options, bad: &mut Vec<Invalid>) -> Registry {
    let mut reg = Registry::default();
    let pods: BTreeMap<(String, String), &Metadata> = config
        .objects
        .iter()
        .filter_map(|o| match o {
            Object::Pod(m, _) => Some(((ns(m).to_string(), m.name.clone()), m)),
            _ => None,
        })
        .collect();
    for o in &config.objects {
        let Object::Service(m, spec) = o else {
            continue;
        };
        let namespace = ns(m).to_string();
        let slices: Vec<&EndpointSlice> = config
            .objects
            .iter()
            .filter_map(|o| match o {
                Object::EndpointSlice(sm, s)
                    if ns(sm) == namespace
                        && sm.labels.get("kubernetes.io/service-name") == Some(&m.name) =>
                {
                    Some(s)
                }
                _ => None,
            })
            .collect();
        let mut ports = Vec::new();
        for (i, p) in spec.ports.iter().enumerate() {
            let mut eps = Vec::new();
            for slice in &slices {
                let port = slice
                    .ports
                    .iter()
                    .find(|sp| sp.name.as_deref().unwrap_or("") == p.name.as_deref().unwrap_or(""))
                    .or(match (slice.ports.as_slice(), spec.ports.len()) {
                        ([only], 1) => Some(only),
                        _ => None,
                    });
                let Some(port) = port else { continue };
                for e in &slice.endpoints {
                    if e.conditions.as_ref().and_then(|c| c.ready) == Some(false) {
                        continue;
                    }
                    let pod = e.target_ref.as_ref().and_then(|t| {
                        let pns = t.namespace.clone().unwrap_or_else(|| namespace.clone());
                        pods.get(&(pns, t.name.clone()))
                    });
                    let mut labels = pod.map(|p| p.labels.clone()).unwrap_or_default();
                    labels.extend(e.labels.clone());
                    let workload = e
                        .target_ref
                        .as_ref()
                        .map(|t| workload_name(&t.name, &labels))
                        .unwrap_or_default();
                    for a in &e.addresses {
                        eps.push(Endpoint {
                            address: a.clone(),
                            port: port.port,
                            labels: labels.clone(),
                            workload: workload.clone(),
                            namespace: namespace.clone(),
                            weight: 1,
                            locality: String::new(),
                        });
                    }
                }
            }
            if slices.is_empty() && !spec.selector.is_empty() {
                // No slices: the Pods the selector picks, as the endpoints controller would.
                let target = match &p.target_port {
                    None => Some(p.port),
                    Some(serde_yaml::Value::Number(n)) => n.as_u64().map(|n| n as u32),
                    Some(_) => None,
                };
                match target {
                    Some(target) => {
                        for o in &config.objects {
                            if let Object::Pod(pm, st) = o {
                                if ns(pm) == namespace && selects(&spec.selector, &pm.labels) {
                                    if let Some(ip) = &st.pod_ip {
                                        eps.push(Endpoint {
                                            address: ip.clone(),
                                            port: target,
                                            labels: pm.labels.clone(),
                                            workload: workload_name(&pm.name, &pm.labels),
                                            namespace: namespace.clone(),
                                            weight: 1,
                                            locality: String::new(),
                                        });
                                    }
                                }
                            }
                        }
                    }
                    None => bad.push(invalid(
                        "Service",
                        m,
                        format!(
                            "spec.ports[{i}].targetPort: a named target port needs an EndpointSlice"
                        ),
                    )),
                }
            }
            ports.push((p.port, p.name.clone(), eps));
        }
        let f = fqdn(&m.name, &namespace, options);
        reg.services.insert(
            f.clone(),
            Service {
                fqdn: f,
                name: m.name.clone(),
                namespace,
                resolution: Resolution::Eds,
                ports,
            },
        );
    }
    for o in &config.objects {
        let Object::ServiceEntry(m, se) = o else {
            continue;
        };
        let namespace = ns(m).to_string();
        let resolution = match se.resolution.as_deref().unwrap_or("NONE") {
            "STATIC" => Resolution::Eds,
            "DNS" => Resolution::StrictDns,
            "DNS_ROUND_ROBIN" => Resolution::LogicalDns,
            "NONE" => {
                bad.push(invalid(
                    "ServiceEntry",
                    m,
                    "spec.resolution: NONE (original destination) gives a gateway nothing to route to; use STATIC or DNS".into(),
                ));
                continue;
            }
            other => {
                bad.push(invalid(
                    "ServiceEntry",
                    m,
                    format!("spec.resolution: unknown value '{other}'"),
                ));
                continue;
            }
        };
        if se.hosts.is_empty() {
            bad.push(invalid(
                "ServiceEntry",
                m,
                "spec.hosts: at least one host is required".into(),
            ));
            continue;
        }
        let mut workloads: Vec<(String, WorkloadEntrySpec)> = se
            .endpoints
            .iter()
            .map(|e| (String::new(), e.clone()))
            .collect();
        if let Some(sel) = &se.workload_selector {
            for o in &config.objects {
                if let Object::WorkloadEntry(wm, we) = o {
                    if ns(wm) == namespace && selects(&sel.labels, &we.labels) {
                        workloads.push((wm.name.clone(), we.clone()));
                    }
                }
            }
        }
        for host in &se.hosts {
            let mut ports = Vec::new();
            for p in &se.ports {
                let mut eps: Vec<Endpoint> = workloads
                    .iter()
                    .filter(|(_, w)| !w.address.is_empty())
                    .map(|(name, w)| Endpoint {
                        address: w.address.clone(),
                        port: p
                            .name
                            .as_ref()
                            .and_then(|n| w.ports.get(n).copied())
                            .or(p.target_port)
                            .unwrap_or(p.number),
                        labels: w.labels.clone(),
                        workload: name.clone(),
                        namespace: namespace.clone(),
                        weight: w.weight.unwrap_or(1).max(1),
                        locality: w.locality.clone().unwrap_or_default(),
                    })
                    .collect();
                if eps.is_empty() && resolution != Resolution::Eds {
                    // DNS with no endpoints resolves the host itself.
                    eps.push(Endpoint {
                        address: host.clone(),
                        port: p.target_port.unwrap_or(p.number),
                        labels: BTreeMap::new(),
                        workload: String::new(),
                        namespace: namespace.clone(),
                        weight: 1,
                        locality: String::new(),
                    });
                }
                ports.push((p.number, p.name.clone(), eps));
            }
            reg.services.insert(
                host.clone(),
                Service {
                    fqdn: host.clone(),
                    name: host.clone(),
                    namespace: namespace.clone(),
                    resolution,
                    ports,
                },
            );
        }
    }
    reg
}

// ---------------------------------------------------------------------------------------
// Durations and small conversions.

/// An Istio duration ("1s", "1.5s", "100ms", "1m", "1h") as proto-JSON ("1.500s").
pub fn duration(text: &str) -> Result<String, String> {
    let t = text.trim();
    let units: [(&str, f64); 6] = [
        ("ms", 1e-3),
        ("us", 1e-6),
        ("ns", 1e-9),
        ("s", 1.0),
        ("m", 60.0),
        ("h", 3600.0),
    ];
    for (unit, scale) in units {
        if let Some(num) = t.strip_suffix(unit) {
            let v: f64 = num
                .parse()
                .map_err(|_| format!("invalid duration '{text}'"))?;
            if !v.is_finite() || v < 0.0 {
                return Err(format!("invalid duration '{text}'"));
            }
            let nanos = (v * scale * 1e9).round() as u128;
            let (secs, frac) = (nanos / 1_000_000_000, nanos % 1_000_000_000);
            return Ok(if frac == 0 {
                format!("{secs}s")
            } else {
                let f = format!("{frac:09}");
                format!("{secs}.{}s", f.trim_end_matches('0'))
            });
        }
    }
    Err(format!(
        "invalid duration '{text}' (use e.g. 10s, 100ms, 1m)"
    ))
}

/// Istio's `Percent` as Envoy's FractionalPercent per million (istiod's conversion).
fn per_million(p: f64) -> Json {
    json!({"numerator": (p * 10000.0) as u32, "denominator": "MILLION"})
}

fn string_match(m: &StringMatch, at: &str) -> Result<Option<Json>, String> {
    Ok(match (&m.exact, &m.prefix, &m.regex) {
        (Some(e), None, None) => Some(json!({"exact": e})),
        (None, Some(p), None) => Some(json!({"prefix": p})),
        (None, None, Some(r)) => {
            check_regex(r, at)?;
            Some(json!({"safe_regex": {"regex": r}}))
        }
        (None, None, None) => None,
        _ => return Err(format!("{at}: only one of exact, prefix, regex may be set")),
    })
}

fn check_regex(r: &str, at: &str) -> Result<(), String> {
    regex::Regex::new(r)
        .map(|_| ())
        .map_err(|e| format!("{at}.regex: invalid regex '{r}': {e}"))
}

const GRPC_CODES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

// ---------------------------------------------------------------------------------------
// The translation.

struct Ctx<'a> {
    options: &'a Options,
    reg: Registry,
    /// DestinationRules by the fqdn of their host.
    rules: BTreeMap<String, (&'a Metadata, &'a DestinationRuleSpec)>,
    bad: Vec<Invalid>,
}

pub fn translate_json(
    config: &Config,
    node: &NodeInfo,
    options: &Options,
) -> (XdsJson, Vec<Invalid>) {
    let mut bad = Vec::new();
    let config = dedup(config, &mut bad);
    let reg = build_registry(&config, options, &mut bad);
    let mut rules = BTreeMap::new();
    for o in &config.objects {
        if let Object::DestinationRule(m, dr) = o {
            if dr.host.is_empty() {
                bad.push(invalid(
                    "DestinationRule",
                    m,
                    "spec.host is required".into(),
                ));
                continue;
            }
            let host = fqdn(&dr.host, ns(m), options);
            // istiod: the oldest rule for a host wins; with no timestamps, the first read.
            if rules.contains_key(&host) {
                bad.push(invalid(
                    "DestinationRule",
                    m,
                    format!("spec.host: another DestinationRule already applies to {host}"),
                ));
                continue;
            }
            rules.insert(host, (m, dr));
        }
    }
    let mut cx = Ctx {
        options,
        reg,
        rules,
        bad,
    };
    let mut out = XdsJson::default();
    cx.clusters(&mut out);
    cx.gateways(&config, node, &mut out);
    let mut bad = cx.bad;
    fill_files(&config, &mut bad);
    (out, bad)
}

/// Keeps the first object of each kind/namespace/name, reporting the rest.
fn dedup(config: &Config, bad: &mut Vec<Invalid>) -> Config {
    let mut seen = BTreeSet::new();
    let mut out = Config::default();
    for (i, o) in config.objects.iter().enumerate() {
        let m = o.metadata();
        if seen.insert((o.kind(), ns(m).to_string(), m.name.clone())) {
            out.objects.push(o.clone());
            out.files.push(config.file_of(i).to_string());
        } else {
            let mut e = invalid(
                o.kind(),
                m,
                "defined twice; the first definition is used".into(),
            );
            e.file = config.file_of(i).to_string();
            bad.push(e);
        }
    }
    out
}

/// Reports made during translation know kind and name; the file comes from the object.
fn fill_files(config: &Config, bad: &mut [Invalid]) {
    for b in bad.iter_mut().filter(|b| b.file.is_empty()) {
        if let Some(i) = config.objects.iter().position(|o| {
            o.kind() == b.kind && format!("{}/{}", ns(o.metadata()), o.metadata().name) == b.name
        }) {
            b.file = config.file_of(i).to_string();
        }
    }
}

/// The traffic policy for one port of one subset: istiod merges the rule's policy, its
/// port-level settings, then the subset's, section by section.
fn merged_policy(
    dr: Option<&DestinationRuleSpec>,
    subset: Option<&Subset>,
    port: u32,
) -> TrafficPolicy {
    let mut out = TrafficPolicy::default();
    let mut apply = |p: &TrafficPolicy| {
        if p.load_balancer.is_some() {
            out.load_balancer = p.load_balancer.clone();
        }
        if p.connection_pool.is_some() {
            out.connection_pool = p.connection_pool.clone();
        }
        if p.outlier_detection.is_some() {
            out.outlier_detection = p.outlier_detection.clone();
        }
        if p.tls.is_some() {
            out.tls = p.tls.clone();
        }
        if let Some(pl) = p
            .port_level_settings
            .iter()
            .find(|pl| pl.port.as_ref().map(|p| p.number) == Some(port))
        {
            if pl.load_balancer.is_some() {
                out.load_balancer = pl.load_balancer.clone();
            }
            if pl.connection_pool.is_some() {
                out.connection_pool = pl.connection_pool.clone();
            }
            if pl.outlier_detection.is_some() {
                out.outlier_detection = pl.outlier_detection.clone();
            }
            if pl.tls.is_some() {
                out.tls = pl.tls.clone();
            }
        }
    };
    if let Some(p) = dr.and_then(|d| d.traffic_policy.as_ref()) {
        apply(p);
    }
    if let Some(p) = subset.and_then(|s| s.traffic_policy.as_ref()) {
        apply(p);
    }
    out
}

const MAX: u64 = 4294967295;

impl Ctx<'_> {
    fn clusters(&mut self, out: &mut XdsJson) {
        let services: Vec<Service> = self.reg.services.values().cloned().collect();
        for svc in &services {
            let rule = self.rules.get(&svc.fqdn).map(|(m, d)| (*m, *d));
            for (port, _, eps) in &svc.ports {
                let mut subsets: Vec<Option<&Subset>> = vec![None];
                if let Some((_, dr)) = rule {
                    subsets.extend(dr.subsets.iter().map(Some));
                }
                for subset in subsets {
                    let sname = subset.map(|s| s.name.as_str()).unwrap_or("");
                    let name = format!("outbound|{port}|{sname}|{}", svc.fqdn);
                    let policy = merged_policy(rule.map(|r| r.1), subset, *port);
                    let selected: Vec<&Endpoint> = eps
                        .iter()
                        .filter(|e| subset.is_none_or(|s| selects(&s.labels, &e.labels)))
                        .collect();
                    match self.cluster(
                        &name,
                        svc,
                        *port,
                        rule.map(|r| r.0),
                        sname,
                        &policy,
                        &selected,
                    ) {
                        Ok(c) => {
                            out.clusters.insert(name.clone(), c);
                            if svc.resolution == Resolution::Eds {
                                out.endpoints
                                    .insert(name.clone(), load_assignment(&name, &selected));
                            }
                        }
                        Err(e) => {
                            if let Some((m, _)) = rule {
                                self.bad.push(invalid("DestinationRule", m, e));
                            }
                        }
                    }
                }
            }
        }
        // istiod's catch-all for routes to nowhere; gateways get it too.
        out.clusters.insert(
            "BlackHoleCluster".into(),
            json!({"name": "BlackHoleCluster", "type": "STATIC", "connect_timeout": "10s"}),
        );
    }

    #[allow(clippy::too_many_arguments)]
    fn cluster(
        &self,
        name: &str,
        svc: &Service,
        port: u32,
        rule: Option<&Metadata>,
        subset: &str,
        policy: &TrafficPolicy,
        eps: &[&Endpoint],
    ) -> Result<Json, String> {
        let mut c = Map::new();
        c.insert("name".into(), json!(name));
        match svc.resolution {
            Resolution::Eds => {
                c.insert("type".into(), json!("EDS"));
                c.insert(
                    "eds_cluster_config".into(),
                    json!({"eds_config": ads_source(), "service_name": name}),
                );
            }
            Resolution::StrictDns | Resolution::LogicalDns => {
                let t = if svc.resolution == Resolution::StrictDns {
                    "STRICT_DNS"
                } else {
                    "LOGICAL_DNS"
                };
                c.insert("type".into(), json!(t));
                c.insert("dns_lookup_family".into(), json!("V4_ONLY"));
                c.insert("respect_dns_ttl".into(), json!(true));
                c.insert("load_assignment".into(), load_assignment(name, eps));
            }
        }
        let mut connect_timeout = "10s".to_string();
        let mut thresholds = json!({
            "max_connections": MAX, "max_pending_requests": MAX, "max_requests": MAX,
            "max_retries": MAX, "track_remaining": true
        });
        let mut lb_policy = Some("LEAST_REQUEST");
        let mut common_lb = Map::new();
        let mut http_options = Map::new();
        if let Some(lb) = &policy.load_balancer {
            match (&lb.simple, &lb.consistent_hash) {
                (Some(_), Some(_)) => {
                    return Err(
                        "trafficPolicy.loadBalancer: only one of simple, consistentHash may be set"
                            .into(),
                    )
                }
                (Some(s), None) => {
                    lb_policy = match s.as_str() {
                        // ROUND_ROBIN is Envoy's default, so istiod leaves the field unset.
                        "ROUND_ROBIN" => None,
                        "LEAST_REQUEST" | "LEAST_CONN" | "UNSPECIFIED" => Some("LEAST_REQUEST"),
                        "RANDOM" => Some("RANDOM"),
                        "PASSTHROUGH" => {
                            return Err("trafficPolicy.loadBalancer.simple: PASSTHROUGH (original destination) is not supported for gateway clusters".into())
                        }
                        other => {
                            return Err(format!(
                                "trafficPolicy.loadBalancer.simple: unknown value '{other}'"
                            ))
                        }
                    }
                }
                (None, Some(h)) => {
                    if let Some(m) = &h.maglev {
                        lb_policy = Some("MAGLEV");
                        if let Some(t) = m.table_size {
                            c.insert("maglev_lb_config".into(), json!({"table_size": t}));
                        }
                    } else {
                        lb_policy = Some("RING_HASH");
                        let min = h
                            .ring_hash
                            .as_ref()
                            .and_then(|r| r.minimum_ring_size)
                            .or(h.minimum_ring_size)
                            .unwrap_or(1024);
                        c.insert(
                            "ring_hash_lb_config".into(),
                            json!({"minimum_ring_size": min.to_string()}),
                        );
                    }
                }
                (None, None) => {}
            }
        }
        if let Some(cp) = &policy.connection_pool {
            if let Some(tcp) = &cp.tcp {
                if let Some(n) = tcp.max_connections {
                    thresholds["max_connections"] = json!(n);
                }
                if let Some(t) = &tcp.connect_timeout {
                    connect_timeout = duration(t)
                        .map_err(|e| format!("connectionPool.tcp.connectTimeout: {e}"))?;
                }
                if let Some(k) = &tcp.tcp_keepalive {
                    let mut ka = Map::new();
                    if let Some(p) = k.probes {
                        ka.insert("keepalive_probes".into(), json!(p));
                    }
                    for (field, v) in [
                        ("keepalive_time", &k.time),
                        ("keepalive_interval", &k.interval),
                    ] {
                        if let Some(v) = v {
                            let d = duration(v)
                                .map_err(|e| format!("connectionPool.tcp.tcpKeepalive: {e}"))?;
                            let secs = d.trim_end_matches('s').parse::<f64>().unwrap_or(0.0) as u64;
                            ka.insert(field.into(), json!(secs));
                        }
                    }
                    c.insert(
                        "upstream_connection_options".into(),
                        json!({"tcp_keepalive": ka}),
                    );
                }
                if let Some(d) = &tcp.max_connection_duration {
                    http_options.insert(
                        "max_connection_duration".into(),
                        json!(duration(d).map_err(|e| format!(
                            "connectionPool.tcp.maxConnectionDuration: {e}"
                        ))?),
                    );
                }
                if let Some(d) = &tcp.idle_timeout {
                    http_options.insert(
                        "idle_timeout".into(),
                        json!(duration(d)
                            .map_err(|e| format!("connectionPool.tcp.idleTimeout: {e}"))?),
                    );
                }
            }
            if let Some(h) = &cp.http {
                if let Some(n) = h.http1_max_pending_requests {
                    thresholds["max_pending_requests"] = json!(n);
                }
                if let Some(n) = h.http2_max_requests {
                    thresholds["max_requests"] = json!(n);
                }
                if let Some(n) = h.max_retries {
                    thresholds["max_retries"] = json!(n);
                }
                if let Some(n) = h.max_requests_per_connection {
                    http_options.insert("max_requests_per_connection".into(), json!(n));
                }
                if let Some(d) = &h.idle_timeout {
                    http_options.insert(
                        "idle_timeout".into(),
                        json!(duration(d)
                            .map_err(|e| format!("connectionPool.http.idleTimeout: {e}"))?),
                    );
                }
            }
        }
        c.insert("connect_timeout".into(), json!(connect_timeout));
        // istiod renders warmup as slow start for the two policies that have it.
        if let Some(w) = policy
            .load_balancer
            .as_ref()
            .and_then(|lb| lb.warmup_duration_secs.as_ref())
        {
            let window = duration(w)
                .map_err(|e| format!("trafficPolicy.loadBalancer.warmupDurationSecs: {e}"))?;
            let slow = json!({"slow_start_config": {"slow_start_window": window}});
            match lb_policy {
                None => {
                    c.insert("round_robin_lb_config".into(), slow);
                }
                Some("LEAST_REQUEST") => {
                    c.insert("least_request_lb_config".into(), slow);
                }
                Some(_) => {}
            }
        }
        if let Some(p) = lb_policy {
            c.insert("lb_policy".into(), json!(p));
        }
        c.insert(
            "circuit_breakers".into(),
            json!({"thresholds": [thresholds]}),
        );
        if let Some(od) = &policy.outlier_detection {
            let mut o = Map::new();
            match od.consecutive_5xx_errors.or(od.consecutive_errors) {
                Some(n) if n > 0 => {
                    o.insert("consecutive_5xx".into(), json!(n));
                    o.insert("enforcing_consecutive_5xx".into(), json!(100));
                }
                _ => {
                    o.insert("enforcing_consecutive_5xx".into(), json!(0));
                }
            }
            if let Some(n) = od.consecutive_gateway_errors.filter(|n| *n > 0) {
                o.insert("consecutive_gateway_failure".into(), json!(n));
                o.insert("enforcing_consecutive_gateway_failure".into(), json!(100));
            }
            for (field, v) in [
                ("interval", &od.interval),
                ("base_ejection_time", &od.base_ejection_time),
            ] {
                if let Some(v) = v {
                    o.insert(
                        field.into(),
                        json!(duration(v).map_err(|e| format!("outlierDetection.{field}: {e}"))?),
                    );
                }
            }
            if let Some(p) = od.max_ejection_percent {
                o.insert("max_ejection_percent".into(), json!(p));
            }
            o.insert("enforcing_success_rate".into(), json!(0));
            c.insert("outlier_detection".into(), Json::Object(o));
            // istiod: minHealthPercent is the panic threshold, 0 (never panic) by default.
            common_lb.insert(
                "healthy_panic_threshold".into(),
                json!({"value": od.min_health_percent.unwrap_or(0) as f64}),
            );
        }
        if !common_lb.is_empty() {
            c.insert("common_lb_config".into(), Json::Object(common_lb));
        }
        if !http_options.is_empty() {
            c.insert(
                "typed_extension_protocol_options".into(),
                json!({"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "common_http_protocol_options": http_options,
                    "use_downstream_protocol_config": {"http_protocol_options": {}, "http2_protocol_options": {}}
                }}),
            );
        }
        if eps.iter().any(|e| {
            e.labels
                .get("security.istio.io/tlsMode")
                .map(String::as_str)
                == Some("istio")
        }) {
            // Sidecar'd pods: istiod's auto-mTLS match. The data plane needs the sds-grpc
            // cluster and upstream TLS for it, so only endpoints that say so get it.
            c.insert("transport_socket_matches".into(), auto_mtls(name));
        }
        let mut istio = Map::new();
        istio.insert("default_original_port".into(), json!(port));
        istio.insert(
            "services".into(),
            json!([{"host": svc.fqdn, "name": svc.name, "namespace": svc.namespace}]),
        );
        if let Some(m) = rule {
            istio.insert(
                "config".into(),
                json!(format!(
                    "/apis/{}/namespaces/{}/destination-rule/{}",
                    api_version(m),
                    ns(m),
                    m.name
                )),
            );
        }
        if !subset.is_empty() {
            istio.insert("subset".into(), json!(subset));
        }
        c.insert(
            "metadata".into(),
            json!({"filter_metadata": {"istio": istio}}),
        );
        Ok(Json::Object(c))
    }
}

fn auto_mtls(name: &str) -> Json {
    let sds = |n: &str| {
        json!({"name": n, "sds_config": {"api_config_source": {"api_type": "GRPC",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}],
            "set_node_on_first_message_only": true, "transport_api_version": "V3"},
            "initial_fetch_timeout": "0s", "resource_api_version": "V3"}})
    };
    // istiod's SNI for a subset cluster: outbound_.<port>_.<subset>_.<host>.
    let mut parts = name.split('|').skip(1);
    let (port, subset, host) = (
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
        parts.next().unwrap_or(""),
    );
    json!([
        {"name": "tlsMode-istio", "match": {"tlsMode": "istio"}, "transport_socket": {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {
                    "tls_params": {"tls_minimum_protocol_version": "TLSv1_2", "tls_maximum_protocol_version": "TLSv1_3"},
                    "alpn_protocols": ["istio-peer-exchange", "istio"],
                    "tls_certificate_sds_secret_configs": [sds("default")],
                    "combined_validation_context": {"default_validation_context": {}, "validation_context_sds_secret_config": sds("ROOTCA")}
                },
                "sni": format!("outbound_.{port}_.{subset}_.{host}")
            }}},
        {"name": "tlsMode-disabled", "match": {}, "transport_socket": {"name": "envoy.transport_sockets.raw_buffer",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"}}}
    ])
}

fn ads_source() -> Json {
    json!({"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"})
}

/// istiod groups endpoints by locality; each locality weighs the sum of its endpoints.
fn load_assignment(name: &str, eps: &[&Endpoint]) -> Json {
    let mut by_locality: BTreeMap<&str, Vec<&Endpoint>> = BTreeMap::new();
    for e in eps {
        by_locality.entry(e.locality.as_str()).or_default().push(e);
    }
    let groups: Vec<Json> = by_locality
        .into_iter()
        .map(|(loc, eps)| {
            let mut locality = Map::new();
            let mut parts = loc.split('/');
            for field in ["region", "zone", "sub_zone"] {
                if let Some(p) = parts.next().filter(|p| !p.is_empty()) {
                    locality.insert(field.into(), json!(p));
                }
            }
            let weight: u32 = eps.iter().map(|e| e.weight).sum();
            let lb: Vec<Json> = eps
                .iter()
                .map(|e| {
                    let mut meta = Map::new();
                    let app = e
                        .labels
                        .get("service.istio.io/canonical-name")
                        .or_else(|| e.labels.get("app"))
                        .cloned()
                        .unwrap_or_default();
                    let version = e
                        .labels
                        .get("service.istio.io/canonical-revision")
                        .or_else(|| e.labels.get("version"))
                        .cloned()
                        .unwrap_or_default();
                    meta.insert(
                        "istio".into(),
                        json!({"workload": format!("{};{};{app};{version};Kubernetes", e.workload, e.namespace)}),
                    );
                    if let Some(mode) = e.labels.get("security.istio.io/tlsMode") {
                        meta.insert(
                            "envoy.transport_socket_match".into(),
                            json!({"tlsMode": mode}),
                        );
                    }
                    json!({
                        "endpoint": {"address": {"socket_address": {"address": e.address, "port_value": e.port}}},
                        "health_status": "HEALTHY",
                        "metadata": {"filter_metadata": meta},
                        "load_balancing_weight": e.weight
                    })
                })
                .collect();
            json!({"locality": locality, "lb_endpoints": lb, "load_balancing_weight": weight})
        })
        .collect();
    let mut cla = Map::new();
    cla.insert("cluster_name".into(), json!(name));
    if !groups.is_empty() {
        cla.insert("endpoints".into(), Json::Array(groups));
    }
    Json::Object(cla)
}

// ---------------------------------------------------------------------------------------
// Gateways: listeners, route configurations, virtual hosts, routes.

/// One Gateway server as the gateway sees it.
struct BoundServer<'a> {
    gateway: String, // namespace/name
    gateway_ns: String,
    number: u32,
    hosts: Vec<(String, String)>, // (namespace filter, host)
    https_redirect: bool,
    _server: &'a Server,
}

impl Ctx<'_> {
    fn gateways(&mut self, config: &Config, node: &NodeInfo, out: &mut XdsJson) {
        // The gateway's own Service maps Gateway port numbers to the pod's ports
        // (80 -> 8080 in Istio's charts); without one, the number is the port.
        let gateway_service_ports: BTreeMap<u32, u32> = config
            .objects
            .iter()
            .filter_map(|o| match o {
                Object::Service(_, s)
                    if !s.selector.is_empty() && selects(&s.selector, &node.labels) =>
                {
                    Some(s)
                }
                _ => None,
            })
            .flat_map(|s| s.ports.iter())
            .filter_map(|p| {
                let target = match &p.target_port {
                    None => p.port,
                    Some(serde_yaml::Value::Number(n)) => n.as_u64()? as u32,
                    Some(_) => return None,
                };
                Some((p.port, target))
            })
            .collect();
        // Listener port -> servers on it.
        let mut by_port: BTreeMap<u32, Vec<BoundServer>> = BTreeMap::new();
        for o in &config.objects {
            let Object::Gateway(m, gw) = o else { continue };
            if !selects(&gw.selector, &node.labels) {
                continue;
            }
            for (i, s) in gw.servers.iter().enumerate() {
                let protocol = s
                    .port
                    .protocol
                    .as_deref()
                    .unwrap_or("")
                    .to_ascii_uppercase();
                match protocol.as_str() {
                    "HTTP" | "HTTP2" | "GRPC" | "GRPC-WEB" => {}
                    "HTTPS" | "TLS" | "TCP" | "MONGO" | "REDIS" | "MYSQL" => {
                        self.bad.push(invalid(
                            "Gateway",
                            m,
                            format!(
                                "spec.servers[{i}].port.protocol: {protocol} servers are not served by Portico's control plane yet (TLS and TCP come with the edge work); server skipped"
                            ),
                        ));
                        continue;
                    }
                    other => {
                        self.bad.push(invalid(
                            "Gateway",
                            m,
                            format!("spec.servers[{i}].port.protocol: unknown protocol '{other}'"),
                        ));
                        continue;
                    }
                }
                if s.hosts.is_empty() {
                    self.bad.push(invalid(
                        "Gateway",
                        m,
                        format!("spec.servers[{i}].hosts: at least one host is required"),
                    ));
                    continue;
                }
                if s.port.number == 0 || s.port.number > 65535 {
                    self.bad.push(invalid(
                        "Gateway",
                        m,
                        format!(
                            "spec.servers[{i}].port.number: {} is not a port",
                            s.port.number
                        ),
                    ));
                    continue;
                }
                let gateway_ns = ns(m).to_string();
                let hosts = s
                    .hosts
                    .iter()
                    .map(|h| match h.split_once('/') {
                        Some((".", h)) => (gateway_ns.clone(), h.to_string()),
                        Some((n, h)) => (n.to_string(), h.to_string()),
                        None => ("*".to_string(), h.clone()),
                    })
                    .collect();
                let listen = gateway_service_ports
                    .get(&s.port.number)
                    .copied()
                    .unwrap_or(s.port.number);
                by_port.entry(listen).or_default().push(BoundServer {
                    gateway: format!("{gateway_ns}/{}", m.name),
                    gateway_ns,
                    number: s.port.number,
                    hosts,
                    https_redirect: s.tls.as_ref().is_some_and(|t| t.https_redirect),
                    _server: s,
                });
            }
        }
        let mut vss: Vec<(&Metadata, &VirtualServiceSpec)> = config
            .objects
            .iter()
            .filter_map(|o| match o {
                Object::VirtualService(m, v) => Some((m, v)),
                _ => None,
            })
            .collect();
        // istiod's order: creation time, then name, then namespace. Timestamps in the one
        // format Kubernetes writes (RFC 3339, UTC, seconds) sort as strings; none sorts first.
        vss.sort_by(|a, b| {
            let key = |m: &Metadata| {
                (
                    m.creation_timestamp.clone(),
                    m.name.clone(),
                    ns(m).to_string(),
                )
            };
            key(a.0).cmp(&key(b.0))
        });
        for (m, vs) in &vss {
            if vs.hosts.is_empty() {
                self.bad.push(invalid(
                    "VirtualService",
                    m,
                    "spec.hosts: at least one host is required".into(),
                ));
            }
            if !vs.tcp.is_empty() || !vs.tls.is_empty() {
                self.bad.push(invalid(
                    "VirtualService",
                    m,
                    "spec.tcp/spec.tls: TCP and TLS routes are not served yet (they come with the edge work); the http routes are".into(),
                ));
            }
        }
        for (port, servers) in &by_port {
            let route_name = format!("http.{port}");
            let listener_name = format!("0.0.0.0_{port}");
            out.listeners.insert(
                listener_name.clone(),
                self.listener(&listener_name, *port, &route_name),
            );
            let vhosts = self.virtual_hosts(servers, &vss);
            out.routes.insert(
                route_name.clone(),
                route_config(&route_name, vhosts, servers),
            );
        }
    }

    fn listener(&self, name: &str, port: u32, route_name: &str) -> Json {
        json!({
            "name": name,
            "address": {"socket_address": {"address": self.options.bind_address, "port_value": port}},
            "filter_chains": [{
                "filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": format!("outbound_{name}"),
                        "rds": {"config_source": ads_source(), "route_config_name": route_name},
                        "http_filters": [
                            {"name": "envoy.filters.http.fault", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"}},
                            {"name": "envoy.filters.http.cors", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"}},
                            {"name": "envoy.filters.http.router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
                        ],
                        "use_remote_address": true,
                        "forward_client_cert_details": "SANITIZE_SET",
                        "set_current_client_cert_details": {"subject": true, "dns": true, "uri": true},
                        "upgrade_configs": [{"upgrade_type": "websocket"}],
                        "stream_idle_timeout": "0s",
                        "normalize_path": true,
                        "path_with_escaped_slashes_action": "KEEP_UNCHANGED",
                        "request_id_extension": {"typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig",
                            "use_request_id_for_trace_sampling": true
                        }},
                        "server_name": "istio-envoy"
                    }
                }]
            }],
            "traffic_direction": "OUTBOUND"
        })
    }

    fn virtual_hosts(
        &mut self,
        servers: &[BoundServer],
        vss: &[(&Metadata, &VirtualServiceSpec)],
    ) -> Vec<Json> {
        // (host, server port) -> (https redirect, routes), in first-seen order per host.
        let mut hosts: BTreeMap<(String, u32), (bool, Vec<Json>)> = BTreeMap::new();
        for server in servers {
            for (m, vs) in vss {
                let vs_ns = ns(m);
                let bound = |refs: &[String]| {
                    refs.iter().any(|g| {
                        let full = if g.contains('/') {
                            g.clone()
                        } else {
                            format!("{vs_ns}/{g}")
                        };
                        full == server.gateway
                    })
                };
                if !bound(&vs.gateways)
                    && !vs
                        .http
                        .iter()
                        .any(|h| h.matches.iter().any(|mm| bound(&mm.gateways)))
                {
                    continue;
                }
                let mut domains: Vec<String> = Vec::new();
                // istiod resolves short VirtualService hosts in the VirtualService's namespace.
                let vs_hosts: Vec<String> = vs
                    .hosts
                    .iter()
                    .map(|h| fqdn(h, vs_ns, self.options))
                    .collect();
                for h in &vs_hosts {
                    for (filter, sh) in &server.hosts {
                        if filter != "*" && filter != vs_ns {
                            continue;
                        }
                        if let Some(d) = intersect(h, sh) {
                            if !domains.contains(&d) {
                                domains.push(d);
                            }
                        }
                    }
                }
                if domains.is_empty() {
                    continue;
                }
                let routes = self.vs_routes(m, vs, server);
                for d in domains {
                    let e = hosts
                        .entry((d, server.number))
                        .or_insert_with(|| (server.https_redirect, Vec::new()));
                    e.1.extend(routes.iter().cloned());
                }
            }
        }
        let mut vhosts: Vec<Json> = hosts
            .into_iter()
            .map(|((host, port), (redirect, routes))| {
                let mut v = Map::new();
                v.insert("name".into(), json!(format!("{host}:{port}")));
                v.insert("domains".into(), json!([host]));
                v.insert("routes".into(), Json::Array(routes));
                if redirect {
                    v.insert("require_tls".into(), json!("ALL"));
                }
                v.insert("include_request_attempt_count".into(), json!(true));
                Json::Object(v)
            })
            .collect();
        // Stable output: by virtual host name (Envoy picks by domain, not by position).
        vhosts.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
        vhosts
    }

    fn vs_routes(
        &mut self,
        m: &Metadata,
        vs: &VirtualServiceSpec,
        server: &BoundServer,
    ) -> Vec<Json> {
        let vs_ns = ns(m).to_string();
        let meta = json!({"filter_metadata": {"istio": {"config": format!(
            "/apis/{}/namespaces/{vs_ns}/virtual-service/{}", api_version(m), m.name)}}});
        let mut routes = Vec::new();
        for (i, http) in vs.http.iter().enumerate() {
            let at = format!("spec.http[{i}]");
            let action = match self.action(http, &vs_ns, server.number, &at) {
                Ok(a) => a,
                Err(e) => {
                    self.bad.push(invalid("VirtualService", m, e));
                    continue;
                }
            };
            let matches: Vec<Option<&HttpMatch>> = if http.matches.is_empty() {
                vec![None]
            } else {
                http.matches.iter().map(Some).collect()
            };
            let mut catch_all = false;
            for (j, hm) in matches.into_iter().enumerate() {
                if let Some(hm) = hm {
                    if hm.port.is_some_and(|p| p != server.number) {
                        continue;
                    }
                    let refs = if hm.gateways.is_empty() {
                        &vs.gateways
                    } else {
                        &hm.gateways
                    };
                    let bound = refs.iter().any(|g| {
                        let full = if g.contains('/') {
                            g.clone()
                        } else {
                            format!("{vs_ns}/{g}")
                        };
                        full == server.gateway
                    });
                    if !bound {
                        continue;
                    }
                }
                let rm = match route_match(hm, &format!("{at}.match[{j}]")) {
                    Ok(rm) => rm,
                    Err(e) => {
                        self.bad.push(invalid("VirtualService", m, e));
                        continue;
                    }
                };
                let mut r = Map::new();
                let name = match (http.name.as_deref(), hm.and_then(|h| h.name.as_deref())) {
                    (Some(a), Some(b)) => Some(format!("{a}.{b}")),
                    (Some(a), None) => Some(a.to_string()),
                    (None, Some(b)) => Some(b.to_string()),
                    (None, None) => None,
                };
                let is_catch_all = is_catch_all(&rm);
                r.insert("match".into(), rm);
                for (k, v) in &action {
                    r.insert(k.clone(), v.clone());
                }
                r.insert("metadata".into(), meta.clone());
                if let Some(op) = decorator(&r, &m.name, server.number) {
                    r.insert("decorator".into(), json!({"operation": op}));
                }
                if let Some(n) = name {
                    r.insert("name".into(), json!(n));
                }
                routes.push(Json::Object(r));
                if is_catch_all {
                    catch_all = true;
                    break;
                }
            }
            // istiod stops at a route that matches everything: nothing after it can match.
            if catch_all {
                break;
            }
        }
        let _ = &server.gateway_ns;
        routes
    }

    fn destination_cluster(&self, d: &Destination, vs_ns: &str, listener_port: u32) -> String {
        let host = fqdn(&d.host, vs_ns, self.options);
        let port = match &d.port {
            Some(p) => p.number,
            None => match self.reg.services.get(&host).map(|s| s.ports.as_slice()) {
                Some([(only, _, _)]) => *only,
                _ => listener_port,
            },
        };
        format!(
            "outbound|{port}|{}|{host}",
            d.subset.as_deref().unwrap_or("")
        )
    }

    /// The route's action fields (route / redirect / direct_response and the per-filter
    /// configs), shared by every match of one http route.
    fn action(
        &self,
        http: &HttpRoute,
        vs_ns: &str,
        listener_port: u32,
        at: &str,
    ) -> Result<Map<String, Json>, String> {
        if http.delegate.is_some() {
            return Err(format!(
                "{at}.delegate: delegate VirtualServices are not supported yet"
            ));
        }
        let mut out = Map::new();
        let kinds = [
            !http.route.is_empty(),
            http.redirect.is_some(),
            http.direct_response.is_some(),
        ];
        if kinds.iter().filter(|k| **k).count() != 1 {
            return Err(format!(
                "{at}: exactly one of route, redirect, directResponse is required"
            ));
        }
        if let Some(rd) = &http.redirect {
            let mut r = Map::new();
            if let Some(u) = &rd.uri {
                r.insert("path_redirect".into(), json!(u));
            }
            if let Some(a) = &rd.authority {
                r.insert("host_redirect".into(), json!(a));
            }
            if let Some(p) = rd.port {
                r.insert("port_redirect".into(), json!(p));
            } else if rd.derive_port.as_deref() == Some("FROM_PROTOCOL_DEFAULT") {
                let p = if rd.scheme.as_deref() == Some("https") {
                    443
                } else {
                    80
                };
                r.insert("port_redirect".into(), json!(p));
            }
            if let Some(s) = &rd.scheme {
                r.insert("scheme_redirect".into(), json!(s));
            }
            match rd.redirect_code.unwrap_or(301) {
                301 => {}
                302 => {
                    r.insert("response_code".into(), json!("FOUND"));
                }
                303 => {
                    r.insert("response_code".into(), json!("SEE_OTHER"));
                }
                307 => {
                    r.insert("response_code".into(), json!("TEMPORARY_REDIRECT"));
                }
                308 => {
                    r.insert("response_code".into(), json!("PERMANENT_REDIRECT"));
                }
                other => {
                    return Err(format!(
                        "{at}.redirect.redirectCode: {other} is not a redirect code (301, 302, 303, 307, 308)"
                    ))
                }
            }
            out.insert("redirect".into(), Json::Object(r));
        } else if let Some(dr) = &http.direct_response {
            if !(200..=599).contains(&dr.status) {
                return Err(format!(
                    "{at}.directResponse.status: {} is not an HTTP status",
                    dr.status
                ));
            }
            let mut d = Map::new();
            d.insert("status".into(), json!(dr.status));
            match dr.body.as_ref().map(|b| (&b.string, &b.bytes)) {
                Some((Some(s), None)) => {
                    d.insert("body".into(), json!({"inline_string": s}));
                }
                Some((None, Some(b))) => {
                    d.insert("body".into(), json!({"inline_bytes": b}));
                }
                Some((None, None)) | None => {}
                Some(_) => {
                    return Err(format!(
                        "{at}.directResponse.body: only one of string, bytes"
                    ))
                }
            }
            out.insert("direct_response".into(), Json::Object(d));
        } else {
            let mut ra = Map::new();
            let dests: Vec<&RouteDestination> = if http.route.len() > 1 {
                // istiod leaves zero-weight destinations out of the split.
                http.route
                    .iter()
                    .filter(|d| d.weight.unwrap_or(0) > 0)
                    .collect()
            } else {
                http.route.iter().collect()
            };
            for (k, d) in http.route.iter().enumerate() {
                if d.destination.host.is_empty() {
                    return Err(format!("{at}.route[{k}].destination.host is required"));
                }
            }
            match dests.as_slice() {
                [] => {
                    return Err(format!(
                        "{at}.route: with several destinations, weights are required and must not all be 0"
                    ))
                }
                [one] if one.headers.is_none() || http.route.len() == 1 => {
                    ra.insert(
                        "cluster".into(),
                        json!(self.destination_cluster(&one.destination, vs_ns, listener_port)),
                    );
                    if let Some(h) = &one.headers {
                        header_ops(&mut out, h)?;
                    }
                }
                many => {
                    let mut clusters = Vec::new();
                    for d in many {
                        let mut c = Map::new();
                        c.insert(
                            "name".into(),
                            json!(self.destination_cluster(&d.destination, vs_ns, listener_port)),
                        );
                        c.insert("weight".into(), json!(d.weight.unwrap_or(0)));
                        if let Some(h) = &d.headers {
                            header_ops(&mut c, h)?;
                        }
                        clusters.push(Json::Object(c));
                    }
                    ra.insert("weighted_clusters".into(), json!({"clusters": clusters}));
                }
            }
            if let Some(rw) = &http.rewrite {
                if let Some(u) = &rw.uri {
                    ra.insert("prefix_rewrite".into(), json!(u));
                }
                if let Some(a) = &rw.authority {
                    ra.insert("host_rewrite_literal".into(), json!(a));
                }
                if let Some(rr) = &rw.uri_regex_rewrite {
                    if rw.uri.is_some() {
                        return Err(format!(
                            "{at}.rewrite: uri and uriRegexRewrite cannot both be set"
                        ));
                    }
                    check_regex(&rr.pattern, &format!("{at}.rewrite.uriRegexRewrite.match"))?;
                    ra.insert(
                        "regex_rewrite".into(),
                        json!({"pattern": {"regex": rr.pattern}, "substitution": rr.rewrite}),
                    );
                }
            }
            let timeout = match &http.timeout {
                Some(t) => duration(t).map_err(|e| format!("{at}.timeout: {e}"))?,
                None => "0s".into(),
            };
            ra.insert("timeout".into(), json!(timeout));
            if let Some(rp) = retry_policy(http.retries.as_ref(), at)? {
                ra.insert("retry_policy".into(), rp);
            }
            let mut mirrors = Vec::new();
            if let Some(d) = &http.mirror {
                if let Some(f) = mirror_fraction(http.mirror_percentage.as_ref()) {
                    mirrors.push(
                        json!({"cluster": self.destination_cluster(d, vs_ns, listener_port),
                        "runtime_fraction": {"default_value": f}, "trace_sampled": false}),
                    );
                }
            }
            for mi in &http.mirrors {
                if let Some(f) = mirror_fraction(mi.percentage.as_ref()) {
                    mirrors.push(json!({"cluster": self.destination_cluster(&mi.destination, vs_ns, listener_port),
                        "runtime_fraction": {"default_value": f}, "trace_sampled": false}));
                }
            }
            if !mirrors.is_empty() {
                ra.insert("request_mirror_policies".into(), Json::Array(mirrors));
            }
            if let Some(ch) = self.hash_policy(&http.route, vs_ns) {
                ra.insert("hash_policy".into(), json!([ch]));
            }
            ra.insert("max_grpc_timeout".into(), json!(timeout));
            out.insert("route".into(), Json::Object(ra));
        }
        if let Some(h) = &http.headers {
            header_ops(&mut out, h)?;
        }
        let mut per_filter = Map::new();
        if let Some(f) = &http.fault {
            per_filter.insert("envoy.filters.http.fault".into(), fault(f, at)?);
        }
        if let Some(c) = &http.cors_policy {
            per_filter.insert("envoy.filters.http.cors".into(), cors(c, at)?);
        }
        if !per_filter.is_empty() {
            out.insert("typed_per_filter_config".into(), Json::Object(per_filter));
        }
        Ok(out)
    }

    /// istiod hashes by the DestinationRule of the route's (first) destination.
    fn hash_policy(&self, route: &[RouteDestination], vs_ns: &str) -> Option<Json> {
        let d = &route.first()?.destination;
        let host = fqdn(&d.host, vs_ns, self.options);
        let (_, dr) = self.rules.get(&host)?;
        let subset = d
            .subset
            .as_ref()
            .and_then(|s| dr.subsets.iter().find(|x| &x.name == s));
        let port = d.port.as_ref().map(|p| p.number).unwrap_or(0);
        let policy = merged_policy(Some(dr), subset, port);
        let ch = policy.load_balancer?.consistent_hash?;
        Some(if let Some(h) = ch.http_header_name {
            json!({"header": {"header_name": h}})
        } else if let Some(c) = ch.http_cookie {
            let mut cookie = Map::new();
            cookie.insert("name".into(), json!(c.name));
            if let Some(p) = c.path {
                cookie.insert("path".into(), json!(p));
            }
            if let Some(t) = c.ttl.and_then(|t| duration(&t).ok()) {
                cookie.insert("ttl".into(), json!(t));
            }
            json!({"cookie": cookie})
        } else if ch.use_source_ip == Some(true) {
            json!({"connection_properties": {"source_ip": true}})
        } else if let Some(q) = ch.http_query_parameter_name {
            json!({"query_parameter": {"name": q}})
        } else {
            return None;
        })
    }
}

/// The more specific of a VirtualService host and a Gateway server host, if they overlap.
fn intersect(vs_host: &str, server_host: &str) -> Option<String> {
    let covers = |wild: &str, h: &str| -> bool {
        if wild == "*" {
            return true;
        }
        match wild.strip_prefix("*.") {
            Some(suffix) => {
                h.strip_suffix(suffix)
                    .is_some_and(|rest| rest.ends_with('.') && rest.len() > 1)
                    || h == wild
            }
            None => wild == h,
        }
    };
    if covers(server_host, vs_host) {
        Some(vs_host.to_string())
    } else if covers(vs_host, server_host) {
        Some(server_host.to_string())
    } else {
        None
    }
}

fn route_config(name: &str, mut vhosts: Vec<Json>, servers: &[BoundServer]) -> Json {
    if vhosts.is_empty() {
        // No VirtualService binds here: istiod answers everything with 404.
        let port = servers.first().map(|s| s.number).unwrap_or(0);
        vhosts.push(json!({
            "name": format!("blackhole:{port}"),
            "domains": ["*"],
            "routes": [{"name": "block_all", "match": {"prefix": "/"}, "direct_response": {"status": 404}}],
            "include_request_attempt_count": true
        }));
    }
    json!({
        "name": name,
        "virtual_hosts": vhosts,
        "validate_clusters": false,
        "max_direct_response_body_size_bytes": 1048576,
        "ignore_port_in_host_matching": true
    })
}

fn route_match(hm: Option<&HttpMatch>, at: &str) -> Result<Json, String> {
    let mut m = Map::new();
    let Some(hm) = hm else {
        m.insert("prefix".into(), json!("/"));
        m.insert("case_sensitive".into(), json!(true));
        return Ok(Json::Object(m));
    };
    match &hm.uri {
        None => {
            m.insert("prefix".into(), json!("/"));
        }
        Some(u) => match string_match(u, &format!("{at}.uri"))? {
            Some(Json::Object(sm)) => {
                for (k, v) in sm {
                    let key = match k.as_str() {
                        "exact" => "path",
                        other => other,
                    };
                    m.insert(key.into(), v);
                }
            }
            _ => {
                m.insert("prefix".into(), json!("/"));
            }
        },
    }
    m.insert("case_sensitive".into(), json!(!hm.ignore_uri_case));
    let mut headers = Vec::new();
    let header = |name: &str, sm: &StringMatch, invert: bool, at: &str| -> Result<Json, String> {
        let mut h = Map::new();
        h.insert("name".into(), json!(name));
        match string_match(sm, at)? {
            Some(s) => {
                h.insert("string_match".into(), s);
            }
            None => {
                h.insert("present_match".into(), json!(true));
            }
        }
        if invert {
            h.insert("invert_match".into(), json!(true));
        }
        Ok(Json::Object(h))
    };
    for (name, sm) in &hm.headers {
        headers.push(header(
            &name.to_ascii_lowercase(),
            sm,
            false,
            &format!("{at}.headers.{name}"),
        )?);
    }
    for (name, sm) in &hm.without_headers {
        headers.push(header(
            &name.to_ascii_lowercase(),
            sm,
            true,
            &format!("{at}.withoutHeaders.{name}"),
        )?);
    }
    if let Some(a) = &hm.authority {
        headers.push(header(":authority", a, false, &format!("{at}.authority"))?);
    }
    if let Some(me) = &hm.method {
        headers.push(header(":method", me, false, &format!("{at}.method"))?);
    }
    if let Some(s) = &hm.scheme {
        headers.push(header(":scheme", s, false, &format!("{at}.scheme"))?);
    }
    if !headers.is_empty() {
        m.insert("headers".into(), Json::Array(headers));
    }
    let mut query = Vec::new();
    for (name, sm) in &hm.query_params {
        let mut q = Map::new();
        q.insert("name".into(), json!(name));
        match string_match(sm, &format!("{at}.queryParams.{name}"))? {
            Some(s) => {
                q.insert("string_match".into(), s);
            }
            None => {
                q.insert("present_match".into(), json!(true));
            }
        }
        query.push(Json::Object(q));
    }
    if !query.is_empty() {
        m.insert("query_parameters".into(), Json::Array(query));
    }
    Ok(Json::Object(m))
}

fn is_catch_all(m: &Json) -> bool {
    let Some(o) = m.as_object() else { return false };
    o.get("prefix").and_then(Json::as_str) == Some("/")
        && o.keys().all(|k| k == "prefix" || k == "case_sensitive")
}

/// istiod's operation name: `<host>:<port><path>` for one cluster, the VirtualService's name
/// when the route splits.
fn decorator(route: &Map<String, Json>, vs_name: &str, port: u32) -> Option<String> {
    let ra = route.get("route")?;
    let m = route.get("match")?;
    let path = if let Some(p) = m.get("prefix").and_then(Json::as_str) {
        format!("{p}*")
    } else if let Some(p) = m.get("path").and_then(Json::as_str) {
        p.to_string()
    } else if let Some(r) = m.pointer("/safe_regex/regex").and_then(Json::as_str) {
        r.to_string()
    } else {
        "/*".to_string()
    };
    match ra.get("cluster").and_then(Json::as_str) {
        Some(c) => {
            let mut parts = c.split('|');
            let (_, p, _, h) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
            Some(format!("{h}:{p}{path}"))
        }
        None => Some(format!("{vs_name}:{port}{path}")),
    }
}

fn retry_policy(r: Option<&Retries>, at: &str) -> Result<Option<Json>, String> {
    let mut p = json!({
        "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
        "num_retries": 2,
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}
        }],
        "host_selection_retry_max_attempts": "5",
        "retriable_status_codes": [503]
    });
    let Some(r) = r else { return Ok(Some(p)) };
    let attempts = r.attempts.unwrap_or(0);
    if attempts <= 0 {
        return Ok(None);
    }
    p["num_retries"] = json!(attempts);
    if let Some(on) = &r.retry_on {
        let mut kinds = Vec::new();
        let mut codes = Vec::new();
        for part in on.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match part.parse::<u32>() {
                Ok(code) if (100..=599).contains(&code) => codes.push(code),
                Ok(_) => {
                    return Err(format!(
                        "{at}.retries.retryOn: '{part}' is not an HTTP status"
                    ))
                }
                Err(_) => kinds.push(part.to_string()),
            }
        }
        if !codes.is_empty() && !kinds.iter().any(|k| k == "retriable-status-codes") {
            kinds.push("retriable-status-codes".into());
        }
        p["retry_on"] = json!(kinds.join(","));
        match p.as_object_mut() {
            Some(o) if codes.is_empty() => {
                o.remove("retriable_status_codes");
            }
            Some(o) => {
                o.insert("retriable_status_codes".into(), json!(codes));
            }
            None => {}
        }
    }
    if let Some(t) = &r.per_try_timeout {
        p["per_try_timeout"] =
            json!(duration(t).map_err(|e| format!("{at}.retries.perTryTimeout: {e}"))?);
    }
    Ok(Some(p))
}

fn mirror_fraction(p: Option<&Percent>) -> Option<Json> {
    match p {
        Some(p) if p.value > 0.0 => Some(per_million(p.value)),
        Some(_) => None,
        None => Some(json!({"numerator": 100, "denominator": "HUNDRED"})),
    }
}

fn header_ops(out: &mut Map<String, Json>, h: &Headers) -> Result<(), String> {
    for (ops, add_key, remove_key) in [
        (
            &h.request,
            "request_headers_to_add",
            "request_headers_to_remove",
        ),
        (
            &h.response,
            "response_headers_to_add",
            "response_headers_to_remove",
        ),
    ] {
        let Some(ops) = ops else { continue };
        let mut add = Vec::new();
        for (k, v) in &ops.set {
            add.push(json!({"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}));
        }
        for (k, v) in &ops.add {
            add.push(json!({"header": {"key": k, "value": v}}));
        }
        if !add.is_empty() {
            out.insert(add_key.into(), Json::Array(add));
        }
        if !ops.remove.is_empty() {
            out.insert(remove_key.into(), json!(ops.remove));
        }
    }
    Ok(())
}

fn fault(f: &Fault, at: &str) -> Result<Json, String> {
    let mut o = Map::new();
    o.insert(
        "@type".into(),
        json!("type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"),
    );
    let pct = |p: &Option<Percent>, int: Option<u32>| match (p, int) {
        (Some(p), _) => per_million(p.value),
        (None, Some(i)) => json!({"numerator": i, "denominator": "HUNDRED"}),
        (None, None) => json!({"numerator": 100, "denominator": "HUNDRED"}),
    };
    if let Some(d) = &f.delay {
        let fixed = d
            .fixed_delay
            .as_deref()
            .ok_or_else(|| format!("{at}.fault.delay.fixedDelay is required"))?;
        o.insert(
            "delay".into(),
            json!({"fixed_delay": duration(fixed).map_err(|e| format!("{at}.fault.delay.fixedDelay: {e}"))?,
                   "percentage": pct(&d.percentage, d.percent)}),
        );
    }
    if let Some(a) = &f.abort {
        let mut ab = Map::new();
        match (a.http_status, &a.grpc_status) {
            (Some(s), None) if (200..600).contains(&s) => {
                ab.insert("http_status".into(), json!(s));
            }
            (Some(s), None) => {
                return Err(format!(
                    "{at}.fault.abort.httpStatus: {s} is not an HTTP status"
                ))
            }
            (None, Some(g)) => {
                let code = GRPC_CODES.iter().position(|c| c == g).ok_or_else(|| {
                    format!("{at}.fault.abort.grpcStatus: unknown gRPC status '{g}'")
                })?;
                ab.insert("grpc_status".into(), json!(code));
            }
            _ => {
                return Err(format!(
                    "{at}.fault.abort: exactly one of httpStatus, grpcStatus is required"
                ))
            }
        }
        ab.insert("percentage".into(), pct(&a.percentage, None));
        o.insert("abort".into(), Json::Object(ab));
    }
    Ok(Json::Object(o))
}

fn cors(c: &CorsPolicy, at: &str) -> Result<Json, String> {
    let mut o = Map::new();
    o.insert(
        "@type".into(),
        json!("type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy"),
    );
    let mut origins = Vec::new();
    for o in &c.allow_origin {
        origins.push(json!({"exact": o}));
    }
    for (i, sm) in c.allow_origins.iter().enumerate() {
        if let Some(m) = string_match(sm, &format!("{at}.corsPolicy.allowOrigins[{i}]"))? {
            origins.push(m);
        }
    }
    if !origins.is_empty() {
        o.insert("allow_origin_string_match".into(), Json::Array(origins));
    }
    for (field, list) in [
        ("allow_methods", &c.allow_methods),
        ("allow_headers", &c.allow_headers),
        ("expose_headers", &c.expose_headers),
    ] {
        if !list.is_empty() {
            o.insert(field.into(), json!(list.join(",")));
        }
    }
    if let Some(m) = &c.max_age {
        let d = duration(m).map_err(|e| format!("{at}.corsPolicy.maxAge: {e}"))?;
        let secs = d.trim_end_matches('s').parse::<f64>().unwrap_or(0.0) as u64;
        o.insert("max_age".into(), json!(secs.to_string()));
    }
    if let Some(b) = c.allow_credentials {
        o.insert("allow_credentials".into(), json!(b));
    }
    o.insert(
        "filter_enabled".into(),
        json!({"default_value": {"numerator": 100, "denominator": "HUNDRED"}}),
    );
    Ok(Json::Object(o))
}

#[cfg(test)]
#[path = "translate_tests.rs"]
mod translate_tests;
