//! Envoy's HTTP filters: the connection manager's `http_filters` as an ordered pipeline.
//!
//! Each filter is a module here: its config translated from the proto (pure), its
//! per-request decision, its stats. [`REGISTRY`] maps a config's type URL to the module's
//! translate function; the listener translation runs every `http_filters` entry through it and
//! keeps the filters that act per request, in chain order, in `Hcm::filters`. The request path
//! calls [`run`] once the route is known: each filter in order continues, delays (then
//! continues), or answers with a [`LocalReply`], and a filter after one that answered never
//! runs. The router is the terminal filter and stays in the proxy.
//!
//! A new filter: a module with a `translate_filter` (and a `decode` if it acts per request), a
//! [`HttpFilter`] variant when it does, and one line in [`REGISTRY`].
//!
//! Layering: this module reads the snapshot's shared types (matchers, routes) and the router's
//! request view; it never imports `proxy`, `admin`, `xds` or `server`. Stats live here and the
//! admin renders them.

pub mod alpn;
pub mod callout;
pub mod compressor;
pub mod cors;
pub mod counters;
pub mod ext_authz;
pub mod fault;
pub mod grpc_stats;
pub mod health_check;
pub mod jwt_authn;
pub mod local_ratelimit;
pub mod rbac;
pub mod telemetry;
pub mod typed_struct;

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::google::protobuf::Any;
use http::{HeaderName, HeaderValue};

use crate::matcher::RequestView;

/// One filter of a connection manager's chain that acts per request, built once at
/// translation.
#[derive(Debug)]
pub enum HttpFilter {
    Fault(fault::FaultFilter),
    LocalRateLimit(local_ratelimit::RateLimitFilter),
    Cors(cors::CorsFilter),
    GrpcStats(grpc_stats::GrpcStatsFilter),
    Compressor(compressor::CompressorFilter),
    HealthCheck(health_check::HealthCheckFilter),
    Rbac(rbac::RbacFilter),
    JwtAuthn(Box<jwt_authn::JwtAuthnFilter>),
    ExtAuthz(Box<ext_authz::ExtAuthzFilter>),
}

/// An `http_filters` entry as a translate function sees it.
pub struct FilterDecl<'a> {
    /// The entry's name: how routes' `typed_per_filter_config` address it.
    pub name: &'a str,
    pub config: &'a Any,
    pub disabled: bool,
}

/// What translating one `http_filters` entry gave.
#[derive(Debug)]
pub enum Translated {
    /// Runs on each request, in chain order.
    Run(HttpFilter),
    /// Config-only: the connection manager keeps it for the upstream connector (`istio.alpn`).
    Alpn(Arc<alpn::AlpnOverride>),
    /// `istio.stats`: the connection manager reports Istio's metrics at each request's end.
    IstioStats(Arc<crate::telemetry::istio_stats::StatsConfig>),
    /// `istio.metadata_exchange`: the peer metadata headers, exchanged by the request path.
    PeerMetadata(Arc<crate::telemetry::istio_stats::PeerMetadataConfig>),
    /// Accepted and never run: it cannot change where a request goes or whether it is
    /// allowed (see the module of the entry).
    Inert,
}

