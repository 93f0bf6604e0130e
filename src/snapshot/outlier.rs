//! Outlier detection (`Cluster.outlier_detection`) as Envoy's consecutive-error detectors do
//! it: a host that answers `consecutive_5xx` 5xx in a row (or `consecutive_gateway_failure`
//! 502/503/504) is ejected for `base_ejection_time` times its ejection count (capped by
//! `max_ejection_time`), unless `max_ejection_percent` of the cluster is already out. Connect
//! failures and timeouts count as 503 and 504, as Envoy counts local-origin errors when they
//! are not split out. Ejected hosts are skipped by the balancers until their time is up.
//!
//! Per-host state lives in the cluster's stats (which survive EDS and CDS updates) and is
//! resolved per host when a cluster is built, so the request path only touches atomics.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::cluster::v3 as cpb;

#[derive(Debug, Clone, PartialEq)]
pub struct OutlierConfig {
    pub consecutive_5xx: u32,
    pub enforcing_5xx: u32,
    pub consecutive_gateway: u32,
    pub enforcing_gateway: u32,
    pub interval: Duration,
    pub base_ejection: Duration,
    pub max_ejection: Duration,
    pub max_ejection_percent: u32,
}

impl OutlierConfig {
    pub fn translate(o: &cpb::OutlierDetection) -> Result<OutlierConfig, String> {
        let dur = |d: &Option<envoy_types::pb::google::protobuf::Duration>,
                   default: Duration,
                   what: &str| {
            match d {
                Some(d) => super::duration(d).map_err(|e| format!("outlier_detection.{what}: {e}")),
                None => Ok(default),
            }
        };
        let pct = |v: &Option<envoy_types::pb::google::protobuf::UInt32Value>,
                   default: u32,
                   what: &str| {
            let v = v.as_ref().map_or(default, |v| v.value);
            if v > 100 {
                Err(format!(
                    "outlier_detection.{what}: value must be lte 100, got {v}"
                ))
            } else {
                Ok(v)
            }
        };
        if o.split_external_local_origin_errors {
            return Err(
                "outlier_detection.split_external_local_origin_errors is not supported yet".into(),
            );
        }
        let base = dur(
            &o.base_ejection_time,
            Duration::from_secs(30),
            "base_ejection_time",
        )?;
        Ok(OutlierConfig {
            consecutive_5xx: o.consecutive_5xx.as_ref().map_or(5, |v| v.value),
            enforcing_5xx: pct(
                &o.enforcing_consecutive_5xx,
                100,
                "enforcing_consecutive_5xx",
            )?,
            consecutive_gateway: o
                .consecutive_gateway_failure
                .as_ref()
                .map_or(5, |v| v.value),
            enforcing_gateway: pct(
                &o.enforcing_consecutive_gateway_failure,
                0,
                "enforcing_consecutive_gateway_failure",
            )?,
            interval: dur(&o.interval, Duration::from_secs(10), "interval")?,
            base_ejection: base,
            max_ejection: dur(
                &o.max_ejection_time,
                Duration::from_secs(300),
                "max_ejection_time",
            )?
            .max(base),
            max_ejection_percent: pct(&o.max_ejection_percent, 10, "max_ejection_percent")?,
        })
    }
}

/// One host's detector state, shared by every build of its cluster.
#[derive(Debug, Default)]
pub struct HostOutlier {
    consecutive_5xx: AtomicU32,
    consecutive_gateway: AtomicU32,
    /// Milliseconds since [`epoch`] until which the host is out; 0 when it is not.
    ejected_until: AtomicU64,
    ejections: AtomicU32,
}

/// The cluster-wide part: every host's state by address, and how many are out.
#[derive(Debug, Default)]
pub struct OutlierHosts {
    hosts: Mutex<HashMap<SocketAddr, Arc<HostOutlier>>>,
    pub ejected: AtomicU32,
    pub ejections_enforced_total: AtomicU64,
    pub ejections_enforced_5xx: AtomicU64,
    pub ejections_enforced_gateway: AtomicU64,
    pub ejections_detected_5xx: AtomicU64,
    pub ejections_detected_gateway: AtomicU64,
    pub ejections_overflow: AtomicU64,
}

fn epoch() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64 + 1
}

impl OutlierHosts {
    /// The state of each of `addrs`, in order (cluster build time, not per request). Hosts no
    /// longer in the cluster are forgotten, as Envoy forgets removed hosts.
    pub fn resolve(&self, addrs: &[SocketAddr]) -> Vec<Arc<HostOutlier>> {
        let mut map = self.hosts.lock().unwrap_or_else(|p| p.into_inner());
        let out: Vec<Arc<HostOutlier>> = addrs
            .iter()
            .map(|a| map.entry(*a).or_default().clone())
            .collect();
        map.retain(|a, _| addrs.contains(a));
        let ejected = map
            .values()
            .filter(|h| h.ejected_until.load(Relaxed) != 0)
            .count();
        self.ejected.store(ejected as u32, Relaxed);
        out
    }
}

impl HostOutlier {
    /// Whether the host is out now; an ejection that has run its time is lifted here.
    pub fn is_ejected(&self, cluster: &OutlierHosts) -> bool {
        let until = self.ejected_until.load(Relaxed);
        if until == 0 {
            return false;
        }
        if now_ms() < until {
            return true;
        }
        if self
            .ejected_until
            .compare_exchange(until, 0, Relaxed, Relaxed)
            .is_ok()
        {
            cluster.ejected.fetch_sub(1, Relaxed);
        }
        false
    }

