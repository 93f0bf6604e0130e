//! The request path: a pingora `ProxyHttp` that routes on one snapshot per request.

pub mod client_cert;
mod hbone;
pub mod io;
pub mod listeners;
mod normalize;
pub mod proxy_protocol;
pub mod tcp;
pub mod tls;
mod upgrade;
mod upstream_tls;

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use http::header::HeaderName;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorSource, ErrorType, OrErr, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, Session};

use crate::admin::stats::HcmStats;
use crate::filters::{self, FilterState, LocalReply};
use crate::router::{self, RequestView};
use crate::snapshot::cluster::Cluster;
use crate::snapshot::headers::{FormatCtx, HeaderOps, HeaderPlan};
use crate::snapshot::retry::{Failure, RetryPolicy};
use crate::snapshot::route::{Action, Forward, Redirect, Target};
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

    /// Whether this response should close its connection because the chain is draining
    /// gradually: with Envoy's odds, the share of the drain time already gone.
    fn gradual_close(&self) -> bool {
        let draining = self.draining.load();
        let Some(since) = draining.as_deref() else {
            return false;
        };
        let gone = since.elapsed().as_secs_f64() / self.drain.time.as_secs_f64().max(1e-3);
        fastrand::f64() < gone
    }
}

/// A request on its way to mirror clusters: the chosen targets, then the request as sent
/// upstream (head, then body as it streams).
#[derive(Default)]
struct MirrorJob {
    targets: Vec<(Arc<str>, String)>,
    head: Option<(http::Method, String, http::HeaderMap)>,
    body: Vec<u8>,
    /// Gave up on a body larger than MIRROR_BODY_LIMIT.
    dropped: bool,
    sent: bool,
}

/// Envoy streams large mirrored bodies; Portico copies bodies up to this size and skips the
/// mirror for larger ones.
const MIRROR_BODY_LIMIT: usize = 1 << 20;

/// Per-request state: the snapshot loaded once, and what routing decided.
#[derive(Default)]
pub struct Ctx {
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
    timeout_kind: TimeoutKind,
    /// This request is the last its upstream connection may carry
    /// (`max_requests_per_connection`).
    close_upstream: bool,
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
    mirror: Option<Box<MirrorJob>>,
    /// What the HTTP filters left for the later phases (headers, active faults).
    filters: FilterState,
    attempt_count_to_upstream: bool,
    attempt_count_to_client: bool,
    upstream_start: Option<Instant>,
    /// `set-cookie` values for cookies a hash policy generated, added to the upstream response.
    set_cookies: Vec<String>,
    /// The upstream's response code was counted when its headers arrived.
    code_recorded: bool,
    counted_active: bool,
    /// Response header mutations of the chosen route (and weighted-cluster entry), applied to
    /// the upstream response or to the route's own local replies.
    resp_headers: Option<RespHeaders>,
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
}

/// The timeouts that can end a wait for the upstream, each answered as Envoy answers it.
#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
enum TimeoutKind {
    #[default]
    Route,
    PerTry,
    /// The stream's maximum duration: 504 `downstream duration timeout`.
    Stream,
    /// The stream idle timeout: 504 `stream timeout`.
    Idle,
}

static X_UPSTREAM_RQ_TIMEOUT: HeaderName =
    HeaderName::from_static("x-envoy-upstream-rq-timeout-ms");
static X_UPSTREAM_PER_TRY_TIMEOUT: HeaderName =
    HeaderName::from_static("x-envoy-upstream-rq-per-try-timeout-ms");
static X_ENVOY_INTERNAL: HeaderName = HeaderName::from_static("x-envoy-internal");
static GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// A `grpc-timeout` value (gRPC's HTTP/2 spec: up to 8 digits and a unit), as Envoy reads it.
fn parse_grpc_timeout(v: &http::HeaderValue) -> Option<std::time::Duration> {
    use std::time::Duration;
    let v = v.as_bytes();
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b"H" => Duration::from_secs(n * 3600),
        b"M" => Duration::from_secs(n * 60),
        b"S" => Duration::from_secs(n),
        b"m" => Duration::from_millis(n),
        // Envoy works in whole milliseconds and rounds smaller units up.
        b"u" => Duration::from_millis(n.div_ceil(1000)),
        b"n" => Duration::from_millis(n.div_ceil(1_000_000)),
        _ => return None,
    })
}

/// Envoy's `grpc-timeout` form: milliseconds, or a larger unit when it would not fit 8 digits.
fn grpc_timeout_value(d: std::time::Duration) -> String {
    const MAX: u128 = 99_999_999;
    let mut t = d.as_millis();
    for (unit, next) in [('m', 1000), ('S', 60), ('M', 60)] {
        if t <= MAX {
            return format!("{t}{unit}");
        }
        t /= next;
    }
    format!("{}H", t.min(MAX))
}

/// Envoy's internal-request rule: with `use_remote_address` the request must carry no XFF and
/// come from an internal peer; without it XFF must hold exactly one address, an internal one.
/// Internal ranges come only from `internal_address_config` (Envoy 1.40 has none by default).
/// The connection's original destination when a listener filter restored it (Envoy's
/// `localAddressRestored`: the original_dst or proxy_protocol listener filter); ORIGINAL_DST
/// clusters fall back to it without a host header. Portico runs neither filter, so the
/// address a connection was accepted on never counts, as in Envoy without them.
fn restored_local(_session: &Session) -> Option<SocketAddr> {
    None
}

fn is_internal_request(
    headers: &http::HeaderMap,
    peer: Option<std::net::IpAddr>,
    hcm: &crate::snapshot::listener::Hcm,
) -> bool {
    if hcm.internal_ranges.is_empty() {
        return false;
    }
    let remote = if hcm.use_remote_address {
        if headers.contains_key(&X_FORWARDED_FOR) {
            return false;
        }
        peer
    } else {
        let mut entries = headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','));
        match (entries.next(), entries.next()) {
            (Some(one), None) => one.trim().parse().ok(),
            _ => None,
        }
    };
    remote.is_some_and(|ip| hcm.internal_ranges.iter().any(|c| c.contains(ip)))
}

/// A non-negative integer header (Envoy's `SimpleAtoi`), in milliseconds.
fn header_ms(req: &RequestHeader, name: &HeaderName) -> Option<Option<std::time::Duration>> {
    let v = req.headers.get(name)?;
    Some(
        v.to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(std::time::Duration::from_millis),
    )
}

/// Envoy's timeouts for a routed request: the router's (`finalTimeout`: route timeout or the
/// gRPC header under `max_grpc_timeout`, `x-envoy-upstream-rq-timeout-ms`, per-try timeout)
/// and the connection manager's stream timers (`max_stream_duration`, `grpc-timeout` under
/// `grpc_timeout_header_max`, stream idle timeout). Control headers are consumed here; they
/// are only still present on internal requests.
fn set_timeouts(
    ctx: &mut Ctx,
    req: &mut RequestHeader,
    fwd: &Forward,
    hcm: &crate::snapshot::listener::Hcm,
) -> Result<()> {
    use std::time::Duration;
    let now = Instant::now();
    let t = &fwd.timeouts;
    let grpc_header = if ctx.grpc_request {
        req.headers.get(&GRPC_TIMEOUT).and_then(parse_grpc_timeout)
    } else {
        None
    };
    let legacy_grpc = t.max_stream.is_none() && ctx.grpc_request && t.max_grpc.is_some();
    // With max_stream_duration on the route, Envoy's "new timeouts" leave no route timeout.
    let mut global = match (&t.max_stream, t.max_grpc) {
        (Some(_), _) => None,
        (None, Some(max)) if ctx.grpc_request => {
            let mut g = grpc_header.unwrap_or(Duration::ZERO);
            if let Some(off) = t.grpc_offset.filter(|off| *off < g) {
                g -= off;
            }
            if !max.is_zero() && (g.is_zero() || g > max) {
                g = max;
            }
            Some(g)
        }
        _ => fwd.timeout,
    }
    .filter(|d| !d.is_zero());
    if let Some(v) = header_ms(req, &X_UPSTREAM_RQ_TIMEOUT) {
        if let Some(ms) = v {
            global = (!ms.is_zero()).then_some(ms);
        }
        req.remove_header(&X_UPSTREAM_RQ_TIMEOUT);
    }
    let mut per_try = ctx.retry.as_ref().and_then(|p| p.per_try_timeout);
    if let Some(v) = header_ms(req, &X_UPSTREAM_PER_TRY_TIMEOUT) {
        if let Some(ms) = v {
            per_try = Some(ms);
        }
        req.remove_header(&X_UPSTREAM_PER_TRY_TIMEOUT);
    }
    // A per-try timeout as long as the whole one means nothing.
    per_try = per_try.filter(|p| !p.is_zero() && global.is_none_or(|g| *p < g));
    ctx.timeout = global;
    ctx.deadline = global.map(|g| now + g);
    ctx.per_try = per_try;
    match per_try.or(global) {
        Some(expected) => {
            req.insert_header(X_EXPECTED_TIMEOUT.clone(), expected.as_millis().to_string())?;
            if legacy_grpc {
                req.insert_header(GRPC_TIMEOUT.clone(), grpc_timeout_value(expected))?;
            }
        }
        None => {
            req.remove_header(&X_EXPECTED_TIMEOUT);
        }
    }
    let header_max = t.max_stream.as_ref().and_then(|m| m.grpc_header_max);
    let stream = match (grpc_header, header_max) {
        (Some(mut d), Some(max)) => {
            if !max.is_zero() && d > max {
                d = max;
            }
            if let Some(off) = t.max_stream.as_ref().and_then(|m| m.grpc_header_offset) {
                if !d.is_zero() {
                    d = d.saturating_sub(off);
                }
            }
            Some(d)
        }
        _ => match t.max_stream.as_ref().and_then(|m| m.duration) {
            Some(route) => route,
            None => hcm.max_stream_duration,
        },
    };
    if let (Some(d), true) = (stream, t.max_stream.is_some() && ctx.grpc_request) {
        req.insert_header(GRPC_TIMEOUT.clone(), grpc_timeout_value(d))?;
    }
    ctx.stream_deadline = stream.map(|d| now + d);
    ctx.idle = match t.idle {
        Some(route) => route,
        None => hcm.stream_idle_timeout,
    };
    Ok(())
}

