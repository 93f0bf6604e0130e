//! Route configurations translated from `envoy.config.route.v3` into plain matchers.
//!
//! Everything that can fail (regex compilation, invalid domains, unsupported actions) fails
//! here, at translation time, so that a push is NACKed and the request path never sees it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::data_source::Specifier as DataSpecifier;
use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::r#type::matcher::v3 as mpb;
use http::StatusCode;
use regex::Regex;

use super::headers::{self, HeaderOps, HeaderPlan};
use super::retry::RetryPolicy;
use super::TranslateError;
use crate::filters::{fault, RouteFilters};
use crate::matcher::{check_repeat_limit, regex_matcher};
pub use crate::matcher::{
    compile_full_regex, header_matcher, string_matcher, HeaderMatch, HeaderMatcher, Pseudo,
    StringMatch,
};

/// A compiled `RouteConfiguration`.
#[derive(Debug)]
pub struct RouteTable {
    /// Some virtual host has `require_tls`: only then is the host looked up before routing.
    pub any_require_tls: bool,
    /// `internal_only_headers`: removed from requests that are not internal, before routing.
    pub internal_only: Vec<http::HeaderName>,
    pub name: String,
    pub vhosts: Vec<VirtualHost>,
    /// Exact domains (lowercase) to vhost index.
    exact: HashMap<String, usize>,
    /// `*.suffix` style wildcards: (suffix without the `*`, vhost), longest suffix first.
    suffixes: Vec<(String, usize)>,
    /// `prefix.*` style wildcards: (prefix without the `*`, vhost), longest prefix first.
    prefixes: Vec<(String, usize)>,
    /// The vhost holding the `*` domain.
    any: Option<usize>,
    /// `ignore_port_in_host_matching`: match the authority without its port.
    pub ignore_port: bool,
    /// `validate_clusters` as configured (Envoy defaults it to true for inline route
    /// configurations and false for RDS).
    pub validate_clusters: Option<bool>,
}

#[derive(Debug)]
pub struct VirtualHost {
    pub name: String,
    /// `require_tls`: plain-text requests get Envoy's 301 to `https://` instead of a route.
    pub require_tls: RequireTls,
    pub routes: Vec<Route>,
    /// For long route lists: which routes can match a given path, so matching does not scan
    /// every route. `None` when the list is short enough to scan.
    pub index: Option<RouteIndex>,
}

/// A virtual host's `require_tls`, judged by `x-forwarded-proto` as the connection manager
/// set it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RequireTls {
    #[default]
    None,
    /// Only requests not marked `x-envoy-internal`.
    ExternalOnly,
    All,
}

/// Candidate routes by path, in route order: case-sensitive prefix (and path-separated
/// prefix) routes by their prefix, exact-path routes by their path, and every other route
/// (regex, case-insensitive) as an always-candidate. Matching then checks candidates in route
/// order, so Envoy's first-match semantics hold exactly.
#[derive(Debug, Default)]
pub struct RouteIndex {
    pub prefixes: HashMap<String, Vec<u32>>,
    /// Distinct prefix lengths, ascending.
    pub prefix_lens: Vec<usize>,
    pub exact: HashMap<String, Vec<u32>>,
    pub always: Vec<u32>,
}

/// Shorter lists are scanned: a scan of a few routes beats hashing.
const INDEX_MIN_ROUTES: usize = 16;

impl RouteIndex {
    fn build(routes: &[Route]) -> Option<RouteIndex> {
        if routes.len() < INDEX_MIN_ROUTES {
            return None;
        }
        let mut idx = RouteIndex::default();
        for (i, r) in routes.iter().enumerate() {
            let i = i as u32;
            match &r.path {
                PathMatch::Prefix(p) | PathMatch::SeparatedPrefix(p) if r.case_sensitive => {
                    idx.prefixes.entry(p.clone()).or_default().push(i)
                }
                PathMatch::Exact(p) if r.case_sensitive => {
                    idx.exact.entry(p.clone()).or_default().push(i)
                }
                _ => idx.always.push(i),
            }
        }
        let mut lens: Vec<usize> = idx.prefixes.keys().map(|k| k.len()).collect();
        lens.sort_unstable();
        lens.dedup();
        idx.prefix_lens = lens;
        Some(idx)
    }

    /// Calls `f` with every candidate route index for `path` (query stripped), ascending,
    /// until `f` returns true.
    pub fn candidates(&self, path: &str, mut f: impl FnMut(u32) -> bool) -> Option<u32> {
        let mut found: Vec<u32> = Vec::with_capacity(8);
        for &len in &self.prefix_lens {
            if len > path.len() {
                break;
            }
            if let Some(v) = path.get(..len).and_then(|p| self.prefixes.get(p)) {
                found.extend_from_slice(v);
            }
        }
        if let Some(v) = self.exact.get(path) {
            found.extend_from_slice(v);
        }
        found.extend_from_slice(&self.always);
        found.sort_unstable();
        found.into_iter().find(|i| f(*i))
    }
}

#[derive(Debug)]
pub struct Route {
    /// Shared with each request's record (`%ROUTE_NAME%`).
    pub name: Arc<str>,
    pub path: PathMatch,
    pub case_sensitive: bool,
    pub headers: Vec<HeaderMatcher>,
    pub query: Vec<QueryMatcher>,
    pub grpc_only: bool,
    pub action: Action,
    /// Custom request/response headers of this route, its vhost and its route config, in
    /// the order Envoy applies them.
    pub header_plan: Arc<HeaderPlan>,
    /// What the route says to the chain's HTTP filters (`typed_per_filter_config` of the
    /// route, its virtual host and its route configuration, resolved).
    pub filters: RouteFilters,
    /// `decorator`: the traced span's operation name (istiod sets `<host>:<port>/<path>*`).
    pub decorator: Option<Arc<Decorator>>,
}

/// A route's `decorator`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decorator {
    pub operation: Arc<str>,
    /// `propagate` (default true): the operation travels in `x-envoy-decorator-operation`
    /// (upstream on egress, downstream on ingress).
    pub propagate: bool,
}

