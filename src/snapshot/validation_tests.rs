use super::*;
use crate::snapshot::sources::NoFiles;
use envoy_types::pb::envoy::r#type::matcher::v3::{string_matcher::MatchPattern, StringMatcher};

fn exact(s: &str) -> StringMatcher {
    StringMatcher {
        match_pattern: Some(MatchPattern::Exact(s.into())),
        ignore_case: false,
    }
}

fn inline(s: &str) -> Option<corepb::DataSource> {
    Some(corepb::DataSource {
        specifier: Some(corepb::data_source::Specifier::InlineString(s.into())),
        ..Default::default()
    })
}

fn self_signed(names: &[&str]) -> rcgen::Certificate {
    let key = rcgen::KeyPair::generate().expect("key");
    rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
        .expect("params")
        .self_signed(&key)
        .expect("cert")
}

#[test]
fn a_combined_context_is_the_default_with_the_secret_merged_over_it() {
    let default = tlspb::CertificateValidationContext {
        match_typed_subject_alt_names: vec![tlspb::SubjectAltNameMatcher {
            san_type: tlspb::subject_alt_name_matcher::SanType::Uri as i32,
            matcher: Some(exact("spiffe://a")),
            ..Default::default()
        }],
        trusted_ca: inline("default"),
        ..Default::default()
    };
    let dynamic = tlspb::CertificateValidationContext {
        trusted_ca: inline("from sds"),
        match_typed_subject_alt_names: vec![tlspb::SubjectAltNameMatcher {
            san_type: tlspb::subject_alt_name_matcher::SanType::Dns as i32,
            matcher: Some(exact("b")),
            ..Default::default()
        }],
        ..Default::default()
    };
    let c = combine(&default, &dynamic);
    assert_eq!(c.trusted_ca, inline("from sds"));
    assert_eq!(c.match_typed_subject_alt_names.len(), 2);
    assert_eq!(
        c.match_typed_subject_alt_names[0],
        default.match_typed_subject_alt_names[0]
    );
}

#[test]
fn pinned_hashes_and_spkis_accept_only_their_certificate() {
    let cert = self_signed(&["a.example"]);
    let other = self_signed(&["a.example"]);
    let hex = sha256_hex(cert.der());
    let colons: String = hex
        .as_bytes()
        .chunks(2)
        .map(|c| String::from_utf8_lossy(c).to_uppercase())
        .collect::<Vec<_>>()
        .join(":");
    for pinned in [hex.clone(), colons] {
        let v = CertValidation::parse(
            &tlspb::CertificateValidationContext {
                verify_certificate_hash: vec![pinned],
                ..Default::default()
            },
            &mut Vec::new(),
            Side::Downstream,
            &NoFiles,
        )
        .expect("parse");
        assert!(v.checks_anything());
        assert_eq!(v.check_leaf(cert.der()), Ok(()));
        assert_eq!(v.check_leaf(other.der()), Err(Refusal::Hash));
    }
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.der()).expect("x509");
    let spki = sha256(parsed.tbs_certificate.subject_pki.raw);
    let b64 = base64_encode(&spki);
    let v = CertValidation::parse(
        &tlspb::CertificateValidationContext {
            verify_certificate_spki: vec![b64],
            verify_certificate_hash: vec![sha256_hex(other.der())],
            ..Default::default()
        },
        &mut Vec::new(),
        Side::Downstream,
        &NoFiles,
    )
    .expect("parse");
    // Either list matching is enough.
    assert_eq!(v.check_leaf(cert.der()), Ok(()));
    assert_eq!(v.check_leaf(other.der()), Ok(()));
    assert_eq!(v.check_leaf(self_signed(&["x"]).der()), Err(Refusal::Hash));
}

fn base64_encode(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(b)
}

#[test]
fn san_matchers_need_a_trusted_ca() {
    let err = CertValidation::parse(
        &tlspb::CertificateValidationContext {
            match_typed_subject_alt_names: vec![tlspb::SubjectAltNameMatcher {
                san_type: tlspb::subject_alt_name_matcher::SanType::Dns as i32,
                matcher: Some(exact("a")),
                ..Default::default()
            }],
            ..Default::default()
        },
        &mut Vec::new(),
        Side::Downstream,
        &NoFiles,
    )
    .expect_err("insecure");
    assert!(err.contains("without trusted CA"), "{err}");
    let bad = CertValidation::parse(
        &tlspb::CertificateValidationContext {
            verify_certificate_hash: vec!["abcd".into()],
            ..Default::default()
        },
        &mut Vec::new(),
        Side::Upstream,
        &NoFiles,
    )
    .expect_err("short hash");
    assert!(bad.contains("verify_certificate_hash[0]"), "{bad}");
}
