//! The supervisor with real children and real signals: exit statuses, forwarding, staged
//! stops, descendants, and PID 1.

mod support;

use std::time::Duration;

use nix::sys::signal::Signal;
use support::{Proc, alive, run_to_end, spotguard};

fn sh(script: &str) -> Vec<&str> {
    vec!["run", "--", "sh", "-c", script]
}

#[test]
fn every_exit_code_passes_through() {
    let state = tempfile::tempdir().expect("tempdir");
    for code in 0..=255 {
        let script = format!("exit {code}");
        let f = run_to_end(state.path(), &sh(&script));
        assert_eq!(f.code(), code, "{}", f.stderr);
    }
}

#[test]
fn death_by_signal_is_128_plus_n() {
    let state = tempfile::tempdir().expect("tempdir");
    for (sig, code) in [("KILL", 137), ("SEGV", 139), ("TERM", 143), ("USR1", 138)] {
        let f = run_to_end(state.path(), &sh(&format!("kill -{sig} $$")));
        assert_eq!(f.code(), code, "SIG{sig}: {}", f.stderr);
        assert!(
            f.stderr.contains(&format!("killed by SIG{sig}")),
            "{}",
            f.stderr
        );
    }
}

#[test]
fn exec_failures_are_126_and_127_with_a_one_line_error() {
    let state = tempfile::tempdir().expect("tempdir");
    let f = run_to_end(state.path(), &["run", "--", "no-such-command-xyz"]);
    assert_eq!(f.code(), 127);
    assert_eq!(f.stderr.lines().count(), 1, "{}", f.stderr);
    assert!(
        f.stderr.contains("command not found: no-such-command-xyz"),
        "{}",
        f.stderr
    );

    let script = state.path().join("not-executable.sh");
    std::fs::write(&script, "#!/bin/sh\necho hi\n").expect("write");
    let path = script.to_str().expect("utf-8 path");
    let f = run_to_end(state.path(), &["run", "--", path]);
    assert_eq!(f.code(), 126);
    assert!(
        f.stderr.contains(&format!("cannot execute {path}")),
        "{}",
        f.stderr
    );

    let f = run_to_end(state.path(), &["run", "--", "/"]);
    assert_eq!(f.code(), 126, "{}", f.stderr);
}

