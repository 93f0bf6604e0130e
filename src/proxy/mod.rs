//! The HTTP request path: a pingora `ProxyHttp` whose hooks run Envoy's HTTP connection
//! manager and router as a pipeline of phases, on one snapshot per request.
//!
//! A request goes through these phases, in order (the pingora hook that runs each, and the
//! module that holds it):
//!
//! 1. `request_filter`, `Gateway::begin` here: loads the snapshot, the one the request uses
//!    from its first filter to its last retry and for its mirrors (`Ctx::snapshot`), and finds
//!    in it the filter chain the connection was accepted on (`PinnedChain`).
//! 2. `request_filter`, `downstream`: the codec's refusals, header names, path normalization,
//!    `x-forwarded-proto`, `require_tls`, XFCC; upgrades once the route is known.
//! 3. `request_filter`, `routing`: route match (`router::route`), weighted-cluster pick.
//! 4. `request_filter`: the HTTP filters. `filters::run` runs the connection manager's
//!    `http_filters` in chain order; each lives in `src/filters/`, and a new filter goes there
//!    (its module and a registry line), not here. The router is the terminal filter:
//! 5. `request_filter`, `routing`: the route's action (direct response, redirect, or forward
//!    with its rewrites, retry policy and headers); `upstream` chooses the cluster's host,
//!    `mirror` the mirror clusters; `downstream` sets the connection manager's request
//!    headers and `timeouts` the request's timers.
//! 6. `upstream_peer`, `connected_to_upstream`, `upstream_request_filter`: `upstream` picks
//!    each attempt's connection (a new host on a retry, from `retries`) and writes the
//!    upstream request's headers (`routing` applies the rewrites); `request_body_filter`
//!    copies the body for `mirror`.
//! 7. `upstream_response_filter`, `error_while_proxy`, `fail_to_connect`: `retries` records
//!    each attempt's outcome and decides whether to try again; `response_filter`:
//!    `upstream` writes the response headers.
//! 8. `fail_to_proxy`: `local_reply` answers a request that failed upstream. Every phase
//!    that answers itself goes through `local_reply` (HTTP, or trailers-only gRPC).
//! 9. `logging`, here: releases what the request held (slots, active counts, stats); `trace`
//!    finishes the span it started after the connection manager's request headers (5).
//!
//! The other modules serve connections: `listeners` (runtime listeners, filter chain
//! selection, drains), `tls`, `client_cert`, `proxy_protocol`, `tcp` (tcp_proxy), `hbone`
//! (internal listeners), `upgrade`, `upstream_tls`, `io`.

mod callout;
pub mod client_cert;
pub mod conn;
mod downstream;
mod framing;
mod h1;
mod h1_session;
mod h1_upstream;
mod hbone;
mod head;
pub mod io;
mod istio;
pub mod listeners;
mod local_reply;
pub mod log_limit;
mod mirror;
mod normalize;
mod observe;
mod pool;
pub mod proxy_protocol;
mod retries;
mod routing;
pub mod tcp;
mod timeouts;
pub mod tls;
mod trace;
mod up_io;
mod upgrade;
mod upstream;
mod upstream_tls;

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, Session};

use crate::admin::stats::HcmStats;
use crate::filters::{self, FilterState};
use crate::router;
use crate::snapshot::cluster::Cluster;
use crate::snapshot::retry::RetryPolicy;
use crate::snapshot::route::Action;
use crate::snapshot::ActiveChain;
use crate::State;

/// One per filter chain and worker: every connection accepted on the chain is served by it
/// for the connection's whole life, so a request runs on the chain its connection came in on.
pub struct Gateway {
    pub chain: Arc<PinnedChain>,
    pub state: Arc<State>,
    pub hcm_stats: Arc<HcmStats>,
}

/// A filter chain as its connections hold it. Its identity is the `Arc` of its config: a push
/// that leaves the chain unchanged keeps that `Arc` (`ListenerDef::keep_unchanged_chains`),
/// wherever the chain moves in the list.
pub struct PinnedChain {
    pub listener: String,
    pub def: Arc<crate::snapshot::listener::ChainDef>,
    /// The chain as in the latest snapshot that had it (updated on each push that keeps it):
    /// what its connections use once a push changed or removed it, while they drain.
    pub last: arc_swap::ArcSwap<ActiveChain>,
    /// `Some` once the chain is draining: when the drain started, for the gradual strategy.
    pub draining: arc_swap::ArcSwapOption<Instant>,
    /// Every response closes its connection (an immediate drain, or shutting down).
    pub close_all: std::sync::atomic::AtomicBool,
    pub drain: Drain,
}

/// Envoy's `--drain-time-s` and `--drain-strategy`: how connections of a changed or removed
/// filter chain (or listener) are let go.
#[derive(Debug, Clone, Copy)]
pub struct Drain {
    pub time: std::time::Duration,
    /// `immediate`: every connection is told at once (HTTP/1 `connection: close` on its next
    /// response, HTTP/2 a GOAWAY once its next response is sent); `gradual` (Envoy's default):
    /// each response closes its connection with a chance that grows over the drain time.
    pub immediate: bool,
}

