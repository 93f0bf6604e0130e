//! Upstream TLS (`envoy.transport_sockets.tls` with an `UpstreamTlsContext`) on a cluster, and
//! `transport_socket_matches` picking a transport socket per endpoint.
//!
//! pingora's rustls connector cannot give Envoy's semantics: it skips all verification when no
//! SNI is sent, always checks the hostname against the SNI, has no SAN matchers and no version
//! limits, and rebuilds its client config per connection. So a TLS cluster's connections are
//! made by [`UpstreamTls`] itself, as pingora's custom L4 connector: TCP, then the handshake
//! with a rustls config built once here, handed to pingora as a plain (virtual) stream.

use std::sync::Arc;

use envoy_types::pb::envoy::config::cluster::v3 as cpb;
use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3 as tlspb;
use envoy_types::pb::google::protobuf::{value::Kind, Value};
use prost::Message;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, SignatureScheme};

use super::sds::SdsRef;
use super::tls::SecretDef;
#[cfg(test)]
use super::validation::{dns_name_match, SanKind};
#[cfg(test)]
use super::validation::{sans, San, SanMatcher};
use super::validation::{CertValidation, Refusal, Side};

pub const UPSTREAM_TLS_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext";
const RAW_BUFFER_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer";
/// The `filter_metadata` key Envoy's `transport_socket_matches` read.
pub const MATCH_KEY: &str = "envoy.transport_socket_match";

/// One upstream TLS transport socket, ready to connect with.
#[derive(Debug)]
pub struct UpstreamTls {
    /// `sni`; None sends no server name at all, as Envoy does for an empty `sni`.
    pub sni: Option<ServerName<'static>>,
    /// None while a secret it needs has not come over SDS: a connection then fails, as
    /// Envoy's does for a socket whose secret is not supplied yet.
    pub config: Option<Arc<rustls::ClientConfig>>,
    /// Keeps pingora's connection pool from mixing connections of different TLS settings
    /// (its reuse hash leaves out the custom connector): the hash of `identity`.
    pub group_key: u64,
    /// The socket has no `alpn_protocols`: it offers the cluster's protocol (Envoy's fallback).
    pub alpn_fallback: bool,
    /// The transport socket as configured plus every file and SDS secret it read: equal
    /// identities make equal sockets, so an unchanged cluster compares equal across pushes,
    /// and a rotated secret makes a socket whose connections are pooled apart.
    identity: Vec<u8>,
    /// What comes over SDS, and everything else the config is built from once it is in.
    sds: Option<Arc<Parts>>,
}

/// Where the client certificate comes from.
#[derive(Debug)]
enum CertPart {
    None,
    Inline(Arc<CertifiedKey>),
    Sds(SdsRef),
}

/// Where the validation context comes from.
#[derive(Debug)]
enum ValidationPart {
    Inline(Arc<Validator>),
    /// `validation_context_sds_secret_config` (an empty default) or a
    /// `combined_validation_context`: the secret merged over the default, as Envoy merges it.
    Sds {
        secret: SdsRef,
        default: Box<tlspb::CertificateValidationContext>,
    },
}

/// A socket's settings before its secrets: everything a `ClientConfig` is built from.
#[derive(Debug)]
struct Parts {
    versions: Vec<&'static rustls::SupportedProtocolVersion>,
    provider: Arc<rustls::crypto::CryptoProvider>,
    alpn: Vec<Vec<u8>>,
    cert: CertPart,
    validation: ValidationPart,
}

/// A socket built with its SDS secrets, and the secrets it was built from.
pub type BuiltSocket = (Arc<UpstreamTls>, Vec<Arc<SecretDef>>);

/// A secret as the store holds it: its translation and its encoding (the encoding counts
/// for the socket's identity).
pub type SecretLookup<'a> = dyn Fn(&SdsRef) -> Option<(Arc<SecretDef>, &'a [u8])> + 'a;

