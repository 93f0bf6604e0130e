//! `Store::apply` and `Store::assemble`: SotW replacement rules, whole-push rejection, warming,
//! sharing of unchanged translations and garbage collection.

use super::*;

use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    ClusterDiscoveryType, DiscoveryType, EdsClusterConfig,
};
use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::config::endpoint::v3 as epb;
use envoy_types::pb::envoy::config::listener::v3 as lpb;
use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3 as hcm;
use prost::Message;

use crate::snapshot::listener::{HCM_TYPE, ROUTER_TYPE};

// ---------------------------------------------------------------------------------------------
// Builders

fn any<M: Message>(type_url: &str, m: &M) -> Any {
    Any {
        type_url: type_url.into(),
        value: m.encode_to_vec(),
    }
}

fn sock(host: &str, port: u32) -> corepb::Address {
    corepb::Address {
        address: Some(corepb::address::Address::SocketAddress(
            corepb::SocketAddress {
                address: host.into(),
                port_specifier: Some(corepb::socket_address::PortSpecifier::PortValue(port)),
                ..Default::default()
            },
        )),
    }
}

fn listener_with(
    name: &str,
    port: u32,
    routes: hcm::http_connection_manager::RouteSpecifier,
) -> ListenerProto {
    let h = hcm::HttpConnectionManager {
        stat_prefix: name.into(),
        route_specifier: Some(routes),
        http_filters: vec![hcm::HttpFilter {
            name: "envoy.filters.http.router".into(),
            config_type: Some(hcm::http_filter::ConfigType::TypedConfig(Any {
                type_url: ROUTER_TYPE.into(),
                value: vec![],
            })),
            ..Default::default()
        }],
        ..Default::default()
    };
    ListenerProto {
        name: name.into(),
        address: Some(sock("127.0.0.1", port)),
        filter_chains: vec![lpb::FilterChain {
            filters: vec![lpb::Filter {
                name: "envoy.filters.network.http_connection_manager".into(),
                config_type: Some(lpb::filter::ConfigType::TypedConfig(any(HCM_TYPE, &h))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A listener on 127.0.0.1:`port` taking route config `rds` from ADS.
fn listener(name: &str, port: u32, rds: &str) -> ListenerProto {
    listener_with(
        name,
        port,
        hcm::http_connection_manager::RouteSpecifier::Rds(hcm::Rds {
            config_source: Some(corepb::ConfigSource {
                config_source_specifier: Some(corepb::config_source::ConfigSourceSpecifier::Ads(
                    Default::default(),
                )),
                ..Default::default()
            }),
            route_config_name: rds.into(),
        }),
    )
}

/// A listener with an inline route config whose cluster is not checked (validate_clusters:
/// false), so tests about listeners need no CDS first.
fn inline_listener(name: &str, port: u32) -> ListenerProto {
    let mut rc = route_config("inline", "c");
    rc.validate_clusters = Some(envoy_types::pb::google::protobuf::BoolValue { value: false });
    listener_with(
        name,
        port,
        hcm::http_connection_manager::RouteSpecifier::RouteConfig(rc),
    )
}

#[test]
fn inline_routes_to_unknown_clusters_are_nacked_as_envoy_does() {
    let l = listener_with(
        "l",
        1,
        hcm::http_connection_manager::RouteSpecifier::RouteConfig(route_config("inline", "nope")),
    );
    let errors = nack(&Store::default(), Kind::Listener, &lds(&[l]));
    assert_eq!(
        errors,
        ["listener 'l': route 'inline': unknown cluster 'nope'"]
    );
}

fn route_config(name: &str, cluster: &str) -> RouteConfiguration {
    RouteConfiguration {
        name: name.into(),
        virtual_hosts: vec![rpb::VirtualHost {
            name: "vh".into(),
            domains: vec!["*".into()],
            routes: vec![rpb::Route {
                r#match: Some(rpb::RouteMatch {
                    path_specifier: Some(rpb::route_match::PathSpecifier::Prefix("/".into())),
                    ..Default::default()
                }),
                action: Some(rpb::route::Action::Route(rpb::RouteAction {
                    cluster_specifier: Some(rpb::route_action::ClusterSpecifier::Cluster(
                        cluster.into(),
                    )),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn eds_cluster(name: &str, service: &str) -> ClusterProto {
    ClusterProto {
        name: name.into(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig {
            service_name: service.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn cla(name: &str, hosts: &[(&str, u32)]) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: vec![epb::LocalityLbEndpoints {
            lb_endpoints: hosts
                .iter()
                .map(|(h, p)| epb::LbEndpoint {
                    host_identifier: Some(epb::lb_endpoint::HostIdentifier::Endpoint(
                        epb::Endpoint {
                            address: Some(sock(h, *p)),
                            ..Default::default()
                        },
                    )),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
}

fn static_cluster(name: &str, kind: DiscoveryType, hosts: &[(&str, u32)]) -> ClusterProto {
    ClusterProto {
        name: name.into(),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(kind as i32)),
        load_assignment: Some(cla(name, hosts)),
        ..Default::default()
    }
}

fn lds(ls: &[ListenerProto]) -> Vec<Any> {
    ls.iter().map(|l| any(types::LISTENER, l)).collect()
}

fn rds(rs: &[RouteConfiguration]) -> Vec<Any> {
    rs.iter().map(|r| any(types::ROUTE, r)).collect()
}

fn cds(cs: &[ClusterProto]) -> Vec<Any> {
    cs.iter().map(|c| any(types::CLUSTER, c)).collect()
}

fn eds(es: &[ClusterLoadAssignment]) -> Vec<Any> {
    es.iter().map(|e| any(types::ENDPOINT, e)).collect()
}

#[track_caller]
fn push(s: &Store, kind: Kind, resources: &[Any]) -> Store {
    s.apply(kind, "v", resources)
        .unwrap_or_else(|e| panic!("push rejected: {e:#?}"))
}

#[track_caller]
fn nack(s: &Store, kind: Kind, resources: &[Any]) -> Vec<String> {
    match s.apply(kind, "v", resources) {
        Ok(_) => panic!("push accepted"),
        Err(e) => e,
    }
}

fn snap(s: &Store, prev: &Snapshot) -> Snapshot {
    s.assemble(
        prev,
        prev.version + 1,
        &crate::admin::stats::Stats::default(),
    )
}

fn names<V: Clone>(t: &imbl::OrdMap<String, V>) -> Vec<&str> {
    t.keys().map(|k| k.as_str()).collect()
}

fn sorted<'a>(it: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut v: Vec<_> = it.collect();
    v.sort_unstable();
    v
}

fn snap_listeners(s: &Snapshot) -> Vec<&str> {
    sorted(s.listeners.keys().map(|k| k.as_str()))
}

fn snap_clusters(s: &Snapshot) -> Vec<&str> {
    sorted(s.clusters.keys().map(|k| &**k))
}

/// Listener 'l' (port 1, rds 'r') serving cluster 'c' (EDS), everything delivered.
fn full_store() -> Store {
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[eds_cluster("c", "")]),
    );
    let s = push(&s, Kind::Endpoint, &eds(&[cla("c", &[("10.0.0.1", 80)])]));
    let s = push(&s, Kind::Listener, &lds(&[listener("l", 1, "r")]));
    push(&s, Kind::Route, &rds(&[route_config("r", "c")]))
}

// ---------------------------------------------------------------------------------------------
// Wildcard and named updates

#[test]
fn lds_push_replaces_the_whole_set() {
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[listener("a", 1, "r"), listener("b", 2, "r")]),
    );
    assert_eq!(names(&s.listeners), ["a", "b"]);
    let s = push(
        &s,
        Kind::Listener,
        &lds(&[listener("b", 2, "r"), listener("c", 3, "r")]),
    );
    assert_eq!(names(&s.listeners), ["b", "c"]);
    let s = push(&s, Kind::Listener, &[]);
    assert!(s.listeners.is_empty());
}

#[test]
fn cds_push_replaces_the_whole_set() {
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[eds_cluster("a", ""), eds_cluster("b", "")]),
    );
    assert_eq!(names(&s.clusters), ["a", "b"]);
    let s = push(&s, Kind::Cluster, &cds(&[eds_cluster("b", "")]));
    assert_eq!(names(&s.clusters), ["b"]);
    let s = push(&s, Kind::Cluster, &[]);
    assert!(s.clusters.is_empty());
}

#[test]
fn rds_push_updates_only_the_named_configs() {
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[listener("a", 1, "ra"), listener("b", 2, "rb")]),
    );
    let s = push(&s, Kind::Route, &rds(&[route_config("ra", "c1")]));
    let s = push(&s, Kind::Route, &rds(&[route_config("rb", "c1")]));
    assert_eq!(names(&s.routes), ["ra", "rb"]);
    let before = s.routes["ra"].value.clone();
    let s = push(&s, Kind::Route, &rds(&[route_config("rb", "c2")]));
    assert_eq!(names(&s.routes), ["ra", "rb"]);
    assert!(Arc::ptr_eq(&before, &s.routes["ra"].value));
    assert_eq!(
        s.routes["rb"]
            .value
            .clusters()
            .map(|c| &**c)
            .collect::<Vec<_>>(),
        ["c2"]
    );
    // An empty RDS response removes nothing.
    let s = push(&s, Kind::Route, &[]);
    assert_eq!(names(&s.routes), ["ra", "rb"]);
}

#[test]
fn eds_push_updates_only_the_named_assignments() {
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[eds_cluster("a", ""), eds_cluster("b", "")]),
    );
    let s = push(&s, Kind::Endpoint, &eds(&[cla("a", &[("10.0.0.1", 80)])]));
    let s = push(&s, Kind::Endpoint, &eds(&[cla("b", &[("10.0.0.2", 80)])]));
    assert_eq!(names(&s.endpoints), ["a", "b"]);
    let s = push(&s, Kind::Endpoint, &eds(&[cla("a", &[("10.0.0.3", 80)])]));
    assert_eq!(names(&s.endpoints), ["a", "b"]);
    assert_eq!(
        s.endpoints["a"].value.hosts[0].addr.to_string(),
        "10.0.0.3:80"
    );
    assert_eq!(
        s.endpoints["b"].value.hosts[0].addr.to_string(),
        "10.0.0.2:80"
    );
}

#[test]
fn accepted_push_records_version_and_item_metadata() {
    let s = Store::default()
        .apply(Kind::Listener, "v7", &lds(&[listener("a", 1, "r")]))
        .unwrap();
    assert_eq!(
        s.versions.get(&Kind::Listener).map(String::as_str),
        Some("v7")
    );
    assert_eq!(s.versions.get(&Kind::Cluster), None);
    let item = &s.listeners["a"];
    assert_eq!(&*item.version, "v7");
    assert!(!item.is_static);
    assert_eq!(item.proto.decode().expect("stored bytes decode").name, "a");
    assert_eq!(item.value.addr.to_string(), "127.0.0.1:1");
    // A rejected push leaves the version alone (the caller keeps the old store).
    let errs = s
        .apply(Kind::Listener, "v8", &lds(&[listener("", 1, "r")]))
        .unwrap_err();
    assert_eq!(errs.len(), 1);
    assert_eq!(s.versions[&Kind::Listener], "v7");
}

#[test]
fn resource_wrapper_is_unwrapped() {
    use envoy_types::pb::envoy::service::discovery::v3::Resource;
    let inner = any(types::CLUSTER, &eds_cluster("wrapped", ""));
    let wrapped = any(
        "type.googleapis.com/envoy.service.discovery.v3.Resource",
        &Resource {
            name: "wrapped".into(),
            resource: Some(inner),
            ..Default::default()
        },
    );
    let s = push(&Store::default(), Kind::Cluster, &[wrapped]);
    assert_eq!(names(&s.clusters), ["wrapped"]);
}

// ---------------------------------------------------------------------------------------------
// Rejections

#[test]
fn duplicate_names_in_one_push_as_envoy_treats_them() {
    let errs = nack(
        &Store::default(),
        Kind::Listener,
        &lds(&[listener("a", 1, "r"), listener("a", 2, "r")]),
    );
    assert_eq!(
        errs,
        ["listener 'a': duplicate listener name in one response"]
    );
    let errs = nack(
        &Store::default(),
        Kind::Cluster,
        &cds(&[eds_cluster("c", ""), eds_cluster("c", "")]),
    );
    assert_eq!(
        errs,
        ["cluster 'c': duplicate cluster name in one response"]
    );
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[listener("l", 1, "r")]),
    );
    // Envoy keeps the first of a repeated route configuration or load assignment, silently.
    let s2 = push(
        &s,
        Kind::Route,
        &rds(&[route_config("r", "a"), route_config("r", "b")]),
    );
    assert_eq!(
        s2.routes["r"]
            .value
            .clusters()
            .next()
            .map(|c| c.to_string()),
        Some("a".into())
    );
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[eds_cluster("c", "")]),
    );
    let s3 = push(&s, Kind::Endpoint, &eds(&[cla("c", &[]), cla("c", &[])]));
    assert!(s3.endpoints.contains_key("c"));
}

#[test]
fn a_bad_resource_rejects_the_whole_push_with_every_reason() {
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[listener("old", 1, "r")]),
    );
    let mut no_chains = listener("b", 2, "r");
    no_chains.filter_chains.clear();
    let mut bad_addr = listener("c", 3, "r");
    bad_addr.address = Some(sock("not-an-ip", 3));
    let errs = nack(
        &s,
        Kind::Listener,
        &lds(&[
            listener("a", 4, "r"),
            no_chains,
            bad_addr,
            listener("d", 5, "r"),
        ]),
    );
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert_eq!(errs[0], "listener 'b': no filter chains specified");
    assert_eq!(
        errs[1],
        "listener 'c': address: malformed IP address: not-an-ip"
    );
    // The store the push was applied to is untouched.
    assert_eq!(names(&s.listeners), ["old"]);
}

#[test]
fn bad_clusters_routes_and_endpoints_are_all_reported() {
    let mut bad = eds_cluster("x", "");
    bad.lb_policy = 6;
    let mut bad2 = eds_cluster("y", "");
    bad2.connect_timeout = Some(envoy_types::pb::google::protobuf::Duration {
        seconds: -1,
        nanos: 0,
    });
    let errs = nack(
        &Store::default(),
        Kind::Cluster,
        &cds(&[bad, eds_cluster("ok", ""), bad2]),
    );
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert!(
        errs[0].starts_with("cluster 'x': lb_policy CLUSTER_PROVIDED"),
        "{errs:#?}"
    );
    assert!(
        errs[1].starts_with("cluster 'y': connect_timeout"),
        "{errs:#?}"
    );

    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[listener("l", 1, "r")]),
    );
    let mut bad_rc = route_config("r", "c");
    bad_rc.virtual_hosts[0].domains.clear();
    let errs = nack(&s, Kind::Route, &rds(&[bad_rc]));
    assert_eq!(errs, ["route 'r': vhost 'vh': domains must not be empty"]);

    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[eds_cluster("c", "")]),
    );
    let errs = nack(&s, Kind::Endpoint, &eds(&[cla("c", &[("host.local", 80)])]));
    assert_eq!(errs.len(), 1);
    assert!(errs[0].starts_with("endpoints 'c': "), "{errs:#?}");
}

