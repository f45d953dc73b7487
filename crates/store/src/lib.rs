//! Checkpoints in object storage, through the `object_store` crate: S3 and S3-compatibles, GCS,
//! Azure, and a local directory.
//!
//! The commit protocol (see `PROTOCOL.md` beside this crate): a checkpoint's files are uploaded
//! and verified first; its manifest is written last, with create-if-absent. No manifest, no
//! checkpoint: a reader never sees one whose bytes are not all stored.

mod attempts;
mod cas;
mod layout;
mod manifest;
mod restore;
mod retention;
mod scan;
mod upload;

use std::fmt;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::local::LocalFileSystem;
use object_store::multipart::MultipartStore;
use object_store::path::Path;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, RetryConfig};

pub use attempts::{
    Attempt, AttemptOutcome, CheckpointRef, CommitRecord, HEARTBEAT, IdleRecord, NoticeRecord,
    STALE_AFTER, parse_time,
};
pub use cas::{CasOutcome, Expect};
pub use layout::Layout;
pub use manifest::{EntryKind, FileEntry, Instance, Manifest};
pub use object_store::UpdateVersion;
pub use restore::{RestoreOptions, RestoreReport, check_paths};
pub use retention::RetentionReport;
pub use scan::{LocalCheckpoint, LocalFile};
pub use upload::{UploadOptions, UploadReport};

/// Failures of the store, each naming the URL or key it concerns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The URL cannot be a store.
    #[error("bad store URL {url}: {reason}")]
    BadUrl { url: String, reason: String },
    /// The store did not accept a request (missing bucket, credentials, network).
    #[error("store {url}: {reason}")]
    Store { url: String, reason: String },
    /// A local file could not be read.
    #[error("failed to read {path}: {source}")]
    Local {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A file changed while it was uploaded: the checkpoint was not complete after all.
    #[error("{path} changed while it was uploaded ({reason})")]
    Changed { path: PathBuf, reason: String },
    /// An object did not verify after upload.
    #[error("object {key} did not verify: {reason}")]
    Verify { key: String, reason: String },
    /// A manifest could not be understood.
    #[error("bad manifest {key}: {reason}")]
    Manifest { key: String, reason: String },
    /// A manifest entry that would land outside the restore target.
    #[error("refusing to restore {entry}: {reason}")]
    Unsafe { entry: String, reason: String },
    /// The deadline passed before the work was done.
    #[error("deadline passed while {doing}")]
    Deadline { doing: String },
}

/// How the store's HTTP client behaves.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// `KEY=VALUE` settings passed to `object_store`'s builder (e.g.
    /// `aws_virtual_hosted_style_request=true`).
    pub config: Vec<(String, String)>,
    /// A request with no progress for this long fails and is retried: stalls are bounded.
    pub request_timeout: Duration,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            config: Vec::new(),
            request_timeout: Duration::from_secs(60),
        }
    }
}

/// A store: an `ObjectStore` and the prefix spotguard owns in it.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    /// The same store's multipart API, where it has one (S3, GCS, Azure): it names each upload,
    /// so one a crash abandoned can be aborted later.
    multipart: Option<Arc<dyn MultipartStore>>,
    /// For a local store, its directory: conditional updates lock files there.
    local_root: Option<PathBuf>,
    root: Path,
    url: String,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store").field("url", &self.url).finish()
    }
}

