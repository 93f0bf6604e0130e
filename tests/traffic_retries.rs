//! Route retry policies against backends that misbehave on purpose: answer 503 or 409 a few
//! times, refuse connections, hang past the per-try timeout, or close without answering.
//! Every case runs against Envoy too (`PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh)`).

mod common;

use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::route::v3::{retry_policy, route, RetryPolicy};
use envoy_types::pb::google::protobuf::{Duration as PDuration, UInt32Value};

const HOST: &str = "retry.example.com";

fn policy(retry_on: &str, retries: u32) -> RetryPolicy {
    RetryPolicy {
        retry_on: retry_on.into(),
        num_retries: Some(UInt32Value { value: retries }),
        retry_back_off: Some(retry_policy::RetryBackOff {
            base_interval: Some(PDuration {
                seconds: 0,
                nanos: 1_000_000,
            }),
            max_interval: None,
        }),
        ..Default::default()
    }
}

/// A mesh with one route to `cluster` (endpoints `addrs`), retrying per `retry`.
async fn mesh(
    cluster: &str,
    addrs: &[std::net::SocketAddr],
    retry: Option<RetryPolicy>,
    attempt_count: bool,
) -> Mesh {
    let mesh = Mesh::start(|port| {
        let mut action = to_cluster(cluster);
        if let route::Action::Route(ra) = &mut action {
            ra.retry_policy = retry;
        }
        let mut vh = vhost("retry", &[HOST], vec![rt(prefix("/"), action)]);
        vh.include_request_attempt_count = attempt_count;
        Snapshot {
            routes: vec![route_config(&route_name(port), vec![vh])],
            clusters: vec![eds_cluster(cluster)],
            endpoints: vec![cla(cluster, addrs)],
            ..Default::default()
        }
    })
    .await;
    mesh
}

async fn ready(mesh: &Mesh) {
    eventually("route ready", PROPAGATION, || async {
        let r = mesh.get("/", HOST, &[]).await;
        if r.status == 404 || r.error.is_some() {
            Err(format!("{r:?}"))
        } else {
            Ok(())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istios_default_policy_retries_503_twice_with_attempt_counts() {
    let b = Scripted::start(
        "flaky",
        vec![Step::Status(503), Step::Status(503), Step::Status(200)],
    )
    .await;
    let mut p = policy(
        "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
        2,
    );
    p.retriable_status_codes = vec![503];
    let mesh = mesh("outbound|9080||flaky", &[b.addr], Some(p), true).await;
    ready(&mesh).await;
    b.reset();
    let (metric, label) = envoy_cluster_metric("outbound|9080||flaky", "upstream_rq_retry");
    let before = prom_value(
        &mesh.gw.prometheus().await,
        &metric,
        "envoy_cluster_name",
        &label,
    );
    let r = mesh.get("/x", HOST, &[]).await;
    assert_eq!((r.status, r.body.as_str()), (200, "flaky"), "{r:?}");
    assert_eq!(b.served(), 3);
    let attempts: Vec<Option<String>> = b
        .seen
        .lock()
        .expect("lock")
        .iter()
        .map(|(a, _)| a.clone())
        .collect();
    assert_eq!(
        attempts,
        [
            Some("1".to_string()),
            Some("2".to_string()),
            Some("3".to_string())
        ]
    );
    let after = prom_value(
        &mesh.gw.prometheus().await,
        &metric,
        "envoy_cluster_name",
        &label,
    );
    assert_eq!(after - before, 2.0, "{metric}: {before} -> {after}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_retries_pass_the_last_answer_through() {
    let b = Scripted::start("down", vec![Step::Status(503)]).await;
    let mesh = mesh("down", &[b.addr], Some(policy("5xx", 2)), false).await;
    ready(&mesh).await;
    b.reset();
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(
        (r.status, r.body.as_str(), r.backend()),
        (503, "down", Some("down"))
    );
    assert_eq!(b.served(), 3, "one try and two retries");
    let stats = mesh.gw.prometheus().await;
    let (metric, label) = envoy_cluster_metric("down", "upstream_rq_retry_limit_exceeded");
    assert!(
        prom_value(&stats, &metric, "envoy_cluster_name", &label) >= 1.0,
        "{metric}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_policy_no_retry_and_conditions_are_respected() {
    let b = Scripted::start("once", vec![Step::Status(503)]).await;
    let mesh = mesh("once", &[b.addr], None, false).await;
    ready(&mesh).await;
    b.reset();
    assert_eq!(mesh.get("/", HOST, &[]).await.status, 503);
    assert_eq!(b.served(), 1);

    // gateway-error does not cover 500; retriable-4xx covers 409 only.
    let c = Scripted::start("c", vec![Step::Status(500)]).await;
    let mesh = mesh_named(
        "c",
        &[c.addr],
        Some(policy("gateway-error,retriable-4xx", 3)),
    )
    .await;
    c.reset();
    assert_eq!(mesh.get("/", HOST, &[]).await.status, 500);
    assert_eq!(c.served(), 1);
    let d = Scripted::start("d", vec![Step::Status(409), Step::Status(200)]).await;
    let mesh = mesh_named("d", &[d.addr], Some(policy("retriable-4xx", 1))).await;
    d.reset();
    assert_eq!(mesh.get("/", HOST, &[]).await.status, 200);
    assert_eq!(d.served(), 2);
}

async fn mesh_named(cluster: &str, addrs: &[std::net::SocketAddr], p: Option<RetryPolicy>) -> Mesh {
    let m = mesh(cluster, addrs, p, false).await;
    ready(&m).await;
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_move_to_another_host() {
    let good = Scripted::start("good", vec![Step::Status(200)]).await;
    // A port with nothing listening: every connection is refused.
    let dead = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut p = policy("connect-failure", 3);
    p.retry_host_predicate = vec![retry_policy::RetryHostPredicate {
        name: "envoy.retry_host_predicates.previous_hosts".into(),
        config_type: Some(retry_policy::retry_host_predicate::ConfigType::TypedConfig(
            envoy_types::pb::google::protobuf::Any {
                type_url: "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate".into(),
                value: Vec::new(),
            },
        )),
    }];
    p.host_selection_retry_max_attempts = 5;
    let mesh = mesh_named("two", &[dead, good.addr], Some(p)).await;
    for _ in 0..20 {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!((r.status, r.backend()), (200, Some("good")), "{r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_try_timeout_retries_a_hung_attempt() {
    let b = Scripted::start(
        "slow",
        vec![Step::Hang(Duration::from_secs(3)), Step::Status(200)],
    )
    .await;
    let mut p = policy("5xx", 1);
    p.per_try_timeout = Some(PDuration {
        seconds: 0,
        nanos: 300_000_000,
    });
    let mesh = mesh("slow", &[b.addr], Some(p), false).await;
    mesh.wait_routes_untouched().await;
    let start = Instant::now();
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(b.served(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_connection_is_retried_under_5xx_with_the_body_resent() {
    let b = Scripted::start("closer", vec![Step::Close, Step::Status(200)]).await;
    let mesh = mesh("closer", &[b.addr], Some(policy("5xx", 1)), false).await;
    mesh.wait_routes_untouched().await;
    let r = send_request(
        &reqwest::Client::new(),
        "POST",
        &mesh.url("/submit"),
        Some(HOST),
        &[("content-type", "text/plain")],
        Some(b"order=42".to_vec()),
    )
    .await;
    assert_eq!(r.status, 200, "{r:?}");
    let seen = b.seen.lock().expect("lock").clone();
    assert_eq!(seen.len(), 2);
    assert!(seen.iter().all(|(_, body)| body == "order=42"), "{seen:?}");
}
