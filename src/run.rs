//! `spotguard run` around the session: resume, the attempt ledger, relaunches; and
//! `spotguard status`, which reads the ledger.

use std::sync::Arc;
use std::time::SystemTime;

use spotguard_checkpoint::CheckpointOptions;
use spotguard_session::{Checkpoints, Outcome, RunOptions, Stats};
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
    let _metrics = match args.metrics_addr {
        Some(addr) => match spotguard_stats::serve(addr, base.stats.clone()).await {
            Ok(task) => Some(spotguard_session::AbortOnDrop(task)),
            Err(e) => {
                error!("cannot serve metrics at {addr}: {e}");
                return exit_code::USAGE;
            }
        },
        None => None,
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
        let mut restore_seconds = None;
        if !args.no_resume {
            let began = std::time::Instant::now();
            match restore_newest(&job, &dir).await {
                Ok(Some((m, rep))) => {
                    let secs = began.elapsed().as_secs_f64();
                    base.stats.restored(secs);
                    restore_seconds = Some(secs);
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
        opts.checkpoints = Some(checkpoints(&args, dir.clone(), job.clone(), &base.stats));

        let mut attempt = Attempt::begin(instance.clone(), resumed_from);
        attempt.restore_seconds = restore_seconds;
        let since = Since::now(&base.stats);
        if let Err(e) = job.record_attempt(&mut attempt).await {
            warn!("failed to record the attempt: {e}");
        }
        let heartbeat = tokio::spawn(heartbeat(
            job.clone(),
            attempt.clone(),
            base.stats.clone(),
            since,
        ));
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
        since.fill(&mut attempt, &base.stats);
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
pub(crate) fn checkpoints(
    args: &RunArgs,
    dir: std::path::PathBuf,
    store: JobStore,
    stats: &Arc<Stats>,
) -> Checkpoints {
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
            stats: Some(stats.clone()),
            ..CheckpointOptions::default()
        },
    }
}

/// Where this attempt's share of the run's measurements begins (a restart is a new attempt).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Since {
    commits: usize,
    idle: usize,
}

impl Since {
    pub(crate) fn now(stats: &Stats) -> Since {
        Since {
            commits: stats.commit_count(),
            idle: stats.idle_count(),
        }
    }

    /// Copies this attempt's measurements into its record.
    pub(crate) fn fill(self, a: &mut Attempt, stats: &Stats) {
        a.checkpoints = stats.commits_since(self.commits);
        a.idle = stats.idle_events_since(self.idle);
        a.work_saved_at = stats.work_saved_at().map(spotguard_stats::timestamp);
        if let Some(id) = stats.instance() {
            a.instance = Instance {
                hostname: std::mem::take(&mut a.instance.hostname),
                ..id
            };
        }
    }
}

/// Refreshes a running attempt's record so `status` can tell running from crashed, and
/// records what changed (a commit, the instance's identity, an idle firing) soon after.
pub(crate) async fn heartbeat(
    job: JobStore,
    mut attempt: Attempt,
    stats: Arc<Stats>,
    since: Since,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(HEARTBEAT) => {}
            () = stats.changed.notified() => {}
        }
        since.fill(&mut attempt, &stats);
        if let Err(e) = job.record_attempt(&mut attempt).await {
            warn!("failed to refresh the attempt record: {e}");
        }
    }
}

/// Records how the attempt ended; marks the job completed when the command succeeded (for a
/// queue worker: exit 0, the queue is drained).
pub(crate) async fn finish_attempt(
    job: &JobStore,
    a: &mut Attempt,
    outcome: Option<&Outcome>,
    code: u8,
) {
    let now = SystemTime::now();
    a.ended = Some(humantime::format_rfc3339_millis(now).to_string());
    a.exit_status = Some(code);
    a.outcome = match outcome {
        Some(o) if o.preempted.is_some() => AttemptOutcome::Preempted,
        Some(o) if o.end.success() && !o.upload_failed() => AttemptOutcome::Completed,
        None if code == 0 => AttemptOutcome::Completed,
        _ => AttemptOutcome::Failed,
    };
    a.final_upload_seconds = outcome.and_then(|o| {
        o.flushed_at
            .duration_since(o.exited_at)
            .ok()
            .map(|d| d.as_secs_f64())
    });
    if let Ok(started) = humantime::parse_rfc3339(&a.started) {
        a.wall_seconds = now.duration_since(started).ok().map(|d| d.as_secs_f64());
    }
    let lost_until = match outcome.and_then(|o| o.preempted.as_deref().map(|n| (o, n))) {
        Some((o, n)) => {
            let secs = |from: SystemTime, to: SystemTime| {
                to.duration_since(from).ok().map(|d| d.as_secs_f64())
            };
            a.notice = Some(NoticeRecord {
                source: n.source.to_string(),
                received: spotguard_stats::timestamp(n.received),
                deadline: n
                    .deadline
                    .map(|d| humantime::format_rfc3339_seconds(d).to_string()),
                warning_seconds: n.warning().map(|w| w.as_secs_f64()),
                stop_seconds: secs(n.received, o.exited_at),
                upload_seconds: secs(o.exited_at, o.flushed_at),
                durable_in_time: Some(
                    !o.upload_failed() && n.deadline.is_none_or(|d| o.flushed_at <= d),
                ),
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
    }
    a.time_lost_seconds = match a.outcome {
        AttemptOutcome::Completed => None,
        _ => Some(a.lost_until(lost_until)),
    };
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
                a.started
                    .get(..19)
                    .map_or(a.started.clone(), |s| format!("{s}Z")),
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
