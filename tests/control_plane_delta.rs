//! `portico control-plane` serving incremental (delta) xDS: a gateway whose bootstrap asks
//! for `ads_config.api_type: DELTA_GRPC`, as istio-agent's does since Istio 1.22, comes up,
//! routes, and gets only what an edit changes. What travels is read on both sides: the
//! control plane's log (one `delta push` line per response, with the names sent and
//! removed) and the gateway's `/config_dump` (per-resource versions).
//!
//! Run against Envoy with PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh).

mod common;
mod control_plane_support;

use std::collections::BTreeMap;

use common::*;
use control_plane_support::*;
use serde_json::Value;

const LABELS: [(&str, &str); 1] = [("istio", "ingressgateway")];

/// The bootstrap istio-agent writes since Istio 1.22: the tests' usual one, on delta ADS.
fn delta_bootstrap(admin_port: u16, ads_port: u16) -> String {
    let sotw = bootstrap_yaml_labeled(admin_port, ads_port, &LABELS);
    let delta = sotw.replace("api_type: GRPC", "api_type: DELTA_GRPC");
    assert_ne!(
        delta, sotw,
        "the bootstrap has an ads_config.api_type to change"
    );
    delta
}

/// One `delta push` line of the control plane's log.
#[derive(Debug, Clone, PartialEq)]
struct Push {
    kind: String,
    sent: Vec<String>,
    removed: Vec<String>,
}

/// The `["a", "b"]` list that follows `after` in `line`.
fn list_after(line: &str, after: &str) -> Vec<String> {
    let Some(rest) = line.split_once(after).map(|(_, r)| r) else {
        return Vec::new();
    };
    let Some(body) = rest.strip_prefix('[').and_then(|r| r.split_once(']')) else {
        return Vec::new();
    };
    body.0
        .split(", ")
        .map(|n| n.trim_matches('"').to_string())
        .filter(|n| !n.is_empty())
        .collect()
}

fn pushes(log: &str) -> Vec<Push> {
    log.lines()
        .filter_map(|l| {
            let rest = l.split_once("delta push ")?.1;
            let (kind, rest) = rest.split_once(": ")?;
            Some(Push {
                kind: kind.to_string(),
                sent: list_after(rest, "sent "),
                removed: list_after(rest, "removed "),
            })
        })
        .collect()
}

async fn config_dump(gw: &Gateway) -> Value {
    let r = get(&gw.admin_url("/config_dump"), None, &[]).await;
    assert_eq!(r.status, 200, "GET /config_dump: {}", r.body);
    serde_json::from_str(&r.body).expect("config_dump is JSON")
}

/// Per dynamic resource of one kind: name -> (version_info, last_updated).
fn dumped(
    dump: &Value,
    section: &str,
    list: &str,
    item: &str,
) -> BTreeMap<String, (String, String)> {
    let mut out = BTreeMap::new();
    for c in dump["configs"].as_array().into_iter().flatten() {
        let Some(t) = c["@type"].as_str() else {
            continue;
        };
        if !t.ends_with(section) {
            continue;
        }
        for r in c[list].as_array().into_iter().flatten() {
            let name = r[item]["name"].as_str().unwrap_or_default().to_string();
            let version = r["version_info"].as_str().unwrap_or_default().to_string();
            let updated = r["last_updated"].as_str().unwrap_or_default().to_string();
            out.insert(name, (version, updated));
        }
    }
    out
}

fn clusters(dump: &Value) -> BTreeMap<String, (String, String)> {
    dumped(
        dump,
        "ClustersConfigDump",
        "dynamic_active_clusters",
        "cluster",
    )
}

fn routes(dump: &Value) -> BTreeMap<String, (String, String)> {
    dumped(
        dump,
        "RoutesConfigDump",
        "dynamic_route_configs",
        "route_config",
    )
}

