//! Envoy's stream info: what happened to one request (or one TCP connection), as access logs,
//! Istio's metrics and traces read it. Filled by the request path phase by phase; read once at
//! the end.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

listed_enum! {
/// Envoy's response flags, in Envoy's order (the order `%RESPONSE_FLAGS%` lists them in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ResponseFlag {
    FailedLocalHealthCheck,
    NoHealthyUpstream,
    UpstreamRequestTimeout,
    LocalReset,
    UpstreamRemoteReset,
    UpstreamConnectionFailure,
    UpstreamConnectionTermination,
    UpstreamOverflow,
    NoRouteFound,
    DelayInjected,
    FaultInjected,
    RateLimited,
    UnauthorizedExternalService,
    RateLimitServiceError,
    DownstreamConnectionTermination,
    UpstreamRetryLimitExceeded,
    StreamIdleTimeout,
    InvalidEnvoyRequestHeaders,
    DownstreamProtocolError,
    UpstreamMaxStreamDurationReached,
    ResponseFromCacheFilter,
    NoFilterConfigFound,
    DurationTimeout,
    UpstreamProtocolError,
    NoClusterFound,
    OverloadManager,
    DnsResolutionFailed,
    DropOverLoad,
    DownstreamRemoteReset,
    UnconditionalDropOverload,
}
}

/// (short, long) names, indexed by the flag.
const NAMES: [(&str, &str); 30] = [
    ("LH", "FailedLocalHealthCheck"),
    ("UH", "NoHealthyUpstream"),
    ("UT", "UpstreamRequestTimeout"),
    ("LR", "LocalReset"),
    ("UR", "UpstreamRemoteReset"),
    ("UF", "UpstreamConnectionFailure"),
    ("UC", "UpstreamConnectionTermination"),
    ("UO", "UpstreamOverflow"),
    ("NR", "NoRouteFound"),
    ("DI", "DelayInjected"),
    ("FI", "FaultInjected"),
    ("RL", "RateLimited"),
    ("UAEX", "UnauthorizedExternalService"),
    ("RLSE", "RateLimitServiceError"),
    ("DC", "DownstreamConnectionTermination"),
    ("URX", "UpstreamRetryLimitExceeded"),
    ("SI", "StreamIdleTimeout"),
    ("IH", "InvalidEnvoyRequestHeaders"),
    ("DPE", "DownstreamProtocolError"),
    ("UMSDR", "UpstreamMaxStreamDurationReached"),
    ("RFCF", "ResponseFromCacheFilter"),
    ("NFCF", "NoFilterConfigFound"),
    ("DT", "DurationTimeout"),
    ("UPE", "UpstreamProtocolError"),
    ("NC", "NoClusterFound"),
    ("OM", "OverloadManager"),
    ("DF", "DnsResolutionFailed"),
    ("DO", "DropOverLoad"),
    ("DR", "DownstreamRemoteReset"),
    ("UDO", "UnconditionalDropOverload"),
];

impl ResponseFlag {
    /// Envoy's short name (`UH`), as `%RESPONSE_FLAGS%` and Istio's `response_flags` show it.
    pub fn short(self) -> &'static str {
        NAMES[self as usize].0
    }

    /// Envoy's long name (`NoHealthyUpstream`), as `%RESPONSE_FLAGS_LONG%` shows it.
    pub fn long(self) -> &'static str {
        NAMES[self as usize].1
    }

    /// The flag a short name names (access log filters name flags this way).
    pub fn from_short(s: &str) -> Option<ResponseFlag> {
        NAMES
            .iter()
            .position(|(n, _)| *n == s)
            .map(|i| ResponseFlag::ALL[i])
    }
}

/// A set of response flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResponseFlags(u32);

impl ResponseFlags {
    pub fn set(&mut self, f: ResponseFlag) {
        self.0 |= 1 << f as u32;
    }

