//! Downstream TLS (`envoy.transport_sockets.tls` with a `DownstreamTlsContext`) and the rustls
//! server configs built from it.
//!
//! Translation parses certificates and keys up front, so a bad one is rejected with the push;
//! the `ServerConfig` is built once per accepted config, never per connection.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tlspb;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

use super::sources::{data_source, DataSources, NoFiles};
use super::validation::{CertValidation, Side};

pub const DOWNSTREAM_TLS_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext";
pub const TLS_INSPECTOR_TYPE: &str =
    "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector";

/// Where a chain's certificate comes from.
#[derive(Debug, Clone)]
pub enum CertSource {
    /// `tls_certificates`, in order (the first is the default).
    Inline(Vec<Arc<CertifiedKey>>),
    /// `tls_certificate_sds_secret_configs`, over ADS or from an SDS cluster, in order.
    Sds(Vec<super::sds::SdsRef>),
}

/// Where a chain's client-certificate validation comes from.
#[derive(Debug, Clone)]
pub enum ClientValidation {
    /// No validation context: clients are not asked for a certificate.
    None,
    Inline(Arc<CertValidation>),
    /// `validation_context_sds_secret_config`, or a `combined_validation_context` whose
    /// default half is merged under the secret.
    Sds {
        sds: super::sds::SdsRef,
        default: Option<Box<tlspb::CertificateValidationContext>>,
    },
}

/// The parts of a `DownstreamTlsContext` Portico applies.
#[derive(Debug)]
pub struct DownstreamTls {
    pub cert: CertSource,
    pub validation: ClientValidation,
    /// `require_client_certificate`: a client without a certificate fails the handshake.
    pub require_client_cert: bool,
    /// Session tickets (Envoy's default; `disable_stateless_session_resumption` turns them
    /// off): the only way TLS 1.3 sessions resume in Envoy.
    pub tickets: bool,
    /// The TLS 1.2 session cache (`disable_stateful_session_resumption` turns it off).
    pub session_cache: bool,
    /// Wire-format protocol names, in the configured preference order.
    pub alpn: Vec<Vec<u8>>,
    pub versions: Vec<&'static rustls::SupportedProtocolVersion>,
    /// TLS 1.2 suites when `cipher_suites` is set; TLS 1.3 suites are not configurable in
    /// Envoy either.
    pub tls12_suites: Option<Vec<rustls::SupportedCipherSuite>>,
    /// `tls_params.ecdh_curves` (None: the defaults).
    pub kx_groups: Option<Vec<&'static dyn rustls::crypto::SupportedKxGroup>>,
    /// Built here when the certificate is inline; SDS chains get theirs once the secret is in.
    pub inline_config: Option<Arc<TlsServer>>,
}

/// What a handshake uses: one config offering the chain's ALPN list and one offering none.
/// Envoy (BoringSSL) carries on without ALPN when the client offers nothing it knows, where
/// rustls would fail the handshake, so the acceptor picks the second config for such clients.
#[derive(Debug)]
pub struct TlsServer {
    pub with_alpn: Arc<rustls::ServerConfig>,
    pub without_alpn: Arc<rustls::ServerConfig>,
    pub alpn: Vec<Vec<u8>>,
    /// The URI SANs of the chain's own certificate: `By=` in `x-forwarded-client-cert`.
    pub local_uris: Arc<[String]>,
}

