//! Binds and unbinds LDS listeners at runtime and feeds accepted connections to pingora.
//!
//! Sockets are bound on the control thread when a listener is accepted (so a bind failure can
//! NACK the push), and served once the listener is warm by one accept loop per worker, as
//! Envoy's workers each accept on every listener. A connection stays on the worker that
//! accepted it, so its tasks never cross threads.
//!
//! A connection also stays on the filter chain it was accepted on: each chain has its own
//! pingora apps (one per worker) whose `Gateway` holds the chain (`PinnedChain`), and the
//! connection is served by them until it closes. A push that keeps a chain's config keeps its
//! `Arc<ChainDef>` and so its apps and connections, wherever it moves in the list; a push that
//! changes or removes a chain drains its connections (`--drain-strategy`, `--drain-time-s`), as
//! Envoy's in-place filter chain update does.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::{ArcSwap, ArcSwapOption};
use pingora_core::apps::{HttpServerApp, HttpServerOptions, ServerApp};
use pingora_core::server::configuration::ServerConf;
use pingora_proxy::HttpProxy;
use std::sync::atomic::Ordering::Relaxed;
use tokio::runtime::Handle;
use tokio::sync::watch;

use super::{Drain, Gateway, PinnedChain};
use crate::snapshot::listener::{Codec, ListenAddr, NetworkFilter};
use crate::snapshot::{ActiveChain, ActiveListener, Snapshot};
use crate::State;

struct Running {
    /// Every address it serves (sorted): a change of addresses restarts the listener, whose
    /// sockets all drain together.
    addrs: Vec<SocketAddr>,
    /// The listener as last reconciled.
    listener: Arc<ActiveListener>,
    /// Tells the accept loops to stop.
    shutdown: watch::Sender<bool>,
    /// The chains served, in the listener's order.
    chains: Vec<RunningChain>,
    /// What each worker's accept loop picks chains from, swapped when the chains change.
    served: Vec<Arc<ArcSwap<Served>>>,
    /// `listener.<address>.*`: its open connections, for the shutdown's wait.
    stats: Arc<crate::admin::stats::ListenerStats>,
    /// `/drain_listeners` drains it: its chains' connections are let go.
    drained: bool,
    /// It accepts no more connections (`/drain_listeners`, shutdown): its sockets are closed
    /// and pushes no longer change it, as Envoy's stopped listeners.
    stopped: bool,
}

/// One filter chain being served, on every worker. A push that keeps the chain (the same
/// `Arc<ChainDef>`) keeps this too, wherever the chain moves in the list; a push that changes
/// or removes it drains it, and a changed chain starts afresh beside its draining self.
struct RunningChain {
    pinned: Arc<PinnedChain>,
    signals: Arc<DrainSignals>,
    /// One per worker (each has its own upstream connection pool, as Envoy's workers do, so
    /// a pooled connection is never handed between threads).
    workers: Vec<Arc<ChainServer>>,
}

/// How a chain's connections learn that it drains.
struct DrainSignals {
    /// HTTP connections are told (pingora's shutdown watch: `connection: close` on the next
    /// HTTP/1 response, GOAWAY on HTTP/2): when the drain starts with the immediate strategy,
    /// when it ends with the gradual one.
    tell: watch::Sender<bool>,
    /// The drain time is over: what is left closes (tcp_proxy connections at once).
    close: watch::Sender<bool>,
    /// HTTP/1 connections idle between requests close now (with `Apps::close_idle`, which
    /// wakes those pingora holds).
    idle: watch::Sender<bool>,
}

/// What one worker serves a chain's connections with.
struct ChainServer {
    /// None: a tcp_proxy chain.
    apps: Option<Apps>,
    stats: ChainStats,
    signals: Arc<DrainSignals>,
}

/// One worker's view of a listener: the listener as last reconciled, and its chains' servers
/// in the same order as `listener.chains`.
struct Served {
    listener: Arc<ActiveListener>,
    chains: Vec<Arc<ChainServer>>,
}

fn sorted_addrs(l: &ActiveListener) -> Vec<SocketAddr> {
    let mut a: Vec<SocketAddr> = l.def.bind_addrs().iter().map(|b| b.addr).collect();
    a.sort();
    a
}

/// One pingora app per protocol: HTTP/1 and h2c. Portico reads the first bytes itself to pick
/// one, because pingora's own h2c detection waits for 24 bytes and so hangs on shorter HTTP/1
/// requests.
#[derive(Clone)]
struct Apps {
    h1: Arc<HttpProxy<Gateway>>,
    /// Portico's own loop for the HTTP/1.1 requests it serves (`h1`).
    driver: Arc<super::h1::Driver>,
    h2c: Option<Arc<HttpProxy<Gateway>>>,
}

impl Apps {
    /// Wakes the connections idling between requests so they close now.
    async fn close_idle(&self) {
        self.h1.http_cleanup().await;
        if let Some(h2c) = &self.h2c {
            h2c.http_cleanup().await;
        }
    }
}

/// The listeners being served. Shared between the commit point (which reconciles them with
/// each snapshot) and the admin and signal handlers (which drain and stop them); the lock is
/// never taken on the request path.
#[derive(Clone)]
pub struct ListenerManager {
    inner: Arc<std::sync::Mutex<Inner>>,
}

/// What `/drain_listeners` asks (Envoy's query flags).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainRequest {
    /// `inboundonly`: only listeners whose `traffic_direction` is INBOUND.
    pub inbound_only: bool,
    /// `graceful`: the listeners keep accepting while their connections drain
    /// (`--drain-time-s`, `--drain-strategy`), and stop when the drain time is over.
    pub graceful: bool,
    /// `skip_exit`: after a graceful drain the listeners keep accepting.
    pub skip_exit: bool,
}

struct Inner {
    workers: Vec<Handle>,
    state: Arc<State>,
    conf: Arc<ServerConf>,
    bound: HashMap<SocketAddr, std::net::TcpListener>,
    running: HashMap<String, Running>,
    drain: Drain,
    /// Chains whose connections are draining, while any connection holds them: RDS pushes
    /// still reach them, as Envoy's draining listeners keep their route providers.
    draining: Vec<std::sync::Weak<PinnedChain>>,
    /// Listeners of these directions were stopped: new ones of them are not started (Envoy
    /// allows no listener additions in a stopped direction).
    stopped_inbound: bool,
    stopped_all: bool,
}

