//! `spotguard queue create` and `queue status` through the binary. (The lease protocol itself
//! is tested against every backend in crates/queue/tests/leases.rs.)

mod support;

use support::run_to_end;

#[test]
fn create_append_and_status() {
    let state = tempfile::tempdir().expect("tempdir");
    let f = run_to_end(
        state.path(),
        &[
            "queue",
            "create",
            "--range",
            "1..=250",
            "--shard-size",
            "10",
        ],
    );
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert_eq!(f.stdout, "250 items in 25 shards (0..25)");

    let again = run_to_end(state.path(), &["queue", "create", "--range", "1..=5"]);
    assert_eq!(again.code(), 70);
    assert_eq!(again.stderr.lines().count(), 1, "{}", again.stderr);
    assert!(
        again.stderr.contains("already has a queue of 25 shards"),
        "{}",
        again.stderr
    );

    let items = state.path().join("items.txt");
    std::fs::write(&items, "a.blend\n\nb.blend\nc.blend\n").expect("write");
    let f = run_to_end(
        state.path(),
        &[
            "queue",
            "create",
            "--append",
            "--items",
            items.to_str().expect("utf-8"),
            "--shard-size",
            "2",
        ],
    );
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert_eq!(f.stdout, "3 items in 2 shards (25..27)");

    let f = run_to_end(state.path(), &["queue", "status", "--json"]);
    assert_eq!(f.code(), 0, "{}", f.stderr);
    let v: serde_json::Value = serde_json::from_str(&f.stdout).expect("json");
    assert_eq!(v["counts"]["pending"], 27);
    assert_eq!(v["shards"].as_array().map(Vec::len), Some(27));
    let f = run_to_end(state.path(), &["queue", "status"]);
    assert_eq!(
        f.stdout.lines().next(),
        Some("27 shards: 27 pending, 0 leased, 0 done, 0 failed")
    );
}

#[test]
fn bad_queue_input_is_a_usage_error() {
    let state = tempfile::tempdir().expect("tempdir");
    for args in [
        &["queue", "create", "--range", "9..3"][..],
        &["queue", "create"],
        &["queue", "create", "--range", "1..2", "--shard-size", "0"],
    ] {
        let f = run_to_end(state.path(), args);
        assert_eq!(f.code(), 2, "{args:?}: {}", f.stderr);
        assert_eq!(f.stderr.lines().count(), 1, "{args:?}: {}", f.stderr);
    }
}

use std::path::Path;

use nix::sys::signal::Signal;
use support::{Proc, spotguard};

/// A worker: `spotguard run --queue` on the shared `store`, its own fresh state dir.
fn worker(
    store: &Path,
    script: &str,
    extra: &[&str],
) -> (tempfile::TempDir, std::process::Command) {
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    cmd.args(["run", "--queue", "--store"])
        .arg(store)
        .args(extra)
        .args(["--", "sh", "-c", script]);
    (state, cmd)
}

/// Records each item before announcing it, so an announced item is never redone.
const WORK: &str = r#"trap 'exit 0' TERM
while read i; do echo "$i" >> "$SPOTGUARD_PROGRESS_FILE"; echo "did $SPOTGUARD_SHARD_ID:$i"; [ -n "$SLOW" ] && sleep "$SLOW"; done < "$SPOTGUARD_SHARD_ITEMS""#;

/// `queue create --range RANGE --shard-size SIZE` on `store`, which must succeed.
fn create_queue(state: &Path, store: &str, range: &str, size: &str) {
    let f = run_to_end(
        state,
        &[
            "queue",
            "create",
            "--store",
            store,
            "--range",
            range,
            "--shard-size",
            size,
        ],
    );
    assert_eq!(f.code(), 0, "{}", f.stderr);
}

fn outputs(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("did "))
        .map(|s| s.split(':').nth(1).expect("item").to_owned())
        .collect()
}

