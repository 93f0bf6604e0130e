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
#[derive(Clone, Default, PartialEq)]
pub struct XdsJson {
    pub listeners: BTreeMap<String, Json>,
    pub routes: BTreeMap<String, Json>,
    pub clusters: BTreeMap<String, Json>,
    pub endpoints: BTreeMap<String, Json>,
    /// SDS secrets. Key material: never log these.
    pub secrets: BTreeMap<String, Json>,
}

impl std::fmt::Debug for XdsJson {
    /// Names only: the secrets hold private keys, and the rest is too long to read this way.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names = |m: &BTreeMap<String, Json>| m.keys().cloned().collect::<Vec<_>>();
        f.debug_struct("XdsJson")
            .field("listeners", &names(&self.listeners))
            .field("routes", &names(&self.routes))
            .field("clusters", &names(&self.clusters))
            .field("endpoints", &names(&self.endpoints))
            .field("secrets", &names(&self.secrets))
            .finish()
    }
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
        (&out.secrets, &mut xds.secrets, types::SECRET),
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

// ---------------------------------------------------------------------------------------
// The translation.

struct Ctx<'a> {
    options: &'a Options,
    reg: Registry,
    /// DestinationRules by the fqdn of their host.
    rules: BTreeMap<String, (&'a Metadata, &'a DestinationRuleSpec)>,
    /// Where the gateway runs: its credentialName secrets are read from this namespace.
    proxy_namespace: Option<String>,
    /// Gateway servers validation left out: (`namespace/name`, server index).
    skip_servers: BTreeSet<(String, usize)>,
    /// Hosts whose DestinationRule validation refused: no clusters (fail closed).
    closed_hosts: BTreeSet<String>,
    /// The AuthorizationPolicies selecting this gateway, as RBAC filters for its HTTP
    /// connection managers and its TCP chains.
    authz_http: Vec<Json>,
    authz_tcp: Vec<Json>,
    bad: Vec<Invalid>,
}

/// The checks the translation makes on one http route (its action and its matches), for
/// validation of VirtualServices no gateway binds: the same functions, the same words.
pub(super) fn check_http_route(
    http: &HttpRoute,
    vs_ns: &str,
    options: &Options,
    at: &str,
) -> Result<(), String> {
    let cx = Ctx {
        options,
        reg: Registry::default(),
        rules: BTreeMap::new(),
        proxy_namespace: None,
        skip_servers: BTreeSet::new(),
        closed_hosts: BTreeSet::new(),
        authz_http: Vec::new(),
        authz_tcp: Vec::new(),
        bad: Vec::new(),
    };
    // The port only names clusters; any will do for the checks.
    cx.action(http, vs_ns, 80, at)?;
    for (j, hm) in http.matches.iter().enumerate() {
        route_match(Some(hm), &format!("{at}.match[{j}]"))?;
    }
    Ok(())
}

pub fn translate_json(
    config: &Config,
    node: &NodeInfo,
    options: &Options,
) -> (XdsJson, Vec<Invalid>) {
    let mut bad = Vec::new();
    let all = dedup(config, &mut bad);
    // Every object is validated, whichever gateway selects it; what fails is left out here
    // and reported after what the translation reports.
    let checked = super::validate::check(&all, options);
    let config = checked.kept(&all);
    let skip_servers = checked
        .skip_servers
        .iter()
        .filter_map(|(o, s)| {
            let m = all.objects.get(*o)?.metadata();
            Some((format!("{}/{}", ns(m), m.name), *s))
        })
        .collect();
    let closed_hosts = checked
        .fail_closed
        .iter()
        .filter_map(|o| match all.objects.get(*o)? {
            Object::DestinationRule(m, dr) if !dr.host.is_empty() => {
                Some(fqdn(&dr.host, ns(m), options))
            }
            _ => None,
        })
        .collect();
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
    let (authz_http, authz_tcp) = authorization(&config, node, &reg, &mut bad);
    let mut cx = Ctx {
        options,
        reg,
        rules,
        proxy_namespace: node.namespace.clone(),
        skip_servers,
        closed_hosts,
        authz_http,
        authz_tcp,
        bad,
    };
    let mut out = XdsJson::default();
    cx.clusters(&mut out);
    cx.gateways(&config, node, &mut out);
    let mut bad = cx.bad;
    fill_files(&config, &mut bad);
    bad.extend(checked.reports);
    (out, bad)
}

