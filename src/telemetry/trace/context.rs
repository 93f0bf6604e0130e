//! Envoy's tracing decisions on a request's headers, as pure functions: the sampling packed
//! into `x-request-id` by the uuid request-id extension, the drivers' extraction of an
//! incoming B3 or W3C context, the gateway span's ids, and the headers it sends upstream.

use http::HeaderMap;

use super::config::{Provider, TracingConfig, Zipkin};

/// Why a request is traced (Envoy's `Tracing::Reason`), as `x-request-id` records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    NotTraceable,
    Sampling,
    ServiceForced,
    ClientForced,
}

impl Reason {
    pub fn traced(self) -> bool {
        self != Reason::NotTraceable
    }
}

/// The uuid extension's trace byte: the UUID's version nibble.
const TRACE_BYTE: usize = 14;
const UUID_LEN: usize = 36;

/// The reason a request id carries (`UUIDRequestIDExtension::getTraceReason`).
pub fn trace_reason(rid: &[u8]) -> Reason {
    if rid.len() != UUID_LEN {
        return Reason::NotTraceable;
    }
    match rid[TRACE_BYTE] {
        b'a' => Reason::ServiceForced,
        b'9' => Reason::Sampling,
        b'b' => Reason::ClientForced,
        _ => Reason::NotTraceable,
    }
}

fn set_reason(rid: &mut [u8], r: Reason) {
    if rid.len() != UUID_LEN {
        return;
    }
    rid[TRACE_BYTE] = match r {
        Reason::ServiceForced => b'a',
        Reason::ClientForced => b'b',
        Reason::Sampling => b'9',
        Reason::NotTraceable => b'4',
    };
}

/// The first 8 hex digits of the request id (`UUIDRequestIDExtension::toInteger`).
fn rid_integer(rid: &[u8]) -> Option<u64> {
    let head = rid.get(..8)?;
    let s = std::str::from_utf8(head).ok()?;
    u64::from_str_radix(s, 16).ok()
}

/// Envoy's `mutateTracingRequestHeader`: decides whether the request is traced and packs the
/// decision into `rid` (the `x-request-id` value, changed in place). `random` stands for
/// Envoy's random draw for client sampling. Returns the request's trace reason afterwards.
pub fn sample(
    rid: &mut [u8],
    client_trace_id: bool,
    force_trace: bool,
    cfg: &TracingConfig,
    random: u64,
) -> Reason {
    // A request id that is not a number leaves the decision as the id carries it.
    let Some(value) = rid_integer(rid) else {
        return trace_reason(rid);
    };
    let result = value % 10_000;
    if trace_reason(rid) == Reason::NotTraceable {
        if client_trace_id && cfg.client_sampling.enabled(random) {
            set_reason(rid, Reason::ClientForced);
        } else if force_trace {
            set_reason(rid, Reason::ServiceForced);
        } else if cfg.random_sampling.enabled(result) {
            set_reason(rid, Reason::Sampling);
        }
    }
    if !cfg.overall_sampling.enabled(result) {
        set_reason(rid, Reason::NotTraceable);
    }
    trace_reason(rid)
}

/// How the incoming context was written, which is how the span writes its own upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    B3Multi,
    B3Single,
    W3c,
}

/// The gateway span's identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanContext {
    /// The trace id's high 64 bits; 0 for a 64-bit Zipkin trace id.
    pub trace_high: u64,
    pub trace_low: u64,
    pub span_id: u64,
    pub parent_id: Option<u64>,
    pub sampled: bool,
    pub format: Format,
    /// W3C `tracestate`, carried through.
    pub tracestate: String,
    /// The span is a client span (Envoy's egress operation).
    pub client: bool,
    /// Zipkin: the span continues the caller's span id (`shared_span_context`).
    pub shared: bool,
}

impl SpanContext {
    /// The trace id as Envoy writes it: 32 hex digits when there are high bits (always for
    /// W3C), else 16.
    pub fn trace_id_hex(&self) -> String {
        let mut s = String::with_capacity(32);
        if self.trace_high != 0 || self.format == Format::W3c {
            push_hex16(&mut s, self.trace_high);
        }
        push_hex16(&mut s, self.trace_low);
        s
    }

