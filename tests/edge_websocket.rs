//! WebSockets through the gateway: `upgrade_configs` on the connection manager and per route,
//! the 101 switch to a raw byte stream both ways, close from either side, refusals (403), a
//! non-101 answer to an upgrade, route timeouts not applying to an upgraded stream, and an
//! upgraded connection surviving an RDS push that keeps its route. Runs against Envoy too
//! (PORTICO_GATEWAY_BIN).

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::route::v3::{route, route_action, Route};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::UpgradeConfig;
use envoy_types::pb::google::protobuf::BoolValue;
use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;

const HOST: &str = "ws.example.com";

/// A WebSocket echo server. Echoes text and binary frames; on the text `close`, it closes the
/// connection itself (code 1000, reason `bye`); on `hello?` it first sends `hello` unprompted.
/// Records the headers of every handshake it sees.
struct WsBackend {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<http::HeaderMap>>>,
}

async fn ws_backend() -> WsBackend {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                continue;
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                // The callback's error type is tungstenite's, large as it is.
                #[allow(clippy::result_large_err)]
                let cb = |req: &tokio_tungstenite::tungstenite::handshake::server::Request,
                          resp| {
                    seen.lock().expect("lock").push(req.headers().clone());
                    Ok(resp)
                };
                let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(sock, cb).await else {
                    return;
                };
                while let Some(Ok(msg)) = ws.next().await {
                    match msg {
                        Message::Text(t) if t.as_str() == "close" => {
                            let _ = ws
                                .close(Some(CloseFrame {
                                    code: CloseCode::Normal,
                                    reason: "bye".into(),
                                }))
                                .await;
                        }
                        Message::Text(t) if t.as_str() == "hello?" => {
                            let _ = ws.send(Message::text("hello")).await;
                            let _ = ws.send(Message::Text(t)).await;
                        }
                        Message::Text(_) | Message::Binary(_) => {
                            // A failed send shows as the end of the read loop.
                            let _ = ws.send(msg).await;
                        }
                        _ => {}
                    }
                }
            });
        }
    });
    WsBackend { addr, heads }
}

fn websocket(enabled: Option<bool>) -> UpgradeConfig {
    UpgradeConfig {
        upgrade_type: "websocket".into(),
        enabled: enabled.map(|value| BoolValue { value }),
        ..Default::default()
    }
}

/// A route to `cluster` with the route action adjusted by `f`.
fn route_with(
    m: envoy_types::pb::envoy::config::route::v3::RouteMatch,
    cluster: &str,
    f: impl FnOnce(&mut envoy_types::pb::envoy::config::route::v3::RouteAction),
) -> Route {
    let mut r = rt(m, to_cluster(cluster));
    if let Some(route::Action::Route(ra)) = r.action.as_mut() {
        f(ra);
    }
    r
}

fn route_upgrade(enabled: bool) -> route_action::UpgradeConfig {
    route_action::UpgradeConfig {
        upgrade_type: "websocket".into(),
        enabled: Some(BoolValue { value: enabled }),
        ..Default::default()
    }
}

type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

async fn connect(port: u16, path: &str) -> Result<(Ws, http::Response<Option<Vec<u8>>>), String> {
    let sock = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let req = format!("ws://{HOST}{path}")
        .into_client_request()
        .map_err(|e| e.to_string())?;
    tokio_tungstenite::client_async(req, sock)
        .await
        .map_err(|e| e.to_string())
}

/// The next data or close message, skipping pings; `None` at the end of the stream.
async fn next(ws: &mut Ws) -> Option<Message> {
    let read = async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                Some(Ok(m)) => return Some(m),
                _ => return None,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("websocket read timed out")
}

