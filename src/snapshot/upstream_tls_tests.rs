use super::*;
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher::MatchPattern, StringMatcher};
use envoy_types::pb::google::protobuf::{Any, Struct};

fn ca() -> (rcgen::Certificate, rcgen::KeyPair) {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    (p.self_signed(&key).expect("ca"), key)
}

fn pem_source(s: &str) -> Option<corepb::DataSource> {
    Some(corepb::DataSource {
        specifier: Some(corepb::data_source::Specifier::InlineString(s.into())),
        ..Default::default()
    })
}

fn tls(ctx: tlspb::UpstreamTlsContext) -> corepb::TransportSocket {
    corepb::TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(corepb::transport_socket::ConfigType::TypedConfig(Any {
            type_url: UPSTREAM_TLS_TYPE.into(),
            value: ctx.encode_to_vec(),
        })),
    }
}

fn with_validation(vc: tlspb::CertificateValidationContext) -> tlspb::UpstreamTlsContext {
    tlspb::UpstreamTlsContext {
        common_tls_context: Some(tlspb::CommonTlsContext {
            validation_context_type: Some(
                tlspb::common_tls_context::ValidationContextType::ValidationContext(vc),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn cluster(ts: corepb::TransportSocket) -> cpb::Cluster {
    cpb::Cluster {
        name: "c".into(),
        transport_socket: Some(ts),
        ..Default::default()
    }
}

fn translate(ctx: tlspb::UpstreamTlsContext) -> Result<TransportSockets, String> {
    TransportSockets::translate(&cluster(tls(ctx)), false, &NoFiles)
}

fn rejected(ctx: tlspb::UpstreamTlsContext, needle: &str) {
    match translate(ctx) {
        Ok(t) => panic!("expected a rejection mentioning {needle:?}, got {t:?}"),
        Err(e) => assert!(e.contains(needle), "{e:?} does not mention {needle:?}"),
    }
}

fn exact(s: &str) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(MatchPattern::Exact(s.into())),
        ignore_case: false,
    }
}

#[test]
fn sni_empty_means_none_and_alpn_falls_back_to_the_cluster_protocol() {
    let t = translate(Default::default()).expect("ok");
    let s = t.default.expect("tls");
    assert!(s.sni.is_none());
    assert_eq!(
        s.config.as_ref().expect("built").alpn_protocols,
        vec![b"http/1.1".to_vec()]
    );
    let h2 =
        TransportSockets::translate(&cluster(tls(Default::default())), true, &NoFiles).expect("ok");
    let s2 = h2.default.expect("tls");
    assert_eq!(
        s2.config.as_ref().expect("built").alpn_protocols,
        vec![b"h2".to_vec()]
    );
    // Different sockets never share pooled connections.
    assert_ne!(s.group_key, s2.group_key);
    let t = translate(tlspb::UpstreamTlsContext {
        sni: "api.example".into(),
        common_tls_context: Some(tlspb::CommonTlsContext {
            alpn_protocols: vec!["h2".into(), "http/1.1".into()],
            ..Default::default()
        }),
        ..Default::default()
    })
    .expect("ok");
    let s = t.default.expect("tls");
    assert_eq!(
        s.sni.as_ref().map(|n| n.to_str().into_owned()),
        Some("api.example".into())
    );
    assert_eq!(
        s.config.as_ref().expect("built").alpn_protocols,
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    );
}

#[test]
fn equal_configs_compare_equal() {
    let a = translate(Default::default()).expect("ok");
    let b = translate(Default::default()).expect("ok");
    assert_eq!(a, b);
    let c = translate(tlspb::UpstreamTlsContext {
        sni: "x.example".into(),
        ..Default::default()
    })
    .expect("ok");
    assert_ne!(a, c);
}

#[test]
fn trusted_ca_and_san_matchers_are_built() {
    let (ca, _) = ca();
    let t = translate(with_validation(tlspb::CertificateValidationContext {
        trusted_ca: pem_source(&ca.pem()),
        match_typed_subject_alt_names: vec![tlspb::SubjectAltNameMatcher {
            san_type: tlspb::subject_alt_name_matcher::SanType::Uri as i32,
            matcher: Some(exact("spiffe://td/ns/a/sa/b")),
            ..Default::default()
        }],
        ..Default::default()
    }));
    assert!(t.expect("ok").default.is_some());
}

#[test]
fn rejections_name_the_field() {
    let (ca, _) = ca();
    let vc = |f: &dyn Fn(&mut tlspb::CertificateValidationContext)| {
        let mut v = tlspb::CertificateValidationContext {
            trusted_ca: pem_source(&ca.pem()),
            ..Default::default()
        };
        f(&mut v);
        with_validation(v)
    };
    rejected(
        vc(&|v| v.trusted_ca = pem_source("not pem")),
        "validation_context.trusted_ca: no certificate found",
    );
    rejected(
        vc(&|v| {
            v.trusted_ca = Some(corepb::DataSource {
                specifier: Some(corepb::data_source::Specifier::Filename(
                    "/nonexistent/ca.pem".into(),
                )),
                ..Default::default()
            })
        }),
        "validation_context.trusted_ca: cannot read file '/nonexistent/ca.pem'",
    );
    rejected(
        vc(&|v| v.verify_certificate_spki = vec!["x".into()]),
        "validation_context.verify_certificate_spki[0]: Invalid base64-encoded SHA-256 x",
    );
    rejected(
        vc(&|v| v.verify_certificate_hash = vec!["x".into()]),
        "validation_context.verify_certificate_hash[0]: Invalid hex-encoded SHA-256 x",
    );
    rejected(
        vc(&|v| v.crl = pem_source("x")),
        "validation_context.crl is not supported",
    );
    rejected(
        vc(&|v| v.allow_expired_certificate = true),
        "validation_context.allow_expired_certificate is not supported",
    );
    rejected(
        vc(&|v| v.trust_chain_verification = 1),
        "validation_context.trust_chain_verification is not supported",
    );
    rejected(
        vc(&|v| {
            v.max_verify_depth = Some(envoy_types::pb::google::protobuf::UInt32Value { value: 3 })
        }),
        "validation_context.max_verify_depth is not supported",
    );
    rejected(
        vc(&|v| {
            v.match_typed_subject_alt_names = vec![tlspb::SubjectAltNameMatcher {
                san_type: tlspb::subject_alt_name_matcher::SanType::OtherName as i32,
                matcher: Some(exact("x")),
                ..Default::default()
            }]
        }),
        "match_typed_subject_alt_names[0]: san_type OTHER_NAME is not supported",
    );
    rejected(
        vc(&|v| {
            v.match_typed_subject_alt_names = vec![tlspb::SubjectAltNameMatcher {
                san_type: 0,
                matcher: Some(exact("x")),
                ..Default::default()
            }]
        }),
        "match_typed_subject_alt_names[0]: san_type must be set",
    );
    rejected(
        vc(&|v| {
            v.match_typed_subject_alt_names = vec![tlspb::SubjectAltNameMatcher {
                san_type: tlspb::subject_alt_name_matcher::SanType::Dns as i32,
                matcher: Some(StringMatcher {
                    match_pattern: Some(MatchPattern::Prefix(String::new())),
                    ignore_case: false,
                }),
                ..Default::default()
            }]
        }),
        "match_typed_subject_alt_names[0]: string matcher",
    );
    #[allow(deprecated)]
    rejected(
        vc(&|v| {
            v.trusted_ca = None;
            v.match_subject_alt_names = vec![exact("x")];
        }),
        "SAN-based verification of peer certificates without trusted CA is insecure and not allowed",
    );
    let common = |f: &dyn Fn(&mut tlspb::CommonTlsContext)| {
        let mut c = tlspb::CommonTlsContext::default();
        f(&mut c);
        tlspb::UpstreamTlsContext {
            common_tls_context: Some(c),
            ..Default::default()
        }
    };
    rejected(
        common(&|c| {
            c.tls_certificate_sds_secret_configs = vec![tlspb::SdsSecretConfig {
                name: "default".into(),
                ..Default::default()
            }]
        }),
        "common_tls_context.tls_certificate_sds_secret_configs[0].sds_config: is required",
    );
    rejected(
        common(&|c| {
            c.validation_context_type = Some(
                tlspb::common_tls_context::ValidationContextType::ValidationContextSdsSecretConfig(
                    Default::default(),
                ),
            )
        }),
        "common_tls_context.validation_context_sds_secret_config: name is required",
    );
    rejected(
        common(&|c| {
            c.validation_context_type = Some(
                tlspb::common_tls_context::ValidationContextType::CombinedValidationContext(
                    Default::default(),
                ),
            )
        }),
        "common_tls_context.combined_validation_context.default_validation_context: is required",
    );
    rejected(
        common(&|c| c.tls_certificates = vec![Default::default(), Default::default()]),
        "Multiple TLS certificates are not supported for client contexts",
    );
    rejected(
        common(&|c| {
            c.tls_certificates = vec![tlspb::TlsCertificate {
                certificate_chain: pem_source("nope"),
                private_key: pem_source("nope"),
                ..Default::default()
            }]
        }),
        "tls_certificates[0]: certificate_chain: no certificate found",
    );
    rejected(
        common(&|c| {
            c.tls_params = Some(tlspb::TlsParameters {
                tls_minimum_protocol_version: tlspb::tls_parameters::TlsProtocol::TlSv13 as i32,
                tls_maximum_protocol_version: tlspb::tls_parameters::TlsProtocol::TlSv12 as i32,
                ..Default::default()
            })
        }),
        "tls_params: tls_minimum_protocol_version is above tls_maximum_protocol_version",
    );
    rejected(
        common(&|c| {
            c.tls_params = Some(tlspb::TlsParameters {
                ecdh_curves: vec!["secp256k1".into()],
                ..Default::default()
            })
        }),
        "tls_params.ecdh_curves[0]: 'secp256k1' is not a known curve",
    );
    rejected(
        common(&|c| c.key_log = Some(Default::default())),
        "key_log is not supported",
    );
    rejected(
        tlspb::UpstreamTlsContext {
            allow_renegotiation: true,
            ..Default::default()
        },
        "allow_renegotiation is not supported",
    );
    rejected(
        tlspb::UpstreamTlsContext {
            auto_host_sni: true,
            ..Default::default()
        },
        "auto_host_sni is not supported yet",
    );
    rejected(
        tlspb::UpstreamTlsContext {
            auto_sni_san_validation: true,
            ..Default::default()
        },
        "auto_sni_san_validation is not supported yet",
    );
    let bad = corepb::TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(corepb::transport_socket::ConfigType::TypedConfig(Any {
            type_url: UPSTREAM_TLS_TYPE.into(),
            value: vec![0xff, 0xff],
        })),
    };
    let e = TransportSockets::translate(&cluster(bad), false, &NoFiles).expect_err("bad bytes");
    assert!(e.contains("typed_config: cannot decode"), "{e}");
    let e = TransportSockets::translate(
        &cpb::Cluster {
            transport_socket_matcher: Some(Default::default()),
            ..Default::default()
        },
        false,
        &NoFiles,
    )
    .expect_err("matcher");
    assert!(
        e.contains("transport_socket_matcher is not supported yet"),
        "{e}"
    );
}

#[test]
fn versions_default_to_tls12_for_clients() {
    let t = translate(Default::default()).expect("ok");
    let s = t.default.expect("tls");
    // The config offers only what the version list allows; rustls exposes it through the
    // provider's suites, so check the builder accepted TLS 1.2 alone.
    assert!(s
        .config
        .as_ref()
        .expect("built")
        .crypto_provider()
        .cipher_suites
        .iter()
        .any(|c| c.version() == &rustls::version::TLS12));
    let v = super::super::tls::protocol_versions(None, 2).expect("ok");
    assert_eq!(v, vec![&rustls::version::TLS12]);
}

fn label_struct(pairs: &[(&str, &str)]) -> Struct {
    Struct {
        fields: pairs
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    Value {
                        kind: Some(Kind::StringValue(v.to_string())),
                    },
                )
            })
            .collect(),
    }
}

