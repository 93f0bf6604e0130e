//! Translation of `stats.PluginConfig` in every encoding (with the real configs of the Istio
//! dumps in `shared/xds-data`), peer metadata, and the labels the store reports.

use std::sync::Arc;

use envoy_types::pb::envoy::config::listener::v3 as lpb;
use envoy_types::pb::google::protobuf::{value::Kind, Any, ListValue, Struct, Value};
use prost::Message;
use serde_json::json;

use super::peer::{base64_decode, base64_encode};
use super::*;
use crate::telemetry::stream_info::{Protocol, ResponseFlag, StreamInfo, UpstreamInfo};

fn shared(rel: &str) -> std::path::PathBuf {
    let root = std::env::var_os("PORTICO_SHARED_DIR")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .ancestors()
                .map(|a| a.join("shared"))
                .find(|p| p.join("xds-data").is_dir())
        })
        .unwrap_or_else(|| std::path::PathBuf::from("/work/shared"));
    root.join("xds-data").join(rel)
}

fn to_value(j: &serde_json::Value) -> Value {
    let kind = match j {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(a) => Kind::ListValue(ListValue {
            values: a.iter().map(to_value).collect(),
        }),
        serde_json::Value::Object(_) => Kind::StructValue(to_struct(j)),
    };
    Value { kind: Some(kind) }
}

fn to_struct(j: &serde_json::Value) -> Struct {
    Struct {
        fields: j
            .as_object()
            .map(|o| o.iter().map(|(k, v)| (k.clone(), to_value(v))).collect())
            .unwrap_or_default(),
    }
}

fn typed_struct(outer: &str, inner: &str, value: serde_json::Value) -> Any {
    Any {
        type_url: format!("type.googleapis.com/{outer}"),
        value: TypedStruct {
            type_url: inner.to_string(),
            value: Some(to_struct(&value)),
        }
        .encode_to_vec(),
    }
}

/// A filter's `typed_config` from its proto-JSON (Istio's types are in Portico's descriptors).
fn any_from_json(typed_config: &serde_json::Value) -> Any {
    let _pool = crate::protojson::pool().expect("descriptor pool");
    let f = json!({"name": "f", "typed_config": typed_config});
    let msg = crate::protojson::dynamic_from_json("envoy.config.listener.v3.Filter", &f)
        .unwrap_or_else(|e| panic!("{typed_config}: {e}"));
    let f = lpb::Filter::decode(msg.encode_to_vec().as_slice()).expect("filter");
    match f.config_type {
        Some(lpb::filter::ConfigType::TypedConfig(a)) => a,
        _ => panic!("no typed_config"),
    }
}

fn istio_filters(v: &serde_json::Value, out: &mut Vec<(String, serde_json::Value)>) {
    match v {
        serde_json::Value::Object(o) => {
            if let (Some(n), Some(tc)) = (
                o.get("name").and_then(|n| n.as_str()),
                o.get("typed_config"),
            ) {
                if n == "istio.stats" || n == "istio.metadata_exchange" {
                    out.push((n.to_string(), tc.clone()));
                }
            }
            o.values().for_each(|v| istio_filters(v, out));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| istio_filters(v, out)),
        _ => {}
    }
}

#[test]
fn dump_configs_translate_in_every_form_they_take() {
    let mut stats = 0;
    let mut host_fallback_off = 0;
    let mut mx_wasm = 0;
    for (file, yaml) in [
        (
            "istio-sidecar/deathstarbench_istio1.18.2_sidecar_config_dump.json",
            false,
        ),
        ("istio-sidecar/istioctl_authz_configdump.yaml", true),
    ] {
        let text = std::fs::read_to_string(shared(file))
            .unwrap_or_else(|e| panic!("{file} is needed: {e}"));
        let dump: serde_json::Value = if yaml {
            serde_yaml::from_str(&text).expect("yaml")
        } else {
            serde_json::from_str(&text).expect("json")
        };
        let mut found = Vec::new();
        istio_filters(&dump, &mut found);
        // Hundreds of listeners carry the same few configs (591 in all, 8 different), and
        // translation is pure: each different one once, which keeps a debug build's test
        // run from spending a minute and a half on the same eight conversions.
        let mut seen = std::collections::HashSet::new();
        found.retain(|(name, tc)| seen.insert((name.clone(), tc.to_string())));
        for (name, tc) in found {
            let any = any_from_json(&tc);
            let kind = crate::filters::telemetry::istio_telemetry(&any)
                .unwrap_or_else(|| panic!("{file}: {tc} is not seen as Istio telemetry"));
            if name == "istio.stats" {
                let cfg = StatsConfig::from_any(&any).unwrap_or_else(|e| panic!("{tc}: {e}"));
                assert_eq!(cfg.reporter, Reporter::Source);
                assert_eq!(cfg.tcp_reporting_duration, Duration::from_secs(5));
                host_fallback_off += usize::from(cfg.disable_host_header_fallback);
                assert_eq!(cfg.host_capture.is_none(), cfg.disable_host_header_fallback);
                stats += 1;
            } else if any.type_url.ends_with("wasm.v3.Wasm") {
                // The 1.18 null-VM plugin: the HTTP exchange both ways.
                assert_eq!(kind, PEER_METADATA_TYPE);
                let decl = crate::filters::FilterDecl {
                    name: &name,
                    config: &any,
                    disabled: false,
                };
                match crate::filters::telemetry::translate_peer_metadata(&decl) {
                    Ok(crate::filters::Translated::PeerMetadata(c)) => {
                        assert_eq!(*c, PeerMetadataConfig::legacy_wasm())
                    }
                    other => panic!("{other:?}"),
                }
                mx_wasm += 1;
            }
        }
    }
    assert!(stats >= 4, "{stats} istio.stats configs");
    assert!(host_fallback_off >= 1);
    assert!(mx_wasm >= 1);
}