/// The gateway's AuthorizationPolicies as istiod renders them for it (`authz` module): RBAC
/// HTTP filters and network RBAC filters; CUSTOM ones as the mesh config's ext_authz
/// provider behind an RBAC filter that marks what their rules match (a provider that cannot
/// be used denies what they match, as istiod does, and is reported). RequestAuthentications
/// become the `jwt_authn` filter between them (`authn` module).
fn authorization(
    config: &Config,
    node: &NodeInfo,
    reg: &Registry,
    bad: &mut Vec<Invalid>,
) -> (Vec<Json>, Vec<Json>) {
    use super::authz;
    let node_ns = node.namespace.as_deref().unwrap_or("default");
    let mut selected = Vec::new();
    for o in &config.objects {
        let Object::AuthorizationPolicy(m, spec) = o else {
            continue;
        };
        let refs: Vec<&authz::TargetRef> =
            spec.target_ref.iter().chain(&spec.target_refs).collect();
        if !authz::selects(spec.selector.as_ref(), &refs, ns(m), node_ns, &node.labels) {
            continue;
        }
        match authz::action(spec) {
            Err(e) => bad.push(invalid("AuthorizationPolicy", m, e)),
            Ok(_) => selected.push((m, spec.clone())),
        }
    }
    let policies: Vec<authz::Policy<'_>> = selected
        .iter()
        .map(|(m, spec)| authz::Policy {
            namespace: ns(m),
            name: &m.name,
            spec,
            dry_run: m
                .annotations
                .get("istio.io/dry-run")
                .is_some_and(|v| v.eq_ignore_ascii_case("true")),
        })
        .collect();
    // CUSTOM: the mesh config's ext_authz providers (istiod reads the `istio` ConfigMap of its
    // root namespace).
    let mesh = config
        .objects
        .iter()
        .find_map(|o| match o {
            Object::MeshConfig(m, c) if ns(m) == authz::ROOT_NAMESPACE && m.name == "istio" => {
                Some(c.clone())
            }
            _ => None,
        })
        .unwrap_or_default();
    let lookup = |service: &str, port: u32| -> Result<(String, String), String> {
        let (want_ns, host) = match service.split_once('/') {
            Some((n, h)) => (Some(n), h),
            None => (None, service),
        };
        let s = reg
            .services
            .get(host)
            .filter(|s| want_ns.is_none_or(|n| n == s.namespace))
            .ok_or_else(|| format!("could not find service {service:?} in the registry"))?;
        if !s.ports.iter().any(|(p, _, _)| *p == port) {
            return Err(format!("service {host} has no port {port}"));
        }
        Ok((s.fqdn.clone(), format!("outbound|{port}||{}", s.fqdn)))
    };
    let (custom_http, custom_tcp, custom_problems) = authz::build_custom(&policies, &mesh, &lookup);
    for (namespace, name, reason) in custom_problems {
        if let Some((m, _)) = selected
            .iter()
            .find(|(m, _)| ns(m) == namespace && m.name == name)
        {
            bad.push(invalid("AuthorizationPolicy", m, reason));
        }
    }
    let (mut http, problems) = authz::build_http(&policies, false);
    let (tcp, _) = authz::build_tcp(&policies);
    for (namespace, name, reason) in problems {
        if let Some((m, _)) = selected
            .iter()
            .find(|(m, _)| ns(m) == namespace && m.name == name)
        {
            bad.push(invalid("AuthorizationPolicy", m, reason));
        }
    }
    // RequestAuthentication: the jwt_authn filter goes before the RBAC filters (istiod's
    // order: CUSTOM authorization, authentication, authorization).
    let mut authn_rules = Vec::new();
    let mut authn_meta = Vec::new();
    for o in &config.objects {
        let Object::RequestAuthentication(m, spec) = o else {
            continue;
        };
        let refs: Vec<&authz::TargetRef> =
            spec.target_ref.iter().chain(&spec.target_refs).collect();
        if !super::authz::selects(spec.selector.as_ref(), &refs, ns(m), node_ns, &node.labels) {
            continue;
        }
        authn_meta.push(m);
        for (index, rule) in spec.jwt_rules.iter().enumerate() {
            authn_rules.push(super::authn::Rule {
                namespace: ns(m),
                name: &m.name,
                index,
                rule,
            });
        }
    }
    let cluster_for = |host: &str, port: u16| -> Option<String> {
        reg.services.get(host).and_then(|s| {
            s.ports
                .iter()
                .any(|(p, _, _)| *p == u32::from(port))
                .then(|| format!("outbound|{port}||{}", s.fqdn))
        })
    };
    let (jwt, problems) = super::authn::jwt_filter(&authn_rules, &cluster_for);
    for (namespace, name, reason) in problems {
        if let Some(m) = authn_meta
            .iter()
            .find(|m| ns(m) == namespace && m.name == name)
        {
            bad.push(invalid("RequestAuthentication", m, reason));
        }
    }
    if let Some(j) = jwt {
        http.insert(0, j);
    }
    // istiod's order: CUSTOM first, then authentication, then ALLOW/DENY/AUDIT.
    let http = custom_http.into_iter().chain(http).collect();
    let tcp = custom_tcp.into_iter().chain(tcp).collect();
    (http, tcp)
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
            if self.closed_hosts.contains(&svc.fqdn) {
                continue;
            }
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
    gateway_name: String,
    gateway_ns: String,
    /// The Gateway object and the server's index in it, for reports.
    meta: &'a Metadata,
    index: usize,
    number: u32,
    /// Upper case, as istiod parses it.
    protocol: String,
    hosts: Vec<(String, String)>, // (namespace filter, host)
    https_redirect: bool,
    server: &'a Server,
}

/// istiod's HTTP protocols: one plaintext connection manager per port.
pub(super) fn is_http_protocol(p: &str) -> bool {
    matches!(p, "HTTP" | "HTTP2" | "GRPC" | "GRPC-WEB" | "HTTP_PROXY")
}

/// The istio TLS mode of a server with `tls` (SIMPLE when unset, as the API defaults it).
fn tls_mode(t: &ServerTls) -> String {
    t.mode.as_deref().unwrap_or("SIMPLE").to_ascii_uppercase()
}

impl BoundServer<'_> {
    fn tls(&self) -> Option<&ServerTls> {
        self.server.tls.as_ref()
    }

    fn is_passthrough(&self) -> bool {
        self.tls()
            .is_some_and(|t| matches!(tls_mode(t).as_str(), "PASSTHROUGH" | "AUTO_PASSTHROUGH"))
    }

    /// istiod's `IsTLSServer`: TLS settings on a non-HTTP port (an HTTP server's `tls` only
    /// carries httpsRedirect).
    fn is_tls_server(&self) -> bool {
        self.tls().is_some() && !is_http_protocol(&self.protocol)
    }

    /// istiod's `IsHTTPServer`: plaintext HTTP, or HTTPS terminated here.
    fn is_http_server(&self) -> bool {
        is_http_protocol(&self.protocol) || (self.protocol == "HTTPS" && !self.is_passthrough())
    }

    /// The RDS name istiod gives the server: `http.<listener port>` for plaintext HTTP,
    /// `https.<server port>.<port name>.<gateway>.<namespace>` for terminated HTTPS, none
    /// for the rest (TCP proxies have no routes).
    fn route_name(&self, listen: u32) -> Option<String> {
        if is_http_protocol(&self.protocol) {
            Some(format!("http.{listen}"))
        } else if self.protocol == "HTTPS" && !self.is_passthrough() {
            Some(format!(
                "https.{}.{}.{}.{}",
                self.number,
                self.server.port.name.as_deref().unwrap_or(""),
                self.gateway_name,
                self.gateway_ns
            ))
        } else {
            None
        }
    }

    /// istiod's SNI hosts for the server: its hosts without namespace, deduplicated, sorted.
    fn sni_hosts(&self) -> Vec<String> {
        let set: BTreeSet<String> = self.hosts.iter().map(|(_, h)| h.clone()).collect();
        set.into_iter().collect()
    }

    fn report(&self, what: String) -> Invalid {
        invalid(
            "Gateway",
            self.meta,
            format!("spec.servers[{}]{what}", self.index),
        )
    }

    /// Whether a VirtualService's `gateways` entry names this server's Gateway.
    fn named_by(&self, refs: &[String], vs_ns: &str) -> bool {
        refs.iter().any(|g| {
            let full = if g.contains('/') {
                g.clone()
            } else {
                format!("{vs_ns}/{g}")
            };
            full == self.gateway
        })
    }
}

