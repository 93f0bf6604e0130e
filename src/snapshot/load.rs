//! How a cluster spreads requests over its hosts, with Envoy's integer arithmetic so that the
//! same endpoints take the same shares: each priority level's availability is its healthy
//! share times the overprovisioning factor (whole percents, capped at 100); levels take load
//! in priority order in proportion to their availability over the normalized total; degraded
//! hosts take what healthy ones cannot; a level under the panic threshold balances over all
//! its hosts (never while the normalized total is 100), and with every level in panic the load
//! follows host counts. With `locality_weighted_lb_config` a locality is chosen first, by its
//! weight times its availability, then a host within it.
//!
//! The result is a plan built once per endpoint set: the request path draws one number and
//! walks a handful of buckets.

use std::sync::atomic::AtomicU32;

use super::cluster::{Health, Host};
use crate::lb::{Balancer, Eligible, Policy};

/// `ClusterLoadAssignment.policy`, as far as it shapes the load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadPolicy {
    /// In percent (Envoy's default 140: a level at 72% health still takes all its load).
    pub overprovisioning: u32,
    /// Level health by host weight instead of host count.
    pub weighted_priority_health: bool,
}

impl Default for LoadPolicy {
    fn default() -> Self {
        LoadPolicy {
            overprovisioning: 140,
            weighted_priority_health: false,
        }
    }
}

/// The hosts one bucket balances over.
#[derive(Debug)]
pub enum Pool {
    Hosts(Balancer),
    /// A locality first (a weighted round robin over `each`), then a host in it.
    Localities {
        chooser: Balancer,
        each: Vec<Balancer>,
    },
}

impl Pool {
    pub fn pick(&self, active: &[AtomicU32]) -> Option<usize> {
        match self {
            Pool::Hosts(b) => b.pick(active),
            Pool::Localities { chooser, each } => each.get(chooser.pick(&[])?)?.pick(active),
        }
    }

    pub fn pick_hash(&self, hash: u64, attempt: u32, active: &[AtomicU32]) -> Option<usize> {
        match self {
            Pool::Hosts(b) => b.pick_hash_attempt(hash, attempt, active),
            Pool::Localities { .. } => self.pick(active),
        }
    }

    /// Ring entries or table slots (tests and stats).
    pub fn hash_table_len(&self) -> usize {
        match self {
            Pool::Hosts(b) => b.hash_table_len(),
            Pool::Localities { each, .. } => each.iter().map(Balancer::hash_table_len).sum(),
        }
    }
}

/// A share of the requests, in whole percents, and the pool that serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    pub load: u32,
    pub pool: usize,
    /// The level is in panic: the pool is all of its hosts (`lb_healthy_panic`).
    pub panic: bool,
}

#[derive(Debug, Default)]
pub struct Plan {
    /// Healthy shares in priority order, then degraded ones; the loads add up to 100.
    pub buckets: Vec<Bucket>,
    pub pools: Vec<Pool>,
}

impl Plan {
    /// The bucket a point in `0..100` falls in (Envoy: `hash % 100 + 1` against the running
    /// sum of the loads).
    pub fn bucket(&self, point: u32) -> Option<(&Pool, bool)> {
        let mut sum = 0;
        let chosen = self
            .buckets
            .iter()
            .find(|b| {
                sum += b.load;
                point < sum
            })
            .or(self.buckets.last())?;
        Some((self.pools.get(chosen.pool)?, chosen.panic))
    }
}

/// What the plan is built from.
pub struct Inputs<'a> {
    pub hosts: &'a [Host],
    /// `load_balancing_weight` of each locality, by `Host::locality`.
    pub locality_weights: &'a [Option<u32>],
    pub policy: LoadPolicy,
    /// `healthy_panic_threshold`, rounded to a whole percent as Envoy does.
    pub panic_threshold: u32,
    pub locality_weighted: bool,
    pub lb: Policy,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    All,
    Healthy,
    Degraded,
}

struct Level {
    all: Vec<usize>,
    healthy: Vec<usize>,
    degraded: Vec<usize>,
}

impl Level {
    fn hosts(&self, source: Source) -> &[usize] {
        match source {
            Source::All => &self.all,
            Source::Healthy => &self.healthy,
            Source::Degraded => &self.degraded,
        }
    }
}

