//! The request's timeouts, as Envoy's router and connection manager set them: the route
//! timeout (or the gRPC one), per-try timeout, `x-envoy-upstream-rq-*-timeout-ms`,
//! `max_stream_duration` and `grpc-timeout`, the stream idle timeout. Each attempt's wait for
//! the upstream is bounded by the first of them to run out (`upstream::choose_peer`), and
//! answered for it (`local_reply`).

use std::time::Instant;

use http::header::HeaderName;
use pingora_error::Result;
use pingora_http::RequestHeader;
use pingora_proxy::Session;

use super::head::SetHeader;
use super::Ctx;
use crate::snapshot::route::Forward;

/// The timeouts that can end a wait for the upstream, each answered as Envoy answers it.
#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum TimeoutKind {
    #[default]
    Route,
    PerTry,
    /// The stream's maximum duration: 504 `downstream duration timeout`.
    Stream,
    /// The stream idle timeout: 504 `stream timeout`.
    Idle,
}

static X_UPSTREAM_RQ_TIMEOUT: HeaderName =
    HeaderName::from_static("x-envoy-upstream-rq-timeout-ms");
static X_UPSTREAM_PER_TRY_TIMEOUT: HeaderName =
    HeaderName::from_static("x-envoy-upstream-rq-per-try-timeout-ms");
static GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");
static X_EXPECTED_TIMEOUT: HeaderName = HeaderName::from_static("x-envoy-expected-rq-timeout-ms");
/// A `grpc-timeout` value (gRPC's HTTP/2 spec: up to 8 digits and a unit), as Envoy reads it.
fn parse_grpc_timeout(v: &http::HeaderValue) -> Option<std::time::Duration> {
    use std::time::Duration;
    let v = v.as_bytes();
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b"H" => Duration::from_secs(n * 3600),
        b"M" => Duration::from_secs(n * 60),
        b"S" => Duration::from_secs(n),
        b"m" => Duration::from_millis(n),
        // Envoy works in whole milliseconds and rounds smaller units up.
        b"u" => Duration::from_millis(n.div_ceil(1000)),
        b"n" => Duration::from_millis(n.div_ceil(1_000_000)),
        _ => return None,
    })
}

/// Envoy's `grpc-timeout` form: milliseconds, or a larger unit when it would not fit 8 digits.
fn grpc_timeout_value(d: std::time::Duration) -> String {
    const MAX: u128 = 99_999_999;
    let mut t = d.as_millis();
    for (unit, next) in [('m', 1000), ('S', 60), ('M', 60)] {
        if t <= MAX {
            return format!("{t}{unit}");
        }
        t /= next;
    }
    format!("{}H", t.min(MAX))
}

