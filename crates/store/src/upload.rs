//! Uploading one checkpoint: stream every file in parts with bounded memory, checksum it on
//! the way, verify what the store holds, and commit by writing the manifest last.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use backon::{ExponentialBuilder, Retryable};
use bytes::BytesMut;
use crc_fast::{CrcAlgorithm, Digest};
use futures::TryStreamExt;
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path;
use object_store::{MultipartId, MultipartUpload, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::{debug, warn};

use crate::manifest::FORMAT;
use crate::{Error, FileEntry, Instance, JobStore, LocalCheckpoint, LocalFile, Manifest};

/// How uploads run.
#[derive(Clone, Debug)]
pub struct UploadOptions {
    /// Bytes per multipart part; files no larger go in one PUT.
    pub part_size: usize,
    /// Parts (and small files) in flight at once. Memory is about `part_size × concurrency`.
    pub concurrency: usize,
    /// Attempts per file before the checkpoint fails.
    pub attempts: usize,
    pub instance: Instance,
}

impl Default for UploadOptions {
    fn default() -> Self {
        UploadOptions {
            part_size: 16 << 20,
            concurrency: 8,
            attempts: 3,
            instance: Instance::default(),
        }
    }
}

/// What an upload did.
#[derive(Clone, Debug)]
pub struct UploadReport {
    pub manifest: Manifest,
    /// Bytes actually sent (unchanged files are not).
    pub sent_bytes: u64,
    pub reused_files: usize,
    pub elapsed: Duration,
}

/// S3 allows at most 10,000 parts; stay below it by growing the part for huge files.
const MAX_PARTS: u64 = 9_000;

impl JobStore {
    /// Uploads `ckpt` and commits it as the next checkpoint, judged complete by `rule`.
    pub async fn upload(
        &self,
        ckpt: &LocalCheckpoint,
        rule: &str,
        opts: &UploadOptions,
    ) -> Result<UploadReport, Error> {
        let started = Instant::now();
        let attempts = opts.attempts;
        let committed = retrying("listing committed checkpoints", attempts, || {
            self.committed()
        })
        .await?;
        // Unchanged-file candidates: same path inside the checkpoint, size and mtime.
        let mut previous: HashMap<(&str, u64, i128), &FileEntry> = HashMap::new();
        for m in &committed {
            for f in &m.files {
                previous.insert((f.path.as_str(), f.size, f.mtime_ns), f);
            }
        }
        let mut seq = self
            .highest_seq()
            .await?
            .max(committed.last().map_or(0, |m| m.seq))
            + 1;
        let data_dir = self.layout().data_dir(seq, &nonce());
        let sem = Arc::new(Semaphore::new(opts.concurrency.max(1)));

        // Largest first: the long uploads start early and small ones fill the gaps.
        let mut files: Vec<&LocalFile> = ckpt.files.iter().collect();
        files.sort_by_key(|f| std::cmp::Reverse(f.size));
        let mut tasks = JoinSet::new();
        for file in files {
            let prev = previous
                .get(&(file.rel.as_str(), file.size, file.mtime_ns))
                .map(|f| (*f).clone());
            let key = if ckpt.kind == crate::EntryKind::Dir {
                let mut k = data_dir.clone().join(ckpt.name.as_str());
                for part in file.rel.split('/') {
                    k = k.join(part);
                }
                k
            } else {
                data_dir.clone().join(ckpt.name.as_str())
            };
            let (me, file, sem, opts) = (self.clone(), file.clone(), sem.clone(), opts.clone());
            tasks.spawn(async move { me.upload_or_reuse(file, key, prev, sem, &opts).await });
        }
        let mut entries = Vec::with_capacity(ckpt.files.len());
        let (mut sent, mut reused) = (0, 0);
        while let Some(res) = tasks.join_next().await {
            let (entry, was_sent) = res.expect("upload tasks do not panic")?;
            if was_sent {
                sent += entry.size;
            } else {
                reused += 1;
            }
            entries.push(entry);
        }
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        retrying("verifying the uploaded objects", attempts, || {
            self.verify(&entries)
        })
        .await?;

        let mut manifest = Manifest {
            format: FORMAT,
            job: self
                .layout()
                .job()
                .filename()
                .unwrap_or_default()
                .to_owned(),
            seq,
            name: ckpt.name.clone(),
            kind: ckpt.kind,
            rule: rule.to_owned(),
            created: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            instance: opts.instance.clone(),
            total_bytes: entries.iter().map(|f| f.size).sum(),
            files: entries,
        };
        // The commit point. Create-if-absent: a sequence number is never overwritten.
        for _ in 0..5 {
            let key = self.layout().manifest(seq);
            let created = retrying("committing the manifest", attempts, || {
                self.create_manifest(&key, &manifest)
            })
            .await?;
            if created {
                return Ok(UploadReport {
                    manifest,
                    sent_bytes: sent,
                    reused_files: reused,
                    elapsed: started.elapsed(),
                });
            }
            warn!(
                seq,
                "manifest sequence number taken by another writer; using the next"
            );
            seq += 1;
            manifest.seq = seq;
        }
        Err(Error::Store {
            url: self.url().to_owned(),
            reason: "no free manifest sequence number".into(),
        })
    }

    /// Writes `manifest` at `key` unless something is there: true when it is ours (a retry
    /// whose first attempt did land finds its own manifest), false when another writer's.
    async fn create_manifest(&self, key: &Path, manifest: &Manifest) -> Result<bool, Error> {
        let body = serde_json::to_vec_pretty(manifest).expect("manifests serialize");
        let put = PutOptions {
            mode: PutMode::Create,
            ..PutOptions::default()
        };
        match self
            .inner()
            .put_opts(key, PutPayload::from(body), put)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(self
                .read_manifest(key)
                .await
                .is_ok_and(|there| &there == manifest)),
            Err(e) => Err(self.error(&e)),
        }
    }

    /// Sends one file, unless an earlier checkpoint stored the same bytes; then its object is
    /// referenced instead. Returns the entry and whether bytes were sent.
    async fn upload_or_reuse(
        &self,
        file: LocalFile,
        key: Path,
        prev: Option<FileEntry>,
        sem: Arc<Semaphore>,
        opts: &UploadOptions,
    ) -> Result<(FileEntry, bool), Error> {
        if let Some(prev) = prev {
            let path = file.path.clone();
            let crc = tokio::task::spawn_blocking(move || checksum(&path))
                .await
                .expect("checksum does not panic")?;
            if crc == prev.crc64nvme {
                debug!(file = %file.path.display(), key = %prev.key, "unchanged since an earlier checkpoint; not sent again");
                return Ok((
                    FileEntry {
                        path: file.rel,
                        ..prev
                    },
                    false,
                ));
            }
        }
        let put = || self.put_file(&file, &key, &sem, opts.part_size);
        let crc = put
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(500))
                    .with_max_delay(Duration::from_secs(10))
                    .with_max_times(opts.attempts.saturating_sub(1)),
            )
            .when(|e| matches!(e, Error::Store { .. } | Error::Verify { .. }))
            .notify(|e, wait| {
                warn!(
                    "upload of {} failed, retrying in {}: {e}",
                    file.path.display(),
                    humantime::format_duration(wait)
                )
            })
            .await?;
        let entry = FileEntry {
            path: file.rel,
            size: file.size,
            mtime_ns: file.mtime_ns,
            crc64nvme: crc,
            key: self.layout().relative(&key),
        };
        Ok((entry, true))
    }

    /// Uploads one finished output file to `<job>/outputs/<rel>` (retried like checkpoint
    /// files). Returns its CRC-64/NVME. Outputs are results, not checkpoints: no manifest.
    pub async fn upload_output(
        &self,
        rel: &str,
        path: &std::path::Path,
        opts: &UploadOptions,
    ) -> Result<String, Error> {
        let meta = std::fs::metadata(path).map_err(|source| Error::Local {
            path: path.to_owned(),
            source,
        })?;
        let file = LocalFile {
            rel: rel.to_owned(),
            path: path.to_owned(),
            size: meta.len(),
            mtime_ns: crate::scan::mtime_ns(&meta),
        };
        let mut key = self.layout().job().clone().join("outputs");
        for part in rel.split('/') {
            key = key.join(part);
        }
        let sem = Arc::new(Semaphore::new(opts.concurrency.max(1)));
        let what = format!("upload of {}", path.display());
        retrying(&what, opts.attempts, || {
            self.put_file(&file, &key, &sem, opts.part_size)
        })
        .await
    }

    /// One attempt at one file: a single PUT when it fits in a part, else a multipart upload
    /// whose parts are read, checksummed and sent as they come.
    async fn put_file(
        &self,
        file: &LocalFile,
        key: &Path,
        sem: &Arc<Semaphore>,
        part_size: usize,
    ) -> Result<String, Error> {
        let local_err = |source| Error::Local {
            path: file.path.clone(),
            source,
        };
        let part_size = part_size.max(file.size.div_ceil(MAX_PARTS) as usize);
        let mut reader = PartReader::open(&file.path, part_size).map_err(local_err)?;
        if file.size <= part_size as u64 {
            let _permit = sem.clone().acquire_owned().await.expect("semaphore open");
            let part = reader.next_part().await.map_err(local_err)?;
            let len = part.len() as u64;
            self.inner()
                .put(key, PutPayload::from(part.freeze()))
                .await
                .map_err(|e| self.error(&e))?;
            return reader.finish(len, file);
        }
        let mut upload = self.begin_multipart(key).await?;
        let mut parts: JoinSet<Result<(usize, Option<PartId>), Error>> = JoinSet::new();
        let mut total = 0u64;
        let mut parts_started = 0usize;
        let result: Result<Vec<Option<PartId>>, Error> = async {
            let mut ids = Vec::new();
            let mut collect =
                |done: Result<Result<(usize, Option<PartId>), Error>, tokio::task::JoinError>| {
                    let (n, id) = done.expect("part uploads do not panic")?;
                    if ids.len() <= n {
                        ids.resize(n + 1, None);
                    }
                    ids[n] = id;
                    Ok::<_, Error>(())
                };
            loop {
                let permit = sem.clone().acquire_owned().await.expect("semaphore open");
                // Surface a failed part early instead of reading the rest of the file.
                while let Some(done) = parts.try_join_next() {
                    collect(done)?;
                }
                let part = reader.next_part().await.map_err(local_err)?;
                if part.is_empty() {
                    break;
                }
                total += part.len() as u64;
                let put = upload.put_part(self, parts_started, PutPayload::from(part.freeze()));
                let (n, key) = (parts_started, key.clone());
                parts_started += 1;
                parts.spawn(async move {
                    let res = put.await;
                    drop(permit);
                    if res.is_ok() {
                        debug!(%key, part = n, "part stored");
                    }
                    res.map(|id| (n, id))
                });
            }
            while let Some(done) = parts.join_next().await {
                collect(done)?;
            }
            Ok(ids)
        }
        .await;
        let ids = match result.and_then(|ids| reader.finish(total, file).map(|crc| (ids, crc))) {
            Ok(x) => x,
            Err(e) => {
                parts.shutdown().await;
                upload.abort(self, key).await;
                return Err(e);
            }
        };
        let (ids, crc) = ids;
        upload.complete(self, key, ids).await?;
        Ok(crc)
    }

    /// Starts a multipart upload. Where the store names uploads, the name is recorded under
    /// `uploads/` first, so one abandoned by a crash is aborted by the next run.
    async fn begin_multipart(&self, key: &Path) -> Result<Multipart, Error> {
        let Some(mp) = self.multipart() else {
            let upload = self
                .inner()
                .put_multipart(key)
                .await
                .map_err(|e| self.error(&e))?;
            return Ok(Multipart::Plain(std::sync::Mutex::new(upload)));
        };
        let id = mp.create_multipart(key).await.map_err(|e| self.error(&e))?;
        let record = self.uploads_dir().join(format!(
            "{:016x}.json",
            crc_fast::checksum(CrcAlgorithm::Crc64Nvme, id.as_bytes())
        ));
        let body = serde_json::json!({ "key": key.to_string(), "id": id, "started": crate::attempts::now() });
        if let Err(e) = self
            .inner()
            .put(&record, PutPayload::from(body.to_string()))
            .await
        {
            let _ = mp.abort_multipart(key, &id).await;
            return Err(self.error(&e));
        }
        Ok(Multipart::Tracked {
            mp: mp.clone(),
            key: key.clone(),
            id,
            record,
        })
    }

    fn uploads_dir(&self) -> Path {
        self.layout().job().clone().join("uploads")
    }

    /// Aborts the multipart uploads an earlier run recorded and never finished (it was
    /// killed mid-upload). Call before this run starts uploading. Returns how many.
    pub async fn abort_abandoned_uploads(&self) -> Result<usize, Error> {
        let Some(mp) = self.multipart() else {
            return Ok(0);
        };
        let records: Vec<_> = self
            .inner()
            .list(Some(&self.uploads_dir()))
            .try_collect()
            .await
            .map_err(|e| self.error(&e))?;
        let mut aborted = 0;
        for meta in records {
            let body = self
                .inner()
                .get(&meta.location)
                .await
                .map_err(|e| self.error(&e))?
                .bytes()
                .await
                .map_err(|e| self.error(&e))?;
            let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            if let (Some(key), Some(id)) = (v["key"].as_str(), v["id"].as_str()) {
                match mp.abort_multipart(&Path::from(key), &id.to_owned()).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => aborted += 1,
                    Err(e) => {
                        warn!(
                            "failed to abort the abandoned multipart upload of {key}: {}",
                            crate::describe(&e)
                        );
                        continue;
                    }
                }
            }
            let _ = self.inner().delete(&meta.location).await;
        }
        Ok(aborted)
    }

    /// Every object a manifest will name exists with the right size. Run before the commit.
    async fn verify(&self, entries: &[FileEntry]) -> Result<(), Error> {
        let mut heads = JoinSet::new();
        for e in entries {
            let (me, key, size) = (self.clone(), e.key.clone(), e.size);
            heads.spawn(async move {
                let meta = me
                    .inner()
                    .head(&me.layout().absolute(&key))
                    .await
                    .map_err(|err| Error::Verify {
                        key: key.clone(),
                        reason: crate::describe(&err),
                    })?;
                if meta.size != size {
                    return Err(Error::Verify {
                        key,
                        reason: format!("{} bytes stored, {size} expected", meta.size),
                    });
                }
                Ok(())
            });
            // Bounded fan-out: at most 32 HEADs at a time.
            if heads.len() >= 32 {
                heads
                    .join_next()
                    .await
                    .expect("non-empty")
                    .expect("no panic")?;
            }
        }
        while let Some(r) = heads.join_next().await {
            r.expect("no panic")?;
        }
        Ok(())
    }
}

