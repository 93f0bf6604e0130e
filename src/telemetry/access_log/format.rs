//! Envoy's substitution formatter: a format string (`%REQ(:METHOD)% %RESPONSE_CODE%`) or a
//! JSON format (a struct whose string values are format strings) parsed once, at translation,
//! into pieces; each log line is then the pieces evaluated against one request's record.
//!
//! Parsing follows Envoy 1.40: a command is `%COMMAND(SUBCOMMAND):LENGTH%` (the same regex),
//! `%%` is a literal `%`, an unknown command is refused with Envoy's message (`Not supported
//! field in StreamInfo: X`), and so are parameters or a length on a command that takes none.
//! Values keep their type: a number (`%RESPONSE_CODE%`, `%BYTES_SENT%`, durations) is a
//! JSON number when it is a JSON value's only piece, a missing value is `-` in text and
//! `null` in JSON (`omit_empty_values`: empty text, key left out).

use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::OnceLock;
use std::time::{Duration, UNIX_EPOCH};

use regex::Regex;

use super::LogContext;
use crate::telemetry::stream_info::Protocol;

/// Envoy's default format, used when a logger names none.
pub const DEFAULT_FORMAT: &str = "[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \"%REQ(X-REQUEST-ID)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\"\n";

/// One piece of a format string.
#[derive(Debug, Clone)]
pub enum Piece {
    Text(String),
    Op(Op),
}

/// Which headers a `%REQ%`, `%RESP%` or `%TRAILER%` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Headers {
    Request,
    Response,
    Trailers,
}

/// A header name as `%REQ(X?Y)%` names it: lowercase; the request pseudo-headers by kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderKey {
    Method,
    Path,
    Authority,
    Scheme,
    /// `:status` (of the response).
    Status,
    /// A header name, parsed once here rather than on each line.
    Name(http::HeaderName),
    /// A name no header map holds (another pseudo-header, an empty name): always missing.
    None,
}

impl HeaderKey {
    fn parse(s: &str) -> HeaderKey {
        let l = s.to_ascii_lowercase();
        match l.as_str() {
            ":method" => HeaderKey::Method,
            ":path" => HeaderKey::Path,
            // Envoy's header map keeps `host` as `:authority`.
            ":authority" | "host" => HeaderKey::Authority,
            ":scheme" => HeaderKey::Scheme,
            ":status" => HeaderKey::Status,
            _ => {
                http::HeaderName::from_bytes(l.as_bytes()).map_or(HeaderKey::None, HeaderKey::Name)
            }
        }
    }
}

/// `%GRPC_STATUS(...)%` output forms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcForm {
    Camel,
    Snake,
    Number,
}

/// A command operator, resolved at translation.
#[derive(Debug, Clone)]
pub enum Op {
    Header {
        which: Headers,
        main: HeaderKey,
        alt: Option<HeaderKey>,
        max: Option<usize>,
        /// `%REQ_WITHOUT_QUERY%` (the `envoy.formatter.req_without_query` extension).
        without_query: bool,
    },
    StartTime(Option<TimeFormat>),
    ResponseCode,
    ResponseFlags,
    ResponseFlagsLong,
    ResponseCodeDetails,
    ConnectionTerminationDetails,
    UpstreamHost,
    UpstreamHostWithoutPort,
    UpstreamCluster,
    UpstreamClusterRaw,
    UpstreamLocalAddress,
    UpstreamLocalAddressWithoutPort,
    UpstreamTransportFailureReason,
    DownstreamLocalAddress,
    DownstreamLocalAddressWithoutPort,
    DownstreamLocalPort,
    DownstreamRemoteAddress,
    DownstreamRemoteAddressWithoutPort,
    DownstreamRemotePort,
    DownstreamDirectRemoteAddress,
    DownstreamDirectRemoteAddressWithoutPort,
    DownstreamPeerUriSan,
    RequestedServerName,
    RouteName,
    Protocol,
    BytesReceived,
    BytesSent,
    Duration,
    RequestDuration,
    RequestTxDuration,
    ResponseDuration,
    ResponseTxDuration,
    UpstreamRequestAttemptCount,
    ConnectionId,
    Hostname,
    GrpcStatus(GrpcForm),
    /// Operators on state Portico never has (dynamic metadata, filter state, cluster and
    /// host metadata): parsed, always missing (`-`/`null`), as Envoy shows them when
    /// nothing was set.
    Missing,
}

/// Why a format is refused (the messages are Envoy's).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("Incorrect configuration: {0}. Couldn't find valid command at position {1}")]
    Syntax(String, usize),
    #[error("Not supported field in StreamInfo: {0}")]
    Unknown(String),
    #[error("{0} does not take any parameters or length")]
    NoParams(String),
    #[error("{0} requires parameters")]
    NeedsParams(String),
    #[error("{0} does not allow length to be specified.")]
    NoLength(String),
    #[error("More than 1 alternative header specified in token: {0}")]
    Alternatives(String),
    #[error("Invalid header configuration. Format string contains invalid characters.")]
    HeaderChars,
    #[error("{0}")]
    Other(String),
}

fn command_regex() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    // Envoy's regex, verbatim: COMMAND, then a lazy (SUBCOMMAND), then :LENGTH, then `%`.
    RE.get_or_init(|| {
        Regex::new(r"^%((?:[A-Z]|[0-9]|_)+)(?:\((.*?)\))?(?::([0-9]+))?%").expect("valid regex")
    })
}