thread_local! {
    /// Requests carried so far per upstream connection of this worker, by socket. Each worker
    /// has its own connection pool, so a connection is only ever reused on the thread that
    /// opened it; a new connection on a recycled descriptor starts again at one.
    static CONNECTION_USES: std::cell::RefCell<std::collections::HashMap<i32, u32>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Counts one more request on the connection `fd`; true when it is the last one allowed.
fn count_connection_use(fd: i32, reused: bool, max: u32) -> bool {
    CONNECTION_USES.with(|uses| {
        let mut uses = uses.borrow_mut();
        let n = if reused {
            uses.get(&fd).copied().unwrap_or(0) + 1
        } else {
            1
        };
        if n >= max {
            uses.remove(&fd);
            true
        } else {
            uses.insert(fd, n);
            false
        }
    })
}

/// Envoy leaves unset keepalive fields to the kernel; pingora needs all three, so unset ones
/// take Linux's defaults (7200 s idle, 75 s between probes, 9 probes).
fn tcp_keepalive(
    k: crate::snapshot::cluster::TcpKeepalive,
) -> pingora_core::protocols::TcpKeepalive {
    use std::time::Duration;
    pingora_core::protocols::TcpKeepalive {
        idle: Duration::from_secs(u64::from(k.time.unwrap_or(7200))),
        interval: Duration::from_secs(u64::from(k.interval.unwrap_or(75))),
        count: k.probes.unwrap_or(9) as usize,
        #[cfg(target_os = "linux")]
        user_timeout: Duration::ZERO,
    }
}

struct RespHeaders {
    entry: Option<Arc<HeaderOps>>,
    plan: Arc<HeaderPlan>,
    /// What the formatters read besides the request.
    fmt: FormatCtx,
}

impl RespHeaders {
    fn apply(&self, resp: &mut ResponseHeader, req: &RequestHeader) {
        // Envoy: the weighted-cluster entry first, then the route chain.
        for ops in self.entry.iter().chain(self.plan.response.iter()) {
            ops.apply(resp, Some(req), &self.fmt);
        }
    }
}

/// grpc-message encoding (gRPC's HTTP/2 spec, as Envoy's `PercentEncoding::encode`): bytes
/// outside printable ASCII, and `%`, become `%XX`.
fn grpc_percent_encode(msg: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(msg.len());
    for &b in msg {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Envoy's downstream remote address: the peer with `use_remote_address` (or the XFF entry
/// `xff_num_trusted_hops` back), otherwise the last XFF address, else the peer. Addresses
/// taken from XFF have port 0, as in Envoy.
fn downstream_remote(
    headers: &http::HeaderMap,
    peer: Option<SocketAddr>,
    hcm: &crate::snapshot::listener::Hcm,
) -> Option<SocketAddr> {
    let skip = if hcm.use_remote_address {
        match hcm.xff_num_trusted_hops.checked_sub(1) {
            Some(n) => n as usize,
            None => return peer,
        }
    } else {
        hcm.xff_num_trusted_hops as usize
    };
    // Several XFF lines count as one comma-joined list, as Envoy's header map keeps them.
    let from_xff = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .rev()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.rsplit(','))
        .nth(skip)
        .and_then(|hop| hop.trim().parse::<std::net::IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 0));
    from_xff.or(peer)
}

static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static X_UPSTREAM_TIME: HeaderName = HeaderName::from_static("x-envoy-upstream-service-time");
static X_EXPECTED_TIMEOUT: HeaderName = HeaderName::from_static("x-envoy-expected-rq-timeout-ms");
static X_ORIGINAL_PATH: HeaderName = HeaderName::from_static("x-envoy-original-path");
static X_ATTEMPT_COUNT: HeaderName = HeaderName::from_static("x-envoy-attempt-count");
static X_OVERLOADED: HeaderName = HeaderName::from_static("x-envoy-overloaded");
/// A circuit breaker overflowed: Envoy's `reset reason: overflow`.
const OVERFLOW: ErrorType = ErrorType::Custom("upstream overflow");

/// Control headers Envoy removes from requests that are not internal.
const UNTRUSTED_ENVOY_HEADERS: &[&str] = &[
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-internal",
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-max-retries",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-force-trace",
    "x-envoy-ip-tags",
    "x-envoy-upstream-alt-stat-name",
];

/// Headers Envoy also removes from edge requests (with `use_remote_address`).
const EDGE_STRIPPED_HEADERS: &[&str] = &[
    "x-envoy-decorator-operation",
    "x-envoy-original-path",
    "x-envoy-downstream-service-cluster",
    "x-envoy-downstream-service-node",
];

/// Envoy's default limits: 60 KiB of request headers, 100 headers.
const MAX_REQUEST_HEADERS_BYTES: usize = 60 * 1024;
const MAX_REQUEST_HEADERS: usize = 100;

/// Requests Envoy's codec refuses before routing: (status, body, close the connection).
fn reject(session: &Session) -> Option<(u16, &'static str, bool)> {
    let req = session.req_header();
    let h1 = matches!(
        session.as_downstream(),
        pingora_core::protocols::http::ServerSession::H1(_)
    );
    if h1 && req.version == http::Version::HTTP_10 {
        return Some((426, "Upgrade Required", true));
    }
    if has_fragment(session) {
        return Some((400, "", true));
    }
    let size: usize = req.raw_path().len()
        + req
            .headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len())
            .sum::<usize>();
    if size > MAX_REQUEST_HEADERS_BYTES || req.headers.len() > MAX_REQUEST_HEADERS {
        return Some((431, "Request Header Fields Too Large", true));
    }
    if req.method.as_str().bytes().any(|b| b.is_ascii_lowercase()) {
        return Some((400, "Bad Request", true));
    }
    if h1 && !req.headers.contains_key(http::header::HOST) && req.uri.authority().is_none() {
        return Some((400, "", true));
    }
    let authority = raw_authority(req);
    if authority.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Some((400, "Bad Request", true));
    }
    let raw = req.raw_path();
    // Envoy's HTTP/1 codec refuses a request target holding raw non-ASCII bytes (UTF-8 not
    // percent-encoded), which pingora's parser lets through; control bytes it refuses itself.
    if h1 && raw.iter().any(|b| *b >= 0x80) {
        return Some((400, "Bad Request", true));
    }
    if req.method != http::Method::OPTIONS
        && req.method != http::Method::CONNECT
        && raw.first() != Some(&b'/')
    {
        return Some((400, "Bad Request", true));
    }
    if let Some(te) = req.headers.get(http::header::TRANSFER_ENCODING) {
        if !te.as_bytes().eq_ignore_ascii_case(b"chunked") {
            return Some((501, "Not Implemented", true));
        }
        // The parser drops Content-Length next to chunked; the raw head still shows both.
        if req.headers.contains_key(http::header::CONTENT_LENGTH)
            || raw_head_has(session, b"content-length:")
        {
            return Some((400, "Bad Request", true));
        }
    }
    // Upgrades are decided after routing (`upgrade::permitted`): the route has a say.
    None
}

static X_ENVOY_EXTERNAL_ADDRESS: HeaderName = HeaderName::from_static("x-envoy-external-address");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// The request's authority, lowercased, with the port stripped as the HCM asks.
/// Replaces the request's path and query, keeping its scheme and authority (HTTP/2).
fn set_path(req: &mut RequestHeader, path: &str) -> std::result::Result<(), http::Error> {
    let mut parts = req.uri.clone().into_parts();
    parts.path_and_query = Some(http::uri::PathAndQuery::try_from(path)?);
    req.set_uri(http::Uri::from_parts(parts)?);
    Ok(())
}

fn authority<'a>(session: &'a Session, listener: &ActiveChain) -> std::borrow::Cow<'a, str> {
    let req = session.req_header();
    let raw = raw_authority(req);
    let host = match split_port(raw) {
        (host, Some(_))
            if listener.routes.ignore_port
                || hcm_strips_port(raw, listener, local_port(session)) =>
        {
            host
        }
        _ => raw,
    };
    // Most clients already send a lowercase host: borrow it then.
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        std::borrow::Cow::Owned(host.to_ascii_lowercase())
    } else {
        std::borrow::Cow::Borrowed(host)
    }
}

/// The port the connection came in on (a PROXY header's destination when one was read), as
/// Envoy's `strip_matching_host_port` compares it: a listener with additional addresses may
/// listen on several ports.
fn local_port(session: &Session) -> Option<u16> {
    session
        .server_addr()
        .and_then(|a| a.as_inet())
        .map(|a| a.port())
}

/// Whether the HCM's `strip_any_host_port` / `strip_matching_host_port` removes the port of
/// this authority: that changes the Host sent upstream too, unlike `ignore_port_in_host_matching`.
fn hcm_strips_port(raw: &str, listener: &ActiveChain, local_port: Option<u16>) -> bool {
    let Some(hcm) = listener.def.hcm() else {
        return false;
    };
    match split_port(raw).1 {
        Some(_) if hcm.strip_any_host_port => true,
        Some(port) => {
            hcm.strip_matching_host_port
                && port.parse::<u16>().ok() == Some(local_port.unwrap_or(listener.def.addr.port()))
        }
        None => false,
    }
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) to remove, including those named in `Connection`.
/// Returns the names to drop and whether `te: trailers` must be set in place of `te`.
fn hop_by_hop(headers: &http::HeaderMap) -> (Vec<HeaderName>, bool) {
    let mut names: Vec<HeaderName> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for h in [
        &http::header::CONNECTION,
        &KEEP_ALIVE,
        &PROXY_CONNECTION,
        &http::header::UPGRADE,
    ] {
        if headers.contains_key(h) {
            names.push(h.clone());
        }
    }
    let mut te_trailers = false;
    if let Some(te) = headers.get(http::header::TE) {
        // Only "trailers" may travel on.
        te_trailers = te
            .to_str()
            .is_ok_and(|v| v.split(',').any(|t| t.trim() == "trailers"));
        names.push(http::header::TE);
    }
    (names, te_trailers)
}

