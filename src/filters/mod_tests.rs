use super::*;
use envoy_types::pb::envoy::extensions::filters::http::fault::v3 as fpb;
use envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3 as lpb;
use envoy_types::pb::envoy::r#type::v3 as tpb;
use prost::Message;

fn any(type_url: &str, value: Vec<u8>) -> Any {
    Any {
        type_url: type_url.into(),
        value,
    }
}

fn translate(name: &str, a: &Any) -> Translated {
    let r = lookup(a).expect("registered");
    (r.translate)(&FilterDecl {
        name,
        config: a,
        disabled: false,
    })
    .expect("translates")
}

fn abort_all() -> Any {
    let f = fpb::HttpFault {
        abort: Some(fpb::FaultAbort {
            error_type: Some(fpb::fault_abort::ErrorType::HttpStatus(503)),
            percentage: Some(tpb::FractionalPercent {
                numerator: 100,
                denominator: 0,
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    any(fault::FAULT_TYPE, f.encode_to_vec())
}

fn two_tokens() -> Any {
    use envoy_types::pb::envoy::config::core::v3::RuntimeFractionalPercent;
    let all = Some(RuntimeFractionalPercent {
        default_value: Some(tpb::FractionalPercent {
            numerator: 100,
            denominator: 0,
        }),
        runtime_key: String::new(),
    });
    let c = lpb::LocalRateLimit {
        stat_prefix: "mod_tests".into(),
        token_bucket: Some(tpb::TokenBucket {
            max_tokens: 2,
            tokens_per_fill: None,
            fill_interval: Some(envoy_types::pb::google::protobuf::Duration {
                seconds: 3600,
                nanos: 0,
            }),
        }),
        filter_enabled: all.clone(),
        filter_enforced: all,
        ..Default::default()
    };
    any(local_ratelimit::TYPE, c.encode_to_vec())
}

fn chain(configs: &[(&str, Any)]) -> Vec<HttpFilter> {
    configs
        .iter()
        .map(|(n, a)| match translate(n, a) {
            Translated::Run(f) => f,
            other => panic!("{n}: {other:?}"),
        })
        .collect()
}

fn run_once(filters: &[HttpFilter], st: &mut FilterState, stats: &fault::FaultStats) -> u16 {
    let headers = http::HeaderMap::new();
    let view = RequestView {
        host: "h",
        authority: "h",
        path: "/",
        method: "GET",
        scheme: "http",
        headers: &headers,
    };
    let req = Request {
        server: None,
        view: &view,
        route: None,
        picked: None,
        conn: Connection::default(),
        upstreams: None,
        body: None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let named = crate::filters::counters::NamedCounters::default();
    let stats = Stats {
        fault: stats,
        named: &named,
    };
    match rt.block_on(run(filters, 0, &req, st, stats)) {
        Outcome::Reply(r) => r.status,
        Outcome::Done | Outcome::Reroute { .. } => 200,
    }
}

#[test]
fn the_registry_knows_each_type_once_and_sees_through_wrappers() {
    for (i, r) in REGISTRY.iter().enumerate() {
        assert!(
            REGISTRY[i + 1..].iter().all(|o| o.type_url != r.type_url),
            "{} registered twice",
            r.type_url
        );
    }
    assert_eq!(
        lookup(&abort_all()).map(|r| r.name),
        Some("envoy.filters.http.fault")
    );
    let wrapped = any(
        "type.googleapis.com/xds.type.v3.TypedStruct",
        telemetry::TypedStruct {
            type_url: "type.googleapis.com/stats.PluginConfig".into(),
        }
        .encode_to_vec(),
    );
    let r = lookup(&wrapped).expect("istio.stats through a TypedStruct");
    assert!(matches!(
        (r.translate)(&FilterDecl {
            name: "istio.stats",
            config: &wrapped,
            disabled: false
        }),
        Ok(Translated::IstioStats(_))
    ));
    assert!(lookup(&any("type.googleapis.com/some.Unknown", vec![])).is_none());
    // A fault config as JSON in a TypedStruct is refused rather than half read.
    let fault_json = any(
        "type.googleapis.com/udpa.type.v1.TypedStruct",
        telemetry::TypedStruct {
            type_url: fault::FAULT_TYPE.into(),
        }
        .encode_to_vec(),
    );
    let r = lookup(&fault_json).expect("registered by the type it names");
    let e = (r.translate)(&FilterDecl {
        name: "f",
        config: &fault_json,
        disabled: false,
    })
    .unwrap_err();
    assert!(e.contains("TypedStruct"), "{e}");
}

#[test]
fn a_filter_after_one_that_answered_never_runs() {
    let stats = fault::FaultStats::default();
    // [fault, limiter]: the aborts never reach the limiter.
    let filters = chain(&[("f", abort_all()), ("rl", two_tokens())]);
    let mut st = FilterState::default();
    for _ in 0..3 {
        assert_eq!(run_once(&filters, &mut st, &stats), 503);
    }
    let HttpFilter::LocalRateLimit(rl) = &filters[1] else {
        panic!("limiter second");
    };
    assert_eq!(rl.config.bucket.as_ref().map(|b| b.remaining()), Some(2));
    assert_eq!(st.active_faults, 3);
    st.release(&stats);
    assert_eq!(
        stats
            .active_faults
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );

    // [limiter, fault]: each request spends a token, then the limiter answers first.
    let filters = chain(&[("rl", two_tokens()), ("f", abort_all())]);
    let mut st = FilterState::default();
    let got: Vec<u16> = (0..3)
        .map(|_| run_once(&filters, &mut st, &stats))
        .collect();
    assert_eq!(got, [503, 503, 429]);
}

#[test]
fn metadata_is_kept_by_filter_namespace() {
    let mut st = FilterState::default();
    assert!(st.metadata("envoy.filters.http.jwt_authn").is_none());
    st.set_metadata(
        "envoy.filters.http.jwt_authn",
        "issuer-a".into(),
        serde_json::json!({"sub": "alice"}),
    );
    st.set_metadata(
        "envoy.filters.http.jwt_authn",
        "issuer-b".into(),
        serde_json::json!({"sub": "bob"}),
    );
    assert_eq!(
        st.metadata("envoy.filters.http.jwt_authn"),
        Some(&serde_json::json!({"issuer-a": {"sub": "alice"}, "issuer-b": {"sub": "bob"}}))
    );
}

#[test]
fn header_ops_set_append_and_remove() {
    let mut h = http::HeaderMap::new();
    h.append("x-a", HeaderValue::from_static("1"));
    h.append("x-a", HeaderValue::from_static("2"));
    h.insert("x-b", HeaderValue::from_static("b"));
    let name = |n: &'static str| HeaderName::from_static(n);
    for op in [
        HeaderOp::Set(name("x-a"), HeaderValue::from_static("3")),
        HeaderOp::Append(name("x-c"), HeaderValue::from_static("c1")),
        HeaderOp::Append(name("x-c"), HeaderValue::from_static("c2")),
        HeaderOp::Remove(name("x-b")),
    ] {
        op.apply(&mut h);
    }
    let all = |n: &str| {
        h.get_all(n)
            .iter()
            .map(|v| v.to_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(all("x-a"), ["3"]);
    assert_eq!(all("x-c"), ["c1", "c2"]);
    assert!(h.get("x-b").is_none());
}
