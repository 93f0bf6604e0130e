//! Route match plus endpoint pick, plain against every traffic policy configured on the route
//! and cluster (retries, custom headers at two levels, fault and CORS per-filter configs, a
//! mirror, a header hash policy on a ring-hash cluster): `cargo bench --bench policy_path`.
//! The policies are resolved when the snapshot is built, so the request path should cost about
//! the same; the difference is the hash of one header.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster as ClusterPb};
use envoy_types::pb::envoy::config::core::v3::{
    address, socket_address, Address, HeaderValue, HeaderValueOption, RuntimeFractionalPercent,
    SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::route::v3::{
    retry_policy, route, route_action, route_match, RetryPolicy, Route, RouteAction,
    RouteConfiguration, RouteMatch, VirtualHost,
};
use envoy_types::pb::envoy::extensions::filters::http::cors::v3::CorsPolicy;
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault;
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher::MatchPattern, StringMatcher};
use envoy_types::pb::envoy::r#type::v3::{fractional_percent::DenominatorType, FractionalPercent};
use envoy_types::pb::google::protobuf::{Any, UInt32Value};
use portico::admin::stats::ClusterStats;
use portico::lb::hash_policy::{self, HashInput};
use portico::router::{route as pick_route, RequestView};
use portico::snapshot::cluster::{Cluster, ClusterDef, LoadAssignment};
use portico::snapshot::route::{Action, RouteTable};
use prost::{Message, Name};

const ROUTES: usize = 10;

fn any<M: Message + Name>(m: M) -> Any {
    Any {
        type_url: M::type_url(),
        value: m.encode_to_vec(),
    }
}

fn header(k: &str, v: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: k.into(),
            value: v.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn table(policies: bool) -> RouteTable {
    let routes = (0..ROUTES)
        .map(|i| {
            let mut ra = RouteAction {
                cluster_specifier: Some(route_action::ClusterSpecifier::Cluster("c".into())),
                ..Default::default()
            };
            let mut r = Route {
                r#match: Some(RouteMatch {
                    path_specifier: Some(route_match::PathSpecifier::Prefix(format!("/svc{i}/"))),
                    ..Default::default()
                }),
                ..Default::default()
            };
            if policies {
                ra.retry_policy = Some(RetryPolicy {
                    retry_on: "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes".into(),
                    num_retries: Some(UInt32Value { value: 2 }),
                    retriable_status_codes: vec![503],
                    retry_host_predicate: vec![retry_policy::RetryHostPredicate {
                        name: "envoy.retry_host_predicates.previous_hosts".into(),
                        config_type: Some(retry_policy::retry_host_predicate::ConfigType::TypedConfig(Any {
                            type_url: "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate".into(),
                            value: Vec::new(),
                        })),
                    }],
                    host_selection_retry_max_attempts: 5,
                    ..Default::default()
                });
                ra.request_mirror_policies = vec![route_action::RequestMirrorPolicy {
                    cluster: "c".into(),
                    runtime_fraction: Some(RuntimeFractionalPercent {
                        default_value: Some(FractionalPercent {
                            numerator: 0,
                            denominator: DenominatorType::Hundred as i32,
                        }),
                        runtime_key: String::new(),
                    }),
                    ..Default::default()
                }];
                ra.hash_policy = vec![route_action::HashPolicy {
                    policy_specifier: Some(route_action::hash_policy::PolicySpecifier::Header(
                        route_action::hash_policy::Header {
                            header_name: "x-user".into(),
                            ..Default::default()
                        },
                    )),
                    ..Default::default()
                }];
                r.request_headers_to_add = vec![header("x-route", "r")];
                r.response_headers_to_add = vec![header("x-served-by", "portico")];
                r.typed_per_filter_config
                    .insert("envoy.filters.http.fault".into(), any(HttpFault::default()));
                r.typed_per_filter_config.insert(
                    "envoy.filters.http.cors".into(),
                    any(CorsPolicy {
                        allow_origin_string_match: vec![StringMatcher {
                            match_pattern: Some(MatchPattern::Exact("https://a.example".into())),
                            ..Default::default()
                        }],
                        ..Default::default()
                    }),
                );
            }
            r.action = Some(route::Action::Route(ra));
            r
        })
        .collect();
    let mut vh = VirtualHost {
        name: "vh".into(),
        domains: vec!["*".into()],
        routes,
        ..Default::default()
    };
    if policies {
        vh.request_headers_to_add = vec![header("x-vhost", "v")];
    }
    let rc = RouteConfiguration {
        name: "bench".into(),
        virtual_hosts: vec![vh],
        ..Default::default()
    };
    match RouteTable::translate(&rc) {
        Ok(t) => t,
        Err(e) => panic!("bench route table is invalid: {e}"),
    }
}

fn cluster(policies: bool) -> Cluster {
    let mut c = ClusterPb {
        name: "c".into(),
        cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
            cluster::DiscoveryType::Static as i32,
        )),
        ..Default::default()
    };
    if policies {
        c.lb_policy = cluster::LbPolicy::RingHash as i32;
    }
    let def = match ClusterDef::translate(&c, &portico::snapshot::sources::NoFiles) {
        Ok(d) => d,
        Err(e) => panic!("bench cluster is invalid: {e}"),
    };
    let endpoints = (0..10)
        .map(|i| LbEndpoint {
            host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                address: Some(Address {
                    address: Some(address::Address::SocketAddress(SocketAddress {
                        address: format!("10.0.0.{}", i + 1),
                        port_specifier: Some(socket_address::PortSpecifier::PortValue(8080)),
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            })),
            ..Default::default()
        })
        .collect();
    let cla = ClusterLoadAssignment {
        cluster_name: "c".into(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints: endpoints,
            ..Default::default()
        }],
        ..Default::default()
    };
    let la = match LoadAssignment::translate(&cla) {
        Ok(l) => l,
        Err(e) => panic!("bench endpoints are invalid: {e}"),
    };
    Cluster::new(
        Arc::new(def),
        Arc::new(la),
        Arc::new(ClusterStats::default()),
    )
}

fn policy_path(c: &mut Criterion) {
    let mut headers = http::HeaderMap::new();
    headers.insert("x-user", http::HeaderValue::from_static("user-42"));
    let path = format!("/svc{}/x", ROUTES - 1);
    let view = RequestView {
        host: "example.com",
        authority: "example.com",
        path: &path,
        method: "GET",
        scheme: "http",
        headers: &headers,
    };
    let mut group = c.benchmark_group("policy_path");
    for (label, policies) in [("plain", false), ("all_policies", true)] {
        let t = table(policies);
        let cl = cluster(policies);
        let run = || {
            let (_, r) = pick_route(black_box(&t), black_box(&view))?;
            let Action::Forward(f) = &r.action else {
                return None;
            };
            let hash = if cl.hashes() {
                let input = HashInput {
                    headers: &headers,
                    authority: view.authority,
                    path: view.path,
                    method: view.method,
                    scheme: view.scheme,
                    source_ip: None,
                };
                hash_policy::generate(&f.hash_policy, &input, |_| String::new())
            } else {
                None
            };
            cl.pick_hashed(hash)
        };
        assert!(run().is_some(), "{label}: the request must reach a host");
        group.bench_function(label, |b| b.iter(run));
    }
    group.finish();
}

criterion_group!(benches, policy_path);
criterion_main!(benches);
