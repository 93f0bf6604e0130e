//! The client certificate of an mTLS connection, as `x-forwarded-client-cert` reports it.
//!
//! What Envoy reads from the TLS session per request (hash, subject, SANs, the PEM) is worked
//! out once per handshake here, and rides with the connection to the request path in
//! pingora's connection digest (`conn::ConnInfo`).

use std::sync::Arc;

use pingora_http::RequestHeader;
use rustls::pki_types::CertificateDer;
use x509_parser::der_parser::asn1_rs::ToDer;

use crate::snapshot::listener::{ForwardClientCert, Xfcc};
use crate::snapshot::validation::{sans, sha256_hex, San};

/// A connection's peer certificate, in the forms XFCC needs.
#[derive(Debug)]
pub struct PeerCert {
    /// The URI SANs of the gateway's own certificate (`By=`).
    by: Arc<[String]>,
    hash: String,
    subject: String,
    issuer: String,
    uris: Vec<String>,
    dns: Vec<String>,
    /// URL-encoded PEM of the leaf, and of the whole chain the client sent (leaf first).
    cert: String,
    chain: String,
}

impl PeerCert {
    /// None when the client sent no certificate.
    pub fn from_chain(chain: &[CertificateDer<'_>], by: Arc<[String]>) -> Option<PeerCert> {
        let leaf = chain.first()?;
        let (subject, issuer) = match x509_parser::parse_x509_certificate(leaf.as_ref()) {
            Ok((_, c)) => (rfc2253(c.subject()), rfc2253(c.issuer())),
            Err(_) => (String::new(), String::new()),
        };
        let (mut uris, mut dns) = (Vec::new(), Vec::new());
        for s in sans(leaf.as_ref()).unwrap_or_default() {
            match s {
                San::Uri(u) => uris.push(u),
                San::Dns(d) => dns.push(d),
                _ => {}
            }
        }
        Some(PeerCert {
            by,
            hash: sha256_hex(leaf.as_ref()),
            subject,
            issuer,
            uris,
            dns,
            cert: url_encoded_pem(std::slice::from_ref(leaf)),
            chain: url_encoded_pem(chain),
        })
    }

    /// The current hop's element, in Envoy's order: By, Hash, then the configured details
    /// in the order Envoy 1.40 writes them (Cert, Chain, Subject, URI, DNS, Issuer).
    fn element(&self, x: &Xfcc) -> String {
        let mut parts: Vec<String> = self.by.iter().map(|u| format!("By={u}")).collect();
        parts.push(format!("Hash={}", self.hash));
        if x.cert {
            parts.push(format!("Cert=\"{}\"", self.cert));
        }
        if x.chain {
            parts.push(format!("Chain=\"{}\"", self.chain));
        }
        if x.subject {
            // The key is there even when the subject is empty.
            parts.push(format!("Subject=\"{}\"", self.subject));
        }
        if x.uri {
            if self.uris.is_empty() {
                parts.push("URI=".into());
            }
            parts.extend(self.uris.iter().map(|u| format!("URI={u}")));
        }
        if x.dns {
            parts.extend(self.dns.iter().map(|d| format!("DNS={d}")));
        }
        if x.issuer {
            parts.push(format!("Issuer=\"{}\"", self.issuer));
        }
        parts.join(";")
    }
}

impl crate::filters::PeerIdentity for PeerCert {
    fn uri_sans(&self) -> &[String] {
        &self.uris
    }
    fn dns_sans(&self) -> &[String] {
        &self.dns
    }
    fn subject(&self) -> &str {
        &self.subject
    }
}

/// The peer certificate of the connection a request came on, if it was mTLS.
pub fn of(digest: Option<&pingora_core::protocols::Digest>) -> Option<Arc<PeerCert>> {
    super::conn::info(digest)?.peer.clone()
}

/// The TLS server name (SNI) of the connection a request came on.
pub fn sni_of(digest: Option<&pingora_core::protocols::Digest>) -> Option<Arc<str>> {
    super::conn::info(digest)?.sni.clone()
}

const XFCC: &str = "x-forwarded-client-cert";
/// The same name parsed once: a removal by `&str` parses it on every request.
static XFCC_NAME: http::HeaderName = http::HeaderName::from_static(XFCC);

/// Envoy's connection manager on `x-forwarded-client-cert`, before routing.
pub fn mutate(
    req: &mut RequestHeader,
    x: &Xfcc,
    peer: Option<&PeerCert>,
) -> pingora_error::Result<()> {
    let peer = match (x.mode, peer) {
        (ForwardClientCert::AlwaysForwardOnly, _) => return Ok(()),
        // Without a client certificate every other mode drops what the client sent.
        (ForwardClientCert::Sanitize, _) | (_, None) => {
            // Removed only when there: a removal hashes the name in both of pingora's maps,
            // and few requests carry one (a scan of the names present costs less).
            if super::downstream::has(&req.headers, &XFCC_NAME) {
                req.remove_header(&XFCC_NAME);
            }
            return Ok(());
        }
        (ForwardClientCert::ForwardOnly, Some(_)) => return Ok(()),
        (_, Some(p)) => p,
    };
    let element = peer.element(x);
    let value = match x.mode {
        ForwardClientCert::AppendForward => {
            // Envoy keeps one XFCC header, the values joined by commas.
            let prior: Vec<&str> = req
                .headers
                .get_all(XFCC)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
                .collect();
            if prior.is_empty() {
                element
            } else {
                format!("{},{element}", prior.join(","))
            }
        }
        _ => element,
    };
    req.insert_header(XFCC, value)?;
    Ok(())
}

/// PEM as OpenSSL writes it (64-column base64, LF line ends), URL-encoded as Envoy encodes
/// it for XFCC.
fn url_encoded_pem(certs: &[CertificateDer<'_>]) -> String {
    let mut out = String::new();
    for c in certs {
        let pem = pem::encode_config(
            &pem::Pem::new("CERTIFICATE", c.as_ref().to_vec()),
            pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF),
        );
        for ch in pem.chars() {
            match ch {
                '\n' => out.push_str("%0A"),
                ' ' => out.push_str("%20"),
                '+' => out.push_str("%2B"),
                '/' => out.push_str("%2F"),
                '=' => out.push_str("%3D"),
                c => out.push(c),
            }
        }
    }
    out
}

/// OpenSSL's short names, as `X509_NAME_print_ex` with `XN_FLAG_RFC2253` prints them.
fn short_name(oid: &str) -> Option<&'static str> {
    Some(match oid {
        "2.5.4.3" => "CN",
        "2.5.4.4" => "SN",
        "2.5.4.5" => "serialNumber",
        "2.5.4.6" => "C",
        "2.5.4.7" => "L",
        "2.5.4.8" => "ST",
        "2.5.4.9" => "street",
        "2.5.4.10" => "O",
        "2.5.4.11" => "OU",
        "2.5.4.12" => "title",
        "2.5.4.13" => "description",
        "2.5.4.15" => "businessCategory",
        "2.5.4.17" => "postalCode",
        "2.5.4.41" => "name",
        "2.5.4.42" => "GN",
        "2.5.4.43" => "initials",
        "2.5.4.44" => "generationQualifier",
        "2.5.4.46" => "dnQualifier",
        "2.5.4.65" => "pseudonym",
        "0.9.2342.19200300.100.1.1" => "UID",
        "0.9.2342.19200300.100.1.25" => "DC",
        "1.2.840.113549.1.9.1" => "emailAddress",
        _ => return None,
    })
}