/// One filter chain before it becomes JSON: istiod's `filterChainOpts`.
struct Chain {
    sni_hosts: Vec<String>,
    application_protocols: Vec<String>,
    tls: Option<Json>,
    filters: Vec<Json>,
}

impl Chain {
    fn json(&self) -> Json {
        let mut c = Map::new();
        // istiod: a chain that matches everything has no filter_chain_match; "*" among the
        // SNI hosts means any name.
        let mut m = Map::new();
        if !self.sni_hosts.is_empty() && !self.sni_hosts.iter().any(|h| h == "*") {
            let mut names = self.sni_hosts.clone();
            names.sort();
            m.insert("server_names".into(), json!(names));
        }
        if !self.application_protocols.is_empty() {
            m.insert(
                "application_protocols".into(),
                json!(self.application_protocols),
            );
        }
        if !m.is_empty() {
            c.insert("filter_chain_match".into(), Json::Object(m));
        }
        c.insert("filters".into(), json!(self.filters));
        if let Some(tls) = &self.tls {
            c.insert(
                "transport_socket".into(),
                json!({"name": "envoy.transport_sockets.tls", "typed_config": tls}),
            );
        }
        Json::Object(c)
    }

    /// istiod adds the TLS inspector when a chain matches on SNI or offers ALPN.
    fn needs_tls_inspector(&self) -> bool {
        !self.sni_hosts.is_empty()
            || self
                .tls
                .as_ref()
                .and_then(|t| t.pointer("/common_tls_context/alpn_protocols"))
                .and_then(Json::as_array)
                .is_some_and(|a| !a.is_empty())
    }
}

/// A Kubernetes Secret an SDS resource name refers to.
struct SecretRef {
    namespace: String,
    name: String,
    /// `-cacert`: the CA bundle, for client certificate validation.
    ca: bool,
    /// The server that named it, for the report when it is missing.
    reported_by: Invalid,
    /// Why istiod would not serve it (another namespace), if so.
    refused: Option<String>,
}

/// istiod's SNI for AUTO_PASSTHROUGH chains: what a sidecar's mTLS cluster sends.
const ISTIO_MTLS_ALPNS: [&str; 5] = [
    "istio",
    "istio-peer-exchange",
    "istio-http/1.0",
    "istio-http/1.1",
    "istio-h2",
];

/// istiod's `ValidCipherSuites`: what BoringSSL knows; others are dropped (Envoy would NACK).
const VALID_CIPHER_SUITES: [&str; 15] = [
    "ECDHE-ECDSA-AES128-GCM-SHA256",
    "ECDHE-RSA-AES128-GCM-SHA256",
    "ECDHE-ECDSA-AES256-GCM-SHA384",
    "ECDHE-RSA-AES256-GCM-SHA384",
    "ECDHE-ECDSA-CHACHA20-POLY1305",
    "ECDHE-RSA-CHACHA20-POLY1305",
    "ECDHE-ECDSA-AES128-SHA",
    "ECDHE-RSA-AES128-SHA",
    "ECDHE-ECDSA-AES256-SHA",
    "ECDHE-RSA-AES256-SHA",
    "AES128-GCM-SHA256",
    "AES256-GCM-SHA384",
    "AES128-SHA",
    "AES256-SHA",
    "DES-CBC3-SHA",
];

/// istiod's SDS source for `credentialName` secrets: the ADS stream itself. No
/// initial_fetch_timeout on purpose (istiod's choice): a missing secret must not block the
/// whole listener forever, only its chain.
fn credential_sds(name: &str) -> Json {
    json!({"name": name, "sds_config": {"ads": {}, "resource_api_version": "V3"}})
}

/// istio-agent's SDS (the workload certificate `default`, the mesh root `ROOTCA`).
fn agent_sds(name: &str) -> Json {
    json!({"name": name, "sds_config": {"api_config_source": {"api_type": "GRPC",
        "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}],
        "set_node_on_first_message_only": true, "transport_api_version": "V3"},
        "initial_fetch_timeout": "0s", "resource_api_version": "V3"}})
}

/// `credentialName` as istiod names the SDS resource.
fn credential_resource(name: &str) -> String {
    if name.starts_with("kubernetes://") {
        name.to_string()
    } else {
        format!("kubernetes://{name}")
    }
}

fn exact_matchers(list: &[String]) -> Json {
    Json::Array(list.iter().map(|s| json!({"exact": s})).collect())
}

