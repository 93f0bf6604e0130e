//! Routing behaviour of a gateway fed over ADS: route matching, traffic
//! splitting, host matching, local replies, forwarded headers and stats.

mod common;

use common::*;
use envoy_types::pb::google::protobuf::BoolValue;

const HOST: &str = "bookinfo.example.com";

fn reviews(subset: &str) -> String {
    subset_cluster(subset, "reviews")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_match_selects_subset() {
    let v1 = Backend::start("reviews-v1").await;
    let v2 = Backend::start("reviews-v2").await;
    let (c1, c2) = (reviews("v1"), reviews("v2"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "bookinfo",
                    &[HOST],
                    vec![
                        rt(with_header(prefix("/"), "x-version", "v2"), to_cluster(&c2)),
                        rt(prefix("/"), to_cluster(&c1)),
                    ],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[(&c1, &v1), (&c2, &v2)])
    })
    .await;
    mesh.wait_backend("/reviews/1", HOST, &[], "reviews-v1")
        .await;

    for _ in 0..5 {
        let with = mesh.get("/reviews/1", HOST, &[("x-version", "v2")]).await;
        assert_eq!(
            (with.status, with.body.as_str()),
            (200, "reviews-v2"),
            "{with:?}"
        );
        let without = mesh.get("/reviews/1", HOST, &[]).await;
        assert_eq!((without.status, without.body.as_str()), (200, "reviews-v1"));
        // Exact match: another value is not a match.
        let other = mesh.get("/reviews/1", HOST, &[("x-version", "v3")]).await;
        assert_eq!(other.backend(), Some("reviews-v1"));
    }
    assert!(v1.served() + v2.served() >= 15);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_clusters_split_80_20() {
    let v1 = Backend::start("reviews-v1").await;
    let v2 = Backend::start("reviews-v2").await;
    let (c1, c2) = (reviews("v1"), reviews("v2"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "bookinfo",
                    &[HOST],
                    vec![rt(prefix("/"), weighted(&[(&c1, 80), (&c2, 20)]))],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[(&c1, &v1), (&c2, &v2)])
    })
    .await;
    mesh.wait_status("/", HOST, 200).await;

    const N: usize = 1000;
    let (mut n1, mut n2) = (0usize, 0usize);
    for i in 0..N {
        let r = mesh.get("/", HOST, &[]).await;
        match (r.status, r.backend()) {
            (200, Some("reviews-v1")) => n1 += 1,
            (200, Some("reviews-v2")) => n2 += 1,
            _ => panic!("request {i} failed: {r:?}"),
        }
    }
    assert_eq!(n1 + n2, N);
    let share = n1 as f64 * 100.0 / N as f64;
    // Outside 73..87 has probability 4e-8 for p=0.8, n=1000 (binomial, computed).
    assert!(
        (73.0..=87.0).contains(&share),
        "v1 share {share}% (v1={n1}, v2={n2}), expected 80±7"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn safe_regex_matches_the_whole_path() {
    let v1 = Backend::start("reviews-v1").await;
    let v2 = Backend::start("reviews-v2").await;
    let (c1, c2) = (reviews("v1"), reviews("v2"));
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "bookinfo",
                    &[HOST],
                    vec![
                        rt(regex("/api/v[0-9]+"), to_cluster(&c1)),
                        rt(prefix("/api/"), to_cluster(&c2)),
                        rt(path("/exact"), to_cluster(&c1)),
                    ],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[(&c1, &v1), (&c2, &v2)])
    })
    .await;
    mesh.wait_backend("/api/v1", HOST, &[], "reviews-v1").await;

    let cases: &[(&str, u16, Option<&str>)] = &[
        ("/api/v1", 200, Some("reviews-v1")),
        ("/api/v42", 200, Some("reviews-v1")),
        // The query string is stripped before regex and exact path matching.
        ("/api/v1?page=2", 200, Some("reviews-v1")),
        ("/exact?x=1", 200, Some("reviews-v1")),
        // Not a whole-path match: falls through to the next route.
        ("/api/v1/x", 200, Some("reviews-v2")),
        ("/api/vx", 200, Some("reviews-v2")),
        // Anchored at the start too, and no catch-all route: 404.
        ("/x/api/v1", 404, None),
        ("/exact/", 404, None),
        ("/EXACT", 404, None),
    ];
    for (p, status, backend) in cases {
        let r = mesh.get(p, HOST, &[]).await;
        assert_eq!((r.status, r.backend()), (*status, *backend), "{p}: {r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_host_is_404() {
    let v1 = Backend::start("reviews-v1").await;
    let c1 = reviews("v1");
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "bookinfo",
                    &[HOST],
                    vec![rt(prefix("/"), to_cluster(&c1))],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[(&c1, &v1)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "reviews-v1").await;

    for host in ["unknown.example.com", "example.com", "bookinfo.example.co"] {
        let r = mesh.get("/", host, &[]).await;
        assert_eq!(r.status, 404, "{host}: {r:?}");
        // Envoy's "no route" local reply has an empty body.
        assert_eq!(r.body, "", "{host}");
        assert_eq!(r.header("x-envoy-upstream-service-time"), None);
    }
    // Domain matching is case-insensitive.
    let r = mesh.get("/", "BookInfo.Example.COM", &[]).await;
    assert_eq!(r.backend(), Some("reviews-v1"), "{r:?}");
    assert!(v1.served() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcard_domains_and_host_port() {
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(&route_name(port), host_match_vhosts())],
        ..Default::default()
    })
    .await;
    mesh.wait_status("/", HOST, 200).await;

    let cases: &[(&str, u16, &str)] = &[
        (HOST, 200, "exact"),
        // An exact domain wins over a suffix wildcard.
        ("x.example.com", 200, "suffix"),
        // A suffix wildcard spans several labels.
        ("a.b.example.com", 200, "suffix"),
        // ...but needs at least one character before the suffix.
        ("example.com", 404, ""),
        ("api.internal", 200, "prefix"),
        // By default the port is part of the host that is matched.
        ("bookinfo.example.com:8080", 404, ""),
        ("x.example.com:8080", 404, ""),
        ("bookinfo.example.com:9999", 200, "with-port"),
    ];
    for (host, status, body) in cases {
        let r = mesh.get("/", host, &[]).await;
        assert_eq!((r.status, r.body.as_str()), (*status, *body), "host {host}");
    }

    // RouteConfiguration.ignore_port_in_host_matching makes the port irrelevant.
    let mut rc = route_config(&route_name(mesh.port), host_match_vhosts());
    rc.ignore_port_in_host_matching = true;
    mesh.ads.set_routes("2", &[rc]);
    mesh.ads.wait_for_ack(RDS, "2", PROPAGATION).await;
    let r = mesh.wait_status("/", "x.example.com:8080", 200).await;
    assert_eq!(r.body, "suffix");
    let r = mesh.get("/", "bookinfo.example.com:8080", &[]).await;
    assert_eq!((r.status, r.body.as_str()), (200, "exact"));
}

