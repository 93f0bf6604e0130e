//! `portico`: Envoy-compatible command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

// glibc malloc was an eighth of the CPU of a proxied request (its free-list upkeep and
// consolidation); mimalloc's thread-local free lists make the request path's short-lived
// header maps and buffers cheap. Measured in benches/vs-envoy (case 4).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Serve,
    Validate,
}

/// An ingress gateway that speaks Envoy's xDS contract. Takes Envoy's bootstrap and flags.
#[derive(Debug, Parser)]
#[command(name = "portico", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Envoy v3 bootstrap file (YAML or JSON).
    #[arg(short = 'c', long = "config-path", value_name = "FILE")]
    config_path: Option<PathBuf>,
    /// serve (default) or validate: check the bootstrap and exit.
    #[arg(long, value_enum, default_value = "serve")]
    mode: Mode,
    /// trace, debug, info, warning/warn, error, critical, off.
    #[arg(short = 'l', long = "log-level", default_value = "info", global = true)]
    log_level: String,
    /// Worker threads (default: number of cores).
    #[arg(long, global = true)]
    concurrency: Option<usize>,
    /// Accepted for Envoy compatibility; Portico has no hot restart.
    #[arg(long, hide = true)]
    disable_hot_restart: bool,
    /// Accepted for Envoy compatibility; unknown fields are always reported.
    #[arg(long, hide = true)]
    allow_unknown_static_fields: bool,
    /// Envoy flags Portico accepts and ignores (reported as a warning).
    #[arg(long, hide = true)]
    base_id: Option<String>,
    #[arg(long, hide = true)]
    drain_time_s: Option<String>,
    #[arg(long, hide = true)]
    drain_strategy: Option<String>,
    #[arg(long, hide = true)]
    parent_shutdown_time_s: Option<String>,
    #[arg(long, hide = true)]
    local_address_ip_version: Option<String>,
    #[arg(long, hide = true)]
    file_flush_interval_msec: Option<String>,
    #[arg(long, hide = true)]
    log_format: Option<String>,
    #[arg(long, hide = true)]
    component_log_level: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the built-in bookinfo demo: demo backends plus a gateway routing to them.
    Demo {
        /// Port of the demo gateway listener.
        #[arg(long, default_value_t = 8080)]
        port: u16,
    },
}

fn log_filter(level: &str) -> anyhow::Result<&'static str> {
    Ok(match level.to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warning" | "warn" => "warn",
        "error" | "critical" => "error",
        "off" => "off",
        other => anyhow::bail!("--log-level: invalid value '{other}' (expected trace, debug, info, warning, error, critical or off)"),
    })
}

fn main() -> ExitCode {
    match real_main() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("portico: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn real_main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = log_filter(&cli.log_level)?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PORTICO_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(format!(
                    "portico={filter},{}",
                    if filter == "off" { "off" } else { "warn" }
                ))
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let concurrency = match cli.concurrency {
        Some(0) => anyhow::bail!("--concurrency must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    };
    if let Some(Command::Demo { port }) = cli.command {
        return portico::demo::run(port, concurrency).context("demo failed");
    }
    for (flag, set) in [
        ("--base-id", cli.base_id.is_some()),
        ("--drain-time-s", cli.drain_time_s.is_some()),
        ("--drain-strategy", cli.drain_strategy.is_some()),
        (
            "--parent-shutdown-time-s",
            cli.parent_shutdown_time_s.is_some(),
        ),
        (
            "--local-address-ip-version",
            cli.local_address_ip_version.is_some(),
        ),
        (
            "--file-flush-interval-msec",
            cli.file_flush_interval_msec.is_some(),
        ),
        ("--log-format", cli.log_format.is_some()),
        ("--component-log-level", cli.component_log_level.is_some()),
    ] {
        if set {
            tracing::warn!("{flag} is accepted for Envoy compatibility and ignored");
        }
    }
    let path = cli
        .config_path
        .context("no bootstrap given: pass -c/--config-path FILE (or run `portico demo`)")?;
    let bootstrap = portico::bootstrap::load(&path)?;
    for w in &bootstrap.warnings {
        tracing::warn!("{w}");
    }
    match cli.mode {
        Mode::Validate => {
            portico::server::validate(&bootstrap)
                .with_context(|| format!("configuration '{}' is invalid", path.display()))?;
            println!("configuration '{}' OK", path.display());
            Ok(())
        }
        Mode::Serve => Ok(portico::server::run(bootstrap, concurrency)?),
    }
}