#[test]
fn undecodable_and_mistyped_resources_are_reported_by_index() {
    let good = any(types::LISTENER, &listener("a", 1, "r"));
    let wrong_type = any(types::CLUSTER, &eds_cluster("c", ""));
    let garbage = Any {
        type_url: types::LISTENER.into(),
        value: vec![0xff, 0xff, 0xff],
    };
    let errs = nack(
        &Store::default(),
        Kind::Listener,
        &[good, wrong_type, garbage],
    );
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert_eq!(
        errs[0],
        format!(
            "resource 1: unexpected resource type {}, expected {}",
            types::CLUSTER,
            types::LISTENER
        )
    );
    assert!(
        errs[1].starts_with("resource 2: cannot decode"),
        "{errs:#?}"
    );
}

#[test]
fn two_listeners_on_one_address_are_rejected() {
    let errs = nack(
        &Store::default(),
        Kind::Listener,
        &lds(&[listener("a", 1, "r"), listener("b", 1, "r")]),
    );
    assert_eq!(
        errs,
        ["listener 'b': duplicate address 127.0.0.1:1 as listener 'a'"]
    );
}

#[test]
fn static_resources_cannot_be_replaced_or_removed() {
    let mut s = Store::default();
    s.add_static(
        &[listener("static-l", 1, "r")],
        &[static_cluster(
            "static-c",
            DiscoveryType::Static,
            &[("10.0.0.1", 80)],
        )],
    )
    .unwrap();
    assert!(s.listeners["static-l"].is_static && s.clusters["static-c"].is_static);

    // A wildcard push without them keeps them.
    let s2 = push(&s, Kind::Listener, &lds(&[listener("dyn", 2, "r")]));
    assert_eq!(names(&s2.listeners), ["dyn", "static-l"]);
    let s2 = push(&s, Kind::Cluster, &[]);
    assert_eq!(names(&s2.clusters), ["static-c"]);

    // A push naming them is rejected.
    let errs = nack(&s, Kind::Listener, &lds(&[listener("static-l", 1, "r")]));
    assert_eq!(
        errs,
        ["listener 'static-l': a static resource from the bootstrap cannot be replaced by xDS"]
    );
    let errs = nack(&s, Kind::Cluster, &cds(&[eds_cluster("static-c", "")]));
    assert_eq!(
        errs,
        ["cluster 'static-c': a static resource from the bootstrap cannot be replaced by xDS"]
    );
    // Nor may a dynamic listener take a static listener's address.
    let errs = nack(&s, Kind::Listener, &lds(&[listener("dyn", 1, "r")]));
    assert_eq!(errs.len(), 1);
    assert!(
        errs[0].contains("duplicate address 127.0.0.1:1"),
        "{errs:#?}"
    );
}

