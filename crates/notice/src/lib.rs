//! Preemption notices: the machine is going away (`Terminate`) or now is a good moment to save
//! (`Hint`), from whichever source saw it first.
//!
//! Each cloud's metadata service is one [`NoticeSource`]; the wire details are in
//! `shared/PROTOCOLS.md` and cited beside the code. Signals to spotguard itself become notices
//! in the session crate, which owns signal handling.

mod aws;
mod azure;
mod gcp;
mod http;
mod imds;
mod notice;
mod poll;
mod simple;
mod simulate;
mod time;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{debug, info};

pub use notice::{Notice, NoticeKind, Source};
pub use simulate::Simulated;

/// A boxed future, so sources can be used as `Arc<dyn NoticeSource>`.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A cloud whose metadata service announces preemptions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cloud {
    Aws,
    Gcp,
    Azure,
    Aliyun,
    Tencent,
    Volcengine,
}

impl Cloud {
    /// Every cloud, in the order auto-detection reports them.
    pub const ALL: [Cloud; 6] = [
        Cloud::Aws,
        Cloud::Gcp,
        Cloud::Azure,
        Cloud::Aliyun,
        Cloud::Tencent,
        Cloud::Volcengine,
    ];

    /// The lowercase name used on the command line and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Cloud::Aws => "aws",
            Cloud::Gcp => "gcp",
            Cloud::Azure => "azure",
            Cloud::Aliyun => "aliyun",
            Cloud::Tencent => "tencent",
            Cloud::Volcengine => "volcengine",
        }
    }

    /// The metadata service's address when nothing overrides it.
    pub fn default_endpoint(self) -> &'static str {
        match self {
            Cloud::Aws => "http://169.254.169.254",
            Cloud::Gcp => "http://metadata.google.internal",
            Cloud::Azure => "http://169.254.169.254",
            Cloud::Aliyun => "http://100.100.100.200",
            Cloud::Tencent => "http://metadata.tencentyun.com",
            Cloud::Volcengine => "http://100.96.0.96",
        }
    }

    /// The environment variable that overrides the endpoint. AWS and GCP use their SDKs'
    /// standard variables; the others have spotguard's own.
    pub fn endpoint_env(self) -> &'static str {
        match self {
            Cloud::Aws => "AWS_EC2_METADATA_SERVICE_ENDPOINT",
            Cloud::Gcp => "GCE_METADATA_HOST",
            Cloud::Azure => "SPOTGUARD_AZURE_METADATA_ENDPOINT",
            Cloud::Aliyun => "SPOTGUARD_ALIYUN_METADATA_ENDPOINT",
            Cloud::Tencent => "SPOTGUARD_TENCENT_METADATA_ENDPOINT",
            Cloud::Volcengine => "SPOTGUARD_VOLCENGINE_METADATA_ENDPOINT",
        }
    }

    /// Warning assumed when a notice carries no time of its own.
    pub fn default_warning(self) -> Duration {
        Duration::from_secs(match self {
            Cloud::Aws | Cloud::Tencent => 120,
            Cloud::Gcp | Cloud::Azure => 30,
            Cloud::Aliyun | Cloud::Volcengine => 300,
        })
    }
}

impl fmt::Display for Cloud {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown cloud name.
#[derive(Debug, thiserror::Error)]
#[error("unknown cloud {0:?} (expected one of aws, gcp, azure, aliyun, tencent, volcengine)")]
pub struct UnknownCloud(String);

impl FromStr for Cloud {
    type Err = UnknownCloud;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Cloud::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownCloud(s.to_owned()))
    }
}

/// Failures talking to a metadata service. Sources log these and keep watching.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No answer (refused, timed out, reset).
    #[error("failed to reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    /// An answer with an unexpected status.
    #[error("{url} answered HTTP {status}{hint}")]
    Status {
        url: String,
        status: u16,
        hint: &'static str,
    },
    /// An answer whose body could not be understood.
    #[error("unexpected answer from {url}: {reason}")]
    Body { url: String, reason: String },
}

/// Where each cloud's metadata service is.
#[derive(Clone, Debug, Default)]
pub struct Endpoints {
    overrides: Vec<(Cloud, String)>,
}

impl Endpoints {
    /// Reads every cloud's override variable (see [`Cloud::endpoint_env`]).
    pub fn from_env() -> Self {
        let mut e = Endpoints::default();
        for cloud in Cloud::ALL {
            if let Ok(v) = std::env::var(cloud.endpoint_env())
                && !v.trim().is_empty()
            {
                e = e.with(cloud, &v);
            }
        }
        e
    }

