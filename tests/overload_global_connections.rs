//! The overload manager's global downstream connection limit, as istio-agent's bootstrap sets
//! it (`envoy.resource_monitors.global_downstream_max_connections`): past the limit a new
//! connection is accepted and closed at once and counted in
//! `listener.<address>.downstream_global_cx_overflow`; a listener with
//! `ignore_global_conn_limit` (istio-agent's 15021 and 15090) still takes connections.
//! Runs against Envoy too.

mod common;

use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LIMIT: usize = 3;

/// Whether a fresh connection to `port` is served a response (false: closed at once).
async fn served(port: u16) -> bool {
    raw_http1(
        port,
        b"GET / HTTP/1.1\r\nhost: example.com\r\nconnection: close\r\n\r\n",
        false,
    )
    .await
    .status
        == 200
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_global_limit_are_closed_and_counted() {
    let web = Backend::start("web").await;
    let (port, exempt) = (free_port(), free_port());
    let ads = AdsServer::start_any(
        "1",
        &Snapshot {
            listeners: vec![l(port), {
                let mut x = l(exempt);
                x.ignore_global_conn_limit = true;
                x
            }],
            routes: vec![
                route_config(
                    &route_name(port),
                    vec![vhost(
                        "all",
                        &["*"],
                        vec![rt(prefix("/"), to_cluster("web"))],
                    )],
                ),
                route_config(
                    &route_name(exempt),
                    vec![vhost(
                        "all",
                        &["*"],
                        vec![rt(prefix("/"), to_cluster("web"))],
                    )],
                ),
            ],
            ..Default::default()
        }
        .with_backends(&[("web", &web)]),
    )
    .await;
    let gw = Gateway::start_bootstrap(|admin| {
        format!(
            "{}overload_manager:\n  resource_monitors:\n  - name: envoy.resource_monitors.global_downstream_max_connections\n    typed_config:\n      \"@type\": type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig\n      max_active_downstream_connections: {LIMIT}\n",
            bootstrap_yaml(admin, ads.port)
        )
    })
    .await;
    eventually("the listeners", Duration::from_secs(15), || async {
        (served(port).await && served(exempt).await)
            .then_some(())
            .ok_or(String::from("not yet"))
    })
    .await;
    // Hold LIMIT connections open (each has sent a request and got its answer).
    let mut held = Vec::new();
    for _ in 0..LIMIT {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nhost: example.com\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 512];
        let n = s.read(&mut buf).await.expect("read");
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&buf[..n])
        );
        held.push(s);
    }
    assert!(
        !served(port).await,
        "the connection past the limit is closed"
    );
    assert!(served(exempt).await, "an exempt listener still serves");
    let stat = format!("listener.127.0.0.1_{port}.downstream_global_cx_overflow");
    let body = gw
        .admin_get(&format!("/stats?filter=^{}$", stat.replace('.', "\\.")))
        .await
        .body;
    assert_eq!(body.trim(), format!("{stat}: 1"), "{body}");
    // Once one is closed, a new connection is served again.
    held.pop();
    eventually("a place to free up", Duration::from_secs(10), || async {
        served(port)
            .await
            .then_some(())
            .ok_or(String::from("still full"))
    })
    .await;
}

#[test]
fn other_monitors_and_overload_actions_are_refused_by_name() {
    if is_envoy(&gateway_bin()) {
        // Envoy implements them; this is Portico's refusal.
        return;
    }
    let dir = TempDir::new("portico-overload");
    let path = dir.path.join("b.yaml");
    std::fs::write(
        &path,
        format!(
            "{}overload_manager:\n  resource_monitors:\n  - name: envoy.resource_monitors.fixed_heap\n    typed_config:\n      \"@type\": type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig\n      max_heap_size_bytes: 1000000\n",
            bootstrap_yaml(free_port(), free_port())
        ),
    )
    .expect("write");
    let out = std::process::Command::new(gateway_bin())
        .args(["--mode", "validate", "-c"])
        .arg(&path)
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("overload_manager.resource_monitors[0]: resource monitor 'envoy.resource_monitors.fixed_heap' is not supported"),
        "{err}"
    );
}