/// The listener with the given HCM upgrade configs, routes `/` (and `/nows` with the
/// route disabling WebSocket, `/route-ws` with the route enabling it) to the ws backend.
async fn mesh(
    backend: &WsBackend,
    hcm_upgrades: Vec<UpgradeConfig>,
    timeout: Option<Duration>,
) -> Mesh {
    let addr = backend.addr;
    let mesh = Mesh::start_raw(move |port| {
        let mut h = hcm(port);
        // Without dots, so the stats keep the whole prefix as their tag.
        h.stat_prefix = "ws_edge".into();
        h.upgrade_configs = hcm_upgrades;
        let t = timeout.map(|d| envoy_types::pb::google::protobuf::Duration {
            seconds: d.as_secs() as i64,
            nanos: d.subsec_nanos() as i32,
        });
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "ws",
                    &[HOST],
                    vec![
                        route_with(prefix("/nows"), "ws", |ra| {
                            ra.upgrade_configs.push(route_upgrade(false))
                        }),
                        route_with(prefix("/route-ws"), "ws", |ra| {
                            ra.upgrade_configs.push(route_upgrade(true))
                        }),
                        rt(prefix("/direct"), direct(200, "direct")),
                        route_with(prefix("/"), "ws", |ra| ra.timeout = t),
                    ],
                )],
            )],
            clusters: vec![eds_cluster("ws")],
            endpoints: vec![cla("ws", &[addr])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_routes_untouched().await;
    mesh
}

/// Waits until a WebSocket handshake on `path` succeeds (clusters warm after routes).
async fn connect_eventually(port: u16, path: &str) -> (Ws, http::Response<Option<Vec<u8>>>) {
    eventually("websocket handshake", PROPAGATION, || async {
        connect(port, path).await
    })
    .await
}

const GAPS: &[(&str, &str)] = &[];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_echo_both_ways_and_close_from_either_side() {
    let backend = ws_backend().await;
    // A short route timeout: an upgraded stream outlives it (Envoy never arms it for upgrades).
    let mesh = mesh(
        &backend,
        vec![websocket(None)],
        Some(Duration::from_millis(500)),
    )
    .await;
    let (mut ws, resp) = connect_eventually(mesh.port, "/echo").await;
    let mut c = Checks::with_gaps(GAPS);
    c.eq("handshake status", resp.status().as_u16(), 101);
    let h = |n: &str| {
        resp.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_ascii_lowercase)
    };
    c.eq("101 upgrade", h("upgrade"), Some("websocket".into()));
    c.eq("101 connection", h("connection"), Some("upgrade".into()));
    c.eq(
        "101 x-envoy-upstream-service-time",
        h("x-envoy-upstream-service-time"),
        None,
    );
    c.eq("101 server", h("server"), Some("envoy".into()));
    c.ok(
        "101 sec-websocket-accept",
        h("sec-websocket-accept").is_some(),
        resp.headers(),
    );
    let head = backend
        .heads
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .unwrap_or_default();
    let b = |n: &str| {
        head.get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_ascii_lowercase)
    };
    c.eq("upstream upgrade", b("upgrade"), Some("websocket".into()));
    c.eq(
        "upstream connection",
        b("connection"),
        Some("upgrade".into()),
    );
    c.ok(
        "upstream sec-websocket-key",
        b("sec-websocket-key").is_some(),
        &head,
    );
    c.eq(
        "upstream x-forwarded-proto",
        b("x-forwarded-proto"),
        Some("http".into()),
    );
    c.ok("upstream x-request-id", b("x-request-id").is_some(), &head);

    ws.send(Message::text("ping one")).await.expect("send");
    c.eq(
        "text echo",
        next(&mut ws).await,
        Some(Message::text("ping one")),
    );
    let blob: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    ws.send(Message::binary(blob.clone())).await.expect("send");
    c.eq(
        "binary echo",
        next(&mut ws).await,
        Some(Message::binary(blob)),
    );
    // Quiet for longer than the route timeout.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    ws.send(Message::text("hello?"))
        .await
        .expect("send after idle");
    c.eq(
        "server push",
        next(&mut ws).await,
        Some(Message::text("hello")),
    );
    c.eq(
        "echo after idle",
        next(&mut ws).await,
        Some(Message::text("hello?")),
    );
    // The client closes: the close handshake goes through and the stream ends.
    ws.close(None).await.expect("close");
    let closed = next(&mut ws).await;
    c.ok(
        "client close answered",
        matches!(closed, Some(Message::Close(_)) | None),
        &closed,
    );
    c.eq("stream ends after client close", next(&mut ws).await, None);

    // The server closes.
    let (mut ws, _) = connect(mesh.port, "/echo").await.expect("second handshake");
    ws.send(Message::text("close")).await.expect("send");
    match next(&mut ws).await {
        Some(Message::Close(Some(f))) => {
            c.eq("server close code", f.code, CloseCode::Normal);
            c.eq(
                "server close reason",
                f.reason.as_str().to_string(),
                "bye".to_string(),
            );
        }
        other => c.ok("server close frame", false, other),
    }
    c.eq("stream ends after server close", next(&mut ws).await, None);
    c.finish();
}

