//! Listeners (LDS or bootstrap `static_resources.listeners`): filter chains, each with one HTTP
//! connection manager and optionally TLS.

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::config::listener::v3 as lpb;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::filter_chain::{select, ChainMatch, Conn};
use super::route::RouteTable;
use super::sources::DataSources;
use super::tcp_proxy::{TcpProxy, TCP_PROXY_TYPE};
use super::tls::{DownstreamTls, DOWNSTREAM_TLS_TYPE, TLS_INSPECTOR_TYPE};
use super::{socket_address, TranslateError};
pub use crate::filters::alpn::AlpnOverride;
use crate::filters::telemetry::{config_type, istio_telemetry, MX_NETWORK_TYPE};
use crate::filters::{HttpFilter, Translated};
use crate::telemetry::access_log::AccessLogs;
use crate::telemetry::istio_stats::{StatsConfig, STATS_TYPE};

pub const HCM_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
pub const ROUTER_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";

#[derive(Debug)]
pub struct ListenerDef {
    pub name: String,
    /// `address`: the primary address (the stats scope and `/listeners` name it first).
    pub addr: SocketAddr,
    /// Every socket the listener binds: `address`, then each of `additional_addresses`
    /// (istiod's dual stack: `0.0.0.0:P` plus `[::]:P`). All of them serve the same filter
    /// chains, are bound and released together, and are checked together for conflicts.
    pub binds: Vec<ListenAddr>,
    /// `filter_chains` in order, then `default_filter_chain` if there is one.
    pub chains: Vec<Arc<ChainDef>>,
    /// The criteria of the `filter_chains` (the default chain has none).
    pub matches: Vec<ChainMatch>,
    pub has_default: bool,
    /// The listener filters that act on a connection, in configured order (Envoy runs them
    /// in order: a PROXY header listed before the TLS inspector is read off first).
    pub listener_filters: Vec<ListenerFilter>,
    /// `envoy.filters.listener.tls_inspector` is configured: SNI and ALPN are read from the
    /// ClientHello before the chain is picked. Without it Envoy sees neither.
    pub tls_inspector: bool,
    /// `bind_to_port` (default true). An unbound listener only gets connections another
    /// listener hands over by their original destination (`use_original_dst`), which Portico
    /// refuses, so such a listener is kept but never bound, as Envoy keeps it.
    pub bind_to_port: bool,
    /// `listener_filters_timeout` (default 15 s; zero: none).
    pub listener_filters_timeout: Option<std::time::Duration>,
    pub continue_on_listener_filters_timeout: bool,
    /// `ignore_global_conn_limit`: the overload manager's global downstream connection limit
    /// does not apply to this listener (istio-agent's 15021 and 15090 listeners).
    pub ignore_global_conn_limit: bool,
    /// The `listener.<name>.*` stats scope: `stat_prefix`, else the address as Envoy writes
    /// it (`0.0.0.0_443`).
    pub stat_name: String,
    /// `internal_listener`: bound to no socket (`addr` is unspecified and `bind_to_port`
    /// false); endpoints with an `envoy_internal_address` naming it connect through its
    /// chain. Only one tcp_proxy chain is supported on such a listener (see `translate`).
    pub internal: bool,
    /// The `envoy.filters.listener.original_dst` listener filter is configured: on an
    /// internal connection it restores the local address from the `local` field of the
    /// `envoy.filters.listener.original_dst` metadata the connection carries.
    pub original_dst: bool,
    /// The listener's `access_log`: Envoy writes it for connections no filter chain took
    /// (istiod renders one filtered on the NR flag).
    pub access_log: AccessLogs,
    /// The listener's own config: its proto without `filter_chains` and
    /// `default_filter_chain`. When a push changes it, Envoy replaces the whole listener and
    /// drains every connection; when only chains change, only theirs.
    pub level: lpb::Listener,
}

/// One listening socket of a listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddr {
    pub addr: SocketAddr,
    /// IPV6_V6ONLY. Envoy binds an IPv6 address for IPv6 alone unless `ipv4_compat` is set,
    /// which is what lets `0.0.0.0:P` and `[::]:P` be two sockets of one dual-stack listener.
    pub v6only: bool,
}

impl ListenerDef {
    /// `traffic_direction: INBOUND` (what `/drain_listeners?inboundonly` drains).
    pub fn is_inbound(&self) -> bool {
        self.level.traffic_direction
            == envoy_types::pb::envoy::config::core::v3::TrafficDirection::Inbound as i32
    }

    /// The distinct addresses to bind, in configured order. Envoy 1.40 accepts an address
    /// listed twice in one listener (with its default `reuse_port` both sockets bind); one
    /// socket serves it here, which accepts the same connections.
    pub fn bind_addrs(&self) -> Vec<ListenAddr> {
        let mut out: Vec<ListenAddr> = Vec::with_capacity(self.binds.len());
        for b in &self.binds {
            if !out.iter().any(|o| o.addr == b.addr) {
                out.push(*b);
            }
        }
        out
    }

    /// Whether `other` listens on the same set of addresses (order aside), as Envoy's
    /// `hasCompatibleAddress` decides whether an update may keep the old sockets.
    pub fn same_addresses(&self, other: &ListenerDef) -> bool {
        let mut a: Vec<SocketAddr> = self.bind_addrs().iter().map(|b| b.addr).collect();
        let mut b: Vec<SocketAddr> = other.bind_addrs().iter().map(|b| b.addr).collect();
        a.sort();
        b.sort();
        a == b
    }
}

/// The socket address of `address` or an `additional_addresses[]` entry (`primary`: the
/// listener's `address`, for an additional one). Envoy checks each additional
/// address's `ipv4_compat` against the primary address, not its own (Envoy 1.40 refuses
/// `0.0.0.0:P` plus `[::]:P` with `ipv4_compat`), and so does this.
fn listen_addr(
    a: Option<&corepb::Address>,
    primary: Option<SocketAddr>,
) -> Result<ListenAddr, String> {
    let (host, port) = socket_address(a)?;
    let ip: std::net::IpAddr = host
        .parse()
        .map_err(|_| format!("malformed IP address: {host}"))?;
    let addr = SocketAddr::new(ip, port);
    let compat = matches!(
        a.and_then(|a| a.address.as_ref()),
        Some(corepb::address::Address::SocketAddress(sa)) if sa.ipv4_compat
    );
    if compat {
        // Only `::` or an IPv4-mapped IPv6 address may accept IPv4 too.
        let checked = primary.unwrap_or(addr);
        let ok = match checked.ip() {
            std::net::IpAddr::V6(v6) => v6.is_unspecified() || v6.to_ipv4_mapped().is_some(),
            std::net::IpAddr::V4(_) => false,
        };
        if !ok {
            return Err(format!(
                "Only IPv6 address '::' or valid IPv4-mapped IPv6 address can set ipv4_compat: {checked}"
            ));
        }
    }
    Ok(ListenAddr {
        addr,
        v6only: addr.is_ipv6() && !compat,
    })
}

/// A listener filter that does something to the connection, in the listener's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenerFilter {
    TlsInspector,
    ProxyProtocol(Arc<ProxyProtocol>),
}

/// `envoy.filters.listener.proxy_protocol`: the connection starts with a PROXY protocol header
/// (v1 or v2) whose source becomes the downstream remote address and whose destination the
/// local address, before any other listener filter after it sees a byte.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProxyProtocol {
    /// `allow_requests_without_proxy_protocol`: a connection whose first bytes cannot start a
    /// PROXY header goes on untouched.
    pub allow_without: bool,
    /// Not in `disallowed_versions`.
    pub allow_v1: bool,
    pub allow_v2: bool,
    /// `stat_prefix`: the stats are `proxy_proto.[<stat_prefix>.]...`.
    pub stat_prefix: String,
}

pub const PROXY_PROTOCOL_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.listener.proxy_protocol.v3.ProxyProtocol";
const HTTP_INSPECTOR_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.listener.http_inspector.v3.HttpInspector";
const ORIGINAL_DST_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst";

