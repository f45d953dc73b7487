//! One conformance suite, run against every backend: a local directory, and two real
//! S3-compatible servers on 127.0.0.1 (moto and s3s-fs), so a quirk of one server is not
//! mistaken for correctness. (object_store's `src/integration.rs` is the model.)

use std::path::Path as FsPath;
use std::sync::Arc;

use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use spotguard_store::{
    Error, JobStore, LocalCheckpoint, RestoreOptions, Store, StoreOptions, UploadOptions,
};
use spotguard_testkit::{Kind, S3Server};

/// A store and whatever keeps it alive.
struct Backend {
    store: Store,
    _server: Option<S3Server>,
    _dir: tempfile::TempDir,
}

fn local() -> Backend {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::open(
        dir.path().join("store").to_str().expect("utf-8"),
        &StoreOptions::default(),
    )
    .expect("local store");
    Backend {
        store,
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
    let store = Store::open(&server.url("prefix/jobs"), &opts).expect("s3 store");
    Backend {
        store,
        _server: Some(server),
        _dir: tempfile::tempdir().expect("tempdir"),
    }
}

/// Deterministic bytes that do not compress or dedupe.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn write(path: &FsPath, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, bytes).expect("write");
}

fn opts() -> UploadOptions {
    UploadOptions {
        part_size: 5 << 20,
        concurrency: 4,
        ..UploadOptions::default()
    }
}

fn crc(bytes: &[u8]) -> String {
    let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc64Nvme);
    d.update(bytes);
    format!("{:016x}", d.finalize())
}

async fn get(
    job: &JobStore,
    raw: &Arc<dyn ObjectStore>,
    key: &str,
) -> object_store::Result<Vec<u8>> {
    Ok(raw
        .get(&job.layout().absolute(key))
        .await?
        .bytes()
        .await?
        .to_vec())
}

async fn commit_round_trip(b: Backend) {
    let job = b.store.job("train");
    let tmp = tempfile::tempdir().expect("tempdir");
    let ckpt = tmp.path().join("step-10");
    let big = noise(12 << 20, 1); // three parts of 5 MiB, the last one short
    write(&ckpt.join("model.bin"), &big);
    write(&ckpt.join("nested/deeper/state.json"), b"{\"step\": 10}");
    write(&ckpt.join("empty"), b"");
    let local = LocalCheckpoint::scan(&ckpt).expect("scan");
    let rep = job
        .upload(&local, "renamed", &opts())
        .await
        .expect("upload");
    assert_eq!(rep.sent_bytes, (12 << 20) + 12);
    let committed = job.committed().await.expect("list");
    assert_eq!(committed, vec![rep.manifest.clone()]);
    let m = &committed[0];
    assert_eq!(
        (m.seq, m.name.as_str(), m.rule.as_str()),
        (1, "step-10", "renamed")
    );
    let paths: Vec<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["empty", "model.bin", "nested/deeper/state.json"]);
    let raw = b.store.object_store();
    for f in &m.files {
        let local_bytes = std::fs::read(ckpt.join(&f.path)).expect("read");
        let stored = get(&job, &raw, &f.key).await.expect("stored object");
        assert!(stored == local_bytes, "{} differs in the store", f.path);
        assert_eq!(f.crc64nvme, crc(&local_bytes), "{}", f.path);
        assert_eq!(f.size, local_bytes.len() as u64);
    }

    // A single-file checkpoint (Lightning's epoch=3.ckpt).
    let file = tmp.path().join("epoch=3.ckpt");
    write(&file, &noise(1000, 2));
    let rep = job
        .upload(
            &LocalCheckpoint::scan(&file).expect("scan"),
            "lightning",
            &opts(),
        )
        .await
        .expect("upload");
    assert_eq!(rep.manifest.seq, 2);
    assert_eq!(rep.manifest.files.len(), 1);
    assert_eq!(rep.manifest.files[0].path, "");
    assert_eq!(
        get(&job, &raw, &rep.manifest.files[0].key)
            .await
            .expect("stored"),
        noise(1000, 2)
    );
}

