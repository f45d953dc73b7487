//! Watches the checkpoint dir the command writes into, judges each direct entry by the
//! completion rules, and uploads each complete checkpoint as soon as it is complete.
//!
//! One actor owns all of it (the `notify` watcher, the per-entry state, the one upload in
//! flight); the session talks to it through [`Checkpointer`].

pub mod outputs;
pub mod rules;
pub mod writers;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use notify::event::{AccessKind, AccessMode, ModifyKind, RenameMode};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use spotguard_stats::Stats;
use spotguard_store::{
    CommitRecord, JobStore, LocalCheckpoint, Manifest, UploadOptions, UploadReport,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use crate::rules::{Observation, Rule, Verdict};

/// How checkpoints are found and kept.
#[derive(Clone, Debug)]
pub struct CheckpointOptions {
    /// Quiescence: an entry no rule recognises is complete after this long without writes.
    pub settle: Duration,
    /// Full rescan of the dir, the safety net under file-system events.
    pub rescan: Duration,
    /// Committed checkpoints kept in the store.
    pub keep: usize,
    /// A failed upload is tried again after this long.
    pub retry_after: Duration,
    pub upload: UploadOptions,
    /// The job's prefix is known to hold nothing yet (a queue shard's first attempt): skip
    /// the start-up look for committed checkpoints and abandoned uploads.
    pub fresh: bool,
    /// Where each commit and upload failure is counted (the ledger and the metrics).
    pub stats: Option<Arc<Stats>>,
}

impl Default for CheckpointOptions {
    fn default() -> Self {
        CheckpointOptions {
            settle: Duration::from_secs(10),
            rescan: Duration::from_secs(5),
            keep: 3,
            retry_after: Duration::from_secs(15),
            upload: UploadOptions::default(),
            fresh: false,
            stats: None,
        }
    }
}

/// Why the checkpointer could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("failed to use the checkpoint dir {path}: {reason}")]
    Dir { path: PathBuf, reason: String },
    #[error(transparent)]
    Store(#[from] spotguard_store::Error),
}

/// One committed checkpoint, as a flush reports it.
#[derive(Clone, Debug)]
pub struct Committed {
    pub name: String,
    recency: Recency,
    pub seq: u64,
    pub bytes: u64,
    pub sent_bytes: u64,
    pub elapsed: Duration,
}

/// What the final flush made durable, and what not.
#[derive(Clone, Debug, Default)]
pub struct FlushReport {
    /// Committed during the flush.
    pub committed: Vec<Committed>,
    /// Complete checkpoints that are not durable, with the reason.
    pub not_durable: Vec<(String, String)>,
    /// Entries never complete (half-written): not uploaded, by design.
    pub incomplete: Vec<(String, String)>,
    /// The newest complete checkpoint, if any, and whether it is committed.
    pub newest: Option<(String, bool)>,
}

impl FlushReport {
    /// True when the newest complete checkpoint did not reach the store: "upload failed".
    pub fn failed(&self) -> bool {
        matches!(self.newest, Some((_, false)))
    }
}

enum Cmd {
    Flush {
        deadline: Option<Instant>,
        trust_quiescence: bool,
        reply: oneshot::Sender<FlushReport>,
    },
}

/// Handle to the checkpoint actor.
#[derive(Debug)]
pub struct Checkpointer {
    tx: mpsc::Sender<Cmd>,
    task: JoinHandle<()>,
}

impl Checkpointer {
    /// Starts watching `dir` (created if missing) and uploading to `store`.
    pub async fn start(
        dir: &Path,
        store: JobStore,
        opts: CheckpointOptions,
    ) -> Result<Self, Error> {
        let dir_err = |reason: String| Error::Dir {
            path: dir.to_owned(),
            reason,
        };
        std::fs::create_dir_all(dir).map_err(|e| dir_err(e.to_string()))?;
        let dir = dir.canonicalize().map_err(|e| dir_err(e.to_string()))?;
        let (ev_tx, events) = mpsc::unbounded_channel();
        let mut watcher = notify::recommended_watcher(move |res| {
            let _ = ev_tx.send(res);
        })
        .map_err(|e| dir_err(format!("cannot watch it: {e}")))?;
        watcher
            .watch(&dir, RecursiveMode::Recursive)
            .map_err(|e| dir_err(format!("cannot watch it: {e}")))?;
        let manifests = if opts.fresh {
            Vec::new()
        } else {
            match store.abort_abandoned_uploads().await {
                Ok(0) => {}
                Ok(n) => info!("aborted {n} multipart upload(s) an earlier run left unfinished"),
                Err(e) => warn!("failed to look for unfinished multipart uploads: {e}"),
            }
            store.committed().await?
        };
        // The newest committed write: anything older is superseded and never uploaded, so
        // sequence numbers follow the order the checkpoints were written.
        let newest_committed = manifests
            .last()
            .and_then(|m| m.files.iter().map(|f| f.mtime_ns).max())
            .map_or(SystemTime::UNIX_EPOCH, |ns| {
                SystemTime::UNIX_EPOCH + Duration::from_nanos(ns.max(0) as u64)
            });
        let committed = latest_by_name(manifests);
        let (tx, rx) = mpsc::channel(4);
        let mut actor = Actor {
            dir,
            store,
            opts,
            entries: BTreeMap::new(),
            committed,
            newest_committed: (newest_committed, 0),
            next_order: 1,
            failed: HashMap::new(),
            events,
            _watcher: watcher,
            uploading: None,
        };
        actor.rescan();
        let task = tokio::spawn(actor.run(rx));
        Ok(Checkpointer { tx, task })
    }

    /// The command has exited: upload every complete checkpoint not yet durable, newest
    /// first, before `deadline`. `trust_quiescence`: the command exited cleanly, so files it
    /// wrote in place are finished; otherwise only checkpoints complete by their layout (or
    /// judged complete before) count, since a killed writer leaves half a file behind.
    pub async fn flush(self, deadline: Option<Instant>, trust_quiescence: bool) -> FlushReport {
        let (reply, rx) = oneshot::channel();
        if self
            .tx
            .send(Cmd::Flush {
                deadline,
                trust_quiescence,
                reply,
            })
            .await
            .is_err()
        {
            return FlushReport::default();
        }
        let report = rx.await.unwrap_or_default();
        let _ = self.task.await;
        report
    }
}

fn latest_by_name(manifests: Vec<Manifest>) -> HashMap<String, Fingerprint> {
    manifests
        .into_iter()
        .map(|m| {
            let fp = m
                .files
                .iter()
                .map(|f| (f.path.clone(), f.size, f.mtime_ns))
                .collect();
            (m.name, fp)
        })
        .collect()
}

type Fingerprint = Vec<(String, u64, i128)>;

#[derive(Debug)]
struct Tracked {
    last_event: Instant,
    renamed_in: bool,
    /// The rule that judged it complete, once one has.
    complete: Option<Rule>,
    last_verdict: String,
    /// When it was first seen, relative to the others.
    order: u64,
    /// Committed or superseded, and untouched since: not judged again until an event or the
    /// next rescan (an idle training run costs next to nothing).
    settled: bool,
    /// When the command started writing it, if we saw that (an event, not a scan or a
    /// rename into the dir): gives how long the write took.
    first_write: Option<SystemTime>,
}

type Recency = (SystemTime, u64);

struct Actor {
    dir: PathBuf,
    store: JobStore,
    opts: CheckpointOptions,
    entries: BTreeMap<String, Tracked>,
    /// Fingerprint of each name's newest committed version.
    committed: HashMap<String, Fingerprint>,
    /// Recency of the newest committed checkpoint: its newest write, then the order entries
    /// were first seen (file times are coarse: two checkpoints can share one).
    newest_committed: Recency,
    next_order: u64,
    /// Names whose upload failed, and when to try again.
    failed: HashMap<String, (Instant, String)>,
    events: mpsc::UnboundedReceiver<notify::Result<notify::Event>>,
    _watcher: RecommendedWatcher,
    uploading: Option<(String, JoinHandle<UploadResult>)>,
}

/// A complete checkpoint ready to go.
struct Ready {
    name: String,
    recency: Recency,
    /// How long the command took to write it, when known.
    write_seconds: Option<f64>,
    scan: LocalCheckpoint,
    rule: Rule,
}

type UploadResult = (
    String,
    Fingerprint,
    Recency,
    Option<f64>,
    Result<UploadReport, spotguard_store::Error>,
);

impl Actor {
    async fn run(mut self, mut cmds: mpsc::Receiver<Cmd>) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut rescan = tokio::time::interval(self.opts.rescan);
        loop {
            tokio::select! {
                Some(ev) = self.events.recv() => self.on_event(ev),
                _ = tick.tick() => self.step(false),
                _ = rescan.tick() => self.rescan(),
                res = wait_upload(&mut self.uploading) => {
                    self.on_uploaded(res);
                    // Straight on to the next one, if any.
                    self.step(false);
                }
                cmd = cmds.recv() => {
                    if let Some(Cmd::Flush { deadline, trust_quiescence, reply }) = cmd {
                        let report = self.flush(deadline, trust_quiescence).await;
                        let _ = reply.send(report);
                    }
                    return;
                }
            }
        }
    }

    fn on_event(&mut self, ev: notify::Result<notify::Event>) {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                warn!(
                    "file-system event error in {}: {e}; relying on rescans",
                    self.dir.display()
                );
                return;
            }
        };
        // Opens and reads (ours included: every scan opens the dirs) are not writes. Only a
        // close after writing is.
        if let EventKind::Access(kind) = ev.kind
            && kind != AccessKind::Close(AccessMode::Write)
        {
            return;
        }
        let now = Instant::now();
        // For a rename within the watched tree `paths` is [from, to]: the entry that
        // matters is where it went.
        let renamed_to = matches!(
            ev.kind,
            EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both))
        );
        let paths = if renamed_to {
            ev.paths.last().into_iter().collect::<Vec<_>>()
        } else {
            ev.paths.iter().collect()
        };
        for path in paths {
            let Ok(rel) = path.strip_prefix(&self.dir) else {
                continue;
            };
            let mut comps = rel.components();
            let Some(first) = comps.next() else { continue };
            let name = first.as_os_str().to_string_lossy().into_owned();
            let direct = comps.next().is_none();
            let next = &mut self.next_order;
            let t = self.entries.entry(name).or_insert_with(|| Tracked {
                last_event: now,
                renamed_in: false,
                complete: None,
                last_verdict: String::new(),
                order: std::mem::replace(next, *next + 1),
                settled: false,
                first_write: (!renamed_to).then(SystemTime::now),
            });
            t.last_event = now;
            t.settled = false;
            if direct {
                if renamed_to {
                    t.renamed_in = true;
                } else if matches!(ev.kind, EventKind::Create(_)) {
                    t.renamed_in = false;
                }
            }
            if !direct || !renamed_to {
                // Written to since it was judged: judge it again.
                t.complete = None;
            }
        }
    }

    /// Adds entries the events missed; forgets entries that are gone.
    fn rescan(&mut self) {
        let Ok(read) = std::fs::read_dir(&self.dir) else {
            warn!("cannot read the checkpoint dir {}", self.dir.display());
            return;
        };
        let mut present = Vec::new();
        for e in read.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            present.push(name.clone());
            let next = &mut self.next_order;
            self.entries.entry(name).or_insert_with(|| Tracked {
                // Age comes from mtimes for entries found by a scan.
                last_event: Instant::now() - Duration::from_secs(3600),
                renamed_in: false,
                complete: None,
                last_verdict: String::new(),
                order: std::mem::replace(next, *next + 1),
                settled: false,
                first_write: None,
            });
        }
        self.entries.retain(|name, _| present.contains(name));
        // The safety net: look at everything again, in case an event was lost.
        for t in self.entries.values_mut() {
            t.settled = false;
        }
    }

    /// Judges every entry; starts the next upload unless one is in flight.
    fn step(&mut self, trust_quiescence: bool) {
        if self.uploading.is_some() {
            return;
        }
        let ready = self.ready(trust_quiescence, false);
        let now = Instant::now();
        if let Some(r) = ready
            .into_iter()
            .find(|r| self.failed.get(&r.name).is_none_or(|(at, _)| *at <= now))
        {
            self.start_upload(r);
        }
    }

    /// Complete, not-yet-committed checkpoints, newest first.
    fn ready(&mut self, trust_quiescence: bool, definitive_only: bool) -> Vec<Ready> {
        let candidates: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, t)| !t.settled)
            .map(|(n, _)| n)
            .filter(|n| !rules::is_ignored_name(Path::new(n.as_str())))
            .filter(|n| self.uploading.as_ref().is_none_or(|(u, _)| u != *n))
            .cloned()
            .collect();
        if candidates.is_empty() {
            return Vec::new();
        }
        let writers = writers::entries_open_for_write(&self.dir);
        let mut ready = Vec::new();
        for name in candidates {
            let path = self.dir.join(&name);
            let Ok(scan) = LocalCheckpoint::scan(&path) else {
                continue;
            };
            let t = self.entries.get_mut(&name).expect("candidates are tracked");
            if self.committed.get(&name) == Some(&scan.fingerprint()) {
                t.settled = true;
                continue;
            }
            let newest_write = newest_mtime(&path, &scan);
            let recency = (newest_write, t.order);
            if recency < self.newest_committed {
                if t.last_verdict != "superseded" {
                    debug!(entry = %name, "older than the newest committed checkpoint: not uploaded");
                    t.last_verdict = "superseded".into();
                }
                t.settled = true;
                continue;
            }
            let since_mtime = SystemTime::now()
                .duration_since(newest_write)
                .unwrap_or_default();
            let quiet_for = if trust_quiescence {
                Duration::MAX
            } else {
                t.last_event.elapsed().min(since_mtime)
            };
            let obs = Observation {
                is_dir: scan.kind == spotguard_store::EntryKind::Dir,
                renamed_in: t.renamed_in,
                quiet_for,
                open_for_write: writers.contains(&name),
                has_marker: self
                    .dir
                    .join(format!("{name}{}", rules::MARKER_SUFFIX))
                    .exists(),
                files: scan.files.iter().map(|f| f.rel.clone()).collect(),
            };
            let verdict = rules::judge(&name, &obs, self.opts.settle);
            let shown = format!("{verdict:?}");
            if shown != t.last_verdict {
                debug!(entry = %name, "checkpoint entry: {shown}");
                t.last_verdict = shown;
            }
            let rule = match verdict {
                Verdict::Complete(rule)
                    if !definitive_only || rule.is_definitive() || t.complete.is_some() =>
                {
                    rule
                }
                Verdict::Complete(_) | Verdict::Incomplete(_) | Verdict::Ignored(_) => continue,
            };
            t.complete.get_or_insert(rule);
            let write_seconds = t
                .first_write
                .filter(|_| !t.renamed_in)
                .and_then(|f| newest_write.duration_since(f).ok())
                .map(|d| d.as_secs_f64());
            ready.push(Ready {
                name,
                recency,
                write_seconds,
                scan,
                rule,
            });
        }
        ready.sort_by_key(|r| std::cmp::Reverse(r.recency));
        ready
    }

    fn start_upload(&mut self, r: Ready) {
        info!(
            checkpoint = %r.name,
            rule = r.rule.name(),
            "checkpoint complete; uploading {} in {} files",
            bytes(r.scan.total_bytes()),
            r.scan.files.len()
        );
        let (store, opts) = (self.store.clone(), self.opts.upload.clone());
        let keep = self.opts.keep;
        let name = r.name.clone();
        let written = r.recency;
        let write_seconds = r.write_seconds;
        let task = tokio::spawn(async move {
            let fp = r.scan.fingerprint();
            let res = store.upload(&r.scan, r.rule.name(), &opts).await;
            if res.is_ok() {
                match store.retain(keep).await {
                    Ok(rep) if !rep.deleted_checkpoints.is_empty() => {
                        info!(deleted = ?rep.deleted_checkpoints, objects = rep.deleted_objects, "retention (--keep {keep})");
                    }
                    Ok(_) => {}
                    Err(e) => warn!("retention failed (will try after the next commit): {e}"),
                }
            }
            (r.name, fp, written, write_seconds, res)
        });
        self.uploading = Some((name, task));
    }

    fn on_uploaded(
        &mut self,
        (name, fp, written, write_seconds, res): UploadResult,
    ) -> Option<Committed> {
        match res {
            Ok(rep) => {
                let m = &rep.manifest;
                if let Some(stats) = &self.opts.stats {
                    let now = SystemTime::now();
                    stats.committed(
                        CommitRecord {
                            seq: m.seq,
                            name: name.clone(),
                            committed: spotguard_stats::timestamp(now),
                            bytes: m.total_bytes,
                            sent_bytes: rep.sent_bytes,
                            upload_seconds: rep.elapsed.as_secs_f64(),
                            write_seconds,
                        },
                        now,
                    );
                }
                let secs = rep.elapsed.as_secs_f64().max(1e-3);
                info!(
                    checkpoint = %name,
                    seq = m.seq,
                    "checkpoint committed: {} ({} sent, {} files unchanged) in {:.1}s, {}/s",
                    bytes(m.total_bytes),
                    bytes(rep.sent_bytes),
                    rep.reused_files,
                    secs,
                    bytes((rep.sent_bytes as f64 / secs) as u64)
                );
                self.failed.remove(&name);
                self.committed.insert(name.clone(), fp);
                self.newest_committed = self.newest_committed.max(written);
                Some(Committed {
                    name,
                    recency: written,
                    seq: m.seq,
                    bytes: m.total_bytes,
                    sent_bytes: rep.sent_bytes,
                    elapsed: rep.elapsed,
                })
            }
            Err(e) => {
                if let Some(stats) = &self.opts.stats {
                    stats.upload_failed();
                }
                error!(checkpoint = %name, "checkpoint upload failed; retrying in {}s: {e}", self.opts.retry_after.as_secs());
                self.failed.insert(
                    name,
                    (Instant::now() + self.opts.retry_after, e.to_string()),
                );
                None
            }
        }
    }

    async fn flush(&mut self, deadline: Option<Instant>, trust_quiescence: bool) -> FlushReport {
        while let Ok(ev) = self.events.try_recv() {
            self.on_event(ev);
        }
        self.rescan();
        let mut report = FlushReport::default();
        if let Some((name, task)) = self.uploading.take() {
            match until(deadline, task).await {
                Some(res) => report
                    .committed
                    .extend(self.on_uploaded(res.expect("upload tasks do not panic"))),
                None => report
                    .not_durable
                    .push((name, "deadline passed during the upload".into())),
            }
        }
        let ready = self.ready(trust_quiescence, !trust_quiescence);
        report.newest = ready.first().map(|r| (r.name.clone(), false));
        if ready.is_empty() {
            // Nothing new: the newest complete checkpoint is the newest committed one.
            report.newest = None;
        }
        // Newest first; once one is committed the older ones are superseded.
        for r in ready {
            if report.committed.iter().any(|c| c.recency > r.recency) {
                continue;
            }
            let name = r.name.clone();
            if deadline.is_some_and(|d| d <= Instant::now()) {
                report
                    .not_durable
                    .push((name, "no time left before the deadline".into()));
                continue;
            }
            self.start_upload(r);
            let (_, task) = self.uploading.take().expect("just started");
            match until(deadline, task).await {
                Some(res) => match self.on_uploaded(res.expect("upload tasks do not panic")) {
                    Some(c) => report.committed.push(c),
                    None => {
                        let why = self
                            .failed
                            .get(&name)
                            .map(|(_, e)| e.clone())
                            .unwrap_or_default();
                        report.not_durable.push((name, why));
                    }
                },
                None => report
                    .not_durable
                    .push((name, "deadline passed during the upload".into())),
            }
        }
        if let Some((newest, durable)) = &mut report.newest {
            *durable = report.committed.iter().any(|c| &c.name == newest);
        }
        for (name, t) in &self.entries {
            if rules::is_ignored_name(Path::new(name))
                || t.complete.is_some()
                || t.last_verdict == "superseded"
            {
                continue;
            }
            let fp = LocalCheckpoint::scan(&self.dir.join(name))
                .map(|s| s.fingerprint())
                .ok();
            if fp.is_some()
                && self.committed.get(name) != fp.as_ref()
                && !report.committed.iter().any(|c| &c.name == name)
            {
                report
                    .incomplete
                    .push((name.clone(), t.last_verdict.clone()));
            }
        }
        report
    }
}

async fn wait_upload(slot: &mut Option<(String, JoinHandle<UploadResult>)>) -> UploadResult {
    match slot {
        Some((_, task)) => {
            let res = task.await.expect("upload tasks do not panic");
            *slot = None;
            res
        }
        None => std::future::pending().await,
    }
}

async fn until<T>(
    deadline: Option<Instant>,
    task: JoinHandle<T>,
) -> Option<Result<T, tokio::task::JoinError>> {
    match deadline {
        Some(d) => {
            let abort = task.abort_handle();
            let res = tokio::time::timeout_at(d, task).await.ok();
            if res.is_none() {
                abort.abort();
            }
            res
        }
        None => Some(task.await),
    }
}

fn newest_mtime(path: &Path, scan: &LocalCheckpoint) -> SystemTime {
    let own = std::fs::symlink_metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or(SystemTime::UNIX_EPOCH);
    scan.files
        .iter()
        .map(|f| SystemTime::UNIX_EPOCH + Duration::from_nanos(f.mtime_ns.max(0) as u64))
        .fold(own, SystemTime::max)
}

/// `1.5 GiB`, `300 MiB`, `12 KiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