    pub fn has(self, f: ResponseFlag) -> bool {
        self.0 & (1 << f as u32) != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn iter(self) -> impl Iterator<Item = ResponseFlag> {
        ResponseFlag::ALL.into_iter().filter(move |f| self.has(*f))
    }

    /// As `%RESPONSE_FLAGS%`: short names joined by `,` in Envoy's order, `-` when none.
    pub fn short_string(self) -> Cow<'static, str> {
        self.joined(ResponseFlag::short)
    }

    /// As `%RESPONSE_FLAGS_LONG%`.
    pub fn long_string(self) -> Cow<'static, str> {
        self.joined(ResponseFlag::long)
    }

    fn joined(self, name: fn(ResponseFlag) -> &'static str) -> Cow<'static, str> {
        let mut it = self.iter();
        let Some(first) = it.next() else {
            return Cow::Borrowed("-");
        };
        let Some(second) = it.next() else {
            return Cow::Borrowed(name(first));
        };
        let mut s = String::from(name(first));
        for f in std::iter::once(second).chain(it) {
            s.push(',');
            s.push_str(name(f));
        }
        Cow::Owned(s)
    }
}

/// The downstream protocol, as `%PROTOCOL%` and Istio's `request_protocol` name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    Http10,
    #[default]
    Http11,
    Http2,
    /// A TCP connection (tcp_proxy): no HTTP.
    Tcp,
}

impl Protocol {
    /// Envoy's name (`%PROTOCOL%`); `-` for TCP.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Http10 => "HTTP/1.0",
            Protocol::Http11 => "HTTP/1.1",
            Protocol::Http2 => "HTTP/2",
            Protocol::Tcp => "-",
        }
    }
}

/// What the telemetry knows of the upstream cluster a request went to: built once per cluster
/// at translation, shared by every request to it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct UpstreamInfo {
    /// The cluster's name (`%UPSTREAM_CLUSTER_RAW%`).
    pub name: Arc<str>,
    /// `alt_stat_name` when set, else the name (`%UPSTREAM_CLUSTER%`, Envoy's observability
    /// name).
    pub observability_name: Arc<str>,
    /// The cluster's `istio` filter metadata (`services`, `external`, `disable_mx`): Istio's
    /// destination service labels, and whether peer metadata headers go to it.
    pub istio: crate::telemetry::istio_stats::IstioClusterMetadata,
}

