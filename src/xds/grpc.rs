//! gRPC channels to the control plane's bootstrap clusters (ADS, SDS): a TCP address or, as
//! istio-agent's `xds-grpc` and `sds-grpc`, a unix socket (`pipe`). HTTP/2 either way.

use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::core::v3::address::Address as A;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use tonic::transport::{Channel, Endpoint, Uri};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a gRPC stream to a bootstrap cluster goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrpcTarget {
    Tcp { host: String, port: u16 },
    Unix(PathBuf),
}

impl std::fmt::Display for GrpcTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GrpcTarget::Tcp { host, port } if host.contains(':') => write!(f, "[{host}]:{port}"),
            GrpcTarget::Tcp { host, port } => write!(f, "{host}:{port}"),
            GrpcTarget::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// The first endpoint of the bootstrap's static cluster `cluster`; None when there is no such
/// cluster or it has no endpoint (Envoy then never receives anything from it either).
pub fn bootstrap_target(b: &Bootstrap, cluster: &str) -> Option<GrpcTarget> {
    let c = b
        .static_resources
        .as_ref()?
        .clusters
        .iter()
        .find(|c| c.name == cluster)?;
    c.load_assignment
        .as_ref()?
        .endpoints
        .iter()
        .flat_map(|l| l.lb_endpoints.iter())
        .find_map(|e| {
            let Some(HostIdentifier::Endpoint(ep)) = &e.host_identifier else {
                return None;
            };
            match ep.address.as_ref()?.address.as_ref()? {
                A::SocketAddress(sa) => match sa.port_specifier {
                    Some(PortSpecifier::PortValue(p)) => Some(GrpcTarget::Tcp {
                        host: sa.address.clone(),
                        port: u16::try_from(p).ok()?,
                    }),
                    _ => None,
                },
                A::Pipe(p) => Some(GrpcTarget::Unix(PathBuf::from(&p.path))),
                A::EnvoyInternalAddress(_) => None,
            }
        })
}

/// An HTTP/2 channel to `target`, connected.
pub async fn connect(target: &GrpcTarget) -> Result<Channel, String> {
    match target {
        GrpcTarget::Tcp { .. } => {
            let uri = format!("http://{target}");
            Endpoint::from_shared(uri.clone())
                .map_err(|e| format!("invalid address {uri}: {e}"))?
                .connect_timeout(CONNECT_TIMEOUT)
                .tcp_nodelay(true)
                .connect()
                .await
                .map_err(|e| format!("cannot connect to {uri}: {e}"))
        }
        GrpcTarget::Unix(path) => Endpoint::from_static("http://localhost")
            .connect_timeout(CONNECT_TIMEOUT)
            .connect_with_connector(UnixConnector(path.clone()))
            .await
            .map_err(|e| format!("cannot connect to {target}: {e}")),
    }
}

/// Dials the unix socket whatever the URI says (tonic asks a connector per connection).
struct UnixConnector(PathBuf);

type Dialing = Pin<
    Box<
        dyn std::future::Future<
                Output = std::io::Result<hyper_util::rt::TokioIo<tokio::net::UnixStream>>,
            > + Send,
    >,
>;

impl tonic::codegen::Service<Uri> for UnixConnector {
    type Response = hyper_util::rt::TokioIo<tokio::net::UnixStream>;
    type Error = std::io::Error;
    type Future = Dialing;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let path = self.0.clone();
        Box::pin(async move {
            tokio::net::UnixStream::connect(path)
                .await
                .map(hyper_util::rt::TokioIo::new)
        })
    }
}
