//! `envoy.filters.http.jwt_authn`: JWT authentication as Envoy's filter does it. Providers
//! (issuer, audiences, where tokens are found, what a good token leaves on the request) and
//! requirements (`rules` by route match, `requirement_map` by name; provider, provider with
//! audiences, `requires_any`, `requires_all`, `allow_missing`, `allow_missing_or_failed`) are
//! translated once; a request is checked against its route's `PerRouteConfig` (disabled, or a
//! `requirement_map` entry by name) when it has one, else the first rule that matches it.
//!
//! A failed requirement answers 401 (403 for `Audiences in Jwt are not allowed`) with
//! jwt_verify_lib's status string as the body, `www-authenticate: Bearer realm="<uri>"` (with
//! `, error="invalid_token"` unless the token is missing) and the details
//! `jwt_authn_access_denied{<status, spaces as underscores>}`. A good token's payload goes to
//! the dynamic metadata under `payload_in_metadata`; `forward_payload_header` and
//! `claim_to_headers` add headers (spoofed copies from the client are removed first); without
//! `forward` the token's header is removed.
//!
//! Keys come from `local_jwks` (inline, as istiod renders it by default) or `remote_jwks`:
//! fetched through the named cluster (`filters::callout::Upstreams`) when a token of that
//! provider first needs them, kept for `cache_duration` (Envoy's default 10 minutes) and
//! fetched again by the first request after that, so a rotated key set is picked up. A
//! request whose keys are being fetched waits for the fetch (bounded by `http_uri.timeout`);
//! a failed fetch (no answer, not 200, not a JWKS) answers `Jwks remote fetch is failed` and
//! the next request tries again. `async_fetch` is accepted: its background fetch is a warm-up
//! of the same cache (Portico's first request waits where Envoy's listener warms); a
//! `retry_policy` is refused. A JWKS `filename` is refused: translation reads no files.

mod verify;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3 as jpb;
use http::{HeaderName, HeaderValue};
use prost::Message;
use serde_json::Value;

use super::{
    Decision, FilterDecl, FilterState, HeaderOp, HttpFilter, LocalReply, Request, Translated,
};
use crate::matcher::{header_matcher, header_matches, HeaderMatcher, RequestView};
pub use verify::Status;
use verify::{Jwk, Jwt};

pub const TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication";
/// The dynamic metadata namespace the payloads go under.
pub const NAMESPACE: &str = "envoy.filters.http.jwt_authn";

/// Envoy's `http.<prefix>.jwt_authn.<stat_prefix>*` counters, in the connection manager's
/// scope (bound on the filter's first request; unbound in unit tests).
#[derive(Debug, Default)]
pub struct JwtStats {
    pub allowed: Arc<AtomicU64>,
    pub denied: Arc<AtomicU64>,
    pub cors_preflight_bypassed: Arc<AtomicU64>,
    pub jwks_fetch_success: Arc<AtomicU64>,
    pub jwks_fetch_failed: Arc<AtomicU64>,
    pub jwt_cache_hit: Arc<AtomicU64>,
    pub jwt_cache_miss: Arc<AtomicU64>,
}

impl JwtStats {
    fn resolve(named: &crate::filters::counters::NamedCounters, prefix: &str) -> JwtStats {
        let c = |n: &str| named.get(&format!("jwt_authn.{prefix}{n}"));
        JwtStats {
            allowed: c("allowed"),
            denied: c("denied"),
            cors_preflight_bypassed: c("cors_preflight_bypassed"),
            jwks_fetch_success: c("jwks_fetch_success"),
            jwks_fetch_failed: c("jwks_fetch_failed"),
            jwt_cache_hit: c("jwt_cache_hit"),
            jwt_cache_miss: c("jwt_cache_miss"),
        }
    }
}

/// Where a provider looks for tokens.
#[derive(Debug, Clone, PartialEq)]
pub enum Location {
    /// A header, and the prefix its value must contain (the token follows it).
    Header(HeaderName, String),
    Param(String),
    Cookie(String),
}

#[derive(Debug)]
pub struct Provider {
    pub name: String,
    pub issuer: String,
    pub audiences: Vec<String>,
    pub forward: bool,
    pub locations: Vec<Location>,
    pub forward_payload_header: Option<HeaderName>,
    pub pad_forward_payload_header: bool,
    pub payload_in_metadata: String,
    pub header_in_metadata: String,
    pub space_delimited_claims: Vec<String>,
    pub claim_to_headers: Vec<(HeaderName, String)>,
    pub clock_skew: u64,
    pub clear_route_cache: bool,
    pub keys: Keys,
}

/// Where a provider's keys come from.
#[derive(Debug)]
pub enum Keys {
    Local(Vec<Jwk>),
    Remote(Box<RemoteJwks>),
}

