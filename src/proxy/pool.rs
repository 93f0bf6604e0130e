//! Idle HTTP/1 upstream connections of the own HTTP/1.1 loop (`h1`), one pool per worker and
//! chain.
//!
//! pingora's pool spawns a task per released connection (to watch it while idle) and, on
//! reuse, asks the kernel for the socket's peer (`getpeername`) to be sure the pooled fd is
//! still the connection it was: a task, a lock, a channel pair and a syscall per request. Here
//! a pool owns its idle connections outright, so the fd cannot change under it; a connection
//! is checked on release and on reuse the way pingora checks it (a read that must not be
//! ready: data or EOF on an idle connection means it cannot be reused), which costs no syscall
//! unless the reactor has seen the socket readable. One sweep task per pool, alive while the
//! pool holds connections, closes the ones past their idle timeout and the ones the server
//! closed, waking at the earliest deadline and at least every `SWEEP` (so a server's close is
//! answered within that, where pingora answers at once).
//!
//! Same semantics as pingora's otherwise: keyed by the peer's reuse hash (and its address),
//! at most `cap` idle connections per pool with the least recently released closed first, the
//! cluster's idle timeout counted from release (None: no limit).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::up_io::Io;
use futures::FutureExt;
use pingora_core::protocols::l4::socket::SocketAddr;
use pingora_core::upstreams::peer::Peer;
use tokio::io::AsyncReadExt;

/// The pool key of a plain peer (no TLS, proxy or client certificate; HTTP/1): of what
/// pingora's reuse hash reads, only its address and group key can differ between two such
/// peers. pingora's hash runs ahash over every field (~150 instructions a request); this
/// mixes the two (under 20). Keys made either way share a pool, as pingora's reuse hashes
/// share one: two different peers with one key (odds of 2^-64) would share connections there
/// too, and `take` still checks the address.
pub(crate) fn plain_key(addr: &SocketAddr, group_key: u64) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mix = |h: u64, w: u64| (h.rotate_left(26) ^ w).wrapping_mul(K);
    let h = mix(group_key ^ 0x706c_6169_6e00, 0);
    let h = match addr {
        SocketAddr::Inet(std::net::SocketAddr::V4(a)) => {
            mix(h, u64::from(a.ip().to_bits()) << 16 | u64::from(a.port()))
        }
        SocketAddr::Inet(std::net::SocketAddr::V6(a)) => {
            let ip = a.ip().to_bits();
            let h = mix(mix(h, ip as u64), (ip >> 64) as u64);
            mix(h, u64::from(a.port()) << 32 | u64::from(a.scope_id()))
        }
        // The own loop's plain peers are TCP ones; any other address still gets a key.
        other => {
            use std::hash::{Hash, Hasher};
            let mut d = std::hash::DefaultHasher::new();
            other.hash(&mut d);
            mix(h, d.finish())
        }
    };
    // The map takes the key as its own hash (`Prehashed`): the top bits pick the control
    // byte, the low ones the bucket.
    h ^ h >> 29
}

/// How long a server's close of an idle connection may go unanswered.
const SWEEP: Duration = Duration::from_secs(1);

pub(crate) struct Pool {
    cap: usize,
    inner: Mutex<Inner>,
    /// Wakes the sweep when a connection has an earlier deadline than it sleeps to.
    wake: Arc<tokio::sync::Notify>,
}

#[derive(Default)]
struct Inner {
    /// Per key, oldest release first: reuse takes the newest (warmest, furthest from any
    /// timeout the server has).
    idle: HashMap<u64, Vec<Idle>, crate::prehashed::BuildPrehashed>,
    count: usize,
    /// Release order, for the cap.
    seq: u64,
    sweeping: bool,
    /// When the sweep next wakes (while `sweeping`).
    sweep_at: Option<Instant>,
}

struct Idle {
    addr: SocketAddr,
    stream: Io,
    until: Option<Instant>,
    seq: u64,
}

impl Pool {
    pub fn new(cap: usize) -> Arc<Pool> {
        Arc::new(Pool {
            cap,
            inner: Mutex::new(Inner::default()),
            wake: Arc::new(tokio::sync::Notify::new()),
        })
    }

