//! Outlier detection (`Cluster.outlier_detection`) as Envoy's detectors do it: a host that
//! answers `consecutive_5xx` 5xx in a row (or `consecutive_gateway_failure` 502/503/504), or
//! whose success rate over an `interval` falls `success_rate_stdev_factor` standard
//! deviations below its peers', is ejected for `base_ejection_time` times its ejection count
//! (capped by `max_ejection_time`), unless `max_ejection_percent` of the cluster is already
//! out. Connect
//! failures and timeouts count as 503 and 504, as Envoy counts local-origin errors when they
//! are not split out. Ejected hosts are skipped by the balancers until their time is up.
//!
//! This module translates the config; the detectors' per-host state is live state
//! ([`crate::live::outlier`]), kept across EDS and CDS updates.

use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3 as cpb;

pub use crate::live::outlier::OutlierConfig;

/// The detectors' parameters from `Cluster.outlier_detection`, with Envoy's defaults.
pub fn translate(o: &cpb::OutlierDetection) -> Result<OutlierConfig, String> {
    let dur =
        |d: &Option<envoy_types::pb::google::protobuf::Duration>, default: Duration, what: &str| {
            match d {
                Some(d) => super::duration(d).map_err(|e| format!("outlier_detection.{what}: {e}")),
                None => Ok(default),
            }
        };
    let pct =
        |v: &Option<envoy_types::pb::google::protobuf::UInt32Value>, default: u32, what: &str| {
            let v = v.as_ref().map_or(default, |v| v.value);
            if v > 100 {
                Err(format!(
                    "outlier_detection.{what}: value must be lte 100, got {v}"
                ))
            } else {
                Ok(v)
            }
        };
    if o.split_external_local_origin_errors {
        return Err(
            "outlier_detection.split_external_local_origin_errors is not supported yet".into(),
        );
    }
    // Detectors and options that would eject other hosts, or for other times, than these do.
    let refused = [
        (
            "enforcing_failure_percentage",
            o.enforcing_failure_percentage
                .as_ref()
                .is_some_and(|v| v.value > 0),
        ),
        (
            "always_eject_one_host",
            o.always_eject_one_host.as_ref().is_some_and(|v| v.value),
        ),
        (
            "detect_degraded_hosts",
            o.detect_degraded_hosts.as_ref().is_some_and(|v| v.value),
        ),
        ("monitors", !o.monitors.is_empty()),
        (
            "max_ejection_time_jitter",
            o.max_ejection_time_jitter
                .as_ref()
                .is_some_and(|d| d.seconds != 0 || d.nanos != 0),
        ),
    ];
    if let Some((field, _)) = refused.iter().find(|(_, set)| *set) {
        return Err(format!("outlier_detection.{field} is not supported"));
    }
    let base = dur(
        &o.base_ejection_time,
        Duration::from_secs(30),
        "base_ejection_time",
    )?;
    Ok(OutlierConfig {
        consecutive_5xx: o.consecutive_5xx.as_ref().map_or(5, |v| v.value),
        enforcing_5xx: pct(
            &o.enforcing_consecutive_5xx,
            100,
            "enforcing_consecutive_5xx",
        )?,
        consecutive_gateway: o
            .consecutive_gateway_failure
            .as_ref()
            .map_or(5, |v| v.value),
        enforcing_gateway: pct(
            &o.enforcing_consecutive_gateway_failure,
            0,
            "enforcing_consecutive_gateway_failure",
        )?,
        interval: dur(&o.interval, Duration::from_secs(10), "interval")?,
        base_ejection: base,
        max_ejection: dur(
            &o.max_ejection_time,
            Duration::from_secs(300),
            "max_ejection_time",
        )?
        .max(base),
        max_ejection_percent: pct(&o.max_ejection_percent, 10, "max_ejection_percent")?,
        uneject_on_check: o
            .successful_active_health_check_uneject_host
            .as_ref()
            .is_none_or(|b| b.value),
        success_rate: crate::live::outlier::SuccessRate {
            enforcing: pct(&o.enforcing_success_rate, 100, "enforcing_success_rate")?,
            minimum_hosts: o.success_rate_minimum_hosts.as_ref().map_or(5, |v| v.value),
            request_volume: o
                .success_rate_request_volume
                .as_ref()
                .map_or(100, |v| v.value),
            stdev_factor: f64::from(
                o.success_rate_stdev_factor
                    .as_ref()
                    .map_or(1900, |v| v.value),
            ) / 1000.0,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::UInt32Value;

    #[test]
    fn defaults_are_envoys() {
        let c = translate(&cpb::OutlierDetection::default()).unwrap();
        assert_eq!((c.consecutive_5xx, c.enforcing_5xx), (5, 100));
        assert_eq!((c.consecutive_gateway, c.enforcing_gateway), (5, 0));
        assert_eq!(c.base_ejection, Duration::from_secs(30));
        assert_eq!(c.max_ejection_percent, 10);
        let bad = cpb::OutlierDetection {
            max_ejection_percent: Some(UInt32Value { value: 101 }),
            ..Default::default()
        };
        assert!(translate(&bad)
            .unwrap_err()
            .contains("max_ejection_percent"));
    }
}
