//! Routing: the route a request matches (`router::route` on the connection's route table), the
//! weighted-cluster pick, what the route answers itself (direct responses, redirects,
//! `require_tls`), and what it asks of a forwarded request: path and host rewrites, its retry
//! policy and timeout, its own headers, the hash for ring hash and Maglev clusters.

use std::sync::Arc;

use bytes::Bytes;
use http::header::HeaderName;
use pingora_error::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;

use super::downstream::{
    authority, downstream_remote, hcm_strips_port, is_internal_request, local_port, raw_authority,
    split_port, X_FORWARDED_PROTO,
};
use super::head::SetHeader;
use super::{Ctx, Gateway};
use crate::router::RequestView;
use crate::snapshot::headers::{FormatCtx, HeaderOps, HeaderPlan};
use crate::snapshot::listener::Hcm;
use crate::snapshot::route::{Action, ClusterEntry, Forward, Redirect, Route, Target};
use crate::snapshot::ActiveChain;

static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static X_ORIGINAL_PATH: HeaderName = HeaderName::from_static("x-envoy-original-path");

/// The route's response header mutations (and its weighted-cluster entry's), applied to the
/// upstream response or to the route's own local replies.
pub(super) struct RespHeaders {
    entry: Option<Arc<HeaderOps>>,
    plan: Arc<HeaderPlan>,
    /// What the formatters read besides the request.
    fmt: FormatCtx,
}

impl RespHeaders {
    pub(super) fn apply(&self, resp: &mut ResponseHeader, req: &RequestHeader) {
        // Envoy: the weighted-cluster entry first, then the route chain.
        for ops in self.entry.iter().chain(self.plan.response.iter()) {
            ops.apply(resp, Some(req), &self.fmt);
        }
    }
}

/// What route matching and the HTTP filters see of the request; `host` is its authority as
/// the connection manager settled it (`downstream::authority`).
pub(super) fn request_view<'a>(req: &'a RequestHeader, host: &'a str) -> RequestView<'a> {
    RequestView {
        host,
        authority: raw_authority(req),
        path: req.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/"),
        method: req.method.as_str(),
        scheme: req.uri.scheme_str().unwrap_or("http"),
        headers: &req.headers,
    }
}

/// Envoy resolves the weighted cluster with the route, before any filter runs: the fault
/// filter's upstream_cluster and the entry's overrides see the pick.
pub(super) fn pick_cluster(route: Option<&Route>) -> Option<(&Arc<str>, Option<&ClusterEntry>)> {
    match route.map(|r| &r.action) {
        Some(Action::Forward(f)) => Some(match &f.target {
            Target::Cluster(c) => (c, None),
            Target::Weighted(w) => {
                let i = w.pick_index(fastrand::u64(..));
                (&w.clusters[i].0, w.entries.get(i))
            }
        }),
        _ => None,
    }
}

