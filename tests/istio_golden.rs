//! Golden tests of the control plane's translation: Istio YAML in (`tests/golden/<case>/*.yaml`),
//! xDS out (`tests/golden/<case>.json`, every resource as proto-JSON plus the objects
//! reported invalid). `UPDATE_GOLDEN=1 cargo test --test istio_golden` rewrites the files;
//! review the diff before committing it.
//!
//! Two cases are also compared with what the real istiod sent for the same input, from the
//! config dumps in `../shared/xds-data/istio-gateway/` (provenance in its SOURCES.md).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use portico::istio::translate::{encode, translate_json, XdsJson};
use portico::istio::{load_dir, NodeInfo, Options};
use portico::xds::types;
use serde_json::{json, Value};

const MANIFEST: &str = env!("CARGO_MANIFEST_DIR");

fn gateway_node() -> NodeInfo {
    NodeInfo {
        id: "router~10.244.0.9~istio-ingressgateway-5d8f9c7b6-abcde.istio-system~istio-system.svc.cluster.local".into(),
        labels: [
            ("app".to_string(), "istio-ingressgateway".to_string()),
            ("istio".to_string(), "ingressgateway".to_string()),
        ]
        .into(),
        namespace: Some("istio-system".into()),
    }
}

fn run(dir: &Path) -> (XdsJson, Vec<String>) {
    // Decoding the descriptor pool is slow; keep one alive for every conversion.
    let _pool = portico::protojson::pool().expect("descriptor pool");
    let (config, mut invalid) = load_dir(dir).expect("case directory");
    let (out, more) = translate_json(&config, &gateway_node(), &Options::default());
    invalid.extend(more);
    let shown = invalid
        .iter()
        .map(|i| i.to_string().replace(&format!("{MANIFEST}/"), ""))
        .collect();
    (out, shown)
}

/// A resource normalised through its protobuf type: what a proxy receives, printed the way
/// Envoy's config_dump prints it (defaults dropped, proto field names).
fn normalised(type_url: &str, v: &Value) -> Value {
    let mut body = v.clone();
    if let Some(o) = body.as_object_mut() {
        o.remove("@type");
    }
    let any = encode(type_url, &body).unwrap_or_else(|e| panic!("{type_url}: {e}"));
    let mut out = portico::protojson::any_to_json(&any).expect("decode");
    if let Some(o) = out.as_object_mut() {
        o.remove("@type");
    }
    out
}

fn as_json(out: &XdsJson, invalid: &[String]) -> Value {
    let section = |m: &BTreeMap<String, Value>, t: &str| {
        Value::Object(
            m.iter()
                .map(|(k, v)| (k.clone(), normalised(t, v)))
                .collect(),
        )
    };
    let mut secrets = section(&out.secrets, types::SECRET);
    // Private keys are redacted as Envoy's config_dump redacts them ("[redacted]").
    for s in secrets
        .as_object_mut()
        .into_iter()
        .flat_map(|o| o.values_mut())
    {
        if let Some(k) = s.pointer_mut("/tls_certificate/private_key") {
            *k = json!({"inline_bytes": "W3JlZGFjdGVkXQ=="});
        }
    }
    let mut v = json!({
        "invalid": invalid,
        "listeners": section(&out.listeners, types::LISTENER),
        "routes": section(&out.routes, types::ROUTE),
        "clusters": section(&out.clusters, types::CLUSTER),
        "endpoints": section(&out.endpoints, types::ENDPOINT),
    });
    // Only cases with secrets carry the section, so the older golden files stay as they are.
    if !out.secrets.is_empty() {
        v["secrets"] = secrets;
    }
    v
}

fn golden(case: &str) -> Value {
    let _pool = portico::protojson::pool().expect("descriptor pool");
    let dir = PathBuf::from(MANIFEST).join("tests/golden").join(case);
    let (out, invalid) = run(&dir);
    let got = as_json(&out, &invalid);
    // Beside the case directory, not in it: the control plane reads every .json file there.
    let file = PathBuf::from(MANIFEST).join(format!("tests/golden/{case}.json"));
    let text = serde_json::to_string_pretty(&got).expect("json") + "\n";
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&file, &text).expect("write golden");
    }
    let want = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_GOLDEN=1 writes it)", file.display()));
    if want != text {
        let want: Value = serde_json::from_str(&want).expect("golden json");
        for (path, a, b) in diff(&want, &got, String::new()).into_iter().take(20) {
            eprintln!("{path}: expected {a}, got {b}");
        }
        panic!(
            "{case}: translation differs from {} (UPDATE_GOLDEN=1 to accept)",
            file.display()
        );
    }
    got
}

