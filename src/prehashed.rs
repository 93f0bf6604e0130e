//! A `Hasher` for map keys that are hashes already (pingora's connection reuse hashes, the
//! xxh64 of a metric's labels): hashing them again with the default SipHash buys nothing and
//! costs more than the lookup around it.

use std::hash::{BuildHasherDefault, Hasher};

/// The key's `u64` as its own hash.
#[derive(Default)]
pub struct Prehashed(u64);

/// For `HashMap::with_hasher` / `default()`.
pub type BuildPrehashed = BuildHasherDefault<Prehashed>;

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is expected (the keys are u64); any other input still hashes.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn a_u64_key_is_its_own_hash() {
        let b = BuildPrehashed::default();
        for k in [0u64, 1, 0xdead_beef, u64::MAX] {
            assert_eq!(b.hash_one(k), k);
        }
    }
}
