//! Endpoint pick per LB policy, 10 hosts, equal and unequal weights: `cargo bench --bench lb_pick`.
//! Ring hash and Maglev picks take a request hash (a header value hashed per iteration, as the
//! request path does); `lb_build` is what an endpoint change costs them at snapshot build time.

use std::hint::black_box;
use std::sync::atomic::AtomicU32;

use criterion::{criterion_group, criterion_main, Criterion};
use portico::lb::hash::xx64;
use portico::lb::{Balancer, Eligible, Policy};

const HOSTS: usize = 10;

fn eligible(weights: &[u32]) -> Eligible {
    Eligible {
        hosts: (0..weights.len()).collect(),
        weights: weights.to_vec(),
        shares: None,
    }
}

/// Hosts keyed by address, as clusters place them.
fn addr_key(i: usize) -> String {
    format!("10.0.{}.{}:8080", i / 256, i % 256)
}

fn lb_pick(c: &mut Criterion) {
    // Some hosts busier than others, so least-request compares real loads.
    let active: Vec<AtomicU32> = (0..HOSTS).map(|i| AtomicU32::new((i % 4) as u32)).collect();
    let equal = [1u32; HOSTS];
    let unequal: [u32; HOSTS] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
    // Distinct session keys, cycled through so lookups do not all hit one cache line.
    let keys: Vec<String> = (0..1024).map(|i| format!("session-{i}")).collect();
    for (label, weights) in [("equal", &equal), ("weighted", &unequal)] {
        let mut group = c.benchmark_group(format!("lb_pick/{label}"));
        for (name, policy) in [
            ("round_robin", Policy::RoundRobin),
            ("least_request", Policy::LeastRequest),
            ("random", Policy::Random),
        ] {
            let balancer = Balancer::new(policy, eligible(weights));
            group.bench_function(name, |b| {
                b.iter(|| black_box(&balancer).pick(black_box(&active)))
            });
        }
        for (name, policy) in [
            ("ring_hash", Policy::RING_HASH_DEFAULT),
            ("maglev", Policy::MAGLEV_DEFAULT),
        ] {
            let balancer = Balancer::with_keys(policy, eligible(weights), addr_key);
            let mut i = 0usize;
            group.bench_function(name, |b| {
                b.iter(|| {
                    i = (i + 1) % keys.len();
                    let h = xx64(black_box(keys[i].as_bytes()), 0);
                    black_box(&balancer).pick_hash(h, &active)
                })
            });
        }
        group.finish();
    }
    // Built once per endpoint change, off the request path.
    let mut group = c.benchmark_group("lb_build");
    for hosts in [10usize, 100] {
        let weights = vec![1u32; hosts];
        group.bench_function(format!("ring_hash/{hosts}"), |b| {
            b.iter(|| Balancer::with_keys(Policy::RING_HASH_DEFAULT, eligible(&weights), addr_key))
        });
        group.bench_function(format!("maglev/{hosts}"), |b| {
            b.iter(|| Balancer::with_keys(Policy::MAGLEV_DEFAULT, eligible(&weights), addr_key))
        });
    }
    group.finish();
}

criterion_group!(benches, lb_pick);
criterion_main!(benches);
