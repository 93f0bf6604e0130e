//! `portico control-plane` end to end: Istio YAML in a directory, the control plane's ADS
//! server, a gateway (Portico, or Envoy with PORTICO_GATEWAY_BIN) configured by it, and real
//! backends. The control plane is always Portico's binary.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

const LABELS: [(&str, &str); 1] = [("istio", "ingressgateway")];

fn portico() -> Command {
    Command::new(env!("CARGO_BIN_EXE_portico"))
}

/// `portico control-plane` serving `dir` on a free port; killed on drop, its log shown if the
/// test fails.
struct ControlPlane {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl ControlPlane {
    async fn start(dir: &Path, log_dir: &Path) -> ControlPlane {
        let port = free_port();
        let log = log_dir.join(format!("control-plane-{port}.log"));
        let out = std::fs::File::create(&log).expect("create log");
        let child = portico()
            .args(["control-plane", "--config-dir"])
            .arg(dir)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--bind-address", "127.0.0.1", "--log-level", "info"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().expect("dup log")))
            .stderr(Stdio::from(out))
            .spawn()
            .expect("spawn portico control-plane");
        let mut cp = ControlPlane { child, port, log };
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if let Ok(Some(status)) = cp.child.try_wait() {
                panic!("control plane exited with {status}:\n{}", cp.log());
            }
            assert!(
                Instant::now() < deadline,
                "control plane not listening:\n{}",
                cp.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cp
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- control plane log:\n{}\n---- end", self.log());
        }
    }
}

const SERVICE: &str = r#"apiVersion: v1
kind: Service
metadata: { name: reviews, namespace: default }
spec:
  selector: { app: reviews }
  ports:
  - { name: http, port: 9080 }
"#;

const DESTINATION_RULE: &str = r#"apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: { name: reviews, namespace: default }
spec:
  host: reviews
  subsets:
  - { name: v1, labels: { version: v1 } }
  - { name: v2, labels: { version: v2 } }
"#;

/// An object the model rejects (`http` must be a list): reported, and the rest still served.
const BROKEN: &str = r#"apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: { name: broken, namespace: default }
spec:
  hosts: ["*"]
  http: "not a list"
"#;

fn gateway_yaml(port: u16) -> String {
    format!(
        r#"apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {{ name: gw, namespace: default }}
spec:
  selector: {{ istio: ingressgateway }}
  servers:
  - port: {{ number: {port}, name: http, protocol: HTTP }}
    hosts: ["*"]
"#
    )
}

/// The VirtualService sending /reviews to the given (subset, weight) pairs.
fn virtual_service(split: &[(&str, u32)]) -> String {
    let routes: String = split
        .iter()
        .map(|(subset, weight)| {
            format!("    - destination: {{ host: reviews, subset: {subset} }}\n      weight: {weight}\n")
        })
        .collect();
    format!(
        r#"apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{ name: reviews, namespace: default }}
spec:
  hosts: ["*"]
  gateways: [gw]
  http:
  - match:
    - uri: {{ prefix: /reviews }}
    route:
{routes}"#
    )
}

/// One EndpointSlice per (pod name, version, port) on 127.0.0.1.
fn endpoint_slices(pods: &[(&str, &str, u16)]) -> String {
    pods.iter()
        .map(|(name, version, port)| {
            format!(
                r#"---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}
  namespace: default
  labels: {{ kubernetes.io/service-name: reviews }}
addressType: IPv4
ports:
- {{ name: http, port: {port} }}
endpoints:
- addresses: [127.0.0.1]
  conditions: {{ ready: true }}
  targetRef: {{ kind: Pod, name: {name} }}
  labels: {{ app: reviews, version: {version} }}
"#
            )
        })
        .collect()
}

/// Writes atomically (temp file + rename) so the watcher never reads half a file; the
/// rename still changes what the watcher fingerprints.
fn write(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).expect("write config file");
    std::fs::rename(&tmp, dir.join(name)).expect("rename config file");
}

fn write_config(dir: &Path, gw_port: u16, pods: &[(&str, &str, u16)], split: &[(&str, u32)]) {
    write(dir, "gateway.yaml", &gateway_yaml(gw_port));
    write(dir, "service.yaml", SERVICE);
    write(dir, "destinationrule.yaml", DESTINATION_RULE);
    write(dir, "endpointslices.yaml", &endpoint_slices(pods));
    write(dir, "virtualservice.yaml", &virtual_service(split));
}

async fn wait_backend(url: &str, want: &str) {
    let client = HttpClient::new();
    eventually(&format!("{url} served by {want}"), PROPAGATION, || {
        let client = client.clone();
        async move {
            let r = client.get(url, None, &[]).await;
            match r.backend() {
                Some(b) if b == want => Ok(()),
                _ => Err(format!(
                    "status {} backend {:?} body {:?} error {:?}",
                    r.status,
                    r.backend(),
                    r.body,
                    r.error
                )),
            }
        }
    })
    .await;
}

