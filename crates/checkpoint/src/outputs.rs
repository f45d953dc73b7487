//! `--outputs DIR`: every result file the command finishes (a rendered frame, a processed
//! shard) is uploaded under `<job>/outputs/` as soon as it is closed, not when the run ends.
//! "Finished" is a close after writing (inotify), a rename into the dir, or, on a rescan, a
//! file no process holds open for writing; names that are temporary (`.x`, `*.tmp`,
//! `*.partial`) wait for their rename.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::event::{AccessKind, AccessMode, ModifyKind, RenameMode};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use spotguard_store::{JobStore, UploadOptions};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::{Error, rules, writers};

/// Handle to the outputs uploader.
#[derive(Debug)]
pub struct Outputs {
    stop: oneshot::Sender<()>,
    task: JoinHandle<OutputsReport>,
}

/// What was uploaded, and what could not be.
#[derive(Clone, Debug, Default)]
pub struct OutputsReport {
    pub uploaded: usize,
    pub failed: Vec<(String, String)>,
}

impl Outputs {
    /// Watches `dir` (created if missing) and uploads finished files to `store`.
    pub fn start(dir: &Path, store: JobStore, opts: UploadOptions) -> Result<Outputs, Error> {
        let dir_err = |reason: String| Error::Dir {
            path: dir.to_owned(),
            reason,
        };
        std::fs::create_dir_all(dir).map_err(|e| dir_err(e.to_string()))?;
        let dir = dir.canonicalize().map_err(|e| dir_err(e.to_string()))?;
        let (tx, events) = mpsc::unbounded_channel();
        let mut watcher = notify::recommended_watcher(move |res| {
            let _ = tx.send(res);
        })
        .map_err(|e| dir_err(format!("cannot watch it: {e}")))?;
        watcher
            .watch(&dir, RecursiveMode::Recursive)
            .map_err(|e| dir_err(format!("cannot watch it: {e}")))?;
        let (stop, stop_rx) = oneshot::channel();
        let actor = Actor {
            dir,
            store,
            opts,
            sent: HashMap::new(),
            report: OutputsReport::default(),
            _watcher: watcher,
        };
        Ok(Outputs {
            stop,
            task: tokio::spawn(actor.run(events, stop_rx)),
        })
    }

    /// The command has exited: upload every finished file not yet sent, then stop.
    pub async fn finish(self) -> OutputsReport {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

struct Actor {
    dir: PathBuf,
    store: JobStore,
    opts: UploadOptions,
    /// Sent files and the (size, mtime) sent, so a rewrite is sent again.
    sent: HashMap<PathBuf, (u64, i128)>,
    report: OutputsReport,
    _watcher: RecommendedWatcher,
}

impl Actor {
    async fn run(
        mut self,
        mut events: mpsc::UnboundedReceiver<notify::Result<notify::Event>>,
        mut stop: oneshot::Receiver<()>,
    ) -> OutputsReport {
        let mut rescan = tokio::time::interval(Duration::from_secs(5));
        loop {
            tokio::select! {
                Some(ev) = events.recv() => {
                    let Ok(ev) = ev else { continue };
                    let finished = matches!(
                        ev.kind,
                        EventKind::Access(AccessKind::Close(AccessMode::Write))
                            | EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both))
                    );
                    if finished && let Some(path) = ev.paths.last() {
                        self.send(path.clone()).await;
                    }
                }
                _ = rescan.tick() => self.sweep().await,
                _ = &mut stop => {
                    while let Ok(Ok(ev)) = events.try_recv() {
                        if let Some(path) = ev.paths.last() {
                            self.send(path.clone()).await;
                        }
                    }
                    self.sweep().await;
                    // A failure retried successfully later is no failure.
                    let dir = self.dir.clone();
                    let sent = &self.sent;
                    self.report.failed.retain(|(rel, _)| !sent.contains_key(&dir.join(rel)));
                    self.report.failed.dedup_by(|a, b| a.0 == b.0);
                    return self.report;
                }
            }
        }
    }

    /// The safety net: every file nobody holds open for writing.
    async fn sweep(&mut self) {
        let open = writers::entries_open_for_write(&self.dir);
        let mut files = Vec::new();
        walk(&self.dir, &mut files);
        for f in files {
            let top = f
                .strip_prefix(&self.dir)
                .ok()
                .and_then(|r| r.components().next())
                .map(|c| c.as_os_str().to_string_lossy().into_owned());
            if top.is_some_and(|t| !open.contains(&t)) {
                self.send(f).await;
            }
        }
    }

    async fn send(&mut self, path: PathBuf) {
        let Ok(rel) = path
            .strip_prefix(&self.dir)
            .map(|r| r.to_string_lossy().into_owned())
        else {
            return;
        };
        if rel.split('/').any(|c| rules::is_ignored_name(Path::new(c))) {
            return;
        }
        let Ok(meta) = std::fs::metadata(&path) else {
            return;
        };
        if !meta.is_file() {
            return;
        }
        let stamp = (
            meta.len(),
            meta.modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos() as i128),
        );
        if self.sent.get(&path) == Some(&stamp) {
            return;
        }
        match self.store.upload_output(&rel, &path, &self.opts).await {
            Ok(_) => {
                info!(output = %rel, "output uploaded");
                self.sent.insert(path, stamp);
                self.report.uploaded += 1;
            }
            Err(e) => {
                warn!(output = %rel, "output upload failed: {e}");
                self.report.failed.push((rel, e.to_string()));
            }
        }
    }
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => walk(&p, out),
            Ok(t) if t.is_file() => out.push(p),
            _ => {}
        }
    }
}
