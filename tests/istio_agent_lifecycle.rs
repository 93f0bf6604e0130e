//! The gateway's life inside Istio's proxyv2 image, played as pilot-agent plays it: started on
//! the bootstrap pilot-agent renders (istio/istio's own golden renders, `tests/data/bootstrap/
//! istio/`, 1.30's template) with pilot-agent's flags, fed over DELTA_GRPC on a Unix socket as
//! istio-agent's xDS proxy feeds it, probed for readiness as the kubelet probes the pod (15021,
//! routed by the bootstrap's static listener to pilot-agent's status server, which asks the admin
//! API), scraped on 15090 with compression, then drained (`POST /drain_listeners?graceful`) and
//! terminated while clients have requests in flight.
//!
//! Runs against Envoy too: `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test
//! istio_agent_lifecycle`. One difference is by design: Envoy exits at once on SIGTERM (its
//! requests in flight fail; pilot-agent never sends it SIGTERM, it drains through the admin API
//! and kills it after the drain period), where Portico finishes them and then exits.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(20);

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bootstrap/istio")
}

fn goldens() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(golden_dir())
        .expect("golden bootstraps")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
}

/// Every bootstrap pilot-agent's template renders in Istio's own tests is accepted with
/// pilot-agent's flags, as Envoy accepts it; the two the proxies refuse are refused with the
/// field named.
#[test]
fn every_istio_golden_bootstrap_validates_with_pilot_agents_flags() {
    let bin = gateway_bin();
    let envoy = is_envoy(&bin);
    let files = goldens();
    assert!(files.len() >= 30, "{} goldens", files.len());
    for f in files {
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.unwrap_or_default();
        let out = Command::new(&bin)
            .args(["--mode", "validate", "-c"])
            .arg(&f)
            .args(PILOT_AGENT_FLAGS)
            .args(["--concurrency", "2"])
            .stdin(Stdio::null())
            .output()
            .expect("run the gateway");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        match name.as_str() {
            // Envoy 1.40 has no LightStep tracer any more; neither has Portico.
            "tracing_lightstep_golden.json" => {
                assert!(!out.status.success(), "{name} is refused");
                let want = if envoy {
                    "Didn't find a registered implementation"
                } else {
                    "tracing.http"
                };
                assert!(stderr.contains(want), "{name}: {stderr}");
            }
            // Ambient's `istio.workload.BootstrapExtension` exists in istio-proxy's Envoy, not
            // in upstream Envoy: Portico accepts it as istio-proxy does.
            "ambient_golden.json" if envoy => {
                assert!(!out.status.success(), "{name}: upstream Envoy refuses it");
            }
            _ => assert!(
                out.status.success(),
                "{name} must validate: {stdout}{stderr}"
            ),
        }
    }
}

/// Ports and paths of the golden bootstrap, rewritten to the test's own.
struct Ports {
    admin: u16,
    agent: u16,
    prometheus: u16,
    status: u16,
}

/// `default_golden.json` as pilot-agent renders it for this pod: the test's ports, the xDS
/// proxy's socket, the gateway's node identity. Everything else is Istio's, untouched.
fn istio_bootstrap(ports: &Ports, xds: &Path, sds: &Path) -> String {
    let text = std::fs::read_to_string(golden_dir().join("default_golden.json")).expect("golden");
    let mut b: serde_json::Value = serde_json::from_str(&text).expect("golden is JSON");
    fn walk(v: &mut serde_json::Value, f: &mut dyn FnMut(&str, &mut serde_json::Value)) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m.iter_mut() {
                    f(k, v);
                    walk(v, f);
                }
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(|v| walk(v, f)),
            _ => {}
        }
    }
    walk(&mut b, &mut |k, v| match k {
        "port_value" => {
            let to = match v.as_u64() {
                Some(15000) => ports.admin,
                Some(15020) => ports.agent,
                Some(15090) => ports.prometheus,
                Some(15021) => ports.status,
                other => panic!("unexpected port {other:?} in the golden"),
            };
            *v = to.into();
        }
        // Listeners bind loopback only: this test's traffic stays on 127.0.0.1.
        "address" if v == "0.0.0.0" => *v = "127.0.0.1".into(),
        "pipe" => {
            let path = v["path"].as_str().unwrap_or_default();
            let to = if path == "/tmp/XDS" { xds } else { sds };
            v["path"] = to.to_string_lossy().into_owned().into();
        }
        _ => {}
    });
    b["node"]["id"] =
        "router~127.0.0.1~istio-ingressgateway-7d4b9.istio-system~istio-system.svc.cluster.local"
            .into();
    b["node"]["cluster"] = "istio-ingressgateway.istio-system".into();
    serde_json::to_string_pretty(&b).expect("serialise")
}

