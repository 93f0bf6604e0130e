//! Conformance of the xDS lifecycle and the admin endpoint, with Envoy as the
//! spec: listeners and clusters coming and going, warming, NACKs and their
//! bookkeeping, EDS health/priority/weights, and what the admin port reports.

mod common;

use std::collections::HashMap;
use std::io::ErrorKind;
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::{cluster, Cluster};
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::{route, RouteConfiguration};
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_connection_manager, http_filter, HttpFilter, Rds,
};
use envoy_types::pb::google::protobuf::Any;
use serde_json::Value;

const HOST: &str = "xds.example.com";

fn svc(name: &str) -> String {
    format!("outbound|9080||{name}.default.svc.cluster.local")
}

fn single_route(port: u16, action: route::Action) -> RouteConfiguration {
    route_config(
        &route_name(port),
        vec![vhost("xds", &["*"], vec![rt(prefix("/"), action)])],
    )
}

/// Route config `http.<port>` with `(prefix, cluster)` routes in order.
fn prefix_routes(port: u16, routes: &[(&str, &str)]) -> RouteConfiguration {
    route_config(
        &route_name(port),
        vec![vhost(
            "xds",
            &["*"],
            routes
                .iter()
                .map(|(p, c)| rt(prefix(p), to_cluster(c)))
                .collect(),
        )],
    )
}

fn url(port: u16, path: &str) -> String {
    format!("http://127.0.0.1:{port}{path}")
}

fn router_filter() -> HttpFilter {
    HttpFilter {
        name: "envoy.filters.http.router".to_string(),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(Router::default()))),
        ..Default::default()
    }
}

/// Listener on `port` whose HCM uses `filters` as its HTTP filter chain.
fn listener_with_filters(port: u16, filters: Vec<HttpFilter>) -> Listener {
    let mut h = hcm(port);
    h.http_filters = filters;
    listener_with(port, h)
}

/// Waits until a request on a FRESH connection to `port` is served by `backend`.
async fn wait_fresh_backend(port: u16, path: &str, backend: &str) {
    let u = url(port, path);
    eventually(&format!("{u} to reach {backend}"), PROPAGATION, || async {
        let r = get(&u, Some(HOST), &[]).await;
        if r.status == 200 && r.backend() == Some(backend) {
            Ok(())
        } else {
            Err(format!(
                "status {} backend {:?} error {:?} body {:?}",
                r.status,
                r.backend(),
                r.error,
                r.body
            ))
        }
    })
    .await
}

/// Waits until a fresh request to `port` answers `status`; returns it.
async fn wait_fresh_status(port: u16, path: &str, status: u16) -> Resp {
    let u = url(port, path);
    eventually(&format!("{u} to answer {status}"), PROPAGATION, || async {
        let r = get(&u, Some(HOST), &[]).await;
        if r.status == status {
            Ok(r)
        } else {
            Err(format!(
                "status {} error {:?} body {:?}",
                r.status, r.error, r.body
            ))
        }
    })
    .await
}

/// Waits until connecting to `port` is refused.
async fn wait_refused(port: u16) {
    eventually(
        &format!("port {port} to refuse connections"),
        PROPAGATION,
        || async {
            match tcp_connect(port).await {
                Err(ErrorKind::ConnectionRefused) => Ok(()),
                other => Err(format!("connect: {other:?}")),
            }
        },
    )
    .await
}

/// Sends `n` sequential requests and counts who answered: the `x-backend`
/// value, or `status:<code>` for answers without one.
async fn distribution(mesh: &Mesh, path: &str, n: usize) -> HashMap<String, usize> {
    let mut seen = HashMap::new();
    for _ in 0..n {
        let r = mesh.get(path, HOST, &[]).await;
        let key = match (r.status, r.backend()) {
            (200, Some(b)) => b.to_string(),
            (s, _) => format!("status:{s} {:?} {:?}", r.body, r.error),
        };
        *seen.entry(key).or_default() += 1;
    }
    seen
}

fn count(d: &HashMap<String, usize>, backend: &str) -> usize {
    d.get(backend).copied().unwrap_or(0)
}

/// Numeric part of the test ADS server's nonces (`n<seq>`).
fn nonce_seq(nonce: &str) -> u64 {
    nonce
        .strip_prefix('n')
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected nonce {nonce:?}"))
}

/// Mesh with one EDS cluster `name` -> `backend` behind `/`.
async fn one_cluster_mesh(name: &str, backend: &Backend) -> Mesh {
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![single_route(port, to_cluster(name))],
            ..Default::default()
        }
        .with_backends(&[(name, backend)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], &backend.name).await;
    mesh
}

/// Mesh whose route table sends `/<prefix>` to the matching cluster, with the
/// given clusters and load assignments.
async fn eds_mesh(
    routes: &[(&str, &str)],
    clusters: Vec<Cluster>,
    endpoints: Vec<envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment>,
) -> Mesh {
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![prefix_routes(port, routes)],
        clusters,
        endpoints,
        ..Default::default()
    })
    .await;
    mesh.ads.wait_for_ack(EDS, "1", PROPAGATION).await;
    mesh.ads.wait_for_ack(RDS, "1", PROPAGATION).await;
    mesh
}

