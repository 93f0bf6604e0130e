//! Request counters kept as plain atomics on the request path, and the xDS counters; one
//! list of them (Envoy's dotted names with their Prometheus form) feeds every `/stats` format.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use prometheus::{IntCounter, IntCounterVec, Opts};

pub use crate::live::{
    ClusterStats, CodeCounters, FaultStats, HcmStats, ListenerStats, SslStats, TcpStats,
};

/// xDS counters under Envoy's names: CDS and LDS on their managers, RDS per route config,
/// EDS per cluster.
#[derive(Debug, Clone)]
pub struct XdsCounters {
    pub cds: [IntCounter; 3],
    pub lds: [IntCounter; 3],
    pub rds: [IntCounterVec; 3],
    pub eds: [IntCounterVec; 3],
    /// Resources refused one by one (the rest of their response applied), by type
    /// (`lds`, `rds`, `cds`, `eds`, `sds`). Envoy has no such counter; Portico's own name.
    pub rejected_resources: IntCounterVec,
}

pub const ATTEMPT: usize = 0;
pub const SUCCESS: usize = 1;
pub const REJECTED: usize = 2;

#[derive(Debug)]
pub struct Stats {
    clusters: Mutex<HashMap<String, Arc<ClusterStats>>>,
    hcms: Mutex<HashMap<String, Arc<HcmStats>>>,
    tcps: Mutex<HashMap<String, Arc<TcpStats>>>,
    listeners: Mutex<HashMap<String, Arc<ListenerStats>>>,
    pub xds: XdsCounters,
    /// Requests Portico's own HTTP/1.1 loop served (`proxy::h1`), shown once there are any:
    /// how much of the traffic skips pingora's proxy loop.
    pub h1_loop_requests: std::sync::atomic::AtomicU64,
    /// `POST /reset_counters`: each counter's value then, taken off what it shows since.
    /// The counters themselves run on untouched (the request path never sees a reset).
    counter_baseline: Mutex<HashMap<String, u64>>,
}

impl Default for Stats {
    fn default() -> Self {
        Self::new()
    }
}

// Read back by `collect_xds`, which names them for every format; no registry needed.
fn counter_vec(name: &str, label: &str) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, name), &[label])
        .unwrap_or_else(|e| panic!("static metric definition {name} is invalid: {e}"))
}

fn counter(name: &str) -> IntCounter {
    IntCounter::new(name, name)
        .unwrap_or_else(|e| panic!("static metric definition {name} is invalid: {e}"))
}

const OUTCOMES: [&str; 3] = ["update_attempt", "update_success", "update_rejected"];

impl Stats {
    pub fn new() -> Stats {
        let xds = XdsCounters {
            cds: OUTCOMES.map(|o| counter(&format!("envoy_cluster_manager_cds_{o}"))),
            lds: OUTCOMES.map(|o| counter(&format!("envoy_listener_manager_lds_{o}"))),
            rds: OUTCOMES
                .map(|o| counter_vec(&format!("envoy_http_rds_{o}"), "envoy_rds_route_config")),
            eds: OUTCOMES.map(|o| counter_vec(&format!("envoy_cluster_{o}"), "envoy_cluster_name")),
            rejected_resources: counter_vec("portico_xds_rejected_resources", "type"),
        };
        Stats {
            clusters: Mutex::default(),
            hcms: Mutex::default(),
            tcps: Mutex::default(),
            listeners: Mutex::default(),
            xds,
            h1_loop_requests: Default::default(),
            counter_baseline: Mutex::default(),
        }
    }

    /// `POST /reset_counters`: every counter in `list` (as collected, before any earlier
    /// reset is taken off) reads zero from now on.
    pub fn reset_counters(&self, raw: &StatList) {
        let mut base = self
            .counter_baseline
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for s in raw.stats.iter().filter(|s| s.kind == Kind::Counter) {
            base.insert(s.name.clone(), s.value);
        }
    }

    /// Takes the last reset off every counter in `list` (Envoy keeps a counter "used" once
    /// it has counted, reset or not).
    pub fn rebase(&self, list: &mut StatList) {
        let base = self
            .counter_baseline
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if base.is_empty() {
            return;
        }
        for s in list.stats.iter_mut().filter(|s| s.kind == Kind::Counter) {
            if let Some(b) = base.get(&s.name) {
                s.value = s.value.saturating_sub(*b);
            }
        }
    }

    pub fn cluster(&self, name: &str) -> Arc<ClusterStats> {
        let mut m = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(name.to_string()).or_default().clone()
    }

    pub fn hcm(&self, prefix: &str) -> Arc<HcmStats> {
        let mut m = self.hcms.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(prefix.to_string()).or_default().clone()
    }

    pub fn listener(&self, name: &str) -> Arc<ListenerStats> {
        let mut m = self.listeners.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(name.to_string()).or_default().clone()
    }

    pub fn tcp(&self, prefix: &str) -> Arc<TcpStats> {
        let mut m = self.tcps.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(prefix.to_string()).or_default().clone()
    }

