//! The connection manager's request header limits: `max_request_headers_kb` and
//! `common_http_protocol_options.max_headers_count`, answered 431 as Envoy's codec answers.
//! Runs against Envoy too.

mod common;

use common::*;
use envoy_types::pb::envoy::config::core::v3::HttpProtocolOptions;
use envoy_types::pb::google::protobuf::UInt32Value;

/// A request with `extra` headers of `len` bytes of value each (besides Host).
fn request(extra: usize, len: usize) -> Vec<u8> {
    let mut r = String::from("GET / HTTP/1.1\r\nhost: example.com\r\nconnection: close\r\n");
    for i in 0..extra {
        r.push_str(&format!("x-h{i:03}: {}\r\n", "v".repeat(len)));
    }
    r.push_str("\r\n");
    r.into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_header_limits_come_from_the_connection_manager() {
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.max_request_headers_kb = Some(UInt32Value { value: 2 });
        h.common_http_protocol_options = Some(HttpProtocolOptions {
            max_headers_count: Some(UInt32Value { value: 10 }),
            ..Default::default()
        });
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "all",
                    &["*"],
                    vec![rt(prefix("/"), direct(200, "ok"))],
                )],
            )],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_status("/", "example.com", 200).await;
    let status = |extra, len| {
        let req = request(extra, len);
        async move { raw_http1(mesh.port, &req, false).await.status }
    };
    // Host, connection and 8 more make 10 headers; one more is too many.
    assert_eq!(status(8, 1).await, 200);
    assert_eq!(status(9, 1).await, 431);
    // 2 KiB of headers: 5 headers of 300 bytes fit, 8 of 300 do not.
    assert_eq!(status(5, 300).await, 200);
    assert_eq!(status(8, 300).await, 431);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_limits_are_refused() {
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.max_request_headers_kb = Some(UInt32Value { value: 9000 });
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "all",
                    &["*"],
                    vec![rt(prefix("/"), direct(200, "ok"))],
                )],
            )],
            ..Default::default()
        }
    })
    .await;
    let nack = mesh
        .ads
        .wait_for_nack(
            "type.googleapis.com/envoy.config.listener.v3.Listener",
            std::time::Duration::from_secs(10),
        )
        .await;
    let error = nack.error.unwrap_or_default();
    assert!(error.contains("max_request_headers_kb"), "{error}");
}