fn meta(pairs: &[(&str, &str)]) -> corepb::Metadata {
    let mut m = corepb::Metadata::default();
    m.filter_metadata
        .insert(MATCH_KEY.into(), label_struct(pairs));
    m
}

#[test]
fn matches_pick_by_endpoint_then_locality_metadata() {
    let c = cpb::Cluster {
        name: "c".into(),
        transport_socket_matches: vec![
            cpb::cluster::TransportSocketMatch {
                name: "istio".into(),
                r#match: Some(label_struct(&[("tlsMode", "istio")])),
                transport_socket: Some(tls(Default::default())),
            },
            cpb::cluster::TransportSocketMatch {
                name: "plain".into(),
                r#match: Some(label_struct(&[("tlsMode", "disabled")])),
                transport_socket: None,
            },
        ],
        ..Default::default()
    };
    let t = TransportSockets::translate(&c, false, &NoFiles).expect("ok");
    let l = |e: Option<&[(&str, &str)]>, loc: Option<&[(&str, &str)]>| SocketLabels {
        endpoint: e.and_then(|p| labels(Some(&meta(p)))),
        locality: loc.and_then(|p| labels(Some(&meta(p)))),
    };
    assert_eq!(t.pick(None), 0);
    assert_eq!(t.pick(Some(&l(Some(&[("tlsMode", "istio")]), None))), 1);
    assert!(t.get(1).is_some());
    assert_eq!(t.pick(Some(&l(Some(&[("tlsMode", "disabled")]), None))), 2);
    assert!(t.get(2).is_none());
    // Extra labels on the endpoint do not matter; a different value does.
    assert_eq!(
        t.pick(Some(&l(Some(&[("tlsMode", "istio"), ("x", "y")]), None))),
        1
    );
    assert_eq!(t.pick(Some(&l(Some(&[("tlsMode", "other")]), None))), 0);
    // The endpoint's metadata wins over its locality's, whichever match comes first.
    assert_eq!(
        t.pick(Some(&l(
            Some(&[("tlsMode", "disabled")]),
            Some(&[("tlsMode", "istio")])
        ))),
        2
    );
    assert_eq!(
        t.pick(Some(&l(
            Some(&[("other", "x")]),
            Some(&[("tlsMode", "istio")])
        ))),
        1
    );
    assert!(t.get(0).is_none(), "no transport_socket: plain text");
    // An empty match matches every endpoint.
    let c = cpb::Cluster {
        transport_socket_matches: vec![cpb::cluster::TransportSocketMatch {
            name: "all".into(),
            r#match: None,
            transport_socket: Some(tls(Default::default())),
        }],
        ..Default::default()
    };
    let t = TransportSockets::translate(&c, false, &NoFiles).expect("ok");
    assert_eq!(t.pick(None), 1);
}

