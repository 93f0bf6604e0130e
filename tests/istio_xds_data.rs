//! What istiod really sends, from the config dumps in `../shared/xds-data/` (provenance in its
//! SOURCES.md): every route configuration and endpoint assignment must translate, and every
//! cluster or listener Portico cannot serve yet must be refused with a reason naming it.

use std::path::PathBuf;

use envoy_types::pb::google::protobuf::Any;
use portico::xds::store::Store;
use portico::xds::types::{self, Kind};
use serde_json::Value;

/// `shared/xds-data`: from `PORTICO_SHARED_DIR`, else the nearest `shared/` beside the repo
/// or one of its parents (CI lays a copy of shared/ beside the clone).
fn shared(rel: &str) -> PathBuf {
    let root = std::env::var_os("PORTICO_SHARED_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .ancestors()
                .map(|a| a.join("shared"))
                .find(|p| p.join("xds-data").is_dir())
        })
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared")));
    root.join("xds-data").join(rel)
}

fn load(rel: &str) -> Value {
    let path = shared(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{} is needed (the shared/ folder beside the repo): {e}",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every resource of `type_url` under `key` in the dump's sections, re-packed as Any. Resources
/// holding an extension Portico has no descriptor for (istio's own filters) cannot be turned
/// back into protobuf from JSON here; they are counted in the second value.
fn resources(dump: &Value, key: &str, type_url: &str) -> (Vec<Any>, usize) {
    let mut out = Vec::new();
    let mut undecodable = 0;
    let mut stack = vec![dump];
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(m) => {
                if let Some(r) = m.get(key) {
                    if r.get("@type").and_then(Value::as_str) == Some(type_url) {
                        let name = type_url.trim_start_matches("type.googleapis.com/");
                        let mut body = r.clone();
                        if let Some(o) = body.as_object_mut() {
                            o.remove("@type");
                        }
                        match portico::protojson::dynamic_from_json(name, &body) {
                            Ok(m) => out.push(Any {
                                type_url: type_url.to_string(),
                                value: prost::Message::encode_to_vec(&m),
                            }),
                            Err(e) if e.to_string().contains("unknown type") => undecodable += 1,
                            Err(e) => panic!("{name} from the dump does not decode: {e}"),
                        }
                        continue;
                    }
                }
                stack.extend(m.values());
            }
            Value::Array(a) => stack.extend(a.iter()),
            _ => {}
        }
    }
    (out, undecodable)
}

/// Adds the previous_hosts typed_config to every retry predicate named without one; returns
/// how many it patched.
fn add_predicate_types(v: &mut Value) -> usize {
    match v {
        Value::Object(m) => {
            let mut n = 0;
            if let Some(Value::Array(preds)) = m.get_mut("retry_host_predicate") {
                for p in preds.iter_mut().filter(|p| p.get("typed_config").is_none()) {
                    p["typed_config"] = serde_json::json!({
                        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                    });
                    n += 1;
                }
            }
            n + m.values_mut().map(add_predicate_types).sum::<usize>()
        }
        Value::Array(a) => a.iter_mut().map(add_predicate_types).sum(),
        _ => 0,
    }
}