impl Route {
    /// How much of the path `prefix_rewrite` replaces: the matched prefix, or the whole path
    /// for an exact match. Regex routes have no prefix to replace.
    pub fn rewrite_len(&self) -> Option<usize> {
        match &self.path {
            PathMatch::Prefix(p) | PathMatch::SeparatedPrefix(p) | PathMatch::Exact(p) => {
                Some(p.len())
            }
            PathMatch::Regex(_) => None,
        }
    }
}

#[derive(Debug)]
pub enum PathMatch {
    Prefix(String),
    Exact(String),
    Regex(Regex),
    SeparatedPrefix(String),
}

#[derive(Debug)]
pub enum Action {
    Forward(Forward),
    Direct {
        status: StatusCode,
        body: Option<Bytes>,
    },
    Redirect(Redirect),
}

#[derive(Debug)]
pub struct Forward {
    pub target: Target,
    /// Route `timeout`: Envoy's default is 15 s; zero disables it.
    pub timeout: Option<std::time::Duration>,
    /// The route's other timeouts: stream idle, stream duration, gRPC header timeouts.
    pub timeouts: StreamTimeouts,
    pub prefix_rewrite: Option<String>,
    pub regex_rewrite: Option<RegexRewrite>,
    /// `host_rewrite_literal`.
    pub host_rewrite: Option<String>,
    /// The other host rewrites, which depend on the request or the chosen host.
    pub host_rewrite_from: Option<Box<HostRewrite>>,
    /// `append_x_forwarded_host`: a host rewrite appends the original host to
    /// `x-forwarded-host`.
    pub append_x_forwarded_host: bool,
    /// What ring hash and Maglev clusters hash; other balancers ignore it.
    pub hash_policy: Vec<crate::lb::hash_policy::HashPolicy>,
    pub retry: Option<Arc<RetryPolicy>>,
    /// `request_mirror_policies`: the route's own, else its virtual host's.
    pub mirrors: Arc<[Mirror]>,
    /// The virtual host's `include_request_attempt_count` / `include_attempt_count_in_response`.
    pub attempt_count_to_upstream: bool,
    pub attempt_count_to_client: bool,
    /// `upgrade_configs`: this route's word on upgrade types, over the connection manager's.
    pub upgrades: super::upgrade::Upgrades,
    /// `cluster_not_found_response_code`: the status when the route's cluster does not exist
    /// (istiod sets 500 on Gateway API routes).
    pub cluster_not_found: u16,
}

/// Where a host rewrite takes the new Host from, besides a literal.
#[derive(Debug)]
pub enum HostRewrite {
    /// `auto_host_rewrite`: the chosen endpoint's hostname (DNS name or EDS `hostname`).
    Auto,
    /// `host_rewrite_header`: that request header's value, when it is not empty.
    Header(http::HeaderName),
    /// `host_rewrite_path_regex`: a substitution on the path without its query.
    PathRegex(RegexRewrite),
}

/// A route's timeouts besides `timeout`, as Envoy reads them.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StreamTimeouts {
    /// `idle_timeout`: replaces the connection manager's `stream_idle_timeout`; `Some(None)`
    /// (zero) disables it.
    pub idle: Option<Option<Duration>>,
    /// `max_stream_duration`. When a route sets it at all, Envoy uses the "new" timeouts: the
    /// route `timeout` and `max_grpc_timeout` no longer apply.
    pub max_stream: Option<MaxStream>,
    /// Deprecated `max_grpc_timeout`: for gRPC requests the `grpc-timeout` header becomes the
    /// route timeout, capped by this (zero: no cap).
    pub max_grpc: Option<Duration>,
    /// Deprecated `grpc_timeout_offset`, subtracted from the header's timeout.
    pub grpc_offset: Option<Duration>,
}

/// `RouteAction.max_stream_duration`.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct MaxStream {
    /// `max_stream_duration`: `None` falls back to the connection manager's; `Some(None)`
    /// (zero) disables the limit.
    pub duration: Option<Option<Duration>>,
    /// `grpc_timeout_header_max`: a gRPC request's `grpc-timeout` sets the stream limit,
    /// capped by this (zero: no cap). Unset: the header is not used.
    pub grpc_header_max: Option<Duration>,
    pub grpc_header_offset: Option<Duration>,
}

impl StreamTimeouts {
    #[allow(deprecated)]
    fn translate(ra: &rpb::RouteAction) -> Result<StreamTimeouts, String> {
        let d = |field: &str, v: &Option<envoy_types::pb::google::protobuf::Duration>| {
            v.as_ref()
                .map(|d| super::duration(d).map_err(|e| format!("{field}: {e}")))
                .transpose()
        };
        let nonzero = |v: Option<Duration>| v.map(|d| (!d.is_zero()).then_some(d));
        let max_stream = match &ra.max_stream_duration {
            Some(m) => Some(MaxStream {
                duration: nonzero(d(
                    "max_stream_duration.max_stream_duration",
                    &m.max_stream_duration,
                )?),
                grpc_header_max: d(
                    "max_stream_duration.grpc_timeout_header_max",
                    &m.grpc_timeout_header_max,
                )?,
                grpc_header_offset: d(
                    "max_stream_duration.grpc_timeout_header_offset",
                    &m.grpc_timeout_header_offset,
                )?,
            }),
            None => None,
        };
        Ok(StreamTimeouts {
            idle: nonzero(d("idle_timeout", &ra.idle_timeout)?),
            max_stream,
            max_grpc: d("max_grpc_timeout", &ra.max_grpc_timeout)?,
            grpc_offset: d("grpc_timeout_offset", &ra.grpc_timeout_offset)?,
        })
    }
}

/// One `request_mirror_policies` entry: a copy of a share of the requests goes to `cluster`.
#[derive(Debug)]
pub struct Mirror {
    pub cluster: Arc<str>,
    /// The share mirrored, in millionths (Envoy's FractionalPercent scaled to MILLION).
    pub per_million: u32,
    /// Envoy appends `-shadow` to the host (before any port) unless told not to.
    pub shadow_suffix: bool,
    pub host_rewrite: Option<String>,
}

