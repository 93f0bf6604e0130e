//! Envoy's HTTP tracing at the connection manager: `config` translates the connection
//! manager's `tracing` (Zipkin and OpenTelemetry drivers, sampling, custom tags);
//! `context` decides (the uuid request id's trace bits, client and forced tracing, random and
//! overall sampling, an incoming B3 or W3C decision) and writes the span's propagation
//! headers; `span` is the finished span and its wire forms; `export` batches spans to the
//! collector off the request path.
//!
//! The request path (`proxy::trace`) runs `context` on the request headers, injects the
//! headers into the upstream request and reports the span once the request is over.

pub mod config;
pub mod context;
pub mod export;
pub mod otlp;
pub mod span;

pub use config::{Provider, TracingConfig};
pub use context::{Reason, SpanContext};
pub use export::{Batching, Resolve, Tracer};
pub use span::{FinishedSpan, LocalInfo};
