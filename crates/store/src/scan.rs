//! A checkpoint on local disk: one direct entry of the checkpoint dir, a file or a directory.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::{EntryKind, Error};

/// One regular file of a local checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalFile {
    /// `/`-separated path inside the checkpoint; empty for a single-file checkpoint.
    pub rel: String,
    pub path: PathBuf,
    pub size: u64,
    pub mtime_ns: i128,
}

/// A checkpoint as found on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalCheckpoint {
    pub name: String,
    pub path: PathBuf,
    pub kind: EntryKind,
    /// Sorted by `rel`.
    pub files: Vec<LocalFile>,
}

impl LocalCheckpoint {
    /// Walks `path` (a file or a directory). Symlinks are skipped: a checkpoint is what the
    /// command wrote, not what it points at.
    pub fn scan(path: &Path) -> Result<Self, Error> {
        let err = |source| Error::Local {
            path: path.to_owned(),
            source,
        };
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let meta = fs::symlink_metadata(path).map_err(err)?;
        let mut files = Vec::new();
        let kind = if meta.is_dir() {
            walk(path, "", &mut files)?;
            files.sort_by(|a, b| a.rel.cmp(&b.rel));
            EntryKind::Dir
        } else {
            files.push(LocalFile {
                rel: String::new(),
                path: path.to_owned(),
                size: meta.len(),
                mtime_ns: mtime_ns(&meta),
            });
            EntryKind::File
        };
        Ok(LocalCheckpoint {
            name,
            path: path.to_owned(),
            kind,
            files,
        })
    }

    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// Sizes and times of every file: equal fingerprints mean nothing changed.
    pub fn fingerprint(&self) -> Vec<(String, u64, i128)> {
        self.files
            .iter()
            .map(|f| (f.rel.clone(), f.size, f.mtime_ns))
            .collect()
    }
}

fn walk(dir: &Path, prefix: &str, out: &mut Vec<LocalFile>) -> Result<(), Error> {
    let err = |source| Error::Local {
        path: dir.to_owned(),
        source,
    };
    for entry in fs::read_dir(dir).map_err(err)? {
        let entry = entry.map_err(err)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let rel = if prefix.is_empty() {
            name
        } else {
            format!("{prefix}/{name}")
        };
        let meta = entry.metadata().map_err(|source| Error::Local {
            path: entry.path(),
            source,
        })?;
        if meta.is_dir() {
            walk(&entry.path(), &rel, out)?;
        } else if meta.is_file() {
            out.push(LocalFile {
                rel,
                path: entry.path(),
                size: meta.len(),
                mtime_ns: mtime_ns(&meta),
            });
        }
    }
    Ok(())
}

pub(crate) fn mtime_ns(meta: &fs::Metadata) -> i128 {
    meta.modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as i128)
}
