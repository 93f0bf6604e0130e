//! What the control plane tests share (tests/control_plane.rs, state of the world, and
//! tests/control_plane_delta.rs): `portico control-plane` as a process, and the Istio YAML
//! they write into its directory.
#![allow(dead_code)] // each test binary uses what it needs

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;

use crate::common::*;

pub fn portico() -> Command {
    Command::new(env!("CARGO_BIN_EXE_portico"))
}

/// `portico control-plane` serving `dir` on a free port; killed on drop, its log shown if the
/// test fails.
pub struct ControlPlane {
    child: Child,
    pub port: u16,
    log: PathBuf,
}

impl ControlPlane {
    pub async fn start(dir: &Path, log_dir: &Path) -> ControlPlane {
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

    pub fn log(&self) -> String {
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

pub const SERVICE: &str = r#"apiVersion: v1
kind: Service
metadata: { name: reviews, namespace: default }
spec:
  selector: { app: reviews }
  ports:
  - { name: http, port: 9080 }
"#;

pub const DESTINATION_RULE: &str = r#"apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: { name: reviews, namespace: default }
spec:
  host: reviews
  subsets:
  - { name: v1, labels: { version: v1 } }
  - { name: v2, labels: { version: v2 } }
"#;

pub fn gateway_yaml(port: u16) -> String {
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
pub fn virtual_service(split: &[(&str, u32)]) -> String {
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
pub fn endpoint_slices(pods: &[(&str, &str, u16)]) -> String {
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
pub fn write(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).expect("write config file");
    std::fs::rename(&tmp, dir.join(name)).expect("rename config file");
}

pub fn write_config(dir: &Path, gw_port: u16, pods: &[(&str, &str, u16)], split: &[(&str, u32)]) {
    write(dir, "gateway.yaml", &gateway_yaml(gw_port));
    write(dir, "service.yaml", SERVICE);
    write(dir, "destinationrule.yaml", DESTINATION_RULE);
    write(dir, "endpointslices.yaml", &endpoint_slices(pods));
    write(dir, "virtualservice.yaml", &virtual_service(split));
}

pub async fn wait_backend(url: &str, want: &str) {
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

/// A Service `name` (port `port`, named `port_name`) whose one endpoint is 127.0.0.1:`target`.
pub fn service_at(name: &str, port: u16, port_name: &str, target: u16) -> String {
    format!(
        r#"---
apiVersion: v1
kind: Service
metadata: {{ name: {name}, namespace: default }}
spec:
  selector: {{ app: {name} }}
  ports:
  - {{ name: {port_name}, port: {port} }}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: default
  labels: {{ kubernetes.io/service-name: {name} }}
addressType: IPv4
ports:
- {{ name: {port_name}, port: {target} }}
endpoints:
- addresses: [127.0.0.1]
  conditions: {{ ready: true }}
"#
    )
}

/// A `kubernetes.io/tls` Secret in the gateway's namespace (the test node's: default).
pub fn tls_secret(name: &str, leaf: &Leaf) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{ name: {name}, namespace: default }}\ntype: kubernetes.io/tls\ndata:\n  tls.crt: {}\n  tls.key: {}\n",
        b64(&leaf.cert),
        b64(&leaf.key)
    )
}

/// A Gateway with one server for shop.example.com on `port` (`protocol`, `tls` as a YAML
/// flow mapping), a VirtualService sending it all to `web`, and `web`'s Service at
/// 127.0.0.1:`web_port`.
pub fn shop_config(port: u16, protocol: &str, tls: &str, web_port: u16) -> String {
    let name = protocol.to_ascii_lowercase();
    format!(
        r#"apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {{ name: gw, namespace: default }}
spec:
  selector: {{ istio: ingressgateway }}
  servers:
  - port: {{ number: {port}, name: {name}, protocol: {protocol} }}
    hosts: ["shop.example.com"]
    tls: {tls}
---
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {{ name: shop, namespace: default }}
spec:
  hosts: [shop.example.com]
  gateways: [gw]
  http:
  - route:
    - destination: {{ host: web }}
{}"#,
        service_at("web", 80, "http", web_port)
    )
}
