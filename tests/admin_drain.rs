//! Draining as pilot-agent drives it: `POST /drain_listeners` (`graceful`, `inboundonly`,
//! none) with `--drain-time-s` and `--drain-strategy immediate` (pilot-agent's flags), and
//! SIGTERM. The `/drain_listeners` tests run against Envoy too
//! (`PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test admin_drain`); Envoy exits
//! at once on SIGTERM, so the SIGTERM test is Portico's own.

mod common;

use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::core::v3::TrafficDirection;
use envoy_types::pb::envoy::extensions::filters::common::fault::v3::fault_delay;
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HOST: &str = "drain.example.com";

/// Listener `port`: INBOUND or unspecified; a header-driven fault delay in front of the
/// router so a request can be kept in flight.
fn listener(port: u16, inbound: bool) -> envoy_types::pb::envoy::config::listener::v3::Listener {
    let mut h = hcm(port);
    let fault = HttpFault {
        delay: Some(
            envoy_types::pb::envoy::extensions::filters::common::fault::v3::FaultDelay {
                fault_delay_secifier: Some(fault_delay::FaultDelaySecifier::HeaderDelay(
                    fault_delay::HeaderDelay {},
                )),
                percentage: Some(envoy_types::pb::envoy::r#type::v3::FractionalPercent {
                    numerator: 100,
                    denominator: 0,
                }),
            },
        ),
        ..Default::default()
    };
    h.http_filters.insert(
        0,
        HttpFilter {
            name: "envoy.filters.http.fault".into(),
            config_type: Some(http_filter::ConfigType::TypedConfig(any(fault))),
            ..Default::default()
        },
    );
    let mut l = listener_with(port, h);
    if inbound {
        l.traffic_direction = TrafficDirection::Inbound as i32;
    }
    l
}

async fn mesh(backend: &Backend, inbound: u16, outbound: u16) -> Mesh {
    let routes = |p: u16| {
        route_config(
            &route_name(p),
            vec![vhost("all", &["*"], vec![rt(prefix("/"), to_cluster("b"))])],
        )
    };
    let addr = backend.addr;
    let mesh = Mesh::start_args(
        ads_api_type(),
        &["--drain-time-s", "2", "--drain-strategy", "immediate"],
        move |_| Snapshot {
            listeners: vec![listener(inbound, true), listener(outbound, false)],
            routes: vec![routes(inbound), routes(outbound)],
            clusters: vec![eds_cluster("b")],
            endpoints: vec![cla("b", &[addr])],
            ..Default::default()
        },
    )
    .await;
    for p in [inbound, outbound] {
        eventually(
            "the listener serves",
            Duration::from_secs(15),
            || async move {
                let r = raw_get(p).await;
                (r.status == 200).then_some(()).ok_or(format!("{r:?}"))
            },
        )
        .await;
    }
    mesh
}

fn request(extra: &str) -> Vec<u8> {
    format!("GET / HTTP/1.1\r\nhost: {HOST}\r\n{extra}\r\n").into_bytes()
}

async fn raw_get(port: u16) -> RawResp {
    raw_http1(port, &request(""), false).await
}

/// A keep-alive connection: one request at a time.
struct Conn(tokio::net::TcpStream);

impl Conn {
    async fn open(port: u16) -> Conn {
        Conn(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connect"),
        )
    }

    async fn get(&mut self, extra: &str) -> RawResp {
        self.0.write_all(&request(extra)).await.expect("write");
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(r) = parse_raw_response(&buf, false) {
                return r;
            }
            let n = tokio::time::timeout(Duration::from_secs(10), self.0.read(&mut chunk))
                .await
                .expect("a response within 10 s")
                .expect("read");
            assert!(
                n > 0,
                "closed before a response: {:?}",
                String::from_utf8_lossy(&buf)
            );
            buf.extend_from_slice(&chunk[..n]);
        }
    }
}

async fn admin_post(mesh: &Mesh, path: &str) -> RawResp {
    let req = format!("POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\n\r\n");
    raw_http1(mesh.gw.admin_port, req.as_bytes(), false).await
}

