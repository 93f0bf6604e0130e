//! `envoy.filters.http.compressor` as Istio 1.30's bootstrap chains it (brotli, zstd, gzip
//! with its content types): the encoding negotiated from Accept-Encoding across the three
//! filters, the body decoding back to what the backend sent (with a length and chunked), and
//! the responses left alone (no Accept-Encoding, q=0, HEAD, too small, other content types,
//! already encoded, no-transform), with Envoy's header changes. Runs against Envoy too:
//! `PORTICO_GATEWAY_BIN=$(scripts/envoy-path.sh) cargo test --test traffic_compression`.

mod common;

use std::convert::Infallible;
use std::io::Read;

use bytes::Bytes;
use common::*;
use envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig;
use envoy_types::pb::envoy::extensions::compression::brotli::compressor::v3::Brotli;
use envoy_types::pb::envoy::extensions::compression::gzip::compressor::v3::Gzip;
use envoy_types::pb::envoy::extensions::compression::zstd::compressor::v3::Zstd;
use envoy_types::pb::envoy::extensions::filters::http::compressor::v3::{compressor, Compressor};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    http_filter, HttpFilter,
};
use http_body_util::{BodyExt, Full, StreamBody};

const HOST: &str = "metrics.example.com";
const TYPES: [&str; 4] = [
    "text/plain",
    "application/vnd.google.protobuf",
    "application/openmetrics-text",
    "application/openmetrics-protobuf",
];

fn text() -> String {
    (0..200)
        .map(|i| format!("istio_requests_total{{n=\"{i}\"}} {i}\n"))
        .collect()
}

fn compressor(name: &str, library: TypedExtensionConfig) -> HttpFilter {
    #[allow(deprecated)]
    let c = Compressor {
        compressor_library: Some(library),
        response_direction_config: Some(compressor::ResponseDirectionConfig {
            common_config: Some(compressor::CommonDirectionConfig {
                content_type: TYPES.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    HttpFilter {
        name: format!("envoy.filters.http.compressor.{name}"),
        config_type: Some(http_filter::ConfigType::TypedConfig(any(c))),
        ..Default::default()
    }
}

fn library<T: prost::Message + prost::Name>(name: &str, m: T) -> TypedExtensionConfig {
    TypedExtensionConfig {
        name: name.into(),
        typed_config: Some(any(m)),
    }
}

/// `/text` (text/plain with a length), `/chunked` (the same without one), `/small`,
/// `/png`, `/encoded` (already gzip), `/no-transform`, `/etag` (a strong ETag).
async fn backend() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let path = req.uri().path().to_string();
                        let b = http::Response::builder().status(200);
                        let (b, body): (_, String) = match path.as_str() {
                            "/small" => (b.header("content-type", "text/plain"), "tiny".into()),
                            "/png" => (b.header("content-type", "image/png"), text()),
                            "/encoded" => (
                                b.header("content-type", "text/plain")
                                    .header("content-encoding", "gzip"),
                                text(),
                            ),
                            "/no-transform" => (
                                b.header("content-type", "text/plain")
                                    .header("cache-control", "no-transform"),
                                text(),
                            ),
                            "/etag" => (
                                b.header("content-type", "text/plain; charset=utf-8")
                                    .header("etag", "\"v1\""),
                                text(),
                            ),
                            "/chunked" => {
                                let pieces: Vec<Result<hyper::body::Frame<Bytes>, Infallible>> =
                                    text()
                                        .into_bytes()
                                        .chunks(1000)
                                        .map(|c| {
                                            Ok(hyper::body::Frame::data(Bytes::copy_from_slice(c)))
                                        })
                                        .collect();
                                let body = StreamBody::new(futures::stream::iter(pieces)).boxed();
                                return Ok::<_, Infallible>(
                                    b.header("content-type", "text/plain")
                                        .body(body)
                                        .expect("response"),
                                );
                            }
                            _ => (
                                b.header("content-type", "text/plain; version=0.0.4"),
                                text(),
                            ),
                        };
                        Ok(
                            b.body(Full::new(Bytes::from(body)).map_err(|e| match e {}).boxed())
                                .expect("response"),
                        )
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(sock), svc)
                    .await;
            });
        }
    });
    addr
}

