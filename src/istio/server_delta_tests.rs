//! The delta ADS server against a tonic client on loopback, serving fixed xDS.

use std::collections::HashMap;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::google::rpc::Status as RpcStatus;

use super::tests::{bookinfo, node, start, Fake};
use super::*;

const LDS: &str = types::LISTENER;
const RDS: &str = types::ROUTE;
const CDS: &str = types::CLUSTER;
const EDS: &str = types::ENDPOINT;

struct DeltaClient {
    tx: mpsc::Sender<DeltaDiscoveryRequest>,
    rx: tonic::Streaming<DeltaDiscoveryResponse>,
    node: Option<Node>,
}

impl DeltaClient {
    async fn connect(addr: SocketAddr, node: Node) -> DeltaClient {
        let mut client = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
            .await
            .expect("connect");
        let (tx, rx) = mpsc::channel(16);
        let rx = client
            .delta_aggregated_resources(ReceiverStream::new(rx))
            .await
            .expect("open delta stream")
            .into_inner();
        DeltaClient {
            tx,
            rx,
            node: Some(node),
        }
    }

    async fn send(&mut self, mut req: DeltaDiscoveryRequest) {
        req.node = self.node.take();
        self.tx.send(req).await.expect("send request");
    }

    async fn subscribe(&mut self, type_url: &str, names: &[&str]) {
        self.send(DeltaDiscoveryRequest {
            type_url: type_url.into(),
            resource_names_subscribe: names.iter().map(|n| n.to_string()).collect(),
            ..Default::default()
        })
        .await;
    }

    async fn ack(&mut self, r: &DeltaDiscoveryResponse) {
        self.send(DeltaDiscoveryRequest {
            type_url: r.type_url.clone(),
            response_nonce: r.nonce.clone(),
            ..Default::default()
        })
        .await;
    }

    async fn recv(&mut self) -> DeltaDiscoveryResponse {
        match tokio::time::timeout(Duration::from_secs(5), self.rx.message()).await {
            Ok(Ok(Some(r))) => r,
            other => panic!("no response: {other:?}"),
        }
    }

    async fn silent(&mut self) {
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(300), self.rx.message()).await {
            panic!("expected no response, got {r:?}");
        }
    }
}

fn names(r: &DeltaDiscoveryResponse) -> Vec<&str> {
    r.resources.iter().map(|r| r.name.as_str()).collect()
}

fn versions(r: &DeltaDiscoveryResponse) -> HashMap<String, String> {
    r.resources
        .iter()
        .map(|r| (r.name.clone(), r.version.clone()))
        .collect()
}

