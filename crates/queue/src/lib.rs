//! A queue of shards kept in the job's store, with no server besides the store itself.
//!
//! Layout under `<job>/queue/`: `meta.json` (counts), `shards/<id>.json` (the items, written
//! once), `state/<id>.json` (the shard's lease state, changed only by compare-and-swap on its
//! version). A worker holds a shard while its lease has not expired; every change it makes is
//! conditional on the version it last wrote, so a worker whose lease expired and was taken over
//! is *fenced*: its renewals, progress and "done" all fail, and it must stop.

mod state;

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use object_store::path::Path;
use serde::{Deserialize, Serialize};
use spotguard_store::{CasOutcome, Expect, JobStore, UpdateVersion};

pub use state::{Phase, ShardState};

/// Failures of queue operations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Store(#[from] spotguard_store::Error),
    /// `queue create` on a job that has a queue already (use append).
    #[error("job already has a queue of {shards} shards (append to add more)")]
    Exists { shards: u32 },
    /// The lease was lost: it expired and another worker took the shard.
    #[error("lost the lease on shard {shard}: another worker holds it now")]
    Fenced { shard: u32 },
    #[error("bad queue object {key}: {reason}")]
    Corrupt { key: String, reason: String },
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Meta {
    shards: u32,
    items: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Shard {
    id: u32,
    items: Vec<String>,
}

/// Counts of shards by phase.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub pending: u32,
    pub leased: u32,
    pub done: u32,
    pub failed: u32,
}

/// A job's queue.
#[derive(Clone, Debug)]
pub struct Queue {
    store: JobStore,
    /// Shard count last read from `meta.json`: claims read it again only when they find
    /// nothing to claim (an append may have added shards), saving a GET per claim.
    known_shards: std::sync::Arc<std::sync::atomic::AtomicU32>,
    view: std::sync::Arc<std::sync::Mutex<ClaimView>>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

impl Queue {
    pub fn new(store: JobStore) -> Queue {
        Queue {
            store,
            known_shards: Default::default(),
            view: Default::default(),
        }
    }

    fn dir(&self) -> Path {
        self.store.layout().job().clone().join("queue")
    }

    fn meta_key(&self) -> Path {
        self.dir().join("meta.json")
    }

    fn shard_key(&self, id: u32) -> Path {
        self.dir().join("shards").join(format!("{id:08}.json"))
    }

    fn state_key(&self, id: u32) -> Path {
        self.dir().join("state").join(format!("{id:08}.json"))
    }

    /// `done/` / `failed/` hold a marker per shard that reached that final phase, so a LIST
    /// tells a claimer which shards it need not look at (a finished shard never changes again).
    /// Only hints: the state object is the truth, and a missing marker costs one GET.
    fn marker_dir(&self, phase: Phase) -> Path {
        let name = if phase == Phase::Failed {
            "failed"
        } else {
            "done"
        };
        self.dir().join(name)
    }

    /// `<marker dir>/<id / 1000>/<id>`: a claimer that keeps finding shards taken in one
    /// stretch LISTs only that thousand (one request, and a small dir for stores that map keys
    /// to files).
    fn marker_key(&self, phase: Phase, id: u32) -> Path {
        self.marker_dir(phase)
            .join(format!("{:05}", id / MARKER_BUCKET))
            .join(format!("{id:08}"))
    }

    /// Shards with a `phase` marker.
    async fn marked(&self, phase: Phase) -> Result<HashSet<u32>, Error> {
        self.marked_under(self.marker_dir(phase)).await
    }

    async fn marked_under(&self, prefix: Path) -> Result<HashSet<u32>, Error> {
        Ok(self
            .store
            .list_keys(&prefix)
            .await?
            .iter()
            .filter_map(|k| k.filename().and_then(|f| f.parse().ok()))
            .collect())
    }

    async fn state(&self, id: u32) -> Result<Option<(ShardState, UpdateVersion)>, Error> {
        let key = self.state_key(id);
        match self.store.read_versioned(&key).await? {
            Some((b, v)) => Ok(Some((parse(&key, &b)?, v))),
            None => Ok(None),
        }
    }

