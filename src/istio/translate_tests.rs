use super::*;

#[test]
fn durations_as_proto_json() {
    assert_eq!(duration("10s").unwrap(), "10s");
    assert_eq!(duration("1.5s").unwrap(), "1.5s");
    assert_eq!(duration("100ms").unwrap(), "0.1s");
    assert_eq!(duration("2m").unwrap(), "120s");
    assert_eq!(duration("1h").unwrap(), "3600s");
    assert!(duration("10").is_err());
    assert!(duration("-1s").is_err());
    assert!(duration("abc").is_err());
}

fn gateway_node() -> NodeInfo {
    NodeInfo {
        id: "router~127.0.0.1~gw.istio-system~istio-system.svc.cluster.local".into(),
        labels: [("istio".to_string(), "ingressgateway".to_string())].into(),
        namespace: Some("istio-system".into()),
    }
}

fn bookinfo() -> Config {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/gateway-examples/bookinfo");
    let (config, invalid) = crate::istio::load_dir(std::path::Path::new(dir)).expect("bookinfo");
    assert!(invalid.is_empty(), "{invalid:?}");
    config
}

/// What the control plane serves must be what the data plane accepts, as one ADS stream
/// delivers it: CDS, EDS, LDS, RDS, SDS.
pub(crate) fn accepted_by_portico(xds: &Xds) {
    use crate::xds::store::Store;
    use crate::xds::types::Kind;
    let mut store = Store::default();
    for (kind, set) in [
        (Kind::Cluster, &xds.clusters),
        (Kind::Endpoint, &xds.endpoints),
        (Kind::Listener, &xds.listeners),
        (Kind::Route, &xds.routes),
        (Kind::Secret, &xds.secrets),
    ] {
        let resources: Vec<Any> = set.values().cloned().collect();
        match store.apply(kind, "1", &resources) {
            Ok(next) => store = next,
            Err(e) => panic!("Portico refuses the {kind:?} the control plane serves: {e:?}"),
        }
    }
}

#[test]
fn bookinfo_translates_and_portico_accepts_it() {
    let (xds, invalid) = crate::istio::translate(&bookinfo(), &gateway_node(), &Options::default());
    assert!(invalid.is_empty(), "{invalid:?}");
    assert_eq!(xds.listeners.keys().collect::<Vec<_>>(), ["0.0.0.0_8080"]);
    assert_eq!(xds.routes.keys().collect::<Vec<_>>(), ["http.8080"]);
    let clusters: Vec<&str> = xds.clusters.keys().map(String::as_str).collect();
    let mut want = vec![
        "BlackHoleCluster",
        "outbound|9080||productpage.default.svc.cluster.local",
        "outbound|9080||ratings.default.svc.cluster.local",
        "outbound|9080||reviews.default.svc.cluster.local",
        "outbound|9080|v1|productpage.default.svc.cluster.local",
        "outbound|9080|v1|ratings.default.svc.cluster.local",
        "outbound|9080|v1|reviews.default.svc.cluster.local",
        "outbound|9080|v2|reviews.default.svc.cluster.local",
        "outbound|9080|v3|reviews.default.svc.cluster.local",
    ];
    want.sort();
    assert_eq!(clusters, want);
    accepted_by_portico(&xds);
}

fn config(yaml: &str) -> Config {
    let (objects, bad) = crate::istio::model::parse_file("test.yaml", yaml);
    assert!(bad.is_empty(), "{bad:?}");
    let files = vec!["test.yaml".to_string(); objects.len()];
    Config { objects, files }
}

const GATEWAY: &str = r#"
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: { name: gw, namespace: default }
spec:
  selector: { istio: ingressgateway }
  servers:
  - port: { number: 8080, name: http, protocol: HTTP }
    hosts: ["*"]
---
apiVersion: v1
kind: Service
metadata: { name: web, namespace: default }
spec:
  selector: { app: web }
  ports: [{ name: http, port: 80 }]
"#;