#[tokio::test]
async fn wildcard_cds_lds_and_named_eds_with_per_resource_versions() {
    let (_cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = DeltaClient::connect(addr, node("gw-1", &[])).await;
    c.subscribe(CDS, &[]).await;
    let cds = c.recv().await;
    assert_eq!(
        (cds.type_url.as_str(), cds.system_version_info.as_str()),
        (CDS, "v1")
    );
    assert_eq!(names(&cds), ["c1", "c2"]);
    assert!(cds.removed_resources.is_empty());
    // Each resource carries its content's version, and the resource itself.
    assert!(cds
        .resources
        .iter()
        .all(|r| r.version.len() == 16 && r.resource.is_some()));
    assert_ne!(cds.resources[0].version, cds.resources[1].version);
    c.ack(&cds).await;
    // "*" is the wildcard too.
    c.subscribe(LDS, &["*"]).await;
    let lds = c.recv().await;
    assert_eq!(names(&lds), ["0.0.0.0_8080"]);
    assert_ne!(lds.nonce, cds.nonce);
    c.ack(&lds).await;
    // A name that does not exist is answered as removed: the gateway stops waiting for it.
    c.subscribe(EDS, &["c1", "missing"]).await;
    let eds = c.recv().await;
    assert_eq!(names(&eds), ["c1"]);
    assert_eq!(eds.removed_resources, ["missing"]);
    c.ack(&eds).await;
    c.silent().await;
}

#[tokio::test]
async fn subscribe_and_unsubscribe_change_what_is_sent_and_pushed() {
    let (cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = DeltaClient::connect(addr, node("gw-1", &[])).await;
    c.subscribe(EDS, &["c1"]).await;
    let first = c.recv().await;
    assert_eq!(names(&first), ["c1"]);
    c.ack(&first).await;
    // A later subscription gets only the new name.
    c.subscribe(EDS, &["c2"]).await;
    let second = c.recv().await;
    assert_eq!(names(&second), ["c2"]);
    c.ack(&second).await;
    // An unsubscription needs no answer, and ends the pushes for that name.
    c.send(DeltaDiscoveryRequest {
        type_url: EDS.into(),
        resource_names_unsubscribe: vec!["c1".into()],
        ..Default::default()
    })
    .await;
    c.silent().await;
    let mut next = bookinfo();
    next.endpoints = vec![("c1", 7), ("c2", 1)];
    cp.publish(next.generation("v2"));
    c.silent().await;
    next.endpoints = vec![("c1", 7), ("c2", 9)];
    cp.publish(next.generation("v3"));
    let pushed = c.recv().await;
    assert_eq!(
        (names(&pushed), pushed.system_version_info.as_str()),
        (vec!["c2"], "v3")
    );
}

#[tokio::test]
async fn a_reconnecting_gateway_gets_only_what_it_lacks_and_the_removals() {
    let (cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = DeltaClient::connect(addr, node("gw-1", &[])).await;
    c.subscribe(CDS, &[]).await;
    let held = versions(&c.recv().await);
    drop(c);
    // While it was away, c2 changed.
    let mut next = bookinfo();
    next.clusters = vec![("c1", "a"), ("c2", "b")];
    cp.publish(next.generation("v2"));
    let mut c = DeltaClient::connect(addr, node("gw-1", &[])).await;
    let mut initial = held.clone();
    initial.insert("gone".into(), "0123456789abcdef".into());
    c.send(DeltaDiscoveryRequest {
        type_url: CDS.into(),
        initial_resource_versions: initial,
        ..Default::default()
    })
    .await;
    let r = c.recv().await;
    assert_eq!(names(&r), ["c2"], "c1 is unchanged: not sent again");
    assert_ne!(versions(&r)["c2"], held["c2"]);
    assert_eq!(r.removed_resources, ["gone"]);

    // Named types likewise: the names reported stay subscribed.
    let eds_v1 = {
        let mut fresh = DeltaClient::connect(addr, node("gw-2", &[])).await;
        fresh.subscribe(EDS, &["c1", "c2"]).await;
        versions(&fresh.recv().await)
    };
    let mut c = DeltaClient::connect(addr, node("gw-1", &[])).await;
    c.send(DeltaDiscoveryRequest {
        type_url: EDS.into(),
        resource_names_subscribe: vec!["c1".into()],
        initial_resource_versions: [("c1".to_string(), eds_v1["c1"].clone())].into(),
        ..Default::default()
    })
    .await;
    let r = c.recv().await;
    assert!(
        r.resources.is_empty() && r.removed_resources.is_empty(),
        "{r:?}"
    );
    c.ack(&r).await;
    let mut next = bookinfo();
    next.clusters = vec![("c1", "a"), ("c2", "b")];
    next.endpoints = vec![("c1", 4), ("c2", 1)];
    cp.publish(next.generation("v3"));
    assert_eq!(names(&c.recv().await), ["c1"]);
}

#[tokio::test]
async fn a_reload_sends_only_the_changed_resources_and_removes_the_gone() {
    let before = Fake {
        listeners: vec!["0.0.0.0_8080", "0.0.0.0_9090"],
        routes: vec![("http.8080", "a"), ("http.9090", "a")],
        clusters: vec![("c1", "a"), ("c2", "a"), ("c3", "a")],
        endpoints: vec![("c1", 1), ("c2", 1), ("c3", 1)],
    };
    let (cp, addr) = start(before.generation("v1")).await;
    let mut c = DeltaClient::connect(addr, node("gw-1", &[])).await;
    for (t, n) in [
        (CDS, &[][..]),
        (EDS, &["c1", "c2", "c3"][..]),
        (LDS, &[][..]),
        (RDS, &["http.8080", "http.9090"][..]),
    ] {
        c.subscribe(t, n).await;
        let r = c.recv().await;
        c.ack(&r).await;
    }
    c.silent().await;
    let sent = |t| cp.resources_sent(t);
    assert_eq!([sent(CDS), sent(EDS), sent(LDS), sent(RDS)], [3, 3, 2, 2]);

    // One route changes, one listener and one cluster go, one cluster's endpoints change.
    let after = Fake {
        listeners: vec!["0.0.0.0_8080"],
        routes: vec![("http.8080", "a"), ("http.9090", "b")],
        clusters: vec![("c1", "a"), ("c2", "a")],
        endpoints: vec![("c1", 5), ("c2", 1)],
    };
    cp.publish(after.generation("v2"));
    let mut got = Vec::new();
    for _ in 0..4 {
        let r = c.recv().await;
        assert_eq!(r.system_version_info, "v2");
        let n: Vec<String> = names(&r).iter().map(|n| n.to_string()).collect();
        got.push((r.type_url.clone(), n, r.removed_resources.clone()));
        c.ack(&r).await;
    }
    let row = |t: &str, n: &[&str], gone: &[&str]| {
        let own = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        (t.to_string(), own(n), own(gone))
    };
    assert_eq!(
        got,
        [
            row(CDS, &[], &["c3"]),
            row(EDS, &["c1"], &["c3"]),
            row(LDS, &[], &["0.0.0.0_9090"]),
            row(RDS, &["http.9090"], &[]),
        ],
        "in istiod's order, only what changed"
    );
    c.silent().await;
    assert_eq!([sent(CDS), sent(EDS), sent(LDS), sent(RDS)], [3, 4, 2, 3]);

    // The same content under a new version: nothing travels.
    cp.publish(after.generation("v3"));
    c.silent().await;
}

#[tokio::test]
async fn a_changed_cluster_gets_its_endpoints_again() {
    let (cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = DeltaClient::connect(addr, node("gw-1", &[])).await;
    for (t, n) in [(CDS, &[][..]), (EDS, &["c1", "c2"][..])] {
        c.subscribe(t, n).await;
        let r = c.recv().await;
        c.ack(&r).await;
    }
    let mut next = bookinfo();
    next.clusters = vec![("c1", "changed"), ("c2", "a")];
    cp.publish(next.generation("v2"));
    let cds = c.recv().await;
    assert_eq!((cds.type_url.as_str(), names(&cds)), (CDS, vec!["c1"]));
    let eds = c.recv().await;
    assert_eq!(
        (eds.type_url.as_str(), names(&eds)),
        (EDS, vec!["c1"]),
        "the rebuilt cluster warms with its unchanged endpoints"
    );
    c.silent().await;
}

#[tokio::test]
async fn a_nack_keeps_the_stream_serving() {
    let (cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = DeltaClient::connect(addr, node("gw-1", &[])).await;
    c.subscribe(EDS, &["c1"]).await;
    let first = c.recv().await;
    c.send(DeltaDiscoveryRequest {
        type_url: EDS.into(),
        response_nonce: first.nonce.clone(),
        error_detail: Some(RpcStatus {
            code: 3,
            message: "bad endpoint".into(),
            ..Default::default()
        }),
        ..Default::default()
    })
    .await;
    c.silent().await;
    let mut next = bookinfo();
    next.endpoints = vec![("c1", 2), ("c2", 1)];
    cp.publish(next.generation("v2"));
    let pushed = c.recv().await;
    assert_eq!(
        (names(&pushed), pushed.system_version_info.as_str()),
        (vec!["c1"], "v2")
    );
}

#[tokio::test]
async fn sds_secrets_travel_on_the_delta_stream() {
    use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource};
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        secret, Secret, TlsCertificate,
    };
    // The certificate's bytes stand for its version.
    let secret = |name: &str, body: &str| {
        let s = Secret {
            name: name.into(),
            r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
                certificate_chain: Some(DataSource {
                    specifier: Some(data_source::Specifier::InlineBytes(body.into())),
                    ..Default::default()
                }),
                ..Default::default()
            })),
        };
        super::tests::any(types::SECRET, &s)
    };
    let generation = |v: &str, body: &'static str| {
        let mut xds = bookinfo().xds();
        xds.secrets
            .insert("kubernetes://a".into(), secret("kubernetes://a", body));
        Generation::new(v, move |_| (xds.clone(), Vec::new()))
    };
    let (cp, addr) = start(generation("v1", "1")).await;
    let mut c = DeltaClient::connect(addr, node("gw-1", &[])).await;
    c.subscribe(types::SECRET, &["kubernetes://a"]).await;
    let r = c.recv().await;
    assert_eq!(names(&r), ["kubernetes://a"]);
    c.ack(&r).await;
    cp.publish(generation("v2", "2"));
    let r = c.recv().await;
    assert_eq!(
        (r.type_url.as_str(), names(&r)),
        (types::SECRET, vec!["kubernetes://a"])
    );
}

