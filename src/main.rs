//! `portico`: Envoy-compatible command line.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};

// glibc malloc was an eighth of the CPU of a proxied request (its free-list upkeep and
// consolidation); mimalloc's thread-local free lists make the request path's short-lived
// header maps and buffers cheap. Measured in benches/vs-envoy (case 4). See `alloc` for
// why not the `mimalloc` crate's own allocator.
#[global_allocator]
static GLOBAL: portico::alloc::MiAlloc = portico::alloc::MiAlloc;

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
    /// Per-logger levels over -l, Envoy's logger names: `upstream:debug,config:trace`.
    /// Loggers with no Portico counterpart (e.g. misc) are accepted and govern nothing.
    #[arg(long, value_name = "LOGGER:LEVEL,...")]
    component_log_level: Option<String>,
    /// Worker threads (default: number of cores).
    #[arg(long, global = true)]
    concurrency: Option<usize>,
    /// Accepted for Envoy compatibility: Portico has no hot restart.
    #[arg(long)]
    disable_hot_restart: bool,
    /// Unknown bootstrap fields (in -c and --config-yaml) are dropped with a warning naming
    /// each instead of refusing the file, as Envoy does (pilot-agent always passes it).
    #[arg(long)]
    allow_unknown_static_fields: bool,
    /// Accepted for Envoy compatibility: Portico emits no deprecation logs.
    #[arg(long)]
    skip_deprecated_logs: bool,
    /// Envoy flags Portico accepts and ignores (reported as a warning).
    #[arg(long, hide = true)]
    base_id: Option<String>,
    /// How long connections of a changed or removed filter chain or listener drain before
    /// they are closed (Envoy's default: 600).
    #[arg(long, value_name = "SECONDS")]
    drain_time_s: Option<u64>,
    /// `gradual` (Envoy's default: each response closes its connection with growing odds over
    /// the drain time) or `immediate` (all are told at once, as istio-agent asks).
    #[arg(long, value_name = "STRATEGY")]
    drain_strategy: Option<String>,
    /// Accepted for Envoy compatibility: the hot-restart parent's lifetime; Portico has no
    /// hot restart.
    #[arg(long, value_name = "SECONDS")]
    parent_shutdown_time_s: Option<u64>,
    /// v4 or v6, checked and accepted: Portico takes local addresses from its sockets.
    #[arg(long, value_name = "VERSION", value_parser = ["v4", "v6"])]
    local_address_ip_version: Option<String>,
    /// How often buffered access log lines are written out (Envoy's default: 10000).
    #[arg(long, value_name = "MSEC")]
    file_flush_interval_msec: Option<u64>,
    /// Buffered access log bytes that trigger a write before the interval (Envoy's
    /// default: 64).
    #[arg(long, value_name = "KB")]
    file_flush_min_size_kb: Option<u64>,
    /// Accepted for Envoy compatibility: Portico keeps its own log line format.
    #[arg(long, value_name = "FORMAT")]
    log_format: Option<String>,
    /// The node's `cluster`, over the bootstrap's (as Envoy).
    #[arg(long, value_name = "NAME")]
    service_cluster: Option<String>,
    /// The node's `id`, over the bootstrap's (as Envoy).
    #[arg(long, value_name = "NAME")]
    service_node: Option<String>,
    /// A bootstrap (YAML or JSON) merged over -c's with protobuf's merge, as Envoy does.
    #[arg(long, value_name = "YAML")]
    config_yaml: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the bookinfo demo in one process: demo pods, the control plane serving
    /// gateway-examples/bookinfo/ over ADS, and a gateway configured by it. The gateway's
    /// listener port comes from the Gateway object (8080 in the example).
    Demo {
        /// The Istio config to serve (default: gateway-examples/bookinfo).
        #[arg(long, value_name = "DIR")]
        config_dir: Option<PathBuf>,
        /// Loopback port of the control plane's ADS server.
        #[arg(long, default_value_t = 15010)]
        xds_port: u16,
    },
    /// Serve the Istio config (Gateway, VirtualService, DestinationRule, Service,
    /// EndpointSlice YAML) in a directory over ADS, as istiod serves an ingress gateway.
    /// Files are watched: an edit is pushed to connected gateways.
    ControlPlane {
        /// Directory of *.yaml, *.yml and *.json files (not recursive).
        #[arg(long, value_name = "DIR")]
        config_dir: PathBuf,
        /// Address of the ADS gRPC server (istiod's plaintext xDS port is 15010).
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:15010")]
        listen: SocketAddr,
        /// Address the gateway listeners bind.
        #[arg(long, value_name = "IP", default_value = "0.0.0.0")]
        bind_address: IpAddr,
        /// Translate once and report instead of serving: every invalid object, the resources
        /// per type, a summary; exits 1 if any object is invalid.
        #[arg(long)]
        check: bool,
        /// A label of the gateway --check translates for (repeatable).
        #[arg(long = "gateway-label", value_name = "KEY=VALUE", value_parser = parse_label,
              default_value = "istio=ingressgateway")]
        gateway_labels: Vec<(String, String)>,
    },
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("'{s}' is not KEY=VALUE")),
    }
}