/// The route's response headers, kept in `ctx` for whatever answers the request, and the
/// formatter context its request headers use too. Only routes with custom headers need the
/// formatter context (XFF parsing included).
pub(super) fn response_headers(
    session: &Session,
    ctx: &mut Ctx,
    hcm: &Hcm,
    route: &Route,
    entry: Option<&ClusterEntry>,
) -> FormatCtx {
    let has_entry_ops =
        entry.is_some_and(|e| e.request_headers.is_some() || e.response_headers.is_some());
    let fmt = if has_entry_ops || !route.header_plan.is_empty() {
        let peer = session.client_addr().and_then(|a| a.as_inet()).copied();
        FormatCtx {
            remote: downstream_remote(&session.req_header().headers, peer, hcm),
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
    fmt
}

/// What a forwarding route decides for the upstream request: path and host rewrites, the
/// retry policy, the route timeout (`timeouts::arm_timers` refines it and sets its deadline),
/// attempt counts.
pub(super) fn forward(
    session: &Session,
    ctx: &mut Ctx,
    listener: &ActiveChain,
    route: &Route,
    fwd: &Forward,
) {
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
    ctx.forwarded_host = (fwd.append_x_forwarded_host && (rewritten.is_some() || ctx.auto_host))
        .then(|| raw_authority(session.req_header()).to_string())
        .filter(|h| !h.is_empty());
    ctx.host_rewrite = rewritten.or_else(|| {
        // The HCM's port stripping also changes the Host sent upstream (case kept).
        let raw = raw_authority(session.req_header());
        hcm_strips_port(raw, listener, local_port(session)).then(|| split_port(raw).0.to_string())
    });
    ctx.timeout = fwd.timeout;
    ctx.retry = fwd.retry.clone();
    ctx.attempt_count_to_upstream = fwd.attempt_count_to_upstream;
    ctx.attempt_count_to_client = fwd.attempt_count_to_client;
}

/// The route's custom request headers (weighted-cluster entry first), after the connection
/// manager's own, then `x-envoy-original-path` for a rewritten path: Envoy's order.
pub(super) fn request_headers(
    session: &mut Session,
    ctx: &Ctx,
    route: &Route,
    entry: Option<&ClusterEntry>,
    fmt: &FormatCtx,
) -> Result<()> {
    let suppressed = ctx
        .listener
        .as_ref()
        .and_then(|l| l.def.hcm())
        .is_some_and(|h| h.suppress_envoy_headers);
    let rewritten = ctx.prefix_rewrite.is_some() || ctx.path_rewrite.is_some();
    let original_path = (rewritten && !suppressed).then(|| {
        session
            .req_header()
            .uri
            .path_and_query()
            .map_or_else(|| "/".to_string(), |p| p.as_str().to_string())
    });
    let req = session.req_header_mut();
    for ops in entry
        .and_then(|e| e.request_headers.as_ref())
        .into_iter()
        .chain(route.header_plan.request.iter())
    {
        ops.apply(req, None, fmt);
    }
    if let Some(p) = original_path {
        req.set(&X_ORIGINAL_PATH, p)?;
    }
    Ok(())
}

/// The route's rewrites on the upstream request (each attempt's): path (prefix or regex), Host
/// (route, header, path regex, the endpoint's hostname, or the connection manager's port
/// stripping) and `x-forwarded-host`.
pub(super) fn apply_rewrites(upstream: &mut RequestHeader, ctx: &Ctx) -> Result<()> {
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
        upstream.set(&http::header::HOST, &**h)?;
        host_rewritten = true;
    } else if let Some(h) = &ctx.host_rewrite {
        upstream.set(&http::header::HOST, h.as_str())?;
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
            upstream.set(&X_FORWARDED_HOST, value)?;
        }
    }
    Ok(())
}

impl Gateway {
    /// A direct response; Envoy points 201 and 3xx ones at the request's own URL.
    pub(super) async fn direct_response(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        status: u16,
        body: Option<Bytes>,
    ) -> Result<bool> {
        let mut extra = Vec::new();
        if status == 201 || (300..400).contains(&status) {
            let req = session.req_header();
            let path = req.uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
            let scheme = req.uri.scheme_str().unwrap_or("http");
            let location = format!("{scheme}://{}{path}", raw_authority(req));
            extra.push((http::header::LOCATION, location));
        }
        self.local_reply(session, ctx, status, body, &extra).await
    }

    /// Whether the request's virtual host sends plain-text requests to https (`require_tls`),
    /// by `x-forwarded-proto` as Envoy judges it.
    pub(super) fn needs_tls(
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

    pub(super) async fn redirect(
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

/// `uri` with a new path and query. The scheme and authority stay: an HTTP/2 request carries
/// its authority only there, and an HTTP/2 upstream needs it.
fn with_path(uri: &http::Uri, path_and_query: &str) -> std::result::Result<http::Uri, http::Error> {
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(path_and_query.parse()?);
    Ok(http::Uri::from_parts(parts)?)
}

/// The request hash of the route's `hash_policy`, for a ring hash or Maglev cluster. A cookie
/// policy with a ttl whose cookie the request lacks generates one, as Envoy's router does, and
/// leaves its `set-cookie` in `set_cookies` for the response.
pub(super) fn request_hash(
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
