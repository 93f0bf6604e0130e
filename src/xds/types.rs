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
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Cluster, Kind::Endpoint, Kind::Listener, Kind::Route];

    pub fn type_url(self) -> &'static str {
        match self {
            Kind::Listener => LISTENER,
            Kind::Route => ROUTE,
            Kind::Cluster => CLUSTER,
            Kind::Endpoint => ENDPOINT,
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
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Decodes a resource of the expected type, unwrapping a `discovery.v3.Resource` envelope.
pub fn decode<M: prost::Message + Default>(any: &Any, want: &str) -> Result<M, String> {
    if any.type_url == RESOURCE_WRAPPER {
        let r =
            envoy_types::pb::envoy::service::discovery::v3::Resource::decode(any.value.as_slice())
                .map_err(|e| format!("cannot decode Resource wrapper: {e}"))?;
        let inner = r.resource.ok_or("Resource wrapper holds no resource")?;
        return decode(&inner, want);
    }
    if any.type_url != want {
        return Err(format!(
            "unexpected resource type {}, expected {want}",
            any.type_url
        ));
    }
    M::decode(any.value.as_slice()).map_err(|e| format!("cannot decode {want}: {e}"))
}

use prost::Message as _;
