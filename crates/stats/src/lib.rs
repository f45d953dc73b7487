//! What a run measures, in one place: each committed checkpoint, upload failures, notices,
//! restore time, the instance's identity, idle-watchdog firings and queue counts. The run
//! writes them into its attempt record (the job ledger) and, with `--metrics-addr`, serves
//! them as Prometheus text.
//!
//! Writers are the checkpoint uploader, the session and the queue loop; everything here is
//! cheap to update (a lock held for a push) and never blocks on I/O.

mod serve;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::SystemTime;

use spotguard_store::{CommitRecord, IdleRecord, Instance};
use tokio::sync::Notify;

pub use serve::serve;

/// Shards of a task queue by state, as this worker last saw them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueCounts {
    pub pending: u32,
    pub leased: u32,
    pub done: u32,
    pub failed: u32,
}

#[derive(Debug, Default)]
struct Inner {
    commits: Vec<CommitRecord>,
    last_commit: Option<(SystemTime, u64)>,
    bytes_uploaded: u64,
    upload_failures: u64,
    /// (source, kind) → count.
    notices: BTreeMap<(String, String), u64>,
    restore_seconds: Option<f64>,
    instance: Option<Instance>,
    idle_events: Vec<IdleRecord>,
    idle_now: bool,
    queue: Option<QueueCounts>,
    shards_done: u64,
    started: Option<SystemTime>,
    work_saved_at: Option<SystemTime>,
}

/// The run's measurements. Shared as `Arc<Stats>`.
#[derive(Debug)]
pub struct Stats {
    inner: Mutex<Inner>,
    /// Something the ledger records changed (an idle firing, the instance's identity): the
    /// attempt record is worth rewriting now rather than at the next heartbeat.
    pub changed: Notify,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            inner: Mutex::new(Inner {
                started: Some(SystemTime::now()),
                ..Inner::default()
            }),
            changed: Notify::new(),
        }
    }
}

impl Stats {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// A checkpoint was committed.
    pub fn committed(&self, c: CommitRecord, at: SystemTime) {
        self.with(|i| {
            i.bytes_uploaded += c.sent_bytes;
            i.last_commit = Some((at, c.bytes));
            i.commits.push(c);
        });
        self.changed.notify_one();
    }

    pub fn upload_failed(&self) {
        self.with(|i| i.upload_failures += 1);
    }

    /// A notice arrived (`kind`: terminate or hint).
    pub fn notice(&self, source: &str, kind: &str) {
        self.with(|i| *i.notices.entry((source.into(), kind.into())).or_default() += 1);
    }

    pub fn restored(&self, seconds: f64) {
        self.with(|i| i.restore_seconds = Some(seconds));
    }

    /// What the metadata service said of this machine.
    pub fn set_instance(&self, instance: Instance) {
        self.with(|i| i.instance = Some(instance));
        self.changed.notify_one();
    }

    pub fn instance(&self) -> Option<Instance> {
        self.with(|i| i.instance.clone())
    }

    /// The idle watchdog fired; returns the firing's index for [`Stats::on_idle_ran`].
    pub fn idle_fired(&self, rec: IdleRecord) -> usize {
        let index = self.with(|i| {
            i.idle_events.push(rec);
            i.idle_now = true;
            i.idle_events.len() - 1
        });
        self.changed.notify_one();
        index
    }

    /// `--on-idle` ran for firing `index` and exited with `status`.
    pub fn on_idle_ran(&self, index: usize, status: Option<i32>) {
        self.with(|i| {
            if let Some(e) = i.idle_events.get_mut(index) {
                e.on_idle_status = status;
            }
        });
        self.changed.notify_one();
    }

    /// The command is busy again (or was never idle).
    pub fn busy(&self) {
        self.with(|i| i.idle_now = false);
    }

    pub fn set_queue(&self, counts: QueueCounts) {
        self.with(|i| i.queue = Some(counts));
    }

    /// Nothing done before `t` can be lost any more (a queue shard started, or recorded an
    /// item).
    pub fn work_saved(&self, t: SystemTime) {
        self.with(|i| i.work_saved_at = i.work_saved_at.max(Some(t)));
    }

    pub fn work_saved_at(&self) -> Option<SystemTime> {
        self.with(|i| i.work_saved_at)
    }

    pub fn shard_done(&self) {
        self.with(|i| i.shards_done += 1);
    }

    /// Commits since `from` (an index into all of this run's commits).
    pub fn commits_since(&self, from: usize) -> Vec<CommitRecord> {
        self.with(|i| i.commits.get(from..).map(<[_]>::to_vec).unwrap_or_default())
    }

    pub fn commit_count(&self) -> usize {
        self.with(|i| i.commits.len())
    }

    pub fn idle_events_since(&self, from: usize) -> Vec<IdleRecord> {
        self.with(|i| {
            i.idle_events
                .get(from..)
                .map(<[_]>::to_vec)
                .unwrap_or_default()
        })
    }

