//! HTTP/2 abuse: the rapid reset flood (CVE-2023-44487), streams opened and reset in a loop,
//! must cost next to no backend requests and end the connection; PING, SETTINGS, empty DATA
//! and CONTINUATION floods are bounded; the connection manager's `http2_protocol_options`
//! and idle timeout apply to HTTP/2 connections. Runs against Envoy too:
//! `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test edge_h2_abuse`.

mod common;

use std::time::Duration;

use common::*;

const HOST: &str = "example.com";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_costs_no_backend_requests_and_ends_the_connection() {
    let web = Backend::start_delayed("web", Duration::from_millis(200)).await;
    let mesh = Mesh::start_raw(|port| {
        Snapshot {
            listeners: vec![l(port)],
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
    let before = web.served();
    let sock = tokio::net::TcpStream::connect(("127.0.0.1", mesh.port))
        .await
        .expect("connect");
    let (mut h2, conn) = h2::client::Builder::new()
        .max_concurrent_reset_streams(100_000)
        .handshake::<_, bytes::Bytes>(sock)
        .await
        .expect("h2 handshake");
    let conn = tokio::spawn(conn);
    let mut opened = 0usize;
    let flood = async {
        for i in 0..5000 {
            h2 = match h2.ready().await {
                Ok(h) => h,
                Err(_) => break,
            };
            let req = http::Request::get(format!("http://{HOST}/r{i}"))
                .body(())
                .expect("request");
            match h2.send_request(req, false) {
                Ok((_resp, mut stream)) => {
                    stream.send_reset(h2::Reason::CANCEL);
                    opened += 1;
                }
                Err(_) => break,
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(20), flood).await;
    let ended = tokio::time::timeout(Duration::from_secs(10), conn).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let hits = web.served() - before;
    eprintln!("opened {opened} streams, backend saw {hits}, connection ended: {ended:?}");
    assert!(
        ended.is_ok(),
        "the gateway ends a connection that resets stream after stream"
    );
    // How: Portico (the h2 crate's reset accounting) sends GOAWAY ENHANCE_YOUR_CALM
    // "too_many_resets" mid-flood (about 1,700 streams here); Envoy 1.40 reads the whole
    // burst and then resets the connection (its premature-reset limit). Either way the flood
    // ends with the connection, and the backend sees a few percent of the streams at most.
    // A proxy without the mitigation forwards nearly every stream; a quarter is far above
    // what either proxy lets through (under 3 % in runs here).
    assert!(
        hits * 4 <= opened.max(10),
        "{hits} backend requests for {opened} reset streams"
    );
    // The gateway still serves others.
    assert_eq!(mesh.get("/", HOST, &[]).await.status, 200);
}

/// One HTTP/2 frame: a 9-byte head and its payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

const DATA: u8 = 0;
const HEADERS: u8 = 1;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const CONTINUATION: u8 = 9;
const END_STREAM: u8 = 1;
const END_HEADERS: u8 = 4;

/// `POST /` to example.com in HPACK without the dynamic table (static-table names).
fn post_block() -> Vec<u8> {
    let mut b = vec![0x83, 0x86, 0x84, 0x01, HOST.len() as u8];
    b.extend_from_slice(HOST.as_bytes());
    b
}

/// A header block fragment of `n` bytes of whole `x-pad: aaa...` literals.
fn padding_block(n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n);
    while out.len() + 130 <= n {
        out.extend_from_slice(&[0x00, 5]);
        out.extend_from_slice(b"x-pad");
        out.push(120);
        out.extend_from_slice(&[b'a'; 120]);
    }
    out
}

/// What a flood came to: bytes the gateway took, whether it ended the connection, and
/// whether it answered with GOAWAY.
#[derive(Debug)]
struct Flood {
    sent: usize,
    closed: bool,
    goaway: bool,
}

/// Opens an HTTP/2 connection (preface, empty SETTINGS, then `start`) and writes `each`
/// `times` times, for at most `limit`. `read` reads what the gateway sends meanwhile (an
/// attacker that never reads makes the gateway queue its answers).
async fn flood(
    port: u16,
    start: Vec<u8>,
    each: Vec<u8>,
    times: usize,
    read: bool,
    limit: Duration,
) -> Flood {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sock = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let (mut r, mut w) = sock.into_split();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(frame(SETTINGS, 0, 0, &[]));
    hello.extend(start);
    w.write_all(&hello).await.expect("preface");
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        let mut chunk = vec![0u8; 65536];
        if !read {
            // Read nothing until the flood is over, then look for the end.
            tokio::time::sleep(limit).await;
        }
        loop {
            match tokio::time::timeout(Duration::from_secs(5), r.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return (true, got),
                Ok(Ok(n)) => {
                    if got.len() < 1 << 20 {
                        got.extend_from_slice(&chunk[..n]);
                    }
                }
                Err(_) => return (false, got),
            }
        }
    });
    // Many frames per write, as a flooder would.
    let batch: Vec<u8> = each.repeat(64);
    let mut sent = 0usize;
    let started = std::time::Instant::now();
    let mut written = 0;
    while written < times && started.elapsed() < limit {
        let left = limit.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, w.write_all(&batch)).await {
            Ok(Ok(())) => {
                sent += batch.len();
                written += 64;
            }
            _ => break,
        }
    }
    drop(w);
    let (closed, got) = reader.await.expect("reader");
    // A GOAWAY frame anywhere in what was read (type 7 on stream 0).
    let goaway = got
        .windows(9)
        .any(|h| h[3] == 7 && h[5..9] == [0, 0, 0, 0] && h[4] == 0);
    Flood {
        sent,
        closed,
        goaway,
    }
}

/// A gateway routing to a backend that keeps requests waiting, and its RSS at rest.
async fn h2_mesh() -> (Backend, Mesh) {
    let web = Backend::start_delayed("web", Duration::from_millis(200)).await;
    let mesh = Mesh::start_raw(|port| {
        Snapshot {
            listeners: vec![l(port)],
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
    (web, mesh)
}

/// After a flood: the gateway still serves, and did not grow by more than `mib`.
async fn unharmed(mesh: &Mesh, rss_before: u64, mib: u64, what: &str) {
    assert_eq!(mesh.get("/", HOST, &[]).await.status, 200, "{what}");
    let grown = mesh.gw.rss_kib().saturating_sub(rss_before) / 1024;
    assert!(grown <= mib, "{what}: RSS grew by {grown} MiB");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_and_settings_floods_from_a_client_that_never_reads_are_bounded() {
    let (_web, mesh) = h2_mesh().await;
    let before = mesh.gw.rss_kib();
    for (name, each) in [
        ("PING", frame(PING, 0, 0, &[7; 8])),
        ("SETTINGS", frame(SETTINGS, 0, 0, &[0, 3, 0, 0, 0, 100])),
    ] {
        // 1,000,000 frames would be 17-15 MB of answers queued for a client that never reads.
        let f = flood(
            mesh.port,
            Vec::new(),
            each,
            1_000_000,
            false,
            Duration::from_secs(8),
        )
        .await;
        eprintln!("{name} flood: {f:?}");
        // Envoy closes the connection past 1,000 queued control frames
        // (`max_outbound_control_frames`); Portico's HTTP/2 codec answers one PING or SETTINGS
        // at a time and stops reading while the answer cannot be sent. Measured here, both
        // had closed the connection by the end (after 4-10 MB written); what must hold is
        // that the gateway keeps a bounded amount.
        assert!(f.closed || f.sent < 64 << 20, "{name}: {f:?}");
        unharmed(&mesh, before, 64, name).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_data_frames_flood_is_bounded() {
    let (_web, mesh) = h2_mesh().await;
    let before = mesh.gw.rss_kib();
    let start = frame(HEADERS, END_HEADERS, 1, &post_block());
    let f = flood(
        mesh.port,
        start,
        frame(DATA, 0, 1, &[]),
        2_000_000,
        true,
        Duration::from_secs(8),
    )
    .await;
    eprintln!("empty DATA flood: {f:?}");
    // Both end the connection: Portico's codec (the h2 crate) with GOAWAY after a few hundred
    // KB of empty frames; Envoy 1.40 by closing it, here after about 9 MB read
    // (`max_consecutive_inbound_frames_with_empty_payload`).
    assert!(f.closed, "{f:?}");
    unharmed(&mesh, before, 64, "empty DATA").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuation_flood_is_cut_off_at_the_header_limit() {
    let (web, mesh) = h2_mesh().await;
    let before_rss = mesh.gw.rss_kib();
    let served = web.served();
    // A header block that never ends: HEADERS without END_HEADERS, then CONTINUATION frames
    // of 16 KiB of header fields (CVE-2024-27316 class).
    let start = frame(HEADERS, END_STREAM, 1, &post_block());
    let f = flood(
        mesh.port,
        start,
        frame(CONTINUATION, 0, 1, &padding_block(16_000)),
        100_000,
        true,
        Duration::from_secs(10),
    )
    .await;
    eprintln!("CONTINUATION flood: {f:?}, ended by GOAWAY: {}", f.goaway);
    // Both end the connection once the block passes the header limit: Portico with GOAWAY
    // (about 3 MB taken, most of it in socket buffers), Envoy 1.40 by closing it (about
    // 15 MB taken here).
    assert!(f.closed, "{f:?}");
    assert!(f.sent < 32 << 20, "{f:?}");
    assert_eq!(web.served(), served, "nothing of it reaches the backend");
    unharmed(&mesh, before_rss, 64, "CONTINUATION").await;
}

/// The frames a gateway sends on a fresh HTTP/2 connection until it closes or `limit`
/// passes: (type, flags, stream, payload, when).
async fn frames_until_close(
    port: u16,
    limit: Duration,
) -> (Vec<(u8, u8, u32, Vec<u8>, Duration)>, Option<Duration>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let started = std::time::Instant::now();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(frame(SETTINGS, 0, 0, &[]));
    s.write_all(&hello).await.expect("preface");
    let mut buf = Vec::new();
    let mut frames = Vec::new();
    let mut chunk = [0u8; 16384];
    let mut acked = false;
    loop {
        while buf.len() >= 9 {
            let len =
                (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            let f: Vec<u8> = buf.drain(..9 + len).collect();
            let stream = u32::from_be_bytes([f[5], f[6], f[7], f[8]]) & 0x7fff_ffff;
            if f[3] == SETTINGS && f[4] & 1 == 0 && !acked {
                s.write_all(&frame(SETTINGS, 1, 0, &[])).await.expect("ack");
                acked = true;
            }
            frames.push((f[3], f[4], stream, f[9..].to_vec(), started.elapsed()));
        }
        let left = limit.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, s.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (frames, Some(started.elapsed())),
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
            Err(_) => return (frames, None),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_managers_http2_settings_are_advertised_and_idle_connections_close() {
    use envoy_types::pb::envoy::config::core::v3::{Http2ProtocolOptions, HttpProtocolOptions};
    use envoy_types::pb::google::protobuf::UInt32Value;
    let web = Backend::start("web").await;
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.http2_protocol_options = Some(Http2ProtocolOptions {
            max_concurrent_streams: Some(UInt32Value { value: 7 }),
            initial_stream_window_size: Some(UInt32Value { value: 131_072 }),
            initial_connection_window_size: Some(UInt32Value { value: 1_048_576 }),
            ..Default::default()
        });
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
    let (frames, closed) = frames_until_close(mesh.port, Duration::from_secs(15)).await;
    let summary: Vec<String> = frames
        .iter()
        .map(|(t, fl, s, p, at)| {
            format!("type {t} flags {fl} stream {s} len {} at {at:?}", p.len())
        })
        .collect();
    eprintln!("{summary:#?} closed {closed:?}");
    let settings = frames
        .iter()
        .find(|f| f.0 == SETTINGS && f.1 & 1 == 0)
        .expect("the server's SETTINGS");
    let params: Vec<(u16, u32)> = settings
        .3
        .chunks(6)
        .map(|c| {
            (
                u16::from_be_bytes([c[0], c[1]]),
                u32::from_be_bytes([c[2], c[3], c[4], c[5]]),
            )
        })
        .collect();
    // SETTINGS_MAX_CONCURRENT_STREAMS (3), SETTINGS_INITIAL_WINDOW_SIZE (4).
    assert!(params.contains(&(3, 7)), "{params:?}");
    assert!(params.contains(&(4, 131_072)), "{params:?}");
    // The connection window grows from the protocol's 65,535 with a WINDOW_UPDATE on stream 0.
    let grown: u32 = frames
        .iter()
        .filter(|f| f.0 == 8 && f.2 == 0)
        .map(|f| u32::from_be_bytes([f.3[0], f.3[1], f.3[2], f.3[3]]) & 0x7fff_ffff)
        .sum();
    assert_eq!(grown, 1_048_576 - 65_535, "{summary:#?}");
    // Idle: closed after idle_timeout (1 s), drain_timeout (5 s) and the delayed close (1 s):
    // 7.0 s on both. Envoy also sends GOAWAY at 1 s and again at 6 s; Portico (pingora's
    // HTTP/2 server) closes without one, so a client that starts a stream in between is
    // served rather than sent away.
    let closed = closed.expect("the idle connection is closed");
    assert!(
        closed >= Duration::from_millis(900) && closed < Duration::from_secs(9),
        "closed after {closed:?}"
    );
}
