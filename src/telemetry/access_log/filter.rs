//! `envoy.config.accesslog.v3.AccessLogFilter`: which requests a logger writes.

use envoy_types::pb::envoy::config::accesslog::v3 as apb;

use super::LogContext;
use crate::matcher::{header_matcher, header_matches, HeaderMatcher, RequestView};
use crate::telemetry::stream_info::{ResponseFlag, ResponseFlags};

/// `ComparisonFilter.Op`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    Eq,
    Ge,
    Le,
    Ne,
}

/// A comparison against the runtime value's default (Portico has no runtime: the
/// `runtime_key` is never overridden).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cmp {
    pub op: CmpOp,
    pub value: u64,
}

impl Cmp {
    fn holds(self, v: u64) -> bool {
        match self.op {
            CmpOp::Eq => v == self.value,
            CmpOp::Ge => v >= self.value,
            CmpOp::Le => v <= self.value,
            CmpOp::Ne => v != self.value,
        }
    }
}

#[derive(Debug)]
pub enum Filter {
    Status(Cmp),
    /// On the request's duration in milliseconds.
    Duration(Cmp),
    /// Portico serves no health checks of its own (no `health_check` HTTP filter): every
    /// request passes.
    NotHealthCheck,
    /// Whether the request is traced. Portico's request record carries no tracing decision
    /// yet, so no request is (Envoy's answer when the connection manager has no `tracing`).
    Traceable,
    /// `runtime_filter`: `percent_sampled` (the runtime key is never overridden). The draw is
    /// Envoy's: the first 8 hex digits of the request's UUID `x-request-id` (so every logger
    /// samples the same requests), unless `use_independent_randomness` or no such id: random.
    Runtime {
        numerator: u64,
        denominator: u64,
        independent: bool,
    },
    And(Vec<Filter>),
    Or(Vec<Filter>),
    Header(HeaderMatcher),
    /// `response_flag_filter`: any of these flags; an empty list: any flag at all.
    Flags(Option<ResponseFlags>),
    Grpc {
        statuses: Vec<u32>,
        exclude: bool,
    },
    /// `log_type_filter` on Envoy's `AccessLogType` numbers.
    LogType {
        types: Vec<i32>,
        exclude: bool,
    },
    /// Accepted without effect (`metadata_filter`, `extension_filter` such as Istio's CEL
    /// filter): the logger writes as if the filter were not there. A telemetry choice: a
    /// line too many rather than a listener refused.
    Pass,
}

fn cmp(c: Option<&apb::ComparisonFilter>, at: &str) -> Result<Cmp, String> {
    let Some(c) = c else {
        return Err(format!("{at}.comparison is required"));
    };
    let op = match apb::comparison_filter::Op::try_from(c.op) {
        Ok(apb::comparison_filter::Op::Eq) => CmpOp::Eq,
        Ok(apb::comparison_filter::Op::Ge) => CmpOp::Ge,
        Ok(apb::comparison_filter::Op::Le) => CmpOp::Le,
        Ok(apb::comparison_filter::Op::Ne) => CmpOp::Ne,
        Err(_) => return Err(format!("{at}.comparison.op: unknown value {}", c.op)),
    };
    let Some(v) = &c.value else {
        return Err(format!("{at}.comparison.value is required"));
    };
    if v.runtime_key.is_empty() {
        return Err(format!(
            "{at}.comparison.value.runtime_key must not be empty"
        ));
    }
    Ok(Cmp {
        op,
        value: u64::from(v.default_value),
    })
}