/// The load plan of a host set; `make` builds the cluster's balancer over a set of hosts.
pub fn plan(inp: &Inputs, make: &dyn Fn(Eligible) -> Balancer) -> Plan {
    let hosts = inp.hosts;
    let mut priorities: Vec<u32> = hosts.iter().map(|h| h.priority).collect();
    priorities.sort_unstable();
    priorities.dedup();
    let levels: Vec<Level> = priorities
        .iter()
        .map(|&p| {
            let of = |keep: &dyn Fn(&Host) -> bool| -> Vec<usize> {
                (0..hosts.len())
                    .filter(|&i| hosts[i].priority == p && keep(&hosts[i]))
                    .collect()
            };
            Level {
                all: of(&|_| true),
                healthy: of(&|h| h.health == Health::Healthy),
                degraded: of(&|h| h.health == Health::Degraded),
            }
        })
        .collect();
    if levels.is_empty() {
        return Plan::default();
    }
    let weight = |idx: &[usize]| -> u64 {
        if inp.policy.weighted_priority_health {
            idx.iter().map(|&i| u64::from(hosts[i].weight)).sum()
        } else {
            idx.len() as u64
        }
    };
    let factor = u64::from(inp.policy.overprovisioning);
    let availability = |l: &Level, part: &[usize]| -> u32 {
        match weight(&l.all) {
            0 => 0,
            total => (factor * weight(part) / total).min(100) as u32,
        }
    };
    let health: Vec<u32> = levels.iter().map(|l| availability(l, &l.healthy)).collect();
    let degraded: Vec<u32> = levels
        .iter()
        .map(|l| availability(l, &l.degraded))
        .collect();
    let normalized = health
        .iter()
        .zip(&degraded)
        .map(|(h, d)| h + d)
        .sum::<u32>()
        .min(100);
    let threshold = inp.panic_threshold.min(100);
    if threshold == 0 && normalized == 0 {
        // Envoy gives P0 all the load and finds no healthy host there.
        return Plan::default();
    }
    let n = levels.len();
    let mut healthy_load = vec![0u32; n];
    let mut degraded_load = vec![0u32; n];
    if normalized > 0 {
        let distribute = |out: &mut [u32], avail: &[u32], mut total: u32| {
            let mut first = None;
            for i in 0..n {
                if first.is_none() && avail[i] > 0 {
                    first = Some(i);
                }
                out[i] = total.min(avail[i] * 100 / normalized);
                total -= out[i];
            }
            (first, total)
        };
        let (first_healthy, left) = distribute(&mut healthy_load, &health, 100);
        let (first_degraded, left) = distribute(&mut degraded_load, &degraded, left);
        // Rounding leftovers go to the first level with any availability.
        match (first_healthy, first_degraded) {
            (Some(i), _) => healthy_load[i] += left,
            (None, Some(i)) => degraded_load[i] += left,
            (None, None) => {}
        }
    }
    let panic: Vec<bool> = levels
        .iter()
        .map(|l| {
            let count = l.all.len() as f64;
            let pct = |part: &[usize]| {
                if count == 0.0 {
                    0.0
                } else {
                    100.0 * part.len() as f64 / count
                }
            };
            normalized != 100 && pct(&l.healthy) + pct(&l.degraded) < f64::from(threshold)
        })
        .collect();
    if panic.iter().all(|p| *p) {
        // Total panic: load by host count, whatever their health.
        let total: usize = levels.iter().map(|l| l.all.len()).sum();
        let mut left = 100u32;
        for (i, l) in levels.iter().enumerate() {
            healthy_load[i] = (100 * l.all.len() / total.max(1)) as u32;
            degraded_load[i] = 0;
            left -= healthy_load[i];
        }
        if let Some(first) = levels.iter().position(|l| !l.all.is_empty()) {
            healthy_load[first] += left;
        }
    }
    let hashing = inp.lb.is_hashing();
    let mut plan = Plan::default();
    let mut built: Vec<(usize, Source, usize)> = Vec::new();
    for (loads, wanted) in [
        (&healthy_load, Source::Healthy),
        (&degraded_load, Source::Degraded),
    ] {
        for (i, &load) in loads.iter().enumerate() {
            if load == 0 {
                continue;
            }
            // Hashing balancers keep one structure per level, over its healthy hosts (all of
            // them in panic), whichever availability chose the level.
            let source = match (panic[i], hashing) {
                (true, _) => Source::All,
                (false, true) => Source::Healthy,
                (false, false) => wanted,
            };
            let pool = match built.iter().find(|(l, s, _)| *l == i && *s == source) {
                Some((_, _, p)) => *p,
                None => {
                    let p = if hashing && inp.locality_weighted {
                        Pool::Hosts(make(locality_shares(inp, &levels[i], source)))
                    } else {
                        let locality = inp.locality_weighted && source != Source::All;
                        pool(inp, &levels[i], source, locality, make)
                    };
                    plan.pools.push(p);
                    built.push((i, source, plan.pools.len() - 1));
                    plan.pools.len() - 1
                }
            };
            plan.buckets.push(Bucket {
                load,
                pool,
                panic: panic[i],
            });
        }
    }
    plan
}

