//! HTTP/1.1 requests without a body, to an HTTP/1 upstream, proxied by a loop of Portico's own
//! over pingora's HTTP sessions and connector.
//!
//! pingora's `HttpProxy` runs every request as two tasks joined by two channels (a downstream
//! half and an upstream half), with a cache state machine and module hooks around them: a
//! request without a body, which is most of what a gateway sees, pays for that machinery
//! without using it. This loop calls the same `ProxyHttp` hooks of `Gateway`, in the same order
//! and with the same errors as `HttpProxy` (its `process_request`, `proxy_to_upstream` and
//! `proxy_to_h1_upstream`), one step after the other. Everything else (a request body, an
//! upgrade, `Expect`, HTTP/1.0, absolute-form targets, a route that can reach an HTTP/2
//! cluster, a pipelined request pingora already holds) stays with `HttpProxy`:
//! `h1_session::Plain::parse` decides on the head read ahead of the session, so either path
//! reads the request itself.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use futures::FutureExt;

use http::HeaderName;
use pingora_core::connectors::http::Connector;
use pingora_core::protocols::http::client::HttpSession as ClientSession;
use pingora_core::protocols::http::{HttpTask, ServerSession};
use pingora_core::protocols::Stream;
use pingora_core::upstreams::peer::{HttpPeer, Peer};
use pingora_error::{Error, ErrorType, Result};
use pingora_http::RequestHeader;
use pingora_proxy::{HttpProxy, ProxyHttp, Session};

use super::h1_session::{Conn, OwnAt, OwnSession, Plain, Vacant};
use super::h1_upstream::Upstream;
use super::io::Downstream;
use super::timeouts::LazyTimer;
use super::up_io::Io;
use super::{Ctx, Gateway};
use crate::snapshot::route::{Action, RouteTable, Target};

/// How far ahead of a session a request head is read to decide which loop serves it: past
/// this, pingora reads the rest (and refuses what it must).
pub(crate) const HEAD_LIMIT: usize = 16 * 1024;

/// The most upstream tasks written downstream at once: pingora's pipe between its two halves
/// holds four, and its downstream half writes what it finds there (and the task it waited for).
const BATCH: usize = 5;

/// One chain's loop on one worker.
pub(crate) struct Driver {
    pub gw: Gateway,
    pub app: Arc<HttpProxy<Gateway>>,
    /// New connections, and pooling for a peer that is not plain HTTP/1 (ALPN other than h1).
    connector: Connector,
    /// Idle HTTP/1 upstream connections of this loop.
    pool: Arc<super::pool::Pool>,
    max_retries: usize,
    /// Whether the chain's routes reach only HTTP/1 clusters, for the snapshot version held.
    plan_version: AtomicU64,
    plan_h1: AtomicBool,
    /// Whether the chain's connection manager keeps header case (the request head must keep
    /// it: pingora's session reads it so).
    plan_case: AtomicBool,
}

impl Driver {
    pub fn new(
        gw: Gateway,
        app: Arc<HttpProxy<Gateway>>,
        conf: &pingora_core::server::configuration::ServerConf,
    ) -> Driver {
        Driver {
            gw,
            app,
            // As `HttpProxy` builds its own: the same pool settings and timeouts.
            connector: Connector::new(Some(
                pingora_core::connectors::ConnectorOptions::from_server_conf(conf),
            )),
            pool: super::pool::Pool::new(conf.upstream_keepalive_pool_size),
            max_retries: conf.max_retries,
            plan_version: AtomicU64::new(u64::MAX),
            plan_h1: AtomicBool::new(false),
            plan_case: AtomicBool::new(false),
        }
    }

    /// Whether every cluster the chain's routes name speaks HTTP/1 in the serving snapshot
    /// (an HTTP/2 upstream stays with pingora's loop). Worked out once per snapshot.
    pub fn routes_h1(&self) -> bool {
        if !enabled() {
            return false;
        }
        let serving = self.gw.state.serving.load();
        let snap = &serving.snapshot;
        if self.plan_version.load(Relaxed) == snap.version {
            return self.plan_h1.load(Relaxed);
        }
        let chain = self.gw.chain.in_snapshot(snap);
        let h1 = upstreams_h1(&chain.routes, |name| {
            snap.clusters.get(name).is_none_or(|c| !c.def.http2)
        });
        let case = chain.def.hcm().is_some_and(|h| h.keep_header_case);
        self.plan_h1.store(h1, Relaxed);
        self.plan_case.store(case, Relaxed);
        self.plan_version.store(snap.version, Relaxed);
        h1
    }

    /// Whether a request's head goes to Portico's own HTTP/1 session (`h1_session`) rather
    /// than pingora's: unless the connection manager keeps header case (a head without case
    /// is what the own session reads), or `PORTICO_H1_SESSION=pingora` says not to. Read
    /// after `routes_h1` for the same snapshot.
    fn own_session(&self) -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let on = *ON
            .get_or_init(|| std::env::var("PORTICO_H1_SESSION").map_or(true, |v| v != "pingora"));
        on && !self.plan_case.load(Relaxed)
    }
}

/// `PORTICO_H1_LOOP=pingora` leaves every request to pingora's loop: an operator's way back
/// should this loop ever differ, and the tests' way to hold both loops to the same answers.
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PORTICO_H1_LOOP").map_or(true, |v| v != "pingora"))
}

/// Whether every cluster a route table can forward to passes `h1`.
fn upstreams_h1(routes: &RouteTable, h1: impl Fn(&str) -> bool) -> bool {
    routes
        .vhosts
        .iter()
        .flat_map(|v| &v.routes)
        .all(|r| match &r.action {
            Action::Forward(f) => match &f.target {
                Target::Cluster(c) => h1(c),
                Target::Weighted(w) => w.clusters.iter().all(|(c, _)| h1(c)),
            },
            _ => true,
        })
}

/// Whether a request head (complete, as `io::Downstream::read_head` found it) is one this loop
/// serves (`h1_session::Plain::parse`).
#[cfg(test)]
pub(crate) fn plain_request(head: &[u8]) -> bool {
    super::h1_session::plain(head).is_some()
}