impl Store {
    /// Opens `url`: `s3://bucket/prefix`, `gs://bucket/prefix`, `az://container/prefix`,
    /// `file:///path`, or a plain local path. Credentials come from each cloud's usual
    /// environment variables and instance roles; `AWS_ENDPOINT_URL` selects an S3-compatible
    /// service (plain `http://` endpoints are allowed as given).
    pub fn open(url: &str, opts: &StoreOptions) -> Result<Store, Error> {
        let display = redact(url);
        let bad = |reason: String| Error::BadUrl {
            url: display.clone(),
            reason,
        };
        let Some((scheme, _)) = url.split_once("://") else {
            return Store::local(FsPath::new(url), &display);
        };
        if scheme == "file" {
            let parsed = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
            let path = parsed
                .to_file_path()
                .map_err(|()| bad("not a local path".into()))?;
            return Store::local(&path, &display);
        }
        let parsed = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err(bad("no bucket or container named".into()));
        }
        let client = ClientOptions::new()
            .with_timeout(opts.request_timeout)
            .with_connect_timeout(Duration::from_secs(5));
        let retry = RetryConfig {
            max_retries: 4,
            retry_timeout: Duration::from_secs(60),
            ..RetryConfig::default()
        };
        let config_err =
            |k: &str, e: object_store::Error| bad(format!("bad store option {k}: {e}"));
        // The three builders share no trait: this applies `--store-option`s and builds.
        macro_rules! build {
            ($b:expr) => {{
                let mut b = $b;
                for (k, v) in &opts.config {
                    b = b.with_config(k.parse().map_err(|e| config_err(k, e))?, v);
                }
                let built = Arc::new(b.build().map_err(|e| bad(one_line(&e)))?);
                (built.clone(), built)
            }};
        }
        let (inner, multipart): (Arc<dyn ObjectStore>, Arc<dyn MultipartStore>) = match scheme {
            "s3" | "s3a" => {
                let mut b = AmazonS3Builder::from_env()
                    .with_url(url)
                    .with_client_options(client)
                    .with_retry(retry);
                // S3-compatibles on plain HTTP (a local server, a private MinIO): the URL is
                // the user's explicit choice.
                let endpoint = std::env::var("AWS_ENDPOINT_URL_S3")
                    .or_else(|_| std::env::var("AWS_ENDPOINT_URL"));
                if endpoint.is_ok_and(|e| e.starts_with("http://")) {
                    b = b.with_allow_http(true);
                }
                // The instance-role credential lookup honours the same override as notices.
                if let Ok(imds) = std::env::var("AWS_EC2_METADATA_SERVICE_ENDPOINT") {
                    b = b.with_metadata_endpoint(imds);
                }
                build!(b)
            }
            "gs" => build!(
                GoogleCloudStorageBuilder::from_env()
                    .with_url(url)
                    .with_client_options(client)
                    .with_retry(retry)
            ),
            "az" | "azure" | "abfs" | "abfss" => build!(
                MicrosoftAzureBuilder::from_env()
                    .with_url(url)
                    .with_client_options(client)
                    .with_retry(retry)
            ),
            other => {
                return Err(bad(format!(
                    "unknown scheme {other}:// (expected s3, gs, az, file or a path)"
                )));
            }
        };
        let root = Path::from(parsed.path().trim_matches('/'));
        Ok(Store {
            inner,
            multipart: Some(multipart),
            local_root: None,
            root,
            url: display,
        })
    }

    fn local(path: &FsPath, display: &str) -> Result<Store, Error> {
        let err = |reason: String| Error::Store {
            url: display.to_owned(),
            reason,
        };
        std::fs::create_dir_all(path)
            .map_err(|e| err(format!("cannot create the directory: {e}")))?;
        let fs = LocalFileSystem::new_with_prefix(path).map_err(|e| err(one_line(&e)))?;
        Ok(Store {
            inner: Arc::new(fs.with_automatic_cleanup(true)),
            multipart: None,
            local_root: Some(path.to_owned()),
            root: Path::default(),
            url: display.to_owned(),
        })
    }

    /// The underlying `object_store`, for what spotguard does not wrap.
    pub fn object_store(&self) -> Arc<dyn ObjectStore> {
        self.inner.clone()
    }

    /// The URL as given (credentials redacted), for messages.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Checks that the store answers, the bucket exists and the credentials work, within
    /// `timeout`: done before the command starts, so a typo fails fast.
    pub async fn check(&self, timeout: Duration) -> Result<(), Error> {
        let list = self.inner.list_with_delimiter(Some(&self.root));
        match tokio::time::timeout(timeout, list).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(self.error(&e)),
            Err(_) => Err(Error::Store {
                url: self.url.clone(),
                reason: format!("no answer within {}", humantime::format_duration(timeout)),
            }),
        }
    }

    /// The part of the store that holds `job`.
    pub fn job(&self, job: &str) -> JobStore {
        JobStore {
            store: self.clone(),
            layout: Layout::new(self.root.clone(), job),
        }
    }

    pub(crate) fn error(&self, e: &object_store::Error) -> Error {
        Error::Store {
            url: self.url.clone(),
            reason: describe(e),
        }
    }
}

