//! The command line.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use nix::sys::signal::Signal;

use crate::exit_code;
use crate::logging::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "spotguard",
    version,
    about = "Run training and batch jobs safely on preemptible (spot) cloud machines",
    after_help = exit_code::HELP,
    propagate_version = true
)]
pub struct Cli {
    /// Log format on stderr.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "human",
        env = "SPOTGUARD_LOG_FORMAT"
    )]
    pub log_format: LogFormat,
    /// More log detail (-v debug, -vv trace).
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Less log detail (-q warnings and errors only, -qq errors only).
    #[arg(short, long, global = true, action = clap::ArgAction::Count, conflicts_with = "verbose")]
    pub quiet: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a command, upload its checkpoints, stop it cleanly on a preemption notice.
    #[command(after_help = RUN_AFTER_HELP)]
    Run(RunArgs),
    /// List a job's committed checkpoints.
    Ls(LsArgs),
    /// Restore a job's newest complete checkpoint, for re-provisioning scripts.
    #[command(after_help = RESUME_AFTER_HELP)]
    Resume(ResumeArgs),
    /// Batch work split into shards that instances lease from the store.
    #[command(subcommand)]
    Queue(QueueCommand),
    /// Show a job's attempts and whether it is completed.
    #[command(after_help = "Exit status: 0 the job is completed, 4 not yet, 70 error.")]
    Status(LsArgs),
    /// What the job cost and what preemptions took: time, lost work, overhead, the saving
    /// against on-demand, and the checkpoint interval to use.
    #[command(after_help = REPORT_AFTER_HELP)]
    Report(ReportArgs),
}

const REPORT_AFTER_HELP: &str = "\
Prices are per instance-hour. Billable time is each attempt's wall time from its start to its
end (at least 60 s each, as the clouds bill); the time to boot a machine and to restore is
not seen by spotguard before it starts, so add --boot if you know it.

Interval advice (Young/Daly): with checkpoint cost C (how long writing one blocks the
command) and mean time between preemptions M, the best interval is about sqrt(2·C·M); the
expected waste at interval T is C/T + T/(2M) of the run time.";

#[derive(Debug, Args)]
pub struct ReportArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// Spot price per instance-hour.
    #[arg(long, value_name = "PRICE")]
    pub price: Option<f64>,
    /// On-demand price per instance-hour of the same machine.
    #[arg(long, value_name = "PRICE")]
    pub on_demand_price: Option<f64>,
    /// A prices file: lines `INSTANCE_TYPE SPOT_PER_HOUR ON_DEMAND_PER_HOUR` (`#` comments);
    /// each attempt is priced by its instance type, `*` matches any.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["price", "on_demand_price"])]
    pub prices: Option<PathBuf>,
    /// Currency shown with prices.
    #[arg(long, value_name = "SYMBOL", default_value = "$")]
    pub currency: String,
    /// Mean time between preemptions for the advice [default: observed, when there were any].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub mtbp: Option<Duration>,
    /// Checkpoint cost for the advice [default: the measured write time of the checkpoints].
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub checkpoint_cost: Option<Duration>,
    /// Time each machine spent booting before spotguard started, billed but not seen.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "0s")]
    pub boot: Duration,
    /// Also write a self-contained HTML page with a timeline chart and the tables.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// One JSON object, for scripts.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum QueueCommand {
    /// Split items into shards in the job's prefix.
    Create(QueueCreateArgs),
    /// Shards pending / leased / done / failed, and who holds which lease.
    Status(LsArgs),
}

#[derive(Debug, Args)]
pub struct QueueCreateArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// A file with one item per line (blank lines skipped).
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "range",
        required_unless_present = "range"
    )]
    pub items: Option<PathBuf>,
    /// Integer items: A..B (B excluded) or A..=B (B included), e.g. frames 1..=250.
    #[arg(long, value_name = "A..B", value_parser = parse_range)]
    pub range: Option<(i64, i64)>,
    /// Items per shard.
    #[arg(long, value_name = "K", default_value = "1", value_parser = clap::value_parser!(u32).range(1..))]
    pub shard_size: u32,
    /// Add the items to an existing queue instead of refusing.
    #[arg(long)]
    pub append: bool,
}

