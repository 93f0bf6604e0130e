//! `envoy.filters.http.compressor`: response bodies compressed with gzip, brotli or zstd as
//! the client's `Accept-Encoding` allows, with Envoy's negotiation across every compressor
//! filter of the chain (highest q-value; `*` takes the first registered; `choose_first`
//! breaks ties), its checks (content type, minimum length, `Cache-Control: no-transform`,
//! ETags, an existing `Content-Encoding`, uncompressible status codes, headers-only
//! responses) and its header changes (`Content-Encoding`, `Vary: Accept-Encoding`, no
//! `Content-Length`, strong ETags dropped or weakened). Istio 1.30's bootstrap puts three of
//! them (brotli, zstd, gzip) on the 15090 Prometheus listener.
//!
//! Decisions written down: the libraries' tuning fields (window bits, memory level, strategy,
//! chunk size, checksum) change the compressed bytes, not what the client decodes, and are
//! accepted with the library's defaults; zstd `dictionary` is refused (a client without it
//! cannot decode); `request_direction_config` (compressing request bodies) is refused unless
//! disabled; `status_header_enabled` is accepted and the header not sent; runtime keys of
//! `enabled` are not read (the default value decides).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::compression::brotli::compressor::v3::Brotli;
use envoy_types::pb::envoy::extensions::compression::gzip::compressor::v3::Gzip;
use envoy_types::pb::envoy::extensions::compression::zstd::compressor::v3::Zstd;
use envoy_types::pb::envoy::extensions::filters::http::compressor::v3::Compressor;
use envoy_types::pb::google::protobuf::Any;
use http::HeaderMap;
use pingora_core::protocols::http::compression::Algorithm;
use prost::Message;

use super::{FilterDecl, HttpFilter, Translated};
use crate::matcher::StringMatch;

pub const TYPE: &str = "type.googleapis.com/envoy.extensions.filters.http.compressor.v3.Compressor";
const GZIP: &str = "type.googleapis.com/envoy.extensions.compression.gzip.compressor.v3.Gzip";
const BROTLI: &str = "type.googleapis.com/envoy.extensions.compression.brotli.compressor.v3.Brotli";
const ZSTD: &str = "type.googleapis.com/envoy.extensions.compression.zstd.compressor.v3.Zstd";

/// Envoy's default content types.
const DEFAULT_TYPES: [&str; 18] = [
    "text/html",
    "text/plain",
    "text/css",
    "application/javascript",
    "application/x-javascript",
    "text/javascript",
    "text/x-javascript",
    "text/ecmascript",
    "text/js",
    "text/jscript",
    "text/x-js",
    "application/ecmascript",
    "application/x-json",
    "application/xml",
    "application/json",
    "image/svg+xml",
    "text/xml",
    "application/xhtml+xml",
];

#[derive(Debug)]
pub struct CompressorFilter {
    pub name: String,
    pub algorithm: Algorithm,
    /// The library's level in pingora's scale (gzip 1-9, brotli 0-11, zstd 1-22).
    pub level: u32,
    /// `response_direction_config.common_config.enabled` (its default value).
    pub enabled: bool,
    pub min_length: u64,
    pub content_types: ContentTypes,
    pub disable_on_etag: bool,
    pub weaken_etag: bool,
    pub remove_accept_encoding: bool,
    pub uncompressible_codes: Vec<u16>,
    pub choose_first: bool,
    pub stats: Arc<CompressorStats>,
}

#[derive(Debug)]
pub enum ContentTypes {
    /// Media types (lowercase) compared with the response's, parameters cut off.
    List(Vec<String>),
    Matchers(Vec<StringMatch>),
}

impl ContentTypes {
    fn allows(&self, media_type: &str) -> bool {
        match self {
            ContentTypes::List(l) => l.iter().any(|t| t.eq_ignore_ascii_case(media_type)),
            ContentTypes::Matchers(m) => m.iter().any(|m| m.matches(media_type)),
        }
    }
}

