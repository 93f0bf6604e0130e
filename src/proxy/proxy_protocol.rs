//! `envoy.filters.listener.proxy_protocol`: reads a PROXY protocol header (v1 text or v2
//! binary) off an accepted connection, as Envoy's listener filter does: the bytes are peeked
//! until the header is complete, checked, then consumed exactly, so what follows (a TLS
//! ClientHello, an HTTP request) stays on the socket for the next listener filter and the
//! chain. The header's source becomes the connection's remote address and its destination the
//! local one; a LOCAL command (v2) or `UNKNOWN` (v1) keeps the socket's own addresses.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::snapshot::listener::ProxyProtocol;

const V2_SIGNATURE: &[u8; 12] = b"\r\n\r\n\0\r\nQUIT\n";
const V1_SIGNATURE: &[u8; 6] = b"PROXY ";
/// The fixed part of a v2 header: signature, version/command, family, length.
const V2_HEADER_LEN: usize = 16;
/// Envoy's limit for a v1 line, CRLF included.
const V1_MAX_LEN: usize = 107;
/// What Envoy peeks at first: a v2 header with the largest (AF_UNIX) address block.
const INITIAL_PEEK: usize = V2_HEADER_LEN + 216;

/// Which header the bytes turned out to hold, for the per-version stats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    NotFound,
    V1,
    V2,
}

/// What the filter decided for a connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A header was read and consumed; `addrs` are (source, destination) when it carried them
    /// (not for LOCAL or UNKNOWN).
    Found {
        version: Version,
        addrs: Option<(SocketAddr, SocketAddr)>,
    },
    /// No header, and `allow_requests_without_proxy_protocol` lets the connection go on as is.
    NotFoundAllowed,
    /// Malformed, or absent when required: Envoy closes the connection and counts
    /// `downstream_cx_proxy_proto_error` plus the version's (or `not_found_disallowed`).
    Error(Version),
    /// A well-formed header of a version in `disallowed_versions`: closed, counted as found
    /// and disallowed.
    Denied(Version),
    /// The peer closed (or the socket failed) before the header was complete.
    Closed,
}

/// Envoy's counters for the filter, under `proxy_proto.[<stat_prefix>.]`, plus the legacy
/// `downstream_cx_proxy_proto_error`. Kept here, per stat prefix, for the admin endpoint to
/// render.
#[derive(Debug, Default)]
pub struct Stats {
    pub downstream_cx_proxy_proto_error: AtomicU64,
    pub not_found_allowed: AtomicU64,
    pub not_found_disallowed: AtomicU64,
    pub v1: VersionStats,
    pub v2: VersionStats,
}

/// `proxy_proto.[<stat_prefix>.]versions.<v1|v2>.*`.
#[derive(Debug, Default)]
pub struct VersionStats {
    pub found: AtomicU64,
    pub disallowed: AtomicU64,
    pub error: AtomicU64,
}

impl Stats {
    /// Counts an outcome as Envoy's `onData` does.
    pub fn count(&self, o: &Outcome) {
        let version = |v: Version| match v {
            Version::V1 => Some(&self.v1),
            Version::V2 => Some(&self.v2),
            Version::NotFound => None,
        };
        match o {
            Outcome::Found { version: v, .. } => {
                if let Some(s) = version(*v) {
                    s.found.fetch_add(1, Relaxed);
                }
            }
            Outcome::NotFoundAllowed => {
                self.not_found_allowed.fetch_add(1, Relaxed);
            }
            Outcome::Error(v) => {
                match version(*v) {
                    Some(s) => s.error.fetch_add(1, Relaxed),
                    None => self.not_found_disallowed.fetch_add(1, Relaxed),
                };
                self.downstream_cx_proxy_proto_error.fetch_add(1, Relaxed);
            }
            Outcome::Denied(v) => {
                if let Some(s) = version(*v) {
                    s.found.fetch_add(1, Relaxed);
                    s.disallowed.fetch_add(1, Relaxed);
                }
            }
            Outcome::Closed => {}
        }
    }
}

static STATS: OnceLock<Mutex<BTreeMap<String, Arc<Stats>>>> = OnceLock::new();

/// The counters of the filters with this `stat_prefix` (Envoy shares them the same way).
pub fn stats(prefix: &str) -> Arc<Stats> {
    let m = STATS.get_or_init(Mutex::default);
    let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = m.get(prefix) {
        return s.clone();
    }
    m.entry(prefix.to_string()).or_default().clone()
}

