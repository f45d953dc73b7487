//! Resuming: `spotguard run` hands the newest committed checkpoint to the command on a fresh
//! machine, and `spotguard resume` does the same for scripts, with distinct exit codes.

mod support;

use std::path::{Path, PathBuf};

use nix::sys::signal::Signal;
use support::{Proc, run_to_end, spotguard};

fn train() -> PathBuf {
    [env!("CARGO_MANIFEST_DIR"), "examples", "train.py"]
        .iter()
        .collect()
}

/// One "instance": its own fresh state dir, the shared store.
fn instance(store: &Path, extra: &[&str]) -> (tempfile::TempDir, std::process::Command) {
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    cmd.args(["run", "--store"])
        .arg(store)
        .args(extra)
        .args(["--", "python3"])
        .arg(train())
        .args([
            "--steps",
            "300",
            "--save-every",
            "40",
            "--step-time",
            "0.002",
        ]);
    (state, cmd)
}

fn final_weights(stdout: &str) -> String {
    stdout
        .lines()
        .find(|l| l.starts_with("done: "))
        .unwrap_or_else(|| panic!("not done:\n{stdout}"))
        .to_owned()
}

#[test]
fn a_preempted_run_resumes_on_a_fresh_machine_to_the_same_weights() {
    let store = tempfile::tempdir().expect("store");
    // The reference: one uninterrupted run.
    let (_s, cmd) = instance(&store.path().join("reference"), &[]);
    let reference = Proc::start(cmd).finish();
    assert_eq!(reference.code(), 0, "{}", reference.stderr);
    let expected = final_weights(&reference.stdout);

    // Preempted once it has made progress, then resumed elsewhere from fresh local dirs.
    let shared = store.path().join("shared");
    let (_s1, cmd) = instance(&shared, &[]);
    let p = Proc::start(cmd);
    p.expect_stdout("step 120");
    p.signal(Signal::SIGTERM);
    let first = p.finish();
    assert_eq!(first.code(), 75, "{}", first.stderr);
    let stopped = first
        .stdout
        .lines()
        .find(|l| l.starts_with("stopping at step"))
        .expect("saved on SIGTERM")
        .to_owned();

    let (_s2, cmd) = instance(&shared, &[]);
    let second = Proc::start(cmd).finish();
    assert_eq!(second.code(), 0, "{}", second.stderr);
    let resumed = second
        .stdout
        .lines()
        .find(|l| l.starts_with("resumed from"))
        .expect("resumed")
        .to_owned();
    let step: &str = stopped
        .split_whitespace()
        .nth(3)
        .expect("step")
        .trim_end_matches(|c: char| !c.is_ascii_digit());
    assert!(
        resumed.ends_with(&format!("at step {step}")),
        "resumed from the flushed step {step}: {resumed}"
    );
    assert_eq!(
        final_weights(&second.stdout),
        expected,
        "bit-for-bit the uninterrupted result"
    );
}

#[test]
fn resume_exit_codes_and_print_env() {
    let state = tempfile::tempdir().expect("tempdir");
    let f = run_to_end(state.path(), &["resume"]);
    assert_eq!(f.code(), 3, "no checkpoint yet: {}", f.stderr);
    assert_eq!(f.stdout, "");

    let script = r#"d="$SPOTGUARD_CHECKPOINT_DIR"; mkdir "$d/.s"; echo it\'s > "$d/.s/w"; mv "$d/.s" "$d/step-7""#;
    let f = run_to_end(state.path(), &["run", "--", "sh", "-c", script]);
    assert_eq!(f.code(), 0, "{}", f.stderr);

    let to = state.path().join("elsewhere");
    let to_s = to.to_str().expect("utf-8");
    let f = run_to_end(state.path(), &["resume", "--to", to_s]);
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert_eq!(f.stdout, to.join("step-7").display().to_string());
    let f = run_to_end(state.path(), &["resume", "--to", to_s, "--print-env"]);
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert_eq!(
        f.stdout,
        format!(
            "export SPOTGUARD_RESUME_DIR='{}'\nexport SPOTGUARD_RESUME_NAME='step-7'\nexport SPOTGUARD_RESUME_SEQ=1",
            to.join("step-7").display()
        )
    );
    let f = run_to_end(state.path(), &["resume", "--store", "ftp://nowhere/x"]);
    assert_eq!(f.code(), 70, "{}", f.stderr);
}