impl TlsServer {
    /// The config for a client offering `offered` (None: no ALPN extension).
    pub fn for_client<'a>(
        &self,
        mut offered: Option<impl Iterator<Item = &'a [u8]>>,
    ) -> Arc<rustls::ServerConfig> {
        let overlap = offered
            .as_mut()
            .is_some_and(|o| o.any(|p| self.alpn.iter().any(|a| a == p)));
        if overlap || self.alpn.is_empty() {
            self.with_alpn.clone()
        } else {
            self.without_alpn.clone()
        }
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Parses a PEM certificate chain and private key into a key rustls can sign with, checking
/// that they belong together.
pub fn certified_key(chain_pem: &[u8], key_pem: &[u8]) -> Result<Arc<CertifiedKey>, String> {
    let chain: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut &chain_pem[..])
        .collect::<Result<_, _>>()
        .map_err(|e| format!("certificate_chain: malformed PEM: {e}"))?;
    if chain.is_empty() {
        return Err("certificate_chain: no certificate found".into());
    }
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut &key_pem[..])
        .map_err(|e| format!("private_key: malformed PEM: {e}"))?
        .ok_or("private_key: no private key found")?;
    let signer = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| format!("private_key: {e}"))?;
    let ck = CertifiedKey::new(chain, signer);
    match ck.keys_match() {
        // rustls cannot read some public keys; the handshake then shows any mismatch.
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => {}
        Err(e) => return Err(format!("private_key does not match certificate_chain: {e}")),
    }
    Ok(Arc::new(ck))
}

/// A `TlsCertificate` (inline, a file, or an SDS secret's `tls_certificate`).
pub fn tls_certificate(
    c: &tlspb::TlsCertificate,
    src: &dyn DataSources,
) -> Result<Arc<CertifiedKey>, String> {
    if c.private_key_provider.is_some() {
        return Err("private_key_provider is not supported".into());
    }
    if c.password.is_some() {
        return Err("password (encrypted private keys) is not supported".into());
    }
    let chain = data_source(c.certificate_chain.as_ref(), "certificate_chain", src)?;
    let key = data_source(c.private_key.as_ref(), "private_key", src)?;
    certified_key(&chain, &key)
}

/// TLS 1.2 suites BoringSSL (so Envoy) knows but rustls does not implement: RSA key exchange,
/// CBC modes, PSK and 3DES.
const BORINGSSL_ONLY: [&str; 14] = [
    "ECDHE-PSK-CHACHA20-POLY1305",
    "ECDHE-ECDSA-AES128-SHA",
    "ECDHE-RSA-AES128-SHA",
    "ECDHE-PSK-AES128-CBC-SHA",
    "ECDHE-ECDSA-AES256-SHA",
    "ECDHE-RSA-AES256-SHA",
    "ECDHE-PSK-AES256-CBC-SHA",
    "AES128-GCM-SHA256",
    "AES256-GCM-SHA384",
    "AES128-SHA",
    "PSK-AES128-CBC-SHA",
    "AES256-SHA",
    "PSK-AES256-CBC-SHA",
    "DES-CBC3-SHA",
];

/// Envoy's TLS 1.2 cipher names (BoringSSL's) that rustls implements.
fn tls12_suite(name: &str) -> Option<rustls::SupportedCipherSuite> {
    use rustls::crypto::ring::cipher_suite as cs;
    Some(match name {
        "ECDHE-ECDSA-AES128-GCM-SHA256" => cs::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        "ECDHE-ECDSA-AES256-GCM-SHA384" => cs::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        "ECDHE-ECDSA-CHACHA20-POLY1305" => cs::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        "ECDHE-RSA-AES128-GCM-SHA256" => cs::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        "ECDHE-RSA-AES256-GCM-SHA384" => cs::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        "ECDHE-RSA-CHACHA20-POLY1305" => cs::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        _ => return None,
    })
}

