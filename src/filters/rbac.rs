//! Envoy's RBAC filters (`envoy.filters.http.rbac`, `envoy.filters.network.rbac`): policies of
//! permissions (what is asked) and principals (who asks); a policy matches when any of its
//! permissions and any of its principals match. ALLOW lets through what some policy matches,
//! DENY refuses it, LOG only marks it; shadow rules are evaluated, counted and recorded in the
//! dynamic metadata, never enforced (istiod's dry-run and its CUSTOM marking).
//!
//! As Envoy (source/extensions/filters/common/rbac/): policies are tried in name order and the
//! first that matches is the effective one (`rbac_access_denied_matched_policy[<name>]`);
//! `url_path` sees the path without its query; `authenticated` matches the peer
//! certificate's URI SANs, then its DNS SANs, then its subject; `remote_ip` is the client the
//! connection manager trusts (`x-forwarded-for`), `direct_remote_ip` the socket's peer.
//! A matcher Portico does not implement is refused with its field, never ignored.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use envoy_types::pb::envoy::config::rbac::v3 as rpb;
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3 as hpb;
use envoy_types::pb::envoy::r#type::matcher::v3 as mpb;
use prost::Message;

use super::{Decision, FilterDecl, LocalReply, Request, Translated};
use crate::matcher::{header_matcher, header_matches, string_matcher, HeaderMatcher, StringMatch};

pub const TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC";
pub const PER_ROUTE_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBACPerRoute";
pub const NETWORK_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC";

/// The dynamic metadata namespace of the HTTP filter's shadow results.
pub const HTTP_NAMESPACE: &str = "envoy.filters.http.rbac";
/// The same for the network filter (what istiod's network ext_authz keys on).
pub const NETWORK_NAMESPACE: &str = "envoy.filters.network.rbac";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Allow,
    Deny,
    Log,
}

/// A CIDR range as RBAC's `*_ip` matchers take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    len: u8,
}

impl Cidr {
    fn translate(c: &envoy_types::pb::envoy::config::core::v3::CidrRange) -> Result<Cidr, String> {
        let addr: IpAddr = c
            .address_prefix
            .parse()
            .map_err(|_| format!("malformed IP address: {}", c.address_prefix))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = c.prefix_len.as_ref().map_or(0, |v| v.value);
        if len > max {
            return Err(format!("prefix length {len} is too long for {addr}"));
        }
        Ok(Cidr {
            addr,
            len: len as u8,
        })
    }

    fn contains(&self, ip: IpAddr) -> bool {
        let ip = match (self.addr, ip) {
            (IpAddr::V4(_), IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => return false,
            },
            _ => ip,
        };
        match (self.addr, ip) {
            (IpAddr::V4(a), IpAddr::V4(b)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.len)).unwrap_or(0);
                u32::from(a) & mask == u32::from(b) & mask
            }
            (IpAddr::V6(a), IpAddr::V6(b)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.len))
                    .unwrap_or(0);
                u128::from(a) & mask == u128::from(b) & mask
            }
            _ => false,
        }
    }
}

/// `envoy.type.matcher.v3.MetadataMatcher` over the request's dynamic metadata.
#[derive(Debug)]
pub struct MetadataMatcher {
    filter: String,
    path: Vec<String>,
    value: ValueMatcher,
    invert: bool,
}

#[derive(Debug)]
enum ValueMatcher {
    Null,
    Double(DoubleMatch),
    String(StringMatch),
    Bool(bool),
    Present(bool),
    ListOneOf(Box<ValueMatcher>),
    Or(Vec<ValueMatcher>),
}

#[derive(Debug)]
enum DoubleMatch {
    Exact(f64),
    Range(f64, f64),
}

