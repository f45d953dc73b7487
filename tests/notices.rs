//! Every notice source against the fake metadata server, which speaks each cloud's protocol:
//! the notice is detected, written to `notice.json`, and the command is told to stop.

mod support;

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, SystemTime};

use nix::sys::signal::Signal;
use support::{FakeCloud, NOTICE_CHILD, Proc, printed_notice, spotguard};

/// spotguard watching `cloud` at `fake`, running [`NOTICE_CHILD`].
fn watching(state: &std::path::Path, cloud: &str, fake: &FakeCloud, extra: &[&str]) -> Command {
    let mut cmd = spotguard(state);
    cmd.args([
        "run",
        "--cloud",
        cloud,
        "--poll-interval",
        "100ms",
        "--metadata-endpoint",
        &fake.url(),
    ])
    .args(extra)
    .args(["--", "sh", "-c", NOTICE_CHILD]);
    cmd
}

/// Starts, preempts through the fake, and returns the notice the child was shown.
fn preempt(cloud: &str, fake: &FakeCloud, body: serde_json::Value) -> serde_json::Value {
    let state = tempfile::tempdir().expect("tempdir");
    let p = Proc::start(watching(state.path(), cloud, fake, &[]));
    p.expect_stdout("ready");
    fake.control("preempt", body);
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    let notice = printed_notice(&f.stdout);
    assert_eq!(notice["source"], cloud, "{notice}");
    assert_eq!(notice["kind"], "terminate", "{notice}");
    notice
}

fn seconds_from_now(notice: &serde_json::Value) -> f64 {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    notice["deadline_unix"].as_f64().expect("deadline") - now
}

fn in_secs(secs: u64, fmt: &str) -> String {
    // Formats via Python's strftime-compatible pattern using `date`, in UTC.
    let out = Command::new("date")
        .args(["-u", "-d", &format!("+{secs} seconds"), &format!("+{fmt}")])
        .output()
        .expect("date");
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_owned()
}

#[test]
fn aws_spot_interruption_with_imdsv2_tokens_only() {
    let fake = FakeCloud::start("aws", &[]);
    let time = in_secs(100, "%Y-%m-%dT%H:%M:%SZ");
    let notice = preempt("aws", &fake, serde_json::json!({ "time": time }));
    assert_eq!(notice["deadline"], time.as_str());
    assert_eq!(notice["detail"], "spot instance-action: terminate");
    let log = fake.log();
    assert_eq!(
        log["violations"],
        serde_json::json!([]),
        "AWS metadata read without a token"
    );
    let requests = log["requests"].as_array().expect("requests");
    assert!(
        requests
            .iter()
            .any(|r| r["method"] == "PUT" && r["path"] == "/latest/api/token")
    );
    assert!(
        requests
            .iter()
            .all(|r| r["method"] == "PUT" || r["headers"]["x-aws-ec2-metadata-token"].is_string()),
        "every GET carries the token"
    );
}

#[test]
fn aws_rebalance_hint_sends_the_checkpoint_signal_and_tokens_are_renewed() {
    let fake = FakeCloud::start("aws", &[]);
    let state = tempfile::tempdir().expect("tempdir");
    let p = Proc::start(watching(
        state.path(),
        "aws",
        &fake,
        &["--checkpoint-signal", "USR1", "-v"],
    ));
    p.expect_stdout("ready");
    fake.control("rebalance", serde_json::json!({}));
    p.expect_stdout("checkpoint");
    p.expect_stderr("checkpoint hint: rebalance recommendation");
    // The token spotguard holds is now refused: it must renew it, not give up or go tokenless.
    fake.control("expire-tokens", serde_json::json!({}));
    fake.control("preempt", serde_json::json!({}));
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    assert_eq!(printed_notice(&f.stdout)["source"], "aws");
    let log = fake.log();
    let requests = log["requests"].as_array().expect("requests");
    let puts = requests.iter().filter(|r| r["method"] == "PUT").count();
    assert!(puts >= 2, "token renewed after 401: {puts} token requests");
    assert!(requests.iter().any(|r| r["status"] == 401));
    assert_eq!(log["violations"], serde_json::json!([]));
    // Tokens are secrets: none may reach the logs, even at -v.
    for r in requests {
        if let Some(token) = r["headers"]["x-aws-ec2-metadata-token"].as_str() {
            assert!(!f.stderr.contains(token), "token leaked into the log");
        }
    }
}

#[test]
fn aws_scheduled_instance_stop_soon_is_a_termination() {
    let fake = FakeCloud::start("aws", &[]);
    let state = tempfile::tempdir().expect("tempdir");
    let p = Proc::start(watching(state.path(), "aws", &fake, &[]));
    p.expect_stdout("ready");
    let when = in_secs(90, "%d %b %Y %H:%M:%S GMT");
    fake.control(
        "maintenance",
        serde_json::json!({"Code": "instance-stop", "EventId": "instance-event-1", "NotBefore": when,
                           "NotAfter": when, "State": "active", "Description": "The instance is scheduled for stop"}),
    );
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    let notice = printed_notice(&f.stdout);
    assert!(
        notice["detail"]
            .as_str()
            .expect("detail")
            .contains("instance-stop")
    );
    let left = seconds_from_now(&notice);
    assert!(
        (60.0..=95.0).contains(&left),
        "deadline from NotBefore: {left}s"
    );
}

