//! `ListenerDef::translate`: one filter chain, one HTTP connection manager, the router last.

use super::*;
use crate::filters::alpn::{AlpnFilterConfig, AlpnOverrideProto, ALPN_FILTER_TYPE};
use crate::filters::cors::CORS_TYPE;
use crate::filters::fault::FaultFilter;
use crate::filters::telemetry::{TypedStruct, TYPED_STRUCTS, WASM_HTTP_TYPE};
use crate::snapshot::sources::NoFiles;

use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3 as tpb;
use envoy_types::pb::envoy::extensions::transport_sockets::raw_buffer::v3::RawBuffer;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::DownstreamTlsContext;
use envoy_types::pb::google::protobuf::BoolValue;
use hcm::http_connection_manager::{CodecType, RouteSpecifier};

const TLS_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext";
const RAW_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer";

// ---------------------------------------------------------------------------------------------
// Builders

fn any<M: Message>(type_url: &str, m: &M) -> Any {
    Any {
        type_url: type_url.into(),
        value: m.encode_to_vec(),
    }
}

fn address(host: &str, port: u32) -> corepb::Address {
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

fn typed_filter(name: &str, type_url: &str) -> hcm::HttpFilter {
    hcm::HttpFilter {
        name: name.into(),
        config_type: Some(hcm::http_filter::ConfigType::TypedConfig(Any {
            type_url: type_url.into(),
            value: vec![],
        })),
        ..Default::default()
    }
}

fn optional(mut f: hcm::HttpFilter) -> hcm::HttpFilter {
    f.is_optional = true;
    f
}

fn router() -> hcm::HttpFilter {
    hcm::HttpFilter {
        name: "envoy.filters.http.router".into(),
        config_type: Some(hcm::http_filter::ConfigType::TypedConfig(any(
            ROUTER_TYPE,
            &Router::default(),
        ))),
        ..Default::default()
    }
}

fn ads_rds(name: &str) -> RouteSpecifier {
    RouteSpecifier::Rds(hcm::Rds {
        config_source: Some(corepb::ConfigSource {
            config_source_specifier: Some(corepb::config_source::ConfigSourceSpecifier::Ads(
                Default::default(),
            )),
            ..Default::default()
        }),
        route_config_name: name.into(),
    })
}

fn base_hcm() -> hcm::HttpConnectionManager {
    hcm::HttpConnectionManager {
        stat_prefix: "ingress_http".into(),
        route_specifier: Some(ads_rds("routes")),
        http_filters: vec![router()],
        ..Default::default()
    }
}

fn hcm_filter(h: &hcm::HttpConnectionManager) -> lpb::Filter {
    lpb::Filter {
        name: "envoy.filters.network.http_connection_manager".into(),
        config_type: Some(lpb::filter::ConfigType::TypedConfig(any(HCM_TYPE, h))),
    }
}

fn chain(filters: Vec<lpb::Filter>) -> lpb::FilterChain {
    lpb::FilterChain {
        filters,
        ..Default::default()
    }
}

fn listener_with(h: &hcm::HttpConnectionManager) -> lpb::Listener {
    lpb::Listener {
        name: "l".into(),
        address: Some(address("0.0.0.0", 8080)),
        filter_chains: vec![chain(vec![hcm_filter(h)])],
        ..Default::default()
    }
}

fn listener() -> lpb::Listener {
    listener_with(&base_hcm())
}

fn ok(l: &lpb::Listener) -> ListenerDef {
    ListenerDef::translate(l, &NoFiles).unwrap_or_else(|e| panic!("unexpected rejection: {e}"))
}

/// Asserts `l` is rejected with an error naming listener 'l' and mentioning `needle`.
#[track_caller]
fn rejected(l: &lpb::Listener, needle: &str) -> String {
    let e = match ListenerDef::translate(l, &NoFiles) {
        Ok(d) => panic!("expected a rejection, got {d:?}"),
        Err(e) => e,
    };
    assert_eq!(e.resource, format!("listener '{}'", l.name));
    let text = e.to_string();
    assert!(
        text.contains(needle),
        "error {text:?} does not mention {needle:?}"
    );
    text
}

#[track_caller]
fn hcm_rejected(h: hcm::HttpConnectionManager, needle: &str) -> String {
    let text = rejected(&listener_with(&h), needle);
    assert!(
        text.starts_with("listener 'l': http_connection_manager: "),
        "{text}"
    );
    text
}

fn tls_socket(name: &str, type_url: &str) -> corepb::TransportSocket {
    corepb::TransportSocket {
        name: name.into(),
        config_type: Some(corepb::transport_socket::ConfigType::TypedConfig(Any {
            type_url: type_url.into(),
            value: if type_url == TLS_TYPE {
                DownstreamTlsContext::default().encode_to_vec()
            } else {
                RawBuffer::default().encode_to_vec()
            },
        })),
    }
}

// ---------------------------------------------------------------------------------------------
// Accepted listeners

#[test]
fn minimal_listener_translates_with_defaults() {
    let d = ok(&listener());
    assert_eq!(d.name, "l");
    assert_eq!(d.addr, "0.0.0.0:8080".parse().unwrap());
    let h = &d.chains[0].hcm().expect("http chain");
    assert_eq!(h.stat_prefix, "ingress_http");
    assert!(matches!(&h.routes, RouteSource::Rds(n) if n == "routes"));
    assert_eq!(h.codec, Codec::Auto);
    assert!(!h.use_remote_address);
    assert!(!h.skip_xff_append);
    assert!(
        h.generate_request_id,
        "generate_request_id defaults to true"
    );
    assert!(!h.preserve_external_request_id);
    assert!(!h.strip_any_host_port);
    assert!(!h.strip_matching_host_port);
    assert_eq!(h.server_name, "envoy");
    assert_eq!(h.server_transformation, ServerTransformation::Overwrite);
    assert!(!h.keep_header_case, "Envoy writes HTTP/1 names lower case");
}

#[test]
fn via_and_request_id_in_response_are_kept_and_a_bad_via_refused() {
    let mut h = base_hcm();
    h.via = "1.1 portico".into();
    h.always_set_request_id_in_response = true;
    let d = ok(&listener_with(&h));
    let hcm = d.chains[0].hcm().expect("http chain");
    assert_eq!(
        hcm.via.as_ref().map(|v| v.as_bytes()),
        Some(&b"1.1 portico"[..])
    );
    assert!(hcm.always_set_request_id_in_response);
    let d = ok(&listener_with(&base_hcm()));
    let hcm = d.chains[0].hcm().expect("http chain");
    assert!(hcm.via.is_none() && !hcm.always_set_request_id_in_response);
    h.via = "a\nb".into();
    hcm_rejected(h, "via: \"a\\nb\" is not a valid header value");
}

#[test]
fn hcm_fields_that_change_answers_are_refused_with_their_names() {
    use hcm::LocalReplyConfig;
    type Set = fn(&mut hcm::HttpConnectionManager);
    let cases: Vec<(Set, &str)> = vec![
        (
            |h| {
                h.local_reply_config = Some(LocalReplyConfig {
                    mappers: vec![Default::default()],
                    ..Default::default()
                })
            },
            "local_reply_config: mappers and body_format are not supported",
        ),
        (
            |h| h.add_user_agent = Some(BoolValue { value: true }),
            "add_user_agent is not supported",
        ),
        (
            |h| h.proxy_status_config = Some(Default::default()),
            "proxy_status_config is not supported",
        ),
        (
            |h| h.append_local_overload = true,
            "append_local_overload is not supported",
        ),
        (
            |h| h.represent_ipv4_remote_address_as_ipv4_mapped_ipv6 = true,
            "represent_ipv4_remote_address_as_ipv4_mapped_ipv6 is not supported",
        ),
        (
            |h| h.stream_error_on_invalid_http_message = Some(BoolValue { value: true }),
            "stream_error_on_invalid_http_message: only false",
        ),
    ];
    for (set, needle) in cases {
        let mut h = base_hcm();
        set(&mut h);
        hcm_rejected(h, needle);
    }
    // Their defaults, spelled out, are accepted.
    let mut h = base_hcm();
    h.local_reply_config = Some(LocalReplyConfig::default());
    h.add_user_agent = Some(BoolValue { value: false });
    h.stream_error_on_invalid_http_message = Some(BoolValue { value: false });
    ok(&listener_with(&h));
}

#[test]
fn server_header_transformation_is_kept_and_an_undefined_one_refused() {
    use hcm::http_connection_manager::ServerHeaderTransformation as T;
    for (t, want) in [
        (T::Overwrite, ServerTransformation::Overwrite),
        (T::AppendIfAbsent, ServerTransformation::AppendIfAbsent),
        (T::PassThrough, ServerTransformation::PassThrough),
    ] {
        let mut h = base_hcm();
        h.server_header_transformation = t as i32;
        let d = ok(&listener_with(&h));
        let hcm = d.chains[0].hcm().expect("http chain");
        assert_eq!(hcm.server_transformation, want);
    }
    let mut h = base_hcm();
    h.server_header_transformation = 7;
    hcm_rejected(h, "server_header_transformation: 7 is not a defined value");
}

#[test]
fn header_key_format_keeps_header_case() {
    use envoy_types::pb::envoy::config::core::v3::http1_protocol_options::{
        header_key_format::HeaderFormat, HeaderKeyFormat,
    };
    let mut h = base_hcm();
    h.http_protocol_options = Some(Default::default());
    let d = ok(&listener_with(&h));
    assert!(!d.chains[0].hcm().expect("http chain").keep_header_case);
    if let Some(o) = h.http_protocol_options.as_mut() {
        o.header_key_format = Some(HeaderKeyFormat {
            header_format: Some(HeaderFormat::ProperCaseWords(Default::default())),
        });
    }
    let d = ok(&listener_with(&h));
    assert!(d.chains[0].hcm().expect("http chain").keep_header_case);
}

#[test]
fn hcm_options_are_kept() {
    let mut h = base_hcm();
    h.codec_type = CodecType::Http2 as i32;
    h.use_remote_address = Some(BoolValue { value: true });
    h.skip_xff_append = true;
    h.generate_request_id = Some(BoolValue { value: false });
    h.preserve_external_request_id = true;
    h.strip_port_mode = Some(hcm::http_connection_manager::StripPortMode::StripAnyHostPort(true));
    h.strip_matching_host_port = true;
    h.server_name = "portico".into();
    let d = ok(&listener_with(&h));
    assert_eq!(d.chains[0].hcm().expect("http chain").codec, Codec::Http2);
    assert!(d.chains[0].hcm().expect("http chain").use_remote_address);
    assert!(d.chains[0].hcm().expect("http chain").skip_xff_append);
    assert!(!d.chains[0].hcm().expect("http chain").generate_request_id);
    assert!(
        d.chains[0]
            .hcm()
            .expect("http chain")
            .preserve_external_request_id
    );
    assert!(d.chains[0].hcm().expect("http chain").strip_any_host_port);
    assert!(
        d.chains[0]
            .hcm()
            .expect("http chain")
            .strip_matching_host_port
    );
    assert_eq!(
        d.chains[0].hcm().expect("http chain").server_name,
        "portico"
    );

    h.codec_type = CodecType::Http1 as i32;
    h.strip_port_mode = Some(hcm::http_connection_manager::StripPortMode::StripAnyHostPort(false));
    let d = ok(&listener_with(&h));
    assert_eq!(d.chains[0].hcm().expect("http chain").codec, Codec::Http1);
    assert!(!d.chains[0].hcm().expect("http chain").strip_any_host_port);
}

#[test]
fn ipv6_address_and_port_zero() {
    let mut l = listener();
    l.address = Some(address("::1", 0));
    assert_eq!(ok(&l).addr, "[::1]:0".parse().unwrap());
}

fn additional(a: corepb::Address) -> lpb::AdditionalAddress {
    lpb::AdditionalAddress {
        address: Some(a),
        ..Default::default()
    }
}

fn compat(mut a: corepb::Address) -> corepb::Address {
    if let Some(corepb::address::Address::SocketAddress(sa)) = &mut a.address {
        sa.ipv4_compat = true;
    }
    a
}

#[test]
fn additional_addresses_are_bound_with_the_primary_first() {
    // istiod's dual-stack gateway listener: 0.0.0.0:8080 plus [::]:8080.
    let mut l = listener();
    l.additional_addresses = vec![additional(address("::", 8080))];
    let d = ok(&l);
    assert_eq!(d.addr, "0.0.0.0:8080".parse().unwrap());
    let binds: Vec<(String, bool)> = d
        .binds
        .iter()
        .map(|b| (b.addr.to_string(), b.v6only))
        .collect();
    assert_eq!(
        binds,
        [("0.0.0.0:8080".into(), false), ("[::]:8080".into(), true)],
        "an IPv6 address takes IPv6 alone unless ipv4_compat, as Envoy binds it"
    );
    // The stats scope stays the primary address's.
    assert_eq!(d.stat_name, "0.0.0.0_8080");
    // The same chains serve every address.
    assert_eq!(d.chains.len(), 1);
}

#[test]
fn additional_addresses_may_use_other_ports_and_repeat() {
    let mut l = listener();
    l.additional_addresses = vec![
        additional(address("127.0.0.2", 9090)),
        additional(address("0.0.0.0", 8080)),
    ];
    let d = ok(&l);
    let addrs: Vec<String> = d.bind_addrs().iter().map(|b| b.addr.to_string()).collect();
    // Envoy 1.40 accepts an address listed twice (its reuse_port binds both sockets); one
    // socket serves it here.
    assert_eq!(addrs, ["0.0.0.0:8080", "127.0.0.2:9090"]);
    assert_eq!(d.binds.len(), 3);
}

#[test]
fn ipv4_compat_is_checked_against_the_primary_address_as_envoy_does() {
    // `::` as primary with ipv4_compat: accepted, its socket takes IPv4 too.
    let mut l = listener();
    l.address = Some(compat(address("::", 8080)));
    l.additional_addresses = vec![additional(compat(address("::1", 8081)))];
    let d = ok(&l);
    assert!(!d.binds[0].v6only);
    assert!(!d.binds[1].v6only);
    // An IPv4 primary refuses ipv4_compat on an additional `::` (Envoy 1.40's
    // checkIpv4CompatAddress looks at the primary address).
    let mut l = listener();
    l.additional_addresses = vec![additional(compat(address("::", 8080)))];
    rejected(
        &l,
        "additional_addresses[0].address: Only IPv6 address '::' or valid IPv4-mapped IPv6 address can set ipv4_compat: 0.0.0.0:8080",
    );
    let mut l = listener();
    l.address = Some(compat(address("127.0.0.1", 8080)));
    rejected(&l, "address: Only IPv6 address '::'");
    // An IPv4-mapped address may.
    let mut l = listener();
    l.address = Some(compat(address("::ffff:127.0.0.1", 8080)));
    assert!(!ok(&l).binds[0].v6only);
}

#[test]
fn additional_addresses_that_cannot_be_bound_are_refused() {
    let mut l = listener();
    l.additional_addresses = vec![lpb::AdditionalAddress::default()];
    rejected(&l, "additional_addresses[0].address is required");
    let mut l = listener();
    let mut udp = address("127.0.0.1", 8081);
    if let Some(corepb::address::Address::SocketAddress(sa)) = &mut udp.address {
        sa.protocol = corepb::socket_address::Protocol::Udp as i32;
    }
    l.additional_addresses = vec![additional(address("::", 8080)), additional(udp)];
    rejected(&l, "has different socket type");
    let mut l = listener();
    l.additional_addresses = vec![additional(address("not-an-ip", 8080))];
    rejected(
        &l,
        "additional_addresses[0].address: malformed IP address: not-an-ip",
    );
    let mut l = listener();
    l.additional_addresses = vec![additional(corepb::Address {
        address: Some(corepb::address::Address::Pipe(corepb::Pipe {
            path: "/tmp/x".into(),
            mode: 0,
        })),
    })];
    rejected(
        &l,
        "additional_addresses[0].address: pipe address '/tmp/x' is not supported",
    );
}

#[test]
fn same_addresses_ignores_order_and_repeats() {
    let mut a = listener();
    a.additional_addresses = vec![additional(address("::", 8080))];
    let mut b = listener();
    b.address = Some(address("::", 8080));
    b.additional_addresses = vec![
        additional(address("0.0.0.0", 8080)),
        additional(address("::", 8080)),
    ];
    assert!(ok(&a).same_addresses(&ok(&b)));
    assert!(!ok(&a).same_addresses(&ok(&listener())));
}

#[test]
fn default_filter_chain_alone_is_used() {
    let mut l = listener();
    l.default_filter_chain = Some(l.filter_chains.remove(0));
    assert!(matches!(
        ok(&l).chains[0].hcm().expect("http chain").routes,
        RouteSource::Rds(_)
    ));
}

#[test]
fn inline_route_config_is_translated() {
    let mut h = base_hcm();
    h.route_specifier = Some(RouteSpecifier::RouteConfig(rpb::RouteConfiguration {
        name: "inline".into(),
        virtual_hosts: vec![rpb::VirtualHost {
            name: "vh".into(),
            domains: vec!["*".into()],
            ..Default::default()
        }],
        ..Default::default()
    }));
    let d = ok(&listener_with(&h));
    let RouteSource::Inline(t) = &d.chains[0].hcm().expect("http chain").routes else {
        panic!("not inline");
    };
    assert_eq!(t.name, "inline");
    assert_eq!(t.vhosts[0].name, "vh");
}

#[test]
fn raw_buffer_transport_socket_is_accepted() {
    let mut l = listener();
    l.filter_chains[0].transport_socket =
        Some(tls_socket("envoy.transport_sockets.raw_buffer", RAW_TYPE));
    ok(&l);
}

#[test]
fn optional_and_disabled_http_filters_are_skipped() {
    let mut optional = typed_filter(
        "envoy.filters.http.cors",
        "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors",
    );
    optional.is_optional = true;
    let mut disabled = typed_filter(
        "envoy.filters.http.fault",
        "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
    );
    disabled.disabled = true;
    let mut h = base_hcm();
    h.http_filters = vec![optional, disabled, router()];
    ok(&listener_with(&h));
}

#[test]
fn router_named_without_typed_config_is_rejected() {
    // Envoy 1.40: "Didn't find a registered implementation for 'envoy.filters.http.router'
    // with type URL: ''".
    let mut h = base_hcm();
    h.http_filters = vec![hcm::HttpFilter {
        name: "envoy.filters.http.router".into(),
        ..Default::default()
    }];
    hcm_rejected(
        h,
        "no registered implementation for 'envoy.filters.http.router' with type URL ''",
    );
}

#[test]
fn router_is_recognised_by_type_url_not_name() {
    let mut h = base_hcm();
    h.http_filters = vec![typed_filter("my-router", ROUTER_TYPE)];
    ok(&listener_with(&h));
}

// ---------------------------------------------------------------------------------------------
// Listener-level rejections

#[test]
fn empty_name_is_rejected() {
    let mut l = listener();
    l.name.clear();
    let e = ListenerDef::translate(&l, &NoFiles).unwrap_err();
    assert_eq!(e.to_string(), "listener '': name must not be empty");
}

#[test]
fn missing_address_is_rejected() {
    let mut l = listener();
    l.address = None;
    rejected(&l, "address: socket_address is required");
}

#[test]
fn hostname_address_is_rejected() {
    let mut l = listener();
    l.address = Some(address("localhost", 80));
    rejected(&l, "address: malformed IP address: localhost");
}

#[test]
fn empty_address_is_rejected() {
    let mut l = listener();
    l.address = Some(address("", 80));
    rejected(&l, "address: socket_address.address must not be empty");
}

#[test]
fn port_out_of_range_is_rejected() {
    let mut l = listener();
    l.address = Some(address("0.0.0.0", 70000));
    rejected(&l, "address: port_value 70000 out of range");
}

#[test]
fn named_port_and_pipe_are_rejected() {
    let mut l = listener();
    l.address = Some(corepb::Address {
        address: Some(corepb::address::Address::SocketAddress(
            corepb::SocketAddress {
                address: "0.0.0.0".into(),
                port_specifier: Some(corepb::socket_address::PortSpecifier::NamedPort(
                    "http".into(),
                )),
                ..Default::default()
            },
        )),
    });
    rejected(&l, "address: named_port 'http' is not supported");
    l.address = Some(corepb::Address {
        address: Some(corepb::address::Address::Pipe(corepb::Pipe {
            path: "/tmp/sock".into(),
            mode: 0,
        })),
    });
    rejected(&l, "address: pipe address '/tmp/sock' is not supported");
}

#[test]
fn unknown_listener_filters_are_refused() {
    let mut l = listener();
    l.listener_filters.push(lpb::ListenerFilter {
        name: "envoy.filters.listener.tls_inspector".into(),
        ..Default::default()
    });
    assert!(ok(&l).tls_inspector);
    l.listener_filters.push(lpb::ListenerFilter {
        name: "envoy.filters.listener.original_src".into(),
        config_type: Some(lpb::listener_filter::ConfigType::TypedConfig(Any {
            type_url:
                "type.googleapis.com/envoy.extensions.filters.listener.original_src.v3.OriginalSrc"
                    .into(),
            value: vec![],
        })),
        ..Default::default()
    });
    rejected(
        &l,
        "listener_filters[1]: listener filter 'envoy.filters.listener.original_src' (type.googleapis.com/envoy.extensions.filters.listener.original_src.v3.OriginalSrc) is not supported",
    );
    assert!(!ok(&listener()).tls_inspector);
}

#[test]
fn no_filter_chains_is_rejected() {
    let mut l = listener();
    l.filter_chains.clear();
    rejected(&l, "no filter chains specified");
}

#[test]
fn identical_filter_chain_matches_are_rejected() {
    let mut l = listener();
    l.filter_chains[0].name = "a".into();
    let mut second = l.filter_chains[0].clone();
    second.name = "b".into();
    l.filter_chains.push(second);
    rejected(
        &l,
        "filter chain 'b' has the same matching rules defined as 'a'",
    );
    // A default chain has no match, so it never collides.
    let mut l = listener();
    l.default_filter_chain = Some(l.filter_chains[0].clone());
    let d = ok(&l);
    assert_eq!(d.chains.len(), 2);
    assert!(d.has_default);
}

#[test]
fn tls_context_without_certificates_is_rejected() {
    let mut l = listener();
    l.filter_chains[0].transport_socket = Some(tls_socket("envoy.transport_sockets.tls", TLS_TYPE));
    rejected(
        &l,
        "filter_chains[0].transport_socket 'envoy.transport_sockets.tls': No TLS certificates found for server context",
    );
}

#[test]
fn tls_context_under_the_raw_buffer_name_is_rejected() {
    let mut l = listener();
    l.filter_chains[0].transport_socket =
        Some(tls_socket("envoy.transport_sockets.raw_buffer", TLS_TYPE));
    rejected(&l, "transport_socket");
}

#[test]
fn raw_buffer_under_another_name_is_accepted() {
    let mut l = listener();
    l.filter_chains[0].transport_socket = Some(tls_socket("plaintext", RAW_TYPE));
    ok(&l);
}

#[test]
fn chain_without_network_filters_is_rejected() {
    let mut l = listener();
    l.filter_chains[0].filters.clear();
    rejected(&l, "filter_chains[0]: no network filters");
}

#[test]
fn several_network_filters_are_rejected() {
    let mut l = listener();
    let limit = lpb::Filter {
        name: "envoy.filters.network.connection_limit".into(),
        config_type: Some(lpb::filter::ConfigType::TypedConfig(Any {
            type_url: "type.googleapis.com/envoy.extensions.filters.network.connection_limit.v3.ConnectionLimit".into(),
            value: vec![],
        })),
    };
    l.filter_chains[0].filters.insert(0, limit);
    rejected(
        &l,
        "filter_chains[0]: only a single http_connection_manager or tcp_proxy is supported, found network filter 'envoy.filters.network.connection_limit' (type.googleapis.com/envoy.extensions.filters.network.connection_limit.v3.ConnectionLimit) first",
    );
    // Network RBAC in front of the terminal filter is translated, and checked.
    let mut l = listener();
    let rbac = lpb::Filter {
        name: "envoy.filters.network.rbac".into(),
        config_type: Some(lpb::filter::ConfigType::TypedConfig(Any {
            type_url: "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC".into(),
            value: vec![],
        })),
    };
    l.filter_chains[0].filters.insert(0, rbac);
    rejected(
        &l,
        "filter_chains[0].filters[0] 'envoy.filters.network.rbac': stat_prefix: value length must be at least 1 characters",
    );
}

#[test]
fn network_filter_without_typed_config_is_rejected() {
    let mut l = listener();
    l.filter_chains[0].filters[0].config_type = None;
    rejected(
        &l,
        "filter_chains[0].filters[0] 'envoy.filters.network.http_connection_manager': typed_config is required",
    );
}

fn tcp_filter(p: &tpb::TcpProxy) -> lpb::Filter {
    lpb::Filter {
        name: "envoy.filters.network.tcp_proxy".into(),
        config_type: Some(lpb::filter::ConfigType::TypedConfig(any(TCP_PROXY_TYPE, p))),
    }
}

fn tcp_proxy(cluster: &str) -> tpb::TcpProxy {
    tpb::TcpProxy {
        stat_prefix: "passthrough".into(),
        cluster_specifier: Some(tpb::tcp_proxy::ClusterSpecifier::Cluster(cluster.into())),
        ..Default::default()
    }
}

#[test]
fn tcp_proxy_chains_translate_next_to_http_ones() {
    let mut l = listener();
    l.filter_chains[0].filter_chain_match = Some(lpb::FilterChainMatch {
        server_names: vec!["http.example.com".into()],
        ..Default::default()
    });
    l.filter_chains.push(lpb::FilterChain {
        filter_chain_match: Some(lpb::FilterChainMatch {
            server_names: vec!["a.example.com".into()],
            ..Default::default()
        }),
        ..chain(vec![tcp_filter(&tcp_proxy("a"))])
    });
    l.default_filter_chain = Some(chain(vec![tcp_filter(&tcp_proxy("fallback"))]));
    let d = ok(&l);
    assert_eq!(d.chains.len(), 3);
    assert!(d.chains[0].hcm().is_some() && d.chains[0].tcp().is_none());
    let t = d.chains[1].tcp().expect("tcp chain");
    assert!(d.chains[1].hcm().is_none());
    assert_eq!(t.stat_prefix, "passthrough");
    assert_eq!(t.cluster(0), "a");
    assert_eq!(d.chains[2].tcp().map(|t| t.cluster(0)), Some("fallback"));
}

#[test]
fn bad_tcp_proxy_is_rejected_naming_the_chain() {
    let mut l = listener();
    l.filter_chains[0].filters[0] = tcp_filter(&tpb::TcpProxy {
        stat_prefix: String::new(),
        ..tcp_proxy("a")
    });
    rejected(
        &l,
        "listener 'l': filter_chains[0].filters[0]: tcp_proxy: stat_prefix must not be empty",
    );
    l.filter_chains[0].filters[0] = lpb::Filter {
        name: "envoy.filters.network.tcp_proxy".into(),
        config_type: Some(lpb::filter::ConfigType::TypedConfig(Any {
            type_url: TCP_PROXY_TYPE.into(),
            value: vec![0xff, 0xff],
        })),
    };
    rejected(&l, "filter_chains[0].filters[0]: tcp_proxy: cannot decode");
}

#[test]
fn tcp_proxy_behind_tls_termination_is_accepted() {
    let mut l = listener();
    l.filter_chains[0].filters[0] = tcp_filter(&tcp_proxy("a"));
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tlspb;
    // An SDS certificate, so the TLS context itself is valid without key material.
    let sds = DownstreamTlsContext {
        common_tls_context: Some(tlspb::CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![tlspb::SdsSecretConfig {
                name: "cert".into(),
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
            TLS_TYPE, &sds,
        ))),
    });
    // Istio's SIMPLE TLS server with tcp routes: the chain terminates, tcp_proxy carries on.
    let def = ListenerDef::translate(&l, &NoFiles).expect("accepted");
    assert!(def.chains[0].tls.is_some() && def.chains[0].tcp().is_some());
}

