//! Local replies: responses the gateway makes itself (codec rejections, filter replies, direct
//! responses and redirects, upstream failures), as Envoy's `sendLocalReply` makes them, and for
//! a gRPC request as a trailers-only gRPC response. Also the mapping of a failed proxy attempt
//! to Envoy's status and details (`fail_to_proxy`).

use bytes::Bytes;
use http::header::HeaderName;
use pingora_error::{Error, ErrorSource, ErrorType, Result};
use pingora_http::ResponseHeader;
use pingora_proxy::{FailToProxy, Session};
use std::sync::atomic::Ordering::Relaxed;

use super::observe::details;
use super::timeouts::TimeoutKind;
use super::upstream::OVERFLOW;
use super::{filter_response_headers, hbone, Ctx, Gateway};
use crate::filters::{self, LocalReply};
use crate::telemetry::ResponseFlag;

static X_OVERLOADED: HeaderName = HeaderName::from_static("x-envoy-overloaded");

impl Gateway {
    /// An HTTP filter's local reply (a fault abort is `fault filter abort` as text, or for a
    /// gRPC request a trailers-only gRPC response, as Envoy's `sendLocalReply` makes it).
    pub(super) async fn filter_reply(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        r: LocalReply,
    ) -> Result<bool> {
        ctx.outcome(super::observe::filter_flag(&r.details), r.details.clone());
        tracing::trace!(
            details = &*r.details,
            status = r.status,
            "local reply from a filter"
        );
        self.local_reply_grpc(session, ctx, r.status, r.body, &r.headers, r.grpc_status)
            .await
    }

    /// The gateway's own answer: plain text, or trailers-only gRPC for a gRPC request.
    pub(super) async fn local_reply(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        status: u16,
        body: Option<Bytes>,
        extra: &[(HeaderName, String)],
    ) -> Result<bool> {
        self.local_reply_grpc(session, ctx, status, body, extra, None)
            .await
    }

    /// A gRPC request's local reply, as Envoy's `sendLocalReply` makes it: HTTP 200 with
    /// headers only (trailers-only), grpc-status (given, or mapped from the HTTP status) and
    /// the body as grpc-message.
    async fn grpc_local_reply(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        grpc_status: u32,
        body: Option<Bytes>,
        extra: &[(HeaderName, String)],
    ) -> Result<bool> {
        let mut resp = ResponseHeader::build(200, Some(6))?;
        for (k, v) in extra {
            resp.insert_header(k.clone(), v.as_str())?;
        }
        resp.insert_header(http::header::CONTENT_TYPE, "application/grpc")?;
        resp.insert_header("grpc-status", grpc_status.to_string())?;
        if let Some(b) = body.filter(|b| !b.is_empty()) {
            resp.insert_header("grpc-message", grpc_percent_encode(&b))?;
        }
        if let Some(rh) = &ctx.resp_headers {
            rh.apply(&mut resp, session.req_header());
        }
        if super::downstream_h1(session) {
            resp.insert_header(http::header::CONTENT_LENGTH, "0")?;
        }
        if let Some(h) = ctx.listener.as_ref().and_then(|l| l.def.hcm()) {
            super::upstream::server(&mut resp, h)?;
            super::upstream::manager_response(&mut resp, h, session.req_header())?;
        }
        // Trailers-only means END_STREAM on the HEADERS frame, as Envoy sends it; pingora's
        // session wrapper would drop the flag and end the stream with an empty DATA frame.
        if let pingora_core::protocols::http::ServerSession::H2(h2) = session.as_downstream_mut() {
            h2.write_response_header(Box::new(resp), true)?;
        } else {
            super::envoy_reason_phrase(session, &mut resp)?;
            session.write_response_header(Box::new(resp), true).await?;
        }
        Ok(true)
    }

