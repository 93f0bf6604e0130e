//! Wires a bootstrap into running parts: worker runtime, listeners, admin, ADS client.

use std::sync::Arc;
use std::time::Duration;

use crate::bootstrap::Bootstrap;
use crate::proxy::listeners::ListenerManager;
use crate::xds::client::{AdsClient, Api};
use crate::xds::commit::ConfigWorker;
use crate::xds::store::Store;
use crate::State;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("invalid bootstrap: {}", .0.join("; "))]
    Static(Vec<String>),
    #[error("cannot bind admin address {0}: {1}")]
    Admin(std::net::SocketAddr, std::io::Error),
    #[error("cannot start runtime: {0}")]
    Runtime(std::io::Error),
    #[error("ADS cluster '{0}': {1}")]
    AdsCluster(String, String),
}

/// Checks everything a bootstrap implies without serving: the static resources translate
/// and the ADS cluster has an address.
pub fn validate(b: &Bootstrap) -> Result<Store, ServerError> {
    let sr = b.proto.static_resources.clone().unwrap_or_default();
    let mut store = Store::default();
    store
        .add_static(&sr.listeners, &sr.clusters)
        .map_err(ServerError::Static)?;
    if let Some(ads) = &b.ads {
        ads_target(b, &store, &ads.cluster_name)?;
    }
    bootstrap_tracer(b)?;
    global_connection_limit(&b.proto).map_err(|e| ServerError::Static(vec![e]))?;
    bootstrap_extensions(&b.proto).map_err(|e| ServerError::Static(vec![e]))?;
    runtime_layers(&b.proto).map_err(|e| ServerError::Static(vec![e]))?;
    if let Some(a) = &b.proto.admin {
        crate::admin::access_logs(a).map_err(|e| ServerError::Static(vec![e]))?;
    }
    crate::admin::sinks::translate(&b.proto).map_err(|e| ServerError::Static(vec![e]))?;
    if let Some(sc) = &b.proto.stats_config {
        crate::admin::stats::StatsMatcher::from_bootstrap(sc)
            .map_err(|e| ServerError::Static(vec![e]))?;
    }
    Ok(store)
}

/// `bootstrap_extensions` istio-agent writes: the internal listener registry (Portico's
/// internal listeners, istiod's HBONE `connect_originate`, need no registry settings; its
/// `buffer_size_kb` tunes Envoy's in-memory pipe) and Istio's `metadata_discovery` (workload
/// metadata for ambient peers' telemetry labels, which Portico's `istio.stats` reads from the
/// peer exchange instead). Any other extension is refused, as Envoy refuses one it lacks.
fn bootstrap_extensions(
    b: &envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap,
) -> Result<(), String> {
    const KNOWN: [&str; 2] = [
        "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener",
        "type.googleapis.com/istio.workload.BootstrapExtension",
    ];
    for (i, e) in b.bootstrap_extensions.iter().enumerate() {
        let t = e
            .typed_config
            .as_ref()
            .map(crate::filters::telemetry::config_type)
            .unwrap_or_default();
        if !KNOWN.contains(&t.as_str()) {
            return Err(format!(
                "bootstrap_extensions[{i}] '{}': extension type '{t}' is not supported",
                e.name
            ));
        }
    }
    Ok(())
}

/// `layered_runtime`: static layers and the admin layer are what Portico has; an RTDS or
/// disk layer would change runtime values Portico would never see, so it is refused.
fn runtime_layers(
    b: &envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap,
) -> Result<(), String> {
    use envoy_types::pb::envoy::config::bootstrap::v3::runtime_layer::LayerSpecifier as L;
    for (i, l) in b
        .layered_runtime
        .iter()
        .flat_map(|r| r.layers.iter())
        .enumerate()
    {
        match &l.layer_specifier {
            Some(L::StaticLayer(_)) | Some(L::AdminLayer(_)) => {}
            Some(L::DiskLayer(_)) => {
                return Err(format!(
                    "layered_runtime.layers[{i}] '{}': disk_layer is not supported",
                    l.name
                ))
            }
            Some(L::RtdsLayer(_)) => {
                return Err(format!(
                    "layered_runtime.layers[{i}] '{}': rtds_layer is not supported",
                    l.name
                ))
            }
            None => {
                return Err(format!(
                    "layered_runtime.layers[{i}] '{}': no layer specifier set",
                    l.name
                ))
            }
        }
    }
    Ok(())
}

