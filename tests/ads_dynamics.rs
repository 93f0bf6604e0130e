//! Configuration changes over ADS: updates under load, EDS moves, NACKs, the
//! node identity and surviving a management-server restart.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;

const HOST: &str = "bookinfo.example.com";

fn reviews(subset: &str) -> String {
    subset_cluster(subset, "reviews")
}

fn single_route(
    port: u16,
    action: envoy_types::pb::envoy::config::route::v3::route::Action,
) -> RouteConfiguration {
    route_config(
        &route_name(port),
        vec![vhost("bookinfo", &[HOST], vec![rt(prefix("/"), action)])],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_shift_under_load_loses_no_request() {
    let v1 = Backend::start("reviews-v1").await;
    let v2 = Backend::start("reviews-v2").await;
    let (c1, c2) = (reviews("v1"), reviews("v2"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![single_route(port, weighted(&[(&c1, 100), (&c2, 0)]))],
            ..Default::default()
        }
        .with_backends(&[(&c1, &v1), (&c2, &v2)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "reviews-v1").await;

    // A sequential keep-alive client, so the shift happens on a live connection.
    let stop = Arc::new(AtomicBool::new(false));
    let url = mesh.url("/");
    let load = tokio::spawn({
        let stop = stop.clone();
        async move {
            let client = HttpClient::new();
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut seen = Vec::new();
            while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
                let r = client.get(&url, Some(HOST), &[]).await;
                seen.push((r.status, r.backend().map(str::to_string), r.error));
            }
            seen
        }
    });

    // Let the load run on the old split first.
    eventually("load on the old split", PROPAGATION, || async {
        let n = v1.served();
        if n >= 50 {
            Ok(())
        } else {
            Err(format!("{n} requests on v1"))
        }
    })
    .await;
    mesh.ads.set_routes(
        "2",
        &[single_route(mesh.port, weighted(&[(&c1, 0), (&c2, 100)]))],
    );
    mesh.ads.wait_for_ack(RDS, "2", PROPAGATION).await;
    let after_ack = v2.served();
    eventually("load to run on the new split", PROPAGATION, || async {
        let n = v2.served() - after_ack;
        if n >= 100 {
            Ok(())
        } else {
            Err(format!("{n} requests on v2 since the ACK"))
        }
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let seen = load.await.expect("load task");

    let failed: Vec<_> = seen.iter().filter(|(s, _, _)| *s != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {:?}",
        failed.len(),
        seen.len(),
        &failed[..failed.len().min(5)]
    );
    let tail: Vec<_> = seen.iter().rev().take(50).collect();
    assert!(
        tail.iter()
            .all(|(_, b, _)| b.as_deref() == Some("reviews-v2")),
        "traffic did not end on v2: {tail:?}"
    );
    // The split flipped once: v1 then v2, never back.
    let first_v2 = seen
        .iter()
        .position(|(_, b, _)| b.as_deref() == Some("reviews-v2"))
        .expect("some v2 traffic");
    assert!(first_v2 > 0, "v2 got traffic before the push");
    assert!(
        seen[first_v2..]
            .iter()
            .all(|(_, b, _)| b.as_deref() == Some("reviews-v2")),
        "traffic went back to v1 after the shift"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eds_update_moves_traffic_to_new_endpoints() {
    let pod1 = Backend::start("reviews-v1-pod1").await;
    let pod2 = Backend::start("reviews-v1-pod2").await;
    let pod3 = Backend::start("reviews-v1-pod3").await;
    let c1 = reviews("v1");
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![single_route(port, to_cluster(&c1))],
            ..Default::default()
        }
        .with_backends(&[(&c1, &pod1)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "reviews-v1-pod1").await;

    // The pod is rescheduled: the subset's only endpoint changes.
    mesh.ads.set_endpoints("2", &[cla(&c1, &[pod2.addr])]);
    mesh.ads.wait_for_ack(EDS, "2", PROPAGATION).await;
    mesh.wait_backend("/", HOST, &[], "reviews-v1-pod2").await;
    let old = pod1.served();
    for _ in 0..20 {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!(
            (r.status, r.backend()),
            (200, Some("reviews-v1-pod2")),
            "{r:?}"
        );
    }
    assert_eq!(
        pod1.served(),
        old,
        "removed endpoint still receives traffic"
    );

    // Scale out: round robin over both endpoints.
    mesh.ads
        .set_endpoints("3", &[cla(&c1, &[pod2.addr, pod3.addr])]);
    mesh.ads.wait_for_ack(EDS, "3", PROPAGATION).await;
    mesh.wait_backend("/", HOST, &[], "reviews-v1-pod3").await;
    let (b2, b3) = (pod2.served(), pod3.served());
    for _ in 0..20 {
        assert_eq!(mesh.get("/", HOST, &[]).await.status, 200);
    }
    let (d2, d3) = (pod2.served() - b2, pod3.served() - b3);
    assert_eq!(d2 + d3, 20);
    assert!(d2 >= 5 && d3 >= 5, "round robin spread pod2={d2} pod3={d3}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_regex_is_nacked_and_previous_routes_keep_serving() {
    let v1 = Backend::start("reviews-v1").await;
    let v2 = Backend::start("reviews-v2").await;
    let (c1, c2) = (reviews("v1"), reviews("v2"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![single_route(port, to_cluster(&c1))],
            ..Default::default()
        }
        .with_backends(&[(&c1, &v1), (&c2, &v2)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "reviews-v1").await;
    mesh.ads.wait_for_ack(RDS, "1", PROPAGATION).await;

    let bad = route_config(
        &route_name(mesh.port),
        vec![vhost(
            "bookinfo",
            &[HOST],
            vec![
                rt(regex("("), to_cluster(&c2)),
                rt(prefix("/"), to_cluster(&c2)),
            ],
        )],
    );
    mesh.ads.set_routes("2", &[bad]);
    let nack = mesh.ads.wait_for_nack(RDS, PROPAGATION).await;
    assert_eq!(
        nack.version_info, "1",
        "a NACK carries the last accepted version"
    );
    assert!(
        !nack.response_nonce.is_empty(),
        "a NACK names the rejected response"
    );
    let msg = nack.error.unwrap_or_default();
    assert!(!msg.trim().is_empty(), "NACK without an error message");
    assert!(
        !mesh
            .ads
            .log()
            .iter()
            .any(|r| r.type_url == RDS && r.version_info == "2"),
        "version 2 must never be acknowledged"
    );

    // The whole update was rejected, including its valid routes.
    for _ in 0..10 {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!((r.status, r.backend()), (200, Some("reviews-v1")), "{r:?}");
    }

    // A later valid version is accepted again.
    mesh.ads
        .set_routes("3", &[single_route(mesh.port, to_cluster(&c2))]);
    mesh.ads.wait_for_ack(RDS, "3", PROPAGATION).await;
    mesh.wait_backend("/", HOST, &[], "reviews-v2").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_identity_is_sent_on_first_request() {
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![single_route(port, direct(200, "ok"))],
        ..Default::default()
    })
    .await;
    mesh.wait_status("/", HOST, 200).await;

    let log = mesh.ads.log();
    let first = log.first().expect("at least one DiscoveryRequest");
    assert_eq!(first.node_id.as_deref(), Some(NODE_ID));
    assert_eq!(first.node_cluster.as_deref(), Some(NODE_CLUSTER));
    assert_eq!(mesh.ads.first_node_id().as_deref(), Some(NODE_ID));
    // State of the world: the first request of each type has no version/nonce.
    for t in [LDS, CDS] {
        let r = log.iter().find(|r| r.type_url == t).expect("subscribed");
        assert_eq!(
            (r.version_info.as_str(), r.response_nonce.as_str()),
            ("", ""),
            "{t}"
        );
        assert!(
            r.resource_names.is_empty(),
            "{t} is a wildcard subscription"
        );
    }
    let rds = log
        .iter()
        .find(|r| r.type_url == RDS)
        .expect("RDS subscribed");
    assert_eq!(rds.resource_names, vec![route_name(mesh.port)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_ads_restart_and_resyncs() {
    let v1 = Backend::start("reviews-v1").await;
    let v2 = Backend::start("reviews-v2").await;
    let (c1, c2) = (reviews("v1"), reviews("v2"));
    let mut mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![single_route(port, to_cluster(&c1))],
            ..Default::default()
        }
        .with_backends(&[(&c1, &v1)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "reviews-v1").await;
    mesh.ads.wait_for_ack(RDS, "1", PROPAGATION).await;

    let ads_port = mesh.ads.port;
    mesh.ads.stop().await;
    // The data plane keeps its last config while the control plane is gone.
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(1) {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!((r.status, r.backend()), (200, Some("reviews-v1")), "{r:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Back on the same port with a new route and a new cluster.
    let port = mesh.port;
    let snapshot = Snapshot {
        listeners: vec![l(port)],
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "bookinfo",
                &[HOST],
                vec![
                    rt(prefix("/new"), to_cluster(&c2)),
                    rt(prefix("/"), to_cluster(&c1)),
                ],
            )],
        )],
        ..Default::default()
    }
    .with_backends(&[(&c1, &v1), (&c2, &v2)]);
    mesh.ads = AdsServer::start(ads_port, "2", &snapshot).await;
    mesh.wait_backend_within(Duration::from_secs(15), "/new", HOST, &[], "reviews-v2")
        .await;
    assert_eq!(mesh.get("/", HOST, &[]).await.backend(), Some("reviews-v1"));
    // The reconnected stream identifies the node again.
    assert_eq!(mesh.ads.first_node_id().as_deref(), Some(NODE_ID));
}