#[test]
fn non_stop_signals_are_forwarded_to_the_group() {
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    // The handler runs in a grandchild too: forwarding goes to the whole process group.
    cmd.args(sh(r#"
        for s in HUP QUIT USR1 USR2 WINCH; do trap "echo got $s" $s; done
        echo ready
        while :; do sleep 30 & wait $!; done
    "#));
    let p = Proc::start(cmd);
    p.expect_stdout("ready");
    for sig in [
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGWINCH,
    ] {
        p.signal(sig);
        p.expect_stdout(&format!("got {}", &sig.as_str()[3..]));
    }
    p.signal(Signal::SIGKILL);
}

#[test]
fn sigint_is_forwarded_as_sigint_and_stops_the_run() {
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    cmd.args(sh(
        r#"trap 'echo got INT; exit 0' INT; echo ready; while :; do sleep 30 & wait $!; done"#,
    ));
    let p = Proc::start(cmd);
    p.expect_stdout("ready");
    p.signal(Signal::SIGINT);
    let f = p.finish();
    assert!(f.stdout.contains("got INT"), "{}", f.stdout);
    assert_eq!(
        f.code(),
        75,
        "a stop by signal exits with the preempted code\n{}",
        f.stderr
    );
}

#[test]
fn a_child_that_ignores_sigterm_is_killed_after_the_grace_period() {
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    cmd.args([
        "run",
        "--grace",
        "2s",
        "--safety-margin",
        "0s",
        "--",
        "sh",
        "-c",
    ])
    .arg("trap '' TERM; echo ready; while :; do sleep 30; done");
    let p = Proc::start(cmd);
    p.expect_stdout("ready");
    p.signal(Signal::SIGTERM);
    p.expect_stderr("SIGKILL in 2.0s");
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    assert!(
        f.stderr.contains("the deadline came: sending SIGKILL"),
        "{}",
        f.stderr
    );
    assert!(f.stderr.contains("killed by SIGKILL"), "{}", f.stderr);
}

#[test]
fn a_second_sigterm_kills_at_once() {
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    // A grace far longer than the test's hard timeout: only the second signal can end it.
    cmd.args(["run", "--grace", "1h", "--", "sh", "-c"])
        .arg("trap '' TERM; echo ready; while :; do sleep 30; done");
    let p = Proc::start(cmd);
    p.expect_stdout("ready");
    p.signal(Signal::SIGTERM);
    p.expect_stderr("preemption notice");
    p.signal(Signal::SIGTERM);
    let f = p.finish();
    assert_eq!(f.code(), 75, "{}", f.stderr);
    assert!(
        f.stderr.contains("received again during the stop"),
        "{}",
        f.stderr
    );
}

/// tini#180, dumb-init#212: an init that exits with its direct child leaves the rest of the
/// tree to be killed abruptly (or to run on). Here none survives, daemons included.
#[test]
fn no_descendant_survives_the_command() {
    let state = tempfile::tempdir().expect("tempdir");
    let mut cmd = spotguard(state.path());
    cmd.args(["run", "--", "python3", "-c"]).arg(
        r#"
import os, subprocess, sys
in_group = subprocess.Popen(["sleep", "300"])
own_session = subprocess.Popen(["sleep", "300"], start_new_session=True)
r, w = os.pipe()
if os.fork() == 0:                      # a classic double-forked daemon
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        os.execvp("sleep", ["sleep", "300"])
    os._exit(0)
os.wait()
daemon = int(os.read(r, 32))
print("pids", in_group.pid, own_session.pid, daemon, flush=True)
sys.exit(3)                             # exit without waiting for any of them
"#,
    );
    let f = Proc::start(cmd).finish();
    assert_eq!(
        f.code(),
        3,
        "the command's own status passes through\n{}",
        f.stderr
    );
    let line = f
        .stdout
        .lines()
        .find(|l| l.starts_with("pids "))
        .expect("pids line");
    let pids: Vec<i32> = line[5..]
        .split(' ')
        .map(|p| p.parse().expect("pid"))
        .collect();
    assert_eq!(pids.len(), 3);
    for pid in pids {
        assert!(!alive(pid), "pid {pid} survived\n{}", f.stderr);
    }
    assert!(
        f.stderr.contains("the command left processes running"),
        "{}",
        f.stderr
    );
}

/// As PID 1 of a new PID namespace (a container's ENTRYPOINT): orphans are re-parented to
/// spotguard, which must reap them as they exit and stop the rest before it exits.
#[test]
fn as_pid_1_it_reaps_zombies_and_stops_daemons() {
    let state = tempfile::tempdir().expect("tempdir");
    let marker = state.path().join("daemon-stopped");
    let child = format!(
        r#"
import os, signal, sys, time
assert os.getpid() != 1
# Orphans that exit at once: zombies of PID 1 unless it reaps them.
for _ in range(5):
    if os.fork() == 0:
        if os.fork() == 0:
            os._exit(0)
        os._exit(0)
    os.wait()
# A daemon that records a graceful stop (SIGTERM), which namespace teardown would not give.
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        def stop(*_):
            open({marker:?}, "w").write("TERM")
            os._exit(0)
        signal.signal(signal.SIGTERM, stop)
        os.write(w, b"x")
        while True:
            signal.pause()
    os._exit(0)
os.wait()
os.read(r, 1)
def zombies():
    n = 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                stat = open(f"/proc/{{p}}/stat").read()
            except OSError:
                continue
            if stat[stat.rfind(")") + 2] == "Z":
                n += 1
    return n
deadline = time.monotonic() + 10
while zombies() and time.monotonic() < deadline:
    time.sleep(0.05)
print("zombies left:", zombies(), flush=True)
"#,
        marker = marker.to_str().expect("utf-8 path")
    );
    let mut cmd = std::process::Command::new("unshare");
    cmd.args([
        "--pid",
        "--fork",
        "--mount-proc",
        env!("CARGO_BIN_EXE_spotguard"),
    ])
    .args(["run", "--cloud", "none", "--", "python3", "-c", &child])
    .env("SPOTGUARD_STATE_DIR", state.path());
    let f = Proc::start(cmd).finish_within(Duration::from_secs(30));
    assert_eq!(f.code(), 0, "{}\n{}", f.stdout, f.stderr);
    assert!(f.stdout.contains("zombies left: 0"), "{}", f.stdout);
    assert_eq!(
        std::fs::read_to_string(&marker).ok().as_deref(),
        Some("TERM"),
        "{}",
        f.stderr
    );
}
