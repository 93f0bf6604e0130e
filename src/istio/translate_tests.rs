use super::*;

#[test]
fn durations_as_proto_json() {
    assert_eq!(duration("10s").unwrap(), "10s");
    assert_eq!(duration("1.5s").unwrap(), "1.5s");
    assert_eq!(duration("100ms").unwrap(), "0.1s");
    assert_eq!(duration("2m").unwrap(), "120s");
    assert_eq!(duration("1h").unwrap(), "3600s");
    assert!(duration("10").is_err());
    assert!(duration("-1s").is_err());
    assert!(duration("abc").is_err());
}

fn gateway_node() -> NodeInfo {
    NodeInfo {
        id: "router~127.0.0.1~gw.istio-system~istio-system.svc.cluster.local".into(),
        labels: [("istio".to_string(), "ingressgateway".to_string())].into(),
        namespace: Some("istio-system".into()),
    }
}

fn bookinfo() -> Config {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/gateway-examples/bookinfo");
    let (config, invalid) = crate::istio::load_dir(std::path::Path::new(dir)).expect("bookinfo");
    assert!(invalid.is_empty(), "{invalid:?}");
    config
}

/// What the control plane serves must be what the data plane accepts, as one ADS stream
/// delivers it: CDS, EDS, LDS, RDS.
pub(crate) fn accepted_by_portico(xds: &Xds) {
    use crate::xds::store::Store;
    use crate::xds::types::Kind;
    let mut store = Store::default();
    for (kind, set) in [
        (Kind::Cluster, &xds.clusters),
        (Kind::Endpoint, &xds.endpoints),
        (Kind::Listener, &xds.listeners),
        (Kind::Route, &xds.routes),
    ] {
        let resources: Vec<Any> = set.values().cloned().collect();
        match store.apply(kind, "1", &resources) {
            Ok(next) => store = next,
            Err(e) => panic!("Portico refuses the {kind:?} the control plane serves: {e:?}"),
        }
    }
}

#[test]
fn bookinfo_translates_and_portico_accepts_it() {
    let (xds, invalid) = crate::istio::translate(&bookinfo(), &gateway_node(), &Options::default());
    assert!(invalid.is_empty(), "{invalid:?}");
    assert_eq!(xds.listeners.keys().collect::<Vec<_>>(), ["0.0.0.0_8080"]);
    assert_eq!(xds.routes.keys().collect::<Vec<_>>(), ["http.8080"]);
    let clusters: Vec<&str> = xds.clusters.keys().map(String::as_str).collect();
    let mut want = vec![
        "BlackHoleCluster",
        "outbound|9080||productpage.default.svc.cluster.local",
        "outbound|9080||ratings.default.svc.cluster.local",
        "outbound|9080||reviews.default.svc.cluster.local",
        "outbound|9080|v1|productpage.default.svc.cluster.local",
        "outbound|9080|v1|ratings.default.svc.cluster.local",
        "outbound|9080|v1|reviews.default.svc.cluster.local",
        "outbound|9080|v2|reviews.default.svc.cluster.local",
        "outbound|9080|v3|reviews.default.svc.cluster.local",
    ];
    want.sort();
    assert_eq!(clusters, want);
    accepted_by_portico(&xds);
}