/// Options of the parser: extensions the config enables.
#[derive(Debug, Clone, Copy, Default)]
pub struct Extensions {
    /// `envoy.formatter.req_without_query` is among the `formatters`.
    pub req_without_query: bool,
}

/// Parses a format string into pieces, as Envoy's `SubstitutionFormatParser::parse`.
pub fn parse(format: &str, ext: Extensions) -> Result<Vec<Piece>, FormatError> {
    let mut out = Vec::new();
    let mut text = String::new();
    let b = format.as_bytes();
    let mut pos = 0;
    while pos < b.len() {
        if b[pos] != b'%' {
            // Copy up to the next `%` at once (keeps multi-byte characters whole).
            let end = format[pos..].find('%').map_or(b.len(), |i| pos + i);
            text.push_str(&format[pos..end]);
            pos = end;
            continue;
        }
        if b.get(pos + 1) == Some(&b'%') {
            text.push('%');
            pos += 2;
            continue;
        }
        if !text.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut text)));
        }
        let Some(c) = command_regex().captures(&format[pos..]) else {
            return Err(FormatError::Syntax(format.to_string(), pos));
        };
        let whole = c.get(0).map_or(0, |m| m.end());
        let cmd = c.get(1).map_or("", |m| m.as_str());
        let sub = c.get(2).map(|m| m.as_str());
        let len = match c.get(3) {
            Some(m) => Some(m.as_str().parse::<usize>().map_err(|_| {
                FormatError::Other(format!("Length must be an integer, given: {}", m.as_str()))
            })?),
            None => None,
        };
        out.push(Piece::Op(command(cmd, sub.unwrap_or(""), len, ext)?));
        pos += whole;
    }
    if !text.is_empty() || format.is_empty() {
        out.push(Piece::Text(text));
    }
    Ok(out)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Syntax {
    CommandOnly,
    ParamsRequiredLength,
    ParamsOptional,
}

fn check(s: Syntax, cmd: &str, sub: &str, len: Option<usize>) -> Result<(), FormatError> {
    if s == Syntax::CommandOnly && (!sub.is_empty() || len.is_some()) {
        return Err(FormatError::NoParams(cmd.into()));
    }
    if s == Syntax::ParamsRequiredLength && sub.is_empty() {
        return Err(FormatError::NeedsParams(cmd.into()));
    }
    if s == Syntax::ParamsOptional && len.is_some() {
        return Err(FormatError::NoLength(cmd.into()));
    }
    Ok(())
}

fn header_op(
    which: Headers,
    sub: &str,
    len: Option<usize>,
    without_query: bool,
) -> Result<Op, FormatError> {
    let mut parts = sub.split('?');
    let main = parts.next().unwrap_or("");
    let alt = parts.next();
    if parts.next().is_some() {
        return Err(FormatError::Alternatives(sub.into()));
    }
    let bad = |s: &str| s.bytes().any(|c| c == 0 || c == b'\r' || c == b'\n');
    let invalid = |s: &str| {
        !s.is_empty()
            && !s
                .bytes()
                .all(|c| c == b':' || http::HeaderName::from_bytes(&[c]).is_ok())
    };
    if bad(main) || alt.is_some_and(bad) {
        return Err(FormatError::Other(
            "Invalid header configuration. Format string contains newline.".into(),
        ));
    }
    if invalid(main) || alt.is_some_and(invalid) {
        return Err(FormatError::HeaderChars);
    }
    Ok(Op::Header {
        which,
        main: HeaderKey::parse(main),
        alt: alt.map(HeaderKey::parse),
        max: len,
        without_query,
    })
}

