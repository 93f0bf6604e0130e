//! Active health checking (`Cluster.health_checks`) as Envoy's health checkers do it: the
//! config, the per-host state machine, the interval rules and the state the checkers share
//! with cluster builds. The checks themselves run in [`crate::health`], off the request path.
//!
//! What Envoy does, and Portico with it:
//! - A host added to a cluster with a health checker starts failed (`FAILED_ACTIVE_HC`); its
//!   first successful check makes it healthy whatever `healthy_threshold` says, later
//!   recoveries need `healthy_threshold` passes in a row.
//! - An HTTP answer outside `expected_statuses` (default: 200 only) fails the host at once,
//!   unless the status is in `retriable_statuses`; retriable answers, connect failures, resets
//!   and timeouts count towards `unhealthy_threshold`.
//! - A cluster with health checks warms until every host has had one check result.
//! - EDS `health_status` unhealthy/draining/timeout keeps a host out whatever the checks say.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::config::endpoint::v3 as epb;

use super::cluster::{Health, LoadAssignment};
use super::headers::HeaderOps;
pub use crate::live::health::{HcFlags, HealthHosts, Transition};

/// One translated `HealthCheck`.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthCheckConfig {
    pub timeout: Duration,
    pub interval: Duration,
    pub no_traffic_interval: Duration,
    pub no_traffic_healthy_interval: Duration,
    pub unhealthy_interval: Duration,
    pub unhealthy_edge_interval: Duration,
    pub healthy_edge_interval: Duration,
    pub initial_jitter: Duration,
    pub interval_jitter: Duration,
    pub interval_jitter_percent: u32,
    pub unhealthy_threshold: u32,
    pub healthy_threshold: u32,
    pub reuse_connection: bool,
    pub kind: CheckKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum CheckKind {
    /// Connect only: a completed TCP handshake passes.
    Tcp,
    Http(HttpCheck),
}

#[derive(Debug, Clone, PartialEq)]
pub struct HttpCheck {
    /// `host`; empty: the endpoint's `health_check_config.hostname`, else the cluster name.
    pub host: String,
    pub path: String,
    /// `method` (GET when unspecified; CONNECT is refused, as Envoy refuses it).
    pub method: http::Method,
    /// Half-open `[start, end)` status ranges.
    pub expected: Vec<(u16, u16)>,
    pub retriable: Vec<(u16, u16)>,
    pub http2: bool,
    pub headers: CheckHeaders,
}

impl HttpCheck {
    pub fn expects(&self, status: u16) -> bool {
        self.expected
            .iter()
            .any(|(s, e)| (*s..*e).contains(&status))
    }

    pub fn retries(&self, status: u16) -> bool {
        self.retriable
            .iter()
            .any(|(s, e)| (*s..*e).contains(&status))
    }
}

/// `request_headers_to_add` / `_to_remove`, parsed once; compared by their protos since the
/// parsed form has no equality.
#[derive(Debug, Clone)]
pub struct CheckHeaders {
    pub ops: Arc<HeaderOps>,
    source: (Vec<corepb::HeaderValueOption>, Vec<String>),
}