/// Field-by-field differences, as (json path, expected, got).
fn diff(a: &Value, b: &Value, at: String) -> Vec<(String, String, String)> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter()
                .flat_map(|k| {
                    let null = Value::Null;
                    diff(
                        x.get(k).unwrap_or(&null),
                        y.get(k).unwrap_or(&null),
                        format!("{at}/{k}"),
                    )
                })
                .collect()
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .flat_map(|(i, (p, q))| diff(p, q, format!("{at}/{i}")))
            .collect(),
        _ if a == b => Vec::new(),
        _ => vec![(at, a.to_string(), b.to_string())],
    }
}

fn shared(rel: &str) -> Value {
    let root = std::env::var_os("PORTICO_SHARED_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            Path::new(MANIFEST)
                .ancestors()
                .map(|a| a.join("shared"))
                .find(|p| p.join("xds-data").is_dir())
        })
        .unwrap_or_else(|| PathBuf::from(MANIFEST).join("../shared"));
    let path = root.join("xds-data").join(rel);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{} is needed: {e}", path.display()));
    serde_json::from_str(&text).expect("dump json")
}

/// The dynamic resource named `name` under `key` in an istiod config dump.
fn from_dump(dump: &Value, key: &str, name: &str) -> Value {
    let mut stack = vec![dump];
    while let Some(v) = stack.pop() {
        match v {
            Value::Object(m) => {
                if let Some(r) = m.get(key) {
                    if r.get("name").and_then(Value::as_str) == Some(name) {
                        return r.clone();
                    }
                }
                stack.extend(m.values());
            }
            Value::Array(a) => stack.extend(a.iter()),
            _ => {}
        }
    }
    panic!("{name} is not in the dump");
}

#[test]
fn bookinfo_example_golden() {
    // The demo's own config, gateway-examples/bookinfo/, checked in as a golden too.
    let dir = PathBuf::from(MANIFEST).join("gateway-examples/bookinfo");
    let (out, invalid) = run(&dir);
    assert!(invalid.is_empty(), "{invalid:?}");
    let got = as_json(&out, &invalid);
    let file = PathBuf::from(MANIFEST).join("tests/golden/bookinfo-example.json");
    let text = serde_json::to_string_pretty(&got).expect("json") + "\n";
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&file, &text).expect("write golden");
    }
    let want = std::fs::read_to_string(&file).expect("golden (UPDATE_GOLDEN=1 writes it)");
    assert!(
        want == text,
        "gateway-examples/bookinfo translation differs from {}",
        file.display()
    );
}

#[test]
fn bookinfo_routes_match_istiod_field_by_field() {
    let got = golden("istiod-bookinfo");
    let dump = shared("istio-gateway/istioctl_describe_http_config.json");
    let mut want = normalised(types::ROUTE, &from_dump(&dump, "route_config", "http.8080"));
    with_newer_istiod_route_fields(&mut want);
    let ours = &got["routes"]["http.8080"];
    let d = diff(&want, ours, String::new());
    assert!(d.is_empty(), "differences from istiod: {d:#?}");
}

/// Istio's 2022 route dumps predate three fields istiod sets now (the 2023 dump in
/// httpbin_routes_match_istiod_exactly has them): the retry predicate's typed_config, the
/// direct-response size limit, and port-blind host matching.
fn with_newer_istiod_route_fields(want: &mut Value) {
    for v in want["virtual_hosts"].as_array_mut().into_iter().flatten() {
        for r in v["routes"].as_array_mut().into_iter().flatten() {
            r["route"]["retry_policy"]["retry_host_predicate"][0]["typed_config"] = json!({
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
            });
        }
    }
    want["max_direct_response_body_size_bytes"] = json!(1048576);
    want["ignore_port_in_host_matching"] = json!(true);
}

