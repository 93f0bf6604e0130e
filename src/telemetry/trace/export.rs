//! Span export off the request path: the request path hands finished spans to a bounded
//! channel ([`Tracer::report`], never blocking; a full channel drops and counts); one task
//! batches them per provider as Envoy's reporters do (a flush at `min_flush_spans`, Envoy's
//! 5, or every `flush_interval`, Envoy's 5 s; the runtime keys `tracing.zipkin.*` and
//! `tracing.opentelemetry.*` of the bootstrap's static runtime layer set them) and sends
//! each batch to a host of the provider's cluster, which it finds through [`Resolve`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::mpsc;

use super::config::{OpenTelemetry, Provider, Zipkin};
use super::otlp;
use super::span::{FinishedSpan, LocalInfo};

/// The endpoints of a cluster in the current configuration: the edge provides it (telemetry
/// cannot read the snapshot).
pub type Resolve = Arc<dyn Fn(&str) -> Vec<SocketAddr> + Send + Sync>;

/// Spans waiting for the exporter at most; more are dropped.
const QUEUE: usize = 4096;

/// Batching as Envoy's runtime keys say.
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    pub zipkin_min_flush_spans: usize,
    pub zipkin_flush_interval: Duration,
    pub otel_min_flush_spans: usize,
    pub otel_flush_interval: Duration,
    pub request_timeout: Duration,
}

impl Default for Batching {
    fn default() -> Batching {
        Batching {
            zipkin_min_flush_spans: 5,
            zipkin_flush_interval: Duration::from_millis(5000),
            otel_min_flush_spans: 5,
            otel_flush_interval: Duration::from_millis(5000),
            request_timeout: Duration::from_millis(5000),
        }
    }
}

impl Batching {
    /// From runtime values (`tracing.zipkin.min_flush_spans`, `tracing.zipkin.flush_interval_ms`,
    /// `tracing.zipkin.request_timeout`, `tracing.opentelemetry.min_flush_spans`,
    /// `tracing.opentelemetry.flush_interval_ms`), Envoy's defaults for the others.
    pub fn from_runtime(get: impl Fn(&str) -> Option<u64>) -> Batching {
        let d = Batching::default();
        let ms = |k: &str, d: Duration| get(k).map_or(d, Duration::from_millis);
        Batching {
            zipkin_min_flush_spans: get("tracing.zipkin.min_flush_spans")
                .map_or(d.zipkin_min_flush_spans, |v| v as usize),
            zipkin_flush_interval: ms("tracing.zipkin.flush_interval_ms", d.zipkin_flush_interval),
            otel_min_flush_spans: get("tracing.opentelemetry.min_flush_spans")
                .map_or(d.otel_min_flush_spans, |v| v as usize),
            otel_flush_interval: ms(
                "tracing.opentelemetry.flush_interval_ms",
                d.otel_flush_interval,
            ),
            request_timeout: ms("tracing.zipkin.request_timeout", d.request_timeout),
        }
    }
}

/// The request path's handle on the exporter.
#[derive(Debug, Default)]
pub struct Tracer {
    tx: OnceLock<mpsc::Sender<FinishedSpan>>,
    local: OnceLock<Arc<LocalInfo>>,
    /// The bootstrap's `tracing.http` driver.
    default_provider: OnceLock<Arc<Provider>>,
    pub stats: TracerStats,
}

/// Envoy's tracer counters (`tracing.zipkin.*`, `tracing.opentelemetry.*`), and the spans
/// Portico dropped before any driver saw them.
#[derive(Debug, Default)]
pub struct TracerStats {
    /// The queue was full, the exporter not started, or the collector cluster had no host.
    pub spans_dropped: AtomicU64,
    pub zipkin_spans_sent: AtomicU64,
    /// Reports the collector accepted (202), refused (other status), or that failed.
    pub zipkin_reports_sent: AtomicU64,
    pub zipkin_reports_dropped: AtomicU64,
    pub zipkin_reports_failed: AtomicU64,
    pub zipkin_timer_flushed: AtomicU64,
    pub otel_spans_sent: AtomicU64,
    pub otel_timer_flushed: AtomicU64,
}

impl TracerStats {
    /// (Envoy's stat name, value), for the admin.
    pub fn list(&self) -> [(&'static str, u64); 8] {
        let v = |c: &AtomicU64| c.load(Relaxed);
        [
            ("tracing.portico.spans_dropped", v(&self.spans_dropped)),
            ("tracing.zipkin.spans_sent", v(&self.zipkin_spans_sent)),
            ("tracing.zipkin.reports_sent", v(&self.zipkin_reports_sent)),
            (
                "tracing.zipkin.reports_dropped",
                v(&self.zipkin_reports_dropped),
            ),
            (
                "tracing.zipkin.reports_failed",
                v(&self.zipkin_reports_failed),
            ),
            (
                "tracing.zipkin.timer_flushed",
                v(&self.zipkin_timer_flushed),
            ),
            ("tracing.opentelemetry.spans_sent", v(&self.otel_spans_sent)),
            (
                "tracing.opentelemetry.timer_flushed",
                v(&self.otel_timer_flushed),
            ),
        ]
    }
}

/// How a report went.
enum Outcome {
    Sent,
    /// The collector answered, but not 202.
    Refused,
    Failed,
}

impl Tracer {
    /// Hands a finished span to the exporter; never waits.
    pub fn report(&self, span: FinishedSpan) {
        let ok = self.tx.get().is_some_and(|tx| tx.try_send(span).is_ok());
        if !ok {
            self.stats.spans_dropped.fetch_add(1, Relaxed);
        }
    }