    async fn meta(&self) -> Result<Option<(Meta, UpdateVersion)>, Error> {
        match self.store.read_versioned(&self.meta_key()).await? {
            Some((b, v)) => Ok(Some((parse(&self.meta_key(), &b)?, v))),
            None => Ok(None),
        }
    }

    /// Splits `items` into shards of `shard_size` and adds them. Without `append`, a job that
    /// already has a queue is an error. Returns the ids of the new shards.
    pub async fn create(
        &self,
        items: &[String],
        shard_size: usize,
        append: bool,
    ) -> Result<std::ops::Range<u32>, Error> {
        let shard_size = shard_size.max(1);
        loop {
            let existing = self.meta().await?;
            if let Some((m, _)) = &existing
                && !append
            {
                return Err(Error::Exists { shards: m.shards });
            }
            let first = existing.as_ref().map_or(0, |(m, _)| m.shards);
            let count = items.len().div_ceil(shard_size) as u32;
            // Shards first, the count last: a reader never sees a shard id that has no items.
            {
                use futures::{StreamExt, TryStreamExt};
                futures::stream::iter(items.chunks(shard_size).enumerate())
                    .map(|(i, chunk)| {
                        let shard = Shard {
                            id: first + i as u32,
                            items: chunk.to_vec(),
                        };
                        async move {
                            let key = self.shard_key(shard.id);
                            self.store
                                .write_if(&key, json(&shard), Expect::Absent)
                                .await
                        }
                    })
                    .buffer_unordered(READ_CONCURRENCY)
                    .try_collect::<Vec<_>>()
                    .await?;
            }
            let meta = Meta {
                shards: first + count,
                items: existing.as_ref().map_or(0, |(m, _)| m.items) + items.len() as u64,
            };
            let expect = match existing {
                Some((_, v)) => Expect::Version(v),
                None => Expect::Absent,
            };
            match self
                .store
                .write_if(&self.meta_key(), json(&meta), expect)
                .await?
            {
                CasOutcome::Written(_) => return Ok(first..first + count),
                // Another `create --append` raced us: its shards took these ids; go again.
                CasOutcome::Conflict if append => continue,
                CasOutcome::Conflict => return Err(Error::Exists { shards: 0 }),
            }
        }
    }

    /// Every shard's state (pending when never claimed), read with a few requests in flight.
    pub async fn states(&self) -> Result<Vec<(u32, ShardState)>, Error> {
        let Some((meta, _)) = self.meta().await? else {
            return Ok(Vec::new());
        };
        let ids: Vec<u32> = self
            .store
            .list_keys(&self.dir().join("state"))
            .await?
            .iter()
            .filter_map(|k| {
                k.filename()
                    .and_then(|f| f.strip_suffix(".json"))
                    .and_then(|n| n.parse::<u32>().ok())
            })
            .filter(|&id| id < meta.shards)
            .collect();
        let mut states = vec![ShardState::default(); meta.shards as usize];
        for (id, state) in self.read_states(ids).await? {
            states[id as usize] = state;
        }
        Ok(states
            .into_iter()
            .enumerate()
            .map(|(i, s)| (i as u32, s))
            .collect())
    }

    async fn read_states(&self, ids: Vec<u32>) -> Result<Vec<(u32, ShardState)>, Error> {
        use futures::{StreamExt, TryStreamExt};
        futures::stream::iter(ids)
            .map(|id| async move { Ok::<_, Error>(self.state(id).await?.map(|(s, _)| (id, s))) })
            .buffer_unordered(READ_CONCURRENCY)
            .try_filter_map(|s| async move { Ok(s) })
            .try_collect()
            .await
    }

