//! Envoy's access logs (`envoy.config.accesslog.v3.AccessLog`), on the HTTP connection
//! manager, on tcp_proxy and on listeners.
//!
//! Translation (pure) turns each entry into an [`AccessLog`]: its filter, its format parsed
//! into pieces, and where it writes. At the end of a request (or TCP connection) the proxy
//! hands the record ([`LogContext`]) to [`AccessLogs::log`]: each logger whose filter passes
//! formats its line on the spot and hands it to the process-wide writer of its path
//! ([`sink`]), which buffers and writes off the request path.
//!
//! Loggers: `envoy.access_loggers.file` (`FileAccessLog`: a path, `/dev/stdout` and
//! `/dev/stderr` included; legacy `format`/`json_format`/`typed_json_format` or `log_format`)
//! and `envoy.access_loggers.stdout`/`stderr`. Envoy's other loggers (gRPC ALS,
//! OpenTelemetry, fluentd, Wasm, dynamic modules, stats) ship logs to collectors Portico does
//! not talk to: accepted without effect, a telemetry-only choice that keeps the listener
//! serving. A type Envoy does not know is refused, naming the field, as Envoy refuses it.

pub mod filter;
pub mod format;
pub mod sink;

use std::sync::{Arc, OnceLock};

use envoy_types::pb::envoy::config::accesslog::v3 as apb;
use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::extensions::access_loggers::file::v3 as filepb;
use envoy_types::pb::envoy::extensions::access_loggers::stream::v3 as streampb;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;

use crate::matcher::RequestView;
use crate::telemetry::StreamInfo;
use filter::Filter;
use format::{Extensions, JsonNode, Piece};

pub const FILE_TYPE: &str =
    "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog";
pub const STDOUT_TYPE: &str =
    "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog";
pub const STDERR_TYPE: &str =
    "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StderrAccessLog";
const REQ_WITHOUT_QUERY_TYPE: &str =
    "type.googleapis.com/envoy.extensions.formatter.req_without_query.v3.ReqWithoutQuery";

/// Envoy loggers Portico accepts without effect (see the module doc).
const INERT_TYPES: [&str; 9] = [
    "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
    "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.TcpGrpcAccessLogConfig",
    "type.googleapis.com/envoy.extensions.access_loggers.open_telemetry.v3.OpenTelemetryAccessLogConfig",
    "type.googleapis.com/envoy.extensions.access_loggers.fluentd.v3.FluentdAccessLogConfig",
    "type.googleapis.com/envoy.extensions.access_loggers.wasm.v3.WasmAccessLog",
    "type.googleapis.com/envoy.extensions.access_loggers.dynamic_modules.v3.DynamicModuleAccessLog",
    "type.googleapis.com/envoy.extensions.access_loggers.stats.v3.Config",
    "type.googleapis.com/envoy.extensions.access_loggers.open_telemetry.v3.OpenTelemetryAccessLogConfig.Legacy",
    "type.googleapis.com/envoy.extensions.access_loggers.filters.process_ratelimit.v3.ProcessRateLimitFilter",
];

/// Envoy's `AccessLogType` (what `log_type_filter` selects on).
pub mod log_type {
    pub const TCP_CONNECTION_END: i32 = 3;
    pub const DOWNSTREAM_END: i32 = 6;
}

/// What a logger sees of one request or connection. `request`: the request head as the
/// connection manager left it (None for TCP); `response`/`trailers`: what went downstream.
pub struct LogContext<'a> {
    pub info: &'a StreamInfo,
    pub request: Option<RequestView<'a>>,
    pub response: Option<&'a http::HeaderMap>,
    pub trailers: Option<&'a http::HeaderMap>,
    /// Envoy's `AccessLogType` ([`log_type`]).
    pub log_type: i32,
}

/// A logger's format.
#[derive(Debug)]
pub enum Format {
    Text(Vec<Piece>),
    Json(JsonNode),
}

/// Where a logger writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A file path (`/dev/stdout` and `/dev/stderr` are the process's streams).
    Path(Arc<str>),
    /// A logger accepted without effect.
    Inert,
}

/// One translated `AccessLog`.
#[derive(Debug)]
pub struct AccessLog {
    pub name: String,
    pub filter: Option<Filter>,
    pub format: Format,
    /// `omit_empty_values`.
    pub omit_empty: bool,
    pub target: Target,
    /// The writer of `target`, looked up once on first use (translation opens nothing).
    writer: OnceLock<Option<Arc<sink::Writer>>>,
}

