//! The one commit point: a push the store accepted (resource by resource) becomes the serving
//! config here. `ConfigWorker::commit` binds what new listeners need, assembles the snapshot
//! against the serving one, swaps it in together with the store it came from (one `ArcSwap`
//! store of `crate::Serving`, which the request path and `/config_dump` read), then hands it to the listener manager, the health checkers and the
//! SDS streams. The ADS and SDS streams only ever reach the serving config through here.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::store::{Applied, LiveClusters, Rejected, Store};
use crate::live::ClusterStats;
use crate::snapshot::cluster::HostState;
use crate::snapshot::cluster::{ClusterDef, DiscoveryKind, LoadAssignment};
use crate::snapshot::listener::ListenAddr;
use crate::snapshot::Snapshot;
use crate::State;

/// What a commit asks of the listener manager (the proxy's): xDS never reaches into the proxy.
pub trait Listeners: Send {
    /// Binds the sockets `wanted` needs that are not bound yet; returns the listeners whose
    /// sockets cannot be bound, with the reason.
    fn prepare(&mut self, wanted: &BTreeMap<String, Vec<ListenAddr>>) -> Vec<(String, String)>;
    /// Serves `snap`'s listeners: starts new ones, updates chains, drains what went.
    fn reconcile(&mut self, snap: &Snapshot);
}

/// Owns the store and the listeners; every accepted change goes through `commit`.
pub struct ConfigWorker {
    pub state: Arc<State>,
    /// The last good config; shared with the admin endpoint without copying.
    pub store: Arc<Store>,
    listeners: Box<dyn Listeners>,
    version: u64,
    /// The active health checkers; their results come back through `apply_health_changes`.
    pub health: crate::health::HealthManager,
    /// The SDS streams to bootstrap clusters; their pushes come back through
    /// `apply_sds_events`.
    pub sds: super::sds::SdsManager,
    /// Every subscribed ADS type was accepted once (true without ADS); `/ready` waits for
    /// this and for the SDS clusters' initial fetch.
    pub ads_ready: bool,
    /// The DNS clusters' resolutions, made off the xDS loop.
    pub(super) dns: Arc<DnsInbox>,
}

/// A round of DNS results: each DNS cluster as it was resolved, and what its names gave.
type Resolved = Vec<(Arc<ClusterDef>, LoadAssignment)>;

/// Where a round of DNS resolution leaves its results.
#[derive(Default)]
pub(super) struct DnsInbox {
    results: std::sync::Mutex<Option<Resolved>>,
    pub(super) notify: tokio::sync::Notify,
    running: std::sync::atomic::AtomicBool,
}

impl ConfigWorker {
    pub fn new(
        state: Arc<State>,
        store: Store,
        listeners: impl Listeners + 'static,
    ) -> ConfigWorker {
        ConfigWorker {
            state,
            store: Arc::new(store),
            listeners: Box::new(listeners),
            version: 0,
            health: Default::default(),
            sds: Default::default(),
            ads_ready: false,
            dns: Default::default(),
        }
    }

    /// Commits a push applied resource by resource; a listener whose socket cannot be bound
    /// is refused alone (keeping its last good version), as Envoy refuses it when it is added.
    /// Returns every refused resource.
    pub fn commit_applied(&mut self, applied: Applied) -> Result<Vec<Rejected>, Vec<String>> {
        let Applied {
            store: mut next,
            mut rejected,
        } = applied;
        for (name, message) in self.listeners.prepare(&next.listener_addrs()) {
            rejected.push(next.revert_listener(&self.store, &name, message));
        }
        self.commit(next)?;
        Ok(rejected)
    }