impl Mirror {
    fn translate(m: &rpb::route_action::RequestMirrorPolicy) -> Result<Mirror, String> {
        if m.cluster.is_empty() {
            return Err(if m.cluster_header.is_empty() {
                "request_mirror_policies: cluster is required".into()
            } else {
                "request_mirror_policies: cluster_header is not supported".into()
            });
        }
        if !m.request_headers_mutations.is_empty() {
            return Err(
                "request_mirror_policies: request_headers_mutations is not supported yet".into(),
            );
        }
        // No fraction: every request is mirrored.
        let per_million = super::per_million(m.runtime_fraction.as_ref(), 1_000_000)
            .map_err(|e| format!("request_mirror_policies: {e}"))?;
        Ok(Mirror {
            cluster: Arc::from(m.cluster.as_str()),
            per_million,
            shadow_suffix: !m.disable_shadow_host_suffix_append,
            host_rewrite: (!m.host_rewrite_literal.is_empty())
                .then(|| m.host_rewrite_literal.clone()),
        })
    }

    /// The host a mirrored request carries.
    pub fn host(&self, host: &str) -> String {
        if let Some(h) = &self.host_rewrite {
            return h.clone();
        }
        if !self.shadow_suffix {
            return host.to_string();
        }
        match host
            .rsplit_once(':')
            .filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
        {
            Some((h, p)) if !h.ends_with(']') || host.starts_with('[') => format!("{h}-shadow:{p}"),
            _ => format!("{host}-shadow"),
        }
    }
}

fn mirrors(
    list: &[rpb::route_action::RequestMirrorPolicy],
) -> Result<Option<Arc<[Mirror]>>, String> {
    if list.is_empty() {
        return Ok(None);
    }
    let v = list
        .iter()
        .map(Mirror::translate)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(Arc::from(v)))
}

#[derive(Debug)]
pub enum Target {
    Cluster(Arc<str>),
    Weighted(WeightedClusters),
}

/// `weighted_clusters`: cumulative weights so a pick is one random number and a short scan.
#[derive(Debug)]
pub struct WeightedClusters {
    pub clusters: Vec<(Arc<str>, u64)>,
    pub total: u64,
    /// Per entry (same order as `clusters`): its own header mutations and fault overrides,
    /// applied before the route's.
    pub entries: Vec<ClusterEntry>,
}

#[derive(Debug, Default)]
pub struct ClusterEntry {
    pub request_headers: Option<Arc<HeaderOps>>,
    pub response_headers: Option<Arc<HeaderOps>>,
    /// The entry's own `typed_per_filter_config` (faults only), over the route's.
    pub filters: RouteFilters,
}

impl WeightedClusters {
    /// `value` is uniformly random; Envoy picks `value % total` against running sums.
    pub fn pick(&self, value: u64) -> &Arc<str> {
        &self.clusters[self.pick_index(value)].0
    }

    /// The index of the entry `pick` would choose.
    pub fn pick_index(&self, value: u64) -> usize {
        let mut point = value % self.total.max(1);
        for (i, (_, weight)) in self.clusters.iter().enumerate() {
            if point < *weight {
                return i;
            }
            point -= weight;
        }
        // Unreachable when total is the sum of weights; fall back to the last cluster.
        self.clusters.len() - 1
    }
}

#[derive(Debug)]
pub struct Redirect {
    pub scheme: Option<String>,
    pub host: Option<String>,
    pub port: Option<u32>,
    pub path: Option<String>,
    pub prefix_rewrite: Option<String>,
    pub regex_rewrite: Option<RegexRewrite>,
    pub strip_query: bool,
    pub status: StatusCode,
}

#[derive(Debug)]
pub struct QueryMatcher {
    pub name: String,
    pub kind: QueryMatch,
}

#[derive(Debug)]
pub enum QueryMatch {
    String(StringMatch),
    Present,
    /// `present_match: false`: the parameter must be absent.
    Absent,
}

/// `regex_rewrite`: every match in the path (not the query) replaced, as RE2's GlobalReplace.
#[derive(Debug)]
pub struct RegexRewrite {
    regex: Regex,
    /// The substitution in the regex crate's syntax (`\1` becomes `${1}`).
    substitution: String,
}

impl RegexRewrite {
    pub fn translate(m: &mpb::RegexMatchAndSubstitute) -> Result<RegexRewrite, String> {
        let pattern = m.pattern.as_ref().ok_or("pattern is required")?;
        if pattern.regex.is_empty() {
            return Err("pattern.regex must not be empty".into());
        }
        check_repeat_limit(&pattern.regex)?;
        let regex = regex::RegexBuilder::new(&pattern.regex)
            .size_limit(1 << 20)
            .build()
            .map_err(|e| {
                let msg = e.to_string();
                let last = msg
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                format!(
                    "invalid regex '{}': {}",
                    pattern.regex,
                    last.trim().trim_start_matches("error: ")
                )
            })?;
        let groups = regex.captures_len() - 1;
        let mut substitution = String::with_capacity(m.substitution.len());
        let mut chars = m.substitution.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some(d @ '0'..='9') => {
                        let n = d as usize - '0' as usize;
                        if n > groups {
                            return Err(format!(
                                "substitution '{}' refers to group {n}; the pattern has {groups}",
                                m.substitution
                            ));
                        }
                        substitution.push_str(&format!("${{{n}}}"));
                    }
                    Some('\\') => substitution.push('\\'),
                    _ => {
                        return Err(format!(
                        "substitution '{}': a backslash must be followed by a digit or a backslash",
                        m.substitution
                    ))
                    }
                },
                '$' => substitution.push_str("$$"),
                c => substitution.push(c),
            }
        }
        Ok(RegexRewrite {
            regex,
            substitution,
        })
    }

    /// The rewritten path.
    pub fn apply(&self, path: &str) -> String {
        self.regex
            .replace_all(path, self.substitution.as_str())
            .into_owned()
    }
}

