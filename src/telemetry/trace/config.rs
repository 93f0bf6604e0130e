//! The connection manager's `tracing`, translated: sampling, custom tags and the provider
//! (Envoy's tracer driver). Pure: no environment, no cluster lookups; environment tags are
//! resolved by the exporter, clusters when a batch is sent.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{grpc_service, http_uri, HttpService};
use envoy_types::pb::envoy::config::trace::v3::{
    tracing::http::ConfigType, OpenTelemetryConfig, ZipkinConfig,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::Tracing as TracingProto;
use envoy_types::pb::envoy::r#type::tracing::v3::custom_tag;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

const ZIPKIN_TYPE: &str = "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig";
const OTEL_TYPE: &str = "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig";

/// Drivers Envoy 1.40 has but Portico does not: accepted (tracing never changes where a
/// request goes) with one warning, and no spans or propagation headers.
const UNIMPLEMENTED: &[(&str, &str)] = &[
    (
        "type.googleapis.com/envoy.config.trace.v3.DatadogConfig",
        "envoy.tracers.datadog",
    ),
    (
        "type.googleapis.com/envoy.config.trace.v3.SkyWalkingConfig",
        "envoy.tracers.skywalking",
    ),
    (
        "type.googleapis.com/envoy.config.trace.v3.XRayConfig",
        "envoy.tracers.xray",
    ),
    (
        "type.googleapis.com/envoy.extensions.tracers.fluentd.v3.FluentdConfig",
        "envoy.tracers.fluentd",
    ),
];

/// A sampling fraction as Envoy evaluates it: `value % denominator < numerator`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fraction {
    pub numerator: u64,
    pub denominator: u64,
}

impl Fraction {
    pub const ALL_OF_10000: Fraction = Fraction {
        numerator: 10_000,
        denominator: 10_000,
    };

    pub fn enabled(self, value: u64) -> bool {
        value % self.denominator < self.numerator
    }
}

/// One of `custom_tags`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustomTag {
    pub tag: String,
    pub value: TagValue,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TagValue {
    Literal(String),
    /// Read from the gateway's environment (by the exporter, off the request path); the
    /// default when unset; no tag when both are empty.
    Environment {
        name: String,
        default: String,
    },
    /// A request header's value, else the default; no tag when both are empty.
    RequestHeader {
        name: http::HeaderName,
        default: String,
    },
}

/// The connection manager's tracing.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// None: the bootstrap's `tracing.http` driver, if it has one (Envoy's fallback, which
    /// istiod relies on: its connection managers carry sampling and tags, istio-agent's
    /// bootstrap the Zipkin driver); else sampling only (the `x-request-id` trace bits).
    pub provider: Option<Arc<Provider>>,
    /// `client_sampling` (of 100), `random_sampling` and `overall_sampling` (of 10000), as
    /// Envoy's connection manager config turns the `Percent`s into fractions.
    pub client_sampling: Fraction,
    pub random_sampling: Fraction,
    pub overall_sampling: Fraction,
    pub custom_tags: Vec<CustomTag>,
    /// `http.url` is cut to this many bytes of path (Envoy's default 256).
    pub max_path_tag_length: usize,
    pub verbose: bool,
    /// `operation`: the span's name instead of the driver's default (a literal; formatter
    /// commands are not expanded).
    pub operation: Option<String>,
    /// The listener's `traffic_direction` is OUTBOUND: Envoy's egress operation (CLIENT spans,
    /// a new child span for an incoming context); set by the listener.
    pub egress: bool,
}

/// The tracer driver.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Provider {
    Zipkin(Zipkin),
    OpenTelemetry(OpenTelemetry),
    /// A driver Envoy has and Portico does not (its name): no spans, no headers.
    Unimplemented(&'static str),
}

/// `envoy.tracers.zipkin`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Zipkin {
    pub cluster: String,
    /// The POST's path (`collector_endpoint`).
    pub endpoint: String,
    /// The POST's Host: `collector_hostname`, else the cluster's name.
    pub hostname: String,
    /// `HTTP_PROTO`: spans as `zipkin.proto3.ListOfSpans`; else JSON v2.
    pub proto: bool,
    pub trace_id_128bit: bool,
    /// `shared_span_context` (default true): an ingress span continues the caller's span id.
    pub shared_span_context: bool,
}

