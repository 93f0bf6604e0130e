//! `filter_chain_match` and Envoy's filter chain selection.
//!
//! Envoy narrows the candidates one criterion at a time (destination port, server name,
//! transport protocol, application protocols) and never backtracks: once a more specific
//! entry matches at one level, the less specific ones at that level are out, even if nothing
//! below matches. No match at all means the default filter chain, or a closed connection.

use envoy_types::pb::envoy::config::listener::v3 as lpb;

/// The criteria of one filter chain, normalized as Envoy indexes them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChainMatch {
    /// 0: any port.
    pub destination_port: u16,
    /// Lowercased; a wildcard `*.example.com` is kept as `.example.com`.
    pub server_names: Vec<String>,
    /// Empty: any.
    pub transport_protocol: String,
    pub application_protocols: Vec<String>,
}

/// What the listener knows about a connection when it picks the chain.
#[derive(Debug, Clone, Copy)]
pub struct Conn<'a> {
    pub destination_port: u16,
    /// The SNI, lowercased; empty when there is none (or no TLS inspector).
    pub server_name: &'a str,
    /// `tls` or `raw_buffer`.
    pub transport_protocol: &'a str,
    pub application_protocols: &'a [String],
}

impl ChainMatch {
    pub fn translate(m: Option<&lpb::FilterChainMatch>) -> Result<ChainMatch, String> {
        let Some(m) = m else {
            return Ok(ChainMatch::default());
        };
        let unsupported = [
            ("prefix_ranges", !m.prefix_ranges.is_empty()),
            ("source_prefix_ranges", !m.source_prefix_ranges.is_empty()),
            (
                "direct_source_prefix_ranges",
                !m.direct_source_prefix_ranges.is_empty(),
            ),
            ("source_ports", !m.source_ports.is_empty()),
            ("source_type", m.source_type != 0),
        ];
        if let Some((field, _)) = unsupported.iter().find(|(_, set)| *set) {
            return Err(format!("filter_chain_match.{field} is not supported"));
        }
        if !m.address_suffix.is_empty() || m.suffix_len.is_some() {
            return Err("filter chain contains unimplemented fields".into());
        }
        let destination_port = match m.destination_port.as_ref().map(|p| p.value) {
            None => 0,
            Some(p) => u16::try_from(p)
                .map_err(|_| format!("filter_chain_match.destination_port {p} out of range"))?,
        };
        let mut server_names = Vec::with_capacity(m.server_names.len());
        for n in &m.server_names {
            let wildcard = n.starts_with("*.");
            if n.contains('*') && !wildcard {
                return Err("partial wildcards are not supported in \"server_names\"".into());
            }
            let n = n.to_ascii_lowercase();
            server_names.push(if wildcard { n[1..].to_string() } else { n });
        }
        Ok(ChainMatch {
            destination_port,
            server_names,
            transport_protocol: m.transport_protocol.clone(),
            application_protocols: m.application_protocols.clone(),
        })
    }

    /// Every (port, server name, transport, application protocol) leaf this match occupies.
    fn leaves(&self) -> Vec<(u16, &str, &str, &str)> {
        let names: Vec<&str> = if self.server_names.is_empty() {
            vec![""]
        } else {
            self.server_names.iter().map(String::as_str).collect()
        };
        let protos: Vec<&str> = if self.application_protocols.is_empty() {
            vec![""]
        } else {
            self.application_protocols
                .iter()
                .map(String::as_str)
                .collect()
        };
        let mut out = Vec::new();
        for n in &names {
            for p in &protos {
                out.push((
                    self.destination_port,
                    *n,
                    self.transport_protocol.as_str(),
                    *p,
                ));
            }
        }
        out
    }
}

/// Rejects chains Envoy would: identical matches, and matches sharing a leaf.
pub fn check_overlaps(chains: &[(&str, &ChainMatch)]) -> Result<(), String> {
    for (i, (name, m)) in chains.iter().enumerate() {
        if let Some((other, _)) = chains[..i].iter().find(|(_, o)| *o == *m) {
            return Err(format!(
                "filter chain '{name}' has the same matching rules defined as '{other}'"
            ));
        }
    }
    let mut seen = std::collections::HashSet::new();
    for (_, m) in chains {
        for leaf in m.leaves() {
            if !seen.insert(leaf) {
                return Err(
                    "multiple filter chains with overlapping matching rules are defined".into(),
                );
            }
        }
    }
    Ok(())
}

/// The index of the chain Envoy picks for `conn`, or None (the default chain, if any).
pub fn select(chains: &[ChainMatch], conn: &Conn<'_>) -> Option<usize> {
    let all: Vec<usize> = (0..chains.len()).collect();
    let on_port: Vec<usize> = all
        .iter()
        .copied()
        .filter(|&i| {
            chains[i].destination_port != 0 && chains[i].destination_port == conn.destination_port
        })
        .collect();
    // A chain for this very port shadows the catch-all port entirely.
    let candidates = if on_port.is_empty() {
        all.into_iter()
            .filter(|&i| chains[i].destination_port == 0)
            .collect()
    } else {
        on_port
    };
    let by_name = by_server_name(chains, &candidates, conn.server_name);
    let by_transport = narrow(
        &by_name,
        |i| chains[i].transport_protocol == conn.transport_protocol,
        |i| chains[i].transport_protocol.is_empty(),
    );
    let mut by_alpn = Vec::new();
    for p in conn.application_protocols {
        by_alpn = by_transport
            .iter()
            .copied()
            .filter(|&i| chains[i].application_protocols.contains(p))
            .collect();
        if !by_alpn.is_empty() {
            break;
        }
    }
    if by_alpn.is_empty() {
        by_alpn = by_transport
            .into_iter()
            .filter(|&i| chains[i].application_protocols.is_empty())
            .collect();
    }
    by_alpn.first().copied()
}

/// The exact-match subset if any, otherwise the catch-all subset.
fn narrow(c: &[usize], exact: impl Fn(usize) -> bool, any: impl Fn(usize) -> bool) -> Vec<usize> {
    let hit: Vec<usize> = c.iter().copied().filter(|&i| exact(i)).collect();
    if hit.is_empty() {
        c.iter().copied().filter(|&i| any(i)).collect()
    } else {
        hit
    }
}

/// Exact name, then wildcards from the longest suffix, then chains without server names.
fn by_server_name(chains: &[ChainMatch], c: &[usize], sni: &str) -> Vec<usize> {
    let with = |key: &str| -> Vec<usize> {
        c.iter()
            .copied()
            .filter(|&i| chains[i].server_names.iter().any(|n| n == key))
            .collect()
    };
    if !sni.is_empty() {
        let exact = with(sni);
        if !exact.is_empty() {
            return exact;
        }
        // ".b.example.com", then ".example.com", then ".com" for "a.b.example.com".
        let mut from = 1;
        while let Some(off) = sni.get(from..).and_then(|s| s.find('.')) {
            let pos = from + off;
            if pos + 1 >= sni.len() {
                break;
            }
            let hit = with(&sni[pos..]);
            if !hit.is_empty() {
                return hit;
            }
            from = pos + 1;
        }
    }
    c.iter()
        .copied()
        .filter(|&i| chains[i].server_names.is_empty())
        .collect()
}

#[cfg(test)]
#[path = "filter_chain_tests.rs"]
mod filter_chain_tests;
