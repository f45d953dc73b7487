//! Restoring a committed checkpoint: parallel ranged GETs with bounded memory, every file's
//! size and CRC verified, written beside the target and swapped in only when whole.

use std::fs::{self, File};
use std::os::unix::fs::FileExt;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crc_fast::{CrcAlgorithm, Digest, checksum_combine};
use futures::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, GetRange};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::upload::{checksum, retrying};
use crate::{EntryKind, Error, FileEntry, JobStore, Manifest};

/// How restores run.
#[derive(Clone, Debug)]
pub struct RestoreOptions {
    /// Bytes per ranged GET.
    pub part_size: usize,
    /// GETs in flight at once; memory is about `part_size × concurrency`.
    pub concurrency: usize,
    pub attempts: usize,
    /// Bytes downloaded so far, for a progress display.
    pub progress: Option<Arc<AtomicU64>>,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            part_size: 16 << 20,
            concurrency: 8,
            attempts: 3,
            progress: None,
        }
    }
}

/// What a restore did.
#[derive(Clone, Debug)]
pub struct RestoreReport {
    /// The restored checkpoint: `<dest>/<name>`.
    pub path: PathBuf,
    pub bytes: u64,
    /// Bytes downloaded (files already present and identical are not).
    pub fetched_bytes: u64,
    pub reused_files: usize,
    pub elapsed: Duration,
}

/// Refuses a manifest whose entries would land outside the target: absolute paths, `..`,
/// empty or odd components. Named by the offending entry.
pub fn check_paths(m: &Manifest) -> Result<(), Error> {
    let unsafe_entry = |entry: &str, reason: &str| Error::Unsafe {
        entry: entry.to_owned(),
        reason: reason.to_owned(),
    };
    let component_ok =
        |c: &str| !c.is_empty() && c != "." && c != ".." && !c.contains(['\0', '\\']);
    if !component_ok(&m.name) || m.name.contains('/') {
        return Err(unsafe_entry(
            &m.name,
            "the checkpoint name is not a plain file name",
        ));
    }
    match m.kind {
        EntryKind::File => {
            if m.files.len() != 1 || !m.files[0].path.is_empty() {
                return Err(unsafe_entry(
                    &m.name,
                    "a file checkpoint must hold exactly one file",
                ));
            }
        }
        EntryKind::Dir => {
            for f in &m.files {
                if f.path.starts_with('/') {
                    return Err(unsafe_entry(&f.path, "absolute path"));
                }
                if !f.path.split('/').all(component_ok) {
                    return Err(unsafe_entry(
                        &f.path,
                        "path escapes the checkpoint dir or is malformed",
                    ));
                }
            }
        }
    }
    Ok(())
}

