//! Ring hash and Maglev: Envoy's published vectors (its own unit tests' rings and tables), weights,
//! stickiness and minimal disruption.

use super::*;

fn hosts(ports: &[u16], weights: &[u32]) -> Vec<HashHost> {
    ports
        .iter()
        .zip(weights)
        .enumerate()
        .map(|(index, (p, w))| HashHost {
            key: format!("127.0.0.1:{p}"),
            index,
            weight: *w,
            share: None,
        })
        .collect()
}

#[test]
fn hash_functions_match_envoys_vectors() {
    // Values from Envoy's test/common/common/hash_test.cc.
    assert_eq!(xx64(b"foo", 0), 3728699739546630719);
    assert_eq!(xx64(b"lyft", 0), 4400747396090729504);
    assert_eq!(xx64(b"", 0), 17241709254077376921);
    assert_eq!(murmur2_64(b"foo"), 9631199822919835226);
    assert_eq!(murmur2_64(b"bar"), 11474628671133349555);
    assert_eq!(murmur2_64(b"foo\nbar"), 16306510975912980159);
    assert_eq!(murmur2_64(b"lyft"), 12847078931730529320);
    assert_eq!(murmur2_64(b""), 6142509188972423790);
    // One value chains to a plain hash; several chain seeds.
    assert_eq!(xx64_chain([&b"foo"[..]]), xx64(b"foo", 0));
    assert_eq!(
        xx64_chain([&b"a"[..], &b"b"[..]]),
        xx64(b"b", xx64(b"a", 0))
    );
}

#[test]
fn ring_matches_envoys_basic_ring() {
    // Envoy's RingHashLoadBalancerTest.Basic: six hosts, minimum ring size 12.
    let ring = Ring::build(
        &hosts(&[90, 91, 92, 93, 94, 95], &[1; 6]),
        12,
        8 << 20,
        HashFunction::XxHash,
    );
    assert_eq!(ring.len(), 12);
    assert_eq!(ring.hashes[0], 833437586790550860);
    assert_eq!(ring.hashes[3], 3551244743356806947);
    assert_eq!(ring.hashes[11], 16117243373044804889);
    assert_eq!(ring.pick(0), Some(4));
    assert_eq!(ring.pick(u64::MAX), Some(4));
    assert_eq!(ring.pick(3551244743356806947), Some(5));
    assert_eq!(ring.pick(3551244743356806948), Some(3));
    assert_eq!(ring.pick(16117243373044804880), Some(0));
}

#[test]
fn ring_size_follows_min_max_and_weights() {
    let three = hosts(&[1, 2, 3], &[1; 3]);
    // The lightest host gets a whole number of entries: ceil(1024 / 3) each.
    let r = Ring::build(&three, 1024, 8 << 20, HashFunction::XxHash);
    assert_eq!(r.len(), 3 * 342);
    // The maximum caps it.
    let r = Ring::build(&three, 1024, 100, HashFunction::XxHash);
    assert!(r.len() <= 100 && r.len() >= 99, "{}", r.len());
    // Weights 1:3 give a quarter and three quarters of the entries.
    let r = Ring::build(
        &hosts(&[1, 2], &[1, 3]),
        1024,
        8 << 20,
        HashFunction::XxHash,
    );
    let first = r.hosts.iter().filter(|h| **h == 0).count();
    assert_eq!((first, r.len() - first), (256, 768));
    assert!(Ring::build(&[], 1024, 8 << 20, HashFunction::XxHash)
        .pick(1)
        .is_none());
}

#[test]
fn murmur_ring_places_hosts_differently() {
    let h = hosts(&[90, 91, 92], &[1; 3]);
    let xx = Ring::build(&h, 12, 8 << 20, HashFunction::XxHash);
    let mm = Ring::build(&h, 12, 8 << 20, HashFunction::MurmurHash2);
    assert_eq!(mm.len(), 12);
    assert_ne!(xx.hashes, mm.hashes);
    assert_eq!(mm.hashes[0], {
        let mut all: Vec<u64> = (90..93)
            .flat_map(|p| (0..4).map(move |i| murmur2_64(format!("127.0.0.1:{p}_{i}").as_bytes())))
            .collect();
        all.sort();
        all[0]
    });
}

