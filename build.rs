//! Copies the FileDescriptorSet that envoy-types ships (but does not export) into OUT_DIR, so that
//! `protojson` can turn proto-JSON (bootstrap files, /config_dump) into prost messages and back.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use prost::Message;
use prost_reflect::prost_types::field_descriptor_proto::{Label, Type};
use prost_reflect::prost_types::{DescriptorProto, FieldDescriptorProto, FileDescriptorProto};
use prost_reflect::{DescriptorPool, DynamicMessage, Value};

/// Must match the envoy-types version in Cargo.toml: the registry search looks for exactly this
/// directory so that a stale copy of another version in the cache can never be picked up.
const ENVOY_TYPES_VERSION: &str = "0.7.7";
const DESCRIPTORS_IN_CRATE: &str = "src/generated/types.bin";
const OVERRIDE_VAR: &str = "PORTICO_ENVOY_DESCRIPTORS";
const OUT_NAME: &str = "envoy_descriptors.bin";

/// Messages that proto-JSON decoding of real bootstraps and xDS resources needs: the well-known
/// types have their own JSON mapping, and Istio writes TypedStruct (both the udpa and xds flavours)
/// inside Any. If a future envoy-types drops any of them, failing here beats a runtime surprise.
const REQUIRED_MESSAGES: &[&str] = &[
    "envoy.config.bootstrap.v3.Bootstrap",
    "envoy.config.cluster.v3.Cluster",
    "envoy.config.listener.v3.Listener",
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
    "google.protobuf.Any",
    "google.protobuf.Duration",
    "google.protobuf.Timestamp",
    "google.protobuf.Struct",
    "google.protobuf.Value",
    "google.protobuf.ListValue",
    "google.protobuf.FieldMask",
    "google.protobuf.Empty",
    "google.protobuf.BoolValue",
    "google.protobuf.UInt32Value",
    "google.protobuf.UInt64Value",
    "google.protobuf.DoubleValue",
    "google.protobuf.StringValue",
    "udpa.type.v1.TypedStruct",
    "xds.type.v3.TypedStruct",
    "envoy.tcp.metadataexchange.config.MetadataExchange",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed={OVERRIDE_VAR}");
    println!("cargo:rerun-if-env-changed=CARGO_HOME");
    println!("cargo:rerun-if-env-changed=HOME");

    check_locked_version();

    let source = match locate() {
        Ok(path) => path,
        Err(tried) => fail(&format!(
            "cannot find the Envoy descriptor set shipped by envoy-types {ENVOY_TYPES_VERSION} \
             ({DESCRIPTORS_IN_CRATE} inside that crate).\n  tried:\n    {}\n  \
             set {OVERRIDE_VAR}=/path/to/envoy-types-{ENVOY_TYPES_VERSION}/{DESCRIPTORS_IN_CRATE} to point at it",
            tried.join("\n    ")
        )),
    };
    println!("cargo:rerun-if-changed={}", source.display());

    let shipped = fs::read(&source)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", source.display())));
    let bytes = prepare(&source, &shipped);

    let out_dir =
        PathBuf::from(env::var_os("OUT_DIR").unwrap_or_else(|| fail("OUT_DIR is not set")));
    let dest = out_dir.join(OUT_NAME);
    // Only rewrite on change so the include_bytes! consumer is not rebuilt needlessly.
    if fs::read(&dest).ok().as_deref() != Some(&bytes[..]) {
        fs::write(&dest, &bytes)
            .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", dest.display())));
    }
}

