//! Gateway servers that are not plain HTTP: HTTPS (SIMPLE, MUTUAL, ISTIO_MUTUAL) with their
//! SDS secrets, PASSTHROUGH by SNI, TCP and AUTO_PASSTHROUGH, as istiod renders them
//! (pilot/pkg/networking/core/gateway.go, listener.go; pilot/pkg/xds/sds.go).

use base64::Engine;

use super::translate_tests::accepted_by_portico;
use super::*;

fn node() -> NodeInfo {
    NodeInfo {
        id: "router~127.0.0.1~gw.istio-system~istio-system.svc.cluster.local".into(),
        labels: [("istio".to_string(), "ingressgateway".to_string())].into(),
        namespace: Some("istio-system".into()),
    }
}

fn config(yaml: &str) -> Config {
    let (objects, bad) = crate::istio::model::parse_file("test.yaml", yaml);
    assert!(bad.is_empty(), "{bad:?}");
    let files = vec!["test.yaml".to_string(); objects.len()];
    Config { objects, files }
}

fn run(yaml: &str) -> (XdsJson, Vec<String>) {
    let (out, bad) = translate_json(&config(yaml), &node(), &Options::default());
    (out, bad.iter().map(ToString::to_string).collect())
}

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

/// A certificate and key (PEM) for `host`, signed by itself.
fn cert(host: &str) -> (String, String) {
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec![host.to_string()]).expect("params");
    let cert = params.self_signed(&key).expect("cert");
    (cert.pem(), key.serialize_pem())
}

/// A `kubernetes.io/tls` Secret as kubectl writes it (base64 `data`).
fn tls_secret(name: &str, host: &str) -> String {
    let (c, k) = cert(host);
    format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata: {{ name: {name}, namespace: istio-system }}\ntype: kubernetes.io/tls\ndata:\n  tls.crt: {}\n  tls.key: {}\n",
        b64(&c),
        b64(&k)
    )
}

const SERVICES: &str = r#"
---
apiVersion: v1
kind: Service
metadata: { name: web, namespace: default }
spec:
  selector: { app: web }
  ports: [{ name: http, port: 9080 }]
---
apiVersion: v1
kind: Service
metadata: { name: db, namespace: default }
spec:
  selector: { app: db }
  ports: [{ name: tcp, port: 27017 }]
---
apiVersion: v1
kind: Service
metadata: { name: a, namespace: default }
spec:
  selector: { app: a }
  ports: [{ name: https, port: 443 }]
---
apiVersion: v1
kind: Service
metadata: { name: b, namespace: default }
spec:
  selector: { app: b }
  ports: [{ name: https, port: 443 }]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: { name: web, namespace: default }
spec:
  hosts: ["*.example.com"]
  gateways: [istio-system/gw]
  http:
  - route:
    - destination: { host: web }
"#;

fn gateway(servers: &str) -> String {
    format!(
        r#"apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {{ name: gw, namespace: istio-system }}
spec:
  selector: {{ istio: ingressgateway }}
  servers:
{servers}"#
    )
}

fn chain<'a>(out: &'a XdsJson, listener: &str, i: usize) -> &'a Json {
    &out.listeners[listener]["filter_chains"][i]
}

