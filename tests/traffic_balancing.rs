//! How traffic spreads over priorities, localities and ramping hosts, and the host rewrites
//! that depend on the chosen endpoint: priority failover by the overprovisioning factor,
//! panic mode, `locality_weighted_lb_config`, slow start, `auto_host_rewrite`,
//! `host_rewrite_header`, `host_rewrite_path_regex` and `append_x_forwarded_host`. Every case
//! runs against Envoy too (PORTICO_GATEWAY_BIN).

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{
    self, common_lb_config::LocalityConfigSpecifier, CommonLbConfig,
};
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::{HealthStatus, Locality};
use envoy_types::pb::envoy::config::endpoint::v3::{
    cluster_load_assignment, lb_endpoint, ClusterLoadAssignment, Endpoint, LbEndpoint,
    LocalityLbEndpoints,
};
use envoy_types::pb::envoy::config::route::v3::{route, route_action};
use envoy_types::pb::envoy::r#type::matcher::v3::{RegexMatchAndSubstitute, RegexMatcher};
use envoy_types::pb::envoy::r#type::v3::Percent;
use envoy_types::pb::google::protobuf::{BoolValue, Duration as PDuration, UInt32Value};

const HOST: &str = "lb.example.com";

/// One endpoint: its backend, EDS health and (for `auto_host_rewrite`) hostname.
struct Ep<'a> {
    addr: SocketAddr,
    health: HealthStatus,
    hostname: &'a str,
}

fn ep(b: &Backend, health: HealthStatus) -> Ep<'static> {
    Ep {
        addr: b.addr,
        health,
        hostname: "",
    }
}

/// A locality group: priority, zone, locality weight, endpoints.
fn group(priority: u32, zone: &str, weight: Option<u32>, eps: &[Ep]) -> LocalityLbEndpoints {
    LocalityLbEndpoints {
        priority,
        locality: Some(Locality {
            zone: zone.into(),
            ..Default::default()
        }),
        load_balancing_weight: weight.map(|value| UInt32Value { value }),
        lb_endpoints: eps
            .iter()
            .map(|e| LbEndpoint {
                host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                    address: Some(socket_addr(&e.addr.ip().to_string(), e.addr.port())),
                    hostname: e.hostname.into(),
                    ..Default::default()
                })),
                health_status: e.health as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn assignment(name: &str, groups: Vec<LocalityLbEndpoints>) -> ClusterLoadAssignment {
    ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: groups,
        ..Default::default()
    }
}

fn locality_weighted(mut c: Cluster) -> Cluster {
    c.common_lb_config = Some(CommonLbConfig {
        locality_config_specifier: Some(LocalityConfigSpecifier::LocalityWeightedLbConfig(
            Default::default(),
        )),
        ..Default::default()
    });
    c
}

async fn mesh(c: Cluster, cla: ClusterLoadAssignment) -> Mesh {
    let name = c.name.clone();
    Mesh::start(move |port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "lb",
                &[HOST],
                vec![rt(prefix("/"), to_cluster(&name))],
            )],
        )],
        clusters: vec![c],
        endpoints: vec![cla],
        ..Default::default()
    })
    .await
}

/// Which backend answered each of `n` requests.
async fn spread(mesh: &Mesh, n: usize) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for _ in 0..n {
        let r = mesh.get("/", HOST, &[]).await;
        assert_eq!(r.status, 200, "{r:?}");
        *seen
            .entry(r.backend().unwrap_or("?").to_string())
            .or_insert(0) += 1;
    }
    seen
}

fn count(seen: &BTreeMap<String, usize>, name: &str) -> usize {
    seen.get(name).copied().unwrap_or(0)
}

#[track_caller]
/// `name` took `want` of the requests, give or take `slack`. Where the pick is random (the
/// priority a request goes to is drawn per request, as in Envoy), the slack is at least 5.5
/// binomial standard deviations: 400 requests split 0.25 to 0.75, +-55, fail with probability
/// below 3e-8 (computed); within a priority and between localities the choice is a
/// deterministic schedule and the slack only absorbs where it started.
fn near(seen: &BTreeMap<String, usize>, name: &str, want: usize, slack: usize) {
    let got = count(seen, name);
    assert!(
        got + slack >= want && got <= want + slack,
        "{name}: {got}, want {want} ± {slack}: {seen:?}"
    );
}

