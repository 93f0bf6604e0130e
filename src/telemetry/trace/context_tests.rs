use std::sync::Arc;

use http::{HeaderMap, HeaderValue};

use super::*;
use crate::telemetry::trace::config::{Fraction, OpenTelemetry, Zipkin};

fn cfg(provider: Option<Provider>) -> TracingConfig {
    TracingConfig {
        provider: provider.map(Arc::new),
        client_sampling: Fraction {
            numerator: 100,
            denominator: 100,
        },
        random_sampling: Fraction::ALL_OF_10000,
        overall_sampling: Fraction::ALL_OF_10000,
        custom_tags: Vec::new(),
        max_path_tag_length: 256,
        verbose: false,
        operation: None,
        egress: false,
    }
}

fn zipkin(shared: bool, wide: bool) -> Provider {
    Provider::Zipkin(Zipkin {
        cluster: "zipkin".into(),
        endpoint: "/api/v2/spans".into(),
        hostname: "zipkin".into(),
        proto: false,
        trace_id_128bit: wide,
        shared_span_context: shared,
    })
}

fn otel() -> Provider {
    Provider::OpenTelemetry(OpenTelemetry {
        cluster: "otel".into(),
        authority: "otel".into(),
        service_name: "s".into(),
    })
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(*k, HeaderValue::from_str(v).unwrap());
    }
    h
}

fn counter() -> impl FnMut() -> u64 {
    let mut n = 0;
    move || {
        n += 1;
        0x1111 * n
    }
}

#[test]
fn request_id_sampling_as_the_uuid_extension_packs_it() {
    let c = cfg(None);
    let mut rid = *b"12345678-1234-4234-8234-123456789012";
    assert_eq!(sample(&mut rid, false, false, &c, 0), Reason::Sampling);
    assert_eq!(rid[14], b'9');
    // Already decided: kept.
    assert_eq!(sample(&mut rid, true, true, &c, 0), Reason::Sampling);

    let mut rid = *b"12345678-1234-4234-8234-123456789012";
    assert_eq!(sample(&mut rid, true, false, &c, 0), Reason::ClientForced);
    assert_eq!(rid[14], b'b');
    let mut rid = *b"12345678-1234-4234-8234-123456789012";
    assert_eq!(sample(&mut rid, false, true, &c, 0), Reason::ServiceForced);
    assert_eq!(rid[14], b'a');

    // Random sampling reads the first 8 hex digits modulo 10000: 0x00001388 = 5000.
    let mut half = cfg(None);
    half.random_sampling = Fraction {
        numerator: 5000,
        denominator: 10_000,
    };
    let mut rid = *b"00001388-1234-4234-8234-123456789012";
    assert_eq!(
        sample(&mut rid, false, false, &half, 0),
        Reason::NotTraceable
    );
    assert_eq!(rid[14], b'4');
    let mut rid = *b"00001387-1234-4234-8234-123456789012";
    assert_eq!(sample(&mut rid, false, false, &half, 0), Reason::Sampling);

    // Overall sampling unsets even a forced trace.
    let mut off = cfg(None);
    off.overall_sampling = Fraction {
        numerator: 0,
        denominator: 10_000,
    };
    let mut rid = *b"12345678-1234-4234-8234-123456789012";
    assert_eq!(sample(&mut rid, false, true, &off, 0), Reason::NotTraceable);
    assert_eq!(rid[14], b'4');

    // Not a uuid: left alone.
    let mut rid = b"my-request".to_vec();
    assert_eq!(sample(&mut rid, true, true, &c, 0), Reason::NotTraceable);
    assert_eq!(rid, b"my-request");
}

#[test]
fn zipkin_root_span_and_its_b3_headers() {
    let c = cfg(Some(zipkin(true, false)));
    let s = start_span(
        &c,
        c.provider.as_deref(),
        &HeaderMap::new(),
        Reason::Sampling,
        &mut counter(),
    )
    .unwrap();
    assert_eq!(s.trace_low, s.span_id);
    assert_eq!(s.trace_high, 0);
    assert!(s.sampled);
    assert_eq!(
        names(&s),
        vec![
            ("x-b3-traceid", "0000000000001111".to_string()),
            ("x-b3-spanid", "0000000000001111".to_string()),
            ("x-b3-sampled", "1".to_string()),
        ]
    );
    let wide = cfg(Some(zipkin(true, true)));
    let s = start_span(
        &wide,
        wide.provider.as_deref(),
        &HeaderMap::new(),
        Reason::NotTraceable,
        &mut counter(),
    )
    .unwrap();
    assert_eq!(s.trace_id_hex(), "00000000000022220000000000001111");
    assert!(!s.sampled);
}

