//! Istio's telemetry filters (HTTP and network): found through their wrappers here, translated
//! by `crate::telemetry::istio_stats` (`istio.stats`, the HTTP `istio.metadata_exchange`) or
//! accepted without effect (the network metadata exchange, whose ALPN Portico never offers).
//! gRPC stats are found here too and run in `grpc_stats`. They observe traffic and change
//! neither where a request goes nor whether it is allowed.

use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::google::protobuf::Any;
use std::sync::Arc;

use prost::Message;

use super::{FilterDecl, Translated};
use crate::telemetry::istio_stats;

/// `udpa.type.v1.TypedStruct` / `xds.type.v3.TypedStruct`: a config named by its type URL.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct TypedStruct {
    #[prost(string, tag = "1")]
    pub(crate) type_url: String,
}

pub(crate) const TYPED_STRUCTS: [&str; 2] = [
    "type.googleapis.com/udpa.type.v1.TypedStruct",
    "type.googleapis.com/xds.type.v3.TypedStruct",
];

/// The type a filter's config names, seeing through TypedStruct wrappers.
pub fn config_type(a: &Any) -> String {
    if TYPED_STRUCTS.contains(&a.type_url.as_str()) {
        if let Ok(ts) = TypedStruct::decode(a.value.as_slice()) {
            return ts.type_url;
        }
    }
    a.type_url.clone()
}

/// A Wasm filter's config (plain, or inside a TypedStruct as istiod up to 1.17 rendered it)
/// as (VM runtime, inline code, configuration's type).
fn wasm_parts(a: &Any) -> Option<(String, String, Option<String>)> {
    use envoy_types::pb::envoy::config::core::v3::async_data_source::Specifier;
    use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
    use envoy_types::pb::envoy::extensions::wasm::v3::plugin_config::Vm;
    if a.type_url == WASM_HTTP_TYPE || a.type_url == WASM_NETWORK_TYPE {
        // The HTTP and network Wasm messages have the same fields.
        let w = Wasm::decode(a.value.as_slice()).ok()?;
        let cfg = w.config?;
        let Some(Vm::VmConfig(vm)) = &cfg.vm else {
            return None;
        };
        let code = match vm.code.as_ref().and_then(|c| c.specifier.as_ref()) {
            Some(Specifier::Local(d)) => match &d.specifier {
                Some(corepb::data_source::Specifier::InlineString(s)) => s.clone(),
                _ => String::new(),
            },
            _ => String::new(),
        };
        return Some((
            vm.runtime.clone(),
            code,
            cfg.configuration.as_ref().map(config_type),
        ));
    }
    if TYPED_STRUCTS.contains(&a.type_url.as_str()) {
        let ts = istio_stats::TypedStruct::decode(a.value.as_slice()).ok()?;
        if ts.type_url != WASM_HTTP_TYPE && ts.type_url != WASM_NETWORK_TYPE {
            return None;
        }
        let j = istio_stats::struct_to_json(ts.value.as_ref()?);
        let cfg = &j["config"];
        let vm = &cfg["vm_config"];
        let vm = if vm.is_null() { &cfg["vmConfig"] } else { vm };
        let code = &vm["code"]["local"];
        let code = code["inline_string"]
            .as_str()
            .or(code["inlineString"].as_str())
            .unwrap_or_default();
        return Some((
            vm["runtime"].as_str().unwrap_or_default().to_string(),
            code.to_string(),
            cfg["configuration"]["@type"].as_str().map(str::to_string),
        ));
    }
    None
}