#[test]
fn gcp_preempted_through_a_hanging_get() {
    let fake = FakeCloud::start("gcp", &[]);
    let notice = preempt("gcp", &fake, serde_json::json!({}));
    assert_eq!(notice["detail"], "instance/preempted = TRUE");
    let log = fake.log();
    let requests = log["requests"].as_array().expect("requests");
    assert!(
        requests
            .iter()
            .all(|r| r["headers"]["metadata-flavor"] == "Google")
    );
    assert!(
        requests.iter().any(|r| {
            let path = r["path"].as_str().unwrap_or_default();
            path.starts_with("/computeMetadata/v1/instance/preempted?wait_for_change=true")
                && path.contains("last_etag=")
        }),
        "no hanging GET with last_etag: {requests:?}"
    );
}

#[test]
fn gcp_terminate_on_host_maintenance() {
    let fake = FakeCloud::start("gcp", &[]);
    let state = tempfile::tempdir().expect("tempdir");
    let p = Proc::start(watching(state.path(), "gcp", &fake, &[]));
    p.expect_stdout("ready");
    fake.control(
        "maintenance",
        serde_json::json!({"value": "MIGRATE_ON_HOST_MAINTENANCE"}),
    );
    fake.control(
        "maintenance",
        serde_json::json!({"value": "TERMINATE_ON_HOST_MAINTENANCE"}),
    );
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    assert_eq!(
        printed_notice(&f.stdout)["detail"],
        "maintenance-event = TERMINATE_ON_HOST_MAINTENANCE"
    );
}

#[test]
fn azure_preempt_for_this_vm_is_acknowledged_and_others_are_ignored() {
    let fake = FakeCloud::start("azure", &[]);
    let state = tempfile::tempdir().expect("tempdir");
    let p = Proc::start(watching(
        state.path(),
        "azure",
        &fake,
        &["--checkpoint-signal", "USR1"],
    ));
    p.expect_stdout("ready");
    // Another VM of the availability set is preempted: not us.
    fake.control(
        "preempt",
        serde_json::json!({"id": "OTHER-1", "resources": ["vm-other"]}),
    );
    // A reboot of ours is a hint; once it has been seen, the event before it was seen too.
    fake.control(
        "preempt",
        serde_json::json!({"id": "REBOOT-1", "type": "Reboot"}),
    );
    p.expect_stdout("checkpoint");
    fake.control("preempt", serde_json::json!({"id": "PREEMPT-1"}));
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    let notice = printed_notice(&f.stdout);
    assert_eq!(notice["event_id"], "PREEMPT-1");
    let left = seconds_from_now(&notice);
    assert!(
        (0.0..=31.0).contains(&left),
        "deadline from NotBefore: {left}s"
    );
    let log = fake.log();
    assert_eq!(log["acked"], serde_json::json!(["PREEMPT-1"]));
    let requests = log["requests"].as_array().expect("requests");
    assert!(requests.iter().all(|r| r["headers"]["metadata"] == "true"));
}

#[test]
fn aliyun_plain_and_hardened_modes() {
    for extra in [&[][..], &["--hardened"][..]] {
        let fake = FakeCloud::start("aliyun", extra);
        let time = in_secs(300, "%Y-%m-%dT%H:%M:%SZ");
        let notice = preempt("aliyun", &fake, serde_json::json!({ "time": time }));
        assert_eq!(notice["deadline"], time.as_str());
        assert_eq!(fake.log()["violations"], serde_json::json!([]), "{extra:?}");
    }
}

#[test]
fn tencent_termination_time_is_beijing_time() {
    let fake = FakeCloud::start("tencent", &[]);
    // 120 s from now, written as Tencent does: `YYYY-MM-DD hh:mm:ss` in UTC+8.
    let local = in_secs(120 + 8 * 3600, "%Y-%m-%d %H:%M:%S");
    let notice = preempt("tencent", &fake, serde_json::json!({ "time": local }));
    let left = seconds_from_now(&notice);
    assert!(
        (100.0..=121.0).contains(&left),
        "UTC+8 read as UTC? deadline in {left}s"
    );
}

#[test]
fn volcengine_termination_time() {
    let fake = FakeCloud::start("volcengine", &[]);
    let time = in_secs(300, "%Y-%m-%dT%H:%M:%SZ");
    let notice = preempt("volcengine", &fake, serde_json::json!({ "time": time }));
    assert_eq!(notice["deadline"], time.as_str());
}