impl Default for Drain {
    fn default() -> Drain {
        Drain {
            time: std::time::Duration::from_secs(600),
            immediate: false,
        }
    }
}

impl PinnedChain {
    /// The chain in `snap` (routes as RDS last delivered them), or as it last was if that
    /// snapshot no longer has it.
    fn in_snapshot(&self, snap: &crate::snapshot::Snapshot) -> Arc<ActiveChain> {
        snap.listeners
            .get(&self.listener)
            .and_then(|l| l.chains.iter().find(|c| Arc::ptr_eq(&c.def, &self.def)))
            .cloned()
            .unwrap_or_else(|| self.last.load_full())
    }

    /// Whether this response should close its connection because the chain is draining, as
    /// Envoy's `drainClose` decides when a response's headers are written: always with the
    /// immediate strategy (and when shutting down), else with Envoy's odds, the share of the
    /// drain time already gone.
    fn drain_close(&self) -> bool {
        if self.close_all.load(Relaxed) {
            return true;
        }
        let draining = self.draining.load();
        let Some(since) = draining.as_deref() else {
            return false;
        };
        let gone = since.elapsed().as_secs_f64() / self.drain.time.as_secs_f64().max(1e-3);
        fastrand::f64() < gone
    }
}

/// Per-request state: the snapshot loaded once, and what routing decided.
#[derive(Default)]
pub struct Ctx {
    /// Served by Portico's own HTTP/1 loop (`h1`), whose upstream writer lowercases names and
    /// whose heads `h1_session::Plain::parse` passed (no body, upgrade or `Expect`).
    own_loop: bool,
    /// What the request shares with Portico's own HTTP/1 session (`h1_session`), when it has
    /// one: the keep-alive its hooks decide.
    own: Option<Arc<h1_session::Conn>>,
    /// That session, for the own loop to call directly (`h1_session::OwnAt`).
    own_at: h1_session::OwnAt,
    /// The own loop's timer for upstream reads, lent by the client's connection for the
    /// request (`timeouts::LazyTimer`).
    read_timer: timeouts::LazyTimer,
    listener: Option<Arc<ActiveChain>>,
    cluster: Option<Arc<Cluster>>,
    /// The request's one snapshot, loaded when it starts: routing, upstream selection,
    /// retries, internal listeners' chains and mirrors all read this one.
    snapshot: Option<Arc<crate::snapshot::Snapshot>>,
    host_index: usize,
    peer: Option<SocketAddr>,
    prefix_rewrite: Option<(usize, String)>,
    /// The whole new path and query, from `regex_rewrite`.
    path_rewrite: Option<String>,
    host_rewrite: Option<String>,
    /// The request's hash for ring hash and Maglev, kept for retries.
    request_hash: Option<u64>,
    /// `auto_host_rewrite`: the chosen endpoint's hostname becomes the Host.
    auto_host: bool,
    /// `append_x_forwarded_host` on a route that rewrites the host: the original Host.
    forwarded_host: Option<String>,
    /// The route rewrote the host (not the connection manager's port stripping).
    route_host: bool,
    timeout: Option<std::time::Duration>,
    /// When the route timeout runs out, across every attempt.
    deadline: Option<Instant>,
    /// The per-try timeout (route policy or `x-envoy-upstream-rq-per-try-timeout-ms`).
    per_try: Option<std::time::Duration>,
    /// When the stream's maximum duration runs out (`max_stream_duration`, `grpc-timeout`).
    stream_deadline: Option<Instant>,
    /// The stream idle timeout (route `idle_timeout`, else the connection manager's).
    idle: Option<std::time::Duration>,
    /// Which timeout bounds the current attempt's wait for the upstream.
    timeout_kind: timeouts::TimeoutKind,
    /// This request is the last its upstream connection may carry
    /// (`max_requests_per_connection`).
    close_upstream: bool,
    /// The request carries none of the hop-by-hop fields (nor those Envoy forwards though
    /// pingora strips them): the own loop looked (`h1::strip_hop_by_hop`), and the upstream
    /// request's policy has nothing to strip or put back.
    hop_free: bool,
    retry: Option<Arc<RetryPolicy>>,
    /// Upstream attempts started (1 on the first try).
    attempts: u32,
    /// Hosts already tried, for the previous_hosts predicate (allocated only on a retry).
    tried: Vec<usize>,
    /// The current attempt's outcome is to be retried (set where it is decided, read by
    /// `error_while_proxy`, which pingora calls afterwards).
    retrying: bool,
    /// This request holds one of the cluster's concurrent-retry slots.
    retry_slot: bool,
    /// This request holds one of the cluster's `max_connections` slots.
    cx_slot: bool,
    /// Mirrors this request goes to, and the copy being taken of it.
    mirror: Option<Box<mirror::MirrorJob>>,
    /// What the HTTP filters left for the later phases (headers, active faults).
    filters: FilterState,
    attempt_count_to_upstream: bool,
    attempt_count_to_client: bool,
    /// When the upstream attempt started sending, since the request's start.
    upstream_start: Option<std::time::Duration>,
    /// The clock when `choose_peer` worked out the attempt's timeouts from it.
    peer_at: Option<Instant>,
    /// A reading of the clock that nothing since has waited on, for the next step that
    /// needs the time to take instead of reading it again (a reading costs ~25 ns here, and
    /// a request made eleven): `arm_timers`' for the first attempt's `choose_peer`, then
    /// `choose_peer`'s for the upstream request's start when the connection came from the
    /// pool. Cleared where a step may wait (a connect, a circuit breaker's queue).
    clock: Option<Instant>,
    /// `set-cookie` values for cookies a hash policy generated, added to the upstream response.
    set_cookies: Vec<String>,
    /// The upstream's response code was counted when its headers arrived.
    code_recorded: bool,
    counted_active: bool,
    /// Response header mutations of the chosen route (and weighted-cluster entry), applied to
    /// the upstream response or to the route's own local replies.
    resp_headers: Option<routing::RespHeaders>,
    /// A gRPC request (by content-type): Envoy turns every local reply after routing into a
    /// trailers-only gRPC response for it.
    grpc_request: bool,
    /// An allowed HTTP/1.1 upgrade (WebSocket): its `Connection`/`Upgrade` travel upstream and
    /// the router's timers never start, as Envoy's request never ends before the switch.
    upgrade: bool,
    /// The upstream answered an upgrade without switching: Envoy relays the head only.
    discard_body: bool,
    /// This attempt speaks HTTP/2 upstream (the cluster's protocol, or the client's under
    /// `use_downstream_protocol_config`).
    upstream_h2: bool,
    /// This attempt's peer is a plain TCP one (no TLS, no internal listener): its settings are
    /// the cluster's timeouts, keepalive and bind address only (`choose_peer`), so the own
    /// loop keys its pool by `pool::plain_key` and keeps the peer's box for a next request
    /// (`upstream::keep_plain`).
    plain_peer: bool,
    /// The request's record for access logs, metrics and traces (`observe`).
    pub(crate) info: crate::telemetry::StreamInfo,
    /// The request carried `x-envoy-peer-metadata-id` / `x-envoy-peer-metadata` (the
    /// metadata exchange answers with the gateway's own then).
    mx_request: (bool, bool),
    /// The gateway's span, when the request is traced and sampled (`trace`).
    trace: Option<Box<trace::ActiveTrace>>,
    /// The request passed the connection manager's checks (Envoy traces from there on), and
    /// whether `trace::begin` already ran for it.
    traceable: bool,
    trace_begun: bool,
    /// `info.downstream_remote` was settled as the connection manager reached the request,
    /// before it appended to `x-forwarded-for` (`observe::finish` works it out otherwise).
    remote_settled: bool,
    /// The matched route's decorator (for a span begun late), and the operation an ingress
    /// response carries in `x-envoy-decorator-operation`.
    decorator: Option<Arc<crate::snapshot::route::Decorator>>,
    decorator_response: Option<Arc<str>>,
    /// The routed cluster's counters for this gRPC call (`envoy.filters.http.grpc_stats`).
    grpc_counters: Option<Arc<crate::live::grpc::MethodCounters>>,
}

