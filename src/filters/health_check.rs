//! `envoy.filters.http.health_check`: a request matching the filter's headers is a health
//! check. Outside pass-through mode the gateway answers it itself: 200, or 503 when the
//! server fails health checks (`POST /healthcheck/fail`) or a listed cluster has fewer healthy
//! hosts than its minimum (`cluster_min_healthy_percentages`). In pass-through mode it goes
//! upstream unless the server fails health checks. Either way its response names the local
//! cluster in `x-envoy-upstream-healthchecked-cluster`; while the server fails health checks,
//! every other response carries `x-envoy-immediate-health-check-fail: true`.
//!
//! `cache_time` (pass-through answers reused for a while) is refused: the cached status would
//! answer requests, and Portico does not keep one.

use envoy_types::pb::envoy::extensions::filters::http::health_check::v3::HealthCheck;
use prost::Message;

use super::{Decision, FilterDecl, FilterState, HttpFilter, LocalReply, Request, Translated};
use crate::matcher::{header_matcher, header_matches, HeaderMatcher};

pub const TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.http.health_check.v3.HealthCheck";

/// What the health check filter reads of the server (the request path provides it).
pub trait ServerHealth {
    /// `POST /healthcheck/fail` is in force.
    fn failing(&self) -> bool;
    /// The cluster's (healthy, total) hosts; None: no such cluster.
    fn cluster(&self, name: &str) -> Option<(usize, usize)>;
    /// The local node's cluster (`node.cluster`).
    fn local_cluster(&self) -> &str;
}

#[derive(Debug)]
pub struct HealthCheckFilter {
    pub name: String,
    pub pass_through: bool,
    pub headers: Vec<HeaderMatcher>,
    /// (cluster, minimum healthy percent).
    pub min_healthy: Vec<(String, f64)>,
}

pub fn translate_filter(d: &FilterDecl<'_>) -> Result<Translated, String> {
    let c = HealthCheck::decode(d.config.value.as_slice())
        .map_err(|e| format!("cannot decode: {e}"))?;
    let pass_through = c
        .pass_through_mode
        .ok_or("pass_through_mode is required")?
        .value;
    if c.cache_time.is_some() {
        return Err(
            "cache_time is not supported (Portico keeps no cached health check answer)".into(),
        );
    }
    let headers = c
        .headers
        .iter()
        .enumerate()
        .map(|(i, h)| header_matcher(h).map_err(|e| format!("headers[{i}]: {e}")))
        .collect::<Result<_, _>>()?;
    let mut min_healthy: Vec<(String, f64)> = c
        .cluster_min_healthy_percentages
        .iter()
        .map(|(k, v)| (k.clone(), v.value))
        .collect();
    min_healthy.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(Translated::Run(HttpFilter::HealthCheck(
        HealthCheckFilter {
            name: d.name.to_string(),
            pass_through,
            headers,
            min_healthy,
        },
    )))
}

impl HealthCheckFilter {
    pub fn decode(&self, req: &Request<'_>, st: &mut FilterState) -> Decision {
        let Some(server) = req.server else {
            return Decision::Continue;
        };
        let failing = server.failing();
        let is_check = self.headers.iter().all(|h| header_matches(h, req.view));
        if !is_check {
            st.health_check_fail_header |= failing;
            return Decision::Continue;
        }
        st.healthchecked_cluster = Some(server.local_cluster().to_string());
        if self.pass_through && !failing {
            return Decision::Continue;
        }
        let healthy = !failing
            && self
                .min_healthy
                .iter()
                .all(|(c, min)| match server.cluster(c) {
                    None => false,
                    Some((_, 0)) => *min == 0.0,
                    Some((healthy, total)) => healthy as f64 >= total as f64 * min / 100.0,
                });
        Decision::Reply(LocalReply {
            status: if healthy { 200 } else { 503 },
            body: None,
            headers: Vec::new(),
            grpc_status: None,
            details: std::borrow::Cow::Borrowed(if healthy {
                "health_check_ok"
            } else {
                "health_check_failed"
            }),
        })
    }
}
