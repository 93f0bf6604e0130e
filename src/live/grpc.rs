//! A cluster's gRPC counters (`envoy.filters.http.grpc_stats`): per `<service>.<method>` (or
//! none), the status codes seen, success/failure/total and message counts. Methods are looked
//! up lock-free; only a method seen for the first time takes the writer lock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

/// gRPC's status codes 0 to 16; others (not gRPC's) are kept apart.
const KNOWN_STATUSES: usize = 17;

#[derive(Debug, Default)]
pub struct MethodCounters {
    pub statuses: [AtomicU64; KNOWN_STATUSES],
    /// Status values beyond gRPC's codes.
    pub other_statuses: Mutex<BTreeMap<u32, u64>>,
    pub success: AtomicU64,
    pub failure: AtomicU64,
    pub total: AtomicU64,
    pub request_message_count: AtomicU64,
    pub response_message_count: AtomicU64,
}

impl MethodCounters {
    /// A call ended with this `grpc-status` value.
    pub fn status(&self, status: u32) {
        match self.statuses.get(status as usize) {
            Some(c) => {
                c.fetch_add(1, Relaxed);
            }
            None => {
                if let Ok(mut m) = self.other_statuses.lock() {
                    *m.entry(status).or_default() += 1;
                }
            }
        }
        let ok = status == 0;
        if ok { &self.success } else { &self.failure }.fetch_add(1, Relaxed);
        self.total.fetch_add(1, Relaxed);
    }

    /// (stat suffix, value) of every counter that was ever charged, in Envoy's names.
    pub fn samples(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for (i, c) in self.statuses.iter().enumerate() {
            let v = c.load(Relaxed);
            if v > 0 {
                out.push((i.to_string(), v));
            }
        }
        if let Ok(m) = self.other_statuses.lock() {
            out.extend(m.iter().map(|(k, v)| (k.to_string(), *v)));
        }
        for (name, c) in [
            ("success", &self.success),
            ("failure", &self.failure),
            ("total", &self.total),
            ("request_message_count", &self.request_message_count),
            ("response_message_count", &self.response_message_count),
        ] {
            let v = c.load(Relaxed);
            if v > 0 {
                out.push((name.to_string(), v));
            }
        }
        out
    }
}

/// Keyed by `<service>.<method>`; "" for calls counted without them.
#[derive(Debug, Default)]
pub struct GrpcCounters {
    methods: ArcSwap<BTreeMap<Box<str>, Arc<MethodCounters>>>,
    write: Mutex<()>,
}

impl GrpcCounters {
    pub fn method(&self, names: Option<&str>) -> Arc<MethodCounters> {
        let key = names.unwrap_or("");
        if let Some(m) = self.methods.load().get(key) {
            return m.clone();
        }
        let _w = self.write.lock();
        let cur = self.methods.load_full();
        if let Some(m) = cur.get(key) {
            return m.clone();
        }
        let m = Arc::new(MethodCounters::default());
        let mut next = (*cur).clone();
        next.insert(key.into(), m.clone());
        self.methods.store(Arc::new(next));
        m
    }

    /// Every method with counters, "" first.
    pub fn all(&self) -> Arc<BTreeMap<Box<str>, Arc<MethodCounters>>> {
        self.methods.load_full()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_outcomes() {
        let g = GrpcCounters::default();
        let m = g.method(Some("pkg.Svc.Do"));
        m.status(0);
        m.status(5);
        m.status(99);
        m.request_message_count.fetch_add(3, Relaxed);
        assert!(Arc::ptr_eq(&m, &g.method(Some("pkg.Svc.Do"))));
        let s: BTreeMap<String, u64> = m.samples().into_iter().collect();
        assert_eq!(s["0"], 1);
        assert_eq!(s["5"], 1);
        assert_eq!(s["99"], 1);
        assert_eq!(s["success"], 1);
        assert_eq!(s["failure"], 2);
        assert_eq!(s["total"], 3);
        assert_eq!(s["request_message_count"], 3);
        assert!(!s.contains_key("response_message_count"));
        assert_eq!(g.all().len(), 1);
    }
}
