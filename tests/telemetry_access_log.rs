//! Envoy access logs: Istio's default text and JSON formats written to files, one line per
//! request, checked field by field for a request served upstream (200), one without a route
//! (404 NR), one to a cluster without endpoints (503 UH) and one to an endpoint refusing
//! connections (503 UF); a status-code filter; a stdout logger; a tcp_proxy connection's line.
//! Runs against Envoy too (PORTICO_GATEWAY_BIN): the lines are Envoy's.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::config::accesslog::v3 as apb;
use envoy_types::pb::envoy::config::core::v3 as corepb;
use envoy_types::pb::envoy::config::listener::v3::{filter, Filter, FilterChain, Listener};
use envoy_types::pb::envoy::extensions::access_loggers::file::v3::{
    file_access_log::AccessLogFormat, FileAccessLog,
};
use envoy_types::pb::envoy::extensions::access_loggers::stream::v3::{
    stdout_access_log, StdoutAccessLog,
};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    tcp_proxy::ClusterSpecifier, TcpProxy,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HOST: &str = "alog.example.com";

/// Istio's `EnvoyTextLogFormat` (1.9 onwards; `%UPSTREAM_CLUSTER_RAW%` since 1.22).
const ISTIO_TEXT: &str = "[%START_TIME%] \"%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL%\" %RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %CONNECTION_TERMINATION_DETAILS% \"%UPSTREAM_TRANSPORT_FAILURE_REASON%\" %BYTES_RECEIVED% %BYTES_SENT% %DURATION% %RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)% \"%REQ(X-FORWARDED-FOR)%\" \"%REQ(USER-AGENT)%\" \"%REQ(X-REQUEST-ID)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\" %UPSTREAM_CLUSTER_RAW% %UPSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_LOCAL_ADDRESS% %DOWNSTREAM_REMOTE_ADDRESS% %REQUESTED_SERVER_NAME% %ROUTE_NAME%\n";

/// Istio's `EnvoyJSONLogFormatIstio`.
const ISTIO_JSON: [(&str, &str); 24] = [
    ("start_time", "%START_TIME%"),
    ("route_name", "%ROUTE_NAME%"),
    ("method", "%REQ(:METHOD)%"),
    ("path", "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%"),
    ("protocol", "%PROTOCOL%"),
    ("response_code", "%RESPONSE_CODE%"),
    ("response_flags", "%RESPONSE_FLAGS%"),
    ("response_code_details", "%RESPONSE_CODE_DETAILS%"),
    (
        "connection_termination_details",
        "%CONNECTION_TERMINATION_DETAILS%",
    ),
    ("bytes_received", "%BYTES_RECEIVED%"),
    ("bytes_sent", "%BYTES_SENT%"),
    ("duration", "%DURATION%"),
    (
        "upstream_service_time",
        "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%",
    ),
    ("x_forwarded_for", "%REQ(X-FORWARDED-FOR)%"),
    ("user_agent", "%REQ(USER-AGENT)%"),
    ("request_id", "%REQ(X-REQUEST-ID)%"),
    ("authority", "%REQ(:AUTHORITY)%"),
    ("upstream_host", "%UPSTREAM_HOST%"),
    ("upstream_cluster", "%UPSTREAM_CLUSTER_RAW%"),
    ("upstream_local_address", "%UPSTREAM_LOCAL_ADDRESS%"),
    ("downstream_local_address", "%DOWNSTREAM_LOCAL_ADDRESS%"),
    ("downstream_remote_address", "%DOWNSTREAM_REMOTE_ADDRESS%"),
    ("requested_server_name", "%REQUESTED_SERVER_NAME%"),
    (
        "upstream_transport_failure_reason",
        "%UPSTREAM_TRANSPORT_FAILURE_REASON%",
    ),
];

fn text_source(s: &str) -> corepb::SubstitutionFormatString {
    corepb::SubstitutionFormatString {
        format: Some(
            corepb::substitution_format_string::Format::TextFormatSource(corepb::DataSource {
                specifier: Some(corepb::data_source::Specifier::InlineString(s.into())),
                ..Default::default()
            }),
        ),
        ..Default::default()
    }
}

fn file_log(path: &str, format: corepb::SubstitutionFormatString) -> apb::AccessLog {
    apb::AccessLog {
        name: "envoy.access_loggers.file".into(),
        filter: None,
        config_type: Some(apb::access_log::ConfigType::TypedConfig(any(
            FileAccessLog {
                path: path.into(),
                access_log_format: Some(AccessLogFormat::LogFormat(format)),
            },
        ))),
    }
}

