//! The bootstrap's `stats_config.stats_matcher` (istio-agent sets an inclusion list): the stats
//! it leaves out exist nowhere, in `/stats` or `/stats/prometheus`; pilot-agent's readiness
//! query still finds what Istio's list includes. Runs against Envoy too.

mod common;

use common::*;

async fn names(gw: &Gateway, path: &str) -> Vec<String> {
    gw.admin_get(path)
        .await
        .body
        .lines()
        .filter_map(|l| l.split_once(": ").map(|(n, _)| n.to_string()))
        .collect()
}

async fn gateway(matcher: &str) -> (Gateway, AdsServer, Backend, u16) {
    let web = Backend::start("web").await;
    let port = free_port();
    let ads = AdsServer::start_any(
        "1",
        &Snapshot {
            listeners: vec![l(port)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "all",
                    &["*"],
                    vec![rt(prefix("/"), to_cluster("web"))],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[("web", &web)]),
    )
    .await;
    let gw = Gateway::start_bootstrap(|admin| {
        format!(
            "{}stats_config:\n  stats_matcher:\n{matcher}",
            bootstrap_yaml(admin, ads.port)
        )
    })
    .await;
    let url = format!("http://127.0.0.1:{port}/");
    eventually("traffic", std::time::Duration::from_secs(15), || async {
        let r = get(&url, Some("example.com"), &[]).await;
        (r.backend() == Some("web"))
            .then_some(())
            .ok_or(format!("{}", r.status))
    })
    .await;
    (gw, ads, web, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inclusion_list_keeps_only_what_it_names() {
    let (gw, _ads, _web, _port) = gateway(
        "    inclusion_list:\n      patterns:\n      - prefix: server.\n      - prefix: listener_manager\n      - suffix: downstream_rq_total\n",
    )
    .await;
    let all = names(&gw, "/stats").await;
    assert!(all.iter().any(|n| n == "server.state"), "{all:?}");
    assert!(all.iter().any(|n| n == "listener_manager.workers_started"));
    assert!(all
        .iter()
        .any(|n| n.starts_with("http.") && n.ends_with(".downstream_rq_total")));
    assert!(
        !all.iter()
            .any(|n| n.starts_with("cluster_manager.") || n.starts_with("cluster.")),
        "{all:?}"
    );
    let ready = names(
        &gw,
        r"/stats?usedonly&filter=^(server\.state|listener_manager\.workers_started)",
    )
    .await;
    assert_eq!(ready, ["listener_manager.workers_started", "server.state"]);
    let prom = gw.admin_get("/stats/prometheus").await.body;
    assert!(prom.contains("envoy_server_state"));
    assert!(!prom.contains("envoy_cluster_manager_"), "{prom}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exclusion_list_drops_what_it_names() {
    let (gw, _ads, _web, _port) =
        gateway("    exclusion_list:\n      patterns:\n      - prefix: cluster.\n").await;
    let all = names(&gw, "/stats").await;
    assert!(!all.iter().any(|n| n.starts_with("cluster.")), "{all:?}");
    assert!(all
        .iter()
        .any(|n| n == "cluster_manager.cds.update_success"));
    assert!(all.iter().any(|n| n.starts_with("http.")));
}
