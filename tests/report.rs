//! `spotguard report`: figures checked against a scripted ledger whose every time is known,
//! a real preempted run's ledger, and the HTML page rendered in headless Chromium.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::{FakeCloud, Proc, run_to_end, spotguard};

const T0: &str = "2026-01-01T00:00:00Z";

fn at(secs: u64) -> String {
    let t0 = humantime::parse_rfc3339(T0).expect("T0");
    humantime::format_rfc3339_millis(t0 + Duration::from_secs(secs)).to_string()
}

fn commit(seq: u64, taken: u64, upload: u64, write: f64) -> Value {
    json!({"seq": seq, "name": format!("step-{seq}"), "committed": at(taken + upload),
           "bytes": 1_000_000 * seq, "sent_bytes": 1_000_000, "upload_seconds": upload,
           "write_seconds": write})
}

/// Two attempts whose every time is known:
/// 1. g5.xlarge spot, from 0: checkpoints taken at 1200 and 2400 (10 s uploads, 30 s
///    writes), AWS notice at 3000 with 120 s warning, command out at 3020, final upload
///    done at 3050: lost 600 s (3000 − 2400), useful 3050 − 600 − 30 = 2420 s.
/// 2. from 3300, restore 60 s, one checkpoint taken at 3300 + 1200, completed at
///    3300 + 2000 after a 15 s final upload: useful 2000 − 60 − 15 = 1925 s.
fn write_ledger(store: &Path, job: &str) {
    let dir = store.join(job).join("attempts");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let a1 = json!({
        "format": 1, "id": "00000000000000000001-1",
        "instance": {"hostname": "spot-a", "cloud": "aws", "instance_type": "g5.xlarge",
                     "zone": "us-east-1a", "lifecycle": "spot"},
        "started": at(0), "updated": at(3050), "ended": at(3050),
        "outcome": "preempted", "exit_status": 75, "resumed_from": null, "last_committed": null,
        "notice": {"source": "aws", "received": at(3000), "deadline": at(3120),
                   "warning_seconds": 120.0, "stop_seconds": 20.0, "upload_seconds": 30.0,
                   "durable_in_time": true},
        "time_lost_seconds": 600.0, "wall_seconds": 3050.0, "restore_seconds": null,
        "final_upload_seconds": 30.0,
        "checkpoints": [commit(1, 1200, 10, 30.0), commit(2, 2400, 10, 30.0)],
        "idle": [],
    });
    let a2 = json!({
        "format": 1, "id": "00000000000000000002-1",
        "instance": {"hostname": "spot-b", "cloud": "aws", "instance_type": "g5.xlarge",
                     "lifecycle": "spot"},
        "started": at(3300), "updated": at(5300), "ended": at(5300),
        "outcome": "completed", "exit_status": 0, "resumed_from": null, "last_committed": null,
        "notice": null, "time_lost_seconds": null, "wall_seconds": 2000.0,
        "restore_seconds": 60.0, "final_upload_seconds": 15.0,
        "checkpoints": [commit(3, 4500, 10, 30.0)],
        "idle": [],
    });
    for a in [a1, a2] {
        let id = a["id"].as_str().expect("id").to_owned();
        std::fs::write(dir.join(format!("{id}.json")), a.to_string()).expect("write");
    }
}

/// `spotguard report --store STORE --job JOB EXTRA...`, run to its end.
fn report(state: &Path, store: &str, job: &str, extra: &[&str]) -> support::Finished {
    let mut args = vec!["report", "--store", store, "--job", job];
    args.extend_from_slice(extra);
    run_to_end(state, &args)
}

fn close(got: &Value, want: f64, what: &str) {
    let g = got
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: not a number: {got}"));
    assert!((g - want).abs() < 1e-6, "{what}: got {g}, want {want}");
}