impl JobStore {
    /// Restores `m` as `<dest>/<m.name>`. Files already there with the same size and CRC are
    /// kept (nothing is downloaded when the whole copy is identical); everything else is
    /// fetched into a hidden staging path and verified, then swapped in.
    pub async fn restore(
        &self,
        m: &Manifest,
        dest: &FsPath,
        opts: &RestoreOptions,
    ) -> Result<RestoreReport, Error> {
        check_paths(m)?;
        let started = Instant::now();
        let local = |source, path: &FsPath| Error::Local {
            path: path.to_owned(),
            source,
        };
        fs::create_dir_all(dest).map_err(|e| local(e, dest))?;
        let target = dest.join(&m.name);
        let at = |root: &FsPath, f: &FileEntry| {
            if f.path.is_empty() {
                root.to_owned()
            } else {
                root.join(&f.path)
            }
        };

        // What is already there and identical.
        let mut same = vec![false; m.files.len()];
        for (i, f) in m.files.iter().enumerate() {
            let p = at(&target, f);
            let size_ok =
                fs::symlink_metadata(&p).is_ok_and(|md| md.is_file() && md.len() == f.size);
            same[i] = size_ok && checksum(&p).is_ok_and(|c| c == f.crc64nvme);
        }
        let complete_copy = same.iter().all(|s| *s) && extra_files(&target, m).is_empty();
        if complete_copy {
            set_mtimes(&target, m);
            return Ok(RestoreReport {
                path: target,
                bytes: m.total_bytes,
                fetched_bytes: 0,
                reused_files: m.files.len(),
                elapsed: started.elapsed(),
            });
        }

        let staging = dest.join(format!(".{}.restoring-{}", m.name, std::process::id()));
        let _ = fs::remove_dir_all(&staging);
        let _ = fs::remove_file(&staging);
        if m.kind == EntryKind::Dir {
            fs::create_dir_all(&staging).map_err(|e| local(e, &staging))?;
        }
        let sem = Arc::new(Semaphore::new(opts.concurrency.max(1)));
        let mut tasks = JoinSet::new();
        let (mut fetched, mut reused) = (0, 0);
        for (i, f) in m.files.iter().enumerate() {
            let dst = at(&staging, f);
            if let Some(parent) = dst.parent() {
                fs::create_dir_all(parent).map_err(|e| local(e, parent))?;
            }
            if same[i] {
                let src = at(&target, f);
                if fs::hard_link(&src, &dst).is_err() {
                    fs::copy(&src, &dst).map_err(|e| local(e, &src))?;
                }
                reused += 1;
                continue;
            }
            fetched += f.size;
            let (me, f, sem, opts) = (self.clone(), f.clone(), sem.clone(), opts.clone());
            tasks.spawn(async move {
                let key = me.layout().absolute(&f.key);
                let what = format!("download of {}", f.key);
                retrying(&what, opts.attempts, || {
                    me.fetch_file(&key, &dst, &f, &sem, &opts)
                })
                .await
            });
        }
        while let Some(res) = tasks.join_next().await {
            if let Err(e) = res.expect("downloads do not panic") {
                let _ = fs::remove_dir_all(&staging);
                let _ = fs::remove_file(&staging);
                return Err(e);
            }
        }
        set_mtimes(&staging, m);
        // Swap: the old copy (if any) is moved aside first, so `target` is never half there.
        let old = dest.join(format!(".{}.old-{}", m.name, std::process::id()));
        if fs::symlink_metadata(&target).is_ok() {
            fs::rename(&target, &old).map_err(|e| local(e, &target))?;
        }
        fs::rename(&staging, &target).map_err(|e| local(e, &target))?;
        let _ = fs::remove_dir_all(&old);
        let _ = fs::remove_file(&old);
        Ok(RestoreReport {
            path: target,
            bytes: m.total_bytes,
            fetched_bytes: fetched,
            reused_files: reused,
            elapsed: started.elapsed(),
        })
    }

    /// One attempt at one file: ranged GETs written at their offsets, CRCs combined in order.
    async fn fetch_file(
        &self,
        key: &Path,
        dst: &FsPath,
        f: &FileEntry,
        sem: &Arc<Semaphore>,
        opts: &RestoreOptions,
    ) -> Result<(), Error> {
        let local = |source| Error::Local {
            path: dst.to_owned(),
            source,
        };
        let file = File::create(dst).map_err(local)?;
        file.set_len(f.size).map_err(local)?;
        let file = Arc::new(file);
        let part = opts.part_size.max(1) as u64;
        let mut parts = JoinSet::new();
        let mut start = 0;
        let mut index = 0;
        while start < f.size || (f.size == 0 && index == 0) {
            let end = (start + part).min(f.size);
            let permit = sem.clone().acquire_owned().await.expect("semaphore open");
            let (me, key, file, progress) = (
                self.clone(),
                key.clone(),
                file.clone(),
                opts.progress.clone(),
            );
            parts.spawn(async move {
                let res = me.fetch_range(&key, file, start, end).await;
                if let (Ok(_), Some(p)) = (&res, progress) {
                    p.fetch_add(end - start, Ordering::Relaxed);
                }
                drop(permit);
                res.map(|crc| (index, crc, end - start))
            });
            start = end;
            index += 1;
            if f.size == 0 {
                break;
            }
        }
        let mut crcs = Vec::with_capacity(index);
        while let Some(r) = parts.join_next().await {
            let r = r.expect("range downloads do not panic");
            match r {
                Ok(v) => crcs.push(v),
                Err(Error::Local { source, .. }) => return Err(local(source)),
                Err(e) => return Err(e),
            }
        }
        crcs.sort_by_key(|(i, _, _)| *i);
        let crc = crcs
            .iter()
            .skip(1)
            .fold(crcs.first().map_or(0, |c| c.1), |acc, (_, c, len)| {
                checksum_combine(CrcAlgorithm::Crc64Nvme, acc, *c, *len)
            });
        let crc = format!("{crc:016x}");
        if crc != f.crc64nvme {
            return Err(Error::Verify {
                key: key.to_string(),
                reason: format!("checksum {crc}, the manifest says {}", f.crc64nvme),
            });
        }
        // No fsync: a restore cut short by a crash is verified (size and CRC) and redone by
        // the next one, and flushing gigabytes here would only delay the command.
        Ok(())
    }
}