impl ProxyProtocol {
    fn translate(any: &Any) -> Result<ProxyProtocol, String> {
        use envoy_types::pb::envoy::extensions::filters::listener::proxy_protocol::v3 as pp;
        let c: pp::ProxyProtocol = unpack(any, PROXY_PROTOCOL_TYPE, "proxy_protocol")?;
        // TLVs go to dynamic metadata, which only metadata readers (RBAC, access logs, the
        // router's metadata matchers) use; none of Portico's reads it yet, so a config that
        // relies on them is refused rather than half served.
        if !c.rules.is_empty() {
            return Err(
                "proxy_protocol.rules: TLVs as dynamic metadata are not supported (nothing in Portico reads dynamic metadata yet)"
                    .into(),
            );
        }
        // `pass_through_tlvs` (and `tlv_location`) only feed an upstream PROXY protocol
        // transport socket, which Portico's clusters do not have: accepted, it cannot matter.
        let mut allow_v1 = true;
        let mut allow_v2 = true;
        for v in &c.disallowed_versions {
            match *v {
                0 => allow_v1 = false,
                1 => allow_v2 = false,
                other => {
                    return Err(format!(
                        "proxy_protocol.disallowed_versions: unknown version {other}"
                    ))
                }
            }
        }
        if !allow_v1 && !allow_v2 {
            return Err("Proxy Protocol filter is misconfigured: all proxy protocol versions are disallowed.".into());
        }
        Ok(ProxyProtocol {
            allow_without: c.allow_requests_without_proxy_protocol,
            allow_v1,
            allow_v2,
            stat_prefix: c.stat_prefix,
        })
    }
}

/// A network filter that decides whether a connection goes on.
#[derive(Debug, Clone)]
pub enum NetworkPolicy {
    Rbac(Arc<crate::filters::rbac::NetworkRbac>),
    ExtAuthz(Arc<crate::filters::ext_authz::NetworkExtAuthz>),
}

/// One filter chain: how it terminates the transport, and its network filter.
#[derive(Debug)]
pub struct ChainDef {
    pub name: String,
    /// The listener's address (the request path reads it for `strip_matching_host_port`).
    pub addr: SocketAddr,
    pub tls: Option<Arc<DownstreamTls>>,
    /// `transport_socket_connect_timeout`: how long the TLS handshake may take (istiod sets
    /// it on gateway chains against slow handshakes). None: no limit, Envoy's default.
    pub handshake_timeout: Option<std::time::Duration>,
    pub filter: NetworkFilter,
    /// The network `istio.stats` filter in front of a tcp_proxy: Istio's TCP metrics for
    /// each connection. (On an HTTP chain istiod puts it among the HTTP filters instead.)
    pub istio_stats: Option<Arc<StatsConfig>>,
    /// `envoy.filters.network.rbac` and `envoy.filters.network.ext_authz` filters in front of
    /// the terminal filter, in order: each decides, once per connection, whether it goes on.
    pub policy: Vec<NetworkPolicy>,
    /// The `FilterChain` as received. Envoy tells a chain a push kept from one it changed by
    /// comparing these messages whole (match, name and filters included): a kept chain keeps
    /// its connections, a changed one drains them.
    pub source: lpb::FilterChain,
}

/// The chain's one terminal network filter.
// One per chain, behind the chain's Arc: the variants' sizes cost nothing per request.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum NetworkFilter {
    Http(Hcm),
    Tcp(TcpProxy),
}

impl Hcm {
    /// The chain has a fault filter (Envoy creates its stats with it).
    pub fn has_fault_filter(&self) -> bool {
        self.filters
            .iter()
            .any(|f| matches!(f, HttpFilter::Fault(_)))
    }
}

impl ChainDef {
    /// The connection manager of an HTTP chain; None for a tcp_proxy chain.
    pub fn hcm(&self) -> Option<&Hcm> {
        match &self.filter {
            NetworkFilter::Http(h) => Some(h),
            NetworkFilter::Tcp(_) => None,
        }
    }

    pub fn tcp(&self) -> Option<&TcpProxy> {
        match &self.filter {
            NetworkFilter::Tcp(t) => Some(t),
            NetworkFilter::Http(_) => None,
        }
    }
}

impl ListenerDef {
    /// Takes the previous version's `Arc` of every chain this version has unchanged, so a
    /// chain's identity (`Arc::ptr_eq`) survives a push that reorders or changes the others:
    /// connections accepted on it stay on it, and a request finds it in the next snapshot
    /// without comparing configs.
    pub fn keep_unchanged_chains(&mut self, prev: &ListenerDef) {
        // Envoy updates filter chains in place only when nothing else of the listener changed
        // (`ListenerMessageUtil::filterChainOnlyChange`); otherwise every chain is new.
        if self.level != prev.level {
            return;
        }
        for chain in &mut self.chains {
            if let Some(same) = prev
                .chains
                .iter()
                .find(|p| p.addr == chain.addr && p.source == chain.source)
            {
                *chain = same.clone();
            }
        }
    }

    /// The chain for a connection: its index in `chains`, or None (close it).
    pub fn select_chain(&self, conn: &Conn<'_>) -> Option<usize> {
        match select(&self.matches, conn) {
            Some(i) => Some(i),
            None if self.has_default => Some(self.chains.len() - 1),
            None => None,
        }
    }
}

#[derive(Debug)]
pub enum RouteSource {
    Rds(String),
    Inline(Arc<RouteTable>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Auto,
    Http1,
    Http2,
}

/// The connection manager's limits on one HTTP/1 downstream connection (Envoy's
/// `request_headers_timeout`, `request_timeout` and `common_http_protocol_options`'
/// `max_connection_duration` and `max_requests_per_connection`; unset or zero: none).
/// HTTP/2 connections are not held to them (see the README's security section).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnLimits {
    /// From a request's first byte to the end of its headers; 408 past it.
    pub request_headers_timeout: Option<std::time::Duration>,
    /// From a request's first byte to the end of its body; 408 past it while no response
    /// has begun.
    pub request_timeout: Option<std::time::Duration>,
    /// A connection this old gets `connection: close` on its next response, and is closed
    /// `drain_timeout` after it when idle, as Envoy drains it.
    pub max_connection_duration: Option<std::time::Duration>,
    /// The response to this many-th request carries `connection: close`.
    pub max_requests_per_connection: Option<u32>,
    pub drain_timeout: std::time::Duration,
    /// How long a connection answered 408 is still read from before it closes, so the
    /// client reads the answer instead of a reset.
    pub delayed_close: std::time::Duration,
}

impl ConnLimits {
    /// Whether a connection needs the per-connection state at all.
    pub fn any(&self) -> bool {
        self.request_headers_timeout.is_some()
            || self.request_timeout.is_some()
            || self.max_connection_duration.is_some()
            || self.max_requests_per_connection.is_some()
    }

    /// Whether a connection's reads are timed.
    pub fn timed(&self) -> bool {
        self.request_headers_timeout.is_some() || self.request_timeout.is_some()
    }
}

/// The connection manager's `http2_protocol_options` as the HTTP/2 codec takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct H2Settings {
    /// `max_concurrent_streams`: Envoy's default is 2^31-1 (no practical limit).
    pub max_concurrent_streams: u32,
    /// `initial_stream_window_size` and `initial_connection_window_size`; None keeps the
    /// codec's 64 KiB. Envoy's default of 256 MiB would let one slow upload hold 256 MiB per
    /// stream in the gateway: Envoy bounds what it buffers with its buffer watermarks
    /// (`per_connection_buffer_limit_bytes`), which pingora's HTTP/2 server does not have, so
    /// the window is the bound here.
    pub stream_window: Option<u32>,
    pub connection_window: Option<u32>,
    /// `hpack_table_size` (Envoy's default 4096, the protocol's).
    pub hpack_table_size: Option<u32>,
    /// The decoded header list a request may carry: `max_request_headers_kb`.
    pub max_header_list: u32,
}

impl H2Settings {
    const MAX_WINDOW: u32 = (1 << 31) - 1;

