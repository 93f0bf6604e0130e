//! The Envoy-style admin endpoint: `/ready`, `/stats/prometheus`, `/config_dump`, `/clusters`,
//! `/server_info`.

mod dump_filter;
pub mod explain;
pub mod logging;
pub mod sinks;
pub mod stats;

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use envoy_types::pb::envoy::admin::v3 as admin;
use envoy_types::pb::google::protobuf::{Any, Timestamp};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use prost::Name;

use crate::State;

pub async fn serve(listener: tokio::net::TcpListener, state: Arc<State>) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("admin accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let state = state.clone();
        let local = stream.local_addr().ok();
        tokio::spawn(async move {
            let quit = Arc::new(AtomicBool::new(false));
            let svc = {
                let (state, quit) = (state.clone(), quit.clone());
                hyper::service::service_fn(move |req| {
                    let (state, quit) = (state.clone(), quit.clone());
                    async move {
                        let mut info = crate::telemetry::StreamInfo::new(protocol(&req));
                        let resp = handle(&req, &state, &quit);
                        access_log(&state, &mut info, &req, &resp, peer, local);
                        Ok::<_, Infallible>(resp)
                    }
                })
            };
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!("admin connection: {e}");
            }
            // `/quitquitquit` answered with `connection: close`: its answer is written once
            // the connection is done, and only then the server stops.
            if quit.load(Ordering::Relaxed) {
                state.quit.notify_one();
            }
        });
    }
}

/// Translates `admin.access_log` and the deprecated `admin.access_log_path` (a file logger
/// with Envoy's default format, as Envoy reads it).
pub fn access_logs(
    admin: &envoy_types::pb::envoy::config::bootstrap::v3::Admin,
) -> Result<crate::telemetry::access_log::AccessLogs, String> {
    use envoy_types::pb::envoy::config::accesslog::v3 as apb;
    use envoy_types::pb::envoy::extensions::access_loggers::file::v3::FileAccessLog;
    use prost::Message as _;
    let mut list = admin.access_log.clone();
    #[allow(deprecated)]
    let path = &admin.access_log_path;
    if !path.is_empty() {
        let file = FileAccessLog {
            path: path.clone(),
            ..Default::default()
        };
        list.push(apb::AccessLog {
            name: "envoy.access_loggers.file".into(),
            config_type: Some(apb::access_log::ConfigType::TypedConfig(Any {
                type_url: crate::telemetry::access_log::FILE_TYPE.into(),
                value: file.encode_to_vec(),
            })),
            ..Default::default()
        });
    }
    crate::telemetry::access_log::AccessLogs::translate(&list, "admin.access_log")
}

fn protocol(req: &Request<Incoming>) -> crate::telemetry::Protocol {
    match req.version() {
        http::Version::HTTP_10 => crate::telemetry::Protocol::Http10,
        _ => crate::telemetry::Protocol::Http11,
    }
}

