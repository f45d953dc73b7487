//! `--simulate-preemption`: a rehearsal notice on any machine.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;

use crate::{BoxFuture, Notice, NoticeSource, Source};

/// Raises one Terminate notice `after` the watch starts, with `warning` until the deadline.
#[derive(Clone, Copy, Debug)]
pub struct Simulated {
    pub after: Duration,
    pub warning: Duration,
}

impl NoticeSource for Simulated {
    fn source(&self) -> Source {
        Source::Simulated
    }

    fn probe(&self) -> BoxFuture<'_, bool> {
        Box::pin(async { true })
    }

    fn watch(self: Arc<Self>, tx: mpsc::Sender<Notice>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            tokio::select! {
                () = tokio::time::sleep(self.after) => {
                    let n = Notice::terminate(
                        Source::Simulated,
                        SystemTime::now() + self.warning,
                        format!("simulated preemption after {}", humantime::format_duration(self.after)),
                    );
                    let _ = tx.send(n).await;
                }
                () = tx.closed() => {}
            }
        })
    }
}
