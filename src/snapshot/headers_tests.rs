use super::*;
use corepb::header_value_option::HeaderAppendAction as A;
use envoy_types::pb::google::protobuf::BoolValue;

fn hvo(key: &str, value: &str) -> corepb::HeaderValueOption {
    corepb::HeaderValueOption {
        header: Some(corepb::HeaderValue {
            key: key.into(),
            value: value.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn with_action(mut h: corepb::HeaderValueOption, a: A) -> corepb::HeaderValueOption {
    h.append_action = a as i32;
    h
}

#[allow(deprecated)]
fn with_append(mut h: corepb::HeaderValueOption, append: bool) -> corepb::HeaderValueOption {
    h.append = Some(BoolValue { value: append });
    h
}

fn ops(add: Vec<corepb::HeaderValueOption>, remove: &[&str]) -> HeaderOps {
    let remove: Vec<String> = remove.iter().map(|s| s.to_string()).collect();
    HeaderOps::translate("request", &add, &remove).expect("valid header ops")
}

fn err(add: Vec<corepb::HeaderValueOption>, remove: &[&str]) -> String {
    let remove: Vec<String> = remove.iter().map(|s| s.to_string()).collect();
    HeaderOps::translate("request", &add, &remove).expect_err("must be rejected")
}

fn map(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut m = HeaderMap::new();
    for (k, v) in pairs {
        m.append(
            HeaderName::from_bytes(k.as_bytes()).expect("name"),
            HeaderValue::from_str(v).expect("value"),
        );
    }
    m
}

fn all(m: &HeaderMap, name: &str) -> Vec<String> {
    m.get_all(name)
        .iter()
        .map(|v| v.to_str().expect("ascii").to_string())
        .collect()
}

fn request(path: &str, pairs: &[(&str, &str)]) -> RequestHeader {
    let mut r = RequestHeader::build("GET", path.as_bytes(), None).expect("request");
    for (k, v) in pairs {
        r.append_header(k.to_string(), *v).expect("header");
    }
    r
}

#[test]
fn append_actions_behave_like_envoy() {
    let o = ops(
        vec![
            hvo("x-append", "new"),
            with_action(hvo("x-absent", "new"), A::AddIfAbsent),
            with_action(hvo("x-absent-missing", "new"), A::AddIfAbsent),
            with_action(hvo("x-over", "new"), A::OverwriteIfExistsOrAdd),
            with_action(hvo("x-over-missing", "new"), A::OverwriteIfExistsOrAdd),
            with_action(hvo("x-if-exists", "new"), A::OverwriteIfExists),
            with_action(hvo("x-if-exists-missing", "new"), A::OverwriteIfExists),
        ],
        &[],
    );
    let mut m = map(&[
        ("x-append", "old"),
        ("x-absent", "old"),
        ("x-over", "old1"),
        ("x-over", "old2"),
        ("x-if-exists", "old"),
    ]);
    o.apply(&mut m, None, &FormatCtx::default());
    assert_eq!(all(&m, "x-append"), ["old", "new"]);
    assert_eq!(all(&m, "x-absent"), ["old"]);
    assert_eq!(all(&m, "x-absent-missing"), ["new"]);
    assert_eq!(all(&m, "x-over"), ["new"]);
    assert_eq!(all(&m, "x-over-missing"), ["new"]);
    assert_eq!(all(&m, "x-if-exists"), ["new"]);
    assert!(all(&m, "x-if-exists-missing").is_empty());
}

#[test]
fn deprecated_append_maps_to_actions() {
    let o = ops(
        vec![
            with_append(hvo("x-a", "1"), true),
            with_append(hvo("x-b", "1"), false),
        ],
        &[],
    );
    assert_eq!(o.add[0].action, AppendAction::AppendIfExistsOrAdd);
    assert_eq!(o.add[1].action, AppendAction::OverwriteIfExistsOrAdd);
    // `append` next to the default action is fine; next to any other it is rejected.
    let e = err(
        vec![with_action(
            with_append(hvo("x-a", "1"), true),
            A::AddIfAbsent,
        )],
        &[],
    );
    assert_eq!(
        e,
        "request_headers_to_add[0] 'x-a': Both append and append_action are set and it's not allowed"
    );
}

#[test]
fn removal_comes_before_additions_and_checks_see_it() {
    let o = ops(
        vec![
            with_action(hvo("x-gone", "added"), A::AddIfAbsent),
            with_action(hvo("x-keep", "x"), A::OverwriteIfExists),
        ],
        &["x-gone", "x-keep"],
    );
    let mut m = map(&[("x-gone", "old"), ("x-keep", "old")]);
    o.apply(&mut m, None, &FormatCtx::default());
    assert_eq!(all(&m, "x-gone"), ["added"]);
    assert!(all(&m, "x-keep").is_empty());
}

#[test]
fn overwrites_apply_before_appends_and_last_overwrite_wins() {
    let o = ops(
        vec![
            hvo("x-h", "appended"),
            with_action(hvo("x-h", "first"), A::OverwriteIfExistsOrAdd),
            with_action(hvo("x-h", "second"), A::OverwriteIfExistsOrAdd),
        ],
        &[],
    );
    let mut m = map(&[("x-h", "old")]);
    o.apply(&mut m, None, &FormatCtx::default());
    assert_eq!(all(&m, "x-h"), ["second", "appended"]);
}

#[test]
fn empty_values_are_skipped_unless_kept() {
    let mut keep = hvo("x-kept", "");
    keep.keep_empty_value = true;
    let mut keep_dyn = hvo("x-kept-dyn", "%REQ(x-missing)%");
    keep_dyn.keep_empty_value = true;
    let o = ops(
        vec![
            hvo("x-empty", ""),
            keep,
            hvo("x-dyn", "%REQ(x-missing)%"),
            keep_dyn,
        ],
        &[],
    );
    // The fixed empty value without keep_empty_value is dropped at translation.
    assert_eq!(o.add.len(), 3);
    let req = request("/", &[]);
    let mut m = HeaderMap::new();
    o.apply(&mut m, Some(&req), &FormatCtx::default());
    assert!(!m.contains_key("x-empty"));
    assert_eq!(all(&m, "x-kept"), [""]);
    assert!(!m.contains_key("x-dyn"));
    assert_eq!(all(&m, "x-kept-dyn"), [""]);
}

#[test]
fn formatters_render_request_and_addresses() {
    let o = ops(
        vec![
            hvo("x-remote", "%DOWNSTREAM_REMOTE_ADDRESS%"),
            hvo("x-remote-ip", "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"),
            hvo("x-remote-port", "%DOWNSTREAM_REMOTE_PORT%"),
            hvo(
                "x-direct",
                "%DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT%",
            ),
            hvo("x-local", "%DOWNSTREAM_LOCAL_ADDRESS%"),
            hvo("x-local-port", "%DOWNSTREAM_LOCAL_PORT%"),
            hvo("x-proto", "%PROTOCOL%"),
            hvo("x-req", "v=%REQ(x-in)%;"),
            hvo("x-alt", "%REQ(x-missing?x-in)%"),
            hvo("x-trunc", "%REQ(x-in):3%"),
            hvo("x-path", "%REQ(:PATH)% %REQ(:METHOD)% %REQ(:AUTHORITY)%"),
            hvo("x-pct", "100%% %REQ(x-in)%%%"),
        ],
        &[],
    );
    let ctx = FormatCtx {
        remote: Some("10.1.2.3:4567".parse().expect("addr")),
        direct_remote: Some("[::1]:80".parse().expect("addr")),
        local: Some("127.0.0.1:8080".parse().expect("addr")),
    };
    let mut req = request("/p?q=1", &[("x-in", "hello"), ("host", "example.com")]);
    o.apply(&mut req, None, &ctx);
    let h = |n: &str| {
        req.headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    assert_eq!(h("x-remote").as_deref(), Some("10.1.2.3:4567"));
    assert_eq!(h("x-remote-ip").as_deref(), Some("10.1.2.3"));
    assert_eq!(h("x-remote-port").as_deref(), Some("4567"));
    assert_eq!(h("x-direct").as_deref(), Some("::1"));
    assert_eq!(h("x-local").as_deref(), Some("127.0.0.1:8080"));
    assert_eq!(h("x-local-port").as_deref(), Some("8080"));
    assert_eq!(h("x-proto").as_deref(), Some("HTTP/1.1"));
    assert_eq!(h("x-req").as_deref(), Some("v=hello;"));
    assert_eq!(h("x-alt").as_deref(), Some("hello"));
    assert_eq!(h("x-trunc").as_deref(), Some("hel"));
    assert_eq!(h("x-path").as_deref(), Some("/p?q=1 GET example.com"));
    assert_eq!(h("x-pct").as_deref(), Some("100% hello%"));
}

#[test]
fn request_formatters_read_headers_before_this_levels_additions() {
    let o = ops(
        vec![
            with_action(hvo("x-a", "new"), A::OverwriteIfExistsOrAdd),
            hvo("x-copy", "%REQ(x-a)%"),
        ],
        &[],
    );
    let mut req = request("/", &[("x-a", "old")]);
    o.apply(&mut req, None, &FormatCtx::default());
    assert_eq!(all(&req.headers, "x-a"), ["new"]);
    assert_eq!(all(&req.headers, "x-copy"), ["old"]);
}

#[test]
fn format_grammar_matches_envoys() {
    assert_eq!(
        parse_format("a%%b").expect("ok"),
        [Part::Literal("a%b".into())]
    );
    assert_eq!(
        parse_format("x%PROTOCOL%y").expect("ok"),
        [
            Part::Literal("x".into()),
            Part::Command(Command::Protocol),
            Part::Literal("y".into())
        ]
    );
    let no_cmd = |f: &str, pos: usize| HeaderError::NoCommand {
        format: f.into(),
        pos,
    };
    assert_eq!(parse_format("50%"), Err(no_cmd("50%", 2)));
    assert_eq!(parse_format("%protocol%"), Err(no_cmd("%protocol%", 0)));
    assert_eq!(parse_format("%REQ(x%"), Err(no_cmd("%REQ(x%", 0)));
    assert_eq!(parse_format("a %PROTOCOL"), Err(no_cmd("a %PROTOCOL", 2)));
    assert_eq!(
        parse_format("%NOPE%"),
        Err(HeaderError::UnknownCommand("NOPE".into()))
    );
    assert_eq!(
        parse_format("%START_TIME%"),
        Err(HeaderError::Unsupported("START_TIME".into()))
    );
    assert_eq!(
        parse_format("%REQ%"),
        Err(HeaderError::ParamsRequired("REQ".into()))
    );
    assert_eq!(
        parse_format("%REQ()%"),
        Err(HeaderError::ParamsRequired("REQ".into()))
    );
    assert_eq!(
        parse_format("%PROTOCOL(x)%"),
        Err(HeaderError::NoParams("PROTOCOL".into()))
    );
    assert_eq!(
        parse_format("%DOWNSTREAM_REMOTE_ADDRESS:10%"),
        Err(HeaderError::NoParams("DOWNSTREAM_REMOTE_ADDRESS".into()))
    );
    assert_eq!(
        parse_format("%REQ(a?b?c)%"),
        Err(HeaderError::TooManyAlternatives("a?b?c".into()))
    );
}

#[test]
fn rejections_name_field_and_header() {
    assert_eq!(
        err(vec![hvo(":path", "/x")], &[]),
        "request_headers_to_add[0] ':path': :-prefixed or host headers may not be modified"
    );
    assert_eq!(
        err(vec![hvo("Host", "x")], &[]),
        "request_headers_to_add[0] 'Host': :-prefixed or host headers may not be modified"
    );
    assert_eq!(
        err(vec![], &["host"]),
        "request_headers_to_remove[0] 'host': :-prefixed or host headers may not be removed"
    );
    assert_eq!(
        err(vec![], &[":authority"]),
        "request_headers_to_remove[0] ':authority': :-prefixed or host headers may not be removed"
    );
    assert_eq!(
        err(vec![], &[""]),
        "request_headers_to_remove[0] '': header name must not be empty"
    );
    assert_eq!(
        err(vec![hvo("", "v")], &[]),
        "request_headers_to_add[0] '': header name must not be empty"
    );
    assert_eq!(
        err(vec![hvo("bad name", "v")], &[]),
        "request_headers_to_add[0] 'bad name': invalid header name 'bad name'"
    );
    assert_eq!(
        err(vec![hvo("x-a", "line\nbreak")], &[]),
        "request_headers_to_add[0] 'x-a': 'x-a': invalid header value characters"
    );
    assert_eq!(
        err(vec![hvo("x-a", "ok"), hvo("x-b", "%BOGUS%")], &[]),
        "request_headers_to_add[1] 'x-b': Not supported field in StreamInfo: BOGUS"
    );
    let mut both = hvo("x-a", "v");
    if let Some(h) = both.header.as_mut() {
        h.raw_value = b"raw".to_vec();
    }
    assert_eq!(
        err(vec![both], &[]),
        "request_headers_to_add[0] 'x-a': 'x-a': only one of value or raw_value can be set"
    );
    let mut bad_action = hvo("x-a", "v");
    bad_action.append_action = 9;
    assert_eq!(
        err(vec![bad_action], &[]),
        "request_headers_to_add[0] 'x-a': unknown append_action 9"
    );
}

#[test]
fn raw_value_is_used_when_value_is_empty() {
    let mut h = hvo("x-raw", "");
    if let Some(v) = h.header.as_mut() {
        v.raw_value = b"bytes".to_vec();
    }
    let o = ops(vec![h], &[]);
    let mut m = HeaderMap::new();
    o.apply(&mut m, None, &FormatCtx::default());
    assert_eq!(all(&m, "x-raw"), ["bytes"]);
}

#[test]
fn plan_order_follows_most_specific_header_mutations_wins() {
    let mk = |v: &str| {
        Some(Arc::new(ops(
            vec![with_action(hvo("x-level", v), A::OverwriteIfExistsOrAdd)],
            &[],
        )))
    };
    let (rc, vh, rt) = (mk("rc"), mk("vh"), mk("route"));
    let run = |most_specific: bool| {
        let levels = [
            (rc.clone(), rc.clone()),
            (vh.clone(), vh.clone()),
            (rt.clone(), rt.clone()),
        ];
        let plan = HeaderPlan::build([&levels[0], &levels[1], &levels[2]], most_specific);
        let mut m = HeaderMap::new();
        for o in &plan.request {
            o.apply(&mut m, None, &FormatCtx::default());
        }
        all(&m, "x-level")
    };
    // By default the route config's value is applied last and wins.
    assert_eq!(run(false), ["rc"]);
    assert_eq!(run(true), ["route"]);
}