/// What a connection's last request left on its session for the next one (pingora's
/// `HttpPersistentSettings`, read back once applied).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Kept {
    keepalive: Option<u64>,
    reuses: Option<u32>,
    pipelining: bool,
    /// When the last response ended, as the request's end read the clock (its
    /// `%DURATION%`): the keep-alive wait counts from there rather than from a reading of
    /// its own. None: from when the wait starts.
    ended: Option<std::time::Instant>,
}

impl Kept {
    pub fn of(h1: &pingora_core::protocols::http::v1::server::HttpSession) -> Kept {
        Kept {
            keepalive: h1.get_keepalive_timeout(),
            reuses: h1.get_keepalive_reuses_remaining(),
            pipelining: h1.pipelining_enabled(),
            ended: None,
        }
    }

    /// How long the connection may wait for its next request (None: no limit); None
    /// overall when it is not to be kept.
    pub fn idle(&self) -> Option<std::time::Duration> {
        self.keepalive
            .filter(|secs| *secs > 0)
            .map(std::time::Duration::from_secs)
    }

    /// When the connection's keep-alive wait ends, if it has a limit.
    pub fn idle_deadline(&self) -> Option<tokio::time::Instant> {
        let idle = self.idle()?;
        let from = match self.ended {
            Some(t) => tokio::time::Instant::from_std(t),
            None => tokio::time::Instant::now(),
        };
        Some(from + idle)
    }

    pub fn apply(self, s: &mut ServerSession) {
        s.set_keepalive(self.keepalive);
        s.set_keepalive_reuses_remaining(self.reuses);
        s.set_pipelining_enabled(self.pipelining);
    }
}

/// The connection after a request, for the next: bytes of that request already read are
/// back in front of it.
pub(crate) type Next = (Box<Downstream>, Kept);

/// One request, as `HttpProxy::process_new_http` serves it. `None`: the connection is done.
/// `plain`: the request's head, which `read_head` buffered on the connection; `read_timer`:
/// the connection's timer for upstream reads, lent to the request (`Ctx::read_timer`);
/// `spare`: what the connection's last request left for the next (`Spare`).
pub(crate) async fn process(
    d: &Driver,
    mut stream: Box<Downstream>,
    kept: Kept,
    told: bool,
    plain: &Plain,
    read_timer: &mut LazyTimer,
    spare: &mut Spare,
) -> Option<Next> {
    // The head goes into Portico's own session when it can (see `h1_session`), else pingora's
    // session reads it from the connection.
    let own = if d.own_session() {
        plain.take(&mut stream)
    } else {
        None
    };
    // What the request's hooks and its own session share, kept here to take the connection
    // back from it.
    let mut conn = None;
    let ended;
    // The session is handed back here rather than in each way out of `process_request`,
    // and the request's state lives in this block only: a future is as large as its largest
    // await, and pingora's `finish` (which `reuse` awaits) nested under the proxying steps,
    // next to the context, made this one, boxed per request, 12.6 KB.
    let s = {
        let mut ctx = d.gw.new_ctx();
        ctx.own_loop = true;
        ctx.read_timer = std::mem::take(read_timer);
        let s = match own {
            Some((req, raw)) => {
                let c = spare.conn(if told { None } else { plain.keepalive() });
                // Both made in their boxes (`in_box`), as each request makes them.
                let session =
                    super::in_box(|| OwnSession::new(stream, req, raw, c.clone(), kept.reuses));
                // pingora's proxy session is made only around an HTTP/1 session of its own;
                // the own one takes its place at once. Made once a connection (`Spare`).
                let mut s = spare.session.take().unwrap_or_else(|| {
                    super::in_box(|| {
                        Session::new_h1_with_modules(Box::new(Vacant), &d.app.downstream_modules)
                    })
                });
                ctx.own_at = OwnAt::of(&session);
                *s.downstream_session = ServerSession::new_custom(session);
                ctx.own = Some(c.clone());
                conn = Some(c);
                s
            }
            None => {
                let stream: Stream = stream;
                // Boxed: the session (several hundred bytes) moves through the steps below and
                // back out, a copy at each move; a box moves as a pointer.
                let mut s = Box::new(Session::new_h1_with_modules(
                    stream,
                    &d.app.downstream_modules,
                ));
                kept.apply(&mut s.downstream_session);
                // `handle_new_request`: the head is already buffered, so no shutdown wait is
                // needed.
                // Boxed, as `reuse` below: pingora's session's futures are large, and this
                // request's future is boxed (and moved) whole for each request.
                match Box::pin(s.downstream_session.read_request()).await {
                    Ok(true) => {}
                    Ok(false) => return None,
                    Err(mut e) => {
                        e.as_down();
                        if matches!(e.etype, ErrorType::InvalidHTTPHeader) {
                            if let Err(e) = s.downstream_session.respond_error(400).await {
                                tracing::debug!("failed to send error response to downstream: {e}");
                            }
                        }
                        s.downstream_session.shutdown().await;
                        return None;
                    }
                }
                if told {
                    s.set_keepalive(None);
                }
                s
            }
        };
        d.gw.state.stats.h1_loop_requests.fetch_add(1, Relaxed);
        let s = process_request(d, s, &mut ctx).await;
        *read_timer = std::mem::take(&mut ctx.read_timer);
        ended = ctx
            .info
            .last_downstream_tx
            .map(|since| ctx.info.started + since);
        s?
    };
    match conn {
        Some(c) => {
            let next = reuse_own(d, s, &c, kept, ended, spare).await;
            spare.conn = Some(c);
            next
        }
        None => Box::pin(reuse(s)).await,
    }
}

/// What a connection's requests its own session serves keep from one to the next, rather
/// than make for each.
///
/// `session`: pingora's proxy session. Making one costs its own HTTP/1 session, made only to
/// be replaced (the `Vacant` one), two allocations of pingora's and the moves, and dropping it
/// again about as much: about 1,000 instructions a request. What a request leaves on it is put
/// back as `Session::new` makes it (`vacate`); the fields only pingora's proxy loop writes,
/// which this loop never calls, stay as made. The one such field this loop can reach (the 101
/// `write_response_tasks` marks) belongs to a response after which the connection is not
/// kept, so its session is not either.
///
/// `conn`: what the request's hooks and its session share (`Conn`), made anew in the same
/// allocation once the last request's holders are gone.
#[derive(Default)]
pub(crate) struct Spare {
    session: Option<Box<Session>>,
    conn: Option<Arc<Conn>>,
}

