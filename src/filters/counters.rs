//! Filters' counters known by name.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

/// Counters known by name, made when a filter first needs them and kept for the process's
/// life (Envoy's stats are shared by name: the RBAC filters of one connection manager count
/// into the same `rbac.allowed`). Looked up once per filter instance, never per request.
#[derive(Debug, Default)]
pub struct NamedCounters {
    map: Mutex<BTreeMap<String, std::sync::Arc<AtomicU64>>>,
}

impl NamedCounters {
    pub fn get(&self, name: &str) -> std::sync::Arc<AtomicU64> {
        let mut m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        m.entry(name.to_string()).or_default().clone()
    }

    /// Every counter, by name.
    pub fn all(&self) -> Vec<(String, u64)> {
        let m = self.map.lock().unwrap_or_else(|e| e.into_inner());
        m.iter()
            .map(|(k, v)| (k.clone(), v.load(Relaxed)))
            .collect()
    }
}

/// Counters of filters outside a connection manager (network RBAC on TCP chains), by their
/// full names.
pub static ROOT_COUNTERS: std::sync::LazyLock<NamedCounters> =
    std::sync::LazyLock::new(NamedCounters::default);