/// `uri` with a new path and query. The scheme and authority stay: an HTTP/2 request carries
/// its authority only there, and an HTTP/2 upstream needs it.
fn with_path(uri: &http::Uri, path_and_query: &str) -> std::result::Result<http::Uri, http::Error> {
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(path_and_query.parse()?);
    Ok(http::Uri::from_parts(parts)?)
}

fn strip_request(req: &mut RequestHeader) -> Result<()> {
    let (names, te) = hop_by_hop(&req.headers);
    for n in &names {
        req.remove_header(n);
    }
    if te {
        req.insert_header(http::header::TE, "trailers")?;
    }
    Ok(())
}

/// Envoy removes only the connection-level headers from responses; headers a `Connection`
/// header names, and `te`, pass.
fn strip_response(resp: &mut ResponseHeader) {
    for h in [
        &http::header::CONNECTION,
        &KEEP_ALIVE,
        &PROXY_CONNECTION,
        &http::header::UPGRADE,
    ] {
        resp.remove_header(h);
    }
}

impl Gateway {
    /// Whether the request may be tried again under `policy`, counting Envoy's retry stats:
    /// retries left, the cluster's concurrent-retry circuit breaker, a body that can be
    /// resent (pingora buffers it up to its retry buffer size), and time left.
    fn may_retry(&self, session: &Session, ctx: &mut Ctx, policy: &RetryPolicy) -> bool {
        let Some(cluster) = ctx.cluster.clone() else {
            return false;
        };
        if ctx.attempts > policy.num_retries {
            cluster.stats.rq_retry_limit_exceeded.fetch_add(1, Relaxed);
            return false;
        }
        if session.as_ref().retry_buffer_truncated() {
            return false;
        }
        if ctx.deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        if !ctx.retry_slot {
            let active = cluster.stats.retry_active.fetch_add(1, Relaxed);
            let max = match &cluster.def.retry_budget {
                Some(b) => b.max(
                    cluster.stats.rq_active.load(Relaxed)
                        + cluster.stats.rq_pending_active.load(Relaxed),
                ),
                None => u64::from(cluster.def.max_retries),
            };
            if active >= max {
                cluster.stats.retry_active.fetch_sub(1, Relaxed);
                cluster.stats.rq_retry_overflow.fetch_add(1, Relaxed);
                return false;
            }
            ctx.retry_slot = true;
        }
        cluster.stats.rq_retry.fetch_add(1, Relaxed);
        true
    }

    /// The cluster's circuit breakers, as Envoy's connection pool applies them: over
    /// `max_requests` active requests, or with every `max_connections` slot busy and
    /// `max_pending_requests` already waiting, the request overflows (503,
    /// `x-envoy-overloaded`); otherwise it waits for a slot, within the route timeout.
    async fn take_connection_slot(&self, ctx: &mut Ctx) -> Result<()> {
        let Some(cluster) = ctx.cluster.clone() else {
            return Ok(());
        };
        let (def, s) = (&cluster.def, &cluster.stats);
        if s.rq_active.load(Relaxed) > u64::from(def.max_requests) {
            s.rq_active_overflow.fetch_add(1, Relaxed);
            // It never becomes an upstream request: Envoy does not count it in rq_total.
            s.rq_total.fetch_sub(1, Relaxed);
            return Error::e_explain(OVERFLOW, "max_requests circuit breaker open");
        }
        // HTTP/2 multiplexes requests: only max_requests limits them.
        if ctx.upstream_h2 {
            return Ok(());
        }
        let max = u64::from(def.max_connections);
        let mut waiting = false;
        let taken = loop {
            let busy = s.cx_busy.load(Relaxed);
            if busy < max {
                if s.cx_busy
                    .compare_exchange(busy, busy + 1, Relaxed, Relaxed)
                    .is_ok()
                {
                    break Ok(());
                }
                continue;
            }
            if !waiting {
                s.cx_overflow.fetch_add(1, Relaxed);
                let pending = s.rq_pending_active.fetch_add(1, Relaxed);
                if pending >= u64::from(def.max_pending_requests) {
                    s.rq_pending_active.fetch_sub(1, Relaxed);
                    s.rq_pending_overflow.fetch_add(1, Relaxed);
                    s.rq_total.fetch_sub(1, Relaxed);
                    return Error::e_explain(OVERFLOW, "max_pending_requests circuit breaker open");
                }
                waiting = true;
            }
            let freed = s.cx_freed.notified();
            tokio::pin!(freed);
            // Registered before the re-check, so a slot freed in between is not missed.
            freed.as_mut().enable();
            if s.cx_busy.load(Relaxed) < max {
                continue;
            }
            match ctx.deadline {
                Some(d) => {
                    if tokio::time::timeout_at(d.into(), freed).await.is_err() {
                        break Error::e_explain(
                            ErrorType::ReadTimedout,
                            "route timeout while waiting for a connection slot",
                        );
                    }
                }
                None => freed.await,
            }
        };
        if waiting {
            s.rq_pending_active.fetch_sub(1, Relaxed);
        }
        ctx.cx_slot = taken.is_ok();
        taken
    }

    /// Fire and forget: each mirror target gets its copy on a task of its own, so a slow or
    /// failing mirror never delays or fails the request itself. Counted in the mirror
    /// cluster's stats, as Envoy's shadow requests are.
    fn send_mirrors(&self, ctx: &mut Ctx) {
        let Some(job) = ctx.mirror.as_mut().filter(|j| !j.sent) else {
            return;
        };
        job.sent = true;
        let Some((method, pq, headers)) = job.head.take() else {
            return;
        };
        let body = Bytes::from(std::mem::take(&mut job.body));
        let Some(snap) = ctx.snapshot.clone() else {
            return;
        };
        let timeout = ctx.timeout;
        for (name, host) in std::mem::take(&mut job.targets) {
            let Some(cluster) = snap.clusters.get(name.as_ref()).cloned() else {
                continue;
            };
            // A shadow to an ORIGINAL_DST cluster goes where its copy of the headers says.
            let picked = match &cluster.def.original_dst {
                Some(od) => cluster.pick_original_dst(od, &headers, None),
                None => cluster.pick(),
            };
            let Some((idx, addr)) = picked else {
                continue;
            };
            if cluster
                .endpoints
                .hosts
                .get(idx)
                .is_some_and(|h| h.internal.is_some())
            {
                // Envoy would shadow through the internal listener's tunnel; Portico's
                // mirrors connect directly, so an internal endpoint gets no copy.
                tracing::debug!(cluster = %cluster.def.name, "mirror to an internal listener's endpoint is not supported; skipped");
                continue;
            }
            let mut headers = headers.clone();
            if let Ok(v) = http::HeaderValue::from_str(&host) {
                headers.insert(http::header::HOST, v);
            }
            let (method, pq, body) = (method.clone(), pq.clone(), body.clone());
            cluster.active[idx].fetch_add(1, Relaxed);
            cluster.stats.rq_active.fetch_add(1, Relaxed);
            cluster.stats.start();
            tokio::spawn(async move {
                let sent = mirror_request(addr, method, &pq, headers, body);
                let outcome = match timeout {
                    Some(t) => tokio::time::timeout(t, sent).await.ok(),
                    None => Some(sent.await),
                };
                match outcome {
                    Some(Ok(status)) => cluster.stats.record_code(status),
                    Some(Err(e)) => {
                        tracing::debug!(cluster = %cluster.def.name, "mirror request failed: {e}");
                        cluster.stats.record_code(503);
                    }
                    None => {
                        cluster.stats.rq_timeout.fetch_add(1, Relaxed);
                        cluster.stats.record_code(504);
                    }
                }
                cluster.active[idx].fetch_sub(1, Relaxed);
                cluster.stats.rq_active.fetch_sub(1, Relaxed);
            });
        }
    }

    /// Before a retry: Envoy's back-off, then a host of the same cluster, avoiding the hosts
    /// already tried when the policy has the previous_hosts predicate.
    async fn next_attempt(&self, ctx: &mut Ctx) -> Result<()> {
        let (Some(policy), Some(cluster)) = (ctx.retry.clone(), ctx.cluster.clone()) else {
            return Ok(());
        };
        let wait = policy.backoff(ctx.attempts - 1, fastrand::u64(..));
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        if cluster.def.original_dst.is_some() {
            // The request still names the same host: Envoy's retry asks the original-dst
            // balancer again and gets it back, whatever the retry host predicates say.
            cluster.stats.start();
            return Ok(());
        }
        ctx.tried.push(ctx.host_index);
        // A hashing cluster keeps the request's hash (a new random one without it) and, as
        // Envoy, walks the ring or flips the table hash for each host the predicate refuses.
        let hash = cluster
            .hashes()
            .then(|| ctx.request_hash.unwrap_or_else(|| fastrand::u64(..)));
        let choose = |attempt: u32| match hash {
            Some(h) => cluster.pick_hashed_attempt(Some(h), attempt),
            None => cluster.pick(),
        };
        let mut pick = choose(0);
        if policy.previous_hosts {
            for attempt in 1..=policy.host_selection_attempts {
                match pick {
                    Some((i, _)) if ctx.tried.contains(&i) => pick = choose(attempt),
                    _ => break,
                }
            }
        }
        let Some((idx, addr)) = pick else {
            return Error::e_explain(
                ErrorType::ConnectNoRoute,
                "no healthy upstream for the retry",
            );
        };
        cluster.active[ctx.host_index].fetch_sub(1, Relaxed);
        cluster.active[idx].fetch_add(1, Relaxed);
        ctx.host_index = idx;
        ctx.peer = Some(addr);
        // Envoy counts every attempt as an upstream request.
        cluster.stats.start();
        Ok(())
    }

    /// An HTTP filter's local reply (a fault abort is `fault filter abort` as text, or for a
    /// gRPC request a trailers-only gRPC response, as Envoy's `sendLocalReply` makes it).
    async fn filter_reply(&self, session: &mut Session, ctx: &Ctx, r: LocalReply) -> Result<bool> {
        tracing::trace!(
            details = r.details,
            status = r.status,
            "local reply from a filter"
        );
        self.local_reply_grpc(session, ctx, r.status, r.body, &r.headers, r.grpc_status)
            .await
    }

    async fn local_reply(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        status: u16,
        body: Option<Bytes>,
        extra: &[(HeaderName, String)],
    ) -> Result<bool> {
        self.local_reply_grpc(session, ctx, status, body, extra, None)
            .await
    }