impl Spare {
    fn conn(&mut self, keepalive: Option<u64>) -> Arc<Conn> {
        if let Some(mut c) = self.conn.take() {
            if let Some(fresh) = Arc::get_mut(&mut c) {
                *fresh = Conn::new(keepalive);
                return c;
            }
        }
        Arc::new(Conn::new(keepalive))
    }
}

/// The session back as `Session::new` makes it, its own session (the request's, dropped with
/// it: `OwnSession`'s drop hands the connection back) replaced by pingora's placeholder for a
/// custom session, `()`, whose box allocates nothing. None: it holds what a next request
/// must not inherit (a cache in use).
fn vacate(
    mut s: Box<Session>,
    modules: &pingora_core::modules::http::HttpModules,
) -> Option<Box<Session>> {
    *s.downstream_session = ServerSession::new_custom(Box::new(()));
    if s.cache.enabled() || s.subrequest_ctx.is_some() {
        return None;
    }
    s.upstream_compression =
        pingora_core::protocols::http::compression::ResponseCompressionCtx::new(0, false, false);
    s.ignore_downstream_range = false;
    s.upstream_headers_mutated_for_cache = false;
    s.subrequest_spawner = None;
    s.downstream_modules_ctx = modules.build_ctx();
    Some(s)
}

/// `HttpProxy::process_request` without a cache, subrequests or custom sessions: the session
/// when the connection is to be kept.
async fn process_request(d: &Driver, mut s: Box<Session>, ctx: &mut Ctx) -> Option<Box<Session>> {
    let gw = &d.gw;
    // `early_request_filter` and `proxy_upstream_filter` are pingora's defaults (nothing, and
    // go on) for the gateway: not called.
    let req = s.downstream_session.req_header_mut();
    if let Err(e) = s.downstream_modules_ctx.request_header_filter(req).await {
        return handle_error(d, s, ctx, e).await;
    }
    match gw.route_request(&mut s, ctx).await {
        Ok(true) => {
            gw.end_request(&mut s, None, ctx).await;
            return Some(s);
        }
        Ok(false) => {}
        Err(e) => return handle_error(d, s, ctx, e).await,
    }
    let mut retries = 0;
    let mut server_reuse = false;
    let mut proxy_error: Option<Box<Error>> = None;
    while retries < d.max_retries {
        retries += 1;
        let (reuse, e) = proxy_to_upstream(d, &mut s, ctx).await;
        server_reuse = reuse;
        match e {
            Some(error) => {
                let retry = error.retry();
                if retry
                    && !gw.suppress_proxy_warn_log(
                        &s,
                        ctx,
                        &error,
                        pingora_proxy::ProxyWarnLogContext::UpstreamRetry,
                    )
                {
                    tracing::warn!("Fail to proxy: {error}, tries: {retries}, retry: {retry}");
                }
                proxy_error = Some(error);
                if !retry {
                    break;
                }
            }
            None => {
                proxy_error = None;
                break;
            }
        }
    }
    if let Some(e) = proxy_error.as_ref() {
        let res = gw.fail_reply(&mut s, e, ctx).await;
        if !gw.suppress_error_log(&s, ctx, e) {
            tracing::error!(
                "Fail to proxy: {e}, status: {}, tries: {retries}, retry: false",
                res.error_code
            );
        }
    }
    finish(d, s, ctx, server_reuse, proxy_error).await
}

/// `HttpProxy::handle_error`: the session when the connection is to be kept.
async fn handle_error(
    d: &Driver,
    mut s: Box<Session>,
    ctx: &mut Ctx,
    e: Box<Error>,
) -> Option<Box<Session>> {
    let gw = &d.gw;
    let res = gw.fail_reply(&mut s, &e, ctx).await;
    if !gw.suppress_error_log(&s, ctx, &e) {
        tracing::error!("Fail to proxy: {e}, status: {}", res.error_code);
    }
    gw.end_request(&mut s, Some(&e), ctx).await;
    s.downstream_session.on_proxy_failure(e);
    res.can_reuse_downstream.then_some(s)
}

/// `HttpProxy::finish`: the session when the connection is to be kept.
async fn finish(
    d: &Driver,
    mut s: Box<Session>,
    ctx: &mut Ctx,
    reuse_downstream: bool,
    error: Option<Box<Error>>,
) -> Option<Box<Session>> {
    d.gw.end_request(&mut s, error.as_deref(), ctx).await;
    if let Some(e) = error {
        s.downstream_session.on_proxy_failure(e);
    }
    reuse_downstream.then_some(s)
}

/// pingora's `finish` of the downstream session and its `HttpPersistentSettings`, handed
/// back as the connection and what the next request inherits (one fewer reuse left).
async fn reuse(s: Box<Session>) -> Option<Next> {
    let ds = &s.downstream_session;
    let kept = Kept {
        keepalive: ds.get_keepalive(),
        reuses: ds
            .get_keepalive_reuses_remaining()
            .map(|r| r.saturating_sub(1)),
        pipelining: ds.pipelining_enabled(),
        ended: None,
    };
    // `finish` flushes the response, and shuts a connection that is not kept.
    let session: ServerSession = *s.downstream_session;
    let (stream, prefix) = session.finish().await.ok().flatten()?.into_parts();
    kept.keepalive?;
    let mut d = stream.into_any().downcast::<Downstream>().ok()?;
    if let Some(prefix) = prefix {
        d.unread(&prefix);
    }
    Some((d, kept))
}

/// `reuse` for Portico's own session: as pingora's `finish` of its own, the response's end
/// flushed, the connection shut unless it is kept, and then handed back by the session.
async fn reuse_own(
    d: &Driver,
    mut s: Box<Session>,
    conn: &Conn,
    kept: Kept,
    ended: Option<std::time::Instant>,
    spare: &mut Spare,
) -> Option<Next> {
    // Most responses were finished where the proxying ended; this call (a boxed future, as
    // each of the session's async methods) is for the others, an error's reply among them.
    if !conn.finished() {
        s.downstream_session.finish_body().await.ok()?;
    }
    if !super::h1_session::will_keepalive(conn, kept.reuses) {
        s.downstream_session.shutdown().await;
        return None;
    }
    spare.session = vacate(s, &d.app.downstream_modules);
    let d = conn.take()?;
    let kept = Kept {
        keepalive: conn.keepalive(),
        reuses: kept.reuses.map(|r| r.saturating_sub(1)),
        pipelining: true,
        ended,
    };
    Some((d, kept))
}