/// One job's checkpoints in a store.
#[derive(Clone, Debug)]
pub struct JobStore {
    store: Store,
    layout: Layout,
}

impl JobStore {
    pub fn url(&self) -> &str {
        self.store.url()
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub(crate) fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.store.inner
    }

    pub(crate) fn multipart(&self) -> Option<&Arc<dyn MultipartStore>> {
        self.store.multipart.as_ref()
    }

    pub(crate) fn error(&self, e: &object_store::Error) -> Error {
        self.store.error(e)
    }

    /// Every committed checkpoint, oldest first. Only manifests count: data without one is an
    /// upload that never finished. A manifest that cannot be read is skipped with a warning:
    /// it names nothing a reader could trust.
    pub async fn committed(&self) -> Result<Vec<Manifest>, Error> {
        let metas: Vec<_> = self
            .inner()
            .list(Some(&self.layout.manifests()))
            .try_collect()
            .await
            .map_err(|e| self.error(&e))?;
        let mut out = Vec::new();
        for meta in metas {
            if self.layout.manifest_seq(&meta.location).is_none() {
                continue;
            }
            match self.read_manifest(&meta.location).await {
                Ok(m) => out.push(m),
                Err(e @ Error::Manifest { .. }) => tracing::warn!("skipping {e}"),
                Err(e) => return Err(e),
            }
        }
        out.sort_by_key(|m| m.seq);
        Ok(out)
    }

    pub(crate) async fn read_manifest(&self, key: &Path) -> Result<Manifest, Error> {
        let bytes = self
            .inner()
            .get(key)
            .await
            .map_err(|e| self.error(&e))?
            .bytes()
            .await
            .map_err(|e| self.error(&e))?;
        serde_json::from_slice(&bytes).map_err(|e| Error::Manifest {
            key: key.to_string(),
            reason: e.to_string(),
        })
    }

    /// The highest sequence number used by a manifest or by data, so a new upload never
    /// reuses the keys of one that crashed.
    pub(crate) async fn highest_seq(&self) -> Result<u64, Error> {
        let mut max = 0;
        for prefix in [self.layout.manifests(), self.layout.data()] {
            let listed = self
                .inner()
                .list_with_delimiter(Some(&prefix))
                .await
                .map_err(|e| self.error(&e))?;
            for key in listed
                .objects
                .iter()
                .map(|o| &o.location)
                .chain(&listed.common_prefixes)
            {
                if let Some(seq) = self
                    .layout
                    .manifest_seq(key)
                    .or_else(|| self.layout.data_seq(key))
                {
                    max = max.max(seq);
                }
            }
        }
        Ok(max)
    }
}

/// An `object_store` error on one line: what failed, without the multi-line chain.
pub(crate) fn describe(e: &object_store::Error) -> String {
    let what = match e {
        object_store::Error::NotFound { .. } => "not found: ",
        object_store::Error::PermissionDenied { .. } => "permission denied: ",
        object_store::Error::Unauthenticated { .. } => "credentials refused: ",
        _ => "",
    };
    let detail = one_line(e);
    // object_store falls back to the instance role when the environment has no keys; off a
    // cloud that lookup fails with a message about the metadata token, not about keys.
    if detail.contains("/latest/api/token")
        || detail.contains("metadata") && detail.contains("credential")
    {
        return format!(
            "no credentials: none in the environment and no instance role answered ({detail})"
        );
    }
    format!("{what}{detail}")
}

fn one_line(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let msg = inner.to_string();
        if !s.contains(&msg) {
            s = format!("{s}: {msg}");
        }
        source = inner.source();
    }
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Hides a password in `scheme://user:password@host`.
fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        _ => url.to_owned(),
    }
}