/// A bumped envoy-types with this constant left behind would silently embed the old version's
/// descriptors whenever the old crate is still in the registry cache; the lock file tells.
fn check_locked_version() {
    let Some(dir) = env::var_os("CARGO_MANIFEST_DIR") else {
        return;
    };
    let lock = Path::new(&dir).join("Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    // Absent when Portico is built as a dependency of another workspace; nothing to compare.
    let Ok(text) = fs::read_to_string(&lock) else {
        return;
    };
    let mut lines = text.lines();
    let mut locked = Vec::new();
    while let Some(line) = lines.next() {
        if line.trim() == "name = \"envoy-types\"" {
            if let Some(version) = lines
                .next()
                .and_then(|l| l.trim().strip_prefix("version = \""))
                .and_then(|v| v.strip_suffix('"'))
            {
                locked.push(version.to_owned());
            }
        }
    }
    if !locked.is_empty() && !locked.iter().any(|v| v == ENVOY_TYPES_VERSION) {
        fail(&format!(
            "Cargo.lock has envoy-types {} but build.rs expects {ENVOY_TYPES_VERSION}: \
             update ENVOY_TYPES_VERSION in build.rs",
            locked.join(", ")
        ));
    }
}

/// Returns the descriptor file, or the list of places looked at.
fn locate() -> Result<PathBuf, Vec<String>> {
    let mut tried = Vec::new();

    // An explicit override wins and must be right: silently falling back would hide a typo.
    if let Some(path) = env::var_os(OVERRIDE_VAR) {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        fail(&format!(
            "{OVERRIDE_VAR}={} does not name a readable file",
            path.display()
        ));
    }

    // The registry cache is the common case and needs no subprocess.
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    match cargo_home {
        Some(home) => {
            let src = home.join("registry").join("src");
            tried.push(format!(
                "{}/*/envoy-types-{ENVOY_TYPES_VERSION}/{DESCRIPTORS_IN_CRATE}",
                src.display()
            ));
            if let Some(found) = search_registry(&src) {
                return Ok(found);
            }
        }
        None => tried.push("registry cache: neither CARGO_HOME nor HOME is set".to_owned()),
    }

    // Vendored sources, git or path dependencies: ask cargo where the package lives.
    match from_cargo_metadata() {
        Ok(path) if path.is_file() => return Ok(path),
        Ok(path) => tried.push(format!("cargo metadata: {} (missing)", path.display())),
        Err(why) => tried.push(format!("cargo metadata: {why}")),
    }
    Err(tried)
}

fn search_registry(src: &Path) -> Option<PathBuf> {
    let mut registries: Vec<PathBuf> = fs::read_dir(src)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    // Deterministic choice when several registry mirrors hold the same crate (identical contents).
    registries.sort();
    registries
        .into_iter()
        .map(|r| {
            r.join(format!("envoy-types-{ENVOY_TYPES_VERSION}"))
                .join(DESCRIPTORS_IN_CRATE)
        })
        .find(|p| p.is_file())
}

fn from_cargo_metadata() -> Result<PathBuf, String> {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest_dir = env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR is not set")?;
    // --offline: the outer build already resolved and fetched everything, and a build script
    // must not touch the network.
    let output = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--offline"])
        .current_dir(&manifest_dir)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", Path::new(&cargo).display()))?;
    if !output.status.success() {
        // The first lines carry cargo's error; the rest can be a long backtrace.
        let stderr = String::from_utf8_lossy(&output.stderr);
        let head: Vec<&str> = stderr
            .lines()
            .filter(|l| !l.trim().is_empty())
            .take(3)
            .collect();
        return Err(format!(
            "exited with {}: {}",
            output.status,
            head.join(" / ")
        ));
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| format!("unreadable output: {e}"))?;
    let packages = meta["packages"].as_array().ok_or("no packages in output")?;
    let manifest = packages
        .iter()
        .find(|p| p["name"] == "envoy-types" && p["version"] == ENVOY_TYPES_VERSION)
        .and_then(|p| p["manifest_path"].as_str())
        .ok_or_else(|| {
            format!("no envoy-types {ENVOY_TYPES_VERSION} package in the dependency graph")
        })?;
    let dir = Path::new(manifest)
        .parent()
        .ok_or("envoy-types manifest_path has no parent directory")?;
    Ok(dir.join(DESCRIPTORS_IN_CRATE))
}

/// Turns the shipped set into the one Portico embeds: without source comments, plus the files
/// envoy-types leaves out, checked to contain every message Portico relies on.
fn prepare(source: &Path, shipped: &[u8]) -> Vec<u8> {
    let stripped = strip_source_code_info(shipped).unwrap_or_else(|e| {
        fail(&format!(
            "{} is not a valid FileDescriptorSet: {e}",
            source.display()
        ))
    });
    let mut pool = DescriptorPool::decode(stripped.as_slice()).unwrap_or_else(|e| {
        fail(&format!(
            "{} is not a valid FileDescriptorSet: {e}",
            source.display()
        ))
    });

    // envoy-types only ships the files its generated code imports, so some well-known types
    // (FieldMask, ...) are absent although Envoy configs use them; prost-reflect carries them all.
    let global = DescriptorPool::global();
    let wkt: Vec<FileDescriptorProto> = global
        .files()
        .filter(|f| pool.get_file_by_name(f.name()).is_none())
        .map(|f| f.file_descriptor_proto().clone())
        .collect();
    pool.add_file_descriptor_protos(wkt)
        .unwrap_or_else(|e| fail(&format!("cannot add the well-known types: {e}")));
    let typed_structs: Vec<FileDescriptorProto> = [
        ("udpa/type/v1/typed_struct.proto", "udpa.type.v1"),
        ("xds/type/v3/typed_struct.proto", "xds.type.v3"),
    ]
    .into_iter()
    .filter(|(file, _)| pool.get_file_by_name(file).is_none())
    .map(|(file, package)| typed_struct_file(file, package))
    .collect();
    pool.add_file_descriptor_protos(typed_structs)
        .unwrap_or_else(|e| fail(&format!("cannot add TypedStruct: {e}")));
    let istio: Vec<FileDescriptorProto> = istio_listener_filter_files()
        .into_iter()
        .filter(|f| pool.get_file_by_name(f.name()).is_none())
        .collect();
    pool.add_file_descriptor_protos(istio)
        .unwrap_or_else(|e| fail(&format!("cannot add Istio's listener filter types: {e}")));

    let missing: Vec<&str> = REQUIRED_MESSAGES
        .iter()
        .copied()
        .filter(|name| pool.get_message_by_name(name).is_none())
        .collect();
    if !missing.is_empty() {
        fail(&format!(
            "{} lacks messages Portico needs: {}",
            source.display(),
            missing.join(", ")
        ));
    }
    pool.encode_to_vec()
}

/// Source comments are 80% of the shipped bytes and, once decoded, about 30 MB of resident
/// memory that JSON conversion never reads. Going through DynamicMessage (not prost-types)
/// keeps the custom options such as `udpa.annotations.sensitive` byte for byte, as unknown fields.
fn strip_source_code_info(bytes: &[u8]) -> Result<Vec<u8>, prost::DecodeError> {
    let set_desc = DescriptorPool::global()
        .get_message_by_name("google.protobuf.FileDescriptorSet")
        .unwrap_or_else(|| fail("prost-reflect lacks google.protobuf.FileDescriptorSet"));
    let mut set = DynamicMessage::decode(set_desc, bytes)?;
    if let Some(Value::List(files)) = set.get_field_by_name_mut("file") {
        for file in files {
            if let Value::Message(file) = file {
                file.clear_field_by_name("source_code_info");
            }
        }
    }
    Ok(set.encode_to_vec())
}

/// `TypedStruct` as defined by cncf/xds (udpa/type/v1 and xds/type/v3 hold the same message):
/// Istio puts it inside `Any` in bootstraps and listeners, but envoy-types does not ship it.
fn typed_struct_file(file: &str, package: &str) -> FileDescriptorProto {
    let field = |name: &str, json: &str, number: i32, kind: Type, type_name: Option<&str>| {
        FieldDescriptorProto {
            name: Some(name.to_owned()),
            json_name: Some(json.to_owned()),
            number: Some(number),
            label: Some(Label::Optional as i32),
            r#type: Some(kind as i32),
            type_name: type_name.map(str::to_owned),
            ..Default::default()
        }
    };
    FileDescriptorProto {
        name: Some(file.to_owned()),
        package: Some(package.to_owned()),
        dependency: vec!["google/protobuf/struct.proto".to_owned()],
        message_type: vec![DescriptorProto {
            name: Some("TypedStruct".to_owned()),
            field: vec![
                field("type_url", "typeUrl", 1, Type::String, None),
                field(
                    "value",
                    "value",
                    2,
                    Type::Message,
                    Some(".google.protobuf.Struct"),
                ),
            ],
            ..Default::default()
        }],
        syntax: Some("proto3".to_owned()),
        ..Default::default()
    }
}

/// Istio's own listener and HTTP filter configs, which istiod puts inside `Any` on gateway and
/// sidecar listeners and which envoy-types does not ship: without them a listener holding one
/// cannot be read from proto-JSON (config dumps, bootstraps). Field numbers and names are
/// istio/proxy's (`source/extensions/filters/http/istio_stats/config.proto`,
/// `.../http/peer_metadata/config.proto`,
/// `.../network/metadata_exchange/config/metadata_exchange.proto`) and istio/api's
/// (`envoy/config/filter/http/alpn/v2alpha1/config.proto`). Only messages and fields; options
/// and comments are left out.
fn istio_listener_filter_files() -> Vec<FileDescriptorProto> {
    use prost_reflect::prost_types::{
        EnumDescriptorProto, EnumValueDescriptorProto, MessageOptions, OneofDescriptorProto,
    };
    fn f(
        name: &str,
        number: i32,
        label: Label,
        kind: Type,
        type_name: Option<&str>,
    ) -> FieldDescriptorProto {
        FieldDescriptorProto {
            name: Some(name.to_owned()),
            json_name: Some(json_name(name)),
            number: Some(number),
            label: Some(label as i32),
            r#type: Some(kind as i32),
            type_name: type_name.map(str::to_owned),
            ..Default::default()
        }
    }
    fn json_name(name: &str) -> String {
        let mut out = String::new();
        let mut upper = false;
        for c in name.chars() {
            if c == '_' {
                upper = true;
            } else if upper {
                out.extend(c.to_uppercase());
                upper = false;
            } else {
                out.push(c);
            }
        }
        out
    }
    fn message(name: &str, field: Vec<FieldDescriptorProto>) -> DescriptorProto {
        DescriptorProto {
            name: Some(name.to_owned()),
            field,
            ..Default::default()
        }
    }
    fn enumeration(name: &str, values: &[(&str, i32)]) -> EnumDescriptorProto {
        EnumDescriptorProto {
            name: Some(name.to_owned()),
            value: values
                .iter()
                .map(|(n, v)| EnumValueDescriptorProto {
                    name: Some((*n).to_owned()),
                    number: Some(*v),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }
    fn oneof_member(mut fd: FieldDescriptorProto, index: i32) -> FieldDescriptorProto {
        fd.oneof_index = Some(index);
        fd
    }
    fn file(
        name: &str,
        package: &str,
        dependency: &[&str],
        message_type: Vec<DescriptorProto>,
        enum_type: Vec<EnumDescriptorProto>,
    ) -> FileDescriptorProto {
        FileDescriptorProto {
            name: Some(name.to_owned()),
            package: Some(package.to_owned()),
            dependency: dependency.iter().map(|d| (*d).to_owned()).collect(),
            message_type,
            enum_type,
            syntax: Some("proto3".to_owned()),
            ..Default::default()
        }
    }
    use Label::{Optional as One, Repeated as Many};

    // istio.stats: `stats.PluginConfig`.
    let mut dimensions_entry = message(
        "DimensionsEntry",
        vec![
            f("key", 1, One, Type::String, None),
            f("value", 2, One, Type::String, None),
        ],
    );
    dimensions_entry.options = Some(MessageOptions {
        map_entry: Some(true),
        ..Default::default()
    });
    let mut metric_config = message(
        "MetricConfig",
        vec![
            f(
                "dimensions",
                1,
                Many,
                Type::Message,
                Some(".stats.MetricConfig.DimensionsEntry"),
            ),
            f("name", 2, One, Type::String, None),
            f("tags_to_remove", 3, Many, Type::String, None),
            f("match", 4, One, Type::String, None),
            f("drop", 5, One, Type::Bool, None),
        ],
    );
    metric_config.nested_type = vec![dimensions_entry];
    let duration = Some(".google.protobuf.Duration");
    let stats = file(
        "istio/stats/config.proto",
        "stats",
        &["google/protobuf/duration.proto"],
        vec![
            metric_config,
            message(
                "MetricDefinition",
                vec![
                    f("name", 1, One, Type::String, None),
                    f("value", 2, One, Type::String, None),
                    f("type", 3, One, Type::Enum, Some(".stats.MetricType")),
                ],
            ),
            message(
                "PluginConfig",
                vec![
                    f("disable_host_header_fallback", 6, One, Type::Bool, None),
                    f("tcp_reporting_duration", 7, One, Type::Message, duration),
                    f(
                        "metrics",
                        8,
                        Many,
                        Type::Message,
                        Some(".stats.MetricConfig"),
                    ),
                    f(
                        "definitions",
                        9,
                        Many,
                        Type::Message,
                        Some(".stats.MetricDefinition"),
                    ),
                    f("reporter", 10, One, Type::Enum, Some(".stats.Reporter")),
                    f("rotation_interval", 11, One, Type::Message, duration),
                    f(
                        "graceful_deletion_interval",
                        12,
                        One,
                        Type::Message,
                        duration,
                    ),
                ],
            ),
        ],
        vec![
            enumeration(
                "MetricType",
                &[("COUNTER", 0), ("GAUGE", 1), ("HISTOGRAM", 2)],
            ),
            enumeration("Reporter", &[("UNSPECIFIED", 0), ("SERVER_GATEWAY", 1)]),
        ],
    );

    // istio.metadata_exchange (network): `envoy.tcp.metadataexchange.config.MetadataExchange`.
    let mx = file(
        "envoy/tcp/metadataexchange/config/metadata_exchange.proto",
        "envoy.tcp.metadataexchange.config",
        &[],
        vec![message(
            "MetadataExchange",
            vec![
                f("protocol", 1, One, Type::String, None),
                f("enable_discovery", 2, One, Type::Bool, None),
                f("additional_labels", 3, Many, Type::String, None),
            ],
        )],
        vec![],
    );

    // istio.metadata_exchange (HTTP, 1.22+): `io.istio.http.peer_metadata.Config`.
    let pm = ".io.istio.http.peer_metadata.Config";
    let mut discovery = message(
        "DiscoveryMethod",
        vec![
            oneof_member(
                f(
                    "baggage",
                    1,
                    One,
                    Type::Message,
                    Some(&format!("{pm}.Baggage")),
                ),
                0,
            ),
            oneof_member(
                f(
                    "workload_discovery",
                    2,
                    One,
                    Type::Message,
                    Some(&format!("{pm}.WorkloadDiscovery")),
                ),
                0,
            ),
            oneof_member(
                f(
                    "istio_headers",
                    3,
                    One,
                    Type::Message,
                    Some(&format!("{pm}.IstioHeaders")),
                ),
                0,
            ),
        ],
    );
    discovery.oneof_decl = vec![OneofDescriptorProto {
        name: Some("method_specifier".to_owned()),
        ..Default::default()
    }];
    let mut propagation = message(
        "PropagationMethod",
        vec![oneof_member(
            f(
                "istio_headers",
                1,
                One,
                Type::Message,
                Some(&format!("{pm}.IstioHeaders")),
            ),
            0,
        )],
    );
    propagation.oneof_decl = discovery.oneof_decl.clone();
    let mut config = message(
        "Config",
        vec![
            f(
                "downstream_discovery",
                1,
                Many,
                Type::Message,
                Some(&format!("{pm}.DiscoveryMethod")),
            ),
            f(
                "upstream_discovery",
                2,
                Many,
                Type::Message,
                Some(&format!("{pm}.DiscoveryMethod")),
            ),
            f(
                "downstream_propagation",
                3,
                Many,
                Type::Message,
                Some(&format!("{pm}.PropagationMethod")),
            ),
            f(
                "upstream_propagation",
                4,
                Many,
                Type::Message,
                Some(&format!("{pm}.PropagationMethod")),
            ),
            f("shared_with_upstream", 5, One, Type::Bool, None),
            f("additional_labels", 6, Many, Type::String, None),
        ],
    );
    config.nested_type = vec![
        message("Baggage", vec![]),
        message("WorkloadDiscovery", vec![]),
        message(
            "IstioHeaders",
            vec![f("skip_external_clusters", 1, One, Type::Bool, None)],
        ),
        discovery,
        propagation,
    ];
    let peer_metadata = file(
        "istio/peer_metadata/config.proto",
        "io.istio.http.peer_metadata",
        &[],
        vec![config],
        vec![],
    );

    // istio.alpn: `istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig`.
    let alpn_pkg = ".istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig";
    let mut filter_config = message(
        "FilterConfig",
        vec![f(
            "alpn_override",
            1,
            Many,
            Type::Message,
            Some(&format!("{alpn_pkg}.AlpnOverride")),
        )],
    );
    filter_config.nested_type = vec![message(
        "AlpnOverride",
        vec![
            f(
                "upstream_protocol",
                1,
                One,
                Type::Enum,
                Some(&format!("{alpn_pkg}.Protocol")),
            ),
            f("alpn_override", 2, Many, Type::String, None),
        ],
    )];
    filter_config.enum_type = vec![enumeration(
        "Protocol",
        &[("HTTP10", 0), ("HTTP11", 1), ("HTTP2", 2)],
    )];
    let alpn = file(
        "envoy/config/filter/http/alpn/v2alpha1/config.proto",
        "istio.envoy.config.filter.http.alpn.v2alpha1",
        &[],
        vec![filter_config],
        vec![],
    );
    vec![stats, mx, peer_metadata, alpn]
}

fn fail(msg: &str) -> ! {
    // cargo:warning keeps the message visible even when cargo truncates the panic output.
    for line in msg.lines() {
        println!("cargo:warning={line}");
    }
    panic!("portico build script: {msg}");
}
