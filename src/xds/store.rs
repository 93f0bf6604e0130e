//! The last good config: every accepted resource by type and name, with its translation.
//!
//! `apply` is pure: it takes a push and returns the candidate store (or every rejection
//! reason), and `assemble` turns a store into a snapshot, reusing what did not change.
//!
//! Tables are persistent maps: a push copies nothing it does not change, so an EDS update of
//! one cluster in ten thousand costs a few map nodes and one rebuilt cluster, not a pass over
//! the whole config. Wildcard pushes (LDS, CDS) carry everything and are rebuilt whole.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use envoy_types::pb::envoy::config::cluster::v3::Cluster as ClusterProto;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener as ListenerProto;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret as SecretProto;
use envoy_types::pb::google::protobuf::Any;

use super::sources::Sources;
use super::types::{self, Kind, Raw};
use crate::live::ClusterStats;
use crate::snapshot::cluster::{Cluster, ClusterDef, DiscoveryKind, HostState, LoadAssignment};
use crate::snapshot::listener::{ListenAddr, ListenerDef, RouteSource};
use crate::snapshot::route::RouteTable;
use crate::snapshot::sds::{SdsCluster, SdsRef, SdsSource};
use crate::snapshot::sources::DataSources;
use crate::snapshot::tls::{CertSource, ClientValidation, DownstreamTls, SecretDef, TlsServer};
use crate::snapshot::upstream_tls::Resolved;
use crate::snapshot::{ActiveChain, ActiveListener, Snapshot, TranslateError};

/// One accepted resource: the proto as received (encoded, for `/config_dump`) and its
/// translation.
#[derive(Debug)]
pub struct Item<P, T> {
    pub proto: Raw<P>,
    pub value: Arc<T>,
    pub version: Arc<str>,
    pub last_updated: SystemTime,
    /// From the bootstrap: never removed or replaced by xDS.
    pub is_static: bool,
}

impl<P, T> Clone for Item<P, T> {
    fn clone(&self) -> Self {
        Item {
            proto: self.proto.clone(),
            value: self.value.clone(),
            version: self.version.clone(),
            last_updated: self.last_updated,
            is_static: self.is_static,
        }
    }
}

pub type Table<P, T> = imbl::OrdMap<String, Item<P, T>>;

/// What changed since the last commit, so `assemble` rebuilds only that.
#[derive(Debug, Clone, Default)]
pub struct Touched {
    /// Clusters were pushed, resolved or added from the bootstrap: look at every one.
    pub all_clusters: bool,
    /// ClusterLoadAssignment names an EDS push carried.
    pub endpoints: BTreeSet<String>,
    /// Clusters whose active health checks changed a host's health.
    pub health: BTreeSet<String>,
    /// Secret names a push carried: the clusters built from them are rebuilt.
    pub secrets: BTreeSet<String>,
}

/// The live state snapshot assembly needs, handed in by the commit point
/// (`crate::xds::commit` implements it over the process's stats): assembling reads nothing
/// live itself, so it is a function of the store, the serving snapshot and this.
pub trait LiveClusters {
    /// The cluster's counters and live state, kept across pushes by name.
    fn stats(&self, cluster: &str) -> Arc<ClusterStats>;
    /// A cluster with active health checks: the generation of its checker's results once
    /// the first round for `def` is done, None while it is not (the cluster warms).
    fn health_round(&self, cluster: &str, def: &Arc<ClusterDef>) -> Option<u64>;
    /// What the live state says of the hosts a build of `def` over `endpoints` has.
    fn hosts(&self, cluster: &str, def: &ClusterDef, endpoints: &LoadAssignment) -> HostState;
}

#[derive(Debug, Clone, Default)]
pub struct Store {
    pub listeners: Table<ListenerProto, ListenerDef>,
    pub routes: Table<RouteConfiguration, RouteTable>,
    pub clusters: Table<ClusterProto, ClusterDef>,
    pub endpoints: Table<ClusterLoadAssignment, LoadAssignment>,
    /// SDS secrets the listeners and clusters ask for, over ADS or from SDS clusters (keyed
    /// by name alone: see `snapshot::sds`).
    pub secrets: Table<SecretProto, SecretDef>,
    /// Endpoints of STATIC and DNS clusters, by cluster name (DNS ones filled by a resolver).
    pub resolved: imbl::OrdMap<String, Arc<LoadAssignment>>,
    /// EDS clusters by the ClusterLoadAssignment name they read; rebuilt when clusters change.
    pub eds_users: Arc<HashMap<String, Vec<String>>>,
    /// Clusters by the SDS secret names their transport sockets are built from.
    pub sds_users: Arc<HashMap<String, Vec<String>>>,
    /// Last accepted version per kind.
    pub versions: BTreeMap<Kind, String>,
    /// Resources whose last update was refused, by kind and name, until one is accepted.
    pub failures: imbl::OrdMap<(Kind, String), Arc<Failure>>,
    pub touched: Touched,
    /// The files and variables resources name, read when they are translated.
    pub sources: Sources,
}

/// Translates one resource, reusing the previous translation when the proto is unchanged.
trait Translate: prost::Message + prost::Name + Default + Sized {
    type Out;
    const URL: &'static str;
    fn name(&self) -> &str;
    fn translate(&self, src: &dyn DataSources) -> Result<Self::Out, TranslateError>;
    /// Carries what must outlive a change over from the previous translation.
    fn carry_over(_next: &mut Self::Out, _prev: &Self::Out) {}
}

impl Translate for ListenerProto {
    type Out = ListenerDef;
    const URL: &'static str = types::LISTENER;
    fn name(&self) -> &str {
        &self.name
    }
    fn translate(&self, src: &dyn DataSources) -> Result<ListenerDef, TranslateError> {
        ListenerDef::translate(self, src)
    }
    fn carry_over(next: &mut ListenerDef, prev: &ListenerDef) {
        next.keep_unchanged_chains(prev);
    }
}