/// `remote_jwks`: the fetch and its cache.
#[derive(Debug)]
pub struct RemoteJwks {
    pub cluster: String,
    pub authority: String,
    pub path: String,
    pub timeout: std::time::Duration,
    pub cache_duration: std::time::Duration,
    /// The key set and when it was fetched.
    cached: std::sync::RwLock<Option<(std::time::Instant, std::sync::Arc<Vec<Jwk>>)>>,
}

impl RemoteJwks {
    fn fresh(&self) -> Option<std::sync::Arc<Vec<Jwk>>> {
        let c = self.cached.read().unwrap_or_else(|p| p.into_inner());
        c.as_ref()
            .filter(|(at, _)| at.elapsed() < self.cache_duration)
            .map(|(_, k)| k.clone())
    }

    /// Fetches the key set through the cluster; true when it was stored.
    async fn fetch(&self, up: &dyn super::callout::Upstreams) -> bool {
        let req = super::callout::CalloutRequest {
            method: http::Method::GET,
            path: self.path.clone(),
            authority: self.authority.clone(),
            headers: http::HeaderMap::new(),
            body: bytes::Bytes::new(),
            timeout: self.timeout,
            grpc: false,
        };
        let keys = match up.call(&self.cluster, req).await {
            Ok(r) if r.status == 200 => {
                verify::parse_jwks(std::str::from_utf8(&r.body).unwrap_or(""))
            }
            Ok(r) => {
                tracing::debug!(cluster = %self.cluster, status = r.status, "JWKS fetch failed");
                return false;
            }
            Err(e) => {
                tracing::debug!(cluster = %self.cluster, "JWKS fetch failed: {e}");
                return false;
            }
        };
        if keys.is_empty() {
            return false;
        }
        *self.cached.write().unwrap_or_else(|p| p.into_inner()) =
            Some((std::time::Instant::now(), std::sync::Arc::new(keys)));
        true
    }
}