fn routes(out: &XdsJson) -> Vec<Json> {
    out.routes["http.8080"]["virtual_hosts"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|v| v["routes"].as_array().cloned().unwrap_or_default())
        .collect()
}

#[test]
fn a_gateway_whose_selector_misses_the_node_yields_nothing_to_listen_on() {
    let mut node = gateway_node();
    node.labels = [("istio".to_string(), "egressgateway".to_string())].into();
    let (out, bad) = translate_json(&config(GATEWAY), &node, &Options::default());
    assert!(bad.is_empty(), "{bad:?}");
    assert!(out.listeners.is_empty() && out.routes.is_empty());
    // Clusters are the registry's, whichever gateway asks.
    assert!(out
        .clusters
        .contains_key("outbound|80||web.default.svc.cluster.local"));
}

#[test]
fn a_server_with_no_virtual_service_answers_404_like_istiod() {
    let (out, _) = translate_json(&config(GATEWAY), &gateway_node(), &Options::default());
    let r = routes(&out);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0]["direct_response"]["status"], 404);
    assert_eq!(
        out.routes["http.8080"]["virtual_hosts"][0]["name"],
        "blackhole:8080"
    );
}

#[test]
fn virtual_services_merge_per_host_in_creation_then_name_then_namespace_order() {
    let vs = |name: &str, ns: &str, ts: &str, prefix: &str| {
        format!(
            r#"---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{ name: {name}, namespace: {ns}{ts} }}
spec:
  hosts: ["*"]
  gateways: [default/gw]
  http:
  - match: [{{ uri: {{ prefix: {prefix} }} }}]
    route: [{{ destination: {{ host: web.default.svc.cluster.local }} }}]
"#
        )
    };
    let yaml = [
        GATEWAY.to_string(),
        vs("b", "default", "", "/b-default"),
        vs("a", "zzz", "", "/a-zzz"),
        vs("a", "default", "", "/a-default"),
        vs(
            "c",
            "default",
            ", creationTimestamp: \"2020-01-01T00:00:00Z\"",
            "/c-old",
        ),
        vs(
            "d",
            "default",
            ", creationTimestamp: \"2019-01-01T00:00:00Z\"",
            "/d-older",
        ),
    ]
    .concat();
    let (out, bad) = translate_json(&config(&yaml), &gateway_node(), &Options::default());
    assert!(bad.is_empty(), "{bad:?}");
    let prefixes: Vec<String> = routes(&out)
        .iter()
        .map(|r| r["match"]["prefix"].as_str().unwrap_or("").to_string())
        .collect();
    // No timestamp sorts first (as Go's zero time), then by name, then namespace.
    assert_eq!(
        prefixes,
        ["/a-default", "/a-zzz", "/b-default", "/d-older", "/c-old"]
    );
}

#[test]
fn destinations_resolve_short_names_ports_and_drop_zero_weights() {
    let yaml = format!(
        r#"{GATEWAY}---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{ name: v, namespace: default }}
spec:
  hosts: ["*"]
  gateways: [gw]
  http:
  - match: [{{ uri: {{ prefix: /split }} }}]
    route:
    - {{ destination: {{ host: web }}, weight: 100 }}
    - {{ destination: {{ host: web, subset: canary }}, weight: 0 }}
  - match: [{{ uri: {{ prefix: /other }}, port: 9999 }}]
    route: [{{ destination: {{ host: web }} }}]
  - retries: {{ attempts: 0 }}
    route: [{{ destination: {{ host: unknown }} }}]
"#
    );
    let (out, bad) = translate_json(&config(&yaml), &gateway_node(), &Options::default());
    assert!(bad.is_empty(), "{bad:?}");
    let r = routes(&out);
    assert_eq!(
        r.len(),
        2,
        "the port-9999 match does not apply on 8080: {r:?}"
    );
    // One destination left after dropping weight 0: a plain cluster, as istiod renders it.
    assert_eq!(
        r[0]["route"]["cluster"],
        "outbound|80||web.default.svc.cluster.local"
    );
    // An unknown service without a port: the server's port, as istiod falls back to.
    assert_eq!(
        r[1]["route"]["cluster"],
        "outbound|8080||unknown.default.svc.cluster.local"
    );
    assert!(r[1]["route"].get("retry_policy").is_none());
    assert_eq!(r[0]["route"]["retry_policy"]["num_retries"], 2);
}

