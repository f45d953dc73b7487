//! The completion rules: when is a direct entry of the checkpoint dir a complete checkpoint?
//! All of them are here, in the order they are applied. A wrong "complete" uploads a
//! half-written checkpoint that a later resume would load, so every rule errs on "not yet".

use std::path::Path;
use std::time::Duration;

/// Which rule judged an entry complete; recorded in the manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The entry appeared by `rename(2)` (write to a temporary name, then rename).
    Renamed,
    /// The command wrote `<name>.complete` beside it.
    Marker,
    /// PyTorch Distributed Checkpoint: `.metadata` is written last, after every shard.
    Dcp,
    /// Hugging Face Trainer `checkpoint-N/`: `trainer_state.json` is written last.
    HuggingFace,
    /// PyTorch Lightning `*.ckpt`: one file written in place; complete once closed.
    Lightning,
    /// Anything else: no writes for the settle time and no file open for writing.
    Quiescent,
}

impl Rule {
    pub fn name(self) -> &'static str {
        match self {
            Rule::Renamed => "renamed",
            Rule::Marker => "marker",
            Rule::Dcp => "pytorch-dcp",
            Rule::HuggingFace => "huggingface",
            Rule::Lightning => "lightning",
            Rule::Quiescent => "quiescent",
        }
    }

    /// Rules that say so from the layout itself, not from time passing.
    pub fn is_definitive(self) -> bool {
        !matches!(self, Rule::Quiescent | Rule::Lightning)
    }
}

/// The suffix of an explicit completion marker: `step-100.complete` completes `step-100`.
pub const MARKER_SUFFIX: &str = ".complete";
/// A Lightning file checkpoint is complete once closed and quiet this long.
pub const LIGHTNING_SETTLE: Duration = Duration::from_secs(2);

/// What the tracker knows about one entry.
#[derive(Clone, Debug, Default)]
pub struct Observation {
    pub is_dir: bool,
    /// It appeared by a rename into the checkpoint dir.
    pub renamed_in: bool,
    /// Time since the last write seen under it (events and mtimes).
    pub quiet_for: Duration,
    /// Some process has a file under it open for writing.
    pub open_for_write: bool,
    /// `<name>.complete` exists beside it.
    pub has_marker: bool,
    /// Paths inside a directory entry, relative to it.
    pub files: Vec<String>,
}

/// The verdict on one entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Not a checkpoint at all (a temporary name, a marker).
    Ignored(&'static str),
    /// A checkpoint still being written.
    Incomplete(String),
    Complete(Rule),
}

/// Applies the rules, in order, to the entry `name`.
pub fn judge(name: &str, obs: &Observation, settle: Duration) -> Verdict {
    // 1. Temporary names: ignored until renamed into place.
    if name.starts_with('.') || name.ends_with(".tmp") || name.ends_with(".partial") {
        return Verdict::Ignored("temporary name");
    }
    // 2. Markers complete other entries; they are not checkpoints.
    if name.ends_with(MARKER_SUFFIX) {
        return Verdict::Ignored("completion marker");
    }
    // 3. Nothing open for writing is complete, whatever else it looks like.
    if obs.open_for_write {
        return Verdict::Incomplete("a file in it is open for writing".into());
    }
    // 4. The command said so.
    if obs.has_marker {
        return Verdict::Complete(Rule::Marker);
    }
    if obs.is_dir {
        let base = |f: &String| f.rsplit('/').next().unwrap_or(f).to_owned();
        // 5. PyTorch DCP: shards `*.distcp`, then `.metadata` from the coordinator.
        let has_metadata = obs.files.iter().any(|f| f == ".metadata");
        if has_metadata || obs.files.iter().any(|f| f.ends_with(".distcp")) {
            return if has_metadata {
                Verdict::Complete(Rule::Dcp)
            } else {
                Verdict::Incomplete("PyTorch DCP shards without .metadata yet".into())
            };
        }
        // 6. Hugging Face Trainer: `checkpoint-<step>/` with trainer_state.json last.
        if is_hf_checkpoint(name) {
            return if obs
                .files
                .iter()
                .map(base)
                .any(|f| f == "trainer_state.json")
            {
                Verdict::Complete(Rule::HuggingFace)
            } else {
                Verdict::Incomplete("Hugging Face checkpoint without trainer_state.json yet".into())
            };
        }
    }
    // 7. Write-then-rename: complete the moment it appears.
    if obs.renamed_in {
        return Verdict::Complete(Rule::Renamed);
    }
    // 8. Lightning: a closed `.ckpt`, briefly quiet.
    if !obs.is_dir && name.ends_with(".ckpt") {
        return if obs.quiet_for >= LIGHTNING_SETTLE.min(settle) {
            Verdict::Complete(Rule::Lightning)
        } else {
            Verdict::Incomplete("Lightning checkpoint written moments ago".into())
        };
    }
    // 9. Quiescence, the fallback.
    if obs.quiet_for >= settle {
        Verdict::Complete(Rule::Quiescent)
    } else {
        Verdict::Incomplete(format!(
            "written {:.1}s ago; complete after {}s without writes",
            obs.quiet_for.as_secs_f64(),
            settle.as_secs()
        ))
    }
}

