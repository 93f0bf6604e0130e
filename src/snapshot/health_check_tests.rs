//! Health check translation, the per-host state machine and the interval rules.

use super::*;

use corepb::health_check::{HealthChecker as HC, HttpHealthCheck, TcpHealthCheck};
use envoy_types::pb::envoy::r#type::v3::Int64Range;
use envoy_types::pb::google::protobuf::{Duration as PDuration, UInt32Value};

fn ms(n: u64) -> Option<PDuration> {
    Some(PDuration {
        seconds: (n / 1000) as i64,
        nanos: ((n % 1000) * 1_000_000) as i32,
    })
}

fn base(checker: HC) -> corepb::HealthCheck {
    corepb::HealthCheck {
        timeout: ms(1000),
        interval: ms(5000),
        unhealthy_threshold: Some(UInt32Value { value: 3 }),
        healthy_threshold: Some(UInt32Value { value: 2 }),
        health_checker: Some(checker),
        ..Default::default()
    }
}

fn http(path: &str) -> HC {
    HC::HttpHealthCheck(HttpHealthCheck {
        path: path.into(),
        ..Default::default()
    })
}

fn ok(hc: corepb::HealthCheck) -> HealthCheckConfig {
    HealthCheckConfig::translate(&[hc])
        .unwrap_or_else(|e| panic!("unexpected rejection: {e}"))
        .expect("one health check")
}

#[track_caller]
fn rejected(hc: corepb::HealthCheck, needle: &str) {
    match HealthCheckConfig::translate(&[hc]) {
        Ok(c) => panic!("expected a rejection, got {c:?}"),
        Err(e) => assert!(e.contains(needle), "{e:?} does not mention {needle:?}"),
    }
}

#[test]
fn defaults_are_envoys() {
    let c = ok(base(http("/healthz")));
    assert_eq!(c.no_traffic_interval, Duration::from_secs(60));
    assert_eq!(c.no_traffic_healthy_interval, Duration::from_secs(60));
    assert_eq!(c.unhealthy_interval, Duration::from_secs(5));
    assert_eq!(c.unhealthy_edge_interval, Duration::from_secs(5));
    assert_eq!(c.healthy_edge_interval, Duration::from_secs(5));
    assert!(c.reuse_connection);
    let CheckKind::Http(h) = &c.kind else {
        panic!("http expected")
    };
    assert_eq!(h.expected, vec![(200, 201)]);
    assert!(h.retriable.is_empty() && !h.http2);
    assert!(h.expects(200) && !h.expects(204));
    // Unhealthy edge defaults to the unhealthy interval, no-traffic healthy to no-traffic.
    let c = ok(corepb::HealthCheck {
        unhealthy_interval: ms(700),
        no_traffic_interval: ms(300),
        ..base(HC::TcpHealthCheck(TcpHealthCheck::default()))
    });
    assert_eq!(c.unhealthy_edge_interval, Duration::from_millis(700));
    assert_eq!(c.no_traffic_healthy_interval, Duration::from_millis(300));
    assert_eq!(c.kind, CheckKind::Tcp);
    assert_eq!(HealthCheckConfig::translate(&[]), Ok(None));
}

#[test]
fn required_fields_are_rejected_naming_them() {
    rejected(
        corepb::HealthCheck {
            timeout: None,
            ..base(http("/"))
        },
        "health_checks[0].timeout: value is required",
    );
    rejected(
        corepb::HealthCheck {
            interval: ms(0),
            ..base(http("/"))
        },
        "health_checks[0].interval: value must be greater than 0s",
    );
    rejected(
        corepb::HealthCheck {
            unhealthy_threshold: None,
            ..base(http("/"))
        },
        "health_checks[0].unhealthy_threshold: value is required",
    );
    rejected(
        corepb::HealthCheck {
            healthy_threshold: None,
            ..base(http("/"))
        },
        "health_checks[0].healthy_threshold: value is required",
    );
    rejected(
        corepb::HealthCheck {
            health_checker: None,
            ..base(http("/"))
        },
        "health_checks[0].health_checker: value is required",
    );
    rejected(
        base(http("")),
        "health_checks[0].http_health_check.path: value length must be at least 1",
    );
    rejected(
        corepb::HealthCheck {
            no_traffic_interval: ms(0),
            ..base(http("/"))
        },
        "health_checks[0].no_traffic_interval: value must be greater than 0s",
    );
}

