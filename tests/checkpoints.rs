//! Checkpoints end to end through the binary: each completion rule against a writer that
//! writes slowly, the flush on a notice, `spotguard ls`, start-up store checks, and failures
//! (spotguard killed mid-upload, the S3 server gone).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use spotguard_testkit::S3Server;
use support::{Proc, run_to_end, spotguard};

fn helper(name: &str) -> PathBuf {
    [env!("CARGO_MANIFEST_DIR"), "tests", "helpers", name]
        .iter()
        .collect()
}

/// `spotguard run` with the local default store under `state`, running `args`.
fn run_cmd(state: &Path, flags: &[&str], child: &[&str]) -> Command {
    let mut cmd = spotguard(state);
    cmd.arg("run").args(flags).arg("--").args(child);
    cmd
}

/// `spotguard ls --json` for the default job, as JSON.
fn ls(state: &Path, envs: &[(&str, String)], flags: &[&str]) -> serde_json::Value {
    let mut cmd = spotguard(state);
    cmd.args(["ls", "--json"])
        .args(flags)
        .envs(envs.iter().map(|(k, v)| (*k, v)));
    let f = Proc::start(cmd).finish();
    assert_eq!(f.code(), 0, "{}", f.stderr);
    serde_json::from_str(&f.stdout).unwrap_or_else(|e| panic!("{e}: {}", f.stdout))
}

/// Runs the slow writer in `mode`; returns the one committed checkpoint it produced, checked
/// to be whole: the first commit is the complete checkpoint, never a part of it.
fn slow_writer(mode: &str, settle: &str) -> serde_json::Value {
    let state = tempfile::tempdir().expect("tempdir");
    let writer = helper("slow_writer.py");
    let mut p = Proc::start(run_cmd(
        state.path(),
        &["--settle", settle],
        &["python3", writer.to_str().expect("utf-8"), mode],
    ));
    let complete = p.expect_stdout("complete ");
    let mut words = complete.split_whitespace().skip(1);
    let (name, bytes) = (
        words.next().expect("name").to_owned(),
        words.next().expect("bytes").to_owned(),
    );
    p.expect_stderr("checkpoint committed");
    drop(p.stdin.take());
    let f = p.finish();
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert!(
        !f.stderr.contains("upload failed"),
        "an upload started before the checkpoint was whole:\n{}",
        f.stderr
    );
    let list = ls(state.path(), &[], &[]);
    let ckpts = list["checkpoints"].as_array().expect("checkpoints");
    assert_eq!(ckpts.len(), 1, "{list}");
    let c = &ckpts[0];
    assert_eq!(c["seq"], 1);
    assert_eq!(c["name"], name.as_str());
    assert_eq!(
        c["bytes"].to_string(),
        bytes,
        "committed before the writer finished: {c}"
    );
    c.clone()
}

#[test]
fn rule_write_then_rename() {
    // Temporary names are ignored however long they sit still (settle 1s < the pauses).
    let c = slow_writer("rename", "1s");
    assert_eq!(c["rule"], "renamed");
    assert_eq!(c["files"], 2);
}

#[test]
fn rule_hugging_face_trainer_state_last() {
    let c = slow_writer("huggingface", "1s");
    assert_eq!(c["rule"], "huggingface");
    assert_eq!(c["files"], 3);
}

#[test]
fn rule_pytorch_dcp_metadata_last() {
    let c = slow_writer("dcp", "1s");
    assert_eq!(c["rule"], "pytorch-dcp");
    assert_eq!(c["files"], 3);
}

#[test]
fn rule_explicit_marker() {
    // A settle time longer than the test: only the marker can complete it.
    let c = slow_writer("marker", "1h");
    assert_eq!(c["rule"], "marker");
    assert_eq!(c["files"], 2);
}

#[test]
fn rule_quiescence_waits_for_open_files() {
    // The writer pauses longer than the settle time with its file still open.
    let c = slow_writer("quiescent", "1s");
    assert_eq!(c["rule"], "quiescent");
}

#[test]
fn rule_lightning_ckpt_once_closed() {
    let c = slow_writer("lightning", "1h");
    assert_eq!(c["rule"], "lightning");
    assert_eq!(c["kind"], "file");
}