/// The gateway process as pilot-agent starts it. Killed on drop.
struct Proc {
    child: Child,
    stderr: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "---- gateway output:\n{}\n----",
                std::fs::read_to_string(&self.stderr).unwrap_or_default()
            );
        }
    }
}

/// pilot-agent's `parseStats`: the first line starting with the name; missing is 0.
fn parse_stat(body: &str, name: &str) -> Option<u64> {
    match body.lines().find(|l| l.starts_with(name)) {
        None => Some(0),
        Some(line) => line.split_once(':')?.1.trim().parse().ok(),
    }
}

async fn admin(port: u16, method: &str, target: &str) -> RawResp {
    let req = format!(
        "{method} {target} HTTP/1.1\r\nhost: localhost:{port}\r\nuser-agent: Go-http-client/1.1\r\naccept-encoding: gzip\r\n\r\n"
    );
    raw_http1(port, req.as_bytes(), false).await
}

/// pilot-agent's readiness check (`pilot/cmd/pilot-agent/status/ready/probe.go`): CDS and LDS
/// updated once, then `server.state` LIVE (0) and the workers started.
async fn agent_ready(admin_port: u16) -> Result<(), String> {
    let r = admin(
        admin_port,
        "GET",
        r"/stats?usedonly&filter=^(cluster_manager\.cds|listener_manager\.lds)\.(update_success|update_rejected)$",
    )
    .await;
    let body = r.body_str();
    let cds = parse_stat(&body, "cluster_manager.cds.update_success");
    let lds = parse_stat(&body, "listener_manager.lds.update_success");
    if r.status != 200 || cds == Some(0) || lds == Some(0) {
        return Err(format!("config not received: {} {body}", r.status));
    }
    let r = admin(
        admin_port,
        "GET",
        r"/stats?usedonly&filter=^(server\.state|listener_manager\.workers_started)",
    )
    .await;
    let body = r.body_str();
    match (
        parse_stat(&body, "server.state"),
        parse_stat(&body, "listener_manager.workers_started"),
    ) {
        (Some(0), Some(1)) if body.contains("server.state") => Ok(()),
        other => Err(format!("(state, workers_started) = {other:?}: {body}")),
    }
}

/// pilot-agent's status server (15020) as far as the bootstrap's 15021 listener reaches it:
/// `/healthz/ready` answers 200 when the readiness check passes, 503 otherwise.
async fn fake_agent(port: u16, admin_port: u16) -> tokio::task::JoinHandle<()> {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind the agent's status port");
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf);
                let path = head.split_whitespace().nth(1).unwrap_or("");
                let (status, body) = if path == "/healthz/ready" {
                    match agent_ready(admin_port).await {
                        Ok(()) => ("200 OK", String::new()),
                        Err(e) => ("503 Service Unavailable", e),
                    }
                } else {
                    ("404 Not Found", String::new())
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    })
}

fn decode(encoding: Option<&str>, body: &[u8]) -> String {
    use std::io::Read;
    let mut out = String::new();
    match encoding {
        Some("gzip") => {
            flate2::read::GzDecoder::new(body)
                .read_to_string(&mut out)
                .expect("gzip decodes");
        }
        Some("br") => {
            brotli::Decompressor::new(body, 4096)
                .read_to_string(&mut out)
                .expect("brotli decodes");
        }
        Some("zstd") => {
            out = String::from_utf8(zstd::decode_all(body).expect("zstd decodes")).expect("utf-8")
        }
        _ => out = String::from_utf8_lossy(body).into_owned(),
    }
    out
}

/// Requests in a loop, each on whatever connection the client keeps, until told to stop;
/// counts answers and failures.
#[derive(Default)]
struct Load {
    ok: AtomicUsize,
    failed: AtomicUsize,
    closing: AtomicUsize,
    stop: AtomicBool,
    errors: std::sync::Mutex<Vec<String>>,
}