/// `A..B` (end excluded) or `A..=B` (end included), as an inclusive pair.
fn parse_range(s: &str) -> Result<(i64, i64), String> {
    let bad = || format!("expected A..B or A..=B with integers, got {s:?}");
    let (a, b, inclusive) = match s.split_once("..=") {
        Some((a, b)) => (a, b, true),
        None => {
            let (a, b) = s.split_once("..").ok_or_else(bad)?;
            (a, b, false)
        }
    };
    let a: i64 = a.trim().parse().map_err(|_| bad())?;
    let b: i64 = b.trim().parse().map_err(|_| bad())?;
    let last = if inclusive { b } else { b - 1 };
    if last < a {
        return Err(format!("the range {s} is empty"));
    }
    Ok((a, last))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RestartPolicy {
    /// Never relaunch the command.
    Never,
    /// Relaunch it (resuming from the newest checkpoint) when it fails; never after a
    /// preemption notice.
    OnFailure,
}

const RESUME_AFTER_HELP: &str = "\
Prints the restored checkpoint's path on stdout (or, with --print-env, shell export
lines for SPOTGUARD_RESUME_DIR, SPOTGUARD_RESUME_NAME and SPOTGUARD_RESUME_SEQ).

Exit status:
  0     restored
  3     the job has no checkpoint yet (start fresh)
  70    error (store unreachable, every checkpoint damaged, ...)";

#[derive(Debug, Args)]
pub struct ResumeArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// Directory to restore into [default: the job's checkpoint dir].
    #[arg(long, value_name = "DIR")]
    pub to: Option<PathBuf>,
    /// Print `export` lines for a shell to eval instead of the path.
    #[arg(long)]
    pub print_env: bool,
}

/// Where a job's checkpoints are stored.
#[derive(Debug, Args)]
pub struct StoreArgs {
    /// Job name: names the state dir and the job's prefix in the store.
    #[arg(long, env = "SPOTGUARD_JOB", default_value = "default", value_parser = parse_job)]
    pub job: String,

    /// Object store for checkpoints: s3://bucket/prefix, gs://..., az://..., file:///path or a
    /// path [default: <state root>/store, a local directory]. S3-compatible services:
    /// AWS_ENDPOINT_URL=http://host:port.
    #[arg(long, env = "SPOTGUARD_STORE", value_name = "URL")]
    pub store: Option<String>,

    /// An object_store setting, e.g. aws_virtual_hosted_style_request=true (repeatable).
    #[arg(long = "store-option", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub store_options: Vec<(String, String)>,

    /// Local state root [default: $XDG_STATE_HOME/spotguard or ~/.local/state/spotguard].
    #[arg(long, env = "SPOTGUARD_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct LsArgs {
    #[command(flatten)]
    pub store: StoreArgs,
    /// One JSON object with every checkpoint, for scripts.
    #[arg(long)]
    pub json: bool,
}

const RUN_AFTER_HELP: &str = "\
The command gets these environment variables:
  SPOTGUARD_JOB          the job name
  SPOTGUARD_STATE_DIR    the job's local state dir
  SPOTGUARD_NOTICE_FILE  a JSON file (source, kind, deadline) that exists once a
                         preemption notice has come
  SPOTGUARD_CHECKPOINT_DIR  where to write checkpoints
  SPOTGUARD_RESUME_DIR   the restored newest committed checkpoint, when there is one
                         (SPOTGUARD_RESUME_NAME and SPOTGUARD_RESUME_SEQ name it)

Signals: SIGINT and SIGTERM start a stop (a second one kills at once); SIGHUP,
SIGQUIT, SIGUSR1, SIGUSR2 and SIGWINCH are forwarded to the command's process group.

Endpoint overrides (for tests and proxies): AWS_EC2_METADATA_SERVICE_ENDPOINT,
GCE_METADATA_HOST, SPOTGUARD_AZURE_METADATA_ENDPOINT, SPOTGUARD_ALIYUN_METADATA_ENDPOINT,
SPOTGUARD_TENCENT_METADATA_ENDPOINT, SPOTGUARD_VOLCENGINE_METADATA_ENDPOINT.

Checkpoints: each direct entry of SPOTGUARD_CHECKPOINT_DIR is one checkpoint. It is
uploaded as soon as it is complete: renamed into place (names starting with '.' or ending
in .tmp/.partial are ignored until then), a NAME.complete marker beside it, a PyTorch DCP
dir with .metadata, a Hugging Face checkpoint-N/ with trainer_state.json, a closed
Lightning .ckpt, or anything else after --settle without writes.

