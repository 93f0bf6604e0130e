//! The cases, each run the same way for both proxies.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{self, AdsServer, HttpClient};
use crate::config;
use crate::tools::{self, Env, Nginx, Opts, Proxy, Results, Running, BODY};

/// The fixed request rates of the latency case (and of its CPU per request).
pub const RATES: [u32; 2] = [2_000, 10_000];

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("load tool task: {e}"))?
}

/// The same load straight to the backend: the floor every proxied figure sits on.
pub async fn direct(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    results: &mut Results,
) -> Result<(), String> {
    let secs = opts.secs;
    if opts.wants("h1") {
        let url = format!("http://127.0.0.1:{}/", backend.ports[0]);
        let (e, o) = (env.clone(), opts.clone());
        let r = blocking(move || tools::wrk(&e, &o, &url, 50, secs)).await?;
        results.add("1 h1 rps, 50 conns", "direct", r.rps);
    }
    if opts.wants("h2c") {
        let url = format!("http://127.0.0.1:{}/", backend.h2_port);
        let (e, o) = (env.clone(), opts.clone());
        let (rps, _) = blocking(move || tools::h2load(&e, &o, &url, 50, 10, secs)).await?;
        results.add("2 h2c rps, 50 conns x 10 streams", "direct", rps);
    }
    if opts.wants("latency") {
        for rate in RATES {
            let url = format!("http://127.0.0.1:{}/", backend.ports[0]);
            let (e, o) = (env.clone(), opts.clone());
            let l = blocking(move || tools::oha(&e, &o, &url, rate, secs)).await?;
            results.add(&format!("3 latency p50 @{rate} rps"), "direct", l.p50);
            results.add(&format!("3 latency p99 @{rate} rps"), "direct", l.p99);
            results.add(&format!("3 latency p99.9 @{rate} rps"), "direct", l.p999);
        }
    }
    Ok(())
}

/// One wrk run against `p`: its req/s under `rps_case` and the proxy's CPU seconds per 100k
/// requests under `cpu_case`; socket errors and non-2xx answers are recorded as `what`.
#[allow(clippy::too_many_arguments)]
async fn wrk_with_cpu(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    p: &Running,
    url: &str,
    conns: u32,
    extra: &[&str],
    (rps_case, cpu_case, what): (&str, &str, &str),
    results: &mut Results,
) -> Result<(), String> {
    let who = p.proxy.name();
    let secs = opts.secs;
    let cpu0 = p.cpu_secs()?;
    let (e, o, u) = (env.clone(), opts.clone(), url.to_string());
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let r = blocking(move || {
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        tools::wrk_with(&e, &o, &u, conns, secs, &extra)
    })
    .await?;
    let cpu1 = p.cpu_secs()?;
    results.add(rps_case, who, r.rps);
    if r.requests > 0.0 {
        results.add(cpu_case, who, (cpu1 - cpu0) / r.requests * 100_000.0);
    }
    results.error(format!("{who} {what}"), r.errors);
    Ok(())
}

/// The slices of `secs` seconds the HTTP/1.1 saturation run takes turns in: about two
/// seconds each (wrk counts whole seconds), the first ones a second longer when it does not
/// divide evenly.
fn slices(secs: u64) -> Vec<u64> {
    let n = (secs / 2).max(1);
    (0..n)
        .map(|i| secs / n + u64::from(i < secs % n))
        .filter(|s| *s > 0)
        .collect()
}

/// `slices`' check (for `--self-test`): the slices add up to the run and none is empty or
/// longer than a second over another.
pub fn slices_self_test() -> Result<(), String> {
    for secs in 1..=60 {
        let s = slices(secs);
        let (min, max) = (s.iter().min().copied(), s.iter().max().copied());
        if s.iter().sum::<u64>() != secs
            || min == Some(0)
            || max.zip(min).is_none_or(|(a, b)| a - b > 1)
        {
            return Err(format!("{secs} s cut into {s:?}"));
        }
    }
    if slices(10) != [2, 2, 2, 2, 2] || slices(5) != [3, 2] || slices(3) != [3] {
        return Err(format!(
            "10, 5, 3 s: {:?} {:?} {:?}",
            slices(10),
            slices(5),
            slices(3)
        ));
    }
    Ok(())
}

