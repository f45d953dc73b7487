//! One run of a job: the supervised command, the notice sources, and the stop sequence that
//! joins them. See `DESIGN.md` beside this crate for the signal-handling design.

mod idle;
mod state;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use spotguard_checkpoint::{CheckpointOptions, Checkpointer, FlushReport, bytes};
use spotguard_notice::{
    Cloud, Endpoints, Notice, NoticeKind, NoticeSource, Simulated, Source, WatchOptions,
};
use spotguard_supervise::{
    FORWARDED, ProcessEnd, Signal, Signals, SpawnError, Supervisor, humanize,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

pub use idle::IdleOptions;
pub use spotguard_stats::Stats;
pub use state::StateDir;

/// Which metadata service to watch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloudChoice {
    /// Probe them all in the background; watch the one that answers.
    Auto,
    /// Watch none: signals only.
    None,
    /// Watch this one, without probing.
    Only(Cloud),
}

/// Everything `spotguard run` needs, with the CLI's defaults.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The command and its arguments.
    pub command: Vec<OsString>,
    pub job: String,
    pub state_dir: PathBuf,
    pub cloud: CloudChoice,
    pub endpoints: Endpoints,
    pub watch: WatchOptions,
    /// Time a signal notice gives before the platform kills everything (Kubernetes'
    /// `terminationGracePeriodSeconds`, `docker stop -t`).
    pub grace: Duration,
    /// The command is killed this long before a notice's deadline, so what follows the
    /// command's exit (uploads, acknowledgement) still fits.
    pub safety_margin: Duration,
    /// Sent to the command on a Terminate notice. `None`: forward the signal that came (SIGINT
    /// stays SIGINT), SIGTERM for cloud notices.
    pub stop_signal: Option<Signal>,
    /// Sent to the command on a Hint notice, if set.
    pub checkpoint_signal: Option<Signal>,
    /// An extra signal that means "you are being preempted" (SLURM `--signal=B:USR1@120`), and
    /// the warning it gives (default: `grace`).
    pub notice_signal: Option<(Signal, Option<Duration>)>,
    /// Raise a simulated Terminate notice after this long.
    pub simulate: Option<Duration>,
    /// How long processes left behind by the command get to exit before SIGKILL.
    pub linger: Duration,
    /// How long auto-detection may take.
    pub detect_timeout: Duration,
    /// Where checkpoints are written and where they go; `None` runs without them.
    pub checkpoints: Option<Checkpoints>,
    /// Extra environment for the command (`SPOTGUARD_RESUME_*`).
    pub env: Vec<(String, OsString)>,
    /// Extra notice sources, started with the others (e.g. a task-queue lease watch).
    pub sources: Vec<Arc<dyn NoticeSource>>,
    /// Where the run's measurements go (the ledger, the metrics endpoint).
    pub stats: Arc<Stats>,
    /// The idle watchdog, when on.
    pub idle: Option<IdleOptions>,
}

/// Checkpoints of the run: the local dir the command writes into and the job's store.
#[derive(Clone, Debug)]
pub struct Checkpoints {
    pub dir: PathBuf,
    pub store: spotguard_store::JobStore,
    pub opts: CheckpointOptions,
}

impl RunOptions {
    /// Options for `command` with every default.
    pub fn new(command: Vec<OsString>, state_dir: PathBuf) -> Self {
        RunOptions {
            command,
            job: "default".into(),
            state_dir,
            cloud: CloudChoice::Auto,
            endpoints: Endpoints::default(),
            watch: WatchOptions::default(),
            grace: Duration::from_secs(30),
            safety_margin: Duration::from_secs(5),
            stop_signal: None,
            checkpoint_signal: None,
            notice_signal: None,
            simulate: None,
            linger: Duration::from_secs(5),
            detect_timeout: Duration::from_secs(2),
            checkpoints: None,
            env: Vec::new(),
            sources: Vec::new(),
            stats: Arc::default(),
            idle: None,
        }
    }
}

/// How the run ended.
#[derive(Debug)]
pub struct Outcome {
    /// How the command ended.
    pub end: ProcessEnd,
    /// The Terminate notice that stopped it, if one did.
    pub preempted: Option<Box<Notice>>,
    /// Whether it had to be SIGKILLed.
    pub killed: bool,
    /// What the final upload made durable (`None` without checkpoints).
    pub flush: Option<FlushReport>,
    /// When the command (and everything it started) had exited.
    pub exited_at: SystemTime,
    /// When the final upload was over.
    pub flushed_at: SystemTime,
}

impl Outcome {
    /// The newest complete checkpoint did not reach the store.
    pub fn upload_failed(&self) -> bool {
        self.flush.as_ref().is_some_and(FlushReport::failed)
    }
}