/// The versions `tls_params` allows; TLS_AUTO and unset mean TLS 1.2 at least and `auto_max`
/// at most (Envoy's servers: 1.3; its clients: 1.2).
pub fn protocol_versions(
    p: Option<&tlspb::TlsParameters>,
    auto_max: u8,
) -> Result<Vec<&'static rustls::SupportedProtocolVersion>, String> {
    use tlspb::tls_parameters::TlsProtocol as P;
    let rank = |v: i32, field: &str, auto: u8| -> Result<u8, String> {
        match P::try_from(v) {
            Ok(P::TlsAuto) => Ok(auto),
            Ok(P::TlSv12) => Ok(2),
            Ok(P::TlSv13) => Ok(3),
            Ok(P::TlSv10 | P::TlSv11) => Err(format!(
                "tls_params.{field}: {} is not supported (only TLSv1_2 and TLSv1_3)",
                P::try_from(v).map(|p| p.as_str_name()).unwrap_or("?")
            )),
            Err(_) => Err(format!("tls_params.{field}: unknown protocol version {v}")),
        }
    };
    let (min, max) = match p {
        Some(p) => (
            rank(
                p.tls_minimum_protocol_version,
                "tls_minimum_protocol_version",
                2,
            )?,
            rank(
                p.tls_maximum_protocol_version,
                "tls_maximum_protocol_version",
                auto_max,
            )?,
        ),
        None => (2, auto_max),
    };
    if min > max {
        return Err(
            "tls_params: tls_minimum_protocol_version is above tls_maximum_protocol_version".into(),
        );
    }
    let mut v = Vec::new();
    if max >= 3 {
        v.push(&rustls::version::TLS13);
    }
    if min <= 2 {
        v.push(&rustls::version::TLS12);
    }
    Ok(v)
}

/// The key exchange groups `tls_params.ecdh_curves` names, in order (None: rustls's
/// defaults, which are BoringSSL's: X25519, P-256, P-384).
pub fn kx_groups(
    p: Option<&tlspb::TlsParameters>,
) -> Result<Option<Vec<&'static dyn rustls::crypto::SupportedKxGroup>>, String> {
    use rustls::crypto::ring::kx_group;
    let Some(p) = p.filter(|p| !p.ecdh_curves.is_empty()) else {
        return Ok(None);
    };
    let mut groups: Vec<&'static dyn rustls::crypto::SupportedKxGroup> = Vec::new();
    let mut skipped = Vec::new();
    for (i, name) in p.ecdh_curves.iter().enumerate() {
        match name.as_str() {
            "X25519" => groups.push(kx_group::X25519),
            "P-256" => groups.push(kx_group::SECP256R1),
            "P-384" => groups.push(kx_group::SECP384R1),
            // BoringSSL has these; rustls with ring does not.
            "P-224" | "P-521" | "X25519MLKEM768" | "X25519Kyber768Draft00" => {
                skipped.push(name.clone())
            }
            _ => {
                return Err(format!(
                    "tls_params.ecdh_curves[{i}]: '{name}' is not a known curve"
                ))
            }
        }
    }
    if groups.is_empty() {
        return Err(format!(
            "tls_params.ecdh_curves: none of {} is supported (X25519, P-256 and P-384 are)",
            skipped.join(", ")
        ));
    }
    if !skipped.is_empty() {
        tracing::warn!(
            "tls_params.ecdh_curves: {} not offered (rustls does not implement them)",
            skipped.join(", ")
        );
    }
    Ok(Some(groups))
}

/// The TLS 1.2 suites `tls_params.cipher_suites` names (None: rustls's defaults). TLS 1.3
/// suites are not configurable in Envoy either.
pub fn cipher_suites(
    p: Option<&tlspb::TlsParameters>,
) -> Result<Option<Vec<rustls::SupportedCipherSuite>>, String> {
    Ok(match p {
        Some(p) if !p.cipher_suites.is_empty() => {
            let mut suites = Vec::new();
            let mut skipped = Vec::new();
            for (i, name) in p.cipher_suites.iter().enumerate() {
                // BoringSSL's equal-preference groups, "[A|B]".
                let group = name.trim_start_matches('[').trim_end_matches(']');
                for n in group.split('|') {
                    match tls12_suite(n) {
                        Some(s) => suites.push(s),
                        // istiod's default list names two of these; Envoy accepts it, so
                        // they are left out rather than the whole listener refused.
                        None if BORINGSSL_ONLY.contains(&n) => skipped.push(n.to_string()),
                        None => {
                            return Err(format!(
                                "tls_params.cipher_suites[{i}]: '{n}' is not a known cipher suite"
                            ))
                        }
                    }
                }
            }
            if suites.is_empty() {
                return Err(format!(
                    "tls_params.cipher_suites: none of {} is supported (rustls has no RSA key exchange, CBC, PSK or 3DES suites)",
                    skipped.join(", ")
                ));
            }
            if !skipped.is_empty() {
                tracing::warn!(
                    "tls_params.cipher_suites: {} not offered (rustls does not implement them)",
                    skipped.join(", ")
                );
            }
            Some(suites)
        }
        _ => None,
    })
}

