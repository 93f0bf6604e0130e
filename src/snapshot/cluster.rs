//! Clusters (CDS) and their endpoints (EDS, or a static `load_assignment`).

use std::net::SocketAddr;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3 as cpb;
use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::config::endpoint::v3 as epb;

use super::load::{LoadPolicy, Plan, Pool};
use super::{duration, socket_address, TranslateError};
use crate::lb::{Balancer, Eligible, HashFunction, Policy};
use crate::live::ClusterStats;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiscoveryKind {
    Static,
    StrictDns,
    LogicalDns,
    Eds,
    /// ORIGINAL_DST: no endpoints; each request names its host (see `OriginalDst`).
    OriginalDst,
}

/// An ORIGINAL_DST cluster's `original_dst_lb_config`, as Envoy's original_dst cluster reads
/// it: the host is the request's header when `use_http_header` is set, else the downstream
/// connection's local address when a listener filter restored it; with neither, no host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OriginalDst {
    /// `use_http_header`: the header naming the host (`x-envoy-original-dst-host` unless
    /// `http_header_name` says otherwise); only its first value counts.
    pub header: Option<http::HeaderName>,
    /// `upstream_port_override`: the port used whatever the header or connection says.
    pub port_override: Option<u16>,
    /// `metadata_key`, when it names a field of the `envoy.filters.listener.original_dst`
    /// dynamic metadata: the host it holds comes before the header and the restored address.
    /// Only an internal connection carries that metadata (an internal_upstream socket passes
    /// it from the endpoint: istiod's `waypoint`).
    pub metadata_field: Option<String>,
}

impl OriginalDst {
    /// The host for a request: the header (only its first value, as Envoy reads an untrusted
    /// header), else `restored` (the connection's original destination, when a listener filter
    /// restored it). An unparsable header falls through to `restored`, as in Envoy.
    pub fn host(
        &self,
        headers: &http::HeaderMap,
        restored: Option<SocketAddr>,
    ) -> (Option<SocketAddr>, bool) {
        let mut invalid = false;
        let from_header = self.header.as_ref().and_then(|name| {
            let v = headers.get(name)?;
            let parsed = parse_ip_port(v.as_bytes());
            invalid = parsed.is_none();
            parsed
        });
        self.with_port(from_header.or(restored))
            .map_or((None, invalid), |a| (Some(a), invalid))
    }

    /// The host on an internal connection, as Envoy's original_dst balancer reads it there:
    /// the `metadata_key` field of the metadata the connection carries (an unparsable value
    /// counts as invalid and falls through), else the restored local address.
    pub fn internal_host(
        &self,
        metadata: Option<&InternalAddr>,
        restored: Option<SocketAddr>,
    ) -> (Option<SocketAddr>, bool) {
        let mut invalid = false;
        let from_meta = self
            .metadata_field
            .as_deref()
            .and_then(|f| metadata?.orig_dst_field(f))
            .and_then(|v| {
                let parsed = parse_ip_port(v.as_bytes());
                invalid = parsed.is_none();
                parsed
            });
        (self.with_port(from_meta.or(restored)), invalid)
    }

    fn with_port(&self, a: Option<SocketAddr>) -> Option<SocketAddr> {
        a.map(|mut a| {
            if let Some(p) = self.port_override {
                a.set_port(p);
            }
            a
        })
    }
}

/// `ip:port` or `[ipv6]:port`, as Envoy's `parseInternetAddressAndPortNoThrow`: no names, a
/// port is required.
pub fn parse_ip_port(v: &[u8]) -> Option<SocketAddr> {
    let s = std::str::from_utf8(v).ok()?;
    let (ip, port) = s.rsplit_once(':')?;
    let ip = match ip.strip_prefix('[') {
        Some(rest) => std::net::IpAddr::V6(rest.strip_suffix(']')?.parse().ok()?),
        None => std::net::IpAddr::V4(ip.parse().ok()?),
    };
    // Envoy reads the port with absl::SimpleAtoi into a 64-bit integer, then checks the range.
    let port: u64 = port.parse().ok()?;
    Some(SocketAddr::new(ip, u16::try_from(port).ok()?))
}

/// A cluster as CDS (or the bootstrap) defined it, without endpoints.
#[derive(Debug, PartialEq)]
pub struct ClusterDef {
    pub name: Arc<str>,
    pub kind: DiscoveryKind,
    /// The ClusterLoadAssignment name to subscribe to (EDS `service_name`, else the cluster name).
    pub eds_name: String,
    pub connect_timeout: Duration,
    pub policy: Policy,
    /// Locality weighting, slow start and least-request sampling.
    pub lb: LbOptions,
    /// Percent of healthy hosts under which Envoy balances across all hosts (panic mode),
    /// rounded as Envoy rounds it.
    pub panic_threshold: u32,
    /// For STATIC and DNS clusters: the inline `load_assignment`.
    pub inline: Option<LoadAssignmentSpec>,
    pub http2: bool,
    /// `http2_protocol_options.max_concurrent_streams`: streams one upstream connection carries.
    pub h2_max_streams: u32,
    /// The HTTP/1 options' `header_key_format` is set: a request's header names go to this
    /// cluster in the case they were read in, when the connection manager kept it (Envoy keeps
    /// case end to end only with a formatter on both sides, as istiod's preserve-case option
    /// sets them). Unset, names go lower case.
    pub keep_header_case: bool,
    /// `dns_lookup_family`, for DNS clusters.
    pub dns_family: DnsFamily,
    /// Circuit breaker on concurrent retries (default priority `max_retries`, Envoy: 3).
    pub max_retries: u32,
    /// `retry_budget`: replaces `max_retries` with a share of the requests in flight.
    pub retry_budget: Option<RetryBudget>,
    /// The other default-priority circuit breakers (Envoy: 1024 each).
    pub max_connections: u32,
    pub max_pending_requests: u32,
    pub max_requests: u32,
    pub outlier: Option<super::outlier::OutlierConfig>,
    /// The connection pool closes an upstream connection idle this long (Envoy: 1 hour;
    /// zero: never).
    pub idle_timeout: Option<Duration>,
    /// `max_requests_per_connection`: an upstream connection closes after this many requests.
    pub max_requests_per_connection: Option<u32>,
    /// `common_http_protocol_options.max_headers_count` (default 100): an HTTP/1 response
    /// with more header fields is refused (502, as Envoy's codec refuses it).
    pub max_response_headers: usize,
    /// `common_http_protocol_options.max_response_headers_kb` in bytes (HTTP/1 default
    /// 80 KiB): an HTTP/1 response head larger than this is refused.
    pub max_response_head_bytes: usize,
    /// `upstream_connection_options.tcp_keepalive`.
    pub tcp_keepalive: Option<TcpKeepalive>,
    /// `health_checks`: the active health check, when there is one.
    pub health_check: Option<Arc<super::health_check::HealthCheckConfig>>,
    /// `transport_socket` and `transport_socket_matches`.
    pub transport: super::upstream_tls::TransportSockets,
    /// ORIGINAL_DST clusters: how a request names its host.
    pub original_dst: Option<OriginalDst>,
    /// `use_downstream_protocol_config`: HTTP/2 upstream for HTTP/2 clients, else HTTP/1.1.
    pub downstream_protocol: bool,
    /// `upstream_bind_config`: the local address upstream connections bind.
    pub bind: Option<Bind>,
    /// What access logs, metrics and traces say of the cluster (its name, `alt_stat_name`).
    pub telemetry: Arc<crate::telemetry::UpstreamInfo>,
}

/// A circuit breaker's `retry_budget`: concurrent retries may be `percent` of the active and
/// pending requests, and never fewer than `min_concurrency` (Envoy's defaults: 20 %, 3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryBudget {
    pub percent: f64,
    pub min_concurrency: u32,
}

impl RetryBudget {
    /// The concurrent retries allowed with `in_flight` active plus pending requests.
    pub fn max(&self, in_flight: u64) -> u64 {
        // Envoy truncates the share to a whole number before taking the floor into account.
        ((self.percent / 100.0 * in_flight as f64) as u64).max(u64::from(self.min_concurrency))
    }
}

/// `upstream_bind_config`: the source address, and the extra ones of other IP families.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bind {
    pub source: SocketAddr,
    pub extra: Vec<SocketAddr>,
}

impl Bind {
    /// Envoy binds the source address of the upstream's IP family when the config has one,
    /// else `source_address` (and the connect then fails, as in Envoy).
    pub fn for_peer(&self, peer: SocketAddr) -> SocketAddr {
        std::iter::once(&self.source)
            .chain(&self.extra)
            .find(|a| a.is_ipv4() == peer.is_ipv4())
            .copied()
            .unwrap_or(self.source)
    }
}

/// What a cluster's load-balancer config says beyond the policy itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LbOptions {
    /// `locality_weighted_lb_config`: choose a locality by weight before the host.
    pub locality_weighted: bool,
    pub slow_start: Option<crate::lb::SlowStart>,
    /// Least request: hosts sampled per pick.
    pub choice_count: u32,
    /// Least request with unequal weights: `weight / (active + 1) ^ bias`.
    pub active_request_bias: f64,
}

impl Default for LbOptions {
    fn default() -> Self {
        LbOptions {
            locality_weighted: false,
            slow_start: None,
            choice_count: 2,
            active_request_bias: 1.0,
        }
    }
}

/// TCP keepalive for upstream connections; an unset field keeps the kernel's setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpKeepalive {
    pub probes: Option<u32>,
    pub time: Option<u32>,
    pub interval: Option<u32>,
}

/// Which addresses a DNS lookup keeps, as Envoy's `dns_lookup_family` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DnsFamily {
    /// IPv6 if there is any, else IPv4 (Envoy's AUTO).
    Auto,
    V4Only,
    V6Only,
    /// IPv4 if there is any, else IPv6.
    V4Preferred,
    All,
}

impl DnsFamily {
    pub fn filter(self, addrs: &[std::net::IpAddr]) -> Vec<std::net::IpAddr> {
        let v4: Vec<_> = addrs.iter().copied().filter(|a| a.is_ipv4()).collect();
        let v6: Vec<_> = addrs.iter().copied().filter(|a| a.is_ipv6()).collect();
        match self {
            DnsFamily::Auto if !v6.is_empty() => v6,
            DnsFamily::Auto | DnsFamily::V4Only => v4,
            DnsFamily::V6Only => v6,
            DnsFamily::V4Preferred if !v4.is_empty() => v4,
            DnsFamily::V4Preferred => v6,
            DnsFamily::All => addrs.to_vec(),
        }
    }
}

