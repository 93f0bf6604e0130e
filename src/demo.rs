//! `portico demo`: the embedded default. Demo backends standing in for bookinfo's pods, and a
//! gateway on the static bookinfo bootstrap routing to them.

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::TokioIo;

/// The static bookinfo bootstrap, with its ports fixed for the demo backends below.
pub const BOOTSTRAP: &str = include_str!("../gateway-examples/bootstraps/bookinfo-static.yaml");

/// (name, version, port) of each demo pod, matching the bootstrap's endpoints.
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

pub fn run(port: u16, concurrency: usize) -> Result<(), DemoError> {
    let text = BOOTSTRAP.replace("port_value: 8080", &format!("port_value: {port}"));
    let bootstrap = crate::bootstrap::parse(&text, crate::bootstrap::Format::Yaml)?;
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
    println!("Portico demo: bookinfo behind the gateway on http://127.0.0.1:{port} (admin on http://127.0.0.1:15000)");
    println!(
        "demo pods: {}",
        PODS.iter()
            .map(|(n, v, p)| format!("{n}-{v}@127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("try:");
    println!("  curl -s http://127.0.0.1:{port}/productpage");
    println!("  curl -s -H 'end-user: jason' http://127.0.0.1:{port}/reviews/1   # header match -> reviews v2");
    println!("  for i in $(seq 10); do curl -s http://127.0.0.1:{port}/reviews/1; done   # 50/50 split v1/v3");
    println!("  curl -s http://127.0.0.1:15000/stats/prometheus | grep upstream_rq_total");
    println!("Ctrl-C to stop.");
    crate::server::run(bootstrap, concurrency)?;
    drop(rt);
    Ok(())
}
