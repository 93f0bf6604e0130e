//! The layering the design promises, checked on the source tree: config, balancing, matching,
//! the HTTP filters and live state never reach up into the proxy, the admin, the xDS client or
//! the server; the xDS side never reaches into the proxy; and the lower modules do not import
//! the snapshot, so there are no cycles between them.

use std::path::{Path, PathBuf};

/// (files under `src/`, module paths they must not use, why)
const RULES: &[(&str, &[&str], &str)] = &[
    (
        "snapshot",
        &["proxy", "admin", "xds", "server", "health"],
        "translation and assembly read only their inputs",
    ),
    (
        "lb",
        &["proxy", "admin", "xds", "server", "snapshot"],
        "below the snapshot",
    ),
    (
        "filters",
        &[
            "proxy", "admin", "xds", "server", "snapshot", "router", "live",
        ],
        "below the snapshot",
    ),
    (
        "live",
        &["proxy", "admin", "xds", "server", "snapshot", "health"],
        "below the snapshot",
    ),
    (
        "telemetry",
        &[
            "proxy", "admin", "xds", "server", "snapshot", "router", "live",
        ],
        "below the snapshot: the request path hands it a record",
    ),
    (
        "matcher.rs",
        &[
            "proxy", "admin", "xds", "server", "snapshot", "router", "filters",
        ],
        "a leaf",
    ),
    (
        "units.rs",
        &[
            "proxy", "admin", "xds", "server", "snapshot", "lb", "filters",
        ],
        "a leaf",
    ),
    (
        "router.rs",
        &["proxy", "admin", "xds", "server"],
        "a pure function of table and request",
    ),
    (
        "xds",
        &["proxy"],
        "the commit point drives listeners through a trait",
    ),
];

fn files(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(p)
            .expect("readable source dir")
            .map(|e| e.expect("dir entry").path())
            .collect();
        entries.sort();
        for e in entries {
            files(&e, out);
        }
    } else if p.extension().is_some_and(|e| e == "rs") {
        out.push(p.to_path_buf());
    }
}

/// The code of a line, without its `//` comment (doc comments may name any module).
fn code(line: &str) -> &str {
    match line.find("//") {
        Some(i) => &line[..i],
        None => line,
    }
}

#[test]
fn layers_only_look_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut broken = Vec::new();
    for (dir, banned, why) in RULES {
        let mut found = Vec::new();
        files(&src.join(dir), &mut found);
        assert!(!found.is_empty(), "src/{dir} has no Rust files");
        for f in found {
            let text = std::fs::read_to_string(&f).expect("readable source");
            for (n, line) in text.lines().enumerate() {
                let line = code(line);
                for m in *banned {
                    if line.contains(&format!("crate::{m}::"))
                        || line.contains(&format!("crate::{m};"))
                        || line.contains(&format!("crate::{m}}}"))
                        || line.contains(&format!("crate::{{{m}"))
                    {
                        broken.push(format!(
                            "{}:{}: uses crate::{m} ({dir}: {why})",
                            f.strip_prefix(&src).unwrap_or(&f).display(),
                            n + 1
                        ));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "layering broken:\n{}", broken.join("\n"));
}

/// Translation reads no files and no environment (`snapshot::sources`): the edge does.
#[test]
fn the_snapshot_reads_no_files_or_environment() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut found = Vec::new();
    for dir in [
        "snapshot",
        "filters",
        "lb",
        "live",
        "router.rs",
        "matcher.rs",
        "units.rs",
    ] {
        files(&src.join(dir), &mut found);
    }
    let mut broken = Vec::new();
    for f in found {
        let name = f.to_string_lossy();
        if name.ends_with("_tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("readable source");
        // Unit tests inside a module may read fixtures; only the module's own code counts.
        let text = text.split("#[cfg(test)]").next().unwrap_or("");
        for (n, line) in text.lines().enumerate() {
            let line = code(line);
            for io in ["std::fs", "std::env", "File::open", "env::var"] {
                if line.contains(io) {
                    broken.push(format!("{name}:{}: {io}", n + 1));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "I/O below the edge:\n{}",
        broken.join("\n")
    );
}

/// `h1_session::OwnAt::get`'s premise: Portico makes custom sessions of two types only, its
/// own (whose address `OwnAt::of` takes as it is handed over) and the empty `()`. Unit tests
/// (a file's `mod tests`, the `_tests.rs` files) are left out.
#[test]
fn custom_sessions_are_own_sessions_or_empty() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let needle = "new_custom(";
    let mut found = Vec::new();
    let mut all = Vec::new();
    files(&src, &mut all);
    // The request path's code only: tests make sessions of their own (and this file's
    // expectations below name the calls they look for).
    let tests = |f: &PathBuf| f.to_string_lossy().ends_with("_tests.rs");
    for f in all.into_iter().filter(|f| !tests(f)) {
        let text = std::fs::read_to_string(&f).expect("readable source");
        let lines: Vec<&str> = text
            .lines()
            .map(code)
            .take_while(|l| l.trim() != "mod tests {")
            .collect();
        for (n, line) in lines.iter().enumerate() {
            if line.contains(needle) {
                let before = n.checked_sub(1).map_or("", |p| lines[p].trim());
                found.push((
                    f.strip_prefix(&src).unwrap_or(&f).display().to_string(),
                    before.to_string(),
                    line.trim().to_string(),
                ));
            }
        }
    }
    let at = |before: &str, line: &str| {
        (
            "proxy/h1.rs".to_string(),
            before.to_string(),
            line.to_string(),
        )
    };
    assert_eq!(
        found,
        [
            at(
                "ctx.own_at = OwnAt::of(&session);",
                "*s.downstream_session = ServerSession::new_custom(session);"
            ),
            at(
                ") -> Option<Box<Session>> {",
                "*s.downstream_session = ServerSession::new_custom(Box::new(()));"
            ),
        ],
        "a custom session of another kind breaks `OwnAt::get`"
    );
}