/// One registered filter type.
pub struct Registration {
    /// The type URL of its `typed_config` (seen through `TypedStruct` wrappers).
    pub type_url: &'static str,
    /// Envoy's (or Istio's) well-known name for it, as istiod names the entry.
    pub name: &'static str,
    pub translate: fn(&FilterDecl<'_>) -> Result<Translated, String>,
}

/// Every HTTP filter Portico accepts besides the router. A type not here is refused (NACK)
/// unless the entry is `is_optional` or `disabled`.
pub static REGISTRY: &[Registration] = &[
    Registration {
        type_url: fault::FAULT_TYPE,
        name: "envoy.filters.http.fault",
        translate: fault::translate_filter,
    },
    Registration {
        type_url: local_ratelimit::TYPE,
        name: "envoy.filters.http.local_ratelimit",
        translate: local_ratelimit::translate_filter,
    },
    Registration {
        type_url: cors::CORS_TYPE,
        name: "envoy.filters.http.cors",
        translate: cors::translate_filter,
    },
    Registration {
        type_url: health_check::TYPE,
        name: "envoy.filters.http.health_check",
        translate: health_check::translate_filter,
    },
    Registration {
        type_url: rbac::TYPE,
        name: "envoy.filters.http.rbac",
        translate: rbac::translate_filter,
    },
    Registration {
        type_url: ext_authz::TYPE,
        name: "envoy.filters.http.ext_authz",
        translate: ext_authz::translate_filter,
    },
    Registration {
        type_url: jwt_authn::TYPE,
        name: "envoy.filters.http.jwt_authn",
        translate: jwt_authn::translate_filter,
    },
    Registration {
        type_url: compressor::TYPE,
        name: "envoy.filters.http.compressor",
        translate: compressor::translate_filter,
    },
    Registration {
        type_url: alpn::ALPN_FILTER_TYPE,
        name: "istio.alpn",
        translate: alpn::translate_filter,
    },
    Registration {
        type_url: telemetry::ISTIO_TELEMETRY_TYPES[0],
        name: "istio.stats",
        translate: telemetry::translate_stats,
    },
    Registration {
        type_url: telemetry::ISTIO_TELEMETRY_TYPES[1],
        name: "istio.metadata_exchange",
        translate: telemetry::translate_filter,
    },
    Registration {
        type_url: telemetry::ISTIO_TELEMETRY_TYPES[2],
        name: "istio.metadata_exchange",
        translate: telemetry::translate_peer_metadata,
    },
    Registration {
        type_url: grpc_stats::TYPE,
        name: "envoy.filters.http.grpc_stats",
        translate: grpc_stats::translate_filter,
    },
];

/// The registration for a filter's config: by its type URL, through `TypedStruct` wrappers
/// and Istio's null-VM Wasm plugins.
pub fn lookup(config: &Any) -> Option<&'static Registration> {
    let t = match telemetry::istio_telemetry(config) {
        Some(t) => t.to_string(),
        None => telemetry::config_type(config),
    };
    REGISTRY.iter().find(|r| r.type_url == t)
}

/// What a route (or a weighted cluster entry) says to the chain's filters, by filter name:
/// its `typed_per_filter_config` levels resolved at translation (route over virtual host over
/// route configuration). A filter with per-route config keeps its part here.
#[derive(Debug, Default)]
pub struct RouteFilters {
    /// Fault filter overrides.
    pub faults: Vec<(String, fault::PerRoute)>,
    /// Local rate limit overrides, most specific level first.
    pub rate_limits: Vec<(String, Arc<local_ratelimit::LocalRateLimit>)>,
    /// CORS policies (None: no level sets one). Only forwarding routes carry them: their
    /// route entry is where Envoy's CORS filter looks.
    pub cors: Option<Arc<cors::RoutePolicies>>,
    /// RBAC overrides (`RBACPerRoute`), most specific level first.
    pub rbac: Vec<(String, Arc<rbac::PerRoute>)>,
    /// ext_authz's word (`ExtAuthzPerRoute`), the levels merged.
    pub ext_authz: Vec<(String, Arc<ext_authz::PerRoute>)>,
    /// jwt_authn's word (`PerRouteConfig`), most specific level first.
    pub jwt: Vec<(String, Arc<jwt_authn::PerRoute>)>,
}

impl RouteFilters {
    /// The word on the fault filter named `name`, if any.
    pub fn fault_override(&self, name: &str) -> Option<&fault::PerRoute> {
        self.faults.iter().find(|(n, _)| n == name).map(|(_, p)| p)
    }

    /// The word on the ext_authz filter named `name`, if any.
    pub fn ext_authz_override(&self, name: &str) -> Option<&ext_authz::PerRoute> {
        self.ext_authz
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| &**p)
    }

    /// The word on the RBAC filter named `name`, if any.
    pub fn rbac_override(&self, name: &str) -> Option<&rbac::PerRoute> {
        self.rbac.iter().find(|(n, _)| n == name).map(|(_, p)| &**p)
    }

    /// The word on the jwt_authn filter named `name`, if any.
    pub fn jwt_override(&self, name: &str) -> Option<&jwt_authn::PerRoute> {
        self.jwt.iter().find(|(n, _)| n == name).map(|(_, p)| &**p)
    }
}

