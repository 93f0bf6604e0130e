//! The state-of-the-world ADS client and the config worker that commits what it accepts.
//!
//! Per type it keeps the subscribed names, the last accepted version (in the store) and the
//! last nonce. A push is validated as a whole: ACKed and swapped in, or NACKed with every reason
//! while the last good config keeps serving. A lost stream is retried with capped, jittered
//! exponential backoff; the config in force stays until the new stream delivers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::rpc::Status;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::store::Store;
use super::types::Kind;
use crate::admin::stats::{ATTEMPT, REJECTED, SUCCESS};
use crate::proxy::listeners::ListenerManager;
use crate::snapshot::cluster::{ClusterDef, DiscoveryKind, LoadAssignment};
use crate::State;

/// Owns the store and the listeners; every accepted change goes through `commit`.
pub struct ConfigWorker {
    pub state: Arc<State>,
    /// The last good config; shared with the admin endpoint without copying.
    pub store: Arc<Store>,
    listeners: ListenerManager,
    version: u64,
    /// The active health checkers; their results come back through `apply_health_changes`.
    pub health: crate::health::HealthManager,
    /// The SDS streams to bootstrap clusters; their pushes come back through
    /// `apply_sds_events`.
    pub sds: super::sds::SdsManager,
    /// Every subscribed ADS type was accepted once (true without ADS); `/ready` waits for
    /// this and for the SDS clusters' initial fetch.
    pub ads_ready: bool,
}

impl ConfigWorker {
    pub fn new(state: Arc<State>, store: Store, listeners: ListenerManager) -> ConfigWorker {
        ConfigWorker {
            state,
            store: Arc::new(store),
            listeners,
            version: 0,
            health: Default::default(),
            sds: Default::default(),
            ads_ready: false,
        }
    }