#[test]
fn other_network_filters_are_rejected() {
    let mut l = listener();
    l.filter_chains[0].filters[0] = lpb::Filter {
        name: "envoy.filters.network.redis_proxy".into(),
        config_type: Some(lpb::filter::ConfigType::TypedConfig(Any {
            type_url:
                "type.googleapis.com/envoy.extensions.filters.network.redis_proxy.v3.RedisProxy"
                    .into(),
            value: vec![],
        })),
    };
    rejected(
        &l,
        "network filter 'envoy.filters.network.redis_proxy' (type.googleapis.com/envoy.extensions.filters.network.redis_proxy.v3.RedisProxy) is not supported",
    );
}

#[test]
fn undecodable_hcm_is_rejected() {
    let mut l = listener();
    l.filter_chains[0].filters[0].config_type = Some(lpb::filter::ConfigType::TypedConfig(Any {
        type_url: HCM_TYPE.into(),
        value: vec![0xff, 0xff, 0xff],
    }));
    rejected(&l, "http_connection_manager: cannot decode");
}

// ---------------------------------------------------------------------------------------------
// HCM rejections

#[test]
fn rds_not_from_ads_is_rejected() {
    let mut h = base_hcm();
    h.route_specifier = Some(RouteSpecifier::Rds(hcm::Rds {
        config_source: Some(corepb::ConfigSource {
            config_source_specifier: Some(
                corepb::config_source::ConfigSourceSpecifier::ApiConfigSource(Default::default()),
            ),
            ..Default::default()
        }),
        route_config_name: "routes".into(),
    }));
    hcm_rejected(h.clone(), "rds.config_source: only ads is supported");
    h.route_specifier = Some(RouteSpecifier::Rds(hcm::Rds {
        config_source: None,
        route_config_name: "routes".into(),
    }));
    hcm_rejected(h, "rds.config_source: only ads is supported");
}