#[test]
fn bookinfo_https_routes_match_istiod_field_by_field() {
    let got = golden("istiod-bookinfo-tls");
    let dump = shared("istio-gateway/istioctl_describe_tls_config.json");
    let name = "https.443.https.bookinfo-gateway.default";
    let mut want = normalised(types::ROUTE, &from_dump(&dump, "route_config", name));
    with_newer_istiod_route_fields(&mut want);
    let d = diff(&want, &got["routes"][name], String::new());
    assert!(d.is_empty(), "differences from istiod: {d:#?}");
    assert!(
        got["invalid"].as_array().is_some_and(Vec::is_empty),
        "{}",
        got["invalid"]
    );
    // The listener istiod builds for it (the dump has none; pilot's gateway.go and
    // listener.go are the reference): one SNI-less chain terminating TLS with the Secret
    // over ADS, the connection manager on the HTTPS route, and the TLS inspector.
    let l = &got["listeners"]["0.0.0.0_8443"];
    assert_eq!(
        l["listener_filters"][0]["name"],
        "envoy.filters.listener.tls_inspector"
    );
    let chain = &l["filter_chains"][0];
    assert!(chain.get("filter_chain_match").is_none(), "{chain}");
    let tls = &chain["transport_socket"]["typed_config"];
    assert_eq!(
        tls["common_tls_context"],
        json!({
            "tls_certificate_sds_secret_configs": [{
                "name": "kubernetes://bookinfo-credential",
                "sds_config": {"ads": {}, "resource_api_version": "V3"}
            }],
            "alpn_protocols": ["h2", "http/1.1"]
        })
    );
    assert_eq!(tls["require_client_certificate"], false);
    let hcm = &chain["filters"][0]["typed_config"];
    assert_eq!(hcm["rds"]["route_config_name"], name);
    assert_eq!(hcm["stat_prefix"], "outbound_0.0.0.0_8443");
    // The Secret as istiod's SecretGen sends it (keys redacted in the golden file).
    let s = &got["secrets"]["kubernetes://bookinfo-credential"];
    assert_eq!(s["name"], "kubernetes://bookinfo-credential");
    assert!(s["tls_certificate"]["certificate_chain"]["inline_bytes"].is_string());
}

#[test]
fn bookinfo_subset_cluster_matches_istiod_field_by_field() {
    let got = golden("istiod-bookinfo");
    let dump = shared("istio-gateway/istioctl_describe_http_config.json");
    let name = "outbound|9080|v1|productpage.default.svc.cluster.local";
    let mut want = from_dump(&dump, "cluster", name);
    if let Some(o) = want.as_object_mut() {
        // Istio's own Envoy extension (upstream Envoy and Portico have no such filter), and the
        // auto-mTLS match istiod adds for sidecar'd pods (tested in the features golden).
        o.remove("filters");
        o.remove("transport_socket_matches");
    }
    let want = normalised(types::CLUSTER, &want);
    let d = diff(&want, &got["clusters"][name], String::new());
    assert!(d.is_empty(), "differences from istiod: {d:#?}");
}

#[test]
fn httpbin_routes_match_istiod_exactly() {
    let got = golden("istiod-httpbin");
    let dump = shared("istio-gateway/istioctl_routes_istio-gateway-http-route-prefix.json");
    let want = normalised(types::ROUTE, &from_dump(&dump, "route_config", "http.8080"));
    let d = diff(&want, &got["routes"]["http.8080"], String::new());
    assert!(d.is_empty(), "differences from istiod: {d:#?}");
    assert_eq!(
        got["listeners"]
            .as_object()
            .map(|o| o.keys().cloned().collect::<Vec<_>>()),
        Some(vec!["0.0.0.0_8080".to_string()])
    );
}

#[test]
fn endpoint_assignments_match_istiod_field_by_field() {
    let got = golden("istiod-eds");
    let dump = shared("istio-eds/istioctl_endpoint_configdump.json");
    for svc in ["reviews", "ratings", "productpage"] {
        let name = format!("outbound|9080||{svc}.default.svc.cluster.local");
        let mut stack = vec![&dump];
        let mut want = None;
        while let Some(v) = stack.pop() {
            match v {
                Value::Object(m) => {
                    if let Some(c) = m.get("endpoint_config") {
                        if c["cluster_name"] == name.as_str() {
                            want = Some(c.clone());
                        }
                    }
                    stack.extend(m.values());
                }
                Value::Array(a) => stack.extend(a.iter()),
                _ => {}
            }
        }
        let mut want = want.unwrap_or_else(|| panic!("{name} is not in the dump"));
        // Envoy rebuilds its EDS dump from live hosts, adding its defaults (the 140%
        // overprovisioning factor, an empty health_check_config) that istiod never sends.
        if let Some(o) = want.as_object_mut() {
            o.remove("policy");
            o.remove("@type");
        }
        for l in want["endpoints"].as_array_mut().into_iter().flatten() {
            for e in l["lb_endpoints"].as_array_mut().into_iter().flatten() {
                if let Some(ep) = e["endpoint"].as_object_mut() {
                    ep.remove("health_check_config");
                }
            }
        }
        let want = normalised(types::ENDPOINT, &want);
        let d = diff(&want, &got["endpoints"][&name], String::new());
        assert!(d.is_empty(), "{name}: differences from istiod: {d:#?}");
    }
}