#[tokio::test]
async fn the_first_delta_request_must_name_the_node() {
    let (_cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = DeltaClient::connect(addr, node("gw-1", &[])).await;
    c.node = None;
    c.subscribe(CDS, &[]).await;
    match tokio::time::timeout(Duration::from_secs(5), c.rx.message()).await {
        Ok(Err(s)) => assert_eq!(s.code(), tonic::Code::InvalidArgument),
        other => panic!("expected an error status, got {other:?}"),
    }
}

#[test]
fn subscriptions_follow_wildcard_names_and_initial_versions() {
    let req = |sub: &[&str], unsub: &[&str], initial: &[(&str, &str)]| DeltaDiscoveryRequest {
        resource_names_subscribe: sub.iter().map(|s| s.to_string()).collect(),
        resource_names_unsubscribe: unsub.iter().map(|s| s.to_string()).collect(),
        initial_resource_versions: initial
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    // Wildcard: an empty first request, with what a reconnecting gateway kept.
    let mut s = Sub::default();
    let asked = subscribe(&mut s, &req(&[], &[], &[("a", "1")]), true);
    assert!(s.wildcard && s.names.is_empty() && asked.names.is_empty());
    assert_eq!(s.sent, [("a".to_string(), "1".to_string())].into());
    // Named: the initial names stay subscribed; a later unsubscription forgets them.
    let mut s = Sub::default();
    subscribe(&mut s, &req(&["b"], &[], &[("a", "1")]), true);
    assert!(!s.wildcard);
    assert_eq!(s.names, ["a".to_string(), "b".to_string()].into());
    let asked = subscribe(&mut s, &req(&["c", "b"], &["a"], &[]), false);
    assert_eq!(asked.names, ["c"], "b was subscribed already");
    assert_eq!(s.names, ["b".to_string(), "c".to_string()].into());
    assert!(
        s.sent.is_empty(),
        "no removal is owed for an unsubscribed name"
    );
    // "*" later turns the wildcard on, and its unsubscription off.
    let asked = subscribe(&mut s, &req(&["*"], &[], &[]), false);
    assert!(asked.wildcard && s.wildcard);
    subscribe(&mut s, &req(&[], &["*"], &[]), false);
    assert!(!s.wildcard);
}

#[test]
fn a_diff_names_the_changed_and_the_gone() {
    let served = Served::new(bookinfo().xds());
    let v = |n: &str| served.version(CDS, n).expect("exists").to_string();
    let sub = Sub {
        wildcard: true,
        sent: [
            ("c1".to_string(), v("c1")),
            ("c2".to_string(), "old".to_string()),
            ("c9".to_string(), "x".to_string()),
        ]
        .into(),
        ..Sub::default()
    };
    assert_eq!(
        sub.diff(&served, CDS),
        Diff {
            changed: vec!["c2".into()],
            gone: vec!["c9".into()],
        }
    );
}