    pub fn from_proto(
        o: Option<&envoy_types::pb::envoy::config::core::v3::Http2ProtocolOptions>,
        max_header_list: usize,
    ) -> Result<H2Settings, String> {
        let window = |field: &str, v: Option<u32>| match v {
            None => Ok(None),
            Some(w @ 65_535..=Self::MAX_WINDOW) => Ok(Some(w)),
            Some(w) => Err(format!(
                "http2_protocol_options.{field}: {w} is out of range (65535 to 2147483647)"
            )),
        };
        let streams = match o.and_then(|o| o.max_concurrent_streams.as_ref()).map(|v| v.value) {
            None => Self::MAX_WINDOW,
            Some(n @ 1..=Self::MAX_WINDOW) => n,
            Some(n) => {
                return Err(format!(
                    "http2_protocol_options.max_concurrent_streams: {n} is out of range (1 to 2147483647)"
                ))
            }
        };
        Ok(H2Settings {
            max_concurrent_streams: streams,
            stream_window: window(
                "initial_stream_window_size",
                o.and_then(|o| o.initial_stream_window_size.as_ref())
                    .map(|v| v.value),
            )?,
            connection_window: window(
                "initial_connection_window_size",
                o.and_then(|o| o.initial_connection_window_size.as_ref())
                    .map(|v| v.value),
            )?,
            hpack_table_size: o.and_then(|o| o.hpack_table_size.as_ref()).map(|v| v.value),
            max_header_list: u32::try_from(max_header_list).unwrap_or(u32::MAX),
        })
    }
}

/// `HttpConnectionManager.server_header_transformation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerTransformation {
    /// Every response's `server` is `server_name` (the default).
    Overwrite,
    /// `server_name` only on a response that has no `server`.
    AppendIfAbsent,
    /// The response's own `server`, or none.
    PassThrough,
}

/// The parts of `HttpConnectionManager` the request path reads.
#[derive(Debug)]
pub struct Hcm {
    pub stat_prefix: String,
    pub routes: RouteSource,
    pub codec: Codec,
    pub use_remote_address: bool,
    pub skip_xff_append: bool,
    /// `xff_num_trusted_hops`: how many XFF entries (from the right) are trusted proxies.
    pub xff_num_trusted_hops: u32,
    pub generate_request_id: bool,
    pub preserve_external_request_id: bool,
    pub strip_any_host_port: bool,
    pub strip_matching_host_port: bool,
    pub server_name: String,
    /// `server_name` as the `server` header's value, made once rather than per response
    /// (None: not a valid header value, which each response then refuses as before).
    pub server_header: Option<http::HeaderValue>,
    /// `server_header_transformation`: whether a response's `server` is replaced by
    /// `server_name`, added only where it is missing, or passed as it came.
    pub server_transformation: ServerTransformation,
    /// `via`: appended to every request's and response's `via` (None: empty, nothing added).
    pub via: Option<http::HeaderValue>,
    /// `always_set_request_id_in_response`: the request's `x-request-id` on its response.
    pub always_set_request_id_in_response: bool,
    /// The router's `suppress_envoy_headers`: no `x-envoy-upstream-service-time`,
    /// `x-envoy-expected-rq-timeout-ms`, `x-envoy-original-path` or `x-envoy-overloaded`.
    pub suppress_envoy_headers: bool,
    /// The `http_filters` that act per request, in chain order (the router, terminal, is
    /// not among them; filters accepted without effect neither).
    pub filters: Vec<HttpFilter>,
    /// `stream_idle_timeout`: Envoy's default is 5 minutes; zero disables it.
    pub stream_idle_timeout: Option<std::time::Duration>,
    /// `common_http_protocol_options.idle_timeout`: an HTTP/1 connection with no request in
    /// flight is closed this long after its last response (Envoy's default 1 hour; zero:
    /// never), plus what Envoy's drain adds after its idle timer fires: `drain_timeout`
    /// (default 5 s) and `delayed_close_timeout` (default 1 s).
    pub idle_timeout: Option<std::time::Duration>,
    /// `common_http_protocol_options.max_stream_duration` (unset or zero: no limit).
    pub max_stream_duration: Option<std::time::Duration>,
    /// What one HTTP/1 downstream connection may take: its request timers, its age and its
    /// number of requests.
    pub conn_limits: ConnLimits,
    /// `http2_protocol_options` for downstream HTTP/2 connections.
    pub h2: H2Settings,
    /// `internal_address_config.cidr_ranges`: downstream addresses Envoy treats as internal.
    pub internal_ranges: Vec<Cidr>,
    /// `upgrade_configs`: which `Upgrade` types (WebSocket) are proxied.
    pub upgrades: super::upgrade::Upgrades,
    /// `forward_client_cert_details` and `set_current_client_cert_details`: what becomes of
    /// `x-forwarded-client-cert`.
    pub xfcc: Xfcc,
    /// `normalize_path`, `merge_slashes`, `path_with_escaped_slashes_action`: what the
    /// connection manager does to `:path` before routing.
    pub path: PathNormalization,
    /// `istio.alpn`: the ALPN offered upstream over TLS instead of the cluster's.
    pub alpn: Option<Arc<AlpnOverride>>,
    /// `istio.stats` and `istio.metadata_exchange`: Istio's metrics and peer metadata.
    pub istio: crate::telemetry::istio_stats::IstioFilters,
    /// `common_http_protocol_options.headers_with_underscores_action` (Envoy Gateway sets
    /// REJECT_REQUEST).
    pub underscores: Underscores,
    /// `max_request_headers_kb` (Envoy's default 60 KiB) and
    /// `common_http_protocol_options.max_headers_count` (default 100): a request beyond
    /// either is answered 431.
    pub max_request_headers_bytes: usize,
    pub max_headers_count: usize,
    /// `access_log`: one line per request, written when it ends.
    pub access_log: AccessLogs,
    /// `tracing`: Envoy's connection manager tracing (sampling, driver, tags); None: off.
    pub tracing: Option<Arc<crate::telemetry::trace::TracingConfig>>,
    /// `http_protocol_options.header_key_format` is set (istiod's preserve-case option, or
    /// proper case): HTTP/1 header names keep the case they came with. Unset, Envoy writes
    /// them lower case and Portico keeps none (`proxy::head`).
    pub keep_header_case: bool,
    /// `http_protocol_options.allow_custom_methods`: any token as an HTTP/1 method. Unset,
    /// Envoy's codec takes only the methods it knows (`proxy::downstream::known_method`).
    pub allow_custom_methods: bool,
}

/// What the codec does with a request header whose name holds `_`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Underscores {
    #[default]
    Allow,
    /// 400, and the connection closes (Envoy's HTTP/1 codec).
    Reject,
    /// The header is removed.
    Drop,
}

/// The connection manager's path normalization, applied to `:path` before any filter or route
/// sees it, in Envoy's order: escaped slashes, then RFC 3986 normalization, then merged slashes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathNormalization {
    /// `normalize_path` (Envoy's default without the field: false).
    pub normalize: bool,
    pub merge_slashes: bool,
    pub escaped_slashes: EscapedSlashes,
}

impl PathNormalization {
    pub fn is_active(&self) -> bool {
        self.normalize || self.merge_slashes || self.escaped_slashes != EscapedSlashes::Keep
    }
}

/// `path_with_escaped_slashes_action` for `%2F`, `%2f`, `%5C` and `%5c` in the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EscapedSlashes {
    /// KEEP_UNCHANGED, and IMPLEMENTATION_SPECIFIC_DEFAULT (Envoy's runtime default keeps them).
    #[default]
    Keep,
    /// REJECT_REQUEST: 400.
    Reject,
    /// UNESCAPE_AND_REDIRECT: 307 to the unescaped (and normalized) path.
    Redirect,
    /// UNESCAPE_AND_FORWARD: routed and forwarded unescaped.
    Forward,
}

/// `forward_client_cert_details` (Envoy's default: SANITIZE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardClientCert {
    #[default]
    Sanitize,
    ForwardOnly,
    AppendForward,
    SanitizeSet,
    AlwaysForwardOnly,
}

/// How the connection manager treats `x-forwarded-client-cert`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Xfcc {
    pub mode: ForwardClientCert,
    /// `set_current_client_cert_details`, for APPEND_FORWARD and SANITIZE_SET; `Hash` (and
    /// `By`) are always set.
    pub subject: bool,
    pub cert: bool,
    pub chain: bool,
    pub dns: bool,
    pub uri: bool,
    pub issuer: bool,
}

/// An address range (`CidrRange`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub addr: std::net::IpAddr,
    pub len: u8,
}

impl Cidr {
    fn translate(c: &corepb::CidrRange) -> Result<Cidr, String> {
        let addr: std::net::IpAddr = c
            .address_prefix
            .parse()
            .map_err(|_| format!("malformed IP address: {}", c.address_prefix))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = c.prefix_len.as_ref().map_or(0, |v| v.value);
        if len > max {
            return Err(format!("prefix_len {len} must be at most {max}"));
        }
        Ok(Cidr {
            addr,
            len: len as u8,
        })
    }

    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr;
        let ip = match ip {
            IpAddr::V6(v6) if self.addr.is_ipv4() => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => return false,
            },
            other => other,
        };
        match (self.addr, ip) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                u32::from(a) & mask == u32::from(b) & mask
            }
            (IpAddr::V6(a), IpAddr::V6(b)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                u128::from(a) & mask == u128::from(b) & mask
            }
            _ => false,
        }
    }
}

