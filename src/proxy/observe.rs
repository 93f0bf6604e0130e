//! The request's record for its observers (`crate::telemetry::StreamInfo`): begun with the
//! request, marked by the phase that decides its outcome (Envoy's response flags and response
//! code details), finished in `logging`. Access logs, Istio's metrics and traces read it there.

use std::borrow::Cow;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use pingora_error::{Error, ErrorSource};
use pingora_proxy::Session;

use super::Ctx;
use crate::live::grpc::MethodCounters;
use crate::telemetry::{Protocol, ResponseFlag, StreamInfo};

/// Envoy's `upstream_reset_before_response_started{<reason>}` details, by reset reason.
pub(super) mod details {
    pub const VIA_UPSTREAM: &str = "via_upstream";
    pub const ROUTE_NOT_FOUND: &str = "route_not_found";
    pub const CLUSTER_NOT_FOUND: &str = "cluster_not_found";
    pub const NO_HEALTHY_UPSTREAM: &str = "no_healthy_upstream";
    pub const DIRECT_RESPONSE: &str = "direct_response";
    pub const UPSTREAM_TIMEOUT: &str = "upstream_response_timeout";
    pub const PER_TRY_TIMEOUT: &str = "upstream_per_try_timeout";
    pub const STREAM_IDLE_TIMEOUT: &str = "stream_idle_timeout";
    pub const DURATION_TIMEOUT: &str = "max_duration_timeout";
    pub const REQUEST_OVERALL_TIMEOUT: &str = "request_overall_timeout";
    pub const DOWNSTREAM_DISCONNECT: &str = "downstream_remote_disconnect";
    pub const RESET_OVERFLOW: &str = "upstream_reset_before_response_started{overflow}";
    pub const RESET_CONNECT_TIMEOUT: &str =
        "upstream_reset_before_response_started{connection_timeout}";
    pub const RESET_REMOTE_CONNECT: &str =
        "upstream_reset_before_response_started{remote_connection_failure}";
    pub const RESET_LOCAL_CONNECT: &str =
        "upstream_reset_before_response_started{local_connection_failure}";
    pub const RESET_TERMINATION: &str =
        "upstream_reset_before_response_started{connection_termination}";
    pub const RESET_PROTOCOL: &str = "upstream_reset_before_response_started{protocol_error}";
    pub const RESET_AFTER_TERMINATION: &str =
        "upstream_reset_after_response_started{connection_termination}";
    pub const RESET_AFTER_PROTOCOL: &str = "upstream_reset_after_response_started{protocol_error}";
}

/// What a filter's local reply says about the request, by its details.
pub(super) fn filter_flag(details: &str) -> Option<ResponseFlag> {
    match details {
        "fault_filter_abort" => Some(ResponseFlag::FaultInjected),
        "local_rate_limited" => Some(ResponseFlag::RateLimited),
        "health_check_failed" => Some(ResponseFlag::FailedLocalHealthCheck),
        "ext_authz_denied" | "ext_authz_error" => Some(ResponseFlag::UnauthorizedExternalService),
        _ => None,
    }
}

impl Ctx {
    /// The phase that decided the request's outcome says so (a flag, Envoy's details).
    pub(super) fn outcome(
        &mut self,
        flag: Option<ResponseFlag>,
        details: impl Into<Cow<'static, str>>,
    ) {
        if let Some(f) = flag {
            self.info.flags.set(f);
        }
        self.info.response_code_details = details.into();
    }
}

/// At the request's start: what the connection says.
pub(super) fn begin(session: &Session, info: &mut StreamInfo) {
    info.protocol = match session.req_header().version {
        http::Version::HTTP_10 | http::Version::HTTP_09 => Protocol::Http10,
        http::Version::HTTP_2 => Protocol::Http2,
        _ => Protocol::Http11,
    };
    info.downstream_direct_remote = session.client_addr().and_then(|a| a.as_inet()).copied();
    info.downstream_local = session.server_addr().and_then(|a| a.as_inet()).copied();
    info.downstream_tls = session.digest().is_some_and(|d| d.ssl_digest.is_some());
    if info.downstream_tls {
        info.requested_server_name = super::client_cert::sni_of(session.digest());
    }
}

