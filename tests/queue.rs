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
