//! The Istio metrics: labelled counters and histograms kept per label set ("series"), found
//! on the request path without a lock and, once a series exists, without allocating; rendered
//! for `/stats/prometheus` as istio-proxy's Envoy renders them (its `istiocustom` stat
//! namespace, which Envoy's Prometheus output shows without the `envoy_` prefix) and for
//! `/stats` under Envoy's name for a tagged stat (`istiocustom.<metric>.<tag>.<value>...`).
//!
//! Series are found by a hash of their label names and values in an immutable map per shard
//! (`ArcSwap` of a persistent `imbl` map): readers load it without locking; a new series is
//! added under the shard's mutex by swapping in a new map (cheap: `imbl` shares structure).

use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

use arc_swap::ArcSwap;

use super::peer::{LocalNode, PeerInfo};
use super::{Attr, Capture, Metric, MetricPlan, Reporter, StatsConfig, Tag};
use crate::telemetry::stream_info::{Protocol, ResponseFlags, StreamInfo, UpstreamInfo};

/// Envoy's default histogram buckets, which are Istio's documented buckets for
/// `istio_request_duration_milliseconds` and the byte histograms.
pub const BUCKETS: [f64; 19] = [
    0.5, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0,
    60000.0, 300000.0, 600000.0, 1800000.0, 3600000.0,
];

/// The most labels one series may carry (25 standard tags plus dimensions added by
/// `metrics` overrides); dimensions beyond it are left out (and a warning logged once).
pub const MAX_LABELS: usize = 40;

const SHARDS: usize = 16;

/// One series: its labels and its value.
#[derive(Debug)]
pub struct Series {
    /// The labels as `Labels::key` encodes them: what a lookup compares, and where the
    /// names and values are read back from (`pairs`).
    key: Box<[u8]>,
    /// `a="b",c="d"`, for Prometheus.
    prom: String,
    value: Value,
}

#[derive(Debug)]
enum Value {
    Counter(AtomicU64),
    Histogram(Histogram),
}

#[derive(Debug)]
struct Histogram {
    /// Not cumulative: `buckets[i]` counts values in (BUCKETS[i-1], BUCKETS[i]]; the last slot
    /// counts values over every bucket.
    buckets: [AtomicU64; BUCKETS.len() + 1],
    sum: AtomicU64,
}

impl Histogram {
    fn new() -> Histogram {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum: AtomicU64::new(0),
        }
    }

    fn record(&self, v: u64) {
        let i = BUCKETS
            .iter()
            .position(|b| v as f64 <= *b)
            .unwrap_or(BUCKETS.len());
        self.buckets[i].fetch_add(1, Relaxed);
        self.sum.fetch_add(v, Relaxed);
    }
}

/// Keyed by the labels' xxh64, used as the map's hash as it is.
type Map = imbl::GenericHashMap<
    u64,
    Vec<Arc<Series>>,
    crate::prehashed::BuildPrehashed,
    imbl::shared_ptr::DefaultSharedPtr,
>;

struct Shard {
    map: ArcSwap<Map>,
    write: Mutex<()>,
}

/// One metric's series.
struct Family {
    metric: Metric,
    shards: Vec<Shard>,
}

impl Family {
    fn new(metric: Metric) -> Family {
        Family {
            metric,
            shards: (0..SHARDS)
                .map(|_| Shard {
                    map: ArcSwap::from_pointee(Map::default()),
                    write: Mutex::new(()),
                })
                .collect(),
        }
    }

    /// The series for these labels (`key`: `Labels::key`, `h` its hash), made on first use.
    fn series(&self, labels: &Labels<'_>, key: &[u8], h: u64) -> Arc<Series> {
        let shard = &self.shards[(h as usize) % SHARDS];
        if let Some(s) = find(&shard.map.load(), h, key) {
            return s;
        }
        let _w = shard.write.lock().unwrap_or_else(|p| p.into_inner());
        let cur = shard.map.load_full();
        if let Some(s) = find(&cur, h, key) {
            return s;
        }
        let s = Arc::new(labels.to_series(key, self.metric.is_histogram()));
        let mut next = (*cur).clone();
        next.entry(h).or_default().push(s.clone());
        shard.map.store(Arc::new(next));
        s
    }

