//! Route match time, 10 and 10,000 prefix routes, first/last: `cargo bench --bench route_match`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
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

fn route_match(c: &mut Criterion) {
    let headers = http::HeaderMap::new();
    for n in [10usize, 10_000] {
        let t = table(n);
        let mut group = c.benchmark_group(format!("route_match/{n}"));
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
            assert!(pick(&t, &view).is_some(), "{path} must match a route");
            group.bench_function(label, |b| b.iter(|| pick(black_box(&t), black_box(&view))));
        }
        group.finish();
    }
}

criterion_group!(benches, route_match);
criterion_main!(benches);