fn unpack<M: Message + Default>(any: &Any, want: &str, what: &str) -> Result<M, String> {
    if any.type_url != want {
        return Err(format!("{what}: expected {want}, got {}", any.type_url));
    }
    M::decode(any.value.as_slice()).map_err(|e| format!("{what}: cannot decode: {e}"))
}

const TLS_INSPECTOR: &str = "envoy.filters.listener.tls_inspector";
const TLS_TRANSPORT: &str = "envoy.transport_sockets.tls";

impl ListenerDef {
    pub fn translate(
        l: &lpb::Listener,
        src: &dyn DataSources,
    ) -> Result<ListenerDef, TranslateError> {
        let err = |d: String| TranslateError::new(format!("listener '{}'", l.name), d);
        if l.name.is_empty() {
            return Err(TranslateError::new("listener ''", "name must not be empty"));
        }
        check_listener_fields(l).map_err(err)?;
        let internal = matches!(
            l.listener_specifier,
            Some(lpb::listener::ListenerSpecifier::InternalListener(_))
        );
        let mut binds = Vec::new();
        let addr = if internal {
            if l.address.is_some() || !l.additional_addresses.is_empty() {
                return Err(err(
                    "address: an internal listener has no address (internal_listener is set)"
                        .into(),
                ));
            }
            SocketAddr::from(([0, 0, 0, 0], 0))
        } else {
            let primary =
                listen_addr(l.address.as_ref(), None).map_err(|e| err(format!("address: {e}")))?;
            let addr = primary.addr;
            binds.push(primary);
            for (i, a) in l.additional_addresses.iter().enumerate() {
                let at = format!("additional_addresses[{i}]");
                let Some(address) = &a.address else {
                    return Err(err(format!("{at}.address is required")));
                };
                let is_udp = matches!(
                    &address.address,
                    Some(corepb::address::Address::SocketAddress(sa))
                        if sa.protocol == corepb::socket_address::Protocol::Udp as i32
                );
                if is_udp {
                    return Err(err(format!(
                        "listener {}: has different socket type. The listener only support same socket type for all the addresses.",
                        l.name
                    )));
                }
                binds.push(
                    listen_addr(Some(address), Some(addr))
                        .map_err(|e| err(format!("{at}.address: {e}")))?,
                );
                // `socket_options` here replace the listener's for this address. Portico applies
                // neither (see check_listener_fields): they tune the socket, not where a request
                // goes. `tcp_keepalive` likewise only keeps idle downstream connections alive.
            }
            addr
        };
        let mut original_dst = false;
        let mut tls_inspector = false;
        let mut http_inspector = false;
        let mut listener_filters = Vec::new();
        for (i, f) in l.listener_filters.iter().enumerate() {
            use lpb::listener_filter::ConfigType;
            if f.filter_disabled.is_some() {
                return Err(err(format!(
                    "listener_filters[{i}]: filter_disabled is not supported"
                )));
            }
            let (type_url, any) = match &f.config_type {
                Some(ConfigType::TypedConfig(a)) => (a.type_url.as_str(), Some(a)),
                Some(ConfigType::ConfigDiscovery(_)) => {
                    return Err(err(format!(
                        "listener_filters[{i}]: listener filter '{}': config_discovery is not supported",
                        f.name
                    )))
                }
                None if f.name == TLS_INSPECTOR => (TLS_INSPECTOR_TYPE, None),
                None => ("", None),
            };
            match (type_url, any) {
                (TLS_INSPECTOR_TYPE, _) => {
                    tls_inspector = true;
                    listener_filters.push(ListenerFilter::TlsInspector);
                }
                (PROXY_PROTOCOL_TYPE, Some(a)) => {
                    let pp = ProxyProtocol::translate(a)
                        .map_err(|e| err(format!("listener_filters[{i}] '{}': {e}", f.name)))?;
                    listener_filters.push(ListenerFilter::ProxyProtocol(Arc::new(pp)));
                }
                // The HTTP inspector only sets the application protocol (h2c, http/1.1,
                // http/1.0) of plaintext connections for filter chain matching; checked against
                // the chains below.
                (HTTP_INSPECTOR_TYPE, _) => http_inspector = true,
                // original_dst restores the destination of a connection that iptables
                // redirected (SO_ORIGINAL_DST). A gateway is addressed directly, so that
                // destination is the local address the listener already uses; it only matters
                // for handing connections over by `use_original_dst`, which is refused above.
                (ORIGINAL_DST_TYPE, _) => original_dst = true,
                (other, _) => {
                    return Err(err(format!(
                        "listener_filters[{i}]: listener filter '{}' ({other}) is not supported",
                        f.name
                    )))
                }
            }
        }
        if l.filter_chains.is_empty() && l.default_filter_chain.is_none() {
            return Err(err("no filter chains specified".into()));
        }
        // OUTBOUND (as istiod sets on gateways): Envoy's egress tracing operation.
        let egress = l.traffic_direction == corepb::TrafficDirection::Outbound as i32;
        let mut chains = Vec::with_capacity(l.filter_chains.len() + 1);
        let mut matches = Vec::with_capacity(l.filter_chains.len());
        for (i, c) in l.filter_chains.iter().enumerate() {
            let at = format!("filter_chains[{i}]");
            matches.push(
                ChainMatch::translate(c.filter_chain_match.as_ref())
                    .map_err(|e| err(format!("{at}: {e}")))?,
            );
            chains.push(Arc::new(
                ChainDef::translate(c, addr, &at, src, egress).map_err(err)?,
            ));
        }
        let named: Vec<(&str, &ChainMatch)> = l
            .filter_chains
            .iter()
            .map(|c| c.name.as_str())
            .zip(matches.iter())
            .collect();
        super::filter_chain::check_overlaps(&named).map_err(err)?;
        if http_inspector {
            // Without the inspector a plaintext connection has no application protocol, so a
            // chain that asks for one on plaintext would match differently from Envoy's.
            if let Some(i) = matches
                .iter()
                .position(|m| !m.application_protocols.is_empty() && m.transport_protocol != "tls")
            {
                return Err(err(format!(
                    "filter_chains[{i}]: matching application_protocols on plaintext connections (envoy.filters.listener.http_inspector) is not supported"
                )));
            }
        }
        if let Some(c) = &l.default_filter_chain {
            chains.push(Arc::new(
                ChainDef::translate(c, addr, "default_filter_chain", src, egress).map_err(err)?,
            ));
        }
        if internal {
            check_internal(l, &chains, &listener_filters, http_inspector).map_err(err)?;
        } else if let Some(i) = chains
            .iter()
            .position(|c| c.tcp().is_some_and(|t| t.tunneling.is_some()))
        {
            return Err(err(format!(
                "filter chain {i}: tcp_proxy tunneling_config is supported only on internal listeners (ambient's connect_originate)"
            )));
        }
        let listener_filters_timeout = match &l.listener_filters_timeout {
            None => Some(std::time::Duration::from_secs(15)),
            Some(d) => {
                let d = super::duration(d)
                    .map_err(|e| err(format!("listener_filters_timeout: {e}")))?;
                (!d.is_zero()).then_some(d)
            }
        };
        let access_log = AccessLogs::translate(&l.access_log, "access_log").map_err(err)?;
        Ok(ListenerDef {
            access_log,
            level: lpb::Listener {
                filter_chains: Vec::new(),
                default_filter_chain: None,
                ..l.clone()
            },
            name: l.name.clone(),
            addr,
            binds,
            chains,
            matches,
            has_default: l.default_filter_chain.is_some(),
            listener_filters,
            tls_inspector,
            listener_filters_timeout,
            continue_on_listener_filters_timeout: l.continue_on_listener_filters_timeout,
            ignore_global_conn_limit: l.ignore_global_conn_limit,
            stat_name: if !l.stat_prefix.is_empty() {
                l.stat_prefix.clone()
            } else if internal {
                l.name.clone()
            } else {
                format!("{}_{}", addr.ip(), addr.port())
            },
            // An internal listener takes no connection from a socket.
            bind_to_port: !internal && l.bind_to_port.as_ref().is_none_or(|b| b.value),
            internal,
            original_dst,
        })
    }
}