/// At the request's end (pingora's `logging`): the rest of the record, from the session and
/// what the phases kept.
static GRPC_STATUS: http::HeaderName = http::HeaderName::from_static("grpc-status");

pub(super) fn finish(session: &Session, ctx: &mut Ctx, e: Option<&Error>) {
    let written = session.response_written();
    let code = written.map_or(0, |r| r.status.as_u16());
    // The access log and a trace's span (one begun, or one `end_request` may still begin)
    // give the wall clock at the start.
    let wall = ctx.trace.is_some()
        || ctx
            .listener
            .as_ref()
            .and_then(|l| l.def.hcm())
            .is_some_and(|h| !h.access_log.is_empty() || h.tracing.is_some());
    let info = &mut ctx.info;
    info.response_code = code;
    info.bytes_received = session.body_bytes_read() as u64;
    info.bytes_sent = session.body_bytes_sent() as u64;
    let elapsed = info.started.elapsed();
    info.last_downstream_tx = Some(elapsed);
    if wall {
        info.settle_start_time(elapsed);
    }
    info.attempts = ctx.attempts;
    if let Some(c) = &ctx.cluster {
        info.upstream = Some(c.def.telemetry.clone());
    }
    info.upstream_host = ctx.peer;
    // A request that ended before the connection manager's headers (a local reply) has its
    // XFF as the client sent it.
    if let (false, Some(hcm)) = (
        ctx.remote_settled,
        ctx.listener.as_ref().and_then(|l| l.def.hcm()),
    ) {
        info.downstream_remote = super::downstream::downstream_remote(
            &session.req_header().headers,
            info.downstream_direct_remote,
            hcm,
        );
    }
    if info.grpc_status.is_none() {
        // A trailers-only gRPC response (or a local reply) carries it in its headers.
        // Looked up only when there: a lookup hashes the name, a scan of the few names a
        // response has costs less, and most responses are not gRPC.
        info.grpc_status = written
            .filter(|r| super::downstream::has(&r.headers, &GRPC_STATUS))
            .and_then(|r| r.headers.get(&GRPC_STATUS))
            .and_then(|v| std::str::from_utf8(v.as_bytes()).ok()?.parse().ok());
    }
    grpc_status(ctx);
    let info = &mut ctx.info;
    if ctx.filters.delay_injected {
        info.flags.set(ResponseFlag::DelayInjected);
    }
    let client_gone = e.is_some_and(|e| e.esource() == &ErrorSource::Downstream);
    if client_gone {
        info.flags
            .set(ResponseFlag::DownstreamConnectionTermination);
        if code == 0 {
            info.response_code_details = Cow::Borrowed(details::DOWNSTREAM_DISCONNECT);
        }
    }
    if info.response_code_details.is_empty() && code > 0 && info.first_upstream_rx.is_some() {
        info.response_code_details = Cow::Borrowed(details::VIA_UPSTREAM);
    }
}

/// The request's body has all arrived.
pub(super) fn request_done(info: &mut StreamInfo) {
    if info.last_downstream_rx.is_none() {
        info.last_downstream_rx = Some(info.started.elapsed());
    }
}

/// An upstream attempt starts sending, `at` after the request's start.
pub(super) fn upstream_sent(info: &mut StreamInfo, at: std::time::Duration) {
    if info.first_upstream_tx.is_none() {
        info.first_upstream_tx = Some(at);
    }
}

/// The upstream's response headers arrived.
pub(super) fn upstream_answered(info: &mut StreamInfo) {
    info.first_upstream_rx = Some(info.started.elapsed());
}

/// The upstream's trailers: their grpc-status.
pub(super) fn upstream_trailers(info: &mut StreamInfo, trailers: &http::HeaderMap) {
    if let Some(s) = trailers
        .get("grpc-status")
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok()?.parse().ok())
    {
        info.grpc_status = Some(s);
    }
}

