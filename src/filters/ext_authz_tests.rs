use super::*;

fn filter(yaml: &str) -> Result<ExtAuthzFilter, String> {
    let v: serde_json::Value = serde_yaml::from_str(yaml).expect("yaml");
    let c: pb::ExtAuthz = crate::protojson::dynamic_from_json(
        "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
        &v,
    )
    .expect("decode")
    .transcode_to()
    .expect("transcode");
    ExtAuthzFilter::translate("envoy.filters.http.ext_authz", &c)
}

#[test]
fn istiods_grpc_provider_translates() {
    let f = filter(
        r#"
transport_api_version: V3
status_on_error: {code: Forbidden}
failure_mode_allow: true
grpc_service:
  envoy_grpc: {cluster_name: "outbound|9000||authz.foo.svc.cluster.local", authority: authz.foo.svc.cluster.local}
  timeout: 2s
filter_enabled_metadata:
  filter: envoy.filters.http.rbac
  path: [{key: istio_ext_authz_shadow_effective_policy_id}]
  value: {string_match: {prefix: istio-ext-authz}}
"#,
    )
    .expect("translates");
    assert!(f.cfg.failure_mode_allow);
    assert_eq!(f.cfg.status_on_error, 403);
    match &f.cfg.service {
        Service::Grpc {
            cluster,
            authority,
            timeout,
            ..
        } => {
            assert_eq!(cluster, "outbound|9000||authz.foo.svc.cluster.local");
            assert_eq!(authority, "authz.foo.svc.cluster.local");
            assert_eq!(*timeout, Duration::from_secs(2));
        }
        other => panic!("{other:?}"),
    }
    assert!(f.cfg.enabled_metadata.is_some());
}

#[test]
fn what_cannot_be_honoured_is_refused_by_field() {
    for (yaml, field) in [
        ("transport_api_version: V3\nhttp_service: {server_uri: {uri: 'http://a', cluster: a, timeout: 1s}}\nwith_request_body: {max_request_bytes: 100000}\n", "with_request_body.max_request_bytes"),
        ("transport_api_version: V3\ngrpc_service: {google_grpc: {target_uri: a, stat_prefix: a}}\n", "google_grpc"),
        ("transport_api_version: V3\n", "one of grpc_service or http_service"),
        ("transport_api_version: V3\nhttp_service: {server_uri: {uri: 'http://a', cluster: a, timeout: 1s}}\nstatus_on_error: {code: 42}\n", "status_on_error"),
    ] {
        let e = filter(yaml).expect_err(yaml);
        assert!(e.contains(field), "{e}");
    }
}

fn ok_header(key: &str, value: &str, append: Option<bool>) -> corepb::HeaderValueOption {
    #[allow(deprecated)]
    corepb::HeaderValueOption {
        header: Some(corepb::HeaderValue {
            key: key.into(),
            value: value.into(),
            ..Default::default()
        }),
        append: append.map(|value| envoy_types::pb::google::protobuf::BoolValue { value }),
        ..Default::default()
    }
}

#[test]
fn grpc_answers_map_to_verdicts() {
    let ok = authpb::CheckResponse {
        status: Some(Default::default()),
        http_response: Some(authpb::check_response::HttpResponse::OkResponse(
            authpb::OkHttpResponse {
                headers: vec![
                    ok_header("x-user", "alice", None),
                    ok_header("x-tag", "t", Some(true)),
                ],
                headers_to_remove: vec!["authorization".into(), "host".into()],
                response_headers_to_add: vec![ok_header("x-seen", "1", None)],
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let Verdict::Ok(a) = check_response(ok, usize::MAX) else {
        panic!("not ok")
    };
    assert_eq!(
        a.request,
        vec![
            HeaderOp::Set(
                HeaderName::from_static("x-user"),
                HeaderValue::from_static("alice")
            ),
            HeaderOp::Append(
                HeaderName::from_static("x-tag"),
                HeaderValue::from_static("t")
            ),
            HeaderOp::Remove(HeaderName::from_static("authorization")),
        ]
    );
    assert_eq!(
        a.response,
        vec![HeaderOp::Append(
            HeaderName::from_static("x-seen"),
            HeaderValue::from_static("1")
        )]
    );

    let denied = authpb::CheckResponse {
        status: Some(envoy_types::pb::google::rpc::Status {
            code: 7,
            ..Default::default()
        }),
        http_response: Some(authpb::check_response::HttpResponse::DeniedResponse(
            authpb::DeniedHttpResponse {
                status: Some(envoy_types::pb::envoy::r#type::v3::HttpStatus { code: 401 }),
                headers: vec![ok_header("www-authenticate", "Bearer", None)],
                body: "no entry".into(),
            },
        )),
        ..Default::default()
    };
    match check_response(denied, 2) {
        Verdict::Denied {
            status,
            headers,
            body,
        } => {
            assert_eq!(status, 401);
            assert_eq!(headers[0].1, "Bearer");
            assert_eq!(&body[..], b"no");
        }
        other => panic!("{other:?}"),
    }
    let bare = authpb::CheckResponse {
        status: Some(envoy_types::pb::google::rpc::Status {
            code: 16,
            ..Default::default()
        }),
        ..Default::default()
    };
    assert!(matches!(
        check_response(bare, usize::MAX),
        Verdict::Denied { status: 403, .. }
    ));
}

#[test]
fn per_route_levels_merge() {
    let level = |disabled: bool, ext: &[(&str, &str)]| {
        vec![(
            "authz".to_string(),
            Arc::new(PerRoute {
                disabled,
                context_extensions: ext
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                no_body: false,
            }),
        )]
    };
    let route = level(false, &[("a", "route")]);
    let vh = level(false, &[("a", "vh"), ("b", "vh")]);
    let m = merge(&[&route, &vh, &[]]);
    assert_eq!(
        m[0].1.context_extensions,
        vec![
            ("a".to_string(), "route".to_string()),
            ("b".to_string(), "vh".to_string())
        ]
    );
    let off = level(true, &[]);
    assert!(merge(&[&off, &vh])[0].1.disabled);
}