/// What Portico supports of an internal listener: the shape istiod gives `connect_originate`
/// (one tcp_proxy chain, with or without `tunneling_config`; the original_dst listener filter).
/// Chain matching, TLS and HTTP connection managers on internal connections are refused.
fn check_internal(
    l: &lpb::Listener,
    chains: &[Arc<ChainDef>],
    filters: &[ListenerFilter],
    http_inspector: bool,
) -> Result<(), String> {
    let at = "internal_listener";
    if !filters.is_empty() || http_inspector {
        return Err(format!(
            "{at}: only the envoy.filters.listener.original_dst listener filter is supported on internal listeners"
        ));
    }
    let matchless = |c: &lpb::FilterChain| {
        c.filter_chain_match
            .as_ref()
            .is_none_or(|m| *m == lpb::FilterChainMatch::default())
    };
    if chains.len() != 1 || !l.filter_chains.iter().all(matchless) {
        return Err(format!(
            "{at}: only one filter chain without filter_chain_match is supported on internal listeners"
        ));
    }
    let chain = &chains[0];
    if chain.tls.is_some() {
        return Err(format!(
            "{at}: a TLS transport_socket on an internal listener's chain is not supported"
        ));
    }
    let Some(tcp) = chain.tcp() else {
        return Err(format!(
            "{at}: only a tcp_proxy chain is supported on internal listeners (not an http_connection_manager)"
        ));
    };
    if tcp.max_connect_attempts > 1 {
        return Err(format!(
            "{at}: tcp_proxy max_connect_attempts above 1 is not supported on internal listeners yet"
        ));
    }
    Ok(())
}

/// The listener fields istiod (or anyone) may set beside address, filters and chains: each is
/// either refused with the reason, or accepted because it cannot change where a request goes
/// or whether it is allowed at a gateway.
fn check_listener_fields(l: &lpb::Listener) -> Result<(), String> {
    if l.api_listener.is_some() {
        return Err("api_listener is not supported".into());
    }
    if l.udp_listener_config.is_some() {
        return Err("udp_listener_config: UDP listeners (QUIC / HTTP/3) are not supported".into());
    }
    if let Some(corepb::address::Address::SocketAddress(sa)) =
        l.address.as_ref().and_then(|a| a.address.as_ref())
    {
        if sa.protocol == corepb::socket_address::Protocol::Udp as i32 {
            return Err("address: UDP listeners (QUIC / HTTP/3) are not supported".into());
        }
    }
    if l.use_original_dst.as_ref().is_some_and(|b| b.value) {
        return Err("use_original_dst: handing connections to the listener of their original destination (a sidecar's virtualOutbound) is not supported".into());
    }
    if l.filter_chain_matcher.is_some() {
        return Err("filter_chain_matcher is not supported".into());
    }
    if l.fcds_config.is_some() {
        return Err("fcds_config: filter chain discovery is not supported".into());
    }
    // Without IP_TRANSPARENT / IP_FREEBIND Envoy's socket would not receive what it is meant
    // to; Portico does not set them.
    if l.transparent.as_ref().is_some_and(|b| b.value) {
        return Err("transparent is not supported".into());
    }
    if l.freebind.as_ref().is_some_and(|b| b.value) {
        return Err("freebind is not supported".into());
    }
    if l.per_connection_buffer_high_watermark_timeout
        .as_ref()
        .is_some_and(|d| d.seconds != 0 || d.nanos != 0)
    {
        return Err("per_connection_buffer_high_watermark_timeout is not supported".into());
    }
    // Accepted, and why they cannot matter at a gateway:
    // - connection_balance_config (exact_balance): which worker accepts a connection; Portico's
    //   workers each accept on the socket, and a connection's handling does not depend on it.
    // - per_connection_buffer_limit_bytes: flow-control watermarks of Envoy's buffers; pingora
    //   has its own, and no request is routed or refused by it.
    // - bypass_overload_manager: Portico's overload manager has no action a listener could be
    //   exempted from (ignore_global_conn_limit is read: the global connection limit).
    // - socket_options (and `additional_addresses[].socket_options`): options set on the
    //   listening socket (keepalive, buffer sizes, TOS); none changes where a request goes.
    // - traffic_direction, metadata, stat_prefix handling aside, stats_matcher,
    //   max_connections_to_accept_per_socket_event, tcp_backlog_size, enable_reuse_port,
    //   tcp_fast_open_queue_length: observability and accept-loop tuning.
    Ok(())
}

impl ChainDef {
    fn translate(
        chain: &lpb::FilterChain,
        addr: SocketAddr,
        at: &str,
        src: &dyn DataSources,
        egress: bool,
    ) -> Result<ChainDef, String> {
        let tls = match &chain.transport_socket {
            None => None,
            Some(ts) if super::cluster::is_raw_buffer(ts) => None,
            Some(ts) => match &ts.config_type {
                Some(corepb::transport_socket::ConfigType::TypedConfig(a))
                    if a.type_url == DOWNSTREAM_TLS_TYPE =>
                {
                    Some(Arc::new(DownstreamTls::from_any(a, src).map_err(|e| {
                        format!("{at}.transport_socket '{}': {e}", ts.name)
                    })?))
                }
                _ if ts.name == TLS_TRANSPORT => {
                    return Err(format!(
                        "{at}.transport_socket '{}': typed_config must be a DownstreamTlsContext",
                        ts.name
                    ))
                }
                _ => {
                    return Err(format!(
                        "{at}.transport_socket '{}' is not supported",
                        ts.name
                    ))
                }
            },
        };
        let Some((terminal, before)) = chain.filters.split_last() else {
            return Err(format!("{at}: no network filters"));
        };
        let mut mx = false;
        let mut istio_stats = None;
        let mut policy = Vec::new();
        for (i, f) in before.iter().enumerate() {
            if f.name.is_empty() {
                return Err(format!("{at}.filters[{i}]: name must not be empty"));
            }
            if let Some(lpb::filter::ConfigType::TypedConfig(a)) = &f.config_type {
                if a.type_url == crate::filters::rbac::NETWORK_TYPE {
                    let r = crate::filters::rbac::NetworkRbac::translate(
                        a,
                        &crate::live::ROOT_COUNTERS,
                    )
                    .map_err(|e| format!("{at}.filters[{i}] '{}': {e}", f.name))?;
                    policy.push(NetworkPolicy::Rbac(Arc::new(r)));
                    continue;
                }
                if a.type_url == crate::filters::ext_authz::NETWORK_TYPE {
                    let r = crate::filters::ext_authz::NetworkExtAuthz::translate(
                        a,
                        &crate::live::ROOT_COUNTERS,
                    )
                    .map_err(|e| format!("{at}.filters[{i}] '{}': {e}", f.name))?;
                    policy.push(NetworkPolicy::ExtAuthz(Arc::new(r)));
                    continue;
                }
            }
            let kind = match &f.config_type {
                Some(lpb::filter::ConfigType::TypedConfig(a)) => match istio_telemetry(a) {
                    Some(t) => {
                        mx |= t == MX_NETWORK_TYPE;
                        if t == STATS_TYPE {
                            let cfg = StatsConfig::from_any(a)
                                .map_err(|e| format!("{at}.filters[{i}] '{}': {e}", f.name))?;
                            for w in &cfg.warnings {
                                tracing::warn!(filter = %f.name, "istio.stats: {w}");
                            }
                            istio_stats = Some(Arc::new(cfg));
                        }
                        continue;
                    }
                    None => config_type(a),
                },
                _ => "no typed_config".to_string(),
            };
            return Err(format!(
                "{at}: only a single http_connection_manager or tcp_proxy is supported, found network filter '{}' ({kind}) first",
                f.name
            ));
        }
        let f = terminal;
        let i = before.len();
        if f.name.is_empty() {
            return Err(format!("{at}.filters[{i}]: name must not be empty"));
        }
        let any = match &f.config_type {
            Some(lpb::filter::ConfigType::TypedConfig(a)) => a,
            _ => {
                return Err(format!(
                    "{at}.filters[{i}] '{}': typed_config is required",
                    f.name
                ))
            }
        };
        let filter = match any.type_url.as_str() {
            HCM_TYPE => {
                let proto: hcm::HttpConnectionManager =
                    unpack(any, HCM_TYPE, "http_connection_manager")?;
                NetworkFilter::Http(
                    Hcm::translate(&proto, egress)
                        .map_err(|e| format!("http_connection_manager: {e}"))?,
                )
            }
            TCP_PROXY_TYPE => NetworkFilter::Tcp(
                TcpProxy::from_any(any).map_err(|e| format!("{at}.filters[{i}]: {e}"))?,
            ),
            other => {
                return Err(format!(
                    "network filter '{}' ({other}) is not supported",
                    f.name
                ))
            }
        };
        #[allow(deprecated)]
        if chain.use_proxy_proto.as_ref().is_some_and(|b| b.value) {
            return Err(format!(
                "{at}.use_proxy_proto is not supported: use the envoy.filters.listener.proxy_protocol listener filter"
            ));
        }
        let handshake_timeout = match &chain.transport_socket_connect_timeout {
            None => None,
            Some(d) => {
                let d = super::duration(d)
                    .map_err(|e| format!("{at}.transport_socket_connect_timeout: {e}"))?;
                (!d.is_zero()).then_some(d)
            }
        };
        let tls = match tls {
            // Istio's TCP metadata exchange reads a header the peer writes into the stream when
            // the TLS handshake settled on `istio-peer-exchange`. Portico does not speak that
            // exchange, so it does not offer that protocol: peers then send the plain stream,
            // which Envoy's filter passes through untouched (as with PILOT_DISABLE_MX_ALPN).
            Some(_) if mx => Some(Arc::new(without_mx_alpn(chain, at, src)?)),
            other => other,
        };
        Ok(ChainDef {
            istio_stats,
            policy,
            name: chain.name.clone(),
            addr,
            tls,
            handshake_timeout,
            filter,
            source: chain.clone(),
        })
    }
}

