//! Live state: the counters and per-cluster state the request path updates as traffic flows
//! (request and connection counts, connection slots, outlier, health and slow-start state).
//! The snapshot holds config only and refers to these by `Arc` handle, kept across pushes by
//! name; `admin::stats` renders them with Envoy's names.

pub mod grpc;
pub mod health;
pub mod outlier;
pub mod slow_start;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

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
    pub rq_retry: AtomicU64,
    pub rq_retry_success: AtomicU64,
    pub rq_retry_overflow: AtomicU64,
    pub rq_retry_limit_exceeded: AtomicU64,
    pub rq_per_try_timeout: AtomicU64,
    /// Retries in flight, against the cluster's `max_retries` circuit breaker.
    pub retry_active: AtomicU64,
    pub rq_pending_overflow: AtomicU64,
    pub rq_active_overflow: AtomicU64,
    pub cx_overflow: AtomicU64,
    /// Requests holding one of the `max_connections` slots (an upstream connection in use).
    pub cx_busy: AtomicU64,
    /// Requests waiting for such a slot, against `max_pending_requests`.
    pub rq_pending_active: AtomicU64,
    /// Wakes a waiting request when a slot frees.
    pub cx_freed: tokio::sync::Notify,
    pub outlier: outlier::OutlierHosts,
    /// Slow start: when each host turned healthy.
    pub healthy_since: slow_start::HealthySince,
    /// Picks that found their priority level in panic.
    pub lb_healthy_panic: AtomicU64,
    /// Requests for which the balancer found no host (Envoy's 503 `no healthy upstream`).
    pub cx_none_healthy: AtomicU64,
    /// ORIGINAL_DST: requests whose host header was not `ip:port`.
    pub original_dst_host_invalid: AtomicU64,
    pub health: health::HealthHosts,
    /// `envoy.filters.http.grpc_stats`: the cluster's `grpc.*` counters.
    pub grpc: grpc::GrpcCounters,
}

impl ClusterStats {
    /// An upstream request starts; Envoy counts `upstream_rq_total` here, not at the end.
    pub fn start(&self) {
        self.rq_total.fetch_add(1, Relaxed);
    }

    /// The response code, once known.
    pub fn record_code(&self, code: u16) {
        if (100..600).contains(&code) {
            self.rq_xx[usize::from(code / 100 - 1)].fetch_add(1, Relaxed);
        }
        self.codes.inc(code);
    }
}

pub use crate::filters::counters::{NamedCounters, ROOT_COUNTERS};

/// The overload manager's global downstream connection limit
/// (`envoy.resource_monitors.global_downstream_max_connections`): connections open on the
/// listeners it applies to, and the most it allows (`u64::MAX`: none).
#[derive(Debug)]
pub struct GlobalConnections {
    pub max: AtomicU64,
    pub active: AtomicU64,
}

impl Default for GlobalConnections {
    fn default() -> Self {
        GlobalConnections {
            max: AtomicU64::new(u64::MAX),
            active: AtomicU64::new(0),
        }
    }
}

impl GlobalConnections {
    /// Takes a place for a new connection; false (and nothing taken) at the limit.
    pub fn try_open(&self) -> bool {
        let max = self.max.load(Relaxed);
        let mut cur = self.active.load(Relaxed);
        loop {
            if cur >= max {
                return false;
            }
            match self
                .active
                .compare_exchange_weak(cur, cur + 1, Relaxed, Relaxed)
            {
                Ok(_) => return true,
                Err(seen) => cur = seen,
            }
        }
    }

    pub fn close(&self) {
        self.active.fetch_sub(1, Relaxed);
    }
}

#[derive(Debug, Default)]
pub struct HcmStats {
    pub rq_total: AtomicU64,
    pub rq_xx: [AtomicU64; 5],
    pub rq_active: AtomicU64,
    pub cx_total: AtomicU64,
    pub cx_ssl_total: AtomicU64,
    pub cx_ssl_active: AtomicU64,
    pub no_route: AtomicU64,
    /// Upgrades refused by `upgrade_configs` (Envoy's name for any upgrade type).
    pub ws_on_non_ws_route: AtomicU64,
    /// Upgrade requests let through, and those still open.
    pub upgrades_total: AtomicU64,
    pub upgrades_active: AtomicU64,
    /// Requests the client ended (reset, hung up) before their response was complete.
    pub rq_rx_reset: AtomicU64,
    /// `request_headers_timeout` and `request_timeout` fired.
    pub rq_header_timeout: AtomicU64,
    pub rq_timeout: AtomicU64,
    /// Connections closed by `max_requests_per_connection` and `max_connection_duration`.
    pub cx_max_requests_reached: AtomicU64,
    pub cx_max_duration_reached: AtomicU64,
    /// The filters' counters by name under `http.<prefix>.` (RBAC's `rbac.allowed`, ...).
    pub named: NamedCounters,
    pub fault: FaultStats,
}

/// Envoy's `tcp.<stat_prefix>.*` stats of tcp_proxy chains.
#[derive(Debug, Default)]
pub struct TcpStats {
    pub cx_total: AtomicU64,
    /// The chain's cluster does not exist (yet).
    pub cx_no_route: AtomicU64,
    pub idle_timeout: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub tx_bytes: AtomicU64,
    /// Proxied connections open now.
    pub cx_active: AtomicU64,
}

/// Envoy's `listener.<address>.*` stats: connections and, on TLS chains, `ssl.*`.
#[derive(Debug, Default)]
pub struct ListenerStats {
    /// Connections closed at once because the global downstream limit was reached.
    pub global_cx_overflow: AtomicU64,
    pub cx_total: AtomicU64,
    pub cx_destroy: AtomicU64,
    pub cx_active: AtomicU64,
    pub no_filter_chain_match: AtomicU64,
    pub ssl: SslStats,
}

/// `ssl.*`: handshakes and why they failed, and what the good ones negotiated.
#[derive(Debug, Default)]
pub struct SslStats {
    pub handshake: AtomicU64,
    pub connection_error: AtomicU64,
    pub no_certificate: AtomicU64,
    pub fail_verify_error: AtomicU64,
    pub fail_verify_no_cert: AtomicU64,
    pub fail_verify_san: AtomicU64,
    pub fail_verify_cert_hash: AtomicU64,
    pub session_reused: AtomicU64,
    /// (tag, value) -> count, for `ssl.ciphers.*`, `ssl.versions.*` and `ssl.curves.*`.
    pub(crate) negotiated: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

impl SslStats {
    /// One successful handshake and what it settled on; the names are Envoy's (BoringSSL's).
    pub fn handshake_done(&self, cipher: &'static str, version: &'static str, curve: &'static str) {
        self.handshake.fetch_add(1, Relaxed);
        let mut m = self.negotiated.lock().unwrap_or_else(|p| p.into_inner());
        for key in [("cipher", cipher), ("version", version), ("curve", curve)] {
            if !key.1.is_empty() {
                *m.entry(key).or_default() += 1;
            }
        }
    }
}

pub use crate::filters::fault::FaultStats;

impl HcmStats {
    /// A downstream request's headers arrived.
    pub fn start(&self) {
        self.rq_total.fetch_add(1, Relaxed);
        self.rq_active.fetch_add(1, Relaxed);
    }

    /// The request ended with `code` (0: no response was sent).
    pub fn finish(&self, code: u16) {
        self.rq_active.fetch_sub(1, Relaxed);
        if (100..600).contains(&code) {
            self.rq_xx[usize::from(code / 100 - 1)].fetch_add(1, Relaxed);
        }
    }
}