/// `Box::new(make())` with the value made in the box: `Box::new` makes it on the stack and
/// then copies it in, a copy of the whole type (a request's future is 4 KB whatever state it
/// starts in; pingora's peer 672 bytes) on every request.
#[inline(always)]
pub(crate) fn in_box<T>(make: impl FnOnce() -> T) -> Box<T> {
    Box::write(Box::new_uninit(), make())
}

/// The HTTP filters' response side (CORS, `x-ratelimit-*`, the policy filters' headers), on
/// upstream responses and local replies alike.
fn filter_response_headers(resp: &mut ResponseHeader, ctx: &Ctx) -> Result<()> {
    let mut out = Ok(());
    ctx.filters.response_headers(|k, v| {
        if out.is_ok() {
            out = resp.insert_header(k, v).map(|_| ());
        }
    });
    out?;
    for op in &ctx.filters.response_header_ops {
        match op {
            filters::HeaderOp::Set(k, v) => resp.insert_header(k.clone(), v.clone())?,
            filters::HeaderOp::Append(k, v) => {
                resp.append_header(k.clone(), v.clone()).map(|_| ())?
            }
            filters::HeaderOp::Remove(k) => {
                resp.remove_header(k);
            }
        }
    }
    Ok(())
}

/// pingora's `set_keepalive` on the request's downstream session, Portico's own HTTP/1
/// session included (pingora ignores it for a custom session).
fn keepalive(session: &mut Session, ctx: &Ctx, secs: Option<u64>) {
    match &ctx.own {
        Some(c) => c.set_keepalive(secs),
        None => session.set_keepalive(secs),
    }
}

/// Whether the request came over HTTP/1: pingora's session, or Portico's own (the only
/// custom session there is).
pub(super) fn downstream_h1(session: &Session) -> bool {
    matches!(
        session.as_downstream(),
        pingora_core::protocols::http::ServerSession::H1(_)
            | pingora_core::protocols::http::ServerSession::Custom(_)
    )
}

