//! `envoy.filters.http.grpc_stats`: Envoy's per-cluster gRPC counters. The filter decides on
//! the request's headers whether (and under which name) a gRPC call is counted; the request
//! path counts its messages as the bodies pass and its status at the end, into the routed
//! cluster's scope: `cluster.<name>.grpc[.<service>.<method>].{<status>,success,failure,total,
//! request_message_count,response_message_count}`.
//!
//! `enable_upstream_stats` (a per-method `upstream_rq_time` histogram) is accepted and not
//! emitted: Portico's admin has no histograms yet, and the histogram changes nothing about a
//! request.

use std::collections::HashSet;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::grpc_stats::v3::{
    filter_config::PerMethodStatSpecifier, FilterConfig,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::{Decision, FilterDecl, FilterState, HttpFilter, Request, Translated};

pub const TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.grpc_stats.v3.FilterConfig";

#[derive(Debug)]
pub struct GrpcStatsFilter {
    pub name: String,
    /// `emit_filter_state`: the message counts go on the request's record.
    pub emit_filter_state: bool,
    /// `stats_for_all_methods`: every `/<service>/<method>` gets its own stats.
    pub all_methods: bool,
    /// `individual_method_stats_allowlist`, as the `<service>.<method>` stat prefixes.
    pub allowlist: HashSet<Arc<str>>,
    /// `replace_dots_in_grpc_service_name` (with all methods): `.` in the service becomes `_`.
    pub replace_dots: bool,
}

/// What the filter left on a gRPC request it counts.
#[derive(Debug, Default)]
pub struct GrpcCall {
    /// `<service>.<method>`, or None: counted without them (not on the allowlist).
    pub names: Option<Arc<str>>,
    pub emit_filter_state: bool,
    pub requests: FrameCounter,
    pub responses: FrameCounter,
}

pub fn translate_filter(d: &FilterDecl<'_>) -> Result<Translated, String> {
    let c = decode_config(d.config)?;
    let mut f = GrpcStatsFilter {
        name: d.name.to_string(),
        emit_filter_state: c.emit_filter_state,
        all_methods: false,
        allowlist: HashSet::new(),
        replace_dots: c.replace_dots_in_grpc_service_name,
    };
    match c.per_method_stat_specifier {
        Some(PerMethodStatSpecifier::StatsForAllMethods(b)) => f.all_methods = b.value,
        Some(PerMethodStatSpecifier::IndividualMethodStatsAllowlist(l)) => {
            for s in &l.services {
                for m in &s.method_names {
                    f.allowlist.insert(Arc::from(format!("{}.{m}", s.name)));
                }
            }
        }
        None => {}
    }
    Ok(Translated::Run(HttpFilter::GrpcStats(f)))
}

/// The config, plain or in a `TypedStruct` (whose value is the config as JSON).
fn decode_config(a: &Any) -> Result<FilterConfig, String> {
    if a.type_url == TYPE {
        return FilterConfig::decode(a.value.as_slice()).map_err(|e| format!("cannot decode: {e}"));
    }
    let json = super::typed_struct::value_json(a)?;
    crate::protojson::from_json(
        "envoy.extensions.filters.http.grpc_stats.v3.FilterConfig",
        &json,
    )
    .map_err(|e| format!("cannot decode: {e}"))
}

impl GrpcStatsFilter {
    /// Envoy's decodeHeaders: a gRPC request to a cluster whose path names a service and a
    /// method is counted.
    pub fn decode(&self, req: &Request<'_>, st: &mut FilterState) -> Decision {
        if req.picked.is_none() || !is_grpc(req.view.headers) {
            return Decision::Continue;
        }
        let Some((service, method)) = service_and_method(req.view.path) else {
            return Decision::Continue;
        };
        let names = if self.all_methods {
            let service = if self.replace_dots {
                std::borrow::Cow::Owned(service.replace('.', "_"))
            } else {
                std::borrow::Cow::Borrowed(service)
            };
            Some(Arc::from(format!("{service}.{method}")))
        } else if self.allowlist.is_empty() {
            None
        } else {
            let key = format!("{service}.{method}");
            self.allowlist.get(key.as_str()).cloned()
        };
        st.grpc = Some(Box::new(GrpcCall {
            names,
            emit_filter_state: self.emit_filter_state,
            ..Default::default()
        }));
        Decision::Continue
    }
}

/// `content-type: application/grpc` or `application/grpc+<codec>` (Envoy's
/// `isGrpcRequestHeaders`; gRPC-Web is another filter's).
fn is_grpc(h: &http::HeaderMap) -> bool {
    h.get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct == "application/grpc"
                || ct
                    .strip_prefix("application/grpc+")
                    .is_some_and(|rest| !rest.is_empty())
        })
}

