//! Conformance, more of it, with Envoy as the spec: ADS protocol corner
//! cases (resource envelopes, wrong types, duplicates, unrequested and
//! renamed resources, unsubscribing), config changes under traffic, the
//! HCM's naming, host and forwarding options, h2c downstream, the
//! downstream/upstream status stats and round-robin order.
//!
//! Not covered because Portico refuses them by design (NACKed as "not
//! supported yet"): TLS, listener filters, several filter chains, HTTP
//! filters other than the router unless `is_optional`. Ring hash and Maglev:
//! `tests/traffic_hash.rs`.

mod common;

use std::collections::HashMap;
use std::fmt::Debug;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::cluster;
use envoy_types::pb::envoy::config::core::v3::CidrRange;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager::{
        InternalAddressConfig, RouteSpecifier, ServerHeaderTransformation, StripPortMode,
    },
    HttpConnectionManager, Rds,
};
use envoy_types::pb::envoy::service::discovery::v3::Resource;
use envoy_types::pb::google::protobuf::{Any, BoolValue, UInt32Value};
use serde_json::Value;
use tokio::task::JoinHandle;

const HOST: &str = "more.example.com";

/// How long to look for the effect of a push that was already ACKed or
/// NACKed: both gateways apply a push before answering it.
const APPLIED: Duration = Duration::from_secs(3);

// ---------------------------------------------------------------------------
// Helpers local to this file
// ---------------------------------------------------------------------------

fn svc(name: &str) -> String {
    format!("outbound|9080||{name}.default.svc.cluster.local")
}

/// Route config `name`: every domain, `/` to `cluster`.
fn all_to(name: &str, cluster: &str) -> RouteConfiguration {
    route_config(
        name,
        vec![vhost(
            "more",
            &["*"],
            vec![rt(prefix("/"), to_cluster(cluster))],
        )],
    )
}

/// Route config `name`: every domain answers 200 with `body`.
fn all_direct(name: &str, body: &str) -> RouteConfiguration {
    route_config(
        name,
        vec![vhost(
            "more",
            &["*"],
            vec![rt(prefix("/"), direct(200, body))],
        )],
    )
}

/// The default HCM of `port`, reading its routes from RDS `route`, edited.
fn hcm_rds(
    port: u16,
    route: &str,
    edit: impl FnOnce(&mut HttpConnectionManager),
) -> HttpConnectionManager {
    let mut h = hcm(port);
    h.route_specifier = Some(RouteSpecifier::Rds(Rds {
        config_source: Some(ads_source()),
        route_config_name: route.to_string(),
    }));
    edit(&mut h);
    h
}

/// The default HCM of `port` with an inline route configuration.
/// `rc` matching domains without the authority's port (h2c clients send
/// `:authority` with the port).
fn ignoring_port(mut rc: RouteConfiguration) -> RouteConfiguration {
    rc.ignore_port_in_host_matching = true;
    rc
}

fn hcm_inline(port: u16, rc: RouteConfiguration) -> HttpConnectionManager {
    let mut h = hcm(port);
    h.route_specifier = Some(RouteSpecifier::RouteConfig(rc));
    h
}

/// `m` packed in a `discovery.v3.Resource` envelope.
fn wrapped(name: &str, m: Any) -> Any {
    any(Resource {
        name: name.to_string(),
        version: "1".to_string(),
        resource: Some(m),
        ..Default::default()
    })
}

fn named(name: &str, a: Any) -> (String, Any) {
    (name.to_string(), a)
}

/// `GET path` with `host`, `connection: close`, on a fresh raw connection.
async fn raw_get(port: u16, path: &str, host: &str, headers: &[(&str, &str)]) -> RawResp {
    let mut req = format!("GET {path} HTTP/1.1\r\nhost: {host}\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("connection: close\r\n\r\n");
    raw_http1(port, req.as_bytes(), false).await
}

/// Waits until a fresh `GET path` on `port` answers `status` with `body`.
async fn wait_answer(port: u16, path: &str, status: u16, body: &str) {
    eventually(
        &format!("port {port} {path} to answer {status} {body:?}"),
        PROPAGATION,
        || async {
            let r = raw_get(port, path, HOST, &[]).await;
            if r.status == status && r.body_str() == body {
                Ok(())
            } else {
                Err(format!("{} {:?}", r.status, r.body_str()))
            }
        },
    )
    .await
}

/// Polls `check` like `eventually`, but hands back the last observation as
/// an error instead of panicking, so a test can record it and go on.
async fn poll<T, F, Fut>(timeout: Duration, mut check: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match check().await {
            Ok(v) => return Ok(v),
            Err(last) if Instant::now() >= deadline => return Err(last),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// The first request of `type_url` logged at `since` or later that answers a
/// response (carries a nonce): the ACK or NACK of a push.
async fn answer_to_push(ads: &AdsServer, type_url: &str, since: usize) -> LoggedRequest {
    eventually(
        &format!("an ACK or NACK of {type_url}"),
        PROPAGATION,
        || async {
            ads.log()
                .into_iter()
                .skip(since)
                .find(|r| r.type_url == type_url && !r.response_nonce.is_empty())
                .ok_or_else(|| "none yet".to_string())
        },
    )
    .await
}

/// Sends `n` sequential requests on the mesh's keep-alive client and counts
/// who answered: the `x-backend` value, or `status:<code>` otherwise.
async fn distribution(mesh: &Mesh, n: usize) -> HashMap<String, usize> {
    let mut seen = HashMap::new();
    for _ in 0..n {
        let r = mesh.get("/", HOST, &[]).await;
        let key = match (r.status, r.backend()) {
            (200, Some(b)) => b.to_string(),
            (s, _) => format!("status:{s} {:?} {:?}", r.body, r.error),
        };
        *seen.entry(key).or_default() += 1;
    }
    seen
}

/// One request of a `Load` loop: status, backend, and error/body for failures.
#[derive(Debug, Clone)]
struct Outcome {
    status: u16,
    backend: Option<String>,
    detail: String,
}

/// A client sending GETs back to back until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicUsize>,
    task: JoinHandle<Vec<Outcome>>,
}

impl Load {
    /// `fresh`: a new connection per request (10 ms apart, to spare ephemeral
    /// ports other tests' listeners pick from); otherwise one keep-alive client.
    fn start(url: String, fresh: bool) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicUsize::new(0));
        let (s, d) = (stop.clone(), done.clone());
        let task = tokio::spawn(async move {
            let client = HttpClient::new();
            let mut out = Vec::new();
            while !s.load(Ordering::SeqCst) {
                let r = if fresh {
                    get(&url, Some(HOST), &[]).await
                } else {
                    client.get(&url, Some(HOST), &[]).await
                };
                out.push(Outcome {
                    status: r.status,
                    backend: r.backend().map(str::to_string),
                    detail: format!("{:?} {:?}", r.error, r.body),
                });
                d.fetch_add(1, Ordering::SeqCst);
                if fresh {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            out
        });
        Load { stop, done, task }
    }

    fn count(&self) -> usize {
        self.done.load(Ordering::SeqCst)
    }

    /// Waits until `n` more requests than now have completed.
    async fn run_for(&self, n: usize) {
        let target = self.count() + n;
        eventually(&format!("{n} more requests"), PROPAGATION, || async {
            let c = self.count();
            if c >= target {
                Ok(())
            } else {
                Err(format!("{c} of {target}"))
            }
        })
        .await
    }

    async fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.expect("load task")
    }
}

/// The failed requests of a load run, described.
fn failures(out: &[Outcome]) -> Vec<String> {
    out.iter()
        .filter(|o| o.status != 200)
        .map(|o| format!("{} {:?} {}", o.status, o.backend, o.detail))
        .collect()
}

/// An h2c (prior knowledge) client resolving each of `hosts` to 127.0.0.1:`port`.
fn h2_client(hosts: &[&str], port: u16) -> reqwest::Client {
    let target = SocketAddr::from(([127, 0, 0, 1], port));
    let mut b = reqwest::Client::builder()
        .no_proxy()
        .http2_prior_knowledge()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(5));
    for h in hosts {
        b = b.resolve(h, target);
    }
    b.build().expect("build h2c client")
}

fn config_dump_route_names(dump: &Value) -> Vec<String> {
    dump["configs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| {
            c["@type"]
                .as_str()
                .is_some_and(|t| t.ends_with("RoutesConfigDump"))
        })
        .flat_map(|c| {
            c["dynamic_route_configs"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|r| r["route_config"]["name"].as_str().map(str::to_string))
        .collect()
}

// ---------------------------------------------------------------------------
// ADS protocol
// ---------------------------------------------------------------------------

/// Every type delivered inside `envoy.service.discovery.v3.Resource`
/// envelopes is unwrapped, applied and ACKed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ads_resources_in_resource_envelopes_are_accepted() {
    let b = Backend::start("wrapped").await;
    let cl = svc("wrapped");
    let port = free_port();
    let rn = route_name(port);
    let ads = AdsServer::start_any("1", &Snapshot::default()).await;
    ads.set_type_raw(
        CDS,
        "1",
        vec![named(&cl, wrapped(&cl, any(eds_cluster(&cl))))],
    );
    ads.set_type_raw(
        EDS,
        "1",
        vec![named(&cl, wrapped(&cl, any(cla(&cl, &[b.addr]))))],
    );
    ads.set_type_raw(
        LDS,
        "1",
        vec![named(
            &listener_name(port),
            wrapped(&listener_name(port), any(l(port))),
        )],
    );
    ads.set_type_raw(
        RDS,
        "1",
        vec![named(&rn, wrapped(&rn, any(all_to(&rn, &cl))))],
    );
    let gw = Gateway::start(ads.port).await;
    let mesh = Mesh {
        ads,
        gw,
        port,
        client: HttpClient::new(),
    };
    mesh.wait_backend("/", HOST, &[], "wrapped").await;
    for t in [CDS, EDS, LDS, RDS] {
        mesh.ads.wait_for_ack(t, "1", PROPAGATION).await;
    }
    let nacks: Vec<LoggedRequest> = mesh.ads.log().into_iter().filter(|r| r.is_nack()).collect();
    assert!(nacks.is_empty(), "{nacks:?}");
}

