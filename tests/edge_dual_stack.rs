//! Listener `additional_addresses`, as istiod renders a dual-stack gateway (ISTIO_DUAL_STACK:
//! `0.0.0.0:P` plus `[::]:P`): one listener, one socket per address, the same filter chains on
//! each. Here on loopback: `127.0.0.1:P` plus `[::1]:P` (or `127.0.0.2:P` where the machine has
//! no IPv6 loopback). Requests on every address route; `/listeners` names each address; an
//! update that drops an additional address stops listening on it; a new listener naming an
//! address another listener holds, or one that cannot be bound, is refused alone while the
//! holder keeps serving. Runs against Envoy too (PORTICO_GATEWAY_BIN), same assertions.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::listener::v3::{AdditionalAddress, Listener};

const CLUSTER: &str = "outbound|80||ds.default.svc.cluster.local";
const HOST: &str = "ds.example.com";

/// The second loopback address: IPv6 when the machine has it.
fn second_ip() -> &'static str {
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        "::1"
    } else {
        "127.0.0.2"
    }
}

fn addr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().expect("test ip"), port)
}

/// Listener `0.0.0.0_<port>` on 127.0.0.1:`port`, also listening on each of `more`.
fn listener(port: u16, more: &[SocketAddr]) -> Listener {
    let mut l = l(port);
    l.additional_addresses = more
        .iter()
        .map(|a| AdditionalAddress {
            address: Some(socket_addr(&a.ip().to_string(), a.port())),
            ..Default::default()
        })
        .collect();
    l
}

fn routes(port: u16) -> envoy_types::pb::envoy::config::route::v3::RouteConfiguration {
    route_config(
        &route_name(port),
        vec![vhost(
            "ds",
            &[HOST],
            vec![rt(prefix("/"), to_cluster(CLUSTER))],
        )],
    )
}

/// GET / on `a` over a fresh connection; the backend that answered, or what happened.
async fn backend_at(a: SocketAddr) -> Result<String, String> {
    let url = format!("http://{a}/");
    let r = HttpClient::new().get(&url, Some(HOST), &[]).await;
    match (r.status, r.backend()) {
        (200, Some(b)) => Ok(b.to_string()),
        _ => Err(format!(
            "status {} error {:?} body {:?}",
            r.status, r.error, r.body
        )),
    }
}

/// Whether something accepts TCP connections on `a`.
async fn listening(a: SocketAddr) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(a)).await,
        Ok(Ok(_))
    )
}

async fn wait_listening(a: SocketAddr, want: bool) {
    eventually(
        &format!("{a} listening: {want}"),
        PROPAGATION,
        || async move {
            if listening(a).await == want {
                Ok(())
            } else {
                Err(format!("{a} listening: {}", !want))
            }
        },
    )
    .await
}