    /// One upstream outcome (an HTTP status; 503 for a connect failure, 504 for a timeout).
    pub fn record(&self, status: u16, cfg: &OutlierConfig, cluster: &OutlierHosts, hosts: usize) {
        if !(500..600).contains(&status) {
            self.consecutive_5xx.store(0, Relaxed);
            self.consecutive_gateway.store(0, Relaxed);
            return;
        }
        let n5 = self.consecutive_5xx.fetch_add(1, Relaxed) + 1;
        let gateway = matches!(status, 502..=504);
        let ng = if gateway {
            self.consecutive_gateway.fetch_add(1, Relaxed) + 1
        } else {
            self.consecutive_gateway.store(0, Relaxed);
            0
        };
        // Envoy checks the gateway detector first; each ejection resets both counters.
        if gateway && cfg.consecutive_gateway > 0 && ng == cfg.consecutive_gateway {
            cluster.ejections_detected_gateway.fetch_add(1, Relaxed);
            if enforced(cfg.enforcing_gateway) && self.eject(cfg, cluster, hosts) {
                cluster.ejections_enforced_gateway.fetch_add(1, Relaxed);
            }
        } else if cfg.consecutive_5xx > 0 && n5 == cfg.consecutive_5xx {
            cluster.ejections_detected_5xx.fetch_add(1, Relaxed);
            if enforced(cfg.enforcing_5xx) && self.eject(cfg, cluster, hosts) {
                cluster.ejections_enforced_5xx.fetch_add(1, Relaxed);
            }
        }
    }

    fn eject(&self, cfg: &OutlierConfig, cluster: &OutlierHosts, hosts: usize) -> bool {
        if self.ejected_until.load(Relaxed) != 0 {
            return false;
        }
        let out = cluster.ejected.load(Relaxed) as usize;
        if hosts == 0 || out * 100 / hosts >= cfg.max_ejection_percent as usize {
            cluster.ejections_overflow.fetch_add(1, Relaxed);
            return false;
        }
        let n = self.ejections.fetch_add(1, Relaxed) + 1;
        let time = cfg.base_ejection.saturating_mul(n).min(cfg.max_ejection);
        // Envoy lifts ejections on its interval timer: a host comes back at the first tick
        // after its time is up.
        let interval = cfg.interval.as_millis().max(1) as u64;
        let ms = (time.as_millis() as u64).div_ceil(interval) * interval;
        self.ejected_until.store(now_ms() + ms, Relaxed);
        self.consecutive_5xx.store(0, Relaxed);
        self.consecutive_gateway.store(0, Relaxed);
        cluster.ejected.fetch_add(1, Relaxed);
        cluster.ejections_enforced_total.fetch_add(1, Relaxed);
        true
    }
}

fn enforced(percent: u32) -> bool {
    percent >= 100 || (percent > 0 && fastrand::u32(..100) < percent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{Duration as PDuration, UInt32Value};

    fn cfg() -> OutlierConfig {
        OutlierConfig::translate(&cpb::OutlierDetection {
            consecutive_5xx: Some(UInt32Value { value: 3 }),
            base_ejection_time: Some(PDuration {
                seconds: 0,
                nanos: 50_000_000,
            }),
            interval: Some(PDuration {
                seconds: 0,
                nanos: 10_000_000,
            }),
            max_ejection_percent: Some(UInt32Value { value: 50 }),
            ..Default::default()
        })
        .unwrap()
    }

    #[test]
    fn defaults_are_envoys() {
        let c = OutlierConfig::translate(&cpb::OutlierDetection::default()).unwrap();
        assert_eq!((c.consecutive_5xx, c.enforcing_5xx), (5, 100));
        assert_eq!((c.consecutive_gateway, c.enforcing_gateway), (5, 0));
        assert_eq!(c.base_ejection, Duration::from_secs(30));
        assert_eq!(c.max_ejection_percent, 10);
        let bad = cpb::OutlierDetection {
            max_ejection_percent: Some(UInt32Value { value: 101 }),
            ..Default::default()
        };
        assert!(OutlierConfig::translate(&bad)
            .unwrap_err()
            .contains("max_ejection_percent"));
    }

    #[test]
    fn consecutive_errors_eject_for_a_while_and_successes_reset_the_count() {
        let cluster = OutlierHosts::default();
        let a: SocketAddr = "10.0.0.1:80".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:80".parse().unwrap();
        let hosts = cluster.resolve(&[a, b]);
        let c = cfg();
        hosts[0].record(500, &c, &cluster, 2);
        hosts[0].record(500, &c, &cluster, 2);
        hosts[0].record(200, &c, &cluster, 2);
        hosts[0].record(500, &c, &cluster, 2);
        assert!(!hosts[0].is_ejected(&cluster));
        hosts[0].record(503, &c, &cluster, 2);
        hosts[0].record(500, &c, &cluster, 2);
        assert!(hosts[0].is_ejected(&cluster));
        // 50% of two hosts is out already: the other one stays in.
        for _ in 0..3 {
            hosts[1].record(500, &c, &cluster, 2);
        }
        assert!(!hosts[1].is_ejected(&cluster));
        assert_eq!(cluster.ejections_overflow.load(Relaxed), 1);
        std::thread::sleep(Duration::from_millis(80));
        assert!(!hosts[0].is_ejected(&cluster));
        assert_eq!(cluster.ejected.load(Relaxed), 0);
        // A rebuild keeps the state of hosts that stay.
        let again = cluster.resolve(&[a]);
        assert!(Arc::ptr_eq(&again[0], &hosts[0]));
    }
}
