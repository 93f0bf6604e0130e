//! Load balancers over a cluster's eligible hosts. Each `pick` is lock-free: one atomic or one
//! random draw, plus a read of per-host active-request counters for least-request; the
//! consistent-hash policies (ring hash, Maglev) look a request hash up in a structure built with
//! the balancer.

pub mod hash;
pub mod hash_policy;

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub use hash::HashFunction;
use hash::{HashHost, MaglevTable, Ring};

/// The host set a balancer chooses from: indices into the cluster's hosts with their weights.
#[derive(Debug, Default)]
pub struct Eligible {
    pub hosts: Vec<usize>,
    pub weights: Vec<u32>,
    /// For ring hash and Maglev: each host's share of the whole, already normalized (Envoy
    /// folds locality weights in this way); `None` normalizes `weights`.
    pub shares: Option<Vec<f64>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    LeastRequest,
    Random,
    RingHash {
        min_ring_size: u64,
        max_ring_size: u64,
        function: HashFunction,
    },
    Maglev {
        table_size: u64,
    },
}

impl Policy {
    /// Envoy's defaults for `ring_hash_lb_config` (1024 .. 8M entries, XXH64).
    pub const RING_HASH_DEFAULT: Policy = Policy::RingHash {
        min_ring_size: 1024,
        max_ring_size: 8 * 1024 * 1024,
        function: HashFunction::XxHash,
    };
    /// Envoy's default Maglev table size, a prime.
    pub const MAGLEV_DEFAULT: Policy = Policy::Maglev { table_size: 65537 };

    /// Whether picks use the request hash of the route's `hash_policy`.
    pub fn is_hashing(&self) -> bool {
        matches!(self, Policy::RingHash { .. } | Policy::Maglev { .. })
    }
}

/// `slow_start_config` of round robin and least request: a host's weight ramps up over
/// `window` after it joins (or turns healthy), as
/// `weight * max(min_weight, (elapsed / window) ^ (1 / aggression))`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlowStart {
    pub window: Duration,
    pub aggression: f64,
    /// A fraction (Envoy's `min_weight_percent`, default 10%).
    pub min_weight: f64,
}

impl SlowStart {
    /// The weight factor after `elapsed` in the window (1 once it is over).
    pub fn factor(&self, elapsed: Duration) -> f64 {
        if elapsed >= self.window {
            return 1.0;
        }
        let ms = |d: Duration| d.as_millis() as f64;
        let time = ms(elapsed).max(1.0) / ms(self.window).max(1.0);
        let ramp = if self.aggression == 1.0 || time == 1.0 {
            time
        } else {
            time.powf(1.0 / self.aggression)
        };
        ramp.max(self.min_weight)
    }
}

/// Slow-start state of one balancer: when each eligible host began its ramp.
#[derive(Debug)]
struct Ramp {
    config: SlowStart,
    since: Vec<Option<Instant>>,
    /// After this no host is ramping and picks take the plain path.
    until: Instant,
}

/// The lookup structure of a consistent-hash balancer.
#[derive(Debug)]
enum Hashed {
    None,
    Ring(Ring),
    Maglev(MaglevTable),
}

/// Per-cluster balancer state, built once per endpoint set.
#[derive(Debug)]
pub struct Balancer {
    policy: Policy,
    eligible: Eligible,
    /// Smooth weighted round-robin order, precomputed; empty when weights are all equal.
    schedule: Vec<u32>,
    /// Running sums of weights, for weighted random picks.
    cumulative: Vec<u64>,
    next: AtomicUsize,
    uniform: bool,
    hashed: Hashed,
    /// Least request: hosts sampled per pick (Envoy's `choice_count`, default 2).
    choices: u32,
    /// Least request with unequal weights: `weight / (active + 1) ^ bias`.
    bias: f64,
    ramp: Option<Box<Ramp>>,
}