/// Splits `http://host[:port]/path?query` into (authority, path and query).
fn split_uri(uri: &str) -> Option<(String, String)> {
    let rest = uri
        .strip_prefix("http://")
        .or_else(|| uri.strip_prefix("https://"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.is_empty() {
        return None;
    }
    Some((authority.to_string(), path.to_string()))
}

/// A requirement, with providers by index into the filter's list.
#[derive(Debug)]
pub enum Requirement {
    Provider(usize, Option<Vec<String>>),
    Any {
        children: Vec<Requirement>,
        allow_missing: bool,
    },
    All(Vec<Requirement>),
    AllowMissing,
    AllowMissingOrFailed,
}

/// A rule's route match (the subset of `RouteMatch` the filter accepts).
#[derive(Debug)]
pub struct RuleMatch {
    pub path: PathMatch,
    pub case_sensitive: bool,
    pub headers: Vec<HeaderMatcher>,
}

#[derive(Debug)]
pub enum PathMatch {
    Prefix(String),
    Exact(String),
    SeparatedPrefix(String),
    Regex(regex::Regex),
}

#[derive(Debug)]
pub struct JwtAuthnFilter {
    pub name: String,
    pub stat_prefix: String,
    pub providers: Vec<Provider>,
    /// In order; the first that matches decides (None: no verification).
    pub rules: Vec<(RuleMatch, Option<std::sync::Arc<Requirement>>)>,
    /// `requirement_map`, which a route's `PerRouteConfig` names (it then decides in place of
    /// `rules`).
    pub requirement_map: std::collections::HashMap<String, std::sync::Arc<Requirement>>,
    pub bypass_cors_preflight: bool,
    pub strip_failure_response: bool,
    pub stats: OnceLock<JwtStats>,
}

fn header_name(s: &str, field: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(s.to_ascii_lowercase().as_bytes())
        .map_err(|_| format!("{field}: '{s}' is not a valid header name"))
}

fn provider(name: &str, p: &jpb::JwtProvider) -> Result<Provider, String> {
    let at = |f: &str| format!("providers['{name}'].{f}");
    if p.subjects.is_some() {
        return Err(format!("{}: not supported", at("subjects")));
    }
    if p.require_expiration {
        return Err(format!("{}: not supported", at("require_expiration")));
    }
    if p.max_lifetime.is_some() {
        return Err(format!("{}: not supported", at("max_lifetime")));
    }
    if !p.failed_status_in_metadata.is_empty() {
        return Err(format!(
            "{}: not supported",
            at("failed_status_in_metadata")
        ));
    }
    let keys = match &p.jwks_source_specifier {
        Some(jpb::jwt_provider::JwksSourceSpecifier::LocalJwks(ds)) => {
            Keys::Local(match &ds.specifier {
                Some(Specifier::InlineString(s)) => verify::parse_jwks(s),
                Some(Specifier::InlineBytes(b)) => {
                    verify::parse_jwks(std::str::from_utf8(b).unwrap_or(""))
                }
                Some(Specifier::Filename(_)) => {
                    return Err(format!(
                        "{}: a JWKS file is not supported (inline the JWKS)",
                        at("local_jwks.filename")
                    ))
                }
                _ => {
                    return Err(format!(
                        "{}: only inline_string and inline_bytes are supported",
                        at("local_jwks")
                    ))
                }
            })
        }
        Some(jpb::jwt_provider::JwksSourceSpecifier::RemoteJwks(r)) => {
            if r.retry_policy.is_some() {
                return Err(format!(
                    "{}: not supported (a failed fetch is tried again by the next request)",
                    at("remote_jwks.retry_policy")
                ));
            }
            let uri = r
                .http_uri
                .as_ref()
                .ok_or(format!("{}: is required", at("remote_jwks.http_uri")))?;
            use envoy_types::pb::envoy::config::core::v3::http_uri::HttpUpstreamType as U;
            let cluster = match &uri.http_upstream_type {
                Some(U::Cluster(c)) if !c.is_empty() => c.clone(),
                _ => {
                    return Err(format!(
                        "{}: is required",
                        at("remote_jwks.http_uri.cluster")
                    ))
                }
            };
            let (authority, path) = split_uri(&uri.uri).ok_or(format!(
                "{}: '{}' is not an http(s) URI",
                at("remote_jwks.http_uri.uri"),
                uri.uri
            ))?;
            let timeout = match &uri.timeout {
                Some(d) => crate::units::duration(d)
                    .map_err(|e| format!("{}: {e}", at("remote_jwks.http_uri.timeout")))?,
                None => {
                    return Err(format!(
                        "{}: is required",
                        at("remote_jwks.http_uri.timeout")
                    ))
                }
            };
            let cache_duration = match &r.cache_duration {
                Some(d) => crate::units::duration(d)
                    .map_err(|e| format!("{}: {e}", at("remote_jwks.cache_duration")))?,
                None => std::time::Duration::from_secs(600),
            };
            Keys::Remote(Box::new(RemoteJwks {
                cluster,
                authority,
                path,
                timeout,
                cache_duration,
                cached: Default::default(),
            }))
        }
        None => {
            return Err(format!(
                "{}: one of local_jwks or remote_jwks is required",
                at("jwks_source_specifier")
            ))
        }
    };
    let mut locations = Vec::new();
    for (i, h) in p.from_headers.iter().enumerate() {
        locations.push(Location::Header(
            header_name(&h.name, &at(&format!("from_headers[{i}].name")))?,
            h.value_prefix.clone(),
        ));
    }
    locations.extend(p.from_params.iter().cloned().map(Location::Param));
    locations.extend(p.from_cookies.iter().cloned().map(Location::Cookie));
    if locations.is_empty() {
        locations.push(Location::Header(
            http::header::AUTHORIZATION,
            "Bearer ".to_string(),
        ));
        locations.push(Location::Param("access_token".to_string()));
    }
    let forward_payload_header = if p.forward_payload_header.is_empty() {
        None
    } else {
        Some(header_name(
            &p.forward_payload_header,
            &at("forward_payload_header"),
        )?)
    };
    let claim_to_headers = p
        .claim_to_headers
        .iter()
        .enumerate()
        .map(|(i, c)| {
            if !c.claim_path.is_empty() {
                return Err(format!(
                    "{}: not supported",
                    at(&format!("claim_to_headers[{i}].claim_path"))
                ));
            }
            Ok((
                header_name(
                    &c.header_name,
                    &at(&format!("claim_to_headers[{i}].header_name")),
                )?,
                c.claim_name.clone(),
            ))
        })
        .collect::<Result<_, String>>()?;
    Ok(Provider {
        name: name.to_string(),
        issuer: p.issuer.clone(),
        audiences: p.audiences.clone(),
        forward: p.forward,
        locations,
        forward_payload_header,
        pad_forward_payload_header: p.pad_forward_payload_header,
        payload_in_metadata: p.payload_in_metadata.clone(),
        header_in_metadata: p.header_in_metadata.clone(),
        space_delimited_claims: p
            .normalize_payload_in_metadata
            .as_ref()
            .map(|n| n.space_delimited_claims.clone())
            .unwrap_or_default(),
        claim_to_headers,
        clock_skew: if p.clock_skew_seconds > 0 {
            u64::from(p.clock_skew_seconds)
        } else {
            60
        },
        clear_route_cache: p.clear_route_cache,
        keys,
    })
}

fn requirement(r: &jpb::JwtRequirement, names: &[String], at: &str) -> Result<Requirement, String> {
    use jpb::jwt_requirement::RequiresType as T;
    let find = |n: &str, f: &str| {
        names.iter().position(|p| p == n).ok_or_else(|| {
            format!("{at}.{f}: Wrong requirement: provider '{n}' is not in providers")
        })
    };
    Ok(match &r.requires_type {
        Some(T::ProviderName(n)) => Requirement::Provider(find(n, "provider_name")?, None),
        Some(T::ProviderAndAudiences(pa)) => Requirement::Provider(
            find(&pa.provider_name, "provider_and_audiences.provider_name")?,
            Some(pa.audiences.clone()),
        ),
        Some(T::RequiresAny(l)) => {
            let mut children = Vec::new();
            let mut allow_missing = false;
            for (i, c) in l.requirements.iter().enumerate() {
                if matches!(c.requires_type, Some(T::AllowMissing(_))) {
                    allow_missing = true;
                } else {
                    children.push(requirement(c, names, &format!("{at}.requires_any[{i}]"))?);
                }
            }
            Requirement::Any {
                children,
                allow_missing,
            }
        }
        Some(T::RequiresAll(l)) => Requirement::All(
            l.requirements
                .iter()
                .enumerate()
                .map(|(i, c)| requirement(c, names, &format!("{at}.requires_all[{i}]")))
                .collect::<Result<_, _>>()?,
        ),
        Some(T::AllowMissing(_)) => Requirement::AllowMissing,
        Some(T::AllowMissingOrFailed(_)) => Requirement::AllowMissingOrFailed,
        Some(T::ExtractOnlyWithoutValidation(_)) => {
            return Err(format!(
                "{at}.extract_only_without_validation: not supported"
            ))
        }
        None => return Err(format!("{at}: requires_type is required")),
    })
}

fn rule_match(m: &rpb::RouteMatch, at: &str) -> Result<RuleMatch, String> {
    use rpb::route_match::PathSpecifier as P;
    let case_sensitive = m.case_sensitive.as_ref().is_none_or(|b| b.value);
    let fold = |s: &str| {
        if case_sensitive {
            s.to_string()
        } else {
            s.to_ascii_lowercase()
        }
    };
    let path = match &m.path_specifier {
        Some(P::Prefix(p)) => PathMatch::Prefix(fold(p)),
        Some(P::Path(p)) => PathMatch::Exact(fold(p)),
        Some(P::PathSeparatedPrefix(p)) => PathMatch::SeparatedPrefix(fold(p)),
        Some(P::SafeRegex(re)) => PathMatch::Regex(
            crate::matcher::compile_full_regex(&re.regex)
                .map_err(|e| format!("{at}.safe_regex: {e}"))?,
        ),
        _ => {
            return Err(format!(
                "{at}: only prefix, path, safe_regex and path_separated_prefix are supported"
            ))
        }
    };
    if !m.query_parameters.is_empty() {
        return Err(format!("{at}.query_parameters: not supported"));
    }
    if m.grpc.is_some()
        || m.runtime_fraction.is_some()
        || m.tls_context.is_some()
        || !m.dynamic_metadata.is_empty()
    {
        return Err(format!(
            "{at}: only the path, case_sensitive and headers are supported"
        ));
    }
    let headers = m
        .headers
        .iter()
        .enumerate()
        .map(|(i, h)| header_matcher(h).map_err(|e| format!("{at}.headers[{i}]: {e}")))
        .collect::<Result<_, _>>()?;
    Ok(RuleMatch {
        path,
        case_sensitive,
        headers,
    })
}

impl RuleMatch {
    fn matches(&self, req: &RequestView<'_>) -> bool {
        let path = req.path_only();
        let lower;
        let p = if self.case_sensitive {
            path
        } else {
            lower = path.to_ascii_lowercase();
            &lower
        };
        let ok = match &self.path {
            PathMatch::Prefix(x) => p.starts_with(x.as_str()),
            PathMatch::Exact(x) => p == x,
            PathMatch::SeparatedPrefix(x) => {
                p.starts_with(x.as_str()) && (p.len() == x.len() || p.as_bytes()[x.len()] == b'/')
            }
            PathMatch::Regex(re) => re.is_match(path),
        };
        ok && self.headers.iter().all(|h| header_matches(h, req))
    }
}

pub fn translate(name: &str, c: &jpb::JwtAuthentication) -> Result<JwtAuthnFilter, String> {
    if c.filter_state_rules.is_some() {
        return Err("filter_state_rules: not supported".into());
    }
    // Sorted: providers keep a stable order whatever the map's.
    let mut names: Vec<String> = c.providers.keys().cloned().collect();
    names.sort();
    let providers = names
        .iter()
        .map(|n| provider(n, &c.providers[n]))
        .collect::<Result<Vec<_>, _>>()?;
    let mut map = std::collections::HashMap::new();
    for (k, r) in &c.requirement_map {
        map.insert(
            k.clone(),
            std::sync::Arc::new(requirement(r, &names, &format!("requirement_map['{k}']"))?),
        );
    }
    let mut rules = Vec::new();
    for (i, r) in c.rules.iter().enumerate() {
        let at = format!("rules[{i}]");
        let m = rule_match(
            r.r#match
                .as_ref()
                .ok_or_else(|| format!("{at}.match: required"))?,
            &format!("{at}.match"),
        )?;
        use jpb::requirement_rule::RequirementType as RT;
        let req =
            match &r.requirement_type {
                None => None,
                Some(RT::Requires(q)) => Some(std::sync::Arc::new(requirement(
                    q,
                    &names,
                    &format!("{at}.requires"),
                )?)),
                Some(RT::RequirementName(n)) => Some(map.get(n).cloned().ok_or_else(|| {
                    format!("{at}.requirement_name: {}", wrong_requirement(n, &map))
                })?),
            };
        rules.push((m, req));
    }
    Ok(JwtAuthnFilter {
        name: name.to_string(),
        stat_prefix: c.stat_prefix.clone(),
        providers,
        rules,
        requirement_map: map,
        bypass_cors_preflight: c.bypass_cors_preflight,
        strip_failure_response: c.strip_failure_response,
        stats: OnceLock::new(),
    })
}

/// Envoy's words for a requirement name the map does not hold (its names sorted: Envoy lists
/// them in its map's order, which no config fixes).
fn wrong_requirement<T>(name: &str, map: &std::collections::HashMap<String, T>) -> String {
    let mut names: Vec<&str> = map.keys().map(String::as_str).collect();
    names.sort_unstable();
    format!(
        "Wrong requirement_name: {name}. It should be one of [{}]",
        names.join(",")
    )
}

/// A route's word to the filter (`PerRouteConfig`, the most specific level's): no
/// verification, or the requirement of that name in the filter's `requirement_map`. Envoy
/// Gateway's JWT policies are written this way, with no `rules` at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerRoute {
    Disabled,
    Requirement(String),
}

pub const PER_ROUTE_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.PerRouteConfig";

/// The `PerRouteConfig`s of one level's `typed_per_filter_config`, by filter name.
pub fn per_route(
    map: &std::collections::HashMap<String, envoy_types::pb::google::protobuf::Any>,
) -> Result<Vec<(String, std::sync::Arc<PerRoute>)>, String> {
    let mut out = Vec::new();
    for (name, a) in map {
        if a.type_url != PER_ROUTE_TYPE {
            continue;
        }
        let at = format!("typed_per_filter_config['{name}']");
        let c = jpb::PerRouteConfig::decode(a.value.as_slice())
            .map_err(|e| format!("{at}: cannot decode PerRouteConfig: {e}"))?;
        use jpb::per_route_config::RequirementSpecifier as S;
        let p = match c.requirement_specifier {
            Some(S::Disabled(true)) => PerRoute::Disabled,
            Some(S::Disabled(false)) => {
                return Err(format!("{at}.disabled: value must equal true"));
            }
            Some(S::RequirementName(n)) if !n.is_empty() => PerRoute::Requirement(n),
            Some(S::RequirementName(_)) => {
                return Err(format!(
                    "{at}.requirement_name: value length must be at least 1 characters"
                ));
            }
            None => return Err(format!("{at}: requirement_specifier is required")),
        };
        out.push((name.clone(), std::sync::Arc::new(p)));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

pub fn translate_filter(d: &FilterDecl<'_>) -> Result<Translated, String> {
    let c = jpb::JwtAuthentication::decode(d.config.value.as_slice())
        .map_err(|e| format!("cannot decode: {e}"))?;
    Ok(Translated::Run(HttpFilter::JwtAuthn(Box::new(translate(
        d.name, &c,
    )?))))
}

/// One extracted token: where it was found, which providers' issuers may use that place.
struct Token<'r> {
    value: &'r str,
    /// The header it came in (removed when not forwarded).
    header: Option<&'r HeaderName>,
    /// Issuers configured for the location; empty string: any.
    issuers: Vec<&'r str>,
}

/// Per request: what verified tokens leave on the request.
#[derive(Default)]
struct Outputs {
    ops: Vec<HeaderOp>,
    metadata: Vec<(String, Value)>,
    clear_route_cache: bool,
    /// Providers whose remote keys must be fetched before this request can be decided.
    fetch: Vec<usize>,
    /// The fetch this request waited for is over: stale keys now mean it failed.
    fetched: bool,
}

fn cookie<'r>(req: &RequestView<'r>, name: &str) -> Option<&'r str> {
    req.headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|kv| {
            let (k, v) = kv.trim().split_once('=')?;
            (k == name).then(|| v.trim_matches('"'))
        })
}