const DOWNSTREAM_CONNECTIONS_MONITOR: &str =
    "envoy.resource_monitors.global_downstream_max_connections";
const DOWNSTREAM_CONNECTIONS_TYPE: &str = "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig";

/// The overload manager's global downstream connection limit: the
/// `global_downstream_max_connections` resource monitor, else the older runtime key
/// `overload.global_downstream_max_connections` (Istio before 1.28 set that), else none.
/// Other resource monitors and any overload action are refused by name: what they would do
/// (shed requests, stop accepting) decides whether a request is served, and Portico does not
/// implement them.
fn global_connection_limit(
    b: &envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap,
) -> Result<Option<u64>, String> {
    use prost::Message;
    let mut limit = None;
    if let Some(o) = &b.overload_manager {
        for (i, m) in o.resource_monitors.iter().enumerate() {
            let at = format!("overload_manager.resource_monitors[{i}]");
            let any = match &m.config_type {
                Some(envoy_types::pb::envoy::config::overload::v3::resource_monitor::ConfigType::TypedConfig(a)) => a,
                None => return Err(format!("{at}: typed_config is required")),
            };
            if m.name != DOWNSTREAM_CONNECTIONS_MONITOR
                && any.type_url != DOWNSTREAM_CONNECTIONS_TYPE
            {
                return Err(format!(
                    "{at}: resource monitor '{}' is not supported (only {DOWNSTREAM_CONNECTIONS_MONITOR})",
                    m.name
                ));
            }
            let cfg = envoy_types::pb::envoy::extensions::resource_monitors::downstream_connections::v3::DownstreamConnectionsConfig::decode(any.value.as_slice())
                .map_err(|e| format!("{at}: {e}"))?;
            if cfg.max_active_downstream_connections <= 0 {
                return Err(format!(
                    "{at}.max_active_downstream_connections: value must be greater than 0"
                ));
            }
            limit = Some(cfg.max_active_downstream_connections as u64);
        }
        if let Some((i, a)) = o.actions.iter().enumerate().next() {
            return Err(format!(
                "overload_manager.actions[{i}]: overload action '{}' is not supported",
                a.name
            ));
        }
    }
    Ok(limit.or_else(|| static_runtime_u64(b, "overload.global_downstream_max_connections")))
}

/// The ADS server's address (a socket address or a unix socket); None when the cluster has
/// no endpoint (valid config to Envoy, which then never receives any).
fn ads_target(
    b: &Bootstrap,
    store: &Store,
    cluster: &str,
) -> Result<Option<crate::xds::grpc::GrpcTarget>, ServerError> {
    let err = |m: &str| ServerError::AdsCluster(cluster.to_string(), m.to_string());
    let c = store
        .clusters
        .get(cluster)
        .ok_or_else(|| err("not defined in static_resources.clusters"))?;
    if c.value.inline.is_none() {
        return Err(err("must be STATIC or STRICT_DNS"));
    }
    Ok(crate::xds::grpc::bootstrap_target(&b.proto, cluster))
}

/// Runs until SIGINT or SIGTERM.
pub fn run(b: Bootstrap, concurrency: usize) -> Result<(), ServerError> {
    run_drained(b, concurrency, crate::proxy::Drain::default())
}