fn command(cmd: &str, sub: &str, len: Option<usize>, ext: Extensions) -> Result<Op, FormatError> {
    use Syntax::*;
    let simple = |op: Op| -> Result<Op, FormatError> {
        check(CommandOnly, cmd, sub, len)?;
        Ok(op)
    };
    match cmd {
        "REQ" | "RESP" | "TRAILER" => {
            check(ParamsRequiredLength, cmd, sub, len)?;
            let which = match cmd {
                "REQ" => Headers::Request,
                "RESP" => Headers::Response,
                _ => Headers::Trailers,
            };
            header_op(which, sub, len, false)
        }
        "REQ_WITHOUT_QUERY" if ext.req_without_query => {
            check(ParamsRequiredLength, cmd, sub, len)?;
            header_op(Headers::Request, sub, len, true)
        }
        "START_TIME" => {
            check(ParamsOptional, cmd, sub, len)?;
            if sub.is_empty() {
                Ok(Op::StartTime(None))
            } else {
                Ok(Op::StartTime(Some(TimeFormat::parse(sub))))
            }
        }
        "RESPONSE_CODE" => simple(Op::ResponseCode),
        "RESPONSE_FLAGS" => simple(Op::ResponseFlags),
        "RESPONSE_FLAGS_LONG" => simple(Op::ResponseFlagsLong),
        "RESPONSE_CODE_DETAILS" => simple(Op::ResponseCodeDetails),
        "CONNECTION_TERMINATION_DETAILS" => simple(Op::ConnectionTerminationDetails),
        "UPSTREAM_HOST" | "UPSTREAM_REMOTE_ADDRESS" => simple(Op::UpstreamHost),
        "UPSTREAM_REMOTE_ADDRESS_WITHOUT_PORT" => simple(Op::UpstreamHostWithoutPort),
        "UPSTREAM_CLUSTER" => simple(Op::UpstreamCluster),
        "UPSTREAM_CLUSTER_RAW" => simple(Op::UpstreamClusterRaw),
        "UPSTREAM_LOCAL_ADDRESS" => simple(Op::UpstreamLocalAddress),
        "UPSTREAM_LOCAL_ADDRESS_WITHOUT_PORT" => simple(Op::UpstreamLocalAddressWithoutPort),
        "UPSTREAM_TRANSPORT_FAILURE_REASON" => simple(Op::UpstreamTransportFailureReason),
        "DOWNSTREAM_LOCAL_ADDRESS" => simple(Op::DownstreamLocalAddress),
        "DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT" => simple(Op::DownstreamLocalAddressWithoutPort),
        "DOWNSTREAM_LOCAL_PORT" => simple(Op::DownstreamLocalPort),
        "DOWNSTREAM_REMOTE_ADDRESS" => simple(Op::DownstreamRemoteAddress),
        "DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT" => simple(Op::DownstreamRemoteAddressWithoutPort),
        "DOWNSTREAM_REMOTE_PORT" => simple(Op::DownstreamRemotePort),
        "DOWNSTREAM_DIRECT_REMOTE_ADDRESS" => simple(Op::DownstreamDirectRemoteAddress),
        "DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT" => {
            simple(Op::DownstreamDirectRemoteAddressWithoutPort)
        }
        "DOWNSTREAM_PEER_URI_SAN" => simple(Op::DownstreamPeerUriSan),
        "REQUESTED_SERVER_NAME" => simple(Op::RequestedServerName),
        "ROUTE_NAME" => simple(Op::RouteName),
        "PROTOCOL" => simple(Op::Protocol),
        "BYTES_RECEIVED" => simple(Op::BytesReceived),
        "BYTES_SENT" => simple(Op::BytesSent),
        "DURATION" => simple(Op::Duration),
        "REQUEST_DURATION" => simple(Op::RequestDuration),
        "REQUEST_TX_DURATION" => simple(Op::RequestTxDuration),
        "RESPONSE_DURATION" => simple(Op::ResponseDuration),
        "RESPONSE_TX_DURATION" => simple(Op::ResponseTxDuration),
        "UPSTREAM_REQUEST_ATTEMPT_COUNT" => simple(Op::UpstreamRequestAttemptCount),
        "CONNECTION_ID" => simple(Op::ConnectionId),
        "HOSTNAME" => simple(Op::Hostname),
        "GRPC_STATUS" => {
            check(ParamsOptional, cmd, sub, len)?;
            let form = match sub {
                "" | "CAMEL_STRING" => GrpcForm::Camel,
                "SNAKE_STRING" => GrpcForm::Snake,
                "NUMBER" => GrpcForm::Number,
                other => {
                    return Err(FormatError::Other(format!(
                        "GrpcStatusFormatter only supports CAMEL_STRING, SNAKE_STRING or NUMBER. Got: {other}"
                    )))
                }
            };
            Ok(Op::GrpcStatus(form))
        }
        "GRPC_STATUS_NUMBER" => simple(Op::GrpcStatus(GrpcForm::Number)),
        "DYNAMIC_METADATA"
        | "CLUSTER_METADATA"
        | "UPSTREAM_METADATA"
        | "FILTER_STATE"
        | "UPSTREAM_FILTER_STATE" => {
            check(ParamsRequiredLength, cmd, sub, len)?;
            Ok(Op::Missing)
        }
        other => Err(FormatError::Unknown(other.to_string())),
    }
}

/// A value as an operator produces it.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    Missing,
    Str(Cow<'a, str>),
    Int(u64),
}

fn ms(d: Duration) -> Value<'static> {
    Value::Int(d.as_millis() as u64)
}

fn opt_str<'a>(s: Option<&'a str>) -> Value<'a> {
    match s {
        Some(s) if !s.is_empty() => Value::Str(Cow::Borrowed(s)),
        _ => Value::Missing,
    }
}

fn addr(a: Option<std::net::SocketAddr>) -> Value<'static> {
    a.map_or(Value::Missing, |a| {
        let mut s = String::with_capacity(21);
        push_addr(&mut s, a, true);
        Value::Str(Cow::Owned(s))
    })
}

fn ip(a: Option<std::net::SocketAddr>) -> Value<'static> {
    a.map_or(Value::Missing, |a| {
        let mut s = String::with_capacity(15);
        push_addr(&mut s, a, false);
        Value::Str(Cow::Owned(s))
    })
}

/// Dotted decimal, as `Ipv4Addr`'s `Display` writes it: its formatter (padding support, one
/// `write` per octet) cost about 1.6k instructions an address, and a line in Istio's format
/// has four.
fn push_ipv4(out: &mut String, ip: std::net::Ipv4Addr) {
    for (i, o) in ip.octets().into_iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        // An octet's at most three digits, without the general loop's buffer.
        if o >= 100 {
            out.push(char::from(b'0' + o / 100));
        }
        if o >= 10 {
            out.push(char::from(b'0' + o / 10 % 10));
        }
        out.push(char::from(b'0' + o % 10));
    }
}

/// `n` in decimal, without `fmt`'s machinery.
fn push_u64(out: &mut String, n: u64) {
    push_padded(out, n, 0);
}

/// `n` in decimal, zero-padded to `width` digits (`{n:0width$}`).
fn push_padded(out: &mut String, mut n: u64, width: usize) {
    let mut buf = [b'0'; 20];
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let at = at.min(buf.len().saturating_sub(width));
    for &d in &buf[at..] {
        out.push(char::from(d));
    }
}