async fn wait_routes_at(a: SocketAddr, backend: &str) {
    eventually(
        &format!("{a} to reach {backend}"),
        PROPAGATION,
        || async move {
            match backend_at(a).await {
                Ok(b) if b == backend => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_address_of_a_listener_routes_and_goes_with_it() {
    let backend = Backend::start("ds").await;
    let ip2 = second_ip();
    let mesh = Mesh::start_raw(|port| {
        Snapshot {
            listeners: vec![listener(port, &[addr(ip2, port)])],
            routes: vec![routes(port)],
            ..Default::default()
        }
        .with_backends(&[(CLUSTER, &backend)])
    })
    .await;
    let port = mesh.port;
    let primary = addr("127.0.0.1", port);
    let second = addr(ip2, port);
    let name = listener_name(port);

    // Both addresses route, through the same chain and route table.
    wait_routes_at(primary, "ds").await;
    wait_routes_at(second, "ds").await;

    // `/listeners`: one `name::address` line per socket, the primary address first.
    let text = mesh.gw.admin_get("/listeners").await.body;
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with(&name)).collect();
    assert_eq!(
        lines,
        [format!("{name}::{primary}"), format!("{name}::{second}")],
        "{text}"
    );
    // `/config_dump` shows the listener as it was sent, additional addresses included.
    let dump = mesh.gw.admin_get("/config_dump").await.body;
    assert!(dump.contains("additional_addresses"), "{dump}");

    // A new listener whose additional address the first one holds is refused alone: the
    // holder keeps both addresses, the newcomer binds nothing (not even its free primary).
    let port2 = free_port();
    let since = mesh.ads.log_len();
    mesh.ads.set_listeners(
        "2",
        &[listener(port, &[second]), listener(port2, &[second])],
    );
    let mut routes2 = vec![routes(port), routes(port2)];
    mesh.ads.set_routes("2", &routes2);
    let nack = mesh.ads.wait_for_nack_since(LDS, since, PROPAGATION).await;
    let error = nack.error.unwrap_or_default();
    assert!(error.contains(&listener_name(port2)), "{error}");
    assert!(!listening(addr("127.0.0.1", port2)).await);
    assert_eq!(backend_at(primary).await, Ok("ds".to_string()));
    assert_eq!(backend_at(second).await, Ok("ds".to_string()));

    // A listener one of whose addresses cannot be bound (something else holds it) is
    // refused alone too.
    let held = std::net::TcpListener::bind(addr(ip2, 0)).expect("hold a port");
    let held_addr = held.local_addr().expect("held address");
    let port3 = free_port();
    let since = mesh.ads.log_len();
    mesh.ads.set_listeners(
        "3",
        &[listener(port, &[second]), listener(port3, &[held_addr])],
    );
    routes2.push(routes(port3));
    mesh.ads.set_routes("3", &routes2);
    let nack = mesh.ads.wait_for_nack_since(LDS, since, PROPAGATION).await;
    let error = nack.error.unwrap_or_default();
    assert!(error.contains(&listener_name(port3)), "{error}");
    assert!(!listening(addr("127.0.0.1", port3)).await);
    assert_eq!(backend_at(second).await, Ok("ds".to_string()));
    drop(held);

    // An update that drops the additional address stops listening there; the primary
    // address keeps routing.
    mesh.ads.set_listeners("4", &[listener(port, &[])]);
    mesh.ads.wait_for_ack(LDS, "4", PROPAGATION).await;
    wait_listening(second, false).await;
    wait_routes_at(primary, "ds").await;
    let text = mesh.gw.admin_get("/listeners").await.body;
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with(&name)).collect();
    assert_eq!(lines, [format!("{name}::{primary}")], "{text}");

    // Adding it back listens there again; and with it the address the refused listener
    // wanted is now taken by nobody else, so that listener is accepted.
    mesh.ads
        .set_listeners("5", &[listener(port, &[second]), listener(port2, &[])]);
    mesh.ads.wait_for_ack(LDS, "5", PROPAGATION).await;
    wait_routes_at(second, "ds").await;
    wait_routes_at(addr("127.0.0.1", port2), "ds").await;
}

/// `filter_chain_match.destination_port` is matched against the address a connection came in
/// on, so with additional addresses on other ports each port can pick its own chain (Envoy
/// indexes chains by the connection's local port, whichever socket accepted it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destination_port_picks_the_chain_per_address() {
    use envoy_types::pb::envoy::config::listener::v3::FilterChainMatch;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
        http_connection_manager::RouteSpecifier, Rds,
    };
    use envoy_types::pb::google::protobuf::UInt32Value;
    const OTHER: &str = "outbound|81||other.default.svc.cluster.local";
    let main = Backend::start("main").await;
    let other = Backend::start("other").await;
    let ip2 = second_ip();
    let port2 = free_port();
    let mesh = Mesh::start_raw(|port| {
        let mut l = listener(port, &[addr(ip2, port2)]);
        // A first chain for connections to port2 only, with its own routes.
        let mut chain = l.filter_chains[0].clone();
        let mut h = hcm(port);
        h.route_specifier = Some(RouteSpecifier::Rds(Rds {
            config_source: Some(ads_source()),
            route_config_name: "other-port".into(),
        }));
        chain.filters[0] = listener_with(port, h).filter_chains[0].filters[0].clone();
        chain.filter_chain_match = Some(FilterChainMatch {
            destination_port: Some(UInt32Value {
                value: u32::from(port2),
            }),
            ..Default::default()
        });
        l.filter_chains.insert(0, chain);
        Snapshot {
            listeners: vec![l],
            routes: vec![
                routes(port),
                route_config(
                    "other-port",
                    vec![vhost(
                        "o",
                        &[HOST],
                        vec![rt(prefix("/"), to_cluster(OTHER))],
                    )],
                ),
            ],
            ..Default::default()
        }
        .with_backends(&[(CLUSTER, &main), (OTHER, &other)])
    })
    .await;
    wait_routes_at(addr("127.0.0.1", mesh.port), "main").await;
    wait_routes_at(addr(ip2, port2), "other").await;
}
