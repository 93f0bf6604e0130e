//! Envoy's custom request/response headers (`request_headers_to_add`, `..._to_remove` and the
//! response pair) at route-config, virtual-host, route and weighted-cluster level.
//!
//! Everything is parsed once here: header names, append actions and the `%COMMAND%`
//! substitution formatters. The request path only walks precomputed lists; a value with no
//! command is a ready `HeaderValue` (cloning it is a reference-count bump).

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3 as corepb;
use http::{HeaderMap, HeaderName, HeaderValue};
use pingora_http::{RequestHeader, ResponseHeader};

/// `HeaderValueOption.append_action`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendAction {
    AppendIfExistsOrAdd,
    AddIfAbsent,
    OverwriteIfExistsOrAdd,
    OverwriteIfExists,
}

impl AppendAction {
    /// Whether the entry takes effect given whether the header is present (after removals).
    fn applies(self, present: bool) -> bool {
        match self {
            AppendAction::AppendIfExistsOrAdd | AppendAction::OverwriteIfExistsOrAdd => true,
            AppendAction::AddIfAbsent => !present,
            AppendAction::OverwriteIfExists => present,
        }
    }

    fn overwrites(self) -> bool {
        matches!(
            self,
            AppendAction::OverwriteIfExistsOrAdd | AppendAction::OverwriteIfExists
        )
    }
}

/// One `%COMMAND%` of a header value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    RemoteAddress,
    RemoteAddressWithoutPort,
    RemotePort,
    DirectRemoteAddress,
    DirectRemoteAddressWithoutPort,
    DirectRemotePort,
    LocalAddress,
    LocalAddressWithoutPort,
    LocalPort,
    Protocol,
    /// `%REQ(main?alt):max%`: the first value of a request header (or pseudo-header).
    Req {
        main: ReqHeader,
        alt: Option<ReqHeader>,
        max_len: Option<usize>,
    },
}

/// A request header a `%REQ(...)%` reads; pseudo-headers map to the request line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReqHeader {
    Path,
    Method,
    Authority,
    Scheme,
    Named(HeaderName),
    /// A name no request can carry: always missing.
    Never,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Literal(String),
    Command(Command),
}

/// A header value: fixed, or assembled from literals and commands per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    Static(HeaderValue),
    Dynamic(Vec<Part>),
}

#[derive(Debug, Clone)]
pub struct HeaderAdd {
    pub name: HeaderName,
    pub value: Format,
    pub action: AppendAction,
    /// `keep_empty_value`: add the header even when its value comes out empty.
    pub keep_empty: bool,
}

/// One level's header mutations: removals first, then additions, as Envoy's `HeaderParser`.
#[derive(Debug, Clone, Default)]
pub struct HeaderOps {
    pub remove: Vec<HeaderName>,
    pub add: Vec<HeaderAdd>,
    /// No `Format::Dynamic` in `add`: values need no rendering, so no per-request buffer.
    all_static: bool,
}

/// Translation errors, worded as Envoy's where Envoy has a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("header name must not be empty")]
    EmptyName,
    #[error("invalid header name '{0}'")]
    InvalidName(String),
    #[error("'{0}': invalid header value characters")]
    InvalidValue(String),
    #[error("'{0}': only one of value or raw_value can be set")]
    ValueAndRawValue(String),
    #[error("'{0}': raw_value must be UTF-8")]
    RawValueNotUtf8(String),
    #[error(":-prefixed or host headers may not be modified")]
    NotModifiable,
    #[error(":-prefixed or host headers may not be removed")]
    NotRemovable,
    #[error("Both append and append_action are set and it's not allowed")]
    AppendAndAction,
    #[error("unknown append_action {0}")]
    UnknownAction(i32),
    #[error("Incorrect configuration: {format}. Couldn't find valid command at position {pos}")]
    NoCommand { format: String, pos: usize },
    #[error("Not supported field in StreamInfo: {0}")]
    UnknownCommand(String),
    #[error("substitution command %{0}% is not supported by Portico")]
    Unsupported(String),
    #[error("{0} requires parameters")]
    ParamsRequired(String),
    #[error("{0} does not take any parameters or length")]
    NoParams(String),
    #[error("More than 1 alternative header specified in token: {0}")]
    TooManyAlternatives(String),
}