fn eligible(hosts: &[Host], idx: &[usize]) -> Eligible {
    Eligible {
        hosts: idx.to_vec(),
        weights: idx.iter().map(|&i| hosts[i].weight).collect(),
        shares: None,
    }
}

/// A hashing balancer's hosts when localities are weighted, as Envoy normalizes them: each
/// host's share is its weight over its locality's, times its locality's weight over the sum of
/// every locality's weight at this level (localities with no eligible host still count, so the
/// shares can add up to less than one). Hosts of a locality without weight are left out.
fn locality_shares(inp: &Inputs, level: &Level, source: Source) -> Eligible {
    let hosts = inp.hosts;
    let weight_of = |loc: u32| {
        inp.locality_weights
            .get(loc as usize)
            .copied()
            .flatten()
            .unwrap_or(0)
    };
    let mut localities: Vec<u32> = level.all.iter().map(|&i| hosts[i].locality).collect();
    localities.sort_unstable();
    localities.dedup();
    let total: u64 = localities.iter().map(|&l| u64::from(weight_of(l))).sum();
    let mut out = Eligible::default();
    let mut shares = Vec::new();
    for loc in localities {
        let w = weight_of(loc);
        if w == 0 || total == 0 {
            continue;
        }
        let members: Vec<usize> = level
            .hosts(source)
            .iter()
            .copied()
            .filter(|&i| hosts[i].locality == loc)
            .collect();
        let sum: u64 = members.iter().map(|&i| u64::from(hosts[i].weight)).sum();
        let locality_share = f64::from(w) / total as f64;
        for i in members {
            out.hosts.push(i);
            out.weights.push(hosts[i].weight);
            shares.push(f64::from(hosts[i].weight) / sum.max(1) as f64 * locality_share);
        }
    }
    out.shares = Some(shares);
    out
}

