use super::*;
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use http::HeaderValue;

fn pct(n: u32, d: tpb::fractional_percent::DenominatorType) -> Option<tpb::FractionalPercent> {
    Some(tpb::FractionalPercent {
        numerator: n,
        denominator: d as i32,
    })
}

use tpb::fractional_percent::DenominatorType as D;

fn abort_http(status: u32, p: Option<tpb::FractionalPercent>) -> fpb::HttpFault {
    fpb::HttpFault {
        abort: Some(fpb::FaultAbort {
            error_type: Some(fpb::fault_abort::ErrorType::HttpStatus(status)),
            percentage: p,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn delay_ms(ms: i32, p: Option<tpb::FractionalPercent>) -> fpb::HttpFault {
    fpb::HttpFault {
        delay: Some(cfpb::FaultDelay {
            fault_delay_secifier: Some(cfpb::fault_delay::FaultDelaySecifier::FixedDelay(
                PbDuration {
                    seconds: 0,
                    nanos: ms * 1_000_000,
                },
            )),
            percentage: p,
        }),
        ..Default::default()
    }
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut m = HeaderMap::new();
    for (k, v) in pairs {
        m.insert(
            http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
            HeaderValue::from_str(v).expect("value"),
        );
    }
    m
}

#[test]
fn percentages_use_envoys_modulo_rule() {
    let p = Percent {
        numerator: 50,
        denominator: 100,
    };
    assert!(p.hit(49));
    assert!(!p.hit(50));
    assert!(p.hit(149));
    let m = Percent {
        numerator: 1,
        denominator: 1_000_000,
    };
    assert!(m.hit(0) && !m.hit(1));
    // A numerator above the denominator is always on.
    let over = Percent {
        numerator: 200,
        denominator: 100,
    };
    assert!((0..100).all(|r| over.hit(r)));
}

#[test]
fn fixed_abort_and_delay_translate_and_fire() {
    let f = Fault::translate(&abort_http(503, pct(100, D::Hundred))).expect("valid");
    let h = HeaderMap::new();
    assert_eq!(
        f.abort_for(&h, || 7),
        Some(AbortWith {
            status: 503,
            grpc_status: None,
            body: Bytes::from_static(b"fault filter abort"),
        })
    );
    assert_eq!(f.delay_for(&h, || 0), None);
    let f = Fault::translate(&delay_ms(250, pct(10, D::TenThousand))).expect("valid");
    assert_eq!(f.delay_for(&h, || 9), Some(Duration::from_millis(250)));
    assert_eq!(f.delay_for(&h, || 10), None);
}

#[test]
fn missing_percentage_never_fires() {
    let f = Fault::translate(&abort_http(500, None)).expect("valid");
    assert_eq!(f.abort_for(&HeaderMap::new(), || 0), None);
}

#[test]
fn grpc_abort_answers_200_with_grpc_status() {
    let mut p = abort_http(200, pct(100, D::Hundred));
    if let Some(a) = p.abort.as_mut() {
        a.error_type = Some(fpb::fault_abort::ErrorType::GrpcStatus(14));
        a.response_body = "custom".into();
    }
    let f = Fault::translate(&p).expect("valid");
    let a = f.abort_for(&HeaderMap::new(), || 0).expect("fires");
    assert_eq!((a.status, a.grpc_status), (200, Some(14)));
    assert_eq!(a.body, Bytes::from_static(b"custom"));
    assert_eq!(http_to_grpc_status(503), 14);
    assert_eq!(http_to_grpc_status(404), 12);
    assert_eq!(http_to_grpc_status(418), 2);
}

#[test]
fn header_controlled_faults_read_envoys_headers() {
    let p = fpb::HttpFault {
        abort: Some(fpb::FaultAbort {
            error_type: Some(fpb::fault_abort::ErrorType::HeaderAbort(
                fpb::fault_abort::HeaderAbort {},
            )),
            percentage: pct(100, D::Hundred),
            ..Default::default()
        }),
        delay: Some(cfpb::FaultDelay {
            fault_delay_secifier: Some(cfpb::fault_delay::FaultDelaySecifier::HeaderDelay(
                cfpb::fault_delay::HeaderDelay {},
            )),
            percentage: pct(50, D::Hundred),
        }),
        ..Default::default()
    };
    let f = Fault::translate(&p).expect("valid");
    let none = HeaderMap::new();
    assert_eq!(f.abort_for(&none, || 0), None);
    assert_eq!(f.delay_for(&none, || 0), None);
    let h = headers(&[(HDR_ABORT, "429"), (HDR_DELAY, "20")]);
    assert_eq!(f.abort_for(&h, || 0).map(|a| a.status), Some(429));
    assert_eq!(f.delay_for(&h, || 0), Some(Duration::from_millis(20)));
    // The configured percentage caps the header's.
    let h = headers(&[(HDR_DELAY, "20"), (HDR_DELAY_PERCENT, "80")]);
    assert_eq!(f.delay_for(&h, || 60), None);
    let h = headers(&[(HDR_DELAY, "20"), (HDR_DELAY_PERCENT, "10")]);
    assert_eq!(f.delay_for(&h, || 10), None);
    assert!(f.delay_for(&h, || 9).is_some());
    // Out-of-range HTTP status: no HTTP abort; a gRPC one still applies.
    let h = headers(&[(HDR_ABORT, "700")]);
    assert_eq!(f.abort_for(&h, || 0), None);
    let h = headers(&[(HDR_ABORT, "700"), (HDR_ABORT_GRPC, "5")]);
    assert_eq!(
        f.abort_for(&h, || 0).map(|a| (a.status, a.grpc_status)),
        Some((200, Some(5)))
    );
}

#[test]
fn rejections_name_the_field() {
    let e = |p: fpb::HttpFault| Fault::translate(&p).expect_err("must be rejected");
    assert_eq!(
        e(abort_http(600, None)),
        "abort: http_status: value 600 must be inside range [200, 600)"
    );
    assert_eq!(
        e(abort_http(199, None)),
        "abort: http_status: value 199 must be inside range [200, 600)"
    );
    assert_eq!(
        e(delay_ms(0, None)),
        "delay: fixed_delay: value must be greater than 0s"
    );
    assert_eq!(
        e(fpb::HttpFault {
            abort: Some(fpb::FaultAbort::default()),
            ..Default::default()
        }),
        "abort: one of http_status, grpc_status or header_abort is required"
    );
    assert_eq!(
        e(fpb::HttpFault {
            delay: Some(cfpb::FaultDelay::default()),
            ..Default::default()
        }),
        "delay: one of fixed_delay or header_delay is required"
    );
    let mut bad_den = abort_http(500, pct(1, D::Hundred));
    if let Some(a) = bad_den.abort.as_mut() {
        if let Some(p) = a.percentage.as_mut() {
            p.denominator = 7;
        }
    }
    assert_eq!(
        e(bad_den),
        "abort: percentage.denominator: 7 is not a defined value"
    );
    assert_eq!(
        e(fpb::HttpFault {
            response_rate_limit: Some(Default::default()),
            ..Default::default()
        }),
        "response_rate_limit is not supported"
    );
    assert_eq!(
        e(fpb::HttpFault {
            headers: vec![rpb::HeaderMatcher::default()],
            ..Default::default()
        }),
        "headers[0] '': name must not be empty"
    );
    let wrong = Any {
        type_url: "type.googleapis.com/x.Y".into(),
        value: vec![],
    };
    assert_eq!(
        Fault::from_any(&wrong).expect_err("wrong type"),
        format!("expected {FAULT_TYPE}, got type.googleapis.com/x.Y")
    );
}

#[test]
fn max_active_faults_is_kept() {
    let mut p = abort_http(500, pct(100, D::Hundred));
    p.max_active_faults = Some(UInt32Value { value: 3 });
    assert_eq!(
        Fault::translate(&p).expect("valid").max_active_faults,
        Some(3)
    );
}

#[test]
fn per_route_entries_and_layering() {
    use envoy_types::pb::envoy::config::route::v3::FilterConfig;
    let fault_any = Any {
        type_url: FAULT_TYPE.into(),
        value: abort_http(418, pct(100, D::Hundred)).encode_to_vec(),
    };
    let disabled = Any {
        type_url: FILTER_CONFIG_TYPE.into(),
        value: FilterConfig {
            disabled: true,
            ..Default::default()
        }
        .encode_to_vec(),
    };
    let wrapped = Any {
        type_url: FILTER_CONFIG_TYPE.into(),
        value: FilterConfig {
            config: Some(fault_any.clone()),
            ..Default::default()
        }
        .encode_to_vec(),
    };
    let other = Any {
        type_url: "type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy".into(),
        value: vec![],
    };
    let map: std::collections::HashMap<String, Any> = [
        ("f1".to_string(), fault_any),
        ("f2".to_string(), disabled),
        ("f3".to_string(), wrapped),
        ("cors".to_string(), other),
    ]
    .into_iter()
    .collect();
    let got = per_route(&map).expect("valid");
    let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["f1", "f2", "f3"]);
    assert_eq!(got[1].1.disabled, Some(true));
    assert!(got[1].1.config.is_none());
    assert_eq!(got[2].1.disabled, Some(false));
    assert!(got[2].1.config.as_ref().is_some_and(|c| c.abort.is_some()));

    let bad: std::collections::HashMap<String, Any> = [(
        "f".to_string(),
        Any {
            type_url: FAULT_TYPE.into(),
            value: abort_http(100, None).encode_to_vec(),
        },
    )]
    .into_iter()
    .collect();
    assert_eq!(
        per_route(&bad).expect_err("bad status"),
        "typed_per_filter_config['f']: abort: http_status: value 100 must be inside range [200, 600)"
    );

    // The route only enables f1; the vhost's config for it stays.
    let enable_only = PerRoute {
        disabled: Some(false),
        config: None,
    };
    let vh = vec![
        ("f1".to_string(), got[0].1.clone()),
        ("f2".to_string(), got[1].1.clone()),
    ];
    let rt = vec![
        ("f1".to_string(), enable_only.clone()),
        ("f2".to_string(), enable_only),
    ];
    let layered = layer(&[&[], &vh, &rt]);
    assert_eq!(layered.len(), 2);
    assert_eq!(layered[0].1.disabled, Some(false));
    assert!(layered[0].1.config.is_some());
    assert_eq!(layered[1].1.disabled, Some(false));

    let empty = FilterConfig::default();
    let bad: std::collections::HashMap<String, Any> = [(
        "f".to_string(),
        Any {
            type_url: FILTER_CONFIG_TYPE.into(),
            value: empty.encode_to_vec(),
        },
    )]
    .into_iter()
    .collect();
    assert_eq!(
        per_route(&bad).expect_err("empty FilterConfig"),
        "Empty route/virtual host per filter configuration for f filter"
    );
}