    /// A local reply; `grpc_status` is the fault filter's for gRPC aborts.
    async fn local_reply_grpc(
        &self,
        session: &mut Session,
        ctx: &Ctx,
        status: u16,
        body: Option<Bytes>,
        extra: &[(HeaderName, String)],
        grpc_status: Option<u32>,
    ) -> Result<bool> {
        if self.chain.drain_close() {
            super::keepalive(session, ctx, None);
        }
        if ctx.grpc_request {
            let grpc_status =
                grpc_status.unwrap_or_else(|| filters::fault::http_to_grpc_status(status));
            return self
                .grpc_local_reply(session, ctx, grpc_status, body, extra)
                .await;
        }
        let mut resp = ResponseHeader::build(status, Some(4))?;
        let len = body.as_ref().map_or(0, |b| b.len());
        // 1xx and 204 responses never carry a body or its length (RFC 9110 §8.6).
        let no_body_status = status < 200 || status == 204;
        let body = if no_body_status { None } else { body };
        let head_only = session.req_header().method == http::Method::HEAD;
        // Envoy answers HEAD for an empty local reply without a length (chunked framing).
        let h2 = !super::downstream_h1(session);
        // Envoy sends an empty local reply without a length over HTTP/2, and to HEAD.
        let omit_length = no_body_status || (len == 0 && (head_only || h2));
        if !omit_length {
            resp.insert_header(http::header::CONTENT_LENGTH, len.to_string())?;
        }
        if len > 0 {
            resp.insert_header(http::header::CONTENT_TYPE, "text/plain")?;
        }
        for (k, v) in extra {
            resp.insert_header(k.clone(), v.as_str())?;
        }
        // The route's response headers reach its own local replies (direct responses,
        // redirects, upstream failures), as Envoy's router finalizes them.
        if let Some(rh) = &ctx.resp_headers {
            rh.apply(&mut resp, session.req_header());
        }
        if let Some(h) = ctx.listener.as_ref().and_then(|l| l.def.hcm()) {
            super::upstream::server(&mut resp, h)?;
            super::upstream::manager_response(&mut resp, h, session.req_header())?;
        }
        filter_response_headers(&mut resp, ctx)?;
        super::envoy_reason_phrase(session, &mut resp)?;
        session
            .write_response_header(Box::new(resp), body.is_none() || head_only)
            .await?;
        if let Some(b) = body {
            if !head_only {
                session.write_response_body(Some(b), true).await?;
            }
        }
        Ok(true)
    }

    /// A proxy attempt failed for good (pingora's `fail_to_proxy`): Envoy's reply for the
    /// error, unless the response has already started.
    pub(super) async fn fail_reply(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Ctx,
    ) -> FailToProxy {
        if session.response_written().is_some() {
            if e.esource() == &ErrorSource::Upstream {
                let (flag, details) = match e.etype() {
                    ErrorType::InvalidHTTPHeader
                    | ErrorType::H1Error
                    | ErrorType::H2Error
                    | ErrorType::InvalidH2 => (
                        ResponseFlag::UpstreamProtocolError,
                        details::RESET_AFTER_PROTOCOL,
                    ),
                    _ => (
                        ResponseFlag::UpstreamConnectionTermination,
                        details::RESET_AFTER_TERMINATION,
                    ),
                };
                ctx.outcome(Some(flag), details);
            }
            // The response has started: all that is left is to cut it short, as Envoy does.
            return FailToProxy {
                error_code: 0,
                can_reuse_downstream: false,
            };
        }
        let late_body = super::conn_state(session).is_some_and(|c| c.body_timed_out());
        let (code, body, flag, details) = if late_body {
            // `request_timeout` fired while the body was still coming (`conn`).
            (
                408,
                "request timeout",
                None,
                details::REQUEST_OVERALL_TIMEOUT,
            )
        } else {
            failure_reply(e, ctx)
        };
        if code > 0 || flag.is_some() {
            ctx.outcome(flag, details);
        }
        if code > 0 {
            // pingora closes the downstream connection after a failed proxy attempt; saying so
            // keeps clients from reusing it (Envoy keeps it open).
            super::keepalive(session, ctx, None);
            let body = (!body.is_empty()).then(|| Bytes::from_static(body.as_bytes()));
            let overloaded = [(X_OVERLOADED.clone(), "true".to_string())];
            let suppressed = ctx
                .listener
                .as_ref()
                .and_then(|l| l.def.hcm())
                .is_some_and(|h| h.suppress_envoy_headers);
            let extra: &[(HeaderName, String)] = if *e.etype() == OVERFLOW && !suppressed {
                &overloaded
            } else {
                &[]
            };
            // Envoy's stream duration timer names its own gRPC status.
            let grpc = (matches!(
                e.etype(),
                ErrorType::ReadTimedout | ErrorType::WriteTimedout
            ) && ctx.timeout_kind == TimeoutKind::Stream)
                .then_some(4);
            if let Err(err) = self
                .local_reply_grpc(session, ctx, code, body, extra, grpc)
                .await
            {
                tracing::debug!("failed to send error response downstream: {err}");
            }
        }
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }
}

