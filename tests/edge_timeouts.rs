//! Connection timeouts from the connection manager: `common_http_protocol_options.idle_timeout`
//! closes an HTTP/1 connection that waits too long for its next request. Runs against Envoy
//! too: `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test edge_timeouts`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::core::v3::HttpProtocolOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HOST: &str = "example.com";

/// Reads one response (headers and a content-length body) from `s`.
async fn one_response(s: &mut tokio::net::TcpStream) -> String {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk).await.expect("read");
        assert!(
            n > 0,
            "closed before a response: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let len: usize = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap_or(0))
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                return text;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http1_connection_is_closed_after_idle_timeout() {
    let web = Backend::start("web").await;
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.common_http_protocol_options = Some(HttpProtocolOptions {
            idle_timeout: Some(envoy_types::pb::google::protobuf::Duration {
                seconds: 1,
                nanos: 0,
            }),
            ..Default::default()
        });
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "all",
                    &["*"],
                    vec![rt(prefix("/"), to_cluster("web"))],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[("web", &web)])
    })
    .await;
    eventually("served", Duration::from_secs(15), || async {
        let r = mesh.get("/", HOST, &[]).await;
        (r.status == 200)
            .then_some(())
            .ok_or(format!("{}", r.status))
    })
    .await;
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    let req = format!("GET / HTTP/1.1\r\nhost: {HOST}\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let first = one_response(&mut s).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    // Within the timeout the connection is reused.
    tokio::time::sleep(Duration::from_millis(300)).await;
    s.write_all(req.as_bytes()).await.expect("write");
    let second = one_response(&mut s).await;
    assert!(second.starts_with("HTTP/1.1 200"), "{second}");
    // Then it idles past the timeout: the gateway closes it.
    let idle = Instant::now();
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut rest))
        .await
        .expect("the gateway closes the idle connection");
    let waited = idle.elapsed();
    assert!(n.is_ok() || rest.is_empty(), "{n:?}");
    assert!(
        // Envoy drains an idle connection: idle_timeout + drain_timeout (5 s) + delayed close
        // (1 s).
        waited >= Duration::from_millis(6500) && waited < Duration::from_secs(9),
        "closed after {waited:?}"
    );
}