/// The header map side of a mutation: pingora keeps header-name case in a side table, so
/// mutations must go through its own methods.
pub trait HeaderTarget {
    fn headers(&self) -> &HeaderMap;
    /// The request itself, when the target is one (its own formatters read it).
    fn as_request(&self) -> Option<&RequestHeader> {
        None
    }
    fn remove(&mut self, name: &HeaderName);
    fn set(&mut self, name: &HeaderName, value: HeaderValue);
    fn append(&mut self, name: &HeaderName, value: HeaderValue);
}

macro_rules! pingora_target {
    ($t:ty, $req:expr) => {
        impl HeaderTarget for $t {
            fn headers(&self) -> &HeaderMap {
                &self.headers
            }
            fn as_request(&self) -> Option<&RequestHeader> {
                $req(self)
            }
            fn remove(&mut self, name: &HeaderName) {
                self.remove_header(name);
            }
            fn set(&mut self, name: &HeaderName, value: HeaderValue) {
                // Only fails on invalid names/values, which translation already excluded.
                let _ = self.insert_header(name.clone(), value);
            }
            fn append(&mut self, name: &HeaderName, value: HeaderValue) {
                let _ = self.append_header(name.clone(), value);
            }
        }
    };
}
pingora_target!(RequestHeader, Some);
pingora_target!(ResponseHeader, |_| None);

impl HeaderTarget for HeaderMap {
    fn headers(&self) -> &HeaderMap {
        self
    }
    fn remove(&mut self, name: &HeaderName) {
        HeaderMap::remove(self, name);
    }
    fn set(&mut self, name: &HeaderName, value: HeaderValue) {
        self.insert(name.clone(), value);
    }
    fn append(&mut self, name: &HeaderName, value: HeaderValue) {
        HeaderMap::append(self, name.clone(), value);
    }
}

/// What the formatters read besides the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct FormatCtx {
    /// Envoy's downstream remote address (XFF-derived as the connection manager decides).
    pub remote: Option<SocketAddr>,
    /// The peer of the downstream connection.
    pub direct_remote: Option<SocketAddr>,
    pub local: Option<SocketAddr>,
}