#[test]
fn maglev_matches_envoys_tables() {
    // Envoy's MaglevLoadBalancerTest.Basic (table size 7) and .Weighted (17, weights 1:2).
    let t = MaglevTable::build(&hosts(&[90, 91, 92, 93, 94, 95], &[1; 6]), 7);
    let got: Vec<usize> = (0..7).filter_map(|i| t.pick(i)).collect();
    assert_eq!(got, vec![2, 4, 0, 1, 5, 0, 3]);
    assert_eq!(
        t.pick(7),
        Some(2),
        "the hash is taken modulo the table size"
    );
    let t = MaglevTable::build(&hosts(&[90, 91], &[1, 2]), 17);
    let got: Vec<usize> = (0..17).filter_map(|i| t.pick(i)).collect();
    assert_eq!(got, vec![1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 0, 1]);
}

#[test]
fn maglev_does_not_depend_on_host_order() {
    let a = hosts(&[90, 91, 92, 93], &[1; 4]);
    let mut b = a.clone();
    b.reverse();
    let ta = MaglevTable::build(&a, 65537);
    let tb = MaglevTable::build(&b, 65537);
    assert!((0..65537).all(|i| ta.pick(i) == tb.pick(i)));
}

#[test]
fn maglev_weights_scale_slots() {
    let t = MaglevTable::build(&hosts(&[1, 2, 3], &[1, 2, 1]), 65537);
    let count = |h: usize| (0..65537u64).filter(|i| t.pick(*i) == Some(h)).count();
    let (a, b, c) = (count(0), count(1), count(2));
    assert_eq!(a + b + c, 65537);
    let share = |n: usize| n as f64 / 65537.0;
    assert!((share(a) - 0.25).abs() < 0.01, "{a}");
    assert!((share(b) - 0.5).abs() < 0.01, "{b}");
    assert!((share(c) - 0.25).abs() < 0.01, "{c}");
}

#[test]
fn primes() {
    let p: Vec<u64> = (0..30).filter(|n| is_prime(*n)).collect();
    assert_eq!(p, vec![2, 3, 5, 7, 11, 13, 17, 19, 23, 29]);
    assert!(is_prime(65537));
    assert!(is_prime(5_000_011));
    assert!(!is_prime(65536));
}

/// Fraction of `keys` hashes that map to another host after host `removed` leaves, among the
/// keys whose host stays. Consistent hashing should move only the removed host's keys (1/N).
fn remapped(before: impl Fn(u64) -> usize, after: impl Fn(u64) -> usize, keys: u64) -> f64 {
    let moved = (0..keys)
        .map(|k| xx64(format!("user-{k}").as_bytes(), 0))
        .filter(|h| before(*h) != after(*h))
        .count();
    moved as f64 / keys as f64
}

pub(crate) const DISRUPTION_KEYS: u64 = 20_000;