#[test]
fn add_static_reports_every_bad_resource() {
    let mut bad_l = listener("bl", 1, "r");
    bad_l.filter_chains.clear();
    let bad_c = static_cluster("bc", DiscoveryType::Static, &[("not-an-ip", 80)]);
    let errs = Store::default().add_static(&[bad_l], &[bad_c]).unwrap_err();
    assert_eq!(errs.len(), 2, "{errs:#?}");
    assert!(
        errs[0].starts_with("static_resources: listener 'bl'"),
        "{errs:#?}"
    );
    assert!(
        errs[1].starts_with("static_resources: cluster 'bc'"),
        "{errs:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Reuse of unchanged translations

#[test]
fn unchanged_resources_keep_their_translation() {
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[listener("a", 1, "r"), listener("b", 2, "r")]),
    );
    let a = s.listeners["a"].value.clone();
    let b = s.listeners["b"].value.clone();
    let s = s
        .apply(
            Kind::Listener,
            "v2",
            &lds(&[listener("a", 1, "r"), listener("b", 2, "r2")]),
        )
        .unwrap();
    assert!(Arc::ptr_eq(&a, &s.listeners["a"].value));
    assert_eq!(
        &*s.listeners["a"].version, "v",
        "an unchanged resource keeps its version"
    );
    assert!(!Arc::ptr_eq(&b, &s.listeners["b"].value));
    assert_eq!(&*s.listeners["b"].version, "v2");
}

// ---------------------------------------------------------------------------------------------
// Assembly, warming and sharing

#[test]
fn complete_store_assembles() {
    let s = full_store();
    let snapshot = snap(&s, &Snapshot::default());
    assert_eq!(snapshot.version, 1);
    assert_eq!(snap_listeners(&snapshot), ["l"]);
    assert_eq!(snap_clusters(&snapshot), ["c"]);
    let l = &snapshot.listeners["l"];
    assert!(Arc::ptr_eq(&l.def, &s.listeners["l"].value));
    assert!(Arc::ptr_eq(&l.chains[0].routes, &s.routes["r"].value));
    let c = &snapshot.clusters["c"];
    assert!(Arc::ptr_eq(&c.def, &s.clusters["c"].value));
    assert!(Arc::ptr_eq(&c.endpoints, &s.endpoints["c"].value));
}

#[test]
fn eds_cluster_without_endpoints_is_warming() {
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[eds_cluster("c", "svc")]),
    );
    let first = snap(&s, &Snapshot::default());
    assert!(first.clusters.is_empty());
    // The assignment is looked up by service_name, not by cluster name.
    let s = push(&s, Kind::Endpoint, &eds(&[cla("svc", &[("10.0.0.1", 80)])]));
    let second = snap(&s, &first);
    assert_eq!(snap_clusters(&second), ["c"]);
}

#[test]
fn eds_cluster_keeps_serving_its_previous_version_while_warming() {
    let s = full_store();
    let first = snap(&s, &Snapshot::default());
    let old = first.clusters["c"].clone();
    // The cluster now wants another assignment, which has not arrived.
    let s = push(&s, Kind::Cluster, &cds(&[eds_cluster("c", "c2")]));
    let second = snap(&s, &first);
    assert!(
        Arc::ptr_eq(&second.clusters["c"], &old),
        "previous version keeps serving"
    );
    assert_eq!(old.def.eds_name, "c");
    // Without a previous snapshot it is not routable.
    assert!(snap(&s, &Snapshot::default()).clusters.is_empty());
    // Once the assignment arrives, the new version takes over.
    let s = push(&s, Kind::Endpoint, &eds(&[cla("c2", &[("10.0.0.2", 80)])]));
    let third = snap(&s, &second);
    assert_eq!(third.clusters["c"].def.eds_name, "c2");
    assert_eq!(
        third.clusters["c"].endpoints.hosts[0].addr.to_string(),
        "10.0.0.2:80"
    );
}

#[test]
fn eds_cluster_with_an_empty_assignment_is_not_warming() {
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[eds_cluster("c", "")]),
    );
    let s = push(&s, Kind::Endpoint, &eds(&[cla("c", &[])]));
    let snapshot = snap(&s, &Snapshot::default());
    assert_eq!(snap_clusters(&snapshot), ["c"]);
    assert!(snapshot.clusters["c"].pick().is_none());
}

#[test]
fn static_cluster_with_literal_endpoints_needs_no_eds() {
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[
            static_cluster("s", DiscoveryType::Static, &[("10.0.0.1", 80)]),
            static_cluster("dns-literal", DiscoveryType::StrictDns, &[("10.0.0.2", 80)]),
            static_cluster("dns", DiscoveryType::StrictDns, &[("backend.local", 80)]),
        ]),
    );
    assert_eq!(
        s.resolved.keys().map(String::as_str).collect::<Vec<_>>(),
        ["dns-literal", "s"]
    );
    let snapshot = snap(&s, &Snapshot::default());
    // The DNS cluster with a hostname warms until the resolver fills `resolved` in.
    assert_eq!(snap_clusters(&snapshot), ["dns-literal", "s"]);
    assert_eq!(
        s.dns_clusters()
            .iter()
            .map(|c| &*c.name)
            .collect::<Vec<_>>(),
        ["dns", "dns-literal"]
    );
    let mut s = s;
    s.resolved.insert(
        "dns".into(),
        Arc::new(LoadAssignment::from_resolved(
            s.clusters["dns"].value.inline.as_ref().unwrap(),
            |_| "10.0.0.3".parse().ok(),
        )),
    );
    let snapshot = snap(&s, &snapshot);
    assert_eq!(snap_clusters(&snapshot), ["dns", "dns-literal", "s"]);
}

#[test]
fn resolved_endpoints_are_reused_when_unchanged() {
    let c = static_cluster("s", DiscoveryType::Static, &[("10.0.0.1", 80)]);
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(std::slice::from_ref(&c)),
    );
    let before = s.resolved["s"].clone();
    // Another cluster changes; this one's endpoints keep their Arc.
    let s = push(&s, Kind::Cluster, &cds(&[c.clone(), eds_cluster("e", "")]));
    assert!(Arc::ptr_eq(&before, &s.resolved["s"]));
    // Its own endpoints change: a new Arc.
    let mut changed = c;
    changed.load_assignment = Some(cla("s", &[("10.0.0.9", 80)]));
    let s = push(&s, Kind::Cluster, &cds(&[changed]));
    assert!(!Arc::ptr_eq(&before, &s.resolved["s"]));
    // Removed clusters lose their endpoints.
    let s = push(&s, Kind::Cluster, &[]);
    assert!(s.resolved.is_empty());
}

#[test]
fn listener_without_routes_is_warming() {
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[listener("l", 1, "r")]),
    );
    let first = snap(&s, &Snapshot::default());
    assert!(first.listeners.is_empty());
    let s = push(&s, Kind::Route, &rds(&[route_config("r", "c")]));
    assert_eq!(snap_listeners(&snap(&s, &first)), ["l"]);
}

