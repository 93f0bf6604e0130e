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
    if pool.get_file_by_name(METADATA_EXCHANGE_FILE).is_none() {
        pool.add_file_descriptor_proto(metadata_exchange_file())
            .unwrap_or_else(|e| fail(&format!("cannot add MetadataExchange: {e}")));
    }

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

const METADATA_EXCHANGE_FILE: &str = "envoy/tcp/metadataexchange/config/metadata_exchange.proto";

/// istio/proxy's `envoy.tcp.metadataexchange.config.MetadataExchange` (one field, `protocol`):
/// istiod puts it, unwrapped, on the `istio.metadata_exchange` filter of every cluster it sends
/// Istio 1.18 and earlier proxies, so their config dumps do not decode without it.
fn metadata_exchange_file() -> FileDescriptorProto {
    FileDescriptorProto {
        name: Some(METADATA_EXCHANGE_FILE.to_owned()),
        package: Some("envoy.tcp.metadataexchange.config".to_owned()),
        message_type: vec![DescriptorProto {
            name: Some("MetadataExchange".to_owned()),
            field: vec![FieldDescriptorProto {
                name: Some("protocol".to_owned()),
                json_name: Some("protocol".to_owned()),
                number: Some(1),
                label: Some(Label::Optional as i32),
                r#type: Some(Type::String as i32),
                ..Default::default()
            }],
            ..Default::default()
        }],
        syntax: Some("proto3".to_owned()),
        ..Default::default()
    }
}

fn fail(msg: &str) -> ! {
    // cargo:warning keeps the message visible even when cargo truncates the panic output.
    for line in msg.lines() {
        println!("cargo:warning={line}");
    }
    panic!("portico build script: {msg}");
}