/// A multipart upload in progress: named and recorded where the store allows it.
enum Multipart {
    Tracked {
        mp: Arc<dyn MultipartStore>,
        key: Path,
        id: MultipartId,
        record: Path,
    },
    Plain(std::sync::Mutex<Box<dyn MultipartUpload>>),
}

type PartFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Option<PartId>, Error>> + Send>>;

impl Multipart {
    fn put_part(&mut self, store: &JobStore, n: usize, data: PutPayload) -> PartFuture {
        let me = store.clone();
        match self {
            Multipart::Tracked { mp, key, id, .. } => {
                let (mp, key, id) = (mp.clone(), key.clone(), id.clone());
                Box::pin(async move {
                    mp.put_part(&key, &id, n, data)
                        .await
                        .map(Some)
                        .map_err(|e| me.error(&e))
                })
            }
            Multipart::Plain(upload) => {
                let fut = upload.get_mut().expect("not poisoned").put_part(data);
                Box::pin(async move { fut.await.map(|()| None).map_err(|e| me.error(&e)) })
            }
        }
    }

    async fn complete(
        self,
        store: &JobStore,
        key: &Path,
        ids: Vec<Option<PartId>>,
    ) -> Result<(), Error> {
        match self {
            Multipart::Tracked { mp, id, record, .. } => {
                let ids = ids
                    .into_iter()
                    .map(|p| p.expect("every part has an id"))
                    .collect();
                mp.complete_multipart(key, &id, ids)
                    .await
                    .map_err(|e| store.error(&e))?;
                let _ = store.inner().delete(&record).await;
                Ok(())
            }
            Multipart::Plain(upload) => {
                let mut upload = upload.into_inner().expect("not poisoned");
                upload
                    .complete()
                    .await
                    .map(|_| ())
                    .map_err(|e| store.error(&e))
            }
        }
    }

