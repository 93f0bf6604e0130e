//! Active health checks against backends that misbehave on purpose: a health endpoint that
//! starts failing and recovers, one that hangs past the check timeout, a closed port, a backend
//! that asks to be taken out on a proxied response. What a client sees (where traffic goes) and
//! what the stats count. Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{health_check, HealthCheck, HealthStatus};
use envoy_types::pb::google::protobuf::{Duration as PDuration, UInt32Value};
use http_body_util::Full;
use hyper::body::Bytes;

const HOST: &str = "hc.example.com";
const CLUSTER: &str = "pool";

fn ms(n: u64) -> Option<PDuration> {
    Some(PDuration {
        seconds: (n / 1000) as i64,
        nanos: ((n % 1000) * 1_000_000) as i32,
    })
}

/// A backend whose `/healthz` answers what the test says: a status, or a hang of `hang_ms`.
/// Every other path answers 200 with its name (and `/passive` on the backend named `b` also
/// with `x-envoy-immediate-health-check-fail`).
struct HcBackend {
    addr: SocketAddr,
    health: Arc<AtomicU16>,
    hang_ms: Arc<AtomicU64>,
    checks: Arc<AtomicUsize>,
    served: Arc<AtomicUsize>,
    /// The last health check request: (host, user-agent, x-probe).
    last_check: Arc<Mutex<Option<(String, String, String)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl HcBackend {
    async fn start(name: &'static str) -> HcBackend {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut b = HcBackend {
            addr,
            health: Arc::new(AtomicU16::new(200)),
            hang_ms: Arc::new(AtomicU64::new(0)),
            checks: Arc::default(),
            served: Arc::default(),
            last_check: Arc::default(),
            task: tokio::spawn(async {}),
        };
        let (health, hang, checks, served, last) = (
            b.health.clone(),
            b.hang_ms.clone(),
            b.checks.clone(),
            b.served.clone(),
            b.last_check.clone(),
        );
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (health, hang, checks, served, last) = (
                    health.clone(),
                    hang.clone(),
                    checks.clone(),
                    served.clone(),
                    last.clone(),
                );
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            let (health, hang, checks, served, last) = (
                                health.clone(),
                                hang.clone(),
                                checks.clone(),
                                served.clone(),
                                last.clone(),
                            );
                            async move {
                                let h = |n: &str| {
                                    req.headers()
                                        .get(n)
                                        .and_then(|v| v.to_str().ok())
                                        .unwrap_or("")
                                        .to_string()
                                };
                                let mut resp = hyper::Response::builder().header("x-backend", name);
                                if req.uri().path() == "/healthz" {
                                    checks.fetch_add(1, SeqCst);
                                    *last.lock().expect("lock") =
                                        Some((h("host"), h("user-agent"), h("x-probe")));
                                    let wait = hang.load(SeqCst);
                                    if wait > 0 {
                                        tokio::time::sleep(Duration::from_millis(wait)).await;
                                    }
                                    resp = resp.status(health.load(SeqCst));
                                } else {
                                    served.fetch_add(1, SeqCst);
                                    if req.uri().path() == "/passive" && name == "b" {
                                        resp = resp
                                            .header("x-envoy-immediate-health-check-fail", "true");
                                    }
                                }
                                Ok::<_, Infallible>(
                                    resp.body(Full::new(Bytes::from(name)))
                                        .expect("static response"),
                                )
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        b.task.abort();
        b.task = task;
        b
    }
}

impl Drop for HcBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An address nothing listens on.
fn closed_port() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr")
}

