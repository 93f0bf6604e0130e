//! Downstream: what Envoy's codec and HTTP connection manager do with a request before and
//! around routing. The codec's refusals (`reject`), header-name and path normalization,
//! `x-forwarded-proto`, `require_tls`, XFCC, upgrades, the authority and its port, and the
//! request headers the connection manager sets (XFF, internal and edge requests, request id);
//! also hop-by-hop headers both ways.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;

use bytes::Bytes;
use http::header::HeaderName;
use pingora_error::Result;
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;

use super::head::SetHeader;
use super::{client_cert, normalize, upgrade, Ctx, Gateway};
use crate::snapshot::listener::Hcm;
use crate::snapshot::route::Route;
use crate::snapshot::ActiveChain;

pub(super) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(super) static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_ENVOY_INTERNAL: HeaderName = HeaderName::from_static("x-envoy-internal");
static X_ENVOY_EXTERNAL_ADDRESS: HeaderName = HeaderName::from_static("x-envoy-external-address");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

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
/// Envoy's defaults, for a chain without a connection manager.
const MAX_REQUEST_HEADERS_BYTES: usize = 60 * 1024;
const MAX_REQUEST_HEADERS: usize = 100;

impl Gateway {
    /// Before routing, as Envoy's codec and connection manager: refusals, header names with
    /// underscores, path normalization, then the control headers an external client may not
    /// send, `x-forwarded-proto`, `x-envoy-internal`, `via`, `x-request-id`, `require_tls` and
    /// XFCC, which route matchers see. `Ok(true)`: answered locally.
    pub(super) async fn downstream_checks(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        listener: &ActiveChain,
    ) -> Result<bool> {
        if let pingora_core::protocols::http::ServerSession::H1(h1) = session.as_downstream_mut() {
            // Serve pipelined requests in order instead of dropping them, as Envoy does.
            h1.set_pipelining_enabled(true);
            // Envoy answers Expect: 100-continue itself; upstream 1xx are not relayed.
            h1.set_ignore_info_resp(true);
        }
        let host_from_target = match absolute_form(session) {
            Ok(taken) => taken,
            Err(()) => {
                super::keepalive(session, ctx, None);
                let body = Some(Bytes::from_static(b"Bad Request"));
                return self.local_reply(session, ctx, 400, body, &[]).await;
            }
        };
        if let Some((status, body, close)) = reject(session, listener.def.hcm(), host_from_target) {
            if close {
                super::keepalive(session, ctx, None);
            }
            let body = (!body.is_empty()).then(|| Bytes::from_static(body.as_bytes()));
            return self.local_reply(session, ctx, status, body, &[]).await;
        }
        let Some(hcm) = listener.def.hcm() else {
            return Ok(false);
        };
        if underscores_refused(session, hcm) {
            // Envoy's codec refuses the request and closes the connection.
            super::keepalive(session, ctx, None);
            return self.local_reply(session, ctx, 400, None, &[]).await;
        }
        // Envoy normalizes :path before any filter or route sees it.
        if hcm.path.is_active() {
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
        // x-forwarded-proto is settled before routing: `require_tls` and header matchers
        // read it.
        let client_ip = session
            .client_addr()
            .and_then(|a| a.as_inet())
            .map(|a| a.ip());
        let req = session.req_header_mut();
        // Looked for in one pass over the names present (`present`): a lookup hashes each
        // name, for headers most requests do not carry.
        let [has_proto, has_id, has_via] = present(
            &req.headers,
            &[&X_FORWARDED_PROTO, &X_REQUEST_ID, &http::header::VIA],
        );
        let proto = (hcm.use_remote_address || !has_proto).then(|| {
            // The chain terminating TLS is what makes the connection https, as in Envoy.
            // Static values: a `&str` would be checked and copied into a new value each
            // time.
            if listener.def.tls.is_some() {
                http::HeaderValue::from_static("https")
            } else {
                http::HeaderValue::from_static("http")
            }
        });
        // Envoy trusts x-envoy-* control headers only from internal clients (Envoy 1.40 has no
        // internal address ranges unless internal_address_config names some), and removes
        // them, the edge's and the route configuration's internal-only ones before routing:
        // a spoofed header neither picks a route nor reaches the upstream.
        let internal = is_internal_request(&req.headers, client_ip, hcm);
        if !internal {
            if req
                .headers
                .keys()
                .any(|k| k.as_str().starts_with("x-envoy-"))
            {
                for h in UNTRUSTED_ENVOY_HEADERS {
                    req.remove_header(*h);
                }
            }
            if hcm.use_remote_address {
                for h in EDGE_STRIPPED_HEADERS {
                    req.remove_header(*h);
                }
            }
            for h in &listener.routes.internal_only {
                req.remove_header(h);
            }
        }
        // x-request-id too, before any local reply: Envoy's access logs and traces name every
        // request by it, those the gateway answers itself included. All written in one go
        // (the head taken apart once).
        let via = hcm
            .via
            .as_ref()
            .map(|v| appended_via(&req.headers, has_via, v));
        let id = request_id(req, client_ip, hcm, has_id)?;
        // In Envoy's order: x-forwarded-proto, x-envoy-internal, via, x-request-id.
        let internal = internal.then(|| http::HeaderValue::from_static("true"));
        req.set_all(
            [
                proto.map(|v| (&X_FORWARDED_PROTO, v)),
                internal.map(|v| (&X_ENVOY_INTERNAL, v)),
                via.map(|v| (&http::header::VIA, v)),
                id.map(|v| (&X_REQUEST_ID, v)),
            ]
            .into_iter()
            .flatten(),
        )?;
        if listener.routes.any_require_tls && self.needs_tls(session, listener, hcm) {
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
        // Envoy's connection manager settles x-forwarded-client-cert before routing, so route
        // matchers see what the upstream will.
        use crate::snapshot::listener::ForwardClientCert as F;
        // Only the modes that keep or write the header look at the certificate.
        let peer = match hcm.xfcc.mode {
            F::Sanitize | F::AlwaysForwardOnly => None,
            _ => client_cert::of(session.digest()),
        };
        client_cert::mutate(session.req_header_mut(), &hcm.xfcc, peer.as_deref())?;
        Ok(false)
    }

    /// Envoy decides an upgrade when it builds the filter chain, once the route is known and
    /// before any filter runs. False: refused, a bare 403 on a connection that then closes,
    /// since the bytes after the request belong to the other protocol.
    pub(super) fn admit_upgrade(
        &self,
        session: &Session,
        ctx: &mut Ctx,
        hcm: &Hcm,
        route: Option<&Route>,
    ) -> bool {
        // The own loop serves no head with an `Upgrade` (`h1_session::Plain::parse`).
        if ctx.own_loop {
            return true;
        }
        let Some(up) = upgrade::requested(session) else {
            return true;
        };
        if !upgrade::permitted(&hcm.upgrades, route, up) {
            self.hcm_stats.ws_on_non_ws_route.fetch_add(1, Relaxed);
            return false;
        }
        ctx.upgrade = true;
        self.hcm_stats.upgrades_total.fetch_add(1, Relaxed);
        self.hcm_stats.upgrades_active.fetch_add(1, Relaxed);
        true
    }
}

/// `headers_with_underscores_action`: whether the request is refused; under `DROP_HEADER` the
/// names with underscores are removed here.
fn underscores_refused(session: &mut Session, hcm: &Hcm) -> bool {
    use crate::snapshot::listener::Underscores;
    if hcm.underscores == Underscores::Allow {
        return false;
    }
    let req = session.req_header();
    if !req.headers.keys().any(|k| k.as_str().contains('_')) {
        return false;
    }
    if hcm.underscores == Underscores::Reject {
        return true;
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
    false
}

/// Whether the request asks for `100 Continue`, which the connection manager sends itself once
/// the request is routed upstream.
pub(super) fn expects_continue(req: &RequestHeader) -> bool {
    req.headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// The rest of what Envoy's connection manager does to a request going upstream: `100
/// Continue`, XFF and `x-envoy-external-address`.
pub(super) async fn request_headers(
    session: &mut Session,
    hcm: &Hcm,
    expect_continue: bool,
) -> Result<()> {
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
    let req = session.req_header_mut();
    // The control headers an external client may not send went before routing
    // (`downstream_checks`); that check settles the same way now, as XFF is not changed yet.
    let edge = hcm.use_remote_address && !is_internal_request(&req.headers, client_ip, hcm);
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
            req.set(&X_FORWARDED_FOR, value)?;
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
            req.set(&X_ENVOY_EXTERNAL_ADDRESS, client)?;
        }
    }
    Ok(())
}

/// Envoy's `x-request-id`, the value to set if any: generated when missing, and for an edge
/// request (from outside, with `use_remote_address`) unless `preserve_external_request_id`.
fn request_id(
    req: &RequestHeader,
    client_ip: Option<std::net::IpAddr>,
    hcm: &Hcm,
    has_id: bool,
) -> Result<Option<http::HeaderValue>> {
    if !hcm.generate_request_id {
        return Ok(None);
    }
    let edge = hcm.use_remote_address && !is_internal_request(&req.headers, client_ip, hcm);
    let regenerate = edge && !hcm.preserve_external_request_id;
    if regenerate || !has_id {
        return Ok(Some(uuid_value(crate::uuid::v4_bytes())));
    }
    Ok(None)
}

/// A UUID's text as a header value, without `from_bytes`'s check of every byte (about 140
/// instructions a request): the text is hex digits and hyphens (`uuid::v4_bytes`), which a
/// header value may hold.
fn uuid_value(text: [u8; 36]) -> http::HeaderValue {
    debug_assert!(text.iter().all(|b| b.is_ascii_hexdigit() || *b == b'-'));
    super::head::parsed_value(bytes::Bytes::copy_from_slice(&text))
}

/// An HTTP/1 request target in absolute form (`GET http://host/path`, RFC 9112 3.2.2), as
/// Envoy's codec takes it: the target's authority (less any userinfo) replaces Host, its path
/// (`/` when it has none) becomes the target. Only http and https, with an authority: anything
/// else is refused (`Err`). Whether the target was in absolute form (its authority now the
/// Host).
fn absolute_form(session: &mut Session) -> std::result::Result<bool, ()> {
    if !super::downstream_h1(session) {
        return Ok(false);
    }
    let req = session.req_header();
    if req.method == http::Method::CONNECT {
        return Ok(false);
    }
    let raw = req.raw_path();
    let Some(colon) = raw.iter().position(|b| *b == b':') else {
        return Ok(false);
    };
    let (scheme, rest) = raw.split_at(colon);
    let Some(rest) = rest.strip_prefix(b"://") else {
        return Ok(false);
    };
    if scheme.is_empty()
        || !scheme
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(b))
    {
        return Ok(false);
    }
    if !scheme.eq_ignore_ascii_case(b"http") && !scheme.eq_ignore_ascii_case(b"https") {
        return Err(());
    }
    // Envoy's codec ends the authority at the first '/' only (`http://a?q` names host `a?q`).
    let end = rest.iter().position(|b| *b == b'/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    let authority = match authority.iter().rposition(|b| *b == b'@') {
        Some(at) => &authority[at + 1..],
        None => authority,
    };
    if authority.is_empty() {
        return Err(());
    }
    let target: Vec<u8> = if path.is_empty() {
        b"/".to_vec()
    } else {
        path.to_vec()
    };
    let host = http::HeaderValue::from_bytes(authority).map_err(|_| ())?;
    let req = session.req_header_mut();
    req.set_raw_path(&target).map_err(|_| ())?;
    req.insert_header(http::header::HOST, host)
        .map_err(|_| ())?;
    Ok(true)
}

/// Requests Envoy's codec refuses before routing: (status, body, close the connection).
/// `host_from_target`: the Host is an absolute-form target's authority (`absolute_form`).
fn reject(
    session: &Session,
    hcm: Option<&crate::snapshot::listener::Hcm>,
    host_from_target: bool,
) -> Option<(u16, &'static str, bool)> {
    let req = session.req_header();
    let h1 = super::downstream_h1(session);
    // Envoy's HTTP/1 codec reads the method first and refuses one it does not know, before
    // it reads the version.
    if h1 && !hcm.is_some_and(|h| h.allow_custom_methods) && !known_method(&req.method) {
        return Some((400, "Bad Request", true));
    }
    if h1 && req.version == http::Version::HTTP_10 {
        return Some((426, "Upgrade Required", true));
    }
    // Before the fragment check: such a target was marked with `#` (`h1_session`).
    if refused_target(session) {
        return Some((400, "Bad Request", true));
    }
    if has_fragment(session) {
        return Some((400, "", true));
    }
    // One pass over the headers for every check below that reads them (each lookup by name
    // hashes it).
    let mut size = req.raw_path().len();
    let (mut host, mut lengths, mut length_digits) = (None, 0usize, true);
    let (mut codings, mut chunked) = (0usize, false);
    for (k, v) in req.headers.iter() {
        size += k.as_str().len() + v.len();
        if *k == http::header::HOST {
            host = host.or(Some(v));
        } else if *k == http::header::CONTENT_LENGTH {
            if lengths == 0 {
                length_digits = !v.is_empty() && v.as_bytes().iter().all(u8::is_ascii_digit);
            }
            lengths += 1;
        } else if *k == http::header::TRANSFER_ENCODING {
            if codings == 0 {
                chunked = v.as_bytes().eq_ignore_ascii_case(b"chunked");
            }
            codings += 1;
        }
    }
    let (max_bytes, max_count) = hcm
        .map_or((MAX_REQUEST_HEADERS_BYTES, MAX_REQUEST_HEADERS), |h| {
            (h.max_request_headers_bytes, h.max_headers_count)
        });
    if size > max_bytes || req.headers.len() > max_count {
        return Some((431, "Request Header Fields Too Large", true));
    }
    if req.method.as_str().bytes().any(|b| b.is_ascii_lowercase()) {
        return Some((400, "Bad Request", true));
    }
    if h1 && host.is_none() && req.uri.authority().is_none() {
        return Some((400, "", true));
    }
    // Envoy checks the characters of the Host a client sent (one that is not text is
    // refused too); a target's authority (absolute-form, HTTP/2's) is its parser's, which
    // takes `example.com?q` as one (`edge_absolute_form`).
    let authority_ok = match (host, req.uri.authority()) {
        (Some(_), _) if host_from_target => true,
        (Some(h), _) => authority_chars_valid(h.as_bytes()),
        (None, Some(a)) => !a.as_str().bytes().any(|b| b <= b' ' || b == 0x7f),
        (None, None) => true,
    };
    if !authority_ok {
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
    // Content-Length must be digits only: a list (`5, 5`) or a sign is refused as Envoy's
    // codec refuses it, so no upstream parser reads it differently.
    if h1 && lengths > 0 && (!length_digits || lengths > 1) {
        return Some((400, "Bad Request", true));
    }
    if codings > 0 {
        // One coding, chunked, once: anything else (`chunked, chunked` in two headers
        // included) is Envoy's 501.
        if !chunked || codings > 1 {
            return Some((501, "Not Implemented", true));
        }
        // The parser drops Content-Length next to chunked; the raw head still shows both.
        if lengths > 0 || raw_head_has(session, b"content-length:") {
            return Some((400, "Bad Request", true));
        }
    }
    // Upgrades are decided after routing (`upgrade::permitted`): the route has a say.
    None
}

/// Envoy's check of an authority's characters (`HeaderUtility::authorityIsValid`, nghttp2's
/// `check_authority`): RFC 3986's for a host name, an IP literal and a port, `@` and `%`
/// among them; anything else (a space, `/`, `?`, `#`, `"`, `\`, a byte that is not ASCII)
/// is answered 400.
fn authority_chars_valid(authority: &[u8]) -> bool {
    const VALID: [bool; 256] = {
        let mut t = [false; 256];
        let extra = b"-._~!$&'()*+,;=:@[]%";
        let mut b = 0;
        while b < 256 {
            let c = b as u8;
            t[b] = c.is_ascii_alphanumeric();
            b += 1;
        }
        let mut i = 0;
        while i < extra.len() {
            t[extra[i] as usize] = true;
            i += 1;
        }
        t
    };
    authority.iter().all(|b| VALID[usize::from(*b)])
}

/// Whether Envoy's HTTP/1 codec takes the method without `allow_custom_methods`: the methods
/// of http-parser's list, as its balsa parser keeps them (`MSEARCH` without the dash; no
/// lower case).
pub(super) fn known_method(method: &http::Method) -> bool {
    use http::Method as M;
    const OTHERS: [&str; 25] = [
        "ACL",
        "BIND",
        "CHECKOUT",
        "COPY",
        "LINK",
        "LOCK",
        "MERGE",
        "MKACTIVITY",
        "MKCALENDAR",
        "MKCOL",
        "MOVE",
        "MSEARCH",
        "NOTIFY",
        "PROPFIND",
        "PROPPATCH",
        "PURGE",
        "REBIND",
        "REPORT",
        "SEARCH",
        "SOURCE",
        "SUBSCRIBE",
        "UNBIND",
        "UNLINK",
        "UNLOCK",
        "UNSUBSCRIBE",
    ];
    // The nine the `http` crate knows are compared without their text.
    [
        M::GET,
        M::POST,
        M::PUT,
        M::DELETE,
        M::HEAD,
        M::OPTIONS,
        M::CONNECT,
        M::PATCH,
        M::TRACE,
    ]
    .contains(method)
        || OTHERS.contains(&method.as_str())
}

/// Replaces the request's path and query, keeping its scheme and authority (HTTP/2).
fn set_path(req: &mut RequestHeader, path: &str) -> std::result::Result<(), http::Error> {
    let mut parts = req.uri.clone().into_parts();
    parts.path_and_query = Some(http::uri::PathAndQuery::try_from(path)?);
    req.set_uri(http::Uri::from_parts(parts)?);
    Ok(())
}

/// The request's authority, lowercased, with the port stripped as the HCM asks.
pub(super) fn authority<'a>(
    session: &'a Session,
    listener: &ActiveChain,
) -> std::borrow::Cow<'a, str> {
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
pub(super) fn local_port(session: &Session) -> Option<u16> {
    session
        .server_addr()
        .and_then(|a| a.as_inet())
        .map(|a| a.port())
}

/// Whether the HCM's `strip_any_host_port` / `strip_matching_host_port` removes the port of
/// this authority: that changes the Host sent upstream too, unlike `ignore_port_in_host_matching`.
pub(super) fn hcm_strips_port(raw: &str, listener: &ActiveChain, local_port: Option<u16>) -> bool {
    let Some(hcm) = listener.def.hcm() else {
        return false;
    };
    // Most connection managers strip no port: no need to find one.
    if !hcm.strip_any_host_port && !hcm.strip_matching_host_port {
        return false;
    }
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
pub(super) fn hop_by_hop(headers: &http::HeaderMap) -> (Vec<HeaderName>, bool) {
    let hop = [
        &http::header::CONNECTION,
        &KEEP_ALIVE,
        &PROXY_CONNECTION,
        &http::header::UPGRADE,
        &http::header::TE,
    ];
    if !present(headers, &hop).contains(&true) {
        return (Vec::new(), false);
    }
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

pub(super) fn strip_request(req: &mut RequestHeader) -> Result<()> {
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
pub(super) fn strip_response(resp: &mut ResponseHeader) {
    let hop = [
        &http::header::CONNECTION,
        &KEEP_ALIVE,
        &PROXY_CONNECTION,
        &http::header::UPGRADE,
    ];
    for (h, _) in hop
        .iter()
        .zip(present(&resp.headers, &hop))
        .filter(|(_, p)| *p)
    {
        resp.remove_header(*h);
    }
}

/// The connection manager's `via` appended to a message's: Envoy joins the values it
/// received with `,` (one field, as its codec merges a repeated `via`) and appends its own
/// after `, `.
pub(super) fn appended_via(
    headers: &http::HeaderMap,
    present: bool,
    via: &http::HeaderValue,
) -> http::HeaderValue {
    if !present {
        return via.clone();
    }
    let mut joined = Vec::with_capacity(64);
    for v in headers.get_all(http::header::VIA) {
        if !joined.is_empty() {
            joined.push(b',');
        }
        joined.extend_from_slice(v.as_bytes());
    }
    if !joined.is_empty() {
        joined.extend_from_slice(b", ");
    }
    joined.extend_from_slice(via.as_bytes());
    // Values that were valid joined by `,` and a space are valid.
    http::HeaderValue::from_bytes(&joined).unwrap_or_else(|_| via.clone())
}

/// Whether `name` is among the headers (`present` for one name): cheaper than a lookup, which
/// hashes the name, for a name few messages carry.
pub(super) fn has<T>(headers: &http::HeaderMap<T>, name: &HeaderName) -> bool {
    present(headers, &[name])[0]
}

/// Which of `names` are among the headers, in one pass over the (few) names present: most
/// messages carry none of the names a strip looks for, and a removal hashes its name in both
/// of pingora's maps whether present or not. Removing only those present, in the order of
/// `names`, leaves the same headers in the same order as removing every name (a removal of
/// an absent name changes nothing).
pub(super) fn present<T, const N: usize>(
    headers: &http::HeaderMap<T>,
    names: &[&HeaderName; N],
) -> [bool; N] {
    let mut found = [false; N];
    // A few names are compared with each name present as they are: a standard name against a
    // custom one differs by its kind, two custom ones by their lengths first, without a look
    // at the text (cheaper than the bit set below, which reads each name's text for its
    // length).
    if N <= 4 {
        for k in headers.keys() {
            for (f, h) in found.iter_mut().zip(names) {
                *f |= *h == k;
            }
        }
        return found;
    }
    // The lengths of `names` as a bit set: most names present have a length none of `names`
    // has, and skip the comparisons with each of them.
    let bit = |n: &HeaderName| 1u64 << n.as_str().len().min(63);
    let lengths = names.iter().fold(0u64, |set, h| set | bit(h));
    for k in headers.keys() {
        if lengths & bit(k) == 0 {
            continue;
        }
        if let Some(i) = names.iter().position(|h| *h == k) {
            found[i] = true;
        }
    }
    found
}

/// Whether the raw HTTP/1 request head has a header line starting with `name` (lowercase,
/// with its colon), whatever the parser kept of it.
fn raw_head_has(session: &Session, name: &[u8]) -> bool {
    super::raw_h1_head(session).is_some_and(|raw| {
        raw.split(|b| *b == b'\n')
            .skip(1)
            .any(|line| line.len() >= name.len() && line[..name.len()].eq_ignore_ascii_case(name))
    })
}

/// Whether the HTTP/1 request's target held bytes Envoy's codec refuses
/// (`h1_session::mark_refused_target`).
fn refused_target(session: &Session) -> bool {
    match session.as_downstream() {
        pingora_core::protocols::http::ServerSession::H1(h1) => h1
            .stream()
            .as_any()
            .downcast_ref::<super::io::Downstream>()
            .is_some_and(super::io::Downstream::refused_target),
        _ => false,
    }
}

/// Whether the HTTP/1 request's target carries a `#fragment`, which the URI parser drops
/// silently but Envoy answers with 400 (a `#` in a method, which `allow_custom_methods`
/// lets through, is no fragment). Portico's own session serves no target with a `#`
/// (`h1_session::Plain::head` leaves those to pingora's): nothing to look for there.
fn has_fragment(session: &Session) -> bool {
    match session.as_downstream() {
        pingora_core::protocols::http::ServerSession::H1(h1) => {
            let raw = h1.get_headers_raw_bytes();
            let line_end = raw.iter().position(|b| *b == b'\n').unwrap_or(raw.len());
            fragment_in_target(&raw[..line_end])
        }
        _ => false,
    }
}

/// Whether a request line's target (after the method's space, before the version's) holds
/// a `#`.
fn fragment_in_target(line: &[u8]) -> bool {
    let start = line.iter().position(|b| *b == b' ').map_or(0, |p| p + 1);
    let end = line
        .iter()
        .rposition(|b| *b == b' ')
        .filter(|e| *e >= start)
        .unwrap_or(line.len());
    line[start..end].contains(&b'#')
}

/// The authority as the client sent it (`:authority` or `Host`).
pub(super) fn raw_authority(req: &RequestHeader) -> &str {
    req.uri
        .authority()
        .map(|a| a.as_str())
        .or_else(|| {
            req.headers
                .get(http::header::HOST)
                .and_then(super::head::value_str)
        })
        .unwrap_or("")
}

/// `host[:port]` into host and port; IPv6 literals keep their brackets.
pub(super) fn split_port(authority: &str) -> (&str, Option<&str>) {
    // By bytes: `rfind` of a char runs a char searcher (~200 instructions on every request
    // for a host like `127.0.0.1:8080`).
    let bytes = authority.as_bytes();
    let colon = if bytes.first() == Some(&b'[') {
        bytes.windows(2).position(|w| w == b"]:").map(|i| i + 1)
    } else {
        bytes.iter().rposition(|b| *b == b':')
    };
    match colon {
        Some(i) => (&authority[..i], Some(&authority[i + 1..])),
        None => (authority, None),
    }
}

/// Envoy's downstream remote address: the peer with `use_remote_address` (or the XFF entry
/// `xff_num_trusted_hops` back), otherwise the last XFF address, else the peer. Addresses
/// taken from XFF have port 0, as in Envoy.
pub(super) fn downstream_remote(
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
    // A scan of the names present costs less than the lookup (which hashes the name), and
    // most requests to an edge carry no XFF.
    if !has(headers, &X_FORWARDED_FOR) {
        return peer;
    }
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

/// Envoy's internal-request rule: with `use_remote_address` the request must carry no XFF and
/// come from an internal peer; without it XFF must hold exactly one address, an internal one.
/// Internal ranges come only from `internal_address_config` (Envoy 1.40 has none by default).
pub(super) fn is_internal_request(
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

#[cfg(test)]
#[path = "downstream_tests.rs"]
mod downstream_tests;