impl ListenerManager {
    pub fn new(workers: Vec<Handle>, state: Arc<State>) -> ListenerManager {
        ListenerManager {
            inner: Arc::new(std::sync::Mutex::new(Inner::new(workers, state))),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while reconciling leaves the listeners as they were: carry on with them.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `--drain-time-s` and `--drain-strategy`.
    pub fn with_drain(self, drain: Drain) -> ListenerManager {
        self.lock().drain = drain;
        self
    }

    pub fn prepare(&mut self, wanted: &BTreeMap<String, Vec<ListenAddr>>) -> Vec<(String, String)> {
        self.lock().prepare(wanted)
    }

    pub fn reconcile(&mut self, snap: &Snapshot) {
        self.lock().reconcile(snap)
    }

    /// `POST /drain_listeners`: the matching listeners' connections drain now; the listeners
    /// stop accepting now, or with `graceful` once the drain time is over (never with
    /// `skip_exit`).
    pub fn drain_listeners(&self, req: DrainRequest) {
        let (names, time) = {
            let mut inner = self.lock();
            let names = inner.drain_listeners(req.inbound_only);
            if !req.graceful {
                inner.stop_listeners(&names, req.inbound_only);
            }
            (names, inner.drain.time)
        };
        if req.graceful && !req.skip_exit {
            let me = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(time).await;
                me.lock().stop_listeners(&names, req.inbound_only);
            });
        }
    }

    /// SIGTERM: every listener stops accepting, every connection is told to close (HTTP/1
    /// after its response in flight, HTTP/2 by GOAWAY, idle ones now); returns once none is
    /// open or `limit` has passed, when what is left is closed.
    pub async fn shutdown(&self, limit: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        let stats = {
            let mut inner = self.lock();
            let names: Vec<String> = inner.running.keys().cloned().collect();
            inner.stop_listeners(&names, false);
            let workers = inner.workers.clone();
            for r in inner.running.values() {
                for c in &r.chains {
                    c.tell_now(&workers);
                }
            }
            inner
                .running
                .values()
                .map(|r| r.stats.clone())
                .collect::<Vec<_>>()
        };
        let open = || stats.iter().map(|s| s.cx_active.load(Relaxed)).sum::<u64>();
        while open() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        let left = open();
        if left > 0 {
            tracing::info!(connections = left, "drain time over: closing what is left");
        }
        let inner = self.lock();
        for r in inner.running.values() {
            for c in &r.chains {
                let _ = c.signals.close.send(true);
            }
        }
    }
}

impl std::fmt::Debug for ListenerManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ListenerManager")
    }
}

impl crate::ListenerControl for ListenerManager {
    fn drain_listeners(&self, inbound_only: bool, graceful: bool, skip_exit: bool) {
        ListenerManager::drain_listeners(
            self,
            DrainRequest {
                inbound_only,
                graceful,
                skip_exit,
            },
        )
    }
}

impl Inner {
    fn new(workers: Vec<Handle>, state: Arc<State>) -> Inner {
        let conf = ServerConf {
            threads: workers.len(),
            // Idle upstream connections kept per worker. pingora's default of 128 closes every
            // connection beyond it after one request, so 50 h2 clients x 10 streams opened a new
            // upstream connection per request. Envoy keeps idle connections without a count
            // limit; this bounds memory at a few MB per worker.
            upstream_keepalive_pool_size: 4096,
            ..ServerConf::default()
        };
        Inner {
            workers,
            state,
            conf: Arc::new(conf),
            bound: HashMap::new(),
            running: HashMap::new(),
            drain: Drain::default(),
            draining: Vec::new(),
            stopped_inbound: false,
            stopped_all: false,
        }
    }

    /// Drains the chains of the listeners `/drain_listeners` names; returns their names.
    fn drain_listeners(&mut self, inbound_only: bool) -> Vec<String> {
        let (workers, drain) = (self.workers.clone(), self.drain);
        let mut names = Vec::new();
        for (name, r) in &mut self.running {
            if inbound_only && !r.listener.def.is_inbound() {
                continue;
            }
            names.push(name.clone());
            if std::mem::replace(&mut r.drained, true) {
                continue;
            }
            tracing::info!(listener = %name, "draining (drain_listeners)");
            for c in &r.chains {
                c.begin_drain(&workers, drain);
            }
        }
        names
    }

    /// The listeners stop accepting: their accept loops end and their sockets close.
    fn stop_listeners(&mut self, names: &[String], inbound_only: bool) {
        if inbound_only {
            self.stopped_inbound = true;
        } else {
            self.stopped_all = true;
        }
        for name in names {
            if let Some(r) = self.running.get_mut(name) {
                if !std::mem::replace(&mut r.stopped, true) {
                    tracing::info!(listener = %name, "listener stopped");
                    let _ = r.shutdown.send(true);
                }
            }
        }
        self.release_unserved_sockets();
    }

    /// Closes the sockets no accepting listener uses.
    fn release_unserved_sockets(&mut self) {
        let serving: Vec<SocketAddr> = self
            .running
            .values()
            .filter(|r| !r.stopped)
            .flat_map(|r| r.addrs.iter().copied())
            .collect();
        self.bound.retain(|addr, _| serving.contains(addr));
    }

    /// Checks that every address not served yet can be bound, so a conflict NACKs the push.
    /// Like Envoy, a listener does not accept connections until it is warm, so the check
    /// binds and releases; `reconcile` binds for real when the listener becomes active.
    /// A listener with several addresses is refused whole when any of them cannot be bound;
    /// the trial sockets are held until the end, so two new addresses that exclude each other
    /// (`[::]:P` with `ipv4_compat` beside `0.0.0.0:P`) are caught here too.
    pub fn prepare(&mut self, wanted: &BTreeMap<String, Vec<ListenAddr>>) -> Vec<(String, String)> {
        let mut errors = Vec::new();
        let mut held = Vec::new();
        for (name, addrs) in wanted {
            let mut mine = Vec::new();
            let failed = addrs
                .iter()
                .filter(|a| !self.bound.contains_key(&a.addr))
                .find_map(|a| match bind(a) {
                    Ok(sock) => {
                        mine.push(sock);
                        None
                    }
                    Err(e) => Some(format!("listener '{name}': cannot bind {}: {e}", a.addr)),
                });
            match failed {
                Some(e) => errors.push((name.clone(), e)),
                None => held.extend(mine),
            }
        }
        errors
    }