/// `<stat_prefix>compressor.<library name>.<encoding>.*`.
#[derive(Debug, Default)]
pub struct CompressorStats {
    pub library: String,
    pub compressed: AtomicU64,
    pub not_compressed: AtomicU64,
    pub no_accept_header: AtomicU64,
    pub header_identity: AtomicU64,
    pub header_compressor_used: AtomicU64,
    pub header_compressor_overshadowed: AtomicU64,
    pub header_wildcard: AtomicU64,
    pub header_not_valid: AtomicU64,
    pub content_length_too_small: AtomicU64,
    pub not_compressed_etag: AtomicU64,
    pub total_uncompressed_bytes: AtomicU64,
    pub total_compressed_bytes: AtomicU64,
}

pub fn translate_filter(d: &FilterDecl<'_>) -> Result<Translated, String> {
    let c =
        Compressor::decode(d.config.value.as_slice()).map_err(|e| format!("cannot decode: {e}"))?;
    let lib = c
        .compressor_library
        .as_ref()
        .ok_or("compressor_library is required")?;
    let cfg = lib
        .typed_config
        .as_ref()
        .ok_or("compressor_library.typed_config is required")?;
    let (algorithm, level) = library(cfg).map_err(|e| format!("compressor_library: {e}"))?;
    if let Some(r) = &c.request_direction_config {
        let enabled = r
            .common_config
            .as_ref()
            .and_then(|cc| cc.enabled.as_ref())
            .and_then(|f| f.default_value.as_ref())
            .is_none_or(|v| v.value);
        if enabled {
            return Err(
                "request_direction_config (compressing request bodies) is not supported".into(),
            );
        }
    }
    let resp = c.response_direction_config.clone().unwrap_or_default();
    let common = resp.common_config.clone().unwrap_or_default();
    #[allow(deprecated)]
    let (old_types, old_length, old_etag, old_remove, old_enabled) = (
        c.content_type.clone(),
        c.content_length.map(|v| v.value),
        c.disable_on_etag_header,
        c.remove_accept_encoding_header,
        c.runtime_enabled
            .as_ref()
            .and_then(|f| f.default_value.as_ref())
            .map(|v| v.value),
    );
    #[allow(deprecated)]
    let common_types = common.content_type.clone();
    let content_types = if !common.content_type_matcher.is_empty() {
        ContentTypes::Matchers(
            common
                .content_type_matcher
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    crate::matcher::string_matcher(m)
                        .map_err(|e| format!("content_type_matcher[{i}]: {e}"))
                })
                .collect::<Result<_, _>>()?,
        )
    } else {
        let list = if !common_types.is_empty() {
            common_types
        } else if !old_types.is_empty() {
            old_types
        } else {
            DEFAULT_TYPES.iter().map(|s| s.to_string()).collect()
        };
        ContentTypes::List(
            list.into_iter()
                .map(|t| t.trim().to_ascii_lowercase())
                .collect(),
        )
    };
    let min_length = common
        .min_content_length
        .map(|v| v.value)
        .or(old_length)
        .filter(|v| *v > 0)
        .unwrap_or(30);
    let enabled = common
        .enabled
        .as_ref()
        .and_then(|f| f.default_value.as_ref())
        .map(|v| v.value)
        .or(old_enabled)
        .unwrap_or(true);
    let uncompressible_codes = resp
        .uncompressible_response_codes
        .iter()
        .map(|c| {
            u16::try_from(*c)
                .map_err(|_| format!("uncompressible_response_codes: {c} is not a status code"))
        })
        .collect::<Result<_, _>>()?;
    Ok(Translated::Run(HttpFilter::Compressor(CompressorFilter {
        name: d.name.to_string(),
        algorithm,
        level,
        enabled,
        min_length: u64::from(min_length),
        content_types,
        disable_on_etag: resp.disable_on_etag_header || old_etag,
        weaken_etag: resp.weaken_etag_on_compress,
        remove_accept_encoding: resp.remove_accept_encoding_header || old_remove,
        uncompressible_codes,
        choose_first: c.choose_first,
        stats: Arc::new(CompressorStats {
            library: lib.name.clone(),
            ..Default::default()
        }),
    })))
}