/// Why the run could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Spawn(#[from] SpawnError),
    #[error("failed to prepare the state dir {path}: {source}")]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Checkpoints(#[from] spotguard_checkpoint::Error),
}

/// A stop in progress: the notice that started it and when the command will be killed.
#[derive(Debug)]
struct Stop {
    notice: Notice,
    kill_at: Instant,
    /// A stop signal (SIGINT/SIGTERM/the notice signal) has been received: another kills at once.
    signalled: bool,
    killed: bool,
}

/// Shortest time the command gets after the stop signal, even when a deadline has passed.
const MIN_STOP_WINDOW: Duration = Duration::from_secs(1);

/// Runs the command to its end, handling signals and notices. The heart of `spotguard run`.
pub async fn run(opts: RunOptions) -> Result<Outcome, Error> {
    let state = StateDir::prepare(&opts.state_dir, &opts.job)?;
    let mut catch: Vec<Signal> = FORWARDED.to_vec();
    if let Some((sig, _)) = opts.notice_signal
        && !catch.contains(&sig)
    {
        catch.push(sig);
    }
    let mut signals = Signals::new(&catch).map_err(Error::Signals)?;

    let mut cmd = Command::new(&opts.command[0]);
    cmd.args(&opts.command[1..])
        .env("SPOTGUARD_JOB", &opts.job)
        .env("SPOTGUARD_STATE_DIR", state.path())
        .env("SPOTGUARD_NOTICE_FILE", state.notice_file());
    // Only this run's resume point, never one inherited from the environment.
    for var in [
        "SPOTGUARD_RESUME_DIR",
        "SPOTGUARD_RESUME_NAME",
        "SPOTGUARD_RESUME_SEQ",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(opts.env.iter().map(|(k, v)| (k, v)));
    // Watch before the command starts, so no checkpoint it writes is missed.
    let checkpointer = match &opts.checkpoints {
        Some(c) => {
            let ckpt = Checkpointer::start(&c.dir, c.store.clone(), c.opts.clone()).await?;
            cmd.env("SPOTGUARD_CHECKPOINT_DIR", &c.dir);
            Some(ckpt)
        }
        None => None,
    };
    let mut sup = Supervisor::spawn(cmd)?;
    info!(pid = sup.pid().as_raw(), job = %opts.job, "started {}", display_command(&opts.command));
    if let Some(c) = &opts.checkpoints {
        info!(dir = %c.dir.display(), store = %c.store.url(), "checkpoints are uploaded as they complete");
    }

    let idle_stop = Arc::new(tokio::sync::Notify::new());
    let mut idle = opts.idle.clone().map(|o| {
        AbortOnDrop(tokio::spawn(idle::watch(
            o,
            opts.stats.clone(),
            idle_stop.clone(),
        )))
    });
    let (tx, mut notices) = mpsc::channel::<Notice>(16);
    let watched: Arc<OnceLock<Arc<dyn NoticeSource>>> = Arc::new(OnceLock::new());
    let identity = start_sources(&opts, tx, &watched);

    let mut run = Running {
        opts: &opts,
        sup: &mut sup,
        state: &state,
        stop: None,
    };
    let end = loop {
        let kill_at = run.stop.as_ref().filter(|s| !s.killed).map(|s| s.kill_at);
        tokio::select! {
            end = run.sup.wait() => break end,
            Some(sig) = signals.recv() => run.on_signal(sig),
            Some(notice) = notices.recv() => run.on_notice(notice, None),
            () = sleep_until(kill_at), if kill_at.is_some() => run.kill("the deadline came"),
        }
    };
    let stop = run.stop.take();
    info!("command {end}");
    let linger = stop.as_ref().map_or(opts.linger, |s| {
        opts.linger
            .min(s.kill_at.saturating_duration_since(Instant::now()))
            .max(MIN_STOP_WINDOW)
    });
    sup.finish(opts.stop_signal.unwrap_or(Signal::SIGTERM), linger)
        .await;
    idle_stop.notify_one();

    let exited_at = SystemTime::now();

    // Make what the command saved durable before the deadline (no deadline without a stop:
    // the retries bound it).
    let flush = match checkpointer {
        Some(ckpt) => {
            let deadline = stop
                .as_ref()
                .and_then(|s| s.notice.deadline)
                .map(instant_at);
            let report = ckpt.flush(deadline, end.success()).await;
            log_flush(&report);
            Some(report)
        }
        None => None,
    };

    let flushed_at = SystemTime::now();
    // After the flush, so the upload never waits: an --on-idle run in progress may finish and
    // have its status recorded (bounded; dropping the handle aborts the rest).
    if let Some(AbortOnDrop(h)) = &mut idle {
        let _ = tokio::time::timeout(Duration::from_secs(5), h).await;
    }
    drop(idle);
    // The ledger wants the machine's identity; a short run may end before the look-up does.
    if let Some(h) = identity
        && !h.is_finished()
    {
        let _ = tokio::time::timeout(Duration::from_secs(1), h).await;
    }
    let Some(stop) = stop else {
        return Ok(Outcome {
            end,
            preempted: None,
            killed: false,
            flush,
            exited_at,
            flushed_at,
        });
    };
    // The work is as safe as it will get: let the platform proceed (Azure's early ack).
    if let Some(source) = watched.get()
        && stop.notice.source == source.source()
    {
        match tokio::time::timeout(Duration::from_secs(3), source.acknowledge(&stop.notice)).await {
            Ok(Ok(())) => debug!(source = %stop.notice.source, "notice acknowledged"),
            Ok(Err(e)) => warn!("failed to acknowledge the notice: {e}"),
            Err(_) => warn!("failed to acknowledge the notice: timed out"),
        }
    }
    let now = SystemTime::now();
    let since =
        |t: SystemTime, from: SystemTime| humanize(t.duration_since(from).unwrap_or_default());
    let left = stop
        .notice
        .deadline
        .map(|d| d.duration_since(now).unwrap_or_default());
    info!(
        source = %stop.notice.source,
        "stopped by a preemption notice: command stopped {} after the notice, upload and commit took {}{}",
        since(exited_at, stop.notice.received),
        since(now, exited_at),
        left.map(|l| format!(", {} left before the deadline", humanize(l))).unwrap_or_default()
    );
    Ok(Outcome {
        end,
        preempted: Some(Box::new(stop.notice)),
        killed: stop.killed,
        flush,
        exited_at,
        flushed_at,
    })
}

/// A background task that ends with its owner.
#[derive(Debug)]
pub struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Asks the watched metadata service what this machine is, for the ledger.
fn learn_identity(source: Arc<dyn NoticeSource>, stats: Arc<Stats>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let id = match tokio::time::timeout(Duration::from_secs(10), source.identity()).await {
            Ok(id) => id,
            Err(_) => return,
        };
        debug!(?id, "instance identity");
        stats.set_instance(spotguard_store::Instance {
            hostname: String::new(),
            cloud: Some(source.source().to_string()),
            instance_id: id.instance_id,
            instance_type: id.instance_type,
            zone: id.zone,
            lifecycle: id.lifecycle,
        });
    })
}