#[test]
fn dns_matching_follows_dns_rules() {
    assert!(dns_name_match("api.svc.example", "*.svc.example"));
    assert!(dns_name_match("API.svc.example", "api.SVC.example"));
    assert!(!dns_name_match("a.b.svc.example", "*.svc.example"));
    assert!(!dns_name_match("svc.example", "*.svc.example"));
    assert!(!dns_name_match("api.svc.example", "*api.svc.example"));
}

fn matcher(kind: SanKind, m: MatchPattern) -> SanMatcher {
    SanMatcher {
        kind,
        matcher: super::super::route::string_matcher(&StringMatcher {
            match_pattern: Some(m),
            ignore_case: false,
        })
        .expect("matcher"),
    }
}

#[test]
fn san_matchers_look_at_their_own_san_type() {
    let key = rcgen::KeyPair::generate().expect("key");
    let mut p =
        rcgen::CertificateParams::new(vec!["*.svc.example".to_string(), "10.1.2.3".to_string()])
            .expect("params");
    p.subject_alt_names.push(rcgen::SanType::URI(
        rcgen::Ia5String::try_from("spiffe://td/ns/a/sa/b".to_string()).expect("uri"),
    ));
    p.subject_alt_names.push(rcgen::SanType::Rfc822Name(
        rcgen::Ia5String::try_from("ops@example.com".to_string()).expect("email"),
    ));
    let cert = p.self_signed(&key).expect("cert");
    let have = sans(cert.der()).expect("sans");
    assert_eq!(
        have,
        vec![
            San::Dns("*.svc.example".into()),
            San::Ip("10.1.2.3".into()),
            San::Uri("spiffe://td/ns/a/sa/b".into()),
            San::Email("ops@example.com".into()),
        ]
    );
    let any = |m: &SanMatcher| have.iter().any(|s| m.matches(s));
    assert!(any(&matcher(
        SanKind::Dns,
        MatchPattern::Exact("x.svc.example".into())
    )));
    // Only the exact DNS matcher knows wildcards; a suffix matcher compares the SAN text.
    assert!(!any(&matcher(
        SanKind::Dns,
        MatchPattern::Suffix("x.svc.example".into())
    )));
    assert!(any(&matcher(
        SanKind::Ip,
        MatchPattern::Exact("10.1.2.3".into())
    )));
    assert!(!any(&matcher(
        SanKind::Dns,
        MatchPattern::Exact("10.1.2.3".into())
    )));
    assert!(any(&matcher(
        SanKind::Uri,
        MatchPattern::Prefix("spiffe://td/".into())
    )));
    assert!(!any(&matcher(
        SanKind::Dns,
        MatchPattern::Prefix("spiffe://td/".into())
    )));
    assert!(any(&matcher(
        SanKind::Email,
        MatchPattern::Exact("ops@example.com".into())
    )));
}

