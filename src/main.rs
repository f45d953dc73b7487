//! `spotguard`: the thin binary. Parsing, logging and exit codes live here; the work is in
//! `crates/*`.

/// `println!` that does not panic when stdout is closed early (`spotguard ls | head`).
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

mod cli;
mod exit_code;
mod logging;
mod queue_run;
mod report;
mod run;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use clap::error::{ContextKind, ErrorKind};
use spotguard_checkpoint::bytes;
use spotguard_notice::{Cloud, Endpoints, WatchOptions};
use spotguard_session::{CloudChoice, RunOptions};
use spotguard_store::{Manifest, RestoreOptions, RestoreReport, Store, StoreOptions};
use tracing::error;

use crate::cli::{Cli, CloudArg, Command, LsArgs, QueueCommand, ResumeArgs, RunArgs, StoreArgs};

/// How long the start-up check of the store may take.
const STORE_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

fn main() -> ExitCode {
    bounded_allocator();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(&e),
    };
    logging::init(cli.log_format, cli.verbose as i8 - cli.quiet as i8);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!("failed to start the async runtime: {e}");
            return ExitCode::from(exit_code::SETUP_FAILED);
        }
    };
    let code = runtime.block_on(run(cli.command));
    // Background probes and watches may be mid-request: do not wait for them.
    runtime.shutdown_background();
    ExitCode::from(code)
}

/// Uploads and downloads move multi-megabyte part buffers. glibc raises its mmap threshold
/// each time such a buffer is freed, after which they come from the heap arenas and are
/// rarely given back: resident memory then grows with the checkpoint instead of staying at
/// part size × concurrency. A fixed threshold keeps every large buffer an mmap, returned on
/// free (mallopt(3)).
fn bounded_allocator() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes allocator tuning; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

async fn run(command: Command) -> u8 {
    match command {
        Command::Run(args) => run::run_command(args).await,
        Command::Status(args) => run::status(args).await,
        Command::Report(args) => report::report(args).await,
        Command::Queue(cmd) => queue(cmd).await,
        Command::Ls(args) => ls(args).await,
        Command::Resume(args) => resume(args).await,
    }
}

/// The job's checkpoint dir when none is given.
pub(crate) fn default_checkpoint_dir(args: &StoreArgs) -> PathBuf {
    state_root(args)
        .join("jobs")
        .join(&args.job)
        .join("checkpoints")
}

/// Restores the newest committed checkpoint into `dir`, logging what it did.
pub(crate) async fn restore_newest(
    job: &spotguard_store::JobStore,
    dir: &std::path::Path,
) -> Result<Option<(Manifest, RestoreReport)>, String> {
    // A progress line on a terminal, nothing otherwise (logs stay clean).
    let progress = std::io::stderr()
        .is_terminal()
        .then(|| std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0)));
    let ticker = progress.clone().map(|p| tokio::spawn(show_progress(p)));
    let opts = RestoreOptions {
        progress,
        ..RestoreOptions::default()
    };
    let found = job.restore_newest(dir, &opts).await;
    if let Some(t) = ticker {
        t.abort();
        eprint!("\r\x1b[2K");
    }
    let found = found.map_err(|e| e.to_string())?;
    match &found {
        Some((m, rep)) => tracing::info!(
            seq = m.seq,
            checkpoint = %m.name,
            "restored the newest complete checkpoint: {} ({} downloaded, {} files already here) in {:.1}s",
            bytes(rep.bytes),
            bytes(rep.fetched_bytes),
            rep.reused_files,
            rep.elapsed.as_secs_f64()
        ),
        None => tracing::debug!(
            "no committed checkpoint for job {}: starting fresh",
            job.layout().job()
        ),
    }
    Ok(found)
}