    /// Shards by phase. Cheap when most shards are finished: two LISTs for the finished ones,
    /// a GET only for each of the others.
    pub async fn counts(&self) -> Result<Counts, Error> {
        let Some((meta, _)) = self.meta().await? else {
            return Ok(Counts::default());
        };
        let (done, failed) =
            tokio::try_join!(self.marked(Phase::Done), self.marked(Phase::Failed))?;
        let rest: Vec<u32> = (0..meta.shards)
            .filter(|id| !done.contains(id) && !failed.contains(id))
            .collect();
        let unmarked = rest.len();
        let read = self.read_states(rest).await?;
        // Never claimed: no state object, pending.
        let mut c = Counts {
            done: done.iter().filter(|&&id| id < meta.shards).count() as u32,
            failed: failed.iter().filter(|&&id| id < meta.shards).count() as u32,
            pending: (unmarked - read.len()) as u32,
            ..Counts::default()
        };
        let now = now_ms();
        for (_, s) in read {
            match s.phase_at(now) {
                Phase::Pending => c.pending += 1,
                Phase::Leased => c.leased += 1,
                Phase::Done => c.done += 1,
                Phase::Failed => c.failed += 1,
            }
        }
        Ok(c)
    }

    /// Claims a shard that is pending or whose lease expired, for `worker`, for `ttl`.
    /// `None` when no shard is claimable now; [`Queue::seen`] then says whether any is left.
    ///
    /// Each queue handle remembers which shards it saw finished (for good) or held by someone
    /// else, so a claim usually costs one GET and one conditional PUT however long the queue:
    /// it tries the shard after the one it last claimed, else a random spot in the largest
    /// stretch of shards not known to be taken (workers spread out instead of fighting over
    /// the same ones). After a few misses in a row, when much is unknown, it LISTs the finished
    /// markers of that stretch; when nothing is left to try it forgets its sightings of
    /// leases (they may have expired or been released) and looks once more.
    pub async fn claim(
        &self,
        worker: &str,
        ttl: Duration,
        max_attempts: u32,
    ) -> Result<Option<Lease>, Error> {
        let Some(shards) = self.shard_count().await? else {
            return Ok(None);
        };
        {
            let mut view = self.view.lock().expect("claim view");
            view.resize(shards);
            view.seed(worker);
        }
        let mut refreshed = false;
        loop {
            let pick = self.view.lock().expect("claim view").pick();
            let Some(id) = pick else {
                if refreshed {
                    return Ok(None);
                }
                refreshed = true;
                self.refresh(None).await?;
                continue;
            };
            let (state, expect) = match self.state(id).await? {
                Some((s, v)) => (s, Expect::Version(v)),
                None => (ShardState::default(), Expect::Absent),
            };
            let now = now_ms();
            if !state.claimable(now, max_attempts) {
                let refresh =
                    self.view
                        .lock()
                        .expect("claim view")
                        .saw(id, &state, now, max_attempts);
                if refresh {
                    self.refresh(Some(id)).await?;
                }
                continue;
            }
            if let Some(lease) = self.take(id, worker, state, expect, now, ttl).await? {
                self.view.lock().expect("claim view").claimed(id);
                return Ok(Some(lease));
            }
            // Lost the race for this one: someone else holds it now.
            self.view.lock().expect("claim view").busy(id);
        }
    }

    /// Learns from the markers what finished when much is unknown (a LIST page names 1,000
    /// finished shards; a GET learns one): those of the thousand around `near` (where misses
    /// came in a row). Without `near` (nothing left to try) it first forgets sightings of
    /// leases (they may have expired or been released), lists every marker, and looks
    /// whether the queue grew.
    async fn refresh(&self, near: Option<u32>) -> Result<(), Error> {
        let unknown = {
            let mut view = self.view.lock().expect("claim view");
            match near {
                Some(_) => view.unknown(),
                None => view.forget_busy(),
            }
        };
        if unknown > LIST_WHEN_UNKNOWN {
            let under = |phase| match near {
                Some(id) => self
                    .marker_dir(phase)
                    .join(format!("{:05}", id / MARKER_BUCKET)),
                None => self.marker_dir(phase),
            };
            let (done, failed) = tokio::try_join!(
                self.marked_under(under(Phase::Done)),
                self.marked_under(under(Phase::Failed))
            )?;
            let mut view = self.view.lock().expect("claim view");
            for id in done {
                view.set(id, Seen::Done);
            }
            for id in failed {
                view.set(id, Seen::Failed);
            }
        }
        if near.is_some() {
            return Ok(());
        }
        if let Some((meta, _)) = self.meta().await? {
            self.known_shards
                .store(meta.shards, std::sync::atomic::Ordering::Relaxed);
            self.view.lock().expect("claim view").resize(meta.shards);
        }
        Ok(())
    }