#[test]
fn unsupported_variants_are_named() {
    rejected(
        base(HC::GrpcHealthCheck(Default::default())),
        "health_checks[0].grpc_health_check is not supported yet",
    );
    rejected(
        base(HC::CustomHealthCheck(
            corepb::health_check::CustomHealthCheck {
                name: "envoy.health_checkers.redis".into(),
                ..Default::default()
            },
        )),
        "health_checks[0].custom_health_check 'envoy.health_checkers.redis' is not supported yet",
    );
    rejected(
        base(HC::TcpHealthCheck(TcpHealthCheck {
            send: Some(corepb::health_check::Payload {
                payload: Some(corepb::health_check::payload::Payload::Text("01".into())),
            }),
            ..Default::default()
        })),
        "health_checks[0].tcp_health_check: send/receive payloads are not supported yet",
    );
    rejected(
        corepb::HealthCheck {
            tls_options: Some(Default::default()),
            ..base(http("/"))
        },
        "health_checks[0].tls_options is not supported yet",
    );
    #[allow(deprecated)]
    rejected(
        corepb::HealthCheck {
            event_log_path: "/dev/stdout".into(),
            ..base(http("/"))
        },
        "health_checks[0].event_log_path is not supported yet",
    );
    rejected(
        base(HC::HttpHealthCheck(HttpHealthCheck {
            path: "/".into(),
            codec_client_type: envoy_types::pb::envoy::r#type::v3::CodecClientType::Http3 as i32,
            ..Default::default()
        })),
        "health_checks[0].http_health_check.codec_client_type: HTTP3 is not supported yet",
    );
    let two = [base(http("/")), base(http("/"))];
    assert!(HealthCheckConfig::translate(&two)
        .unwrap_err()
        .contains("more than one health check"));
}

#[test]
fn status_ranges_are_checked_as_envoy_does() {
    let with = |expected: Vec<Int64Range>, retriable: Vec<Int64Range>| {
        base(HC::HttpHealthCheck(HttpHealthCheck {
            path: "/".into(),
            expected_statuses: expected,
            retriable_statuses: retriable,
            ..Default::default()
        }))
    };
    let r = |start, end| Int64Range { start, end };
    let c = ok(with(vec![r(200, 300)], vec![r(503, 504)]));
    let CheckKind::Http(h) = &c.kind else {
        panic!("http expected")
    };
    assert!(h.expects(204) && !h.expects(300) && h.retries(503) && !h.retries(500));
    rejected(
        with(vec![r(300, 200)], vec![]),
        "Invalid http expected status range: expecting start < end, but found start=300 and end=200",
    );
    rejected(
        with(vec![], vec![r(99, 200)]),
        "Invalid http retriable status range: expecting start >= 100, but found start=99",
    );
    rejected(
        with(vec![r(200, 601)], vec![]),
        "Invalid http expected status range: expecting end <= 600, but found end=601",
    );
}

#[test]
fn request_headers_are_parsed_once_and_host_cannot_be_removed() {
    let c = ok(base(HC::HttpHealthCheck(HttpHealthCheck {
        path: "/".into(),
        request_headers_to_add: vec![corepb::HeaderValueOption {
            header: Some(corepb::HeaderValue {
                key: "x-probe".into(),
                value: "1".into(),
                ..Default::default()
            }),
            ..Default::default()
        }],
        request_headers_to_remove: vec!["user-agent".into()],
        ..Default::default()
    })));
    let CheckKind::Http(h) = &c.kind else {
        panic!("http expected")
    };
    let mut m = http::HeaderMap::new();
    m.insert("user-agent", http::HeaderValue::from_static("Envoy/HC"));
    h.headers.ops.apply(&mut m, None, &Default::default());
    assert_eq!(m.get("x-probe").map(|v| v.as_bytes()), Some(&b"1"[..]));
    assert!(m.get("user-agent").is_none());
    rejected(
        base(HC::HttpHealthCheck(HttpHealthCheck {
            path: "/".into(),
            request_headers_to_remove: vec!["host".into()],
            ..Default::default()
        })),
        "host headers may not be removed",
    );
}