Exit status:
  N     the command's own exit status, passed through (128+N: killed by signal N)
  74    the newest checkpoint could not be uploaded
  75    a preemption notice stopped the command (relaunch to resume)
  2, 70, 126, 127: see spotguard --help";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CloudArg {
    /// Probe every metadata service in the background; watch the one that answers.
    Auto,
    /// Watch no metadata service: signals only.
    None,
    Aws,
    Gcp,
    Azure,
    Aliyun,
    Tencent,
    Volcengine,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub store: StoreArgs,

    /// Where the command writes checkpoints, one file or directory each (e.g. a Hugging Face
    /// Trainer output_dir) [default: <state root>/jobs/<job>/checkpoints].
    #[arg(long, value_name = "DIR")]
    pub checkpoint_dir: Option<PathBuf>,

    /// Committed checkpoints to keep in the store; older ones are deleted after each commit.
    #[arg(long, value_name = "N", default_value = "3", value_parser = clap::value_parser!(u32).range(1..))]
    pub keep: u32,

    /// A checkpoint no rule recognises is complete after this long without writes.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub settle: Duration,

    /// Multipart upload part size (at least 5MiB).
    #[arg(long, value_name = "SIZE", default_value = "16MiB", value_parser = parse_part_size)]
    pub part_size: u64,

    /// Work through the job's task queue: claim a shard, run the command on it
    /// (SPOTGUARD_SHARD_ID, SPOTGUARD_SHARD_ITEMS, SPOTGUARD_PROGRESS_FILE), mark it done, claim
    /// the next; exit 0 when none are left.
    #[arg(long)]
    pub queue: bool,

    /// Upload every result file the command finishes in DIR to <job>/outputs/ as soon as it
    /// is closed (rendered frames, processed shards).
    #[arg(long, value_name = "DIR")]
    pub outputs: Option<PathBuf>,

    /// Queue lease time; renewed every third of it while the command runs.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub lease_ttl: Duration,

    /// Queue: runs of a shard whose command fails before the shard is marked failed.
    #[arg(long, value_name = "N", default_value = "3", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_attempts: u32,

    /// Start without restoring the newest committed checkpoint.
    #[arg(long)]
    pub no_resume: bool,

    /// Relaunch a failed command on this machine, resuming from the newest checkpoint.
    #[arg(long, value_enum, default_value = "never")]
    pub restart: RestartPolicy,

    /// Relaunches allowed with --restart on-failure (backoff 1s, 2s, 4s ... 60s between).
    #[arg(long, value_name = "N", default_value = "3")]
    pub max_restarts: u32,

    /// Parts uploaded at once; memory use is about part size × this.
    #[arg(long, value_name = "N", default_value = "8", value_parser = clap::value_parser!(u32).range(1..=256))]
    pub upload_concurrency: u32,

    /// Which cloud's metadata service announces preemptions.
    #[arg(long, value_enum, default_value = "auto", env = "SPOTGUARD_CLOUD")]
    pub cloud: CloudArg,

    /// Metadata service address for the cloud named by --cloud (overrides its env variable).
    #[arg(long, value_name = "URL", env = "SPOTGUARD_METADATA_ENDPOINT")]
    pub metadata_endpoint: Option<String>,

    /// AWS: read the metadata service without an IMDSv2 token when none can be had.
    #[arg(long)]
    pub imdsv1_fallback: bool,

    /// Time a SIGTERM/SIGINT gives before the platform kills everything: Kubernetes'
    /// terminationGracePeriodSeconds, docker stop's --time.
    #[arg(long, value_name = "DURATION", default_value = "30s", env = "SPOTGUARD_GRACE", value_parser = parse_duration)]
    pub grace: Duration,

    /// The command is SIGKILLed this long before a notice's deadline: the time kept for the
    /// final upload and commit.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub safety_margin: Duration,

    /// Signal that tells the command to stop [default: the signal received, SIGTERM for cloud
    /// notices].
    #[arg(long, value_name = "SIGNAL", value_parser = parse_signal)]
    pub stop_signal: Option<Signal>,

    /// Signal that tells the command to save a checkpoint and carry on, sent on a hint (e.g.
    /// an AWS rebalance recommendation).
    #[arg(long, value_name = "SIGNAL", value_parser = parse_signal)]
    pub checkpoint_signal: Option<Signal>,

    /// An extra signal that announces a preemption, with its warning time, e.g. USR1@120s for
    /// SLURM's --signal=B:USR1@120 [default warning: --grace].
    #[arg(long, value_name = "SIGNAL[@DURATION]", value_parser = parse_notice_signal)]
    pub notice_signal: Option<(Signal, Option<Duration>)>,

    /// Idle watchdog: when the command's processes use under --idle-cpu of one core and every
    /// GPU (via nvidia-smi, when present) under --idle-gpu for this long, log it, run
    /// --on-idle and record it in the ledger. Off by default.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub idle_timeout: Option<Duration>,

    /// Shell command run (sh -c) when the idle watchdog fires, e.g. a webhook or a shutdown;
    /// it gets SPOTGUARD_IDLE_SECONDS.
    #[arg(long, value_name = "CMD", requires = "idle_timeout")]
    pub on_idle: Option<String>,

    /// Idle below this CPU use, percent of one core.
    #[arg(
        long,
        value_name = "PERCENT",
        default_value = "5",
        requires = "idle_timeout"
    )]
    pub idle_cpu: f64,

    /// Idle below this GPU utilisation, percent.
    #[arg(
        long,
        value_name = "PERCENT",
        default_value = "3",
        requires = "idle_timeout"
    )]
    pub idle_gpu: f64,

    /// Serve Prometheus metrics at this address (e.g. 127.0.0.1:9184). Off by default.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,

    /// Rehearse: raise a preemption notice after this delay (with --grace of warning).
    #[arg(long, value_name = "DELAY", value_parser = parse_duration)]
    pub simulate_preemption: Option<Duration>,

    /// Pause between polls of metadata services that must be polled.
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration, hide = true)]
    pub poll_interval: Duration,

    /// The command to run, after `--`.
    #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// `90s`, `2m`, `1h30m`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s).map_err(|e| format!("{e} (expected e.g. 30s, 2m, 1h)"))
}