/// For pingora's HTTP/1 session, which writes a head's stored reason phrase (the upstream's,
/// else the `http` crate's): the one Envoy's codec writes (`head::envoy_reason`), stored only
/// where the two differ. Portico's own session writes Envoy's itself; HTTP/2 has none.
pub(super) fn envoy_reason_phrase(session: &Session, resp: &mut ResponseHeader) -> Result<()> {
    if let pingora_core::protocols::http::ServerSession::H1(_) = session.as_downstream() {
        resp.set_reason_phrase(Some(head::envoy_reason(resp.status)))?;
    }
    Ok(())
}

/// The HTTP/1 request head as it was read (request line and fields).
pub(super) fn raw_h1_head(session: &Session) -> Option<Bytes> {
    match session.as_downstream() {
        pingora_core::protocols::http::ServerSession::H1(h1) => Some(h1.get_headers_raw_bytes()),
        pingora_core::protocols::http::ServerSession::Custom(c) => {
            Some(c.pseudo_raw_h1_request_header())
        }
        _ => None,
    }
}

/// How long an HTTP/1 connection waits for its next request after this response: the
/// connection manager's `idle_timeout` (None: forever), capped or ended by its limits.
fn set_keepalive(
    session: &mut Session,
    ctx: &Ctx,
    idle: Option<std::time::Duration>,
    admit: conn::Admit,
) {
    let idle = match admit {
        conn::Admit::Close => None,
        conn::Admit::Keep => Some(idle),
        conn::Admit::KeepAtMost(d) => Some(Some(idle.map_or(d, |i| i.min(d)))),
    };
    // pingora counts whole seconds, and zero means forever.
    let secs = idle.map(|i| i.map_or(0, |d| d.as_secs_f64().ceil().max(1.0) as u64));
    keepalive(session, ctx, secs);
}

/// The connection manager's state of the request's connection, when its chain limits
/// connections (HTTP/1 only).
/// Whether pingora means to keep this HTTP/1 connection alive after the request.
fn h1_kept_alive(session: &Session, ctx: &Ctx) -> bool {
    if let Some(c) = &ctx.own {
        return c.keepalive().is_some();
    }
    matches!(
        session.as_downstream(),
        pingora_core::protocols::http::ServerSession::H1(s1)
            if s1.get_keepalive_timeout().is_some()
    )
}

/// The cluster's limits on a response head (Envoy's defaults before one is chosen).
pub(super) fn response_limits(ctx: &Ctx) -> framing::Limits {
    ctx.cluster
        .as_ref()
        .map_or_else(framing::Limits::default, |c| framing::Limits {
            fields: c.def.max_response_headers,
            bytes: c.def.max_response_head_bytes,
        })
}

fn conn_state(session: &Session) -> Option<&conn::ConnState> {
    conn::info(session.digest())?.state.as_deref()
}

/// Whether pingora's log line about `e` is held back: a client's own doing always (logged at
/// debug), the rest beyond the per-second budget (`log_limit`).
fn quiet(session: &Session, e: &Error) -> bool {
    if *e.esource() == pingora_error::ErrorSource::Downstream {
        tracing::debug!(
            "request ended by the client: {e}, {}",
            session.request_summary()
        );
        return true;
    }
    match log_limit::PROXY.check() {
        log_limit::Verdict::Suppress => true,
        log_limit::Verdict::Log { suppressed: 0 } => false,
        log_limit::Verdict::Log { suppressed } => {
            tracing::warn!(
                "{suppressed} proxy warnings and errors were not logged (more than {} a second)",
                log_limit::BURST
            );
            false
        }
    }
}

/// The filters' changes to the request's headers, made on the request itself: the route is
/// chosen on them, and the upstream request and the access log see them.
fn apply_request_header_ops(session: &mut Session, ctx: &mut Ctx) -> Result<()> {
    if ctx.filters.request_header_ops.is_empty() {
        return Ok(());
    }
    let req = session.req_header_mut();
    for op in ctx.filters.request_header_ops.drain(..) {
        match op {
            filters::HeaderOp::Set(k, v) => req.insert_header(k, v)?,
            filters::HeaderOp::Append(k, v) => req.append_header(k, v).map(|_| ())?,
            filters::HeaderOp::Remove(k) => {
                req.remove_header(&k);
            }
        }
    }
    Ok(())
}

/// The server's health as the health check filter reads it.
struct ServerView<'a> {
    state: &'a State,
    snapshot: Option<&'a crate::snapshot::Snapshot>,
}

impl filters::health_check::ServerHealth for ServerView<'_> {
    fn failing(&self) -> bool {
        self.state.health_check_failed.load(Relaxed)
    }

    fn cluster(&self, name: &str) -> Option<(usize, usize)> {
        let c = self.snapshot?.clusters.get(name)?;
        Some((c.healthy_count(), c.endpoints.hosts.len()))
    }

    fn local_cluster(&self) -> &str {
        self.state
            .bootstrap
            .as_ref()
            .and_then(|b| b.node.as_ref())
            .map_or("", |n| n.cluster.as_str())
    }
}