/// `proxy` serving the basic case's config (one listener, one route, one cluster; nginx and
/// HAProxy their own configs to the same backends), and its URL, once it serves.
async fn start_basic(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
) -> Result<(Running, String), String> {
    let port = common::free_port();
    let p = if proxy.speaks_xds() {
        let admin = common::free_port();
        let boot = config::static_bootstrap(admin, port, 0, &backend.ports);
        Running::start(env, opts, proxy, &boot, admin).await?
    } else {
        Running::start_plain(env, opts, proxy, port, &backend.ports).await?
    };
    let url = format!("http://127.0.0.1:{port}/");
    check_serves(&url).await?;
    Ok((p, url))
}

/// Cases 1 and 4 (h1 run) and memory idle and after it: every contender serves the basic
/// config at once, and they take turns under wrk in slices of about two seconds (`slices`),
/// the order turning by one each slice, until each has had `secs` seconds. A proxy's figure
/// for the round is its requests over its slices and its CPU seconds within them. This VM's
/// speed drifts (other tenants): with whole turns of `secs` each, a contender's rounds moved
/// by up to 23 % within one run, and Portico/nginx by round went from 0.80 to 1.22; slices a
/// few seconds apart share the drift (four runs of 3 rounds: 0.95 to 1.06 by round). The
/// contenders waiting their turn idle on the same core.
pub async fn h1_turns(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    results: &mut Results,
) -> Result<(), String> {
    let mut running = Vec::new();
    for &proxy in &env.proxies {
        running.push(start_basic(env, opts, backend, proxy).await?);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (p, _) in &running {
        results.add("5 rss idle", p.proxy.name(), p.rss_mib()?);
    }
    // Per contender: requests, seconds under load, CPU seconds, errors.
    let mut sums = vec![(0.0, 0u64, 0.0, 0u64); running.len()];
    for (turn, secs) in slices(opts.secs).into_iter().enumerate() {
        for k in 0..running.len() {
            let i = (k + turn) % running.len();
            let (p, url) = &running[i];
            let cpu0 = p.cpu_secs()?;
            let (e, o, u) = (env.clone(), opts.clone(), url.clone());
            let r = blocking(move || tools::wrk_with(&e, &o, &u, 50, secs, &[])).await?;
            let cpu1 = p.cpu_secs()?;
            let s = &mut sums[i];
            s.0 += r.requests;
            s.1 += secs;
            s.2 += cpu1 - cpu0;
            s.3 += r.errors;
        }
    }
    for ((p, _), (requests, secs, cpu, errors)) in running.iter().zip(sums) {
        let who = p.proxy.name();
        if secs > 0 {
            results.add("1 h1 rps, 50 conns", who, requests / secs as f64);
        }
        if requests > 0.0 {
            results.add(
                "4 cpu per 100k requests (h1 run)",
                who,
                cpu / requests * 100_000.0,
            );
        }
        results.error(format!("{who} h1"), errors);
        results.add("5 rss after h1 run", who, p.rss_mib()?);
    }
    Ok(())
}

fn last(results: &Results, case: &str, who: &str) -> Option<f64> {
    results.by_case.get(case)?.get(who)?.last().copied()
}

/// Cases 2-4: one listener, one route, one cluster (case 1, the saturation run, and memory
/// are `h1_turns`'). nginx and HAProxy (their own configs, the same backends) run the
/// fixed-rate latency and its CPU; h2c is Portico's and Envoy's alone.
pub async fn basic(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
    results: &mut Results,
) -> Result<(), String> {
    if opts.wants("h1") && !opts.wants("h2c") && !opts.wants("latency") {
        // All of it in `h1_turns`.
        return Ok(());
    }
    let (p, url) = start_basic(env, opts, backend, proxy).await?;
    let who = proxy.name();
    let secs = opts.secs;
    if !opts.wants("h1") {
        // Else measured with the h1 run (`h1_turns`).
        tokio::time::sleep(Duration::from_secs(3)).await;
        results.add("5 rss idle", who, p.rss_mib()?);
    }
    if opts.wants("h2c") && proxy.speaks_xds() {
        let (e, o, u) = (env.clone(), opts.clone(), url.clone());
        let (rps, failed) = blocking(move || tools::h2load(&e, &o, &u, 50, 10, secs)).await?;
        results.add("2 h2c rps, 50 conns x 10 streams", who, rps);
        results.error(format!("{who} h2c"), failed);
    }
    if opts.wants("latency") {
        for rate in RATES {
            let (e, o, u) = (env.clone(), opts.clone(), url.clone());
            let cpu0 = p.cpu_secs()?;
            let l = blocking(move || tools::oha(&e, &o, &u, rate, secs)).await?;
            let cpu1 = p.cpu_secs()?;
            for (pct, v) in [("p50", l.p50), ("p99", l.p99), ("p99.9", l.p999)] {
                let case = format!("3 latency {pct} @{rate} rps");
                results.add(&case, who, v);
                if let Some(floor) = last(results, &case, "direct") {
                    results.add(
                        &format!("3 latency added {pct} @{rate} rps"),
                        who,
                        v - floor,
                    );
                }
            }
            if l.requests > 0.0 {
                results.add(
                    &format!("4 cpu per 100k requests @{rate} rps"),
                    who,
                    (cpu1 - cpu0) / l.requests * 100_000.0,
                );
            }
            results.error(format!("{who} latency @{rate}"), l.errors);
        }
    }
    Ok(())
}

/// Case 12: the basic case with Istio's observability on (access log to a file, 1 % Zipkin
/// tracing, gRPC stats, fault, CORS; for Portico also istio-proxy's own filters: metadata
/// exchange, ALPN, standard metrics), to set against cases 1 and 4 (the router alone).
pub async fn telemetry(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
    results: &mut Results,
) -> Result<(), String> {
    let (admin, port) = (common::free_port(), common::free_port());
    let who = proxy.name();
    let log = env.dir.path.join(format!("access-{who}.log"));
    let boot = config::telemetry_bootstrap(
        admin,
        port,
        &backend.ports,
        &log.display().to_string(),
        proxy == Proxy::Portico,
    );
    let p = Running::start(env, opts, proxy, &boot, admin).await?;
    let url = format!("http://127.0.0.1:{port}/");
    check_serves(&url).await?;
    let cases = (
        "12 h1 rps, 50 conns, Istio telemetry on",
        "12 cpu per 100k requests (telemetry on)",
        "telemetry",
    );
    wrk_with_cpu(env, opts, &p, &url, 50, &[], cases, results).await?;
    if let (Some(on), Some(off)) = (
        last(results, "12 cpu per 100k requests (telemetry on)", who),
        last(results, "4 cpu per 100k requests (h1 run)", who),
    ) {
        results.add("12 telemetry cpu ratio (on / off)", who, on / off);
    }
    // The log must have been written, a line per request: a logger that drops lines would
    // look cheap.
    let lines = std::fs::read(&log)
        .map(|b| b.iter().filter(|c| **c == b'\n').count())
        .unwrap_or(0);
    results.add(
        "12 access log lines written (thousands)",
        who,
        lines as f64 / 1000.0,
    );
    let _ = std::fs::remove_file(&log);
    Ok(())
}

/// Case 13: what a policy costs per request: RBAC with 10 and with 1,000 policies (none of
/// which matches, so every one is evaluated, then the request is allowed), and JWT
/// verification of a good ES256 token with the key inline (cached), to set against cases 1
/// and 4 (the router alone).
pub async fn policy(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
    results: &mut Results,
) -> Result<(), String> {
    let signer = common::jwt::Signer::new();
    let token = signer.token(
        "k1",
        serde_json::json!({"iss": config::ISSUER, "sub": "bench", "aud": "api",
            "exp": common::jwt::now() + 86_400}),
    );
    let bearer = format!("authorization: Bearer {token}");
    let jwks = signer.jwks("k1");
    let variants: [(&str, String, Vec<&str>); 3] = [
        ("rbac, 10 policies", config::rbac_filter_yaml(10), vec![]),
        (
            "rbac, 1000 policies",
            config::rbac_filter_yaml(1000),
            vec![],
        ),
        (
            "jwt_authn, ES256, key cached",
            config::jwt_filter_yaml(&jwks),
            vec!["-H", bearer.as_str()],
        ),
    ];
    for (what, filters, extra) in variants {
        let (admin, port) = (common::free_port(), common::free_port());
        let boot = config::policy_bootstrap(admin, port, &backend.ports, &filters);
        let p = Running::start(env, opts, proxy, &boot, admin).await?;
        let url = format!("http://127.0.0.1:{port}/");
        let headers: Vec<(&str, &str)> = extra
            .get(1)
            .and_then(|h| h.split_once(": "))
            .into_iter()
            .collect();
        let r = common::get(&url, None, &headers).await;
        if r.status != 200 || r.body != BODY {
            return Err(format!(
                "{what}: {url}: {} {:?} {:?}",
                r.status, r.body, r.error
            ));
        }
        let rps = format!("13 h1 rps, 50 conns, {what}");
        let cpu = format!("13 cpu per 100k requests, {what}");
        wrk_with_cpu(env, opts, &p, &url, 50, &extra, (&rps, &cpu, what), results).await?;
    }
    Ok(())
}

async fn check_serves(url: &str) -> Result<(), String> {
    let r = common::get(url, None, &[]).await;
    if r.status == 200 && r.body == BODY {
        Ok(())
    } else {
        Err(format!("{url}: {} {:?} {:?}", r.status, r.body, r.error))
    }
}

/// Case 7: the first and the last of 10,000 prefix routes against the 1-route figure.
pub async fn routes(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
    results: &mut Results,
) -> Result<(), String> {
    let n = opts.scale;
    let (admin, port) = (common::free_port(), common::free_port());
    let boot = config::static_bootstrap(admin, port, n, &backend.ports);
    let _p = Running::start(env, opts, proxy, &boot, admin).await?;
    let who = proxy.name();
    let mut rps = Vec::new();
    for (label, path) in [
        ("first", "/svc0/x".to_string()),
        ("last", format!("/svc{}/x", n - 1)),
    ] {
        let url = format!("http://127.0.0.1:{port}{path}");
        check_serves(&url).await?;
        let (e, o) = (env.clone(), opts.clone());
        let secs = opts.secs;
        let r = blocking(move || tools::wrk(&e, &o, &url, 50, secs)).await?;
        results.add(&format!("7 rps, {label} of {n} routes"), who, r.rps);
        results.error(format!("{who} routes {label}"), r.errors);
        rps.push(r.rps);
    }
    if let (Some(one), Some(lastr)) = (last(results, "1 h1 rps, 50 conns", who), rps.last()) {
        results.add(&format!("7 ratio last of {n} / 1 route"), who, lastr / one);
    }
    Ok(())
}

/// Polls `url` on one keep-alive connection until the body is `want`.
async fn until_body(
    client: &HttpClient,
    url: &str,
    want: &str,
    limit: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        let r = client.get(url, None, &[]).await;
        if r.status == 200 && r.body == want {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{url} did not answer {want:?} within {limit:?} (last {} {:?})",
                r.status, r.body
            ));
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

/// The proxy under test, fed by `ads` (the integration tests' bootstrap).
async fn start_on_ads(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    proxy: Proxy,
    ads: &AdsServer,
) -> Result<Running, String> {
    start_on_ads_api(env, opts, proxy, ads, "GRPC").await
}

/// As [`start_on_ads`], over `api_type` (`GRPC` or `DELTA_GRPC`).
async fn start_on_ads_api(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    proxy: Proxy,
    ads: &AdsServer,
    api_type: &str,
) -> Result<Running, String> {
    let admin = common::free_port();
    let boot = common::bootstrap_yaml_api(admin, ads.port, api_type);
    Running::start(env, opts, proxy, &boot, admin).await
}

/// The last cluster's assignment with its first endpoint on `port`.
fn moved_endpoint(
    big: &common::Snapshot,
    port: u16,
) -> Result<envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment, String> {
    let mut cla = big.endpoints.last().cloned().ok_or("no endpoints")?;
    let ep = cla.endpoints[0]
        .lb_endpoints
        .first_mut()
        .ok_or("no endpoint")?;
    ep.host_identifier = Some(
        envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier::Endpoint(
            envoy_types::pb::envoy::config::endpoint::v3::Endpoint {
                address: Some(common::socket_addr("127.0.0.1", port)),
                ..Default::default()
            },
        ),
    );
    Ok(cla)
}

/// Case 9: one small change in a large config over state of the world and over delta. Per
/// update: the time from the push to traffic, the bytes the control plane sent, and the
/// proxy's CPU (averaged over `UPDATES` updates, each awaited by its ACK with no traffic, so
/// the CPU is the update's alone). The changes: one endpoint of one cluster (EDS), and one
/// field of one cluster (CDS, which state of the world sends whole).
pub async fn xds_updates(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
    results: &mut Results,
) -> Result<(), String> {
    const UPDATES: u32 = 10;
    let n = opts.scale;
    let who = proxy.name();
    for (api, label) in [("GRPC", "sotw"), ("DELTA_GRPC", "delta")] {
        let port = common::free_port();
        let big = config::scale_snapshot(port, n, &backend.ports);
        let ads = AdsServer::start_any("1", &big).await;
        let p = start_on_ads_api(env, opts, proxy, &ads, api).await?;
        let client = HttpClient::new();
        let last_url = format!("http://127.0.0.1:{port}/svc{}/x", n - 1);
        until_body(&client, &last_url, BODY, Duration::from_secs(300)).await?;
        tokio::time::sleep(Duration::from_secs(1)).await;

        // State of the world: istiod pushes only the changed assignment (EDS is not a
        // wildcard type). Delta: the server holds every assignment and sends what changed.
        let set_eds = |version: &str, port: u16| -> Result<(), String> {
            let moved = moved_endpoint(&big, port)?;
            if api == "DELTA_GRPC" {
                let mut all = big.endpoints.clone();
                if let Some(last) = all.last_mut() {
                    *last = moved;
                }
                ads.set_endpoints(version, &all);
            } else {
                ads.set_endpoints(version, &[moved]);
            }
            Ok(())
        };
        // The clock starts once the control plane holds the new state: encoding ten thousand
        // assignments is the harness's work, not the proxy's.
        set_eds("e0", backend.changed_port)?;
        let t0 = Instant::now();
        until_body(&client, &last_url, "changed\n", Duration::from_secs(60)).await?;
        results.add(
            &format!("9 {label}: one-endpoint change in {n} clusters -> traffic"),
            who,
            t0.elapsed().as_secs_f64() * 1000.0,
        );

        let mut measure = |what: &str, bytes: u64, cpu: f64| {
            results.add(
                &format!("9 {label}: bytes on the wire per {what}"),
                who,
                bytes as f64 / f64::from(UPDATES),
            );
            results.add(
                &format!("9 {label}: proxy cpu-ms per {what}"),
                who,
                cpu * 1000.0 / f64::from(UPDATES),
            );
        };
        let (bytes0, cpu0) = (ads.sent_bytes(), p.cpu_secs()?);
        for i in 1..=UPDATES {
            let to = if i % 2 == 0 {
                backend.changed_port
            } else {
                backend.ports[0]
            };
            let version = format!("e{i}");
            set_eds(&version, to)?;
            ads.wait_for_ack(common::EDS, &version, Duration::from_secs(60))
                .await;
        }
        measure(
            "one-endpoint update",
            ads.sent_bytes() - bytes0,
            p.cpu_secs()? - cpu0,
        );

        let (bytes0, cpu0) = (ads.sent_bytes(), p.cpu_secs()?);
        let mut clusters = big.clusters.clone();
        for i in 1..=UPDATES {
            if let Some(c) = clusters.last_mut() {
                c.connect_timeout = Some(envoy_types::pb::google::protobuf::Duration {
                    seconds: 1 + i64::from(i),
                    nanos: 0,
                });
            }
            let version = format!("c{i}");
            ads.set_clusters(&version, &clusters);
            ads.wait_for_ack(common::CDS, &version, Duration::from_secs(60))
                .await;
        }
        measure(
            "one-cluster update",
            ads.sent_bytes() - bytes0,
            p.cpu_secs()? - cpu0,
        );
        drop(p);
    }
    Ok(())
}

/// Cases 5 (loaded memory) and 6 (config at scale), over ADS.
pub async fn scale(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
    results: &mut Results,
) -> Result<(), String> {
    let n = opts.scale;
    let who = proxy.name();
    let port = common::free_port();
    let ads = AdsServer::start_any("1", &config::scale_snapshot(port, 1, &backend.ports)).await;
    let p = start_on_ads(env, opts, proxy, &ads).await?;
    let client = HttpClient::new();
    until_body(
        &client,
        &format!("http://127.0.0.1:{port}/svc0/x"),
        BODY,
        Duration::from_secs(20),
    )
    .await?;

    let big = config::scale_snapshot(port, n, &backend.ports);
    let t0 = Instant::now();
    ads.set_snapshot("2", &big);
    let last_url = format!("http://127.0.0.1:{port}/svc{}/x", n - 1);
    until_body(&client, &last_url, BODY, Duration::from_secs(300)).await?;
    results.add(
        &format!("6 push {n} clusters x10 eps + {n} routes -> traffic on the last"),
        who,
        t0.elapsed().as_secs_f64() * 1000.0,
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    results.add(
        &format!("5 rss with {n} clusters x10 eps + {n} routes"),
        who,
        p.rss_mib()?,
    );

    // One endpoint of the last cluster moves to the backend that answers "changed".
    let cla = moved_endpoint(&big, backend.changed_port)?;
    let t0 = Instant::now();
    ads.set_endpoints("3", &[cla]);
    until_body(&client, &last_url, "changed\n", Duration::from_secs(60)).await?;
    results.add(
        &format!("6 one-endpoint EDS change in {n} clusters -> traffic"),
        who,
        t0.elapsed().as_secs_f64() * 1000.0,
    );
    drop(p);
    Ok(())
}

/// Case 6, last part: saturating load while a CDS+EDS+RDS push lands every 100 ms.
pub async fn churn(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
    results: &mut Results,
) -> Result<(), String> {
    let who = proxy.name();
    let port = common::free_port();
    let ads =
        Arc::new(AdsServer::start_any("0", &config::churn_snapshot(port, 0, &backend.ports)).await);
    let _p = start_on_ads(env, opts, proxy, &ads).await?;
    let url = format!("http://127.0.0.1:{port}/");
    until_body(&HttpClient::new(), &url, BODY, Duration::from_secs(20)).await?;

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pusher = {
        let (ads, stop, ports) = (ads.clone(), stop.clone(), backend.ports.clone());
        tokio::spawn(async move {
            let mut k = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(100)).await;
                k += 1;
                ads.set_snapshot(&k.to_string(), &config::churn_snapshot(port, k, &ports));
            }
            k
        })
    };
    let (e, o, secs) = (env.clone(), opts.clone(), opts.secs);
    let r = blocking(move || tools::wrk(&e, &o, &url, 50, secs)).await?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let pushes = pusher.await.map_err(|e| e.to_string())?;
    // Every push must have been accepted, or the case measured nothing.
    ads.wait_for_ack(common::RDS, &pushes.to_string(), Duration::from_secs(10))
        .await;
    results.add(
        "6 failed requests, push every 100 ms under load",
        who,
        r.errors as f64,
    );
    results.add("6 rps during churn", who, r.rps);
    eprintln!("   ({pushes} pushes)");
    Ok(())
}

