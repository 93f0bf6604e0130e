//! `portico control-plane` end to end: Istio YAML in a directory, the control plane's ADS
//! server, a gateway (Portico, or Envoy with PORTICO_GATEWAY_BIN) configured by it, and real
//! backends. The control plane is always Portico's binary.

mod common;
mod control_plane_support;

use std::path::Path;
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use common::*;
use control_plane_support::*;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LABELS: [(&str, &str); 1] = [("istio", "ingressgateway")];

/// An object the model rejects (`http` must be a list): reported, and the rest still served.
const BROKEN: &str = r#"apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: { name: broken, namespace: default }
spec:
  hosts: ["*"]
  http: "not a list"
"#;

#[tokio::test]
async fn traffic_follows_edits_of_the_config_dir() {
    let tmp = TempDir::new("portico-cp");
    let dir = tmp.path.join("config");
    std::fs::create_dir_all(&dir).expect("config dir");
    let v1 = Backend::start("reviews-v1").await;
    let v2 = Backend::start("reviews-v2").await;
    let v2b = Backend::start("reviews-v2b").await;
    let gw_port = free_port();
    write_config(
        &dir,
        gw_port,
        &[
            ("reviews-v1", "v1", v1.addr.port()),
            ("reviews-v2", "v2", v2.addr.port()),
        ],
        &[("v1", 100)],
    );
    write(&dir, "broken.yaml", BROKEN);

    let cp = ControlPlane::start(&dir, &tmp.path).await;
    let _gw = Gateway::start_labeled(cp.port, &LABELS).await;
    let url = format!("http://127.0.0.1:{gw_port}/reviews/1");
    wait_backend(&url, "reviews-v1").await;
    let log = cp.log();
    assert!(
        log.contains("broken.yaml: VirtualService '") && log.contains("broken': "),
        "the invalid object is logged by file, kind and name:\n{log}"
    );

    // A route edit (RDS): the VirtualService now sends everything to v2.
    write(
        &dir,
        "virtualservice.yaml",
        &virtual_service(&[("v2", 100)]),
    );
    wait_backend(&url, "reviews-v2").await;

    // An endpoint edit (EDS): subset v2's pod moves to another backend.
    write(
        &dir,
        "endpointslices.yaml",
        &endpoint_slices(&[
            ("reviews-v1", "v1", v1.addr.port()),
            ("reviews-v2", "v2", v2b.addr.port()),
        ]),
    );
    wait_backend(&url, "reviews-v2b").await;

    // A weight edit: back to v1 entirely.
    write(
        &dir,
        "virtualservice.yaml",
        &virtual_service(&[("v1", 100), ("v2", 0)]),
    );
    wait_backend(&url, "reviews-v1").await;

    // A weighted split: both subsets answer, in roughly the configured shares.
    write(
        &dir,
        "virtualservice.yaml",
        &virtual_service(&[("v1", 50), ("v2", 50)]),
    );
    wait_backend(&url, "reviews-v2b").await;
    let client = HttpClient::new();
    let mut v1_count = 0;
    for _ in 0..200 {
        match client.get(&url, None, &[]).await.backend() {
            Some("reviews-v1") => v1_count += 1,
            Some("reviews-v2b") => {}
            other => panic!("unexpected backend {other:?}"),
        }
    }
    // 200 draws at p = 0.5: outside 60..140 has probability below 1e-8.
    assert!(
        (60..=140).contains(&v1_count),
        "v1 served {v1_count} of 200"
    );
}