fn json_format() -> corepb::SubstitutionFormatString {
    corepb::SubstitutionFormatString {
        format: Some(corepb::substitution_format_string::Format::JsonFormat(
            Struct {
                fields: ISTIO_JSON
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            Value {
                                kind: Some(Kind::StringValue(v.to_string())),
                            },
                        )
                    })
                    .collect(),
            },
        )),
        ..Default::default()
    }
}

/// Logs only responses of 500 and up.
fn status_filtered(path: &str) -> apb::AccessLog {
    let mut l = file_log(
        path,
        text_source("%RESPONSE_CODE% %RESPONSE_FLAGS% %REQ(X-REQUEST-ID)%\n"),
    );
    l.filter = Some(apb::AccessLogFilter {
        filter_specifier: Some(apb::access_log_filter::FilterSpecifier::StatusCodeFilter(
            apb::StatusCodeFilter {
                comparison: Some(apb::ComparisonFilter {
                    op: apb::comparison_filter::Op::Ge as i32,
                    value: Some(corepb::RuntimeUInt32 {
                        default_value: 500,
                        runtime_key: "access_log.status_min".into(),
                    }),
                }),
            },
        )),
    });
    l
}

fn stdout_log() -> apb::AccessLog {
    apb::AccessLog {
        name: "envoy.access_loggers.stdout".into(),
        filter: None,
        config_type: Some(apb::access_log::ConfigType::TypedConfig(any(
            StdoutAccessLog {
                access_log_format: Some(stdout_access_log::AccessLogFormat::LogFormat(
                    text_source("ALOG-STDOUT %RESPONSE_CODE% %REQ(X-REQUEST-ID)%\n"),
                )),
            },
        ))),
    }
}

fn named(
    mut r: envoy_types::pb::envoy::config::route::v3::Route,
    name: &str,
) -> envoy_types::pb::envoy::config::route::v3::Route {
    r.name = name.into();
    r
}

/// Waits until `path` has a line containing `needle`; returns that line.
async fn line_with(path: &std::path::Path, needle: &str) -> String {
    eventually(
        &format!("a line with {needle} in {}", path.display()),
        Duration::from_secs(10),
        || async {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            text.lines()
                .find(|l| l.contains(needle))
                .map(str::to_string)
                .ok_or_else(|| text.clone())
        },
    )
    .await
}

/// The Istio text line's fields by name.
fn text_fields(line: &str) -> HashMap<&'static str, String> {
    let re = regex::Regex::new(
        r#"^\[(\S+)\] "(\S+) (\S+) (\S+)" (\d+) (\S+) (\S+) (\S+) "([^"]*)" (\d+) (\d+) (\d+) (\S+) "([^"]*)" "([^"]*)" "([^"]*)" "([^"]*)" "([^"]*)" (\S+) (\S+) (\S+) (\S+) (\S+) (\S+)$"#,
    )
    .unwrap();
    let c = re
        .captures(line)
        .unwrap_or_else(|| panic!("not Istio's text format: {line:?}"));
    let names = [
        "start_time",
        "method",
        "path",
        "protocol",
        "response_code",
        "response_flags",
        "response_code_details",
        "connection_termination_details",
        "upstream_transport_failure_reason",
        "bytes_received",
        "bytes_sent",
        "duration",
        "upstream_service_time",
        "x_forwarded_for",
        "user_agent",
        "request_id",
        "authority",
        "upstream_host",
        "upstream_cluster",
        "upstream_local_address",
        "downstream_local_address",
        "downstream_remote_address",
        "requested_server_name",
        "route_name",
    ];
    names
        .iter()
        .enumerate()
        .map(|(i, n)| (*n, c[i + 1].to_string()))
        .collect()
}

/// What one request's lines must say (text `-` is JSON `null`).
struct Expect<'a> {
    rid: &'a str,
    path: &'a str,
    code: u16,
    flags: &'a str,
    /// A prefix of the details (UF's carry the transport failure after it in Envoy).
    details: &'a str,
    body_len: usize,
    upstream_host: Option<String>,
    cluster: Option<&'a str>,
    route: Option<&'a str>,
    via_upstream: bool,
}

