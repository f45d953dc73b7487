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
    /// Run a command, stop it cleanly on a preemption notice, pass its exit status through.
    #[command(after_help = RUN_AFTER_HELP)]
    Run(RunArgs),
}

const RUN_AFTER_HELP: &str = "\
The command gets these environment variables:
  SPOTGUARD_JOB          the job name
  SPOTGUARD_STATE_DIR    the job's local state dir
  SPOTGUARD_NOTICE_FILE  a JSON file (source, kind, deadline) that exists once a
                         preemption notice has come

Signals: SIGINT and SIGTERM start a stop (a second one kills at once); SIGHUP,
SIGQUIT, SIGUSR1, SIGUSR2 and SIGWINCH are forwarded to the command's process group.

Endpoint overrides (for tests and proxies): AWS_EC2_METADATA_SERVICE_ENDPOINT,
GCE_METADATA_HOST, SPOTGUARD_AZURE_METADATA_ENDPOINT, SPOTGUARD_ALIYUN_METADATA_ENDPOINT,
SPOTGUARD_TENCENT_METADATA_ENDPOINT, SPOTGUARD_VOLCENGINE_METADATA_ENDPOINT.

Exit status:
  N     the command's own exit status, passed through (128+N: killed by signal N)
  75    a preemption notice stopped the command (relaunch to resume)
  2, 70, 74, 126, 127: see spotguard --help";

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
    /// Job name: names the state dir (and, later, the checkpoints in the store).
    #[arg(long, env = "SPOTGUARD_JOB", default_value = "default", value_parser = parse_job)]
    pub job: String,

    /// Local state dir [default: $XDG_STATE_HOME/spotguard or ~/.local/state/spotguard].
    #[arg(long, env = "SPOTGUARD_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

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

    /// The command is SIGKILLed this long before a notice's deadline.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
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