/// A resource whose type URL differs from the response's is rejected: the
/// push is NACKed and the previous config keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ads_resource_of_the_wrong_type_is_nacked() {
    let b = Backend::start("kept").await;
    let cl = svc("kept");
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![all_to(&route_name(port), &cl)],
            ..Default::default()
        }
        .with_backends(&[(&cl, &b)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "kept").await;
    mesh.ads.wait_for_ack(CDS, "1", PROPAGATION).await;
    let rn = route_name(mesh.port);

    // A CDS response holding a Listener.
    let since = mesh.ads.log_len();
    mesh.ads
        .set_type_raw(CDS, "2", vec![named(&cl, any(l(mesh.port)))]);
    let r = answer_to_push(&mesh.ads, CDS, since).await;
    eprintln!("observed: CDS with a Listener inside: {r:?}");
    assert!(r.is_nack(), "CDS push with a Listener inside: {r:?}");
    assert_eq!(r.version_info, "1", "{r:?}");
    mesh.wait_backend("/", HOST, &[], "kept").await;

    // An RDS response holding a Cluster under the requested name.
    let since = mesh.ads.log_len();
    mesh.ads
        .set_type_raw(RDS, "2", vec![named(&rn, any(eds_cluster(&rn)))]);
    let r = answer_to_push(&mesh.ads, RDS, since).await;
    eprintln!("observed: RDS with a Cluster inside: {r:?}");
    assert!(r.is_nack(), "RDS push with a Cluster inside: {r:?}");
    assert_eq!(r.version_info, "1", "{r:?}");
    mesh.wait_backend("/", HOST, &[], "kept").await;

    // The same resources inside envelopes are rejected the same way.
    let since = mesh.ads.log_len();
    mesh.ads
        .set_type_raw(CDS, "3", vec![named(&cl, wrapped(&cl, any(l(mesh.port))))]);
    let r = answer_to_push(&mesh.ads, CDS, since).await;
    eprintln!("observed: CDS with a wrapped Listener inside: {r:?}");
    assert!(r.is_nack(), "CDS push with a wrapped Listener: {r:?}");
    mesh.wait_backend("/", HOST, &[], "kept").await;
}