impl HeaderOps {
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.add.is_empty()
    }

    /// Builds one level from its proto lists.
    /// `side` is `request` or `response`, for the field names in errors.
    pub fn translate(
        side: &str,
        add: &[corepb::HeaderValueOption],
        remove: &[String],
    ) -> Result<HeaderOps, String> {
        let mut ops = HeaderOps::default();
        for (i, h) in add.iter().enumerate() {
            let key = h.header.as_ref().map_or("", |v| v.key.as_str());
            if let Some(a) =
                header_add(h).map_err(|e| format!("{side}_headers_to_add[{i}] '{key}': {e}"))?
            {
                ops.add.push(a);
            }
        }
        for (i, name) in remove.iter().enumerate() {
            ops.remove.push(
                removable(name)
                    .map_err(|e| format!("{side}_headers_to_remove[{i}] '{name}': {e}"))?,
            );
        }
        ops.all_static = ops.add.iter().all(|a| matches!(a.value, Format::Static(_)));
        Ok(ops)
    }

    /// Applies removals, then additions, as Envoy's `HeaderParser::evaluateHeaders`: every value
    /// is computed (and every presence check made) against the headers after removal, then all
    /// overwrites are applied, then all appends.
    ///
    /// `req` is the request the formatters read; `None` when `target` is that request.
    pub fn apply<T: HeaderTarget>(
        &self,
        target: &mut T,
        req: Option<&RequestHeader>,
        ctx: &FormatCtx,
    ) {
        for name in &self.remove {
            target.remove(name);
        }
        if self.add.is_empty() {
            return;
        }
        if self.all_static && self.add.len() <= 64 {
            // Static values: presence decides, so one bitmask replaces a value buffer.
            let mut take = 0u64;
            for (i, a) in self.add.iter().enumerate() {
                if a.action.applies(target.headers().contains_key(&a.name)) {
                    take |= 1 << i;
                }
            }
            for pass_overwrite in [true, false] {
                for (i, a) in self.add.iter().enumerate() {
                    if take & (1 << i) == 0 || a.action.overwrites() != pass_overwrite {
                        continue;
                    }
                    if let Format::Static(v) = &a.value {
                        if pass_overwrite {
                            target.set(&a.name, v.clone());
                        } else {
                            target.append(&a.name, v.clone());
                        }
                    }
                }
            }
            return;
        }
        let values: Vec<Option<HeaderValue>> = {
            let reqh = req.or_else(|| target.as_request());
            let mut buf = String::new();
            self.add
                .iter()
                .map(|a| {
                    if !a.action.applies(target.headers().contains_key(&a.name)) {
                        return None;
                    }
                    let v = match &a.value {
                        Format::Static(v) => v.clone(),
                        Format::Dynamic(parts) => {
                            buf.clear();
                            render(parts, reqh, ctx, &mut buf);
                            // A request value may hold bytes a header cannot; drop it then.
                            HeaderValue::from_bytes(buf.as_bytes()).ok()?
                        }
                    };
                    (a.keep_empty || !v.is_empty()).then_some(v)
                })
                .collect()
        };
        for pass_overwrite in [true, false] {
            for (a, v) in self.add.iter().zip(&values) {
                let Some(v) = v else { continue };
                if a.action.overwrites() == pass_overwrite {
                    if pass_overwrite {
                        target.set(&a.name, v.clone());
                    } else {
                        target.append(&a.name, v.clone());
                    }
                }
            }
        }
    }
}

/// One level's (request, response) ops; `None` where the level has none.
pub type LevelOps = (Option<Arc<HeaderOps>>, Option<Arc<HeaderOps>>);

/// The header mutations of a route as they apply, in order, precomputed per route.
#[derive(Debug, Clone, Default)]
pub struct HeaderPlan {
    pub request: Vec<Arc<HeaderOps>>,
    pub response: Vec<Arc<HeaderOps>>,
}

