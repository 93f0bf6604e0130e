//! Outlier detection's live state: each host's consecutive-error counts, its answers since
//! the last success-rate sweep and its ejection, shared by every build of its cluster (they
//! survive EDS and CDS updates, as Envoy keeps a host's detector state while the host
//! stays). Resolved per host when a cluster is built, so the request path only touches
//! atomics (and the answer after each interval sweeps). The config is translated in
//! `snapshot::outlier`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The consecutive-error detectors' parameters (`Cluster.outlier_detection`).
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
    /// `successful_active_health_check_uneject_host` (default true): a passing active check
    /// returns an ejected host at once.
    pub uneject_on_check: bool,
    /// The success-rate detector (on by default in Envoy).
    pub success_rate: SuccessRate,
}

/// The success-rate detector's parameters: each `interval`, among the hosts not ejected that
/// took `request_volume` requests or more, when there are `minimum_hosts` of them, a host
/// whose share of non-5xx answers is below the mean less `stdev_factor` standard deviations
/// is ejected (`enforcing` percent of the time).
#[derive(Debug, Clone, PartialEq)]
pub struct SuccessRate {
    pub enforcing: u32,
    pub minimum_hosts: u32,
    pub request_volume: u32,
    pub stdev_factor: f64,
}

/// One host's detector state, shared by every build of its cluster.
#[derive(Debug, Default)]
pub struct HostOutlier {
    consecutive_5xx: AtomicU32,
    consecutive_gateway: AtomicU32,
    /// Answers since the last success-rate sweep, and how many of them were not 5xx.
    answered: AtomicU64,
    succeeded: AtomicU64,
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
    /// The cluster's `uneject_on_check`, as its latest build says.
    uneject_on_check: AtomicBool,
    pub ejections_enforced_success_rate: AtomicU64,
    pub ejections_detected_success_rate: AtomicU64,
    /// When the next success-rate sweep is due (milliseconds since [`epoch`]; 0: not yet
    /// armed).
    next_sweep: AtomicU64,
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
    pub fn resolve(&self, addrs: &[SocketAddr], cfg: &OutlierConfig) -> Vec<Arc<HostOutlier>> {
        self.uneject_on_check.store(cfg.uneject_on_check, Relaxed);
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

impl OutlierHosts {
    /// Envoy sweeps for success-rate outliers on its interval timer; here the first answer
    /// after the interval is up sweeps, over the answers since the last sweep (the same
    /// window under steady traffic; a longer one after a quiet spell, which has few answers).
    fn sweep_if_due(&self, cfg: &OutlierConfig) {
        let now = now_ms();
        let interval = cfg.interval.as_millis().max(1) as u64;
        let due = self.next_sweep.load(Relaxed);
        if due == 0 {
            let _ = self
                .next_sweep
                .compare_exchange(0, now + interval, Relaxed, Relaxed);
            return;
        }
        // One caller sweeps; the others carry on.
        if now < due
            || self
                .next_sweep
                .compare_exchange(due, now + interval, Relaxed, Relaxed)
                .is_err()
        {
            return;
        }
        self.sweep(cfg);
    }

    fn sweep(&self, cfg: &OutlierConfig) {
        let hosts: Vec<Arc<HostOutlier>> = {
            let map = self.hosts.lock().unwrap_or_else(|p| p.into_inner());
            map.values().cloned().collect()
        };
        let sr = &cfg.success_rate;
        let mut rates = Vec::with_capacity(hosts.len());
        for h in &hosts {
            let answered = h.answered.swap(0, Relaxed);
            let succeeded = h.succeeded.swap(0, Relaxed).min(answered);
            if h.is_ejected(self) || answered == 0 || answered < u64::from(sr.request_volume) {
                continue;
            }
            rates.push((h, succeeded as f64 * 100.0 / answered as f64));
        }
        let minimum = sr.minimum_hosts as usize;
        if hosts.len() < minimum || rates.is_empty() || rates.len() < minimum {
            return;
        }
        let n = rates.len() as f64;
        let mean = rates.iter().map(|(_, r)| r).sum::<f64>() / n;
        let variance = rates.iter().map(|(_, r)| (r - mean).powi(2)).sum::<f64>() / n;
        let threshold = mean - sr.stdev_factor * variance.sqrt();
        for (h, rate) in rates {
            if rate < threshold {
                self.ejections_detected_success_rate.fetch_add(1, Relaxed);
                if enforced(sr.enforcing) && h.eject(cfg, self, hosts.len()) {
                    self.ejections_enforced_success_rate.fetch_add(1, Relaxed);
                }
            }
        }
    }

    /// An active health check of `addr` passed: Envoy returns the host if outlier detection
    /// had ejected it (`successful_active_health_check_uneject_host`).
    pub fn check_passed(&self, addr: &SocketAddr) {
        if !self.uneject_on_check.load(Relaxed) {
            return;
        }
        let host = {
            let map = self.hosts.lock().unwrap_or_else(|p| p.into_inner());
            map.get(addr).cloned()
        };
        if let Some(h) = host {
            let until = h.ejected_until.load(Relaxed);
            if until != 0
                && h.ejected_until
                    .compare_exchange(until, 0, Relaxed, Relaxed)
                    .is_ok()
            {
                self.ejected.fetch_sub(1, Relaxed);
            }
        }
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
        self.answered.fetch_add(1, Relaxed);
        if !(500..600).contains(&status) {
            self.succeeded.fetch_add(1, Relaxed);
        }
        cluster.sweep_if_due(cfg);
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
        // Envoy's rule: ejecting this one must leave at most `max_ejection_percent` out (so with
        // five hosts and the default 10%, none is ever ejected).
        let out = cluster.ejected.load(Relaxed) as usize;
        if hosts == 0 || (out + 1) * 100 > cfg.max_ejection_percent as usize * hosts {
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

    fn cfg() -> OutlierConfig {
        OutlierConfig {
            consecutive_5xx: 3,
            enforcing_5xx: 100,
            consecutive_gateway: 5,
            enforcing_gateway: 0,
            interval: Duration::from_millis(10),
            base_ejection: Duration::from_millis(50),
            max_ejection: Duration::from_secs(300),
            max_ejection_percent: 50,
            uneject_on_check: true,
            success_rate: SuccessRate {
                enforcing: 100,
                minimum_hosts: 5,
                request_volume: 100,
                stdev_factor: 1.9,
            },
        }
    }

    #[test]
    fn consecutive_errors_eject_for_a_while_and_successes_reset_the_count() {
        let cluster = OutlierHosts::default();
        let a: SocketAddr = "10.0.0.1:80".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:80".parse().unwrap();
        let hosts = cluster.resolve(&[a, b], &cfg());
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
        // A passing active check returns an ejected host at once.
        for _ in 0..3 {
            hosts[0].record(500, &c, &cluster, 2);
        }
        assert!(hosts[0].is_ejected(&cluster));
        cluster.check_passed(&a);
        assert!(!hosts[0].is_ejected(&cluster));
        assert_eq!(cluster.ejected.load(Relaxed), 0);
        // Unless the cluster says otherwise.
        let keep = OutlierConfig {
            uneject_on_check: false,
            ..cfg()
        };
        cluster.resolve(&[a, b], &keep);
        for _ in 0..3 {
            hosts[0].record(500, &keep, &cluster, 2);
        }
        cluster.check_passed(&a);
        assert!(hosts[0].is_ejected(&cluster));
        // A rebuild keeps the state of hosts that stay.
        let again = cluster.resolve(&[a], &cfg());
        assert!(Arc::ptr_eq(&again[0], &hosts[0]));
    }

    #[test]
    fn a_host_well_below_the_others_success_rate_is_ejected_at_the_sweep() {
        let addrs: Vec<SocketAddr> = (1..=5)
            .map(|i| SocketAddr::from(([10, 0, 0, i], 80)))
            .collect();
        // The consecutive detectors off: only the success rate ejects.
        let c = OutlierConfig {
            consecutive_5xx: 0,
            consecutive_gateway: 0,
            interval: Duration::from_millis(200),
            max_ejection_percent: 100,
            ..cfg()
        };
        let run = |bad_every: usize, volume: usize, c: &OutlierConfig| {
            let cluster = OutlierHosts::default();
            let hosts = cluster.resolve(&addrs, c);
            // The first answer arms the sweep.
            hosts[1].record(200, c, &cluster, 5);
            for (i, h) in hosts.iter().enumerate() {
                for k in 0..volume {
                    let status = if i == 0 && k % bad_every == 0 {
                        500
                    } else {
                        200
                    };
                    h.record(status, c, &cluster, 5);
                }
            }
            std::thread::sleep(Duration::from_millis(250));
            // The first answer after the interval sweeps.
            hosts[1].record(200, c, &cluster, 5);
            let out: Vec<bool> = hosts.iter().map(|h| h.is_ejected(&cluster)).collect();
            (out, cluster.ejections_detected_success_rate.load(Relaxed))
        };
        // Half its answers 5xx against all good: 50% < 100 - 1.9 * 20.
        let (out, detected) = run(2, 100, &c);
        assert_eq!(out, [true, false, false, false, false]);
        assert_eq!(detected, 1);
        // Too few answers per host (Envoy's volume of 100): no verdict.
        let (out, detected) = run(2, 99, &c);
        assert_eq!((out.contains(&true), detected), (false, 0));
        // Detected but not enforced (istiod sets enforcing_success_rate to 0).
        let off = OutlierConfig {
            success_rate: SuccessRate {
                enforcing: 0,
                ..c.success_rate.clone()
            },
            ..c.clone()
        };
        let (out, detected) = run(2, 100, &off);
        assert_eq!((out.contains(&true), detected), (false, 1));
        // Against hosts that never fail even one 5xx in a hundred is an outlier, as in
        // Envoy's arithmetic: 99% < 99.8 - 1.9 * 0.4 = 99.04.
        let (out, _) = run(100, 100, &c);
        assert_eq!(out, [true, false, false, false, false]);
    }
}
