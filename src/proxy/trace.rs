//! The connection manager's tracing on the request path (Envoy's `traceRequest` and
//! `finalizeDownstreamSpan`): once the request headers are final, Envoy's sampling decision
//! is packed into `x-request-id`, the driver starts the gateway's span (continuing an incoming
//! B3 or W3C context) and writes its propagation headers into the request; at the end the
//! span is finished from the `StreamInfo` and handed to the exporter
//! (`telemetry::trace::export`), which sends it off the request path.
//!
//! A request answered before the router forwarded it (no route, a direct response, a local
//! reply) is traced at its end instead ([`late`]): its span is the same, only no headers went
//! anywhere. Replies of the codec and of the connection manager's own checks (before Envoy
//! traces) have no span.

use std::borrow::Cow;
use std::sync::Arc;

use pingora_error::{ErrorType, OrErr, Result};
use pingora_http::RequestHeader;

use super::downstream::{X_FORWARDED_PROTO, X_REQUEST_ID};
use super::head::SetHeader;
use crate::snapshot::listener::Hcm;
use crate::snapshot::route::Decorator;
use crate::telemetry::trace::config::TagValue;
use crate::telemetry::trace::{
    context, FinishedSpan, Provider, SpanContext, Tracer, TracingConfig,
};
use crate::telemetry::StreamInfo;

/// A sampled span in progress.
pub(super) struct ActiveTrace {
    config: Arc<TracingConfig>,
    provider: Arc<Provider>,
    ctx: SpanContext,
    name: String,
    /// What Envoy reads off the request headers when the span ends; read here, once the
    /// headers are final for the upstream.
    tags: Vec<(Cow<'static, str>, String)>,
}

static DECORATOR_OPERATION_NAME: http::HeaderName =
    http::HeaderName::from_static("x-envoy-decorator-operation");

fn header<'a>(req: &'a RequestHeader, name: &http::HeaderName) -> Option<&'a str> {
    req.headers.get(name).and_then(|v| v.to_str().ok())
}