impl PartialEq for CheckHeaders {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

fn at(i: usize, field: &str) -> String {
    format!("health_checks[{i}].{field}")
}

fn required_duration(
    d: &Option<envoy_types::pb::google::protobuf::Duration>,
    field: &str,
) -> Result<Duration, String> {
    let d = d
        .as_ref()
        .ok_or_else(|| format!("{field}: value is required"))?;
    positive(d, field)
}

fn positive(
    d: &envoy_types::pb::google::protobuf::Duration,
    field: &str,
) -> Result<Duration, String> {
    let v = super::duration(d).map_err(|e| format!("{field}: {e}"))?;
    if v.is_zero() {
        return Err(format!("{field}: value must be greater than 0s"));
    }
    Ok(v)
}

fn optional_positive(
    d: &Option<envoy_types::pb::google::protobuf::Duration>,
    field: &str,
    default: Duration,
) -> Result<Duration, String> {
    d.as_ref().map_or(Ok(default), |d| positive(d, field))
}

fn ranges(
    rs: &[envoy_types::pb::envoy::r#type::v3::Int64Range],
    kind: &str,
) -> Result<Vec<(u16, u16)>, String> {
    rs.iter()
        .map(|r| {
            // Envoy's own wording (HttpStatusChecker::validateRange).
            if r.start >= r.end {
                return Err(format!(
                    "Invalid http {kind} status range: expecting start < end, but found start={} and end={}",
                    r.start, r.end
                ));
            }
            if r.start < 100 {
                return Err(format!(
                    "Invalid http {kind} status range: expecting start >= 100, but found start={}",
                    r.start
                ));
            }
            if r.end > 600 {
                return Err(format!(
                    "Invalid http {kind} status range: expecting end <= 600, but found end={}",
                    r.end
                ));
            }
            Ok((r.start as u16, r.end as u16))
        })
        .collect()
}

impl HealthCheckConfig {
    /// `Cluster.health_checks`: Portico runs one checker per cluster (the Envoy API of this
    /// build has no health check names, which Envoy needs to tell several apart).
    pub fn translate(checks: &[corepb::HealthCheck]) -> Result<Option<HealthCheckConfig>, String> {
        match checks {
            [] => Ok(None),
            [one] => HealthCheckConfig::translate_one(0, one).map(Some),
            _ => Err(
                "health_checks: more than one health check per cluster is not supported yet".into(),
            ),
        }
    }

    fn translate_one(i: usize, hc: &corepb::HealthCheck) -> Result<HealthCheckConfig, String> {
        use corepb::health_check::HealthChecker as HC;
        let f = |field: &str| at(i, field);
        let timeout = required_duration(&hc.timeout, &f("timeout"))?;
        let interval = required_duration(&hc.interval, &f("interval"))?;
        let unhealthy_threshold = hc
            .unhealthy_threshold
            .as_ref()
            .ok_or_else(|| format!("{}: value is required", f("unhealthy_threshold")))?
            .value;
        let healthy_threshold = hc
            .healthy_threshold
            .as_ref()
            .ok_or_else(|| format!("{}: value is required", f("healthy_threshold")))?
            .value;
        let kind = match &hc.health_checker {
            None => return Err(format!("{}: value is required (http_health_check, tcp_health_check, grpc_health_check or custom_health_check)", f("health_checker"))),
            Some(HC::GrpcHealthCheck(_)) => {
                return Err(format!("{} is not supported yet", f("grpc_health_check")))
            }
            Some(HC::CustomHealthCheck(c)) => {
                if c.name.is_empty() {
                    return Err(format!("{}: value length must be at least 1 characters", f("custom_health_check.name")));
                }
                return Err(format!("{} '{}' is not supported yet", f("custom_health_check"), c.name));
            }
            Some(HC::TcpHealthCheck(t)) => {
                if t.send.is_some() || !t.receive.is_empty() {
                    return Err(format!(
                        "{}: send/receive payloads are not supported yet (connect-only checks are)",
                        f("tcp_health_check")
                    ));
                }
                if t.proxy_protocol_config.is_some() {
                    return Err(format!("{} is not supported yet", f("tcp_health_check.proxy_protocol_config")));
                }
                CheckKind::Tcp
            }
            Some(HC::HttpHealthCheck(h)) => CheckKind::Http(http_check(i, h)?),
        };
        if hc.alt_port.is_some() {
            return Err(format!("{} is not supported yet", f("alt_port")));
        }
        #[allow(deprecated)]
        if !hc.event_log_path.is_empty() {
            return Err(format!("{} is not supported yet", f("event_log_path")));
        }
        if !hc.event_logger.is_empty() {
            return Err(format!("{} is not supported yet", f("event_logger")));
        }
        if hc.event_service.is_some() {
            return Err(format!("{} is not supported yet", f("event_service")));
        }
        if hc.tls_options.is_some() {
            return Err(format!("{} is not supported yet", f("tls_options")));
        }
        if hc.transport_socket_match_criteria.is_some() {
            return Err(format!(
                "{} is not supported yet",
                f("transport_socket_match_criteria")
            ));
        }
        let no_traffic_interval = optional_positive(
            &hc.no_traffic_interval,
            &f("no_traffic_interval"),
            Duration::from_secs(60),
        )?;
        let unhealthy_interval =
            optional_positive(&hc.unhealthy_interval, &f("unhealthy_interval"), interval)?;
        let jitter = |d: &Option<envoy_types::pb::google::protobuf::Duration>, field: &str| {
            d.as_ref().map_or(Ok(Duration::ZERO), |d| {
                super::duration(d).map_err(|e| format!("{}: {e}", f(field)))
            })
        };
        Ok(HealthCheckConfig {
            timeout,
            interval,
            no_traffic_interval,
            no_traffic_healthy_interval: optional_positive(
                &hc.no_traffic_healthy_interval,
                &f("no_traffic_healthy_interval"),
                no_traffic_interval,
            )?,
            unhealthy_interval,
            unhealthy_edge_interval: optional_positive(
                &hc.unhealthy_edge_interval,
                &f("unhealthy_edge_interval"),
                unhealthy_interval,
            )?,
            healthy_edge_interval: optional_positive(
                &hc.healthy_edge_interval,
                &f("healthy_edge_interval"),
                interval,
            )?,
            initial_jitter: jitter(&hc.initial_jitter, "initial_jitter")?,
            interval_jitter: jitter(&hc.interval_jitter, "interval_jitter")?,
            interval_jitter_percent: hc.interval_jitter_percent,
            unhealthy_threshold,
            healthy_threshold,
            reuse_connection: hc.reuse_connection.as_ref().is_none_or(|b| b.value),
            kind,
        })
    }
}

fn http_check(i: usize, h: &corepb::health_check::HttpHealthCheck) -> Result<HttpCheck, String> {
    let f = |field: &str| at(i, &format!("http_health_check.{field}"));
    if h.path.is_empty() {
        return Err(format!(
            "{}: value length must be at least 1 characters",
            f("path")
        ));
    }
    if http::HeaderValue::from_str(&h.path).is_err() {
        return Err(format!(
            "{}: value does not match regex pattern for HTTP header values",
            f("path")
        ));
    }
    if !h.host.is_empty() && http::HeaderValue::from_str(&h.host).is_err() {
        return Err(format!(
            "{}: value does not match regex pattern for HTTP header values",
            f("host")
        ));
    }
    if h.send.is_some() || !h.receive.is_empty() {
        return Err(format!(
            "{}: send/receive payloads are not supported yet",
            f("send")
        ));
    }
    if h.service_name_matcher.is_some() {
        return Err(format!(
            "{} is not supported yet",
            f("service_name_matcher")
        ));
    }
    let method = {
        use corepb::RequestMethod as M;
        match M::try_from(h.method) {
            Ok(M::MethodUnspecified) | Ok(M::Get) => http::Method::GET,
            Ok(M::Head) => http::Method::HEAD,
            Ok(M::Post) => http::Method::POST,
            Ok(M::Put) => http::Method::PUT,
            Ok(M::Delete) => http::Method::DELETE,
            Ok(M::Options) => http::Method::OPTIONS,
            Ok(M::Trace) => http::Method::TRACE,
            Ok(M::Patch) => http::Method::PATCH,
            Ok(M::Connect) | Err(_) => {
                return Err(format!(
                    "{}: value must not be in list [CONNECT] and must be one of the defined enum values",
                    f("method")
                ))
            }
        }
    };
    use envoy_types::pb::envoy::r#type::v3::CodecClientType as C;
    let http2 = match C::try_from(h.codec_client_type) {
        Ok(C::Http1) => false,
        Ok(C::Http2) => true,
        Ok(C::Http3) => {
            return Err(format!(
                "{}: HTTP3 is not supported yet",
                f("codec_client_type")
            ))
        }
        Err(_) => {
            return Err(format!(
                "{}: value must be one of the defined enum values",
                f("codec_client_type")
            ))
        }
    };
    if h.request_headers_to_add.len() > 1000 {
        return Err(format!(
            "{}: value must contain no more than 1000 item(s)",
            f("request_headers_to_add")
        ));
    }
    let ops = HeaderOps::translate(
        "request",
        &h.request_headers_to_add,
        &h.request_headers_to_remove,
    )
    .map_err(|e| format!("{}: {e}", at(i, "http_health_check")))?;
    let mut expected = ranges(&h.expected_statuses, "expected")
        .map_err(|e| format!("{}: {e}", f("expected_statuses")))?;
    if expected.is_empty() {
        expected.push((200, 201));
    }
    Ok(HttpCheck {
        host: h.host.clone(),
        path: h.path.clone(),
        method,
        expected,
        retriable: ranges(&h.retriable_statuses, "retriable")
            .map_err(|e| format!("{}: {e}", f("retriable_statuses")))?,
        http2,
        headers: CheckHeaders {
            ops: Arc::new(ops),
            source: (
                h.request_headers_to_add.clone(),
                h.request_headers_to_remove.clone(),
            ),
        },
    })
}

// ---------------------------------------------------------------------------------------------
// Per-endpoint health check settings (`LbEndpoint.endpoint.health_check_config`)

/// Where and how one endpoint is checked, when its `health_check_config` says more than the
/// defaults.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EndpointCheck {
    /// `port_value` / `address`: the checked address instead of the endpoint's.
    pub target: Option<SocketAddr>,
    /// `hostname`: the check's `:authority` (before the cluster name).
    pub hostname: Option<String>,
    /// `disable_active_health_check`: the host is never checked and counts as passing.
    pub disabled: bool,
}

impl EndpointCheck {
    /// The endpoint's settings, or None when it has none worth keeping.
    pub fn translate(
        addr: SocketAddr,
        c: Option<&epb::endpoint::HealthCheckConfig>,
    ) -> Result<Option<EndpointCheck>, String> {
        let Some(c) = c else { return Ok(None) };
        let mut target = None;
        if let Some(a) = &c.address {
            let (host, port) = super::socket_address(Some(a))
                .map_err(|e| format!("health_check_config.address: {e}"))?;
            let ip: std::net::IpAddr = host.parse().map_err(|_| {
                format!("health_check_config.address: malformed IP address: {host}")
            })?;
            target = Some(SocketAddr::new(ip, port));
        }
        if c.port_value > 65535 {
            return Err(format!(
                "health_check_config.port_value: value must be less than or equal to 65535, got {}",
                c.port_value
            ));
        }
        if c.port_value != 0 {
            let base = target.unwrap_or(addr);
            target = Some(SocketAddr::new(base.ip(), c.port_value as u16));
        }
        let e = EndpointCheck {
            target,
            hostname: (!c.hostname.is_empty()).then(|| c.hostname.clone()),
            disabled: c.disable_active_health_check,
        };
        Ok((e != EndpointCheck::default()).then_some(e))
    }
}

/// The `health_check_config` of every EDS endpoint that has one, by endpoint address.
pub fn endpoint_checks(
    la: &epb::ClusterLoadAssignment,
) -> Result<HashMap<SocketAddr, EndpointCheck>, String> {
    let mut out = HashMap::new();
    for (li, loc) in la.endpoints.iter().enumerate() {
        for (ei, lb) in loc.lb_endpoints.iter().enumerate() {
            let Some(epb::lb_endpoint::HostIdentifier::Endpoint(ep)) = &lb.host_identifier else {
                continue;
            };
            if ep.health_check_config.is_none() {
                continue;
            }
            // The endpoint's own address was checked by the caller; an unparsable one is
            // rejected there first.
            let Ok((host, port)) = super::socket_address(ep.address.as_ref()) else {
                continue;
            };
            let Ok(ip) = host.parse::<std::net::IpAddr>() else {
                continue;
            };
            let addr = SocketAddr::new(ip, port);
            if let Some(c) = EndpointCheck::translate(addr, ep.health_check_config.as_ref())
                .map_err(|e| format!("endpoints[{li}].lb_endpoints[{ei}].endpoint.{e}"))?
            {
                out.insert(addr, c);
            }
        }
    }
    Ok(out)
}

/// STATIC and DNS clusters: per-endpoint health check settings are not applied yet, so they
/// are refused rather than ignored.
pub fn inline_checks_unsupported(la: &epb::ClusterLoadAssignment) -> Result<(), String> {
    for (li, loc) in la.endpoints.iter().enumerate() {
        for (ei, lb) in loc.lb_endpoints.iter().enumerate() {
            if let Some(epb::lb_endpoint::HostIdentifier::Endpoint(ep)) = &lb.host_identifier {
                if ep
                    .health_check_config
                    .as_ref()
                    .is_some_and(|c| *c != Default::default())
                {
                    return Err(format!("load_assignment: endpoints[{li}].lb_endpoints[{ei}].endpoint.health_check_config is not supported yet outside EDS"));
                }
            }
        }
    }
    Ok(())
}

/// The hosts as the balancers see them once active checks have had their say.
pub fn apply(hosts: &[super::cluster::Host], hc: &[Option<HcFlags>]) -> Vec<super::cluster::Host> {
    hosts
        .iter()
        .zip(hc)
        .map(|(h, f)| {
            let mut h = h.clone();
            h.health = effective(h.health, f.as_ref());
            h
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The state machine

/// What one check (or a passive report) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Pass {
        degraded: bool,
    },
    /// An answer outside the expected statuses; `retriable` when in `retriable_statuses`.
    /// `immediate` when it carried `x-envoy-immediate-health-check-fail`.
    Active {
        retriable: bool,
        immediate: bool,
    },
    /// Connect failure, reset, GOAWAY.
    Network,
    Timeout,
    /// `x-envoy-immediate-health-check-fail` on a proxied response.
    Passive,
}

/// One host's checker state (Envoy's `ActiveHealthCheckSession`).
#[derive(Debug, Clone)]
pub struct Machine {
    pub flags: HcFlags,
    first_check: bool,
    num_healthy: u32,
    num_unhealthy: u32,
}

impl Default for Machine {
    fn default() -> Self {
        Machine {
            flags: HcFlags::NEW,
            first_check: true,
            num_healthy: 0,
            num_unhealthy: 0,
        }
    }
}

impl Machine {
    /// Applies one result; the transition decides the next interval and whether the cluster's
    /// load buckets need rebuilding (`Changed`).
    pub fn apply(&mut self, outcome: Outcome, cfg: &HealthCheckConfig) -> Transition {
        let t = match outcome {
            Outcome::Pass { degraded } => self.pass(degraded, cfg),
            other => self.fail(other, cfg),
        };
        self.first_check = false;
        t
    }

    fn pass(&mut self, degraded: bool, cfg: &HealthCheckConfig) -> Transition {
        self.num_unhealthy = 0;
        let mut t = Transition::Unchanged;
        if self.flags.failed {
            // The first result ever makes a host healthy at once (faster start-up), later
            // recoveries need the threshold.
            self.num_healthy += 1;
            if self.first_check || self.num_healthy >= cfg.healthy_threshold {
                self.flags.failed = false;
                self.flags.timeout = false;
                self.flags.immediate = false;
                t = Transition::Changed;
            } else {
                t = Transition::ChangePending;
            }
        }
        if degraded != self.flags.degraded {
            self.flags.degraded = degraded;
            if t == Transition::Unchanged {
                t = Transition::Changed;
            }
        }
        t
    }

    fn fail(&mut self, outcome: Outcome, cfg: &HealthCheckConfig) -> Transition {
        self.num_healthy = 0;
        let counted = matches!(
            outcome,
            Outcome::Network
                | Outcome::Timeout
                | Outcome::Active {
                    retriable: true,
                    ..
                }
        );
        if let Outcome::Active {
            immediate: true, ..
        }
        | Outcome::Passive = outcome
        {
            self.flags.immediate = true;
        }
        let mut t = Transition::Unchanged;
        if !self.flags.failed {
            self.num_unhealthy += 1;
            if !counted || self.num_unhealthy >= cfg.unhealthy_threshold {
                self.flags.failed = true;
                t = Transition::Changed;
            } else {
                t = Transition::ChangePending;
            }
        }
        // A failed host toggles between timeout and failure as its failures do.
        self.flags.timeout = outcome == Outcome::Timeout && self.flags.failed;
        t
    }
}

/// Envoy's `HealthCheckerImplBase::interval`: which interval follows a result. `healthy` is
/// whether the result passed; `traffic` whether the cluster has ever sent a request (Envoy:
/// whether `upstream_cx_total` was ever used).
pub fn next_interval(
    cfg: &HealthCheckConfig,
    healthy: bool,
    t: Transition,
    traffic: bool,
    random: impl FnMut() -> u64,
) -> Duration {
    let pending = t == Transition::ChangePending;
    let base = match (traffic, healthy) {
        (true, false) if pending => cfg.unhealthy_edge_interval,
        (true, false) => cfg.unhealthy_interval,
        (true, true) if pending => cfg.healthy_edge_interval,
        (true, true) => cfg.interval,
        (false, true) if !pending => cfg.no_traffic_healthy_interval,
        (false, _) => cfg.no_traffic_interval,
    };
    with_jitter(cfg, base, cfg.interval_jitter, random)
}

/// The delay before a host's first check: `initial_jitter` randomised, or none.
pub fn initial_delay(cfg: &HealthCheckConfig, random: impl FnMut() -> u64) -> Duration {
    if cfg.initial_jitter.is_zero() {
        return Duration::ZERO;
    }
    with_jitter(cfg, Duration::ZERO, cfg.initial_jitter, random)
}

fn with_jitter(
    cfg: &HealthCheckConfig,
    base: Duration,
    jitter: Duration,
    mut random: impl FnMut() -> u64,
) -> Duration {
    let mut ms = base.as_millis() as u64;
    let percent = u64::from(cfg.interval_jitter_percent) * ms / 100;
    if percent > 0 {
        ms += random() % percent;
    }
    let jitter = jitter.as_millis() as u64;
    if jitter > 0 {
        ms += random() % jitter;
    }
    // Never zero, so a check cannot spin.
    Duration::from_millis(ms.max(1))
}

/// A host's health as the load balancer sees it: EDS unhealthy (draining, timeout) wins, then
/// a failed active check; degraded from either source.
pub fn effective(eds: Health, hc: Option<&HcFlags>) -> Health {
    match (eds, hc) {
        (Health::Unhealthy, _) => Health::Unhealthy,
        (_, Some(f)) if f.failed => Health::Unhealthy,
        (Health::Degraded, _) => Health::Degraded,
        (_, Some(f)) if f.degraded => Health::Degraded,
        _ => Health::Healthy,
    }
}

/// Envoy's `/clusters` `health_flags`, in Envoy's flag order.
pub fn flags_text(eds: Health, hc: Option<&HcFlags>) -> String {
    let mut s = String::new();
    let f = hc.copied().unwrap_or_default();
    if f.failed {
        s.push_str("/failed_active_hc");
    }
    if eds == Health::Unhealthy {
        s.push_str("/failed_eds_health");
    }
    if f.degraded {
        s.push_str("/degraded_active_hc");
    }
    if eds == Health::Degraded {
        s.push_str("/degraded_eds_health");
    }
    if f.immediate {
        s.push_str("/excluded_via_immediate_hc_fail");
    }
    if f.timeout {
        s.push_str("/active_hc_timeout");
    }
    if s.is_empty() {
        s.push_str("healthy");
    }
    s
}

impl LoadAssignment {
    /// The endpoint's own health check settings, if it has any.
    pub fn check(&self, addr: &SocketAddr) -> Option<&EndpointCheck> {
        self.checks.get(addr)
    }
}

#[cfg(test)]
#[path = "health_check_tests.rs"]
mod health_check_tests;