#[test]
fn endpoint_settings_override_the_checked_address() {
    let addr: SocketAddr = "10.0.0.1:80".parse().unwrap();
    let c = epb::endpoint::HealthCheckConfig {
        port_value: 8081,
        hostname: "probe.local".into(),
        ..Default::default()
    };
    let e = EndpointCheck::translate(addr, Some(&c)).unwrap().unwrap();
    assert_eq!(e.target, Some("10.0.0.1:8081".parse().unwrap()));
    assert_eq!(e.hostname.as_deref(), Some("probe.local"));
    assert_eq!(
        EndpointCheck::translate(addr, Some(&Default::default())).unwrap(),
        None
    );
}

// ---------------------------------------------------------------------------------------------
// State machine

fn cfg(unhealthy: u32, healthy: u32) -> HealthCheckConfig {
    let mut c = ok(base(http("/")));
    c.unhealthy_threshold = unhealthy;
    c.healthy_threshold = healthy;
    c
}

const PASS: Outcome = Outcome::Pass { degraded: false };

#[test]
fn the_first_pass_makes_a_host_healthy_whatever_the_threshold() {
    let c = cfg(3, 5);
    let mut m = Machine::default();
    assert!(m.flags.failed, "new hosts start failed");
    assert_eq!(m.apply(PASS, &c), Transition::Changed);
    assert!(!m.flags.failed);
    assert_eq!(m.apply(PASS, &c), Transition::Unchanged);
}

#[test]
fn a_first_failure_keeps_the_host_failed_and_recovery_needs_the_threshold() {
    let c = cfg(3, 2);
    let mut m = Machine::default();
    assert_eq!(m.apply(Outcome::Network, &c), Transition::Unchanged);
    assert!(m.flags.failed);
    assert_eq!(m.apply(PASS, &c), Transition::ChangePending);
    assert!(m.flags.failed);
    assert_eq!(m.apply(PASS, &c), Transition::Changed);
    assert!(!m.flags.failed);
}

#[test]
fn network_failures_count_towards_the_threshold_and_a_pass_resets_them() {
    let c = cfg(3, 1);
    let mut m = Machine::default();
    m.apply(PASS, &c);
    assert_eq!(m.apply(Outcome::Network, &c), Transition::ChangePending);
    assert_eq!(m.apply(Outcome::Timeout, &c), Transition::ChangePending);
    assert_eq!(m.apply(PASS, &c), Transition::Unchanged);
    assert_eq!(m.apply(Outcome::Timeout, &c), Transition::ChangePending);
    assert_eq!(
        m.apply(
            Outcome::Active {
                retriable: true,
                immediate: false
            },
            &c
        ),
        Transition::ChangePending
    );
    assert_eq!(m.apply(Outcome::Timeout, &c), Transition::Changed);
    assert!(
        m.flags.failed && m.flags.timeout,
        "a timeout marks the failed host"
    );
    m.apply(Outcome::Network, &c);
    assert!(!m.flags.timeout, "the flag follows the latest failure");
}

#[test]
fn an_unexpected_status_fails_at_once() {
    let c = cfg(5, 1);
    let mut m = Machine::default();
    m.apply(PASS, &c);
    let t = m.apply(
        Outcome::Active {
            retriable: false,
            immediate: true,
        },
        &c,
    );
    assert_eq!(t, Transition::Changed);
    assert!(m.flags.failed && m.flags.immediate);
    m.apply(PASS, &c);
    assert!(
        !m.flags.failed && !m.flags.immediate,
        "a pass clears the exclusion"
    );
    assert_eq!(m.apply(Outcome::Passive, &c), Transition::Changed);
}