    /// What this handle saw of the queue in its last claim that found nothing (no requests):
    /// counts of shards done, failed for good, and still unfinished (held by others).
    pub fn seen(&self) -> Counts {
        self.view.lock().expect("claim view").counts()
    }

    /// The shard count, read from `meta.json` once per handle (a refresh re-reads it when an
    /// append may have added shards).
    async fn shard_count(&self) -> Result<Option<u32>, Error> {
        use std::sync::atomic::Ordering;
        let cached = self.known_shards.load(Ordering::Relaxed);
        if cached > 0 {
            return Ok(Some(cached));
        }
        let Some((meta, _)) = self.meta().await? else {
            return Ok(None);
        };
        self.known_shards.store(meta.shards, Ordering::Relaxed);
        Ok(Some(meta.shards))
    }

    async fn take(
        &self,
        id: u32,
        worker: &str,
        state: ShardState,
        expect: Expect,
        now: u64,
        ttl: Duration,
    ) -> Result<Option<Lease>, Error> {
        let next = state.claimed(worker, now, ttl);
        let key = self.state_key(id);
        let CasOutcome::Written(version) = self.store.write_if(&key, json(&next), expect).await?
        else {
            return Ok(None);
        };
        let shard: Shard = match self.store.read_versioned(&self.shard_key(id)).await? {
            Some((b, _)) => parse(&self.shard_key(id), &b)?,
            None => {
                return Err(Error::Corrupt {
                    key: self.shard_key(id).to_string(),
                    reason: "missing".into(),
                });
            }
        };
        Ok(Some(Lease {
            queue: self.clone(),
            id,
            items: shard.items,
            state: next,
            version,
        }))
    }
}

/// Finished markers are grouped by this many shards.
const MARKER_BUCKET: u32 = 1000;
/// A refresh LISTs the finished markers when more shards than this are of unknown state.
const LIST_WHEN_UNKNOWN: usize = 64;
/// Misses (shards found taken) in a row before a claim refreshes what it knows.
const MISSES_BEFORE_REFRESH: u32 = 8;

/// What a queue handle last saw of one shard.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Seen {
    #[default]
    Unknown,
    /// Leased by another worker (or not claimable by us for now): may change.
    Busy,
    /// Finished for good: never changes again.
    Done,
    Failed,
}

/// What one queue handle knows of the shards, and where it claims next.
#[derive(Debug, Default)]
struct ClaimView {
    seen: Vec<Seen>,
    next: Option<u32>,
    misses: u32,
    rng: u64,
}

impl ClaimView {
    fn resize(&mut self, shards: u32) {
        if self.seen.len() < shards as usize {
            self.seen.resize(shards as usize, Seen::Unknown);
        }
    }

    fn seed(&mut self, worker: &str) {
        if self.rng == 0 {
            let nanos = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .subsec_nanos();
            self.rng = (crc32(worker) ^ u64::from(nanos)) | 1;
        }
    }

