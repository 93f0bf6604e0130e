//! Consistent hashing as Envoy 1.40 builds it: the ketama-style ring of `RING_HASH` and the
//! lookup table of `MAGLEV`. Both are built once per host set (at snapshot build time, when a
//! cluster's endpoints change); a pick is one binary search or one table index.
//!
//! Construction follows Envoy's algorithms step for step (same hash keys, same hash functions,
//! same floating point running sums, same host order), so that a given request hash lands on the
//! same endpoint address as it does in Envoy.

/// Envoy's `HashUtil::xxHash64`: XXH64 with seed 0 unless told otherwise.
pub fn xx64(bytes: &[u8], seed: u64) -> u64 {
    xxhash_rust::xxh64::xxh64(bytes, seed)
}

/// Envoy's hash of several values (a header sent more than once): each value is hashed with the
/// previous hash as seed, starting from seed 0; a single value is a plain XXH64.
pub fn xx64_chain<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    values.into_iter().fold(0, |seed, v| xx64(v, seed))
}

/// Seed of Envoy's `MurmurHash::murmurHash2` (the 64-bit `std::hash` of libstdc++).
const STD_HASH_SEED: u64 = 0xc70f_6907;

/// MurmurHash64A as libstdc++'s `_Hash_bytes` computes it on 64-bit targets, which is what
/// Envoy's `MURMUR_HASH_2` ring hash function is (kept for rings built by older Envoys).
pub fn murmur2_64(bytes: &[u8]) -> u64 {
    const MUL: u64 = (0xc6a4_a793_u64 << 32) + 0x5bd1_e995;
    let shift_mix = |v: u64| v ^ (v >> 47);
    let mut hash = STD_HASH_SEED ^ (bytes.len() as u64).wrapping_mul(MUL);
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let data = shift_mix(u64::from_le_bytes(word).wrapping_mul(MUL)).wrapping_mul(MUL);
        hash ^= data;
        hash = hash.wrapping_mul(MUL);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        // The tail is loaded little-endian, as libstdc++'s load_bytes does.
        let data = rest
            .iter()
            .rev()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
        hash ^= data;
        hash = hash.wrapping_mul(MUL);
    }
    shift_mix(shift_mix(hash).wrapping_mul(MUL))
}

/// Which function places hosts on the ring (`ring_hash_lb_config.hash_function`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashFunction {
    XxHash,
    MurmurHash2,
}

/// One host to place: its key (Envoy hashes the address, `ip:port`), its index in the cluster's
/// host list, and its weight.
#[derive(Debug, Clone)]
pub struct HashHost {
    pub key: String,
    pub index: usize,
    pub weight: u32,
    /// A share of the whole given by the caller (locality-weighted clusters); it replaces
    /// `weight / sum of weights`.
    pub share: Option<f64>,
}

/// Envoy normalizes weights to fractions of their sum before building either structure; the
/// same f64 arithmetic keeps the ring's per-host counts identical to Envoy's.
fn normalized(hosts: &[HashHost]) -> (Vec<f64>, f64, f64) {
    let sum: u64 = hosts.iter().map(|h| u64::from(h.weight)).sum();
    let weights: Vec<f64> = hosts
        .iter()
        .map(|h| {
            h.share
                .unwrap_or_else(|| f64::from(h.weight) * 1.0 / sum.max(1) as f64)
        })
        .collect();
    let min = weights.iter().copied().fold(1.0, f64::min);
    let max = weights.iter().copied().fold(0.0, f64::max);
    (weights, min, max)
}

/// A sorted ring of (hash, host index).
#[derive(Debug, Default)]
pub struct Ring {
    hashes: Vec<u64>,
    hosts: Vec<u32>,
}