#[test]
fn listener_keeps_serving_its_previous_version_while_warming() {
    let s = full_store();
    let first = snap(&s, &Snapshot::default());
    let old = first.listeners["l"].clone();
    // Same address, new route config name that has not arrived.
    let s = push(&s, Kind::Listener, &lds(&[listener("l", 1, "r2")]));
    let second = snap(&s, &first);
    assert!(Arc::ptr_eq(&second.listeners["l"], &old));
    assert!(snap(&s, &Snapshot::default()).listeners.is_empty());
    let s = push(&s, Kind::Route, &rds(&[route_config("r2", "c")]));
    let third = snap(&s, &second);
    assert!(!Arc::ptr_eq(&third.listeners["l"], &old));
    assert!(Arc::ptr_eq(
        &third.listeners["l"].chains[0].routes,
        &s.routes["r2"].value
    ));
}

#[test]
fn moved_listener_does_not_keep_its_old_routes() {
    let s = full_store();
    let first = snap(&s, &Snapshot::default());
    let s = push(&s, Kind::Listener, &lds(&[listener("l", 2, "r2")]));
    assert!(snap(&s, &first).listeners.is_empty());
}

#[test]
fn inline_routes_need_no_rds() {
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[inline_listener("l", 1)]),
    );
    let snapshot = snap(&s, &Snapshot::default());
    assert_eq!(snap_listeners(&snapshot), ["l"]);
    assert_eq!(snapshot.listeners["l"].chains[0].routes.name, "inline");
    assert!(s.wanted_routes().is_empty());
}

#[test]
fn removed_resources_leave_the_snapshot() {
    let s = full_store();
    let first = snap(&s, &Snapshot::default());
    let s = push(&s, Kind::Listener, &[]);
    let s = push(&s, Kind::Cluster, &[]);
    let second = snap(&s, &first);
    assert!(second.listeners.is_empty());
    assert!(second.clusters.is_empty());
}

#[test]
fn unchanged_snapshot_entries_are_shared() {
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[eds_cluster("a", ""), eds_cluster("b", "")]),
    );
    let s = push(
        &s,
        Kind::Endpoint,
        &eds(&[cla("a", &[("10.0.0.1", 80)]), cla("b", &[("10.0.0.2", 80)])]),
    );
    let s = push(
        &s,
        Kind::Listener,
        &lds(&[listener("la", 1, "ra"), listener("lb", 2, "rb")]),
    );
    let s = push(
        &s,
        Kind::Route,
        &rds(&[route_config("ra", "a"), route_config("rb", "b")]),
    );
    let first = snap(&s, &Snapshot::default());

    // Nothing changed: everything is shared.
    let same = snap(&s, &first);
    for (k, v) in &first.clusters {
        assert!(Arc::ptr_eq(v, &same.clusters[k]), "cluster {k}");
    }
    for (k, v) in &first.listeners {
        assert!(Arc::ptr_eq(v, &same.listeners[k]), "listener {k}");
    }

    // New endpoints for 'a' and a new route config for 'rb': only those are rebuilt.
    let s = push(&s, Kind::Endpoint, &eds(&[cla("a", &[("10.0.0.3", 80)])]));
    let s = push(&s, Kind::Route, &rds(&[route_config("rb", "a")]));
    // An identical re-push of 'ra' and of the clusters changes nothing.
    let s = push(&s, Kind::Route, &rds(&[route_config("ra", "a")]));
    let s = push(
        &s,
        Kind::Cluster,
        &cds(&[eds_cluster("a", ""), eds_cluster("b", "")]),
    );
    let next = snap(&s, &same);
    assert!(!Arc::ptr_eq(&same.clusters["a"], &next.clusters["a"]));
    assert!(Arc::ptr_eq(&same.clusters["b"], &next.clusters["b"]));
    assert!(Arc::ptr_eq(&same.listeners["la"], &next.listeners["la"]));
    assert!(!Arc::ptr_eq(&same.listeners["lb"], &next.listeners["lb"]));
    // A rebuilt entry still shares the unchanged part.
    assert!(Arc::ptr_eq(
        &same.clusters["a"].def,
        &next.clusters["a"].def
    ));
    assert!(Arc::ptr_eq(
        &same.listeners["lb"].def,
        &next.listeners["lb"].def
    ));
}

#[test]
fn changed_cluster_definition_rebuilds_the_cluster() {
    let s = full_store();
    let first = snap(&s, &Snapshot::default());
    let mut changed = eds_cluster("c", "");
    changed.lb_policy = 3; // RANDOM
    let s = push(&s, Kind::Cluster, &cds(&[changed]));
    let second = snap(&s, &first);
    assert!(!Arc::ptr_eq(&first.clusters["c"], &second.clusters["c"]));
    assert!(Arc::ptr_eq(
        &first.clusters["c"].endpoints,
        &second.clusters["c"].endpoints
    ));
    assert_eq!(second.clusters["c"].def.policy, crate::lb::Policy::Random);
}

#[test]
fn stats_are_requested_only_for_new_clusters() {
    let s = full_store();
    /// Fresh live state, recording which clusters assembly asked for.
    struct Counting(std::cell::RefCell<Vec<String>>);
    impl LiveClusters for Counting {
        fn stats(&self, cluster: &str) -> Arc<ClusterStats> {
            self.0.borrow_mut().push(cluster.to_string());
            Arc::default()
        }
        fn health_round(&self, _: &str, _: &Arc<ClusterDef>) -> Option<u64> {
            Some(0)
        }
        fn hosts(&self, _: &str, _: &ClusterDef, _: &LoadAssignment) -> HostState {
            HostState::default()
        }
    }
    let live = Counting(Default::default());
    let first = s.assemble(&Snapshot::default(), 1, &live);
    assert_eq!(*live.0.borrow(), ["c"]);
    s.assemble(&first, 2, &live);
    assert_eq!(live.0.borrow().len(), 1);
}

// ---------------------------------------------------------------------------------------------
// Garbage collection and subscriptions

#[test]
fn unreferenced_route_configs_are_collected() {
    let s = full_store();
    assert_eq!(names(&s.routes), ["r"]);
    let s = push(&s, Kind::Listener, &lds(&[listener("l", 1, "r2")]));
    assert!(s.routes.is_empty());
    // A route config nobody asked for is not kept.
    let s = push(
        &s,
        Kind::Route,
        &rds(&[route_config("r2", "c"), route_config("stray", "c")]),
    );
    assert_eq!(names(&s.routes), ["r2"]);
}

#[test]
fn unreferenced_endpoints_are_collected() {
    let s = full_store();
    assert_eq!(names(&s.endpoints), ["c"]);
    let s = push(&s, Kind::Cluster, &cds(&[eds_cluster("c", "other")]));
    assert!(s.endpoints.is_empty());
    let s = push(
        &s,
        Kind::Endpoint,
        &eds(&[cla("other", &[]), cla("stray", &[])]),
    );
    assert_eq!(names(&s.endpoints), ["other"]);
    let s = push(&s, Kind::Cluster, &[]);
    assert!(s.endpoints.is_empty());
}

#[test]
fn wanted_routes_and_endpoints() {
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[
            listener("a", 1, "ra"),
            listener("b", 2, "shared"),
            listener("c", 3, "shared"),
            inline_listener("d", 4),
        ]),
    );
    assert_eq!(
        s.wanted_routes().into_iter().collect::<Vec<_>>(),
        ["ra", "shared"]
    );
    let s = push(
        &s,
        Kind::Cluster,
        &cds(&[
            eds_cluster("e1", ""),
            eds_cluster("e2", "svc2"),
            static_cluster("st", DiscoveryType::Static, &[("10.0.0.1", 80)]),
            static_cluster("dns", DiscoveryType::StrictDns, &[("a.local", 80)]),
        ]),
    );
    assert_eq!(
        s.wanted_endpoints().into_iter().collect::<Vec<_>>(),
        ["e1", "svc2"]
    );
    assert!(Store::default().wanted_routes().is_empty());
    assert!(Store::default().wanted_endpoints().is_empty());
}

#[test]
fn listener_addrs_lists_every_listener() {
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[listener("a", 1, "r"), inline_listener("b", 2)]),
    );
    let addrs = s.listener_addrs();
    assert_eq!(addrs["a"].len(), 1);
    assert_eq!(addrs["a"][0].addr.to_string(), "127.0.0.1:1");
    assert_eq!(addrs["b"][0].addr.to_string(), "127.0.0.1:2");
}

