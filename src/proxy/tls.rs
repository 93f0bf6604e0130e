//! The downstream TLS path: what Envoy's TLS inspector reads from the ClientHello (without
//! consuming it), and the handshake with the chain's config.

use std::sync::Arc;

use pingora_core::protocols::ALPN;
use tokio::net::TcpStream;

use crate::snapshot::listener::Codec;
use crate::snapshot::tls::TlsServer;

/// What the TLS inspector learnt: TLS or not, the SNI (lowercased) and the offered ALPN list.
#[derive(Debug, Default)]
pub struct Hello {
    pub tls: bool,
    pub server_name: String,
    pub alpn: Vec<String>,
}

/// Envoy's inspector gives up on a ClientHello beyond 64 KiB; such a client is not TLS to it.
const MAX_HELLO: usize = 64 * 1024;

/// Peeks at the first bytes until they parse as a ClientHello, or clearly are not one.
pub async fn inspect(tcp: &TcpStream) -> Hello {
    let mut buf = vec![0u8; 16 * 1024];
    let mut last = 0;
    loop {
        let n = match tcp.peek(&mut buf).await {
            Ok(0) | Err(_) => return Hello::default(),
            Ok(n) => n,
        };
        // A TLS handshake record starts 0x16 0x03; anything else is plain text to Envoy.
        if buf[0] != 0x16 || (n > 1 && buf[1] != 0x03) {
            return Hello::default();
        }
        if n > last {
            last = n;
            let mut acceptor = rustls::server::Acceptor::default();
            let mut rest = &buf[..n];
            while !rest.is_empty() {
                match acceptor.read_tls(&mut rest) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            match acceptor.accept() {
                Ok(Some(accepted)) => {
                    let hello = accepted.client_hello();
                    return Hello {
                        tls: true,
                        server_name: hello
                            .server_name()
                            .map(|s| s.to_ascii_lowercase())
                            .unwrap_or_default(),
                        alpn: hello
                            .alpn()
                            .map(|it| {
                                it.map(|p| String::from_utf8_lossy(p).into_owned())
                                    .collect()
                            })
                            .unwrap_or_default(),
                    };
                }
                Ok(None) => {}
                Err(_) => return Hello::default(),
            }
            if n == buf.len() {
                if buf.len() >= MAX_HELLO {
                    return Hello::default();
                }
                buf.resize(buf.len() * 2, 0);
                continue;
            }
        }
        // More of the ClientHello is on its way; peek returns at once while data is queued.
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Runs the handshake; returns the session and the protocol pingora should speak on it.
pub async fn handshake(
    tcp: TcpStream,
    tls: &Arc<TlsServer>,
    codec: Codec,
) -> std::io::Result<(tokio_rustls::server::TlsStream<TcpStream>, Option<ALPN>)> {
    let start =
        tokio_rustls::LazyConfigAcceptor::new(rustls::server::Acceptor::default(), tcp).await?;
    let config = tls.for_client(start.client_hello().alpn());
    let stream = start.into_stream(config).await?;
    let negotiated_h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
    // The connection manager's codec_type decides, as in Envoy; AUTO follows ALPN.
    let alpn = match codec {
        Codec::Http2 => Some(ALPN::H2),
        Codec::Http1 => None,
        Codec::Auto if negotiated_h2 => Some(ALPN::H2),
        Codec::Auto => None,
    };
    Ok((stream, alpn))
}

/// The negotiated cipher suite by its BoringSSL name, as Envoy's `ssl.ciphers.*` says it.
pub fn cipher_name(c: &rustls::ServerConnection) -> &'static str {
    use rustls::CipherSuite as S;
    match c.negotiated_cipher_suite().map(|s| s.suite()) {
        Some(S::TLS13_AES_128_GCM_SHA256) => "TLS_AES_128_GCM_SHA256",
        Some(S::TLS13_AES_256_GCM_SHA384) => "TLS_AES_256_GCM_SHA384",
        Some(S::TLS13_CHACHA20_POLY1305_SHA256) => "TLS_CHACHA20_POLY1305_SHA256",
        Some(S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256) => "ECDHE-ECDSA-AES128-GCM-SHA256",
        Some(S::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384) => "ECDHE-ECDSA-AES256-GCM-SHA384",
        Some(S::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256) => "ECDHE-ECDSA-CHACHA20-POLY1305",
        Some(S::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256) => "ECDHE-RSA-AES128-GCM-SHA256",
        Some(S::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384) => "ECDHE-RSA-AES256-GCM-SHA384",
        Some(S::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256) => "ECDHE-RSA-CHACHA20-POLY1305",
        _ => "",
    }
}

pub fn version_name(c: &rustls::ServerConnection) -> &'static str {
    match c.protocol_version() {
        Some(rustls::ProtocolVersion::TLSv1_3) => "TLSv1.3",
        Some(rustls::ProtocolVersion::TLSv1_2) => "TLSv1.2",
        _ => "",
    }
}

/// The key exchange group by its BoringSSL name (`ssl.curves.*`).
pub fn curve_name(c: &rustls::ServerConnection) -> &'static str {
    use rustls::NamedGroup as G;
    match c.negotiated_key_exchange_group().map(|g| g.name()) {
        Some(G::X25519) => "X25519",
        Some(G::secp256r1) => "P-256",
        Some(G::secp384r1) => "P-384",
        Some(G::secp521r1) => "P-521",
        _ => "",
    }
}

/// Counts a failed handshake where Envoy does: client-certificate refusals by their reason,
/// everything else as `ssl.connection_error`.
pub fn count_failure(ssl: &crate::admin::stats::SslStats, e: &std::io::Error) {
    use rustls::CertificateError as CE;
    use std::sync::atomic::Ordering::Relaxed;
    let counter = match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::NoCertificatesPresented) => &ssl.fail_verify_no_cert,
        // The client verifier reports a SAN mismatch as a name error and a pin mismatch as
        // an application failure (see `snapshot::tls`).
        Some(rustls::Error::InvalidCertificate(CE::NotValidForName)) => &ssl.fail_verify_san,
        Some(rustls::Error::InvalidCertificate(CE::ApplicationVerificationFailure)) => {
            &ssl.fail_verify_cert_hash
        }
        Some(rustls::Error::InvalidCertificate(_)) => &ssl.fail_verify_error,
        _ => &ssl.connection_error,
    };
    counter.fetch_add(1, Relaxed);
}

/// Counts a completed handshake in the listener's `ssl.*` stats, as Envoy does.
pub fn count_handshake(ssl: &crate::admin::stats::SslStats, c: &rustls::ServerConnection) {
    use std::sync::atomic::Ordering::Relaxed;
    ssl.handshake_done(cipher_name(c), version_name(c), curve_name(c));
    if c.peer_certificates().is_none() {
        ssl.no_certificate.fetch_add(1, Relaxed);
    }
    if c.handshake_kind() == Some(rustls::HandshakeKind::Resumed) {
        ssl.session_reused.fetch_add(1, Relaxed);
    }
}
