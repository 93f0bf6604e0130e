//! Mirroring (Envoy's `request_mirror_policies`): which mirror clusters a routed request goes
//! to, the copy taken of it as it goes upstream, and the fire-and-forget shadow requests. Mirrors
//! use the request's own snapshot (`Ctx::snapshot`), never a newer one.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use bytes::Bytes;
use pingora_http::RequestHeader;
use pingora_proxy::Session;

use super::{Ctx, Gateway};
use crate::snapshot::route::Forward;

/// A request on its way to mirror clusters: the chosen targets, then the request as sent
/// upstream (head, then body as it streams).
#[derive(Default)]
pub(super) struct MirrorJob {
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

/// Routing: the route's mirror policies that sample this request, with the Host each copy
/// carries.
pub(super) fn choose_targets(session: &Session, ctx: &mut Ctx, fwd: &Forward) {
    if fwd.mirrors.is_empty() {
        return;
    }
    let host = super::downstream::raw_authority(session.req_header());
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

impl Gateway {
    /// The upstream request's head: the mirror gets the request as it goes upstream (Envoy
    /// copies it after the router's header changes); a request without a body is sent now.
    pub(super) fn mirror_head(
        &self,
        session: &mut Session,
        upstream: &RequestHeader,
        ctx: &mut Ctx,
    ) {
        let Some(job) = ctx.mirror.as_mut().filter(|j| j.head.is_none()) else {
            return;
        };
        let pq = upstream
            .uri
            .path_and_query()
            .map_or_else(|| "/".to_string(), |p| p.as_str().to_string());
        job.head = Some((upstream.method.clone(), pq, upstream.headers.clone()));
        if session.as_mut().is_body_empty() {
            self.send_mirrors(ctx);
        }
    }

    /// The request body as it streams: copied for the mirrors, which are sent at its end.
    pub(super) fn mirror_body(&self, body: &Option<Bytes>, end_of_stream: bool, ctx: &mut Ctx) {
        let Some(job) = ctx.mirror.as_mut().filter(|j| !j.sent && !j.dropped) else {
            return;
        };
        if let Some(b) = body {
            if job.body.len() + b.len() > MIRROR_BODY_LIMIT {
                job.dropped = true;
                job.body = Vec::new();
                return;
            }
            job.body.extend_from_slice(b);
        }
        if end_of_stream {
            self.send_mirrors(ctx);
        }
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