impl AccessLog {
    /// Translates `access_log[i]` (`at` names it in errors).
    pub fn translate(a: &apb::AccessLog, at: &str) -> Result<AccessLog, String> {
        let filter = a
            .filter
            .as_ref()
            .map(|f| Filter::translate(f, &format!("{at}.filter")))
            .transpose()?;
        let Some(apb::access_log::ConfigType::TypedConfig(any)) = &a.config_type else {
            return Err(format!("{at}: access log '{}' has no typed_config", a.name));
        };
        let (format, omit_empty, target) = logger(any, at)?;
        Ok(AccessLog {
            name: a.name.clone(),
            filter,
            format,
            omit_empty,
            target,
            writer: OnceLock::new(),
        })
    }

    /// The line this logger writes for `ctx`, if its filter passes.
    pub fn line(&self, ctx: &LogContext<'_>) -> Option<String> {
        if self.target == Target::Inert {
            return None;
        }
        if let Some(f) = &self.filter {
            if !f.evaluate(ctx) {
                return None;
            }
        }
        let mut out = String::with_capacity(256);
        match &self.format {
            Format::Text(pieces) => format::write_text(
                &mut out,
                pieces,
                ctx,
                if self.omit_empty { "" } else { "-" },
            ),
            Format::Json(node) => {
                if !node.write(&mut out, ctx, self.omit_empty) {
                    out.push_str("{}");
                }
                out.push('\n');
            }
        }
        Some(out)
    }

    /// Formats and hands the line to the writer (never blocks).
    pub fn log(&self, ctx: &LogContext<'_>) {
        let Some(line) = self.line(ctx) else {
            return;
        };
        let writer = self.writer.get_or_init(|| match &self.target {
            Target::Path(p) => Some(sink::writer(p)),
            Target::Inert => None,
        });
        if let Some(w) = writer {
            w.write(line.as_bytes());
        }
    }
}

/// The access logs of a connection manager, tcp_proxy or listener, in config order.
#[derive(Debug, Default, Clone)]
pub struct AccessLogs(pub Arc<[AccessLog]>);

