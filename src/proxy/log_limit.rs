//! What a client can make the gateway log: nothing above debug for its own doing, and
//! warnings and errors about upstreams at a bounded rate.
//!
//! A client that hangs up before its response is counted (`downstream_rq_rx_reset`, as
//! Envoy) and logged at debug: 500 slow clients are a counter of 500, not 500 ERROR lines.
//! Upstream failures are the operator's business and stay at warning/error, but at most
//! [`BURST`] lines a second; what is held back is counted and said with the next line let
//! through.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{SystemTime, UNIX_EPOCH};

/// Lines let through per second.
pub const BURST: u64 = 10;

/// A per-second budget of log lines, lock-free: one word holds the second and the count.
#[derive(Debug, Default)]
pub struct Limiter {
    /// `second << 16 | lines this second` (the count saturates below 2^16).
    window: AtomicU64,
    suppressed: AtomicU64,
}

/// The limiter's answer for one line.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; this many lines like it were held back since the last one let through.
    Log {
        suppressed: u64,
    },
    Suppress,
}

impl Limiter {
    pub const fn new() -> Limiter {
        Limiter {
            window: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    pub fn check(&self) -> Verdict {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.check_at(now)
    }

    /// [`check`](Self::check) at second `now` (tests).
    pub fn check_at(&self, now: u64) -> Verdict {
        let mut cur = self.window.load(Relaxed);
        loop {
            let (second, count) = (cur >> 16, cur & 0xffff);
            let next = if second == now & 0xffff_ffff_ffff {
                if count >= BURST {
                    self.suppressed.fetch_add(1, Relaxed);
                    return Verdict::Suppress;
                }
                cur + 1
            } else {
                ((now & 0xffff_ffff_ffff) << 16) | 1
            };
            match self
                .window
                .compare_exchange_weak(cur, next, Relaxed, Relaxed)
            {
                Ok(_) => {
                    return Verdict::Log {
                        suppressed: self.suppressed.swap(0, Relaxed),
                    }
                }
                Err(seen) => cur = seen,
            }
        }
    }
}

/// The budget of the proxy's upstream warnings and errors.
pub static PROXY: Limiter = Limiter::new();

/// The budget of pingora's own warnings and errors (those it logs without asking us first).
pub static PINGORA: Limiter = Limiter::new();

/// A subscriber layer for what pingora logs on its own, outside the hooks that ask
/// [`quiet`](super::quiet) first: above all `Fail to proxy: Downstream ...` at ERROR for every
/// client that closes or stalls mid-head. A client's doing is dropped (its answer, if any,
/// is counted in the stats); pingora's other warnings and errors go through their own
/// per-second budget. Everything else passes untouched.
#[derive(Debug, Default, Clone, Copy)]
pub struct PingoraLogs;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for PingoraLogs {
    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        let meta = event.metadata();
        if *meta.level() > tracing::Level::WARN {
            return true;
        }
        let mut seen = Seen::default();
        event.record(&mut seen);
        let target = seen.log_target.as_deref().unwrap_or(meta.target());
        if !target.starts_with("pingora") {
            return true;
        }
        if client_doing(&seen.message) {
            return false;
        }
        matches!(PINGORA.check(), Verdict::Log { .. })
    }
}

/// pingora names an error's side first: `Downstream ...` is the client's.
fn client_doing(message: &str) -> bool {
    let m = message.strip_prefix("Fail to proxy: ").unwrap_or(message);
    m.starts_with("Downstream ")
}

/// The fields the layer reads: the message, and the `log` crate's target (pingora logs
/// through `log`, whose records arrive with target `log` and the real one as a field).
#[derive(Default)]
struct Seen {
    message: String,
    log_target: Option<String>,
}

impl tracing::field::Visit for Seen {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "message" => self.message = value.to_string(),
            "log.target" => self.log_target = Some(value.to_string()),
            _ => {}
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_stalling_or_closing_mid_head_is_its_own_doing() {
        assert!(client_doing(
            "Fail to proxy: Downstream ConnectionClosed context: while reading request headers"
        ));
        assert!(client_doing(
            "Downstream ReadError cause: request timed out"
        ));
        assert!(!client_doing("Fail to proxy: Upstream ConnectRefused"));
        assert!(!client_doing(
            "failed to send error response to downstream: x"
        ));
    }

    #[test]
    fn pingoras_lines_about_clients_are_dropped_and_the_rest_rate_limited() {
        use tracing_subscriber::layer::SubscriberExt;
        #[derive(Clone, Default)]
        struct Count(std::sync::Arc<std::sync::atomic::AtomicU64>);
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Count {
            fn on_event(
                &self,
                _: &tracing::Event<'_>,
                _: tracing_subscriber::layer::Context<'_, S>,
            ) {
                self.0.fetch_add(1, Relaxed);
            }
        }
        let seen = Count::default();
        let subscriber = tracing_subscriber::registry()
            .with(PingoraLogs)
            .with(seen.clone());
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..100 {
                tracing::error!(target: "pingora_proxy", "Fail to proxy: Downstream ConnectionClosed");
            }
            assert_eq!(seen.0.load(Relaxed), 0);
            for _ in 0..100 {
                tracing::error!(target: "pingora_proxy", "Fail to proxy: Upstream ConnectRefused");
            }
            // At most two seconds' budgets if the clock turned during the loop.
            let n = seen.0.load(Relaxed);
            assert!((BURST..=2 * BURST).contains(&n), "{n}");
            for _ in 0..100 {
                tracing::error!(target: "portico::proxy", "ours are not limited here");
            }
            assert_eq!(seen.0.load(Relaxed), n + 100);
        });
    }

    #[test]
    fn a_burst_a_second_then_the_count_of_what_was_held_back() {
        let l = Limiter::new();
        for _ in 0..BURST {
            assert_eq!(l.check_at(100), Verdict::Log { suppressed: 0 });
        }
        for _ in 0..7 {
            assert_eq!(l.check_at(100), Verdict::Suppress);
        }
        assert_eq!(l.check_at(101), Verdict::Log { suppressed: 7 });
        assert_eq!(l.check_at(101), Verdict::Log { suppressed: 0 });
    }
}