impl Gateway {
    /// The chain's compressor filters on an upstream response: at most one compresses it
    /// (headers now, body in `response_body_filter`).
    fn compress_response(
        &self,
        session: &Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let Some(cs) = ctx.filters.compress.as_mut() else {
            return Ok(());
        };
        let Some(hcm) = ctx.listener.as_ref().and_then(|l| l.def.hcm()) else {
            return Ok(());
        };
        let status = resp.status.as_u16();
        let empty = resp
            .headers
            .get(http::header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() == b"0");
        let headers_only = session.req_header().method == http::Method::HEAD
            || status < 200
            || status == 204
            || status == 304
            || empty
            || ctx.discard_body;
        filters::compressor::response_headers(&hcm.filters, cs, resp, headers_only);
        if cs.encoder.is_some() && downstream_h1(session) {
            resp.insert_header(http::header::TRANSFER_ENCODING, "chunked")?;
        }
        Ok(())
    }

    /// The request's one snapshot, kept in `ctx`, and the connection's own chain in it,
    /// whatever later pushes did to the listener's others.
    fn begin(&self, session: &mut Session, ctx: &mut Ctx) -> Arc<ActiveChain> {
        self.hcm_stats.start();
        ctx.counted_active = true;
        let snap = self.state.snapshot();
        let listener = self.chain.in_snapshot(&snap);
        ctx.snapshot = Some(snap);
        observe::begin(session, &mut ctx.info);
        // Envoy sends HTTP/1 names upstream lower case unless the connection manager asks
        // otherwise; without the case, every header write is one map insert (`head`).
        if ctx.own_loop && listener.def.hcm().is_some_and(|h| !h.keep_header_case) {
            head::drop_case(session.req_header_mut());
        }
        ctx.listener = Some(listener.clone());
        listener
    }
}

/// What the connection manager read of the body for its filters.
enum BodyRead {
    None,
    Read(filters::BufferedBody),
    /// Longer than a filter allows without `allow_partial_message`.
    TooLarge,
}

impl Gateway {
    /// Reads the request body a filter wants to check (ext_authz's `with_request_body`): up
    /// to the largest `max_request_bytes` of the chain's filters, kept in pingora's retry
    /// buffer so the proxy still sends it upstream.
    async fn buffer_body_for_filters(
        &self,
        session: &mut Session,
        hcm: &crate::snapshot::listener::Hcm,
        expect_continue: &mut bool,
    ) -> Result<BodyRead> {
        let wanted = hcm
            .filters
            .iter()
            .filter_map(|f| match f {
                filters::HttpFilter::ExtAuthz(a) => a.body_settings(),
                _ => None,
            })
            .max_by_key(|b| b.max_bytes);
        let Some(want) = wanted else {
            return Ok(BodyRead::None);
        };
        if session.as_mut().is_body_empty() || session.is_upgrade_req() {
            return Ok(BodyRead::Read(filters::BufferedBody::default()));
        }
        if std::mem::take(expect_continue) {
            session
                .write_response_header(Box::new(ResponseHeader::build(100, Some(0))?), false)
                .await?;
            session
                .req_header_mut()
                .remove_header(&http::header::EXPECT);
        }
        session.as_mut().enable_retry_buffering();
        let mut buf = bytes::BytesMut::new();
        let mut done = false;
        while buf.len() < want.max_bytes {
            match session.read_request_body().await? {
                Some(chunk) => buf.extend_from_slice(&chunk),
                None => {
                    done = true;
                    break;
                }
            }
        }
        if !done && session.as_mut().is_body_done() {
            done = true;
        }
        let partial = !done || buf.len() > want.max_bytes;
        if partial && !want.allow_partial {
            return Ok(BodyRead::TooLarge);
        }
        buf.truncate(want.max_bytes);
        Ok(BodyRead::Read(filters::BufferedBody {
            bytes: buf.freeze(),
            partial,
        }))
    }
}

