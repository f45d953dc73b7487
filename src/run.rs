//! `spotguard run` around the session: resume, the attempt ledger, relaunches; and
//! `spotguard status`, which reads the ledger.

use std::time::SystemTime;

use spotguard_checkpoint::CheckpointOptions;
use spotguard_session::{Checkpoints, Outcome, RunOptions};
use spotguard_store::{
    Attempt, AttemptOutcome, CheckpointRef, HEARTBEAT, Instance, JobStore, Manifest, NoticeRecord,
    UploadOptions,
};
use tokio::signal::unix::{SignalKind, signal};
use tracing::{error, info, warn};

use crate::cli::{LsArgs, RestartPolicy, RunArgs};
use crate::{
    default_checkpoint_dir, exit_code, hostname, restore_newest, run_options, store_or_exit,
};

pub(crate) async fn run_command(args: RunArgs) -> u8 {
    let base = match run_options(&args) {
        Ok(opts) => opts,
        Err(msg) => {
            eprintln!("spotguard: error: {msg}");
            return exit_code::USAGE;
        }
    };
    // The store is checked before the command starts: a typo or a missing credential fails
    // now, not at the first checkpoint an hour in.
    let store = match store_or_exit(&args.store).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    if args.queue {
        return crate::queue_run::run_queue(&args, base, store).await;
    }
    let job = store.job(&base.job);
    let dir = args
        .checkpoint_dir
        .clone()
        .unwrap_or_else(|| default_checkpoint_dir(&args.store));
    let instance = Instance {
        hostname: hostname(),
        ..Instance::default()
    };
    let mut restarts = 0;
    loop {
        let mut opts = base.clone();
        let mut resumed_from = None;
        if !args.no_resume {
            match restore_newest(&job, &dir).await {
                Ok(Some((m, rep))) => {
                    resume_env(&mut opts, &m, rep.path.clone());
                    resumed_from = Some(CheckpointRef {
                        seq: m.seq,
                        name: m.name,
                        created: m.created,
                    });
                }
                Ok(None) => {}
                Err(e) => {
                    error!("failed to resume: {e}");
                    return exit_code::SETUP_FAILED;
                }
            }
        }
        opts.checkpoints = Some(checkpoints(&args, dir.clone(), job.clone()));

        let mut attempt = Attempt::begin(instance.clone(), resumed_from);
        if let Err(e) = job.record_attempt(&mut attempt).await {
            warn!("failed to record the attempt: {e}");
        }
        let heartbeat = tokio::spawn(heartbeat(job.clone(), attempt.clone()));
        let outputs = match crate::start_outputs(&args, &job) {
            Ok(o) => o,
            Err(code) => return code,
        };
        let result = spotguard_session::run(opts).await;
        let outputs_failed = crate::finish_outputs(outputs).await;
        heartbeat.abort();
        let _ = heartbeat.await;

        let code = match &result {
            Ok(outcome) if outcome.upload_failed() || outputs_failed => {
                error!(
                    "exiting with {}: the newest checkpoint is not durable (the command {})",
                    exit_code::UPLOAD_FAILED,
                    outcome.end
                );
                exit_code::UPLOAD_FAILED
            }
            Ok(outcome) if outcome.preempted.is_some() => exit_code::PREEMPTED,
            Ok(outcome) => outcome.end.exit_code(),
            Err(spotguard_session::Error::Spawn(e)) => {
                error!("{e}");
                match e.exit_code() {
                    127 => exit_code::NOT_FOUND,
                    _ => exit_code::NOT_EXECUTABLE,
                }
            }
            Err(e) => {
                error!("{e}");
                exit_code::SETUP_FAILED
            }
        };
        finish_attempt(&job, &mut attempt, result.as_ref().ok(), code).await;

        let failed = matches!(&result, Ok(o) if o.preempted.is_none() && !o.end.success() && !o.upload_failed());
        if !(failed && args.restart == RestartPolicy::OnFailure) {
            return code;
        }
        if restarts >= args.max_restarts {
            error!(
                "the command failed again and {} restarts are used up",
                args.max_restarts
            );
            return code;
        }
        restarts += 1;
        let wait = std::time::Duration::from_secs(1 << (restarts - 1).min(6))
            .min(std::time::Duration::from_secs(60));
        warn!(
            "the command failed (exit status {code}); restart {restarts} of {} in {}s",
            args.max_restarts,
            wait.as_secs()
        );
        // A stop during the backoff ends it: the machine or the user wants us gone.
        let (mut term, mut int) = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(t), Ok(i)) => (t, i),
            _ => return code,
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = term.recv() => return exit_code::PREEMPTED,
            _ = int.recv() => return exit_code::PREEMPTED,
        }
    }
}

/// The command's `SPOTGUARD_RESUME_*` variables for a restored checkpoint.
pub(crate) fn resume_env(opts: &mut RunOptions, m: &Manifest, path: std::path::PathBuf) {
    opts.env
        .push(("SPOTGUARD_RESUME_DIR".into(), path.into_os_string()));
    opts.env
        .push(("SPOTGUARD_RESUME_NAME".into(), m.name.clone().into()));
    opts.env
        .push(("SPOTGUARD_RESUME_SEQ".into(), m.seq.to_string().into()));
}