/// The chain's DownstreamTlsContext without `istio-peer-exchange` in its ALPN list.
fn without_mx_alpn(
    chain: &lpb::FilterChain,
    at: &str,
    src: &dyn DataSources,
) -> Result<DownstreamTls, String> {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::DownstreamTlsContext;
    let Some(corepb::transport_socket::ConfigType::TypedConfig(a)) = chain
        .transport_socket
        .as_ref()
        .and_then(|t| t.config_type.as_ref())
    else {
        return Err(format!("{at}.transport_socket: typed_config is required"));
    };
    let mut ctx: DownstreamTlsContext = unpack(a, DOWNSTREAM_TLS_TYPE, "transport_socket")?;
    if let Some(c) = ctx.common_tls_context.as_mut() {
        c.alpn_protocols.retain(|p| p != MX_ALPN);
    }
    let any = Any {
        type_url: DOWNSTREAM_TLS_TYPE.to_string(),
        value: ctx.encode_to_vec(),
    };
    DownstreamTls::from_any(&any, src).map_err(|e| format!("{at}.transport_socket: {e}"))
}

const MX_ALPN: &str = "istio-peer-exchange";

impl Hcm {
    fn translate(h: &hcm::HttpConnectionManager, egress: bool) -> Result<Hcm, String> {
        use hcm::http_connection_manager::{CodecType, RouteSpecifier};
        let routes = match &h.route_specifier {
            Some(RouteSpecifier::Rds(rds)) => {
                let ads = matches!(
                    rds.config_source
                        .as_ref()
                        .and_then(|c| c.config_source_specifier.as_ref()),
                    Some(corepb::config_source::ConfigSourceSpecifier::Ads(_))
                );
                if !ads {
                    return Err("rds.config_source: only ads is supported".into());
                }
                RouteSource::Rds(rds.route_config_name.clone())
            }
            Some(RouteSpecifier::RouteConfig(rc)) => RouteSource::Inline(Arc::new(
                RouteTable::translate(rc).map_err(|e| e.to_string())?,
            )),
            Some(RouteSpecifier::ScopedRoutes(_)) => {
                return Err("scoped_routes is not supported".into())
            }
            None => return Err("one of rds or route_config is required".into()),
        };
        let codec = match CodecType::try_from(h.codec_type) {
            Ok(CodecType::Auto) => Codec::Auto,
            Ok(CodecType::Http1) => Codec::Http1,
            Ok(CodecType::Http2) => Codec::Http2,
            _ => return Err(format!("codec_type {} is not supported", h.codec_type)),
        };
        if h.stat_prefix.is_empty() {
            return Err("stat_prefix must not be empty".into());
        }
        let via = match h.via.as_str() {
            "" => None,
            v => Some(
                http::HeaderValue::from_str(v)
                    .map_err(|_| format!("via: {v:?} is not a valid header value"))?,
            ),
        };
        let server_transformation = {
            use hcm::http_connection_manager::ServerHeaderTransformation as T;
            match T::try_from(h.server_header_transformation) {
                Ok(T::Overwrite) => ServerTransformation::Overwrite,
                Ok(T::AppendIfAbsent) => ServerTransformation::AppendIfAbsent,
                Ok(T::PassThrough) => ServerTransformation::PassThrough,
                // Envoy's validation takes defined values only.
                Err(_) => {
                    return Err(format!(
                        "server_header_transformation: {} is not a defined value",
                        h.server_header_transformation
                    ))
                }
            }
        };
        let HttpFilters {
            filters,
            suppress_envoy_headers,
            alpn,
            istio,
        } = check_http_filters(&h.http_filters)?;
        let opt_duration =
            |field: &str, d: Option<&envoy_types::pb::google::protobuf::Duration>| {
                d.map(|d| super::duration(d).map_err(|e| format!("{field}: {e}")))
                    .transpose()
            };
        let stream_idle_timeout =
            match opt_duration("stream_idle_timeout", h.stream_idle_timeout.as_ref())? {
                None => Some(std::time::Duration::from_secs(300)),
                Some(d) => (!d.is_zero()).then_some(d),
            };
        let idle_timeout = match opt_duration(
            "common_http_protocol_options.idle_timeout",
            h.common_http_protocol_options
                .as_ref()
                .and_then(|o| o.idle_timeout.as_ref()),
        )? {
            None => Some(std::time::Duration::from_secs(3600)),
            Some(d) => (!d.is_zero()).then_some(d),
        };
        let drain_timeout = opt_duration("drain_timeout", h.drain_timeout.as_ref())?
            .unwrap_or(std::time::Duration::from_secs(5));
        let delayed_close =
            opt_duration("delayed_close_timeout", h.delayed_close_timeout.as_ref())?
                .unwrap_or(std::time::Duration::from_secs(1));
        let idle_timeout = idle_timeout.map(|d| d + drain_timeout + delayed_close);
        let common = h.common_http_protocol_options.as_ref();
        let nonzero = |d: Option<std::time::Duration>| d.filter(|d| !d.is_zero());
        let conn_limits = ConnLimits {
            request_headers_timeout: nonzero(opt_duration(
                "request_headers_timeout",
                h.request_headers_timeout.as_ref(),
            )?),
            request_timeout: nonzero(opt_duration("request_timeout", h.request_timeout.as_ref())?),
            max_connection_duration: nonzero(opt_duration(
                "common_http_protocol_options.max_connection_duration",
                common.and_then(|o| o.max_connection_duration.as_ref()),
            )?),
            max_requests_per_connection: common
                .and_then(|o| o.max_requests_per_connection.as_ref())
                .map(|v| v.value)
                .filter(|n| *n > 0),
            drain_timeout,
            delayed_close,
        };
        let max_stream_duration = opt_duration(
            "common_http_protocol_options.max_stream_duration",
            h.common_http_protocol_options
                .as_ref()
                .and_then(|o| o.max_stream_duration.as_ref()),
        )?
        .filter(|d| !d.is_zero());
        let internal_ranges = match &h.internal_address_config {
            Some(c) => c
                .cidr_ranges
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    Cidr::translate(r)
                        .map_err(|e| format!("internal_address_config.cidr_ranges[{i}]: {e}"))
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => Vec::new(),
        };
        let upgrades = super::upgrade::Upgrades::from_hcm(&h.upgrade_configs)?;
        use hcm::http_connection_manager::ForwardClientCertDetails as Fcc;
        let mode = match Fcc::try_from(h.forward_client_cert_details) {
            Ok(Fcc::Sanitize) => ForwardClientCert::Sanitize,
            Ok(Fcc::ForwardOnly) => ForwardClientCert::ForwardOnly,
            Ok(Fcc::AppendForward) => ForwardClientCert::AppendForward,
            Ok(Fcc::SanitizeSet) => ForwardClientCert::SanitizeSet,
            Ok(Fcc::AlwaysForwardOnly) => ForwardClientCert::AlwaysForwardOnly,
            Err(_) => {
                return Err(format!(
                    "forward_client_cert_details: unknown value {}",
                    h.forward_client_cert_details
                ))
            }
        };
        let details = h.set_current_client_cert_details.unwrap_or_default();
        let xfcc = Xfcc {
            mode,
            subject: details.subject.is_some_and(|b| b.value),
            cert: details.cert,
            chain: details.chain,
            dns: details.dns,
            uri: details.uri,
            issuer: details.issuer,
        };
        if details.format != 0 {
            return Err(
                "set_current_client_cert_details.format: only TEXT is supported (JSON is not)"
                    .into(),
            );
        }
        check_hcm_fields(h)?;
        use hcm::http_connection_manager::PathWithEscapedSlashesAction as Esc;
        let escaped_slashes = match Esc::try_from(h.path_with_escaped_slashes_action) {
            Ok(Esc::ImplementationSpecificDefault | Esc::KeepUnchanged) => EscapedSlashes::Keep,
            Ok(Esc::RejectRequest) => EscapedSlashes::Reject,
            Ok(Esc::UnescapeAndRedirect) => EscapedSlashes::Redirect,
            Ok(Esc::UnescapeAndForward) => EscapedSlashes::Forward,
            Err(_) => {
                return Err(format!(
                    "path_with_escaped_slashes_action: unknown value {}",
                    h.path_with_escaped_slashes_action
                ))
            }
        };
        let path = PathNormalization {
            normalize: h.normalize_path.as_ref().is_some_and(|b| b.value),
            merge_slashes: h.merge_slashes,
            escaped_slashes,
        };
        let underscores = match h
            .common_http_protocol_options
            .as_ref()
            .map_or(0, |o| o.headers_with_underscores_action)
        {
            0 => Underscores::Allow,
            1 => Underscores::Reject,
            2 => Underscores::Drop,
            other => {
                return Err(format!(
                    "common_http_protocol_options.headers_with_underscores_action: unknown value {other}"
                ))
            }
        };
        let max_request_headers_bytes = match h.max_request_headers_kb.as_ref().map(|v| v.value) {
            None => 60 * 1024,
            // Envoy's bounds (PGV: greater than 0, at most 8192).
            Some(kb @ 1..=8192) => kb as usize * 1024,
            Some(kb) => {
                return Err(format!(
                    "max_request_headers_kb: {kb} is out of range (1 to 8192)"
                ))
            }
        };
        let h2 =
            H2Settings::from_proto(h.http2_protocol_options.as_ref(), max_request_headers_bytes)?;
        let max_headers_count = match h
            .common_http_protocol_options
            .as_ref()
            .and_then(|o| o.max_headers_count.as_ref())
            .map(|v| v.value)
        {
            None => 100,
            Some(n @ 1..) => n as usize,
            Some(_) => {
                return Err(
                    "common_http_protocol_options.max_headers_count: must be at least 1".into(),
                )
            }
        };
        let access_log = AccessLogs::translate(&h.access_log, "access_log")?;
        let tracing = h
            .tracing
            .as_ref()
            .map(|t| crate::telemetry::trace::TracingConfig::translate(t, egress))
            .transpose()?
            .map(Arc::new);
        Ok(Hcm {
            access_log,
            istio,
            tracing,
            underscores,
            max_request_headers_bytes,
            max_headers_count,
            path,
            alpn,
            upgrades,
            xfcc,
            stream_idle_timeout,
            idle_timeout,
            max_stream_duration,
            conn_limits,
            h2,
            internal_ranges,
            filters,
            stat_prefix: h.stat_prefix.clone(),
            routes,
            codec,
            use_remote_address: h.use_remote_address.as_ref().is_some_and(|b| b.value),
            skip_xff_append: h.skip_xff_append,
            xff_num_trusted_hops: h.xff_num_trusted_hops,
            generate_request_id: h.generate_request_id.as_ref().is_none_or(|b| b.value),
            preserve_external_request_id: h.preserve_external_request_id,
            strip_any_host_port: matches!(
                h.strip_port_mode,
                Some(hcm::http_connection_manager::StripPortMode::StripAnyHostPort(true))
            ),
            strip_matching_host_port: h.strip_matching_host_port,
            server_header: http::HeaderValue::from_str(if h.server_name.is_empty() {
                "envoy"
            } else {
                &h.server_name
            })
            .ok(),
            server_transformation,
            via,
            always_set_request_id_in_response: h.always_set_request_id_in_response,
            suppress_envoy_headers,
            server_name: if h.server_name.is_empty() {
                "envoy".to_string()
            } else {
                h.server_name.clone()
            },
            keep_header_case: h
                .http_protocol_options
                .as_ref()
                .is_some_and(|o| o.header_key_format.is_some()),
            allow_custom_methods: h
                .http_protocol_options
                .as_ref()
                .is_some_and(|o| o.allow_custom_methods),
        })
    }
}

