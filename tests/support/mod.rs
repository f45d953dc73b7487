//! Helpers for the integration tests: run the real `spotguard` binary with real children and
//! real signals, watch its output line by line, and drive the fake metadata server.
//! Every wait has a hard timeout; nothing sleeps where an event can be awaited.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of this module"
)]

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Default hard limit for any wait in these tests.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// Every variable that could point spotguard at a real metadata service or change its output.
const SCRUBBED: &[&str] = &[
    "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    "AWS_EC2_METADATA_DISABLED",
    "GCE_METADATA_HOST",
    "SPOTGUARD_AZURE_METADATA_ENDPOINT",
    "SPOTGUARD_ALIYUN_METADATA_ENDPOINT",
    "SPOTGUARD_TENCENT_METADATA_ENDPOINT",
    "SPOTGUARD_VOLCENGINE_METADATA_ENDPOINT",
    "SPOTGUARD_METADATA_ENDPOINT",
    "SPOTGUARD_JOB",
    "SPOTGUARD_GRACE",
    "SPOTGUARD_LOG",
    "SPOTGUARD_LOG_FORMAT",
    "HTTP_PROXY",
    "http_proxy",
];

/// A `spotguard` command with a private state dir and `--cloud none` by default (the tests
/// must never probe a real metadata address: network traffic stays on 127.0.0.1).
pub fn spotguard(state: &Path) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spotguard"));
    for var in SCRUBBED {
        cmd.env_remove(var);
    }
    cmd.env("SPOTGUARD_STATE_DIR", state)
        .env("SPOTGUARD_CLOUD", "none")
        .env("NO_COLOR", "1");
    cmd
}

/// Lines read so far from one pipe, with a condvar to wait for a new one.
#[derive(Default)]
struct Lines {
    lines: Mutex<(Vec<String>, bool)>,
    changed: Condvar,
}

impl Lines {
    fn follow(pipe: impl Read + Send + 'static) -> Arc<Lines> {
        let lines = Arc::new(Lines::default());
        let l = lines.clone();
        thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                l.lines.lock().expect("lock").0.push(line);
                l.changed.notify_all();
            }
            l.lines.lock().expect("lock").1 = true;
            l.changed.notify_all();
        });
        lines
    }

    fn wait_for(&self, needle: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        let mut g = self.lines.lock().expect("lock");
        loop {
            if let Some(l) = g.0.iter().find(|l| l.contains(needle)) {
                return Some(l.clone());
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            if g.1 {
                return None;
            }
            g = self.changed.wait_timeout(g, left).expect("lock").0;
        }
    }

    fn wait_closed(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut g = self.lines.lock().expect("lock");
        while !g.1 {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return;
            };
            g = self.changed.wait_timeout(g, left).expect("lock").0;
        }
    }

    fn text(&self) -> String {
        self.lines.lock().expect("lock").0.join("\n")
    }
}

/// A running spotguard (or any process) with its output followed.
pub struct Proc {
    pub pid: Pid,
    stdout: Arc<Lines>,
    stderr: Arc<Lines>,
    pub stdin: Option<ChildStdin>,
    exit: mpsc::Receiver<ExitStatus>,
    done: bool,
}

/// How a process ended, with everything it printed.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Finished {
    pub fn code(&self) -> i32 {
        use std::os::unix::process::ExitStatusExt;
        self.status.code().unwrap_or_else(|| {
            panic!(
                "killed by signal {:?}\n{}",
                self.status.signal(),
                self.stderr
            )
        })
    }
}