#[test]
fn subsets_hold_only_ready_endpoints_with_their_labels() {
    let yaml = format!(
        r#"{GATEWAY}---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {{ name: web, namespace: default }}
spec:
  host: web
  subsets:
  - {{ name: v1, labels: {{ version: v1 }} }}
  - {{ name: v2, labels: {{ version: v2 }} }}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{ name: web-1, namespace: default, labels: {{ kubernetes.io/service-name: web }} }}
ports: [{{ name: http, port: 8080 }}]
endpoints:
- {{ addresses: [10.0.0.1], labels: {{ version: v1 }} }}
- {{ addresses: [10.0.0.2], labels: {{ version: v2 }} }}
- {{ addresses: [10.0.0.3], labels: {{ version: v2 }}, conditions: {{ ready: false }} }}
"#
    );
    let (out, bad) = translate_json(&config(&yaml), &gateway_node(), &Options::default());
    assert!(bad.is_empty(), "{bad:?}");
    let addrs = |c: &str| -> Vec<String> {
        out.endpoints[c]["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|l| l["lb_endpoints"].as_array().cloned().unwrap_or_default())
            .map(|e| {
                let a = &e["endpoint"]["address"]["socket_address"];
                format!(
                    "{}:{}",
                    a["address"].as_str().unwrap_or(""),
                    a["port_value"]
                )
            })
            .collect()
    };
    assert_eq!(
        addrs("outbound|80||web.default.svc.cluster.local"),
        ["10.0.0.1:8080", "10.0.0.2:8080"]
    );
    assert_eq!(
        addrs("outbound|80|v1|web.default.svc.cluster.local"),
        ["10.0.0.1:8080"]
    );
    assert_eq!(
        addrs("outbound|80|v2|web.default.svc.cluster.local"),
        ["10.0.0.2:8080"]
    );
}

#[test]
fn gateway_ports_map_through_the_gateway_service_to_the_pod_port() {
    let yaml = GATEWAY.replace("number: 8080", "number: 80").to_string()
        + r#"---
apiVersion: v1
kind: Service
metadata: { name: ingress, namespace: istio-system }
spec:
  selector: { istio: ingressgateway }
  ports: [{ name: http2, port: 80, targetPort: 8080 }]
"#;
    let (out, _) = translate_json(&config(&yaml), &gateway_node(), &Options::default());
    assert_eq!(out.listeners.keys().collect::<Vec<_>>(), ["0.0.0.0_8080"]);
    assert_eq!(
        out.listeners["0.0.0.0_8080"]["address"]["socket_address"]["port_value"],
        8080
    );
    assert_eq!(
        out.routes["http.8080"]["virtual_hosts"][0]["name"],
        "blackhole:80"
    );
}