    fn all(&self) -> Vec<Arc<Series>> {
        let mut v: Vec<Arc<Series>> = self
            .shards
            .iter()
            .flat_map(|s| {
                s.map
                    .load()
                    .values()
                    .flat_map(|v| v.iter().cloned())
                    .collect::<Vec<_>>()
            })
            .collect();
        v.sort_by(|a, b| a.prom.cmp(&b.prom));
        v
    }
}

impl Series {
    fn add(&self, v: u64) {
        match &self.value {
            Value::Counter(c) => {
                c.fetch_add(v, Relaxed);
            }
            Value::Histogram(h) => h.record(v),
        }
    }

    /// (name, value) pairs, in order, decoded from the key.
    fn pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        // The key was written from `&str`s, so every piece is UTF-8.
        fn text(b: &[u8]) -> &str {
            std::str::from_utf8(b).unwrap_or_default()
        }
        self.key
            .split(|b| *b == 0xfe)
            .filter(|pair| !pair.is_empty())
            .map(move |pair| match pair.iter().position(|b| *b == 0xff) {
                Some(at) => (text(&pair[..at]), text(&pair[at + 1..])),
                None => (text(pair), ""),
            })
    }
}

fn find(map: &Map, h: u64, key: &[u8]) -> Option<Arc<Series>> {
    map.get(&h)?.iter().find(|s| *s.key == *key).cloned()
}

/// A series' labels as computed for one request: borrowed wherever they can be.
pub struct Labels<'a> {
    names: [&'a str; MAX_LABELS],
    values: [Cow<'a, str>; MAX_LABELS],
    len: usize,
}

impl<'a> Labels<'a> {
    fn new() -> Labels<'a> {
        Labels {
            names: [""; MAX_LABELS],
            values: std::array::from_fn(|_| Cow::Borrowed("")),
            len: 0,
        }
    }

    fn push(&mut self, name: &'a str, value: Cow<'a, str>) {
        if self.len < MAX_LABELS {
            self.names[self.len] = name;
            self.values[self.len] = value;
            self.len += 1;
        }
    }

    /// (name, value) pairs, in order.
    pub fn pairs(&self) -> impl Iterator<Item = (&str, &str)> {
        (0..self.len).map(|i| (self.names[i], &*self.values[i]))
    }

    /// The labels as one buffer: each name and value followed by a byte UTF-8 never holds
    /// (0xff, 0xfe), so equal buffers are equal labels. Hashed once per request and compared
    /// in one go: a request's labels are some 25 pairs of short strings, and xxh64's
    /// streaming update per piece and a comparison per string each cost more than the bytes.
    fn key(&self) -> Vec<u8> {
        let len = self.pairs().map(|(n, v)| n.len() + v.len() + 2).sum();
        let mut buf = Vec::with_capacity(len);
        for (n, v) in self.pairs() {
            buf.extend_from_slice(n.as_bytes());
            buf.push(0xff);
            buf.extend_from_slice(v.as_bytes());
            buf.push(0xfe);
        }
        buf
    }

    fn to_series(&self, key: &[u8], histogram: bool) -> Series {
        let mut prom = String::new();
        for (i, (n, v)) in self.pairs().enumerate() {
            if i > 0 {
                prom.push(',');
            }
            let _ = write!(prom, "{n}=\"{}\"", escape(v));
        }
        Series {
            key: Box::from(key),
            prom,
            value: if histogram {
                Value::Histogram(Histogram::new())
            } else {
                Value::Counter(AtomicU64::new(0))
            },
        }
    }
}

fn escape(s: &str) -> Cow<'_, str> {
    if s.contains(['\\', '"', '\n']) {
        Cow::Owned(
            s.replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n"),
        )
    } else {
        Cow::Borrowed(s)
    }
}

/// Decimal strings of 0..1000, so response codes and gRPC statuses label without allocating.
fn small_number(n: u32) -> Cow<'static, str> {
    static TABLE: OnceLock<Vec<String>> = OnceLock::new();
    let t = TABLE.get_or_init(|| (0..1000).map(|i| i.to_string()).collect());
    match t.get(n as usize) {
        Some(s) => Cow::Borrowed(s.as_str()),
        None => Cow::Owned(n.to_string()),
    }
}