/// `envoy.tracers.opentelemetry` over gRPC (`grpc_service.envoy_grpc`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OpenTelemetry {
    pub cluster: String,
    /// The `:authority` of the Export call: `envoy_grpc.authority`, else the cluster name.
    pub authority: String,
    /// `service_name`: the resource's `service.name` (Envoy's default `unknown_service:envoy`).
    pub service_name: String,
}

impl TracingConfig {
    /// `egress`: the listener's `traffic_direction` is OUTBOUND.
    pub fn translate(t: &TracingProto, egress: bool) -> Result<TracingConfig, String> {
        let provider = match &t.provider {
            None => None,
            Some(p) => Some(Arc::new(provider(&p.name, p.config_type.as_ref())?)),
        };
        let percent = |p: &Option<envoy_types::pb::envoy::r#type::v3::Percent>,
                       field: &str|
         -> Result<Option<f64>, String> {
            match p {
                Some(p) if !(0.0..=100.0).contains(&p.value) => Err(format!(
                    "tracing.{field}: value must be between 0 and 100, got {}",
                    p.value
                )),
                Some(p) => Ok(Some(p.value)),
                None => Ok(None),
            }
        };
        // Envoy: client sampling is a percent of 100 (truncated), random and overall sampling
        // percents rounded to a fraction of 10000.
        let client = percent(&t.client_sampling, "client_sampling")?.unwrap_or(100.0);
        let of_10000 = |v: Option<f64>| Fraction {
            numerator: v.map_or(10_000, |v| (v * 100.0).round() as u64),
            denominator: 10_000,
        };
        let mut custom_tags = Vec::with_capacity(t.custom_tags.len());
        for (i, c) in t.custom_tags.iter().enumerate() {
            let value = match &c.r#type {
                Some(custom_tag::Type::Literal(l)) => TagValue::Literal(l.value.clone()),
                Some(custom_tag::Type::Environment(e)) => TagValue::Environment {
                    name: e.name.clone(),
                    default: e.default_value.clone(),
                },
                Some(custom_tag::Type::RequestHeader(h)) => TagValue::RequestHeader {
                    name: http::HeaderName::from_bytes(h.name.to_ascii_lowercase().as_bytes())
                        .map_err(|_| {
                            format!(
                                "tracing.custom_tags[{i}].request_header.name: invalid header name '{}'",
                                h.name
                            )
                        })?,
                    default: h.default_value.clone(),
                },
                // Metadata tags (route, cluster or host metadata) only decorate spans: accepted,
                // not implemented.
                Some(custom_tag::Type::Metadata(_)) | Some(custom_tag::Type::Value(_)) => continue,
                None => {
                    return Err(format!(
                        "tracing.custom_tags[{i}]: one of literal, environment, request_header, metadata is required"
                    ))
                }
            };
            if c.tag.is_empty() {
                return Err(format!("tracing.custom_tags[{i}].tag must not be empty"));
            }
            custom_tags.push(CustomTag {
                tag: c.tag.clone(),
                value,
            });
        }
        // Accepted without effect: `spawn_upstream_span` (Envoy's router span around each
        // upstream attempt; Portico reports the connection manager's span only and injects its
        // context) and `upstream_operation`. Neither changes routing.
        Ok(TracingConfig {
            provider,
            client_sampling: Fraction {
                numerator: client as u64,
                denominator: 100,
            },
            random_sampling: of_10000(percent(&t.random_sampling, "random_sampling")?),
            overall_sampling: of_10000(percent(&t.overall_sampling, "overall_sampling")?),
            custom_tags,
            max_path_tag_length: t.max_path_tag_length.map_or(256, |v| v.value as usize),
            verbose: t.verbose,
            operation: (!t.operation.is_empty()).then(|| t.operation.clone()),
            egress,
        })
    }
}

