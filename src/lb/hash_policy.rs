//! A route's `hash_policy` list: what part of a request the consistent-hash balancers hash.
//! Translation (from `RouteAction.hash_policy`) rejects what Envoy rejects; evaluation follows
//! Envoy's `HashPolicyImpl::generateHash` (values hashed with XXH64, policies combined by
//! rotating the running hash left by one and XORing, `terminal` stopping once a hash exists).

use std::net::IpAddr;
use std::time::Duration;

use envoy_types::pb::envoy::config::route::v3 as rpb;
use regex::Regex;

use super::hash::{xx64, xx64_chain};

#[derive(Debug)]
pub struct HashPolicy {
    pub kind: HashKind,
    pub terminal: bool,
}

#[derive(Debug)]
pub enum HashKind {
    Header {
        header: HeaderKey,
        rewrite: Option<(Regex, String)>,
    },
    Cookie(CookiePolicy),
    SourceIp,
    QueryParameter(String),
    /// Portico has no filter that stores hashable filter state, so this never yields a hash;
    /// Envoy likewise finds nothing under a key no filter set.
    FilterState(String),
}

/// Which request header a header policy reads.
#[derive(Debug)]
pub enum HeaderKey {
    Authority,
    Path,
    Method,
    Scheme,
    Name(http::HeaderName),
    /// A name no request can carry: valid config to Envoy, never hashes.
    Never,
}

#[derive(Debug)]
pub struct CookiePolicy {
    pub name: String,
    pub path: String,
    /// With a ttl, a request without the cookie gets one generated (and `set-cookie` on the
    /// response); without one such a request yields no hash.
    pub ttl: Option<Duration>,
    pub attributes: Vec<(String, String)>,
}

/// What a policy can read from a request.
pub struct HashInput<'a> {
    pub headers: &'a http::HeaderMap,
    pub authority: &'a str,
    /// Path with query.
    pub path: &'a str,
    pub method: &'a str,
    pub scheme: &'a str,
    /// The downstream address as Envoy's connection manager settled it (XFF-aware).
    pub source_ip: Option<IpAddr>,
}

/// The request hash of a policy list, or None when no policy produced one (Envoy then picks a
/// random host). `new_cookie` generates a cookie value for a cookie policy with a ttl whose
/// cookie the request lacks, and arranges the `set-cookie` on the response.
pub fn generate(
    policies: &[HashPolicy],
    input: &HashInput<'_>,
    mut new_cookie: impl FnMut(&CookiePolicy) -> String,
) -> Option<u64> {
    let mut hash: Option<u64> = None;
    for p in policies {
        if let Some(new) = p.evaluate(input, &mut new_cookie) {
            // Rotating keeps two identical policies from cancelling each other out.
            let old = hash.map_or(0, |h| h.rotate_left(1));
            hash = Some(old ^ new);
        }
        // A terminal policy ends the list only once some hash exists (its own or an earlier one).
        if p.terminal && hash.is_some() {
            break;
        }
    }
    hash
}

