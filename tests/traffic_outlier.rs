//! Outlier detection against a backend that always fails: after `consecutive_5xx` errors in a
//! row it is ejected and traffic goes to the healthy one, then it comes back after its
//! ejection time. Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::OutlierDetection;
use envoy_types::pb::google::protobuf::{Duration as PDuration, UInt32Value};

const HOST: &str = "outlier.example.com";

fn ms(n: i64) -> Option<PDuration> {
    Some(PDuration {
        seconds: n / 1000,
        nanos: (n % 1000) as i32 * 1_000_000,
    })
}

/// Every request to the cluster `pool` (`c`), whose endpoints are `addrs`.
fn pool(
    port: u16,
    c: envoy_types::pb::envoy::config::cluster::v3::Cluster,
    addrs: &[std::net::SocketAddr],
) -> Snapshot {
    Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "o",
                &[HOST],
                vec![rt(prefix("/"), to_cluster("pool"))],
            )],
        )],
        clusters: vec![c],
        endpoints: vec![cla("pool", addrs)],
        ..Default::default()
    }
}

async fn mesh(bad: &Scripted, good: &Scripted, od: OutlierDetection) -> Mesh {
    let mesh = Mesh::start(|port| {
        let mut c = eds_cluster("pool");
        c.outlier_detection = Some(od);
        pool(port, c, &[bad.addr, good.addr])
    })
    .await;
    mesh.wait_routes_untouched().await;
    mesh
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_host_is_ejected_then_returns() {
    let bad = Scripted::start("bad", vec![Step::Status(500)]).await;
    let good = Scripted::start("good", vec![Step::Status(200)]).await;
    let mesh = mesh(
        &bad,
        &good,
        OutlierDetection {
            consecutive_5xx: Some(UInt32Value { value: 3 }),
            interval: ms(100),
            base_ejection_time: ms(1500),
            max_ejection_percent: Some(UInt32Value { value: 100 }),
            ..Default::default()
        },
    )
    .await;
    for _ in 0..30 {
        mesh.get("/", HOST, &[]).await;
    }
    // Round robin over two hosts: the bad one answers three times, then it is out. Envoy
    // ejects on its main thread, so on a loaded machine one more request can reach the host
    // before the ejection lands (Portico ejects inline: exactly 3).
    let n = bad.served();
    assert!((3..=4).contains(&n), "bad served {n}");
    assert_eq!(good.served(), 30 - n);
    let stats = mesh.gw.prometheus().await;
    let (metric, label) = envoy_cluster_metric(
        "pool",
        "outlier_detection_ejections_enforced_consecutive_5xx",
    );
    assert_eq!(
        prom_value(&stats, &metric, "envoy_cluster_name", &label),
        1.0
    );
    let (metric, label) = envoy_cluster_metric("pool", "outlier_detection_ejections_active");
    assert_eq!(
        prom_value(&stats, &metric, "envoy_cluster_name", &label),
        1.0
    );

    // After the ejection time the host is back and takes traffic again.
    tokio::time::sleep(Duration::from_millis(1800)).await;
    for _ in 0..10 {
        mesh.get("/", HOST, &[]).await;
    }
    assert!(bad.served() > 3, "bad served {}", bad.served());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_errors_eject_only_when_enforced_and_max_ejection_percent_holds() {
    let bad = Scripted::start("bad", vec![Step::Status(503)]).await;
    let good = Scripted::start("good", vec![Step::Status(200)]).await;
    // consecutive_5xx off (0); gateway failures detected but Envoy's default enforcement is 0%.
    let mesh = mesh(
        &bad,
        &good,
        OutlierDetection {
            consecutive_5xx: Some(UInt32Value { value: 0 }),
            consecutive_gateway_failure: Some(UInt32Value { value: 2 }),
            interval: ms(100),
            base_ejection_time: ms(5000),
            max_ejection_percent: Some(UInt32Value { value: 100 }),
            ..Default::default()
        },
    )
    .await;
    for _ in 0..20 {
        mesh.get("/", HOST, &[]).await;
    }
    assert_eq!(bad.served(), 10, "not enforced: round robin as before");
    let stats = mesh.gw.prometheus().await;
    let (metric, label) = envoy_cluster_metric(
        "pool",
        "outlier_detection_ejections_detected_consecutive_gateway_failure",
    );
    assert!(prom_value(&stats, &metric, "envoy_cluster_name", &label) >= 1.0);
}

/// `successful_active_health_check_uneject_host` (on by default): a host ejected for its 5xx
/// is back as soon as an active health check passes, long before its ejection time; turned
/// off, the ejection stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passing_health_check_returns_an_ejected_host_unless_told_not_to() {
    use envoy_types::pb::envoy::config::core::v3::{health_check, HealthCheck};
    use envoy_types::pb::google::protobuf::BoolValue;
    for uneject in [true, false] {
        let backend = RawBackend::start().await;
        let mesh = Mesh::start(|port| {
            let mut c = eds_cluster("pool");
            c.outlier_detection = Some(OutlierDetection {
                consecutive_5xx: Some(UInt32Value { value: 3 }),
                interval: ms(100),
                base_ejection_time: ms(60_000),
                max_ejection_percent: Some(UInt32Value { value: 100 }),
                successful_active_health_check_uneject_host: Some(BoolValue { value: uneject }),
                ..Default::default()
            });
            c.health_checks = vec![HealthCheck {
                timeout: ms(1000),
                interval: ms(200),
                no_traffic_interval: ms(200),
                unhealthy_threshold: Some(UInt32Value { value: 3 }),
                healthy_threshold: Some(UInt32Value { value: 1 }),
                health_checker: Some(health_check::HealthChecker::HttpHealthCheck(
                    health_check::HttpHealthCheck {
                        path: "/healthz".into(),
                        ..Default::default()
                    },
                )),
                ..Default::default()
            }];
            pool(port, c, &[backend.addr])
        })
        .await;
        mesh.wait_routes_untouched().await;
        eventually("the host answers", Duration::from_secs(10), || async {
            let r = mesh.get("/warm", HOST, &[]).await;
            (r.status == 200)
                .then_some(())
                .ok_or(format!("{}", r.status))
        })
        .await;
        for _ in 0..3 {
            mesh.get("/status/500", HOST, &[]).await;
        }
        let metric = |name: &str| {
            let (metric, label) = envoy_cluster_metric("pool", name);
            let gw = &mesh.gw;
            async move {
                let stats = gw.prometheus().await;
                prom_value(&stats, &metric, "envoy_cluster_name", &label)
            }
        };
        // The count, not the active gauge: a check may pass (and return the host) at once.
        // Envoy ejects on its main thread, a moment after the third answer.
        eventually("the ejection", Duration::from_secs(5), || async {
            let n = metric("outlier_detection_ejections_enforced_total").await;
            (n == 1.0)
                .then_some(())
                .ok_or(format!("uneject {uneject}: {n} ejections"))
        })
        .await;
        let active = || metric("outlier_detection_ejections_active");
        // A few health-check intervals.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let want = if uneject { 0.0 } else { 1.0 };
        assert_eq!(
            active().await,
            want,
            "uneject {uneject}: after passing checks"
        );
    }
}

/// The success-rate detector (on by default): among five hosts answering enough requests in
/// an interval, the one whose success rate is far below the others' is ejected, though it
/// never failed `consecutive_5xx` times in a row (that detector is off here); unless one host
/// of five (20%) is more than `max_ejection_percent` (Envoy's default 10%): then the ejection
/// overflows and the host keeps its traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_with_a_success_rate_far_below_its_peers_is_ejected() {
    for max_percent in [Some(20), None] {
        success_rate_case(max_percent).await;
    }
}

