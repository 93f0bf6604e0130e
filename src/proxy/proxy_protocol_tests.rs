//! The PROXY protocol parser against the cases Envoy's filter distinguishes.

use super::*;

fn cfg() -> ProxyProtocol {
    ProxyProtocol {
        allow_without: false,
        allow_v1: true,
        allow_v2: true,
        stat_prefix: String::new(),
    }
}

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

fn v2(cmd: u8, fam: u8, addrs: &[u8], tlvs: &[u8]) -> Vec<u8> {
    let mut h = V2_SIGNATURE.to_vec();
    h.push(cmd);
    h.push(fam);
    let len = (addrs.len() + tlvs.len()) as u16;
    h.extend_from_slice(&len.to_be_bytes());
    h.extend_from_slice(addrs);
    h.extend_from_slice(tlvs);
    h
}

fn v4_block() -> Vec<u8> {
    let mut a = vec![192, 0, 2, 7, 10, 0, 0, 1];
    a.extend_from_slice(&5555u16.to_be_bytes());
    a.extend_from_slice(&443u16.to_be_bytes());
    a
}

#[test]
fn v1_tcp4_and_tcp6_give_source_and_destination() {
    let line = b"PROXY TCP4 192.0.2.7 10.0.0.1 5555 443\r\nGET / HTTP/1.1\r\n";
    assert_eq!(
        parse(line, &cfg()),
        Parse::Done {
            len: 40,
            version: Version::V1,
            addrs: Some((sa("192.0.2.7:5555"), sa("10.0.0.1:443")))
        }
    );
    let line = b"PROXY TCP6 2001:db8::7 2001:db8::1 5555 443\r\n";
    match parse(line, &cfg()) {
        Parse::Done { addrs, .. } => assert_eq!(
            addrs,
            Some((sa("[2001:db8::7]:5555"), sa("[2001:db8::1]:443")))
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn v1_unknown_keeps_the_socket_addresses() {
    assert_eq!(
        parse(b"PROXY UNKNOWN\r\n", &cfg()),
        Parse::Done {
            len: 15,
            version: Version::V1,
            addrs: None
        }
    );
}

#[test]
fn v1_errors() {
    for bad in [
        &b"PROXY TCP4 192.0.2.7 10.0.0.1 5555\r\n"[..],
        b"PROXY TCP4 2001:db8::7 10.0.0.1 5555 443\r\n",
        b"PROXY TCP4 192.0.2.7 10.0.0.1 5555 70000\r\n",
        b"PROXY TCP5 192.0.2.7 10.0.0.1 5555 443\r\n",
        b"PROXY TCP4 0.0.0.0 10.0.0.1 5555 443\r\n",
        b"PROXY TCP4 224.0.0.1 10.0.0.1 5555 443\r\n",
    ] {
        assert_eq!(
            parse(bad, &cfg()),
            Parse::Error(Version::V1),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
    // A request without a header: not a v1 signature once 16 bytes are in.
    assert_eq!(
        parse(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", &cfg()),
        Parse::Error(Version::NotFound)
    );
    // No CRLF within the v1 limit.
    let long = format!("PROXY TCP4 {}", "1".repeat(120));
    assert_eq!(
        parse(long.as_bytes(), &cfg()),
        Parse::Error(Version::NotFound)
    );
}

#[test]
fn partial_headers_wait_for_more() {
    assert!(matches!(parse(b"PROXY TCP4 1.2", &cfg()), Parse::More(_)));
    assert!(matches!(parse(&V2_SIGNATURE[..5], &cfg()), Parse::More(_)));
    let h = v2(0x21, 0x11, &v4_block(), &[]);
    assert_eq!(parse(&h[..20], &cfg()), Parse::More(h.len()));
}

#[test]
fn v2_inet_inet6_local_and_tlvs() {
    let h = v2(0x21, 0x11, &v4_block(), &[]);
    assert_eq!(
        parse(&h, &cfg()),
        Parse::Done {
            len: 28,
            version: Version::V2,
            addrs: Some((sa("192.0.2.7:5555"), sa("10.0.0.1:443")))
        }
    );
    // TLVs are skipped over (and counted in the length).
    let h = v2(
        0x21,
        0x11,
        &v4_block(),
        &[0x01, 0x00, 0x02, b'h', b'2', 0x04, 0, 0],
    );
    assert!(matches!(parse(&h, &cfg()), Parse::Done { len: 36, .. }));
    // A TLV running past the header is malformed.
    let h = v2(0x21, 0x11, &v4_block(), &[0x01, 0x00, 0x09, b'h']);
    assert_eq!(parse(&h, &cfg()), Parse::Error(Version::V2));
    // IPv6 over DGRAM is accepted as Envoy accepts it.
    let mut a = [0u8; 36].to_vec();
    a[15] = 7;
    a[31] = 1;
    a[32..34].copy_from_slice(&5555u16.to_be_bytes());
    a[34..36].copy_from_slice(&443u16.to_be_bytes());
    a[0] = 0x20;
    a[1] = 0x01;
    a[16] = 0x20;
    a[17] = 0x01;
    let h = v2(0x21, 0x22, &a, &[]);
    match parse(&h, &cfg()) {
        Parse::Done { addrs, .. } => {
            assert_eq!(addrs, Some((sa("[2001::7]:5555"), sa("[2001::1]:443"))))
        }
        other => panic!("{other:?}"),
    }
    // LOCAL: health checks from the balancer keep the real addresses; the block is skipped.
    let h = v2(0x20, 0x00, &[1, 2, 3], &[]);
    assert_eq!(
        parse(&h, &cfg()),
        Parse::Done {
            len: 19,
            version: Version::V2,
            addrs: None
        }
    );
}

#[test]
fn v2_errors() {
    // Version 1 in the binary header, AF_UNIX, a short address block, an unknown command.
    for h in [
        v2(0x11, 0x11, &v4_block(), &[]),
        v2(0x21, 0x31, &[0u8; 216], &[]),
        v2(0x21, 0x11, &v4_block()[..8], &[]),
        v2(0x22, 0x11, &v4_block(), &[]),
        v2(0x21, 0x13, &v4_block(), &[]),
    ] {
        assert_eq!(parse(&h, &cfg()), Parse::Error(Version::V2), "{h:?}");
    }
}

#[test]
fn requests_without_a_header_pass_when_allowed() {
    let allow = ProxyProtocol {
        allow_without: true,
        ..cfg()
    };
    assert_eq!(parse(b"GET / HTTP/1.1\r\n", &allow), Parse::NotFound);
    assert_eq!(parse(&[0x16, 0x03, 0x01], &allow), Parse::NotFound);
    // A prefix of a signature waits.
    assert!(matches!(parse(b"PRO", &allow), Parse::More(_)));
    // Headers still parse.
    assert!(matches!(
        parse(b"PROXY UNKNOWN\r\n", &allow),
        Parse::Done { .. }
    ));
}

#[test]
fn disallowed_versions_are_denied() {
    let no_v1 = ProxyProtocol {
        allow_v1: false,
        ..cfg()
    };
    assert_eq!(
        parse(b"PROXY UNKNOWN\r\n", &no_v1),
        Parse::Denied(Version::V1)
    );
    let no_v2 = ProxyProtocol {
        allow_v2: false,
        ..cfg()
    };
    assert_eq!(
        parse(&v2(0x21, 0x11, &v4_block(), &[]), &no_v2),
        Parse::Denied(Version::V2)
    );
    // With requests allowed through, a disallowed version's signature is just "no header".
    let lenient = ProxyProtocol {
        allow_without: true,
        ..no_v1
    };
    assert_eq!(parse(b"PROXY UNKNOWN\r\n", &lenient), Parse::NotFound);
}

#[test]
fn stats_count_as_envoy_does() {
    let s = Stats::default();
    s.count(&Outcome::Error(Version::NotFound));
    s.count(&Outcome::Error(Version::V2));
    s.count(&Outcome::Denied(Version::V1));
    s.count(&Outcome::NotFoundAllowed);
    s.count(&Outcome::Found {
        version: Version::V1,
        addrs: None,
    });
    let g = |a: &AtomicU64| a.load(Relaxed);
    assert_eq!(g(&s.downstream_cx_proxy_proto_error), 2);
    assert_eq!(g(&s.not_found_disallowed), 1);
    assert_eq!(g(&s.not_found_allowed), 1);
    assert_eq!(g(&s.v2.error), 1);
    assert_eq!((g(&s.v1.found), g(&s.v1.disallowed)), (2, 1));
}

#[tokio::test]
async fn read_consumes_exactly_the_header() {
    use tokio::io::AsyncWriteExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut server, _) = l.accept().await.expect("accept");
    // The header arrives in two pieces, the request right behind it.
    client
        .write_all(b"PROXY TCP4 192.0.2.7 ")
        .await
        .expect("write");
    let reader = tokio::spawn(async move {
        let o = read(&mut server, &cfg()).await;
        let mut rest = [0u8; 5];
        server.read_exact(&mut rest).await.expect("rest");
        (o, rest)
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    client
        .write_all(b"10.0.0.1 5555 443\r\nHELLO")
        .await
        .expect("write");
    let (o, rest) = reader.await.expect("join");
    assert_eq!(
        o,
        Outcome::Found {
            version: Version::V1,
            addrs: Some((sa("192.0.2.7:5555"), sa("10.0.0.1:443")))
        }
    );
    assert_eq!(&rest, b"HELLO");
}
