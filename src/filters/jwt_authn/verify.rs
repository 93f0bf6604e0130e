//! JWS compact tokens and JWKS as google/jwt_verify_lib (Envoy's library) reads them, verified
//! with `ring`: RS256/384/512, PS256/384/512, ES256/384, HS256/384/512 and EdDSA (Ed25519).
//! ES512 (P-521) is not in `ring`: such keys are skipped, as a key of an unsupported curve is.

use base64::Engine;
use ring::signature::{self, RsaPublicKeyComponents, UnparsedPublicKey};
use serde_json::{Map, Value};

/// jwt_verify_lib's statuses that the filter reports, with their exact strings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    JwtMissed,
    JwtNotYetValid,
    JwtExpired,
    JwtBadFormat,
    JwtHeaderParseError,
    JwtHeaderBadAlg,
    JwtHeaderNotImplementedAlg,
    JwtHeaderBadKid,
    JwtPayloadParseError,
    JwtSignatureParseError,
    JwtUnknownIssuer,
    JwtAudienceNotAllowed,
    JwtVerificationFail,
    JwksNoValidKeys,
    JwksKidAlgMismatch,
    JwksFetchFail,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::JwtMissed => "Jwt is missing",
            Status::JwtNotYetValid => "Jwt not yet valid",
            Status::JwtExpired => "Jwt is expired",
            Status::JwtBadFormat => "Jwt is not in the form of Header.Payload.Signature",
            Status::JwtHeaderParseError => {
                "Jwt header is an invalid Base64url input or an invalid JSON"
            }
            Status::JwtHeaderBadAlg => "Jwt header [alg] field is not a string",
            Status::JwtHeaderNotImplementedAlg => "Jwt header [alg] field value is invalid",
            Status::JwtHeaderBadKid => "Jwt header [kid] field is not a string",
            Status::JwtPayloadParseError => "Jwt payload is an invalid Base64 or an invalid JSON",
            Status::JwtSignatureParseError => "Jwt signature is an invalid Base64",
            Status::JwtUnknownIssuer => "Jwt issuer is not configured",
            Status::JwtAudienceNotAllowed => "Audiences in Jwt are not allowed",
            Status::JwtVerificationFail => "Jwt verification fails",
            Status::JwksNoValidKeys => "Jwks doesn't have any valid public key",
            Status::JwksKidAlgMismatch => "Jwks doesn't have key to match kid or alg from Jwt",
            Status::JwksFetchFail => "Jwks remote fetch is failed",
        }
    }
}

fn b64url(s: &str) -> Option<Vec<u8>> {
    // Tokens are unpadded base64url; tolerate padding as jwt_verify_lib does.
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(s.trim_end_matches('='))
        .ok()
}

const ALGS: &[&str] = &[
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "HS256",
    "HS384", "HS512", "EdDSA",
];

/// A parsed (not yet verified) token.
#[derive(Debug)]
pub struct Jwt<'a> {
    pub alg: String,
    pub kid: String,
    pub iss: String,
    pub audiences: Vec<String>,
    pub nbf: u64,
    pub exp: u64,
    pub payload: Map<String, Value>,
    /// The payload as it came, base64url (`forward_payload_header`).
    pub payload_b64: &'a str,
    /// `header.payload`, what the signature covers.
    pub signed: &'a str,
    pub signature: Vec<u8>,
}

fn time_claim(p: &Map<String, Value>, k: &str) -> Result<u64, Status> {
    match p.get(k) {
        None => Ok(0),
        Some(Value::Number(n)) => Ok(n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
            .unwrap_or(0)),
        Some(_) => Err(Status::JwtPayloadParseError),
    }
}