/// Bytes gathered from the response before each positional write: big enough that the
/// blocking-pool round trip is amortised, small enough to stay in cache.
const WRITE_BUF: usize = 4 << 20;

impl JobStore {
    /// Streams `start..end` of `key` into `file` at the same offsets, checksumming chunks as
    /// they arrive: no buffer the size of the range, one pass over the bytes.
    async fn fetch_range(
        &self,
        key: &Path,
        file: Arc<File>,
        start: u64,
        end: u64,
    ) -> Result<u64, Error> {
        let mut digest = Digest::new(CrcAlgorithm::Crc64Nvme);
        if end == start {
            return Ok(digest.finalize());
        }
        let opts = GetOptions {
            range: Some(GetRange::Bounded(start..end)),
            ..GetOptions::default()
        };
        let mut stream = self
            .inner()
            .get_opts(key, opts)
            .await
            .map_err(|e| self.error(&e))?
            .into_stream();
        let mut offset = start;
        let mut buf = Vec::with_capacity(WRITE_BUF);
        loop {
            let chunk = stream
                .next()
                .await
                .transpose()
                .map_err(|e| self.error(&e))?;
            let done = chunk.is_none();
            if let Some(chunk) = &chunk {
                digest.update(chunk);
                buf.extend_from_slice(chunk);
            }
            if (done && !buf.is_empty()) || buf.len() >= WRITE_BUF {
                let (f, at) = (file.clone(), offset);
                let len = buf.len() as u64;
                buf = tokio::task::spawn_blocking(move || f.write_all_at(&buf, at).map(|()| buf))
                    .await
                    .expect("writes do not panic")
                    .map_err(|source| Error::Local {
                        path: PathBuf::new(),
                        source,
                    })?;
                buf.clear();
                offset += len;
            }
            if done {
                break;
            }
        }
        if offset != end {
            return Err(Error::Verify {
                key: key.to_string(),
                reason: format!("range {start}..{end} returned {} bytes", offset - start),
            });
        }
        Ok(digest.finalize())
    }
}

/// Files in a local copy that the manifest does not name.
fn extra_files(target: &FsPath, m: &Manifest) -> Vec<PathBuf> {
    if m.kind == EntryKind::File {
        return Vec::new();
    }
    let Ok(scan) = crate::LocalCheckpoint::scan(target) else {
        return Vec::new();
    };
    scan.files
        .into_iter()
        .filter(|f| !m.files.iter().any(|e| e.path == f.rel))
        .map(|f| f.path)
        .collect()
}

/// Restored files get the committed mtimes, so the checkpoint reads as unchanged and is not
/// uploaded again.
fn set_mtimes(root: &FsPath, m: &Manifest) {
    for f in &m.files {
        let p = if f.path.is_empty() {
            root.to_owned()
        } else {
            root.join(&f.path)
        };
        let t = UNIX_EPOCH + Duration::from_nanos(f.mtime_ns.max(0) as u64);
        if let Ok(file) = File::options().write(true).open(&p) {
            let _ = file.set_modified(t.max(SystemTime::UNIX_EPOCH));
        }
    }
}

impl JobStore {
    /// Restores the newest committed checkpoint into `dest`, falling back to older ones when
    /// the newest cannot be restored whole (damaged or missing objects), logging why.
    /// `Ok(None)`: the job has no committed checkpoint yet.
    pub async fn restore_newest(
        &self,
        dest: &FsPath,
        opts: &RestoreOptions,
    ) -> Result<Option<(Manifest, RestoreReport)>, Error> {
        let committed = self.committed().await?;
        let mut last_err = None;
        for m in committed.iter().rev() {
            match self.restore(m, dest, opts).await {
                Ok(rep) => return Ok(Some((m.clone(), rep))),
                Err(e @ (Error::Store { .. } | Error::Verify { .. } | Error::Unsafe { .. })) => {
                    tracing::warn!(seq = m.seq, checkpoint = %m.name, "cannot restore this checkpoint, trying the previous one: {e}");
                    last_err = Some(e);
                }
                Err(e) => return Err(e),
            }
        }
        match last_err {
            Some(e) => Err(e),
            None => Ok(None),
        }
    }
}