const UNKNOWN: &str = "unknown";

/// `s`, or `unknown` when empty (istio-proxy's `!x.empty() ? x : unknown`).
fn or_unknown(s: &str) -> Cow<'_, str> {
    Cow::Borrowed(if s.is_empty() { UNKNOWN } else { s })
}

/// Clusters istio-proxy names as the destination service themselves.
const SPECIAL_CLUSTERS: [&str; 5] = [
    "BlackHoleCluster",
    "PassthroughCluster",
    "InboundPassthroughCluster",
    "InboundPassthroughClusterIpv4",
    "InboundPassthroughClusterIpv6",
];

/// What one request or connection reports, gathered from its record.
struct View<'a> {
    cfg: &'a StatsConfig,
    node: &'a LocalNode,
    info: &'a StreamInfo,
}

impl<'a> View<'a> {
    fn captured(&self, i: usize) -> Option<&'a str> {
        self.info.istio_attributes.get(i)?.as_deref()
    }

    /// The upstream peer: exchanged metadata, else (the source reporter's fallback) the
    /// endpoint's `istio.workload` metadata.
    fn upstream_peer(&self) -> Option<&'a PeerInfo> {
        self.info
            .peers
            .upstream
            .as_deref()
            .or(match self.cfg.reporter {
                Reporter::Source => self.info.upstream_workload.as_deref(),
                Reporter::Waypoint => None,
            })
    }

    /// istio-proxy's destination service host and name (Host fallback, then the cluster's
    /// `istio` metadata, or the special clusters' own names).
    fn service(&self) -> (Option<&'a str>, Option<&'a str>) {
        let mut host = None;
        let mut name = None;
        if let Some(i) = self.cfg.host_capture {
            if let Some(h) = self.captured(i) {
                host = Some(h);
                name = Some(h);
            }
        }
        match self.info.route_name.as_deref() {
            Some("block_all") => name = Some("BlackHoleCluster"),
            Some("allow_any") => name = Some("PassthroughCluster"),
            _ => {
                if let Some(up) = &self.info.upstream {
                    if SPECIAL_CLUSTERS.contains(&&*up.name) {
                        name = Some(&up.name);
                    } else if let Some(svc) = &up.istio.service {
                        host = Some(&svc.host);
                        name = Some(&svc.name);
                    }
                }
            }
        }
        (
            host.filter(|s| !s.is_empty()),
            name.filter(|s| !s.is_empty()),
        )
    }

    fn standard(&self, t: Tag) -> Cow<'a, str> {
        let node = &self.node.peer;
        let info = self.info;
        match self.cfg.reporter {
            Reporter::Source => {
                let peer = self.upstream_peer();
                let pf = |f: fn(&PeerInfo) -> &str| -> Cow<'a, str> {
                    match peer {
                        Some(p) => or_unknown(f(p)),
                        None => Cow::Borrowed(UNKNOWN),
                    }
                };
                match t {
                    Tag::Reporter => Cow::Borrowed("source"),
                    Tag::SourceWorkload => Cow::Borrowed(&node.workload),
                    Tag::SourceCanonicalService => Cow::Borrowed(&node.canonical_name),
                    Tag::SourceCanonicalRevision => Cow::Borrowed(&node.canonical_revision),
                    Tag::SourceWorkloadNamespace => Cow::Borrowed(&node.namespace),
                    // The local certificate's SAN of the upstream TLS connection: Portico does
                    // not keep it, so `unknown` (as istio-proxy over plain text).
                    Tag::SourcePrincipal => Cow::Borrowed(UNKNOWN),
                    Tag::SourceApp => Cow::Borrowed(&node.app),
                    Tag::SourceVersion => Cow::Borrowed(&node.version),
                    Tag::SourceCluster => Cow::Borrowed(&node.cluster),
                    Tag::DestinationWorkload => pf(|p| &p.workload),
                    Tag::DestinationWorkloadNamespace | Tag::DestinationServiceNamespace => {
                        pf(|p| &p.namespace)
                    }
                    // The upstream certificate's SAN (see SourcePrincipal).
                    Tag::DestinationPrincipal => Cow::Borrowed(UNKNOWN),
                    Tag::DestinationApp => pf(|p| &p.app),
                    Tag::DestinationVersion => pf(|p| &p.version),
                    Tag::DestinationService => or_unknown(self.service().0.unwrap_or("")),
                    Tag::DestinationCanonicalService => pf(|p| &p.canonical_name),
                    Tag::DestinationCanonicalRevision => match peer {
                        Some(p) if !p.canonical_revision.is_empty() => {
                            Cow::Borrowed(&p.canonical_revision)
                        }
                        _ => Cow::Borrowed("latest"),
                    },
                    Tag::DestinationServiceName => or_unknown(self.service().1.unwrap_or("")),
                    Tag::DestinationCluster => pf(|p| &p.cluster),
                    _ => self.common(t),
                }
            }
            Reporter::Waypoint => {
                let down = info.peers.downstream.as_deref();
                let up = info.peers.upstream.as_deref();
                let peer_san = info.downstream_peer_uri_san.as_deref().unwrap_or("");
                let df = |f: fn(&PeerInfo) -> &str| -> Cow<'a, str> {
                    match down {
                        Some(p) => or_unknown(f(p)),
                        None => Cow::Borrowed(UNKNOWN),
                    }
                };
                let canonical = up.map_or(UNKNOWN, |p| p.canonical_name.as_str());
                match t {
                    Tag::Reporter => Cow::Borrowed("waypoint"),
                    Tag::SourceWorkload => df(|p| &p.workload),
                    Tag::SourceCanonicalService => df(|p| &p.canonical_name),
                    Tag::SourceCanonicalRevision => match down {
                        Some(p) if !p.canonical_revision.is_empty() => {
                            Cow::Borrowed(&p.canonical_revision)
                        }
                        _ => Cow::Borrowed("latest"),
                    },
                    Tag::SourceWorkloadNamespace => {
                        match namespace_of(peer_san).or(down.map(|p| p.namespace.as_str())) {
                            Some(ns) => or_unknown(ns),
                            None => Cow::Borrowed(UNKNOWN),
                        }
                    }
                    Tag::SourcePrincipal => or_unknown(peer_san),
                    Tag::SourceApp => df(|p| &p.app),
                    Tag::SourceVersion => df(|p| &p.version),
                    Tag::SourceCluster => df(|p| &p.cluster),
                    Tag::DestinationWorkload => Cow::Borrowed(up.map_or(UNKNOWN, |p| &p.workload)),
                    Tag::DestinationWorkloadNamespace => match up {
                        Some(p) => or_unknown(&p.namespace),
                        None => Cow::Borrowed(UNKNOWN),
                    },
                    Tag::DestinationPrincipal => Cow::Borrowed(up.map_or(UNKNOWN, |p| &p.identity)),
                    Tag::DestinationApp => match up {
                        Some(p) => or_unknown(&p.app),
                        None => Cow::Borrowed(UNKNOWN),
                    },
                    Tag::DestinationVersion => Cow::Borrowed(up.map_or(UNKNOWN, |p| &p.version)),
                    Tag::DestinationService => Cow::Borrowed(self.service().0.unwrap_or(canonical)),
                    Tag::DestinationCanonicalService => Cow::Borrowed(canonical),
                    Tag::DestinationCanonicalRevision => {
                        Cow::Borrowed(up.map_or(UNKNOWN, |p| &p.canonical_revision))
                    }
                    Tag::DestinationServiceName => {
                        Cow::Borrowed(self.service().1.unwrap_or(canonical))
                    }
                    Tag::DestinationServiceNamespace => Cow::Borrowed(&node.namespace),
                    Tag::DestinationCluster => Cow::Borrowed(&node.cluster),
                    _ => self.common(t),
                }
            }
        }
    }

    /// The protocol, code and flag tags, the same for every reporter.
    fn common(&self, t: Tag) -> Cow<'a, str> {
        let info = self.info;
        match t {
            Tag::RequestProtocol => Cow::Borrowed(match (info.protocol, info.grpc_request) {
                (Protocol::Tcp, _) => "tcp",
                (_, true) => "grpc",
                (_, false) => "http",
            }),
            Tag::ResponseCode => small_number(u32::from(info.response_code)),
            Tag::GrpcResponseStatus => match (info.grpc_request, info.grpc_status) {
                (true, Some(s)) => small_number(s),
                _ => Cow::Borrowed(""),
            },
            Tag::ResponseFlags => info.flags.short_string(),
            Tag::ConnectionSecurityPolicy => Cow::Borrowed(match self.cfg.reporter {
                // istio-proxy only knows it on the server side.
                Reporter::Source => UNKNOWN,
                Reporter::Waypoint => {
                    if info.downstream_peer_uri_san.is_some() {
                        "mutual_tls"
                    } else {
                        "none"
                    }
                }
            }),
            _ => Cow::Borrowed(UNKNOWN),
        }
    }

    fn attr(&self, a: &'a Attr) -> Cow<'a, str> {
        let info = self.info;
        let s: Option<Cow<'a, str>> = match a {
            Attr::Literal(s) => Some(Cow::Borrowed(s)),
            Attr::Request(i) => self.captured(*i).map(Cow::Borrowed),
            Attr::ResponseCode => Some(small_number(u32::from(info.response_code))),
            Attr::GrpcStatus => info.grpc_status.map(small_number),
            Attr::CodeDetails => Some(Cow::Borrowed(&info.response_code_details)),
            Attr::NodeId => Some(Cow::Borrowed(&self.node.id)),
            Attr::NodeCluster => Some(Cow::Borrowed(&self.node.cluster)),
            Attr::NodeMetadata(k) => self.node.metadata(k).map(Cow::Borrowed),
            Attr::UpstreamPeer(f) => self.upstream_peer().map(|p| Cow::Borrowed(f.get(p))),
            Attr::DownstreamPeer(f) => info
                .peers
                .downstream
                .as_deref()
                .map(|p| Cow::Borrowed(f.get(p))),
            Attr::ClusterName => info.upstream.as_ref().map(|u| Cow::Borrowed(&*u.name)),
            Attr::RouteName => info.route_name.as_deref().map(Cow::Borrowed),
            Attr::Sni => info.requested_server_name.as_deref().map(Cow::Borrowed),
            Attr::Mtls => Some(Cow::Borrowed(if info.downstream_peer_uri_san.is_some() {
                "true"
            } else {
                "false"
            })),
            Attr::SourceAddress => info.downstream_remote.map(|a| Cow::Owned(a.to_string())),
            Attr::DestinationAddress => info.downstream_local.map(|a| Cow::Owned(a.to_string())),
            Attr::UpstreamAddress => info.upstream_host.map(|a| Cow::Owned(a.to_string())),
            Attr::Unknown => None,
        };
        // An attribute that is absent is a CEL error: istio-proxy labels it `unknown`.
        s.unwrap_or(Cow::Borrowed(UNKNOWN))
    }

    /// The metric's labels: the standard tags in istio-proxy's order with the overrides
    /// applied, then the added dimensions.
    fn labels(&self, plan: &'a MetricPlan, tags: &[Tag]) -> Labels<'a> {
        let mut l = Labels::new();
        for t in tags {
            match plan.overrides.iter().find(|(k, _)| k == t) {
                Some((_, None)) => {}
                Some((_, Some(a))) => l.push(t.name(), self.attr(a)),
                None => l.push(t.name(), self.standard(*t)),
            }
        }
        for (name, a) in &plan.additions {
            l.push(name, self.attr(a));
        }
        l
    }
}