/// Every stat prefix seen and its counters, for rendering.
pub fn all_stats() -> Vec<(String, Arc<Stats>)> {
    let m = STATS.get_or_init(Mutex::default);
    let m = m.lock().unwrap_or_else(|p| p.into_inner());
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// Reads the header. Timeouts are the caller's (`listener_filters_timeout`).
pub async fn read(tcp: &mut TcpStream, cfg: &ProxyProtocol) -> Outcome {
    let mut buf = vec![0u8; INITIAL_PEEK];
    let mut last = 0;
    loop {
        let n = match tcp.peek(&mut buf).await {
            Ok(0) | Err(_) => return Outcome::Closed,
            Ok(n) => n,
        };
        if n > last {
            last = n;
            match parse(&buf[..n], cfg) {
                Parse::Done {
                    len,
                    version,
                    addrs,
                } => {
                    // Consume exactly the header; the rest belongs to whatever comes next.
                    let mut header = vec![0u8; len];
                    if tcp.read_exact(&mut header).await.is_err() {
                        return Outcome::Closed;
                    }
                    return Outcome::Found { version, addrs };
                }
                Parse::NotFound => return Outcome::NotFoundAllowed,
                Parse::Error(v) => return Outcome::Error(v),
                Parse::Denied(v) => return Outcome::Denied(v),
                Parse::More(want) => {
                    if want > buf.len() {
                        buf.resize(want, 0);
                    }
                }
            }
        }
        // More of the header is on its way; peek returns at once while data is queued.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The decision on the bytes seen so far.
#[derive(Debug, PartialEq, Eq)]
enum Parse {
    Done {
        len: usize,
        version: Version,
        addrs: Option<(SocketAddr, SocketAddr)>,
    },
    NotFound,
    Error(Version),
    Denied(Version),
    /// Wait for at least this many bytes (or just more, for a v1 line).
    More(usize),
}

/// Envoy's `readProxyHeader` + `parseBuffer` on a prefix of the stream.
fn parse(data: &[u8], cfg: &ProxyProtocol) -> Parse {
    let n = data.len();
    let prefix_of = |sig: &[u8]| data[..n.min(sig.len())] == sig[..n.min(sig.len())];
    if cfg.allow_without {
        let v2 = cfg.allow_v2 && prefix_of(V2_SIGNATURE);
        let v1 = cfg.allow_v1 && prefix_of(V1_SIGNATURE);
        if !v1 && !v2 {
            return Parse::NotFound;
        }
    }
    let mut version = Version::NotFound;
    if n >= V2_HEADER_LEN {
        if data[..12] == V2_SIGNATURE[..] {
            version = Version::V2;
        } else if data[..6] != V1_SIGNATURE[..] {
            return Parse::Error(Version::NotFound);
        }
    }
    if version == Version::V2 {
        if !cfg.allow_v2 {
            return Parse::Denied(Version::V2);
        }
        return parse_v2(data);
    }
    // A v1 line ends at the first CRLF (Envoy starts looking at the second byte).
    let mut end = None;
    for i in 1..n {
        if data[i] == b'\n' && data[i - 1] == b'\r' {
            if i == 1 {
                // Too short to tell a v2 signature from a v1 line yet.
                return Parse::More(n + 1);
            }
            end = Some(i + 1);
            break;
        }
    }
    match end {
        Some(len) if len > V1_MAX_LEN => Parse::Error(Version::V1),
        Some(_) if !cfg.allow_v1 => Parse::Denied(Version::V1),
        Some(len) => match parse_v1(&data[..len]) {
            Some(addrs) => Parse::Done {
                len,
                version: Version::V1,
                addrs,
            },
            None => Parse::Error(Version::V1),
        },
        None if n > V1_MAX_LEN => Parse::Error(Version::NotFound),
        None => Parse::More(n + 1),
    }
}

/// `PROXY TCP4|TCP6|UNKNOWN src dst sport dport\r\n`; Some(None) for UNKNOWN.
fn parse_v1(line: &[u8]) -> Option<Option<(SocketAddr, SocketAddr)>> {
    let text = std::str::from_utf8(line).ok()?;
    let parts: Vec<&str> = text
        .trim_end_matches(|c: char| c.is_ascii_whitespace())
        .split(' ')
        .filter(|p| !p.is_empty())
        .collect();
    if parts.len() < 2 || parts[0] != "PROXY" {
        return None;
    }
    if parts[1] == "UNKNOWN" {
        // The spec says to use the connection's own addresses.
        return Some(None);
    }
    if parts.len() != 6 {
        return None;
    }
    let port = |s: &str| -> Option<u16> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let (src, dst): (IpAddr, IpAddr) = match parts[1] {
        "TCP4" => (
            IpAddr::V4(parts[2].parse::<Ipv4Addr>().ok()?),
            IpAddr::V4(parts[3].parse::<Ipv4Addr>().ok()?),
        ),
        "TCP6" => (
            IpAddr::V6(parts[2].parse::<Ipv6Addr>().ok()?),
            IpAddr::V6(parts[3].parse::<Ipv6Addr>().ok()?),
        ),
        _ => return None,
    };
    let src = SocketAddr::new(src, port(parts[4])?);
    let dst = SocketAddr::new(dst, port(parts[5])?);
    if !unicast(src.ip()) || !unicast(dst.ip()) {
        return None;
    }
    Some(Some((src, dst)))
}

fn parse_v2(data: &[u8]) -> Parse {
    let ver_cmd = data[12];
    if ver_cmd >> 4 != 2 {
        return Parse::Error(Version::V2);
    }
    let family = data[13];
    let local = ver_cmd & 0x0f == 0;
    let addr_len = if local {
        0
    } else {
        match family >> 4 {
            1 => 12,
            2 => 36,
            _ => return Parse::Error(Version::V2),
        }
    };
    let declared = usize::from(u16::from_be_bytes([data[14], data[15]]));
    if declared < addr_len {
        return Parse::Error(Version::V2);
    }
    let total = V2_HEADER_LEN + declared;
    if local {
        // A health check from the balancer itself: addresses (and TLVs) are skipped.
        return if data.len() >= total {
            Parse::Done {
                len: total,
                version: Version::V2,
                addrs: None,
            }
        } else {
            Parse::More(total)
        };
    }
    if ver_cmd & 0x0f != 1 || !matches!(family & 0x0f, 1 | 2) {
        // Neither LOCAL nor PROXY, or neither STREAM nor DGRAM.
        return Parse::Error(Version::V2);
    }
    if data.len() < total {
        return Parse::More(total);
    }
    let a = &data[V2_HEADER_LEN..];
    let (src, dst) = if family >> 4 == 1 {
        let ip = |o: usize| IpAddr::V4(Ipv4Addr::new(a[o], a[o + 1], a[o + 2], a[o + 3]));
        let port = |o: usize| u16::from_be_bytes([a[o], a[o + 1]]);
        (
            SocketAddr::new(ip(0), port(8)),
            SocketAddr::new(ip(4), port(10)),
        )
    } else {
        let ip = |o: usize| {
            let mut b = [0u8; 16];
            b.copy_from_slice(&a[o..o + 16]);
            IpAddr::V6(Ipv6Addr::from(b))
        };
        let port = |o: usize| u16::from_be_bytes([a[o], a[o + 1]]);
        (
            SocketAddr::new(ip(0), port(32)),
            SocketAddr::new(ip(16), port(34)),
        )
    };
    if !tlvs_well_formed(&a[addr_len..declared]) {
        return Parse::Error(Version::V2);
    }
    if !unicast(src.ip()) || !unicast(dst.ip()) {
        return Parse::Error(Version::V2);
    }
    Parse::Done {
        len: total,
        version: Version::V2,
        addrs: Some((src, dst)),
    }
}

/// Type, 16-bit length, value, repeated to the end, as Envoy walks them (their values are
/// only kept for rules and pass-through, which Portico does not serve).
fn tlvs_well_formed(mut t: &[u8]) -> bool {
    while !t.is_empty() {
        if t.len() < 3 {
            return false;
        }
        let len = usize::from(u16::from_be_bytes([t[1], t[2]]));
        if t.len() < 3 + len {
            return false;
        }
        t = &t[3 + len..];
    }
    true
}

/// Envoy requires both addresses to be unicast: not unspecified, multicast or broadcast.
fn unicast(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !v4.is_unspecified() && !v4.is_multicast() && !v4.is_broadcast(),
        IpAddr::V6(v6) => !v6.is_unspecified() && !v6.is_multicast(),
    }
}

#[cfg(test)]
#[path = "proxy_protocol_tests.rs"]
mod proxy_protocol_tests;
