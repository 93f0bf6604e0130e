//! Connection timeouts and limits from the connection manager on HTTP/1 connections:
//! `common_http_protocol_options.idle_timeout` closes a connection that waits too long for
//! its next request, `request_headers_timeout` and `request_timeout` answer a slow client
//! 408, `max_requests_per_connection` and `max_connection_duration` close old connections.
//! Runs against Envoy too: `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test
//! edge_timeouts`.

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

fn pb_ms(ms: u64) -> Option<envoy_types::pb::google::protobuf::Duration> {
    Some(envoy_types::pb::google::protobuf::Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    })
}

/// A gateway routing everything to one backend, its connection manager set by `tune`.
async fn mesh_with(
    web: &Backend,
    tune: impl FnOnce(&mut envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager),
) -> Mesh {
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        tune(&mut h);
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
        .with_backends(&[("web", web)])
    })
    .await;
    eventually("served", Duration::from_secs(15), || async {
        let r = mesh.get("/", HOST, &[]).await;
        (r.status == 200)
            .then_some(())
            .ok_or(format!("{}", r.status))
    })
    .await;
    mesh
}

/// Everything the gateway sends until it closes (or `limit` passes), and when it closed.
async fn read_until_close(
    s: &mut tokio::net::TcpStream,
    limit: Duration,
) -> (String, Option<Duration>) {
    let start = Instant::now();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = limit.saturating_sub(start.elapsed());
        match tokio::time::timeout(left, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                return (String::from_utf8_lossy(&buf).into(), Some(start.elapsed()))
            }
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => return (String::from_utf8_lossy(&buf).into(), None),
        }
    }
}