#[test]
fn https_simple_renders_istiods_chain_and_the_secret_over_sds() {
    let yaml = gateway(
        r#"  - port: { number: 443, name: https, protocol: HTTPS }
    hosts: ["shop.example.com", "default/api.example.com", "shop.example.com"]
    tls:
      mode: SIMPLE
      credentialName: shop-cert
      minProtocolVersion: TLSV1_2
      maxProtocolVersion: TLSV1_3
      cipherSuites: [ECDHE-RSA-AES256-GCM-SHA384, NOT-A-CIPHER, ECDHE-RSA-AES256-GCM-SHA384]
"#,
    ) + SERVICES
        + &tls_secret("shop-cert", "shop.example.com");
    let (out, bad) = run(&yaml);
    assert!(bad.is_empty(), "{bad:?}");
    let c = chain(&out, "0.0.0.0_443", 0);
    // Hosts without their namespace, once each, sorted.
    assert_eq!(
        c["filter_chain_match"],
        json!({"server_names": ["api.example.com", "shop.example.com"]})
    );
    assert_eq!(
        c["transport_socket"],
        json!({"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": ["h2", "http/1.1"],
                "tls_certificate_sds_secret_configs": [{"name": "kubernetes://shop-cert",
                    "sds_config": {"ads": {}, "resource_api_version": "V3"}}],
                // Only what the server sets; an unknown suite is dropped, a repeat kept once.
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2",
                    "tls_maximum_protocol_version": "TLSv1_3",
                    "cipher_suites": ["ECDHE-RSA-AES256-GCM-SHA384"]}
            },
            "require_client_certificate": false
        }})
    );
    let hcm = &c["filters"][0]["typed_config"];
    assert_eq!(
        hcm["rds"]["route_config_name"],
        "https.443.https.gw.istio-system"
    );
    assert_eq!(hcm["stat_prefix"], "outbound_0.0.0.0_443");
    assert_eq!(
        out.listeners["0.0.0.0_443"]["listener_filters"][0]["name"],
        "envoy.filters.listener.tls_inspector"
    );
    let vhosts = &out.routes["https.443.https.gw.istio-system"]["virtual_hosts"];
    assert_eq!(vhosts[0]["name"], "api.example.com:443");
    assert_eq!(vhosts[1]["name"], "shop.example.com:443");
    let s = &out.secrets["kubernetes://shop-cert"];
    assert_eq!(s["name"], "kubernetes://shop-cert");
    assert!(s["tls_certificate"]["certificate_chain"]["inline_bytes"].is_string());
    assert!(s["tls_certificate"]["private_key"]["inline_bytes"].is_string());

    let (xds, _) = crate::istio::translate(&config(&yaml), &node(), &Options::default());
    assert_eq!(
        xds.secrets.keys().collect::<Vec<_>>(),
        ["kubernetes://shop-cert"]
    );
    accepted_by_portico(&xds);
}

#[test]
fn a_named_https_server_names_its_connection_manager_stats() {
    let yaml = gateway(
        r#"  - port: { number: 443, name: https, protocol: HTTPS }
    name: shop-tls
    hosts: ["*"]
    tls: { credentialName: shop-cert }
"#,
    ) + SERVICES;
    let (out, _) = run(&yaml);
    let c = chain(&out, "0.0.0.0_443", 0);
    assert_eq!(c["filters"][0]["typed_config"]["stat_prefix"], "shop-tls");
    // "*" is any name: no filter_chain_match, but SNI hosts still bring the TLS inspector.
    assert!(c.get("filter_chain_match").is_none(), "{c}");
    assert!(out.listeners["0.0.0.0_443"]
        .get("listener_filters")
        .is_some());
    assert!(c["transport_socket"]["typed_config"]["common_tls_context"]
        .get("tls_params")
        .is_none());
}

#[test]
fn http_and_https_servers_on_two_ports_of_one_gateway_both_render() {
    let yaml = gateway(
        r#"  - port: { number: 80, name: http, protocol: HTTP }
    hosts: ["*.example.com"]
    tls: { httpsRedirect: true }
  - port: { number: 443, name: https, protocol: HTTPS }
    hosts: ["*.example.com"]
    tls: { mode: SIMPLE, credentialName: shop-cert }
"#,
    ) + SERVICES
        + &tls_secret("shop-cert", "*.example.com");
    let (out, bad) = run(&yaml);
    assert!(bad.is_empty(), "{bad:?}");
    assert_eq!(
        out.listeners.keys().collect::<Vec<_>>(),
        ["0.0.0.0_443", "0.0.0.0_80"]
    );
    assert_eq!(
        out.routes.keys().collect::<Vec<_>>(),
        ["http.80", "https.443.https.gw.istio-system"]
    );
    assert_eq!(
        out.routes["http.80"]["virtual_hosts"][0]["require_tls"],
        "ALL"
    );
    let https = &out.routes["https.443.https.gw.istio-system"]["virtual_hosts"][0];
    assert!(https.get("require_tls").is_none());
    assert_eq!(
        https["routes"][0]["route"]["cluster"],
        "outbound|9080||web.default.svc.cluster.local"
    );
    // The plaintext listener has no TLS inspector (istiod adds it only for SNI or ALPN).
    assert!(out.listeners["0.0.0.0_80"]
        .get("listener_filters")
        .is_none());
    let (xds, _) = crate::istio::translate(&config(&yaml), &node(), &Options::default());
    accepted_by_portico(&xds);
}