    fn random(&mut self) -> u64 {
        // xorshift64
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn set(&mut self, id: u32, seen: Seen) {
        if let Some(s) = self.seen.get_mut(id as usize) {
            *s = seen;
        }
    }

    fn busy(&mut self, id: u32) {
        self.set(id, Seen::Busy);
        self.next = None;
    }

    /// A shard found not claimable; true when it is time to refresh.
    fn saw(&mut self, id: u32, state: &ShardState, now: u64, max_attempts: u32) -> bool {
        let seen = match state.phase_at(now) {
            Phase::Done => Seen::Done,
            Phase::Failed => Seen::Failed,
            // Pending but out of attempts (by our --max-attempts): failed as far as we go.
            Phase::Pending if state.failures >= max_attempts.max(1) => Seen::Failed,
            _ => Seen::Busy,
        };
        self.set(id, seen);
        self.next = None;
        self.misses += 1;
        if self.misses >= MISSES_BEFORE_REFRESH {
            self.misses = 0;
            return true;
        }
        false
    }

    fn claimed(&mut self, id: u32) {
        self.set(id, Seen::Busy);
        self.next = Some(id + 1);
        self.misses = 0;
    }

    /// Forgets lease sightings; returns how many shards are of unknown state now.
    fn forget_busy(&mut self) -> usize {
        let mut unknown = 0;
        for s in &mut self.seen {
            if *s == Seen::Busy {
                *s = Seen::Unknown;
            }
            unknown += usize::from(*s == Seen::Unknown);
        }
        unknown
    }

    fn unknown(&self) -> usize {
        self.seen.iter().filter(|s| **s == Seen::Unknown).count()
    }

    fn counts(&self) -> Counts {
        let mut c = Counts::default();
        for s in &self.seen {
            match s {
                Seen::Done => c.done += 1,
                Seen::Failed => c.failed += 1,
                Seen::Busy => c.leased += 1,
                Seen::Unknown => c.pending += 1,
            }
        }
        c
    }

    /// The shard after the last one claimed if its state is unknown, else a random spot in
    /// the middle of the largest stretch of shards of unknown state.
    fn pick(&mut self) -> Option<u32> {
        if let Some(n) = self.next
            && self.seen.get(n as usize) == Some(&Seen::Unknown)
        {
            return Some(n);
        }
        let (mut best, mut run_start) = ((0usize, 0usize), None);
        let free = self.seen.iter().map(|s| *s == Seen::Unknown);
        for (i, free) in free.chain(std::iter::once(false)).enumerate() {
            match (free, run_start) {
                (true, None) => run_start = Some(i),
                (false, Some(s)) => {
                    if i - s > best.1 - best.0 {
                        best = (s, i);
                    }
                    run_start = None;
                }
                _ => {}
            }
        }
        let (s, e) = best;
        if e == s {
            return None;
        }
        // A random spot in the middle half of the stretch: two workers that jump at once
        // rarely land on the same shard, and each leaves room behind it for the other.
        let len = e - s;
        let lo = s + len / 4;
        let span = (len / 2).max(1);
        Some((lo + (self.random() % span as u64) as usize) as u32)
    }
}

/// A claimed shard. Every change is conditional on the version this lease last wrote.
#[derive(Debug)]
pub struct Lease {
    queue: Queue,
    pub id: u32,
    items: Vec<String>,
    state: ShardState,
    version: UpdateVersion,
}

impl Lease {
    /// The shard's items not yet recorded as done (what a taker-over still has to do).
    pub fn remaining(&self) -> Vec<String> {
        self.items
            .iter()
            .filter(|i| !self.state.done_items.contains(i))
            .cloned()
            .collect()
    }

    pub fn state(&self) -> &ShardState {
        &self.state
    }

    async fn swap(&mut self, next: ShardState) -> Result<(), Error> {
        let key = self.queue.state_key(self.id);
        match self
            .queue
            .store
            .write_if(&key, json(&next), Expect::Version(self.version.clone()))
            .await?
        {
            CasOutcome::Written(v) => {
                self.version = v;
                self.state = next;
                Ok(())
            }
            CasOutcome::Conflict => Err(Error::Fenced { shard: self.id }),
        }
    }

    /// Extends the lease by `ttl` from now, recording `done` items with it.
    pub async fn renew(&mut self, ttl: Duration, done: &[String]) -> Result<(), Error> {
        let next = self.state.with_progress(done).renewed(now_ms(), ttl);
        self.swap(next).await
    }