    /// Overrides one cloud's endpoint: a URL, or (as `GCE_METADATA_HOST` has it) `host:port`.
    #[must_use]
    pub fn with(mut self, cloud: Cloud, endpoint: &str) -> Self {
        self.overrides.retain(|(c, _)| *c != cloud);
        self.overrides.push((cloud, endpoint.to_owned()));
        self
    }

    /// The base URL for `cloud`, without a trailing slash.
    pub fn get(&self, cloud: Cloud) -> String {
        let raw = self
            .overrides
            .iter()
            .find(|(c, _)| *c == cloud)
            .map_or(cloud.default_endpoint(), |(_, e)| e.as_str());
        let url = if raw.contains("://") {
            raw.to_owned()
        } else {
            format!("http://{raw}")
        };
        url.trim_end_matches('/').to_owned()
    }
}

/// How sources watch.
#[derive(Clone, Debug)]
pub struct WatchOptions {
    /// Pause between polls, for the services that must be polled (GCP's hangs instead).
    pub poll_interval: Duration,
    /// AWS: read the metadata service without a session token when the token request fails.
    /// Off by default: IMDSv1 is disabled on hardened instances and a security risk elsewhere.
    pub imdsv1_fallback: bool,
}

impl Default for WatchOptions {
    fn default() -> Self {
        WatchOptions {
            poll_interval: Duration::from_secs(1),
            imdsv1_fallback: false,
        }
    }
}

/// One place notices come from.
pub trait NoticeSource: Send + Sync + fmt::Debug {
    /// Where its notices say they come from.
    fn source(&self) -> Source;

    /// True when this source's service answers here (auto-detection). Quick and bounded.
    fn probe(&self) -> BoxFuture<'_, bool>;

    /// Watches until `tx` is closed, sending each notice once. Errors are logged, not returned:
    /// a metadata service that hiccups must not end the watch.
    fn watch(self: Arc<Self>, tx: mpsc::Sender<Notice>) -> BoxFuture<'static, ()>;

    /// Tells the platform the work is safe and it may proceed now (Azure's `StartRequests`).
    /// A no-op where the platform has no such thing.
    fn acknowledge<'a>(&'a self, _notice: &'a Notice) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async { Ok(()) })
    }

    /// What the metadata service says of this machine (for the job ledger). Best effort:
    /// fields it cannot read stay empty.
    fn identity(&self) -> BoxFuture<'_, Identity> {
        Box::pin(async { Identity::default() })
    }
}

/// A machine as its metadata service describes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    pub instance_id: Option<String>,
    /// `g5.xlarge`, `a2-highgpu-1g`, `Standard_NC6s_v3`.
    pub instance_type: Option<String>,
    pub zone: Option<String>,
    /// `spot` or `on-demand`.
    pub lifecycle: Option<String>,
}

/// The last `/`-separated part (GCP answers `projects/N/zones/us-central1-a`).
pub(crate) fn last_segment(s: &str) -> Option<String> {
    let s = s.trim();
    let last = s.rsplit('/').next().unwrap_or(s);
    (!last.is_empty()).then(|| last.to_owned())
}

/// The source that watches `cloud`'s metadata service at `endpoints`.
pub fn cloud_source(
    cloud: Cloud,
    endpoints: &Endpoints,
    opts: &WatchOptions,
) -> Arc<dyn NoticeSource> {
    let base = endpoints.get(cloud);
    match cloud {
        Cloud::Aws => Arc::new(aws::Aws::new(base, opts)),
        Cloud::Gcp => Arc::new(gcp::Gcp::new(base)),
        Cloud::Azure => Arc::new(azure::Azure::new(base, opts)),
        Cloud::Aliyun | Cloud::Tencent | Cloud::Volcengine => {
            Arc::new(simple::TerminationTime::new(cloud, base, opts))
        }
    }
}

/// Finds which cloud this machine runs on by probing every metadata service at once.
///
/// Bounded by `timeout`: a machine without any (a laptop, CI) answers `None` within it.
pub async fn detect(
    endpoints: &Endpoints,
    opts: &WatchOptions,
    timeout: Duration,
) -> Option<Arc<dyn NoticeSource>> {
    let mut probes = tokio::task::JoinSet::new();
    for cloud in Cloud::ALL {
        if cloud == Cloud::Aws && aws::disabled_by_env() {
            debug!("AWS_EC2_METADATA_DISABLED is set; not probing aws");
            continue;
        }
        let source = cloud_source(cloud, endpoints, opts);
        probes.spawn(async move { source.probe().await.then_some(source) });
    }
    let found = tokio::time::timeout(timeout, async {
        while let Some(res) = probes.join_next().await {
            if let Ok(Some(source)) = res {
                return Some(source);
            }
        }
        None
    })
    .await
    .ok()
    .flatten();
    if let Some(source) = &found {
        info!(cloud = %source.source(), "cloud metadata service found; watching it for preemption notices");
    }
    found
}