#[test]
fn rds_without_name_is_accepted_as_envoy_does() {
    let mut h = base_hcm();
    h.route_specifier = Some(ads_rds(""));
    ok(&listener_with(&h));
}

#[test]
fn scoped_routes_are_rejected() {
    let mut h = base_hcm();
    h.route_specifier = Some(RouteSpecifier::ScopedRoutes(Default::default()));
    hcm_rejected(h, "scoped_routes is not supported");
}

#[test]
fn missing_route_specifier_is_rejected() {
    let mut h = base_hcm();
    h.route_specifier = None;
    hcm_rejected(h, "one of rds or route_config is required");
}

#[test]
fn bad_inline_route_config_names_the_route_config() {
    let mut h = base_hcm();
    h.route_specifier = Some(RouteSpecifier::RouteConfig(rpb::RouteConfiguration {
        name: "inline".into(),
        virtual_hosts: vec![rpb::VirtualHost {
            name: "vh".into(),
            ..Default::default()
        }],
        ..Default::default()
    }));
    let text = hcm_rejected(h, "route 'inline': vhost 'vh': domains must not be empty");
    assert_eq!(
        text,
        "listener 'l': http_connection_manager: route 'inline': vhost 'vh': domains must not be empty"
    );
}

#[test]
fn http3_codec_is_rejected() {
    let mut h = base_hcm();
    h.codec_type = CodecType::Http3 as i32;
    hcm_rejected(h.clone(), "codec_type 3 is not supported");
    h.codec_type = 42;
    hcm_rejected(h, "codec_type 42 is not supported");
}