    /// Forgets clusters that no snapshot holds any more, as Envoy drops a removed cluster's stats.
    pub fn retain_clusters(&self, live: impl Fn(&str) -> bool) {
        let mut m = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|k, _| live(k));
    }

    /// Every stat Portico keeps, under Envoy's dotted name and its Prometheus form (metric and
    /// labels after Envoy's default tag extraction), into `out`. One list feeds `/stats` (text,
    /// JSON) and `/stats/prometheus`, so the formats cannot disagree on what exists.
    pub fn collect(&self, ctx: &Context<'_>, out: &mut StatList) {
        let clusters: Vec<(String, Arc<ClusterStats>)> = sorted(&self.clusters);
        let hcms: Vec<(String, Arc<HcmStats>)> = sorted(&self.hcms);
        let tcps: Vec<(String, Arc<TcpStats>)> = sorted(&self.tcps);
        let listeners: Vec<(String, Arc<ListenerStats>)> = sorted(&self.listeners);
        // The PROXY protocol listener filter's counters, at the root scope as Envoy keeps them:
        // `downstream_cx_proxy_proto_error` and `proxy_proto.[<stat_prefix>.]...`.
        let mut proto_errors = None;
        for (prefix, s) in crate::proxy::proxy_protocol::all_stats() {
            *proto_errors.get_or_insert(0) += s.downstream_cx_proxy_proto_error.load(Relaxed);
            // Envoy's tag extraction turns the version (and a stat_prefix) into labels.
            let (scope, dotted) = if prefix.is_empty() {
                (String::new(), "proxy_proto".to_string())
            } else {
                (
                    format!("envoy_proxy_protocol_prefix=\"{}\"", esc(&prefix)),
                    format!("proxy_proto.{prefix}"),
                )
            };
            let with = |extra: &str| match (scope.is_empty(), extra.is_empty()) {
                (true, _) => extra.to_string(),
                (false, true) => scope.clone(),
                (false, false) => format!("{scope},{extra}"),
            };
            for (stat, v) in [
                ("not_found_allowed", &s.not_found_allowed),
                ("not_found_disallowed", &s.not_found_disallowed),
            ] {
                out.add(
                    Kind::Counter,
                    format!("{dotted}.{stat}"),
                    format!("envoy_proxy_proto_{stat}"),
                    with(""),
                    v.load(Relaxed),
                );
            }
            for (version, vs) in [("1", &s.v1), ("2", &s.v2)] {
                let label = with(&format!("envoy_proxy_protocol_version=\"{version}\""));
                for (stat, v) in [
                    ("found", &vs.found),
                    ("disallowed", &vs.disallowed),
                    ("error", &vs.error),
                ] {
                    out.add(
                        Kind::Counter,
                        format!("{dotted}.versions.v{version}.{stat}"),
                        format!("envoy_proxy_proto_{stat}"),
                        label.clone(),
                        v.load(Relaxed),
                    );
                }
            }
        }
        if let Some(n) = proto_errors {
            out.add(
                Kind::Counter,
                "downstream_cx_proxy_proto_error".into(),
                "envoy_downstream_cx_proxy_proto_error".into(),
                String::new(),
                n,
            );
        }
        for (n, s) in &listeners {
            let label = format!("envoy_listener_address=\"{}\"", esc(n));
            for (kind, stat, v) in [
                (Kind::Counter, "downstream_cx_total", &s.cx_total),
                (Kind::Counter, "downstream_cx_destroy", &s.cx_destroy),
                (Kind::Gauge, "downstream_cx_active", &s.cx_active),
                (
                    Kind::Counter,
                    "no_filter_chain_match",
                    &s.no_filter_chain_match,
                ),
                (
                    Kind::Counter,
                    "downstream_global_cx_overflow",
                    &s.global_cx_overflow,
                ),
                (Kind::Counter, "ssl.handshake", &s.ssl.handshake),
                (
                    Kind::Counter,
                    "ssl.connection_error",
                    &s.ssl.connection_error,
                ),
                (Kind::Counter, "ssl.no_certificate", &s.ssl.no_certificate),
                (
                    Kind::Counter,
                    "ssl.fail_verify_error",
                    &s.ssl.fail_verify_error,
                ),
                (
                    Kind::Counter,
                    "ssl.fail_verify_no_cert",
                    &s.ssl.fail_verify_no_cert,
                ),
                (Kind::Counter, "ssl.fail_verify_san", &s.ssl.fail_verify_san),
                (
                    Kind::Counter,
                    "ssl.fail_verify_cert_hash",
                    &s.ssl.fail_verify_cert_hash,
                ),
                (Kind::Counter, "ssl.session_reused", &s.ssl.session_reused),
            ] {
                out.add(
                    kind,
                    format!("listener.{n}.{stat}"),
                    format!("envoy_listener_{}", stat.replace('.', "_")),
                    label.clone(),
                    v.load(Relaxed),
                );
            }
            let negotiated = s
                .ssl
                .negotiated
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            for ((tag, value), count) in negotiated {
                let (group, metric, tag) = match tag {
                    "cipher" => ("ciphers", "envoy_listener_ssl_ciphers", "envoy_ssl_cipher"),
                    "version" => (
                        "versions",
                        "envoy_listener_ssl_versions",
                        "envoy_ssl_version",
                    ),
                    _ => ("curves", "envoy_listener_ssl_curves", "envoy_ssl_curve"),
                };
                out.add(
                    Kind::Counter,
                    format!("listener.{n}.ssl.{group}.{value}"),
                    metric.to_string(),
                    format!("{tag}=\"{}\",{label}", esc(value)),
                    count,
                );
            }
        }
        for (n, s) in &tcps {
            for (stat, v) in [
                ("downstream_cx_total", &s.cx_total),
                ("downstream_cx_no_route", &s.cx_no_route),
                ("idle_timeout", &s.idle_timeout),
                ("downstream_cx_rx_bytes_total", &s.rx_bytes),
                ("downstream_cx_tx_bytes_total", &s.tx_bytes),
            ] {
                let (metric, tag) = tagged("tcp", n, stat);
                out.add(
                    Kind::Counter,
                    format!("tcp.{n}.{stat}"),
                    metric,
                    format!("envoy_tcp_prefix=\"{}\"", esc(tag)),
                    v.load(Relaxed),
                );
            }
        }
        for (n, s) in &clusters {
            // `dotted` is the stat under `cluster.<name>.`; `prom` the metric's last part,
            // `extra` the labels tag extraction took out of `dotted` (a response code).
            let mut c = |kind, dotted: &str, prom: &str, extra: &str, v: u64| {
                let (metric, tag) = tagged("cluster", n, prom);
                out.add(
                    kind,
                    format!("cluster.{n}.{dotted}"),
                    metric,
                    format!("{extra}envoy_cluster_name=\"{}\"", esc(tag)),
                    v,
                );
            };
            for (kind, stat, v) in [
                (Kind::Counter, "upstream_rq_total", s.rq_total.load(Relaxed)),
                (
                    Kind::Counter,
                    "upstream_cx_connect_fail",
                    s.cx_connect_fail.load(Relaxed),
                ),
                (
                    Kind::Counter,
                    "upstream_rq_timeout",
                    s.rq_timeout.load(Relaxed),
                ),
                (Kind::Gauge, "upstream_rq_active", s.rq_active.load(Relaxed)),
                (
                    Kind::Gauge,
                    "outlier_detection.ejections_active",
                    u64::from(s.outlier.ejected.load(Relaxed)),
                ),
                (
                    Kind::Gauge,
                    "upstream_rq_pending_active",
                    s.rq_pending_active.load(Relaxed),
                ),
            ] {
                c(kind, stat, &stat.replace('.', "_"), "", v);
            }
            for (stat, v) in [
                ("upstream_rq_retry", &s.rq_retry),
                ("upstream_rq_retry_success", &s.rq_retry_success),
                ("upstream_rq_retry_overflow", &s.rq_retry_overflow),
                (
                    "upstream_rq_retry_limit_exceeded",
                    &s.rq_retry_limit_exceeded,
                ),
                ("upstream_rq_per_try_timeout", &s.rq_per_try_timeout),
                ("upstream_rq_pending_overflow", &s.rq_pending_overflow),
                ("upstream_rq_active_overflow", &s.rq_active_overflow),
                ("upstream_cx_overflow", &s.cx_overflow),
                ("lb_healthy_panic", &s.lb_healthy_panic),
                ("upstream_cx_none_healthy", &s.cx_none_healthy),
                ("original_dst_host_invalid", &s.original_dst_host_invalid),
                (
                    "outlier_detection.ejections_enforced_total",
                    &s.outlier.ejections_enforced_total,
                ),
                (
                    "outlier_detection.ejections_enforced_consecutive_5xx",
                    &s.outlier.ejections_enforced_5xx,
                ),
                (
                    "outlier_detection.ejections_enforced_consecutive_gateway_failure",
                    &s.outlier.ejections_enforced_gateway,
                ),
                (
                    "outlier_detection.ejections_detected_consecutive_5xx",
                    &s.outlier.ejections_detected_5xx,
                ),
                (
                    "outlier_detection.ejections_detected_consecutive_gateway_failure",
                    &s.outlier.ejections_detected_gateway,
                ),
                (
                    "outlier_detection.ejections_enforced_success_rate",
                    &s.outlier.ejections_enforced_success_rate,
                ),
                (
                    "outlier_detection.ejections_detected_success_rate",
                    &s.outlier.ejections_detected_success_rate,
                ),
                (
                    "outlier_detection.ejections_overflow",
                    &s.outlier.ejections_overflow,
                ),
            ] {
                c(
                    Kind::Counter,
                    stat,
                    &stat.replace('.', "_"),
                    "",
                    v.load(Relaxed),
                );
            }
            for (code, count) in s.codes.snapshot() {
                c(
                    Kind::Counter,
                    &format!("upstream_rq_{code}"),
                    "upstream_rq",
                    &format!("envoy_response_code=\"{code}\","),
                    count,
                );
            }
            // envoy.filters.http.grpc_stats: `grpc.[<service>.<method>.]<stat>`.
            for (names, m) in s.grpc.all().iter() {
                for (stat, v) in m.samples() {
                    let (dotted, prom, extra) = grpc_stat(names, &stat);
                    c(Kind::Counter, &dotted, &prom, &extra, v);
                }
            }
            for (i, x) in s.rq_xx.iter().enumerate() {
                let class = format!("envoy_response_code_class=\"{}\",", i + 1);
                c(
                    Kind::Counter,
                    &format!("upstream_rq_{}xx", i + 1),
                    "upstream_rq_xx",
                    &class,
                    x.load(Relaxed),
                );
            }
            if s.health.active() {
                let h = &s.health;
                for (stat, v) in [
                    ("health_check.attempt", &h.attempt),
                    ("health_check.success", &h.success),
                    ("health_check.failure", &h.failure),
                    ("health_check.network_failure", &h.network_failure),
                    ("health_check.passive_failure", &h.passive_failure),
                    ("health_check.verify_cluster", &h.verify_cluster),
                ] {
                    c(
                        Kind::Counter,
                        stat,
                        &stat.replace('.', "_"),
                        "",
                        v.load(Relaxed),
                    );
                }
                let (healthy, degraded) = h.gauges();
                c(
                    Kind::Gauge,
                    "health_check.healthy",
                    "health_check_healthy",
                    "",
                    healthy,
                );
                c(
                    Kind::Gauge,
                    "health_check.degraded",
                    "health_check_degraded",
                    "",
                    degraded,
                );
            }
            if let Some((healthy, total)) = (ctx.membership)(n) {
                c(
                    Kind::Gauge,
                    "membership_healthy",
                    "membership_healthy",
                    "",
                    healthy as u64,
                );
                c(
                    Kind::Gauge,
                    "membership_total",
                    "membership_total",
                    "",
                    total as u64,
                );
            }
        }
        for (n, s) in &hcms {
            let mut h = |kind, dotted: &str, prom: &str, extra: &str, v: u64| {
                let (metric, tag) = tagged("http", n, prom);
                out.add(
                    kind,
                    format!("http.{n}.{dotted}"),
                    metric,
                    format!("{extra}envoy_http_conn_manager_prefix=\"{}\"", esc(tag)),
                    v,
                );
            };
            let mut stats = vec![
                (
                    Kind::Counter,
                    "downstream_rq_total",
                    s.rq_total.load(Relaxed),
                ),
                (
                    Kind::Counter,
                    "downstream_cx_total",
                    s.cx_total.load(Relaxed),
                ),
                (Kind::Counter, "no_route", s.no_route.load(Relaxed)),
                (
                    Kind::Counter,
                    "downstream_rq_rx_reset",
                    s.rq_rx_reset.load(Relaxed),
                ),
                (
                    Kind::Counter,
                    "downstream_rq_header_timeout",
                    s.rq_header_timeout.load(Relaxed),
                ),
                (
                    Kind::Counter,
                    "downstream_rq_timeout",
                    s.rq_timeout.load(Relaxed),
                ),
                (
                    Kind::Counter,
                    "downstream_cx_max_requests_reached",
                    s.cx_max_requests_reached.load(Relaxed),
                ),
                (
                    Kind::Counter,
                    "downstream_cx_max_duration_reached",
                    s.cx_max_duration_reached.load(Relaxed),
                ),
                (
                    Kind::Counter,
                    "downstream_rq_ws_on_non_ws_route",
                    s.ws_on_non_ws_route.load(Relaxed),
                ),
                (
                    Kind::Counter,
                    "downstream_cx_ssl_total",
                    s.cx_ssl_total.load(Relaxed),
                ),
                (
                    Kind::Gauge,
                    "downstream_cx_ssl_active",
                    s.cx_ssl_active.load(Relaxed),
                ),
                (
                    Kind::Counter,
                    "downstream_cx_upgrades_total",
                    s.upgrades_total.load(Relaxed),
                ),
                (
                    Kind::Gauge,
                    "downstream_cx_upgrades_active",
                    s.upgrades_active.load(Relaxed),
                ),
            ];
            if s.fault.enabled.load(Relaxed) {
                let fs = &s.fault;
                stats.extend([
                    (
                        Kind::Counter,
                        "fault.delays_injected",
                        fs.delays_injected.load(Relaxed),
                    ),
                    (
                        Kind::Counter,
                        "fault.aborts_injected",
                        fs.aborts_injected.load(Relaxed),
                    ),
                    (
                        Kind::Counter,
                        "fault.faults_overflow",
                        fs.faults_overflow.load(Relaxed),
                    ),
                    (Kind::Counter, "fault.response_rl_injected", 0),
                    (
                        Kind::Gauge,
                        "fault.active_faults",
                        fs.active_faults.load(Relaxed),
                    ),
                ]);
            }
            stats.push((
                Kind::Gauge,
                "downstream_rq_active",
                s.rq_active.load(Relaxed),
            ));
            for (kind, stat, v) in stats {
                h(kind, stat, &stat.replace('.', "_"), "", v);
            }
            for (stat, v) in s.named.all() {
                h(Kind::Counter, &stat, &stat.replace('.', "_"), "", v);
            }
            for (i, x) in s.rq_xx.iter().enumerate() {
                let class = format!("envoy_response_code_class=\"{}\",", i + 1);
                h(
                    Kind::Counter,
                    &format!("downstream_rq_{}xx", i + 1),
                    "downstream_rq_xx",
                    &class,
                    x.load(Relaxed),
                );
            }
        }
        for (prefix, s) in crate::filters::local_ratelimit::all_stats() {
            for (stat, v) in [
                ("enabled", s.enabled.load(Relaxed)),
                ("enforced", s.enforced.load(Relaxed)),
                ("ok", s.ok.load(Relaxed)),
                ("rate_limited", s.rate_limited.load(Relaxed)),
                ("shadow_mode", 0),
            ] {
                let (metric, tag) = tagged("http_local_rate_limit", &prefix, stat);
                out.add(
                    Kind::Counter,
                    format!("{prefix}.http_local_rate_limit.{stat}"),
                    metric,
                    format!("envoy_local_http_ratelimit_prefix=\"{}\"", esc(tag)),
                    v,
                );
            }
        }
        // Filters outside a connection manager (network RBAC): full names, no tags.
        for (stat, v) in crate::live::ROOT_COUNTERS.all() {
            out.add(
                Kind::Counter,
                stat.clone(),
                format!("envoy_{}", stat.replace('.', "_")),
                String::new(),
                v,
            );
        }
        self.collect_xds(ctx, out);
    }

    /// The xDS counters: `cluster_manager.cds.*`, `listener_manager.lds.*`,
    /// `http.<stat_prefix>.rds.<route_config>.*`, `cluster.<name>.update_*` (EDS).
    fn collect_xds(&self, ctx: &Context<'_>, out: &mut StatList) {
        use prometheus::core::Collector;
        let x = &self.xds;
        for (i, o) in OUTCOMES.iter().enumerate() {
            for (scope, c) in [
                ("cluster_manager.cds", &x.cds[i]),
                ("listener_manager.lds", &x.lds[i]),
            ] {
                out.add(
                    Kind::Counter,
                    format!("{scope}.{o}"),
                    format!("envoy_{}_{o}", scope.replace('.', "_")),
                    String::new(),
                    c.get(),
                );
            }
        }
        // Each labelled counter as (label value, count).
        let samples = |v: &IntCounterVec| -> Vec<(String, u64)> {
            v.collect()
                .iter()
                .flat_map(|f| f.get_metric())
                .map(|m| {
                    let label = m.get_label().first().map(|l| l.value().to_string());
                    (
                        label.unwrap_or_default(),
                        m.get_counter().get_value() as u64,
                    )
                })
                .collect()
        };
        for (i, o) in OUTCOMES.iter().enumerate() {
            for (route, n) in samples(&x.rds[i]) {
                // Envoy scopes RDS under the connection manager that subscribed first.
                let dotted = match (ctx.rds_prefix)(&route) {
                    Some(p) => format!("http.{p}.rds.{route}.{o}"),
                    None => format!("http.rds.{route}.{o}"),
                };
                out.add(
                    Kind::Counter,
                    dotted,
                    format!("envoy_http_rds_{o}"),
                    format!("envoy_rds_route_config=\"{}\"", esc(&route)),
                    n,
                );
            }
            for (cluster, n) in samples(&x.eds[i]) {
                let (metric, tag) = tagged("cluster", &cluster, o);
                out.add(
                    Kind::Counter,
                    format!("cluster.{cluster}.{o}"),
                    metric,
                    format!("envoy_cluster_name=\"{}\"", esc(tag)),
                    n,
                );
            }
        }
        for (kind, n) in samples(&x.rejected_resources) {
            out.add(
                Kind::Counter,
                format!("portico.xds.{kind}.rejected_resources"),
                "portico_xds_rejected_resources".into(),
                format!("type=\"{}\"", esc(&kind)),
                n,
            );
        }
        let own = self
            .h1_loop_requests
            .load(std::sync::atomic::Ordering::Relaxed);
        if own > 0 {
            out.add(
                Kind::Counter,
                "portico.http1_loop.rq_total".into(),
                "portico_http1_loop_rq_total".into(),
                String::new(),
                own,
            );
        }
    }

    /// Prometheus text of every stat. `membership` gives (healthy, total) hosts per cluster.
    pub fn render(&self, membership: &dyn Fn(&str) -> Option<(usize, usize)>) -> String {
        let mut list = StatList::default();
        self.collect(
            &Context {
                membership,
                rds_prefix: &|_| None,
            },
            &mut list,
        );
        list.prometheus(&Select::default())
    }
}