#[test]
fn istiod_route_configurations_translate() {
    // One decoded descriptor pool for every conversion in this test.
    let _pool = portico::protojson::pool().expect("descriptor pool");
    let mut total = 0;
    for f in [
        "istio-gateway/istioctl_describe_http_config.json",
        "istio-gateway/istioctl_describe_tls_config.json",
        "istio-gateway/istioctl_routes_istio-gateway-http-route-prefix.json",
        "istio-gateway/istioctl_routes_k8s-gateway-http-route-path-prefix.json",
    ] {
        let dump = load(f);
        // The 2022 dumps name the previous_hosts retry predicate without its typed_config, as
        // istiod then did; Envoy 1.40 refuses that ("Didn't find a registered implementation
        // for 'envoy.retry_host_predicates.previous_hosts' with type URL: ''") and so does
        // Portico. istiod has sent the typed_config since (the 2023 dumps): add it, as it would.
        let (as_dumped, _) = resources(&dump, "route_config", types::ROUTE);
        let mut patched = dump.clone();
        let old_style = add_predicate_types(&mut patched);
        let (routes, undecodable) = resources(&patched, "route_config", types::ROUTE);
        assert!(!routes.is_empty(), "{f} holds route configurations");
        assert_eq!(undecodable, 0, "{f}");
        total += routes.len();
        // One at a time: the dumps hold several unnamed static route configs.
        for (r, raw) in routes.iter().zip(&as_dumped) {
            if let Err(e) = Store::default().apply(Kind::Route, "1", std::slice::from_ref(r)) {
                panic!("{f}: istiod's routes were rejected: {e:?}");
            }
            if old_style > 0 {
                let e = Store::default()
                    .apply(Kind::Route, "1", std::slice::from_ref(raw))
                    .expect_err("a name-only retry predicate is refused, as Envoy 1.40 does");
                assert!(e.iter().any(|e| e.contains("with type URL ''")), "{e:?}");
            }
        }
    }
    assert!(total >= 4);
}

#[test]
fn istiod_endpoint_assignments_translate() {
    // One decoded descriptor pool for every conversion in this test.
    let _pool = portico::protojson::pool().expect("descriptor pool");
    // Only what EDS delivers: the static section holds the bootstrap's pipe-addressed clusters.
    let mut dump = load("istio-eds/istioctl_endpoint_configdump.json");
    if let Some(configs) = dump.get_mut("configs").and_then(Value::as_array_mut) {
        for c in configs {
            if let Some(o) = c.as_object_mut() {
                o.remove("static_endpoint_configs");
            }
        }
    }
    let (eps, undecodable) = resources(&dump, "endpoint_config", types::ENDPOINT);
    assert_eq!(undecodable, 0);
    assert!(eps.len() > 10, "the EDS dump holds many assignments");
    if let Err(e) = Store::default().apply(Kind::Endpoint, "1", &eps) {
        panic!("istiod's endpoints were rejected: {e:?}");
    }
}

/// Envoy Gateway's translator goldens (lists of resources in lowerCamelCase YAML): routes and
/// endpoints must translate; clusters and listeners either translate or are refused by name for a
/// feature that has not landed yet.
#[test]
fn envoy_gateway_goldens_translate_or_are_refused_by_name() {
    // One decoded descriptor pool for every conversion in this test.
    let _pool = portico::protojson::pool().expect("descriptor pool");
    let dir = shared("envoy-gateway");
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    let mut checked = 0;
    let mut refused = Vec::new();
    for path in entries {
        let file = path
            .file_name()
            .and_then(|f| f.to_str())
            .unwrap_or_default()
            .to_string();
        let (kind, full) = match file.rsplit('.').nth(1) {
            Some("routes") => (Kind::Route, "envoy.config.route.v3.RouteConfiguration"),
            Some("endpoints") => (
                Kind::Endpoint,
                "envoy.config.endpoint.v3.ClusterLoadAssignment",
            ),
            Some("clusters") => (Kind::Cluster, "envoy.config.cluster.v3.Cluster"),
            Some("listeners") => (Kind::Listener, "envoy.config.listener.v3.Listener"),
            _ => continue,
        };
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
        let items: Vec<serde_json::Value> =
            serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        for item in items {
            let msg = portico::protojson::dynamic_from_json(full, &item)
                .unwrap_or_else(|e| panic!("{file}: does not decode: {e}"));
            let any = Any {
                type_url: format!("type.googleapis.com/{full}"),
                value: prost::Message::encode_to_vec(&msg),
            };
            checked += 1;
            if let Err(errors) = Store::default().apply(kind, "1", std::slice::from_ref(&any)) {
                for reason in errors {
                    // Routes and endpoints must pass, but for retry priorities (not yet).
                    let allowed = (reason.contains("not supported")
                        && (matches!(kind, Kind::Cluster | Kind::Listener)
                            || reason.contains("retry_priority")))
                        // Envoy Gateway's CORS golden holds an origin regex RE2 cannot parse;
                        // Envoy 1.40 refuses it too ("no argument for repetition operator: *").
                        || (file == "cors.routes.yaml"
                            && reason.contains("invalid regex '*.example.com'"));
                    assert!(
                        allowed,
                        "{file}: refused for a reason other than a missing feature: {reason}"
                    );
                    refused.push(format!("{file}: {reason}"));
                }
            }
        }
    }
    assert!(checked > 40, "only {checked} resources checked");
    eprintln!(
        "{} of {checked} Envoy Gateway resources refused until their feature lands:",
        refused.len()
    );
    for r in &refused {
        eprintln!("  {r}");
    }
}