fn upgrade_request(path: &str) -> Vec<u8> {
    format!(
        "GET {path} HTTP/1.1\r\nhost: {HOST}\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\
         sec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    .into_bytes()
}

/// What the gateway answers to an upgrade request it refuses: a bare 403 that closes.
fn check_refused(c: &mut Checks, what: &str, r: &RawResp) {
    c.eq(format!("{what}: status"), r.status, 403);
    c.eq(format!("{what}: body"), r.body_str(), String::new());
    c.eq(
        format!("{what}: content-length"),
        r.header("content-length"),
        Some("0"),
    );
    c.eq(
        format!("{what}: connection"),
        r.header("connection"),
        Some("close"),
    );
    c.eq(format!("{what}: upgrade"), r.header("upgrade"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrades_without_upgrade_configs_are_refused() {
    let backend = ws_backend().await;
    let mesh = mesh(&backend, Vec::new(), None).await;
    let mut c = Checks::with_gaps(GAPS);
    let r = raw_http1(mesh.port, &upgrade_request("/echo"), false).await;
    check_refused(&mut c, "no upgrade_configs", &r);
    // An upgrade type the connection manager lists as disabled is refused too.
    drop(mesh);
    let mesh = self::mesh(&backend, vec![websocket(Some(false))], None).await;
    let r = raw_http1(mesh.port, &upgrade_request("/echo"), false).await;
    check_refused(&mut c, "hcm websocket disabled", &r);
    // ... unless the route enables it.
    let r = connect(mesh.port, "/route-ws")
        .await
        .map(|(_, r)| r.status().as_u16());
    c.eq("route enables what the hcm disables", r, Ok(101));
    // Without `Connection: upgrade` the Upgrade header is hop-by-hop noise: a plain request.
    let plain = format!(
        "GET /direct HTTP/1.1\r\nhost: {HOST}\r\nupgrade: websocket\r\nconnection: close\r\n\r\n"
    );
    let r = raw_http1(mesh.port, plain.as_bytes(), false).await;
    c.eq("upgrade header without connection: upgrade", r.status, 200);
    c.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_can_disable_or_enable_websocket() {
    let backend = ws_backend().await;
    let mesh = mesh(&backend, vec![websocket(None)], None).await;
    let mut c = Checks::with_gaps(GAPS);
    let (ws, _) = connect_eventually(mesh.port, "/").await;
    let stat = |text: &str, name: &str| {
        prom_value(text, name, "envoy_http_conn_manager_prefix", "ws_edge")
    };
    let text = mesh.gw.prometheus().await;
    let total_before = stat(&text, "envoy_http_downstream_cx_upgrades_total");
    c.eq(
        "upgrades_active with one open",
        stat(&text, "envoy_http_downstream_cx_upgrades_active"),
        1.0,
    );
    drop(ws);
    let r = raw_http1(mesh.port, &upgrade_request("/nows"), false).await;
    check_refused(&mut c, "route disables", &r);
    let r = connect(mesh.port, "/route-ws")
        .await
        .map(|(_, r)| r.status().as_u16());
    c.eq("route enables", r, Ok(101));
    // The whole Upgrade value names the type, in any case: a list or an empty value matches
    // nothing.
    for (what, value, want) in [
        ("a list", "websocket, foo", 403),
        ("empty", "", 403),
        ("other case", "WebSocket", 101),
    ] {
        let req = String::from_utf8(upgrade_request("/echo"))
            .expect("ascii")
            .replace("upgrade: websocket", &format!("upgrade: {value}"));
        let (status, _) = head_only(mesh.port, req.as_bytes()).await;
        c.eq(format!("upgrade {what}: status"), status, want);
    }
    // A direct response has no upgrade map: the connection manager allows, the route answers.
    let r = raw_http1(mesh.port, &upgrade_request("/direct"), false).await;
    c.eq("direct response status", r.status, 200);
    c.eq("direct response body", r.body_str(), "direct".to_string());
    // No route at all: the connection manager allows, so it is a plain 404.
    let mut req = upgrade_request("/echo");
    req = String::from_utf8(req)
        .expect("ascii")
        .replace(HOST, "nowhere.example")
        .into_bytes();
    let r = raw_http1(mesh.port, &req, false).await;
    c.eq("no route status", r.status, 404);
    // Counted as Envoy counts them: a refusal is `ws_on_non_ws_route`; every upgrade let
    // through the filter chain (route-ws, WebSocket, direct, no route) is an upgrade, active until it ends.
    let text = eventually("upgrades to end", PROPAGATION, || async {
        let text = mesh.gw.prometheus().await;
        match stat(&text, "envoy_http_downstream_cx_upgrades_active") {
            0.0 => Ok(text),
            n => Err(format!("{n} active")),
        }
    })
    .await;
    c.eq(
        "ws_on_non_ws_route (nows, a list, empty)",
        stat(&text, "envoy_http_downstream_rq_ws_on_non_ws_route"),
        3.0,
    );
    c.eq(
        "upgrades_total after route-ws, WebSocket, direct, no route",
        stat(&text, "envoy_http_downstream_cx_upgrades_total") - total_before,
        4.0,
    );
    c.finish();
}

/// A raw HTTP/1.1 backend answering every request with `reply`; records each request head.
async fn raw_backend(reply: &'static [u8]) -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                continue;
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Ok(n) = sock.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head: Vec<u8> = buf.drain(..end + 4).collect();
                        seen.lock()
                            .expect("lock")
                            .push(String::from_utf8_lossy(&head).into_owned());
                        if sock.write_all(reply).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, heads)
}

async fn raw_mesh(addr: SocketAddr) -> Mesh {
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.upgrade_configs = vec![websocket(None)];
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "ws",
                    &[HOST],
                    vec![rt(prefix("/"), to_cluster("raw"))],
                )],
            )],
            clusters: vec![eds_cluster("raw")],
            endpoints: vec![cla("raw", &[addr])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_routes_untouched().await;
    mesh
}

/// Sends `request` and reads the response head only (an upgraded connection stays open):
/// status and lowercased header lines.
async fn head_only(port: u16, request: &[u8]) -> (u16, Vec<(String, String)>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(request).await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        Ok::<_, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(Duration::from_secs(5), io)
        .await
        .expect("response head in time")
        .expect("io");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let mut lines = text.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers)
}