impl Translate for RouteConfiguration {
    type Out = RouteTable;
    const URL: &'static str = types::ROUTE;
    fn name(&self) -> &str {
        &self.name
    }
    fn translate(&self, _: &dyn DataSources) -> Result<RouteTable, TranslateError> {
        RouteTable::translate(self)
    }
}

impl Translate for ClusterProto {
    type Out = ClusterDef;
    const URL: &'static str = types::CLUSTER;
    fn name(&self) -> &str {
        &self.name
    }
    fn translate(&self, src: &dyn DataSources) -> Result<ClusterDef, TranslateError> {
        ClusterDef::translate(self, src)
    }
}

impl Translate for SecretProto {
    type Out = SecretDef;
    const URL: &'static str = types::SECRET;
    fn name(&self) -> &str {
        &self.name
    }
    fn translate(&self, src: &dyn DataSources) -> Result<SecretDef, TranslateError> {
        SecretDef::translate(self, src)
    }
}

impl Translate for ClusterLoadAssignment {
    type Out = LoadAssignment;
    const URL: &'static str = types::ENDPOINT;
    fn name(&self) -> &str {
        &self.cluster_name
    }
    fn translate(&self, _: &dyn DataSources) -> Result<LoadAssignment, TranslateError> {
        LoadAssignment::translate(self)
    }
}

/// One resource of a push and the version it arrived with: the response's `version_info` in
/// state of the world, the resource's own `version` in delta.
#[derive(Debug, Clone, Copy)]
pub struct Incoming<'a> {
    pub any: &'a Any,
    pub version: &'a str,
}

/// A response as the store takes it.
#[derive(Debug, Clone)]
pub enum Push<'a> {
    /// State of the world: for LDS and CDS the whole set, so a name it lacks is removed.
    Sotw {
        version: &'a str,
        resources: &'a [Any],
    },
    /// Incremental: the resources that changed and the names removed. As Envoy, removals are
    /// honoured for listeners and clusters and ignored for route configurations, endpoints
    /// and secrets (their users decide when they go).
    Delta {
        system_version: &'a str,
        resources: Vec<Incoming<'a>>,
        removed: &'a [String],
    },
}

/// A resource refused on its own; the rest of its response was applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejected {
    pub kind: Kind,
    pub name: String,
    /// The reason, naming the resource and the field.
    pub message: String,
    /// The resource as it arrived, for `/config_dump`'s `error_state`.
    pub config: Option<Any>,
    pub version: String,
}

/// A push applied resource by resource: the new store and what it refused.
#[derive(Debug)]
pub struct Applied {
    pub store: Store,
    pub rejected: Vec<Rejected>,
}

impl Applied {
    /// The NACK's message: every refusal, in the order of the response.
    pub fn message(&self) -> Option<String> {
        (!self.rejected.is_empty()).then(|| {
            self.rejected
                .iter()
                .map(|r| r.message.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        })
    }
}

/// The last refusal of a resource that has not been accepted since: `/config_dump` shows it
/// as Envoy's `error_state`.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    pub version: String,
    pub at: SystemTime,
    pub config: Option<Any>,
}

/// Which resources of the kind a push removes besides the ones it carries.
enum Removal<'a> {
    /// State-of-the-world LDS and CDS: every dynamic resource the response does not name.
    Unnamed,
    /// Delta LDS and CDS: the names in `removed_resources`.
    Names(&'a [String]),
    None,
}

/// A table after a push, and the names the push held.
type TablePush<P> = (Table<P, <P as Translate>::Out>, BTreeSet<String>);

/// Applies a push to a table, resource by resource. A response that cannot be decoded, or
/// that names a listener or cluster twice, is refused whole (`Err`), as Envoy refuses it;
/// otherwise each resource that fails to translate is refused alone, keeping its previous
/// version, and reported in `rejected`. Returns the new table and the names the response held.
fn apply_table<P: Translate>(
    old: &Table<P, P::Out>,
    kind: Kind,
    items: &[Incoming<'_>],
    removal: Removal<'_>,
    now: SystemTime,
    rejected: &mut Vec<Rejected>,
    src: &dyn DataSources,
) -> Result<TablePush<P>, Vec<String>> {
    let what = kind.noun();
    let mut whole = Vec::new();
    let mut decoded = Vec::with_capacity(items.len());
    for (i, inc) in items.iter().enumerate() {
        let d = types::payload(inc.any, P::URL).and_then(|bytes| {
            P::decode(&*bytes)
                .map(|p| (p, bytes))
                .map_err(|e| format!("cannot decode {}: {e}", P::URL))
        });
        match d {
            Ok((proto, bytes)) => decoded.push((proto, bytes, inc.version)),
            Err(e) => whole.push(format!("resource {i}: {e}")),
        }
    }
    let mut seen = BTreeSet::new();
    for (proto, ..) in &decoded {
        let name = proto.name();
        // Envoy rejects a repeated listener or cluster, but keeps the first of a repeated
        // route configuration or load assignment without complaint.
        if !seen.insert(name.to_string()) && kind.is_wildcard() {
            whole.push(format!(
                "{what} '{name}': duplicate {what} name in one response"
            ));
        }
    }
    if !whole.is_empty() {
        return Err(whole);
    }
    let mut next = old.clone();
    match removal {
        Removal::Unnamed => {
            let stale: Vec<String> = old
                .iter()
                .filter(|(k, i)| !i.is_static && !seen.contains(*k))
                .map(|(k, _)| k.clone())
                .collect();
            for k in &stale {
                next.remove(k);
            }
        }
        Removal::Names(names) => {
            for n in names {
                if next.get(n).is_some_and(|i| !i.is_static) {
                    next.remove(n);
                }
            }
        }
        Removal::None => {}
    }
    let mut done = BTreeSet::new();
    for (proto, bytes, version) in decoded {
        let name = proto.name().to_string();
        if !done.insert(name.clone()) {
            continue;
        }
        let refuse = |message: String| Rejected {
            kind,
            name: name.clone(),
            message,
            config: Some(Any {
                type_url: P::URL.to_string(),
                value: bytes.to_vec(),
            }),
            version: version.to_string(),
        };
        match old.get(&name) {
            Some(prev) if prev.is_static => {
                rejected.push(refuse(format!(
                    "{what} '{name}': a static resource from the bootstrap cannot be replaced by xDS"
                )));
                continue;
            }
            // The same bytes are the same resource; a re-encoding that differs only costs a
            // translation.
            Some(prev) if prev.proto.bytes() == &*bytes => continue,
            _ => {}
        }
        match proto.translate(src) {
            Ok(mut value) => {
                if let Some(prev) = old.get(&name) {
                    P::carry_over(&mut value, &prev.value);
                }
                next.insert(
                    name.clone(),
                    Item {
                        proto: Raw::from_bytes(&bytes),
                        value: Arc::new(value),
                        version: Arc::from(version),
                        last_updated: now,
                        is_static: false,
                    },
                );
            }
            Err(e) => rejected.push(refuse(e.to_string())),
        }
    }
    Ok((next, seen))
}

/// Puts back the previous version of `name` (or removes it if it is new) after a check of the
/// whole store refused it, and returns the refused resource as it arrived.
fn revert<P: prost::Message + prost::Name + Default, T>(
    next: &mut Table<P, T>,
    old: &Table<P, T>,
    name: &str,
) -> Option<(Any, String)> {
    let refused = next
        .get(name)
        .map(|i| (i.proto.to_any(), i.version.to_string()));
    match old.get(name) {
        Some(prev) => {
            next.insert(name.to_string(), prev.clone());
        }
        None => {
            next.remove(name);
        }
    }
    refused
}

impl Rejected {
    fn after_check(
        kind: Kind,
        name: String,
        message: String,
        refused: Option<(Any, String)>,
    ) -> Rejected {
        let (config, version) = match refused {
            Some((a, v)) => (Some(a), v),
            None => (None, String::new()),
        };
        Rejected {
            kind,
            name,
            message,
            config,
            version,
        }
    }
}

/// Check failures grouped by resource, each resource's reasons joined, in name order.
fn by_name(failed: Vec<(String, String)>) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for (name, message) in failed {
        match out.get_mut(&name) {
            Some(m) => {
                m.push_str("; ");
                m.push_str(&message);
            }
            None => {
                out.insert(name, message);
            }
        }
    }
    out
}