    /// Starts accept loops for listeners that became active, stops removed ones, updates the
    /// chains of the others in place (as Envoy's filter-chain-only update: kept chains keep
    /// their connections, changed and removed ones drain), and closes sockets no running
    /// listener uses any more.
    pub fn reconcile(&mut self, snap: &Snapshot) {
        let (workers, drain) = (self.workers.clone(), self.drain);
        let draining = &mut self.draining;
        self.running.retain(|name, r| {
            // A stopped listener stays as it is until a push removes it.
            let keep = snap
                .listeners
                .get(name)
                .is_some_and(|l| r.stopped || sorted_addrs(l) == r.addrs);
            if !keep {
                tracing::info!(listener = %name, addrs = ?r.addrs, "listener stopped; draining open connections");
                let _ = r.shutdown.send(true);
                for c in r.chains.drain(..) {
                    draining.push(Arc::downgrade(&c.pinned));
                    c.begin_drain(&workers, drain);
                }
            }
            keep
        });
        for (name, l) in &snap.listeners {
            match self.running.get(name) {
                Some(r) if Arc::ptr_eq(&r.listener, l) => continue,
                // Stopped listeners are not changed any more, as in Envoy.
                Some(r) if r.stopped => continue,
                Some(_) => {
                    self.update_chains(name, l);
                    continue;
                }
                None => {}
            }
            if self.stopped_all || (self.stopped_inbound && l.def.is_inbound()) {
                tracing::warn!(listener = %name, "listeners of this traffic direction were stopped (drain_listeners): not starting it");
                continue;
            }
            if !l.def.bind_to_port {
                // Envoy keeps such a listener without a socket: only connections handed over
                // by their original destination reach it, and Portico hands none over.
                continue;
            }
            let binds = l.def.bind_addrs();
            let mut socks: Vec<Vec<std::net::TcpListener>> = Vec::with_capacity(binds.len());
            for b in &binds {
                if let std::collections::hash_map::Entry::Vacant(slot) = self.bound.entry(b.addr) {
                    match bind(b) {
                        Ok(sock) => {
                            slot.insert(sock);
                        }
                        Err(e) => {
                            tracing::error!(listener = %name, addr = %b.addr, "cannot bind: {e}");
                            break;
                        }
                    }
                }
                // One duplicate of the socket per worker.
                match self.bound.get(&b.addr).and_then(|s| {
                    self.workers
                        .iter()
                        .map(|_| s.try_clone().ok())
                        .collect::<Option<Vec<_>>>()
                }) {
                    Some(per_worker) => socks.push(per_worker),
                    None => {
                        tracing::error!(listener = %name, addr = %b.addr, "cannot share the listening socket");
                        break;
                    }
                }
            }
            if socks.len() != binds.len() {
                // Not served at all rather than on some of its addresses; the sockets bound
                // for it are closed below with the others no listener serves.
                continue;
            }
            let (tx, rx) = watch::channel(false);
            let chains: Vec<RunningChain> =
                l.chains.iter().map(|c| self.new_chain(name, c)).collect();
            let served: Vec<Arc<ArcSwap<Served>>> = (0..self.workers.len())
                .map(|w| Arc::new(ArcSwap::from_pointee(served_by(l, &chains, w))))
                .collect();
            let addrs: Vec<SocketAddr> = binds.iter().map(|b| b.addr).collect();
            tracing::info!(listener = %name, ?addrs, "listener serving");
            let stats = self.state.stats.listener(&l.def.stat_name);
            for per_worker in socks {
                for ((w, sock), served) in self.workers.iter().zip(per_worker).zip(&served) {
                    let conn = Conns {
                        listener: name.clone(),
                        stats: stats.clone(),
                        state: self.state.clone(),
                        served: served.clone(),
                    };
                    w.spawn(accept_loop(sock, conn, rx.clone()));
                }
            }
            self.running.insert(
                name.clone(),
                Running {
                    addrs: sorted_addrs(l),
                    listener: l.clone(),
                    shutdown: tx,
                    chains,
                    served,
                    stats,
                    drained: false,
                    stopped: false,
                },
            );
        }
        self.refresh_draining(snap);
        // Last, so a listener replaced at the same address reuses the socket.
        self.release_unserved_sockets();
    }

    /// A push changed the listener but not its addresses: its chains are matched to the
    /// running ones by identity; the kept ones carry on, the others drain, new ones start.
    fn update_chains(&mut self, name: &str, l: &Arc<ActiveListener>) {
        let Some(mut old) = self
            .running
            .get_mut(name)
            .map(|r| std::mem::take(&mut r.chains))
        else {
            return;
        };
        let mut chains = Vec::with_capacity(l.chains.len());
        for active in &l.chains {
            match old
                .iter()
                .position(|c| Arc::ptr_eq(&c.pinned.def, &active.def))
            {
                Some(i) => {
                    let kept = old.swap_remove(i);
                    kept.pinned.last.store(active.clone());
                    chains.push(kept);
                }
                None => chains.push(self.new_chain(name, active)),
            }
        }
        if !old.is_empty() {
            tracing::info!(listener = %name, chains = old.len(), "filter chains changed or removed; draining their connections");
        }
        for gone in old {
            self.draining.push(Arc::downgrade(&gone.pinned));
            gone.begin_drain(&self.workers, self.drain);
        }
        let Some(r) = self.running.get_mut(name) else {
            return;
        };
        for (w, served) in r.served.iter().enumerate() {
            served.store(Arc::new(served_by(l, &chains, w)));
        }
        r.chains = chains;
        r.listener = l.clone();
    }

    /// Draining chains that take their routes over RDS get the table `snap` has under that
    /// name (from any chain serving it); chains no connection holds any more are forgotten.
    fn refresh_draining(&mut self, snap: &Snapshot) {
        use crate::snapshot::listener::RouteSource;
        self.draining.retain(|weak| {
            let Some(pinned) = weak.upgrade() else {
                return false;
            };
            let Some(RouteSource::Rds(name)) = pinned.def.hcm().map(|h| &h.routes) else {
                return true;
            };
            let current = snap
                .listeners
                .values()
                .flat_map(|l| &l.chains)
                .find(|c| matches!(c.def.hcm().map(|h| &h.routes), Some(RouteSource::Rds(n)) if n == name))
                .map(|c| &c.routes);
            let last = pinned.last.load();
            if let Some(routes) = current.filter(|r| !Arc::ptr_eq(r, &last.routes)) {
                pinned.last.store(Arc::new(ActiveChain {
                    def: last.def.clone(),
                    routes: routes.clone(),
                    tls: last.tls.clone(),
                    secrets: last.secrets.clone(),
                }));
            }
            true
        });
    }

