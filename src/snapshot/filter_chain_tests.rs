//! Envoy's filter chain selection order: port, server name, transport, application protocol.

use super::*;

fn m(port: u16, names: &[&str], transport: &str, alpn: &[&str]) -> ChainMatch {
    let proto = lpb::FilterChainMatch {
        destination_port: (port != 0).then_some(envoy_types::pb::google::protobuf::UInt32Value {
            value: u32::from(port),
        }),
        server_names: names.iter().map(|s| s.to_string()).collect(),
        transport_protocol: transport.into(),
        application_protocols: alpn.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    };
    ChainMatch::translate(Some(&proto)).expect("valid match")
}

fn pick(
    chains: &[ChainMatch],
    port: u16,
    sni: &str,
    transport: &str,
    alpn: &[&str],
) -> Option<usize> {
    let alpn: Vec<String> = alpn.iter().map(|s| s.to_string()).collect();
    select(
        chains,
        &Conn {
            destination_port: port,
            server_name: sni,
            transport_protocol: transport,
            application_protocols: &alpn,
        },
    )
}

#[test]
fn exact_server_name_beats_wildcards_and_the_longest_wildcard_wins() {
    let chains = [
        m(0, &["*.example.com"], "", &[]),
        m(0, &["www.example.com"], "", &[]),
        m(0, &["*.b.example.com"], "", &[]),
        m(0, &[], "", &[]),
    ];
    assert_eq!(pick(&chains, 443, "www.example.com", "tls", &[]), Some(1));
    assert_eq!(pick(&chains, 443, "x.example.com", "tls", &[]), Some(0));
    assert_eq!(pick(&chains, 443, "a.b.example.com", "tls", &[]), Some(2));
    // A wildcard needs a label in front of it.
    assert_eq!(pick(&chains, 443, "example.com", "tls", &[]), Some(3));
    assert_eq!(pick(&chains, 443, "", "raw_buffer", &[]), Some(3));
}

#[test]
fn server_names_are_matched_case_insensitively() {
    let chains = [m(0, &["WWW.Example.com"], "", &[])];
    assert_eq!(pick(&chains, 443, "www.example.com", "tls", &[]), Some(0));
}

#[test]
fn a_matching_server_name_does_not_fall_back_when_the_transport_differs() {
    // Envoy never backtracks: the name matched, so the catch-all chain is out.
    let chains = [m(0, &["a.com"], "tls", &[]), m(0, &[], "", &[])];
    assert_eq!(pick(&chains, 80, "a.com", "raw_buffer", &[]), None);
    assert_eq!(pick(&chains, 80, "b.com", "raw_buffer", &[]), Some(1));
}

#[test]
fn a_destination_port_entry_shadows_the_catch_all_port() {
    let chains = [m(8443, &["a.com"], "", &[]), m(0, &[], "", &[])];
    assert_eq!(pick(&chains, 8443, "a.com", "tls", &[]), Some(0));
    assert_eq!(pick(&chains, 8443, "b.com", "tls", &[]), None);
    assert_eq!(pick(&chains, 9000, "b.com", "tls", &[]), Some(1));
}

#[test]
fn transport_protocol_exact_then_any() {
    let chains = [m(0, &[], "tls", &[]), m(0, &[], "raw_buffer", &[])];
    assert_eq!(pick(&chains, 80, "", "tls", &[]), Some(0));
    assert_eq!(pick(&chains, 80, "", "raw_buffer", &[]), Some(1));
    let chains = [m(0, &[], "tls", &[]), m(0, &[], "", &[])];
    assert_eq!(pick(&chains, 80, "", "raw_buffer", &[]), Some(1));
}

#[test]
fn application_protocols_follow_the_clients_order() {
    let chains = [
        m(0, &[], "", &["h2"]),
        m(0, &[], "", &["http/1.1"]),
        m(0, &[], "", &[]),
    ];
    assert_eq!(pick(&chains, 80, "", "tls", &["http/1.1", "h2"]), Some(1));
    assert_eq!(pick(&chains, 80, "", "tls", &["h2", "http/1.1"]), Some(0));
    assert_eq!(pick(&chains, 80, "", "tls", &["spdy/3"]), Some(2));
    assert_eq!(pick(&chains, 80, "", "tls", &[]), Some(2));
}

#[test]
fn partial_wildcards_and_unsupported_criteria_are_rejected() {
    let bad = lpb::FilterChainMatch {
        server_names: vec!["foo*.example.com".into()],
        ..Default::default()
    };
    assert_eq!(
        ChainMatch::translate(Some(&bad)).unwrap_err(),
        "partial wildcards are not supported in \"server_names\""
    );
    let ranges = lpb::FilterChainMatch {
        source_ports: vec![1234],
        ..Default::default()
    };
    assert!(ChainMatch::translate(Some(&ranges))
        .unwrap_err()
        .contains("source_ports"));
}

#[test]
fn overlapping_matches_are_rejected() {
    let a = m(0, &["a.com", "b.com"], "", &[]);
    let b = m(0, &["b.com"], "", &[]);
    assert_eq!(
        check_overlaps(&[("a", &a), ("b", &b)]).unwrap_err(),
        "multiple filter chains with overlapping matching rules are defined"
    );
    let c = m(0, &["c.com"], "", &[]);
    assert!(check_overlaps(&[("a", &a), ("c", &c)]).is_ok());
    assert_eq!(
        check_overlaps(&[("a", &a), ("a2", &a.clone())]).unwrap_err(),
        "filter chain 'a2' has the same matching rules defined as 'a'"
    );
}
