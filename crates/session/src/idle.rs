//! The idle watchdog (`--idle-timeout`): a rented GPU that sits idle for hours costs as much
//! as a busy one. When the command's processes use less than `cpu_percent` of one core and
//! every GPU less than `gpu_percent` for `timeout`, it logs a warning, runs `--on-idle` if
//! given, and records the firing in the ledger. It fires once per idle stretch: the command
//! must get busy again before it can fire again.
//!
//! CPU comes from `/proc/PID/stat` of every process below us; GPU utilisation from
//! `nvidia-smi` when it is on the PATH (a machine without it is "CPU only").

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use spotguard_stats::Stats;
use spotguard_store::IdleRecord;
use spotguard_supervise::humanize;
use tokio::process::Command;
use tokio::sync::Notify;
use tracing::{debug, info, warn};

/// When the watchdog fires and what it does then.
#[derive(Clone, Debug)]
pub struct IdleOptions {
    pub timeout: Duration,
    /// Below this much of one core (all the command's processes together) is idle.
    pub cpu_percent: f64,
    /// Below this utilisation on every GPU is idle.
    pub gpu_percent: f64,
    /// Run with `sh -c` when it fires (a webhook, a shutdown).
    pub on_idle: Option<String>,
    /// How often to sample (default: a tenth of the timeout, between 1 and 30 s).
    pub sample: Option<Duration>,
}

impl IdleOptions {
    pub fn new(timeout: Duration) -> Self {
        IdleOptions {
            timeout,
            cpu_percent: 5.0,
            gpu_percent: 3.0,
            on_idle: None,
            sample: None,
        }
    }
}

/// The current idle stretch: when it began (wall clock, monotonic), its samples' CPU (sum,
/// count), the highest GPU utilisation seen in it.
type Stretch = (SystemTime, tokio::time::Instant, (f64, u32), Option<f64>);

/// Watches until `stop` is notified (the command exited). An `--on-idle` command already
/// running is waited for, so its exit status reaches the ledger.
pub(crate) async fn watch(opts: IdleOptions, stats: Arc<Stats>, stop: Arc<Notify>) {
    let sample = opts.sample.unwrap_or_else(|| {
        (opts.timeout / 10).clamp(Duration::from_secs(1), Duration::from_secs(30))
    });
    let tick = ticks_per_second();
    let mut gpus = Gpus::default();
    let mut last = (
        tokio::time::Instant::now(),
        spotguard_supervise::tree_cpu_ticks(),
    );
    let mut idle: Option<Stretch> = None;
    let mut fired = false;
    loop {
        tokio::select! {
            () = tokio::time::sleep(sample) => {}
            () = stop.notified() => return,
        }
        let now = (
            tokio::time::Instant::now(),
            spotguard_supervise::tree_cpu_ticks(),
        );
        let cpu = cpu_percent(last, now, tick);
        let gpu = gpus.utilisation().await;
        last = now;
        let quiet = cpu < opts.cpu_percent && gpu.is_none_or(|g| g < opts.gpu_percent);
        debug!(cpu, ?gpu, quiet, "idle watchdog sample");
        if !quiet {
            if fired {
                info!("the command is busy again (CPU {cpu:.0}%)");
                stats.busy();
            }
            idle = None;
            fired = false;
            continue;
        }
        // Idle since the previous sample: the window just measured was quiet.
        let (since, since_i, cpu_sum, max_gpu) =
            idle.get_or_insert((SystemTime::now() - sample, now.0 - sample, (0.0, 0), None));
        cpu_sum.0 += cpu;
        cpu_sum.1 += 1;
        *max_gpu = match (*max_gpu, gpu) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let idle_for = now.0.duration_since(*since_i);
        if fired || idle_for < opts.timeout {
            continue;
        }
        fired = true;
        let avg_cpu = cpu_sum.0 / f64::from(cpu_sum.1.max(1));
        let gpu_text = max_gpu.map_or("no GPU".into(), |g| format!("GPU at most {g:.0}%"));
        warn!(
            "the command has been idle for {} (CPU {avg_cpu:.1}%, {gpu_text}){}",
            humanize(idle_for),
            if opts.on_idle.is_some() {
                "; running --on-idle"
            } else {
                ""
            }
        );
        // Recorded before --on-idle runs: the firing counts even if the run ends meanwhile.
        let firing = stats.idle_fired(IdleRecord {
            since: spotguard_stats::timestamp(*since),
            fired: spotguard_stats::timestamp(SystemTime::now()),
            cpu_percent: avg_cpu,
            gpu_percent: *max_gpu,
            on_idle_status: None,
        });
        if let Some(cmd) = &opts.on_idle {
            let mut sh = Command::new("sh");
            sh.arg("-c")
                .arg(cmd)
                .env("SPOTGUARD_IDLE_SECONDS", idle_for.as_secs().to_string());
            match spotguard_supervise::run_helper(sh).await {
                Ok(out) => {
                    stats.on_idle_ran(firing, out.status.code());
                    if !out.status.success() {
                        warn!("--on-idle command exited with {}", out.status);
                    }
                }
                Err(e) => warn!("failed to run --on-idle: {e}"),
            }
        }
    }
}

fn cpu_percent(
    (t0, c0): (tokio::time::Instant, u64),
    (t1, c1): (tokio::time::Instant, u64),
    tick: f64,
) -> f64 {
    let secs = t1.duration_since(t0).as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    // A process that exited takes its ticks with it: never below zero.
    c1.saturating_sub(c0) as f64 / tick / secs * 100.0
}

fn ticks_per_second() -> f64 {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        Ok(Some(t)) if t > 0 => t as f64,
        _ => 100.0,
    }
}

/// GPU utilisation via `nvidia-smi`, when there is one.
#[derive(Debug, Default)]
struct Gpus {
    /// `nvidia-smi` could not be run: don't try again.
    absent: bool,
    said: bool,
}

impl Gpus {
    /// The busiest GPU's utilisation, `None` without GPUs.
    async fn utilisation(&mut self) -> Option<f64> {
        if self.absent {
            return None;
        }
        let mut smi = Command::new("nvidia-smi");
        smi.args([
            "--query-gpu=utilization.gpu",
            "--format=csv,noheader,nounits",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            spotguard_supervise::run_helper(smi),
        )
        .await;
        let max = match out {
            Ok(Ok(o)) if o.status.success() => String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter_map(|l| l.trim().parse::<f64>().ok())
                .reduce(f64::max),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                info!("no nvidia-smi on the PATH: the idle watchdog looks at CPU only");
                self.absent = true;
                return None;
            }
            other => {
                if !self.said {
                    warn!("nvidia-smi failed ({other:?}); the idle watchdog looks at CPU only");
                    self.said = true;
                }
                None
            }
        };
        if max.is_none() && !self.said {
            info!("nvidia-smi lists no GPU: the idle watchdog looks at CPU only");
            self.said = true;
        }
        max
    }
}