fn port(a: Option<std::net::SocketAddr>) -> Value<'static> {
    a.map_or(Value::Missing, |a| Value::Int(u64::from(a.port())))
}

fn truncate(s: &str, max: Option<usize>) -> &str {
    let Some(max) = max else { return s };
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn header<'a>(ctx: &LogContext<'a>, which: Headers, key: &HeaderKey) -> Option<Cow<'a, str>> {
    let v = match which {
        Headers::Request => {
            let r = ctx.request.as_ref()?;
            match key {
                HeaderKey::Method => Some(r.method),
                HeaderKey::Path => Some(r.path),
                HeaderKey::Authority => Some(r.authority),
                HeaderKey::Scheme => Some(r.scheme),
                HeaderKey::Name(n) => r.headers.get(n).and_then(|v| v.to_str().ok()),
                HeaderKey::Status | HeaderKey::None => None,
            }
        }
        Headers::Response | Headers::Trailers => {
            let map = if which == Headers::Response {
                ctx.response?
            } else {
                ctx.trailers?
            };
            match key {
                // Envoy's response map holds the status as `:status`.
                HeaderKey::Status if which == Headers::Response => {
                    let code = ctx.info.response_code;
                    return (code != 0).then(|| Cow::Owned(code.to_string()));
                }
                HeaderKey::Name(n) => map.get(n).and_then(|v| v.to_str().ok()),
                _ => None,
            }
        }
    };
    v.filter(|v| !v.is_empty()).map(Cow::Borrowed)
}

/// Evaluates one operator.
pub fn eval<'a>(op: &Op, ctx: &LogContext<'a>) -> Value<'a> {
    let info = ctx.info;
    match op {
        Op::Header {
            which,
            main,
            alt,
            max,
            without_query,
        } => {
            let v = header(ctx, *which, main)
                .or_else(|| alt.as_ref().and_then(|a| header(ctx, *which, a)));
            match v {
                Some(Cow::Borrowed(v)) => {
                    let v = if *without_query {
                        v.split_once('?').map_or(v, |(p, _)| p)
                    } else {
                        v
                    };
                    Value::Str(Cow::Borrowed(truncate(v, *max)))
                }
                Some(Cow::Owned(v)) => Value::Str(Cow::Owned(truncate(&v, *max).to_string())),
                None => Value::Missing,
            }
        }
        Op::StartTime(f) => {
            let mut s = String::with_capacity(32);
            match f {
                None => TimeFormat::default_format().write(&mut s, info.start_time()),
                Some(f) => f.write(&mut s, info.start_time()),
            }
            Value::Str(Cow::Owned(s))
        }
        Op::ResponseCode => Value::Int(u64::from(info.response_code)),
        Op::ResponseFlags => Value::Str(info.flags.short_string()),
        Op::ResponseFlagsLong => Value::Str(info.flags.long_string()),
        Op::ResponseCodeDetails => opt_str(Some(info.response_code_details.as_ref())),
        Op::ConnectionTerminationDetails => Value::Missing,
        Op::UpstreamHost => addr(info.upstream_host),
        Op::UpstreamHostWithoutPort => ip(info.upstream_host),
        Op::UpstreamCluster => opt_str(info.upstream.as_ref().map(|u| &*u.observability_name)),
        Op::UpstreamClusterRaw => opt_str(info.upstream.as_ref().map(|u| &*u.name)),
        Op::UpstreamLocalAddress => addr(info.upstream_local),
        Op::UpstreamLocalAddressWithoutPort => ip(info.upstream_local),
        // Envoy writes the reason with its spaces as `_` (one token in a text line).
        Op::UpstreamTransportFailureReason => {
            match info.upstream_transport_failure_reason.as_deref() {
                Some(r) if !r.is_empty() => Value::Str(Cow::Owned(r.replace(' ', "_"))),
                _ => Value::Missing,
            }
        }
        Op::DownstreamLocalAddress => addr(info.downstream_local),
        Op::DownstreamLocalAddressWithoutPort => ip(info.downstream_local),
        Op::DownstreamLocalPort => port(info.downstream_local),
        Op::DownstreamRemoteAddress => addr(info.downstream_remote),
        Op::DownstreamRemoteAddressWithoutPort => ip(info.downstream_remote),
        Op::DownstreamRemotePort => port(info.downstream_remote),
        Op::DownstreamDirectRemoteAddress => addr(info.downstream_direct_remote),
        Op::DownstreamDirectRemoteAddressWithoutPort => ip(info.downstream_direct_remote),
        Op::DownstreamPeerUriSan => opt_str(info.downstream_peer_uri_san.as_deref()),
        Op::RequestedServerName => opt_str(info.requested_server_name.as_deref()),
        Op::RouteName => opt_str(info.route_name.as_deref()),
        Op::Protocol => match info.protocol {
            Protocol::Tcp => Value::Missing,
            p => Value::Str(Cow::Borrowed(p.as_str())),
        },
        Op::BytesReceived => Value::Int(info.bytes_received),
        Op::BytesSent => Value::Int(info.bytes_sent),
        Op::Duration => ms(info.duration()),
        Op::RequestDuration => info.last_downstream_rx.map_or(Value::Missing, ms),
        Op::RequestTxDuration => info.first_upstream_tx.map_or(Value::Missing, ms),
        Op::ResponseDuration => info.first_upstream_rx.map_or(Value::Missing, ms),
        Op::ResponseTxDuration => match info.first_upstream_rx {
            Some(rx) => ms(info.duration().saturating_sub(rx)),
            None => Value::Missing,
        },
        Op::UpstreamRequestAttemptCount => Value::Int(u64::from(info.attempts)),
        Op::ConnectionId => Value::Int(info.connection_id),
        Op::Hostname => opt_str(hostname()),
        Op::GrpcStatus(form) => grpc_status(ctx, *form),
        Op::Missing => Value::Missing,
    }
}