fn listeners(dump: &Value) -> BTreeMap<String, (String, String)> {
    let mut out = BTreeMap::new();
    for c in dump["configs"].as_array().into_iter().flatten() {
        if !c["@type"]
            .as_str()
            .unwrap_or("")
            .ends_with("ListenersConfigDump")
        {
            continue;
        }
        for l in c["dynamic_listeners"].as_array().into_iter().flatten() {
            let Some(active) = l.get("active_state") else {
                continue;
            };
            out.insert(
                l["name"].as_str().unwrap_or_default().to_string(),
                (
                    active["version_info"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    active["last_updated"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                ),
            );
        }
    }
    out
}

/// The pushes logged after the first `from`, once `done` holds for them.
async fn pushes_since(
    cp: &ControlPlane,
    from: usize,
    what: &str,
    done: impl Fn(&[Push]) -> bool,
) -> Vec<Push> {
    eventually(what, PROPAGATION, || {
        let all = pushes(&cp.log());
        let new = all.get(from..).unwrap_or_default().to_vec();
        let result = if done(&new) {
            Ok(new)
        } else {
            Err(format!("pushes so far: {new:?}"))
        };
        async move { result }
    })
    .await
}

struct Setup {
    _tmp: TempDir,
    dir: std::path::PathBuf,
    v1: Backend,
    v2: Backend,
    cp: ControlPlane,
    gw: Gateway,
    url: String,
}

async fn setup(name: &str) -> Setup {
    let tmp = TempDir::new(name);
    let dir = tmp.path.join("config");
    std::fs::create_dir_all(&dir).expect("config dir");
    let v1 = Backend::start("reviews-v1").await;
    let v2 = Backend::start("reviews-v2").await;
    let gw_port = free_port();
    write_config(
        &dir,
        gw_port,
        &[
            ("reviews-v1", "v1", v1.addr.port()),
            ("reviews-v2", "v2", v2.addr.port()),
        ],
        &[("v1", 100)],
    );
    let cp = ControlPlane::start(&dir, &tmp.path).await;
    let gw = Gateway::start_bootstrap(|admin| delta_bootstrap(admin, cp.port)).await;
    let url = format!("http://127.0.0.1:{gw_port}/reviews/1");
    wait_backend(&url, "reviews-v1").await;
    Setup {
        _tmp: tmp,
        dir,
        v1,
        v2,
        cp,
        gw,
        url,
    }
}

fn kinds(p: &[Push]) -> Vec<&str> {
    p.iter().map(|p| p.kind.as_str()).collect()
}

#[tokio::test]
async fn a_delta_gateway_comes_up_ready_and_routes() {
    let s = setup("portico-cp-delta-up").await;
    let log = s.cp.log();
    let first = pushes(&log);
    // Every type the gateway uses came over the delta stream, wildcard CDS and LDS whole.
    for kind in ["CDS", "EDS", "LDS", "RDS"] {
        assert!(
            kinds(&first).contains(&kind),
            "no delta {kind} push in:\n{log}"
        );
    }
    let cds: Vec<String> = first
        .iter()
        .filter(|p| p.kind == "CDS")
        .flat_map(|p| p.sent.clone())
        .collect();
    for c in [
        "outbound|9080|v1|reviews.default.svc.cluster.local",
        "outbound|9080|v2|reviews.default.svc.cluster.local",
    ] {
        assert!(cds.iter().any(|n| n == c), "{c} not sent: {cds:?}");
    }
    // Each resource the gateway holds carries its own version (a content hash).
    let dump = config_dump(&s.gw).await;
    let held = clusters(&dump);
    let v1 = &held["outbound|9080|v1|reviews.default.svc.cluster.local"].0;
    let v2 = &held["outbound|9080|v2|reviews.default.svc.cluster.local"].0;
    assert!(v1.len() == 16 && v2.len() == 16 && v1 != v2, "{held:?}");
    assert!(s.v1.served() > 0 && s.v2.served() == 0);
}

#[tokio::test]
async fn an_edit_pushes_only_the_changed_resources() {
    let s = setup("portico-cp-delta-edit").await;
    let before = config_dump(&s.gw).await;
    let from = pushes(&s.cp.log()).len();

    // A route edit: only the route configuration travels.
    write(
        &s.dir,
        "virtualservice.yaml",
        &virtual_service(&[("v2", 100)]),
    );
    wait_backend(&s.url, "reviews-v2").await;
    let new = pushes_since(&s.cp, from, "the RDS push", |p| !p.is_empty()).await;
    assert_eq!(
        new,
        [Push {
            kind: "RDS".into(),
            sent: vec![route_name_of(&before)],
            removed: Vec::new(),
        }],
        "a route edit sends the one route configuration and nothing else"
    );
    let after = config_dump(&s.gw).await;
    assert_eq!(clusters(&after), clusters(&before), "clusters untouched");
    assert_eq!(listeners(&after), listeners(&before), "listeners untouched");
    assert_ne!(
        routes(&after),
        routes(&before),
        "the route configuration changed"
    );

    // An endpoint edit: only the one subset's assignment travels.
    let from = pushes(&s.cp.log()).len();
    let v2b = Backend::start("reviews-v2b").await;
    write(
        &s.dir,
        "endpointslices.yaml",
        &endpoint_slices(&[
            ("reviews-v1", "v1", s.v1.addr.port()),
            ("reviews-v2", "v2", v2b.addr.port()),
        ]),
    );
    wait_backend(&s.url, "reviews-v2b").await;
    let new = pushes_since(&s.cp, from, "the EDS push", |p| !p.is_empty()).await;
    assert_eq!(kinds(&new), ["EDS"], "{new:?}");
    // The service's default cluster holds every pod, v2's holds v2's: both changed; v1's not.
    let mut sent = new[0].sent.clone();
    sent.sort();
    assert_eq!(
        sent,
        [
            "outbound|9080|v2|reviews.default.svc.cluster.local",
            "outbound|9080||reviews.default.svc.cluster.local",
        ]
    );
    let last = config_dump(&s.gw).await;
    assert_eq!(
        clusters(&last),
        clusters(&before),
        "clusters untouched by EDS"
    );
}

fn route_name_of(dump: &Value) -> String {
    let names: Vec<String> = routes(dump).into_keys().collect();
    assert_eq!(names.len(), 1, "one route configuration: {names:?}");
    names[0].clone()
}

#[tokio::test]
async fn removed_objects_are_removed_from_the_gateway() {
    let s = setup("portico-cp-delta-remove").await;
    let from = pushes(&s.cp.log()).len();

    // No VirtualService: the route configuration stays, answering 404 (istiod's blackhole).
    std::fs::remove_file(s.dir.join("virtualservice.yaml")).expect("remove vs");
    eventually("404 once the VirtualService is gone", PROPAGATION, || {
        let url = s.url.clone();
        async move {
            match get(&url, None, &[]).await.status {
                404 => Ok(()),
                other => Err(format!("status {other}")),
            }
        }
    })
    .await;
    let new = pushes_since(&s.cp, from, "the RDS push", |p| !p.is_empty()).await;
    assert_eq!(kinds(&new), ["RDS"], "{new:?}");

    // No Service (nor its rule and slices): its clusters and assignments are removed.
    let from = pushes(&s.cp.log()).len();
    for f in [
        "service.yaml",
        "destinationrule.yaml",
        "endpointslices.yaml",
    ] {
        std::fs::remove_file(s.dir.join(f)).expect("remove");
    }
    let reviews = |n: &String| n.ends_with("reviews.default.svc.cluster.local");
    let new = pushes_since(&s.cp, from, "the CDS and EDS removals", |p| {
        p.iter().any(|p| p.kind == "CDS") && p.iter().any(|p| p.kind == "EDS")
    })
    .await;
    let cds = new.iter().find(|p| p.kind == "CDS").expect("CDS");
    assert!(cds.sent.is_empty(), "{cds:?}");
    assert_eq!(
        cds.removed.iter().filter(|n| reviews(n)).count(),
        3,
        "{cds:?}"
    );
    let eds = new.iter().find(|p| p.kind == "EDS").expect("EDS");
    assert!(
        eds.removed.iter().all(reviews) && !eds.removed.is_empty(),
        "{eds:?}"
    );
    eventually("the gateway drops the clusters", PROPAGATION, || {
        let gw = &s.gw;
        async move {
            let held = clusters(&config_dump(gw).await);
            match held.keys().filter(|n| reviews(n)).count() {
                0 => Ok(()),
                n => Err(format!("{n} reviews clusters still held: {held:?}")),
            }
        }
    })
    .await;

    // No Gateway: its listener is removed.
    let from = pushes(&s.cp.log()).len();
    std::fs::remove_file(s.dir.join("gateway.yaml")).expect("remove gateway");
    let new = pushes_since(&s.cp, from, "the LDS removal", |p| {
        p.iter().any(|p| p.kind == "LDS")
    })
    .await;
    let lds = new.iter().find(|p| p.kind == "LDS").expect("LDS");
    assert_eq!((lds.sent.len(), lds.removed.len()), (0, 1), "{lds:?}");
    eventually("the gateway drops the listener", PROPAGATION, || {
        let gw = &s.gw;
        async move {
            let held = listeners(&config_dump(gw).await);
            if held.is_empty() {
                Ok(())
            } else {
                Err(format!("listeners still held: {held:?}"))
            }
        }
    })
    .await;
}

/// A Kubernetes Secret over SDS on the same delta stream: the HTTPS server serves its
/// certificate.
#[tokio::test]
async fn secrets_travel_on_the_delta_stream() {
    let tmp = TempDir::new("portico-cp-delta-sds");
    let dir = tmp.path.join("config");
    std::fs::create_dir_all(&dir).expect("config dir");
    let pki = Pki::new("cp-delta-ca");
    let leaf = pki.leaf(&["shop.example.com"]);
    let web = Backend::start("web").await;
    let port = free_port();
    write(
        &dir,
        "gateway.yaml",
        &shop_config(
            port,
            "HTTPS",
            "{ mode: SIMPLE, credentialName: shop-cert }",
            web.addr.port(),
        ),
    );
    write(&dir, "secret.yaml", &tls_secret("shop-cert", &leaf));
    let cp = ControlPlane::start(&dir, &tmp.path).await;
    let _gw = Gateway::start_bootstrap(|admin| delta_bootstrap(admin, cp.port)).await;
    let log = cp.log();
    let sds: Vec<Push> = pushes(&log)
        .into_iter()
        .filter(|p| p.kind == "SDS")
        .collect();
    assert_eq!(
        sds.first().map(|p| p.sent.clone()),
        Some(vec!["kubernetes://shop-cert".to_string()]),
        "{log}"
    );
    let client = pki.client();
    eventually("HTTPS with the Secret's certificate", PROPAGATION, || {
        let client = client.clone();
        let want = leaf.der.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .map_err(|e| e.to_string())?;
            let sni = rustls::pki_types::ServerName::try_from("shop.example.com")
                .map_err(|e| e.to_string())?;
            let tls = client.connect(sni, tcp).await.map_err(|e| e.to_string())?;
            let (_, conn) = tls.get_ref();
            match conn.peer_certificates() {
                Some([first, ..]) if first.as_ref() == want.as_slice() => Ok(()),
                other => Err(format!("presented {:?}", other.map(|c| c.len()))),
            }
        }
    })
    .await;
}