/// Two resources with the same name in one response. Envoy NACKs it for CDS
/// and LDS ("duplicate cluster/listener X found") but has applied the first
/// copy by then; for RDS and EDS it ACKs and the first copy applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ads_duplicate_names_in_one_response() {
    let (a, b) = (Backend::start("dup-a").await, Backend::start("dup-b").await);
    let base = svc("base");
    let dup = svc("dup");
    let (pa, pb) = (free_port(), free_port());
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "more",
                    &["*"],
                    vec![
                        rt(prefix("/dup"), to_cluster(&dup)),
                        rt(prefix("/"), to_cluster(&base)),
                    ],
                )],
            )],
            endpoints: vec![cla("eds-a", &[a.addr]), cla("eds-b", &[b.addr])],
            ..Default::default()
        }
        .with_backends(&[(&base, &a)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "dup-a").await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);

    // CDS: the same cluster twice, its endpoints from "eds-a" then "eds-b".
    let with_service = |service: &str| {
        let mut x = eds_cluster(&dup);
        if let Some(e) = x.eds_cluster_config.as_mut() {
            e.service_name = service.to_string();
        }
        x
    };
    let since = mesh.ads.log_len();
    mesh.ads.set_type_raw(
        CDS,
        "2",
        vec![
            named(&base, any(eds_cluster(&base))),
            named(&dup, any(with_service("eds-a"))),
            named(&dup, any(with_service("eds-b"))),
        ],
    );
    let r = answer_to_push(&mesh.ads, CDS, since).await;
    eprintln!("observed: CDS duplicate: {r:?}");
    c.ok("CDS duplicate is NACKed", r.is_nack(), &r);
    c.ok(
        "CDS NACK names the duplicate",
        r.error.as_deref().is_some_and(|e| e.contains("duplicate")),
        &r.error,
    );
    // Envoy has applied the first copy before it meets the second.
    let got = poll(APPLIED, || async {
        let r = mesh.get("/dup", HOST, &[]).await;
        match r.backend() {
            Some(b) => Ok(b.to_string()),
            None => Err(format!("{} {:?}", r.status, r.body)),
        }
    })
    .await;
    c.eq(
        "CDS duplicate: the first copy is applied",
        got,
        Ok("dup-a".to_string()),
    );

    // LDS: the same listener twice, on two ports.
    let inline = |port: u16, body: &str| {
        let mut x = listener_with(port, hcm_inline(port, all_direct("inline", body)));
        x.name = "dup-listener".to_string();
        x
    };
    let since = mesh.ads.log_len();
    mesh.ads.set_type_raw(
        LDS,
        "2",
        vec![
            named(&listener_name(mesh.port), any(l(mesh.port))),
            named("dup-listener", any(inline(pa, "copy-a"))),
            named("dup-listener", any(inline(pb, "copy-b"))),
        ],
    );
    let r = answer_to_push(&mesh.ads, LDS, since).await;
    eprintln!("observed: LDS duplicate: {r:?}");
    c.ok("LDS duplicate is NACKed", r.is_nack(), &r);
    c.ok(
        "LDS NACK names the duplicate",
        r.error.as_deref().is_some_and(|e| e.contains("duplicate")),
        &r.error,
    );
    let first = poll(APPLIED, || async {
        let r = raw_get(pa, "/", HOST, &[]).await;
        if r.status == 200 {
            Ok(r.body_str())
        } else {
            Err(format!("{} {:?}", r.status, r.body_str()))
        }
    })
    .await;
    c.eq(
        "LDS duplicate: the first copy is applied",
        first,
        Ok("copy-a".to_string()),
    );
    c.eq(
        "LDS duplicate: second copy's port",
        tcp_connect(pb).await,
        Err(std::io::ErrorKind::ConnectionRefused),
    );
    mesh.wait_backend("/", HOST, &[], "dup-a").await;

    // EDS: the same load assignment twice.
    let since = mesh.ads.log_len();
    mesh.ads.set_type_raw(
        EDS,
        "2",
        vec![
            named(&base, any(cla(&base, &[b.addr]))),
            named(&base, any(cla(&base, &[a.addr]))),
            named("eds-a", any(cla("eds-a", &[a.addr]))),
        ],
    );
    let r = answer_to_push(&mesh.ads, EDS, since).await;
    eprintln!("observed: EDS duplicate: {r:?}");
    let _ = poll(APPLIED, || async {
        match mesh.get("/", HOST, &[]).await.backend() {
            Some("dup-b") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let d = distribution(&mesh, 6).await;
    eprintln!("observed: EDS duplicate serves {d:?}");
    c.ok("EDS duplicate is ACKed", !r.is_nack(), &r);
    c.eq(
        "EDS duplicate: the first copy applies",
        d.get("dup-b"),
        Some(&6),
    );
    // RDS: the requested route config twice.
    let rn = route_name(mesh.port);
    let since = mesh.ads.log_len();
    mesh.ads.set_type_raw(
        RDS,
        "2",
        vec![
            named(&rn, any(all_direct(&rn, "rds-a"))),
            named(&rn, any(all_direct(&rn, "rds-b"))),
        ],
    );
    let r = answer_to_push(&mesh.ads, RDS, since).await;
    eprintln!("observed: RDS duplicate: {r:?}");
    let body = poll(APPLIED, || async {
        let r = mesh.get("/", HOST, &[]).await;
        if r.backend().is_none() {
            Ok(r.body)
        } else {
            Err(r.body)
        }
    })
    .await
    .unwrap_or_else(|old| old);
    eprintln!("observed: RDS duplicate serves {body:?}");
    c.ok("RDS duplicate is ACKed", !r.is_nack(), &r);
    c.eq(
        "RDS duplicate: the first copy applies",
        body.as_str(),
        "rds-a",
    );

    c.finish();
}

/// An RDS response may carry a route configuration nobody asked for: it is
/// ignored, the requested one is applied and the push ACKed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ads_unrequested_route_config_is_ignored() {
    let (a, b) = (
        Backend::start("first").await,
        Backend::start("second").await,
    );
    let (ca, cb) = (svc("first"), svc("second"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![all_to(&route_name(port), &ca)],
            ..Default::default()
        }
        .with_backends(&[(&ca, &a), (&cb, &b)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "first").await;
    let rn = route_name(mesh.port);
    let since = mesh.ads.log_len();
    // The server filters on the pair's name: both go out.
    mesh.ads.set_type_raw(
        RDS,
        "2",
        vec![
            named(&rn, any(all_to(&rn, &cb))),
            named(&rn, any(all_direct("unrequested", "nobody asked"))),
        ],
    );
    let r = answer_to_push(&mesh.ads, RDS, since).await;
    eprintln!("observed: RDS with an unrequested config: {r:?}");
    assert!(!r.is_nack(), "{r:?}");
    assert_eq!(r.version_info, "2", "{r:?}");
    mesh.wait_backend("/", HOST, &[], "second").await;
    let dump: Value = serde_json::from_str(&mesh.gw.admin_get("/config_dump").await.body)
        .expect("config_dump is JSON");
    assert_eq!(config_dump_route_names(&dump), vec![rn.clone()]);
    // The unrequested name is not subscribed to afterwards.
    let asked: Vec<Vec<String>> = mesh
        .ads
        .log()
        .into_iter()
        .filter(|r| r.type_url == RDS)
        .map(|r| r.resource_names)
        .collect();
    assert!(
        asked.iter().all(|n| n == &vec![rn.clone()]),
        "RDS requests: {asked:?}"
    );
}

/// A cluster whose `eds_cluster_config.service_name` differs from its name
/// subscribes to, and is fed by, the service name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eds_service_name_differs_from_cluster_name() {
    let b = Backend::start("by-service-name").await;
    let other = Backend::start("by-cluster-name").await;
    let cl = svc("renamed");
    let service = "eds-service-name";
    let mesh = Mesh::start(|port| {
        let mut c = eds_cluster(&cl);
        if let Some(e) = c.eds_cluster_config.as_mut() {
            e.service_name = service.to_string();
        }
        Snapshot {
            routes: vec![all_to(&route_name(port), &cl)],
            clusters: vec![c],
            endpoints: vec![cla(service, &[b.addr]), cla(&cl, &[other.addr])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "by-service-name").await;
    let asked: Vec<Vec<String>> = mesh
        .ads
        .log()
        .into_iter()
        .filter(|r| r.type_url == EDS)
        .map(|r| r.resource_names)
        .collect();
    assert!(
        asked.iter().all(|n| n == &vec![service.to_string()]),
        "EDS requests: {asked:?}"
    );
    let d = distribution(&mesh, 5).await;
    assert_eq!(d.get("by-service-name"), Some(&5), "{d:?}");
}

/// When the only listener using RDS switches to an inline route
/// configuration, Envoy does not unsubscribe: the old listener's filter
/// chain drains (600 s by default) and keeps its RDS subscription, so the
/// next RDS request is the ACK of the next push and still lists the name,
/// and switching back to RDS serves the pushed routes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rds_subscription_outlives_the_listener_dropping_its_route_config() {
    let b = Backend::start("rds").await;
    let cl = svc("rds");
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![all_to(&route_name(port), &cl)],
            ..Default::default()
        }
        .with_backends(&[(&cl, &b)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "rds").await;
    mesh.ads.wait_for_ack(RDS, "1", PROPAGATION).await;
    let rn = route_name(mesh.port);
    let since = mesh.ads.log_len();
    mesh.ads.set_listeners(
        "2",
        &[listener_with(
            mesh.port,
            hcm_inline(mesh.port, all_direct("inline", "inline")),
        )],
    );
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    wait_answer(mesh.port, "/", 200, "inline").await;
    mesh.ads.set_routes("2", &[all_direct(&rn, "rds-2")]);
    let next = eventually("an RDS request after the change", PROPAGATION, || async {
        mesh.ads
            .log()
            .into_iter()
            .skip(since)
            .find(|r| r.type_url == RDS)
            .ok_or_else(|| "none".to_string())
    })
    .await;
    eprintln!("observed: first RDS request after the listener went inline: {next:?}");
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    c.eq(
        "first RDS request after the change: names, version, NACK",
        (
            next.resource_names.clone(),
            next.version_info.as_str(),
            next.is_nack(),
        ),
        (vec![rn.clone()], "2", false),
    );
    // Back to RDS: the routes pushed meanwhile serve.
    mesh.ads.set_listeners("3", &[l(mesh.port)]);
    mesh.ads.wait_for_ack(LDS, "3", PROPAGATION).await;
    wait_answer(mesh.port, "/", 200, "rds-2").await;
    c.finish();
}

// ---------------------------------------------------------------------------
// Changes under traffic
// ---------------------------------------------------------------------------

/// A listener updated in place (same name and address) to a new route
/// configuration name keeps answering while it switches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_updated_in_place_to_a_new_route_config_keeps_serving() {
    let (a, b) = (Backend::start("old").await, Backend::start("new").await);
    let (ca, cb) = (svc("old"), svc("new"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![
                all_to(&route_name(port), &ca),
                all_to(&format!("{}.v2", route_name(port)), &cb),
            ],
            ..Default::default()
        }
        .with_backends(&[(&ca, &a), (&cb, &b)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "old").await;
    let kept = Load::start(mesh.url("/"), false);
    let fresh = Load::start(mesh.url("/"), true);
    kept.run_for(20).await;
    fresh.run_for(20).await;

    let v2 = format!("{}.v2", route_name(mesh.port));
    mesh.ads.set_listeners(
        "2",
        &[listener_with(mesh.port, hcm_rds(mesh.port, &v2, |_| {}))],
    );
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    eventually(
        "fresh connections to reach the new routes",
        PROPAGATION,
        || async {
            let r = get(&mesh.url("/"), Some(HOST), &[]).await;
            if r.backend() == Some("new") {
                Ok(())
            } else {
                Err(format!("{} {:?}", r.status, r.backend()))
            }
        },
    )
    .await;
    kept.run_for(20).await;
    fresh.run_for(20).await;
    let (kept, fresh) = (kept.finish().await, fresh.finish().await);
    let last = fresh.last().and_then(|o| o.backend.clone());
    assert!(
        failures(&kept).is_empty(),
        "keep-alive: {:?}",
        failures(&kept)
    );
    assert!(failures(&fresh).is_empty(), "fresh: {:?}", failures(&fresh));
    assert_eq!(last.as_deref(), Some("new"));
    eprintln!(
        "observed: {} keep-alive and {} fresh requests across the change",
        kept.len(),
        fresh.len()
    );
}

/// A CDS update that only changes a cluster's lb_policy: Envoy builds a new
/// cluster that warms (it re-requests its EDS resource and holds the CDS ACK
/// until endpoints arrive, or initial_fetch_timeout, 15 s) while the old one
/// keeps serving; the EDS push that follows (as Istio sends) completes it.
/// No request fails, and every endpoint still serves afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cds_lb_policy_change_keeps_endpoints() {
    let (a, b) = (Backend::start("lb-a").await, Backend::start("lb-b").await);
    let cl = svc("lb");
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![all_to(&route_name(port), &cl)],
        clusters: vec![eds_cluster(&cl)],
        endpoints: vec![cla(&cl, &[a.addr, b.addr])],
        ..Default::default()
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "lb-a").await;
    mesh.wait_backend("/", HOST, &[], "lb-b").await;
    mesh.ads.wait_for_ack(CDS, "1", PROPAGATION).await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let load = Load::start(mesh.url("/"), false);
    load.run_for(20).await;
    let since = mesh.ads.log_len();
    let mut changed = eds_cluster(&cl);
    changed.lb_policy = cluster::LbPolicy::LeastRequest as i32;
    mesh.ads.set_clusters("2", &[changed]);
    let rerequest = tokio::time::timeout(APPLIED, async {
        loop {
            let log = mesh.ads.log();
            if let Some(r) = log.iter().skip(since).find(|r| r.type_url == EDS) {
                return r.clone();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    eprintln!("observed: EDS request after the CDS update: {rerequest:?}");
    c.ok(
        "the updated cluster re-requests its endpoints (same names)",
        rerequest
            .as_ref()
            .is_ok_and(|r| r.resource_names == vec![cl.clone()] && !r.is_nack()),
        &rerequest,
    );
    load.run_for(40).await;
    let early_ack = mesh
        .ads
        .log()
        .iter()
        .skip(since)
        .find(|r| r.type_url == CDS && r.version_info == "2")
        .cloned();
    c.eq(
        "CDS update ACKed before the cluster's endpoints arrived",
        early_ack.map(|r| r.version_info),
        None,
    );
    mesh.ads.set_endpoints("2", &[cla(&cl, &[a.addr, b.addr])]);
    mesh.ads.wait_for_ack(CDS, "2", PROPAGATION).await;
    mesh.ads.wait_for_ack(EDS, "2", PROPAGATION).await;
    let mark = load.count();
    load.run_for(60).await;
    let out = load.finish().await;
    c.eq("failed requests", failures(&out).len(), 0);
    c.ok("failures", failures(&out).is_empty(), failures(&out));
    let mut after: HashMap<String, usize> = HashMap::new();
    for o in &out[mark..] {
        *after
            .entry(o.backend.clone().unwrap_or_default())
            .or_default() += 1;
    }
    eprintln!("observed: after the lb_policy change: {after:?}");
    c.ok(
        "both endpoints serve after the change",
        after.contains_key("lb-a") && after.contains_key("lb-b"),
        &after,
    );
    c.finish();
}

/// Endpoints added and removed by EDS while two keep-alive clients loop: no
/// request fails, and the removed endpoint gets nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eds_endpoint_added_and_removed_under_load() {
    let (a, b) = (Backend::start("ep-a").await, Backend::start("ep-b").await);
    let cl = svc("ep");
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![all_to(&route_name(port), &cl)],
            ..Default::default()
        }
        .with_backends(&[(&cl, &a)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "ep-a").await;
    let kept = Load::start(mesh.url("/"), false);
    let other = Load::start(mesh.url("/"), false);
    kept.run_for(20).await;
    mesh.ads.set_endpoints("2", &[cla(&cl, &[a.addr, b.addr])]);
    mesh.ads.wait_for_ack(EDS, "2", PROPAGATION).await;
    mesh.wait_backend("/", HOST, &[], "ep-b").await;
    kept.run_for(20).await;
    mesh.ads.set_endpoints("3", &[cla(&cl, &[b.addr])]);
    mesh.ads.wait_for_ack(EDS, "3", PROPAGATION).await;
    kept.run_for(20).await;
    let served_a = a.served();
    kept.run_for(20).await;
    other.run_for(5).await;
    let (kept, other) = (kept.finish().await, other.finish().await);
    assert!(
        failures(&kept).is_empty(),
        "client 1: {:?}",
        failures(&kept)
    );
    assert!(
        failures(&other).is_empty(),
        "client 2: {:?}",
        failures(&other)
    );
    assert_eq!(
        a.served(),
        served_a,
        "the removed endpoint still got requests"
    );
    eprintln!(
        "observed: {} + {} keep-alive requests, all 200",
        kept.len(),
        other.len()
    );
}

// ---------------------------------------------------------------------------
// Inline route configuration validation
// ---------------------------------------------------------------------------

/// `validate_clusters` defaults to true for an inline `route_config`: a
/// listener whose inline routes name an unknown cluster is rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_route_config_naming_an_unknown_cluster_is_nacked() {
    let b = Backend::start("known").await;
    let cl = svc("known");
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![all_to(&route_name(port), &cl)],
            ..Default::default()
        }
        .with_backends(&[(&cl, &b)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "known").await;
    mesh.ads.wait_for_ack(LDS, "1", PROPAGATION).await;
    let p2 = free_port();
    let inline_to = |cluster: &str| listener_with(p2, hcm_inline(p2, all_to("inline", cluster)));
    let since = mesh.ads.log_len();
    mesh.ads
        .set_listeners("2", &[l(mesh.port), inline_to("no-such-cluster")]);
    let r = answer_to_push(&mesh.ads, LDS, since).await;
    eprintln!("observed: inline route_config to an unknown cluster: {r:?}");
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    c.ok("LDS push is NACKed", r.is_nack(), &r);
    c.ok(
        "the NACK names the unknown cluster",
        r.error
            .as_deref()
            .is_some_and(|e| e.contains("unknown cluster 'no-such-cluster'")),
        &r.error,
    );
    c.eq(
        "the rejected listener's port",
        tcp_connect(p2).await,
        Err(std::io::ErrorKind::ConnectionRefused),
    );
    if !r.is_nack() {
        let r = get(&format!("http://127.0.0.1:{p2}/"), Some(HOST), &[]).await;
        eprintln!(
            "observed: accepted inline listener answers {} {:?}",
            r.status, r.body
        );
    }
    mesh.wait_backend("/", HOST, &[], "known").await;

    // The same listener naming a cluster that exists is accepted.
    mesh.ads.set_listeners("3", &[l(mesh.port), inline_to(&cl)]);
    mesh.ads.wait_for_ack(LDS, "3", PROPAGATION).await;
    eventually("the inline listener to serve", PROPAGATION, || async {
        let r = get(&format!("http://127.0.0.1:{p2}/"), Some(HOST), &[]).await;
        if r.backend() == Some("known") {
            Ok(())
        } else {
            Err(format!("{} {:?}", r.status, r.error))
        }
    })
    .await;
    c.finish();
}

// ---------------------------------------------------------------------------
// HCM options
// ---------------------------------------------------------------------------

/// A connection manager whose loopback clients are internal (their `x-envoy-*` control
/// headers are trusted).
fn loopback_internal(h: &mut HttpConnectionManager) {
    h.use_remote_address = Some(BoolValue { value: true });
    h.internal_address_config = Some(InternalAddressConfig {
        cidr_ranges: vec![CidrRange {
            address_prefix: "127.0.0.0".into(),
            prefix_len: Some(UInt32Value { value: 8 }),
        }],
        ..Default::default()
    });
}

/// A route that answers `body` itself for a request carrying `header`.
fn with_header_route(header: &str, body: &str) -> envoy_types::pb::envoy::config::route::v3::Route {
    use envoy_types::pb::envoy::config::route::v3::{header_matcher, HeaderMatcher};
    let mut r = rt(prefix("/"), direct(200, body));
    if let Some(m) = r.r#match.as_mut() {
        m.headers = vec![HeaderMatcher {
            name: header.into(),
            header_match_specifier: Some(header_matcher::HeaderMatchSpecifier::PresentMatch(true)),
            ..Default::default()
        }];
    }
    r
}

/// `server_name` replaces `envoy` in the `server` header of proxied responses
/// (over the upstream's own) and of every local reply, on HTTP/1.1 and h2c.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hcm_server_name_in_proxied_and_local_replies() {
    let echo = EchoBackend::start("echo").await;
    let (echo_c, empty_c) = (svc("echo"), svc("empty"));
    let mut custom = 0;
    let mesh = Mesh::start_raw(|port| {
        custom = free_port();
        let rn = route_name(port);
        Snapshot {
            listeners: vec![
                l(port),
                listener_with(
                    custom,
                    hcm_rds(custom, &rn, |h| h.server_name = "portico-conf/1.0".into()),
                ),
            ],
            routes: vec![ignoring_port(route_config(
                &rn,
                vec![vhost(
                    "more",
                    &[HOST],
                    vec![
                        rt(prefix("/proxied"), to_cluster(&echo_c)),
                        rt(path("/direct"), direct(200, "d")),
                        rt(path("/missing"), to_cluster("no-such-cluster")),
                        rt(path("/empty"), to_cluster(&empty_c)),
                    ],
                )],
            ))],
            clusters: vec![eds_cluster(&echo_c), eds_cluster(&empty_c)],
            endpoints: vec![cla(&echo_c, &[echo.addr]), cla(&empty_c, &[])],
            ..Default::default()
        }
    })
    .await;
    wait_answer(mesh.port, "/proxied", 200, "echo").await;
    wait_answer(custom, "/proxied", 200, "echo").await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let h2 = h2_client(&[HOST, "unknown.example.com"], custom);
    let cases: &[(&str, &str, u16)] = &[
        ("/proxied", HOST, 200),
        ("/direct", HOST, 200),
        ("/missing", HOST, 503),
        ("/empty", HOST, 503),
        ("/no-route", HOST, 404),
        ("/", "unknown.example.com", 404),
    ];
    for (p, host, status) in cases {
        for (port, want) in [(mesh.port, "envoy"), (custom, "portico-conf/1.0")] {
            let r = raw_get(port, p, host, &[]).await;
            c.eq(
                format!("HTTP/1.1 :{port} {host}{p}: status, server"),
                (r.status, r.header("server")),
                (*status, Some(want)),
            );
        }
        let url = format!("http://{host}:{custom}{p}");
        let r = send_request(&h2, "GET", &url, None, &[], None).await;
        c.eq(
            format!("h2c {host}{p}: status, server"),
            (r.status, r.header("server")),
            (*status, Some("portico-conf/1.0")),
        );
    }
    c.finish();
}

/// `server_header_transformation`: APPEND_IF_ABSENT keeps an upstream's `server` and names
/// itself on a response without one (a local reply); PASS_THROUGH keeps the upstream's and
/// adds none. Envoy Gateway sets PASS_THROUGH on every listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hcm_server_header_transformation() {
    let echo = EchoBackend::start("echo").await;
    let echo_c = svc("echo");
    let (mut append, mut pass) = (0, 0);
    let mesh = Mesh::start_raw(|port| {
        append = free_port();
        pass = free_port();
        let rn = route_name(port);
        let with = |p: u16, t: ServerHeaderTransformation| {
            listener_with(
                p,
                hcm_rds(p, &rn, |h| {
                    h.server_name = "portico-conf/1.0".into();
                    h.server_header_transformation = t as i32;
                }),
            )
        };
        Snapshot {
            listeners: vec![
                l(port),
                with(append, ServerHeaderTransformation::AppendIfAbsent),
                with(pass, ServerHeaderTransformation::PassThrough),
            ],
            routes: vec![ignoring_port(route_config(
                &rn,
                vec![vhost(
                    "more",
                    &[HOST],
                    vec![
                        rt(prefix("/proxied"), to_cluster(&echo_c)),
                        rt(path("/direct"), direct(200, "d")),
                    ],
                )],
            ))],
            clusters: vec![eds_cluster(&echo_c)],
            endpoints: vec![cla(&echo_c, &[echo.addr])],
            ..Default::default()
        }
    })
    .await;
    wait_answer(append, "/proxied", 200, "echo").await;
    wait_answer(pass, "/proxied", 200, "echo").await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let cases: &[(u16, &str, u16, Option<&str>)] = &[
        (append, "/proxied", 200, Some("echo-backend")),
        (append, "/direct", 200, Some("portico-conf/1.0")),
        (append, "/no-route", 404, Some("portico-conf/1.0")),
        (pass, "/proxied", 200, Some("echo-backend")),
        (pass, "/direct", 200, None),
        (pass, "/no-route", 404, None),
        (mesh.port, "/proxied", 200, Some("envoy")),
    ];
    for (port, p, status, want) in cases {
        let r = raw_get(*port, p, HOST, &[]).await;
        c.eq(
            format!("HTTP/1.1 :{port}{p}: status, server"),
            (r.status, r.header("server")),
            (*status, *want),
        );
        let h2 = h2_client(&[HOST], *port);
        let url = format!("http://{HOST}:{port}{p}");
        let r = send_request(&h2, "GET", &url, None, &[], None).await;
        c.eq(
            format!("h2c :{port}{p}: status, server"),
            (r.status, r.header("server")),
            (*status, *want),
        );
    }
    c.finish();
}

/// `via` is appended to the request's and the response's `via` (local replies included);
/// `always_set_request_id_in_response` puts the request's `x-request-id` on the response, as
/// an internal request's `x-envoy-force-trace` does without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hcm_via_and_request_id_in_response() {
    let backend = RawBackend::start().await;
    let cl = "raw";
    let (mut via, mut inside) = (0, 0);
    let mesh = Mesh::start_raw(|port| {
        via = free_port();
        inside = free_port();
        let rn = route_name(port);
        Snapshot {
            listeners: vec![
                l(port),
                listener_with(
                    via,
                    hcm_rds(via, &rn, |h| {
                        h.via = "1.1 portico-a".into();
                        h.always_set_request_id_in_response = true;
                    }),
                ),
                // Loopback clients internal: their x-envoy-force-trace is kept.
                listener_with(inside, hcm_rds(inside, &rn, loopback_internal)),
            ],
            routes: vec![ignoring_port(route_config(
                &rn,
                vec![vhost(
                    "more",
                    &[HOST],
                    vec![
                        rt(path("/direct"), direct(200, "d")),
                        rt(prefix("/up"), to_cluster(cl)),
                        rt(prefix("/raw"), to_cluster(cl)),
                    ],
                )],
            ))],
            clusters: vec![eds_cluster(cl)],
            endpoints: vec![cla(cl, &[backend.addr])],
            ..Default::default()
        }
    })
    .await;
    wait_answer(via, "/up/warm", 200, "raw-backend").await;
    wait_answer(mesh.port, "/up/warm", 200, "raw-backend").await;
    wait_answer(inside, "/up/warm", 200, "raw-backend").await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let up = |t: &str| {
        backend
            .request(t)
            .unwrap_or_else(|| panic!("{t} did not reach the upstream"))
    };

    let r = raw_get(via, "/up/1", HOST, &[]).await;
    let u = up("/up/1");
    c.eq(
        "via: upstream request's via",
        u.header("via"),
        Some("1.1 portico-a"),
    );
    c.eq(
        "via: response's via",
        r.header("via"),
        Some("1.1 portico-a"),
    );
    let rid = u.header("x-request-id").unwrap_or_default();
    c.ok("via: a request id generated", is_uuid(rid), rid);
    c.eq(
        "via: the response's x-request-id is the request's",
        r.header("x-request-id"),
        Some(rid),
    );

    let r = raw_get(
        via,
        "/up/2",
        HOST,
        &[("via", "1.0 client"), ("x-request-id", "my-id")],
    )
    .await;
    let u = up("/up/2");
    c.eq(
        "via: a client's via is appended to",
        u.header("via"),
        Some("1.0 client, 1.1 portico-a"),
    );
    c.eq(
        "via: the client's id kept and returned",
        (u.header("x-request-id"), r.header("x-request-id")),
        (Some("my-id"), Some("my-id")),
    );
    c.eq(
        "via: the response's via is the gateway's",
        r.header("via"),
        Some("1.1 portico-a"),
    );

    // Two via fields: one value, as Envoy's codec merges them.
    raw_get(
        via,
        "/up/twice",
        HOST,
        &[("via", "1.0 a"), ("via", "1.0 b")],
    )
    .await;
    c.eq(
        "via: two of a client's, joined and appended to",
        up("/up/twice").header("via"),
        Some("1.0 a,1.0 b, 1.1 portico-a"),
    );

    // The upstream's own via, appended to.
    let hex: String = b"HTTP/1.1 200 OK\r\nvia: 1.1 up\r\ncontent-length: 2\r\n\r\nok"
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let r = raw_get(via, &format!("/raw/{hex}"), HOST, &[]).await;
    c.eq(
        "via: an upstream's via is appended to",
        (r.status, r.header("via")),
        (200, Some("1.1 up, 1.1 portico-a")),
    );

    for p in ["/direct", "/missing"] {
        let r = raw_get(via, p, HOST, &[("x-request-id", "local-id")]).await;
        c.eq(
            format!("via: local reply {p}: via, x-request-id"),
            (r.header("via"), r.header("x-request-id")),
            (Some("1.1 portico-a"), Some("local-id")),
        );
    }

    // Without the options: no via, and the id comes back only with an internal client's
    // x-envoy-force-trace (an external client's is removed).
    let r = raw_get(mesh.port, "/up/3", HOST, &[("x-request-id", "plain-id")]).await;
    c.eq(
        "default: no via, no id",
        (r.header("via"), r.header("x-request-id")),
        (None, None),
    );
    let forced = [
        ("x-request-id", "forced-id"),
        ("x-envoy-force-trace", "true"),
    ];
    let r = raw_get(mesh.port, "/up/4", HOST, &forced).await;
    c.eq(
        "default: force-trace from outside is removed",
        r.header("x-request-id"),
        None,
    );
    let r = raw_get(inside, "/up/5", HOST, &forced).await;
    c.eq(
        "internal: force-trace returns the id",
        r.header("x-request-id"),
        Some("forced-id"),
    );
    let r = raw_get(inside, "/direct", HOST, &forced).await;
    c.eq(
        "internal: force-trace on a local reply",
        r.header("x-request-id"),
        Some("forced-id"),
    );
    c.finish();
}

/// The router's `suppress_envoy_headers` (Envoy Gateway sets it on every listener): no
/// `x-envoy-expected-rq-timeout-ms` or `x-envoy-original-path` upstream, no
/// `x-envoy-upstream-service-time` on the response; without it all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_suppress_envoy_headers() {
    use envoy_types::pb::envoy::config::route::v3::{route, route_action, RouteAction};
    use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_filter;
    let backend = RawBackend::start().await;
    let cl = "raw";
    let mut quiet = 0;
    let mesh = Mesh::start_raw(|port| {
        quiet = free_port();
        let rn = route_name(port);
        let rewrite = route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cl.into())),
            prefix_rewrite: "/rewritten".into(),
            timeout: Some(envoy_types::pb::google::protobuf::Duration {
                seconds: 5,
                nanos: 0,
            }),
            ..Default::default()
        });
        Snapshot {
            listeners: vec![
                l(port),
                listener_with(
                    quiet,
                    hcm_rds(quiet, &rn, |h| {
                        if let Some(f) = h.http_filters.last_mut() {
                            f.config_type =
                                Some(http_filter::ConfigType::TypedConfig(any(Router {
                                    suppress_envoy_headers: true,
                                    ..Default::default()
                                })));
                        }
                    }),
                ),
            ],
            routes: vec![ignoring_port(route_config(
                &rn,
                vec![vhost(
                    "more",
                    &[HOST],
                    vec![
                        rt(prefix("/from"), rewrite),
                        rt(prefix("/"), to_cluster(cl)),
                    ],
                )],
            ))],
            clusters: vec![eds_cluster(cl)],
            endpoints: vec![cla(cl, &[backend.addr])],
            ..Default::default()
        }
    })
    .await;
    wait_answer(quiet, "/warm", 200, "raw-backend").await;
    wait_answer(mesh.port, "/warm", 200, "raw-backend").await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    for (port, what, suppressed) in [(quiet, "suppressed", true), (mesh.port, "default", false)] {
        let target = format!("/from/{what}");
        let r = raw_get(port, &target, HOST, &[]).await;
        c.eq(format!("{what}: status"), r.status, 200);
        let u = backend
            .request(&format!("/rewritten/{what}"))
            .unwrap_or_else(|| panic!("{what} did not reach the upstream"));
        let expect = |v: &str| (!suppressed).then(|| v.to_string());
        c.eq(
            format!("{what}: upstream x-envoy-expected-rq-timeout-ms"),
            u.header("x-envoy-expected-rq-timeout-ms")
                .map(str::to_string),
            expect("5000"),
        );
        c.eq(
            format!("{what}: upstream x-envoy-original-path"),
            u.header("x-envoy-original-path").map(str::to_string),
            expect(&target),
        );
        c.eq(
            format!("{what}: x-envoy-upstream-service-time on the response"),
            r.header("x-envoy-upstream-service-time").is_some(),
            !suppressed,
        );
    }
    c.finish();
}