/// On a notice the command saves (write-then-rename) and exits; that checkpoint is committed
/// before spotguard exits with the preempted code.
#[test]
fn a_notice_flushes_the_final_checkpoint_to_s3() {
    let s3 = S3Server::moto();
    let state = tempfile::tempdir().expect("tempdir");
    let train = [env!("CARGO_MANIFEST_DIR"), "examples", "train.py"]
        .iter()
        .collect::<PathBuf>();
    let mut cmd = run_cmd(
        state.path(),
        &["--store", &s3.url("jobs"), "--job", "demo"],
        &[
            "python3",
            train.to_str().expect("utf-8"),
            "--steps",
            "100000",
            "--save-every",
            "1000000",
            "--step-time",
            "0.001",
        ],
    );
    cmd.envs(s3.env());
    let p = Proc::start(cmd);
    p.expect_stdout("training from step 0");
    p.signal(Signal::SIGTERM);
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    let saved = f
        .stdout
        .lines()
        .find(|l| l.starts_with("stopping at step"))
        .expect("the command saved on SIGTERM");
    assert!(
        f.stderr.contains("the newest checkpoint is committed"),
        "{}",
        f.stderr
    );
    let list = ls(
        state.path(),
        &s3.env(),
        &["--store", &s3.url("jobs"), "--job", "demo"],
    );
    let newest = list["checkpoints"]
        .as_array()
        .expect("list")
        .last()
        .expect("one checkpoint")
        .clone();
    assert!(
        saved.contains(newest["name"].as_str().expect("name")),
        "{saved} vs {newest}"
    );
}

#[test]
fn ls_lists_commits_in_order_as_a_table_too() {
    let state = tempfile::tempdir().expect("tempdir");
    // Each checkpoint is written once the previous one is committed (a newer checkpoint
    // supersedes an older one still waiting).
    let script = r#"for i in 1 2; do d="$SPOTGUARD_CHECKPOINT_DIR"; mkdir "$d/.s$i"; echo $i > "$d/.s$i/w"; mv "$d/.s$i" "$d/step-$i"; read line; done"#;
    let mut p = Proc::start(run_cmd(state.path(), &[], &["sh", "-c", script]));
    use std::io::Write;
    for seq in ["seq=1", "seq=2"] {
        let line = p.expect_stderr(seq);
        assert!(line.contains("checkpoint committed"), "{line}");
        p.stdin
            .as_mut()
            .expect("stdin")
            .write_all(b"next\n")
            .expect("write");
    }
    drop(p.stdin.take());
    let f = p.finish();
    assert_eq!(f.code(), 0, "{}", f.stderr);
    let list = ls(state.path(), &[], &[]);
    let names: Vec<&str> = list["checkpoints"]
        .as_array()
        .expect("list")
        .iter()
        .map(|c| c["name"].as_str().expect("name"))
        .collect();
    assert_eq!(names, ["step-1", "step-2"], "{list}");
    let f = run_to_end(state.path(), &["ls"]);
    assert_eq!(f.code(), 0);
    let lines: Vec<&str> = f.stdout.lines().collect();
    assert!(
        lines[0].contains("SEQ") && lines[0].contains("NAME"),
        "{}",
        f.stdout
    );
    assert_eq!(lines.len(), 3, "{}", f.stdout);
}

/// Checkpoints written faster than they upload: the newest wins and sequence numbers follow
/// the order they were written, so "the newest committed" is the newest written.
#[test]
fn a_newer_checkpoint_supersedes_older_pending_ones() {
    let state = tempfile::tempdir().expect("tempdir");
    let script = r#"for i in 1 2 3 4 5; do d="$SPOTGUARD_CHECKPOINT_DIR"; mkdir "$d/.s$i"; echo $i > "$d/.s$i/w"; mv "$d/.s$i" "$d/step-$i"; done"#;
    let f = run_to_end(state.path(), &["run", "--", "sh", "-c", script]);
    assert_eq!(f.code(), 0, "{}", f.stderr);
    let list = ls(state.path(), &[], &[]);
    let ckpts = list["checkpoints"].as_array().expect("list");
    assert_eq!(ckpts.last().expect("some")["name"], "step-5", "{list}");
    let names: Vec<&str> = ckpts
        .iter()
        .map(|c| c["name"].as_str().expect("name"))
        .collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert_eq!(names, sorted, "sequence numbers out of write order: {list}");
}