#[test]
fn plain_any_with_overrides() {
    let pb = PluginConfigPb {
        disable_host_header_fallback: true,
        tcp_reporting_duration: Some(envoy_types::pb::google::protobuf::Duration {
            seconds: 15,
            nanos: 0,
        }),
        metrics: vec![
            MetricConfigPb {
                name: "requests_total".into(),
                dimensions: [
                    ("request_host".to_string(), "request.host".to_string()),
                    (
                        "destination_port".to_string(),
                        "string(destination.port)".to_string(),
                    ),
                    ("source_cluster".to_string(), "'edge'".to_string()),
                ]
                .into_iter()
                .collect(),
                tags_to_remove: vec!["grpc_response_status".into()],
                ..Default::default()
            },
            MetricConfigPb {
                name: "request_bytes".into(),
                drop: true,
                ..Default::default()
            },
        ],
        reporter: 0,
        ..Default::default()
    };
    let any = Any {
        type_url: STATS_TYPE.into(),
        value: pb.encode_to_vec(),
    };
    let cfg = StatsConfig::from_any(&any).expect("translates");
    assert!(cfg.disable_host_header_fallback);
    assert_eq!(cfg.tcp_reporting_duration, Duration::from_secs(15));
    assert!(cfg.plan(Metric::RequestBytes).drop);
    assert!(!cfg.plan(Metric::ResponseBytes).drop);
    let rt = cfg.plan(Metric::RequestsTotal);
    assert!(rt.overrides.contains(&(Tag::GrpcResponseStatus, None)));
    assert!(rt
        .overrides
        .contains(&(Tag::SourceCluster, Some(Attr::Literal(Arc::from("edge"))))));
    // Added dimensions in tag-name order, as istio-proxy sorts them.
    let added: Vec<&str> = rt.additions.iter().map(|(n, _)| &**n).collect();
    assert_eq!(added, ["destination_port", "request_host"]);
    assert_eq!(
        rt.additions[0].1,
        Attr::Unknown,
        "a CEL call is not evaluated"
    );
    assert_eq!(rt.additions[1].1, Attr::Request(0));
    assert_eq!(cfg.captures, [Capture::Host]);
    assert!(cfg
        .warnings
        .iter()
        .any(|w| w.contains("string(destination.port)")));
    // The other metrics keep their standard tags.
    assert_eq!(cfg.plan(Metric::TcpOpened), &MetricPlan::default());
}

#[test]
fn typed_struct_encodings_both_type_urls() {
    let value = json!({
        "disable_host_header_fallback": true,
        "tcpReportingDuration": "0.5s",
        "reporter": "SERVER_GATEWAY",
        "metrics": [
            {"dimensions": {"upstream_workload": "upstream_peer.workload",
                            "app_label": "upstream_peer.labels['app']",
                            "node_meta": "node.metadata['MESH_ID']",
                            "user_agent": "request.headers['User-Agent']"},
             "tags_to_remove": ["request_protocol"]},
            {"name": "tcp_sent_bytes_total", "drop": true}
        ]
    });
    for outer in ["udpa.type.v1.TypedStruct", "xds.type.v3.TypedStruct"] {
        let any = typed_struct(outer, STATS_TYPE, value.clone());
        assert_eq!(
            crate::filters::telemetry::istio_telemetry(&any),
            Some(STATS_TYPE)
        );
        let cfg = StatsConfig::from_any(&any).expect("translates");
        assert_eq!(cfg.reporter, Reporter::Waypoint);
        assert_eq!(cfg.tcp_reporting_duration, Duration::from_millis(500));
        assert!(cfg.plan(Metric::TcpSent).drop);
        for m in Metric::ALL {
            let p = cfg.plan(m);
            assert!(p.overrides.contains(&(Tag::RequestProtocol, None)), "{m:?}");
            assert_eq!(
                p.additions,
                vec![
                    (
                        Arc::from("app_label"),
                        Attr::UpstreamPeer(PeerField::Label("app".into()))
                    ),
                    (Arc::from("node_meta"), Attr::NodeMetadata("MESH_ID".into())),
                    (
                        Arc::from("upstream_workload"),
                        Attr::UpstreamPeer(PeerField::Workload)
                    ),
                    (Arc::from("user_agent"), Attr::Request(0)),
                ]
            );
        }
        assert_eq!(
            cfg.captures,
            [Capture::Header(http::HeaderName::from_static("user-agent"))]
        );
        assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
    }
}

