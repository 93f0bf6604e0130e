//! Requests a filter makes to a cluster of the serving configuration: ext_authz's check, a
//! remote JWKS fetch. The filters only describe the request; the edge (`proxy::callout`)
//! picks a host of the cluster, connects as the cluster says (HTTP/1.1 or HTTP/2, TLS) and
//! answers with the whole response.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method};

/// One request to a cluster.
#[derive(Debug, Clone)]
pub struct CalloutRequest {
    pub method: Method,
    /// Path and query.
    pub path: String,
    /// `:authority` / `host` (the cluster name when empty, as Envoy's async client sends).
    pub authority: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The whole exchange, connection included.
    pub timeout: Duration,
    /// A gRPC call: HTTP/2 whatever the cluster's protocol options say.
    pub grpc: bool,
}

/// The whole response.
#[derive(Debug, Clone, Default)]
pub struct CalloutResponse {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// HTTP/2 trailers (a gRPC status), if any.
    pub trailers: Option<HeaderMap>,
}

/// Why a callout got no response.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CalloutError {
    #[error("cluster '{0}' is not in the configuration")]
    NoCluster(String),
    #[error("cluster '{0}' has no healthy host")]
    NoHealthyHost(String),
    #[error("timed out")]
    Timeout,
    #[error("connection failed: {0}")]
    Connect(String),
    #[error("{0}")]
    Protocol(String),
}

/// The edge's way to the configuration's clusters.
#[async_trait::async_trait]
pub trait Upstreams: Send + Sync {
    /// Sends `req` to a host of `cluster` and reads the whole response.
    async fn call(
        &self,
        cluster: &str,
        req: CalloutRequest,
    ) -> Result<CalloutResponse, CalloutError>;
}