/// Whether this push added or changed `name` in the table.
fn changed<P, T>(old: &Table<P, T>, next: &Table<P, T>, name: &str) -> bool {
    match (old.get(name), next.get(name)) {
        (Some(o), Some(n)) => !Arc::ptr_eq(&o.value, &n.value),
        (None, Some(_)) => true,
        _ => false,
    }
}

impl Store {
    /// Adds bootstrap resources, which xDS can neither replace nor remove.
    pub fn add_static(
        &mut self,
        listeners: &[ListenerProto],
        clusters: &[ClusterProto],
    ) -> Result<(), Vec<String>> {
        let mut errors = Vec::new();
        let now = SystemTime::now();
        let mut add = |res: Result<(), TranslateError>| {
            if let Err(e) = res {
                errors.push(format!("static_resources: {e}"));
            }
        };
        for l in listeners {
            let mut l = l.clone();
            if l.name.is_empty() {
                // Envoy names an unnamed static listener with a random UUID.
                l.name = crate::uuid::v4();
            }
            let r = l.translate(&*self.sources).map(|v| {
                self.listeners
                    .insert(l.name.clone(), static_item(l.clone(), v, now));
            });
            add(r);
        }
        for c in clusters {
            let r = c.translate(&*self.sources).map(|v| {
                self.clusters
                    .insert(c.name.clone(), static_item(c.clone(), v, now));
            });
            add(r);
        }
        self.resolve_literal_endpoints();
        self.index_eds_users();
        self.touched.all_clusters = true;
        let all = |_: &str| true;
        let failed = [
            self.check_listener_addresses(&all),
            self.check_sds_clusters(all, all),
            self.check_route_clusters(&all),
        ];
        errors.extend(
            failed
                .into_iter()
                .flatten()
                .map(|(_, e)| format!("static_resources: {e}")),
        );
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// The candidate store after a state-of-the-world push, or every reason it is rejected:
    /// all or nothing, for callers that want a push to be good as a whole (tests, tools).
    /// The ADS client uses [`Store::update`], which applies what it can.
    pub fn apply(
        &self,
        kind: Kind,
        version: &str,
        resources: &[Any],
    ) -> Result<Store, Vec<String>> {
        let applied = self.update(kind, Push::Sotw { version, resources })?;
        if applied.rejected.is_empty() {
            Ok(applied.store)
        } else {
            Err(applied.rejected.into_iter().map(|r| r.message).collect())
        }
    }

    /// Applies a push as Envoy does, resource by resource: every resource that translates and
    /// passes its checks is applied, each one that does not is refused alone (keeping its last
    /// good version) and listed in `rejected`. `Err` is a response Envoy refuses whole (a
    /// resource that does not decode, a listener or cluster named twice): nothing is applied.
    pub fn update(&self, kind: Kind, push: Push<'_>) -> Result<Applied, Vec<String>> {
        let (version, items, removal) = match push {
            Push::Sotw { version, resources } => (
                version,
                resources
                    .iter()
                    .map(|any| Incoming { any, version })
                    .collect::<Vec<_>>(),
                if kind.is_wildcard() {
                    Removal::Unnamed
                } else {
                    Removal::None
                },
            ),
            Push::Delta {
                system_version,
                resources,
                removed,
            } => (
                system_version,
                resources,
                if kind.is_wildcard() {
                    Removal::Names(removed)
                } else {
                    Removal::None
                },
            ),
        };
        let mut rejected = Vec::new();
        let now = SystemTime::now();
        let mut next = self.clone();
        let seen = match kind {
            Kind::Listener => {
                let (table, seen) = apply_table(
                    &self.listeners,
                    kind,
                    &items,
                    removal,
                    now,
                    &mut rejected,
                    &*self.sources,
                )?;
                next.listeners = table;
                // Only listeners this push adds or changes are checked, as Envoy checks a
                // listener when it is added or updated; a failing one keeps its old version.
                type Check = fn(&Store, &dyn Fn(&str) -> bool) -> Vec<(String, String)>;
                let checks: [Check; 3] = [
                    |s, changed| s.check_listener_addresses(changed),
                    |s, changed| s.check_route_clusters(changed),
                    |s, changed| s.check_sds_clusters(changed, |_| false),
                ];
                for check in checks {
                    let failed = check(&next, &|name| {
                        changed(&self.listeners, &next.listeners, name)
                    });
                    for (name, message) in by_name(failed) {
                        let refused = revert(&mut next.listeners, &self.listeners, &name);
                        rejected.push(Rejected::after_check(kind, name, message, refused));
                    }
                }
                seen
            }
            Kind::Route => {
                let (routes, pushed) = apply_table(
                    &self.routes,
                    kind,
                    &items,
                    removal,
                    now,
                    &mut rejected,
                    &*self.sources,
                )?;
                next.routes = routes;
                // Route tables nothing asks for are dropped, as Envoy ignores them.
                let wanted = next.wanted_routes();
                for name in pushed.iter().filter(|n| !wanted.contains(*n)) {
                    next.routes.remove(name);
                }
                for name in &pushed {
                    let Some(item) = next.routes.get(name) else {
                        continue;
                    };
                    if !changed(&self.routes, &next.routes, name)
                        || item.value.validate_clusters != Some(true)
                    {
                        continue;
                    }
                    let unknown = item
                        .value
                        .unknown_clusters(|c| next.clusters.contains_key(c));
                    if !unknown.is_empty() {
                        let refused = revert(&mut next.routes, &self.routes, name);
                        rejected.push(Rejected::after_check(
                            kind,
                            name.clone(),
                            unknown.join("; "),
                            refused,
                        ));
                    }
                }
                pushed
            }
            Kind::Cluster => {
                let (table, seen) = apply_table(
                    &self.clusters,
                    kind,
                    &items,
                    removal,
                    now,
                    &mut rejected,
                    &*self.sources,
                )?;
                next.clusters = table;
                let failed = next.check_sds_clusters(
                    |_| false,
                    |name| changed(&self.clusters, &next.clusters, name),
                );
                for (name, message) in by_name(failed) {
                    let refused = revert(&mut next.clusters, &self.clusters, &name);
                    rejected.push(Rejected::after_check(kind, name, message, refused));
                }
                next.resolve_literal_endpoints();
                next.index_eds_users();
                next.touched.all_clusters = true;
                seen
            }
            Kind::Secret => next.apply_secrets(&SdsSource::Ads, &items, now, &mut rejected)?,
            Kind::Endpoint => {
                let (endpoints, pushed) = apply_table(
                    &self.endpoints,
                    kind,
                    &items,
                    removal,
                    now,
                    &mut rejected,
                    &*self.sources,
                )?;
                next.endpoints = endpoints;
                for name in &pushed {
                    if next.eds_users.contains_key(name) {
                        next.touched.endpoints.insert(name.clone());
                    } else {
                        // Envoy drops assignments for clusters it does not have.
                        next.endpoints.remove(name);
                    }
                }
                pushed
            }
        };
        if rejected.is_empty() {
            next.versions.insert(kind, version.to_string());
        }
        if kind.is_wildcard() {
            next.collect_garbage();
        }
        next.record_failures(kind, &seen, &rejected, now);
        Ok(Applied {
            store: next,
            rejected,
        })
    }

    /// Keeps the last refusal of each resource until it is accepted or goes away.
    fn record_failures(
        &mut self,
        kind: Kind,
        seen: &BTreeSet<String>,
        rejected: &[Rejected],
        now: SystemTime,
    ) {
        let still_there = |s: &Store, name: &str| match kind {
            Kind::Listener => s.listeners.contains_key(name),
            Kind::Cluster => s.clusters.contains_key(name),
            Kind::Route => s.routes.contains_key(name),
            Kind::Endpoint => s.endpoints.contains_key(name),
            Kind::Secret => s.secrets.contains_key(name),
        };
        let stale: Vec<(Kind, String)> = self
            .failures
            .keys()
            .filter(|(k, name)| {
                *k == kind
                    && (seen.contains(name) || (kind.is_wildcard() && !still_there(self, name)))
            })
            .cloned()
            .collect();
        for key in &stale {
            self.failures.remove(key);
        }
        for r in rejected {
            self.failures.insert(
                (kind, r.name.clone()),
                Arc::new(Failure {
                    message: r.message.clone(),
                    version: r.version.clone(),
                    at: now,
                    config: r.config.clone(),
                }),
            );
        }
    }

    /// The store after a push on the SDS stream to `source`'s cluster, applied secret by
    /// secret. The stream keeps its own version; the store's versions are ADS's.
    pub fn apply_sds(
        &self,
        source: &Arc<SdsCluster>,
        version: &str,
        resources: &[Any],
        resource_versions: &[String],
    ) -> Result<Applied, Vec<String>> {
        let mut rejected = Vec::new();
        let mut next = self.clone();
        let now = SystemTime::now();
        let items: Vec<Incoming> = resources
            .iter()
            .enumerate()
            .map(|(i, any)| Incoming {
                any,
                version: resource_versions.get(i).map_or(version, String::as_str),
            })
            .collect();
        let seen = next.apply_secrets(
            &SdsSource::Cluster(source.clone()),
            &items,
            now,
            &mut rejected,
        )?;
        next.record_failures(Kind::Secret, &seen, &rejected, now);
        Ok(Applied {
            store: next,
            rejected,
        })
    }

    /// Secrets from `source`: those nobody asks of it are dropped, as Envoy ignores them, and
    /// every cluster built from a pushed secret must build with it (Envoy refuses the secret
    /// when its socket's update fails). Returns the names pushed.
    fn apply_secrets(
        &mut self,
        source: &SdsSource,
        items: &[Incoming<'_>],
        now: SystemTime,
        rejected: &mut Vec<Rejected>,
    ) -> Result<BTreeSet<String>, Vec<String>> {
        let old = self.secrets.clone();
        let (secrets, pushed) = apply_table(
            &old,
            Kind::Secret,
            items,
            Removal::None,
            now,
            rejected,
            &*self.sources,
        )?;
        self.secrets = secrets;
        let wanted = self.wanted_from(source);
        for name in pushed.iter().filter(|n| !wanted.contains(*n)) {
            self.secrets.remove(name);
        }
        let mut failed = Vec::new();
        {
            let lookup = self.secret_lookup();
            for name in pushed.iter().filter(|n| wanted.contains(*n)) {
                for c in self.sds_users.get(name).into_iter().flatten() {
                    let Some(item) = self.clusters.get(c) else {
                        continue;
                    };
                    if let Err(e) = item.value.transport.resolve(&lookup) {
                        failed.push((name.clone(), format!("secret '{name}': cluster '{c}': {e}")));
                    }
                }
            }
        }
        for (name, message) in by_name(failed) {
            let refused = revert(&mut self.secrets, &old, &name);
            rejected.push(Rejected::after_check(Kind::Secret, name, message, refused));
        }
        self.touched.secrets.extend(pushed.iter().cloned());
        Ok(pushed)
    }

    /// Puts back the last good version of listener `name` (or leaves it out if it is new),
    /// for a listener whose socket cannot be bound; returns the refusal to report.
    pub fn revert_listener(&mut self, old: &Store, name: &str, message: String) -> Rejected {
        let refused = revert(&mut self.listeners, &old.listeners, name);
        let rejected = Rejected::after_check(Kind::Listener, name.to_string(), message, refused);
        self.record_failures(
            Kind::Listener,
            &BTreeSet::new(),
            std::slice::from_ref(&rejected),
            SystemTime::now(),
        );
        self.versions.remove(&Kind::Listener);
        if let Some(v) = old.versions.get(&Kind::Listener) {
            self.versions.insert(Kind::Listener, v.clone());
        }
        rejected
    }

    /// The secrets as the upstream sockets read them: translation and encoding.
    fn secret_lookup<'a>(&'a self) -> impl Fn(&SdsRef) -> Option<(Arc<SecretDef>, &'a [u8])> + 'a {
        move |r: &SdsRef| {
            self.secrets
                .get(&r.name)
                .map(|i| (i.value.clone(), i.proto.bytes()))
        }
    }

    fn index_eds_users(&mut self) {
        let mut users: HashMap<String, Vec<String>> = HashMap::new();
        let mut sds: HashMap<String, Vec<String>> = HashMap::new();
        for (name, c) in self.clusters.iter() {
            if c.value.kind == DiscoveryKind::Eds {
                users
                    .entry(c.value.eds_name.clone())
                    .or_default()
                    .push(name.clone());
            }
            for r in c.value.transport.sds_refs() {
                let users = sds.entry(r.name.clone()).or_default();
                if users.last() != Some(name) {
                    users.push(name.clone());
                }
            }
        }
        self.eds_users = Arc::new(users);
        self.sds_users = Arc::new(sds);
    }

    /// Every SDS secret the listeners (those `listener` selects) and clusters (`cluster`)
    /// ask for from an SDS cluster must name a static cluster of the bootstrap, as Envoy
    /// requires of a gRPC config source. Returns (resource name, reason) pairs.
    fn check_sds_clusters(
        &self,
        listener: impl Fn(&str) -> bool,
        cluster: impl Fn(&str) -> bool,
    ) -> Vec<(String, String)> {
        let mut errors = Vec::new();
        let mut check = |what: &str, name: &str, r: &SdsRef| {
            let Some(c) = r.cluster() else {
                return;
            };
            if !self.clusters.get(&c.cluster).is_some_and(|c| c.is_static) {
                errors.push((name.to_string(), format!(
                    "{what} '{name}': secret '{}': sds_config: gRPC cluster '{}' is not a static cluster of the bootstrap",
                    r.name, c.cluster
                )));
            }
        };
        for (name, l) in self.listeners.iter().filter(|(n, _)| listener(n)) {
            for r in l
                .value
                .chains
                .iter()
                .filter_map(|c| c.tls.as_ref())
                .flat_map(|t| t.sds_refs())
            {
                check("listener", name, r);
            }
        }
        for (name, c) in self.clusters.iter().filter(|(n, _)| cluster(n)) {
            for r in c.value.transport.sds_refs() {
                check("cluster", name, r);
            }
        }
        errors
    }

    /// Inline route tables (validate_clusters defaults to true for them) that name a cluster
    /// the store does not have, for the listeners `check` selects.
    fn check_route_clusters(&self, check: &dyn Fn(&str) -> bool) -> Vec<(String, String)> {
        let mut errors = Vec::new();
        for (name, l) in self.listeners.iter().filter(|(n, _)| check(n)) {
            for chain in &l.value.chains {
                if let Some(RouteSource::Inline(t)) = chain.hcm().map(|h| &h.routes) {
                    if t.validate_clusters != Some(false) {
                        errors.extend(
                            t.unknown_clusters(|c| self.clusters.contains_key(c))
                                .into_iter()
                                .map(|e| (name.clone(), format!("listener '{name}': {e}"))),
                        );
                    }
                }
            }
        }
        errors
    }

    /// Listeners `check` selects whose address another listener already has. The ones it
    /// does not select hold their addresses first, so a push's new listener is the one
    /// refused, as Envoy refuses the listener it is adding.
    fn check_listener_addresses(&self, check: &dyn Fn(&str) -> bool) -> Vec<(String, String)> {
        // Envoy lets several listeners bind port 0 (each gets its own port).
        let addrs = |l: &Item<ListenerProto, ListenerDef>| -> Vec<SocketAddr> {
            l.value
                .bind_addrs()
                .into_iter()
                .map(|b| b.addr)
                .filter(|a| a.port() != 0)
                .collect()
        };
        let mut by_addr: BTreeMap<SocketAddr, &str> = BTreeMap::new();
        let bound = |l: &Item<ListenerProto, ListenerDef>| l.value.bind_to_port;
        for (name, l) in self.listeners.iter().filter(|(n, l)| !check(n) && bound(l)) {
            for a in addrs(l) {
                by_addr.insert(a, name);
            }
        }
        let mut errors = Vec::new();
        for (name, l) in self.listeners.iter().filter(|(n, l)| check(n) && bound(l)) {
            let mine = addrs(l);
            // Every address is checked before any is taken: a refused listener holds none.
            match mine.iter().find_map(|a| by_addr.get(a).map(|o| (a, *o))) {
                Some((a, other)) => errors.push((
                    name.clone(),
                    format!("listener '{name}': duplicate address {a} as listener '{other}'"),
                )),
                None => {
                    for a in mine {
                        by_addr.insert(a, name);
                    }
                }
            }
        }
        errors
    }

    /// (name, version) of every resource of `kind` that xDS delivered: what a delta stream
    /// reports as `initial_resource_versions` when it reconnects.
    pub fn dynamic_versions(&self, kind: Kind) -> Box<dyn Iterator<Item = (&str, &str)> + '_> {
        fn of<P, T>(t: &Table<P, T>) -> Box<dyn Iterator<Item = (&str, &str)> + '_> {
            Box::new(
                t.iter()
                    .filter(|(_, i)| !i.is_static)
                    .map(|(n, i)| (n.as_str(), &*i.version)),
            )
        }
        match kind {
            Kind::Listener => of(&self.listeners),
            Kind::Route => of(&self.routes),
            Kind::Cluster => of(&self.clusters),
            Kind::Endpoint => of(&self.endpoints),
            Kind::Secret => of(&self.secrets),
        }
    }