fn hostname() -> Option<&'static str> {
    static NAME: OnceLock<Option<String>> = OnceLock::new();
    NAME.get_or_init(|| {
        let mut buf = [0u8; 256];
        // SAFETY: the buffer is valid for its length; gethostname writes at most that many
        // bytes and we read up to the first NUL within it.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        if rc != 0 {
            return None;
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Some(String::from_utf8_lossy(&buf[..end]).into_owned())
    })
    .as_deref()
}

const GRPC_CAMEL: [&str; 17] = [
    "OK",
    "Canceled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
];

/// Envoy's HTTP status to gRPC status mapping (`Grpc::Utility::httpToGrpcStatus`).
pub fn http_to_grpc(code: u16) -> u32 {
    match code {
        400 => 13,
        401 => 16,
        403 => 7,
        404 => 12,
        429 | 502 | 503 | 504 => 14,
        _ => 2,
    }
}

/// The response's gRPC status: `grpc-status` of the trailers, else of the headers
/// (trailers-only), else the record's, else mapped from the HTTP status as Envoy does.
pub fn response_grpc_status(ctx: &LogContext<'_>) -> Option<u32> {
    let from = |m: Option<&http::HeaderMap>| {
        m.and_then(|m| m.get("grpc-status"))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u32>().ok())
    };
    from(ctx.trailers)
        .or_else(|| from(ctx.response))
        .or(ctx.info.grpc_status)
        .or_else(|| (ctx.info.response_code != 0).then(|| http_to_grpc(ctx.info.response_code)))
}

fn grpc_status<'a>(ctx: &LogContext<'a>, form: GrpcForm) -> Value<'a> {
    // Envoy shows a gRPC status only for gRPC requests.
    let grpc = ctx.request.as_ref().is_some_and(|r| {
        r.headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("application/grpc"))
    });
    if !grpc {
        return Value::Missing;
    }
    let Some(s) = response_grpc_status(ctx) else {
        return Value::Missing;
    };
    let names = match form {
        GrpcForm::Number => return Value::Int(u64::from(s)),
        GrpcForm::Camel => &GRPC_CAMEL,
        GrpcForm::Snake => &crate::units::GRPC_STATUS_NAMES,
    };
    match names.get(s as usize) {
        Some(n) => Value::Str(Cow::Borrowed(n)),
        None => Value::Str(Cow::Owned(s.to_string())),
    }
}

/// Appends pieces as text (`missing`: `-`, or empty with `omit_empty_values`).
pub fn write_text(out: &mut String, pieces: &[Piece], ctx: &LogContext<'_>, missing: &str) {
    for p in pieces {
        match p {
            Piece::Text(t) => out.push_str(t),
            Piece::Op(op) if write_direct(out, op, ctx, missing) => {}
            Piece::Op(op) => match eval(op, ctx) {
                Value::Missing => out.push_str(missing),
                Value::Str(s) => out.push_str(&s),
                Value::Int(n) => push_u64(out, n),
            },
        }
    }
}

/// The operators a text line writes straight into its buffer, as `eval` renders them: each
/// built as a `String` of its own cost an allocation and a copy, and a line in Istio's format
/// has five (the start time, four addresses). False for any other operator.
fn write_direct(out: &mut String, op: &Op, ctx: &LogContext<'_>, missing: &str) -> bool {
    let info = ctx.info;
    let (a, with_port) = match op {
        Op::StartTime(f) => {
            f.as_ref()
                .unwrap_or_else(|| TimeFormat::default_format())
                .write(out, info.start_time());
            return true;
        }
        Op::UpstreamHost => (info.upstream_host, true),
        Op::UpstreamHostWithoutPort => (info.upstream_host, false),
        Op::UpstreamLocalAddress => (info.upstream_local, true),
        Op::UpstreamLocalAddressWithoutPort => (info.upstream_local, false),
        Op::DownstreamLocalAddress => (info.downstream_local, true),
        Op::DownstreamLocalAddressWithoutPort => (info.downstream_local, false),
        Op::DownstreamRemoteAddress => (info.downstream_remote, true),
        Op::DownstreamRemoteAddressWithoutPort => (info.downstream_remote, false),
        Op::DownstreamDirectRemoteAddress => (info.downstream_direct_remote, true),
        Op::DownstreamDirectRemoteAddressWithoutPort => (info.downstream_direct_remote, false),
        _ => return false,
    };
    match a {
        None => out.push_str(missing),
        Some(a) => push_addr(out, a, with_port),
    }
    true
}

/// An address as `addr` (with the port) or `ip` (without) renders it.
fn push_addr(out: &mut String, a: std::net::SocketAddr, with_port: bool) {
    match a {
        std::net::SocketAddr::V4(v4) => {
            push_ipv4(out, *v4.ip());
            if with_port {
                out.push(':');
                push_u64(out, u64::from(v4.port()));
            }
        }
        std::net::SocketAddr::V6(_) if with_port => {
            let _ = write!(out, "{a}");
        }
        std::net::SocketAddr::V6(_) => {
            let _ = write!(out, "{}", a.ip());
        }
    }
}