    /// An idle connection to `peer` that is still open and within its idle timeout.
    /// `key`: the peer's `reuse_hash` (worked out once per request, for `put` too); `now`: a
    /// reading of the clock the caller has (the request's peer was chosen moments before).
    pub fn take(&self, key: u64, peer: &impl Peer, now: Instant) -> Option<Io> {
        let mut inner = self.inner.lock().ok()?;
        let inner = &mut *inner;
        let list = inner.idle.get_mut(&key)?;
        let mut found = None;
        let mut i = list.len();
        while i > 0 {
            i -= 1;
            if list[i].addr != *peer.address() {
                continue;
            }
            let mut c = list.remove(i);
            inner.count -= 1;
            if c.until.is_some_and(|t| t <= now) || !reusable(&mut c.stream) {
                // Dropped: closed (outside the lock would be nicer, but a close of a dead or
                // expired socket is one cheap syscall).
                continue;
            }
            found = Some(c.stream);
            break;
        }
        found
    }

    /// Keeps `stream` (a connection to `peer` whose last response is complete) for reuse.
    pub fn put(self: &Arc<Self>, stream: Io, key: u64, peer: &impl Peer, idle: Option<Duration>) {
        // Not checked here as `take` checks: the response was read to its end moments ago,
        // leaving nothing buffered, and what the server sends or closes from now on `take`
        // (or the sweep) finds, as it would find it after a check here (~320 instructions).
        if self.cap == 0 {
            return;
        }
        let until = idle.map(|d| Instant::now() + d);
        let evicted;
        let spawn;
        {
            let Ok(mut inner) = self.inner.lock() else {
                return;
            };
            let inner = &mut *inner;
            inner.seq += 1;
            let seq = inner.seq;
            inner.idle.entry(key).or_default().push(Idle {
                addr: peer.address().clone(),
                stream,
                until,
                seq,
            });
            inner.count += 1;
            evicted = (inner.count > self.cap)
                .then(|| inner.evict_oldest())
                .flatten();
            spawn = !inner.sweeping;
            if spawn {
                inner.sweeping = true;
                inner.sweep_at = None;
            } else if let (Some(u), Some(at)) = (until, inner.sweep_at) {
                if u < at {
                    self.wake.notify_one();
                }
            }
        }
        drop(evicted);
        if spawn {
            tokio::spawn(sweep(Arc::downgrade(self), self.wake.clone()));
        }
    }

    /// How many idle connections the pool holds.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().map_or(0, |i| i.count)
    }
}

impl Inner {
    fn evict_oldest(&mut self) -> Option<Idle> {
        let key = self
            .idle
            .iter()
            .filter_map(|(k, l)| l.first().map(|c| (c.seq, *k)))
            .min()
            .map(|(_, k)| k)?;
        let list = self.idle.get_mut(&key)?;
        let c = list.remove(0);
        self.count -= 1;
        Some(c)
    }

    /// Drops expired and server-closed connections; the earliest remaining deadline.
    fn purge(&mut self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut count = 0;
        self.idle.retain(|_, list| {
            list.retain_mut(|c| {
                let keep = c.until.is_none_or(|t| t > now) && reusable(&mut c.stream);
                if keep {
                    if let Some(u) = c.until {
                        next = Some(next.map_or(u, |n| n.min(u)));
                    }
                }
                keep
            });
            count += list.len();
            !list.is_empty()
        });
        self.count = count;
        next
    }
}

/// The pool's sweep: runs while the pool holds connections and the pool exists (a removed
/// chain's pool closes its connections as it goes).
async fn sweep(pool: Weak<Pool>, wake: Arc<tokio::sync::Notify>) {
    loop {
        let at = {
            let Some(p) = pool.upgrade() else { return };
            let Ok(mut inner) = p.inner.lock() else {
                return;
            };
            let now = Instant::now();
            let next = inner.purge(now);
            if inner.count == 0 {
                inner.sweeping = false;
                inner.sweep_at = None;
                return;
            }
            let at = next.map_or(now + SWEEP, |n| n.min(now + SWEEP));
            inner.sweep_at = Some(at);
            at
        };
        tokio::select! {
            _ = tokio::time::sleep_until(at.into()) => {}
            _ = wake.notified() => {}
        }
    }
}

