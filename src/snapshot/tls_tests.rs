//! `DownstreamTlsContext` and SDS secret translation, with certificates made by rcgen.

use super::*;
use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
use tlspb::tls_parameters::TlsProtocol;

fn cert(name: &str) -> (String, String) {
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec![name.to_string()]).expect("params");
    let c = params.self_signed(&key).expect("cert");
    (c.pem(), key.serialize_pem())
}

fn inline(s: &str) -> Option<corepb::DataSource> {
    Some(corepb::DataSource {
        specifier: Some(Specifier::InlineString(s.into())),
        ..Default::default()
    })
}

fn tls_cert(chain: &str, key: &str) -> tlspb::TlsCertificate {
    tlspb::TlsCertificate {
        certificate_chain: inline(chain),
        private_key: inline(key),
        ..Default::default()
    }
}

fn ctx(common: tlspb::CommonTlsContext) -> tlspb::DownstreamTlsContext {
    tlspb::DownstreamTlsContext {
        common_tls_context: Some(common),
        ..Default::default()
    }
}

fn with_cert() -> tlspb::CommonTlsContext {
    let (c, k) = cert("a.example.com");
    tlspb::CommonTlsContext {
        tls_certificates: vec![tls_cert(&c, &k)],
        ..Default::default()
    }
}

fn params(min: TlsProtocol, max: TlsProtocol) -> Option<tlspb::TlsParameters> {
    Some(tlspb::TlsParameters {
        tls_minimum_protocol_version: min as i32,
        tls_maximum_protocol_version: max as i32,
        ..Default::default()
    })
}

#[test]
fn inline_certificate_builds_a_config_with_alpn() {
    let mut c = with_cert();
    c.alpn_protocols = vec!["h2".into(), "http/1.1".into()];
    let t = DownstreamTls::translate(&ctx(c), &NoFiles).expect("valid");
    let server = t.inline_config.expect("built");
    assert_eq!(
        server.with_alpn.alpn_protocols,
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    );
    assert!(server.without_alpn.alpn_protocols.is_empty());
    // A client offering nothing the chain knows gets the config without ALPN, as BoringSSL
    // carries on without it.
    let other: [&[u8]; 1] = [b"spdy/3"];
    assert!(server
        .for_client(Some(other.into_iter()))
        .alpn_protocols
        .is_empty());
    let h2: [&[u8]; 1] = [b"h2"];
    assert_eq!(
        server.for_client(Some(h2.into_iter())).alpn_protocols.len(),
        2
    );
}

fn ds(s: Specifier) -> Option<corepb::DataSource> {
    Some(corepb::DataSource {
        specifier: Some(s),
        ..Default::default()
    })
}

#[test]
fn certificate_from_a_file_or_variable_of_the_supplied_sources() {
    use crate::snapshot::sources::MemorySources;
    let (c, k) = cert("a.example.com");
    let file = |p: &str| ds(Specifier::Filename(p.into()));
    let common = tlspb::CommonTlsContext {
        tls_certificates: vec![tlspb::TlsCertificate {
            certificate_chain: file("/virtual/c.pem"),
            private_key: ds(Specifier::EnvironmentVariable("KEY".into())),
            ..Default::default()
        }],
        ..Default::default()
    };
    let src = MemorySources::default()
        .with_file("/virtual/c.pem", c.clone())
        .with_env("KEY", &k);
    let t = DownstreamTls::translate(&ctx(common.clone()), &src).expect("valid");
    assert!(t.inline_config.is_some());
    let e = DownstreamTls::translate(&ctx(common.clone()), &NoFiles).unwrap_err();
    assert!(
        e.starts_with(
            "tls_certificates[0]: certificate_chain: cannot read file '/virtual/c.pem': "
        ),
        "{e}"
    );
    let mut missing = common;
    missing.tls_certificates[0].certificate_chain = ds(Specifier::InlineString(c));
    let e = DownstreamTls::translate(&ctx(missing.clone()), &NoFiles).unwrap_err();
    assert_eq!(
        e,
        "tls_certificates[0]: private_key: environment variable 'KEY' is not set"
    );
    missing.tls_certificates[0].private_key = file("/virtual/nope.pem");
    let e = DownstreamTls::translate(&ctx(missing), &src).unwrap_err();
    assert!(
        e.contains("tls_certificates[0]: private_key: cannot read file '/virtual/nope.pem'"),
        "{e}"
    );
}