/// istiod up to 1.17: the null-VM Wasm plugin with its config as a JSON string, plain or
/// inside a TypedStruct.
#[test]
fn wasm_string_value_configuration() {
    let config = r#"{"debug":"false","stat_prefix":"istio","disable_host_header_fallback":"true",
        "metrics":[{"name":"requests_total","dimensions":{"destination_port":"string(destination.port)","request_host":"request.host"}}]}"#;
    let wasm = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
        "config": {
            "root_id": "stats_outbound",
            "vm_config": {"vm_id": "stats_outbound", "runtime": "envoy.wasm.runtime.null",
                          "code": {"local": {"inline_string": "envoy.wasm.stats"}}},
            "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                              "value": config}
        }
    });
    let plain = any_from_json(&wasm);
    let mut inner = wasm.clone();
    inner.as_object_mut().map(|o| o.remove("@type"));
    let wrapped = typed_struct(
        "udpa.type.v1.TypedStruct",
        "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
        inner,
    );
    for any in [plain, wrapped] {
        assert_eq!(
            crate::filters::telemetry::istio_telemetry(&any),
            Some(STATS_TYPE)
        );
        let cfg = StatsConfig::from_any(&any).expect("translates");
        assert!(cfg.disable_host_header_fallback);
        let added: Vec<_> = cfg
            .plan(Metric::RequestsTotal)
            .additions
            .iter()
            .map(|(n, a)| (n.to_string(), a.clone()))
            .collect();
        assert_eq!(
            added,
            [
                ("destination_port".to_string(), Attr::Unknown),
                ("request_host".to_string(), Attr::Request(0)),
            ]
        );
    }
    // A real Wasm module is not Istio's built-in plugin: refused as before.
    let mut other = wasm.clone();
    other["config"]["vm_config"]["runtime"] = json!("envoy.wasm.runtime.v8");
    assert_eq!(
        crate::filters::telemetry::istio_telemetry(&any_from_json(&other)),
        None
    );
}

#[test]
fn malformed_configs_are_refused() {
    let bad = typed_struct(
        "udpa.type.v1.TypedStruct",
        STATS_TYPE,
        json!({"tcp_reporting_duration": "soon"}),
    );
    let e = StatsConfig::from_any(&bad).unwrap_err();
    assert!(e.contains("tcp_reporting_duration"), "{e}");
    let bad = typed_struct(
        "udpa.type.v1.TypedStruct",
        STATS_TYPE,
        json!({"metrics": {"name": "x"}}),
    );
    assert!(StatsConfig::from_any(&bad).unwrap_err().contains("metrics"));
}

#[test]
fn peer_metadata_config_from_typed_struct() {
    // As istiod renders it for gateways (and sidecars' outbound listeners).
    let any = typed_struct(
        "udpa.type.v1.TypedStruct",
        PEER_METADATA_TYPE,
        json!({
            "upstream_discovery": [{"istio_headers": {}}, {"workload_discovery": {}}],
            "upstream_propagation": [{"istio_headers": {"skip_external_clusters": true}}]
        }),
    );
    let c = PeerMetadataConfig::from_any(&any).expect("translates");
    assert_eq!(
        c.upstream_discovery,
        [Discovery::IstioHeaders, Discovery::WorkloadDiscovery]
    );
    assert_eq!(
        c.upstream_propagation,
        Some(Propagation {
            skip_external_clusters: true
        })
    );
    assert!(c.downstream_discovery.is_empty() && c.downstream_propagation.is_none());
    // The same as a plain Any, through the descriptors.
    let plain = any_from_json(&json!({
        "@type": PEER_METADATA_TYPE,
        "upstream_discovery": [{"istio_headers": {}}, {"workload_discovery": {}}],
        "upstream_propagation": [{"istio_headers": {"skip_external_clusters": true}}]
    }));
    assert_eq!(PeerMetadataConfig::from_any(&plain).expect("plain"), c);
}