impl Parts {
    fn build(
        &self,
        cert: Option<Arc<CertifiedKey>>,
        validator: Arc<Validator>,
    ) -> Result<Arc<rustls::ClientConfig>, String> {
        let builder = rustls::ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&self.versions)
            .map_err(|e| format!("common_tls_context.tls_params: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(validator);
        let mut config = match cert {
            Some(ck) => builder.with_client_cert_resolver(Arc::new(ClientCert(ck))),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = self.alpn.clone();
        Ok(Arc::new(config))
    }

    fn sds_refs(&self) -> impl Iterator<Item = &SdsRef> {
        let cert = match &self.cert {
            CertPart::Sds(r) => Some(r),
            _ => None,
        };
        let validation = match &self.validation {
            ValidationPart::Sds { secret, .. } => Some(secret),
            ValidationPart::Inline(_) => None,
        };
        cert.into_iter().chain(validation)
    }
}

impl PartialEq for UpstreamTls {
    fn eq(&self, other: &Self) -> bool {
        self.identity == other.identity
    }
}

/// A cluster's transport sockets: the default (`transport_socket`, None for raw buffer) and the
/// `transport_socket_matches`, in order.
#[derive(Debug, Default, PartialEq)]
pub struct TransportSockets {
    pub default: Option<Arc<UpstreamTls>>,
    /// The default socket is an `internal_upstream` one (around `default`).
    pub default_internal: Option<InternalUpstream>,
    pub matches: Vec<SocketMatch>,
}

#[derive(Debug, PartialEq)]
pub struct SocketMatch {
    pub name: String,
    /// Every label must be in the endpoint's (or its locality's) match metadata, equal.
    pub labels: Vec<(String, Label)>,
    pub socket: Option<Arc<UpstreamTls>>,
    /// The socket is an `internal_upstream` one, `socket` its inner socket.
    pub internal: Option<InternalUpstream>,
}

/// `envoy.transport_sockets.internal_upstream`: on a connection to an internal listener it
/// passes metadata to that listener's connection; on any connection it is its inner socket
/// (only raw buffer is supported inside). Of the metadata, only the endpoint's
/// `envoy.filters.listener.original_dst` struct is read by anything Portico runs (the
/// original_dst listener filter, an ORIGINAL_DST cluster's `metadata_key`); the rest (istiod's
/// `istio` cluster and host metadata) feeds telemetry filters only, so it cannot matter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InternalUpstream {
    /// `passthrough_metadata` has the host's `envoy.filters.listener.original_dst`.
    pub passes_orig_dst: bool,
}

/// A metadata value as `transport_socket_matches` compares it.
#[derive(Debug, Clone, PartialEq)]
pub enum Label {
    Null,
    Number(f64),
    String(String),
    Bool(bool),
    /// Structs and lists, compared by their encoding.
    Other(Vec<u8>),
}

impl Label {
    fn from_value(v: &Value) -> Label {
        match &v.kind {
            None | Some(Kind::NullValue(_)) => Label::Null,
            Some(Kind::NumberValue(n)) => Label::Number(*n),
            Some(Kind::StringValue(s)) => Label::String(s.clone()),
            Some(Kind::BoolValue(b)) => Label::Bool(*b),
            Some(_) => Label::Other(v.encode_to_vec()),
        }
    }
}

/// An endpoint's `envoy.transport_socket_match` metadata, and its locality's.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SocketLabels {
    pub endpoint: Option<Vec<(String, Label)>>,
    pub locality: Option<Vec<(String, Label)>>,
}

/// The `envoy.transport_socket_match` entry of a metadata, as labels.
pub fn labels(m: Option<&corepb::Metadata>) -> Option<Vec<(String, Label)>> {
    let s = m?.filter_metadata.get(MATCH_KEY)?;
    let mut v: Vec<(String, Label)> = s
        .fields
        .iter()
        .map(|(k, v)| (k.clone(), Label::from_value(v)))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    Some(v)
}

