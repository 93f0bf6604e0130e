//! Route retry policies (`RetryPolicy` on a route or its virtual host): which outcomes Envoy's
//! router retries, how many times, per-try timeouts, back-off and host re-selection.

use std::time::Duration;

use envoy_types::pb::envoy::config::route::v3 as rpb;

/// `retry_on` conditions, as bits.
pub mod on {
    pub const FIVE_XX: u32 = 1;
    pub const GATEWAY_ERROR: u32 = 1 << 1;
    pub const CONNECT_FAILURE: u32 = 1 << 2;
    pub const RETRIABLE_4XX: u32 = 1 << 3;
    pub const REFUSED_STREAM: u32 = 1 << 4;
    pub const RETRIABLE_STATUS_CODES: u32 = 1 << 5;
    pub const RESET: u32 = 1 << 6;
    pub const RESET_BEFORE_REQUEST: u32 = 1 << 7;
    pub const GRPC_CANCELLED: u32 = 1 << 8;
    pub const GRPC_DEADLINE_EXCEEDED: u32 = 1 << 9;
    pub const GRPC_RESOURCE_EXHAUSTED: u32 = 1 << 10;
    pub const GRPC_UNAVAILABLE: u32 = 1 << 11;
    pub const GRPC_INTERNAL: u32 = 1 << 12;
    pub const ENVOY_RATELIMITED: u32 = 1 << 13;
    pub const HTTP3_POST_CONNECT_FAILURE: u32 = 1 << 14;
}

const NAMES: [(&str, u32); 15] = [
    ("5xx", on::FIVE_XX),
    ("gateway-error", on::GATEWAY_ERROR),
    ("connect-failure", on::CONNECT_FAILURE),
    ("retriable-4xx", on::RETRIABLE_4XX),
    ("refused-stream", on::REFUSED_STREAM),
    ("retriable-status-codes", on::RETRIABLE_STATUS_CODES),
    ("reset", on::RESET),
    ("reset-before-request", on::RESET_BEFORE_REQUEST),
    ("cancelled", on::GRPC_CANCELLED),
    ("deadline-exceeded", on::GRPC_DEADLINE_EXCEEDED),
    ("resource-exhausted", on::GRPC_RESOURCE_EXHAUSTED),
    ("unavailable", on::GRPC_UNAVAILABLE),
    ("internal", on::GRPC_INTERNAL),
    ("envoy-ratelimited", on::ENVOY_RATELIMITED),
    ("http3-post-connect-failure", on::HTTP3_POST_CONNECT_FAILURE),
];

const PREVIOUS_HOSTS_TYPE: &str =
    "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate";

#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    pub on: u32,
    /// Retries after the first attempt (Envoy's default: 1).
    pub num_retries: u32,
    pub per_try_timeout: Option<Duration>,
    pub statuses: Vec<u16>,
    /// `previous_hosts`: a retry avoids hosts already tried.
    pub previous_hosts: bool,
    /// `host_selection_retry_max_attempts`: how many more picks a retry may make after the
    /// first when the predicate refuses the host (Envoy tries this many plus one).
    pub host_selection_attempts: u32,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
}

/// Why an attempt failed, for the retry decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The connection could not be established (refused, timed out).
    ConnectFailure,
    /// The connection broke or the per-try timeout fired before response headers.
    Reset,
}

impl RetryPolicy {
    /// Whether a response with `status` (and a gRPC `grpc-status`, if any) is retried.
    /// Envoy never retries a response carrying `x-envoy-overloaded` or `x-envoy-ratelimited`;
    /// the caller checks those headers.
    pub fn retries_status(&self, status: u16, grpc_status: Option<u32>) -> bool {
        let on = self.on;
        if on & on::FIVE_XX != 0 && (500..600).contains(&status) {
            return true;
        }
        if on & on::GATEWAY_ERROR != 0 && matches!(status, 502..=504) {
            return true;
        }
        if on & on::RETRIABLE_4XX != 0 && status == 409 {
            return true;
        }
        if on & on::RETRIABLE_STATUS_CODES != 0 && self.statuses.contains(&status) {
            return true;
        }
        let grpc = [
            (1, on::GRPC_CANCELLED),
            (4, on::GRPC_DEADLINE_EXCEEDED),
            (8, on::GRPC_RESOURCE_EXHAUSTED),
            (13, on::GRPC_INTERNAL),
            (14, on::GRPC_UNAVAILABLE),
        ];
        match grpc_status {
            Some(code) => grpc.iter().any(|(c, bit)| *c == code && on & bit != 0),
            None => false,
        }
    }

    /// Whether a failed attempt (no response headers) is retried.
    pub fn retries_failure(&self, failure: Failure) -> bool {
        let on = self.on;
        if on & (on::FIVE_XX | on::GATEWAY_ERROR | on::RESET) != 0 {
            return true;
        }
        match failure {
            Failure::ConnectFailure => on & (on::CONNECT_FAILURE | on::RESET_BEFORE_REQUEST) != 0,
            Failure::Reset => false,
        }
    }