/// pingora's request phases (the `ProxyHttp` methods below forward here). Portico's own
/// HTTP/1 loop (`h1`) calls these directly: through the trait (`async_trait`) each call's
/// future is boxed, an allocation per phase per request.
impl Gateway {
    pub(super) async fn route_request(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        let listener = self.begin(session, ctx);
        // Only a connection with timers needs to know whether a body follows.
        if conn_state(session).is_some() {
            let body_empty = session.as_mut().is_body_empty();
            if let Some(c) = conn_state(session) {
                c.head_received(body_empty);
            }
        }
        // Downstream, then routing, then the HTTP filters, then the router (module comment).
        if self.downstream_checks(session, ctx, &listener).await? {
            return Ok(true);
        }
        ctx.traceable = true;
        // `idle_timeout`: how long this HTTP/1 connection may wait for its next request (the
        // keep-alive pingora decided for it stays as it is otherwise), no longer than its
        // maximum duration allows; its maximum number of requests may close it.
        if let Some(h) = listener.def.hcm() {
            let kept = h1_kept_alive(session, ctx);
            let admit = conn_state(session).map_or(conn::Admit::Keep, |c| c.admit());
            if kept {
                set_keepalive(session, ctx, h.idle_timeout, admit);
            }
        }
        // Set after the codec-level checks above, whose replies stay plain.
        ctx.grpc_request = router::is_grpc(&session.req_header().headers);
        // The own loop serves no head with an `Expect` (`h1_session::Plain::parse`).
        let mut expect_continue =
            !ctx.own_loop && downstream::expects_continue(session.req_header());
        // `istio.metadata_exchange` and `istio.stats` read the request's headers (the former
        // removes the peer's metadata headers, which are not forwarded).
        istio::request(session, ctx);
        // ext_authz's `with_request_body`: the body is read before the filters run and
        // replayed upstream from pingora's retry buffer (a client waiting for `100 Continue`
        // gets it first, as Envoy's connection manager sends it).
        let body = match listener.def.hcm() {
            Some(h) => {
                match self
                    .buffer_body_for_filters(session, h, &mut expect_continue)
                    .await?
                {
                    BodyRead::Read(b) => Some(b),
                    BodyRead::None => None,
                    BodyRead::TooLarge => {
                        ctx.outcome(None, "request_payload_too_large");
                        return self
                            .local_reply(
                                session,
                                ctx,
                                413,
                                Some(bytes::Bytes::from_static(b"Payload Too Large")),
                                &[],
                            )
                            .await;
                    }
                }
            }
            None => None,
        };
        // The route and its weighted-cluster pick, before any filter runs.
        let mut host = downstream::authority(session, &listener);
        let mut matched = {
            let view = routing::request_view(session.req_header(), &host);
            router::route(&listener.routes, &view).map(|(_, r)| r)
        };
        let Some(hcm) = listener.def.hcm() else {
            // Checked above when the chain was loaded.
            return self.local_reply(session, ctx, 404, None, &[]).await;
        };
        if !self.admit_upgrade(session, ctx, hcm, matched) {
            keepalive(session, ctx, None);
            return self.local_reply(session, ctx, 403, None, &[]).await;
        }
        let mut picked = routing::pick_cluster(matched);
        // The connection manager's HTTP filters, in chain order; the router is the last. A
        // filter that clears the route cache has the route chosen again before the next one.
        if !hcm.filters.is_empty() {
            let stats = filters::Stats {
                fault: &self.hcm_stats.fault,
                named: &self.hcm_stats.named,
            };
            // The connection as the policy filters see it, worked out only for a chain that
            // has one (istiod's chains always carry fault and CORS, which do not read it).
            let reads_conn = hcm
                .filters
                .iter()
                .any(filters::HttpFilter::reads_connection);
            let peer = if reads_conn {
                client_cert::of(session.digest())
            } else {
                None
            };
            let mut next = 0;
            loop {
                let server = ServerView {
                    state: &self.state,
                    snapshot: ctx.snapshot.as_deref(),
                };
                let view = routing::request_view(session.req_header(), &host);
                let direct = ctx.info.downstream_direct_remote;
                let conn = if reads_conn {
                    filters::Connection {
                        direct_remote: direct,
                        remote: downstream::downstream_remote(view.headers, direct, hcm)
                            .map(|a| a.ip()),
                        local: ctx.info.downstream_local,
                        sni: ctx.info.requested_server_name.as_deref(),
                        peer: peer
                            .as_deref()
                            .map(|p| p as &(dyn filters::PeerIdentity + Sync)),
                        tls: ctx.info.downstream_tls,
                    }
                } else {
                    filters::Connection::default()
                };
                let callouts = ctx
                    .snapshot
                    .as_deref()
                    .map(|snapshot| callout::Callouts { snapshot });
                let filter_req = filters::Request {
                    view: &view,
                    route: matched.map(|r| &r.filters),
                    picked: picked.map(|(c, e)| (c.as_ref(), e.map(|e| &e.filters))),
                    server: Some(&server),
                    conn,
                    upstreams: callouts
                        .as_ref()
                        .map(|c| c as &dyn filters::callout::Upstreams),
                    body: body.as_ref(),
                };
                let outcome =
                    filters::run(&hcm.filters, next, &filter_req, &mut ctx.filters, stats).await;
                match outcome {
                    filters::Outcome::Done => break,
                    filters::Outcome::Reply(reply) => {
                        return self.filter_reply(session, ctx, reply).await;
                    }
                    filters::Outcome::Reroute { next: n } => {
                        next = n;
                        apply_request_header_ops(session, ctx)?;
                        host = downstream::authority(session, &listener);
                        let view = routing::request_view(session.req_header(), &host);
                        matched = router::route(&listener.routes, &view).map(|(_, r)| r);
                        picked = routing::pick_cluster(matched);
                    }
                }
            }
            apply_request_header_ops(session, ctx)?;
        }
        if let Some(r) = matched.filter(|r| !r.name.is_empty()) {
            ctx.info.route_name = Some(r.name.clone());
        }
        if let Some(d) = matched.and_then(|r| r.decorator.as_ref()) {
            ctx.decorator = Some(d.clone());
        }
        // The router: the route's action; a forward gets its host, mirrors, headers and timers.
        let Some(route) = matched else {
            self.hcm_stats.no_route.fetch_add(1, Relaxed);
            ctx.outcome(
                Some(crate::telemetry::ResponseFlag::NoRouteFound),
                observe::details::ROUTE_NOT_FOUND,
            );
            return self.local_reply(session, ctx, 404, None, &[]).await;
        };
        let entry = picked.and_then(|(_, e)| e);
        let fmt = routing::response_headers(session, ctx, hcm, route, entry);
        let fwd = match &route.action {
            Action::Direct { status, body } => {
                ctx.outcome(None, observe::details::DIRECT_RESPONSE);
                return self
                    .direct_response(session, ctx, status.as_u16(), body.clone())
                    .await;
            }
            Action::Redirect(r) => {
                ctx.outcome(None, observe::details::DIRECT_RESPONSE);
                return self.redirect(session, ctx, r, route.rewrite_len()).await;
            }
            Action::Forward(f) => f,
        };
        let Some((cluster, _)) = picked else {
            return Error::e_explain(ErrorType::InternalError, "forward route without a cluster");
        };
        if self
            .choose_host(session, ctx, &listener, fwd, cluster)
            .await?
        {
            return Ok(true);
        }
        routing::forward(session, ctx, &listener, route, fwd);
        mirror::choose_targets(session, ctx, fwd);
        // Envoy settles the downstream remote address (XFF's trusted hop, else the peer) before
        // it appends the peer to XFF: what the access log and istio.stats' source address read
        // is that one, not the hop the append moved in.
        ctx.info.downstream_remote = downstream::downstream_remote(
            &session.req_header().headers,
            ctx.info.downstream_direct_remote,
            hcm,
        );
        ctx.remote_settled = true;
        downstream::request_headers(session, hcm, expect_continue).await?;
        ctx.trace_begun = true;
        ctx.trace = trace::begin(
            session.req_header_mut(),
            hcm,
            &ctx.info,
            &self.state.tracer,
            route.decorator.as_deref(),
            &mut ctx.decorator_response,
        )?;
        timeouts::arm_timers(session, ctx, fwd, hcm)?;
        routing::request_headers(session, ctx, route, entry, &fmt)?;
        Ok(false)
    }

