//! Incremental (Delta) ADS and Envoy's per-resource acceptance, as a stock istiod (1.22+)
//! drives a gateway: `api_type: DELTA_GRPC`, subscriptions that follow the clusters and
//! listeners, removals, a reconnect that reports what the gateway holds, and one bad resource
//! in a push refused alone while the rest applies (state of the world and delta alike).
//! Every test here also runs against Envoy 1.40 with the same expectations.

mod common;

use std::collections::BTreeSet;

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{address, Address};
use envoy_types::pb::envoy::config::endpoint::v3::{
    lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;

const DELTA: &str = "DELTA_GRPC";
const SOTW: &str = "GRPC";
const HOST: &str = "shop.example.com";

fn routes(port: u16, paths: &[(&str, &str)]) -> RouteConfiguration {
    route_config(
        &route_name(port),
        vec![vhost(
            "shop",
            &[HOST],
            paths
                .iter()
                .map(|(p, c)| rt(prefix(p), to_cluster(c)))
                .collect(),
        )],
    )
}

/// The EDS names the gateway subscribed to and then unsubscribed from, over the whole log.
fn eds_subscriptions(ads: &AdsServer) -> (BTreeSet<String>, BTreeSet<String>) {
    let mut sub = BTreeSet::new();
    let mut unsub = BTreeSet::new();
    for r in ads.log().iter().filter(|r| r.type_url == EDS && r.delta) {
        sub.extend(r.resource_names.iter().cloned());
        unsub.extend(r.unsubscribe.iter().cloned());
    }
    (sub, unsub)
}

/// A LOGICAL_DNS cluster with two endpoints: it decodes and passes the proto's own rules, but
/// Envoy refuses it when it builds the cluster (a per-resource refusal, not a whole one).
fn unbuildable_cluster(name: &str) -> Cluster {
    let mut c = eds_cluster(name);
    c.eds_cluster_config = None;
    c.cluster_discovery_type = Some(
        envoy_types::pb::envoy::config::cluster::v3::cluster::ClusterDiscoveryType::Type(
            envoy_types::pb::envoy::config::cluster::v3::cluster::DiscoveryType::LogicalDns as i32,
        ),
    );
    let ep = |port: u32| LbEndpoint {
        host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
            address: Some(socket_addr("127.0.0.1", port as u16)),
            ..Default::default()
        })),
        ..Default::default()
    };
    c.load_assignment = Some(ClusterLoadAssignment {
        cluster_name: name.to_string(),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints: vec![ep(1), ep(2)],
            ..Default::default()
        }],
        ..Default::default()
    });
    c
}

