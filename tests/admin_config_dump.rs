//! `/config_dump` narrowed as istioctl and operators narrow it: `resource=`, `mask=`,
//! `name_regex=` (a whole-name match), alone and together, with `include_eds`; Envoy's
//! refusals (404 for a field no config has, 400 for one that is not a list or a mask that
//! applies nowhere). Runs against Envoy too:
//! `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test admin_config_dump`.

mod common;

use common::*;
use serde_json::{json, Value};

async fn dump(mesh: &Mesh, q: &str) -> (u16, Value, String) {
    let r = mesh.gw.admin_get(&format!("/config_dump?{q}")).await;
    let v = serde_json::from_str(&r.body).unwrap_or(Value::Null);
    (r.status, v, r.body)
}

/// Each config's (or item's) type's last part with its names: `DynamicCluster:alpha`.
fn shape(v: &Value) -> Vec<String> {
    let Some(configs) = v["configs"].as_array() else {
        return Vec::new();
    };
    configs
        .iter()
        .map(|c| {
            let t = c["@type"]
                .as_str()
                .unwrap_or("")
                .rsplit('.')
                .next()
                .unwrap_or("");
            let name = c["cluster"]["name"]
                .as_str()
                .or(c["name"].as_str())
                .or(c["endpoint_config"]["cluster_name"].as_str());
            match name {
                Some(n) => format!("{t}:{n}"),
                None => t.to_string(),
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_dump_narrowed_as_envoy() {
    let backend = Backend::start("b").await;
    let addr = backend.addr;
    let mesh = Mesh::start(move |port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "all",
                &["*"],
                vec![rt(prefix("/"), to_cluster("alpha"))],
            )],
        )],
        clusters: vec![eds_cluster("alpha"), eds_cluster("beta")],
        endpoints: vec![cla("alpha", &[addr]), cla("beta", &[addr])],
        ..Default::default()
    })
    .await;
    mesh.wait_status("/", "x", 200).await;

    let (s, v, _) = dump(&mesh, "resource=dynamic_active_clusters").await;
    assert_eq!(s, 200);
    assert_eq!(shape(&v), ["DynamicCluster:alpha", "DynamicCluster:beta"]);
    assert_eq!(
        v["configs"][0]["@type"],
        "type.googleapis.com/envoy.admin.v3.ClustersConfigDump.DynamicCluster"
    );
    assert_eq!(v["configs"][0]["version_info"], "1");

    // The regex must match the whole name; nothing left is `{}`.
    let (s, v, _) = dump(&mesh, "resource=dynamic_active_clusters&name_regex=alp").await;
    assert_eq!((s, v), (200, json!({})));
    let (_, v, _) = dump(&mesh, "resource=dynamic_active_clusters&name_regex=al.*a").await;
    assert_eq!(shape(&v), ["DynamicCluster:alpha"]);

    // A mask on each item, into the cluster (an Any).
    let (_, v, _) = dump(&mesh, "resource=dynamic_active_clusters&mask=cluster.name").await;
    assert_eq!(
        v["configs"][1],
        json!({
            "@type": "type.googleapis.com/envoy.admin.v3.ClustersConfigDump.DynamicCluster",
            "cluster": {"@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster", "name": "beta"}
        })
    );
    let (_, v, _) = dump(
        &mesh,
        "resource=dynamic_listeners&mask=name,active_state.version_info",
    )
    .await;
    let item = &v["configs"][0];
    assert_eq!(item["active_state"], json!({"version_info": "1"}));
    assert!(item["name"].is_string());
    assert_eq!(item.as_object().map(|o| o.len()), Some(3), "{item}");

    // A mask over whole configs keeps those it applies to.
    let (_, v, _) = dump(&mesh, "mask=static_clusters").await;
    assert_eq!(shape(&v), ["ClustersConfigDump"]);
    assert_eq!(
        v["configs"][0]["static_clusters"][0]["cluster"]["name"],
        "xds-grpc"
    );
    assert!(v["configs"][0].get("dynamic_active_clusters").is_none());
    let (_, v, _) = dump(&mesh, "mask=bootstrap.node.id").await;
    assert_eq!(shape(&v), ["BootstrapConfigDump"]);
    assert_eq!(
        v["configs"][0]["bootstrap"]["node"]
            .as_object()
            .map(|o| o.len()),
        Some(1)
    );

    // name_regex alone narrows every config's resources.
    let (_, v, _) = dump(&mesh, "name_regex=beta&mask=dynamic_active_clusters").await;
    assert_eq!(shape(&v), ["ClustersConfigDump"]);
    assert_eq!(
        v["configs"][0]["dynamic_active_clusters"][0]["cluster"]["name"],
        "beta"
    );
    assert_eq!(
        v["configs"][0]["dynamic_active_clusters"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    let (_, v, _) = dump(&mesh, "name_regex=beta").await;
    let clusters = v["configs"]
        .as_array()
        .and_then(|c| {
            c.iter().find(|c| {
                c["@type"]
                    .as_str()
                    .is_some_and(|t| t.ends_with("ClustersConfigDump"))
            })
        })
        .cloned()
        .unwrap_or_default();
    assert!(clusters.get("static_clusters").is_none(), "{clusters}");
    assert_eq!(
        clusters["dynamic_active_clusters"].as_array().map(Vec::len),
        Some(1)
    );

    let (_, v, _) = dump(
        &mesh,
        "resource=static_clusters&name_regex=xds-grpc&mask=cluster.name",
    )
    .await;
    assert_eq!(shape(&v), ["StaticCluster:xds-grpc"]);
    let (_, v, _) = dump(&mesh, "resource=dynamic_endpoint_configs&include_eds").await;
    assert_eq!(
        shape(&v),
        ["DynamicEndpointConfig:alpha", "DynamicEndpointConfig:beta"]
    );

    // Refusals.
    let (s, _, body) = dump(&mesh, "resource=nothing").await;
    assert_eq!((s, body.trim()), (404, "nothing not found in config dump"));
    let (s, _, body) = dump(&mesh, "resource=bootstrap").await;
    assert_eq!(
        (s, body.trim()),
        (
            400,
            "bootstrap is not a repeated field. Use ?mask=bootstrap to get only this field"
        )
    );
    let (s, _, body) = dump(&mesh, "mask=dynamic_active_clusters.cluster.name").await;
    assert_eq!(
        (s, body.trim()),
        (
            400,
            "FieldMask dynamic_active_clusters.cluster.name could not be successfully applied to any configs."
        )
    );
    let (s, _, _) = dump(&mesh, "resource=dynamic_listeners&mask=nope").await;
    assert_eq!(s, 400);
}

/// One stat's value from `/stats` (text).
async fn stat(mesh: &Mesh, name: &str) -> Option<u64> {
    let r = mesh
        .gw
        .admin_get(&format!(
            "/stats?filter=%5E{}%24",
            name.replace('.', "%5C.")
        ))
        .await;
    r.body.lines().find_map(|l| {
        let (k, v) = l.split_once(": ")?;
        (k == name).then(|| v.trim().parse().ok())?
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_counters_zeroes_counters_and_leaves_gauges() {
    let backend = Backend::start("b").await;
    let addr = backend.addr;
    let mesh = Mesh::start(move |port| Snapshot {
        routes: vec![route_config(
            &route_name(port),
            vec![vhost(
                "all",
                &["*"],
                vec![rt(prefix("/"), to_cluster("alpha"))],
            )],
        )],
        clusters: vec![eds_cluster("alpha")],
        endpoints: vec![cla("alpha", &[addr])],
        ..Default::default()
    })
    .await;
    mesh.wait_status("/", "x", 200).await;
    for _ in 0..3 {
        assert_eq!(mesh.get("/", "x", &[]).await.status, 200);
    }
    let total = "cluster.alpha.upstream_rq_total";
    assert!(stat(&mesh, total).await.is_some_and(|v| v >= 3));
    let members = stat(&mesh, "cluster.alpha.membership_total").await;
    assert_eq!(members, Some(1));
    let r = raw_http1(
        mesh.gw.admin_port,
        b"POST /reset_counters HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\n\r\n",
        false,
    )
    .await;
    assert_eq!((r.status, r.body_str().as_str()), (200, "OK\n"));
    assert_eq!(stat(&mesh, total).await, Some(0));
    assert_eq!(stat(&mesh, "cluster.alpha.membership_total").await, members);
    assert_eq!(mesh.get("/", "x", &[]).await.status, 200);
    assert_eq!(stat(&mesh, total).await, Some(1));
}