/// As [`run`], draining changed filter chains and listeners as `drain` says.
pub fn run_drained(
    b: Bootstrap,
    concurrency: usize,
    drain: crate::proxy::Drain,
) -> Result<(), ServerError> {
    let store = validate(&b)?;
    crate::release_freed_memory();
    // pingora's timeouts (connect, its HTTP/1 and HTTP/2 sessions' reads and writes) run on
    // its own clock thread below 15 minutes, and that thread, once a first timeout starts it,
    // wakes every 10 ms for the life of the process, busy or idle. Every timeout of a second
    // or more goes on the tokio timers of the runtime that sets it instead (a worker's, or the
    // control thread's): no thread, no wake-ups while idle.
    pingora_timeout::fast_timeout::set_fast_timeout_to_tokio_threshold(Some(Duration::ZERO));
    let workers = Workers::start(concurrency.max(1)).map_err(ServerError::Runtime)?;
    // xDS, admin and DNS run on their own thread so a large push never stalls a worker.
    let control = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ServerError::Runtime)?;
    let worker_handles = workers.handles.clone();
    let state = Arc::new(State::new(Some(b.proto.clone())));
    if let Some(max) =
        global_connection_limit(&b.proto).map_err(|e| ServerError::Static(vec![e]))?
    {
        state
            .global_connections
            .max
            .store(max, std::sync::atomic::Ordering::Relaxed);
    }
    control.block_on(async move {
        let stop = shutdown_signal();
        reopen_logs_on_sigusr1();
        let admin = match b.admin_address {
            Some(addr) => Some(
                crate::admin::bind(addr)
                    .await
                    .map_err(|e| ServerError::Admin(addr, e))?,
            ),
            None => None,
        };
        let listeners = ListenerManager::new(worker_handles, state.clone()).with_drain(drain);
        let _ = state.listeners.set(Arc::new(listeners.clone()));
        let mut worker = ConfigWorker::new(state.clone(), Store::default(), listeners.clone());
        // SDS streams may dial any static cluster of the bootstrap.
        let targets = b
            .proto
            .static_resources
            .iter()
            .flat_map(|s| s.clusters.iter())
            .map(|c| (c.name.clone(), crate::xds::grpc::bootstrap_target(&b.proto, &c.name)))
            .collect();
        worker.sds = crate::xds::sds::SdsManager::new(b.proto.node.clone().unwrap_or_default(), targets);
        worker.commit(store.clone()).map_err(ServerError::Static)?;
        start_tracer(&b, &state);
        if let Some(l) = admin {
            tracing::info!(addr = %l.local_addr().map(|a| a.to_string()).unwrap_or_default(), "admin listening");
            tokio::spawn(crate::admin::serve(l, state.clone()));
        }
        let sinks = crate::admin::sinks::translate(&b.proto).map_err(|e| ServerError::Static(vec![e]))?;
        tokio::spawn(crate::admin::sinks::run(sinks, state.clone()));
        let ads = b.ads.as_ref().map(|a| ads_target(&b, &store, &a.cluster_name)).transpose()?;
        if let (Some(a), Some(None)) = (&b.ads, &ads) {
            tracing::error!(cluster = %a.cluster_name, "the ADS cluster has no endpoint: no dynamic config will arrive");
        }
        match ads {
            Some(Some(target)) => {
                let node = b.proto.node.clone().unwrap_or_default();
                let api = if b.ads.as_ref().is_some_and(|a| a.delta) { Api::Delta } else { Api::Sotw };
                let mut client = AdsClient::new(worker, node, target, api, b.lds_via_ads, b.cds_via_ads);
                client.node_first_only = b.ads.as_ref().is_some_and(|a| a.set_node_on_first_message_only);
                tokio::spawn(client.run());
            }
            // Static config only, or an ADS cluster without endpoints (then nothing will
            // arrive, so never ready, as Envoy). The worker keeps the static listeners alive.
            _ => {
                if ads.is_none() {
                    worker.ads_ready = true;
                    worker.update_ready();
                }
                tokio::spawn(async move {
                    loop {
                        worker.start_dns_refresh();
                        worker.sleep_applying_health(Duration::from_secs(5)).await;
                    }
                });
            }
        }
        let signalled = tokio::select! {
            _ = stop => true,
            _ = state.quit.notified() => false,
        };
        if signalled {
            // SIGTERM (or SIGINT): no new connections; the open ones finish the request in
            // flight and close, within the drain time. A second signal cuts it short.
            tracing::info!(drain_time = ?drain.time, "shutting down: draining open connections");
            let again = shutdown_signal();
            tokio::select! {
                () = listeners.shutdown(drain.time) => {}
                () = again => tracing::info!("second signal: not waiting for open connections"),
            }
        }
        tracing::info!("shutting down");
        Ok::<(), ServerError>(())
    })?;
    // `/quitquitquit` stops now, as Envoy; what is left is closed with the runtimes.
    workers.shutdown();
    // What the access logs still buffer is written out, as Envoy's log files do on exit.
    crate::telemetry::access_log::sink::flush_all(Duration::from_secs(2));
    Ok(())
}