/// A listener both gateways refuse when they build it: its address is not an IP.
fn unbuildable_listener(port: u16) -> Listener {
    let mut l = l(port);
    l.address = Some(Address {
        address: Some(address::Address::SocketAddress(
            envoy_types::pb::envoy::config::core::v3::SocketAddress {
                address: "not-an-ip".into(),
                port_specifier: Some(
                    envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier::PortValue(
                        u32::from(port),
                    ),
                ),
                ..Default::default()
            },
        )),
    });
    l
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_subscribes_and_unsubscribes_endpoints_as_clusters_come_and_go() {
    let a = Backend::start("a").await;
    let b = Backend::start("b").await;
    let c = Backend::start("c").await;
    let mesh = Mesh::start_api(DELTA, |port| {
        Snapshot {
            listeners: vec![l(port)],
            routes: vec![routes(port, &[("/a", "a"), ("/b", "b"), ("/c", "c")])],
            ..Default::default()
        }
        .with_backends(&[("a", &a), ("b", &b)])
    })
    .await;
    mesh.wait_backend("/a", HOST, &[], "a").await;
    mesh.wait_backend("/b", HOST, &[], "b").await;
    let (sub, unsub) = eds_subscriptions(&mesh.ads);
    assert_eq!(sub, BTreeSet::from(["a".to_string(), "b".to_string()]));
    assert!(unsub.is_empty(), "{unsub:?}");
    // Every request on the stream was a delta one.
    assert!(mesh.ads.log().iter().all(|r| r.delta));

    // Cluster b goes, c comes: b is unsubscribed, c subscribed, and c serves.
    let snap = Snapshot::default().with_backends(&[("a", &a), ("c", &c)]);
    mesh.ads.set_endpoints("2", &snap.endpoints);
    mesh.ads.set_clusters("2", &snap.clusters);
    mesh.wait_backend("/c", HOST, &[], "c").await;
    eventually("b unsubscribed", PROPAGATION, || async {
        let (sub, unsub) = eds_subscriptions(&mesh.ads);
        if unsub.contains("b") && sub.contains("c") {
            Ok(())
        } else {
            Err(format!("subscribed {sub:?}, unsubscribed {unsub:?}"))
        }
    })
    .await;
    // The route to the removed cluster has nowhere to go.
    let r = mesh.wait_status("/b", HOST, 503).await;
    assert_eq!(r.status, 503);
    assert_eq!(mesh.get("/a", HOST, &[]).await.backend(), Some("a"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_removes_listeners_and_clusters_by_name() {
    let a = Backend::start("a").await;
    let second = free_port();
    let mesh = Mesh::start_api(DELTA, |port| {
        Snapshot {
            listeners: vec![l(port), l(second)],
            routes: vec![routes(port, &[("/", "a")]), routes(second, &[("/", "a")])],
            ..Default::default()
        }
        .with_backends(&[("a", &a)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "a").await;
    let url2 = format!("http://127.0.0.1:{second}/");
    eventually("second listener", PROPAGATION, || async {
        let r = get(&url2, Some(HOST), &[]).await;
        (r.backend() == Some("a"))
            .then_some(())
            .ok_or(format!("{r:?}"))
    })
    .await;
    let port = mesh.port;
    mesh.ads.set_listeners("2", &[l(port)]);
    eventually("second listener closed", PROPAGATION, || async {
        match tcp_connect(second).await {
            Err(std::io::ErrorKind::ConnectionRefused) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // The removal was sent as a removal, not as a new full set.
    let lds_removed = mesh.ads.log().iter().any(|r| r.type_url == LDS && r.delta);
    assert!(lds_removed);
    assert_eq!(mesh.get("/", HOST, &[]).await.backend(), Some("a"));
    mesh.ads.set_clusters("3", &[]);
    mesh.wait_status("/", HOST, 503).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delta_reconnect_reports_what_the_gateway_holds_and_gets_only_changes() {
    let a = Backend::start("a").await;
    let a2 = Backend::start("a2").await;
    let port = free_port();
    let build = |backend: &Backend| {
        Snapshot {
            listeners: vec![l(port)],
            routes: vec![routes(port, &[("/", "a")])],
            ..Default::default()
        }
        .with_backends(&[("a", backend)])
    };
    let mut ads = AdsServer::start_any("1", &build(&a)).await;
    let ads_port = ads.port;
    let gw = Gateway::start_bootstrap(|admin| bootstrap_yaml_api(admin, ads_port, DELTA)).await;
    let url = format!("http://127.0.0.1:{port}/");
    eventually("served by a", PROPAGATION, || async {
        let r = get(&url, Some(HOST), &[]).await;
        (r.backend() == Some("a"))
            .then_some(())
            .ok_or(format!("{r:?}"))
    })
    .await;
    ads.stop().await;
    // The control plane comes back with one endpoint changed.
    let ads = AdsServer::start(ads_port, "2", &build(&a2)).await;
    eventually("served by a2 after the reconnect", PROPAGATION, || async {
        let r = get(&url, Some(HOST), &[]).await;
        (r.backend() == Some("a2"))
            .then_some(())
            .ok_or(format!("{r:?}"))
    })
    .await;
    let log = ads.log();
    let first = |type_url: &str| {
        log.iter()
            .find(|r| r.type_url == type_url)
            .unwrap_or_else(|| panic!("no {type_url} request on the new stream: {log:?}"))
            .clone()
    };
    // The first request of each type names every resource the gateway holds, with the
    // version it has.
    let cds = first(CDS);
    assert_eq!(
        cds.initial_versions.keys().collect::<Vec<_>>(),
        ["a"],
        "{cds:?}"
    );
    let lds = first(LDS);
    assert_eq!(
        lds.initial_versions.keys().cloned().collect::<Vec<_>>(),
        [listener_name(port)],
        "{lds:?}"
    );
    let rds = first(RDS);
    assert_eq!(rds.resource_names, [route_name(port)], "{rds:?}");
    assert_eq!(
        rds.initial_versions.keys().cloned().collect::<Vec<_>>(),
        [route_name(port)]
    );
    let eds = first(EDS);
    assert_eq!(eds.resource_names, ["a"], "{eds:?}");
    assert!(eds.initial_versions.contains_key("a"), "{eds:?}");
    drop(gw);
}

/// One bad cluster and one bad listener in a push: each is refused alone, named in the NACK,
/// and everything else in the same push is applied.
async fn one_bad_resource_is_refused_alone(api_type: &str) {
    let a = Backend::start("a").await;
    let c = Backend::start("c").await;
    let third = free_port();
    let bad_port = free_port();
    let mesh = Mesh::start_api(api_type, |port| {
        Snapshot {
            listeners: vec![l(port)],
            routes: vec![routes(port, &[("/a", "a"), ("/c", "c")])],
            ..Default::default()
        }
        .with_backends(&[("a", &a)])
    })
    .await;
    mesh.wait_backend("/a", HOST, &[], "a").await;

    // CDS: a kept, c new, 'broken' refused.
    let since = mesh.ads.log_len();
    let eps = mesh_endpoints(&[("a", &a), ("c", &c)]);
    mesh.ads.set_endpoints("2", &eps);
    mesh.ads.set_clusters(
        "2",
        &[
            eds_cluster("a"),
            unbuildable_cluster("broken"),
            eds_cluster("c"),
        ],
    );
    let nack = mesh.ads.wait_for_nack_since(CDS, since, PROPAGATION).await;
    let error = nack.error.unwrap_or_default();
    assert!(
        error.contains("broken"),
        "the NACK names the cluster: {error}"
    );
    assert!(!error.contains("'a'") && !error.contains("'c'"), "{error}");
    mesh.wait_backend("/c", HOST, &[], "c").await;
    assert_eq!(mesh.get("/a", HOST, &[]).await.backend(), Some("a"));

    // LDS: the serving listener kept, a new one applied, a bad new one refused.
    let since = mesh.ads.log_len();
    let port = mesh.port;
    mesh.ads.set_routes(
        "3",
        &[
            routes(port, &[("/a", "a"), ("/c", "c")]),
            routes(third, &[("/", "c")]),
        ],
    );
    mesh.ads
        .set_listeners("3", &[l(port), unbuildable_listener(bad_port), l(third)]);
    let nack = mesh.ads.wait_for_nack_since(LDS, since, PROPAGATION).await;
    let error = nack.error.unwrap_or_default();
    assert!(
        error.contains(&listener_name(bad_port)),
        "the NACK names the listener: {error}"
    );
    let url3 = format!("http://127.0.0.1:{third}/");
    eventually("the new listener serves", PROPAGATION, || async {
        let r = get(&url3, Some(HOST), &[]).await;
        (r.backend() == Some("c"))
            .then_some(())
            .ok_or(format!("{r:?}"))
    })
    .await;

    // A bad update of the serving listener keeps its last good version serving.
    let since = mesh.ads.log_len();
    let mut bad_update = unbuildable_listener(port);
    bad_update.name = listener_name(port);
    mesh.ads.set_listeners("4", &[bad_update, l(third)]);
    mesh.ads.wait_for_nack_since(LDS, since, PROPAGATION).await;
    for _ in 0..5 {
        assert_eq!(mesh.get("/a", HOST, &[]).await.backend(), Some("a"));
    }
    // The config dump shows the refused listener with its error.
    let dump = mesh.gw.admin_get("/config_dump").await;
    let dump: serde_json::Value = serde_json::from_str(&dump.body).expect("config_dump is JSON");
    let listeners = dump["configs"]
        .as_array()
        .and_then(|c| {
            c.iter()
                .find(|c| c["@type"] == "type.googleapis.com/envoy.admin.v3.ListenersConfigDump")
        })
        .expect("listeners in the dump");
    let refused = listeners["dynamic_listeners"]
        .as_array()
        .and_then(|l| l.iter().find(|l| l["name"] == listener_name(port).as_str()))
        .expect("the refused listener is listed");
    eprintln!(
        "{}",
        serde_json::to_string_pretty(refused).unwrap_or_default()
    );
    assert!(
        refused["active_state"].is_object(),
        "the last good version is active: {refused}"
    );
    let details = refused["error_state"]["details"]
        .as_str()
        .unwrap_or_default();
    assert!(
        !details.is_empty(),
        "error_state names the failure: {refused}"
    );
    assert!(
        refused["error_state"]["failed_configuration"].is_object(),
        "{refused}"
    );
}

fn mesh_endpoints(pairs: &[(&str, &Backend)]) -> Vec<ClusterLoadAssignment> {
    pairs.iter().map(|(n, b)| cla(n, &[b.addr])).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_resource_is_refused_alone_over_delta() {
    one_bad_resource_is_refused_alone(DELTA).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_resource_is_refused_alone_over_sotw() {
    one_bad_resource_is_refused_alone(SOTW).await;
}

/// The bootstrap istio-agent wrote for the Istio 1.18 proxy of the dump in shared/xds-data, as
/// 1.22+ writes it (`api_type: DELTA_GRPC`), with its xDS socket, admin and static listeners
/// moved to this test's places: the gateway comes up ready on it and routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_agent_bootstrap_over_delta_on_the_xds_unix_socket() {
    let a = Backend::start("a").await;
    let port = free_port();
    let dir = TempDir::new("istio-agent");
    let socket = dir.path.join("XDS");
    let snapshot = Snapshot {
        listeners: vec![l(port)],
        routes: vec![routes(port, &[("/", "a")])],
        ..Default::default()
    }
    .with_backends(&[("a", &a)]);
    let ads = AdsServer::start_unix(&socket, "1", &snapshot).await;

    let dump_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|p| {
            p.join(
                "shared/xds-data/istio-sidecar/deathstarbench_istio1.18.2_sidecar_config_dump.json",
            )
        })
        .find(|p| p.exists())
        .expect("shared/xds-data beside the repo");
    let dump: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dump_path).expect("dump")).expect("json");
    let mut boot = dump["configs"]
        .as_array()
        .and_then(|c| {
            c.iter()
                .find(|c| c["@type"] == "type.googleapis.com/envoy.admin.v3.BootstrapConfigDump")
        })
        .map(|c| c["bootstrap"].clone())
        .expect("the dump holds the bootstrap");
    boot["dynamic_resources"]["ads_config"]["api_type"] = "DELTA_GRPC".into();
    // istio-agent's own listeners (prometheus 15090, readiness 15021) on free loopback ports.
    for l in boot["static_resources"]["listeners"]
        .as_array_mut()
        .expect("static listeners")
    {
        l["address"]["socket_address"] =
            serde_json::json!({"address": "127.0.0.1", "port_value": free_port()});
    }
    for c in boot["static_resources"]["clusters"]
        .as_array_mut()
        .expect("static clusters")
    {
        if c["name"] == "xds-grpc" {
            let ep =
                &mut c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"];
            assert!(
                ep["pipe"].is_object(),
                "istio-agent serves xDS on a unix socket: {ep}"
            );
            ep["pipe"]["path"] = socket.display().to_string().into();
        }
    }
    let _gw = Gateway::start_bootstrap(|admin_port| {
        boot["admin"]["address"]["socket_address"] =
            serde_json::json!({"address": "127.0.0.1", "port_value": admin_port});
        // JSON is YAML: both gateways read it as the .yaml file the harness writes.
        serde_json::to_string_pretty(&boot).expect("bootstrap json")
    })
    .await;
    let url = format!("http://127.0.0.1:{port}/");
    eventually(
        "routed over delta from istio-agent's socket",
        PROPAGATION,
        || async {
            let r = get(&url, Some(HOST), &[]).await;
            (r.backend() == Some("a"))
                .then_some(())
                .ok_or(format!("{r:?}"))
        },
    )
    .await;
    assert!(
        ads.log().iter().all(|r| r.delta),
        "every request was a delta one"
    );
    // set_node_on_first_message_only: the node only on the stream's first request.
    let with_node = ads.log().iter().filter(|r| r.node_id.is_some()).count();
    assert_eq!(with_node, 1, "{:?}", ads.log());
}
