//! ES256 tokens and the JWKS that verifies them, for the JWT tests.

use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::json;

fn b64(b: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

pub struct Signer(EcdsaKeyPair);

impl Signer {
    #[allow(clippy::new_without_default)]
    pub fn new() -> Signer {
        let rng = SystemRandom::new();
        let pkcs8 =
            EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).expect("key");
        Signer(
            EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
                .expect("key"),
        )
    }

    /// A JWKS holding this key under `kid`.
    pub fn jwks(&self, kid: &str) -> String {
        let p = self.0.public_key().as_ref();
        json!({"keys": [{"kty":"EC","crv":"P-256","alg":"ES256","kid":kid,"x":b64(&p[1..33]),"y":b64(&p[33..65])}]})
            .to_string()
    }

    pub fn token(&self, kid: &str, claims: serde_json::Value) -> String {
        let h = b64(json!({"alg": "ES256", "kid": kid, "typ": "JWT"})
            .to_string()
            .as_bytes());
        let p = b64(claims.to_string().as_bytes());
        let msg = format!("{h}.{p}");
        let sig = self
            .0
            .sign(&SystemRandom::new(), msg.as_bytes())
            .expect("sign");
        format!("{msg}.{}", b64(sig.as_ref()))
    }
}

/// Seconds since the epoch.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