/// The admin's access logs (`admin.access_log`, `admin.access_log_path`), written as Envoy
/// writes them for its admin listener: one line per request once the answer is ready (the
/// admin's answers are whole bodies, so its size is known before it is sent).
fn access_log(
    state: &State,
    info: &mut crate::telemetry::StreamInfo,
    req: &Request<Incoming>,
    resp: &Response<Full<Bytes>>,
    peer: SocketAddr,
    local: Option<SocketAddr>,
) {
    use hyper::body::Body as _;
    if state.admin_access_log.is_empty() {
        return;
    }
    info.downstream_remote = Some(peer);
    info.downstream_direct_remote = Some(peer);
    info.downstream_local = local;
    info.response_code = resp.status().as_u16();
    info.response_code_details = std::borrow::Cow::Borrowed("admin_filter_response");
    info.bytes_sent = resp.body().size_hint().exact().unwrap_or(0);
    info.last_downstream_tx = Some(info.elapsed());
    let authority = req
        .headers()
        .get(http::header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    state
        .admin_access_log
        .log(&crate::telemetry::access_log::LogContext {
            info,
            request: Some(crate::matcher::RequestView {
                host: authority,
                authority,
                path,
                method: req.method().as_str(),
                scheme: "http",
                headers: req.headers(),
            }),
            response: Some(resp.headers()),
            trailers: None,
            log_type: crate::telemetry::access_log::log_type::DOWNSTREAM_END,
        });
}

fn reply(status: u16, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

const TEXT: &str = "text/plain; charset=UTF-8";

/// The query's parameters, percent-decoded, in order; a bare key (`usedonly`) has an empty
/// value.
pub fn params(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Envoy's `server.state`: 0 LIVE, 1 DRAINING (health check failed), 2 PRE_INITIALIZING.
fn server_state(state: &State) -> (u64, &'static str) {
    if state.health_check_failed.load(Ordering::Relaxed) {
        (1, "DRAINING")
    } else if state.ready.load(Ordering::Relaxed) {
        (0, "LIVE")
    } else {
        (2, "PRE_INITIALIZING")
    }
}

/// Endpoints that change the server: Envoy refuses them but by POST.
const POST_ONLY: &[&str] = &[
    "/healthcheck/fail",
    "/healthcheck/ok",
    "/quitquitquit",
    "/logging",
    "/drain_listeners",
    "/runtime_modify",
    "/reset_counters",
];

fn handle(req: &Request<Incoming>, state: &State, quit: &AtomicBool) -> Response<Full<Bytes>> {
    let query = req.uri().query().unwrap_or("");
    let path = req.uri().path();
    if POST_ONLY.contains(&path) && req.method() != http::Method::POST {
        return reply(
            405,
            TEXT,
            format!("Method {} not allowed, POST required.", req.method()),
        );
    }
    match path {
        "/ready" => match server_state(state) {
            (0, name) => reply(200, TEXT, format!("{name}\n")),
            (_, name) => reply(503, TEXT, format!("{name}\n")),
        },
        "/stats" => {
            state.stats_flush.notify_one();
            stats(state, query)
        }
        "/stats/prometheus" => {
            state.stats_flush.notify_one();
            let list = stat_list(state);
            let mut text = list.prometheus(&stats::Select::default());
            state.istio.store.prometheus_histograms(&mut text);
            reply(200, "text/plain; version=0.0.4", text)
        }
        "/healthcheck/fail" | "/healthcheck/ok" => {
            state
                .health_check_failed
                .store(path == "/healthcheck/fail", Ordering::Relaxed);
            reply(200, TEXT, "OK\n")
        }
        "/quitquitquit" => {
            quit.store(true, Ordering::Relaxed);
            let mut r = reply(200, TEXT, "OK\n");
            r.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
            r
        }
        "/drain_listeners" => {
            let has = |flag: &str| {
                query
                    .split('&')
                    .any(|kv| kv.split('=').next() == Some(flag))
            };
            match state.listeners.get() {
                Some(l) => {
                    l.drain_listeners(has("inboundonly"), has("graceful"), has("skip_exit"));
                    reply(200, TEXT, "OK\n")
                }
                None => reply(503, TEXT, "listeners not started yet\n"),
            }
        }
        "/reset_counters" => {
            state.stats.reset_counters(&raw_stat_list(state));
            reply(200, TEXT, "OK\n")
        }
        "/logging" => logging(query),
        "/memory" => reply(200, "application/json", pretty(&memory())),
        "/runtime" => reply(200, "application/json", pretty(&runtime(state))),
        "/runtime_modify" => runtime_modify(state, query),
        "/config_dump" => match config_dump_narrowed(state, query) {
            Err(r) => reply(r.status, TEXT, r.message),
            Ok(v) => {
                // The descriptor pool the dump needed is gone again: give its memory back.
                crate::release_freed_memory();
                reply(
                    200,
                    "application/json",
                    serde_json::to_string_pretty(&v).unwrap_or_default(),
                )
            }
        },
        "/clusters"
            if params(query)
                .iter()
                .any(|(k, v)| k == "format" && v == "json") =>
        {
            reply(200, "application/json", pretty(&clusters_json(state)))
        }
        "/clusters" => reply(200, "text/plain", clusters(state)),
        "/explain" => match explain::explain(&state.snapshot(), &params(query)) {
            Ok(v) => reply(200, "application/json", pretty(&v)),
            Err(e) => reply(400, TEXT, format!("{e}\n")),
        },
        "/listeners" if query.split('&').any(|p| p == "format=json") => {
            reply(200, "application/json", listeners_json(state))
        }
        "/listeners" => reply(200, "text/plain", listeners_text(state)),
        "/server_info" => {
            let v = serde_json::json!({
                "version": concat!("portico/", env!("CARGO_PKG_VERSION")),
                "state": server_state(state).1,
                "uptime_current_epoch": format!("{}s", state.started.elapsed().as_secs()),
                "node": state.bootstrap_node_json(),
            });
            reply(200, "application/json", v.to_string())
        }
        "/" => reply(
            200,
            "text/plain",
            format!("admin commands are:\n{}", menu()),
        ),
        _ => reply(
            404,
            "text/plain",
            format!("invalid path. admin commands are:\n{}", menu()),
        ),
    }
}

fn menu() -> String {
    [
        "/clusters",
        "/config_dump",
        "/explain",
        "/healthcheck/fail",
        "/healthcheck/ok",
        "/listeners",
        "/logging",
        "/memory",
        "/quitquitquit",
        "/ready",
        "/runtime",
        "/server_info",
        "/stats",
        "/stats/prometheus",
    ]
    .iter()
    .map(|p| format!("  {p}\n"))
    .collect()
}

/// JSON as Envoy's admin pretty-prints it: one space per level.
fn pretty(v: &serde_json::Value) -> String {
    let mut buf = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(
        &mut buf,
        serde_json::ser::PrettyFormatter::with_indent(b" "),
    );
    match serde::Serialize::serialize(v, &mut ser) {
        Ok(()) => {
            buf.push(b'\n');
            String::from_utf8_lossy(&buf).into_owned()
        }
        Err(_) => v.to_string(),
    }
}

/// Every stat of the process: the request and xDS counters, and the server's own.
/// The compressor filters' `http.<prefix>.compressor.<library>.<encoding>.*` counters, for
/// the serving chains (one set per name).
fn compressor_stats<'a>(
    hcms: impl Iterator<Item = &'a crate::snapshot::listener::Hcm>,
    list: &mut stats::StatList,
) {
    use crate::filters::HttpFilter;
    let mut seen = std::collections::HashSet::new();
    for h in hcms {
        for f in &h.filters {
            let HttpFilter::Compressor(c) = f else {
                continue;
            };
            let enc = match c.algorithm.as_str() {
                "br" => "brotli",
                other => other,
            };
            let scope = format!("{}.{enc}", c.stats.library);
            if !seen.insert((h.stat_prefix.clone(), scope.clone())) {
                continue;
            }
            let s = &c.stats;
            for (stat, v) in [
                ("header_compressor_used", &s.header_compressor_used),
                (
                    "header_compressor_overshadowed",
                    &s.header_compressor_overshadowed,
                ),
                ("header_identity", &s.header_identity),
                ("header_not_valid", &s.header_not_valid),
                ("header_wildcard", &s.header_wildcard),
                ("no_accept_header", &s.no_accept_header),
                ("response.compressed", &s.compressed),
                ("response.not_compressed", &s.not_compressed),
                (
                    "response.content_length_too_small",
                    &s.content_length_too_small,
                ),
                ("response.not_compressed_etag", &s.not_compressed_etag),
                ("response.total_compressed_bytes", &s.total_compressed_bytes),
                (
                    "response.total_uncompressed_bytes",
                    &s.total_uncompressed_bytes,
                ),
            ] {
                let dotted = format!("compressor.{scope}.{stat}");
                list.add(
                    stats::Kind::Counter,
                    format!("http.{}.{dotted}", h.stat_prefix),
                    format!("envoy_http_{}", dotted.replace(['.', '-'], "_")),
                    format!(
                        "envoy_http_conn_manager_prefix=\"{}\"",
                        h.stat_prefix.replace('\\', "\\\\").replace('"', "\\\"")
                    ),
                    v.load(std::sync::atomic::Ordering::Relaxed),
                );
            }
        }
    }
}

/// Every stat, as Envoy's admin shows it (counters since the last `/reset_counters`).
fn stat_list(state: &State) -> stats::StatList {
    let mut list = raw_stat_list(state);
    state.stats.rebase(&mut list);
    state.stats_matcher.apply(&mut list);
    list
}

fn raw_stat_list(state: &State) -> stats::StatList {
    let snap = state.snapshot();
    // Envoy lists a configured limiter's counters before its first request: bind the
    // serving chains' limiters to theirs (routes' overrides bind on first use).
    let hcms = || {
        snap.listeners
            .values()
            .flat_map(|l| l.chains.iter())
            .filter_map(|c| c.def.hcm())
    };
    for h in hcms() {
        for f in &h.filters {
            if let crate::filters::HttpFilter::LocalRateLimit(rl) = f {
                rl.config.stats();
            }
        }
    }
    let mut list = stats::StatList::default();
    compressor_stats(hcms(), &mut list);
    let membership = |name: &str| {
        snap.clusters
            .get(name)
            .map(|c| (c.healthy_count(), c.endpoints.hosts.len()))
    };
    let rds_prefix = |route: &str| {
        hcms()
            .find(|h| matches!(&h.routes, crate::snapshot::listener::RouteSource::Rds(r) if r == route))
            .map(|h| h.stat_prefix.clone())
    };
    state.stats.collect(
        &stats::Context {
            membership: &membership,
            rds_prefix: &rds_prefix,
        },
        &mut list,
    );
    // Istio's metrics (`istio.stats`): counters and the `istio_build` gauge here, histograms
    // by `istio_histograms`. istio-proxy sets `istio_build` when the filter is configured.
    let istio_configured = snap
        .listeners
        .values()
        .flat_map(|l| l.chains.iter())
        .any(|c| {
            c.def.istio_stats.is_some() || c.def.hcm().is_some_and(|h| h.istio.stats.is_some())
        });
    if istio_configured {
        state.istio.store.configured();
    }
    state.istio.store.collect(
        &state.istio.node,
        &mut |counter, name, metric, labels, v| {
            let kind = if counter {
                stats::Kind::Counter
            } else {
                stats::Kind::Gauge
            };
            list.add(kind, name, metric, labels, v);
        },
    );
    // Listed once they count: Envoy has them only where a driver is configured.
    for (name, value) in state
        .tracer
        .stats
        .list()
        .into_iter()
        .filter(|(_, v)| *v > 0)
    {
        list.add(
            stats::Kind::Counter,
            name.to_string(),
            format!("envoy_{}", name.replace('.', "_")),
            String::new(),
            value,
        );
    }
    let (server_state, _) = server_state(state);
    let ready = state.ready.load(Ordering::Relaxed);
    use stats::Kind::Gauge;
    // pilot-agent's readiness: `server.state` 0 and `listener_manager.workers_started` 1.
    // Envoy starts its workers when initialisation is done, so the gauge is set (and listed
    // by `usedonly`) from then on.
    list.add_used(Gauge, "server.state", server_state);
    list.gauge("listener_manager.workers_started", u64::from(ready));
    list.add_used(Gauge, "server.live", u64::from(server_state == 0));
    list.add_used(Gauge, "server.uptime", state.started.elapsed().as_secs());
    list.gauge(
        "listener_manager.total_listeners_active",
        snap.listeners.len() as u64,
    );
    list.gauge(
        "cluster_manager.active_clusters",
        snap.clusters.len() as u64,
    );
    let mem = memory_numbers();
    list.add_used(Gauge, "server.memory_allocated", mem.allocated);
    list.add_used(Gauge, "server.memory_heap_size", mem.heap_size);
    list.add_used(Gauge, "server.memory_physical_size", mem.physical);
    // Envoy's access log file counters (all files together), and the lines Portico dropped
    // because a file's writer fell behind (Envoy lets its buffer grow instead).
    let fs = crate::telemetry::access_log::sink::stats();
    for (name, c) in [
        ("filesystem.write_buffered", &fs.write_buffered),
        ("filesystem.write_completed", &fs.write_completed),
        ("filesystem.write_failed", &fs.write_failed),
        ("filesystem.flushed_by_timer", &fs.flushed_by_timer),
        ("filesystem.reopen_failed", &fs.reopen_failed),
        ("filesystem.access_log_dropped", &fs.dropped),
    ] {
        list.add(
            stats::Kind::Counter,
            name.to_string(),
            format!("envoy_{}", name.replace('.', "_")),
            String::new(),
            c.load(Ordering::Relaxed),
        );
    }
    list.gauge(
        "filesystem.write_total_buffered",
        fs.write_total_buffered.load(Ordering::Relaxed),
    );
    let store = state.serving.load().store.clone();
    use crate::xds::types::Kind;
    for (name, kind) in [
        ("cluster_manager.cds.version_text", Kind::Cluster),
        ("listener_manager.lds.version_text", Kind::Listener),
    ] {
        list.text(name, store.versions.get(&kind).map_or("", |v| v.as_ref()));
    }
    if let Some(rules) = &state.stats_tags {
        list.retag(rules);
    }
    list
}

/// `/stats`: Envoy's text (default), `format=json` or `format=prometheus`, with `usedonly`
/// and `filter=<regex>` (RE2 syntax, searched in the dotted name).
fn stats(state: &State, query: &str) -> Response<Full<Bytes>> {
    const USAGE: &str = "usage: /stats?format=(html|active-html|json|prometheus|text)\n\n";
    let mut sel = stats::Select::default();
    let mut format = "text".to_string();
    for (k, v) in params(query) {
        match k.as_str() {
            "usedonly" => sel.used_only = true,
            "filter" if !v.is_empty() => match regex::Regex::new(&v) {
                Ok(r) => sel.filter = Some(r),
                Err(e) => {
                    return reply(
                        400,
                        TEXT,
                        format!("Invalid re2 regex: {}\n{USAGE}", regex_error(&e)),
                    )
                }
            },
            "format" => format = v,
            _ => {}
        }
    }
    let list = stat_list(state);
    match format.as_str() {
        "text" => reply(200, TEXT, list.text_format(&sel)),
        "json" => reply(200, "application/json", list.json_format(&sel)),
        "prometheus" => {
            let mut text = list.prometheus(&sel);
            if sel.filter.is_none() {
                // Envoy writes histograms after counters and gauges.
                state.istio.store.prometheus_histograms(&mut text);
            }
            reply(200, "text/plain; version=0.0.4", text)
        }
        _ => reply(400, TEXT, USAGE),
    }
}

/// The regex crate's error in one line.
fn regex_error(e: &regex::Error) -> String {
    e.to_string()
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// `/logging` (POST): without parameters the listing; `level=<l>` sets every logger,
/// `<logger>=<level>` one, `paths=a:l,b:l` several. Envoy takes one parameter at a time.
fn logging(query: &str) -> Response<Full<Bytes>> {
    let ps = params(query);
    let result = match ps.as_slice() {
        [] => Ok(()),
        [(k, v)] if k == "level" => match logging::level(v) {
            Some(l) => logging::update(|levels| {
                levels.set_all(l);
                Ok(())
            }),
            None => Err("unknown logger level".to_string()),
        },
        [(k, v)] if k == "paths" => logging::update(|levels| levels.set_list(v)),
        [(k, v)] => match (logging::LOGGERS.contains(&k.as_str()), logging::level(v)) {
            (false, _) => Err("unknown logger name".to_string()),
            (true, None) => Err("unknown logger level".to_string()),
            (true, Some(_)) => logging::update(|levels| levels.set(k, v)),
        },
        _ => Err("invalid number of parameters".to_string()),
    };
    let listing = logging::current().listing();
    match result {
        Ok(()) => reply(200, TEXT, listing),
        Err(e) => reply(
            400,
            TEXT,
            format!(
                "error: {e}\n\n\
                 usage: /logging?<name>=<level> (change single level)\n\
                 usage: /logging?paths=name1:level1,name2:level2,... (change multiple levels)\n\
                 usage: /logging?level=<level> (change all levels)\n\
                 levels: {} \n{listing}",
                logging::LEVELS.join(" ")
            ),
        ),
    }
}

struct Memory {
    allocated: u64,
    heap_size: u64,
    physical: u64,
}

/// What the allocator holds: mimalloc's committed memory stands for both `allocated` and
/// `heap_size` (mimalloc counts no live bytes without its statistics build); the resident
/// set comes from /proc.
fn memory_numbers() -> Memory {
    let (mut rss, mut commit) = (0usize, 0usize);
    let mut unused = [0usize; 6];
    let [a, b, c, d, e, f] = &mut unused;
    // SAFETY: mi_process_info only writes the eight usize out-parameters given to it.
    unsafe {
        libmimalloc_sys::mi_process_info(a, b, c, &mut rss, d, &mut commit, e, f);
    }
    let page = 4096u64;
    let physical = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(rss as u64, |pages| pages * page);
    Memory {
        allocated: commit as u64,
        heap_size: commit as u64,
        physical,
    }
}

/// `/memory` in Envoy's shape (numbers as strings, as proto-JSON writes uint64). The
/// tcmalloc-only figures (`pageheap_*`, `total_thread_cache`) are 0.
fn memory() -> serde_json::Value {
    let m = memory_numbers();
    serde_json::json!({
        "allocated": m.allocated.to_string(),
        "heap_size": m.heap_size.to_string(),
        "pageheap_unmapped": "0",
        "pageheap_free": "0",
        "total_thread_cache": "0",
        "total_physical_bytes": m.physical.to_string(),
    })
}

/// `/runtime`: the bootstrap's `layered_runtime` layers and every key of its static layers,
/// flattened as Envoy flattens them (`a: {b: 1}` is `a.b`). Disk, admin and RTDS layers
/// contribute no keys (Portico reads none of them).
fn runtime(state: &State) -> serde_json::Value {
    use envoy_types::pb::envoy::config::bootstrap::v3::runtime_layer::LayerSpecifier;
    let layers: Vec<_> = state
        .bootstrap
        .as_ref()
        .and_then(|b| b.layered_runtime.as_ref())
        .map(|r| r.layers.iter().collect())
        .unwrap_or_default();
    let mut values: Vec<std::collections::BTreeMap<String, String>> = Vec::new();
    for l in &layers {
        let mut m = Default::default();
        match &l.layer_specifier {
            Some(LayerSpecifier::StaticLayer(s)) => flatten("", s, &mut m),
            Some(LayerSpecifier::AdminLayer(_)) => {
                m = state
                    .runtime_admin
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
            }
            _ => {}
        }
        values.push(m);
    }
    let mut entries = serde_json::Map::new();
    let keys: std::collections::BTreeSet<&String> = values.iter().flat_map(|m| m.keys()).collect();
    for k in keys {
        let per: Vec<&str> = values
            .iter()
            .map(|m| m.get(k).map_or("", |v| v.as_str()))
            .collect();
        let last = per
            .iter()
            .rev()
            .find(|v| !v.is_empty())
            .copied()
            .unwrap_or("");
        entries.insert(
            k.clone(),
            serde_json::json!({ "final_value": last, "layer_values": per }),
        );
    }
    serde_json::json!({
        "entries": entries,
        "layers": layers.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
    })
}

/// `POST /runtime_modify?key=value[&...]`: sets keys in the runtime's admin layer (an empty
/// value removes the key), as Envoy's admin does. Portico reads one runtime key after start:
/// `overload.global_downstream_max_connections`, when no resource monitor sets the limit.
fn runtime_modify(state: &State, query: &str) -> Response<Full<Bytes>> {
    use envoy_types::pb::envoy::config::bootstrap::v3::runtime_layer::LayerSpecifier;
    let has_admin_layer = state
        .bootstrap
        .as_ref()
        .and_then(|b| b.layered_runtime.as_ref())
        .is_some_and(|r| {
            r.layers
                .iter()
                .any(|l| matches!(l.layer_specifier, Some(LayerSpecifier::AdminLayer(_))))
        });
    if !has_admin_layer {
        return reply(503, TEXT, "No admin layer specified\n".to_string());
    }
    let kv = params(query);
    if kv.is_empty() {
        return reply(
            400,
            TEXT,
            "usage: /runtime_modify?key1=value1&key2=value2&keyN=valueN\n".to_string(),
        );
    }
    let monitor = state
        .bootstrap
        .as_ref()
        .and_then(|b| b.overload_manager.as_ref())
        .is_some_and(|o| !o.resource_monitors.is_empty());
    let mut admin = state
        .runtime_admin
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    for (k, v) in kv {
        if k == "overload.global_downstream_max_connections" && !monitor {
            let max = if v.is_empty() {
                Some(u64::MAX)
            } else {
                v.parse().ok()
            };
            if let Some(max) = max {
                state.global_connections.max.store(max, Ordering::Relaxed);
            }
        }
        if v.is_empty() {
            admin.remove(&k);
        } else {
            admin.insert(k, v);
        }
    }
    reply(200, TEXT, "OK\n".to_string())
}

fn flatten(
    prefix: &str,
    s: &envoy_types::pb::google::protobuf::Struct,
    out: &mut std::collections::BTreeMap<String, String>,
) {
    use envoy_types::pb::google::protobuf::value::Kind;
    for (k, v) in &s.fields {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        let text = match &v.kind {
            Some(Kind::StructValue(inner)) => {
                flatten(&key, inner, out);
                continue;
            }
            Some(Kind::StringValue(s)) => s.clone(),
            Some(Kind::NumberValue(n)) => n.to_string(),
            Some(Kind::BoolValue(b)) => b.to_string(),
            // Envoy refuses lists and nulls in a static layer; nothing to show.
            _ => continue,
        };
        out.insert(key, text);
    }
}

/// `/clusters?format=json`: Envoy's `admin.v3.Clusters`, from the facts the text form shows.
fn clusters_json(state: &State) -> serde_json::Value {
    use crate::snapshot::cluster::Health;
    let snap = state.snapshot();
    let mut names: Vec<_> = snap.clusters.keys().collect();
    names.sort();
    let statuses: Vec<_> = names
        .into_iter()
        .filter_map(|name| snap.clusters.get(name).map(|c| (name, c)))
        .map(|(name, c)| {
            let hosts: Vec<_> = c
                .endpoints
                .hosts
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    let active = c.active.get(i).map_or(0, |v| v.load(Ordering::Relaxed));
                    let mut rq_active = serde_json::json!({"type": "GAUGE", "name": "rq_active"});
                    if active != 0 {
                        rq_active["value"] = active.to_string().into();
                    }
                    let mut health = serde_json::json!({
                        "eds_health_status": match h.health {
                            Health::Healthy => "HEALTHY",
                            Health::Unhealthy => "UNHEALTHY",
                            Health::Degraded => "DEGRADED",
                        }
                    });
                    if let Some(Some(_)) = c.hc.get(i) {
                        let f = c
                            .stats
                            .health
                            .flags_of(&h.addr)
                            .unwrap_or(crate::snapshot::health_check::HcFlags::NEW);
                        for (set, key) in [
                            (f.failed, "failed_active_health_check"),
                            (f.degraded, "failed_active_degraded_check"),
                            (f.timeout, "active_hc_timeout"),
                            (f.immediate, "excluded_via_immediate_hc_fail"),
                        ] {
                            if set {
                                health[key] = true.into();
                            }
                        }
                    }
                    let mut v = serde_json::json!({
                        "address": {"socket_address": {
                            "address": h.addr.ip().to_string(),
                            "port_value": h.addr.port(),
                        }},
                        "stats": [rq_active],
                        "health_status": health,
                        "weight": h.weight,
                        "locality": {},
                    });
                    if h.priority != 0 {
                        v["priority"] = h.priority.into();
                    }
                    v
                })
                .collect();
            let mut v = serde_json::json!({
                "name": &**name,
                "observability_name": &**name,
            });
            if !hosts.is_empty() {
                v["host_statuses"] = hosts.into();
            }
            v
        })
        .collect();
    serde_json::json!({ "cluster_statuses": statuses })
}

/// Envoy's `/listeners`: one `name::address` line per listening address, the listener's
/// `address` first, then its `additional_addresses`.
fn listeners_text(state: &State) -> String {
    let store = state.serving.load().store.clone();
    let mut out = String::new();
    for (name, item) in store.listeners.iter() {
        for b in &item.value.binds {
            out.push_str(&format!("{name}::{}\n", b.addr));
        }
    }
    out
}

/// `/listeners?format=json`: Envoy's `admin.v3.Listeners`.
fn listeners_json(state: &State) -> String {
    let store = state.serving.load().store.clone();
    let addr = |a: &std::net::SocketAddr| serde_json::json!({"socket_address": {"address": a.ip().to_string(), "port_value": a.port()}});
    let statuses: Vec<serde_json::Value> = store
        .listeners
        .iter()
        .map(|(name, item)| {
            let mut v = serde_json::json!({"name": name, "local_address": addr(&item.value.addr)});
            let more: Vec<_> = item
                .value
                .binds
                .iter()
                .skip(1)
                .map(|b| addr(&b.addr))
                .collect();
            if !more.is_empty() {
                v["additional_local_addresses"] = serde_json::Value::Array(more);
            }
            v
        })
        .collect();
    serde_json::to_string_pretty(&serde_json::json!({"listener_statuses": statuses}))
        .unwrap_or_default()
}

/// Envoy's `/clusters` text format: one `cluster::host::stat::value` line per fact.
fn clusters(state: &State) -> String {
    let snap = state.snapshot();
    let mut names: Vec<_> = snap.clusters.keys().collect();
    names.sort();
    let mut out = String::new();
    for name in names {
        let Some(c) = snap.clusters.get(name) else {
            continue;
        };
        let _ = writeln!(out, "{name}::observability_name::{name}");
        for (i, h) in c.endpoints.hosts.iter().enumerate() {
            let a = h.addr;
            let active = c.active.get(i).map_or(0, |v| v.load(Ordering::Relaxed));
            let _ = writeln!(out, "{name}::{a}::rq_active::{active}");
            let _ = writeln!(out, "{name}::{a}::weight::{}", h.weight);
            let _ = writeln!(out, "{name}::{a}::priority::{}", h.priority);
            // The checker's live flags, as Envoy shows them (they change between rebuilds).
            let hc = match c.hc.get(i) {
                Some(Some(_)) => c
                    .stats
                    .health
                    .flags_of(&a)
                    .or(Some(crate::snapshot::health_check::HcFlags::NEW)),
                _ => None,
            };
            let flags = crate::snapshot::health_check::flags_text(h.health, hc.as_ref());
            let _ = writeln!(out, "{name}::{a}::health_flags::{flags}");
        }
    }
    out
}

fn pack<M: prost::Message + Name>(m: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: m.encode_to_vec(),
    }
}

