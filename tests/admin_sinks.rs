//! What the bootstrap sends elsewhere: `stats_sinks` (statsd over UDP, flushed each
//! `stats_flush_interval`) and the admin's access logs (`admin.access_log` and the legacy
//! `admin.access_log_path`). Runs against Envoy too.

mod common;

use std::time::Duration;

use common::*;

async fn start(ads: &AdsServer, extra: String, args: &[&str]) -> Gateway {
    let port = ads.port;
    Gateway::start_bootstrap_args(
        move |admin| format!("{}{extra}", bootstrap_yaml(admin, port)),
        args,
    )
    .await
}

async fn serving(port: u16) {
    let url = format!("http://127.0.0.1:{port}/");
    eventually("traffic", Duration::from_secs(15), || async {
        let r = get(&url, Some("example.com"), &[]).await;
        (r.backend() == Some("web"))
            .then_some(())
            .ok_or(format!("{}", r.status))
    })
    .await;
}

async fn routed() -> (AdsServer, Backend, u16) {
    let web = Backend::start("web").await;
    let port = free_port();
    let ads = AdsServer::start_any(
        "1",
        &Snapshot {
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
        .with_backends(&[("web", &web)]),
    )
    .await;
    (ads, web, port)
}

/// Every stat the statsd sink sent since the last call, one datagram each.
async fn datagrams(sock: &tokio::net::UdpSocket, until: Duration) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 65536];
    let deadline = tokio::time::Instant::now() + until;
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, sock.recv(&mut buf)).await {
        out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    out
}

fn value(line: &str, name: &str, kind: &str) -> Option<u64> {
    let rest = line.strip_prefix(name)?.strip_prefix(':')?;
    rest.strip_suffix(kind)?.strip_suffix('|')?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statsd_sink_sends_counter_deltas_and_gauges_each_flush() {
    let collector = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .expect("udp");
    let sink_port = collector.local_addr().expect("addr").port();
    let (ads, _web, port) = routed().await;
    let gw = start(
        &ads,
        format!(
            "stats_flush_interval: 0.2s\nstats_sinks:\n- name: envoy.stat_sinks.statsd\n  typed_config:\n    \"@type\": type.googleapis.com/envoy.config.metrics.v3.StatsdSink\n    address: {{socket_address: {{address: 127.0.0.1, port_value: {sink_port}}}}}\n    prefix: gw\n"
        ),
        &[],
    )
    .await;
    serving(port).await;
    let url = format!("http://127.0.0.1:{port}/");
    for _ in 0..3 {
        assert_eq!(get(&url, Some("example.com"), &[]).await.status, 200);
    }
    // `serving` sent at least one more request; the deltas over all flushes add up to the
    // total the admin reports, and once the traffic stops a flush reports no change.
    let total = |body: &str| -> u64 {
        body.lines()
            .find_map(|l| l.strip_prefix("cluster.web.upstream_rq_total: "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let expected = total(
        &gw.admin_get("/stats?filter=^cluster\\.web\\.upstream_rq_total$")
            .await
            .body,
    );
    assert!(expected >= 4, "{expected}");
    let mut sum = 0;
    let mut zero_after = false;
    let mut membership = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < deadline && !(sum == expected && zero_after && membership) {
        for d in datagrams(&collector, Duration::from_millis(500)).await {
            // One stat per datagram, in statsd's line format.
            let (name, rest) = d.split_once(':').unwrap_or_else(|| panic!("{d:?}"));
            assert!(name.starts_with("gw."), "{d:?}");
            assert!(!d.contains('\n'), "{d:?}");
            let (v, kind) = rest.split_once('|').unwrap_or_else(|| panic!("{d:?}"));
            assert!(v.parse::<u64>().is_ok(), "{d:?}");
            assert!(["c", "g", "ms", "h"].contains(&kind), "{d:?}");
            if let Some(v) = value(&d, "gw.cluster.web.upstream_rq_total", "c") {
                if v == 0 && sum == expected {
                    zero_after = true;
                }
                sum += v;
            }
            if value(&d, "gw.cluster.web.membership_total", "g") == Some(1) {
                membership = true;
            }
        }
    }
    assert_eq!(sum, expected, "the deltas add up to the counter");
    assert!(zero_after, "an unchanged used counter is sent as 0");
    assert!(membership, "gauges are sent with their value");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_requests_are_access_logged() {
    let dir = TempDir::new("portico-admin-log");
    let log = dir.path.join("admin.log");
    let legacy = dir.path.join("admin-legacy.log");
    let ads = AdsServer::start_any("1", &Snapshot::default()).await;
    let port = ads.port;
    let (log_s, legacy_s) = (log.display().to_string(), legacy.display().to_string());
    let gw = Gateway::start_bootstrap_args(
        move |admin| {
            bootstrap_yaml(admin, port).replacen(
                "admin:\n",
                &format!(
                    "admin:\n  access_log_path: {legacy_s}\n  access_log:\n  - name: envoy.access_loggers.file\n    typed_config:\n      \"@type\": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog\n      path: {log_s}\n"
                ),
                1,
            )
        },
        &["--file-flush-interval-msec", "100"],
    )
    .await;
    let admin_port: u16 = gw
        .admin_url("")
        .trim_start_matches("http://127.0.0.1:")
        .parse()
        .expect("port");
    let r = raw_http1(
        admin_port,
        b"GET /ready?from=test HTTP/1.1\r\nhost: admin.local\r\nuser-agent: probe/1\r\nx-request-id: rid-1\r\nconnection: close\r\n\r\n",
        false,
    )
    .await;
    let ready_body = r.body_str().len();
    for path in [&log, &legacy] {
        let line = eventually("the admin's log line", Duration::from_secs(15), || async {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            text.lines()
                .find(|l| l.contains("from=test"))
                .map(str::to_string)
                .ok_or(text)
        })
        .await;
        // Envoy's default format. Envoy 1.40 fills x-forwarded-for of admin requests with
        // 192.0.2.2 (an address of its own admin plumbing); Portico leaves the header alone.
        let re = regex::Regex::new(&format!(
            r#"^\[\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{{3}}Z\] "GET /ready\?from=test HTTP/1.1" {} - 0 {ready_body} \d+ - "(-|192\.0\.2\.2)" "probe/1" "rid-1" "admin.local" "-"$"#,
            r.status
        ))
        .expect("regex");
        assert!(re.is_match(&line), "{line}");
    }
}