#[test]
fn no_http_filters_means_the_router_alone() {
    let mut h = base_hcm();
    h.http_filters.clear();
    ok(&listener_with(&h));
}

#[test]
fn router_not_last_is_rejected() {
    let mut h = base_hcm();
    let mut cors = typed_filter(
        "envoy.filters.http.cors",
        "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors",
    );
    cors.is_optional = true;
    h.http_filters = vec![router(), cors];
    hcm_rejected(
        h,
        "http_filters: the last filter must be the router (envoy.filters.http.router), found 'envoy.filters.http.cors'",
    );
}

#[test]
fn router_twice_is_rejected() {
    let mut h = base_hcm();
    h.http_filters = vec![router(), router()];
    hcm_rejected(
        h,
        "http_filters[0]: terminal filter 'envoy.filters.http.router' must be the last filter",
    );
}

#[test]
fn router_in_the_middle_is_rejected_even_if_optional() {
    let mut h = base_hcm();
    let mut early = router();
    early.name = "early-router".into();
    early.is_optional = true;
    h.http_filters = vec![
        optional(typed_filter("x", "type.googleapis.com/x")),
        early,
        router(),
    ];
    hcm_rejected(
        h,
        "http_filters[1]: terminal filter 'early-router' must be the last filter",
    );
}

#[test]
fn unsupported_http_filter_is_rejected_unless_optional() {
    let ext_proc =
        "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor";
    let mut h = base_hcm();
    h.http_filters = vec![
        typed_filter("envoy.filters.http.ext_proc", ext_proc),
        router(),
    ];
    hcm_rejected(
        h.clone(),
        &format!(
            "http_filters[0]: http filter 'envoy.filters.http.ext_proc' ({ext_proc}) is not supported; mark it is_optional to skip it"
        ),
    );
    h.http_filters[0].is_optional = true;
    ok(&listener_with(&h));
}

#[test]
fn unsupported_filter_is_named_by_its_index() {
    let mut h = base_hcm();
    h.http_filters = vec![
        optional(typed_filter("a", "type.googleapis.com/a")),
        hcm::HttpFilter {
            name: "b".into(),
            config_type: None,
            ..Default::default()
        },
        router(),
    ];
    hcm_rejected(
        h.clone(),
        "http_filters[1]: http filter 'b' (no typed_config) is not supported",
    );
    h.http_filters[1].config_type = Some(hcm::http_filter::ConfigType::ConfigDiscovery(
        Default::default(),
    ));
    hcm_rejected(
        h,
        "http_filters[1]: http filter 'b' (config_discovery) is not supported",
    );
}

#[test]
fn first_error_wins_in_listener_order() {
    // A bad address is reported before a bad filter chain.
    let mut l = listener();
    l.address = None;
    l.filter_chains.clear();
    let e = ListenerDef::translate(&l, &NoFiles)
        .unwrap_err()
        .to_string();
    assert!(e.contains("address"), "{e}");
}

fn faults(l: &ListenerDef) -> Vec<&FaultFilter> {
    l.chains[0]
        .hcm()
        .expect("http chain")
        .filters
        .iter()
        .filter_map(|f| match f {
            HttpFilter::Fault(f) => Some(f),
            _ => None,
        })
        .collect()
}

#[test]
fn fault_filters_are_translated_and_bad_ones_rejected() {
    let fault = "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault";
    let cors = "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors";
    let mut h = base_hcm();
    h.http_filters = vec![
        typed_filter("envoy.filters.http.fault", fault),
        typed_filter("envoy.filters.http.cors", cors),
        router(),
    ];
    // istiod's empty HTTPFault: a fault filter that injects nothing.
    let l = ok(&listener_with(&h));
    assert_eq!(faults(&l).len(), 1);
    assert_eq!(faults(&l)[0].name, "envoy.filters.http.fault");
    assert!(faults(&l)[0].config.abort.is_none());
    let mut with_abort = typed_filter("my-fault", fault);
    if let Some(hcm::http_filter::ConfigType::TypedConfig(a)) = &mut with_abort.config_type {
        // HTTPFault { abort: { http_status: 503 } }: field 2, message with field 2 = 503.
        a.value = vec![0x12, 0x03, 0x10, 0xf7, 0x03];
    }
    h.http_filters = vec![with_abort.clone(), router()];
    let l = ok(&listener_with(&h));
    assert_eq!(faults(&l)[0].name, "my-fault");
    assert!(faults(&l)[0].config.abort.is_some());
    if let Some(hcm::http_filter::ConfigType::TypedConfig(a)) = &mut with_abort.config_type {
        // http_status: 99
        a.value = vec![0x12, 0x02, 0x10, 0x63];
    }
    h.http_filters = vec![with_abort, router()];
    hcm_rejected(
        h,
        "http_filters[0] 'my-fault': abort: http_status: value 99 must be inside range [200, 600)",
    );
}

#[test]
fn stream_timeouts_and_internal_addresses() {
    use std::time::Duration;
    let d = |secs: i64| {
        Some(envoy_types::pb::google::protobuf::Duration {
            seconds: secs,
            nanos: 0,
        })
    };
    let def = ok(&listener_with(&base_hcm()));
    assert_eq!(
        def.chains[0].hcm().expect("http chain").stream_idle_timeout,
        Some(Duration::from_secs(300))
    );
    assert_eq!(
        def.chains[0].hcm().expect("http chain").max_stream_duration,
        None
    );
    assert!(def.chains[0]
        .hcm()
        .expect("http chain")
        .internal_ranges
        .is_empty());

    let mut h = base_hcm();
    h.stream_idle_timeout = d(0);
    h.common_http_protocol_options = Some(corepb::HttpProtocolOptions {
        max_stream_duration: d(30),
        ..Default::default()
    });
    let cidr = |prefix: &str, len: u32| corepb::CidrRange {
        address_prefix: prefix.into(),
        prefix_len: Some(envoy_types::pb::google::protobuf::UInt32Value { value: len }),
    };
    h.internal_address_config = Some(hcm::http_connection_manager::InternalAddressConfig {
        cidr_ranges: vec![cidr("10.0.0.0", 8), cidr("fd00::", 8)],
        ..Default::default()
    });
    let def = ok(&listener_with(&h));
    assert_eq!(
        def.chains[0].hcm().expect("http chain").stream_idle_timeout,
        None
    );
    assert_eq!(
        def.chains[0].hcm().expect("http chain").max_stream_duration,
        Some(Duration::from_secs(30))
    );
    let r = &def.chains[0].hcm().expect("http chain").internal_ranges;
    let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("ip");
    assert!(r[0].contains(ip("10.1.2.3")));
    assert!(
        r[0].contains(ip("::ffff:10.1.2.3")),
        "v4-mapped addresses match v4 ranges"
    );
    assert!(!r[0].contains(ip("11.0.0.1")));
    assert!(r[1].contains(ip("fd12::1")));
    assert!(!r[1].contains(ip("10.1.2.3")));

    h.internal_address_config = Some(hcm::http_connection_manager::InternalAddressConfig {
        cidr_ranges: vec![cidr("10.0.0.0", 33)],
        ..Default::default()
    });
    hcm_rejected(
        h.clone(),
        "internal_address_config.cidr_ranges[0]: prefix_len 33",
    );
    h.internal_address_config = Some(hcm::http_connection_manager::InternalAddressConfig {
        cidr_ranges: vec![cidr("ten", 8)],
        ..Default::default()
    });
    hcm_rejected(h, "malformed IP address: ten");
}

#[test]
fn hcm_upgrade_configs_are_kept_and_checked() {
    let up = |t: &str, on: Option<bool>| hcm::http_connection_manager::UpgradeConfig {
        upgrade_type: t.into(),
        enabled: on.map(|value| envoy_types::pb::google::protobuf::BoolValue { value }),
        ..Default::default()
    };
    let mut h = base_hcm();
    h.upgrade_configs = vec![up("websocket", None), up("foo", Some(false))];
    let d = ok(&listener_with(&h));
    assert_eq!(
        d.chains[0]
            .hcm()
            .expect("http chain")
            .upgrades
            .lookup(b"websocket"),
        Some(true)
    );
    assert_eq!(
        d.chains[0]
            .hcm()
            .expect("http chain")
            .upgrades
            .lookup(b"foo"),
        Some(false)
    );
    assert!(ok(&listener()).chains[0]
        .hcm()
        .expect("http chain")
        .upgrades
        .is_empty());
    let mut h = base_hcm();
    h.upgrade_configs = vec![up("websocket", None), up("WebSocket", None)];
    hcm_rejected(
        h,
        "multiple upgrade configs with the same name: 'WebSocket'",
    );
    let mut h = base_hcm();
    let mut f = up("websocket", None);
    f.filters.push(router());
    h.upgrade_configs = vec![f.clone()];
    assert_eq!(
        ok(&listener_with(&h)).chains[0]
            .hcm()
            .expect("http chain")
            .upgrades
            .lookup(b"websocket"),
        Some(true)
    );
    f.filters
        .insert(0, typed_filter("envoy.filters.http.cors", CORS_TYPE));
    h.upgrade_configs = vec![f];
    hcm_rejected(
        h,
        "upgrade_configs[0] 'websocket': filters other than the router are not supported",
    );
}

