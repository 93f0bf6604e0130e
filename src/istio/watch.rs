//! Watches the config directory and publishes each changed config as a new generation.
//!
//! Polling, not inotify: dependency-free, works on every filesystem (bind mounts, NFS,
//! Kubernetes ConfigMap symlink swaps), and a 200 ms lag is nothing next to istiod's own
//! debounce of 100 ms..10 s.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::server::{labels_text, push_version, ControlPlane, Generation};
use super::{Config, Invalid, NodeInfo, Options};

const POLL: Duration = Duration::from_millis(200);
/// Editors and `kubectl cp`-style tools write a file in several steps; reloading only once
/// the directory has been still this long avoids serving (and logging) a half-written file.
const QUIET: Duration = Duration::from_millis(100);

/// (modification time, length) of each config file: cheap to take, and any edit changes it.
pub type Fingerprint = BTreeMap<PathBuf, (Option<SystemTime>, u64)>;

/// The config files of `dir` as [`super::load_dir`] reads them, with their fingerprint.
pub fn fingerprint(dir: &Path) -> std::io::Result<Fingerprint> {
    let mut fp = Fingerprint::new();
    for entry in std::fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        let path = entry.path();
        if !matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml" | "json")
        ) {
            continue;
        }
        // Follows symlinks, as load_dir does when it reads the file.
        if let Ok(meta) = std::fs::metadata(&path) {
            if meta.is_file() {
                fp.insert(path, (meta.modified().ok(), meta.len()));
            }
        }
    }
    Ok(fp)
}

/// The gateway the reload summary describes when none has connected yet: the labels of
/// istio's default ingress gateway.
pub fn default_gateway() -> NodeInfo {
    NodeInfo {
        id: String::new(),
        labels: BTreeMap::from([("istio".to_string(), "ingressgateway".to_string())]),
        namespace: Some("istio-system".into()),
    }
}

/// The directory being served: what was loaded last and how the files looked then.
#[derive(Debug)]
pub struct DirWatch {
    dir: PathBuf,
    options: Options,
    seen: Fingerprint,
    config: Config,
    reloads: u64,
    /// The directory could not be listed at the last poll (already reported).
    unreadable: bool,
}

impl DirWatch {
    /// Loads `dir` for the first time; the generation to serve until something changes.
    pub fn open(dir: &Path, options: Options) -> std::io::Result<(DirWatch, Generation)> {
        let seen = fingerprint(dir)?;
        let (config, invalid) = super::load_dir(dir)?;
        let mut watch = DirWatch {
            dir: dir.to_path_buf(),
            options,
            seen,
            config: Config::default(),
            reloads: 0,
            unreadable: false,
        };
        let generation = watch.next_generation(config.clone());
        watch.config = config;
        log_reload(&generation, watch.config.objects.len(), &invalid, &[]);
        Ok((watch, generation))
    }

    /// Polls until the control plane stops, publishing every config that differs from the
    /// one served.
    pub async fn run(self, cp: ControlPlane) {
        tokio::select! {
            () = self.poll(&cp) => {}
            () = cp.stopped() => {}
        }
    }

    async fn poll(mut self, cp: &ControlPlane) {
        loop {
            tokio::time::sleep(POLL).await;
            if !self.settle().await {
                continue;
            }
            let nodes = cp.nodes();
            // Reading and translating are blocking work; the streams keep being served.
            let reloaded = tokio::task::spawn_blocking(move || {
                let result = self.reload(&nodes);
                (self, result)
            })
            .await;
            let result = match reloaded {
                Ok((back, result)) => {
                    self = back;
                    result
                }
                Err(e) => {
                    tracing::error!("config reload failed, no more reloads: {e}");
                    return;
                }
            };
            match result {
                Ok(Some(generation)) => cp.publish(generation),
                Ok(None) => {}
                Err(e) => tracing::warn!(
                    dir = %self.dir.display(),
                    "cannot read the config directory, still serving version {}: {e}",
                    cp.current().version
                ),
            }
        }
    }

    /// True once the files differ from the last load and have stopped changing.
    async fn settle(&mut self) -> bool {
        let Ok(mut now) = fingerprint(&self.dir) else {
            // Let reload() report it, once: the last good config keeps serving meanwhile.
            return !std::mem::replace(&mut self.unreadable, true);
        };
        self.unreadable = false;
        if now == self.seen {
            return false;
        }
        loop {
            tokio::time::sleep(QUIET).await;
            match fingerprint(&self.dir) {
                Ok(next) if next == now => return true,
                Ok(next) => now = next,
                Err(_) => return true,
            }
        }
    }

