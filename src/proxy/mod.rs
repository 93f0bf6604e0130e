//! The request path: a pingora `ProxyHttp` that routes on one snapshot per request.

pub mod io;
pub mod listeners;

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
use crate::router::{self, RequestView};
use crate::snapshot::cluster::Cluster;
use crate::snapshot::route::{Action, Forward, Redirect, Target};
use crate::snapshot::ActiveListener;
use crate::State;

/// One per listener: the listener's name is how a request finds its config in the snapshot.
pub struct Gateway {
    pub listener: String,
    pub state: Arc<State>,
    pub hcm_stats: Arc<HcmStats>,
}

/// Per-request state: the snapshot loaded once, and what routing decided.
#[derive(Default)]
pub struct Ctx {
    listener: Option<Arc<ActiveListener>>,
    cluster: Option<Arc<Cluster>>,
    host_index: usize,
    peer: Option<SocketAddr>,
    prefix_rewrite: Option<(usize, String)>,
    host_rewrite: Option<String>,
    timeout: Option<std::time::Duration>,
    upstream_start: Option<Instant>,
    /// `set-cookie` values for cookies a hash policy generated, added to the upstream response.
    set_cookies: Vec<String>,
    /// The upstream's response code was counted when its headers arrived.
    code_recorded: bool,
    counted_active: bool,
}

static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_UPSTREAM_TIME: HeaderName = HeaderName::from_static("x-envoy-upstream-service-time");
static X_EXPECTED_TIMEOUT: HeaderName = HeaderName::from_static("x-envoy-expected-rq-timeout-ms");
static X_ORIGINAL_PATH: HeaderName = HeaderName::from_static("x-envoy-original-path");

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
    let connection_upgrade = req
        .headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"upgrade"));
    if let (true, true, Some(up)) = (
        h1,
        connection_upgrade,
        req.headers.get(http::header::UPGRADE),
    ) {
        // Upgrades (WebSocket) are refused until upgrade_configs are supported, as Envoy refuses
        // an upgrade no upgrade_config allows; an h2c upgrade offer is simply not taken. Without
        // `Connection: upgrade` the Upgrade header is only hop-by-hop and is dropped.
        if !up.as_bytes().eq_ignore_ascii_case(b"h2c") {
            return Some((403, "", true));
        }
    }
    None
}

static X_ENVOY_EXTERNAL_ADDRESS: HeaderName = HeaderName::from_static("x-envoy-external-address");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// A random UUID v4, as Envoy generates for `x-request-id`.
pub fn request_id() -> String {
    String::from_utf8_lossy(&request_id_bytes()).into_owned()
}

/// The same UUID as ASCII on the stack: the request path turns it into a header value
/// without formatting machinery.
fn request_id_bytes() -> [u8; 36] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let r = fastrand::u128(..);
    // Version 4 and the RFC 4122 variant.
    let r = (r & !(0xf << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
    let mut out = [b'-'; 36];
    let mut nibble = 0;
    for (i, slot) in out.iter_mut().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            continue;
        }
        *slot = HEX[((r >> (124 - 4 * nibble)) & 0xf) as usize];
        nibble += 1;
    }
    out
}

/// The request's authority, lowercased, with the port stripped as the HCM asks.
fn authority<'a>(req: &'a RequestHeader, listener: &ActiveListener) -> std::borrow::Cow<'a, str> {
    let raw = raw_authority(req);
    let host = match split_port(raw) {
        (host, Some(_)) if listener.routes.ignore_port || hcm_strips_port(raw, listener) => host,
        _ => raw,
    };
    // Most clients already send a lowercase host: borrow it then.
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        std::borrow::Cow::Owned(host.to_ascii_lowercase())
    } else {
        std::borrow::Cow::Borrowed(host)
    }
}

