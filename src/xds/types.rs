//! xDS type URLs and the resource kinds Portico subscribes to.

use envoy_types::pb::google::protobuf::Any;

pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
pub const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
pub const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
pub const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
const RESOURCE_WRAPPER: &str = "type.googleapis.com/envoy.service.discovery.v3.Resource";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Cluster,
    Endpoint,
    Listener,
    Route,
    Secret,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::Cluster,
        Kind::Endpoint,
        Kind::Listener,
        Kind::Route,
        Kind::Secret,
    ];

    pub fn type_url(self) -> &'static str {
        match self {
            Kind::Listener => LISTENER,
            Kind::Route => ROUTE,
            Kind::Cluster => CLUSTER,
            Kind::Endpoint => ENDPOINT,
            Kind::Secret => SECRET,
        }
    }

    pub fn from_type_url(url: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.type_url() == url)
    }

    /// LDS and CDS are wildcard subscriptions: a response holds the whole set.
    pub fn is_wildcard(self) -> bool {
        matches!(self, Kind::Listener | Kind::Cluster)
    }

    pub fn short(self) -> &'static str {
        match self {
            Kind::Listener => "lds",
            Kind::Route => "rds",
            Kind::Cluster => "cds",
            Kind::Endpoint => "eds",
            Kind::Secret => "sds",
        }
    }

    /// How errors name a resource of this kind.
    pub fn noun(self) -> &'static str {
        match self {
            Kind::Listener => "listener",
            Kind::Route => "route",
            Kind::Cluster => "cluster",
            Kind::Endpoint => "endpoints",
            Kind::Secret => "secret",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Decodes a resource of the expected type, unwrapping a `discovery.v3.Resource` envelope.
pub fn decode<M: prost::Message + Default>(any: &Any, want: &str) -> Result<M, String> {
    let bytes = payload(any, want)?;
    M::decode(&*bytes).map_err(|e| format!("cannot decode {want}: {e}"))
}

/// The encoded resource inside `any` (unwrapping a `Resource` wrapper), checked to be `want`.
pub fn payload<'a>(any: &'a Any, want: &str) -> Result<std::borrow::Cow<'a, [u8]>, String> {
    if any.type_url == RESOURCE_WRAPPER {
        let r =
            envoy_types::pb::envoy::service::discovery::v3::Resource::decode(any.value.as_slice())
                .map_err(|e| format!("cannot decode Resource wrapper: {e}"))?;
        let inner = r.resource.ok_or("Resource wrapper holds no resource")?;
        return payload(&inner, want).map(|b| std::borrow::Cow::Owned(b.into_owned()));
    }
    if any.type_url != want {
        return Err(format!(
            "unexpected resource type {}, expected {want}",
            any.type_url
        ));
    }
    Ok(std::borrow::Cow::Borrowed(any.value.as_slice()))
}

/// A resource kept as it arrived on the wire. `/config_dump` is its only reader, and a decoded
/// Cluster, RouteConfiguration or ClusterLoadAssignment takes ten times or more the memory of
/// its encoding (every optional sub-message of a prost struct is stored inline).
pub struct Raw<P> {
    bytes: std::sync::Arc<[u8]>,
    _proto: std::marker::PhantomData<fn() -> P>,
}

impl<P> Clone for Raw<P> {
    fn clone(&self) -> Self {
        Raw {
            bytes: self.bytes.clone(),
            _proto: std::marker::PhantomData,
        }
    }
}

impl<P> std::fmt::Debug for Raw<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Raw({} bytes)", self.bytes.len())
    }
}

impl<P: prost::Message + prost::Name + Default> Raw<P> {
    pub fn from_bytes(bytes: &[u8]) -> Raw<P> {
        Raw {
            bytes: bytes.into(),
            _proto: std::marker::PhantomData,
        }
    }

    pub fn encode(p: &P) -> Raw<P> {
        Raw::from_bytes(&p.encode_to_vec())
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn decode(&self) -> Result<P, prost::DecodeError> {
        P::decode(&*self.bytes)
    }

    pub fn to_any(&self) -> Any {
        Any {
            type_url: P::type_url(),
            value: self.bytes.to_vec(),
        }
    }
}

use prost::Message as _;