impl TransportSockets {
    /// `http2`: what the cluster speaks upstream, offered by ALPN when a socket has no
    /// `alpn_protocols` (Envoy's fallback: `h2` or `http/1.1`).
    pub fn translate(
        c: &cpb::Cluster,
        http2: bool,
        src: &dyn DataSources,
    ) -> Result<TransportSockets, String> {
        let fallback: &[u8] = if http2 { b"h2" } else { b"http/1.1" };
        let (default, default_internal) = match &c.transport_socket {
            Some(ts) => socket(ts, fallback, src).map_err(|e| format!("transport_socket: {e}"))?,
            None => (None, None),
        };
        let mut matches = Vec::with_capacity(c.transport_socket_matches.len());
        for (i, m) in c.transport_socket_matches.iter().enumerate() {
            let at = format!("transport_socket_matches[{i}] '{}'", m.name);
            let (socket, internal) = match &m.transport_socket {
                Some(ts) => {
                    socket(ts, fallback, src).map_err(|e| format!("{at}.transport_socket: {e}"))?
                }
                None => (None, None),
            };
            let mut labels: Vec<(String, Label)> = m
                .r#match
                .as_ref()
                .map(|s| {
                    s.fields
                        .iter()
                        .map(|(k, v)| (k.clone(), Label::from_value(v)))
                        .collect()
                })
                .unwrap_or_default();
            labels.sort_by(|a, b| a.0.cmp(&b.0));
            matches.push(SocketMatch {
                name: m.name.clone(),
                labels,
                socket,
                internal,
            });
        }
        if c.transport_socket_matcher.is_some() {
            return Err("transport_socket_matcher is not supported yet".into());
        }
        Ok(TransportSockets {
            default,
            default_internal,
            matches,
        })
    }

    /// The socket `pick` chose, when it is an `internal_upstream` one.
    pub fn internal(&self, i: usize) -> Option<InternalUpstream> {
        match i {
            0 => self.default_internal,
            i => self.matches.get(i - 1).and_then(|m| m.internal),
        }
    }

    /// Whether a TLS socket offers the cluster's protocol by ALPN for want of its own list.
    pub fn alpn_fallback_used(&self) -> bool {
        self.all().flatten().any(|t| t.alpn_fallback)
    }

    pub fn any_tls(&self) -> bool {
        self.default.is_some() || self.matches.iter().any(|m| m.socket.is_some())
    }

    /// The socket for an endpoint: 0 the default, `i + 1` the match `i`. Envoy looks for a
    /// match in the endpoint's metadata first, then in its locality's.
    pub fn pick(&self, labels: Option<&SocketLabels>) -> usize {
        let Some(labels) = labels else {
            return self.first_match(None).unwrap_or(0);
        };
        self.first_match(labels.endpoint.as_deref())
            .or_else(|| self.first_match(labels.locality.as_deref()))
            .unwrap_or(0)
    }

    fn first_match(&self, have: Option<&[(String, Label)]>) -> Option<usize> {
        self.matches
            .iter()
            .position(|m| {
                m.labels
                    .iter()
                    .all(|(k, v)| have.is_some_and(|h| h.iter().any(|(hk, hv)| hk == k && hv == v)))
            })
            .map(|i| i + 1)
    }

    /// The socket `pick` chose.
    pub fn get(&self, i: usize) -> Option<&Arc<UpstreamTls>> {
        match i {
            0 => self.default.as_ref(),
            i => self.matches.get(i - 1).and_then(|m| m.socket.as_ref()),
        }
    }
}

/// istiod's ambient sockets: connections to an internal listener (`connect_originate`).
const INTERNAL_UPSTREAM_TYPE: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport";

/// A transport socket: the TLS socket (None for raw buffer), and whether it is an
/// `internal_upstream` socket around it.
type Socket = (Option<Arc<UpstreamTls>>, Option<InternalUpstream>);