#[test]
fn every_feature_golden() {
    let got = golden("features");
    // Spot checks that say what the golden file holds, so a careless UPDATE_GOLDEN shows.
    let vhosts = got["routes"]["http.8080"]["virtual_hosts"]
        .as_array()
        .expect("vhosts");
    let names: Vec<&str> = vhosts.iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(
        names,
        ["*.api.example.com:8080", "*:8080", "shop.example.com:8080"]
    );
    // The host "*" VirtualService of namespace apps (allowed by the server's "apps/*") comes
    // first on every host of the server, then shop's own routes.
    let shop = &vhosts[2]["routes"];
    assert_eq!(shop[2]["name"], "canary.by-header");
    assert_eq!(shop[2]["route"]["timeout"], "2.500s");
    assert_eq!(
        shop[3]["route"]["weighted_clusters"]["clusters"]
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    // The catch-all route ends shop's list: /never after it is dropped, as istiod does.
    assert_eq!(shop.as_array().map(Vec::len), Some(9));
    assert_eq!(
        got["routes"]["http.8081"]["virtual_hosts"][0]["require_tls"],
        "ALL"
    );
    assert!(got["clusters"]["outbound|443||payments.external.example"]["type"] == "STRICT_DNS");
    assert!(got["endpoints"]
        .as_object()
        .is_some_and(|e| !e.contains_key("outbound|9080|v2|cart.shop.svc.cluster.local")));
    assert_eq!(got["invalid"], json!([]));
    // HTTPS with its Secret, SNI passthrough (namespace-scoped host) and TCP, each on its port.
    let https = &got["listeners"]["0.0.0.0_8443"]["filter_chains"][0];
    assert_eq!(
        https["filter_chain_match"]["server_names"],
        json!(["shop.example.com"])
    );
    assert_eq!(
        https["transport_socket"]["typed_config"]["common_tls_context"]["tls_params"],
        json!({"tls_minimum_protocol_version": "TLSv1_2"})
    );
    assert!(got["routes"]
        .as_object()
        .is_some_and(|r| r.contains_key("https.8443.https.edge.istio-system")));
    assert!(got["secrets"]["kubernetes://shop-cert"]["tls_certificate"].is_object());
    let pass = got["listeners"]["0.0.0.0_8444"]["filter_chains"]
        .as_array()
        .expect("passthrough chains");
    assert_eq!(
        pass[1]["filter_chain_match"]["server_names"],
        json!(["basket.pass.example.com", "cart.pass.example.com"])
    );
    assert_eq!(
        pass[1]["filters"][0]["typed_config"]["stat_prefix"],
        "passthrough.shop"
    );
    assert_eq!(
        got["listeners"]["0.0.0.0_9000"]["filter_chains"][0]["filters"][0]["typed_config"]
            ["cluster"],
        "outbound|9090||catalog.shop.svc.cluster.local"
    );
}

#[test]
fn invalid_objects_are_reported_by_file_kind_name_and_field_and_the_rest_is_served() {
    let got = golden("invalid");
    let invalid: Vec<&str> = got["invalid"]
        .as_array()
        .expect("invalid")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for want in [
        "tests/golden/invalid/invalid.yaml: Frobnicator 'default/what': unsupported kind Frobnicator",
        "tests/golden/invalid/invalid.yaml: VirtualService 'default/bad-fields': spec.http[0].route: invalid type",
        "tests/golden/invalid/invalid.yaml: VirtualService 'default/bad-regex': spec.http[0].match[0].uri.regex: invalid regex '/a('",
        "tests/golden/invalid/invalid.yaml: VirtualService 'default/bad-timeout': spec.http[0].timeout: invalid duration 'soon'",
        "tests/golden/invalid/invalid.yaml: DestinationRule 'default/bad-lb': trafficPolicy.loadBalancer.simple: unknown value 'FASTEST'",
        "tests/golden/invalid/invalid.yaml: Gateway 'default/gw': spec.servers[1].port.protocol: unknown protocol 'SCTP'",
    ] {
        assert!(
            invalid.iter().any(|i| i.starts_with(want)),
            "no report starting with {want:?} in {invalid:#?}"
        );
    }
    let routes = &got["routes"]["http.8080"]["virtual_hosts"][0]["routes"];
    assert_eq!(routes.as_array().map(Vec::len), Some(1), "{routes}");
    assert_eq!(
        routes[0]["route"]["cluster"],
        "outbound|80||web.default.svc.cluster.local"
    );
}

/// The features output, made static (EDS clusters with their assignments inline, RDS and SDS
/// inline), through `<bin> --mode validate`.
fn validate_static(bin: &Path, case: &str, drop: &[&str]) -> std::process::Output {
    let got = golden(case);
    // The secrets with their keys (the golden file has them redacted).
    let (raw, _) = run(&PathBuf::from(MANIFEST).join("tests/golden").join(case));
    let secret = |name: &str| {
        raw.secrets
            .get(name)
            .map(|s| normalised(types::SECRET, s)["tls_certificate"].clone())
            .unwrap_or_else(|| panic!("no secret {name}"))
    };
    let mut clusters = Vec::new();
    for (name, c) in got["clusters"].as_object().expect("clusters") {
        let mut c = c.clone();
        if let Some(o) = c.as_object_mut() {
            if o.get("type").and_then(Value::as_str) == Some("EDS") {
                o.insert("type".into(), json!("STATIC"));
                o.remove("eds_cluster_config");
                let cla = got["endpoints"].get(name).cloned();
                o.insert(
                    "load_assignment".into(),
                    cla.unwrap_or(json!({"cluster_name": name})),
                );
            }
            // The auto-mTLS match names istio-agent's sds-grpc cluster, absent here.
            o.remove("transport_socket_matches");
            if drop
                .iter()
                .any(|d| o.contains_key(*d) || o.get("lb_policy") == Some(&json!(d)))
            {
                continue;
            }
        }
        clusters.push(c);
    }
    let mut listeners = Vec::new();
    for l in got["listeners"].as_object().expect("listeners").values() {
        let mut l = l.clone();
        for chain in l["filter_chains"].as_array_mut().into_iter().flatten() {
            let hcm = chain.pointer_mut("/filters/0/typed_config");
            let rds = hcm
                .as_ref()
                .and_then(|h| h.pointer("/rds/route_config_name"))
                .and_then(Value::as_str)
                .map(String::from);
            if let (Some(name), Some(hcm)) = (rds, hcm) {
                if let Some(o) = hcm.as_object_mut() {
                    o.remove("rds");
                    o.insert("route_config".into(), got["routes"][&name].clone());
                }
            }
            let common = chain.pointer_mut("/transport_socket/typed_config/common_tls_context");
            if let Some(o) = common.and_then(Value::as_object_mut) {
                if let Some(sds) = o.remove("tls_certificate_sds_secret_configs") {
                    let name = sds[0]["name"].as_str().unwrap_or("").to_string();
                    o.insert("tls_certificates".into(), json!([secret(&name)]));
                }
            }
        }
        l["address"]["socket_address"]["address"] = json!("127.0.0.1");
        listeners.push(l);
    }
    let boot = json!({
        "static_resources": {"listeners": listeners, "clusters": clusters},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}
    });
    let dir = std::env::temp_dir().join(format!("portico-golden-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join(format!("{case}.json"));
    std::fs::write(&file, boot.to_string()).expect("write bootstrap");
    let out = std::process::Command::new(bin)
        .args(["--mode", "validate", "-c"])
        .arg(&file)
        .args(["--log-level", "error"])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let _ = std::fs::remove_dir_all(&dir);
    out
}

#[test]
fn envoy_and_portico_accept_every_feature_the_control_plane_renders() {
    // The README's test command installs Envoy 1.40 first (scripts/setup.sh --with-envoy).
    let found = std::process::Command::new(PathBuf::from(MANIFEST).join("scripts/envoy-path.sh"))
        .output()
        .expect("scripts/envoy-path.sh");
    let envoy = String::from_utf8_lossy(&found.stdout).trim().to_string();
    assert!(
        found.status.success() && !envoy.is_empty(),
        "Envoy is needed: run scripts/setup.sh --with-envoy"
    );
    let out = validate_static(Path::new(&envoy), "features", &[]);
    assert!(
        out.status.success(),
        "Envoy: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Consistent hashing (RING_HASH, MAGLEV, route hash_policy) included.
    let portico = Path::new(env!("CARGO_BIN_EXE_portico"));
    let out = validate_static(portico, "features", &[]);
    assert!(
        out.status.success(),
        "Portico: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