/// istiod's TLS protocol enum to Envoy's; TLS_AUTO (the default) sets nothing.
fn tls_version(v: &str, at: &str) -> Result<Option<&'static str>, String> {
    Ok(match v.to_ascii_uppercase().as_str() {
        "TLS_AUTO" | "" => None,
        "TLSV1_0" => Some("TLSv1_0"),
        "TLSV1_1" => Some("TLSv1_1"),
        "TLSV1_2" => Some("TLSv1_2"),
        "TLSV1_3" => Some("TLSv1_3"),
        _ => {
            return Err(format!(
                "{at}: unknown TLS version '{v}' (TLS_AUTO, TLSV1_0, TLSV1_1, TLSV1_2, TLSV1_3)"
            ))
        }
    })
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
        // Listener port -> servers on it, merged as istiod merges them.
        let mut by_port: BTreeMap<u32, Vec<BoundServer>> = BTreeMap::new();
        // Per listener port: the protocol of a plaintext first server, the TLS servers'
        // hosts, and the route names in use.
        let mut plaintext: BTreeMap<u32, String> = BTreeMap::new();
        let mut tls_hosts: BTreeMap<u32, BTreeSet<String>> = BTreeMap::new();
        let mut route_names: BTreeSet<String> = BTreeSet::new();
        for o in &config.objects {
            let Object::Gateway(m, gw) = o else { continue };
            if !selects(&gw.selector, &node.labels) {
                continue;
            }
            let key = format!("{}/{}", ns(m), m.name);
            for (i, s) in gw.servers.iter().enumerate() {
                if self.skip_servers.contains(&(key.clone(), i)) {
                    continue;
                }
                let protocol = s
                    .port
                    .protocol
                    .as_deref()
                    .unwrap_or("")
                    .to_ascii_uppercase();
                let skip = |why: String| invalid("Gateway", m, format!("spec.servers[{i}]{why}"));
                match protocol.as_str() {
                    "HTTP" | "HTTP2" | "GRPC" | "GRPC-WEB" | "HTTP_PROXY" | "HTTPS" | "TLS"
                    | "TCP" => {}
                    "MONGO" | "REDIS" | "MYSQL" => {
                        self.bad.push(skip(format!(
                            ".port.protocol: {protocol} servers (Envoy's {} filter) are not served by Portico's control plane; use TCP; server skipped",
                            protocol.to_ascii_lowercase()
                        )));
                        continue;
                    }
                    other => {
                        self.bad
                            .push(skip(format!(".port.protocol: unknown protocol '{other}'")));
                        continue;
                    }
                }
                if s.hosts.is_empty() {
                    self.bad
                        .push(skip(".hosts: at least one host is required".into()));
                    continue;
                }
                if s.port.number == 0 || s.port.number > 65535 {
                    self.bad.push(skip(format!(
                        ".port.number: {} is not a port",
                        s.port.number
                    )));
                    continue;
                }
                if let Err(e) = check_server_tls(s, &protocol) {
                    self.bad.push(skip(e));
                    continue;
                }
                let gateway_ns = ns(m).to_string();
                let hosts = s
                    .hosts
                    .iter()
                    .map(|h| match h.split_once('/') {
                        Some((".", h)) => (gateway_ns.clone(), h.to_string()),
                        Some(("*", h)) => ("*".to_string(), h.to_string()),
                        Some((n, h)) => (n.to_string(), h.to_string()),
                        None => ("*".to_string(), h.clone()),
                    })
                    .collect();
                let listen = gateway_service_ports
                    .get(&s.port.number)
                    .copied()
                    .unwrap_or(s.port.number);
                let bound = BoundServer {
                    gateway: format!("{gateway_ns}/{}", m.name),
                    gateway_name: m.name.clone(),
                    gateway_ns,
                    meta: m,
                    index: i,
                    number: s.port.number,
                    protocol,
                    hosts,
                    https_redirect: s.tls.as_ref().is_some_and(|t| t.https_redirect),
                    server: s,
                };
                // istiod's mergeGateways, for servers without `bind`.
                if bound.tls().is_some() {
                    // Two TLS servers with one host would be two chains Envoy cannot tell
                    // apart: the later one is dropped.
                    let known = tls_hosts.entry(listen).or_default();
                    let dups: Vec<&String> =
                        s.hosts.iter().filter(|h| known.contains(*h)).collect();
                    if !dups.is_empty() {
                        self.bad.push(bound.report(format!(
                            ": port {listen}: duplicate host names {dups:?} (another TLS server on the port has them); server skipped"
                        )));
                        continue;
                    }
                    known.extend(s.hosts.iter().cloned());
                }
                let route = bound.route_name(listen);
                match by_port.get(&listen) {
                    Some(_) => {
                        if let Some(current) = plaintext.get(&listen) {
                            if !(is_http_protocol(&bound.protocol) && is_http_protocol(current)) {
                                self.bad.push(bound.report(format!(
                                    ": port {listen} already serves plaintext {current}; a {} server cannot share it (istiod skips it too)",
                                    bound.protocol
                                )));
                                continue;
                            }
                        } else {
                            if bound.is_http_server() {
                                let Some(route) = &route else { continue };
                                if !route_names.insert(route.clone()) {
                                    self.bad.push(bound.report(format!(
                                        ".port.name: route {route} exists already (HTTPS servers on one port need distinct port names); server skipped"
                                    )));
                                    continue;
                                }
                            }
                            if bound.tls().is_none() {
                                self.bad.push(bound.report(format!(
                                    ": port {listen} serves TLS; a server without tls settings cannot share it; server skipped"
                                )));
                                continue;
                            }
                        }
                    }
                    None => {
                        if !bound.is_tls_server() {
                            plaintext.insert(listen, bound.protocol.clone());
                        }
                        if bound.is_http_server() {
                            if let Some(r) = &route {
                                route_names.insert(r.clone());
                            }
                        }
                    }
                }
                by_port.entry(listen).or_default().push(bound);
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
        }
        let mut secrets: BTreeMap<String, SecretRef> = BTreeMap::new();
        for (port, servers) in &by_port {
            let listener_name = format!("0.0.0.0_{port}");
            let first_http = servers
                .first()
                .is_some_and(|s| is_http_protocol(&s.protocol));
            if first_http {
                let route_name = format!("http.{port}");
                let stat_prefix = format!("outbound_{listener_name}");
                let chain = Chain {
                    sni_hosts: Vec::new(),
                    application_protocols: Vec::new(),
                    tls: None,
                    filters: vec![hcm(&stat_prefix, &route_name, &self.authz_http)],
                };
                out.listeners.insert(
                    listener_name.clone(),
                    self.listener(&listener_name, *port, &[chain]),
                );
                let vhosts = self.virtual_hosts(servers, &vss);
                out.routes.insert(
                    route_name.clone(),
                    route_config(&route_name, vhosts, servers),
                );
                continue;
            }
            let mut chains = Vec::new();
            for server in servers {
                self.server_chains(server, *port, &vss, &mut chains, &mut secrets, out);
            }
            if chains.is_empty() {
                // istiod: "must have more than 0 chains"; the listener is left out.
                if let Some(first) = servers.first() {
                    self.bad.push(first.report(format!(
                        ": listener {listener_name} has no filter chain (no VirtualService tcp/tls route matches its servers); left out, as istiod does"
                    )));
                }
                continue;
            }
            out.listeners.insert(
                listener_name.clone(),
                self.listener(&listener_name, *port, &chains),
            );
        }
        self.secrets(config, secrets, out);
    }

    /// The filter chains one server on a TLS or TCP port adds (istiod's
    /// `buildGatewayTCPBasedFilterChains`), and the route configuration of an HTTPS server.
    fn server_chains(
        &mut self,
        server: &BoundServer,
        listen: u32,
        vss: &[(&Metadata, &VirtualServiceSpec)],
        chains: &mut Vec<Chain>,
        secrets: &mut BTreeMap<String, SecretRef>,
        out: &mut XdsJson,
    ) {
        let listener_name = format!("0.0.0.0_{listen}");
        if server.is_http_server() {
            // HTTPS terminated here: its own connection manager and route configuration.
            let Some(route_name) = server.route_name(listen) else {
                return;
            };
            let tls = match self.downstream_tls(server, false, secrets) {
                Ok(t) => t,
                Err(e) => {
                    self.bad.push(server.report(e));
                    return;
                }
            };
            let stat_prefix = match server.server.name.as_deref() {
                Some(n) if !n.is_empty() => n.to_string(),
                _ => format!("outbound_{listener_name}"),
            };
            chains.push(Chain {
                sni_hosts: server.sni_hosts(),
                application_protocols: Vec::new(),
                tls: Some(tls),
                filters: vec![hcm(&stat_prefix, &route_name, &self.authz_http)],
            });
            let vhosts = self.virtual_hosts(std::slice::from_ref(server), vss);
            out.routes.insert(
                route_name.clone(),
                route_config(&route_name, vhosts, std::slice::from_ref(server)),
            );
            return;
        }
        let mode = server.tls().map(tls_mode);
        match mode.as_deref() {
            // Opaque TCP, or TLS terminated in front of a TCP proxy.
            None | Some("SIMPLE" | "MUTUAL" | "OPTIONAL_MUTUAL" | "ISTIO_MUTUAL") => {
                let Some(filters) = self.tcp_route_filters(server, vss) else {
                    self.bad.push(server.report(format!(
                        ": no VirtualService tcp route binds to this {} server; it gets no filter chain",
                        server.protocol
                    )));
                    return;
                };
                let (sni_hosts, tls) = match mode {
                    None => (Vec::new(), None),
                    Some(_) => match self.downstream_tls(server, true, secrets) {
                        Ok(t) => (server.sni_hosts(), Some(t)),
                        Err(e) => {
                            self.bad.push(server.report(e));
                            return;
                        }
                    },
                };
                chains.push(Chain {
                    sni_hosts,
                    application_protocols: Vec::new(),
                    tls,
                    filters,
                });
            }
            Some("PASSTHROUGH") => self.passthrough_chains(server, vss, chains),
            Some("AUTO_PASSTHROUGH") => self.auto_passthrough_chains(server, chains),
            Some(other) => self
                .bad
                .push(server.report(format!(".tls.mode: unknown mode '{other}'"))),
        }
    }

    /// The VirtualServices bound to the server's Gateway whose hosts overlap the server's
    /// (istiod's `pickMatchingGatewayHosts`).
    fn bound_vss<'v>(
        &self,
        server: &BoundServer,
        vss: &[(&'v Metadata, &'v VirtualServiceSpec)],
    ) -> Vec<(&'v Metadata, &'v VirtualServiceSpec)> {
        vss.iter()
            .filter(|(m, vs)| {
                let vs_ns = ns(m);
                server.named_by(&vs.gateways, vs_ns)
                    && vs.hosts.iter().any(|h| {
                        let h = fqdn(h, vs_ns, self.options);
                        server.hosts.iter().any(|(filter, sh)| {
                            (filter == "*" || filter == vs_ns) && intersect(&h, sh).is_some()
                        })
                    })
            })
            .copied()
            .collect()
    }

    /// The first `tcp` route of a bound VirtualService that matches the server (istiod
    /// serves exactly one), as network filters.
    fn tcp_route_filters(
        &mut self,
        server: &BoundServer,
        vss: &[(&Metadata, &VirtualServiceSpec)],
    ) -> Option<Vec<Json>> {
        for (m, vs) in self.bound_vss(server, vss) {
            let vs_ns = ns(m);
            for (i, tcp) in vs.tcp.iter().enumerate() {
                let matches = tcp.matches.is_empty()
                    || tcp
                        .matches
                        .iter()
                        .any(|lm| l4_match(lm.port, &lm.gateways, server, vs_ns));
                if !matches || tcp.route.is_empty() {
                    continue;
                }
                return match self.tcp_proxy(m, &tcp.route, server.number, &format!("spec.tcp[{i}]"))
                {
                    Ok(f) => Some(self.authz_tcp.iter().cloned().chain([f]).collect()),
                    Err(e) => {
                        self.bad.push(invalid("VirtualService", m, e));
                        None
                    }
                };
            }
        }
        None
    }

    /// One chain per matching `tls[].match[]` of the bound VirtualServices, by SNI.
    fn passthrough_chains(
        &mut self,
        server: &BoundServer,
        vss: &[(&Metadata, &VirtualServiceSpec)],
        chains: &mut Vec<Chain>,
    ) {
        // SNI names already taken on this listener, by earlier servers' chains.
        let mut taken: BTreeSet<String> = chains
            .iter()
            .flat_map(|c| c.sni_hosts.iter().cloned())
            .collect();
        for (m, vs) in self.bound_vss(server, vss) {
            let vs_ns = ns(m);
            for (i, tls) in vs.tls.iter().enumerate() {
                if tls.route.is_empty() {
                    continue;
                }
                for (j, tm) in tls.matches.iter().enumerate() {
                    if !l4_match(tm.port, &tm.gateways, server, vs_ns) {
                        continue;
                    }
                    let at = format!("spec.tls[{i}].match[{j}]");
                    if tm.sni_hosts.is_empty() {
                        self.bad.push(invalid(
                            "VirtualService",
                            m,
                            format!("{at}.sniHosts: at least one SNI host is required"),
                        ));
                        continue;
                    }
                    let dups: Vec<&String> =
                        tm.sni_hosts.iter().filter(|h| taken.contains(*h)).collect();
                    if !dups.is_empty() {
                        self.bad.push(invalid(
                            "VirtualService",
                            m,
                            format!(
                                "{at}.sniHosts: duplicate SNI host names {dups:?} on port {}; rule skipped, as istiod does",
                                server.number
                            ),
                        ));
                        continue;
                    }
                    let filter = match self.tcp_proxy(
                        m,
                        &tls.route,
                        server.number,
                        &format!("spec.tls[{i}]"),
                    ) {
                        Ok(f) => f,
                        Err(e) => {
                            self.bad.push(invalid("VirtualService", m, e));
                            continue;
                        }
                    };
                    taken.extend(tm.sni_hosts.iter().cloned());
                    chains.push(Chain {
                        sni_hosts: tm.sni_hosts.clone(),
                        application_protocols: Vec::new(),
                        tls: None,
                        filters: self.authz_tcp.iter().cloned().chain([filter]).collect(),
                    });
                }
            }
        }
    }

    /// AUTO_PASSTHROUGH: one chain per mesh service (and subset) the server's hosts cover,
    /// matched on the SNI a sidecar's mTLS cluster sends (`outbound_.<port>_.<subset>_.<host>`).
    fn auto_passthrough_chains(&mut self, server: &BoundServer, chains: &mut Vec<Chain>) {
        let services: Vec<Service> = self
            .reg
            .services
            .values()
            // ServiceEntries are mesh-external by default: istiod leaves them out.
            .filter(|s| {
                s.resolution == Resolution::Eds
                    && s.fqdn.ends_with(&format!(".svc.{}", self.options.domain))
            })
            .filter(|s| {
                server
                    .hosts
                    .iter()
                    .any(|(_, h)| h == "*" || intersect(&s.fqdn, h).as_deref() == Some(&s.fqdn))
            })
            .cloned()
            .collect();
        for svc in &services {
            let rule = self.rules.get(&svc.fqdn).map(|(_, d)| *d);
            for (port, _, _) in &svc.ports {
                let mut subsets = vec![""];
                if let Some(dr) = rule {
                    subsets.extend(dr.subsets.iter().map(|s| s.name.as_str()));
                }
                for subset in subsets {
                    let cluster = format!("outbound|{port}|{subset}|{}", svc.fqdn);
                    let sni = format!("outbound_.{port}_.{subset}_.{}", svc.fqdn);
                    let filter =
                        tcp_proxy_json(&cluster, json!({"cluster": cluster}), rule, subset);
                    chains.push(Chain {
                        sni_hosts: vec![sni],
                        application_protocols: ISTIO_MTLS_ALPNS
                            .iter()
                            .map(|s| s.to_string())
                            .collect(),
                        tls: None,
                        filters: self.authz_tcp.iter().cloned().chain([filter]).collect(),
                    });
                }
            }
        }
    }

    /// istiod's `buildOutboundNetworkFilters`: one destination is `cluster` with the cluster
    /// as stat prefix; several are `weighted_clusters` (zero weights left out) with
    /// `<VirtualService>.<namespace>` as stat prefix.
    fn tcp_proxy(
        &self,
        m: &Metadata,
        route: &[RouteDestination],
        server_port: u32,
        at: &str,
    ) -> Result<Json, String> {
        let vs_ns = ns(m);
        for (k, d) in route.iter().enumerate() {
            if d.destination.host.is_empty() {
                return Err(format!("{at}.route[{k}].destination.host is required"));
            }
        }
        let first = route
            .first()
            .ok_or_else(|| format!("{at}.route: at least one destination is required"))?;
        let host = fqdn(&first.destination.host, vs_ns, self.options);
        let rule = self.rules.get(&host).map(|(_, d)| *d);
        if let [one] = route {
            let cluster = self.destination_cluster(&one.destination, vs_ns, server_port);
            let subset = one.destination.subset.as_deref().unwrap_or("");
            return Ok(tcp_proxy_json(
                &cluster,
                json!({"cluster": cluster}),
                rule,
                subset,
            ));
        }
        let clusters: Vec<Json> = route
            .iter()
            .filter(|d| d.weight.unwrap_or(0) > 0)
            .map(|d| {
                json!({"name": self.destination_cluster(&d.destination, vs_ns, server_port),
                       "weight": d.weight.unwrap_or(0)})
            })
            .collect();
        if clusters.is_empty() {
            return Err(format!(
                "{at}.route: with several destinations, weights are required and must not all be 0"
            ));
        }
        let stat_prefix = format!("{}.{vs_ns}", m.name);
        Ok(tcp_proxy_json(
            &stat_prefix,
            json!({"weighted_clusters": {"clusters": clusters}}),
            rule,
            "",
        ))
    }

    /// istiod's `BuildListenerTLSContext` for a server that terminates TLS. `tcp`: the server
    /// proxies TCP after the handshake (ISTIO_MUTUAL then offers Istio's peer-exchange ALPN).
    /// The secrets the context names are recorded for SDS.
    fn downstream_tls(
        &self,
        server: &BoundServer,
        tcp: bool,
        secrets: &mut BTreeMap<String, SecretRef>,
    ) -> Result<Json, String> {
        let Some(t) = server.tls() else {
            return Err(".tls is required".into());
        };
        let mode = tls_mode(t);
        let alpn: &[&str] = if mode == "ISTIO_MUTUAL" && tcp {
            &["istio-peer-exchange", "h2", "http/1.1"]
        } else {
            &["h2", "http/1.1"]
        };
        let require = matches!(mode.as_str(), "MUTUAL" | "ISTIO_MUTUAL");
        let validate = require || mode == "OPTIONAL_MUTUAL";
        let mut common = Map::new();
        common.insert("alpn_protocols".into(), json!(alpn));
        let credential = t.credential_name.as_deref().filter(|c| !c.is_empty());
        match (mode.as_str(), credential) {
            ("ISTIO_MUTUAL", _) => {
                common.insert(
                    "tls_certificate_sds_secret_configs".into(),
                    json!([agent_sds("default")]),
                );
                if validate {
                    common.insert(
                        "combined_validation_context".into(),
                        json!({
                            "default_validation_context": {"match_subject_alt_names": exact_matchers(&t.subject_alt_names)},
                            "validation_context_sds_secret_config": agent_sds("ROOTCA")
                        }),
                    );
                }
            }
            (_, Some(c)) => {
                let cert = credential_resource(c);
                common.insert(
                    "tls_certificate_sds_secret_configs".into(),
                    json!([credential_sds(&cert)]),
                );
                self.want_secret(server, &cert, false, secrets);
                if validate {
                    let ca = format!("{cert}-cacert");
                    let mut dvc = Map::new();
                    dvc.insert(
                        "match_subject_alt_names".into(),
                        exact_matchers(&t.subject_alt_names),
                    );
                    if !t.verify_certificate_spki.is_empty() {
                        dvc.insert(
                            "verify_certificate_spki".into(),
                            json!(t.verify_certificate_spki),
                        );
                    }
                    if !t.verify_certificate_hash.is_empty() {
                        dvc.insert(
                            "verify_certificate_hash".into(),
                            json!(t.verify_certificate_hash),
                        );
                    }
                    common.insert(
                        "combined_validation_context".into(),
                        json!({"default_validation_context": dvc,
                               "validation_context_sds_secret_config": credential_sds(&ca)}),
                    );
                    self.want_secret(server, &ca, true, secrets);
                } else if !t.subject_alt_names.is_empty() {
                    common.insert(
                        "validation_context".into(),
                        json!({"match_subject_alt_names": exact_matchers(&t.subject_alt_names)}),
                    );
                }
            }
            (_, None) => {
                // check_server_tls refused it already; kept as a guard.
                return Err(".tls.credentialName is required".into());
            }
        }
        if matches!(mode.as_str(), "SIMPLE" | "MUTUAL" | "OPTIONAL_MUTUAL") {
            let mut params = Map::new();
            if let Some(v) = &t.min_protocol_version {
                if let Some(v) = tls_version(v, ".tls.minProtocolVersion")? {
                    params.insert("tls_minimum_protocol_version".into(), json!(v));
                }
            }
            if let Some(v) = &t.max_protocol_version {
                if let Some(v) = tls_version(v, ".tls.maxProtocolVersion")? {
                    params.insert("tls_maximum_protocol_version".into(), json!(v));
                }
            }
            let suites = filter_cipher_suites(&t.cipher_suites);
            if !suites.is_empty() {
                params.insert("cipher_suites".into(), json!(suites));
            }
            if !t.ecdh_curves.is_empty() {
                params.insert("ecdh_curves".into(), json!(t.ecdh_curves));
            }
            if !params.is_empty() {
                common.insert("tls_params".into(), Json::Object(params));
            }
        }
        Ok(json!({
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": common,
            "require_client_certificate": require
        }))
    }

    /// Records that `resource` (an SDS name) is served to this gateway. Secrets are looked up
    /// in the gateway's namespace, as istiod does; a reference to another namespace is refused
    /// at SDS time as istiod refuses it (the chain still names it, and waits).
    fn want_secret(
        &self,
        server: &BoundServer,
        resource: &str,
        ca: bool,
        secrets: &mut BTreeMap<String, SecretRef>,
    ) {
        let proxy_ns = self
            .proxy_namespace
            .clone()
            .unwrap_or_else(|| server.gateway_ns.clone());
        let rest = resource.trim_start_matches("kubernetes://");
        let (namespace, name) = match rest.split_once('/') {
            Some((n, name)) => (n.to_string(), name.to_string()),
            None => (proxy_ns.clone(), rest.to_string()),
        };
        let refused = (namespace != proxy_ns).then(|| {
            format!(
                "secret {namespace}/{name} is outside the gateway's namespace {proxy_ns}, which istiod does not serve"
            )
        });
        secrets.entry(resource.to_string()).or_insert(SecretRef {
            namespace,
            name,
            ca,
            reported_by: server.report(String::new()),
            refused,
        });
    }

    /// The SDS secrets the listeners name, from the Kubernetes Secrets read (istiod's
    /// `SecretGen`): `tls.crt`/`tls.key` or `cert`/`key` as a certificate, `ca.crt` or `cacert`
    /// (of `<name>-cacert`, else of `<name>` itself) as a CA. A missing one is left out, so
    /// the listener waits for it, and reported.
    fn secrets(&mut self, config: &Config, wanted: BTreeMap<String, SecretRef>, out: &mut XdsJson) {
        use base64::Engine;
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let find = |namespace: &str, name: &str| {
            config.objects.iter().find_map(|o| match o {
                Object::Secret(m, s) if ns(m) == namespace && m.name == name => Some(s),
                _ => None,
            })
        };
        for (resource, r) in wanted {
            let mut missing = |why: String| {
                let mut e = r.reported_by.clone();
                e.reason = format!(
                    "{}.tls.credentialName: {why}; the secret is left out of SDS, so the listener's chain waits for it (istiod does the same)",
                    e.reason
                );
                self.bad.push(e);
            };
            if let Some(why) = &r.refused {
                missing(why.clone());
                continue;
            }
            if r.ca {
                let stripped = r.name.strip_suffix("-cacert").unwrap_or(&r.name);
                let Some(s) = find(&r.namespace, &r.name).or_else(|| find(&r.namespace, stripped))
                else {
                    missing(format!(
                        "no Secret {}/{} (nor {}/{stripped}) for the CA",
                        r.namespace, r.name, r.namespace
                    ));
                    continue;
                };
                let Some((ca, crl)) = s
                    .get("cacert")
                    .map(|c| (c, s.get("crl")))
                    .or_else(|| s.get("ca.crt").map(|c| (c, s.get("ca.crl"))))
                else {
                    missing(format!(
                        "Secret {}/{} has no 'cacert' or 'ca.crt' key",
                        r.namespace, r.name
                    ));
                    continue;
                };
                let mut vc = Map::new();
                vc.insert("trusted_ca".into(), json!({"inline_bytes": b64(ca)}));
                if let Some(crl) = crl {
                    vc.insert("crl".into(), json!({"inline_bytes": b64(crl)}));
                }
                out.secrets.insert(
                    resource.clone(),
                    json!({"name": resource, "validation_context": vc}),
                );
                continue;
            }
            let Some(s) = find(&r.namespace, &r.name) else {
                missing(format!("no Secret {}/{}", r.namespace, r.name));
                continue;
            };
            let pair = match (s.get("cert"), s.get("key")) {
                (Some(c), Some(k)) => Some((c, k, None, s.get("crl"))),
                _ => match (s.get("tls.crt"), s.get("tls.key")) {
                    (Some(c), Some(k)) => Some((c, k, s.get("tls.ocsp-staple"), s.get("ca.crl"))),
                    _ => None,
                },
            };
            let Some((cert, key, staple, _crl)) = pair else {
                missing(format!(
                    "Secret {}/{} has neither 'tls.crt' and 'tls.key' nor 'cert' and 'key'",
                    r.namespace, r.name
                ));
                continue;
            };
            let mut tc = Map::new();
            tc.insert(
                "certificate_chain".into(),
                json!({"inline_bytes": b64(cert)}),
            );
            tc.insert("private_key".into(), json!({"inline_bytes": b64(key)}));
            if let Some(st) = staple {
                tc.insert("ocsp_staple".into(), json!({"inline_bytes": b64(st)}));
            }
            out.secrets.insert(
                resource.clone(),
                json!({"name": resource, "tls_certificate": tc}),
            );
        }
    }

    fn listener(&self, name: &str, port: u32, chains: &[Chain]) -> Json {
        let mut l = Map::new();
        l.insert("name".into(), json!(name));
        l.insert(
            "address".into(),
            json!({"socket_address": {"address": self.options.bind_address, "port_value": port}}),
        );
        l.insert(
            "filter_chains".into(),
            Json::Array(chains.iter().map(Chain::json).collect()),
        );
        if chains.iter().any(Chain::needs_tls_inspector) {
            l.insert(
                "listener_filters".into(),
                json!([{"name": "envoy.filters.listener.tls_inspector", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector",
                    "initial_read_buffer_size": 512
                }}]),
            );
        }
        l.insert("traffic_direction".into(), json!("OUTBOUND"));
        Json::Object(l)
    }
}

