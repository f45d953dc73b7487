//! The test that matters: a deterministic training run preempted three times at random points,
//! each "new instance" starting from fresh, empty local dirs against the same S3 store, ends
//! with weights bit for bit equal to an uninterrupted run, and never recomputes a step that
//! was flushed. Once per notice source: AWS, GCP and Azure metadata (fake servers speaking
//! their protocols) and a plain SIGTERM (Kubernetes, docker stop).

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use spotguard_testkit::S3Server;
use support::{FakeCloud, Proc, Rng, spotguard};

const STEPS: &str = "600";
const TRAIN_ARGS: [&str; 6] = [
    "--steps",
    STEPS,
    "--save-every",
    "50",
    "--step-time",
    "0.004",
];

fn train() -> PathBuf {
    [env!("CARGO_MANIFEST_DIR"), "examples", "train.py"]
        .iter()
        .collect()
}

fn done_line(stdout: &str) -> String {
    stdout
        .lines()
        .find(|l| l.starts_with("done: "))
        .unwrap_or_else(|| panic!("not done:\n{stdout}"))
        .to_owned()
}

fn preempted_three_times(source: &str) {
    let mut rng = Rng::from_clock();
    let seed = rng.0;
    let reference = Command::new("python3")
        .arg(train())
        .args(TRAIN_ARGS)
        .env(
            "SPOTGUARD_CHECKPOINT_DIR",
            tempfile::tempdir().expect("tmp").path(),
        )
        .output()
        .expect("reference run");
    let expected = done_line(&String::from_utf8_lossy(&reference.stdout));

    let s3 = S3Server::moto();
    let mut flushed: Option<String> = None;
    for attempt in 0..4 {
        let state = tempfile::tempdir().expect("fresh local dirs");
        let fake = match source {
            "sigterm" => None,
            cloud => Some(FakeCloud::start(cloud, &[])),
        };
        let mut cmd = spotguard(state.path());
        cmd.args([
            "run",
            "--store",
            &s3.url("jobs"),
            "--job",
            "e2e",
            "--poll-interval",
            "100ms",
        ])
        .envs(s3.env());
        if let Some(fake) = &fake {
            cmd.args(["--cloud", source, "--metadata-endpoint", &fake.url()]);
        }
        cmd.arg("--").arg("python3").arg(train()).args(TRAIN_ARGS);
        let p = Proc::start(cmd);
        let start = p.expect_stdout("training from step");
        match &flushed {
            // Nothing committed may be recomputed: it resumes exactly where the flush was.
            Some(step) => {
                let resumed = p.expect_stdout("resumed from");
                assert!(
                    resumed.ends_with(&format!("at step {step}")),
                    "seed {seed}, attempt {attempt}: {resumed}"
                );
                assert_eq!(start, format!("training from step {step}"), "seed {seed}");
            }
            None => assert_eq!(start, "training from step 0"),
        }
        if attempt == 3 {
            let f = p.finish_within(Duration::from_secs(60));
            assert_eq!(f.code(), 0, "seed {seed}: {}", f.stderr);
            assert_eq!(
                done_line(&f.stdout),
                expected,
                "seed {seed}: not bit for bit the uninterrupted result"
            );
            return;
        }
        // A random point: after one of the first saves of this attempt, plus up to 150 ms.
        let saves = 1 + rng.below(2);
        for _ in 0..saves {
            p.expect_stdout(" saved ");
        }
        std::thread::sleep(Duration::from_millis(rng.below(150)));
        match &fake {
            Some(fake) => fake.control("preempt", serde_json::json!({})),
            None => p.signal(Signal::SIGTERM),
        }
        let f = p.finish_within(Duration::from_secs(60));
        assert_eq!(f.code(), 75, "seed {seed}: {}", f.stderr);
        // Committed in the flush, or already by the background upload when the stop came
        // right after a regular save.
        assert!(
            !f.stderr.contains("NOT durable") && !f.stderr.contains("could not be made durable"),
            "seed {seed}: {}",
            f.stderr
        );
        let stop = f
            .stdout
            .lines()
            .find(|l| l.starts_with("stopping at step"))
            .unwrap_or_else(|| panic!("seed {seed}: no flush:\n{}", f.stdout));
        let step = stop
            .split_whitespace()
            .nth(3)
            .expect("step")
            .trim_end_matches(|c: char| !c.is_ascii_digit())
            .to_owned();
        if let Some(fake) = &fake
            && source == "azure"
        {
            assert_eq!(
                fake.log()["acked"].as_array().map(Vec::len),
                Some(1),
                "the preemption is acknowledged"
            );
        }
        flushed = Some(step);
    }
}

#[test]
fn preempted_three_times_by_aws_spot_notices() {
    preempted_three_times("aws");
}

#[test]
fn preempted_three_times_by_gcp_preemption() {
    preempted_three_times("gcp");
}

#[test]
fn preempted_three_times_by_azure_scheduled_events() {
    preempted_three_times("azure");
}

#[test]
fn preempted_three_times_by_sigterm() {
    preempted_three_times("sigterm");
}