async fn unchanged_files_are_referenced_and_survive_retention(b: Backend) {
    let job = b.store.job("train");
    let raw = b.store.object_store();
    let tmp = tempfile::tempdir().expect("tempdir");
    let ckpt = tmp.path().join("latest");
    write(&ckpt.join("frozen.bin"), &noise(6 << 20, 3));
    write(&ckpt.join("head.bin"), &noise(1000, 4));
    let first = job
        .upload(
            &LocalCheckpoint::scan(&ckpt).expect("scan"),
            "marker",
            &opts(),
        )
        .await
        .expect("upload 1");
    write(&ckpt.join("head.bin"), &noise(1000, 5));
    let second = job
        .upload(
            &LocalCheckpoint::scan(&ckpt).expect("scan"),
            "marker",
            &opts(),
        )
        .await
        .expect("upload 2");
    assert_eq!(second.reused_files, 1);
    assert_eq!(second.sent_bytes, 1000, "only the changed file is sent");
    let key = |m: &spotguard_store::Manifest, p: &str| {
        m.files
            .iter()
            .find(|f| f.path == p)
            .expect("file")
            .key
            .clone()
    };
    assert_eq!(
        key(&first.manifest, "frozen.bin"),
        key(&second.manifest, "frozen.bin")
    );

    let rep = job.retain(1).await.expect("retain");
    assert_eq!(rep.deleted_checkpoints, vec![1]);
    assert_eq!(job.committed().await.expect("list").len(), 1);
    // The newest checkpoint is whole on its own: the object it shares with the deleted one stays.
    for f in &second.manifest.files {
        assert!(get(&job, &raw, &f.key).await.is_ok(), "{} is gone", f.key);
    }
    // What only the deleted checkpoint referenced is gone.
    assert!(
        get(&job, &raw, &key(&first.manifest, "head.bin"))
            .await
            .is_err()
    );
}

async fn retention_keeps_the_newest(b: Backend) {
    let job = b.store.job("train");
    let tmp = tempfile::tempdir().expect("tempdir");
    for i in 0..4 {
        let p = tmp.path().join(format!("step-{i}"));
        write(&p.join("w.bin"), &noise(100, i));
        job.upload(
            &LocalCheckpoint::scan(&p).expect("scan"),
            "renamed",
            &opts(),
        )
        .await
        .expect("upload");
    }
    job.retain(2).await.expect("retain");
    let seqs: Vec<u64> = job
        .committed()
        .await
        .expect("list")
        .iter()
        .map(|m| m.seq)
        .collect();
    assert_eq!(seqs, [3, 4]);
    // Even asked to keep none, the newest committed checkpoint stays.
    job.retain(0).await.expect("retain");
    let seqs: Vec<u64> = job
        .committed()
        .await
        .expect("list")
        .iter()
        .map(|m| m.seq)
        .collect();
    assert_eq!(seqs, [4]);
}

async fn manifests_are_create_if_absent(b: Backend) {
    let job = b.store.job("train");
    let raw = b.store.object_store();
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = tmp.path().join("step-1");
    write(&p.join("w.bin"), b"weights");
    let rep = job
        .upload(
            &LocalCheckpoint::scan(&p).expect("scan"),
            "renamed",
            &opts(),
        )
        .await
        .expect("upload");
    // The commit protocol relies on the backend refusing to overwrite a manifest.
    let put = PutOptions {
        mode: PutMode::Create,
        ..PutOptions::default()
    };
    let again = raw
        .put_opts(
            &job.layout().manifest(rep.manifest.seq),
            PutPayload::from_static(b"{}"),
            put,
        )
        .await;
    assert!(
        matches!(again, Err(object_store::Error::AlreadyExists { .. })),
        "{again:?}"
    );
    // A manifest nobody can read names nothing: it is skipped, not trusted.
    raw.put(
        &job.layout().manifest(7),
        PutPayload::from_static(b"{not json"),
    )
    .await
    .expect("put");
    let seqs: Vec<u64> = job
        .committed()
        .await
        .expect("list")
        .iter()
        .map(|m| m.seq)
        .collect();
    assert_eq!(seqs, [1]);
}

async fn an_unfinished_upload_is_invisible_and_collected(b: Backend) {
    let job = b.store.job("train");
    let raw = b.store.object_store();
    // What a crash mid-upload leaves: data under sequence 5, no manifest.
    let orphan = job
        .layout()
        .data_dir(5, "dead")
        .join("step-5")
        .join("w.bin");
    raw.put(&orphan, PutPayload::from_static(b"half"))
        .await
        .expect("put");
    assert!(
        job.committed().await.expect("list").is_empty(),
        "no manifest, no checkpoint"
    );
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = tmp.path().join("step-6");
    write(&p.join("w.bin"), b"whole");
    let rep = job
        .upload(
            &LocalCheckpoint::scan(&p).expect("scan"),
            "renamed",
            &opts(),
        )
        .await
        .expect("upload");
    assert_eq!(
        rep.manifest.seq, 6,
        "a crashed upload's sequence number is not reused"
    );
    job.retain(3).await.expect("retain");
    assert!(raw.head(&orphan).await.is_err(), "the orphan is collected");
    assert_eq!(job.committed().await.expect("list").len(), 1);
}

