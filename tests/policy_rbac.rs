//! `envoy.filters.http.rbac` and `envoy.filters.network.rbac` as Envoy enforces them: path,
//! method and header rules, ALLOW and DENY, `remote_ip` through trusted `x-forwarded-for`
//! hops against `direct_remote_ip`, shadow rules counted and never enforced, a route turning
//! the filter off, and a TCP chain closing a denied connection. Runs against Envoy too:
//! `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test policy_rbac`.

mod common;

use common::*;
use envoy_types::pb::envoy::config::core::v3::CidrRange;
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, FilterChain, Listener};
use envoy_types::pb::envoy::config::rbac::v3::{
    permission, principal, Permission, Policy, Principal, Rbac as Rules,
};
use envoy_types::pb::envoy::config::route::v3::{header_matcher, HeaderMatcher};
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::{Rbac, RbacPerRoute};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as NetworkRbac;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    tcp_proxy::ClusterSpecifier, TcpProxy,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    path_matcher, string_matcher, PathMatcher, StringMatcher,
};
use envoy_types::pb::google::protobuf::UInt32Value;

const HOST: &str = "example.com";

fn prefix_path(p: &str) -> Permission {
    Permission {
        rule: Some(permission::Rule::UrlPath(PathMatcher {
            rule: Some(path_matcher::Rule::Path(StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::Prefix(p.into())),
                ..Default::default()
            })),
        })),
    }
}

