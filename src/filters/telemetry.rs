//! Filters accepted without effect: Istio's telemetry (HTTP and network) and gRPC stats. They
//! observe traffic and change neither where a request goes nor whether it is allowed.

use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use super::{FilterDecl, Translated};

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

/// Istio's own telemetry filters: they observe traffic and feed Istio's metrics, and change
/// neither where a request goes nor whether it is allowed. Until Istio telemetry lands (#15)
/// Portico accepts them and does not run them; the chain around them works as without them.
/// - `istio.stats` (`stats.PluginConfig`, HTTP and network): Istio's request/TCP metrics.
/// - `istio.metadata_exchange` network filter (`envoy.tcp.metadataexchange.config.MetadataExchange`):
///   see `without_mx_alpn`: Portico does not offer the ALPN that would make a peer speak it.
/// - `istio.metadata_exchange` HTTP filter (`io.istio.http.peer_metadata.Config`, 1.22+, or
///   the 1.18 null-VM Wasm): exchanges the peers' identity in `x-envoy-peer-metadata[-id]`
///   headers for the telemetry of both sides; Portico sends none.
/// (`envoy.filters.http.grpc_stats` is listed for the lookup through wrappers; it runs, in
/// `grpc_stats`.)
///
/// Seen through `TypedStruct` (istiod 1.22+ wraps them) and through Istio's null-VM Wasm
/// plugins (`envoy.wasm.runtime.null` with Istio's built-in `envoy.wasm.*` code): a real Wasm
/// module could do anything and stays refused.
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
    if a.type_url == WASM_HTTP_TYPE || a.type_url == WASM_NETWORK_TYPE {
        use envoy_types::pb::envoy::config::core::v3::async_data_source::Specifier;
        use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
        use envoy_types::pb::envoy::extensions::wasm::v3::plugin_config::Vm;
        // The HTTP and network Wasm messages have the same fields.
        let w = Wasm::decode(a.value.as_slice()).ok()?;
        let cfg = w.config?;
        let Some(Vm::VmConfig(vm)) = &cfg.vm else {
            return None;
        };
        let code = match vm.code.as_ref().and_then(|c| c.specifier.as_ref()) {
            Some(Specifier::Local(d)) => match &d.specifier {
                Some(corepb::data_source::Specifier::InlineString(s)) => s.as_str(),
                _ => "",
            },
            _ => "",
        };
        if vm.runtime != "envoy.wasm.runtime.null" || !ISTIO_NULL_VM_PLUGINS.contains(&code) {
            return None;
        }
        if code == "envoy.wasm.stats" {
            return Some(ISTIO_TELEMETRY_TYPES[0]);
        }
        t = cfg.configuration.as_ref().map(config_type)?;
    }
    ISTIO_TELEMETRY_TYPES.iter().copied().find(|k| *k == t)
}

/// The registry's translate function for the telemetry types: accepted, never run.
pub fn translate_filter(_: &FilterDecl<'_>) -> Result<Translated, String> {
    Ok(Translated::Inert)
}