/// `HttpProxy::proxy_to_upstream` for an HTTP/1 upstream: (reuse the downstream, error).
async fn proxy_to_upstream(
    d: &Driver,
    s: &mut Session,
    ctx: &mut Ctx,
) -> (bool, Option<Box<Error>>) {
    let gw = &d.gw;
    let peer = match gw.choose_peer(s, ctx).await {
        Ok(p) => p,
        Err(e) => return (false, Some(e)),
    };
    // A plain HTTP/1 peer's idle connections are this loop's own (see `pool`).
    let own = peer
        .get_peer_options()
        .is_none_or(|o| matches!(o.alpn, pingora_core::protocols::ALPN::H1));
    // A plain peer's reuse hash is its address and group key (`pool::plain_key`).
    let plain = ctx.plain_peer && !ctx.upstream_h2;
    let key = if plain {
        super::pool::plain_key(peer.address(), peer.group_key)
    } else {
        peer.reuse_hash()
    };
    // The clock as `choose_peer` read it, moments ago.
    let chosen = ctx.peer_at.unwrap_or_else(std::time::Instant::now);
    let pooled = if own {
        d.pool.take(key, &*peer, chosen)
    } else {
        None
    };
    let got = match pooled {
        Some(stream) => {
            let mut up = Upstream::new(stream, &*peer);
            up.read_from(chosen);
            Ok((up, true))
        }
        // A plain peer for the own pool: connected here, the socket kept without pingora's
        // stream around it (`up_io`). Boxed, as the connector's future below.
        None if own && super::up_io::connects_itself(&peer) => {
            Box::pin(super::up_io::connect(&peer))
                .await
                .map(|io| (Upstream::new(io, &*peer), false))
        }
        // Boxed: the connector's future (a connect, maybe a TLS handshake) is 8.8 KB, and a
        // pooled connection, the usual case, should not carry that room in every request.
        None => match Box::pin(d.connector.get_http_session(&*peer)).await {
            // A connection for the own pool: the exchange reads the common response itself.
            Ok((ClientSession::H1(h1), reused)) if own => {
                Ok((Upstream::new(Io::Stream(h1.into_inner()), &*peer), reused))
            }
            Ok((ClientSession::H1(h1), reused)) => Ok((Upstream::Pingora(Box::new(h1)), reused)),
            Ok((other, _)) => {
                // `routes_h1` keeps HTTP/2 clusters on pingora's loop; a peer that still asks
                // for HTTP/2 is refused rather than spoken to half-way.
                drop(other);
                let e = Error::explain(
                    ErrorType::InternalError,
                    "an HTTP/2 upstream reached the HTTP/1 loop",
                );
                return (false, Some(e));
            }
            Err(e) => Err(e),
        },
    };
    match got {
        Ok((mut up, client_reused)) => {
            let (server_reused, client_reuse, error) =
                proxy_to_h1_upstream(d, s, &mut up, client_reused, &peer, ctx).await;
            if client_reuse && own {
                if let Some(stream) = up.reuse().await {
                    d.pool.put(stream, key, &*peer, peer.idle_timeout());
                }
            } else if let (true, Upstream::Pingora(h1)) = (client_reuse, up) {
                // Boxed as the connector's `get_http_session` is: the rare case's room.
                Box::pin(d.connector.release_http_session(
                    ClientSession::H1(*h1),
                    &*peer,
                    peer.idle_timeout(),
                ))
                .await;
            }
            let error = error.map(|e| gw.error_while_proxy(&peer, s, e, ctx, client_reused));
            if plain {
                super::upstream::keep_plain(peer);
            }
            (server_reused, error)
        }
        Err(mut e) => {
            e.as_up();
            let e = gw.fail_to_connect(s, &peer, ctx, e);
            (false, Some(e.into_up()))
        }
    }
}

