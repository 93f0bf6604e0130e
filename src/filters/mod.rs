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
pub mod compressor;
pub mod cors;
pub mod fault;
pub mod grpc_stats;
pub mod health_check;
pub mod local_ratelimit;
pub mod telemetry;
pub mod typed_struct;

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
}

impl RouteFilters {
    /// The word on the fault filter named `name`, if any.
    pub fn fault_override(&self, name: &str) -> Option<&fault::PerRoute> {
        self.faults.iter().find(|(n, _)| n == name).map(|(_, p)| p)
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
}

/// A filter's word on a request.
#[derive(Debug)]
pub enum Decision {
    Continue,
    /// Wait this long, then ask the same filter again (`after_delay`).
    Delay(Duration),
    /// Answer the request here; no later filter runs.
    Reply(LocalReply),
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
    pub details: &'static str,
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
}

impl FilterState {
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
        }
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
            | HttpFilter::HealthCheck(_) => Decision::Continue,
        }
    }
}

/// Runs the chain in order: the first local reply ends it (and is returned); delays are
/// waited out in place. Allocates nothing of its own.
pub async fn run(
    filters: &[HttpFilter],
    req: &Request<'_>,
    st: &mut FilterState,
    stats: Stats<'_>,
) -> Option<LocalReply> {
    for f in filters {
        let mut d = f.decode(req, st, stats);
        while let Decision::Delay(t) = d {
            st.delay_injected = true;
            tokio::time::sleep(t).await;
            d = f.after_delay(req, st, stats);
        }
        if let Decision::Reply(r) = d {
            return Some(r);
        }
    }
    None
}

#[cfg(test)]
#[path = "mod_tests.rs"]
mod mod_tests;
