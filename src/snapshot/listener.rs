//! Listeners (LDS or bootstrap `static_resources.listeners`): filter chains, each with one HTTP
//! connection manager and optionally TLS.

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::config::listener::v3 as lpb;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::fault::{Fault, FAULT_TYPE};
use super::filter_chain::{select, ChainMatch, Conn};
use super::ratelimit::LocalRateLimit;
use super::route::RouteTable;
use super::tcp_proxy::{TcpProxy, TCP_PROXY_TYPE};
use super::tls::{DownstreamTls, DOWNSTREAM_TLS_TYPE, TLS_INSPECTOR_TYPE};
use super::{socket_address, TranslateError};

pub const HCM_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
pub const ROUTER_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";

#[derive(Debug)]
pub struct ListenerDef {
    pub name: String,
    pub addr: SocketAddr,
    /// `filter_chains` in order, then `default_filter_chain` if there is one.
    pub chains: Vec<Arc<ChainDef>>,
    /// The criteria of the `filter_chains` (the default chain has none).
    pub matches: Vec<ChainMatch>,
    pub has_default: bool,
    /// `envoy.filters.listener.tls_inspector` is configured: SNI and ALPN are read from the
    /// ClientHello before the chain is picked. Without it Envoy sees neither.
    pub tls_inspector: bool,
    /// `listener_filters_timeout` (default 15 s; zero: none).
    pub listener_filters_timeout: Option<std::time::Duration>,
    pub continue_on_listener_filters_timeout: bool,
    /// The `listener.<name>.*` stats scope: `stat_prefix`, else the address as Envoy writes
    /// it (`0.0.0.0_443`).
    pub stat_name: String,
}

/// One filter chain: how it terminates the transport, and its network filter.
#[derive(Debug)]
pub struct ChainDef {
    pub name: String,
    /// The listener's address (the request path reads it for `strip_matching_host_port`).
    pub addr: SocketAddr,
    pub tls: Option<Arc<DownstreamTls>>,
    pub filter: NetworkFilter,
}