#[test]
fn contexts_kept_for_sds_hold_their_ca_bytes() {
    use crate::snapshot::sources::MemorySources;
    use tlspb::common_tls_context::{CombinedCertificateValidationContext, ValidationContextType};
    let (ca, _) = cert("client CA");
    let src = MemorySources::default().with_file("/virtual/ca.pem", ca.clone());
    let vc = tlspb::CertificateValidationContext {
        trusted_ca: ds(Specifier::Filename("/virtual/ca.pem".into())),
        ..Default::default()
    };
    let inline_ca = ds(Specifier::InlineBytes(ca.clone().into_bytes()));
    // A secret's context: read at translation, then combined and parsed with nothing to read.
    let secret = tlspb::Secret {
        name: "ca".into(),
        r#type: Some(tlspb::secret::Type::ValidationContext(vc.clone())),
    };
    let e = SecretDef::translate(&secret, &NoFiles)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(
            "secret 'ca': validation_context.trusted_ca: cannot read file '/virtual/ca.pem'"
        ),
        "{e}"
    );
    let def = SecretDef::translate(&secret, &src).expect("valid");
    let kept = def.validation.expect("a validation context");
    assert_eq!(kept.trusted_ca, inline_ca);
    assert!(sds_validation(None, &kept).is_ok_and(|v| v.roots.is_some()));
    // The default half of a combined context: its CA read with the listener.
    let mut common = with_cert();
    common.validation_context_type = Some(ValidationContextType::CombinedValidationContext(
        CombinedCertificateValidationContext {
            default_validation_context: Some(vc),
            validation_context_sds_secret_config: Some(tlspb::SdsSecretConfig {
                name: "kubernetes://cred-cacert".into(),
                sds_config: ads(),
            }),
            ..Default::default()
        },
    ));
    let t = DownstreamTls::translate(&ctx(common.clone()), &src).expect("combined");
    let ClientValidation::Sds {
        default: Some(default),
        ..
    } = &t.validation
    else {
        panic!("an SDS validation context with a default half");
    };
    assert_eq!(default.trusted_ca, inline_ca);
    let v = sds_validation(Some(default), &Default::default()).expect("the default's CA");
    assert!(v.roots.is_some());
    // Envoy reads that half only merged with the secret: a file it cannot read fails the
    // merge, unless the secret brings its own CA.
    let t = DownstreamTls::translate(&ctx(common), &NoFiles).expect("accepted");
    let ClientValidation::Sds {
        default: Some(default),
        ..
    } = &t.validation
    else {
        panic!("an SDS validation context with a default half");
    };
    let e = sds_validation(Some(default), &Default::default()).unwrap_err();
    assert!(
        e.starts_with("validation_context.trusted_ca: cannot read file '/virtual/ca.pem'"),
        "{e}"
    );
    assert!(sds_validation(Some(default), &kept).is_ok());
}

#[test]
fn a_key_that_does_not_match_or_parse_is_rejected() {
    let (c, _) = cert("a.example.com");
    let (_, other_key) = cert("b.example.com");
    let common = tlspb::CommonTlsContext {
        tls_certificates: vec![tls_cert(&c, &other_key)],
        ..Default::default()
    };
    let e = DownstreamTls::translate(&ctx(common), &NoFiles).unwrap_err();
    assert!(
        e.contains("private_key does not match certificate_chain"),
        "{e}"
    );
    let common = tlspb::CommonTlsContext {
        tls_certificates: vec![tls_cert(&c, "not a key")],
        ..Default::default()
    };
    let e = DownstreamTls::translate(&ctx(common), &NoFiles).unwrap_err();
    assert!(e.contains("private_key: no private key found"), "{e}");
}