impl HashPolicy {
    fn evaluate(
        &self,
        input: &HashInput<'_>,
        new_cookie: &mut impl FnMut(&CookiePolicy) -> String,
    ) -> Option<u64> {
        match &self.kind {
            HashKind::Header { header, rewrite } => {
                let mut values: Vec<std::borrow::Cow<'_, [u8]>> = match header {
                    HeaderKey::Authority => vec![input.authority.as_bytes().into()],
                    HeaderKey::Path => vec![input.path.as_bytes().into()],
                    HeaderKey::Method => vec![input.method.as_bytes().into()],
                    HeaderKey::Scheme => vec![input.scheme.as_bytes().into()],
                    HeaderKey::Name(n) => input
                        .headers
                        .get_all(n)
                        .iter()
                        .map(|v| v.as_bytes().into())
                        .collect(),
                    HeaderKey::Never => Vec::new(),
                };
                if values.is_empty() {
                    return None;
                }
                if let Some((re, sub)) = rewrite {
                    for v in values.iter_mut() {
                        let s = String::from_utf8_lossy(v);
                        let replaced = re.replace_all(&s, sub.as_str()).into_owned();
                        *v = replaced.into_bytes().into();
                    }
                }
                // Sorted, so that the same values in another order hash the same.
                values.sort();
                Some(xx64_chain(values.iter().map(|v| v.as_ref())))
            }
            HashKind::Cookie(c) => match cookie_value(input.headers, &c.name) {
                Some(v) if !v.is_empty() => Some(xx64(v.as_bytes(), 0)),
                _ if c.ttl.is_some() => Some(xx64(new_cookie(c).as_bytes(), 0)),
                _ => None,
            },
            HashKind::SourceIp => input.source_ip.map(|ip| xx64(ip.to_string().as_bytes(), 0)),
            HashKind::QueryParameter(name) => {
                query_value(input.path, name).map(|v| xx64(v.as_bytes(), 0))
            }
            HashKind::FilterState(_) => None,
        }
    }
}

/// The first value of cookie `name` over all `cookie` headers, surrounding quotes removed.
pub fn cookie_value<'a>(headers: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| {
            let (k, v) = pair.trim_start_matches(' ').split_once('=')?;
            (k == name).then(|| {
                v.strip_prefix('"')
                    .and_then(|v| v.strip_suffix('"'))
                    .unwrap_or(v)
            })
        })
}

/// The first raw (undecoded) value of query parameter `name`; `?a` has the empty value.
fn query_value<'a>(path: &'a str, name: &str) -> Option<&'a str> {
    let query = path.split_once('?')?.1;
    let query = query.split_once('#').map_or(query, |(q, _)| q);
    query.split('&').find_map(|kv| match kv.split_once('=') {
        Some((k, v)) => (k == name).then_some(v),
        None => (kv == name).then_some(""),
    })
}

/// Envoy's `set-cookie` for a generated cookie: quoted value, `Max-Age` unless the ttl is zero,
/// `Path` when set, the configured attributes, then `HttpOnly`.
pub fn set_cookie_value(c: &CookiePolicy, value: &str) -> String {
    let mut out = format!("{}=\"{}\"", c.name, value);
    if let Some(ttl) = c.ttl.filter(|t| !t.is_zero()) {
        out.push_str(&format!("; Max-Age={}", ttl.as_secs()));
    }
    if !c.path.is_empty() {
        out.push_str(&format!("; Path={}", c.path));
    }
    for (k, v) in &c.attributes {
        if v.is_empty() {
            out.push_str(&format!("; {k}"));
        } else {
            out.push_str(&format!("; {k}={v}"));
        }
    }
    out.push_str("; HttpOnly");
    out
}

/// The value Envoy generates for a missing cookie: XXH64 of the connection's remote and local
/// addresses (`ip:port` each, concatenated) as 16 hex digits, so that requests racing on one
/// connection get the same cookie.
pub fn generated_cookie(remote: &str, local: &str) -> String {
    let mut key = String::with_capacity(remote.len() + local.len());
    key.push_str(remote);
    key.push_str(local);
    format!("{:016x}", xx64(key.as_bytes(), 0))
}

/// Translates `RouteAction.hash_policy`; errors name the list index and the field.
pub fn translate(list: &[rpb::route_action::HashPolicy]) -> Result<Vec<HashPolicy>, String> {
    let mut out = Vec::with_capacity(list.len());
    for (i, p) in list.iter().enumerate() {
        if let Some(p) = translate_one(p).map_err(|e| format!("hash_policy[{i}]: {e}"))? {
            out.push(p);
        }
    }
    Ok(out)
}