/// Envoy's threading model: each worker thread runs its own single-threaded runtime. A
/// work-stealing pool would move a connection's tasks between threads and pay for the
/// synchronisation on every wake-up; a proxy's connections need none of it.
struct Workers {
    handles: Vec<tokio::runtime::Handle>,
    stop: tokio::sync::watch::Sender<bool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Workers {
    fn start(n: usize) -> std::io::Result<Workers> {
        let (stop, _) = tokio::sync::watch::channel(false);
        let mut w = Workers {
            handles: Vec::with_capacity(n),
            stop,
            threads: Vec::with_capacity(n),
        };
        for i in 0..n {
            let (tx, rx) = std::sync::mpsc::channel();
            let mut stopped = w.stop.subscribe();
            let thread = std::thread::Builder::new()
                .name(format!("portico-worker-{i}"))
                .spawn(move || {
                    // Made first, so it outlives the runtime and gives its blocks back last.
                    let _kept = crate::alloc::ThreadCache::on();
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = tx.send(Ok(rt.handle().clone()));
                    rt.block_on(async move {
                        let trim = tokio::spawn(trim_kept_blocks());
                        let _ = stopped.wait_for(|s| *s).await;
                        trim.abort();
                        // The access log lines this worker still holds go to their writers.
                        crate::telemetry::access_log::sink::flush_thread_local();
                    });
                    rt.shutdown_timeout(Duration::from_secs(1));
                })?;
            w.threads.push(thread);
            let handle = rx
                .recv()
                .map_err(|_| std::io::Error::other("worker thread exited during start-up"))??;
            w.handles.push(handle);
        }
        Ok(w)
    }

    fn shutdown(mut self) {
        let _ = self.stop.send(true);
        for t in std::mem::take(&mut self.threads) {
            let _ = t.join();
        }
    }
}

/// A worker's kept medium blocks (`alloc::ThreadCache`) that went unused for a second go
/// back to the allocator: the cache follows the load down, and a start-up burst's blocks do
/// not stay. One wake-up a second.
async fn trim_kept_blocks() {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        crate::alloc::trim();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // On an early error return: stop the threads instead of leaving them parked.
        let _ = self.stop.send(true);
    }
}

/// SIGUSR1 reopens every access log file (log rotation), as Envoy does. Must run inside the
/// runtime.
fn reopen_logs_on_sigusr1() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::user_defined1()) {
        Ok(mut s) => {
            tokio::spawn(async move {
                while s.recv().await.is_some() {
                    crate::telemetry::access_log::sink::reopen_all();
                }
            });
        }
        Err(e) => tracing::warn!("cannot install the SIGUSR1 handler: {e}"),
    }
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called, not when it
/// is first polled, so a signal that arrives during start-up is not lost.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    async move {
        match (term, int) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
}