#[test]
fn protocol_versions() {
    let mut c = with_cert();
    c.tls_params = params(TlsProtocol::TlSv13, TlsProtocol::TlSv13);
    let t = DownstreamTls::translate(&ctx(c.clone()), &NoFiles).expect("valid");
    assert_eq!(t.versions, vec![&rustls::version::TLS13]);
    c.tls_params = params(TlsProtocol::TlsAuto, TlsProtocol::TlSv12);
    let t = DownstreamTls::translate(&ctx(c.clone()), &NoFiles).expect("valid");
    assert_eq!(t.versions, vec![&rustls::version::TLS12]);
    c.tls_params = params(TlsProtocol::TlSv10, TlsProtocol::TlsAuto);
    let e = DownstreamTls::translate(&ctx(c.clone()), &NoFiles).unwrap_err();
    assert!(
        e.contains("tls_params.tls_minimum_protocol_version: TLSv1_0 is not supported"),
        "{e}"
    );
    c.tls_params = params(TlsProtocol::TlSv13, TlsProtocol::TlSv12);
    assert!(DownstreamTls::translate(&ctx(c), &NoFiles).is_err());
}

#[test]
fn cipher_suites_rustls_lacks_are_left_out_and_unknown_ones_rejected() {
    let mut c = with_cert();
    c.tls_params = Some(tlspb::TlsParameters {
        cipher_suites: vec![
            "[ECDHE-ECDSA-AES128-GCM-SHA256|ECDHE-ECDSA-CHACHA20-POLY1305]".into(),
            "ECDHE-RSA-AES128-GCM-SHA256".into(),
        ],
        ..Default::default()
    });
    let t = DownstreamTls::translate(&ctx(c.clone()), &NoFiles).expect("valid");
    assert_eq!(t.tls12_suites.as_ref().map(Vec::len), Some(3));
    // istiod's default list: the two RSA key exchange suites are left out, the rest applies.
    c.tls_params = Some(tlspb::TlsParameters {
        cipher_suites: [
            "ECDHE-ECDSA-AES256-GCM-SHA384",
            "ECDHE-RSA-AES256-GCM-SHA384",
            "ECDHE-ECDSA-AES128-GCM-SHA256",
            "ECDHE-RSA-AES128-GCM-SHA256",
            "AES256-GCM-SHA384",
            "AES128-GCM-SHA256",
        ]
        .map(String::from)
        .to_vec(),
        ..Default::default()
    });
    let t = DownstreamTls::translate(&ctx(c.clone()), &NoFiles).expect("istiod's list");
    assert_eq!(t.tls12_suites.as_ref().map(Vec::len), Some(4));
    // Only suites rustls lacks: nothing left to offer.
    c.tls_params = Some(tlspb::TlsParameters {
        cipher_suites: vec!["AES128-SHA".into()],
        ..Default::default()
    });
    let e = DownstreamTls::translate(&ctx(c.clone()), &NoFiles).unwrap_err();
    assert!(
        e.starts_with("tls_params.cipher_suites: none of AES128-SHA is supported"),
        "{e}"
    );
    c.tls_params = Some(tlspb::TlsParameters {
        cipher_suites: vec!["ECDHE-RSA-AES128-GCM-SHA256".into(), "NOT-A-SUITE".into()],
        ..Default::default()
    });
    let e = DownstreamTls::translate(&ctx(c), &NoFiles).unwrap_err();
    assert_eq!(
        e,
        "tls_params.cipher_suites[1]: 'NOT-A-SUITE' is not a known cipher suite"
    );
}

#[test]
fn sds_certificates_need_a_config_source() {
    let sds = |ads: bool| tlspb::CommonTlsContext {
        tls_certificate_sds_secret_configs: vec![tlspb::SdsSecretConfig {
            name: "kubernetes://bookinfo-cert".into(),
            sds_config: ads.then(|| corepb::ConfigSource {
                config_source_specifier: Some(corepb::config_source::ConfigSourceSpecifier::Ads(
                    Default::default(),
                )),
                ..Default::default()
            }),
        }],
        ..Default::default()
    };
    let t = DownstreamTls::translate(&ctx(sds(true)), &NoFiles).expect("valid");
    assert_eq!(
        t.sds_names().collect::<Vec<_>>(),
        vec!["kubernetes://bookinfo-cert"]
    );
    assert!(t.inline_config.is_none());
    let e = DownstreamTls::translate(&ctx(sds(false)), &NoFiles).unwrap_err();
    assert!(e.contains("sds_config: is required"), "{e}");
}