/// Case 14, the soak (`--cases soak`, not part of `all`): saturating HTTP/1.1 load for
/// `--soak-secs` while the control plane pushes every 100 ms (clusters' settings, endpoints,
/// the route's cluster, and a second listener that changes each push) and restarts every
/// minute; RSS and open file descriptors sampled every 5 s after a 10 s warm-up.
pub async fn soak(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
    results: &mut Results,
) -> Result<(), String> {
    let who = proxy.name();
    let (port, extra) = (common::free_port(), common::free_port());
    let snap = move |k: usize, ports: &[u16]| {
        let mut s = config::churn_snapshot(port, k, ports);
        let mut h = common::hcm(extra);
        h.stat_prefix = format!("soak_{}", k % 7);
        s.listeners.push(common::listener_with(extra, h));
        s
    };
    let ads_port = common::free_port();
    let ads = Arc::new(tokio::sync::RwLock::new(
        AdsServer::start(ads_port, "0", &snap(0, &backend.ports)).await,
    ));
    let p = {
        let a = ads.read().await;
        start_on_ads(env, opts, proxy, &a).await?
    };
    let url = format!("http://127.0.0.1:{port}/");
    until_body(&HttpClient::new(), &url, BODY, Duration::from_secs(20)).await?;

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pusher = {
        let (ads, stop, ports) = (ads.clone(), stop.clone(), backend.ports.clone());
        tokio::spawn(async move {
            let (mut k, mut restarts) = (0usize, 0usize);
            let mut last_restart = std::time::Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(100)).await;
                k += 1;
                if last_restart.elapsed() >= Duration::from_secs(60) {
                    let mut a = ads.write().await;
                    a.stop().await;
                    *a = AdsServer::start(ads_port, &k.to_string(), &snap(k, &ports)).await;
                    last_restart = std::time::Instant::now();
                    restarts += 1;
                } else {
                    ads.read()
                        .await
                        .set_snapshot(&k.to_string(), &snap(k, &ports));
                }
            }
            (k, restarts)
        })
    };
    let secs = opts.soak_secs;
    let load = {
        let (e, o, u) = (env.clone(), opts.clone(), url.clone());
        tokio::task::spawn_blocking(move || tools::wrk(&e, &o, &u, 50, secs))
    };
    tokio::time::sleep(Duration::from_secs(10)).await;
    let fds =
        |pid: u32| std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count()) as f64;
    let (rss0, fd0) = (p.rss_mib()?, fds(p.pid()));
    let (mut rss_max, mut rss_last, mut fd_last) = (rss0, rss0, fd0);
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        // Sampled only under load: once wrk closes its connections the fds drop.
        if load.is_finished() {
            break;
        }
        if let Ok(r) = p.rss_mib() {
            rss_max = rss_max.max(r);
            rss_last = r;
        }
        fd_last = fds(p.pid());
    }
    let r = load.await.map_err(|e| e.to_string())??;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (pushes, restarts) = pusher.await.map_err(|e| e.to_string())?;
    results.add("14 soak failed requests", who, r.errors as f64);
    results.add("14 soak rps", who, r.rps);
    results.add("14 soak rss after warm-up", who, rss0);
    results.add(
        "14 soak rss growth, end vs warm-up",
        who,
        (rss_last - rss0) / rss0 * 100.0,
    );
    results.add(
        "14 soak rss growth, max vs warm-up",
        who,
        (rss_max - rss0) / rss0 * 100.0,
    );
    results.add("14 soak open fds, end minus warm-up", who, fd_last - fd0);
    eprintln!("   ({pushes} pushes, {restarts} control plane restarts, {secs} s)");
    Ok(())
}

