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