/// `listener(name, port)` also listening on each of `more` (host, port).
fn multi_listener(name: &str, port: u32, more: &[(&str, u32)]) -> ListenerProto {
    let mut l = listener(name, port, "r");
    l.additional_addresses = more
        .iter()
        .map(
            |(h, p)| envoy_types::pb::envoy::config::listener::v3::AdditionalAddress {
                address: Some(corepb::Address {
                    address: Some(corepb::address::Address::SocketAddress(
                        corepb::SocketAddress {
                            address: (*h).into(),
                            port_specifier: Some(corepb::socket_address::PortSpecifier::PortValue(
                                *p,
                            )),
                            ..Default::default()
                        },
                    )),
                }),
                ..Default::default()
            },
        )
        .collect();
    l
}

#[test]
fn listener_addrs_lists_every_address_of_a_listener() {
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[multi_listener("a", 1, &[("::1", 1), ("127.0.0.2", 3)])]),
    );
    let addrs: Vec<String> = s.listener_addrs()["a"]
        .iter()
        .map(|b| b.addr.to_string())
        .collect();
    assert_eq!(addrs, ["127.0.0.1:1", "[::1]:1", "127.0.0.2:3"]);
}

#[test]
fn an_additional_address_another_listener_holds_refuses_the_new_listener_alone() {
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(&[multi_listener("z", 1, &[("::1", 1)])]),
    );
    // "a" is new, its primary address is free, its additional one is z's.
    let a = s
        .update(
            Kind::Listener,
            per_resource::sotw(
                "v2",
                &lds(&[
                    multi_listener("z", 1, &[("::1", 1)]),
                    multi_listener("a", 2, &[("::1", 1)]),
                    listener("b", 3, "r"),
                ]),
            ),
        )
        .expect("decodes");
    assert_eq!(names(&a.store.listeners), ["b", "z"]);
    assert_eq!(
        a.message().as_deref(),
        Some("listener 'a': duplicate address [::1]:1 as listener 'z'")
    );
    // A new listener whose primary address is another's additional one: refused too.
    let errs = nack(
        &s,
        Kind::Listener,
        &lds(&[multi_listener("z", 1, &[("::1", 1)]), listener("c", 1, "r")]),
    );
    assert_eq!(
        errs,
        ["listener 'c': duplicate address 127.0.0.1:1 as listener 'z'"]
    );
    // The holder may drop its additional address, and another listener then take it.
    let s2 = push(
        &s,
        Kind::Listener,
        &lds(&[listener("z", 1, "r"), multi_listener("a", 2, &[("::1", 1)])]),
    );
    assert_eq!(names(&s2.listeners), ["a", "z"]);
    // Port 0 never conflicts (each socket gets its own port), as in Envoy.
    push(
        &Store::default(),
        Kind::Listener,
        &lds(&[
            multi_listener("p", 0, &[("127.0.0.1", 0)]),
            listener("q", 0, "r"),
        ]),
    );
}

// ---------------------------------------------------------------------------------------------
// Incremental EDS: one assignment changes one cluster

/// What `ConfigWorker::commit` does: assemble against the serving snapshot, then start the next
/// round of changes from the committed store.
fn commit(mut s: Store, prev: &Snapshot) -> (Store, Snapshot) {
    let next = snap(&s, prev);
    s.touched = Touched::default();
    (s, next)
}

fn three_clusters() -> (Store, Snapshot) {
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[
            eds_cluster("a", ""),
            eds_cluster("b", ""),
            eds_cluster("c", ""),
        ]),
    );
    let s = push(
        &s,
        Kind::Endpoint,
        &eds(&[
            cla("a", &[("10.0.0.1", 80)]),
            cla("b", &[("10.0.0.2", 80)]),
            cla("c", &[("10.0.0.3", 80)]),
        ]),
    );
    commit(s, &Snapshot::default())
}

#[test]
fn eds_push_of_one_assignment_rebuilds_only_that_cluster() {
    let (s, s1) = three_clusters();
    let next = push(&s, Kind::Endpoint, &eds(&[cla("b", &[("10.0.0.9", 81)])]));
    assert!(!next.touched.all_clusters);
    assert_eq!(next.touched.endpoints, BTreeSet::from(["b".to_string()]));
    let (_, s2) = commit(next, &s1);
    assert!(Arc::ptr_eq(&s1.clusters["a"], &s2.clusters["a"]));
    assert!(Arc::ptr_eq(&s1.clusters["c"], &s2.clusters["c"]));
    assert!(!Arc::ptr_eq(&s1.clusters["b"], &s2.clusters["b"]));
    let hosts: Vec<String> = s2.clusters["b"]
        .endpoints
        .hosts
        .iter()
        .map(|h| h.addr.to_string())
        .collect();
    assert_eq!(hosts, ["10.0.0.9:81"]);
    // Endpoints the push did not carry are kept (EDS is not a wildcard type).
    assert_eq!(
        s2.clusters["a"].endpoints.hosts[0].addr.to_string(),
        "10.0.0.1:80"
    );
}

#[test]
fn eds_assignment_for_an_unknown_cluster_is_dropped() {
    let (s, s1) = three_clusters();
    let next = push(&s, Kind::Endpoint, &eds(&[cla("zz", &[("10.0.0.9", 81)])]));
    assert!(!next.endpoints.contains_key("zz"));
    assert!(next.touched.endpoints.is_empty());
    let (_, s2) = commit(next, &s1);
    assert_eq!(snap_clusters(&s2), ["a", "b", "c"]);
}

#[test]
fn cds_push_after_incremental_commits_still_removes_clusters() {
    let (s, s1) = three_clusters();
    let (s, s2) = commit(
        push(&s, Kind::Endpoint, &eds(&[cla("a", &[("10.0.0.7", 80)])])),
        &s1,
    );
    let next = push(
        &s,
        Kind::Cluster,
        &cds(&[eds_cluster("a", ""), eds_cluster("c", "")]),
    );
    assert!(next.touched.all_clusters);
    let (s, s3) = commit(next, &s2);
    assert_eq!(snap_clusters(&s3), ["a", "c"]);
    assert!(
        !s.endpoints.contains_key("b"),
        "b's assignment is collected with it"
    );
    // Unchanged clusters survive the full pass as the same objects.
    assert!(Arc::ptr_eq(&s2.clusters["a"], &s3.clusters["a"]));
}

#[test]
fn eds_push_reaches_every_cluster_sharing_a_service_name() {
    let s = push(
        &Store::default(),
        Kind::Cluster,
        &cds(&[
            eds_cluster("x", "svc"),
            eds_cluster("y", "svc"),
            eds_cluster("z", ""),
        ]),
    );
    let s = push(
        &s,
        Kind::Endpoint,
        &eds(&[
            cla("svc", &[("10.0.0.1", 80)]),
            cla("z", &[("10.0.0.3", 80)]),
        ]),
    );
    let (s, s1) = commit(s, &Snapshot::default());
    let (_, s2) = commit(
        push(&s, Kind::Endpoint, &eds(&[cla("svc", &[("10.0.0.2", 80)])])),
        &s1,
    );
    for c in ["x", "y"] {
        assert_eq!(
            s2.clusters[c].endpoints.hosts[0].addr.to_string(),
            "10.0.0.2:80"
        );
    }
    assert!(Arc::ptr_eq(&s1.clusters["z"], &s2.clusters["z"]));
}

mod sds {
    use super::*;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tlspb;