    /// Route configuration names the listeners ask for.
    pub fn wanted_routes(&self) -> BTreeSet<String> {
        self.listeners
            .values()
            .flat_map(|l| l.value.chains.iter())
            .filter_map(|c| match c.hcm().map(|h| &h.routes) {
                Some(RouteSource::Rds(n)) => Some(n.clone()),
                Some(RouteSource::Inline(_)) | None => None,
            })
            .collect()
    }

    /// Every SDS secret the listeners' TLS chains and the clusters' sockets ask for.
    pub fn sds_refs(&self) -> impl Iterator<Item = &SdsRef> {
        let listeners = self
            .listeners
            .values()
            .flat_map(|l| l.value.chains.iter())
            .filter_map(|c| c.tls.as_ref())
            .flat_map(|t| t.sds_refs());
        let clusters = self
            .clusters
            .values()
            .flat_map(|c| c.value.transport.sds_refs());
        listeners.chain(clusters)
    }

    /// SDS secret names asked for over ADS.
    pub fn wanted_secrets(&self) -> BTreeSet<String> {
        self.wanted_from(&SdsSource::Ads)
    }

    fn wanted_from(&self, source: &SdsSource) -> BTreeSet<String> {
        self.sds_refs()
            .filter(|r| &r.source == source)
            .map(|r| r.name.clone())
            .collect()
    }

