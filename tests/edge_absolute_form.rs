//! Absolute-form request targets (RFC 9112 3.2.2: a server must accept them; the target's
//! authority replaces Host), as Envoy's HTTP/1 codec handles them. Runs against Envoy too.

mod common;

use common::*;

async fn mesh(echo: &EchoBackend) -> Mesh {
    let addr = echo.addr;
    Mesh::start(move |port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![
                vhost(
                    "example",
                    &["example.com", "example.com:*"],
                    vec![rt(prefix("/"), to_cluster("echo"))],
                ),
                vhost(
                    "other",
                    &["other.com"],
                    vec![rt(prefix("/"), direct(200, "other"))],
                ),
            ],
        )],
        clusters: vec![eds_cluster("echo")],
        endpoints: vec![cla("echo", &[addr])],
        ..Default::default()
    })
    .await
}

/// One request on its own connection: (status, Host and target the backend saw).
async fn send(m: &Mesh, head: &str) -> (u16, Option<String>, Option<String>) {
    let req = format!("{head}\r\nconnection: close\r\n\r\n");
    let r = raw_http1(m.port, req.as_bytes(), false).await;
    (
        r.status,
        r.header("x-echo-host").map(str::to_string),
        r.header("x-echo-path").map(str::to_string),
    )
}

fn ok(host: &str, path: &str) -> (u16, Option<String>, Option<String>) {
    (200, Some(host.into()), Some(path.into()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absolute_form_targets_route_by_their_authority() {
    let echo = EchoBackend::start("echo").await;
    let m = mesh(&echo).await;
    m.wait_status("/", "example.com", 200).await;
    let refused = (400, None, None);
    // The target's authority is the Host; its path (or "/") the target upstream.
    for (head, want) in [
        (
            "GET http://example.com/abs?q=1 HTTP/1.1",
            ok("example.com", "/abs?q=1"),
        ),
        ("GET http://example.com HTTP/1.1", ok("example.com", "/")),
        (
            "GET http://example.com?q HTTP/1.1",
            // The authority ends at the first /, as in Envoy: no such host.
            (404, None, None),
        ),
        (
            "GET HTTP://Example.COM:80/x HTTP/1.1",
            ok("Example.COM:80", "/x"),
        ),
        (
            "GET https://example.com/x HTTP/1.1",
            ok("example.com", "/x"),
        ),
        (
            "OPTIONS http://example.com HTTP/1.1",
            ok("example.com", "/"),
        ),
        (
            "GET http://example.com/x HTTP/1.1\r\nhost: example.com",
            ok("example.com", "/x"),
        ),
        // Only http(s), and an authority.
        ("GET ftp://example.com/x HTTP/1.1", refused.clone()),
        (
            "GET http:///x HTTP/1.1\r\nhost: example.com",
            refused.clone(),
        ),
    ] {
        let got = send(&m, head).await;
        assert_eq!((got.0, got.1, got.2), want, "{head}");
    }
    // Where Portico is stricter than Envoy, by pingora's HTTP/1 parser: a Host that differs
    // from the target's authority, or userinfo in the target, is refused (400) as ambiguous
    // (a request-smuggling shape) where Envoy drops the Host and routes by the target.
    let envoy = is_envoy(&gateway_bin());
    for head in [
        "GET http://example.com/x HTTP/1.1\r\nhost: other.com",
        "GET http://user@example.com/x HTTP/1.1",
    ] {
        let got = send(&m, head).await;
        if envoy {
            assert_eq!(got, ok("example.com", "/x"), "{head}");
        } else {
            assert_eq!(got.0, 400, "{head}");
        }
    }
}