    /// Binds new listener sockets, then swaps in the snapshot built from `next`.
    pub fn commit(&mut self, next: Store) -> Result<(), Vec<String>> {
        let wanted = next.listener_addrs();
        let failed = self.listeners.prepare(&wanted);
        if !failed.is_empty() {
            return Err(failed.into_iter().map(|(_, e)| e).collect());
        }
        self.version += 1;
        let prev = self.state.snapshot();
        let stats = &self.state.stats;
        let snap = Arc::new(next.assemble(&prev, self.version, stats));
        let mut next = next;
        let all_clusters = next.touched.all_clusters;
        // Which SDS secrets are wanted only changes with listeners or clusters: an EDS push
        // into ten thousand clusters must not walk them all.
        let refs_changed = all_clusters || !next.listeners.ptr_eq(&self.store.listeners);
        if all_clusters {
            stats.retain_clusters(|n| next.clusters.contains_key(n));
        }
        // The snapshot now reflects every change; the next commit starts from it.
        next.touched = Default::default();
        self.store = Arc::new(next);
        self.state.serving.store(Arc::new(crate::Serving {
            snapshot: snap.clone(),
            store: self.store.clone(),
        }));
        self.listeners.reconcile(&snap);
        // Checked clusters only come with a cluster push; an endpoint push matters only when
        // some cluster is checked (this keeps a one-endpoint change off a walk of every cluster).
        if all_clusters || self.health.is_checking() {
            self.health.reconcile(&self.store, stats);
        }
        if refs_changed {
            self.sds.reconcile(&self.store);
        }
        self.update_ready();
        Ok(())
    }

    /// Applies what the SDS streams received, answering each with its verdict.
    pub fn apply_sds_events(&mut self) {
        for event in self.sds.inbox.take() {
            match event {
                super::sds::Event::Push {
                    source,
                    version,
                    resources,
                    resource_versions,
                    reply,
                } => {
                    let result = self
                        .store
                        .apply_sds(&source, &version, &resources, &resource_versions)
                        .and_then(|applied| self.commit_applied(applied));
                    let result = match result {
                        Ok(rejected) if rejected.is_empty() => Ok(()),
                        Ok(rejected) => Err(rejected
                            .into_iter()
                            .map(|r| r.message)
                            .collect::<Vec<_>>()
                            .join("; ")),
                        Err(e) => Err(e.join("; ")),
                    };
                    let _ = reply.send(result);
                }
                super::sds::Event::FetchTimeout(source) => self.sds.timed_out(&source),
            }
        }
        self.update_ready();
    }

    /// Marks the gateway ready once ADS and the SDS clusters' initial fetch are done.
    pub fn update_ready(&self) {
        if self.ads_ready && self.sds.initial_fetch_done(&self.store) {
            self.state.ready.store(true, Ordering::Relaxed);
        }
    }

    /// Rebuilds the clusters whose active health checks changed a host's health.
    pub fn apply_health_changes(&mut self) {
        let names = self.health.changes.take();
        if names.is_empty() {
            return;
        }
        let mut next = Store::clone(&self.store);
        next.touched.health = names;
        if let Err(e) = self.commit(next) {
            tracing::warn!("health check result not applied: {}", e.join("; "));
        }
    }

    /// Waits `d`, applying health check results as they come.
    pub async fn sleep_applying_health(&mut self, d: Duration) {
        let changes = self.health.changes.clone();
        let sds = self.sds.inbox.clone();
        let dns = self.dns.clone();
        let until = tokio::time::Instant::now() + d;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => return,
                _ = changes.notify.notified() => self.apply_health_changes(),
                _ = sds.notify.notified() => self.apply_sds_events(),
                _ = dns.notify.notified() => self.apply_dns(),
            }
        }
    }

    /// Starts resolving the DNS clusters' hostnames in a task of its own, unless a round is
    /// already under way; `apply_dns` commits what it finds. Lookups never hold up the xDS
    /// stream: a slow or failing resolver (istio-agent's bootstrap names a zipkin cluster
    /// that often does not resolve) must not delay a push.
    pub fn start_dns_refresh(&self) {
        if self.dns.running.swap(true, Ordering::AcqRel) {
            return;
        }
        let defs = self.store.dns_clusters();
        if defs.is_empty() {
            self.dns.running.store(false, Ordering::Release);
            return;
        }
        let inbox = self.dns.clone();
        tokio::spawn(async move {
            let mut out = Vec::with_capacity(defs.len());
            for def in defs {
                let la = resolve(&def).await;
                out.push((def, la));
            }
            if let Ok(mut r) = inbox.results.lock() {
                *r = Some(out);
            }
            inbox.notify.notify_one();
        });
    }

    /// Commits the last round of DNS results where they changed a cluster's hosts.
    pub fn apply_dns(&mut self) {
        let Some(results) = self.dns.results.lock().ok().and_then(|mut r| r.take()) else {
            return;
        };
        self.dns.running.store(false, Ordering::Release);
        let mut next = Store::clone(&self.store);
        let mut changed = false;
        for (def, la) in results {
            // A cluster replaced or removed while its names were being resolved is left to
            // the next round.
            let current = next
                .clusters
                .get(def.name.as_ref())
                .is_some_and(|c| Arc::ptr_eq(&c.value, &def));
            if !current {
                continue;
            }
            let same = next.resolved.get(def.name.as_ref()).is_some_and(|old| {
                old.hosts.len() == la.hosts.len()
                    && old
                        .hosts
                        .iter()
                        .zip(&la.hosts)
                        .all(|(a, b)| a.addr == b.addr && a.weight == b.weight)
            });
            if !same {
                next.resolved.insert(def.name.to_string(), Arc::new(la));
                next.touched.all_clusters = true;
                changed = true;
            }
        }
        if changed {
            if let Err(e) = self.commit(next) {
                tracing::warn!("DNS refresh not applied: {}", e.join("; "));
            }
        }
    }
}

