//! Istio's filters on the request path: `istio.metadata_exchange` (the peer metadata headers
//! read from the request and the response, and the gateway's own sent upstream) and
//! `istio.stats` (what its dimensions read of the request, and the report at the end). Their
//! config is the connection manager's (`Hcm::istio`); the metrics live in `State::istio`.

use std::sync::Arc;

use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;

use super::head::SetHeader;
use super::Ctx;
use crate::telemetry::istio_stats::peer::{PEER_HEADER_NAME, PEER_ID_HEADER_NAME};
use crate::telemetry::istio_stats::{store, Discovery, IstioFilters, PeerInfo};
use crate::State;

fn istio(ctx: &Ctx) -> Option<&IstioFilters> {
    ctx.listener
        .as_ref()
        .and_then(|l| l.def.hcm())
        .map(|h| &h.istio)
}

/// Whether `upstream_request` may add peer metadata to the upstream request.
pub(super) fn propagates(ctx: &Ctx) -> bool {
    istio(ctx)
        .and_then(|i| i.peer_metadata.as_ref())
        .is_some_and(|p| p.upstream_propagation.is_some())
}

/// The first discovery method that finds the peer in `headers`, as istio-proxy's
/// `discover`; None if none does.
fn discover(
    methods: &[Discovery],
    headers: &http::HeaderMap,
    additional: &[String],
) -> Option<Arc<PeerInfo>> {
    methods.iter().find_map(|m| match m {
        Discovery::IstioHeaders => {
            let v = headers.get(&PEER_HEADER_NAME)?;
            PeerInfo::from_header(v.as_bytes(), additional).map(Arc::new)
        }
        Discovery::Baggage => {
            let v = headers.get(header_name!("baggage"))?.to_str().ok()?;
            Some(Arc::new(PeerInfo::from_baggage(v)))
        }
        Discovery::WorkloadDiscovery => None,
    })
}

/// At the filter's place in the chain (the request's headers): the downstream peer's
/// metadata is read and its headers removed (they are not sent upstream); the values the
/// stats dimensions read are kept.
pub(super) fn request(session: &mut Session, ctx: &mut Ctx) {
    let Some(ist) = istio(ctx).cloned() else {
        return;
    };
    if let Some(pm) = &ist.peer_metadata {
        let h = &session.req_header().headers;
        let (id, md) = (
            h.contains_key(&PEER_ID_HEADER_NAME),
            h.contains_key(&PEER_HEADER_NAME),
        );
        ctx.mx_request = (id, md);
        ctx.info.peers.downstream = discover(&pm.downstream_discovery, h, &pm.additional_labels);
        if pm.downstream_discovery.contains(&Discovery::IstioHeaders) {
            // Only those present: a removal hashes the name in both of pingora's maps.
            let req = session.req_header_mut();
            if id {
                req.remove_header(&PEER_ID_HEADER_NAME);
            }
            if md {
                req.remove_header(&PEER_HEADER_NAME);
            }
        }
    }
    if let Some(stats) = &ist.stats {
        ctx.info.request_head_bytes = request_head_size(session.req_header());
        if !stats.captures.is_empty() {
            let req = session.req_header();
            let host = req
                .uri
                .authority()
                .map(|a| a.as_str())
                .or_else(|| req.headers.get(http::header::HOST)?.to_str().ok())
                .unwrap_or("");
            let scheme = if ctx.info.downstream_tls {
                "https"
            } else {
                "http"
            };
            let pq = req.uri.path_and_query().map_or("/", |p| p.as_str());
            ctx.info.istio_attributes =
                store::capture(stats, host, req.method.as_str(), pq, scheme, &|n| {
                    Some(req.headers.get(n)?.to_str().ok()?.to_string())
                });
        }
    }
}