/// Route configuration options istiod sets: `cluster_not_found_response_code` (500 on Gateway
/// API routes) and `max_direct_response_body_size_bytes` (1 MiB); and the configuration's
/// `request_mirror_policies`, which a virtual host without its own inherits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_config_not_found_codes_direct_body_limit_and_mirrors() {
    use envoy_types::pb::envoy::config::route::v3::{
        route, route_action, route_action::ClusterNotFoundResponseCode as Code,
        route_action::RequestMirrorPolicy, RouteAction,
    };
    use envoy_types::pb::google::protobuf::UInt32Value;
    let backend = RawBackend::start().await;
    let shadow = RawBackend::start().await;
    let missing = |code: Code| {
        route::Action::Route(RouteAction {
            cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(
                "no-such-cluster".into(),
            )),
            cluster_not_found_response_code: code as i32,
            ..Default::default()
        })
    };
    let big = "b".repeat(5000);
    let mesh = Mesh::start_raw(|port| {
        let rn = route_name(port);
        let mut rc = route_config(
            &rn,
            vec![vhost(
                "more",
                &[HOST],
                vec![
                    rt(path("/missing-500"), missing(Code::InternalServerError)),
                    rt(path("/missing-404"), missing(Code::NotFound)),
                    rt(path("/missing-503"), missing(Code::ServiceUnavailable)),
                    rt(path("/big"), direct(200, &big)),
                    rt(prefix("/"), to_cluster("raw")),
                ],
            )],
        );
        rc.max_direct_response_body_size_bytes = Some(UInt32Value { value: 8192 });
        rc.request_mirror_policies = vec![RequestMirrorPolicy {
            cluster: "shadow".into(),
            ..Default::default()
        }];
        Snapshot {
            listeners: vec![l(port)],
            routes: vec![ignoring_port(rc)],
            clusters: vec![eds_cluster("raw"), eds_cluster("shadow")],
            endpoints: vec![cla("raw", &[backend.addr]), cla("shadow", &[shadow.addr])],
            ..Default::default()
        }
    })
    .await;
    wait_answer(mesh.port, "/warm", 200, "raw-backend").await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    for (p, want) in [
        ("/missing-500", 500),
        ("/missing-404", 404),
        ("/missing-503", 503),
    ] {
        let r = raw_get(mesh.port, p, HOST, &[]).await;
        c.eq(format!("{p}: status"), r.status, want);
    }
    let r = raw_get(mesh.port, "/big", HOST, &[]).await;
    c.eq(
        "a 5000-byte direct body under an 8 KiB limit",
        (r.status, r.body.len()),
        (200, 5000),
    );
    raw_get(mesh.port, "/mirrored", HOST, &[]).await;
    let seen = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if shadow.request("/mirrored").is_some() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or(false);
    c.ok(
        "the configuration's mirror policy reaches the shadow cluster",
        seen,
        "not mirrored",
    );
    c.finish();
}