async fn success_rate_case(max_percent: Option<u32>) {
    let bad = Scripted::start("bad", vec![Step::Status(500)]).await;
    let mut good = Vec::new();
    for _ in 0..4 {
        good.push(Scripted::start("good", vec![Step::Status(200)]).await);
    }
    let mut addrs = vec![bad.addr];
    addrs.extend(good.iter().map(|g| g.addr));
    let mesh = Mesh::start(|port| {
        let mut c = eds_cluster("pool");
        c.outlier_detection = Some(OutlierDetection {
            consecutive_5xx: Some(UInt32Value { value: 0 }),
            interval: ms(500),
            base_ejection_time: ms(60_000),
            success_rate_request_volume: Some(UInt32Value { value: 10 }),
            max_ejection_percent: max_percent.map(|value| UInt32Value { value }),
            ..Default::default()
        });
        pool(port, c, &addrs)
    })
    .await;
    mesh.wait_routes_untouched().await;
    let value = |stats: &str, name: &str| {
        let (metric, label) = envoy_cluster_metric("pool", name);
        prom_value(stats, &metric, "envoy_cluster_name", &label)
    };
    // Traffic until an interval has seen enough of it (each host 10 answers or more) and the
    // detector has had its say: an ejection, or an overflow.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let stats = loop {
        for _ in 0..50 {
            mesh.get("/", HOST, &[]).await;
        }
        let stats = mesh.gw.prometheus().await;
        let decided = value(&stats, "outlier_detection_ejections_enforced_success_rate")
            + value(&stats, "outlier_detection_ejections_overflow");
        if decided >= 1.0 {
            break stats;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "max {max_percent:?}: no success-rate verdict: {}",
            stats
                .lines()
                .filter(|l| l.contains("outlier") && !l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n")
        );
    };
    let ejected = value(&stats, "outlier_detection_ejections_enforced_success_rate") >= 1.0;
    assert_eq!(
        ejected,
        max_percent.is_some(),
        "max {max_percent:?}: ejected"
    );
    // Envoy ejects on its interval timer: let the ejection land.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = bad.served();
    for _ in 0..50 {
        mesh.get("/", HOST, &[]).await;
    }
    let took = bad.served() - before;
    if ejected {
        assert_eq!(took, 0, "the ejected host took traffic");
    } else {
        assert!(
            took > 0,
            "max {max_percent:?}: the host left in took no traffic"
        );
    }
}