// ---------------------------------------------------------------------------------------------
// istiod's gateway routes on a running gateway, over state of the world and delta: requests go
// to the cluster istiod meant.

mod common;

use common::{AdsServer, Backend, Gateway, Snapshot};
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;

/// The dynamic route configuration of a gateway dump, decoded.
fn gateway_routes(rel: &str) -> RouteConfiguration {
    let _pool = portico::protojson::pool().expect("descriptor pool");
    let mut dump = load(rel);
    // The 2022 dumps' retry predicates as istiod writes them since (with their typed_config).
    add_predicate_types(&mut dump);
    // Only what RDS delivered: the static ones are istio-agent's own (stats, readiness).
    if let Some(configs) = dump.get_mut("configs").and_then(Value::as_array_mut) {
        for c in configs {
            if let Some(o) = c.as_object_mut() {
                o.remove("static_route_configs");
            }
        }
    }
    let (routes, undecodable) = resources(&dump, "route_config", types::ROUTE);
    assert_eq!(undecodable, 0, "{rel}");
    let [rc] = routes.as_slice() else {
        panic!(
            "{rel}: one dynamic route configuration expected, got {}",
            routes.len()
        );
    };
    prost::Message::decode(rc.value.as_slice()).expect("route configuration decodes")
}

/// Serves `rc` on a gateway speaking `api_type`, each cluster it names backed by a backend of
/// that name, and checks where each (host, path) goes: `Some(cluster)` or `None` for a 404.
async fn route_as_istiod_meant(rel: &str, api_type: &str, cases: &[(&str, &str, Option<&str>)]) {
    let rc = gateway_routes(rel);
    let port = common::free_port();
    let mut clusters: Vec<String> = Vec::new();
    for vh in &rc.virtual_hosts {
        for r in &vh.routes {
            use envoy_types::pb::envoy::config::route::v3::{route, route_action};
            if let Some(route::Action::Route(a)) = &r.action {
                if let Some(route_action::ClusterSpecifier::Cluster(c)) = &a.cluster_specifier {
                    if !clusters.contains(c) {
                        clusters.push(c.clone());
                    }
                }
            }
        }
    }
    let mut backends = Vec::new();
    for c in &clusters {
        backends.push(Backend::start(c).await);
    }
    let pairs: Vec<(&str, &Backend)> = clusters.iter().map(|c| c.as_str()).zip(&backends).collect();
    // The listener asks for the route configuration by istiod's name.
    let mut hcm = common::hcm(port);
    if let Some(
        envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::RouteSpecifier::Rds(rds),
    ) = &mut hcm.route_specifier
    {
        rds.route_config_name = rc.name.clone();
    }
    let snapshot = Snapshot {
        listeners: vec![common::listener_with(port, hcm)],
        routes: vec![rc],
        ..Default::default()
    }
    .with_backends(&pairs);
    let ads = AdsServer::start_any("1", &snapshot).await;
    let ads_port = ads.port;
    let _gw =
        Gateway::start_bootstrap(|admin| common::bootstrap_yaml_api(admin, ads_port, api_type))
            .await;
    for (host, path, want) in cases {
        let url = format!("http://127.0.0.1:{port}{path}");
        common::eventually(
            &format!("{rel}: {host}{path} over {api_type}"),
            common::PROPAGATION,
            || async {
                let r = common::get(&url, Some(host), &[]).await;
                match (want, r.status, r.backend()) {
                    (Some(c), 200, Some(b)) if b == *c => Ok(()),
                    (None, 404, _) => Ok(()),
                    _ => Err(format!(
                        "want {want:?}, got {} from {:?}",
                        r.status,
                        r.backend()
                    )),
                }
            },
        )
        .await;
    }
}