/// A JSON format, built once: constant parts already serialized, keys sorted (Envoy 1.40
/// sorts them).
#[derive(Debug, Clone)]
pub enum JsonNode {
    /// A serialized constant (string, number, bool).
    Const(String),
    /// A literal null.
    Null,
    Template(Vec<Piece>),
    /// Serialized keys with their values.
    Map(Vec<(String, JsonNode)>),
    List(Vec<JsonNode>),
}

/// A constant JSON number as Envoy 1.40 writes it: integral values as integers, others as a
/// string of their shortest form (`1.5` becomes `"1.5"`, checked against Envoy).
fn json_number(n: f64) -> String {
    if n.is_finite() && n.fract() == 0.0 && n.abs() < 9.007_199_254_740_992e15 {
        format!("{}", n as i64)
    } else {
        json_string(&format!("{n}"))
    }
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

impl JsonNode {
    /// From a `google.protobuf.Struct`.
    pub fn from_struct(
        s: &envoy_types::pb::google::protobuf::Struct,
        ext: Extensions,
    ) -> Result<JsonNode, FormatError> {
        let mut keys: Vec<&String> = s.fields.keys().collect();
        keys.sort();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            out.push((json_string(k), JsonNode::from_value(&s.fields[k], ext)?));
        }
        Ok(JsonNode::Map(out))
    }

    fn from_value(
        v: &envoy_types::pb::google::protobuf::Value,
        ext: Extensions,
    ) -> Result<JsonNode, FormatError> {
        use envoy_types::pb::google::protobuf::value::Kind;
        Ok(match &v.kind {
            None | Some(Kind::NullValue(_)) => JsonNode::Null,
            Some(Kind::NumberValue(n)) => JsonNode::Const(json_number(*n)),
            Some(Kind::BoolValue(b)) => JsonNode::Const(b.to_string()),
            Some(Kind::StringValue(s)) if !s.contains('%') => JsonNode::Const(json_string(s)),
            Some(Kind::StringValue(s)) => JsonNode::Template(parse(s, ext)?),
            Some(Kind::StructValue(s)) => JsonNode::from_struct(s, ext)?,
            Some(Kind::ListValue(l)) => JsonNode::List(
                l.values
                    .iter()
                    .map(|v| JsonNode::from_value(v, ext))
                    .collect::<Result<_, _>>()?,
            ),
        })
    }

    /// Writes the node; false (and nothing written) when `omit` leaves it out.
    pub fn write(&self, out: &mut String, ctx: &LogContext<'_>, omit: bool) -> bool {
        match self {
            JsonNode::Const(c) => {
                out.push_str(c);
                true
            }
            JsonNode::Null => {
                if omit {
                    return false;
                }
                out.push_str("null");
                true
            }
            JsonNode::Template(pieces) => {
                if let [Piece::Op(op)] = pieces.as_slice() {
                    // A single operator keeps its type.
                    match eval(op, ctx) {
                        Value::Missing if omit => return false,
                        Value::Missing => out.push_str("null"),
                        Value::Int(n) => push_u64(out, n),
                        Value::Str(s) => out.push_str(&json_string(&s)),
                    }
                    return true;
                }
                let mut s = String::new();
                write_text(&mut s, pieces, ctx, if omit { "" } else { "-" });
                out.push_str(&json_string(&s));
                true
            }
            JsonNode::Map(fields) => {
                let start = out.len();
                out.push('{');
                let mut empty = true;
                for (k, v) in fields {
                    let field_start = out.len();
                    if !empty {
                        out.push(',');
                    }
                    out.push_str(k);
                    out.push(':');
                    if !v.write(out, ctx, omit) {
                        out.truncate(field_start);
                        continue;
                    }
                    empty = false;
                }
                if empty && omit {
                    out.truncate(start);
                    return false;
                }
                out.push('}');
                true
            }
            JsonNode::List(items) => {
                out.push('[');
                let mut empty = true;
                for v in items {
                    let item_start = out.len();
                    if !empty {
                        out.push(',');
                    }
                    if !v.write(out, ctx, omit) {
                        out.truncate(item_start);
                        continue;
                    }
                    empty = false;
                }
                out.push(']');
                true
            }
        }
    }
}

/// A `%START_TIME(...)%` format: strftime with Envoy's additions (`%f`, `%1f`..`%9f`: the
/// fraction of the second to that many digits, `%f` 9; `%s`: seconds since the epoch),
/// always in UTC as Envoy writes it.
#[derive(Debug, Clone)]
pub struct TimeFormat {
    pieces: Vec<TimePiece>,
    /// Where the pieces that read a fraction of the second start: those before it change
    /// once a second, and are written once a second (`write`).
    split: usize,
    /// Unique to the parse (a clone has the same pieces): what a thread's cached text of
    /// the whole seconds was written for.
    id: u64,
}

thread_local! {
    /// The last (format id, second) written and its text up to `split`.
    static SECONDS: std::cell::RefCell<(u64, i64, String)> =
        const { std::cell::RefCell::new((u64::MAX, 0, String::new())) };
}

#[derive(Debug, Clone)]
enum TimePiece {
    Text(String),
    /// A conversion character (`Y`, `m`, ...).
    Conv(char),
    /// Fraction digits.
    Frac(u8),
    /// `%E<n>S`: seconds with `n` fraction digits.
    SecFrac(u8),
}