/// Resolves a DNS cluster's hostnames. STRICT_DNS makes every address of the wanted family a
/// host; LOGICAL_DNS keeps the first, as Envoy does.
async fn resolve(def: &ClusterDef) -> LoadAssignment {
    let Some(spec) = &def.inline else {
        return LoadAssignment::default();
    };
    let mut resolved = BTreeMap::new();
    for e in &spec.endpoints {
        let host = &e.host;
        if host.parse::<std::net::IpAddr>().is_ok() || resolved.contains_key(host) {
            continue;
        }
        match tokio::net::lookup_host((host.as_str(), e.port)).await {
            Ok(it) => {
                let all: Vec<std::net::IpAddr> = it.map(|a| a.ip()).collect();
                let mut ips = def.dns_family.filter(&all);
                ips.dedup();
                if def.kind == DiscoveryKind::LogicalDns {
                    ips.truncate(1);
                }
                resolved.insert(host.clone(), ips);
            }
            Err(e) => tracing::warn!(cluster = %def.name, %host, "DNS lookup failed: {e}"),
        }
    }
    LoadAssignment::from_dns(spec, &resolved)
}

/// Assembly reads the clusters' live state through here: the health checkers' results, slow
/// start clocks and outlier detectors, kept in each cluster's stats across pushes.
impl LiveClusters for crate::admin::stats::Stats {
    fn stats(&self, cluster: &str) -> Arc<ClusterStats> {
        self.cluster(cluster)
    }

    fn health_round(&self, cluster: &str, def: &Arc<ClusterDef>) -> Option<u64> {
        let s = self.cluster(cluster);
        s.health.ready_for(def).then(|| s.health.generation())
    }

    fn hosts(&self, cluster: &str, def: &ClusterDef, endpoints: &LoadAssignment) -> HostState {
        host_state(&self.cluster(cluster), def, endpoints)
    }
}

/// What `live` says of the hosts of `def` over `endpoints`; only the parts the cluster's
/// config uses are read.
pub fn host_state(live: &ClusterStats, def: &ClusterDef, endpoints: &LoadAssignment) -> HostState {
    let (hc_generation, hc) = match &def.health_check {
        Some(_) => (
            live.health.generation(),
            live.health.flags(endpoints.hosts.iter().map(|h| {
                let disabled = endpoints.check(&h.addr).is_some_and(|c| c.disabled);
                (h.addr, disabled)
            })),
        ),
        None => (0, Vec::new()),
    };
    let failed = |i: usize| hc.get(i).is_some_and(|f| f.is_some_and(|f| f.failed));
    let healthy_since = match def.lb.slow_start {
        // A host failed by its active checks starts a new ramp when it passes again, as Envoy
        // restarts slow start from the last passing check.
        Some(_) => live
            .healthy_since
            .resolve(endpoints.hosts.iter().enumerate().map(|(i, h)| {
                let health = crate::snapshot::health_check::effective(
                    h.health,
                    hc.get(i).and_then(Option::as_ref),
                );
                (
                    h.addr,
                    health == crate::snapshot::cluster::Health::Healthy,
                    failed(i),
                )
            })),
        None => Vec::new(),
    };
    let outlier = if let Some(cfg) = &def.outlier {
        let addrs: Vec<std::net::SocketAddr> = endpoints.hosts.iter().map(|h| h.addr).collect();
        live.outlier.resolve(&addrs, cfg)
    } else {
        Vec::new()
    };
    HostState {
        hc,
        hc_generation,
        healthy_since,
        outlier,
    }
}
