//! Runs one command the way an init should.
//!
//! The command runs in a process group of its own, so a stop reaches everything it started.
//! spotguard becomes a child subreaper (or is PID 1 in a container), so descendants that
//! daemonise are re-parented to it rather than to the host's init: they are reaped as they exit,
//! and none is left running when the command is over (the bug tini#180 and dumb-init#212 pin:
//! an init that exits when its direct child does kills the rest abruptly instead of stopping it).
//!
//! Reaping uses `waitpid(-1)`, so this crate owns every child of the process: anything else
//! spotguard runs for itself and waits for goes through [`run_helper`], whose children the
//! reaper leaves alone (it then reaps child by child instead).

mod descendants;
mod helpers;
mod signals;
mod status;

use std::ffi::OsString;
use std::io;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{kill, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};
use tokio::time::Instant;
use tracing::{debug, info, warn};

pub use helpers::run_helper;
pub use nix::sys::signal::Signal;
pub use signals::{FORWARDED, Signals};
pub use status::ProcessEnd;

/// CPU clock ticks used so far by every live process below this one (the command's whole
/// tree, daemons included, as we are its subreaper), with their reaped children's.
pub fn tree_cpu_ticks() -> u64 {
    descendants::of(nix::unistd::getpid())
        .into_iter()
        .map(descendants::cpu_ticks)
        .sum()
}

/// The process id of the supervised command, which also names its process group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChildPid(Pid);

impl ChildPid {
    /// The raw pid.
    pub fn as_raw(self) -> i32 {
        self.0.as_raw()
    }
}