async fn queue(cmd: QueueCommand) -> u8 {
    let args = match &cmd {
        QueueCommand::Create(a) => &a.store,
        QueueCommand::Status(a) => &a.store,
    };
    let job = args.job.clone();
    let store = match store_or_exit(args).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let q = spotguard_queue::Queue::new(store.job(&job));
    match cmd {
        QueueCommand::Create(a) => {
            let items: Vec<String> = match (&a.items, a.range) {
                (Some(file), _) => match std::fs::read_to_string(file) {
                    Ok(text) => text
                        .lines()
                        .map(str::trim)
                        .filter(|l| !l.is_empty())
                        .map(str::to_owned)
                        .collect(),
                    Err(e) => {
                        eprintln!(
                            "spotguard: error: cannot read --items {}: {e}",
                            file.display()
                        );
                        return exit_code::USAGE;
                    }
                },
                (None, Some((first, last))) => (first..=last).map(|i| i.to_string()).collect(),
                (None, None) => unreachable!("clap requires --items or --range"),
            };
            match q.create(&items, a.shard_size as usize, a.append).await {
                Ok(ids) => {
                    outln!(
                        "{} items in {} shards ({}..{})",
                        items.len(),
                        ids.len(),
                        ids.start,
                        ids.end
                    );
                    0
                }
                Err(e) => {
                    error!("{e}");
                    exit_code::SETUP_FAILED
                }
            }
        }
        QueueCommand::Status(a) => {
            let (counts, states) = match tokio::try_join!(q.counts(), q.states()) {
                Ok(x) => x,
                Err(e) => {
                    error!("{e}");
                    return exit_code::SETUP_FAILED;
                }
            };
            if a.json {
                let shards: Vec<_> = states
                    .iter()
                    .map(|(id, s)| serde_json::json!({ "id": id, "state": s }))
                    .collect();
                let doc = serde_json::json!({ "job": job, "counts": counts, "shards": shards });
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&doc).expect("serializes")
                );
            } else {
                outln!(
                    "{} shards: {} pending, {} leased, {} done, {} failed",
                    states.len(),
                    counts.pending,
                    counts.leased,
                    counts.done,
                    counts.failed
                );
                for (id, s) in states.iter().filter(|(_, s)| s.attempts > 0) {
                    outln!(
                        "{id:>8}  {:<8} attempts {:<3} owner {}",
                        serde_json::to_value(s.phase)
                            .expect("serializes")
                            .as_str()
                            .unwrap_or_default(),
                        s.attempts,
                        s.owner.as_deref().unwrap_or("-")
                    );
                }
            }
            0
        }
    }
}

/// `[spotguard] restoring: 1.2 GiB at 180 MiB/s`, redrawn in place.
async fn show_progress(done: std::sync::Arc<std::sync::atomic::AtomicU64>) {
    let start = std::time::Instant::now();
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(250));
    loop {
        tick.tick().await;
        let n = done.load(std::sync::atomic::Ordering::Relaxed);
        let rate = n as f64 / start.elapsed().as_secs_f64().max(1e-3);
        eprint!(
            "\r\x1b[2K[spotguard] restoring: {} at {}/s",
            bytes(n),
            bytes(rate as u64)
        );
    }
}

async fn resume(args: ResumeArgs) -> u8 {
    let store = match store_or_exit(&args.store).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let dir = args
        .to
        .clone()
        .unwrap_or_else(|| default_checkpoint_dir(&args.store));
    match restore_newest(&store.job(&args.store.job), &dir).await {
        Ok(Some((m, rep))) => {
            if args.print_env {
                outln!(
                    "export SPOTGUARD_RESUME_DIR={}",
                    shell_quote(&rep.path.to_string_lossy())
                );
                outln!("export SPOTGUARD_RESUME_NAME={}", shell_quote(&m.name));
                outln!("export SPOTGUARD_RESUME_SEQ={}", m.seq);
            } else {
                outln!("{}", rep.path.display());
            }
            0
        }
        Ok(None) => exit_code::NOTHING_TO_RESUME,
        Err(e) => {
            error!("{e}");
            exit_code::SETUP_FAILED
        }
    }
}

/// `'it'\''s'`: safe inside `eval`.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Opens and checks the store named by `args`; a one-line error otherwise.
/// Starts the `--outputs` uploader, if asked for.
pub(crate) fn start_outputs(
    args: &RunArgs,
    job: &spotguard_store::JobStore,
) -> Result<Option<spotguard_checkpoint::outputs::Outputs>, u8> {
    let Some(dir) = &args.outputs else {
        return Ok(None);
    };
    let opts = spotguard_store::UploadOptions {
        part_size: args.part_size as usize,
        concurrency: args.upload_concurrency as usize,
        ..spotguard_store::UploadOptions::default()
    };
    spotguard_checkpoint::outputs::Outputs::start(dir, job.clone(), opts)
        .map(Some)
        .map_err(|e| {
            error!("{e}");
            exit_code::SETUP_FAILED
        })
}

/// Uploads what the command left in `--outputs`; true when some output could not be uploaded.
pub(crate) async fn finish_outputs(
    outputs: Option<spotguard_checkpoint::outputs::Outputs>,
) -> bool {
    let Some(outputs) = outputs else { return false };
    let report = outputs.finish().await;
    for (rel, why) in &report.failed {
        error!(output = %rel, "output NOT uploaded: {why}");
    }
    !report.failed.is_empty()
}

/// The store, or the exit code after logging why not.
pub(crate) async fn store_or_exit(args: &StoreArgs) -> Result<Store, u8> {
    open_store(args).await.map_err(|e| {
        error!("{e}");
        exit_code::SETUP_FAILED
    })
}