/// An endpoint before DNS resolution (DNS clusters may name hosts instead of IPs).
#[derive(Debug, Clone, PartialEq)]
pub struct SpecEndpoint {
    /// An IP literal, or for DNS clusters a name to resolve.
    pub host: String,
    pub port: u16,
    pub weight: u32,
    pub health: Health,
    pub priority: u32,
    /// Index into the assignment's `locality_weights`.
    pub locality: u32,
    /// `endpoint.hostname` (DNS clusters: the name resolved when it is empty).
    pub hostname: Option<Arc<str>>,
    /// The endpoint's transport socket match metadata (None: neither it nor its locality has
    /// any).
    pub labels: Option<Arc<super::upstream_tls::SocketLabels>>,
    /// `envoy_internal_address`: the endpoint is an internal listener (`host`/`port` are
    /// its `endpoint_id`).
    pub internal: Option<Arc<InternalAddr>>,
    /// The endpoint's `istio` metadata `workload` (Istio's destination labels).
    pub workload: Option<Arc<crate::telemetry::istio_stats::PeerInfo>>,
}

/// An endpoint whose address is an internal listener (`envoy_internal_address`): istiod's
/// ambient endpoints, reached through its `connect_originate` listener (HBONE). Such a host is
/// still keyed by an `ip:port` (its `endpoint_id`, which istiod sets to the pod's address),
/// so balancers, outlier detection and pools tell pods apart as Envoy's endpoint ids do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InternalAddr {
    /// `server_listener_name`.
    pub listener: Arc<str>,
    pub endpoint_id: Arc<str>,
    /// The endpoint's `envoy.filters.listener.original_dst` metadata, its string fields (a
    /// list's first string, as Envoy reads a metadata key): what an internal_upstream socket
    /// passing that metadata gives the internal connection (`local` for the original_dst
    /// listener filter; `waypoint` for the ORIGINAL_DST cluster's `metadata_key`).
    pub orig_dst: Vec<(String, String)>,
}

/// The dynamic metadata namespace of the original_dst listener filter.
pub const ORIG_DST_NS: &str = "envoy.filters.listener.original_dst";

