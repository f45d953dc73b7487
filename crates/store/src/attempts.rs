//! The job's ledger of attempts: one small JSON object per run of the command, under
//! `<job>/attempts/`, and `<job>/completed.json` once the command has succeeded. A relaunch
//! loop reads them (`spotguard status`) to know whether to go on.

use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use serde::{Deserialize, Serialize};

use crate::{Error, Instance, JobStore};

/// How an attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttemptOutcome {
    /// Still running (its heartbeat is recent).
    Running,
    /// The command exited 0: the job is done.
    Completed,
    /// A preemption notice stopped it.
    Preempted,
    /// The command failed (non-zero exit, or killed by a signal not from a notice).
    Failed,
    /// spotguard itself vanished: no end was recorded and the heartbeat stopped.
    Crashed,
}

/// A reference to a committed checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRef {
    pub seq: u64,
    pub name: String,
    pub created: String,
}

/// The notice that ended an attempt, and how the stop went.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NoticeRecord {
    pub source: String,
    pub received: String,
    pub deadline: Option<String>,
    /// Warning the notice gave: from its arrival to its deadline.
    pub warning_seconds: Option<f64>,
    /// From the notice to the command's exit (its flush).
    #[serde(default)]
    pub stop_seconds: Option<f64>,
    /// From the command's exit to the last checkpoint committed (the final upload).
    #[serde(default)]
    pub upload_seconds: Option<f64>,
    /// Everything complete was committed before the deadline.
    #[serde(default)]
    pub durable_in_time: Option<bool>,
}

/// A checkpoint the attempt committed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CommitRecord {
    pub seq: u64,
    pub name: String,
    /// When it was committed (RFC 3339, milliseconds).
    pub committed: String,
    pub bytes: u64,
    /// Bytes sent (unchanged files are not sent again).
    pub sent_bytes: u64,
    /// Upload and commit, in the background.
    pub upload_seconds: f64,
    /// How long the command took to write it (first write to last), when seen: about how long
    /// a synchronous checkpoint blocked the command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_seconds: Option<f64>,
}

impl CommitRecord {
    /// When the checkpoint was taken: its upload started as soon as it was complete.
    pub fn taken_at(&self) -> Option<SystemTime> {
        let committed = parse_time(&self.committed)?;
        committed.checked_sub(Duration::from_secs_f64(self.upload_seconds.max(0.0)))
    }
}

/// An RFC 3339 time, with or without fractional seconds.
pub fn parse_time(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s).ok()
}

/// The idle watchdog fired.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IdleRecord {
    /// Idle since (RFC 3339).
    pub since: String,
    /// When the watchdog fired.
    pub fired: String,
    /// CPU of the command's processes, percent of one core, over the idle time.
    pub cpu_percent: f64,
    /// Highest GPU utilisation seen meanwhile, when there are GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_percent: Option<f64>,
    /// `--on-idle` ran, with this exit status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_idle_status: Option<i32>,
}

/// One run of the command.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attempt {
    pub format: u32,
    pub id: String,
    pub instance: Instance,
    pub started: String,
    pub updated: String,
    pub ended: Option<String>,
    pub outcome: AttemptOutcome,
    pub exit_status: Option<u8>,
    pub resumed_from: Option<CheckpointRef>,
    pub last_committed: Option<CheckpointRef>,
    pub notice: Option<NoticeRecord>,
    /// Time from the last committed checkpoint to the notice (or the failure).
    pub time_lost_seconds: Option<f64>,
    /// From start to end (or to the last heartbeat, while running or after a crash).
    #[serde(default)]
    pub wall_seconds: Option<f64>,
    /// Restoring the checkpoint it resumed from, before the command started.
    #[serde(default)]
    pub restore_seconds: Option<f64>,
    /// From the command's exit to the end of the final upload.
    #[serde(default)]
    pub final_upload_seconds: Option<f64>,
    /// Checkpoints it committed, oldest first.
    #[serde(default)]
    pub checkpoints: Vec<CommitRecord>,
    #[serde(default)]
    pub idle: Vec<IdleRecord>,
    /// Nothing done before this can be lost (a queue worker: when its current shard started,
    /// or the shard's last recorded item).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub work_saved_at: Option<String>,
}

/// A running attempt's record is refreshed this often...
pub const HEARTBEAT: Duration = Duration::from_secs(60);
/// ...and one not refreshed for this long is taken for crashed.
pub const STALE_AFTER: Duration = Duration::from_secs(300);

pub(crate) fn now() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

