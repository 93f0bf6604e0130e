use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use envoy_types::pb::envoy::config::accesslog::v3 as apb;
use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::extensions::access_loggers::file::v3 as filepb;
use envoy_types::pb::google::protobuf::{value::Kind, Any, Struct, Value as PValue};
use prost::Message;

use super::format::{parse, Extensions, FormatError, TimeFormat};
use super::*;
use crate::telemetry::stream_info::{Protocol, ResponseFlag, UpstreamInfo};

const ISTIO_TEXT: &str = "[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %CONNECTION_TERMINATION_DETAILS% \"%UPSTREAM_TRANSPORT_FAILURE_REASON%\" %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \"%REQ(X-REQUEST-ID)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\" %UPSTREAM_CLUSTER_RAW% %UPSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_REMOTE_ADDRESS% %REQUESTED_SERVER_NAME% %ROUTE_NAME%\n";

fn info() -> StreamInfo {
    let mut i = StreamInfo::new(Protocol::Http11);
    // 2026-12-02T15:14:45.829920Z
    i.set_start_time(UNIX_EPOCH + Duration::new(1_796_224_485, 829_920_000));
    i.downstream_local = Some("127.0.0.1:18001".parse().unwrap());
    i.downstream_remote = Some("127.0.0.1:34832".parse().unwrap());
    i.downstream_direct_remote = i.downstream_remote;
    i.route_name = Some("r_ok".into());
    i.upstream = Some(Arc::new(UpstreamInfo {
        name: "up".into(),
        observability_name: "up-alt".into(),
        ..Default::default()
    }));
    i.upstream_host = Some("127.0.0.1:18002".parse().unwrap());
    i.upstream_local = Some("127.0.0.1:48144".parse().unwrap());
    i.response_code = 200;
    i.set_details("via_upstream");
    i.bytes_sent = 335;
    i.last_downstream_tx = Some(Duration::from_millis(14));
    i.last_downstream_rx = Some(Duration::from_millis(0));
    i.first_upstream_rx = Some(Duration::from_millis(13));
    i.attempts = 1;
    i
}

fn headers(pairs: &[(&str, &str)]) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            http::HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