    /// Binds new listener sockets, then swaps in the snapshot built from `next`.
    pub fn commit(&mut self, next: Store) -> Result<(), Vec<String>> {
        let wanted = next.listener_addrs();
        self.listeners.prepare(&wanted)?;
        self.version += 1;
        let prev = self.state.snapshot.load_full();
        let stats = &self.state.stats;
        let snap = Arc::new(next.assemble(&prev, self.version, &|n| stats.cluster(n)));
        self.state.snapshot.store(snap.clone());
        self.listeners.reconcile(&snap);
        let mut next = next;
        let all_clusters = next.touched.all_clusters;
        if all_clusters {
            stats.retain_clusters(|n| next.clusters.contains_key(n));
        }
        // The snapshot now reflects every change; the next commit starts from it.
        next.touched = Default::default();
        self.store = Arc::new(next);
        self.state.store.store(self.store.clone());
        // Checked clusters only come with a cluster push; an endpoint push matters only when
        // some cluster is checked (this keeps a one-endpoint change off a walk of every cluster).
        if all_clusters || self.health.is_checking() {
            self.health.reconcile(&self.store, stats);
        }
        self.sds.reconcile(&self.store);
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
                    reply,
                } => {
                    let result = self
                        .store
                        .apply_sds(&source, &version, &resources)
                        .and_then(|next| self.commit(next));
                    let _ = reply.send(result.map_err(|e| e.join("; ")));
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
        let until = tokio::time::Instant::now() + d;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => return,
                _ = changes.notify.notified() => self.apply_health_changes(),
                _ = sds.notify.notified() => self.apply_sds_events(),
            }
        }
    }

    /// Resolves DNS clusters' hostnames and commits the result if it changed.
    pub async fn refresh_dns(&mut self) {
        let defs = self.store.dns_clusters();
        if defs.is_empty() {
            return;
        }
        let mut next = Store::clone(&self.store);
        let mut changed = false;
        for def in defs {
            let la = resolve(&def).await;
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

#[derive(Debug, Default)]
struct Sub {
    names: BTreeSet<String>,
    nonce: String,
    acked: bool,
}

pub struct AdsClient {
    worker: ConfigWorker,
    node: Node,
    /// The ADS server: the bootstrap's xDS cluster's endpoint.
    target: super::grpc::GrpcTarget,
    subs: BTreeMap<Kind, Sub>,
    lds: bool,
    cds: bool,
    /// `ads_config.set_node_on_first_message_only`; Envoy sends the node on every request otherwise.
    pub node_first_only: bool,
    /// The CDS ACK held back until the clusters it brought have their endpoints.
    pending_cds_ack: Option<(DiscoveryRequest, std::time::Instant)>,
    /// Since when readiness has waited for a listener's SDS secrets.
    secrets_wanted_since: std::cell::Cell<Option<std::time::Instant>>,
}

enum StreamEnd {
    /// The stream delivered at least one response before it ended.
    AfterData(String),
    NoData(String),
}

const BACKOFF_BASE: Duration = Duration::from_millis(250);
const BACKOFF_CAP: Duration = Duration::from_secs(5);
const DNS_REFRESH: Duration = Duration::from_secs(5);
const INITIAL_FETCH_TIMEOUT: Duration = Duration::from_secs(15);
const MAX_MESSAGE: usize = 512 * 1024 * 1024;

impl AdsClient {
    pub fn new(
        worker: ConfigWorker,
        node: Node,
        target: super::grpc::GrpcTarget,
        lds: bool,
        cds: bool,
    ) -> AdsClient {
        AdsClient {
            worker,
            node,
            target,
            subs: BTreeMap::new(),
            lds,
            cds,
            node_first_only: false,
            pending_cds_ack: None,
            secrets_wanted_since: Default::default(),
        }
    }

    pub async fn run(mut self) {
        let mut attempt = 0u32;
        loop {
            match self.stream_once().await {
                StreamEnd::AfterData(why) => {
                    tracing::warn!("ADS stream closed: {why}; reconnecting");
                    attempt = 0;
                }
                StreamEnd::NoData(why) => tracing::warn!("ADS stream failed: {why}"),
            }
            // Full jitter over a capped exponential window.
            let window = BACKOFF_BASE
                .saturating_mul(1 << attempt.min(8))
                .min(BACKOFF_CAP);
            let delay = window.mul_f64(0.5 + fastrand::f64() * 0.5);
            attempt = attempt.saturating_add(1);
            self.worker.sleep_applying_health(delay).await;
            self.worker.refresh_dns().await;
        }
    }

    fn request(&self, kind: Kind, with_node: bool) -> DiscoveryRequest {
        let sub = self.subs.get(&kind);
        DiscoveryRequest {
            version_info: self
                .worker
                .store
                .versions
                .get(&kind)
                .cloned()
                .unwrap_or_default(),
            node: (with_node || !self.node_first_only).then(|| self.node.clone()),
            resource_names: sub
                .map(|s| s.names.iter().cloned().collect())
                .unwrap_or_default(),
            type_url: kind.type_url().to_string(),
            response_nonce: sub.map(|s| s.nonce.clone()).unwrap_or_default(),
            ..Default::default()
        }
    }

    async fn stream_once(&mut self) -> StreamEnd {
        let uri = self.target.to_string();
        let channel = match super::grpc::connect(&self.target).await {
            Ok(c) => c,
            Err(e) => return StreamEnd::NoData(e),
        };
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let (tx, rx) = mpsc::channel::<DiscoveryRequest>(64);
        // Fresh nonces per stream: the server has forgotten the old ones.
        self.pending_cds_ack = None;
        for sub in self.subs.values_mut() {
            sub.nonce.clear();
        }
        let mut first = true;
        let mut initial = Vec::new();
        if self.cds {
            self.subs.entry(Kind::Cluster).or_default();
            initial.push(Kind::Cluster);
        }
        if self.lds {
            self.subs.entry(Kind::Listener).or_default();
            initial.push(Kind::Listener);
        }
        for kind in [Kind::Endpoint, Kind::Route, Kind::Secret] {
            if self.subs.get(&kind).is_some_and(|s| !s.names.is_empty()) {
                initial.push(kind);
            }
        }
        for kind in initial {
            let req = self.request(kind, first);
            first = false;
            if tx.send(req).await.is_err() {
                return StreamEnd::NoData("request channel closed".into());
            }
        }
        let mut responses = match client
            .stream_aggregated_resources(ReceiverStream::new(rx))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(s) => return StreamEnd::NoData(format!("ADS call failed: {}", s.message())),
        };
        tracing::info!("ADS stream open to {uri}");
        let mut got_data = false;
        let mut dns = tokio::time::interval(DNS_REFRESH);
        dns.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let health = self.worker.health.changes.clone();
        let sds = self.worker.sds.inbox.clone();
        loop {
            tokio::select! {
                _ = health.notify.notified() => self.worker.apply_health_changes(),
                _ = sds.notify.notified() => self.worker.apply_sds_events(),
                msg = responses.message() => match msg {
                    Ok(Some(resp)) => {
                        got_data = true;
                        for req in self.handle(resp) {
                            if tx.send(req).await.is_err() {
                                return StreamEnd::AfterData("request channel closed".into());
                            }
                        }
                    }
                    Ok(None) => {
                        let why = "server closed the stream".to_string();
                        return if got_data { StreamEnd::AfterData(why) } else { StreamEnd::NoData(why) };
                    }
                    Err(s) => {
                        let why = format!("{}: {}", s.code(), s.message());
                        return if got_data { StreamEnd::AfterData(why) } else { StreamEnd::NoData(why) };
                    }
                },
                _ = dns.tick() => {
                    self.worker.refresh_dns().await;
                    self.update_readiness();
                    // Envoy's initial_fetch_timeout: stop waiting for endpoints after 15 s.
                    let expired = self
                        .pending_cds_ack
                        .as_ref()
                        .is_some_and(|(_, since)| since.elapsed() >= INITIAL_FETCH_TIMEOUT);
                    let released = if expired { self.pending_cds_ack.take() } else { None };
                    if let Some((ack, _)) = released {
                        if let Some(s) = self.subs.get_mut(&Kind::Cluster) {
                            s.acked = true;
                        }
                        self.update_readiness();
                        if tx.send(ack).await.is_err() {
                            return StreamEnd::AfterData("request channel closed".into());
                        }
                    }
                }
            }
        }
    }

    /// Applies one response; returns the requests to send (the ACK or NACK, then any
    /// subscription changes it caused).
    fn handle(&mut self, resp: DiscoveryResponse) -> Vec<DiscoveryRequest> {
        let Some(kind) = Kind::from_type_url(&resp.type_url) else {
            tracing::warn!(type_url = %resp.type_url, "ignoring response of a type Portico did not subscribe to");
            return Vec::new();
        };
        let state = self.worker.state.clone();
        let counters = &state.stats.xds;
        let bump = |outcome: usize, names: &[String]| match kind {
            Kind::Cluster => counters.cds[outcome].inc(),
            Kind::Listener => counters.lds[outcome].inc(),
            Kind::Route => names
                .iter()
                .for_each(|n| counters.rds[outcome].with_label_values(&[n.as_str()]).inc()),
            Kind::Endpoint => names
                .iter()
                .for_each(|n| counters.eds[outcome].with_label_values(&[n.as_str()]).inc()),
            // Envoy's sds.<name>.* counters are not kept yet.
            Kind::Secret => {}
        };
        // As Envoy, a named resource's counters move only when the response carries it.
        let names: Vec<String> = if kind.is_wildcard() {
            Vec::new()
        } else {
            resp.resources
                .iter()
                .filter_map(|a| <ResourceName as prost::Message>::decode(a.value.as_slice()).ok())
                .map(|r| r.name)
                .collect()
        };
        bump(ATTEMPT, &names);
        let started = std::time::Instant::now();
        let result = self
            .worker
            .store
            .apply(kind, &resp.version_info, &resp.resources)
            .and_then(|next| self.worker.commit(next));
        self.subs.entry(kind).or_default().nonce = resp.nonce.clone();
        let mut out = Vec::new();
        match result {
            Ok(()) => {
                bump(SUCCESS, &names);
                tracing::debug!(
                    kind = kind.short(),
                    version = %resp.version_info,
                    resources = resp.resources.len(),
                    apply_us = started.elapsed().as_micros() as u64,
                    "accepted"
                );
                let ack = self.request(kind, false);
                if kind == Kind::Cluster {
                    // A newer CDS response supersedes an ACK still waiting for endpoints.
                    self.pending_cds_ack = None;
                }
                // Only listeners and clusters decide which routes and endpoints are wanted.
                let wanted = if kind.is_wildcard() {
                    vec![
                        (Kind::Endpoint, self.worker.store.wanted_endpoints()),
                        (Kind::Route, self.worker.store.wanted_routes()),
                        (Kind::Secret, self.worker.store.wanted_secrets()),
                    ]
                } else {
                    Vec::new()
                };
                for (k, names) in wanted {
                    let sub = self.subs.entry(k).or_default();
                    if sub.names != names {
                        sub.names = names;
                        out.push(self.request(k, false));
                    }
                }
                if kind == Kind::Cluster && self.worker.store.has_warming_clusters() {
                    // Like Envoy, ACK new clusters once they are warm (their endpoints arrived).
                    self.pending_cds_ack = Some((ack, std::time::Instant::now()));
                } else {
                    if let Some(s) = self.subs.get_mut(&kind) {
                        s.acked = true;
                    }
                    out.insert(0, ack);
                }
                if self.pending_cds_ack.is_some() && !self.worker.store.has_warming_clusters() {
                    if let Some((cds_ack, _)) = self.pending_cds_ack.take() {
                        if let Some(s) = self.subs.get_mut(&Kind::Cluster) {
                            s.acked = true;
                        }
                        out.push(cds_ack);
                    }
                }
            }
            Err(errors) => {
                bump(REJECTED, &names);
                let message = errors.join("; ");
                tracing::warn!(kind = kind.short(), version = %resp.version_info, "rejected: {message}");
                let mut nack = self.request(kind, false);
                nack.error_detail = Some(Status {
                    code: tonic::Code::InvalidArgument as i32,
                    message,
                    details: Vec::new(),
                });
                out.push(nack);
            }
        }
        self.update_readiness();
        out
    }

    fn update_readiness(&mut self) {
        // Envoy's init waits for each secret a listener names, not just for an SDS answer,
        // until the secret's initial_fetch_timeout (15 s by default) lets it go on.
        let secrets_in = |s: &Sub| {
            let all = s
                .names
                .iter()
                .all(|n| self.worker.store.secrets.contains_key(n));
            let since = self
                .secrets_wanted_since
                .get()
                .unwrap_or_else(std::time::Instant::now);
            self.secrets_wanted_since.set(Some(since));
            all || since.elapsed() >= INITIAL_FETCH_TIMEOUT
        };
        let done = |k: Kind| match self.subs.get(&k) {
            Some(s) if k.is_wildcard() => s.acked,
            Some(s) if k == Kind::Secret => s.names.is_empty() || (s.acked && secrets_in(s)),
            Some(s) => s.names.is_empty() || s.acked,
            None => true,
        };
        let required = |k: Kind| match k {
            Kind::Cluster => self.cds,
            Kind::Listener => self.lds,
            _ => true,
        };
        if Kind::ALL.iter().all(|k| !required(*k) || done(*k)) {
            self.worker.ads_ready = true;
            self.worker.update_ready();
        }
    }
}

/// The name of a RouteConfiguration or ClusterLoadAssignment: field 1 of both. Decoding only
/// it keeps per-resource counters cheap on large pushes.
#[derive(Clone, PartialEq, prost::Message)]
struct ResourceName {
    #[prost(string, tag = "1")]
    name: String,
}
