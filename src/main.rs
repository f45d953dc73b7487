//! `spotguard`: the thin binary. Parsing, logging and exit codes live here; the work is in
//! `crates/*`.

mod cli;
mod exit_code;
mod logging;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use clap::error::{ContextKind, ErrorKind};
use spotguard_notice::{Cloud, Endpoints, WatchOptions};
use spotguard_session::{CloudChoice, Outcome, RunOptions};
use tracing::error;

use crate::cli::{Cli, CloudArg, Command, RunArgs};

fn main() -> ExitCode {
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

async fn run(command: Command) -> u8 {
    match command {
        Command::Run(args) => run_command(args).await,
    }
}

async fn run_command(args: RunArgs) -> u8 {
    let opts = match run_options(args) {
        Ok(opts) => opts,
        Err(msg) => {
            eprintln!("spotguard: error: {msg}");
            return exit_code::USAGE;
        }
    };
    match spotguard_session::run(opts).await {
        Ok(Outcome::Exited(end)) => end.exit_code(),
        Ok(Outcome::Preempted { .. }) => exit_code::PREEMPTED,
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
    }
}

fn run_options(args: RunArgs) -> Result<RunOptions, String> {
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
    let state_dir = args.state_dir.unwrap_or_else(default_state_dir);
    let mut opts = RunOptions::new(args.command, state_dir);
    opts.job = args.job;
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
    Ok(opts)
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