    /// Everything a chain is served with, on every worker.
    fn new_chain(&self, listener: &str, active: &Arc<ActiveChain>) -> RunningChain {
        let pinned = Arc::new(PinnedChain {
            listener: listener.to_string(),
            def: active.def.clone(),
            last: ArcSwap::new(active.clone()),
            draining: ArcSwapOption::empty(),
            close_all: Default::default(),
            drain: self.drain,
        });
        let signals = Arc::new(DrainSignals {
            tell: watch::channel(false).0,
            close: watch::channel(false).0,
            idle: watch::channel(false).0,
        });
        let app = |hcm: &crate::snapshot::listener::Hcm, h2c: bool| {
            let mut proxy = HttpProxy::new(
                Gateway {
                    chain: pinned.clone(),
                    state: self.state.clone(),
                    hcm_stats: self.state.stats.hcm(&hcm.stat_prefix),
                },
                self.conf.clone(),
            );
            let mut opts = HttpServerOptions::default();
            opts.h2c = h2c;
            // An HTTP/2 connection with no stream in flight closes after the connection
            // manager's idle_timeout (with Envoy's drain, as for HTTP/1).
            opts.h2_idle_timeout = hcm.idle_timeout;
            proxy.server_options = Some(opts);
            proxy.h2_options = Some(h2_options(&hcm.h2));
            proxy.handle_init_modules();
            Arc::new(proxy)
        };
        let workers = self
            .workers
            .iter()
            .map(|_| {
                let stats = match &active.def.filter {
                    NetworkFilter::Http(hcm) => {
                        let s = self.state.stats.hcm(&hcm.stat_prefix);
                        if hcm.has_fault_filter() {
                            // Envoy creates the fault stats with the filter, so they show
                            // before any fault.
                            s.fault.enabled.store(true, Relaxed);
                        }
                        ChainStats::Http(s)
                    }
                    // Created with the chain, so Envoy's zeros show before any connection.
                    NetworkFilter::Tcp(t) => ChainStats::Tcp(self.state.stats.tcp(&t.stat_prefix)),
                };
                Arc::new(ChainServer {
                    apps: active.def.hcm().map(|h| {
                        let h1 = app(h, false);
                        let gw = Gateway {
                            chain: pinned.clone(),
                            state: self.state.clone(),
                            hcm_stats: self.state.stats.hcm(&h.stat_prefix),
                        };
                        Apps {
                            driver: Arc::new(super::h1::Driver::new(gw, h1.clone(), &self.conf)),
                            h1,
                            h2c: (h.codec != Codec::Http1).then(|| app(h, true)),
                        }
                    }),
                    stats,
                    signals: signals.clone(),
                })
            })
            .collect();
        RunningChain {
            pinned,
            signals,
            workers,
        }
    }
}

/// One worker's chains of `l`, in the listener's order.
fn served_by(l: &Arc<ActiveListener>, chains: &[RunningChain], worker: usize) -> Served {
    Served {
        listener: l.clone(),
        chains: chains
            .iter()
            .filter_map(|c| c.workers.get(worker).cloned())
            .collect(),
    }
}

impl RunningChain {
    /// Drains the chain's connections (once) as Envoy drains a changed or removed filter
    /// chain: told now (immediate) or each response with growing odds (gradual), and whatever
    /// is left closed when the drain time is over. The chain may still take connections
    /// meanwhile (a graceful `/drain_listeners`); they drain alike.
    fn begin_drain(&self, workers: &[Handle], drain: Drain) {
        if self.pinned.draining.load().is_some() {
            return;
        }
        self.pinned
            .draining
            .store(Some(Arc::new(std::time::Instant::now())));
        if drain.immediate {
            self.pinned.close_all.store(true, Relaxed);
            let _ = self.signals.tell.send(true);
        }
        let apps: Vec<Option<Apps>> = self.workers.iter().map(|s| s.apps.clone()).collect();
        let signals = self.signals.clone();
        let pinned = self.pinned.clone();
        let workers = workers.to_vec();
        tokio::spawn(async move {
            tokio::time::sleep(drain.time).await;
            pinned.close_all.store(true, Relaxed);
            let _ = signals.tell.send(true);
            let _ = signals.close.send(true);
            let _ = signals.idle.send(true);
            for (w, apps) in workers.iter().zip(apps) {
                if let Some(apps) = apps {
                    w.spawn(async move { apps.close_idle().await });
                }
            }
        });
    }

    /// Shutting down: every connection is told to close now, and idle ones are closed.
    fn tell_now(&self, workers: &[Handle]) {
        if self.pinned.draining.load().is_none() {
            self.pinned
                .draining
                .store(Some(Arc::new(std::time::Instant::now())));
        }
        self.pinned.close_all.store(true, Relaxed);
        let _ = self.signals.tell.send(true);
        let _ = self.signals.idle.send(true);
        for (w, s) in workers.iter().zip(&self.workers) {
            if let Some(apps) = s.apps.clone() {
                w.spawn(async move { apps.close_idle().await });
            }
        }
    }
}

fn bind(a: &ListenAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let sock = Socket::new(Domain::for_address(a.addr), Type::STREAM, None)?;
    // As std does on Unix, so a restart does not wait out TIME_WAIT.
    sock.set_reuse_address(true)?;
    if a.addr.is_ipv6() {
        // Set either way: the system default (net.ipv6.bindv6only) must not decide whether
        // `[::]:P` also takes IPv4 and so collides with `0.0.0.0:P`.
        sock.set_only_v6(a.v6only)?;
    }
    sock.bind(&a.addr.into())?;
    // The kernel caps it at net.core.somaxconn.
    sock.listen(4096)?;
    sock.set_nonblocking(true)?;
    Ok(sock.into())
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Whether the connection starts with the HTTP/2 preface. Peeks only as far as needed: the
/// first byte that differs from the preface settles it, so short HTTP/1 requests never wait.
async fn starts_with_h2_preface(stream: &tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; 24];
    loop {
        let n = match stream.peek(&mut buf).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => n,
        };
        if buf[..n] != H2_PREFACE[..n] {
            return false;
        }
        if n == H2_PREFACE.len() {
            return true;
        }
        // A partial preface: wait for more bytes (peek returns at once while data is queued).
        if stream.readable().await.is_err() {
            return false;
        }
        tokio::task::yield_now().await;
    }
}

/// What an accept loop hands each connection: the listener's chains as this worker serves
/// them (swapped when a push changes them).
#[derive(Clone)]
struct Conns {
    listener: String,
    /// `listener.<address>.*`.
    stats: Arc<crate::admin::stats::ListenerStats>,
    state: Arc<State>,
    served: Arc<ArcSwap<Served>>,
}

/// A chain's stats scope: `http.<prefix>` or `tcp.<prefix>`.
enum ChainStats {
    Http(Arc<crate::admin::stats::HcmStats>),
    Tcp(Arc<crate::admin::stats::TcpStats>),
}