/// The connection manager istiod gives a gateway's HTTP and HTTPS chains.
fn hcm(stat_prefix: &str, route_name: &str, authz: &[Json]) -> Json {
    let mut hcm = json!({
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": stat_prefix,
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
    });
    // istiod's order: the authorization filters come before fault, CORS and the router.
    if let Some(Json::Array(filters)) = hcm.pointer_mut("/typed_config/http_filters") {
        for (i, f) in authz.iter().enumerate() {
            filters.insert(i, f.clone());
        }
    }
    hcm
}

/// What istiod's validation refuses in a server's TLS settings, and what this control plane
/// cannot serve (certificates mounted as files are istio-agent's to serve).
pub(super) fn check_server_tls(s: &Server, protocol: &str) -> Result<(), String> {
    let Some(t) = &s.tls else {
        return if matches!(protocol, "HTTPS" | "TLS") {
            Err(format!(".tls: a {protocol} server needs tls settings (istiod refuses it without); server skipped"))
        } else {
            Ok(())
        };
    };
    if is_http_protocol(protocol) {
        // An HTTP server's tls holds httpsRedirect; nothing there terminates TLS.
        return Ok(());
    }
    let mode = tls_mode(t);
    match mode.as_str() {
        "PASSTHROUGH" | "AUTO_PASSTHROUGH" | "ISTIO_MUTUAL" => Ok(()),
        "SIMPLE" | "MUTUAL" | "OPTIONAL_MUTUAL" => {
            if t.credential_name.as_deref().is_some_and(|c| !c.is_empty()) {
                Ok(())
            } else if t.server_certificate.is_some() || t.private_key.is_some() {
                Err(".tls.serverCertificate: certificates mounted as files are served by istio-agent, not by this control plane; use credentialName (a Kubernetes Secret); server skipped".into())
            } else {
                Err(format!(
                    ".tls.credentialName: {mode} needs a credentialName; server skipped"
                ))
            }
        }
        other => Err(format!(".tls.mode: unknown mode '{other}'; server skipped")),
    }
}