    /// SDS secret names asked for from each SDS cluster source.
    pub fn wanted_sds(&self) -> BTreeMap<Arc<SdsCluster>, BTreeSet<String>> {
        let mut out: BTreeMap<Arc<SdsCluster>, BTreeSet<String>> = BTreeMap::new();
        for r in self.sds_refs() {
            if let Some(c) = r.cluster() {
                out.entry(c.clone()).or_default().insert(r.name.clone());
            }
        }
        out
    }

    /// ClusterLoadAssignment names the EDS clusters ask for.
    pub fn wanted_endpoints(&self) -> BTreeSet<String> {
        self.eds_users.keys().cloned().collect()
    }

    /// Whether an EDS cluster is still waiting for its first ClusterLoadAssignment.
    pub fn has_warming_clusters(&self) -> bool {
        self.eds_users
            .keys()
            .any(|name| !self.endpoints.contains_key(name))
    }

    /// DNS clusters whose hosts need resolving: (cluster name, hostnames).
    pub fn dns_clusters(&self) -> Vec<Arc<ClusterDef>> {
        self.clusters
            .values()
            .filter(|c| {
                matches!(
                    c.value.kind,
                    DiscoveryKind::StrictDns | DiscoveryKind::LogicalDns
                )
            })
            .map(|c| c.value.clone())
            .collect()
    }