impl Proc {
    pub fn start(mut cmd: Command) -> Proc {
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::piped());
        let mut child: Child = cmd.spawn().expect("spawn under test");
        let pid = Pid::from_raw(child.id() as i32);
        let stdout = Lines::follow(child.stdout.take().expect("stdout"));
        let stderr = Lines::follow(child.stderr.take().expect("stderr"));
        let stdin = child.stdin.take();
        let (tx, exit) = mpsc::channel();
        thread::spawn(move || {
            let status = child.wait().expect("wait");
            let _ = tx.send(status);
        });
        Proc {
            pid,
            stdout,
            stderr,
            stdin,
            exit,
            done: false,
        }
    }

    /// Waits for a stdout line containing `needle`; panics with all output on timeout.
    pub fn expect_stdout(&self, needle: &str) -> String {
        self.stdout
            .wait_for(needle, TIMEOUT)
            .unwrap_or_else(|| self.fail(&format!("no stdout line with {needle:?}")))
    }

    /// Waits for a stderr line containing `needle`; panics with all output on timeout.
    pub fn expect_stderr(&self, needle: &str) -> String {
        self.stderr
            .wait_for(needle, TIMEOUT)
            .unwrap_or_else(|| self.fail(&format!("no stderr line with {needle:?}")))
    }

    pub fn signal(&self, sig: Signal) {
        kill(self.pid, sig).expect("signal the process under test");
    }

    /// Waits for the exit, at most `timeout`.
    pub fn finish_within(mut self, timeout: Duration) -> Finished {
        let status = match self.exit.recv_timeout(timeout) {
            Ok(s) => s,
            Err(_) => self.fail(&format!("still running after {timeout:?}")),
        };
        self.done = true;
        self.stdout.wait_closed(Duration::from_secs(5));
        self.stderr.wait_closed(Duration::from_secs(5));
        Finished {
            status,
            stdout: self.stdout.text(),
            stderr: self.stderr.text(),
        }
    }

    pub fn finish(self) -> Finished {
        self.finish_within(TIMEOUT)
    }

    fn fail(&self, what: &str) -> ! {
        panic!(
            "{what}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.stdout.text(),
            self.stderr.text()
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if !self.done {
            let _ = kill(self.pid, Signal::SIGKILL);
        }
    }
}

/// Runs spotguard to its end with `args` (after `run`-level flags chosen by the caller).
pub fn run_to_end(state: &Path, args: &[&str]) -> Finished {
    let mut cmd = spotguard(state);
    cmd.args(args);
    Proc::start(cmd).finish()
}

/// True while `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat[stat.rfind(')').expect("stat") + 2..].chars().next();
            state != Some('Z')
        }
        Err(_) => false,
    }
}

/// The fake metadata server (tests/fakecloud/fakecloud.py) for one cloud.
pub struct FakeCloud {
    proc: Proc,
    pub addr: String,
}

impl FakeCloud {
    pub fn start(cloud: &str, extra: &[&str]) -> FakeCloud {
        let script: PathBuf = [
            env!("CARGO_MANIFEST_DIR"),
            "tests",
            "fakecloud",
            "fakecloud.py",
        ]
        .iter()
        .collect();
        let mut cmd = Command::new("python3");
        cmd.arg(script).args(["--cloud", cloud]).args(extra);
        let proc = Proc::start(cmd);
        let line = proc.expect_stdout("listening ");
        let addr = line.trim_start_matches("listening ").trim().to_owned();
        FakeCloud { proc, addr }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// POSTs a control request (`/_fake/...`).
    pub fn control(&self, what: &str, body: serde_json::Value) {
        let (status, text) = http(
            &self.addr,
            "POST",
            &format!("/_fake/{what}"),
            &body.to_string(),
        );
        assert!(status < 300, "control {what}: {status} {text}");
    }

    /// Every protocol request seen, the violations, and Azure's acknowledged event ids.
    pub fn log(&self) -> serde_json::Value {
        let (_, text) = http(&self.addr, "GET", "/_fake/log", "");
        serde_json::from_str(&text).expect("fake log is JSON")
    }
}

pub use spotguard_testkit::http;

/// The JSON notice a test child printed after a line `notice`.
pub fn printed_notice(stdout: &str) -> serde_json::Value {
    let json = stdout
        .split_once("notice\n")
        .unwrap_or_else(|| panic!("the child printed no notice:\n{stdout}"))
        .1;
    serde_json::from_str(json).unwrap_or_else(|e| panic!("bad notice JSON ({e}):\n{json}"))
}

/// A child that prints `ready`, and on SIGTERM prints `notice` and the notice file, then
/// exits 0. With `checkpoint`, SIGUSR1 makes it print `checkpoint` and carry on.
pub const NOTICE_CHILD: &str = r#"
trap 'echo checkpoint' USR1
trap 'echo notice; cat "$SPOTGUARD_NOTICE_FILE"; exit 0' TERM
echo ready
while :; do sleep 30 & wait $!; done
"#;

/// A small LCG for random choices in tests, reproducible from the seed a test prints.
pub struct Rng(pub u64);

impl Rng {
    /// Seeded from the clock; print `.0` on failure to reproduce.
    pub fn from_clock() -> Rng {
        Rng(std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos() as u64)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}
