use std::fmt;
use std::time::{Duration, SystemTime};

use crate::Cloud;
use crate::time::format_utc;

/// Where a notice came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// A signal sent to spotguard itself (Kubernetes, Docker, systemd, SLURM, a user).
    Signal(String),
    /// `--simulate-preemption`: a rehearsal.
    Simulated,
    /// A cloud's metadata service.
    Cloud(Cloud),
    /// Something else spotguard watches (e.g. `lease`: a task-queue lease was lost).
    Other(&'static str),
}

impl Source {
    /// The short name written to `notice.json` and logs: `aws`, `signal`, `simulated`.
    pub fn name(&self) -> &str {
        match self {
            Source::Signal(_) => "signal",
            Source::Simulated => "simulated",
            Source::Cloud(c) => c.name(),
            Source::Other(name) => name,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Signal(sig) => write!(f, "signal {sig}"),
            other => f.write_str(other.name()),
        }
    }
}

/// What a notice means.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NoticeKind {
    /// The machine is going away: stop, save, upload.
    Terminate,
    /// A good moment to checkpoint (e.g. an AWS rebalance recommendation); keep running.
    Hint,
}

impl NoticeKind {
    /// `terminate` or `hint`.
    pub fn name(self) -> &'static str {
        match self {
            NoticeKind::Terminate => "terminate",
            NoticeKind::Hint => "hint",
        }
    }
}

impl fmt::Display for NoticeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One preemption notice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    pub source: Source,
    pub kind: NoticeKind,
    /// When spotguard saw it.
    pub received: SystemTime,
    /// When the machine goes away, as the source says (or as assumed for it). `None` for hints.
    pub deadline: Option<SystemTime>,
    /// What the source said, for logs: `spot instance-action: terminate`.
    pub detail: String,
    /// The platform's id for the event, where it has one (Azure's `EventId`), so it can be
    /// acknowledged.
    pub event_id: Option<String>,
}

impl Notice {
    /// The machine goes away at `deadline`.
    pub fn terminate(source: Source, deadline: SystemTime, detail: impl Into<String>) -> Self {
        Notice {
            source,
            kind: NoticeKind::Terminate,
            received: SystemTime::now(),
            deadline: Some(deadline),
            detail: detail.into(),
            event_id: None,
        }
    }

    /// A good moment to checkpoint.
    pub fn hint(source: Source, detail: impl Into<String>) -> Self {
        Notice {
            source,
            kind: NoticeKind::Hint,
            received: SystemTime::now(),
            deadline: None,
            detail: detail.into(),
            event_id: None,
        }
    }

    /// Sets the platform's event id.
    #[must_use]
    pub fn with_event_id(mut self, id: impl Into<String>) -> Self {
        self.event_id = Some(id.into());
        self
    }

    /// How much warning the notice gave: from receipt to the deadline.
    pub fn warning(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.duration_since(self.received).unwrap_or_default())
    }

    /// Identity for de-duplication: a source repeats a pending event on every poll.
    pub fn key(&self) -> String {
        let id = self.event_id.as_deref().unwrap_or(&self.detail);
        format!("{}/{}/{}", self.source, self.kind, id)
    }

    /// The `notice.json` the child reads from `SPOTGUARD_NOTICE_FILE`.
    pub fn to_json(&self) -> serde_json::Value {
        let unix = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or_default()
        };
        let mut v = serde_json::json!({
            "source": self.source.name(),
            "kind": self.kind.name(),
            "received": format_utc(self.received),
            "deadline": self.deadline.map(format_utc),
            "deadline_unix": self.deadline.map(unix),
            "warning_seconds": self.warning().map(|w| w.as_secs_f64()),
            "detail": self.detail,
            "event_id": self.event_id,
        });
        if let Source::Signal(sig) = &self.source {
            v["signal"] = serde_json::Value::from(sig.as_str());
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_names_source_kind_and_deadline() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut n = Notice::terminate(
            Source::Cloud(Cloud::Aws),
            at,
            "spot instance-action: terminate",
        );
        n.received = at - Duration::from_secs(120);
        let v = n.to_json();
        assert_eq!(v["source"], "aws");
        assert_eq!(v["kind"], "terminate");
        assert_eq!(v["deadline"], "2023-11-14T22:13:20Z");
        assert_eq!(v["warning_seconds"], 120.0);
        let sig = Notice::terminate(Source::Signal("SIGTERM".into()), at, "x").to_json();
        assert_eq!(sig["source"], "signal");
        assert_eq!(sig["signal"], "SIGTERM");
    }

    #[test]
    fn key_prefers_event_id() {
        let a = Notice::hint(Source::Simulated, "one").with_event_id("E1");
        let b = Notice::hint(Source::Simulated, "two").with_event_id("E1");
        assert_eq!(a.key(), b.key());
        assert_ne!(a.key(), Notice::hint(Source::Simulated, "one").key());
    }
}