/// Where the command's checkpoints go and how, from the run flags.
pub(crate) fn checkpoints(args: &RunArgs, dir: std::path::PathBuf, store: JobStore) -> Checkpoints {
    Checkpoints {
        dir,
        store,
        opts: CheckpointOptions {
            settle: args.settle,
            keep: args.keep as usize,
            upload: UploadOptions {
                part_size: args.part_size as usize,
                concurrency: args.upload_concurrency as usize,
                instance: Instance {
                    hostname: hostname(),
                    ..Instance::default()
                },
                ..UploadOptions::default()
            },
            ..CheckpointOptions::default()
        },
    }
}

/// Refreshes a running attempt's record so `status` can tell running from crashed.
async fn heartbeat(job: JobStore, mut attempt: Attempt) {
    loop {
        tokio::time::sleep(HEARTBEAT).await;
        if let Err(e) = job.record_attempt(&mut attempt).await {
            warn!("failed to refresh the attempt record: {e}");
        }
    }
}

/// Records how the attempt ended; marks the job completed when the command succeeded.
async fn finish_attempt(job: &JobStore, a: &mut Attempt, outcome: Option<&Outcome>, code: u8) {
    let now = SystemTime::now();
    a.ended = Some(humantime::format_rfc3339_seconds(now).to_string());
    a.exit_status = Some(code);
    a.outcome = match outcome {
        Some(o) if o.preempted.is_some() => AttemptOutcome::Preempted,
        Some(o) if o.end.success() && !o.upload_failed() => AttemptOutcome::Completed,
        _ => AttemptOutcome::Failed,
    };
    let lost_until = match outcome.and_then(|o| o.preempted.as_deref()) {
        Some(n) => {
            a.notice = Some(NoticeRecord {
                source: n.source.to_string(),
                received: humantime::format_rfc3339_seconds(n.received).to_string(),
                deadline: n
                    .deadline
                    .map(|d| humantime::format_rfc3339_seconds(d).to_string()),
                warning_seconds: n.warning().map(|w| w.as_secs_f64()),
            });
            n.received
        }
        None => now,
    };
    if let Ok(committed) = job.committed().await {
        a.last_committed = committed.last().map(|m| CheckpointRef {
            seq: m.seq,
            name: m.name.clone(),
            created: m.created.clone(),
        });
        // Work lost: from the newest checkpoint committed before the notice (or the end).
        let before = committed
            .iter()
            .filter_map(|m| humantime::parse_rfc3339(&m.created).ok())
            .filter(|t| *t <= lost_until)
            .max();
        let from = before.or_else(|| humantime::parse_rfc3339(&a.started).ok());
        a.time_lost_seconds = from
            .and_then(|f| lost_until.duration_since(f).ok())
            .map(|d| d.as_secs_f64());
    }
    if a.outcome != AttemptOutcome::Completed {
        a.time_lost_seconds = a.time_lost_seconds.or(Some(0.0));
    } else {
        a.time_lost_seconds = None;
    }
    if let Err(e) = job.record_attempt(a).await {
        warn!("failed to record the attempt: {e}");
    }
    if a.outcome == AttemptOutcome::Completed {
        match job.mark_completed(a).await {
            Ok(()) => info!("job marked completed"),
            Err(e) => warn!("failed to mark the job completed: {e}"),
        }
    }
}

/// `spotguard status`: the attempts, and whether the job is completed (exit 0) or not (4).
pub(crate) async fn status(args: LsArgs) -> u8 {
    let store = match store_or_exit(&args.store).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let job = store.job(&args.store.job);
    let (attempts, completed) = match tokio::try_join!(job.attempts(), job.completed()) {
        Ok(x) => x,
        Err(e) => {
            error!("{e}");
            return exit_code::SETUP_FAILED;
        }
    };
    if args.json {
        let list: Vec<_> = attempts
            .iter()
            .map(|a| {
                let mut v = serde_json::to_value(a).expect("records serialize");
                v["outcome"] = serde_json::to_value(a.effective_outcome()).expect("serializes");
                v
            })
            .collect();
        let doc = serde_json::json!({
            "store": store.url(), "job": args.store.job,
            "completed": completed.is_some(), "completed_at": completed, "attempts": list,
        });
        outln!(
            "{}",
            serde_json::to_string_pretty(&doc).expect("JSON serializes")
        );
    } else {
        match &completed {
            Some(at) => outln!("job {}: completed at {at}", args.store.job),
            None => outln!("job {}: not completed", args.store.job),
        }
        if !attempts.is_empty() {
            outln!(
                "{:<20}  {:<10}  {:<20}  {:>4}  {:<22}  {:>9}",
                "STARTED",
                "OUTCOME",
                "HOST",
                "EXIT",
                "LAST CHECKPOINT",
                "LOST"
            );
        }
        for a in &attempts {
            let outcome = serde_json::to_value(a.effective_outcome()).expect("serializes");
            outln!(
                "{:<20}  {:<10}  {:<20}  {:>4}  {:<22}  {:>9}",
                a.started,
                outcome.as_str().unwrap_or_default(),
                a.instance.hostname,
                a.exit_status.map(|c| c.to_string()).unwrap_or_default(),
                a.last_committed
                    .as_ref()
                    .map(|c| format!("#{} {}", c.seq, c.name))
                    .unwrap_or_default(),
                a.time_lost_seconds
                    .map(|s| format!("{s:.0}s"))
                    .unwrap_or_default(),
            );
        }
    }
    if completed.is_some() {
        0
    } else {
        exit_code::NOT_COMPLETED
    }
}
