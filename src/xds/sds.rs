//! SDS streams to bootstrap clusters, one per distinct config source, as istio-agent's
//! `sds-grpc` serves them: state of the world (`SecretDiscoveryService/StreamSecrets`) or
//! incremental (`DeltaSecrets`, `api_type: DELTA_GRPC`).
//!
//! A stream task owns the connection, the nonce and its last accepted version; what it
//! receives goes through the config worker (the [`Inbox`]), which applies it to the one store
//! and answers with the verdict the task ACKs or NACKs. The worker tells each task the names
//! to subscribe to after every commit; a source nothing asks of any more is stopped.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_client::SecretDiscoveryServiceClient;
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::rpc::Status;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio_stream::wrappers::ReceiverStream;

use super::grpc::GrpcTarget;
use super::store::Store;
use super::types;
use crate::snapshot::sds::SdsCluster;

const BACKOFF_BASE: Duration = Duration::from_millis(250);
const BACKOFF_CAP: Duration = Duration::from_secs(5);
const MAX_MESSAGE: usize = 64 * 1024 * 1024;

/// What the stream tasks hand the config worker.
pub enum Event {
    /// A response to apply; the verdict (Err: the NACK's message) goes back on `reply`.
    Push {
        source: Arc<SdsCluster>,
        version: String,
        resources: Vec<Any>,
        /// Over delta, each resource's own version (same length as `resources`); empty over
        /// state of the world, where `version` is every resource's.
        resource_versions: Vec<String>,
        reply: oneshot::Sender<Result<(), String>>,
    },
    /// The source's `initial_fetch_timeout` ran out: start-up stops waiting for it.
    FetchTimeout(Arc<SdsCluster>),
}

/// Events waiting for the config worker, which wakes on `notify`.
#[derive(Default)]
pub struct Inbox {
    queue: Mutex<Vec<Event>>,
    pub notify: Notify,
}

impl Inbox {
    fn push(&self, e: Event) {
        if let Ok(mut q) = self.queue.lock() {
            q.push(e);
        }
        self.notify.notify_one();
    }

    /// Hands a response to the config worker; its verdict, or None once the worker is gone.
    fn apply(
        &self,
        source: &Arc<SdsCluster>,
        version: &str,
        resources: Vec<Any>,
        resource_versions: Vec<String>,
    ) -> impl std::future::Future<Output = Option<Result<(), String>>> {
        let (reply, answer) = oneshot::channel();
        self.push(Event::Push {
            source: source.clone(),
            version: version.to_string(),
            resources,
            resource_versions,
            reply,
        });
        async move { answer.await.ok() }
    }

    pub fn take(&self) -> Vec<Event> {
        self.queue
            .lock()
            .map(|mut q| std::mem::take(&mut *q))
            .unwrap_or_default()
    }
}

struct Source {
    names: watch::Sender<BTreeSet<String>>,
    /// Start-up no longer waits for this source's secrets.
    timed_out: bool,
    task: tokio::task::JoinHandle<()>,
    timer: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Source {
    fn drop(&mut self) {
        self.task.abort();
        if let Some(t) = &self.timer {
            t.abort();
        }
    }
}

/// The SDS streams the config in force asks for.
#[derive(Default)]
pub struct SdsManager {
    pub inbox: Arc<Inbox>,
    node: Node,
    /// Each static cluster's gRPC target, from the bootstrap.
    targets: HashMap<String, Option<GrpcTarget>>,
    sources: BTreeMap<Arc<SdsCluster>, Source>,
}

impl SdsManager {
    pub fn new(node: Node, targets: HashMap<String, Option<GrpcTarget>>) -> SdsManager {
        SdsManager {
            node,
            targets,
            ..Default::default()
        }
    }

    /// Starts, updates and stops streams so each source is asked for what `store` wants of it.
    /// Outside a tokio runtime (unit tests of the worker) nothing is started.
    pub fn reconcile(&mut self, store: &Store) {
        let wanted = store.wanted_sds();
        self.sources.retain(|s, _| wanted.contains_key(s));
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        for (source, names) in wanted {
            if let Some(s) = self.sources.get(&source) {
                s.names.send_if_modified(|old| {
                    let changed = *old != names;
                    *old = names;
                    changed
                });
                continue;
            }
            let target = self.targets.get(&source.cluster).cloned().flatten();
            let (tx, rx) = watch::channel(names);
            let task = tokio::spawn(run(
                source.clone(),
                target,
                self.node.clone(),
                rx,
                self.inbox.clone(),
            ));
            let timer = source.initial_fetch_timeout.map(|t| {
                let (inbox, source) = (self.inbox.clone(), source.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(t).await;
                    inbox.push(Event::FetchTimeout(source));
                })
            });
            self.sources.insert(
                source,
                Source {
                    names: tx,
                    timed_out: false,
                    task,
                    timer,
                },
            );
        }
    }

    pub fn timed_out(&mut self, source: &SdsCluster) {
        if let Some(s) = self.sources.get_mut(source) {
            if !s.timed_out {
                tracing::warn!(
                    cluster = %source.cluster,
                    "SDS: initial_fetch_timeout expired; start-up stops waiting for its secrets"
                );
            }
            s.timed_out = true;
        }
    }

