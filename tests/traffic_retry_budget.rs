//! A circuit breaker's `retry_budget` (istiod renders DestinationRule `retryBudget` so)
//! replaces `max_retries`: with `max_retries: 0` no retry passes, with a budget whose floor
//! (`min_retry_concurrency`) is 1 the retries go on. Runs against Envoy too
//! (PORTICO_GATEWAY_BIN).

mod common;

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::{circuit_breakers, CircuitBreakers};
use envoy_types::pb::envoy::config::route::v3::{retry_policy, route, RetryPolicy};
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::google::protobuf::{Duration as PDuration, UInt32Value};

const HOST: &str = "budget.example.com";

async fn mesh(cluster: &str, backend: &Scripted, budget: bool) -> Mesh {
    let mesh = Mesh::start(|port| {
        let mut action = to_cluster(cluster);
        if let route::Action::Route(ra) = &mut action {
            ra.retry_policy = Some(RetryPolicy {
                retry_on: "5xx".into(),
                num_retries: Some(UInt32Value { value: 2 }),
                retry_back_off: Some(retry_policy::RetryBackOff {
                    base_interval: Some(PDuration {
                        seconds: 0,
                        nanos: 1_000_000,
                    }),
                    max_interval: None,
                }),
                ..Default::default()
            });
        }
        let mut c = eds_cluster(cluster);
        c.circuit_breakers = Some(CircuitBreakers {
            thresholds: vec![circuit_breakers::Thresholds {
                max_retries: Some(UInt32Value { value: 0 }),
                retry_budget: budget.then(|| circuit_breakers::thresholds::RetryBudget {
                    budget_percent: Some(Percent { value: 0.0 }),
                    min_retry_concurrency: Some(UInt32Value { value: 1 }),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        });
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost("budget", &[HOST], vec![rt(prefix("/"), action)])],
            )],
            clusters: vec![c],
            endpoints: vec![cla(cluster, &[backend.addr])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_routes_untouched().await;
    mesh
}

async fn overflows(mesh: &Mesh, cluster: &str) -> f64 {
    let (metric, label) = envoy_cluster_metric(cluster, "upstream_rq_retry_overflow");
    prom_value(
        &mesh.gw.prometheus().await,
        &metric,
        "envoy_cluster_name",
        &label,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_retries_zero_allows_no_retry() {
    let b = Scripted::start("down", vec![Step::Status(503)]).await;
    let mesh = mesh("no-budget", &b, false).await;
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(b.served(), 1, "the retry overflowed");
    assert_eq!(overflows(&mesh, "no-budget").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_budget_replaces_max_retries() {
    let b = Scripted::start("down", vec![Step::Status(503)]).await;
    let mesh = mesh("budget", &b, true).await;
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(b.served(), 3, "the first try and both retries");
    assert_eq!(overflows(&mesh, "budget").await, 0.0);
}
