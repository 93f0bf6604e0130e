//! Upstream: choosing the host (`choose_host` when routed, `choose_peer` for each attempt) and
//! its connection (circuit breakers, TLS, internal listeners, bind address, keepalive,
//! `max_requests_per_connection`), and the upstream request and response headers. pingora calls
//! these through `upstream_peer`, `connected_to_upstream`, `upstream_request_filter` and
//! `response_filter`; retries are in `retries`, timeouts in `timeouts`.

use crate::snapshot::listener::ServerTransformation as Transformation;
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use http::header::HeaderName;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;

use super::downstream::{strip_request, strip_response};
use super::head::SetHeader;
use super::timeouts::TimeoutKind;
use super::{filter_response_headers, hbone, upgrade, upstream_tls, Ctx, Gateway};
use crate::snapshot::route::Forward;

static X_UPSTREAM_TIME: HeaderName = HeaderName::from_static("x-envoy-upstream-service-time");
static X_ATTEMPT_COUNT: HeaderName = HeaderName::from_static("x-envoy-attempt-count");
/// A circuit breaker overflowed: Envoy's `reset reason: overflow`.
pub(super) const OVERFLOW: ErrorType = ErrorType::Custom("upstream overflow");

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
            ctx.outcome(
                Some(crate::telemetry::ResponseFlag::NoClusterFound),
                super::observe::details::CLUSTER_NOT_FOUND,
            );
            return self
                .local_reply(session, ctx, fwd.cluster_not_found, None, &[])
                .await;
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
            ctx.outcome(
                Some(crate::telemetry::ResponseFlag::NoHealthyUpstream),
                super::observe::details::NO_HEALTHY_UPSTREAM,
            );
            ctx.info.upstream = Some(cluster.def.telemetry.clone());
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
                // Queued for a connection: the request's last reading of the clock is old.
                ctx.clock = None;
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
        ctx.plain_peer = false;
        // Made in its box: built on the stack, it was copied twice (out of the match and into
        // the box), 672 bytes each, on every request.
        let mut peer = match (internal, tls) {
            (Some(p), _) => Box::new(p),
            (None, Some(tls)) => {
                // istio.alpn: the connection manager's list for the protocol spoken upstream.
                let alpn = ctx
                    .listener
                    .as_ref()
                    .and_then(|l| l.def.hcm())
                    .and_then(|h| h.alpn.as_ref())
                    .filter(|a| a.for_protocol(cluster.def.http2).is_some())
                    .map(|a| (a.clone(), cluster.def.http2));
                Box::new(upstream_tls::peer(tls, alpn, cluster.def.connect_timeout)?)
            }
            (None, None) => {
                ctx.plain_peer = true;
                match SPARE_PEERS.with(|k| k.try_borrow_mut().ok()?.pop()) {
                    Some(p) => refill_plain(p, addr),
                    None => super::in_box(|| HttpPeer::new(addr, false, String::new())),
                }
            }
        };
        peer.options.connection_timeout = Some(cluster.def.connect_timeout);
        // Approximates Envoy's timeouts: the upstream must answer within the per-try timeout
        // and within what is left of the route timeout.
        // The first attempt takes `arm_timers`' reading, made moments ago with nothing waited
        // on since; a retry (after its back-off) reads the clock.
        let now = match ctx.clock.take() {
            Some(t) if ctx.attempts == 1 => t,
            _ => Instant::now(),
        };
        ctx.peer_at = Some(now);
        ctx.clock = Some(now);
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
        Ok(peer)
    }
}

/// How many plain peers a worker thread keeps for its next requests: about as many as it has
/// requests in flight at once under load; more would be memory held for nothing.
const SPARE_PEERS_MAX: usize = 64;