/// Reads until `s` has sent a whole head (`\r\n\r\n`): the text so far and when.
async fn read_head(s: &mut tokio::net::tcp::OwnedReadHalf, limit: Duration) -> (String, Duration) {
    let start = Instant::now();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !String::from_utf8_lossy(&buf).contains("\r\n\r\n") {
        let n = tokio::time::timeout(limit.saturating_sub(start.elapsed()), s.read(&mut chunk))
            .await
            .expect("an answer in time")
            .expect("read");
        assert!(
            n > 0,
            "closed without an answer: {:?}",
            String::from_utf8_lossy(&buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    }
    (String::from_utf8_lossy(&buf).into(), start.elapsed())
}

/// A connection manager counter summed over every prefix (Envoy also lists its admin
/// listener's, at zero).
async fn stat_sum(mesh: &Mesh, suffix: &str) -> u64 {
    let body = mesh
        .gw
        .admin_get(&format!("/stats?filter={suffix}$"))
        .await
        .body;
    body.lines()
        .filter_map(|l| l.split_once(": ").filter(|(n, _)| n.ends_with(suffix)))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum()
}

fn header<'a>(resp: &'a str, name: &str) -> Option<&'a str> {
    resp.split("\r\n\r\n").next()?.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_request_head_is_answered_408_at_request_headers_timeout() {
    let web = Backend::start("web").await;
    let mesh = mesh_with(&web, |h| h.request_headers_timeout = pb_ms(1000)).await;
    let s = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    let (mut r, mut w) = s.into_split();
    w.write_all(b"GET / HTTP/1.1\r\nhost: example.com\r\n")
        .await
        .expect("write");
    // A header line every 250 ms: every read is quick, the head never ends.
    let trickle = tokio::spawn(async move {
        for i in 0..40 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if w.write_all(format!("x-h{i}: v\r\n").as_bytes())
                .await
                .is_err()
            {
                return;
            }
        }
    });
    let (answer, after) = read_head(&mut r, Duration::from_secs(8)).await;
    assert!(
        answer.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
        "{answer}"
    );
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_millis(2500),
        "answered after {after:?}"
    );
    assert_eq!(header(&answer, "connection"), Some("close"), "{answer}");
    assert_eq!(
        header(&answer, "content-type"),
        Some("text/plain"),
        "{answer}"
    );
    assert_eq!(header(&answer, "content-length"), Some("22"), "{answer}");
    let mut body = Vec::new();
    // Envoy keeps reading for its delayed close (1 s) before it closes; Portico half-closes
    // at once and reads on as long: either way the body is there and the connection ends.
    tokio::time::timeout(Duration::from_secs(5), r.read_to_end(&mut body))
        .await
        .expect("the connection ends")
        .ok();
    let text = String::from_utf8_lossy(&body);
    assert!(
        format!("{answer}{text}").ends_with("\r\n\r\nrequest header timeout"),
        "{answer}{text}"
    );
    trickle.abort();
    eventually("counted", Duration::from_secs(5), || async {
        let n = stat_sum(&mesh, "downstream_rq_header_timeout").await;
        (n == 1).then_some(()).ok_or(n.to_string())
    })
    .await;
    // The timer starts with a request's first byte: idling before it is idle_timeout's
    // business.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    s.write_all(format!("GET / HTTP/1.1\r\nhost: {HOST}\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let ok = one_response(&mut s).await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    // And a quick head after a slow one on the same connection is timed afresh.
    tokio::time::sleep(Duration::from_millis(700)).await;
    s.write_all(b"GET / HTTP/1.1\r\n").await.expect("write");
    tokio::time::sleep(Duration::from_millis(600)).await;
    s.write_all(format!("host: {HOST}\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let ok = one_response(&mut s).await;
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_request_is_answered_408_at_request_timeout() {
    // The backend takes longer than the timeout: the 408 is the gateway's, not a response.
    let web = Backend::start_delayed("web", Duration::from_secs(4)).await;
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.request_timeout = pb_ms(1000);
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
    eventually("served", Duration::from_secs(20), || async {
        let r = mesh.get("/", HOST, &[]).await;
        (r.status == 200)
            .then_some(())
            .ok_or(format!("{}", r.status))
    })
    .await;
    // A head that never ends.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    s.write_all(b"GET / HTTP/1.1\r\nhost: example.com\r\n")
        .await
        .expect("write");
    let started = Instant::now();
    let (answer, closed) = read_until_close(&mut s, Duration::from_secs(6)).await;
    assert!(closed.is_some(), "not closed: {answer}");
    assert!(
        answer.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
        "{answer}"
    );
    assert!(answer.ends_with("\r\n\r\nrequest timeout"), "{answer}");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );
    // A body that never ends, the request already on its way upstream.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    s.write_all(b"POST / HTTP/1.1\r\nhost: example.com\r\ncontent-length: 10\r\n\r\nabcde")
        .await
        .expect("write");
    let started = Instant::now();
    let (answer, closed) = read_until_close(&mut s, Duration::from_secs(6)).await;
    let took = started.elapsed();
    assert!(closed.is_some(), "not closed: {answer}");
    assert!(
        answer.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
        "{answer}"
    );
    assert!(answer.ends_with("\r\n\r\nrequest timeout"), "{answer}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_millis(3500),
        "{took:?}"
    );
    eventually("counted", Duration::from_secs(5), || async {
        let n = stat_sum(&mesh, "downstream_rq_timeout").await;
        (n == 2).then_some(()).ok_or(n.to_string())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_request_a_connection_may_carry_closes_it() {
    let web = Backend::start("web").await;
    let mesh = mesh_with(&web, |h| {
        h.common_http_protocol_options = Some(HttpProtocolOptions {
            max_requests_per_connection: Some(envoy_types::pb::google::protobuf::UInt32Value {
                value: 3,
            }),
            ..Default::default()
        })
    })
    .await;
    let before = stat_sum(&mesh, "downstream_cx_max_requests_reached").await;
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    let req = format!("GET / HTTP/1.1\r\nhost: {HOST}\r\n\r\n");
    for _ in 0..2 {
        s.write_all(req.as_bytes()).await.expect("write");
        let r = one_response(&mut s).await;
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert_ne!(
            header(&r, "connection")
                .map(str::to_ascii_lowercase)
                .as_deref(),
            Some("close"),
            "{r}"
        );
    }
    s.write_all(req.as_bytes()).await.expect("write");
    let (last, closed) = read_until_close(&mut s, Duration::from_secs(10)).await;
    assert!(last.starts_with("HTTP/1.1 200"), "{last}");
    assert_eq!(
        header(&last, "connection")
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Some("close"),
        "{last}"
    );
    assert!(closed.is_some(), "still open after the last request");
    eventually("counted", Duration::from_secs(5), || async {
        let n = stat_sum(&mesh, "downstream_cx_max_requests_reached").await;
        (n > before).then_some(()).ok_or(n.to_string())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_its_max_duration_is_closed() {
    // Each response takes a second: the second connection's request is in flight when the
    // connection reaches its maximum duration.
    let web = Backend::start_delayed("web", Duration::from_millis(1000)).await;
    let mesh = mesh_with(&web, |h| {
        h.common_http_protocol_options = Some(HttpProtocolOptions {
            max_connection_duration: pb_ms(1500),
            ..Default::default()
        })
    })
    .await;
    let req = format!("GET / HTTP/1.1\r\nhost: {HOST}\r\n\r\n");
    // Idle at its deadline: drained (drain_timeout, 5 s, then the delayed close, 1 s).
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    let connected = Instant::now();
    s.write_all(req.as_bytes()).await.expect("write");
    let first = one_response(&mut s).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert_ne!(
        header(&first, "connection")
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Some("close"),
        "{first}"
    );
    let (rest, closed) = read_until_close(&mut s, Duration::from_secs(15)).await;
    assert!(rest.is_empty(), "{rest}");
    let age = connected.elapsed();
    assert!(closed.is_some(), "never closed");
    // Envoy: 7.5 s; Portico's keep-alive counts whole seconds, up to one later.
    assert!(
        age >= Duration::from_millis(7000) && age < Duration::from_millis(9500),
        "closed at {age:?}"
    );
    // Busy at its deadline: the response says `connection: close`.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    s.write_all(req.as_bytes()).await.expect("write");
    let (late, _) = read_until_close(&mut s, Duration::from_secs(10)).await;
    assert!(late.starts_with("HTTP/1.1 200"), "{late}");
    assert_eq!(
        header(&late, "connection")
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Some("close"),
        "{late}"
    );
    eventually("counted", Duration::from_secs(5), || async {
        let n = stat_sum(&mesh, "downstream_cx_max_duration_reached").await;
        (n >= 2).then_some(()).ok_or(n.to_string())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_its_response_costs_bounded_memory() {
    const SIZE: usize = 64 << 20;
    let body = bytes::Bytes::from(vec![b'x'; SIZE]);
    let addr =
        serve_fn(move |_| hyper::Response::new(http_body_util::Full::new(body.clone()))).await;
    let mesh = Mesh::start_raw(|port| Snapshot {
        listeners: vec![listener_with(port, hcm(port))],
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "all",
                &["*"],
                vec![rt(prefix("/"), to_cluster("big"))],
            )],
        )],
        clusters: vec![eds_cluster("big")],
        endpoints: vec![cla("big", &[addr])],
        ..Default::default()
    })
    .await;
    eventually("served", Duration::from_secs(15), || async {
        let r = raw_http1(
            mesh.port,
            b"HEAD / HTTP/1.1\r\nhost: example.com\r\nconnection: close\r\n\r\n",
            true,
        )
        .await;
        (r.status == 200).then_some(()).ok_or(format!("{r:?}"))
    })
    .await;
    let before = mesh.gw.rss_kib();
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    s.write_all(format!("GET / HTTP/1.1\r\nhost: {HOST}\r\n\r\n").as_bytes())
        .await
        .expect("write");
    // The client reads nothing for a while: the upstream keeps sending.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let grown = mesh.gw.rss_kib().saturating_sub(before) / 1024;
    eprintln!("a client not reading 64 MiB: the gateway grew by {grown} MiB");
    // What the gateway holds is bounded by its buffers and the sockets' (Envoy:
    // per_connection_buffer_limit_bytes, 1 MiB; Portico: backpressure from the client's
    // socket to the upstream's), not by the 64 MiB response.
    assert!(
        grown < 24,
        "the gateway grew by {grown} MiB for a client that does not read"
    );
    // Then it reads: everything arrives.
    let mut got = 0usize;
    let mut head = Vec::new();
    let mut chunk = vec![0u8; 1 << 16];
    let started = Instant::now();
    while got < SIZE && started.elapsed() < Duration::from_secs(60) {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
            .await
            .expect("data")
            .expect("read");
        assert!(n > 0, "closed after {got} body bytes");
        if head.is_empty() || !String::from_utf8_lossy(&head).contains("\r\n\r\n") {
            head.extend_from_slice(&chunk[..n]);
            if let Some(end) = String::from_utf8_lossy(&head).find("\r\n\r\n") {
                got = head.len() - end - 4;
            }
        } else {
            got += n;
        }
    }
    assert_eq!(got, SIZE);
}