/// One request's (or TCP connection's) record. Times are offsets from `started`.
#[derive(Debug, Clone)]
pub struct StreamInfo {
    /// Wall clock at the start (`%START_TIME%`): `start_time()`, worked out when first
    /// asked for. Most requests log nothing and are traced by nobody, and a reading of the
    /// wall clock for each cost ~25 ns.
    start_wall: OnceLock<SystemTime>,
    pub started: Instant,
    pub protocol: Protocol,
    /// The downstream peer as the connection manager decided it (XFF when trusted):
    /// `%DOWNSTREAM_REMOTE_ADDRESS%`.
    pub downstream_remote: Option<SocketAddr>,
    /// The connection's peer: `%DOWNSTREAM_DIRECT_REMOTE_ADDRESS%`.
    pub downstream_direct_remote: Option<SocketAddr>,
    /// The address the connection was accepted on: `%DOWNSTREAM_LOCAL_ADDRESS%`.
    pub downstream_local: Option<SocketAddr>,
    /// The TLS SNI the client sent: `%REQUESTED_SERVER_NAME%`.
    pub requested_server_name: Option<Arc<str>>,
    /// The downstream connection is TLS; `downstream_peer_uri_san`: the client certificate's
    /// first URI SAN (mTLS), Istio's `source_principal`.
    pub downstream_tls: bool,
    pub downstream_peer_uri_san: Option<Arc<str>>,
    /// The matched route's name (`%ROUTE_NAME%`).
    pub route_name: Option<Arc<str>>,
    /// The cluster the router chose (`%UPSTREAM_CLUSTER%`).
    pub upstream: Option<Arc<UpstreamInfo>>,
    /// The host of the last attempt (`%UPSTREAM_HOST%`).
    pub upstream_host: Option<SocketAddr>,
    /// The local address of the last attempt's upstream connection.
    pub upstream_local: Option<SocketAddr>,
    /// `%UPSTREAM_TRANSPORT_FAILURE_REASON%`.
    pub upstream_transport_failure_reason: Option<String>,
    /// The response code sent downstream; 0: none (the client or the gateway reset the
    /// stream first).
    pub response_code: u16,
    /// Envoy's response code details (`via_upstream`, `route_not_found`, ...).
    pub response_code_details: Cow<'static, str>,
    pub flags: ResponseFlags,
    /// Request and response body bytes (`%BYTES_RECEIVED%`, `%BYTES_SENT%`); for TCP, the
    /// bytes read from and written to the downstream connection.
    pub bytes_received: u64,
    pub bytes_sent: u64,
    /// The request's last byte was read (`%REQUEST_DURATION%`).
    pub last_downstream_rx: Option<Duration>,
    /// The first upstream attempt started (`%REQUEST_TX_DURATION%` is its end).
    pub first_upstream_tx: Option<Duration>,
    /// The upstream response's first byte (`%RESPONSE_DURATION%`).
    pub first_upstream_rx: Option<Duration>,
    /// The response's last byte was sent (`%DURATION%`); None: set at the end.
    pub last_downstream_tx: Option<Duration>,
    /// Upstream attempts made (`%UPSTREAM_REQUEST_ATTEMPT_COUNT%`).
    pub attempts: u32,
    /// The response's gRPC status (trailers, or headers for trailers-only).
    pub grpc_status: Option<u32>,
    /// `%CONNECTION_ID%`.
    pub connection_id: u64,
    /// The request is gRPC (`content-type: application/grpc*`): Istio's `request_protocol`
    /// is `grpc` and its `grpc_response_status` is reported.
    pub grpc_request: bool,
    /// The chosen endpoint's `istio` filter metadata `workload`
    /// (`name;namespace;canonical_service;canonical_revision;cluster`), parsed at
    /// translation: Istio's destination labels when the upstream sent no peer metadata.
    pub upstream_workload: Option<Arc<crate::telemetry::istio_stats::PeerInfo>>,
    /// The peers `istio.metadata_exchange` found: the downstream's in the request headers,
    /// the upstream's in the response headers.
    pub peers: crate::telemetry::istio_stats::Peers,
    /// The request's and the response's head as they go on the wire in HTTP/1 form (start
    /// line, headers, blank line), measured only when an observer needs them (`istio.stats`:
    /// istio-proxy's byte histograms read Envoy's wire byte meters, which count heads and
    /// bodies; for HTTP/2 this is the uncompressed size, not the HPACK frames').
    pub request_head_bytes: u64,
    pub response_head_bytes: u64,
    /// Request values the connection manager's `istio.stats` dimensions read (its
    /// `StatsConfig::captures`, in order); empty when it needs none.
    pub istio_attributes: Vec<Option<String>>,
    /// The gRPC stats filter's filter state (`emit_filter_state`): messages each way.
    pub grpc_messages: Option<(u64, u64)>,
}

impl Default for StreamInfo {
    fn default() -> StreamInfo {
        StreamInfo::new(Protocol::Http11)
    }
}

impl StreamInfo {
    pub fn new(protocol: Protocol) -> StreamInfo {
        StreamInfo {
            start_wall: OnceLock::new(),
            started: Instant::now(),
            protocol,
            downstream_remote: None,
            downstream_direct_remote: None,
            downstream_local: None,
            requested_server_name: None,
            downstream_tls: false,
            downstream_peer_uri_san: None,
            route_name: None,
            upstream: None,
            upstream_host: None,
            upstream_local: None,
            upstream_transport_failure_reason: None,
            response_code: 0,
            response_code_details: Cow::Borrowed(""),
            flags: ResponseFlags::default(),
            bytes_received: 0,
            bytes_sent: 0,
            last_downstream_rx: None,
            first_upstream_tx: None,
            first_upstream_rx: None,
            last_downstream_tx: None,
            attempts: 0,
            grpc_status: None,
            connection_id: 0,
            grpc_request: false,
            upstream_workload: None,
            peers: Default::default(),
            istio_attributes: Vec::new(),
            request_head_bytes: 0,
            response_head_bytes: 0,
            grpc_messages: None,
        }
    }

