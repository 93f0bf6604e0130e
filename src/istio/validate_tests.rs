//! Validation of objects no gateway selects, as istio's webhook validates them.

use super::*;
use crate::istio::model::parse_file;

fn checked(yaml: &str) -> Checked {
    let (objects, bad) = parse_file("t.yaml", yaml);
    assert!(bad.is_empty(), "{bad:?}");
    let config = Config {
        files: vec!["t.yaml".into(); objects.len()],
        objects,
    };
    check(&config, &Options::default())
}

/// The reasons reported, one string per report.
fn reasons(yaml: &str) -> Vec<String> {
    checked(yaml)
        .reports
        .iter()
        .map(|r| format!("{} {}: {}", r.kind, r.name, r.reason))
        .collect()
}

fn vs(http: &str) -> String {
    format!(
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {{ name: v, namespace: shop }}\nspec:\n  hosts: [web.example.com]\n  gateways: [other/gw]\n  http:\n{http}"
    )
}

#[test]
fn a_valid_virtual_service_passes() {
    let r = reasons(&vs(
        "  - match: [{ uri: { prefix: /a } }]\n    route:\n    - { destination: { host: web, subset: v1 }, weight: 30 }\n    - { destination: { host: web, subset: v2 }, weight: 40 }\n    timeout: 1.5s\n    retries: { attempts: 2, perTryTimeout: 100ms }\n",
    ));
    assert!(r.is_empty(), "{r:?}");
}

#[test]
fn route_errors_are_found_in_objects_no_gateway_binds() {
    for (http, want) in [
        (
            "  - match: [{ uri: { regex: \"(\" } }]\n    route: [{ destination: { host: web } }]\n",
            "spec.http[0].match[0].uri.regex: invalid regex '('",
        ),
        (
            "  - route:\n    - { destination: { host: web, subset: v1 } }\n    - { destination: { host: web, subset: v2 } }\n",
            "spec.http[0].route: with several destinations, weights are required and must not all be 0",
        ),
        (
            "  - route: [{ destination: { host: \"\" } }]\n",
            "spec.http[0].route[0].destination.host is required",
        ),
        (
            "  - route: [{ destination: { host: web, subset: V_1 } }]\n",
            "spec.http[0].route[0].destination.subset: 'V_1' is not a valid subset name",
        ),
        (
            "  - route: [{ destination: { host: web, port: { number: 70000 } } }]\n",
            "spec.http[0].route[0].destination.port.number: port number 70000",
        ),
        (
            "  - route: [{ destination: { host: web } }]\n    timeout: soon\n",
            "spec.http[0].timeout: invalid duration 'soon'",
        ),
        (
            "  - route: [{ destination: { host: web } }]\n    timeout: 0.5ms\n",
            "spec.http[0].timeout: '0.5ms': only durations to ms precision",
        ),
        (
            "  - route: [{ destination: { host: web } }]\n    retries: { attempts: 0, perTryTimeout: 1s }\n",
            "spec.http[0].retries: a retry policy is configured while attempts is 0",
        ),
        (
            "  - route: [{ destination: { host: web } }]\n    retries: { attempts: -1 }\n",
            "spec.http[0].retries.attempts: -1 is negative",
        ),
        (
            "  - route: [{ destination: { host: web } }]\n    retries: { attempts: 2, perTryTimeout: 0s }\n",
            "spec.http[0].retries.perTryTimeout: '0s': a duration must be at least 1ms",
        ),
        (
            "  - route: [{ destination: { host: \"*\" } }]\n",
            "spec.http[0].route[0].destination.host: '*' is not a destination",
        ),
        (
            "  - match: [{ port: 0, uri: { prefix: / } }, { port: 99999 }]\n    route: [{ destination: { host: web } }]\n",
            "spec.http[0].match[1].port: port number 99999",
        ),
    ] {
        let r = reasons(&vs(http));
        assert_eq!(r.len(), 1, "{http}: {r:?}");
        assert!(
            r[0].starts_with(&format!("VirtualService shop/v: {want}")),
            "{http}: want {want:?}, got {r:?}"
        );
    }
}

#[test]
fn hosts_and_gateway_names_are_checked() {
    let bad_host = vs("  - route: [{ destination: { host: web } }]\n").replace(
        "[web.example.com]",
        "[\"web..example.com\", Web.example.com]",
    );
    let r = reasons(&bad_host);
    assert!(
        r[0].contains("spec.hosts[0]: domain name 'web..example.com' invalid"),
        "{r:?}"
    );
    assert!(r[0].contains("spec.hosts[1]"), "{r:?}");
    let dup = vs("  - route: [{ destination: { host: web } }]\n")
        .replace("[web.example.com]", "[\"*.example.com\", web.example.com]");
    assert!(
        reasons(&dup)[0].contains("duplicate hosts"),
        "{:?}",
        reasons(&dup)
    );
    let gw = vs("  - route: [{ destination: { host: web } }]\n").replace("other/gw", "Other/gw");
    assert!(reasons(&gw)[0].contains("spec.gateways[0]: invalid namespace 'Other'"));
    let empty = vs("").replace("  http:\n", "");
    assert!(reasons(&empty)[0].contains("one of http, tcp, tls is required"));
}