/// A backend that answers an upgrade request with a plain 200: a normal response, though
/// Envoy passes only its head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_101_answer_to_an_upgrade_is_a_normal_response() {
    let (addr, heads) =
        raw_backend(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-backend: raw\r\n\r\nplain").await;
    let mesh = raw_mesh(addr).await;
    let mut c = Checks::with_gaps(GAPS);
    let r = raw_http1(mesh.port, &upgrade_request("/x"), false).await;
    c.eq("status", r.status, 200);
    // Envoy relays the head only, and closes: the rest of the connection was the upgrade's.
    c.eq("body", r.body_str(), String::new());
    c.eq("content-length", r.header("content-length"), Some("0"));
    c.eq("connection", r.header("connection"), Some("close"));
    let head = heads
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .unwrap_or_default()
        .to_ascii_lowercase();
    c.ok(
        "upstream connection: upgrade",
        head.contains("\r\nconnection: upgrade\r\n"),
        &head,
    );
    c.ok(
        "upstream upgrade: websocket",
        head.contains("\r\nupgrade: websocket\r\n"),
        &head,
    );
    c.ok(
        "upstream expected timeout",
        head.contains("\r\nx-envoy-expected-rq-timeout-ms: 15000\r\n"),
        &head,
    );
    c.eq("x-backend", r.header("x-backend"), Some("raw"));
    c.eq("upgrade", r.header("upgrade"), None);
    c.eq(
        "x-envoy-upstream-service-time",
        r.header("x-envoy-upstream-service-time").is_some(),
        false,
    );
    c.finish();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_connection_survives_rds_and_cds_pushes() {
    let backend = ws_backend().await;
    let other = Backend::start("other").await;
    let mesh = mesh(&backend, vec![websocket(None)], None).await;
    let (mut ws, _) = connect_eventually(mesh.port, "/echo").await;
    ws.send(Message::text("before")).await.expect("send");
    assert_eq!(next(&mut ws).await, Some(Message::text("before")));
    // The same route table plus a new virtual host for another cluster.
    let addr = backend.addr;
    let port = mesh.port;
    let routes = vec![route_config(
        &route_name(port),
        vec![
            vhost("ws", &[HOST], vec![rt(prefix("/"), to_cluster("ws"))]),
            vhost(
                "other",
                &["other.example.com"],
                vec![rt(prefix("/"), to_cluster("other"))],
            ),
        ],
    )];
    mesh.ads
        .set_clusters("2", &[eds_cluster("ws"), eds_cluster("other")]);
    mesh.ads
        .set_endpoints("2", &[cla("ws", &[addr]), cla("other", &[other.addr])]);
    mesh.ads.set_routes("2", &routes);
    mesh.wait_backend("/", "other.example.com", &[], "other")
        .await;
    ws.send(Message::text("after"))
        .await
        .expect("send after push");
    assert_eq!(next(&mut ws).await, Some(Message::text("after")));
    // Even a push that removes its route leaves an upgraded stream alone: the route was
    // resolved when it started.
    mesh.ads.set_routes(
        "3",
        &[route_config(
            &route_name(port),
            vec![vhost(
                "other",
                &["other.example.com"],
                vec![rt(prefix("/"), to_cluster("other"))],
            )],
        )],
    );
    mesh.wait_status("/", HOST, 404).await;
    ws.send(Message::text("route gone"))
        .await
        .expect("send after the route went");
    assert_eq!(next(&mut ws).await, Some(Message::text("route gone")));
    ws.close(None).await.expect("close");
}

/// Whether the gateway accepted `version` of `type_url` (ACK) or refused it (NACK, with the
/// reason), judged from the requests logged after `since`.
async fn verdict(
    ads: &AdsServer,
    type_url: &str,
    version: &str,
    since: usize,
) -> Result<(), String> {
    let deadline = std::time::Instant::now() + PROPAGATION;
    loop {
        for r in ads.log().into_iter().skip(since) {
            if r.type_url != type_url || r.response_nonce.is_empty() {
                continue;
            }
            if let Some(e) = r.error {
                return Err(e);
            }
            if r.version_info == version {
                return Ok(());
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no answer to {type_url} {version}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_upgrade_configs_are_rejected() {
    let backend = ws_backend().await;
    let mesh = mesh(&backend, vec![websocket(None)], None).await;
    let port = mesh.port;
    let mut c = Checks::with_gaps(GAPS);
    let routes = |ups: Vec<route_action::UpgradeConfig>| {
        vec![route_config(
            &route_name(port),
            vec![vhost(
                "ws",
                &[HOST],
                vec![route_with(prefix("/"), "ws", |ra| ra.upgrade_configs = ups)],
            )],
        )]
    };
    let named = |t: &str| route_action::UpgradeConfig {
        upgrade_type: t.into(),
        ..Default::default()
    };
    for (i, (what, ups, accepted)) in [
        (
            "route: the same upgrade twice",
            vec![named("websocket"), named("websocket")],
            false,
        ),
        (
            "route: names differing in case",
            vec![named("websocket"), named("WebSocket")],
            false,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let since = mesh.ads.log_len();
        let version = format!("r{i}");
        mesh.ads.set_routes(&version, &routes(ups));
        let v = verdict(&mesh.ads, RDS, &version, since).await;
        c.eq(what, v.is_ok(), accepted);
    }
    let listener = |ups: Vec<UpgradeConfig>| {
        let mut h = hcm(port);
        h.upgrade_configs = ups;
        listener_with(port, h)
    };
    let since = mesh.ads.log_len();
    mesh.ads.set_listeners(
        "l1",
        &[listener(vec![
            websocket(None),
            UpgradeConfig {
                upgrade_type: "WEBSOCKET".into(),
                ..Default::default()
            },
        ])],
    );
    let v = verdict(&mesh.ads, LDS, "l1", since).await;
    c.ok(
        "hcm: the same upgrade twice, differing in case",
        v.is_err(),
        &v,
    );
    c.finish();
}

/// Which of the downstream request's hop-by-hop headers reach the upstream on an upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_on_an_upgrade() {
    let (addr, heads) = raw_backend(
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\nkeep-alive: timeout=5\r\nx-resp-hop: 1\r\n\r\n",
    )
    .await;
    let mesh = raw_mesh(addr).await;
    let req = format!(
        "GET /x HTTP/1.1\r\nhost: {HOST}\r\nconnection: keep-alive, Upgrade, x-hop\r\nupgrade: websocket\r\n\
         x-hop: 1\r\nkeep-alive: timeout=5\r\nproxy-connection: keep-alive\r\nte: trailers, gzip\r\n\r\n"
    );
    let (status, resp) = head_only(mesh.port, req.as_bytes()).await;
    let header = |n: &str| {
        resp.iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.to_ascii_lowercase())
    };
    let head = heads
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .unwrap_or_default();
    let mut lines: Vec<String> = head
        .split("\r\n")
        .skip(1)
        .filter(|l| !l.is_empty())
        .map(|l| l.to_ascii_lowercase())
        .filter(|l| {
            [
                "connection:",
                "upgrade:",
                "x-hop:",
                "keep-alive:",
                "proxy-connection:",
                "te:",
            ]
            .iter()
            .any(|p| l.starts_with(p))
        })
        .collect();
    let mut c = Checks::with_gaps(GAPS);
    c.eq("switch status", status, 101);
    c.eq("101 keep-alive", header("keep-alive"), None);
    c.eq("101 x-resp-hop", header("x-resp-hop"), Some("1".into()));
    c.eq(
        "101 connection",
        header("connection"),
        Some("upgrade".into()),
    );
    // Header order is pingora's (a known codec difference); the set is what counts.
    let mut names: Vec<&str> = resp.iter().map(|(k, _)| k.as_str()).collect();
    names.sort_unstable();
    c.eq(
        "101 headers",
        names,
        vec!["connection", "date", "server", "upgrade", "x-resp-hop"],
    );
    lines.sort_unstable();
    c.eq(
        "upstream hop-by-hop headers",
        lines,
        vec![
            "connection: keep-alive, upgrade, x-hop".to_string(),
            "te: trailers, gzip".into(),
            "upgrade: websocket".into(),
            "x-hop: 1".into(),
        ],
    );
    c.finish();
}

/// The stream idle timeout still ends a quiet upgraded stream; traffic keeps it alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_idle_timeout_ends_a_quiet_websocket() {
    let backend = ws_backend().await;
    let addr = backend.addr;
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.upgrade_configs = vec![websocket(None)];
        h.stream_idle_timeout = Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 1,
            nanos: 0,
        });
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "ws",
                    &[HOST],
                    vec![rt(prefix("/"), to_cluster("ws"))],
                )],
            )],
            clusters: vec![eds_cluster("ws")],
            endpoints: vec![cla("ws", &[addr])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_routes_untouched().await;
    let (mut ws, _) = connect_eventually(mesh.port, "/").await;
    // Talking every 400 ms for 2 s: never idle for a whole second.
    for i in 0..5 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let m = Message::text(format!("m{i}"));
        ws.send(m.clone()).await.expect("send while active");
        assert_eq!(next(&mut ws).await, Some(m));
    }
    // Quiet for longer than the idle timeout: the gateway ends the stream.
    let started = std::time::Instant::now();
    let end = next(&mut ws).await;
    let took = started.elapsed();
    assert!(
        matches!(end, None | Some(Message::Close(_))),
        "expected the stream to end, got {end:?}"
    );
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_millis(3000),
        "ended after {took:?}"
    );
}

/// A backend that answers a request which asked for no upgrade with a 101: relayed as Envoy
/// relays it, its connection fields gone, dated like any response. (The own HTTP/1 loop skips
/// pingora's checks of the switch only for batches without a 101.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unasked_for_101_is_relayed_without_its_connection_fields() {
    let (addr, heads) = raw_backend(
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\nx-resp: 1\r\n\r\n",
    )
    .await;
    let mesh = raw_mesh(addr).await;
    let (status, headers) = head_only(
        mesh.port,
        format!("GET /plain HTTP/1.1\r\nhost: {HOST}\r\n\r\n").as_bytes(),
    )
    .await;
    let mut names: Vec<&str> = headers.iter().map(|(k, _)| k.as_str()).collect();
    names.sort_unstable();
    let mut c = Checks::default();
    c.eq(
        "requests the backend saw",
        heads.lock().expect("lock").len(),
        1,
    );
    c.eq("status", status, 101);
    c.eq(
        "header names",
        names,
        vec!["date", "server", "x-envoy-upstream-service-time", "x-resp"],
    );
    c.finish();
}