impl PartialEq for AccessLogs {
    /// Two lists are the same when they are the same translation (or both empty): loggers are
    /// compared by identity, as their writers are.
    fn eq(&self, other: &AccessLogs) -> bool {
        (self.0.is_empty() && other.0.is_empty()) || Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for AccessLogs {}

impl AccessLogs {
    pub fn translate(list: &[apb::AccessLog], field: &str) -> Result<AccessLogs, String> {
        let logs = list
            .iter()
            .enumerate()
            .map(|(i, a)| AccessLog::translate(a, &format!("{field}[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(AccessLogs(logs.into()))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn log(&self, ctx: &LogContext<'_>) {
        for l in self.0.iter() {
            l.log(ctx);
        }
    }
}

/// The listener's access logs for a connection no filter chain took: Envoy's line for it has
/// the `NR` flag and no request (istiod's listener log is filtered on exactly this flag).
/// Envoy also writes the listener's logs for every other connection when it closes; Portico
/// does not (see the README).
pub fn log_unmatched(
    logs: &AccessLogs,
    peer: std::net::SocketAddr,
    local: Option<std::net::SocketAddr>,
    server_name: &str,
) {
    if logs.is_empty() {
        return;
    }
    let mut info = StreamInfo::new(crate::telemetry::Protocol::Tcp);
    info.downstream_remote = Some(peer);
    info.downstream_direct_remote = Some(peer);
    info.downstream_local = local;
    if !server_name.is_empty() {
        info.requested_server_name = Some(server_name.into());
    }
    info.flags.set(crate::telemetry::ResponseFlag::NoRouteFound);
    info.last_downstream_tx = Some(info.elapsed());
    logs.log(&LogContext {
        info: &info,
        request: None,
        response: None,
        trailers: None,
        log_type: log_type::TCP_CONNECTION_END,
    });
}

fn logger(any: &Any, at: &str) -> Result<(Format, bool, Target), String> {
    let t = any.type_url.as_str();
    let decode_err = |e: prost::DecodeError| format!("{at}.typed_config: cannot decode {t}: {e}");
    match t {
        FILE_TYPE => {
            let f = filepb::FileAccessLog::decode(any.value.as_slice()).map_err(decode_err)?;
            if f.path.is_empty() {
                return Err(format!("{at}: FileAccessLog.path must not be empty"));
            }
            use filepb::file_access_log::AccessLogFormat as F;
            let target = Target::Path(f.path.as_str().into());
            #[allow(deprecated)]
            let (format, omit) = match &f.access_log_format {
                None => (default_format(), false),
                Some(F::Format(s)) if s.is_empty() => (default_format(), false),
                Some(F::Format(s)) => (
                    Format::Text(
                        format::parse(s, Extensions::default())
                            .map_err(|e| format!("{at}.format: {e}"))?,
                    ),
                    false,
                ),
                Some(F::JsonFormat(s)) | Some(F::TypedJsonFormat(s)) => (
                    Format::Json(
                        JsonNode::from_struct(s, Extensions::default())
                            .map_err(|e| format!("{at}.json_format: {e}"))?,
                    ),
                    false,
                ),
                Some(F::LogFormat(sfs)) => substitution_format(sfs, &format!("{at}.log_format"))?,
            };
            Ok((format, omit, target))
        }
        STDOUT_TYPE | STDERR_TYPE => {
            let (sfs, path) = if t == STDOUT_TYPE {
                let s =
                    streampb::StdoutAccessLog::decode(any.value.as_slice()).map_err(decode_err)?;
                (
                    s.access_log_format
                        .map(|streampb::stdout_access_log::AccessLogFormat::LogFormat(f)| f),
                    "/dev/stdout",
                )
            } else {
                let s =
                    streampb::StderrAccessLog::decode(any.value.as_slice()).map_err(decode_err)?;
                (
                    s.access_log_format
                        .map(|streampb::stderr_access_log::AccessLogFormat::LogFormat(f)| f),
                    "/dev/stderr",
                )
            };
            let (format, omit) = match &sfs {
                Some(f) => substitution_format(f, &format!("{at}.log_format"))?,
                None => (default_format(), false),
            };
            Ok((format, omit, Target::Path(path.into())))
        }
        t if INERT_TYPES.contains(&t) => Ok((Format::Text(Vec::new()), false, Target::Inert)),
        t => Err(format!(
            "{at}.typed_config: Didn't find a registered implementation for type: '{}'",
            t.strip_prefix("type.googleapis.com/").unwrap_or(t)
        )),
    }
}

fn default_format() -> Format {
    Format::Text(format::parse(format::DEFAULT_FORMAT, Extensions::default()).unwrap_or_default())
}

/// `envoy.config.core.v3.SubstitutionFormatString`.
pub fn substitution_format(
    f: &corepb::SubstitutionFormatString,
    at: &str,
) -> Result<(Format, bool), String> {
    use corepb::substitution_format_string::Format as F;
    let mut ext = Extensions::default();
    for (i, x) in f.formatters.iter().enumerate() {
        let t = x.typed_config.as_ref().map_or("", |a| a.type_url.as_str());
        if t == REQ_WITHOUT_QUERY_TYPE {
            ext.req_without_query = true;
        } else {
            return Err(format!(
                "{at}.formatters[{i}] '{}': formatter extension {t} is not supported",
                x.name
            ));
        }
    }
    #[allow(deprecated)]
    let format = match &f.format {
        None => return Err(format!("{at}: no format set")),
        Some(F::TextFormat(s)) => {
            Format::Text(format::parse(s, ext).map_err(|e| format!("{at}.text_format: {e}"))?)
        }
        Some(F::TextFormatSource(ds)) => {
            use corepb::data_source::Specifier as S;
            let text = match &ds.specifier {
                Some(S::InlineString(s)) => s.clone(),
                Some(S::InlineBytes(b)) => String::from_utf8_lossy(b).into_owned(),
                Some(S::Filename(_)) | Some(S::EnvironmentVariable(_)) => {
                    return Err(format!(
                        "{at}.text_format_source: only inline_string and inline_bytes are supported"
                    ))
                }
                None => return Err(format!("{at}.text_format_source: no data set")),
            };
            Format::Text(
                format::parse(&text, ext).map_err(|e| format!("{at}.text_format_source: {e}"))?,
            )
        }
        Some(F::JsonFormat(s)) => Format::Json(
            JsonNode::from_struct(s, ext).map_err(|e| format!("{at}.json_format: {e}"))?,
        ),
    };
    Ok((format, f.omit_empty_values))
}

#[cfg(test)]
mod tests;
