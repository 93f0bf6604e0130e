//! Where translation gets the bytes a `config.core.v3.DataSource` names.
//!
//! Translation never touches the disk or the process environment: the caller supplies a
//! [`DataSources`] (the xDS store passes the real files and variables; tests pass a map). What
//! translation reads ends up in the snapshot as bytes, so nothing after it reads again.

use std::collections::HashMap;
use std::io;

use envoy_types::pb::envoy::config::core::v3 as corepb;

/// The files and environment variables a `DataSource` may name.
pub trait DataSources {
    /// The contents of the file at `path`.
    fn file(&self, path: &str) -> io::Result<Vec<u8>>;
    /// The value of variable `name` (None: unset or not Unicode).
    fn env(&self, name: &str) -> Option<String>;
}

/// No files and no variables: for what translation already read (every data source it
/// keeps is inline) and for tests of inline configs.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoFiles;

impl DataSources for NoFiles {
    fn file(&self, _path: &str) -> io::Result<Vec<u8>> {
        Err(io::Error::new(
            io::ErrorKind::NotFound,
            "files are read only when their resource is translated",
        ))
    }

    fn env(&self, _name: &str) -> Option<String> {
        None
    }
}

/// Files and variables held in memory (tests, tools).
#[derive(Debug, Clone, Default)]
pub struct MemorySources {
    pub files: HashMap<String, Vec<u8>>,
    pub env: HashMap<String, String>,
}

impl MemorySources {
    pub fn with_file(mut self, path: &str, contents: impl Into<Vec<u8>>) -> Self {
        self.files.insert(path.to_string(), contents.into());
        self
    }

    pub fn with_env(mut self, name: &str, value: &str) -> Self {
        self.env.insert(name.to_string(), value.to_string());
        self
    }
}

impl DataSources for MemorySources {
    fn file(&self, path: &str) -> io::Result<Vec<u8>> {
        self.files
            .get(path)
            .cloned()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }

    fn env(&self, name: &str) -> Option<String> {
        self.env.get(name).cloned()
    }
}

/// A data source's bytes: inline ones as they are, a file or variable from `src`. Envoy reads
/// them when it loads the config, so a missing one refuses the resource, naming `field`.
pub fn data_source(
    d: Option<&corepb::DataSource>,
    field: &str,
    src: &dyn DataSources,
) -> Result<Vec<u8>, String> {
    use corepb::data_source::Specifier as S;
    match d.and_then(|d| d.specifier.as_ref()) {
        Some(S::InlineBytes(b)) => Ok(b.clone()),
        Some(S::InlineString(s)) => Ok(s.clone().into_bytes()),
        Some(S::Filename(f)) => src
            .file(f)
            .map_err(|e| format!("{field}: cannot read file '{f}': {e}")),
        Some(S::EnvironmentVariable(v)) => src
            .env(v)
            .map(String::into_bytes)
            .ok_or_else(|| format!("{field}: environment variable '{v}' is not set")),
        None => Err(format!("{field}: a data source is required")),
    }
}

/// `d` with a file or variable replaced by the bytes it names (inline ones are left alone),
/// for a config kept as a proto and parsed after translation.
pub fn inlined(
    d: &corepb::DataSource,
    field: &str,
    src: &dyn DataSources,
) -> Result<corepb::DataSource, String> {
    use corepb::data_source::Specifier as S;
    match &d.specifier {
        Some(S::Filename(_) | S::EnvironmentVariable(_)) => Ok(corepb::DataSource {
            specifier: Some(S::InlineBytes(data_source(Some(d), field, src)?)),
            ..d.clone()
        }),
        _ => Ok(d.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corepb::data_source::Specifier as S;

    fn ds(s: S) -> corepb::DataSource {
        corepb::DataSource {
            specifier: Some(s),
            ..Default::default()
        }
    }

    #[test]
    fn files_and_variables_come_from_the_source() {
        let src = MemorySources::default()
            .with_file("/virtual/a", "file bytes")
            .with_env("A", "env bytes");
        let read = |s: S| data_source(Some(&ds(s)), "f", &src);
        assert_eq!(
            read(S::Filename("/virtual/a".into())).unwrap(),
            b"file bytes"
        );
        assert_eq!(
            read(S::EnvironmentVariable("A".into())).unwrap(),
            b"env bytes"
        );
        assert_eq!(read(S::InlineString("x".into())).unwrap(), b"x");
        let e = read(S::Filename("/virtual/b".into())).unwrap_err();
        assert!(e.starts_with("f: cannot read file '/virtual/b': "), "{e}");
        assert_eq!(
            read(S::EnvironmentVariable("B".into())).unwrap_err(),
            "f: environment variable 'B' is not set"
        );
        assert_eq!(
            data_source(None, "f", &src).unwrap_err(),
            "f: a data source is required"
        );
        let d = inlined(&ds(S::Filename("/virtual/a".into())), "f", &src).unwrap();
        assert_eq!(d.specifier, Some(S::InlineBytes(b"file bytes".to_vec())));
        // Once inline, nothing is read again.
        assert_eq!(data_source(Some(&d), "f", &NoFiles).unwrap(), b"file bytes");
    }
}
