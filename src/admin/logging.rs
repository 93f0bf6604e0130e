//! Envoy's loggers and `/logging`: a level per named logger, changed at run time.
//!
//! Envoy names its loggers by component (`admin`, `config`, `upstream`, ...); Portico logs by
//! module. Every Envoy logger name is accepted (pilot-agent passes `--component-log-level
//! misc:error`, istioctl sets any of them) and listed; the loggers with a Portico counterpart
//! set the level of those modules, the others govern nothing Portico has. `level` (Envoy's
//! `-l`) sets every logger and the rest of Portico's modules.

use std::sync::{Mutex, OnceLock};

/// Envoy 1.40's loggers, in the order its `/logging` lists them.
pub const LOGGERS: &[&str] = &[
    "a2a",
    "admin",
    "ai_protocol_manager",
    "alternate_protocols_cache",
    "aws",
    "assert",
    "backtrace",
    "basic_auth",
    "cache_filter",
    "client",
    "config",
    "connection",
    "conn_handler",
    "compression",
    "credential_injector",
    "decompression",
    "dns",
    "dubbo",
    "envoy_bug",
    "ext_authz",
    "ext_proc",
    "rocketmq",
    "file",
    "filter",
    "forward_proxy",
    "geolocation",
    "grpc",
    "happy_eyeballs",
    "hc",
    "health_checker",
    "http",
    "http2",
    "hystrix",
    "init",
    "io",
    "jwt",
    "json_rpc",
    "kafka",
    "key_value_store",
    "lua",
    "local_rate_limit",
    "main",
    "matcher",
    "mcp",
    "misc",
    "mongo",
    "multi_connection",
    "notification",
    "oauth2",
    "quic",
    "quic_stream",
    "pool",
    "rate_limit_quota",
    "rbac",
    "rds",
    "redis",
    "router",
    "runtime",
    "stats",
    "secret",
    "sse",
    "tap",
    "testing",
    "thrift",
    "tracing",
    "upstream",
    "udp",
    "wasm",
    "websocket",
    "golang",
    "stats_sinks",
    "dynamic_modules",
    "ip_tagging",
];

/// The Portico modules an Envoy logger stands for.
fn targets(logger: &str) -> &'static [&'static str] {
    match logger {
        "admin" => &["portico::admin"],
        "config" => &["portico::xds", "portico::bootstrap", "portico::snapshot"],
        "upstream" => &["portico::lb", "portico::live"],
        "hc" | "health_checker" => &["portico::health"],
        "router" => &["portico::router"],
        "http" => &["portico::proxy"],
        "filter" => &["portico::filters"],
        "main" => &["portico::server"],
        "secret" => &["portico::xds::sds"],
        _ => &[],
    }
}

/// Envoy's levels, as `/logging` prints them.
pub const LEVELS: &[&str] = &[
    "trace", "debug", "info", "warning", "error", "critical", "off",
];

/// An Envoy level name (also `warn`, as `-l` takes it) to its canonical name.
pub fn level(name: &str) -> Option<&'static str> {
    match name.to_ascii_lowercase().as_str() {
        "warn" => Some("warning"),
        l => LEVELS.iter().find(|x| **x == l).copied(),
    }
}

fn tracing_level(level: &str) -> &'static str {
    match level {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warning" => "warn",
        "off" => "off",
        // tracing has no critical: its errors are the nearest.
        _ => "error",
    }
}

/// The level of every logger, and the default for modules no logger names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Levels {
    pub default: &'static str,
    pub loggers: Vec<(&'static str, &'static str)>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum LevelError {
    UnknownLevel(String),
    UnknownLogger(String),
    Malformed(String),
}

impl std::fmt::Display for LevelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LevelError::UnknownLevel(l) => write!(f, "unknown logger level '{l}'"),
            LevelError::UnknownLogger(l) => write!(f, "unknown logger name '{l}'"),
            LevelError::Malformed(s) => write!(f, "'{s}' is not <logger>:<level>"),
        }
    }
}

impl Levels {
    pub fn new(default: &'static str) -> Levels {
        Levels {
            default,
            loggers: LOGGERS.iter().map(|l| (*l, default)).collect(),
        }
    }

    /// Every logger (and the default) at `level`, as `-l` and `/logging?level=` do.
    pub fn set_all(&mut self, level: &'static str) {
        self.default = level;
        for l in &mut self.loggers {
            l.1 = level;
        }
    }

    pub fn set(&mut self, logger: &str, level: &str) -> Result<(), LevelError> {
        let lv = self::level(level).ok_or_else(|| LevelError::UnknownLevel(level.into()))?;
        let slot = self
            .loggers
            .iter_mut()
            .find(|(n, _)| *n == logger)
            .ok_or_else(|| LevelError::UnknownLogger(logger.into()))?;
        slot.1 = lv;
        Ok(())
    }

    /// `--component-log-level` and `/logging?paths=`: `name:level,name:level`. All or nothing.
    pub fn set_list(&mut self, list: &str) -> Result<(), LevelError> {
        let mut next = self.clone();
        for item in list.split(',').filter(|s| !s.is_empty()) {
            let (n, l) = item
                .split_once(':')
                .ok_or_else(|| LevelError::Malformed(item.into()))?;
            next.set(n.trim(), l.trim())?;
        }
        *self = next;
        Ok(())
    }

    /// The `tracing_subscriber::EnvFilter` directives: Portico at the default level, each
    /// mapped module at its logger's level; other crates at warn (or off).
    pub fn directives(&self) -> String {
        let d = tracing_level(self.default);
        let mut out = format!("{},portico={d}", if d == "off" { "off" } else { "warn" });
        for (logger, level) in &self.loggers {
            for t in targets(logger) {
                out.push_str(&format!(",{t}={}", tracing_level(level)));
            }
        }
        out
    }

    /// Envoy's listing: `active loggers:` then `  name: level` lines.
    pub fn listing(&self) -> String {
        let mut out = String::from("active loggers:\n");
        for (n, l) in &self.loggers {
            out.push_str(&format!("  {n}: {l}\n"));
        }
        out
    }
}

type Apply = Box<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The process's loggers: their levels and the function that applies new directives to the
/// installed subscriber (a reload handle the binary hands over).
pub struct Logging {
    levels: Mutex<Levels>,
    apply: Apply,
}

static LOGGING: OnceLock<Logging> = OnceLock::new();

/// Called once by the binary after it installed its subscriber. The subscriber is process
/// global, so its controls are too.
pub fn install(levels: Levels, apply: Apply) {
    let _ = LOGGING.set(Logging {
        levels: Mutex::new(levels),
        apply,
    });
}

/// The current levels (Envoy's defaults when no subscriber was installed, as in tests).
pub fn current() -> Levels {
    match LOGGING.get() {
        Some(l) => l.levels.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        None => Levels::new("info"),
    }
}

/// Changes the levels with `change` and applies them; on error nothing changes.
pub fn update(change: impl FnOnce(&mut Levels) -> Result<(), LevelError>) -> Result<(), String> {
    let Some(l) = LOGGING.get() else {
        return Err("no log subscriber to change".into());
    };
    let mut levels = l.levels.lock().unwrap_or_else(|p| p.into_inner());
    let mut next = levels.clone();
    change(&mut next).map_err(|e| e.to_string())?;
    (l.apply)(&next.directives())?;
    *levels = next;
    Ok(())
}

#[cfg(test)]
#[path = "logging_tests.rs"]
mod tests;
