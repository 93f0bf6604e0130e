//! The command line: Envoy's flags, `--mode validate`, and errors that name the field.

use std::path::PathBuf;
use std::process::{Command, Output};

fn portico(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_portico"))
        .args(args)
        .output()
        .expect("the portico binary runs")
}

fn write(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("portico-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write bootstrap");
    p
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn validate_accepts_every_example() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/gateway-examples/bootstraps");
    for f in ["bookinfo-static.yaml", "bookinfo-ads.yaml"] {
        let path = format!("{dir}/{f}");
        let o = portico(&["--mode", "validate", "-c", &path]);
        assert!(o.status.success(), "{f}: {}", stderr(&o));
        assert!(String::from_utf8_lossy(&o.stdout).contains("OK"));
    }
}

#[test]
fn validate_names_the_bad_field() {
    let cases = [
        ("unknown.yaml", "admin:\n  adress: {}\n", "admin.adress"),
        (
            "duration.yaml",
            "static_resources:\n  clusters:\n  - name: a\n    connect_timeout: 5x\n",
            "static_resources.clusters[0].connect_timeout",
        ),
        (
            "filter.yaml",
            "static_resources:\n  listeners:\n  - name: l\n    address: {socket_address: {address: 127.0.0.1, port_value: 1}}\n    filter_chains: [{filters: [{name: x, typed_config: {\"@type\": type.googleapis.com/envoy.extensions.filters.network.direct_response.v3.Config}}]}]\n",
            "listener 'l': network filter 'x'",
        ),
        (
            "regex.yaml",
            "static_resources:\n  listeners:\n  - name: l\n    address: {socket_address: {address: 127.0.0.1, port_value: 1}}\n    filter_chains: [{filters: [{name: hcm, typed_config: {\"@type\": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager, stat_prefix: s, http_filters: [{name: envoy.filters.http.router, typed_config: {\"@type\": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}], route_config: {name: rc, virtual_hosts: [{name: vh, domains: ['*'], routes: [{match: {safe_regex: {regex: '('}}, route: {cluster: c}}]}]}}}]}]\n",
            "route 'rc': vhost 'vh' route 0: invalid regex '('",
        ),
    ];
    for (name, text, want) in cases {
        let p = write(name, text);
        let o = portico(&["--mode", "validate", "-c", p.to_str().expect("utf-8 path")]);
        assert!(!o.status.success(), "{name} must fail");
        assert!(stderr(&o).contains(want), "{name}: {}", stderr(&o));
    }
}

#[test]
fn bad_flags_exit_non_zero_with_a_message() {
    let o = portico(&["--bogus-flag"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--bogus-flag"));
    let o = portico(&["--concurrency", "0", "-c", "x.yaml"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--concurrency"));
    let o = portico(&["--log-level", "loud", "-c", "x.yaml"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--log-level"));
    let o = portico(&["-c", "/nonexistent/bootstrap.yaml"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/nonexistent/bootstrap.yaml"));
    let o = portico(&[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--config-path"));
}

#[test]
fn envoy_flags_istio_agent_passes_are_accepted() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/gateway-examples/bootstraps/bookinfo-static.yaml"
    );
    let o = portico(&[
        "--mode",
        "validate",
        "-c",
        path,
        "--drain-time-s",
        "45",
        "--drain-strategy",
        "immediate",
        "--local-address-ip-version",
        "v4",
        "--file-flush-interval-msec",
        "1000",
        "--disable-hot-restart",
        "--allow-unknown-static-fields",
        "-l",
        "warning",
        "--component-log-level",
        "misc:error",
        "--concurrency",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn help_lists_the_envoy_style_options() {
    let o = portico(&["--help"]);
    assert!(o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    for flag in ["--config-path", "--mode", "--log-level", "--concurrency"] {
        assert!(out.contains(flag), "--help lacks {flag}");
    }
}

#[test]
fn sigterm_stops_the_gateway_cleanly() {
    // Ports below the ephemeral range, unique to this process.
    let base = 20_000 + (std::process::id() % 10_000) as u16;
    let (listener, admin) = (base, base + 1);
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/gateway-examples/bootstraps/bookinfo-static.yaml"
    ))
    .expect("example bootstrap")
    .replace("port_value: 8080", &format!("port_value: {listener}"))
    .replace("port_value: 15000", &format!("port_value: {admin}"));
    let path = write("sigterm.yaml", &text);
    let mut child = Command::new(env!("CARGO_BIN_EXE_portico"))
        .args([
            "-c",
            path.to_str().expect("utf-8 path"),
            "--concurrency",
            "1",
            "-l",
            "error",
        ])
        .spawn()
        .expect("portico starts");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while std::net::TcpStream::connect(("127.0.0.1", admin)).is_err() {
        assert!(std::time::Instant::now() < deadline, "admin never listened");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let status = child.wait().expect("portico exits");
    assert!(status.success(), "exit status after SIGTERM: {status}");
}
