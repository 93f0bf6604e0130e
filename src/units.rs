//! Conversions of protobuf value types every layer shares (durations, runtime fractions), so
//! that the filters and balancers need not reach into the snapshot for them.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3 as corepb;

/// A runtime fraction's default value in millionths (capped at the whole), or `absent` when
/// it has none: each policy has its own default (mirrors and CORS: all; rate limits: none).
pub fn per_million(
    f: Option<&corepb::RuntimeFractionalPercent>,
    absent: u32,
) -> Result<u32, String> {
    use envoy_types::pb::envoy::r#type::v3::fractional_percent::DenominatorType as D;
    let Some(v) = f.and_then(|f| f.default_value.as_ref()) else {
        return Ok(absent);
    };
    let scale = match D::try_from(v.denominator) {
        Ok(D::Hundred) => 10_000,
        Ok(D::TenThousand) => 100,
        Ok(D::Million) => 1,
        Err(_) => return Err(format!("unknown denominator {}", v.denominator)),
    };
    Ok(v.numerator.saturating_mul(scale).min(1_000_000))
}

pub fn duration(d: &envoy_types::pb::google::protobuf::Duration) -> Result<Duration, String> {
    if d.seconds < 0 || d.nanos < 0 || d.nanos >= 1_000_000_000 {
        return Err(format!("invalid duration {}s {}ns", d.seconds, d.nanos));
    }
    Ok(Duration::new(d.seconds as u64, d.nanos as u32))
}

/// gRPC's status codes by number, as their proto enum names them (`NOT_FOUND`): what access
/// logs print and what Istio's retry and fault configs name.
pub const GRPC_STATUS_NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];