impl Ring {
    /// Builds the ring as Envoy does: scale so the lightest host gets a whole number of entries
    /// (at least `min_size` in total, at most `max_size`), then give each host `scale x weight`
    /// entries keyed `"<address>_<i>"`, with running sums carrying the fractions across hosts.
    pub fn build(hosts: &[HashHost], min_size: u64, max_size: u64, function: HashFunction) -> Ring {
        if hosts.is_empty() {
            return Ring::default();
        }
        let (weights, min_w, _) = normalized(hosts);
        let scale = ((min_w * min_size as f64).ceil() / min_w).min(max_size as f64);
        let size = scale.ceil() as usize;
        let mut entries: Vec<(u64, u32)> = Vec::with_capacity(size);
        let mut current = 0.0f64;
        let mut target = 0.0f64;
        let mut key = String::new();
        for (host, w) in hosts.iter().zip(&weights) {
            target += scale * w;
            let mut i = 0u64;
            while current < target {
                key.clear();
                key.push_str(&host.key);
                key.push('_');
                key.push_str(&i.to_string());
                let hash = match function {
                    HashFunction::XxHash => xx64(key.as_bytes(), 0),
                    HashFunction::MurmurHash2 => murmur2_64(key.as_bytes()),
                };
                entries.push((hash, host.index as u32));
                i += 1;
                current += 1.0;
            }
        }
        // Stable, like std::sort on the hash alone could not promise; equal hashes are
        // astronomically rare with 64-bit hashes.
        entries.sort_by_key(|(h, _)| *h);
        Ring {
            hashes: entries.iter().map(|(h, _)| *h).collect(),
            hosts: entries.iter().map(|(_, i)| *i).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    /// How many entries each host (by index, `n` hosts) holds: the weights made visible.
    pub fn entries_per_host(&self, n: usize) -> Vec<usize> {
        let mut out = vec![0; n];
        for h in &self.hosts {
            if let Some(c) = out.get_mut(*h as usize) {
                *c += 1;
            }
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }

    /// The first entry whose hash is at or after `h`, wrapping past the end to the first: the
    /// ketama lookup Envoy uses.
    pub fn pick(&self, h: u64) -> Option<usize> {
        self.pick_attempt(h, 0)
    }

    /// Envoy's host-selection retry (a retry host predicate refused the host): `attempt`
    /// entries further round the ring.
    pub fn pick_attempt(&self, h: u64, attempt: u32) -> Option<usize> {
        if self.hashes.is_empty() {
            return None;
        }
        let at = self.hashes.partition_point(|x| *x < h);
        let at = if at == self.hashes.len() { 0 } else { at };
        let at = (at + attempt as usize) % self.hashes.len();
        Some(self.hosts[at] as usize)
    }
}

/// Envoy's Maglev lookup table: `table_size` slots, each naming a host. Slots hold a position in
/// `hosts` in the narrowest integer that fits (one byte for up to 256 hosts), so the default
/// 65,537-slot table of a small cluster takes 64 KiB rather than 256 (Envoy's compact table
/// packs bits for the same reason).
#[derive(Debug, Default)]
pub struct MaglevTable {
    hosts: Vec<u32>,
    slots: Slots,
}

#[derive(Debug, Default)]
enum Slots {
    #[default]
    Empty,
    U8(Vec<u8>),
    U16(Vec<u16>),
    U32(Vec<u32>),
}

impl MaglevTable {
    /// Fills the table as Envoy does: hosts sorted by key, each with an offset and a skip from
    /// two XXH64 hashes of its key (seeds 0 and 1); hosts take turns claiming their next free
    /// preferred slot, a host of lower weight skipping turns in proportion to its weight.
    pub fn build(hosts: &[HashHost], table_size: u64) -> MaglevTable {
        if hosts.is_empty() || table_size < 2 {
            return MaglevTable::default();
        }
        let (weights, _, max_w) = normalized(hosts);
        struct Entry {
            index: u32,
            offset: u64,
            skip: u64,
            weight: f64,
            target: f64,
            next: u64,
        }
        let mut order: Vec<usize> = (0..hosts.len()).collect();
        // Envoy sorts by key so the fill order does not depend on the order EDS listed hosts in.
        order.sort_by(|a, b| hosts[*a].key.cmp(&hosts[*b].key));
        let mut entries: Vec<Entry> = order
            .into_iter()
            .map(|i| {
                let key = hosts[i].key.as_bytes();
                Entry {
                    index: hosts[i].index as u32,
                    offset: xx64(key, 0) % table_size,
                    skip: xx64(key, 1) % (table_size - 1) + 1,
                    weight: weights[i],
                    target: 0.0,
                    next: 0,
                }
            })
            .collect();
        const EMPTY: u32 = u32::MAX;
        let size = table_size as usize;
        // Positions in `entries` while filling; narrowed below.
        let mut slots = vec![EMPTY; size];
        let mut filled = 0usize;
        let mut iteration: u32 = 1;
        while filled < size {
            for (pos, e) in entries.iter_mut().enumerate() {
                if filled >= size {
                    break;
                }
                if f64::from(iteration) * e.weight < e.target {
                    continue;
                }
                e.target += max_w;
                let mut c = e.offset.wrapping_add(e.skip.wrapping_mul(e.next)) % table_size;
                while slots[c as usize] != EMPTY {
                    e.next += 1;
                    c = e.offset.wrapping_add(e.skip.wrapping_mul(e.next)) % table_size;
                }
                slots[c as usize] = pos as u32;
                e.next += 1;
                filled += 1;
            }
            iteration = iteration.wrapping_add(1);
        }
        let hosts: Vec<u32> = entries.iter().map(|e| e.index).collect();
        let slots = match hosts.len() {
            0..=256 => Slots::U8(slots.into_iter().map(|p| p as u8).collect()),
            257..=65536 => Slots::U16(slots.into_iter().map(|p| p as u16).collect()),
            _ => Slots::U32(slots),
        };
        MaglevTable { hosts, slots }
    }

    pub fn len(&self) -> usize {
        match &self.slots {
            Slots::Empty => 0,
            Slots::U8(s) => s.len(),
            Slots::U16(s) => s.len(),
            Slots::U32(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many slots each host (by index, `n` hosts) holds.
    pub fn slots_per_host(&self, n: usize) -> Vec<usize> {
        let mut out = vec![0; n];
        let mut count = |pos: usize| {
            if let Some(c) = self.hosts.get(pos).and_then(|i| out.get_mut(*i as usize)) {
                *c += 1;
            }
        };
        match &self.slots {
            Slots::Empty => {}
            Slots::U8(s) => s.iter().for_each(|p| count(usize::from(*p))),
            Slots::U16(s) => s.iter().for_each(|p| count(usize::from(*p))),
            Slots::U32(s) => s.iter().for_each(|p| count(*p as usize)),
        }
        out
    }

    pub fn pick(&self, h: u64) -> Option<usize> {
        self.pick_attempt(h, 0)
    }

    /// Envoy's host-selection retry: the hash is flipped by a value with most bits set, so
    /// each attempt lands far from the last.
    pub fn pick_attempt(&self, h: u64, attempt: u32) -> Option<usize> {
        let h = if attempt > 0 {
            h ^ 0u64.wrapping_sub(u64::from(attempt))
        } else {
            h
        };
        let at = |len: usize| (h % len as u64) as usize;
        let pos = match &self.slots {
            Slots::Empty => return None,
            Slots::U8(s) => usize::from(s[at(s.len())]),
            Slots::U16(s) => usize::from(s[at(s.len())]),
            Slots::U32(s) => s[at(s.len())] as usize,
        };
        self.hosts.get(pos).map(|i| *i as usize)
    }
}

/// Trial division is enough: Envoy caps `table_size` at 5,000,011.
pub fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    if n.is_multiple_of(2) {
        return n == 2;
    }
    let mut d = 3u64;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

#[cfg(test)]
#[path = "hash_tests.rs"]
mod hash_tests;
