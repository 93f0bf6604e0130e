//! Portico: an ingress gateway that speaks Envoy's xDS contract, on pingora.
//!
//! Data flow: ADS stream ([`xds::client`]) -> accepted resources ([`xds::store`]) -> immutable
//! [`snapshot::Snapshot`] swapped into [`State::snapshot`] -> the request path ([`proxy`]) loads
//! it once per request and routes with [`router`] and [`lb`].

/// A header name parsed once, at compile time: a lookup by `&str` parses and checks the name
/// on every call (some 400 instructions for a custom name), one by `HeaderName` only hashes
/// it.
macro_rules! header_name {
    ($n:literal) => {{
        static NAME: http::HeaderName = http::HeaderName::from_static($n);
        &NAME
    }};
}

pub mod admin;
pub mod alloc;
pub mod bootstrap;
pub mod demo;
pub mod filters;
pub mod health;
pub mod istio;
pub mod lb;
pub mod live;
pub mod matcher;
pub mod prehashed;
pub mod protojson;
pub mod proxy;
pub mod router;
pub mod server;
pub mod snapshot;
pub mod telemetry;
pub mod units;
pub mod uuid;
pub mod xds;

use std::sync::atomic::AtomicBool;
use std::time::{Instant, SystemTime};

use arc_swap::ArcSwap;

/// The serving config: the snapshot requests read, and the store it was assembled from (what
/// `/config_dump` shows). Swapped as one at the commit point (`xds::commit`), so no reader
/// sees the snapshot of one push with the store of another.
#[derive(Debug, Default)]
pub struct Serving {
    pub snapshot: std::sync::Arc<snapshot::Snapshot>,
    pub store: std::sync::Arc<xds::store::Store>,
}

/// What the data path and the admin endpoint share with the control side.
#[derive(Debug)]
pub struct State {
    pub serving: ArcSwap<Serving>,
    pub stats: admin::stats::Stats,
    /// True once every subscribed xDS type was accepted once; never goes back.
    pub ready: AtomicBool,
    pub bootstrap: Option<envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap>,
    pub started: Instant,
    pub started_at: SystemTime,
    /// Envoy's global health-check-fail flag (`POST /healthcheck/fail`, `/healthcheck/ok`):
    /// `/ready` answers DRAINING and `server.state` is 1 while set. Envoy's HTTP
    /// `health_check` filter would answer 503 by it; Portico has no such filter yet.
    pub health_check_failed: AtomicBool,
    /// `POST /quitquitquit`: the server stops as on SIGTERM.
    pub quit: tokio::sync::Notify,
    /// Istio's metrics and the gateway's own identity (from the bootstrap `node`), for
    /// `istio.stats` and `istio.metadata_exchange`.
    pub istio: telemetry::istio_stats::Istio,
    /// The bootstrap's `stats_config.stats_tags` (istio-agent's tag regexes): how Envoy's own
    /// stats are named in Prometheus; None: Envoy's default tags.
    pub stats_tags: Option<admin::stats::TagRules>,
    /// The span exporter's handle (started by the server).
    pub tracer: std::sync::Arc<telemetry::trace::Tracer>,
    /// The listeners, for `POST /drain_listeners` (set once they are served).
    pub listeners: std::sync::OnceLock<std::sync::Arc<dyn ListenerControl>>,
    /// The overload manager's global downstream connection limit (the server sets `max`).
    pub global_connections: live::GlobalConnections,
    /// `stats_config.stats_matcher`: the stats that exist (checked when the bootstrap is).
    pub stats_matcher: admin::stats::StatsMatcher,
    /// The runtime's admin layer: what `POST /runtime_modify` set (admin requests only).
    pub runtime_admin: std::sync::Mutex<std::collections::BTreeMap<String, String>>,
    /// The admin's access logs (checked when the bootstrap is).
    pub admin_access_log: telemetry::access_log::AccessLogs,
    /// Notified on each admin `/stats` read: the stats sinks flush on it with
    /// `stats_flush_on_admin`.
    pub stats_flush: tokio::sync::Notify,
}

/// What the admin may ask of the listeners.
pub trait ListenerControl: Send + Sync + std::fmt::Debug {
    /// `POST /drain_listeners[?inboundonly][&graceful][&skip_exit]`.
    fn drain_listeners(&self, inbound_only: bool, graceful: bool, skip_exit: bool);
}

impl State {
    pub fn new(
        bootstrap: Option<envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap>,
    ) -> State {
        let stats_matcher = bootstrap
            .as_ref()
            .and_then(|b| b.stats_config.as_ref())
            .and_then(|sc| admin::stats::StatsMatcher::from_bootstrap(sc).ok())
            .unwrap_or_default();
        let admin_access_log = bootstrap
            .as_ref()
            .and_then(|b| b.admin.as_ref())
            .and_then(|a| admin::access_logs(a).ok())
            .unwrap_or_default();
        State {
            serving: ArcSwap::from_pointee(Serving::default()),
            stats: admin::stats::Stats::new(),
            ready: AtomicBool::new(false),
            started: Instant::now(),
            started_at: SystemTime::now(),
            health_check_failed: AtomicBool::new(false),
            quit: tokio::sync::Notify::new(),
            stats_tags: bootstrap
                .as_ref()
                .and_then(|b| b.stats_config.as_ref())
                .and_then(admin::stats::TagRules::from_bootstrap),
            istio: telemetry::istio_stats::Istio::new(
                bootstrap.as_ref().and_then(|b| b.node.as_ref()),
            ),
            bootstrap,
            tracer: Default::default(),
            listeners: std::sync::OnceLock::new(),
            global_connections: Default::default(),
            stats_matcher,
            runtime_admin: Default::default(),
            admin_access_log,
            stats_flush: tokio::sync::Notify::new(),
        }
    }

    /// The serving snapshot (one atomic load and a reference count).
    pub fn snapshot(&self) -> std::sync::Arc<snapshot::Snapshot> {
        self.serving.load().snapshot.clone()
    }

    pub fn bootstrap_node_json(&self) -> serde_json::Value {
        let node = self.bootstrap.as_ref().and_then(|b| b.node.as_ref());
        match node {
            Some(n) => serde_json::json!({ "id": n.id, "cluster": n.cluster }),
            None => serde_json::Value::Null,
        }
    }
}

/// Hands freed heap back to the OS. The proto descriptor pool (~18 MB), needed only to read
/// the bootstrap and to render `/config_dump`, is dropped after use; the allocator (mimalloc in
/// the binary, glibc's in tests) would otherwise keep that memory in the process.
pub fn release_freed_memory() {
    // SAFETY: mi_collect takes no pointers; with `force` it frees mimalloc's empty pages and
    // returns purgeable memory to the OS, and is a no-op for a heap that holds nothing.
    unsafe {
        libmimalloc_sys::mi_collect(true);
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own allocator state; it takes no pointers and is
    // documented as safe to call at any time from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod layering_tests;