fn ts(t: SystemTime) -> Option<Timestamp> {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).ok()?;
    Some(Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    })
}

/// One resource as proto-JSON. A resource holding an `Any` Portico has no descriptor for (an
/// optional filter of another vendor, say) still shows, with the reason it cannot be expanded.
fn render(any: &Any) -> serde_json::Value {
    crate::protojson::any_to_json(any).unwrap_or_else(
        |e| serde_json::json!({ "@type": any.type_url, "portico_render_error": e.to_string() }),
    )
}

fn stamp(t: SystemTime) -> serde_json::Value {
    ts(t)
        .and_then(|t| crate::protojson::to_json("google.protobuf.Timestamp", &t).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// A secret as Envoy dumps it: the private key (and its password) replaced by "[redacted]",
/// in whatever form it came (inline bytes, inline string or file name).
fn redacted_secret(
    raw: &crate::xds::types::Raw<
        envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret,
    >,
) -> Any {
    use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::secret::Type;
    let Ok(mut secret) = raw.decode() else {
        return raw.to_any();
    };
    let redact = |d: &mut Option<envoy_types::pb::envoy::config::core::v3::DataSource>| {
        if let Some(spec) = d.as_mut().and_then(|d| d.specifier.as_mut()) {
            *spec = match spec {
                Specifier::InlineBytes(_) => Specifier::InlineBytes(b"[redacted]".to_vec()),
                Specifier::InlineString(_) => Specifier::InlineString("[redacted]".into()),
                Specifier::Filename(_) => Specifier::Filename("[redacted]".into()),
                Specifier::EnvironmentVariable(_) => {
                    Specifier::EnvironmentVariable("[redacted]".into())
                }
            };
        }
    };
    if let Some(Type::TlsCertificate(c)) = &mut secret.r#type {
        redact(&mut c.private_key);
        redact(&mut c.password);
    }
    if let Some(Type::GenericSecret(g)) = &mut secret.r#type {
        redact(&mut g.secret);
    }
    envoy_types::util::pack_any(secret)
}

