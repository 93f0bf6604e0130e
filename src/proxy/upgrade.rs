//! HTTP/1.1 upgrades (WebSocket) on the request path. pingora itself switches both sides to a
//! raw byte stream when the upstream answers 101 to a request that carries `Upgrade` on both
//! legs; what is left here is Envoy's policy: which upgrades are allowed, which headers travel,
//! which timers stop applying.

use http::HeaderValue;
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;

use crate::snapshot::route::{Action, Route};
use crate::snapshot::upgrade::{allowed, Upgrades};

/// An upgrade request as Envoy's codec sees one: HTTP/1.1 with `Upgrade` and a `Connection`
/// that names it. `Upgrade: h2c` is not one: Envoy's codec drops that offer. Returns the
/// requested protocol.
pub(super) fn requested(session: &Session) -> Option<&HeaderValue> {
    if !super::downstream_h1(session) {
        return None;
    }
    let req = session.req_header();
    if req.version != http::Version::HTTP_11 {
        return None;
    }
    let up = req.headers.get(http::header::UPGRADE)?;
    if up.as_bytes().eq_ignore_ascii_case(b"h2c") {
        return None;
    }
    connection_names_upgrade(&req.headers).then_some(up)
}

fn connection_names_upgrade(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"upgrade"))
}

/// Whether the matched route (or, without a forwarding route, the connection manager) lets
/// this upgrade through. Direct responses and redirects carry no upgrade map in Envoy.
pub(super) fn permitted(hcm: &Upgrades, route: Option<&Route>, upgrade: &HeaderValue) -> bool {
    let route = route.and_then(|r| match &r.action {
        Action::Forward(f) => Some(&f.upgrades),
        _ => None,
    });
    allowed(hcm, route, upgrade.as_bytes())
}

static KEEP_ALIVE: http::HeaderName = http::HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: http::HeaderName = http::HeaderName::from_static("proxy-connection");

/// An upgrade request's hop-by-hop headers as Envoy forwards them: `Connection`, `Upgrade`,
/// `TE` and whatever `Connection` names travel unchanged; only `keep-alive` and
/// `proxy-connection` are dropped. They are copied from the downstream request because
/// pingora and the generic stripping may have removed some.
pub(super) fn forward_hop_by_hop(
    down: &http::HeaderMap,
    up: &mut RequestHeader,
) -> pingora_core::Result<()> {
    let nominated = down
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .filter_map(|t| http::HeaderName::from_bytes(t.trim_ascii()).ok());
    let fixed = [
        http::header::CONNECTION,
        http::header::UPGRADE,
        http::header::TE,
        http::header::TRAILER,
        http::header::PROXY_AUTHORIZATION,
    ];
    for name in fixed.into_iter().chain(nominated) {
        if name == KEEP_ALIVE || name == PROXY_CONNECTION || !down.contains_key(&name) {
            continue;
        }
        up.remove_header(&name);
        for v in down.get_all(&name) {
            up.append_header(name.clone(), v.clone())?;
        }
    }
    up.remove_header(&KEEP_ALIVE);
    up.remove_header(&PROXY_CONNECTION);
    Ok(())
}

/// The 101 as Envoy relays it: `Connection` and `Upgrade` stay, the other connection-level
/// headers go, and it is dated like any response (pingora dates only final responses).
pub(super) fn switch_response(resp: &mut ResponseHeader) -> pingora_core::Result<()> {
    resp.remove_header(&KEEP_ALIVE);
    resp.remove_header(&PROXY_CONNECTION);
    resp.remove_header(&http::header::TRANSFER_ENCODING);
    dated(resp)
}

/// A `Date` where the 101 has none: Envoy's connection manager dates a 101 as it dates a final
/// response, whether or not the request asked for the switch (pingora dates only final
/// responses).
pub(super) fn dated(resp: &mut ResponseHeader) -> pingora_core::Result<()> {
    if !resp.headers.contains_key(http::header::DATE) {
        resp.insert_header(
            http::header::DATE,
            pingora_core::protocols::http::date::get_cached_date(),
        )?;
    }
    Ok(())
}

/// A response that completes the upgrade keeps its `Connection` and `Upgrade`, as Envoy's
/// connection manager leaves them on upgrade responses.
pub(super) fn is_switch(resp: &ResponseHeader) -> bool {
    resp.status == http::StatusCode::SWITCHING_PROTOCOLS
        && resp.headers.contains_key(http::header::UPGRADE)
        && connection_names_upgrade(&resp.headers)
}

/// The head of a non-101 answer to an upgrade, as Envoy relays it: no body follows.
pub(super) fn refused_head(resp: &mut ResponseHeader) -> pingora_core::Result<()> {
    resp.remove_header(&http::header::TRANSFER_ENCODING);
    resp.insert_header(http::header::CONTENT_LENGTH, "0")?;
    Ok(())
}