fn check(dir: &Path, extra: &[&str]) -> Output {
    portico()
        .args(["control-plane", "--check", "--config-dir"])
        .arg(dir)
        .args(extra)
        .output()
        .expect("run portico control-plane --check")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn check_reports_invalid_objects_and_sets_the_exit_code() {
    let tmp = TempDir::new("portico-cp-check");
    write_config(&tmp.path, 8080, &[("reviews-v1", "v1", 1)], &[("v1", 100)]);
    let ok = check(&tmp.path, &[]);
    assert!(ok.status.success(), "valid dir: {}", text(&ok.stderr));
    assert!(
        text(&ok.stdout).contains("5 objects, 0 invalid"),
        "{}",
        text(&ok.stdout)
    );

    write(&tmp.path, "broken.yaml", BROKEN);
    let bad = check(&tmp.path, &[]);
    assert_eq!(
        bad.status.code(),
        Some(1),
        "an invalid object fails --check"
    );
    let err = text(&bad.stderr);
    assert!(err.contains("broken.yaml"), "names the file: {err}");
    // The name may carry its namespace ('default/broken').
    assert!(
        err.contains("broken.yaml: VirtualService '") && err.contains("broken': "),
        "names kind and name: {err}"
    );
    assert!(
        text(&bad.stdout).contains("5 objects, 1 invalid"),
        "{}",
        text(&bad.stdout)
    );
}

#[test]
fn bad_flags_are_named() {
    let missing = portico()
        .args(["control-plane", "--config-dir", "/no/such/portico/dir"])
        .output()
        .expect("run");
    assert!(!missing.status.success());
    assert!(
        text(&missing.stderr).contains("--config-dir"),
        "{}",
        text(&missing.stderr)
    );

    let tmp = TempDir::new("portico-cp-flags");
    let listen = portico()
        .args(["control-plane", "--config-dir"])
        .arg(&tmp.path)
        .args(["--listen", "not-an-address"])
        .output()
        .expect("run");
    assert!(!listen.status.success());
    assert!(
        text(&listen.stderr).contains("--listen"),
        "{}",
        text(&listen.stderr)
    );

    let label = check(&tmp.path, &["--gateway-label", "no-equals-sign"]);
    assert!(!label.status.success());
    assert!(
        text(&label.stderr).contains("--gateway-label"),
        "{}",
        text(&label.stderr)
    );
}

/// The names istiod gives a gateway's resources, as `--check` lists them.
#[test]
fn check_lists_istio_resource_names() {
    let tmp = TempDir::new("portico-cp-names");
    write_config(
        &tmp.path,
        8080,
        &[("reviews-v1", "v1", 19082), ("reviews-v2", "v2", 19083)],
        &[("v1", 50), ("v2", 50)],
    );
    let o = check(&tmp.path, &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    for want in [
        "0.0.0.0_8080",
        "http.8080",
        "outbound|9080|v1|reviews.default.svc.cluster.local",
        "outbound|9080|v2|reviews.default.svc.cluster.local",
    ] {
        assert!(out.contains(want), "missing {want}:\n{out}");
    }
    // A gateway with other labels selects no Gateway: nothing to serve it.
    let other = check(&tmp.path, &["--gateway-label", "istio=other"]);
    assert!(
        text(&other.stdout).contains("listeners (0)"),
        "{}",
        text(&other.stdout)
    );
}

// ---------------------------------------------------------------------------------------------
// TLS, passthrough and TCP servers, with Kubernetes Secrets served over SDS

/// One HTTP/1.1 GET over TLS to `sni` on `port`, verifying the gateway's certificate with
/// `pki`: the DER certificate it presented and the response head.
async fn https_get(
    pki: &Pki,
    port: u16,
    sni: &str,
    path: &str,
) -> Result<(Vec<u8>, String), String> {
    https_get_as(pki, port, sni, path, None).await
}

/// `https_get`, presenting `client` as the client certificate when given.
async fn https_get_as(
    pki: &Pki,
    port: u16,
    sni: &str,
    path: &str,
    client: Option<&Leaf>,
) -> Result<(Vec<u8>, String), String> {
    let connector = match client {
        None => pki.client(),
        Some(leaf) => {
            let cfg = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(pki.roots())
            .with_client_auth_cert(
                vec![rustls::pki_types::CertificateDer::from(leaf.der.clone())],
                rustls::pki_types::PrivateKeyDer::Pkcs8(
                    rustls::pki_types::PrivatePkcs8KeyDer::from(leaf.key_der.clone()),
                ),
            )
            .map_err(|e| e.to_string())?;
            tokio_rustls::TlsConnector::from(std::sync::Arc::new(cfg))
        }
    };
    let run = async {
        let tcp = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from(sni.to_string()).map_err(|e| e.to_string())?;
        let mut tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let cert = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.to_vec())
            .ok_or("no certificate")?;
        let req = format!("GET {path} HTTP/1.1\r\nhost: {sni}\r\nconnection: close\r\n\r\n");
        tls.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut resp = Vec::new();
        let _ = tls.read_to_end(&mut resp).await;
        Ok((cert, String::from_utf8_lossy(&resp).to_lowercase()))
    };
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .map_err(|_| "timed out".to_string())?
}

#[tokio::test]
async fn https_with_a_kubernetes_secret_follows_its_rotation() {
    let tmp = TempDir::new("portico-cp-https");
    let dir = tmp.path.join("config");
    std::fs::create_dir_all(&dir).expect("config dir");
    let pki = Pki::new("cp-https-ca");
    let first = pki.leaf(&["shop.example.com"]);
    let web = Backend::start("web").await;
    let port = free_port();
    write(
        &dir,
        "gateway.yaml",
        &shop_config(
            port,
            "HTTPS",
            "{ mode: SIMPLE, credentialName: shop-cert }",
            web.addr.port(),
        ),
    );
    write(&dir, "secret.yaml", &tls_secret("shop-cert", &first));

    let cp = ControlPlane::start(&dir, &tmp.path).await;
    let _gw = Gateway::start_labeled(cp.port, &LABELS).await;
    // The certificate comes from the Secret, verified against the test CA; the route reaches
    // the backend.
    eventually(
        "HTTPS through the Secret's certificate",
        PROPAGATION,
        || async {
            match https_get(&pki, port, "shop.example.com", "/shop").await {
                Ok((cert, resp)) if cert == first.der && resp.contains("x-backend: web") => Ok(()),
                Ok((_, resp)) => Err(format!("unexpected: {resp}")),
                Err(e) => Err(e),
            }
        },
    )
    .await;

    // Rotation: the Secret file changes; new handshakes get the new certificate.
    let second = pki.leaf(&["shop.example.com"]);
    write(&dir, "secret.yaml", &tls_secret("shop-cert", &second));
    eventually("the rotated certificate", PROPAGATION, || async {
        match https_get(&pki, port, "shop.example.com", "/shop").await {
            Ok((cert, resp)) if cert == second.der && resp.contains("x-backend: web") => Ok(()),
            Ok((cert, _)) if cert == first.der => Err("still the first certificate".into()),
            Ok((_, resp)) => Err(format!("unexpected: {resp}")),
            Err(e) => Err(e),
        }
    })
    .await;
    // Secrets never reach the control plane's log.
    let log = cp.log();
    for key in [&first.key, &second.key] {
        let line = key.lines().nth(1).unwrap_or("");
        assert!(
            !line.is_empty() && !log.contains(line),
            "a key is in the log:\n{log}"
        );
    }
    assert!(!log.contains("PRIVATE KEY"), "{log}");
}

#[tokio::test]
async fn mutual_tls_with_the_ca_in_the_secret() {
    let tmp = TempDir::new("portico-cp-mtls");
    let dir = tmp.path.join("config");
    std::fs::create_dir_all(&dir).expect("config dir");
    let pki = Pki::new("cp-mtls-ca");
    let clients = Pki::new("cp-mtls-clients");
    let server = pki.leaf(&["bank.example.com"]);
    let client = clients.leaf_with_uris(&["client.example.com"], &["spiffe://td/ns/a/sa/good"]);
    let other = clients.leaf_with_uris(&["client.example.com"], &["spiffe://td/ns/a/sa/bad"]);
    let web = Backend::start("bank").await;
    let port = free_port();
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    write(
        &dir,
        "gateway.yaml",
        &format!(
            r#"apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {{ name: gw, namespace: default }}
spec:
  selector: {{ istio: ingressgateway }}
  servers:
  - port: {{ number: {port}, name: https, protocol: HTTPS }}
    hosts: ["bank.example.com"]
    tls:
      mode: MUTUAL
      credentialName: bank-cert
      subjectAltNames: ["spiffe://td/ns/a/sa/good"]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{ name: bank, namespace: default }}
spec:
  hosts: [bank.example.com]
  gateways: [gw]
  http:
  - route:
    - destination: {{ host: bank }}
---
apiVersion: v1
kind: Secret
metadata: {{ name: bank-cert, namespace: default }}
type: Opaque
data:
  tls.crt: {}
  tls.key: {}
  ca.crt: {}
{}"#,
            b64(&server.cert),
            b64(&server.key),
            b64(&clients.ca_pem()),
            service_at("bank", 80, "http", web.addr.port())
        ),
    );
    let cp = ControlPlane::start(&dir, &tmp.path).await;
    let _gw = Gateway::start_labeled(cp.port, &LABELS).await;
    eventually(
        "mTLS with the client CA from the Secret",
        PROPAGATION,
        || async {
            match https_get_as(&pki, port, "bank.example.com", "/", Some(&client)).await {
                Ok((_, resp)) if resp.contains("x-backend: bank") => Ok(()),
                Ok((_, resp)) => Err(format!("unexpected: {resp}")),
                Err(e) => Err(e),
            }
        },
    )
    .await;
    // istiod sets SANITIZE_SET with the subject, URI and DNS SANs for a gateway.
    let (_, resp) = https_get_as(&pki, port, "bank.example.com", "/", Some(&client))
        .await
        .expect("mTLS");
    assert!(
        resp.contains("x-echo-xfcc: hash=") && resp.contains("uri=spiffe://td/ns/a/sa/good"),
        "{resp}"
    );
    for (what, who) in [("no certificate", None), ("the wrong SAN", Some(&other))] {
        let r = https_get_as(&pki, port, "bank.example.com", "/", who).await;
        assert!(
            !r.as_ref().is_ok_and(|(_, resp)| resp.contains("x-backend")),
            "{what}: {r:?}"
        );
    }
}

