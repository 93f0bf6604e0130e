//! Active health checking's live state: every checked host's flags by address, whether the
//! checker's first round is done, and Envoy's `health_check.*` counters. The checkers
//! (`crate::health`) write it; cluster builds read it at the commit point; the config and the
//! per-host state machine are in `snapshot::health_check`.

use std::any::Any;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// The cluster config a checker runs for, held by identity.
pub type Owner = Arc<dyn Any + Send + Sync>;

fn same<T: Any + Send + Sync>(owner: &Owner, def: &Arc<T>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(owner), Arc::as_ptr(def))
}

/// Envoy's `HealthTransition`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Unchanged,
    Changed,
    ChangePending,
}

/// A host's active-check flags, as Envoy's host health flags name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HcFlags {
    pub failed: bool,
    pub degraded: bool,
    pub timeout: bool,
    pub immediate: bool,
}

impl HcFlags {
    /// A host just added to a cluster with a health checker.
    pub const NEW: HcFlags = HcFlags {
        failed: true,
        degraded: false,
        timeout: false,
        immediate: false,
    };
}

/// One cluster's health-check state, kept in its stats (which outlive snapshots): the flags of
/// every checked host by address, whether the first round is done, and Envoy's counters.
#[derive(Debug, Default)]
pub struct HealthHosts {
    inner: Mutex<Inner>,
    /// Bumped whenever a build would come out different: a cluster is reused only at the
    /// generation it was built at.
    generation: AtomicU64,
    pub attempt: AtomicU64,
    pub success: AtomicU64,
    pub failure: AtomicU64,
    pub network_failure: AtomicU64,
    pub passive_failure: AtomicU64,
    pub verify_cluster: AtomicU64,
}

#[derive(Debug, Default)]
struct Inner {
    /// The definition the current checker runs for (the cluster's config, by identity): a
    /// changed cluster is a new cluster to Envoy, with every host failed again until checked.
    owner: Option<Owner>,
    initialized: bool,
    /// Check results still awaited before the first round counts as done.
    pending: usize,
    hosts: HashMap<SocketAddr, HostEntry>,
}

#[derive(Debug)]
struct HostEntry {
    flags: HcFlags,
    /// Where a passive failure is sent, to the host's check task.
    passive: Option<tokio::sync::mpsc::UnboundedSender<()>>,
}