// ---------------------------------------------------------------------------
// Listeners
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_added_at_runtime_serves_and_removed_listener_refuses_connections() {
    let b = Backend::start("first").await;
    let c = svc("first");
    let mesh = one_cluster_mesh(&c, &b).await;

    let p2 = free_port();
    assert_eq!(tcp_connect(p2).await, Err(ErrorKind::ConnectionRefused));
    mesh.ads.set_routes(
        "2",
        &[
            single_route(mesh.port, to_cluster(&c)),
            single_route(p2, direct(200, "second listener")),
        ],
    );
    mesh.ads.set_listeners("2", &[l(mesh.port), l(p2)]);
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    let r = wait_fresh_status(p2, "/", 200).await;
    assert_eq!(r.body, "second listener");

    mesh.ads.set_listeners("3", &[l(mesh.port)]);
    mesh.ads.wait_for_ack(LDS, "3", PROPAGATION).await;
    wait_refused(p2).await;
    // The remaining listener is untouched.
    for _ in 0..5 {
        let r = get(&mesh.url("/"), Some(HOST), &[]).await;
        assert_eq!((r.status, r.backend()), (200, Some("first")), "{r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_address_change_moves_the_listener_to_the_new_port() {
    let b = Backend::start("first").await;
    let c = svc("first");
    let mesh = one_cluster_mesh(&c, &b).await;

    // Same listener name (and route config), new port: accepted and moved.
    let p2 = free_port();
    let mut moved = l(mesh.port);
    moved.address = Some(socket_addr("127.0.0.1", p2));
    mesh.ads.set_listeners("2", &[moved]);
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    wait_fresh_backend(p2, "/", "first").await;
    wait_refused(mesh.port).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_listeners_with_the_same_address_in_one_push_are_nacked() {
    let b = Backend::start("first").await;
    let c = svc("first");
    let mesh = one_cluster_mesh(&c, &b).await;
    mesh.ads.wait_for_ack(LDS, "1", PROPAGATION).await;

    let p2 = free_port();
    mesh.ads.set_routes(
        "2",
        &[
            single_route(mesh.port, to_cluster(&c)),
            single_route(p2, direct(200, "new listener")),
        ],
    );
    mesh.ads.wait_for_ack(RDS, "2", PROPAGATION).await;
    let mut twin = l(p2);
    twin.name = format!("{}_twin", listener_name(p2));
    let before = mesh.ads.log_len();
    mesh.ads.set_listeners("2", &[l(mesh.port), l(p2), twin]);
    let nack = mesh.ads.wait_for_nack_since(LDS, before, PROPAGATION).await;
    assert_eq!(nack.version_info, "1", "{nack:?}");
    assert!(
        !nack.error.as_deref().unwrap_or_default().trim().is_empty(),
        "{nack:?}"
    );
    // The existing listener keeps serving.
    for _ in 0..5 {
        let r = get(&mesh.url("/"), Some(HOST), &[]).await;
        assert_eq!((r.status, r.backend()), (200, Some("first")), "{r:?}");
    }
    // Not asserted (Portico rejects the whole push by design): what became
    // of the valid new listener of the rejected push.
    tokio::time::sleep(Duration::from_millis(500)).await;
    eprintln!(
        "observed: good listener of a NACKed LDS push: {:?}",
        probe_http(p2, HOST, "/", Duration::from_secs(1)).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_waiting_for_its_route_config_refuses_connections() {
    let b = Backend::start("first").await;
    let c = svc("first");
    let mesh = one_cluster_mesh(&c, &b).await;

    let p2 = free_port();
    // LDS names http.<p2>, which the control plane does not have yet.
    mesh.ads.set_listeners("2", &[l(mesh.port), l(p2)]);
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    eventually(
        "RDS subscription to the new route name",
        PROPAGATION,
        || async {
            let asked = mesh
                .ads
                .log()
                .iter()
                .any(|r| r.type_url == RDS && r.resource_names.contains(&route_name(p2)));
            if asked {
                Ok(())
            } else {
                Err("not yet".to_string())
            }
        },
    )
    .await;
    // While the listener warms, its port is not even bound.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        assert_eq!(
            probe_http(p2, HOST, "/", Duration::from_millis(500)).await,
            Err("refused".to_string()),
            "a listener waiting for its route config must not accept connections"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    mesh.ads.set_routes(
        "2",
        &[
            single_route(mesh.port, to_cluster(&c)),
            single_route(p2, direct(200, "warmed")),
        ],
    );
    let r = wait_fresh_status(p2, "/", 200).await;
    assert_eq!(r.body, "warmed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_keeps_old_routes_until_its_new_route_config_arrives() {
    let old = Backend::start("old-routes").await;
    let new = Backend::start("new-routes").await;
    let (c_old, c_new) = (svc("old"), svc("new"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![single_route(port, to_cluster(&c_old))],
            ..Default::default()
        }
        .with_backends(&[(&c_old, &old), (&c_new, &new)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "old-routes").await;

    let next_name = format!("{}.next", route_name(mesh.port));
    let mut h = hcm(mesh.port);
    h.route_specifier = Some(http_connection_manager::RouteSpecifier::Rds(Rds {
        config_source: Some(ads_source()),
        route_config_name: next_name.clone(),
    }));
    mesh.ads.set_listeners("2", &[listener_with(mesh.port, h)]);
    mesh.ads.wait_for_ack(LDS, "2", PROPAGATION).await;
    // The new route name is requested but does not exist yet: old routes serve.
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        let r = get(&mesh.url("/"), Some(HOST), &[]).await;
        assert_eq!((r.status, r.backend()), (200, Some("old-routes")), "{r:?}");
    }
    let mut next = single_route(mesh.port, to_cluster(&c_new));
    next.name = next_name;
    mesh.ads
        .set_routes("2", &[single_route(mesh.port, to_cluster(&c_old)), next]);
    wait_fresh_backend(mesh.port, "/", "new-routes").await;
}

// ---------------------------------------------------------------------------
// HTTP filters
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_http_filter_is_nacked_unless_optional() {
    let b = Backend::start("first").await;
    let c = svc("first");
    let mesh = one_cluster_mesh(&c, &b).await;
    mesh.ads.wait_for_ack(LDS, "1", PROPAGATION).await;

    let unknown = |optional: bool| HttpFilter {
        name: "portico.test.no_such_filter".to_string(),
        config_type: Some(http_filter::ConfigType::TypedConfig(Any {
            type_url: "type.googleapis.com/portico.test.NoSuchFilter".to_string(),
            value: vec![],
        })),
        is_optional: optional,
        ..Default::default()
    };
    let before = mesh.ads.log_len();
    mesh.ads.set_listeners(
        "2",
        &[listener_with_filters(
            mesh.port,
            vec![unknown(false), router_filter()],
        )],
    );
    let nack = mesh.ads.wait_for_nack_since(LDS, before, PROPAGATION).await;
    assert_eq!(nack.version_info, "1", "{nack:?}");
    eprintln!("observed: unknown filter NACK: {:?}", nack.error);
    let r = get(&mesh.url("/"), Some(HOST), &[]).await;
    assert_eq!((r.status, r.backend()), (200, Some("first")), "{r:?}");

    mesh.ads.set_listeners(
        "3",
        &[listener_with_filters(
            mesh.port,
            vec![unknown(true), router_filter()],
        )],
    );
    mesh.ads.wait_for_ack(LDS, "3", PROPAGATION).await;
    wait_fresh_backend(mesh.port, "/", "first").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_filter_not_last_is_nacked() {
    let b = Backend::start("first").await;
    let c = svc("first");
    let mesh = one_cluster_mesh(&c, &b).await;
    mesh.ads.wait_for_ack(LDS, "1", PROPAGATION).await;

    let before = mesh.ads.log_len();
    mesh.ads.set_listeners(
        "2",
        &[listener_with_filters(
            mesh.port,
            vec![router_filter(), router_filter()],
        )],
    );
    let nack = mesh.ads.wait_for_nack_since(LDS, before, PROPAGATION).await;
    assert_eq!(nack.version_info, "1", "{nack:?}");
    eprintln!("observed: router-not-last NACK: {:?}", nack.error);
    for _ in 0..5 {
        let r = get(&mesh.url("/"), Some(HOST), &[]).await;
        assert_eq!((r.status, r.backend()), (200, Some("first")), "{r:?}");
    }
}

// ---------------------------------------------------------------------------
// Clusters
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_cluster_answers_503_and_readded_cluster_serves_again() {
    let b = Backend::start("first").await;
    let c = svc("first");
    let mesh = one_cluster_mesh(&c, &b).await;

    mesh.ads.set_clusters("2", &[]);
    mesh.ads.wait_for_ack(CDS, "2", PROPAGATION).await;
    let r = mesh.wait_status("/", HOST, 503).await;
    eprintln!("observed: removed cluster: {r:?}");
    for _ in 0..3 {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!((r.status, r.body.as_str()), (503, ""), "{r:?}");
    }

    mesh.ads.set_clusters("3", &[eds_cluster(&c)]);
    mesh.ads.wait_for_ack(CDS, "3", PROPAGATION).await;
    mesh.wait_backend("/", HOST, &[], "first").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_waiting_for_endpoints_answers_503_until_eds_arrives() {
    let b1 = Backend::start("first").await;
    let b2 = Backend::start("second").await;
    let (c1, c2) = (svc("first"), svc("second"));
    let mesh = one_cluster_mesh(&c1, &b1).await;

    mesh.ads.set_routes(
        "2",
        &[prefix_routes(mesh.port, &[("/second", &c2), ("/", &c1)])],
    );
    mesh.ads.wait_for_ack(RDS, "2", PROPAGATION).await;
    // CDS adds `second`; its endpoints are not on the control plane yet.
    mesh.ads
        .set_clusters("2", &[eds_cluster(&c1), eds_cluster(&c2)]);
    eventually(
        "EDS subscription to the new cluster",
        PROPAGATION,
        || async {
            let asked = mesh
                .ads
                .log()
                .iter()
                .any(|r| r.type_url == EDS && r.resource_names.contains(&c2));
            if asked {
                Ok(())
            } else {
                Err("not yet".to_string())
            }
        },
    )
    .await;
    for _ in 0..5 {
        let r = mesh.get("/second", HOST, &[]).await;
        assert_eq!((r.status, r.body.as_str()), (503, ""), "{r:?}");
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!((r.status, r.backend()), (200, Some("first")), "{r:?}");
    }
    let acked_while_warming = mesh
        .ads
        .log()
        .iter()
        .any(|r| r.type_url == CDS && r.version_info == "2");

    mesh.ads
        .set_endpoints("2", &[cla(&c1, &[b1.addr]), cla(&c2, &[b2.addr])]);
    mesh.wait_backend("/second", HOST, &[], "second").await;
    mesh.ads.wait_for_ack(CDS, "2", PROPAGATION).await;
    // Envoy holds the ACK of a CDS version until its new clusters have warmed.
    assert!(
        !acked_while_warming,
        "CDS 2 was acknowledged before its new cluster's endpoints arrived"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_cluster_in_a_push_is_nacked_and_old_clusters_keep_serving() {
    let b1 = Backend::start("first").await;
    let b2 = Backend::start("second").await;
    let (c1, c2, bad) = (svc("first"), svc("second"), svc("bad"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![prefix_routes(port, &[("/second", &c2), ("/", &c1)])],
            ..Default::default()
        }
        .with_backends(&[(&c1, &b1)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "first").await;
    mesh.ads.wait_for_ack(CDS, "1", PROPAGATION).await;
    mesh.ads
        .set_endpoints("1", &[cla(&c1, &[b1.addr]), cla(&c2, &[b2.addr])]);

    let mut invalid = eds_cluster(&bad);
    invalid.lb_policy = 99;
    let before = mesh.ads.log_len();
    mesh.ads
        .set_clusters("2", &[eds_cluster(&c1), eds_cluster(&c2), invalid]);
    let nack = mesh.ads.wait_for_nack_since(CDS, before, PROPAGATION).await;
    assert_eq!(nack.version_info, "1", "{nack:?}");
    let msg = nack.error.clone().unwrap_or_default();
    eprintln!("observed: invalid cluster NACK: {msg:?}");
    assert!(
        msg.contains(&bad),
        "NACK does not name the cluster: {msg:?}"
    );
    for _ in 0..10 {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!((r.status, r.backend()), (200, Some("first")), "{r:?}");
    }
    // Not asserted (Portico rejects the whole push by design): whether the
    // valid new cluster of the rejected push was applied.
    observe_good_part(&mesh, "lb_policy 99").await;
}

/// Reports (without asserting) whether `/second` starts being served within
/// 2 s, i.e. whether the valid new cluster of a rejected push was applied.
async fn observe_good_part(mesh: &Mesh, what: &str) {
    let start = Instant::now();
    let mut r = mesh.get("/second", HOST, &[]).await;
    while r.status != 200 && start.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        r = mesh.get("/second", HOST, &[]).await;
    }
    eprintln!(
        "observed: good cluster of a CDS push NACKed for {what}: {} {:?} {:?}",
        r.status,
        r.backend(),
        r.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nack_carries_last_accepted_version_and_rejected_nonce() {
    let b1 = Backend::start("first").await;
    let b2 = Backend::start("second").await;
    let (c1, c2) = (svc("first"), svc("second"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![prefix_routes(port, &[("/second", &c2), ("/", &c1)])],
            ..Default::default()
        }
        .with_backends(&[(&c1, &b1)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "first").await;
    mesh.ads.wait_for_ack(CDS, "1", PROPAGATION).await;
    mesh.ads
        .set_endpoints("1", &[cla(&c1, &[b1.addr]), cla(&c2, &[b2.addr])]);

    let negative_timeout = |name: &str| {
        let mut c = eds_cluster(name);
        c.connect_timeout = Some(envoy_types::pb::google::protobuf::Duration {
            seconds: -1,
            nanos: 0,
        });
        c
    };
    let check_nack = |nack: &LoggedRequest, before: usize, accepted: &str| {
        assert_eq!(
            nack.version_info, accepted,
            "NACK must carry the last accepted version: {nack:?}"
        );
        assert!(
            !nack.error.as_deref().unwrap_or_default().trim().is_empty(),
            "NACK without error_detail: {nack:?}"
        );
        // The rejected response is the newest one sent: its nonce is newer
        // than any nonce the gateway had answered before the push.
        let newest_before = mesh.ads.log()[..before]
            .iter()
            .filter(|r| !r.response_nonce.is_empty())
            .map(|r| nonce_seq(&r.response_nonce))
            .max()
            .unwrap_or(0);
        assert!(
            nonce_seq(&nack.response_nonce) > newest_before,
            "NACK nonce {:?} is not the rejected response's (newest answered before: n{newest_before})",
            nack.response_nonce
        );
    };

    let before = mesh.ads.log_len();
    mesh.ads
        .set_clusters("2", &[eds_cluster(&c1), negative_timeout(&c2)]);
    let nack = mesh.ads.wait_for_nack_since(CDS, before, PROPAGATION).await;
    eprintln!("observed: negative connect_timeout NACK: {:?}", nack.error);
    check_nack(&nack, before, "1");
    assert_eq!(mesh.get("/", HOST, &[]).await.backend(), Some("first"));

    // The next valid push is ACKed with its own version and a newer nonce.
    mesh.ads
        .set_clusters("3", &[eds_cluster(&c1), eds_cluster(&c2)]);
    mesh.ads.wait_for_ack(CDS, "3", PROPAGATION).await;
    let ack = mesh
        .ads
        .log()
        .into_iter()
        .find(|r| r.type_url == CDS && r.version_info == "3")
        .expect("ACK of 3");
    assert!(ack.error.is_none());
    assert!(
        nonce_seq(&ack.response_nonce) > nonce_seq(&nack.response_nonce),
        "ACK {ack:?} vs NACK {nack:?}"
    );
    mesh.wait_backend("/second", HOST, &[], "second").await;

    // A second rejection reports version 3, the last accepted one.
    let before = mesh.ads.log_len();
    mesh.ads
        .set_clusters("4", &[negative_timeout(&c1), eds_cluster(&c2)]);
    let nack = mesh.ads.wait_for_nack_since(CDS, before, PROPAGATION).await;
    check_nack(&nack, before, "3");
    assert!(
        !mesh
            .ads
            .log()
            .iter()
            .any(|r| r.type_url == CDS && (r.version_info == "2" || r.version_info == "4")),
        "a rejected version was acknowledged"
    );
    assert_eq!(mesh.get("/", HOST, &[]).await.backend(), Some("first"));
    assert_eq!(
        mesh.get("/second", HOST, &[]).await.backend(),
        Some("second")
    );
}

// ---------------------------------------------------------------------------
// Endpoints
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eds_unhealthy_and_draining_endpoints_get_no_traffic() {
    let (a, b, c, d) = (
        Backend::start("healthy").await,
        Backend::start("unknown").await,
        Backend::start("unhealthy").await,
        Backend::start("draining").await,
    );
    let (cu, cd) = (svc("with-unhealthy"), svc("with-draining"));
    let mesh = eds_mesh(
        &[("/u", &cu), ("/d", &cd)],
        vec![eds_cluster(&cu), eds_cluster(&cd)],
        vec![
            cla_localities(
                &cu,
                vec![locality_at(
                    0,
                    vec![
                        lb_ep(a.addr, EdsHealth::Healthy, None),
                        lb_ep(b.addr, EdsHealth::Unknown, None),
                        lb_ep(c.addr, EdsHealth::Unhealthy, None),
                    ],
                )],
            ),
            cla_localities(
                &cd,
                vec![locality_at(
                    0,
                    vec![
                        lb_ep(a.addr, EdsHealth::Healthy, None),
                        lb_ep(b.addr, EdsHealth::Unknown, None),
                        lb_ep(d.addr, EdsHealth::Draining, None),
                    ],
                )],
            ),
        ],
    )
    .await;
    for p in ["/u", "/d"] {
        let dist = distribution(&mesh, p, 60).await;
        assert!(
            count(&dist, "healthy") >= 20 && count(&dist, "unknown") >= 20,
            "{p}: {dist:?}"
        );
        assert_eq!(
            count(&dist, "healthy") + count(&dist, "unknown"),
            60,
            "{p}: {dist:?}"
        );
    }
    assert_eq!((c.served(), d.served()), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eds_one_healthy_of_three_panics_and_uses_all() {
    let (a, b, c) = (
        Backend::start("a").await,
        Backend::start("b").await,
        Backend::start("c").await,
    );
    let cl = svc("panic");
    let mesh = eds_mesh(
        &[("/", &cl)],
        vec![eds_cluster(&cl)],
        vec![cla_localities(
            &cl,
            vec![locality_at(
                0,
                vec![
                    lb_ep(a.addr, EdsHealth::Healthy, None),
                    lb_ep(b.addr, EdsHealth::Unhealthy, None),
                    lb_ep(c.addr, EdsHealth::Unhealthy, None),
                ],
            )],
        )],
    )
    .await;
    let dist = distribution(&mesh, "/", 60).await;
    for n in ["a", "b", "c"] {
        assert!(count(&dist, n) >= 10, "panic mode should use {n}: {dist:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eds_degraded_endpoint_only_takes_what_healthy_ones_cannot() {
    let (a, b, c, d) = (
        Backend::start("h1").await,
        Backend::start("h2").await,
        Backend::start("h3").await,
        Backend::start("degraded").await,
    );
    let (full, half) = (svc("three-healthy"), svc("one-healthy"));
    let mesh = eds_mesh(
        &[("/full", &full), ("/half", &half)],
        vec![eds_cluster(&full), eds_cluster(&half)],
        vec![
            cla_localities(
                &full,
                vec![locality_at(
                    0,
                    vec![
                        lb_ep(a.addr, EdsHealth::Healthy, None),
                        lb_ep(b.addr, EdsHealth::Healthy, None),
                        lb_ep(c.addr, EdsHealth::Healthy, None),
                        lb_ep(d.addr, EdsHealth::Degraded, None),
                    ],
                )],
            ),
            cla_localities(
                &half,
                vec![locality_at(
                    0,
                    vec![
                        lb_ep(a.addr, EdsHealth::Healthy, None),
                        lb_ep(d.addr, EdsHealth::Degraded, None),
                    ],
                )],
            ),
        ],
    )
    .await;
    // 3 of 4 healthy * 1.4 overprovisioning >= 100%: degraded gets nothing.
    let dist = distribution(&mesh, "/full", 60).await;
    assert_eq!(count(&dist, "degraded"), 0, "{dist:?}");
    // 1 of 2 healthy: healthy gets 50% * 1.4 = 70%, degraded the other 30%.
    let dist = distribution(&mesh, "/half", 200).await;
    let deg = count(&dist, "degraded");
    eprintln!("observed: 1 healthy + 1 degraded: {dist:?}");
    // p = 0.3 over 200: outside 25..=95 has probability 7e-8 (binomial, computed).
    assert!(
        (25..=95).contains(&deg),
        "degraded share {deg}/200: {dist:?}"
    );
    assert_eq!(count(&dist, "h1") + deg, 200, "{dist:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eds_unhealthy_priority_0_fails_over_to_priority_1() {
    let (a, b, c) = (
        Backend::start("p0-a").await,
        Backend::start("p0-b").await,
        Backend::start("p1").await,
    );
    let cl = svc("priorities");
    let mesh = eds_mesh(
        &[("/", &cl)],
        vec![eds_cluster(&cl)],
        vec![cla_localities(
            &cl,
            vec![
                locality_at(
                    0,
                    vec![
                        lb_ep(a.addr, EdsHealth::Unhealthy, None),
                        lb_ep(b.addr, EdsHealth::Unhealthy, None),
                    ],
                ),
                locality_at(1, vec![lb_ep(c.addr, EdsHealth::Healthy, None)]),
            ],
        )],
    )
    .await;
    let dist = distribution(&mesh, "/", 30).await;
    assert_eq!(count(&dist, "p1"), 30, "{dist:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eds_weights_3_to_1_with_round_robin() {
    let (a, b) = (Backend::start("w3").await, Backend::start("w1").await);
    let cl = svc("weighted");
    let mesh = eds_mesh(
        &[("/", &cl)],
        vec![eds_cluster(&cl)],
        vec![cla_localities(
            &cl,
            vec![locality_at(
                0,
                vec![
                    lb_ep(a.addr, EdsHealth::Healthy, Some(3)),
                    lb_ep(b.addr, EdsHealth::Healthy, Some(1)),
                ],
            )],
        )],
    )
    .await;
    let dist = distribution(&mesh, "/", 400).await;
    eprintln!("observed: 3:1 weights over 400: {dist:?}");
    let w3 = count(&dist, "w3");
    assert_eq!(w3 + count(&dist, "w1"), 400, "{dist:?}");
    assert!((280..=320).contains(&w3), "{dist:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_request_and_random_clusters_serve() {
    let (a, b) = (Backend::start("a").await, Backend::start("b").await);
    let (lr, rnd) = (svc("least-request"), svc("random"));
    let with_policy = |name: &str, p: cluster::LbPolicy| {
        let mut c = eds_cluster(name);
        c.lb_policy = p as i32;
        c
    };
    let mesh = eds_mesh(
        &[("/lr", &lr), ("/random", &rnd)],
        vec![
            with_policy(&lr, cluster::LbPolicy::LeastRequest),
            with_policy(&rnd, cluster::LbPolicy::Random),
        ],
        vec![cla(&lr, &[a.addr, b.addr]), cla(&rnd, &[a.addr, b.addr])],
    )
    .await;
    for p in ["/lr", "/random"] {
        let dist = distribution(&mesh, p, 100).await;
        assert_eq!(count(&dist, "a") + count(&dist, "b"), 100, "{p}: {dist:?}");
        assert!(
            count(&dist, "a") >= 15 && count(&dist, "b") >= 15,
            "{p}: {dist:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_load_assignment_answers_no_healthy_upstream() {
    let cl = svc("empty");
    let mesh = eds_mesh(&[("/", &cl)], vec![eds_cluster(&cl)], vec![cla(&cl, &[])]).await;
    for _ in 0..3 {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!(
            (r.status, r.body.as_str()),
            (503, "no healthy upstream"),
            "{r:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_endpoint_port_answers_503_connect_failure() {
    let cl = svc("closed");
    let closed: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mesh = eds_mesh(
        &[("/", &cl)],
        vec![eds_cluster(&cl)],
        vec![cla(&cl, &[closed])],
    )
    .await;
    let r = mesh.get("/", HOST, &[]).await;
    eprintln!("observed: closed port: {r:?}");
    assert_eq!(r.status, 503, "{r:?}");
    assert_eq!(
        r.body,
        "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure",
        "{r:?}"
    );
}

// ---------------------------------------------------------------------------
// Admin
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_is_503_before_the_first_config_and_200_after() {
    let ads = AdsServer::start_any("1", &Snapshot::default()).await;
    for t in [LDS, RDS, CDS, EDS] {
        ads.clear_type(t);
    }
    let mut gw = Gateway::spawn(ads.port);
    eventually("the gateway to subscribe to CDS", PROPAGATION, || async {
        if ads.log().iter().any(|r| r.type_url == CDS) {
            Ok(())
        } else {
            Err(format!("{} requests", ads.log_len()))
        }
    })
    .await;
    let r = eventually("admin to answer", PROPAGATION, || async {
        let r = gw.admin_get("/ready").await;
        if r.status != 0 {
            Ok(r)
        } else {
            Err(format!("{:?}", r.error))
        }
    })
    .await;
    eprintln!("observed: /ready before config: {r:?}");
    assert_eq!((r.status, r.body.as_str()), (503, "PRE_INITIALIZING\n"));

    let port = free_port();
    ads.set_snapshot(
        "1",
        &Snapshot {
            listeners: vec![l(port)],
            routes: vec![single_route(port, direct(200, "ok"))],
            ..Default::default()
        },
    );
    gw.wait_ready().await;
    let r = gw.admin_get("/ready").await;
    assert_eq!((r.status, r.body.as_str()), (200, "LIVE\n"));
    let r = wait_fresh_status(port, "/", 200).await;
    assert_eq!(r.body, "ok");
}

fn dump_of<'a>(dump: &'a Value, kind: &str) -> &'a Value {
    let ty = format!("type.googleapis.com/envoy.admin.v3.{kind}");
    dump["configs"]
        .as_array()
        .expect("configs[]")
        .iter()
        .find(|c| c["@type"] == ty.as_str())
        .unwrap_or_else(|| panic!("no {ty} in config dump"))
}

fn names_at(list: &Value, path: &[&str]) -> Vec<String> {
    list.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|item| {
                    path.iter()
                        .try_fold(item, |v, k| v.get(*k))
                        .and_then(Value::as_str)
                        .map(str::to_string)
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_dump_lists_dynamic_resources_with_versions() {
    let b1 = Backend::start("first").await;
    let b2 = Backend::start("second").await;
    let (c1, c2) = (svc("first"), svc("second"));
    let mesh = one_cluster_mesh(&c1, &b1).await;
    mesh.ads.wait_for_ack(RDS, "1", PROPAGATION).await;

    let fetch = || async {
        let r = mesh.gw.admin_get("/config_dump").await;
        assert_eq!(r.status, 200, "{r:?}");
        assert!(
            r.header("content-type")
                .is_some_and(|c| c.starts_with("application/json")),
            "{r:?}"
        );
        serde_json::from_str::<Value>(&r.body).expect("config dump is JSON")
    };
    let dump = fetch().await;
    let clusters = dump_of(&dump, "ClustersConfigDump");
    assert_eq!(clusters["version_info"], "1");
    assert_eq!(
        names_at(&clusters["dynamic_active_clusters"], &["cluster", "name"]),
        vec![c1.clone()]
    );
    assert_eq!(
        names_at(&clusters["dynamic_active_clusters"], &["version_info"]),
        vec!["1"]
    );
    assert_eq!(
        clusters["dynamic_active_clusters"][0]["cluster"]["@type"],
        CDS
    );
    let listeners = dump_of(&dump, "ListenersConfigDump");
    assert_eq!(listeners["version_info"], "1");
    let ln = listener_name(mesh.port);
    assert_eq!(
        names_at(&listeners["dynamic_listeners"], &["name"]),
        vec![ln.clone()]
    );
    assert_eq!(
        names_at(
            &listeners["dynamic_listeners"],
            &["active_state", "listener", "name"]
        ),
        vec![ln.clone()]
    );
    assert_eq!(
        names_at(
            &listeners["dynamic_listeners"],
            &["active_state", "version_info"]
        ),
        vec!["1"]
    );
    let routes = dump_of(&dump, "RoutesConfigDump");
    assert_eq!(
        names_at(&routes["dynamic_route_configs"], &["route_config", "name"]),
        vec![route_name(mesh.port)]
    );
    assert_eq!(
        names_at(&routes["dynamic_route_configs"], &["version_info"]),
        vec!["1"]
    );

    // A new CDS version shows up with its version.
    mesh.ads
        .set_endpoints("2", &[cla(&c1, &[b1.addr]), cla(&c2, &[b2.addr])]);
    mesh.ads
        .set_clusters("2", &[eds_cluster(&c1), eds_cluster(&c2)]);
    mesh.ads.wait_for_ack(CDS, "2", PROPAGATION).await;
    eventually("config dump to show CDS version 2", PROPAGATION, || async {
        let dump = fetch().await;
        let clusters = dump_of(&dump, "ClustersConfigDump");
        let mut names = names_at(&clusters["dynamic_active_clusters"], &["cluster", "name"]);
        names.sort();
        let mut want = vec![c1.clone(), c2.clone()];
        want.sort();
        if clusters["version_info"] == "2" && names == want {
            Ok(())
        } else {
            Err(format!("{clusters}"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusters_admin_lists_hosts_with_health_flags() {
    let (a, b, c) = (
        Backend::start("a").await,
        Backend::start("b").await,
        Backend::start("c").await,
    );
    let cl = svc("flags");
    let mesh = eds_mesh(
        &[("/", &cl)],
        vec![eds_cluster(&cl)],
        vec![cla_localities(
            &cl,
            vec![
                locality_at(
                    0,
                    vec![
                        lb_ep(a.addr, EdsHealth::Healthy, Some(3)),
                        lb_ep(b.addr, EdsHealth::Unhealthy, None),
                    ],
                ),
                locality_at(1, vec![lb_ep(c.addr, EdsHealth::Degraded, None)]),
            ],
        )],
    )
    .await;
    let r = mesh.gw.admin_get("/clusters").await;
    assert_eq!(r.status, 200, "{r:?}");
    let lines: Vec<&str> = r.body.lines().collect();
    for want in [
        format!("{cl}::{}::health_flags::healthy", a.addr),
        format!("{cl}::{}::health_flags::/failed_eds_health", b.addr),
        format!("{cl}::{}::health_flags::/degraded_eds_health", c.addr),
        format!("{cl}::{}::weight::3", a.addr),
        format!("{cl}::{}::weight::1", b.addr),
        format!("{cl}::{}::priority::0", a.addr),
        format!("{cl}::{}::priority::1", c.addr),
    ] {
        assert!(
            lines.contains(&want.as_str()),
            "missing {want:?} in:\n{}",
            r.body
        );
    }
}

fn prom_total(text: &str, metric: &str) -> f64 {
    prom_samples(text, metric).iter().map(|(_, v)| v).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_counts_accepted_and_rejected_xds_updates() {
    let b = Backend::start("first").await;
    let c = svc("first");
    let mesh = one_cluster_mesh(&c, &b).await;
    mesh.ads.wait_for_ack(LDS, "1", PROPAGATION).await;

    const CDS_OK: &str = "envoy_cluster_manager_cds_update_success";
    const CDS_REJ: &str = "envoy_cluster_manager_cds_update_rejected";
    const LDS_OK: &str = "envoy_listener_manager_lds_update_success";
    const LDS_REJ: &str = "envoy_listener_manager_lds_update_rejected";
    let text = mesh.gw.prometheus().await;
    for m in [CDS_OK, CDS_REJ, LDS_OK, LDS_REJ] {
        assert!(
            !prom_samples(&text, m).is_empty(),
            "{m} missing from /stats/prometheus"
        );
    }
    let (cds_ok, lds_ok) = (prom_total(&text, CDS_OK), prom_total(&text, LDS_OK));
    assert!(cds_ok >= 1.0 && lds_ok >= 1.0, "{cds_ok} {lds_ok}");
    assert_eq!(
        (prom_total(&text, CDS_REJ), prom_total(&text, LDS_REJ)),
        (0.0, 0.0)
    );

    let mut bad = eds_cluster(&c);
    bad.lb_policy = 99;
    let before = mesh.ads.log_len();
    mesh.ads.set_clusters("2", &[bad]);
    mesh.ads.wait_for_nack_since(CDS, before, PROPAGATION).await;
    let before = mesh.ads.log_len();
    mesh.ads.set_listeners(
        "2",
        &[listener_with_filters(
            mesh.port,
            vec![router_filter(), router_filter()],
        )],
    );
    mesh.ads.wait_for_nack_since(LDS, before, PROPAGATION).await;
    eventually("rejections to be counted", PROPAGATION, || async {
        let text = mesh.gw.prometheus().await;
        let got = (
            prom_total(&text, CDS_REJ),
            prom_total(&text, LDS_REJ),
            prom_total(&text, CDS_OK),
            prom_total(&text, LDS_OK),
        );
        if got == (1.0, 1.0, cds_ok, lds_ok) {
            Ok(())
        } else {
            Err(format!(
                "(cds rejected, lds rejected, cds ok, lds ok) = {got:?}"
            ))
        }
    })
    .await;

    mesh.ads.set_clusters("3", &[eds_cluster(&c)]);
    mesh.ads.wait_for_ack(CDS, "3", PROPAGATION).await;
    eventually("the accepted update to be counted", PROPAGATION, || async {
        let text = mesh.gw.prometheus().await;
        let ok = prom_total(&text, CDS_OK);
        if ok == cds_ok + 1.0 {
            Ok(())
        } else {
            Err(format!("cds success {ok}, was {cds_ok}"))
        }
    })
    .await;
}

// ---------------------------------------------------------------------------
// Swaps under traffic
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_request_completes_across_route_and_listener_swaps() {
    let slow = Backend::start_delayed("slow", Duration::from_secs(1)).await;
    let fast = Backend::start("fast").await;
    let (cs, cf) = (svc("slow"), svc("fast"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![single_route(port, to_cluster(&cs))],
            ..Default::default()
        }
        .with_backends(&[(&cs, &slow), (&cf, &fast)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "slow").await;

    // Route swap while a request is in flight on the slow backend.
    let client = mesh.client.clone();
    let u = mesh.url("/");
    let arrived = slow.served();
    let inflight = tokio::spawn(async move { client.get(&u, Some(HOST), &[]).await });
    eventually(
        "the slow request to reach the backend",
        PROPAGATION,
        || async {
            if slow.served() > arrived {
                Ok(())
            } else {
                Err("not yet".to_string())
            }
        },
    )
    .await;
    mesh.ads
        .set_routes("2", &[single_route(mesh.port, to_cluster(&cf))]);
    mesh.ads.wait_for_ack(RDS, "2", PROPAGATION).await;
    let r = inflight.await.expect("in-flight task");
    assert_eq!((r.status, r.backend()), (200, Some("slow")), "{r:?}");
    // The keep-alive client sees the new route.
    mesh.wait_backend("/", HOST, &[], "fast").await;

    // Listener update (new stat prefix) while a request is in flight.
    mesh.ads
        .set_routes("3", &[single_route(mesh.port, to_cluster(&cs))]);
    mesh.wait_backend("/", HOST, &[], "slow").await;
    let client = mesh.client.clone();
    let u = mesh.url("/");
    let arrived = slow.served();
    let inflight = tokio::spawn(async move { client.get(&u, Some(HOST), &[]).await });
    eventually(
        "the slow request to reach the backend",
        PROPAGATION,
        || async {
            if slow.served() > arrived {
                Ok(())
            } else {
                Err("not yet".to_string())
            }
        },
    )
    .await;
    let mut h = hcm(mesh.port);
    h.stat_prefix = "renamed".to_string();
    mesh.ads.set_listeners("3", &[listener_with(mesh.port, h)]);
    mesh.ads.wait_for_ack(LDS, "3", PROPAGATION).await;
    let r = inflight.await.expect("in-flight task");
    assert_eq!((r.status, r.backend()), (200, Some("slow")), "{r:?}");
}