fn is_hf_checkpoint(name: &str) -> bool {
    name.strip_prefix("checkpoint-")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The entry a marker completes: `step-100.complete` → `step-100`.
pub fn marker_target(name: &str) -> Option<&str> {
    name.strip_suffix(MARKER_SUFFIX).filter(|t| !t.is_empty())
}

/// True when `path`'s name is temporary or a marker (never uploaded as a checkpoint).
pub fn is_ignored_name(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
        matches!(
            judge(n, &Observation::default(), Duration::MAX),
            Verdict::Ignored(_)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SETTLE: Duration = Duration::from_secs(10);

    fn dir(files: &[&str]) -> Observation {
        Observation {
            is_dir: true,
            files: files.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn temporary_names_and_markers_are_ignored() {
        for name in [
            ".step-5",
            "step-5.tmp",
            "model.ckpt.partial",
            "step-5.complete",
        ] {
            assert!(
                matches!(
                    judge(name, &Observation::default(), SETTLE),
                    Verdict::Ignored(_)
                ),
                "{name}"
            );
        }
        assert_eq!(marker_target("step-5.complete"), Some("step-5"));
    }

    #[test]
    fn renamed_entries_are_complete_at_once() {
        let obs = Observation {
            renamed_in: true,
            ..dir(&["w.bin"])
        };
        assert_eq!(
            judge("step-5", &obs, SETTLE),
            Verdict::Complete(Rule::Renamed)
        );
    }

    #[test]
    fn open_files_veto_every_rule() {
        let obs = Observation {
            renamed_in: true,
            has_marker: true,
            open_for_write: true,
            ..dir(&[".metadata"])
        };
        assert!(matches!(
            judge("step-5", &obs, SETTLE),
            Verdict::Incomplete(_)
        ));
    }

    #[test]
    fn marker_completes() {
        let obs = Observation {
            has_marker: true,
            ..dir(&["a"])
        };
        assert_eq!(
            judge("step-5", &obs, SETTLE),
            Verdict::Complete(Rule::Marker)
        );
    }

    #[test]
    fn dcp_needs_metadata() {
        assert!(matches!(
            judge("step-5", &dir(&["__0_0.distcp"]), SETTLE),
            Verdict::Incomplete(_)
        ));
        assert_eq!(
            judge("step-5", &dir(&["__0_0.distcp", ".metadata"]), SETTLE),
            Verdict::Complete(Rule::Dcp)
        );
        // Even if it was renamed in: shards without metadata are not a checkpoint yet.
        let renamed = Observation {
            renamed_in: true,
            ..dir(&["__0_0.distcp"])
        };
        assert!(matches!(
            judge("step-5", &renamed, SETTLE),
            Verdict::Incomplete(_)
        ));
    }

    #[test]
    fn huggingface_needs_trainer_state() {
        let partial = dir(&["model.safetensors", "optimizer.pt"]);
        assert!(matches!(
            judge("checkpoint-500", &partial, SETTLE),
            Verdict::Incomplete(_)
        ));
        let done = dir(&["model.safetensors", "optimizer.pt", "trainer_state.json"]);
        assert_eq!(
            judge("checkpoint-500", &done, SETTLE),
            Verdict::Complete(Rule::HuggingFace)
        );
        // Not the HF naming: the fallback applies.
        assert!(matches!(
            judge("checkpoint-x", &done, SETTLE),
            Verdict::Incomplete(_)
        ));
    }

    #[test]
    fn lightning_ckpt_once_closed_and_quiet() {
        let fresh = Observation {
            quiet_for: Duration::from_millis(100),
            ..Default::default()
        };
        assert!(matches!(
            judge("epoch=3.ckpt", &fresh, SETTLE),
            Verdict::Incomplete(_)
        ));
        let quiet = Observation {
            quiet_for: LIGHTNING_SETTLE,
            ..Default::default()
        };
        assert_eq!(
            judge("epoch=3.ckpt", &quiet, SETTLE),
            Verdict::Complete(Rule::Lightning)
        );
    }

    #[test]
    fn quiescence_is_the_fallback() {
        let busy = Observation {
            quiet_for: Duration::from_secs(3),
            ..dir(&["w"])
        };
        assert!(matches!(
            judge("weights", &busy, SETTLE),
            Verdict::Incomplete(_)
        ));
        let quiet = Observation {
            quiet_for: SETTLE,
            ..dir(&["w"])
        };
        assert_eq!(
            judge("weights", &quiet, SETTLE),
            Verdict::Complete(Rule::Quiescent)
        );
    }
}