#[test]
fn the_validator_checks_the_chain_and_never_the_name() {
    let (ca, ca_key) = ca();
    let (rogue, rogue_key) = self::ca();
    let leaf = |names: &[&str], issuer: &rcgen::Certificate, key: &rcgen::KeyPair| {
        let k = rcgen::KeyPair::generate().expect("key");
        let p =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("params");
        p.signed_by(&k, issuer, key).expect("leaf").der().clone()
    };
    let good = leaf(&["unrelated.example"], &ca, &ca_key);
    let bad = leaf(&["api.example"], &rogue, &rogue_key);
    let name = ServerName::try_from("api.example").expect("name");
    let now = UnixTime::now();
    let check = |v: &Validator, cert: &CertificateDer<'_>| {
        v.verify_server_cert(cert, &[], &name, &[], now).is_ok()
    };
    let none = Validator {
        chain: None,
        check: CertValidation::default(),
        algorithms: rustls::crypto::ring::default_provider().signature_verification_algorithms,
    };
    assert!(check(&none, &good) && check(&none, &bad));
    let mut id = Vec::new();
    let trusted = validator(
        &tlspb::CertificateValidationContext {
            trusted_ca: pem_source(&ca.pem()),
            ..Default::default()
        },
        &mut id,
        &NoFiles,
    )
    .expect("validator");
    assert!(check(&trusted, &good), "the name is not checked");
    assert!(!check(&trusted, &bad), "the chain is");
    let with_san = validator(
        &tlspb::CertificateValidationContext {
            trusted_ca: pem_source(&ca.pem()),
            match_typed_subject_alt_names: vec![tlspb::SubjectAltNameMatcher {
                san_type: tlspb::subject_alt_name_matcher::SanType::Dns as i32,
                matcher: Some(exact("api.example")),
                ..Default::default()
            }],
            ..Default::default()
        },
        &mut id,
        &NoFiles,
    )
    .expect("validator");
    assert!(!check(&with_san, &good), "SANs, not the SNI, decide");
    let named = leaf(&["api.example"], &ca, &ca_key);
    assert!(check(&with_san, &named));
}