    /// The wait before retry number `retry` (1-based): Envoy's jittered exponential back-off,
    /// a uniform draw below `base * 2^(retry-1)`, capped at `max`.
    pub fn backoff(&self, retry: u32, random: u64) -> Duration {
        let base = self.backoff_base.as_millis() as u64;
        let ceiling = base
            .saturating_mul(1u64 << (retry.saturating_sub(1)).min(30))
            .min(self.backoff_max.as_millis() as u64);
        Duration::from_millis(if ceiling == 0 { 0 } else { random % ceiling })
    }

    pub fn translate(p: &rpb::RetryPolicy) -> Result<RetryPolicy, String> {
        let mut bits = 0;
        for token in p
            .retry_on
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
        {
            match NAMES.iter().find(|(n, _)| *n == token) {
                Some((_, b)) => bits |= b,
                // retriable-headers needs retriable_headers, which Portico does not match yet.
                None if token == "retriable-headers" => {
                    return Err("retry_on 'retriable-headers' is not supported yet".into())
                }
                // Envoy 1.40 warns and ignores tokens it does not know.
                None => tracing::warn!(
                    "Unknown retry_on policy token '{token}' in retry_on config '{}'; it is ignored",
                    p.retry_on
                ),
            }
        }
        let statuses = p
            .retriable_status_codes
            .iter()
            .map(|c| {
                u16::try_from(*c)
                    .ok()
                    .filter(|c| (100..600).contains(c))
                    .ok_or_else(|| format!("retriable_status_codes: {c} is not an HTTP status"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut previous_hosts = false;
        for (i, pred) in p.retry_host_predicate.iter().enumerate() {
            let type_url = match &pred.config_type {
                Some(rpb::retry_policy::retry_host_predicate::ConfigType::TypedConfig(a)) => {
                    a.type_url.as_str()
                }
                None => "",
            };
            if type_url == PREVIOUS_HOSTS_TYPE {
                previous_hosts = true;
            } else if type_url.is_empty() {
                // Envoy 1.40 finds extensions by type only.
                return Err(format!(
                    "retry_host_predicate[{i}]: no registered implementation for '{}' with type URL ''",
                    pred.name
                ));
            } else {
                return Err(format!(
                    "retry_host_predicate[{i}] '{}' is not supported (only previous_hosts)",
                    pred.name
                ));
            }
        }
        if p.retry_priority.is_some() {
            return Err("retry_priority is not supported yet".into());
        }
        if !p.retriable_headers.is_empty() || !p.retriable_request_headers.is_empty() {
            return Err(
                "retriable_headers / retriable_request_headers are not supported yet".into(),
            );
        }
        if p.rate_limited_retry_back_off.is_some() {
            return Err("rate_limited_retry_back_off is not supported yet".into());
        }
        if !p.retry_options_predicates.is_empty() {
            return Err("retry_options_predicates are not supported".into());
        }
        let per_try_timeout = match &p.per_try_timeout {
            Some(d) => {
                let d = super::duration(d).map_err(|e| format!("per_try_timeout: {e}"))?;
                (!d.is_zero()).then_some(d)
            }
            None => None,
        };
        if p.per_try_idle_timeout.is_some() {
            return Err("per_try_idle_timeout is not supported yet".into());
        }
        let (mut base, mut max) = (Duration::from_millis(25), None);
        if let Some(b) = &p.retry_back_off {
            let bi = b
                .base_interval
                .as_ref()
                .ok_or("retry_back_off.base_interval is required")?;
            base = super::duration(bi).map_err(|e| format!("retry_back_off.base_interval: {e}"))?;
            if base < Duration::from_millis(1) {
                return Err("retry_back_off.base_interval must be at least 1ms".into());
            }
            if let Some(m) = &b.max_interval {
                let m =
                    super::duration(m).map_err(|e| format!("retry_back_off.max_interval: {e}"))?;
                if m < base {
                    return Err(
                        "retry_back_off.max_interval must be greater than or equal to the base_interval"
                            .into(),
                    );
                }
                max = Some(m);
            }
        }
        Ok(RetryPolicy {
            on: bits,
            num_retries: p.num_retries.as_ref().map_or(1, |n| n.value),
            per_try_timeout,
            statuses,
            previous_hosts,
            host_selection_attempts: u32::try_from(p.host_selection_retry_max_attempts)
                .unwrap_or(0),
            backoff_base: base,
            // Envoy: ten times the base unless given.
            backoff_max: max.unwrap_or(base * 10),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::{Duration as PDuration, UInt32Value};

    fn typed(type_url: &str) -> rpb::retry_policy::retry_host_predicate::ConfigType {
        rpb::retry_policy::retry_host_predicate::ConfigType::TypedConfig(
            envoy_types::pb::google::protobuf::Any {
                type_url: type_url.into(),
                value: Vec::new(),
            },
        )
    }

    fn istio_default() -> rpb::RetryPolicy {
        rpb::RetryPolicy {
            retry_on: "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes"
                .into(),
            num_retries: Some(UInt32Value { value: 2 }),
            retry_host_predicate: vec![rpb::retry_policy::RetryHostPredicate {
                name: "envoy.retry_host_predicates.previous_hosts".into(),
                config_type: Some(typed(PREVIOUS_HOSTS_TYPE)),
            }],
            host_selection_retry_max_attempts: 5,
            retriable_status_codes: vec![503],
            ..Default::default()
        }
    }

    #[test]
    fn istios_default_policy() {
        let p = RetryPolicy::translate(&istio_default()).unwrap();
        assert_eq!(p.num_retries, 2);
        assert!(p.previous_hosts);
        assert_eq!(p.host_selection_attempts, 5);
        assert!(p.retries_status(503, None));
        assert!(!p.retries_status(502, None));
        assert!(!p.retries_status(500, None));
        assert!(p.retries_status(200, Some(14)), "grpc unavailable");
        assert!(p.retries_status(200, Some(1)), "grpc cancelled");
        assert!(!p.retries_status(200, Some(13)));
        assert!(p.retries_failure(Failure::ConnectFailure));
        assert!(!p.retries_failure(Failure::Reset));
    }

    #[test]
    fn five_xx_and_gateway_error_cover_resets() {
        let mut raw = istio_default();
        raw.retry_on = "5xx".into();
        let p = RetryPolicy::translate(&raw).unwrap();
        assert!(p.retries_status(500, None) && p.retries_status(599, None));
        assert!(!p.retries_status(409, None));
        assert!(p.retries_failure(Failure::Reset));
        raw.retry_on = "gateway-error,retriable-4xx".into();
        let p = RetryPolicy::translate(&raw).unwrap();
        assert!(p.retries_status(504, None) && !p.retries_status(500, None));
        assert!(p.retries_status(409, None));
        raw.retry_on = "reset".into();
        let p = RetryPolicy::translate(&raw).unwrap();
        assert!(p.retries_failure(Failure::Reset) && !p.retries_status(503, None));
    }

    #[test]
    fn unknown_conditions_are_ignored_as_envoy_does() {
        let mut raw = istio_default();
        raw.retry_on = "5xx,sometimes".into();
        let p = RetryPolicy::translate(&raw).unwrap();
        assert_eq!(p.on, on::FIVE_XX);
    }

    #[test]
    fn defaults_and_backoff() {
        let p = RetryPolicy::translate(&rpb::RetryPolicy {
            retry_on: "5xx".into(),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(p.num_retries, 1);
        // Unset: no re-pick (Envoy makes host_selection_retry_max_attempts + 1 picks).
        assert_eq!(p.host_selection_attempts, 0);
        assert_eq!(
            (p.backoff_base, p.backoff_max),
            (Duration::from_millis(25), Duration::from_millis(250))
        );
        assert!(p.backoff(1, u64::MAX) < Duration::from_millis(25));
        assert!(p.backoff(3, u64::MAX) < Duration::from_millis(100));
        assert!(p.backoff(30, u64::MAX) < Duration::from_millis(250));
    }

    #[test]
    fn rejections_name_the_field() {
        let bad = |f: &dyn Fn(&mut rpb::RetryPolicy), want: &str| {
            let mut p = istio_default();
            f(&mut p);
            let e = RetryPolicy::translate(&p).unwrap_err();
            assert!(e.contains(want), "{e} does not contain {want}");
        };
        bad(
            &|p| p.retriable_status_codes = vec![99],
            "retriable_status_codes: 99",
        );
        bad(
            &|p| {
                p.retry_host_predicate[0].config_type = Some(typed(
                    "type.googleapis.com/envoy.extensions.retry.host.omit_canary_hosts.v3.OmitCanaryHostsPredicate",
                ))
            },
            "retry_host_predicate[0]",
        );
        bad(
            &|p| p.retry_host_predicate[0].config_type = None,
            "with type URL ''",
        );
        bad(
            &|p| {
                p.retry_back_off = Some(rpb::retry_policy::RetryBackOff {
                    base_interval: Some(PDuration {
                        seconds: 1,
                        nanos: 0,
                    }),
                    max_interval: Some(PDuration {
                        seconds: 0,
                        nanos: 5_000_000,
                    }),
                })
            },
            "max_interval must be greater",
        );
        bad(
            &|p| {
                p.retry_back_off = Some(rpb::retry_policy::RetryBackOff {
                    base_interval: None,
                    max_interval: None,
                })
            },
            "base_interval is required",
        );
    }
}
