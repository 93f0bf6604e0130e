//! Request counters kept as plain atomics on the request path, rendered in Prometheus text
//! format with Envoy's metric names. Control-plane counters use the `prometheus` crate.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use prometheus::{Encoder, IntCounter, IntCounterVec, Opts, Registry, TextEncoder};

/// Per-status-code counters: a few lock-free slots (code in the top 16 bits, count below),
/// since a cluster rarely sees more than a handful of distinct codes; the rest go to a map.
#[derive(Debug, Default)]
pub struct CodeCounters {
    slots: [AtomicU64; 8],
    overflow: Mutex<BTreeMap<u16, u64>>,
}

const COUNT_MASK: u64 = (1 << 48) - 1;

impl CodeCounters {
    pub fn inc(&self, code: u16) {
        let tag = u64::from(code) << 48;
        for slot in &self.slots {
            let cur = slot.load(Relaxed);
            if cur & !COUNT_MASK == tag {
                slot.fetch_add(1, Relaxed);
                return;
            }
            if cur == 0 && slot.compare_exchange(0, tag | 1, Relaxed, Relaxed).is_ok() {
                return;
            }
            // Lost the race for an empty slot: someone may have claimed it for this code.
            if slot.load(Relaxed) & !COUNT_MASK == tag {
                slot.fetch_add(1, Relaxed);
                return;
            }
        }
        if let Ok(mut m) = self.overflow.lock() {
            *m.entry(code).or_default() += 1;
        }
    }

    pub fn snapshot(&self) -> BTreeMap<u16, u64> {
        let mut out = self.overflow.lock().map(|m| m.clone()).unwrap_or_default();
        for slot in &self.slots {
            let v = slot.load(Relaxed);
            if v != 0 {
                *out.entry((v >> 48) as u16).or_default() += v & COUNT_MASK;
            }
        }
        out
    }
}

#[derive(Debug, Default)]
pub struct ClusterStats {
    pub rq_total: AtomicU64,
    pub rq_xx: [AtomicU64; 5],
    pub codes: CodeCounters,
    pub cx_connect_fail: AtomicU64,
    pub rq_timeout: AtomicU64,
    pub rq_active: AtomicU64,
}

impl ClusterStats {
    pub fn record(&self, code: u16) {
        self.rq_total.fetch_add(1, Relaxed);
        if (100..600).contains(&code) {
            self.rq_xx[usize::from(code / 100 - 1)].fetch_add(1, Relaxed);
        }
        self.codes.inc(code);
    }
}

#[derive(Debug, Default)]
pub struct HcmStats {
    pub rq_total: AtomicU64,
    pub rq_xx: [AtomicU64; 5],
    pub rq_active: AtomicU64,
    pub cx_total: AtomicU64,
    pub no_route: AtomicU64,
}

impl HcmStats {
    pub fn record(&self, code: u16) {
        self.rq_total.fetch_add(1, Relaxed);
        if (100..600).contains(&code) {
            self.rq_xx[usize::from(code / 100 - 1)].fetch_add(1, Relaxed);
        }
    }
}

/// xDS counters under Envoy's names: CDS and LDS on their managers, RDS per route config,
/// EDS per cluster.
#[derive(Debug, Clone)]
pub struct XdsCounters {
    pub cds: [IntCounter; 3],
    pub lds: [IntCounter; 3],
    pub rds: [IntCounterVec; 3],
    pub eds: [IntCounterVec; 3],
}

pub const ATTEMPT: usize = 0;
pub const SUCCESS: usize = 1;
pub const REJECTED: usize = 2;