#[test]
fn mutual_validates_clients_with_the_cacert_secret() {
    let (ca, _) = cert("client-ca");
    let (c, k) = cert("shop.example.com");
    let secret = format!(
        "---\napiVersion: v1\nkind: Secret\nmetadata: {{ name: shop-cert, namespace: istio-system }}\ntype: kubernetes.io/tls\ndata:\n  tls.crt: {}\n  tls.key: {}\n  ca.crt: {}\n",
        b64(&c),
        b64(&k),
        b64(&ca)
    );
    let yaml = gateway(
        r#"  - port: { number: 443, name: https, protocol: HTTPS }
    hosts: ["shop.example.com"]
    tls:
      mode: MUTUAL
      credentialName: shop-cert
      subjectAltNames: [spiffe://example.com/client, client.example.com]
"#,
    ) + SERVICES
        + &secret;
    let (out, bad) = run(&yaml);
    assert!(bad.is_empty(), "{bad:?}");
    let tls = &chain(&out, "0.0.0.0_443", 0)["transport_socket"]["typed_config"];
    assert_eq!(tls["require_client_certificate"], true);
    assert_eq!(
        tls["common_tls_context"]["combined_validation_context"],
        json!({
            "default_validation_context": {"match_subject_alt_names": [
                {"exact": "spiffe://example.com/client"}, {"exact": "client.example.com"}]},
            "validation_context_sds_secret_config": {"name": "kubernetes://shop-cert-cacert",
                "sds_config": {"ads": {}, "resource_api_version": "V3"}}
        })
    );
    // The CA from ca.crt of the same Secret, as istiod's GetCaCert falls back to it.
    assert_eq!(
        out.secrets["kubernetes://shop-cert-cacert"],
        json!({"name": "kubernetes://shop-cert-cacert",
               "validation_context": {"trusted_ca": {"inline_bytes": b64(&ca)}}})
    );

    // A separate <name>-cacert Secret (generic, `cacert`) wins over the fallback.
    let (other_ca, _) = cert("other-ca");
    let yaml = yaml
        + &format!(
            "---\napiVersion: v1\nkind: Secret\nmetadata: {{ name: shop-cert-cacert, namespace: istio-system }}\nstringData:\n  cacert: |\n{}",
            other_ca.lines().map(|l| format!("    {l}\n")).collect::<String>()
        );
    let (out, bad) = run(&yaml);
    assert!(bad.is_empty(), "{bad:?}");
    assert_eq!(
        out.secrets["kubernetes://shop-cert-cacert"]["validation_context"]["trusted_ca"]
            ["inline_bytes"],
        b64(&other_ca)
    );
}

#[test]
fn istio_mutual_takes_the_workload_certificate_from_istio_agent() {
    let yaml = gateway(
        r#"  - port: { number: 15443, name: https-mtls, protocol: HTTPS }
    hosts: ["*.example.com"]
    tls: { mode: ISTIO_MUTUAL }
"#,
    ) + SERVICES;
    let (out, bad) = run(&yaml);
    assert!(bad.is_empty(), "{bad:?}");
    let sds = |name: &str| {
        json!({"name": name, "sds_config": {"api_config_source": {"api_type": "GRPC",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}],
            "set_node_on_first_message_only": true, "transport_api_version": "V3"},
            "initial_fetch_timeout": "0s", "resource_api_version": "V3"}})
    };
    assert_eq!(
        chain(&out, "0.0.0.0_15443", 0)["transport_socket"]["typed_config"],
        json!({
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": ["h2", "http/1.1"],
                "tls_certificate_sds_secret_configs": [sds("default")],
                "combined_validation_context": {
                    "default_validation_context": {"match_subject_alt_names": []},
                    "validation_context_sds_secret_config": sds("ROOTCA")
                }
            },
            "require_client_certificate": true
        })
    );
    // istio-agent serves those; the control plane has no secret to send.
    assert!(out.secrets.is_empty());
}