/// Points every cloud's endpoint override at `addr` except those given.
fn all_endpoints(cmd: &mut Command, addr: &str) {
    for var in [
        "AWS_EC2_METADATA_SERVICE_ENDPOINT",
        "GCE_METADATA_HOST",
        "SPOTGUARD_AZURE_METADATA_ENDPOINT",
        "SPOTGUARD_ALIYUN_METADATA_ENDPOINT",
        "SPOTGUARD_TENCENT_METADATA_ENDPOINT",
        "SPOTGUARD_VOLCENGINE_METADATA_ENDPOINT",
    ] {
        cmd.env(var, addr);
    }
}

#[test]
fn auto_detection_finds_the_cloud_that_answers() {
    let fake = FakeCloud::start("gcp", &[]);
    // Nothing listens on the others' port: connection refused, as off-cloud.
    let closed = TcpListener::bind("127.0.0.1:0").expect("bind");
    let closed_addr = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    all_endpoints(&mut cmd, &closed_addr);
    cmd.env("GCE_METADATA_HOST", &fake.addr).args([
        "run",
        "--cloud",
        "auto",
        "--",
        "sh",
        "-c",
        NOTICE_CHILD,
    ]);
    let p = Proc::start(cmd);
    p.expect_stdout("ready");
    p.expect_stderr("cloud metadata service found");
    fake.control("preempt", serde_json::json!({}));
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    assert_eq!(printed_notice(&f.stdout)["source"], "gcp");
}

/// A metadata address that accepts connections and never answers must not delay the command
/// or spotguard's exit, and costs one quiet line.
#[test]
fn auto_detection_never_hangs_on_a_silent_endpoint() {
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = format!("http://{}", silent.local_addr().expect("addr"));
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    all_endpoints(&mut cmd, &addr);
    cmd.args([
        "run",
        "--cloud",
        "auto",
        "--",
        "sh",
        "-c",
        "echo ready; read line; echo bye",
    ]);
    let mut p = Proc::start(cmd);
    p.expect_stdout("ready");
    let line = p.expect_stderr("no cloud metadata service answered");
    assert!(line.contains("INFO"), "{line}");
    drop(p.stdin.take());
    let f = p.finish_within(Duration::from_secs(10));
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert!(f.stdout.contains("bye"));
    drop(silent);
}

#[test]
fn an_exiting_command_does_not_wait_for_detection() {
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = format!("http://{}", silent.local_addr().expect("addr"));
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    all_endpoints(&mut cmd, &addr);
    cmd.args(["run", "--cloud", "auto", "--", "true"]);
    let f = Proc::start(cmd).finish_within(Duration::from_secs(10));
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert!(
        !f.stderr.contains("no cloud metadata service answered"),
        "exit waited for detection"
    );
}

#[test]
fn sigterm_to_spotguard_is_a_notice_with_the_grace_period() {
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    cmd.args(["run", "--grace", "45s", "--", "sh", "-c", NOTICE_CHILD]);
    let p = Proc::start(cmd);
    p.expect_stdout("ready");
    p.signal(Signal::SIGTERM);
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    let notice = printed_notice(&f.stdout);
    assert_eq!(notice["source"], "signal");
    assert_eq!(notice["signal"], "SIGTERM");
    let warning = notice["warning_seconds"].as_f64().expect("warning");
    assert!((44.0..=45.0).contains(&warning), "{warning}");
}

#[test]
fn slurm_style_notice_signal_with_its_own_lead_time() {
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    cmd.args([
        "run",
        "--notice-signal",
        "USR1@120s",
        "--",
        "sh",
        "-c",
        NOTICE_CHILD,
    ]);
    let p = Proc::start(cmd);
    p.expect_stdout("ready");
    p.signal(Signal::SIGUSR1);
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    let notice = printed_notice(&f.stdout);
    assert_eq!(notice["signal"], "SIGUSR1");
    assert!(
        !f.stdout.contains("checkpoint"),
        "the notice signal is not forwarded as itself"
    );
    let warning = notice["warning_seconds"].as_f64().expect("warning");
    assert!((119.0..=120.0).contains(&warning), "{warning}");
}

#[test]
fn simulate_preemption_rehearses_with_the_stop_signal() {
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    cmd.args(["run", "--simulate-preemption", "200ms", "--stop-signal", "USR2", "--", "sh", "-c"])
        .arg(r#"trap 'echo notice; cat "$SPOTGUARD_NOTICE_FILE"; exit 0' USR2; echo ready; while :; do sleep 30 & wait $!; done"#);
    let f = Proc::start(cmd).finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    assert_eq!(printed_notice(&f.stdout)["source"], "simulated");
}

#[test]
fn a_stale_notice_file_is_removed_at_start() {
    let state = tempfile::tempdir().expect("tempdir");
    let notice = state.path().join("jobs/default/notice.json");
    std::fs::create_dir_all(notice.parent().expect("parent")).expect("mkdir");
    std::fs::write(&notice, "{}").expect("write");
    let f = support::run_to_end(
        state.path(),
        &[
            "run",
            "--",
            "sh",
            "-c",
            r#"test ! -e "$SPOTGUARD_NOTICE_FILE""#,
        ],
    );
    assert_eq!(
        f.code(),
        0,
        "an old notice was shown to the new run\n{}",
        f.stderr
    );
}