impl ValueMatcher {
    fn translate(v: &mpb::ValueMatcher) -> Result<ValueMatcher, String> {
        use mpb::value_matcher::MatchPattern as P;
        Ok(match &v.match_pattern {
            Some(P::NullMatch(_)) => ValueMatcher::Null,
            Some(P::DoubleMatch(d)) => {
                use mpb::double_matcher::MatchPattern as D;
                ValueMatcher::Double(match &d.match_pattern {
                    Some(D::Exact(e)) => DoubleMatch::Exact(*e),
                    Some(D::Range(r)) => DoubleMatch::Range(r.start, r.end),
                    None => return Err("double_match: no match pattern set".into()),
                })
            }
            Some(P::StringMatch(s)) => ValueMatcher::String(string_matcher(s)?),
            Some(P::BoolMatch(b)) => ValueMatcher::Bool(*b),
            Some(P::PresentMatch(p)) => ValueMatcher::Present(*p),
            Some(P::ListMatch(l)) => match &l.match_pattern {
                Some(mpb::list_matcher::MatchPattern::OneOf(inner)) => {
                    ValueMatcher::ListOneOf(Box::new(ValueMatcher::translate(inner)?))
                }
                None => return Err("list_match: no match pattern set".into()),
            },
            Some(P::OrMatch(o)) => ValueMatcher::Or(
                o.value_matchers
                    .iter()
                    .map(ValueMatcher::translate)
                    .collect::<Result<_, _>>()?,
            ),
            None => return Err("value matcher: no match pattern set".into()),
        })
    }

    fn matches(&self, v: Option<&serde_json::Value>) -> bool {
        use serde_json::Value as J;
        match self {
            ValueMatcher::Present(p) => v.is_some_and(|v| !v.is_null()) == *p,
            ValueMatcher::Null => matches!(v, Some(J::Null)),
            ValueMatcher::Bool(b) => matches!(v, Some(J::Bool(x)) if x == b),
            ValueMatcher::String(m) => matches!(v, Some(J::String(s)) if m.matches(s)),
            ValueMatcher::Double(d) => match v.and_then(J::as_f64) {
                Some(x) => match d {
                    DoubleMatch::Exact(e) => x == *e,
                    DoubleMatch::Range(s, e) => x >= *s && x < *e,
                },
                None => false,
            },
            ValueMatcher::ListOneOf(inner) => match v {
                Some(J::Array(a)) => a.iter().any(|x| inner.matches(Some(x))),
                _ => false,
            },
            ValueMatcher::Or(all) => all.iter().any(|m| m.matches(v)),
        }
    }
}

impl MetadataMatcher {
    pub(crate) fn translate(m: &mpb::MetadataMatcher) -> Result<MetadataMatcher, String> {
        let mut path = Vec::new();
        for seg in &m.path {
            match &seg.segment {
                Some(mpb::metadata_matcher::path_segment::Segment::Key(k)) if !k.is_empty() => {
                    path.push(k.clone())
                }
                _ => return Err("metadata.path: each segment needs a non-empty key".into()),
            }
        }
        if path.is_empty() {
            return Err("metadata.path must not be empty".into());
        }
        let value = m
            .value
            .as_ref()
            .ok_or("metadata.value is required")
            .and_then(|v| ValueMatcher::translate(v).map_err(|_| "metadata.value: invalid"))
            .map_err(|e| e.to_string())?;
        Ok(MetadataMatcher {
            filter: m.filter.clone(),
            path,
            value,
            invert: m.invert,
        })
    }

    pub(crate) fn matches(&self, st: &super::FilterState) -> bool {
        let mut v = st.metadata(&self.filter);
        for k in &self.path {
            v = v.and_then(|x| x.get(k));
        }
        self.value.matches(v) != self.invert
    }
}

/// Envoy's URI template (`envoy.path.match.uri_template`): literal segments, `*` (one
/// segment), `**` (any number of segments), `{name}`, `{name=*}`, `{name=**}`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seg {
    Lit(String),
    One,
    Any,
}

#[derive(Debug)]
pub struct UriTemplate(Vec<Seg>);