/// What [`Stats::collect`] needs from the current config.
pub struct Context<'a> {
    /// (healthy, total) hosts of a cluster.
    pub membership: &'a dyn Fn(&str) -> Option<(usize, usize)>,
    /// The `stat_prefix` of the connection manager a route configuration serves.
    pub rds_prefix: &'a dyn Fn(&str) -> Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// One stat: Envoy's dotted name (what `/stats` prints and `filter=` matches) and its
/// Prometheus form after Envoy's tag extraction.
#[derive(Debug, Clone)]
pub struct Stat {
    pub kind: Kind,
    pub name: String,
    pub metric: String,
    /// Without braces: `envoy_cluster_name="a"`.
    pub labels: String,
    pub value: u64,
    /// Envoy's "used" flag (`usedonly`): set once a counter was incremented or a gauge set.
    /// Portico keeps no such flag; a non-zero value stands for it, except where the caller
    /// knows better (`server.state` is always set, as Envoy sets it on every stats flush).
    pub used: bool,
}

/// Which stats a request wants: `usedonly`, `filter=<regex>` on the dotted name.
#[derive(Debug, Default)]
pub struct Select {
    pub used_only: bool,
    pub filter: Option<regex::Regex>,
}

impl Select {
    fn wants(&self, name: &str, used: bool) -> bool {
        (used || !self.used_only) && self.filter.as_ref().is_none_or(|r| r.is_match(name))
    }
}