#[test]
fn two_workers_drain_the_queue_each_item_once() {
    let store = tempfile::tempdir().expect("store");
    let setup = tempfile::tempdir().expect("state");
    let s = store.path().to_str().expect("utf-8");
    create_queue(setup.path(), s, "1..=40", "4");
    let (_a, a) = worker(store.path(), WORK, &[]);
    let (_b, b) = worker(store.path(), WORK, &[]);
    let (a, b) = (Proc::start(a), Proc::start(b));
    let (a, b) = (a.finish(), b.finish());
    assert_eq!((a.code(), b.code()), (0, 0), "{}\n{}", a.stderr, b.stderr);
    let mut all: Vec<u32> = outputs(&a.stdout)
        .iter()
        .chain(&outputs(&b.stdout))
        .map(|i| i.parse().expect("int"))
        .collect();
    all.sort_unstable();
    assert_eq!(all, (1..=40).collect::<Vec<_>>(), "every item exactly once");
    let st = run_to_end(setup.path(), &["queue", "status", "--store", s, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&st.stdout).expect("json");
    assert_eq!(v["counts"]["done"], 10);
}

#[test]
fn a_preempted_worker_releases_its_shard_with_progress() {
    let store = tempfile::tempdir().expect("store");
    let setup = tempfile::tempdir().expect("state");
    let s = store.path().to_str().expect("utf-8");
    create_queue(setup.path(), s, "1..=6", "6");
    let (_a, mut a) = worker(store.path(), WORK, &["--lease-ttl", "1h"]);
    // Each item takes a second after it is recorded.
    a.env("SLOW", "1");
    let a = Proc::start(a);
    a.expect_stdout("did 0:2");
    a.signal(Signal::SIGTERM);
    let a = a.finish();
    assert_eq!(a.code(), 75, "{}", a.stderr);
    assert!(
        a.stderr.contains("released with its progress"),
        "{}",
        a.stderr
    );
    let first = outputs(&a.stdout);
    // Released at once: no waiting out the hour-long lease.
    let (_b, b) = worker(store.path(), WORK, &[]);
    let b = Proc::start(b).finish();
    assert_eq!(b.code(), 0, "{}", b.stderr);
    let second = outputs(&b.stdout);
    assert!(
        first.iter().all(|i| !second.contains(i)),
        "redone after takeover: {first:?} then {second:?}"
    );
    let mut all: Vec<u32> = first
        .iter()
        .chain(&second)
        .map(|i| i.parse().expect("int"))
        .collect();
    all.sort_unstable();
    assert_eq!(all, (1..=6).collect::<Vec<_>>());

    // Each worker is an attempt in the job's ledger; the preempted one lost only the item in
    // flight (recorded items are saved), not the shard's whole run: under the second item 1
    // took, where losing from the shard's start would be over it.
    let r = run_to_end(setup.path(), &["report", "--store", s, "--json"]);
    assert_eq!(r.code(), 0, "{}", r.stderr);
    let r: serde_json::Value = serde_json::from_str(&r.stdout).expect("report JSON");
    assert_eq!(r["totals"]["attempts"], 2, "{r}");
    assert_eq!(r["totals"]["preemptions"], 1, "{r}");
    assert_eq!(r["totals"]["completed"], true, "{r}");
    let first = &r["attempts"][0];
    assert_eq!(first["outcome"], "preempted", "{first}");
    assert_eq!(first["notice"]["source"], "signal SIGTERM", "{first}");
    let lost = first["lost"].as_f64().expect("lost");
    assert!((0.0..0.9).contains(&lost), "lost {lost}s: {first}");
    // The drained queue marks the job completed.
    let st = run_to_end(setup.path(), &["status", "--store", s]);
    assert_eq!(st.code(), 0, "{}", st.stdout);
}

#[test]
fn a_failing_shard_is_retried_then_failed_and_the_rest_finishes() {
    let store = tempfile::tempdir().expect("store");
    let setup = tempfile::tempdir().expect("state");
    let s = store.path().to_str().expect("utf-8");
    create_queue(setup.path(), s, "1..=4", "1");
    let script = r#"[ "$SPOTGUARD_SHARD_ID" = 2 ] && exit 3; cat "$SPOTGUARD_SHARD_ITEMS" > "$SPOTGUARD_PROGRESS_FILE""#;
    let (_w, cmd) = worker(store.path(), script, &["--max-attempts", "2"]);
    let f = Proc::start(cmd).finish();
    assert_eq!(f.code(), 0, "{}", f.stderr);
    assert!(
        f.stderr.contains("1 shard(s) failed for good"),
        "{}",
        f.stderr
    );
    let st = run_to_end(setup.path(), &["queue", "status", "--store", s, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&st.stdout).expect("json");
    assert_eq!(
        (v["counts"]["done"].as_u64(), v["counts"]["failed"].as_u64()),
        (Some(3), Some(1)),
        "{v}"
    );
    let shard = &v["shards"][2]["state"];
    assert_eq!(
        (
            shard["failures"].as_u64(),
            shard["last_exit_status"].as_i64()
        ),
        (Some(2), Some(3)),
        "{shard}"
    );
}

/// The render farm: each frame is uploaded as soon as it is written and closed, while the
/// command is still rendering the next one.
#[test]
fn outputs_are_uploaded_as_each_file_is_closed() {
    let store = tempfile::tempdir().expect("store");
    let setup = tempfile::tempdir().expect("state");
    let s = store.path().to_str().expect("utf-8");
    create_queue(setup.path(), s, "1..=3", "3");
    let frames = setup.path().join("frames");
    let uploaded = store.path().join("default/outputs");
    // Frame i+1 is only rendered once frame i is in the store: the upload cannot wait for the end.
    let script = format!(
        r#"while read i; do echo "frame $i" > "{frames}/frame-$i.txt"; n=0; until [ -f "{up}/frame-$i.txt" ]; do n=$((n+1)); [ $n -gt 200 ] && exit 9; sleep 0.05; done; echo $i >> "$SPOTGUARD_PROGRESS_FILE"; done < "$SPOTGUARD_SHARD_ITEMS""#,
        frames = frames.display(),
        up = uploaded.display()
    );
    let (_w, cmd) = worker(
        store.path(),
        &script,
        &["--outputs", frames.to_str().expect("utf-8")],
    );
    let f = Proc::start(cmd).finish();
    assert_eq!(f.code(), 0, "{}", f.stderr);
    for i in 1..=3 {
        let body = std::fs::read_to_string(uploaded.join(format!("frame-{i}.txt")))
            .expect("uploaded frame");
        assert_eq!(body, format!("frame {i}\n"));
    }
}