/// The tokio instant of a wall-clock deadline.
fn instant_at(t: SystemTime) -> Instant {
    Instant::now() + t.duration_since(SystemTime::now()).unwrap_or_default()
}

/// What was made durable and what was not, loudly when something was not.
fn log_flush(r: &FlushReport) {
    for c in &r.committed {
        info!(checkpoint = %c.name, seq = c.seq, "durable: {} in {:.1}s", bytes(c.bytes), c.elapsed.as_secs_f64());
    }
    for (name, why) in &r.not_durable {
        error!(checkpoint = %name, "NOT durable: {why}");
    }
    for (name, why) in &r.incomplete {
        warn!(checkpoint = %name, "not uploaded, it was never complete: {why}");
    }
    match &r.newest {
        Some((name, true)) => info!(checkpoint = %name, "the newest checkpoint is committed"),
        Some((name, false)) => {
            error!(checkpoint = %name, "the newest checkpoint could not be made durable")
        }
        None => debug!("no new checkpoint to upload"),
    }
}

/// Starts the notice sources in the background: nothing here may delay the command. Returns
/// the look-up of the machine's identity when the cloud is known up front.
fn start_sources(
    opts: &RunOptions,
    tx: mpsc::Sender<Notice>,
    watched: &Arc<OnceLock<Arc<dyn NoticeSource>>>,
) -> Option<tokio::task::JoinHandle<()>> {
    for source in &opts.sources {
        tokio::spawn(source.clone().watch(tx.clone()));
    }
    if let Some(after) = opts.simulate {
        info!(
            "rehearsal: a simulated preemption notice comes in {}",
            humanize(after)
        );
        let sim = Arc::new(Simulated {
            after,
            warning: opts.grace,
        });
        tokio::spawn(sim.watch(tx.clone()));
    }
    match opts.cloud {
        CloudChoice::None => {
            debug!("cloud notices off (--cloud none)");
            None
        }
        CloudChoice::Only(cloud) => {
            let source = spotguard_notice::cloud_source(cloud, &opts.endpoints, &opts.watch);
            info!(%cloud, endpoint = %opts.endpoints.get(cloud), "watching the metadata service for preemption notices");
            let _ = watched.set(source.clone());
            let identity = learn_identity(source.clone(), opts.stats.clone());
            tokio::spawn(source.watch(tx));
            Some(identity)
        }
        CloudChoice::Auto => {
            let (endpoints, watch, timeout) = (
                opts.endpoints.clone(),
                opts.watch.clone(),
                opts.detect_timeout,
            );
            let watched = watched.clone();
            let stats = opts.stats.clone();
            tokio::spawn(async move {
                match spotguard_notice::detect(&endpoints, &watch, timeout).await {
                    Some(source) => {
                        let _ = watched.set(source.clone());
                        // Detached: the run does not wait for it (detection took long already).
                        drop(learn_identity(source.clone(), stats));
                        source.watch(tx).await;
                    }
                    None => info!(
                        "no cloud metadata service answered; only signals can announce a preemption"
                    ),
                }
            });
            None
        }
    }
}