    /// A gRPC request's local reply, as Envoy's `sendLocalReply` makes it: HTTP 200 with
    /// headers only (trailers-only), grpc-status (given, or mapped from the HTTP status) and
    /// the body as grpc-message.
    async fn grpc_local_reply(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        grpc_status: u32,
        body: Option<Bytes>,
        extra: &[(HeaderName, String)],
    ) -> Result<bool> {
        let mut resp = ResponseHeader::build(200, Some(6))?;
        for (k, v) in extra {
            resp.insert_header(k.clone(), v.as_str())?;
        }
        resp.insert_header(http::header::CONTENT_TYPE, "application/grpc")?;
        resp.insert_header("grpc-status", grpc_status.to_string())?;
        if let Some(b) = body.filter(|b| !b.is_empty()) {
            resp.insert_header("grpc-message", grpc_percent_encode(&b))?;
        }
        if let Some(rh) = &ctx.resp_headers {
            rh.apply(&mut resp, session.req_header());
        }
        let h1 = matches!(
            session.as_downstream(),
            pingora_core::protocols::http::ServerSession::H1(_)
        );
        if h1 {
            resp.insert_header(http::header::CONTENT_LENGTH, "0")?;
        }
        if let Some(h) = ctx.listener.as_ref().and_then(|l| l.def.hcm()) {
            resp.insert_header(http::header::SERVER, h.server_name.as_str())?;
        }
        // Trailers-only means END_STREAM on the HEADERS frame, as Envoy sends it; pingora's
        // session wrapper would drop the flag and end the stream with an empty DATA frame.
        if let pingora_core::protocols::http::ServerSession::H2(h2) = session.as_downstream_mut() {
            h2.write_response_header(Box::new(resp), true)?;
        } else {
            session.write_response_header(Box::new(resp), true).await?;
        }
        Ok(true)
    }

    /// A local reply; `grpc_status` is the fault filter's for gRPC aborts.
    async fn local_reply_grpc(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        status: u16,
        body: Option<Bytes>,
        extra: &[(HeaderName, String)],
        grpc_status: Option<u32>,
    ) -> Result<bool> {
        if ctx.grpc_request {
            let grpc_status =
                grpc_status.unwrap_or_else(|| filters::fault::http_to_grpc_status(status));
            return self
                .grpc_local_reply(session, ctx, grpc_status, body, extra)
                .await;
        }
        let mut resp = ResponseHeader::build(status, Some(4))?;
        let len = body.as_ref().map_or(0, |b| b.len());
        // 1xx and 204 responses never carry a body or its length (RFC 9110 §8.6).
        let no_body_status = status < 200 || status == 204;
        let body = if no_body_status { None } else { body };
        let head_only = session.req_header().method == http::Method::HEAD;
        // Envoy answers HEAD for an empty local reply without a length (chunked framing).
        let h2 = !matches!(
            session.as_downstream(),
            pingora_core::protocols::http::ServerSession::H1(_)
        );
        // Envoy sends an empty local reply without a length over HTTP/2, and to HEAD.
        let omit_length = no_body_status || (len == 0 && (head_only || h2));
        if !omit_length {
            resp.insert_header(http::header::CONTENT_LENGTH, len.to_string())?;
        }
        if len > 0 {
            resp.insert_header(http::header::CONTENT_TYPE, "text/plain")?;
        }
        for (k, v) in extra {
            resp.insert_header(k.clone(), v.as_str())?;
        }
        // The route's response headers reach its own local replies (direct responses,
        // redirects, upstream failures), as Envoy's router finalizes them.
        if let Some(rh) = &ctx.resp_headers {
            rh.apply(&mut resp, session.req_header());
        }
        if let Some(h) = ctx.listener.as_ref().and_then(|l| l.def.hcm()) {
            resp.insert_header(http::header::SERVER, h.server_name.as_str())?;
        }
        filter_response_headers(&mut resp, ctx)?;
        session
            .write_response_header(Box::new(resp), body.is_none() || head_only)
            .await?;
        if let Some(b) = body {
            if !head_only {
                session.write_response_body(Some(b), true).await?;
            }
        }
        Ok(true)
    }

    /// Whether the request's virtual host sends plain-text requests to https (`require_tls`),
    /// by `x-forwarded-proto` as Envoy judges it.
    fn needs_tls(
        &self,
        session: &Session,
        listener: &ActiveChain,
        hcm: &crate::snapshot::listener::Hcm,
    ) -> bool {
        use crate::snapshot::route::RequireTls;
        let req = session.req_header();
        let Some(vh) = listener.routes.vhost(&authority(session, listener)) else {
            return false;
        };
        let https = req
            .headers
            .get(&X_FORWARDED_PROTO)
            .is_some_and(|v| v.as_bytes() == b"https");
        match vh.require_tls {
            RequireTls::None => false,
            RequireTls::All => !https,
            RequireTls::ExternalOnly => {
                let ip = session
                    .client_addr()
                    .and_then(|a| a.as_inet())
                    .map(|a| a.ip());
                !https && !is_internal_request(&req.headers, ip, hcm)
            }
        }
    }

    async fn redirect(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        r: &Redirect,
        rewrite_len: Option<usize>,
    ) -> Result<bool> {
        let req = session.req_header();
        let orig_scheme = req.uri.scheme_str().unwrap_or("http");
        let scheme = r.scheme.as_deref().unwrap_or(orig_scheme);
        let raw = raw_authority(req);
        let (orig_host, orig_port) = split_port(raw);
        // host_redirect replaces host and port; otherwise the request's own (case kept).
        let (host, mut port) = match &r.host {
            Some(h) => {
                let (h, p) = split_port(h);
                (h.to_string(), p.map(str::to_string))
            }
            None => (orig_host.to_string(), orig_port.map(str::to_string)),
        };
        if let Some(p) = r.port {
            port = Some(p.to_string());
        } else if r.host.is_none() && scheme != orig_scheme {
            // Switching scheme drops a port that is the default of the new scheme's peer.
            let default_for_other = matches!(
                (scheme, port.as_deref()),
                ("https", Some("80")) | ("http", Some("443"))
            );
            if default_for_other {
                port = None;
            }
        }
        let full = req.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        let (path, query) = match full.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (full, None),
        };
        let mut location = format!("{scheme}://{host}");
        if let Some(p) = port {
            location.push(':');
            location.push_str(&p);
        }
        match (&r.path, &r.prefix_rewrite, rewrite_len) {
            (Some(p), _, _) => location.push_str(p),
            _ if r.regex_rewrite.is_some() => {
                if let Some(rr) = &r.regex_rewrite {
                    location.push_str(&rr.apply(path));
                }
            }
            (None, Some(pre), Some(len)) => {
                location.push_str(pre);
                location.push_str(path.get(len..).unwrap_or(""));
            }
            _ => location.push_str(path),
        }
        // A path_redirect with its own query replaces the request's query.
        let own_query = r.path.as_ref().is_some_and(|p| p.contains('?'));
        if let (false, false, Some(q)) = (r.strip_query, own_query, query) {
            location.push('?');
            location.push_str(q);
        }
        self.local_reply(
            session,
            ctx,
            r.status.as_u16(),
            None,
            &[(http::header::LOCATION, location)],
        )
        .await
    }
}

/// The HTTP filters' response side (CORS, `x-ratelimit-*`), on upstream responses and local
/// replies alike.
fn filter_response_headers(resp: &mut ResponseHeader, ctx: &Ctx) -> Result<()> {
    let mut out = Ok(());
    ctx.filters.response_headers(|k, v| {
        if out.is_ok() {
            out = resp.insert_header(k, v).map(|_| ());
        }
    });
    out
}

/// One mirrored request over a fresh HTTP/1.1 connection; its answer is read and dropped.
async fn mirror_request(
    addr: SocketAddr,
    method: http::Method,
    pq: &str,
    headers: http::HeaderMap,
    body: Bytes,
) -> std::result::Result<u16, Box<dyn std::error::Error + Send + Sync>> {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method(method)
        .uri(pq)
        .body(http_body_util::Full::new(body))?;
    *req.headers_mut() = headers;
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    resp.into_body().collect().await?;
    Ok(status)
}

/// Whether the raw HTTP/1 request head has a header line starting with `name` (lowercase,
/// with its colon), whatever the parser kept of it.
fn raw_head_has(session: &Session, name: &[u8]) -> bool {
    match session.as_downstream() {
        pingora_core::protocols::http::ServerSession::H1(h1) => {
            let raw = h1.get_headers_raw_bytes();
            raw.split(|b| *b == b'\n').skip(1).any(|line| {
                line.len() >= name.len() && line[..name.len()].eq_ignore_ascii_case(name)
            })
        }
        _ => false,
    }
}

/// Whether the HTTP/1 request line carries a `#fragment`, which the URI parser drops silently
/// but Envoy answers with 400.
fn has_fragment(session: &Session) -> bool {
    match session.as_downstream() {
        pingora_core::protocols::http::ServerSession::H1(h1) => {
            let raw = h1.get_headers_raw_bytes();
            let line_end = raw.iter().position(|b| *b == b'\n').unwrap_or(raw.len());
            raw[..line_end].contains(&b'#')
        }
        _ => false,
    }
}

/// The authority as the client sent it (`:authority` or `Host`).
fn raw_authority(req: &RequestHeader) -> &str {
    req.uri
        .authority()
        .map(|a| a.as_str())
        .or_else(|| {
            req.headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
        })
        .unwrap_or("")
}

/// `host[:port]` into host and port; IPv6 literals keep their brackets.
fn split_port(authority: &str) -> (&str, Option<&str>) {
    let colon = if authority.starts_with('[') {
        authority.find("]:").map(|i| i + 1)
    } else {
        authority.rfind(':')
    };
    match colon {
        Some(i) => (&authority[..i], Some(&authority[i + 1..])),
        None => (authority, None),
    }
}