/// Serves one accepted connection.
///
/// A task is as large as its largest step for as long as it lives, and most of an HTTP
/// connection's life is spent idle in a keep-alive: so the steps before HTTP (listener
/// filters, TLS handshake, network policy, or all of a tcp_proxy connection) run in their
/// own boxed future, freed before the HTTP serving starts.
async fn serve_connection(tcp: tokio::net::TcpStream, peer: SocketAddr, conns: Conns) {
    let Some(c) = Box::pin(open_connection(tcp, peer, conns)).await else {
        return;
    };
    if c.h1_only {
        serve_h1(&c.app, &c.driver, c.stream, c.told, c.idle).await;
    } else {
        let mut stream = c.stream;
        while let Some(next) = c.app.process_new(stream, &c.told).await {
            stream = next;
        }
    }
    if let Some(limits) = c.limited {
        limits.closed();
    }
    if c.tls {
        c.stats.cx_ssl_active.fetch_sub(1, Relaxed);
    }
}

/// An HTTP connection ready for pingora.
struct HttpConn {
    app: Arc<HttpProxy<Gateway>>,
    driver: Arc<super::h1::Driver>,
    stream: pingora_core::protocols::Stream,
    told: watch::Receiver<bool>,
    idle: watch::Receiver<bool>,
    /// HTTP/1.1 (not h2c, not HTTP/2 by ALPN).
    h1_only: bool,
    limited: Option<Arc<super::conn::ConnState>>,
    stats: Arc<crate::live::HcmStats>,
    tls: bool,
}

/// Everything before HTTP: listener filters, chain selection, TLS, network policy; a
/// tcp_proxy chain's connection is served here to its end (None).
async fn open_connection(
    mut tcp: tokio::net::TcpStream,
    mut peer: SocketAddr,
    conns: Conns,
) -> Option<HttpConn> {
    // A connection's age (`max_connection_duration`) counts from here, before any wait for
    // the client's first bytes.
    let accepted = std::time::Instant::now();
    let _ = tcp.set_nodelay(true);
    // The destination a PROXY header restored (None: the socket's own local address).
    let mut local = None;
    // The chain is chosen once, from one view of the listener, and kept for the connection's
    // life: its certificate, and the pingora app (the Gateway holding the chain) that serves
    // every request on it.
    let (active, server) = {
        let served = conns.served.load_full();
        let l = &served.listener;
        let hello = if l.def.listener_filters.is_empty() {
            Default::default()
        } else {
            let run = Box::pin(run_listener_filters(
                &mut tcp, &l.def, &mut peer, &mut local,
            ));
            let done = match l.def.listener_filters_timeout {
                Some(t) => tokio::time::timeout(t, run).await.map_err(|_| ()),
                None => Ok(run.await),
            };
            match done {
                Ok(Some(hello)) => hello,
                // The filters closed the connection.
                Ok(None) => return None,
                // Envoy closes the connection, unless told to carry on without the filters.
                Err(()) if l.def.continue_on_listener_filters_timeout => Default::default(),
                Err(()) => return None,
            }
        };
        // The listener filters may have waited: pick from the chains in force now.
        let served = conns.served.load_full();
        let l = &served.listener;
        let port = local
            .or_else(|| tcp.local_addr().ok())
            .map_or(l.def.addr.port(), |a| a.port());
        let conn = crate::snapshot::filter_chain::Conn {
            destination_port: port,
            server_name: &hello.server_name,
            transport_protocol: if hello.tls { "tls" } else { "raw_buffer" },
            application_protocols: &hello.alpn,
        };
        let Some(i) = l.def.select_chain(&conn) else {
            tracing::debug!(listener = %conns.listener, %peer, "no filter chain matches; closing");
            conns.stats.no_filter_chain_match.fetch_add(1, Relaxed);
            let local = local.or_else(|| tcp.local_addr().ok());
            crate::telemetry::access_log::log_unmatched(
                &l.def.access_log,
                peer,
                local,
                &hello.server_name,
            );
            return None;
        };
        let chosen = match (l.chains.get(i), served.chains.get(i)) {
            (Some(c), Some(s)) => (c.clone(), s.clone()),
            _ => return None,
        };
        // The chain's network policy filters (RBAC, ext_authz), once for the connection
        // (Envoy's ONE_TIME_ON_FIRST_BYTE): a denied connection is closed before anything is
        // read. A chain that terminates TLS decides after the handshake, when the client's
        // certificate (`authenticated`) is known, as Envoy's filters see the decrypted bytes.
        if !chosen.0.def.policy.is_empty() && chosen.0.tls.is_none() {
            let local = local.or_else(|| tcp.local_addr().ok());
            let view = crate::filters::Connection {
                direct_remote: Some(peer),
                remote: Some(peer.ip()),
                local,
                sni: (!hello.server_name.is_empty()).then_some(hello.server_name.as_str()),
                peer: None,
                tls: hello.tls,
            };
            if !network_policy_allows(&chosen.0.def, &view, &conns.state).await {
                tracing::debug!(listener = %conns.listener, %peer, "connection denied by a network policy filter");
                return None;
            }
        }
        chosen
    };
    // Told when the chain's drain ends, or (immediate strategy) starts.
    let told = server.signals.tell.subscribe();
    let stats = match &server.stats {
        ChainStats::Http(s) => s,
        ChainStats::Tcp(s) => {
            if let Some(proxy) = active.def.tcp() {
                let snap = conns.state.snapshot();
                // Closed when the drain time of its chain (or listener) is over.
                let close = server.signals.close.subscribe();
                let local = local.or_else(|| tcp.local_addr().ok());
                let istio = active
                    .def
                    .istio_stats
                    .as_deref()
                    .map(|c| (c, &conns.state.istio));
                match &active.tls {
                    // Istio's `tls.mode: SIMPLE` on a TLS server with tcp routes: the chain
                    // terminates TLS and proxies the plaintext.
                    Some(tls) => match with_timeout(
                        active.def.handshake_timeout,
                        super::tls::handshake(tcp, tls, Codec::Http1),
                    )
                    .await
                    {
                        Ok((session, _)) => {
                            let c = session.get_ref().1;
                            super::tls::count_handshake(&conns.stats.ssl, c);
                            if !active.def.policy.is_empty() {
                                let cert = c.peer_certificates().and_then(|chain| {
                                    super::client_cert::PeerCert::from_chain(
                                        chain,
                                        tls.local_uris.clone(),
                                    )
                                });
                                let view = crate::filters::Connection {
                                    direct_remote: Some(peer),
                                    remote: Some(peer.ip()),
                                    local,
                                    sni: c.server_name(),
                                    peer: cert
                                        .as_ref()
                                        .map(|p| p as &(dyn crate::filters::PeerIdentity + Sync)),
                                    tls: true,
                                };
                                if !Box::pin(network_policy_allows(
                                    &active.def,
                                    &view,
                                    &conns.state,
                                ))
                                .await
                                {
                                    tracing::debug!(listener = %conns.listener, %peer, "connection denied by a network policy filter");
                                    return None;
                                }
                            }
                            super::tcp::serve(session, (peer, local), proxy, snap, s, close, istio)
                                .await;
                        }
                        Err(e) => {
                            super::tls::count_failure(&conns.stats.ssl, &e);
                            tracing::debug!(listener = %conns.listener, %peer, "TLS handshake failed: {e}");
                        }
                    },
                    None => {
                        Box::pin(super::tcp::serve(
                            tcp,
                            (peer, local),
                            proxy,
                            snap,
                            s,
                            close,
                            istio,
                        ))
                        .await
                    }
                }
            }
            return None;
        }
    };
    let Some(apps) = &server.apps else {
        return None;
    };
    stats
        .cx_total
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut limited = None;
    let h1_only;
    let (app, stream): (_, pingora_core::protocols::Stream) = match &active.tls {
        Some(tls) => {
            // Envoy's connection manager exists before the handshake, so failed ones count.
            stats.cx_ssl_total.fetch_add(1, Relaxed);
            stats.cx_ssl_active.fetch_add(1, Relaxed);
            let codec = active.def.hcm().map_or(Codec::Auto, |h| h.codec);
            match with_timeout(
                active.def.handshake_timeout,
                super::tls::handshake(tcp, tls, codec),
            )
            .await
            {
                Ok((session, alpn)) => {
                    let c = session.get_ref().1;
                    super::tls::count_handshake(&conns.stats.ssl, c);
                    let cert = c.peer_certificates().and_then(|chain| {
                        super::client_cert::PeerCert::from_chain(chain, tls.local_uris.clone())
                            .map(Arc::new)
                    });
                    if !active.def.policy.is_empty() {
                        let view = crate::filters::Connection {
                            direct_remote: Some(peer),
                            remote: Some(peer.ip()),
                            local,
                            sni: c.server_name(),
                            peer: cert
                                .as_deref()
                                .map(|p| p as &(dyn crate::filters::PeerIdentity + Sync)),
                            tls: true,
                        };
                        if !network_policy_allows(&active.def, &view, &conns.state).await {
                            tracing::debug!(listener = %conns.listener, %peer, "connection denied by a network policy filter");
                            stats.cx_ssl_active.fetch_sub(1, Relaxed);
                            return None;
                        }
                    }
                    let sni = c.server_name().map(Arc::from);
                    let h2 = alpn == Some(pingora_core::protocols::ALPN::H2);
                    h1_only = !h2;
                    let mut d = super::io::Downstream::new_tls(session, peer, alpn);
                    d.set_local_addr(local);
                    limited = (!h2)
                        .then(|| conn_state(&active.def, stats, accepted, &mut d))
                        .flatten();
                    let info = super::conn::ConnInfo {
                        peer: cert,
                        sni,
                        state: limited.clone(),
                    };
                    if let Some(digest) = info.into_digest() {
                        use pingora_core::protocols::GetProxyDigest;
                        d.set_proxy_digest(digest);
                    }
                    (apps.h1.clone(), Box::new(d))
                }
                Err(e) => {
                    super::tls::count_failure(&conns.stats.ssl, &e);
                    tracing::debug!(listener = %conns.listener, %peer, "TLS handshake failed: {e}");
                    stats.cx_ssl_active.fetch_sub(1, Relaxed);
                    return None;
                }
            }
        }
        None => {
            let (app, h2) = match &apps.h2c {
                Some(h2c) if starts_with_h2_preface(&tcp).await => (h2c.clone(), true),
                _ => (apps.h1.clone(), false),
            };
            let mut d = super::io::Downstream::new(tcp, peer);
            d.set_local_addr(local);
            h1_only = !h2;
            if !h2 {
                limited = conn_state(&active.def, stats, accepted, &mut d);
                let info = super::conn::ConnInfo {
                    state: limited.clone(),
                    ..Default::default()
                };
                if let Some(digest) = info.into_digest() {
                    use pingora_core::protocols::GetProxyDigest;
                    d.set_proxy_digest(digest);
                }
            }
            (app, Box::new(d))
        }
    };
    let tls = active.tls.is_some();
    Some(HttpConn {
        app,
        driver: apps.driver.clone(),
        stream,
        told,
        idle: server.signals.idle.subscribe(),
        h1_only,
        limited,
        stats: stats.clone(),
        tls,
    })
}