#[derive(Debug)]
pub struct Stats {
    clusters: Mutex<HashMap<String, Arc<ClusterStats>>>,
    hcms: Mutex<HashMap<String, Arc<HcmStats>>>,
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
            rds: OUTCOMES.map(|o| counter_vec(&registry, &format!("envoy_http_rds_{o}"), "envoy_rds_route_config")),
            eds: OUTCOMES.map(|o| counter_vec(&registry, &format!("envoy_cluster_{o}"), "envoy_cluster_name")),
        };
        Stats {
            clusters: Mutex::default(),
            hcms: Mutex::default(),
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

    /// Forgets clusters that no snapshot holds any more, as Envoy drops a removed cluster's stats.
    pub fn retain_clusters(&self, live: impl Fn(&str) -> bool) {
        let mut m = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|k, _| live(k));
    }

    /// Prometheus text. `membership` gives (healthy, total) hosts per cluster.
    pub fn render(&self, membership: &dyn Fn(&str) -> Option<(usize, usize)>) -> String {
        let mut out = String::with_capacity(4096);
        let clusters: Vec<(String, Arc<ClusterStats>)> = {
            let m = self.clusters.lock().unwrap_or_else(|p| p.into_inner());
            let mut v: Vec<_> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        let esc = |s: &str| s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
        let counter = |out: &mut String, name: &str, f: &dyn Fn(&ClusterStats) -> u64| {
            let _ = writeln!(out, "# TYPE {name} counter");
            for (n, s) in &clusters {
                let _ = writeln!(out, "{name}{{envoy_cluster_name=\"{}\"}} {}", esc(n), f(s));
            }
        };
        counter(&mut out, "envoy_cluster_upstream_rq_total", &|s| s.rq_total.load(Relaxed));
        counter(&mut out, "envoy_cluster_upstream_cx_connect_fail", &|s| s.cx_connect_fail.load(Relaxed));
        counter(&mut out, "envoy_cluster_upstream_rq_timeout", &|s| s.rq_timeout.load(Relaxed));
        let _ = writeln!(out, "# TYPE envoy_cluster_upstream_rq counter");
        for (n, s) in &clusters {
            for (code, count) in s.codes.snapshot() {
                let _ = writeln!(
                    out,
                    "envoy_cluster_upstream_rq{{envoy_response_code=\"{code}\",envoy_cluster_name=\"{}\"}} {count}",
                    esc(n)
                );
            }
        }
        let _ = writeln!(out, "# TYPE envoy_cluster_upstream_rq_xx counter");
        for (n, s) in &clusters {
            for (i, c) in s.rq_xx.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "envoy_cluster_upstream_rq_xx{{envoy_response_code_class=\"{}\",envoy_cluster_name=\"{}\"}} {}",
                    i + 1,
                    esc(n),
                    c.load(Relaxed)
                );
            }
        }
        let _ = writeln!(out, "# TYPE envoy_cluster_upstream_rq_active gauge");
        for (n, s) in &clusters {
            let _ = writeln!(out, "envoy_cluster_upstream_rq_active{{envoy_cluster_name=\"{}\"}} {}", esc(n), s.rq_active.load(Relaxed));
        }
        for (metric, pick) in [("envoy_cluster_membership_healthy", 0usize), ("envoy_cluster_membership_total", 1)] {
            let _ = writeln!(out, "# TYPE {metric} gauge");
            for (n, _) in &clusters {
                if let Some((h, t)) = membership(n) {
                    let _ = writeln!(out, "{metric}{{envoy_cluster_name=\"{}\"}} {}", esc(n), if pick == 0 { h } else { t });
                }
            }
        }
        let hcms: Vec<(String, Arc<HcmStats>)> = {
            let m = self.hcms.lock().unwrap_or_else(|p| p.into_inner());
            let mut v: Vec<_> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        let hcm_counter = |out: &mut String, name: &str, kind: &str, f: &dyn Fn(&HcmStats) -> u64| {
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (n, s) in &hcms {
                let _ = writeln!(out, "{name}{{envoy_http_conn_manager_prefix=\"{}\"}} {}", esc(n), f(s));
            }
        };
        hcm_counter(&mut out, "envoy_http_downstream_rq_total", "counter", &|s| s.rq_total.load(Relaxed));
        hcm_counter(&mut out, "envoy_http_downstream_cx_total", "counter", &|s| s.cx_total.load(Relaxed));
        hcm_counter(&mut out, "envoy_http_no_route", "counter", &|s| s.no_route.load(Relaxed));
        hcm_counter(&mut out, "envoy_http_downstream_rq_active", "gauge", &|s| s.rq_active.load(Relaxed));
        let _ = writeln!(out, "# TYPE envoy_http_downstream_rq_xx counter");
        for (n, s) in &hcms {
            for (i, c) in s.rq_xx.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "envoy_http_downstream_rq_xx{{envoy_response_code_class=\"{}\",envoy_http_conn_manager_prefix=\"{}\"}} {}",
                    i + 1,
                    esc(n),
                    c.load(Relaxed)
                );
            }
        }
        let mut buf = Vec::new();
        if TextEncoder::new().encode(&self.registry.gather(), &mut buf).is_ok() {
            out.push_str(&String::from_utf8_lossy(&buf));
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
    fn render_uses_envoy_names() {
        let stats = Stats::new();
        let c = stats.cluster("outbound|9080|v1|reviews.default.svc.cluster.local");
        c.record(200);
        c.record(503);
        stats.xds.cds[SUCCESS].inc();
        let text = stats.render(&|_| Some((1, 2)));
        assert!(text.contains(
            "envoy_cluster_upstream_rq_total{envoy_cluster_name=\"outbound|9080|v1|reviews.default.svc.cluster.local\"} 2"
        ));
        assert!(text.contains("envoy_response_code=\"503\""));
        assert!(text.contains("envoy_cluster_membership_total{envoy_cluster_name=\"outbound|9080|v1|reviews.default.svc.cluster.local\"} 2"));
        assert!(text.contains("envoy_cluster_manager_cds_update_success 1"));
    }
}