#[test]
fn chain_errors_name_the_chain_and_default_chains_translate() {
    let mut l = listener();
    let mut second = l.filter_chains[0].clone();
    second.filter_chain_match = Some(lpb::FilterChainMatch {
        server_names: vec!["b.example.com".into()],
        ..Default::default()
    });
    second.transport_socket = Some(tls_socket("envoy.transport_sockets.tls", TLS_TYPE));
    l.filter_chains.push(second);
    rejected(
        &l,
        "filter_chains[1].transport_socket 'envoy.transport_sockets.tls': No TLS certificates",
    );
    let mut l = listener();
    let mut d = l.filter_chains[0].clone();
    d.transport_socket = Some(tls_socket("envoy.transport_sockets.tls", TLS_TYPE));
    l.default_filter_chain = Some(d);
    rejected(&l, "default_filter_chain.transport_socket");
    let mut l = listener();
    l.filter_chains[0].transport_socket = Some(corepb::TransportSocket {
        name: "envoy.transport_sockets.alts".into(),
        config_type: None,
    });
    rejected(
        &l,
        "filter_chains[0].transport_socket 'envoy.transport_sockets.alts' is not supported",
    );
}

#[test]
fn a_default_chain_is_picked_when_nothing_matches() {
    let mut l = listener();
    l.filter_chains[0].filter_chain_match = Some(lpb::FilterChainMatch {
        server_names: vec!["a.example.com".into()],
        ..Default::default()
    });
    let conn = |sni| super::super::filter_chain::Conn {
        destination_port: 8080,
        server_name: sni,
        transport_protocol: "tls",
        application_protocols: &[],
    };
    assert_eq!(ok(&l).select_chain(&conn("a.example.com")), Some(0));
    assert_eq!(ok(&l).select_chain(&conn("b.example.com")), None);
    l.default_filter_chain = Some(l.filter_chains[0].clone());
    assert_eq!(ok(&l).select_chain(&conn("b.example.com")), Some(1));
}

// ---------------------------------------------------------------------------------------------
// What istiod sends beyond the basics: PROXY protocol, Istio's own filters, listener and
// connection manager fields.

fn listener_filter(name: &str, type_url: &str, value: Vec<u8>) -> lpb::ListenerFilter {
    lpb::ListenerFilter {
        name: name.into(),
        config_type: Some(lpb::listener_filter::ConfigType::TypedConfig(Any {
            type_url: type_url.into(),
            value,
        })),
        ..Default::default()
    }
}

fn proxy_protocol_filter(
    p: &envoy_types::pb::envoy::extensions::filters::listener::proxy_protocol::v3::ProxyProtocol,
) -> lpb::ListenerFilter {
    listener_filter(
        "envoy.filters.listener.proxy_protocol",
        PROXY_PROTOCOL_TYPE,
        p.encode_to_vec(),
    )
}

#[test]
fn proxy_protocol_is_kept_in_listener_filter_order() {
    use envoy_types::pb::envoy::extensions::filters::listener::proxy_protocol::v3 as pp;
    let mut l = listener();
    l.listener_filters = vec![
        proxy_protocol_filter(&pp::ProxyProtocol::default()),
        lpb::ListenerFilter {
            name: TLS_INSPECTOR.into(),
            ..Default::default()
        },
    ];
    let def = ok(&l);
    assert_eq!(
        def.listener_filters,
        vec![
            ListenerFilter::ProxyProtocol(Arc::new(ProxyProtocol {
                allow_without: false,
                allow_v1: true,
                allow_v2: true,
                stat_prefix: String::new(),
            })),
            ListenerFilter::TlsInspector,
        ]
    );
    assert!(def.tls_inspector);
    // The options Envoy 1.40 honours.
    l.listener_filters = vec![proxy_protocol_filter(&pp::ProxyProtocol {
        allow_requests_without_proxy_protocol: true,
        disallowed_versions: vec![0],
        stat_prefix: "nlb".into(),
        pass_through_tlvs: Some(corepb::ProxyProtocolPassThroughTlVs {
            match_type: 0,
            tlv_type: vec![],
        }),
        ..Default::default()
    })];
    assert_eq!(
        ok(&l).listener_filters,
        vec![ListenerFilter::ProxyProtocol(Arc::new(ProxyProtocol {
            allow_without: true,
            allow_v1: false,
            allow_v2: true,
            stat_prefix: "nlb".into(),
        }))]
    );
    l.listener_filters = vec![proxy_protocol_filter(&pp::ProxyProtocol {
        disallowed_versions: vec![0, 1],
        ..Default::default()
    })];
    rejected(&l, "all proxy protocol versions are disallowed");
    l.listener_filters = vec![proxy_protocol_filter(&pp::ProxyProtocol {
        rules: vec![pp::proxy_protocol::Rule {
            tlv_type: 0xe0,
            on_tlv_present: None,
        }],
        ..Default::default()
    })];
    rejected(
        &l,
        "listener_filters[0] 'envoy.filters.listener.proxy_protocol': proxy_protocol.rules",
    );
}

#[test]
fn http_inspector_and_original_dst_are_accepted_where_they_cannot_matter() {
    let mut l = listener();
    l.listener_filters = vec![
        listener_filter(
            "envoy.filters.listener.original_dst",
            ORIGINAL_DST_TYPE,
            vec![],
        ),
        listener_filter(
            "envoy.filters.listener.http_inspector",
            HTTP_INSPECTOR_TYPE,
            vec![],
        ),
    ];
    assert!(ok(&l).listener_filters.is_empty());
    // A plaintext chain picked by the sniffed protocol would match differently.
    l.filter_chains[0].filter_chain_match = Some(lpb::FilterChainMatch {
        application_protocols: vec!["http/1.1".into(), "h2c".into()],
        ..Default::default()
    });
    rejected(
        &l,
        "filter_chains[0]: matching application_protocols on plaintext connections (envoy.filters.listener.http_inspector) is not supported",
    );
}

#[test]
fn listener_fields_are_refused_by_name_or_accepted() {
    use envoy_types::pb::google::protobuf::UInt32Value;
    let mut l = listener();
    l.traffic_direction = corepb::TrafficDirection::Outbound as i32;
    l.per_connection_buffer_limit_bytes = Some(UInt32Value { value: 32768 });
    l.ignore_global_conn_limit = true;
    l.connection_balance_config = Some(lpb::listener::ConnectionBalanceConfig {
        balance_type: Some(
            lpb::listener::connection_balance_config::BalanceType::ExactBalance(Default::default()),
        ),
    });
    l.max_connections_to_accept_per_socket_event = Some(UInt32Value { value: 1 });
    l.bind_to_port = Some(BoolValue { value: false });
    let def = ok(&l);
    assert!(!def.bind_to_port);
    assert!(ok(&listener()).bind_to_port);

    let mut l = listener();
    l.use_original_dst = Some(BoolValue { value: true });
    rejected(&l, "use_original_dst: handing connections");
    let mut l = listener();
    l.udp_listener_config = Some(Default::default());
    rejected(&l, "udp_listener_config: UDP listeners (QUIC / HTTP/3)");
}

#[test]
fn chain_handshake_timeout_is_kept() {
    let mut l = listener();
    l.filter_chains[0].transport_socket_connect_timeout =
        Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 15,
            nanos: 0,
        });
    assert_eq!(
        ok(&l).chains[0].handshake_timeout,
        Some(std::time::Duration::from_secs(15))
    );
    assert_eq!(ok(&listener()).chains[0].handshake_timeout, None);
}

/// A TypedStruct naming `type_url`, as istiod 1.22+ wraps Istio's filters.
fn typed_struct(type_url: &str) -> Any {
    Any {
        type_url: TYPED_STRUCTS[0].into(),
        value: TypedStruct {
            type_url: type_url.into(),
        }
        .encode_to_vec(),
    }
}

fn http_filter_any(name: &str, a: Any) -> hcm::HttpFilter {
    hcm::HttpFilter {
        name: name.into(),
        config_type: Some(hcm::http_filter::ConfigType::TypedConfig(a)),
        ..Default::default()
    }
}

fn null_vm_wasm(type_url: &str, code: &str, configuration: Option<Any>) -> Any {
    use envoy_types::pb::envoy::extensions::filters::http::wasm::v3::Wasm;
    use envoy_types::pb::envoy::extensions::wasm::v3 as wasm;
    let vm = wasm::VmConfig {
        runtime: "envoy.wasm.runtime.null".into(),
        code: Some(corepb::AsyncDataSource {
            specifier: Some(corepb::async_data_source::Specifier::Local(
                corepb::DataSource {
                    specifier: Some(corepb::data_source::Specifier::InlineString(code.into())),
                    ..Default::default()
                },
            )),
        }),
        ..Default::default()
    };
    Any {
        type_url: type_url.into(),
        value: Wasm {
            config: Some(wasm::PluginConfig {
                configuration,
                vm: Some(wasm::plugin_config::Vm::VmConfig(vm)),
                ..Default::default()
            }),
        }
        .encode_to_vec(),
    }
}

fn alpn_filter() -> hcm::HttpFilter {
    let c = AlpnFilterConfig {
        alpn_override: vec![
            AlpnOverrideProto {
                upstream_protocol: 0,
                alpn_override: vec!["istio-http/1.0".into(), "istio".into(), "http/1.0".into()],
            },
            AlpnOverrideProto {
                upstream_protocol: 1,
                alpn_override: vec!["istio-http/1.1".into(), "istio".into(), "http/1.1".into()],
            },
            AlpnOverrideProto {
                upstream_protocol: 2,
                alpn_override: vec!["istio-h2".into(), "istio".into(), "h2".into()],
            },
        ],
    };
    http_filter_any(
        "istio.alpn",
        Any {
            type_url: ALPN_FILTER_TYPE.into(),
            value: c.encode_to_vec(),
        },
    )
}