/// istio-proxy's `getNamespace`: `<domain>/ns/<namespace>/sa/<account>`.
fn namespace_of(principal: &str) -> Option<&str> {
    let i = principal.find("/ns/")? + 4;
    let rest = &principal[i..];
    Some(rest.split('/').next().unwrap_or(rest))
}

thread_local! {
    static MEMO: std::cell::RefCell<Option<Memo>> = const { std::cell::RefCell::new(None) };
}

/// The series the last HTTP request on this thread was counted in, with what their labels
/// were made of. A gateway's requests mostly repeat one label set (same route, cluster,
/// upstream peer, code, flags), and making it (some 25 labels, their key, its hash) and
/// finding the four metrics' series in it cost about 7k instructions a request. Kept only
/// for plans without overrides or added dimensions: their labels (`View::standard`) read
/// nothing but what is held here. Shared values are held (not only their addresses), so
/// an address is never taken for a value that replaced a freed one; the node, which lives
/// beside the store, by address.
struct Memo {
    store: u64,
    cfg: Arc<StatsConfig>,
    node: usize,
    upstream_peer: Option<Arc<PeerInfo>>,
    downstream_peer: Option<Arc<PeerInfo>>,
    upstream_workload: Option<Arc<PeerInfo>>,
    upstream: Option<Arc<UpstreamInfo>>,
    route_name: Option<Arc<str>>,
    host: Option<String>,
    peer_san: Option<Arc<str>>,
    protocol: Protocol,
    grpc_request: bool,
    response_code: u16,
    grpc_status: Option<u32>,
    flags: ResponseFlags,
    series: [Option<Arc<Series>>; 4],
}