#[test]
fn authorization_policies_selecting_the_gateway_become_rbac_filters_before_the_router() {
    let policies = r#"
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: { name: deny-admin, namespace: istio-system }
spec:
  selector: { matchLabels: { istio: ingressgateway } }
  action: DENY
  rules:
  - to: [{ operation: { paths: ["/admin*"] } }]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: { name: allow-office, namespace: istio-system }
spec:
  selector: { matchLabels: { istio: ingressgateway } }
  rules:
  - from: [{ source: { remoteIpBlocks: ["10.0.0.0/8"] } }]
  - when: [{ key: request.bogus, values: ["x"] }]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: { name: other-workload, namespace: istio-system }
spec:
  selector: { matchLabels: { app: something-else } }
  action: DENY
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: { name: oauth, namespace: istio-system }
spec:
  action: CUSTOM
  provider: { name: oauth2-proxy }
  rules:
  - to: [{ operation: { hosts: ["private.example.com"] } }]
"#;
    let mut node = gateway_node();
    node.namespace = Some("istio-system".into());
    let (out, bad) = translate_json(
        &config(&format!("{GATEWAY}{policies}")),
        &node,
        &Options::default(),
    );
    let reasons: Vec<(String, String)> = bad
        .iter()
        .map(|b| (b.name.clone(), b.reason.clone()))
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(reasons.iter().any(|(n, r)| n == "istio-system/oauth"
        && r.starts_with("spec.provider: available providers are [] but found \"oauth2-proxy\"")));
    assert!(reasons.iter().any(|(n, r)| n == "istio-system/allow-office"
        && r.contains("spec.rules[1]")
        && r.contains("unknown attribute request.bogus")));
    let filters = out.listeners["0.0.0.0_8080"]
        .pointer("/filter_chains/0/filters/0/typed_config/http_filters")
        .and_then(Json::as_array)
        .cloned()
        .unwrap_or_default();
    let names: Vec<&str> = filters.iter().filter_map(|f| f["name"].as_str()).collect();
    assert_eq!(
        names,
        [
            "envoy.filters.http.rbac",
            "envoy.filters.http.rbac",
            "envoy.filters.http.rbac",
            "envoy.filters.http.fault",
            "envoy.filters.http.cors",
            "envoy.filters.http.router"
        ]
    );
    // The unusable CUSTOM provider: what its rules match is denied.
    let custom = &filters[0]["typed_config"]["rules"];
    assert_eq!(custom["action"], "DENY");
    let names_of = |rules: &Json| -> Vec<String> {
        rules["policies"]
            .as_object()
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    };
    assert_eq!(
        names_of(custom),
        ["istio-ext-authz-oauth2-proxy-ns[istio-system]-policy[oauth]-rule[0]-deny-due-to-bad-CUSTOM-action"]
    );
    let deny = &filters[1]["typed_config"]["rules"];
    assert_eq!(deny["action"], "DENY");
    assert_eq!(
        names_of(deny),
        ["ns[istio-system]-policy[deny-admin]-rule[0]"]
    );
    // What the control plane renders, the data plane enforces.
    let (xds, _) = crate::istio::translate(
        &config(&format!("{GATEWAY}{policies}")),
        &node,
        &Options::default(),
    );
    accepted_by_portico(&xds);
    let allow = &filters[2]["typed_config"]["rules"];
    assert_eq!(allow["action"], "ALLOW");
    assert_eq!(
        allow["policies"]["ns[istio-system]-policy[allow-office]-rule[0]"]["principals"][0]
            ["and_ids"]["ids"][0]["or_ids"]["ids"][0],
        json!({"remote_ip": {"address_prefix": "10.0.0.0", "prefix_len": 8}})
    );
}

#[test]
fn request_authentication_puts_jwt_authn_before_the_authorization_filters() {
    let policies = r#"
---
apiVersion: security.istio.io/v1
kind: RequestAuthentication
metadata: { name: jwt, namespace: istio-system }
spec:
  selector: { matchLabels: { istio: ingressgateway } }
  jwtRules:
  - issuer: https://issuer.example
    jwksUri: http://web.default.svc.cluster.local/jwks
    outputClaimToHeaders: [{ header: x-group, claim: group }]
  - issuer: https://elsewhere.example
    jwksUri: https://elsewhere.example/keys
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: { name: need-token, namespace: istio-system }
spec:
  selector: { matchLabels: { istio: ingressgateway } }
  rules:
  - from: [{ source: { requestPrincipals: ["*"] } }]
"#;
    let (out, bad) = translate_json(
        &config(&format!("{GATEWAY}{policies}")),
        &gateway_node(),
        &Options::default(),
    );
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert_eq!(bad[0].kind, "RequestAuthentication");
    assert!(
        bad[0].reason.starts_with("spec.jwtRules[1].jwksUri:"),
        "{}",
        bad[0].reason
    );
    let filters = out.listeners["0.0.0.0_8080"]
        .pointer("/filter_chains/0/filters/0/typed_config/http_filters")
        .and_then(Json::as_array)
        .cloned()
        .unwrap_or_default();
    let names: Vec<&str> = filters.iter().filter_map(|f| f["name"].as_str()).collect();
    assert_eq!(
        names[..3],
        [
            "envoy.filters.http.jwt_authn",
            "envoy.filters.http.rbac",
            "envoy.filters.http.fault"
        ]
    );
    let providers = &filters[0]["typed_config"]["providers"];
    // Sorted by issuer: elsewhere before issuer.
    assert_eq!(
        providers["origins-0"]["issuer"],
        "https://elsewhere.example"
    );
    assert_eq!(
        providers["origins-1"]["remote_jwks"]["http_uri"]["cluster"],
        "outbound|80||web.default.svc.cluster.local"
    );
    assert_eq!(
        providers["origins-1"]["claim_to_headers"],
        json!([{"header_name": "x-group", "claim_name": "group"}])
    );
}