#[test]
fn istiod_gateway_http_filters_are_accepted() {
    let mut h = base_hcm();
    h.http_filters =
        vec![
        http_filter_any(
            "istio.metadata_exchange",
            typed_struct("type.googleapis.com/io.istio.http.peer_metadata.Config"),
        ),
        http_filter_any(
            "envoy.filters.http.grpc_stats",
            Any {
                type_url:
                    "type.googleapis.com/envoy.extensions.filters.http.grpc_stats.v3.FilterConfig"
                        .into(),
                value: vec![],
            },
        ),
        alpn_filter(),
        typed_filter(
            "envoy.filters.http.fault",
            "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
        ),
        typed_filter("envoy.filters.http.cors", CORS_TYPE),
        http_filter_any("istio.stats", typed_struct("type.googleapis.com/stats.PluginConfig")),
        http_filter_any(
            "istio.stats",
            null_vm_wasm(WASM_HTTP_TYPE, "envoy.wasm.stats", None),
        ),
        http_filter_any(
            "istio.metadata_exchange",
            null_vm_wasm(
                WASM_HTTP_TYPE,
                "envoy.wasm.metadata_exchange",
                Some(Any {
                    type_url: MX_NETWORK_TYPE.into(),
                    value: vec![],
                }),
            ),
        ),
        router(),
    ];
    let def = ok(&listener_with(&h));
    let hcm = def.chains[0].hcm().expect("http chain");
    let alpn = hcm.alpn.as_ref().expect("istio.alpn");
    assert_eq!(
        alpn.for_protocol(false),
        Some(
            &[
                b"istio-http/1.1".to_vec(),
                b"istio".to_vec(),
                b"http/1.1".to_vec()
            ][..]
        )
    );
    assert_eq!(
        alpn.for_protocol(true),
        Some(&[b"istio-h2".to_vec(), b"istio".to_vec(), b"h2".to_vec()][..])
    );
    // A Wasm module that is not one of Istio's built-in null-VM plugins stays refused.
    let mut h = base_hcm();
    let mut wasm = null_vm_wasm(WASM_HTTP_TYPE, "my.plugin", None);
    h.http_filters = vec![http_filter_any("my.wasm", wasm.clone()), router()];
    hcm_rejected(h.clone(), "http filter 'my.wasm'");
    wasm = null_vm_wasm(WASM_HTTP_TYPE, "envoy.wasm.metadata_exchange", None);
    h.http_filters = vec![http_filter_any("mx", wasm), router()];
    hcm_rejected(h, "http filter 'mx'");
}

#[test]
fn istio_network_filters_before_the_terminal_filter_are_accepted() {
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tlsv3;
    let mx = lpb::Filter {
        name: "istio.metadata_exchange".into(),
        config_type: Some(lpb::filter::ConfigType::TypedConfig(typed_struct(
            MX_NETWORK_TYPE,
        ))),
    };
    let stats = lpb::Filter {
        name: "istio.stats".into(),
        config_type: Some(lpb::filter::ConfigType::TypedConfig(Any {
            type_url: "type.googleapis.com/stats.PluginConfig".into(),
            value: vec![],
        })),
    };
    let mut l = listener();
    l.filter_chains[0].filters = vec![mx, stats, tcp_filter(&tcp_proxy("outbound|9000||db"))];
    // ISTIO_MUTUAL TCP server: istiod offers istio-peer-exchange first.
    let key = rcgen::KeyPair::generate().expect("key");
    let c = rcgen::CertificateParams::new(vec!["gw.example".to_string()])
        .expect("params")
        .self_signed(&key)
        .expect("cert");
    let (test_cert, test_key) = (c.pem(), key.serialize_pem());
    let cert = tlsv3::TlsCertificate {
        certificate_chain: Some(corepb::DataSource {
            specifier: Some(corepb::data_source::Specifier::InlineString(test_cert)),
            ..Default::default()
        }),
        private_key: Some(corepb::DataSource {
            specifier: Some(corepb::data_source::Specifier::InlineString(test_key)),
            ..Default::default()
        }),
        ..Default::default()
    };
    let ctx = DownstreamTlsContext {
        common_tls_context: Some(tlsv3::CommonTlsContext {
            tls_certificates: vec![cert],
            alpn_protocols: vec!["istio-peer-exchange".into(), "h2".into(), "http/1.1".into()],
            ..Default::default()
        }),
        ..Default::default()
    };
    l.filter_chains[0].transport_socket = Some(corepb::TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(corepb::transport_socket::ConfigType::TypedConfig(any(
            TLS_TYPE, &ctx,
        ))),
    });
    let def = ok(&l);
    let tls = def.chains[0].tls.as_ref().expect("tls");
    assert_eq!(tls.alpn, vec![b"h2".to_vec(), b"http/1.1".to_vec()]);
    assert!(def.chains[0].tcp().is_some());
}

#[test]
fn path_normalization_fields_are_kept() {
    use hcm::http_connection_manager::PathWithEscapedSlashesAction as Esc;
    let mut h = base_hcm();
    assert_eq!(
        ok(&listener_with(&h)).chains[0].hcm().expect("hcm").path,
        PathNormalization::default()
    );
    h.normalize_path = Some(BoolValue { value: true });
    h.merge_slashes = true;
    h.path_with_escaped_slashes_action = Esc::UnescapeAndForward as i32;
    let def = ok(&listener_with(&h));
    assert_eq!(
        def.chains[0].hcm().expect("hcm").path,
        PathNormalization {
            normalize: true,
            merge_slashes: true,
            escaped_slashes: EscapedSlashes::Forward,
        }
    );
    h.path_with_escaped_slashes_action = Esc::KeepUnchanged as i32;
    assert!(ok(&listener_with(&h)).chains[0]
        .hcm()
        .expect("hcm")
        .path
        .is_active());
}

#[test]
fn hcm_fields_that_would_change_requests_are_refused() {
    let mut h = base_hcm();
    h.http_protocol_options = Some(corepb::Http1ProtocolOptions {
        accept_http_10: true,
        ..Default::default()
    });
    hcm_rejected(h, "http_protocol_options.accept_http_10");
    let mut h = base_hcm();
    h.append_x_forwarded_port = true;
    hcm_rejected(h, "append_x_forwarded_port is not supported");
    let mut h = base_hcm();
    h.strip_trailing_host_dot = true;
    hcm_rejected(h, "strip_trailing_host_dot is not supported");
    let mut h = base_hcm();
    h.request_id_extension = Some(hcm::RequestIdExtension {
        typed_config: Some(Any {
            type_url: "type.googleapis.com/my.RequestId".into(),
            value: vec![],
        }),
    });
    hcm_rejected(h, "request_id_extension: only");
    let mut h = base_hcm();
    h.request_id_extension = Some(hcm::RequestIdExtension {
        typed_config: Some(Any {
            type_url: UUID_REQUEST_ID_TYPE.into(),
            value: vec![],
        }),
    });
    h.proxy_100_continue = true;
    ok(&listener_with(&h));
    // Envoy Gateway's REJECT_REQUEST.
    let mut h = base_hcm();
    h.common_http_protocol_options = Some(corepb::HttpProtocolOptions {
        headers_with_underscores_action: 1,
        ..Default::default()
    });
    assert_eq!(
        ok(&listener_with(&h)).chains[0]
            .hcm()
            .expect("hcm")
            .underscores,
        Underscores::Reject
    );
}

// ---------------------------------------------------------------------------------------------
// The real thing: every listener of an Istio 1.18 sidecar's config dump (DeathStarBench) and
// of istioctl's authz test dump either translates or is refused for a documented reason. The
// sidecar's listeners carry the same filter types a gateway's do.

/// `shared/xds-data`, found as tests/istio_xds_data.rs finds it.
fn shared(rel: &str) -> std::path::PathBuf {
    let root = std::env::var_os("PORTICO_SHARED_DIR")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .ancestors()
                .map(|a| a.join("shared"))
                .find(|p| p.join("xds-data").is_dir())
        })
        .unwrap_or_else(|| {
            std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared"))
        });
    root.join("xds-data").join(rel)
}

fn dump_listeners(v: &serde_json::Value, out: &mut Vec<serde_json::Value>) {
    match v {
        serde_json::Value::Object(m) => {
            if m.get("@type").and_then(|t| t.as_str())
                == Some("type.googleapis.com/envoy.config.listener.v3.Listener")
            {
                let mut l = v.clone();
                if let Some(o) = l.as_object_mut() {
                    o.remove("@type");
                }
                out.push(l);
                return;
            }
            m.values().for_each(|x| dump_listeners(x, out));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| dump_listeners(x, out)),
        _ => {}
    }
}

/// Why a listener of the dumps may be refused: sidecar-only machinery, each named in the
/// error. Every Istio filter in them (istio.stats, istio.metadata_exchange in all its forms,
/// istio.alpn, grpc_stats, fault, cors) is accepted.
const DOCUMENTED_REFUSALS: &[&str] = &[
    // Sidecar chains picked by the sniffed protocol (inbound and outbound per-port listeners).
    "matching application_protocols on plaintext connections (envoy.filters.listener.http_inspector) is not supported",
    // virtualInbound's inspectors skipped by destination port.
    "filter_disabled is not supported",
    // virtualOutbound (15001): hands connections over by original destination.
    "use_original_dst: handing connections",
    // Istio 1.18's internal listeners (connect_originate, main_internal) restored the
    // destination with Istio's own listener filter.
    "listener filter 'set_dst_address'",
    // The sidecar-inbound authn network filter: not telemetry (it feeds authorization).
    "found network filter 'istio_authn' (type.googleapis.com/io.istio.network.authn.Config) first",
];