/// Serves an HTTP/1.1 connection request after request, as pingora's `process_new` does,
/// except that the wait for the next request happens here. pingora waits inside the
/// request's own future, which holds the whole proxy pipeline's state (and the session and
/// its read buffer) for as long as the connection idles: tens of KiB per idle keep-alive
/// connection. Here an idle connection holds its socket and little else, and pingora is
/// handed it when bytes arrive, within the keep-alive the last request settled
/// (`idle_timeout`, the connection limits), or it closes when idle connections are closed
/// (the end of a drain, shutdown).
async fn serve_h1(
    app: &Arc<HttpProxy<Gateway>>,
    driver: &super::h1::Driver,
    stream: pingora_core::protocols::Stream,
    told: watch::Receiver<bool>,
    mut idle_close: watch::Receiver<bool>,
) {
    use super::io::{Downstream, Head};
    use pingora_core::protocols::http::ServerSession;
    /// The connection between two requests: as pingora left it (its session, and whether it
    /// holds bytes of the next request), or as Portico's own loop left it. One per connection,
    /// taken apart at once. pingora's session is boxed (an allocation per request pingora's
    /// loop serves): this state moves at every request, and the own loop's, the usual one, is
    /// two words.
    enum Between {
        Pingora(Box<ServerSession>, bool),
        Ours(Box<Downstream>, super::h1::Kept),
    }
    let mut session = ServerSession::new_http1(stream);
    // pingora's default keep-alive for a new connection; the request path sets its own.
    session.set_keepalive(Some(60));
    let mut conn = Between::Pingora(Box::new(session), false);
    let mut idle_timer = super::timeouts::LazyTimer::default();
    let mut read_timer = super::timeouts::LazyTimer::default();
    // One wait for the close signal for the connection's life: made per wait, its waiter
    // was registered on the signal and removed again at every request.
    let closed = closing(&mut idle_close);
    tokio::pin!(closed);
    // Each request's head as the own loop's parse reads it, one for the connection's life
    // (`Plain::parse`).
    let mut plain = super::h1_session::Plain::default();
    let mut spare = super::h1::Spare::default();
    loop {
        let told_now = *told.borrow();
        // A plain request goes to Portico's own loop (`h1`); a request pingora already read
        // the start of (pipelined) stays with pingora, whose session holds those bytes.
        // The head is read here even for pingora's loop (an HTTP/2 upstream in the routes),
        // to mark a target Envoy refuses before pingora's session reads it.
        let own_loop = driver.routes_h1();
        let ours = match conn {
            Between::Ours(d, kept) => Ok((d, kept)),
            Between::Pingora(session, false) => ours_with_settings(*session).map_err(Box::new),
            Between::Pingora(session, _) => Err(session),
        };
        let reused = match ours {
            Ok((mut d, kept)) => {
                // As pingora's own read of a request head, cut short by the end of a drain.
                let head = tokio::select! {
                    biased;
                    h = d.read_head(super::h1::HEAD_LIMIT) => h,
                    _ = closed.as_mut() => return,
                };
                let parsed = match &head {
                    Head::Closed => return,
                    Head::Undecided => false,
                    Head::Complete(end) if own_loop => plain.parse(&d.ahead()[..*end]),
                    Head::Complete(_) => false,
                };
                if let (false, Head::Complete(end)) = (parsed, &head) {
                    // Only a head the quick parse refused (or did not try) can hold such a
                    // target; pingora's session reads it, marked.
                    d.mark_refused_target(*end);
                }
                if parsed {
                    // Boxed, as pingora's request future is: a connection's task is as
                    // large as its largest await, and it mostly idles between requests.
                    let request = super::in_box(|| {
                        super::h1::process(
                            driver,
                            d,
                            kept,
                            told_now,
                            &plain,
                            &mut read_timer,
                            &mut spare,
                        )
                    });
                    match Box::into_pin(request).await {
                        Some((d, kept)) => {
                            if !idle_wait(
                                &d,
                                kept.idle_deadline(),
                                closed.as_mut(),
                                &mut idle_timer,
                            )
                            .await
                            {
                                return;
                            }
                            conn = Between::Ours(d, kept);
                            continue;
                        }
                        None => return,
                    }
                }
                let mut session = ServerSession::new_http1(d);
                kept.apply(&mut session);
                if told_now {
                    session.set_keepalive(None);
                }
                app.process_new_http(session, &told).await
            }
            Err(mut session) => {
                if told_now {
                    session.set_keepalive(None);
                }
                app.process_new_http(*session, &told).await
            }
        };
        let Some(reused) = reused else {
            return;
        };
        let (stream, settings) = reused.consume();
        let mut next = ServerSession::new_http1(stream);
        let mut pipelined = false;
        if let Some(s) = settings {
            pipelined = carries_pipelined_bytes(&s);
            s.apply_to_session(&mut next);
        }
        let Some(idle) = next.get_keepalive().map(keepalive_idle) else {
            return;
        };
        // Bytes of a next request already read go to pingora at once (it refuses them).
        let ours = next
            .stream()
            .filter(|_| !pipelined)
            .and_then(|s| s.as_any().downcast_ref::<Downstream>());
        if let Some(d) = ours {
            let deadline = idle.map(|i| tokio::time::Instant::now() + i);
            if !idle_wait(d, deadline, closed.as_mut(), &mut idle_timer).await {
                return;
            }
        }
        conn = Between::Pingora(Box::new(next), pipelined);
    }
}

