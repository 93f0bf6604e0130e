//! `istio.alpn`: a config-only filter. Nothing runs per request; the connection manager keeps
//! the override and the upstream TLS connector reads it.

use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::{FilterDecl, Translated};

/// `istio.alpn` (`istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig`): the ALPN list a
/// routed request's upstream TLS connection offers instead of the cluster's, by the protocol
/// spoken upstream. istiod puts it on every gateway and sidecar-outbound connection manager
/// (PILOT_ENABLE_ALPN_FILTER, on by default) so that an ISTIO_MUTUAL pod's sidecar sees
/// `istio-http/1.1` or `istio-h2` and picks its HTTP chain on a port whose protocol it sniffs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AlpnOverride {
    /// Wire-format names; empty: no override for that protocol.
    pub http11: Vec<Vec<u8>>,
    pub http2: Vec<Vec<u8>>,
    /// Keeps pooled upstream connections made with these lists apart from the others.
    pub key: u64,
}

pub const ALPN_FILTER_TYPE: &str =
    "type.googleapis.com/istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig";

/// istio/api's `FilterConfig` for the ALPN filter (no Rust type ships it).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct AlpnFilterConfig {
    #[prost(message, repeated, tag = "1")]
    pub(crate) alpn_override: Vec<AlpnOverrideProto>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct AlpnOverrideProto {
    /// HTTP10 = 0, HTTP11 = 1, HTTP2 = 2.
    #[prost(int32, tag = "1")]
    pub(crate) upstream_protocol: i32,
    #[prost(string, repeated, tag = "2")]
    pub(crate) alpn_override: Vec<String>,
}

impl AlpnOverride {
    pub fn from_any(a: &Any) -> Result<AlpnOverride, String> {
        if a.type_url != ALPN_FILTER_TYPE {
            return Err(format!(
                "a {} wrapped in {} is not supported",
                ALPN_FILTER_TYPE, a.type_url
            ));
        }
        let c = AlpnFilterConfig::decode(a.value.as_slice())
            .map_err(|e| format!("cannot decode: {e}"))?;
        let mut out = AlpnOverride::default();
        for (i, o) in c.alpn_override.iter().enumerate() {
            let list: Vec<Vec<u8>> = o
                .alpn_override
                .iter()
                .map(|p| p.as_bytes().to_vec())
                .collect();
            if let Some(p) = list.iter().find(|p| p.is_empty() || p.len() > 255) {
                return Err(format!(
                    "alpn_override[{i}]: invalid protocol name '{}'",
                    String::from_utf8_lossy(p)
                ));
            }
            match o.upstream_protocol {
                // Portico answers HTTP/1.0 requests with 426, as Envoy does by default, so no
                // request is ever proxied as HTTP/1.0.
                0 => {}
                1 => out.http11 = list,
                2 => out.http2 = list,
                other => {
                    return Err(format!(
                        "alpn_override[{i}].upstream_protocol: unknown value {other}"
                    ))
                }
            }
        }
        let mut key = Vec::new();
        for l in [&out.http11, &out.http2] {
            for p in l {
                key.extend_from_slice(p);
                key.push(0);
            }
            key.push(0xff);
        }
        out.key = xxhash_rust::xxh64::xxh64(&key, 7);
        Ok(out)
    }

    /// The list for an upstream speaking HTTP/2 (`http2`) or HTTP/1.1; None: keep the cluster's.
    pub fn for_protocol(&self, http2: bool) -> Option<&[Vec<u8>]> {
        let l = if http2 { &self.http2 } else { &self.http11 };
        (!l.is_empty()).then_some(l.as_slice())
    }
}

/// The registry's translate function. A disabled entry configures nothing (Envoy runs no
/// disabled filter unless a route enables it, and a route cannot configure this one).
pub fn translate_filter(d: &FilterDecl<'_>) -> Result<Translated, String> {
    if d.disabled {
        return Ok(Translated::Inert);
    }
    Ok(Translated::Alpn(Arc::new(AlpnOverride::from_any(
        d.config,
    )?)))
}