fn check_text(line: &str, e: &Expect<'_>, port: u16) {
    let f = text_fields(line);
    let dash = |v: Option<&str>| v.unwrap_or("-").to_string();
    let start = &f["start_time"];
    assert!(
        start.len() == 24 && start.ends_with('Z') && start.as_bytes()[10] == b'T',
        "start_time {start}"
    );
    assert_eq!(f["method"], "GET", "{line}");
    assert_eq!(f["path"], e.path, "{line}");
    assert_eq!(f["protocol"], "HTTP/1.1", "{line}");
    assert_eq!(f["response_code"], e.code.to_string(), "{line}");
    assert_eq!(f["response_flags"], e.flags, "{line}");
    assert!(
        f["response_code_details"].starts_with(e.details),
        "details: {line}"
    );
    assert_eq!(f["connection_termination_details"], "-", "{line}");
    assert_eq!(f["bytes_received"], "0", "{line}");
    assert_eq!(f["bytes_sent"], e.body_len.to_string(), "{line}");
    assert!(f["duration"].parse::<u64>().is_ok(), "{line}");
    if e.via_upstream {
        assert!(f["upstream_service_time"].parse::<u64>().is_ok(), "{line}");
        assert!(
            f["upstream_local_address"].starts_with("127.0.0.1:"),
            "{line}"
        );
    } else {
        assert_eq!(f["upstream_service_time"], "-", "{line}");
        assert_eq!(f["upstream_local_address"], "-", "{line}");
    }
    assert_eq!(f["x_forwarded_for"], "-", "{line}");
    assert_eq!(f["user_agent"], "alog-test/1", "{line}");
    assert_eq!(f["request_id"], e.rid, "{line}");
    assert_eq!(f["authority"], HOST, "{line}");
    assert_eq!(
        f["upstream_host"],
        dash(e.upstream_host.as_deref()),
        "{line}"
    );
    assert_eq!(f["upstream_cluster"], dash(e.cluster), "{line}");
    assert_eq!(
        f["downstream_local_address"],
        format!("127.0.0.1:{port}"),
        "{line}"
    );
    assert!(
        f["downstream_remote_address"].starts_with("127.0.0.1:"),
        "{line}"
    );
    assert_eq!(f["requested_server_name"], "-", "{line}");
    assert_eq!(f["route_name"], dash(e.route), "{line}");
}

fn check_json(line: &str, e: &Expect<'_>, port: u16) {
    let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
    let o = v.as_object().expect("an object");
    // Every key, in Envoy's sorted order.
    let keys: Vec<&String> = o.keys().collect();
    let mut sorted: Vec<&str> = ISTIO_JSON.iter().map(|(k, _)| *k).collect();
    sorted.sort();
    assert_eq!(keys, sorted, "{line}");
    let null_or = |v: Option<&str>| v.map_or(serde_json::Value::Null, |s| s.into());
    assert!(o["start_time"].as_str().is_some_and(|s| s.ends_with('Z')));
    assert_eq!(o["method"], "GET");
    assert_eq!(o["path"], e.path);
    assert_eq!(o["protocol"], "HTTP/1.1");
    assert_eq!(o["response_code"], e.code, "numbers stay numbers: {line}");
    assert_eq!(o["response_flags"], e.flags, "{line}");
    assert!(o["response_code_details"]
        .as_str()
        .is_some_and(|d| d.starts_with(e.details)));
    assert_eq!(o["connection_termination_details"], serde_json::Value::Null);
    assert_eq!(o["bytes_received"], 0, "{line}");
    assert_eq!(o["bytes_sent"], e.body_len, "{line}");
    assert!(o["duration"].is_u64(), "{line}");
    if e.via_upstream {
        // A header: a string, even when it holds a number.
        assert!(o["upstream_service_time"].is_string(), "{line}");
        assert!(o["upstream_local_address"].is_string(), "{line}");
    } else {
        assert_eq!(
            o["upstream_service_time"],
            serde_json::Value::Null,
            "{line}"
        );
        assert_eq!(
            o["upstream_local_address"],
            serde_json::Value::Null,
            "{line}"
        );
    }
    assert_eq!(o["x_forwarded_for"], serde_json::Value::Null);
    assert_eq!(o["user_agent"], "alog-test/1");
    assert_eq!(o["request_id"], e.rid);
    assert_eq!(o["authority"], HOST);
    assert_eq!(
        o["upstream_host"],
        null_or(e.upstream_host.as_deref()),
        "{line}"
    );
    assert_eq!(o["upstream_cluster"], null_or(e.cluster), "{line}");
    assert_eq!(
        o["downstream_local_address"],
        format!("127.0.0.1:{port}").as_str()
    );
    assert!(o["downstream_remote_address"]
        .as_str()
        .is_some_and(|s| s.starts_with("127.0.0.1:")));
    assert_eq!(o["requested_server_name"], serde_json::Value::Null);
    assert_eq!(o["route_name"], null_or(e.route), "{line}");
}