fn pool(
    inp: &Inputs,
    level: &Level,
    source: Source,
    by_locality: bool,
    make: &dyn Fn(Eligible) -> Balancer,
) -> Pool {
    let hosts = inp.hosts;
    let members = level.hosts(source);
    if !by_locality {
        return Pool::Hosts(make(eligible(hosts, members)));
    }
    // Localities in the order they were listed; the weight is the locality's times its
    // availability (eligible over all of its hosts at this level, times the overprovisioning
    // factor, at most 1).
    let mut localities: Vec<u32> = level.all.iter().map(|&i| hosts[i].locality).collect();
    localities.sort_unstable();
    localities.dedup();
    let mut weights = Vec::new();
    let mut each = Vec::new();
    for loc in localities {
        let in_loc: Vec<usize> = members
            .iter()
            .copied()
            .filter(|&i| hosts[i].locality == loc)
            .collect();
        let total = level
            .all
            .iter()
            .filter(|&&i| hosts[i].locality == loc)
            .count();
        let Some(Some(w)) = inp.locality_weights.get(loc as usize) else {
            continue;
        };
        if in_loc.is_empty() || total == 0 || *w == 0 {
            continue;
        }
        let ratio = (f64::from(inp.policy.overprovisioning) / 100.0 * in_loc.len() as f64
            / total as f64)
            .min(1.0);
        // Hundredths keep the availability's precision in an integer weight.
        let effective = (f64::from(*w) * ratio * 100.0)
            .round()
            .min(f64::from(u32::MAX)) as u32;
        weights.push(effective.max(1));
        each.push(make(eligible(hosts, &in_loc)));
    }
    if each.is_empty() {
        // No locality can take traffic: Envoy falls back to the level's hosts.
        return Pool::Hosts(make(eligible(hosts, members)));
    }
    let chooser = Balancer::new(
        Policy::RoundRobin,
        Eligible {
            hosts: (0..each.len()).collect(),
            weights,
            shares: None,
        },
    );
    Pool::Localities { chooser, each }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn host(port: u16, health: Health, priority: u32) -> Host {
        Host {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            weight: 1,
            health,
            priority,
            locality: 0,
            hostname: None,
            labels: None,
            internal: None,
            workload: None,
        }
    }

    fn build(hosts: &[Host], threshold: u32) -> Plan {
        plan(
            &Inputs {
                hosts,
                locality_weights: &[],
                policy: LoadPolicy::default(),
                panic_threshold: threshold,
                locality_weighted: false,
                lb: Policy::RoundRobin,
            },
            &|e| Balancer::new(Policy::RoundRobin, e),
        )
    }

    /// (load, hosts the bucket's pool balances over, panic) per bucket.
    fn shape(plan: &Plan, hosts: usize) -> Vec<(u32, Vec<usize>, bool)> {
        let active: Vec<AtomicU32> = (0..hosts).map(|_| AtomicU32::new(0)).collect();
        plan.buckets
            .iter()
            .map(|b| {
                let mut seen: Vec<usize> = (0..200)
                    .filter_map(|_| plan.pools[b.pool].pick(&active))
                    .collect();
                seen.sort_unstable();
                seen.dedup();
                (b.load, seen, b.panic)
            })
            .collect()
    }

    use Health::{Degraded as D, Healthy as H, Unhealthy as U};

    #[test]
    fn unhealthy_hosts_are_skipped_above_the_panic_threshold() {
        let hosts = [host(1, H, 0), host(2, H, 0), host(3, U, 0)];
        assert_eq!(shape(&build(&hosts, 50), 3), vec![(100, vec![0, 1], false)]);
    }

    #[test]
    fn a_level_under_the_threshold_balances_over_all_its_hosts() {
        let hosts = [host(1, H, 0), host(2, U, 0), host(3, U, 0)];
        assert_eq!(
            shape(&build(&hosts, 50), 3),
            vec![(100, vec![0, 1, 2], true)]
        );
        // Panic off: only the healthy host.
        assert_eq!(shape(&build(&hosts, 0), 3), vec![(100, vec![0], false)]);
    }

    #[test]
    fn no_availability_and_no_panic_means_no_host() {
        let hosts = [host(1, U, 0), host(2, U, 1)];
        assert!(build(&hosts, 0).buckets.is_empty());
    }

    #[test]
    fn total_panic_spreads_by_host_count() {
        // Envoy: every level in panic, so load follows host counts (2 of 3 hosts on P0).
        let hosts = [host(1, U, 0), host(2, U, 0), host(3, U, 1)];
        assert_eq!(
            shape(&build(&hosts, 50), 3),
            vec![(67, vec![0, 1], true), (33, vec![2], true)]
        );
    }

    #[test]
    fn no_panic_while_the_normalized_total_is_100() {
        // P0 at 1/3 health is under 50%, but P1 makes the total 100%: P0 keeps its healthy
        // host for its 46% (140 * 1 / 3, whole percents) and P1 takes the rest.
        let hosts = [host(1, H, 0), host(2, U, 0), host(3, U, 0), host(4, H, 1)];
        assert_eq!(
            shape(&build(&hosts, 50), 4),
            vec![(46, vec![0], false), (54, vec![3], false)]
        );
    }

    #[test]
    fn lower_priority_takes_what_p0_cannot() {
        let hosts = [host(1, H, 0), host(2, U, 0), host(3, H, 1)];
        assert_eq!(
            shape(&build(&hosts, 0), 3),
            vec![(70, vec![0], false), (30, vec![2], false)]
        );
    }

    #[test]
    fn degraded_hosts_take_what_healthy_ones_cannot() {
        let hosts = [host(1, H, 0), host(2, D, 0)];
        assert_eq!(
            shape(&build(&hosts, 50), 2),
            vec![(70, vec![0], false), (30, vec![1], false)]
        );
        let mostly = [host(1, H, 0), host(2, H, 0), host(3, H, 0), host(4, D, 0)];
        assert_eq!(
            shape(&build(&mostly, 50), 4),
            vec![(100, vec![0, 1, 2], false)]
        );
    }

    #[test]
    fn rounding_leftovers_go_to_the_first_available_level() {
        // Three levels at 46% each (1 of 3 healthy): normalized 100, loads 46 / 46 / 8.
        let mut hosts = Vec::new();
        for p in 0..3u32 {
            for k in 0..3u16 {
                let health = if k == 0 { H } else { U };
                hosts.push(host(10 * p as u16 + k, health, p));
            }
        }
        let loads: Vec<u32> = build(&hosts, 50).buckets.iter().map(|b| b.load).collect();
        assert_eq!(loads, vec![46, 46, 8]);
        // Two levels at 10% (1 of 14): normalized 20, 50 / 50.
        let mut hosts = Vec::new();
        for p in 0..2u32 {
            for k in 0..14u16 {
                hosts.push(host(100 * p as u16 + k, if k == 0 { H } else { U }, p));
            }
        }
        let plan = build(&hosts, 0);
        let loads: Vec<u32> = plan.buckets.iter().map(|b| b.load).collect();
        assert_eq!(loads, vec![50, 50]);
    }

    #[test]
    fn weighted_priority_health_counts_weights() {
        let mut hosts = vec![host(1, H, 0), host(2, U, 0), host(3, H, 1)];
        hosts[0].weight = 3;
        let p = plan(
            &Inputs {
                hosts: &hosts,
                locality_weights: &[],
                policy: LoadPolicy {
                    overprovisioning: 100,
                    weighted_priority_health: true,
                },
                panic_threshold: 0,
                locality_weighted: false,
                lb: Policy::RoundRobin,
            },
            &|e| Balancer::new(Policy::RoundRobin, e),
        );
        // 100 * 3 / 4 = 75 on P0.
        let loads: Vec<u32> = p.buckets.iter().map(|b| b.load).collect();
        assert_eq!(loads, vec![75, 25]);
    }

    #[test]
    fn localities_take_traffic_by_weight_times_availability() {
        // Locality 0 (weight 1): 2 healthy hosts; locality 1 (weight 3): 1 healthy of 2, so
        // availability min(1, 1.4 * 0.5) = 0.7: effective 1 : 2.1.
        let mut hosts = vec![host(1, H, 0), host(2, H, 0), host(3, H, 0), host(4, U, 0)];
        hosts[2].locality = 1;
        hosts[3].locality = 1;
        let p = plan(
            &Inputs {
                hosts: &hosts,
                locality_weights: &[Some(1), Some(3)],
                policy: LoadPolicy::default(),
                panic_threshold: 0,
                locality_weighted: true,
                lb: Policy::RoundRobin,
            },
            &|e| Balancer::new(Policy::RoundRobin, e),
        );
        let active: Vec<AtomicU32> = (0..4).map(|_| AtomicU32::new(0)).collect();
        let mut counts = [0usize; 4];
        for _ in 0..3100 {
            let (pool, _) = p.bucket(0).expect("bucket");
            counts[pool.pick(&active).expect("host")] += 1;
        }
        assert_eq!(counts, [500, 500, 2100, 0]);
    }

    #[test]
    fn a_locality_without_weight_gets_nothing() {
        let mut hosts = vec![host(1, H, 0), host(2, H, 0)];
        hosts[1].locality = 1;
        let p = plan(
            &Inputs {
                hosts: &hosts,
                locality_weights: &[Some(5), None],
                policy: LoadPolicy::default(),
                panic_threshold: 50,
                locality_weighted: true,
                lb: Policy::RoundRobin,
            },
            &|e| Balancer::new(Policy::RoundRobin, e),
        );
        assert_eq!(shape(&p, 2), vec![(100, vec![0], false)]);
    }

    #[test]
    fn hashing_with_locality_weights_scales_each_locality() {
        // Locality 0 (weight 1) has one host, locality 1 (weight 3) two: shares 1/4 and 3/8
        // each, so the ring gives locality 1 three quarters of the keys.
        let mut hosts = vec![host(1, H, 0), host(2, H, 0), host(3, H, 0)];
        hosts[1].locality = 1;
        hosts[2].locality = 1;
        let p = plan(
            &Inputs {
                hosts: &hosts,
                locality_weights: &[Some(1), Some(3)],
                policy: LoadPolicy::default(),
                panic_threshold: 50,
                locality_weighted: true,
                lb: Policy::MAGLEV_DEFAULT,
            },
            &|e| {
                assert_eq!(e.shares, Some(vec![0.25, 0.375, 0.375]));
                Balancer::new(Policy::MAGLEV_DEFAULT, e)
            },
        );
        let active: Vec<AtomicU32> = (0..3).map(|_| AtomicU32::new(0)).collect();
        let first = (0..20_000u64)
            .filter(|k| {
                let h = crate::lb::hash::xx64(&k.to_le_bytes(), 0);
                p.pools[0].pick_hash(h, 0, &active) == Some(0)
            })
            .count();
        assert!((4600..5400).contains(&first), "{first} of 20000");
    }

    #[test]
    fn hashing_levels_use_their_healthy_hosts_for_both_loads() {
        let hosts = [host(1, H, 0), host(2, D, 0)];
        let p = plan(
            &Inputs {
                hosts: &hosts,
                locality_weights: &[],
                policy: LoadPolicy::default(),
                panic_threshold: 50,
                locality_weighted: false,
                lb: Policy::MAGLEV_DEFAULT,
            },
            &|e| Balancer::new(Policy::MAGLEV_DEFAULT, e),
        );
        assert_eq!(p.pools.len(), 1);
        assert_eq!(
            p.buckets,
            vec![
                Bucket {
                    load: 70,
                    pool: 0,
                    panic: false
                },
                Bucket {
                    load: 30,
                    pool: 0,
                    panic: false
                }
            ]
        );
    }
}