    /// The headers this span sends upstream, as the driver injects them.
    pub fn headers(&self) -> Vec<(&'static http::HeaderName, String)> {
        let mut span = String::with_capacity(16);
        push_hex16(&mut span, self.span_id);
        match self.format {
            Format::W3c => {
                // Envoy writes `tracestate` even when empty.
                vec![
                    (
                        header_name!("traceparent"),
                        format!(
                            "00-{}-{span}-{}",
                            self.trace_id_hex(),
                            if self.sampled { "01" } else { "00" }
                        ),
                    ),
                    (header_name!("tracestate"), self.tracestate.clone()),
                ]
            }
            Format::B3Single => {
                let mut v = format!(
                    "{}-{span}-{}",
                    self.trace_id_hex(),
                    if self.sampled { "1" } else { "0" }
                );
                if let Some(p) = self.parent_id {
                    v.push_str(&format!("-{p:016x}"));
                }
                vec![(header_name!("b3"), v)]
            }
            Format::B3Multi => {
                // Room for all four and the `x-request-id` the connection manager adds to
                // them (`proxy::trace::begin`): a `vec!` of two grew on the third, every
                // request.
                let mut h = Vec::with_capacity(5);
                h.push((header_name!("x-b3-traceid"), self.trace_id_hex()));
                h.push((header_name!("x-b3-spanid"), span));
                if let Some(p) = self.parent_id {
                    h.push((header_name!("x-b3-parentspanid"), format!("{p:016x}")));
                }
                h.push((
                    header_name!("x-b3-sampled"),
                    if self.sampled { "1" } else { "0" }.to_string(),
                ));
                h
            }
        }
    }
}

/// `{v:016x}`: ids are formatted on every request (sampled or not), and `fmt`'s padded hex
/// cost some 800 instructions an id.
fn push_hex16(out: &mut String, v: u64) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for shift in (0..16).rev() {
        out.push(char::from(HEX[((v >> (shift * 4)) & 0xf) as usize]));
    }
}

fn first<'a>(h: &'a HeaderMap, name: &http::HeaderName) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