/// `internal_only_headers`: removed from an external client's request before routing (a
/// spoofed trust header neither reaches the upstream nor matches a route); an internal
/// client's go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_config_internal_only_headers() {
    let backend = RawBackend::start().await;
    let cl = "raw";
    let mut inside = 0;
    let mesh = Mesh::start_raw(|port| {
        inside = free_port();
        let rn = route_name(port);
        let trusted = with_header_route("x-trusted", "trusted route");
        let mut rc = route_config(
            &rn,
            vec![vhost(
                "more",
                &[HOST],
                vec![trusted, rt(prefix("/"), to_cluster(cl))],
            )],
        );
        rc.internal_only_headers = vec!["x-trusted".into()];
        Snapshot {
            listeners: vec![
                l(port),
                listener_with(inside, hcm_rds(inside, &rn, loopback_internal)),
            ],
            routes: vec![ignoring_port(rc)],
            clusters: vec![eds_cluster(cl)],
            endpoints: vec![cla(cl, &[backend.addr])],
            ..Default::default()
        }
    })
    .await;
    wait_answer(mesh.port, "/warm", 200, "raw-backend").await;
    wait_answer(inside, "/warm", 200, "raw-backend").await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let spoofed = [("x-trusted", "yes"), ("x-other", "kept")];
    let r = raw_get(mesh.port, "/outside", HOST, &spoofed).await;
    c.eq(
        "external: the header matched no route",
        (r.status, String::from_utf8_lossy(&r.body).to_string()),
        (200, "raw-backend".to_string()),
    );
    let u = backend
        .request("/outside")
        .unwrap_or_else(|| panic!("/outside did not reach the upstream"));
    c.eq(
        "external: x-trusted removed, x-other kept",
        (u.header("x-trusted"), u.header("x-other")),
        (None, Some("kept")),
    );
    let r = raw_get(inside, "/inside", HOST, &spoofed).await;
    c.eq(
        "internal: the header matches its route",
        (r.status, String::from_utf8_lossy(&r.body).to_string()),
        (200, "trusted route".to_string()),
    );
    c.finish();
}