impl TimeFormat {
    pub fn parse(s: &str) -> TimeFormat {
        let mut out = Vec::new();
        let mut text = String::new();
        let mut chars = s.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                text.push(c);
                continue;
            }
            let piece = match chars.peek().copied() {
                Some(d @ '1'..='9') => {
                    chars.next();
                    if chars.peek() == Some(&'f') {
                        chars.next();
                        TimePiece::Frac(d as u8 - b'0')
                    } else {
                        text.push('%');
                        text.push(d);
                        continue;
                    }
                }
                Some('f') => {
                    chars.next();
                    TimePiece::Frac(9)
                }
                Some('E') => {
                    chars.next();
                    match (chars.next(), chars.next()) {
                        (Some(d @ '0'..='9'), Some('S')) => TimePiece::SecFrac(d as u8 - b'0'),
                        (Some('*'), Some('S')) => TimePiece::SecFrac(9),
                        (a, b) => {
                            text.push_str("%E");
                            text.extend(a);
                            text.extend(b);
                            continue;
                        }
                    }
                }
                Some(c) => {
                    chars.next();
                    TimePiece::Conv(c)
                }
                None => {
                    text.push('%');
                    continue;
                }
            };
            if !text.is_empty() {
                out.push(TimePiece::Text(std::mem::take(&mut text)));
            }
            out.push(piece);
        }
        if !text.is_empty() {
            out.push(TimePiece::Text(text));
        }
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        TimeFormat {
            split: out
                .iter()
                .position(|p| matches!(p, TimePiece::Frac(_) | TimePiece::SecFrac(_)))
                .unwrap_or(out.len()),
            pieces: out,
            id: IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Envoy's default: `2026-12-02T15:14:45.829Z`.
    fn default_format() -> &'static TimeFormat {
        static F: OnceLock<TimeFormat> = OnceLock::new();
        F.get_or_init(|| TimeFormat::parse("%Y-%m-%dT%H:%M:%E3SZ"))
    }

    /// `t` in this format. What the whole seconds make, up to the first piece that reads a
    /// fraction of one (the date, hours and minutes of Istio's default format, whose seconds
    /// come with their milliseconds), is written once a second per thread and copied from then
    /// on: five numbers and the calendar arithmetic cost about 1k instructions a line.
    pub fn write(&self, out: &mut String, t: std::time::SystemTime) {
        let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        let secs = d.as_secs() as i64;
        let nanos = d.subsec_nanos();
        let (whole, fraction) = self.pieces.split_at(self.split);
        if !whole.is_empty() {
            SECONDS.with_borrow_mut(|(id, at, text)| {
                if (*id, *at) != (self.id, secs) {
                    text.clear();
                    write_pieces(whole, text, secs, nanos);
                    (*id, *at) = (self.id, secs);
                }
                out.push_str(text);
            });
        }
        write_pieces(fraction, out, secs, nanos);
    }
}