impl Attempt {
    /// A new attempt, running from now.
    pub fn begin(instance: Instance, resumed_from: Option<CheckpointRef>) -> Attempt {
        let t = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        Attempt {
            format: 1,
            id: format!("{:020}-{}", t.as_nanos() / 1_000_000, std::process::id()),
            instance,
            started: now(),
            updated: now(),
            ended: None,
            outcome: AttemptOutcome::Running,
            exit_status: None,
            resumed_from,
            last_committed: None,
            notice: None,
            time_lost_seconds: None,
            wall_seconds: None,
            restore_seconds: None,
            final_upload_seconds: None,
            checkpoints: Vec::new(),
            idle: Vec::new(),
            work_saved_at: None,
        }
    }

    /// Work this attempt did that no checkpoint saved, up to `until` (the notice, the failure,
    /// the last heartbeat of a crash): from the newest checkpoint it took (written, not
    /// committed: one committed during the final flush still saved the work before it) or
    /// `work_saved_at` to `until`, else from when the command started (after the restore).
    pub fn lost_until(&self, until: SystemTime) -> f64 {
        let started = humantime::parse_rfc3339(&self.started)
            .ok()
            .map(|t| t + Duration::from_secs_f64(self.restore_seconds.unwrap_or(0.0).max(0.0)));
        let saved = self
            .checkpoints
            .iter()
            .filter_map(|c| c.taken_at())
            .chain(self.work_saved_at.as_deref().and_then(parse_time))
            .filter(|t| *t <= until)
            .max();
        saved
            .max(started)
            .and_then(|from| until.duration_since(from).ok())
            .map_or(0.0, |d| d.as_secs_f64())
    }

    /// Where the work stopped: the notice, else the end, else the last heartbeat.
    pub fn stopped_at(&self) -> Option<SystemTime> {
        let t = self
            .notice
            .as_ref()
            .map(|n| n.received.as_str())
            .or(self.ended.as_deref())
            .unwrap_or(&self.updated);
        parse_time(t)
    }

    /// What `status` shows: a running record whose heartbeat stopped is a crash.
    pub fn effective_outcome(&self) -> AttemptOutcome {
        if self.outcome != AttemptOutcome::Running {
            return self.outcome;
        }
        let stale = humantime::parse_rfc3339(&self.updated)
            .ok()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_none_or(|age| age > STALE_AFTER);
        if stale {
            AttemptOutcome::Crashed
        } else {
            AttemptOutcome::Running
        }
    }
}

impl JobStore {
    fn attempts_dir(&self) -> Path {
        self.layout().job().clone().join("attempts")
    }

    fn completed_key(&self) -> Path {
        self.layout().job().clone().join("completed.json")
    }

    /// Writes (or rewrites) an attempt's record, refreshing its heartbeat.
    pub async fn record_attempt(&self, a: &mut Attempt) -> Result<(), Error> {
        a.updated = now();
        if a.ended.is_none()
            && let Ok(started) = humantime::parse_rfc3339(&a.started)
        {
            a.wall_seconds = SystemTime::now()
                .duration_since(started)
                .ok()
                .map(|d| d.as_secs_f64());
        }
        let body = serde_json::to_vec_pretty(a).expect("records serialize");
        let key = self.attempts_dir().join(format!("{}.json", a.id));
        self.inner()
            .put(&key, PutPayload::from(body))
            .await
            .map_err(|e| self.error(&e))?;
        Ok(())
    }

    /// Every attempt, oldest first. Unreadable records are skipped.
    pub async fn attempts(&self) -> Result<Vec<Attempt>, Error> {
        let metas: Vec<_> = self
            .inner()
            .list(Some(&self.attempts_dir()))
            .try_collect()
            .await
            .map_err(|e| self.error(&e))?;
        let mut out = Vec::new();
        for meta in metas {
            let Ok(got) = self.inner().get(&meta.location).await else {
                continue;
            };
            let Ok(bytes) = got.bytes().await else {
                continue;
            };
            if let Ok(a) = serde_json::from_slice::<Attempt>(&bytes) {
                out.push(a);
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// Marks the job completed (the command exited 0 and its checkpoints are durable).
    pub async fn mark_completed(&self, attempt: &Attempt) -> Result<(), Error> {
        let body = serde_json::json!({ "attempt": attempt.id, "completed": now() });
        let body = serde_json::to_vec_pretty(&body).expect("serializes");
        self.inner()
            .put(&self.completed_key(), PutPayload::from(body))
            .await
            .map_err(|e| self.error(&e))?;
        Ok(())
    }

    /// When the job was marked completed, if it was.
    pub async fn completed(&self) -> Result<Option<String>, Error> {
        match self.inner().get(&self.completed_key()).await {
            Ok(got) => {
                let bytes = got.bytes().await.map_err(|e| self.error(&e))?;
                let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
                Ok(Some(v["completed"].as_str().unwrap_or_default().to_owned()))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(&e)),
        }
    }
}