impl Provider {
    /// A tracer driver config, as the connection manager's `tracing.provider` or the
    /// bootstrap's `tracing.http` (the default of connection managers without a provider)
    /// carry it.
    pub fn translate(
        http: &envoy_types::pb::envoy::config::trace::v3::tracing::Http,
    ) -> Result<Provider, String> {
        provider(&http.name, http.config_type.as_ref())
    }
}

fn provider(name: &str, config: Option<&ConfigType>) -> Result<Provider, String> {
    let Some(ConfigType::TypedConfig(any)) = config else {
        return Err(format!(
            "tracing.provider '{name}': typed_config is required"
        ));
    };
    match any.type_url.as_str() {
        ZIPKIN_TYPE => zipkin(&decode::<ZipkinConfig>(any, name)?).map(Provider::Zipkin),
        OTEL_TYPE => {
            opentelemetry(&decode::<OpenTelemetryConfig>(any, name)?).map(Provider::OpenTelemetry)
        }
        other => match UNIMPLEMENTED.iter().find(|(t, _)| *t == other) {
            Some((_, driver)) => {
                tracing::warn!(
                    "tracing.provider '{name}': {driver} is not implemented by Portico; requests are not traced"
                );
                Ok(Provider::Unimplemented(driver))
            }
            // Envoy refuses a provider it has no factory for (Lightstep, OpenCensus, dynamic OT
            // are gone from 1.40).
            None => Err(format!(
                "tracing.provider '{name}': no registered implementation for type URL '{other}'"
            )),
        },
    }
}

fn decode<M: Message + Default>(any: &Any, name: &str) -> Result<M, String> {
    M::decode(any.value.as_slice()).map_err(|e| {
        format!(
            "tracing.provider '{name}': cannot decode {}: {e}",
            any.type_url
        )
    })
}

fn zipkin(z: &ZipkinConfig) -> Result<Zipkin, String> {
    use envoy_types::pb::envoy::config::trace::v3::zipkin_config::CollectorEndpointVersion as V;
    let proto = match V::try_from(z.collector_endpoint_version) {
        Ok(V::HttpJson) => false,
        Ok(V::HttpProto) => true,
        // Envoy refuses the default (DEPRECATED_AND_UNAVAILABLE_DO_NOT_USE) too.
        _ => {
            return Err(format!(
                "tracing.provider zipkin: collector_endpoint_version {} is not supported; set HTTP_JSON or HTTP_PROTO",
                z.collector_endpoint_version
            ))
        }
    };
    let (cluster, endpoint, hostname) = match &z.collector_service {
        Some(s) => collector_service(s)?,
        None => {
            // Envoy's messages.
            if z.collector_cluster.is_empty() {
                return Err(
                    "Either collector_cluster or collector_service must be specified".into(),
                );
            }
            if z.collector_endpoint.is_empty() {
                return Err(
                    "collector_endpoint must be specified when using collector_cluster".into(),
                );
            }
            let hostname = if z.collector_hostname.is_empty() {
                z.collector_cluster.clone()
            } else {
                z.collector_hostname.clone()
            };
            (
                z.collector_cluster.clone(),
                z.collector_endpoint.clone(),
                hostname,
            )
        }
    };
    if z.trace_context_option != 0 {
        // USE_B3_WITH_W3C_PROPAGATION: W3C headers besides B3; tracing only.
        tracing::warn!(
            "tracing.provider zipkin: trace_context_option is not implemented (B3 only)"
        );
    }
    Ok(Zipkin {
        cluster,
        endpoint,
        hostname,
        proto,
        trace_id_128bit: z.trace_id_128bit,
        shared_span_context: z.shared_span_context.as_ref().is_none_or(|b| b.value),
    })
}