#[test]
fn figures_match_a_scripted_ledger() {
    let state = tempfile::tempdir().expect("tempdir");
    let store = state.path().join("store");
    write_ledger(&store, "ft");
    let s = store.to_str().expect("utf-8");
    let f = report(
        state.path(),
        s,
        "ft",
        &["--json", "--price", "1.0", "--on-demand-price", "3.0"],
    );
    assert_eq!(f.code(), 0, "{}", f.stderr);
    let r: Value = serde_json::from_str(&f.stdout).expect("report JSON");
    let t = &r["totals"];
    assert_eq!(t["attempts"], 2);
    assert_eq!(t["preemptions"], 1);
    assert_eq!(t["completed"], true);
    close(&t["wall"], 5050.0, "wall");
    close(&t["billable"], 5050.0, "billable");
    close(&t["lost"], 600.0, "lost work");
    close(&t["restore"], 60.0, "restore");
    close(&t["final_upload"], 45.0, "final uploads");
    close(&t["useful"], 2420.0 + 1925.0, "useful");
    close(&t["cadence"], 1200.0, "cadence");
    assert_eq!(t["notices_durable_in_time"], 1);
    let c = &r["cost"];
    close(&c["total"], 5050.0 / 3600.0, "cost");
    close(
        &c["on_demand_equivalent"],
        4345.0 / 3600.0 * 3.0,
        "on-demand equivalent",
    );
    close(
        &c["saving"],
        4345.0 / 3600.0 * 3.0 - 5050.0 / 3600.0,
        "saving",
    );
    close(&c["lost"], 600.0 / 3600.0, "lost work's cost");
    close(&c["overhead"], (60.0 + 45.0) / 3600.0, "overhead's cost");
    let a = &r["advice"];
    close(&a["checkpoint_cost"], 30.0, "C");
    close(&a["mtbp"], 5050.0, "M (observed: wall / preemptions)");
    close(
        &a["interval"],
        (2.0_f64 * 30.0 * 5050.0).sqrt(),
        "sqrt(2CM)",
    );
    close(
        &a["waste_current"],
        30.0 / 1200.0 + 1200.0 / (2.0 * 5050.0),
        "waste now",
    );
    let ti = (2.0_f64 * 30.0 * 5050.0).sqrt();
    close(
        &a["waste_advised"],
        30.0 / ti + ti / (2.0 * 5050.0),
        "waste advised",
    );
    let lane = &r["attempts"][0];
    close(&lane["notice"]["at"], 3000.0, "notice offset");
    close(
        &lane["checkpoints"][1]["taken"],
        2400.0,
        "checkpoint offset",
    );
    close(
        &r["attempts"][1]["start_offset"],
        3300.0,
        "second lane's offset",
    );

    // The terminal table says the same.
    let f = report(
        state.path(),
        s,
        "ft",
        &["--price", "1", "--on-demand-price", "3"],
    );
    assert_eq!(f.code(), 0, "{}", f.stderr);
    for needle in [
        "2 attempt(s), 1 preemption(s)",
        "lost work",
        "10m00s",
        "saving",
        "$1.40",
        "advised: one every 9m10s",
    ] {
        assert!(f.stdout.contains(needle), "no {needle:?} in\n{}", f.stdout);
    }
}

#[test]
fn prices_by_instance_type_and_bad_input() {
    let state = tempfile::tempdir().expect("tempdir");
    let store = state.path().join("store");
    write_ledger(&store, "ft");
    let s = store.to_str().expect("utf-8");
    let prices = state.path().join("prices.txt");
    std::fs::write(&prices, "# type spot on-demand\ng5.xlarge 0.5 1.5\n* 9 9\n").expect("write");
    let p = prices.to_str().expect("utf-8");
    let f = report(state.path(), s, "ft", &["--json", "--prices", p]);
    assert_eq!(f.code(), 0, "{}", f.stderr);
    let r: Value = serde_json::from_str(&f.stdout).expect("JSON");
    close(
        &r["cost"]["total"],
        5050.0 / 3600.0 * 0.5,
        "cost at the g5.xlarge price",
    );

    std::fs::write(&prices, "g5.xlarge 0.5\n").expect("write");
    let f = report(state.path(), s, "ft", &["--prices", p]);
    assert_eq!(f.code(), 2);
    assert!(
        f.stderr.contains("line 1") && f.stderr.trim().lines().count() == 1,
        "{}",
        f.stderr
    );
    let f = report(state.path(), s, "ft", &["--price", "1"]);
    assert_eq!(f.code(), 2, "{}", f.stderr);
    let f = report(state.path(), s, "nope", &[]);
    assert_eq!(f.code(), 3, "{}", f.stderr);
    assert!(f.stderr.contains("no attempts"), "{}", f.stderr);
}

/// A checkpoint, then a spot notice from each cloud's (fake) metadata service: the ledger
/// has the machine as that service describes it, the commit, the notice and its timings, and
/// the report prices it.
#[test]
fn a_preempted_run_lands_in_the_ledger_and_the_report() {
    for (cloud, ty, zone, lifecycle) in [
        ("aws", Some("g5.xlarge"), "us-east-1a", Some("spot")),
        ("gcp", Some("a2-highgpu-1g"), "us-central1-a", Some("spot")),
        ("azure", Some("Standard_NC6s_v3"), "eastus-1", Some("spot")),
        (
            "aliyun",
            Some("ecs.gn7i-c8g1.2xlarge"),
            "cn-hangzhou-i",
            None,
        ),
        ("tencent", None, "ap-guangzhou-3", Some("spot")),
    ] {
        preempted_run_in_the_ledger(cloud, ty, zone, lifecycle);
    }
}

