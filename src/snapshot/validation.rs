//! Peer certificate validation as Envoy's default validator does it, for both sides: the
//! `CertificateValidationContext` (inline, or the default and SDS halves of a combined one)
//! parsed once into roots, SAN matchers and pinned hashes.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tlspb;
use prost::Message;

use super::route::StringMatch;
use super::sources::{data_source, inlined, DataSources};

/// A SAN matcher: the SAN type and the string matcher.
#[derive(Debug)]
pub struct SanMatcher {
    pub kind: SanKind,
    pub matcher: StringMatch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SanKind {
    Dns,
    Uri,
    Email,
    Ip,
}

impl SanMatcher {
    pub fn matches(&self, san: &San) -> bool {
        let value = match (self.kind, san) {
            (SanKind::Dns, San::Dns(v))
            | (SanKind::Uri, San::Uri(v))
            | (SanKind::Email, San::Email(v))
            | (SanKind::Ip, San::Ip(v)) => v,
            _ => return false,
        };
        // An exact matcher on a DNS SAN follows DNS rules, as Envoy's does: a wildcard SAN
        // covers one label, and case does not count.
        match (&self.matcher, self.kind) {
            (StringMatch::Exact(want, _), SanKind::Dns) => dns_name_match(want, value),
            (m, _) => m.matches(value),
        }
    }
}

pub fn dns_name_match(name: &str, pattern: &str) -> bool {
    let (name, pattern) = (name.to_ascii_lowercase(), pattern.to_ascii_lowercase());
    if name == pattern {
        return true;
    }
    let Some(suffix) = pattern.strip_prefix('*') else {
        return false;
    };
    // "*.example.com" matches "a.example.com", not "a.b.example.com" nor "example.com".
    suffix.starts_with('.')
        && name.len() > suffix.len()
        && name.ends_with(suffix)
        && !name[..name.len() - suffix.len()].contains('.')
}

#[derive(Debug, PartialEq)]
pub enum San {
    Dns(String),
    Uri(String),
    Email(String),
    Ip(String),
}

/// The subject alternative names of a DER certificate.
pub fn sans(der: &[u8]) -> Result<Vec<San>, String> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|e| format!("bad certificate: {e}"))?;
    let Ok(Some(ext)) = cert.subject_alternative_name() else {
        return Ok(Vec::new());
    };
    Ok(ext
        .value
        .general_names
        .iter()
        .filter_map(|g| match g {
            GeneralName::DNSName(s) => Some(San::Dns(s.to_string())),
            GeneralName::URI(s) => Some(San::Uri(s.to_string())),
            GeneralName::RFC822Name(s) => Some(San::Email(s.to_string())),
            GeneralName::IPAddress(b) => match b.len() {
                4 => <[u8; 4]>::try_from(*b)
                    .ok()
                    .map(|a| San::Ip(std::net::IpAddr::from(a).to_string())),
                16 => <[u8; 16]>::try_from(*b)
                    .ok()
                    .map(|a| San::Ip(std::net::IpAddr::from(a).to_string())),
                _ => None,
            },
            _ => None,
        })
        .collect())
}

/// Which side of the connection validates: the field checks differ a little.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A client (cluster) checking the server it connects to.
    Upstream,
    /// A listener checking its clients' certificates.
    Downstream,
}

/// What a validation context asks of a peer certificate.
#[derive(Debug, Default)]
pub struct CertValidation {
    /// `trusted_ca`: the chain must lead to one of these (the name is never checked).
    pub roots: Option<Arc<rustls::RootCertStore>>,
    /// One of the certificate's SANs must match one of these, when there are any.
    pub sans: Vec<SanMatcher>,
    /// `verify_certificate_hash` (SHA-256 of the DER) and `verify_certificate_spki` (SHA-256
    /// of the SubjectPublicKeyInfo): when either is set the certificate must match one entry.
    pub hashes: Vec<[u8; 32]>,
    pub spkis: Vec<[u8; 32]>,
    /// `suppress_client_ca_list`: a server asking for a client certificate names no CAs.
    pub suppress_ca_list: bool,
}

/// Why a peer certificate was refused, as Envoy counts it (`ssl.fail_verify_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    San,
    Hash,
    Encoding,
}