const UUID_REQUEST_ID_TYPE: &str =
    "type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig";

/// Connection manager fields that would change where a request goes, whether it is allowed
/// or what reaches the upstream, and that Portico does not implement: refused by name. The
/// rest is accepted because it only observes or tunes (see the comments).
fn check_hcm_fields(h: &hcm::HttpConnectionManager) -> Result<(), String> {
    if let Some(o) = &h.http_protocol_options {
        if o.accept_http_10 {
            return Err("http_protocol_options.accept_http_10: HTTP/1.0 is not supported (Portico answers 426, Envoy's default)".into());
        }
        // Each changes which requests are refused or how: Portico answers as Envoy's
        // defaults do (400 for a length next to chunked, 403 for an upgrade no config
        // allows, absolute-form targets taken, the connection closed after a 400).
        let refused = [
            ("allow_chunked_length", o.allow_chunked_length),
            (
                "ignore_http_11_upgrade",
                !o.ignore_http_11_upgrade.is_empty(),
            ),
            (
                "allow_absolute_url",
                o.allow_absolute_url.as_ref().is_some_and(|b| !b.value),
            ),
            (
                "override_stream_error_on_invalid_http_message",
                o.override_stream_error_on_invalid_http_message
                    .as_ref()
                    .is_some_and(|b| b.value),
            ),
        ];
        if let Some((field, _)) = refused.iter().find(|(_, set)| *set) {
            return Err(format!(
                "http_protocol_options.{field}: only Envoy's default is supported"
            ));
        }
        // header_key_format (istiod's preserve-case) is read into `Hcm::keep_header_case`,
        // allow_custom_methods into `Hcm::allow_custom_methods`; enable_trailers and the like change how HTTP/1 is written, not where a request
        // goes.
    }
    if h.http2_protocol_options
        .as_ref()
        .is_some_and(|o| o.allow_connect)
    {
        return Err("http2_protocol_options.allow_connect: extended CONNECT (WebSocket over HTTP/2) is not supported".into());
    }
    if let Some(o) = &h.http2_protocol_options {
        if !o.custom_settings_parameters.is_empty() {
            return Err(
                "http2_protocol_options.custom_settings_parameters are not supported".into(),
            );
        }
        #[allow(deprecated)]
        let stream_errors = o.stream_error_on_invalid_http_messaging
            || o.override_stream_error_on_invalid_http_message
                .as_ref()
                .is_some_and(|b| b.value);
        if stream_errors {
            return Err("http2_protocol_options: stream errors on invalid messages (instead of Envoy's default, closing the connection) are not supported".into());
        }
    }
    // Envoy refuses it on a connection manager (it is a cluster's option).
    if h.common_http_protocol_options
        .as_ref()
        .is_some_and(|o| o.max_response_headers_kb.is_some())
    {
        return Err("common_http_protocol_options.max_response_headers_kb cannot be set on a connection manager".into());
    }
    if h.tracing.as_ref().is_some_and(|t| t.no_context_propagation) {
        return Err("tracing.no_context_propagation is not supported".into());
    }
    // common_http_protocol_options: idle_timeout, max_connection_duration and
    // max_requests_per_connection are read above (HTTP/1 connections; see `ConnLimits`).
    if let Some(r) = &h.request_id_extension {
        let t = r
            .typed_config
            .as_ref()
            .map(|a| a.type_url.as_str())
            .unwrap_or("");
        if t != UUID_REQUEST_ID_TYPE {
            return Err(format!(
                "request_id_extension: only {UUID_REQUEST_ID_TYPE} is supported, got '{t}'"
            ));
        }
        // The UUID extension is Envoy's default; its options only concern trace sampling.
    }
    if h.append_x_forwarded_port {
        return Err("append_x_forwarded_port is not supported".into());
    }
    if h.strip_trailing_host_dot {
        return Err("strip_trailing_host_dot is not supported".into());
    }
    if h.scheme_header_transformation.is_some() {
        return Err("scheme_header_transformation is not supported".into());
    }
    if !h.original_ip_detection_extensions.is_empty() {
        return Err("original_ip_detection_extensions are not supported".into());
    }
    if !h.early_header_mutation_extensions.is_empty() {
        return Err("early_header_mutation_extensions are not supported".into());
    }
    if h.path_normalization_options.is_some() {
        return Err("path_normalization_options is not supported".into());
    }
    if h.typed_header_validation_config.is_some() {
        return Err("typed_header_validation_config is not supported".into());
    }
    // What these change is the answer a client gets (a local reply's status and body, headers
    // Envoy adds, an address's form, whether a connection outlives a malformed request):
    // refused rather than left out without a word.
    if h.local_reply_config
        .as_ref()
        .is_some_and(|c| !c.mappers.is_empty() || c.body_format.is_some())
    {
        return Err("local_reply_config: mappers and body_format are not supported".into());
    }
    if h.add_user_agent.as_ref().is_some_and(|b| b.value) {
        return Err("add_user_agent is not supported".into());
    }
    if h.proxy_status_config.is_some() {
        return Err("proxy_status_config is not supported".into());
    }
    if h.append_local_overload {
        return Err("append_local_overload is not supported".into());
    }
    if h.represent_ipv4_remote_address_as_ipv4_mapped_ipv6 {
        return Err("represent_ipv4_remote_address_as_ipv4_mapped_ipv6 is not supported".into());
    }
    if h.stream_error_on_invalid_http_message
        .as_ref()
        .is_some_and(|b| b.value)
    {
        return Err("stream_error_on_invalid_http_message: only false (Envoy's default: an HTTP/1 connection closes after a malformed request) is supported".into());
    }
    // Accepted: `access_log_options` (periodic and on-new-request lines; Portico writes one
    // line at the end of each request), `add_proxy_protocol_connection_state` (filter state
    // no filter here reads), `http3_protocol_options` (no HTTP/3 listener),
    // `proxy_100_continue` (Portico answers `Expect: 100-continue` itself; either way the body
    // follows), `internal_address_config` (read above), `http2_protocol_options` (its
    // streams, windows and HPACK table are read above; its flood knobs
    // (`max_outbound_frames`, `max_consecutive_inbound_frames_with_empty_payload`, ...) are
    // the HTTP/2 codec's own fixed defences here, and `connection_keepalive` pings only
    // probe liveness).
    Ok(())
}

