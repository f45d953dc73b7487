//! Compare-and-swap on one object: create-if-absent, or replace-if-version-matches. S3, GCS and
//! Azure do it with conditional requests (`If-None-Match: *`, `If-Match: <etag>`). object_store's
//! local backend only has create-if-absent, so for a local store the replace is done under an
//! exclusive `flock(2)` on a per-key lock file (`.spotguard-locks/` in the store's directory):
//! read the current ETag, compare, write (object_store writes by atomic rename), unlock. That
//! holds between processes on one machine, which is what a local store serves.

use std::fs::{self, File};

use bytes::Bytes;
use nix::fcntl::{Flock, FlockArg};
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};

use crate::{Error, JobStore};

/// What the object must be for the write to happen.
#[derive(Clone, Debug)]
pub enum Expect {
    /// Nothing there yet.
    Absent,
    /// Exactly this version.
    Version(UpdateVersion),
}

/// What a conditional write did.
#[derive(Clone, Debug)]
pub enum CasOutcome {
    Written(UpdateVersion),
    /// Someone else changed (or created) the object first.
    Conflict,
}

impl JobStore {
    /// The object's bytes and version, if it exists.
    pub async fn read_versioned(
        &self,
        key: &Path,
    ) -> Result<Option<(Bytes, UpdateVersion)>, Error> {
        match self.inner().get(key).await {
            Ok(got) => {
                let version = UpdateVersion {
                    e_tag: got.meta.e_tag.clone(),
                    version: got.meta.version.clone(),
                };
                let bytes = got.bytes().await.map_err(|e| self.error(&e))?;
                Ok(Some((bytes, version)))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(&e)),
        }
    }

    /// Every key under `prefix`.
    pub async fn list_keys(&self, prefix: &Path) -> Result<Vec<Path>, Error> {
        use futures::TryStreamExt;
        let metas: Vec<_> = self
            .inner()
            .list(Some(prefix))
            .try_collect()
            .await
            .map_err(|e| self.error(&e))?;
        Ok(metas.into_iter().map(|m| m.location).collect())
    }

    /// Writes `body` at `key` only if the object is as `expect` says.
    pub async fn write_if(
        &self,
        key: &Path,
        body: Bytes,
        expect: Expect,
    ) -> Result<CasOutcome, Error> {
        let mode = match (&expect, &self.store.local_root) {
            (Expect::Absent, _) => PutMode::Create,
            (Expect::Version(v), None) => PutMode::Update(v.clone()),
            (Expect::Version(v), Some(root)) => {
                return self.local_replace(root, key, body, v).await;
            }
        };
        match self
            .inner()
            .put_opts(
                key,
                PutPayload::from(body),
                PutOptions {
                    mode,
                    ..PutOptions::default()
                },
            )
            .await
        {
            Ok(r) => Ok(CasOutcome::Written(r.into())),
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. }
                | object_store::Error::NotFound { .. },
            ) => Ok(CasOutcome::Conflict),
            Err(e) => Err(self.error(&e)),
        }
    }

    async fn local_replace(
        &self,
        root: &std::path::Path,
        key: &Path,
        body: Bytes,
        expected: &UpdateVersion,
    ) -> Result<CasOutcome, Error> {
        let locks = root.join(".spotguard-locks");
        let lock_path = locks.join(format!(
            "{:016x}.lock",
            crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, key.as_ref().as_bytes())
        ));
        let local = |source, path: &std::path::Path| Error::Local {
            path: path.to_owned(),
            source,
        };
        fs::create_dir_all(&locks).map_err(|e| local(e, &locks))?;
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| local(e, &lock_path))?;
        let guard = tokio::task::spawn_blocking(move || Flock::lock(file, FlockArg::LockExclusive))
            .await
            .expect("flock does not panic")
            .map_err(|(_, errno)| local(std::io::Error::from(errno), &lock_path))?;
        let current = match self.inner().head(key).await {
            Ok(meta) => meta.e_tag,
            Err(object_store::Error::NotFound { .. }) => return Ok(CasOutcome::Conflict),
            Err(e) => return Err(self.error(&e)),
        };
        if current != expected.e_tag {
            return Ok(CasOutcome::Conflict);
        }
        let res = self
            .inner()
            .put(key, PutPayload::from(body))
            .await
            .map_err(|e| self.error(&e))?;
        drop(guard);
        Ok(CasOutcome::Written(res.into()))
    }
}
