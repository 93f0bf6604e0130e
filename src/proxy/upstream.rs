//! Upstream: choosing the host and its connection (circuit breakers, TLS, internal
//! listeners, keepalive, `max_requests_per_connection`), retries, the request's timeouts, and
//! the upstream request and response headers. pingora calls these through `upstream_peer`,
//! `connected_to_upstream`, `upstream_request_filter`, `upstream_response_filter`,
//! `error_while_proxy`, `fail_to_connect` and `response_filter`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use http::header::HeaderName;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorSource, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;

use super::downstream::{strip_request, strip_response};
use super::{filter_response_headers, hbone, upgrade, upstream_tls, Ctx, Gateway};
use crate::snapshot::retry::{Failure, RetryPolicy};
use crate::snapshot::route::Forward;

/// The timeouts that can end a wait for the upstream, each answered as Envoy answers it.
#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum TimeoutKind {
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
static GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");
static X_EXPECTED_TIMEOUT: HeaderName = HeaderName::from_static("x-envoy-expected-rq-timeout-ms");
static X_UPSTREAM_TIME: HeaderName = HeaderName::from_static("x-envoy-upstream-service-time");
static X_ATTEMPT_COUNT: HeaderName = HeaderName::from_static("x-envoy-attempt-count");
/// A circuit breaker overflowed: Envoy's `reset reason: overflow`.
pub(super) const OVERFLOW: ErrorType = ErrorType::Custom("upstream overflow");

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

/// The request's timers once it is routed (`set_timeouts`). An upgrade's differ: Envoy arms
/// the route and per-try timeouts when the request ends, which an upgrade request never does;
/// nor does it retry a request still streaming. The stream idle timeout (and
/// max_stream_duration) still bound it, both ways.
pub(super) fn arm_timers(
    session: &mut Session,
    ctx: &mut Ctx,
    fwd: &Forward,
    hcm: &crate::snapshot::listener::Hcm,
) -> Result<()> {
    // Envoy announces the per-try timeout when there is one, else the route's.
    set_timeouts(ctx, session.req_header_mut(), fwd, hcm)?;
    if ctx.upgrade {
        ctx.timeout = None;
        ctx.deadline = None;
        ctx.per_try = None;
        ctx.retry = None;
        // pingora's 60 s body-read default would cut a quiet client of the tunnel; Envoy
        // leaves it to the stream idle timeout.
        if let pingora_core::protocols::http::ServerSession::H1(h1) = session.as_downstream_mut() {
            h1.set_read_timeout(ctx.idle);
        }
    }
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

/// The connection's original destination when a listener filter restored it (Envoy's
/// `localAddressRestored`: the original_dst or proxy_protocol listener filter); ORIGINAL_DST
/// clusters fall back to it without a host header. Portico runs neither filter, so the
/// address a connection was accepted on never counts, as in Envoy without them.
fn restored_local(_session: &Session) -> Option<SocketAddr> {
    None
}

impl Gateway {
    /// The route's cluster (in the request's snapshot) and a host in it: by the request's
    /// original destination, its hash, or the cluster's balancer. `Ok(true)`: answered locally
    /// (no such cluster, no healthy host).
    pub(super) async fn choose_host(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        listener: &crate::snapshot::ActiveChain,
        fwd: &Forward,
        cluster_name: &str,
    ) -> Result<bool> {
        let cluster = ctx
            .snapshot
            .as_ref()
            .and_then(|snap| snap.clusters.get(cluster_name))
            .cloned();
        let Some(cluster) = cluster else {
            // Envoy's cluster_not_found_response_code default.
            return self.local_reply(session, ctx, 503, None, &[]).await;
        };
        let picked = if let Some(od) = &cluster.def.original_dst {
            cluster.pick_original_dst(od, &session.req_header().headers, restored_local(session))
        } else if cluster.hashes() {
            let hash = super::routing::request_hash(session, listener, fwd, &mut ctx.set_cookies);
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
                    Some(bytes::Bytes::from_static(b"no healthy upstream")),
                    &[],
                )
                .await;
        };
        cluster.active[idx].fetch_add(1, Relaxed);
        cluster.stats.rq_active.fetch_add(1, Relaxed);
        cluster.stats.start();
        ctx.host_index = idx;
        ctx.peer = Some(addr);
        ctx.cluster = Some(cluster);
        Ok(false)
    }

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

    /// pingora's `upstream_peer`: the attempt's host (a new one on a retry), its connection
    /// slot, and how to connect to it (TLS, internal listener, bind address, timeouts).
    pub(super) async fn choose_peer(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
    ) -> Result<Box<HttpPeer>> {
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

    /// pingora's `upstream_response_filter`: the host's outcome (outlier detection, passive
    /// health checks), and whether the retry policy tries again for this answer.
    pub(super) fn upstream_response(
        &self,
        session: &mut Session,
        resp: &ResponseHeader,
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

    /// pingora's `error_while_proxy`: the host's outcome, and whether to retry after a reset or
    /// a per-try timeout.
    pub(super) fn upstream_error(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
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

    /// pingora's `fail_to_connect`: the host's outcome, and whether to retry.
    pub(super) fn connect_failed(
        &self,
        session: &mut Session,
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
            .is_some_and(|p| p.retries_failure(failure) && self.may_retry(session, ctx, &p));
        e.set_retry(retry);
        e
    }
}

/// pingora's `connected_to_upstream`: counts the request on its connection, which it closes
/// when `max_requests_per_connection` is reached.
pub(super) fn count_request(ctx: &mut Ctx, reused: bool, fd: i32) {
    let limit = ctx
        .cluster
        .as_ref()
        .filter(|_| !ctx.upstream_h2)
        .and_then(|c| c.def.max_requests_per_connection);
    #[cfg(unix)]
    if let (Some(max), true) = (limit, fd >= 0) {
        ctx.close_upstream = count_connection_use(fd, reused, max);
    }
}

/// The upstream request's hop-by-hop headers, as Envoy forwards them: an upgrade's as they came
/// (bar two), otherwise stripped with `te: trailers`, `trailer` and `proxy-authorization` put
/// back; `connection: close` on a connection's last request.
pub(super) fn hop_by_hop(session: &Session, upstream: &mut RequestHeader, ctx: &Ctx) -> Result<()> {
    if ctx.upgrade {
        // Envoy forwards an upgrade's hop-by-hop headers as they came, bar two.
        return upgrade::forward_hop_by_hop(&session.req_header().headers, upstream);
    }
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
        let (nominated, te_trailers) = super::downstream::hop_by_hop(down);
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
    Ok(())
}

/// The router's last request headers: the attempt count and the HTTP filters' own.
pub(super) fn attempt_headers(upstream: &mut RequestHeader, ctx: &Ctx) -> Result<()> {
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
    Ok(())
}

/// pingora's `response_filter`: the response as the client gets it (an upgrade's switch,
/// connection headers, stats, `x-envoy-upstream-service-time`, the route's and the filters'
/// headers, `server`, generated cookies).
pub(super) fn response_headers(
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
}