/// The library and its level, with Envoy's defaults (gzip 6, brotli 3, zstd 3).
fn library(a: &Any) -> Result<(Algorithm, u32), String> {
    match a.type_url.as_str() {
        GZIP => {
            let g = Gzip::decode(a.value.as_slice()).map_err(|e| format!("cannot decode: {e}"))?;
            // DEFAULT_COMPRESSION (0) is zlib's default, 6.
            let level = match g.compression_level {
                0 => 6,
                l @ 1..=9 => l as u32,
                l => return Err(format!("gzip compression_level {l} is not valid")),
            };
            Ok((Algorithm::Gzip, level))
        }
        BROTLI => {
            let b =
                Brotli::decode(a.value.as_slice()).map_err(|e| format!("cannot decode: {e}"))?;
            let q = b.quality.map_or(3, |v| v.value);
            if q > 11 {
                return Err(format!("brotli quality {q} is not valid (0 to 11)"));
            }
            // pingora treats level 0 as "no compressor"; brotli's 0 and 1 are close.
            Ok((Algorithm::Brotli, q.max(1)))
        }
        ZSTD => {
            let z = Zstd::decode(a.value.as_slice()).map_err(|e| format!("cannot decode: {e}"))?;
            if z.dictionary.is_some() {
                return Err("zstd dictionary is not supported".into());
            }
            let l = z.compression_level.map_or(3, |v| v.value);
            Ok((Algorithm::Zstd, l.clamp(1, 22)))
        }
        other => Err(format!(
            "compression library {other} is not supported (gzip, brotli and zstd are)"
        )),
    }
}

/// A streaming encoder: each piece flushed (Envoy's `Compressor::State::Flush`, so a
/// streamed response is not held back), the last one finishing the stream.
pub enum Encoder {
    Gzip(flate2::write::GzEncoder<Vec<u8>>),
    Brotli(Box<brotli::CompressorWriter<Vec<u8>>>),
    Zstd(zstd::stream::write::Encoder<'static, Vec<u8>>),
    Done,
}

impl Encoder {
    fn new(algorithm: Algorithm, level: u32) -> Option<Encoder> {
        Some(match algorithm {
            Algorithm::Gzip => Encoder::Gzip(flate2::write::GzEncoder::new(
                Vec::new(),
                flate2::Compression::new(level),
            )),
            // Envoy's defaults: a 18-bit window, 4 KiB buffer.
            Algorithm::Brotli => Encoder::Brotli(Box::new(brotli::CompressorWriter::new(
                Vec::new(),
                4096,
                level,
                18,
            ))),
            Algorithm::Zstd => {
                Encoder::Zstd(zstd::stream::write::Encoder::new(Vec::new(), level as i32).ok()?)
            }
            _ => return None,
        })
    }

    fn encode(&mut self, input: &[u8], end: bool) -> std::io::Result<bytes::Bytes> {
        use std::io::Write;
        let out = match self {
            Encoder::Gzip(e) => {
                e.write_all(input)?;
                e.flush()?;
                std::mem::take(e.get_mut())
            }
            Encoder::Brotli(e) => {
                e.write_all(input)?;
                e.flush()?;
                std::mem::take(e.get_mut())
            }
            Encoder::Zstd(e) => {
                e.write_all(input)?;
                e.flush()?;
                std::mem::take(e.get_mut())
            }
            Encoder::Done => Vec::new(),
        };
        if !end {
            return Ok(out.into());
        }
        let mut out = out;
        match std::mem::replace(self, Encoder::Done) {
            Encoder::Gzip(e) => out.extend(e.finish()?),
            Encoder::Brotli(e) => out.extend(e.into_inner()),
            Encoder::Zstd(e) => out.extend(e.finish()?),
            Encoder::Done => {}
        }
        Ok(out.into())
    }
}

/// What the compressor filters left on a request: its `Accept-Encoding`, and once decided
/// the response's encoder.
#[derive(Default)]
pub struct CompressState {
    accept_encoding: Option<String>,
    /// The response is being compressed by this filter's encoder.
    pub encoder: Option<(Encoder, Arc<CompressorStats>)>,
}

impl std::fmt::Debug for CompressState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompressState")
            .field("accept_encoding", &self.accept_encoding)
            .field("compressing", &self.encoder.is_some())
            .finish()
    }
}

