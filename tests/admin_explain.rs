//! `GET /explain` (Portico only: Envoy has no such endpoint): the listener, chain, virtual
//! host, route, action and each endpoint's eligibility for a request, from the serving
//! snapshot, answered as the request path would decide.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_says_where_a_request_would_go_and_why() {
    if is_envoy(&gateway_bin()) {
        return;
    }
    let (a, b, c) = (
        Backend::start("a").await,
        Backend::start("b").await,
        Backend::start("c").await,
    );
    let mesh = Mesh::start(|port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![
                vhost(
                    "shop",
                    &["shop.example.com"],
                    vec![
                        rt(
                            with_header(prefix("/cart"), "x-canary", "1"),
                            to_cluster("canary"),
                        ),
                        rt(prefix("/cart"), weighted(&[("stable", 90), ("canary", 10)])),
                    ],
                ),
                vhost(
                    "other",
                    &["other.example.com"],
                    vec![rt(prefix("/"), direct(204, ""))],
                ),
            ],
        )],
        clusters: vec![eds_cluster("stable"), eds_cluster("canary")],
        endpoints: vec![
            cla_localities(
                "stable",
                vec![locality_at(
                    0,
                    vec![
                        lb_ep(a.addr, EdsHealth::Healthy, None),
                        lb_ep(b.addr, EdsHealth::Unhealthy, None),
                    ],
                )],
            ),
            cla_localities(
                "canary",
                vec![locality_at(
                    0,
                    vec![lb_ep(c.addr, EdsHealth::Degraded, None)],
                )],
            ),
        ],
        ..Default::default()
    })
    .await;
    mesh.wait_status("/", "other.example.com", 204).await;
    let explain = |q: &str| {
        let url = mesh.gw.admin_url(&format!("/explain?{q}"));
        async move {
            let r = get(&url, None, &[]).await;
            (
                r.status,
                serde_json::from_str::<serde_json::Value>(&r.body)
                    .unwrap_or(serde_json::Value::String(r.body)),
            )
        }
    };
    let (status, e) = explain("authority=shop.example.com&path=/cart/1").await;
    assert_eq!(status, 200, "{e}");
    assert_eq!(e["virtual_host"], "shop");
    assert_eq!(e["route"]["index"], 1, "{e:#}");
    let forward = e["action"]["forward"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(forward.len(), 2, "{e:#}");
    assert_eq!(forward[0]["cluster"], "stable");
    assert_eq!(forward[0]["weight"], 90);
    let hosts = forward[0]["hosts"].as_array().cloned().unwrap_or_default();
    let eligibility = |addr: std::net::SocketAddr| {
        hosts
            .iter()
            .find(|h| h["address"] == addr.to_string())
            .map(|h| h["eligibility"].as_str().unwrap_or("").to_string())
            .unwrap_or_default()
    };
    assert_eq!(eligibility(a.addr), "eligible");
    assert!(eligibility(b.addr).starts_with("unhealthy"), "{e:#}");
    // A header match picks the first route.
    let (_, e) = explain("authority=SHOP.example.com&path=/cart/1&header=x-canary:1").await;
    assert_eq!(e["route"]["index"], 0, "{e:#}");
    let canary = &e["action"]["forward"][0];
    assert!(
        canary["hosts"][0]["eligibility"]
            .as_str()
            .unwrap_or("")
            .starts_with("degraded"),
        "{e:#}"
    );
    // Misses say why.
    let (_, e) = explain("authority=nowhere.example.com&path=/").await;
    assert!(
        e["outcome"]
            .as_str()
            .unwrap_or("")
            .starts_with("404: no virtual host"),
        "{e:#}"
    );
    let (_, e) = explain("authority=shop.example.com&path=/elsewhere").await;
    assert!(
        e["outcome"]
            .as_str()
            .unwrap_or("")
            .contains("has no route matching"),
        "{e:#}"
    );
    let (_, e) = explain("authority=other.example.com&path=/x").await;
    assert_eq!(e["action"]["direct_response"], 204);
    // A bad query is a 400 naming the parameter.
    let (status, e) = explain("path=/").await;
    assert_eq!(
        (status, e),
        (
            400,
            serde_json::Value::String("authority: required\n".into())
        )
    );
}
