//! The gateway as pilot-agent (istio-agent) drives it: started with the flags pilot-agent
//! passes to envoy (`pkg/envoy/proxy.go` `args()`), polled for readiness as its probe does
//! (`pilot/cmd/pilot-agent/status/util/stats.go`), then the admin endpoints it and istioctl use.
//! Runs against Envoy too: `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test
//! admin_pilot_agent`.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

const WAIT: Duration = Duration::from_secs(15);

/// A gateway started with exactly the flags given (pilot-agent's list has `--concurrency`,
/// `-l` and `--disable-hot-restart`, which `common::Gateway` adds itself). Killed on drop.
struct Proc {
    child: Child,
    admin: u16,
    stderr: std::path::PathBuf,
    _dir: TempDir,
}

impl Proc {
    fn start(bootstrap: impl FnOnce(u16) -> String, args: &[&str]) -> Proc {
        let dir = TempDir::new("portico-pilot-agent");
        let admin = free_port();
        let path = dir.path.join("envoy-rev.json.yaml");
        std::fs::write(&path, bootstrap(admin)).expect("write bootstrap");
        let stderr = dir.path.join("stderr");
        let out = std::fs::File::create(&stderr).expect("stderr file");
        let child = Command::new(gateway_bin())
            .arg("-c")
            .arg(&path)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().expect("dup")))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("spawn gateway");
        Proc {
            child,
            admin,
            stderr,
            _dir: dir,
        }
    }

    /// One request written as pilot-agent's Go client writes it: the query unescaped.
    async fn admin(&self, method: &str, target: &str) -> RawResp {
        let req = format!(
            "{method} {target} HTTP/1.1\r\nhost: localhost:{}\r\nuser-agent: Go-http-client/1.1\r\naccept-encoding: gzip\r\n\r\n",
            self.admin
        );
        raw_http1(self.admin, req.as_bytes(), false).await
    }
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

/// pilot-agent's `parseStats`: the first line starting with the name, split on ':' into
/// exactly two parts, the second a u64. Missing: 0.
fn parse_stat(body: &str, name: &str) -> Result<u64, String> {
    match body.lines().find(|l| l.starts_with(name)) {
        None => Ok(0),
        Some(line) => {
            let parts: Vec<&str> = line.split(':').collect();
            if parts.len() != 2 {
                return Err(format!("envoy stat {name} missing separator. line:{line}"));
            }
            parts[1]
                .trim()
                .parse()
                .map_err(|e| format!("failed parsing Envoy stat {name} ({e}) line: {line}"))
        }
    }
}

const READY_QUERY: &str =
    r"/stats?usedonly&filter=^(server\.state|listener_manager\.workers_started)";
const UPDATE_QUERY: &str = r"/stats?usedonly&filter=^(cluster_manager\.cds|listener_manager\.lds)\.(update_success|update_rejected)$";

/// pilot-agent's readiness probe: CDS and LDS updated once, then `server.state` LIVE and
/// workers started.
async fn probe(gw: &Proc) -> Result<(), String> {
    let r = gw.admin("GET", UPDATE_QUERY).await;
    if r.status != 200 {
        return Err(format!("update stats: {} {}", r.status, r.body_str()));
    }
    let body = r.body_str();
    let (cds, lds) = (
        parse_stat(&body, "cluster_manager.cds.update_success")?,
        parse_stat(&body, "listener_manager.lds.update_success")?,
    );
    if cds == 0 || lds == 0 {
        return Err(format!("config not received: cds {cds}, lds {lds}"));
    }
    let r = gw.admin("GET", READY_QUERY).await;
    let body = r.body_str();
    for name in ["server.state", "listener_manager.workers_started"] {
        if !body.contains(name) {
            return Err(format!("{name} is not yet updated: {body:?}"));
        }
    }
    match (
        parse_stat(&body, "server.state")?,
        parse_stat(&body, "listener_manager.workers_started")?,
    ) {
        (0, 1) => Ok(()),
        other => Err(format!("(state, workers_started) = {other:?}")),
    }
}