impl UriTemplate {
    fn parse(t: &str) -> Result<UriTemplate, String> {
        let Some(rest) = t.strip_prefix('/') else {
            return Err(format!("path_template '{t}' must start with '/'"));
        };
        let mut segs = Vec::new();
        for s in rest.split('/') {
            let op = match s.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                Some(var) => match var.split_once('=') {
                    None => "*",
                    Some((_, "*")) => "*",
                    Some((_, "**")) => "**",
                    Some((_, other)) => {
                        return Err(format!(
                            "path_template '{t}': variable pattern '{other}' is not supported"
                        ))
                    }
                },
                None => s,
            };
            segs.push(match op {
                "*" => Seg::One,
                "**" => Seg::Any,
                lit if lit.contains(['*', '{', '}']) => {
                    return Err(format!("path_template '{t}': invalid segment '{lit}'"))
                }
                lit => Seg::Lit(lit.to_string()),
            });
        }
        Ok(UriTemplate(segs))
    }

    fn matches(&self, path: &str) -> bool {
        let Some(rest) = path.strip_prefix('/') else {
            return false;
        };
        let parts: Vec<&str> = rest.split('/').collect();
        fn go(t: &[Seg], p: &[&str]) -> bool {
            match t.split_first() {
                None => p.is_empty(),
                Some((Seg::Any, tail)) => (0..=p.len()).any(|i| go(tail, &p[i..])),
                Some((Seg::One, tail)) => {
                    p.first().is_some_and(|s| !s.is_empty()) && go(tail, &p[1..])
                }
                Some((Seg::Lit(l), tail)) => p.first() == Some(&l.as_str()) && go(tail, &p[1..]),
            }
        }
        go(&self.0, &parts)
    }
}

#[derive(Debug)]
pub enum Permission {
    Any,
    And(Vec<Permission>),
    Or(Vec<Permission>),
    Not(Box<Permission>),
    Header(HeaderMatcher),
    UrlPath(StringMatch),
    DestIp(Cidr),
    DestPort(u32),
    DestPortRange(u32, u32),
    ServerName(StringMatch),
    Metadata(MetadataMatcher),
    UriTemplate(UriTemplate),
}

#[derive(Debug)]
pub enum Principal {
    Any,
    And(Vec<Principal>),
    Or(Vec<Principal>),
    Not(Box<Principal>),
    Authenticated(Option<StringMatch>),
    DirectRemoteIp(Cidr),
    RemoteIp(Cidr),
    Header(HeaderMatcher),
    UrlPath(StringMatch),
    Metadata(MetadataMatcher),
}

/// What a policy is checked against: the request (absent on a TCP chain) and the connection.
pub struct Subject<'a> {
    pub req: Option<&'a Request<'a>>,
    pub conn: &'a super::Connection<'a>,
    pub state: &'a super::FilterState,
}

const URI_TEMPLATE_TYPE: &str =
    "type.googleapis.com/envoy.extensions.path.match.uri_template.v3.UriTemplateMatchConfig";

fn path_matcher(p: &mpb::PathMatcher) -> Result<StringMatch, String> {
    match &p.rule {
        Some(mpb::path_matcher::Rule::Path(s)) => string_matcher(s),
        None => Err("url_path: no rule set".into()),
    }
}