/// Stats gathered for one admin answer: counters and gauges, and Envoy's text readouts
/// (`cluster_manager.cds.version_text`).
#[derive(Debug, Default)]
pub struct StatList {
    pub stats: Vec<Stat>,
    pub texts: Vec<(String, String)>,
}

impl StatList {
    pub fn add(&mut self, kind: Kind, name: String, metric: String, labels: String, value: u64) {
        self.stats.push(Stat {
            kind,
            name,
            metric,
            labels,
            value,
            used: value != 0,
        });
    }

    /// A stat Envoy marks used whatever its value.
    pub fn add_used(&mut self, kind: Kind, name: &str, value: u64) {
        self.stats.push(Stat {
            kind,
            name: name.to_string(),
            metric: format!("envoy_{}", name.replace('.', "_")),
            labels: String::new(),
            value,
            used: true,
        });
    }

    /// A gauge at the root scope, `used` when non-zero.
    pub fn gauge(&mut self, name: &str, value: u64) {
        self.add(
            Kind::Gauge,
            name.to_string(),
            format!("envoy_{}", name.replace('.', "_")),
            String::new(),
            value,
        );
    }

    pub fn text(&mut self, name: &str, value: &str) {
        self.texts.push((name.to_string(), value.to_string()));
    }

    fn sorted(&self, sel: &Select) -> (Vec<&(String, String)>, Vec<&Stat>) {
        let mut texts: Vec<_> = self
            .texts
            .iter()
            .filter(|(n, v)| sel.wants(n, !v.is_empty()))
            .collect();
        texts.sort_by(|a, b| a.0.cmp(&b.0));
        let mut stats: Vec<_> = self
            .stats
            .iter()
            .filter(|s| sel.wants(&s.name, s.used))
            .collect();
        // Envoy lists counters and gauges together, by name.
        stats.sort_by(|a, b| a.name.cmp(&b.name));
        (texts, stats)
    }

