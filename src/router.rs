//! The route matcher: a pure function from a route table and a request view to a route.

use http::HeaderMap;

pub use crate::matcher::{header_matches, RequestView};
use crate::snapshot::route::{PathMatch, QueryMatch, Route, RouteTable, VirtualHost};

/// Envoy's order: pick the vhost by authority, then the first route whose every condition holds.
pub fn route<'t>(
    table: &'t RouteTable,
    req: &RequestView<'_>,
) -> Option<(&'t VirtualHost, &'t Route)> {
    let vh = table.vhost(req.host)?;
    let path = req.path_only();
    match &vh.index {
        None => vh
            .routes
            .iter()
            .find(|r| route_matches(r, req, path))
            .map(|r| (vh, r)),
        Some(idx) => {
            let i = idx.candidates(path, |i| route_matches(&vh.routes[i as usize], req, path))?;
            Some((vh, &vh.routes[i as usize]))
        }
    }
}

fn eq_ic_prefix(path: &str, prefix: &str) -> bool {
    path.len() >= prefix.len()
        && path.as_bytes()[..prefix.len()].eq_ignore_ascii_case(prefix.as_bytes())
}

pub fn route_matches(r: &Route, req: &RequestView<'_>, path: &str) -> bool {
    let path_ok = match &r.path {
        PathMatch::Prefix(p) => {
            if r.case_sensitive {
                path.starts_with(p.as_str())
            } else {
                eq_ic_prefix(path, p)
            }
        }
        PathMatch::Exact(p) => {
            if r.case_sensitive {
                path == p
            } else {
                path.eq_ignore_ascii_case(p)
            }
        }
        PathMatch::Regex(re) => re.is_match(path),
        PathMatch::SeparatedPrefix(p) => {
            let starts = if r.case_sensitive {
                path.starts_with(p.as_str())
            } else {
                eq_ic_prefix(path, p)
            };
            starts && (path.len() == p.len() || path.as_bytes()[p.len()] == b'/')
        }
    };
    if !path_ok {
        return false;
    }
    if r.grpc_only && !is_grpc(req.headers) {
        return false;
    }
    r.headers.iter().all(|h| header_matches(h, req)) && query_matches(r, req)
}

/// A gRPC request, by content-type (`application/grpc` or `application/grpc+...`).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == "application/grpc" || v.starts_with("application/grpc+"))
}

fn query_matches(r: &Route, req: &RequestView<'_>) -> bool {
    if r.query.is_empty() {
        return true;
    }
    let query = req.query().unwrap_or("");
    r.query
        .iter()
        .all(|q| match (first_query_value(query, &q.name), &q.kind) {
            (None, QueryMatch::Absent) => true,
            (None, _) | (Some(_), QueryMatch::Absent) => false,
            (Some(_), QueryMatch::Present) => true,
            (Some(v), QueryMatch::String(m)) => m.matches(v),
        })
}

/// The first value of a query parameter, compared and returned undecoded, as Envoy does.
fn first_query_value<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == name).then_some(v)
    })
}

#[cfg(test)]
mod index_agrees_with_scan {
    use super::*;
    use envoy_types::pb::envoy::config::route::v3 as rpb;

    fn mk(i: usize, path: rpb::route_match::PathSpecifier, ci: bool) -> rpb::Route {
        rpb::Route {
            r#match: Some(rpb::RouteMatch {
                path_specifier: Some(path),
                case_sensitive: ci
                    .then_some(envoy_types::pb::google::protobuf::BoolValue { value: false }),
                ..Default::default()
            }),
            action: Some(rpb::route::Action::Route(rpb::RouteAction {
                cluster_specifier: Some(rpb::route_action::ClusterSpecifier::Cluster(format!(
                    "c{i}"
                ))),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    /// Property: for random route lists (long enough to be indexed) and random paths, the
    /// index picks exactly the route a first-match scan picks.
    #[test]
    fn indexed_match_is_first_match() {
        use rpb::route_match::PathSpecifier as PS;
        let segs = ["a", "b", "api", "v1", "A"];
        let rand_path = || {
            let n = fastrand::usize(0..4);
            let mut p = String::new();
            for _ in 0..n {
                p.push('/');
                p.push_str(segs[fastrand::usize(..segs.len())]);
            }
            if p.is_empty() || fastrand::bool() {
                p.push('/');
            }
            p
        };
        let headers = http::HeaderMap::new();
        for seed in 0..200u64 {
            fastrand::seed(seed);
            let routes: Vec<rpb::Route> = (0..fastrand::usize(16..40))
                .map(|i| {
                    let p = rand_path();
                    let spec = match fastrand::u8(0..5) {
                        0 | 1 => PS::Prefix(p),
                        2 => PS::Path(p),
                        3 => PS::SafeRegex(envoy_types::pb::envoy::r#type::matcher::v3::RegexMatcher {
                            regex: format!("{}.*", regex::escape(&p)),
                            ..Default::default()
                        }),
                        _ => PS::PathSeparatedPrefix(p.trim_end_matches('/').to_string()),
                    };
                    let ci = fastrand::u8(0..6) == 0;
                    mk(i, spec, ci)
                })
                .filter(|r| {
                    !matches!(&r.r#match.as_ref().and_then(|m| m.path_specifier.clone()), Some(PS::PathSeparatedPrefix(p)) if p.is_empty())
                })
                .collect();
            let rc = rpb::RouteConfiguration {
                name: "rc".into(),
                virtual_hosts: vec![rpb::VirtualHost {
                    name: "vh".into(),
                    domains: vec!["*".into()],
                    routes,
                    ..Default::default()
                }],
                ..Default::default()
            };
            let table = RouteTable::translate(&rc).expect("valid routes");
            let vh = &table.vhosts[0];
            if vh.index.is_none() {
                continue;
            }
            for _ in 0..50 {
                let path = format!(
                    "{}{}",
                    rand_path(),
                    if fastrand::bool() { "?q=1" } else { "" }
                );
                let view = RequestView {
                    host: "h",
                    authority: "h",
                    path: &path,
                    method: "GET",
                    scheme: "http",
                    headers: &headers,
                };
                let scan = vh
                    .routes
                    .iter()
                    .position(|r| route_matches(r, &view, view.path_only()));
                let indexed = route(&table, &view).map(|(_, r)| r as *const _);
                assert_eq!(
                    indexed,
                    scan.map(|i| &vh.routes[i] as *const _),
                    "seed {seed} path {path}"
                );
            }
        }
    }
}
#[cfg(test)]
#[path = "router_tests.rs"]
mod router_tests;