// ---------------------------------------------------------------------------------------------
// SDS: Istio's ISTIO_MUTUAL socket, from the sds-grpc cluster

fn sds_grpc() -> corepb::ConfigSource {
    corepb::ConfigSource {
        config_source_specifier: Some(
            corepb::config_source::ConfigSourceSpecifier::ApiConfigSource(
                corepb::ApiConfigSource {
                    api_type: corepb::api_config_source::ApiType::Grpc as i32,
                    transport_api_version: corepb::ApiVersion::V3 as i32,
                    set_node_on_first_message_only: true,
                    grpc_services: vec![corepb::GrpcService {
                        target_specifier: Some(corepb::grpc_service::TargetSpecifier::EnvoyGrpc(
                            corepb::grpc_service::EnvoyGrpc {
                                cluster_name: "sds-grpc".into(),
                                ..Default::default()
                            },
                        )),
                        ..Default::default()
                    }],
                    ..Default::default()
                },
            ),
        ),
        initial_fetch_timeout: Some(Default::default()),
        resource_api_version: corepb::ApiVersion::V3 as i32,
        ..Default::default()
    }
}

/// What istiod sends for ISTIO_MUTUAL (the sidecar dumps in /work/shared/xds-data).
fn istio_mutual(spiffe: &str) -> tlspb::UpstreamTlsContext {
    #[allow(deprecated)]
    let default = tlspb::CertificateValidationContext {
        match_subject_alt_names: vec![exact(spiffe)],
        ..Default::default()
    };
    tlspb::UpstreamTlsContext {
        sni: "outbound_.9080_._.reviews.default.svc.cluster.local".into(),
        common_tls_context: Some(tlspb::CommonTlsContext {
            tls_params: Some(tlspb::TlsParameters {
                tls_minimum_protocol_version: tlspb::tls_parameters::TlsProtocol::TlSv12 as i32,
                tls_maximum_protocol_version: tlspb::tls_parameters::TlsProtocol::TlSv13 as i32,
                ..Default::default()
            }),
            alpn_protocols: vec!["istio-peer-exchange".into(), "istio".into()],
            tls_certificate_sds_secret_configs: vec![tlspb::SdsSecretConfig {
                name: "default".into(),
                sds_config: Some(sds_grpc()),
            }],
            validation_context_type: Some(
                tlspb::common_tls_context::ValidationContextType::CombinedValidationContext(
                    tlspb::common_tls_context::CombinedCertificateValidationContext {
                        default_validation_context: Some(default),
                        validation_context_sds_secret_config: Some(tlspb::SdsSecretConfig {
                            name: "ROOTCA".into(),
                            sds_config: Some(sds_grpc()),
                        }),
                        ..Default::default()
                    },
                ),
            ),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn istio_cluster(ctx: tlspb::UpstreamTlsContext) -> cpb::Cluster {
    let raw = corepb::TransportSocket {
        name: "envoy.transport_sockets.raw_buffer".into(),
        config_type: Some(corepb::transport_socket::ConfigType::TypedConfig(Any {
            type_url: RAW_BUFFER_TYPE.into(),
            value: Vec::new(),
        })),
    };
    cpb::Cluster {
        name: "outbound|9080||reviews.default.svc.cluster.local".into(),
        transport_socket_matches: vec![
            cpb::cluster::TransportSocketMatch {
                name: "tlsMode-istio".into(),
                r#match: Some(label_struct(&[("tlsMode", "istio")])),
                transport_socket: Some(tls(ctx)),
            },
            cpb::cluster::TransportSocketMatch {
                name: "tlsMode-disabled".into(),
                r#match: Some(Struct::default()),
                transport_socket: Some(raw),
            },
        ],
        ..Default::default()
    }
}

struct Secrets(Vec<(SecretDef, Vec<u8>)>);

impl Secrets {
    fn new(list: Vec<tlspb::Secret>) -> Secrets {
        Secrets(
            list.into_iter()
                .map(|s| {
                    (
                        SecretDef::translate(&s, &NoFiles).expect("secret"),
                        s.encode_to_vec(),
                    )
                })
                .collect(),
        )
    }

    fn resolve(&self, t: &TransportSockets) -> Result<Option<Resolved>, String> {
        let defs: Vec<(Arc<SecretDef>, &[u8])> = self
            .0
            .iter()
            .map(|(d, b)| {
                (
                    Arc::new(SecretDef {
                        name: d.name.clone(),
                        cert: d.cert.clone(),
                        validation: d.validation.clone(),
                    }),
                    b.as_slice(),
                )
            })
            .collect();
        let lookup = |r: &SdsRef| {
            defs.iter()
                .find(|(d, _)| d.name == r.name)
                .map(|(d, b)| (d.clone(), *b))
        };
        t.resolve(&lookup)
    }
}

fn cert_secret(
    name: &str,
    ca: &rcgen::Certificate,
    ca_key: &rcgen::KeyPair,
    uri: &str,
) -> tlspb::Secret {
    let k = rcgen::KeyPair::generate().expect("key");
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    p.subject_alt_names.push(rcgen::SanType::URI(
        rcgen::Ia5String::try_from(uri).expect("uri"),
    ));
    let c = p.signed_by(&k, ca, ca_key).expect("leaf");
    tlspb::Secret {
        name: name.into(),
        r#type: Some(tlspb::secret::Type::TlsCertificate(tlspb::TlsCertificate {
            certificate_chain: pem_source(&c.pem()),
            private_key: pem_source(&k.serialize_pem()),
            ..Default::default()
        })),
    }
}

fn root_secret(name: &str, ca: &rcgen::Certificate) -> tlspb::Secret {
    tlspb::Secret {
        name: name.into(),
        r#type: Some(tlspb::secret::Type::ValidationContext(
            tlspb::CertificateValidationContext {
                trusted_ca: pem_source(&ca.pem()),
                ..Default::default()
            },
        )),
    }
}

