//! Where an SDS secret comes from: the ADS stream (`sds_config: {ads: {}}`) or an SDS stream
//! (state of the world or incremental) to a static bootstrap cluster (`api_config_source` GRPC
//! or DELTA_GRPC with `envoy_grpc.cluster_name`, as istio-agent's `sds-grpc`).
//!
//! Secrets are keyed by name alone in the store. Envoy keys them by name and config source, so
//! the same name from two sources would be two secrets there and one here; no control plane
//! Portico serves sends that.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tlspb;

/// Envoy's `initial_fetch_timeout` when a config source does not set one.
pub const DEFAULT_INITIAL_FETCH_TIMEOUT: Duration = Duration::from_secs(15);

/// One SDS stream to a bootstrap cluster. Two secrets with equal sources share a stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SdsCluster {
    /// `grpc_services[0].envoy_grpc.cluster_name`: a static cluster of the bootstrap.
    pub cluster: String,
    /// `set_node_on_first_message_only`.
    pub node_first_only: bool,
    /// `api_type: DELTA_GRPC`: the incremental `DeltaSecrets` stream instead of
    /// `StreamSecrets`. Sources differing only in this are two streams, as in Envoy.
    pub delta: bool,
    /// How long start-up (`/ready`) waits for the secrets; None waits for ever (`0s`, as
    /// istiod sets it).
    pub initial_fetch_timeout: Option<Duration>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SdsSource {
    Ads,
    Cluster(Arc<SdsCluster>),
}

/// A secret an SDS config names, and where it comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SdsRef {
    pub name: String,
    pub source: SdsSource,
}

impl SdsRef {
    /// An `SdsSecretConfig`; `field` names it in errors.
    pub fn parse(c: &tlspb::SdsSecretConfig, field: &str) -> Result<SdsRef, String> {
        if c.name.is_empty() {
            return Err(format!("{field}: name is required"));
        }
        let at = format!("{field}.sds_config");
        let Some(cs) = &c.sds_config else {
            return Err(format!(
                "{at}: is required (static secrets from the bootstrap are not supported)"
            ));
        };
        Ok(SdsRef {
            name: c.name.clone(),
            source: source(cs, &at)?,
        })
    }

    /// The bootstrap cluster the secret's stream dials, when it does not come over ADS.
    pub fn cluster(&self) -> Option<&Arc<SdsCluster>> {
        match &self.source {
            SdsSource::Ads => None,
            SdsSource::Cluster(c) => Some(c),
        }
    }
}