/// The span exporter, on the control thread: the node as spans show it, Envoy's batching
/// runtime keys from the bootstrap's static runtime layers, and the collectors' hosts from
/// the current snapshot.
fn start_tracer(b: &Bootstrap, state: &Arc<State>) {
    use crate::telemetry::trace::{Batching, LocalInfo, Resolve};
    let node = b.proto.node.clone().unwrap_or_default();
    let local = LocalInfo {
        node_id: node.id,
        cluster: node.cluster,
        zone: node.locality.map(|l| l.zone).unwrap_or_default(),
        address: local_address(),
    };
    let batching = Batching::from_runtime(|k| static_runtime_u64(&b.proto, k));
    let weak = Arc::downgrade(state);
    let resolve: Resolve = Arc::new(move |cluster: &str| {
        weak.upgrade()
            .and_then(|s| {
                s.snapshot()
                    .clusters
                    .get(cluster)
                    .map(|c| c.endpoints.hosts.iter().map(|h| h.addr).collect())
            })
            .unwrap_or_default()
    });
    // Checked by `validate`.
    let default_provider = bootstrap_tracer(b).ok().flatten();
    state
        .tracer
        .start(local, default_provider, batching, resolve);
}

/// The bootstrap's `tracing.http` driver (istio-agent's Zipkin), used by connection managers
/// whose `tracing` names no provider. Envoy refuses a bootstrap whose driver it cannot build.
// `Bootstrap.tracing` is deprecated in the proto, yet Envoy 1.40 still reads it and
// istio-agent still writes it.
#[allow(deprecated)]
fn bootstrap_tracer(
    b: &Bootstrap,
) -> Result<Option<crate::telemetry::trace::Provider>, ServerError> {
    let Some(http) = b.proto.tracing.as_ref().and_then(|t| t.http.as_ref()) else {
        return Ok(None);
    };
    crate::telemetry::trace::Provider::translate(http)
        .map(Some)
        .map_err(|e| ServerError::Static(vec![format!("tracing.http: {e}")]))
}

/// A number from the bootstrap's static runtime layers (`layered_runtime.layers[].static_layer`),
/// the last layer that has it winning, with the key flat (`a.b.c`) or nested as Envoy reads both.
fn static_runtime_u64(
    b: &envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap,
    key: &str,
) -> Option<u64> {
    use envoy_types::pb::envoy::config::bootstrap::v3::runtime_layer::LayerSpecifier;
    use envoy_types::pb::google::protobuf::value::Kind;
    use envoy_types::pb::google::protobuf::Struct;
    fn find(s: &Struct, key: &str) -> Option<u64> {
        if let Some(v) = s.fields.get(key) {
            return match &v.kind {
                Some(Kind::NumberValue(n)) if *n >= 0.0 => Some(*n as u64),
                Some(Kind::StringValue(t)) => t.parse().ok(),
                _ => None,
            };
        }
        let (head, rest) = key.split_once('.')?;
        match &s.fields.get(head)?.kind {
            Some(Kind::StructValue(inner)) => find(inner, rest),
            _ => None,
        }
    }
    b.layered_runtime
        .as_ref()?
        .layers
        .iter()
        .rev()
        .find_map(|l| match &l.layer_specifier {
            Some(LayerSpecifier::StaticLayer(s)) => find(s, key),
            _ => None,
        })
}

/// Envoy's local address for spans: the first non-loopback IPv4 address of an interface.
fn local_address() -> Option<std::net::IpAddr> {
    let mut addrs: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list that freeifaddrs releases below; each entry is read
    // only while the list is alive, and `ifa_addr` is checked for null and its family
    // before it is read as an IPv4 address.
    unsafe {
        if libc::getifaddrs(&mut addrs) != 0 {
            return None;
        }
        let mut out = None;
        let mut cur = addrs;
        while !cur.is_null() {
            let ifa = &*cur;
            if !ifa.ifa_addr.is_null() && i32::from((*ifa.ifa_addr).sa_family) == libc::AF_INET {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if !ip.is_loopback() {
                    out = Some(std::net::IpAddr::V4(ip));
                    break;
                }
            }
            cur = ifa.ifa_next;
        }
        libc::freeifaddrs(addrs);
        out
    }
}

#[cfg(test)]
mod tracer_tests {
    use super::static_runtime_u64;
    use envoy_types::pb::envoy::config::bootstrap::v3::{
        runtime_layer::LayerSpecifier, Bootstrap, LayeredRuntime, RuntimeLayer,
    };
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

    fn num(n: f64) -> Value {
        Value {
            kind: Some(Kind::NumberValue(n)),
        }
    }