const REVIEWS: &str = "spiffe://cluster.local/ns/default/sa/reviews";

#[test]
fn istio_mutual_is_accepted_and_waits_for_its_secrets() {
    let t = TransportSockets::translate(&istio_cluster(istio_mutual(REVIEWS)), false, &NoFiles)
        .expect("ok");
    assert!(t.needs_sds());
    let refs: Vec<(&str, &str)> = t
        .sds_refs()
        .map(|r| {
            (
                r.name.as_str(),
                r.cluster().map_or("", |c| c.cluster.as_str()),
            )
        })
        .collect();
    assert_eq!(refs, [("default", "sds-grpc"), ("ROOTCA", "sds-grpc")]);
    let s = t.matches[0].socket.as_ref().expect("tls");
    assert!(
        s.config.is_none(),
        "nothing to connect with before the secrets"
    );
    assert_eq!(
        s.sni.as_ref().map(|n| n.to_str().into_owned()).as_deref(),
        Some("outbound_.9080_._.reviews.default.svc.cluster.local")
    );
    assert!(
        t.matches[1].socket.is_none(),
        "tlsMode-disabled is plain text"
    );

    let (ca, ca_key) = ca();
    let default = cert_secret(
        "default",
        &ca,
        &ca_key,
        "spiffe://cluster.local/ns/default/sa/gw",
    );
    assert!(Secrets::new(vec![]).resolve(&t).expect("ok").is_none());
    assert!(Secrets::new(vec![default.clone()])
        .resolve(&t)
        .expect("ok")
        .is_none());
    let both = Secrets::new(vec![default.clone(), root_secret("ROOTCA", &ca)]);
    let r = both.resolve(&t).expect("ok").expect("built");
    assert_eq!(r.sockets.len(), 3, "the default socket and both matches");
    assert!(r.sockets[0].is_none() && r.sockets[2].is_none());
    let built = r.sockets[1].as_ref().expect("tls");
    let config = built.config.as_ref().expect("built");
    assert_eq!(
        config.alpn_protocols,
        vec![b"istio-peer-exchange".to_vec(), b"istio".to_vec()]
    );
    assert!(config.client_auth_cert_resolver.has_certs());
    assert_eq!(r.secrets.len(), 2);

    // A rotated certificate makes a socket whose connections are pooled apart.
    let rotated = cert_secret(
        "default",
        &ca,
        &ca_key,
        "spiffe://cluster.local/ns/default/sa/gw2",
    );
    let again = Secrets::new(vec![rotated, root_secret("ROOTCA", &ca)])
        .resolve(&t)
        .expect("ok")
        .expect("built");
    let again = again.sockets[1].as_ref().expect("tls");
    assert_ne!(again.group_key, built.group_key);
    assert_ne!(**again, **built);
}