const PRODUCTPAGE: &str = "outbound|9080||productpage.default.svc.cluster.local";
const HTTPBIN: &str = "outbound|8000||httpbin.default.svc.cluster.local";

async fn istiod_routes_on_a_gateway(api_type: &str) {
    route_as_istiod_meant(
        "istio-gateway/istioctl_describe_http_config.json",
        api_type,
        &[
            ("bookinfo.example.com", "/productpage", Some(PRODUCTPAGE)),
            ("any.example.com", "/static/style.css", Some(PRODUCTPAGE)),
            ("any.example.com", "/login", Some(PRODUCTPAGE)),
            ("any.example.com", "/api/v1/products/1", Some(PRODUCTPAGE)),
            ("any.example.com", "/productpage/x", None),
            ("any.example.com", "/PRODUCTPAGE", None),
        ],
    )
    .await;
    route_as_istiod_meant(
        "istio-gateway/istioctl_routes_istio-gateway-http-route-prefix.json",
        api_type,
        &[
            ("httpbin.example.com", "/get", Some(HTTPBIN)),
            ("httpbin.example.com", "/getx", Some(HTTPBIN)),
            ("httpbin.example.com", "/status/200", None),
            ("other.example.com", "/get", None),
        ],
    )
    .await;
    // Gateway API's PathPrefix is path_separated_prefix: /getx does not match /get.
    route_as_istiod_meant(
        "istio-gateway/istioctl_routes_k8s-gateway-http-route-path-prefix.json",
        api_type,
        &[
            ("httpbin.example.com", "/get", Some(HTTPBIN)),
            ("httpbin.example.com", "/get/anything", Some(HTTPBIN)),
            ("httpbin.example.com", "/getx", None),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istiod_gateway_routes_reach_the_right_cluster_over_sotw() {
    istiod_routes_on_a_gateway("GRPC").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istiod_gateway_routes_reach_the_right_cluster_over_delta() {
    istiod_routes_on_a_gateway("DELTA_GRPC").await;
}

// ---------------------------------------------------------------------------------------------
// Every resource of every dump, pushed as istiod pushes it (state of the world and delta):
// accepted, or refused alone for a reason this table documents.

use portico::xds::store::{Incoming, Push};

/// Why Portico may refuse a resource that istiod or Envoy Gateway really sends: a substring of
/// the refusal and the reason it is documented (README, "What istiod sends").
const DOCUMENTED: &[(&str, &str)] = &[
    // Envoy 1.40 refuses it too: "no argument for repetition operator: *".
    (
        "invalid regex '*.example.com'",
        "Envoy Gateway's CORS golden holds a regex RE2 refuses",
    ),
    // Envoy 1.40 refuses a name-only predicate: the 2022 dumps predate istiod's typed_config.
    (
        "with type URL ''",
        "istiod before 2023 named retry predicates without a typed_config",
    ),
    // Sidecar-only shapes: istiod never sends them to a gateway (router mode).
    (
        "matching application_protocols on plaintext connections",
        "a sidecar's protocol sniffing (http_inspector chains)",
    ),
    ("use_original_dst", "a sidecar's virtualOutbound"),
    (
        "filter_disabled is not supported",
        "a sidecar's virtualInbound",
    ),
    // Ambient (HBONE) in Istio 1.18's shape: its internal listeners restored the destination
    // with Istio's own `set_dst_address` listener filter, which Portico does not run (istiod
    // now renders envoy.filters.listener.original_dst, which it does; see istio_hbone.rs).
    (
        "listener filter 'set_dst_address'",
        "Istio 1.18's connect_originate / main_internal (istio.set_internal_dst_address)",
    ),
    (
        "io.istio.network.authn.Config",
        "ambient's connect_terminate (istio_authn)",
    ),
    // Config dumps replace private keys with "[redacted]": not a key istiod sent.
    (
        "private_key: no private key found",
        "the dump redacts private keys",
    ),
];

fn documented(reason: &str) -> bool {
    DOCUMENTED.iter().any(|(s, _)| reason.contains(s))
}

/// The dynamic resources of a dump by kind (static ones belong to the bootstrap), with the
/// version each was delivered at, and the bootstrap's static clusters.
struct Dump {
    name: String,
    by_kind: Vec<(Kind, Vec<(Any, String)>)>,
    static_clusters: Vec<envoy_types::pb::envoy::config::cluster::v3::Cluster>,
}

const KINDS: [(Kind, &str, &str); 5] = [
    (Kind::Cluster, "cluster", "envoy.config.cluster.v3.Cluster"),
    (
        Kind::Endpoint,
        "endpoint_config",
        "envoy.config.endpoint.v3.ClusterLoadAssignment",
    ),
    (
        Kind::Listener,
        "listener",
        "envoy.config.listener.v3.Listener",
    ),
    (
        Kind::Route,
        "route_config",
        "envoy.config.route.v3.RouteConfiguration",
    ),
    (
        Kind::Secret,
        "secret",
        "envoy.extensions.transport_sockets.tls.v3.Secret",
    ),
];

/// Every `key` entry of type `full` below `v`, with the nearest `version_info` above it.
fn collect(v: &Value, key: &str, full: &str, version: &str, out: &mut Vec<(Any, String)>) {
    match v {
        Value::Object(m) => {
            let version = m
                .get("version_info")
                .and_then(Value::as_str)
                .unwrap_or(version);
            if let Some(r) = m.get(key) {
                let type_url = format!("type.googleapis.com/{full}");
                if r.get("@type").and_then(Value::as_str) == Some(type_url.as_str()) {
                    let mut body = r.clone();
                    if let Some(o) = body.as_object_mut() {
                        o.remove("@type");
                    }
                    let msg = portico::protojson::dynamic_from_json(full, &body)
                        .unwrap_or_else(|e| panic!("{full} from the dump does not decode: {e}"));
                    out.push((
                        Any {
                            type_url,
                            value: prost::Message::encode_to_vec(&msg),
                        },
                        version.to_string(),
                    ));
                    return;
                }
            }
            for (k, x) in m {
                // Warming secrets are placeholders for what has not arrived, not resources.
                if !k.starts_with("static_") && k != "bootstrap" && k != "dynamic_warming_secrets" {
                    collect(x, key, full, version, out);
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| collect(x, key, full, version, out)),
        _ => {}
    }
}

fn istiod_dumps() -> Vec<Dump> {
    let mut dumps: Vec<Dump> = Vec::new();
    for rel in [
        "istio-sidecar/deathstarbench_istio1.18.2_sidecar_config_dump.json",
        "istio-sidecar/istioctl_authz_configdump.yaml",
        "istio-eds/istioctl_endpoint_configdump.json",
        "istio-gateway/istioctl_describe_http_config.json",
        "istio-gateway/istioctl_describe_tls_config.json",
        "istio-gateway/istioctl_routes_istio-gateway-http-route-prefix.json",
        "istio-gateway/istioctl_routes_k8s-gateway-http-route-path-prefix.json",
        "istio-sds-ecds/istioctl_secret_config_dump.json",
    ] {
        let path = shared(rel);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: {e}"));
        let mut dump: Value = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{rel}: {e}"));
        add_predicate_types(&mut dump);
        let by_kind = KINDS
            .iter()
            .map(|(kind, key, full)| {
                let mut out = Vec::new();
                collect(&dump, key, full, "", &mut out);
                (*kind, out)
            })
            .collect();
        // The bootstrap's own clusters (xds-grpc, sds-grpc, ...), as istio-agent writes them.
        let mut static_clusters = Vec::new();
        let mut stack = vec![&dump];
        while let Some(v) = stack.pop() {
            match v {
                Value::Object(m) => {
                    if let Some(Value::Array(sc)) = m.get("static_clusters") {
                        for c in sc.iter().filter_map(|c| c.get("cluster")) {
                            let mut body = c.clone();
                            if let Some(o) = body.as_object_mut() {
                                o.remove("@type");
                            }
                            let msg = portico::protojson::dynamic_from_json(
                                "envoy.config.cluster.v3.Cluster",
                                &body,
                            )
                            .unwrap_or_else(|e| panic!("{rel}: static cluster: {e}"));
                            static_clusters.push(
                                prost::Message::decode(
                                    prost::Message::encode_to_vec(&msg).as_slice(),
                                )
                                .expect("static cluster"),
                            );
                        }
                    }
                    stack.extend(m.values());
                }
                Value::Array(a) => stack.extend(a.iter()),
                _ => {}
            }
        }
        // A dump without its bootstrap gets istio-agent's (the first dump's): every Istio
        // proxy has its sds-grpc and xds-grpc clusters.
        let static_clusters = match (static_clusters.is_empty(), dumps.first()) {
            (true, Some(first)) => first.static_clusters.clone(),
            _ => static_clusters,
        };
        dumps.push(Dump {
            name: rel.to_string(),
            by_kind,
            static_clusters,
        });
    }
    dumps
}

/// Pushes a dump kind by kind (clusters, endpoints, listeners, routes, secrets) as one
/// response each, and returns every refusal as (kind, name, reason).
fn push_dump(d: &Dump, delta: bool) -> Vec<(Kind, String, String)> {
    let mut store = Store::default();
    store
        .add_static(&[], &d.static_clusters)
        .unwrap_or_else(|e| panic!("{}: the bootstrap's static clusters: {e:?}", d.name));
    let mut refused = Vec::new();
    for (kind, resources) in &d.by_kind {
        if resources.is_empty() {
            continue;
        }
        let anys: Vec<Any> = resources.iter().map(|(a, _)| a.clone()).collect();
        let push = if delta {
            Push::Delta {
                system_version: "dump",
                resources: resources
                    .iter()
                    .map(|(any, version)| Incoming { any, version })
                    .collect(),
                removed: &[],
            }
        } else {
            Push::Sotw {
                version: "dump",
                resources: &anys,
            }
        };
        let applied = store.update(*kind, push).unwrap_or_else(|e| {
            panic!("{}: the whole {kind:?} response was refused: {e:?}", d.name)
        });
        refused.extend(
            applied
                .rejected
                .iter()
                .map(|r| (*kind, r.name.clone(), r.message.clone())),
        );
        store = applied.store;
    }
    refused
}

#[test]
fn every_istiod_resource_is_accepted_or_refused_for_a_documented_reason() {
    let _pool = portico::protojson::pool().expect("descriptor pool");
    let mut total = 0;
    let mut undocumented = Vec::new();
    for d in istiod_dumps() {
        let n: usize = d.by_kind.iter().map(|(_, r)| r.len()).sum();
        total += n;
        let sotw = push_dump(&d, false);
        let delta = push_dump(&d, true);
        assert_eq!(
            sotw, delta,
            "{}: state of the world and delta refuse the same resources",
            d.name
        );
        eprintln!("{}: {n} resources, {} refused", d.name, sotw.len());
        for (kind, name, reason) in sotw {
            eprintln!("  {kind:?} {name}: {reason}");
            if !documented(&reason) {
                undocumented.push(format!("{}: {kind:?} '{name}': {reason}", d.name));
            }
        }
    }
    assert!(total > 400, "only {total} resources in the dumps");
    assert!(
        undocumented.is_empty(),
        "refused for undocumented reasons:\n{}",
        undocumented.join("\n")
    );
}
