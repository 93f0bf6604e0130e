//! The immutable routing snapshot and its translation from xDS protos.
//!
//! Translation is pure: protos in, plain Rust structs (or a [`TranslateError`] naming the
//! resource and field) out. The files and environment variables a resource names come from
//! the caller's [`sources::DataSources`]; nothing here reads the disk or the environment. The
//! request path reads only these structs.

pub mod cluster;
pub mod filter_chain;
pub mod headers;
pub mod health_check;
pub mod listener;
pub mod load;
pub mod outlier;
pub mod retry;
pub mod route;
pub mod sds;
pub mod sources;
pub mod tcp_proxy;
pub mod tls;
pub mod upgrade;
pub mod upstream_tls;
pub mod validation;

use std::collections::HashMap;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3 as corepb;

use cluster::Cluster;
use listener::ListenerDef;
use route::RouteTable;

pub use crate::units::{duration, per_million};

/// A rejected resource: which one, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{resource}: {detail}")]
pub struct TranslateError {
    pub resource: String,
    pub detail: String,
}

impl TranslateError {
    pub fn new(resource: impl Into<String>, detail: impl Into<String>) -> TranslateError {
        TranslateError {
            resource: resource.into(),
            detail: detail.into(),
        }
    }
}

/// A listener that is serving: its definition and, per filter chain, what it resolved to.
#[derive(Debug)]
pub struct ActiveListener {
    pub def: Arc<ListenerDef>,
    pub chains: Vec<Arc<ActiveChain>>,
}

/// One filter chain that is serving: what a request on it reads.
#[derive(Debug)]
pub struct ActiveChain {
    pub def: Arc<listener::ChainDef>,
    pub routes: Arc<RouteTable>,
    /// The handshake configs, for TLS chains (inline certificates, or the SDS secret in force).
    pub tls: Option<Arc<tls::TlsServer>>,
    /// The SDS secrets `tls` was built from (certificate, then validation context), so
    /// unchanged secrets reuse it.
    pub secrets: Vec<Arc<tls::SecretDef>>,
}

/// Clusters by name, looked up on every request: by names the control plane chose, not
/// clients, so hashed by foldhash rather than SipHash, whose resistance to chosen keys they
/// do not need (~300 instructions a lookup, most of them SipHash's).
pub type ClusterMap = imbl::GenericHashMap<
    Arc<str>,
    Arc<Cluster>,
    foldhash::fast::RandomState,
    imbl::shared_ptr::DefaultSharedPtr,
>;

/// Everything a request needs, swapped as a whole.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub version: u64,
    /// By name, looked up on every request (foldhash: see `ClusterMap`).
    pub listeners: HashMap<String, Arc<ActiveListener>, foldhash::fast::RandomState>,
    /// Persistent, so an EDS update replaces one entry and shares the rest.
    pub clusters: ClusterMap,
}

/// A `socket_address`'s host and port; named ports and pipes are rejected.
pub fn socket_address(a: Option<&corepb::Address>) -> Result<(String, u16), String> {
    use corepb::address::Address as A;
    use corepb::socket_address::PortSpecifier as P;
    let sa = match a.and_then(|a| a.address.as_ref()) {
        Some(A::SocketAddress(sa)) => sa,
        Some(A::Pipe(p)) => return Err(format!("pipe address '{}' is not supported", p.path)),
        Some(A::EnvoyInternalAddress(_)) => {
            return Err("envoy_internal_address is not supported".into())
        }
        None => return Err("socket_address is required".into()),
    };
    if sa.address.is_empty() {
        return Err("socket_address.address must not be empty".into());
    }
    let port = match &sa.port_specifier {
        Some(P::PortValue(p)) => {
            u16::try_from(*p).map_err(|_| format!("port_value {p} out of range"))?
        }
        Some(P::NamedPort(n)) => return Err(format!("named_port '{n}' is not supported")),
        None => return Err("socket_address: port_specifier is required".into()),
    };
    Ok((sa.address.clone(), port))
}