#[test]
fn the_combined_context_checks_the_secrets_ca_and_the_default_sans() {
    let t = TransportSockets::translate(&istio_cluster(istio_mutual(REVIEWS)), false, &NoFiles)
        .expect("ok");
    let s = t.matches[0].socket.as_ref().expect("tls");
    let Some(ValidationPart::Sds { default, secret }) = s.sds.as_ref().map(|p| &p.validation)
    else {
        panic!("a combined context");
    };
    assert_eq!(secret.name, "ROOTCA");
    let (ca, ca_key) = ca();
    let (rogue, rogue_key) = self::ca();
    let root = SecretDef::translate(&root_secret("ROOTCA", &ca), &NoFiles).expect("root");
    let v = validator(
        &super::super::validation::combine(default, root.validation.as_deref().expect("vc")),
        &mut Vec::new(),
        &NoFiles,
    )
    .expect("validator");
    let leaf = |uri: &str, issuer: &rcgen::Certificate, key: &rcgen::KeyPair| {
        let k = rcgen::KeyPair::generate().expect("key");
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        p.subject_alt_names.push(rcgen::SanType::URI(
            rcgen::Ia5String::try_from(uri).expect("uri"),
        ));
        p.signed_by(&k, issuer, key).expect("leaf").der().clone()
    };
    let name =
        ServerName::try_from("outbound_.9080_._.reviews.default.svc.cluster.local").expect("name");
    let ok = |c: &CertificateDer<'_>| {
        v.verify_server_cert(c, &[], &name, &[], UnixTime::now())
            .is_ok()
    };
    assert!(ok(&leaf(REVIEWS, &ca, &ca_key)));
    assert!(
        !ok(&leaf(
            "spiffe://cluster.local/ns/default/sa/other",
            &ca,
            &ca_key
        )),
        "the default's SAN"
    );
    assert!(!ok(&leaf(REVIEWS, &rogue, &rogue_key)), "the secret's CA");
}