#[test]
fn a_missing_or_unusable_secret_is_left_out_and_reported() {
    let servers = r#"  - port: { number: 443, name: https, protocol: HTTPS }
    hosts: ["a.example.com"]
    tls: { credentialName: nowhere }
  - port: { number: 443, name: https-b, protocol: HTTPS }
    hosts: ["b.example.com"]
    tls: { credentialName: no-keys }
  - port: { number: 443, name: https-c, protocol: HTTPS }
    hosts: ["c.example.com"]
    tls: { credentialName: default/elsewhere }
"#;
    let yaml = gateway(servers)
        + SERVICES
        + "---\napiVersion: v1\nkind: Secret\nmetadata: { name: no-keys, namespace: istio-system }\nstringData: { password: hunter2 }\n";
    let (out, bad) = run(&yaml);
    assert!(out.secrets.is_empty());
    // The chains still render: the gateway waits for the secrets, which istiod leaves out of
    // SDS too (the cross-namespace one because it is not allowed).
    assert_eq!(
        out.listeners["0.0.0.0_443"]["filter_chains"]
            .as_array()
            .map(Vec::len),
        Some(3)
    );
    assert_eq!(bad.len(), 3, "{bad:#?}");
    assert!(bad[0].contains("spec.servers[2].tls.credentialName: secret default/elsewhere is outside the gateway's namespace istio-system, which istiod does not serve"), "{bad:#?}");
    assert!(bad[1].contains("Gateway 'istio-system/gw': spec.servers[1].tls.credentialName: Secret istio-system/no-keys has neither 'tls.crt' and 'tls.key' nor 'cert' and 'key'"), "{bad:#?}");
    assert!(
        bad[2].contains("spec.servers[0].tls.credentialName: no Secret istio-system/nowhere"),
        "{bad:#?}"
    );
    // Never the content.
    assert!(!bad.iter().any(|b| b.contains("hunter2")));
}

#[test]
fn secrets_are_read_as_istio_reads_them_and_never_printed() {
    let (c, k) = cert("shop.example.com");
    let indent = |s: &str| s.lines().map(|l| format!("    {l}\n")).collect::<String>();
    let yaml = format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{ name: generic, namespace: istio-system }}\nstringData:\n  cert: |\n{}  key: |\n{}",
        indent(&c),
        indent(&k)
    );
    let cfg = config(&yaml);
    let Object::Secret(_, s) = &cfg.objects[0] else {
        panic!("not a secret");
    };
    assert_eq!(s.get("cert"), Some(c.as_bytes()));
    let shown = format!("{cfg:?}");
    assert!(
        shown.contains("\"cert\"") && !shown.contains("PRIVATE KEY"),
        "{shown}"
    );

    // Bad base64 is reported by key, without the value.
    let (ok, bad) = crate::istio::model::parse_file(
        "s.yaml",
        "apiVersion: v1\nkind: Secret\nmetadata: { name: s }\ndata: { tls.key: 'sEcReT!!' }\n",
    );
    assert!(ok.is_empty());
    assert_eq!(bad[0].reason, "data.tls.key: not valid base64");
    assert!(!bad[0].to_string().contains("sEcReT"));
}

const PASSTHROUGH: &str = r#"
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: { name: pass, namespace: default }
spec:
  hosts: ["a.pass.example.com", "b.pass.example.com"]
  gateways: [istio-system/gw]
  tls:
  - match:
    - sniHosts: [a.pass.example.com]
    route:
    - destination: { host: a, port: { number: 443 } }
  - match:
    - sniHosts: [b.pass.example.com]
      port: 443
    route:
    - destination: { host: b }
      weight: 80
    - destination: { host: a }
      weight: 20
    - destination: { host: a, subset: never }
      weight: 0
  - match:
    - sniHosts: [a.pass.example.com]
    route:
    - destination: { host: b }
"#;

#[test]
fn passthrough_routes_by_sni_to_tcp_proxies() {
    let yaml = gateway(
        r#"  - port: { number: 443, name: tls, protocol: TLS }
    hosts: ["*.pass.example.com"]
    tls: { mode: PASSTHROUGH }
"#,
    ) + SERVICES
        + PASSTHROUGH;
    let (out, bad) = run(&yaml);
    let l = &out.listeners["0.0.0.0_443"];
    assert_eq!(
        l["filter_chains"],
        json!([
            {"filter_chain_match": {"server_names": ["a.pass.example.com"]},
             "filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": "outbound|443||a.default.svc.cluster.local",
                "cluster": "outbound|443||a.default.svc.cluster.local"}}]},
            {"filter_chain_match": {"server_names": ["b.pass.example.com"]},
             "filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": "pass.default",
                "weighted_clusters": {"clusters": [
                    {"name": "outbound|443||b.default.svc.cluster.local", "weight": 80},
                    {"name": "outbound|443||a.default.svc.cluster.local", "weight": 20}]}}}]}
        ])
    );
    assert_eq!(
        l["listener_filters"][0]["name"],
        "envoy.filters.listener.tls_inspector"
    );
    // The third rule repeats a.pass.example.com: Envoy could not tell the chains apart.
    assert_eq!(bad.len(), 1, "{bad:#?}");
    assert!(bad[0].contains("spec.tls[2].match[0].sniHosts: duplicate SNI host names"));
    assert!(out.routes.keys().all(|r| !r.contains("443")));
    let (xds, _) = crate::istio::translate(&config(&yaml), &node(), &Options::default());
    accepted_by_portico(&xds);
}