#[tokio::test]
async fn https_redirect_sends_plain_http_to_https() {
    let tmp = TempDir::new("portico-cp-redirect");
    let dir = tmp.path.join("config");
    std::fs::create_dir_all(&dir).expect("config dir");
    let web = Backend::start("web").await;
    let port = free_port();
    write(
        &dir,
        "gateway.yaml",
        &shop_config(port, "HTTP", "{ httpsRedirect: true }", web.addr.port()),
    );
    let cp = ControlPlane::start(&dir, &tmp.path).await;
    let _gw = Gateway::start_labeled(cp.port, &LABELS).await;
    let req = b"GET /cart?id=7 HTTP/1.1\r\nhost: shop.example.com\r\nx-forwarded-proto: https\r\nconnection: close\r\n\r\n";
    // istiod's gateway trusts only its own view of the connection (use_remote_address), so a
    // client's x-forwarded-proto does not dodge the redirect.
    let r = eventually("the redirect", PROPAGATION, || async {
        let r = raw_http1(port, req, false).await;
        if r.status == 301 {
            Ok(r)
        } else {
            Err(format!("status {}", r.status))
        }
    })
    .await;
    assert_eq!(
        r.header("location"),
        Some("https://shop.example.com/cart?id=7")
    );
}

/// A TCP backend greeting each connection with `<name>\n` (over TLS when given a config),
/// then closing when the client does.
async fn greeter(name: &str, tls: Option<rustls::ServerConfig>) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind backend");
    let addr = listener.local_addr().expect("addr");
    let greeting = format!("{name}\n").into_bytes();
    let acceptor = tls.map(|c| tokio_rustls::TlsAcceptor::from(Arc::new(c)));
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (greeting, acceptor) = (greeting.clone(), acceptor.clone());
            tokio::spawn(async move {
                async fn greet<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
                    mut s: S,
                    g: &[u8],
                ) {
                    let _ = s.write_all(g).await;
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                    }
                }
                match acceptor {
                    Some(a) => {
                        if let Ok(s) = a.accept(tcp).await {
                            greet(s, &greeting).await;
                        }
                    }
                    None => greet(tcp, &greeting).await,
                }
            });
        }
    });
    addr
}