/// Whole milliseconds as a header value.
pub(super) fn millis_value(d: std::time::Duration) -> http::HeaderValue {
    super::head::int_value(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A non-negative integer header (Envoy's `SimpleAtoi`), in milliseconds.
fn header_ms(req: &RequestHeader, name: &HeaderName) -> Option<Option<std::time::Duration>> {
    let v = req.headers.get(name)?;
    Some(
        v.to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .map(std::time::Duration::from_millis),
    )
}

/// Envoy's timeouts for a routed request: the router's (`finalTimeout`: route timeout or the
/// gRPC header under `max_grpc_timeout`, `x-envoy-upstream-rq-timeout-ms`, per-try timeout)
/// and the connection manager's stream timers (`max_stream_duration`, `grpc-timeout` under
/// `grpc_timeout_header_max`, stream idle timeout). Control headers are consumed here; they
/// are only still present on internal requests.
fn set_timeouts(
    ctx: &mut Ctx,
    req: &mut RequestHeader,
    fwd: &Forward,
    hcm: &crate::snapshot::listener::Hcm,
) -> Result<()> {
    use std::time::Duration;
    let now = Instant::now();
    ctx.clock = Some(now);
    let t = &fwd.timeouts;
    let grpc_header = if ctx.grpc_request {
        req.headers.get(&GRPC_TIMEOUT).and_then(parse_grpc_timeout)
    } else {
        None
    };
    let legacy_grpc = t.max_stream.is_none() && ctx.grpc_request && t.max_grpc.is_some();
    // With max_stream_duration on the route, Envoy's "new timeouts" leave no route timeout.
    let mut global = match (&t.max_stream, t.max_grpc) {
        (Some(_), _) => None,
        (None, Some(max)) if ctx.grpc_request => {
            let mut g = grpc_header.unwrap_or(Duration::ZERO);
            if let Some(off) = t.grpc_offset.filter(|off| *off < g) {
                g -= off;
            }
            if !max.is_zero() && (g.is_zero() || g > max) {
                g = max;
            }
            Some(g)
        }
        _ => fwd.timeout,
    }
    .filter(|d| !d.is_zero());
    let mut per_try = ctx.retry.as_ref().and_then(|p| p.per_try_timeout);
    // Both control headers share a prefix: one pass over the (few) names present finds
    // neither on most requests, where a lookup hashes its name (~250 instructions each).
    if req
        .headers
        .keys()
        .any(|k| k.as_str().starts_with("x-envoy-upstream-rq-"))
    {
        if let Some(v) = header_ms(req, &X_UPSTREAM_RQ_TIMEOUT) {
            if let Some(ms) = v {
                global = (!ms.is_zero()).then_some(ms);
            }
            req.remove_header(&X_UPSTREAM_RQ_TIMEOUT);
        }
        if let Some(v) = header_ms(req, &X_UPSTREAM_PER_TRY_TIMEOUT) {
            if let Some(ms) = v {
                per_try = Some(ms);
            }
            req.remove_header(&X_UPSTREAM_PER_TRY_TIMEOUT);
        }
    }
    // A per-try timeout as long as the whole one means nothing.
    per_try = per_try.filter(|p| !p.is_zero() && global.is_none_or(|g| *p < g));
    ctx.timeout = global;
    ctx.deadline = global.map(|g| now + g);
    ctx.per_try = per_try;
    match per_try.or(global) {
        Some(expected) => {
            if !hcm.suppress_envoy_headers {
                req.set(&X_EXPECTED_TIMEOUT, millis_value(expected))?;
            }
            if legacy_grpc {
                req.set(&GRPC_TIMEOUT, grpc_timeout_value(expected))?;
            }
        }
        None => {
            req.remove_header(&X_EXPECTED_TIMEOUT);
        }
    }
    let header_max = t.max_stream.as_ref().and_then(|m| m.grpc_header_max);
    let stream = match (grpc_header, header_max) {
        (Some(mut d), Some(max)) => {
            if !max.is_zero() && d > max {
                d = max;
            }
            if let Some(off) = t.max_stream.as_ref().and_then(|m| m.grpc_header_offset) {
                if !d.is_zero() {
                    d = d.saturating_sub(off);
                }
            }
            Some(d)
        }
        _ => match t.max_stream.as_ref().and_then(|m| m.duration) {
            Some(route) => route,
            None => hcm.max_stream_duration,
        },
    };
    if let (Some(d), true) = (stream, t.max_stream.is_some() && ctx.grpc_request) {
        req.set(&GRPC_TIMEOUT, grpc_timeout_value(d))?;
    }
    ctx.stream_deadline = stream.map(|d| now + d);
    ctx.idle = match t.idle {
        Some(route) => route,
        None => hcm.stream_idle_timeout,
    };
    Ok(())
}

/// The request's timers once it is routed (`set_timeouts`). An upgrade's differ: Envoy arms
/// the route and per-try timeouts when the request ends, which an upgrade request never does;
/// nor does it retry a request still streaming. The stream idle timeout (and
/// max_stream_duration) still bound it, both ways.
pub(super) fn arm_timers(
    session: &mut Session,
    ctx: &mut Ctx,
    fwd: &Forward,
    hcm: &crate::snapshot::listener::Hcm,
) -> Result<()> {
    // Envoy announces the per-try timeout when there is one, else the route's.
    set_timeouts(ctx, session.req_header_mut(), fwd, hcm)?;
    if ctx.upgrade {
        ctx.timeout = None;
        ctx.deadline = None;
        ctx.per_try = None;
        ctx.retry = None;
        // pingora's 60 s body-read default would cut a quiet client of the tunnel; Envoy
        // leaves it to the stream idle timeout.
        if let pingora_core::protocols::http::ServerSession::H1(h1) = session.as_downstream_mut() {
            h1.set_read_timeout(ctx.idle);
        }
    }
    Ok(())
}

/// A timer kept from one use to the next (a connection's keep-alive wait, its upstream
/// reads). Arming a fresh tokio timer per use costs an insertion into the timer wheel and a
/// removal after it; this one is moved only when it would fire late (a shorter wait) or has
/// fired. One armed for an earlier use's deadline fires early and is then moved to the
/// current one, as nginx's lazy timers do: once per period rather than once per use.
#[derive(Default)]
pub(crate) struct LazyTimer(Option<std::pin::Pin<Box<tokio::time::Sleep>>>);

impl LazyTimer {
    /// Resolves when the timer fires: true when `at` has been reached, false when it fired
    /// for an earlier deadline (call again to wait for `at`).
    pub async fn until(&mut self, at: tokio::time::Instant) -> bool {
        let sleep = match &mut self.0 {
            Some(s) => {
                if s.deadline() > at || s.is_elapsed() {
                    s.as_mut().reset(at);
                }
                s
            }
            None => self.0.insert(Box::pin(tokio::time::sleep_until(at))),
        };
        sleep.as_mut().await;
        tokio::time::Instant::now() >= at
    }

    /// `fut` unless `at` comes first (None).
    pub async fn bound<F: std::future::Future>(
        &mut self,
        at: tokio::time::Instant,
        fut: F,
    ) -> Option<F::Output> {
        let mut fut = std::pin::pin!(fut);
        loop {
            tokio::select! {
                biased;
                out = fut.as_mut() => return Some(out),
                reached = self.until(at) => if reached {
                    return None;
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_lazy_timer_moves_only_when_it_would_fire_late_or_has_fired() {
        use futures::FutureExt;
        use std::time::Duration;
        use tokio::time::Instant;
        let deadline = |t: &LazyTimer| t.0.as_ref().map(|s| s.deadline());
        let mut t = LazyTimer::default();

        // First use arms it; it reaches its deadline.
        let at = Instant::now() + Duration::from_millis(20);
        assert!(t.until(at).await);

        // Fired: the next deadline re-arms it.
        let early = Instant::now() + Duration::from_millis(20);
        assert_eq!(t.until(early).now_or_never(), None);
        assert_eq!(deadline(&t), Some(early));

        // A later deadline (the next request's) leaves the armed one alone: it fires early,
        // says so, and is then moved to the later one.
        let late = Instant::now() + Duration::from_secs(30);
        assert!(!t.until(late).await, "fired for the earlier deadline");
        assert!(Instant::now() >= early && Instant::now() < late);
        assert_eq!(t.until(late).now_or_never(), None);
        assert_eq!(deadline(&t), Some(late));

        // A shorter keep-alive moves it earlier at once.
        let short = Instant::now() + Duration::from_millis(20);
        assert!(t.until(short).await);
        assert!(Instant::now() >= short);
    }

    #[tokio::test]
    async fn a_bound_read_ends_at_its_own_deadline_not_an_earlier_armed_one() {
        use std::time::Duration;
        use tokio::time::Instant;
        let mut t = LazyTimer::default();
        // What is ready comes through, the timer untouched.
        let at = Instant::now() + Duration::from_secs(30);
        assert_eq!(t.bound(at, async { 7 }).await, Some(7));

        // Armed for an earlier wait, the timer fires early: the bound waits on to its own.
        let early = Instant::now() + Duration::from_millis(10);
        assert_eq!(t.bound(early, std::future::pending::<()>()).await, None);
        assert!(Instant::now() >= early);
        let own = Instant::now() + Duration::from_millis(60);
        let armed = Instant::now() + Duration::from_millis(10);
        let _ = futures::FutureExt::now_or_never(t.until(armed));
        assert_eq!(t.bound(own, std::future::pending::<()>()).await, None);
        assert!(
            Instant::now() >= own,
            "not cut short by the earlier deadline"
        );

        // A read that completes after the earlier deadline but before its own comes through.
        let armed = Instant::now() + Duration::from_millis(10);
        let _ = futures::FutureExt::now_or_never(t.until(armed));
        let own = Instant::now() + Duration::from_secs(30);
        let read = tokio::time::sleep(Duration::from_millis(40));
        assert_eq!(
            t.bound(own, async {
                read.await;
                1
            })
            .await,
            Some(1)
        );
    }

    #[test]
    fn grpc_timeouts_parse_and_format_as_envoy() {
        let v = |s: &'static str| parse_grpc_timeout(&http::HeaderValue::from_static(s));
        let ms = std::time::Duration::from_millis;
        assert_eq!(v("300m"), Some(ms(300)));
        assert_eq!(v("2S"), Some(ms(2000)));
        assert_eq!(v("1M"), Some(ms(60_000)));
        assert_eq!(v("1H"), Some(ms(3_600_000)));
        assert_eq!(v("1500u"), Some(ms(2)), "sub-millisecond units round up");
        assert_eq!(v("1n"), Some(ms(1)));
        for bad in ["", "m", "10", "123456789m", "1x", "-1m", "1.5S"] {
            assert_eq!(v(bad), None, "{bad}");
        }
        assert_eq!(grpc_timeout_value(ms(400)), "400m");
        assert_eq!(grpc_timeout_value(ms(100_000_000)), "100000S");
        assert_eq!(
            grpc_timeout_value(std::time::Duration::from_secs(100_000_000)),
            "1666666M"
        );
    }
}