/// Case 8: HTTPS (TLS 1.3, an ECDSA P-256 certificate) with keep-alive, and with a new
/// connection (so a full handshake) per request.
pub async fn https(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
    results: &mut Results,
) -> Result<(), String> {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vs-envoy-tls");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let key = rcgen::KeyPair::generate().map_err(|e| format!("key: {e}"))?;
    let cert = rcgen::CertificateParams::new(vec!["bench.example.com".to_string()])
        .and_then(|p| p.self_signed(&key))
        .map_err(|e| format!("certificate: {e}"))?;
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, cert.pem()).map_err(|e| format!("cert.pem: {e}"))?;
    std::fs::write(&key_path, key.serialize_pem()).map_err(|e| format!("key.pem: {e}"))?;
    let (admin, port) = (common::free_port(), common::free_port());
    let boot = config::tls_bootstrap(
        admin,
        port,
        &backend.ports,
        &cert_path.display().to_string(),
        &key_path.display().to_string(),
    );
    let p = Running::start(env, opts, proxy, &boot, admin).await?;
    let who = proxy.name();
    let url = format!("https://127.0.0.1:{port}/");
    // A short run first: it fails loudly if the listener does not serve HTTPS.
    let (e, o, u) = (env.clone(), opts.clone(), url.clone());
    let probe = blocking(move || tools::wrk(&e, &o, &u, 1, 1)).await?;
    if probe.requests < 1.0 || probe.errors > 0 {
        return Err(format!(
            "{who}: HTTPS probe: {} requests, {} errors",
            probe.requests, probe.errors
        ));
    }
    let cases = (
        "8 https rps, 50 conns keep-alive",
        "8 https cpu per 100k requests (keep-alive)",
        "https keep-alive",
    );
    wrk_with_cpu(env, opts, &p, &url, 50, &[], cases, results).await?;
    let cases = (
        "8 https new-connection rps (handshakes/s), 20 conns",
        "8 https cpu per 100k requests (new connections)",
        "https new connections",
    );
    let close: &[&str] = &["-H", "connection: close"];
    wrk_with_cpu(env, opts, &p, &url, 20, close, cases, results).await?;
    drop(p);

    // TLS towards the backend instead: plain HTTP in, keep-alive TLS connections out.
    let (admin, port) = (common::free_port(), common::free_port());
    let boot = config::upstream_tls_bootstrap(admin, port, backend.tls_port);
    let p = Running::start(env, opts, proxy, &boot, admin).await?;
    let url = format!("http://127.0.0.1:{port}/");
    check_serves(&url).await?;
    let cases = (
        "8 https upstream rps, 50 conns keep-alive",
        "8 https upstream cpu per 100k requests",
        "https upstream",
    );
    wrk_with_cpu(env, opts, &p, &url, 50, &[], cases, results).await
}