#[test]
fn the_command_sees_resume_variables_only_when_there_is_something_to_resume() {
    let state = tempfile::tempdir().expect("tempdir");
    let show = r#"echo "dir=${SPOTGUARD_RESUME_DIR-unset} seq=${SPOTGUARD_RESUME_SEQ-unset}""#;
    let mut cmd = spotguard(state.path());
    // An inherited value must not leak through to a fresh job.
    cmd.env("SPOTGUARD_RESUME_DIR", "/stale")
        .args(["run", "--", "sh", "-c", show]);
    let f = Proc::start(cmd).finish();
    assert_eq!(f.stdout, "dir=unset seq=unset");
    let save = r#"d="$SPOTGUARD_CHECKPOINT_DIR"; mkdir "$d/.s"; echo 1 > "$d/.s/w"; mv "$d/.s" "$d/step-1""#;
    assert_eq!(
        run_to_end(state.path(), &["run", "--", "sh", "-c", save]).code(),
        0
    );
    let f = run_to_end(state.path(), &["run", "--", "sh", "-c", show]);
    let dir = state.path().join("jobs/default/checkpoints/step-1");
    assert_eq!(f.stdout, format!("dir={} seq=1", dir.display()));
    let f = run_to_end(
        state.path(),
        &["run", "--no-resume", "--", "sh", "-c", show],
    );
    assert_eq!(f.stdout, "dir=unset seq=unset");
}

fn status_json(state: &Path) -> (i32, serde_json::Value) {
    let f = run_to_end(state, &["status", "--json"]);
    let v = serde_json::from_str(&f.stdout).unwrap_or_else(|e| panic!("{e}: {}", f.stdout));
    (f.code(), v)
}

#[test]
fn restart_on_failure_resumes_and_the_ledger_records_each_attempt() {
    let state = tempfile::tempdir().expect("tempdir");
    let (code, v) = status_json(state.path());
    assert_eq!((code, v["completed"].as_bool()), (4, Some(false)), "{v}");
    // Fails once after saving a checkpoint; the relaunch resumes from it and succeeds.
    let script = r#"
        if [ -n "$SPOTGUARD_RESUME_DIR" ]; then echo "resumed $(cat "$SPOTGUARD_RESUME_DIR/w")"; exit 0; fi
        d="$SPOTGUARD_CHECKPOINT_DIR"; mkdir "$d/.s"; echo progress > "$d/.s/w"; mv "$d/.s" "$d/step-1"; exit 9"#;
    let f = run_to_end(
        state.path(),
        &[
            "run",
            "--restart",
            "on-failure",
            "--max-restarts",
            "2",
            "--",
            "sh",
            "-c",
            script,
        ],
    );
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert_eq!(f.stdout, "resumed progress");
    assert!(f.stderr.contains("restart 1 of 2"), "{}", f.stderr);
    let (code, v) = status_json(state.path());
    assert_eq!(code, 0, "completed: {v}");
    let outcomes: Vec<&str> = v["attempts"]
        .as_array()
        .expect("attempts")
        .iter()
        .map(|a| a["outcome"].as_str().expect("outcome"))
        .collect();
    assert_eq!(outcomes, ["failed", "completed"], "{v}");
    assert_eq!(v["attempts"][0]["exit_status"], 9);
    assert_eq!(v["attempts"][1]["resumed_from"]["name"], "step-1");
}

#[test]
fn a_preempted_command_is_never_restarted_here_and_lost_time_is_recorded() {
    let state = tempfile::tempdir().expect("tempdir");
    let script = r#"trap 'exit 0' TERM; d="$SPOTGUARD_CHECKPOINT_DIR"; mkdir "$d/.s"; echo 1 > "$d/.s/w"; mv "$d/.s" "$d/step-1"; echo saved; while :; do sleep 30 & wait $!; done"#;
    let mut cmd = spotguard(state.path());
    cmd.args(["run", "--restart", "on-failure", "--", "sh", "-c", script]);
    let p = Proc::start(cmd);
    p.expect_stdout("saved");
    p.expect_stderr("checkpoint committed");
    p.signal(Signal::SIGTERM);
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    assert!(
        !f.stderr.contains("restart"),
        "no relaunch after a notice: {}",
        f.stderr
    );
    let (code, v) = status_json(state.path());
    assert_eq!(code, 4);
    let a = &v["attempts"].as_array().expect("attempts")[0];
    assert_eq!(v["attempts"].as_array().map(Vec::len), Some(1));
    assert_eq!(a["outcome"], "preempted");
    assert_eq!(a["notice"]["source"], "signal SIGTERM");
    assert_eq!(a["last_committed"]["name"], "step-1");
    assert!(
        a["time_lost_seconds"]
            .as_f64()
            .is_some_and(|s| (0.0..30.0).contains(&s)),
        "{a}"
    );
}