#[test]
fn a_bad_store_fails_before_the_command_starts() {
    let state = tempfile::tempdir().expect("tempdir");
    let marker = state.path().join("child-ran");
    let touch = format!("touch {}", marker.display());
    let moto = S3Server::moto();
    let cases: Vec<(String, Vec<(&str, String)>)> = vec![
        ("ftp://example/x".into(), vec![]),
        ("s3://no-such-bucket/jobs".into(), moto.env()),
    ];
    for (url, envs) in cases {
        let mut cmd = run_cmd(state.path(), &["--store", &url], &["sh", "-c", &touch]);
        cmd.envs(envs);
        let f = Proc::start(cmd).finish_within(Duration::from_secs(60));
        assert_eq!(f.code(), 70, "{url}: {}", f.stderr);
        assert_eq!(
            f.stderr.lines().count(),
            1,
            "{url}: one line:\n{}",
            f.stderr
        );
        assert!(f.stderr.contains(&url), "{url}: {}", f.stderr);
        assert!(!marker.exists(), "{url}: the command ran");
    }
    // No credentials at all, and no instance role to fall back on.
    let mut cmd = run_cmd(
        state.path(),
        &["--store", "s3://spotguard-test/jobs"],
        &["sh", "-c", &touch],
    );
    cmd.envs(moto.env())
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY");
    let f = Proc::start(cmd).finish_within(Duration::from_secs(60));
    assert_eq!(f.code(), 70, "{}", f.stderr);
    assert!(f.stderr.contains("no credentials"), "{}", f.stderr);
    assert!(!marker.exists(), "the command ran");

    // Wrong credentials: s3s-fs checks signatures.
    let s3s = S3Server::s3s_fs();
    let mut cmd = run_cmd(
        state.path(),
        &["--store", &s3s.url("jobs")],
        &["sh", "-c", &touch],
    );
    cmd.envs(s3s.env())
        .env("AWS_SECRET_ACCESS_KEY", "not-the-secret");
    let f = Proc::start(cmd).finish_within(Duration::from_secs(60));
    assert_eq!(f.code(), 70, "{}", f.stderr);
    assert!(f.stderr.contains(&s3s.url("jobs")), "{}", f.stderr);
    assert!(!f.stderr.contains("not-the-secret"), "a secret in the log");
    assert!(!marker.exists(), "the command ran");
}

/// A 24 MiB checkpoint written by `sh`, renamed into place.
const BIG_CHECKPOINT: &str = r#"echo $$ > "$SPOTGUARD_STATE_DIR/child.pid"; d="$SPOTGUARD_CHECKPOINT_DIR"; mkdir "$d/.big"; head -c 25165824 /dev/urandom > "$d/.big/w.bin"; mv "$d/.big" "$d/big"; echo saved; exec sleep 600"#;

/// kill -9 spotguard mid-upload: no manifest names a partial object, and the next run (same
/// local dir) completes the checkpoint.
#[test]
fn kill_9_mid_upload_leaves_no_partial_checkpoint() {
    let s3 = S3Server::s3s_fs();
    let state = tempfile::tempdir().expect("tempdir");
    let flags = [
        "--store".to_owned(),
        s3.url("jobs"),
        "--part-size".into(),
        "5MiB".into(),
        "--upload-concurrency".into(),
        "1".into(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut cmd = spotguard(state.path());
    cmd.args(["-v", "run"])
        .args(&flags)
        .args(["--", "sh", "-c", BIG_CHECKPOINT])
        .envs(s3.env());
    let p = Proc::start(cmd);
    // In the middle of the multipart upload: a part is stored, more are to come.
    p.expect_stderr("part stored");
    p.signal(Signal::SIGKILL);
    let f = p.finish();
    assert!(
        !f.stderr.contains("checkpoint committed"),
        "too fast to interrupt; the test proves nothing:\n{}",
        f.stderr
    );
    let mut ls_flags = flags.clone();
    ls_flags.truncate(2);
    let list = ls(state.path(), &s3.env(), &ls_flags);
    assert_eq!(
        list["checkpoints"],
        serde_json::json!([]),
        "a manifest after kill -9 mid-upload"
    );
    // The SIGKILLed spotguard could not stop its command: end that process group here.
    let pid_file = state.path().join("jobs/default/child.pid");
    let pgid: i32 = std::fs::read_to_string(&pid_file)
        .expect("child pid")
        .trim()
        .parse()
        .expect("pid");
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid), Signal::SIGKILL);

    // The next run finds the complete checkpoint in the same dir and commits it.
    let mut cmd = run_cmd(state.path(), &flags, &["true"]);
    cmd.envs(s3.env());
    let f = Proc::start(cmd).finish_within(Duration::from_secs(60));
    assert_eq!(f.code(), 0, "{}", f.stderr);
    // The multipart upload the killed run left behind is aborted, its record removed.
    assert!(
        f.stderr
            .contains("aborted 1 multipart upload(s) an earlier run left unfinished"),
        "{}",
        f.stderr
    );
    let uploads = s3.root().join("root/spotguard-test/jobs/default/uploads");
    let left = std::fs::read_dir(&uploads).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "upload records left in {}", uploads.display());
    let list = ls(state.path(), &s3.env(), &ls_flags);
    let c = &list["checkpoints"][0];
    assert_eq!(
        (c["name"].as_str(), c["bytes"].as_u64()),
        (Some("big"), Some(25_165_824)),
        "{list}"
    );
}

