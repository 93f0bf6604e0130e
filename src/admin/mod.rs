//! The Envoy-style admin endpoint: `/ready`, `/stats/prometheus`, `/config_dump`, `/clusters`,
//! `/server_info`.

pub mod stats;

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use envoy_types::pb::envoy::admin::v3 as admin;
use envoy_types::pb::google::protobuf::{Any, Timestamp};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use prost::Name;

use crate::State;

pub async fn serve(listener: tokio::net::TcpListener, state: Arc<State>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("admin accept failed: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(handle(&req, &state)) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!("admin connection: {e}");
            }
        });
    }
}

fn reply(status: u16, content_type: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
    if let Ok(v) = http::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(http::header::CONTENT_TYPE, v);
    }
    r
}

fn handle(req: &Request<Incoming>, state: &State) -> Response<Full<Bytes>> {
    let query = req.uri().query().unwrap_or("");
    match req.uri().path() {
        "/ready" => {
            if state.ready.load(Ordering::Relaxed) {
                reply(200, "text/plain; charset=UTF-8", "LIVE\n")
            } else {
                reply(503, "text/plain; charset=UTF-8", "PRE_INITIALIZING\n")
            }
        }
        "/stats/prometheus" => {
            let snap = state.snapshot();
            // Envoy lists a configured limiter's counters before its first request: bind the
            // serving chains' limiters to theirs (routes' overrides bind on first use).
            for l in snap.listeners.values() {
                for c in &l.chains {
                    for f in c.def.hcm().map_or(&[][..], |h| &h.filters) {
                        if let crate::filters::HttpFilter::LocalRateLimit(rl) = f {
                            rl.config.stats();
                        }
                    }
                }
            }
            let text = state.stats.render(&|name| {
                snap.clusters
                    .get(name)
                    .map(|c| (c.healthy_count(), c.endpoints.hosts.len()))
            });
            reply(200, "text/plain; version=0.0.4", text)
        }
        "/config_dump" => match config_dump(state, query.contains("include_eds")) {
            Ok(v) => {
                // The descriptor pool the dump needed is gone again: give its memory back.
                crate::release_freed_memory();
                reply(200, "application/json", serde_json::to_string_pretty(&v).unwrap_or_default())
            }
            Err(e) => reply(500, "text/plain", format!("config dump failed: {e}\n")),
        },
        "/clusters" => reply(200, "text/plain", clusters(state)),
        "/listeners" if query.split('&').any(|p| p == "format=json") => {
            reply(200, "application/json", listeners_json(state))
        }
        "/listeners" => reply(200, "text/plain", listeners_text(state)),
        "/server_info" => {
            let state_name = if state.ready.load(Ordering::Relaxed) { "LIVE" } else { "PRE_INITIALIZING" };
            let v = serde_json::json!({
                "version": concat!("portico/", env!("CARGO_PKG_VERSION")),
                "state": state_name,
                "uptime_current_epoch": format!("{}s", state.started.elapsed().as_secs()),
                "node": state.bootstrap_node_json(),
            });
            reply(200, "application/json", v.to_string())
        }
        "/" => reply(
            200,
            "text/plain",
            "admin commands are:\n  /clusters\n  /config_dump\n  /listeners\n  /ready\n  /server_info\n  /stats/prometheus\n",
        ),
        _ => reply(404, "text/plain", "invalid path. admin commands are: /clusters /config_dump /listeners /ready /server_info /stats/prometheus\n"),
    }
}

/// Envoy's `/listeners`: one `name::address` line per listening address, the listener's
/// `address` first, then its `additional_addresses`.
fn listeners_text(state: &State) -> String {
    let store = state.serving.load().store.clone();
    let mut out = String::new();
    for (name, item) in store.listeners.iter() {
        for b in &item.value.binds {
            out.push_str(&format!("{name}::{}\n", b.addr));
        }
    }
    out
}