#[test]
fn base64_round_trips() {
    for (plain, enc) in [
        ("", ""),
        ("f", "Zg=="),
        ("fo", "Zm8="),
        ("foo", "Zm9v"),
        ("foob", "Zm9vYg=="),
        ("fooba", "Zm9vYmE="),
        ("foobar", "Zm9vYmFy"),
    ] {
        assert_eq!(base64_encode(plain.as_bytes()), enc);
        assert_eq!(base64_decode(enc.as_bytes()).unwrap(), plain.as_bytes());
        assert_eq!(
            base64_decode(enc.trim_end_matches('=').as_bytes()).unwrap(),
            plain.as_bytes()
        );
    }
    assert_eq!(base64_decode(b"Zm9v!"), None);
}

fn gateway_node() -> LocalNode {
    let md = to_struct(&json!({
        "NAME": "istio-ingressgateway-7d4f9-abcde",
        "NAMESPACE": "istio-system",
        "WORKLOAD_NAME": "istio-ingressgateway",
        "CLUSTER_ID": "Kubernetes",
        "OWNER": "kubernetes://apis/apps/v1/namespaces/istio-system/deployments/istio-ingressgateway",
        "ISTIO_VERSION": "1.22.1",
        "MESH_ID": "cluster.local",
        "LABELS": {
            "app": "istio-ingressgateway",
            "istio": "ingressgateway",
            "service.istio.io/canonical-name": "istio-ingressgateway",
            "service.istio.io/canonical-revision": "latest"
        }
    }));
    LocalNode::new(
        "router~10.244.0.17~istio-ingressgateway-7d4f9-abcde.istio-system~istio-system.svc.cluster.local",
        "istio-ingressgateway.istio-system",
        Some(&md),
    )
}

#[test]
fn node_metadata_becomes_the_peer_header_and_back() {
    let node = gateway_node();
    assert_eq!(node.peer.workload, "istio-ingressgateway");
    assert_eq!(node.peer.workload_type, peer::WorkloadType::Deployment);
    assert_eq!(node.peer.canonical_revision, "latest");
    assert_eq!(node.peer.version, "");
    assert_eq!(node.istio_version, "1.22.1");
    let bytes = base64_decode(node.header_value.as_bytes()).unwrap();
    let s = Struct::decode(bytes.as_slice()).unwrap();
    let mut keys: Vec<&String> = s.fields.keys().collect();
    keys.sort();
    // Only what istio-proxy's convertWorkloadMetadataToStruct writes (MESH_ID, ISTIO_VERSION
    // and the other labels stay home).
    assert_eq!(
        keys,
        [
            "CLUSTER_ID",
            "LABELS",
            "NAME",
            "NAMESPACE",
            "OWNER",
            "WORKLOAD_NAME"
        ]
    );
    match &s.fields["OWNER"].kind {
        Some(Kind::StringValue(o)) => assert_eq!(
            o,
            "kubernetes://apis/apps/v1/namespaces/istio-system/deployments/istio-ingressgateway"
        ),
        other => panic!("{other:?}"),
    }
    // Deterministic: keys sorted on the wire (protobuf's deterministic map order).
    assert_eq!(node.peer.to_struct_bytes(), node.peer.to_struct_bytes());
    let back = PeerInfo::from_header(node.header_value.as_bytes(), &[]).unwrap();
    assert_eq!(back, node.peer);
}

#[test]
fn endpoint_and_baggage_metadata() {
    let p = PeerInfo::from_endpoint("reviews-v2;default;reviews;v2;Kubernetes").unwrap();
    assert_eq!(
        (
            &*p.workload,
            &*p.namespace,
            &*p.canonical_name,
            &*p.canonical_revision,
            &*p.cluster
        ),
        ("reviews-v2", "default", "reviews", "v2", "Kubernetes")
    );
    assert_eq!(p.app, "");
    assert_eq!(PeerInfo::from_endpoint("a;b;c;d"), None);
    let b = PeerInfo::from_baggage(
        "k8s.deployment.name=ratings-v1,k8s.namespace.name=default,service.name=ratings,service.version=v1,k8s.cluster.name=Kubernetes",
    );
    assert_eq!(b.workload, "ratings-v1");
    assert_eq!(b.workload_type, peer::WorkloadType::Deployment);
    assert_eq!(b.canonical_revision, "v1");
}

#[test]
fn cluster_istio_metadata() {
    let md = to_struct(&json!({
        "services": [
            {"host": "reviews.default.svc.cluster.local", "namespace": "default"},
            {"host": "other.default.svc.cluster.local", "name": "other", "namespace": "default"}
        ],
        "default_original_port": 9080.0
    }));
    let m = IstioClusterMetadata::from_metadata(&md);
    let s = m.service.unwrap();
    assert_eq!(&*s.host, "reviews.default.svc.cluster.local");
    assert_eq!(
        &*s.name, "reviews",
        "the host up to its first dot without a name"
    );
    assert_eq!(&*s.namespace, "default");
    let ext = IstioClusterMetadata::from_metadata(&to_struct(&json!({"external": true})));
    assert!(ext.external && !ext.disable_mx && ext.service.is_none());
}