fn same<T: ?Sized>(a: &Option<Arc<T>>, b: &Option<Arc<T>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

/// The Host the request path kept for `destination_service`, when the config reads it.
fn captured_host<'a>(cfg: &StatsConfig, info: &'a StreamInfo) -> Option<&'a str> {
    cfg.host_capture
        .and_then(|i| info.istio_attributes.get(i))
        .and_then(|h| h.as_deref())
}

impl Memo {
    fn of(
        store: u64,
        cfg: &Arc<StatsConfig>,
        node: &LocalNode,
        info: &StreamInfo,
        series: [Option<Arc<Series>>; 4],
    ) -> Memo {
        Memo {
            store,
            cfg: cfg.clone(),
            node: node as *const LocalNode as usize,
            upstream_peer: info.peers.upstream.clone(),
            downstream_peer: info.peers.downstream.clone(),
            upstream_workload: info.upstream_workload.clone(),
            upstream: info.upstream.clone(),
            route_name: info.route_name.clone(),
            host: captured_host(cfg, info).map(str::to_string),
            peer_san: info.downstream_peer_uri_san.clone(),
            protocol: info.protocol,
            grpc_request: info.grpc_request,
            response_code: info.response_code,
            grpc_status: info.grpc_status,
            flags: info.flags,
            series,
        }
    }