/// Envoy's `UpdateFailureState` for a resource whose last update was refused.
fn error_state(kind: crate::xds::types::Kind, f: &crate::xds::store::Failure) -> serde_json::Value {
    use crate::xds::types::{Kind, Raw};
    let mut v = serde_json::json!({
        "last_update_attempt": stamp(f.at),
        "details": f.message,
        "version_info": f.version,
    });
    let config = match (&f.config, kind) {
        // A refused secret is shown with its private key redacted, as an accepted one is.
        (Some(c), Kind::Secret) => Some(render(&redacted_secret(&Raw::from_bytes(&c.value)))),
        (Some(c), _) => Some(render(c)),
        (None, _) => None,
    };
    if let Some(c) = config {
        v["failed_configuration"] = c;
    }
    v
}

/// `/config_dump` in Envoy's shape: the bootstrap, then clusters, listeners, routes (and
/// endpoints with `include_eds`), each split into static and dynamic.
/// `/config_dump` with its query: `include_eds`, then `resource=`, `mask=`, `name_regex=`.
fn config_dump_narrowed(
    state: &State,
    query: &str,
) -> Result<serde_json::Value, dump_filter::Refused> {
    let params = params(query);
    let narrow = dump_filter::Narrow::from_params(&params)?;
    // Held across the dump and its narrowing: both read the descriptors.
    let _pool = crate::protojson::pool();
    let include_eds = params.iter().any(|(k, _)| k == "include_eds");
    let dump = config_dump(state, include_eds).map_err(|e| dump_filter::Refused {
        status: 500,
        message: format!("config dump failed: {e}\n"),
    })?;
    if narrow.is_empty() {
        return Ok(dump);
    }
    narrow.apply(dump)
}