/// Whether the HCM's `strip_any_host_port` / `strip_matching_host_port` removes the port of
/// this authority: that changes the Host sent upstream too, unlike `ignore_port_in_host_matching`.
fn hcm_strips_port(raw: &str, listener: &ActiveListener) -> bool {
    let hcm = &listener.def.hcm;
    match split_port(raw).1 {
        Some(_) if hcm.strip_any_host_port => true,
        Some(port) => {
            hcm.strip_matching_host_port
                && port.parse::<u16>().ok() == Some(listener.def.addr.port())
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
    async fn local_reply(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        status: u16,
        body: Option<Bytes>,
        extra: &[(HeaderName, String)],
    ) -> Result<bool> {
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
        if let Some(l) = &ctx.listener {
            resp.insert_header(http::header::SERVER, l.def.hcm.server_name.as_str())?;
        }
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

/// The downstream address as Envoy's connection manager settles it: the peer with
/// `use_remote_address` (or the XFF entry the trusted hops point at), otherwise the last XFF
/// entry (skipping trusted hops) when it is an IP, else the peer.
fn downstream_ip(
    headers: &http::HeaderMap,
    peer: Option<std::net::IpAddr>,
    listener: &ActiveListener,
) -> Option<std::net::IpAddr> {
    let hcm = &listener.def.hcm;
    let skip = if hcm.use_remote_address {
        match hcm.xff_num_trusted_hops.checked_sub(1) {
            Some(s) => s as usize,
            None => return peer,
        }
    } else {
        hcm.xff_num_trusted_hops as usize
    };
    let xff: Vec<&str> = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect();
    xff.len()
        .checked_sub(skip + 1)
        .and_then(|i| xff.get(i))
        .and_then(|a| a.parse().ok())
        .or(peer)
}

/// The request hash of the route's `hash_policy`, for a ring hash or Maglev cluster. A cookie
/// policy with a ttl whose cookie the request lacks generates one, as Envoy's router does, and
/// leaves its `set-cookie` in `set_cookies` for the response.
fn request_hash(
    session: &Session,
    listener: &ActiveListener,
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
        source_ip: downstream_ip(&req.headers, peer.map(|a| a.ip()), listener),
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
        let snap = self.state.snapshot.load_full();
        let Some(listener) = snap.listeners.get(&self.listener).cloned() else {
            // The listener was removed while this connection was open.
            session.set_keepalive(None);
            return self.local_reply(session, ctx, 404, None, &[]).await;
        };
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
        let expect_continue = session
            .req_header()
            .headers
            .get(http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        let host = authority(session.req_header(), &listener);
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
        let Some((_vh, route)) = router::route(&listener.routes, &view) else {
            self.hcm_stats.no_route.fetch_add(1, Relaxed);
            return self.local_reply(session, ctx, 404, None, &[]).await;
        };
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
        let cluster_name = match &fwd.target {
            Target::Cluster(c) => c,
            Target::Weighted(w) => w.pick(fastrand::u64(..)),
        };
        let Some(cluster) = snap.clusters.get(cluster_name.as_ref()).cloned() else {
            // Envoy's cluster_not_found_response_code default.
            return self.local_reply(session, ctx, 503, None, &[]).await;
        };
        let picked = if cluster.hashes() {
            let hash = request_hash(session, &listener, fwd, &mut ctx.set_cookies);
            cluster.pick_hashed(hash)
        } else {
            cluster.pick()
        };
        let Some((idx, addr)) = picked else {
            // Envoy counts the code (upstream_rq_503), though no upstream request started.
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
        ctx.host_rewrite = fwd.host_rewrite.clone().or_else(|| {
            // The HCM's port stripping also changes the Host sent upstream (case kept).
            let raw = raw_authority(session.req_header());
            hcm_strips_port(raw, &listener).then(|| split_port(raw).0.to_string())
        });
        ctx.timeout = fwd.timeout;
        ctx.host_index = idx;
        ctx.peer = Some(addr);
        ctx.cluster = Some(cluster);

        // Request headers as Envoy's connection manager mutates them.
        let hcm = &listener.def.hcm;
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
        let original_path = ctx.prefix_rewrite.is_some().then(|| {
            session
                .req_header()
                .uri
                .path_and_query()
                .map_or_else(|| "/".to_string(), |p| p.as_str().to_string())
        });
        let req = session.req_header_mut();
        // Envoy trusts no client x-envoy-* control headers; by default (no internal address
        // ranges configured) every request counts as external.
        if req
            .headers
            .keys()
            .any(|k| k.as_str().starts_with("x-envoy-"))
        {
            for h in UNTRUSTED_ENVOY_HEADERS {
                req.remove_header(*h);
            }
        }
        // With use_remote_address every request is an edge request: Envoy 1.40 has no
        // internal address ranges unless internal_address_config names some.
        let edge = hcm.use_remote_address;
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
            req.insert_header(X_ENVOY_EXTERNAL_ADDRESS.clone(), client)?;
        }
        if hcm.use_remote_address || !req.headers.contains_key(&X_FORWARDED_PROTO) {
            req.insert_header(X_FORWARDED_PROTO.clone(), "http")?;
        }
        let regenerate = edge && !hcm.preserve_external_request_id;
        if hcm.generate_request_id && (regenerate || !req.headers.contains_key(&X_REQUEST_ID)) {
            let id = http::HeaderValue::from_bytes(&request_id_bytes())
                .or_err(ErrorType::InternalError, "request id")?;
            req.insert_header(X_REQUEST_ID.clone(), id)?;
        }
        match ctx.timeout {
            Some(t) => req.insert_header(X_EXPECTED_TIMEOUT.clone(), t.as_millis().to_string())?,
            None => {
                req.remove_header(&X_EXPECTED_TIMEOUT);
            }
        }
        if let Some(p) = original_path {
            req.insert_header(X_ORIGINAL_PATH.clone(), p)?;
        }
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        let (Some(addr), Some(cluster)) = (ctx.peer, &ctx.cluster) else {
            return Error::e_explain(ErrorType::InternalError, "no upstream chosen");
        };
        let mut peer = HttpPeer::new(addr, false, String::new());
        peer.options.connection_timeout = Some(cluster.def.connect_timeout);
        // Approximates Envoy's route timeout: the upstream must answer within it.
        peer.options.read_timeout = ctx.timeout;
        if cluster.def.http2 {
            peer.options.set_http_version(2, 2);
        }
        Ok(Box::new(peer))
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        strip_request(upstream)?;
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
        if let Some((len, rewrite)) = &ctx.prefix_rewrite {
            let pq = upstream
                .uri
                .path_and_query()
                .map(|p| p.as_str())
                .unwrap_or("/");
            let rest = pq.get(*len..).unwrap_or("");
            let new = format!("{rewrite}{rest}");
            let uri = http::Uri::builder()
                .path_and_query(new)
                .build()
                .map_err(|e| Error::because(ErrorType::InternalError, "prefix rewrite", e))?;
            upstream.set_uri(uri);
        }
        if let Some(h) = &ctx.host_rewrite {
            upstream.insert_header(http::header::HOST, h.as_str())?;
        }
        ctx.upstream_start = Some(Instant::now());
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        strip_response(resp);
        if let Some(c) = &ctx.cluster {
            // Counted on headers, as Envoy does, so a scrape right after a response sees it.
            c.stats.record_code(resp.status.as_u16());
            ctx.code_recorded = true;
        }
        if let Some(start) = ctx.upstream_start {
            resp.insert_header(
                X_UPSTREAM_TIME.clone(),
                start.elapsed().as_millis().to_string(),
            )?;
        }
        if let Some(l) = &ctx.listener {
            resp.insert_header(http::header::SERVER, l.def.hcm.server_name.as_str())?;
        }
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
        if let Some(c) = &ctx.cluster {
            c.stats.cx_connect_fail.fetch_add(1, Relaxed);
        }
        // Envoy retries only when a retry policy says so.
        e.set_retry(false);
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
            ConnectTimedout => (
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: connection timeout",
            ),
            ConnectRefused | ConnectNoRoute | ConnectError | ConnectProxyFailure => (
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure",
            ),
            SocketError | BindError => (
                503,
                "upstream connect error or disconnect/reset before headers. reset reason: local connection failure",
            ),
            ReadTimedout | WriteTimedout => {
                if let Some(c) = &ctx.cluster {
                    c.stats.rq_timeout.fetch_add(1, Relaxed);
                }
                (504, "upstream request timeout")
            }
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
            let body = (!body.is_empty()).then(|| Bytes::from_static(body.as_bytes()));
            if let Err(err) = self.local_reply(session, ctx, code, body, &[]).await {
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
        if let Some(c) = &ctx.cluster {
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
    fn request_ids_are_uuid_v4() {
        let id = request_id();
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
        assert!(matches!(&id[19..20], "8" | "9" | "a" | "b"));
        assert_ne!(id, request_id());
        for (i, c) in id.chars().enumerate() {
            if matches!(i, 8 | 13 | 18 | 23) {
                assert_eq!(c, '-', "{id}");
            } else {
                assert!(matches!(c, '0'..='9' | 'a'..='f'), "{id}");
            }
        }
        // Every hex digit position varies: no nibble is lost or repeated.
        let ids: Vec<String> = (0..64).map(|_| request_id()).collect();
        for i in (0..36).filter(|i| ![8, 13, 14, 18, 23].contains(i)) {
            let distinct: std::collections::BTreeSet<char> =
                ids.iter().filter_map(|id| id.chars().nth(i)).collect();
            assert!(distinct.len() > 1, "position {i} never changes");
        }
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