impl Permission {
    // `metadata` is deprecated for `sourced_metadata`, but it is what istiod sends.
    #[allow(deprecated)]
    fn translate(p: &rpb::Permission, at: &str) -> Result<Permission, String> {
        use rpb::permission::Rule as R;
        let set = |s: &rpb::permission::Set, what: &str| -> Result<Vec<Permission>, String> {
            s.rules
                .iter()
                .enumerate()
                .map(|(i, r)| Permission::translate(r, &format!("{at}.{what}.rules[{i}]")))
                .collect()
        };
        Ok(match &p.rule {
            Some(R::Any(true)) => Permission::Any,
            Some(R::Any(false)) | None => return Err(format!("{at}: no rule set")),
            Some(R::AndRules(s)) => Permission::And(set(s, "and_rules")?),
            Some(R::OrRules(s)) => Permission::Or(set(s, "or_rules")?),
            Some(R::NotRule(r)) => Permission::Not(Box::new(Permission::translate(
                r,
                &format!("{at}.not_rule"),
            )?)),
            Some(R::Header(h)) => {
                Permission::Header(header_matcher(h).map_err(|e| format!("{at}.header: {e}"))?)
            }
            Some(R::UrlPath(u)) => {
                Permission::UrlPath(path_matcher(u).map_err(|e| format!("{at}.url_path: {e}"))?)
            }
            Some(R::DestinationIp(c)) => Permission::DestIp(
                Cidr::translate(c).map_err(|e| format!("{at}.destination_ip: {e}"))?,
            ),
            Some(R::DestinationPort(p)) => Permission::DestPort(*p),
            Some(R::DestinationPortRange(r)) => {
                Permission::DestPortRange(r.start as u32, r.end as u32)
            }
            Some(R::RequestedServerName(s)) => Permission::ServerName(
                string_matcher(s).map_err(|e| format!("{at}.requested_server_name: {e}"))?,
            ),
            Some(R::Metadata(m)) => Permission::Metadata(
                MetadataMatcher::translate(m).map_err(|e| format!("{at}.{e}"))?,
            ),
            Some(R::UriTemplate(t)) => {
                let any = t.typed_config.as_ref();
                if any.map(|a| a.type_url.as_str()) != Some(URI_TEMPLATE_TYPE) {
                    return Err(format!(
                        "{at}.uri_template: only {URI_TEMPLATE_TYPE} is supported"
                    ));
                }
                let cfg = envoy_types::pb::envoy::extensions::path::r#match::uri_template::v3::UriTemplateMatchConfig::decode(
                    any.map_or(&[][..], |a| a.value.as_slice()),
                )
                .map_err(|e| format!("{at}.uri_template: {e}"))?;
                Permission::UriTemplate(
                    UriTemplate::parse(&cfg.path_template)
                        .map_err(|e| format!("{at}.uri_template: {e}"))?,
                )
            }
            Some(R::Matcher(_)) => {
                return Err(format!(
                    "{at}.matcher: extension matchers are not supported"
                ))
            }
            Some(R::SourcedMetadata(_)) => {
                return Err(format!("{at}.sourced_metadata is not supported"))
            }
        })
    }

    pub fn matches(&self, s: &Subject<'_>) -> bool {
        match self {
            Permission::Any => true,
            Permission::And(all) => all.iter().all(|p| p.matches(s)),
            Permission::Or(any) => any.iter().any(|p| p.matches(s)),
            Permission::Not(p) => !p.matches(s),
            Permission::Header(h) => s.req.is_some_and(|r| header_matches(h, r.view)),
            Permission::UrlPath(m) => s.req.is_some_and(|r| m.matches(r.view.path_only())),
            Permission::UriTemplate(t) => s.req.is_some_and(|r| t.matches(r.view.path_only())),
            Permission::DestIp(c) => s.conn.local.is_some_and(|a| c.contains(a.ip())),
            Permission::DestPort(p) => s.conn.local.is_some_and(|a| u32::from(a.port()) == *p),
            Permission::DestPortRange(lo, hi) => s
                .conn
                .local
                .is_some_and(|a| (*lo..*hi).contains(&u32::from(a.port()))),
            Permission::ServerName(m) => m.matches(s.conn.sni.unwrap_or("")),
            Permission::Metadata(m) => m.matches(s.state),
        }
    }
}

impl Principal {
    fn translate(p: &rpb::Principal, at: &str) -> Result<Principal, String> {
        use rpb::principal::Identifier as I;
        let set = |s: &rpb::principal::Set, what: &str| -> Result<Vec<Principal>, String> {
            s.ids
                .iter()
                .enumerate()
                .map(|(i, r)| Principal::translate(r, &format!("{at}.{what}.ids[{i}]")))
                .collect()
        };
        #[allow(deprecated)]
        Ok(match &p.identifier {
            Some(I::Any(true)) => Principal::Any,
            Some(I::Any(false)) | None => return Err(format!("{at}: no identifier set")),
            Some(I::AndIds(s)) => Principal::And(set(s, "and_ids")?),
            Some(I::OrIds(s)) => Principal::Or(set(s, "or_ids")?),
            Some(I::NotId(r)) => {
                Principal::Not(Box::new(Principal::translate(r, &format!("{at}.not_id"))?))
            }
            Some(I::Authenticated(a)) => Principal::Authenticated(
                a.principal_name
                    .as_ref()
                    .map(string_matcher)
                    .transpose()
                    .map_err(|e| format!("{at}.authenticated.principal_name: {e}"))?,
            ),
            Some(I::SourceIp(c)) | Some(I::DirectRemoteIp(c)) => Principal::DirectRemoteIp(
                Cidr::translate(c).map_err(|e| format!("{at}.direct_remote_ip: {e}"))?,
            ),
            Some(I::RemoteIp(c)) => {
                Principal::RemoteIp(Cidr::translate(c).map_err(|e| format!("{at}.remote_ip: {e}"))?)
            }
            Some(I::Header(h)) => {
                Principal::Header(header_matcher(h).map_err(|e| format!("{at}.header: {e}"))?)
            }
            Some(I::UrlPath(u)) => {
                Principal::UrlPath(path_matcher(u).map_err(|e| format!("{at}.url_path: {e}"))?)
            }
            Some(I::Metadata(m)) => {
                Principal::Metadata(MetadataMatcher::translate(m).map_err(|e| format!("{at}.{e}"))?)
            }
            Some(I::FilterState(_)) => {
                return Err(format!(
                    "{at}.filter_state: filter state matchers are not supported"
                ))
            }
            Some(I::Custom(_)) | Some(I::SourcedMetadata(_)) => {
                return Err(format!("{at}: this principal kind is not supported"))
            }
        })
    }