async fn a_file_changed_during_upload_is_not_committed(b: Backend) {
    let job = b.store.job("train");
    let tmp = tempfile::tempdir().expect("tempdir");
    let p = tmp.path().join("step-1");
    write(&p.join("w.bin"), &noise(1 << 20, 9));
    let scan = LocalCheckpoint::scan(&p).expect("scan");
    // The writer was not finished after all.
    write(&p.join("w.bin"), &noise(2 << 20, 9));
    let res = job.upload(&scan, "quiescent", &opts()).await;
    assert!(matches!(res, Err(Error::Changed { .. })), "{res:?}");
    assert!(job.committed().await.expect("list").is_empty());
}

fn ropts() -> RestoreOptions {
    RestoreOptions {
        part_size: 5 << 20,
        concurrency: 4,
        ..RestoreOptions::default()
    }
}

async fn restore_verifies_and_skips_identical_copies(b: Backend) {
    let job = b.store.job("train");
    let raw = b.store.object_store();
    let tmp = tempfile::tempdir().expect("tempdir");
    let ckpt = tmp.path().join("src/step-3");
    write(&ckpt.join("model.bin"), &noise(11 << 20, 7));
    write(&ckpt.join("sub/opt.bin"), &noise(3000, 8));
    write(&ckpt.join("empty"), b"");
    let m = job
        .upload(
            &LocalCheckpoint::scan(&ckpt).expect("scan"),
            "renamed",
            &opts(),
        )
        .await
        .expect("upload")
        .manifest;

    let dest = tmp.path().join("fresh");
    let rep = job.restore(&m, &dest, &ropts()).await.expect("restore");
    assert_eq!(rep.path, dest.join("step-3"));
    assert_eq!(rep.fetched_bytes, m.total_bytes);
    for f in &m.files {
        let a = std::fs::read(ckpt.join(&f.path)).expect("source");
        let b = std::fs::read(rep.path.join(&f.path)).expect("restored");
        assert!(a == b, "{} differs after restore", f.path);
    }
    // Restored files carry the committed mtimes: the checkpoint reads as unchanged.
    let again = LocalCheckpoint::scan(&rep.path).expect("scan");
    assert_eq!(
        again.fingerprint(),
        m.files
            .iter()
            .map(|f| (f.path.clone(), f.size, f.mtime_ns))
            .collect::<Vec<_>>()
    );

    // The same machine restarting: an identical copy downloads nothing.
    let rep = job
        .restore(&m, &dest, &ropts())
        .await
        .expect("restore again");
    assert_eq!(rep.fetched_bytes, 0);
    // One damaged file: only it is fetched.
    write(&dest.join("step-3/sub/opt.bin"), &noise(3000, 99));
    let rep = job.restore(&m, &dest, &ropts()).await.expect("repair");
    assert_eq!(rep.fetched_bytes, 3000);
    assert_eq!(
        std::fs::read(dest.join("step-3/sub/opt.bin")).expect("read"),
        noise(3000, 8)
    );

    // Bytes changed in the store (same size): the checksum catches it, nothing is swapped in.
    let key = &m
        .files
        .iter()
        .find(|f| f.path == "sub/opt.bin")
        .expect("file")
        .key;
    raw.put(
        &job.layout().absolute(key),
        PutPayload::from(noise(3000, 100)),
    )
    .await
    .expect("corrupt");
    let other = tmp.path().join("other");
    let res = job.restore(&m, &other, &ropts()).await;
    assert!(matches!(res, Err(Error::Verify { .. })), "{res:?}");
    assert!(
        !other.join("step-3").exists(),
        "a damaged checkpoint was put in place"
    );
}