fn preempted_run_in_the_ledger(cloud: &str, ty: Option<&str>, zone: &str, lifecycle: Option<&str>) {
    let state = tempfile::tempdir().expect("tempdir");
    let store = state.path().join("store");
    let s = store.to_str().expect("utf-8");
    let fake = FakeCloud::start(cloud, &[]);
    let mut cmd = spotguard(state.path());
    cmd.args(["run", "--store", s, "--job", "led", "--cloud", cloud, "--metadata-endpoint", &fake.url(), "--poll-interval", "100ms", "--", "sh", "-c"])
        .arg(r#"trap 'echo stopping; exit 0' TERM
printf 'weights' > "$SPOTGUARD_CHECKPOINT_DIR/step-1.tmp" && mv "$SPOTGUARD_CHECKPOINT_DIR/step-1.tmp" "$SPOTGUARD_CHECKPOINT_DIR/step-1.pt"
echo saved
while :; do sleep 30 & wait $!; done"#);
    let p = Proc::start(cmd);
    p.expect_stdout("saved");
    p.expect_stderr("checkpoint committed");
    fake.control("preempt", json!({}));
    let f = p.finish();
    assert_eq!(f.code(), 75, "{cloud}: {}", f.stderr);

    let f = report(
        state.path(),
        s,
        "led",
        &["--json", "--price", "1", "--on-demand-price", "3"],
    );
    assert_eq!(f.code(), 0, "{}", f.stderr);
    let r: Value = serde_json::from_str(&f.stdout).expect("JSON");
    let a = &r["attempts"][0];
    assert_eq!(a["instance_type"], json!(ty), "{cloud}: {a}");
    assert_eq!(a["lifecycle"], json!(lifecycle), "{cloud}: {a}");
    assert_eq!(a["zone"], zone, "{cloud}: {a}");
    assert_eq!(a["outcome"], "preempted", "{cloud}: {a}");
    assert_eq!(
        a["checkpoints"].as_array().map(Vec::len),
        Some(1),
        "{cloud}: {a}"
    );
    let n = &a["notice"];
    assert_eq!(n["source"], cloud, "{n}");
    assert_eq!(n["durable_in_time"], true, "{n}");
    let wall = a["wall"].as_f64().expect("wall");
    let lost = a["lost"].as_f64().expect("lost");
    let notice_at = n["at"].as_f64().expect("notice offset");
    let taken = a["checkpoints"][0]["taken"].as_f64().expect("taken");
    // Lost work is exactly from the checkpoint to the notice.
    assert!(
        (lost - (notice_at - taken)).abs() < 0.01,
        "{cloud}: lost {lost}, notice {notice_at}, taken {taken}"
    );
    assert!(lost >= 0.0 && lost <= wall, "{cloud}: {a}");
    assert!(r["cost"]["total"].as_f64().expect("cost") > 0.0, "{r}");
    assert_eq!(r["totals"]["preemptions"], 1);
}

fn chromium() -> &'static str {
    for c in ["/usr/bin/chromium", "/usr/bin/chromium-browser"] {
        if Path::new(c).exists() {
            return c;
        }
    }
    panic!(
        "no Chromium: `scripts/test` installs Debian's chromium package (apt-get install chromium)"
    )
}

/// The page is self-contained and renders: Chromium (offline) draws the timeline to a
/// screenshot, and the DOM it built has the chart with a lane per attempt.
#[test]
fn the_html_page_renders_in_headless_chromium() {
    let state = tempfile::tempdir().expect("tempdir");
    let store = state.path().join("store");
    write_ledger(&store, "ft");
    let html = state.path().join("report.html");
    let f = report(
        state.path(),
        store.to_str().expect("utf-8"),
        "ft",
        &["--html", html.to_str().expect("utf-8")],
    );
    assert_eq!(f.code(), 0, "{}", f.stderr);
    let page = std::fs::read_to_string(&html).expect("page");
    for loads in ["src=", "href=", "<script", "<link", "url(", "@import"] {
        assert!(
            !page.contains(loads),
            "the page must load nothing, but has {loads:?}"
        );
    }

    let shot = state.path().join("shot.png");
    let profile = state.path().join("profile");
    let flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--window-size=1200,900",
    ];
    let url = format!("file://{}", html.display());
    let run = |extra: &[String]| {
        let mut cmd = Command::new(chromium());
        cmd.args(flags)
            .arg(format!("--user-data-dir={}", profile.display()))
            .args(extra)
            .arg(&url);
        let p = Proc::start(cmd);
        p.finish_within(Duration::from_secs(60))
    };
    let f = run(&[format!("--screenshot={}", shot.display())]);
    assert!(f.status.success(), "chromium failed: {}", f.stderr);
    let png = std::fs::read(&shot).expect("screenshot written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(
        png.len() > 10_000,
        "screenshot too small to hold the chart: {} bytes",
        png.len()
    );
    let f = run(&["--dump-dom".to_owned()]);
    assert!(f.status.success(), "chromium failed: {}", f.stderr);
    let dom = f.stdout;
    assert!(
        dom.contains("<svg id=\"timeline\""),
        "no chart in the rendered DOM"
    );
    assert_eq!(
        dom.matches("<g class=\"lane\"").count(),
        2,
        "one lane per attempt"
    );
    assert_eq!(
        dom.matches("class=\"ckpt\"").count(),
        3 + 1,
        "three checkpoint ticks and the legend's"
    );
    assert!(
        dom.contains("class=\"notice\"") && dom.contains("class=\"running\""),
        "{dom}"
    );
}