fn param<'r>(req: &RequestView<'r>, name: &str) -> Option<&'r str> {
    req.query()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == name).then_some(v)
    })
}

/// The token after a value prefix: from the first base64url (or dot) character after it to
/// the end (Envoy's `extractJWT`).
fn after_prefix<'r>(v: &'r str, prefix: &str) -> Option<&'r str> {
    if prefix.is_empty() {
        return Some(v);
    }
    let pos = v.find(prefix)? + prefix.len();
    let rest = &v[pos..];
    let start = rest.find(|c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    Some(start.map_or(v, |s| &rest[s..]))
}

impl JwtAuthnFilter {
    /// Tokens at the locations of `providers`, headers first (by header then prefix, as
    /// Envoy's ordered map), then params, then cookies; each location once.
    fn extract<'r>(&'r self, req: &RequestView<'r>, providers: &[usize]) -> Vec<Token<'r>> {
        let mut locs: Vec<(&'r Location, Vec<&'r str>)> = Vec::new();
        for &i in providers {
            let p = &self.providers[i];
            for l in &p.locations {
                match locs.iter_mut().find(|(x, _)| *x == l) {
                    Some((_, iss)) => iss.push(&p.issuer),
                    None => locs.push((l, vec![&p.issuer])),
                }
            }
        }
        let rank = |l: &Location| match l {
            Location::Header(h, p) => (0, format!("{}{p}", h.as_str())),
            Location::Param(p) => (1, p.clone()),
            Location::Cookie(c) => (2, c.clone()),
        };
        locs.sort_by_key(|(l, _)| rank(l));
        let mut out = Vec::new();
        for (l, issuers) in locs {
            match l {
                Location::Header(h, prefix) => {
                    for v in req.headers.get_all(h).iter() {
                        let Ok(v) = v.to_str() else { continue };
                        if let Some(t) = after_prefix(v, prefix) {
                            out.push(Token {
                                value: t,
                                header: Some(h),
                                issuers: issuers.clone(),
                            });
                        }
                    }
                }
                Location::Param(n) => {
                    if let Some(v) = param(req, n) {
                        out.push(Token {
                            value: v,
                            header: None,
                            issuers,
                        });
                    }
                }
                Location::Cookie(n) => {
                    if let Some(v) = cookie(req, n) {
                        out.push(Token {
                            value: v,
                            header: None,
                            issuers,
                        });
                    }
                }
            }
        }
        out
    }