#[test]
fn tcp_servers_proxy_to_the_first_matching_tcp_route() {
    let yaml = gateway(
        r#"  - port: { number: 31400, name: tcp, protocol: TCP }
    hosts: ["*"]
"#,
    ) + SERVICES
        + r#"---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: { name: db, namespace: default }
spec:
  hosts: ["*"]
  gateways: [istio-system/gw]
  tcp:
  - match: [{ port: 9999 }]
    route: [{ destination: { host: web } }]
  - match: [{ port: 31400 }]
    route: [{ destination: { host: db, port: { number: 27017 } } }]
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: { name: db, namespace: default }
spec:
  host: db
  trafficPolicy:
    connectionPool: { tcp: { idleTimeout: 30m } }
"#;
    let (out, bad) = run(&yaml);
    assert!(bad.is_empty(), "{bad:?}");
    let l = &out.listeners["0.0.0.0_31400"];
    assert_eq!(
        l["filter_chains"],
        json!([{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": "outbound|27017||db.default.svc.cluster.local",
            "cluster": "outbound|27017||db.default.svc.cluster.local",
            "idle_timeout": "1800s"}}]}])
    );
    // No SNI, no TLS: no inspector.
    assert!(l.get("listener_filters").is_none());
    let (xds, _) = crate::istio::translate(&config(&yaml), &node(), &Options::default());
    accepted_by_portico(&xds);
}

#[test]
fn a_tls_or_tcp_port_with_no_route_has_no_listener() {
    let yaml = gateway(
        r#"  - port: { number: 443, name: tls, protocol: TLS }
    hosts: ["nothing.example.com"]
    tls: { mode: PASSTHROUGH }
  - port: { number: 31400, name: tcp, protocol: TCP }
    hosts: ["*"]
"#,
    ) + SERVICES;
    let (out, bad) = run(&yaml);
    assert!(out.listeners.is_empty(), "{:?}", out.listeners.keys());
    assert_eq!(bad.len(), 3, "{bad:#?}");
    assert!(bad
        .iter()
        .any(|b| b.contains("listener 0.0.0.0_443 has no filter chain")));
    assert!(bad
        .iter()
        .any(|b| b.contains("no VirtualService tcp route binds to this TCP server")));
}