/// Envoy's `StringUtil::atoull(s, 16)` for ids: 1 to 16 hex digits.
fn hex64(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

/// The span `provider` (the connection manager's, else the bootstrap's) starts for a
/// request. `None`: no span and no headers (no driver, one
/// Portico lacks, or an incoming context the driver cannot read: Envoy's null span).
/// `random` draws Envoy's random ids.
pub fn start_span(
    cfg: &TracingConfig,
    provider: Option<&Provider>,
    headers: &HeaderMap,
    reason: Reason,
    random: &mut dyn FnMut() -> u64,
) -> Option<SpanContext> {
    match provider? {
        Provider::Zipkin(z) => start_zipkin(z, cfg.egress, headers, reason.traced(), random),
        Provider::OpenTelemetry(_) => start_w3c(cfg.egress, headers, reason.traced(), random),
        Provider::Unimplemented(_) => None,
    }
}

/// Zipkin's `SpanContextExtractor::extractSampled`: the caller's decision, if it sent one.
fn b3_sampled(headers: &HeaderMap) -> Option<bool> {
    if let Some(b3) = first(headers, header_name!("b3")) {
        let pos = match b3.len() {
            1 => 0,
            35 | 52 => 34,
            51 | 68 => 50,
            _ => return None,
        };
        return match b3.as_bytes()[pos] {
            b'0' => Some(false),
            b'1' | b'd' => Some(true),
            _ => None,
        };
    }
    first(headers, header_name!("x-b3-sampled")).map(|v| v == "1" || v == "true")
}

/// An incoming B3 context: Ok(None) when there is none, Err when it is malformed.
#[allow(clippy::type_complexity)]
fn b3_context(headers: &HeaderMap) -> Result<Option<(u64, u64, u64, u64, Format)>, ()> {
    if let Some(b3) = headers.get(header_name!("b3")) {
        let b3 = b3.to_str().map_err(|_| ())?;
        return b3_single(b3).map(|c| c.map(|(h, l, s, p)| (h, l, s, p, Format::B3Single)));
    }
    let (Some(tid), Some(sid)) = (
        first(headers, header_name!("x-b3-traceid")),
        first(headers, header_name!("x-b3-spanid")),
    ) else {
        return Ok(None);
    };
    let (high, low) = if tid.len() == 32 {
        (hex64(&tid[..16]).ok_or(())?, hex64(&tid[16..]).ok_or(())?)
    } else {
        (0, hex64(tid).ok_or(())?)
    };
    let span = hex64(sid).ok_or(())?;
    let parent = match first(headers, header_name!("x-b3-parentspanid")) {
        Some(p) if !p.is_empty() => hex64(p).ok_or(())?,
        _ => 0,
    };
    Ok(Some((high, low, span, parent, Format::B3Multi)))
}

/// The single `b3` header: `traceid-spanid[-sampled[-parentid]]`, or a lone sampling flag.
#[allow(clippy::type_complexity)]
fn b3_single(b3: &str) -> Result<Option<(u64, u64, u64, u64)>, ()> {
    let valid_flag = |c: u8| matches!(c, b'0' | b'1' | b'd');
    let b = b3.as_bytes();
    if b.len() == 1 {
        return if valid_flag(b[0]) { Ok(None) } else { Err(()) };
    }
    if b.len() < 33 || b.len() > 32 + 1 + 16 + 3 + 16 {
        return Err(());
    }
    let mut pos = 0;
    let (high, low) = if b.get(32) == Some(&b'-') {
        pos = 32;
        (hex64(&b3[..16]).ok_or(())?, hex64(&b3[16..32]).ok_or(())?)
    } else {
        pos += 16;
        (0, hex64(&b3[..16]).ok_or(())?)
    };
    if b.get(pos) != Some(&b'-') {
        return Err(());
    }
    pos += 1;
    let span = hex64(b3.get(pos..pos + 16).ok_or(())?).ok_or(())?;
    pos += 16;
    let mut parent = 0;
    if b.len() > pos {
        if b.len() == pos + 1 || b[pos] != b'-' {
            return Err(());
        }
        pos += 1;
        if b.len() == pos + 1 || (b.len() >= pos + 2 && b[pos + 1] == b'-') {
            if !valid_flag(b[pos]) {
                return Err(());
            }
            pos += 1;
        } else {
            return Err(());
        }
        if b.len() > pos {
            if b.len() != pos + 17 {
                return Err(());
            }
            parent = hex64(&b3[pos + 1..]).ok_or(())?;
        }
    }
    Ok(Some((high, low, span, parent)))
}

fn start_zipkin(
    z: &Zipkin,
    egress: bool,
    headers: &HeaderMap,
    traced: bool,
    random: &mut dyn FnMut() -> u64,
) -> Option<SpanContext> {
    // Every B3 name is `b3` or starts with `x-b3-`: one pass over the names present finds
    // none on most requests, where the lookups below hash up to six names.
    let any_b3 = headers.keys().any(|k| {
        let n = k.as_str();
        n == "b3" || n.starts_with("x-b3-")
    });
    let (sampled, prev, format) = if any_b3 {
        let sampled = b3_sampled(headers).unwrap_or(traced);
        // A malformed context: Envoy's null span.
        let prev = b3_context(headers).ok()?;
        // Zipkin injects in the format it read; a request without B3 context gets the multi
        // headers (a lone `b3: 0` flag is rewritten as a whole single header).
        let format = match (&prev, headers.contains_key(header_name!("b3"))) {
            (Some(p), _) => p.4,
            (None, true) => Format::B3Single,
            (None, false) => Format::B3Multi,
        };
        (sampled, prev, format)
    } else {
        (traced, None, Format::B3Multi)
    };
    let ctx = match prev {
        None => {
            let id = random();
            SpanContext {
                trace_high: if z.trace_id_128bit { random() } else { 0 },
                trace_low: id,
                span_id: id,
                parent_id: None,
                sampled,
                format,
                tracestate: String::new(),
                client: egress,
                shared: false,
            }
        }
        Some((high, low, span, parent, format)) => {
            let shared = !egress && z.shared_span_context;
            let (span_id, parent_id) = if shared {
                (span, (parent != 0).then_some(parent))
            } else {
                (random(), Some(span))
            };
            SpanContext {
                trace_high: high,
                trace_low: low,
                span_id,
                parent_id,
                sampled,
                format,
                tracestate: String::new(),
                client: egress,
                shared,
            }
        }
    };
    Some(ctx)
}

/// OpenTelemetry: continue an incoming `traceparent` (the caller's span becomes the parent,
/// its sampled flag decides), else start a trace with the connection manager's decision.
fn start_w3c(
    egress: bool,
    headers: &HeaderMap,
    traced: bool,
    random: &mut dyn FnMut() -> u64,
) -> Option<SpanContext> {
    let Some(tp) = headers.get(header_name!("traceparent")) else {
        return Some(SpanContext {
            trace_high: random(),
            trace_low: random(),
            span_id: random(),
            parent_id: None,
            sampled: traced,
            format: Format::W3c,
            tracestate: String::new(),
            client: egress,
            shared: false,
        });
    };
    let (high, low, parent, sampled) = traceparent(tp.to_str().ok()?)?;
    let tracestate = headers
        .get_all("tracestate")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    Some(SpanContext {
        trace_high: high,
        trace_low: low,
        span_id: random(),
        parent_id: Some(parent),
        sampled,
        format: Format::W3c,
        tracestate,
        client: egress,
        shared: false,
    })
}

/// `version-traceid-parentid-flags` with Envoy's checks: sizes, hex, ids not all zero.
fn traceparent(tp: &str) -> Option<(u64, u64, u64, bool)> {
    if tp.len() != 55 {
        return None;
    }
    let mut it = tp.split('-');
    let (v, t, p, f) = (it.next()?, it.next()?, it.next()?, it.next()?);
    if it.next().is_some() || v.len() != 2 || t.len() != 32 || p.len() != 16 || f.len() != 2 {
        return None;
    }
    let hex = |s: &str| s.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex(v) || !hex(f) {
        return None;
    }
    let (high, low, parent) = (hex64(&t[..16])?, hex64(&t[16..])?, hex64(p)?);
    if (high == 0 && low == 0) || parent == 0 {
        return None;
    }
    let flags = u8::from_str_radix(f, 16).ok()?;
    Some((high, low, parent, flags & 1 == 1))
}

#[cfg(test)]
#[path = "context_tests.rs"]
mod tests;
