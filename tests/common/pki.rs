//! A test certificate authority (rcgen): leaf certificates for backends and listeners, and
//! the roots and rustls configs clients and servers need.

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

pub struct Pki {
    pub ca: rcgen::Certificate,
    pub ca_key: rcgen::KeyPair,
}

/// A leaf certificate and its key, in PEM and DER.
pub struct Leaf {
    pub cert: String,
    pub key: String,
    pub der: Vec<u8>,
    pub key_der: Vec<u8>,
}

impl Pki {
    pub fn new(name: &str) -> Pki {
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let ca = params.self_signed(&ca_key).expect("CA cert");
        Pki { ca, ca_key }
    }

    /// A leaf with DNS (or IP) SANs for `names`.
    pub fn leaf(&self, names: &[&str]) -> Leaf {
        self.leaf_with_uris(names, &[])
    }

    /// A leaf with DNS (or IP) SANs for `names` and URI SANs for `uris`.
    pub fn leaf_with_uris(&self, names: &[&str], uris: &[&str]) -> Leaf {
        let key = rcgen::KeyPair::generate().expect("leaf key");
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("leaf params");
        for u in uris {
            params.subject_alt_names.push(rcgen::SanType::URI(
                rcgen::Ia5String::try_from(u.to_string()).expect("uri"),
            ));
        }
        let cert = params
            .signed_by(&key, &self.ca, &self.ca_key)
            .expect("leaf cert");
        Leaf {
            cert: cert.pem(),
            key: key.serialize_pem(),
            der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        }
    }

    pub fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    pub fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from(self.ca.der().to_vec()))
            .expect("add CA");
        roots
    }

    /// A server config holding a new certificate for `names`.
    pub fn server(&self, names: &[&str]) -> rustls::ServerConfig {
        let leaf = self.leaf(names);
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(leaf.der)],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf.key_der)),
        )
        .expect("server config")
    }

    /// A client trusting this CA only.
    pub fn client(&self) -> tokio_rustls::TlsConnector {
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(self.roots())
        .with_no_client_auth();
        tokio_rustls::TlsConnector::from(Arc::new(cfg))
    }
}