fn upstream(name: &str, service: Option<(&str, &str, &str)>) -> Arc<UpstreamInfo> {
    Arc::new(UpstreamInfo {
        name: Arc::from(name),
        observability_name: Arc::from(name),
        istio: IstioClusterMetadata {
            service: service.map(|(h, n, ns)| IstioService {
                host: Arc::from(h),
                name: Arc::from(n),
                namespace: Arc::from(ns),
            }),
            ..Default::default()
        },
    })
}

fn labels_of(store: &Store, m: Metric) -> Vec<(Vec<(String, String)>, u64)> {
    store.samples(m)
}

fn label<'a>(l: &'a [(String, String)], k: &str) -> &'a str {
    l.iter()
        .find(|(n, _)| n == k)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {k} in {l:?}"))
}

#[test]
fn source_reporter_labels_as_istio_proxy() {
    let node = gateway_node();
    let store = Store::new();
    let cfg =
        Arc::new(StatsConfig::from_json(&json!({"disable_host_header_fallback": true})).unwrap());
    // A request to a cluster with `istio` metadata and an endpoint with `istio.workload`.
    let mut info = StreamInfo::new(Protocol::Http11);
    info.response_code = 200;
    info.upstream = Some(upstream(
        "outbound|9080||reviews.default.svc.cluster.local",
        Some(("reviews.default.svc.cluster.local", "reviews", "default")),
    ));
    info.upstream_workload =
        PeerInfo::from_endpoint("reviews-v2;default;reviews;v2;Kubernetes").map(Arc::new);
    info.bytes_received = 0;
    info.bytes_sent = 120;
    info.last_downstream_tx = Some(Duration::from_millis(7));
    store.record_http(&cfg, &node, &info);
    store.record_http(&cfg, &node, &info);
    let s = labels_of(&store, Metric::RequestsTotal);
    assert_eq!(s.len(), 1);
    let (l, n) = &s[0];
    assert_eq!(*n, 2);
    let names: Vec<&str> = l.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        Tag::HTTP.iter().map(|t| t.name()).collect::<Vec<_>>()
    );
    let want = [
        ("reporter", "source"),
        ("source_workload", "istio-ingressgateway"),
        ("source_canonical_service", "istio-ingressgateway"),
        ("source_canonical_revision", "latest"),
        ("source_workload_namespace", "istio-system"),
        ("source_principal", "unknown"),
        ("source_app", "istio-ingressgateway"),
        ("source_version", ""),
        ("source_cluster", "Kubernetes"),
        ("destination_workload", "reviews-v2"),
        ("destination_workload_namespace", "default"),
        ("destination_principal", "unknown"),
        ("destination_app", "unknown"),
        ("destination_version", "unknown"),
        ("destination_service", "reviews.default.svc.cluster.local"),
        ("destination_canonical_service", "reviews"),
        ("destination_canonical_revision", "v2"),
        ("destination_service_name", "reviews"),
        ("destination_service_namespace", "default"),
        ("destination_cluster", "Kubernetes"),
        ("request_protocol", "http"),
        ("response_code", "200"),
        ("grpc_response_status", ""),
        ("response_flags", "-"),
        ("connection_security_policy", "unknown"),
    ];
    for (k, v) in want {
        assert_eq!(label(l, k), v, "{k}");
    }
    // Histograms: 7 ms falls in le=10; request bytes 0 in le=0.5.
    let mut text = String::new();
    store.prometheus_histograms(&mut text);
    assert!(text.contains("# TYPE istio_request_duration_milliseconds histogram"));
    assert!(text.contains("le=\"5\"} 0\n"), "{text}");
    assert!(
        text.contains("connection_security_policy=\"unknown\",le=\"10\"} 2\n"),
        "{text}"
    );
    assert!(text.contains("istio_request_bytes_bucket{"), "{text}");
    assert!(text.contains(",le=\"+Inf\"} 2\n"));
    assert!(text.contains("istio_response_bytes_sum{"));

    // A 404 without a route: no cluster, no peer: unknowns and NR.
    let mut nr = StreamInfo::new(Protocol::Http2);
    nr.response_code = 404;
    nr.flags.set(ResponseFlag::NoRouteFound);
    store.record_http(&cfg, &node, &nr);
    let s = labels_of(&store, Metric::RequestsTotal);
    let (l, n) = s
        .iter()
        .find(|(l, _)| label(l, "response_code") == "404")
        .expect("404 series");
    assert_eq!(*n, 1);
    for (k, v) in [
        ("destination_workload", "unknown"),
        ("destination_service", "unknown"),
        ("destination_service_name", "unknown"),
        ("destination_canonical_revision", "latest"),
        ("destination_service_namespace", "unknown"),
        ("response_flags", "NR"),
    ] {
        assert_eq!(label(l, k), v, "{k}");
    }

    // The exchanged peer metadata wins over the endpoint's.
    let mut mx = info.clone();
    let mut p = PeerInfo::from_endpoint("reviews-v3;default;reviews;v3;Kubernetes").unwrap();
    p.app = "reviews".into();
    p.version = "v3".into();
    mx.peers.upstream = Some(Arc::new(p));
    mx.grpc_request = true;
    mx.grpc_status = Some(14);
    mx.grpc_messages = Some((1, 3));
    store.record_http(&cfg, &node, &mx);
    // The gRPC message counters: the peer tags only.
    for (m, v) in [(Metric::RequestMessages, 1), (Metric::ResponseMessages, 3)] {
        let s = store.samples(m);
        assert_eq!(s.len(), 1, "{m:?}");
        assert_eq!(s[0].1, v);
        assert_eq!(s[0].0.len(), 20);
        assert_eq!(
            s[0].0.last().map(|(n, _)| n.as_str()),
            Some("destination_cluster")
        );
        assert_eq!(label(&s[0].0, "destination_workload"), "reviews-v3");
    }
    let s = labels_of(&store, Metric::RequestsTotal);
    let (l, _) = s
        .iter()
        .find(|(l, _)| label(l, "destination_workload") == "reviews-v3")
        .expect("peer series");
    assert_eq!(label(l, "destination_app"), "reviews");
    assert_eq!(label(l, "destination_version"), "v3");
    assert_eq!(label(l, "request_protocol"), "grpc");
    assert_eq!(label(l, "grpc_response_status"), "14");
}