#[tokio::test]
async fn traffic_follows_edits_of_the_config_dir() {
    let tmp = TempDir::new("portico-cp");
    let dir = tmp.path.join("config");
    std::fs::create_dir_all(&dir).expect("config dir");
    let v1 = Backend::start("reviews-v1").await;
    let v2 = Backend::start("reviews-v2").await;
    let v2b = Backend::start("reviews-v2b").await;
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
    write(&dir, "broken.yaml", BROKEN);

    let cp = ControlPlane::start(&dir, &tmp.path).await;
    let _gw = Gateway::start_labeled(cp.port, &LABELS).await;
    let url = format!("http://127.0.0.1:{gw_port}/reviews/1");
    wait_backend(&url, "reviews-v1").await;
    let log = cp.log();
    assert!(
        log.contains("broken.yaml: VirtualService '") && log.contains("broken': "),
        "the invalid object is logged by file, kind and name:\n{log}"
    );

    // A route edit (RDS): the VirtualService now sends everything to v2.
    write(
        &dir,
        "virtualservice.yaml",
        &virtual_service(&[("v2", 100)]),
    );
    wait_backend(&url, "reviews-v2").await;

    // An endpoint edit (EDS): subset v2's pod moves to another backend.
    write(
        &dir,
        "endpointslices.yaml",
        &endpoint_slices(&[
            ("reviews-v1", "v1", v1.addr.port()),
            ("reviews-v2", "v2", v2b.addr.port()),
        ]),
    );
    wait_backend(&url, "reviews-v2b").await;

    // A weight edit: back to v1 entirely.
    write(
        &dir,
        "virtualservice.yaml",
        &virtual_service(&[("v1", 100), ("v2", 0)]),
    );
    wait_backend(&url, "reviews-v1").await;

    // A weighted split: both subsets answer, in roughly the configured shares.
    write(
        &dir,
        "virtualservice.yaml",
        &virtual_service(&[("v1", 50), ("v2", 50)]),
    );
    wait_backend(&url, "reviews-v2b").await;
    let client = HttpClient::new();
    let mut v1_count = 0;
    for _ in 0..200 {
        match client.get(&url, None, &[]).await.backend() {
            Some("reviews-v1") => v1_count += 1,
            Some("reviews-v2b") => {}
            other => panic!("unexpected backend {other:?}"),
        }
    }
    // 200 draws at p = 0.5: outside 60..140 has probability below 1e-8.
    assert!(
        (60..=140).contains(&v1_count),
        "v1 served {v1_count} of 200"
    );
}

fn check(dir: &Path, extra: &[&str]) -> Output {
    portico()
        .args(["control-plane", "--check", "--config-dir"])
        .arg(dir)
        .args(extra)
        .output()
        .expect("run portico control-plane --check")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn check_reports_invalid_objects_and_sets_the_exit_code() {
    let tmp = TempDir::new("portico-cp-check");
    write_config(&tmp.path, 8080, &[("reviews-v1", "v1", 1)], &[("v1", 100)]);
    let ok = check(&tmp.path, &[]);
    assert!(ok.status.success(), "valid dir: {}", text(&ok.stderr));
    assert!(
        text(&ok.stdout).contains("5 objects, 0 invalid"),
        "{}",
        text(&ok.stdout)
    );

    write(&tmp.path, "broken.yaml", BROKEN);
    let bad = check(&tmp.path, &[]);
    assert_eq!(
        bad.status.code(),
        Some(1),
        "an invalid object fails --check"
    );
    let err = text(&bad.stderr);
    assert!(err.contains("broken.yaml"), "names the file: {err}");
    // The name may carry its namespace ('default/broken').
    assert!(
        err.contains("broken.yaml: VirtualService '") && err.contains("broken': "),
        "names kind and name: {err}"
    );
    assert!(
        text(&bad.stdout).contains("5 objects, 1 invalid"),
        "{}",
        text(&bad.stdout)
    );
}

#[test]
fn bad_flags_are_named() {
    let missing = portico()
        .args(["control-plane", "--config-dir", "/no/such/portico/dir"])
        .output()
        .expect("run");
    assert!(!missing.status.success());
    assert!(
        text(&missing.stderr).contains("--config-dir"),
        "{}",
        text(&missing.stderr)
    );

    let tmp = TempDir::new("portico-cp-flags");
    let listen = portico()
        .args(["control-plane", "--config-dir"])
        .arg(&tmp.path)
        .args(["--listen", "not-an-address"])
        .output()
        .expect("run");
    assert!(!listen.status.success());
    assert!(
        text(&listen.stderr).contains("--listen"),
        "{}",
        text(&listen.stderr)
    );

    let label = check(&tmp.path, &["--gateway-label", "no-equals-sign"]);
    assert!(!label.status.success());
    assert!(
        text(&label.stderr).contains("--gateway-label"),
        "{}",
        text(&label.stderr)
    );
}

/// The names istiod gives a gateway's resources, as `--check` lists them.
#[test]
fn check_lists_istio_resource_names() {
    let tmp = TempDir::new("portico-cp-names");
    write_config(
        &tmp.path,
        8080,
        &[("reviews-v1", "v1", 19082), ("reviews-v2", "v2", 19083)],
        &[("v1", 50), ("v2", 50)],
    );
    let o = check(&tmp.path, &[]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    for want in [
        "0.0.0.0_8080",
        "http.8080",
        "outbound|9080|v1|reviews.default.svc.cluster.local",
        "outbound|9080|v2|reviews.default.svc.cluster.local",
    ] {
        assert!(out.contains(want), "missing {want}:\n{out}");
    }
    // A gateway with other labels selects no Gateway: nothing to serve it.
    let other = check(&tmp.path, &["--gateway-label", "istio=other"]);
    assert!(
        text(&other.stdout).contains("listeners (0)"),
        "{}",
        text(&other.stdout)
    );
}