impl CompressorFilter {
    /// Envoy's decodeHeaders: the request's Accept-Encoding is kept for the response.
    pub fn decode(&self, req: &super::Request<'_>, st: &mut super::FilterState) -> super::Decision {
        let state = st.compress.get_or_insert_with(Default::default);
        if state.accept_encoding.is_none() {
            state.accept_encoding = req
                .view
                .headers
                .get(http::header::ACCEPT_ENCODING)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
        }
        if self.enabled && self.remove_accept_encoding {
            st.remove_accept_encoding = true;
        }
        super::Decision::Continue
    }
}

/// Envoy's encodeHeaders over the chain's compressor filters: at most one compresses. `resp`
/// gets the headers of a compressed response; the encoder is left in `state`.
/// `headers_only`: the response has no body (HEAD, 204, 304, an empty length).
pub fn response_headers(
    filters: &[HttpFilter],
    state: &mut CompressState,
    resp: &mut pingora_http::ResponseHeader,
    headers_only: bool,
) {
    let status = resp.status.as_u16();
    let compressors: Vec<&CompressorFilter> = filters
        .iter()
        .filter_map(|f| match f {
            HttpFilter::Compressor(c) => Some(c),
            _ => None,
        })
        .collect();
    if compressors.is_empty() {
        return;
    }
    let media_type = resp
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        });
    let decision = state
        .accept_encoding
        .as_deref()
        .map(|ae| choose(&compressors, ae, media_type.as_deref()));
    for c in compressors.iter().rev() {
        let s = &c.stats;
        let chosen = c.check(
            status,
            &resp.headers,
            headers_only,
            media_type.as_deref(),
            decision.as_ref(),
        );
        if chosen && state.encoder.is_none() {
            if let Some(enc) = Encoder::new(c.algorithm, c.level) {
                c.rewrite_headers(resp);
                s.compressed.fetch_add(1, Relaxed);
                state.encoder = Some((enc, s.clone()));
                continue;
            }
        }
        s.not_compressed.fetch_add(1, Relaxed);
    }
}

/// Envoy's EncodingDecision.
#[derive(Debug, PartialEq, Eq)]
enum Decision {
    /// A compressor's encoding was asked for by name.
    Valid(String),
    /// `*`: the first registered.
    Wildcard(String),
    Identity,
    NotValid,
}

fn choose(compressors: &[&CompressorFilter], accept: &str, media_type: Option<&str>) -> Decision {
    // Allowed encodings in registration order (the first filter for an encoding counts),
    // without those whose content types exclude this response.
    let mut allowed: Vec<(&str, bool)> = Vec::new();
    for c in compressors {
        if let Some(mt) = media_type.filter(|m| !m.is_empty()) {
            if !c.content_types.allows(mt) {
                continue;
            }
        }
        let enc = c.algorithm.as_str();
        if !allowed.iter().any(|(e, _)| *e == enc) {
            allowed.push((enc, c.choose_first));
        }
    }
    let mut pairs: Vec<(String, f32)> = Vec::new();
    for token in accept.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let mut parts = token.splitn(2, ';');
        let name = parts.next().unwrap_or("").trim().to_ascii_lowercase();
        let mut q = 1.0f32;
        if let Some(params) = parts.next() {
            if let Some((k, v)) = params.split_once('=') {
                if k.trim().eq_ignore_ascii_case("q") {
                    match v.trim().parse::<f32>() {
                        Ok(v) => q = v,
                        Err(_) => continue,
                    }
                }
            }
        }
        if q == 0.0 {
            allowed.retain(|(e, _)| *e != name);
        }
        pairs.push((name, q));
    }
    if pairs.is_empty() || allowed.is_empty() {
        return Decision::NotValid;
    }
    let mut choice: (&str, f32) = ("identity", 0.0);
    for (name, q) in &pairs {
        let known = allowed.iter().any(|(e, _)| e == name) || name == "identity" || name == "*";
        let better = *q > choice.1
            || (*q == choice.1
                && q > &0.0
                && allowed
                    .iter()
                    .any(|(e, first)| e == name && *first && choice.0 != *e));
        if known && better {
            choice = (name, *q);
        }
    }
    if choice.1 == 0.0 {
        return Decision::NotValid;
    }
    match choice.0 {
        "identity" => Decision::Identity,
        "*" => Decision::Wildcard(allowed[0].0.to_string()),
        e => Decision::Valid(e.to_string()),
    }
}