#[test]
fn host_header_fallback_and_overrides() {
    let node = gateway_node();
    let store = Store::new();
    let cfg = Arc::new(
        StatsConfig::from_json(&json!({
            "metrics": [
                {"name": "requests_total",
                 "dimensions": {"request_host": "request.host", "source_cluster": "'edge'",
                                "mesh": "node.metadata['MESH_ID']", "bad": "a + b"},
                 "tags_to_remove": ["source_principal", "nonsense"]},
                {"name": "request_duration_milliseconds", "drop": true}
            ]
        }))
        .unwrap(),
    );
    assert_eq!(cfg.captures, [Capture::Host]);
    let mut info = StreamInfo::new(Protocol::Http11);
    info.response_code = 503;
    info.flags.set(ResponseFlag::NoHealthyUpstream);
    info.upstream = Some(upstream("plain", None));
    info.istio_attributes = vec![Some("www.example.com".into())];
    store.record_http(&cfg, &node, &info);
    let s = labels_of(&store, Metric::RequestsTotal);
    let (l, _) = &s[0];
    assert!(l.iter().all(|(n, _)| n != "source_principal"));
    assert_eq!(label(l, "source_cluster"), "edge");
    assert_eq!(label(l, "destination_service"), "www.example.com");
    assert_eq!(label(l, "destination_service_name"), "www.example.com");
    assert_eq!(label(l, "response_flags"), "UH");
    let tail: Vec<&str> = l.iter().rev().take(3).map(|(n, _)| n.as_str()).collect();
    assert_eq!(tail, ["request_host", "mesh", "bad"]);
    assert_eq!(label(l, "request_host"), "www.example.com");
    assert_eq!(label(l, "mesh"), "cluster.local");
    assert_eq!(label(l, "bad"), "unknown");
    assert!(store.samples(Metric::RequestDuration).is_empty());
    assert_eq!(store.samples(Metric::RequestBytes).len(), 1);
}

#[test]
fn tcp_connection_metrics() {
    let node = gateway_node();
    let store = Store::new();
    let cfg = StatsConfig::default();
    let mut info = StreamInfo::new(Protocol::Tcp);
    info.upstream = Some(upstream(
        "outbound|3306||mysql.db.svc.cluster.local",
        Some(("mysql.db.svc.cluster.local", "mysql", "db")),
    ));
    info.bytes_received = 11;
    info.bytes_sent = 22;
    store.record_tcp(&cfg, &node, &info);
    store.record_tcp(&cfg, &node, &info);
    for (m, v) in [
        (Metric::TcpOpened, 2),
        (Metric::TcpClosed, 2),
        (Metric::TcpReceived, 22),
        (Metric::TcpSent, 44),
    ] {
        let s = store.samples(m);
        assert_eq!(s.len(), 1, "{m:?}");
        assert_eq!(s[0].1, v, "{m:?}");
        let names: Vec<&str> = s[0].0.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, Tag::TCP.iter().map(|t| t.name()).collect::<Vec<_>>());
        assert_eq!(label(&s[0].0, "request_protocol"), "tcp");
        assert_eq!(
            label(&s[0].0, "destination_service"),
            "mysql.db.svc.cluster.local"
        );
    }
    let mut rows = Vec::new();
    store.configured();
    store.collect(&node, &mut |counter, name, metric, labels, v| {
        rows.push((counter, name, metric, labels, v))
    });
    assert!(rows.iter().any(|r| !r.0
        && r.2 == "istio_build"
        && r.3 == "component=\"proxy\",tag=\"1.22.1\""
        && r.1 == "istiocustom.istio_build.component.proxy.tag.1.22.1"));
    let opened = rows
        .iter()
        .find(|r| r.2 == "istio_tcp_connections_opened_total")
        .expect("opened");
    assert!(opened
        .1
        .starts_with("istiocustom.istio_tcp_connections_opened_total.reporter.source.source_workload.istio-ingressgateway."));
    assert!(opened
        .3
        .starts_with("reporter=\"source\",source_workload=\"istio-ingressgateway\""));
}