/// Pushes one endpoint assignment and waits for the gateway to accept it.
async fn push_endpoints(m: &Mesh, version: &str, cla: ClusterLoadAssignment) {
    m.ads.set_endpoints(version, &[cla]);
    m.ads
        .wait_for_ack(
            "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            version,
            PROPAGATION,
        )
        .await;
}

async fn settle(mesh: &Mesh, backend: &str) {
    mesh.wait_backend("/", HOST, &[], backend).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_priority_takes_what_p0_cannot() {
    use HealthStatus::{Healthy as H, Unhealthy as U};
    let (a, b, c) = (
        Backend::start("p0-a").await,
        Backend::start("p0-b").await,
        Backend::start("p1").await,
    );
    // P0 at half health: 1.4 x 50% = 70% stays, 30% fails over to P1.
    let m = mesh(
        eds_cluster("pool"),
        assignment(
            "pool",
            vec![
                group(0, "a", None, &[ep(&a, H), ep(&b, U)]),
                group(1, "b", None, &[ep(&c, H)]),
            ],
        ),
    )
    .await;
    settle(&m, "p1").await;
    let seen = spread(&m, 400).await;
    near(&seen, "p0-a", 280, 55);
    near(&seen, "p1", 120, 55);
    assert_eq!(count(&seen, "p0-b"), 0, "{seen:?}");

    // All of P0 down: P1 takes everything.
    push_endpoints(
        &m,
        "2",
        assignment(
            "pool",
            vec![
                group(0, "a", None, &[ep(&a, U), ep(&b, U)]),
                group(1, "b", None, &[ep(&c, H)]),
            ],
        ),
    )
    .await;
    let seen = spread(&m, 50).await;
    assert_eq!(count(&seen, "p1"), 50, "{seen:?}");

    // The overprovisioning factor comes from the assignment's policy: at 100, half health
    // keeps half the load.
    let mut half = assignment(
        "pool",
        vec![
            group(0, "a", None, &[ep(&a, H), ep(&b, U)]),
            group(1, "b", None, &[ep(&c, H)]),
        ],
    );
    half.policy = Some(cluster_load_assignment::Policy {
        overprovisioning_factor: Some(UInt32Value { value: 100 }),
        ..Default::default()
    });
    push_endpoints(&m, "3", half).await;
    let seen = spread(&m, 400).await;
    near(&seen, "p0-a", 200, 55);
    near(&seen, "p1", 200, 55);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_mode_as_envoy_decides_it() {
    use HealthStatus::{Healthy as H, Unhealthy as U};
    let (a, b, c, d) = (
        Backend::start("p0-a").await,
        Backend::start("p0-b").await,
        Backend::start("p0-c").await,
        Backend::start("p1").await,
    );
    // P0 at 1/3 health is under the 50% threshold, but P1 brings the total to 100%: no
    // panic. P0 keeps 140 / 3 = 46% on its healthy host, P1 takes 54%.
    let m = mesh(
        eds_cluster("pool"),
        assignment(
            "pool",
            vec![
                group(0, "a", None, &[ep(&a, H), ep(&b, U), ep(&c, U)]),
                group(1, "b", None, &[ep(&d, H)]),
            ],
        ),
    )
    .await;
    settle(&m, "p1").await;
    let seen = spread(&m, 400).await;
    near(&seen, "p0-a", 184, 55);
    near(&seen, "p1", 216, 55);
    assert_eq!(count(&seen, "p0-b") + count(&seen, "p0-c"), 0, "{seen:?}");

    // Every level under the threshold: load by host count over all hosts, whatever their
    // health (3 of 4 hosts on P0), and counted as lb_healthy_panic.
    push_endpoints(
        &m,
        "2",
        assignment(
            "pool",
            vec![
                group(0, "a", None, &[ep(&a, U), ep(&b, U), ep(&c, U)]),
                group(1, "b", None, &[ep(&d, U)]),
            ],
        ),
    )
    .await;
    let seen = spread(&m, 400).await;
    for name in ["p0-a", "p0-b", "p0-c"] {
        near(&seen, name, 100, 55);
    }
    near(&seen, "p1", 100, 55);
    let stats = m.gw.prometheus().await;
    let (metric, label) = envoy_cluster_metric("pool", "lb_healthy_panic");
    assert!(
        prom_value(&stats, &metric, "envoy_cluster_name", &label) >= 400.0,
        "{metric}"
    );

    // With the panic threshold at 0 there is no panic: nothing healthy means 503.
    let mut c0 = eds_cluster("pool");
    c0.common_lb_config = Some(CommonLbConfig {
        healthy_panic_threshold: Some(Percent { value: 0.0 }),
        ..Default::default()
    });
    m.ads.set_clusters("3", &[c0]);
    // Envoy warms the updated cluster with a fresh EDS response.
    m.ads.set_endpoints(
        "3",
        &[assignment(
            "pool",
            vec![
                group(0, "a", None, &[ep(&a, U), ep(&b, U), ep(&c, U)]),
                group(1, "b", None, &[ep(&d, U)]),
            ],
        )],
    );
    m.ads
        .wait_for_ack(
            "type.googleapis.com/envoy.config.cluster.v3.Cluster",
            "3",
            PROPAGATION,
        )
        .await;
    let r = eventually("503 with no healthy host", PROPAGATION, || async {
        let r = m.get("/", HOST, &[]).await;
        if r.status == 503 {
            Ok(r)
        } else {
            Err(format!("{r:?}"))
        }
    })
    .await;
    assert_eq!(r.body, "no healthy upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn localities_take_traffic_by_weight_and_availability() {
    use HealthStatus::{Healthy as H, Unhealthy as U};
    let (a, b1, b2, c) = (
        Backend::start("zone-a").await,
        Backend::start("zone-b1").await,
        Backend::start("zone-b2").await,
        Backend::start("zone-c").await,
    );
    // Zone a weight 1, zone b weight 3, zone c has no weight (never chosen when locality
    // weighting is on).
    let groups = |b2_health| {
        vec![
            group(0, "a", Some(1), &[ep(&a, H)]),
            group(0, "b", Some(3), &[ep(&b1, H), ep(&b2, b2_health)]),
            group(0, "c", None, &[ep(&c, H)]),
        ]
    };
    let m = mesh(
        locality_weighted(eds_cluster("pool")),
        assignment("pool", groups(H)),
    )
    .await;
    settle(&m, "zone-a").await;
    let seen = spread(&m, 400).await;
    near(&seen, "zone-a", 100, 12);
    near(&seen, "zone-b1", 150, 20);
    near(&seen, "zone-b2", 150, 20);
    assert_eq!(count(&seen, "zone-c"), 0, "{seen:?}");

    // Half of zone b down: its availability is min(1, 1.4 x 0.5) = 0.7, so a : b = 1 : 2.1.
    push_endpoints(&m, "2", assignment("pool", groups(U))).await;
    let seen = spread(&m, 310).await;
    near(&seen, "zone-a", 100, 12);
    near(&seen, "zone-b1", 210, 12);
    assert_eq!(
        count(&seen, "zone-b2") + count(&seen, "zone-c"),
        0,
        "{seen:?}"
    );

    // Without locality weighting every host counts alike.
    m.ads.set_clusters("3", &[eds_cluster("pool")]);
    push_endpoints(&m, "3", assignment("pool", groups(H))).await;
    eventually("zone-c serves", PROPAGATION, || async {
        let r = m.get("/", HOST, &[]).await;
        if r.backend() == Some("zone-c") {
            Ok(())
        } else {
            Err(format!("{r:?}"))
        }
    })
    .await;
    let seen = spread(&m, 400).await;
    for name in ["zone-a", "zone-b1", "zone-b2", "zone-c"] {
        near(&seen, name, 100, 10);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_round_robin_with_locality_weighting_as_envoy_gateway_renders_it() {
    use envoy_types::pb::envoy::extensions::load_balancing_policies::common::v3 as common;
    use envoy_types::pb::envoy::extensions::load_balancing_policies::round_robin::v3::RoundRobin;
    use HealthStatus::Healthy as H;
    let (a, b) = (
        Backend::start("zone-a").await,
        Backend::start("zone-b").await,
    );
    let mut c = eds_cluster("pool");
    c.load_balancing_policy = Some(envoy_types::pb::envoy::config::cluster::v3::LoadBalancingPolicy {
        policies: vec![
            envoy_types::pb::envoy::config::cluster::v3::load_balancing_policy::Policy {
                typed_extension_config: Some(
                    envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig {
                        name: "envoy.load_balancing_policies.round_robin".into(),
                        typed_config: Some(any(RoundRobin {
                            locality_lb_config: Some(common::LocalityLbConfig {
                                locality_config_specifier: Some(
                                    common::locality_lb_config::LocalityConfigSpecifier::LocalityWeightedLbConfig(
                                        Default::default(),
                                    ),
                                ),
                            }),
                            slow_start_config: None,
                        })),
                    },
                ),
            },
        ],
    });
    let m = mesh(
        c,
        assignment(
            "pool",
            vec![
                group(0, "a", Some(1), &[ep(&a, H)]),
                group(0, "b", Some(4), &[ep(&b, H)]),
            ],
        ),
    )
    .await;
    settle(&m, "zone-a").await;
    let seen = spread(&m, 250).await;
    near(&seen, "zone-a", 50, 8);
    near(&seen, "zone-b", 200, 8);
}

fn slow_start_cluster(window_ms: i64) -> Cluster {
    let mut c = eds_cluster("pool");
    c.lb_config = Some(cluster::LbConfig::RoundRobinLbConfig(
        cluster::RoundRobinLbConfig {
            slow_start_config: Some(cluster::SlowStartConfig {
                slow_start_window: Some(PDuration {
                    seconds: window_ms / 1000,
                    nanos: ((window_ms % 1000) * 1_000_000) as i32,
                }),
                ..Default::default()
            }),
        },
    ));
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_host_ramps_up_over_the_slow_start_window() {
    use HealthStatus::Healthy as H;
    let (old, new) = (Backend::start("old").await, Backend::start("new").await);
    let window = Duration::from_secs(4);
    let m = mesh(
        slow_start_cluster(window.as_millis() as i64),
        assignment("pool", vec![group(0, "a", None, &[ep(&old, H)])]),
    )
    .await;
    settle(&m, "old").await;
    // The first host's own window passes before the second arrives.
    tokio::time::sleep(window + Duration::from_millis(500)).await;
    push_endpoints(
        &m,
        "2",
        assignment(
            "pool",
            vec![group(0, "a", None, &[ep(&old, H), ep(&new, H)])],
        ),
    )
    .await;
    // Early in its window the new host weighs 10% to 25% of the old one's.
    let started = std::time::Instant::now();
    let seen = spread(&m, 100).await;
    let early = count(&seen, "new");
    assert!(
        started.elapsed() < window / 2,
        "the early sample took {:?}",
        started.elapsed()
    );
    assert!(
        (1..=35).contains(&early),
        "new host early in slow start: {seen:?}"
    );
    // After the window both weigh the same.
    let since = started.elapsed();
    tokio::time::sleep((window + Duration::from_millis(300)).saturating_sub(since)).await;
    let seen = spread(&m, 200).await;
    near(&seen, "new", 100, 25);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_rewrites_from_the_endpoint_a_header_or_the_path() {
    let echo = EchoBackend::start("echo").await;
    let with_host = |spec: route_action::HostRewriteSpecifier, xfh: bool| {
        let mut a = to_cluster("named");
        if let route::Action::Route(ra) = &mut a {
            ra.host_rewrite_specifier = Some(spec);
            ra.append_x_forwarded_host = xfh;
        }
        a
    };
    use route_action::HostRewriteSpecifier as HR;
    let auto = || HR::AutoHostRewrite(BoolValue { value: true });
    let echo_addr = echo.addr;
    let m = Mesh::start(move |port| {
        let mut plain_auto = to_cluster("plain");
        if let route::Action::Route(ra) = &mut plain_auto {
            ra.host_rewrite_specifier = Some(auto());
            ra.append_x_forwarded_host = true;
        }
        let mut dns = Cluster {
            name: "dns".into(),
            cluster_discovery_type: Some(cluster::ClusterDiscoveryType::Type(
                cluster::DiscoveryType::StrictDns as i32,
            )),
            dns_lookup_family: cluster::DnsLookupFamily::V4Only as i32,
            connect_timeout: Some(PDuration {
                seconds: 1,
                nanos: 0,
            }),
            ..Default::default()
        };
        dns.load_assignment = Some(ClusterLoadAssignment {
            cluster_name: "dns".into(),
            endpoints: vec![LocalityLbEndpoints {
                lb_endpoints: vec![LbEndpoint {
                    host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                        address: Some(socket_addr("localhost", echo_addr.port())),
                        ..Default::default()
                    })),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            ..Default::default()
        });
        let mut dns_auto = to_cluster("dns");
        if let route::Action::Route(ra) = &mut dns_auto {
            ra.host_rewrite_specifier = Some(auto());
        }
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "rw",
                    &[HOST],
                    vec![
                        rt(prefix("/auto"), with_host(auto(), true)),
                        rt(prefix("/plain"), plain_auto),
                        rt(prefix("/dns"), dns_auto),
                        rt(
                            prefix("/header"),
                            with_host(HR::HostRewriteHeader("x-target-host".into()), true),
                        ),
                        rt(
                            prefix("/regex"),
                            with_host(
                                HR::HostRewritePathRegex(RegexMatchAndSubstitute {
                                    pattern: Some(RegexMatcher {
                                        regex: "^/regex/([^/]+).*$".into(),
                                        ..Default::default()
                                    }),
                                    substitution: "\\1.internal".into(),
                                }),
                                false,
                            ),
                        ),
                    ],
                )],
            )],
            clusters: vec![eds_cluster("named"), eds_cluster("plain"), dns],
            endpoints: vec![
                assignment(
                    "named",
                    vec![group(
                        0,
                        "a",
                        None,
                        &[Ep {
                            addr: echo_addr,
                            health: HealthStatus::Healthy,
                            hostname: "pod-1.reviews.example",
                        }],
                    )],
                ),
                cla("plain", &[echo_addr]),
            ],
            ..Default::default()
        }
    })
    .await;
    mesh_ready(&m).await;
    // The endpoint's EDS hostname, with the original host appended to x-forwarded-host.
    let r = m.get("/auto", HOST, &[]).await;
    assert_eq!(
        r.header("x-echo-host"),
        Some("pod-1.reviews.example"),
        "{r:?}"
    );
    assert_eq!(r.header("x-echo-forwarded-host"), Some(HOST), "{r:?}");
    let r = m
        .get("/auto", HOST, &[("x-forwarded-host", "edge.example")])
        .await;
    assert_eq!(
        r.header("x-echo-forwarded-host"),
        Some("edge.example,lb.example.com"),
        "{r:?}"
    );
    // No hostname on the endpoint: the Host stays, and nothing is appended.
    let r = m.get("/plain", HOST, &[]).await;
    assert_eq!(r.header("x-echo-host"), Some(HOST), "{r:?}");
    assert_eq!(r.header("x-echo-forwarded-host"), None, "{r:?}");
    // A DNS cluster's host is named by the name it was resolved from.
    let r = eventually("the DNS cluster answers", PROPAGATION, || async {
        let r = m.get("/dns", HOST, &[]).await;
        if r.status == 200 {
            Ok(r)
        } else {
            Err(format!("{r:?}"))
        }
    })
    .await;
    assert_eq!(r.header("x-echo-host"), Some("localhost"), "{r:?}");
    // From a request header; without it (or empty) the Host stays.
    let r = m
        .get("/header", HOST, &[("x-target-host", "from-header.example")])
        .await;
    assert_eq!(
        r.header("x-echo-host"),
        Some("from-header.example"),
        "{r:?}"
    );
    assert_eq!(r.header("x-echo-forwarded-host"), Some(HOST), "{r:?}");
    let r = m.get("/header", HOST, &[]).await;
    assert_eq!(r.header("x-echo-host"), Some(HOST), "{r:?}");
    assert_eq!(r.header("x-echo-forwarded-host"), None, "{r:?}");
    // From the path, without its query.
    let r = m.get("/regex/ratings/v1?x=1", HOST, &[]).await;
    assert_eq!(r.header("x-echo-host"), Some("ratings.internal"), "{r:?}");
    assert_eq!(r.header("x-echo-path"), Some("/regex/ratings/v1?x=1"));
}

async fn mesh_ready(m: &Mesh) {
    m.wait_status("/plain", HOST, 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_least_request_follows_the_weights() {
    // Envoy's least request with unequal weights schedules by weight over active requests:
    // one request at a time, that is the weights.
    let (light, heavy) = (Backend::start("light").await, Backend::start("heavy").await);
    let mut c = eds_cluster("pool");
    c.lb_policy = cluster::LbPolicy::LeastRequest as i32;
    let mut cla = assignment(
        "pool",
        vec![group(
            0,
            "a",
            None,
            &[
                ep(&light, HealthStatus::Healthy),
                ep(&heavy, HealthStatus::Healthy),
            ],
        )],
    );
    cla.endpoints[0].lb_endpoints[1].load_balancing_weight = Some(UInt32Value { value: 3 });
    let m = mesh(c, cla).await;
    settle(&m, "light").await;
    let seen = spread(&m, 400).await;
    near(&seen, "light", 100, 30);
    near(&seen, "heavy", 300, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_maglev_table_weighs_localities_when_locality_weighting_is_on() {
    use envoy_types::pb::envoy::config::route::v3::route_action::hash_policy::{
        Header, PolicySpecifier,
    };
    use HealthStatus::Healthy as H;
    let (a, b) = (
        Backend::start("zone-a").await,
        Backend::start("zone-b").await,
    );
    let mut c = locality_weighted(eds_cluster("pool"));
    c.lb_policy = cluster::LbPolicy::Maglev as i32;
    let cla = assignment(
        "pool",
        vec![
            group(0, "a", Some(1), &[ep(&a, H)]),
            group(0, "b", Some(3), &[ep(&b, H)]),
        ],
    );
    let m = Mesh::start(move |port| {
        let mut action = to_cluster("pool");
        if let route::Action::Route(ra) = &mut action {
            ra.hash_policy = vec![route_action::HashPolicy {
                policy_specifier: Some(PolicySpecifier::Header(Header {
                    header_name: "x-user".into(),
                    regex_rewrite: None,
                })),
                terminal: false,
            }];
        }
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost("lb", &[HOST], vec![rt(prefix("/"), action)])],
            )],
            clusters: vec![c],
            endpoints: vec![cla],
            ..Default::default()
        }
    })
    .await;
    m.wait_status("/", HOST, 200).await;
    // Equal host weights, but zone b's locality weighs 3: it owns about three quarters of the
    // table, so of many distinct keys about 75% land there.
    let mut on_b = 0;
    for k in 0..400 {
        let user = format!("user-{k}");
        let r = m.get("/", HOST, &[("x-user", user.as_str())]).await;
        if r.backend() == Some("zone-b") {
            on_b += 1;
        }
    }
    assert!((260..340).contains(&on_b), "{on_b} of 400 keys on zone b");
}
