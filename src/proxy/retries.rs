//! Retries: Envoy's retry policy and its circuit breakers (`max_retries`, retry budgets),
//! back-off, the next host (retry host predicates, hashing clusters), and each attempt's outcome
//! per host (outlier detection, passive health checks). pingora asks through
//! `upstream_response_filter`, `error_while_proxy` and `fail_to_connect`, and retries when the
//! error it gets back says so.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorSource, ErrorType, Result};
use pingora_http::ResponseHeader;
use pingora_proxy::Session;

use super::timeouts::TimeoutKind;
use super::{hbone, Ctx, Gateway};
use crate::snapshot::retry::{Failure, RetryPolicy};

impl Gateway {
    /// Whether the request may be tried again under `policy`, counting Envoy's retry stats:
    /// retries left, the cluster's concurrent-retry circuit breaker, a body that can be
    /// resent (pingora buffers it up to its retry buffer size), and time left.
    fn may_retry(&self, session: &Session, ctx: &mut Ctx, policy: &RetryPolicy) -> bool {
        let Some(cluster) = ctx.cluster.clone() else {
            return false;
        };
        if ctx.attempts > policy.num_retries {
            cluster.stats.rq_retry_limit_exceeded.fetch_add(1, Relaxed);
            super::observe::retries_exhausted(&mut ctx.info, false);
            return false;
        }
        if session.as_ref().retry_buffer_truncated() {
            return false;
        }
        if ctx.deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        if !ctx.retry_slot {
            let active = cluster.stats.retry_active.fetch_add(1, Relaxed);
            let max = match &cluster.def.retry_budget {
                Some(b) => b.max(
                    cluster.stats.rq_active.load(Relaxed)
                        + cluster.stats.rq_pending_active.load(Relaxed),
                ),
                None => u64::from(cluster.def.max_retries),
            };
            if active >= max {
                cluster.stats.retry_active.fetch_sub(1, Relaxed);
                cluster.stats.rq_retry_overflow.fetch_add(1, Relaxed);
                super::observe::retries_exhausted(&mut ctx.info, true);
                return false;
            }
            ctx.retry_slot = true;
        }
        cluster.stats.rq_retry.fetch_add(1, Relaxed);
        true
    }

    /// Before a retry: Envoy's back-off, then a host of the same cluster, avoiding the hosts
    /// already tried when the policy has the previous_hosts predicate.
    pub(super) async fn next_attempt(&self, ctx: &mut Ctx) -> Result<()> {
        let (Some(policy), Some(cluster)) = (ctx.retry.clone(), ctx.cluster.clone()) else {
            return Ok(());
        };
        let wait = policy.backoff(ctx.attempts - 1, fastrand::u64(..));
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        if cluster.def.original_dst.is_some() {
            // The request still names the same host: Envoy's retry asks the original-dst
            // balancer again and gets it back, whatever the retry host predicates say.
            cluster.stats.start();
            return Ok(());
        }
        ctx.tried.push(ctx.host_index);
        // A hashing cluster keeps the request's hash (a new random one without it) and, as
        // Envoy, walks the ring or flips the table hash for each host the predicate refuses.
        let hash = cluster
            .hashes()
            .then(|| ctx.request_hash.unwrap_or_else(|| fastrand::u64(..)));
        let choose = |attempt: u32| match hash {
            Some(h) => cluster.pick_hashed_attempt(Some(h), attempt),
            None => cluster.pick(),
        };
        let mut pick = choose(0);
        if policy.previous_hosts {
            for attempt in 1..=policy.host_selection_attempts {
                match pick {
                    Some((i, _)) if ctx.tried.contains(&i) => pick = choose(attempt),
                    _ => break,
                }
            }
        }
        let Some((idx, addr)) = pick else {
            return Error::e_explain(
                ErrorType::ConnectNoRoute,
                "no healthy upstream for the retry",
            );
        };
        cluster.active[ctx.host_index].fetch_sub(1, Relaxed);
        cluster.active[idx].fetch_add(1, Relaxed);
        ctx.host_index = idx;
        ctx.peer = Some(addr);
        // Envoy counts every attempt as an upstream request.
        cluster.stats.start();
        Ok(())
    }

