//! The access log manager: one writer per path for the whole process, shared by every logger
//! that names the path (Envoy's `AccessLogManager`), whatever listener or push it came from.
//!
//! The request path formats its line into its worker's own buffer for the path (no lock, no
//! wake-up of another thread per line: handing each line over a channel woke the writer
//! thread per request and doubled the cost of a logged request). A worker hands its buffer to
//! the path's writer thread when it reaches `--file-flush-min-size-kb` (Envoy's default
//! 64 KiB), and a ticker on each worker hands over what waits every half
//! `--file-flush-interval-msec` (default 10 s), so a line reaches the file within about the
//! flush interval, as with Envoy's flush thread. [`Writer::write`] never blocks: a batch the
//! writer's bounded queue cannot take is dropped and its lines counted. SIGUSR1 ([`reopen_all`]) makes every writer reopen its file, for log
//! rotation. `/dev/stdout` and `/dev/stderr` are the process's own streams.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Batches waiting per path before new ones are dropped.
const QUEUE: usize = 1024;

/// Flush settings, from the command line.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub flush_interval: Duration,
    pub min_flush_bytes: usize,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            flush_interval: Duration::from_millis(10_000),
            min_flush_bytes: 64 * 1024,
        }
    }
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();

/// Sets the flush settings (`--file-flush-interval-msec`, `--file-flush-min-size-kb`). Call
/// before the first log line; later calls are ignored.
pub fn configure(flush_interval_ms: Option<u64>, min_size_kb: Option<u64>) {
    let d = Settings::default();
    let _ = SETTINGS.set(Settings {
        flush_interval: flush_interval_ms
            .map_or(d.flush_interval, |ms| Duration::from_millis(ms.max(1))),
        min_flush_bytes: min_size_kb.map_or(d.min_flush_bytes, |kb| (kb as usize) * 1024),
    });
}

fn settings() -> Settings {
    *SETTINGS.get_or_init(Settings::default)
}

/// Process-wide counters (all paths).
#[derive(Debug, Default)]
pub struct SinkStats {
    /// Lines handed to a writer.
    pub write_buffered: AtomicU64,
    /// Writes to a file that completed.
    pub write_completed: AtomicU64,
    pub write_failed: AtomicU64,
    /// Ticks of the flush timer (Envoy counts each, whether or not anything was waiting).
    pub flushed_by_timer: AtomicU64,
    /// Bytes waiting in the writers' buffers (a gauge).
    pub write_total_buffered: AtomicU64,
    pub reopen_failed: AtomicU64,
    /// Lines dropped because the writer's queue was full.
    pub dropped: AtomicU64,
}

pub fn stats() -> &'static SinkStats {
    static S: OnceLock<SinkStats> = OnceLock::new();
    S.get_or_init(SinkStats::default)
}

enum Msg {
    /// Lines from one worker.
    Batch(Vec<u8>),
    Reopen,
    Flush(SyncSender<()>),
}

/// The writer of one path.
#[derive(Debug)]
pub struct Writer {
    tx: SyncSender<Msg>,
}

/// What a worker thread holds for each path until it hands it over.
#[derive(Default)]
struct Local {
    pending: Vec<(Arc<Writer>, Vec<u8>, u64)>,
    ticker: bool,
}

thread_local! {
    static LOCAL: std::cell::RefCell<Local> = std::cell::RefCell::new(Local::default());
}

impl Writer {
    /// Buffers a line on this thread (see the module comment); outside a tokio runtime it is
    /// handed over at once.
    pub fn write(self: &Arc<Self>, line: &[u8]) {
        stats().write_buffered.fetch_add(1, Relaxed);
        if tokio::runtime::Handle::try_current().is_err() {
            self.send(line.to_vec(), 1);
            return;
        }
        let full = LOCAL.with(|l| {
            let mut l = l.borrow_mut();
            if !l.ticker {
                l.ticker = true;
                tokio::spawn(ticker());
            }
            let i = match l.pending.iter().position(|(w, ..)| Arc::ptr_eq(w, self)) {
                Some(i) => i,
                None => {
                    l.pending.push((self.clone(), Vec::new(), 0));
                    l.pending.len() - 1
                }
            };
            let (_, buf, lines) = &mut l.pending[i];
            if buf.capacity() == 0 {
                buf.reserve(settings().min_flush_bytes.clamp(4096, 1 << 20));
            }
            buf.extend_from_slice(line);
            *lines += 1;
            (buf.len() >= settings().min_flush_bytes)
                .then(|| (std::mem::take(buf), std::mem::take(lines)))
        });
        if let Some((batch, lines)) = full {
            self.send(batch, lines);
        }
    }

    fn send(&self, batch: Vec<u8>, lines: u64) {
        match self.tx.try_send(Msg::Batch(batch)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                stats().dropped.fetch_add(lines, Relaxed);
            }
        }
    }
}

/// Hands over what this worker holds, every half flush interval.
async fn ticker() {
    let every = (settings().flush_interval / 2).max(Duration::from_millis(1));
    loop {
        tokio::time::sleep(every).await;
        flush_thread_local();
    }
}

/// Hands over what this thread holds for every path (a worker's ticker, and a worker about to
/// stop).
pub fn flush_thread_local() {
    let batches: Vec<(Arc<Writer>, Vec<u8>, u64)> = LOCAL.with(|l| {
        let mut l = l.borrow_mut();
        l.pending
            .iter_mut()
            .filter(|(_, b, _)| !b.is_empty())
            .map(|(w, b, n)| (w.clone(), std::mem::take(b), std::mem::take(n)))
            .collect()
    });
    for (w, b, n) in batches {
        w.send(b, n);
    }
}

