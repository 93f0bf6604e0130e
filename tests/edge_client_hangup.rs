//! Clients that hang up before their response: counted, not logged. 50 clients each send a
//! request to a slow backend and close the connection; the gateway's log stays free of
//! warnings and errors about them (Portico used to write one ERROR line each) and
//! `http.<prefix>.downstream_rq_rx_reset` counts them, as Envoy's does. The same for clients
//! that close or stall in the middle of their request head (pingora logged an ERROR line
//! for each). Runs against Envoy too.

mod common;

use std::time::Duration;

use common::*;
use tokio::io::AsyncWriteExt;

const CLIENTS: u64 = 50;
const HOST: &str = "example.com";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_hanging_up_are_counted_not_logged() {
    let slow = Backend::start_delayed("slow", Duration::from_millis(800)).await;
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "all",
                    &["*"],
                    vec![rt(prefix("/"), to_cluster("slow"))],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[("slow", &slow)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "slow").await;
    let before = slow.served();
    let mut tasks = Vec::new();
    for _ in 0..CLIENTS {
        let port = mesh.port;
        tasks.push(tokio::spawn(async move {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connect");
            s.write_all(b"GET / HTTP/1.1\r\nhost: example.com\r\n\r\n")
                .await
                .expect("write");
            s
        }));
    }
    let mut conns = Vec::new();
    for t in tasks {
        conns.push(t.await.expect("client task"));
    }
    // Every request is in flight at the backend before the clients go.
    eventually(
        "the requests to reach the backend",
        Duration::from_secs(10),
        || async {
            let n = slow.served() - before;
            (n as u64 == CLIENTS).then_some(()).ok_or(format!("{n}"))
        },
    )
    .await;
    // What the gateway logs from here on is about the hang-ups.
    let logged_before = mesh.gw.stderr().len();
    drop(conns);
    let stat = format!("http.outbound_0.0.0.0_{}.downstream_rq_rx_reset", mesh.port);
    let filter = format!("/stats?filter=^{}$", stat.replace('.', "\\."));
    eventually(
        "the resets to be counted",
        Duration::from_secs(10),
        || async {
            let body = mesh.gw.admin_get(&filter).await.body;
            let v: Option<u64> = body
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{stat}: ")))
                .and_then(|v| v.trim().parse().ok());
            (v == Some(CLIENTS)).then_some(()).ok_or(body)
        },
    )
    .await;
    // Once the backend has answered them all, nothing was logged about the clients.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let log = mesh.gw.stderr();
    let noisy: Vec<&str> = log
        .get(logged_before..)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("error") || l.contains("warn")
        })
        .collect();
    assert!(noisy.is_empty(), "{} lines: {noisy:#?}", noisy.len());
}

/// The lines among `log` that a client could have caused: warnings and errors.
fn noisy(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("error") || l.contains("warn")
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_closing_or_stalling_mid_head_are_not_logged() {
    let web = Backend::start("web").await;
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.request_headers_timeout = Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 0,
            nanos: 500_000_000,
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
    mesh.wait_backend("/", HOST, &[], "web").await;
    let logged_before = mesh.gw.stderr().len();
    let mut stalled = Vec::new();
    for i in 0..CLIENTS {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
            .await
            .expect("connect");
        s.write_all(b"GET / HTTP/1.1\r\nhost: example.com\r\n")
            .await
            .expect("write");
        // Half close at once, half wait to be answered 408.
        if i % 2 == 0 {
            stalled.push(s);
        }
    }
    for mut s in stalled {
        let mut answer = String::new();
        tokio::time::timeout(
            Duration::from_secs(10),
            tokio::io::AsyncReadExt::read_to_string(&mut s, &mut answer),
        )
        .await
        .expect("answered in time")
        .ok();
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    }
    let stat = "downstream_rq_header_timeout";
    eventually(
        "the timeouts to be counted",
        Duration::from_secs(10),
        || async {
            let body = mesh
                .gw
                .admin_get(&format!("/stats?filter={stat}$"))
                .await
                .body;
            let n: u64 = body
                .lines()
                .filter_map(|l| l.split_once(": ").filter(|(n, _)| n.ends_with(stat)))
                .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
                .sum();
            (n == CLIENTS / 2).then_some(()).ok_or(body)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = mesh.gw.stderr();
    let lines = noisy(log.get(logged_before..).unwrap_or_default());
    assert!(lines.is_empty(), "{} lines: {lines:#?}", lines.len());
}
