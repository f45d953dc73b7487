//! The signals spotguard itself receives, merged into one typed stream.

use nix::sys::signal::Signal;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Signals spotguard catches and passes on to the command's process group (SIGINT and SIGTERM
/// also start a stop; see the session crate).
pub const FORWARDED: &[Signal] = &[
    Signal::SIGINT,
    Signal::SIGTERM,
    Signal::SIGHUP,
    Signal::SIGQUIT,
    Signal::SIGUSR1,
    Signal::SIGUSR2,
    Signal::SIGWINCH,
];

/// A stream of caught signals. Dropping it stops listening (the handlers stay installed, as
/// tokio cannot uninstall them, so signals are then ignored rather than fatal).
#[derive(Debug)]
pub struct Signals {
    rx: mpsc::UnboundedReceiver<Signal>,
    tasks: Vec<JoinHandle<()>>,
}

impl Signals {
    /// Catches every signal in `which`. Must be called inside a tokio runtime.
    pub fn new(which: &[Signal]) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut tasks = Vec::with_capacity(which.len());
        for &sig in which {
            let mut stream = signal(SignalKind::from_raw(sig as i32))?;
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                while stream.recv().await.is_some() {
                    if tx.send(sig).is_err() {
                        return;
                    }
                }
            }));
        }
        Ok(Signals { rx, tasks })
    }

    /// A stream that never yields: for tests and embedders that handle signals themselves.
    pub fn none() -> Self {
        let (_tx, rx) = mpsc::unbounded_channel();
        Signals {
            rx,
            tasks: Vec::new(),
        }
    }

    /// The next caught signal. Cancel-safe.
    pub async fn recv(&mut self) -> Option<Signal> {
        self.rx.recv().await
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}