/// The router's own config (`envoy.extensions.filters.http.router.v3.Router`): whether it
/// suppresses the `x-envoy-*` headers it adds. What else it holds is either refused here or
/// does not change an answer: `dynamic_stats`, `suppress_grpc_request_failure_code_stats`
/// (stats), `start_child_span` (a span's shape), `upstream_log` and its options (logging).
fn router_options(a: &envoy_types::pb::google::protobuf::Any) -> Result<bool, String> {
    use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
    if !a
        .type_url
        .ends_with("/envoy.extensions.filters.http.router.v3.Router")
    {
        // A TypedStruct: the defaults when it holds nothing.
        let empty = crate::telemetry::istio_stats::TypedStruct::decode(a.value.as_slice())
            .is_ok_and(|t| t.value.as_ref().is_none_or(|v| v.fields.is_empty()));
        return if empty {
            Ok(false)
        } else {
            Err(
                "http_filters: the router's config as a TypedStruct with fields is not supported"
                    .into(),
            )
        };
    }
    let r = Router::decode(a.value.as_slice())
        .map_err(|e| format!("http_filters: the router's config cannot be decoded: {e}"))?;
    if !r.upstream_http_filters.is_empty() {
        return Err("http_filters: router upstream_http_filters are not supported".into());
    }
    if !r.strict_check_headers.is_empty() {
        return Err("http_filters: router strict_check_headers is not supported".into());
    }
    if r.respect_expected_rq_timeout {
        return Err("http_filters: router respect_expected_rq_timeout is not supported".into());
    }
    Ok(r.suppress_envoy_headers)
}

struct HttpFilters {
    filters: Vec<HttpFilter>,
    suppress_envoy_headers: bool,
    alpn: Option<Arc<AlpnOverride>>,
    istio: crate::telemetry::istio_stats::IstioFilters,
}

/// Envoy's rule: the router must be the last filter (no filters at all means the router
/// alone); every other entry goes through the filter registry, and one Portico does not
/// implement is an error unless the config marks it `is_optional` (or `disabled`).
fn check_http_filters(filters: &[hcm::HttpFilter]) -> Result<HttpFilters, String> {
    let is_router = |f: &hcm::HttpFilter| match &f.config_type {
        Some(hcm::http_filter::ConfigType::TypedConfig(a)) => config_type(a) == ROUTER_TYPE,
        _ => false,
    };
    if let Some(i) = filters.iter().position(|f| f.name.is_empty()) {
        return Err(format!("http_filters[{i}]: name must not be empty"));
    }
    let Some(last) = filters.last() else {
        return Ok(HttpFilters {
            filters: Vec::new(),
            suppress_envoy_headers: false,
            alpn: None,
            istio: Default::default(),
        });
    };
    if last.name == "envoy.filters.http.router" && last.config_type.is_none() {
        return Err(
            "http_filters: no registered implementation for 'envoy.filters.http.router' with type URL ''"
                .into(),
        );
    }
    if !is_router(last) {
        return Err(format!(
            "http_filters: the last filter must be the router (envoy.filters.http.router), found '{}'",
            last.name
        ));
    }
    if last.disabled {
        return Err(format!(
            "http_filters: the last (terminal) filter '{}' cannot be disabled by default",
            last.name
        ));
    }
    let suppress_envoy_headers = match &last.config_type {
        Some(hcm::http_filter::ConfigType::TypedConfig(a)) => router_options(a)?,
        _ => false,
    };
    let mut out = HttpFilters {
        filters: Vec::new(),
        suppress_envoy_headers,
        alpn: None,
        istio: Default::default(),
    };
    for (i, f) in filters[..filters.len() - 1].iter().enumerate() {
        if is_router(f) {
            return Err(format!(
                "http_filters[{i}]: terminal filter '{}' must be the last filter",
                f.name
            ));
        }
        let registered = match &f.config_type {
            Some(hcm::http_filter::ConfigType::TypedConfig(a)) => {
                crate::filters::lookup(a).map(|r| (r, a))
            }
            _ => None,
        };
        if let Some((r, a)) = registered {
            let decl = crate::filters::FilterDecl {
                name: &f.name,
                config: a,
                disabled: f.disabled,
            };
            match (r.translate)(&decl)
                .map_err(|e| format!("http_filters[{i}] '{}': {e}", f.name))?
            {
                Translated::Run(filter) => out.filters.push(filter),
                Translated::Alpn(a) => out.alpn = Some(a),
                // Envoy would run a second instance too; one set of metrics per chain is
                // what istiod renders, and a second entry reports the same series.
                Translated::IstioStats(c) => out.istio.stats = Some(c),
                Translated::PeerMetadata(c) => out.istio.peer_metadata = Some(c),
                Translated::Inert => {}
            }
            continue;
        }
        // A filter Portico does not implement is fine if the config says it may be skipped.
        if f.is_optional || f.disabled {
            continue;
        }
        let kind = match &f.config_type {
            Some(hcm::http_filter::ConfigType::TypedConfig(a)) => config_type(a),
            Some(hcm::http_filter::ConfigType::ConfigDiscovery(_)) => {
                "config_discovery".to_string()
            }
            None => "no typed_config".to_string(),
        };
        return Err(format!(
            "http_filters[{i}]: http filter '{}' ({kind}) is not supported; mark it is_optional to skip it",
            f.name
        ));
    }
    Ok(out)
}

#[cfg(test)]
#[path = "listener_tests.rs"]
mod listener_tests;