    pub fn matches(&self, s: &Subject<'_>) -> bool {
        match self {
            Principal::Any => true,
            Principal::And(all) => all.iter().all(|p| p.matches(s)),
            Principal::Or(any) => any.iter().any(|p| p.matches(s)),
            Principal::Not(p) => !p.matches(s),
            Principal::Authenticated(name) => {
                if !s.conn.tls {
                    return false;
                }
                let Some(name) = name else {
                    return true;
                };
                match s.conn.peer {
                    Some(peer) => {
                        peer.uri_sans().iter().any(|u| name.matches(u))
                            || peer.dns_sans().iter().any(|d| name.matches(d))
                            || name.matches(peer.subject())
                    }
                    None => name.matches(""),
                }
            }
            Principal::DirectRemoteIp(c) => {
                s.conn.direct_remote.is_some_and(|a| c.contains(a.ip()))
            }
            Principal::RemoteIp(c) => s
                .conn
                .remote
                .or(s.conn.direct_remote.map(|a| a.ip()))
                .is_some_and(|ip| c.contains(ip)),
            Principal::Header(h) => s.req.is_some_and(|r| header_matches(h, r.view)),
            Principal::UrlPath(m) => s.req.is_some_and(|r| m.matches(r.view.path_only())),
            Principal::Metadata(m) => m.matches(s.state),
        }
    }
}

#[derive(Debug)]
pub struct Policy {
    permissions: Vec<Permission>,
    principals: Vec<Principal>,
}

/// One rule set: the action and its policies in name order.
#[derive(Debug)]
pub struct Engine {
    pub action: Action,
    policies: Vec<(String, Policy)>,
}

impl Engine {
    pub fn translate(r: &rpb::Rbac, at: &str) -> Result<Engine, String> {
        let action = match r.action {
            0 => Action::Allow,
            1 => Action::Deny,
            2 => Action::Log,
            other => return Err(format!("{at}.action: unknown value {other}")),
        };
        if r.audit_logging_options.is_some() {
            // Audit loggers only log; they never change the decision.
        }
        let names: BTreeMap<&String, &rpb::Policy> = r.policies.iter().collect();
        let mut policies = Vec::with_capacity(names.len());
        for (name, p) in names {
            let pat = format!("{at}.policies[{name}]");
            if p.condition.is_some() || p.checked_condition.is_some() || p.cel_config.is_some() {
                return Err(format!("{pat}: CEL conditions are not supported"));
            }
            if p.permissions.is_empty() || p.principals.is_empty() {
                return Err(format!(
                    "{pat}: a policy needs at least one permission and one principal"
                ));
            }
            let permissions = p
                .permissions
                .iter()
                .enumerate()
                .map(|(i, x)| Permission::translate(x, &format!("{pat}.permissions[{i}]")))
                .collect::<Result<_, _>>()?;
            let principals = p
                .principals
                .iter()
                .enumerate()
                .map(|(i, x)| Principal::translate(x, &format!("{pat}.principals[{i}]")))
                .collect::<Result<_, _>>()?;
            policies.push((
                name.clone(),
                Policy {
                    permissions,
                    principals,
                },
            ));
        }
        Ok(Engine { action, policies })
    }