    /// The bootstrap's driver, for connection managers without their own.
    pub fn default_provider(&self) -> Option<&Arc<Provider>> {
        self.default_provider.get()
    }

    /// The node as spans show it.
    pub fn local(&self) -> Option<&Arc<LocalInfo>> {
        self.local.get()
    }

    /// Starts the exporter task on the current runtime (once; later calls do nothing).
    pub fn start(
        self: &Arc<Self>,
        local: LocalInfo,
        default_provider: Option<Provider>,
        batching: Batching,
        resolve: Resolve,
    ) {
        let (tx, rx) = mpsc::channel(QUEUE);
        if self.tx.set(tx).is_err() {
            return;
        }
        if let Some(p) = default_provider {
            let _ = self.default_provider.set(Arc::new(p));
        }
        let local = Arc::new(local);
        let _ = self.local.set(local.clone());
        let me = Arc::downgrade(self);
        tokio::spawn(run(rx, local, batching, resolve, me));
    }
}

async fn run(
    mut rx: mpsc::Receiver<FinishedSpan>,
    local: Arc<LocalInfo>,
    batching: Batching,
    resolve: Resolve,
    tracer: std::sync::Weak<Tracer>,
) {
    let mut pending: HashMap<Arc<Provider>, Vec<FinishedSpan>> = HashMap::new();
    let tick = batching
        .zipkin_flush_interval
        .min(batching.otel_flush_interval)
        .max(Duration::from_millis(10));
    let mut timer = tokio::time::interval(tick);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            span = rx.recv() => {
                let Some(span) = span else { return };
                let provider = span.provider.clone();
                let min = match &*provider {
                    Provider::Zipkin(_) => batching.zipkin_min_flush_spans,
                    Provider::OpenTelemetry(_) => batching.otel_min_flush_spans,
                    Provider::Unimplemented(_) => continue,
                };
                let batch = pending.entry(provider.clone()).or_default();
                batch.push(span);
                if batch.len() >= min.max(1) {
                    let batch = std::mem::take(batch);
                    send(&provider, batch, &local, &batching, &resolve, &tracer);
                }
            }
            _ = timer.tick() => {
                if let Some(t) = tracer.upgrade() {
                    for p in pending.keys() {
                        match &**p {
                            Provider::Zipkin(_) => &t.stats.zipkin_timer_flushed,
                            _ => &t.stats.otel_timer_flushed,
                        }
                        .fetch_add(1, Relaxed);
                    }
                }
                for (provider, batch) in pending.iter_mut() {
                    if !batch.is_empty() {
                        let batch = std::mem::take(batch);
                        send(provider, batch, &local, &batching, &resolve, &tracer);
                    }
                }
            }
        }
    }
}

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Sends one batch on a task of its own, so a slow collector never holds the queue.
fn send(
    provider: &Provider,
    batch: Vec<FinishedSpan>,
    local: &Arc<LocalInfo>,
    batching: &Batching,
    resolve: &Resolve,
    tracer: &std::sync::Weak<Tracer>,
) {
    let n = batch.len() as u64;
    let hosts = match provider {
        Provider::Zipkin(z) => resolve(&z.cluster),
        Provider::OpenTelemetry(o) => resolve(&o.cluster),
        Provider::Unimplemented(_) => return,
    };
    // Envoy's cluster load balancing, simply: a random host of the cluster.
    let Some(host) = (!hosts.is_empty()).then(|| hosts[fastrand::usize(..hosts.len())]) else {
        tracing::debug!("tracing: collector cluster has no endpoints; {n} spans not sent");
        if let Some(t) = tracer.upgrade() {
            t.stats.spans_dropped.fetch_add(n, Relaxed);
        }
        return;
    };
    let timeout = batching.request_timeout;
    let tracer = tracer.clone();
    match provider {
        Provider::Zipkin(z) => {
            let body = zipkin_body(z, &batch, local);
            let z = z.clone();
            if let Some(t) = tracer.upgrade() {
                t.stats.zipkin_spans_sent.fetch_add(n, Relaxed);
            }
            tokio::spawn(async move {
                let outcome = tokio::time::timeout(timeout, post_zipkin(host, &z, body))
                    .await
                    .unwrap_or_else(|_| Err("timed out".into()));
                let outcome = match outcome {
                    Ok(true) => Outcome::Sent,
                    Ok(false) => Outcome::Refused,
                    Err(e) => {
                        tracing::debug!("tracing: zipkin report to {host}: {e}");
                        Outcome::Failed
                    }
                };
                if let Some(t) = tracer.upgrade() {
                    match outcome {
                        Outcome::Sent => &t.stats.zipkin_reports_sent,
                        Outcome::Refused => &t.stats.zipkin_reports_dropped,
                        Outcome::Failed => &t.stats.zipkin_reports_failed,
                    }
                    .fetch_add(1, Relaxed);
                }
            });
        }
        Provider::OpenTelemetry(o) => {
            let req = otlp_request(o, &batch, local);
            let o = o.clone();
            if let Some(t) = tracer.upgrade() {
                t.stats.otel_spans_sent.fetch_add(n, Relaxed);
            }
            tokio::spawn(async move {
                let ok = tokio::time::timeout(timeout, export_otlp(host, &o, req))
                    .await
                    .unwrap_or_else(|_| Err("timed out".into()));
                if let Err(e) = &ok {
                    tracing::debug!("tracing: OpenTelemetry export to {host}: {e}");
                }
            });
        }
        Provider::Unimplemented(_) => {}
    }
}

