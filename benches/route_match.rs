//! Route matching cost with 10 and 10,000 prefix routes (first and last match).
//! `cargo bench --bench route_match`. The comparison against Envoy under load is separate.

use std::hint::black_box;
use std::time::Instant;

use envoy_types::pb::envoy::config::route::v3::{
    route, route_action, route_match, Route, RouteAction, RouteConfiguration, RouteMatch,
    VirtualHost,
};
use portico::router::{route as pick, RequestView};
use portico::snapshot::route::RouteTable;

fn table(n: usize) -> RouteTable {
    let routes = (0..n)
        .map(|i| Route {
            r#match: Some(RouteMatch {
                path_specifier: Some(route_match::PathSpecifier::Prefix(format!("/svc{i}/"))),
                ..Default::default()
            }),
            action: Some(route::Action::Route(RouteAction {
                cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(format!("c{i}"))),
                ..Default::default()
            })),
            ..Default::default()
        })
        .collect();
    let rc = RouteConfiguration {
        name: "bench".into(),
        virtual_hosts: vec![VirtualHost {
            name: "vh".into(),
            domains: vec!["*".into()],
            routes,
            ..Default::default()
        }],
        ..Default::default()
    };
    match RouteTable::translate(&rc) {
        Ok(t) => t,
        Err(e) => panic!("bench route table is invalid: {e}"),
    }
}

fn main() {
    let headers = http::HeaderMap::new();
    for n in [10usize, 10_000] {
        let t = table(n);
        for (label, path) in [
            ("first", "/svc0/x".to_string()),
            ("last", format!("/svc{}/x", n - 1)),
        ] {
            let view = RequestView {
                host: "example.com",
                authority: "example.com",
                path: &path,
                method: "GET",
                scheme: "http",
                headers: &headers,
            };
            let iters = if n > 1000 && label == "last" {
                2_000
            } else {
                200_000
            };
            let start = Instant::now();
            for _ in 0..iters {
                black_box(pick(black_box(&t), black_box(&view)));
            }
            let per = start.elapsed().as_nanos() as f64 / iters as f64;
            println!("route_match routes={n:>6} match={label:<5} {per:>10.1} ns/request");
        }
    }
}
