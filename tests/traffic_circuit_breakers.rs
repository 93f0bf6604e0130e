//! Cluster circuit breakers against a backend that holds every request: overflow answers 503
//! with `x-envoy-overloaded`, requests over `max_connections` wait while `max_pending_requests`
//! allows, and the overflows are counted. Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::{circuit_breakers, CircuitBreakers};
use envoy_types::pb::google::protobuf::UInt32Value;

const HOST: &str = "cb.example.com";
const OVERFLOW_BODY: &str =
    "upstream connect error or disconnect/reset before headers. reset reason: overflow";

async fn mesh(backend: &Scripted, cluster: &str, limits: circuit_breakers::Thresholds) -> Mesh {
    let mesh = Mesh::start(|port| {
        let mut c = eds_cluster(cluster);
        c.circuit_breakers = Some(CircuitBreakers {
            thresholds: vec![limits],
            ..Default::default()
        });
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "cb",
                    &[HOST],
                    vec![rt(prefix("/"), to_cluster(cluster))],
                )],
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

fn limit(v: u32) -> Option<UInt32Value> {
    Some(UInt32Value { value: v })
}

async fn concurrently(mesh: &Mesh, n: usize, gap: Duration) -> Vec<(Resp, Duration)> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..n {
        let url = mesh.url("/");
        tokio::time::sleep(if i == 0 { Duration::ZERO } else { gap }).await;
        tasks.push(tokio::spawn(async move {
            let r = get(&url, Some(HOST), &[]).await;
            (r, start.elapsed())
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("request task"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_requests_overflow_answers_503_overloaded() {
    let slow = Scripted::start("slow", vec![Step::Hang(Duration::from_millis(800))]).await;
    let mesh = mesh(
        &slow,
        "limited",
        circuit_breakers::Thresholds {
            max_requests: limit(1),
            ..Default::default()
        },
    )
    .await;
    let out = concurrently(&mesh, 2, Duration::from_millis(200)).await;
    assert_eq!(out[0].0.status, 200, "{:?}", out[0]);
    let r = &out[1].0;
    assert_eq!(
        (r.status, r.header("x-envoy-overloaded"), r.body.as_str()),
        (503, Some("true"), OVERFLOW_BODY),
        "{r:?}"
    );
    assert!(
        out[1].1 < Duration::from_millis(700),
        "overflow is immediate"
    );
    // Envoy counts a max_requests overflow as upstream_rq_active_overflow, and the request
    // never becomes an upstream request.
    let stats = mesh.gw.prometheus().await;
    for (stat, want) in [
        ("upstream_rq_active_overflow", 1.0),
        ("upstream_rq_total", 1.0),
    ] {
        let (metric, label) = envoy_cluster_metric("limited", stat);
        assert_eq!(
            prom_value(&stats, &metric, "envoy_cluster_name", &label),
            want,
            "{stat}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_max_connections_wait_until_pending_overflows() {
    let slow = Scripted::start("slow", vec![Step::Hang(Duration::from_millis(600))]).await;
    let mesh = mesh(
        &slow,
        "one-conn",
        circuit_breakers::Thresholds {
            max_connections: limit(1),
            max_pending_requests: limit(1),
            ..Default::default()
        },
    )
    .await;
    let out = concurrently(&mesh, 3, Duration::from_millis(100)).await;
    let statuses: Vec<u16> = out.iter().map(|(r, _)| r.status).collect();
    assert_eq!(statuses, [200, 200, 503], "{out:?}");
    // The second waited for the first's connection.
    assert!(out[1].1 >= Duration::from_millis(1100), "{:?}", out[1].1);
    assert_eq!(out[2].0.header("x-envoy-overloaded"), Some("true"));
    assert!(out[2].1 < Duration::from_millis(500), "{:?}", out[2].1);
    let stats = mesh.gw.prometheus().await;
    let (metric, label) = envoy_cluster_metric("one-conn", "upstream_rq_pending_overflow");
    assert_eq!(
        prom_value(&stats, &metric, "envoy_cluster_name", &label),
        1.0
    );
}