    /// Whether this request's labels are the memo's: every input of `View::standard` equal.
    fn serves(
        &self,
        store: u64,
        cfg: &Arc<StatsConfig>,
        node: &LocalNode,
        info: &StreamInfo,
    ) -> bool {
        self.store == store
            && Arc::ptr_eq(&self.cfg, cfg)
            && self.node == node as *const LocalNode as usize
            && self.response_code == info.response_code
            && self.flags == info.flags
            && self.protocol == info.protocol
            && self.grpc_request == info.grpc_request
            && self.grpc_status == info.grpc_status
            && same(&self.upstream_peer, &info.peers.upstream)
            && same(&self.downstream_peer, &info.peers.downstream)
            && same(&self.upstream_workload, &info.upstream_workload)
            && same(&self.upstream, &info.upstream)
            && self.route_name == info.route_name
            && self.peer_san == info.downstream_peer_uri_san
            && self.host.as_deref() == captured_host(cfg, info)
    }
}

/// Every Istio metric of the process, whichever listener reported it (Envoy keeps them in one
/// stats store too: two listeners reporting the same labels add to the same series).
pub struct Store {
    /// Unique in the process: what a thread's `Memo` was made for (an address could be
    /// reused by the next store).
    id: u64,
    families: Vec<Family>,
    /// `istio_build{component="proxy",tag=<ISTIO_VERSION>}`: set once an `istio.stats` filter
    /// is configured, as istio-proxy's filter factory sets it.
    build: AtomicU64,
}