    /// The first policy (in name order) that matches.
    pub fn matched(&self, s: &Subject<'_>) -> Option<&str> {
        self.policies
            .iter()
            .find(|(_, p)| {
                p.permissions.iter().any(|x| x.matches(s))
                    && p.principals.iter().any(|x| x.matches(s))
            })
            .map(|(n, _)| n.as_str())
    }

    /// Whether the rule set allows the subject, and the policy that decided (if any).
    pub fn allows<'e>(&'e self, s: &Subject<'_>) -> (bool, Option<&'e str>) {
        let m = self.matched(s);
        match self.action {
            Action::Allow => (m.is_some(), m),
            Action::Deny => (m.is_none(), m),
            Action::Log => (true, m),
        }
    }
}

/// Counters one RBAC filter counts into, resolved from the connection manager's named
/// counters on first use (Envoy's stats are shared by name across filters of a scope).
#[derive(Debug)]
pub struct Counters {
    pub allowed: Arc<AtomicU64>,
    pub denied: Arc<AtomicU64>,
    pub shadow_allowed: Arc<AtomicU64>,
    pub shadow_denied: Arc<AtomicU64>,
    /// LOG rule sets only.
    pub logged: Option<(Arc<AtomicU64>, Arc<AtomicU64>)>,
}

/// Envoy's `statPrefixJoin`: `b` after `a`, ending in a dot (nothing added for an empty `b`).
fn join(a: &str, b: &str) -> String {
    match b {
        "" => a.to_string(),
        b if b.ends_with('.') => format!("{a}{b}"),
        b => format!("{a}{b}."),
    }
}

impl Counters {
    /// Envoy's names: `<prefix>rbac.[<rules_stat_prefix>.]allowed`, `...denied`,
    /// `<prefix>rbac.[<shadow_rules_stat_prefix>.]shadow_allowed`, `...shadow_denied`, and for
    /// a LOG rule set `logged`/`not_logged`.
    pub fn resolve(
        named: &crate::filters::counters::NamedCounters,
        prefix: &str,
        rules: &str,
        shadow: &str,
        log: bool,
    ) -> Counters {
        let base = join(prefix, "rbac.");
        let (r, s) = (join(&base, rules), join(&base, shadow));
        let c = |n: String| named.get(&n);
        Counters {
            allowed: c(format!("{r}allowed")),
            denied: c(format!("{r}denied")),
            shadow_allowed: c(format!("{s}shadow_allowed")),
            shadow_denied: c(format!("{s}shadow_denied")),
            logged: log.then(|| (c(format!("{r}logged")), c(format!("{r}not_logged")))),
        }
    }

    fn count_log(&self, matched: bool) {
        if let Some((yes, no)) = &self.logged {
            if matched { yes } else { no }.fetch_add(1, Relaxed);
        }
    }
}

/// The HTTP filter.
#[derive(Debug)]
pub struct RbacFilter {
    pub name: String,
    pub rules: Option<Engine>,
    pub shadow: Option<Engine>,
    pub rules_stat_prefix: String,
    pub shadow_rules_stat_prefix: String,
    counters: OnceLock<Counters>,
}

/// A route's word to an RBAC filter (`RBACPerRoute`): its own rules, or none (disabled).
#[derive(Debug)]
pub struct PerRoute {
    pub rbac: Option<RbacFilter>,
}

fn decode_http(bytes: &[u8], at: &str) -> Result<hpb::Rbac, String> {
    hpb::Rbac::decode(bytes).map_err(|e| format!("{at}: cannot decode RBAC: {e}"))
}

impl RbacFilter {
    pub fn from_proto(name: &str, r: &hpb::Rbac) -> Result<RbacFilter, String> {
        if r.matcher.is_some() || r.shadow_matcher.is_some() {
            return Err(
                "matcher/shadow_matcher (the unified matcher API) are not supported; use rules"
                    .into(),
            );
        }
        Ok(RbacFilter {
            name: name.to_string(),
            rules: r
                .rules
                .as_ref()
                .map(|x| Engine::translate(x, "rules"))
                .transpose()?,
            shadow: r
                .shadow_rules
                .as_ref()
                .map(|x| Engine::translate(x, "shadow_rules"))
                .transpose()?,
            rules_stat_prefix: r.rules_stat_prefix.clone(),
            shadow_rules_stat_prefix: r.shadow_rules_stat_prefix.clone(),
            counters: OnceLock::new(),
        })
    }