/// Retries ran out (`URX`) or their circuit breaker overflowed (`UO`).
pub(super) fn retries_exhausted(info: &mut StreamInfo, overflow: bool) {
    info.flags.set(if overflow {
        ResponseFlag::UpstreamOverflow
    } else {
        ResponseFlag::UpstreamRetryLimitExceeded
    });
}

/// The connection manager's access logs, once the record is finished.
pub(super) fn access_log(session: &Session, ctx: &Ctx) {
    let Some(hcm) = ctx.listener.as_ref().and_then(|l| l.def.hcm()) else {
        return;
    };
    if hcm.access_log.is_empty() {
        return;
    }
    let req = session.req_header();
    let authority = super::downstream::raw_authority(req);
    let log = crate::telemetry::access_log::LogContext {
        info: &ctx.info,
        request: Some(super::routing::request_view(req, authority)),
        response: session.response_written().map(|r| &r.headers),
        // pingora keeps no downstream trailers; `%TRAILER(...)%` shows `-`.
        trailers: None,
        log_type: crate::telemetry::access_log::log_type::DOWNSTREAM_END,
    };
    hcm.access_log.log(&log);
}

/// `%UPSTREAM_TRANSPORT_FAILURE_REASON%` of a failed connect, in Envoy's words (the socket's
/// error as Envoy's connection reports it). A timeout has none in Envoy.
pub(super) fn transport_failure(info: &mut StreamInfo, e: &Error) {
    use pingora_error::ErrorType;
    let reason = match e.etype() {
        ErrorType::ConnectRefused => "delayed connect error: Connection refused",
        ErrorType::ConnectNoRoute => "delayed connect error: No route to host",
        _ => return,
    };
    info.upstream_transport_failure_reason = Some(reason.to_string());
}

/// The gRPC stats filter's counters for the call, from the routed cluster (found once, on the
/// first body or at the end).
fn grpc_counters(ctx: &mut Ctx) -> Option<Arc<MethodCounters>> {
    if let Some(c) = &ctx.grpc_counters {
        return Some(c.clone());
    }
    let call = ctx.filters.grpc.as_ref()?;
    let cluster = match &ctx.cluster {
        Some(c) => c.clone(),
        // Answered before an upstream was chosen (no healthy host): the routed cluster.
        None => {
            let name = ctx.info.upstream.as_ref()?.name.clone();
            ctx.snapshot.as_ref()?.clusters.get(&*name)?.clone()
        }
    };
    let m = cluster.stats.grpc.method(call.names.as_deref());
    ctx.grpc_counters = Some(m.clone());
    Some(m)
}

pub(super) fn grpc_request_body(ctx: &mut Ctx, body: &[u8]) {
    let Some(call) = ctx.filters.grpc.as_mut() else {
        return;
    };
    let n = call.requests.inspect(body);
    if n > 0 {
        if let Some(m) = grpc_counters(ctx) {
            m.request_message_count.fetch_add(n, Relaxed);
        }
    }
}

pub(super) fn grpc_response_body(ctx: &mut Ctx, body: &[u8]) {
    let Some(call) = ctx.filters.grpc.as_mut() else {
        return;
    };
    let n = call.responses.inspect(body);
    if n > 0 {
        if let Some(m) = grpc_counters(ctx) {
            m.response_message_count.fetch_add(n, Relaxed);
        }
    }
}

/// The call's status, counted at its end (trailers, or the headers of a trailers-only
/// response); the filter state with the message counts.
fn grpc_status(ctx: &mut Ctx) {
    let Some(call) = ctx.filters.grpc.as_ref() else {
        return;
    };
    if call.emit_filter_state {
        ctx.info.grpc_messages = Some((call.requests.frames, call.responses.frames));
    }
    let Some(status) = ctx.info.grpc_status else {
        return;
    };
    if let Some(m) = grpc_counters(ctx) {
        m.status(status);
    }
}