fn decode(encoding: Option<&str>, body: &[u8]) -> String {
    let mut out = String::new();
    match encoding {
        None => out = String::from_utf8_lossy(body).into_owned(),
        Some("gzip") => {
            flate2::read::GzDecoder::new(body)
                .read_to_string(&mut out)
                .expect("gzip decodes");
        }
        Some("br") => {
            brotli::Decompressor::new(body, 4096)
                .read_to_string(&mut out)
                .expect("brotli decodes");
        }
        Some("zstd") => {
            out = String::from_utf8(zstd::decode_all(body).expect("zstd decodes")).expect("utf-8");
        }
        Some(other) => panic!("unexpected encoding {other}"),
    }
    out
}

async fn get(port: u16, method: &str, path: &str, accept: Option<&str>) -> RawResp {
    let ae = accept
        .map(|a| format!("accept-encoding: {a}\r\n"))
        .unwrap_or_default();
    let req = format!("{method} {path} HTTP/1.1\r\nhost: {HOST}\r\n{ae}connection: close\r\n\r\n");
    raw_http1(port, req.as_bytes(), method == "HEAD").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn istio_stats_compressors_negotiate_and_compress_as_envoy() {
    let addr = backend().await;
    let mesh = Mesh::start_raw(move |port| {
        let mut h = hcm(port);
        h.http_filters.splice(
            0..0,
            [
                compressor("brotli", library("stats_brotli", Brotli::default())),
                compressor("zstd", library("stats_zstd", Zstd::default())),
                compressor("gzip", library("stats_gzip", Gzip::default())),
            ],
        );
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost("all", &["*"], vec![rt(prefix("/"), to_cluster("b"))])],
            )],
            clusters: vec![eds_cluster("b")],
            endpoints: vec![cla("b", &[addr])],
            ..Default::default()
        }
    })
    .await;
    mesh.wait_status("/text", HOST, 200).await;
    let port = mesh.port;
    let mut c = Checks::with_gaps(&[]);
    for (accept, want) in [
        (Some("gzip"), Some("gzip")),
        (Some("br"), Some("br")),
        (Some("zstd"), Some("zstd")),
        // Equal q: the client's first; higher q wins; `*`: the first registered (brotli).
        (Some("deflate, gzip, br, zstd"), Some("gzip")),
        (Some("gzip;q=0.5, zstd;q=0.9"), Some("zstd")),
        (Some("*"), Some("br")),
        (Some("br;q=0, *"), Some("zstd")),
        (Some("identity"), None),
        (Some("gzip;q=0"), None),
        (Some("deflate"), None),
        (None, None),
    ] {
        for path in ["/text", "/chunked"] {
            let r = get(port, "GET", path, accept).await;
            let what = format!("{path} accept-encoding {accept:?}");
            c.eq(format!("{what}: status"), r.status, 200);
            c.eq(
                format!("{what}: content-encoding"),
                r.header("content-encoding"),
                want,
            );
            c.eq(format!("{what}: body"), decode(want, &r.body), text());
            if want.is_some() {
                c.eq(
                    format!("{what}: no length"),
                    r.header("content-length"),
                    None,
                );
                c.eq(
                    format!("{what}: vary"),
                    r.header("vary"),
                    Some("Accept-Encoding"),
                );
            }
        }
    }
    for path in ["/small", "/png", "/encoded", "/no-transform"] {
        let r = get(port, "GET", path, Some("gzip")).await;
        let enc = r.header("content-encoding");
        let expected = (path == "/encoded").then_some("gzip");
        c.eq(format!("{path}: left alone"), enc, expected);
        c.eq(format!("{path}: no vary"), r.header("vary"), None);
    }
    let r = get(port, "GET", "/etag", Some("br")).await;
    c.eq(
        "strong etag: compressed",
        r.header("content-encoding"),
        Some("br"),
    );
    c.eq("strong etag: removed", r.header("etag"), None);
    let r = get(port, "HEAD", "/text", Some("gzip")).await;
    c.eq("HEAD: not compressed", r.header("content-encoding"), None);
    // Each filter's counters under its library's name (Envoy names brotli's `brotli`).
    let s = mesh.gw.admin_get("/stats?filter=compressor").await;
    let stat = |name: &str| {
        s.body.lines().find_map(|l| {
            let (k, v) = l.split_once(": ")?;
            k.ends_with(name).then(|| v.trim().parse::<u64>().ok())?
        })
    };
    for (lib, n) in [
        ("stats_brotli.brotli", 5),
        ("stats_zstd.zstd", 6),
        ("stats_gzip.gzip", 4),
    ] {
        c.eq(
            format!("{lib} compressed"),
            stat(&format!(".compressor.{lib}.response.compressed")),
            Some(n),
        );
    }
    c.finish();
}