/// Envoy removes an external client's `x-envoy-*` control headers before routing: a route
/// matching on one does not match for that client, and does for an internal one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_envoy_headers_are_gone_before_routing() {
    let backend = RawBackend::start().await;
    let cl = "raw";
    let mut inside = 0;
    let mesh = Mesh::start_raw(|port| {
        inside = free_port();
        let rn = route_name(port);
        let retry = with_header_route("x-envoy-retry-on", "matched on x-envoy-retry-on");
        Snapshot {
            listeners: vec![
                l(port),
                listener_with(inside, hcm_rds(inside, &rn, loopback_internal)),
            ],
            routes: vec![ignoring_port(route_config(
                &rn,
                vec![vhost(
                    "more",
                    &[HOST],
                    vec![retry, rt(prefix("/"), to_cluster(cl))],
                )],
            ))],
            clusters: vec![eds_cluster(cl)],
            endpoints: vec![cla(cl, &[backend.addr])],
            ..Default::default()
        }
    })
    .await;
    wait_answer(mesh.port, "/warm", 200, "raw-backend").await;
    wait_answer(inside, "/warm", 200, "raw-backend").await;
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let control = [("x-envoy-retry-on", "5xx")];
    for (port, who, want) in [
        (mesh.port, "external", "raw-backend"),
        (inside, "internal", "matched on x-envoy-retry-on"),
    ] {
        let r = raw_get(port, "/x", HOST, &control).await;
        c.eq(
            format!("{who}: the route picked"),
            (r.status, String::from_utf8_lossy(&r.body).to_string()),
            (200, want.to_string()),
        );
    }
    c.finish();
}

/// `strip_matching_host_port` drops the port from Host only when it is the
/// listener's own; `strip_any_host_port` drops any port. The stripped Host is
/// what routing matches and what the upstream receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hcm_strip_host_port_modes() {
    const H: &str = "strip.example.com";
    let echo = EchoBackend::start("echo").await;
    let echo_c = svc("echo");
    let (mut matching, mut any_port) = (0, 0);
    let mesh = Mesh::start_raw(|port| {
        matching = free_port();
        any_port = free_port();
        let rn = route_name(port);
        Snapshot {
            listeners: vec![
                l(port),
                listener_with(
                    matching,
                    hcm_rds(matching, &rn, |h| h.strip_matching_host_port = true),
                ),
                listener_with(
                    any_port,
                    hcm_rds(any_port, &rn, |h| {
                        h.strip_port_mode = Some(StripPortMode::StripAnyHostPort(true))
                    }),
                ),
            ],
            routes: vec![route_config(
                &rn,
                vec![
                    vhost("strip", &[H], vec![rt(prefix("/"), to_cluster(&echo_c))]),
                    vhost(
                        "catch",
                        &["*"],
                        vec![rt(prefix("/"), direct(200, "catch-all"))],
                    ),
                ],
            )],
            clusters: vec![eds_cluster(&echo_c)],
            endpoints: vec![cla(&echo_c, &[echo.addr])],
            ..Default::default()
        }
    })
    .await;
    for p in [mesh.port, matching, any_port] {
        wait_answer(p, "/", 200, "catch-all").await;
    }
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    // (listener, Host sent, body, upstream Host)
    let own = |p: u16| format!("{H}:{p}");
    let cases: Vec<(&str, u16, String, &str, Option<String>)> = vec![
        (
            "default",
            mesh.port,
            H.to_string(),
            "echo",
            Some(H.to_string()),
        ),
        ("default", mesh.port, own(mesh.port), "catch-all", None),
        ("default", mesh.port, format!("{H}:1234"), "catch-all", None),
        (
            "matching",
            matching,
            H.to_string(),
            "echo",
            Some(H.to_string()),
        ),
        (
            "matching",
            matching,
            own(matching),
            "echo",
            Some(H.to_string()),
        ),
        ("matching", matching, format!("{H}:1234"), "catch-all", None),
        ("matching", matching, own(mesh.port), "catch-all", None),
        ("any", any_port, own(any_port), "echo", Some(H.to_string())),
        (
            "any",
            any_port,
            format!("{H}:1234"),
            "echo",
            Some(H.to_string()),
        ),
        (
            "any",
            any_port,
            format!("{}:1234", H.to_uppercase()),
            "echo",
            Some(H.to_uppercase()),
        ),
    ];
    for (name, port, host, body, up_host) in cases {
        let r = raw_get(port, "/", &host, &[]).await;
        c.eq(
            format!("{name}: Host {host}: status, body, upstream host"),
            (
                r.status,
                r.body_str(),
                r.header("x-echo-host").map(str::to_string),
            ),
            (200, body.to_string(), up_host),
        );
    }
    c.finish();
}

/// Forwarding and request-id options, one listener each, as the upstream
/// sees them: `use_remote_address` with `xff_num_trusted_hops: 1`, with
/// `skip_xff_append`, with `preserve_external_request_id`, and
/// `generate_request_id: false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hcm_forwarding_and_request_id_options() {
    let backend = RawBackend::start().await;
    let cl = "raw";
    let (mut hops, mut skip, mut nogen, mut preserve) = (0, 0, 0, 0);
    let _mesh = Mesh::start_raw(|port| {
        hops = free_port();
        skip = free_port();
        nogen = free_port();
        preserve = free_port();
        let rn = route_name(port);
        let ura =
            |h: &mut HttpConnectionManager| h.use_remote_address = Some(BoolValue { value: true });
        Snapshot {
            listeners: vec![
                l(port),
                listener_with(
                    hops,
                    hcm_rds(hops, &rn, |h| {
                        ura(h);
                        h.xff_num_trusted_hops = 1;
                    }),
                ),
                listener_with(
                    skip,
                    hcm_rds(skip, &rn, |h| {
                        ura(h);
                        h.skip_xff_append = true;
                    }),
                ),
                listener_with(
                    nogen,
                    hcm_rds(nogen, &rn, |h| {
                        h.generate_request_id = Some(BoolValue { value: false })
                    }),
                ),
                listener_with(
                    preserve,
                    hcm_rds(preserve, &rn, |h| {
                        ura(h);
                        h.preserve_external_request_id = true;
                    }),
                ),
            ],
            routes: vec![all_to(&rn, cl)],
            clusters: vec![eds_cluster(cl)],
            endpoints: vec![cla(cl, &[backend.addr])],
            ..Default::default()
        }
    })
    .await;
    for p in [hops, skip, nogen, preserve] {
        wait_answer(p, "/warm", 200, "raw-backend").await;
    }
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let up = |t: &str| {
        backend
            .request(t)
            .unwrap_or_else(|| panic!("{t} did not reach the upstream"))
    };
    const CLIENT_XFF: &str = "198.51.100.1, 203.0.113.7";

    // xff_num_trusted_hops: 1: the last XFF entry the client sent is the
    // trusted client address; the peer is still appended.
    raw_get(
        hops,
        "/hops/1",
        HOST,
        &[("x-forwarded-for", CLIENT_XFF), ("x-request-id", "my-id")],
    )
    .await;
    let u = up("/hops/1");
    let xff = u.header("x-forwarded-for").unwrap_or_default();
    c.ok(
        "hops: x-forwarded-for gets a local address appended",
        xff.strip_prefix(&format!("{CLIENT_XFF},"))
            .is_some_and(is_local_address),
        xff,
    );
    c.eq(
        "hops: x-envoy-external-address",
        u.header("x-envoy-external-address"),
        Some("203.0.113.7"),
    );
    let rid = u.header("x-request-id").unwrap_or_default();
    c.ok("hops: x-request-id regenerated", is_uuid(rid), rid);
    raw_get(hops, "/hops/2", HOST, &[]).await;
    let u = up("/hops/2");
    let xff = u.header("x-forwarded-for").unwrap_or_default();
    c.ok(
        "hops, no XFF: one local address",
        is_local_address(xff),
        xff,
    );
    c.eq(
        "hops, no XFF: x-envoy-external-address",
        u.header("x-envoy-external-address"),
        Some("127.0.0.1"),
    );
    raw_get(hops, "/hops/3", HOST, &[("x-forwarded-for", "10.1.2.3")]).await;
    c.eq(
        "hops, private XFF: x-envoy-external-address",
        up("/hops/3").header("x-envoy-external-address"),
        Some("10.1.2.3"),
    );

    // skip_xff_append: XFF is left as the client sent it (or absent).
    raw_get(skip, "/skip/1", HOST, &[]).await;
    let u = up("/skip/1");
    c.eq(
        "skip, no XFF: x-forwarded-for",
        u.header("x-forwarded-for"),
        None,
    );
    c.eq(
        "skip, no XFF: x-envoy-external-address",
        u.header("x-envoy-external-address"),
        Some("127.0.0.1"),
    );
    raw_get(skip, "/skip/2", HOST, &[("x-forwarded-for", CLIENT_XFF)]).await;
    let u = up("/skip/2");
    c.eq(
        "skip: x-forwarded-for",
        u.header("x-forwarded-for"),
        Some(CLIENT_XFF),
    );
    c.eq(
        "skip: x-envoy-external-address",
        u.header("x-envoy-external-address"),
        Some("127.0.0.1"),
    );

    // generate_request_id: false: none is added; a client one passes.
    raw_get(nogen, "/nogen/1", HOST, &[]).await;
    c.eq(
        "nogen: x-request-id",
        up("/nogen/1").header("x-request-id").map(str::to_string),
        None,
    );
    raw_get(nogen, "/nogen/2", HOST, &[("x-request-id", "my-id")]).await;
    c.eq(
        "nogen, client id: x-request-id",
        up("/nogen/2").header("x-request-id").map(str::to_string),
        Some("my-id".to_string()),
    );

    // preserve_external_request_id: an edge request keeps the client's id.
    raw_get(preserve, "/preserve/1", HOST, &[("x-request-id", "my-id")]).await;
    c.eq(
        "preserve: x-request-id",
        up("/preserve/1").header("x-request-id").map(str::to_string),
        Some("my-id".to_string()),
    );
    raw_get(preserve, "/preserve/2", HOST, &[]).await;
    let rid = up("/preserve/2")
        .header("x-request-id")
        .unwrap_or_default()
        .to_string();
    c.ok("preserve, no id: generated", is_uuid(&rid), rid);
    c.finish();
}

