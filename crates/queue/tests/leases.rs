//! The queue's lease protocol against every backend (local directory with flock-based
//! compare-and-swap, moto, s3s-fs): exclusive claims, expiry and takeover, fencing of the old
//! holder, progress that travels with the shard, retries, and every shard done exactly once
//! under concurrent workers.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use spotguard_queue::{Error, Phase, Queue};
use spotguard_store::{Store, StoreOptions};
use spotguard_testkit::{Kind, S3Server};

struct Backend {
    queue: Queue,
    _server: Option<S3Server>,
    _dir: tempfile::TempDir,
}

fn local() -> Backend {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(
        dir.path().join("store").to_str().expect("utf-8"),
        &StoreOptions::default(),
    )
    .expect("store");
    Backend {
        queue: Queue::new(store.job("q")),
        _server: None,
        _dir: dir,
    }
}

fn s3(kind: Kind) -> Backend {
    let server = S3Server::start(kind);
    let opts = StoreOptions {
        config: server.store_options(),
        ..StoreOptions::default()
    };
    let store = Store::open(&server.url("jobs"), &opts).expect("store");
    Backend {
        queue: Queue::new(store.job("q")),
        _server: Some(server),
        _dir: tempfile::tempdir().expect("tempdir"),
    }
}

fn items(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("frame-{i:04}")).collect()
}

const TTL: Duration = Duration::from_secs(60);

async fn create_and_append(b: Backend) {
    let q = &b.queue;
    assert_eq!(q.create(&items(10), 4, false).await.expect("create"), 0..3);
    assert!(matches!(
        q.create(&items(2), 4, false).await,
        Err(Error::Exists { shards: 3 })
    ));
    assert_eq!(q.create(&items(2), 4, true).await.expect("append"), 3..4);
    let counts = q.counts().await.expect("counts");
    assert_eq!(counts.pending, 4);
}

async fn one_shard_one_holder(b: Backend) {
    let q = Arc::new(b.queue);
    q.create(&items(3), 10, false).await.expect("create");
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..8 {
        let q = q.clone();
        tasks.spawn(async move {
            q.claim(&format!("worker-{w}"), TTL, 3)
                .await
                .expect("claim")
                .is_some()
        });
    }
    let mut winners = 0;
    while let Some(won) = tasks.join_next().await {
        winners += usize::from(won.expect("no panic"));
    }
    assert_eq!(winners, 1, "two workers hold one shard");
}

async fn expiry_takeover_and_fencing(b: Backend) {
    let q = &b.queue;
    q.create(&items(5), 10, false).await.expect("create");
    // A lease that expires at once: as if the worker stopped renewing (preempted, frozen).
    let mut old = q
        .claim("old", Duration::ZERO, 3)
        .await
        .expect("claim")
        .expect("a shard");
    old.progress(&["frame-0000".into()])
        .await
        .expect("progress while still holding the version");
    let mut new = q
        .claim("new", TTL, 3)
        .await
        .expect("claim")
        .expect("the expired shard");
    assert_eq!(new.id, old.id);
    assert_eq!(new.remaining().len(), 4, "progress travels with the shard");
    // The old holder is fenced from every change.
    assert!(matches!(
        old.renew(TTL, &[]).await,
        Err(Error::Fenced { .. })
    ));
    assert!(matches!(
        old.progress(&["frame-0001".into()]).await,
        Err(Error::Fenced { .. })
    ));
    assert!(matches!(old.done(&[]).await, Err(Error::Fenced { .. })));
    new.renew(TTL, &[]).await.expect("renew");
    new.done(&[]).await.expect("done");
    assert!(
        q.claim("late", TTL, 3).await.expect("claim").is_none(),
        "a done shard is never claimed"
    );
    assert_eq!(q.counts().await.expect("counts").done, 1);
}

async fn release_and_failures(b: Backend) {
    let q = &b.queue;
    q.create(&items(4), 10, false).await.expect("create");
    let l = q.claim("a", TTL, 2).await.expect("claim").expect("shard");
    l.release(&["frame-0000".into(), "frame-0001".into()])
        .await
        .expect("release");
    let l = q
        .claim("b", TTL, 2)
        .await
        .expect("claim")
        .expect("released at once, no TTL wait");
    assert_eq!(l.remaining(), ["frame-0002", "frame-0003"]);
    l.fail(1, 2, &[]).await.expect("fail");
    let l = q.claim("c", TTL, 2).await.expect("claim").expect("retried");
    l.fail(3, 2, &[]).await.expect("fail");
    assert!(
        q.claim("d", TTL, 2).await.expect("claim").is_none(),
        "attempts used up"
    );
    let states = q.states().await.expect("states");
    assert_eq!(
        (states[0].1.phase, states[0].1.last_exit_status),
        (Phase::Failed, Some(3))
    );
}

async fn every_shard_done_exactly_once(b: Backend) {
    let q = Arc::new(b.queue);
    q.create(&items(120), 3, false).await.expect("create"); // 40 shards
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..8 {
        let q = q.clone();
        tasks.spawn(async move {
            let mut done = Vec::new();
            while let Some(lease) = q.claim(&format!("w{w}"), TTL, 3).await.expect("claim") {
                let id = lease.id;
                lease.done(&[]).await.expect("done by the holder");
                done.push(id);
            }
            done
        });
    }
    let mut all = Vec::new();
    while let Some(d) = tasks.join_next().await {
        all.extend(d.expect("no panic"));
    }
    let unique: HashSet<u32> = all.iter().copied().collect();
    assert_eq!(all.len(), 40, "a shard was done twice: {all:?}");
    assert_eq!(unique.len(), 40);
    assert_eq!(q.counts().await.expect("counts").done, 40);
}

macro_rules! suite {
    ($backend:ident, $make:expr, [$($case:ident),*]) => {
        mod $backend {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    super::$case($make).await
                }
            )*
        }
    };
}

suite!(
    local_dir,
    local(),
    [
        create_and_append,
        expiry_takeover_and_fencing,
        release_and_failures,
        one_shard_one_holder,
        every_shard_done_exactly_once
    ]
);
suite!(
    moto,
    s3(Kind::Moto),
    [
        create_and_append,
        expiry_takeover_and_fencing,
        release_and_failures,
        one_shard_one_holder,
        every_shard_done_exactly_once
    ]
);
// s3s-fs 0.14.1 checks If-None-Match / If-Match and then writes, without a lock
// (s3s-fs src/s3.rs, put_object): two racing conditional PUTs can both succeed, so it serves
// the sequential cases only. S3, GCS and Azure evaluate the condition atomically.
suite!(
    s3s_fs,
    s3(Kind::S3sFs),
    [
        create_and_append,
        expiry_takeover_and_fencing,
        release_and_failures
    ]
);