/// `/listeners?format=json`: Envoy's `admin.v3.Listeners`.
fn listeners_json(state: &State) -> String {
    let store = state.serving.load().store.clone();
    let addr = |a: &std::net::SocketAddr| serde_json::json!({"socket_address": {"address": a.ip().to_string(), "port_value": a.port()}});
    let statuses: Vec<serde_json::Value> = store
        .listeners
        .iter()
        .map(|(name, item)| {
            let mut v = serde_json::json!({"name": name, "local_address": addr(&item.value.addr)});
            let more: Vec<_> = item
                .value
                .binds
                .iter()
                .skip(1)
                .map(|b| addr(&b.addr))
                .collect();
            if !more.is_empty() {
                v["additional_local_addresses"] = serde_json::Value::Array(more);
            }
            v
        })
        .collect();
    serde_json::to_string_pretty(&serde_json::json!({"listener_statuses": statuses}))
        .unwrap_or_default()
}

/// Envoy's `/clusters` text format: one `cluster::host::stat::value` line per fact.
fn clusters(state: &State) -> String {
    let snap = state.snapshot();
    let mut names: Vec<_> = snap.clusters.keys().collect();
    names.sort();
    let mut out = String::new();
    for name in names {
        let Some(c) = snap.clusters.get(name) else {
            continue;
        };
        let _ = writeln!(out, "{name}::observability_name::{name}");
        for (i, h) in c.endpoints.hosts.iter().enumerate() {
            let a = h.addr;
            let active = c.active.get(i).map_or(0, |v| v.load(Ordering::Relaxed));
            let _ = writeln!(out, "{name}::{a}::rq_active::{active}");
            let _ = writeln!(out, "{name}::{a}::weight::{}", h.weight);
            let _ = writeln!(out, "{name}::{a}::priority::{}", h.priority);
            // The checker's live flags, as Envoy shows them (they change between rebuilds).
            let hc = match c.hc.get(i) {
                Some(Some(_)) => c
                    .stats
                    .health
                    .flags_of(&a)
                    .or(Some(crate::snapshot::health_check::HcFlags::NEW)),
                _ => None,
            };
            let flags = crate::snapshot::health_check::flags_text(h.health, hc.as_ref());
            let _ = writeln!(out, "{name}::{a}::health_flags::{flags}");
        }
    }
    out
}

fn pack<M: prost::Message + Name>(m: &M) -> Any {
    Any {
        type_url: M::type_url(),
        value: m.encode_to_vec(),
    }
}

fn ts(t: SystemTime) -> Option<Timestamp> {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).ok()?;
    Some(Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    })
}

/// One resource as proto-JSON. A resource holding an `Any` Portico has no descriptor for (an
/// optional filter of another vendor, say) still shows, with the reason it cannot be expanded.
fn render(any: &Any) -> serde_json::Value {
    crate::protojson::any_to_json(any).unwrap_or_else(
        |e| serde_json::json!({ "@type": any.type_url, "portico_render_error": e.to_string() }),
    )
}

fn stamp(t: SystemTime) -> serde_json::Value {
    ts(t)
        .and_then(|t| crate::protojson::to_json("google.protobuf.Timestamp", &t).ok())
        .unwrap_or(serde_json::Value::Null)
}

/// A secret as Envoy dumps it: the private key (and its password) replaced by "[redacted]",
/// in whatever form it came (inline bytes, inline string or file name).
fn redacted_secret(
    raw: &crate::xds::types::Raw<
        envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret,
    >,
) -> Any {
    use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::secret::Type;
    let Ok(mut secret) = raw.decode() else {
        return raw.to_any();
    };
    let redact = |d: &mut Option<envoy_types::pb::envoy::config::core::v3::DataSource>| {
        if let Some(spec) = d.as_mut().and_then(|d| d.specifier.as_mut()) {
            *spec = match spec {
                Specifier::InlineBytes(_) => Specifier::InlineBytes(b"[redacted]".to_vec()),
                Specifier::InlineString(_) => Specifier::InlineString("[redacted]".into()),
                Specifier::Filename(_) => Specifier::Filename("[redacted]".into()),
                Specifier::EnvironmentVariable(_) => {
                    Specifier::EnvironmentVariable("[redacted]".into())
                }
            };
        }
    };
    if let Some(Type::TlsCertificate(c)) = &mut secret.r#type {
        redact(&mut c.private_key);
        redact(&mut c.password);
    }
    if let Some(Type::GenericSecret(g)) = &mut secret.r#type {
        redact(&mut g.secret);
    }
    envoy_types::util::pack_any(secret)
}