    pub fn idle_count(&self) -> usize {
        self.with(|i| i.idle_events.len())
    }

    /// Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let now = SystemTime::now();
        self.with(|i| {
            let mut out = String::new();
            let mut family = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
                let _ = writeln!(out, "# HELP {name} {help}");
                let _ = writeln!(out, "# TYPE {name} {kind}");
                for (labels, v) in samples {
                    let _ = writeln!(out, "{name}{labels} {v}");
                }
            };
            let unix = |t: SystemTime| {
                t.duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64())
            };
            let last = i.last_commit;
            family(
                "spotguard_checkpoints_committed_total",
                "counter",
                "Checkpoints committed to the store by this run.",
                &[(String::new(), i.commits.len() as f64)],
            );
            family(
                "spotguard_last_checkpoint_timestamp_seconds",
                "gauge",
                "When the newest checkpoint was committed (Unix time; 0 before the first).",
                &[(String::new(), last.map_or(0.0, |(t, _)| unix(t)))],
            );
            family(
                "spotguard_last_checkpoint_age_seconds",
                "gauge",
                "Seconds since the newest checkpoint was committed (since the start before the first).",
                &[(
                    String::new(),
                    now.duration_since(last.map_or(i.started.unwrap_or(now), |(t, _)| t))
                        .map_or(0.0, |d| d.as_secs_f64()),
                )],
            );
            family(
                "spotguard_last_checkpoint_bytes",
                "gauge",
                "Size of the newest committed checkpoint.",
                &[(String::new(), last.map_or(0.0, |(_, b)| b as f64))],
            );
            family(
                "spotguard_uploaded_bytes_total",
                "counter",
                "Checkpoint bytes sent to the store.",
                &[(String::new(), i.bytes_uploaded as f64)],
            );
            family(
                "spotguard_upload_failures_total",
                "counter",
                "Checkpoint uploads that failed (each is retried).",
                &[(String::new(), i.upload_failures as f64)],
            );
            let notices: Vec<_> = i
                .notices
                .iter()
                .map(|((source, kind), n)| {
                    (
                        format!("{{source=\"{}\",kind=\"{}\"}}", escape(source), escape(kind)),
                        *n as f64,
                    )
                })
                .collect();
            family(
                "spotguard_notices_total",
                "counter",
                "Preemption notices and checkpoint hints received, by source.",
                &notices,
            );
            family(
                "spotguard_restore_seconds",
                "gauge",
                "Time the last restore took before the command started (0 when none ran).",
                &[(String::new(), i.restore_seconds.unwrap_or(0.0))],
            );
            family(
                "spotguard_idle",
                "gauge",
                "1 while the idle watchdog considers the command idle.",
                &[(String::new(), f64::from(u8::from(i.idle_now)))],
            );
            family(
                "spotguard_idle_firings_total",
                "counter",
                "Times the idle watchdog fired.",
                &[(String::new(), i.idle_events.len() as f64)],
            );
            if let Some(q) = i.queue {
                let samples: Vec<_> = [
                    ("pending", q.pending),
                    ("leased", q.leased),
                    ("done", q.done),
                    ("failed", q.failed),
                ]
                .iter()
                .map(|(s, n)| (format!("{{state=\"{s}\"}}"), f64::from(*n)))
                .collect();
                family(
                    "spotguard_queue_shards",
                    "gauge",
                    "Task-queue shards by state, as this worker last saw them.",
                    &samples,
                );
                family(
                    "spotguard_queue_shards_done_total",
                    "counter",
                    "Shards this worker finished.",
                    &[(String::new(), i.shards_done as f64)],
                );
            }
            out
        })
    }
}

/// Label values escape `\`, `"` and newlines.
fn escape(v: &str) -> String {
    v.replace('\\', r"\\")
        .replace('"', "\\\"")
        .replace('\n', r"\n")
}

/// RFC 3339 with milliseconds, the ledger's time format for events.
pub fn timestamp(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_family_with_help_and_type() {
        let s = Stats::default();
        s.committed(
            CommitRecord {
                seq: 1,
                name: "step-1".into(),
                bytes: 2048,
                sent_bytes: 2048,
                ..CommitRecord::default()
            },
            SystemTime::now(),
        );
        s.notice("aws", "hint");
        s.notice("signal \"TERM\"", "terminate");
        let text = s.render();
        assert!(
            text.contains("spotguard_uploaded_bytes_total 2048\n"),
            "{text}"
        );
        assert!(
            text.contains(
                r#"spotguard_notices_total{source="signal \"TERM\"",kind="terminate"} 1"#
            ),
            "{text}"
        );
        assert!(
            !text.contains("spotguard_queue_shards"),
            "no queue, no queue metrics"
        );
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} has no TYPE"
            );
        }
    }
}