#[test]
fn zipkin_continues_b3_contexts() {
    let c = cfg(Some(zipkin(true, false)));
    let h = headers(&[
        ("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124"),
        ("x-b3-spanid", "a2fb4a1d1a96d312"),
        ("x-b3-parentspanid", "0020000000000001"),
        ("x-b3-sampled", "0"),
    ]);
    let s = start_span(
        &c,
        c.provider.as_deref(),
        &h,
        Reason::Sampling,
        &mut counter(),
    )
    .unwrap();
    assert_eq!(s.trace_id_hex(), "463ac35c9f6413ad48485a3953bb6124");
    assert_eq!(s.span_id, 0xa2fb4a1d1a96d312);
    assert_eq!(s.parent_id, Some(0x0020000000000001));
    assert!(!s.sampled, "the caller's decision wins");

    // Not shared (or egress): a child span.
    let c = cfg(Some(zipkin(false, false)));
    let s = start_span(
        &c,
        c.provider.as_deref(),
        &h,
        Reason::Sampling,
        &mut counter(),
    )
    .unwrap();
    assert_eq!(s.span_id, 0x1111);
    assert_eq!(s.parent_id, Some(0xa2fb4a1d1a96d312));

    // Single header, written back the same way.
    let b3 = "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90";
    let c = cfg(Some(zipkin(true, false)));
    let s = start_span(
        &c,
        c.provider.as_deref(),
        &headers(&[("b3", b3)]),
        Reason::NotTraceable,
        &mut counter(),
    );
    assert_eq!(names(&s.unwrap()), vec![("b3", b3.to_string())]);
    let s = start_span(
        &c,
        c.provider.as_deref(),
        &headers(&[("b3", "0")]),
        Reason::Sampling,
        &mut counter(),
    );
    assert_eq!(
        names(&s.unwrap()),
        vec![("b3", "0000000000001111-0000000000001111-0".to_string())]
    );
    // Malformed: no span.
    for bad in [
        vec![("x-b3-traceid", "xyz"), ("x-b3-spanid", "1")],
        vec![("b3", "x")],
        vec![("b3", "80f198ee56343ba8-e457b5a2e4d86bd1-")],
    ] {
        assert!(
            start_span(
                &c,
                c.provider.as_deref(),
                &headers(&bad),
                Reason::Sampling,
                &mut counter()
            )
            .is_none(),
            "{bad:?}"
        );
    }
}

#[test]
fn w3c_traceparent_started_and_continued() {
    let c = cfg(Some(otel()));
    let s = start_span(
        &c,
        c.provider.as_deref(),
        &HeaderMap::new(),
        Reason::Sampling,
        &mut counter(),
    )
    .unwrap();
    assert_eq!(
        names(&s),
        vec![
            (
                "traceparent",
                "00-00000000000011110000000000002222-0000000000003333-01".to_string()
            ),
            ("tracestate", String::new()),
        ]
    );
    let h = headers(&[
        (
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        ),
        ("tracestate", "a=1"),
        ("tracestate", "b=2"),
    ]);
    let s = start_span(
        &c,
        c.provider.as_deref(),
        &h,
        Reason::Sampling,
        &mut counter(),
    )
    .unwrap();
    assert_eq!(s.trace_id_hex(), "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(s.parent_id, Some(0xb7ad6b7169203331));
    assert!(!s.sampled);
    assert_eq!(s.tracestate, "a=1,b=2");
    for bad in [
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "zz-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    ] {
        let h = headers(&[("traceparent", bad)]);
        assert!(
            start_span(
                &c,
                c.provider.as_deref(),
                &h,
                Reason::Sampling,
                &mut counter()
            )
            .is_none(),
            "{bad}"
        );
    }
}

#[test]
fn unimplemented_drivers_make_no_spans() {
    let c = cfg(Some(Provider::Unimplemented("envoy.tracers.datadog")));
    assert!(start_span(
        &c,
        c.provider.as_deref(),
        &HeaderMap::new(),
        Reason::Sampling,
        &mut counter()
    )
    .is_none());
    assert!(start_span(
        &cfg(None),
        None,
        &HeaderMap::new(),
        Reason::Sampling,
        &mut counter()
    )
    .is_none());
}

#[test]
fn ids_are_sixteen_lowercase_hex_digits_as_fmt_writes_them() {
    for v in [
        0u64,
        1,
        0xf,
        0x10,
        0xdead_beef,
        0x0123_4567_89ab_cdef,
        u64::MAX,
    ] {
        let mut s = String::new();
        push_hex16(&mut s, v);
        assert_eq!(s, format!("{v:016x}"));
    }
}

fn names(s: &SpanContext) -> Vec<(&'static str, String)> {
    s.headers()
        .into_iter()
        .map(|(n, v)| (n.as_str(), v))
        .collect()
}