    fn layer(fields: Vec<(&str, Value)>) -> RuntimeLayer {
        RuntimeLayer {
            name: "l".into(),
            layer_specifier: Some(LayerSpecifier::StaticLayer(Struct {
                fields: fields
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect(),
            })),
        }
    }

    #[test]
    fn runtime_keys_flat_or_nested_last_layer_wins() {
        let nested = Value {
            kind: Some(Kind::StructValue(Struct {
                fields: [(
                    "zipkin".to_string(),
                    Value {
                        kind: Some(Kind::StructValue(Struct {
                            fields: [("min_flush_spans".to_string(), num(2.0))].into(),
                        })),
                    },
                )]
                .into(),
            })),
        };
        let b = Bootstrap {
            layered_runtime: Some(LayeredRuntime {
                layers: vec![
                    layer(vec![("tracing.zipkin.flush_interval_ms", num(100.0))]),
                    layer(vec![("tracing", nested)]),
                ],
            }),
            ..Default::default()
        };
        assert_eq!(
            static_runtime_u64(&b, "tracing.zipkin.min_flush_spans"),
            Some(2)
        );
        assert_eq!(
            static_runtime_u64(&b, "tracing.zipkin.flush_interval_ms"),
            Some(100)
        );
        assert_eq!(
            static_runtime_u64(&b, "tracing.opentelemetry.min_flush_spans"),
            None
        );
    }
}

#[cfg(test)]
mod bootstrap_section_tests {
    use super::{bootstrap_extensions, global_connection_limit};
    use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;

    fn bootstrap(json: serde_json::Value) -> Bootstrap {
        let _pool = crate::protojson::pool();
        crate::protojson::dynamic_from_json("envoy.config.bootstrap.v3.Bootstrap", &json)
            .expect("proto json")
            .transcode_to()
            .expect("transcode")
    }

    #[test]
    fn the_global_connection_limit_from_the_monitor_or_the_runtime_key() {
        let monitor = bootstrap(
            serde_json::json!({"overload_manager": {"resource_monitors": [{
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                    "max_active_downstream_connections": 500
                }
            }]}}),
        );
        assert_eq!(global_connection_limit(&monitor), Ok(Some(500)));
        let runtime = bootstrap(serde_json::json!({"layered_runtime": {"layers": [{
            "name": "global config",
            "static_layer": {"overload.global_downstream_max_connections": 700}
        }]}}));
        assert_eq!(global_connection_limit(&runtime), Ok(Some(700)));
        assert_eq!(global_connection_limit(&Bootstrap::default()), Ok(None));
        let action = bootstrap(serde_json::json!({"overload_manager": {"actions": [{
            "name": "envoy.overload_actions.stop_accepting_requests",
            "triggers": [{"name": "x", "threshold": {"value": 0.9}}]
        }]}}));
        assert_eq!(
            global_connection_limit(&action),
            Err("overload_manager.actions[0]: overload action 'envoy.overload_actions.stop_accepting_requests' is not supported".into())
        );
    }

    #[test]
    fn istio_agents_bootstrap_extensions_are_accepted_others_refused() {
        let istio = bootstrap(serde_json::json!({"bootstrap_extensions": [
            {"name": "envoy.bootstrap.internal_listener", "typed_config": {
                "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
                "type_url": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener",
                "value": {"buffer_size_kb": 64}
            }},
            {"name": "metadata_discovery", "typed_config": {
                "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
                "type_url": "type.googleapis.com/istio.workload.BootstrapExtension",
                "value": {"config_source": {"ads": {}}}
            }}
        ]}));
        assert_eq!(bootstrap_extensions(&istio), Ok(()));
        let other = bootstrap(serde_json::json!({"bootstrap_extensions": [
            {"name": "wasm", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.wasm.v3.WasmService"}}
        ]}));
        assert_eq!(
            bootstrap_extensions(&other),
            Err("bootstrap_extensions[0] 'wasm': extension type 'type.googleapis.com/envoy.extensions.wasm.v3.WasmService' is not supported".into())
        );
    }
}
