//! The state-of-the-world ADS client and the config worker that commits what it accepts.
//!
//! Per type it keeps the subscribed names, the last accepted version (in the store) and the
//! last nonce. A push is validated as a whole: ACKed and swapped in, or NACKed with every reason
//! while the last good config keeps serving. A lost stream is retried with capped, jittered
//! exponential backoff; the config in force stays until the new stream delivers.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::rpc::Status;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::commit::ConfigWorker;
use super::store::{Incoming, Push};
use super::types::Kind;
use crate::admin::stats::{ATTEMPT, REJECTED, SUCCESS};

#[derive(Debug, Default)]
struct Sub {
    /// Named kinds: the names subscribed to (in delta, the names the server was told of).
    names: BTreeSet<String>,
    nonce: String,
    acked: bool,
}

/// The two ADS protocols: state of the world (`GRPC`) and incremental (`DELTA_GRPC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Sotw,
    Delta,
}

/// A request on the stream, of either protocol.
#[derive(Debug)]
enum Outgoing {
    Sotw(DiscoveryRequest),
    Delta(DeltaDiscoveryRequest),
}

/// A response on the stream, of either protocol.
enum Response {
    Sotw(DiscoveryResponse),
    Delta(DeltaDiscoveryResponse),
}

pub struct AdsClient {
    worker: ConfigWorker,
    node: Node,
    /// The ADS server: the bootstrap's xDS cluster's endpoint.
    target: super::grpc::GrpcTarget,
    api: Api,
    subs: BTreeMap<Kind, Sub>,
    lds: bool,
    cds: bool,
    /// `ads_config.set_node_on_first_message_only`; Envoy sends the node on every request otherwise.
    pub node_first_only: bool,
    /// The CDS ACK held back until the clusters it brought have their endpoints.
    pending_cds_ack: Option<(Outgoing, std::time::Instant)>,
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

type Responses =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<Response, tonic::Status>> + Send>>;

impl AdsClient {
    pub fn new(
        worker: ConfigWorker,
        node: Node,
        target: super::grpc::GrpcTarget,
        api: Api,
        lds: bool,
        cds: bool,
    ) -> AdsClient {
        AdsClient {
            worker,
            node,
            target,
            api,
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
            self.worker.start_dns_refresh();
            self.worker.sleep_applying_health(delay).await;
        }
    }

    /// A state-of-the-world request: the subscription, the last accepted version and nonce.
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

    /// A delta request with no subscription change: an ACK, or a NACK with `error`.
    fn delta_ack(&self, kind: Kind, error: Option<String>) -> DeltaDiscoveryRequest {
        DeltaDiscoveryRequest {
            node: (!self.node_first_only).then(|| self.node.clone()),
            type_url: kind.type_url().to_string(),
            response_nonce: self
                .subs
                .get(&kind)
                .map(|s| s.nonce.clone())
                .unwrap_or_default(),
            error_detail: error.map(nack_status),
            ..Default::default()
        }
    }

    /// The first delta request of a kind on a new stream: every name subscribed to (none for
    /// the wildcard LDS and CDS) and the version of each resource already held, so the server
    /// sends only what changed while the stream was down, and removals.
    fn delta_initial(&self, kind: Kind, with_node: bool) -> DeltaDiscoveryRequest {
        let names = self.subs.get(&kind).map(|s| &s.names);
        let wanted = |n: &str| kind.is_wildcard() || names.is_some_and(|s| s.contains(n));
        DeltaDiscoveryRequest {
            node: (with_node || !self.node_first_only).then(|| self.node.clone()),
            type_url: kind.type_url().to_string(),
            resource_names_subscribe: if kind.is_wildcard() {
                Vec::new()
            } else {
                names
                    .map(|s| s.iter().cloned().collect())
                    .unwrap_or_default()
            },
            initial_resource_versions: self
                .worker
                .store
                .dynamic_versions(kind)
                .filter(|(n, _)| wanted(n))
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        }
    }

    fn first_requests(&mut self) -> Vec<Outgoing> {
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
        initial
            .into_iter()
            .enumerate()
            .map(|(i, kind)| match self.api {
                Api::Sotw => Outgoing::Sotw(self.request(kind, i == 0)),
                Api::Delta => Outgoing::Delta(self.delta_initial(kind, i == 0)),
            })
            .collect()
    }

    async fn open(&mut self, rx: mpsc::Receiver<Outgoing>) -> Result<Responses, String> {
        use futures::StreamExt;
        let channel = super::grpc::connect(&self.target).await?;
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE);
        let requests = ReceiverStream::new(rx);
        let failed = |s: tonic::Status| format!("ADS call failed: {}", s.message());
        Ok(match self.api {
            Api::Sotw => {
                let out = requests.filter_map(|o| async move {
                    match o {
                        Outgoing::Sotw(r) => Some(r),
                        Outgoing::Delta(_) => None,
                    }
                });
                let s = client
                    .stream_aggregated_resources(out)
                    .await
                    .map_err(failed)?;
                Box::pin(s.into_inner().map(|r| r.map(Response::Sotw)))
            }
            Api::Delta => {
                let out = requests.filter_map(|o| async move {
                    match o {
                        Outgoing::Delta(r) => Some(r),
                        Outgoing::Sotw(_) => None,
                    }
                });
                let s = client
                    .delta_aggregated_resources(out)
                    .await
                    .map_err(failed)?;
                Box::pin(s.into_inner().map(|r| r.map(Response::Delta)))
            }
        })
    }