/// After the connection manager's request headers (`x-request-id` is set): sampling, the
/// span, and its headers on the request. Some: a span to finish and report.
/// `decorator`: the matched route's. `ctx_response`: set to the operation Envoy's ingress
/// response carries in `x-envoy-decorator-operation`.
pub(super) fn begin(
    req: &mut RequestHeader,
    hcm: &Hcm,
    info: &StreamInfo,
    tracer: &Tracer,
    decorator: Option<&Decorator>,
    response_operation: &mut Option<Arc<str>>,
) -> Result<Option<Box<ActiveTrace>>> {
    let Some(cfg) = &hcm.tracing else {
        return Ok(None);
    };
    // Envoy's decorator handling: egress sends the route's operation upstream; ingress takes
    // a caller's override from the request (never passed on) and otherwise returns the
    // route's operation on the response.
    let mut operation = decorator.map(|d| d.operation.clone());
    let propagate = decorator.is_some_and(|d| d.propagate);
    // Which of the names read below the request has, in one pass over its (few) names: each
    // is rarely there, and a lookup by name hashes it.
    let [has_operation, client, force] = super::downstream::present(
        &req.headers,
        &[
            &DECORATOR_OPERATION_NAME,
            header_name!("x-client-trace-id"),
            header_name!("x-envoy-force-trace"),
        ],
    );
    if cfg.egress {
        if let (Some(op), true) = (&operation, propagate) {
            req.set(&DECORATOR_OPERATION_NAME, &**op)?;
        }
    } else {
        let requested = has_operation
            .then(|| header(req, &DECORATOR_OPERATION_NAME))
            .flatten()
            .filter(|o| !o.is_empty());
        if let Some(o) = requested {
            operation = Some(Arc::from(o));
        } else if propagate {
            *response_operation = operation.clone();
        }
        // A removal hashes the name in both of pingora's maps even when it is absent.
        if has_operation {
            req.remove_header(&DECORATOR_OPERATION_NAME);
        }
    }
    // The sampling decision packed into `x-request-id` (a new value, when it changed), written
    // with the span's headers below: one write for all.
    let (reason, rid) = match req.headers.get(&X_REQUEST_ID) {
        Some(v) => {
            let mut rid = v.as_bytes().to_vec();
            let reason = context::sample(&mut rid, client, force, cfg, fastrand::u64(..));
            let changed = (rid != v.as_bytes())
                .then(|| String::from_utf8(rid).or_err(ErrorType::InternalError, "x-request-id"));
            (reason, changed.transpose()?)
        }
        None => (context::Reason::NotTraceable, None),
    };
    // The connection manager's driver, else the bootstrap's (Envoy's fallback).
    let provider = cfg.provider.as_ref().or(tracer.default_provider());
    let span = context::start_span(
        cfg,
        provider.map(|p| &**p),
        &req.headers,
        reason,
        &mut || fastrand::u64(..),
    );
    let (Some(span), Some(provider)) = (span, provider.cloned()) else {
        if let Some(rid) = rid {
            req.set(&X_REQUEST_ID, rid)?;
        }
        return Ok(None);
    };
    let mut headers = span.headers();
    // Last: it is already there, and an insert keeps its place.
    if let Some(rid) = rid {
        headers.push((&X_REQUEST_ID, rid));
    }
    req.set_all(headers)?;
    if !span.sampled {
        return Ok(None);
    }
    let host = super::downstream::raw_authority(req).to_string();
    let name = match (&operation, &cfg.operation, &*provider) {
        (Some(op), _, _) => op.to_string(),
        (None, Some(op), _) => op.clone(),
        // Zipkin names the span by the request's host; the others by Envoy's operation.
        (None, None, Provider::Zipkin(_)) => host.clone(),
        (None, None, _) if cfg.egress => format!("egress {host}"),
        (None, None, _) => "ingress".to_string(),
    };
    let mut tags: Vec<(Cow<'static, str>, String)> = Vec::with_capacity(24);
    if let Some(id) = header(req, &X_REQUEST_ID) {
        tags.push(("guid:x-request-id".into(), id.to_string()));
    }
    let raw_path = String::from_utf8_lossy(req.raw_path()).into_owned();
    let path = header(req, header_name!("x-envoy-original-path")).unwrap_or(&raw_path);
    let path = path
        .get(..cfg.max_path_tag_length.min(path.len()))
        .unwrap_or(path);
    let proto = header(req, &X_FORWARDED_PROTO).unwrap_or("");
    tags.push(("http.url".into(), format!("{proto}://{host}{path}")));
    tags.push(("http.method".into(), req.method.as_str().to_string()));
    tags.push((
        "downstream_cluster".into(),
        header(req, header_name!("x-envoy-downstream-service-cluster"))
            .unwrap_or("-")
            .to_string(),
    ));
    tags.push((
        "user_agent".into(),
        header(req, header_name!("user-agent"))
            .unwrap_or("-")
            .to_string(),
    ));
    tags.push(("http.protocol".into(), info.protocol.as_str().to_string()));
    if let Some(peer) = info.downstream_direct_remote {
        tags.push(("peer.address".into(), peer.ip().to_string()));
    }
    if let Some(c) = header(req, header_name!("x-client-trace-id")) {
        tags.push(("guid:x-client-trace-id".into(), c.to_string()));
    }
    for t in &cfg.custom_tags {
        let value = match &t.value {
            TagValue::Literal(v) => v.clone(),
            TagValue::RequestHeader { name, default } => match req.headers.get(name) {
                Some(v) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
                None => default.clone(),
            },
            // Read by the exporter.
            TagValue::Environment { .. } => continue,
        };
        if !value.is_empty() {
            tags.push((Cow::Owned(t.tag.clone()), value));
        }
    }
    Ok(Some(Box::new(ActiveTrace {
        config: cfg.clone(),
        provider,
        ctx: span,
        name,
        tags,
    })))
}

/// A request answered before the router forwarded it (no route, a direct response or
/// redirect, a filter's or the router's local reply): Envoy traced it from its headers all the
/// same. Done at the end, with the request id the connection manager would have given it
/// (the reply never carried it) and `x-envoy-force-trace` only from internal clients.
pub(super) fn late(
    req: &mut RequestHeader,
    client_ip: Option<std::net::IpAddr>,
    hcm: &Hcm,
    info: &StreamInfo,
    tracer: &Tracer,
    decorator: Option<&Decorator>,
) -> Result<Option<Box<ActiveTrace>>> {
    if hcm.tracing.is_none() {
        return Ok(None);
    }
    let internal = super::downstream::is_internal_request(&req.headers, client_ip, hcm);
    let force_trace = header_name!("x-envoy-force-trace");
    if !internal && req.headers.contains_key(force_trace) {
        req.remove_header(force_trace);
    }
    let regenerate = hcm.use_remote_address && !internal && !hcm.preserve_external_request_id;
    if hcm.generate_request_id && (regenerate || !req.headers.contains_key(&X_REQUEST_ID)) {
        let id = http::HeaderValue::from_bytes(&crate::uuid::v4_bytes())
            .or_err(ErrorType::InternalError, "request id")?;
        req.set(&X_REQUEST_ID, id)?;
    }
    begin(req, hcm, info, tracer, decorator, &mut None)
}

/// An ingress response carries the route's decorator operation (Envoy, for the caller's
/// client span).
pub(super) fn response_headers(
    resp: &mut pingora_http::ResponseHeader,
    operation: Option<&Arc<str>>,
) -> Result<()> {
    if let Some(op) = operation {
        resp.set(&DECORATOR_OPERATION_NAME, &**op)?;
    }
    Ok(())
}

/// At the request's end: Envoy's common tags from the record, and the span to the exporter.
pub(super) fn finish(trace: ActiveTrace, info: &StreamInfo, tracer: &Tracer) {
    let ActiveTrace {
        config,
        provider,
        ctx,
        name,
        mut tags,
    } = trace;
    tags.push(("component".into(), "proxy".into()));
    if let Some(u) = &info.upstream {
        tags.push(("upstream_cluster".into(), u.name.to_string()));
        tags.push((
            "upstream_cluster.name".into(),
            u.observability_name.to_string(),
        ));
    }
    tags.push(("http.status_code".into(), info.response_code.to_string()));
    tags.push(("response_size".into(), info.bytes_sent.to_string()));
    tags.push(("request_size".into(), info.bytes_received.to_string()));
    tags.push((
        "response_flags".into(),
        info.flags.short_string().into_owned(),
    ));
    if info.response_code == 0 || info.response_code >= 500 {
        tags.push(("error".into(), "true".into()));
    }
    tracer.report(FinishedSpan {
        config,
        provider,
        ctx,
        name,
        start: info.start_time(),
        duration: info.duration(),
        tags,
    });
}
