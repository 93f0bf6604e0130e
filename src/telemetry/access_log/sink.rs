//! The access log manager: one writer per path for the whole process, shared by every logger
//! that names the path (Envoy's `AccessLogManager`), whatever listener or push it came from.
//!
//! The request path formats its line and hands it over a bounded channel ([`Writer::write`]
//! never blocks: when the channel is full the line is dropped and counted). Each path's
//! thread buffers lines and writes them when the buffer reaches `--file-flush-min-size-kb`
//! (Envoy's default 64 KiB) or every `--file-flush-interval-msec` (default 10 s), as Envoy's
//! flush thread does. SIGUSR1 ([`reopen_all`]) makes every writer reopen its file, for log
//! rotation. `/dev/stdout` and `/dev/stderr` are the process's own streams.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Lines waiting per path before new ones are dropped.
const QUEUE: usize = 16 * 1024;

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
    Line(Vec<u8>),
    Reopen,
    Flush(SyncSender<()>),
}

/// The writer of one path.
#[derive(Debug)]
pub struct Writer {
    tx: SyncSender<Msg>,
}

impl Writer {
    /// Queues a line; drops (and counts) it if the queue is full.
    pub fn write(&self, line: Vec<u8>) {
        match self.tx.try_send(Msg::Line(line)) {
            Ok(()) => {
                stats().write_buffered.fetch_add(1, Relaxed);
            }
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                stats().dropped.fetch_add(1, Relaxed);
            }
        }
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
            Ok(Msg::Line(l)) => {
                buf.extend_from_slice(&l);
                if buf.len() >= s.min_flush_bytes {
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