    async fn stream_once(&mut self) -> StreamEnd {
        use futures::StreamExt;
        let uri = self.target.to_string();
        let (tx, rx) = mpsc::channel::<Outgoing>(64);
        // Fresh nonces per stream: the server has forgotten the old ones.
        self.pending_cds_ack = None;
        for sub in self.subs.values_mut() {
            sub.nonce.clear();
        }
        for req in self.first_requests() {
            if tx.send(req).await.is_err() {
                return StreamEnd::NoData("request channel closed".into());
            }
        }
        let mut responses = match self.open(rx).await {
            Ok(r) => r,
            Err(e) => return StreamEnd::NoData(e),
        };
        tracing::info!(api = ?self.api, "ADS stream open to {uri}");
        let mut got_data = false;
        let mut dns = tokio::time::interval(DNS_REFRESH);
        dns.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let health = self.worker.health.changes.clone();
        let sds = self.worker.sds.inbox.clone();
        let dns_done = self.worker.dns.clone();
        loop {
            tokio::select! {
                _ = health.notify.notified() => self.worker.apply_health_changes(),
                _ = sds.notify.notified() => self.worker.apply_sds_events(),
                msg = responses.next() => match msg {
                    Some(Ok(resp)) => {
                        got_data = true;
                        let out = match resp {
                            Response::Sotw(r) => self.handle(r),
                            Response::Delta(r) => self.handle_delta(r),
                        };
                        for req in out {
                            if tx.send(req).await.is_err() {
                                return StreamEnd::AfterData("request channel closed".into());
                            }
                        }
                    }
                    None => {
                        let why = "server closed the stream".to_string();
                        return if got_data { StreamEnd::AfterData(why) } else { StreamEnd::NoData(why) };
                    }
                    Some(Err(s)) => {
                        let why = format!("{}: {}", s.code(), s.message());
                        return if got_data { StreamEnd::AfterData(why) } else { StreamEnd::NoData(why) };
                    }
                },
                _ = dns_done.notify.notified() => self.worker.apply_dns(),
                _ = dns.tick() => {
                    self.worker.start_dns_refresh();
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

    /// Applies a push resource by resource and commits what was accepted. Ok: ACK; Err: the
    /// NACK's message, naming every refused resource (those accepted are applied all the same).
    fn apply(&mut self, kind: Kind, push: Push<'_>, names: &[String]) -> Result<(), String> {
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
        bump(ATTEMPT, names);
        let started = std::time::Instant::now();
        let outcome = match self.worker.store.update(kind, push) {
            Err(whole) => Err(whole.join("; ")),
            Ok(applied) => self
                .worker
                .commit_applied(applied)
                .map_err(|e| e.join("; ")),
        };
        match outcome {
            Ok(rejected) if rejected.is_empty() => {
                bump(SUCCESS, names);
                tracing::debug!(
                    kind = kind.short(),
                    apply_us = started.elapsed().as_micros() as u64,
                    "accepted"
                );
                Ok(())
            }
            Ok(rejected) => {
                counters
                    .rejected_resources
                    .with_label_values(&[kind.short()])
                    .inc_by(rejected.len() as u64);
                let (bad, good): (Vec<String>, Vec<String>) = names
                    .iter()
                    .cloned()
                    .partition(|n| rejected.iter().any(|r| &r.name == n));
                // Named kinds count per resource; LDS and CDS count the response.
                if !kind.is_wildcard() {
                    bump(SUCCESS, &good);
                }
                bump(REJECTED, &bad);
                let message = rejected
                    .iter()
                    .map(|r| r.message.as_str())
                    .collect::<Vec<_>>()
                    .join("; ");
                tracing::warn!(
                    kind = kind.short(),
                    refused = rejected.len(),
                    "resources rejected, the rest applied: {message}"
                );
                Err(message)
            }
            Err(message) => {
                bump(REJECTED, names);
                tracing::warn!(kind = kind.short(), "response rejected: {message}");
                Err(message)
            }
        }
    }

    /// The named kinds whose wanted names changed after a listener or cluster push, with the
    /// new set; the subscription is updated to it.
    fn resubscribe(&mut self, kind: Kind) -> Vec<(Kind, BTreeSet<String>, BTreeSet<String>)> {
        // Only listeners and clusters decide which routes, endpoints and secrets are wanted.
        if !kind.is_wildcard() {
            return Vec::new();
        }
        let wanted = [
            (Kind::Endpoint, self.worker.store.wanted_endpoints()),
            (Kind::Route, self.worker.store.wanted_routes()),
            (Kind::Secret, self.worker.store.wanted_secrets()),
        ];
        let mut out = Vec::new();
        for (k, names) in wanted {
            let sub = self.subs.entry(k).or_default();
            if sub.names != names {
                let old = std::mem::replace(&mut sub.names, names);
                out.push((k, old, sub.names.clone()));
            }
        }
        out
    }

    /// A rejected first response still ends that type's wait at start-up, as in Envoy (its
    /// subscriptions' `onConfigUpdateFailed` marks their init targets ready: a bad config must
    /// not keep the server from starting, the last good one, if any, keeps serving).
    fn answered_with_nack(&mut self, kind: Kind) {
        if let Some(s) = self.subs.get_mut(&kind) {
            s.acked = true;
        }
    }

    /// After an ACK of a push: holds a CDS ACK back while new clusters warm (as Envoy, which
    /// ACKs new clusters once their endpoints are in), and releases it once they are warm.
    fn ack_or_hold(&mut self, kind: Kind, ack: Outgoing, out: &mut Vec<Outgoing>) {
        if kind == Kind::Cluster {
            // A newer CDS response supersedes an ACK still waiting for endpoints.
            self.pending_cds_ack = None;
        }
        if kind == Kind::Cluster && self.worker.store.has_warming_clusters() {
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

    /// Applies one state-of-the-world response; returns the requests to send (the ACK or
    /// NACK, then any subscription changes it caused).
    fn handle(&mut self, resp: DiscoveryResponse) -> Vec<Outgoing> {
        let Some(kind) = Kind::from_type_url(&resp.type_url) else {
            tracing::warn!(type_url = %resp.type_url, "ignoring response of a type Portico did not subscribe to");
            return Vec::new();
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
        let push = Push::Sotw {
            version: &resp.version_info,
            resources: &resp.resources,
        };
        let result = self.apply(kind, push, &names);
        self.subs.entry(kind).or_default().nonce = resp.nonce.clone();
        // The subscriptions follow what was accepted, NACK or not.
        let mut out: Vec<Outgoing> = self
            .resubscribe(kind)
            .into_iter()
            .map(|(k, _, _)| Outgoing::Sotw(self.request(k, false)))
            .collect();
        match result {
            Ok(()) => {
                let ack = Outgoing::Sotw(self.request(kind, false));
                self.ack_or_hold(kind, ack, &mut out);
            }
            Err(message) => {
                self.answered_with_nack(kind);
                let mut nack = self.request(kind, false);
                nack.error_detail = Some(nack_status(message));
                out.insert(0, Outgoing::Sotw(nack));
            }
        }
        self.update_readiness();
        out
    }

    /// Applies one delta response: what it adds or changes, resource by resource, and the
    /// listeners and clusters it removes. Returns the ACK or NACK, then any subscription
    /// changes (subscribe/unsubscribe by name).
    fn handle_delta(&mut self, resp: DeltaDiscoveryResponse) -> Vec<Outgoing> {
        let Some(kind) = Kind::from_type_url(&resp.type_url) else {
            tracing::warn!(type_url = %resp.type_url, "ignoring response of a type Portico did not subscribe to");
            return Vec::new();
        };
        // A resource without a body only refreshes a TTL, which Portico does not keep.
        let items: Vec<Incoming> = resp
            .resources
            .iter()
            .filter_map(|r| {
                r.resource.as_ref().map(|any| Incoming {
                    any,
                    version: &r.version,
                })
            })
            .collect();
        let names: Vec<String> = if kind.is_wildcard() {
            Vec::new()
        } else {
            resp.resources.iter().map(|r| r.name.clone()).collect()
        };
        let mut removed = resp.removed_resources.clone();
        removed.extend(resp.removed_resource_names.iter().map(|r| r.name.clone()));
        let push = Push::Delta {
            system_version: &resp.system_version_info,
            resources: items,
            removed: &removed,
        };
        let result = self.apply(kind, push, &names);
        self.subs.entry(kind).or_default().nonce = resp.nonce.clone();
        let mut out: Vec<Outgoing> = self
            .resubscribe(kind)
            .into_iter()
            .map(|(k, old, new)| {
                Outgoing::Delta(DeltaDiscoveryRequest {
                    node: (!self.node_first_only).then(|| self.node.clone()),
                    type_url: k.type_url().to_string(),
                    resource_names_subscribe: new.difference(&old).cloned().collect(),
                    resource_names_unsubscribe: old.difference(&new).cloned().collect(),
                    ..Default::default()
                })
            })
            .collect();
        match result {
            Ok(()) => {
                let ack = Outgoing::Delta(self.delta_ack(kind, None));
                self.ack_or_hold(kind, ack, &mut out);
            }
            Err(message) => {
                self.answered_with_nack(kind);
                out.insert(0, Outgoing::Delta(self.delta_ack(kind, Some(message))));
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

fn nack_status(message: String) -> Status {
    Status {
        code: tonic::Code::InvalidArgument as i32,
        message,
        details: Vec::new(),
    }
}

/// The name of a RouteConfiguration or ClusterLoadAssignment: field 1 of both. Decoding only
/// it keeps per-resource counters cheap on large pushes.
#[derive(Clone, PartialEq, prost::Message)]
struct ResourceName {
    #[prost(string, tag = "1")]
    name: String,
}