#[test]
fn istio_dump_listeners_translate_or_are_refused_with_a_reason() {
    let _pool = crate::protojson::pool().expect("descriptor pool");
    let mut translated = 0;
    let mut refused = Vec::new();
    for (file, yaml) in [
        (
            "istio-sidecar/deathstarbench_istio1.18.2_sidecar_config_dump.json",
            false,
        ),
        ("istio-sidecar/istioctl_authz_configdump.yaml", true),
    ] {
        let path = shared(file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{} is needed: {e}", path.display()));
        let dump: serde_json::Value = if yaml {
            serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
        } else {
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
        };
        let mut ls = Vec::new();
        dump_listeners(&dump, &mut ls);
        assert!(ls.len() > 5, "{file}: {} listeners", ls.len());
        for json in ls {
            let name = json["name"].as_str().unwrap_or("").to_string();
            if name.is_empty() {
                // The bootstrap's static listeners (Prometheus, health), dumped without a name.
                continue;
            }
            // Every Istio type in the dump now has a descriptor: all of them decode.
            let msg =
                crate::protojson::dynamic_from_json("envoy.config.listener.v3.Listener", &json)
                    .unwrap_or_else(|e| panic!("{file}: listener '{name}' does not decode: {e}"));
            let proto = lpb::Listener::decode(msg.encode_to_vec().as_slice())
                .unwrap_or_else(|e| panic!("{file}: '{name}': {e}"));
            match ListenerDef::translate(&proto, &NoFiles) {
                Ok(_) => translated += 1,
                Err(e) => {
                    let text = e.to_string();
                    assert!(
                        text.starts_with(&format!("listener '{}'", proto.name)),
                        "{text}"
                    );
                    assert!(
                        DOCUMENTED_REFUSALS.iter().any(|r| text.contains(r)),
                        "{file}: '{name}' refused for an undocumented reason: {text}"
                    );
                    refused.push(text);
                }
            }
        }
    }
    eprintln!(
        "{translated} listeners translated; {} refused:",
        refused.len()
    );
    for r in &refused {
        eprintln!("  {r}");
    }
    assert!(translated >= 50, "only {translated} listeners translated");
}

// ---------------------------------------------------------------------------------------------
// Internal listeners (ambient HBONE)

/// istiod's `connect_originate` listener.
fn connect_originate() -> lpb::Listener {
    let tcp = tpb::TcpProxy {
        stat_prefix: "connect_originate".into(),
        cluster_specifier: Some(tpb::tcp_proxy::ClusterSpecifier::Cluster(
            "connect_originate".into(),
        )),
        tunneling_config: Some(tpb::tcp_proxy::TunnelingConfig {
            hostname: "%DOWNSTREAM_LOCAL_ADDRESS%".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    lpb::Listener {
        name: "connect_originate".into(),
        use_original_dst: Some(BoolValue { value: false }),
        listener_specifier: Some(lpb::listener::ListenerSpecifier::InternalListener(
            Default::default(),
        )),
        listener_filters: vec![lpb::ListenerFilter {
            name: "envoy.filters.listener.original_dst".into(),
            config_type: Some(lpb::listener_filter::ConfigType::TypedConfig(Any {
                type_url: ORIGINAL_DST_TYPE.into(),
                value: vec![],
            })),
            ..Default::default()
        }],
        filter_chains: vec![chain(vec![tcp_filter(&tcp)])],
        ..Default::default()
    }
}

#[test]
fn istiods_connect_originate_is_an_unbound_internal_listener() {
    let d = ok(&connect_originate());
    assert!(d.internal);
    assert!(d.original_dst);
    // Never bound, so never in the store's address checks.
    assert!(!d.bind_to_port);
    assert_eq!(d.stat_name, "connect_originate");
    let tcp = d.chains[0].tcp().expect("tcp_proxy");
    assert_eq!(tcp.clusters(), ["connect_originate"]);
    let t = tcp.tunneling.as_ref().expect("tunneling_config");
    assert_eq!(
        t.authority(Some("10.1.2.3:8080".parse().expect("addr")), "x"),
        "10.1.2.3:8080"
    );
    // Without the original_dst filter nothing restores the destination.
    let mut l = connect_originate();
    l.listener_filters.clear();
    assert!(!ok(&l).original_dst);
}

#[test]
fn internal_listeners_take_only_the_tcp_proxy_shape() {
    let mut l = connect_originate();
    l.address = Some(address("0.0.0.0", 15008));
    rejected(&l, "address: an internal listener has no address");
    let mut l = connect_originate();
    l.listener_filters[0] = lpb::ListenerFilter {
        name: TLS_INSPECTOR.into(),
        ..Default::default()
    };
    rejected(
        &l,
        "only the envoy.filters.listener.original_dst listener filter is supported on internal listeners",
    );
    let mut l = connect_originate();
    l.default_filter_chain = Some(l.filter_chains[0].clone());
    rejected(&l, "only one filter chain without filter_chain_match");
    let mut l = connect_originate();
    l.filter_chains[0].filter_chain_match = Some(lpb::FilterChainMatch {
        destination_port: Some(envoy_types::pb::google::protobuf::UInt32Value { value: 80 }),
        ..Default::default()
    });
    rejected(&l, "only one filter chain without filter_chain_match");
    let mut l = connect_originate();
    l.filter_chains = vec![chain(vec![hcm_filter(&base_hcm())])];
    rejected(
        &l,
        "only a tcp_proxy chain is supported on internal listeners (not an http_connection_manager)",
    );
    let mut l = connect_originate();
    let mut tcp = tpb::TcpProxy {
        stat_prefix: "s".into(),
        cluster_specifier: Some(tpb::tcp_proxy::ClusterSpecifier::Cluster("c".into())),
        max_connect_attempts: Some(envoy_types::pb::google::protobuf::UInt32Value { value: 2 }),
        ..Default::default()
    };
    l.filter_chains = vec![chain(vec![tcp_filter(&tcp)])];
    rejected(&l, "max_connect_attempts above 1");
    // A tunnel from a bound listener is not implemented.
    tcp.max_connect_attempts = None;
    tcp.tunneling_config = Some(tpb::tcp_proxy::TunnelingConfig {
        hostname: "x".into(),
        ..Default::default()
    });
    let mut bound = listener();
    bound.filter_chains = vec![chain(vec![tcp_filter(&tcp)])];
    rejected(
        &bound,
        "tcp_proxy tunneling_config is supported only on internal listeners",
    );
}

/// Two chains told apart by server name, each with its own routes.
fn by_server_name(name: &str, routes: &str) -> lpb::FilterChain {
    let mut h = base_hcm();
    h.route_specifier = Some(ads_rds(routes));
    lpb::FilterChain {
        name: name.into(),
        filter_chain_match: Some(lpb::FilterChainMatch {
            server_names: vec![format!("{name}.example")],
            ..Default::default()
        }),
        ..chain(vec![hcm_filter(&h)])
    }
}

#[test]
fn a_push_keeps_the_identity_of_unchanged_chains_wherever_they_move() {
    let mut l = listener();
    l.filter_chains = vec![by_server_name("a", "ra"), by_server_name("b", "rb")];
    let prev = ok(&l);
    // Reordered, and b's routes changed.
    l.filter_chains = vec![by_server_name("b", "rb2"), by_server_name("a", "ra")];
    let mut next = ok(&l);
    next.keep_unchanged_chains(&prev);
    assert!(Arc::ptr_eq(&next.chains[1], &prev.chains[0]), "a is kept");
    assert!(
        !prev.chains.iter().any(|p| Arc::ptr_eq(p, &next.chains[0])),
        "b changed: a new chain"
    );
    // The same chains on another address are other chains.
    l.address = Some(address("0.0.0.0", 8081));
    let mut moved = ok(&l);
    moved.keep_unchanged_chains(&next);
    assert!(!Arc::ptr_eq(&moved.chains[1], &next.chains[1]));
    // A change to the listener itself (here its per-connection buffer limit) replaces every
    // chain, as Envoy replaces the whole listener.
    l.per_connection_buffer_limit_bytes =
        Some(envoy_types::pb::google::protobuf::UInt32Value { value: 65536 });
    let mut relimited = ok(&l);
    relimited.keep_unchanged_chains(&moved);
    assert!(!relimited
        .chains
        .iter()
        .any(|c| moved.chains.iter().any(|p| Arc::ptr_eq(c, p))));
    // Unchanged again: everything is kept.
    let mut same = ok(&l);
    same.keep_unchanged_chains(&relimited);
    assert!(same
        .chains
        .iter()
        .zip(&relimited.chains)
        .all(|(a, b)| Arc::ptr_eq(a, b)));
}

#[test]
fn tls_certificate_files_come_from_the_supplied_sources() {
    use crate::snapshot::sources::MemorySources;
    use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tlspb;
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = rcgen::CertificateParams::new(vec!["a.example.com".to_string()])
        .expect("params")
        .self_signed(&key)
        .expect("cert");
    let ds = |s: Specifier| {
        Some(corepb::DataSource {
            specifier: Some(s),
            ..Default::default()
        })
    };
    let tls = DownstreamTlsContext {
        common_tls_context: Some(tlspb::CommonTlsContext {
            tls_certificates: vec![tlspb::TlsCertificate {
                certificate_chain: ds(Specifier::Filename("/virtual/cert.pem".into())),
                // A variable every process has: the supplied value is used, not the process's.
                private_key: ds(Specifier::EnvironmentVariable("HOME".into())),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut l = listener();
    l.filter_chains[0].transport_socket = Some(corepb::TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(corepb::transport_socket::ConfigType::TypedConfig(any(
            TLS_TYPE, &tls,
        ))),
    });
    let src = MemorySources::default()
        .with_file("/virtual/cert.pem", cert.pem())
        .with_env("HOME", &key.serialize_pem());
    let def = ListenerDef::translate(&l, &src).expect("accepted");
    let chain_tls = def.chains[0].tls.as_ref().expect("TLS");
    assert!(
        chain_tls.inline_config.is_some(),
        "built from the served bytes"
    );

    let mut no_file = src.clone();
    no_file.files.clear();
    let e = ListenerDef::translate(&l, &no_file).expect_err("refused");
    assert_eq!(e.resource, "listener 'l'");
    assert!(
        e.detail.starts_with(
            "filter_chains[0].transport_socket 'envoy.transport_sockets.tls': tls_certificates[0]: certificate_chain: cannot read file '/virtual/cert.pem': "
        ),
        "{e}"
    );
    let mut no_env = src;
    no_env.env.clear();
    let e = ListenerDef::translate(&l, &no_env).expect_err("refused");
    assert_eq!(
        e.detail,
        "filter_chains[0].transport_socket 'envoy.transport_sockets.tls': tls_certificates[0]: private_key: environment variable 'HOME' is not set"
    );
}

/// `access_log` on the connection manager and on the listener is translated: a bad one NACKs
/// the listener naming the field and Envoy's reason; a good one is kept in order.
#[test]
fn access_logs_are_translated() {
    use crate::telemetry::access_log::{FILE_TYPE, STDOUT_TYPE};
    use envoy_types::pb::envoy::config::accesslog::v3 as apb;
    use envoy_types::pb::envoy::extensions::access_loggers::file::v3 as filepb;
    let file = |format: &str| apb::AccessLog {
        name: "envoy.access_loggers.file".into(),
        filter: None,
        config_type: Some(apb::access_log::ConfigType::TypedConfig(any(
            FILE_TYPE,
            &filepb::FileAccessLog {
                path: "/dev/stdout".into(),
                access_log_format: Some(filepb::file_access_log::AccessLogFormat::LogFormat(
                    corepb::SubstitutionFormatString {
                        format: Some(
                            corepb::substitution_format_string::Format::TextFormatSource(
                                corepb::DataSource {
                                    specifier: Some(corepb::data_source::Specifier::InlineString(
                                        format.into(),
                                    )),
                                    ..Default::default()
                                },
                            ),
                        ),
                        ..Default::default()
                    },
                )),
            },
        ))),
    };
    let mut h = base_hcm();
    h.access_log = vec![file("%RESPONSE_CODE%\n"), file("%NOPE%")];
    let e = rejected(&listener_with(&h), "access_log[1]");
    assert!(
        e.contains(
            "access_log[1].log_format.text_format_source: Not supported field in StreamInfo: NOPE"
        ),
        "{e}"
    );
    h.access_log.pop();
    let mut l = listener_with(&h);
    l.access_log = vec![apb::AccessLog {
        name: "envoy.access_loggers.stdout".into(),
        filter: None,
        config_type: Some(apb::access_log::ConfigType::TypedConfig(Any {
            type_url: STDOUT_TYPE.into(),
            value: vec![],
        })),
    }];
    let def = ok(&l);
    assert_eq!(def.access_log.0.len(), 1);
    assert_eq!(def.chains[0].hcm().map(|h| h.access_log.0.len()), Some(1));
}

#[test]
fn tracing_is_translated_with_the_listeners_direction() {
    use envoy_types::pb::envoy::config::trace::v3::{tracing::http, tracing::Http, ZipkinConfig};
    let mut h = base_hcm();
    assert!(ok(&listener_with(&h)).chains[0]
        .hcm()
        .expect("hcm")
        .tracing
        .is_none());
    let zipkin = ZipkinConfig {
        collector_cluster: "zipkin".into(),
        collector_endpoint: "/api/v2/spans".into(),
        collector_endpoint_version: 1,
        ..Default::default()
    };
    h.tracing = Some(hcm::http_connection_manager::Tracing {
        provider: Some(Http {
            name: "envoy.tracers.zipkin".into(),
            config_type: Some(http::ConfigType::TypedConfig(any(
                "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
                &zipkin,
            ))),
        }),
        ..Default::default()
    });
    let mut l = listener_with(&h);
    l.traffic_direction = corepb::TrafficDirection::Outbound as i32;
    let def = ok(&l);
    let t = def.chains[0]
        .hcm()
        .expect("hcm")
        .tracing
        .clone()
        .expect("tracing");
    assert!(t.egress);
    assert!(matches!(
        t.provider.as_deref(),
        Some(crate::telemetry::trace::Provider::Zipkin(_))
    ));
    // A driver config Envoy cannot build refuses the listener, naming the field.
    let mut bad = zipkin;
    bad.collector_endpoint_version = 0;
    if let Some(t) = h.tracing.as_mut() {
        t.provider = Some(Http {
            name: "envoy.tracers.zipkin".into(),
            config_type: Some(http::ConfigType::TypedConfig(any(
                "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
                &bad,
            ))),
        });
    }
    hcm_rejected(h, "tracing.provider zipkin: collector_endpoint_version");
}

#[test]
fn connection_limits_are_read_and_zero_means_none() {
    use std::time::Duration;
    let d = |ms: i64| {
        Some(envoy_types::pb::google::protobuf::Duration {
            seconds: ms / 1000,
            nanos: ((ms % 1000) * 1_000_000) as i32,
        })
    };
    let def = ok(&listener_with(&base_hcm()));
    let l = def.chains[0].hcm().expect("http chain").conn_limits;
    assert!(!l.any(), "{l:?}");
    assert_eq!(l.drain_timeout, Duration::from_secs(5));
    assert_eq!(l.delayed_close, Duration::from_secs(1));

    let mut h = base_hcm();
    h.request_headers_timeout = d(1500);
    h.request_timeout = d(0);
    h.drain_timeout = d(2000);
    h.common_http_protocol_options = Some(corepb::HttpProtocolOptions {
        max_connection_duration: d(60_000),
        max_requests_per_connection: Some(envoy_types::pb::google::protobuf::UInt32Value {
            value: 100,
        }),
        ..Default::default()
    });
    let def = ok(&listener_with(&h));
    let l = def.chains[0].hcm().expect("http chain").conn_limits;
    assert_eq!(l.request_headers_timeout, Some(Duration::from_millis(1500)));
    assert_eq!(l.request_timeout, None);
    assert_eq!(l.max_connection_duration, Some(Duration::from_secs(60)));
    assert_eq!(l.max_requests_per_connection, Some(100));
    assert_eq!(l.drain_timeout, Duration::from_secs(2));
    assert!(l.any() && l.timed());

    let mut h = base_hcm();
    h.request_headers_timeout = d(-1000);
    hcm_rejected(h, "request_headers_timeout: invalid duration -1s 0ns");
}

#[test]
fn http2_settings_are_read_and_checked_against_envoys_ranges() {
    use envoy_types::pb::google::protobuf::UInt32Value;
    let def = ok(&listener_with(&base_hcm()));
    let h2 = def.chains[0].hcm().expect("http chain").h2;
    assert_eq!(h2.max_concurrent_streams, 2_147_483_647);
    assert_eq!((h2.stream_window, h2.connection_window), (None, None));
    assert_eq!(h2.max_header_list, 60 * 1024);

    let mut h = base_hcm();
    h.max_request_headers_kb = Some(UInt32Value { value: 96 });
    h.http2_protocol_options = Some(corepb::Http2ProtocolOptions {
        max_concurrent_streams: Some(UInt32Value { value: 100 }),
        initial_stream_window_size: Some(UInt32Value { value: 65536 }),
        initial_connection_window_size: Some(UInt32Value { value: 1_048_576 }),
        ..Default::default()
    });
    let def = ok(&listener_with(&h));
    let h2 = def.chains[0].hcm().expect("http chain").h2;
    assert_eq!(h2.max_concurrent_streams, 100);
    assert_eq!(h2.stream_window, Some(65536));
    assert_eq!(h2.connection_window, Some(1_048_576));
    assert_eq!(h2.max_header_list, 96 * 1024);

    let mut h = base_hcm();
    h.http2_protocol_options = Some(corepb::Http2ProtocolOptions {
        initial_stream_window_size: Some(UInt32Value { value: 1000 }),
        ..Default::default()
    });
    hcm_rejected(
        h,
        "http2_protocol_options.initial_stream_window_size: 1000 is out of range (65535 to 2147483647)",
    );
    let mut h = base_hcm();
    h.http2_protocol_options = Some(corepb::Http2ProtocolOptions {
        max_concurrent_streams: Some(UInt32Value { value: 0 }),
        ..Default::default()
    });
    hcm_rejected(
        h,
        "http2_protocol_options.max_concurrent_streams: 0 is out of range (1 to 2147483647)",
    );
}

#[test]
fn the_routers_suppress_envoy_headers_is_kept_and_what_it_cannot_do_refused() {
    let with = |r: Router| {
        let mut h = base_hcm();
        if let Some(f) = h.http_filters.last_mut() {
            f.config_type = Some(hcm::http_filter::ConfigType::TypedConfig(
                envoy_types::util::pack_any(r),
            ));
        }
        h
    };
    let d = ok(&listener_with(&with(Router {
        suppress_envoy_headers: true,
        ..Default::default()
    })));
    assert!(
        d.chains[0]
            .hcm()
            .expect("http chain")
            .suppress_envoy_headers
    );
    let d = ok(&listener_with(&base_hcm()));
    assert!(
        !d.chains[0]
            .hcm()
            .expect("http chain")
            .suppress_envoy_headers
    );
    for (r, needle) in [
        (
            Router {
                strict_check_headers: vec!["x-envoy-max-retries".into()],
                ..Default::default()
            },
            "router strict_check_headers is not supported",
        ),
        (
            Router {
                respect_expected_rq_timeout: true,
                ..Default::default()
            },
            "router respect_expected_rq_timeout is not supported",
        ),
        (
            Router {
                upstream_http_filters: vec![Default::default()],
                ..Default::default()
            },
            "router upstream_http_filters are not supported",
        ),
    ] {
        hcm_rejected(with(r), needle);
    }
}

#[test]
fn listener_and_codec_options_that_change_answers_are_refused_with_their_names() {
    let mut l = listener();
    l.transparent = Some(BoolValue { value: true });
    rejected(&l, "transparent is not supported");
    let mut l = listener();
    l.freebind = Some(BoolValue { value: true });
    rejected(&l, "freebind is not supported");
    type Set = fn(&mut hcm::HttpConnectionManager);
    let cases: Vec<(Set, &str)> = vec![
        (
            |h| {
                h.http_protocol_options = Some(corepb::Http1ProtocolOptions {
                    allow_chunked_length: true,
                    ..Default::default()
                })
            },
            "http_protocol_options.allow_chunked_length: only Envoy's default is supported",
        ),
        (
            |h| {
                h.http_protocol_options = Some(corepb::Http1ProtocolOptions {
                    allow_absolute_url: Some(BoolValue { value: false }),
                    ..Default::default()
                })
            },
            "http_protocol_options.allow_absolute_url: only Envoy's default is supported",
        ),
        (
            |h| {
                h.http2_protocol_options = Some(corepb::Http2ProtocolOptions {
                    custom_settings_parameters: vec![Default::default()],
                    ..Default::default()
                })
            },
            "http2_protocol_options.custom_settings_parameters are not supported",
        ),
        (
            |h| {
                h.common_http_protocol_options = Some(corepb::HttpProtocolOptions {
                    max_response_headers_kb: Some(envoy_types::pb::google::protobuf::UInt32Value {
                        value: 80,
                    }),
                    ..Default::default()
                })
            },
            "max_response_headers_kb cannot be set on a connection manager",
        ),
        (
            |h| {
                h.tracing = Some(hcm::http_connection_manager::Tracing {
                    no_context_propagation: true,
                    ..Default::default()
                })
            },
            "tracing.no_context_propagation is not supported",
        ),
    ];
    for (set, needle) in cases {
        let mut h = base_hcm();
        set(&mut h);
        hcm_rejected(h, needle);
    }
}