/// A session's keep-alive as a wait: `Some(0)` is pingora's "no limit".
fn keepalive_idle(secs: u64) -> Option<std::time::Duration> {
    (secs > 0).then(|| std::time::Duration::from_secs(secs))
}

/// Waits for a kept-alive connection's next request; false: it is to close (its keep-alive
/// ran out, idle connections are closing, or the client went away).
async fn idle_wait(
    d: &super::io::Downstream,
    deadline: Option<tokio::time::Instant>,
    mut closed: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    timer: &mut super::timeouts::LazyTimer,
) -> bool {
    loop {
        let expired = async {
            match deadline {
                Some(at) => timer.until(at).await,
                None => std::future::pending().await,
            }
        };
        // Readable first: a client that already sent its next request costs no timer.
        tokio::select! {
            biased;
            r = d.readable() => return r.is_ok(),
            reached = expired => if reached {
                return false;
            },
            _ = closed.as_mut() => return false,
        }
    }
}

/// Resolves when idle connections are to close (the end of a drain, shutdown). Not to be
/// polled once resolved: the connection closes then.
async fn closing(idle_close: &mut watch::Receiver<bool>) {
    loop {
        if *idle_close.borrow_and_update() {
            return;
        }
        if idle_close.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// The connection under an HTTP/1 session (our `io::Downstream`), and what the last request
/// left on the session for the next one; the session itself when it is not ours.
#[allow(clippy::result_large_err)]
fn ours_with_settings(
    session: pingora_core::protocols::http::ServerSession,
) -> Result<
    (Box<super::io::Downstream>, super::h1::Kept),
    pingora_core::protocols::http::ServerSession,
> {
    use pingora_core::protocols::http::ServerSession;
    let ours = session
        .stream()
        .is_some_and(|s| s.as_any().is::<super::io::Downstream>());
    match session {
        ServerSession::H1(h1) if ours => {
            let kept = super::h1::Kept::of(&h1);
            match h1
                .into_inner()
                .into_any()
                .downcast::<super::io::Downstream>()
            {
                Ok(d) => Ok((d, kept)),
                // Checked above.
                Err(_) => unreachable!("the stream was checked to be a Downstream"),
            }
        }
        other => Err(other),
    }
}

/// Whether pingora carries bytes the client sent after its last request over to the next
/// one (a pipelined request): the next session reads those before the socket, so it must
/// not wait for the socket. pingora keeps the field private; its `Debug` form names it,
/// scanned here without allocating (`conformance_http`'s pipelining case pins this down).
fn carries_pipelined_bytes(s: &pingora_core::apps::HttpPersistentSettings) -> bool {
    // `Debug` writes a field as its name, `": "`, then the value (`Some(..)` or `None`).
    #[derive(Default)]
    struct Scan {
        after_name: bool,
        found: bool,
    }
    impl std::fmt::Write for Scan {
        fn write_str(&mut self, piece: &str) -> std::fmt::Result {
            if piece.contains("pipelined_prefix: Some") {
                self.found = true;
            } else if piece == "pipelined_prefix" {
                self.after_name = true;
            } else if self.after_name && piece != ": " {
                self.found |= piece.starts_with("Some");
                self.after_name = false;
            }
            Ok(())
        }
    }
    let mut scan = Scan::default();
    let _ = std::fmt::Write::write_fmt(&mut scan, format_args!("{s:?}"));
    scan.found
}

/// The HTTP/2 codec's settings from the connection manager's `http2_protocol_options`.
fn h2_options(
    h: &crate::snapshot::listener::H2Settings,
) -> pingora_core::protocols::http::v2::server::H2Options {
    let mut o = pingora_core::protocols::http::v2::server::default_h2_options();
    o.max_concurrent_streams(h.max_concurrent_streams);
    o.max_header_list_size(h.max_header_list);
    if let Some(w) = h.stream_window {
        o.initial_window_size(w);
    }
    if let Some(w) = h.connection_window {
        o.initial_connection_window_size(w);
    }
    if let Some(t) = h.hpack_table_size {
        o.header_table_size(t);
    }
    o
}

/// The connection manager's per-connection state of an HTTP/1 connection, when its chain
/// limits connections; its read timers go into `d`.
fn conn_state(
    def: &crate::snapshot::listener::ChainDef,
    stats: &Arc<crate::live::HcmStats>,
    accepted: std::time::Instant,
    d: &mut super::io::Downstream,
) -> Option<Arc<super::conn::ConnState>> {
    let hcm = def.hcm()?;
    let limits = hcm.conn_limits;
    if !limits.any() {
        return None;
    }
    let state = Arc::new(super::conn::ConnState::new(
        limits,
        stats.clone(),
        Arc::from(hcm.server_name.as_str()),
        accepted,
    ));
    if limits.timed() {
        d.set_timer(super::conn::ReadTimer::new(state.clone()));
    }
    Some(state)
}

/// Runs the listener filters in their configured order; None when one of them closed the
/// connection. A PROXY header's addresses replace `peer` (and set `local`) for everything
/// after it: the TLS inspector, chain selection, XFF and the request path.
/// The chain's network policy filters in order (RBAC, ext_authz): whether the connection
/// goes on.
async fn network_policy_allows(
    def: &crate::snapshot::listener::ChainDef,
    view: &crate::filters::Connection<'_>,
    state: &crate::State,
) -> bool {
    let mut st = crate::filters::FilterState::default();
    let snap = state.snapshot();
    let callouts = super::callout::Callouts { snapshot: &snap };
    for p in &def.policy {
        let ok = match p {
            crate::snapshot::listener::NetworkPolicy::Rbac(r) => r.allows(view, &mut st),
            crate::snapshot::listener::NetworkPolicy::ExtAuthz(a) => {
                a.allows(view, &st, Some(&callouts)).await
            }
        };
        if !ok {
            return false;
        }
    }
    true
}

async fn run_listener_filters(
    tcp: &mut tokio::net::TcpStream,
    def: &crate::snapshot::listener::ListenerDef,
    peer: &mut SocketAddr,
    local: &mut Option<SocketAddr>,
) -> Option<super::tls::Hello> {
    use super::proxy_protocol::{self as pp, Outcome};
    use crate::snapshot::listener::ListenerFilter;
    let mut hello = super::tls::Hello::default();
    for f in &def.listener_filters {
        match f {
            ListenerFilter::TlsInspector => hello = super::tls::inspect(tcp).await,
            ListenerFilter::ProxyProtocol(cfg) => {
                let outcome = pp::read(tcp, cfg).await;
                pp::stats(&cfg.stat_prefix).count(&outcome);
                match outcome {
                    Outcome::Found { addrs, .. } => {
                        if let Some((src, dst)) = addrs {
                            *peer = src;
                            *local = Some(dst);
                        }
                    }
                    Outcome::NotFoundAllowed => {}
                    Outcome::Error(_) | Outcome::Denied(_) | Outcome::Closed => {
                        tracing::debug!(listener = %def.name, %peer, ?outcome, "PROXY protocol: closing");
                        return None;
                    }
                }
            }
        }
    }
    Some(hello)
}

/// The TLS handshake under the chain's `transport_socket_connect_timeout`.
async fn with_timeout<T>(
    limit: Option<std::time::Duration>,
    handshake: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    match limit {
        Some(t) => tokio::time::timeout(t, handshake)
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())),
        None => handshake.await,
    }
}