fn socket(
    ts: &corepb::TransportSocket,
    alpn_fallback: &[u8],
    src: &dyn DataSources,
) -> Result<Socket, String> {
    use corepb::transport_socket::ConfigType;
    match &ts.config_type {
        Some(ConfigType::TypedConfig(a)) if a.type_url == RAW_BUFFER_TYPE => Ok((None, None)),
        Some(ConfigType::TypedConfig(a)) if a.type_url == UPSTREAM_TLS_TYPE => {
            let ctx = tlspb::UpstreamTlsContext::decode(a.value.as_slice())
                .map_err(|e| format!("typed_config: cannot decode: {e}"))?;
            let mut identity = ts.encode_to_vec();
            identity.extend_from_slice(alpn_fallback);
            UpstreamTls::translate(&ctx, alpn_fallback, &mut identity, src)
                .map(|t| (Some(Arc::new(t)), None))
                .map_err(|e| format!("'{}': {e}", ts.name))
        }
        Some(ConfigType::TypedConfig(a)) if a.type_url == INTERNAL_UPSTREAM_TYPE => {
            internal_upstream(&a.value, src).map_err(|e| format!("'{}': {e}", ts.name))
        }
        Some(ConfigType::TypedConfig(a)) => Err(format!(
            "'{}': typed_config {} is not supported",
            ts.name, a.type_url
        )),
        None if ts.name == "envoy.transport_sockets.raw_buffer" => Ok((None, None)),
        None => Err(format!("'{}' is not supported", ts.name)),
    }
}

fn internal_upstream(bytes: &[u8], src: &dyn DataSources) -> Result<Socket, String> {
    use envoy_types::pb::envoy::extensions::transport_sockets::internal_upstream::v3::InternalUpstreamTransport;
    use envoy_types::pb::envoy::r#type::metadata::v3::metadata_kind::Kind as MK;
    let t = InternalUpstreamTransport::decode(bytes)
        .map_err(|e| format!("typed_config: cannot decode: {e}"))?;
    let mut passes_orig_dst = false;
    for (i, m) in t.passthrough_metadata.iter().enumerate() {
        let at = format!("passthrough_metadata[{i}]");
        match m.kind.as_ref().and_then(|k| k.kind.as_ref()) {
            Some(MK::Host(_)) => passes_orig_dst |= m.name == super::cluster::ORIG_DST_NS,
            // Cluster metadata under that name would be read as the endpoint's is; Portico
            // does not carry a cluster's metadata, so it refuses rather than drops it.
            Some(MK::Cluster(_)) if m.name == super::cluster::ORIG_DST_NS => {
                return Err(format!(
                    "{at}: the cluster's '{}' metadata is not supported (only the host's)",
                    m.name
                ))
            }
            // Other namespaces (istiod: `istio`, `istio.peer_metadata`) feed telemetry and
            // peer-metadata filters only.
            Some(MK::Cluster(_)) => {}
            _ => {
                return Err(format!(
                    "{at}.kind: only host and cluster metadata can be passed"
                ))
            }
        }
    }
    // The inner socket: TLS inside the tunnel (a DestinationRule's SIMPLE/MUTUAL TLS over
    // HBONE) is not implemented.
    match &t.transport_socket {
        None => {}
        Some(inner) => match socket(inner, b"", src)? {
            (None, None) => {}
            (Some(_), _) => {
                return Err(
                    "transport_socket: TLS inside an internal_upstream socket (TLS over HBONE) is not supported yet"
                        .into(),
                )
            }
            (None, Some(_)) => {
                return Err("transport_socket: an internal_upstream socket inside another".into())
            }
        },
    }
    Ok((None, Some(InternalUpstream { passes_orig_dst })))
}