/// Connections held open for the memory-per-connection case.
const HELD: usize = 2000;

/// Case 15: memory per open connection. `HELD` clients each make one request and keep the
/// connection open and idle (HTTP/1.1 keep-alive; then, on a fresh proxy, h2c); RSS before
/// and after, per connection. Idle keep-alive connections are what a gateway facing many
/// clients holds most of.
pub async fn conns(
    env: &Arc<Env>,
    opts: &Arc<Opts>,
    backend: &Nginx,
    proxy: Proxy,
    results: &mut Results,
) -> Result<(), String> {
    let who = proxy.name();
    for h2 in [false, true] {
        let (admin, port) = (common::free_port(), common::free_port());
        let boot = config::static_bootstrap(admin, port, 0, &backend.ports);
        let p = Running::start(env, opts, proxy, &boot, admin).await?;
        check_serves(&format!("http://127.0.0.1:{port}/")).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = p.rss_mib()?;
        let held = if h2 {
            hold_h2(port, HELD).await?.len()
        } else {
            hold_h1(port, HELD).await?.len()
        };
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = p.rss_mib()?;
        let kind = if h2 { "h2c" } else { "h1 keep-alive" };
        results.add(
            &format!("15 rss per idle {kind} connection ({held} open)"),
            who,
            (after - before) * 1024.0 / held as f64,
        );
        drop(p);
    }
    Ok(())
}

