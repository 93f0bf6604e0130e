//! The active health checkers: one task per checked host, on the control runtime, never on a
//! worker. Results go into the cluster's shared [`HealthHosts`]; a result that changes what the
//! balancers must see names the cluster in [`Changes`], and the config worker commits a
//! snapshot with that cluster rebuilt. The request path only ever reads the snapshot.
//!
//! The rules (thresholds, intervals, what counts as which failure) live in
//! [`crate::snapshot::health_check`]; this module only does the I/O.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::admin::stats::{ClusterStats, Stats};
use crate::snapshot::cluster::ClusterDef;
use crate::snapshot::health_check::{
    initial_delay, next_interval, CheckKind, HealthCheckConfig, HttpCheck, Machine, Outcome,
};
use crate::xds::store::Store;

/// Clusters whose health changed since the config worker last looked, and a wake-up for it.
#[derive(Debug, Default)]
pub struct Changes {
    names: Mutex<BTreeSet<String>>,
    pub notify: tokio::sync::Notify,
}

impl Changes {
    fn push(&self, name: &str) {
        self.names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string());
        self.notify.notify_one();
    }

    pub fn take(&self) -> BTreeSet<String> {
        std::mem::take(&mut *self.names.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Every running checker, reconciled with the store on each commit.
#[derive(Debug, Default)]
pub struct HealthManager {
    checkers: HashMap<String, Checker>,
    pub changes: Arc<Changes>,
    any_checked: bool,
}

#[derive(Debug)]
struct Checker {
    def: Arc<ClusterDef>,
    stats: Arc<ClusterStats>,
    sessions: HashMap<SocketAddr, Session>,
}

/// One host's check task; dropping it stops the checks.
#[derive(Debug)]
struct Session {
    target: SocketAddr,
    authority: String,
    /// Whether the host has had a result yet (a host removed before that still counts down
    /// the first round, as Envoy's deleted sessions do).
    checked: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HealthManager {
    /// Whether the last reconciled config had a checked cluster (with or without endpoints).
    pub fn is_checking(&self) -> bool {
        self.any_checked
    }

    /// Starts checkers for new clusters and hosts, stops them for removed ones. A cluster whose
    /// definition changed gets a new checker with every host failed again, as Envoy builds a
    /// new cluster; the old build keeps serving until the new one has finished its first round.
    pub fn reconcile(&mut self, store: &Store, stats: &Stats) {
        // Unit tests commit without a runtime; there is nothing to run the checks on then.
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let mut live = BTreeSet::new();
        self.any_checked = false;
        for (name, item) in store.clusters.iter() {
            let def = &item.value;
            let Some(cfg) = &def.health_check else {
                continue;
            };
            self.any_checked = true;
            // EDS clusters are checked once their endpoints are known.
            let Some(la) = store.cluster_endpoints(name, def) else {
                continue;
            };
            live.insert(name.clone());
            let fresh = !self
                .checkers
                .get(name)
                .is_some_and(|c| Arc::ptr_eq(&c.def, def));
            if fresh {
                let cs = stats.cluster(name);
                // Stop the old sessions before the state they report into is reset.
                self.checkers.remove(name);
                cs.health.reset(Some(def.clone()));
                self.checkers.insert(
                    name.clone(),
                    Checker {
                        def: def.clone(),
                        stats: cs,
                        sessions: HashMap::new(),
                    },
                );
            }
            let Some(checker) = self.checkers.get_mut(name) else {
                continue;
            };
            let mut wanted: HashMap<SocketAddr, (SocketAddr, String)> = HashMap::new();
            for h in &la.hosts {
                let ec = la.check(&h.addr);
                if ec.is_some_and(|c| c.disabled) {
                    continue;
                }
                let target = ec.and_then(|c| c.target).unwrap_or(h.addr);
                let authority = match (&cfg.kind, ec.and_then(|c| c.hostname.clone())) {
                    (_, Some(h)) => h,
                    (CheckKind::Http(http), None) if !http.host.is_empty() => http.host.clone(),
                    _ => name.clone(),
                };
                wanted.insert(h.addr, (target, authority));
            }
            let mut changed = false;
            let stale: Vec<SocketAddr> = checker
                .sessions
                .iter()
                .filter(|(a, s)| {
                    wanted
                        .get(*a)
                        .is_none_or(|(t, auth)| *t != s.target || *auth != s.authority)
                })
                .map(|(a, _)| *a)
                .collect();
            for addr in stale {
                if let Some(s) = checker.sessions.remove(&addr) {
                    let never_checked = !s.checked.load(Relaxed);
                    drop(s);
                    changed |= checker.stats.health.remove(&addr, never_checked);
                }
            }
            for (addr, (target, authority)) in wanted {
                if checker.sessions.contains_key(&addr) {
                    continue;
                }
                let (tx, rx) = mpsc::unbounded_channel();
                checker.stats.health.add(addr, tx);
                let checked = Arc::new(AtomicBool::new(false));
                let ctx = SessionCtx {
                    cluster: name.clone(),
                    cfg: cfg.clone(),
                    stats: checker.stats.clone(),
                    addr,
                    target,
                    authority: authority.clone(),
                    changes: self.changes.clone(),
                    checked: checked.clone(),
                };
                let task = tokio::spawn(run_session(ctx, rx));
                checker.sessions.insert(
                    addr,
                    Session {
                        target,
                        authority,
                        checked,
                        task,
                    },
                );
            }
            // A cluster without hosts to check is warm at once.
            changed |= checker.stats.health.finish_if_idle();
            if changed {
                self.changes.push(name);
            }
        }
        let gone: Vec<String> = self
            .checkers
            .keys()
            .filter(|n| !live.contains(*n))
            .cloned()
            .collect();
        for name in gone {
            if let Some(c) = self.checkers.remove(&name) {
                // A cluster that stays (without checks now, or waiting for endpoints) forgets
                // its checker's state; a removed one drops its stats anyway.
                if store.clusters.contains_key(&name) {
                    c.stats.health.reset(None);
                }
            }
        }
    }
}

struct SessionCtx {
    cluster: String,
    cfg: Arc<HealthCheckConfig>,
    stats: Arc<ClusterStats>,
    addr: SocketAddr,
    target: SocketAddr,
    authority: String,
    changes: Arc<Changes>,
    checked: Arc<AtomicBool>,
}

impl SessionCtx {
    fn record(
        &self,
        m: &mut Machine,
        outcome: Outcome,
    ) -> crate::snapshot::health_check::Transition {
        let h = &self.stats.health;
        match outcome {
            Outcome::Pass { .. } => {
                h.success.fetch_add(1, Relaxed);
                self.stats.outlier.check_passed(&self.addr);
            }
            _ => {
                h.failure.fetch_add(1, Relaxed);
            }
        };
        match outcome {
            Outcome::Network | Outcome::Timeout => {
                h.network_failure.fetch_add(1, Relaxed);
            }
            Outcome::Passive => {
                h.passive_failure.fetch_add(1, Relaxed);
            }
            _ => {}
        }
        let t = m.apply(outcome, &self.cfg);
        self.checked.store(true, Relaxed);
        if h.report(&self.addr, m.flags, t) {
            self.changes.push(&self.cluster);
        }
        t
    }
}

async fn run_session(ctx: SessionCtx, mut passive: mpsc::UnboundedReceiver<()>) {
    let mut m = Machine::default();
    let mut conn: Option<Conn> = None;
    let mut delay = initial_delay(&ctx.cfg, || fastrand::u64(..));
    loop {
        let until = tokio::time::Instant::now() + delay;
        loop {
            tokio::select! {
                _ = tokio::time::sleep_until(until) => break,
                Some(()) = passive.recv() => { ctx.record(&mut m, Outcome::Passive); }
            }
        }
        ctx.stats.health.attempt.fetch_add(1, Relaxed);
        let outcome = {
            let check = tokio::time::timeout(ctx.cfg.timeout, check_once(&ctx, &mut conn));
            tokio::pin!(check);
            loop {
                tokio::select! {
                    r = &mut check => break r.unwrap_or(Outcome::Timeout),
                    Some(()) = passive.recv() => { ctx.record(&mut m, Outcome::Passive); }
                }
            }
        };
        if outcome == Outcome::Timeout {
            // Envoy closes the connection of a check that timed out.
            conn = None;
        }
        let t = ctx.record(&mut m, outcome);
        let traffic = ctx.stats.rq_total.load(Relaxed) > 0;
        let healthy = matches!(outcome, Outcome::Pass { .. });
        delay = next_interval(&ctx.cfg, healthy, t, traffic, || fastrand::u64(..));
    }
}

async fn check_once(ctx: &SessionCtx, conn: &mut Option<Conn>) -> Outcome {
    match &ctx.cfg.kind {
        CheckKind::Tcp => match tokio::net::TcpStream::connect(ctx.target).await {
            // Connect-only: the handshake is the check; the socket closes on drop.
            Ok(_) => Outcome::Pass { degraded: false },
            Err(_) => Outcome::Network,
        },
        CheckKind::Http(h) => http_check(ctx, h, conn).await,
    }
}

/// An HTTP connection kept between checks (`reuse_connection`), with its driver task.
struct Conn {
    sender: Sender,
    driver: JoinHandle<()>,
}

enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Empty<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Empty<Bytes>>),
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Conn {
    fn usable(&self) -> bool {
        match &self.sender {
            Sender::H1(s) => !s.is_closed(),
            Sender::H2(s) => !s.is_closed(),
        }
    }
}

async fn connect(target: SocketAddr, http2: bool) -> Option<Conn> {
    let tcp = tokio::net::TcpStream::connect(target).await.ok()?;
    let _ = tcp.set_nodelay(true);
    let io = hyper_util::rt::TokioIo::new(tcp);
    if http2 {
        let (sender, c) =
            hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                .await
                .ok()?;
        let driver = tokio::spawn(async move {
            let _ = c.await;
        });
        Some(Conn {
            sender: Sender::H2(sender),
            driver,
        })
    } else {
        let (sender, c) = hyper::client::conn::http1::handshake(io).await.ok()?;
        let driver = tokio::spawn(async move {
            let _ = c.await;
        });
        Some(Conn {
            sender: Sender::H1(sender),
            driver,
        })
    }
}

async fn http_check(ctx: &SessionCtx, h: &HttpCheck, conn: &mut Option<Conn>) -> Outcome {
    if !conn.as_ref().is_some_and(Conn::usable) {
        *conn = None;
        match connect(ctx.target, h.http2).await {
            Some(c) => *conn = Some(c),
            None => return Outcome::Network,
        }
    }
    let Some(c) = conn.as_mut() else {
        return Outcome::Network;
    };
    let Ok(req) = request(ctx, h) else {
        // The path and authority were validated as header values; nothing else can fail.
        return Outcome::Network;
    };
    let sent = match &mut c.sender {
        Sender::H1(s) => s.send_request(req).await,
        Sender::H2(s) => s.send_request(req).await,
    };
    let resp = match sent {
        Ok(r) => r,
        Err(_) => {
            *conn = None;
            return Outcome::Network;
        }
    };
    let status = resp.status().as_u16();
    let has = |n: &str| resp.headers().contains_key(n);
    let immediate = has("x-envoy-immediate-health-check-fail");
    let degraded = has("x-envoy-degraded");
    let close = resp
        .headers()
        .get(http::header::CONNECTION)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("close"));
    // The result is known once the whole answer is in; a reset before is a network failure.
    if resp.into_body().collect().await.is_err() {
        *conn = None;
        return Outcome::Network;
    }
    if close || !ctx.cfg.reuse_connection {
        *conn = None;
    }
    if !h.expects(status) {
        return Outcome::Active {
            retriable: h.retries(status),
            immediate,
        };
    }
    Outcome::Pass { degraded }
}

/// The check request as Envoy sends it: the method, `:authority`, path and `user-agent:
/// Envoy/HC`, then the configured header mutations.
fn request(ctx: &SessionCtx, h: &HttpCheck) -> Result<http::Request<Empty<Bytes>>, http::Error> {
    let mut b = http::Request::builder().method(h.method.clone());
    if h.http2 {
        b = b.uri(format!("http://{}{}", ctx.authority, h.path));
    } else {
        b = b
            .uri(h.path.as_str())
            .header(http::header::HOST, ctx.authority.as_str());
    }
    let mut req = b
        .header(http::header::USER_AGENT, "Envoy/HC")
        .body(Empty::new())?;
    // Envoy evaluates formatters against a loopback "downstream" for health checks.
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let fctx = crate::snapshot::headers::FormatCtx {
        remote: Some(loopback),
        direct_remote: Some(loopback),
        local: Some(loopback),
    };
    h.headers.ops.apply(req.headers_mut(), None, &fctx);
    Ok(req)
}