    fn counters(&self, named: &crate::filters::counters::NamedCounters) -> &Counters {
        self.counters.get_or_init(|| {
            let log = self.rules.as_ref().is_some_and(|r| r.action == Action::Log);
            Counters::resolve(
                named,
                "",
                &self.rules_stat_prefix,
                &self.shadow_rules_stat_prefix,
                log,
            )
        })
    }

    /// Evaluates the request: shadow rules first (recorded, never enforced), then the rules.
    pub fn decode(
        &self,
        req: &Request<'_>,
        st: &mut super::FilterState,
        named: &crate::filters::counters::NamedCounters,
    ) -> Decision {
        // A route may replace this filter's rules or turn it off.
        let this = match req.route.and_then(|r| r.rbac_override(&self.name)) {
            Some(PerRoute { rbac: None }) => return Decision::Continue,
            Some(PerRoute { rbac: Some(f) }) => f,
            None => self,
        };
        let c = this.counters(named);
        if let Some(shadow) = &this.shadow {
            let subject = Subject {
                req: Some(req),
                conn: &req.conn,
                state: st,
            };
            let (ok, policy) = shadow.allows(&subject);
            let policy = policy.map(str::to_string);
            if ok {
                c.shadow_allowed.fetch_add(1, Relaxed);
            } else {
                c.shadow_denied.fetch_add(1, Relaxed);
            }
            let prefix = &this.shadow_rules_stat_prefix;
            if let Some(p) = policy {
                st.set_metadata(
                    HTTP_NAMESPACE,
                    format!("{prefix}shadow_effective_policy_id"),
                    p.into(),
                );
            }
            st.set_metadata(
                HTTP_NAMESPACE,
                format!("{prefix}shadow_engine_result"),
                if ok { "allowed" } else { "denied" }.into(),
            );
        }
        let Some(rules) = &this.rules else {
            return Decision::Continue;
        };
        let subject = Subject {
            req: Some(req),
            conn: &req.conn,
            state: st,
        };
        let (ok, policy) = rules.allows(&subject);
        if rules.action == Action::Log {
            c.count_log(policy.is_some());
            if policy.is_some() {
                st.set_metadata(HTTP_NAMESPACE, "access_log_hint".into(), true.into());
            }
            return Decision::Continue;
        }
        if ok {
            c.allowed.fetch_add(1, Relaxed);
            return Decision::Continue;
        }
        c.denied.fetch_add(1, Relaxed);
        Decision::Reply(LocalReply {
            status: 403,
            body: Some(bytes::Bytes::from_static(b"RBAC: access denied")),
            headers: Vec::new(),
            grpc_status: None,
            details: std::borrow::Cow::Owned(format!(
                "rbac_access_denied_matched_policy[{}]",
                policy.unwrap_or("none")
            )),
        })
    }
}

pub fn translate_filter(d: &FilterDecl<'_>) -> Result<Translated, String> {
    let r = decode_http(&d.config.value, "typed_config")?;
    Ok(Translated::Run(super::HttpFilter::Rbac(
        RbacFilter::from_proto(d.name, &r)?,
    )))
}

/// A route's `typed_per_filter_config` for an RBAC filter named `name`.
pub fn translate_per_route(
    name: &str,
    any: &envoy_types::pb::google::protobuf::Any,
) -> Result<PerRoute, String> {
    if any.type_url != PER_ROUTE_TYPE {
        return Err(format!("expected {PER_ROUTE_TYPE}, got {}", any.type_url));
    }
    let p = hpb::RbacPerRoute::decode(any.value.as_slice())
        .map_err(|e| format!("cannot decode RBACPerRoute: {e}"))?;
    Ok(PerRoute {
        rbac: p
            .rbac
            .as_ref()
            .map(|r| RbacFilter::from_proto(name, r))
            .transpose()?,
    })
}

