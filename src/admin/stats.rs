//! Request counters kept as plain atomics on the request path, rendered in Prometheus text
//! format with Envoy's metric names. Control-plane counters use the `prometheus` crate.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use prometheus::{Encoder, IntCounter, IntCounterVec, Opts, Registry, TextEncoder};

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
    registry: Registry,
}

impl Default for Stats {
    fn default() -> Self {
        Self::new()
    }
}

fn counter_vec(registry: &Registry, name: &str, label: &str) -> IntCounterVec {
    let v = IntCounterVec::new(Opts::new(name, name), &[label])
        .unwrap_or_else(|e| panic!("static metric definition {name} is invalid: {e}"));
    // Registration only fails on duplicate names, which these constants cannot have.
    let _ = registry.register(Box::new(v.clone()));
    v
}

fn counter(registry: &Registry, name: &str) -> IntCounter {
    let v = IntCounter::new(name, name)
        .unwrap_or_else(|e| panic!("static metric definition {name} is invalid: {e}"));
    let _ = registry.register(Box::new(v.clone()));
    v
}

const OUTCOMES: [&str; 3] = ["update_attempt", "update_success", "update_rejected"];

impl Stats {
    pub fn new() -> Stats {
        let registry = Registry::new();
        let xds = XdsCounters {
            cds: OUTCOMES.map(|o| counter(&registry, &format!("envoy_cluster_manager_cds_{o}"))),
            lds: OUTCOMES.map(|o| counter(&registry, &format!("envoy_listener_manager_lds_{o}"))),
            rds: OUTCOMES.map(|o| {
                counter_vec(
                    &registry,
                    &format!("envoy_http_rds_{o}"),
                    "envoy_rds_route_config",
                )
            }),
            eds: OUTCOMES.map(|o| {
                counter_vec(
                    &registry,
                    &format!("envoy_cluster_{o}"),
                    "envoy_cluster_name",
                )
            }),
            rejected_resources: counter_vec(&registry, "portico_xds_rejected_resources", "type"),
        };
        Stats {
            clusters: Mutex::default(),
            hcms: Mutex::default(),
            tcps: Mutex::default(),
            listeners: Mutex::default(),
            xds,
            registry,
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

    /// Prometheus text. `membership` gives (healthy, total) hosts per cluster.
    pub fn render(&self, membership: &dyn Fn(&str) -> Option<(usize, usize)>) -> String {
        let clusters: Vec<(String, Arc<ClusterStats>)> = sorted(&self.clusters);
        let hcms: Vec<(String, Arc<HcmStats>)> = sorted(&self.hcms);
        let tcps: Vec<(String, Arc<TcpStats>)> = sorted(&self.tcps);
        let listeners: Vec<(String, Arc<ListenerStats>)> = sorted(&self.listeners);
        let mut f = Families::default();
        // The PROXY protocol listener filter's counters, at the root scope as Envoy keeps them:
        // `downstream_cx_proxy_proto_error` and `proxy_proto.[<stat_prefix>.]...`.
        let mut proto_errors = None;
        for (prefix, s) in crate::proxy::proxy_protocol::all_stats() {
            *proto_errors.get_or_insert(0) += s.downstream_cx_proxy_proto_error.load(Relaxed);
            // Envoy's tag extraction turns the version (and a stat_prefix) into labels.
            let scope = if prefix.is_empty() {
                String::new()
            } else {
                format!("envoy_proxy_protocol_prefix=\"{}\"", esc(&prefix))
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
                f.add(
                    "counter",
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
                    f.add(
                        "counter",
                        format!("envoy_proxy_proto_{stat}"),
                        label.clone(),
                        v.load(Relaxed),
                    );
                }
            }
        }
        if let Some(n) = proto_errors {
            f.add(
                "counter",
                "envoy_downstream_cx_proxy_proto_error".to_string(),
                String::new(),
                n,
            );
        }
        for (n, s) in &listeners {
            let label = format!("envoy_listener_address=\"{}\"", esc(n));
            for (kind, stat, v) in [
                ("counter", "downstream_cx_total", &s.cx_total),
                ("counter", "downstream_cx_destroy", &s.cx_destroy),
                ("gauge", "downstream_cx_active", &s.cx_active),
                ("counter", "no_filter_chain_match", &s.no_filter_chain_match),
                ("counter", "ssl_handshake", &s.ssl.handshake),
                ("counter", "ssl_connection_error", &s.ssl.connection_error),
                ("counter", "ssl_no_certificate", &s.ssl.no_certificate),
                ("counter", "ssl_fail_verify_error", &s.ssl.fail_verify_error),
                (
                    "counter",
                    "ssl_fail_verify_no_cert",
                    &s.ssl.fail_verify_no_cert,
                ),
                ("counter", "ssl_fail_verify_san", &s.ssl.fail_verify_san),
                (
                    "counter",
                    "ssl_fail_verify_cert_hash",
                    &s.ssl.fail_verify_cert_hash,
                ),
                ("counter", "ssl_session_reused", &s.ssl.session_reused),
            ] {
                f.add(
                    kind,
                    format!("envoy_listener_{stat}"),
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
                let (metric, tag) = match tag {
                    "cipher" => ("envoy_listener_ssl_ciphers", "envoy_ssl_cipher"),
                    "version" => ("envoy_listener_ssl_versions", "envoy_ssl_version"),
                    _ => ("envoy_listener_ssl_curves", "envoy_ssl_curve"),
                };
                f.add(
                    "counter",
                    metric.to_string(),
                    format!("{tag}=\"{}\",{label}", esc(value)),
                    count,
                );
            }
        }
        for (n, s) in &tcps {
            for (kind, stat, v) in [
                ("counter", "downstream_cx_total", &s.cx_total),
                ("counter", "downstream_cx_no_route", &s.cx_no_route),
                ("counter", "idle_timeout", &s.idle_timeout),
                ("counter", "downstream_cx_rx_bytes_total", &s.rx_bytes),
                ("counter", "downstream_cx_tx_bytes_total", &s.tx_bytes),
            ] {
                let (metric, tag) = tagged("tcp", n, stat);
                f.add(
                    kind,
                    metric,
                    format!("envoy_tcp_prefix=\"{}\"", esc(tag)),
                    v.load(Relaxed),
                );
            }
        }
        for (n, s) in &clusters {
            let c = |f: &mut Families, kind, stat: &str, extra: &str, v: u64| {
                let (metric, tag) = tagged("cluster", n, stat);
                f.add(
                    kind,
                    metric,
                    format!("{extra}envoy_cluster_name=\"{}\"", esc(tag)),
                    v,
                );
            };
            c(
                &mut f,
                "counter",
                "upstream_rq_total",
                "",
                s.rq_total.load(Relaxed),
            );
            c(
                &mut f,
                "counter",
                "upstream_cx_connect_fail",
                "",
                s.cx_connect_fail.load(Relaxed),
            );
            c(
                &mut f,
                "counter",
                "upstream_rq_timeout",
                "",
                s.rq_timeout.load(Relaxed),
            );
            c(
                &mut f,
                "gauge",
                "upstream_rq_active",
                "",
                s.rq_active.load(Relaxed),
            );
            c(
                &mut f,
                "gauge",
                "outlier_detection_ejections_active",
                "",
                u64::from(s.outlier.ejected.load(Relaxed)),
            );
            c(
                &mut f,
                "gauge",
                "upstream_rq_pending_active",
                "",
                s.rq_pending_active.load(Relaxed),
            );
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
                    "outlier_detection_ejections_enforced_total",
                    &s.outlier.ejections_enforced_total,
                ),
                (
                    "outlier_detection_ejections_enforced_consecutive_5xx",
                    &s.outlier.ejections_enforced_5xx,
                ),
                (
                    "outlier_detection_ejections_enforced_consecutive_gateway_failure",
                    &s.outlier.ejections_enforced_gateway,
                ),
                (
                    "outlier_detection_ejections_detected_consecutive_5xx",
                    &s.outlier.ejections_detected_5xx,
                ),
                (
                    "outlier_detection_ejections_detected_consecutive_gateway_failure",
                    &s.outlier.ejections_detected_gateway,
                ),
                (
                    "outlier_detection_ejections_overflow",
                    &s.outlier.ejections_overflow,
                ),
            ] {
                c(&mut f, "counter", stat, "", v.load(Relaxed));
            }
            for (code, count) in s.codes.snapshot() {
                c(
                    &mut f,
                    "counter",
                    "upstream_rq",
                    &format!("envoy_response_code=\"{code}\","),
                    count,
                );
            }
            for (i, x) in s.rq_xx.iter().enumerate() {
                let class = format!("envoy_response_code_class=\"{}\",", i + 1);
                c(&mut f, "counter", "upstream_rq_xx", &class, x.load(Relaxed));
            }
            if s.health.active() {
                let h = &s.health;
                for (stat, v) in [
                    ("health_check_attempt", &h.attempt),
                    ("health_check_success", &h.success),
                    ("health_check_failure", &h.failure),
                    ("health_check_network_failure", &h.network_failure),
                    ("health_check_passive_failure", &h.passive_failure),
                    ("health_check_verify_cluster", &h.verify_cluster),
                ] {
                    c(&mut f, "counter", stat, "", v.load(Relaxed));
                }
                let (healthy, degraded) = h.gauges();
                c(&mut f, "gauge", "health_check_healthy", "", healthy);
                c(&mut f, "gauge", "health_check_degraded", "", degraded);
            }
            if let Some((healthy, total)) = membership(n) {
                c(&mut f, "gauge", "membership_healthy", "", healthy as u64);
                c(&mut f, "gauge", "membership_total", "", total as u64);
            }
        }
        for (n, s) in &hcms {
            let h = |f: &mut Families, kind, stat: &str, extra: &str, v: u64| {
                let (metric, tag) = tagged("http", n, stat);
                f.add(
                    kind,
                    metric,
                    format!("{extra}envoy_http_conn_manager_prefix=\"{}\"", esc(tag)),
                    v,
                );
            };
            h(
                &mut f,
                "counter",
                "downstream_rq_total",
                "",
                s.rq_total.load(Relaxed),
            );
            h(
                &mut f,
                "counter",
                "downstream_cx_total",
                "",
                s.cx_total.load(Relaxed),
            );
            h(&mut f, "counter", "no_route", "", s.no_route.load(Relaxed));
            for (kind, stat, v) in [
                (
                    "counter",
                    "downstream_rq_ws_on_non_ws_route",
                    &s.ws_on_non_ws_route,
                ),
                ("counter", "downstream_cx_ssl_total", &s.cx_ssl_total),
                ("gauge", "downstream_cx_ssl_active", &s.cx_ssl_active),
                ("counter", "downstream_cx_upgrades_total", &s.upgrades_total),
                ("gauge", "downstream_cx_upgrades_active", &s.upgrades_active),
            ] {
                h(&mut f, kind, stat, "", v.load(Relaxed));
            }
            if s.fault.enabled.load(Relaxed) {
                let fs = &s.fault;
                for (stat, v) in [
                    ("fault_delays_injected", &fs.delays_injected),
                    ("fault_aborts_injected", &fs.aborts_injected),
                    ("fault_faults_overflow", &fs.faults_overflow),
                    ("fault_response_rl_injected", &AtomicU64::new(0)),
                ] {
                    h(&mut f, "counter", stat, "", v.load(Relaxed));
                }
                h(
                    &mut f,
                    "gauge",
                    "fault_active_faults",
                    "",
                    fs.active_faults.load(Relaxed),
                );
            }
            h(
                &mut f,
                "gauge",
                "downstream_rq_active",
                "",
                s.rq_active.load(Relaxed),
            );
            for (i, x) in s.rq_xx.iter().enumerate() {
                let class = format!("envoy_response_code_class=\"{}\",", i + 1);
                h(
                    &mut f,
                    "counter",
                    "downstream_rq_xx",
                    &class,
                    x.load(Relaxed),
                );
            }
        }
        for (prefix, s) in crate::filters::local_ratelimit::all_stats() {
            for (stat, v) in [
                ("enabled", &s.enabled),
                ("enforced", &s.enforced),
                ("ok", &s.ok),
                ("rate_limited", &s.rate_limited),
                ("shadow_mode", &AtomicU64::new(0)),
            ] {
                let (metric, tag) = tagged("http_local_rate_limit", &prefix, stat);
                f.add(
                    "counter",
                    metric,
                    format!("envoy_local_http_ratelimit_prefix=\"{}\"", esc(tag)),
                    v.load(Relaxed),
                );
            }
        }
        let mut out = f.finish();
        let mut buf = Vec::new();
        if TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .is_ok()
        {
            out.push_str(&String::from_utf8_lossy(&buf));
        }
        out
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

/// Metric families in text format: one `# TYPE` line per name, samples grouped under it.
#[derive(Default)]
struct Families {
    by_name: BTreeMap<String, (&'static str, Vec<String>)>,
}

impl Families {
    fn add(&mut self, kind: &'static str, metric: String, labels: String, value: u64) {
        let e = self.by_name.entry(metric).or_insert((kind, Vec::new()));
        e.1.push(format!("{{{labels}}} {value}"));
    }

    fn finish(self) -> String {
        let mut out = String::with_capacity(4096);
        for (name, (kind, samples)) in self.by_name {
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for s in samples {
                let _ = writeln!(out, "{name}{s}");
            }
        }
        out
    }
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
        assert!(text.contains("envoy_cluster_manager_cds_update_success 1"));
    }
}