    /// pingora's `upstream_response_filter`: the host's outcome (outlier detection, passive
    /// health checks), and whether the retry policy tries again for this answer.
    pub(super) fn upstream_response(
        &self,
        session: &mut Session,
        resp: &ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        let status = resp.status.as_u16();
        if let Some(c) = &ctx.cluster {
            c.record_outcome(ctx.host_index, status);
            // Envoy's passive health check: the upstream asks to be taken out now.
            if !c.hc.is_empty()
                && resp
                    .headers
                    .contains_key("x-envoy-immediate-health-check-fail")
            {
                if let Some(h) = c.endpoints.hosts.get(ctx.host_index) {
                    c.stats.health.passive_failure(&h.addr);
                }
            }
        }
        let Some(policy) = ctx.retry.clone() else {
            return Ok(());
        };
        let grpc_status = resp
            .headers
            .get("grpc-status")
            .and_then(|v| std::str::from_utf8(v.as_bytes()).ok()?.parse().ok());
        // Envoy never retries an answer that says the upstream is overloaded or rate limited.
        let refused = resp.headers.contains_key("x-envoy-overloaded")
            || resp.headers.contains_key("x-envoy-ratelimited");
        if refused || !policy.retries_status(status, grpc_status) {
            if ctx.attempts > 1 {
                if let Some(c) = &ctx.cluster {
                    c.stats.rq_retry_success.fetch_add(1, Relaxed);
                }
            }
            return Ok(());
        }
        if !self.may_retry(session, ctx, &policy) {
            return Ok(());
        }
        // This attempt's answer is counted now; the client will see the next one.
        if let Some(c) = &ctx.cluster {
            c.stats.record_code(status);
        }
        ctx.retrying = true;
        Error::e_explain(
            ErrorType::Custom("retriable upstream response"),
            format!("upstream answered {status}, retrying"),
        )
    }

    /// pingora's `error_while_proxy`: the host's outcome, and whether to retry after a reset or
    /// a per-try timeout.
    pub(super) fn upstream_error(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut Ctx,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        if std::mem::take(&mut ctx.retrying) {
            e.set_retry(true);
            return e;
        }
        let upstream = e.esource() == &ErrorSource::Upstream;
        let timed_out = matches!(
            e.etype(),
            ErrorType::ReadTimedout | ErrorType::WriteTimedout
        );
        let per_try = timed_out && ctx.timeout_kind == TimeoutKind::PerTry;
        if per_try {
            if let Some(c) = &ctx.cluster {
                c.stats.rq_per_try_timeout.fetch_add(1, Relaxed);
            }
        }
        if upstream && session.response_written().is_none() {
            if let Some(c) = &ctx.cluster {
                // Timeouts count as 504, resets and broken connections as 503.
                c.record_outcome(ctx.host_index, if timed_out { 504 } else { 503 });
            }
        }
        // A reset, a broken connection or a per-try timeout before the response started.
        let retry = (per_try || upstream && !timed_out)
            && session.response_written().is_none()
            && ctx.retry.clone().is_some_and(|p| {
                p.retries_failure(Failure::Reset) && self.may_retry(session, ctx, &p)
            });
        e.set_retry(retry);
        e
    }

    /// pingora's `fail_to_connect`: the host's outcome, and whether to retry.
    pub(super) fn connect_failed(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        // A failed HBONE tunnel is, to Envoy's router, an internal connection that came up and
        // then closed before any response: a reset, not a connect failure (the tunnel's own
        // cluster counts the failed connect).
        let tunnel = *e.etype() == hbone::TUNNEL_FAILURE;
        if let Some(c) = &ctx.cluster {
            if !tunnel {
                c.stats.cx_connect_fail.fetch_add(1, Relaxed);
            }
            // A local-origin failure counts as a 503 for outlier detection, as in Envoy.
            c.record_outcome(ctx.host_index, 503);
        }
        let failure = if tunnel {
            Failure::Reset
        } else {
            Failure::ConnectFailure
        };
        // Envoy retries only when a retry policy says so.
        let retry = ctx
            .retry
            .clone()
            .is_some_and(|p| p.retries_failure(failure) && self.may_retry(session, ctx, &p));
        e.set_retry(retry);
        e
    }
}