    /// Reads the directory again. A new generation if the objects changed; None if the
    /// edit changed nothing the gateways see (comments, reordering of files, a still broken
    /// object), in which case the served version stays.
    fn reload(&mut self, nodes: &[NodeInfo]) -> std::io::Result<Option<Generation>> {
        let seen = fingerprint(&self.dir)?;
        let (config, invalid) = super::load_dir(&self.dir)?;
        self.seen = seen;
        if config == self.config {
            for i in &invalid {
                tracing::warn!("invalid: {i}");
            }
            tracing::info!(
                objects = config.objects.len(),
                invalid = invalid.len(),
                "config files changed, objects did not: nothing to push"
            );
            return Ok(None);
        }
        let generation = self.next_generation(config.clone());
        self.config = config;
        log_reload(&generation, self.config.objects.len(), &invalid, nodes);
        Ok(Some(generation))
    }

    fn next_generation(&mut self, config: Config) -> Generation {
        self.reloads += 1;
        Generation::from_config(push_version(self.reloads), config, self.options.clone())
    }
}

/// One warning per object left out, then one line per kind of connected gateway (or istio's
/// default gateway before any connects) with what it now gets.
fn log_reload(generation: &Generation, objects: usize, invalid: &[Invalid], nodes: &[NodeInfo]) {
    for i in invalid {
        tracing::warn!("invalid: {i}");
    }
    let default = [default_gateway()];
    let nodes = if nodes.is_empty() {
        &default[..]
    } else {
        nodes
    };
    for node in nodes {
        let xds = generation.xds_for(node);
        tracing::info!(
            "config version {}: {objects} objects ({} invalid); gateway {}: {} listeners, {} routes, {} clusters, {} endpoints",
            generation.version,
            invalid.len(),
            labels_text(&node.labels),
            xds.listeners.len(),
            xds.routes.len(),
            xds.clusters.len(),
            xds.endpoints.len(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "portico-watch-{tag}-{}-{:?}",
            std::process::id(),
            SystemTime::now()
        ));
        std::fs::create_dir_all(&d).expect("temp dir");
        d
    }

    const SERVICE: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: default}\nspec: {ports: [{port: 9080}]}\n";

    #[test]
    fn fingerprint_sees_config_files_only() {
        let d = temp_dir("fp");
        std::fs::write(d.join("a.yaml"), SERVICE).expect("write");
        std::fs::write(d.join("notes.txt"), "x").expect("write");
        std::fs::create_dir_all(d.join("sub.yaml")).expect("mkdir");
        let fp = fingerprint(&d).expect("fingerprint");
        assert_eq!(
            fp.keys().cloned().collect::<Vec<_>>(),
            vec![d.join("a.yaml")]
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn reload_publishes_only_changed_objects() {
        let d = temp_dir("reload");
        std::fs::write(d.join("a.yaml"), SERVICE).expect("write");
        let (mut w, first) = DirWatch::open(&d, Options::default()).expect("open");
        assert!(first.version.ends_with("/1"), "{}", first.version);
        // A comment changes the file, not the objects: no new version.
        std::fs::write(d.join("a.yaml"), format!("# note\n{SERVICE}")).expect("write");
        assert!(w.reload(&[]).expect("reload").is_none());
        std::fs::write(d.join("a.yaml"), SERVICE.replace("9080", "9081")).expect("write");
        let next = w.reload(&[]).expect("reload").expect("a new generation");
        assert!(next.version.ends_with("/2"), "{}", next.version);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[tokio::test]
    async fn settle_waits_for_a_change_to_go_quiet() {
        let d = temp_dir("settle");
        std::fs::write(d.join("a.yaml"), SERVICE).expect("write");
        let (mut w, _) = DirWatch::open(&d, Options::default()).expect("open");
        assert!(!w.settle().await, "nothing changed");
        std::fs::write(d.join("b.yaml"), SERVICE).expect("write");
        assert!(w.settle().await, "a new file is a change");
        let _ = std::fs::remove_dir_all(&d);
    }
}