impl<'a> Jwt<'a> {
    pub fn parse(token: &'a str) -> Result<Self, Status> {
        let mut parts = token.split('.');
        let (Some(h), Some(p), Some(s), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Status::JwtBadFormat);
        };
        let header: Map<String, Value> = b64url(h)
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or(Status::JwtHeaderParseError)?;
        let alg = match header.get("alg") {
            Some(Value::String(a)) => a.clone(),
            _ => return Err(Status::JwtHeaderBadAlg),
        };
        if !ALGS.contains(&alg.as_str()) {
            return Err(Status::JwtHeaderNotImplementedAlg);
        }
        let kid = match header.get("kid") {
            None => String::new(),
            Some(Value::String(k)) => k.clone(),
            Some(_) => return Err(Status::JwtHeaderBadKid),
        };
        let payload: Map<String, Value> = b64url(p)
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or(Status::JwtPayloadParseError)?;
        let iss = match payload.get("iss") {
            None => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(Status::JwtPayloadParseError),
        };
        let audiences = match payload.get("aud") {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or(Status::JwtPayloadParseError)?,
            Some(_) => return Err(Status::JwtPayloadParseError),
        };
        let nbf = time_claim(&payload, "nbf")?;
        let exp = time_claim(&payload, "exp")?;
        let signature = b64url(s).ok_or(Status::JwtSignatureParseError)?;
        Ok(Jwt {
            alg,
            kid,
            iss,
            audiences,
            nbf,
            exp,
            payload,
            payload_b64: p,
            signed: &token[..h.len() + 1 + p.len()],
            signature,
        })
    }

    /// `nbf` and `exp` against `now`, with the clock skew allowed either way.
    pub fn check_time(&self, now: u64, skew: u64) -> Status {
        if self.nbf > now.saturating_add(skew) {
            return Status::JwtNotYetValid;
        }
        if self.exp != 0 && self.exp.saturating_add(skew) < now {
            return Status::JwtExpired;
        }
        Status::Ok
    }
}

/// One usable key of a JWKS.
#[derive(Debug, Clone)]
pub struct Jwk {
    pub kid: String,
    /// The key's `alg`, if it names one.
    pub alg: Option<String>,
    pub key: KeyMaterial,
}

#[derive(Debug, Clone)]
pub enum KeyMaterial {
    Rsa {
        n: Vec<u8>,
        e: Vec<u8>,
    },
    /// An uncompressed point (0x04 || x || y) on P-256 or P-384.
    Ec {
        p384: bool,
        point: Vec<u8>,
    },
    Oct(Vec<u8>),
    Ed25519(Vec<u8>),
}

/// Parses a JWKS (`{"keys": [...]}`) into its usable keys. Keys jwt_verify_lib would reject
/// are skipped; an empty result means "no valid public key", which fails every token at
/// request time as Envoy's local JWKS does.
pub fn parse_jwks(text: &str) -> Vec<Jwk> {
    let Ok(Value::Object(o)) = serde_json::from_str::<Value>(text) else {
        return Vec::new();
    };
    let Some(Value::Array(keys)) = o.get("keys") else {
        return Vec::new();
    };
    keys.iter().filter_map(parse_jwk).collect()
}

fn field(o: &Map<String, Value>, k: &str) -> Option<Vec<u8>> {
    b64url(o.get(k)?.as_str()?)
}

fn parse_jwk(v: &Value) -> Option<Jwk> {
    let o = v.as_object()?;
    let kid = o
        .get("kid")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let alg = o.get("alg").and_then(Value::as_str).map(str::to_string);
    let alg_starts = |p: &str| alg.as_deref().is_none_or(|a| a.starts_with(p));
    let key = match o.get("kty")?.as_str()? {
        "RSA"
            if alg
                .as_deref()
                .is_none_or(|a| a.starts_with("RS") || a.starts_with("PS")) =>
        {
            KeyMaterial::Rsa {
                n: field(o, "n")?,
                e: field(o, "e")?,
            }
        }
        "EC" if alg_starts("ES") => {
            let crv = o.get("crv").and_then(Value::as_str);
            let p384 = match (crv, alg.as_deref()) {
                (Some("P-256") | None, None | Some("ES256")) => false,
                (Some("P-384"), None | Some("ES384")) | (None, Some("ES384")) => true,
                _ => return None,
            };
            let (x, y) = (field(o, "x")?, field(o, "y")?);
            let len = if p384 { 48 } else { 32 };
            if x.len() != len || y.len() != len {
                return None;
            }
            let mut point = Vec::with_capacity(1 + 2 * len);
            point.push(4);
            point.extend_from_slice(&x);
            point.extend_from_slice(&y);
            KeyMaterial::Ec { p384, point }
        }
        "oct" if alg_starts("HS") => KeyMaterial::Oct(field(o, "k")?),
        "OKP" if o.get("crv").and_then(Value::as_str) == Some("Ed25519") => {
            KeyMaterial::Ed25519(field(o, "x")?)
        }
        _ => return None,
    };
    Some(Jwk { kid, alg, key })
}