    /// Endpoints that are IP literals need no resolver: fill them in now.
    fn resolve_literal_endpoints(&mut self) {
        let mut resolved = imbl::OrdMap::new();
        for (name, c) in self.clusters.iter() {
            let Some(spec) = &c.value.inline else {
                continue;
            };
            let literal = spec
                .endpoints
                .iter()
                .all(|e| e.host.parse::<std::net::IpAddr>().is_ok());
            if literal {
                // Keep the previous Arc when the endpoints are the same, so the cluster is reused.
                let la = match self.resolved.get(name) {
                    Some(prev) if same_hosts(prev, spec) => prev.clone(),
                    _ => Arc::new(LoadAssignment::from_resolved(spec, |h| h.parse().ok())),
                };
                resolved.insert(name.clone(), la);
            } else if let Some(prev) = self.resolved.get(name) {
                resolved.insert(name.clone(), prev.clone());
            }
        }
        self.resolved = resolved;
    }

    /// Drops route configs and endpoints nothing refers to any more.
    fn collect_garbage(&mut self) {
        // Only stale names are removed, so the tables keep sharing their nodes with the
        // previous store (a rebuild copied every entry on every LDS and CDS push).
        let routes = self.wanted_routes();
        let stale: Vec<String> = self
            .routes
            .keys()
            .filter(|k| !routes.contains(*k))
            .cloned()
            .collect();
        for k in &stale {
            self.routes.remove(k);
        }
        let secrets: BTreeSet<&str> = self.sds_refs().map(|r| r.name.as_str()).collect();
        let stale: Vec<String> = self
            .secrets
            .keys()
            .filter(|k| !secrets.contains(k.as_str()))
            .cloned()
            .collect();
        for k in &stale {
            self.secrets.remove(k);
        }
        let stale: Vec<String> = self
            .endpoints
            .keys()
            .filter(|k| !self.eds_users.contains_key(*k))
            .cloned()
            .collect();
        for k in &stale {
            self.endpoints.remove(k);
        }
    }