#[test]
fn tls_and_tcp_routes_are_checked() {
    let yaml = "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: { name: t }\nspec:\n  hosts: [\"*.example.com\"]\n  gateways: [gw]\n  tls:\n  - match: [{ sniHosts: [a.other.org] }]\n    route: [{ destination: { host: a } }]\n  tcp:\n  - route: []\n";
    let r = reasons(yaml);
    assert_eq!(r.len(), 1);
    assert!(
        r[0].contains("spec.tls[0].match[0].sniHosts[0]: 'a.other.org' is not within"),
        "{r:?}"
    );
    assert!(
        r[0].contains("spec.tcp[0].route: at least one destination"),
        "{r:?}"
    );
}

const GATEWAY: &str = "apiVersion: networking.istio.io/v1\nkind: Gateway\nmetadata: { name: g, namespace: edge }\nspec:\n  selector: { istio: other }\n  servers:\n";

#[test]
fn a_bad_gateway_server_is_left_out_alone() {
    let yaml = format!(
        "{GATEWAY}  - port: {{ number: 80, name: http, protocol: HTTP }}\n    hosts: [\"*\"]\n  - port: {{ number: 81, name: web, protocol: SCTP }}\n    hosts: [web]\n  - port: {{ number: 80, name: tcp, protocol: TCP }}\n    hosts: [\"*\"]\n  - port: {{ number: 82, name: http, protocol: HTTP }}\n    hosts: [\"ns/*.example.com\"]\n  - port: {{ number: 443, name: https, protocol: HTTPS }}\n    hosts: [\"*\"]\n"
    );
    let c = checked(&yaml);
    assert!(c.skip.is_empty(), "the Gateway stays");
    assert_eq!(
        c.skip_servers,
        [(0, 1), (0, 2), (0, 3), (0, 4)].into(),
        "{:#?}",
        c.reports
    );
    let r: Vec<&str> = c.reports.iter().map(|r| r.reason.as_str()).collect();
    assert!(
        r[0].starts_with("spec.servers[1].port.protocol: unknown protocol 'SCTP'"),
        "{r:?}"
    );
    assert!(
        r[0].contains("spec.servers[1].hosts[0]: 'web': short names"),
        "{r:?}"
    );
    assert!(r[1].contains("spec.servers[2].port: port 80 is plaintext HTTP in servers[0]; a TCP server cannot share it"), "{r:?}");
    assert!(
        r[2].contains("spec.servers[3].port.name: 'http' is the name of servers[0]'s port too"),
        "{r:?}"
    );
    assert!(
        r[3].contains("spec.servers[4].tls: a HTTPS server needs tls settings"),
        "{r:?}"
    );
    assert_eq!(c.reports[0].file, "t.yaml");
    assert_eq!(
        (c.reports[0].kind.as_str(), c.reports[0].name.as_str()),
        ("Gateway", "edge/g")
    );
}

#[test]
fn destination_rules_and_service_entries_are_checked() {
    let dr = "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: { name: d }\nspec:\n  host: web\n  trafficPolicy:\n    loadBalancer: { simple: FASTEST }\n    connectionPool: { tcp: { connectTimeout: 0s } }\n  subsets:\n  - { name: v1, labels: { version: v1 } }\n  - { name: v1 }\n  - { name: Version_2 }\n";
    let r = reasons(dr);
    assert_eq!(r.len(), 1);
    for want in [
        "trafficPolicy.loadBalancer.simple: unknown value 'FASTEST'",
        "trafficPolicy.connectionPool.tcp.connectTimeout: '0s': a duration must be at least 1ms",
        "subsets[1].name: duplicate subset name 'v1'",
        "subsets[2].name: 'Version_2' is not a valid subset name",
    ] {
        assert!(r[0].contains(want), "{want}: {r:?}");
    }
    let se = "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: { name: s }\nspec:\n  hosts: [api.example.com]\n  resolution: STATIC\n  ports: [{ number: 443, name: https, protocol: TLS }, { number: 443, name: tls }]\n  endpoints: [{ address: api.example.com, ports: { grpc: 8443 } }]\n";
    let r = reasons(se);
    for want in [
        "spec.ports[1].number: port 443 is defined twice",
        "spec.endpoints[0].address: 'api.example.com' is not a valid address for resolution STATIC",
        "spec.endpoints[0].ports.grpc: no port of the ServiceEntry is named 'grpc'",
    ] {
        assert!(r[0].contains(want), "{want}: {r:?}");
    }
}

#[test]
fn reports_follow_the_translation_order_of_kinds() {
    let yaml = format!(
        "{}\n---\n{GATEWAY}  - port: {{ number: 1, name: x, protocol: SCTP }}\n    hosts: [\"*\"]\n---\napiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {{ name: d }}\nspec: {{ host: \"\" }}\n",
        vs("  - route: [{ destination: { host: \"*\" } }]\n")
    );
    let kinds: Vec<String> = checked(&yaml)
        .reports
        .iter()
        .map(|r| r.kind.clone())
        .collect();
    assert_eq!(kinds, ["DestinationRule", "Gateway", "VirtualService"]);
}

#[test]
fn names_are_dns_labels_and_wildcard_domains() {
    assert!(is_dns_label("v1") && is_dns_label("a-b") && !is_dns_label("-a") && !is_dns_label("A"));
    assert!(wildcard_domain("*").is_ok() && wildcard_domain("*.a.b").is_ok());
    assert!(wildcard_domain("reviews").is_ok() && wildcard_domain("a.b.").is_ok());
    assert!(wildcard_domain("a.*.b").is_err() && wildcard_domain("a.123").is_err());
    assert!(gateway_host("./a.b").is_ok() && gateway_host("10.0.0.1").is_ok());
    assert!(gateway_host("a").is_err() && gateway_host("*a.b").is_err());
    assert!(is_prime(65537) && !is_prime(65536) && is_prime(2));
}
