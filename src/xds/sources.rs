//! The files and environment variables xDS resources name (`DataSource.filename`,
//! `environment_variable`): read here, at the edge, and handed to translation, which
//! stays pure (see `snapshot::sources`).

use std::fmt;
use std::io;
use std::sync::Arc;

use crate::snapshot::sources::DataSources;

/// This machine's files and this process's environment, as Envoy reads them when it loads a
/// resource.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalSources;

impl DataSources for LocalSources {
    fn file(&self, path: &str) -> io::Result<Vec<u8>> {
        std::fs::read(path)
    }

    fn env(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

/// The sources a store translates with: the local ones unless a test or tool supplies its own.
#[derive(Clone)]
pub struct Sources(pub Arc<dyn DataSources + Send + Sync>);

impl Sources {
    pub fn new(src: impl DataSources + Send + Sync + 'static) -> Sources {
        Sources(Arc::new(src))
    }
}

impl Default for Sources {
    fn default() -> Sources {
        Sources::new(LocalSources)
    }
}

impl fmt::Debug for Sources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Sources")
    }
}

impl std::ops::Deref for Sources {
    type Target = dyn DataSources + Send + Sync;
    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}