/// `portico control-plane`.
fn control_plane(
    dir: PathBuf,
    listen: SocketAddr,
    bind_address: IpAddr,
    check: bool,
    labels: Vec<(String, String)>,
) -> anyhow::Result<()> {
    std::fs::read_dir(&dir)
        .with_context(|| format!("--config-dir {}: cannot read the directory", dir.display()))?;
    let options = portico::istio::Options {
        bind_address: bind_address.to_string(),
        ..Default::default()
    };
    if check {
        return check_config(&dir, &options, labels);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    // The signal handlers need the runtime: installed inside it.
    rt.block_on(async {
        let stop = portico::server::shutdown_signal();
        portico::istio::server::serve(&dir, listen, options, stop).await
    })
    .map_err(|e| match e {
        e @ portico::istio::server::ServeError::Bind { .. } => {
            anyhow::Error::new(e).context("--listen")
        }
        e @ portico::istio::server::ServeError::ConfigDir { .. } => {
            anyhow::Error::new(e).context("--config-dir")
        }
        e => anyhow::Error::new(e),
    })
}

/// `portico control-plane --check`: what a gateway with `labels` would get, and every object
/// left out (on stderr, one per line: file, kind, name, reason).
fn check_config(
    dir: &Path,
    options: &portico::istio::Options,
    labels: Vec<(String, String)>,
) -> anyhow::Result<()> {
    let (config, mut invalid) =
        portico::istio::load_dir(dir).with_context(|| format!("--config-dir {}", dir.display()))?;
    let node = portico::istio::NodeInfo {
        id: "portico-check".into(),
        labels: labels.into_iter().collect(),
        namespace: Some("istio-system".into()),
    };
    let (xds, bad) = portico::istio::translate(&config, &node, options);
    invalid.extend(bad);
    for i in &invalid {
        eprintln!("invalid: {i}");
    }
    for (kind, resources) in [
        ("listeners", &xds.listeners),
        ("routes", &xds.routes),
        ("clusters", &xds.clusters),
        ("endpoints", &xds.endpoints),
        // Names only: a secret's content is never printed.
        ("secrets", &xds.secrets),
    ] {
        println!("{kind} ({}):", resources.len());
        for name in resources.keys() {
            println!("  {name}");
        }
    }
    let gateway = portico::istio::server::labels_text(&node.labels);
    println!(
        "{}: {} objects, {} invalid; gateway {gateway}: {} listeners, {} routes, {} clusters, {} endpoints, {} secrets",
        dir.display(),
        config.objects.len(),
        invalid.len(),
        xds.listeners.len(),
        xds.routes.len(),
        xds.clusters.len(),
        xds.endpoints.len(),
        xds.secrets.len()
    );
    if !invalid.is_empty() {
        anyhow::bail!("{} invalid object(s) in {}", invalid.len(), dir.display());
    }
    Ok(())
}

/// The subscriber, with a reload handle `/logging` changes levels through. `PORTICO_LOG`, when
/// set, replaces the start-up directives (a later `/logging` change replaces it in turn).
fn init_logging(levels: portico::admin::logging::Levels) {
    use tracing_subscriber::prelude::*;
    use tracing_subscriber::{reload, EnvFilter};
    let filter = EnvFilter::try_from_env("PORTICO_LOG")
        .unwrap_or_else(|_| EnvFilter::new(levels.directives()));
    let (filter, handle) = reload::Layer::new(filter);
    tracing_subscriber::registry()
        .with(filter)
        .with(portico::proxy::log_limit::PingoraLogs)
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .init();
    portico::admin::logging::install(
        levels,
        Box::new(move |directives| {
            let f = EnvFilter::try_new(directives).map_err(|e| e.to_string())?;
            handle.reload(f).map_err(|e| e.to_string())
        }),
    );
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
    let level = portico::admin::logging::level(&cli.log_level).with_context(|| {
        format!(
            "--log-level: invalid value '{}' (expected trace, debug, info, warning, error, critical or off)",
            cli.log_level
        )
    })?;
    let mut levels = portico::admin::logging::Levels::new(level);
    if let Some(list) = &cli.component_log_level {
        levels
            .set_list(list)
            .map_err(|e| anyhow::anyhow!("--component-log-level: {e}"))?;
    }
    init_logging(levels);
    let concurrency = match cli.concurrency {
        Some(0) => anyhow::bail!("--concurrency must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
    };
    match cli.command {
        Some(Command::Demo {
            config_dir,
            xds_port,
        }) => return portico::demo::run(config_dir, xds_port, concurrency).context("demo failed"),
        Some(Command::ControlPlane {
            config_dir,
            listen,
            bind_address,
            check,
            gateway_labels,
        }) => return control_plane(config_dir, listen, bind_address, check, gateway_labels),
        None => {}
    }
    if cli.base_id.is_some() {
        tracing::warn!("--base-id is accepted for Envoy compatibility and ignored");
    }
    portico::telemetry::access_log::sink::configure(
        cli.file_flush_interval_msec,
        cli.file_flush_min_size_kb,
    );
    let mut drain = portico::proxy::Drain::default();
    if let Some(t) = cli.drain_time_s {
        drain.time = std::time::Duration::from_secs(t);
    }
    match cli.drain_strategy.as_deref() {
        None | Some("gradual") => {}
        Some("immediate") => drain.immediate = true,
        Some(other) => {
            anyhow::bail!("--drain-strategy must be gradual or immediate, not '{other}'")
        }
    }
    let path = cli
        .config_path
        .context("no bootstrap given: pass -c/--config-path FILE (or run `portico demo`)")?;
    let mut bootstrap = portico::bootstrap::load_with(
        &path,
        cli.config_yaml.as_deref(),
        cli.allow_unknown_static_fields,
    )
    .map_err(|e| match &cli.config_yaml {
        Some(_) => anyhow::anyhow!("{e} (with --config-yaml)"),
        None => anyhow::anyhow!("{e}"),
    })?;
    // As Envoy: the flags win over the bootstrap's node.
    if cli.service_cluster.is_some() || cli.service_node.is_some() {
        let node = bootstrap.proto.node.get_or_insert_with(Default::default);
        if let Some(c) = cli.service_cluster {
            node.cluster = c.clone();
            bootstrap.node.cluster = c;
        }
        if let Some(n) = cli.service_node {
            node.id = n.clone();
            bootstrap.node.id = n;
        }
    }
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
        Mode::Serve => Ok(portico::server::run_drained(bootstrap, concurrency, drain)?),
    }
}
