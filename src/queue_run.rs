//! `spotguard run --queue`: claim a shard, run the command on its remaining items with the
//! lease renewed (and progress recorded) in the background, mark it done or failed, claim the
//! next; exit 0 when the queue is drained. On a preemption the shard is released at once with
//! its progress, so another instance takes it over without waiting for the lease to expire.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use spotguard_notice::{BoxFuture, Notice, NoticeSource, Source};
use spotguard_queue::{Error as QueueError, Lease, Queue};
use spotguard_session::{Outcome, RunOptions};
use spotguard_store::{Attempt, Instance, Store};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::{Notify, mpsc, oneshot};
use tracing::{error, info, warn};

use crate::cli::RunArgs;
use crate::run::Since;
use crate::{exit_code, hostname, restore_newest};

/// Pause before looking again when other workers hold the remaining shards.
const WAIT_FOR_OTHERS: Duration = Duration::from_secs(2);

/// The worker is one attempt in the job's ledger: its machine time, notices and lost work
/// show in `spotguard report` like a `run`'s.
pub(crate) async fn run_queue(args: &RunArgs, base: RunOptions, store: Store) -> u8 {
    let job = store.job(&base.job);
    let mut attempt = Attempt::begin(
        Instance {
            hostname: hostname(),
            ..Instance::default()
        },
        None,
    );
    let since = Since::now(&base.stats);
    if let Err(e) = job.record_attempt(&mut attempt).await {
        warn!("failed to record the attempt: {e}");
    }
    let heartbeat = spotguard_session::AbortOnDrop(tokio::spawn(crate::run::heartbeat(
        job.clone(),
        attempt.clone(),
        base.stats.clone(),
        since,
    )));
    let (code, outcome) = work_through(args, &base, &store).await;
    drop(heartbeat);
    since.fill(&mut attempt, &base.stats);
    crate::run::finish_attempt(&job, &mut attempt, outcome.as_deref(), code).await;
    code
}

/// Claims and runs shards until none is left (0) or something ends the worker; with the
/// outcome of the shard run that did, when one did.
async fn work_through(
    args: &RunArgs,
    base: &RunOptions,
    store: &Store,
) -> (u8, Option<Box<Outcome>>) {
    let queue = Queue::new(store.job(&base.job));
    let worker = format!("{}-{}", hostname(), std::process::id());
    loop {
        let lease = match queue
            .claim(&worker, args.lease_ttl, args.max_attempts)
            .await
        {
            Ok(l) => l,
            Err(e) => {
                error!("failed to claim a shard: {e}");
                return (exit_code::SETUP_FAILED, None);
            }
        };
        let seen = queue.seen();
        base.stats.set_queue(spotguard_stats::QueueCounts {
            pending: seen.pending,
            leased: seen.leased,
            done: seen.done,
            failed: seen.failed,
        });
        let Some(lease) = lease else {
            // The claim just looked at every shard not known finished: what it saw is current.
            let counts = seen;
            if counts.pending == 0 && counts.leased == 0 {
                info!(
                    done = counts.done,
                    failed = counts.failed,
                    "the queue is drained"
                );
                if counts.failed > 0 {
                    warn!(
                        "{} shard(s) failed for good; `spotguard queue status` lists them",
                        counts.failed
                    );
                }
                return (0, None);
            }
            // Others hold the rest; their leases may expire or be released: look again soon.
            if wait_or_stop(WAIT_FOR_OTHERS).await {
                return (exit_code::PREEMPTED, None);
            }
            continue;
        };
        match run_shard(args, base, store, lease).await {
            ShardEnd::Next => {}
            ShardEnd::Exit(code, outcome) => return (code, outcome),
        }
    }
}

enum ShardEnd {
    Next,
    /// The worker stops, with the shard run's outcome when it ran.
    Exit(u8, Option<Box<Outcome>>),
}