/// The request sent upstream: the gateway's own metadata (istio-proxy's
/// `MXPropagationMethod::inject`), unless the cluster's `istio` metadata says `disable_mx`, or
/// `external` with `skip_external_clusters`.
pub(super) fn upstream_request(
    upstream: &mut RequestHeader,
    ctx: &Ctx,
    state: &State,
) -> pingora_error::Result<()> {
    let Some(prop) = istio(ctx)
        .and_then(|i| i.peer_metadata.as_ref())
        .and_then(|p| p.upstream_propagation)
    else {
        return Ok(());
    };
    if let Some(c) = &ctx.cluster {
        let md = &c.def.telemetry.istio;
        if md.disable_mx
            || (prop.skip_external_clusters
                && (md.external || &*c.def.name == "PassthroughCluster"))
        {
            return Ok(());
        }
    }
    let node = &state.istio.node;
    if let Some((id, md)) = &node.values {
        return upstream.set_all([
            (&PEER_ID_HEADER_NAME, id.clone()),
            (&PEER_HEADER_NAME, md.clone()),
        ]);
    }
    upstream.set_all([
        (&PEER_ID_HEADER_NAME, node.id.as_str()),
        (&PEER_HEADER_NAME, node.header_value.as_str()),
    ])
}

/// The upstream's response headers: the upstream peer's metadata is read, and its headers
/// removed from what the client gets.
pub(super) fn upstream_response(resp: &mut ResponseHeader, ctx: &mut Ctx) {
    let Some(pm) = istio(ctx).and_then(|i| i.peer_metadata.clone()) else {
        return;
    };
    if let Some(p) = discover(&pm.upstream_discovery, &resp.headers, &pm.additional_labels) {
        ctx.info.peers.upstream = Some(p);
    }
    if pm.upstream_discovery.contains(&Discovery::IstioHeaders) {
        // Only those present: a removal hashes the name in both of pingora's maps.
        for name in [&PEER_ID_HEADER_NAME, &PEER_HEADER_NAME] {
            if resp.headers.contains_key(name) {
                resp.remove_header(name);
            }
        }
    }
}

/// The response to the client: the gateway's metadata when the client sent its own
/// (`downstream_propagation`, as istio-proxy answers a peer that announced itself).
pub(super) fn response(
    resp: &mut ResponseHeader,
    ctx: &Ctx,
    state: &State,
) -> pingora_error::Result<()> {
    let Some(_) = istio(ctx)
        .and_then(|i| i.peer_metadata.as_ref())
        .and_then(|p| p.downstream_propagation)
    else {
        return Ok(());
    };
    let node = &state.istio.node;
    if ctx.mx_request.0 {
        resp.set(&PEER_ID_HEADER_NAME, node.id.as_str())?;
    }
    if ctx.mx_request.1 {
        resp.set(&PEER_HEADER_NAME, node.header_value.as_str())?;
    }
    Ok(())
}

/// The request is over (after `observe::finish`): Istio's metrics.
pub(super) fn finish(session: &Session, ctx: &mut Ctx, state: &State) {
    let Some(stats) = istio(ctx).and_then(|i| i.stats.clone()) else {
        return;
    };
    ctx.info.grpc_request = ctx.grpc_request;
    if ctx.peer.is_some() {
        if let Some(c) = &ctx.cluster {
            ctx.info.upstream_workload = c
                .endpoints
                .hosts
                .get(ctx.host_index)
                .and_then(|h| h.workload.clone());
        }
    }
    if let Some(r) = session.response_written() {
        ctx.info.response_head_bytes = response_head_size(r);
    }
    state.istio.store.configured();
    state
        .istio
        .store
        .record_http(&stats, &state.istio.node, &ctx.info);
}

/// `GET /p HTTP/1.1\r\n`, each `name: value\r\n`, `\r\n`.
fn request_head_size(r: &RequestHeader) -> u64 {
    let target = r.uri.path_and_query().map_or(1, |p| p.as_str().len());
    let line = r.method.as_str().len() + 1 + target + " HTTP/1.1\r\n".len();
    (line + headers_size(&r.headers) + 2) as u64
}

/// `HTTP/1.1 200 OK\r\n`, each `name: value\r\n`, `\r\n`.
fn response_head_size(r: &ResponseHeader) -> u64 {
    let reason = r.status.canonical_reason().map_or(0, str::len);
    let line = "HTTP/1.1 200 ".len() + reason + 2;
    (line + headers_size(&r.headers) + 2) as u64
}

fn headers_size(h: &http::HeaderMap) -> usize {
    h.iter()
        .map(|(n, v)| n.as_str().len() + 2 + v.len() + 2)
        .sum()
}