// ---------------------------------------------------------------------------
// h2c downstream
// ---------------------------------------------------------------------------

/// Local replies and proxied responses over h2c: status, body, framing and
/// the headers the gateway adds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_local_replies_and_response_headers() {
    let echo = EchoBackend::start("echo").await;
    let (echo_c, empty_c) = (svc("echo"), svc("empty"));
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![ignoring_port(route_config(
            &route_name(port),
            vec![vhost(
                "more",
                &[HOST],
                vec![
                    rt(prefix("/proxied"), to_cluster(&echo_c)),
                    rt(path("/direct"), direct(200, "d")),
                    rt(path("/teapot"), direct(418, "short and stout")),
                    rt(path("/missing"), to_cluster("no-such-cluster")),
                    rt(path("/empty"), to_cluster(&empty_c)),
                ],
            )],
        ))],
        clusters: vec![eds_cluster(&echo_c), eds_cluster(&empty_c)],
        endpoints: vec![cla(&echo_c, &[echo.addr]), cla(&empty_c, &[])],
        ..Default::default()
    })
    .await;
    wait_answer(mesh.port, "/proxied", 200, "echo").await;
    let h2 = h2_client(&[HOST], mesh.port);
    let url = |p: &str| format!("http://{HOST}:{}{p}", mesh.port);
    let r = h2.get(url("/direct")).send().await.expect("h2c request");
    assert_eq!(r.version(), reqwest::Version::HTTP_2);

    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    // (path, status, body, content-length, content-type)
    type Case<'a> = (&'a str, u16, &'a str, Option<&'a str>, Option<&'a str>);
    let cases: &[Case] = &[
        ("/direct", 200, "d", Some("1"), Some("text/plain")),
        (
            "/teapot",
            418,
            "short and stout",
            Some("15"),
            Some("text/plain"),
        ),
        ("/missing", 503, "", None, None),
        (
            "/empty",
            503,
            "no healthy upstream",
            Some("19"),
            Some("text/plain"),
        ),
        ("/no-route", 404, "", None, None),
    ];
    for (p, status, body, len, ctype) in cases {
        let r = send_request(&h2, "GET", &url(p), None, &[], None).await;
        c.eq(
            format!("h2c {p}: status, body, content-length, content-type"),
            (
                r.status,
                r.body.as_str(),
                r.header("content-length"),
                r.header("content-type"),
            ),
            (*status, *body, *len, *ctype),
        );
        c.eq(
            format!("h2c {p}: server"),
            r.header("server"),
            Some("envoy"),
        );
        c.ok(
            format!("h2c {p}: date"),
            r.header("date").is_some(),
            &r.headers,
        );
        c.eq(
            format!("h2c {p}: x-envoy-upstream-service-time"),
            r.header("x-envoy-upstream-service-time"),
            None,
        );
    }
    let r = send_request(&h2, "GET", &url("/proxied/x"), None, &[], None).await;
    c.eq(
        "h2c proxied: status, body, server",
        (r.status, r.body.as_str(), r.header("server")),
        (200, "echo", Some("envoy")),
    );
    let t = r.header("x-envoy-upstream-service-time");
    c.ok(
        "h2c proxied: x-envoy-upstream-service-time is whole milliseconds",
        t.is_some_and(|t| t.parse::<u64>().is_ok()),
        t,
    );
    c.ok("h2c proxied: date", r.header("date").is_some(), &r.headers);
    for h in ["connection", "keep-alive", "transfer-encoding"] {
        c.eq(format!("h2c proxied: {h}"), r.header(h), None);
    }
    c.eq(
        "h2c proxied: upstream host is :authority",
        r.header("x-echo-host").map(str::to_string),
        Some(format!("{HOST}:{}", mesh.port)),
    );
    c.finish();
}

/// 100 concurrent streams on one h2c connection are each routed on their
/// own headers and answered with their own response; a large POST body
/// crosses to the HTTP/1.1 upstream intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_concurrent_streams_on_one_connection() {
    let (a, b) = (EchoBackend::start("a").await, EchoBackend::start("b").await);
    let (ca, cb) = (svc("a"), svc("b"));
    let mesh = Mesh::start_raw(|port| {
        let rn = route_name(port);
        Snapshot {
            listeners: vec![listener_with(
                port,
                hcm_rds(port, &rn, |h| h.stat_prefix = "h2c_streams".into()),
            )],
            routes: vec![ignoring_port(route_config(
                &rn,
                vec![vhost(
                    "more",
                    &[HOST],
                    vec![
                        rt(with_header(prefix("/"), "x-route", "a"), to_cluster(&ca)),
                        rt(prefix("/"), to_cluster(&cb)),
                    ],
                )],
            ))],
            clusters: vec![eds_cluster(&ca), eds_cluster(&cb)],
            endpoints: vec![cla(&ca, &[a.addr]), cla(&cb, &[b.addr])],
            ..Default::default()
        }
    })
    .await;
    wait_answer(mesh.port, "/warm", 200, "b").await;
    let cx = |text: &str| {
        prom_value(
            text,
            "envoy_http_downstream_cx_total",
            "envoy_http_conn_manager_prefix",
            "h2c_streams",
        )
    };
    let before = cx(&mesh.gw.prometheus().await);
    let h2 = h2_client(&[HOST], mesh.port);
    let url = |p: &str| format!("http://{HOST}:{}{p}", mesh.port);
    let r = send_request(&h2, "GET", &url("/first"), None, &[], None).await;
    assert_eq!((r.status, r.body.as_str()), (200, "b"), "{r:?}");

    let requests = (0..100).map(|i| {
        let h2 = h2.clone();
        let u = url(&format!("/c/{i}"));
        async move {
            let route: &[(&str, &str)] = if i % 2 == 0 { &[("x-route", "a")] } else { &[] };
            (i, send_request(&h2, "GET", &u, None, route, None).await)
        }
    });
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    for (i, r) in futures::future::join_all(requests).await {
        let want_backend = if i % 2 == 0 { "a" } else { "b" };
        c.eq(
            format!("stream {i}: status, backend, upstream path"),
            (r.status, r.backend(), r.header("x-echo-path")),
            (200, Some(want_backend), Some(format!("/c/{i}").as_str())),
        );
    }

    let body: String = (0..256 * 1024)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    let r = send_request(
        &h2,
        "POST",
        &url("/post"),
        None,
        &[],
        Some(body.clone().into_bytes()),
    )
    .await;
    c.eq(
        "h2c POST 256 KiB: status, method, content-length upstream, body length",
        (
            r.status,
            r.header("x-echo-method"),
            r.header("x-echo-content-length"),
            r.header("x-echo-body-len"),
        ),
        (200, Some("POST"), Some("262144"), Some("262144")),
    );
    c.ok(
        "h2c POST 256 KiB: body intact",
        r.body == body,
        r.body.len(),
    );

    let after = cx(&mesh.gw.prometheus().await);
    c.eq("downstream connections for all of it", after - before, 1.0);
    c.finish();
}

/// Over h2c the vhost is chosen by `:authority`, and the upstream's Host is
/// the `:authority`, whatever a `host` header says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_authority_and_host_header() {
    const A: &str = "a.example.com";
    const B: &str = "b.example.com";
    let echo = EchoBackend::start("echo").await;
    let echo_c = svc("echo");
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![
                vhost(
                    "a",
                    &[&format!("{A}:{port}")],
                    vec![
                        rt(prefix("/proxied"), to_cluster(&echo_c)),
                        rt(prefix("/"), direct(200, "vhost-a")),
                    ],
                ),
                vhost(
                    "b",
                    &[&format!("{B}:{port}"), B],
                    vec![
                        rt(prefix("/proxied"), to_cluster(&echo_c)),
                        rt(prefix("/"), direct(200, "vhost-b")),
                    ],
                ),
            ],
        )],
        clusters: vec![eds_cluster(&echo_c)],
        endpoints: vec![cla(&echo_c, &[echo.addr])],
        ..Default::default()
    })
    .await;
    let ha = format!("{A}:{}", mesh.port);
    eventually("vhost a", PROPAGATION, || async {
        let r = raw_get(mesh.port, "/", &ha, &[]).await;
        if r.body_str() == "vhost-a" {
            Ok(())
        } else {
            Err(format!("{} {:?}", r.status, r.body_str()))
        }
    })
    .await;
    let h2 = h2_client(&[A, B], mesh.port);
    let url = |p: &str| format!("http://{A}:{}{p}", mesh.port);
    let mut c = Checks::with_gaps(KNOWN_PORTICO_GAPS);
    let r = send_request(&h2, "GET", &url("/"), None, &[], None).await;
    c.eq(
        "h2c :authority a",
        (r.status, r.body.as_str()),
        (200, "vhost-a"),
    );
    let r = send_request(&h2, "GET", &url("/"), Some(B), &[], None).await;
    eprintln!(
        "observed: h2c :authority a + host b: {} {:?}",
        r.status, r.body
    );
    c.eq(
        "h2c :authority a + host b: vhost",
        (r.status, r.body.as_str()),
        (200, "vhost-a"),
    );
    let r = send_request(&h2, "GET", &url("/proxied"), Some(B), &[], None).await;
    c.eq(
        "h2c :authority a + host b: upstream host",
        (r.status, r.header("x-echo-host").map(str::to_string)),
        (200, Some(ha.clone())),
    );
    // HTTP/1.1 for contrast: Host decides.
    let r = raw_get(mesh.port, "/", B, &[]).await;
    c.eq(
        "HTTP/1.1 host b",
        (r.status, r.body_str()),
        (200, "vhost-b".to_string()),
    );
    c.finish();
}

// ---------------------------------------------------------------------------
// Stats
// ---------------------------------------------------------------------------