/// Envoy's `UpdateFailureState` for a resource whose last update was refused.
fn error_state(kind: crate::xds::types::Kind, f: &crate::xds::store::Failure) -> serde_json::Value {
    use crate::xds::types::{Kind, Raw};
    let mut v = serde_json::json!({
        "last_update_attempt": stamp(f.at),
        "details": f.message,
        "version_info": f.version,
    });
    let config = match (&f.config, kind) {
        // A refused secret is shown with its private key redacted, as an accepted one is.
        (Some(c), Kind::Secret) => Some(render(&redacted_secret(&Raw::from_bytes(&c.value)))),
        (Some(c), _) => Some(render(c)),
        (None, _) => None,
    };
    if let Some(c) = config {
        v["failed_configuration"] = c;
    }
    v
}

/// `/config_dump` in Envoy's shape: the bootstrap, then clusters, listeners, routes (and
/// endpoints with `include_eds`), each split into static and dynamic.
pub fn config_dump(state: &State, include_eds: bool) -> Result<serde_json::Value, String> {
    use crate::xds::types::Kind;
    use serde_json::json;
    // Held for the whole dump, so each resource reuses one decoded descriptor pool.
    let _pool = crate::protojson::pool().map_err(|e| e.to_string())?;
    let serving = state.serving.load_full();
    let (store, snap) = (&serving.store, &serving.snapshot);
    let version = |k| store.versions.get(&k).cloned().unwrap_or_default();
    let mut configs = Vec::new();
    if let Some(b) = &state.bootstrap {
        configs.push(json!({
            "@type": admin::BootstrapConfigDump::type_url(),
            "bootstrap": render(&pack(b)),
            "last_updated": stamp(state.started_at),
        }));
    }
    let (mut static_clusters, mut dynamic_clusters) = (Vec::new(), Vec::new());
    for item in store.clusters.values() {
        let cluster = render(&item.proto.to_any());
        if item.is_static {
            static_clusters
                .push(json!({ "cluster": cluster, "last_updated": stamp(item.last_updated) }));
        } else {
            let mut entry = json!({
                "version_info": &*item.version,
                "cluster": cluster,
                "last_updated": stamp(item.last_updated),
            });
            if let Some(f) = store
                .failures
                .get(&(Kind::Cluster, item.value.name.to_string()))
            {
                entry["error_state"] = error_state(Kind::Cluster, f);
            }
            dynamic_clusters.push(entry);
        }
    }
    // Refused clusters that have no good version: their error alone.
    dynamic_clusters.extend(refused_only(store, Kind::Cluster, |n| {
        store.clusters.contains_key(n)
    }));
    configs.push(json!({
        "@type": admin::ClustersConfigDump::type_url(),
        "version_info": version(Kind::Cluster),
        "static_clusters": static_clusters,
        "dynamic_active_clusters": dynamic_clusters,
    }));
    let (mut static_listeners, mut dynamic_listeners) = (Vec::new(), Vec::new());
    for (name, item) in &store.listeners {
        let listener = render(&item.proto.to_any());
        if item.is_static {
            static_listeners
                .push(json!({ "listener": listener, "last_updated": stamp(item.last_updated) }));
        } else {
            let st = json!({
                "version_info": &*item.version,
                "listener": listener,
                "last_updated": stamp(item.last_updated),
            });
            let warm = snap
                .listeners
                .get(name)
                .is_some_and(|l| Arc::ptr_eq(&l.def, &item.value));
            let key = if warm {
                "active_state"
            } else {
                "warming_state"
            };
            let mut entry = json!({ "name": name, key: st });
            if let Some(f) = store.failures.get(&(Kind::Listener, name.clone())) {
                entry["error_state"] = error_state(Kind::Listener, f);
            }
            dynamic_listeners.push(entry);
        }
    }
    // As Envoy: a listener refused before any version was accepted is listed by name with
    // its error alone.
    for ((_, name), f) in store
        .failures
        .iter()
        .filter(|((k, n), _)| *k == Kind::Listener && !store.listeners.contains_key(n))
    {
        dynamic_listeners
            .push(json!({ "name": name, "error_state": error_state(Kind::Listener, f) }));
    }
    configs.push(json!({
        "@type": admin::ListenersConfigDump::type_url(),
        "version_info": version(Kind::Listener),
        "static_listeners": static_listeners,
        "dynamic_listeners": dynamic_listeners,
    }));
    let mut routes: Vec<_> = store
        .routes
        .iter()
        .map(|(name, item)| {
            let mut entry = json!({
                "version_info": &*item.version,
                "route_config": render(&item.proto.to_any()),
                "last_updated": stamp(item.last_updated),
            });
            if let Some(f) = store.failures.get(&(Kind::Route, name.clone())) {
                entry["error_state"] = error_state(Kind::Route, f);
            }
            entry
        })
        .collect();
    routes.extend(refused_only(store, Kind::Route, |n| {
        store.routes.contains_key(n)
    }));
    configs.push(json!({
        "@type": admin::RoutesConfigDump::type_url(),
        "dynamic_route_configs": routes,
    }));
    // Envoy lists a subscribed secret that has not arrived as warming.
    let mut secrets: Vec<_> = store
        .secrets
        .values()
        .map(|item| {
            let mut entry = json!({
                "name": item.value.name,
                "version_info": &*item.version,
                "last_updated": stamp(item.last_updated),
                "secret": render(&redacted_secret(&item.proto)),
            });
            if let Some(f) = store
                .failures
                .get(&(Kind::Secret, item.value.name.to_string()))
            {
                entry["error_state"] = error_state(Kind::Secret, f);
            }
            entry
        })
        .collect();
    for ((_, name), f) in store
        .failures
        .iter()
        .filter(|((k, n), _)| *k == Kind::Secret && !store.secrets.contains_key(n))
    {
        secrets.push(json!({ "name": name, "error_state": error_state(Kind::Secret, f) }));
    }
    // As Envoy: named, "uninitialized", stamped when the listener asking for it arrived.
    let mut warming_since: std::collections::BTreeMap<&str, SystemTime> = Default::default();
    for item in store.listeners.values() {
        for name in item
            .value
            .chains
            .iter()
            .filter_map(|c| c.tls.as_ref())
            .flat_map(|t| t.sds_names())
            .filter(|n| !store.secrets.contains_key(*n))
        {
            warming_since.entry(name).or_insert(item.last_updated);
        }
    }
    // Clusters' sockets too, whichever source (ADS or an SDS cluster) the secret comes from.
    for item in store.clusters.values() {
        for r in item
            .value
            .transport
            .sds_refs()
            .filter(|r| !store.secrets.contains_key(&r.name))
        {
            warming_since
                .entry(r.name.as_str())
                .or_insert(item.last_updated);
        }
    }
    let warming: Vec<_> = warming_since
        .into_iter()
        .map(|(n, t)| {
            json!({
                "name": n,
                "version_info": "uninitialized",
                "last_updated": stamp(t),
                "secret": {
                    "@type": crate::xds::types::SECRET,
                    "name": n,
                },
            })
        })
        .collect();
    if !secrets.is_empty() || !warming.is_empty() {
        configs.push(json!({
            "@type": admin::SecretsConfigDump::type_url(),
            "dynamic_active_secrets": secrets,
            "dynamic_warming_secrets": warming,
        }));
    }
    if include_eds {
        let mut eps: Vec<_> = store
            .endpoints
            .iter()
            .map(|(name, item)| {
                let mut entry = json!({
                    "version_info": &*item.version,
                    "endpoint_config": render(&item.proto.to_any()),
                    "last_updated": stamp(item.last_updated),
                });
                if let Some(f) = store.failures.get(&(Kind::Endpoint, name.clone())) {
                    entry["error_state"] = error_state(Kind::Endpoint, f);
                }
                entry
            })
            .collect();
        eps.extend(refused_only(store, Kind::Endpoint, |n| {
            store.endpoints.contains_key(n)
        }));
        configs.push(json!({
            "@type": admin::EndpointsConfigDump::type_url(),
            "dynamic_endpoint_configs": eps,
        }));
    }
    Ok(json!({ "configs": configs }))
}

/// Entries for refused resources of `kind` that have no accepted version (`has` is false):
/// Envoy's dynamic config entries with only `error_state`.
fn refused_only<'a>(
    store: &'a crate::xds::store::Store,
    kind: crate::xds::types::Kind,
    has: impl Fn(&str) -> bool + 'a,
) -> impl Iterator<Item = serde_json::Value> + 'a {
    store
        .failures
        .iter()
        .filter(move |((k, n), _)| *k == kind && !has(n))
        .map(move |(_, f)| serde_json::json!({ "error_state": error_state(kind, f) }))
}

pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