    fn sds_listener(name: &str, port: u32, secret: &str) -> ListenerProto {
        let mut l = inline_listener(name, port);
        let ctx = tlspb::DownstreamTlsContext {
            common_tls_context: Some(tlspb::CommonTlsContext {
                tls_certificate_sds_secret_configs: vec![tlspb::SdsSecretConfig {
                    name: secret.into(),
                    sds_config: Some(corepb::ConfigSource {
                        config_source_specifier: Some(
                            corepb::config_source::ConfigSourceSpecifier::Ads(Default::default()),
                        ),
                        ..Default::default()
                    }),
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        l.filter_chains[0].transport_socket = Some(corepb::TransportSocket {
            name: "envoy.transport_sockets.tls".into(),
            config_type: Some(corepb::transport_socket::ConfigType::TypedConfig(any(
                crate::snapshot::tls::DOWNSTREAM_TLS_TYPE,
                &ctx,
            ))),
        });
        l
    }

    fn secret(name: &str, key: Option<&str>) -> Any {
        let k = rcgen::KeyPair::generate().expect("key");
        let c = rcgen::CertificateParams::new(vec!["a.example.com".to_string()])
            .expect("params")
            .self_signed(&k)
            .expect("cert");
        let pem = |s: String| {
            Some(corepb::DataSource {
                specifier: Some(corepb::data_source::Specifier::InlineString(s)),
                ..Default::default()
            })
        };
        let s = tlspb::Secret {
            name: name.into(),
            r#type: Some(tlspb::secret::Type::TlsCertificate(tlspb::TlsCertificate {
                certificate_chain: pem(c.pem()),
                private_key: pem(key.map_or_else(|| k.serialize_pem(), str::to_string)),
                ..Default::default()
            })),
        };
        any(types::SECRET, &s)
    }

    #[test]
    fn a_listener_warms_until_its_secret_arrives_and_reuses_it_after() {
        let s = push(
            &Store::default(),
            Kind::Listener,
            &lds(&[sds_listener("l", 1, "cert")]),
        );
        assert_eq!(s.wanted_secrets().into_iter().collect::<Vec<_>>(), ["cert"]);
        let warming = snap(&s, &Snapshot::default());
        assert!(
            snap_listeners(&warming).is_empty(),
            "no secret yet: warming"
        );
        let s = push(
            &s,
            Kind::Secret,
            &[secret("cert", None), secret("unused", None)],
        );
        assert_eq!(
            names(&s.secrets),
            ["cert"],
            "a secret nothing asks for is dropped"
        );
        let first = snap(&s, &warming);
        let tls = first.listeners["l"].chains[0].tls.clone().expect("serving");
        // Another push leaves the secret alone: the same rustls configs stay.
        let s2 = push(&s, Kind::Route, &rds(&[route_config("other", "c")]));
        let again = snap(&s2, &first);
        assert!(Arc::ptr_eq(
            &tls,
            again.listeners["l"].chains[0]
                .tls
                .as_ref()
                .expect("serving")
        ));
        // A new version (rotation) builds new ones.
        let s3 = push(&s2, Kind::Secret, &[secret("cert", None)]);
        let rotated = snap(&s3, &again);
        assert!(!Arc::ptr_eq(
            &tls,
            rotated.listeners["l"].chains[0]
                .tls
                .as_ref()
                .expect("serving")
        ));
    }

    fn sds_grpc(cluster: &str) -> corepb::ConfigSource {
        corepb::ConfigSource {
            config_source_specifier: Some(
                corepb::config_source::ConfigSourceSpecifier::ApiConfigSource(
                    corepb::ApiConfigSource {
                        api_type: corepb::api_config_source::ApiType::Grpc as i32,
                        grpc_services: vec![corepb::GrpcService {
                            target_specifier: Some(
                                corepb::grpc_service::TargetSpecifier::EnvoyGrpc(
                                    corepb::grpc_service::EnvoyGrpc {
                                        cluster_name: cluster.into(),
                                        ..Default::default()
                                    },
                                ),
                            ),
                            ..Default::default()
                        }],
                        ..Default::default()
                    },
                ),
            ),
            initial_fetch_timeout: Some(Default::default()),
            ..Default::default()
        }
    }

    /// An EDS cluster with Istio's ISTIO_MUTUAL socket: `default` and `ROOTCA` from `sds`.
    fn mtls_cluster(name: &str, sds: &str) -> ClusterProto {
        let mut c = eds_cluster(name, name);
        let cfg = |n: &str| tlspb::SdsSecretConfig {
            name: n.into(),
            sds_config: Some(sds_grpc(sds)),
        };
        let ctx = tlspb::UpstreamTlsContext {
            common_tls_context: Some(tlspb::CommonTlsContext {
                tls_certificate_sds_secret_configs: vec![cfg("default")],
                validation_context_type: Some(
                    tlspb::common_tls_context::ValidationContextType::CombinedValidationContext(
                        tlspb::common_tls_context::CombinedCertificateValidationContext {
                            default_validation_context: Some(Default::default()),
                            validation_context_sds_secret_config: Some(cfg("ROOTCA")),
                            ..Default::default()
                        },
                    ),
                ),
                ..Default::default()
            }),
            ..Default::default()
        };
        c.transport_socket = Some(corepb::TransportSocket {
            name: "envoy.transport_sockets.tls".into(),
            config_type: Some(corepb::transport_socket::ConfigType::TypedConfig(any(
                crate::snapshot::upstream_tls::UPSTREAM_TLS_TYPE,
                &ctx,
            ))),
        });
        c
    }

    fn root(name: &str) -> Any {
        let k = rcgen::KeyPair::generate().expect("key");
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = p.self_signed(&k).expect("ca");
        let s = tlspb::Secret {
            name: name.into(),
            r#type: Some(tlspb::secret::Type::ValidationContext(
                tlspb::CertificateValidationContext {
                    trusted_ca: Some(corepb::DataSource {
                        specifier: Some(corepb::data_source::Specifier::InlineString(ca.pem())),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            )),
        };
        any(types::SECRET, &s)
    }

    /// The bootstrap's sds-grpc: a unix socket, as istio-agent's.
    fn with_sds_grpc() -> Store {
        let mut c = static_cluster("sds-grpc", DiscoveryType::Static, &[]);
        if let Some(la) = &mut c.load_assignment {
            la.endpoints = vec![epb::LocalityLbEndpoints {
                lb_endpoints: vec![epb::LbEndpoint {
                    host_identifier: Some(epb::lb_endpoint::HostIdentifier::Endpoint(
                        epb::Endpoint {
                            address: Some(corepb::Address {
                                address: Some(corepb::address::Address::Pipe(corepb::Pipe {
                                    path: "./var/run/secrets/workload-spiffe-uds/socket".into(),
                                    mode: 0,
                                })),
                            }),
                            ..Default::default()
                        },
                    )),
                    ..Default::default()
                }],
                ..Default::default()
            }];
        }
        let mut s = Store::default();
        s.add_static(&[], &[c])
            .expect("a pipe endpoint is accepted");
        s
    }

    #[track_caller]
    fn sds_push(s: &Store, resources: &[Any]) -> Result<Store, Vec<String>> {
        let source = s.wanted_sds().into_keys().next().expect("an SDS source");
        let applied = s.apply_sds(&source, "s1", resources, &[])?;
        match applied.message() {
            None => Ok(applied.store),
            Some(_) => Err(applied.rejected.into_iter().map(|r| r.message).collect()),
        }
    }

    /// Over delta SDS each secret carries its own version; over state of the world, the
    /// response's.
    #[test]
    fn delta_sds_secrets_keep_their_own_versions() {
        let s = push(
            &with_sds_grpc(),
            Kind::Cluster,
            &cds(&[mtls_cluster("up", "sds-grpc")]),
        );
        let source = s.wanted_sds().into_keys().next().expect("an SDS source");
        let applied = s
            .apply_sds(
                &source,
                "system-7",
                &[secret("default", None), root("ROOTCA")],
                &["d-3".to_string(), "r-9".to_string()],
            )
            .expect("decodes");
        assert!(applied.rejected.is_empty(), "{:?}", applied.rejected);
        let version = |n: &str| applied.store.secrets.get(n).map(|i| i.version.to_string());
        assert_eq!(version("default").as_deref(), Some("d-3"));
        assert_eq!(version("ROOTCA").as_deref(), Some("r-9"));
        let sotw = s
            .apply_sds(&source, "v2", &[secret("default", None)], &[])
            .expect("decodes");
        assert_eq!(
            sotw.store
                .secrets
                .get("default")
                .map(|i| i.version.to_string())
                .as_deref(),
            Some("v2")
        );
    }

    #[test]
    fn a_cluster_warms_until_its_sds_cluster_secrets_arrive_and_rebuilds_on_rotation() {
        let s = push(
            &with_sds_grpc(),
            Kind::Cluster,
            &cds(&[mtls_cluster("up", "sds-grpc")]),
        );
        let s = push(&s, Kind::Endpoint, &eds(&[cla("up", &[("10.0.0.1", 80)])]));
        assert!(s.wanted_secrets().is_empty(), "nothing over ADS");
        let wanted = s.wanted_sds();
        let (source, asked) = wanted.iter().next().expect("one source");
        assert_eq!(source.cluster, "sds-grpc");
        assert_eq!(asked.iter().collect::<Vec<_>>(), ["ROOTCA", "default"]);
        let warming = snap(&s, &Snapshot::default());
        assert!(
            !snap_clusters(&warming).contains(&"up"),
            "no secrets: warming"
        );
        let s = sds_push(&s, &[secret("default", None)]).expect("accepted");
        assert!(
            !snap_clusters(&snap(&s, &warming)).contains(&"up"),
            "one of two"
        );
        let s = sds_push(&s, &[root("ROOTCA"), secret("unasked", None)]).expect("accepted");
        assert_eq!(names(&s.secrets), ["ROOTCA", "default"]);
        assert!(
            !s.versions.contains_key(&Kind::Secret),
            "ADS versions untouched"
        );
        let first = snap(&s, &warming);
        let up = first.clusters.get("up").expect("warm");
        let tls = up.tls_for(0).expect("tls").tls.clone();
        assert!(tls.config.is_some());
        // An endpoint push keeps the built sockets.
        let s = push(&s, Kind::Endpoint, &eds(&[cla("up", &[("10.0.0.2", 80)])]));
        let second = snap(&s, &first);
        let up2 = second.clusters.get("up").expect("warm");
        assert!(Arc::ptr_eq(&up2.tls_for(0).expect("tls").tls, &tls));
        // A rotated certificate: new sockets, pooled apart.
        let s = sds_push(&s, &[secret("default", None)]).expect("accepted");
        let third = snap(&s, &second);
        let rotated = third
            .clusters
            .get("up")
            .and_then(|c| c.tls_for(0))
            .map(|t| t.tls.clone())
            .expect("tls");
        assert!(!Arc::ptr_eq(&rotated, &tls));
        assert_ne!(rotated.group_key, tls.group_key);
        // A bad one is refused by name; the store (so the sockets) stays as it was.
        let errors = sds_push(&s, &[secret("default", Some("nope"))]).expect_err("bad key");
        assert_eq!(
            errors,
            ["secret 'default': tls_certificate: private_key: no private key found"]
        );
        // A CA where the certificate belongs is refused too, naming the secret and cluster.
        let errors = sds_push(&s, &[root("default")]).expect_err("wrong kind");
        assert!(
            errors[0].starts_with(
                "secret 'default': cluster 'up': secret 'default' is used as a client certificate"
            ),
            "{errors:?}"
        );
    }

    #[test]
    fn an_sds_cluster_missing_from_the_bootstrap_is_nacked_naming_it() {
        let errors = nack(
            &with_sds_grpc(),
            Kind::Cluster,
            &cds(&[mtls_cluster("up", "nope")]),
        );
        // One refusal of the cluster, with both reasons.
        assert_eq!(
            errors,
            [
                "cluster 'up': secret 'default': sds_config: gRPC cluster 'nope' is not a static cluster of the bootstrap; \
                 cluster 'up': secret 'ROOTCA': sds_config: gRPC cluster 'nope' is not a static cluster of the bootstrap",
            ]
        );
        // A dynamic cluster of that name does not do either.
        let s = push(
            &with_sds_grpc(),
            Kind::Cluster,
            &cds(&[eds_cluster("nope", "nope")]),
        );
        let errors = nack(
            &s,
            Kind::Cluster,
            &cds(&[eds_cluster("nope", "nope"), mtls_cluster("up", "nope")]),
        );
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("cluster 'up': secret 'default'"),
            "{errors:?}"
        );
    }

    #[test]
    fn a_bad_key_is_nacked_by_secret_name() {
        let s = push(
            &Store::default(),
            Kind::Listener,
            &lds(&[sds_listener("l", 1, "cert")]),
        );
        let errors = nack(&s, Kind::Secret, &[secret("cert", Some("nope"))]);
        assert_eq!(
            errors,
            ["secret 'cert': tls_certificate: private_key: no private key found"]
        );
    }

    #[test]
    fn secret_files_come_from_the_stores_sources() {
        use crate::snapshot::sources::MemorySources;
        let k = rcgen::KeyPair::generate().expect("key");
        let c = rcgen::CertificateParams::new(vec!["a.example.com".to_string()])
            .expect("params")
            .self_signed(&k)
            .expect("cert");
        let file = |p: &str| {
            Some(corepb::DataSource {
                specifier: Some(corepb::data_source::Specifier::Filename(p.into())),
                ..Default::default()
            })
        };
        let secret = any(
            types::SECRET,
            &tlspb::Secret {
                name: "cert".into(),
                r#type: Some(tlspb::secret::Type::TlsCertificate(tlspb::TlsCertificate {
                    certificate_chain: file("/virtual/cert.pem"),
                    private_key: file("/virtual/key.pem"),
                    ..Default::default()
                })),
            },
        );
        let mut s = push(
            &Store::default(),
            Kind::Listener,
            &lds(&[sds_listener("l", 1, "cert")]),
        );
        // The local files: there is no such file, so the secret is refused by its field.
        let errors = nack(&s, Kind::Secret, std::slice::from_ref(&secret));
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].starts_with(
                "secret 'cert': tls_certificate: certificate_chain: cannot read file '/virtual/cert.pem': "
            ),
            "{errors:?}"
        );
        s.sources = crate::xds::sources::Sources::new(
            MemorySources::default()
                .with_file("/virtual/cert.pem", c.pem())
                .with_file("/virtual/key.pem", k.serialize_pem()),
        );
        let s = push(&s, Kind::Secret, &[secret]);
        assert!(s
            .secrets
            .get("cert")
            .is_some_and(|i| i.value.cert.is_some()));
    }
}

