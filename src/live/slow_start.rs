//! Slow start's live state: when each host of a cluster was first seen healthy, kept across
//! endpoint updates (Envoy keeps a host's time while the host stays in the cluster). Read
//! when a cluster is built; the balancers ramp a host's weight from it.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Instant;

#[derive(Debug, Default)]
pub struct HealthySince {
    hosts: Mutex<HashMap<SocketAddr, Instant>>,
}

impl HealthySince {
    /// Each host's time, for `(address, healthy, reset)` per host (`None` for hosts not
    /// healthy). Forgets hosts that left, and those marked `reset` (failed by active health
    /// checks), so that they ramp again.
    pub fn resolve(
        &self,
        hosts: impl IntoIterator<Item = (SocketAddr, bool, bool)>,
    ) -> Vec<Option<Instant>> {
        let mut map = self.hosts.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let mut present = HashSet::new();
        let out = hosts
            .into_iter()
            .map(|(addr, healthy, reset)| {
                present.insert(addr);
                if reset {
                    map.remove(&addr);
                }
                healthy.then(|| *map.entry(addr).or_insert(now))
            })
            .collect();
        map.retain(|a, _| present.contains(a));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_keeps_its_time_until_it_leaves_or_is_reset() {
        let s = HealthySince::default();
        let a: SocketAddr = "10.0.0.1:80".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:80".parse().unwrap();
        let first = s.resolve([(a, true, false), (b, false, false)]);
        assert!(first[0].is_some() && first[1].is_none());
        let again = s.resolve([(a, true, false), (b, true, false)]);
        assert_eq!(again[0], first[0]);
        let later = again[1].expect("b is healthy now");
        // Leaving forgets the host; coming back starts a new ramp.
        s.resolve([(a, true, false)]);
        let back = s.resolve([(a, true, true), (b, true, false)]);
        assert!(back[0] >= first[0] && back[1] >= Some(later));
        assert!(back[1].is_some());
    }
}