fn verify_with(jwt: &Jwt<'_>, key: &KeyMaterial) -> Option<bool> {
    use signature as s;
    let msg = jwt.signed.as_bytes();
    let sig = jwt.signature.as_slice();
    let rsa = |params: &'static s::RsaParameters, n: &[u8], e: &[u8]| {
        RsaPublicKeyComponents { n, e }
            .verify(params, msg, sig)
            .is_ok()
    };
    Some(match (jwt.alg.as_str(), key) {
        ("RS256", KeyMaterial::Rsa { n, e }) => rsa(&s::RSA_PKCS1_2048_8192_SHA256, n, e),
        ("RS384", KeyMaterial::Rsa { n, e }) => rsa(&s::RSA_PKCS1_2048_8192_SHA384, n, e),
        ("RS512", KeyMaterial::Rsa { n, e }) => rsa(&s::RSA_PKCS1_2048_8192_SHA512, n, e),
        ("PS256", KeyMaterial::Rsa { n, e }) => rsa(&s::RSA_PSS_2048_8192_SHA256, n, e),
        ("PS384", KeyMaterial::Rsa { n, e }) => rsa(&s::RSA_PSS_2048_8192_SHA384, n, e),
        ("PS512", KeyMaterial::Rsa { n, e }) => rsa(&s::RSA_PSS_2048_8192_SHA512, n, e),
        ("ES256", KeyMaterial::Ec { p384: false, point }) => {
            UnparsedPublicKey::new(&s::ECDSA_P256_SHA256_FIXED, point)
                .verify(msg, sig)
                .is_ok()
        }
        ("ES384", KeyMaterial::Ec { p384: true, point }) => {
            UnparsedPublicKey::new(&s::ECDSA_P384_SHA384_FIXED, point)
                .verify(msg, sig)
                .is_ok()
        }
        ("EdDSA", KeyMaterial::Ed25519(x)) => UnparsedPublicKey::new(&s::ED25519, x)
            .verify(msg, sig)
            .is_ok(),
        (a @ ("HS256" | "HS384" | "HS512"), KeyMaterial::Oct(k)) => {
            let alg = match a {
                "HS256" => ring::hmac::HMAC_SHA256,
                "HS384" => ring::hmac::HMAC_SHA384,
                _ => ring::hmac::HMAC_SHA512,
            };
            ring::hmac::verify(&ring::hmac::Key::new(alg, k), msg, sig).is_ok()
        }
        _ => return None,
    })
}

/// The signature against the keys: a key whose `kid` (when both name one) and `alg` (when the
/// key names one) fit the token and whose type fits the algorithm is tried; the first that
/// verifies wins. No key tried: `JwksKidAlgMismatch`; keys tried, none verified:
/// `JwtVerificationFail` (jwt_verify_lib's `verifyJwtWithoutTimeChecking`).
pub fn verify_signature(jwt: &Jwt<'_>, keys: &[Jwk]) -> Status {
    if keys.is_empty() {
        return Status::JwksNoValidKeys;
    }
    let mut tried = false;
    for k in keys {
        if !jwt.kid.is_empty() && !k.kid.is_empty() && k.kid != jwt.kid {
            continue;
        }
        if k.alg.as_deref().is_some_and(|a| a != jwt.alg) {
            continue;
        }
        match verify_with(jwt, &k.key) {
            Some(true) => return Status::Ok,
            Some(false) => tried = true,
            None => {}
        }
    }
    if tried {
        Status::JwtVerificationFail
    } else {
        Status::JwksKidAlgMismatch
    }
}