fn with_ctx<R>(
    info: &StreamInfo,
    req: &http::HeaderMap,
    resp: &http::HeaderMap,
    f: impl FnOnce(&LogContext<'_>) -> R,
) -> R {
    let ctx = LogContext {
        info,
        request: Some(RequestView {
            host: "example.com",
            authority: "example.com:8080",
            path: "/ok?x=1",
            method: "GET",
            scheme: "http",
            headers: req,
        }),
        response: Some(resp),
        trailers: None,
        log_type: log_type::DOWNSTREAM_END,
    };
    f(&ctx)
}

fn text(format: &str, info: &StreamInfo) -> String {
    let pieces = parse(format, Extensions::default()).expect("valid format");
    let req = headers(&[("user-agent", "ua/1"), ("x-request-id", "rid-1")]);
    let resp = headers(&[("x-envoy-upstream-service-time", "12")]);
    with_ctx(info, &req, &resp, |ctx| {
        let mut s = String::new();
        format::write_text(&mut s, &pieces, ctx, "-");
        s
    })
}

#[test]
fn istio_text_format_renders_like_envoy() {
    assert_eq!(
        text(ISTIO_TEXT, &info()),
        "[2026-12-02T15:14:45.829Z] \"GET /ok?x=1 HTTP/1.1\" 200 - via_upstream - \"-\" 0 335 14 12 \"-\" \"ua/1\" \"rid-1\" \"example.com:8080\" \"127.0.0.1:18002\" up 127.0.0.1:48144 127.0.0.1:18001 127.0.0.1:34832 - r_ok\n"
    );
    let mut nr = StreamInfo::new(Protocol::Http11);
    nr.set_start_time(info().start_time());
    nr.response_code = 404;
    nr.flags.set(ResponseFlag::NoRouteFound);
    nr.set_details("route_not_found");
    nr.last_downstream_tx = Some(Duration::ZERO);
    assert_eq!(
        text("%RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_FLAGS_LONG% %RESPONSE_CODE_DETAILS% %UPSTREAM_HOST% %UPSTREAM_CLUSTER% %ROUTE_NAME% %DURATION% %RESPONSE_DURATION%", &nr),
        "404 NR NoRouteFound route_not_found - - - 0 -"
    );
}

#[test]
fn operators_and_lengths() {
    let i = info();
    assert_eq!(
        text("%UPSTREAM_CLUSTER% %UPSTREAM_CLUSTER_RAW% %REQ(USER-AGENT):2% %REQ(X-MISSING?USER-AGENT)% %REQ(HOST)% %RESP(:STATUS)% %TRAILER(grpc-status)%", &i),
        "up-alt up ua ua/1 example.com:8080 200 -"
    );
    assert_eq!(
        text("%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT% %DOWNSTREAM_LOCAL_PORT% %UPSTREAM_REQUEST_ATTEMPT_COUNT% %RESPONSE_TX_DURATION% %REQUEST_DURATION% 100%% %PROTOCOL%", &i),
        "127.0.0.1 18001 1 1 0 100% HTTP/1.1"
    );
    let mut uf = info();
    uf.upstream_transport_failure_reason = Some("delayed connect error: Connection refused".into());
    assert_eq!(
        text("%UPSTREAM_TRANSPORT_FAILURE_REASON%", &uf),
        "delayed_connect_error:_Connection_refused"
    );
    let mut tcp = info();
    tcp.protocol = Protocol::Tcp;
    let pieces = parse(
        "%PROTOCOL% %REQ(:METHOD)% %BYTES_SENT%",
        Extensions::default(),
    )
    .unwrap();
    let ctx = LogContext {
        info: &tcp,
        request: None,
        response: None,
        trailers: None,
        log_type: log_type::TCP_CONNECTION_END,
    };
    let mut s = String::new();
    format::write_text(&mut s, &pieces, &ctx, "-");
    assert_eq!(s, "- - 335");
}

#[test]
fn start_time_formats() {
    let t = info().start_time();
    let f = |s: &str| {
        let mut o = String::new();
        TimeFormat::parse(s).write(&mut o, t);
        o
    };
    assert_eq!(
        f("%s.%3f|%f|%6f|%9f|%Y-%m-%dT%H:%M:%S"),
        "1796224485.829|829920000|829920|829920000|2026-12-02T15:14:45"
    );
    assert_eq!(f("%a %b %e %j %z"), "Wed Dec  2 336 +0000");
    assert_eq!(f("%F %T"), "2026-12-02 15:14:45");
}

#[test]
fn refusals_use_envoys_messages() {
    let e = |s: &str| parse(s, Extensions::default()).unwrap_err().to_string();
    assert_eq!(e("%FOO_BAR%"), "Not supported field in StreamInfo: FOO_BAR");
    assert_eq!(e("%REQ%"), "REQ requires parameters");
    assert_eq!(
        e("%PROTOCOL(x)%"),
        "PROTOCOL does not take any parameters or length"
    );
    assert_eq!(
        e("%RESPONSE_CODE:3%"),
        "RESPONSE_CODE does not take any parameters or length"
    );
    assert_eq!(
        e("%REQ(A?B?C)%"),
        "More than 1 alternative header specified in token: A?B?C"
    );
    assert_eq!(
        e("100% x"),
        "Incorrect configuration: 100% x. Couldn't find valid command at position 3"
    );
    assert_eq!(
        e("%START_TIME:3%"),
        "START_TIME does not allow length to be specified."
    );
    assert!(matches!(
        parse("%REQ_WITHOUT_QUERY(:PATH)%", Extensions::default()),
        Err(FormatError::Unknown(_))
    ));
    assert!(parse(
        "%REQ_WITHOUT_QUERY(:PATH)%",
        Extensions {
            req_without_query: true
        }
    )
    .is_ok());
}

fn sval(s: &str) -> PValue {
    PValue {
        kind: Some(Kind::StringValue(s.into())),
    }
}

fn json(fields: &[(&str, PValue)], omit: bool, info: &StreamInfo) -> String {
    let s = Struct {
        fields: fields
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    };
    let node = JsonNode::from_struct(&s, Extensions::default()).expect("valid");
    let req = headers(&[("user-agent", "ua/1")]);
    let resp = headers(&[("x-envoy-upstream-service-time", "12")]);
    with_ctx(info, &req, &resp, |ctx| {
        let mut o = String::new();
        if !node.write(&mut o, ctx, omit) {
            o.push_str("{}");
        }
        o
    })
}

#[test]
fn json_keeps_types_and_sorts_keys() {
    let fields = [
        ("response_code", sval("%RESPONSE_CODE%")),
        ("bytes_sent", sval("%BYTES_SENT%")),
        (
            "upstream_service_time",
            sval("%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%"),
        ),
        ("xff", sval("%REQ(X-FORWARDED-FOR)%")),
        ("flags", sval("%RESPONSE_FLAGS%")),
        ("misc", sval("%RESPONSE_CODE% x %REQ(X-FORWARDED-FOR)%")),
        ("const", sval("plain")),
        (
            "n",
            PValue {
                kind: Some(Kind::NumberValue(2.0)),
            },
        ),
        (
            "f",
            PValue {
                kind: Some(Kind::NumberValue(1.5)),
            },
        ),
        (
            "nested",
            PValue {
                kind: Some(Kind::StructValue(Struct {
                    fields: [("ua".to_string(), sval("%REQ(USER-AGENT)%"))].into(),
                })),
            },
        ),
    ];
    assert_eq!(
        json(&fields, false, &info()),
        r#"{"bytes_sent":335,"const":"plain","f":"1.5","flags":"-","misc":"200 x -","n":2,"nested":{"ua":"ua/1"},"response_code":200,"upstream_service_time":"12","xff":null}"#
    );
    assert_eq!(
        json(&fields, true, &info()),
        r#"{"bytes_sent":335,"const":"plain","f":"1.5","flags":"-","misc":"200 x ","n":2,"nested":{"ua":"ua/1"},"response_code":200,"upstream_service_time":"12"}"#
    );
}

fn file_log(format: Option<filepb::file_access_log::AccessLogFormat>) -> apb::AccessLog {
    apb::AccessLog {
        name: "envoy.access_loggers.file".into(),
        filter: None,
        config_type: Some(apb::access_log::ConfigType::TypedConfig(Any {
            type_url: FILE_TYPE.into(),
            value: filepb::FileAccessLog {
                path: "/dev/null".into(),
                access_log_format: format,
            }
            .encode_to_vec(),
        })),
    }
}

#[test]
fn translation_of_loggers() {
    let l = AccessLog::translate(&file_log(None), "access_log[0]").expect("valid");
    assert_eq!(l.target, Target::Path("/dev/null".into()));
    let line = with_ctx(&info(), &headers(&[]), &headers(&[]), |c| l.line(c)).unwrap();
    assert!(line.starts_with("[2026-12-02T15:14:45.829Z] \"GET /ok?x=1 HTTP/1.1\" 200 - 0 335 14 - \"-\" \"-\" \"-\" \"example.com:8080\" \"127.0.0.1:18002\"\n"), "{line}");

    let bad = file_log(Some(filepb::file_access_log::AccessLogFormat::LogFormat(
        corepb::SubstitutionFormatString {
            format: Some(
                corepb::substitution_format_string::Format::TextFormatSource(corepb::DataSource {
                    specifier: Some(corepb::data_source::Specifier::InlineString(
                        "%NOPE%".into(),
                    )),
                    ..Default::default()
                }),
            ),
            ..Default::default()
        },
    )));
    assert_eq!(
        AccessLog::translate(&bad, "access_log[0]").unwrap_err(),
        "access_log[0].log_format.text_format_source: Not supported field in StreamInfo: NOPE"
    );

    let mut unknown = file_log(None);
    unknown.config_type = Some(apb::access_log::ConfigType::TypedConfig(Any {
        type_url: "type.googleapis.com/foo.Bar".into(),
        value: vec![],
    }));
    assert!(AccessLog::translate(&unknown, "access_log[0]")
        .unwrap_err()
        .contains("access_log[0].typed_config"));
}

#[test]
fn filters() {
    use apb::access_log_filter::FilterSpecifier as F;
    let status = |op: i32, v: u32| apb::AccessLogFilter {
        filter_specifier: Some(F::StatusCodeFilter(apb::StatusCodeFilter {
            comparison: Some(apb::ComparisonFilter {
                op,
                value: Some(corepb::RuntimeUInt32 {
                    default_value: v,
                    runtime_key: "k".into(),
                }),
            }),
        })),
    };
    let flags = |f: &[&str]| apb::AccessLogFilter {
        filter_specifier: Some(F::ResponseFlagFilter(apb::ResponseFlagFilter {
            flags: f.iter().map(|s| s.to_string()).collect(),
        })),
    };
    let mut i = info();
    let eval = |f: &apb::AccessLogFilter, i: &StreamInfo| {
        let f = filter::Filter::translate(f, "filter").expect("valid");
        with_ctx(i, &headers(&[]), &headers(&[]), |c| f.evaluate(c))
    };
    assert!(eval(&status(1, 200), &i)); // GE 200
    assert!(!eval(&status(1, 400), &i));
    assert!(!eval(&flags(&[]), &i));
    i.flags.set(ResponseFlag::NoHealthyUpstream);
    assert!(eval(&flags(&[]), &i));
    assert!(eval(&flags(&["UF", "UH"]), &i));
    assert!(!eval(&flags(&["NR"]), &i));
    let or = apb::AccessLogFilter {
        filter_specifier: Some(F::OrFilter(apb::OrFilter {
            filters: vec![status(1, 500), flags(&["UH"])],
        })),
    };
    assert!(eval(&or, &i));
    // runtime_filter: 50% of requests, chosen by the x-request-id's first 8 hex digits.
    let runtime = apb::AccessLogFilter {
        filter_specifier: Some(F::RuntimeFilter(apb::RuntimeFilter {
            runtime_key: "k".into(),
            percent_sampled: Some(envoy_types::pb::envoy::r#type::v3::FractionalPercent {
                numerator: 50,
                denominator: 0,
            }),
            use_independent_randomness: false,
        })),
    };
    let f = filter::Filter::translate(&runtime, "filter").expect("valid");
    // 0x00000031 % 100 = 49: in; 0x00000032 % 100 = 50: out.
    for (id, logged) in [("00000031-aaaa", true), ("00000032-aaaa", false)] {
        let req = headers(&[("x-request-id", id)]);
        assert_eq!(
            with_ctx(&i, &req, &headers(&[]), |c| f.evaluate(c)),
            logged,
            "{id}"
        );
    }
    let bad = filter::Filter::translate(&flags(&["XX"]), "filter").unwrap_err();
    assert_eq!(
        bad,
        "filter.response_flag_filter.flags: unknown response flag 'XX'"
    );
}

