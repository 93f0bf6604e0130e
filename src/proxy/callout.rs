//! The filters' requests to the configuration's clusters (`filters::callout`): ext_authz's
//! checks. A host is picked by the cluster's balancer from the request's own snapshot; gRPC
//! calls and HTTP/2 clusters go over a shared HTTP/2 connection per host (opened on first use,
//! replaced when it closes), HTTP/1.1 over a connection per call. Plain text only: a cluster
//! with TLS towards its hosts answers with an error, which the filter treats as the server
//! being unreachable (`failure_mode_allow` decides).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::filters::callout::{CalloutError, CalloutRequest, CalloutResponse, Upstreams};
use crate::snapshot::Snapshot;

type H2 = hyper::client::conn::http2::SendRequest<Full<Bytes>>;

/// HTTP/2 connections to callout hosts, shared by every worker.
fn h2_pool() -> &'static Mutex<HashMap<SocketAddr, H2>> {
    static POOL: OnceLock<Mutex<HashMap<SocketAddr, H2>>> = OnceLock::new();
    POOL.get_or_init(Default::default)
}

/// The callouts of one request, against the snapshot it was routed with.
pub(crate) struct Callouts<'a> {
    pub snapshot: &'a Snapshot,
}

#[async_trait::async_trait]
impl Upstreams for Callouts<'_> {
    async fn call(
        &self,
        cluster: &str,
        req: CalloutRequest,
    ) -> Result<CalloutResponse, CalloutError> {
        let c = self
            .snapshot
            .clusters
            .get(cluster)
            .ok_or_else(|| CalloutError::NoCluster(cluster.to_string()))?;
        if c.tls_hosts.iter().any(Option::is_some) || c.def.transport.any_tls() {
            return Err(CalloutError::Connect(format!(
                "cluster '{cluster}' uses TLS, which Portico's callouts do not speak"
            )));
        }
        let (_, addr) = c
            .pick()
            .ok_or_else(|| CalloutError::NoHealthyHost(cluster.to_string()))?;
        let h2 = req.grpc || c.def.http2;
        let connect_timeout = c.def.connect_timeout;
        let timeout = req.timeout;
        match tokio::time::timeout(timeout, exchange(addr, h2, connect_timeout, req)).await {
            Ok(r) => r,
            Err(_) => Err(CalloutError::Timeout),
        }
    }
}

async fn exchange(
    addr: SocketAddr,
    h2: bool,
    connect_timeout: std::time::Duration,
    req: CalloutRequest,
) -> Result<CalloutResponse, CalloutError> {
    let mut builder = http::Request::builder().method(req.method).uri(if h2 {
        format!("http://{}{}", req.authority, req.path)
    } else {
        req.path.clone()
    });
    if let Some(h) = builder.headers_mut() {
        *h = req.headers;
        if !h2 {
            if let Ok(v) = http::HeaderValue::from_str(&req.authority) {
                h.insert(http::header::HOST, v);
            }
        }
    }
    let request = builder
        .body(Full::new(req.body))
        .map_err(|e| CalloutError::Protocol(e.to_string()))?;
    let response = if h2 {
        let mut sender = h2_sender(addr, connect_timeout).await?;
        sender
            .send_request(request)
            .await
            .map_err(|e| CalloutError::Protocol(e.to_string()))?
    } else {
        let io = connect(addr, connect_timeout).await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| CalloutError::Connect(e.to_string()))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        sender
            .send_request(request)
            .await
            .map_err(|e| CalloutError::Protocol(e.to_string()))?
    };
    let (parts, body) = response.into_parts();
    let collected = body
        .collect()
        .await
        .map_err(|e| CalloutError::Protocol(e.to_string()))?;
    let trailers = collected.trailers().cloned();
    Ok(CalloutResponse {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    })
}

async fn connect(
    addr: SocketAddr,
    timeout: std::time::Duration,
) -> Result<TokioIo<tokio::net::TcpStream>, CalloutError> {
    let s = match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return Err(CalloutError::Connect(e.to_string())),
        Err(_) => return Err(CalloutError::Connect("connect timeout".into())),
    };
    let _ = s.set_nodelay(true);
    Ok(TokioIo::new(s))
}

/// The host's shared HTTP/2 connection, opened when there is none or it closed.
async fn h2_sender(addr: SocketAddr, timeout: std::time::Duration) -> Result<H2, CalloutError> {
    let pooled = {
        let pool = h2_pool().lock().unwrap_or_else(|p| p.into_inner());
        pool.get(&addr).filter(|s| !s.is_closed()).cloned()
    };
    if let Some(mut s) = pooled {
        if s.ready().await.is_ok() {
            return Ok(s);
        }
    }
    let io = connect(addr, timeout).await?;
    let (sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .map_err(|e| CalloutError::Connect(e.to_string()))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    h2_pool()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(addr, sender.clone());
    Ok(sender)
}