fn json(r: &RawResp) -> serde_json::Value {
    assert_eq!(r.status, 200, "{}", r.body_str());
    serde_json::from_slice(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body_str()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pilot_agent_probes_ready_and_drives_the_admin_api() {
    let web = Backend::start("web").await;
    let port = free_port();
    let snapshot = Snapshot {
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
    .with_backends(&[("web", &web)]);
    let ads = AdsServer::start_any("1", &snapshot).await;
    // pilot-agent's flags, in its order (Istio 1.30 with ISTIO_BOOTSTRAP_OVERRIDE set).
    let gw = Proc::start(
        |admin| bootstrap_yaml(admin, ads.port),
        &[
            PILOT_AGENT_FLAGS,
            &[
                "--config-yaml",
                r#"{"node":{"cluster":"from-config-yaml"}}"#,
                "--concurrency",
                "1",
            ],
        ]
        .concat(),
    );

    eventually("pilot-agent's probe to pass", WAIT, || probe(&gw)).await;
    let client = HttpClient::new();
    let url = format!("http://127.0.0.1:{port}/x");
    eventually("traffic to reach web", WAIT, || async {
        let r = client.get(&url, None, &[]).await;
        (r.backend() == Some("web"))
            .then_some(())
            .ok_or(format!("{} {:?}", r.status, r.error))
    })
    .await;

    // --config-yaml merged over -c.
    let info = json(&gw.admin("GET", "/server_info").await);
    assert_eq!(info["node"]["cluster"], "from-config-yaml", "{info}");
    assert_eq!(info["node"]["id"], NODE_ID, "{info}");

    // Text: `name: value`, counters and gauges sorted together by name.
    let text = gw.admin("GET", "/stats").await;
    assert_eq!(text.status, 200);
    let body = text.body_str();
    let numeric: Vec<(&str, u64)> = body
        .lines()
        .filter_map(|l| l.split_once(": "))
        .filter_map(|(n, v)| v.parse().ok().map(|v| (n, v)))
        .collect();
    let names: Vec<&str> = numeric.iter().map(|(n, _)| *n).collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted, "counters and gauges sorted by name");
    let stat = |name: &str| numeric.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
    assert_eq!(stat("server.state"), Some(0), "{body}");
    assert_eq!(stat("listener_manager.workers_started"), Some(1));
    assert!(stat("cluster_manager.cds.update_success") >= Some(1));
    assert!(stat("listener_manager.lds.update_success") >= Some(1));
    assert_eq!(stat("cluster_manager.cds.update_rejected"), Some(0));
    assert_eq!(stat("cluster.web.upstream_rq_200"), Some(1), "{body}");
    assert_eq!(
        stat(&format!("http.outbound_0.0.0.0_{port}.downstream_rq_total")),
        Some(1)
    );
    assert!(stat(&format!("listener.127.0.0.1_{port}.downstream_cx_active")).is_some());

    // usedonly leaves out what was never incremented; filter is a regex on the name.
    let r = gw
        .admin(
            "GET",
            r"/stats?usedonly&filter=^cluster_manager\.cds\.update_rejected$",
        )
        .await;
    assert_eq!((r.status, r.body_str()), (200, String::new()));
    let r = gw.admin("GET", "/stats?filter=(").await;
    assert_eq!(r.status, 400, "an invalid regex: {}", r.body_str());
    assert!(
        r.body_str().starts_with("Invalid re2 regex"),
        "{}",
        r.body_str()
    );

    // JSON, the same stats.
    let j = json(
        &gw.admin("GET", r"/stats?format=json&filter=^server\.state$")
            .await,
    );
    assert_eq!(
        j,
        serde_json::json!({"stats": [{"name": "server.state", "value": 0}]})
    );
    let j = json(&gw.admin("GET", "/stats?format=json").await);
    let entries = j["stats"].as_array().expect("stats array");
    assert!(entries
        .iter()
        .any(|e| e["name"] == "listener_manager.workers_started" && e["value"] == 1));

    // Prometheus, from /stats and /stats/prometheus.
    for target in ["/stats?format=prometheus", "/stats/prometheus"] {
        let r = gw.admin("GET", target).await;
        assert_eq!(r.status, 200);
        let p = r.body_str();
        assert!(
            p.contains("# TYPE envoy_server_state gauge\nenvoy_server_state{} 0\n"),
            "{target}: {p}"
        );
        let web_rq: f64 = prom_samples(&p, "envoy_cluster_upstream_rq_total")
            .iter()
            .filter(|(l, _)| l.get("envoy_cluster_name").map(String::as_str) == Some("web"))
            .map(|(_, v)| v)
            .sum();
        assert_eq!(web_rq, 1.0, "{p}");
    }

    // The global health-check-fail flag: /ready and server.state say DRAINING.
    let r = gw.admin("GET", "/healthcheck/fail").await;
    assert_eq!(
        (r.status, r.body_str().as_str()),
        (405, "Method GET not allowed, POST required.")
    );
    let r = gw.admin("POST", "/healthcheck/fail").await;
    assert_eq!((r.status, r.body_str().as_str()), (200, "OK\n"));
    let r = gw.admin("GET", "/ready").await;
    assert_eq!((r.status, r.body_str().as_str()), (503, "DRAINING\n"));
    let r = gw.admin("POST", "/healthcheck/ok").await;
    assert_eq!((r.status, r.body_str().as_str()), (200, "OK\n"));
    let r = gw.admin("GET", "/ready").await;
    assert_eq!((r.status, r.body_str().as_str()), (200, "LIVE\n"));

    // Loggers: Envoy's names, -l and --component-log-level applied, changed at run time.
    let r = gw.admin("GET", "/logging").await;
    assert_eq!(r.status, 405);
    let r = gw.admin("POST", "/logging").await;
    let listing = r.body_str();
    assert_eq!(r.status, 200);
    assert!(listing.starts_with("active loggers:\n"), "{listing}");
    for want in [
        "  misc: error\n",
        "  admin: warning\n",
        "  upstream: warning\n",
    ] {
        assert!(listing.contains(want), "{want:?} in {listing}");
    }
    let r = gw.admin("POST", "/logging?upstream=debug").await;
    assert!(
        r.body_str().contains("  upstream: debug\n"),
        "{}",
        r.body_str()
    );
    let r = gw.admin("POST", "/logging?level=info").await;
    assert!(r.body_str().contains("  misc: info\n"));
    assert!(r.body_str().contains("  upstream: info\n"));
    let r = gw.admin("POST", "/logging?nosuch=debug").await;
    assert_eq!(r.status, 400);
    assert!(
        r.body_str().starts_with("error: unknown logger name\n"),
        "{}",
        r.body_str()
    );

    // /clusters?format=json: Envoy's cluster_statuses.
    let c = json(&gw.admin("GET", "/clusters?format=json").await);
    let web_status = c["cluster_statuses"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["name"] == "web"))
        .unwrap_or_else(|| panic!("no web in {c}"));
    let host = &web_status["host_statuses"][0];
    assert_eq!(
        host["address"]["socket_address"]["port_value"],
        web.addr.port()
    );
    assert_eq!(host["health_status"]["eds_health_status"], "HEALTHY");
    assert_eq!(host["weight"], 1);

    // /memory and /runtime: Envoy's shapes.
    let m = json(&gw.admin("GET", "/memory").await);
    let allocated: u64 = m["allocated"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(allocated > 0, "{m}");
    let rt = json(&gw.admin("GET", "/runtime").await);
    assert!(rt["layers"].is_array() && rt["entries"].is_object(), "{rt}");

    // /quitquitquit: answered, then a clean exit.
    let r = gw.admin("GET", "/quitquitquit").await;
    assert_eq!(r.status, 405);
    let r = gw.admin("POST", "/quitquitquit").await;
    assert_eq!((r.status, r.body_str().as_str()), (200, "OK\n"));
    let mut gw = gw;
    let status = eventually("the gateway to exit", WAIT, || {
        let s = gw.child.try_wait();
        async move {
            match s {
                Ok(Some(s)) => Ok(s),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
    assert!(status.success(), "exit status {status}");
}

/// Before its first config, the readiness query must not let pilot-agent conclude ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_until_config_arrives() {
    // An ADS port nothing listens on: no config ever arrives.
    let dead = free_port();
    let gw = Proc::start(
        |admin| bootstrap_yaml(admin, dead),
        &[
            "--concurrency",
            "1",
            "--disable-hot-restart",
            "-l",
            "warning",
        ],
    );
    eventually("the admin port", WAIT, || async {
        let r = gw.admin("GET", "/ready").await;
        (r.status == 503)
            .then_some(())
            .ok_or(format!("{} {}", r.status, r.body_str()))
    })
    .await;
    assert!(probe(&gw).await.is_err());
    let r = gw.admin("GET", READY_QUERY).await;
    let body = r.body_str();
    // Envoy lists nothing or `server.state: 2` (PRE_INITIALIZING), never workers started.
    assert!(!body.contains("listener_manager.workers_started"), "{body}");
    if body.contains("server.state") {
        assert_ne!(parse_stat(&body, "server.state"), Ok(0), "{body}");
    }
}

#[test]
fn malformed_flag_values_exit_non_zero_naming_the_flag() {
    let bin = gateway_bin();
    let dir = TempDir::new("portico-flags");
    let path = dir.path.join("b.yaml");
    std::fs::write(&path, bootstrap_yaml(free_port(), free_port())).expect("write");
    for (flag, value) in [
        ("--local-address-ip-version", "v5"),
        ("--file-flush-interval-msec", "abc"),
        ("--drain-time-s", "ten"),
        ("--component-log-level", "nosuch:info"),
        ("--concurrency", "many"),
    ] {
        let o = Command::new(&bin)
            .args(["--mode", "validate", "-c"])
            .arg(&path)
            .args([flag, value])
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{flag} {value} accepted");
        // Envoy names the flag for some values only ("unknown IP address version 'v5'").
        if !is_envoy(&bin) {
            assert!(err.contains(flag), "{flag}: {err}");
        }
    }
}