/// A data source's bytes, appended to `identity` too (equal bytes make equal sockets).
pub(crate) fn read(
    d: Option<&corepb::DataSource>,
    field: &str,
    identity: &mut Vec<u8>,
    src: &dyn DataSources,
) -> Result<Vec<u8>, String> {
    let bytes = data_source(d, field, src)?;
    identity.extend_from_slice(&bytes);
    Ok(bytes)
}

/// `vc` with the file or variable its `trusted_ca` names read from `src` and inlined, for a
/// context kept as a proto and parsed after translation (a secret's, or the default half of a
/// combined context). One that cannot be read is left as configured, so parsing it still
/// refuses it by name; a secret that replaces it makes the failure moot, as in Envoy, which
/// reads the merged context.
pub fn read_sources(
    vc: &tlspb::CertificateValidationContext,
    src: &dyn DataSources,
) -> tlspb::CertificateValidationContext {
    let mut out = vc.clone();
    if let Some(ca) = &vc.trusted_ca {
        if let Ok(d) = inlined(ca, "validation_context.trusted_ca", src) {
            out.trusted_ca = Some(d);
        }
    }
    out
}

/// The context an SDS validation secret completes: the default half first, then the secret's
/// fields merged over it (repeated fields appended, set scalars replacing), as Envoy merges a
/// `combined_validation_context`.
pub fn combine(
    default: &tlspb::CertificateValidationContext,
    dynamic: &tlspb::CertificateValidationContext,
) -> tlspb::CertificateValidationContext {
    let mut out = default.clone();
    // Protobuf merge semantics are those of the wire format: decoding a second message into
    // the first merges it.
    if out.merge(dynamic.encode_to_vec().as_slice()).is_err() {
        return dynamic.clone();
    }
    out
}