impl RouteTable {
    /// Picks the virtual host for `host` as Envoy does: exact, then longest `*.suffix`, then
    /// longest `prefix.*`, then `*`. `host` must already be lowercase.
    pub fn vhost(&self, host: &str) -> Option<&VirtualHost> {
        if let Some(i) = self.exact.get(host) {
            return Some(&self.vhosts[*i]);
        }
        // Wildcards never match the empty string, hence the strict length check.
        for (suffix, i) in &self.suffixes {
            if host.len() > suffix.len() && host.ends_with(suffix.as_str()) {
                return Some(&self.vhosts[*i]);
            }
        }
        for (prefix, i) in &self.prefixes {
            if host.len() > prefix.len() && host.starts_with(prefix.as_str()) {
                return Some(&self.vhosts[*i]);
            }
        }
        self.any.map(|i| &self.vhosts[i])
    }

    /// A table without virtual hosts: what a tcp_proxy chain carries, since it routes nothing.
    pub fn empty() -> RouteTable {
        RouteTable {
            any_require_tls: false,
            internal_only: Vec::new(),
            name: String::new(),
            vhosts: Vec::new(),
            exact: HashMap::new(),
            suffixes: Vec::new(),
            prefixes: Vec::new(),
            any: None,
            ignore_port: false,
            validate_clusters: None,
        }
    }