/// What the request path hands every filter: the request as routing sees it, what the route
/// it matched says to the filters, and the cluster it picked with the weighted entry's own
/// word, all from one snapshot.
pub struct Request<'a> {
    pub view: &'a RequestView<'a>,
    pub route: Option<&'a RouteFilters>,
    pub picked: Option<(&'a str, Option<&'a RouteFilters>)>,
    /// The server's health, for the health check filter (None: no filter reads it).
    pub server: Option<&'a (dyn health_check::ServerHealth + Sync)>,
    /// The downstream connection the request came on (the policy filters read it).
    pub conn: Connection<'a>,
    /// Requests to the configuration's clusters (ext_authz, remote JWKS); None where no
    /// filter of the chain makes one (unit tests).
    pub upstreams: Option<&'a dyn callout::Upstreams>,
    /// The request body the connection manager buffered for a filter that checks it
    /// (ext_authz's `with_request_body`); None when no filter asked.
    pub body: Option<&'a BufferedBody>,
}

/// A request body read before the filters ran (it still goes upstream, replayed).
#[derive(Debug, Clone, Default)]
pub struct BufferedBody {
    pub bytes: bytes::Bytes,
    /// More followed than was buffered.
    pub partial: bool,
}

/// The downstream connection, as Envoy's policy filters see it (RBAC's `direct_remote_ip`,
/// `remote_ip`, `destination_ip`/`destination_port`, `requested_server_name`,
/// `authenticated`; ext_authz's attribute context).
#[derive(Clone, Copy, Default)]
pub struct Connection<'a> {
    /// The peer's address on the socket.
    pub direct_remote: Option<SocketAddr>,
    /// The client's address as the connection manager trusts it (`x-forwarded-for` with
    /// `xff_num_trusted_hops`, `use_remote_address`); the direct peer when nothing else is
    /// trusted.
    pub remote: Option<IpAddr>,
    /// The address the connection was accepted on.
    pub local: Option<SocketAddr>,
    /// The TLS server name the client asked for.
    pub sni: Option<&'a str>,
    /// The verified client certificate of an mTLS connection.
    pub peer: Option<&'a (dyn PeerIdentity + Sync)>,
    pub tls: bool,
}

/// A verified client certificate's identity (RBAC's `authenticated` principal).
pub trait PeerIdentity {
    fn uri_sans(&self) -> &[String];
    fn dns_sans(&self) -> &[String];
    /// The subject, RFC 2253.
    fn subject(&self) -> &str;
}

/// A filter's word on a request.
#[derive(Debug)]
pub enum Decision {
    Continue,
    /// Wait this long, then ask the same filter again (`after_delay`).
    Delay(Duration),
    /// Answer the request here; no later filter runs.
    Reply(LocalReply),
    /// The filter must wait for I/O (a call to an authorization server, a key fetch): the
    /// chain awaits the filter's [`HttpFilter::decode_async`], whose word is final.
    Async,
}

/// A filter's local reply, as Envoy's `sendLocalReply` takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    pub status: u16,
    pub body: Option<Bytes>,
    pub headers: Vec<(HeaderName, String)>,
    /// For a gRPC request: the grpc-status to answer with (else mapped from `status`).
    pub grpc_status: Option<u32>,
    /// Envoy's response code details.
    pub details: Cow<'static, str>,
}

/// What the filters leave on a request for its later phases (upstream headers, response
/// headers, the end of the request).
#[derive(Debug, Default)]
pub struct FilterState {
    /// Active faults this request holds (one per fault filter that injected).
    pub active_faults: u32,
    /// The fault filter in progress delayed the request (and holds its active fault).
    fault_delayed: bool,
    /// A local rate limit that limited this request without enforcing: its request headers.
    pub rate_limit_headers: Option<Arc<local_ratelimit::LocalRateLimit>>,
    /// The local rate limit whose `x-ratelimit-*` headers go on the response.
    pub rate_limit_response: Option<Arc<local_ratelimit::LocalRateLimit>>,
    /// A CORS request from an allowed origin: the policy and the origin, for the response.
    pub cors: Option<(Arc<cors::Cors>, String)>,
    /// A filter delayed the request (Envoy's `DI` response flag).
    pub delay_injected: bool,
    /// A gRPC call the gRPC stats filter counts (boxed: most requests are not).
    pub grpc: Option<Box<grpc_stats::GrpcCall>>,
    /// The compressor filters' Accept-Encoding and, once decided, the response's encoder.
    pub compress: Option<Box<compressor::CompressState>>,
    /// A compressor filter removes Accept-Encoding from the upstream request.
    pub remove_accept_encoding: bool,
    /// The health check filter: the server fails health checks (a response header says so).
    pub health_check_fail_header: bool,
    /// The health check filter: a health check's response names the local cluster.
    pub healthchecked_cluster: Option<String>,
    /// Envoy's dynamic metadata, by filter namespace (`envoy.filters.http.jwt_authn` ->
    /// provider -> payload): written by one filter, read by later ones (RBAC's metadata
    /// matchers) and by the access log. None until a filter writes.
    pub metadata: Option<Box<serde_json::Map<String, serde_json::Value>>>,
    /// Changes the filters make to the request's headers. Applied to the request before the
    /// next filter runs when `clear_route_cache` is set (the route is chosen again), else
    /// once the chain is done; what goes upstream and what the access log sees include them.
    pub request_header_ops: Vec<HeaderOp>,
    /// Changes the filters make to the response's headers (upstream responses and local
    /// replies alike).
    pub response_header_ops: Vec<HeaderOp>,
    /// A filter changed what routing reads: the route is chosen again before the next filter.
    pub clear_route_cache: bool,
}