/// A distinguished name in RFC 2253 form, as Envoy prints subjects: the last RDN first,
/// RDNs joined by `,`, the attributes of one RDN by `+`, special characters escaped.
fn rfc2253(name: &x509_parser::x509::X509Name<'_>) -> String {
    let mut rdns = Vec::new();
    for rdn in name.iter().collect::<Vec<_>>().into_iter().rev() {
        let attrs: Vec<String> = rdn
            .iter()
            .map(|a| {
                let oid = a.attr_type().to_id_string();
                match (short_name(&oid), a.as_str()) {
                    (Some(sn), Ok(v)) => format!("{sn}={}", escape(v)),
                    // Unknown types and values that are not strings: the DER, in hex.
                    (sn, _) => {
                        let hex: String = a
                            .attr_value()
                            .to_der_vec()
                            .unwrap_or_default()
                            .iter()
                            .map(|b| format!("{b:02X}"))
                            .collect();
                        format!("{}=#{hex}", sn.map_or(oid.clone(), str::to_string))
                    }
                }
            })
            .collect();
        rdns.push(attrs.join("+"));
    }
    rdns.join(",")
}

fn escape(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    let last = v.chars().count().saturating_sub(1);
    for (i, c) in v.chars().enumerate() {
        match c {
            ',' | '+' | '"' | '\\' | '<' | '>' | ';' => {
                out.push('\\');
                out.push(c);
            }
            '#' if i == 0 => out.push_str("\\#"),
            ' ' if i == 0 || i == last => out.push_str("\\ "),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\{:02X}", c as u32));
            }
            // OpenSSL escapes every byte of a non-ASCII character.
            c if !c.is_ascii() => {
                let mut b = [0u8; 4];
                for byte in c.encode_utf8(&mut b).bytes() {
                    out.push_str(&format!("\\{byte:02X}"));
                }
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(dn: &[(rcgen::DnType, &str)], sans: &[&str]) -> rcgen::Certificate {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut p =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params");
        p.distinguished_name = rcgen::DistinguishedName::new();
        for (t, v) in dn {
            p.distinguished_name.push(t.clone(), *v);
        }
        p.self_signed(&key).expect("cert")
    }

    #[test]
    fn subjects_print_as_openssl_rfc2253() {
        let c = cert(
            &[
                (rcgen::DnType::CountryName, "US"),
                (rcgen::DnType::OrganizationName, "Acme, Inc."),
                (rcgen::DnType::CommonName, " client#1 "),
            ],
            &["client.example"],
        );
        let p = PeerCert::from_chain(&[c.der().clone()], Arc::from(Vec::new())).expect("peer");
        assert_eq!(p.subject, "CN=\\ client#1\\ ,O=Acme\\, Inc.,C=US");
        assert_eq!(p.issuer, p.subject);
        assert_eq!(p.dns, vec!["client.example".to_string()]);
        assert_eq!(p.hash.len(), 64);
    }

    #[test]
    fn the_element_follows_envoys_order() {
        let c = cert(&[(rcgen::DnType::CommonName, "c")], &["a.example"]);
        let p = PeerCert::from_chain(
            &[c.der().clone()],
            Arc::from(vec!["spiffe://gw".to_string()]),
        )
        .expect("peer");
        let x = Xfcc {
            mode: ForwardClientCert::SanitizeSet,
            subject: true,
            uri: true,
            dns: true,
            ..Default::default()
        };
        assert_eq!(
            p.element(&x),
            format!(
                "By=spiffe://gw;Hash={};Subject=\"CN=c\";URI=;DNS=a.example",
                p.hash
            )
        );
        let pem = url_encoded_pem(&[c.der().clone()]);
        assert!(pem.starts_with("-----BEGIN%20CERTIFICATE-----%0A"), "{pem}");
        assert!(pem.ends_with("-----END%20CERTIFICATE-----%0A"), "{pem}");
    }

    #[test]
    fn modes_sanitize_forward_append_and_set() {
        let c = cert(&[(rcgen::DnType::CommonName, "c")], &[]);
        let p = PeerCert::from_chain(&[c.der().clone()], Arc::from(Vec::new())).expect("peer");
        let run = |mode, peer: Option<&PeerCert>| {
            let mut req = RequestHeader::build("GET", b"/", None).expect("req");
            req.insert_header(XFCC, "By=x;Hash=y").expect("hdr");
            mutate(
                &mut req,
                &Xfcc {
                    mode,
                    ..Default::default()
                },
                peer,
            )
            .expect("mutate");
            req.headers
                .get(XFCC)
                .map(|v| v.to_str().unwrap_or("").to_string())
        };
        let hash = format!("Hash={}", p.hash);
        use ForwardClientCert as F;
        assert_eq!(run(F::Sanitize, Some(&p)), None);
        assert_eq!(run(F::SanitizeSet, None), None);
        assert_eq!(run(F::ForwardOnly, None), None);
        assert_eq!(
            run(F::AlwaysForwardOnly, None).as_deref(),
            Some("By=x;Hash=y")
        );
        assert_eq!(
            run(F::ForwardOnly, Some(&p)).as_deref(),
            Some("By=x;Hash=y")
        );
        assert_eq!(run(F::SanitizeSet, Some(&p)), Some(hash.clone()));
        assert_eq!(
            run(F::AppendForward, Some(&p)),
            Some(format!("By=x;Hash=y,{hash}"))
        );
    }
}
