//! A queue of shards kept in the job's store, with no server besides the store itself.
//!
//! Layout under `<job>/queue/`: `meta.json` (counts), `shards/<id>.json` (the items, written
//! once), `state/<id>.json` (the shard's lease state, changed only by compare-and-swap on its
//! version). A worker holds a shard while its lease has not expired; every change it makes is
//! conditional on the version it last wrote, so a worker whose lease expired and was taken over
//! is *fenced*: its renewals, progress and "done" all fail, and it must stop.

mod state;

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

    /// `done/<id>`: written after a shard is done, so one LIST tells a claimer which shards
    /// it need not look at (a done shard never changes again).
    fn done_key(&self, id: u32) -> Path {
        self.dir().join("done").join(format!("{id:08}"))
    }

    async fn done_ids(&self) -> Result<std::collections::HashSet<u32>, Error> {
        Ok(self
            .store
            .list_keys(&self.dir().join("done"))
            .await?
            .iter()
            .filter_map(|k| k.filename().and_then(|f| f.parse().ok()))
            .collect())
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
            for (i, chunk) in items.chunks(shard_size).enumerate() {
                let shard = Shard {
                    id: first + i as u32,
                    items: chunk.to_vec(),
                };
                let key = self.shard_key(shard.id);
                self.store
                    .write_if(&key, json(&shard), Expect::Absent)
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

    /// Every shard's state (pending when never claimed).
    pub async fn states(&self) -> Result<Vec<(u32, ShardState)>, Error> {
        let Some((meta, _)) = self.meta().await? else {
            return Ok(Vec::new());
        };
        let mut states = vec![ShardState::default(); meta.shards as usize];
        for location in self.store.list_keys(&self.dir().join("state")).await? {
            let Some(id) = location
                .filename()
                .and_then(|f| f.strip_suffix(".json"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some((b, _)) = self.store.read_versioned(&location).await?
                && let Some(slot) = states.get_mut(id as usize)
            {
                *slot = parse(&location, &b)?;
            }
        }
        Ok(states
            .into_iter()
            .enumerate()
            .map(|(i, s)| (i as u32, s))
            .collect())
    }

    /// Shards by phase.
    pub async fn counts(&self) -> Result<Counts, Error> {
        let mut c = Counts::default();
        let now = now_ms();
        for (_, s) in self.states().await? {
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
    /// `None` when no shard is claimable now.
    pub async fn claim(
        &self,
        worker: &str,
        ttl: Duration,
        max_attempts: u32,
    ) -> Result<Option<Lease>, Error> {
        use std::sync::atomic::Ordering;
        let cached = self.known_shards.load(Ordering::Relaxed);
        if cached > 0
            && let Some(lease) = self.claim_among(cached, worker, ttl, max_attempts).await?
        {
            return Ok(Some(lease));
        }
        // Nothing among the shards we knew of (or we knew none): the queue may have grown.
        let Some((meta, _)) = self.meta().await? else {
            return Ok(None);
        };
        self.known_shards.store(meta.shards, Ordering::Relaxed);
        if meta.shards == cached {
            return Ok(None);
        }
        self.claim_among(meta.shards, worker, ttl, max_attempts)
            .await
    }

    async fn claim_among(
        &self,
        shards: u32,
        worker: &str,
        ttl: Duration,
        max_attempts: u32,
    ) -> Result<Option<Lease>, Error> {
        // Start the scan at a worker-dependent offset: many workers starting at once spread out
        // instead of all fighting over shard 0.
        let n = shards.max(1);
        let start = (crc32(worker) % n as u64) as u32;
        let done = self.done_ids().await?;
        for k in 0..shards {
            let id = (start + k) % n;
            if done.contains(&id) {
                continue;
            }
            let key = self.state_key(id);
            let current = self.store.read_versioned(&key).await?;
            let (state, expect) = match current {
                Some((b, v)) => (parse::<ShardState>(&key, &b)?, Expect::Version(v)),
                None => (ShardState::default(), Expect::Absent),
            };
            let now = now_ms();
            if !state.claimable(now, max_attempts) {
                continue;
            }
            let next = state.claimed(worker, now, ttl);
            if let CasOutcome::Written(version) =
                self.store.write_if(&key, json(&next), expect).await?
            {
                let shard: Shard = match self.store.read_versioned(&self.shard_key(id)).await? {
                    Some((b, _)) => parse(&self.shard_key(id), &b)?,
                    None => {
                        return Err(Error::Corrupt {
                            key: self.shard_key(id).to_string(),
                            reason: "missing".into(),
                        });
                    }
                };
                return Ok(Some(Lease {
                    queue: self.clone(),
                    id,
                    items: shard.items,
                    state: next,
                    version,
                }));
            }
            // Lost the race for this one: try the next.
        }
        Ok(None)
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
        // Only a hint for claimers (the state object is the truth): a failure here costs a GET.
        let key = self.queue.done_key(self.id);
        let _ = self
            .queue
            .store
            .write_if(&key, Bytes::from_static(b"done"), Expect::Absent)
            .await;
        Ok(())
    }

    /// Gives the shard back at once (a preemption): pending again, progress kept.
    pub async fn release(mut self, done: &[String]) -> Result<(), Error> {
        let next = self.state.with_progress(done).released();
        self.swap(next).await
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
        self.swap(next).await
    }
}

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