fn manager() -> &'static Mutex<HashMap<String, Arc<Writer>>> {
    static M: OnceLock<Mutex<HashMap<String, Arc<Writer>>>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The writer of `path`, started on first use. Each logger calls this once (then keeps the
/// handle), so the lock is not on the per-request path.
pub fn writer(path: &str) -> Arc<Writer> {
    let mut m = manager().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(w) = m.get(path) {
        return w.clone();
    }
    let (tx, rx) = sync_channel(QUEUE);
    let p = path.to_string();
    let spawned = std::thread::Builder::new()
        .name("access-log".into())
        .spawn(move || run(p, rx));
    if let Err(e) = spawned {
        tracing::error!(path, "access log: cannot start the writer thread: {e}");
    }
    let w = Arc::new(Writer { tx });
    m.insert(path.to_string(), w.clone());
    w
}

/// SIGUSR1: every file is reopened (after a rotation moved it away).
pub fn reopen_all() {
    let m = manager().lock().unwrap_or_else(|e| e.into_inner());
    for w in m.values() {
        let _ = w.tx.try_send(Msg::Reopen);
    }
}

/// Writes out what every writer holds, waiting up to `timeout` (at shutdown).
pub fn flush_all(timeout: Duration) {
    let writers: Vec<Arc<Writer>> = {
        let m = manager().lock().unwrap_or_else(|e| e.into_inner());
        m.values().cloned().collect()
    };
    let deadline = Instant::now() + timeout;
    for w in writers {
        let (tx, rx) = sync_channel(1);
        if w.tx.try_send(Msg::Flush(tx)).is_ok() {
            let _ = rx.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        }
    }
}

enum Out {
    Stdout,
    Stderr,
    File(Option<std::fs::File>),
}

impl Out {
    fn open(path: &str) -> Out {
        match path {
            "/dev/stdout" => Out::Stdout,
            "/dev/stderr" => Out::Stderr,
            p => Out::File(open_file(p)),
        }
    }

    fn reopen(&mut self, path: &str) {
        if let Out::File(f) = self {
            *f = open_file(path);
            if f.is_none() {
                stats().reopen_failed.fetch_add(1, Relaxed);
            }
        }
    }

    fn write_all(&mut self, buf: &[u8], path: &str) {
        let r = match self {
            Out::Stdout => {
                let mut o = std::io::stdout().lock();
                o.write_all(buf).and_then(|_| o.flush())
            }
            Out::Stderr => std::io::stderr().lock().write_all(buf),
            Out::File(Some(f)) => f.write_all(buf),
            Out::File(None) => {
                // Opening failed before: try again, so a directory created later works.
                *self = Out::File(open_file(path));
                match self {
                    Out::File(Some(f)) => f.write_all(buf),
                    _ => Err(std::io::Error::other("not open")),
                }
            }
        };
        match r {
            Ok(()) => stats().write_completed.fetch_add(1, Relaxed),
            Err(_) => stats().write_failed.fetch_add(1, Relaxed),
        };
    }
}

fn open_file(path: &str) -> Option<std::fs::File> {
    match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        Ok(f) => Some(f),
        Err(e) => {
            tracing::error!(path, "access log: cannot open the file: {e}");
            None
        }
    }
}

/// A writer thread: buffer, flush on size or timer, reopen on request.
fn run(path: String, rx: Receiver<Msg>) {
    let s = settings();
    let mut out = Out::open(&path);
    let mut buf: Vec<u8> = Vec::with_capacity(s.min_flush_bytes.min(1 << 20));
    let mut next = Instant::now() + s.flush_interval;
    // What this writer adds to the process-wide `write_total_buffered` gauge.
    let mut counted = 0u64;
    loop {
        let now = buf.len() as u64;
        if now != counted {
            let g = &stats().write_total_buffered;
            if now > counted {
                g.fetch_add(now - counted, Relaxed);
            } else {
                g.fetch_sub(counted - now, Relaxed);
            }
            counted = now;
        }
        let wait = next.saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            // A batch is already what a flush writes: out it goes (behind what waits).
            Ok(Msg::Batch(b)) => {
                if buf.is_empty() {
                    out.write_all(&b, &path);
                } else {
                    buf.extend_from_slice(&b);
                    out.write_all(&buf, &path);
                    buf.clear();
                }
            }
            Ok(Msg::Reopen) => {
                if !buf.is_empty() {
                    out.write_all(&buf, &path);
                    buf.clear();
                }
                out.reopen(&path);
            }
            Ok(Msg::Flush(done)) => {
                if !buf.is_empty() {
                    out.write_all(&buf, &path);
                    buf.clear();
                }
                let _ = done.try_send(());
            }
            Err(RecvTimeoutError::Timeout) => {
                stats().flushed_by_timer.fetch_add(1, Relaxed);
                if !buf.is_empty() {
                    out.write_all(&buf, &path);
                    buf.clear();
                }
                next = Instant::now() + s.flush_interval;
            }
            Err(RecvTimeoutError::Disconnected) => {
                if !buf.is_empty() {
                    out.write_all(&buf, &path);
                }
                return;
            }
        }
    }
}