    async fn abort(self, store: &JobStore, key: &Path) {
        let res = match self {
            Multipart::Tracked { mp, id, record, .. } => {
                let res = mp.abort_multipart(key, &id).await;
                if res.is_ok() {
                    let _ = store.inner().delete(&record).await;
                }
                res
            }
            Multipart::Plain(upload) => upload.into_inner().expect("not poisoned").abort().await,
        };
        if let Err(e) = res {
            warn!(
                "failed to abort the multipart upload of {key} (the next run retries): {}",
                crate::describe(&e)
            );
        }
    }
}

/// Runs `op` up to `attempts` times with exponential backoff while it fails in the store
/// (not on local errors, which a retry cannot mend), logging each failure with its reason.
pub(crate) async fn retrying<T, F, Fut>(what: &str, attempts: usize, op: F) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Error>>,
{
    op.retry(
        ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(500))
            .with_max_delay(Duration::from_secs(10))
            .with_max_times(attempts.saturating_sub(1)),
    )
    .when(|e| matches!(e, Error::Store { .. } | Error::Verify { .. }))
    .notify(|e, wait| {
        warn!(
            "{what} failed, retrying in {}: {e}",
            humantime::format_duration(wait)
        )
    })
    .await
}

/// Reads a file part by part on the blocking pool, checksumming each part while it is hot in
/// the cache: one pass over the bytes, no copy beyond the read itself.
struct PartReader {
    file: Option<File>,
    path: PathBuf,
    part_size: usize,
    digest: Option<Digest>,
    size_at_open: u64,
}