impl InternalAddr {
    pub fn orig_dst_field(&self, key: &str) -> Option<&str> {
        self.orig_dst
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Envoy's name for the address (`envoy://<listener>/<endpoint_id>`): what hashing
    /// balancers place on the ring, and what `%DOWNSTREAM_LOCAL_ADDRESS%` reads when no
    /// original destination was restored.
    pub fn envoy_name(&self) -> String {
        format!("envoy://{}/{}", self.listener, self.endpoint_id)
    }

    fn translate(
        i: &corepb::EnvoyInternalAddress,
        metadata: Option<&corepb::Metadata>,
    ) -> Result<(Arc<InternalAddr>, SocketAddr), String> {
        use envoy_types::pb::google::protobuf::value::Kind;
        let listener =
            match &i.address_name_specifier {
                Some(corepb::envoy_internal_address::AddressNameSpecifier::ServerListenerName(
                    n,
                )) if !n.is_empty() => n.as_str(),
                _ => return Err("envoy_internal_address.server_listener_name is required".into()),
            };
        let Some(addr) = parse_ip_port(i.endpoint_id.as_bytes()) else {
            return Err(format!(
                "envoy_internal_address '{listener}': endpoint_id '{}' must be an ip:port (Portico keys hosts by address)",
                i.endpoint_id
            ));
        };
        let mut orig_dst = Vec::new();
        if let Some(s) = metadata.and_then(|m| m.filter_metadata.get(ORIG_DST_NS)) {
            for (k, v) in &s.fields {
                let v = match &v.kind {
                    Some(Kind::ListValue(l)) => l.values.first().and_then(|v| v.kind.as_ref()),
                    other => other.as_ref(),
                };
                if let Some(Kind::StringValue(s)) = v {
                    orig_dst.push((k.clone(), s.clone()));
                }
            }
            orig_dst.sort();
        }
        Ok((
            Arc::new(InternalAddr {
                listener: Arc::from(listener),
                endpoint_id: Arc::from(i.endpoint_id.as_str()),
                orig_dst,
            }),
            addr,
        ))
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadAssignmentSpec {
    pub endpoints: Vec<SpecEndpoint>,
    /// Each locality's `load_balancing_weight`, in the order localities first appear.
    pub locality_weights: Vec<Option<u32>>,
    pub policy: LoadPolicy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy,
    Degraded,
}

#[derive(Debug, Clone)]
pub struct Host {
    pub addr: SocketAddr,
    pub weight: u32,
    pub health: Health,
    pub priority: u32,
    /// Index into the assignment's `locality_weights`.
    pub locality: u32,
    /// What `auto_host_rewrite` puts in the Host header.
    pub hostname: Option<Arc<str>>,
    /// For `transport_socket_matches`.
    pub labels: Option<Arc<super::upstream_tls::SocketLabels>>,
    /// An internal listener's endpoint: connections go through that listener's chain.
    pub internal: Option<Arc<InternalAddr>>,
    /// The endpoint's `istio` filter metadata `workload`
    /// (`name;namespace;canonical_service;canonical_revision;cluster`), parsed: Istio's
    /// destination labels when the upstream sends no peer metadata. None without it (or when
    /// it has fewer than five parts, which istio-proxy ignores too).
    pub workload: Option<Arc<crate::telemetry::istio_stats::PeerInfo>>,
}

/// A translated ClusterLoadAssignment.
#[derive(Debug, Default)]
pub struct LoadAssignment {
    pub hosts: Vec<Host>,
    pub locality_weights: Vec<Option<u32>>,
    pub policy: LoadPolicy,
    /// Endpoints' `health_check_config`, for the few that have one.
    pub checks: std::collections::HashMap<SocketAddr, super::health_check::EndpointCheck>,
}

/// A routable cluster: definition, endpoints and balancer state.
#[derive(Debug)]
pub struct Cluster {
    pub def: Arc<ClusterDef>,
    pub endpoints: Arc<LoadAssignment>,
    /// Where traffic goes: shares per priority level and health, as Envoy splits load.
    pub plan: Plan,
    /// In-flight requests per host, for least-request.
    pub active: Vec<AtomicU32>,
    pub stats: Arc<ClusterStats>,
    /// Outlier-detection state per host (empty without `outlier_detection`).
    pub outlier: Vec<Arc<crate::live::outlier::HostOutlier>>,
    /// Active health check flags per host as built (empty without `health_checks`; None for a
    /// host whose checks are disabled), and the checker generation they were read at.
    pub hc: Vec<Option<super::health_check::HcFlags>>,
    pub hc_generation: u64,
    /// Each host's transport socket (see `TransportSockets::pick`); empty when the cluster
    /// has no `transport_socket_matches`, so every host uses the default.
    pub transport: Vec<u16>,
    /// Per host, its TLS connection settings (None: plain text); empty without TLS.
    pub tls_hosts: Vec<Option<Arc<super::upstream_tls::EndpointTls>>>,
    /// The sockets built with their SDS secrets; empty when the sockets need none, and then
    /// `def.transport`'s are used as they are.
    pub sockets: Arc<super::upstream_tls::Resolved>,
    /// Some host is an internal listener's endpoint: a request keeps the snapshot to reach
    /// that listener and the cluster its chain sends to.
    pub internal_hosts: bool,
}

/// What the cluster's live state says of its hosts when it is built, read at the commit
/// point (`xds/commit.rs`) and handed in, so that building a cluster reads nothing live.
#[derive(Debug, Default)]
pub struct HostState {
    /// Active health check flags per host (empty without `health_checks`; None for a host
    /// whose checks are disabled), and the checker generation they were read at.
    pub hc: Vec<Option<super::health_check::HcFlags>>,
    pub hc_generation: u64,
    /// Slow start: when each host turned healthy (empty without slow start).
    pub healthy_since: Vec<Option<std::time::Instant>>,
    /// Outlier-detection state per host (empty without `outlier_detection`).
    pub outlier: Vec<Arc<crate::live::outlier::HostOutlier>>,
}

impl Cluster {
    /// A cluster with no live host state: for tests and tools (real builds go through
    /// [`Cluster::build`] with what the commit point read).
    pub fn new(
        def: Arc<ClusterDef>,
        endpoints: Arc<LoadAssignment>,
        stats: Arc<ClusterStats>,
    ) -> Cluster {
        Cluster::build(
            def,
            endpoints,
            stats,
            Default::default(),
            HostState::default(),
        )
    }

    /// The cluster from its definition, endpoints, the sockets built with their SDS secrets
    /// (see `TransportSockets::resolve`) and its hosts' live state.
    pub fn build(
        def: Arc<ClusterDef>,
        endpoints: Arc<LoadAssignment>,
        stats: Arc<ClusterStats>,
        sockets: Arc<super::upstream_tls::Resolved>,
        live: HostState,
    ) -> Cluster {
        let HostState {
            hc,
            hc_generation,
            healthy_since: since,
            outlier,
        } = live;
        // Active checks change what the balancers see of a host's health, not the endpoints.
        let checked: Vec<Host>;
        let hosts = if hc.is_empty() {
            &endpoints.hosts
        } else {
            checked = super::health_check::apply(&endpoints.hosts, &hc);
            &checked
        };
        let make = |eligible: Eligible| {
            // Hashing balancers place hosts by address, as Envoy does (`ip:port`, or
            // `envoy://<listener>/<endpoint_id>` for an internal listener's endpoint).
            Balancer::with_keys(def.policy, eligible, |i| match &hosts[i].internal {
                Some(a) => a.envoy_name(),
                None => hosts[i].addr.to_string(),
            })
            .with_least_request(def.lb.choice_count, def.lb.active_request_bias)
            .with_slow_start(def.lb.slow_start, |i| since.get(i).copied().flatten())
        };
        let plan = super::load::plan(
            &super::load::Inputs {
                hosts,
                locality_weights: &endpoints.locality_weights,
                policy: endpoints.policy,
                panic_threshold: def.panic_threshold,
                locality_weighted: def.lb.locality_weighted,
                lb: def.policy,
            },
            &make,
        );
        let mut active: Vec<AtomicU32> =
            endpoints.hosts.iter().map(|_| AtomicU32::new(0)).collect();
        if def.original_dst.is_some() {
            // The one slot the hosts requests name share (ORIGINAL_DST clusters have no others).
            active.push(AtomicU32::new(0));
        }
        let transport = if def.transport.matches.is_empty() {
            Vec::new()
        } else {
            endpoints
                .hosts
                .iter()
                .map(|h| def.transport.pick(h.labels.as_deref()) as u16)
                .collect()
        };
        let tls_hosts = if def.transport.any_tls() {
            endpoints
                .hosts
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    let socket = transport.get(i).map_or(0, |&s| usize::from(s));
                    // The sockets built with their SDS secrets, when they need any.
                    let tls = if sockets.sockets.is_empty() {
                        def.transport.get(socket)
                    } else {
                        sockets.sockets.get(socket).and_then(Option::as_ref)
                    };
                    tls.map(|t| {
                        Arc::new(super::upstream_tls::EndpointTls::with_bind(
                            t.clone(),
                            h.addr,
                            def.tcp_keepalive,
                            def.bind.as_ref().map(|b| b.for_peer(h.addr)),
                        ))
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        Cluster {
            internal_hosts: endpoints.hosts.iter().any(|h| h.internal.is_some()),
            tls_hosts,
            transport,
            sockets,
            hc,
            hc_generation,
            outlier,
            plan,
            def,
            endpoints,
            active,
            stats,
        }
    }

    pub fn pick(&self) -> Option<(usize, SocketAddr)> {
        let pool = self.pool(fastrand::u32(..100))?;
        let i = self.not_ejected(pool.pick(&self.active)?);
        Some((i, self.endpoints.hosts[i].addr))
    }

    /// The pool a point in `0..100` chooses; counts `lb_healthy_panic` as Envoy does.
    fn pool(&self, point: u32) -> Option<&Pool> {
        let (pool, panic) = self.plan.bucket(point)?;
        if panic {
            self.stats
                .lb_healthy_panic
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Some(pool)
    }

    /// `i`, or when outlier detection has ejected it, the next host of the same priority and
    /// health that is in; with every such host out, `i` (Envoy's panic mode uses all hosts).
    fn not_ejected(&self, i: usize) -> usize {
        let out = |j: usize| {
            self.outlier
                .get(j)
                .is_some_and(|h| h.is_ejected(&self.stats.outlier))
        };
        if self.outlier.is_empty()
            || self
                .stats
                .outlier
                .ejected
                .load(std::sync::atomic::Ordering::Relaxed)
                == 0
            || !out(i)
        {
            return i;
        }
        let hosts = &self.endpoints.hosts;
        // The health the balancers saw: EDS combined with the active checks.
        let health = |j: usize| {
            super::health_check::effective(hosts[j].health, self.hc.get(j).and_then(Option::as_ref))
        };
        let n = hosts.len();
        (1..n)
            .map(|k| (i + k) % n)
            .find(|&j| hosts[j].priority == hosts[i].priority && health(j) == health(i) && !out(j))
            .unwrap_or(i)
    }

    /// One upstream outcome for outlier detection (a status; 503/504 for failures).
    pub fn record_outcome(&self, i: usize, status: u16) {
        if let (Some(cfg), Some(h)) = (&self.def.outlier, self.outlier.get(i)) {
            h.record(status, cfg, &self.stats.outlier, self.outlier.len());
        }
    }

    /// Whether picks use the route's request hash (ring hash, Maglev).
    pub fn hashes(&self) -> bool {
        self.def.policy.is_hashing()
    }

    /// A pick for a hashing cluster: `hash` (a random one when the route's hash policies
    /// produced none, as Envoy does) chooses the priority level and the host.
    pub fn pick_hashed(&self, hash: Option<u64>) -> Option<(usize, SocketAddr)> {
        self.pick_hashed_attempt(hash, 0)
    }

    /// `pick_hashed` for Envoy's host-selection retries (`attempt` > 0 once a retry host
    /// predicate refused what the earlier attempts gave): the same level, the next host the
    /// ring or table gives for that attempt.
    pub fn pick_hashed_attempt(
        &self,
        hash: Option<u64>,
        attempt: u32,
    ) -> Option<(usize, SocketAddr)> {
        if !self.hashes() {
            return self.pick();
        }
        let h = hash.unwrap_or_else(|| fastrand::u64(..));
        // Envoy chooses the priority with `hash % 100` against whole-percent loads.
        let pool = self.pool((h % 100) as u32)?;
        let i = self.not_ejected(pool.pick_hash(h, attempt, &self.active)?);
        Some((i, self.endpoints.hosts[i].addr))
    }

    /// The host an ORIGINAL_DST cluster's request names (see `OriginalDst::host`), and the
    /// slot in `active` all such hosts share; counts `original_dst_host_invalid` as Envoy does.
    pub fn pick_original_dst(
        &self,
        od: &OriginalDst,
        headers: &http::HeaderMap,
        restored: Option<SocketAddr>,
    ) -> Option<(usize, SocketAddr)> {
        let (host, invalid) = od.host(headers, restored);
        if invalid {
            self.stats
                .original_dst_host_invalid
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Some((self.endpoints.hosts.len(), host?))
    }

    /// The TLS settings for a host an ORIGINAL_DST request named: the socket a host without
    /// metadata gets (Envoy's dynamic hosts have none); None for plain text.
    pub fn original_dst_tls(
        &self,
        addr: SocketAddr,
    ) -> Option<Arc<super::upstream_tls::EndpointTls>> {
        if !self.def.transport.any_tls() {
            return None;
        }
        let socket = self.def.transport.pick(None);
        let tls = if self.sockets.sockets.is_empty() {
            self.def.transport.get(socket)
        } else {
            self.sockets.sockets.get(socket).and_then(Option::as_ref)
        }?;
        Some(Arc::new(super::upstream_tls::EndpointTls::with_bind(
            tls.clone(),
            addr,
            self.def.tcp_keepalive,
            self.def.bind.as_ref().map(|b| b.for_peer(addr)),
        )))
    }

    /// The TLS settings host `i` connects with; None for plain text.
    pub fn tls_for(&self, i: usize) -> Option<&Arc<super::upstream_tls::EndpointTls>> {
        self.tls_hosts.get(i)?.as_ref()
    }

    pub fn healthy_count(&self) -> usize {
        self.endpoints
            .hosts
            .iter()
            .enumerate()
            .filter(|(i, h)| {
                super::health_check::effective(h.health, self.hc.get(*i).and_then(Option::as_ref))
                    == Health::Healthy
            })
            .count()
    }
}

impl ClusterDef {
    pub fn translate(
        c: &cpb::Cluster,
        src: &dyn super::sources::DataSources,
    ) -> Result<ClusterDef, TranslateError> {
        let err = |d: String| TranslateError::new(format!("cluster '{}'", c.name), d);
        if c.name.is_empty() {
            return Err(TranslateError::new("cluster ''", "name must not be empty"));
        }
        use cpb::cluster::{ClusterDiscoveryType as CDT, DiscoveryType as DT, LbPolicy};
        let kind = match &c.cluster_discovery_type {
            None => DiscoveryKind::Static,
            Some(CDT::Type(t)) => match DT::try_from(*t) {
                Ok(DT::Static) => DiscoveryKind::Static,
                Ok(DT::StrictDns) => DiscoveryKind::StrictDns,
                Ok(DT::LogicalDns) => DiscoveryKind::LogicalDns,
                Ok(DT::Eds) => DiscoveryKind::Eds,
                Ok(DT::OriginalDst) => DiscoveryKind::OriginalDst,
                Err(_) => return Err(err(format!("type: unknown discovery type {t}"))),
            },
            Some(CDT::ClusterType(ct)) => {
                return Err(err(format!("cluster_type '{}' is not supported", ct.name)))
            }
        };
        let mut lb = LbOptions::default();
        let original_dst = match kind {
            DiscoveryKind::OriginalDst => Some(original_dst(c).map_err(err)?),
            _ => None,
        };
        let policy = match &c.load_balancing_policy {
            // The cluster provides the host: Envoy's original-dst balancer has nothing to
            // balance, so the policy and `common_lb_config` cannot matter.
            _ if original_dst.is_some() => Policy::RoundRobin,
            // Envoy uses the first policy in the list that it knows; so does Portico.
            Some(lbp) => lbp
                .policies
                .iter()
                .filter_map(|p| p.typed_extension_config.as_ref()?.typed_config.as_ref())
                .find_map(|any| typed_policy(any, &mut lb))
                .ok_or_else(|| {
                    let names: Vec<&str> = lbp
                        .policies
                        .iter()
                        .filter_map(|p| p.typed_extension_config.as_ref().map(|t| t.name.as_str()))
                        .collect();
                    err(format!(
                        "load_balancing_policy: policies [{}] are not supported yet",
                        names.join(", ")
                    ))
                })?
                .map_err(|e| err(format!("load_balancing_policy: {e}")))?,
            None => match LbPolicy::try_from(c.lb_policy) {
                Ok(LbPolicy::RoundRobin) => {
                    lb = legacy_lb_options(c).map_err(err)?;
                    Policy::RoundRobin
                }
                Ok(LbPolicy::LeastRequest) => {
                    lb = legacy_lb_options(c).map_err(err)?;
                    Policy::LeastRequest
                }
                Ok(LbPolicy::Random) => Policy::Random,
                Ok(LbPolicy::RingHash) => {
                    lb = legacy_lb_options(c).map_err(err)?;
                    legacy_ring_hash(c).map_err(err)?
                }
                Ok(LbPolicy::Maglev) => {
                    lb = legacy_lb_options(c).map_err(err)?;
                    legacy_maglev(c).map_err(err)?
                }
                Ok(other) => {
                    return Err(err(format!(
                        "lb_policy {} is not supported yet",
                        other.as_str_name()
                    )))
                }
                Err(_) => return Err(err(format!("lb_policy: unknown value {}", c.lb_policy))),
            },
        };
        let connect_timeout = match &c.connect_timeout {
            Some(d) => duration(d).map_err(|e| err(format!("connect_timeout: {e}")))?,
            None => Duration::from_secs(5),
        };
        if connect_timeout.is_zero() {
            return Err(err("connect_timeout must be greater than 0s".into()));
        }
        let panic_threshold = c
            .common_lb_config
            .as_ref()
            .and_then(|l| l.healthy_panic_threshold.as_ref())
            .map(|p| p.value)
            .unwrap_or(50.0);
        if !(0.0..=100.0).contains(&panic_threshold) {
            return Err(err(format!(
                "common_lb_config.healthy_panic_threshold {panic_threshold} must be in [0, 100]"
            )));
        }
        // Envoy rounds the percentage to a whole number.
        let panic_threshold = panic_threshold.round() as u32;
        if kind == DiscoveryKind::Eds && c.eds_cluster_config.is_none() {
            return Err(err(
                "cannot create an EDS cluster without an EDS config (eds_cluster_config)".into(),
            ));
        }
        // Endpoints come over the ADS stream; another source would leave the cluster empty.
        if let Some(src) = c
            .eds_cluster_config
            .as_ref()
            .and_then(|e| e.eds_config.as_ref())
            .and_then(|s| s.config_source_specifier.as_ref())
        {
            use corepb::config_source::ConfigSourceSpecifier as S;
            if !matches!(src, S::Ads(_) | S::Self_(_)) {
                return Err(err(
                    "eds_cluster_config.eds_config: only ads (or self) is supported".into(),
                ));
            }
        }
        let eds_name = match (&kind, &c.eds_cluster_config) {
            (DiscoveryKind::Eds, Some(e)) if !e.service_name.is_empty() => e.service_name.clone(),
            _ => c.name.clone(),
        };
        let inline = match (&kind, &c.load_assignment) {
            (DiscoveryKind::Eds, _) => None,
            (_, Some(la)) if la.cluster_name.is_empty() => {
                return Err(err("load_assignment.cluster_name must not be empty".into()))
            }
            (_, Some(la)) => Some(
                load_assignment_spec(
                    la,
                    kind != DiscoveryKind::Static,
                    kind == DiscoveryKind::Static,
                )
                .map_err(|e| err(format!("load_assignment: {e}")))?,
            ),
            (_, None) => Some(LoadAssignmentSpec::default()),
        };
        // Envoy's own checks, in its order: the policy first, then the load assignment.
        if kind == DiscoveryKind::OriginalDst && c.load_assignment.is_some() {
            return Err(err(
                "ORIGINAL_DST clusters must have no load assignment configured".into(),
            ));
        }
        if kind == DiscoveryKind::LogicalDns {
            let one = c.load_assignment.as_ref().is_some_and(|la| {
                la.endpoints.len() == 1 && la.endpoints[0].lb_endpoints.len() == 1
            });
            if !one {
                return Err(err(
                    "LOGICAL_DNS clusters must have a single locality_lb_endpoint and a single lb_endpoint".into(),
                ));
            }
        }
        let options = protocol_options(c).map_err(err)?;
        #[allow(deprecated)]
        let h2_options = c.http2_protocol_options.as_ref().or_else(|| {
            use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
                explicit_http_config::ProtocolConfig, UpstreamProtocolOptions,
            };
            match options.as_ref()?.upstream_protocol_options.as_ref()? {
                UpstreamProtocolOptions::ExplicitHttpConfig(e) => match &e.protocol_config {
                    Some(ProtocolConfig::Http2ProtocolOptions(h2)) => Some(h2),
                    _ => None,
                },
                _ => None,
            }
        });
        let keep_header_case = keeps_header_case(c, options.as_ref());
        upstream_h1_options(c, options.as_ref()).map_err(err)?;
        let downstream_protocol = downstream_protocol(options.as_ref()).map_err(err)?;
        let h2_options = h2_options.or(downstream_protocol);
        let downstream_protocol = downstream_protocol.is_some();
        // With use_downstream_protocol_config the protocol is chosen per request.
        let http2 = h2_options.is_some() && !downstream_protocol;
        // Envoy's default is 2^31 - 1: in practice the server's SETTINGS decide.
        let h2_max_streams = h2_options
            .and_then(|o| o.max_concurrent_streams.as_ref())
            .map_or(i32::MAX as u32, |v| v.value)
            .max(1);
        // The extension's common options replace the cluster's deprecated ones.
        #[allow(deprecated)]
        let common = options
            .as_ref()
            .and_then(|o| o.common_http_protocol_options.as_ref())
            .or(c.common_http_protocol_options.as_ref());
        let idle_timeout = match common.and_then(|o| o.idle_timeout.as_ref()) {
            Some(d) => Some(
                duration(d)
                    .map_err(|e| err(format!("common_http_protocol_options.idle_timeout: {e}")))?,
            )
            .filter(|d| !d.is_zero()),
            None => Some(Duration::from_secs(3600)),
        };
        // `max_connection_duration` (istiod's DestinationRule maxConnectionDuration) only
        // retires upstream connections sooner: accepted, the hosts chosen are the same.
        let max_response_headers = match common.and_then(|o| o.max_headers_count.as_ref()) {
            Some(v) if v.value == 0 => {
                return Err(err(
                    "common_http_protocol_options.max_headers_count: must be at least 1".into(),
                ))
            }
            Some(v) => v.value as usize,
            None => 100,
        };
        let max_response_head_bytes = match common.and_then(|o| o.max_response_headers_kb.as_ref())
        {
            Some(v) if v.value == 0 || v.value > 8192 => {
                return Err(err(format!(
                    "common_http_protocol_options.max_response_headers_kb: {} is not in 1..=8192",
                    v.value
                )))
            }
            Some(v) => v.value as usize * 1024,
            None => 80 * 1024,
        };
        // `max_stream_duration` would end upstream requests: refused until it is implemented.
        if common.is_some_and(|o| o.max_stream_duration.is_some()) {
            return Err(err(
                "common_http_protocol_options.max_stream_duration is not supported yet".into(),
            ));
        }
        #[allow(deprecated)]
        let max_requests_per_connection = common
            .and_then(|o| o.max_requests_per_connection.as_ref())
            .or(c.max_requests_per_connection.as_ref())
            .map(|v| v.value)
            .filter(|n| *n > 0);
        let tcp_keepalive = c
            .upstream_connection_options
            .as_ref()
            .and_then(|o| o.tcp_keepalive.as_ref())
            .map(|k| TcpKeepalive {
                probes: k.keepalive_probes.as_ref().map(|v| v.value),
                time: k.keepalive_time.as_ref().map(|v| v.value),
                interval: k.keepalive_interval.as_ref().map(|v| v.value),
            });
        let dns_family = match c.dns_lookup_family {
            1 => DnsFamily::V4Only,
            2 => DnsFamily::V6Only,
            3 => DnsFamily::V4Preferred,
            4 => DnsFamily::All,
            _ => DnsFamily::Auto,
        };
        let thresholds = c.circuit_breakers.as_ref().and_then(|cb| {
            cb.thresholds
                .iter()
                .find(|t| t.priority == corepb::RoutingPriority::Default as i32)
        });
        if thresholds.is_some_and(|t| t.max_connection_pools.is_some()) {
            return Err(err(
                "circuit_breakers.thresholds.max_connection_pools is not supported".into(),
            ));
        }
        let retry_budget = match thresholds.and_then(|t| t.retry_budget.as_ref()) {
            Some(b) => {
                let percent = b.budget_percent.as_ref().map_or(20.0, |p| p.value);
                if !(0.0..=100.0).contains(&percent) {
                    return Err(err(format!(
                        "circuit_breakers.thresholds.retry_budget.budget_percent {percent} must be in [0, 100]"
                    )));
                }
                let interval = match &b.budget_interval {
                    Some(d) => duration(d).map_err(|e| {
                        err(format!(
                            "circuit_breakers.thresholds.retry_budget.budget_interval: {e}"
                        ))
                    })?,
                    None => Duration::ZERO,
                };
                if !interval.is_zero() {
                    // Counting the requests started within a window: not implemented.
                    return Err(err(
                        "circuit_breakers.thresholds.retry_budget.budget_interval is not supported yet"
                            .into(),
                    ));
                }
                Some(RetryBudget {
                    percent,
                    min_concurrency: b.min_retry_concurrency.as_ref().map_or(3, |v| v.value),
                })
            }
            None => None,
        };
        // `track_remaining` (remaining_* gauges) cannot change where a request goes;
        // `max_connection_pools` overflows requests to 503 once the cluster has that many
        // pools, so it is refused. Only the DEFAULT priority is read: HIGH applies
        // to routes of that priority alone (a HIGH route is refused).
        let limit = |f: fn(&cpb::circuit_breakers::Thresholds) -> Option<u32>, default| {
            thresholds.and_then(f).unwrap_or(default)
        };
        // A host's connections never outnumber the cluster's: a per-host cap at or above the
        // cluster's changes nothing (Envoy Gateway's sample sets both to 1); a lower one
        // would queue requests Portico sends, so it is refused.
        let cluster_connections = limit(|t| t.max_connections.as_ref().map(|v| v.value), 1024);
        for t in c
            .circuit_breakers
            .as_ref()
            .map_or(&[][..], |cb| cb.per_host_thresholds.as_slice())
        {
            if t.max_connections
                .as_ref()
                .is_some_and(|v| v.value < cluster_connections)
            {
                return Err(err(format!(
                    "circuit_breakers.per_host_thresholds.max_connections below the cluster's ({cluster_connections}) is not supported"
                )));
            }
        }
        let outlier = match &c.outlier_detection {
            Some(o) => Some(super::outlier::translate(o).map_err(err)?),
            None => None,
        };
        let health_check = super::health_check::HealthCheckConfig::translate(&c.health_checks)
            .map_err(err)?
            .map(Arc::new);
        if let (Some(la), true) = (&c.load_assignment, kind != DiscoveryKind::Eds) {
            super::health_check::inline_checks_unsupported(la).map_err(err)?;
        }
        // After the protocol: Envoy offers it by ALPN when the socket lists no protocols.
        let transport =
            super::upstream_tls::TransportSockets::translate(c, http2, src).map_err(err)?;
        if downstream_protocol && transport.alpn_fallback_used() {
            return Err(err(format!(
                "typed_extension_protocol_options['{HTTP_PROTOCOL_OPTIONS}'].use_downstream_protocol_config \
                 with a TLS transport socket without alpn_protocols is not supported (the ALPN \
                 offered would depend on the request)"
            )));
        }
        let bind = match &c.upstream_bind_config {
            Some(b) => Some(bind_config(b).map_err(|e| err(format!("upstream_bind_config: {e}")))?),
            None => None,
        };
        accepted_fields(c).map_err(err)?;
        let telemetry = Arc::new(crate::telemetry::UpstreamInfo {
            istio: c
                .metadata
                .as_ref()
                .and_then(|m| m.filter_metadata.get("istio"))
                .map(crate::telemetry::istio_stats::IstioClusterMetadata::from_metadata)
                .unwrap_or_default(),
            name: Arc::from(c.name.as_str()),
            observability_name: Arc::from(if c.alt_stat_name.is_empty() {
                c.name.as_str()
            } else {
                c.alt_stat_name.as_str()
            }),
        });
        Ok(ClusterDef {
            telemetry,
            original_dst,
            downstream_protocol,
            bind,
            transport,
            health_check,
            idle_timeout,
            max_requests_per_connection,
            max_response_headers,
            max_response_head_bytes,
            tcp_keepalive,
            outlier,
            max_retries: limit(|t| t.max_retries.as_ref().map(|v| v.value), 3),
            retry_budget,
            max_connections: limit(|t| t.max_connections.as_ref().map(|v| v.value), 1024),
            max_pending_requests: limit(|t| t.max_pending_requests.as_ref().map(|v| v.value), 1024),
            max_requests: limit(|t| t.max_requests.as_ref().map(|v| v.value), 1024),
            dns_family,
            name: Arc::from(c.name.as_str()),
            kind,
            eds_name,
            connect_timeout,
            policy,
            lb,
            panic_threshold,
            inline,
            http2,
            h2_max_streams,
            keep_header_case,
        })
    }
}

/// `original_dst_lb_config` and the checks Envoy's original_dst cluster factory makes.
fn original_dst(c: &cpb::Cluster) -> Result<OriginalDst, String> {
    use cpb::cluster::LbPolicy;
    if c.lb_policy != LbPolicy::ClusterProvided as i32 {
        let name = LbPolicy::try_from(c.lb_policy).map_or("unknown", |p| p.as_str_name());
        return Err(format!(
            "lb_policy {name} is not valid for cluster type ORIGINAL_DST: only CLUSTER_PROVIDED is allowed"
        ));
    }
    if let Some(d) = &c.cleanup_interval {
        // Portico keeps no host map to sweep: a request's host lives for that request, and the
        // connection pool closes idle connections (idle_timeout). Only Envoy's proto rule is
        // checked.
        if duration(d)
            .map_err(|e| format!("cleanup_interval: {e}"))?
            .is_zero()
        {
            return Err("cleanup_interval must be greater than 0s".into());
        }
    }
    let cfg = match &c.lb_config {
        Some(cpb::cluster::LbConfig::OriginalDstLbConfig(o)) => Some(o),
        _ => None,
    };
    let use_header = cfg.is_some_and(|o| o.use_http_header);
    let name = cfg.map_or("", |o| o.http_header_name.as_str());
    if !use_header && !name.is_empty() {
        return Err(format!(
            "original_dst_lb_config: invalid config http_header_name={name} and use_http_header is false. Set use_http_header to true if http_header_name is desired."
        ));
    }
    let header = match (use_header, name) {
        (false, _) => None,
        (true, "") => Some(http::HeaderName::from_static("x-envoy-original-dst-host")),
        (true, n) => Some(
            http::HeaderName::from_bytes(n.to_ascii_lowercase().as_bytes()).map_err(|_| {
                format!("original_dst_lb_config.http_header_name '{n}' is not a valid header name")
            })?,
        ),
    };
    let port_override = match cfg.and_then(|o| o.upstream_port_override.as_ref()) {
        Some(p) => Some(u16::try_from(p.value).map_err(|_| {
            format!(
                "original_dst_lb_config.upstream_port_override {} must be at most 65535",
                p.value
            )
        })?),
        None => None,
    };
    // `metadata_key` names the host from dynamic metadata (the request's, then the
    // connection's). No filter Portico runs sets any; only an internal connection carries
    // metadata, the `envoy.filters.listener.original_dst` struct its internal_upstream socket
    // passes from the endpoint (istiod: `waypoint`). A key elsewhere could only be found in
    // metadata Portico does not carry, so it is refused rather than never matched. The
    // `envoy.network.transport_socket.original_dst_address` filter state is set by no filter
    // Portico runs: nothing to read.
    let metadata_field = match cfg.and_then(|o| o.metadata_key.as_ref()) {
        None => None,
        Some(k) => {
            use envoy_types::pb::envoy::r#type::metadata::v3::metadata_key::path_segment::Segment;
            let field = match k.path.as_slice() {
                [one] => match &one.segment {
                    Some(Segment::Key(f)) if !f.is_empty() => Some(f.clone()),
                    _ => None,
                },
                _ => None,
            };
            match field {
                Some(f) if k.key == ORIG_DST_NS => Some(f),
                _ => {
                    return Err(format!(
                        "original_dst_lb_config.metadata_key: only one field of '{ORIG_DST_NS}' (the metadata an internal connection carries) is supported"
                    ))
                }
            }
        }
    };
    Ok(OriginalDst {
        header,
        port_override,
        metadata_field,
    })
}

/// `use_downstream_protocol_config`: its HTTP/2 options when it has them (HTTP/2 clients
/// then get an HTTP/2 upstream); `auto_config` is refused.
fn downstream_protocol(
    options: Option<&envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions>,
) -> Result<Option<&corepb::Http2ProtocolOptions>, String> {
    use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::UpstreamProtocolOptions as U;
    let at = format!("typed_extension_protocol_options['{HTTP_PROTOCOL_OPTIONS}']");
    let Some(o) = options else {
        return Ok(None);
    };
    // The rest of the extension: none is set by istiod; each changes what a request does.
    let unsupported = [
        ("http_filters", !o.http_filters.is_empty()),
        (
            "header_validation_config",
            o.header_validation_config.is_some(),
        ),
        ("outlier_detection", o.outlier_detection.is_some()),
        (
            "request_mirror_policies",
            !o.request_mirror_policies.is_empty(),
        ),
        ("hash_policy", !o.hash_policy.is_empty()),
        ("retry_policy", o.retry_policy.is_some()),
    ];
    if let Some((field, _)) = unsupported.iter().find(|(_, set)| *set) {
        return Err(format!("{at}.{field} is not supported yet"));
    }
    if let Some(u) = &o.upstream_http_protocol_options {
        if u.auto_sni || u.auto_san_validation || !u.override_auto_sni_header.is_empty() {
            return Err(format!(
                "{at}.upstream_http_protocol_options: auto_sni and auto_san_validation are not supported yet"
            ));
        }
    }
    match &o.upstream_protocol_options {
        Some(U::UseDownstreamProtocolConfig(d)) => Ok(d.http2_protocol_options.as_ref()),
        Some(U::AutoConfig(_)) => Err(format!(
            "{at}.auto_config is not supported yet (the upstream protocol would come from ALPN); use explicit_http_config or use_downstream_protocol_config"
        )),
        Some(U::ExplicitHttpConfig(e))
            if matches!(
                e.protocol_config,
                Some(
                    envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::explicit_http_config::ProtocolConfig::Http3ProtocolOptions(_)
                )
            ) =>
        {
            Err(format!(
                "{at}.explicit_http_config.http3_protocol_options: HTTP/3 upstreams are not supported"
            ))
        }
        _ => Ok(None),
    }
}

/// `upstream_bind_config`: a source address (and extra ones per IP family) Portico binds
/// before connecting; the rest of Envoy's bind options are refused.
fn bind_config(b: &corepb::BindConfig) -> Result<Bind, String> {
    let ip = |sa: &corepb::SocketAddress, at: &str| -> Result<SocketAddr, String> {
        let addr = corepb::Address {
            address: Some(corepb::address::Address::SocketAddress(sa.clone())),
        };
        let (host, port) = socket_address(Some(&addr)).map_err(|e| format!("{at}: {e}"))?;
        let ip: std::net::IpAddr = host
            .parse()
            .map_err(|_| format!("{at}: malformed IP address: {host}"))?;
        Ok(SocketAddr::new(ip, port))
    };
    if b.freebind.as_ref().is_some_and(|f| f.value) {
        return Err("freebind is not supported".into());
    }
    if !b.socket_options.is_empty() {
        return Err("socket_options are not supported".into());
    }
    if b.local_address_selector.is_some() {
        return Err("local_address_selector is not supported".into());
    }
    let Some(source) = &b.source_address else {
        return Err("source_address is required".into());
    };
    let source = ip(source, "source_address")?;
    let mut extra = Vec::new();
    for (i, e) in b.extra_source_addresses.iter().enumerate() {
        let at = format!("extra_source_addresses[{i}]");
        if e.socket_options.is_some() {
            return Err(format!("{at}.socket_options are not supported"));
        }
        let Some(a) = &e.address else {
            return Err(format!("{at}.address is required"));
        };
        extra.push(ip(a, &format!("{at}.address"))?);
    }
    #[allow(deprecated)]
    for (i, a) in b.additional_source_addresses.iter().enumerate() {
        extra.push(ip(a, &format!("additional_source_addresses[{i}]"))?);
    }
    // Envoy: at most one extra address, of the other IP family than source_address.
    if extra.len() > 1 || extra.iter().any(|a| a.is_ipv4() == source.is_ipv4()) {
        return Err(
            "extra_source_addresses: at most one, of the other IP family than source_address"
                .into(),
        );
    }
    Ok(Bind { source, extra })
}

/// Istio's upstream network filters: both only observe the connection for telemetry.
const ISTIO_CLUSTER_FILTERS: &[&str] = &[
    // `istio.metadata_exchange`: exchanges peer metadata in-band only on a connection whose
    // ALPN is `istio-peer-exchange`; otherwise it passes bytes through untouched.
    "envoy.tcp.metadataexchange.config.MetadataExchange",
    // `upstream_hbone_peer_metadata`: reads the peer metadata of an HBONE tunnel's answer
    // for telemetry; it changes neither the host nor the bytes.
    "envoy.extensions.network_filters.peer_metadata.UpstreamConfig",
];

/// `udpa.type.v1.TypedStruct` / `xds.type.v3.TypedStruct`: a config named by its type URL.
#[derive(Clone, PartialEq, prost::Message)]
struct TypedStruct {
    #[prost(string, tag = "1")]
    type_url: String,
}

/// The config type of an `Any` (its full name), looking through a TypedStruct: istiod wraps
/// Istio's filter configs in one.
fn config_type(any: &envoy_types::pb::google::protobuf::Any) -> String {
    use prost::Message;
    let name = |url: &str| url.rsplit('/').next().unwrap_or_default().to_string();
    let outer = name(&any.type_url);
    if outer == "udpa.type.v1.TypedStruct" || outer == "xds.type.v3.TypedStruct" {
        if let Ok(t) = TypedStruct::decode(any.value.as_slice()) {
            return name(&t.type_url);
        }
    }
    outer
}

/// c-ares (istiod's choice, with `udp_max_queries`) and getaddrinfo answer from the system's
/// resolver configuration, as Portico's lookups do; c-ares given its own name servers does not.
fn system_resolver(t: &corepb::TypedExtensionConfig) -> bool {
    use envoy_types::pb::envoy::extensions::network::dns_resolver::cares::v3::CaresDnsResolverConfig;
    use prost::Message;
    let Some(any) = &t.typed_config else {
        return false;
    };
    match config_type(any).as_str() {
        "envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig" => {
            CaresDnsResolverConfig::decode(any.value.as_slice())
                .is_ok_and(|c| c.resolvers.is_empty())
        }
        "envoy.extensions.network.dns_resolver.getaddrinfo.v3.GetAddrInfoDnsResolverConfig" => true,
        _ => false,
    }
}

/// Fields Portico accepts without acting on them, each because it cannot change where a
/// request goes or whether it is allowed (the comment says why), and the fields it refuses.
#[allow(deprecated)]
fn accepted_fields(c: &cpb::Cluster) -> Result<(), String> {
    for (i, f) in c.filters.iter().enumerate() {
        let kind = f.typed_config.as_ref().map(config_type).unwrap_or_default();
        if !ISTIO_CLUSTER_FILTERS.contains(&kind.as_str()) {
            // Envoy's words for an extension it has no factory for.
            return Err(format!(
                "filters[{i}]: didn't find a registered implementation for '{}' with type URL: '{kind}'",
                f.name
            ));
        }
    }
    let refused = [
        ("lb_subset_config", c.lb_subset_config.is_some()),
        ("upstream_config", c.upstream_config.is_some()),
        ("queuing_policies", c.queuing_policies.is_some()),
        // Where names resolve: Portico uses the system resolver.
        ("dns_resolvers", !c.dns_resolvers.is_empty()),
        (
            "dns_resolution_config.resolvers",
            c.dns_resolution_config
                .as_ref()
                .is_some_and(|d| !d.resolvers.is_empty()),
        ),
        (
            "protocol_selection USE_DOWNSTREAM_PROTOCOL (use use_downstream_protocol_config)",
            c.protocol_selection != 0,
        ),
        (
            "common_lb_config.ignore_new_hosts_until_first_hc",
            c.common_lb_config
                .as_ref()
                .is_some_and(|l| l.ignore_new_hosts_until_first_hc),
        ),
        (
            "typed_dns_resolver_config (other than the system's resolver)",
            c.typed_dns_resolver_config
                .as_ref()
                .is_some_and(|t| !system_resolver(t)),
        ),
    ];
    if let Some((field, _)) = refused.iter().find(|(_, set)| *set) {
        return Err(format!("{field} is not supported yet"));
    }
    if let Some(d) = &c.dns_refresh_rate {
        // Envoy's proto rule; Portico re-resolves every DNS cluster every 5 s (Envoy's
        // default rate), so a rate (or `respect_dns_ttl`, `dns_jitter`,
        // `dns_failure_refresh_rate`) only changes how soon a DNS change is seen, never which
        // addresses a cluster gets.
        if duration(d).map_err(|e| format!("dns_refresh_rate: {e}"))? < Duration::from_millis(1) {
            return Err("dns_refresh_rate must be at least 1ms".into());
        }
    }
    // Accepted, deliberately:
    // - metadata: read only by filters and telemetry (Istio's `istio` service labels); no
    //   routing decision of Portico's reads cluster metadata.
    // - alt_stat_name, stats_matcher, track_cluster_stats, track_timeout_budgets: stats only.
    // - common_lb_config.zone_aware_lb_config: needs the bootstrap's local cluster, which
    //   Portico does not have; Envoy without one does no zone-aware routing either.
    //   override_host_status: read only by host-override (stateful session), which Portico
    //   does not run. update_merge_window, close_connections_on_host_set_change: timing and
    //   connection lifecycle.
    // - per_connection_buffer_limit_bytes (and its watermark timeout), preconnect_policy,
    //   connection_pool_per_downstream_connection, close_connections_on_host_health_failure,
    //   wait_for_warm_on_init, use_tcp_for_dns_lookups, lrs_server: buffering, pooling,
    //   start-up and reporting; the host chosen is the same.
    // - ignore_health_on_host_removal: Portico drops a host EDS removes at once, which is
    //   what the field's true asks (Envoy Gateway sets it); with false Envoy keeps a
    //   removed host that still passes its active checks until one fails.
    // - Endpoint.additional_addresses and happy_eyeballs_config: Portico connects to the
    //   endpoint's first address; Envoy tries the others only when that one fails.
    Ok(())
}

/// A typed load-balancing policy Portico implements, by its config type; `Some(Err)` when the
/// policy is known but its config is invalid (Envoy rejects the cluster then).
fn typed_policy(
    any: &envoy_types::pb::google::protobuf::Any,
    lb: &mut LbOptions,
) -> Option<Result<Policy, String>> {
    use envoy_types::pb::envoy::extensions::load_balancing_policies::{
        least_request, maglev, ring_hash, round_robin,
    };
    use prost::Message;
    let ok = |p| Some(Ok(p));
    match any.type_url.strip_prefix("type.googleapis.com/")? {
        "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin" => Some(
            round_robin::v3::RoundRobin::decode(any.value.as_slice())
                .map_err(|e| format!("RoundRobin: {e}"))
                .and_then(|r| {
                    *lb = LbOptions {
                        locality_weighted: typed_locality_weighted(r.locality_lb_config.as_ref()),
                        slow_start: typed_slow_start(r.slow_start_config.as_ref())
                            .map_err(|e| format!("RoundRobin.{e}"))?,
                        ..LbOptions::default()
                    };
                    Ok(Policy::RoundRobin)
                }),
        ),
        "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest" => Some(
            least_request::v3::LeastRequest::decode(any.value.as_slice())
                .map_err(|e| format!("LeastRequest: {e}"))
                .and_then(|r| {
                    // FULL_SCAN picks the least loaded of all hosts, not of `choice_count`.
                    if r.selection_method != 0 {
                        return Err(
                            "LeastRequest.selection_method: only N_CHOICES is supported".into()
                        );
                    }
                    *lb = LbOptions {
                        locality_weighted: typed_locality_weighted(r.locality_lb_config.as_ref()),
                        slow_start: typed_slow_start(r.slow_start_config.as_ref())
                            .map_err(|e| format!("LeastRequest.{e}"))?,
                        choice_count: choice_count(r.choice_count.as_ref())
                            .map_err(|e| format!("LeastRequest.{e}"))?,
                        active_request_bias: r
                            .active_request_bias
                            .as_ref()
                            .map_or(1.0, |b| b.default_value),
                    };
                    Ok(Policy::LeastRequest)
                }),
        ),
        "envoy.extensions.load_balancing_policies.random.v3.Random" => ok(Policy::Random),
        "envoy.extensions.load_balancing_policies.ring_hash.v3.RingHash" => Some(
            ring_hash::v3::RingHash::decode(any.value.as_slice())
                .map_err(|e| format!("RingHash: {e}"))
                .and_then(|r| {
                    lb.locality_weighted = r.locality_weighted_lb_config.is_some();
                    typed_ring_hash(&r).map_err(|e| format!("RingHash: {e}"))
                }),
        ),
        "envoy.extensions.load_balancing_policies.maglev.v3.Maglev" => Some(
            maglev::v3::Maglev::decode(any.value.as_slice())
                .map_err(|e| format!("Maglev: {e}"))
                .and_then(|m| {
                    lb.locality_weighted = m.locality_weighted_lb_config.is_some();
                    typed_maglev(&m).map_err(|e| format!("Maglev: {e}"))
                }),
        ),
        _ => None,
    }
}

fn typed_locality_weighted(
    c: Option<
        &envoy_types::pb::envoy::extensions::load_balancing_policies::common::v3::LocalityLbConfig,
    >,
) -> bool {
    use envoy_types::pb::envoy::extensions::load_balancing_policies::common::v3::locality_lb_config::LocalityConfigSpecifier as L;
    matches!(
        c.and_then(|c| c.locality_config_specifier.as_ref()),
        Some(L::LocalityWeightedLbConfig(_))
    )
}

fn typed_slow_start(
    c: Option<
        &envoy_types::pb::envoy::extensions::load_balancing_policies::common::v3::SlowStartConfig,
    >,
) -> Result<Option<crate::lb::SlowStart>, String> {
    match c {
        None => Ok(None),
        Some(c) => slow_start(
            c.slow_start_window.as_ref(),
            c.aggression.as_ref().map(|a| a.default_value),
            c.min_weight_percent.as_ref().map(|p| p.value),
        ),
    }
}

/// `slow_start_config`; a zero window turns it off, as in Envoy.
fn slow_start(
    window: Option<&envoy_types::pb::google::protobuf::Duration>,
    aggression: Option<f64>,
    min_weight_percent: Option<f64>,
) -> Result<Option<crate::lb::SlowStart>, String> {
    let window = match window {
        Some(d) => duration(d).map_err(|e| format!("slow_start_config.slow_start_window: {e}"))?,
        None => Duration::ZERO,
    };
    if window.is_zero() {
        return Ok(None);
    }
    let min = min_weight_percent.unwrap_or(10.0);
    if !(0.0..=100.0).contains(&min) {
        return Err(format!(
            "slow_start_config.min_weight_percent {min} must be in [0, 100]"
        ));
    }
    // Envoy logs an invalid aggression and uses 1.0.
    let aggression = aggression
        .filter(|a| *a > 0.0 && a.is_finite())
        .unwrap_or(1.0);
    Ok(Some(crate::lb::SlowStart {
        window,
        aggression,
        min_weight: min / 100.0,
    }))
}

fn choice_count(v: Option<&envoy_types::pb::google::protobuf::UInt32Value>) -> Result<u32, String> {
    match v.map(|v| v.value) {
        None => Ok(2),
        Some(n) if n < 2 => Err(format!(
            "choice_count: value must be greater than or equal to 2, got {n}"
        )),
        Some(n) => Ok(n),
    }
}

/// The legacy `lb_config` of round robin and least request, with `common_lb_config`'s
/// locality setting.
fn legacy_lb_options(c: &cpb::Cluster) -> Result<LbOptions, String> {
    use cpb::cluster::common_lb_config::LocalityConfigSpecifier as L;
    use cpb::cluster::LbConfig;
    let mut lb = LbOptions {
        locality_weighted: matches!(
            c.common_lb_config
                .as_ref()
                .and_then(|l| l.locality_config_specifier.as_ref()),
            Some(L::LocalityWeightedLbConfig(_))
        ),
        ..LbOptions::default()
    };
    let legacy = |s: &cpb::cluster::SlowStartConfig| {
        slow_start(
            s.slow_start_window.as_ref(),
            s.aggression.as_ref().map(|a| a.default_value),
            s.min_weight_percent.as_ref().map(|p| p.value),
        )
    };
    match &c.lb_config {
        Some(LbConfig::RoundRobinLbConfig(r)) => {
            if let Some(s) = &r.slow_start_config {
                lb.slow_start = legacy(s).map_err(|e| format!("round_robin_lb_config.{e}"))?;
            }
        }
        Some(LbConfig::LeastRequestLbConfig(r)) => {
            if let Some(s) = &r.slow_start_config {
                lb.slow_start = legacy(s).map_err(|e| format!("least_request_lb_config.{e}"))?;
            }
            lb.choice_count = choice_count(r.choice_count.as_ref())
                .map_err(|e| format!("least_request_lb_config.{e}"))?;
            lb.active_request_bias = r
                .active_request_bias
                .as_ref()
                .map_or(1.0, |b| b.default_value);
        }
        _ => {}
    }
    Ok(lb)
}

/// Envoy's proto limit for both ring sizes (2^23 entries).
const MAX_RING_SIZE: u64 = 8 * 1024 * 1024;
/// Envoy's proto limit for a Maglev table.
const MAX_MAGLEV_TABLE: u64 = 5_000_011;

fn ring_hash_policy(
    min: Option<u64>,
    max: Option<u64>,
    function: HashFunction,
) -> Result<Policy, String> {
    let Policy::RingHash {
        min_ring_size: default_min,
        max_ring_size: default_max,
        ..
    } = Policy::RING_HASH_DEFAULT
    else {
        return Err("ring hash defaults".into());
    };
    let (min, max) = (min.unwrap_or(default_min), max.unwrap_or(default_max));
    for (field, v) in [("minimum_ring_size", min), ("maximum_ring_size", max)] {
        if v > MAX_RING_SIZE {
            return Err(format!("{field} {v} must be at most {MAX_RING_SIZE}"));
        }
    }
    if min > max {
        return Err(format!(
            "ring hash: minimum_ring_size ({min}) > maximum_ring_size ({max})"
        ));
    }
    Ok(Policy::RingHash {
        min_ring_size: min,
        max_ring_size: max,
        function,
    })
}

fn maglev_policy(table_size: Option<u64>) -> Result<Policy, String> {
    let Policy::Maglev {
        table_size: default,
    } = Policy::MAGLEV_DEFAULT
    else {
        return Err("maglev defaults".into());
    };
    let size = table_size.unwrap_or(default);
    if size > MAX_MAGLEV_TABLE {
        return Err(format!(
            "table_size {size} must be at most {MAX_MAGLEV_TABLE}"
        ));
    }
    if !crate::lb::hash::is_prime(size) {
        return Err("The table size of maglev must be prime number".into());
    }
    Ok(Policy::Maglev { table_size: size })
}

/// What neither balancer implements yet: bounded loads and hashing by hostname (Portico keeps no
/// endpoint hostnames), and a cluster-level hash policy.
fn consistent_hashing_unsupported(
    use_hostname: bool,
    balance_factor: Option<u32>,
    cluster_hash_policy: bool,
) -> Result<(), String> {
    if use_hostname {
        return Err("use_hostname_for_hashing is not supported yet".into());
    }
    if balance_factor.is_some_and(|f| f > 0) {
        return Err("hash_balance_factor (bounded load) is not supported yet".into());
    }
    if cluster_hash_policy {
        return Err("consistent_hashing_lb_config.hash_policy is not supported yet; set hash_policy on the route".into());
    }
    Ok(())
}

fn legacy_consistent_hashing(c: &cpb::Cluster) -> Result<(), String> {
    let chc = c
        .common_lb_config
        .as_ref()
        .and_then(|l| l.consistent_hashing_lb_config.as_ref());
    consistent_hashing_unsupported(
        chc.is_some_and(|h| h.use_hostname_for_hashing),
        chc.and_then(|h| h.hash_balance_factor.as_ref())
            .map(|f| f.value),
        false,
    )
    .map_err(|e| format!("common_lb_config.consistent_hashing_lb_config: {e}"))
}

/// `lb_policy: RING_HASH` with the optional `ring_hash_lb_config`.
fn legacy_ring_hash(c: &cpb::Cluster) -> Result<Policy, String> {
    use cpb::cluster::ring_hash_lb_config::HashFunction as F;
    legacy_consistent_hashing(c)?;
    let Some(cpb::cluster::LbConfig::RingHashLbConfig(r)) = &c.lb_config else {
        return Ok(Policy::RING_HASH_DEFAULT);
    };
    let function = match F::try_from(r.hash_function) {
        Ok(F::XxHash) => HashFunction::XxHash,
        Ok(F::MurmurHash2) => HashFunction::MurmurHash2,
        Err(_) => {
            return Err(format!(
                "ring_hash_lb_config.hash_function: unknown value {}",
                r.hash_function
            ))
        }
    };
    ring_hash_policy(
        r.minimum_ring_size.as_ref().map(|v| v.value),
        r.maximum_ring_size.as_ref().map(|v| v.value),
        function,
    )
    .map_err(|e| format!("ring_hash_lb_config: {e}"))
}

/// `lb_policy: MAGLEV` with the optional `maglev_lb_config`.
fn legacy_maglev(c: &cpb::Cluster) -> Result<Policy, String> {
    legacy_consistent_hashing(c)?;
    let size = match &c.lb_config {
        Some(cpb::cluster::LbConfig::MaglevLbConfig(m)) => m.table_size.as_ref().map(|v| v.value),
        _ => None,
    };
    maglev_policy(size).map_err(|e| format!("maglev_lb_config: {e}"))
}

fn typed_consistent_hashing(
    chc: Option<&envoy_types::pb::envoy::extensions::load_balancing_policies::common::v3::ConsistentHashingLbConfig>,
) -> Result<(), String> {
    consistent_hashing_unsupported(
        chc.is_some_and(|h| h.use_hostname_for_hashing),
        chc.and_then(|h| h.hash_balance_factor.as_ref())
            .map(|f| f.value),
        chc.is_some_and(|h| !h.hash_policy.is_empty()),
    )
    .map_err(|e| format!("consistent_hashing_lb_config: {e}"))
}

fn typed_ring_hash(
    r: &envoy_types::pb::envoy::extensions::load_balancing_policies::ring_hash::v3::RingHash,
) -> Result<Policy, String> {
    use envoy_types::pb::envoy::extensions::load_balancing_policies::ring_hash::v3::ring_hash::HashFunction as F;
    #[allow(deprecated)]
    let (use_hostname, factor) = (
        r.use_hostname_for_hashing,
        r.hash_balance_factor.as_ref().map(|f| f.value),
    );
    // The deprecated top-level fields count only without consistent_hashing_lb_config.
    match &r.consistent_hashing_lb_config {
        Some(chc) => typed_consistent_hashing(Some(chc))?,
        None => consistent_hashing_unsupported(use_hostname, factor, false)?,
    }
    let function = match F::try_from(r.hash_function) {
        Ok(F::DefaultHash) | Ok(F::XxHash) => HashFunction::XxHash,
        Ok(F::MurmurHash2) => HashFunction::MurmurHash2,
        Err(_) => return Err(format!("hash_function: unknown value {}", r.hash_function)),
    };
    ring_hash_policy(
        r.minimum_ring_size.as_ref().map(|v| v.value),
        r.maximum_ring_size.as_ref().map(|v| v.value),
        function,
    )
}

fn typed_maglev(
    m: &envoy_types::pb::envoy::extensions::load_balancing_policies::maglev::v3::Maglev,
) -> Result<Policy, String> {
    typed_consistent_hashing(m.consistent_hashing_lb_config.as_ref())?;
    maglev_policy(m.table_size.as_ref().map(|v| v.value))
}

/// Envoy picks a transport socket by its `typed_config` type, and by name only without one.
pub fn is_raw_buffer(ts: &corepb::TransportSocket) -> bool {
    match &ts.config_type {
        Some(corepb::transport_socket::ConfigType::TypedConfig(a)) => {
            a.type_url
                == "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"
        }
        None => ts.name == "envoy.transport_sockets.raw_buffer",
    }
}

const HTTP_PROTOCOL_OPTIONS: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

/// The cluster's HTTP/1 options: in the protocol options extension (explicit, downstream-
/// protocol or auto config), else the deprecated cluster field.
fn upstream_h1<'a>(
    c: &'a cpb::Cluster,
    options: Option<
        &'a envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions,
    >,
) -> Option<&'a corepb::Http1ProtocolOptions> {
    use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
        explicit_http_config::ProtocolConfig, UpstreamProtocolOptions,
    };
    let h1 = options.and_then(|o| match o.upstream_protocol_options.as_ref()? {
        UpstreamProtocolOptions::ExplicitHttpConfig(e) => match &e.protocol_config {
            Some(ProtocolConfig::HttpProtocolOptions(h1)) => Some(h1),
            _ => None,
        },
        UpstreamProtocolOptions::UseDownstreamProtocolConfig(d) => d.http_protocol_options.as_ref(),
        UpstreamProtocolOptions::AutoConfig(a) => a.http_protocol_options.as_ref(),
    });
    #[allow(deprecated)]
    h1.or(c.http_protocol_options.as_ref())
}

/// Whether the cluster's HTTP/1 options name a `header_key_format`.
fn keeps_header_case(
    c: &cpb::Cluster,
    options: Option<&envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions>,
) -> bool {
    upstream_h1(c, options).is_some_and(|o| o.header_key_format.is_some())
}

/// The upstream HTTP/1 options that change what a response does: trailers relayed, a length
/// next to chunked taken, an absolute-form request line. Refused when set.
fn upstream_h1_options(
    c: &cpb::Cluster,
    options: Option<&envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions>,
) -> Result<(), String> {
    let Some(o) = upstream_h1(c, options) else {
        return Ok(());
    };
    let refused = [
        ("enable_trailers", o.enable_trailers),
        ("allow_chunked_length", o.allow_chunked_length),
        ("send_fully_qualified_url", o.send_fully_qualified_url),
    ];
    match refused.iter().find(|(_, set)| *set) {
        Some((field, _)) => Err(format!(
            "http_protocol_options.{field} is not supported on a cluster"
        )),
        None => Ok(()),
    }
}

/// The cluster's `HttpProtocolOptions` extension, if it has one.
fn protocol_options(
    c: &cpb::Cluster,
) -> Result<
    Option<envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions>,
    String,
> {
    use prost::Message;
    // Envoy refuses a name it does not know and applies those it does; TCP's options (an idle
    // timeout for tcp_proxy's upstream connections) change no answer here.
    if let Some(k) = c.typed_extension_protocol_options.keys().find(|k| {
        k.as_str() != HTTP_PROTOCOL_OPTIONS
            && k.as_str() != "envoy.extensions.upstreams.tcp.v3.TcpProtocolOptions"
    }) {
        return Err(format!(
            "typed_extension_protocol_options['{k}'] is not supported"
        ));
    }
    let Some(any) = c
        .typed_extension_protocol_options
        .get(HTTP_PROTOCOL_OPTIONS)
    else {
        return Ok(None);
    };
    let at = format!("typed_extension_protocol_options['{HTTP_PROTOCOL_OPTIONS}']");
    if any.type_url != format!("type.googleapis.com/{HTTP_PROTOCOL_OPTIONS}") {
        return Err(format!(
            "{at}: expected {HTTP_PROTOCOL_OPTIONS}, got {}",
            any.type_url
        ));
    }
    envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions::decode(
        any.value.as_slice(),
    )
    .map(Some)
    .map_err(|e| format!("{at}: cannot decode: {e}"))
}

fn health(status: i32) -> Health {
    use corepb::HealthStatus as HS;
    match HS::try_from(status) {
        Ok(HS::Unknown) | Ok(HS::Healthy) => Health::Healthy,
        Ok(HS::Degraded) => Health::Degraded,
        _ => Health::Unhealthy,
    }
}

/// `skip_pipes`: a static cluster's unix socket endpoints (istio-agent's `sds-grpc` and
/// `xds-grpc`) are left out of its hosts: only the SDS and ADS clients dial them, from the
/// bootstrap, and the HTTP data path cannot reach a pipe.
fn load_assignment_spec(
    la: &epb::ClusterLoadAssignment,
    allow_hostnames: bool,
    skip_pipes: bool,
) -> Result<LoadAssignmentSpec, String> {
    let mut spec = LoadAssignmentSpec::default();
    if let Some(p) = &la.policy {
        if let Some(f) = &p.overprovisioning_factor {
            if f.value == 0 {
                return Err("policy.overprovisioning_factor must be greater than 0".into());
            }
            spec.policy.overprovisioning = f.value;
        }
        spec.policy.weighted_priority_health = p.weighted_priority_health;
        if !p.drop_overloads.is_empty() {
            return Err("policy.drop_overloads is not supported yet".into());
        }
        // Envoy drops the endpoints of an assignment not renewed in that time.
        if p.endpoint_stale_after
            .as_ref()
            .is_some_and(|d| d.seconds != 0 || d.nanos != 0)
        {
            return Err("policy.endpoint_stale_after is not supported".into());
        }
    }
    // Localities by (priority, region, zone, sub_zone): endpoints listed under the same one
    // share its weight.
    let mut localities: Vec<(u32, &str, &str, &str)> = Vec::new();
    for (li, loc) in la.endpoints.iter().enumerate() {
        // Envoy then takes the locality's endpoints from LEDS, not from `lb_endpoints`.
        if matches!(
            loc.lb_config,
            Some(epb::locality_lb_endpoints::LbConfig::LedsClusterLocalityConfig(_))
        ) {
            return Err(format!(
                "endpoints[{li}].leds_cluster_locality_config: LEDS is not supported"
            ));
        }
        if loc.priority > 128 {
            return Err(format!(
                "endpoints[{li}].priority {} must be at most 128",
                loc.priority
            ));
        }
        if loc
            .load_balancing_weight
            .as_ref()
            .is_some_and(|w| w.value == 0)
        {
            return Err(format!(
                "endpoints[{li}].load_balancing_weight must be at least 1"
            ));
        }
        let key = loc.locality.as_ref().map_or(("", "", ""), |l| {
            (l.region.as_str(), l.zone.as_str(), l.sub_zone.as_str())
        });
        let key = (loc.priority, key.0, key.1, key.2);
        let weight = loc.load_balancing_weight.as_ref().map(|w| w.value);
        let locality = match localities.iter().position(|k| *k == key) {
            Some(i) => {
                if weight.is_some() {
                    spec.locality_weights[i] = weight;
                }
                i
            }
            None => {
                localities.push(key);
                spec.locality_weights.push(weight);
                localities.len() - 1
            }
        } as u32;
        for (ei, lb) in loc.lb_endpoints.iter().enumerate() {
            let at = format!("endpoints[{li}].lb_endpoints[{ei}]");
            let ep = match &lb.host_identifier {
                Some(epb::lb_endpoint::HostIdentifier::Endpoint(e)) => e,
                Some(_) => return Err(format!("{at}: endpoint_name is not supported")),
                None => return Err(format!("{at}: endpoint is required")),
            };
            let internal = match ep.address.as_ref().and_then(|a| a.address.as_ref()) {
                Some(corepb::address::Address::EnvoyInternalAddress(i)) => {
                    if allow_hostnames {
                        // A DNS cluster resolves names; an internal listener has none.
                        return Err(format!(
                            "{at}.endpoint.address: envoy_internal_address is not supported in DNS clusters"
                        ));
                    }
                    Some(
                        InternalAddr::translate(i, lb.metadata.as_ref())
                            .map_err(|e| format!("{at}.endpoint.address: {e}"))?,
                    )
                }
                _ => None,
            };
            let pipe = matches!(
                ep.address.as_ref().and_then(|a| a.address.as_ref()),
                Some(corepb::address::Address::Pipe(_))
            );
            if pipe && skip_pipes {
                continue;
            }
            let (host, port) = match &internal {
                Some((_, addr)) => (addr.ip().to_string(), addr.port()),
                None => socket_address(ep.address.as_ref())
                    .map_err(|e| format!("{at}.endpoint.address: {e}"))?,
            };
            if !allow_hostnames && host.parse::<std::net::IpAddr>().is_err() {
                return Err(format!(
                    "{at}.endpoint.address: malformed IP address: {host}"
                ));
            }
            // Port 0 is valid config to Envoy (its rule is only <= 65535); connecting fails later.
            let weight = lb.load_balancing_weight.as_ref().map_or(1, |w| w.value);
            if weight == 0 {
                return Err(format!("{at}.load_balancing_weight must be at least 1"));
            }
            let hostname = (!ep.hostname.is_empty()).then(|| Arc::from(ep.hostname.as_str()));
            let labels = super::upstream_tls::SocketLabels {
                endpoint: super::upstream_tls::labels(lb.metadata.as_ref()),
                locality: super::upstream_tls::labels(loc.metadata.as_ref()),
            };
            let labels = (labels != Default::default()).then(|| Arc::new(labels));
            spec.endpoints.push(SpecEndpoint {
                workload: istio_workload(lb.metadata.as_ref()),
                labels,
                internal: internal.map(|(i, _)| i),
                host,
                port,
                weight,
                health: health(lb.health_status),
                priority: loc.priority,
                locality,
                hostname,
            });
        }
    }
    Ok(spec)
}

/// An endpoint's `istio` filter metadata `workload` string, parsed (see `Host::workload`).
fn istio_workload(
    md: Option<&corepb::Metadata>,
) -> Option<Arc<crate::telemetry::istio_stats::PeerInfo>> {
    use envoy_types::pb::google::protobuf::value::Kind;
    let v = md?.filter_metadata.get("istio")?.fields.get("workload")?;
    match &v.kind {
        Some(Kind::StringValue(s)) => {
            crate::telemetry::istio_stats::PeerInfo::from_endpoint(s).map(Arc::new)
        }
        _ => None,
    }
}

impl LoadAssignment {
    /// A ClusterLoadAssignment from EDS: every address must be an IP literal.
    pub fn translate(la: &epb::ClusterLoadAssignment) -> Result<LoadAssignment, TranslateError> {
        if la.cluster_name.is_empty() {
            return Err(TranslateError::new(
                "endpoints ''",
                "cluster_name must not be empty",
            ));
        }
        let at = |e| TranslateError::new(format!("endpoints '{}'", la.cluster_name), e);
        let spec = load_assignment_spec(la, false, false).map_err(at)?;
        let mut out = LoadAssignment::from_resolved(&spec, |h| h.parse().ok());
        out.checks = super::health_check::endpoint_checks(la).map_err(at)?;
        Ok(out)
    }

    fn host(e: &SpecEndpoint, ip: std::net::IpAddr, hostname: Option<Arc<str>>) -> Host {
        Host {
            addr: SocketAddr::new(ip, e.port),
            weight: e.weight,
            health: e.health,
            priority: e.priority,
            locality: e.locality,
            hostname,
            labels: e.labels.clone(),
            internal: e.internal.clone(),
            workload: e.workload.clone(),
        }
    }

    /// Builds the host list, resolving each endpoint's host with `resolve` (skipping failures).
    pub fn from_resolved(
        spec: &LoadAssignmentSpec,
        resolve: impl Fn(&str) -> Option<std::net::IpAddr>,
    ) -> LoadAssignment {
        let hosts = spec
            .endpoints
            .iter()
            .filter_map(|e| Some(Self::host(e, resolve(&e.host)?, e.hostname.clone())))
            .collect();
        LoadAssignment {
            hosts,
            locality_weights: spec.locality_weights.clone(),
            policy: spec.policy,
            ..Default::default()
        }
    }

    /// Builds the host list of a DNS cluster: every address a name resolved to is a host,
    /// named (for `auto_host_rewrite`) by the endpoint's hostname or else the name resolved.
    pub fn from_dns(
        spec: &LoadAssignmentSpec,
        resolved: &std::collections::BTreeMap<String, Vec<std::net::IpAddr>>,
    ) -> LoadAssignment {
        let mut hosts = Vec::new();
        for e in &spec.endpoints {
            let (ips, name): (Vec<std::net::IpAddr>, _) = match e.host.parse() {
                Ok(ip) => (vec![ip], e.hostname.clone()),
                Err(_) => (
                    resolved.get(&e.host).cloned().unwrap_or_default(),
                    e.hostname
                        .clone()
                        .or_else(|| Some(Arc::from(e.host.as_str()))),
                ),
            };
            for ip in ips {
                hosts.push(Self::host(e, ip, name.clone()));
            }
        }
        LoadAssignment {
            hosts,
            locality_weights: spec.locality_weights.clone(),
            policy: spec.policy,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_family_keeps_the_wanted_addresses() {
        let v4: std::net::IpAddr = [127, 0, 0, 1].into();
        let v6: std::net::IpAddr = std::net::Ipv6Addr::LOCALHOST.into();
        let both = [v4, v6];
        assert_eq!(DnsFamily::Auto.filter(&both), vec![v6]);
        assert_eq!(DnsFamily::Auto.filter(&[v4]), vec![v4]);
        assert_eq!(DnsFamily::V4Only.filter(&both), vec![v4]);
        assert_eq!(
            DnsFamily::V6Only.filter(&[v4]),
            Vec::<std::net::IpAddr>::new()
        );
        assert_eq!(DnsFamily::V4Preferred.filter(&both), vec![v4]);
        assert_eq!(DnsFamily::V4Preferred.filter(&[v6]), vec![v6]);
        assert_eq!(DnsFamily::All.filter(&both), both.to_vec());
    }

    #[test]
    fn strict_dns_makes_every_address_a_host() {
        let spec = LoadAssignmentSpec {
            endpoints: vec![
                SpecEndpoint {
                    host: "svc.local".into(),
                    port: 80,
                    weight: 2,
                    health: Health::Healthy,
                    priority: 0,
                    locality: 0,
                    hostname: None,
                    labels: None,
                    internal: None,
                    workload: None,
                },
                SpecEndpoint {
                    host: "10.0.0.9".into(),
                    port: 81,
                    weight: 1,
                    health: Health::Healthy,
                    priority: 0,
                    locality: 0,
                    hostname: None,
                    labels: None,
                    internal: None,
                    workload: None,
                },
            ],
            ..Default::default()
        };
        let mut resolved = std::collections::BTreeMap::new();
        resolved.insert(
            "svc.local".to_string(),
            vec![[10, 0, 0, 1].into(), [10, 0, 0, 2].into()],
        );
        let la = LoadAssignment::from_dns(&spec, &resolved);
        let addrs: Vec<String> = la.hosts.iter().map(|h| h.addr.to_string()).collect();
        assert_eq!(addrs, vec!["10.0.0.1:80", "10.0.0.2:80", "10.0.0.9:81"]);
        assert!(la.hosts[..2].iter().all(|h| h.weight == 2));
        // auto_host_rewrite names a DNS host by the name it was resolved from.
        assert_eq!(la.hosts[0].hostname.as_deref(), Some("svc.local"));
        assert_eq!(la.hosts[2].hostname, None);
    }
}
#[cfg(test)]
#[path = "cluster_tests.rs"]
mod cluster_tests;