/// Removing one of ten hosts: Maglev moves about a tenth of the keys. Envoy's ring moves the
/// removed host's keys plus some more: with a minimum ring size of 1024, nine hosts get 114
/// entries each instead of 103, and the new entries take keys from other surviving hosts.
#[test]
fn removing_one_of_ten_hosts_moves_about_a_tenth_of_keys() {
    let ten = hosts(&[10, 11, 12, 13, 14, 15, 16, 17, 18, 19], &[1; 10]);
    let nine: Vec<HashHost> = ten.iter().filter(|h| h.index != 3).cloned().collect();
    let ring_before = Ring::build(&ten, 1024, 8 << 20, HashFunction::XxHash);
    let ring_after = Ring::build(&nine, 1024, 8 << 20, HashFunction::XxHash);
    let ring = remapped(
        |h| ring_before.pick(h).unwrap_or(usize::MAX),
        |h| ring_after.pick(h).unwrap_or(usize::MAX),
        DISRUPTION_KEYS,
    );
    let mag_before = MaglevTable::build(&ten, 65537);
    let mag_after = MaglevTable::build(&nine, 65537);
    let maglev = remapped(
        |h| mag_before.pick(h).unwrap_or(usize::MAX),
        |h| mag_after.pick(h).unwrap_or(usize::MAX),
        DISRUPTION_KEYS,
    );
    // The same ring with a fixed 100 entries per host (minimum sizes 1000 and 900).
    let fixed_before = Ring::build(&ten, 1000, 8 << 20, HashFunction::XxHash);
    let fixed_after = Ring::build(&nine, 900, 8 << 20, HashFunction::XxHash);
    let fixed = remapped(
        |h| fixed_before.pick(h).unwrap_or(usize::MAX),
        |h| fixed_after.pick(h).unwrap_or(usize::MAX),
        DISRUPTION_KEYS,
    );
    let share_of_removed = (0..DISRUPTION_KEYS)
        .filter(|k| fixed_before.pick(xx64(format!("user-{k}").as_bytes(), 0)) == Some(3))
        .count() as f64
        / DISRUPTION_KEYS as f64;
    eprintln!(
        "disruption, 10 -> 9 hosts, {DISRUPTION_KEYS} keys: ring hash {ring:.4} (100 entries per host: \
         {fixed:.4}, the removed host's share {share_of_removed:.4}), maglev {maglev:.4} (ideal 0.1)"
    );
    assert!((0.08..0.12).contains(&maglev), "maglev moved {maglev}");
    assert!((0.08..0.25).contains(&ring), "ring hash moved {ring}");
    // With entries per host unchanged, exactly the removed host's keys move.
    assert_eq!(fixed, share_of_removed);
    assert!((0.07..0.13).contains(&fixed), "ring hash moved {fixed}");
}

/// Adding an eleventh host: each structure moves about 1/11 of the keys, all to the new host
/// for the fixed-entries ring.
#[test]
fn adding_a_host_moves_keys_mostly_to_it() {
    let ten = hosts(&[10, 11, 12, 13, 14, 15, 16, 17, 18, 19], &[1; 10]);
    let eleven = hosts(&[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], &[1; 11]);
    let before = MaglevTable::build(&ten, 65537);
    let after = MaglevTable::build(&eleven, 65537);
    let moved = remapped(
        |h| before.pick(h).unwrap_or(usize::MAX),
        |h| after.pick(h).unwrap_or(usize::MAX),
        DISRUPTION_KEYS,
    );
    assert!((0.07..0.12).contains(&moved), "maglev moved {moved}");
    let before = Ring::build(&ten, 1000, 8 << 20, HashFunction::XxHash);
    let after = Ring::build(&eleven, 1100, 8 << 20, HashFunction::XxHash);
    for k in 0..DISRUPTION_KEYS {
        let h = xx64(format!("user-{k}").as_bytes(), 0);
        let (b, a) = (before.pick(h), after.pick(h));
        assert!(a == b || a == Some(10), "key {k} moved from {b:?} to {a:?}");
    }
}

#[test]
fn maglev_slot_width_follows_the_host_count() {
    for n in [1usize, 256, 257, 70_000] {
        let hs: Vec<HashHost> = (0..n)
            .map(|i| HashHost {
                key: format!("10.{}.{}.{}:80", i >> 16, (i >> 8) & 255, i & 255),
                index: i,
                weight: 1,
                share: None,
            })
            .collect();
        // 70,000 hosts need a table larger than the host count.
        let size = if n > 65537 { 140_009 } else { 65537 };
        let t = MaglevTable::build(&hs, size);
        assert_eq!(t.len(), size as usize);
        let mut seen = vec![false; n];
        for i in 0..size {
            seen[t.pick(i).expect("non-empty")] = true;
        }
        assert!(seen.iter().all(|s| *s), "{n} hosts: every host has a slot");
        let width = match &t.slots {
            Slots::U8(_) => 1,
            Slots::U16(_) => 2,
            Slots::U32(_) => 4,
            Slots::Empty => 0,
        };
        assert_eq!(
            width,
            if n <= 256 {
                1
            } else if n <= 65536 {
                2
            } else {
                4
            }
        );
    }
}