impl PartReader {
    fn open(path: &FsPath, part_size: usize) -> std::io::Result<Self> {
        let file = File::open(path)?;
        let size_at_open = file.metadata()?.len();
        Ok(PartReader {
            file: Some(file),
            path: path.to_owned(),
            part_size,
            digest: Some(Digest::new(CrcAlgorithm::Crc64Nvme)),
            size_at_open,
        })
    }

    async fn next_part(&mut self) -> std::io::Result<BytesMut> {
        let mut file = self.file.take().expect("reader holds its file");
        let mut digest = self.digest.take().expect("reader holds its digest");
        let part_size = self.part_size;
        let (file, digest, buf) = tokio::task::spawn_blocking(move || {
            let mut buf = BytesMut::zeroed(part_size);
            let mut filled = 0;
            while filled < part_size {
                match file.read(&mut buf[filled..]) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            buf.truncate(filled);
            digest.update(&buf);
            Ok((file, digest, buf))
        })
        .await
        .expect("reads do not panic")?;
        self.file = Some(file);
        self.digest = Some(digest);
        Ok(buf)
    }

    /// The checksum, once the whole file was read; an error if it changed under us.
    fn finish(self, read: u64, file: &LocalFile) -> Result<String, Error> {
        let changed = |reason: String| Error::Changed {
            path: self.path.clone(),
            reason,
        };
        if read != file.size || self.size_at_open != file.size {
            return Err(changed(format!(
                "{} bytes expected, {read} read",
                file.size
            )));
        }
        let now = std::fs::metadata(&self.path).map_err(|source| Error::Local {
            path: self.path.clone(),
            source,
        })?;
        if crate::scan::mtime_ns(&now) != file.mtime_ns || now.len() != file.size {
            return Err(changed("modified during the upload".into()));
        }
        Ok(format!(
            "{:016x}",
            self.digest.expect("reader holds its digest").finalize()
        ))
    }
}

/// CRC-64/NVME of a whole file, as manifests record it.
pub(crate) fn checksum(path: &FsPath) -> Result<String, Error> {
    let err = |source| Error::Local {
        path: path.to_owned(),
        source,
    };
    let mut f = File::open(path).map_err(err)?;
    let mut digest = Digest::new(CrcAlgorithm::Crc64Nvme);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => digest.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(err(e)),
        }
    }
    Ok(format!("{:016x}", digest.finalize()))
}

/// A short random-enough tag for an upload's data dir: two uploads of the same sequence
/// number (one crashed, one retried) never share keys.
fn nonce() -> String {
    let t = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let mix = t.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32);
    format!(
        "{:08x}",
        (mix.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
    )
}