/// One change to a header map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderOp {
    /// Replaces every value of the header.
    Set(HeaderName, HeaderValue),
    /// Adds a value, keeping the others.
    Append(HeaderName, HeaderValue),
    Remove(HeaderName),
}

impl HeaderOp {
    pub fn apply(&self, headers: &mut http::HeaderMap) {
        match self {
            HeaderOp::Set(k, v) => {
                headers.insert(k.clone(), v.clone());
            }
            HeaderOp::Append(k, v) => {
                headers.append(k.clone(), v.clone());
            }
            HeaderOp::Remove(k) => {
                headers.remove(k);
            }
        }
    }
}

impl FilterState {
    /// The metadata a filter wrote under `namespace`, if any.
    pub fn metadata(&self, namespace: &str) -> Option<&serde_json::Value> {
        self.metadata.as_ref()?.get(namespace)
    }

    /// Sets `key` under the filter namespace `namespace` (an object, created on first use).
    pub fn set_metadata(&mut self, namespace: &str, key: String, value: serde_json::Value) {
        let all = self.metadata.get_or_insert_with(Default::default);
        let ns = all
            .entry(namespace.to_string())
            .or_insert_with(|| serde_json::Value::Object(Default::default()));
        if !ns.is_object() {
            *ns = serde_json::Value::Object(Default::default());
        }
        if let serde_json::Value::Object(m) = ns {
            m.insert(key, value);
        }
    }

    /// Headers the filters add to the request sent upstream: (name, value, append).
    pub fn upstream_request_headers(&self) -> &[(HeaderName, HeaderValue, bool)] {
        self.rate_limit_headers
            .as_ref()
            .map_or(&[], |rl| rl.request_headers_not_enforced.as_slice())
    }

    /// The filters' response side, on upstream responses and local replies alike.
    pub fn response_headers(&self, mut put: impl FnMut(&'static str, &str)) {
        if let Some(c) = &self.healthchecked_cluster {
            put("x-envoy-upstream-healthchecked-cluster", c);
        }
        if self.health_check_fail_header {
            put("x-envoy-immediate-health-check-fail", "true");
        }
        if let Some((c, origin)) = &self.cors {
            cors::response_headers(c, origin, &mut put);
        }
        if let Some(rl) = &self.rate_limit_response {
            rl.x_ratelimit_headers(&mut put);
        }
    }

    /// At the end of the request: the active faults it held are released.
    pub fn release(&mut self, stats: &fault::FaultStats) {
        if self.active_faults > 0 {
            stats.active_faults.fetch_sub(
                u64::from(self.active_faults),
                std::sync::atomic::Ordering::Relaxed,
            );
            self.active_faults = 0;
        }
    }
}

/// The stats handles the filters count into (the connection manager's scope).
#[derive(Clone, Copy)]
pub struct Stats<'a> {
    pub fault: &'a fault::FaultStats,
    /// The connection manager's named counters (RBAC).
    pub named: &'a crate::filters::counters::NamedCounters,
}

impl HttpFilter {
    /// The entry's name in the chain.
    pub fn name(&self) -> &str {
        match self {
            HttpFilter::Fault(f) => &f.name,
            HttpFilter::LocalRateLimit(f) => &f.name,
            HttpFilter::Cors(f) => &f.name,
            HttpFilter::GrpcStats(f) => &f.name,
            HttpFilter::Compressor(f) => &f.name,
            HttpFilter::HealthCheck(f) => &f.name,
            HttpFilter::Rbac(f) => &f.name,
            HttpFilter::JwtAuthn(f) => &f.name,
            HttpFilter::ExtAuthz(f) => &f.name,
        }
    }