#[test]
fn secrets_translate_and_bad_keys_name_the_secret() {
    let (c, k) = cert("a.example.com");
    let good = tlspb::Secret {
        name: "kubernetes://bookinfo-cert".into(),
        r#type: Some(tlspb::secret::Type::TlsCertificate(tls_cert(&c, &k))),
    };
    assert!(SecretDef::translate(&good, &NoFiles)
        .expect("valid")
        .cert
        .is_some());
    let bad = tlspb::Secret {
        name: "kubernetes://bookinfo-cert".into(),
        r#type: Some(tlspb::secret::Type::TlsCertificate(tls_cert(&c, "garbage"))),
    };
    let e = SecretDef::translate(&bad, &NoFiles)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("secret 'kubernetes://bookinfo-cert': tls_certificate: private_key"),
        "{e}"
    );
    // istiod's ROOTCA: a validation context, accepted.
    let ca = tlspb::Secret {
        name: "ROOTCA".into(),
        r#type: Some(tlspb::secret::Type::ValidationContext(Default::default())),
    };
    assert!(SecretDef::translate(&ca, &NoFiles)
        .expect("valid")
        .cert
        .is_none());
}

fn ads() -> Option<corepb::ConfigSource> {
    Some(corepb::ConfigSource {
        config_source_specifier: Some(corepb::config_source::ConfigSourceSpecifier::Ads(
            Default::default(),
        )),
        ..Default::default()
    })
}

#[test]
fn client_validation_inline_sds_and_combined() {
    use tlspb::common_tls_context::{CombinedCertificateValidationContext, ValidationContextType};
    let (ca, _) = cert("client CA");
    let mut common = with_cert();
    common.validation_context_type = Some(ValidationContextType::ValidationContext(
        tlspb::CertificateValidationContext {
            trusted_ca: Some(corepb::DataSource {
                specifier: Some(Specifier::InlineString(ca)),
                ..Default::default()
            }),
            ..Default::default()
        },
    ));
    let mut c = ctx(common.clone());
    c.require_client_certificate =
        Some(envoy_types::pb::google::protobuf::BoolValue { value: true });
    let t = DownstreamTls::translate(&c, &NoFiles).expect("inline mTLS");
    assert!(t.require_client_cert);
    assert!(matches!(t.validation, ClientValidation::Inline(_)));
    // Built at once: nothing to wait for.
    assert!(t.inline_config.is_some());

    // istiod's MUTUAL: the CA by SDS, SAN matchers in the default half.
    common.validation_context_type = Some(ValidationContextType::CombinedValidationContext(
        CombinedCertificateValidationContext {
            default_validation_context: Some(Default::default()),
            validation_context_sds_secret_config: Some(tlspb::SdsSecretConfig {
                name: "kubernetes://cred-cacert".into(),
                sds_config: ads(),
            }),
            ..Default::default()
        },
    ));
    let t = DownstreamTls::translate(&ctx(common.clone()), &NoFiles).expect("combined");
    assert_eq!(
        t.sds_names().collect::<Vec<_>>(),
        vec!["kubernetes://cred-cacert"]
    );
    assert!(t.inline_config.is_none(), "waits for the CA");

    // Errors name the field.
    common.validation_context_type = Some(ValidationContextType::CombinedValidationContext(
        CombinedCertificateValidationContext::default(),
    ));
    let e = DownstreamTls::translate(&ctx(common.clone()), &NoFiles).unwrap_err();
    assert!(
        e.contains("combined_validation_context.validation_context_sds_secret_config is required"),
        "{e}"
    );
    common.validation_context_type = Some(ValidationContextType::ValidationContext(
        tlspb::CertificateValidationContext {
            match_typed_subject_alt_names: vec![tlspb::SubjectAltNameMatcher {
                san_type: tlspb::subject_alt_name_matcher::SanType::Dns as i32,
                matcher: Some(envoy_types::pb::envoy::r#type::matcher::v3::StringMatcher {
                    match_pattern: Some(
                        envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern::Exact(
                            "a".into(),
                        ),
                    ),
                    ignore_case: false,
                }),
                ..Default::default()
            }],
            ..Default::default()
        },
    ));
    let e = DownstreamTls::translate(&ctx(common), &NoFiles).unwrap_err();
    assert!(
        e.starts_with("common_tls_context.validation_context:"),
        "{e}"
    );
    assert!(e.contains("without trusted CA"), "{e}");
}