#[test]
fn waypoint_reporter_labels_the_downstream_as_source() {
    let node = gateway_node();
    let store = Store::new();
    let cfg = Arc::new(StatsConfig::from_json(&json!({"reporter": "SERVER_GATEWAY"})).unwrap());
    let mut info = StreamInfo::new(Protocol::Http2);
    info.response_code = 200;
    info.downstream_peer_uri_san = Some(Arc::from("spiffe://cluster.local/ns/frontend/sa/web"));
    let mut down = PeerInfo::from_endpoint("web-v1;frontend;web;v1;Kubernetes").unwrap();
    down.app = "web".into();
    info.peers.downstream = Some(Arc::new(down));
    info.upstream = Some(upstream(
        "inbound-vip|9080|http|reviews.default.svc.cluster.local",
        Some(("reviews.default.svc.cluster.local", "reviews", "default")),
    ));
    // The endpoint's metadata is not the waypoint's fallback: only exchanged metadata.
    info.upstream_workload =
        PeerInfo::from_endpoint("reviews-v2;default;reviews;v2;Kubernetes").map(Arc::new);
    store.record_http(&cfg, &node, &info);
    let s = store.samples(Metric::RequestsTotal);
    let (l, _) = &s[0];
    for (k, v) in [
        ("reporter", "waypoint"),
        ("source_workload", "web-v1"),
        ("source_canonical_service", "web"),
        ("source_canonical_revision", "v1"),
        ("source_workload_namespace", "frontend"),
        (
            "source_principal",
            "spiffe://cluster.local/ns/frontend/sa/web",
        ),
        ("source_app", "web"),
        ("source_version", "unknown"),
        ("destination_workload", "unknown"),
        ("destination_service", "reviews.default.svc.cluster.local"),
        ("destination_canonical_service", "unknown"),
        ("destination_service_name", "reviews"),
        ("destination_service_namespace", "istio-system"),
        ("destination_cluster", "Kubernetes"),
        ("connection_security_policy", "mutual_tls"),
    ] {
        assert_eq!(label(l, k), v, "{k}");
    }
}

