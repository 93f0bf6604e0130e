//! Load balancers over a cluster's eligible hosts. Each `pick` is lock-free: one atomic or one
//! random draw, plus a read of per-host active-request counters for least-request.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

/// The host set a balancer chooses from: indices into the cluster's hosts with their weights.
#[derive(Debug)]
pub struct Eligible {
    pub hosts: Vec<usize>,
    pub weights: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    LeastRequest,
    Random,
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
    pub fn new(policy: Policy, eligible: Eligible) -> Balancer {
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
        let slot = match self.policy {
            Policy::RoundRobin if self.uniform => self.next.fetch_add(1, Ordering::Relaxed) % n,
            Policy::RoundRobin if !self.schedule.is_empty() => {
                let i = self.next.fetch_add(1, Ordering::Relaxed) % self.schedule.len();
                self.schedule[i] as usize
            }
            Policy::RoundRobin | Policy::Random => self.weighted_random(),
            Policy::LeastRequest => {
                // Power of two choices; with weights, compare load per unit of weight.
                let a = fastrand::usize(..n);
                let mut b = fastrand::usize(..n - 1);
                if b >= a {
                    b += 1;
                }
                let load = |s: usize| {
                    let act = active
                        .get(self.eligible.hosts[s])
                        .map_or(0, |c| c.load(Ordering::Relaxed));
                    (u64::from(act) + 1) * 1_000_000 / u64::from(self.eligible.weights[s].max(1))
                };
                if load(b) < load(a) {
                    b
                } else {
                    a
                }
            }
        };
        Some(self.eligible.hosts[slot])
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
        for _ in 0..100 {
            assert_eq!(b.pick(&active), Some(1));
        }
    }

    #[test]
    fn empty_set_picks_nothing() {
        let b = Balancer::new(Policy::RoundRobin, eligible(&[]));
        assert!(b.is_empty());
        assert_eq!(b.pick(&[]), None);
    }
}