impl std::fmt::Display for ChildPid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Why the command could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpawnError {
    /// The program does not exist (or is not on `PATH`).
    #[error("command not found: {program}")]
    NotFound {
        program: String,
        #[source]
        source: io::Error,
    },
    /// The program exists but could not be executed (permissions, not a binary, ...).
    #[error("cannot execute {program}: {source}")]
    NotExecutable {
        program: String,
        #[source]
        source: io::Error,
    },
    /// Setting up the supervisor itself failed.
    #[error("failed to set up the supervisor: {0}")]
    Setup(#[source] io::Error),
}

impl SpawnError {
    /// The exit status a shell would give for this failure: 127 not found, 126 not executable.
    pub fn exit_code(&self) -> u8 {
        match self {
            SpawnError::NotFound { .. } => 127,
            SpawnError::NotExecutable { .. } | SpawnError::Setup(_) => 126,
        }
    }
}

/// One supervised command and every process it starts.
#[derive(Debug)]
pub struct Supervisor {
    pid: Pid,
    end: Option<ProcessEnd>,
    /// True once `waitpid(-1)` answered `ECHILD`: no descendant is left.
    childless: bool,
    sigchld: tokio::signal::unix::Signal,
}

impl Supervisor {
    /// Starts `cmd` in a new process group. Must be called inside a tokio runtime.
    ///
    /// Makes this process a child subreaper first (unless it is PID 1, which is one already),
    /// so orphans in the command's tree are re-parented here.
    pub fn spawn(mut cmd: Command) -> Result<Self, SpawnError> {
        // Listen for SIGCHLD before the child exists, so its exit cannot be missed.
        let sigchld = signal(SignalKind::child()).map_err(SpawnError::Setup)?;
        if std::process::id() != 1 {
            // PR_SET_CHILD_SUBREAPER: see prctl(2).
            nix::sys::prctl::set_child_subreaper(true)
                .map_err(|e| SpawnError::Setup(io::Error::from(e)))?;
        }
        cmd.process_group(0);
        let program = display_program(cmd.get_program().to_os_string());
        let child = cmd.spawn().map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => SpawnError::NotFound { program, source },
            _ => SpawnError::NotExecutable { program, source },
        })?;
        let pid = Pid::from_raw(i32::try_from(child.id()).expect("pids fit in i32"));
        // The `Child` handle is dropped without waiting: `reap` collects the status.
        drop(child);
        debug!(
            pid = pid.as_raw(),
            "command started in its own process group"
        );
        Ok(Supervisor {
            pid,
            end: None,
            childless: false,
            sigchld,
        })
    }

    /// The command's pid (and process group id).
    pub fn pid(&self) -> ChildPid {
        ChildPid(self.pid)
    }

    /// How the command ended, once it has.
    pub fn end(&self) -> Option<ProcessEnd> {
        self.end
    }

    /// Sends `sig` to the command's process group.
    pub fn signal_group(&self, sig: Signal) {
        match killpg(self.pid, sig) {
            Ok(()) | Err(Errno::ESRCH) => {}
            Err(e) => warn!(signal = %sig, error = %e, "failed to signal the process group"),
        }
    }

    /// Sends `sig` to the process group and to every other descendant (those that left the
    /// group, e.g. daemons that called `setsid`).
    pub fn signal_all(&self, sig: Signal) {
        self.signal_group(sig);
        for pid in descendants::of(nix::unistd::getpid()) {
            match kill(pid, sig) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(e) => {
                    warn!(pid = pid.as_raw(), signal = %sig, error = %e, "failed to signal a descendant")
                }
            }
        }
    }

    /// Waits until the command itself exits, reaping every other zombie on the way.
    ///
    /// Cancel-safe: the state lives in `self`, so it can be used in `select!`.
    pub async fn wait(&mut self) -> ProcessEnd {
        loop {
            self.reap();
            if let Some(end) = self.end {
                return end;
            }
            self.sigchld.recv().await;
        }
    }

    /// After the command has exited: stops whatever it left behind and reaps it all.
    ///
    /// Descendants still running get `sig`, then `SIGKILL` after `linger`. Returns how many
    /// processes had to be stopped.
    pub async fn finish(&mut self, sig: Signal, linger: Duration) -> usize {
        self.reap();
        if self.childless {
            return 0;
        }
        let left = descendants::of(nix::unistd::getpid()).len();
        if left > 0 {
            info!(
                processes = left,
                "the command left processes running; sending {sig}, SIGKILL after {}",
                humanize(linger)
            );
            self.signal_all(sig);
        }
        if self.wait_childless(Instant::now() + linger).await {
            return left;
        }
        let left = descendants::of(nix::unistd::getpid()).len();
        warn!(
            processes = left,
            "processes still running after {}; sending SIGKILL",
            humanize(linger)
        );
        self.signal_all(Signal::SIGKILL);
        // SIGKILL cannot be caught; only a process stuck in the kernel (state D) can delay us.
        if !self
            .wait_childless(Instant::now() + Duration::from_secs(10))
            .await
        {
            warn!("some processes did not die after SIGKILL; exiting anyway");
        }
        left
    }

    /// Reaps until no child is left or `deadline` passes; true when none is left.
    async fn wait_childless(&mut self, deadline: Instant) -> bool {
        loop {
            self.reap();
            if self.childless {
                return true;
            }
            tokio::select! {
                _ = self.sigchld.recv() => {}
                _ = tokio::time::sleep_until(deadline) => {
                    self.reap();
                    return self.childless;
                }
            }
        }
    }

    /// Collects every exited child without blocking (tini's `reap_zombies`).
    fn reap(&mut self) {
        let helpers = helpers::registry();
        if !helpers.is_empty() {
            return self.reap_around(&helpers);
        }
        drop(helpers);
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => return,
                Ok(WaitStatus::Exited(pid, code)) => self.reaped(pid, ProcessEnd::Exited(code)),
                Ok(WaitStatus::Signaled(pid, signal, core_dumped)) => self.reaped(
                    pid,
                    ProcessEnd::Signalled {
                        signal,
                        core_dumped,
                    },
                ),
                Ok(_) => {}
                Err(Errno::EINTR) => {}
                Err(Errno::ECHILD) => {
                    self.childless = true;
                    return;
                }
                Err(e) => {
                    warn!(error = %e, "waitpid failed");
                    return;
                }
            }
        }
    }

    /// While helpers run: reaps each other child by pid, leaving the helpers' exit status to
    /// whoever waits for them. Childless when only helpers are left.
    fn reap_around(&mut self, helpers: &std::collections::BTreeSet<i32>) {
        let mut left = 0;
        for pid in descendants::children(nix::unistd::getpid()) {
            if helpers.contains(&pid.as_raw()) {
                continue;
            }
            match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => self.reaped(pid, ProcessEnd::Exited(code)),
                Ok(WaitStatus::Signaled(pid, signal, core_dumped)) => self.reaped(
                    pid,
                    ProcessEnd::Signalled {
                        signal,
                        core_dumped,
                    },
                ),
                // Gone meanwhile (reaped already, or not our child after all).
                Err(Errno::ECHILD) => {}
                _ => left += 1,
            }
        }
        self.childless = left == 0;
    }

    fn reaped(&mut self, pid: Pid, end: ProcessEnd) {
        if pid == self.pid {
            debug!(pid = pid.as_raw(), %end, "command ended");
            self.end = Some(end);
        } else {
            debug!(pid = pid.as_raw(), %end, "reaped a descendant");
        }
    }
}

fn display_program(program: OsString) -> String {
    program.to_string_lossy().into_owned()
}

/// A duration as users type it: `1.5s`, `30s`, `2m`, `2m5s`.
pub fn humanize(d: Duration) -> String {
    if d.subsec_millis() != 0 && d < Duration::from_secs(10) {
        return format!("{:.1}s", d.as_secs_f64());
    }
    let s = d.as_secs();
    match (s / 60, s % 60) {
        (0, s) => format!("{s}s"),
        (m, 0) => format!("{m}m"),
        (m, s) => format!("{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn humanized_durations() {
        assert_eq!(humanize(Duration::from_millis(1500)), "1.5s");
        assert_eq!(humanize(Duration::from_secs(30)), "30s");
        assert_eq!(humanize(Duration::from_secs(120)), "2m");
        assert_eq!(humanize(Duration::from_secs(125)), "2m5s");
    }
}
