//! Stress: 1,000 shards, 16 workers at once on one machine, workers `kill -9`ed at random and
//! replaced. Afterwards every item's output exists (exactly one per item: outputs are keyed by
//! item) and every shard is done. Against the local-dir store (1,000 shards) and moto (120:
//! moto, single-threaded Python, serves some hundred requests a second here and each shard
//! costs about a dozen; 250 took a minute, 1,000 over two). s3s-fs does not evaluate conditional
//! writes atomically (see crates/queue/tests/leases.rs).

mod support;

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use spotguard_testkit::S3Server;
use support::{Proc, Rng, spotguard};

const WORKERS: usize = 16;
const KILLS: usize = 24;

fn stress(store_url: &str, envs: &[(&'static str, String)], shards: u32) {
    let mut rng = Rng::from_clock();
    let seed = rng.0;
    let root = tempfile::tempdir().expect("tempdir");
    let results = root.path().join("results");
    std::fs::create_dir_all(&results).expect("mkdir");
    let mut create = spotguard(root.path());
    create
        .args([
            "queue",
            "create",
            "--store",
            store_url,
            "--range",
            &format!("1..={shards}"),
        ])
        .envs(envs.iter().map(|(k, v)| (*k, v)));
    assert_eq!(Proc::start(create).finish().code(), 0);

    let script = format!(
        r#"i=$(cat "$SPOTGUARD_SHARD_ITEMS"); [ -n "$i" ] || exit 0; echo "$i" > "{r}/item-$i"; echo "$i" >> "$SPOTGUARD_PROGRESS_FILE""#,
        r = results.display()
    );
    let start_worker = |n: usize| {
        let state = root.path().join(format!("worker-{n}"));
        let mut cmd = spotguard(&state);
        cmd.args([
            "-q",
            "run",
            "--queue",
            "--store",
            store_url,
            "--lease-ttl",
            "1s",
            "--no-resume",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .envs(envs.iter().map(|(k, v)| (*k, v)));
        Proc::start(cmd)
    };
    let mut slots: Vec<Proc> = (0..WORKERS).map(start_worker).collect();
    let deadline = Instant::now() + Duration::from_secs(110);
    for next in WORKERS..WORKERS + KILLS {
        std::thread::sleep(Duration::from_millis(20 + rng.below(60)));
        let victim = rng.below(WORKERS as u64) as usize;
        slots[victim].signal(Signal::SIGKILL);
        let fresh = start_worker(next);
        let killed = std::mem::replace(&mut slots[victim], fresh);
        drop(killed.finish_within(Duration::from_secs(10)));
    }
    for p in slots {
        let left = deadline.saturating_duration_since(Instant::now());
        let f = p.finish_within(left);
        assert_eq!(f.code(), 0, "seed {seed}: {}", f.stderr);
    }
    for i in 1..=shards {
        assert!(
            results.join(format!("item-{i}")).exists(),
            "seed {seed}: item {i} has no output"
        );
    }
    let mut st = spotguard(root.path());
    st.args(["queue", "status", "--json", "--store", store_url])
        .envs(envs.iter().map(|(k, v)| (*k, v)));
    let f = Proc::start(st).finish();
    let v: serde_json::Value = serde_json::from_str(&f.stdout).expect("json");
    assert_eq!(v["counts"]["done"], shards, "seed {seed}: {}", v["counts"]);
}

#[test]
fn stress_local_dir() {
    let store = tempfile::tempdir().expect("store");
    stress(store.path().to_str().expect("utf-8"), &[], 1000);
}

#[test]
fn stress_moto() {
    let s3 = S3Server::moto();
    stress(&s3.url("jobs"), &s3.env(), 120);
}