#[test]
fn writers_are_shared_flushed_and_reopened() {
    let dir = std::env::temp_dir().join(format!("portico-alog-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("a.log");
    let p = path.to_str().unwrap();
    let w = sink::writer(p);
    // One writer per path, whoever asks.
    assert!(Arc::ptr_eq(&w, &sink::writer(p)));
    w.write(b"one\n");
    sink::flush_all(Duration::from_secs(5));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "one\n");
    // Log rotation: the file is moved away, SIGUSR1 reopens the path.
    let rotated = dir.join("a.log.1");
    std::fs::rename(&path, &rotated).unwrap();
    sink::reopen_all();
    w.write(b"two\n");
    sink::flush_all(Duration::from_secs(5));
    assert_eq!(std::fs::read_to_string(&rotated).unwrap(), "one\n");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "two\n");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[allow(deprecated)]
fn unmatched_connections_log_nr() {
    let dir = std::env::temp_dir().join(format!("portico-alog-nr-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("l.log");
    let mut a = file_log(Some(filepb::file_access_log::AccessLogFormat::Format(
        "%RESPONSE_FLAGS% %PROTOCOL% %DOWNSTREAM_REMOTE_ADDRESS% %REQUESTED_SERVER_NAME%\n".into(),
    )));
    if let Some(apb::access_log::ConfigType::TypedConfig(any)) = &mut a.config_type {
        let mut f = filepb::FileAccessLog::decode(any.value.as_slice()).unwrap();
        f.path = path.to_str().unwrap().into();
        any.value = f.encode_to_vec();
    }
    let logs = AccessLogs::translate(&[a], "access_log").expect("valid");
    log_unmatched(
        &logs,
        "127.0.0.1:5555".parse().unwrap(),
        None,
        "sni.example",
    );
    sink::flush_all(Duration::from_secs(5));
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "NR - 127.0.0.1:5555 sni.example\n"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn header_and_grpc_filters() {
    use apb::access_log_filter::FilterSpecifier as F;
    use envoy_types::pb::envoy::config::route::v3 as rpb;
    let present = |name: &str, present: bool| apb::AccessLogFilter {
        filter_specifier: Some(F::HeaderFilter(apb::HeaderFilter {
            header: Some(rpb::HeaderMatcher {
                name: name.into(),
                header_match_specifier: Some(
                    rpb::header_matcher::HeaderMatchSpecifier::PresentMatch(present),
                ),
                ..Default::default()
            }),
        })),
    };
    let i = info();
    let req = headers(&[("x-debug", "1")]);
    let eval = |f: &apb::AccessLogFilter, ctx: &LogContext<'_>| {
        filter::Filter::translate(f, "filter")
            .expect("valid")
            .evaluate(ctx)
    };
    with_ctx(&i, &req, &headers(&[]), |c| {
        assert!(eval(&present("x-debug", true), c));
        assert!(!eval(&present("x-other", true), c));
    });
    let tcp = LogContext {
        info: &i,
        request: None,
        response: None,
        trailers: None,
        log_type: log_type::TCP_CONNECTION_END,
    };
    // A connection has an empty header map: only "absent" matches.
    assert!(eval(&present("x-debug", false), &tcp));
    assert!(!eval(&present("x-debug", true), &tcp));

    let grpc = |statuses: &[i32], exclude: bool| apb::AccessLogFilter {
        filter_specifier: Some(F::GrpcStatusFilter(apb::GrpcStatusFilter {
            statuses: statuses.to_vec(),
            exclude,
        })),
    };
    let mut unavailable = info();
    unavailable.response_code = 503;
    // No grpc-status anywhere: mapped from the HTTP status (503: Unavailable, 14).
    with_ctx(&unavailable, &req, &headers(&[]), |c| {
        assert!(eval(&grpc(&[14], false), c));
        assert!(!eval(&grpc(&[14], true), c));
    });
    with_ctx(&i, &req, &headers(&[("grpc-status", "5")]), |c| {
        assert!(eval(&grpc(&[5], false), c));
    });
}