/// A connection's place under the global connection limit, given back when it ends (also if
/// its task ends by a panic).
struct GlobalSlot(Option<Arc<State>>);

impl Drop for GlobalSlot {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            s.global_connections.close();
        }
    }
}

async fn accept_loop(
    sock: std::net::TcpListener,
    conns: Conns,
    mut shutdown: watch::Receiver<bool>,
) {
    let listener = match tokio::net::TcpListener::from_std(sock) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("cannot register listening socket: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, peer)) => {
                    // The overload manager's global limit, as Envoy applies it: past it the
                    // connection is accepted and closed at once, and counted.
                    let limited = !conns.served.load().listener.def.ignore_global_conn_limit;
                    if limited && !conns.state.global_connections.try_open() {
                        conns.stats.global_cx_overflow.fetch_add(1, Relaxed);
                        drop(tcp);
                        continue;
                    }
                    let slot = GlobalSlot(limited.then(|| conns.state.clone()));
                    let conns = conns.clone();
                    tokio::spawn(async move {
                        let _slot = slot;
                        let stats = conns.stats.clone();
                        stats.cx_total.fetch_add(1, Relaxed);
                        stats.cx_active.fetch_add(1, Relaxed);
                        serve_connection(tcp, peer, conns).await;
                        stats.cx_active.fetch_sub(1, Relaxed);
                        stats.cx_destroy.fetch_add(1, Relaxed);
                    });
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            changed = shutdown.changed() => {
                if changed.is_err() || *shutdown.borrow() {
                    break;
                }
            }
        }
    }
}

/// The commit point drives the listeners through this, so `xds` needs nothing of the proxy.
impl crate::xds::commit::Listeners for ListenerManager {
    fn prepare(&mut self, wanted: &BTreeMap<String, Vec<ListenAddr>>) -> Vec<(String, String)> {
        ListenerManager::prepare(self, wanted)
    }

    fn reconcile(&mut self, snap: &Snapshot) {
        ListenerManager::reconcile(self, snap)
    }
}

#[cfg(test)]
#[path = "listeners_tests.rs"]
mod listeners_tests;