fn http_check(unhealthy: u32, healthy: u32) -> HealthCheck {
    HealthCheck {
        timeout: ms(400),
        interval: ms(100),
        // Without traffic Envoy checks every 60 s by default: the tests start without any.
        no_traffic_interval: ms(100),
        unhealthy_threshold: Some(UInt32Value { value: unhealthy }),
        healthy_threshold: Some(UInt32Value { value: healthy }),
        health_checker: Some(health_check::HealthChecker::HttpHealthCheck(
            health_check::HttpHealthCheck {
                path: "/healthz".into(),
                request_headers_to_add: vec![
                    envoy_types::pb::envoy::config::core::v3::HeaderValueOption {
                        header: Some(envoy_types::pb::envoy::config::core::v3::HeaderValue {
                            key: "x-probe".into(),
                            value: "yes".into(),
                            ..Default::default()
                        }),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

fn checked_cluster(hc: HealthCheck) -> Cluster {
    let mut c = eds_cluster(CLUSTER);
    c.health_checks = vec![hc];
    c
}

async fn mesh(
    cluster: Cluster,
    endpoints: Vec<envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment>,
) -> Mesh {
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "hc",
                &[HOST],
                vec![rt(prefix("/"), to_cluster(CLUSTER))],
            )],
        )],
        clusters: vec![cluster],
        endpoints,
        ..Default::default()
    })
    .await;
    mesh.wait_routes_untouched().await;
    mesh
}

/// Which backends `n` requests reach (by name), all of them answered 200.
async fn spread(mesh: &Mesh, path: &str, n: usize) -> Vec<String> {
    let mut seen = Vec::new();
    for _ in 0..n {
        let r = mesh.get(path, HOST, &[]).await;
        seen.push(match r.backend() {
            Some(b) if r.status == 200 => b.to_string(),
            _ => format!("status {} {:?}", r.status, r.body),
        });
    }
    seen
}

/// Waits until `n` requests in a row reach exactly the backends in `want`, each at least once.
async fn wait_spread(mesh: &Mesh, want: &[&str], n: usize) {
    let what = format!("traffic over exactly {want:?}");
    eventually(&what, PROPAGATION, || async {
        let seen = spread(mesh, "/", n).await;
        let only = seen.iter().all(|b| want.contains(&b.as_str()));
        let all = want.iter().all(|w| seen.iter().any(|b| b == w));
        if only && all {
            Ok(())
        } else {
            Err(format!("{seen:?}"))
        }
    })
    .await
}

async fn stat(mesh: &Mesh, name: &str) -> f64 {
    let text = mesh.gw.prometheus().await;
    let (metric, label) = envoy_cluster_metric(CLUSTER, name);
    prom_value(&text, &metric, "envoy_cluster_name", &label)
}

async fn wait_stat(mesh: &Mesh, name: &str, ok: impl Fn(f64) -> bool) -> f64 {
    eventually(name, PROPAGATION, || async {
        let v = stat(mesh, name).await;
        if ok(v) {
            Ok(v)
        } else {
            Err(format!("{name} = {v}"))
        }
    })
    .await
}

async fn host_flags(mesh: &Mesh, addr: SocketAddr) -> String {
    let body = mesh.gw.admin_get("/clusters").await.body;
    let key = format!("{CLUSTER}::{addr}::health_flags::");
    body.lines()
        .find_map(|l| l.strip_prefix(&key))
        .unwrap_or("<missing>")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_health_endpoint_moves_traffic_away_until_it_passes_healthy_threshold_times() {
    let a = HcBackend::start("a").await;
    let b = HcBackend::start("b").await;
    let mesh = mesh(
        checked_cluster(http_check(3, 3)),
        vec![cla(CLUSTER, &[a.addr, b.addr])],
    )
    .await;
    wait_spread(&mesh, &["a", "b"], 10).await;

    // The check request as Envoy sends it.
    let (host, agent, probe) = a.last_check.lock().expect("lock").clone().expect("checked");
    assert_eq!(host, CLUSTER, "authority defaults to the cluster name");
    assert_eq!(agent, "Envoy/HC");
    assert_eq!(probe, "yes", "request_headers_to_add");

    // 503 is not an expected status: out at once, whatever unhealthy_threshold says.
    b.health.store(503, SeqCst);
    wait_spread(&mesh, &["a"], 10).await;
    assert_eq!(
        wait_stat(&mesh, "health_check_healthy", |v| v == 1.0).await,
        1.0
    );
    assert_eq!(stat(&mesh, "membership_healthy").await, 1.0);
    assert!(stat(&mesh, "health_check_failure").await >= 1.0);
    assert_eq!(stat(&mesh, "health_check_network_failure").await, 0.0);
    assert!(
        host_flags(&mesh, b.addr)
            .await
            .contains("/failed_active_hc"),
        "{}",
        host_flags(&mesh, b.addr).await
    );
    assert_eq!(host_flags(&mesh, a.addr).await, "healthy");

    // Recovery needs healthy_threshold (3) passes in a row; the host is out until then.
    let before = b.checks.load(SeqCst);
    b.health.store(200, SeqCst);
    let served = b.served.load(SeqCst);
    eventually("b back in the pool", PROPAGATION, || async {
        let seen = spread(&mesh, "/", 4).await;
        if seen.iter().any(|s| s == "b") {
            Ok(())
        } else {
            Err(format!("{seen:?}"))
        }
    })
    .await;
    // Checks run while the test sends traffic; b was answering 503 until `before`.
    assert!(
        b.checks.load(SeqCst) >= before + 3,
        "b back after {} checks",
        b.checks.load(SeqCst) - before
    );
    assert!(b.served.load(SeqCst) > served);
    // One scrape, so the counters are of the same moment.
    let text = mesh.gw.prometheus().await;
    let v = |stat: &str| {
        let (metric, label) = envoy_cluster_metric(CLUSTER, stat);
        prom_value(&text, &metric, "envoy_cluster_name", &label)
    };
    let (attempts, success, failure) = (
        v("health_check_attempt"),
        v("health_check_success"),
        v("health_check_failure"),
    );
    assert!(
        attempts >= success + failure && failure >= 1.0 && success >= 3.0,
        "attempt {attempts} success {success} failure {failure}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_host_failing_is_panic_mode_over_all_of_them() {
    let a = HcBackend::start("a").await;
    let b = HcBackend::start("b").await;
    let mesh = mesh(
        checked_cluster(http_check(1, 1)),
        vec![cla(CLUSTER, &[a.addr, b.addr])],
    )
    .await;
    wait_spread(&mesh, &["a", "b"], 10).await;
    a.health.store(500, SeqCst);
    b.health.store(500, SeqCst);
    wait_stat(&mesh, "health_check_healthy", |v| v == 0.0).await;
    assert_eq!(stat(&mesh, "membership_healthy").await, 0.0);
    // No healthy host: Envoy balances across all of them rather than failing.
    wait_spread(&mesh, &["a", "b"], 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_check_and_a_closed_port_are_network_failures() {
    let a1 = HcBackend::start("a1").await;
    let a2 = HcBackend::start("a2").await;
    let slow = HcBackend::start("slow").await;
    slow.hang_ms.store(2000, SeqCst);
    let closed = closed_port();
    // Two of four hosts pass: 50% is not under the panic threshold, so only they serve.
    let mesh = mesh(
        checked_cluster(http_check(2, 1)),
        vec![cla(CLUSTER, &[a1.addr, a2.addr, slow.addr, closed])],
    )
    .await;
    wait_spread(&mesh, &["a1", "a2"], 12).await;
    wait_stat(&mesh, "health_check_network_failure", |v| v >= 4.0).await;
    assert_eq!(stat(&mesh, "health_check_healthy").await, 2.0);
    assert_eq!(stat(&mesh, "membership_healthy").await, 2.0);
    assert_eq!(slow.served.load(SeqCst), 0);
    // A timed-out check marks the failed host; the first one lands after `timeout`.
    eventually("the slow host's timeout flag", PROPAGATION, || async {
        let flags = host_flags(&mesh, slow.addr).await;
        if flags == "/failed_active_hc/active_hc_timeout" {
            Ok(())
        } else {
            Err(flags)
        }
    })
    .await;
    let flags = host_flags(&mesh, closed).await;
    assert_eq!(flags, "/failed_active_hc");

    // The slow host answers in time again: its first pass ever makes it healthy at once.
    slow.hang_ms.store(0, SeqCst);
    wait_spread(&mesh, &["a1", "a2", "slow"], 12).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_only_tcp_check_takes_a_closed_port_out() {
    let a = HcBackend::start("a").await;
    let closed = closed_port();
    let hc = HealthCheck {
        health_checker: Some(health_check::HealthChecker::TcpHealthCheck(
            Default::default(),
        )),
        ..http_check(1, 1)
    };
    let mesh = mesh(checked_cluster(hc), vec![cla(CLUSTER, &[a.addr, closed])]).await;
    wait_spread(&mesh, &["a"], 10).await;
    wait_stat(&mesh, "health_check_network_failure", |v| v >= 1.0).await;
    assert_eq!(stat(&mesh, "health_check_healthy").await, 1.0);
    assert_eq!(a.checks.load(SeqCst), 0, "connect only: no HTTP request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eds_unhealthy_wins_over_passing_checks_and_new_hosts_wait_for_their_first_check() {
    let a = HcBackend::start("a").await;
    let b = HcBackend::start("b").await;
    let c = HcBackend::start("c").await;
    let ep = |addr, h: HealthStatus| lb_ep(addr, h, None);
    let mesh = mesh(
        checked_cluster(http_check(1, 1)),
        vec![cla_localities(
            CLUSTER,
            vec![locality_at(
                0,
                vec![
                    ep(a.addr, HealthStatus::Healthy),
                    ep(b.addr, HealthStatus::Healthy),
                ],
            )],
        )],
    )
    .await;
    wait_spread(&mesh, &["a", "b"], 10).await;
    // b reported unhealthy by EDS: out although its checks pass; c joins once checked.
    mesh.ads.set_endpoints(
        "2",
        &[cla_localities(
            CLUSTER,
            vec![locality_at(
                0,
                vec![
                    ep(a.addr, HealthStatus::Healthy),
                    ep(b.addr, HealthStatus::Unhealthy),
                    ep(c.addr, HealthStatus::Healthy),
                ],
            )],
        )],
    );
    wait_spread(&mesh, &["a", "c"], 12).await;
    assert!(b.checks.load(SeqCst) > 0);
    let flags = host_flags(&mesh, b.addr).await;
    assert_eq!(flags, "/failed_eds_health");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_asking_to_be_taken_out_is_a_passive_failure() {
    let a = HcBackend::start("a").await;
    let b = HcBackend::start("b").await;
    let mut hc = http_check(1, 3);
    // Slow checks: the host must stay out until three passes, long enough to see it.
    hc.interval = ms(500);
    hc.no_traffic_interval = ms(500);
    let mesh = mesh(checked_cluster(hc), vec![cla(CLUSTER, &[a.addr, b.addr])]).await;
    wait_spread(&mesh, &["a", "b"], 10).await;
    // Round robin: within two requests one reaches b, which asks to be taken out (a never
    // does, so one host stays in).
    eventually("a passive failure", PROPAGATION, || async {
        mesh.get("/passive", HOST, &[]).await;
        let flags = host_flags(&mesh, b.addr).await;
        if flags.contains("/failed_active_hc") {
            Ok(flags)
        } else {
            Err(flags)
        }
    })
    .await;
    let flags = host_flags(&mesh, b.addr).await;
    assert!(flags.contains("/excluded_via_immediate_hc_fail"), "{flags}");
    assert!(stat(&mesh, "health_check_passive_failure").await >= 1.0);
    let serving = "a";
    wait_spread(&mesh, &[serving], 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_check_missing_a_required_field_is_nacked_naming_it() {
    let a = HcBackend::start("a").await;
    let mesh = mesh(
        checked_cluster(http_check(1, 1)),
        vec![cla(CLUSTER, &[a.addr])],
    )
    .await;
    wait_spread(&mesh, &["a"], 4).await;
    let mut bad = http_check(1, 1);
    bad.timeout = None;
    mesh.ads.set_clusters("2", &[checked_cluster(bad)]);
    let nack = mesh.ads.wait_for_nack(CDS, PROPAGATION).await;
    let msg = nack.error.unwrap_or_default().to_lowercase();
    assert!(
        msg.contains("timeout") && msg.contains("value is required"),
        "{msg}"
    );
    // The last good cluster keeps serving.
    wait_spread(&mesh, &["a"], 4).await;
}