/// The request hash of the route's `hash_policy`, for a ring hash or Maglev cluster. A cookie
/// policy with a ttl whose cookie the request lacks generates one, as Envoy's router does, and
/// leaves its `set-cookie` in `set_cookies` for the response.
fn request_hash(
    session: &Session,
    listener: &ActiveChain,
    fwd: &Forward,
    set_cookies: &mut Vec<String>,
) -> Option<u64> {
    use crate::lb::hash_policy::{self, HashInput};
    if fwd.hash_policy.is_empty() {
        return None;
    }
    let req = session.req_header();
    let peer = session.client_addr().and_then(|a| a.as_inet()).copied();
    let input = HashInput {
        headers: &req.headers,
        authority: raw_authority(req),
        path: req.uri.path_and_query().map_or("/", |p| p.as_str()),
        method: req.method.as_str(),
        scheme: req.uri.scheme_str().unwrap_or("http"),
        source_ip: listener
            .def
            .hcm()
            .and_then(|h| downstream_remote(&req.headers, peer, h))
            .map(|a| a.ip()),
    };
    hash_policy::generate(&fwd.hash_policy, &input, |cookie| {
        // Envoy hashes the connection's remote and local addresses, so every request of one
        // connection gets the same cookie.
        let remote = peer.map(|a| a.to_string()).unwrap_or_default();
        let local = session
            .server_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.to_string())
            .unwrap_or_default();
        let value = hash_policy::generated_cookie(&remote, &local);
        set_cookies.push(hash_policy::set_cookie_value(cookie, &value));
        value
    })
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx::default()
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        self.hcm_stats.start();
        ctx.counted_active = true;
        let snap = self.state.snapshot();
        // The connection's own chain, whatever later pushes did to the listener's others.
        let listener = self.chain.in_snapshot(&snap);
        ctx.snapshot = Some(snap.clone());
        if self.chain.gradual_close() {
            session.set_keepalive(None);
        }
        ctx.listener = Some(listener.clone());
        if let pingora_core::protocols::http::ServerSession::H1(h1) = session.as_downstream_mut() {
            // Serve pipelined requests in order instead of dropping them, as Envoy does.
            h1.set_pipelining_enabled(true);
            // Envoy answers Expect: 100-continue itself; upstream 1xx are not relayed.
            h1.set_ignore_info_resp(true);
        }
        if let Some((status, body, close)) = reject(session) {
            if close {
                session.set_keepalive(None);
            }
            let body = (!body.is_empty()).then(|| Bytes::from_static(body.as_bytes()));
            return self.local_reply(session, ctx, status, body, &[]).await;
        }
        if let Some(hcm) = listener.def.hcm() {
            use crate::snapshot::listener::Underscores;
            if hcm.underscores != Underscores::Allow {
                let req = session.req_header();
                if req.headers.keys().any(|k| k.as_str().contains('_')) {
                    if hcm.underscores == Underscores::Reject {
                        // Envoy's codec refuses the request and closes the connection.
                        session.set_keepalive(None);
                        return self.local_reply(session, ctx, 400, None, &[]).await;
                    }
                    let names: Vec<HeaderName> = req
                        .headers
                        .keys()
                        .filter(|k| k.as_str().contains('_'))
                        .cloned()
                        .collect();
                    let req = session.req_header_mut();
                    for n in names {
                        req.remove_header(&n);
                    }
                }
            }
        }
        // Envoy normalizes :path before any filter or route sees it.
        if let Some(hcm) = listener.def.hcm().filter(|h| h.path.is_active()) {
            let req = session.req_header();
            let original = req.uri.path_and_query().map_or("/", |p| p.as_str());
            match normalize::apply(&hcm.path, original) {
                normalize::Action::Continue(None) => {}
                normalize::Action::Continue(Some(p)) => {
                    if set_path(session.req_header_mut(), &p).is_err() {
                        return self.local_reply(session, ctx, 400, None, &[]).await;
                    }
                }
                normalize::Action::Reject => {
                    return self.local_reply(session, ctx, 400, None, &[]).await;
                }
                normalize::Action::Redirect(p) => {
                    return self
                        .local_reply(session, ctx, 307, None, &[(http::header::LOCATION, p)])
                        .await;
                }
            }
        }
        // Envoy's connection manager settles x-forwarded-client-cert before routing, so route
        // matchers see what the upstream will.
        if let Some(hcm) = listener.def.hcm() {
            // x-forwarded-proto is settled before routing too: `require_tls` and header
            // matchers read it.
            let req = session.req_header_mut();
            if hcm.use_remote_address || !req.headers.contains_key(&X_FORWARDED_PROTO) {
                // The chain terminating TLS is what makes the connection https, as in Envoy.
                let proto = if listener.def.tls.is_some() {
                    "https"
                } else {
                    "http"
                };
                req.insert_header(X_FORWARDED_PROTO.clone(), proto)?;
            }
            if listener.routes.any_require_tls && self.needs_tls(session, &listener, hcm) {
                let req = session.req_header();
                let location = format!(
                    "https://{}{}",
                    raw_authority(req),
                    req.uri.path_and_query().map_or("/", |p| p.as_str())
                );
                return self
                    .local_reply(
                        session,
                        ctx,
                        301,
                        None,
                        &[(http::header::LOCATION, location)],
                    )
                    .await;
            }
            use crate::snapshot::listener::ForwardClientCert as F;
            // Only the modes that keep or write the header look at the certificate.
            let peer = match hcm.xfcc.mode {
                F::Sanitize | F::AlwaysForwardOnly => None,
                _ => client_cert::of(session.digest()),
            };
            client_cert::mutate(session.req_header_mut(), &hcm.xfcc, peer.as_deref())?;
        }
        // Set after the codec-level checks above, whose replies stay plain.
        ctx.grpc_request = router::is_grpc(&session.req_header().headers);
        let expect_continue = session
            .req_header()
            .headers
            .get(http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        let host = authority(session, &listener);
        let req = session.req_header();
        let path = req.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        let scheme = req.uri.scheme_str().unwrap_or("http");
        let view = RequestView {
            host: &host,
            authority: raw_authority(req),
            path,
            method: req.method.as_str(),
            scheme,
            headers: &req.headers,
        };
        let matched = router::route(&listener.routes, &view).map(|(_, r)| r);
        let Some(hcm) = listener.def.hcm() else {
            // Checked above when the chain was loaded.
            return self.local_reply(session, ctx, 404, None, &[]).await;
        };
        // Envoy decides an upgrade when it builds the filter chain, once the route is known and
        // before any filter runs: a refused one is a bare 403, and the connection closes since
        // the bytes after the request belong to the other protocol.
        if let Some(up) = upgrade::requested(session) {
            if !upgrade::permitted(&hcm.upgrades, matched, up) {
                self.hcm_stats.ws_on_non_ws_route.fetch_add(1, Relaxed);
                session.set_keepalive(None);
                return self.local_reply(session, ctx, 403, None, &[]).await;
            }
            ctx.upgrade = true;
            self.hcm_stats.upgrades_total.fetch_add(1, Relaxed);
            self.hcm_stats.upgrades_active.fetch_add(1, Relaxed);
        }
        // Envoy resolves the weighted cluster with the route, before any filter runs: the
        // fault filter's upstream_cluster and the entry's overrides see the pick.
        let picked = match matched.map(|r| &r.action) {
            Some(Action::Forward(f)) => Some(match &f.target {
                Target::Cluster(c) => (c, None),
                Target::Weighted(w) => {
                    let i = w.pick_index(fastrand::u64(..));
                    (&w.clusters[i].0, w.entries.get(i))
                }
            }),
            _ => None,
        };
        // The connection manager's HTTP filters, in chain order; the router is the last.
        let filter_req = filters::Request {
            view: &view,
            route: matched.map(|r| &r.filters),
            picked: picked.map(|(c, e)| (c.as_ref(), e.map(|e| &e.filters))),
        };
        let stats = filters::Stats {
            fault: &self.hcm_stats.fault,
        };
        if let Some(reply) = filters::run(&hcm.filters, &filter_req, &mut ctx.filters, stats).await
        {
            return self.filter_reply(session, ctx, reply).await;
        }
        let Some(route) = matched else {
            self.hcm_stats.no_route.fetch_add(1, Relaxed);
            return self.local_reply(session, ctx, 404, None, &[]).await;
        };
        let entry = picked.and_then(|(_, e)| e);
        let has_entry_ops =
            entry.is_some_and(|e| e.request_headers.is_some() || e.response_headers.is_some());
        // Only routes with custom headers need the formatter context (XFF parsing included).
        let fmt = if has_entry_ops || !route.header_plan.is_empty() {
            let peer = session.client_addr().and_then(|a| a.as_inet()).copied();
            FormatCtx {
                remote: downstream_remote(&req.headers, peer, hcm),
                direct_remote: peer,
                local: session.server_addr().and_then(|a| a.as_inet()).copied(),
            }
        } else {
            FormatCtx::default()
        };
        let entry_resp = entry.and_then(|e| e.response_headers.clone());
        if entry_resp.is_some() || !route.header_plan.response.is_empty() {
            ctx.resp_headers = Some(RespHeaders {
                entry: entry_resp,
                plan: route.header_plan.clone(),
                fmt,
            });
        }
        let fwd: &Forward = match &route.action {
            Action::Direct { status, body } => {
                let status = status.as_u16();
                // Envoy points 201 and 3xx direct responses at the request's own URL.
                let mut extra = Vec::new();
                if status == 201 || (300..400).contains(&status) {
                    let location = format!("{scheme}://{}{path}", raw_authority(req));
                    extra.push((http::header::LOCATION, location));
                }
                return self
                    .local_reply(session, ctx, status, body.clone(), &extra)
                    .await;
            }
            Action::Redirect(r) => {
                return self.redirect(session, ctx, r, route.rewrite_len()).await;
            }
            Action::Forward(f) => f,
        };
        let Some((cluster_name, _)) = picked else {
            return Error::e_explain(ErrorType::InternalError, "forward route without a cluster");
        };
        let Some(cluster) = snap.clusters.get(cluster_name.as_ref()).cloned() else {
            // Envoy's cluster_not_found_response_code default.
            return self.local_reply(session, ctx, 503, None, &[]).await;
        };
        let picked = if let Some(od) = &cluster.def.original_dst {
            cluster.pick_original_dst(od, &session.req_header().headers, restored_local(session))
        } else if cluster.hashes() {
            let hash = request_hash(session, &listener, fwd, &mut ctx.set_cookies);
            ctx.request_hash = hash;
            cluster.pick_hashed(hash)
        } else {
            cluster.pick()
        };
        let Some((idx, addr)) = picked else {
            // Envoy counts the code (upstream_rq_503), though no upstream request started.
            cluster.stats.cx_none_healthy.fetch_add(1, Relaxed);
            cluster.stats.record_code(503);
            return self
                .local_reply(
                    session,
                    ctx,
                    503,
                    Some(Bytes::from_static(b"no healthy upstream")),
                    &[],
                )
                .await;
        };
        cluster.active[idx].fetch_add(1, Relaxed);
        cluster.stats.rq_active.fetch_add(1, Relaxed);
        cluster.stats.start();
        if let (Some(rewrite), Some(len)) = (&fwd.prefix_rewrite, route.rewrite_len()) {
            ctx.prefix_rewrite = Some((len, rewrite.clone()));
        }
        if let Some(rr) = &fwd.regex_rewrite {
            // The path is rewritten, the query kept as it came.
            let full = session
                .req_header()
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str());
            let (path, query) = match full.split_once('?') {
                Some((p, q)) => (p, Some(q)),
                None => (full, None),
            };
            let mut new = rr.apply(path);
            if let Some(q) = query {
                new.push('?');
                new.push_str(q);
            }
            ctx.path_rewrite = Some(new);
        }
        let rewritten = fwd.host_rewrite.clone().or_else(|| {
            use crate::snapshot::route::HostRewrite as HR;
            let req = session.req_header();
            match fwd.host_rewrite_from.as_deref()? {
                HR::Header(name) => req
                    .headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .filter(|v| !v.is_empty())
                    .map(str::to_string),
                HR::PathRegex(rr) => Some(rr.apply(req.uri.path())),
                HR::Auto => None,
            }
        });
        ctx.auto_host = matches!(
            fwd.host_rewrite_from.as_deref(),
            Some(crate::snapshot::route::HostRewrite::Auto)
        );
        ctx.route_host = rewritten.is_some();
        ctx.forwarded_host = (fwd.append_x_forwarded_host
            && (rewritten.is_some() || ctx.auto_host))
            .then(|| raw_authority(session.req_header()).to_string())
            .filter(|h| !h.is_empty());
        ctx.host_rewrite = rewritten.or_else(|| {
            // The HCM's port stripping also changes the Host sent upstream (case kept).
            let raw = raw_authority(session.req_header());
            hcm_strips_port(raw, &listener, local_port(session))
                .then(|| split_port(raw).0.to_string())
        });
        ctx.timeout = fwd.timeout;
        ctx.deadline = fwd.timeout.map(|t| Instant::now() + t);
        ctx.retry = fwd.retry.clone();
        if !fwd.mirrors.is_empty() {
            let host = raw_authority(session.req_header());
            let targets: Vec<(Arc<str>, String)> = fwd
                .mirrors
                .iter()
                .filter(|m| fastrand::u32(..1_000_000) < m.per_million)
                .map(|m| (m.cluster.clone(), m.host(host)))
                .collect();
            if !targets.is_empty() {
                ctx.mirror = Some(Box::new(MirrorJob {
                    targets,
                    ..Default::default()
                }));
            }
        }
        ctx.attempt_count_to_upstream = fwd.attempt_count_to_upstream;
        ctx.attempt_count_to_client = fwd.attempt_count_to_client;
        ctx.host_index = idx;
        ctx.peer = Some(addr);
        ctx.cluster = Some(cluster);

        // Request headers as Envoy's connection manager mutates them.
        let client_ip = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip());
        if expect_continue {
            session
                .write_response_header(Box::new(ResponseHeader::build(100, Some(0))?), false)
                .await?;
            session
                .req_header_mut()
                .remove_header(&http::header::EXPECT);
        }
        let original_path =
            (ctx.prefix_rewrite.is_some() || ctx.path_rewrite.is_some()).then(|| {
                session
                    .req_header()
                    .uri
                    .path_and_query()
                    .map_or_else(|| "/".to_string(), |p| p.as_str().to_string())
            });
        let req = session.req_header_mut();
        // Envoy trusts x-envoy-* control headers only from internal clients; Envoy 1.40 has no
        // internal address ranges unless internal_address_config names some.
        let internal = is_internal_request(&req.headers, client_ip, hcm);
        if internal {
            req.insert_header(X_ENVOY_INTERNAL.clone(), "true")?;
        } else if req
            .headers
            .keys()
            .any(|k| k.as_str().starts_with("x-envoy-"))
        {
            for h in UNTRUSTED_ENVOY_HEADERS {
                req.remove_header(*h);
            }
        }
        let edge = hcm.use_remote_address && !internal;
        if edge {
            for h in EDGE_STRIPPED_HEADERS {
                req.remove_header(*h);
            }
        }
        if let (true, Some(ip)) = (hcm.use_remote_address, client_ip) {
            let prior = req
                .headers
                .get(&X_FORWARDED_FOR)
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
                .map(str::to_string);
            if !hcm.skip_xff_append {
                let value = match &prior {
                    Some(prev) => format!("{prev},{ip}"),
                    None => ip.to_string(),
                };
                req.insert_header(X_FORWARDED_FOR.clone(), value)?;
            }
            // With trusted hops, the client is that many entries back from the peer in XFF.
            let mut client = ip.to_string();
            if hcm.xff_num_trusted_hops > 0 {
                if let Some(prev) = &prior {
                    let hops: Vec<&str> = prev.split(',').map(str::trim).collect();
                    let back = hcm.xff_num_trusted_hops as usize;
                    if let Some(addr) = hops.len().checked_sub(back).and_then(|i| hops.get(i)) {
                        if addr.parse::<std::net::IpAddr>().is_ok() {
                            client = addr.to_string();
                        }
                    }
                }
            }
            // Only edge requests: an internal client is not entering the trusted network.
            if edge {
                req.insert_header(X_ENVOY_EXTERNAL_ADDRESS.clone(), client)?;
            }
        }
        let regenerate = edge && !hcm.preserve_external_request_id;
        if hcm.generate_request_id && (regenerate || !req.headers.contains_key(&X_REQUEST_ID)) {
            let id = http::HeaderValue::from_bytes(&crate::uuid::v4_bytes())
                .or_err(ErrorType::InternalError, "request id")?;
            req.insert_header(X_REQUEST_ID.clone(), id)?;
        }
        // Envoy announces the per-try timeout when there is one, else the route's.
        set_timeouts(ctx, req, fwd, hcm)?;
        if ctx.upgrade {
            // Envoy arms the route and per-try timeouts when the request ends, which an upgrade
            // request never does; nor does it retry a request still streaming. The stream idle
            // timeout (and max_stream_duration) still bound it, both ways.
            ctx.timeout = None;
            ctx.deadline = None;
            ctx.per_try = None;
            ctx.retry = None;
        }
        // The route's custom headers (weighted-cluster entry first), after the connection
        // manager's own, before the path rewrite records x-envoy-original-path: Envoy's order.
        for ops in entry
            .and_then(|e| e.request_headers.as_ref())
            .into_iter()
            .chain(route.header_plan.request.iter())
        {
            ops.apply(req, None, &fmt);
        }
        if let Some(p) = original_path {
            req.insert_header(X_ORIGINAL_PATH.clone(), p)?;
        }
        if ctx.upgrade {
            // pingora's 60 s body-read default would cut a quiet client of the tunnel; Envoy
            // leaves it to the stream idle timeout.
            if let pingora_core::protocols::http::ServerSession::H1(h1) =
                session.as_downstream_mut()
            {
                h1.set_read_timeout(ctx.idle);
            }
        }
        Ok(false)
    }

    async fn upstream_peer(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        ctx.attempts += 1;
        if ctx.attempts > 1 {
            self.next_attempt(ctx).await?;
        }
        // use_downstream_protocol_config: HTTP/2 upstream for an HTTP/2 client.
        ctx.upstream_h2 = ctx.cluster.as_ref().is_some_and(|c| {
            c.def.http2 || (c.def.downstream_protocol && session.as_downstream().is_http2())
        });
        if !ctx.cx_slot {
            self.take_connection_slot(ctx).await?;
        }
        let (Some(addr), Some(cluster)) = (ctx.peer, &ctx.cluster) else {
            return Error::e_explain(ErrorType::InternalError, "no upstream chosen");
        };
        // An ORIGINAL_DST host is named by the request, so its TLS settings are made for it.
        let named_tls;
        let tls = if cluster.def.original_dst.is_some() {
            named_tls = cluster.original_dst_tls(addr);
            named_tls.as_ref()
        } else {
            cluster.tls_for(ctx.host_index)
        };
        // An internal listener's endpoint: through that listener's chain (HBONE).
        let internal = match &ctx.snapshot {
            Some(snap)
                if cluster
                    .endpoints
                    .hosts
                    .get(ctx.host_index)
                    .is_some_and(|h| h.internal.is_some()) =>
            {
                Some(hbone::peer(snap, cluster, ctx.host_index)?)
            }
            _ => None,
        };
        let direct = internal.is_none();
        let mut peer = match (internal, tls) {
            (Some(p), _) => p,
            (None, Some(tls)) => {
                // istio.alpn: the connection manager's list for the protocol spoken upstream.
                let alpn = ctx
                    .listener
                    .as_ref()
                    .and_then(|l| l.def.hcm())
                    .and_then(|h| h.alpn.as_ref())
                    .filter(|a| a.for_protocol(cluster.def.http2).is_some())
                    .map(|a| (a.clone(), cluster.def.http2));
                upstream_tls::peer(tls, alpn, cluster.def.connect_timeout)?
            }
            (None, None) => HttpPeer::new(addr, false, String::new()),
        };
        peer.options.connection_timeout = Some(cluster.def.connect_timeout);
        // Approximates Envoy's timeouts: the upstream must answer within the per-try timeout
        // and within what is left of the route timeout.
        let now = Instant::now();
        let left = |d: Option<Instant>| d.map(|d| d.saturating_duration_since(now));
        let bounds = [
            (ctx.per_try, TimeoutKind::PerTry),
            (left(ctx.deadline), TimeoutKind::Route),
            (left(ctx.stream_deadline), TimeoutKind::Stream),
            (ctx.idle, TimeoutKind::Idle),
        ];
        let first = bounds
            .into_iter()
            .filter_map(|(d, kind)| Some((d?, kind)))
            .min_by_key(|(d, _)| *d);
        peer.options.read_timeout = first.map(|(d, _)| d);
        ctx.timeout_kind = first.map_or(TimeoutKind::Route, |(_, kind)| kind);
        // A TLS connection binds in the relay's connector (`EndpointTls::bind`); an internal
        // connection binds nothing (its tunnel is the other cluster's connection).
        if let (Some(b), None, true) = (&cluster.def.bind, tls, direct) {
            use std::hash::{Hash, Hasher};
            let from = b.for_peer(addr);
            let mut bind = pingora_core::connectors::l4::BindTo::default();
            bind.addr = Some(from);
            peer.options.bind_to = Some(bind);
            // pingora's pool key leaves out the bind address: keep connections from different
            // sources apart.
            let mut h = std::hash::DefaultHasher::new();
            from.hash(&mut h);
            peer.group_key = h.finish();
        }
        if ctx.upstream_h2 {
            peer.options.set_http_version(2, 2);
            // pingora's default of one stream per connection would open a connection per
            // concurrent request; Envoy multiplexes them.
            peer.options.max_h2_streams = cluster.def.h2_max_streams as usize;
        }
        peer.options.idle_timeout = cluster.def.idle_timeout;
        // A TLS connection sets its keepalive on the TCP socket under the relay.
        if let (Some(k), None, true) = (cluster.def.tcp_keepalive, tls, direct) {
            peer.options.tcp_keepalive = Some(tcp_keepalive(k));
        }
        Ok(Box::new(peer))
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        reused: bool,
        _peer: &HttpPeer,
        #[cfg(unix)] fd: std::os::unix::io::RawFd,
        #[cfg(windows)] _sock: std::os::windows::io::RawSocket,
        _digest: Option<&pingora_core::protocols::Digest>,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let limit = ctx
            .cluster
            .as_ref()
            .filter(|_| !ctx.upstream_h2)
            .and_then(|c| c.def.max_requests_per_connection);
        #[cfg(unix)]
        if let (Some(max), true) = (limit, fd >= 0) {
            ctx.close_upstream = count_connection_use(fd, reused, max);
        }
        Ok(())
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if ctx.upgrade {
            // Envoy forwards an upgrade's hop-by-hop headers as they came, bar two.
            upgrade::forward_hop_by_hop(&session.req_header().headers, upstream)?;
        } else {
            strip_request(upstream)?;
            if ctx.close_upstream {
                // pingora keeps no connection whose request asked to close it.
                upstream.insert_header(http::header::CONNECTION, "close")?;
            }
            // pingora strips more than Envoy does; put back what Envoy forwards: `te: trailers`,
            // `trailer` and `proxy-authorization` (unless `Connection` names them).
            let down = &session.req_header().headers;
            let restorable = [
                http::header::TE,
                http::header::TRAILER,
                http::header::PROXY_AUTHORIZATION,
            ];
            // Most requests carry none of these: skip the Connection parsing for them.
            if restorable.iter().any(|h| down.contains_key(h)) {
                let (nominated, te_trailers) = hop_by_hop(down);
                if te_trailers {
                    upstream.insert_header(http::header::TE, "trailers")?;
                }
                for name in &restorable[1..] {
                    if nominated.contains(name) {
                        continue;
                    }
                    for v in down.get_all(name) {
                        upstream.append_header(name.clone(), v.clone())?;
                    }
                }
            }
        }
        if let Some((len, rewrite)) = &ctx.prefix_rewrite {
            let pq = upstream
                .uri
                .path_and_query()
                .map(|p| p.as_str())
                .unwrap_or("/");
            let rest = pq.get(*len..).unwrap_or("");
            let new = format!("{rewrite}{rest}");
            let uri = with_path(&upstream.uri, &new)
                .map_err(|e| Error::because(ErrorType::InternalError, "prefix rewrite", e))?;
            upstream.set_uri(uri);
        }
        if let Some(new) = &ctx.path_rewrite {
            let uri = with_path(&upstream.uri, new)
                .map_err(|e| Error::because(ErrorType::InternalError, "regex rewrite", e))?;
            upstream.set_uri(uri);
        }
        let auto = ctx
            .cluster
            .as_ref()
            .filter(|_| ctx.auto_host)
            .and_then(|c| c.endpoints.hosts.get(ctx.host_index)?.hostname.clone());
        let mut host_rewritten = ctx.route_host;
        if let Some(h) = &auto {
            upstream.insert_header(http::header::HOST, &**h)?;
            host_rewritten = true;
        } else if let Some(h) = &ctx.host_rewrite {
            upstream.insert_header(http::header::HOST, h.as_str())?;
        }
        if let (true, Some(original)) = (host_rewritten, &ctx.forwarded_host) {
            // Envoy appends unless the header already ends with the original host.
            let prev = upstream
                .headers
                .get(&X_FORWARDED_HOST)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            if !prev.ends_with(original.as_str()) {
                let value = if prev.is_empty() {
                    original.clone()
                } else {
                    format!("{prev},{original}")
                };
                upstream.insert_header(X_FORWARDED_HOST.clone(), value)?;
            }
        }
        if ctx.attempt_count_to_upstream {
            upstream.insert_header(X_ATTEMPT_COUNT.clone(), ctx.attempts.to_string())?;
        }
        for (k, v, append) in ctx.filters.upstream_request_headers() {
            if *append {
                upstream.append_header(k.clone(), v.clone())?;
            } else {
                upstream.insert_header(k.clone(), v.clone())?;
            }
        }
        if let Some(job) = ctx.mirror.as_mut().filter(|j| j.head.is_none()) {
            // The mirror gets the request as it goes upstream (Envoy copies it after the
            // router's header changes).
            let pq = upstream
                .uri
                .path_and_query()
                .map_or_else(|| "/".to_string(), |p| p.as_str().to_string());
            job.head = Some((upstream.method.clone(), pq, upstream.headers.clone()));
            if session.as_mut().is_body_empty() {
                self.send_mirrors(ctx);
            }
        }
        ctx.upstream_start = Some(Instant::now());
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let Some(job) = ctx.mirror.as_mut().filter(|j| !j.sent && !j.dropped) else {
            return Ok(());
        };
        if let Some(b) = body {
            if job.body.len() + b.len() > MIRROR_BODY_LIMIT {
                job.dropped = true;
                job.body = Vec::new();
                return Ok(());
            }
            job.body.extend_from_slice(b);
        }
        if end_of_stream {
            self.send_mirrors(ctx);
        }
        Ok(())
    }

    async fn upstream_response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let status = resp.status.as_u16();
        if let Some(c) = &ctx.cluster {
            c.record_outcome(ctx.host_index, status);
            // Envoy's passive health check: the upstream asks to be taken out now.
            if !c.hc.is_empty()
                && resp
                    .headers
                    .contains_key("x-envoy-immediate-health-check-fail")
            {
                if let Some(h) = c.endpoints.hosts.get(ctx.host_index) {
                    c.stats.health.passive_failure(&h.addr);
                }
            }
        }
        let Some(policy) = ctx.retry.clone() else {
            return Ok(());
        };
        let grpc_status = resp
            .headers
            .get("grpc-status")
            .and_then(|v| std::str::from_utf8(v.as_bytes()).ok()?.parse().ok());
        // Envoy never retries an answer that says the upstream is overloaded or rate limited.
        let refused = resp.headers.contains_key("x-envoy-overloaded")
            || resp.headers.contains_key("x-envoy-ratelimited");
        if refused || !policy.retries_status(status, grpc_status) {
            if ctx.attempts > 1 {
                if let Some(c) = &ctx.cluster {
                    c.stats.rq_retry_success.fetch_add(1, Relaxed);
                }
            }
            return Ok(());
        }
        if !self.may_retry(session, ctx, &policy) {
            return Ok(());
        }
        // This attempt's answer is counted now; the client will see the next one.
        if let Some(c) = &ctx.cluster {
            c.stats.record_code(status);
        }
        ctx.retrying = true;
        Error::e_explain(
            ErrorType::Custom("retriable upstream response"),
            format!("upstream answered {status}, retrying"),
        )
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
        _client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        if std::mem::take(&mut ctx.retrying) {
            e.set_retry(true);
            return e;
        }
        let upstream = e.esource() == &ErrorSource::Upstream;
        let timed_out = matches!(
            e.etype(),
            ErrorType::ReadTimedout | ErrorType::WriteTimedout
        );
        let per_try = timed_out && ctx.timeout_kind == TimeoutKind::PerTry;
        if per_try {
            if let Some(c) = &ctx.cluster {
                c.stats.rq_per_try_timeout.fetch_add(1, Relaxed);
            }
        }
        if upstream && session.response_written().is_none() {
            if let Some(c) = &ctx.cluster {
                // Timeouts count as 504, resets and broken connections as 503.
                c.record_outcome(ctx.host_index, if timed_out { 504 } else { 503 });
            }
        }
        // A reset, a broken connection or a per-try timeout before the response started.
        let retry = (per_try || upstream && !timed_out)
            && session.response_written().is_none()
            && ctx.retry.clone().is_some_and(|p| {
                p.retries_failure(Failure::Reset) && self.may_retry(session, ctx, &p)
            });
        e.set_retry(retry);
        e
    }
    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<std::time::Duration>> {
        if ctx.discard_body {
            *body = None;
        }
        Ok(None)
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let switching = ctx.upgrade && upgrade::is_switch(resp);
        if switching {
            upgrade::switch_response(resp)?;
        } else {
            strip_response(resp);
        }
        if ctx.upgrade && !switching {
            // Envoy 1.40 relays a refused upgrade's head with an empty body and closes the
            // connection, whose remaining bytes were meant for the other protocol.
            upgrade::refused_head(resp)?;
            session.set_keepalive(None);
            ctx.discard_body = true;
        }
        if let Some(c) = &ctx.cluster {
            // Counted on headers, as Envoy does, so a scrape right after a response sees it.
            c.stats.record_code(resp.status.as_u16());
            ctx.code_recorded = true;
        }
        // Envoy measures from the end of the request, which an upgrade has not reached.
        if let (Some(start), false) = (ctx.upstream_start, ctx.upgrade) {
            resp.insert_header(
                X_UPSTREAM_TIME.clone(),
                start.elapsed().as_millis().to_string(),
            )?;
        }
        // After x-envoy-upstream-service-time, before the connection manager's `server`.
        if let Some(rh) = &ctx.resp_headers {
            rh.apply(resp, session.req_header());
        }
        if let Some(h) = ctx.listener.as_ref().and_then(|l| l.def.hcm()) {
            resp.insert_header(http::header::SERVER, h.server_name.as_str())?;
        }
        if ctx.attempt_count_to_client && ctx.attempts > 0 {
            resp.insert_header(X_ATTEMPT_COUNT.clone(), ctx.attempts.to_string())?;
        }
        filter_response_headers(resp, ctx)?;
        for c in ctx.set_cookies.drain(..) {
            resp.append_header(http::header::SET_COOKIE, c)?;
        }
        Ok(())
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        // A failed HBONE tunnel is, to Envoy's router, an internal connection that came up and
        // then closed before any response: a reset, not a connect failure (the tunnel's own
        // cluster counts the failed connect).
        let tunnel = *e.etype() == hbone::TUNNEL_FAILURE;
        if let Some(c) = &ctx.cluster {
            if !tunnel {
                c.stats.cx_connect_fail.fetch_add(1, Relaxed);
            }
            // A local-origin failure counts as a 503 for outlier detection, as in Envoy.
            c.record_outcome(ctx.host_index, 503);
        }
        let failure = if tunnel {
            Failure::Reset
        } else {
            Failure::ConnectFailure
        };
        // Envoy retries only when a retry policy says so.
        let retry = ctx
            .retry
            .clone()
            .is_some_and(|p| p.retries_failure(failure) && self.may_retry(_session, ctx, &p));
        e.set_retry(retry);
        e
    }

    async fn fail_to_proxy(&self, session: &mut Session, e: &Error, ctx: &mut Ctx) -> FailToProxy {
        use ErrorType::*;
        if session.response_written().is_some() {
            // The response has started: all that is left is to cut it short, as Envoy does.
            return FailToProxy {
                error_code: 0,
                can_reuse_downstream: false,
            };
        }
        let upstream = e.esource() == &ErrorSource::Upstream;
        let (code, body): (u16, &'static str) = match e.etype() {
            InvalidHTTPHeader | H1Error | H2Error | InvalidH2 if upstream => (
                502,
                "upstream connect error or disconnect/reset before headers. reset reason: protocol error",
            ),
            HTTPStatus(code) => (*code, ""),
            t if *t == OVERFLOW => (
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: overflow",
            ),
            ConnectTimedout => (
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: connection timeout",
            ),
            // A failed upstream handshake too: Envoy names no TLS reason in the reply.
            ConnectRefused | ConnectNoRoute | ConnectError | ConnectProxyFailure
            | TLSHandshakeFailure => (
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure",
            ),
            SocketError | BindError => (
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: local connection failure",
            ),
            ReadTimedout | WriteTimedout => match ctx.timeout_kind {
                // The connection manager's stream timers answer for the stream, not the route.
                TimeoutKind::Stream => (504, "downstream duration timeout"),
                TimeoutKind::Idle => (504, "stream timeout"),
                TimeoutKind::Route | TimeoutKind::PerTry => {
                    if let Some(c) = &ctx.cluster {
                        c.stats.rq_timeout.fetch_add(1, Relaxed);
                    }
                    (504, "upstream request timeout")
                }
            },
            // Envoy's internal connection closed by its tcp_proxy when the tunnel failed.
            t if *t == hbone::TUNNEL_FAILURE => (
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
            ),
            _ => match e.esource() {
                ErrorSource::Upstream => (
                    503,
                    "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
                ),
                ErrorSource::Downstream => match e.etype() {
                    WriteError | ReadError | ConnectionClosed => (0, ""),
                    _ => (400, ""),
                },
                ErrorSource::Internal | ErrorSource::Unset => (500, ""),
            },
        };
        if code > 0 {
            // pingora closes the downstream connection after a failed proxy attempt; saying so
            // keeps clients from reusing it (Envoy keeps it open).
            session.set_keepalive(None);
            let body = (!body.is_empty()).then(|| Bytes::from_static(body.as_bytes()));
            let overloaded = [(X_OVERLOADED.clone(), "true".to_string())];
            let extra: &[(HeaderName, String)] = if *e.etype() == OVERFLOW {
                &overloaded
            } else {
                &[]
            };
            // Envoy's stream duration timer names its own gRPC status.
            let grpc = (matches!(e.etype(), ReadTimedout | WriteTimedout)
                && ctx.timeout_kind == TimeoutKind::Stream)
                .then_some(4);
            if let Err(err) = self
                .local_reply_grpc(session, ctx, code, body, extra, grpc)
                .await
            {
                tracing::debug!("failed to send error response downstream: {err}");
            }
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, _e: Option<&Error>, ctx: &mut Ctx) {
        let code = session.response_written().map_or(0, |r| r.status.as_u16());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_and_format_as_envoy() {
        let v = |s: &'static str| parse_grpc_timeout(&http::HeaderValue::from_static(s));
        let ms = std::time::Duration::from_millis;
        assert_eq!(v("300m"), Some(ms(300)));
        assert_eq!(v("2S"), Some(ms(2000)));
        assert_eq!(v("1M"), Some(ms(60_000)));
        assert_eq!(v("1H"), Some(ms(3_600_000)));
        assert_eq!(v("1500u"), Some(ms(2)), "sub-millisecond units round up");
        assert_eq!(v("1n"), Some(ms(1)));
        for bad in ["", "m", "10", "123456789m", "1x", "-1m", "1.5S"] {
            assert_eq!(v(bad), None, "{bad}");
        }
        assert_eq!(grpc_timeout_value(ms(400)), "400m");
        assert_eq!(grpc_timeout_value(ms(100_000_000)), "100000S");
        assert_eq!(
            grpc_timeout_value(std::time::Duration::from_secs(100_000_000)),
            "1666666M"
        );
    }

    #[test]
    fn grpc_messages_are_percent_encoded() {
        assert_eq!(
            grpc_percent_encode(b"fault filter abort"),
            "fault filter abort"
        );
        assert_eq!(
            grpc_percent_encode("100% café\n".as_bytes()),
            "100%25 caf%C3%A9%0A"
        );
    }

    #[test]
    fn downstream_remote_follows_envoys_xff_rules() {
        use crate::snapshot::listener::{Codec, Hcm, RouteSource};
        let hcm = |use_remote_address: bool, hops: u32| Hcm {
            stat_prefix: "p".into(),
            routes: RouteSource::Rds("r".into()),
            codec: Codec::Auto,
            use_remote_address,
            skip_xff_append: false,
            xff_num_trusted_hops: hops,
            generate_request_id: true,
            preserve_external_request_id: false,
            strip_any_host_port: false,
            strip_matching_host_port: false,
            server_name: "envoy".into(),
            filters: Vec::new(),
            stream_idle_timeout: None,
            max_stream_duration: None,
            internal_ranges: Vec::new(),
            upgrades: Default::default(),
            xfcc: Default::default(),
            path: Default::default(),
            alpn: None,
            underscores: Default::default(),
        };
        let peer: Option<SocketAddr> = "127.0.0.1:5000".parse().ok();
        let mut h = http::HeaderMap::new();
        let ip = |a: Option<SocketAddr>| a.map(|a| a.to_string());
        // No XFF: the peer either way.
        assert_eq!(ip(downstream_remote(&h, peer, &hcm(false, 0))), ip(peer));
        h.insert(
            X_FORWARDED_FOR.clone(),
            http::HeaderValue::from_static("10.0.0.1, 10.0.0.2"),
        );
        // Without use_remote_address: the last entry (port 0), or `hops` back from it.
        assert_eq!(
            ip(downstream_remote(&h, peer, &hcm(false, 0))).as_deref(),
            Some("10.0.0.2:0")
        );
        assert_eq!(
            ip(downstream_remote(&h, peer, &hcm(false, 1))).as_deref(),
            Some("10.0.0.1:0")
        );
        // With use_remote_address: the peer, unless hops are trusted.
        assert_eq!(ip(downstream_remote(&h, peer, &hcm(true, 0))), ip(peer));
        assert_eq!(
            ip(downstream_remote(&h, peer, &hcm(true, 1))).as_deref(),
            Some("10.0.0.2:0")
        );
        // Too few entries or garbage: the peer.
        assert_eq!(ip(downstream_remote(&h, peer, &hcm(false, 5))), ip(peer));
        h.insert(
            X_FORWARDED_FOR.clone(),
            http::HeaderValue::from_static("junk"),
        );
        assert_eq!(ip(downstream_remote(&h, peer, &hcm(false, 0))), ip(peer));
        // Several XFF lines read as one list: the last entry of the last line, then back.
        h.insert(
            X_FORWARDED_FOR.clone(),
            http::HeaderValue::from_static("1.1.1.1, 2.2.2.2"),
        );
        h.append(
            X_FORWARDED_FOR.clone(),
            http::HeaderValue::from_static("3.3.3.3"),
        );
        assert_eq!(
            ip(downstream_remote(&h, peer, &hcm(false, 0))).as_deref(),
            Some("3.3.3.3:0")
        );
        assert_eq!(
            ip(downstream_remote(&h, peer, &hcm(false, 1))).as_deref(),
            Some("2.2.2.2:0")
        );
    }

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = RequestHeader::build("GET", b"/", None).expect("valid request");
        h.insert_header("connection", "close, x-private")
            .expect("valid");
        h.insert_header("x-private", "1").expect("valid");
        h.insert_header("keep-alive", "timeout=5").expect("valid");
        h.insert_header("te", "gzip, trailers").expect("valid");
        h.insert_header("x-keep", "1").expect("valid");
        strip_request(&mut h).expect("strip");
        assert!(h.headers.get("connection").is_none());
        assert!(h.headers.get("x-private").is_none());
        assert!(h.headers.get("keep-alive").is_none());
        assert_eq!(
            h.headers.get("te").and_then(|v| v.to_str().ok()),
            Some("trailers")
        );
        assert!(h.headers.get("x-keep").is_some());
    }
}