#[test]
fn validation_secrets_are_checked_by_name() {
    let bad = tlspb::Secret {
        name: "ROOTCA".into(),
        r#type: Some(tlspb::secret::Type::ValidationContext(
            tlspb::CertificateValidationContext {
                trusted_ca: Some(corepb::DataSource {
                    specifier: Some(Specifier::InlineString("not a pem".into())),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )),
    };
    let e = SecretDef::translate(&bad, &NoFiles)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("secret 'ROOTCA': validation_context.trusted_ca"),
        "{e}"
    );
}

#[test]
fn ecdh_curves_pick_the_groups_offered() {
    let params = |curves: &[&str]| tlspb::TlsParameters {
        ecdh_curves: curves.iter().map(|c| c.to_string()).collect(),
        ..Default::default()
    };
    let g = kx_groups(Some(&params(&["P-256", "X25519MLKEM768", "X25519"])))
        .expect("valid")
        .expect("set");
    let names: Vec<_> = g.iter().map(|g| g.name()).collect();
    assert_eq!(
        names,
        [rustls::NamedGroup::secp256r1, rustls::NamedGroup::X25519]
    );
    assert!(kx_groups(None).expect("unset").is_none());
    let e = kx_groups(Some(&params(&["P-521"]))).expect_err("none usable");
    assert!(e.contains("none of P-521"), "{e}");
    let mut common = with_cert();
    common.tls_params = Some(params(&["P-384"]));
    let t = DownstreamTls::translate(&ctx(common), &NoFiles).expect("P-384 only");
    assert!(t.inline_config.is_some());
}

#[test]
fn several_certificates_translate_and_may_not_be_mixed() {
    let (c1, k1) = cert("a.example.com");
    let (c2, k2) = cert("b.example.com");
    let mut common = tlspb::CommonTlsContext {
        tls_certificates: vec![tls_cert(&c1, &k1), tls_cert(&c2, &k2)],
        ..Default::default()
    };
    let t = DownstreamTls::translate(&ctx(common.clone()), &NoFiles).expect("two certificates");
    assert!(matches!(&t.cert, CertSource::Inline(v) if v.len() == 2));
    assert!(t.inline_config.is_some());
    common.tls_certificate_sds_secret_configs = vec![tlspb::SdsSecretConfig {
        name: "s".into(),
        sds_config: ads(),
    }];
    let e = DownstreamTls::translate(&ctx(common), &NoFiles).unwrap_err();
    assert!(e.contains("may not be mixed"), "{e}");
    let bad = tlspb::CommonTlsContext {
        tls_certificates: vec![tls_cert(&c1, &k1), tls_cert(&c2, "garbage")],
        ..Default::default()
    };
    let e = DownstreamTls::translate(&ctx(bad), &NoFiles).unwrap_err();
    assert!(e.starts_with("tls_certificates[1]: private_key"), "{e}");
}

#[test]
fn suppress_client_ca_list_names_no_ca_in_the_certificate_request() {
    let (ca, _) = cert("client CA");
    let vc = |suppress: bool| tlspb::CertificateValidationContext {
        trusted_ca: inline(&ca),
        suppress_client_ca_list: suppress,
        ..Default::default()
    };
    let hints = |suppress: bool| {
        let v = CertValidation::parse(&vc(suppress), &mut Vec::new(), Side::Downstream, &NoFiles)
            .expect("valid");
        let verifier = client_verifier(Some(Arc::new(v)), false)
            .expect("builds")
            .expect("asks for a certificate");
        verifier.root_hint_subjects().len()
    };
    assert_eq!(hints(false), 1);
    assert_eq!(hints(true), 0);
}

#[test]
fn tls_options_portico_does_not_implement_are_refused() {
    let mut common = with_cert();
    common.tls_params = Some(tlspb::TlsParameters {
        compliance_policies: vec![1],
        ..Default::default()
    });
    let e = DownstreamTls::translate(&ctx(common), &NoFiles).expect_err("refused");
    assert!(
        e.contains("tls_params.compliance_policies are not supported"),
        "{e}"
    );
    let mut common = with_cert();
    common.custom_tls_certificate_selector = Some(Default::default());
    let e = DownstreamTls::translate(&ctx(common), &NoFiles).expect_err("refused");
    assert!(
        e.contains("custom_tls_certificate_selector is not supported"),
        "{e}"
    );
}
