//! Processes spotguard runs for itself while it supervises the command (`nvidia-smi`,
//! `--on-idle`). The reaper must not take their exit status from the code that waits for
//! them, and the clean-up after the command must not stop them or count their CPU as the
//! command's: both skip the pids registered here while their owner waits.

use std::collections::BTreeSet;
use std::io;
use std::process::Output;
use std::sync::{Mutex, MutexGuard};

static HELPERS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

/// The registered helper pids. Held by the reaper while it chooses whom to reap, and around
/// a helper's spawn, so a helper is never reaped between its fork and its registration.
pub(crate) fn registry() -> MutexGuard<'static, BTreeSet<i32>> {
    HELPERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Unregisters the helper however its wait ends (done, or the future dropped).
struct Registered(i32);

impl Drop for Registered {
    fn drop(&mut self) {
        registry().remove(&self.0);
    }
}

/// Runs `cmd` to its end as a helper: its exit status, and what it wrote to piped stdout and
/// stderr (set `Stdio::piped()` to capture). Use this, not `Command::status`/`output`, for any
/// process spotguard starts for itself: the supervisor reaps every other child.
pub async fn run_helper(mut cmd: tokio::process::Command) -> io::Result<Output> {
    let (child, pid) = {
        let mut helpers = registry();
        let child = cmd.spawn()?;
        let pid = child.id().map_or(0, |p| p as i32);
        helpers.insert(pid);
        (child, pid)
    };
    let _registered = Registered(pid);
    child.wait_with_output().await
}