#[test]
fn secrets_of_the_wrong_kind_or_an_incomplete_context_are_errors_naming_them() {
    let t = TransportSockets::translate(&istio_cluster(istio_mutual(REVIEWS)), false, &NoFiles)
        .expect("ok");
    let (ca, ca_key) = ca();
    let cert = cert_secret("default", &ca, &ca_key, "spiffe://x");
    let e = Secrets::new(vec![
        root_secret("default", &ca),
        root_secret("ROOTCA", &ca),
    ])
    .resolve(&t)
    .expect_err("a CA is no client certificate");
    assert!(
        e.contains("secret 'default' is used as a client certificate"),
        "{e}"
    );
    let mut as_root = cert.clone();
    as_root.name = "ROOTCA".into();
    let e = Secrets::new(vec![cert.clone(), as_root])
        .resolve(&t)
        .expect_err("a certificate is no validation context");
    assert!(
        e.contains("secret 'ROOTCA' is used as a validation context"),
        "{e}"
    );
    // A ROOTCA without a CA leaves the default's SAN matchers without one.
    let empty = tlspb::Secret {
        name: "ROOTCA".into(),
        r#type: Some(tlspb::secret::Type::ValidationContext(Default::default())),
    };
    let e = Secrets::new(vec![cert, empty])
        .resolve(&t)
        .expect_err("SANs without a CA");
    assert!(
        e.contains("secret 'ROOTCA'") && e.contains("without trusted CA"),
        "{e}"
    );
}

#[test]
fn sds_on_upstream_tls_rejections() {
    let mut rest = istio_mutual(REVIEWS);
    if let Some(c) = &mut rest.common_tls_context {
        if let Some(corepb::config_source::ConfigSourceSpecifier::ApiConfigSource(a)) = c
            .tls_certificate_sds_secret_configs[0]
            .sds_config
            .as_mut()
            .and_then(|s| s.config_source_specifier.as_mut())
        {
            a.api_type = corepb::api_config_source::ApiType::Rest as i32;
        }
    }
    rejected(rest, "tls_certificate_sds_secret_configs[0].sds_config.api_config_source.api_type: REST is not supported for SDS; use GRPC or DELTA_GRPC");
    let mut two = istio_mutual(REVIEWS);
    if let Some(c) = &mut two.common_tls_context {
        let again = c.tls_certificate_sds_secret_configs[0].clone();
        c.tls_certificate_sds_secret_configs.push(again);
    }
    rejected(
        two,
        "Multiple TLS certificates are not supported for client contexts",
    );
    let mut no_secret = istio_mutual(REVIEWS);
    if let Some(tlspb::common_tls_context::ValidationContextType::CombinedValidationContext(cv)) =
        no_secret
            .common_tls_context
            .as_mut()
            .and_then(|c| c.validation_context_type.as_mut())
    {
        cv.validation_context_sds_secret_config = None;
    }
    rejected(
        no_secret,
        "combined_validation_context.validation_context_sds_secret_config: is required",
    );
    // Only the ADS-delivered or the gRPC cluster sources.
    let mut bad_default = istio_mutual(REVIEWS);
    if let Some(tlspb::common_tls_context::ValidationContextType::CombinedValidationContext(cv)) =
        bad_default
            .common_tls_context
            .as_mut()
            .and_then(|c| c.validation_context_type.as_mut())
    {
        if let Some(d) = &mut cv.default_validation_context {
            d.crl = pem_source("x");
        }
    }
    rejected(
        bad_default,
        "combined_validation_context.default_validation_context.crl is not supported",
    );
}

#[test]
fn the_ca_file_comes_from_the_supplied_sources_and_keys_the_socket() {
    use crate::snapshot::sources::MemorySources;
    let (a, _) = ca();
    let (b, _) = ca();
    let c = cluster(tls(with_validation(tlspb::CertificateValidationContext {
        trusted_ca: Some(corepb::DataSource {
            specifier: Some(corepb::data_source::Specifier::Filename(
                "/virtual/ca.pem".into(),
            )),
            ..Default::default()
        }),
        ..Default::default()
    })));
    let with = |ca: &rcgen::Certificate| {
        let src = MemorySources::default().with_file("/virtual/ca.pem", ca.pem());
        TransportSockets::translate(&c, false, &src)
            .expect("ok")
            .default
            .expect("tls")
    };
    let (first, again, other) = (with(&a), with(&a), with(&b));
    assert_eq!(first.group_key, again.group_key);
    // The same file name with other contents is another socket.
    assert_ne!(first.group_key, other.group_key);
    let e = TransportSockets::translate(&c, false, &NoFiles).expect_err("unreadable");
    assert!(
        e.contains("validation_context.trusted_ca: cannot read file '/virtual/ca.pem'"),
        "{e}"
    );
}