impl HeaderPlan {
    /// Envoy applies the route, then vhost, then route-config level ("later evaluated wins",
    /// so the least specific wins) unless `most_specific_header_mutations_wins` reverses it.
    pub fn build(levels: [&LevelOps; 3], most_specific_wins: bool) -> HeaderPlan {
        // `levels` is route config, vhost, route (least to most specific).
        let mut order: Vec<&LevelOps> = levels.to_vec();
        if !most_specific_wins {
            order.reverse();
        }
        HeaderPlan {
            request: order.iter().filter_map(|l| l.0.clone()).collect(),
            response: order.iter().filter_map(|l| l.1.clone()).collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.request.is_empty() && self.response.is_empty()
    }
}

/// A level's request and response ops, `None` when empty.
pub fn level(
    req_add: &[corepb::HeaderValueOption],
    req_remove: &[String],
    resp_add: &[corepb::HeaderValueOption],
    resp_remove: &[String],
) -> Result<LevelOps, String> {
    let req = HeaderOps::translate("request", req_add, req_remove)?;
    let resp = HeaderOps::translate("response", resp_add, resp_remove)?;
    let wrap = |o: HeaderOps| (!o.is_empty()).then(|| Arc::new(o));
    Ok((wrap(req), wrap(resp)))
}

/// Envoy's `isModifiableHeader` / `isRemovableHeader`: no pseudo-headers, no `host`.
fn protected(name: &str) -> bool {
    name.starts_with(':') || name.eq_ignore_ascii_case("host")
}

fn header_name(name: &str) -> Result<HeaderName, HeaderError> {
    if name.is_empty() {
        return Err(HeaderError::EmptyName);
    }
    HeaderName::from_bytes(name.as_bytes()).map_err(|_| HeaderError::InvalidName(name.into()))
}

fn removable(name: &str) -> Result<HeaderName, HeaderError> {
    if name.is_empty() {
        return Err(HeaderError::EmptyName);
    }
    if protected(name) {
        return Err(HeaderError::NotRemovable);
    }
    header_name(name)
}

fn header_add(h: &corepb::HeaderValueOption) -> Result<Option<HeaderAdd>, HeaderError> {
    use corepb::header_value_option::HeaderAppendAction as A;
    let hv = h.header.as_ref().ok_or(HeaderError::EmptyName)?;
    if hv.key.is_empty() {
        return Err(HeaderError::EmptyName);
    }
    #[allow(deprecated)]
    let append = h.append.as_ref().map(|b| b.value);
    let action = match (append, A::try_from(h.append_action)) {
        (Some(_), Ok(a)) if a != A::AppendIfExistsOrAdd => {
            return Err(HeaderError::AppendAndAction)
        }
        (Some(true), _) => AppendAction::AppendIfExistsOrAdd,
        (Some(false), _) => AppendAction::OverwriteIfExistsOrAdd,
        (None, Ok(A::AppendIfExistsOrAdd)) => AppendAction::AppendIfExistsOrAdd,
        (None, Ok(A::AddIfAbsent)) => AppendAction::AddIfAbsent,
        (None, Ok(A::OverwriteIfExistsOrAdd)) => AppendAction::OverwriteIfExistsOrAdd,
        (None, Ok(A::OverwriteIfExists)) => AppendAction::OverwriteIfExists,
        (_, Err(_)) => return Err(HeaderError::UnknownAction(h.append_action)),
    };
    // Envoy checks the name before the value.
    if protected(&hv.key) {
        return Err(HeaderError::NotModifiable);
    }
    let name = header_name(&hv.key)?;
    let raw = match (hv.value.is_empty(), hv.raw_value.is_empty()) {
        (_, true) => hv.value.as_str(),
        (true, false) => std::str::from_utf8(&hv.raw_value)
            .map_err(|_| HeaderError::RawValueNotUtf8(hv.key.clone()))?,
        (false, false) => return Err(HeaderError::ValueAndRawValue(hv.key.clone())),
    };
    let parts = parse_format(raw)?;
    let value = match parts.as_slice() {
        [] => Format::Static(HeaderValue::from_static("")),
        [Part::Literal(s)] => Format::Static(
            HeaderValue::from_bytes(s.as_bytes())
                .map_err(|_| HeaderError::InvalidValue(hv.key.clone()))?,
        ),
        _ => {
            for p in &parts {
                if let Part::Literal(s) = p {
                    HeaderValue::from_bytes(s.as_bytes())
                        .map_err(|_| HeaderError::InvalidValue(hv.key.clone()))?;
                }
            }
            Format::Dynamic(parts)
        }
    };
    // An empty fixed value without keep_empty_value never adds anything: drop it now.
    if matches!(&value, Format::Static(v) if v.is_empty()) && !h.keep_empty_value {
        return Ok(None);
    }
    Ok(Some(HeaderAdd {
        name,
        value,
        action,
        keep_empty: h.keep_empty_value,
    }))
}

/// Commands Envoy knows but Portico does not render; named so the NACK says "not supported"
/// rather than Envoy's "Not supported field" for a misspelt command.
const ENVOY_ONLY_COMMANDS: &[&str] = &[
    "START_TIME",
    "START_TIME_LOCAL",
    "SYSTEM_TIME",
    "REQUEST_DURATION",
    "REQUEST_TX_DURATION",
    "RESPONSE_DURATION",
    "RESPONSE_TX_DURATION",
    "DURATION",
    "BYTES_RECEIVED",
    "BYTES_SENT",
    "RESPONSE_CODE",
    "RESPONSE_CODE_DETAILS",
    "RESPONSE_FLAGS",
    "RESPONSE_FLAGS_LONG",
    "RESP",
    "TRAILER",
    "UPSTREAM_HOST",
    "UPSTREAM_HOST_NAME",
    "UPSTREAM_CLUSTER",
    "UPSTREAM_CLUSTER_RAW",
    "UPSTREAM_LOCAL_ADDRESS",
    "UPSTREAM_LOCAL_ADDRESS_WITHOUT_PORT",
    "UPSTREAM_LOCAL_PORT",
    "UPSTREAM_REMOTE_ADDRESS",
    "UPSTREAM_REMOTE_ADDRESS_WITHOUT_PORT",
    "UPSTREAM_REMOTE_PORT",
    "UPSTREAM_TRANSPORT_FAILURE_REASON",
    "UPSTREAM_METADATA",
    "UPSTREAM_PEER_URI_SAN",
    "UPSTREAM_PEER_SUBJECT",
    "UPSTREAM_LOCAL_URI_SAN",
    "DYNAMIC_METADATA",
    "CLUSTER_METADATA",
    "FILTER_STATE",
    "UPSTREAM_FILTER_STATE",
    "PER_REQUEST_STATE",
    "HOSTNAME",
    "ROUTE_NAME",
    "VIRTUAL_CLUSTER_NAME",
    "REQUESTED_SERVER_NAME",
    "CONNECTION_ID",
    "STREAM_ID",
    "UPSTREAM_CONNECTION_ID",
    "CONNECTION_TERMINATION_DETAILS",
    "DOWNSTREAM_PEER_URI_SAN",
    "DOWNSTREAM_PEER_SUBJECT",
    "DOWNSTREAM_PEER_ISSUER",
    "DOWNSTREAM_PEER_CERT",
    "DOWNSTREAM_PEER_FINGERPRINT_256",
    "DOWNSTREAM_PEER_FINGERPRINT_1",
    "DOWNSTREAM_PEER_SERIAL",
    "DOWNSTREAM_LOCAL_URI_SAN",
    "DOWNSTREAM_LOCAL_SUBJECT",
    "DOWNSTREAM_TLS_VERSION",
    "DOWNSTREAM_TLS_CIPHER",
    "DOWNSTREAM_TLS_SESSION_ID",
    "DOWNSTREAM_TRANSPORT_FAILURE_REASON",
    "DOWNSTREAM_LOCAL_ADDRESS_ENDPOINT_ID",
    "DOWNSTREAM_REMOTE_ADDRESS_ENDPOINT_ID",
    "DOWNSTREAM_DIRECT_LOCAL_ADDRESS",
    "DOWNSTREAM_DIRECT_LOCAL_ADDRESS_WITHOUT_PORT",
    "DOWNSTREAM_DIRECT_LOCAL_PORT",
    "DOWNSTREAM_HEADER_BYTES_RECEIVED",
    "DOWNSTREAM_HEADER_BYTES_SENT",
    "DOWNSTREAM_WIRE_BYTES_RECEIVED",
    "DOWNSTREAM_WIRE_BYTES_SENT",
    "UPSTREAM_HEADER_BYTES_RECEIVED",
    "UPSTREAM_HEADER_BYTES_SENT",
    "UPSTREAM_WIRE_BYTES_RECEIVED",
    "UPSTREAM_WIRE_BYTES_SENT",
    "ENVIRONMENT",
    "UNIQUE_ID",
    "TRACE_ID",
    "GRPC_STATUS",
    "GRPC_STATUS_NUMBER",
    "REQUEST_HEADERS_BYTES",
    "RESPONSE_HEADERS_BYTES",
    "RESPONSE_TRAILERS_BYTES",
    "UPSTREAM_PROTOCOL",
    "UPSTREAM_REQUEST_ATTEMPT_COUNT",
    "ACCESS_LOG_TYPE",
    "CUSTOM_FLAGS",
    "COMMON_DURATION",
    "QUERY_PARAM",
    "PATH",
    "CEL",
    "METADATA",
    "REQ_WITHOUT_QUERY",
];

/// Envoy's substitution-format grammar: literal text with `%%` for `%`, and commands
/// `%COMMAND(SUBCOMMAND):LENGTH%` where COMMAND is `[A-Z0-9_]+` and SUBCOMMAND has no `)`.
pub fn parse_format(format: &str) -> Result<Vec<Part>, HeaderError> {
    let b = format.as_bytes();
    let mut parts = Vec::new();
    let mut lit = String::new();
    let mut pos = 0;
    while pos < b.len() {
        if b[pos] != b'%' {
            // Copy the run of literal text up to the next `%` (keeps UTF-8 intact).
            let end = format[pos..].find('%').map_or(b.len(), |i| pos + i);
            lit.push_str(&format[pos..end]);
            pos = end;
            continue;
        }
        if b.get(pos + 1) == Some(&b'%') {
            lit.push('%');
            pos += 2;
            continue;
        }
        let no_command = || HeaderError::NoCommand {
            format: format.to_string(),
            pos,
        };
        let mut i = pos + 1;
        while i < b.len() && (b[i].is_ascii_uppercase() || b[i].is_ascii_digit() || b[i] == b'_') {
            i += 1;
        }
        if i == pos + 1 {
            return Err(no_command());
        }
        let command = &format[pos + 1..i];
        let mut sub = None;
        if b.get(i) == Some(&b'(') {
            let close = format[i + 1..].find(')').ok_or_else(no_command)?;
            sub = Some(&format[i + 1..i + 1 + close]);
            i += close + 2;
        }
        let mut len = None;
        if b.get(i) == Some(&b':') {
            let digits = format[i + 1..]
                .bytes()
                .take_while(u8::is_ascii_digit)
                .count();
            if digits == 0 {
                return Err(no_command());
            }
            len = Some(&format[i + 1..i + 1 + digits]);
            i += 1 + digits;
        }
        if b.get(i) != Some(&b'%') {
            return Err(no_command());
        }
        if !lit.is_empty() {
            parts.push(Part::Literal(std::mem::take(&mut lit)));
        }
        parts.push(Part::Command(command_of(command, sub, len)?));
        pos = i + 1;
    }
    if !lit.is_empty() {
        parts.push(Part::Literal(lit));
    }
    Ok(parts)
}

fn command_of(command: &str, sub: Option<&str>, len: Option<&str>) -> Result<Command, HeaderError> {
    let plain = |c: Command| {
        if sub.is_some() || len.is_some() {
            Err(HeaderError::NoParams(command.to_string()))
        } else {
            Ok(c)
        }
    };
    match command {
        "DOWNSTREAM_REMOTE_ADDRESS" => plain(Command::RemoteAddress),
        "DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT" => plain(Command::RemoteAddressWithoutPort),
        "DOWNSTREAM_REMOTE_PORT" => plain(Command::RemotePort),
        "DOWNSTREAM_DIRECT_REMOTE_ADDRESS" => plain(Command::DirectRemoteAddress),
        "DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT" => {
            plain(Command::DirectRemoteAddressWithoutPort)
        }
        "DOWNSTREAM_DIRECT_REMOTE_PORT" => plain(Command::DirectRemotePort),
        "DOWNSTREAM_LOCAL_ADDRESS" => plain(Command::LocalAddress),
        "DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT" => plain(Command::LocalAddressWithoutPort),
        "DOWNSTREAM_LOCAL_PORT" => plain(Command::LocalPort),
        "PROTOCOL" => plain(Command::Protocol),
        "REQ" => {
            let sub = sub
                .filter(|s| !s.is_empty())
                .ok_or_else(|| HeaderError::ParamsRequired(command.to_string()))?;
            let mut names = sub.split('?');
            let main = names.next().unwrap_or_default();
            let alt = names.next();
            if names.next().is_some() {
                return Err(HeaderError::TooManyAlternatives(sub.to_string()));
            }
            let max_len = match len {
                None => None,
                Some(l) => Some(l.parse::<usize>().map_err(|_| HeaderError::NoCommand {
                    format: format!("%{command}({sub}):{l}%"),
                    pos: 0,
                })?),
            };
            Ok(Command::Req {
                main: req_header(main),
                alt: alt.map(req_header),
                max_len,
            })
        }
        c if ENVOY_ONLY_COMMANDS.contains(&c) => Err(HeaderError::Unsupported(c.to_string())),
        c => Err(HeaderError::UnknownCommand(c.to_string())),
    }
}

fn req_header(name: &str) -> ReqHeader {
    let lower = name.to_ascii_lowercase();
    match lower.as_str() {
        ":path" => ReqHeader::Path,
        ":method" => ReqHeader::Method,
        ":authority" | "host" => ReqHeader::Authority,
        ":scheme" => ReqHeader::Scheme,
        n => HeaderName::from_bytes(n.as_bytes()).map_or(ReqHeader::Never, ReqHeader::Named),
    }
}

fn req_value<'a>(h: &ReqHeader, req: &'a RequestHeader) -> Option<&'a str> {
    let v = match h {
        ReqHeader::Path => req.uri.path_and_query().map_or("/", |p| p.as_str()),
        ReqHeader::Method => req.method.as_str(),
        ReqHeader::Authority => req.uri.authority().map(|a| a.as_str()).or_else(|| {
            req.headers
                .get(http::header::HOST)
                .and_then(|v| v.to_str().ok())
        })?,
        ReqHeader::Scheme => req.uri.scheme_str().unwrap_or("http"),
        ReqHeader::Named(n) => req.headers.get(n).and_then(|v| v.to_str().ok())?,
        ReqHeader::Never => return None,
    };
    (!v.is_empty()).then_some(v)
}