/// Envoy's default certificate validator: nothing checked without a validation context; with
/// `trusted_ca` the chain (never the hostname); with SAN matchers, one of the certificate's
/// SANs must match one of them.
#[derive(Debug)]
struct Validator {
    chain: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    check: CertValidation,
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Validator {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        use rustls::CertificateError as CE;
        if let Some(chain) = &self.chain {
            // webpki checks the name last, so a name error means the chain was good.
            match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
                Ok(_)
                | Err(rustls::Error::InvalidCertificate(
                    CE::NotValidForName | CE::NotValidForNameContext { .. },
                )) => {}
                Err(e) => return Err(e),
            }
        }
        self.check
            .check_leaf(end_entity.as_ref())
            .map_err(|r| match r {
                Refusal::Encoding => rustls::Error::InvalidCertificate(CE::BadEncoding),
                Refusal::San | Refusal::Hash => {
                    rustls::Error::InvalidCertificate(CE::ApplicationVerificationFailure)
                }
            })?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// The client certificate, whatever the server asks for, as Envoy presents its only one.
#[derive(Debug)]
struct ClientCert(Arc<CertifiedKey>);

impl rustls::client::ResolvesClientCert for ClientCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

use super::sources::{DataSources, NoFiles};
use super::validation::read;

fn validator(
    vc: &tlspb::CertificateValidationContext,
    identity: &mut Vec<u8>,
    src: &dyn DataSources,
) -> Result<Validator, String> {
    let v = CertValidation::parse(vc, identity, Side::Upstream, src)?;
    let provider = rustls::crypto::ring::default_provider();
    let chain = match &v.roots {
        Some(roots) => Some(
            rustls::client::WebPkiServerVerifier::builder_with_provider(
                roots.clone(),
                Arc::new(provider.clone()),
            )
            .build()
            .map_err(|e| format!("validation_context.trusted_ca: {e}"))?,
        ),
        None => None,
    };
    Ok(Validator {
        chain,
        check: v,
        algorithms: provider.signature_verification_algorithms,
    })
}

fn no_validation() -> Validator {
    Validator {
        chain: None,
        check: CertValidation::default(),
        algorithms: rustls::crypto::ring::default_provider().signature_verification_algorithms,
    }
}

fn sds_ref(c: &tlspb::SdsSecretConfig, field: &str) -> Result<SdsRef, String> {
    SdsRef::parse(c, &format!("common_tls_context.{field}"))
}

impl UpstreamTls {
    /// `identity` holds the transport socket's encoding; the files read are appended.
    fn translate(
        ctx: &tlspb::UpstreamTlsContext,
        alpn_fallback: &[u8],
        identity: &mut Vec<u8>,
        src: &dyn DataSources,
    ) -> Result<UpstreamTls, String> {
        if ctx.allow_renegotiation {
            return Err("allow_renegotiation is not supported".into());
        }
        if ctx.auto_host_sni {
            return Err("auto_host_sni is not supported yet".into());
        }
        if ctx.auto_sni_san_validation {
            return Err("auto_sni_san_validation is not supported yet".into());
        }
        let empty = tlspb::CommonTlsContext::default();
        let c = ctx.common_tls_context.as_ref().unwrap_or(&empty);
        if c.tls_certificate_provider_instance.is_some() || c.custom_handshaker.is_some() {
            return Err(
                "common_tls_context: tls_certificate_provider_instance and custom_handshaker are not supported"
                    .into(),
            );
        }
        if c.custom_tls_certificate_selector.is_some() {
            return Err(
                "common_tls_context.custom_tls_certificate_selector is not supported".into(),
            );
        }
        if c.key_log.is_some() {
            return Err("common_tls_context.key_log is not supported".into());
        }
        use tlspb::common_tls_context::ValidationContextType as V;
        let validation = match &c.validation_context_type {
            None => ValidationPart::Inline(Arc::new(no_validation())),
            Some(V::ValidationContext(vc)) => ValidationPart::Inline(Arc::new(
                validator(vc, identity, src).map_err(|e| format!("common_tls_context.{e}"))?,
            )),
            Some(V::ValidationContextSdsSecretConfig(sds)) => ValidationPart::Sds {
                secret: sds_ref(sds, "validation_context_sds_secret_config")?,
                default: Box::default(),
            },
            Some(V::CombinedValidationContext(cv)) => {
                let at = "common_tls_context.combined_validation_context";
                #[allow(deprecated)]
                if cv.validation_context_certificate_provider.is_some()
                    || cv
                        .validation_context_certificate_provider_instance
                        .is_some()
                {
                    return Err(format!(
                        "{at}: validation context certificate providers are not supported"
                    ));
                }
                let Some(default) = &cv.default_validation_context else {
                    return Err(format!("{at}.default_validation_context: is required"));
                };
                let Some(sds) = &cv.validation_context_sds_secret_config else {
                    return Err(format!(
                        "{at}.validation_context_sds_secret_config: is required"
                    ));
                };
                // The default half alone must be valid apart from what the secret brings
                // (the CA), so its own mistakes are refused with the cluster.
                // Kept with its CA read, so the secret completes it without reading.
                let default = super::validation::read_sources(default, src);
                let mut alone = default.clone();
                alone.match_typed_subject_alt_names.clear();
                #[allow(deprecated)]
                alone.match_subject_alt_names.clear();
                CertValidation::parse(&alone, &mut Vec::new(), Side::Upstream, src)
                    .map_err(|e| format!("{at}.default_{e}"))?;
                let typed = default
                    .match_typed_subject_alt_names
                    .iter()
                    .filter_map(|m| m.matcher.as_ref());
                #[allow(deprecated)]
                let untyped = default.match_subject_alt_names.iter();
                for (i, m) in typed.chain(untyped).enumerate() {
                    super::route::string_matcher(m).map_err(|e| {
                        format!("{at}.default_validation_context: SAN matcher {i}: {e}")
                    })?;
                }
                ValidationPart::Sds {
                    secret: sds_ref(
                        sds,
                        "combined_validation_context.validation_context_sds_secret_config",
                    )?,
                    default: Box::new(default),
                }
            }
            // The deprecated certificate provider fields.
            Some(_) => return Err(
                "common_tls_context: validation context certificate providers are not supported"
                    .into(),
            ),
        };
        let cert = match (
            c.tls_certificates.as_slice(),
            c.tls_certificate_sds_secret_configs.as_slice(),
        ) {
            ([], []) => CertPart::None,
            ([one], []) => {
                let mut cert = one.clone();
                // The files' contents count for equality; the names are already in `identity`.
                if let Some(d) = &one.certificate_chain {
                    cert.certificate_chain = Some(corepb::DataSource {
                        specifier: Some(corepb::data_source::Specifier::InlineBytes(read(
                            Some(d),
                            "common_tls_context.tls_certificates[0].certificate_chain",
                            identity,
                            src,
                        )?)),
                        ..Default::default()
                    });
                }
                if let Some(d) = &one.private_key {
                    cert.private_key = Some(corepb::DataSource {
                        specifier: Some(corepb::data_source::Specifier::InlineBytes(read(
                            Some(d),
                            "common_tls_context.tls_certificates[0].private_key",
                            identity,
                            src,
                        )?)),
                        ..Default::default()
                    });
                }
                CertPart::Inline(
                    super::tls::tls_certificate(&cert, &NoFiles)
                        .map_err(|e| format!("common_tls_context.tls_certificates[0]: {e}"))?,
                )
            }
            ([], [sds]) => CertPart::Sds(sds_ref(sds, "tls_certificate_sds_secret_configs[0]")?),
            ([_, ..], [_, ..]) => {
                return Err(
                    "common_tls_context: tls_certificates and tls_certificate_sds_secret_configs are exclusive"
                        .into(),
                )
            }
            ([_, _, ..], []) => {
                return Err(
                    "common_tls_context.tls_certificates: Multiple TLS certificates are not supported for client contexts"
                        .into(),
                )
            }
            ([], [_, _, ..]) => {
                return Err(
                    "common_tls_context.tls_certificate_sds_secret_configs: Multiple TLS certificates are not supported for client contexts"
                        .into(),
                )
            }
        };
        let versions = super::tls::protocol_versions(c.tls_params.as_ref(), 2)
            .map_err(|e| format!("common_tls_context.{e}"))?;
        let mut provider = rustls::crypto::ring::default_provider();
        if let Some(suites) = super::tls::cipher_suites(c.tls_params.as_ref())
            .map_err(|e| format!("common_tls_context.{e}"))?
        {
            provider.cipher_suites.retain(|s| {
                s.version() == &rustls::version::TLS13
                    || suites.iter().any(|x| x.suite() == s.suite())
            });
        }
        if let Some(groups) = super::tls::kx_groups(c.tls_params.as_ref())
            .map_err(|e| format!("common_tls_context.{e}"))?
        {
            provider.kx_groups = groups;
        }
        if let Some(p) = &c.tls_params {
            if !p.signature_algorithms.is_empty() {
                return Err(
                    "common_tls_context.tls_params.signature_algorithms is not supported".into(),
                );
            }
        }
        let alpn_fallback_used = c.alpn_protocols.is_empty();
        let alpn = if alpn_fallback_used {
            vec![alpn_fallback.to_vec()]
        } else {
            c.alpn_protocols
                .iter()
                .map(|p| p.as_bytes().to_vec())
                .collect()
        };
        let sni = match ctx.sni.as_str() {
            "" => None,
            s => Some(ServerName::try_from(s.to_string()).map_err(|e| format!("sni '{s}': {e}"))?),
        };
        let parts = Parts {
            versions,
            provider: Arc::new(provider),
            alpn,
            cert,
            validation,
        };
        let needs_sds = parts.sds_refs().next().is_some();
        let (config, sds) = if needs_sds {
            (None, Some(Arc::new(parts)))
        } else {
            let cert = match &parts.cert {
                CertPart::Inline(ck) => Some(ck.clone()),
                CertPart::None | CertPart::Sds(_) => None,
            };
            let validator = match &parts.validation {
                ValidationPart::Inline(v) => v.clone(),
                ValidationPart::Sds { .. } => Arc::new(no_validation()),
            };
            (Some(parts.build(cert, validator)?), None)
        };
        let group_key = xxhash_rust::xxh64::xxh64(identity, 0);
        Ok(UpstreamTls {
            alpn_fallback: alpn_fallback_used,
            sni,
            config,
            group_key,
            identity: std::mem::take(identity),
            sds,
        })
    }