/// Istio's own telemetry filters: they observe traffic and feed Istio's metrics, and change
/// neither where a request goes nor whether it is allowed.
/// - `istio.stats` (`stats.PluginConfig`, HTTP and network): Istio's request/TCP metrics
///   (`translate_stats`; on TCP chains the listener translation reads it).
/// - `istio.metadata_exchange` network filter (`envoy.tcp.metadataexchange.config.MetadataExchange`):
///   see `without_mx_alpn`: Portico does not offer the ALPN that would make a peer speak it.
/// - `istio.metadata_exchange` HTTP filter (`io.istio.http.peer_metadata.Config`, 1.22+, or
///   the 1.18 null-VM Wasm): exchanges the peers' identity in `x-envoy-peer-metadata[-id]`
///   headers (`translate_peer_metadata`; the request path does the exchange).
/// - `envoy.filters.http.grpc_stats`: listed for the lookup through wrappers; it runs, in
///   `grpc_stats`.
///
/// Seen through `TypedStruct` (istiod 1.22+ wraps them) and through Istio's null-VM Wasm
/// plugins (`envoy.wasm.runtime.null` with Istio's built-in `envoy.wasm.*` code, plain or in
/// a TypedStruct as istiod up to 1.17 rendered them): a real Wasm module could do anything
/// and stays refused.
pub const ISTIO_TELEMETRY_TYPES: [&str; 4] = [
    "type.googleapis.com/stats.PluginConfig",
    MX_NETWORK_TYPE,
    "type.googleapis.com/io.istio.http.peer_metadata.Config",
    "type.googleapis.com/envoy.extensions.filters.http.grpc_stats.v3.FilterConfig",
];
pub const MX_NETWORK_TYPE: &str =
    "type.googleapis.com/envoy.tcp.metadataexchange.config.MetadataExchange";
pub(crate) const WASM_HTTP_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
pub(crate) const WASM_NETWORK_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.network.wasm.v3.Wasm";
/// Istio's null-VM plugins: code compiled into istio-proxy, named by these strings.
const ISTIO_NULL_VM_PLUGINS: [&str; 2] = ["envoy.wasm.metadata_exchange", "envoy.wasm.stats"];

/// The Istio telemetry type `a` configures (see `ISTIO_TELEMETRY_TYPES`), or None.
pub fn istio_telemetry(a: &Any) -> Option<&'static str> {
    let mut t = config_type(a);
    if let Some((runtime, code, configuration)) = wasm_parts(a) {
        if runtime != "envoy.wasm.runtime.null" || !ISTIO_NULL_VM_PLUGINS.contains(&code.as_str()) {
            return None;
        }
        if code == "envoy.wasm.stats" {
            return Some(ISTIO_TELEMETRY_TYPES[0]);
        }
        // The 1.18 metadata exchange plugin names the network filter's type as its
        // configuration: it is the HTTP exchange all the same.
        t = configuration?;
        if a.type_url == WASM_HTTP_TYPE || config_type(a) == WASM_HTTP_TYPE {
            return Some(ISTIO_TELEMETRY_TYPES[2]);
        }
    }
    ISTIO_TELEMETRY_TYPES.iter().copied().find(|k| *k == t)
}

/// The registry's translate function for the network metadata exchange, accepted without
/// effect.
pub fn translate_filter(_: &FilterDecl<'_>) -> Result<Translated, String> {
    Ok(Translated::Inert)
}

/// `istio.stats` in any of its encodings (see `crate::telemetry::istio_stats`). A disabled
/// entry reports nothing.
pub fn translate_stats(d: &FilterDecl<'_>) -> Result<Translated, String> {
    let cfg = istio_stats::StatsConfig::from_any(d.config)?;
    for w in &cfg.warnings {
        tracing::warn!(filter = d.name, "istio.stats: {w}");
    }
    if d.disabled {
        return Ok(Translated::Inert);
    }
    Ok(Translated::IstioStats(Arc::new(cfg)))
}

/// `istio.metadata_exchange` (`io.istio.http.peer_metadata.Config`, or the 1.18 null-VM
/// plugin, which exchanged the headers both ways).
pub fn translate_peer_metadata(d: &FilterDecl<'_>) -> Result<Translated, String> {
    let cfg = if wasm_parts(d.config).is_some() {
        istio_stats::PeerMetadataConfig::legacy_wasm()
    } else {
        istio_stats::PeerMetadataConfig::from_any(d.config)?
    };
    if d.disabled {
        return Ok(Translated::Inert);
    }
    Ok(Translated::PeerMetadata(Arc::new(cfg)))
}