impl Filter {
    pub fn translate(f: &apb::AccessLogFilter, at: &str) -> Result<Filter, String> {
        use apb::access_log_filter::FilterSpecifier as F;
        Ok(match &f.filter_specifier {
            None => return Err(format!("{at}: no filter set")),
            Some(F::StatusCodeFilter(s)) => Filter::Status(cmp(
                s.comparison.as_ref(),
                &format!("{at}.status_code_filter"),
            )?),
            Some(F::DurationFilter(d)) => Filter::Duration(cmp(
                d.comparison.as_ref(),
                &format!("{at}.duration_filter"),
            )?),
            Some(F::NotHealthCheckFilter(_)) => Filter::NotHealthCheck,
            Some(F::TraceableFilter(_)) => Filter::Traceable,
            Some(F::RuntimeFilter(r)) => {
                if r.runtime_key.is_empty() {
                    return Err(format!("{at}.runtime_filter.runtime_key must not be empty"));
                }
                // Envoy's default when percent_sampled is unset: 0% (of a hundred).
                let (numerator, denominator) = match &r.percent_sampled {
                    Some(p) => (
                        u64::from(p.numerator),
                        match p.denominator {
                            1 => 10_000,
                            2 => 1_000_000,
                            _ => 100,
                        },
                    ),
                    None => (0, 100),
                };
                Filter::Runtime {
                    numerator,
                    denominator,
                    independent: r.use_independent_randomness,
                }
            }
            Some(F::AndFilter(a)) => Filter::And(list(&a.filters, &format!("{at}.and_filter"))?),
            Some(F::OrFilter(o)) => Filter::Or(list(&o.filters, &format!("{at}.or_filter"))?),
            Some(F::HeaderFilter(h)) => {
                let Some(m) = &h.header else {
                    return Err(format!("{at}.header_filter.header is required"));
                };
                Filter::Header(
                    header_matcher(m).map_err(|e| format!("{at}.header_filter.header: {e}"))?,
                )
            }
            Some(F::ResponseFlagFilter(r)) => {
                if r.flags.is_empty() {
                    Filter::Flags(None)
                } else {
                    let mut set = ResponseFlags::default();
                    for f in &r.flags {
                        let Some(flag) = ResponseFlag::from_short(f) else {
                            return Err(format!(
                                "{at}.response_flag_filter.flags: unknown response flag '{f}'"
                            ));
                        };
                        set.set(flag);
                    }
                    Filter::Flags(Some(set))
                }
            }
            Some(F::GrpcStatusFilter(g)) => Filter::Grpc {
                statuses: g.statuses.iter().map(|s| *s as u32).collect(),
                exclude: g.exclude,
            },
            Some(F::LogTypeFilter(l)) => Filter::LogType {
                types: l.types.clone(),
                exclude: l.exclude,
            },
            Some(F::MetadataFilter(_)) | Some(F::ExtensionFilter(_)) => Filter::Pass,
        })
    }

    pub fn evaluate(&self, ctx: &LogContext<'_>) -> bool {
        match self {
            Filter::Status(c) => c.holds(u64::from(ctx.info.response_code)),
            Filter::Duration(c) => c.holds(ctx.info.duration().as_millis() as u64),
            Filter::NotHealthCheck => true,
            Filter::Traceable => false,
            Filter::Runtime {
                numerator,
                denominator,
                independent,
            } => {
                let from_id = (!*independent).then(|| request_id_draw(ctx)).flatten();
                let draw = from_id.unwrap_or_else(|| fastrand::u64(..));
                draw % *denominator < *numerator
            }
            Filter::And(fs) => fs.iter().all(|f| f.evaluate(ctx)),
            Filter::Or(fs) => fs.iter().any(|f| f.evaluate(ctx)),
            Filter::Header(m) => match &ctx.request {
                Some(r) => header_matches(m, r),
                // A TCP connection: Envoy matches against an empty header map.
                None => header_matches(m, &empty_request()),
            },
            Filter::Flags(None) => !ctx.info.flags.is_empty(),
            Filter::Flags(Some(set)) => set.iter().any(|f| ctx.info.flags.has(f)),
            Filter::Grpc { statuses, exclude } => {
                // Envoy: no status at all counts as Unknown (2).
                let s = super::format::response_grpc_status(ctx).unwrap_or(2);
                statuses.contains(&s) != *exclude
            }
            Filter::LogType { types, exclude } => types.contains(&ctx.log_type) != *exclude,
            Filter::Pass => true,
        }
    }
}

/// Envoy's UUID request id extension (`modBy`): the id's first 8 characters as hex.
fn request_id_draw(ctx: &LogContext<'_>) -> Option<u64> {
    let id = ctx
        .request
        .as_ref()?
        .headers
        .get("x-request-id")?
        .to_str()
        .ok()?;
    u64::from_str_radix(id.get(..8)?, 16).ok()
}

fn empty_request() -> RequestView<'static> {
    static EMPTY: std::sync::OnceLock<http::HeaderMap> = std::sync::OnceLock::new();
    RequestView {
        host: "",
        authority: "",
        path: "",
        method: "",
        scheme: "",
        headers: EMPTY.get_or_init(http::HeaderMap::new),
    }
}

fn list(fs: &[apb::AccessLogFilter], at: &str) -> Result<Vec<Filter>, String> {
    if fs.len() < 2 {
        return Err(format!("{at}.filters: at least 2 filters are required"));
    }
    fs.iter()
        .enumerate()
        .map(|(i, f)| Filter::translate(f, &format!("{at}.filters[{i}]")))
        .collect()
}