    /// The SDS secrets this socket is built from (none for a socket built at translation).
    pub fn sds_refs(&self) -> impl Iterator<Item = &SdsRef> {
        self.sds.iter().flat_map(|p| p.sds_refs())
    }

    /// The socket built with its SDS secrets and the secrets used; Ok(None) while one has not
    /// arrived. A secret of the wrong kind, or a validation secret that does not complete its
    /// context into a valid one, is an error naming it.
    pub fn with_secrets(&self, lookup: &SecretLookup<'_>) -> Result<Option<BuiltSocket>, String> {
        let Some(parts) = &self.sds else {
            return Err("this socket needs no SDS secret".into());
        };
        let mut identity = self.identity.clone();
        let mut used = Vec::with_capacity(2);
        let mut fetch = |r: &SdsRef| -> Option<Arc<SecretDef>> {
            let (def, bytes) = lookup(r)?;
            identity.extend_from_slice(r.name.as_bytes());
            identity.extend_from_slice(bytes);
            used.push(def.clone());
            Some(def)
        };
        let cert = match &parts.cert {
            CertPart::None => None,
            CertPart::Inline(ck) => Some(ck.clone()),
            CertPart::Sds(r) => {
                let Some(secret) = fetch(r) else {
                    return Ok(None);
                };
                Some(secret.cert.clone().ok_or_else(|| {
                    format!(
                        "secret '{}' is used as a client certificate but holds no tls_certificate",
                        r.name
                    )
                })?)
            }
        };
        let validator = match &parts.validation {
            ValidationPart::Inline(v) => v.clone(),
            ValidationPart::Sds { secret, default } => {
                let Some(s) = fetch(secret) else {
                    return Ok(None);
                };
                let vc = s.validation.as_ref().ok_or_else(|| {
                    format!(
                        "secret '{}' is used as a validation context but holds no validation_context",
                        secret.name
                    )
                })?;
                let combined = super::validation::combine(default, vc);
                Arc::new(
                    validator(&combined, &mut Vec::new(), &NoFiles).map_err(|e| {
                        format!(
                        "common_tls_context: the validation context completed by secret '{}': {e}",
                        secret.name
                    )
                    })?,
                )
            }
        };
        let config = parts.build(cert, validator)?;
        Ok(Some((
            Arc::new(UpstreamTls {
                alpn_fallback: self.alpn_fallback,
                sni: self.sni.clone(),
                config: Some(config),
                group_key: xxhash_rust::xxh64::xxh64(&identity, 0),
                identity,
                sds: None,
            }),
            used,
        )))
    }
}

/// A cluster's sockets built with their SDS secrets: per socket index (see
/// [`TransportSockets::get`]), and the secrets used, in order.
#[derive(Debug, Default)]
pub struct Resolved {
    pub sockets: Vec<Option<Arc<UpstreamTls>>>,
    pub secrets: Vec<Arc<SecretDef>>,
}

impl TransportSockets {
    fn all(&self) -> impl Iterator<Item = Option<&Arc<UpstreamTls>>> {
        std::iter::once(self.default.as_ref()).chain(self.matches.iter().map(|m| m.socket.as_ref()))
    }