    /// Whether start-up has what it waits for from SDS clusters: every wanted secret, or the
    /// source's `initial_fetch_timeout` ran out (Envoy's init manager waits as long).
    pub fn initial_fetch_done(&self, store: &Store) -> bool {
        self.sources.iter().all(|(_, s)| {
            s.timed_out
                || s.names
                    .borrow()
                    .iter()
                    .all(|n| store.secrets.contains_key(n))
        })
    }
}

enum End {
    Stopped,
    AfterData(String),
    NoData(String),
}

impl End {
    /// A stream that ended for `why`, after or before it carried data.
    fn after(got_data: bool, why: String) -> End {
        if got_data {
            End::AfterData(why)
        } else {
            End::NoData(why)
        }
    }
}

async fn sds_client(
    target: &GrpcTarget,
) -> Result<SecretDiscoveryServiceClient<tonic::transport::Channel>, String> {
    let channel = super::grpc::connect(target).await?;
    Ok(SecretDiscoveryServiceClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE))
}

/// One source's stream, reconnected with capped, jittered backoff until the task is stopped.
async fn run(
    source: Arc<SdsCluster>,
    target: Option<GrpcTarget>,
    node: Node,
    mut names: watch::Receiver<BTreeSet<String>>,
    inbox: Arc<Inbox>,
) {
    let Some(target) = target else {
        // The config check refuses clusters not in the bootstrap; this one has no endpoint.
        tracing::error!(cluster = %source.cluster, "SDS cluster has no endpoint: its secrets never arrive");
        return;
    };
    // The last accepted version outlives a stream, as Envoy sends it on reconnecting; over
    // delta, each secret's (`initial_resource_versions`).
    let mut version = String::new();
    let mut versions = BTreeMap::new();
    let mut attempt = 0u32;
    loop {
        let end = if source.delta {
            stream_once_delta(&source, &target, &node, &mut names, &inbox, &mut versions).await
        } else {
            stream_once(&source, &target, &node, &mut names, &inbox, &mut version).await
        };
        match end {
            End::Stopped => return,
            End::AfterData(why) => {
                tracing::warn!(cluster = %source.cluster, "SDS stream to {target} closed: {why}; reconnecting");
                attempt = 0;
            }
            End::NoData(why) => {
                tracing::warn!(cluster = %source.cluster, "SDS stream to {target} failed: {why}")
            }
        }
        let window = BACKOFF_BASE
            .saturating_mul(1 << attempt.min(8))
            .min(BACKOFF_CAP);
        attempt = attempt.saturating_add(1);
        tokio::time::sleep(window.mul_f64(0.5 + fastrand::f64() * 0.5)).await;
    }
}

async fn stream_once(
    source: &Arc<SdsCluster>,
    target: &GrpcTarget,
    node: &Node,
    names: &mut watch::Receiver<BTreeSet<String>>,
    inbox: &Inbox,
    version: &mut String,
) -> End {
    let mut client = match sds_client(target).await {
        Ok(c) => c,
        Err(e) => return End::NoData(e),
    };
    let (tx, rx) = mpsc::channel::<DiscoveryRequest>(16);
    let mut first = true;
    let mut request = |names: &BTreeSet<String>, version: &str, nonce: &str| {
        let with_node = first || !source.node_first_only;
        first = false;
        DiscoveryRequest {
            version_info: version.to_string(),
            node: with_node.then(|| node.clone()),
            resource_names: names.iter().cloned().collect(),
            type_url: types::SECRET.to_string(),
            response_nonce: nonce.to_string(),
            ..Default::default()
        }
    };
    let initial = request(&names.borrow_and_update(), version, "");
    if tx.send(initial).await.is_err() {
        return End::NoData("request channel closed".into());
    }
    let mut responses = match client.stream_secrets(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(s) => return End::NoData(format!("SDS call failed: {}", s.message())),
    };
    tracing::info!(cluster = %source.cluster, "SDS stream open to {target}");
    let mut nonce = String::new();
    let mut got_data = false;
    loop {
        let resp: DiscoveryResponse = tokio::select! {
            changed = names.changed() => {
                if changed.is_err() {
                    return End::Stopped;
                }
                let req = request(&names.borrow_and_update(), version, &nonce);
                if tx.send(req).await.is_err() {
                    return End::after(got_data, "request channel closed".into());
                }
                continue;
            }
            msg = responses.message() => match msg {
                Ok(Some(r)) => r,
                Ok(None) => return End::after(got_data, "server closed the stream".into()),
                Err(s) => return End::after(got_data, format!("{}: {}", s.code(), s.message())),
            },
        };
        got_data = true;
        nonce = resp.nonce.clone();
        let verdict = if resp.type_url != types::SECRET {
            Err(format!(
                "unexpected type {} on an SDS stream, expected {}",
                resp.type_url,
                types::SECRET
            ))
        } else {
            let pushed = inbox.apply(source, &resp.version_info, resp.resources, Vec::new());
            match pushed.await {
                Some(v) => v,
                // The worker is gone: the process is stopping.
                None => return End::Stopped,
            }
        };
        let req = match verdict {
            Ok(()) => {
                *version = resp.version_info;
                request(&names.borrow(), version, &nonce)
            }
            Err(message) => {
                tracing::warn!(cluster = %source.cluster, version = %resp.version_info, "SDS rejected: {message}");
                let mut nack = request(&names.borrow(), version, &nonce);
                nack.error_detail = Some(Status {
                    code: tonic::Code::InvalidArgument as i32,
                    message,
                    details: Vec::new(),
                });
                nack
            }
        };
        if tx.send(req).await.is_err() {
            return End::after(got_data, "request channel closed".into());
        }
    }
}