/// `/<service>/<method>` (Envoy's `resolveServiceAndMethod`: exactly two non-empty parts;
/// the query is not part of the path).
pub fn service_and_method(path: &str) -> Option<(&str, &str)> {
    let path = path.split(['?', '#']).next().unwrap_or(path);
    let mut parts = path.split('/').filter(|p| !p.is_empty());
    let (service, method) = (parts.next()?, parts.next()?);
    parts.next().is_none().then_some((service, method))
}

/// Envoy's gRPC frame inspector: counts the length-prefixed messages in a byte stream that
/// arrives in arbitrary pieces.
#[derive(Debug, Default, Clone)]
pub struct FrameCounter {
    /// Messages whose prefix has been seen.
    pub frames: u64,
    /// Bytes of the current prefix read so far (0 to 4), and its length bytes.
    prefix_read: u8,
    len: u32,
    /// Payload bytes of the current message still to come.
    remaining: u64,
}

impl FrameCounter {
    /// Reads `data`; returns how many new messages began in it.
    pub fn inspect(&mut self, mut data: &[u8]) -> u64 {
        let before = self.frames;
        while !data.is_empty() {
            if self.remaining > 0 {
                let n = (self.remaining as usize).min(data.len());
                self.remaining -= n as u64;
                data = &data[n..];
                continue;
            }
            let b = data[0];
            data = &data[1..];
            match self.prefix_read {
                0 => {
                    // The flags byte starts a new message.
                    self.frames += 1;
                    self.len = 0;
                    self.prefix_read = 1;
                }
                1..=4 => {
                    self.len = (self.len << 8) | u32::from(b);
                    self.prefix_read += 1;
                    if self.prefix_read == 5 {
                        self.prefix_read = 0;
                        self.remaining = u64::from(self.len);
                    }
                }
                _ => self.prefix_read = 0,
            }
        }
        self.frames - before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_and_method_as_envoy_resolves_them() {
        assert_eq!(service_and_method("/pkg.Svc/Do"), Some(("pkg.Svc", "Do")));
        assert_eq!(
            service_and_method("/pkg.Svc/Do?x=1"),
            Some(("pkg.Svc", "Do"))
        );
        assert_eq!(service_and_method("/pkg.Svc"), None);
        assert_eq!(service_and_method("/a/b/c"), None);
        assert_eq!(service_and_method("/"), None);
    }

    #[test]
    fn frames_are_counted_across_pieces() {
        let msg = |n: usize| {
            let mut v = vec![0u8];
            v.extend_from_slice(&(n as u32).to_be_bytes());
            v.extend(std::iter::repeat_n(7u8, n));
            v
        };
        let mut stream = msg(3);
        stream.extend(msg(0));
        stream.extend(msg(300));
        let mut whole = FrameCounter::default();
        assert_eq!(whole.inspect(&stream), 3);
        for cut in 0..stream.len() {
            let mut c = FrameCounter::default();
            let a = c.inspect(&stream[..cut]);
            let b = c.inspect(&stream[cut..]);
            assert_eq!(a + b, 3, "cut at {cut}");
            assert_eq!(c.frames, 3);
        }
        let mut bytewise = FrameCounter::default();
        let n: u64 = stream.iter().map(|b| bytewise.inspect(&[*b])).sum();
        assert_eq!(n, 3);
    }

    #[test]
    fn config_in_every_form() {
        let plain = FilterConfig {
            emit_filter_state: true,
            per_method_stat_specifier: Some(PerMethodStatSpecifier::StatsForAllMethods(
                envoy_types::pb::google::protobuf::BoolValue { value: true },
            )),
            ..Default::default()
        };
        let any = Any {
            type_url: TYPE.into(),
            value: plain.encode_to_vec(),
        };
        let d = FilterDecl {
            name: "envoy.filters.http.grpc_stats",
            config: &any,
            disabled: false,
        };
        let Ok(Translated::Run(HttpFilter::GrpcStats(f))) = translate_filter(&d) else {
            panic!("translates");
        };
        assert!(f.emit_filter_state && f.all_methods);
        let wrapped = super::super::typed_struct::wrap_json(
            TYPE,
            &serde_json::json!({
                "emit_filter_state": true,
                "individual_method_stats_allowlist": {
                    "services": [{"name": "pkg.Svc", "method_names": ["Do", "Undo"]}]
                }
            }),
        );
        let d = FilterDecl {
            config: &wrapped,
            ..d
        };
        let Ok(Translated::Run(HttpFilter::GrpcStats(f))) = translate_filter(&d) else {
            panic!("translates");
        };
        assert!(!f.all_methods);
        assert!(f.allowlist.contains("pkg.Svc.Undo"));
    }
}