    /// Envoy's `/stats` text: text readouts (`name: "value"`), then counters and gauges
    /// (`name: value`), each sorted by name. Histograms: Portico keeps none.
    pub fn text_format(&self, sel: &Select) -> String {
        let (texts, stats) = self.sorted(sel);
        let mut out = String::with_capacity(64 * (texts.len() + stats.len()));
        for (n, v) in texts {
            let _ = writeln!(out, "{n}: {}", serde_json::Value::from(v.as_str()));
        }
        for s in stats {
            let _ = writeln!(out, "{}: {}", s.name, s.value);
        }
        out
    }

    /// Envoy's `/stats?format=json`: `{"stats":[{"name":..,"value":..},...]}`.
    pub fn json_format(&self, sel: &Select) -> String {
        let (texts, stats) = self.sorted(sel);
        let mut v: Vec<serde_json::Value> = texts
            .into_iter()
            .map(|(n, v)| serde_json::json!({"name": n, "value": v}))
            .collect();
        v.extend(
            stats
                .into_iter()
                .map(|s| serde_json::json!({"name": s.name, "value": s.value})),
        );
        serde_json::json!({ "stats": v }).to_string()
    }

    /// Prometheus text as Envoy writes it: counter families, then gauge families, each by
    /// metric name, one `# TYPE` line per family. Text readouts are left out, as Envoy does
    /// unless asked for them.
    pub fn prometheus(&self, sel: &Select) -> String {
        let mut families: [BTreeMap<&str, Vec<&Stat>>; 2] = Default::default();
        for s in self.stats.iter().filter(|s| sel.wants(&s.name, s.used)) {
            let i = match s.kind {
                Kind::Counter => 0,
                Kind::Gauge => 1,
            };
            families[i].entry(&s.metric).or_default().push(s);
        }
        let mut out = String::with_capacity(4096);
        for (families, kind) in families.iter().zip(["counter", "gauge"]) {
            for (name, samples) in families {
                let _ = writeln!(out, "# TYPE {name} {kind}");
                for s in samples {
                    let _ = writeln!(out, "{name}{{{}}} {}", s.labels, s.value);
                }
            }
        }
        out
    }
}

/// The bootstrap's `stats_config.stats_tags` with `use_all_default_tags: false` (what
/// istio-agent writes): Envoy's own stats get their Prometheus names and labels from these
/// regexes alone instead of Envoy's default tags. As Envoy's `TagProducerImpl`: every rule is
/// searched in the full dotted name; a match's first group is cut out of the name and its
/// second group (else the first) is the tag's value; `fixed_value` tags go on every stat.
/// Stats that carry their own tags (Istio's `istiocustom.*`) are left alone.
#[derive(Debug, Default)]
pub struct TagRules {
    rules: Vec<(String, TagValue)>,
}

#[derive(Debug)]
enum TagValue {
    Regex(regex::Regex),
    Fixed(String),
}