/// The chain's one terminal network filter.
#[derive(Debug)]
pub enum NetworkFilter {
    Http(Hcm),
    Tcp(TcpProxy),
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
    /// The chain has an enabled `envoy.filters.http.cors`: routes' CORS policies apply.
    pub cors: bool,
    /// `envoy.filters.http.fault` instances, in filter-chain order.
    pub faults: Vec<FaultFilter>,
    /// `envoy.filters.http.local_ratelimit` instances, in chain order.
    pub rate_limits: Vec<RateLimitFilter>,
    /// The first rate limit filter comes before the first fault filter in the chain.
    pub rate_limit_first: bool,
    /// `stream_idle_timeout`: Envoy's default is 5 minutes; zero disables it.
    pub stream_idle_timeout: Option<std::time::Duration>,
    /// `common_http_protocol_options.max_stream_duration` (unset or zero: no limit).
    pub max_stream_duration: Option<std::time::Duration>,
    /// `internal_address_config.cidr_ranges`: downstream addresses Envoy treats as internal.
    pub internal_ranges: Vec<Cidr>,
    /// `upgrade_configs`: which `Upgrade` types (WebSocket) are proxied.
    pub upgrades: super::upgrade::Upgrades,
    /// `forward_client_cert_details` and `set_current_client_cert_details`: what becomes of
    /// `x-forwarded-client-cert`.
    pub xfcc: Xfcc,
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

/// A fault filter of the chain: its name (how routes address it) and its listener-level
/// config, which a route's `typed_per_filter_config` entry of the same name replaces.
#[derive(Debug)]
pub struct FaultFilter {
    pub name: String,
    pub config: Arc<Fault>,
    /// `disabled: true` in the chain: off unless a route's per-filter config enables it.
    pub disabled: bool,
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
    pub fn translate(l: &lpb::Listener) -> Result<ListenerDef, TranslateError> {
        let err = |d: String| TranslateError::new(format!("listener '{}'", l.name), d);
        if l.name.is_empty() {
            return Err(TranslateError::new("listener ''", "name must not be empty"));
        }
        let (host, port) =
            socket_address(l.address.as_ref()).map_err(|e| err(format!("address: {e}")))?;
        let ip: std::net::IpAddr = host
            .parse()
            .map_err(|_| err(format!("address: malformed IP address: {host}")))?;
        let addr = SocketAddr::new(ip, port);
        let mut tls_inspector = false;
        for (i, f) in l.listener_filters.iter().enumerate() {
            use lpb::listener_filter::ConfigType;
            let is_inspector = match &f.config_type {
                Some(ConfigType::TypedConfig(a)) => a.type_url == TLS_INSPECTOR_TYPE,
                Some(ConfigType::ConfigDiscovery(_)) => false,
                None => f.name == TLS_INSPECTOR,
            };
            if !is_inspector {
                return Err(err(format!(
                    "listener_filters[{i}]: listener filter '{}' is not supported",
                    f.name
                )));
            }
            if f.filter_disabled.is_some() {
                return Err(err(format!(
                    "listener_filters[{i}]: filter_disabled is not supported"
                )));
            }
            tls_inspector = true;
        }
        if l.filter_chain_matcher.is_some() {
            return Err(err("filter_chain_matcher is not supported".into()));
        }
        if l.filter_chains.is_empty() && l.default_filter_chain.is_none() {
            return Err(err("no filter chains specified".into()));
        }
        let mut chains = Vec::with_capacity(l.filter_chains.len() + 1);
        let mut matches = Vec::with_capacity(l.filter_chains.len());
        for (i, c) in l.filter_chains.iter().enumerate() {
            let at = format!("filter_chains[{i}]");
            matches.push(
                ChainMatch::translate(c.filter_chain_match.as_ref())
                    .map_err(|e| err(format!("{at}: {e}")))?,
            );
            chains.push(Arc::new(ChainDef::translate(c, addr, &at).map_err(err)?));
        }
        let named: Vec<(&str, &ChainMatch)> = l
            .filter_chains
            .iter()
            .map(|c| c.name.as_str())
            .zip(matches.iter())
            .collect();
        super::filter_chain::check_overlaps(&named).map_err(err)?;
        if let Some(c) = &l.default_filter_chain {
            chains.push(Arc::new(
                ChainDef::translate(c, addr, "default_filter_chain").map_err(err)?,
            ));
        }
        let listener_filters_timeout = match &l.listener_filters_timeout {
            None => Some(std::time::Duration::from_secs(15)),
            Some(d) => {
                let d = super::duration(d)
                    .map_err(|e| err(format!("listener_filters_timeout: {e}")))?;
                (!d.is_zero()).then_some(d)
            }
        };
        Ok(ListenerDef {
            name: l.name.clone(),
            addr,
            chains,
            matches,
            has_default: l.default_filter_chain.is_some(),
            tls_inspector,
            listener_filters_timeout,
            continue_on_listener_filters_timeout: l.continue_on_listener_filters_timeout,
            stat_name: if l.stat_prefix.is_empty() {
                format!("{}_{}", addr.ip(), addr.port())
            } else {
                l.stat_prefix.clone()
            },
        })
    }
}

impl ChainDef {
    fn translate(chain: &lpb::FilterChain, addr: SocketAddr, at: &str) -> Result<ChainDef, String> {
        let tls = match &chain.transport_socket {
            None => None,
            Some(ts) if super::cluster::is_raw_buffer(ts) => None,
            Some(ts) => match &ts.config_type {
                Some(corepb::transport_socket::ConfigType::TypedConfig(a))
                    if a.type_url == DOWNSTREAM_TLS_TYPE =>
                {
                    Some(Arc::new(DownstreamTls::from_any(a).map_err(|e| {
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
        let filter = match chain.filters.as_slice() {
            [f] if f.name.is_empty() => {
                return Err(format!("{at}.filters[0]: name must not be empty"))
            }
            [f] => {
                let any = match &f.config_type {
                    Some(lpb::filter::ConfigType::TypedConfig(a)) => a,
                    _ => {
                        return Err(format!(
                            "{at}.filters[0] '{}': typed_config is required",
                            f.name
                        ))
                    }
                };
                match any.type_url.as_str() {
                    HCM_TYPE => {
                        let proto: hcm::HttpConnectionManager =
                            unpack(any, HCM_TYPE, "http_connection_manager")?;
                        NetworkFilter::Http(
                            Hcm::translate(&proto)
                                .map_err(|e| format!("http_connection_manager: {e}"))?,
                        )
                    }
                    TCP_PROXY_TYPE => {
                        NetworkFilter::Tcp(
                            TcpProxy::from_any(any).map_err(|e| format!("{at}.filters[0]: {e}"))?,
                        )
                    }
                    other => {
                        return Err(format!(
                            "network filter '{}' ({other}) is not supported",
                            f.name
                        ))
                    }
                }
            }
            [] => return Err(format!("{at}: no network filters")),
            [first, ..] => {
                return Err(format!(
                    "{at}: only a single http_connection_manager or tcp_proxy is supported, found network filter '{}' first",
                    first.name
                ))
            }
        };
        Ok(ChainDef {
            name: chain.name.clone(),
            addr,
            tls,
            filter,
        })
    }
}

impl Hcm {
    fn translate(h: &hcm::HttpConnectionManager) -> Result<Hcm, String> {
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
        let (faults, rate_limits, rate_limit_first) = check_http_filters(&h.http_filters)?;
        let cors = h.http_filters.iter().any(|f| {
            !f.disabled
                && matches!(&f.config_type,
                    Some(hcm::http_filter::ConfigType::TypedConfig(a)) if config_type(a) == CORS_TYPE)
        });
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
        Ok(Hcm {
            upgrades,
            xfcc,
            stream_idle_timeout,
            max_stream_duration,
            internal_ranges,
            cors,
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
            server_name: if h.server_name.is_empty() {
                "envoy".to_string()
            } else {
                h.server_name.clone()
            },
            faults,
            rate_limits,
            rate_limit_first,
        })
    }
}

/// `udpa.type.v1.TypedStruct` / `xds.type.v3.TypedStruct`: a config named by its type URL.
#[derive(Clone, PartialEq, prost::Message)]
struct TypedStruct {
    #[prost(string, tag = "1")]
    type_url: String,
}

const TYPED_STRUCTS: [&str; 2] = [
    "type.googleapis.com/udpa.type.v1.TypedStruct",
    "type.googleapis.com/xds.type.v3.TypedStruct",
];

/// The type a filter's config names, seeing through TypedStruct wrappers.
fn config_type(a: &Any) -> String {
    if TYPED_STRUCTS.contains(&a.type_url.as_str()) {
        if let Ok(ts) = TypedStruct::decode(a.value.as_slice()) {
            return ts.type_url;
        }
    }
    a.type_url.clone()
}

const RATELIMIT_TYPE: &str = super::ratelimit::TYPE;
const CORS_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors";

/// Envoy's rule: the router must be the last filter (no filters at all means the router
/// alone); any other filter Portico does not implement is an error unless the config marks it
/// `is_optional` (or `disabled`). Returns the fault filters, which Portico implements.
/// A local rate limit filter of the chain; a route's per-filter config of the same name
/// replaces its config (a filter-level config without a bucket limits nothing).
#[derive(Debug)]
pub struct RateLimitFilter {
    pub name: String,
    pub config: Arc<LocalRateLimit>,
    pub disabled: bool,
}

type HttpFilters = (Vec<FaultFilter>, Vec<RateLimitFilter>, bool);

fn check_http_filters(filters: &[hcm::HttpFilter]) -> Result<HttpFilters, String> {
    let is_router = |f: &hcm::HttpFilter| match &f.config_type {
        Some(hcm::http_filter::ConfigType::TypedConfig(a)) => config_type(a) == ROUTER_TYPE,
        _ => false,
    };
    if let Some(i) = filters.iter().position(|f| f.name.is_empty()) {
        return Err(format!("http_filters[{i}]: name must not be empty"));
    }
    let Some(last) = filters.last() else {
        return Ok((Vec::new(), Vec::new(), false));
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
    let mut faults = Vec::new();
    let mut rate_limits = Vec::new();
    let mut rate_limit_first = false;
    for (i, f) in filters[..filters.len() - 1].iter().enumerate() {
        if is_router(f) {
            return Err(format!(
                "http_filters[{i}]: terminal filter '{}' must be the last filter",
                f.name
            ));
        }
        if let Some(hcm::http_filter::ConfigType::TypedConfig(a)) = &f.config_type {
            match config_type(a).as_str() {
                // A TypedStruct carries the config as JSON, which Portico does not map.
                FAULT_TYPE if a.type_url != FAULT_TYPE => {
                    return Err(format!(
                        "http_filters[{i}] '{}': a fault config wrapped in a TypedStruct is not supported",
                        f.name
                    ))
                }
                FAULT_TYPE => {
                    let config = Fault::from_any(a)
                        .map_err(|e| format!("http_filters[{i}] '{}': {e}", f.name))?;
                    faults.push(FaultFilter {
                        name: f.name.clone(),
                        config: Arc::new(config),
                        disabled: f.disabled,
                    });
                    continue;
                }
                RATELIMIT_TYPE => {
                    let config = LocalRateLimit::from_any(a)
                        .map_err(|e| format!("http_filters[{i}] '{}': {e}", f.name))?;
                    rate_limit_first |= faults.is_empty() && rate_limits.is_empty();
                    rate_limits.push(RateLimitFilter {
                        name: f.name.clone(),
                        config: Arc::new(config),
                        disabled: f.disabled,
                    });
                    continue;
                }
                // istiod puts CORS on every gateway listener; with no per-route policy it does
                // nothing in Envoy either.
                CORS_TYPE => continue,
                _ => {}
            }
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
    Ok((faults, rate_limits, rate_limit_first))
}

#[cfg(test)]
#[path = "listener_tests.rs"]
mod listener_tests;