/// One incremental stream: the names subscribed and unsubscribed as the config asks, each
/// secret's version kept per name, removals ignored (as Envoy's SDS: a secret goes when nothing
/// uses it, not when the server says so).
async fn stream_once_delta(
    source: &Arc<SdsCluster>,
    target: &GrpcTarget,
    node: &Node,
    names: &mut watch::Receiver<BTreeSet<String>>,
    inbox: &Inbox,
    versions: &mut BTreeMap<String, String>,
) -> End {
    let mut client = match sds_client(target).await {
        Ok(c) => c,
        Err(e) => return End::NoData(e),
    };
    let (tx, rx) = mpsc::channel::<DeltaDiscoveryRequest>(16);
    let mut subscribed = names.borrow_and_update().clone();
    versions.retain(|n, _| subscribed.contains(n));
    let initial = DeltaDiscoveryRequest {
        node: Some(node.clone()),
        type_url: types::SECRET.to_string(),
        resource_names_subscribe: subscribed.iter().cloned().collect(),
        initial_resource_versions: versions.clone().into_iter().collect(),
        ..Default::default()
    };
    let later = |req: DeltaDiscoveryRequest| DeltaDiscoveryRequest {
        node: (!source.node_first_only).then(|| node.clone()),
        type_url: types::SECRET.to_string(),
        ..req
    };
    if tx.send(initial).await.is_err() {
        return End::NoData("request channel closed".into());
    }
    let mut responses = match client.delta_secrets(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(s) => return End::NoData(format!("delta SDS call failed: {}", s.message())),
    };
    tracing::info!(cluster = %source.cluster, "delta SDS stream open to {target}");
    let mut got_data = false;
    loop {
        let resp: DeltaDiscoveryResponse = tokio::select! {
            changed = names.changed() => {
                if changed.is_err() {
                    return End::Stopped;
                }
                let now = names.borrow_and_update().clone();
                let subscribe: Vec<String> = now.difference(&subscribed).cloned().collect();
                let unsubscribe: Vec<String> = subscribed.difference(&now).cloned().collect();
                for n in &unsubscribe {
                    versions.remove(n);
                }
                subscribed = now;
                if subscribe.is_empty() && unsubscribe.is_empty() {
                    continue;
                }
                let req = later(DeltaDiscoveryRequest {
                    resource_names_subscribe: subscribe,
                    resource_names_unsubscribe: unsubscribe,
                    ..Default::default()
                });
                if tx.send(req).await.is_err() {
                    return End::after(got_data, "request channel closed".into());
                }
                continue;
            }
            msg = responses.message() => match msg {
                Ok(Some(r)) => r,
                Ok(None) => return End::after(got_data, "server closed the stream".into()),
                Err(s) => return End::after(got_data, format!("{}: {}", s.code(), s.message())),
            },
        };
        got_data = true;
        let verdict = if resp.type_url != types::SECRET {
            Err(format!(
                "unexpected type {} on an SDS stream, expected {}",
                resp.type_url,
                types::SECRET
            ))
        } else {
            // A resource without a body only says the server knows the name; nothing to apply.
            let (mut resources, mut resource_versions, mut named) =
                (Vec::new(), Vec::new(), Vec::new());
            for r in resp.resources {
                if let Some(any) = r.resource {
                    resources.push(any);
                    resource_versions.push(r.version.clone());
                    named.push((r.name, r.version));
                }
            }
            let pushed = inbox.apply(
                source,
                &resp.system_version_info,
                resources,
                resource_versions,
            );
            match pushed.await {
                Some(Ok(())) => {
                    for (name, version) in named {
                        if subscribed.contains(&name) {
                            versions.insert(name, version);
                        }
                    }
                    Ok(())
                }
                Some(Err(e)) => Err(e),
                // The worker is gone: the process is stopping.
                None => return End::Stopped,
            }
        };
        let mut req = later(DeltaDiscoveryRequest {
            response_nonce: resp.nonce,
            ..Default::default()
        });
        if let Err(message) = verdict {
            tracing::warn!(cluster = %source.cluster, version = %resp.system_version_info, "delta SDS rejected: {message}");
            req.error_detail = Some(Status {
                code: tonic::Code::InvalidArgument as i32,
                message,
                details: Vec::new(),
            });
        }
        if tx.send(req).await.is_err() {
            return End::after(got_data, "request channel closed".into());
        }
    }
}