thread_local! {
    /// Plain peers the own loop's requests on this thread are done with (`keep_plain`), for
    /// the next ones' `choose_peer` to refill (`refill_plain`): making a peer (672 bytes),
    /// boxing it and dropping it cost about 250 instructions a request. Kept per thread, not
    /// per connection: an idle connection holds none. Boxes in the list: the boxes are what
    /// is kept, as `choose_peer` hands pingora a box.
    #[allow(clippy::vec_box)]
    static SPARE_PEERS: std::cell::RefCell<Vec<Box<HttpPeer>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Keeps a plain peer (`Ctx::plain_peer`) a request is done with, for a next request.
pub(super) fn keep_plain(peer: Box<HttpPeer>) {
    SPARE_PEERS.with(|k| {
        if let Ok(mut k) = k.try_borrow_mut() {
            if k.len() < SPARE_PEERS_MAX {
                k.push(peer);
            }
        }
    });
}

/// A plain peer a request before made (`keep_plain`), as `HttpPeer::new(addr, false,
/// "")` makes one: of what `choose_peer` changes on a plain peer, the address and what it
/// sets only for some clusters (bind address, keepalive) are put back; the timeouts it sets
/// on every peer. A peer for HTTP/2 is never kept (`h1::proxy_to_upstream`).
fn refill_plain(mut p: Box<HttpPeer>, addr: SocketAddr) -> Box<HttpPeer> {
    p._address = pingora_core::protocols::l4::socket::SocketAddr::Inet(addr);
    p.group_key = 0;
    p.options.bind_to = None;
    p.options.tcp_keepalive = None;
    p
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
    if !ctx.hop_free {
        strip_request(upstream)?;
    }
    if ctx.close_upstream {
        // pingora keeps no connection whose request asked to close it.
        upstream.insert_header(http::header::CONNECTION, "close")?;
    }
    if ctx.hop_free {
        return Ok(());
    }
    // pingora strips more than Envoy does; put back what Envoy forwards: `te: trailers`,
    // `trailer` and `proxy-authorization` (unless `Connection` names them).
    let down = &session.req_header().headers;
    let restorable = [
        &http::header::TE,
        &http::header::TRAILER,
        &http::header::PROXY_AUTHORIZATION,
    ];
    // Most requests carry none of these: skip the Connection parsing for them.
    if super::downstream::present(down, &restorable).contains(&true) {
        let (nominated, te_trailers) = super::downstream::hop_by_hop(down);
        if te_trailers {
            upstream.set(&http::header::TE, "trailers")?;
        }
        for name in &restorable[1..] {
            if nominated.contains(name) {
                continue;
            }
            for v in down.get_all(*name) {
                upstream.add(name, v.clone())?;
            }
        }
    }
    Ok(())
}

/// What Envoy's connection manager adds to every response after `server` (its
/// `mutateResponseHeaders`): the request's `x-request-id` with
/// `always_set_request_id_in_response` or an `x-envoy-force-trace` (only an internal
/// client's is left on the request), then its `via`.
pub(super) fn manager_response(
    resp: &mut ResponseHeader,
    hcm: &crate::snapshot::listener::Hcm,
    req: &RequestHeader,
) -> Result<()> {
    // Without internal ranges no client is internal, and every x-envoy-force-trace was
    // removed: no need to look for one.
    if hcm.always_set_request_id_in_response
        || (!hcm.internal_ranges.is_empty()
            && super::downstream::has(&req.headers, header_name!("x-envoy-force-trace")))
    {
        if let Some(id) = req.headers.get(&super::downstream::X_REQUEST_ID) {
            resp.set(&super::downstream::X_REQUEST_ID, id.clone())?;
        }
    }
    if let Some(via) = &hcm.via {
        let present = super::downstream::has(&resp.headers, &http::header::VIA);
        let v = super::downstream::appended_via(&resp.headers, present, via);
        resp.set(&http::header::VIA, v)?;
    }
    Ok(())
}

/// The connection manager's `server` header as its `server_header_transformation` says, its
/// value made once per listener (a name that is not a valid header value is refused here,
/// per response, as before).
pub(super) fn server(
    resp: &mut ResponseHeader,
    hcm: &crate::snapshot::listener::Hcm,
) -> Result<()> {
    match hcm.server_transformation {
        Transformation::Overwrite => {}
        Transformation::PassThrough => return Ok(()),
        Transformation::AppendIfAbsent => {
            if super::downstream::has(&resp.headers, &http::header::SERVER) {
                return Ok(());
            }
        }
    }
    match &hcm.server_header {
        Some(v) => resp.set(&http::header::SERVER, v.clone()),
        None => resp.set(&http::header::SERVER, hcm.server_name.as_str()),
    }
}

/// The router's last request headers: the attempt count and the HTTP filters' own.
pub(super) fn attempt_headers(upstream: &mut RequestHeader, ctx: &Ctx) -> Result<()> {
    if ctx.filters.remove_accept_encoding {
        upstream.remove_header(&http::header::ACCEPT_ENCODING);
    }
    if ctx.attempt_count_to_upstream {
        upstream.set(
            &X_ATTEMPT_COUNT,
            super::head::int_value(u64::from(ctx.attempts)),
        )?;
    }
    for (k, v, append) in ctx.filters.upstream_request_headers() {
        if *append {
            upstream.add_name(k, v.clone())?;
        } else {
            upstream.set_name(k, v.clone())?;
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
        // A 101 the request did not ask for is relayed as Envoy relays it: its connection
        // fields stripped, dated.
        if resp.status == http::StatusCode::SWITCHING_PROTOCOLS {
            upgrade::dated(resp)?;
        }
    }
    if ctx.upgrade && !switching {
        // Envoy 1.40 relays a refused upgrade's head with an empty body and closes the
        // connection, whose remaining bytes were meant for the other protocol.
        upgrade::refused_head(resp)?;
        super::keepalive(session, ctx, None);
        ctx.discard_body = true;
    }
    if let Some(c) = &ctx.cluster {
        // Counted on headers, as Envoy does, so a scrape right after a response sees it.
        c.stats.record_code(resp.status.as_u16());
        ctx.code_recorded = true;
    }
    let hcm = ctx.listener.as_ref().and_then(|l| l.def.hcm());
    let mut served = false;
    // Envoy measures from the end of the request, which an upgrade has not reached; a
    // router that suppresses its headers sends none.
    let timed = !ctx.upgrade && !hcm.is_some_and(|h| h.suppress_envoy_headers);
    if let (Some(start), true) = (ctx.upstream_start, timed) {
        // The response's arrival as `upstream_head` read the clock for it.
        let answered = ctx
            .info
            .first_upstream_rx
            .unwrap_or_else(|| ctx.info.started.elapsed());
        let time = super::timeouts::millis_value(answered.saturating_sub(start));
        // With no route headers to go between them, an overwritten `server` is written with
        // it: one write to the head for both (each costs ~300 instructions besides the map's
        // insert).
        let overwrite = hcm
            .filter(|h| {
                ctx.resp_headers.is_none() && h.server_transformation == Transformation::Overwrite
            })
            .and_then(|h| h.server_header.clone());
        match overwrite {
            Some(name) => {
                resp.set_all([(&X_UPSTREAM_TIME, time), (&http::header::SERVER, name)])?;
                served = true;
            }
            None => resp.set(&X_UPSTREAM_TIME, time)?,
        }
    }
    // After x-envoy-upstream-service-time, before the connection manager's `server`.
    if let Some(rh) = &ctx.resp_headers {
        rh.apply(resp, session.req_header());
    }
    if let Some(h) = hcm {
        if !served {
            server(resp, h)?;
        }
        manager_response(resp, h, session.req_header())?;
    }
    if ctx.attempt_count_to_client && ctx.attempts > 0 {
        resp.set(
            &X_ATTEMPT_COUNT,
            super::head::int_value(u64::from(ctx.attempts)),
        )?;
    }
    filter_response_headers(resp, ctx)?;
    for c in ctx.set_cookies.drain(..) {
        resp.append_header(http::header::SET_COOKIE, c)?;
    }
    super::envoy_reason_phrase(session, resp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora_core::upstreams::peer::Peer;

    #[test]
    fn a_thread_keeps_at_most_its_share_of_plain_peers() {
        let addr: SocketAddr = "10.0.0.1:80".parse().expect("addr");
        let held = || SPARE_PEERS.with(|k| k.borrow().len());
        let before = held();
        for _ in 0..SPARE_PEERS_MAX + 5 {
            keep_plain(Box::new(HttpPeer::new(addr, false, String::new())));
        }
        assert_eq!(held(), SPARE_PEERS_MAX.max(before));
        // Another thread's list is its own.
        let other = std::thread::spawn(move || SPARE_PEERS.with(|k| k.borrow().len()))
            .join()
            .expect("thread");
        assert_eq!(other, 0);
    }

    #[test]
    fn a_refilled_peer_is_a_new_one() {
        let first: SocketAddr = "10.0.0.1:80".parse().expect("addr");
        let next: SocketAddr = "10.0.0.2:8080".parse().expect("addr");
        // What `choose_peer` sets on a plain peer for some clusters, and on every one.
        let mut p = Box::new(HttpPeer::new(first, false, String::new()));
        let mut bind = pingora_core::connectors::l4::BindTo::default();
        bind.addr = Some("10.9.9.9:0".parse().expect("addr"));
        p.options.bind_to = Some(bind);
        p.group_key = 42;
        p.options.tcp_keepalive = Some(tcp_keepalive(crate::snapshot::cluster::TcpKeepalive {
            probes: Some(3),
            time: Some(60),
            interval: None,
        }));
        p.options.connection_timeout = Some(std::time::Duration::from_secs(3));
        p.options.read_timeout = Some(std::time::Duration::from_secs(4));
        p.options.idle_timeout = Some(std::time::Duration::from_secs(5));
        let refilled = refill_plain(p, next);
        let fresh = HttpPeer::new(next, false, String::new());
        assert_eq!(refilled.address(), fresh.address());
        assert_eq!(refilled.reuse_hash(), fresh.reuse_hash());
        assert_eq!(refilled.group_key, 0);
        assert!(refilled.options.bind_to.is_none());
        assert!(refilled.options.tcp_keepalive.is_none());
        assert!(!refilled.is_tls());
        assert_eq!(refilled.sni, fresh.sni);
        // The rest of the options as a new peer's, but for the three timeouts `choose_peer`
        // sets on every peer (written over here to compare the rest).
        let mut opts = refilled.options.clone();
        opts.connection_timeout = None;
        opts.read_timeout = None;
        opts.idle_timeout = None;
        assert_eq!(format!("{opts:?}"), format!("{:?}", fresh.options));
    }
}