fn header_is(name: &str, value: &str) -> HeaderMatcher {
    HeaderMatcher {
        name: name.into(),
        header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::StringMatch(
            StringMatcher {
                match_pattern: Some(string_matcher::MatchPattern::Exact(value.into())),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

fn any_principal() -> Principal {
    Principal {
        identifier: Some(principal::Identifier::Any(true)),
    }
}

fn any_permission() -> Permission {
    Permission {
        rule: Some(permission::Rule::Any(true)),
    }
}

fn cidr(ip: &str, len: u32) -> CidrRange {
    CidrRange {
        address_prefix: ip.into(),
        prefix_len: Some(UInt32Value { value: len }),
    }
}

fn rules(action: i32, policies: Vec<(&str, Policy)>) -> Rules {
    Rules {
        action,
        policies: policies
            .into_iter()
            .map(|(n, p)| (n.to_string(), p))
            .collect(),
        ..Default::default()
    }
}

fn policy(permissions: Vec<Permission>, principals: Vec<Principal>) -> Policy {
    Policy {
        permissions,
        principals,
        ..Default::default()
    }
}

fn rbac_filter(name: &str, r: Rbac) -> HttpFilter {
    HttpFilter {
        name: name.into(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(r))),
        ..Default::default()
    }
}

async fn stat(mesh: &Mesh, name: &str) -> u64 {
    let body = mesh
        .gw
        .admin_get(&format!("/stats?filter=^{}$", name.replace('.', "\\.")))
        .await
        .body;
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_rbac_allows_denies_shadows_and_routes_can_opt_out() {
    let web = Backend::start("web").await;
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.use_remote_address = Some(envoy_types::pb::google::protobuf::BoolValue { value: true });
        h.xff_num_trusted_hops = 1;
        // DENY /admin to everyone; shadow-DENY /shadowed (counted, not enforced).
        let deny = Rbac {
            rules: Some(rules(
                1,
                vec![(
                    "no-admin",
                    policy(vec![prefix_path("/admin")], vec![any_principal()]),
                )],
            )),
            shadow_rules: Some(rules(
                1,
                vec![(
                    "shadow-deny",
                    policy(vec![prefix_path("/shadowed")], vec![any_principal()]),
                )],
            )),
            shadow_rules_stat_prefix: "istio_dry_run_deny_".into(),
            ..Default::default()
        };
        // ALLOW: GET with x-role: admin, or from the office (the trusted client address).
        let allow = Rbac {
            rules: Some(rules(
                0,
                vec![
                    (
                        "role",
                        policy(
                            vec![Permission {
                                rule: Some(permission::Rule::Header(header_is(":method", "GET"))),
                            }],
                            vec![Principal {
                                identifier: Some(principal::Identifier::Header(header_is(
                                    "x-role", "admin",
                                ))),
                            }],
                        ),
                    ),
                    (
                        "office",
                        policy(
                            vec![any_permission()],
                            vec![Principal {
                                identifier: Some(principal::Identifier::RemoteIp(cidr(
                                    "10.0.0.0", 8,
                                ))),
                            }],
                        ),
                    ),
                ],
            )),
            ..Default::default()
        };
        let router = h.http_filters.pop().expect("router");
        h.http_filters = vec![
            rbac_filter("deny", deny),
            rbac_filter("allow", allow),
            router,
        ];
        let mut open = rt(prefix("/open"), to_cluster("web"));
        open.typed_per_filter_config
            .insert("allow".into(), any(RbacPerRoute { rbac: None }));
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "all",
                    &["*"],
                    vec![open, rt(prefix("/"), to_cluster("web"))],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[("web", &web)])
    })
    .await;
    let get = |path: &'static str, headers: Vec<(&'static str, &'static str)>| {
        let m = &mesh;
        async move { m.get(path, HOST, &headers).await }
    };
    eventually(
        "the listener",
        std::time::Duration::from_secs(15),
        || async {
            let r = get("/x", vec![("x-role", "admin")]).await;
            (r.status == 200)
                .then_some(())
                .ok_or(format!("{} {:?}", r.status, r.error))
        },
    )
    .await;

    let r = get("/x", vec![]).await;
    assert_eq!((r.status, r.body.as_str()), (403, "RBAC: access denied"));
    assert_eq!(
        get("/x", vec![("x-role", "admin")]).await.backend(),
        Some("web")
    );
    // The DENY filter runs first, whatever the ALLOW one would say.
    assert_eq!(get("/admin/x", vec![("x-role", "admin")]).await.status, 403);
    // remote_ip: the trusted client from x-forwarded-for (one trusted hop), not the peer.
    assert_eq!(
        get("/x", vec![("x-forwarded-for", "10.1.2.3")])
            .await
            .status,
        200
    );
    assert_eq!(
        get("/x", vec![("x-forwarded-for", "11.1.2.3")])
            .await
            .status,
        403
    );
    // Shadow rules are evaluated, never enforced.
    assert_eq!(
        get("/shadowed", vec![("x-role", "admin")]).await.status,
        200
    );
    // A route may turn a filter off (RBACPerRoute without rules); the DENY filter still runs.
    assert_eq!(get("/open", vec![]).await.status, 200);

    let p = format!("http.outbound_0.0.0.0_{}.rbac.", mesh.port);
    // Envoy's names: the shadow prefix joined with a dot; one counter per name, shared by the
    // connection manager's RBAC filters. Three refusals: /x, /admin/x, the untrusted client.
    assert_eq!(
        stat(&mesh, &format!("{p}istio_dry_run_deny_.shadow_denied")).await,
        1
    );
    assert_eq!(stat(&mesh, &format!("{p}denied")).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_rbac_closes_a_denied_connection() {
    let web = Backend::start("web").await;
    let (open_port, closed_port) = (free_port(), free_port());
    let chain = |deny_ip: &str| {
        let r = NetworkRbac {
            stat_prefix: "tcp.".into(),
            rules: Some(rules(
                1,
                vec![(
                    "blocked",
                    policy(
                        vec![any_permission()],
                        vec![Principal {
                            identifier: Some(principal::Identifier::DirectRemoteIp(cidr(
                                deny_ip, 32,
                            ))),
                        }],
                    ),
                )],
            )),
            ..Default::default()
        };
        FilterChain {
            filters: vec![
                Filter {
                    name: "envoy.filters.network.rbac".into(),
                    config_type: Some(filter::ConfigType::TypedConfig(any(r))),
                },
                Filter {
                    name: "envoy.filters.network.tcp_proxy".into(),
                    config_type: Some(filter::ConfigType::TypedConfig(any(TcpProxy {
                        stat_prefix: "web".into(),
                        cluster_specifier: Some(ClusterSpecifier::Cluster("web".into())),
                        ..Default::default()
                    }))),
                },
            ],
            ..Default::default()
        }
    };
    let listener = |port: u16, deny_ip: &str| Listener {
        name: format!("tcp_{port}"),
        address: Some(socket_addr("127.0.0.1", port)),
        filter_chains: vec![chain(deny_ip)],
        ..Default::default()
    };
    let mesh = Mesh::start_raw(|_| {
        Snapshot {
            listeners: vec![
                listener(open_port, "192.0.2.1"),
                listener(closed_port, "127.0.0.1"),
            ],
            ..Default::default()
        }
        .with_backends(&[("web", &web)])
    })
    .await;
    let req = b"GET / HTTP/1.1\r\nhost: example.com\r\nconnection: close\r\n\r\n";
    eventually(
        "the open listener",
        std::time::Duration::from_secs(15),
        || async {
            let r = raw_http1(open_port, req, false).await;
            (r.status == 200)
                .then_some(())
                .ok_or(format!("{} {}", r.status, r.body_str()))
        },
    )
    .await;
    let r = raw_http1(closed_port, req, false).await;
    assert_eq!(r.status, 0, "closed without an answer: {}", r.body_str());
    assert!(stat(&mesh, "tcp.rbac.denied").await >= 1);
    assert!(stat(&mesh, "tcp.rbac.allowed").await >= 1);
}