impl HealthHosts {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Relaxed)
    }

    fn bump(&self) {
        self.generation.fetch_add(1, Relaxed);
    }

    /// Whether `def` can be built: its checker has finished the first round.
    pub fn ready_for<T: Any + Send + Sync>(&self, def: &Arc<T>) -> bool {
        let g = self.lock();
        g.initialized && g.owner.as_ref().is_some_and(|o| same(o, def))
    }

    /// Whether a checker currently runs for this cluster.
    pub fn active(&self) -> bool {
        self.lock().owner.is_some()
    }

    pub fn owner_is<T: Any + Send + Sync>(&self, def: &Arc<T>) -> bool {
        self.lock().owner.as_ref().is_some_and(|o| same(o, def))
    }

    /// A new checker for `def` (or none): every host starts over.
    pub fn reset(&self, def: Option<Owner>) {
        let mut g = self.lock();
        *g = Inner {
            owner: def,
            ..Default::default()
        };
        drop(g);
        self.bump();
    }

    /// A checked host joins; it is failed until its first check passes.
    pub fn add(&self, addr: SocketAddr, passive: tokio::sync::mpsc::UnboundedSender<()>) {
        let mut g = self.lock();
        if !g.initialized {
            g.pending += 1;
        }
        g.hosts.insert(
            addr,
            HostEntry {
                flags: HcFlags::NEW,
                passive: Some(passive),
            },
        );
        drop(g);
        self.bump();
    }

    /// A host left (or is checked elsewhere now). Returns whether the first round completed.
    pub fn remove(&self, addr: &SocketAddr, never_checked: bool) -> bool {
        let mut g = self.lock();
        g.hosts.remove(addr);
        let done = never_checked && self.settle(&mut g);
        drop(g);
        self.bump();
        done
    }

    /// The first round completes when no result is awaited any more; true when it just did.
    pub fn finish_if_idle(&self) -> bool {
        let mut g = self.lock();
        if !g.initialized && g.owner.is_some() && g.pending == 0 {
            g.initialized = true;
            drop(g);
            self.bump();
            return true;
        }
        false
    }

    fn settle(&self, g: &mut Inner) -> bool {
        if g.initialized || g.pending == 0 {
            return false;
        }
        g.pending -= 1;
        if g.pending == 0 {
            g.initialized = true;
            return true;
        }
        false
    }

    /// A check result for `addr`. Envoy counts the first round down by results (not hosts)
    /// and rebuilds host sets only on `Changed`. Returns whether the cluster must be rebuilt.
    pub fn report(&self, addr: &SocketAddr, flags: HcFlags, t: Transition) -> bool {
        let mut g = self.lock();
        let Some(e) = g.hosts.get_mut(addr) else {
            return false;
        };
        e.flags = flags;
        let finished = self.settle(&mut g);
        let rebuild = finished || (g.initialized && t == Transition::Changed);
        drop(g);
        if rebuild {
            self.bump();
        }
        rebuild
    }

    /// The flags of each of `hosts` (address, checks disabled): new hosts fail until checked;
    /// hosts with checks disabled have none.
    pub fn flags(
        &self,
        hosts: impl IntoIterator<Item = (SocketAddr, bool)>,
    ) -> Vec<Option<HcFlags>> {
        let g = self.lock();
        hosts
            .into_iter()
            .map(|(addr, disabled)| {
                if disabled {
                    return None;
                }
                Some(g.hosts.get(&addr).map_or(HcFlags::NEW, |e| e.flags))
            })
            .collect()
    }

    /// The live flags of one host (admin), None when it is not checked.
    pub fn flags_of(&self, addr: &SocketAddr) -> Option<HcFlags> {
        self.lock().hosts.get(addr).map(|e| e.flags)
    }

    /// Hosts checked and passing (Envoy's `health_check.healthy` gauge) and degraded.
    pub fn gauges(&self) -> (u64, u64) {
        let g = self.lock();
        let healthy = g.hosts.values().filter(|e| !e.flags.failed).count() as u64;
        let degraded = g.hosts.values().filter(|e| e.flags.degraded).count() as u64;
        (healthy, degraded)
    }

    /// A proxied response from `addr` carried `x-envoy-immediate-health-check-fail`.
    pub fn passive_failure(&self, addr: &SocketAddr) {
        let g = self.lock();
        if let Some(tx) = g.hosts.get(addr).and_then(|e| e.passive.as_ref()) {
            let _ = tx.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_round_completes_after_one_result_per_host() {
        // Any config object will do as the owner: it is held by identity.
        let def = Arc::new(String::from("cluster c"));
        let h = HealthHosts::default();
        let a: SocketAddr = "10.0.0.1:80".parse().unwrap();
        let b: SocketAddr = "10.0.0.2:80".parse().unwrap();
        h.reset(Some(def.clone()));
        assert!(!h.ready_for(&Arc::new(String::from("cluster c"))));
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        h.add(a, tx.clone());
        h.add(b, tx);
        assert!(!h.ready_for(&def));
        let g = h.generation();
        assert!(
            !h.report(&a, HcFlags::default(), Transition::Changed),
            "warming: no rebuild"
        );
        assert!(
            h.report(&b, HcFlags::NEW, Transition::Unchanged),
            "round done: build"
        );
        assert!(h.ready_for(&def) && h.generation() > g);
        assert_eq!(h.gauges(), (1, 0));
        let g = h.generation();
        assert!(!h.report(&b, HcFlags::NEW, Transition::Unchanged));
        assert_eq!(h.generation(), g, "no change, no rebuild");
        assert!(h.report(&b, HcFlags::default(), Transition::Changed));
        // A rebuild sees the flags; an unknown (new) host starts failed.
        let c: SocketAddr = "10.0.0.3:80".parse().unwrap();
        assert_eq!(
            h.flags([(a, false), (c, false), (b, true)]),
            vec![Some(HcFlags::default()), Some(HcFlags::NEW), None]
        );
    }
}
