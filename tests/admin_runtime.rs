//! The runtime's layers on `/runtime`, and `POST /runtime_modify` into the admin layer, as
//! Envoy answers them. Runs against Envoy too.

mod common;

use common::*;

async fn post(gw: &Gateway, path: &str) -> (u16, String) {
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    );
    let port = gw
        .admin_url("")
        .trim_start_matches("http://127.0.0.1:")
        .parse::<u16>()
        .expect("port");
    let r = raw_http1(port, req.as_bytes(), false).await;
    (r.status, r.body_str())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_modify_sets_the_admin_layer() {
    let ads = AdsServer::start_any("1", &Snapshot::default()).await;
    let gw = Gateway::start_bootstrap(|admin| {
        format!(
            "{}layered_runtime:\n  layers:\n  - name: global config\n    static_layer: {{re2.max_program_size.error_level: 32768, some.flag: true}}\n  - name: admin\n    admin_layer: {{}}\n",
            bootstrap_yaml(admin, ads.port)
        )
    })
    .await;
    assert_eq!(
        post(&gw, "/runtime_modify?some.flag=false&new.key=7").await,
        (200, "OK\n".into())
    );
    let rt: serde_json::Value =
        serde_json::from_str(&gw.admin_get("/runtime").await.body).expect("json");
    assert_eq!(rt["layers"], serde_json::json!(["global config", "admin"]));
    assert_eq!(rt["entries"]["new.key"]["final_value"], "7", "{rt:#}");
    assert_eq!(
        rt["entries"]["new.key"]["layer_values"],
        serde_json::json!(["", "7"])
    );
    assert_eq!(rt["entries"]["some.flag"]["final_value"], "false", "{rt:#}");
    assert_eq!(
        rt["entries"]["re2.max_program_size.error_level"]["final_value"],
        "32768"
    );
    let r = gw.admin_get("/runtime_modify?x=1").await;
    assert_eq!(r.status, 405);
}