impl TagRules {
    /// The rules of a bootstrap's `stats_config`; None when they do not replace Envoy's
    /// default tags (`use_all_default_tags` unset or true: with `stats_tags` too, Portico
    /// renders with its default tags alone and says so once). A regex the `regex` crate
    /// cannot take is skipped with a warning (Envoy's are ECMAScript; the lookahead
    /// `(?=\.)` istio-agent writes is dropped: it only restates the `\.` that follows).
    pub fn from_bootstrap(
        sc: &envoy_types::pb::envoy::config::metrics::v3::StatsConfig,
    ) -> Option<TagRules> {
        use envoy_types::pb::envoy::config::metrics::v3::tag_specifier::TagValue as Pb;
        let defaults = sc.use_all_default_tags.as_ref().is_none_or(|b| b.value);
        if sc.stats_tags.is_empty() && defaults {
            return None;
        }
        if defaults {
            tracing::warn!(
                "stats_config.stats_tags with use_all_default_tags: Portico keeps Envoy's default tags and ignores the custom ones"
            );
            return None;
        }
        let mut rules = Vec::new();
        for t in &sc.stats_tags {
            match &t.tag_value {
                Some(Pb::Regex(r)) => {
                    let translated = r.replace("(?=\\.)", "");
                    match regex::Regex::new(&translated) {
                        Ok(re) => rules.push((t.tag_name.clone(), TagValue::Regex(re))),
                        Err(e) => tracing::warn!(
                            tag = %t.tag_name,
                            "stats_config.stats_tags: regex '{r}' is not supported: {e}"
                        ),
                    }
                }
                Some(Pb::FixedValue(v)) => {
                    rules.push((t.tag_name.clone(), TagValue::Fixed(v.clone())))
                }
                // A tag named after one of Envoy's defaults, without a value: Envoy's own
                // regex for it, which Portico's default tags already stand for.
                None => {}
            }
        }
        Some(TagRules { rules })
    }

    /// (Prometheus metric, labels) of the dotted `name`.
    pub fn apply(&self, name: &str) -> (String, String) {
        let mut cut = vec![false; name.len()];
        let mut labels = String::new();
        for (tag, rule) in &self.rules {
            let value = match rule {
                TagValue::Fixed(v) => v.as_str(),
                TagValue::Regex(re) => {
                    let Some(c) = re.captures(name) else {
                        continue;
                    };
                    let Some(remove) = c.get(1) else {
                        continue;
                    };
                    for flag in &mut cut[remove.range()] {
                        *flag = true;
                    }
                    c.get(2).unwrap_or(remove).as_str()
                }
            };
            if !labels.is_empty() {
                labels.push(',');
            }
            let _ = write!(labels, "{}=\"{}\"", sanitize(tag), esc(value));
        }
        let kept: String = name
            .char_indices()
            .filter(|(i, _)| !cut[*i])
            .map(|(_, c)| c)
            .collect();
        (format!("envoy_{}", sanitize(&kept)), labels)
    }
}

/// Envoy's Prometheus name sanitizing: anything but `[a-zA-Z0-9_]` becomes `_`.
fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

impl StatList {
    /// Envoy's own stats named by the bootstrap's tag rules (see [`TagRules`]).
    pub fn retag(&mut self, rules: &TagRules) {
        for s in &mut self.stats {
            if s.name.starts_with("istiocustom.") {
                continue;
            }
            let (metric, labels) = rules.apply(&s.name);
            s.metric = metric;
            s.labels = labels;
        }
    }
}

fn sorted<T>(m: &Mutex<HashMap<String, Arc<T>>>) -> Vec<(String, Arc<T>)> {
    let m = m.lock().unwrap_or_else(|p| p.into_inner());
    let mut v: Vec<_> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Envoy's default tag extraction for `<scope>.<name>.<stat>`: the tag is `<name>` up to its
/// first dot; whatever follows that dot stays in the metric name. So a cluster named
/// `outbound|9080|v1|reviews.default.svc.cluster.local` is reported by Envoy as
/// `envoy_cluster_default_svc_cluster_local_upstream_rq_total{envoy_cluster_name="outbound|9080|v1|reviews"}`.
pub fn tagged<'a>(scope: &str, name: &'a str, stat: &str) -> (String, &'a str) {
    match name.split_once('.') {
        None => (format!("envoy_{scope}_{stat}"), name),
        Some((tag, rest)) => {
            let rest: String = rest
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect();
            (format!("envoy_{scope}_{rest}_{stat}"), tag)
        }
    }
}