/// `pieces` of a time format for the time `secs` and `nanos` after the epoch.
fn write_pieces(pieces: &[TimePiece], out: &mut String, secs: i64, nanos: u32) {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, mo, da) = civil_from_days(days);
    let (h, mi, s) = (sod / 3600, sod / 60 % 60, sod % 60);
    let wday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    const WD: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    const MO: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let month = MO[(mo as usize).saturating_sub(1).min(11)];
    let yday = days - days_from_civil(y, 1, 1) + 1;
    for p in pieces {
        let _ = match p {
            TimePiece::Text(t) => {
                out.push_str(t);
                Ok(())
            }
            // The default format's pieces as digits pushed directly: `write!` with padding
            // cost more than the date arithmetic.
            TimePiece::Frac(n) => {
                let v = nanos / 10u32.pow(9 - u32::from(*n));
                push_padded(out, u64::from(v), usize::from(*n));
                Ok(())
            }
            TimePiece::SecFrac(n) => {
                push_padded(out, s as u64, 2);
                if *n > 0 {
                    let v = nanos / 10u32.pow(9 - u32::from(*n));
                    out.push('.');
                    push_padded(out, u64::from(v), usize::from(*n));
                }
                Ok(())
            }
            TimePiece::Conv(c) => match c {
                'Y' if y >= 0 => {
                    push_u64(out, y as u64);
                    Ok(())
                }
                'Y' => write!(out, "{y}"),
                'C' => write!(out, "{:02}", y / 100),
                'y' => write!(out, "{:02}", y % 100),
                'm' => {
                    push_padded(out, u64::from(mo), 2);
                    Ok(())
                }
                'd' => {
                    push_padded(out, u64::from(da), 2);
                    Ok(())
                }
                'e' => write!(out, "{da:2}"),
                'j' => write!(out, "{yday:03}"),
                'H' => {
                    push_padded(out, h as u64, 2);
                    Ok(())
                }
                'I' => write!(out, "{:02}", if h % 12 == 0 { 12 } else { h % 12 }),
                'M' => {
                    push_padded(out, mi as u64, 2);
                    Ok(())
                }
                'S' => {
                    push_padded(out, s as u64, 2);
                    Ok(())
                }
                'p' => write!(out, "{}", if h < 12 { "AM" } else { "PM" }),
                's' => write!(out, "{secs}"),
                'a' => write!(out, "{}", &WD[wday][..3]),
                'A' => write!(out, "{}", WD[wday]),
                'u' => write!(out, "{}", if wday == 0 { 7 } else { wday }),
                'w' => write!(out, "{wday}"),
                'b' | 'h' => write!(out, "{}", &month[..3]),
                'B' => write!(out, "{month}"),
                'F' => write!(out, "{y}-{mo:02}-{da:02}"),
                'D' => write!(out, "{mo:02}/{da:02}/{:02}", y % 100),
                'T' => write!(out, "{h:02}:{mi:02}:{s:02}"),
                'R' => write!(out, "{h:02}:{mi:02}"),
                'z' => write!(out, "+0000"),
                'Z' => write!(out, "UTC"),
                'n' => writeln!(out),
                't' => write!(out, "\t"),
                '%' => write!(out, "%"),
                other => write!(out, "%{other}"),
            },
        };
    }
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_and_addresses_read_as_fmt_writes_them() {
        let samples = [
            0u64,
            1,
            9,
            10,
            99,
            100,
            255,
            999,
            1000,
            65_535,
            123_456_789,
            u64::MAX,
        ];
        for n in samples {
            for width in [0, 1, 2, 3, 9] {
                let mut ours = String::new();
                push_padded(&mut ours, n, width);
                assert_eq!(ours, format!("{n:0width$}"), "{n} width {width}");
            }
        }
        let addrs = [
            "0.0.0.0:0",
            "127.0.0.1:19080",
            "10.244.1.23:8080",
            "255.255.255.255:65535",
            "1.20.3.100:443",
            "[::1]:80",
            "[2001:db8::8a2e:370:7334]:15021",
            "[::ffff:10.0.0.1]:9080",
        ];
        for a in addrs {
            let sa: std::net::SocketAddr = a.parse().expect("address");
            assert_eq!(
                addr(Some(sa)),
                Value::Str(Cow::Owned(sa.to_string())),
                "{a}"
            );
            assert_eq!(
                ip(Some(sa)),
                Value::Str(Cow::Owned(sa.ip().to_string())),
                "{a}"
            );
        }
    }

    #[test]
    fn operators_written_straight_into_a_line_read_as_eval_renders_them() {
        let ops = [
            Op::StartTime(None),
            Op::StartTime(Some(TimeFormat::parse("%s %Y %E6S"))),
            Op::UpstreamHost,
            Op::UpstreamHostWithoutPort,
            Op::UpstreamLocalAddress,
            Op::UpstreamLocalAddressWithoutPort,
            Op::DownstreamLocalAddress,
            Op::DownstreamLocalAddressWithoutPort,
            Op::DownstreamRemoteAddress,
            Op::DownstreamRemoteAddressWithoutPort,
            Op::DownstreamDirectRemoteAddress,
            Op::DownstreamDirectRemoteAddressWithoutPort,
        ];
        let addrs = [None, Some("10.244.1.23:8080"), Some("[2001:db8::1]:15021")];
        for a in addrs {
            let a = a.map(|a| a.parse::<std::net::SocketAddr>().expect("address"));
            let mut info = crate::telemetry::stream_info::StreamInfo::new(Protocol::Http11);
            info.set_start_time(UNIX_EPOCH + Duration::new(1_796_397_286, 829_123_456));
            info.upstream_host = a;
            info.upstream_local = a;
            info.downstream_local = a;
            info.downstream_remote = a;
            info.downstream_direct_remote = a;
            let ctx = LogContext {
                info: &info,
                request: None,
                response: None,
                trailers: None,
                log_type: 0,
            };
            for op in &ops {
                let mut direct = String::new();
                assert!(write_direct(&mut direct, op, &ctx, "-"), "{op:?}");
                let evaluated = match eval(op, &ctx) {
                    Value::Missing => "-".to_string(),
                    Value::Str(s) => s.into_owned(),
                    Value::Int(n) => n.to_string(),
                };
                assert_eq!(direct, evaluated, "{op:?} {a:?}");
            }
        }
    }

    #[test]
    fn the_whole_seconds_written_once_read_as_writing_them_each_time() {
        let formats = [
            TimeFormat::parse("%Y-%m-%dT%H:%M:%E3SZ"),
            TimeFormat::parse("%s.%3f %a %b %e %j"),
            TimeFormat::parse("%H:%M:%S"),
            TimeFormat::parse("%9f at %T"),
            TimeFormat::parse("literal"),
        ];
        let base = UNIX_EPOCH + Duration::new(1_796_397_286, 0);
        let times = [
            Duration::new(0, 829_123_456),
            Duration::new(0, 999_999_999),
            Duration::new(1, 0),
            Duration::new(1, 5_000_000),
            Duration::new(0, 1),
            Duration::new(86_400, 42),
        ];
        // Formats taking turns, times going back and forth within and across seconds.
        for t in times {
            for f in formats.iter().chain(formats.iter().rev()) {
                let mut cached = String::from("before ");
                f.write(&mut cached, base + t);
                let mut fresh = String::from("before ");
                let d = (base + t).duration_since(UNIX_EPOCH).expect("after");
                write_pieces(&f.pieces, &mut fresh, d.as_secs() as i64, d.subsec_nanos());
                assert_eq!(cached, fresh, "{f:?} {t:?}");
            }
        }
    }

    #[test]
    fn the_default_start_time_is_envoys() {
        let t = UNIX_EPOCH + Duration::new(1_796_397_286, 829_123_456);
        let mut s = String::new();
        TimeFormat::default_format().write(&mut s, t);
        assert_eq!(s, "2026-12-04T15:14:46.829Z");
        let mut s = String::new();
        TimeFormat::parse("%Y%m%d %H:%M:%S %E0S %E6S %1f %9f").write(&mut s, UNIX_EPOCH);
        assert_eq!(s, "19700101 00:00:00 00 00.000000 0 000000000");
    }
}