/// `n` HTTP/1.1 connections that each made one request and stay open.
async fn hold_h1(port: u16, n: usize) -> Result<Vec<tokio::net::TcpStream>, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| e.to_string())?;
        s.write_all(b"GET / HTTP/1.1\r\nhost: bench\r\n\r\n")
            .await
            .map_err(|e| e.to_string())?;
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        while !String::from_utf8_lossy(&got).ends_with(BODY) {
            let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk))
                .await
                .map_err(|_| "no response".to_string())?
                .map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("closed before its response".into());
            }
            got.extend_from_slice(&chunk[..n]);
        }
        held.push(s);
    }
    Ok(held)
}

/// A held HTTP/2 connection: its handle and the task driving it (stopped when dropped).
struct HeldH2 {
    _client: h2::client::SendRequest<bytes::Bytes>,
    driver: tokio::task::JoinHandle<Result<(), h2::Error>>,
}

impl Drop for HeldH2 {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// `n` h2c connections that each made one request and stay open.
async fn hold_h2(port: u16, n: usize) -> Result<Vec<HeldH2>, String> {
    let mut held = Vec::with_capacity(n);
    for _ in 0..n {
        let s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .map_err(|e| e.to_string())?;
        let (client, conn) = h2::client::handshake(s).await.map_err(|e| e.to_string())?;
        let driver = tokio::spawn(conn);
        let mut ready = client.clone().ready().await.map_err(|e| e.to_string())?;
        let req = http::Request::get("http://bench/")
            .body(())
            .map_err(|e| e.to_string())?;
        let (resp, _) = ready.send_request(req, true).map_err(|e| e.to_string())?;
        let mut body = resp.await.map_err(|e| e.to_string())?.into_body();
        while let Some(chunk) = body.data().await {
            chunk.map_err(|e| e.to_string())?;
        }
        held.push(HeldH2 {
            _client: client,
            driver,
        });
    }
    Ok(held)
}