/// Within one Gateway, validation leaves out what istiod's webhook refuses (a taken port
/// name, a protocol the port cannot share, a server without its tls); across Gateways,
/// the translation merges as istiod does and skips what cannot be merged.
#[test]
fn servers_istiod_cannot_merge_on_one_port_are_skipped() {
    let yaml = gateway(
        r#"  - port: { number: 8080, name: http, protocol: HTTP }
    hosts: ["*"]
  - port: { number: 8080, name: https, protocol: HTTPS }
    hosts: ["x.example.com"]
    tls: { credentialName: c }
  - port: { number: 443, name: https, protocol: HTTPS }
    hosts: ["x.example.com"]
    tls: { credentialName: c }
  - port: { number: 443, name: https-z, protocol: HTTPS }
    hosts: ["x.example.com"]
    tls: { credentialName: c }
  - port: { number: 8443, name: https-8443, protocol: HTTPS }
    hosts: ["z.example.com"]
  - port: { number: 8443, name: https-simple, protocol: HTTPS }
    hosts: ["z.example.com"]
    tls: { mode: SIMPLE }
"#,
    ) + r#"---
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: { name: gw-2, namespace: istio-system }
spec:
  selector: { istio: ingressgateway }
  servers:
  - port: { number: 8080, name: tcp, protocol: TCP }
    hosts: ["*"]
  - port: { number: 443, name: https, protocol: HTTPS }
    hosts: ["x.example.com"]
    tls: { credentialName: c }
"# + SERVICES
        + &tls_secret("c", "x.example.com");
    let (out, bad) = run(&yaml);
    let reasons: Vec<&str> = bad.iter().map(String::as_str).collect();
    for want in [
        // The translation, merging gw-2 into what gw has on the ports.
        "Gateway 'istio-system/gw-2': spec.servers[0]: port 8080 already serves plaintext HTTP",
        "Gateway 'istio-system/gw-2': spec.servers[1]: port 443: duplicate host names [\"x.example.com\"]",
        // Validation, within gw.
        "Gateway 'istio-system/gw': spec.servers[1].port: port 8080 is plaintext HTTP in servers[0]; a HTTPS server cannot share it",
        "Gateway 'istio-system/gw': spec.servers[2].port.name: 'https' is the name of servers[1]'s port too",
        "Gateway 'istio-system/gw': spec.servers[4].tls: a HTTPS server needs tls settings",
        "Gateway 'istio-system/gw': spec.servers[5].tls.credentialName: SIMPLE needs a credentialName",
    ] {
        assert!(
            reasons.iter().any(|r| r.contains(want)),
            "no {want:?} in {reasons:#?}"
        );
    }
    assert_eq!(bad.len(), 6, "{bad:#?}");
    assert_eq!(
        out.listeners["0.0.0.0_443"]["filter_chains"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    assert_eq!(
        out.listeners["0.0.0.0_8080"]["filter_chains"][0]["filters"][0]["typed_config"]["rds"]
            ["route_config_name"],
        "http.8080"
    );
}

#[test]
fn tls_terminated_tcp_and_auto_passthrough_render_as_istiod() {
    let yaml = gateway(
        r#"  - port: { number: 9000, name: tls-db, protocol: TLS }
    hosts: ["db.example.com"]
    tls: { mode: SIMPLE, credentialName: db-cert }
  - port: { number: 15443, name: tls, protocol: TLS }
    hosts: ["*.default.svc.cluster.local"]
    tls: { mode: AUTO_PASSTHROUGH }
"#,
    ) + SERVICES
        + &tls_secret("db-cert", "db.example.com")
        + r#"---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: { name: db, namespace: default }
spec:
  hosts: ["db.example.com"]
  gateways: [istio-system/gw]
  tcp:
  - route: [{ destination: { host: db } }]
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: { name: a, namespace: default }
spec:
  host: a
  subsets: [{ name: v1, labels: { version: v1 } }]
"#;
    let (out, bad) = run(&yaml);
    assert!(bad.is_empty(), "{bad:?}");
    // TLS terminated, then proxied as TCP (Portico does not do this yet; Envoy does).
    let c = chain(&out, "0.0.0.0_9000", 0);
    assert_eq!(
        c["filter_chain_match"],
        json!({"server_names": ["db.example.com"]})
    );
    assert_eq!(
        c["transport_socket"]["typed_config"]["common_tls_context"]
            ["tls_certificate_sds_secret_configs"][0]["name"],
        "kubernetes://db-cert"
    );
    assert_eq!(
        c["filters"][0]["typed_config"]["cluster"],
        "outbound|27017||db.default.svc.cluster.local"
    );
    // AUTO_PASSTHROUGH: one chain per service port and subset, by the SNI of Istio mTLS.
    let chains = out.listeners["0.0.0.0_15443"]["filter_chains"]
        .as_array()
        .expect("chains");
    let snis: Vec<&str> = chains
        .iter()
        .filter_map(|c| c["filter_chain_match"]["server_names"][0].as_str())
        .collect();
    assert_eq!(
        snis,
        [
            "outbound_.443_._.a.default.svc.cluster.local",
            "outbound_.443_.v1_.a.default.svc.cluster.local",
            "outbound_.443_._.b.default.svc.cluster.local",
            "outbound_.27017_._.db.default.svc.cluster.local",
            "outbound_.9080_._.web.default.svc.cluster.local",
        ]
    );
    assert_eq!(
        chains[1]["filter_chain_match"]["application_protocols"],
        json!([
            "istio",
            "istio-peer-exchange",
            "istio-http/1.0",
            "istio-http/1.1",
            "istio-h2"
        ])
    );
    assert_eq!(
        chains[1]["filters"][0]["typed_config"]["cluster"],
        "outbound|443|v1|a.default.svc.cluster.local"
    );
}