    pub fn translate(rc: &rpb::RouteConfiguration) -> Result<RouteTable, TranslateError> {
        let err = |detail: String| TranslateError::new(format!("route '{}'", rc.name), detail);
        let mut vhosts = Vec::with_capacity(rc.virtual_hosts.len());
        let mut exact = HashMap::new();
        let mut suffixes = Vec::new();
        let mut prefixes = Vec::new();
        let mut any = None;
        let mut seen = HashMap::new();
        let rc_headers = headers::level(
            &rc.request_headers_to_add,
            &rc.request_headers_to_remove,
            &rc.response_headers_to_add,
            &rc.response_headers_to_remove,
        )
        .map_err(err)?;
        let rc_faults = fault::per_route(&rc.typed_per_filter_config).map_err(err)?;
        let rc_limits =
            crate::filters::local_ratelimit::per_route(&rc.typed_per_filter_config).map_err(err)?;
        let rc_rbac = crate::filters::rbac::per_route(&rc.typed_per_filter_config).map_err(err)?;
        let rc_authz =
            crate::filters::ext_authz::per_route(&rc.typed_per_filter_config).map_err(err)?;
        let rc_jwt =
            crate::filters::jwt_authn::per_route(&rc.typed_per_filter_config).map_err(err)?;
        let most_specific_wins = rc.most_specific_header_mutations_wins;
        let rc_mirrors = mirrors(&rc.request_mirror_policies)
            .map_err(|e| err(format!("request_mirror_policies: {e}")))?
            .unwrap_or_else(|| Arc::from(Vec::new()));
        let max_direct_body = rc
            .max_direct_response_body_size_bytes
            .as_ref()
            .map_or(4096, |v| v.value as usize);
        let internal_only = rc
            .internal_only_headers
            .iter()
            .map(|h| {
                http::HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                    err(format!(
                        "internal_only_headers: '{h}' is not a valid header name"
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        // What would pick virtual hosts, routes or a path to match in another way than these
        // tables do: refused rather than left out. Accepted at every level, and why they
        // cannot change an answer here: `metadata` (nothing reads route metadata),
        // `stat_prefix`, `virtual_clusters`, `tracing` (stats and spans), `rate_limits` (no
        // global rate-limit filter; local descriptors are refused), `metadata_match` (only the
        // subset balancer, refused, reads it), `per_request_buffer_limit_bytes` and
        // `request_body_buffer_limit` (pingora's retry buffer has its own bound),
        // `flush_timeout`, `runtime_key_prefix` (no runtime key of that form is read).
        let refused = [
            ("vhds", rc.vhds.is_some()),
            ("vhost_header", !rc.vhost_header.is_empty()),
            (
                "ignore_path_parameters_in_path_matching",
                rc.ignore_path_parameters_in_path_matching,
            ),
            ("route_specifiers", !rc.route_specifiers.is_empty()),
        ];
        if let Some((field, _)) = refused.iter().find(|(_, set)| *set) {
            return Err(err(format!("{field} is not supported")));
        }
        for (vi, vh) in rc.virtual_hosts.iter().enumerate() {
            if vh.matcher.is_some() {
                return Err(err(format!(
                    "vhost '{}': matcher (the match tree API) is not supported; use routes",
                    vh.name
                )));
            }
            if !vh.route_specifiers.is_empty() {
                return Err(err(format!(
                    "vhost '{}': route_specifiers are not supported",
                    vh.name
                )));
            }
            if vh
                .hedge_policy
                .as_ref()
                .is_some_and(|h| h.hedge_on_per_try_timeout)
            {
                return Err(err(format!(
                    "vhost '{}': hedge_policy.hedge_on_per_try_timeout is not supported",
                    vh.name
                )));
            }
            let vctx = format!("vhost '{}'", vh.name);
            if vh.name.is_empty() {
                return Err(err(format!("virtual_hosts[{vi}]: name must not be empty")));
            }
            if vh.domains.is_empty() {
                return Err(err(format!("{vctx}: domains must not be empty")));
            }
            for d in &vh.domains {
                let d = d.to_ascii_lowercase();
                if seen.insert(d.clone(), vi).is_some() {
                    return Err(err(format!(
                        "{vctx}: only unique values for domains are permitted; duplicate entry of domain {d}"
                    )));
                }
                // Like Envoy, only a leading or trailing `*` is a wildcard; any other `*`
                // is a literal character of the domain.
                if d == "*" {
                    any = Some(vi);
                } else if let Some(rest) = d.strip_prefix('*') {
                    suffixes.push((rest.to_string(), vi));
                } else if let Some(rest) = d.strip_suffix('*') {
                    prefixes.push((rest.to_string(), vi));
                } else {
                    exact.insert(d, vi);
                }
            }
            let vhost_retry = match &vh.retry_policy {
                Some(p) => Some(Arc::new(
                    RetryPolicy::translate(p)
                        .map_err(|e| err(format!("{vctx}: retry_policy: {e}")))?,
                )),
                None => None,
            };
            #[allow(deprecated)]
            let vh_cors = vh.cors.as_ref();
            let vhost_ctx = VhostCtx {
                filter_configs: &vh.typed_per_filter_config,
                config_filter_configs: &rc.typed_per_filter_config,
                cors: vh_cors,
                retry: vhost_retry,
                // The route configuration's mirrors for a virtual host without its own.
                mirrors: match mirrors(&vh.request_mirror_policies)
                    .map_err(|e| err(format!("{vctx}: {e}")))?
                {
                    Some(m) => m,
                    None => rc_mirrors.clone(),
                },
                max_direct_body,
                attempt_count_to_upstream: vh.include_request_attempt_count,
                attempt_count_to_client: vh.include_attempt_count_in_response,
            };
            let vh_headers = headers::level(
                &vh.request_headers_to_add,
                &vh.request_headers_to_remove,
                &vh.response_headers_to_add,
                &vh.response_headers_to_remove,
            )
            .map_err(|e| err(format!("{vctx}: {e}")))?;
            let vh_faults = fault::per_route(&vh.typed_per_filter_config)
                .map_err(|e| err(format!("{vctx}: {e}")))?;
            let vh_limits = crate::filters::local_ratelimit::per_route(&vh.typed_per_filter_config)
                .map_err(|e| err(format!("{vctx}: {e}")))?;
            let vh_rbac = crate::filters::rbac::per_route(&vh.typed_per_filter_config)
                .map_err(|e| err(format!("{vctx}: {e}")))?;
            let vh_authz = crate::filters::ext_authz::per_route(&vh.typed_per_filter_config)
                .map_err(|e| err(format!("{vctx}: {e}")))?;
            let vh_jwt = crate::filters::jwt_authn::per_route(&vh.typed_per_filter_config)
                .map_err(|e| err(format!("{vctx}: {e}")))?;
            let mut routes = Vec::with_capacity(vh.routes.len());
            for (ri, r) in vh.routes.iter().enumerate() {
                let mut route = translate_route(r, &vhost_ctx)
                    .map_err(|e| err(format!("{vctx} route {ri}: {e}")))?;
                let (rq, rs) = headers::level(
                    &r.request_headers_to_add,
                    &r.request_headers_to_remove,
                    &r.response_headers_to_add,
                    &r.response_headers_to_remove,
                )
                .map_err(|e| err(format!("{vctx} route {ri}: {e}")))?;
                route.header_plan = Arc::new(HeaderPlan::build(
                    [&rc_headers, &vh_headers, &(rq, rs)],
                    most_specific_wins,
                ));
                let own = fault::per_route(&r.typed_per_filter_config)
                    .map_err(|e| err(format!("{vctx} route {ri}: {e}")))?;
                route.filters.faults = fault::layer(&[&rc_faults, &vh_faults, &own]);
                let own_limits =
                    crate::filters::local_ratelimit::per_route(&r.typed_per_filter_config)
                        .map_err(|e| err(format!("{vctx} route {ri}: {e}")))?;
                route.filters.rate_limits = own_limits;
                for level in [&vh_limits, &rc_limits] {
                    for (name, c) in level.iter() {
                        if !route.filters.rate_limits.iter().any(|(n, _)| n == name) {
                            route.filters.rate_limits.push((name.clone(), c.clone()));
                        }
                    }
                }
                // RBACPerRoute: the most specific level's word for each filter name.
                route.filters.rbac = crate::filters::rbac::per_route(&r.typed_per_filter_config)
                    .map_err(|e| err(format!("{vctx} route {ri}: {e}")))?;
                for level in [&vh_rbac, &rc_rbac] {
                    for (name, c) in level.iter() {
                        if !route.filters.rbac.iter().any(|(n, _)| n == name) {
                            route.filters.rbac.push((name.clone(), c.clone()));
                        }
                    }
                }
                // PerRouteConfig (jwt_authn): the most specific level's word for each filter.
                route.filters.jwt =
                    crate::filters::jwt_authn::per_route(&r.typed_per_filter_config)
                        .map_err(|e| err(format!("{vctx} route {ri}: {e}")))?;
                for level in [&vh_jwt, &rc_jwt] {
                    for (name, c) in level.iter() {
                        if !route.filters.jwt.iter().any(|(n, _)| n == name) {
                            route.filters.jwt.push((name.clone(), c.clone()));
                        }
                    }
                }
                let own_authz = crate::filters::ext_authz::per_route(&r.typed_per_filter_config)
                    .map_err(|e| err(format!("{vctx} route {ri}: {e}")))?;
                if !(own_authz.is_empty() && vh_authz.is_empty() && rc_authz.is_empty()) {
                    route.filters.ext_authz =
                        crate::filters::ext_authz::merge(&[&own_authz, &vh_authz, &rc_authz]);
                }
                routes.push(route);
            }
            use rpb::virtual_host::TlsRequirementType as T;
            let require_tls = match T::try_from(vh.require_tls) {
                Ok(T::None) => RequireTls::None,
                Ok(T::ExternalOnly) => RequireTls::ExternalOnly,
                Ok(T::All) => RequireTls::All,
                Err(_) => {
                    return Err(err(format!(
                        "{vctx}: require_tls: unknown value {}",
                        vh.require_tls
                    )))
                }
            };
            vhosts.push(VirtualHost {
                name: vh.name.clone(),
                require_tls,
                index: RouteIndex::build(&routes),
                routes,
            });
        }
        // Longest wildcard wins; the sort is stable so equal lengths keep config order.
        suffixes.sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
        prefixes.sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
        Ok(RouteTable {
            any_require_tls: vhosts.iter().any(|v| v.require_tls != RequireTls::None),
            internal_only,
            name: rc.name.clone(),
            vhosts,
            exact,
            suffixes,
            prefixes,
            any,
            ignore_port: rc.ignore_port_in_host_matching,
            validate_clusters: rc.validate_clusters.as_ref().map(|b| b.value),
        })
    }

    /// Route targets naming a cluster not in `known`, as Envoy words it.
    pub fn unknown_clusters(&self, known: impl Fn(&str) -> bool) -> Vec<String> {
        let mut out = Vec::new();
        for r in self.vhosts.iter().flat_map(|v| v.routes.iter()) {
            let Action::Forward(f) = &r.action else {
                continue;
            };
            match &f.target {
                Target::Cluster(c) if !known(c) => {
                    out.push(format!("route '{}': unknown cluster '{c}'", self.name))
                }
                Target::Weighted(w) => {
                    for (c, _) in w.clusters.iter().filter(|(c, _)| !known(c)) {
                        out.push(format!(
                            "route '{}': unknown weighted cluster '{c}'",
                            self.name
                        ));
                    }
                }
                _ => {}
            }
        }
        out
    }

    /// Every cluster name a route may send traffic to.
    pub fn clusters(&self) -> impl Iterator<Item = &Arc<str>> {
        self.vhosts
            .iter()
            .flat_map(|v| v.routes.iter())
            .flat_map(|r| match &r.action {
                Action::Forward(f) => match &f.target {
                    Target::Cluster(c) => std::slice::from_ref(c).iter().collect::<Vec<_>>(),
                    Target::Weighted(w) => w.clusters.iter().map(|(c, _)| c).collect(),
                },
                _ => Vec::new(),
            })
    }
}

/// What a virtual host (and its route configuration) lends its routes.
struct VhostCtx<'a> {
    filter_configs: &'a HashMap<String, envoy_types::pb::google::protobuf::Any>,
    config_filter_configs: &'a HashMap<String, envoy_types::pb::google::protobuf::Any>,
    cors: Option<&'a rpb::CorsPolicy>,
    retry: Option<Arc<RetryPolicy>>,
    mirrors: Arc<[Mirror]>,
    attempt_count_to_upstream: bool,
    attempt_count_to_client: bool,
    /// The route configuration's `max_direct_response_body_size_bytes` (Envoy's default
    /// 4096; istiod sets 1 MiB).
    max_direct_body: usize,
}

fn translate_route(r: &rpb::Route, vh: &VhostCtx) -> Result<Route, String> {
    let mut route = translate_route_inner(r, vh)?;
    // Only forwarding routes have a route entry, which is where Envoy's CORS filter looks.
    if let (Action::Forward(_), Some(rpb::route::Action::Route(ra))) = (&route.action, &r.action) {
        #[allow(deprecated)]
        let own = ra.cors.as_ref();
        route.filters.cors = crate::filters::cors::resolve(
            &r.typed_per_filter_config,
            vh.filter_configs,
            vh.config_filter_configs,
            [own, vh.cors],
        )?
        .map(Arc::new);
    }
    Ok(route)
}

fn translate_route_inner(r: &rpb::Route, vh: &VhostCtx) -> Result<Route, String> {
    if !r.route_specifiers.is_empty() {
        return Err("route_specifiers are not supported".into());
    }
    use rpb::route_match::PathSpecifier as PS;
    let m = r.r#match.as_ref().ok_or("match is required")?;
    let case_sensitive = m.case_sensitive.as_ref().map(|b| b.value).unwrap_or(true);
    let path = match &m.path_specifier {
        Some(PS::Prefix(p)) => PathMatch::Prefix(if case_sensitive {
            p.clone()
        } else {
            p.to_ascii_lowercase()
        }),
        Some(PS::Path(p)) => PathMatch::Exact(if case_sensitive {
            p.clone()
        } else {
            p.to_ascii_lowercase()
        }),
        Some(PS::SafeRegex(re)) => PathMatch::Regex(regex_matcher(re)?),
        Some(PS::PathSeparatedPrefix(p)) => {
            if p.is_empty() || p.ends_with('/') || p.contains(['?', '#']) {
                return Err(format!(
                    "path_separated_prefix '{p}' must not end with '/' or contain '?' or '#'"
                ));
            }
            PathMatch::SeparatedPrefix(if case_sensitive {
                p.clone()
            } else {
                p.to_ascii_lowercase()
            })
        }
        Some(PS::ConnectMatcher(_)) => return Err("connect_matcher is not supported".into()),
        Some(PS::PathMatchPolicy(p)) => {
            return Err(format!("path_match_policy '{}' is not supported", p.name))
        }
        None => {
            return Err(
                "match: one of prefix, path, safe_regex or path_separated_prefix is required"
                    .into(),
            )
        }
    };
    if !m.dynamic_metadata.is_empty() {
        return Err("match.dynamic_metadata is not supported".into());
    }
    if m.tls_context.is_some() {
        return Err("match.tls_context is not supported".into());
    }
    if !m.cookies.is_empty() {
        return Err("match.cookies is not supported".into());
    }
    if !m.filter_state.is_empty() {
        return Err("match.filter_state is not supported".into());
    }
    // A share of requests below all of them would leave the others to later routes.
    let share = crate::units::per_million(m.runtime_fraction.as_ref(), 1_000_000)
        .map_err(|e| format!("match.runtime_fraction: {e}"))?;
    if share < 1_000_000 {
        return Err("match.runtime_fraction below 100% is not supported".into());
    }
    let headers = m
        .headers
        .iter()
        .enumerate()
        .map(|(i, h)| header_matcher(h).map_err(|e| format!("headers[{i}] '{}': {e}", h.name)))
        .collect::<Result<Vec<_>, _>>()?;
    let query = m
        .query_parameters
        .iter()
        .enumerate()
        .map(|(i, q)| {
            query_matcher(q).map_err(|e| format!("query_parameters[{i}] '{}': {e}", q.name))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let action = match &r.action {
        Some(rpb::route::Action::Route(ra)) => Action::Forward(forward(ra, vh)?),
        Some(rpb::route::Action::DirectResponse(d)) => direct(d, vh.max_direct_body)?,
        Some(rpb::route::Action::Redirect(rd)) => Action::Redirect(redirect(rd)?),
        Some(_) => {
            return Err("only route, redirect and direct_response actions are supported".into())
        }
        None => return Err("an action (route, redirect or direct_response) is required".into()),
    };
    Ok(Route {
        name: Arc::from(r.name.as_str()),
        path,
        case_sensitive,
        headers,
        query,
        grpc_only: m.grpc.is_some(),
        action,
        header_plan: Arc::default(),
        filters: RouteFilters::default(),
        // Tracing only; an empty operation (which Envoy's validation refuses) names nothing.
        decorator: r
            .decorator
            .as_ref()
            .filter(|d| !d.operation.is_empty())
            .map(|d| {
                Arc::new(Decorator {
                    operation: Arc::from(d.operation.as_str()),
                    propagate: d.propagate.as_ref().is_none_or(|b| b.value),
                })
            }),
    })
}

fn query_matcher(q: &rpb::QueryParameterMatcher) -> Result<QueryMatcher, String> {
    use rpb::query_parameter_matcher::QueryParameterMatchSpecifier as Q;
    if q.name.is_empty() {
        return Err("name must not be empty".into());
    }
    let kind = match &q.query_parameter_match_specifier {
        Some(Q::StringMatch(s)) => QueryMatch::String(string_matcher(s)?),
        Some(Q::PresentMatch(true)) | None => QueryMatch::Present,
        Some(Q::PresentMatch(false)) => QueryMatch::Absent,
    };
    Ok(QueryMatcher {
        name: q.name.clone(),
        kind,
    })
}

fn forward(ra: &rpb::RouteAction, vh: &VhostCtx) -> Result<Forward, String> {
    use rpb::route_action::ClusterSpecifier as C;
    use rpb::route_action::HostRewriteSpecifier as HR;
    let target = match &ra.cluster_specifier {
        Some(C::Cluster(c)) if !c.is_empty() => Target::Cluster(Arc::from(c.as_str())),
        Some(C::Cluster(_)) => return Err("route.cluster must not be empty".into()),
        Some(C::WeightedClusters(w)) => {
            if w.clusters.is_empty() {
                return Err("weighted_clusters.clusters must not be empty".into());
            }
            // The pick's number from a header or the route's hash, not a random one.
            if w.random_value_specifier.is_some() {
                return Err("weighted_clusters: random_value_specifier is not supported".into());
            }
            let mut clusters = Vec::with_capacity(w.clusters.len());
            let mut entries = Vec::with_capacity(w.clusters.len());
            let mut total = 0u64;
            for (i, c) in w.clusters.iter().enumerate() {
                if c.name.is_empty() {
                    return Err(format!(
                        "weighted_clusters.clusters[{i}]: name is required (cluster_header is not supported)"
                    ));
                }
                let weight = c.weight.as_ref().map(|v| u64::from(v.value)).unwrap_or(0);
                total += weight;
                clusters.push((Arc::from(c.name.as_str()), weight));
                let wctx = |e: String| format!("weighted_clusters.clusters[{i}] '{}': {e}", c.name);
                if c.host_rewrite_specifier.is_some() {
                    return Err(wctx("host_rewrite_literal is not supported".into()));
                }
                let (request_headers, response_headers) = headers::level(
                    &c.request_headers_to_add,
                    &c.request_headers_to_remove,
                    &c.response_headers_to_add,
                    &c.response_headers_to_remove,
                )
                .map_err(wctx)?;
                // Envoy applies a policy filter's per-route word on the entry picked; here
                // only faults are read from an entry, so the others are refused rather than
                // left out (a route could otherwise lose its authentication).
                for (name, a) in &c.typed_per_filter_config {
                    if [
                        crate::filters::jwt_authn::PER_ROUTE_TYPE,
                        crate::filters::rbac::PER_ROUTE_TYPE,
                        crate::filters::ext_authz::PER_ROUTE_TYPE,
                    ]
                    .contains(&a.type_url.as_str())
                    {
                        return Err(wctx(format!(
                            "typed_per_filter_config['{name}']: {} on a weighted cluster is not supported",
                            a.type_url
                        )));
                    }
                }
                entries.push(ClusterEntry {
                    request_headers,
                    response_headers,
                    filters: RouteFilters {
                        faults: fault::per_route(&c.typed_per_filter_config).map_err(wctx)?,
                        ..Default::default()
                    },
                });
            }
            // total_weight is deprecated and ignored by Envoy 1.40.
            if total > u64::from(u32::MAX) {
                return Err(format!(
                    "weighted_clusters: the sum of weights ({total}) exceeds 4294967295"
                ));
            }
            if total == 0 {
                return Err("weighted_clusters: sum of weights must be greater than 0".into());
            }
            Target::Weighted(WeightedClusters {
                clusters,
                total,
                entries,
            })
        }
        Some(C::ClusterHeader(_)) => return Err("cluster_header is not supported".into()),
        Some(_) => return Err("cluster specifier plugins are not supported".into()),
        None => return Err("route: one of cluster or weighted_clusters is required".into()),
    };
    if matches!(ra.host_rewrite_specifier, Some(HR::HostRewrite(_))) {
        return Err("host_rewrite (a format string) is not supported".into());
    }
    if !ra.path_rewrite.is_empty() {
        return Err("path_rewrite (a format string) is not supported".into());
    }
    #[allow(deprecated)]
    let internal_redirects = ra.internal_redirect_policy.is_some()
        || ra.internal_redirect_action != 0
        || ra.max_internal_redirects.is_some();
    if internal_redirects {
        return Err("internal redirects (internal_redirect_policy) are not supported".into());
    }
    if ra
        .hedge_policy
        .as_ref()
        .is_some_and(|h| h.hedge_on_per_try_timeout)
    {
        return Err("hedge_policy.hedge_on_per_try_timeout is not supported".into());
    }
    if ra.priority != 0 {
        return Err(
            "priority: only DEFAULT is supported (HIGH circuit-breaker thresholds are not)".into(),
        );
    }
    let host_rewrite = match &ra.host_rewrite_specifier {
        Some(HR::HostRewriteLiteral(h)) => Some(h.clone()),
        _ => None,
    };
    let host_rewrite_from = match &ra.host_rewrite_specifier {
        Some(HR::AutoHostRewrite(b)) if b.value => Some(HostRewrite::Auto),
        Some(HR::HostRewriteHeader(h)) => Some(HostRewrite::Header(
            http::HeaderName::from_bytes(h.as_bytes())
                .map_err(|_| format!("host_rewrite_header: invalid header name '{h}'"))?,
        )),
        Some(HR::HostRewritePathRegex(m)) => Some(HostRewrite::PathRegex(
            RegexRewrite::translate(m).map_err(|e| format!("host_rewrite_path_regex: {e}"))?,
        )),
        _ => None,
    }
    .map(Box::new);
    let timeout = match &ra.timeout {
        None => Some(std::time::Duration::from_secs(15)),
        Some(d) => {
            let d = super::duration(d).map_err(|e| format!("timeout: {e}"))?;
            (!d.is_zero()).then_some(d)
        }
    };
    // A route's own policy replaces its virtual host's entirely, as in Envoy.
    let retry = match &ra.retry_policy {
        Some(p) => Some(Arc::new(
            RetryPolicy::translate(p).map_err(|e| format!("retry_policy: {e}"))?,
        )),
        None => vh.retry.clone(),
    };
    let regex_rewrite = match &ra.regex_rewrite {
        Some(_) if !ra.prefix_rewrite.is_empty() => {
            return Err(
                "specify only one of prefix_rewrite, regex_rewrite or path_rewrite_policy".into(),
            );
        }
        Some(rr) => Some(RegexRewrite::translate(rr).map_err(|e| format!("regex_rewrite: {e}"))?),
        None => None,
    };
    if ra.path_rewrite_policy.is_some() {
        return Err("path_rewrite_policy is not supported yet".into());
    }
    let mirrors = mirrors(&ra.request_mirror_policies)?.unwrap_or_else(|| vh.mirrors.clone());
    let hash_policy = crate::lb::hash_policy::translate(&ra.hash_policy)?;
    let timeouts = StreamTimeouts::translate(ra)?;
    let upgrades = super::upgrade::Upgrades::from_route(&ra.upgrade_configs)?;
    let cluster_not_found = {
        use rpb::route_action::ClusterNotFoundResponseCode as C;
        match C::try_from(ra.cluster_not_found_response_code) {
            Ok(C::ServiceUnavailable) => 503,
            Ok(C::NotFound) => 404,
            Ok(C::InternalServerError) => 500,
            Err(_) => {
                return Err(format!(
                    "cluster_not_found_response_code: {} is not a defined value",
                    ra.cluster_not_found_response_code
                ))
            }
        }
    };
    Ok(Forward {
        upgrades,
        cluster_not_found,
        hash_policy,
        target,
        timeout,
        timeouts,
        mirrors,
        regex_rewrite,
        prefix_rewrite: (!ra.prefix_rewrite.is_empty()).then(|| ra.prefix_rewrite.clone()),
        host_rewrite,
        host_rewrite_from,
        append_x_forwarded_host: ra.append_x_forwarded_host,
        retry,
        attempt_count_to_upstream: vh.attempt_count_to_upstream,
        attempt_count_to_client: vh.attempt_count_to_client,
    })
}

fn direct(d: &rpb::DirectResponseAction, max_body: usize) -> Result<Action, String> {
    if d.body_format.is_some() {
        return Err("direct_response.body_format is not supported".into());
    }
    let status = u16::try_from(d.status)
        .ok()
        .filter(|s| (200..600).contains(s))
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| format!("direct_response.status {} must be in [200, 600)", d.status))?;
    let body = match d.body.as_ref().map(|b| b.specifier.as_ref()) {
        None => None,
        Some(None) => {
            return Err(
                "direct_response.body: one of inline_string or inline_bytes is required".into(),
            )
        }
        Some(Some(DataSpecifier::InlineString(s))) => Some(Bytes::from(s.clone())),
        Some(Some(DataSpecifier::InlineBytes(b))) => Some(Bytes::from(b.clone())),
        Some(_) => {
            return Err(
                "direct_response.body: filename and environment_variable are not supported; use inline_string or inline_bytes"
                    .into(),
            )
        }
    };
    if let Some(b) = body.as_ref().filter(|b| b.len() > max_body) {
        return Err(format!(
            "direct_response: response body size is {} bytes; maximum is {max_body}",
            b.len()
        ));
    }
    Ok(Action::Direct { status, body })
}

fn redirect(r: &rpb::RedirectAction) -> Result<Redirect, String> {
    use rpb::redirect_action::PathRewriteSpecifier as PR;
    use rpb::redirect_action::RedirectResponseCode as RC;
    use rpb::redirect_action::SchemeRewriteSpecifier as SR;
    let scheme = match &r.scheme_rewrite_specifier {
        Some(SR::HttpsRedirect(true)) => Some("https".to_string()),
        Some(SR::SchemeRedirect(s)) if !s.is_empty() => Some(s.to_ascii_lowercase()),
        _ => None,
    };
    let mut regex_rewrite = None;
    let (path, prefix_rewrite) = match &r.path_rewrite_specifier {
        Some(PR::PathRedirect(p)) => (Some(p.clone()), None),
        Some(PR::PrefixRewrite(p)) => (None, Some(p.clone())),
        Some(PR::RegexRewrite(rr)) => {
            regex_rewrite = Some(
                RegexRewrite::translate(rr).map_err(|e| format!("redirect.regex_rewrite: {e}"))?,
            );
            (None, None)
        }
        Some(PR::PathRewrite(_)) => return Err("redirect.path_rewrite is not supported".into()),
        None => (None, None),
    };
    let code = RC::try_from(r.response_code).map_err(|_| {
        format!(
            "redirect.response_code: {} is not a defined value",
            r.response_code
        )
    })?;
    let status = match code {
        RC::MovedPermanently => StatusCode::MOVED_PERMANENTLY,
        RC::Found => StatusCode::FOUND,
        RC::SeeOther => StatusCode::SEE_OTHER,
        RC::TemporaryRedirect => StatusCode::TEMPORARY_REDIRECT,
        RC::PermanentRedirect => StatusCode::PERMANENT_REDIRECT,
    };
    if r.host_redirect.contains(['\r', '\n', '\0']) {
        return Err("redirect.host_redirect: invalid header value characters".into());
    }
    Ok(Redirect {
        scheme,
        host: (!r.host_redirect.is_empty()).then(|| r.host_redirect.clone()),
        port: (r.port_redirect != 0).then_some(r.port_redirect),
        path,
        prefix_rewrite,
        regex_rewrite,
        strip_query: r.strip_query,
        status,
    })
}
#[cfg(test)]
#[path = "route_tests.rs"]
mod route_tests;