/// How `%PROTOCOL%` prints a request's version.
pub fn protocol(req: &RequestHeader) -> &'static str {
    match req.version {
        http::Version::HTTP_10 => "HTTP/1.0",
        http::Version::HTTP_2 => "HTTP/2",
        http::Version::HTTP_3 => "HTTP/3",
        _ => "HTTP/1.1",
    }
}

fn push_addr(out: &mut String, a: Option<SocketAddr>, with_port: bool) {
    use std::fmt::Write as _;
    if let Some(a) = a {
        let _ = if with_port {
            write!(out, "{a}")
        } else {
            write!(out, "{}", a.ip())
        };
    }
}

/// Renders a value; a missing value renders as nothing (Envoy's header formatters omit empty
/// values rather than printing `-`).
pub fn render(parts: &[Part], req: Option<&RequestHeader>, ctx: &FormatCtx, out: &mut String) {
    use std::fmt::Write as _;
    for p in parts {
        match p {
            Part::Literal(s) => out.push_str(s),
            Part::Command(c) => match c {
                Command::RemoteAddress => push_addr(out, ctx.remote, true),
                Command::RemoteAddressWithoutPort => push_addr(out, ctx.remote, false),
                Command::RemotePort => {
                    if let Some(a) = ctx.remote {
                        let _ = write!(out, "{}", a.port());
                    }
                }
                Command::DirectRemoteAddress => push_addr(out, ctx.direct_remote, true),
                Command::DirectRemoteAddressWithoutPort => push_addr(out, ctx.direct_remote, false),
                Command::DirectRemotePort => {
                    if let Some(a) = ctx.direct_remote {
                        let _ = write!(out, "{}", a.port());
                    }
                }
                Command::LocalAddress => push_addr(out, ctx.local, true),
                Command::LocalAddressWithoutPort => push_addr(out, ctx.local, false),
                Command::LocalPort => {
                    if let Some(a) = ctx.local {
                        let _ = write!(out, "{}", a.port());
                    }
                }
                Command::Protocol => {
                    if let Some(r) = req {
                        out.push_str(protocol(r));
                    }
                }
                Command::Req { main, alt, max_len } => {
                    let Some(req) = req else { continue };
                    let v = req_value(main, req)
                        .or_else(|| alt.as_ref().and_then(|a| req_value(a, req)));
                    if let Some(v) = v {
                        let v = match max_len {
                            // Truncate on a char boundary at or below the limit.
                            Some(m) if v.len() > *m => {
                                let mut end = *m;
                                while !v.is_char_boundary(end) {
                                    end -= 1;
                                }
                                &v[..end]
                            }
                            _ => v,
                        };
                        out.push_str(v);
                    }
                }
            },
        }
    }
}

#[cfg(test)]
#[path = "headers_tests.rs"]
mod headers_tests;