    fn sanitize(&self, providers: &[usize], o: &mut Outputs) {
        for &i in providers {
            let p = &self.providers[i];
            for h in p
                .forward_payload_header
                .iter()
                .chain(p.claim_to_headers.iter().map(|(h, _)| h))
            {
                o.ops.push(HeaderOp::Remove(h.clone()));
            }
        }
    }

    /// The authenticator: every token must verify (`provider` given: against that provider;
    /// else against the provider of the token's issuer); `allow_failed` / `allow_missing` as
    /// Envoy's.
    #[allow(clippy::too_many_arguments)] // Envoy's authenticator state, passed flat
    fn authenticate(
        &self,
        tokens: Vec<Token<'_>>,
        provider: Option<usize>,
        audiences: Option<&[String]>,
        allow_failed: bool,
        allow_missing: bool,
        now: u64,
        o: &mut Outputs,
    ) -> Status {
        if tokens.is_empty() {
            return if allow_failed || allow_missing {
                Status::Ok
            } else {
                Status::JwtMissed
            };
        }
        // Envoy pops tokens from the back; unless failures are allowed, the first bad one
        // decides, else the last one verified does.
        let mut last = Status::Ok;
        for t in tokens.iter().rev() {
            last = self.verify_one(t, provider, audiences, now, o);
            if last != Status::Ok && !allow_failed && !allow_missing {
                return last;
            }
        }
        if allow_failed {
            Status::Ok
        } else {
            last
        }
    }