/// The thread's memo of the last label set counts every request where making the labels
/// afresh would: requests that change one input of the labels at a time (and change it back),
/// two configs and two stores on one thread.
#[test]
fn the_memo_of_the_last_labels_counts_as_making_them_each_time() {
    let node = gateway_node();
    let fallback = Arc::new(StatsConfig::from_json(&json!({})).unwrap());
    let no_fallback =
        Arc::new(StatsConfig::from_json(&json!({"disable_host_header_fallback": true})).unwrap());
    let waypoint =
        Arc::new(StatsConfig::from_json(&json!({"reporter": "SERVER_GATEWAY"})).unwrap());
    let reviews = upstream(
        "outbound|9080||reviews.default.svc.cluster.local",
        Some(("reviews.default.svc.cluster.local", "reviews", "default")),
    );
    let ratings = upstream(
        "outbound|9080||ratings.default.svc.cluster.local",
        Some(("ratings.default.svc.cluster.local", "ratings", "default")),
    );
    let v1 = PeerInfo::from_endpoint("reviews-v1;default;reviews;v1;Kubernetes").map(Arc::new);
    let v2 = PeerInfo::from_endpoint("reviews-v2;default;reviews;v2;Kubernetes").map(Arc::new);
    let base = |cfg: &StatsConfig| {
        let mut info = StreamInfo::new(Protocol::Http11);
        info.response_code = 200;
        info.upstream = Some(reviews.clone());
        info.upstream_workload = v1.clone();
        info.bytes_sent = 120;
        // A fixed duration: the two stores record one request a moment apart, and a request
        // still open is as long as the time since it started (a millisecond boundary between
        // the two puts them in different buckets).
        info.last_downstream_tx = Some(std::time::Duration::from_millis(3));
        info.istio_attributes = vec![None; cfg.captures.len()];
        info
    };
    type Change = Box<dyn Fn(&mut StreamInfo, &StatsConfig)>;
    let changes: Vec<(&str, Change)> = vec![
        ("none", Box::new(|_: &mut StreamInfo, _: &StatsConfig| {})),
        (
            "code",
            Box::new(|i: &mut StreamInfo, _: &StatsConfig| i.response_code = 503),
        ),
        (
            "flags",
            Box::new(|i: &mut StreamInfo, _: &StatsConfig| {
                i.flags.set(ResponseFlag::NoHealthyUpstream)
            }),
        ),
        (
            "protocol",
            Box::new(|i: &mut StreamInfo, _: &StatsConfig| i.protocol = Protocol::Http2),
        ),
        (
            "grpc",
            Box::new(|i: &mut StreamInfo, _: &StatsConfig| {
                i.grpc_request = true;
                i.grpc_status = Some(14);
            }),
        ),
        ("cluster", {
            let r = ratings.clone();
            Box::new(move |i: &mut StreamInfo, _: &StatsConfig| i.upstream = Some(r.clone()))
        }),
        (
            "no cluster",
            Box::new(|i: &mut StreamInfo, _: &StatsConfig| i.upstream = None),
        ),
        ("workload", {
            let w = v2.clone();
            Box::new(move |i: &mut StreamInfo, _: &StatsConfig| i.upstream_workload = w.clone())
        }),
        ("upstream peer", {
            let w = v2.clone();
            Box::new(move |i: &mut StreamInfo, _: &StatsConfig| i.peers.upstream = w.clone())
        }),
        ("downstream peer", {
            let w = v2.clone();
            Box::new(move |i: &mut StreamInfo, _: &StatsConfig| i.peers.downstream = w.clone())
        }),
        (
            "route",
            Box::new(|i: &mut StreamInfo, _: &StatsConfig| {
                i.route_name = Some(Arc::from("block_all"))
            }),
        ),
        (
            "san",
            Box::new(|i: &mut StreamInfo, _: &StatsConfig| {
                i.downstream_peer_uri_san = Some(Arc::from("spiffe://cluster.local/ns/a/sa/b"))
            }),
        ),
        (
            "host",
            Box::new(|i: &mut StreamInfo, c: &StatsConfig| {
                if let Some(h) = c.host_capture {
                    i.istio_attributes[h] = Some("other.example.com".to_string());
                }
            }),
        ),
        (
            "no cluster, host",
            Box::new(|i: &mut StreamInfo, c: &StatsConfig| {
                i.upstream = None;
                if let Some(h) = c.host_capture {
                    i.istio_attributes[h] = Some("bookinfo.example.com".to_string());
                }
            }),
        ),
    ];
    let render = |store: &Store| {
        let mut counters = Vec::new();
        store.collect(&node, &mut |_, name, metric, labels, v| {
            counters.push((name, metric, labels, v))
        });
        let mut histograms = String::new();
        store.prometheus_histograms(&mut histograms);
        (counters, histograms)
    };
    let run = |ours: &Store, reference: &Store| {
        for cfg in [&fallback, &no_fallback, &waypoint, &fallback] {
            for (what, change) in &changes {
                // The changed request between two plain ones, twice: each input changes and
                // changes back. The reference makes the labels each time (and leaves the
                // thread's memo alone).
                for _ in 0..2 {
                    for changed in [false, true, false] {
                        let mut info = base(cfg);
                        if changed {
                            change(&mut info, cfg);
                        }
                        ours.record_http_with(cfg, &node, &info, true);
                        reference.record_http_with(cfg, &node, &info, false);
                    }
                }
                assert_eq!(render(ours), render(reference), "after {what}");
            }
        }
    };
    run(&Store::new(), &Store::new());
    // Without the cluster's `istio` metadata the service is the Host: requests that differ
    // only in it, one after the other.
    let (ours, reference) = (Store::new(), Store::new());
    for host in [
        "a.example.com",
        "b.example.com",
        "b.example.com",
        "a.example.com",
    ] {
        let mut info = base(&fallback);
        info.upstream = None;
        if let Some(h) = fallback.host_capture {
            info.istio_attributes[h] = Some(host.to_string());
        }
        ours.record_http_with(&fallback, &node, &info, true);
        reference.record_http_with(&fallback, &node, &info, false);
    }
    assert_eq!(render(&ours), render(&reference), "hosts");
    // A store made after another on the same thread does not count into the first's series.
    let (first, second) = (Store::new(), Store::new());
    let info = base(&fallback);
    first.record_http_with(&fallback, &node, &info, true);
    second.record_http_with(&fallback, &node, &info, true);
    first.record_http_with(&fallback, &node, &info, true);
    let reference = Store::new();
    reference.record_http_with(&fallback, &node, &info, false);
    assert_eq!(render(&second), render(&reference));
    reference.record_http_with(&fallback, &node, &info, false);
    assert_eq!(render(&first), render(&reference));
}
