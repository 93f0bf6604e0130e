//! `envoy.filters.http.fault` (HTTPFault): delays and aborts, from the listener's filter chain
//! or a route's `typed_per_filter_config` override, translated once into plain data; the
//! per-request decision (delay, then abort) and Envoy's `http.<stat_prefix>.fault.*` stats.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::config::route::v3 as rpb;
use envoy_types::pb::envoy::extensions::filters::common::fault::v3 as cfpb;
use envoy_types::pb::envoy::extensions::filters::http::fault::v3 as fpb;
use envoy_types::pb::envoy::r#type::v3 as tpb;
use envoy_types::pb::google::protobuf::Any;
use http::HeaderMap;
use prost::Message;

use super::{Decision, FilterDecl, FilterState, LocalReply, Request, Translated};
use crate::matcher::HeaderMatcher;
use crate::matcher::RequestView;

pub const FAULT_TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault";
pub const FILTER_CONFIG_TYPE: &str = "type.googleapis.com/envoy.config.route.v3.FilterConfig";

/// Envoy's request headers for header-controlled faults.
pub const HDR_ABORT: &str = "x-envoy-fault-abort-request";
pub const HDR_ABORT_GRPC: &str = "x-envoy-fault-abort-grpc-request";
pub const HDR_ABORT_PERCENT: &str = "x-envoy-fault-abort-request-percentage";
pub const HDR_DELAY: &str = "x-envoy-fault-delay-request";
pub const HDR_DELAY_PERCENT: &str = "x-envoy-fault-delay-request-percentage";
const HDR_DOWNSTREAM_NODE: &str = "x-envoy-downstream-service-node";

/// The body Envoy's fault filter sends with an abort.
pub const ABORT_BODY: &str = "fault filter abort";

/// `FractionalPercent`: enabled when `random % denominator < numerator`, as Envoy's
/// `ProtobufPercentHelper::evaluateFractionalPercent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Percent {
    pub numerator: u32,
    pub denominator: u32,
}

impl Percent {
    pub fn hit(self, random: u64) -> bool {
        random % u64::from(self.denominator) < u64::from(self.numerator)
    }

