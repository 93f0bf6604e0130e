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

#[cfg(test)]
mod tests {
    use super::*;

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