impl DownstreamTls {
    /// The `typed_config` of an `envoy.transport_sockets.tls` transport socket.
    pub fn from_any(any: &Any, src: &dyn DataSources) -> Result<DownstreamTls, String> {
        if any.type_url != DOWNSTREAM_TLS_TYPE {
            return Err(format!(
                "typed_config: expected {DOWNSTREAM_TLS_TYPE}, got {}",
                any.type_url
            ));
        }
        let ctx = tlspb::DownstreamTlsContext::decode(any.value.as_slice())
            .map_err(|e| format!("typed_config: cannot decode: {e}"))?;
        DownstreamTls::translate(&ctx, src)
    }

    pub fn translate(
        ctx: &tlspb::DownstreamTlsContext,
        src: &dyn DataSources,
    ) -> Result<DownstreamTls, String> {
        // `require_sni` is accepted and not enforced: Envoy 1.40 does not implement it either
        // (not-implemented-hide in its API; it serves clients without SNI).
        if ctx.ocsp_staple_policy != 0 {
            return Err("ocsp_staple_policy is not supported".into());
        }
        let empty = tlspb::CommonTlsContext::default();
        let c = ctx.common_tls_context.as_ref().unwrap_or(&empty);
        let validation = client_validation(c, src)?;
        if matches!(
            ctx.session_ticket_keys_type,
            Some(
                tlspb::downstream_tls_context::SessionTicketKeysType::SessionTicketKeys(_)
                    | tlspb::downstream_tls_context::SessionTicketKeysType::SessionTicketKeysSdsSecretConfig(_)
            )
        ) {
            // Envoy's ticket format is its own; tickets stay valid on this instance only.
            tracing::warn!(
                "session_ticket_keys: Portico issues tickets with keys of its own (not shared with other instances)"
            );
        }
        // Accepted: `prefer_client_ciphers` (which suite a handshake settles on, among those
        // both sides allow; BoringSSL's equal-preference groups have no rustls counterpart),
        // `full_scan_certs_on_sni_mismatch` (which certificate a client whose SNI matches
        // none gets), `TlsCertificate.ocsp_staple` (no staple is sent; a client that asks
        // for one carries on without it).
        if c.custom_tls_certificate_selector.is_some() {
            return Err(
                "common_tls_context.custom_tls_certificate_selector is not supported".into(),
            );
        }
        if c.tls_params
            .as_ref()
            .is_some_and(|p| !p.compliance_policies.is_empty())
        {
            return Err("tls_params.compliance_policies are not supported".into());
        }
        if c.tls_certificate_provider_instance.is_some() || c.custom_handshaker.is_some() {
            return Err(
                "common_tls_context: tls_certificate_provider_instance and custom_handshaker are not supported"
                    .into(),
            );
        }
        let cert = match (
            c.tls_certificates.as_slice(),
            c.tls_certificate_sds_secret_configs.as_slice(),
        ) {
            (inline, []) if !inline.is_empty() => CertSource::Inline(
                inline
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        tls_certificate(c, src).map_err(|e| format!("tls_certificates[{i}]: {e}"))
                    })
                    .collect::<Result<_, _>>()?,
            ),
            ([], sds) if !sds.is_empty() => CertSource::Sds(
                sds.iter()
                    .enumerate()
                    .map(|(i, c)| {
                        super::sds::SdsRef::parse(
                            c,
                            &format!("tls_certificate_sds_secret_configs[{i}]"),
                        )
                    })
                    .collect::<Result<_, _>>()?,
            ),
            ([], []) => {
                return Err("No TLS certificates found for server context".into());
            }
            _ => {
                // Envoy's rule too.
                return Err(
                    "common_tls_context: tls_certificates and tls_certificate_sds_secret_configs may not be mixed"
                        .into(),
                );
            }
        };
        let versions = protocol_versions(c.tls_params.as_ref(), 3)?;
        let tls12_suites = cipher_suites(c.tls_params.as_ref())?;
        let kx_groups = kx_groups(c.tls_params.as_ref())?;
        if let Some(p) = &c.tls_params {
            if !p.signature_algorithms.is_empty() {
                return Err("tls_params.signature_algorithms is not supported".into());
            }
        }
        let mut tls = DownstreamTls {
            cert,
            validation,
            require_client_cert: ctx
                .require_client_certificate
                .as_ref()
                .is_some_and(|b| b.value),
            tickets: !matches!(
                ctx.session_ticket_keys_type,
                Some(tlspb::downstream_tls_context::SessionTicketKeysType::DisableStatelessSessionResumption(true))
            ),
            session_cache: !ctx.disable_stateful_session_resumption,
            alpn: c
                .alpn_protocols
                .iter()
                .map(|p| p.as_bytes().to_vec())
                .collect(),
            versions,
            tls12_suites,
            kx_groups,
            inline_config: None,
        };
        match (&tls.cert, &tls.validation) {
            (CertSource::Inline(certs), ClientValidation::None) => {
                tls.inline_config = Some(tls.server(certs.clone(), None)?);
            }
            (CertSource::Inline(certs), ClientValidation::Inline(v)) => {
                tls.inline_config = Some(tls.server(certs.clone(), Some(v.clone()))?);
            }
            _ => {}
        }
        Ok(tls)
    }

    /// The handshake configs for `cert`, checking client certificates by `validation`.
    pub fn server(
        &self,
        certs: Vec<Arc<CertifiedKey>>,
        validation: Option<Arc<CertValidation>>,
    ) -> Result<Arc<TlsServer>, String> {
        let resolver: Arc<dyn rustls::server::ResolvesServerCert> = match certs.as_slice() {
            [one] => Arc::new(Fixed(one.clone())),
            _ => Arc::new(BySni::new(&certs)?),
        };
        let Some(first) = certs.first() else {
            return Err("No TLS certificates found for server context".into());
        };
        // `By=` names the default certificate's identity.
        let local_uris: Arc<[String]> = first
            .end_entity_cert()
            .ok()
            .and_then(|der| super::validation::sans(der.as_ref()).ok())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|s| match s {
                super::validation::San::Uri(u) => Some(u),
                _ => None,
            })
            .collect();
        let verifier = client_verifier(validation, self.require_client_cert)?;
        // One ticket key set for both configs of the chain.
        let ticketer = if self.tickets {
            Some(
                rustls::crypto::ring::Ticketer::new()
                    .map_err(|e| format!("session tickets: {e}"))?,
            )
        } else {
            None
        };
        let mut p = rustls::crypto::ring::default_provider();
        if let Some(groups) = &self.kx_groups {
            p.kx_groups = groups.clone();
        }
        if let Some(suites) = &self.tls12_suites {
            p.cipher_suites.retain(|s| {
                s.version() == &rustls::version::TLS13
                    || suites.iter().any(|x| x.suite() == s.suite())
            });
        }
        let build = |alpn: Vec<Vec<u8>>| -> Result<Arc<rustls::ServerConfig>, String> {
            let cfg = rustls::ServerConfig::builder_with_provider(Arc::new(p.clone()))
                .with_protocol_versions(&self.versions)
                .map_err(|e| format!("tls_params: {e}"))?;
            let cfg = match &verifier {
                Some(v) => cfg.with_client_cert_verifier(v.clone()),
                None => cfg.with_no_client_auth(),
            };
            let mut cfg = cfg.with_cert_resolver(resolver.clone());
            match &ticketer {
                Some(t) => cfg.ticketer = t.clone(),
                // Envoy resumes TLS 1.3 sessions only by tickets.
                None => cfg.send_tls13_tickets = 0,
            }
            if !self.session_cache {
                cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
            }
            cfg.alpn_protocols = alpn;
            Ok(Arc::new(cfg))
        };
        Ok(Arc::new(TlsServer {
            with_alpn: build(self.alpn.clone())?,
            without_alpn: build(Vec::new())?,
            alpn: self.alpn.clone(),
            local_uris,
        }))
    }

    /// The SDS secrets the chain waits for: its certificate's and its validation context's.
    pub fn sds_refs(&self) -> impl Iterator<Item = &super::sds::SdsRef> {
        let cert: &[super::sds::SdsRef] = match &self.cert {
            CertSource::Sds(s) => s,
            CertSource::Inline(_) => &[],
        };
        let validation = match &self.validation {
            ClientValidation::Sds { sds, .. } => Some(sds),
            _ => None,
        };
        cert.iter().chain(validation)
    }

    /// The names of `sds_refs`.
    pub fn sds_names(&self) -> impl Iterator<Item = &str> {
        self.sds_refs().map(|r| r.name.as_str())
    }
}

