//! A finished gateway span, and its wire forms: Zipkin's JSON v2 and OTLP.

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::config::{TagValue, TracingConfig};
use super::context::SpanContext;
use super::otlp;

/// One span of the gateway hop, as the request path hands it to the exporter.
#[derive(Debug, Clone)]
pub struct FinishedSpan {
    /// The connection manager's tracing (its provider says where the span goes; its
    /// environment tags are resolved by the exporter).
    pub config: Arc<TracingConfig>,
    /// The driver that made it (the connection manager's or the bootstrap's).
    pub provider: Arc<super::config::Provider>,
    pub ctx: SpanContext,
    pub name: String,
    pub start: SystemTime,
    pub duration: Duration,
    /// Tags in the order Envoy sets them.
    pub tags: Vec<(Cow<'static, str>, String)>,
}

/// What the gateway says of itself in spans: the node (Zipkin's local endpoint, the
/// `node_id` and `zone` tags).
#[derive(Debug, Clone, Default)]
pub struct LocalInfo {
    pub node_id: String,
    pub cluster: String,
    pub zone: String,
    /// The gateway's first non-loopback address (Envoy's local address).
    pub address: Option<IpAddr>,
}

fn micros(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

impl FinishedSpan {
    /// Every tag with the exporter's additions: `node_id`, `zone` and the environment
    /// custom tags, resolved by `env`.
    pub fn all_tags(
        &self,
        local: &LocalInfo,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::with_capacity(self.tags.len() + 4);
        // Envoy's tags are a map: a later value for a key replaces the earlier one.
        let mut set = |k: &str, v: String| match out.iter_mut().find(|(ek, _)| ek == k) {
            Some(e) => e.1 = v,
            None => out.push((k.to_string(), v)),
        };
        set("node_id", local.node_id.clone());
        set("zone", local.zone.clone());
        for (k, v) in &self.tags {
            set(k, v.clone());
        }
        for t in &self.config.custom_tags {
            if let TagValue::Environment { name, default } = &t.value {
                let v = env(name)
                    .filter(|v| !v.is_empty())
                    .unwrap_or_else(|| default.clone());
                if !v.is_empty() {
                    set(&t.tag, v);
                }
            }
        }
        out
    }

    /// The span as Zipkin's JSON v2 (Envoy's `JsonV2Serializer`): a server span shares its
    /// id with the caller's when `shared_span_context`, and its end is an `ss` (`cr`)
    /// annotation.
    pub fn zipkin_json(
        &self,
        shared_span_context: bool,
        local: &LocalInfo,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> serde_json::Value {
        use serde_json::{json, Map, Value};
        let start = micros(self.start);
        let duration = self.duration.as_micros() as u64;
        let mut endpoint = Map::new();
        if let Some(ip) = local.address {
            let key = if ip.is_ipv4() { "ipv4" } else { "ipv6" };
            endpoint.insert(key.into(), Value::String(ip.to_string()));
            endpoint.insert("port".into(), json!(0));
        }
        if !local.cluster.is_empty() {
            endpoint.insert("serviceName".into(), Value::String(local.cluster.clone()));
        }
        let mut span = Map::new();
        span.insert("traceId".into(), Value::String(self.ctx.trace_id_hex()));
        if let Some(p) = self.ctx.parent_id {
            span.insert("parentId".into(), Value::String(format!("{p:016x}")));
        }
        span.insert(
            "id".into(),
            Value::String(format!("{:016x}", self.ctx.span_id)),
        );
        let kind = if self.ctx.client { "CLIENT" } else { "SERVER" };
        span.insert("kind".into(), Value::String(kind.into()));
        if !self.ctx.client && shared_span_context {
            span.insert("shared".into(), Value::Bool(true));
        }
        if !self.name.is_empty() {
            span.insert("name".into(), Value::String(self.name.clone()));
        }
        span.insert("timestamp".into(), json!(start));
        span.insert("duration".into(), json!(duration));
        span.insert("localEndpoint".into(), Value::Object(endpoint));
        let tags: Map<String, Value> = self
            .all_tags(local, env)
            .into_iter()
            // Zipkin's span drops tags with empty values (a node without a zone has none).
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| (k, Value::String(v)))
            .collect();
        if !tags.is_empty() {
            span.insert("tags".into(), Value::Object(tags));
        }
        let end = if self.ctx.client { "cr" } else { "ss" };
        span.insert(
            "annotations".into(),
            json!([{ "value": end, "timestamp": start + duration }]),
        );
        Value::Object(span)
    }

    /// The span as `zipkin.proto3` (Envoy's `ProtobufSerializer`): the same fields as the
    /// JSON; the trace id big-endian, span ids in little-endian byte order as Envoy writes
    /// them (its host order, checked against Envoy 1.40).
    pub fn zipkin_proto(
        &self,
        shared_span_context: bool,
        local: &LocalInfo,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> otlp::zipkin::Span {
        let start = micros(self.start);
        let duration = self.duration.as_micros() as u64;
        let mut trace_id = Vec::with_capacity(16);
        if self.ctx.trace_high != 0 {
            trace_id.extend_from_slice(&self.ctx.trace_high.to_be_bytes());
        }
        trace_id.extend_from_slice(&self.ctx.trace_low.to_be_bytes());
        let (ipv4, ipv6) = match local.address {
            Some(IpAddr::V4(a)) => (a.octets().to_vec(), Vec::new()),
            Some(IpAddr::V6(a)) => (Vec::new(), a.octets().to_vec()),
            None => (Vec::new(), Vec::new()),
        };
        otlp::zipkin::Span {
            trace_id,
            parent_id: self
                .ctx
                .parent_id
                .map(|p| p.to_le_bytes().to_vec())
                .unwrap_or_default(),
            id: self.ctx.span_id.to_le_bytes().to_vec(),
            kind: if self.ctx.client { 1 } else { 2 },
            name: self.name.clone(),
            timestamp: start,
            duration,
            local_endpoint: Some(otlp::zipkin::Endpoint {
                service_name: local.cluster.clone(),
                ipv4,
                ipv6,
                port: 0,
            }),
            annotations: vec![otlp::zipkin::Annotation {
                timestamp: start + duration,
                value: if self.ctx.client { "cr" } else { "ss" }.into(),
            }],
            tags: self
                .all_tags(local, env)
                .into_iter()
                .filter(|(_, v)| !v.is_empty())
                .collect(),
            shared: !self.ctx.client && shared_span_context,
        }
    }

    /// The span as OTLP (Envoy's OpenTelemetry tracer): tags become string attributes.
    pub fn otlp(&self, local: &LocalInfo, env: &dyn Fn(&str) -> Option<String>) -> otlp::Span {
        let mut trace_id = Vec::with_capacity(16);
        trace_id.extend_from_slice(&self.ctx.trace_high.to_be_bytes());
        trace_id.extend_from_slice(&self.ctx.trace_low.to_be_bytes());
        otlp::Span {
            trace_id,
            span_id: self.ctx.span_id.to_be_bytes().to_vec(),
            trace_state: self.ctx.tracestate.clone(),
            parent_span_id: self
                .ctx
                .parent_id
                .map(|p| p.to_be_bytes().to_vec())
                .unwrap_or_default(),
            name: self.name.clone(),
            kind: if self.ctx.client {
                otlp::SPAN_KIND_CLIENT
            } else {
                otlp::SPAN_KIND_SERVER
            },
            start_time_unix_nano: nanos(self.start),
            end_time_unix_nano: nanos(self.start + self.duration),
            attributes: self
                .all_tags(local, env)
                .into_iter()
                .map(|(k, v)| otlp::KeyValue::string(k, v))
                .collect(),
            status: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::trace::config::{CustomTag, Fraction, Provider, Zipkin};
    use crate::telemetry::trace::context::Format;

    fn span(client: bool) -> FinishedSpan {
        let config = TracingConfig {
            provider: None,
            client_sampling: Fraction {
                numerator: 100,
                denominator: 100,
            },
            random_sampling: Fraction::ALL_OF_10000,
            overall_sampling: Fraction::ALL_OF_10000,
            custom_tags: vec![CustomTag {
                tag: "pod".into(),
                value: TagValue::Environment {
                    name: "POD".into(),
                    default: "none".into(),
                },
            }],
            max_path_tag_length: 256,
            verbose: false,
            operation: None,
            egress: client,
        };
        FinishedSpan {
            config: Arc::new(config),
            provider: Arc::new(Provider::Zipkin(Zipkin {
                cluster: "z".into(),
                endpoint: "/".into(),
                hostname: "z".into(),
                proto: false,
                trace_id_128bit: false,
                shared_span_context: true,
            })),
            ctx: SpanContext {
                trace_high: 0,
                trace_low: 0xab,
                span_id: 0xcd,
                parent_id: Some(0xef),
                sampled: true,
                format: Format::B3Multi,
                tracestate: String::new(),
                client,
                shared: !client,
            },
            name: "host".into(),
            start: UNIX_EPOCH + Duration::from_micros(1_000_000),
            duration: Duration::from_micros(250),
            tags: vec![("http.method".into(), "GET".into())],
        }
    }

    fn local() -> LocalInfo {
        LocalInfo {
            node_id: "node".into(),
            cluster: "gw".into(),
            zone: String::new(),
            address: Some("10.0.0.1".parse().unwrap()),
        }
    }

    #[test]
    fn zipkin_json_as_envoy_writes_it() {
        let v = span(false).zipkin_json(true, &local(), &|_| Some("pod-1".into()));
        assert_eq!(
            v,
            serde_json::json!({
                "traceId": "00000000000000ab",
                "parentId": "00000000000000ef",
                "id": "00000000000000cd",
                "kind": "SERVER",
                "shared": true,
                "name": "host",
                "timestamp": 1_000_000,
                "duration": 250,
                "localEndpoint": {"ipv4": "10.0.0.1", "port": 0, "serviceName": "gw"},
                "tags": {"node_id": "node", "http.method": "GET", "pod": "pod-1"},
                "annotations": [{"value": "ss", "timestamp": 1_000_250}],
            })
        );
        let v = span(true).zipkin_json(true, &local(), &|_| None);
        assert_eq!(v["kind"], "CLIENT");
        assert!(v.get("shared").is_none());
        assert_eq!(v["annotations"][0]["value"], "cr");
        assert_eq!(v["tags"]["pod"], "none");
    }

    #[test]
    fn otlp_span_carries_ids_and_string_attributes() {
        let s = span(false).otlp(&local(), &|_| None);
        assert_eq!(
            s.trace_id,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xab]
        );
        assert_eq!(s.span_id, 0xcdu64.to_be_bytes());
        assert_eq!(s.parent_span_id, 0xefu64.to_be_bytes());
        assert_eq!(s.kind, otlp::SPAN_KIND_SERVER);
        assert_eq!(s.start_time_unix_nano, 1_000_000_000);
        assert_eq!(s.end_time_unix_nano, 1_000_250_000);
        let zone = s.attributes.iter().find(|a| a.key == "zone");
        assert_eq!(zone.and_then(|a| a.as_str()), Some(""));
    }
}
