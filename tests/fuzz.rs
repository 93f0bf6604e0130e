//! Mutation fuzzing of what Portico takes from outside: the bootstrap parser, each xDS type's
//! translation (the whole `Store::apply` path a push takes), and the HTTP/1 request head on a
//! running gateway (routing included). Seeds are real inputs: Envoy Gateway's translator
//! goldens in `../shared/xds-data`, the tests' bootstraps and Istio's golden bootstraps.
//!
//! Mutations: bit flips, interesting bytes, inserted, removed, duplicated (protobuf merges a
//! repeated message, so this grows lists and overrides fields) and spliced ranges, on the
//! encoded protobuf or the text. No coverage guidance (a stable toolchain has no sanitizer
//! coverage), so every run with the same seed does the same work: the README's test command
//! runs a fixed number of executions and is deterministic. `PORTICO_FUZZ_SECS=N` runs each
//! target for N seconds instead, with a seed from the clock (printed), for longer hunts.
//!
//! A target fails on a panic (caught and reported with the input, hex) or, for the gateway,
//! on an answer that is not a 4xx/2xx/3xx/5xx status or a clean close, and on the gateway
//! process dying.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use envoy_types::pb::google::protobuf::Any;
use portico::xds::store::Store;
use portico::xds::types::Kind;

/// xorshift64*: small, fast, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

/// The budget of one target: a fixed count by default, or seconds from the environment.
struct Budget {
    until: Option<Instant>,
    count: usize,
}

impl Budget {
    fn new(default_count: usize) -> (Budget, u64) {
        match std::env::var("PORTICO_FUZZ_SECS")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
        {
            Some(secs) => {
                let seed = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
                    | 1;
                eprintln!("fuzz: {secs} s per target, seed {seed}");
                (
                    Budget {
                        until: Some(Instant::now() + Duration::from_secs(secs)),
                        count: usize::MAX,
                    },
                    seed,
                )
            }
            None => (
                Budget {
                    until: None,
                    count: default_count,
                },
                0x9E37_79B9_7F4A_7C15,
            ),
        }
    }
    fn more(&self, done: usize) -> bool {
        match self.until {
            Some(t) => Instant::now() < t,
            None => done < self.count,
        }
    }
}

const INTERESTING: [u8; 10] = [0, 1, 0x7f, 0x80, 0xff, b'\n', b':', b'%', b'{', b'"'];

fn mutate(rng: &mut Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut b = input.to_vec();
    for _ in 0..=rng.below(4) {
        let len = b.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                b[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                b[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                b.splice(i..i, bytes);
            }
            3 if len > 1 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(32));
                b.drain(i..i + n);
            }
            4 if len > 1 => {
                let i = rng.below(len);
                let n = 1 + rng.below((len - i).min(256));
                let copy = b[i..i + n].to_vec();
                let at = rng.below(len + 1);
                b.splice(at..at, copy);
            }
            5 if !other.is_empty() => {
                let i = rng.below(other.len());
                let n = 1 + rng.below((other.len() - i).min(256));
                let at = rng.below(len + 1);
                b.splice(at..at, other[i..i + n].iter().copied());
            }
            // Protobuf concatenation merges: the whole seed again, or another seed after it.
            6 => b.extend_from_slice(if rng.below(2) == 0 { input } else { other }),
            _ => {}
        }
    }
    b
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn shared(rel: &str) -> PathBuf {
    std::env::var_os("PORTICO_SHARED_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .ancestors()
                .map(|a| a.join("shared"))
                .find(|p| p.join("xds-data").is_dir())
        })
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared")))
        .join("xds-data")
        .join(rel)
}

/// Envoy Gateway's goldens of one kind, encoded.
fn seeds(kind: &str, full: &str) -> Vec<Vec<u8>> {
    let dir = shared("envoy-gateway");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.ends_with(&format!(".{kind}.yaml")))
        })
        .collect();
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        let items: Vec<serde_json::Value> = serde_yaml::from_str(&text).unwrap_or_default();
        for item in items {
            if let Ok(m) = portico::protojson::dynamic_from_json(full, &item) {
                out.push(prost::Message::encode_to_vec(&m));
            }
        }
    }
    out
}

fn fuzz_xds(kind: Kind, file_kind: &str, full: &str, count: usize) {
    let _pool = portico::protojson::pool().expect("descriptor pool");
    let corpus = seeds(file_kind, full);
    assert!(!corpus.is_empty(), "no seeds for {file_kind}");
    let (budget, seed) = Budget::new(count);
    let mut rng = Rng(seed);
    let type_url = format!("type.googleapis.com/{full}");
    let (mut runs, mut accepted) = (0usize, 0usize);
    // Translation logs its refusals; keep the output readable.
    while budget.more(runs) {
        let a = &corpus[rng.below(corpus.len())];
        let b = &corpus[rng.below(corpus.len())];
        let input = mutate(&mut rng, a, b);
        let any = Any {
            type_url: type_url.clone(),
            value: input.clone(),
        };
        let r = std::panic::catch_unwind(|| {
            Store::default()
                .apply(kind, "1", std::slice::from_ref(&any))
                .is_ok()
        });
        match r {
            Ok(ok) => accepted += usize::from(ok),
            Err(_) => panic!("{full}: translation panicked on input {}", hex(&input)),
        }
        runs += 1;
    }
    eprintln!("fuzz {full}: {runs} executions, {accepted} accepted, 0 crashes");
}

#[test]
fn xds_listener_translation() {
    fuzz_xds(
        Kind::Listener,
        "listeners",
        "envoy.config.listener.v3.Listener",
        10_000,
    );
}