/// The store goes away: failures are loud, and a final commit that cannot happen exits 74.
#[test]
fn an_unreachable_store_at_the_end_exits_74() {
    let mut s3 = S3Server::moto();
    let state = tempfile::tempdir().expect("tempdir");
    let script = r#"read line; d="$SPOTGUARD_CHECKPOINT_DIR"; mkdir "$d/.s"; echo w > "$d/.s/w"; mv "$d/.s" "$d/step-1""#;
    let mut cmd = run_cmd(
        state.path(),
        &["--store", &s3.url("jobs")],
        &["sh", "-c", script],
    );
    cmd.envs(s3.env());
    let mut p = Proc::start(cmd);
    p.expect_stderr("checkpoints are uploaded as they complete");
    s3.stop();
    use std::io::Write;
    p.stdin
        .as_mut()
        .expect("stdin")
        .write_all(b"go\n")
        .expect("write");
    let f = p.finish_within(Duration::from_secs(120));
    assert_eq!(f.code(), 74, "{}", f.stderr);
    assert!(
        f.stderr.contains("failed, retrying in"),
        "each failure is logged:\n{}",
        f.stderr
    );
    assert!(
        f.stderr
            .contains("the newest checkpoint could not be made durable"),
        "{}",
        f.stderr
    );
}

/// The S3 server goes away mid-upload and comes back: the failure is logged, the upload is
/// retried, and what is committed is whole (restored byte for byte).
#[test]
fn the_server_stopping_mid_upload_is_retried_and_nothing_partial_is_committed() {
    let mut s3 = S3Server::s3s_fs();
    let state = tempfile::tempdir().expect("tempdir");
    let flags = [
        "--store".to_owned(),
        s3.url("jobs"),
        "--part-size".into(),
        "5MiB".into(),
        "--upload-concurrency".into(),
        "1".into(),
    ];
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let script = r#"d="$SPOTGUARD_CHECKPOINT_DIR"; mkdir "$d/.big"; head -c 25165824 /dev/urandom > "$d/.big/w.bin"; mv "$d/.big" "$d/big"; read line || true"#;
    let mut cmd = spotguard(state.path());
    cmd.args(["-v", "run"])
        .args(&flags)
        .args(["--", "sh", "-c", script])
        .envs(s3.env());
    let mut p = Proc::start(cmd);
    // Parts are going in: stop the server in the middle of the multipart upload.
    p.expect_stderr("part stored");
    s3.stop();
    p.expect_stderr("failed, retrying in");
    s3.restart();
    p.expect_stderr("checkpoint committed");
    drop(p.stdin.take());
    let f = p.finish_within(Duration::from_secs(120));
    assert_eq!(f.code(), 0, "{}", f.stderr);

    let restored = state.path().join("restored");
    let mut cmd = spotguard(state.path());
    cmd.args(["resume", "--store", &s3.url("jobs"), "--to"])
        .arg(&restored)
        .envs(s3.env());
    let r = Proc::start(cmd).finish_within(Duration::from_secs(60));
    assert_eq!(r.code(), 0, "{}", r.stderr);
    let original =
        std::fs::read(state.path().join("jobs/default/checkpoints/big/w.bin")).expect("original");
    let copy = std::fs::read(restored.join("big/w.bin")).expect("restored");
    assert_eq!(original.len(), 25_165_824);
    assert!(
        original == copy,
        "the committed checkpoint differs from what was written"
    );
}