    pub(super) async fn upstream_connected(
        &self,
        _session: &mut Session,
        reused: bool,
        _peer: &HttpPeer,
        #[cfg(unix)] fd: std::os::unix::io::RawFd,
        #[cfg(windows)] _sock: std::os::windows::io::RawSocket,
        upstream_local: Option<SocketAddr>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        #[cfg(unix)]
        upstream::count_request(ctx, reused, fd);
        if !reused {
            // The connect took time: the request's start reads the clock anew.
            ctx.clock = None;
        }
        // `%UPSTREAM_LOCAL_ADDRESS%`: the attempt's connection's own address.
        ctx.info.upstream_local = upstream_local;
        Ok(())
    }

    pub(super) async fn prepare_upstream_request(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        upstream::hop_by_hop(session, upstream, ctx)?;
        routing::apply_rewrites(upstream, ctx)?;
        upstream::attempt_headers(upstream, ctx)?;
        self.mirror_head(session, upstream, ctx);
        istio::upstream_request(upstream, ctx, &self.state)?;
        self.upstream_request_sent(ctx);
        Ok(())
    }

    /// The upstream request is on its way: when, for timing and the access log.
    pub(super) fn upstream_request_sent(&self, ctx: &mut Ctx) {
        // One reading of the clock for both: `choose_peer`'s, moments ago, when no connect
        // came between.
        let sent = match ctx.clock.take() {
            Some(t) => t.saturating_duration_since(ctx.info.started),
            None => ctx.info.started.elapsed(),
        };
        ctx.upstream_start = Some(sent);
        observe::upstream_sent(&mut ctx.info, sent);
    }

    pub(super) async fn request_body(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.mirror_body(body, end_of_stream, ctx);
        if let Some(b) = body {
            observe::grpc_request_body(ctx, b);
        }
        if end_of_stream {
            observe::request_done(&mut ctx.info);
            if let Some(c) = conn_state(session) {
                c.body_received();
            }
        }
        Ok(())
    }

    pub(super) async fn upstream_head(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        observe::upstream_answered(&mut ctx.info);
        istio::upstream_response(resp, ctx);
        self.upstream_response(session, resp, ctx)
    }

    pub(super) async fn response_head(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        trace::response_headers(resp, ctx.decorator_response.as_ref())?;
        if self.chain.drain_close() {
            keepalive(session, ctx, None);
        } else if let Some(c) = conn_state(session) {
            let kept = h1_kept_alive(session, ctx);
            let admit = c.at_response();
            if kept && admit != conn::Admit::Keep {
                let idle = ctx
                    .listener
                    .as_ref()
                    .and_then(|l| l.def.hcm())
                    .and_then(|h| h.idle_timeout);
                set_keepalive(session, ctx, idle, admit);
            }
        }
        upstream::response_headers(session, resp, ctx)?;
        istio::response(resp, ctx, &self.state)?;
        self.compress_response(session, resp, ctx)
    }