async fn run_shard(args: &RunArgs, base: &RunOptions, store: &Store, lease: Lease) -> ShardEnd {
    let id = lease.id;
    let remaining = lease.remaining();
    info!(
        shard = id,
        attempt = lease.state().attempts,
        "claimed shard {id}: {} item(s) to do",
        remaining.len()
    );
    let dir = base
        .state_dir
        .join("jobs")
        .join(&base.job)
        .join("shards")
        .join(format!("{id:08}"));
    let (items_file, progress_file) = (dir.join("items.txt"), dir.join("progress.txt"));
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| {
            std::fs::write(
                &items_file,
                remaining
                    .iter()
                    .map(|i| format!("{i}\n"))
                    .collect::<String>(),
            )
        })
        .and_then(|()| std::fs::write(&progress_file, ""));
    if let Err(e) = written {
        error!("failed to prepare {}: {e}", dir.display());
        return ShardEnd::Exit(exit_code::SETUP_FAILED, None);
    }

    // Checkpoints and resume are the shard's own.
    let mut opts = base.clone();
    let shard_job = store.job(&format!("{}.shard-{id:08}", base.job));
    let ckpt_dir = dir.join("checkpoints");
    // The shard's first attempt: nothing of it can be in the store yet.
    let fresh = lease.state().attempts <= 1;
    if !args.no_resume && !fresh {
        match restore_newest(&shard_job, &ckpt_dir).await {
            Ok(Some((m, rep))) => {
                opts.env
                    .push(("SPOTGUARD_RESUME_DIR".into(), rep.path.into_os_string()));
                opts.env
                    .push(("SPOTGUARD_RESUME_NAME".into(), m.name.into()));
                opts.env
                    .push(("SPOTGUARD_RESUME_SEQ".into(), m.seq.to_string().into()));
            }
            Ok(None) => {}
            Err(e) => warn!(
                shard = id,
                "cannot resume the shard's checkpoint, starting it afresh: {e}"
            ),
        }
    }
    opts.env
        .push(("SPOTGUARD_SHARD_ID".into(), id.to_string().into()));
    opts.env
        .push(("SPOTGUARD_SHARD_ITEMS".into(), items_file.into_os_string()));
    opts.env.push((
        "SPOTGUARD_PROGRESS_FILE".into(),
        progress_file.clone().into_os_string(),
    ));
    let mut checkpoints = crate::run::checkpoints(args, ckpt_dir, shard_job, &base.stats);
    checkpoints.opts.fresh = fresh;
    opts.checkpoints = Some(checkpoints);
    let lost = Arc::new(Notify::new());
    opts.sources.push(Arc::new(LeaseLost {
        lost: lost.clone(),
        grace: args.grace,
    }));
    let (stop_keeper, stop_rx) = oneshot::channel();
    let keeper = tokio::spawn(keep_lease(
        lease,
        args.lease_ttl,
        progress_file.clone(),
        lost,
        stop_rx,
    ));

    // Earlier shards are done: nothing before this one started can be lost.
    base.stats.work_saved(SystemTime::now());
    let outputs = match crate::start_outputs(args, &store.job(&base.job)) {
        Ok(o) => o,
        Err(code) => return ShardEnd::Exit(code, None),
    };
    let result = spotguard_session::run(opts).await;
    let outputs_failed = crate::finish_outputs(outputs).await;
    let _ = stop_keeper.send(());
    let lease = keeper.await.expect("the lease keeper does not panic");
    let done = read_progress(&progress_file);

    let Some(lease) = lease else {
        warn!(shard = id, "the lease on shard {id} was lost; moving on");
        return ShardEnd::Next;
    };
    let settle = |what: &str, res: Result<(), QueueError>| match res {
        Ok(()) => info!(shard = id, "shard {id} {what}"),
        Err(e) => warn!(shard = id, "failed to mark shard {id} {what}: {e}"),
    };
    match result {
        Ok(o) if o.preempted.is_some() => {
            settle("released with its progress", lease.release(&done).await);
            // The items recorded are not lost: they count as saved when last recorded.
            if !done.is_empty()
                && let Ok(t) = std::fs::metadata(&progress_file).and_then(|m| m.modified())
            {
                base.stats.work_saved(t);
            }
            let code = if o.upload_failed() {
                exit_code::UPLOAD_FAILED
            } else {
                exit_code::PREEMPTED
            };
            ShardEnd::Exit(code, Some(Box::new(o)))
        }
        Ok(o) if o.end.success() && !o.upload_failed() && !outputs_failed => {
            let result = lease.done(&done).await;
            if result.is_ok() {
                base.stats.shard_done();
            }
            settle("done", result);
            ShardEnd::Next
        }
        Ok(o) => {
            let status = i32::from(if o.upload_failed() {
                exit_code::UPLOAD_FAILED
            } else {
                o.end.exit_code()
            });
            settle(
                &format!("failed (exit status {status})"),
                lease.fail(status, args.max_attempts, &done).await,
            );
            ShardEnd::Next
        }
        Err(e) => {
            error!(shard = id, "{e}");
            settle(
                "failed",
                lease
                    .fail(i32::from(exit_code::SETUP_FAILED), args.max_attempts, &done)
                    .await,
            );
            ShardEnd::Next
        }
    }
}

/// Renews the lease every third of its TTL, recording progress with each renewal. Returns the
/// lease when told to stop, `None` once it was lost (after waking the `LeaseLost` source).
async fn keep_lease(
    mut lease: Lease,
    ttl: Duration,
    progress: PathBuf,
    lost: Arc<Notify>,
    mut stop: oneshot::Receiver<()>,
) -> Option<Lease> {
    let period = ttl / 3;
    loop {
        tokio::select! {
            _ = &mut stop => return Some(lease),
            () = tokio::time::sleep(period) => {
                match lease.renew(ttl, &read_progress(&progress)).await {
                    Ok(()) => {}
                    Err(QueueError::Fenced { .. }) => {
                        lost.notify_one();
                        return None;
                    }
                    // A store hiccup: try again next period; the lease has slack until then.
                    Err(e) => warn!(shard = lease.id, "failed to renew the lease: {e}"),
                }
            }
        }
    }
}

/// Items the command recorded as finished, one per line.
fn read_progress(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .map(|t| {
            t.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// A notice source that fires when the shard's lease is lost: the command must stop, since
/// another worker owns the shard now.
#[derive(Debug)]
struct LeaseLost {
    lost: Arc<Notify>,
    grace: Duration,
}

impl NoticeSource for LeaseLost {
    fn source(&self) -> Source {
        Source::Other("lease")
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(async { true })
    }

    fn watch(self: Arc<Self>, tx: mpsc::Sender<Notice>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            self.lost.notified().await;
            let n = Notice::terminate(
                Source::Other("lease"),
                SystemTime::now() + self.grace,
                "the shard's lease was lost to another worker",
            );
            let _ = tx.send(n).await;
        })
    }
}

/// Sleeps `d`; true when SIGTERM/SIGINT came meanwhile (stop).
async fn wait_or_stop(d: Duration) -> bool {
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tokio::time::sleep(d).await;
        return false;
    };
    tokio::select! {
        () = tokio::time::sleep(d) => false,
        _ = term.recv() => true,
        _ = int.recv() => true,
    }
}