/// A gRPC stats counter: its dotted name under `cluster.<name>.`, and its Prometheus name and
/// labels after Envoy's default tag extraction (`cluster.*.grpc.$.**` takes the service,
/// `cluster.*.grpc.*.$.**` the method, each one dot-separated token).
fn grpc_stat(names: &str, stat: &str) -> (String, String, String) {
    if names.is_empty() {
        return (
            format!("grpc.{stat}"),
            format!("grpc_{stat}"),
            String::new(),
        );
    }
    let dotted = format!("grpc.{names}.{stat}");
    let mut tokens = names.split('.');
    let service = tokens.next().unwrap_or_default();
    let method = tokens.next().unwrap_or_default();
    let rest: Vec<&str> = tokens.collect();
    let mut prom = String::from("grpc");
    for t in rest.iter().copied().chain(std::iter::once(stat)) {
        prom.push('_');
        prom.push_str(t);
    }
    let extra = format!(
        "envoy_grpc_bridge_method=\"{}\",envoy_grpc_bridge_service=\"{}\",",
        esc(method),
        esc(service)
    );
    (dotted, prom, extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_counters_count_many_codes() {
        let c = CodeCounters::default();
        for code in 200..215u16 {
            for _ in 0..(code - 199) {
                c.inc(code);
            }
        }
        let s = c.snapshot();
        assert_eq!(s.len(), 15);
        assert_eq!(s[&200], 1);
        assert_eq!(s[&214], 15);
    }

    #[test]
    fn fault_stats_render_under_envoys_names_once_enabled() {
        let stats = Stats::new();
        let h = stats.hcm("ingress");
        assert!(!stats.render(&|_| None).contains("fault"));
        h.fault.enabled.store(true, Relaxed);
        h.fault.aborts_injected.fetch_add(2, Relaxed);
        assert!(h.fault.try_activate(Some(1)));
        assert!(!h.fault.try_activate(Some(1)), "max_active_faults reached");
        let text = stats.render(&|_| None);
        for line in [
            "envoy_http_fault_aborts_injected{envoy_http_conn_manager_prefix=\"ingress\"} 2",
            "envoy_http_fault_delays_injected{envoy_http_conn_manager_prefix=\"ingress\"} 0",
            "envoy_http_fault_faults_overflow{envoy_http_conn_manager_prefix=\"ingress\"} 1",
            "envoy_http_fault_active_faults{envoy_http_conn_manager_prefix=\"ingress\"} 1",
            "# TYPE envoy_http_fault_active_faults gauge",
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }

    #[test]
    fn render_uses_envoy_names() {
        let stats = Stats::new();
        let c = stats.cluster("outbound|9080|v1|reviews.default.svc.cluster.local");
        c.start();
        c.record_code(200);
        c.start();
        c.record_code(503);
        stats.xds.cds[SUCCESS].inc();
        let r = stats.cluster("ratings");
        r.start();
        r.record_code(200);
        let text = stats.render(&|_| Some((1, 2)));
        assert!(text.contains(
            "envoy_cluster_default_svc_cluster_local_upstream_rq_total{envoy_cluster_name=\"outbound|9080|v1|reviews\"} 2"
        ), "{text}");
        assert!(text.contains("envoy_cluster_upstream_rq_total{envoy_cluster_name=\"ratings\"} 1"));
        assert!(text.contains(
            "envoy_response_code=\"503\",envoy_cluster_name=\"outbound|9080|v1|reviews\"} 1"
        ));
        assert!(text.contains("envoy_cluster_membership_total{envoy_cluster_name=\"ratings\"} 2"));
        assert!(text.contains("envoy_cluster_manager_cds_update_success{} 1"));
    }

    fn sample() -> StatList {
        let stats = Stats::new();
        let c = stats.cluster("outbound|80||web.default.svc.cluster.local");
        c.start();
        c.record_code(200);
        stats.xds.cds[SUCCESS].inc();
        stats.xds.rds[SUCCESS].with_label_values(&["http.80"]).inc();
        stats.xds.eds[REJECTED].with_label_values(&["web"]).inc();
        stats.listener("0.0.0.0_8080").cx_active.store(2, Relaxed);
        let mut list = StatList::default();
        stats.collect(
            &Context {
                membership: &|_| Some((1, 1)),
                rds_prefix: &|r| (r == "http.80").then(|| "outbound_0.0.0.0_80".to_string()),
            },
            &mut list,
        );
        list.add_used(Kind::Gauge, "server.state", 0);
        list.gauge("listener_manager.workers_started", 1);
        list.text("cluster_manager.cds.version_text", "v1");
        list
    }

    #[test]
    fn text_format_sorts_like_envoy_and_names_by_dots() {
        let list = sample();
        let text = list.text_format(&Select::default());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "cluster_manager.cds.version_text: \"v1\"");
        let names: Vec<&str> = lines[1..]
            .iter()
            .map(|l| l.split(": ").next().unwrap())
            .collect();
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(names, sorted, "counters and gauges together, by name");
        for want in [
            "cluster.outbound|80||web.default.svc.cluster.local.upstream_rq_200: 1",
            "cluster.outbound|80||web.default.svc.cluster.local.upstream_rq_2xx: 1",
            "cluster.web.update_rejected: 1",
            "cluster_manager.cds.update_success: 1",
            "http.outbound_0.0.0.0_80.rds.http.80.update_success: 1",
            "listener.0.0.0.0_8080.downstream_cx_active: 2",
            "listener.0.0.0.0_8080.ssl.handshake: 0",
            "server.state: 0",
        ] {
            assert!(lines.contains(&want), "{want} missing in\n{text}");
        }
    }

    #[test]
    fn usedonly_and_filter_answer_pilot_agents_queries() {
        let list = sample();
        let ready = Select {
            used_only: true,
            filter: Some(
                regex::Regex::new(r"^(server\.state|listener_manager\.workers_started)").unwrap(),
            ),
        };
        assert_eq!(
            list.text_format(&ready),
            "listener_manager.workers_started: 1\nserver.state: 0\n"
        );
        let updates = Select {
            used_only: true,
            filter: Some(
                regex::Regex::new(
                    r"^(cluster_manager\.cds|listener_manager\.lds)\.(update_success|update_rejected)$",
                )
                .unwrap(),
            ),
        };
        // Counters never incremented are not "used": lds is absent, as in Envoy.
        assert_eq!(
            list.text_format(&updates),
            "cluster_manager.cds.update_success: 1\n"
        );
    }

    #[test]
    fn json_and_prometheus_come_from_the_same_list() {
        let list = sample();
        let sel = Select {
            used_only: false,
            filter: Some(regex::Regex::new(r"^(server\.state|cluster_manager\.cds\.update_success|cluster_manager\.cds\.version_text)$").unwrap()),
        };
        assert_eq!(
            list.json_format(&sel),
            r#"{"stats":[{"name":"cluster_manager.cds.version_text","value":"v1"},{"name":"cluster_manager.cds.update_success","value":1},{"name":"server.state","value":0}]}"#
        );
        assert_eq!(
            list.prometheus(&sel),
            "# TYPE envoy_cluster_manager_cds_update_success counter\n\
             envoy_cluster_manager_cds_update_success{} 1\n\
             # TYPE envoy_server_state gauge\n\
             envoy_server_state{} 0\n"
        );
        let all = list.prometheus(&Select::default());
        assert!(all.contains(
            "envoy_cluster_default_svc_cluster_local_upstream_rq{envoy_response_code=\"200\",envoy_cluster_name=\"outbound|80||web\"} 1"
        ), "{all}");
        assert!(all.contains("envoy_http_rds_update_success{envoy_rds_route_config=\"http.80\"} 1"));
        // Counters first, then gauges, as Envoy writes them.
        let first_gauge = all.find(" gauge\n").unwrap();
        assert!(!all[first_gauge..].contains(" counter\n"));
    }
}

#[cfg(test)]
mod tag_rules_tests {
    use super::*;
    use envoy_types::pb::envoy::config::metrics::v3::{tag_specifier, StatsConfig, TagSpecifier};

    /// istio-agent's bootstrap rules (the 1.18 sidecar dump's `stats_config`).
    fn istio_rules() -> TagRules {
        let tag = |n: &str, r: &str| TagSpecifier {
            tag_name: n.into(),
            tag_value: Some(tag_specifier::TagValue::Regex(r.into())),
        };
        let sc = StatsConfig {
            stats_tags: vec![
                tag(
                    "cluster_name",
                    r"^cluster\.((.+?(\..+?\.svc\.cluster\.local)?)\.)",
                ),
                tag("tcp_prefix", r"^tcp\.((.*?)\.)\w+?$"),
                tag("response_code", r"_rq(_(\d{3}))$"),
                tag("response_code_class", r"_rq(_(\dxx))$"),
                tag(
                    "http_conn_manager_listener_prefix",
                    r"^listener(?=\.).*?\.http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)",
                ),
                tag(
                    "http_conn_manager_prefix",
                    r"^http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)",
                ),
                tag(
                    "listener_address",
                    r"^listener\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)",
                ),
                tag("cache", r"(cache\.(.+?)\.)"),
                tag("component", r"(component\.(.+?)\.)"),
                tag("tag", r"(tag\.(.+?);\.)"),
            ],
            use_all_default_tags: Some(envoy_types::pb::google::protobuf::BoolValue {
                value: false,
            }),
            ..Default::default()
        };
        let rules = TagRules::from_bootstrap(&sc).expect("rules");
        assert_eq!(rules.rules.len(), 10, "every istio-agent regex compiles");
        rules
    }

    #[test]
    fn istio_agent_tag_regexes_name_envoys_stats() {
        let r = istio_rules();
        assert_eq!(
            r.apply("cluster.outbound|9080||reviews.default.svc.cluster.local.upstream_rq_200"),
            (
                "envoy_cluster_upstream_rq".to_string(),
                "cluster_name=\"outbound|9080||reviews.default.svc.cluster.local\",response_code=\"200\""
                    .to_string()
            )
        );
        assert_eq!(
            r.apply("cluster.xds-grpc.upstream_cx_total"),
            (
                "envoy_cluster_upstream_cx_total".to_string(),
                "cluster_name=\"xds-grpc\"".to_string()
            )
        );
        assert_eq!(
            r.apply("http.outbound_0.0.0.0_8080.downstream_rq_total").0,
            "envoy_http_outbound_0_0_0_0_8080_downstream_rq_total",
            "a prefix with letters is not an address"
        );
        assert_eq!(
            r.apply("listener.0.0.0.0_8080.downstream_cx_total"),
            (
                "envoy_listener_downstream_cx_total".to_string(),
                "listener_address=\"0.0.0.0_8080\"".to_string()
            )
        );
        assert_eq!(
            r.apply("server.live"),
            ("envoy_server_live".to_string(), String::new())
        );
        let mut list = StatList::default();
        list.add(
            Kind::Counter,
            "istiocustom.istio_requests_total.reporter.source".into(),
            "istio_requests_total".into(),
            "reporter=\"source\"".into(),
            1,
        );
        list.retag(&r);
        assert_eq!(
            list.stats[0].metric, "istio_requests_total",
            "tagged stats are kept"
        );
    }

    #[test]
    fn default_tags_stay_without_istio_rules() {
        assert!(TagRules::from_bootstrap(&StatsConfig::default()).is_none());
        // No default tags and no rules: no tags at all, as Envoy.
        let none = TagRules::from_bootstrap(&StatsConfig {
            use_all_default_tags: Some(envoy_types::pb::google::protobuf::BoolValue {
                value: false,
            }),
            ..Default::default()
        })
        .expect("rules");
        assert_eq!(
            none.apply("cluster.a.upstream_rq_total"),
            (
                "envoy_cluster_a_upstream_rq_total".to_string(),
                String::new()
            )
        );
    }
}

/// The bootstrap's `stats_config.stats_matcher`: which stats exist at all. Envoy matches the
/// stat's full dotted name (before tags are extracted); a stat left out is in no listing
/// (`/stats`, its JSON and Prometheus forms, the 15090 listener).
#[derive(Debug, Default)]
pub enum StatsMatcher {
    #[default]
    All,
    RejectAll,
    Include(Vec<crate::matcher::StringMatch>),
    Exclude(Vec<crate::matcher::StringMatch>),
}

impl StatsMatcher {
    pub fn from_bootstrap(
        sc: &envoy_types::pb::envoy::config::metrics::v3::StatsConfig,
    ) -> Result<StatsMatcher, String> {
        use envoy_types::pb::envoy::config::metrics::v3::stats_matcher::StatsMatcher as M;
        let Some(m) = sc
            .stats_matcher
            .as_ref()
            .and_then(|m| m.stats_matcher.as_ref())
        else {
            return Ok(StatsMatcher::All);
        };
        let list = |l: &envoy_types::pb::envoy::r#type::matcher::v3::ListStringMatcher,
                    at: &str| {
            l.patterns
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    crate::matcher::string_matcher(p)
                        .map_err(|e| format!("stats_config.stats_matcher.{at}.patterns[{i}]: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(match m {
            M::RejectAll(true) => StatsMatcher::RejectAll,
            M::RejectAll(false) => StatsMatcher::All,
            M::InclusionList(l) => StatsMatcher::Include(list(l, "inclusion_list")?),
            M::ExclusionList(l) => StatsMatcher::Exclude(list(l, "exclusion_list")?),
        })
    }

    pub fn keeps(&self, name: &str) -> bool {
        match self {
            StatsMatcher::All => true,
            StatsMatcher::RejectAll => false,
            StatsMatcher::Include(p) => p.iter().any(|m| m.matches(name)),
            StatsMatcher::Exclude(p) => !p.iter().any(|m| m.matches(name)),
        }
    }

    /// Drops from `list` what the matcher leaves out.
    pub fn apply(&self, list: &mut StatList) {
        if matches!(self, StatsMatcher::All) {
            return;
        }
        list.stats.retain(|s| self.keeps(&s.name));
        list.texts.retain(|(n, _)| self.keeps(n));
    }
}
