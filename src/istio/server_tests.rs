//! The ADS server against a tonic client on loopback, serving fixed xDS (no translation).

use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{Metadata, Node};
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::google::protobuf::{value, Struct, Value};
use envoy_types::pb::google::rpc::Status as RpcStatus;

use super::*;
use prost::Message;

const LDS: &str = types::LISTENER;
const RDS: &str = types::ROUTE;
const CDS: &str = types::CLUSTER;
const EDS: &str = types::ENDPOINT;

pub(super) fn any<M: Message>(type_url: &str, m: &M) -> Any {
    Any {
        type_url: type_url.to_string(),
        value: m.encode_to_vec(),
    }
}

/// Resources by name; the second field of a route (its vhost name), a cluster (its
/// alt_stat_name) or an endpoint (a weight) lets two fakes differ exactly where a test wants.
#[derive(Clone, Default)]
pub(super) struct Fake {
    pub(super) listeners: Vec<&'static str>,
    pub(super) routes: Vec<(&'static str, &'static str)>,
    pub(super) clusters: Vec<(&'static str, &'static str)>,
    pub(super) endpoints: Vec<(&'static str, u32)>,
}

impl Fake {
    pub(super) fn xds(&self) -> Xds {
        let mut x = Xds::default();
        for l in &self.listeners {
            let m = Listener {
                name: l.to_string(),
                ..Default::default()
            };
            x.listeners.insert(l.to_string(), any(LDS, &m));
        }
        for (r, vhost) in &self.routes {
            let m = RouteConfiguration {
                name: r.to_string(),
                virtual_hosts: vec![envoy_types::pb::envoy::config::route::v3::VirtualHost {
                    name: vhost.to_string(),
                    domains: vec!["*".into()],
                    ..Default::default()
                }],
                ..Default::default()
            };
            x.routes.insert(r.to_string(), any(RDS, &m));
        }
        for (c, stat) in &self.clusters {
            let m = Cluster {
                name: c.to_string(),
                alt_stat_name: stat.to_string(),
                ..Default::default()
            };
            x.clusters.insert(c.to_string(), any(CDS, &m));
        }
        for (c, weight) in &self.endpoints {
            let m = ClusterLoadAssignment {
                cluster_name: c.to_string(),
                endpoints: vec![
                    envoy_types::pb::envoy::config::endpoint::v3::LocalityLbEndpoints {
                        load_balancing_weight: Some(
                            envoy_types::pb::google::protobuf::UInt32Value { value: *weight },
                        ),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            };
            x.endpoints.insert(c.to_string(), any(EDS, &m));
        }
        x
    }

    pub(super) fn generation(&self, version: &str) -> Generation {
        let xds = self.xds();
        Generation::new(version, move |_| (xds.clone(), Vec::new()))
    }
}

pub(super) fn bookinfo() -> Fake {
    Fake {
        listeners: vec!["0.0.0.0_8080"],
        routes: vec![("http.8080", "a")],
        clusters: vec![("c1", "a"), ("c2", "a")],
        endpoints: vec![("c1", 1), ("c2", 1)],
    }
}

pub(super) async fn start(first: Generation) -> (ControlPlane, SocketAddr) {
    let cp = ControlPlane::new(first);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let server = cp.clone();
    tokio::spawn(async move { server.serve(listener, std::future::pending()).await });
    (cp, addr)
}

pub(super) fn node(id: &str, labels: &[(&str, &str)]) -> Node {
    let labels = Struct {
        fields: labels
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    Value {
                        kind: Some(value::Kind::StringValue(v.to_string())),
                    },
                )
            })
            .collect(),
    };
    Node {
        id: id.into(),
        metadata: Some(Struct {
            fields: [(
                "LABELS".to_string(),
                Value {
                    kind: Some(value::Kind::StructValue(labels)),
                },
            )]
            .into(),
        }),
        ..Default::default()
    }
}

struct Client {
    tx: mpsc::Sender<DiscoveryRequest>,
    rx: tonic::Streaming<DiscoveryResponse>,
    node: Option<Node>,
}

impl Client {
    async fn connect(addr: SocketAddr, node: Node) -> Client {
        let mut client = AggregatedDiscoveryServiceClient::connect(format!("http://{addr}"))
            .await
            .expect("connect");
        let (tx, rx) = mpsc::channel(16);
        let rx = client
            .stream_aggregated_resources(ReceiverStream::new(rx))
            .await
            .expect("open stream")
            .into_inner();
        Client {
            tx,
            rx,
            node: Some(node),
        }
    }