#[test]
fn custom_policies_call_the_mesh_configs_ext_authz_provider() {
    let objects = r#"
---
apiVersion: v1
kind: ConfigMap
metadata: { name: istio, namespace: istio-system }
data:
  mesh: |
    extensionProviders:
    - name: authz
      envoyExtAuthzGrpc: { service: authz.default.svc.cluster.local, port: 9000 }
---
apiVersion: v1
kind: Service
metadata: { name: authz, namespace: default }
spec:
  selector: { app: authz }
  ports: [{ name: grpc, port: 9000 }]
---
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: { name: ext, namespace: istio-system }
spec:
  selector: { matchLabels: { istio: ingressgateway } }
  action: CUSTOM
  provider: { name: authz }
  rules:
  - to: [{ operation: { paths: ["/private/*"] } }]
"#;
    let (out, bad) = translate_json(
        &config(&format!("{GATEWAY}{objects}")),
        &gateway_node(),
        &Options::default(),
    );
    assert!(bad.is_empty(), "{bad:?}");
    let filters = out.listeners["0.0.0.0_8080"]
        .pointer("/filter_chains/0/filters/0/typed_config/http_filters")
        .and_then(Json::as_array)
        .cloned()
        .unwrap_or_default();
    let names: Vec<&str> = filters.iter().filter_map(|f| f["name"].as_str()).collect();
    assert_eq!(
        names[..2],
        ["envoy.filters.http.rbac", "envoy.filters.http.ext_authz"]
    );
    assert_eq!(
        filters[0]["typed_config"]["shadow_rules_stat_prefix"],
        "istio_ext_authz_"
    );
    let ext = &filters[1]["typed_config"];
    assert_eq!(
        ext["grpc_service"]["envoy_grpc"]["cluster_name"],
        "outbound|9000||authz.default.svc.cluster.local"
    );
    assert_eq!(
        ext["filter_enabled_metadata"]["value"]["string_match"]["prefix"],
        "istio-ext-authz-authz"
    );
}

#[test]
fn peer_authentication_is_checked_and_changes_nothing_at_a_gateway() {
    let ok = r#"
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: { name: default, namespace: istio-system }
spec:
  mtls: { mode: STRICT }
"#;
    let (with, bad) = translate_json(
        &config(&format!("{GATEWAY}{ok}")),
        &gateway_node(),
        &Options::default(),
    );
    assert!(bad.is_empty(), "{bad:?}");
    let (without, _) = translate_json(&config(GATEWAY), &gateway_node(), &Options::default());
    assert_eq!(with, without);
    let (_, bad) = crate::istio::model::parse_file(
        "pa.yaml",
        "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: x}\nspec: {mtls: {mode: STRICTT}}\n",
    );
    assert_eq!(bad.len(), 1);
    assert!(
        bad[0]
            .reason
            .starts_with("spec.mtls.mode: unknown variant `STRICTT`"),
        "{}",
        bad[0].reason
    );
}