/// `proxy_to_h1_upstream` and `proxy_1to1` for a request without a body: (reuse the
/// downstream, reuse the upstream, error).
async fn proxy_to_h1_upstream(
    d: &Driver,
    s: &mut Session,
    client: &mut Upstream,
    reused: bool,
    peer: &HttpPeer,
    ctx: &mut Ctx,
) -> (bool, bool, Option<Box<Error>>) {
    let gw = &d.gw;
    client.set_timeouts(peer.options.read_timeout, peer.options.write_timeout);
    client.set_keep_case(ctx.cluster.as_ref().is_some_and(|c| c.def.keep_header_case));
    // Portico's own session writes names lower case: the response needs no case of its own.
    client.set_response_case(ctx.own.is_none());
    let id = client.id();
    if let Err(e) = gw
        .upstream_connected(s, reused, peer, id, client.local_addr(), ctx)
        .await
    {
        return (false, false, Some(e));
    }

    // The upstream request: a copy of the client's head, edited, when anything edits it;
    // otherwise the head itself, written as it stands (the copy and its drop cost ~1,400
    // instructions a request, for a head most routes send unchanged).
    let written = if edits_request(s, ctx) {
        let mut req = super::head::clone_request(s.req_header());
        req.set_version(http::Version::HTTP_11);
        // pingora's default upstream request policy: hop-by-hop fields go
        // (`h1_session::Plain::parse` left nothing for a `Connection` header to name). None
        // found: Envoy's policy, applied after it (`upstream::hop_by_hop`), has nothing to
        // strip or put back either.
        ctx.hop_free = !strip_hop_by_hop(&mut req);
        if let Err(e) = gw.prepare_upstream_request(s, &mut req, ctx).await {
            return (false, true, Some(e));
        }
        if let Err(e) = upstream_authority(&mut req) {
            return (false, true, Some(e.into_in()));
        }
        s.upstream_compression.request_filter(&req);
        client.write_request_header(Box::new(req)).await
    } else {
        ctx.hop_free = true;
        #[cfg(debug_assertions)]
        unedited_as_edited(gw, s, ctx);
        gw.upstream_request_sent(ctx);
        let req = s.downstream_session.req_header();
        s.upstream_compression.request_filter(req);
        client.write_request(req).await
    };
    if let Err(e) = written {
        return (false, false, Some(e.into_up()));
    }

    // The request's (empty) body, as the downstream half hands it over.
    s.as_mut().enable_retry_buffering();
    let mut data = s.as_ref().get_retry_buffer();
    if let Err(e) = s
        .downstream_modules_ctx
        .request_body_filter(&mut data, true)
        .await
    {
        return (false, false, Some(e));
    }
    // The request has no body (`plain`): it was whole when its context began, after its
    // head was read (Envoy's codec marks such a request complete with its headers), so
    // `request_done` has no clock to read.
    ctx.info
        .last_downstream_rx
        .get_or_insert(std::time::Duration::ZERO);
    if let Err(e) = gw.request_body(s, &mut data, true, ctx).await {
        return (false, false, Some(e));
    }
    if let Some(b) = data.filter(|b| !b.is_empty()) {
        if let Err(e) = client.write_body(&b).await {
            return (false, false, Some(e.into_up()));
        }
    }
    if let Err(e) = client.finish_body().await {
        return (false, false, Some(e.into_up()));
    }

    // The request body's reader is set up before the client is watched, as pingora's loop
    // does by reading the (empty) body first: the watch below may read the first byte of a
    // next request and keeps it for that request in the reader's overread, which setting up
    // the reader later would overwrite (the byte was lost and the next request forwarded as
    // `ET /...`).
    s.downstream_session.is_body_done();
    let limits = super::response_limits(ctx);
    let at = ctx.own_at;
    // The response, while watching the client: one that hangs up ends the request. What the
    // upstream already sent goes out in one write, as pingora batches what its pipe holds.
    loop {
        // The response first (no draw for an order each poll): the client is watched while
        // it is not ready, and a write to a client gone fails anyway.
        let first = tokio::select! {
            biased;
            t = client.read_response_task(&mut ctx.read_timer, limits) => t,
            r = body_or_idle(&mut s.downstream_session, at) => match r {
                Err(e) => return (false, false, Some(e.into_down())),
                Ok(_) => continue,
            },
        };
        let mut batch = Vec::with_capacity(BATCH);
        let mut next = Some(first);
        while let Some(read) = next.take() {
            match read {
                Ok(t) => {
                    let end = t.is_end();
                    batch.push(t);
                    // Only what is already buffered or readable now (a read that would wait has
                    // taken nothing yet, so dropping it loses nothing), and no more than
                    // pingora's pipe holds: the client's pace bounds what is read ahead.
                    if !end && batch.len() < BATCH {
                        next = client
                            .read_response_task(&mut ctx.read_timer, limits)
                            .now_or_never();
                    }
                }
                Err(e) => batch.push(HttpTask::Failed(e.into_up())),
            }
        }
        let end = batch.last().is_some_and(HttpTask::is_end);
        // Filtered in place: each task is taken out, filtered and put back.
        for slot in batch.iter_mut() {
            let task = std::mem::replace(slot, HttpTask::Done);
            match response_task(s, task, ctx, gw).await {
                Ok(t) => *slot = t,
                Err(e) => return (false, false, Some(e)),
            }
        }
        match write_tasks(s, batch, at).await {
            Ok(done) if done || end => break,
            Ok(_) => {}
            Err(e) => return (false, false, Some(e)),
        }
    }
    let finished = match at.get(&mut s.downstream_session) {
        Some(own) => own.finish_body().await.map(|_| ()),
        None => s.as_mut().finish_body().await,
    };
    let reuse_downstream = match finished {
        Ok(()) => true,
        Err(e) => {
            tracing::error!("Error finish sending body to downstream: {e}");
            false
        }
    };
    (reuse_downstream, true, None)
}

/// pingora's `write_response_tasks`. Its pass over the tasks before they are written runs
/// the downstream modules (the gateway registers none: `init_downstream_modules`) and follows
/// an HTTP/1 upgrade (a 101 is refused when the client's request and the upstream request
/// disagree on asking for the switch; an upgraded body needs the 101 first). For a request
/// that asked for no upgrade, on a connection not upgraded, and a batch with neither a 101
/// head nor an upgraded body, that pass does nothing, and the tasks go to the session
/// directly, without its calls for each task.
async fn write_tasks(s: &mut Session, batch: Vec<HttpTask>, at: OwnAt) -> Result<bool> {
    let upgrade = s.downstream_session.is_upgrade_req()
        || s.downstream_session.was_upgraded()
        || batch.iter().any(|t| match t {
            HttpTask::Header(h, _) => h.status == http::StatusCode::SWITCHING_PROTOCOLS,
            HttpTask::UpgradedBody(..) => true,
            _ => false,
        });
    if upgrade {
        return s.write_response_tasks(batch).await;
    }
    match at.get(&mut s.downstream_session) {
        Some(own) => own.duplex_vec(batch).await,
        None => s.downstream_session.response_duplex_vec(batch).await,
    }
}

/// pingora's `read_body_or_idle` for a request without a body: the own session's called
/// directly (`OwnAt`).
async fn body_or_idle(s: &mut ServerSession, at: OwnAt) -> Result<Option<bytes::Bytes>> {
    match at.get(s) {
        Some(own) => own.body_or_idle().await,
        None => s.read_body_or_idle(true).await,
    }
}