struct Running<'a> {
    opts: &'a RunOptions,
    sup: &'a mut Supervisor,
    state: &'a StateDir,
    stop: Option<Stop>,
}

impl Running<'_> {
    fn on_signal(&mut self, sig: Signal) {
        let notice_signal = self.opts.notice_signal.filter(|(s, _)| *s == sig);
        if !(sig == Signal::SIGINT || sig == Signal::SIGTERM || notice_signal.is_some()) {
            debug!("forwarding {sig} to the command");
            self.sup.signal_group(sig);
            return;
        }
        if let Some(stop) = &self.stop
            && stop.signalled
        {
            warn!("{sig} received again during the stop; killing the command now");
            self.kill("a second stop signal came");
            return;
        }
        let warning = notice_signal
            .and_then(|(_, lead)| lead)
            .unwrap_or(self.opts.grace);
        let notice = Notice::terminate(
            Source::Signal(sig.as_str().to_owned()),
            SystemTime::now() + warning,
            format!("{sig} received"),
        );
        // The notice signal itself (e.g. SIGUSR1) is not a stop signal the command expects.
        let forward = if notice_signal.is_some() {
            Signal::SIGTERM
        } else {
            sig
        };
        self.on_notice(notice, Some(forward));
        if let Some(stop) = &mut self.stop {
            stop.signalled = true;
        }
    }

    /// The stop sequence. `received` is the signal that raised the notice, if one did.
    fn on_notice(&mut self, notice: Notice, received: Option<Signal>) {
        let kind = if notice.kind == NoticeKind::Hint {
            "hint"
        } else {
            "terminate"
        };
        self.opts.stats.notice(&notice.source.to_string(), kind);
        if notice.kind == NoticeKind::Hint {
            info!(source = %notice.source, "checkpoint hint: {}", notice.detail);
            if let Some(sig) = self.opts.checkpoint_signal {
                info!("sending {sig} to the command so it saves a checkpoint");
                self.sup.signal_group(sig);
            }
            return;
        }
        let kill_at = self.kill_time(&notice);
        if let Some(stop) = &mut self.stop {
            info!(source = %notice.source, "another preemption notice: {}", notice.detail);
            if kill_at < stop.kill_at {
                info!(
                    "the new deadline is earlier; the command now has {} left",
                    humanize(kill_at - Instant::now())
                );
                stop.kill_at = kill_at;
            }
            return;
        }
        let sig = self
            .opts
            .stop_signal
            .or(received)
            .unwrap_or(Signal::SIGTERM);
        info!(
            source = %notice.source,
            deadline = notice.deadline.map(|d| humantime::format_rfc3339_seconds(d).to_string()).unwrap_or_default(),
            "preemption notice: {}; sending {sig} to the command, SIGKILL in {} unless it exits",
            notice.detail,
            humanize(kill_at - Instant::now()),
        );
        if let Err(e) = self.state.write_notice(&notice) {
            warn!(
                "failed to write {}: {e}",
                self.state.notice_file().display()
            );
        }
        self.sup.signal_group(sig);
        self.stop = Some(Stop {
            notice,
            kill_at,
            signalled: false,
            killed: false,
        });
    }

    /// The deadline less the safety margin, but never less than a moment from now.
    fn kill_time(&self, notice: &Notice) -> Instant {
        let now = Instant::now();
        let until_deadline = notice.deadline.map_or(self.opts.grace, |d| {
            d.duration_since(SystemTime::now()).unwrap_or_default()
        });
        now + until_deadline
            .saturating_sub(self.opts.safety_margin)
            .max(MIN_STOP_WINDOW)
    }

    fn kill(&mut self, why: &str) {
        warn!("{why}: sending SIGKILL to the command and everything it started");
        self.sup.signal_all(Signal::SIGKILL);
        if let Some(stop) = &mut self.stop {
            stop.killed = true;
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn display_command(cmd: &[OsString]) -> String {
    cmd.iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}