    /// Sends a request; the node goes on the first one only, as Envoy's
    /// set_node_on_first_message_only does.
    async fn send(&mut self, type_url: &str, names: &[&str], version: &str, nonce: &str) {
        self.send_req(DiscoveryRequest {
            type_url: type_url.into(),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            version_info: version.into(),
            response_nonce: nonce.into(),
            ..Default::default()
        })
        .await;
    }

    async fn send_req(&mut self, mut req: DiscoveryRequest) {
        req.node = self.node.take();
        self.tx.send(req).await.expect("send request");
    }

    async fn recv(&mut self) -> DiscoveryResponse {
        match tokio::time::timeout(Duration::from_secs(5), self.rx.message()).await {
            Ok(Ok(Some(r))) => r,
            other => panic!("no response: {other:?}"),
        }
    }

    /// Asserts nothing arrives for a while.
    async fn silent(&mut self) {
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(300), self.rx.message()).await {
            panic!("expected no response, got {r:?}");
        }
    }

    async fn ack(&mut self, r: &DiscoveryResponse, names: &[&str]) {
        self.send(&r.type_url, names, &r.version_info, &r.nonce)
            .await;
    }
}

fn names(r: &DiscoveryResponse) -> Vec<String> {
    r.resources
        .iter()
        .map(|a| match a.type_url.as_str() {
            LDS => Listener::decode(&a.value[..]).map(|m| m.name),
            RDS => RouteConfiguration::decode(&a.value[..]).map(|m| m.name),
            CDS => Cluster::decode(&a.value[..]).map(|m| m.name),
            EDS => ClusterLoadAssignment::decode(&a.value[..]).map(|m| m.cluster_name),
            other => panic!("unexpected type {other}"),
        })
        .map(|n| n.expect("decodes"))
        .collect()
}