/// `upstream_filter` then `h1_response_filter`, without a cache.
async fn response_task(
    s: &mut Session,
    mut task: HttpTask,
    ctx: &mut Ctx,
    gw: &Gateway,
) -> Result<HttpTask> {
    let delay = match &mut task {
        HttpTask::Header(header, _) => {
            gw.upstream_head(s, header, ctx).await?;
            None
        }
        HttpTask::Body(data, eos) | HttpTask::UpgradedBody(data, eos) => {
            gw.upstream_response_body_filter(s, data, *eos, ctx)?
        }
        HttpTask::Trailer(Some(trailers)) => {
            gw.upstream_response_trailer_filter(s, trailers, ctx)?;
            None
        }
        _ => None,
    };
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
    Ok(match task {
        HttpTask::Header(mut header, end) => {
            // pingora refuses a 101 only when the two sides disagree on the upgrade; neither
            // asked for one here, so a 101 is relayed as it relays it.
            // An HTTP/1.0-style response (no length) is made chunked so the connection stays.
            let no_body = s.req_header().method == http::Method::HEAD
                || matches!(header.status.as_u16(), 204 | 304);
            // Both framing fields in one scan of the names present (two lookups hash twice).
            let framed = || {
                super::downstream::present(
                    &header.headers,
                    &[
                        &http::header::TRANSFER_ENCODING,
                        &http::header::CONTENT_LENGTH,
                    ],
                )
                .contains(&true)
            };
            if !no_body && !header.status.is_informational() && !end && !framed() {
                header.set_version(http::Version::HTTP_11);
                header.insert_header(http::header::TRANSFER_ENCODING, "chunked")?;
            }
            gw.response_head(s, &mut header, ctx).await?;
            HttpTask::Header(header, end)
        }
        HttpTask::Body(mut data, end) => {
            if let Some(d) = gw.response_body_filter(s, &mut data, end, ctx)? {
                tokio::time::sleep(d).await;
            }
            HttpTask::Body(data, end)
        }
        other => other,
    })
}

/// The hop-by-hop fields pingora's default upstream request policy removes, only those present
/// (`downstream::present`); whether there were any.
fn strip_hop_by_hop(req: &mut RequestHeader) -> bool {
    let found = super::downstream::present(&req.headers, &HOP_BY_HOP);
    for (name, _) in HOP_BY_HOP.iter().zip(found).filter(|(_, p)| *p) {
        req.remove_header(*name);
    }
    found.contains(&true)
}

static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
static HTTP2_SETTINGS: HeaderName = HeaderName::from_static("http2-settings");

/// The hop-by-hop fields pingora's default upstream request policy removes.
static HOP_BY_HOP: [&HeaderName; 10] = [
    &KEEP_ALIVE,
    &PROXY_CONNECTION,
    &http::header::PROXY_AUTHENTICATE,
    &http::header::PROXY_AUTHORIZATION,
    &http::header::TE,
    &http::header::TRAILER,
    &http::header::TRANSFER_ENCODING,
    &http::header::CONNECTION,
    &http::header::UPGRADE,
    &HTTP2_SETTINGS,
];

/// Whether the upstream request differs from the client's head as the request's filters
/// left it: what `strip_hop_by_hop`, `prepare_upstream_request` and `upstream_authority`
/// would change (or refuse), judged without a copy to change. Conservative: a route that may
/// edit (a host rewrite, auto host) counts as editing. `unedited_as_edited` holds the two
/// ways to the same bytes in debug builds.
fn edits_request(s: &Session, ctx: &Ctx) -> bool {
    let req = s.req_header();
    let edits = ctx.upgrade
        || ctx.close_upstream
        || ctx.prefix_rewrite.is_some()
        || ctx.path_rewrite.is_some()
        || ctx.host_rewrite.is_some()
        || ctx.auto_host
        || ctx.route_host
        || ctx.attempt_count_to_upstream
        || ctx.filters.remove_accept_encoding
        || !ctx.filters.upstream_request_headers().is_empty()
        || ctx.mirror.is_some()
        || super::istio::propagates(ctx)
        || req.version != http::Version::HTTP_11
        // What `upstream_authority` reconciles: a target other than origin-form.
        || req.method == http::Method::CONNECT
        || req.uri.authority().is_some()
        || req.raw_path().first() != Some(&b'/');
    if edits {
        return true;
    }
    // One pass over the fields for a hop-by-hop name and the Host (`upstream_authority`
    // passes one without userinfo unchanged).
    let mut hosts = 0;
    for (k, v) in req.headers.iter() {
        if *k == http::header::HOST {
            hosts += 1;
            if hosts > 1 || v.as_bytes().contains(&b'@') {
                return true;
            }
        } else if HOP_LENGTHS & (1 << k.as_str().len().min(63)) != 0 && hop_by_hop(k.as_str()) {
            return true;
        }
    }
    hosts != 1
}

/// Whether `name` (lower case, as a `HeaderName` holds it) is one of `HOP_BY_HOP`: one
/// comparison of text, where comparing `HeaderName`s with the list's took about 165
/// instructions for a name of a listed length (`user-agent` has `connection`'s).
fn hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "connection"
            | "upgrade"
            | "http2-settings"
    )
}

/// The lengths of the `HOP_BY_HOP` names as a bit set: most names have a length none of them
/// has, and skip the comparisons.
const HOP_LENGTHS: u64 =
    1 << 2 | 1 << 7 | 1 << 10 | 1 << 14 | 1 << 16 | 1 << 17 | 1 << 18 | 1 << 19;

/// Debug builds: a head `edits_request` lets go uncopied is the one the copy and its edits
/// would have written.
#[cfg(debug_assertions)]
fn unedited_as_edited(gw: &Gateway, s: &Session, ctx: &Ctx) {
    let down = s.req_header();
    let mut req = super::head::clone_request(down);
    req.set_version(http::Version::HTTP_11);
    assert!(!strip_hop_by_hop(&mut req));
    let edited = super::upstream::hop_by_hop(s, &mut req, ctx)
        .and_then(|()| super::routing::apply_rewrites(&mut req, ctx))
        .and_then(|()| super::upstream::attempt_headers(&mut req, ctx))
        .and_then(|()| super::istio::upstream_request(&mut req, ctx, &gw.state))
        .and_then(|()| upstream_authority(&mut req));
    assert!(
        edited.is_ok(),
        "an unedited request head was refused: {edited:?}"
    );
    for keep_case in [false, true] {
        assert_eq!(
            super::head::request_wire(&req, keep_case),
            super::head::request_wire(down, keep_case),
            "an unedited request head differs from its edited copy"
        );
    }
}