/// Envoy's body for an upstream reset before the response started.
macro_rules! reset {
    ($reason:literal) => {
        concat!(
            "upstream connect error or disconnect/reset before headers. reset reason: ",
            $reason
        )
    };
}

/// Envoy's status, body, response flag and details for a failed proxy attempt (status 0: no
/// reply, the client is gone). A route or per-try timeout counts in the cluster's
/// `upstream_rq_timeout`.
fn failure_reply(e: &Error, ctx: &Ctx) -> (u16, &'static str, Option<ResponseFlag>, &'static str) {
    use ErrorType::*;
    use ResponseFlag as F;
    let upstream = e.esource() == &ErrorSource::Upstream;
    match e.etype() {
        InvalidHTTPHeader | H1Error | H2Error | InvalidH2 if upstream => (
            502,
            reset!("protocol error"),
            Some(F::UpstreamProtocolError),
            details::RESET_PROTOCOL,
        ),
        HTTPStatus(code) => (*code, "", None, ""),
        t if *t == OVERFLOW => (
            503,
            reset!("overflow"),
            Some(F::UpstreamOverflow),
            details::RESET_OVERFLOW,
        ),
        ConnectTimedout => (
            503,
            reset!("connection timeout"),
            Some(F::UpstreamConnectionFailure),
            details::RESET_CONNECT_TIMEOUT,
        ),
        // A failed upstream handshake too: Envoy names no TLS reason in the reply.
        ConnectRefused | ConnectNoRoute | ConnectError | ConnectProxyFailure
        | TLSHandshakeFailure => (
            503,
            reset!("remote connection failure"),
            Some(F::UpstreamConnectionFailure),
            details::RESET_REMOTE_CONNECT,
        ),
        SocketError | BindError => (
            503,
            reset!("local connection failure"),
            Some(F::UpstreamConnectionFailure),
            details::RESET_LOCAL_CONNECT,
        ),
        ReadTimedout | WriteTimedout => match ctx.timeout_kind {
            // The connection manager's stream timers answer for the stream, not the route.
            TimeoutKind::Stream => (
                504,
                "downstream duration timeout",
                Some(F::DurationTimeout),
                details::DURATION_TIMEOUT,
            ),
            TimeoutKind::Idle => (
                504,
                "stream timeout",
                Some(F::StreamIdleTimeout),
                details::STREAM_IDLE_TIMEOUT,
            ),
            kind @ (TimeoutKind::Route | TimeoutKind::PerTry) => {
                if let Some(c) = &ctx.cluster {
                    c.stats.rq_timeout.fetch_add(1, Relaxed);
                }
                let details = if kind == TimeoutKind::PerTry {
                    details::PER_TRY_TIMEOUT
                } else {
                    details::UPSTREAM_TIMEOUT
                };
                (
                    504,
                    "upstream request timeout",
                    Some(F::UpstreamRequestTimeout),
                    details,
                )
            }
        },
        // Envoy's internal connection closed by its tcp_proxy when the tunnel failed.
        t if *t == hbone::TUNNEL_FAILURE => (
            503,
            reset!("connection termination"),
            Some(F::UpstreamConnectionTermination),
            details::RESET_TERMINATION,
        ),
        _ => match e.esource() {
            ErrorSource::Upstream => (
                503,
                reset!("connection termination"),
                Some(F::UpstreamConnectionTermination),
                details::RESET_TERMINATION,
            ),
            ErrorSource::Downstream => match e.etype() {
                WriteError | ReadError | ConnectionClosed => (
                    0,
                    "",
                    Some(F::DownstreamConnectionTermination),
                    details::DOWNSTREAM_DISCONNECT,
                ),
                _ => (400, "", Some(F::DownstreamProtocolError), ""),
            },
            ErrorSource::Internal | ErrorSource::Unset => (500, "", None, ""),
        },
    }
}

/// grpc-message encoding (gRPC's HTTP/2 spec, as Envoy's `PercentEncoding::encode`): bytes
/// outside printable ASCII, and `%`, become `%XX`.
fn grpc_percent_encode(msg: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(msg.len());
    for &b in msg {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_messages_are_percent_encoded() {
        assert_eq!(
            grpc_percent_encode(b"fault filter abort"),
            "fault filter abort"
        );
        assert_eq!(
            grpc_percent_encode("100% café\n".as_bytes()),
            "100%25 caf%C3%A9%0A"
        );
    }
}