async fn first_line<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> Result<String, String> {
    let mut out = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b).await {
            Ok(0) => return Err(format!("closed after {:?}", String::from_utf8_lossy(&out))),
            Ok(_) if b[0] == b'\n' => return Ok(String::from_utf8_lossy(&out).into_owned()),
            Ok(_) => out.push(b[0]),
            Err(e) => return Err(format!("read: {e}")),
        }
    }
}

/// The greeting of the backend a TLS connection for `sni` reaches, its certificate verified.
async fn passthrough_greeting(pki: &Pki, port: u16, sni: &str) -> Result<String, String> {
    let run = async {
        let tcp = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from(sni.to_string()).map_err(|e| e.to_string())?;
        let mut tls = pki
            .client()
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        first_line(&mut tls).await
    };
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .map_err(|_| "timed out".to_string())?
}

async fn tcp_greeting(port: u16) -> Result<String, String> {
    let run = async {
        let mut tcp = TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        first_line(&mut tcp).await
    };
    tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .map_err(|_| "timed out".to_string())?
}

#[tokio::test]
async fn passthrough_by_sni_and_a_tcp_server() {
    let tmp = TempDir::new("portico-cp-l4");
    let dir = tmp.path.join("config");
    std::fs::create_dir_all(&dir).expect("config dir");
    let pki = Pki::new("cp-passthrough-ca");
    let db = greeter("db", Some(pki.server(&["db.pass.example.com"]))).await;
    let ledger = greeter("ledger", Some(pki.server(&["ledger.pass.example.com"]))).await;
    let echo = greeter("echo", None).await;
    let (tls_port, tcp_port) = (free_port(), free_port());
    write(
        &dir,
        "gateway.yaml",
        &format!(
            r#"apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {{ name: gw, namespace: default }}
spec:
  selector: {{ istio: ingressgateway }}
  servers:
  - port: {{ number: {tls_port}, name: tls, protocol: TLS }}
    hosts: ["*.pass.example.com"]
    tls: {{ mode: PASSTHROUGH }}
  - port: {{ number: {tcp_port}, name: tcp, protocol: TCP }}
    hosts: ["*"]
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{ name: pass, namespace: default }}
spec:
  hosts: ["*.pass.example.com"]
  gateways: [gw]
  tls:
  - match:
    - sniHosts: [db.pass.example.com]
    route:
    - destination: {{ host: db }}
  - match:
    - sniHosts: [ledger.pass.example.com]
    route:
    - destination: {{ host: ledger }}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{ name: tcp, namespace: default }}
spec:
  hosts: ["*"]
  gateways: [gw]
  tcp:
  - route:
    - destination: {{ host: echo }}
{}{}{}"#,
            service_at("db", 443, "tls", db.port()),
            service_at("ledger", 443, "tls", ledger.port()),
            service_at("echo", 9000, "tcp", echo.port()),
        ),
    );
    let cp = ControlPlane::start(&dir, &tmp.path).await;
    let _gw = Gateway::start_labeled(cp.port, &LABELS).await;
    // The backends' own certificates reach the client: the gateway only read the SNI.
    for (sni, want) in [
        ("db.pass.example.com", "db"),
        ("ledger.pass.example.com", "ledger"),
    ] {
        eventually(&format!("passthrough to {want}"), PROPAGATION, || async {
            match passthrough_greeting(&pki, tls_port, sni).await {
                Ok(g) if g == want => Ok(()),
                other => Err(format!("{other:?}")),
            }
        })
        .await;
    }
    // A name no route has: no chain, the connection is closed.
    assert!(
        passthrough_greeting(&pki, tls_port, "other.pass.example.com")
            .await
            .is_err(),
        "an unrouted SNI must not reach a backend"
    );
    eventually("TCP to echo", PROPAGATION, || async {
        match tcp_greeting(tcp_port).await {
            Ok(g) if g == "echo" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let log = cp.log();
    assert!(!log.contains("invalid:"), "nothing was left out:\n{log}");
}