/// `reconcile_authority` then pingora's `validate_request_authority`, as pingora's loop does
/// before it writes an upstream request. An origin-form target (what the own loop serves; a
/// path rewrite keeps the form) has no authority to reconcile the Host with or check it
/// against: what both leave to look at is the Host itself, done in one pass over it rather
/// than five lookups (~700 instructions a request).
fn upstream_authority(req: &mut RequestHeader) -> Result<()> {
    let origin_form = req.method != http::Method::CONNECT
        && req.uri.authority().is_none()
        && req.raw_path().first() == Some(&b'/');
    if !origin_form {
        reconcile_authority(req)?;
        return pingora_core::protocols::http::authority::validate_request_authority(req);
    }
    let invalid = |why: &'static str| Error::explain(ErrorType::InvalidHTTPHeader, why);
    let mut hosts = req.headers.get_all(http::header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        // `set_h1_host_from_authority`: no authority to take one from.
        (None, _) => req.insert_header(http::header::HOST, ""),
        (Some(h), _) if h.as_bytes().contains(&b'@') => Err(invalid("userinfo in Host header")),
        (Some(_), Some(_)) => Err(invalid("multiple Host header fields")),
        (Some(_), None) => Ok(()),
    }
}

/// pingora's `reconcile_upstream_authority` then `set_h1_host_from_authority` for a request
/// that came with a Host: a Host a filter chose becomes the target's authority.
fn reconcile_authority(req: &mut RequestHeader) -> Result<()> {
    use pingora_http::authority::{raw_target_authority, RawTargetAuthority};
    let invalid = |why: &'static str| Error::explain(ErrorType::InvalidHTTPHeader, why);
    if let Some(host) = req.headers.get(http::header::HOST) {
        if host.as_bytes().contains(&b'@') {
            return Err(invalid("userinfo in Host header"));
        }
        if let Some(authority) = req.uri.authority() {
            if !req.raw_path_is_utf8() {
                return Err(invalid(
                    "non-UTF-8 path cannot be reconciled with URI authority",
                ));
            }
            if host.as_bytes() != authority.as_str().as_bytes() {
                let authority = http::uri::Authority::try_from(host.as_bytes())
                    .map_err(|_| invalid("invalid Host override for authority"))?;
                let mut parts = http::uri::Parts::default();
                parts.scheme = req.uri.scheme().cloned();
                parts.authority = Some(authority);
                parts.path_and_query = req.uri.path_and_query().cloned();
                let uri = http::Uri::from_parts(parts)
                    .map_err(|_| invalid("failed to apply Host override to URI authority"))?;
                req.set_uri(uri);
            }
        } else if let RawTargetAuthority::Absolute {
            scheme,
            authority,
            path_and_query,
        } = raw_target_authority(req.raw_path())
        {
            if host.as_bytes() != authority {
                http::uri::Authority::try_from(host.as_bytes())
                    .map_err(|_| invalid("invalid Host override for authority"))?;
                let mut target = Vec::with_capacity(
                    scheme.len() + 3 + host.as_bytes().len() + path_and_query.len(),
                );
                target.extend_from_slice(scheme);
                target.extend_from_slice(b"://");
                target.extend_from_slice(host.as_bytes());
                target.extend_from_slice(path_and_query);
                req.set_raw_path(&target)?;
            }
        }
    }
    // The downstream request had a Host: one that matches the authority stays.
    let authority = req
        .uri
        .authority()
        .map(|a| a.as_str().as_bytes().to_vec())
        .or_else(|| {
            raw_target_authority(req.raw_path())
                .authority()
                .map(<[u8]>::to_vec)
        });
    let Some(authority) = authority else {
        if !req.headers.contains_key(http::header::HOST) {
            req.insert_header(http::header::HOST, "")?;
        }
        return Ok(());
    };
    if authority.contains(&b'@') {
        return Err(invalid("userinfo in request authority"));
    }
    let mut hosts = req.headers.get_all(http::header::HOST).iter();
    if hosts.next().is_some_and(|h| h.as_bytes() == authority) && hosts.next().is_none() {
        return Ok(());
    }
    let host = http::HeaderValue::from_bytes(&authority)
        .map_err(|_| invalid("invalid authority for Host header"))?;
    req.insert_header(http::header::HOST, host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keepalive_wait_counts_from_the_responses_end() {
        use std::time::Duration;
        let ended = std::time::Instant::now();
        let kept = |keepalive, ended| Kept {
            keepalive,
            reuses: None,
            pipelining: true,
            ended,
        };
        assert_eq!(
            kept(Some(60), Some(ended)).idle_deadline(),
            Some(tokio::time::Instant::from_std(ended) + Duration::from_secs(60))
        );
        // Without the end's reading, from the clock when the wait starts.
        let before = tokio::time::Instant::now();
        let at = kept(Some(5), None).idle_deadline().expect("a limit");
        assert!(at >= before + Duration::from_secs(5));
        assert!(at <= tokio::time::Instant::now() + Duration::from_secs(5));
        // pingora's 0 and none: no limit.
        assert_eq!(kept(Some(0), Some(ended)).idle_deadline(), None);
        assert_eq!(kept(None, Some(ended)).idle_deadline(), None);
    }

    #[test]
    fn a_kept_session_is_put_back_as_made_and_holds_no_request() {
        let modules = pingora_core::modules::http::HttpModules::new();
        let mut s = Box::new(Session::new_h1_with_modules(Box::new(Vacant), &modules));
        s.ignore_downstream_range = true;
        s.upstream_headers_mutated_for_cache = true;
        let kept = vacate(s, &modules).expect("kept");
        assert!(!kept.ignore_downstream_range);
        assert!(!kept.upstream_headers_mutated_for_cache);
        assert!(kept.subrequest_spawner.is_none());
        // The request's own session is gone: pingora's placeholder stands in.
        assert!(matches!(*kept.downstream_session, ServerSession::Custom(_)));
        // One with a subrequest's context is not kept.
        let mut s = kept;
        s.subrequest_ctx = Some(Box::new(pingora_proxy::subrequest::Ctx::builder().build()));
        assert!(vacate(s, &modules).is_none());
    }

    #[test]
    fn a_connections_conn_is_reset_in_place_once_no_one_else_holds_it() {
        let mut spare = Spare::default();
        let first = spare.conn(None);
        assert_eq!(first.keepalive(), None);
        let at = Arc::as_ptr(&first);
        spare.conn = Some(first);
        let second = spare.conn(Some(5));
        assert_eq!(Arc::as_ptr(&second), at, "the same allocation");
        assert_eq!(second.keepalive(), Some(5), "made anew");
        // Still held elsewhere (a request's hooks): a new one.
        let held = second.clone();
        spare.conn = Some(second);
        let third = spare.conn(None);
        assert_ne!(Arc::as_ptr(&third), Arc::as_ptr(&held));
    }

    #[test]
    fn hop_by_hop_names_the_list() {
        for h in HOP_BY_HOP {
            assert!(hop_by_hop(h.as_str()), "{h}");
        }
        for other in [
            "user-agent",
            "host",
            "te2",
            "t",
            "",
            "connectio",
            "connections",
            "keep-alivf",
            "x-forwarded-for",
            "upgrade-insecure-requests",
        ] {
            assert!(!hop_by_hop(other), "{other}");
        }
    }

    #[test]
    fn hop_lengths_are_the_hop_by_hop_names_lengths() {
        let lengths = HOP_BY_HOP
            .iter()
            .fold(0u64, |set, h| set | 1 << h.as_str().len());
        assert_eq!(HOP_LENGTHS, lengths);
    }

    #[test]
    fn plain_requests_are_bodiless_http11_origin_form_with_one_host() {
        let yes = [
            "GET / HTTP/1.1\r\nHost: a\r\n\r\n",
            "HEAD /x?y=1 HTTP/1.1\r\nhost: a\r\nuser-agent: t\r\n\r\n",
            "DELETE /x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nconnection: Close\r\n\r\n",
        ];
        for h in yes {
            assert!(plain_request(h.as_bytes()), "{h:?}");
        }
        let no = [
            "GET / HTTP/1.0\r\nHost: a\r\n\r\n",
            "GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
            "CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n",
            "OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc",
            "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: 0\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nConnection: x-secret\r\nx-secret: 1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\nclose: 1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\n",
            "GET / HTTP/1.1\r\nHost a\r\n\r\n",
        ];
        for h in no {
            assert!(!plain_request(h.as_bytes()), "{h:?}");
        }
    }

    #[test]
    fn more_headers_than_pingora_takes_stay_with_pingora() {
        let mut h = String::from("GET / HTTP/1.1\r\nHost: a\r\n");
        for i in 0..120 {
            h.push_str(&format!("x-{i}: v\r\n"));
        }
        h.push_str("\r\n");
        assert!(!plain_request(h.as_bytes()));
    }

    #[test]
    fn hop_by_hop_fields_go_as_removing_every_name_removes_them() {
        // The reference: pingora's policy, every name removed whether present or not (a
        // removal reorders what is left, so the order is compared too).
        let reference = |req: &mut RequestHeader| {
            for n in [
                "keep-alive",
                "proxy-connection",
                "proxy-authenticate",
                "proxy-authorization",
                "te",
                "trailer",
                "transfer-encoding",
                "connection",
                "upgrade",
                "http2-settings",
            ] {
                req.remove_header(n);
            }
        };
        let heads: [&[(&str, &str)]; 4] = [
            &[("Host", "a"), ("X-A", "1")],
            &[
                ("Host", "a"),
                ("Connection", "keep-alive"),
                ("X-A", "1"),
                ("Keep-Alive", "timeout=5"),
                ("TE", "trailers"),
                ("Proxy-Connection", "x"),
                ("X-B", "2"),
            ],
            &[
                ("Upgrade", "h2c"),
                ("Host", "a"),
                ("HTTP2-Settings", "x"),
                ("X-C", "3"),
            ],
            &[
                ("Trailer", "x"),
                ("trailer", "y"),
                ("Proxy-Authorization", "p"),
            ],
        ];
        for head in heads {
            let build = || {
                let mut req = RequestHeader::build("GET", b"/p", None).expect("req");
                for (n, v) in head {
                    req.append_header(n.to_string(), *v).expect("header");
                }
                req
            };
            let (mut ours, mut theirs) = (build(), build());
            strip_hop_by_hop(&mut ours);
            reference(&mut theirs);
            let wire = |r: &RequestHeader| {
                let mut w = Vec::new();
                r.header_to_h1_wire(&mut w);
                String::from_utf8(w).expect("utf8")
            };
            assert_eq!(wire(&ours), wire(&theirs), "{head:?}");
            assert!(!wire(&ours).to_ascii_lowercase().contains("connection"));
        }
    }

    #[test]
    fn the_origin_form_shortcut_answers_as_reconcile_then_validate() {
        let hosts: [&[&str]; 6] = [
            &[],
            &["a.example"],
            &["a.example:8080"],
            &["u@a.example"],
            &["a.example", "b.example"],
            &["u@a.example", "b.example"],
        ];
        let targets: [(&str, &[u8]); 5] = [
            ("GET", b"/"),
            ("GET", b"/p?q=1"),
            ("GET", b"//a.example/p"),
            ("GET", b"http://a.example/p"),
            ("CONNECT", b"a.example:443"),
        ];
        for (method, target) in targets {
            for hs in hosts {
                let build = || {
                    let mut req = RequestHeader::build(method, target, None).expect("req");
                    for h in hs {
                        req.append_header("host", *h).expect("host");
                    }
                    req
                };
                let (mut ours, mut theirs) = (build(), build());
                let got = upstream_authority(&mut ours).map_err(|e| e.to_string());
                let want = reconcile_authority(&mut theirs)
                    .and_then(|()| {
                        pingora_core::protocols::http::authority::validate_request_authority(
                            &theirs,
                        )
                    })
                    .map_err(|e| e.to_string());
                let what = format!("{method} {:?} {hs:?}", String::from_utf8_lossy(target));
                assert_eq!(got, want, "{what}");
                let wire = |r: &RequestHeader| {
                    let mut w = Vec::new();
                    r.header_to_h1_wire(&mut w);
                    (w, r.uri.to_string(), r.raw_path().to_vec())
                };
                assert_eq!(wire(&ours), wire(&theirs), "{what}");
            }
        }
    }

    #[test]
    fn a_filter_chosen_host_stays_and_a_removed_one_is_empty() {
        let mut req = RequestHeader::build("GET", b"/p", None).expect("req");
        req.insert_header("host", "other.example").expect("host");
        reconcile_authority(&mut req).expect("ok");
        assert_eq!(req.headers["host"], "other.example");
        req.remove_header("host");
        reconcile_authority(&mut req).expect("ok");
        assert_eq!(req.headers["host"], "");
        req.insert_header("host", "u@h").expect("host");
        assert!(reconcile_authority(&mut req).is_err());
    }
}
