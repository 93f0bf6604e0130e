//! `ClusterDef::translate` and ClusterLoadAssignment translation.

use super::*;
use crate::snapshot::sources::NoFiles;

use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    ClusterDiscoveryType as CDT, CommonLbConfig, CustomClusterType, DiscoveryType as DT,
    EdsClusterConfig, LbPolicy, TransportSocketMatch,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::UpstreamTlsContext;
use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
    explicit_http_config::ProtocolConfig, ExplicitHttpConfig, UpstreamProtocolOptions,
};
use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::google::protobuf::{Any, Duration as PbDuration, UInt32Value};
use prost::Message;

const TLS_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext";
const RAW_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer";
const HPO_KEY: &str = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions";

// ---------------------------------------------------------------------------------------------
// Builders

fn cluster(name: &str) -> cpb::Cluster {
    cpb::Cluster {
        name: name.into(),
        ..Default::default()
    }
}

fn typed(name: &str, t: DT) -> cpb::Cluster {
    cpb::Cluster {
        cluster_discovery_type: Some(CDT::Type(t as i32)),
        // Envoy refuses an EDS cluster without an EDS config.
        eds_cluster_config: (t == DT::Eds).then(Default::default),
        ..cluster(name)
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

fn lb_endpoint(host: &str, port: u32) -> epb::LbEndpoint {
    epb::LbEndpoint {
        host_identifier: Some(epb::lb_endpoint::HostIdentifier::Endpoint(epb::Endpoint {
            address: Some(sock(host, port)),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn locality(priority: u32, eps: Vec<epb::LbEndpoint>) -> epb::LocalityLbEndpoints {
    epb::LocalityLbEndpoints {
        priority,
        lb_endpoints: eps,
        ..Default::default()
    }
}

fn cla(name: &str, localities: Vec<epb::LocalityLbEndpoints>) -> epb::ClusterLoadAssignment {
    epb::ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: localities,
        ..Default::default()
    }
}

fn with_inline(mut c: cpb::Cluster, la: epb::ClusterLoadAssignment) -> cpb::Cluster {
    c.load_assignment = Some(la);
    c
}

fn socket(name: &str, type_url: &str) -> corepb::TransportSocket {
    corepb::TransportSocket {
        name: name.into(),
        config_type: Some(corepb::transport_socket::ConfigType::TypedConfig(Any {
            type_url: type_url.into(),
            value: if type_url == TLS_TYPE {
                UpstreamTlsContext::default().encode_to_vec()
            } else {
                vec![]
            },
        })),
    }
}

fn ok(c: &cpb::Cluster) -> ClusterDef {
    ClusterDef::translate(c, &NoFiles).unwrap_or_else(|e| panic!("unexpected rejection: {e}"))
}

#[track_caller]
fn rejected(c: &cpb::Cluster, needle: &str) -> String {
    let e = match ClusterDef::translate(c, &NoFiles) {
        Ok(d) => panic!("expected a rejection, got {d:?}"),
        Err(e) => e,
    };
    assert_eq!(e.resource, format!("cluster '{}'", c.name));
    let text = e.to_string();
    assert!(
        text.contains(needle),
        "error {text:?} does not mention {needle:?}"
    );
    text
}

// ---------------------------------------------------------------------------------------------
// ClusterDef

#[test]
fn defaults() {
    let d = ok(&cluster("c"));
    assert_eq!(
        d,
        ClusterDef {
            telemetry: Arc::new(crate::telemetry::UpstreamInfo {
                name: Arc::from("c"),
                observability_name: Arc::from("c"),
                istio: Default::default(),
            }),
            name: Arc::from("c"),
            kind: DiscoveryKind::Static,
            eds_name: "c".into(),
            connect_timeout: Duration::from_secs(5),
            policy: Policy::RoundRobin,
            panic_threshold: 50,
            lb: Default::default(),
            inline: Some(LoadAssignmentSpec::default()),
            http2: false,
            h2_max_streams: i32::MAX as u32,
            keep_header_case: false,
            max_retries: 3,
            retry_budget: None,
            max_connections: 1024,
            max_pending_requests: 1024,
            max_requests: 1024,
            outlier: None,
            dns_family: DnsFamily::Auto,
            idle_timeout: Some(Duration::from_secs(3600)),
            max_requests_per_connection: None,
            max_response_headers: 100,
            max_response_head_bytes: 80 * 1024,
            tcp_keepalive: None,
            health_check: None,
            transport: Default::default(),
            original_dst: None,
            downstream_protocol: false,
            bind: None,
        }
    );
}

#[test]
fn discovery_types() {
    assert_eq!(ok(&typed("c", DT::Static)).kind, DiscoveryKind::Static);
    assert_eq!(
        ok(&typed("c", DT::StrictDns)).kind,
        DiscoveryKind::StrictDns
    );
    let logical = with_inline(
        typed("c", DT::LogicalDns),
        cla("c", vec![locality(0, vec![lb_endpoint("a.local", 80)])]),
    );
    assert_eq!(ok(&logical).kind, DiscoveryKind::LogicalDns);
    let eds = ok(&typed("c", DT::Eds));
    assert_eq!(eds.kind, DiscoveryKind::Eds);
    assert_eq!(eds.inline, None);
}

// ---------------------------------------------------------------------------------------------
// ORIGINAL_DST

fn original_dst_cluster(lb: Option<cpb::cluster::OriginalDstLbConfig>) -> cpb::Cluster {
    cpb::Cluster {
        lb_policy: LbPolicy::ClusterProvided as i32,
        lb_config: lb.map(cpb::cluster::LbConfig::OriginalDstLbConfig),
        ..typed("od", DT::OriginalDst)
    }
}

fn header_config(name: &str, port: Option<u32>) -> Option<cpb::cluster::OriginalDstLbConfig> {
    Some(cpb::cluster::OriginalDstLbConfig {
        use_http_header: true,
        http_header_name: name.into(),
        upstream_port_override: port.map(|value| UInt32Value { value }),
        ..Default::default()
    })
}

#[test]
fn original_dst_clusters_translate() {
    let d = ok(&original_dst_cluster(None));
    assert_eq!(d.kind, DiscoveryKind::OriginalDst);
    // No endpoints to wait for: the cluster is ready at once, as a STATIC one.
    assert_eq!(d.inline, Some(LoadAssignmentSpec::default()));
    assert_eq!(
        d.original_dst,
        Some(OriginalDst {
            header: None,
            port_override: None,
            metadata_field: None
        })
    );
    let d = ok(&original_dst_cluster(header_config("", None)));
    assert_eq!(
        d.original_dst
            .and_then(|o| o.header)
            .as_ref()
            .map(|h| h.as_str()),
        Some("x-envoy-original-dst-host")
    );
    let d = ok(&original_dst_cluster(header_config("X-Target", Some(8080))));
    let od = d.original_dst.expect("original dst");
    assert_eq!(od.header.as_ref().map(|h| h.as_str()), Some("x-target"));
    assert_eq!(od.port_override, Some(8080));
}

#[test]
fn original_dst_checks_are_envoys() {
    let mut c = original_dst_cluster(None);
    c.lb_policy = LbPolicy::RoundRobin as i32;
    rejected(
        &c,
        "lb_policy ROUND_ROBIN is not valid for cluster type ORIGINAL_DST",
    );
    let c = with_inline(original_dst_cluster(None), cla("od", vec![]));
    rejected(
        &c,
        "ORIGINAL_DST clusters must have no load assignment configured",
    );
    let mut lb = header_config("x-target", None);
    if let Some(l) = lb.as_mut() {
        l.use_http_header = false;
    }
    rejected(
        &original_dst_cluster(lb),
        "invalid config http_header_name=x-target and use_http_header is false",
    );
    rejected(
        &original_dst_cluster(header_config("", Some(70000))),
        "upstream_port_override 70000 must be at most 65535",
    );
    rejected(
        &original_dst_cluster(header_config("bad header", None)),
        "http_header_name 'bad header' is not a valid header name",
    );
    let mut c = original_dst_cluster(None);
    c.cleanup_interval = Some(PbDuration::default());
    rejected(&c, "cleanup_interval must be greater than 0s");
    // istiod's inbound clusters: the longest interval there is.
    c.cleanup_interval = Some(PbDuration {
        seconds: 315_576_000_000,
        nanos: 0,
    });
    ok(&c);
}

#[test]
fn original_dst_host_comes_from_the_header_as_envoy_parses_it() {
    let od = OriginalDst {
        header: Some(http::HeaderName::from_static("x-envoy-original-dst-host")),
        port_override: None,
        metadata_field: None,
    };
    let with = |v: &str| {
        let mut h = http::HeaderMap::new();
        h.insert("x-envoy-original-dst-host", v.parse().expect("value"));
        h
    };
    let addr = |s: &str| s.parse::<SocketAddr>().expect("addr");
    assert_eq!(
        od.host(&with("10.1.2.3:8080"), None),
        (Some(addr("10.1.2.3:8080")), false)
    );
    assert_eq!(
        od.host(&with("[::1]:80"), None),
        (Some(addr("[::1]:80")), false)
    );
    for bad in [
        "10.1.2.3",
        "name:80",
        "10.1.2.3:65536",
        "::1:80",
        "[::1]",
        "",
        "010.1.2.3:80",
    ] {
        assert_eq!(od.host(&with(bad), None), (None, true), "{bad}");
    }
    // Missing: not invalid; and a restored destination is used when the header fails.
    let restored = Some(addr("10.9.9.9:443"));
    assert_eq!(od.host(&http::HeaderMap::new(), None), (None, false));
    assert_eq!(
        od.host(&http::HeaderMap::new(), restored),
        (restored, false)
    );
    assert_eq!(od.host(&with("bogus"), restored), (restored, true));
    // Only the first value counts.
    let mut two = with("10.0.0.1:1");
    two.append(
        "x-envoy-original-dst-host",
        "10.0.0.2:2".parse().expect("value"),
    );
    assert_eq!(od.host(&two, None).0, Some(addr("10.0.0.1:1")));
    // upstream_port_override applies to whatever named the host.
    let od = OriginalDst {
        port_override: Some(9),
        ..od
    };
    assert_eq!(
        od.host(&with("10.1.2.3:8080"), None).0,
        Some(addr("10.1.2.3:9"))
    );
    assert_eq!(
        od.host(&http::HeaderMap::new(), restored).0,
        Some(addr("10.9.9.9:9"))
    );
    // Without use_http_header the header counts for nothing.
    let od = OriginalDst {
        header: None,
        port_override: None,
        metadata_field: None,
    };
    assert_eq!(od.host(&with("10.1.2.3:8080"), None), (None, false));
}

#[test]
fn original_dst_picks_share_one_slot_and_count_invalid_headers() {
    let def = Arc::new(ok(&original_dst_cluster(header_config("", None))));
    let c = Cluster::new(
        def.clone(),
        Arc::new(LoadAssignment::default()),
        Arc::new(ClusterStats::default()),
    );
    assert_eq!(c.active.len(), 1);
    assert_eq!(c.pick(), None, "the ordinary balancer has no host");
    let od = def.original_dst.as_ref().expect("original dst");
    let mut h = http::HeaderMap::new();
    h.insert(
        "x-envoy-original-dst-host",
        "127.0.0.1:80".parse().expect("v"),
    );
    assert_eq!(
        c.pick_original_dst(od, &h, None),
        Some((0, "127.0.0.1:80".parse().expect("addr")))
    );
    h.insert("x-envoy-original-dst-host", "nope".parse().expect("v"));
    assert_eq!(c.pick_original_dst(od, &h, None), None);
    assert_eq!(c.pick_original_dst(od, &http::HeaderMap::new(), None), None);
    assert_eq!(
        c.stats
            .original_dst_host_invalid
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert!(c
        .original_dst_tls("127.0.0.1:80".parse().expect("addr"))
        .is_none());
}

#[test]
fn original_dst_with_tls_builds_a_socket_per_named_host() {
    let mut c = original_dst_cluster(header_config("", None));
    c.transport_socket = Some(socket("tls", TLS_TYPE));
    let c = Cluster::new(
        Arc::new(ok(&c)),
        Arc::new(LoadAssignment::default()),
        Arc::new(ClusterStats::default()),
    );
    let addr: SocketAddr = "127.0.0.1:15008".parse().expect("addr");
    let tls = c.original_dst_tls(addr).expect("TLS");
    assert_eq!(tls.addr, addr);
}

#[test]
fn black_hole_cluster_has_no_host() {
    // istiod's BlackHoleCluster: STATIC, no load assignment, ROUND_ROBIN.
    let mut c = typed("BlackHoleCluster", DT::Static);
    c.connect_timeout = Some(PbDuration {
        seconds: 10,
        nanos: 0,
    });
    let def = ok(&c);
    assert_eq!(def.inline, Some(LoadAssignmentSpec::default()));
    let cluster = Cluster::new(
        Arc::new(def),
        Arc::new(LoadAssignment::default()),
        Arc::new(ClusterStats::default()),
    );
    assert_eq!(cluster.pick(), None);
    assert_eq!(cluster.pick_hashed(Some(1)), None);
    assert_eq!(cluster.healthy_count(), 0);
}

// ---------------------------------------------------------------------------------------------
// Fields istiod sets

#[test]
fn upstream_bind_config_picks_the_source_of_the_peers_family() {
    let sa = |a: &str| corepb::SocketAddress {
        address: a.into(),
        port_specifier: Some(corepb::socket_address::PortSpecifier::PortValue(0)),
        ..Default::default()
    };
    let mut c = cluster("c");
    // istiod's inbound passthrough on a dual-stack pod.
    c.upstream_bind_config = Some(corepb::BindConfig {
        source_address: Some(sa("127.0.0.6")),
        extra_source_addresses: vec![corepb::ExtraSourceAddress {
            address: Some(sa("::6")),
            socket_options: None,
        }],
        ..Default::default()
    });
    let bind = ok(&c).bind.expect("bind");
    let v4: SocketAddr = "10.0.0.1:80".parse().expect("addr");
    let v6: SocketAddr = "[fd00::1]:80".parse().expect("addr");
    assert_eq!(bind.for_peer(v4), "127.0.0.6:0".parse().expect("addr"));
    assert_eq!(bind.for_peer(v6), "[::6]:0".parse().expect("addr"));

    let mut same = c.clone();
    if let Some(b) = same.upstream_bind_config.as_mut() {
        b.extra_source_addresses[0].address = Some(sa("127.0.0.7"));
    }
    rejected(
        &same,
        "upstream_bind_config: extra_source_addresses: at most one",
    );
    let mut free = c.clone();
    if let Some(b) = free.upstream_bind_config.as_mut() {
        b.freebind = Some(envoy_types::pb::google::protobuf::BoolValue { value: true });
    }
    rejected(&free, "upstream_bind_config: freebind is not supported");
    let mut name = c.clone();
    if let Some(b) = name.upstream_bind_config.as_mut() {
        b.source_address = Some(sa("localhost"));
    }
    rejected(
        &name,
        "upstream_bind_config: source_address: malformed IP address",
    );
    let mut none = c;
    if let Some(b) = none.upstream_bind_config.as_mut() {
        b.source_address = None;
        b.extra_source_addresses.clear();
    }
    rejected(&none, "upstream_bind_config: source_address is required");
}

fn with_options(mut c: cpb::Cluster, o: HttpProtocolOptions) -> cpb::Cluster {
    c.typed_extension_protocol_options.insert(
        HPO_KEY.into(),
        Any {
            type_url: format!("type.googleapis.com/{HPO_KEY}"),
            value: o.encode_to_vec(),
        },
    );
    c
}

#[test]
fn use_downstream_protocol_config_follows_the_client() {
    use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::UseDownstreamHttpConfig;
    let downstream = |h2: bool| HttpProtocolOptions {
        upstream_protocol_options: Some(UpstreamProtocolOptions::UseDownstreamProtocolConfig(
            UseDownstreamHttpConfig {
                http_protocol_options: Some(Default::default()),
                http2_protocol_options: h2.then(Default::default),
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let d = ok(&with_options(cluster("c"), downstream(true)));
    assert!(d.downstream_protocol && !d.http2);
    // Without HTTP/2 options every request goes upstream as HTTP/1.1.
    let d = ok(&with_options(cluster("c"), downstream(false)));
    assert!(!d.downstream_protocol && !d.http2);
    // The ALPN a socket without its own list offers would depend on the request.
    let mut tls = with_options(cluster("c"), downstream(true));
    tls.transport_socket = Some(socket("tls", TLS_TYPE));
    rejected(
        &tls,
        "use_downstream_protocol_config with a TLS transport socket without alpn_protocols",
    );
    let auto = HttpProtocolOptions {
        upstream_protocol_options: Some(UpstreamProtocolOptions::AutoConfig(Default::default())),
        ..Default::default()
    };
    rejected(
        &with_options(cluster("c"), auto),
        "auto_config is not supported yet",
    );
    let retry = HttpProtocolOptions {
        retry_policy: Some(Default::default()),
        ..Default::default()
    };
    rejected(
        &with_options(cluster("c"), retry),
        "retry_policy is not supported yet",
    );
}

fn filter(name: &str, any: Any) -> cpb::Filter {
    cpb::Filter {
        name: name.into(),
        typed_config: Some(any),
        ..Default::default()
    }
}

/// A TypedStruct naming `type_url`, as istiod wraps Istio's filter configs.
fn typed_struct(type_url: &str) -> Any {
    #[derive(Clone, PartialEq, prost::Message)]
    struct Ts {
        #[prost(string, tag = "1")]
        type_url: String,
    }
    Any {
        type_url: "type.googleapis.com/udpa.type.v1.TypedStruct".into(),
        value: Ts {
            type_url: type_url.into(),
        }
        .encode_to_vec(),
    }
}

#[test]
fn istio_telemetry_filters_are_accepted_and_others_refused() {
    let mx = "type.googleapis.com/envoy.tcp.metadataexchange.config.MetadataExchange";
    let mut c = cluster("c");
    c.filters = vec![
        // Istio 1.18: the config itself ("protocol: istio-peer-exchange").
        filter(
            "istio.metadata_exchange",
            Any {
                type_url: mx.into(),
                value: b"\x0a\x13istio-peer-exchange".to_vec(),
            },
        ),
        // istiod today: wrapped in a TypedStruct.
        filter("istio.metadata_exchange", typed_struct(mx)),
        filter(
            "upstream_hbone_peer_metadata",
            typed_struct(
                "type.googleapis.com/envoy.extensions.network_filters.peer_metadata.UpstreamConfig",
            ),
        ),
    ];
    ok(&c);
    c.filters.push(filter(
        "my.filter",
        Any {
            type_url: "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy"
                .into(),
            value: vec![],
        },
    ));
    rejected(
        &c,
        "filters[3]: didn't find a registered implementation for 'my.filter' with type URL: 'envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy'",
    );
}

#[test]
fn retry_budget_replaces_max_retries() {
    use cpb::circuit_breakers::thresholds::RetryBudget as Pb;
    let with = |b: Pb| {
        let mut c = cluster("c");
        c.circuit_breakers = Some(cpb::CircuitBreakers {
            thresholds: vec![cpb::circuit_breakers::Thresholds {
                retry_budget: Some(b),
                ..Default::default()
            }],
            ..Default::default()
        });
        c
    };
    // istiod's DestinationRule retryBudget with its defaults, as Envoy's.
    let b = ok(&with(Pb::default())).retry_budget.expect("budget");
    assert_eq!(
        b,
        RetryBudget {
            percent: 20.0,
            min_concurrency: 3
        }
    );
    assert_eq!(b.max(0), 3);
    assert_eq!(b.max(19), 3);
    assert_eq!(b.max(24), 4, "20 % of 24 truncated");
    let b = ok(&with(Pb {
        budget_percent: Some(Percent { value: 50.0 }),
        min_retry_concurrency: Some(UInt32Value { value: 0 }),
        budget_interval: Some(PbDuration::default()),
    }))
    .retry_budget
    .expect("budget");
    assert_eq!((b.max(1), b.max(10)), (0, 5));
    rejected(
        &with(Pb {
            budget_percent: Some(Percent { value: 101.0 }),
            ..Default::default()
        }),
        "retry_budget.budget_percent 101 must be in [0, 100]",
    );
    rejected(
        &with(Pb {
            budget_interval: Some(PbDuration {
                seconds: 1,
                nanos: 0,
            }),
            ..Default::default()
        }),
        "retry_budget.budget_interval is not supported yet",
    );
}

#[test]
fn fields_that_would_change_routing_are_refused() {
    let mut c = cluster("c");
    c.lb_subset_config = Some(Default::default());
    rejected(&c, "lb_subset_config is not supported yet");
    let mut c = cluster("c");
    c.common_lb_config = Some(CommonLbConfig {
        ignore_new_hosts_until_first_hc: true,
        ..Default::default()
    });
    rejected(
        &c,
        "common_lb_config.ignore_new_hosts_until_first_hc is not supported yet",
    );
    let mut c = typed("c", DT::StrictDns);
    #[allow(deprecated)]
    {
        c.dns_resolvers = vec![sock("10.0.0.53", 53)];
    }
    rejected(&c, "dns_resolvers is not supported yet");
    let mut c = typed("c", DT::StrictDns);
    #[allow(deprecated)]
    {
        c.dns_refresh_rate = Some(PbDuration::default());
    }
    rejected(&c, "dns_refresh_rate must be at least 1ms");
}

#[test]
fn istiod_dns_settings_are_accepted() {
    use envoy_types::pb::envoy::extensions::network::dns_resolver::cares::v3::CaresDnsResolverConfig;
    let mut c = with_inline(
        typed("c", DT::StrictDns),
        cla(
            "c",
            vec![locality(0, vec![lb_endpoint("zipkin.istio-system", 9411)])],
        ),
    );
    #[allow(deprecated)]
    {
        c.dns_refresh_rate = Some(PbDuration {
            seconds: 60,
            nanos: 0,
        });
        c.respect_dns_ttl = true;
        c.dns_jitter = Some(PbDuration::default());
    }
    c.dns_lookup_family = cpb::cluster::DnsLookupFamily::V4Only as i32;
    let cares = |resolvers: Vec<corepb::Address>| {
        corepb::TypedExtensionConfig {
        name: "envoy.network.dns_resolver.cares".into(),
        typed_config: Some(Any {
            type_url: "type.googleapis.com/envoy.extensions.network.dns_resolver.cares.v3.CaresDnsResolverConfig".into(),
            value: CaresDnsResolverConfig {
                udp_max_queries: Some(UInt32Value { value: 100 }),
                resolvers,
                ..Default::default()
            }
            .encode_to_vec(),
        }),
    }
    };
    c.typed_dns_resolver_config = Some(cares(vec![]));
    assert_eq!(ok(&c).dns_family, DnsFamily::V4Only);
    c.typed_dns_resolver_config = Some(cares(vec![sock("10.0.0.53", 53)]));
    rejected(
        &c,
        "typed_dns_resolver_config (other than the system's resolver) is not supported yet",
    );
}

fn internal_endpoint(id: &str, meta: &[(&str, &str)]) -> epb::LbEndpoint {
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
    let mut ep = lb_endpoint("10.0.0.1", 80);
    if let Some(epb::lb_endpoint::HostIdentifier::Endpoint(e)) = ep.host_identifier.as_mut() {
        e.address = Some(corepb::Address {
            address: Some(corepb::address::Address::EnvoyInternalAddress(
                corepb::EnvoyInternalAddress {
                    address_name_specifier: Some(
                        corepb::envoy_internal_address::AddressNameSpecifier::ServerListenerName(
                            "connect_originate".into(),
                        ),
                    ),
                    endpoint_id: id.into(),
                },
            )),
        });
    }
    let mut m = corepb::Metadata::default();
    m.filter_metadata.insert(
        ORIG_DST_NS.into(),
        Struct {
            fields: meta
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        Value {
                            kind: Some(Kind::StringValue(v.to_string())),
                        },
                    )
                })
                .collect(),
        },
    );
    ep.metadata = Some(m);
    ep
}

#[test]
fn ambient_internal_addresses_translate_with_their_original_destination() {
    let ep = internal_endpoint("10.0.0.1:80", &[("local", "10.0.0.1:80")]);
    let la = LoadAssignment::translate(&cla("c", vec![locality(0, vec![ep])])).expect("valid");
    let h = &la.hosts[0];
    // Keyed by the endpoint id, as Envoy tells internal endpoints apart by it.
    assert_eq!(h.addr, "10.0.0.1:80".parse::<SocketAddr>().expect("addr"));
    let ia = h.internal.as_ref().expect("internal");
    assert_eq!(&*ia.listener, "connect_originate");
    assert_eq!(ia.orig_dst_field("local"), Some("10.0.0.1:80"));
    assert_eq!(ia.envoy_name(), "envoy://connect_originate/10.0.0.1:80");
    // An id that is no address cannot key a host.
    let ep = internal_endpoint("pod-a", &[]);
    let e = LoadAssignment::translate(&cla("c", vec![locality(0, vec![ep])])).expect_err("refused");
    assert!(
        e.to_string()
            .contains("endpoint_id 'pod-a' must be an ip:port"),
        "{e}"
    );
}

fn internal_upstream(
    passthrough: &[(bool, &str)],
    inner: Option<corepb::TransportSocket>,
) -> corepb::TransportSocket {
    use envoy_types::pb::envoy::extensions::transport_sockets::internal_upstream::v3::{
        internal_upstream_transport::MetadataValueSource, InternalUpstreamTransport,
    };
    use envoy_types::pb::envoy::r#type::metadata::v3::{metadata_kind, MetadataKind};
    use prost::Message;
    let t = InternalUpstreamTransport {
        passthrough_metadata: passthrough
            .iter()
            .map(|(host, name)| MetadataValueSource {
                kind: Some(MetadataKind {
                    kind: Some(if *host {
                        metadata_kind::Kind::Host(Default::default())
                    } else {
                        metadata_kind::Kind::Cluster(Default::default())
                    }),
                }),
                name: name.to_string(),
            })
            .collect(),
        transport_socket: inner,
    };
    corepb::TransportSocket {
        name: "envoy.transport_sockets.internal_upstream".into(),
        config_type: Some(corepb::transport_socket::ConfigType::TypedConfig(
            envoy_types::pb::google::protobuf::Any {
                type_url: "type.googleapis.com/envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport".into(),
                value: t.encode_to_vec(),
            },
        )),
    }
}

#[test]
fn internal_upstream_sockets_say_whether_they_pass_the_original_destination() {
    let raw = socket(
        "envoy.transport_sockets.raw_buffer",
        "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer",
    );
    let mut c = cluster("c");
    c.transport_socket = Some(internal_upstream(
        &[(true, ORIG_DST_NS), (false, "istio"), (true, "istio")],
        Some(raw.clone()),
    ));
    let d = ok(&c);
    assert_eq!(
        d.transport.internal(0),
        Some(crate::snapshot::upstream_tls::InternalUpstream {
            passes_orig_dst: true
        })
    );
    assert!(d.transport.default.is_none());
    c.transport_socket = Some(internal_upstream(&[(false, "istio")], Some(raw)));
    assert_eq!(
        ok(&c).transport.internal(0).map(|s| s.passes_orig_dst),
        Some(false)
    );
    c.transport_socket = Some(internal_upstream(&[(false, ORIG_DST_NS)], None));
    rejected(
        &c,
        "the cluster's 'envoy.filters.listener.original_dst' metadata is not supported",
    );
    // TLS inside the tunnel is not implemented.
    let tls = socket(
        "tls",
        "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
    );
    c.transport_socket = Some(internal_upstream(&[(true, ORIG_DST_NS)], Some(tls)));
    rejected(
        &c,
        "TLS inside an internal_upstream socket (TLS over HBONE) is not supported yet",
    );
}

#[test]
fn original_dst_metadata_key_reads_the_internal_connections_metadata() {
    use envoy_types::pb::envoy::r#type::metadata::v3::{
        metadata_key::path_segment::Segment, metadata_key::PathSegment, MetadataKey,
    };
    let key = |k: &str, path: &[&str]| MetadataKey {
        key: k.into(),
        path: path
            .iter()
            .map(|p| PathSegment {
                segment: Some(Segment::Key(p.to_string())),
            })
            .collect(),
    };
    let mut lb = header_config("", Some(15008));
    if let Some(l) = lb.as_mut() {
        l.use_http_header = false;
        l.metadata_key = Some(key(ORIG_DST_NS, &["waypoint"]));
    }
    let od = ok(&original_dst_cluster(lb.clone()))
        .original_dst
        .expect("original dst");
    assert_eq!(od.metadata_field.as_deref(), Some("waypoint"));
    let addr = |s: &str| s.parse::<SocketAddr>().expect("addr");
    let ia = |meta: &[(&str, &str)]| InternalAddr {
        listener: Arc::from("connect_originate"),
        endpoint_id: Arc::from("10.0.0.1:80"),
        orig_dst: meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    let restored = Some(addr("10.0.0.1:80"));
    // The restored destination, with the HBONE port.
    assert_eq!(
        od.internal_host(Some(&ia(&[("local", "10.0.0.1:80")])), restored),
        (Some(addr("10.0.0.1:15008")), false)
    );
    // A waypoint in the metadata comes first.
    assert_eq!(
        od.internal_host(Some(&ia(&[("waypoint", "10.9.9.9:80")])), restored),
        (Some(addr("10.9.9.9:15008")), false)
    );
    assert_eq!(
        od.internal_host(Some(&ia(&[("waypoint", "bogus")])), restored),
        (Some(addr("10.0.0.1:15008")), true)
    );
    // Metadata not passed, nothing restored: no host.
    assert_eq!(od.internal_host(None, None), (None, false));
    for bad in [key("istio", &["waypoint"]), key(ORIG_DST_NS, &["a", "b"])] {
        let mut lb = lb.clone();
        if let Some(l) = lb.as_mut() {
            l.metadata_key = Some(bad);
        }
        rejected(
            &original_dst_cluster(lb),
            "original_dst_lb_config.metadata_key: only one field of 'envoy.filters.listener.original_dst'",
        );
    }
}

/// Every cluster of a real Istio 1.18 sidecar's config dump (`shared/xds-data`): all of them
/// translate, ORIGINAL_DST (passthrough, inbound, headless services) included.
#[test]
fn istio_1_18_dump_clusters_translate() {
    // One decoded descriptor pool for every conversion in this test.
    let _pool = crate::protojson::pool().expect("descriptor pool");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|a| a.join("shared/xds-data"))
        .find(|p| p.is_dir());
    let Some(path) = std::env::var_os("PORTICO_SHARED_DIR")
        .map(|d| std::path::PathBuf::from(d).join("xds-data"))
        .or(root)
        .map(|d| d.join("istio-sidecar/deathstarbench_istio1.18.2_sidecar_config_dump.json"))
    else {
        panic!("shared/xds-data is needed (the shared/ folder beside the repo)");
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let dump: serde_json::Value = serde_json::from_str(&text).expect("json");
    let mut kinds = std::collections::BTreeMap::new();
    let mut total = 0;
    for section in dump["configs"].as_array().expect("configs") {
        for key in [
            "static_clusters",
            "dynamic_active_clusters",
            "dynamic_warming_clusters",
        ] {
            for entry in section[key].as_array().into_iter().flatten() {
                let mut body = entry["cluster"].clone();
                if let Some(o) = body.as_object_mut() {
                    o.remove("@type");
                }
                let c: cpb::Cluster =
                    crate::protojson::from_json("envoy.config.cluster.v3.Cluster", &body)
                        .unwrap_or_else(|e| panic!("{}: {e}", body["name"]));
                let def = ClusterDef::translate(&c, &NoFiles)
                    .unwrap_or_else(|e| panic!("istiod's cluster was refused: {e}"));
                *kinds.entry(format!("{:?}", def.kind)).or_insert(0) += 1;
                total += 1;
            }
        }
    }
    assert_eq!(total, 143);
    assert_eq!(kinds.get("Eds"), Some(&122));
    assert_eq!(kinds.get("OriginalDst"), Some(&15));
}

#[test]
fn unknown_discovery_type_is_rejected() {
    let mut c = cluster("c");
    c.cluster_discovery_type = Some(CDT::Type(42));
    rejected(&c, "type: unknown discovery type 42");
}

#[test]
fn custom_cluster_type_is_rejected() {
    let mut c = cluster("c");
    c.cluster_discovery_type = Some(CDT::ClusterType(CustomClusterType {
        name: "envoy.clusters.aggregate".into(),
        typed_config: None,
    }));
    rejected(
        &c,
        "cluster_type 'envoy.clusters.aggregate' is not supported",
    );
}

#[test]
fn empty_name_is_rejected() {
    let e = ClusterDef::translate(&cluster(""), &NoFiles).unwrap_err();
    assert_eq!(e.to_string(), "cluster '': name must not be empty");
}

#[test]
fn supported_lb_policies() {
    for (p, want) in [
        (LbPolicy::RoundRobin, Policy::RoundRobin),
        (LbPolicy::LeastRequest, Policy::LeastRequest),
        (LbPolicy::Random, Policy::Random),
    ] {
        let mut c = cluster("c");
        c.lb_policy = p as i32;
        assert_eq!(ok(&c).policy, want);
    }
}

#[test]
fn unsupported_lb_policies_are_rejected() {
    for p in [
        LbPolicy::ClusterProvided,
        LbPolicy::LoadBalancingPolicyConfig,
    ] {
        let mut c = cluster("c");
        c.lb_policy = p as i32;
        rejected(
            &c,
            &format!("lb_policy {} is not supported yet", p.as_str_name()),
        );
    }
    let mut c = cluster("c");
    c.lb_policy = 4; // a hole in the enum
    rejected(&c, "lb_policy: unknown value 4");
}

fn typed_lb(names_and_types: &[(&str, &str)]) -> cpb::LoadBalancingPolicy {
    cpb::LoadBalancingPolicy {
        policies: names_and_types
            .iter()
            .map(|(name, ty)| cpb::load_balancing_policy::Policy {
                typed_extension_config: Some(corepb::TypedExtensionConfig {
                    name: name.to_string(),
                    typed_config: Some(Any {
                        type_url: format!("type.googleapis.com/{ty}"),
                        value: vec![],
                    }),
                }),
            })
            .collect(),
    }
}

#[test]
fn typed_load_balancing_policy_first_supported_wins() {
    let mut c = cluster("c");
    c.load_balancing_policy = Some(typed_lb(&[
        (
            "envoy.load_balancing_policies.wrr_locality",
            "envoy.extensions.load_balancing_policies.wrr_locality.v3.WrrLocality",
        ),
        (
            "envoy.load_balancing_policies.least_request",
            "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
        ),
        (
            "envoy.load_balancing_policies.random",
            "envoy.extensions.load_balancing_policies.random.v3.Random",
        ),
    ]));
    assert_eq!(ok(&c).policy, Policy::LeastRequest);
}

#[test]
fn typed_load_balancing_policy_without_a_supported_one_is_rejected() {
    let mut c = cluster("c");
    c.load_balancing_policy = Some(typed_lb(&[(
        "envoy.load_balancing_policies.wrr_locality",
        "envoy.extensions.load_balancing_policies.wrr_locality.v3.WrrLocality",
    )]));
    rejected(
        &c,
        "load_balancing_policy: policies [envoy.load_balancing_policies.wrr_locality] are not supported yet",
    );
}

mod consistent_hashing {
    use super::*;
    use cpb::cluster::common_lb_config::ConsistentHashingLbConfig as LegacyChc;
    use cpb::cluster::ring_hash_lb_config::HashFunction as LegacyFn;
    use cpb::cluster::{LbConfig, MaglevLbConfig, RingHashLbConfig};
    use envoy_types::pb::envoy::extensions::load_balancing_policies::common::v3::ConsistentHashingLbConfig;
    use envoy_types::pb::envoy::extensions::load_balancing_policies::maglev::v3::Maglev;
    use envoy_types::pb::envoy::extensions::load_balancing_policies::ring_hash::v3::{
        ring_hash::HashFunction as TypedFn, RingHash,
    };
    use envoy_types::pb::google::protobuf::UInt64Value;

    fn with(p: LbPolicy, cfg: Option<LbConfig>) -> cpb::Cluster {
        cpb::Cluster {
            lb_policy: p as i32,
            lb_config: cfg,
            ..cluster("c")
        }
    }

    fn u64v(v: u64) -> Option<UInt64Value> {
        Some(UInt64Value { value: v })
    }

    fn ring(min: Option<u64>, max: Option<u64>, f: LegacyFn) -> Option<LbConfig> {
        Some(LbConfig::RingHashLbConfig(RingHashLbConfig {
            minimum_ring_size: min.and_then(u64v),
            maximum_ring_size: max.and_then(u64v),
            hash_function: f as i32,
        }))
    }

    fn maglev(size: u64) -> Option<LbConfig> {
        Some(LbConfig::MaglevLbConfig(MaglevLbConfig {
            table_size: u64v(size),
        }))
    }

    fn typed(name: &str, ty: &str, value: Vec<u8>) -> cpb::Cluster {
        let mut c = cluster("c");
        let mut lb = typed_lb(&[(name, ty)]);
        if let Some(a) = lb.policies[0]
            .typed_extension_config
            .as_mut()
            .and_then(|t| t.typed_config.as_mut())
        {
            a.value = value;
        }
        c.load_balancing_policy = Some(lb);
        c
    }

    const RING: &str = "envoy.extensions.load_balancing_policies.ring_hash.v3.RingHash";
    const MAGLEV: &str = "envoy.extensions.load_balancing_policies.maglev.v3.Maglev";

    #[test]
    fn defaults() {
        assert_eq!(
            ok(&with(LbPolicy::RingHash, None)).policy,
            Policy::RingHash {
                min_ring_size: 1024,
                max_ring_size: 8388608,
                function: HashFunction::XxHash
            }
        );
        assert_eq!(
            ok(&with(LbPolicy::Maglev, None)).policy,
            Policy::Maglev { table_size: 65537 }
        );
        assert_eq!(
            ok(&typed("ring", RING, vec![])).policy,
            Policy::RING_HASH_DEFAULT
        );
        assert_eq!(
            ok(&typed("maglev", MAGLEV, vec![])).policy,
            Policy::MAGLEV_DEFAULT
        );
    }

    #[test]
    fn configured_sizes_and_functions() {
        let c = with(
            LbPolicy::RingHash,
            ring(Some(16), Some(4096), LegacyFn::MurmurHash2),
        );
        assert_eq!(
            ok(&c).policy,
            Policy::RingHash {
                min_ring_size: 16,
                max_ring_size: 4096,
                function: HashFunction::MurmurHash2
            }
        );
        assert_eq!(
            ok(&with(LbPolicy::Maglev, maglev(7))).policy,
            Policy::Maglev { table_size: 7 }
        );
        let r = RingHash {
            hash_function: TypedFn::MurmurHash2 as i32,
            minimum_ring_size: u64v(64),
            ..Default::default()
        };
        assert_eq!(
            ok(&typed("ring", RING, r.encode_to_vec())).policy,
            Policy::RingHash {
                min_ring_size: 64,
                max_ring_size: 8388608,
                function: HashFunction::MurmurHash2
            }
        );
        let m = Maglev {
            table_size: u64v(5_000_011),
            ..Default::default()
        };
        assert_eq!(
            ok(&typed("maglev", MAGLEV, m.encode_to_vec())).policy,
            Policy::Maglev {
                table_size: 5_000_011
            }
        );
    }

    #[test]
    fn every_rejection_reason() {
        let cases: Vec<(cpb::Cluster, &str)> = vec![
            (
                with(LbPolicy::RingHash, ring(Some(2048), Some(1024), LegacyFn::XxHash)),
                "ring_hash_lb_config: ring hash: minimum_ring_size (2048) > maximum_ring_size (1024)",
            ),
            (
                with(LbPolicy::RingHash, ring(None, Some(1000), LegacyFn::XxHash)),
                "minimum_ring_size (1024) > maximum_ring_size (1000)",
            ),
            (
                with(LbPolicy::RingHash, ring(Some(8388609), None, LegacyFn::XxHash)),
                "ring_hash_lb_config: minimum_ring_size 8388609 must be at most 8388608",
            ),
            (
                with(LbPolicy::RingHash, ring(None, Some(8388609), LegacyFn::XxHash)),
                "ring_hash_lb_config: maximum_ring_size 8388609 must be at most 8388608",
            ),
            (
                with(
                    LbPolicy::RingHash,
                    Some(LbConfig::RingHashLbConfig(RingHashLbConfig {
                        hash_function: 7,
                        ..Default::default()
                    })),
                ),
                "ring_hash_lb_config.hash_function: unknown value 7",
            ),
            (
                with(LbPolicy::Maglev, maglev(65536)),
                "maglev_lb_config: The table size of maglev must be prime number",
            ),
            (
                with(LbPolicy::Maglev, maglev(1)),
                "The table size of maglev must be prime number",
            ),
            (
                with(LbPolicy::Maglev, maglev(5_000_012)),
                "maglev_lb_config: table_size 5000012 must be at most 5000011",
            ),
            (
                typed(
                    "maglev",
                    MAGLEV,
                    Maglev {
                        table_size: u64v(100),
                        ..Default::default()
                    }
                    .encode_to_vec(),
                ),
                "load_balancing_policy: Maglev: The table size of maglev must be prime number",
            ),
            (
                typed(
                    "ring",
                    RING,
                    RingHash {
                        minimum_ring_size: u64v(10),
                        maximum_ring_size: u64v(5),
                        ..Default::default()
                    }
                    .encode_to_vec(),
                ),
                "load_balancing_policy: RingHash: ring hash: minimum_ring_size (10) > maximum_ring_size (5)",
            ),
            (
                typed(
                    "ring",
                    RING,
                    RingHash {
                        hash_function: 9,
                        ..Default::default()
                    }
                    .encode_to_vec(),
                ),
                "RingHash: hash_function: unknown value 9",
            ),
            (
                typed("ring", RING, vec![0xff]),
                "load_balancing_policy: RingHash: ",
            ),
            (
                typed(
                    "maglev",
                    MAGLEV,
                    Maglev {
                        consistent_hashing_lb_config: Some(ConsistentHashingLbConfig {
                            use_hostname_for_hashing: true,
                            ..Default::default()
                        }),
                        ..Default::default()
                    }
                    .encode_to_vec(),
                ),
                "Maglev: consistent_hashing_lb_config: use_hostname_for_hashing is not supported yet",
            ),
            (
                typed(
                    "ring",
                    RING,
                    RingHash {
                        consistent_hashing_lb_config: Some(ConsistentHashingLbConfig {
                            hash_balance_factor: Some(UInt32Value { value: 150 }),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }
                    .encode_to_vec(),
                ),
                "hash_balance_factor (bounded load) is not supported yet",
            ),
            (
                typed(
                    "ring",
                    RING,
                    RingHash {
                        consistent_hashing_lb_config: Some(ConsistentHashingLbConfig {
                            hash_policy: vec![Default::default()],
                            ..Default::default()
                        }),
                        ..Default::default()
                    }
                    .encode_to_vec(),
                ),
                "consistent_hashing_lb_config.hash_policy is not supported yet",
            ),
        ];
        for (c, needle) in &cases {
            rejected(c, needle);
        }
        #[allow(deprecated)]
        let deprecated = RingHash {
            use_hostname_for_hashing: true,
            ..Default::default()
        };
        rejected(
            &typed("ring", RING, deprecated.encode_to_vec()),
            "RingHash: use_hostname_for_hashing is not supported yet",
        );
        for p in [LbPolicy::RingHash, LbPolicy::Maglev] {
            let mut c = with(p, None);
            c.common_lb_config = Some(CommonLbConfig {
                consistent_hashing_lb_config: Some(LegacyChc {
                    use_hostname_for_hashing: true,
                    ..Default::default()
                }),
                ..Default::default()
            });
            rejected(
                &c,
                "common_lb_config.consistent_hashing_lb_config: use_hostname_for_hashing is not supported yet",
            );
        }
    }

    fn hosts(n: u16) -> Arc<LoadAssignment> {
        Arc::new(LoadAssignment {
            hosts: (0..n)
                .map(|i| Host {
                    addr: SocketAddr::from(([10, 0, 0, 1], 8000 + i)),
                    weight: 1,
                    health: Health::Healthy,
                    priority: 0,
                    locality: 0,
                    hostname: None,
                    labels: None,
                    internal: None,
                    workload: None,
                })
                .collect(),
            ..Default::default()
        })
    }

    fn built(policy: LbPolicy, la: Arc<LoadAssignment>) -> Cluster {
        let def = Arc::new(ok(&with(policy, None)));
        Cluster::new(def, la, Default::default())
    }

    #[test]
    fn the_same_hash_always_picks_the_same_host() {
        for p in [LbPolicy::RingHash, LbPolicy::Maglev] {
            let c = built(p, hosts(5));
            assert!(c.hashes());
            let mut seen = std::collections::BTreeSet::new();
            for key in 0..200u64 {
                let h = crate::lb::hash::xx64(&key.to_le_bytes(), 0);
                let first = c.pick_hashed(Some(h));
                for _ in 0..5 {
                    assert_eq!(c.pick_hashed(Some(h)), first);
                }
                seen.insert(first.map(|(i, _)| i));
            }
            assert_eq!(seen.len(), 5, "{p:?}: keys spread over every host");
        }
    }

    #[test]
    fn unhealthy_hosts_are_left_out_of_the_ring_and_their_keys_move() {
        // As Envoy: the ring is built over the healthy hosts only, so a key whose host turns
        // unhealthy lands on the next entry of the new ring; the others keep their host.
        for p in [LbPolicy::RingHash, LbPolicy::Maglev] {
            let all = built(p, hosts(5));
            let mut la = Arc::try_unwrap(hosts(5)).expect("not shared");
            la.hosts[2].health = Health::Unhealthy;
            let some = built(p, Arc::new(la));
            let mut moved = 0;
            for key in 0..2000u64 {
                let h = crate::lb::hash::xx64(&key.to_le_bytes(), 0);
                let (before, after) = (all.pick_hashed(Some(h)), some.pick_hashed(Some(h)));
                assert_ne!(after.map(|(i, _)| i), Some(2));
                if before.map(|(i, _)| i) == Some(2) {
                    moved += 1;
                }
            }
            assert!(
                moved > 200,
                "{p:?}: {moved} keys were on the unhealthy host"
            );
        }
    }

    #[test]
    fn the_priority_level_is_chosen_by_hash_modulo_100_as_envoy_does() {
        // P0 at 50% health keeps 70% of the load, P1 takes 30%: hashes with `h % 100 < 70`
        // stay on P0.
        let la = Arc::new(LoadAssignment {
            hosts: [
                (Health::Healthy, 0),
                (Health::Unhealthy, 0),
                (Health::Healthy, 1),
            ]
            .iter()
            .enumerate()
            .map(|(i, (health, priority))| Host {
                addr: SocketAddr::from(([10, 0, 0, 1], 8000 + i as u16)),
                weight: 1,
                health: *health,
                priority: *priority,
                locality: 0,
                hostname: None,
                labels: None,
                internal: None,
                workload: None,
            })
            .collect(),
            ..Default::default()
        });
        let def = Arc::new(ok(&with(LbPolicy::Maglev, None)));
        let c = Cluster::new(def, la, Default::default());
        for h in [0u64, 69, 169, 70, 99, 1070, u64::MAX] {
            let want = if h % 100 < 70 { 0 } else { 2 };
            assert_eq!(
                c.pick_hashed(Some(h)).map(|(i, _)| i),
                Some(want),
                "hash {h}"
            );
        }
    }

    #[test]
    fn no_hash_picks_a_random_host() {
        let c = built(LbPolicy::Maglev, hosts(4));
        let seen: std::collections::BTreeSet<usize> = (0..200)
            .filter_map(|_| c.pick_hashed(None).map(|(i, _)| i))
            .collect();
        assert_eq!(seen.len(), 4);
    }

    #[test]
    fn weights_count() {
        let la = Arc::new(LoadAssignment {
            hosts: (0..2u16)
                .map(|i| Host {
                    addr: SocketAddr::from(([10, 0, 0, 1], 8000 + i)),
                    weight: 1 + 3 * u32::from(i),
                    health: Health::Healthy,
                    priority: 0,
                    locality: 0,
                    hostname: None,
                    labels: None,
                    internal: None,
                    workload: None,
                })
                .collect(),
            ..Default::default()
        });
        for p in [LbPolicy::RingHash, LbPolicy::Maglev] {
            let c = built(p, la.clone());
            let heavy = (0..20_000u64)
                .filter(|k| {
                    let h = crate::lb::hash::xx64(&k.to_le_bytes(), 0);
                    c.pick_hashed(Some(h)).map(|(i, _)| i) == Some(1)
                })
                .count();
            let share = heavy as f64 / 20_000.0;
            assert!(
                (share - 0.8).abs() < 0.04,
                "{p:?}: weight 4 of 5 got {share}"
            );
        }
    }
}

#[test]
fn tls_transport_socket_is_accepted() {
    let mut c = cluster("c");
    c.transport_socket = Some(socket("envoy.transport_sockets.tls", TLS_TYPE));
    let d = ok(&c);
    assert!(d.transport.default.is_some());
    assert!(d
        .transport
        .default
        .as_ref()
        .is_some_and(|t| t.sni.is_none()));
}

#[test]
fn raw_buffer_transport_socket_by_name_or_type_is_accepted() {
    let mut c = cluster("c");
    c.transport_socket = Some(socket("envoy.transport_sockets.raw_buffer", RAW_TYPE));
    ok(&c);
    c.transport_socket = Some(socket("plain", RAW_TYPE));
    ok(&c);
    c.transport_socket = Some(corepb::TransportSocket {
        name: "envoy.transport_sockets.raw_buffer".into(),
        config_type: None,
    });
    ok(&c);
}

#[test]
fn the_typed_config_type_not_the_name_picks_the_socket() {
    let mut c = cluster("c");
    c.transport_socket = Some(socket("envoy.transport_sockets.raw_buffer", TLS_TYPE));
    assert!(ok(&c).transport.default.is_some());
    c.transport_socket = Some(socket(
        "envoy.transport_sockets.tls",
        "type.googleapis.com/x.Y",
    ));
    rejected(&c, "transport_socket: 'envoy.transport_sockets.tls': typed_config type.googleapis.com/x.Y is not supported");
}

#[test]
fn tls_transport_socket_match_is_accepted() {
    let mut c = cluster("c");
    c.transport_socket_matches = vec![
        TransportSocketMatch {
            name: "plain".into(),
            transport_socket: Some(socket("envoy.transport_sockets.raw_buffer", RAW_TYPE)),
            ..Default::default()
        },
        TransportSocketMatch {
            name: "tlsMode-istio".into(),
            transport_socket: Some(socket("envoy.transport_sockets.tls", TLS_TYPE)),
            ..Default::default()
        },
    ];
    let d = ok(&c);
    assert!(d.transport.default.is_none());
    assert!(d.transport.matches[0].socket.is_none());
    assert!(d.transport.matches[1].socket.is_some());
}

#[test]
fn hosts_keep_their_match_metadata_and_clusters_pick_each_hosts_socket() {
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
    let mut c = cluster("c");
    let istio = Struct {
        fields: [(
            "tlsMode".to_string(),
            Value {
                kind: Some(Kind::StringValue("istio".into())),
            },
        )]
        .into_iter()
        .collect(),
    };
    c.transport_socket_matches = vec![TransportSocketMatch {
        name: "tlsMode-istio".into(),
        r#match: Some(istio.clone()),
        transport_socket: Some(socket("envoy.transport_sockets.tls", TLS_TYPE)),
    }];
    let mut la = epb::ClusterLoadAssignment {
        cluster_name: "c".into(),
        ..Default::default()
    };
    let ep = |port: u32| epb::LbEndpoint {
        host_identifier: Some(epb::lb_endpoint::HostIdentifier::Endpoint(epb::Endpoint {
            address: Some(corepb::Address {
                address: Some(corepb::address::Address::SocketAddress(
                    corepb::SocketAddress {
                        address: "10.0.0.1".into(),
                        port_specifier: Some(corepb::socket_address::PortSpecifier::PortValue(
                            port,
                        )),
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        })),
        ..Default::default()
    };
    let mut secure = ep(1);
    let mut meta = corepb::Metadata::default();
    meta.filter_metadata
        .insert("envoy.transport_socket_match".into(), istio);
    secure.metadata = Some(meta);
    la.endpoints = vec![epb::LocalityLbEndpoints {
        lb_endpoints: vec![secure, ep(2)],
        ..Default::default()
    }];
    let la = LoadAssignment::translate(&la).expect("endpoints");
    assert!(la.hosts[0].labels.is_some());
    assert!(la.hosts[1].labels.is_none());
    let cl = Cluster::new(Arc::new(ok(&c)), Arc::new(la), Default::default());
    assert!(cl.tls_for(0).is_some());
    assert!(cl.tls_for(1).is_none());
    // Without matches every host uses the default socket, and no per-host table is kept.
    c.transport_socket_matches.clear();
    c.transport_socket = Some(socket("envoy.transport_sockets.tls", TLS_TYPE));
    let plain = LoadAssignment::translate(&epb::ClusterLoadAssignment {
        cluster_name: "c".into(),
        endpoints: vec![epb::LocalityLbEndpoints {
            lb_endpoints: vec![ep(1), ep(2)],
            ..Default::default()
        }],
        ..Default::default()
    })
    .expect("endpoints");
    let cl = Cluster::new(Arc::new(ok(&c)), Arc::new(plain), Default::default());
    assert!(cl.transport.is_empty());
    assert!(cl.tls_for(0).is_some() && cl.tls_for(1).is_some());
    assert!(cl.tls_for(2).is_none(), "no such host");
}

#[test]
fn connect_timeout_is_kept() {
    let mut c = cluster("c");
    c.connect_timeout = Some(PbDuration {
        seconds: 1,
        nanos: 250_000_000,
    });
    assert_eq!(ok(&c).connect_timeout, Duration::from_millis(1250));
}

#[test]
fn invalid_connect_timeout_is_rejected() {
    for (seconds, nanos) in [(-1, 0), (0, -1), (0, 1_000_000_000)] {
        let mut c = cluster("c");
        c.connect_timeout = Some(PbDuration { seconds, nanos });
        rejected(
            &c,
            &format!("connect_timeout: invalid duration {seconds}s {nanos}ns"),
        );
    }
}

#[test]
fn zero_connect_timeout_is_rejected() {
    let mut c = cluster("c");
    c.connect_timeout = Some(PbDuration {
        seconds: 0,
        nanos: 0,
    });
    rejected(&c, "connect_timeout");
}

#[test]
fn panic_threshold() {
    let mut c = cluster("c");
    c.common_lb_config = Some(CommonLbConfig::default());
    assert_eq!(
        ok(&c).panic_threshold,
        50,
        "unset healthy_panic_threshold means 50%"
    );
    // Envoy rounds it to a whole percent.
    for (v, want) in [(0.0, 0), (12.5, 13), (12.4, 12), (100.0, 100)] {
        c.common_lb_config = Some(CommonLbConfig {
            healthy_panic_threshold: Some(Percent { value: v }),
            ..Default::default()
        });
        assert_eq!(ok(&c).panic_threshold, want);
    }
    for v in [-0.1, 100.5, f64::NAN] {
        c.common_lb_config = Some(CommonLbConfig {
            healthy_panic_threshold: Some(Percent { value: v }),
            ..Default::default()
        });
        rejected(&c, "common_lb_config.healthy_panic_threshold");
    }
}

#[test]
fn eds_service_name() {
    let mut c = typed("c", DT::Eds);
    assert_eq!(ok(&c).eds_name, "c");
    c.eds_cluster_config = Some(EdsClusterConfig {
        service_name: String::new(),
        ..Default::default()
    });
    assert_eq!(ok(&c).eds_name, "c");
    c.eds_cluster_config = Some(EdsClusterConfig {
        service_name: "outbound|80||svc".into(),
        ..Default::default()
    });
    assert_eq!(ok(&c).eds_name, "outbound|80||svc");
    // service_name only matters for EDS clusters.
    let mut s = cluster("s");
    s.eds_cluster_config = c.eds_cluster_config.clone();
    assert_eq!(ok(&s).eds_name, "s");
}

#[test]
fn eds_cluster_ignores_inline_load_assignment() {
    let c = with_inline(
        typed("c", DT::Eds),
        cla("c", vec![locality(0, vec![lb_endpoint("not-an-ip", 0)])]),
    );
    assert_eq!(ok(&c).inline, None);
}

#[test]
fn http2_detection() {
    let mut c = cluster("c");
    #[allow(deprecated)]
    {
        c.http2_protocol_options = Some(Default::default());
    }
    assert!(ok(&c).http2);

    let opts = |pc: ProtocolConfig| {
        let o = HttpProtocolOptions {
            upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
                ExplicitHttpConfig {
                    protocol_config: Some(pc),
                },
            )),
            ..Default::default()
        };
        Any {
            type_url: format!("type.googleapis.com/{HPO_KEY}"),
            value: o.encode_to_vec(),
        }
    };
    let mut c = cluster("c");
    c.typed_extension_protocol_options.insert(
        HPO_KEY.into(),
        opts(ProtocolConfig::Http2ProtocolOptions(Default::default())),
    );
    assert!(ok(&c).http2);
    assert_eq!(ok(&c).h2_max_streams, i32::MAX as u32);
    c.typed_extension_protocol_options.insert(
        HPO_KEY.into(),
        opts(ProtocolConfig::Http2ProtocolOptions(
            envoy_types::pb::envoy::config::core::v3::Http2ProtocolOptions {
                max_concurrent_streams: Some(envoy_types::pb::google::protobuf::UInt32Value {
                    value: 7,
                }),
                ..Default::default()
            },
        )),
    );
    assert_eq!(ok(&c).h2_max_streams, 7);
    c.typed_extension_protocol_options.insert(
        HPO_KEY.into(),
        opts(ProtocolConfig::HttpProtocolOptions(Default::default())),
    );
    assert!(!ok(&c).http2);
    c.typed_extension_protocol_options.insert(
        HPO_KEY.into(),
        Any {
            type_url: String::new(),
            value: vec![0xff],
        },
    );
    // Envoy cannot unpack it either and rejects the cluster.
    rejected(
        &c,
        "expected envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    );
    c.typed_extension_protocol_options.insert(
        HPO_KEY.into(),
        Any {
            type_url: format!("type.googleapis.com/{HPO_KEY}"),
            value: vec![0xff],
        },
    );
    rejected(&c, "cannot decode");
}

#[test]
fn connection_pool_options() {
    use envoy_types::pb::envoy::config::core::v3::{
        HttpProtocolOptions as Common, TcpKeepalive as Ka,
    };
    let d = |secs| {
        Some(envoy_types::pb::google::protobuf::Duration {
            seconds: secs,
            nanos: 0,
        })
    };
    let mut c = cluster("c");
    let o = HttpProtocolOptions {
        common_http_protocol_options: Some(Common {
            idle_timeout: d(30),
            max_requests_per_connection: Some(UInt32Value { value: 2 }),
            ..Default::default()
        }),
        ..Default::default()
    };
    c.typed_extension_protocol_options.insert(
        HPO_KEY.into(),
        Any {
            type_url: format!("type.googleapis.com/{HPO_KEY}"),
            value: o.encode_to_vec(),
        },
    );
    c.upstream_connection_options = Some(cpb::UpstreamConnectionOptions {
        tcp_keepalive: Some(Ka {
            keepalive_time: Some(UInt32Value { value: 60 }),
            ..Default::default()
        }),
        ..Default::default()
    });
    let def = ok(&c);
    assert_eq!(def.idle_timeout, Some(Duration::from_secs(30)));
    assert_eq!(def.max_requests_per_connection, Some(2));
    assert_eq!(
        def.tcp_keepalive,
        Some(TcpKeepalive {
            probes: None,
            time: Some(60),
            interval: None
        })
    );
    // Zero idle timeout: never closed for idleness. The deprecated cluster fields count when
    // the extension does not set them.
    let mut c = cluster("c");
    #[allow(deprecated)]
    {
        c.common_http_protocol_options = Some(Common {
            idle_timeout: d(0),
            ..Default::default()
        });
        c.max_requests_per_connection = Some(UInt32Value { value: 1 });
    }
    let def = ok(&c);
    assert_eq!(def.idle_timeout, None);
    assert_eq!(def.max_requests_per_connection, Some(1));
    // The response head's limits: Envoy's defaults, else the options'.
    assert_eq!(
        (def.max_response_headers, def.max_response_head_bytes),
        (100, 80 * 1024)
    );
    let mut c = cluster("c");
    #[allow(deprecated)]
    {
        c.common_http_protocol_options = Some(Common {
            max_headers_count: Some(UInt32Value { value: 150 }),
            max_response_headers_kb: Some(UInt32Value { value: 96 }),
            ..Default::default()
        });
    }
    let def = ok(&c);
    assert_eq!(
        (def.max_response_headers, def.max_response_head_bytes),
        (150, 96 * 1024)
    );
    for (count, kb, field) in [
        (0, 96, "max_headers_count"),
        (150, 0, "max_response_headers_kb"),
        (150, 8193, "max_response_headers_kb"),
    ] {
        let mut c = cluster("c");
        #[allow(deprecated)]
        {
            c.common_http_protocol_options = Some(Common {
                max_headers_count: Some(UInt32Value { value: count }),
                max_response_headers_kb: Some(UInt32Value { value: kb }),
                ..Default::default()
            });
        }
        rejected(&c, field);
    }
}

// ---------------------------------------------------------------------------------------------
// Inline load_assignment

#[test]
fn static_load_assignment() {
    let mut weighted = lb_endpoint("10.0.0.2", 8080);
    weighted.load_balancing_weight = Some(UInt32Value { value: 7 });
    weighted.health_status = corepb::HealthStatus::Degraded as i32;
    let c = with_inline(
        cluster("c"),
        cla(
            "c",
            vec![
                locality(0, vec![lb_endpoint("10.0.0.1", 80), weighted]),
                locality(1, vec![lb_endpoint("::1", 9000)]),
            ],
        ),
    );
    let got: Vec<(String, u16, u32, Health, u32, u32)> = ok(&c)
        .inline
        .unwrap()
        .endpoints
        .into_iter()
        .map(|e| (e.host, e.port, e.weight, e.health, e.priority, e.locality))
        .collect();
    assert_eq!(
        got,
        vec![
            ("10.0.0.1".to_string(), 80, 1, Health::Healthy, 0, 0),
            ("10.0.0.2".to_string(), 8080, 7, Health::Degraded, 0, 0),
            ("::1".to_string(), 9000, 1, Health::Healthy, 1, 1),
        ]
    );
}

#[test]
fn static_cluster_rejects_hostnames() {
    let c = with_inline(
        cluster("c"),
        cla(
            "c",
            vec![locality(0, vec![lb_endpoint("backend.local", 80)])],
        ),
    );
    let text = rejected(
        &c,
        "load_assignment: endpoints[0].lb_endpoints[0].endpoint.address: malformed IP address: backend.local",
    );
    assert!(text.starts_with("cluster 'c': "), "{text}");
}

#[test]
fn dns_clusters_accept_hostnames() {
    for t in [DT::StrictDns, DT::LogicalDns] {
        let c = with_inline(
            typed("c", t),
            cla(
                "c",
                vec![locality(0, vec![lb_endpoint("backend.local", 80)])],
            ),
        );
        assert_eq!(ok(&c).inline.unwrap().endpoints[0].host, "backend.local");
    }
}

#[test]
fn logical_dns_needs_exactly_one_endpoint() {
    let two = with_inline(
        typed("c", DT::LogicalDns),
        cla(
            "c",
            vec![locality(
                0,
                vec![lb_endpoint("a.local", 80), lb_endpoint("b.local", 80)],
            )],
        ),
    );
    rejected(&two, "LOGICAL_DNS");
    let two_localities = with_inline(
        typed("c", DT::LogicalDns),
        cla(
            "c",
            vec![
                locality(0, vec![lb_endpoint("a.local", 80)]),
                locality(0, vec![lb_endpoint("b.local", 80)]),
            ],
        ),
    );
    rejected(&two_localities, "LOGICAL_DNS");
    rejected(&typed("c", DT::LogicalDns), "LOGICAL_DNS");
}

#[test]
fn endpoint_errors_name_the_position() {
    let bad_weight = epb::LbEndpoint {
        load_balancing_weight: Some(UInt32Value { value: 0 }),
        ..lb_endpoint("10.0.0.1", 80)
    };
    let cases = [
        (bad_weight, "endpoints[1].lb_endpoints[1].load_balancing_weight must be at least 1"),
        (
            lb_endpoint("10.0.0.1", 65536),
            "endpoints[1].lb_endpoints[1].endpoint.address: port_value 65536 out of range",
        ),
        (
            lb_endpoint("", 80),
            "endpoints[1].lb_endpoints[1].endpoint.address: socket_address.address must not be empty",
        ),
        (
            epb::LbEndpoint {
                host_identifier: Some(epb::lb_endpoint::HostIdentifier::EndpointName("ep".into())),
                ..Default::default()
            },
            "endpoints[1].lb_endpoints[1]: endpoint_name is not supported",
        ),
        (epb::LbEndpoint::default(), "endpoints[1].lb_endpoints[1]: endpoint is required"),
        (
            epb::LbEndpoint {
                host_identifier: Some(epb::lb_endpoint::HostIdentifier::Endpoint(epb::Endpoint::default())),
                ..Default::default()
            },
            "endpoints[1].lb_endpoints[1].endpoint.address: socket_address is required",
        ),
    ];
    for (bad, needle) in cases {
        let la = cla(
            "c",
            vec![
                locality(0, vec![lb_endpoint("10.0.0.9", 80)]),
                locality(1, vec![lb_endpoint("10.0.0.8", 80), bad]),
            ],
        );
        rejected(
            &with_inline(cluster("c"), la.clone()),
            &format!("load_assignment: {needle}"),
        );
        let e = LoadAssignment::translate(&la).unwrap_err();
        assert_eq!(e.resource, "endpoints 'c'");
        assert_eq!(e.detail, needle);
    }
}

#[test]
fn health_statuses() {
    use corepb::HealthStatus as HS;
    let cases = [
        (HS::Unknown as i32, Health::Healthy),
        (HS::Healthy as i32, Health::Healthy),
        (HS::Degraded as i32, Health::Degraded),
        (HS::Unhealthy as i32, Health::Unhealthy),
        (HS::Draining as i32, Health::Unhealthy),
        (HS::Timeout as i32, Health::Unhealthy),
        (99, Health::Unhealthy),
    ];
    for (status, want) in cases {
        assert_eq!(health(status), want, "status {status}");
        let mut ep = lb_endpoint("10.0.0.1", 80);
        ep.health_status = status;
        let la = LoadAssignment::translate(&cla("c", vec![locality(0, vec![ep])])).unwrap();
        assert_eq!(la.hosts[0].health, want, "status {status}");
    }
}

// ---------------------------------------------------------------------------------------------
// EDS ClusterLoadAssignment

#[test]
fn eds_load_assignment_translates() {
    let mut ep = lb_endpoint("10.1.0.1", 8080);
    ep.load_balancing_weight = Some(UInt32Value { value: 3 });
    let la = LoadAssignment::translate(&cla(
        "svc",
        vec![
            locality(0, vec![ep]),
            locality(2, vec![lb_endpoint("fe80::1", 443)]),
        ],
    ))
    .unwrap();
    assert_eq!(la.hosts.len(), 2);
    assert_eq!(la.hosts[0].addr, "10.1.0.1:8080".parse().unwrap());
    assert_eq!((la.hosts[0].weight, la.hosts[0].priority), (3, 0));
    assert_eq!(la.hosts[1].addr, "[fe80::1]:443".parse().unwrap());
    assert_eq!((la.hosts[1].weight, la.hosts[1].priority), (1, 2));
}

#[test]
fn eds_rejects_hostnames() {
    let e = LoadAssignment::translate(&cla(
        "svc",
        vec![locality(0, vec![lb_endpoint("backend.local", 80)])],
    ))
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "endpoints 'svc': endpoints[0].lb_endpoints[0].endpoint.address: malformed IP address: backend.local"
    );
}

#[test]
fn empty_eds_load_assignment_has_no_hosts() {
    assert!(LoadAssignment::translate(&cla("svc", vec![]))
        .unwrap()
        .hosts
        .is_empty());
    assert!(
        LoadAssignment::translate(&cla("svc", vec![locality(0, vec![])]))
            .unwrap()
            .hosts
            .is_empty()
    );
}

#[test]
fn from_resolved_skips_unresolvable_hosts() {
    let ep = |host: &str, port, weight, health, priority| SpecEndpoint {
        host: host.into(),
        port,
        weight,
        health,
        priority,
        locality: 0,
        hostname: None,
        labels: None,
        internal: None,
        workload: None,
    };
    let spec = LoadAssignmentSpec {
        endpoints: vec![
            ep("a.local", 80, 2, Health::Healthy, 0),
            ep("b.local", 81, 1, Health::Unhealthy, 1),
        ],
        ..Default::default()
    };
    let la = LoadAssignment::from_resolved(&spec, |h| {
        (h == "b.local").then(|| "10.9.9.9".parse().unwrap())
    });
    assert_eq!(la.hosts.len(), 1);
    assert_eq!(la.hosts[0].addr, "10.9.9.9:81".parse().unwrap());
    assert_eq!(la.hosts[0].health, Health::Unhealthy);
    assert_eq!(la.hosts[0].priority, 1);
}

#[test]
fn cluster_counts_healthy_hosts() {
    let mut unhealthy = lb_endpoint("10.0.0.2", 80);
    unhealthy.health_status = corepb::HealthStatus::Unhealthy as i32;
    let la = LoadAssignment::translate(&cla(
        "c",
        vec![locality(0, vec![lb_endpoint("10.0.0.1", 80), unhealthy])],
    ))
    .unwrap();
    let c = Cluster::new(
        Arc::new(ok(&cluster("c"))),
        Arc::new(la),
        Arc::new(ClusterStats::default()),
    );
    assert_eq!(c.healthy_count(), 1);
    assert_eq!(c.active.len(), 2);
    assert_eq!(c.pick().map(|(i, a)| (i, a.port())), Some((0, 80)));
}

mod lb_options_tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::RuntimeDouble;
    use envoy_types::pb::envoy::extensions::load_balancing_policies::common::v3 as common;
    use envoy_types::pb::envoy::extensions::load_balancing_policies::{
        least_request::v3::LeastRequest, round_robin::v3::RoundRobin,
    };

    fn typed(any: Any) -> cpb::Cluster {
        let mut c = cluster("c");
        c.load_balancing_policy = Some(cpb::LoadBalancingPolicy {
            policies: vec![cpb::load_balancing_policy::Policy {
                typed_extension_config: Some(corepb::TypedExtensionConfig {
                    name: "p".into(),
                    typed_config: Some(any),
                }),
            }],
        });
        c
    }

    fn pack<M: Message + prost::Name>(m: &M) -> Any {
        Any {
            type_url: M::type_url(),
            value: m.encode_to_vec(),
        }
    }

    fn weighted_locality() -> Option<common::LocalityLbConfig> {
        Some(common::LocalityLbConfig {
            locality_config_specifier: Some(
                common::locality_lb_config::LocalityConfigSpecifier::LocalityWeightedLbConfig(
                    Default::default(),
                ),
            ),
        })
    }

    fn window(secs: i64) -> Option<PbDuration> {
        Some(PbDuration {
            seconds: secs,
            nanos: 0,
        })
    }

    #[test]
    fn typed_round_robin_reads_locality_and_slow_start() {
        // As Envoy Gateway renders it.
        let c = typed(pack(&RoundRobin {
            locality_lb_config: weighted_locality(),
            slow_start_config: Some(common::SlowStartConfig {
                slow_start_window: window(300),
                ..Default::default()
            }),
        }));
        let def = ok(&c);
        assert_eq!(def.policy, Policy::RoundRobin);
        assert!(def.lb.locality_weighted);
        assert_eq!(
            def.lb.slow_start,
            Some(crate::lb::SlowStart {
                window: std::time::Duration::from_secs(300),
                aggression: 1.0,
                min_weight: 0.1,
            })
        );
    }

    #[test]
    fn typed_least_request_reads_choice_count_bias_and_slow_start() {
        let c = typed(pack(&LeastRequest {
            choice_count: Some(UInt32Value { value: 5 }),
            active_request_bias: Some(RuntimeDouble {
                default_value: 0.5,
                runtime_key: "k".into(),
            }),
            slow_start_config: Some(common::SlowStartConfig {
                slow_start_window: window(60),
                aggression: Some(RuntimeDouble {
                    default_value: 2.0,
                    runtime_key: "a".into(),
                }),
                min_weight_percent: Some(Percent { value: 25.0 }),
            }),
            ..Default::default()
        }));
        let lb = ok(&c).lb;
        assert_eq!(lb.choice_count, 5);
        assert_eq!(lb.active_request_bias, 0.5);
        assert!(!lb.locality_weighted);
        let s = lb.slow_start.expect("slow start");
        assert_eq!((s.aggression, s.min_weight), (2.0, 0.25));

        let c = typed(pack(&LeastRequest {
            choice_count: Some(UInt32Value { value: 1 }),
            ..Default::default()
        }));
        rejected(
            &c,
            "LeastRequest.choice_count: value must be greater than or equal to 2, got 1",
        );
        let c = typed(pack(&LeastRequest {
            selection_method: 1,
            ..Default::default()
        }));
        rejected(
            &c,
            "LeastRequest.selection_method: only N_CHOICES is supported",
        );
        // A zero window is no slow start; a bad aggression falls back to 1.0, as in Envoy.
        let c = typed(pack(&RoundRobin {
            slow_start_config: Some(common::SlowStartConfig {
                slow_start_window: window(0),
                ..Default::default()
            }),
            ..Default::default()
        }));
        assert_eq!(ok(&c).lb.slow_start, None);
        let c = typed(pack(&RoundRobin {
            slow_start_config: Some(common::SlowStartConfig {
                slow_start_window: window(10),
                aggression: Some(RuntimeDouble {
                    default_value: -1.0,
                    runtime_key: "a".into(),
                }),
                min_weight_percent: None,
            }),
            ..Default::default()
        }));
        assert_eq!(ok(&c).lb.slow_start.map(|s| s.aggression), Some(1.0));
    }

    #[test]
    fn hashing_policies_read_the_locality_setting() {
        use envoy_types::pb::envoy::extensions::load_balancing_policies::maglev::v3::Maglev;
        let c = typed(pack(&Maglev {
            locality_weighted_lb_config: Some(Default::default()),
            ..Default::default()
        }));
        assert!(ok(&c).lb.locality_weighted);
        let c = typed(pack(&Maglev::default()));
        assert!(!ok(&c).lb.locality_weighted);
        let mut c = cluster("c");
        c.lb_policy = cpb::cluster::LbPolicy::RingHash as i32;
        c.common_lb_config = Some(CommonLbConfig {
            locality_config_specifier: Some(
                cpb::cluster::common_lb_config::LocalityConfigSpecifier::LocalityWeightedLbConfig(
                    Default::default(),
                ),
            ),
            ..Default::default()
        });
        assert!(ok(&c).lb.locality_weighted);
    }

    #[test]
    fn legacy_lb_config_and_common_locality_setting() {
        use cpb::cluster::common_lb_config::LocalityConfigSpecifier as L;
        let mut c = cluster("c");
        c.lb_policy = cpb::cluster::LbPolicy::LeastRequest as i32;
        c.common_lb_config = Some(CommonLbConfig {
            locality_config_specifier: Some(L::LocalityWeightedLbConfig(Default::default())),
            ..Default::default()
        });
        c.lb_config = Some(cpb::cluster::LbConfig::LeastRequestLbConfig(
            cpb::cluster::LeastRequestLbConfig {
                choice_count: Some(UInt32Value { value: 3 }),
                slow_start_config: Some(cpb::cluster::SlowStartConfig {
                    slow_start_window: window(30),
                    ..Default::default()
                }),
                ..Default::default()
            },
        ));
        let lb = ok(&c).lb;
        assert!(lb.locality_weighted);
        assert_eq!(lb.choice_count, 3);
        assert_eq!(
            lb.slow_start.map(|s| s.window),
            Some(std::time::Duration::from_secs(30))
        );
        c.lb_config = Some(cpb::cluster::LbConfig::RoundRobinLbConfig(
            cpb::cluster::RoundRobinLbConfig {
                slow_start_config: Some(cpb::cluster::SlowStartConfig {
                    slow_start_window: window(5),
                    min_weight_percent: Some(Percent { value: 150.0 }),
                    ..Default::default()
                }),
            },
        ));
        c.lb_policy = cpb::cluster::LbPolicy::RoundRobin as i32;
        rejected(
            &c,
            "round_robin_lb_config.slow_start_config.min_weight_percent 150 must be in [0, 100]",
        );
    }

    #[test]
    fn endpoints_keep_localities_hostnames_and_the_policy() {
        let mut a = locality(0, vec![lb_endpoint("10.0.0.1", 80)]);
        a.locality = Some(corepb::Locality {
            region: "r".into(),
            zone: "a".into(),
            ..Default::default()
        });
        a.load_balancing_weight = Some(UInt32Value { value: 3 });
        let mut named = lb_endpoint("10.0.0.2", 80);
        if let Some(epb::lb_endpoint::HostIdentifier::Endpoint(e)) = &mut named.host_identifier {
            e.hostname = "pod-b.example".into();
        }
        let mut b = locality(0, vec![named]);
        b.locality = Some(corepb::Locality {
            region: "r".into(),
            zone: "b".into(),
            ..Default::default()
        });
        // The same locality again at the same priority joins the first.
        let mut a2 = locality(0, vec![lb_endpoint("10.0.0.3", 80)]);
        a2.locality = a.locality.clone();
        let mut assignment = cla("c", vec![a, b, a2]);
        assignment.policy = Some(epb::cluster_load_assignment::Policy {
            overprovisioning_factor: Some(UInt32Value { value: 100 }),
            weighted_priority_health: true,
            ..Default::default()
        });
        let la = LoadAssignment::translate(&assignment).expect("valid");
        let locs: Vec<u32> = la.hosts.iter().map(|h| h.locality).collect();
        assert_eq!(locs, vec![0, 1, 0]);
        assert_eq!(la.locality_weights, vec![Some(3), None]);
        assert_eq!(la.hosts[1].hostname.as_deref(), Some("pod-b.example"));
        assert_eq!(la.hosts[0].hostname, None);
        assert_eq!(
            la.policy,
            crate::snapshot::load::LoadPolicy {
                overprovisioning: 100,
                weighted_priority_health: true
            }
        );
        assignment.policy = Some(epb::cluster_load_assignment::Policy {
            overprovisioning_factor: Some(UInt32Value { value: 0 }),
            ..Default::default()
        });
        let e = LoadAssignment::translate(&assignment).expect_err("zero factor");
        assert!(
            e.to_string()
                .contains("policy.overprovisioning_factor must be greater than 0"),
            "{e}"
        );
    }

    #[test]
    fn locality_weighted_clusters_pick_localities_by_weight() {
        let mut a = locality(0, vec![lb_endpoint("10.0.0.1", 80)]);
        a.locality = Some(corepb::Locality {
            zone: "a".into(),
            ..Default::default()
        });
        a.load_balancing_weight = Some(UInt32Value { value: 1 });
        let mut b = locality(0, vec![lb_endpoint("10.0.0.2", 80)]);
        b.locality = Some(corepb::Locality {
            zone: "b".into(),
            ..Default::default()
        });
        b.load_balancing_weight = Some(UInt32Value { value: 4 });
        let la = LoadAssignment::translate(&cla("c", vec![a, b])).expect("valid");
        let mut c = cluster("c");
        c.common_lb_config = Some(CommonLbConfig {
            locality_config_specifier: Some(
                cpb::cluster::common_lb_config::LocalityConfigSpecifier::LocalityWeightedLbConfig(
                    Default::default(),
                ),
            ),
            ..Default::default()
        });
        let built = Cluster::new(Arc::new(ok(&c)), Arc::new(la), Default::default());
        let b_count = (0..500)
            .filter(|_| built.pick().map(|(i, _)| i) == Some(1))
            .count();
        assert_eq!(b_count, 400, "weights 1:4 as a round robin over localities");
        // Without the locality setting the two hosts alternate.
        let la = built.endpoints.clone();
        let plain = Cluster::new(Arc::new(ok(&cluster("c"))), la, Default::default());
        let b_count = (0..500)
            .filter(|_| plain.pick().map(|(i, _)| i) == Some(1))
            .count();
        assert_eq!(b_count, 250);
    }

    #[test]
    fn picks_in_a_panicking_level_are_counted() {
        let mut unhealthy = lb_endpoint("10.0.0.2", 80);
        unhealthy.health_status = corepb::HealthStatus::Unhealthy as i32;
        let la = LoadAssignment::translate(&cla(
            "c",
            vec![locality(
                0,
                vec![lb_endpoint("10.0.0.1", 80), unhealthy.clone(), unhealthy],
            )],
        ))
        .expect("valid");
        let c = Cluster::new(
            Arc::new(ok(&cluster("c"))),
            Arc::new(la),
            Default::default(),
        );
        for _ in 0..10 {
            c.pick();
        }
        assert_eq!(
            c.stats
                .lb_healthy_panic
                .load(std::sync::atomic::Ordering::Relaxed),
            10
        );
    }
}

#[test]
fn header_key_format_keeps_header_case_wherever_the_http1_options_are() {
    use envoy_types::pb::envoy::config::core::v3::{
        http1_protocol_options::{header_key_format::HeaderFormat, HeaderKeyFormat},
        Http1ProtocolOptions,
    };
    use envoy_types::pb::envoy::extensions::upstreams::http::v3::http_protocol_options::{
        explicit_http_config::ProtocolConfig, ExplicitHttpConfig, UseDownstreamHttpConfig,
    };
    let h1 = |keep: bool| Http1ProtocolOptions {
        header_key_format: keep.then(|| HeaderKeyFormat {
            header_format: Some(HeaderFormat::ProperCaseWords(Default::default())),
        }),
        ..Default::default()
    };
    assert!(!ok(&cluster("c")).keep_header_case);
    for keep in [false, true] {
        let explicit = HttpProtocolOptions {
            upstream_protocol_options: Some(UpstreamProtocolOptions::ExplicitHttpConfig(
                ExplicitHttpConfig {
                    protocol_config: Some(ProtocolConfig::HttpProtocolOptions(h1(keep))),
                },
            )),
            ..Default::default()
        };
        assert_eq!(
            ok(&with_options(cluster("c"), explicit)).keep_header_case,
            keep
        );
        let downstream = HttpProtocolOptions {
            upstream_protocol_options: Some(UpstreamProtocolOptions::UseDownstreamProtocolConfig(
                UseDownstreamHttpConfig {
                    http_protocol_options: Some(h1(keep)),
                    ..Default::default()
                },
            )),
            ..Default::default()
        };
        assert_eq!(
            ok(&with_options(cluster("c"), downstream)).keep_header_case,
            keep
        );
        let mut legacy = cluster("c");
        #[allow(deprecated)]
        {
            legacy.http_protocol_options = Some(h1(keep));
        }
        assert_eq!(ok(&legacy).keep_header_case, keep);
    }
}

#[test]
fn sources_and_options_envoy_would_act_on_are_refused_with_their_names() {
    use envoy_types::pb::envoy::extensions::upstreams::http::v3 as hpb;
    // EDS from anywhere but the ADS stream.
    let mut c = typed("c", DT::Eds);
    c.eds_cluster_config = Some(cpb::cluster::EdsClusterConfig {
        eds_config: Some(corepb::ConfigSource {
            config_source_specifier: Some(
                corepb::config_source::ConfigSourceSpecifier::PathConfigSource(
                    corepb::PathConfigSource {
                        path: "/etc/eds.yaml".into(),
                        ..Default::default()
                    },
                ),
            ),
            ..Default::default()
        }),
        ..Default::default()
    });
    rejected(
        &c,
        "eds_cluster_config.eds_config: only ads (or self) is supported",
    );
    c.eds_cluster_config = Some(cpb::cluster::EdsClusterConfig {
        eds_config: Some(corepb::ConfigSource {
            config_source_specifier: Some(corepb::config_source::ConfigSourceSpecifier::Ads(
                Default::default(),
            )),
            ..Default::default()
        }),
        ..Default::default()
    });
    ok(&c);
    // A protocol options name Envoy would apply or refuse.
    let mut c = typed("c", DT::Eds);
    c.typed_extension_protocol_options.insert(
        "envoy.extensions.upstreams.http.v3.Unknown".into(),
        Default::default(),
    );
    rejected(
        &c,
        "typed_extension_protocol_options['envoy.extensions.upstreams.http.v3.Unknown'] is not supported",
    );
    // HTTP/3 upstreams.
    let mut c = typed("c", DT::Eds);
    let h3 = hpb::HttpProtocolOptions {
        upstream_protocol_options: Some(
            hpb::http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                hpb::http_protocol_options::ExplicitHttpConfig {
                    protocol_config: Some(
                        hpb::http_protocol_options::explicit_http_config::ProtocolConfig::Http3ProtocolOptions(
                            Default::default(),
                        ),
                    ),
                },
            ),
        ),
        ..Default::default()
    };
    c.typed_extension_protocol_options.insert(
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".into(),
        envoy_types::util::pack_any(h3),
    );
    rejected(
        &c,
        "http3_protocol_options: HTTP/3 upstreams are not supported",
    );
}

#[test]
fn outlier_detectors_portico_does_not_run_are_refused() {
    use envoy_types::pb::google::protobuf::{BoolValue, UInt32Value};
    let cases: Vec<(cpb::OutlierDetection, &str)> = vec![
        (
            cpb::OutlierDetection {
                enforcing_failure_percentage: Some(UInt32Value { value: 100 }),
                ..Default::default()
            },
            "outlier_detection.enforcing_failure_percentage is not supported",
        ),
        (
            cpb::OutlierDetection {
                always_eject_one_host: Some(BoolValue { value: true }),
                ..Default::default()
            },
            "outlier_detection.always_eject_one_host is not supported",
        ),
        (
            cpb::OutlierDetection {
                max_ejection_time_jitter: Some(envoy_types::pb::google::protobuf::Duration {
                    seconds: 1,
                    nanos: 0,
                }),
                ..Default::default()
            },
            "outlier_detection.max_ejection_time_jitter is not supported",
        ),
    ];
    for (o, needle) in cases {
        let mut c = typed("c", DT::Eds);
        c.outlier_detection = Some(o);
        rejected(&c, needle);
    }
    // Zero enforcement turns the failure-percentage detector off: accepted.
    let mut c = typed("c", DT::Eds);
    c.outlier_detection = Some(cpb::OutlierDetection {
        enforcing_failure_percentage: Some(UInt32Value { value: 0 }),
        ..Default::default()
    });
    ok(&c);
}

#[test]
fn a_per_host_connection_cap_below_the_clusters_is_refused() {
    use envoy_types::pb::google::protobuf::UInt32Value;
    let with = |cluster: Option<u32>, host: u32| {
        let mut c = typed("c", DT::Eds);
        c.circuit_breakers = Some(cpb::CircuitBreakers {
            thresholds: cluster
                .map(|v| cpb::circuit_breakers::Thresholds {
                    max_connections: Some(UInt32Value { value: v }),
                    ..Default::default()
                })
                .into_iter()
                .collect(),
            per_host_thresholds: vec![cpb::circuit_breakers::Thresholds {
                max_connections: Some(UInt32Value { value: host }),
                ..Default::default()
            }],
        });
        c
    };
    // Envoy Gateway's circuit-breaker sample: both 1.
    ok(&with(Some(1), 1));
    ok(&with(None, 2048));
    rejected(
        &with(None, 10),
        "circuit_breakers.per_host_thresholds.max_connections below the cluster's (1024) is not supported",
    );
}

#[test]
fn upstream_http1_options_and_pool_caps_envoy_would_act_on_are_refused() {
    use envoy_types::pb::envoy::extensions::upstreams::http::v3 as hpb;
    let with_h1 = |o: corepb::Http1ProtocolOptions| {
        let mut c = typed("c", DT::Eds);
        let p = hpb::HttpProtocolOptions {
            upstream_protocol_options: Some(
                hpb::http_protocol_options::UpstreamProtocolOptions::ExplicitHttpConfig(
                    hpb::http_protocol_options::ExplicitHttpConfig {
                        protocol_config: Some(
                            hpb::http_protocol_options::explicit_http_config::ProtocolConfig::HttpProtocolOptions(o),
                        ),
                    },
                ),
            ),
            ..Default::default()
        };
        c.typed_extension_protocol_options.insert(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions".into(),
            envoy_types::util::pack_any(p),
        );
        c
    };
    rejected(
        &with_h1(corepb::Http1ProtocolOptions {
            enable_trailers: true,
            ..Default::default()
        }),
        "http_protocol_options.enable_trailers is not supported on a cluster",
    );
    ok(&with_h1(corepb::Http1ProtocolOptions::default()));
    let mut c = typed("c", DT::Eds);
    c.circuit_breakers = Some(cpb::CircuitBreakers {
        thresholds: vec![cpb::circuit_breakers::Thresholds {
            max_connection_pools: Some(envoy_types::pb::google::protobuf::UInt32Value { value: 3 }),
            ..Default::default()
        }],
        ..Default::default()
    });
    rejected(
        &c,
        "circuit_breakers.thresholds.max_connection_pools is not supported",
    );
}