    /// Builds the snapshot from the store, the serving snapshot and what `live` says of the
    /// clusters' hosts (the only live state it sees). Anything unchanged since `prev` is shared, not rebuilt. A cluster
    /// whose endpoints have not arrived, or a listener whose routes have not, is warming: the
    /// previous version keeps serving if there is one, otherwise it is not routable yet.
    pub fn assemble(&self, prev: &Snapshot, version: u64, live: &dyn LiveClusters) -> Snapshot {
        let lookup = self.secret_lookup();
        let build = |name: &str, def: &Arc<ClusterDef>| {
            let mut endpoints = self.cluster_endpoints(name, def);
            let old = prev.clusters.get(name);
            // Sockets built from SDS secrets: the cluster warms until they are in, as Envoy
            // warms a cluster on its secrets, and keeps the built ones while they are unchanged.
            let sockets = if def.transport.needs_sds() {
                let same = old.filter(|o| {
                    Arc::ptr_eq(&o.def, def) && {
                        let now: Vec<Option<Arc<SecretDef>>> = def
                            .transport
                            .sds_refs()
                            .map(|r| lookup(r).map(|(d, _)| d))
                            .collect();
                        now.len() == o.sockets.secrets.len()
                            && now
                                .iter()
                                .zip(&o.sockets.secrets)
                                .all(|(a, b)| a.as_ref().is_some_and(|a| Arc::ptr_eq(a, b)))
                    }
                });
                match same {
                    Some(o) => Some(o.sockets.clone()),
                    None => match def.transport.resolve(&lookup) {
                        Ok(r) => r.map(Arc::new),
                        Err(e) => {
                            tracing::warn!(cluster = %name, "cannot build the TLS sockets: {e}");
                            None
                        }
                    },
                }
            } else {
                Some(no_sds_sockets())
            };
            if sockets.is_none() {
                endpoints = None;
            }
            // With health checks: warming until the first round is done, and rebuilt when a
            // check changes a host's health.
            let hc_generation = match &def.health_check {
                Some(_) => match live.health_round(name, def) {
                    Some(g) => g,
                    None => {
                        endpoints = None;
                        0
                    }
                },
                None => 0,
            };
            match (endpoints, old, sockets) {
                (Some(eps), Some(old), Some(sockets))
                    if Arc::ptr_eq(&old.def, def)
                        && Arc::ptr_eq(&old.endpoints, &eps)
                        && old.hc_generation == hc_generation
                        && Arc::ptr_eq(&old.sockets, &sockets) =>
                {
                    Some(old.clone())
                }
                (Some(eps), _, Some(sockets)) => {
                    let hosts = live.hosts(name, def, &eps);
                    Some(Arc::new(Cluster::build(
                        def.clone(),
                        eps,
                        live.stats(name),
                        sockets,
                        hosts,
                    )))
                }
                (_, Some(old), _) => Some(old.clone()),
                (_, None, _) => None,
            }
        };
        let clusters = if self.touched.all_clusters {
            let mut clusters = crate::snapshot::ClusterMap::default();
            for (name, item) in self.clusters.iter() {
                if let Some(c) = build(name, &item.value) {
                    clusters.insert(item.value.name.clone(), c);
                }
            }
            clusters
        } else {
            // Only the clusters whose endpoints were pushed; the rest is shared as it was.
            let mut clusters = prev.clusters.clone();
            for eds_name in &self.touched.endpoints {
                for name in self.eds_users.get(eds_name).into_iter().flatten() {
                    let Some(item) = self.clusters.get(name) else {
                        continue;
                    };
                    if let Some(c) = build(name, &item.value) {
                        clusters.insert(item.value.name.clone(), c);
                    }
                }
            }
            let by_secret = self
                .touched
                .secrets
                .iter()
                .flat_map(|s| self.sds_users.get(s).into_iter().flatten());
            for name in self.touched.health.iter().chain(by_secret) {
                if let Some(item) = self.clusters.get(name) {
                    if let Some(c) = build(name, &item.value) {
                        clusters.insert(item.value.name.clone(), c);
                    }
                }
            }
            clusters
        };
        let mut listeners =
            HashMap::with_capacity_and_hasher(self.listeners.len(), Default::default());
        for (name, item) in self.listeners.iter() {
            let def = &item.value;
            let old = prev.listeners.get(name);
            let active = match (self.active_chains(def, old.map(|o| &**o)), old) {
                (Some(chains), Some(old))
                    if Arc::ptr_eq(&old.def, def)
                        && old.chains.len() == chains.len()
                        && old
                            .chains
                            .iter()
                            .zip(&chains)
                            .all(|(a, b)| Arc::ptr_eq(a, b)) =>
                {
                    old.clone()
                }
                (Some(chains), _) => Arc::new(ActiveListener {
                    def: def.clone(),
                    chains,
                }),
                // Only a listener at the same address may keep serving its old routes.
                (None, Some(old)) if old.def.same_addresses(def) => old.clone(),
                (None, _) => continue,
            };
            listeners.insert(name.clone(), active);
        }
        Snapshot {
            version,
            listeners,
            clusters,
        }
    }