    /// Whether a socket needs SDS secrets before it can connect.
    pub fn needs_sds(&self) -> bool {
        self.sds_refs().next().is_some()
    }

    pub fn sds_refs(&self) -> impl Iterator<Item = &SdsRef> {
        self.all().flatten().flat_map(|s| s.sds_refs())
    }

    /// Every socket with its secrets; Ok(None) while one has not arrived (the cluster warms).
    pub fn resolve(&self, lookup: &SecretLookup<'_>) -> Result<Option<Resolved>, String> {
        let mut out = Resolved::default();
        for socket in self.all() {
            let built = match socket {
                Some(s) if s.sds.is_some() => match s.with_secrets(lookup)? {
                    Some((built, used)) => {
                        out.secrets.extend(used);
                        Some(built)
                    }
                    None => return Ok(None),
                },
                other => other.cloned(),
            };
            out.sockets.push(built);
        }
        Ok(Some(out))
    }
}

#[cfg(test)]
#[path = "upstream_tls_tests.rs"]
mod upstream_tls_tests;

/// One endpoint's TLS connection settings: the socket and where it connects. Built with the
/// cluster, one per TLS host, so a request only clones an `Arc`.
#[derive(Debug)]
pub struct EndpointTls {
    pub tls: Arc<UpstreamTls>,
    pub addr: std::net::SocketAddr,
    /// Keeps pooled connections per socket settings and endpoint apart: pingora's pool
    /// sees every relayed connection at the same (local) address.
    pub group_key: u64,
    /// The cluster's `tcp_keepalive`, set on the TCP connection under the session.
    pub keepalive: Option<super::cluster::TcpKeepalive>,
    /// The cluster's `upstream_bind_config`: the local address bound before connecting.
    pub bind: Option<std::net::SocketAddr>,
}

impl EndpointTls {
    pub fn new(
        tls: Arc<UpstreamTls>,
        addr: std::net::SocketAddr,
        keepalive: Option<super::cluster::TcpKeepalive>,
    ) -> EndpointTls {
        EndpointTls::with_bind(tls, addr, keepalive, None)
    }

    pub fn with_bind(
        tls: Arc<UpstreamTls>,
        addr: std::net::SocketAddr,
        keepalive: Option<super::cluster::TcpKeepalive>,
        bind: Option<std::net::SocketAddr>,
    ) -> EndpointTls {
        let mut key = tls.group_key.to_le_bytes().to_vec();
        key.extend_from_slice(addr.to_string().as_bytes());
        if let Some(b) = bind {
            key.extend_from_slice(b.to_string().as_bytes());
        }
        EndpointTls {
            group_key: xxhash_rust::xxh64::xxh64(&key, 1),
            tls,
            addr,
            keepalive,
            bind,
        }
    }
}