impl CompressorFilter {
    /// Whether this filter compresses the response (counting why not, as Envoy).
    fn check(
        &self,
        status: u16,
        resp: &HeaderMap,
        headers_only: bool,
        media_type: Option<&str>,
        decision: Option<&Decision>,
    ) -> bool {
        let s = &self.stats;
        if headers_only || !self.enabled || self.uncompressible_codes.contains(&status) {
            return false;
        }
        if let Some(len) = resp.get(http::header::CONTENT_LENGTH) {
            let ok = len
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .is_some_and(|n| n >= self.min_length);
            if !ok {
                s.content_length_too_small.fetch_add(1, Relaxed);
                return false;
            }
        }
        let Some(decision) = decision else {
            s.no_accept_header.fetch_add(1, Relaxed);
            return false;
        };
        let mine = self.algorithm.as_str();
        let chosen = match decision {
            Decision::Valid(e) => {
                if e == mine {
                    s.header_compressor_used.fetch_add(1, Relaxed);
                } else {
                    s.header_compressor_overshadowed.fetch_add(1, Relaxed);
                }
                e == mine
            }
            Decision::Wildcard(e) => {
                s.header_wildcard.fetch_add(1, Relaxed);
                e == mine
            }
            Decision::Identity => {
                s.header_identity.fetch_add(1, Relaxed);
                false
            }
            Decision::NotValid => {
                s.header_not_valid.fetch_add(1, Relaxed);
                false
            }
        };
        if !chosen {
            return false;
        }
        if let Some(mt) = media_type {
            if !self.content_types.allows(mt) {
                return false;
            }
        }
        let no_transform = resp
            .get_all(http::header::CACHE_CONTROL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("no-transform"));
        if no_transform {
            return false;
        }
        if self.disable_on_etag && !self.weaken_etag && resp.contains_key(http::header::ETAG) {
            s.not_compressed_etag.fetch_add(1, Relaxed);
            return false;
        }
        let te_compressed = resp
            .get_all(http::header::TRANSFER_ENCODING)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| {
                let t = t.trim();
                t.eq_ignore_ascii_case(mine)
                    || t.eq_ignore_ascii_case("gzip")
                    || t.eq_ignore_ascii_case("deflate")
            });
        !te_compressed && !resp.contains_key(http::header::CONTENT_ENCODING)
    }

    /// A compressed response's headers: strong ETags go (or weaken), `Vary` names
    /// Accept-Encoding, no length, the encoding named.
    fn rewrite_headers(&self, resp: &mut pingora_http::ResponseHeader) {
        let etag = resp
            .headers
            .get(http::header::ETAG)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if let Some(etag) = etag {
            let weak = etag.len() >= 2 && etag[..2].eq_ignore_ascii_case("w/");
            if !weak {
                resp.remove_header(&http::header::ETAG);
                if self.weaken_etag {
                    let _ = resp.insert_header(http::header::ETAG, format!("W/{etag}"));
                }
            }
        }
        let vary: Vec<String> = resp
            .headers
            .get_all(http::header::VARY)
            .iter()
            .filter_map(|v| v.to_str().ok().map(str::to_string))
            .collect();
        let has = vary
            .iter()
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("accept-encoding"));
        if !has {
            let value = if vary.is_empty() {
                "Accept-Encoding".to_string()
            } else {
                format!("{}, Accept-Encoding", vary.join(", "))
            };
            let _ = resp.insert_header(http::header::VARY, value);
        }
        resp.remove_header(&http::header::CONTENT_LENGTH);
        let _ = resp.insert_header(http::header::CONTENT_ENCODING, self.algorithm.as_str());
    }
}

impl CompressState {
    /// A piece of the response body through the encoder (the whole body at `end`).
    pub fn body(&mut self, data: &[u8], end: bool) -> Option<bytes::Bytes> {
        let (enc, stats) = self.encoder.as_mut()?;
        stats
            .total_uncompressed_bytes
            .fetch_add(data.len() as u64, Relaxed);
        let out = enc.encode(data, end).ok()?;
        stats
            .total_compressed_bytes
            .fetch_add(out.len() as u64, Relaxed);
        Some(out)
    }
}

#[cfg(test)]
#[path = "compressor_tests.rs"]
mod compressor_tests;
