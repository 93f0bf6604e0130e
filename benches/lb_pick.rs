//! Endpoint pick per LB policy, 10 hosts, equal and unequal weights: `cargo bench --bench lb_pick`.

use std::hint::black_box;
use std::sync::atomic::AtomicU32;

use criterion::{criterion_group, criterion_main, Criterion};
use portico::lb::{Balancer, Eligible, Policy};

const HOSTS: usize = 10;

fn lb_pick(c: &mut Criterion) {
    // Some hosts busier than others, so least-request compares real loads.
    let active: Vec<AtomicU32> = (0..HOSTS).map(|i| AtomicU32::new((i % 4) as u32)).collect();
    let equal = [1u32; HOSTS];
    let unequal: [u32; HOSTS] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
    for (label, weights) in [("equal", &equal), ("weighted", &unequal)] {
        let mut group = c.benchmark_group(format!("lb_pick/{label}"));
        for (name, policy) in [
            ("round_robin", Policy::RoundRobin),
            ("least_request", Policy::LeastRequest),
            ("random", Policy::Random),
        ] {
            let balancer = Balancer::new(
                policy,
                Eligible {
                    hosts: (0..HOSTS).collect(),
                    weights: weights.to_vec(),
                },
            );
            group.bench_function(name, |b| {
                b.iter(|| black_box(&balancer).pick(black_box(&active)))
            });
        }
        group.finish();
    }
}

criterion_group!(benches, lb_pick);
criterion_main!(benches);