pub(crate) async fn open_store(args: &StoreArgs) -> Result<Store, String> {
    let url = match &args.store {
        Some(url) => url.clone(),
        None => state_root(args)
            .join("store")
            .to_string_lossy()
            .into_owned(),
    };
    let opts = StoreOptions {
        config: args.store_options.clone(),
        ..StoreOptions::default()
    };
    let store = Store::open(&url, &opts).map_err(|e| e.to_string())?;
    store
        .check(STORE_CHECK_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    Ok(store)
}

fn state_root(args: &StoreArgs) -> PathBuf {
    args.state_dir.clone().unwrap_or_else(default_state_dir)
}

async fn ls(args: LsArgs) -> u8 {
    let store = match store_or_exit(&args.store).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let job = store.job(&args.store.job);
    let manifests = match job.committed().await {
        Ok(m) => m,
        Err(e) => {
            error!("{e}");
            return exit_code::SETUP_FAILED;
        }
    };
    if args.json {
        let list: Vec<_> = manifests
            .iter()
            .map(|m| {
                serde_json::json!({
                    "seq": m.seq, "name": m.name, "kind": m.kind, "bytes": m.total_bytes,
                    "files": m.file_count(), "created": m.created, "rule": m.rule,
                    "instance": m.instance,
                })
            })
            .collect();
        let doc =
            serde_json::json!({ "store": store.url(), "job": args.store.job, "checkpoints": list });
        outln!(
            "{}",
            serde_json::to_string_pretty(&doc).expect("JSON serializes")
        );
        return 0;
    }
    if manifests.is_empty() {
        eprintln!(
            "no committed checkpoints for job {} in {}",
            args.store.job,
            store.url()
        );
        return 0;
    }
    outln!(
        "{:>6}  {:<32} {:>10} {:>6}  {:<20}  RULE",
        "SEQ",
        "NAME",
        "SIZE",
        "FILES",
        "CREATED"
    );
    for m in &manifests {
        outln!(
            "{:>6}  {:<32} {:>10} {:>6}  {:<20}  {}",
            m.seq,
            m.name,
            bytes(m.total_bytes),
            m.file_count(),
            m.created,
            m.rule
        );
    }
    0
}

pub(crate) fn run_options(args: &RunArgs) -> Result<RunOptions, String> {
    let cloud = match args.cloud {
        CloudArg::Auto => CloudChoice::Auto,
        CloudArg::None => CloudChoice::None,
        CloudArg::Aws => CloudChoice::Only(Cloud::Aws),
        CloudArg::Gcp => CloudChoice::Only(Cloud::Gcp),
        CloudArg::Azure => CloudChoice::Only(Cloud::Azure),
        CloudArg::Aliyun => CloudChoice::Only(Cloud::Aliyun),
        CloudArg::Tencent => CloudChoice::Only(Cloud::Tencent),
        CloudArg::Volcengine => CloudChoice::Only(Cloud::Volcengine),
    };
    let mut endpoints = Endpoints::from_env();
    if let Some(url) = &args.metadata_endpoint {
        let CloudChoice::Only(c) = cloud else {
            return Err("--metadata-endpoint needs --cloud to name the cloud it is for".into());
        };
        endpoints = endpoints.with(c, url);
    }
    let mut opts = RunOptions::new(args.command.clone(), state_root(&args.store));
    opts.job = args.store.job.clone();
    opts.cloud = cloud;
    opts.endpoints = endpoints;
    opts.watch = WatchOptions {
        poll_interval: args.poll_interval,
        imdsv1_fallback: args.imdsv1_fallback,
    };
    opts.grace = args.grace;
    opts.safety_margin = args.safety_margin;
    opts.stop_signal = args.stop_signal;
    opts.checkpoint_signal = args.checkpoint_signal;
    opts.notice_signal = args.notice_signal;
    opts.simulate = args.simulate_preemption;
    if let Some(timeout) = args.idle_timeout {
        if timeout.is_zero() {
            return Err("--idle-timeout must be more than 0".into());
        }
        let mut idle = spotguard_session::IdleOptions::new(timeout);
        idle.cpu_percent = args.idle_cpu;
        idle.gpu_percent = args.idle_gpu;
        idle.on_idle = args.on_idle.clone();
        opts.idle = Some(idle);
    }
    Ok(opts)
}

pub(crate) fn hostname() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// `$XDG_STATE_HOME/spotguard`, else `~/.local/state/spotguard`, else a dir under /tmp.
fn default_state_dir() -> PathBuf {
    let from = |var: &str| {
        std::env::var_os(var)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(x) = from("XDG_STATE_HOME") {
        return x.join("spotguard");
    }
    if let Some(home) = from("HOME") {
        return home.join(".local/state/spotguard");
    }
    std::env::temp_dir().join(format!("spotguard-{}", nix::unistd::getuid()))
}

/// Help and version print as usual; every other parse error is one line and exit code 2.
fn usage_error(e: &clap::Error) -> ExitCode {
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        let _ = e.print();
        return ExitCode::from(exit_code::USAGE);
    }
    eprintln!("spotguard: {}", one_line(e));
    ExitCode::from(exit_code::USAGE)
}

/// clap's message up to its first blank line, joined into one line.
fn one_line(e: &clap::Error) -> String {
    let rendered = e.render().to_string();
    let mut parts: Vec<&str> = rendered
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    if parts.len() == 1
        && let Some(valid) = e.get(ContextKind::ValidValue)
    {
        return format!("{} (possible values: {valid})", parts[0]);
    }
    if parts.is_empty() {
        parts.push("error: bad usage");
    }
    parts.join(" ")
}