/// Downstream response classes and totals per HCM stat_prefix, and upstream
/// response codes per cluster, after a mix of 200/404/503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_downstream_classes_and_upstream_codes() {
    let sb = StatusBackend::start("statuses").await;
    let mut second = 0;
    let mesh = Mesh::start_raw(|port| {
        second = free_port();
        let rn = route_name(port);
        Snapshot {
            listeners: vec![
                listener_with(
                    port,
                    hcm_rds(port, &rn, |h| h.stat_prefix = "ingress_http".into()),
                ),
                listener_with(second, hcm_rds(second, &rn, |_| {})),
            ],
            routes: vec![route_config(
                &rn,
                vec![vhost(
                    "more",
                    &["*"],
                    vec![
                        rt(prefix("/status/"), to_cluster("statuses")),
                        rt(path("/ok"), to_cluster("statuses")),
                        rt(path("/empty"), to_cluster("empty")),
                    ],
                )],
            )],
            clusters: vec![eds_cluster("statuses"), eds_cluster("empty")],
            endpoints: vec![cla("statuses", &[sb.addr]), cla("empty", &[])],
            ..Default::default()
        }
    })
    .await;
    wait_answer(mesh.port, "/ok", 200, "statuses").await;
    wait_answer(second, "/ok", 200, "statuses").await;
    // Envoy's HCM prefix tag takes the stat_prefix up to its first dot and
    // leaves the rest in the metric name.
    let dotted_prefix = "outbound_0";
    let dotted = |stat: &str| format!("envoy_http_0_0_0_{second}_{stat}");
    let stats = |text: &str| -> Vec<(&'static str, f64)> {
        const P: &str = "envoy_http_conn_manager_prefix";
        let class = |metric: &str, prefix: &str, class: &str| -> f64 {
            prom_samples(text, metric)
                .into_iter()
                .filter(|(l, _)| {
                    l.get(P).map(String::as_str) == Some(prefix)
                        && l.get("envoy_response_code_class").map(String::as_str) == Some(class)
                })
                .map(|(_, v)| v)
                .sum()
        };
        let code = |cluster: &str, code: &str| -> f64 {
            prom_samples(text, "envoy_cluster_upstream_rq")
                .into_iter()
                .filter(|(l, _)| {
                    l.get("envoy_cluster_name").map(String::as_str) == Some(cluster)
                        && l.get("envoy_response_code").map(String::as_str) == Some(code)
                })
                .map(|(_, v)| v)
                .sum()
        };
        let (xx, total) = (
            "envoy_http_downstream_rq_xx",
            "envoy_http_downstream_rq_total",
        );
        let up_total = "envoy_cluster_upstream_rq_total";
        let (dxx, dtotal) = (dotted("downstream_rq_xx"), dotted("downstream_rq_total"));
        let dclasses: f64 = ["1", "2", "3", "4", "5"]
            .iter()
            .map(|c| class(&dxx, dotted_prefix, c))
            .sum();
        let iclasses: f64 = ["1", "2", "3", "4", "5"]
            .iter()
            .map(|c| class(xx, "ingress_http", c))
            .sum();
        vec![
            ("ingress_http 2xx", class(xx, "ingress_http", "2")),
            ("ingress_http 4xx", class(xx, "ingress_http", "4")),
            ("ingress_http 5xx", class(xx, "ingress_http", "5")),
            (
                "ingress_http total",
                prom_value(text, total, P, "ingress_http"),
            ),
            (
                "ingress_http total - classes",
                prom_value(text, total, P, "ingress_http") - iclasses,
            ),
            ("dotted 2xx", class(&dxx, dotted_prefix, "2")),
            ("dotted 4xx", class(&dxx, dotted_prefix, "4")),
            ("dotted total", prom_value(text, &dtotal, P, dotted_prefix)),
            (
                "dotted total - classes",
                prom_value(text, &dtotal, P, dotted_prefix) - dclasses,
            ),
            ("statuses 200", code("statuses", "200")),
            ("statuses 404", code("statuses", "404")),
            ("statuses 503", code("statuses", "503")),
            (
                "statuses total",
                prom_value(text, up_total, "envoy_cluster_name", "statuses"),
            ),
            ("empty 503", code("empty", "503")),
            (
                "empty total",
                prom_value(text, up_total, "envoy_cluster_name", "empty"),
            ),
        ]
    };
    // Every warm-up request counted in a class (no request in flight).
    let settled = |s: &[(&str, f64)]| {
        s.iter()
            .filter(|(k, _)| k.ends_with("total - classes"))
            .all(|(_, v)| *v == 0.0)
    };
    let before = eventually("the warm-up to be counted", PROPAGATION, || async {
        let text = mesh.gw.prometheus().await;
        let s = stats(&text);
        if settled(&s) && s[3].1 >= 1.0 && s[7].1 >= 1.0 {
            Ok(s)
        } else {
            Err(format!("{s:?}\n{text}"))
        }
    })
    .await;

    let run = |port: u16, p: &'static str, n: usize, status: u16| {
        let client = mesh.client.clone();
        async move {
            for _ in 0..n {
                let r = client
                    .get(&format!("http://127.0.0.1:{port}{p}"), Some(HOST), &[])
                    .await;
                assert_eq!(r.status, status, "{p}: {r:?}");
            }
        }
    };
    run(mesh.port, "/ok", 5, 200).await;
    run(mesh.port, "/status/404", 3, 404).await;
    run(mesh.port, "/nothing", 2, 404).await;
    run(mesh.port, "/status/503", 2, 503).await;
    run(mesh.port, "/empty", 1, 503).await;
    run(second, "/ok", 2, 200).await;
    run(second, "/nothing", 1, 404).await;

    let want: Vec<(&str, f64)> = vec![
        ("ingress_http 2xx", 5.0),
        ("ingress_http 4xx", 5.0),
        ("ingress_http 5xx", 3.0),
        ("ingress_http total", 13.0),
        ("ingress_http total - classes", 0.0),
        ("dotted 2xx", 2.0),
        ("dotted 4xx", 1.0),
        ("dotted total", 3.0),
        ("dotted total - classes", 0.0),
        ("statuses 200", 7.0),
        ("statuses 404", 3.0),
        ("statuses 503", 2.0),
        ("statuses total", 12.0),
        // "no healthy upstream" is charged to the cluster as a 503, though
        // no upstream request was made.
        ("empty 503", 1.0),
        ("empty total", 0.0),
    ];
    eventually("the stats to count the requests", PROPAGATION, || async {
        let now = stats(&mesh.gw.prometheus().await);
        let got: Vec<(&str, f64)> = now
            .iter()
            .zip(&before)
            .map(|((k, v), (_, b))| (*k, v - b))
            .collect();
        if got == want {
            Ok(())
        } else {
            Err(format!("deltas {got:?}"))
        }
    })
    .await;
}

// ---------------------------------------------------------------------------
// Round robin
// ---------------------------------------------------------------------------

/// Three equal endpoints under ROUND_ROBIN take strict turns: 30 sequential
/// requests give each exactly 10, in a repeating order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_three_equal_endpoints_take_strict_turns() {
    let bs = [
        Backend::start("rr-1").await,
        Backend::start("rr-2").await,
        Backend::start("rr-3").await,
    ];
    let cl = svc("rr");
    let addrs: Vec<SocketAddr> = bs.iter().map(|b| b.addr).collect();
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![all_to(&route_name(port), &cl)],
        clusters: vec![eds_cluster(&cl)],
        endpoints: vec![cla(&cl, &addrs)],
        ..Default::default()
    })
    .await;
    for b in &bs {
        mesh.wait_backend("/", HOST, &[], &b.name).await;
    }
    let mut seq = Vec::new();
    for _ in 0..30 {
        let r = mesh.get("/", HOST, &[]).await;
        seq.push(r.backend().unwrap_or("none").to_string());
    }
    let mut d: HashMap<&str, usize> = HashMap::new();
    for s in &seq {
        *d.entry(s.as_str()).or_default() += 1;
    }
    assert!(
        bs.iter().all(|b| d.get(b.name.as_str()) == Some(&10)),
        "{d:?} {seq:?}"
    );
    assert!(
        seq.iter().enumerate().all(|(i, s)| *s == seq[i % 3]),
        "not a repeating order: {seq:?}"
    );
}

/// ROUND_ROBIN with endpoint weights 1:2 over 300 sequential requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_weights_1_to_2() {
    let (one, two) = (Backend::start("w1").await, Backend::start("w2").await);
    let cl = svc("w12");
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![all_to(&route_name(port), &cl)],
        clusters: vec![eds_cluster(&cl)],
        endpoints: vec![cla_localities(
            &cl,
            vec![locality_at(
                0,
                vec![
                    lb_ep(one.addr, EdsHealth::Healthy, Some(1)),
                    lb_ep(two.addr, EdsHealth::Healthy, Some(2)),
                ],
            )],
        )],
        ..Default::default()
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "w1").await;
    mesh.wait_backend("/", HOST, &[], "w2").await;
    let started = Instant::now();
    let d = distribution(&mesh, 300).await;
    eprintln!(
        "observed: weights 1:2 over 300: {d:?} in {:?}",
        started.elapsed()
    );
    assert_eq!(
        d.get("w1").copied().unwrap_or(0) + d.get("w2").copied().unwrap_or(0),
        300,
        "{d:?}"
    );
    assert_eq!(d.get("w1"), Some(&100), "{d:?}");
}

/// Differences from Envoy that are deliberate or come from pingora; everything else must match.
const KNOWN_PORTICO_GAPS: &[(&str, &str)] = &[
    (
        "h2c :authority a + host b",
        "pingora's HTTP/2 codec refuses a Host that differs from :authority (400)",
    ),
    (
        "the updated cluster re-requests its endpoints",
        "Portico keeps an updated cluster's endpoints instead of re-fetching them",
    ),
    (
        "CDS update ACKed before the cluster's endpoints arrived",
        "an updated cluster keeps its endpoints, so it is not warming",
    ),
    (
        "CDS duplicate: the first copy is applied",
        "a push applies as a whole or not at all",
    ),
    (
        "LDS duplicate: the first copy is applied",
        "a push applies as a whole or not at all",
    ),
    (
        "first RDS request after the change",
        "a replaced listener does not drain, so its route config is released at once",
    ),
];