/// istiod's `l4SingleMatch` at a gateway: the port (0: any) and the gateways (none: any).
fn l4_match(port: Option<u32>, gateways: &[String], server: &BoundServer, vs_ns: &str) -> bool {
    port.is_none_or(|p| p == 0 || p == server.number)
        && (gateways.is_empty() || server.named_by(gateways, vs_ns))
}

/// istiod's `FilterCipherSuites`: BoringSSL's names (and expressions starting with an operator)
/// kept once each, in order; anything else would make Envoy NACK, so it is dropped.
fn filter_cipher_suites(suites: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in suites {
        let operator = s.chars().next().is_some_and(|c| !c.is_alphanumeric());
        let valid =
            s.is_empty() || s == "ALL" || operator || VALID_CIPHER_SUITES.contains(&s.as_str());
        if valid && !out.contains(s) {
            out.push(s.clone());
        }
    }
    out
}

/// A tcp_proxy network filter as istiod builds it: the DestinationRule's TCP idle timeout and
/// maximum connection duration, and source-IP hashing when the rule (or the subset) asks.
fn tcp_proxy_json(
    stat_prefix: &str,
    target: Json,
    rule: Option<&DestinationRuleSpec>,
    subset: &str,
) -> Json {
    let mut p = Map::new();
    p.insert(
        "@type".into(),
        json!("type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"),
    );
    p.insert("stat_prefix".into(), json!(stat_prefix));
    if let Json::Object(t) = target {
        p.extend(t);
    }
    let policy = rule.and_then(|r| r.traffic_policy.as_ref());
    let tcp = policy
        .and_then(|tp| tp.connection_pool.as_ref())
        .and_then(|cp| cp.tcp.as_ref());
    // A bad duration is reported with the DestinationRule's clusters.
    if let Some(d) = tcp
        .and_then(|t| t.idle_timeout.as_deref())
        .and_then(|d| duration(d).ok())
    {
        p.insert("idle_timeout".into(), json!(d));
    }
    if let Some(d) = tcp
        .and_then(|t| t.max_connection_duration.as_deref())
        .and_then(|d| duration(d).ok())
    {
        p.insert("max_downstream_connection_duration".into(), json!(d));
    }
    let mut source_ip = policy
        .and_then(|tp| tp.load_balancer.as_ref())
        .and_then(|lb| lb.consistent_hash.as_ref())
        .and_then(|ch| ch.use_source_ip)
        .unwrap_or(false);
    if let Some(s) = rule.and_then(|r| r.subsets.iter().find(|s| s.name == subset)) {
        if let Some(lb) = s
            .traffic_policy
            .as_ref()
            .and_then(|tp| tp.load_balancer.as_ref())
        {
            source_ip = lb
                .consistent_hash
                .as_ref()
                .and_then(|ch| ch.use_source_ip)
                .unwrap_or(false);
        }
    }
    if source_ip {
        p.insert("hash_policy".into(), json!([{"source_ip": {}}]));
    }
    json!({"name": "envoy.filters.network.tcp_proxy", "typed_config": p})
}

impl Ctx<'_> {
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
                let code = crate::units::GRPC_STATUS_NAMES
                    .iter()
                    .position(|c| c == g)
                    .ok_or_else(|| {
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

#[cfg(test)]
#[path = "translate_tls_tests.rs"]
mod translate_tls_tests;
