//! Request mirroring (`request_mirror_policies`): a copy of each request, body included, goes
//! to the mirror cluster with `-shadow` appended to its host; the mirror never delays or fails
//! the request itself. Runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::core::v3::RuntimeFractionalPercent;
use envoy_types::pb::envoy::config::route::v3::{route, route_action::RequestMirrorPolicy};
use envoy_types::pb::envoy::r#type::v3::{fractional_percent::DenominatorType, FractionalPercent};

const HOST: &str = "mirror.example.com";

async fn mesh(main: &Scripted, mirror: std::net::SocketAddr, percent: Option<u32>) -> Mesh {
    let mesh = Mesh::start(|port| {
        let mut action = to_cluster("main");
        if let route::Action::Route(ra) = &mut action {
            ra.request_mirror_policies = vec![RequestMirrorPolicy {
                cluster: "shadow".into(),
                runtime_fraction: percent.map(|p| RuntimeFractionalPercent {
                    default_value: Some(FractionalPercent {
                        numerator: p,
                        denominator: DenominatorType::Hundred as i32,
                    }),
                    runtime_key: String::new(),
                }),
                ..Default::default()
            }];
        }
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost("m", &[HOST], vec![rt(prefix("/"), action)])],
            )],
            clusters: vec![eds_cluster("main"), eds_cluster("shadow")],
            endpoints: vec![cla("main", &[main.addr]), cla("shadow", &[mirror])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_status("/", HOST, 200).await;
    mesh
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_mirror_gets_a_copy_without_delaying_the_request() {
    let main = Scripted::start("main", vec![Step::Status(200)]).await;
    let shadow = Scripted::start("shadow", vec![Step::Hang(Duration::from_secs(2))]).await;
    let mesh = mesh(&main, shadow.addr, None).await;
    eventually("the readiness probe's copy", PROPAGATION, || async {
        if shadow.served() > 0 {
            Ok(())
        } else {
            Err("no copy yet".to_string())
        }
    })
    .await;
    shadow.reset();
    let start = Instant::now();
    let r = send_request(
        &reqwest::Client::new(),
        "POST",
        &mesh.url("/orders?id=7"),
        Some(HOST),
        &[("content-type", "text/plain"), ("x-trace", "abc")],
        Some(b"item=42".to_vec()),
    )
    .await;
    assert_eq!((r.status, r.backend()), (200, Some("main")), "{r:?}");
    assert!(
        start.elapsed() < Duration::from_millis(1500),
        "{:?}",
        start.elapsed()
    );
    eventually("the mirrored copy", PROPAGATION, || async {
        if shadow.served() > 0 {
            Ok(())
        } else {
            Err("no copy yet".to_string())
        }
    })
    .await;
    let head = shadow.heads.lock().expect("lock")[0].clone();
    assert!(head.starts_with("POST /orders?id=7 HTTP/1.1"), "{head}");
    assert!(head.contains(&format!("host: {HOST}-shadow")), "{head}");
    assert!(head.contains("x-trace: abc"), "{head}");
    assert_eq!(shadow.seen.lock().expect("lock")[0].1, "item=42");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_mirror_never_fails_the_request_and_fractions_are_honoured() {
    let main = Scripted::start("main", vec![Step::Status(200)]).await;
    let dead = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mesh1 = mesh(&main, dead, None).await;
    for _ in 0..20 {
        assert_eq!(mesh1.get("/", HOST, &[]).await.status, 200);
    }
    drop(mesh1);

    let shadow = Scripted::start("shadow", vec![Step::Status(200)]).await;
    let mesh = mesh(&main, shadow.addr, Some(25)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    shadow.reset();
    for _ in 0..400 {
        assert_eq!(mesh.get("/", HOST, &[]).await.status, 200);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // 400 draws at p = 0.25: outside 50..=150 has probability 1e-8 (binomial, computed).
    let n = shadow.served();
    assert!((50..=150).contains(&n), "mirrored {n} of 400");
}