    pub(super) async fn end_request(
        &self,
        session: &mut Session,
        e: Option<&Error>,
        ctx: &mut Ctx,
    ) {
        if let Some(c) = conn_state(session) {
            c.request_ended();
        }
        observe::finish(session, ctx, e);
        if ctx.traceable && !ctx.trace_begun {
            if let Some(chain) = ctx.listener.clone() {
                if let Some(hcm) = chain.def.hcm() {
                    let ip = ctx.info.downstream_direct_remote.map(|a| a.ip());
                    let req = session.req_header_mut();
                    let decorator = ctx.decorator.as_deref();
                    ctx.trace = trace::late(req, ip, hcm, &ctx.info, &self.state.tracer, decorator)
                        .ok()
                        .flatten();
                }
            }
        }
        if let Some(t) = ctx.trace.take() {
            trace::finish(*t, &ctx.info, &self.state.tracer);
        }
        istio::finish(session, ctx, &self.state);
        observe::access_log(session, ctx);
        let code = ctx.info.response_code;
        if ctx.counted_active {
            self.hcm_stats.finish(code);
        }
        if ctx.upgrade {
            self.hcm_stats.upgrades_active.fetch_sub(1, Relaxed);
        }
        ctx.filters.release(&self.hcm_stats.fault);
        if let Some(c) = &ctx.cluster {
            if ctx.retry_slot {
                c.stats.retry_active.fetch_sub(1, Relaxed);
            }
            if ctx.cx_slot {
                c.stats.cx_busy.fetch_sub(1, Relaxed);
                c.stats.cx_freed.notify_one();
            }
            c.active[ctx.host_index].fetch_sub(1, Relaxed);
            c.stats.rq_active.fetch_sub(1, Relaxed);
            if !ctx.code_recorded {
                c.stats.record_code(code);
            }
        }
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::default()
    }

    /// No pingora modules: its default is a response compression module at level 0, which
    /// does nothing (compression is the `compressor` filter's) but costs a module context and
    /// two calls per request. The own HTTP/1 loop relies on there being none: it writes most
    /// responses without pingora's module pass (`h1::write_tasks`).
    fn init_downstream_modules(&self, _modules: &mut pingora_core::modules::http::HttpModules) {}

    // `early_request_filter` and `proxy_upstream_filter` keep pingora's defaults, which the
    // own HTTP/1 loop (`h1::process_request`) leaves uncalled: one to override is to be
    // called there too.

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        self.route_request(session, ctx).await
    }

    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        self.choose_peer(session, ctx).await
    }

    async fn connected_to_upstream(
        &self,
        session: &mut Session,
        reused: bool,
        peer: &HttpPeer,
        #[cfg(unix)] fd: std::os::unix::io::RawFd,
        #[cfg(windows)] sock: std::os::windows::io::RawSocket,
        digest: Option<&pingora_core::protocols::Digest>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        #[cfg(unix)]
        let conn = fd;
        #[cfg(windows)]
        let conn = sock;
        let local = digest
            .and_then(|d| d.socket_digest.as_ref())
            .and_then(|s| s.local_addr())
            .and_then(|a| a.as_inet())
            .copied();
        self.upstream_connected(session, reused, peer, conn, local, ctx)
            .await
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.prepare_upstream_request(session, upstream, ctx).await
    }

    async fn request_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.request_body(session, body, end_of_stream, ctx).await
    }

    async fn upstream_response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // The own loop's upstream exchange checks the heads pingora's session reads for it
        // (`h1_upstream`); here pingora's session read it for pingora's loop.
        framing::check_head(resp)?;
        response_limits(ctx).check_parsed(resp)?;
        self.upstream_head(session, resp, ctx).await
    }

    fn upstream_response_trailer_filter(
        &self,
        _session: &mut Session,
        trailers: &mut http::HeaderMap,
        ctx: &mut Ctx,
    ) -> Result<()> {
        observe::upstream_trailers(&mut ctx.info, trailers);
        Ok(())
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        _client_reused: bool,
    ) -> Box<Error> {
        self.upstream_error(peer, session, e, ctx)
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<std::time::Duration>> {
        if ctx.discard_body {
            *body = None;
        }
        if let Some(b) = body {
            observe::grpc_response_body(ctx, b);
        }
        if let Some(cs) = ctx.filters.compress.as_mut() {
            if cs.encoder.is_some() && (body.is_some() || end_of_stream) {
                let input = body.take().unwrap_or_default();
                *body = cs.body(&input, end_of_stream);
            }
        }
        Ok(None)
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        self.response_head(session, resp, ctx).await
    }

    fn fail_to_connect(
        &self,
        session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        e: Box<Error>,
    ) -> Box<Error> {
        observe::transport_failure(&mut ctx.info, &e);
        self.connect_failed(session, ctx, e)
    }

    /// A client's own doing (it hung up, it sent garbage) is counted and logged at debug;
    /// the rest at a bounded rate (`log_limit`).
    fn suppress_error_log(&self, session: &Session, _ctx: &Ctx, e: &Error) -> bool {
        if *e.esource() == pingora_error::ErrorSource::Downstream
            && !conn_state(session).is_some_and(|c| c.body_timed_out())
        {
            self.hcm_stats.rq_rx_reset.fetch_add(1, Relaxed);
        }
        quiet(session, e)
    }

    fn suppress_proxy_warn_log(
        &self,
        session: &Session,
        _ctx: &Ctx,
        e: &Error,
        _context: pingora_proxy::ProxyWarnLogContext,
    ) -> bool {
        quiet(session, e)
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        self.fail_reply(session, e, ctx).await
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        self.end_request(session, e, ctx).await
    }
}