/// pingora's test of a pooled connection: an idle connection has nothing to read, so a read
/// that is ready (data, EOF or an error) means it is not reusable. Not ready costs no syscall.
fn reusable(stream: &mut Io) -> bool {
    let mut buf = [0u8; 1];
    // `unconstrained`: tokio's budget could make a ready read look pending.
    tokio::task::unconstrained(stream.read(&mut buf[..]))
        .now_or_never()
        .is_none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora_core::upstreams::peer::HttpPeer;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    /// A connection as the own loop makes one to a plain peer, and the server's end.
    async fn pair(l: &TcpListener) -> (Io, TcpStream) {
        let p = peer(l);
        let (c, s) = tokio::join!(crate::proxy::up_io::connect(&p), l.accept());
        (c.expect("connect"), s.expect("accept").0)
    }

    /// A connection as pingora's connector makes one (its stream), and the server's end.
    async fn pingora_pair(l: &TcpListener) -> (Io, TcpStream) {
        let addr = l.local_addr().expect("addr");
        let (c, s) = tokio::join!(TcpStream::connect(addr), l.accept());
        let c = pingora_core::protocols::l4::stream::Stream::from(c.expect("connect"));
        (Io::Stream(Box::new(c)), s.expect("accept").0)
    }

    /// Waits (at most `within`) for the server side to see the pool close its connection.
    async fn closed(s: &mut TcpStream, within: Duration, why: &str) {
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(within, s.read(&mut buf))
            .await
            .expect(why)
            .expect("read");
        assert_eq!(n, 0, "{why}");
    }

    fn peer(l: &TcpListener) -> HttpPeer {
        HttpPeer::new(l.local_addr().expect("addr"), false, String::new())
    }

    #[tokio::test]
    async fn a_released_connection_is_reused_once() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let p = peer(&l);
        let pool = Pool::new(8);
        let (c, _s) = pair(&l).await;
        pool.put(c, p.reuse_hash(), &p, None);
        assert_eq!(pool.len(), 1);
        assert!(pool.take(p.reuse_hash(), &p, Instant::now()).is_some());
        assert!(pool.take(p.reuse_hash(), &p, Instant::now()).is_none());
    }

    #[tokio::test]
    async fn another_peer_gets_nothing() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let l2 = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let pool = Pool::new(8);
        let (c, _s) = pair(&l).await;
        pool.put(c, peer(&l).reuse_hash(), &peer(&l), None);
        assert!(pool
            .take(peer(&l2).reuse_hash(), &peer(&l2), Instant::now())
            .is_none());
        assert!(pool
            .take(peer(&l).reuse_hash(), &peer(&l), Instant::now())
            .is_some());
    }

    #[tokio::test]
    async fn a_connection_the_server_closed_or_wrote_to_is_not_reused() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let p = peer(&l);
        let pool = Pool::new(8);
        let (c1, s1) = pair(&l).await;
        let (c2, mut s2) = pair(&l).await;
        let (c3, s3) = pingora_pair(&l).await;
        let (c4, mut s4) = pingora_pair(&l).await;
        for c in [c1, c2, c3, c4] {
            pool.put(c, p.reuse_hash(), &p, None);
        }
        drop(s1);
        drop(s3);
        s2.write_all(b"unexpected").await.expect("write");
        s4.write_all(b"unexpected").await.expect("write");
        // Until the reactor has seen both sockets readable, they look idle.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            tokio::time::sleep(Duration::from_millis(5)).await;
            let n = pool.inner.lock().expect("lock").purge(Instant::now());
            assert!(n.is_none());
            if pool.len() == 0 || Instant::now() > deadline {
                break;
            }
        }
        assert_eq!(pool.len(), 0);
        assert!(pool.take(p.reuse_hash(), &p, Instant::now()).is_none());
    }

    #[tokio::test]
    async fn the_idle_timeout_closes_and_the_sweep_stops_when_empty() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let p = peer(&l);
        let pool = Pool::new(8);
        let (c, mut s) = pair(&l).await;
        pool.put(c, p.reuse_hash(), &p, Some(Duration::from_millis(50)));
        // The server sees the close: the sweep closed it at the deadline.
        closed(&mut s, Duration::from_secs(10), "closed within the timeout").await;
        assert_eq!(pool.len(), 0);
        let deadline = Instant::now() + Duration::from_secs(10);
        while pool.inner.lock().expect("lock").sweeping && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(!pool.inner.lock().expect("lock").sweeping);
        // A later release starts a new sweep.
        let (c, _s) = pair(&l).await;
        pool.put(c, p.reuse_hash(), &p, None);
        assert!(pool.inner.lock().expect("lock").sweeping);
    }

    #[tokio::test]
    async fn a_shorter_timeout_wakes_the_sweep_early() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let p = peer(&l);
        let pool = Pool::new(8);
        let (c1, _s1) = pair(&l).await;
        pool.put(c1, p.reuse_hash(), &p, Some(Duration::from_secs(3600)));
        tokio::task::yield_now().await;
        let (c2, mut s2) = pair(&l).await;
        let mut p2 = peer(&l);
        p2.group_key = 7;
        pool.put(c2, p2.reuse_hash(), &p2, Some(Duration::from_millis(20)));
        closed(
            &mut s2,
            Duration::from_millis(900),
            "closed before the 1 s sweep",
        )
        .await;
        assert_eq!(pool.len(), 1);
    }

    #[tokio::test]
    async fn past_the_cap_the_least_recently_released_goes() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let p = peer(&l);
        let mut other = peer(&l);
        other.group_key = 9;
        let pool = Pool::new(2);
        let (c1, mut s1) = pair(&l).await;
        let (c2, _s2) = pair(&l).await;
        let (c3, _s3) = pair(&l).await;
        pool.put(c1, p.reuse_hash(), &p, None);
        pool.put(c2, other.reuse_hash(), &other, None);
        pool.put(c3, p.reuse_hash(), &p, None);
        assert_eq!(pool.len(), 2);
        closed(&mut s1, Duration::from_secs(10), "the first was closed").await;
        assert!(pool
            .take(other.reuse_hash(), &other, Instant::now())
            .is_some());
        assert!(pool.take(p.reuse_hash(), &p, Instant::now()).is_some());
        assert!(pool.take(p.reuse_hash(), &p, Instant::now()).is_none());
    }

    #[tokio::test]
    async fn a_dropped_pool_closes_its_connections() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let p = peer(&l);
        let pool = Pool::new(8);
        let (c, mut s) = pair(&l).await;
        pool.put(c, p.reuse_hash(), &p, None);
        drop(pool);
        closed(&mut s, Duration::from_secs(10), "closed").await;
    }

    #[test]
    fn plain_keys_tell_plain_peers_apart_as_reuse_hashes_do() {
        let addrs = [
            "127.0.0.1:80",
            "127.0.0.1:81",
            "127.0.0.2:80",
            "10.1.2.3:9080",
            "[::1]:80",
            "[::1]:81",
            "[fe80::1%2]:80",
            "[fe80::1%3]:80",
        ];
        let mut keys = std::collections::HashSet::new();
        for a in addrs {
            let addr: std::net::SocketAddr = a.parse().expect("addr");
            for group in [0u64, 1, 0xdead_beef] {
                let mut p = HttpPeer::new(addr, false, String::new());
                p.group_key = group;
                let key = plain_key(p.address(), p.group_key);
                // The same peer made again: the same key, as its reuse hash is the same.
                let mut again = HttpPeer::new(addr, false, String::new());
                again.group_key = group;
                assert_eq!(p.reuse_hash(), again.reuse_hash());
                assert_eq!(key, plain_key(again.address(), again.group_key));
                assert!(keys.insert(key), "{a} {group}: a key twice");
            }
        }
        // Spread for the map: the top seven bits (hashbrown's control byte) differ too.
        let tops: std::collections::HashSet<u64> = keys.iter().map(|k| k >> 57).collect();
        assert!(tops.len() > keys.len() / 2, "{tops:?}");
    }

    #[tokio::test]
    async fn plain_keys_find_what_they_put() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let p = peer(&l);
        let pool = Pool::new(8);
        let (c, _s) = pair(&l).await;
        let key = plain_key(p.address(), p.group_key);
        pool.put(c, key, &p, None);
        let mut grouped = peer(&l);
        grouped.group_key = 7;
        let other = plain_key(grouped.address(), grouped.group_key);
        assert!(pool.take(other, &grouped, Instant::now()).is_none());
        assert!(pool.take(key, &p, Instant::now()).is_some());
    }
}