fn source(cs: &corepb::ConfigSource, at: &str) -> Result<SdsSource, String> {
    use corepb::api_config_source::ApiType;
    use corepb::config_source::ConfigSourceSpecifier as S;
    use corepb::grpc_service::TargetSpecifier;
    #[allow(deprecated)]
    let api = match &cs.config_source_specifier {
        Some(S::Ads(_)) => return Ok(SdsSource::Ads),
        Some(S::ApiConfigSource(api)) => api,
        Some(S::Path(_) | S::PathConfigSource(_)) => {
            return Err(format!(
                "{at}: file-based secrets are not supported (use ads or an api_config_source)"
            ))
        }
        Some(S::Self_(_)) => return Err(format!("{at}: self is not supported")),
        None => return Err(format!("{at}: a config source is required")),
    };
    let at = format!("{at}.api_config_source");
    let delta = match ApiType::try_from(api.api_type) {
        Ok(ApiType::Grpc) => false,
        Ok(ApiType::DeltaGrpc) => true,
        Ok(other) => {
            return Err(format!(
                "{at}.api_type: {} is not supported for SDS; use GRPC or DELTA_GRPC",
                other.as_str_name()
            ))
        }
        Err(_) => return Err(format!("{at}.api_type: unknown api_type {}", api.api_type)),
    };
    // 1 is the deprecated V2.
    if api.transport_api_version == 1 {
        return Err(format!(
            "{at}.transport_api_version: V2 xDS transport protocol version is deprecated; use V3"
        ));
    }
    if !api.cluster_names.is_empty() {
        return Err(format!(
            "{at}.cluster_names: API configs of type GRPC must not have a cluster name specified"
        ));
    }
    let [service] = api.grpc_services.as_slice() else {
        return Err(format!(
            "{at}.grpc_services: exactly one gRPC service is required, found {}",
            api.grpc_services.len()
        ));
    };
    let cluster = match &service.target_specifier {
        Some(TargetSpecifier::EnvoyGrpc(g)) if !g.cluster_name.is_empty() => g.cluster_name.clone(),
        Some(TargetSpecifier::GoogleGrpc(_)) => {
            return Err(format!(
                "{at}.grpc_services[0].google_grpc is not supported; use envoy_grpc with a static cluster"
            ))
        }
        _ => {
            return Err(format!(
                "{at}.grpc_services[0]: envoy_grpc.cluster_name is required"
            ))
        }
    };
    let initial_fetch_timeout = match &cs.initial_fetch_timeout {
        None => Some(DEFAULT_INITIAL_FETCH_TIMEOUT),
        Some(d) => {
            let d = super::duration(d).map_err(|e| format!("{at}: initial_fetch_timeout: {e}"))?;
            (!d.is_zero()).then_some(d)
        }
    };
    Ok(SdsSource::Cluster(Arc::new(SdsCluster {
        cluster,
        node_first_only: api.set_node_on_first_message_only,
        delta,
        initial_fetch_timeout,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpc(cluster: &str, api_type: corepb::api_config_source::ApiType) -> corepb::ConfigSource {
        corepb::ConfigSource {
            config_source_specifier: Some(
                corepb::config_source::ConfigSourceSpecifier::ApiConfigSource(
                    corepb::ApiConfigSource {
                        api_type: api_type as i32,
                        transport_api_version: corepb::ApiVersion::V3 as i32,
                        set_node_on_first_message_only: true,
                        grpc_services: vec![corepb::GrpcService {
                            target_specifier: Some(
                                corepb::grpc_service::TargetSpecifier::EnvoyGrpc(
                                    corepb::grpc_service::EnvoyGrpc {
                                        cluster_name: cluster.into(),
                                        ..Default::default()
                                    },
                                ),
                            ),
                            ..Default::default()
                        }],
                        ..Default::default()
                    },
                ),
            ),
            initial_fetch_timeout: Some(Default::default()),
            resource_api_version: corepb::ApiVersion::V3 as i32,
            ..Default::default()
        }
    }

    fn cfg(name: &str, cs: corepb::ConfigSource) -> tlspb::SdsSecretConfig {
        tlspb::SdsSecretConfig {
            name: name.into(),
            sds_config: Some(cs),
        }
    }

    #[test]
    fn istios_sds_grpc_source() {
        use corepb::api_config_source::ApiType;
        let r = SdsRef::parse(&cfg("default", grpc("sds-grpc", ApiType::Grpc)), "f").expect("ok");
        assert_eq!(r.name, "default");
        let c = r.cluster().expect("a cluster source");
        assert_eq!(c.cluster, "sds-grpc");
        assert!(c.node_first_only);
        // 0s: wait for ever.
        assert_eq!(c.initial_fetch_timeout, None);
        let mut cs = grpc("sds-grpc", ApiType::Grpc);
        cs.initial_fetch_timeout = None;
        let r = SdsRef::parse(&cfg("default", cs), "f").expect("ok");
        assert_eq!(
            r.cluster().and_then(|c| c.initial_fetch_timeout),
            Some(DEFAULT_INITIAL_FETCH_TIMEOUT)
        );
        // Equal sources compare equal, so they share a stream.
        let a = SdsRef::parse(&cfg("a", grpc("sds-grpc", ApiType::Grpc)), "f").expect("ok");
        let b = SdsRef::parse(&cfg("b", grpc("sds-grpc", ApiType::Grpc)), "f").expect("ok");
        assert_eq!(a.source, b.source);
    }

    #[test]
    fn ads_and_errors() {
        use corepb::api_config_source::ApiType;
        let ads = corepb::ConfigSource {
            config_source_specifier: Some(corepb::config_source::ConfigSourceSpecifier::Ads(
                Default::default(),
            )),
            ..Default::default()
        };
        assert_eq!(
            SdsRef::parse(&cfg("x", ads), "f").expect("ok").source,
            SdsSource::Ads
        );
        let err = |c: tlspb::SdsSecretConfig| SdsRef::parse(&c, "f").expect_err("rejected");
        let delta =
            SdsRef::parse(&cfg("x", grpc("sds-grpc", ApiType::DeltaGrpc)), "f").expect("delta SDS");
        let sotw = SdsRef::parse(&cfg("x", grpc("sds-grpc", ApiType::Grpc)), "f").expect("ok");
        assert!(delta.cluster().is_some_and(|c| c.delta));
        assert!(sotw.cluster().is_some_and(|c| !c.delta));
        assert_ne!(delta.source, sotw.source, "two streams");
        assert!(err(cfg("x", grpc("sds-grpc", ApiType::Rest))).contains("REST is not supported"));
        assert!(
            err(cfg("x", grpc("", ApiType::Grpc))).contains("envoy_grpc.cluster_name is required")
        );
        assert!(err(cfg("", grpc("sds-grpc", ApiType::Grpc))).contains("f: name is required"));
        assert!(err(tlspb::SdsSecretConfig {
            name: "x".into(),
            sds_config: None
        })
        .contains("static secrets"));
    }
}