pub fn config_dump(state: &State, include_eds: bool) -> Result<serde_json::Value, String> {
    use crate::xds::types::Kind;
    use serde_json::json;
    // Held for the whole dump, so each resource reuses one decoded descriptor pool.
    let _pool = crate::protojson::pool().map_err(|e| e.to_string())?;
    let serving = state.serving.load_full();
    let (store, snap) = (&serving.store, &serving.snapshot);
    let version = |k| store.versions.get(&k).cloned().unwrap_or_default();
    let mut configs = Vec::new();
    if let Some(b) = &state.bootstrap {
        configs.push(json!({
            "@type": admin::BootstrapConfigDump::type_url(),
            "bootstrap": render(&pack(b)),
            "last_updated": stamp(state.started_at),
        }));
    }
    let (mut static_clusters, mut dynamic_clusters) = (Vec::new(), Vec::new());
    for item in store.clusters.values() {
        let cluster = render(&item.proto.to_any());
        if item.is_static {
            static_clusters
                .push(json!({ "cluster": cluster, "last_updated": stamp(item.last_updated) }));
        } else {
            let mut entry = json!({
                "version_info": &*item.version,
                "cluster": cluster,
                "last_updated": stamp(item.last_updated),
            });
            if let Some(f) = store
                .failures
                .get(&(Kind::Cluster, item.value.name.to_string()))
            {
                entry["error_state"] = error_state(Kind::Cluster, f);
            }
            dynamic_clusters.push(entry);
        }
    }
    // Refused clusters that have no good version: their error alone.
    dynamic_clusters.extend(refused_only(store, Kind::Cluster, |n| {
        store.clusters.contains_key(n)
    }));
    configs.push(json!({
        "@type": admin::ClustersConfigDump::type_url(),
        "version_info": version(Kind::Cluster),
        "static_clusters": static_clusters,
        "dynamic_active_clusters": dynamic_clusters,
    }));
    let (mut static_listeners, mut dynamic_listeners) = (Vec::new(), Vec::new());
    for (name, item) in &store.listeners {
        let listener = render(&item.proto.to_any());
        if item.is_static {
            static_listeners
                .push(json!({ "listener": listener, "last_updated": stamp(item.last_updated) }));
        } else {
            let st = json!({
                "version_info": &*item.version,
                "listener": listener,
                "last_updated": stamp(item.last_updated),
            });
            let warm = snap
                .listeners
                .get(name)
                .is_some_and(|l| Arc::ptr_eq(&l.def, &item.value));
            let key = if warm {
                "active_state"
            } else {
                "warming_state"
            };
            let mut entry = json!({ "name": name, key: st });
            if let Some(f) = store.failures.get(&(Kind::Listener, name.clone())) {
                entry["error_state"] = error_state(Kind::Listener, f);
            }
            dynamic_listeners.push(entry);
        }
    }
    // As Envoy: a listener refused before any version was accepted is listed by name with
    // its error alone.
    for ((_, name), f) in store
        .failures
        .iter()
        .filter(|((k, n), _)| *k == Kind::Listener && !store.listeners.contains_key(n))
    {
        dynamic_listeners
            .push(json!({ "name": name, "error_state": error_state(Kind::Listener, f) }));
    }
    configs.push(json!({
        "@type": admin::ListenersConfigDump::type_url(),
        "version_info": version(Kind::Listener),
        "static_listeners": static_listeners,
        "dynamic_listeners": dynamic_listeners,
    }));
    let mut routes: Vec<_> = store
        .routes
        .iter()
        .map(|(name, item)| {
            let mut entry = json!({
                "version_info": &*item.version,
                "route_config": render(&item.proto.to_any()),
                "last_updated": stamp(item.last_updated),
            });
            if let Some(f) = store.failures.get(&(Kind::Route, name.clone())) {
                entry["error_state"] = error_state(Kind::Route, f);
            }
            entry
        })
        .collect();
    routes.extend(refused_only(store, Kind::Route, |n| {
        store.routes.contains_key(n)
    }));
    configs.push(json!({
        "@type": admin::RoutesConfigDump::type_url(),
        "dynamic_route_configs": routes,
    }));
    // Envoy lists a subscribed secret that has not arrived as warming.
    let mut secrets: Vec<_> = store
        .secrets
        .values()
        .map(|item| {
            let mut entry = json!({
                "name": item.value.name,
                "version_info": &*item.version,
                "last_updated": stamp(item.last_updated),
                "secret": render(&redacted_secret(&item.proto)),
            });
            if let Some(f) = store
                .failures
                .get(&(Kind::Secret, item.value.name.to_string()))
            {
                entry["error_state"] = error_state(Kind::Secret, f);
            }
            entry
        })
        .collect();
    for ((_, name), f) in store
        .failures
        .iter()
        .filter(|((k, n), _)| *k == Kind::Secret && !store.secrets.contains_key(n))
    {
        secrets.push(json!({ "name": name, "error_state": error_state(Kind::Secret, f) }));
    }
    // As Envoy: named, "uninitialized", stamped when the listener asking for it arrived.
    let mut warming_since: std::collections::BTreeMap<&str, SystemTime> = Default::default();
    for item in store.listeners.values() {
        for name in item
            .value
            .chains
            .iter()
            .filter_map(|c| c.tls.as_ref())
            .flat_map(|t| t.sds_names())
            .filter(|n| !store.secrets.contains_key(*n))
        {
            warming_since.entry(name).or_insert(item.last_updated);
        }
    }
    // Clusters' sockets too, whichever source (ADS or an SDS cluster) the secret comes from.
    for item in store.clusters.values() {
        for r in item
            .value
            .transport
            .sds_refs()
            .filter(|r| !store.secrets.contains_key(&r.name))
        {
            warming_since
                .entry(r.name.as_str())
                .or_insert(item.last_updated);
        }
    }
    let warming: Vec<_> = warming_since
        .into_iter()
        .map(|(n, t)| {
            json!({
                "name": n,
                "version_info": "uninitialized",
                "last_updated": stamp(t),
                "secret": {
                    "@type": crate::xds::types::SECRET,
                    "name": n,
                },
            })
        })
        .collect();
    if !secrets.is_empty() || !warming.is_empty() {
        configs.push(json!({
            "@type": admin::SecretsConfigDump::type_url(),
            "dynamic_active_secrets": secrets,
            "dynamic_warming_secrets": warming,
        }));
    }
    if include_eds {
        let mut eps: Vec<_> = store
            .endpoints
            .iter()
            .map(|(name, item)| {
                let mut entry = json!({
                    "version_info": &*item.version,
                    "endpoint_config": render(&item.proto.to_any()),
                    "last_updated": stamp(item.last_updated),
                });
                if let Some(f) = store.failures.get(&(Kind::Endpoint, name.clone())) {
                    entry["error_state"] = error_state(Kind::Endpoint, f);
                }
                entry
            })
            .collect();
        eps.extend(refused_only(store, Kind::Endpoint, |n| {
            store.endpoints.contains_key(n)
        }));
        configs.push(json!({
            "@type": admin::EndpointsConfigDump::type_url(),
            "dynamic_endpoint_configs": eps,
        }));
    }
    Ok(json!({ "configs": configs }))
}

/// Entries for refused resources of `kind` that have no accepted version (`has` is false):
/// Envoy's dynamic config entries with only `error_state`.
fn refused_only<'a>(
    store: &'a crate::xds::store::Store,
    kind: crate::xds::types::Kind,
    has: impl Fn(&str) -> bool + 'a,
) -> impl Iterator<Item = serde_json::Value> + 'a {
    store
        .failures
        .iter()
        .filter(move |((k, n), _)| *k == kind && !has(n))
        .map(move |(_, f)| serde_json::json!({ "error_state": error_state(kind, f) }))
}

pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
