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
    pub config: Arc<rustls::ClientConfig>,
    /// Keeps pingora's connection pool from mixing connections of different TLS settings
    /// (its reuse hash leaves out the custom connector): the hash of `identity`.
    pub group_key: u64,
    /// The transport socket as configured plus every file it read: equal identities make
    /// equal sockets, so an unchanged cluster compares equal across pushes.
    identity: Vec<u8>,
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
    pub matches: Vec<SocketMatch>,
}

#[derive(Debug, PartialEq)]
pub struct SocketMatch {
    pub name: String,
    /// Every label must be in the endpoint's (or its locality's) match metadata, equal.
    pub labels: Vec<(String, Label)>,
    pub socket: Option<Arc<UpstreamTls>>,
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
    pub fn translate(c: &cpb::Cluster, http2: bool) -> Result<TransportSockets, String> {
        let fallback: &[u8] = if http2 { b"h2" } else { b"http/1.1" };
        let default = match &c.transport_socket {
            Some(ts) => socket(ts, fallback).map_err(|e| format!("transport_socket: {e}"))?,
            None => None,
        };
        let mut matches = Vec::with_capacity(c.transport_socket_matches.len());
        for (i, m) in c.transport_socket_matches.iter().enumerate() {
            let at = format!("transport_socket_matches[{i}] '{}'", m.name);
            let socket = match &m.transport_socket {
                Some(ts) => {
                    socket(ts, fallback).map_err(|e| format!("{at}.transport_socket: {e}"))?
                }
                None => None,
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
            });
        }
        if c.transport_socket_matcher.is_some() {
            return Err("transport_socket_matcher is not supported yet".into());
        }
        Ok(TransportSockets { default, matches })
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

/// A transport socket: None for raw buffer, else the TLS socket.
fn socket(
    ts: &corepb::TransportSocket,
    alpn_fallback: &[u8],
) -> Result<Option<Arc<UpstreamTls>>, String> {
    use corepb::transport_socket::ConfigType;
    match &ts.config_type {
        Some(ConfigType::TypedConfig(a)) if a.type_url == RAW_BUFFER_TYPE => Ok(None),
        Some(ConfigType::TypedConfig(a)) if a.type_url == UPSTREAM_TLS_TYPE => {
            let ctx = tlspb::UpstreamTlsContext::decode(a.value.as_slice())
                .map_err(|e| format!("typed_config: cannot decode: {e}"))?;
            let mut identity = ts.encode_to_vec();
            identity.extend_from_slice(alpn_fallback);
            UpstreamTls::translate(&ctx, alpn_fallback, &mut identity)
                .map(|t| Some(Arc::new(t)))
                .map_err(|e| format!("'{}': {e}", ts.name))
        }
        Some(ConfigType::TypedConfig(a)) => Err(format!(
            "'{}': typed_config {} is not supported",
            ts.name, a.type_url
        )),
        None if ts.name == "envoy.transport_sockets.raw_buffer" => Ok(None),
        None => Err(format!("'{}' is not supported", ts.name)),
    }
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

fn read(
    d: Option<&corepb::DataSource>,
    field: &str,
    identity: &mut Vec<u8>,
) -> Result<Vec<u8>, String> {
    let bytes = super::tls::data_source(d, field)?;
    identity.extend_from_slice(&bytes);
    Ok(bytes)
}

fn validator(
    vc: &tlspb::CertificateValidationContext,
    identity: &mut Vec<u8>,
) -> Result<Validator, String> {
    let v = CertValidation::parse(vc, identity, Side::Upstream)?;
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

impl UpstreamTls {
    /// `identity` holds the transport socket's encoding; the files read are appended.
    fn translate(
        ctx: &tlspb::UpstreamTlsContext,
        alpn_fallback: &[u8],
        identity: &mut Vec<u8>,
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
        if !c.tls_certificate_sds_secret_configs.is_empty() {
            return Err(
                "common_tls_context.tls_certificate_sds_secret_configs is not supported yet for upstream TLS"
                    .into(),
            );
        }
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
        let validator = match &c.validation_context_type {
            None => Validator {
                chain: None,
                check: CertValidation::default(),
                algorithms: rustls::crypto::ring::default_provider()
                    .signature_verification_algorithms,
            },
            Some(V::ValidationContext(vc)) => {
                validator(vc, identity).map_err(|e| format!("common_tls_context.{e}"))?
            }
            Some(V::ValidationContextSdsSecretConfig(_)) => {
                return Err(
                    "common_tls_context.validation_context_sds_secret_config is not supported yet for upstream TLS"
                        .into(),
                )
            }
            Some(V::CombinedValidationContext(_)) => {
                return Err(
                    "common_tls_context.combined_validation_context is not supported yet for upstream TLS"
                        .into(),
                )
            }
            // The deprecated certificate provider fields.
            Some(_) => {
                return Err(
                    "common_tls_context: validation context certificate providers are not supported"
                        .into(),
                )
            }
        };
        let client_cert = match c.tls_certificates.as_slice() {
            [] => None,
            [one] => {
                let mut cert = one.clone();
                // The files' contents count for equality; the names are already in `identity`.
                if let Some(d) = &one.certificate_chain {
                    cert.certificate_chain = Some(corepb::DataSource {
                        specifier: Some(corepb::data_source::Specifier::InlineBytes(read(
                            Some(d),
                            "common_tls_context.tls_certificates[0].certificate_chain",
                            identity,
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
                        )?)),
                        ..Default::default()
                    });
                }
                Some(
                    super::tls::tls_certificate(&cert)
                        .map_err(|e| format!("common_tls_context.tls_certificates[0]: {e}"))?,
                )
            }
            _ => {
                return Err(
                    "common_tls_context.tls_certificates: Multiple TLS certificates are not supported for client contexts"
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
        if let Some(p) = &c.tls_params {
            if !p.ecdh_curves.is_empty() {
                return Err("common_tls_context.tls_params.ecdh_curves is not supported".into());
            }
            if !p.signature_algorithms.is_empty() {
                return Err(
                    "common_tls_context.tls_params.signature_algorithms is not supported".into(),
                );
            }
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&versions)
            .map_err(|e| format!("common_tls_context.tls_params: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(validator));
        let mut config = match client_cert {
            Some(ck) => builder.with_client_cert_resolver(Arc::new(ClientCert(ck))),
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = if c.alpn_protocols.is_empty() {
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
        let group_key = xxhash_rust::xxh64::xxh64(identity, 0);
        Ok(UpstreamTls {
            sni,
            config: Arc::new(config),
            group_key,
            identity: std::mem::take(identity),
        })
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
}

impl EndpointTls {
    pub fn new(
        tls: Arc<UpstreamTls>,
        addr: std::net::SocketAddr,
        keepalive: Option<super::cluster::TcpKeepalive>,
    ) -> EndpointTls {
        let mut key = tls.group_key.to_le_bytes().to_vec();
        key.extend_from_slice(addr.to_string().as_bytes());
        EndpointTls {
            group_key: xxhash_rust::xxh64::xxh64(&key, 1),
            tls,
            addr,
            keepalive,
        }
    }
}