/// Longest precomputed round-robin schedule; larger weight sums fall back to weighted random.
const MAX_SCHEDULE: u64 = 1 << 16;

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Balancer {
    /// A balancer whose hosts, if it hashes, are placed by their index (tests and benches);
    /// clusters use [`Balancer::with_keys`] to place hosts by address, as Envoy does.
    pub fn new(policy: Policy, eligible: Eligible) -> Balancer {
        Balancer::with_keys(policy, eligible, |i| i.to_string())
    }

    /// `key` names host `i` (an index into the cluster's hosts) for the hash ring or table.
    pub fn with_keys(
        policy: Policy,
        eligible: Eligible,
        key: impl Fn(usize) -> String,
    ) -> Balancer {
        let hashed = match policy {
            Policy::RingHash {
                min_ring_size,
                max_ring_size,
                function,
            } => Hashed::Ring(Ring::build(
                &hash_hosts(&eligible, &key),
                min_ring_size,
                max_ring_size,
                function,
            )),
            Policy::Maglev { table_size } => {
                Hashed::Maglev(MaglevTable::build(&hash_hosts(&eligible, &key), table_size))
            }
            _ => Hashed::None,
        };
        let uniform = eligible.weights.windows(2).all(|w| w[0] == w[1]);
        let mut cumulative = Vec::with_capacity(eligible.weights.len());
        let mut sum = 0u64;
        for w in &eligible.weights {
            sum += u64::from(*w);
            cumulative.push(sum);
        }
        let schedule = if policy == Policy::RoundRobin && !uniform {
            smooth_schedule(&eligible.weights)
        } else {
            Vec::new()
        };
        // A random start keeps many gateways from hitting the same first host together.
        let start = fastrand::usize(..eligible.hosts.len().max(1) * 64);
        Balancer {
            policy,
            eligible,
            schedule,
            cumulative,
            next: AtomicUsize::new(start),
            uniform,
            hashed,
            choices: 2,
            bias: 1.0,
            ramp: None,
        }
    }

    /// Least request's `choice_count` and `active_request_bias`.
    pub fn with_least_request(mut self, choices: u32, bias: f64) -> Balancer {
        self.choices = choices.max(2);
        self.bias = bias;
        self
    }

    /// Slow start for round robin and least request: `since(i)` is when cluster host `i`
    /// began its ramp (`None`: it does not ramp, e.g. it is not healthy).
    pub fn with_slow_start(
        mut self,
        config: Option<SlowStart>,
        since: impl Fn(usize) -> Option<Instant>,
    ) -> Balancer {
        let Some(config) = config else {
            return self;
        };
        if !matches!(self.policy, Policy::RoundRobin | Policy::LeastRequest) {
            return self;
        }
        let since: Vec<Option<Instant>> = self.eligible.hosts.iter().map(|&i| since(i)).collect();
        let Some(until) = since.iter().flatten().max().map(|t| *t + config.window) else {
            return self;
        };
        if until > Instant::now() {
            self.ramp = Some(Box::new(Ramp {
                config,
                since,
                until,
            }));
        }
        self
    }

    /// The host a consistent-hash balancer maps `hash` to; other policies ignore the hash.
    pub fn pick_hash(&self, hash: u64, active: &[AtomicU32]) -> Option<usize> {
        self.pick_hash_attempt(hash, 0, active)
    }

    /// `pick_hash` for Envoy's host-selection retries: `attempt` > 0 after a retry host
    /// predicate refused the host the earlier attempts gave.
    pub fn pick_hash_attempt(
        &self,
        hash: u64,
        attempt: u32,
        active: &[AtomicU32],
    ) -> Option<usize> {
        match &self.hashed {
            Hashed::Ring(r) => r.pick_attempt(hash, attempt),
            Hashed::Maglev(m) => m.pick_attempt(hash, attempt),
            Hashed::None => self.pick(active),
        }
    }

    /// Ring entries or table slots: what a hashing balancer holds (for tests and stats).
    pub fn hash_table_len(&self) -> usize {
        match &self.hashed {
            Hashed::Ring(r) => r.len(),
            Hashed::Maglev(m) => m.len(),
            Hashed::None => 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.eligible.hosts.is_empty()
    }

    /// Picks a host index (into the cluster's host list). `active` gives a host's in-flight count.
    pub fn pick(&self, active: &[AtomicU32]) -> Option<usize> {
        let n = self.eligible.hosts.len();
        if n == 0 {
            return None;
        }
        if n == 1 {
            return Some(self.eligible.hosts[0]);
        }
        if let Some(ramp) = &self.ramp {
            let now = Instant::now();
            if now < ramp.until {
                let slot = self.weighted_pick(active, |slot, w| match ramp.since[slot] {
                    Some(t) => w * ramp.config.factor(now.saturating_duration_since(t)),
                    None => w,
                });
                return Some(self.eligible.hosts[slot]);
            }
        }
        let slot = match self.policy {
            Policy::RoundRobin if self.uniform => self.next.fetch_add(1, Ordering::Relaxed) % n,
            Policy::RoundRobin if !self.schedule.is_empty() => {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % self.schedule.len();
                self.schedule[i] as usize
            }
            Policy::RoundRobin | Policy::Random => self.weighted_random(),
            // Without a request hash Envoy hashes a random number, which keeps the ring's
            // (weighted) distribution.
            Policy::RingHash { .. } | Policy::Maglev { .. } => {
                return self.pick_hash(fastrand::u64(..), active)
            }
            // Envoy: with unequal weights, each host's weight over its active requests plus
            // one (an EDF schedule; drawn at random here, the same shares).
            Policy::LeastRequest if !self.uniform => self.weighted_pick(active, |_, w| w),
            Policy::LeastRequest => {
                // `choice_count` samples (with replacement, as Envoy), the least loaded wins.
                let load = |s: usize| {
                    active
                        .get(self.eligible.hosts[s])
                        .map_or(0, |c| c.load(Ordering::Relaxed))
                };
                let mut best = fastrand::usize(..n);
                for _ in 1..self.choices {
                    let other = fastrand::usize(..n);
                    if load(other) < load(best) {
                        best = other;
                    }
                }
                best
            }
        };
        Some(self.eligible.hosts[slot])
    }

    /// A draw weighted by `weight(slot, configured weight)`, divided by the active requests
    /// plus one for least request.
    fn weighted_pick(&self, active: &[AtomicU32], weight: impl Fn(usize, f64) -> f64) -> usize {
        let effective = |slot: usize| {
            let w = weight(slot, f64::from(self.eligible.weights[slot]));
            if self.policy == Policy::LeastRequest {
                let act = active
                    .get(self.eligible.hosts[slot])
                    .map_or(0, |c| c.load(Ordering::Relaxed));
                let load = f64::from(act) + 1.0;
                if self.bias == 1.0 {
                    w / load
                } else {
                    w / load.powf(self.bias)
                }
            } else {
                w
            }
        };
        let n = self.eligible.hosts.len();
        let total: f64 = (0..n).map(effective).sum();
        if total.is_nan() || total <= 0.0 {
            return fastrand::usize(..n);
        }
        let mut point = fastrand::f64() * total;
        for slot in 0..n {
            point -= effective(slot);
            if point < 0.0 {
                return slot;
            }
        }
        n - 1
    }

    fn weighted_random(&self) -> usize {
        let total = self.cumulative.last().copied().unwrap_or(0);
        if total == 0 {
            return fastrand::usize(..self.eligible.hosts.len());
        }
        let point = fastrand::u64(..total);
        self.cumulative.partition_point(|c| *c <= point)
    }
}

fn hash_hosts(eligible: &Eligible, key: &impl Fn(usize) -> String) -> Vec<HashHost> {
    eligible
        .hosts
        .iter()
        .zip(&eligible.weights)
        .enumerate()
        .map(|(slot, (&index, &weight))| HashHost {
            key: key(index),
            index,
            weight,
            share: eligible.shares.as_ref().and_then(|s| s.get(slot).copied()),
        })
        .collect()
}

/// nginx's smooth weighted round robin, unrolled into a fixed order of slots.
fn smooth_schedule(weights: &[u32]) -> Vec<u32> {
    let g = weights
        .iter()
        .fold(0u64, |acc, w| gcd(acc, u64::from(*w)))
        .max(1);
    let reduced: Vec<i64> = weights.iter().map(|w| (u64::from(*w) / g) as i64).collect();
    let total: i64 = reduced.iter().sum();
    if total as u64 > MAX_SCHEDULE || total <= 0 {
        return Vec::new();
    }
    let mut current = vec![0i64; reduced.len()];
    let mut out = Vec::with_capacity(total as usize);
    for _ in 0..total {
        let mut best = 0;
        for i in 0..reduced.len() {
            current[i] += reduced[i];
            if current[i] > current[best] {
                best = i;
            }
        }
        current[best] -= total;
        out.push(best as u32);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(b: &Balancer, n: usize, draws: usize) -> Vec<usize> {
        let active: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
        let mut c = vec![0; n];
        for _ in 0..draws {
            c[b.pick(&active).expect("non-empty")] += 1;
        }
        c
    }

    fn eligible(weights: &[u32]) -> Eligible {
        Eligible {
            hosts: (0..weights.len()).collect(),
            weights: weights.to_vec(),
            shares: None,
        }
    }

    #[test]
    fn round_robin_uniform_is_exact() {
        let b = Balancer::new(Policy::RoundRobin, eligible(&[1, 1, 1]));
        assert_eq!(counts(&b, 3, 300), vec![100, 100, 100]);
    }

    #[test]
    fn weighted_round_robin_follows_weights_exactly_per_cycle() {
        let b = Balancer::new(Policy::RoundRobin, eligible(&[5, 1, 2]));
        assert_eq!(counts(&b, 3, 800), vec![500, 100, 200]);
    }

    #[test]
    fn smooth_schedule_interleaves() {
        // 3:1 must not send three in a row to the heavy host twice in a cycle of 4.
        assert_eq!(smooth_schedule(&[3, 1]), vec![0, 0, 1, 0]);
    }

    /// Property: for random weight vectors, random and weighted picks converge to the weights.
    #[test]
    fn weighted_selection_converges_to_weights() {
        for seed in 0..20u64 {
            fastrand::seed(seed);
            let n = fastrand::usize(2..6);
            let weights: Vec<u32> = (0..n).map(|_| fastrand::u32(1..20)).collect();
            let total: u32 = weights.iter().sum();
            for policy in [Policy::Random, Policy::RoundRobin] {
                let b = Balancer::new(policy, eligible(&weights));
                let draws = 40_000;
                let c = counts(&b, n, draws);
                for i in 0..n {
                    let want = f64::from(weights[i]) / f64::from(total);
                    let got = c[i] as f64 / draws as f64;
                    assert!(
                        (want - got).abs() < 0.02,
                        "{policy:?} weights {weights:?}: host {i} got {got:.3}, want {want:.3}"
                    );
                }
            }
        }
    }

    #[test]
    fn least_request_avoids_busy_host() {
        let b = Balancer::new(Policy::LeastRequest, eligible(&[1, 1]));
        let active = [AtomicU32::new(100), AtomicU32::new(0)];
        // Two samples with replacement, as Envoy: the idle host wins unless both samples
        // are the busy one (1 in 4).
        let idle = (0..4000).filter(|_| b.pick(&active) == Some(1)).count();
        assert!((2800..3200).contains(&idle), "{idle} of 4000");
        let b = Balancer::new(Policy::LeastRequest, eligible(&[1, 1])).with_least_request(10, 1.0);
        let idle = (0..4000).filter(|_| b.pick(&active) == Some(1)).count();
        assert!(idle > 3950, "{idle} of 4000");
    }

    #[test]
    fn weighted_least_request_follows_weight_over_active_requests() {
        // Envoy's EDF for unequal weights: weight / (active + 1). Idle: 1 : 3.
        let b = Balancer::new(Policy::LeastRequest, eligible(&[1, 3]));
        let idle = [AtomicU32::new(0), AtomicU32::new(0)];
        let heavy = (0..8000).filter(|_| b.pick(&idle) == Some(1)).count();
        assert!((5700..6300).contains(&heavy), "{heavy} of 8000");
        // The heavy host with 5 in flight: 1 : 3 / 6, so the light one takes two thirds.
        let busy = [AtomicU32::new(0), AtomicU32::new(5)];
        let light = (0..6000).filter(|_| b.pick(&busy) == Some(0)).count();
        assert!((3700..4300).contains(&light), "{light} of 6000");
    }

    #[test]
    fn slow_start_factor_follows_envoys_formula() {
        let s = SlowStart {
            window: Duration::from_secs(10),
            aggression: 1.0,
            min_weight: 0.1,
        };
        assert_eq!(s.factor(Duration::from_secs(5)), 0.5);
        assert_eq!(s.factor(Duration::ZERO), 0.1);
        assert_eq!(s.factor(Duration::from_secs(10)), 1.0);
        let s = SlowStart {
            aggression: 2.0,
            ..s
        };
        assert!((s.factor(Duration::from_millis(2500)) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn a_ramping_host_gets_its_share_of_the_weight() {
        let s = SlowStart {
            window: Duration::from_secs(100),
            aggression: 1.0,
            min_weight: 0.1,
        };
        let now = Instant::now();
        // Host 1 joined 25 s ago: weight 0.25 against host 0's full 1 (out of its window).
        for policy in [Policy::RoundRobin, Policy::LeastRequest] {
            let b = Balancer::new(policy, eligible(&[1, 1])).with_slow_start(Some(s), |i| {
                Some(if i == 0 {
                    now - Duration::from_secs(200)
                } else {
                    now - Duration::from_secs(25)
                })
            });
            let c = counts(&b, 2, 10_000);
            assert!((1800..2200).contains(&c[1]), "{policy:?}: {c:?}");
        }
        // Nobody in the window: the plain (exact) round robin.
        let b = Balancer::new(Policy::RoundRobin, eligible(&[1, 1]))
            .with_slow_start(Some(s), |_| Some(now - Duration::from_secs(500)));
        assert_eq!(counts(&b, 2, 100), vec![50, 50]);
    }

    #[test]
    fn empty_set_picks_nothing() {
        let b = Balancer::new(Policy::RoundRobin, eligible(&[]));
        assert!(b.is_empty());
        assert_eq!(b.pick(&[]), None);
    }
}