/// The RBAC overrides of one level's `typed_per_filter_config`, by filter name.
pub fn per_route(
    map: &std::collections::HashMap<String, envoy_types::pb::google::protobuf::Any>,
) -> Result<Vec<(String, Arc<PerRoute>)>, String> {
    let mut out = Vec::new();
    for (name, a) in map {
        if a.type_url == PER_ROUTE_TYPE {
            let p = translate_per_route(name, a)
                .map_err(|e| format!("typed_per_filter_config['{name}']: {e}"))?;
            out.push((name.clone(), Arc::new(p)));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The network filter on a TCP chain, decided once per connection.
#[derive(Debug)]
pub struct NetworkRbac {
    pub rules: Option<Engine>,
    pub shadow: Option<Engine>,
    pub stat_prefix: String,
    pub shadow_rules_stat_prefix: String,
    pub counters: Counters,
}

impl NetworkRbac {
    pub fn translate(
        any: &envoy_types::pb::google::protobuf::Any,
        named: &crate::filters::counters::NamedCounters,
    ) -> Result<NetworkRbac, String> {
        use envoy_types::pb::envoy::extensions::filters::network::rbac::v3 as npb;
        let r = npb::Rbac::decode(any.value.as_slice())
            .map_err(|e| format!("cannot decode network RBAC: {e}"))?;
        if r.stat_prefix.is_empty() {
            return Err("stat_prefix: value length must be at least 1 characters".into());
        }
        if r.matcher.is_some() || r.shadow_matcher.is_some() {
            return Err(
                "matcher/shadow_matcher (the unified matcher API) are not supported; use rules"
                    .into(),
            );
        }
        if r.enforcement_type != 0 {
            return Err("enforcement_type: only ONE_TIME_ON_FIRST_BYTE is supported".into());
        }
        let rules = r
            .rules
            .as_ref()
            .map(|x| Engine::translate(x, "rules"))
            .transpose()?;
        let log = rules.as_ref().is_some_and(|e| e.action == Action::Log);
        Ok(NetworkRbac {
            rules,
            shadow: r
                .shadow_rules
                .as_ref()
                .map(|x| Engine::translate(x, "shadow_rules"))
                .transpose()?,
            counters: Counters::resolve(
                named,
                &r.stat_prefix,
                "",
                &r.shadow_rules_stat_prefix,
                log,
            ),
            stat_prefix: r.stat_prefix,
            shadow_rules_stat_prefix: r.shadow_rules_stat_prefix,
        })
    }

    /// Whether the connection may go on. The shadow rules' result goes to the connection's
    /// dynamic metadata, as the HTTP filter's does.
    pub fn allows(&self, conn: &super::Connection<'_>, st: &mut super::FilterState) -> bool {
        if let Some(shadow) = &self.shadow {
            let subject = Subject {
                req: None,
                conn,
                state: st,
            };
            let (ok, policy) = shadow.allows(&subject);
            let policy = policy.map(str::to_string);
            if ok {
                self.counters.shadow_allowed.fetch_add(1, Relaxed);
            } else {
                self.counters.shadow_denied.fetch_add(1, Relaxed);
            }
            let prefix = &self.shadow_rules_stat_prefix;
            if let Some(p) = policy {
                st.set_metadata(
                    NETWORK_NAMESPACE,
                    format!("{prefix}shadow_effective_policy_id"),
                    p.into(),
                );
            }
            st.set_metadata(
                NETWORK_NAMESPACE,
                format!("{prefix}shadow_engine_result"),
                if ok { "allowed" } else { "denied" }.into(),
            );
        }
        let subject = Subject {
            req: None,
            conn,
            state: st,
        };
        let Some(rules) = &self.rules else {
            return true;
        };
        let (ok, policy) = rules.allows(&subject);
        if rules.action == Action::Log {
            self.counters.count_log(policy.is_some());
            return true;
        }
        if ok {
            self.counters.allowed.fetch_add(1, Relaxed);
        } else {
            self.counters.denied.fetch_add(1, Relaxed);
        }
        ok
    }
}

#[cfg(test)]
#[path = "rbac_tests.rs"]
mod rbac_tests;
