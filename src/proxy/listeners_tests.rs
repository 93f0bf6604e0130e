//! Binding a listener's addresses: IPv6 sockets as Envoy makes them, and a listener refused
//! whole when one of its addresses cannot be bound.

use super::*;

fn la(addr: &str, v6only: bool) -> ListenAddr {
    ListenAddr {
        addr: addr.parse().expect("test address"),
        v6only,
    }
}

fn has_ipv6_loopback() -> bool {
    std::net::TcpListener::bind("[::1]:0").is_ok()
}

#[test]
fn ipv6_wildcard_is_v6only_so_it_binds_beside_the_ipv4_wildcard() {
    if !has_ipv6_loopback() {
        return;
    }
    let v4 = bind(&la("0.0.0.0:0", false)).expect("bind 0.0.0.0");
    let port = v4.local_addr().expect("bound").port();
    // Whatever net.ipv6.bindv6only says: Envoy's `::` without ipv4_compat is IPv6 only.
    let v6 = bind(&la(&format!("[::]:{port}"), true));
    assert!(v6.is_ok(), "{v6:?}");
    drop(v6);
    // With ipv4_compat the IPv6 socket would take IPv4 too: the port is taken.
    let compat = bind(&la(&format!("[::]:{port}"), false));
    assert!(compat.is_err(), "{compat:?}");
}

#[test]
fn prepare_refuses_a_listener_when_any_of_its_addresses_is_taken() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken_addr = taken.local_addr().expect("bound");
    let free = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("bound")
    };
    let mut m = ListenerManager::new(Vec::new(), Arc::new(State::new(None)));
    let mut wanted = BTreeMap::new();
    wanted.insert(
        "both".to_string(),
        vec![
            la(&free.to_string(), false),
            la(&taken_addr.to_string(), false),
        ],
    );
    wanted.insert("one".to_string(), vec![la(&free.to_string(), false)]);
    let errors = m.prepare(&wanted);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].0, "both");
    assert!(
        errors[0].1.starts_with(&format!(
            "listener 'both': cannot bind {taken_addr}: Address already in use"
        )),
        "{errors:?}"
    );
    // The trial sockets are released: the free address can be bound again.
    assert!(std::net::TcpListener::bind(free).is_ok());
}

#[tokio::test]
async fn pipelined_bytes_carried_to_the_next_request_are_seen() {
    use pingora_core::apps::HttpPersistentSettings;
    use pingora_core::protocols::http::ServerSession;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = l.local_addr().expect("addr");
    let _client = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (server, peer) = l.accept().await.expect("accept");
    let session =
        ServerSession::new_http1(Box::new(super::super::io::Downstream::new(server, peer)));
    let mut settings = HttpPersistentSettings::for_session(&session);
    assert!(!carries_pipelined_bytes(&settings));
    settings.set_pipelined_prefix(bytes::BytesMut::from(&b"GET / HTTP/1.1\r\n"[..]));
    assert!(carries_pipelined_bytes(&settings));
}