    /// `x-envoy-fault-*-percentage`: the header's numerator, capped at the configured one, over
    /// the configured denominator; an unparsable header leaves the configured percentage.
    fn capped_by_header(self, headers: &HeaderMap, name: &str) -> Percent {
        let n = headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u32>().ok());
        match n {
            Some(n) => Percent {
                numerator: n.min(self.numerator),
                denominator: self.denominator,
            },
            None => self,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DelayKind {
    Fixed(Duration),
    /// `header_delay`: milliseconds from `x-envoy-fault-delay-request`.
    Header,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delay {
    pub kind: DelayKind,
    pub percent: Percent,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbortKind {
    Http(u16),
    /// Answered as HTTP 200 with this grpc-status.
    Grpc(u32),
    /// `header_abort`: status from `x-envoy-fault-abort-request` (or `-grpc-request`).
    Header,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abort {
    pub kind: AbortKind,
    pub percent: Percent,
    pub body: Bytes,
}

/// An abort decision: HTTP status and, for gRPC aborts, the grpc-status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbortWith {
    pub status: u16,
    pub grpc_status: Option<u32>,
    pub body: Bytes,
}

#[derive(Debug, Default)]
pub struct Fault {
    pub delay: Option<Delay>,
    pub abort: Option<Abort>,
    pub upstream_cluster: Option<String>,
    pub headers: Vec<HeaderMatcher>,
    pub downstream_nodes: Vec<String>,
    pub max_active_faults: Option<u64>,
}

/// A level's word on one filter (by filter name), as Envoy's `PerFilterConfigs`: whether it
/// is enabled or disabled there, and its own config. Each field resolves on its own, most
/// specific level first (an entry that only enables the filter keeps a vhost's config).
#[derive(Debug, Clone, Default)]
pub struct PerRoute {
    /// `Some(false)`: explicitly enabled (any config entry does that); `Some(true)`:
    /// `FilterConfig { disabled: true }`.
    pub disabled: Option<bool>,
    pub config: Option<Arc<Fault>>,
}

impl PerRoute {
    fn config(f: Fault) -> PerRoute {
        PerRoute {
            disabled: Some(false),
            config: Some(Arc::new(f)),
        }
    }
}

impl Fault {
    pub fn translate(f: &fpb::HttpFault) -> Result<Fault, String> {
        let delay = f
            .delay
            .as_ref()
            .map(|d| delay(d).map_err(|e| format!("delay: {e}")))
            .transpose()?;
        let abort = f
            .abort
            .as_ref()
            .map(|a| abort(a).map_err(|e| format!("abort: {e}")))
            .transpose()?;
        if f.response_rate_limit.is_some() {
            return Err("response_rate_limit is not supported".into());
        }
        let headers = f
            .headers
            .iter()
            .enumerate()
            .map(|(i, h)| {
                crate::matcher::header_matcher(h)
                    .map_err(|e| format!("headers[{i}] '{}': {e}", h.name))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // The *_runtime keys name runtime overrides; with no runtime layer the configured
        // values are what Envoy uses too.
        Ok(Fault {
            delay,
            abort,
            upstream_cluster: (!f.upstream_cluster.is_empty()).then(|| f.upstream_cluster.clone()),
            headers,
            downstream_nodes: f.downstream_nodes.clone(),
            max_active_faults: f.max_active_faults.as_ref().map(|v| u64::from(v.value)),
        })
    }

    /// Decodes an HTTPFault `Any`.
    pub fn from_any(a: &Any) -> Result<Fault, String> {
        if a.type_url != FAULT_TYPE {
            return Err(format!("expected {FAULT_TYPE}, got {}", a.type_url));
        }
        let f = fpb::HttpFault::decode(a.value.as_slice())
            .map_err(|e| format!("cannot decode HTTPFault: {e}"))?;
        Fault::translate(&f)
    }

    /// Whether the fault applies to this request at all: header matchers, the upstream
    /// cluster the route picked, and the downstream node.
    pub fn applies(&self, req: &RequestView<'_>, cluster: Option<&str>) -> bool {
        if !self
            .headers
            .iter()
            .all(|h| crate::matcher::header_matches(h, req))
        {
            return false;
        }
        if let Some(want) = &self.upstream_cluster {
            if cluster != Some(want.as_str()) {
                return false;
            }
        }
        if !self.downstream_nodes.is_empty() {
            let node = req
                .headers
                .get(HDR_DOWNSTREAM_NODE)
                .and_then(|v| v.to_str().ok());
            if !node.is_some_and(|n| self.downstream_nodes.iter().any(|d| d == n)) {
                return false;
            }
        }
        true
    }

    /// The delay to inject, if any; `random` is drawn only when a percentage is evaluated.
    pub fn delay_for(&self, headers: &HeaderMap, random: impl FnOnce() -> u64) -> Option<Duration> {
        let d = self.delay.as_ref()?;
        let (duration, percent) = match &d.kind {
            DelayKind::Fixed(t) => (*t, d.percent),
            DelayKind::Header => {
                let ms = headers
                    .get(HDR_DELAY)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok())?;
                (
                    Duration::from_millis(ms),
                    d.percent.capped_by_header(headers, HDR_DELAY_PERCENT),
                )
            }
        };
        percent.hit(random()).then_some(duration)
    }

    /// The abort to inject, if any.
    pub fn abort_for(
        &self,
        headers: &HeaderMap,
        random: impl FnOnce() -> u64,
    ) -> Option<AbortWith> {
        let a = self.abort.as_ref()?;
        let percent = match a.kind {
            AbortKind::Header => a.percent.capped_by_header(headers, HDR_ABORT_PERCENT),
            _ => a.percent,
        };
        if !percent.hit(random()) {
            return None;
        }
        let num = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok())
        };
        let (status, grpc_status) = match a.kind {
            AbortKind::Http(s) => (s, None),
            AbortKind::Grpc(g) => (200, Some(g)),
            AbortKind::Header => match num(HDR_ABORT) {
                // An out-of-range status means no HTTP abort; Envoy then looks at the gRPC one.
                Some(s) if (200..600).contains(&s) => (s as u16, None),
                _ => match num(HDR_ABORT_GRPC).and_then(|g| u32::try_from(g).ok()) {
                    Some(g) => (200, Some(g)),
                    None => return None,
                },
            },
        };
        Some(AbortWith {
            status,
            grpc_status,
            body: a.body.clone(),
        })
    }
}

fn percent(p: Option<&tpb::FractionalPercent>) -> Result<Percent, String> {
    use tpb::fractional_percent::DenominatorType as D;
    // No percentage: the proto default, 0 of 100, so the fault never fires (as in Envoy).
    let Some(p) = p else {
        return Ok(Percent {
            numerator: 0,
            denominator: 100,
        });
    };
    let denominator = match D::try_from(p.denominator) {
        Ok(D::Hundred) => 100,
        Ok(D::TenThousand) => 10_000,
        Ok(D::Million) => 1_000_000,
        Err(_) => {
            return Err(format!(
                "percentage.denominator: {} is not a defined value",
                p.denominator
            ))
        }
    };
    Ok(Percent {
        numerator: p.numerator,
        denominator,
    })
}

fn delay(d: &cfpb::FaultDelay) -> Result<Delay, String> {
    use cfpb::fault_delay::FaultDelaySecifier as S;
    let kind = match &d.fault_delay_secifier {
        Some(S::FixedDelay(t)) => {
            let t = crate::units::duration(t).map_err(|e| format!("fixed_delay: {e}"))?;
            if t.is_zero() {
                return Err("fixed_delay: value must be greater than 0s".into());
            }
            DelayKind::Fixed(t)
        }
        Some(S::HeaderDelay(_)) => DelayKind::Header,
        None => return Err("one of fixed_delay or header_delay is required".into()),
    };
    Ok(Delay {
        kind,
        percent: percent(d.percentage.as_ref())?,
    })
}

fn abort(a: &fpb::FaultAbort) -> Result<Abort, String> {
    use fpb::fault_abort::ErrorType as E;
    let kind = match a.error_type {
        Some(E::HttpStatus(s)) if (200..600).contains(&s) => AbortKind::Http(s as u16),
        Some(E::HttpStatus(s)) => {
            return Err(format!(
                "http_status: value {s} must be inside range [200, 600)"
            ))
        }
        Some(E::GrpcStatus(g)) => AbortKind::Grpc(g),
        Some(E::HeaderAbort(_)) => AbortKind::Header,
        None => return Err("one of http_status, grpc_status or header_abort is required".into()),
    };
    Ok(Abort {
        kind,
        percent: percent(a.percentage.as_ref())?,
        body: if a.response_body.is_empty() {
            Bytes::from_static(ABORT_BODY.as_bytes())
        } else {
            Bytes::from(a.response_body.clone())
        },
    })
}

/// The fault-relevant entries of a `typed_per_filter_config` map: HTTPFault configs, and
/// `FilterConfig` wrappers (which enable or disable any filter by name). Other filters'
/// configs are left alone, as before.
pub fn per_route(
    map: &std::collections::HashMap<String, Any>,
) -> Result<Vec<(String, PerRoute)>, String> {
    let mut out = Vec::new();
    for (name, a) in map {
        let ctx = |e: String| format!("typed_per_filter_config['{name}']: {e}");
        match a.type_url.as_str() {
            FAULT_TYPE => out.push((
                name.clone(),
                PerRoute::config(Fault::from_any(a).map_err(ctx)?),
            )),
            FILTER_CONFIG_TYPE => {
                let fc = rpb::FilterConfig::decode(a.value.as_slice())
                    .map_err(|e| ctx(format!("cannot decode FilterConfig: {e}")))?;
                let entry = match fc.config {
                    _ if fc.disabled => PerRoute {
                        disabled: Some(true),
                        config: None,
                    },
                    // Envoy's wording.
                    None => {
                        return Err(format!(
                            "Empty route/virtual host per filter configuration for {name} filter"
                        ))
                    }
                    // An empty config only enables the filter.
                    Some(inner) if inner.type_url.is_empty() => PerRoute {
                        disabled: Some(false),
                        config: None,
                    },
                    Some(inner) if inner.type_url == FAULT_TYPE => {
                        PerRoute::config(Fault::from_any(&inner).map_err(ctx)?)
                    }
                    // Another filter's config: it enables that filter, which is not a fault
                    // filter, so nothing here reads it.
                    Some(_) => PerRoute {
                        disabled: Some(false),
                        config: None,
                    },
                };
                out.push((name.clone(), entry));
            }
            _ => {}
        }
    }
    // HashMap order is arbitrary; sort so snapshots compare and debug-print stably.
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Per-filter entries layered least to most specific: for each filter name, the most
/// specific level that says anything about `disabled`, and separately about `config`, wins
/// (Envoy's `filterDisabled` and `mostSpecificPerFilterConfig`).
pub fn layer(levels: &[&[(String, PerRoute)]]) -> Vec<(String, PerRoute)> {
    let mut out: Vec<(String, PerRoute)> = Vec::new();
    for level in levels {
        for (name, v) in level.iter() {
            let i = match out.iter().position(|(n, _)| n == name) {
                Some(i) => i,
                None => {
                    out.push((name.clone(), PerRoute::default()));
                    out.len() - 1
                }
            };
            let slot = &mut out[i].1;
            if v.disabled.is_some() {
                slot.disabled = v.disabled;
            }
            if v.config.is_some() {
                slot.config = v.config.clone();
            }
        }
    }
    out
}

/// A fault filter of the chain: its name (how routes address it) and its listener-level
/// config, which a route's `typed_per_filter_config` entry of the same name replaces.
#[derive(Debug)]
pub struct FaultFilter {
    pub name: String,
    pub config: Arc<Fault>,
    /// `disabled: true` in the chain: off unless a route's per-filter config enables it.
    pub disabled: bool,
}

/// The registry's translate function for `http_filters` entries of this type.
pub fn translate_filter(d: &FilterDecl<'_>) -> Result<Translated, String> {
    // A TypedStruct carries the config as JSON, which Portico does not map.
    if d.config.type_url != FAULT_TYPE {
        return Err("a fault config wrapped in a TypedStruct is not supported".into());
    }
    Ok(Translated::Run(super::HttpFilter::Fault(FaultFilter {
        name: d.name.to_string(),
        config: Arc::new(Fault::from_any(d.config)?),
        disabled: d.disabled,
    })))
}

/// Envoy's `http.<stat_prefix>.fault.*` stats, shown once a listener with this prefix has a
/// fault filter (Envoy creates them with the filter).
#[derive(Debug, Default)]
pub struct FaultStats {
    pub enabled: AtomicBool,
    pub delays_injected: AtomicU64,
    pub aborts_injected: AtomicU64,
    pub faults_overflow: AtomicU64,
    pub active_faults: AtomicU64,
}

impl FaultStats {
    /// Envoy's `tryIncActiveFaults`: counts one active fault unless `max` are already active
    /// (then `faults_overflow` counts the refusal).
    pub fn try_activate(&self, max: Option<u64>) -> bool {
        let max = max.unwrap_or(u64::MAX);
        let mut cur = self.active_faults.load(Relaxed);
        loop {
            if cur >= max {
                self.faults_overflow.fetch_add(1, Relaxed);
                return false;
            }
            match self
                .active_faults
                .compare_exchange_weak(cur, cur + 1, Relaxed, Relaxed)
            {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
    }
}

impl FaultFilter {
    /// The config in force for this request, or None when the filter is off for it. Most
    /// specific first: the weighted-cluster entry, then the route's layers; the enabled flag
    /// and the config resolve separately, as in Envoy.
    fn effective<'a>(&'a self, req: &Request<'a>) -> Option<&'a Fault> {
        let entry = req
            .picked
            .and_then(|(_, e)| e)
            .and_then(|e| e.fault_override(&self.name));
        let routed = req.route.and_then(|r| r.fault_override(&self.name));
        let disabled = entry
            .and_then(|p| p.disabled)
            .or_else(|| routed.and_then(|p| p.disabled))
            .unwrap_or(self.disabled);
        if disabled {
            return None;
        }
        let cfg = entry
            .and_then(|p| p.config.as_ref())
            .or_else(|| routed.and_then(|p| p.config.as_ref()))
            .unwrap_or(&self.config);
        cfg.applies(req.view, req.picked.map(|(c, _)| c))
            .then_some(&**cfg)
    }

    /// Envoy's decodeHeaders: a delay first (the request then waits and comes back through
    /// [`FaultFilter::after_delay`]), else straight to the abort check.
    pub fn decode(&self, req: &Request<'_>, st: &mut FilterState, stats: &FaultStats) -> Decision {
        if !stats.enabled.load(Relaxed) {
            stats.enabled.store(true, Relaxed);
        }
        let Some(cfg) = self.effective(req) else {
            return Decision::Continue;
        };
        st.fault_delayed = false;
        if let Some(d) = cfg.delay_for(req.view.headers, || fastrand::u64(..)) {
            // One active fault per filter, however many it injects (Envoy's fault_active_).
            if stats.try_activate(cfg.max_active_faults) {
                st.fault_delayed = true;
                st.active_faults += 1;
                stats.delays_injected.fetch_add(1, Relaxed);
                return Decision::Delay(d);
            }
        }
        self.abort(cfg, req, st, stats)
    }

    /// Envoy's postDelayInjection: the abort check, after the delay.
    pub fn after_delay(
        &self,
        req: &Request<'_>,
        st: &mut FilterState,
        stats: &FaultStats,
    ) -> Decision {
        match self.effective(req) {
            Some(cfg) => self.abort(cfg, req, st, stats),
            None => Decision::Continue,
        }
    }

    fn abort(
        &self,
        cfg: &Fault,
        req: &Request<'_>,
        st: &mut FilterState,
        stats: &FaultStats,
    ) -> Decision {
        let active = std::mem::take(&mut st.fault_delayed);
        let Some(a) = cfg.abort_for(req.view.headers, || fastrand::u64(..)) else {
            return Decision::Continue;
        };
        if !active {
            if !stats.try_activate(cfg.max_active_faults) {
                return Decision::Continue;
            }
            st.active_faults += 1;
        }
        stats.aborts_injected.fetch_add(1, Relaxed);
        Decision::Reply(LocalReply {
            status: a.status,
            body: Some(a.body),
            headers: Vec::new(),
            grpc_status: a.grpc_status,
            details: std::borrow::Cow::Borrowed("fault_filter_abort"),
        })
    }
}

/// HTTP status to gRPC status for a local reply to a gRPC request (Envoy's
/// `Grpc::Utility::httpToGrpcStatus`).
pub fn http_to_grpc_status(status: u16) -> u32 {
    match status {
        400 => 13,
        401 => 16,
        403 => 7,
        404 => 12,
        429 | 502 | 503 | 504 => 14,
        _ => 2,
    }
}

#[cfg(test)]
#[path = "fault_tests.rs"]
mod fault_tests;