fn closes(r: &RawResp) -> bool {
    r.header("connection")
        .is_some_and(|v| v.eq_ignore_ascii_case("close"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_inbound_drain_closes_connections_then_stops_the_inbound_listener() {
    let backend = Backend::start("b").await;
    let (inbound, outbound) = (free_port(), free_port());
    let mesh = mesh(&backend, inbound, outbound).await;
    let mut a = Conn::open(inbound).await;
    let mut b = Conn::open(outbound).await;
    assert!(!closes(&a.get("").await));
    assert!(!closes(&b.get("").await));

    let r = admin_post(&mesh, "/drain_listeners?inboundonly&graceful").await;
    assert_eq!((r.status, r.body_str().as_str()), (200, "OK\n"), "{r:?}");

    // Draining (immediate strategy): the inbound connection's next response closes it; the
    // listener still takes new connections, which close after their first response.
    let r = a.get("").await;
    assert_eq!(r.status, 200);
    assert!(
        closes(&r),
        "the draining connection is told to close: {r:?}"
    );
    let r = raw_get(inbound).await;
    assert_eq!(r.status, 200, "a graceful drain keeps accepting: {r:?}");
    assert!(closes(&r), "{r:?}");
    // The outbound listener is not drained.
    let r = b.get("").await;
    assert!(!closes(&r), "{r:?}");

    // After the drain time the inbound listener accepts no more; the outbound one serves.
    eventually(
        "the inbound listener stops",
        Duration::from_secs(10),
        || async move {
            match tcp_connect(inbound).await {
                Err(std::io::ErrorKind::ConnectionRefused) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    let r = b.get("").await;
    assert_eq!(r.status, 200);
    assert!(!closes(&r), "{r:?}");
    assert_eq!(raw_get(outbound).await.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_without_graceful_stops_every_listener_now() {
    let backend = Backend::start("b").await;
    let (inbound, outbound) = (free_port(), free_port());
    let mesh = mesh(&backend, inbound, outbound).await;
    let r = admin_post(&mesh, "/drain_listeners").await;
    assert_eq!(r.status, 200, "{r:?}");
    for p in [inbound, outbound] {
        eventually(
            "the listener stops",
            Duration::from_secs(5),
            || async move {
                match tcp_connect(p).await {
                    Err(std::io::ErrorKind::ConnectionRefused) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
    }
    // GET is refused, as Envoy refuses it.
    let r = raw_http1(
        mesh.gw.admin_port,
        b"GET /drain_listeners HTTP/1.1\r\nhost: localhost\r\n\r\n",
        false,
    )
    .await;
    assert_eq!(r.status, 405, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_requests_in_flight_finish_then_exits() {
    if is_envoy(&gateway_bin()) {
        // Envoy stops at once on SIGTERM; pilot-agent drains it through the admin first.
        return;
    }
    let backend = Backend::start("b").await;
    let (inbound, outbound) = (free_port(), free_port());
    let mut mesh = mesh(&backend, inbound, outbound).await;
    let mut slow = Conn::open(outbound).await;
    let mut idle = Conn::open(inbound).await;
    assert_eq!(idle.get("").await.status, 200);
    let in_flight = tokio::spawn(async move {
        let r = slow.get("x-envoy-fault-delay-request: 1500\r\n").await;
        (r.status, closes(&r))
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &mesh.gw.pid().to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    // No new connections once the signal is handled.
    eventually("listeners stop", Duration::from_secs(1), || async move {
        match tcp_connect(inbound).await {
            Err(std::io::ErrorKind::ConnectionRefused) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // The request in flight completes, told to close its connection.
    let (status, closed) = in_flight.await.expect("request task");
    assert_eq!((status, closed), (200, true));
    // The idle keep-alive connection was closed by the gateway.
    let mut buf = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(2), idle.0.read(&mut buf))
        .await
        .expect("the idle connection is closed")
        .unwrap_or(0);
    assert_eq!(n, 0);
    let status = mesh
        .gw
        .wait_exit(Duration::from_secs(5))
        .expect("the gateway exits once its connections are gone");
    assert!(status.success(), "{status}");
}