fn sha256(data: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, data);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Lowercase hex SHA-256 of a DER certificate, as Envoy prints it (`Hash=` in XFCC).
pub fn sha256_hex(der: &[u8]) -> String {
    use std::fmt::Write;
    sha256(der)
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

impl CertValidation {
    /// `identity` collects the bytes of every file read, so an unchanged context compares
    /// equal across pushes (the upstream side keys its connection pools on it). Files and
    /// variables come from `src`.
    pub fn parse(
        vc: &tlspb::CertificateValidationContext,
        identity: &mut Vec<u8>,
        side: Side,
        src: &dyn DataSources,
    ) -> Result<CertValidation, String> {
        let at = |f: &str| format!("validation_context.{f} is not supported");
        if vc.crl.is_some() {
            return Err(at("crl"));
        }
        if vc.allow_expired_certificate {
            return Err(at("allow_expired_certificate"));
        }
        if vc.trust_chain_verification != 0 {
            return Err(at("trust_chain_verification"));
        }
        if vc.custom_validator_config.is_some() {
            return Err(at("custom_validator_config"));
        }
        if vc.ca_certificate_provider_instance.is_some() {
            return Err(at("ca_certificate_provider_instance"));
        }
        if vc.system_root_certs.is_some() {
            return Err(at("system_root_certs"));
        }
        if vc.max_verify_depth.is_some() {
            return Err(at("max_verify_depth"));
        }
        if vc.watched_directory.is_some() {
            return Err(at("watched_directory"));
        }
        if side == Side::Downstream && vc.only_verify_leaf_cert_crl {
            return Err(at("only_verify_leaf_cert_crl"));
        }
        let roots = match &vc.trusted_ca {
            Some(ca) => {
                let pem = read(Some(ca), "validation_context.trusted_ca", identity, src)?;
                let mut roots = rustls::RootCertStore::empty();
                for c in rustls_pemfile::certs(&mut &pem[..]) {
                    let c = c.map_err(|e| {
                        format!("validation_context.trusted_ca: malformed PEM: {e}")
                    })?;
                    roots
                        .add(c)
                        .map_err(|e| format!("validation_context.trusted_ca: {e}"))?;
                }
                if roots.is_empty() {
                    return Err("validation_context.trusted_ca: no certificate found".into());
                }
                Some(Arc::new(roots))
            }
            None => None,
        };
        let mut sans = Vec::new();
        if !vc.match_typed_subject_alt_names.is_empty() {
            // Envoy ignores the deprecated list when the typed one is set.
            use tlspb::subject_alt_name_matcher::SanType as T;
            for (i, m) in vc.match_typed_subject_alt_names.iter().enumerate() {
                let at = format!("validation_context.match_typed_subject_alt_names[{i}]");
                let kind = match T::try_from(m.san_type) {
                    Ok(T::Dns) => SanKind::Dns,
                    Ok(T::Uri) => SanKind::Uri,
                    Ok(T::Email) => SanKind::Email,
                    Ok(T::IpAddress) => SanKind::Ip,
                    Ok(T::OtherName) => {
                        return Err(format!("{at}: san_type OTHER_NAME is not supported"))
                    }
                    Ok(T::Unspecified) | Err(_) => {
                        return Err(format!("{at}: san_type must be set"))
                    }
                };
                let matcher = m
                    .matcher
                    .as_ref()
                    .ok_or_else(|| format!("{at}: matcher is required"))
                    .and_then(|s| {
                        super::route::string_matcher(s).map_err(|e| format!("{at}: {e}"))
                    })?;
                sans.push(SanMatcher { kind, matcher });
            }
        } else {
            #[allow(deprecated)]
            for (i, m) in vc.match_subject_alt_names.iter().enumerate() {
                let at = format!("validation_context.match_subject_alt_names[{i}]");
                // The untyped matchers apply to DNS, URI, email and IP SANs alike.
                for kind in [SanKind::Dns, SanKind::Uri, SanKind::Email, SanKind::Ip] {
                    let matcher =
                        super::route::string_matcher(m).map_err(|e| format!("{at}: {e}"))?;
                    sans.push(SanMatcher { kind, matcher });
                }
            }
        }
        if !sans.is_empty() && roots.is_none() {
            return Err(
                "validation_context: SAN-based verification of peer certificates without trusted CA is insecure and not allowed"
                    .into(),
            );
        }
        let mut hashes = Vec::new();
        for (i, h) in vc.verify_certificate_hash.iter().enumerate() {
            let hex: String = h.chars().filter(|c| *c != ':').collect();
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|j| hex.get(j..j + 2).and_then(|b| u8::from_str_radix(b, 16).ok()))
                .collect::<Option<Vec<u8>>>()
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .ok_or_else(|| {
                    format!("validation_context.verify_certificate_hash[{i}]: Invalid hex-encoded SHA-256 {h}")
                })?;
            identity.extend_from_slice(&bytes);
            hashes.push(bytes);
        }
        let mut spkis = Vec::new();
        for (i, s) in vc.verify_certificate_spki.iter().enumerate() {
            let bytes = base64_decode(s)
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .ok_or_else(|| {
                    format!("validation_context.verify_certificate_spki[{i}]: Invalid base64-encoded SHA-256 {s}")
                })?;
            identity.extend_from_slice(&bytes);
            spkis.push(bytes);
        }
        Ok(CertValidation {
            roots,
            sans,
            hashes,
            spkis,
            suppress_ca_list: vc.suppress_client_ca_list,
        })
    }

    /// Whether the context checks anything at all (Envoy asks a client for a certificate
    /// only then, unless `require_client_certificate` says so).
    pub fn checks_anything(&self) -> bool {
        self.roots.is_some() || !self.hashes.is_empty() || !self.spkis.is_empty()
    }

    /// The checks after the chain's: SANs, then pinned hashes (either kind matching passes).
    pub fn check_leaf(&self, der: &[u8]) -> Result<(), Refusal> {
        if !self.sans.is_empty() {
            let have = sans(der).map_err(|_| Refusal::Encoding)?;
            if !self.sans.iter().any(|m| have.iter().any(|s| m.matches(s))) {
                return Err(Refusal::San);
            }
        }
        if !self.hashes.is_empty() || !self.spkis.is_empty() {
            let hash_ok = !self.hashes.is_empty() && self.hashes.contains(&sha256(der));
            let spki_ok = !self.spkis.is_empty() && {
                let (_, cert) =
                    x509_parser::parse_x509_certificate(der).map_err(|_| Refusal::Encoding)?;
                self.spkis
                    .contains(&sha256(cert.tbs_certificate.subject_pki.raw))
            };
            if !hash_ok && !spki_ok {
                return Err(Refusal::Hash);
            }
        }
        Ok(())
    }
}

/// Standard base64 with padding, as Envoy's `verify_certificate_spki` entries are written.
fn base64_decode(s: &str) -> Option<Vec<u8>> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).ok()
}

#[cfg(test)]
#[path = "validation_tests.rs"]
mod validation_tests;