    /// The wall clock at the start: the wall clock now less the time since the start (one
    /// reading of each clock, a few nanoseconds apart), then the same for the stream's life.
    pub fn start_time(&self) -> SystemTime {
        *self.start_wall.get_or_init(|| {
            let now = SystemTime::now();
            now.checked_sub(self.elapsed()).unwrap_or(now)
        })
    }

    /// `start_time` from `elapsed`, the time since the start as just read, when nothing has
    /// asked for it yet: the stream's end, which reads that time anyway, then costs one
    /// reading of the wall clock.
    pub fn settle_start_time(&mut self, elapsed: Duration) {
        if self.start_wall.get().is_none() {
            let now = SystemTime::now();
            let _ = self.start_wall.set(now.checked_sub(elapsed).unwrap_or(now));
        }
    }

    /// Sets the wall clock at the start (tests' fixed times).
    pub fn set_start_time(&mut self, t: SystemTime) {
        self.start_wall = OnceLock::from(t);
    }

    /// Time since the start.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// `%DURATION%`: the whole stream.
    pub fn duration(&self) -> Duration {
        self.last_downstream_tx.unwrap_or_else(|| self.elapsed())
    }

    pub fn set_details(&mut self, d: impl Into<Cow<'static, str>>) {
        self.response_code_details = d.into();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_time_is_the_wall_clock_at_the_start_and_stays_put() {
        // Only a step of the wall clock by more than the slack between these readings,
        // microseconds apart, could fail this.
        let slack = Duration::from_millis(50);
        let before = SystemTime::now();
        let i = StreamInfo::new(Protocol::Http11);
        let after = SystemTime::now();
        let t = i.start_time();
        assert!(
            t + slack >= before && t <= after + slack,
            "{t:?} not in {before:?}..{after:?}"
        );
        assert_eq!(i.start_time(), t, "worked out once, then the same");

        // Settled at the stream's end from the time since the start it read.
        let mut s = StreamInfo::new(Protocol::Http11);
        let begun = SystemTime::now();
        let elapsed = Duration::from_secs(3);
        s.settle_start_time(elapsed);
        let t = s.start_time();
        assert!(t + elapsed + slack >= begun && t + elapsed <= SystemTime::now() + slack);
        // Once worked out (or asked for), a later settle leaves it.
        s.settle_start_time(Duration::ZERO);
        assert_eq!(s.start_time(), t);
        let fixed = SystemTime::UNIX_EPOCH + Duration::from_secs(1_796_224_485);
        s.set_start_time(fixed);
        assert_eq!(s.start_time(), fixed);
        let copy = s.clone();
        assert_eq!(copy.start_time(), fixed);
    }

    #[test]
    fn flags_list_in_envoys_order() {
        let mut f = ResponseFlags::default();
        assert_eq!(f.short_string(), "-");
        f.set(ResponseFlag::UpstreamRetryLimitExceeded);
        assert_eq!(f.short_string(), "URX");
        f.set(ResponseFlag::UpstreamConnectionFailure);
        f.set(ResponseFlag::NoHealthyUpstream);
        assert_eq!(f.short_string(), "UH,UF,URX");
        assert_eq!(
            f.long_string(),
            "NoHealthyUpstream,UpstreamConnectionFailure,UpstreamRetryLimitExceeded"
        );
        assert_eq!(
            ResponseFlag::from_short("NR"),
            Some(ResponseFlag::NoRouteFound)
        );
        assert_eq!(ResponseFlag::from_short("XX"), None);
        for (i, f) in ResponseFlag::ALL.iter().enumerate() {
            assert_eq!(*f as usize, i);
        }
    }
}