    fn verify_one(
        &self,
        t: &Token<'_>,
        provider: Option<usize>,
        audiences: Option<&[String]>,
        now: u64,
        o: &mut Outputs,
    ) -> Status {
        let jwt = match Jwt::parse(t.value) {
            Ok(j) => j,
            Err(s) => return s,
        };
        if !t.issuers.iter().any(|i| i.is_empty() || *i == jwt.iss) {
            return Status::JwtUnknownIssuer;
        }
        let p = match provider {
            Some(i) => &self.providers[i],
            None => match self
                .providers
                .iter()
                .find(|p| p.issuer == jwt.iss)
                .or_else(|| self.providers.iter().find(|p| p.issuer.is_empty()))
            {
                Some(p) => p,
                None => return Status::JwtUnknownIssuer,
            },
        };
        let s = jwt.check_time(now, p.clock_skew);
        if s != Status::Ok {
            return s;
        }
        if !audiences_allowed(audiences.unwrap_or(&p.audiences), &jwt.audiences) {
            return Status::JwtAudienceNotAllowed;
        }
        let remote;
        let keys: &[Jwk] = match &p.keys {
            Keys::Local(k) => k,
            Keys::Remote(r) => match r.fresh() {
                Some(k) => {
                    remote = k;
                    &remote
                }
                None if o.fetched => return Status::JwksFetchFail,
                None => {
                    let i = self
                        .providers
                        .iter()
                        .position(|x| std::ptr::eq(x, p))
                        .unwrap_or(0);
                    if !o.fetch.contains(&i) {
                        o.fetch.push(i);
                    }
                    return Status::JwksFetchFail;
                }
            },
        };
        let s = verify::verify_signature(&jwt, keys);
        if s != Status::Ok {
            return s;
        }
        self.good(p, t, jwt, o);
        Status::Ok
    }