#[test]
fn degraded_answers_change_the_host_without_failing_it() {
    let c = cfg(1, 1);
    let mut m = Machine::default();
    assert_eq!(
        m.apply(Outcome::Pass { degraded: true }, &c),
        Transition::Changed
    );
    assert!(!m.flags.failed && m.flags.degraded);
    assert_eq!(
        m.apply(Outcome::Pass { degraded: true }, &c),
        Transition::Unchanged
    );
    assert_eq!(m.apply(PASS, &c), Transition::Changed);
    assert!(!m.flags.degraded);
}

#[test]
fn intervals_follow_traffic_state_and_transitions() {
    let mut c = cfg(2, 2);
    c.interval = Duration::from_millis(100);
    c.unhealthy_interval = Duration::from_millis(200);
    c.unhealthy_edge_interval = Duration::from_millis(300);
    c.healthy_edge_interval = Duration::from_millis(400);
    c.no_traffic_interval = Duration::from_millis(500);
    c.no_traffic_healthy_interval = Duration::from_millis(600);
    let zero = || 0u64;
    let iv = |healthy, t, traffic| next_interval(&c, healthy, t, traffic, zero).as_millis();
    assert_eq!(iv(true, Transition::Unchanged, true), 100);
    assert_eq!(iv(false, Transition::Changed, true), 200);
    assert_eq!(iv(false, Transition::ChangePending, true), 300);
    assert_eq!(iv(true, Transition::ChangePending, true), 400);
    assert_eq!(iv(true, Transition::Unchanged, false), 600);
    assert_eq!(iv(true, Transition::ChangePending, false), 500);
    assert_eq!(iv(false, Transition::Changed, false), 500);
    // Jitter: a percentage of the base, then the absolute jitter, each `random % span`.
    c.interval_jitter_percent = 10;
    c.interval_jitter = Duration::from_millis(7);
    let r = next_interval(&c, true, Transition::Unchanged, true, || 1_000_003);
    assert_eq!(r.as_millis(), 100 + 1_000_003 % 10 + 1_000_003 % 7);
    assert_eq!(initial_delay(&c, zero), Duration::ZERO);
    c.initial_jitter = Duration::from_millis(50);
    assert_eq!(initial_delay(&c, || 49).as_millis(), 49);
    assert_eq!(initial_delay(&c, zero).as_millis(), 1, "never zero");
}

#[test]
fn eds_health_wins_over_active_checks() {
    let pass = HcFlags::default();
    let failed = HcFlags::NEW;
    assert_eq!(effective(Health::Unhealthy, Some(&pass)), Health::Unhealthy);
    assert_eq!(effective(Health::Healthy, Some(&failed)), Health::Unhealthy);
    assert_eq!(effective(Health::Degraded, Some(&pass)), Health::Degraded);
    let degraded = HcFlags {
        degraded: true,
        ..pass
    };
    assert_eq!(
        effective(Health::Healthy, Some(&degraded)),
        Health::Degraded
    );
    assert_eq!(effective(Health::Healthy, None), Health::Healthy);
    assert_eq!(
        flags_text(Health::Healthy, Some(&failed)),
        "/failed_active_hc"
    );
    assert_eq!(
        flags_text(Health::Unhealthy, Some(&failed)),
        "/failed_active_hc/failed_eds_health"
    );
    assert_eq!(flags_text(Health::Healthy, Some(&pass)), "healthy");
}

#[test]
fn the_checks_method_is_envoys_and_connect_is_refused() {
    use corepb::RequestMethod as M;
    for (m, want) in [
        (M::MethodUnspecified, http::Method::GET),
        (M::Head, http::Method::HEAD),
        (M::Post, http::Method::POST),
        (M::Patch, http::Method::PATCH),
    ] {
        let c = ok(base(HC::HttpHealthCheck(HttpHealthCheck {
            path: "/healthz".into(),
            method: m as i32,
            ..Default::default()
        })));
        let CheckKind::Http(h) = &c.kind else {
            panic!("an HTTP check: {c:?}")
        };
        assert_eq!(h.method, want);
    }
    rejected(
        base(HC::HttpHealthCheck(HttpHealthCheck {
            path: "/healthz".into(),
            method: M::Connect as i32,
            ..Default::default()
        })),
        "http_health_check.method: value must not be in list [CONNECT]",
    );
}
