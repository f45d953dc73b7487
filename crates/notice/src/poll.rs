//! The loop every polled source runs: check, send what is new, wait, again.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::{Error, Notice, Source};

/// One look at a metadata service.
pub(crate) trait Check: Send + Sync + 'static {
    fn check(&self) -> impl Future<Output = Result<Vec<Notice>, Error>> + Send;
}

/// Sends each notice once, however often a service repeats it.
#[derive(Debug, Default)]
pub(crate) struct Dedup(HashSet<String>);

impl Dedup {
    /// Sends `n` unless it was sent before; false once the receiver is gone.
    pub(crate) async fn send(&mut self, tx: &mpsc::Sender<Notice>, n: Notice) -> bool {
        if !self.0.insert(n.key()) {
            return true;
        }
        tx.send(n).await.is_ok()
    }
}

/// Failures are loud but not a flood: the first, then every `LOG_EVERY`th, then the recovery.
pub(crate) struct FailureLog {
    source: Source,
    failures: u64,
}

const LOG_EVERY: u64 = 60;

impl FailureLog {
    pub(crate) fn new(source: Source) -> Self {
        FailureLog {
            source,
            failures: 0,
        }
    }

    pub(crate) fn failed(&mut self, e: &Error) {
        self.failures += 1;
        if self.failures == 1 || self.failures % LOG_EVERY == 0 {
            warn!(source = %self.source, failures = self.failures, "metadata service check failed: {e}");
        }
    }

    pub(crate) fn ok(&mut self) {
        if self.failures > 0 {
            info!(source = %self.source, "metadata service answers again after {} failed checks", self.failures);
            self.failures = 0;
        }
    }
}

/// Polls `me` every `interval` until `tx` is closed.
pub(crate) async fn poll<C: Check>(
    me: Arc<C>,
    source: Source,
    interval: Duration,
    tx: mpsc::Sender<Notice>,
) {
    let mut dedup = Dedup::default();
    let mut log = FailureLog::new(source);
    loop {
        match me.check().await {
            Ok(notices) => {
                log.ok();
                for n in notices {
                    if !dedup.send(&tx, n).await {
                        return;
                    }
                }
            }
            Err(e) => log.failed(&e),
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = tx.closed() => return,
        }
    }
}