async fn keep_requesting(load: Arc<Load>, url: String) {
    let client = HttpClient::new();
    while !load.stop.load(Ordering::SeqCst) {
        let r = client.get(&url, None, &[]).await;
        if r.status == 200 && r.backend() == Some("web") {
            load.ok.fetch_add(1, Ordering::SeqCst);
            if r.header("connection") == Some("close") {
                load.closing.fetch_add(1, Ordering::SeqCst);
            }
        } else {
            load.failed.fetch_add(1, Ordering::SeqCst);
            if let Ok(mut e) = load.errors.lock() {
                e.push(format!("{} {:?}", r.status, r.error));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pilot_agent_lifecycle_on_istios_bootstrap_loses_no_request() {
    let bin = gateway_bin();
    let envoy = is_envoy(&bin);
    let web = Backend::start("web").await;
    let slow = Backend::start_delayed("slow", Duration::from_millis(1500)).await;
    let dir = TempDir::new("portico-istio-agent");
    let xds = dir.path.join("XDS");
    let sds = dir.path.join("SDS");
    let port = free_port();
    let routes = vec![
        rt(prefix("/slow"), to_cluster("slow")),
        rt(prefix("/"), to_cluster("web")),
    ];
    let snapshot = Snapshot {
        listeners: vec![l(port)],
        routes: vec![route_config(
            &route_name(port),
            vec![vhost("all", &["*"], routes)],
        )],
        ..Default::default()
    }
    .with_backends(&[("web", &web), ("slow", &slow)]);
    let ads = AdsServer::start_unix(&xds, "1", &snapshot).await;
    let ports = Ports {
        admin: free_port(),
        agent: free_port(),
        prometheus: free_port(),
        status: free_port(),
    };
    let agent = fake_agent(ports.agent, ports.admin).await;
    let bootstrap = dir.path.join("envoy-rev.json");
    std::fs::write(&bootstrap, istio_bootstrap(&ports, &xds, &sds)).expect("write bootstrap");
    let stderr = dir.path.join("stderr");
    let out = std::fs::File::create(&stderr).expect("stderr file");
    // pilot-agent's command line (pkg/envoy/proxy.go `args`), the drain time from the
    // bootstrap's proxy config (long enough that the drain below stays inside it).
    let mut flags: Vec<&str> = PILOT_AGENT_FLAGS.to_vec();
    if let Some(i) = flags.iter().position(|f| *f == "--drain-time-s") {
        flags[i + 1] = "20";
    }
    let mut gw = Proc {
        child: Command::new(&bin)
            .arg("-c")
            .arg(&bootstrap)
            .args(&flags)
            .args([
                "--config-yaml",
                r#"{"node":{"metadata":{"ISTIO_VERSION":"1.30.0"}}}"#,
                "--concurrency",
                "2",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().expect("dup")))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("spawn the gateway"),
        stderr,
    };

    // The kubelet's readiness probe: 15021 -> agent -> the admin API.
    let status_url = format!("http://127.0.0.1:{}/healthz/ready", ports.status);
    let client = HttpClient::new();
    eventually("the pod to become Ready", WAIT, || async {
        let r = client.get(&status_url, None, &[]).await;
        (r.status == 200)
            .then_some(())
            .ok_or(format!("{} {:?} {}", r.status, r.error, r.body))
    })
    .await;
    assert!(
        ads.first_node_id()
            .is_some_and(|id| id.starts_with("router~127.0.0.1~")),
        "the node identity reached the control plane over the xDS socket"
    );
    let url = format!("http://127.0.0.1:{port}/");
    eventually("traffic to reach web", WAIT, || async {
        let r = client.get(&url, None, &[]).await;
        (r.backend() == Some("web"))
            .then_some(())
            .ok_or(format!("{} {:?}", r.status, r.error))
    })
    .await;

    // Prometheus scrapes 15090: the admin's metrics, compressed as the client asks.
    let scrape = |enc: &str| {
        format!(
            "GET /stats/prometheus HTTP/1.1\r\nhost: 127.0.0.1\r\naccept-encoding: {enc}\r\n\r\n"
        )
    };
    for (ask, got) in [
        ("gzip", Some("gzip")),
        ("br", Some("br")),
        ("zstd", Some("zstd")),
        ("br;q=0.5, gzip;q=1.0", Some("gzip")),
        ("identity", None),
    ] {
        let r = raw_http1(ports.prometheus, scrape(ask).as_bytes(), false).await;
        assert_eq!(r.status, 200, "{ask}: {}", r.body_str());
        assert_eq!(r.header("content-encoding"), got, "{ask}: {:?}", r.headers);
        let text = decode(got, &r.body);
        assert!(
            text.contains("# TYPE envoy_server_state gauge\n"),
            "{ask}: {text}"
        );
        // Istio's stats matcher keeps the server's own stats (its inclusion list).
        assert!(text.contains("\nenvoy_server_state{} 0\n"), "{ask}: {text}");
        assert!(
            text.contains("\nenvoy_listener_manager_workers_started{} 1\n"),
            "{ask}: {text}"
        );
    }
    // The 15090 listener serves only the metrics.
    let r = raw_http1(
        ports.prometheus,
        b"GET /config_dump HTTP/1.1\r\nhost: x\r\n\r\n",
        false,
    )
    .await;
    assert_eq!(r.status, 404);

    // Clients keep sending while pilot-agent drains the gateway (pod deletion).
    let load = Arc::new(Load::default());
    let clients: Vec<_> = (0..4)
        .map(|_| tokio::spawn(keep_requesting(load.clone(), url.clone())))
        .collect();
    eventually("the load to run", WAIT, || async {
        (load.ok.load(Ordering::SeqCst) >= 20)
            .then_some(())
            .ok_or(String::from("waiting"))
    })
    .await;
    let r = admin(ports.admin, "POST", "/drain_listeners?graceful").await;
    assert_eq!((r.status, r.body_str().as_str()), (200, "OK\n"));
    let drained_at = load.ok.load(Ordering::SeqCst);
    let ready = admin(ports.admin, "GET", "/ready").await;
    let probe = client.get(&status_url, None, &[]).await;
    // A drain is not a failed health check: the server stays LIVE (as Envoy's does); the pod
    // leaves the Service because Kubernetes is deleting it, not through readiness.
    assert_eq!((ready.status, ready.body_str().as_str()), (200, "LIVE\n"));
    assert_eq!(probe.status, 200, "{}", probe.body);
    // Draining: every answer now tells its client to close (drain strategy immediate), and the
    // listener still takes the new connections clients open.
    eventually("answers during the drain", WAIT, || async {
        (load.closing.load(Ordering::SeqCst) >= 20
            && load.ok.load(Ordering::SeqCst) >= drained_at + 20)
            .then_some(())
            .ok_or(format!(
                "ok {} closing {}",
                load.ok.load(Ordering::SeqCst),
                load.closing.load(Ordering::SeqCst)
            ))
    })
    .await;

    // Requests in flight when the process is told to go.
    let slow_url = format!("http://127.0.0.1:{port}/slow");
    let in_flight: Vec<_> = (0..3)
        .map(|_| {
            let u = slow_url.clone();
            tokio::spawn(async move { HttpClient::new().get(&u, None, &[]).await })
        })
        .collect();
    eventually("the slow requests to reach the backend", WAIT, || async {
        (slow.served() == 3)
            .then_some(())
            .ok_or(format!("{}", slow.served()))
    })
    .await;
    // The Service has dropped the pod by now: clients stop opening connections to it.
    load.stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.await.expect("client task");
    }
    let errors = load.errors.lock().map(|e| e.clone()).unwrap_or_default();
    assert_eq!(
        load.failed.load(Ordering::SeqCst),
        0,
        "no request fails while draining: {errors:?}"
    );

    let sent = Instant::now();
    let term = Command::new("kill")
        .args(["-TERM", &gw.child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(term.success());
    let mut answers = Vec::new();
    for f in in_flight {
        answers.push(f.await.expect("in-flight task"));
    }
    let exit = eventually("the gateway to exit", WAIT, || {
        let s = gw.child.try_wait();
        async move {
            match s {
                Ok(Some(s)) => Ok(s),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    if envoy {
        // Envoy stops at once: its requests in flight are lost.
        assert!(
            answers.iter().all(|r| r.status != 200),
            "{:?}",
            answers.iter().map(|r| r.status).collect::<Vec<_>>()
        );
    } else {
        for r in &answers {
            assert_eq!(
                (r.status, r.backend()),
                (200, Some("slow")),
                "{:?}",
                r.error
            );
        }
        assert!(exit.success(), "{exit}");
        // It left as soon as its connections were gone, not at the end of the drain time.
        assert!(
            sent.elapsed() < Duration::from_secs(10),
            "{:?}",
            sent.elapsed()
        );
    }
    agent.abort();
}