#[tokio::test]
async fn istio_formats_status_filter_stdout_and_tcp() {
    let dir = TempDir::new("portico-alog");
    let text_path = dir.path.join("text.log");
    let json_path = dir.path.join("json.log");
    let status_path = dir.path.join("status.log");
    let tcp_path = dir.path.join("tcp.log");
    let web = Backend::start("web").await;
    let refused = free_port();
    let tcp_port = free_port();
    let paths = [&text_path, &json_path, &status_path, &tcp_path]
        .map(|p| p.to_str().expect("utf-8 temp path").to_string());
    let mesh = Mesh::start_args(ads_api_type(), &["--file-flush-interval-msec", "100"], |port| {
        let mut h = hcm(port);
        h.access_log = vec![
            file_log(&paths[0], text_source(ISTIO_TEXT)),
            file_log(&paths[1], json_format()),
            status_filtered(&paths[2]),
            stdout_log(),
        ];
        let tcp = TcpProxy {
            stat_prefix: "alog_tcp".into(),
            cluster_specifier: Some(ClusterSpecifier::Cluster("web".into())),
            access_log: vec![file_log(
                &paths[3],
                text_source(
                    "%DOWNSTREAM_LOCAL_ADDRESS% %UPSTREAM_HOST% %UPSTREAM_CLUSTER% %BYTES_RECEIVED% %BYTES_SENT% %RESPONSE_FLAGS% %PROTOCOL% %REQ(:METHOD)% %RESPONSE_CODE%\n",
                ),
            )],
            ..Default::default()
        };
        let tcp_listener = Listener {
            name: listener_name(tcp_port),
            address: Some(socket_addr("127.0.0.1", tcp_port)),
            filter_chains: vec![FilterChain {
                filters: vec![Filter {
                    name: "envoy.filters.network.tcp_proxy".into(),
                    config_type: Some(filter::ConfigType::TypedConfig(any(tcp))),
                }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut s = Snapshot {
            listeners: vec![listener_with(port, h), tcp_listener],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost(
                    "alog",
                    &[HOST],
                    vec![
                        named(rt(prefix("/ok"), to_cluster("web")), "r_ok"),
                        named(rt(prefix("/uh"), to_cluster("empty")), "r_uh"),
                        named(rt(prefix("/uf"), to_cluster("refused")), "r_uf"),
                    ],
                )],
            )],
            ..Default::default()
        }
        .with_backends(&[("web", &web)]);
        s.clusters.push(eds_cluster("empty"));
        s.endpoints.push(cla("empty", &[]));
        s.clusters.push(eds_cluster("refused"));
        s.endpoints
            .push(cla("refused", &[format!("127.0.0.1:{refused}").parse().unwrap()]));
        s
    })
    .await;
    mesh.wait_backend("/ok", HOST, &[], "web").await;

    let ua = ("user-agent", "alog-test/1");
    let cases = [
        ("/ok?x=1", "rid-ok"),
        ("/nowhere", "rid-nr"),
        ("/uh", "rid-uh"),
        ("/uf", "rid-uf"),
    ];
    let mut resps = Vec::new();
    for (path, rid) in cases {
        resps.push(mesh.get(path, HOST, &[ua, ("x-request-id", rid)]).await);
    }
    let codes: Vec<u16> = resps.iter().map(|r| r.status).collect();
    assert_eq!(codes, [200, 404, 503, 503], "{resps:?}");
    let upstream_web = web.addr.to_string();
    let expect = [
        Expect {
            rid: "rid-ok",
            path: "/ok?x=1",
            code: 200,
            flags: "-",
            details: "via_upstream",
            body_len: resps[0].body.len(),
            upstream_host: Some(upstream_web.clone()),
            cluster: Some("web"),
            route: Some("r_ok"),
            via_upstream: true,
        },
        Expect {
            rid: "rid-nr",
            path: "/nowhere",
            code: 404,
            flags: "NR",
            details: "route_not_found",
            body_len: resps[1].body.len(),
            upstream_host: None,
            cluster: None,
            route: None,
            via_upstream: false,
        },
        Expect {
            rid: "rid-uh",
            path: "/uh",
            code: 503,
            flags: "UH",
            details: "no_healthy_upstream",
            body_len: resps[2].body.len(),
            upstream_host: None,
            cluster: Some("empty"),
            route: Some("r_uh"),
            via_upstream: false,
        },
        Expect {
            rid: "rid-uf",
            path: "/uf",
            code: 503,
            flags: "UF",
            details: "upstream_reset_before_response_started{remote_connection_failure",
            body_len: resps[3].body.len(),
            upstream_host: Some(format!("127.0.0.1:{refused}")),
            cluster: Some("refused"),
            route: Some("r_uf"),
            via_upstream: false,
        },
    ];
    for e in &expect {
        let line = line_with(&text_path, &format!("\"{}\"", e.rid)).await;
        check_text(&line, e, mesh.port);
        let line = line_with(&json_path, &format!("\"{}\"", e.rid)).await;
        check_json(&line, e, mesh.port);
    }
    // Envoy's UF line names the failure; its transport failure reason too.
    let uf = text_fields(&line_with(&text_path, "\"rid-uf\"").await)
        ["upstream_transport_failure_reason"]
        .clone();
    assert_eq!(uf, "delayed_connect_error:_Connection_refused");

    // A request the gateway answers itself still gets (and logs) a generated request id,
    // as Envoy's connection manager makes one before routing.
    let r = mesh
        .get("/nowhere-else", HOST, &[("user-agent", "alog-noid/1")])
        .await;
    assert_eq!(r.status, 404);
    let line = line_with(&text_path, "\"alog-noid/1\"").await;
    let rid = text_fields(&line)["request_id"].clone();
    assert!(is_uuid(&rid), "a generated request id: {line}");

    // The status filter kept the 5xx only.
    line_with(&status_path, "rid-uf").await;
    let status = std::fs::read_to_string(&status_path).unwrap();
    let ours: Vec<&str> = status.lines().filter(|l| l.contains("rid-")).collect();
    assert_eq!(ours, ["503 UH rid-uh", "503 UF rid-uf"], "{status}");

    // The stdout logger writes to the process's stdout (the harness keeps it with stderr).
    eventually("the stdout line", Duration::from_secs(10), || async {
        let out = mesh.gw.stderr();
        if out.contains("ALOG-STDOUT 200 rid-ok") && out.contains("ALOG-STDOUT 404 rid-nr") {
            Ok(())
        } else {
            Err(out)
        }
    })
    .await;

    // Envoy's access log file counters.
    let stats = get(&mesh.gw.admin_url("/stats"), None, &[]).await.body;
    let stat = |n: &str| {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{n}: ")))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {n} in /stats"))
    };
    assert!(stat("filesystem.write_buffered") >= 14, "{stats}");
    assert!(stat("filesystem.write_completed") >= 1, "{stats}");
    assert_eq!(stat("filesystem.write_failed"), 0, "{stats}");

    // tcp_proxy: one line when the connection is over.
    let req = format!("GET /tcp HTTP/1.1\r\nhost: {HOST}\r\nconnection: close\r\n\r\n");
    let mut got = Vec::new();
    eventually(
        "a response through tcp_proxy",
        Duration::from_secs(10),
        || async {
            let mut s = tokio::net::TcpStream::connect(("127.0.0.1", tcp_port))
                .await
                .map_err(|e| e.to_string())?;
            s.write_all(req.as_bytes())
                .await
                .map_err(|e| e.to_string())?;
            let mut buf = Vec::new();
            s.read_to_end(&mut buf).await.map_err(|e| e.to_string())?;
            if buf.starts_with(b"HTTP/1.1 200") {
                Ok(buf)
            } else {
                Err(String::from_utf8_lossy(&buf).into_owned())
            }
        },
    )
    .await
    .clone_into(&mut got);
    let tcp_line = eventually("the tcp_proxy line", Duration::from_secs(10), || async {
        let text = std::fs::read_to_string(&tcp_path).unwrap_or_default();
        text.lines()
            .find(|l| l.ends_with(&format!(" {} {} - - - 0", req.len(), got.len())))
            .map(str::to_string)
            .ok_or(text)
    })
    .await;
    assert_eq!(
        tcp_line,
        format!(
            "127.0.0.1:{tcp_port} {upstream_web} web {} {} - - - 0",
            req.len(),
            got.len()
        )
    );

    // Log rotation: the file is moved away and SIGUSR1 makes the gateway reopen its path.
    let rotated = dir.path.join("text.log.1");
    std::fs::rename(&text_path, &rotated).expect("rotate");
    // SAFETY: kill(2) on the gateway child's own pid; no memory is involved.
    unsafe {
        libc::kill(mesh.gw.pid() as libc::pid_t, libc::SIGUSR1);
    }
    let mut n = 0;
    eventually(
        "a line in the reopened file",
        Duration::from_secs(10),
        || {
            n += 1;
            let rid = format!("rid-rotated-{n}");
            let mesh = &mesh;
            let text_path = &text_path;
            async move {
                mesh.get("/ok", HOST, &[ua, ("x-request-id", rid.as_str())])
                    .await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                let text = std::fs::read_to_string(text_path).unwrap_or_default();
                if text.contains("rid-rotated-") {
                    Ok(())
                } else {
                    Err(text)
                }
            }
        },
    )
    .await;
    let old = std::fs::read_to_string(&rotated).unwrap();
    assert!(old.contains("\"rid-uf\""), "{old}");
}