async fn a_damaged_newest_checkpoint_falls_back_to_the_previous(b: Backend) {
    let job = b.store.job("train");
    let raw = b.store.object_store();
    let tmp = tempfile::tempdir().expect("tempdir");
    for i in 1..=2 {
        let p = tmp.path().join(format!("src/step-{i}"));
        write(&p.join("w.bin"), &noise(2000, i));
        job.upload(
            &LocalCheckpoint::scan(&p).expect("scan"),
            "renamed",
            &opts(),
        )
        .await
        .expect("upload");
    }
    assert!(
        job.restore_newest(&tmp.path().join("none"), &ropts())
            .await
            .is_ok()
    );
    // The newest loses an object (a bad lifecycle rule, a manual delete).
    let newest = job.committed().await.expect("list").pop().expect("two");
    raw.delete(&job.layout().absolute(&newest.files[0].key))
        .await
        .expect("delete");
    let (m, rep) = job
        .restore_newest(&tmp.path().join("dest"), &ropts())
        .await
        .expect("restore")
        .expect("something");
    assert_eq!(m.name, "step-1", "fell back to the previous checkpoint");
    assert_eq!(
        std::fs::read(rep.path.join("w.bin")).expect("read"),
        noise(2000, 1)
    );
    assert!(!tmp.path().join("dest/step-2").exists());
}

#[test]
fn restore_refuses_paths_outside_the_target() {
    let m = |name: &str, path: &str| spotguard_store::Manifest {
        format: 1,
        job: "j".into(),
        seq: 1,
        name: name.into(),
        kind: spotguard_store::EntryKind::Dir,
        rule: "renamed".into(),
        created: String::new(),
        instance: Default::default(),
        total_bytes: 0,
        files: vec![spotguard_store::FileEntry {
            path: path.into(),
            size: 0,
            mtime_ns: 0,
            crc64nvme: String::new(),
            key: "k".into(),
        }],
    };
    for (name, path) in [
        ("ok", "../escape"),
        ("ok", "/etc/passwd"),
        ("ok", "a/../../b"),
        ("..", "x"),
        ("a/b", "x"),
        ("ok", "a//b"),
    ] {
        let err = spotguard_store::check_paths(&m(name, path)).expect_err(path);
        assert!(err.to_string().contains("refusing to restore"), "{err}");
    }
    assert!(spotguard_store::check_paths(&m("step-1", "sub/w.bin")).is_ok());
}

/// Runs every case against one backend, each in its own test.
macro_rules! suite {
    ($backend:ident, $make:expr) => {
        suite!($backend, $make, [commit_round_trip, unchanged_files_are_referenced_and_survive_retention, retention_keeps_the_newest, manifests_are_create_if_absent, an_unfinished_upload_is_invisible_and_collected, restore_verifies_and_skips_identical_copies, a_damaged_newest_checkpoint_falls_back_to_the_previous, a_file_changed_during_upload_is_not_committed]);
    };
    ($backend:ident, $make:expr, [$($case:ident),*]) => {
        mod $backend {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case($make).await
                }
            )*
        }
    };
}

suite!(local_dir, local());
suite!(moto, s3(Kind::Moto));
suite!(s3s_fs, s3(Kind::S3sFs));

#[tokio::test]
async fn start_up_check_names_the_url_and_the_problem() {
    let bad = Store::open("ftp://host/x", &StoreOptions::default()).expect_err("ftp is no store");
    assert!(
        bad.to_string().contains("ftp://host/x") && bad.to_string().contains("unknown scheme"),
        "{bad}"
    );

    let moto = S3Server::moto();
    let opts = StoreOptions {
        config: moto.store_options(),
        ..StoreOptions::default()
    };
    let missing = Store::open("s3://no-such-bucket/x", &opts).expect("opens");
    let err = missing
        .check(std::time::Duration::from_secs(20))
        .await
        .expect_err("missing bucket");
    assert!(err.to_string().contains("s3://no-such-bucket/x"), "{err}");
    assert!(!err.to_string().contains('\n'), "one line: {err}");

    let s3s = S3Server::s3s_fs();
    let mut config = s3s.store_options();
    config.retain(|(k, _)| k != "aws_secret_access_key");
    config.push(("aws_secret_access_key".into(), "wrong".into()));
    let wrong = Store::open(
        &s3s.url("x"),
        &StoreOptions {
            config,
            ..StoreOptions::default()
        },
    )
    .expect("opens");
    let err = wrong
        .check(std::time::Duration::from_secs(20))
        .await
        .expect_err("wrong secret");
    assert!(err.to_string().contains(&s3s.url("x")), "{err}");
    assert!(
        !err.to_string().contains("wrong"),
        "the secret is not echoed: {err}"
    );
}