/// Zipkin JSON v2, or `zipkin.proto3.ListOfSpans` for `HTTP_PROTO`.
pub fn zipkin_body(z: &Zipkin, batch: &[FinishedSpan], local: &LocalInfo) -> Vec<u8> {
    if z.proto {
        use prost::Message;
        let list = otlp::zipkin::ListOfSpans {
            spans: batch
                .iter()
                .map(|s| s.zipkin_proto(z.shared_span_context, local, &env_var))
                .collect(),
        };
        return list.encode_to_vec();
    }
    let spans: Vec<serde_json::Value> = batch
        .iter()
        .map(|s| s.zipkin_json(z.shared_span_context, local, &env_var))
        .collect();
    serde_json::to_vec(&spans).unwrap_or_default()
}

/// Ok(false): the collector answered other than 202 (Envoy counts the report dropped).
async fn post_zipkin(host: SocketAddr, z: &Zipkin, body: Vec<u8>) -> Result<bool, String> {
    use http_body_util::Full;
    let stream = tokio::net::TcpStream::connect(host)
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = http::Request::post(z.endpoint.as_str())
        .header(http::header::HOST, z.hostname.as_str())
        .header(
            http::header::CONTENT_TYPE,
            if z.proto {
                "application/x-protobuf"
            } else {
                "application/json"
            },
        )
        .body(Full::new(bytes::Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    Ok(resp.status() == http::StatusCode::ACCEPTED)
}

/// One Export request for a batch: a resource with the service name, one scope.
pub fn otlp_request(
    o: &OpenTelemetry,
    batch: &[FinishedSpan],
    local: &LocalInfo,
) -> otlp::ExportTraceServiceRequest {
    otlp::ExportTraceServiceRequest {
        resource_spans: vec![otlp::ResourceSpans {
            resource: Some(otlp::Resource {
                // Envoy adds its SDK's name, language and version; Portico names itself.
                attributes: vec![
                    otlp::KeyValue::string("service.name", o.service_name.as_str()),
                    otlp::KeyValue::string("telemetry.sdk.name", "portico"),
                    otlp::KeyValue::string("telemetry.sdk.language", "rust"),
                    otlp::KeyValue::string("telemetry.sdk.version", env!("CARGO_PKG_VERSION")),
                ],
            }),
            scope_spans: vec![otlp::ScopeSpans {
                scope: None,
                spans: batch.iter().map(|s| s.otlp(local, &env_var)).collect(),
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    }
}

async fn export_otlp(
    host: SocketAddr,
    o: &OpenTelemetry,
    req: otlp::ExportTraceServiceRequest,
) -> Result<(), String> {
    let origin: http::Uri = format!("http://{}", o.authority)
        .parse()
        .map_err(|e: http::uri::InvalidUri| e.to_string())?;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{host}"))
        .map_err(|e| e.to_string())?
        .origin(origin)
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| e.to_string())?;
    let codec: tonic_prost::ProstCodec<
        otlp::ExportTraceServiceRequest,
        otlp::ExportTraceServiceResponse,
    > = tonic_prost::ProstCodec::default();
    grpc.unary(
        tonic::Request::new(req),
        http::uri::PathAndQuery::from_static(otlp::EXPORT_PATH),
        codec,
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batching_from_envoys_runtime_keys() {
        let b = Batching::from_runtime(|k| match k {
            "tracing.zipkin.min_flush_spans" => Some(1),
            "tracing.opentelemetry.flush_interval_ms" => Some(200),
            _ => None,
        });
        assert_eq!(b.zipkin_min_flush_spans, 1);
        assert_eq!(b.zipkin_flush_interval, Duration::from_secs(5));
        assert_eq!(b.otel_min_flush_spans, 5);
        assert_eq!(b.otel_flush_interval, Duration::from_millis(200));
    }

    #[test]
    fn a_tracer_not_started_counts_what_it_drops() {
        let t = Tracer::default();
        assert!(t.default_provider().is_none());
        assert_eq!(t.stats.list()[0], ("tracing.portico.spans_dropped", 0));
    }
}