/// With `use_remote_address` and a trusted hop, the downstream remote address is XFF's last
/// entry as the client sent it (port 0), or the peer when XFF has none or no address there;
/// the log sees that one, not the peer the connection manager appends to XFF. Also for a
/// request answered locally (no route), which ends before the append.
#[tokio::test]
async fn downstream_remote_is_the_trusted_hop_before_the_append() {
    let dir = TempDir::new("portico-alog-xff");
    let path = dir.path.join("xff.log");
    let web = Backend::start("web").await;
    let log_path = path.to_str().expect("utf-8 temp path").to_string();
    let mesh = Mesh::start_args(ads_api_type(), &["--file-flush-interval-msec", "100"], |port| {
        let mut h = hcm(port);
        h.use_remote_address = Some(envoy_types::pb::google::protobuf::BoolValue { value: true });
        h.xff_num_trusted_hops = 1;
        h.access_log = vec![file_log(
            &log_path,
            text_source(
                "rid=%REQ(X-CASE)% remote=%DOWNSTREAM_REMOTE_ADDRESS% ip=%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT% code=%RESPONSE_CODE%\n",
            ),
        )];
        Snapshot {
            listeners: vec![listener_with(port, h)],
            routes: vec![route_config(
                &route_name(port),
                vec![vhost("alog", &[HOST], vec![rt(prefix("/ok"), to_cluster("web"))])],
            )],
            ..Default::default()
        }
        .with_backends(&[("web", &web)])
    })
    .await;
    mesh.wait_backend("/ok", HOST, &[], "web").await;

    let cases = [
        ("rid-none", "/ok", None, None, 200),
        ("rid-one", "/ok", Some("1.2.3.4"), Some("1.2.3.4"), 200),
        (
            "rid-two",
            "/ok",
            Some("5.6.7.8, 1.2.3.4"),
            Some("1.2.3.4"),
            200,
        ),
        ("rid-bad", "/ok", Some("not-an-address"), None, 200),
        (
            "rid-local",
            "/nowhere",
            Some("9.9.9.9"),
            Some("9.9.9.9"),
            404,
        ),
    ];
    for (rid, path_, xff, _, code) in cases {
        // Not x-request-id: an edge request gets a new one.
        let mut headers = vec![("x-case", rid)];
        if let Some(x) = xff {
            headers.push(("x-forwarded-for", x));
        }
        let r = mesh.get(path_, HOST, &headers).await;
        assert_eq!(r.status, code, "{rid}: {r:?}");
    }
    for (rid, _, _, hop, code) in cases {
        let line = line_with(&path, &format!("rid={rid} ")).await;
        let field = |name: &str| {
            line.split(' ')
                .find_map(|f| f.strip_prefix(name))
                .unwrap_or_default()
                .to_string()
        };
        assert_eq!(field("code="), code.to_string(), "{line}");
        match hop {
            Some(ip) => {
                assert_eq!(field("remote="), format!("{ip}:0"), "{line}");
                assert_eq!(field("ip="), ip, "{line}");
            }
            None => {
                // The peer, with its port.
                let remote: std::net::SocketAddr = field("remote=").parse().expect(&line);
                assert_eq!(remote.ip().to_string(), "127.0.0.1", "{line}");
                assert_ne!(remote.port(), 0, "{line}");
                assert_eq!(field("ip="), "127.0.0.1", "{line}");
            }
        }
    }
}