/// The chain's client certificate validation, as configured.
fn client_validation(
    c: &tlspb::CommonTlsContext,
    src: &dyn DataSources,
) -> Result<ClientValidation, String> {
    use tlspb::common_tls_context::ValidationContextType as V;
    let at = "common_tls_context";
    Ok(match &c.validation_context_type {
        None => ClientValidation::None,
        Some(V::ValidationContext(vc)) => ClientValidation::Inline(Arc::new(
            CertValidation::parse(vc, &mut Vec::new(), Side::Downstream, src)
                .map_err(|e| format!("{at}.{e}"))?,
        )),
        Some(V::ValidationContextSdsSecretConfig(sds)) => ClientValidation::Sds {
            sds: super::sds::SdsRef::parse(
                sds,
                &format!("{at}.validation_context_sds_secret_config"),
            )?,
            default: None,
        },
        Some(V::CombinedValidationContext(cv)) => {
            let sds = cv.validation_context_sds_secret_config.as_ref().ok_or_else(|| {
                format!("{at}.combined_validation_context.validation_context_sds_secret_config is required")
            })?;
            #[allow(deprecated)]
            if cv.validation_context_certificate_provider.is_some()
                || cv
                    .validation_context_certificate_provider_instance
                    .is_some()
            {
                return Err(format!(
                    "{at}.combined_validation_context: certificate providers are not supported"
                ));
            }
            ClientValidation::Sds {
                sds: super::sds::SdsRef::parse(
                    sds,
                    &format!(
                        "{at}.combined_validation_context.validation_context_sds_secret_config"
                    ),
                )?,
                // Envoy parses this half only merged with each secret; its CA is read now.
                default: cv
                    .default_validation_context
                    .as_ref()
                    .map(|d| Box::new(super::validation::read_sources(d, src))),
            }
        }
        Some(_) => {
            return Err(format!(
                "{at}: validation context certificate providers are not supported"
            ))
        }
    })
}