    /// Every chain of `def` resolved (routes, and the certificate of TLS chains), reusing the
    /// previous chain where nothing changed; None while any chain is still warming, as Envoy
    /// keeps a whole listener warming until every dependency has arrived.
    fn active_chains(
        &self,
        def: &Arc<ListenerDef>,
        old: Option<&ActiveListener>,
    ) -> Option<Vec<Arc<ActiveChain>>> {
        let mut out = Vec::with_capacity(def.chains.len());
        for (i, chain) in def.chains.iter().enumerate() {
            let routes = match chain.hcm().map(|h| &h.routes) {
                Some(RouteSource::Inline(t)) => t.clone(),
                Some(RouteSource::Rds(n)) => self.routes.get(n)?.value.clone(),
                // A tcp_proxy chain routes nothing; like Envoy it does not wait for its
                // clusters either (a missing one closes connections until it arrives).
                None => empty_routes(),
            };
            let prev = old
                .filter(|o| Arc::ptr_eq(&o.def, def))
                .and_then(|o| o.chains.get(i));
            let (tls, secrets) = match &chain.tls {
                None => (None, Vec::new()),
                Some(t) => {
                    let (server, secrets) = self.tls_server(t, prev.map(|p| &**p))?;
                    (Some(server), secrets)
                }
            };
            let same = |p: &&Arc<ActiveChain>| {
                Arc::ptr_eq(&p.routes, &routes)
                    && match (&p.tls, &tls) {
                        (None, None) => true,
                        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                        _ => false,
                    }
            };
            out.push(match prev.filter(same) {
                Some(p) => p.clone(),
                None => Arc::new(ActiveChain {
                    def: chain.clone(),
                    routes,
                    tls,
                    secrets,
                }),
            });
        }
        Some(out)
    }

    /// The handshake configs of a TLS chain once its certificate is known (None: warming),
    /// and the secret they were built from. The previous chain's configs are reused while its
    /// secret is unchanged, so a push of something else builds no rustls config.
    fn tls_server(
        &self,
        t: &DownstreamTls,
        prev: Option<&ActiveChain>,
    ) -> Option<(Arc<TlsServer>, Vec<Arc<SecretDef>>)> {
        if let Some(inline) = &t.inline_config {
            return Some((inline.clone(), Vec::new()));
        }
        let mut secrets = Vec::new();
        let certs = match &t.cert {
            CertSource::Inline(certs) => certs.clone(),
            CertSource::Sds(refs) => {
                let mut certs = Vec::with_capacity(refs.len());
                for r in refs {
                    let secret = self.secrets.get(&r.name)?.value.clone();
                    certs.push(secret.cert.clone()?);
                    secrets.push(secret);
                }
                certs
            }
        };
        let validation = match &t.validation {
            ClientValidation::None => None,
            ClientValidation::Inline(v) => Some(Ok(v.clone())),
            ClientValidation::Sds { sds, default } => {
                let name = &sds.name;
                let secret = self.secrets.get(name)?.value.clone();
                let vc = secret.validation.clone()?;
                secrets.push(secret);
                Some(Err((name, default, vc)))
            }
        };
        if let Some(p) = prev {
            if let Some(tls) = &p.tls {
                let same = p.secrets.len() == secrets.len()
                    && p.secrets
                        .iter()
                        .zip(&secrets)
                        .all(|(a, b)| Arc::ptr_eq(a, b));
                if same {
                    return Some((tls.clone(), secrets));
                }
            }
        }
        let validation = match validation {
            None => None,
            Some(Ok(v)) => Some(v),
            Some(Err((name, default, vc))) => {
                match crate::snapshot::tls::sds_validation(default.as_deref(), &vc) {
                    Ok(v) => Some(v),
                    Err(e) => {
                        tracing::warn!(secret = %name, "cannot use the validation context: {e}");
                        return None;
                    }
                }
            }
        };
        match t.server(certs, validation) {
            Ok(server) => Some((server, secrets)),
            Err(e) => {
                tracing::warn!("cannot build the TLS config: {e}");
                None
            }
        }
    }

    /// The endpoints a cluster is built from, once they are known.
    pub fn cluster_endpoints(&self, name: &str, def: &ClusterDef) -> Option<Arc<LoadAssignment>> {
        match def.kind {
            DiscoveryKind::Eds => self.endpoints.get(&def.eds_name).map(|e| e.value.clone()),
            _ => self.resolved.get(name).cloned(),
        }
    }

    /// The addresses to bind: a `bind_to_port: false` listener has none (Envoy neither binds
    /// it nor lets its address conflict with another listener's).
    pub fn listener_addrs(&self) -> BTreeMap<String, Vec<ListenAddr>> {
        self.listeners
            .iter()
            .filter(|(_, v)| v.value.bind_to_port)
            .map(|(k, v)| (k.clone(), v.value.bind_addrs()))
            .collect()
    }
}

fn same_hosts(la: &LoadAssignment, spec: &crate::snapshot::cluster::LoadAssignmentSpec) -> bool {
    la.locality_weights == spec.locality_weights
        && la.policy == spec.policy
        && la.hosts.len() == spec.endpoints.len()
        && la.hosts.iter().zip(&spec.endpoints).all(|(h, e)| {
            h.addr.ip().to_string() == e.host
                && h.addr.port() == e.port
                && h.weight == e.weight
                && h.health == e.health
                && h.priority == e.priority
                && h.locality == e.locality
                && h.hostname == e.hostname
        })
}

fn static_item<P: prost::Message + prost::Name + Default, T>(
    proto: P,
    value: T,
    now: SystemTime,
) -> Item<P, T> {
    Item {
        proto: Raw::encode(&proto),
        value: Arc::new(value),
        version: Arc::from(""),
        last_updated: now,
        is_static: true,
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod store_tests;

/// The sockets of every cluster that needs no SDS secret: one shared value, so an unchanged
/// cluster compares equal across pushes.
fn no_sds_sockets() -> Arc<Resolved> {
    static EMPTY: std::sync::OnceLock<Arc<Resolved>> = std::sync::OnceLock::new();
    EMPTY.get_or_init(|| Arc::new(Resolved::default())).clone()
}

/// One shared empty table, so an unchanged tcp_proxy chain compares equal across pushes.
fn empty_routes() -> Arc<RouteTable> {
    static EMPTY: std::sync::OnceLock<Arc<RouteTable>> = std::sync::OnceLock::new();
    EMPTY.get_or_init(|| Arc::new(RouteTable::empty())).clone()
}
