//! `portico demo`: the whole loop in one process. Demo backends stand in for bookinfo's pods,
//! the file-fed control plane serves `gateway-examples/bookinfo/` over ADS on loopback, and the
//! gateway, started from a bootstrap like `gateway-examples/bootstraps/bookinfo-ads.yaml`,
//! takes its config from it over real gRPC. Editing a file there changes routing live.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;

/// (name, version, port) of each demo pod, matching gateway-examples/bookinfo/endpointslices.yaml.
pub const PODS: [(&str, &str, u16); 5] = [
    ("productpage", "v1", 19081),
    ("reviews", "v1", 19082),
    ("reviews", "v2", 19083),
    ("reviews", "v3", 19084),
    ("ratings", "v1", 19085),
];

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Bootstrap(#[from] crate::bootstrap::BootstrapError),
    #[error(transparent)]
    Server(#[from] crate::server::ServerError),
    #[error("demo backend {0}: {1}")]
    Backend(SocketAddr, std::io::Error),
    #[error("cannot start the demo runtime: {0}")]
    Runtime(std::io::Error),
    #[error("control plane: {0}")]
    ControlPlane(#[from] crate::istio::server::ServeError),
}

/// The admin port of the demo gateway (Envoy's and istio-agent's usual one).
pub const ADMIN_PORT: u16 = 15000;

/// The labels istio's default ingress gateway pods carry; the bookinfo Gateway selects them.
pub const GATEWAY_LABELS: [(&str, &str); 2] =
    [("app", "istio-ingressgateway"), ("istio", "ingressgateway")];

/// `gateway-examples/bookinfo` under the current directory (a checkout), else under the
/// source tree the binary was built from.
pub fn default_config_dir() -> PathBuf {
    let here = Path::new("gateway-examples/bookinfo");
    if here.is_dir() {
        return here.to_path_buf();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("gateway-examples/bookinfo")
}

/// The gateway's bootstrap, as istio-agent writes it for Envoy: node identity and labels, the
/// admin port, and one ADS stream to the control plane on 127.0.0.1:`xds_port`.
pub fn bootstrap_yaml(xds_port: u16, admin_port: u16) -> String {
    let labels: String = GATEWAY_LABELS
        .iter()
        .map(|(k, v)| format!("      {k}: {v}\n"))
        .collect();
    format!(
        r#"node:
  id: router~127.0.0.1~istio-ingressgateway-demo.istio-system~istio-system.svc.cluster.local
  cluster: istio-ingressgateway.istio-system
  metadata:
    ISTIO_VERSION: "1.24.0"
    CLUSTER_ID: Kubernetes
    LABELS:
{labels}admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {admin_port} }}
dynamic_resources:
  ads_config:
    api_type: GRPC
    transport_api_version: V3
    grpc_services:
    - envoy_grpc: {{ cluster_name: xds-grpc }}
  cds_config: {{ ads: {{}}, resource_api_version: V3 }}
  lds_config: {{ ads: {{}}, resource_api_version: V3 }}
static_resources:
  clusters:
  - name: xds-grpc
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: xds-grpc
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {xds_port} }} }} }}
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {{}}
"#
    )
}

/// The ports of the servers of every Gateway in `dir` that selects the demo gateway, for the
/// banner (the control plane itself decides what is served).
fn gateway_ports(dir: &Path) -> Vec<u32> {
    let labels: BTreeMap<&str, &str> = GATEWAY_LABELS.into_iter().collect();
    let Ok((config, _)) = crate::istio::load_dir(dir) else {
        return Vec::new();
    };
    let mut ports: Vec<u32> = config
        .objects
        .iter()
        .filter_map(|o| match o {
            crate::istio::Object::Gateway(_, spec) => Some(spec),
            _ => None,
        })
        .filter(|spec| {
            spec.selector
                .iter()
                .all(|(k, v)| labels.get(k.as_str()) == Some(&v.as_str()))
        })
        .flat_map(|spec| spec.servers.iter().map(|s| s.port.number))
        .collect();
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// Serves `name version` on `addr` until the process exits.
pub async fn backend(listener: tokio::net::TcpListener, name: &'static str, version: &'static str) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(
                move |req: hyper::Request<hyper::body::Incoming>| async move {
                    let body = format!("{name} {version} {}\n", req.uri().path());
                    let mut resp = hyper::Response::new(Full::new(Bytes::from(body)));
                    if let Ok(v) = http::HeaderValue::from_str(&format!("{name}-{version}")) {
                        resp.headers_mut().insert("x-demo-pod", v);
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                },
            );
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// Runs the demo until Ctrl-C: pods, the control plane on `config_dir` (default:
/// [`default_config_dir`]) serving ADS on 127.0.0.1:`xds_port`, and the gateway.
pub fn run(
    config_dir: Option<PathBuf>,
    xds_port: u16,
    concurrency: usize,
) -> Result<(), DemoError> {
    let dir = config_dir.unwrap_or_else(default_config_dir);
    let bootstrap = crate::bootstrap::parse(
        &bootstrap_yaml(xds_port, ADMIN_PORT),
        crate::bootstrap::Format::Yaml,
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(DemoError::Runtime)?;
    for (name, version, p) in PODS {
        let addr = SocketAddr::from(([127, 0, 0, 1], p));
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(addr))
            .map_err(|e| DemoError::Backend(addr, e))?;
        rt.spawn(backend(listener, name, version));
    }
    // Gateway listeners bind loopback only: the demo should not open ports to the network.
    let options = crate::istio::Options {
        bind_address: "127.0.0.1".into(),
        ..Default::default()
    };
    let control_plane = rt.block_on(crate::istio::server::spawn(
        &dir,
        SocketAddr::from(([127, 0, 0, 1], xds_port)),
        options,
    ))?;
    let ports = gateway_ports(&dir);
    let port = ports.first().copied().unwrap_or(8080);
    println!("Portico demo: bookinfo behind the gateway, configured over xDS by Portico's own control plane");
    for p in &ports {
        println!(
            "  gateway       http://127.0.0.1:{p}   (from the Gateway in {})",
            dir.display()
        );
    }
    println!("  admin         http://127.0.0.1:{ADMIN_PORT}");
    println!(
        "  xDS (ADS)     127.0.0.1:{}   (portico control-plane, watching {})",
        control_plane.local_addr.port(),
        dir.display()
    );
    println!(
        "  demo pods     {}",
        PODS.iter()
            .map(|(n, v, p)| format!("{n}-{v}@127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("try:");
    println!("  curl -s http://127.0.0.1:{port}/productpage");
    println!("  curl -s -H 'end-user: jason' http://127.0.0.1:{port}/reviews/1   # header match -> reviews v2");
    println!("  for i in $(seq 10); do curl -s http://127.0.0.1:{port}/reviews/1; done   # 50/50 split v1/v3");
    println!("  curl -s http://127.0.0.1:{ADMIN_PORT}/stats/prometheus | grep upstream_rq_total");
    println!(
        "Edit a file in {} (e.g. the weights in virtualservice.yaml): routing changes live.",
        dir.display()
    );
    println!("Ctrl-C to stop.");
    let served = crate::server::run(bootstrap, concurrency);
    let stopped = rt.block_on(control_plane.shutdown());
    drop(rt);
    served?;
    Ok(stopped?)
}