impl Default for Store {
    fn default() -> Self {
        Store::new()
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

impl Store {
    pub fn new() -> Store {
        static IDS: AtomicU64 = AtomicU64::new(0);
        Store {
            id: IDS.fetch_add(1, Relaxed),
            families: Metric::ALL.iter().map(|m| Family::new(*m)).collect(),
            build: AtomicU64::new(0),
        }
    }

    fn family(&self, m: Metric) -> &Family {
        &self.families[m as usize]
    }

    /// An `istio.stats` filter is configured: the `istio_build` gauge shows.
    pub fn configured(&self) {
        self.build.store(1, Relaxed);
    }

    /// Adds `v` to each metric of `ms` (all with the same tag list), and hands back the series
    /// added to (None: the metric is dropped). Metrics whose plans are the same (the usual
    /// case: no overrides) share one computation of the labels.
    fn add<const N: usize>(
        &self,
        view: &View<'_>,
        ms: &[(Metric, u64); N],
        tags: &[Tag],
    ) -> [Option<Arc<Series>>; N] {
        let mut found = [const { None }; N];
        let mut last: Option<(&MetricPlan, Labels<'_>, Vec<u8>, u64)> = None;
        for (slot, &(m, v)) in found.iter_mut().zip(ms) {
            let plan = view.cfg.plan(m);
            if plan.drop {
                continue;
            }
            if last.as_ref().is_none_or(|(p, ..)| *p != plan) {
                let labels = view.labels(plan, tags);
                let key = labels.key();
                let h = xxhash_rust::xxh64::xxh64(&key, 0);
                last = Some((plan, labels, key, h));
            }
            let Some((_, labels, key, h)) = &last else {
                continue;
            };
            let s = self.family(m).series(labels, key, *h);
            s.add(v);
            *slot = Some(s);
        }
        found
    }

    /// One HTTP request is over: `istio_requests_total` and the three histograms.
    pub fn record_http(&self, cfg: &Arc<StatsConfig>, node: &LocalNode, info: &StreamInfo) {
        self.record_http_with(cfg, node, info, true);
    }

    /// `record_http`, with the thread's `Memo` (`memo`) or without (the tests' reference).
    pub(super) fn record_http_with(
        &self,
        cfg: &Arc<StatsConfig>,
        node: &LocalNode,
        info: &StreamInfo,
        memo: bool,
    ) {
        let view = View { cfg, node, info };
        // istio-proxy counts a gRPC call's messages (the grpc_stats filter state) first, with
        // the peer tags only.
        if let (true, Some((req, resp))) = (info.grpc_request, info.grpc_messages) {
            self.add(
                &view,
                &[
                    (Metric::RequestMessages, req),
                    (Metric::ResponseMessages, resp),
                ],
                &Tag::PEERS,
            );
        }
        let ms = info.duration().as_millis() as u64;
        // Envoy's wire byte meters: heads and bodies.
        let rx = info.request_head_bytes + info.bytes_received;
        let tx = info.response_head_bytes + info.bytes_sent;
        let values = [
            (Metric::RequestsTotal, 1),
            (Metric::RequestDuration, ms),
            (Metric::RequestBytes, rx),
            (Metric::ResponseBytes, tx),
        ];
        let standard = values.iter().all(|(m, _)| {
            let p = cfg.plan(*m);
            p.overrides.is_empty() && p.additions.is_empty()
        });
        if !(memo && standard) {
            self.add(&view, &values, &Tag::HTTP);
            return;
        }
        MEMO.with_borrow_mut(|last| {
            if let Some(m) = last.as_ref().filter(|m| m.serves(self.id, cfg, node, info)) {
                for (s, (_, v)) in m.series.iter().zip(values) {
                    if let Some(s) = s {
                        s.add(v);
                    }
                }
                return;
            }
            let series = self.add(&view, &values, &Tag::HTTP);
            *last = Some(Memo::of(self.id, cfg, node, info, series));
        });
    }

    /// A TCP connection is over. istio-proxy reports a connection's open counter and bytes
    /// once the peer's metadata is known (TCP metadata exchange, which Portico does not speak)
    /// or when it closes: without the exchange everything is reported at the close.
    pub fn record_tcp(&self, cfg: &StatsConfig, node: &LocalNode, info: &StreamInfo) {
        let view = View { cfg, node, info };
        self.add(
            &view,
            &[
                (Metric::TcpOpened, 1),
                (Metric::TcpSent, info.bytes_sent),
                (Metric::TcpReceived, info.bytes_received),
                (Metric::TcpClosed, 1),
            ],
            &Tag::TCP,
        );
    }

    /// Counters and the build gauge as (kind is counter, Envoy's dotted name, metric, labels,
    /// value), for the admin's stat list.
    pub fn collect(
        &self,
        node: &LocalNode,
        out: &mut dyn FnMut(bool, String, String, String, u64),
    ) {
        if self.build.load(Relaxed) != 0 {
            let tag = if node.istio_version.is_empty() {
                UNKNOWN
            } else {
                &node.istio_version
            };
            out(
                false,
                format!("istiocustom.istio_build.component.proxy.tag.{tag}"),
                "istio_build".into(),
                format!("component=\"proxy\",tag=\"{}\"", escape(tag)),
                1,
            );
        }
        for f in &self.families {
            if f.metric.is_histogram() {
                continue;
            }
            for s in f.all() {
                let Value::Counter(c) = &s.value else {
                    continue;
                };
                out(
                    true,
                    dotted(f.metric.name(), &s),
                    f.metric.name().to_string(),
                    s.prom.clone(),
                    c.load(Relaxed),
                );
            }
        }
    }

    /// The histograms in Prometheus text, as Envoy writes them after its counters and gauges:
    /// cumulative `_bucket` lines with `le`, then `_sum` and `_count`.
    pub fn prometheus_histograms(&self, out: &mut String) {
        // Envoy lists families by name.
        let mut families: Vec<&Family> = self.families.iter().collect();
        families.sort_by_key(|f| f.metric.name());
        for f in families {
            if !f.metric.is_histogram() {
                continue;
            }
            let all = f.all();
            if all.is_empty() {
                continue;
            }
            let name = f.metric.name();
            let _ = writeln!(out, "# TYPE {name} histogram");
            for s in all {
                let Value::Histogram(h) = &s.value else {
                    continue;
                };
                let sep = if s.prom.is_empty() { "" } else { "," };
                let mut cum = 0;
                for (i, b) in BUCKETS.iter().enumerate() {
                    cum += h.buckets[i].load(Relaxed);
                    let _ = writeln!(out, "{name}_bucket{{{}{sep}le=\"{b}\"}} {cum}", s.prom);
                }
                cum += h.buckets[BUCKETS.len()].load(Relaxed);
                let _ = writeln!(out, "{name}_bucket{{{}{sep}le=\"+Inf\"}} {cum}", s.prom);
                let _ = writeln!(out, "{name}_sum{{{}}} {}", s.prom, h.sum.load(Relaxed));
                let _ = writeln!(out, "{name}_count{{{}}} {cum}", s.prom);
            }
        }
    }

    /// Samples of one metric for tests and tools: (labels, counter value or histogram count).
    pub fn samples(&self, m: Metric) -> Vec<(Vec<(String, String)>, u64)> {
        self.family(m)
            .all()
            .iter()
            .map(|s| {
                let labels = s
                    .pairs()
                    .map(|(n, v)| (n.to_string(), v.to_string()))
                    .collect();
                let v = match &s.value {
                    Value::Counter(c) => c.load(Relaxed),
                    Value::Histogram(h) => h.buckets.iter().map(|b| b.load(Relaxed)).sum(),
                };
                (labels, v)
            })
            .collect()
    }
}

/// Envoy's name for a tagged stat: the metric in the `istiocustom` namespace, then each tag's
/// name and value.
fn dotted(metric: &str, s: &Series) -> String {
    let mut d = format!("istiocustom.{metric}");
    for (n, v) in s.pairs() {
        d.push('.');
        d.push_str(n);
        d.push('.');
        d.push_str(v);
    }
    d
}

/// What the request path captures for a config's dimensions: the values of `captures` read
/// from the request, into `StreamInfo::istio_attributes`.
pub fn capture(
    cfg: &StatsConfig,
    host: &str,
    method: &str,
    path_and_query: &str,
    scheme: &str,
    header: &dyn Fn(&http::HeaderName) -> Option<String>,
) -> Vec<Option<String>> {
    cfg.captures
        .iter()
        .map(|c| match c {
            Capture::Host => Some(host.to_string()),
            Capture::Method => Some(method.to_string()),
            Capture::Path => Some(path_and_query.to_string()),
            Capture::UrlPath => Some(
                path_and_query
                    .split_once('?')
                    .map_or(path_and_query, |(p, _)| p)
                    .to_string(),
            ),
            Capture::Scheme => Some(scheme.to_string()),
            Capture::Header(h) => header(h),
        })
        .collect()
}