    fn good(&self, p: &Provider, t: &Token<'_>, jwt: Jwt<'_>, o: &mut Outputs) {
        let before = o.ops.len();
        if let Some(h) = &p.forward_payload_header {
            let mut v = jwt.payload_b64.to_string();
            if p.pad_forward_payload_header {
                while !v.len().is_multiple_of(4) {
                    v.push('=');
                }
            }
            if let Ok(v) = HeaderValue::from_str(&v) {
                o.ops.push(HeaderOp::Append(h.clone(), v));
            }
        }
        for (h, claim) in &p.claim_to_headers {
            let v = match claim_value(&jwt.payload, claim) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Bool(b)) => b.to_string(),
                Some(Value::Number(n)) => match n.as_u64() {
                    Some(u) => u.to_string(),
                    None => format!("{:.6}", n.as_f64().unwrap_or(0.0)),
                },
                _ => continue,
            };
            if v.is_empty() {
                continue;
            }
            if let Ok(v) = HeaderValue::from_str(&v) {
                o.ops.push(HeaderOp::Append(h.clone(), v));
            }
        }
        o.clear_route_cache |= p.clear_route_cache && o.ops.len() > before;
        if !p.forward {
            if let Some(h) = t.header {
                o.ops.push(HeaderOp::Remove(h.clone()));
            }
        }
        if !p.payload_in_metadata.is_empty() {
            let mut payload = jwt.payload;
            for c in &p.space_delimited_claims {
                if let Some(Value::String(s)) = payload.get(c) {
                    let list = s
                        .split(' ')
                        .filter(|x| !x.is_empty())
                        .map(|x| Value::String(x.to_string()))
                        .collect();
                    payload.insert(c.clone(), Value::Array(list));
                }
            }
            o.metadata
                .push((p.payload_in_metadata.clone(), Value::Object(payload)));
        }
    }

    fn check(&self, r: &Requirement, req: &RequestView<'_>, now: u64, o: &mut Outputs) -> Status {
        match r {
            Requirement::Provider(i, aud) => {
                self.sanitize(&[*i], o);
                let tokens = self.extract(req, &[*i]);
                self.authenticate(tokens, Some(*i), aud.as_deref(), false, false, now, o)
            }
            Requirement::AllowMissing | Requirement::AllowMissingOrFailed => {
                let all: Vec<usize> = (0..self.providers.len()).collect();
                self.sanitize(&all, o);
                let tokens = self.extract(req, &all);
                let failed = matches!(r, Requirement::AllowMissingOrFailed);
                self.authenticate(tokens, None, None, failed, !failed, now, o)
            }
            Requirement::All(children) => {
                for c in children {
                    let s = self.check(c, req, now, o);
                    if s != Status::Ok {
                        return s;
                    }
                }
                Status::Ok
            }
            Requirement::Any {
                children,
                allow_missing,
            } => {
                let mut last = Status::JwtMissed;
                for c in children {
                    let s = self.check(c, req, now, o);
                    if s == Status::Ok {
                        return s;
                    }
                    if s != Status::JwtMissed && s != Status::JwtUnknownIssuer {
                        last = s;
                    }
                }
                if *allow_missing && last == Status::JwtMissed {
                    Status::Ok
                } else {
                    last
                }
            }
        }
    }

    /// The requirement for this request: the route's word when it has one for this filter,
    /// else the first rule that matches. Err: the route names a requirement the filter does
    /// not have (Envoy's message).
    fn requirement(&self, req: &Request<'_>) -> Result<Option<&Requirement>, String> {
        match req.route.and_then(|r| r.jwt_override(&self.name)) {
            Some(PerRoute::Disabled) => Ok(None),
            Some(PerRoute::Requirement(n)) => match self.requirement_map.get(n) {
                Some(r) => Ok(Some(r)),
                None => Err(wrong_requirement(n, &self.requirement_map)),
            },
            None => Ok(self
                .rules
                .iter()
                .find(|(m, _)| m.matches(req.view))
                .and_then(|(_, r)| r.as_deref())),
        }
    }

    fn stats(&self) -> &JwtStats {
        self.stats.get_or_init(JwtStats::default)
    }

    pub fn decode(
        &self,
        req: &Request<'_>,
        st: &mut FilterState,
        named: &crate::filters::counters::NamedCounters,
    ) -> Decision {
        self.stats
            .get_or_init(|| JwtStats::resolve(named, &self.stat_prefix));
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.decode_at(req, st, now)
    }

    pub fn decode_at(&self, req: &Request<'_>, st: &mut FilterState, now: u64) -> Decision {
        self.decide(req, st, now, false)
    }

    /// The keys a token needs were stale: fetch them (each once), then decide.
    pub async fn decode_async(&self, req: &Request<'_>, st: &mut FilterState) -> Decision {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut o = Outputs::default();
        if let Ok(Some(r)) = self.requirement(req) {
            let _ = self.check(r, req.view, now, &mut o);
        }
        for i in o.fetch {
            if let (Keys::Remote(r), Some(up)) = (&self.providers[i].keys, req.upstreams) {
                if r.fetch(up).await {
                    self.stats().jwks_fetch_success.fetch_add(1, Relaxed);
                } else {
                    self.stats().jwks_fetch_failed.fetch_add(1, Relaxed);
                }
            }
        }
        self.decide(req, st, now, true)
    }

    fn decide(&self, req: &Request<'_>, st: &mut FilterState, now: u64, fetched: bool) -> Decision {
        let v = req.view;
        if self.bypass_cors_preflight
            && v.method == "OPTIONS"
            && v.headers
                .get(http::header::ORIGIN)
                .is_some_and(|x| !x.is_empty())
            && v.headers
                .get(http::header::ACCESS_CONTROL_REQUEST_METHOD)
                .is_some_and(|x| !x.is_empty())
        {
            self.stats().cors_preflight_bypassed.fetch_add(1, Relaxed);
            self.stats().allowed.fetch_add(1, Relaxed);
            return Decision::Continue;
        }
        let r = match self.requirement(req) {
            Ok(Some(r)) => r,
            Ok(None) => {
                self.stats().allowed.fetch_add(1, Relaxed);
                return Decision::Continue;
            }
            Err(msg) => {
                // Envoy's 403, whatever `strip_failure_response` says.
                self.stats().denied.fetch_add(1, Relaxed);
                return Decision::Reply(LocalReply {
                    status: 403,
                    body: Some(bytes::Bytes::from(format!(
                        "Failed JWT authentication: {msg}"
                    ))),
                    headers: Vec::new(),
                    grpc_status: None,
                    details: std::borrow::Cow::Owned(format!(
                        "jwt_authn_access_denied{{{}}}",
                        msg.replace(' ', "_")
                    )),
                });
            }
        };
        let mut o = Outputs {
            fetched,
            ..Default::default()
        };
        let status = self.check(r, v, now, &mut o);
        if !o.fetch.is_empty() && !fetched {
            return Decision::Async;
        }
        if status != Status::Ok {
            self.stats().denied.fetch_add(1, Relaxed);
            return Decision::Reply(self.deny(v, status));
        }
        self.stats().allowed.fetch_add(1, Relaxed);
        st.request_header_ops.append(&mut o.ops);
        for (k, payload) in o.metadata {
            st.set_metadata(NAMESPACE, k, payload);
        }
        st.clear_route_cache |= o.clear_route_cache;
        Decision::Continue
    }

    fn deny(&self, v: &RequestView<'_>, status: Status) -> LocalReply {
        let msg = status.as_str();
        let details = std::borrow::Cow::Owned(format!(
            "jwt_authn_access_denied{{{}}}",
            msg.replace(' ', "_")
        ));
        let code = if status == Status::JwtAudienceNotAllowed {
            403
        } else {
            401
        };
        if self.strip_failure_response {
            return LocalReply {
                status: code,
                body: None,
                headers: Vec::new(),
                grpc_status: None,
                details,
            };
        }
        // Envoy's `buildOriginalUri`: the path cut at 256 bytes.
        let mut end = v.path.len().min(256);
        while !v.path.is_char_boundary(end) {
            end -= 1;
        }
        let scheme = v
            .headers
            .get("x-forwarded-proto")
            .and_then(|x| x.to_str().ok())
            .unwrap_or(v.scheme);
        let mut www = format!(
            "Bearer realm=\"{scheme}://{}{}\"",
            v.authority,
            &v.path[..end]
        );
        if status != Status::JwtMissed {
            www.push_str(", error=\"invalid_token\"");
        }
        LocalReply {
            status: code,
            body: Some(bytes::Bytes::from_static(msg.as_bytes())),
            headers: vec![(http::header::WWW_AUTHENTICATE, www)],
            grpc_status: None,
            details,
        }
    }
}

/// A claim by name, `a.b.c` reaching into nested objects (jwt_verify_lib's `StructUtils`).
fn claim_value<'p>(payload: &'p serde_json::Map<String, Value>, name: &str) -> Option<&'p Value> {
    let mut parts = name.split('.');
    let mut v = payload.get(parts.next()?)?;
    for p in parts {
        v = v.as_object()?.get(p)?;
    }
    Some(v)
}

/// jwt_verify_lib's `CheckAudience`: no configured audiences allows any; else one of the
/// token's must match, compared without an `http://`/`https://` scheme and trailing `/`.
fn audiences_allowed(configured: &[String], token: &[String]) -> bool {
    if configured.is_empty() {
        return true;
    }
    let norm = |a: &str| {
        let a = a
            .strip_prefix("http://")
            .or_else(|| a.strip_prefix("https://"))
            .unwrap_or(a);
        a.strip_suffix('/').unwrap_or(a).to_string()
    };
    token
        .iter()
        .any(|t| configured.iter().any(|c| norm(c) == norm(t)))
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