    /// Records finished items, so a taker-over gets only the rest.
    pub async fn progress(&mut self, done: &[String]) -> Result<(), Error> {
        let next = self.state.with_progress(done);
        self.swap(next).await
    }

    /// The shard is done.
    pub async fn done(mut self, done: &[String]) -> Result<(), Error> {
        let next = self.state.with_progress(done).finished();
        self.swap(next).await?;
        self.seen(Seen::Done);
        self.mark().await;
        Ok(())
    }

    /// Gives the shard back at once (a preemption): pending again, progress kept.
    pub async fn release(mut self, done: &[String]) -> Result<(), Error> {
        let next = self.state.with_progress(done).released();
        self.swap(next).await?;
        self.seen(Seen::Unknown);
        Ok(())
    }

    /// Tells the claim view how this shard ended up, so it never looks at it again in vain.
    fn seen(&self, seen: Seen) {
        self.queue
            .view
            .lock()
            .expect("claim view")
            .set(self.id, seen);
    }

    /// The command failed with `status`: pending again for another attempt, or failed for
    /// good once `max_attempts` are used.
    pub async fn fail(
        mut self,
        status: i32,
        max_attempts: u32,
        done: &[String],
    ) -> Result<(), Error> {
        let next = self.state.with_progress(done).failed(status, max_attempts);
        self.swap(next).await?;
        if self.state.phase == Phase::Failed {
            self.seen(Seen::Failed);
            self.mark().await;
        } else {
            self.seen(Seen::Unknown);
        }
        Ok(())
    }

    /// The finished marker, a hint for claimers and counts: a failure here costs them a GET.
    async fn mark(&self) {
        let key = self.queue.marker_key(self.state.phase, self.id);
        let _ = self
            .queue
            .store
            .write_if(&key, Bytes::from_static(b"1"), Expect::Absent)
            .await;
    }
}

/// Reads in flight at once when a command looks at many shards.
const READ_CONCURRENCY: usize = 32;

fn json<T: Serialize>(v: &T) -> Bytes {
    Bytes::from(serde_json::to_vec_pretty(v).expect("queue objects serialize"))
}

fn parse<T: for<'de> Deserialize<'de>>(key: &Path, b: &[u8]) -> Result<T, Error> {
    serde_json::from_slice(b).map_err(|e| Error::Corrupt {
        key: key.to_string(),
        reason: e.to_string(),
    })
}

fn crc32(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::{ClaimView, Seen};
    use crate::ShardState;

    #[test]
    fn picks_only_unknown_shards_until_none_is_left() {
        for shards in [1u32, 2, 7, 100] {
            let mut v = ClaimView::default();
            v.resize(shards);
            v.seed("w");
            let mut picked = 0;
            while let Some(id) = v.pick() {
                assert_eq!(
                    v.seen[id as usize],
                    Seen::Unknown,
                    "picked a known shard {id}"
                );
                match id % 3 {
                    0 => v.claimed(id),
                    1 => v.busy(id),
                    _ => v.set(id, Seen::Done),
                }
                picked += 1;
                assert!(picked <= shards, "picked more than {shards} shards");
            }
            assert_eq!(picked, shards);
            let c = v.counts();
            assert_eq!((c.pending, c.leased + c.done), (0, shards));
            // Forgetting leases makes them pickable again; finished ones stay known.
            assert_eq!(
                v.forget_busy(),
                (shards as usize).div_ceil(3) + (shards as usize + 1) / 3
            );
        }
    }

    #[test]
    fn continues_after_the_last_claimed_shard_and_refreshes_after_misses() {
        let mut v = ClaimView::default();
        v.resize(100);
        v.seed("w");
        v.claimed(4);
        assert_eq!(v.pick(), Some(5));
        let done = ShardState::default().finished();
        let refreshes = (10..26).filter(|&id| v.saw(id, &done, 0, 3)).count();
        assert_eq!(refreshes, 2);
        assert_eq!(v.counts().done, 16);
    }
}