#[test]
fn tcp_proxy_listeners_serve_without_routes_or_their_cluster() {
    use crate::snapshot::tcp_proxy::TCP_PROXY_TYPE;
    use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3 as tpb;
    let p = tpb::TcpProxy {
        stat_prefix: "tcp".into(),
        cluster_specifier: Some(tpb::tcp_proxy::ClusterSpecifier::Cluster("not-yet".into())),
        ..Default::default()
    };
    let tcp = ListenerProto {
        name: "tcp".into(),
        address: Some(sock("127.0.0.1", 9)),
        filter_chains: vec![lpb::FilterChain {
            filters: vec![lpb::Filter {
                name: "envoy.filters.network.tcp_proxy".into(),
                config_type: Some(lpb::filter::ConfigType::TypedConfig(any(
                    TCP_PROXY_TYPE,
                    &p,
                ))),
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    let s = push(
        &Store::default(),
        Kind::Listener,
        &lds(std::slice::from_ref(&tcp)),
    );
    // Nothing to wait for: Envoy does not warm a tcp_proxy listener on its cluster.
    assert!(s.wanted_routes().is_empty());
    let first = snap(&s, &Snapshot::default());
    assert_eq!(snap_listeners(&first), ["tcp"]);
    let chain = &first.listeners["tcp"].chains[0];
    assert!(chain.routes.vhosts.is_empty());
    // An unchanged push keeps the very same active chain.
    let s = push(&s, Kind::Listener, &lds(&[tcp]));
    let second = snap(&s, &first);
    assert!(Arc::ptr_eq(&second.listeners["tcp"].chains[0], chain));
}

// ---------------------------------------------------------------------------------------------
// Envoy's acceptance, resource by resource, in state of the world and delta

mod per_resource {
    use super::*;

    pub(super) fn sotw<'a>(version: &'a str, resources: &'a [Any]) -> Push<'a> {
        Push::Sotw { version, resources }
    }

    fn delta<'a>(resources: &'a [(Any, &'a str)], removed: &'a [String]) -> Push<'a> {
        Push::Delta {
            system_version: "sys",
            resources: resources
                .iter()
                .map(|(any, version)| Incoming { any, version })
                .collect(),
            removed,
        }
    }

    fn bad_listener(name: &str, port: u32) -> ListenerProto {
        let mut l = listener(name, port, "r");
        l.filter_chains.clear();
        l
    }

    #[test]
    fn a_bad_listener_is_refused_alone_and_the_rest_of_the_push_applies() {
        let s = push(
            &Store::default(),
            Kind::Listener,
            &lds(&[listener("old", 1, "r"), listener("kept", 2, "r")]),
        );
        // 'kept' changes badly: its last good version stays; 'new' arrives; 'old' is gone.
        let a = s
            .update(
                Kind::Listener,
                sotw(
                    "v2",
                    &lds(&[bad_listener("kept", 2), listener("new", 3, "r")]),
                ),
            )
            .expect("decodes");
        assert_eq!(names(&a.store.listeners), ["kept", "new"]);
        assert!(Arc::ptr_eq(
            &a.store.listeners["kept"].value,
            &s.listeners["kept"].value
        ));
        assert_eq!(&*a.store.listeners["new"].version, "v2");
        assert_eq!(a.rejected.len(), 1);
        assert_eq!(a.rejected[0].name, "kept");
        assert_eq!(
            a.message().as_deref(),
            Some("listener 'kept': no filter chains specified")
        );
        // The NACK carries the last version accepted whole.
        assert_eq!(
            a.store.versions.get(&Kind::Listener),
            s.versions.get(&Kind::Listener)
        );
        let f = &a.store.failures[&(Kind::Listener, "kept".to_string())];
        assert_eq!(f.message, "listener 'kept': no filter chains specified");
        assert_eq!(f.version, "v2");
        assert!(f.config.is_some());
        // Accepted later: the failure is forgotten.
        let b = a
            .store
            .update(
                Kind::Listener,
                sotw("v3", &lds(&[listener("kept", 2, "r")])),
            )
            .expect("decodes");
        assert!(b.rejected.is_empty());
        assert!(b.store.failures.is_empty());
        assert_eq!(b.store.versions[&Kind::Listener], "v3");
    }

    #[test]
    fn a_new_bad_resource_is_left_out_and_its_failure_goes_when_it_does() {
        let a = Store::default()
            .update(
                Kind::Cluster,
                sotw(
                    "v1",
                    &cds(&[eds_cluster("good", ""), {
                        let mut c = eds_cluster("bad", "");
                        c.eds_cluster_config = None;
                        c
                    }]),
                ),
            )
            .expect("decodes");
        assert_eq!(names(&a.store.clusters), ["good"]);
        assert_eq!(a.rejected.len(), 1);
        assert!(a
            .store
            .failures
            .contains_key(&(Kind::Cluster, "bad".into())));
        // A push that no longer names it clears its failure.
        let b = a
            .store
            .update(Kind::Cluster, sotw("v2", &cds(&[eds_cluster("good", "")])))
            .expect("decodes");
        assert!(b.store.failures.is_empty());
    }

    #[test]
    fn an_undecodable_resource_or_a_duplicate_listener_refuses_the_whole_response() {
        let s = push(
            &Store::default(),
            Kind::Listener,
            &lds(&[listener("a", 1, "r")]),
        );
        let garbage = Any {
            type_url: types::LISTENER.into(),
            value: vec![0xff, 0xff, 0xff],
        };
        let mut resources = lds(&[listener("b", 2, "r")]);
        resources.push(garbage);
        let errs = s
            .update(Kind::Listener, sotw("v2", &resources))
            .expect_err("refused whole");
        assert!(errs[0].starts_with("resource 1: cannot decode"), "{errs:?}");
        let errs = s
            .update(
                Kind::Listener,
                sotw("v2", &lds(&[listener("b", 2, "r"), listener("b", 3, "r")])),
            )
            .expect_err("refused whole");
        assert_eq!(
            errs,
            ["listener 'b': duplicate listener name in one response"]
        );
    }

    #[test]
    fn a_new_listener_on_a_taken_address_is_refused_not_the_one_holding_it() {
        let s = push(
            &Store::default(),
            Kind::Listener,
            &lds(&[listener("z", 1, "r")]),
        );
        let a = s
            .update(
                Kind::Listener,
                sotw("v2", &lds(&[listener("z", 1, "r"), listener("a", 1, "r")])),
            )
            .expect("decodes");
        assert_eq!(names(&a.store.listeners), ["z"]);
        assert_eq!(
            a.message().as_deref(),
            Some("listener 'a': duplicate address 127.0.0.1:1 as listener 'z'")
        );
    }

    #[test]
    fn a_route_config_naming_an_unknown_cluster_is_refused_alone() {
        let s = push(
            &Store::default(),
            Kind::Cluster,
            &cds(&[eds_cluster("c", "")]),
        );
        let s = push(
            &s,
            Kind::Listener,
            &lds(&[listener("a", 1, "ra"), listener("b", 2, "rb")]),
        );
        let mut strict = route_config("rb", "missing");
        strict.validate_clusters =
            Some(envoy_types::pb::google::protobuf::BoolValue { value: true });
        let a = s
            .update(
                Kind::Route,
                sotw("v1", &rds(&[route_config("ra", "c"), strict])),
            )
            .expect("decodes");
        assert_eq!(names(&a.store.routes), ["ra"]);
        assert_eq!(a.rejected.len(), 1);
        assert_eq!(a.rejected[0].name, "rb");
    }

    #[test]
    fn delta_adds_and_changes_only_what_it_carries_and_removes_by_name() {
        let s = push(
            &Store::default(),
            Kind::Cluster,
            &cds(&[eds_cluster("a", ""), eds_cluster("b", "")]),
        );
        let before_a = s.clusters["a"].value.clone();
        let c = any(types::CLUSTER, &eds_cluster("c", ""));
        let a = s
            .update(Kind::Cluster, delta(&[(c, "hash-c")], &[]))
            .expect("decodes");
        assert!(a.rejected.is_empty());
        assert_eq!(names(&a.store.clusters), ["a", "b", "c"]);
        assert!(Arc::ptr_eq(&before_a, &a.store.clusters["a"].value));
        // Per-resource versions, and the system version as the type's.
        assert_eq!(&*a.store.clusters["c"].version, "hash-c");
        assert_eq!(&*a.store.clusters["a"].version, "v");
        assert_eq!(a.store.versions[&Kind::Cluster], "sys");
        let removed = vec!["b".to_string(), "never-had".to_string()];
        let b = a
            .store
            .update(Kind::Cluster, delta(&[], &removed))
            .expect("decodes");
        assert_eq!(names(&b.store.clusters), ["a", "c"]);
        let versions: Vec<(&str, &str)> = b.store.dynamic_versions(Kind::Cluster).collect();
        assert_eq!(versions, [("a", "v"), ("c", "hash-c")]);
    }

    #[test]
    fn delta_removals_of_routes_and_endpoints_are_ignored_as_envoy_ignores_them() {
        let s = full_store();
        let removed = vec!["r".to_string()];
        let a = s
            .update(Kind::Route, delta(&[], &removed))
            .expect("decodes");
        assert_eq!(names(&a.store.routes), ["r"]);
        let removed = vec!["c".to_string()];
        let a = s
            .update(Kind::Endpoint, delta(&[], &removed))
            .expect("decodes");
        assert_eq!(names(&a.store.endpoints), ["c"]);
    }

    #[test]
    fn delta_cannot_remove_a_static_resource() {
        let mut s = Store::default();
        s.add_static(
            &[],
            &[static_cluster(
                "xds",
                DiscoveryType::Static,
                &[("127.0.0.1", 1)],
            )],
        )
        .expect("static");
        let removed = vec!["xds".to_string()];
        let a = s
            .update(Kind::Cluster, delta(&[], &removed))
            .expect("decodes");
        assert_eq!(names(&a.store.clusters), ["xds"]);
    }

    #[test]
    fn a_refused_delta_update_of_an_existing_cluster_keeps_the_last_good_one() {
        let s = push(
            &Store::default(),
            Kind::Cluster,
            &cds(&[eds_cluster("a", "")]),
        );
        let mut bad = eds_cluster("a", "");
        bad.eds_cluster_config = None;
        let good = any(types::CLUSTER, &eds_cluster("b", ""));
        let a = s
            .update(
                Kind::Cluster,
                delta(&[(any(types::CLUSTER, &bad), "2"), (good, "2")], &[]),
            )
            .expect("decodes");
        assert_eq!(names(&a.store.clusters), ["a", "b"]);
        assert!(Arc::ptr_eq(
            &s.clusters["a"].value,
            &a.store.clusters["a"].value
        ));
        assert_eq!(a.rejected.len(), 1);
        assert_eq!(
            a.store.versions.get(&Kind::Cluster),
            s.versions.get(&Kind::Cluster)
        );
    }
}