fn host_match_vhosts() -> Vec<envoy_types::pb::envoy::config::route::v3::VirtualHost> {
    vec![
        vhost(
            "exact",
            &[HOST],
            vec![rt(prefix("/"), direct(200, "exact"))],
        ),
        vhost(
            "suffix",
            &["*.example.com"],
            vec![rt(prefix("/"), direct(200, "suffix"))],
        ),
        vhost(
            "prefix",
            &["api.*"],
            vec![rt(prefix("/"), direct(200, "prefix"))],
        ),
        vhost(
            "with-port",
            &["bookinfo.example.com:9999"],
            vec![rt(prefix("/"), direct(200, "with-port"))],
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_replies_direct_response_and_no_upstream() {
    let c_empty = reviews("v0");
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "bookinfo",
                &[HOST],
                vec![
                    rt(path("/teapot"), direct(418, "short and stout")),
                    rt(path("/empty"), to_cluster(&c_empty)),
                    rt(
                        path("/missing"),
                        to_cluster("outbound|9080|v9|missing.default.svc.cluster.local"),
                    ),
                ],
            )],
        )],
        clusters: vec![eds_cluster(&c_empty)],
        endpoints: vec![cla(&c_empty, &[])],
        ..Default::default()
    })
    .await;

    let r = mesh.wait_status("/teapot", HOST, 418).await;
    assert_eq!(r.body, "short and stout");
    assert_eq!(r.header("content-type"), Some("text/plain"));
    assert_eq!(r.header("x-envoy-upstream-service-time"), None);

    // A cluster with zero endpoints: 503 with Envoy's local-reply body.
    let r = mesh.get("/empty", HOST, &[]).await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (503, "no healthy upstream"),
        "{r:?}"
    );
    assert_eq!(r.header("content-type"), Some("text/plain"));

    // A route to a cluster that does not exist: 503, empty body.
    let r = mesh.get("/missing", HOST, &[]).await;
    assert_eq!((r.status, r.body.as_str()), (503, ""), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_headers_default_hcm() {
    let v1 = Backend::start("reviews-v1").await;
    let c1 = reviews("v1");
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "bookinfo",
                    &[HOST],
                    vec![rt(prefix("/"), to_cluster(&c1))],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[(&c1, &v1)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "reviews-v1").await;

    // use_remote_address unset: x-forwarded-for passes through untouched and
    // is not added when absent.
    let r = mesh.get("/", HOST, &[]).await;
    assert_eq!(r.header("x-echo-xff"), None, "{r:?}");
    let r = mesh
        .get(
            "/",
            HOST,
            &[("x-forwarded-for", "203.0.113.7, 198.51.100.1")],
        )
        .await;
    assert_eq!(r.header("x-echo-xff"), Some("203.0.113.7, 198.51.100.1"));

    // x-request-id: a UUID is generated when absent, a client one is kept.
    let r = mesh.get("/", HOST, &[]).await;
    let rid = r.header("x-echo-request-id").unwrap_or_default();
    assert!(is_uuid(rid), "generated x-request-id {rid:?}");
    let r2 = mesh.get("/", HOST, &[]).await;
    assert_ne!(
        r2.header("x-echo-request-id"),
        Some(rid),
        "ids must be unique"
    );
    let r = mesh.get("/", HOST, &[("x-request-id", "req-123")]).await;
    assert_eq!(r.header("x-echo-request-id"), Some("req-123"));
    // The generated id is not returned to the client by default.
    assert_eq!(r.header("x-request-id"), None);

    // Upstream timing header on proxied responses, in whole milliseconds.
    let t = r
        .header("x-envoy-upstream-service-time")
        .unwrap_or_default();
    assert!(
        t.parse::<u64>().is_ok(),
        "x-envoy-upstream-service-time {t:?}"
    );
    // The Host header reaches the upstream unchanged.
    assert_eq!(r.header("x-echo-host"), Some(HOST));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarded_headers_use_remote_address() {
    let v1 = Backend::start("reviews-v1").await;
    let c1 = reviews("v1");
    // What Istio configures on gateways.
    let mesh = Mesh::start_raw(|port| {
        let mut h = hcm(port);
        h.use_remote_address = Some(BoolValue { value: true });
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "bookinfo",
                    &[HOST],
                    vec![rt(prefix("/"), to_cluster(&c1))],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[(&c1, &v1)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "reviews-v1").await;

    // The peer is appended. For a loopback peer Envoy appends the node's own
    // (non-loopback) address instead of 127.0.0.1, so only "an address of this
    // host" is asserted.
    let r = mesh.get("/", HOST, &[]).await;
    let xff = r.header("x-echo-xff").unwrap_or_default().to_string();
    assert!(
        is_local_address(&xff),
        "x-forwarded-for {xff:?} is not one local address"
    );

    // Appended with "," and no space.
    let r = mesh
        .get("/", HOST, &[("x-forwarded-for", "203.0.113.7")])
        .await;
    let xff = r.header("x-echo-xff").unwrap_or_default();
    let appended = xff.strip_prefix("203.0.113.7,").unwrap_or_default();
    assert!(is_local_address(appended), "x-forwarded-for {xff:?}");

    // An edge request (XFF now has more than one hop, so it is external):
    // the client's x-request-id is replaced by a fresh UUID.
    let r = mesh
        .get(
            "/",
            HOST,
            &[
                ("x-forwarded-for", "203.0.113.7"),
                ("x-request-id", "req-123"),
            ],
        )
        .await;
    let rid = r.header("x-echo-request-id").unwrap_or_default();
    assert!(
        is_uuid(rid),
        "x-request-id {rid:?} should have been regenerated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_counts_upstream_requests() {
    let v1 = Backend::start("reviews-v1").await;
    let r1 = Backend::start("ratings-v1").await;
    let c1 = reviews("v1");
    // A dot-free name shows the canonical metric shape.
    let c_plain = "ratings-v1";
    let mesh = Mesh::start(|port| {
        Snapshot {
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "bookinfo",
                    &[HOST],
                    vec![
                        rt(prefix("/ratings"), to_cluster(c_plain)),
                        rt(prefix("/"), to_cluster(&c1)),
                    ],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[(&c1, &v1), (c_plain, &r1)])
    })
    .await;
    mesh.wait_backend("/", HOST, &[], "reviews-v1").await;
    mesh.wait_backend("/ratings", HOST, &[], "ratings-v1").await;

    let count = |text: &str, cluster: &str| {
        let (metric, label) = envoy_cluster_metric(cluster, "upstream_rq_total");
        prom_value(text, &metric, "envoy_cluster_name", &label)
    };
    let before = mesh.gw.prometheus().await;
    assert!(
        before.contains(r#"envoy_cluster_upstream_rq_total{envoy_cluster_name="ratings-v1"}"#),
        "canonical series missing:\n{before}"
    );
    assert!(
        before.contains(
            r#"envoy_cluster_default_svc_cluster_local_upstream_rq_total{envoy_cluster_name="outbound|9080|v1|reviews"}"#
        ),
        "Istio-named cluster series missing:\n{before}"
    );
    let (b1, b_plain) = (count(&before, &c1), count(&before, c_plain));
    assert!(
        b1 >= 1.0 && b_plain >= 1.0,
        "warm-up requests must be counted"
    );

    const N: usize = 25;
    const M: usize = 7;
    for _ in 0..N {
        assert_eq!(mesh.get("/", HOST, &[]).await.status, 200);
    }
    for _ in 0..M {
        assert_eq!(mesh.get("/ratings", HOST, &[]).await.status, 200);
    }
    eventually(
        "upstream_rq_total to count the requests",
        PROPAGATION,
        || async {
            let now = mesh.gw.prometheus().await;
            let (d1, d_plain) = (count(&now, &c1) - b1, count(&now, c_plain) - b_plain);
            if d1 == N as f64 && d_plain == M as f64 {
                Ok(())
            } else {
                Err(format!("deltas {d1} (want {N}) and {d_plain} (want {M})"))
            }
        },
    )
    .await;
}