/// `16MiB`, `8M`, `5242880`: binary units (K, M, G with or without `iB`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("not a size: {s:?} (expected e.g. 16MiB)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?} (expected K, M or G)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size too large: {s}"))
}

/// S3 parts are at least 5 MiB (except the last) and at most 5 GiB.
fn parse_part_size(s: &str) -> Result<u64, String> {
    let n = parse_size(s)?;
    if !(5 << 20..=5 << 30).contains(&n) {
        return Err("the part size must be between 5MiB and 5GiB".into());
    }
    Ok(n)
}

/// `key=value`.
fn parse_key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.trim().to_owned(), v.to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("expected KEY=VALUE, got {s:?}"))
}

/// `TERM`, `SIGTERM`, `sigterm` or `15`.
pub fn parse_signal(s: &str) -> Result<Signal, String> {
    if let Ok(n) = s.parse::<i32>() {
        return Signal::try_from(n).map_err(|_| format!("no signal number {n}"));
    }
    let upper = s.to_ascii_uppercase();
    let name = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    match name.parse::<Signal>() {
        Ok(Signal::SIGKILL | Signal::SIGSTOP) => Err(format!("{name} cannot be caught")),
        Ok(sig) => Ok(sig),
        Err(_) => Err(format!(
            "unknown signal {s:?} (expected e.g. TERM, USR1, 10)"
        )),
    }
}

/// `USR1` or `USR1@120s`.
pub fn parse_notice_signal(s: &str) -> Result<(Signal, Option<Duration>), String> {
    match s.split_once('@') {
        Some((sig, lead)) => Ok((parse_signal(sig)?, Some(parse_duration(lead)?))),
        None => Ok((parse_signal(s)?, None)),
    }
}

/// Job names become directory names and object-store prefixes.
pub fn parse_job(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.len() <= 128
        && !s.starts_with('.')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(s.to_owned())
    } else {
        Err("expected 1-128 of A-Z a-z 0-9 . _ - not starting with a dot".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_in_every_spelling() {
        assert_eq!(parse_signal("TERM"), Ok(Signal::SIGTERM));
        assert_eq!(parse_signal("sigusr1"), Ok(Signal::SIGUSR1));
        assert_eq!(parse_signal("15"), Ok(Signal::SIGTERM));
        assert!(parse_signal("KILL").is_err());
        assert!(parse_signal("BOGUS").is_err());
        assert_eq!(
            parse_notice_signal("USR1@120s"),
            Ok((Signal::SIGUSR1, Some(Duration::from_secs(120))))
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("16MiB"), Ok(16 << 20));
        assert_eq!(parse_size("8M"), Ok(8 << 20));
        assert_eq!(parse_size("1024"), Ok(1024));
        assert!(parse_size("lots").is_err());
        assert!(parse_part_size("1MiB").is_err());
    }

    #[test]
    fn ranges() {
        assert_eq!(parse_range("1..=250"), Ok((1, 250)));
        assert_eq!(parse_range("0..10"), Ok((0, 9)));
        assert!(parse_range("5..5").is_err());
        assert!(parse_range("a..b").is_err());
    }

    #[test]
    fn job_names() {
        assert!(parse_job("llama-ft_2.b").is_ok());
        for bad in ["", ".hidden", "a/b", "../x", "a b"] {
            assert!(parse_job(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