#[tokio::test]
async fn lds_and_cds_are_wildcard_with_version_and_fresh_nonces() {
    let (_cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = Client::connect(addr, node("gw-1", &[("istio", "ingressgateway")])).await;
    c.send(CDS, &[], "", "").await;
    let cds = c.recv().await;
    assert_eq!(cds.type_url, CDS);
    assert_eq!(cds.version_info, "v1");
    assert_eq!(names(&cds), ["c1", "c2"]);
    c.send(LDS, &[], "", "").await;
    let lds = c.recv().await;
    assert_eq!(lds.version_info, "v1");
    assert_eq!(names(&lds), ["0.0.0.0_8080"]);
    assert!(!cds.nonce.is_empty() && !lds.nonce.is_empty());
    assert_ne!(cds.nonce, lds.nonce);
}

#[tokio::test]
async fn rds_and_eds_answer_the_names_asked_that_exist() {
    let (_cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = Client::connect(addr, node("gw-1", &[])).await;
    c.send(EDS, &["c1", "missing"], "", "").await;
    let eds = c.recv().await;
    assert_eq!(names(&eds), ["c1"]);
    // The ACK asks for one more name: a response for the new set.
    c.ack(&eds, &["c1", "c2"]).await;
    let eds2 = c.recv().await;
    assert_eq!(names(&eds2), ["c1", "c2"]);
    assert_ne!(eds2.nonce, eds.nonce);
    // The same names again: a plain ACK, nothing to send.
    c.ack(&eds2, &["c1", "c2"]).await;
    c.silent().await;
    c.send(RDS, &["http.8080"], "", "").await;
    assert_eq!(names(&c.recv().await), ["http.8080"]);
}

#[tokio::test]
async fn nack_keeps_the_stream_and_stale_nonces_are_ignored() {
    let (cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = Client::connect(addr, node("gw-1", &[])).await;
    c.send(EDS, &["c1"], "", "").await;
    let first = c.recv().await;
    c.send_req(DiscoveryRequest {
        type_url: EDS.into(),
        resource_names: vec!["c1".into()],
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
    // The stream still carries pushes after the NACK.
    let mut next = bookinfo();
    next.endpoints = vec![("c1", 2), ("c2", 1)];
    cp.publish(next.generation("v2"));
    let pushed = c.recv().await;
    assert_eq!(
        (pushed.type_url.as_str(), pushed.version_info.as_str()),
        (EDS, "v2")
    );
    // A name change answering the older response is stale: ignored.
    c.ack(&first, &["c1", "c2"]).await;
    c.silent().await;
    c.ack(&pushed, &["c1", "c2"]).await;
    assert_eq!(names(&c.recv().await), ["c1", "c2"]);
}

#[tokio::test]
async fn a_reload_pushes_only_what_changed_cds_eds_lds_rds() {
    let (cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = Client::connect(addr, node("gw-1", &[])).await;
    // Subscribe in the order a gateway warms: LDS, RDS, CDS, EDS.
    for (t, n) in [
        (LDS, &[][..]),
        (RDS, &["http.8080"][..]),
        (CDS, &[][..]),
        (EDS, &["c1"][..]),
    ] {
        c.send(t, n, "", "").await;
        let r = c.recv().await;
        c.ack(&r, n).await;
    }
    c.silent().await;

    // Everything changes: pushed in istiod's order.
    let all = Fake {
        listeners: vec!["0.0.0.0_8080", "0.0.0.0_8443"],
        routes: vec![("http.8080", "b")],
        clusters: vec![("c1", "b"), ("c2", "a")],
        endpoints: vec![("c1", 5), ("c2", 1)],
    };
    cp.publish(all.generation("v2"));
    let mut order = Vec::new();
    for _ in 0..4 {
        let r = c.recv().await;
        assert_eq!(r.version_info, "v2");
        order.push(r.type_url.clone());
    }
    assert_eq!(order, [CDS, EDS, LDS, RDS]);

    // Only the cluster set and a route change; an endpoint nobody asked for changes too.
    let some = Fake {
        routes: vec![("http.8080", "c")],
        clusters: vec![("c1", "c"), ("c2", "a")],
        endpoints: vec![("c1", 5), ("c2", 9)],
        ..all.clone()
    };
    cp.publish(some.generation("v3"));
    let r1 = c.recv().await;
    let r2 = c.recv().await;
    assert_eq!(
        [
            (r1.type_url.as_str(), r1.version_info.as_str()),
            (r2.type_url.as_str(), r2.version_info.as_str())
        ],
        [(CDS, "v3"), (RDS, "v3")]
    );
    c.silent().await;

    // The same resources under a new version: nothing to push.
    cp.publish(some.generation("v4"));
    c.silent().await;
}

#[tokio::test]
async fn eds_and_rds_pushes_carry_only_the_resources_that_changed() {
    let before = Fake {
        listeners: vec!["0.0.0.0_8080"],
        routes: vec![("http.8080", "a"), ("http.9090", "a")],
        clusters: vec![("c1", "a"), ("c2", "a")],
        endpoints: vec![("c1", 1), ("c2", 1)],
    };
    let (cp, addr) = start(before.generation("v1")).await;
    let mut c = Client::connect(addr, node("gw-1", &[])).await;
    for (t, n) in [
        (RDS, &["http.8080", "http.9090"][..]),
        (EDS, &["c1", "c2"][..]),
    ] {
        c.send(t, n, "", "").await;
        let r = c.recv().await;
        assert_eq!(
            r.resources.len(),
            2,
            "the first answer holds every named resource"
        );
        c.ack(&r, n).await;
    }
    let after = Fake {
        routes: vec![("http.8080", "a"), ("http.9090", "b")],
        endpoints: vec![("c1", 7), ("c2", 1)],
        ..before.clone()
    };
    cp.publish(after.generation("v2"));
    let eds = c.recv().await;
    let rds = c.recv().await;
    assert_eq!((eds.type_url.as_str(), rds.type_url.as_str()), (EDS, RDS));
    let names = |r: &DiscoveryResponse, t: &str| -> Vec<String> {
        r.resources
            .iter()
            .map(|a| match t {
                EDS => ClusterLoadAssignment::decode(a.value.as_slice())
                    .map(|m| m.cluster_name)
                    .unwrap_or_default(),
                _ => RouteConfiguration::decode(a.value.as_slice())
                    .map(|m| m.name)
                    .unwrap_or_default(),
            })
            .collect()
    };
    assert_eq!(names(&eds, EDS), ["c1"]);
    assert_eq!(names(&rds, RDS), ["http.9090"]);
    c.silent().await;
}

#[tokio::test]
async fn gateways_with_the_same_labels_share_one_translation() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let xds = bookinfo().xds();
    let (_cp, addr) = start(Generation::new("v1", move |_| {
        counted.fetch_add(1, Ordering::SeqCst);
        (xds.clone(), Vec::new())
    }))
    .await;
    for (id, label) in [("gw-1", "a"), ("gw-2", "a"), ("gw-3", "b")] {
        let mut c = Client::connect(addr, node(id, &[("istio", label)])).await;
        c.send(CDS, &[], "", "").await;
        assert_eq!(names(&c.recv().await), ["c1", "c2"]);
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "one translation per label set"
    );
}

#[tokio::test]
async fn unknown_types_get_an_empty_answer() {
    let (_cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = Client::connect(addr, node("gw-1", &[])).await;
    c.send(types::SECRET, &["kubernetes://cert"], "", "").await;
    let r = c.recv().await;
    assert_eq!((r.type_url.as_str(), r.resources.len()), (types::SECRET, 0));
    assert_eq!(r.version_info, "v1");
}

#[tokio::test]
async fn the_first_request_must_name_the_node() {
    let (_cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = Client::connect(addr, node("gw-1", &[])).await;
    c.node = None;
    c.send(CDS, &[], "", "").await;
    let status = match tokio::time::timeout(Duration::from_secs(5), c.rx.message()).await {
        Ok(Err(s)) => s,
        other => panic!("expected an error status, got {other:?}"),
    };
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("node"), "{}", status.message());
}

#[tokio::test]
async fn stop_ends_open_streams() {
    let (cp, addr) = start(bookinfo().generation("v1")).await;
    let mut c = Client::connect(addr, node("gw-1", &[])).await;
    c.send(CDS, &[], "", "").await;
    c.recv().await;
    cp.stop();
    match tokio::time::timeout(Duration::from_secs(5), c.rx.message()).await {
        Ok(Err(s)) => assert_eq!(s.code(), tonic::Code::Unavailable),
        Ok(Ok(None)) => {}
        other => panic!("stream still open: {other:?}"),
    }
}

#[test]
fn resources_differing_only_in_map_order_have_one_version() {
    let meta = |k: &str| Cluster {
        metadata: Some(Metadata {
            filter_metadata: [(k.to_string(), Struct::default())].into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let named = |k: &str| Cluster {
        name: "c".into(),
        ..meta(k)
    };
    // Concatenated encodings merge: both hold metadata {a, b}, written in opposite order.
    let ab = [named("a").encode_to_vec(), meta("b").encode_to_vec()].concat();
    let ba = [meta("b").encode_to_vec(), named("a").encode_to_vec()].concat();
    assert_ne!(ab, ba);
    let a = Any {
        type_url: CDS.into(),
        value: ab,
    };
    let b = Any {
        type_url: CDS.into(),
        value: ba,
    };
    assert_eq!(resource_version(&a), resource_version(&b));
    assert_ne!(
        resource_version(&a),
        resource_version(&any(CDS, &named("a")))
    );
}

#[test]
fn push_versions_are_dated() {
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339(951_782_400 + 3_661), "2000-02-29T01:01:01Z");
    assert!(push_version(7).ends_with("Z/7"));
}

#[tokio::test]
async fn sds_answers_the_secrets_asked_and_pushes_a_rotation() {
    use envoy_types::pb::envoy::config::core::v3::{data_source, DataSource};
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        secret, Secret, TlsCertificate,
    };
    // The certificate's bytes stand for its version.
    let secret = |name: &str, version: &str| {
        let s = Secret {
            name: name.into(),
            r#type: Some(secret::Type::TlsCertificate(TlsCertificate {
                certificate_chain: Some(DataSource {
                    specifier: Some(data_source::Specifier::InlineBytes(version.into())),
                    ..Default::default()
                }),
                ..Default::default()
            })),
        };
        (name.to_string(), any(types::SECRET, &s))
    };
    let generation = |version: &'static str, secrets: Vec<(String, Any)>| {
        let mut xds = bookinfo().xds();
        xds.secrets = secrets.into_iter().collect();
        Generation::new(version, move |_| (xds.clone(), Vec::new()))
    };
    let (cp, addr) = start(generation(
        "v1",
        vec![secret("kubernetes://a", "1"), secret("kubernetes://b", "1")],
    ))
    .await;
    let mut c = Client::connect(addr, node("gw-1", &[])).await;
    c.send(
        types::SECRET,
        &["kubernetes://a", "kubernetes://missing"],
        "",
        "",
    )
    .await;
    let r = c.recv().await;
    assert_eq!(r.resources.len(), 1, "only the secret asked that exists");
    assert_eq!(r.resources[0], secret("kubernetes://a", "1").1);
    c.ack(&r, &["kubernetes://a", "kubernetes://missing"]).await;
    c.silent().await;
    // A rotated certificate is pushed; one nobody asked for is not.
    cp.publish(generation(
        "v2",
        vec![secret("kubernetes://a", "2"), secret("kubernetes://b", "2")],
    ));
    let r = c.recv().await;
    assert_eq!(
        (r.type_url.as_str(), r.version_info.as_str()),
        (types::SECRET, "v2")
    );
    assert_eq!(r.resources, [secret("kubernetes://a", "2").1]);
    c.ack(&r, &["kubernetes://a", "kubernetes://missing"]).await;
    c.silent().await;
}
