//! The idle watchdog and the metrics endpoint, with real children (and a stand-in
//! `nvidia-smi` on the PATH for the GPU side).

mod support;

use std::path::Path;

use nix::sys::signal::Signal;
use support::{Proc, spotguard};

/// A dir with an `nvidia-smi` that reports `util` percent for two GPUs, put first on PATH.
fn fake_gpus(dir: &Path, util: u32) -> String {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("mkdir");
    let smi = bin.join("nvidia-smi");
    std::fs::write(&smi, format!("#!/bin/sh\necho {util}\necho 0\n")).expect("write");
    std::fs::set_permissions(&smi, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// `spotguard run` with a 2 s idle timeout whose `--on-idle` prints `on-idle ran after Ns`
/// (spotguard's stdout is the command's and --on-idle's).
fn watched(state: &Path, child: &str, path: Option<&str>) -> Proc {
    let store = state.join("store");
    let mut cmd = spotguard(state);
    cmd.args([
        "run",
        "--store",
        store.to_str().expect("utf-8"),
        "--job",
        "idle",
        "--idle-timeout",
        "2s",
    ])
    .args([
        "--on-idle",
        "echo \"on-idle ran after ${SPOTGUARD_IDLE_SECONDS}s\"",
    ])
    .args(["--", "sh", "-c", child]);
    if let Some(p) = path {
        cmd.env("PATH", p);
    }
    Proc::start(cmd)
}

#[test]
fn fires_for_an_idle_command_runs_on_idle_and_records_it() {
    let state = tempfile::tempdir().expect("tempdir");
    let p = watched(state.path(), "echo ready; sleep 60", None);
    p.expect_stdout("ready");
    let line = p.expect_stderr("has been idle for");
    assert!(line.contains("no GPU"), "{line}");
    let ran = p.expect_stdout("on-idle ran after");
    p.signal(Signal::SIGTERM);
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    let secs: u64 = ran
        .trim()
        .trim_start_matches("on-idle ran after ")
        .trim_end_matches('s')
        .parse()
        .expect("seconds");
    assert!(secs >= 2, "idle for {secs}s, timeout 2s");
    assert_eq!(f.stdout.matches("on-idle ran").count(), 1, "{}", f.stdout);
    assert_eq!(
        f.stderr.matches("has been idle for").count(),
        1,
        "fires once per idle stretch"
    );
    let store = state.path().join("store");
    let f = support::run_to_end(
        state.path(),
        &[
            "status",
            "--store",
            store.to_str().expect("utf-8"),
            "--job",
            "idle",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&f.stdout).expect("status JSON");
    let idle = &v["attempts"][0]["idle"];
    assert_eq!(idle.as_array().map(Vec::len), Some(1), "{v}");
    assert!(
        idle[0]["cpu_percent"].as_f64().expect("cpu") < 5.0,
        "{idle}"
    );
    assert_eq!(idle[0]["on_idle_status"], 0, "{idle}");
}

#[test]
fn stays_quiet_for_a_busy_command() {
    let state = tempfile::tempdir().expect("tempdir");
    // Busy on CPU for 6 s: three idle timeouts' worth.
    let p = watched(
        state.path(),
        "end=$(($(date +%s) + 6)); while [ $(date +%s) -lt $end ]; do :; done",
        None,
    );
    let f = p.finish();
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert!(!f.stderr.contains("idle for"), "{}", f.stderr);
    assert!(!f.stdout.contains("on-idle ran"), "{}", f.stdout);
}

#[test]
fn a_busy_gpu_is_not_idle_and_an_idle_one_is() {
    let busy = tempfile::tempdir().expect("tempdir");
    let path = fake_gpus(busy.path(), 87);
    let f = watched(busy.path(), "sleep 6", Some(&path)).finish();
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert!(
        !f.stderr.contains("idle for"),
        "GPU at 87% is busy:\n{}",
        f.stderr
    );

    let idle = tempfile::tempdir().expect("tempdir");
    let path = fake_gpus(idle.path(), 1);
    let p = watched(idle.path(), "echo ready; sleep 60", Some(&path));
    let line = p.expect_stderr("has been idle for");
    assert!(line.contains("GPU at most 1%"), "{line}");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// One scrape, which must succeed. Callers first await the log line that follows the update
/// they look for (spotguard counts before it logs).
fn scrape(addr: &str) -> String {
    let (status, body) = support::http(addr, "GET", "/metrics", "");
    assert_eq!(status, 200, "{body}");
    body
}

#[test]
fn metrics_parse_as_prometheus_exposition_format() {
    let state = tempfile::tempdir().expect("tempdir");
    let store = state.path().join("store");
    let addr = format!("127.0.0.1:{}", free_port());
    let mut cmd = spotguard(state.path());
    cmd.args(["run", "--store", store.to_str().expect("utf-8"), "--job", "m", "--metrics-addr", &addr, "--", "sh", "-c"])
        .arg(r#"printf 'weights' > "$SPOTGUARD_CHECKPOINT_DIR/a.tmp" && mv "$SPOTGUARD_CHECKPOINT_DIR/a.tmp" "$SPOTGUARD_CHECKPOINT_DIR/step-1.pt"
echo ready
trap 'while [ ! -e "$0" ]; do sleep 0.1; done; exit 0' TERM
while :; do sleep 30 & wait $!; done"#)
        .arg(state.path().join("go"));
    let p = Proc::start(cmd);
    p.expect_stdout("ready");
    p.expect_stderr("checkpoint committed");
    let body = scrape(&addr);
    assert!(
        body.contains("spotguard_checkpoints_committed_total 1\n"),
        "{body}"
    );
    assert!(body.contains("spotguard_last_checkpoint_bytes 7"), "{body}");
    assert!(body.contains("spotguard_uploaded_bytes_total 7"), "{body}");
    p.signal(Signal::SIGTERM);
    p.expect_stderr("preemption notice");
    let body = scrape(&addr);
    assert!(body.contains("SIGTERM\",kind=\"terminate\"} 1"), "{body}");

    // The reference parser (prometheus_client, installed by scripts/test) accepts it whole.
    let check = r#"
import sys
from prometheus_client.parser import text_string_to_metric_families
families = {f.name: f for f in text_string_to_metric_families(sys.stdin.read())}
for name in ["spotguard_checkpoints_committed", "spotguard_last_checkpoint_age_seconds",
             "spotguard_last_checkpoint_bytes", "spotguard_uploaded_bytes",
             "spotguard_upload_failures", "spotguard_notices", "spotguard_restore_seconds"]:
    assert name in families, (name, sorted(families))
assert families["spotguard_notices"].type == "counter"
print("parsed", len(families))
"#;
    let mut py = std::process::Command::new("python3");
    py.args(["-c", check]).stdin(std::process::Stdio::piped());
    let mut py = Proc::start(py);
    {
        use std::io::Write;
        let mut stdin = py.stdin.take().expect("stdin");
        stdin.write_all(body.as_bytes()).expect("write");
    }
    let f = py.finish();
    assert!(
        f.status.success() && f.stdout.contains("parsed"),
        "{}\n{}",
        f.stderr,
        body
    );
    let (status, _) = support::http(&addr, "GET", "/nope", "");
    assert_eq!(status, 404);
    std::fs::write(state.path().join("go"), "").expect("write");
    assert_eq!(p.finish().code(), 75);
}