/// `Ok(None)`: a policy Envoy accepts and drops (`connection_properties` without `source_ip`).
fn translate_one(p: &rpb::route_action::HashPolicy) -> Result<Option<HashPolicy>, String> {
    use rpb::route_action::hash_policy::PolicySpecifier as P;
    let kind = match &p.policy_specifier {
        Some(P::Header(h)) => {
            if h.header_name.is_empty() {
                return Err("header.header_name must not be empty".into());
            }
            if h.header_name.bytes().any(|b| b == 0 || b == b'\r' || b == b'\n') {
                return Err(format!(
                    "header.header_name '{}' is not a valid header name",
                    h.header_name.escape_debug()
                ));
            }
            let lower = h.header_name.to_ascii_lowercase();
            let header = match lower.as_str() {
                // Envoy keeps HTTP/1's Host as `:authority`; so `host` names the authority
                // whatever the protocol.
                ":authority" | "host" => HeaderKey::Authority,
                ":path" => HeaderKey::Path,
                ":method" => HeaderKey::Method,
                ":scheme" => HeaderKey::Scheme,
                n => http::HeaderName::from_bytes(n.as_bytes())
                    .map(HeaderKey::Name)
                    .unwrap_or(HeaderKey::Never),
            };
            let rewrite = match &h.regex_rewrite {
                None => None,
                Some(r) => {
                    let pattern = r
                        .pattern
                        .as_ref()
                        .ok_or("header.regex_rewrite.pattern is required")?;
                    if pattern.regex.is_empty() {
                        return Err("header.regex_rewrite.pattern.regex must not be empty".into());
                    }
                    let re = Regex::new(&pattern.regex).map_err(|e| {
                        format!(
                            "header.regex_rewrite: invalid regex '{}': {}",
                            pattern.regex,
                            e.to_string().lines().last().unwrap_or("").trim()
                        )
                    })?;
                    Some((re, re2_substitution(&r.substitution)))
                }
            };
            HashKind::Header { header, rewrite }
        }
        Some(P::Cookie(c)) => {
            if c.name.is_empty() {
                return Err("cookie.name must not be empty".into());
            }
            let ttl = match &c.ttl {
                None => None,
                Some(d) => {
                    Some(crate::units::duration(d).map_err(|e| format!("cookie.ttl: {e}"))?)
                }
            };
            let attributes = c
                .attributes
                .iter()
                .enumerate()
                .map(|(j, a)| {
                    if a.name.is_empty() {
                        Err(format!("cookie.attributes[{j}].name must not be empty"))
                    } else {
                        Ok((a.name.clone(), a.value.clone()))
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            HashKind::Cookie(CookiePolicy {
                name: c.name.clone(),
                path: c.path.clone(),
                ttl,
                attributes,
            })
        }
        Some(P::ConnectionProperties(cp)) => {
            if !cp.source_ip {
                // Envoy adds no policy for it, so not even its `terminal` flag counts.
                return Ok(None);
            }
            HashKind::SourceIp
        }
        Some(P::QueryParameter(q)) => {
            if q.name.is_empty() {
                return Err("query_parameter.name must not be empty".into());
            }
            HashKind::QueryParameter(q.name.clone())
        }
        Some(P::FilterState(f)) => {
            if f.key.is_empty() {
                return Err("filter_state.key must not be empty".into());
            }
            HashKind::FilterState(f.key.clone())
        }
        None => {
            return Err(
                "one of header, cookie, connection_properties, query_parameter or filter_state is required"
                    .into(),
            )
        }
    };
    Ok(Some(HashPolicy {
        kind,
        terminal: p.terminal,
    }))
}

/// RE2's substitution syntax (`\1`, `\\`) in the regex crate's (`${1}`, `$` escaped as `$$`).
fn re2_substitution(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.peek().copied() {
                Some(d) if d.is_ascii_digit() => {
                    chars.next();
                    out.push_str(&format!("${{{d}}}"));
                }
                Some('\\') => {
                    chars.next();
                    out.push('\\');
                }
                _ => out.push('\\'),
            },
            '$' => out.push_str("$$"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
#[path = "hash_policy_tests.rs"]
mod hash_policy_tests;