    /// The filter reads the connection (`Request::conn`): only then does the request path
    /// work it out.
    pub fn reads_connection(&self) -> bool {
        matches!(self, HttpFilter::Rbac(_) | HttpFilter::ExtAuthz(_))
    }

    /// The request's headers reach this filter.
    pub fn decode(&self, req: &Request<'_>, st: &mut FilterState, stats: Stats<'_>) -> Decision {
        match self {
            HttpFilter::Fault(f) => f.decode(req, st, stats.fault),
            HttpFilter::LocalRateLimit(f) => f.decode(req, st),
            HttpFilter::Cors(f) => f.decode(req, st),
            HttpFilter::GrpcStats(f) => f.decode(req, st),
            HttpFilter::Compressor(f) => f.decode(req, st),
            HttpFilter::HealthCheck(f) => f.decode(req, st),
            HttpFilter::Rbac(f) => f.decode(req, st, stats.named),
            HttpFilter::JwtAuthn(f) => f.decode(req, st, stats.named),
            HttpFilter::ExtAuthz(f) => f.decode(req, st, stats.named),
        }
    }

    /// The delay this filter asked for is over.
    pub fn after_delay(
        &self,
        req: &Request<'_>,
        st: &mut FilterState,
        stats: Stats<'_>,
    ) -> Decision {
        match self {
            HttpFilter::Fault(f) => f.after_delay(req, st, stats.fault),
            HttpFilter::LocalRateLimit(_)
            | HttpFilter::Cors(_)
            | HttpFilter::GrpcStats(_)
            | HttpFilter::Compressor(_)
            | HttpFilter::HealthCheck(_)
            | HttpFilter::Rbac(_)
            | HttpFilter::JwtAuthn(_)
            | HttpFilter::ExtAuthz(_) => Decision::Continue,
        }
    }

    /// The filter said [`Decision::Async`]: its I/O, awaited. Its answer is final (a filter
    /// never says `Async` twice for one request).
    pub async fn decode_async(&self, req: &Request<'_>, st: &mut FilterState) -> Decision {
        match self {
            HttpFilter::ExtAuthz(f) => f.decode_async(req, st).await,
            HttpFilter::JwtAuthn(f) => f.decode_async(req, st).await,
            HttpFilter::Fault(_)
            | HttpFilter::LocalRateLimit(_)
            | HttpFilter::Cors(_)
            | HttpFilter::GrpcStats(_)
            | HttpFilter::Compressor(_)
            | HttpFilter::HealthCheck(_)
            | HttpFilter::Rbac(_) => Decision::Continue,
        }
    }
}

/// How far the chain got.
#[derive(Debug)]
pub enum Outcome {
    /// Every filter continued: the router runs.
    Done,
    /// A filter answered; no later filter runs.
    Reply(LocalReply),
    /// The filter before `next` cleared the route cache: the request path applies the
    /// filters' request header changes, chooses the route again and resumes at `next`.
    Reroute { next: usize },
}

/// Runs the chain in order from filter `from`: the first local reply ends it (and is
/// returned); delays are waited out in place, asynchronous filters awaited. Allocates
/// nothing of its own.
pub async fn run(
    filters: &[HttpFilter],
    from: usize,
    req: &Request<'_>,
    st: &mut FilterState,
    stats: Stats<'_>,
) -> Outcome {
    for (i, f) in filters.iter().enumerate().skip(from) {
        let mut d = f.decode(req, st, stats);
        loop {
            match d {
                Decision::Delay(t) => {
                    st.delay_injected = true;
                    tokio::time::sleep(t).await;
                    d = f.after_delay(req, st, stats);
                }
                Decision::Async => d = f.decode_async(req, st).await,
                Decision::Reply(r) => return Outcome::Reply(r),
                Decision::Continue => break,
            }
        }
        if st.clear_route_cache {
            st.clear_route_cache = false;
            return Outcome::Reroute { next: i + 1 };
        }
    }
    Outcome::Done
}

#[cfg(test)]
#[path = "mod_tests.rs"]
mod mod_tests;