#[test]
fn xds_route_translation() {
    fuzz_xds(
        Kind::Route,
        "routes",
        "envoy.config.route.v3.RouteConfiguration",
        20_000,
    );
}

#[test]
fn xds_cluster_translation() {
    fuzz_xds(
        Kind::Cluster,
        "clusters",
        "envoy.config.cluster.v3.Cluster",
        20_000,
    );
}

#[test]
fn xds_endpoint_translation() {
    fuzz_xds(
        Kind::Endpoint,
        "endpoints",
        "envoy.config.endpoint.v3.ClusterLoadAssignment",
        20_000,
    );
}

#[test]
fn bootstrap_parser() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bootstrap");
    let mut corpus: Vec<(Vec<u8>, portico::bootstrap::Format)> = Vec::new();
    for sub in [dir.clone(), dir.join("istio")] {
        let mut files: Vec<_> = std::fs::read_dir(&sub)
            .expect("bootstrap fixtures")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        files.sort();
        for f in files {
            let format = match f.extension().and_then(|e| e.to_str()) {
                Some("json") => portico::bootstrap::Format::Json,
                Some("yaml") | Some("yml") => portico::bootstrap::Format::Yaml,
                _ => continue,
            };
            if let Ok(b) = std::fs::read(&f) {
                corpus.push((b, format));
            }
        }
    }
    assert!(corpus.len() > 20, "{} bootstraps", corpus.len());
    // One decoded descriptor pool for every parse.
    let _pool = portico::protojson::pool().expect("descriptor pool");
    let (budget, seed) = Budget::new(3000);
    let mut rng = Rng(seed);
    let (mut runs, mut accepted) = (0usize, 0usize);
    while budget.more(runs) {
        let (a, format) = &corpus[rng.below(corpus.len())];
        let (b, _) = &corpus[rng.below(corpus.len())];
        let input = mutate(&mut rng, a, b);
        let text = String::from_utf8_lossy(&input).into_owned();
        let r = std::panic::catch_unwind(|| portico::bootstrap::parse(&text, *format).is_ok());
        match r {
            Ok(ok) => accepted += usize::from(ok),
            Err(_) => panic!("the bootstrap parser panicked on {text:?}"),
        }
        runs += 1;
    }
    eprintln!("fuzz bootstrap: {runs} executions, {accepted} accepted, 0 crashes");
}

/// Raw HTTP/1 request heads against a running gateway with routes, header matchers and a
/// redirect: every mutant gets a status line or a clean close, and the gateway survives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_request_heads_on_a_running_gateway() {
    use common::*;
    let web = Backend::start("web").await;
    let mesh = Mesh::start_raw(|port| {
        let mut by_header = rt(prefix("/h"), to_cluster("web"));
        if let Some(m) = by_header.r#match.as_mut() {
            m.headers.push(envoy_types::pb::envoy::config::route::v3::HeaderMatcher {
                name: "x-env".into(),
                header_match_specifier: Some(
                    envoy_types::pb::envoy::config::route::v3::header_matcher::HeaderMatchSpecifier::PresentMatch(true),
                ),
                ..Default::default()
            });
        }
        Snapshot {
            listeners: vec![l(port)],
            routes: vec![route_config(
                &route_name(port),
                vec![
                    vhost("exact", &["example.com", "example.com:80"], vec![by_header, rt(prefix("/"), to_cluster("web"))]),
                    vhost("all", &["*"], vec![rt(prefix("/api/"), to_cluster("web")), rt(prefix("/"), direct(404, "none"))]),
                ],
            )],
            ..Default::default()
        }
        .with_backends(&[("web", &web)])
    })
    .await;
    let port = mesh.port;
    let seeds: Vec<&[u8]> = vec![
        b"GET / HTTP/1.1\r\nhost: example.com\r\n\r\n",
        b"GET /h/x?q=1 HTTP/1.1\r\nHost: example.com:80\r\nx-env: a\r\nconnection: close\r\n\r\n",
        b"POST /api/v1 HTTP/1.1\r\nhost: other\r\ncontent-length: 5\r\n\r\nhello",
        b"POST /api/v1 HTTP/1.1\r\nhost: other\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        b"GET http://example.com/abs HTTP/1.1\r\nhost: example.com\r\n\r\n",
        b"OPTIONS * HTTP/1.1\r\nhost: example.com\r\n\r\n",
        b"GET /%2e%2e/a/../b HTTP/1.0\r\n\r\n",
    ];
    let (budget, seed) = Budget::new(1000);
    let mut rng = Rng(seed);
    let mut runs = 0usize;
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    while budget.more(runs) {
        let a = seeds[rng.below(seeds.len())];
        let b = seeds[rng.below(seeds.len())];
        let mut input = mutate(&mut rng, a, b);
        // End the head so the gateway answers instead of waiting for more.
        if !input.ends_with(b"\r\n\r\n") {
            input.extend_from_slice(b"\r\n\r\nconnection: close\r\n\r\n");
        }
        let r = raw_http1(port, &input, false).await;
        // 0: the gateway closed (or a 5 s timeout on a body it still waits for).
        assert!(
            r.status == 0 || (100..600).contains(&r.status),
            "input {:?}: {} {:?}",
            String::from_utf8_lossy(&input),
            r.status,
            r.body_str()
        );
        *statuses.entry(r.status).or_default() += 1;
        runs += 1;
    }
    // Still serving: the process did not die on any input.
    let r = raw_http1(
        port,
        b"GET / HTTP/1.1\r\nhost: example.com\r\nconnection: close\r\n\r\n",
        false,
    )
    .await;
    assert_eq!(
        r.status, 200,
        "the gateway still serves after {runs} mutants"
    );
    eprintln!("fuzz http1 heads: {runs} executions, statuses {statuses:?}, 0 crashes");
}