/// Resolves an SDS validation context: the secret's, merged over the default half. Both were
/// read at translation, so nothing is read here.
pub fn sds_validation(
    default: Option<&tlspb::CertificateValidationContext>,
    secret: &tlspb::CertificateValidationContext,
) -> Result<Arc<CertValidation>, String> {
    let vc = match default {
        Some(d) => super::validation::combine(d, secret),
        None => secret.clone(),
    };
    CertValidation::parse(&vc, &mut Vec::new(), Side::Downstream, &NoFiles).map(Arc::new)
}

/// The client verifier for a chain: None when clients are not asked for a certificate.
fn client_verifier(
    validation: Option<Arc<CertValidation>>,
    require: bool,
) -> Result<Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>, String> {
    let v = validation.unwrap_or_default();
    // Envoy (BoringSSL) asks for a certificate only when something would check it: with
    // nothing to check, `require_client_certificate` asks for nothing either (Envoy 1.40
    // serves such a chain to clients without a certificate, and never sees theirs).
    if !v.checks_anything() {
        return Ok(None);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = match &v.roots {
        Some(roots) => Some(
            rustls::server::WebPkiClientVerifier::builder_with_provider(
                roots.clone(),
                provider.clone(),
            )
            .allow_unauthenticated()
            .build()
            .map_err(|e| format!("validation_context.trusted_ca: {e}"))?,
        ),
        None => None,
    };
    let hints = chain
        .as_ref()
        .filter(|_| !v.suppress_ca_list)
        .map(|c| c.root_hint_subjects().to_vec())
        .unwrap_or_default();
    Ok(Some(Arc::new(ClientVerifier {
        chain,
        check: v,
        mandatory: require,
        hints,
        algorithms: provider.signature_verification_algorithms,
    })))
}

/// Envoy's default validator on the server side: the chain to `trusted_ca` when there is
/// one, then SANs and pinned hashes.
#[derive(Debug)]
struct ClientVerifier {
    chain: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
    check: Arc<CertValidation>,
    mandatory: bool,
    hints: Vec<rustls::DistinguishedName>,
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl rustls::server::danger::ClientCertVerifier for ClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        &self.hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        use rustls::CertificateError as CE;
        if let Some(chain) = &self.chain {
            chain.verify_client_cert(end_entity, intermediates, now)?;
        }
        self.check
            .check_leaf(end_entity.as_ref())
            // The listener counts refusals by these (ssl.fail_verify_san / _cert_hash).
            .map_err(|r| match r {
                super::validation::Refusal::Encoding => {
                    rustls::Error::InvalidCertificate(CE::BadEncoding)
                }
                super::validation::Refusal::San => {
                    rustls::Error::InvalidCertificate(CE::NotValidForName)
                }
                super::validation::Refusal::Hash => {
                    rustls::Error::InvalidCertificate(CE::ApplicationVerificationFailure)
                }
            })?;
        Ok(rustls::server::danger::ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// One certificate for every client, whatever its SNI, as Envoy serves a single certificate.
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl rustls::server::ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// Several certificates on one chain, chosen as Envoy chooses: the server name by exact then
/// wildcard match against each certificate's DNS SANs (its CN without any), preferring an
/// ECDSA certificate when the client can use one; without a match, the first certificate the
/// client can use, else the first.
#[derive(Debug)]
struct BySni {
    certs: Vec<(Arc<CertifiedKey>, bool)>,
    exact: std::collections::HashMap<String, Vec<usize>>,
    wildcard: std::collections::HashMap<String, Vec<usize>>,
}

impl BySni {
    fn new(certs: &[Arc<CertifiedKey>]) -> Result<BySni, String> {
        let mut out = BySni {
            certs: Vec::with_capacity(certs.len()),
            exact: Default::default(),
            wildcard: Default::default(),
        };
        for (i, ck) in certs.iter().enumerate() {
            let der = ck
                .end_entity_cert()
                .map_err(|e| format!("tls_certificates[{i}]: {e}"))?;
            let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
                .map_err(|e| format!("tls_certificates[{i}]: bad certificate: {e}"))?;
            let ecdsa = cert.public_key().algorithm.algorithm
                == x509_parser::oid_registry::OID_KEY_TYPE_EC_PUBLIC_KEY;
            let mut names: Vec<String> = super::validation::sans(der.as_ref())
                .unwrap_or_default()
                .into_iter()
                .filter_map(|s| match s {
                    super::validation::San::Dns(d) => Some(d.to_ascii_lowercase()),
                    _ => None,
                })
                .collect();
            if names.is_empty() {
                names.extend(
                    cert.subject()
                        .iter_common_name()
                        .filter_map(|cn| cn.as_str().ok())
                        .map(str::to_ascii_lowercase),
                );
            }
            for n in names {
                let slot = match n.strip_prefix("*.") {
                    Some(rest) => out.wildcard.entry(rest.to_string()).or_default(),
                    None => out.exact.entry(n).or_default(),
                };
                if !slot.contains(&i) {
                    slot.push(i);
                }
            }
            out.certs.push((ck.clone(), ecdsa));
        }
        Ok(out)
    }
}

impl rustls::server::ResolvesServerCert for BySni {
    fn resolve(&self, hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        use rustls::SignatureScheme as S;
        let ecdsa_ok = hello.signature_schemes().iter().any(|s| {
            matches!(
                s,
                S::ECDSA_NISTP256_SHA256 | S::ECDSA_NISTP384_SHA384 | S::ECDSA_NISTP521_SHA512
            )
        });
        let usable = |i: &&usize| self.certs.get(**i).is_some_and(|c| ecdsa_ok || !c.1);
        let pick = |idx: &[usize]| {
            // The client's kind first (ECDSA when it can), else the first for the name.
            idx.iter()
                .filter(usable)
                .find(|i| self.certs.get(**i).is_some_and(|c| c.1 == ecdsa_ok))
                .or_else(|| idx.iter().find(usable))
                .or(idx.first())
                .and_then(|i| self.certs.get(*i))
                .map(|c| c.0.clone())
        };
        if let Some(sni) = hello.server_name().map(str::to_ascii_lowercase) {
            if let Some(idx) = self.exact.get(&sni) {
                return pick(idx);
            }
            if let Some(idx) = sni
                .split_once('.')
                .and_then(|(_, rest)| self.wildcard.get(rest))
            {
                return pick(idx);
            }
        }
        let first = (0..self.certs.len()).find(|i| usable(&i)).unwrap_or(0);
        self.certs.get(first).map(|c| c.0.clone())
    }
}

/// An SDS `Secret` Portico can use: a certificate and key, or a validation context (a CA
/// bundle such as Istio's `ROOTCA` or `kubernetes://<name>-cacert`).
#[derive(Debug)]
pub struct SecretDef {
    pub name: String,
    pub cert: Option<Arc<CertifiedKey>>,
    /// Kept as configured: it completes the `combined_validation_context` that names it, and
    /// only the combination is parsed into a validator.
    pub validation: Option<Arc<tlspb::CertificateValidationContext>>,
}

impl SecretDef {
    pub fn translate(
        s: &tlspb::Secret,
        src: &dyn DataSources,
    ) -> Result<SecretDef, super::TranslateError> {
        use tlspb::secret::Type;
        let err = |d: String| super::TranslateError::new(format!("secret '{}'", s.name), d);
        if s.name.is_empty() {
            return Err(super::TranslateError::new(
                "secret ''",
                "name must not be empty",
            ));
        }
        let (cert, validation) = match &s.r#type {
            Some(Type::TlsCertificate(c)) => (
                Some(tls_certificate(c, src).map_err(|e| err(format!("tls_certificate: {e}")))?),
                None,
            ),
            Some(Type::ValidationContext(vc)) => {
                // The CA and pins are checked here, so a bad bundle is refused by its name;
                // SAN matchers may rely on the CA of the context the secret completes.
                // Kept with its CA read, so the contexts it completes read nothing.
                let vc = super::validation::read_sources(vc, src);
                let mut alone = vc.clone();
                alone.match_typed_subject_alt_names.clear();
                #[allow(deprecated)]
                alone.match_subject_alt_names.clear();
                super::validation::CertValidation::parse(
                    &alone,
                    &mut Vec::new(),
                    super::validation::Side::Downstream,
                    src,
                )
                .map_err(err)?;
                (None, Some(Arc::new(vc)))
            }
            // Session ticket keys and generic secrets: accepted, used by nothing.
            Some(_) => (None, None),
            None => return Err(err("a secret type is required".into())),
        };
        Ok(SecretDef {
            name: s.name.clone(),
            cert,
            validation,
        })
    }
}

#[cfg(test)]
#[path = "tls_tests.rs"]
mod tls_tests;