/// Zipkin's `collector_service`: the cluster of its `http_uri`, the URI's host as Host (the
/// cluster when the URI has none) and its path.
fn collector_service(s: &HttpService) -> Result<(String, String, String), String> {
    let uri = s
        .http_uri
        .as_ref()
        .ok_or("tracing.provider zipkin: collector_service.http_uri is required")?;
    let Some(http_uri::HttpUpstreamType::Cluster(cluster)) = &uri.http_upstream_type else {
        return Err(
            "tracing.provider zipkin: collector_service.http_uri.cluster is required".into(),
        );
    };
    let (host, path) = match uri.uri.split_once("://") {
        None => (String::new(), uri.uri.clone()),
        Some((_, rest)) => match rest.find('/') {
            None => (rest.to_string(), "/".to_string()),
            Some(i) => (rest[..i].to_string(), rest[i..].to_string()),
        },
    };
    let host = if host.is_empty() {
        cluster.clone()
    } else {
        host
    };
    Ok((cluster.clone(), path, host))
}

fn opentelemetry(o: &OpenTelemetryConfig) -> Result<OpenTelemetry, String> {
    let service_name = if o.service_name.is_empty() {
        "unknown_service:envoy".to_string()
    } else {
        o.service_name.clone()
    };
    let grpc = o
        .grpc_service
        .as_ref()
        .and_then(|g| g.target_specifier.as_ref());
    let (cluster, authority) = match grpc {
        Some(grpc_service::TargetSpecifier::EnvoyGrpc(e)) => {
            let authority = if e.authority.is_empty() {
                e.cluster_name.clone()
            } else {
                e.authority.clone()
            };
            (e.cluster_name.clone(), authority)
        }
        Some(grpc_service::TargetSpecifier::GoogleGrpc(_)) => {
            return Err(
                "tracing.provider opentelemetry: grpc_service.google_grpc is not supported (envoy_grpc is)"
                    .into(),
            )
        }
        None if o.http_service.is_some() => {
            return Err(
                "tracing.provider opentelemetry: http_service is not supported (grpc_service.envoy_grpc is)"
                    .into(),
            )
        }
        None => {
            return Err(
                "tracing.provider opentelemetry: grpc_service.envoy_grpc is required".into(),
            )
        }
    };
    // Accepted without effect: `resource_detectors`, `sampler` (Envoy's decision is used),
    // `max_cache_size` and the resource-attribute switches: they only shape the exported spans.
    Ok(OpenTelemetry {
        cluster,
        authority,
        service_name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::trace::v3::tracing::Http;
    use envoy_types::pb::envoy::r#type::tracing::v3::CustomTag as CustomTagProto;
    use envoy_types::pb::envoy::r#type::v3::Percent;
    use prost::Name;

    fn any<M: Message + Name>(m: M) -> Any {
        Any {
            type_url: M::type_url(),
            value: m.encode_to_vec(),
        }
    }

    fn with(provider: Option<Any>) -> TracingProto {
        TracingProto {
            provider: provider.map(|a| Http {
                name: "p".into(),
                config_type: Some(ConfigType::TypedConfig(a)),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_sample_everything() {
        let t = TracingConfig::translate(&with(None), false).unwrap();
        assert_eq!(t.provider, None);
        assert_eq!(
            t.client_sampling,
            Fraction {
                numerator: 100,
                denominator: 100
            }
        );
        assert_eq!(t.random_sampling, Fraction::ALL_OF_10000);
        assert_eq!(t.overall_sampling, Fraction::ALL_OF_10000);
        assert_eq!(t.max_path_tag_length, 256);
    }

    #[test]
    fn percents_become_envoys_fractions() {
        let mut p = with(None);
        p.random_sampling = Some(Percent { value: 1.0 });
        p.overall_sampling = Some(Percent { value: 12.345 });
        p.client_sampling = Some(Percent { value: 50.7 });
        let t = TracingConfig::translate(&p, false).unwrap();
        assert_eq!(t.random_sampling.numerator, 100);
        assert_eq!(t.overall_sampling.numerator, 1235);
        assert_eq!(t.client_sampling.numerator, 50);
        p.random_sampling = Some(Percent { value: 101.0 });
        let e = TracingConfig::translate(&p, false).unwrap_err();
        assert!(e.contains("tracing.random_sampling"), "{e}");
    }

    #[test]
    fn zipkin_fields() {
        let z = ZipkinConfig {
            collector_cluster: "zipkin".into(),
            collector_endpoint: "/api/v2/spans".into(),
            trace_id_128bit: true,
            ..Default::default()
        };
        let e = TracingConfig::translate(&with(Some(any(z.clone()))), true).unwrap_err();
        assert!(e.contains("collector_endpoint_version"), "{e}");
        let z = ZipkinConfig {
            collector_endpoint_version: 1,
            ..z
        };
        let t = TracingConfig::translate(&with(Some(any(z.clone()))), true).unwrap();
        let Some(Provider::Zipkin(p)) = t.provider.as_deref() else {
            panic!("{t:?}")
        };
        assert_eq!(p.hostname, "zipkin");
        assert!(p.shared_span_context && p.trace_id_128bit && !p.proto);
        assert!(t.egress);
        let mut no_endpoint = z.clone();
        no_endpoint.collector_endpoint.clear();
        let e = TracingConfig::translate(&with(Some(any(no_endpoint))), false).unwrap_err();
        assert!(e.contains("collector_endpoint"), "{e}");
        let mut named = z;
        named.collector_hostname = "zipkin.example".into();
        let t = TracingConfig::translate(&with(Some(any(named))), false).unwrap();
        let Some(Provider::Zipkin(p)) = t.provider.as_deref() else {
            panic!()
        };
        assert_eq!(p.hostname, "zipkin.example");
    }

    #[test]
    fn opentelemetry_needs_an_envoy_grpc_cluster() {
        use envoy_types::pb::envoy::config::core::v3::GrpcService;
        let o = OpenTelemetryConfig {
            grpc_service: Some(GrpcService {
                target_specifier: Some(grpc_service::TargetSpecifier::EnvoyGrpc(
                    grpc_service::EnvoyGrpc {
                        cluster_name: "otel".into(),
                        ..Default::default()
                    },
                )),
                ..Default::default()
            }),
            ..Default::default()
        };
        let t = TracingConfig::translate(&with(Some(any(o))), false).unwrap();
        let Some(Provider::OpenTelemetry(p)) = t.provider.as_deref() else {
            panic!()
        };
        assert_eq!((p.cluster.as_str(), p.authority.as_str()), ("otel", "otel"));
        assert_eq!(p.service_name, "unknown_service:envoy");
        let e = TracingConfig::translate(&with(Some(any(OpenTelemetryConfig::default()))), false)
            .unwrap_err();
        assert!(e.contains("grpc_service"), "{e}");
    }

    #[test]
    fn other_providers_accepted_or_refused_as_envoy() {
        let datadog = Any {
            type_url: "type.googleapis.com/envoy.config.trace.v3.DatadogConfig".into(),
            value: Vec::new(),
        };
        let t = TracingConfig::translate(&with(Some(datadog)), false).unwrap();
        assert_eq!(
            t.provider.as_deref(),
            Some(&Provider::Unimplemented("envoy.tracers.datadog"))
        );
        let lightstep = Any {
            type_url: "type.googleapis.com/envoy.config.trace.v3.LightstepConfig".into(),
            value: Vec::new(),
        };
        let e = TracingConfig::translate(&with(Some(lightstep)), false).unwrap_err();
        assert!(e.contains("no registered implementation"), "{e}");
    }

    #[test]
    fn custom_tags() {
        let mut p = with(None);
        p.custom_tags = vec![
            CustomTagProto {
                tag: "a".into(),
                r#type: Some(custom_tag::Type::Environment(custom_tag::Environment {
                    name: "POD".into(),
                    default_value: "d".into(),
                })),
            },
            CustomTagProto {
                tag: "b".into(),
                r#type: Some(custom_tag::Type::RequestHeader(custom_tag::Header {
                    name: "X-Foo".into(),
                    default_value: String::new(),
                })),
            },
        ];
        let t = TracingConfig::translate(&p, false).unwrap();
        assert_eq!(
            t.custom_tags[0].value,
            TagValue::Environment {
                name: "POD".into(),
                default: "d".into()
            }
        );
        assert_eq!(
            t.custom_tags[1].value,
            TagValue::RequestHeader {
                name: http::HeaderName::from_static("x-foo"),
                default: String::new()
            }
        );
        p.custom_tags[0].r#type = None;
        assert!(TracingConfig::translate(&p, false).is_err());
    }
}
