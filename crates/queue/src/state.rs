//! The lease state machine of one shard, as pure functions: claim, renew, progress, done,
//! release, fail, expire. The queue applies each transition with a compare-and-swap.

use std::time::Duration;

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    #[default]
    Pending,
    Leased,
    Done,
    Failed,
}

/// A shard's state object (`state/<id>.json`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardState {
    pub phase: Phase,
    /// The worker holding (or that last held) the lease.
    pub owner: Option<String>,
    /// Lease expiry, milliseconds since the epoch.
    pub lease_until_ms: u64,
    /// Claims so far.
    pub attempts: u32,
    /// Claims that ended in a failure of the command.
    pub failures: u32,
    /// Items recorded as finished.
    pub done_items: Vec<String>,
    pub last_exit_status: Option<i32>,
}

impl ShardState {
    /// The phase as seen at `now`: a lease past its expiry counts as pending.
    pub fn phase_at(&self, now_ms: u64) -> Phase {
        match self.phase {
            Phase::Leased if self.lease_until_ms <= now_ms => Phase::Pending,
            p => p,
        }
    }

    pub fn claimable(&self, now_ms: u64, max_attempts: u32) -> bool {
        self.phase_at(now_ms) == Phase::Pending && self.failures < max_attempts.max(1)
    }

    pub fn claimed(&self, worker: &str, now_ms: u64, ttl: Duration) -> ShardState {
        ShardState {
            phase: Phase::Leased,
            owner: Some(worker.to_owned()),
            lease_until_ms: now_ms + ttl.as_millis() as u64,
            attempts: self.attempts + 1,
            ..self.clone()
        }
    }

    pub fn renewed(&self, now_ms: u64, ttl: Duration) -> ShardState {
        ShardState {
            lease_until_ms: now_ms + ttl.as_millis() as u64,
            ..self.clone()
        }
    }

    pub fn with_progress(&self, done: &[String]) -> ShardState {
        let mut next = self.clone();
        for d in done {
            if !next.done_items.contains(d) {
                next.done_items.push(d.clone());
            }
        }
        next
    }

    pub fn finished(&self) -> ShardState {
        ShardState {
            phase: Phase::Done,
            lease_until_ms: 0,
            ..self.clone()
        }
    }

    pub fn released(&self) -> ShardState {
        ShardState {
            phase: Phase::Pending,
            lease_until_ms: 0,
            ..self.clone()
        }
    }

    pub fn failed(&self, status: i32, max_attempts: u32) -> ShardState {
        let failures = self.failures + 1;
        let phase = if failures >= max_attempts.max(1) {
            Phase::Failed
        } else {
            Phase::Pending
        };
        ShardState {
            phase,
            lease_until_ms: 0,
            failures,
            last_exit_status: Some(status),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(30);

    #[test]
    fn lifecycle() {
        let s = ShardState::default();
        assert!(s.claimable(0, 3));
        let held = s.claimed("a", 1000, TTL);
        assert_eq!(held.phase_at(1000), Phase::Leased);
        assert!(!held.claimable(1000, 3), "a live lease is not claimable");
        assert!(held.claimable(31_000, 3), "an expired lease is");
        let renewed = held.renewed(20_000, TTL);
        assert!(!renewed.claimable(31_000, 3));
        let progressed = renewed.with_progress(&["x".into(), "x".into()]);
        assert_eq!(progressed.done_items, ["x"]);
        let released = progressed.released();
        assert!(released.claimable(20_001, 3));
        assert_eq!(released.done_items, ["x"], "progress survives a release");
        let taken = released.claimed("b", 21_000, TTL);
        assert_eq!((taken.owner.as_deref(), taken.attempts), (Some("b"), 2));
        assert_eq!(taken.finished().phase_at(u64::MAX), Phase::Done);
    }

    #[test]
    fn failures_retry_then_stop() {
        let s = ShardState::default().claimed("a", 0, TTL).failed(1, 2);
        assert_eq!(s.phase, Phase::Pending);
        assert!(s.claimable(0, 2));
        let s = s.claimed("b", 0, TTL).failed(7, 2);
        assert_eq!((s.phase, s.last_exit_status), (Phase::Failed, Some(7)));
        assert!(!s.claimable(u64::MAX, 2));
    }

    /// A model of the store: one shard, a compare-and-swap register, many workers acting in
    /// random order with a clock that jumps. Whatever the interleaving: never two workers with
    /// a live lease, a worker whose version is stale can change nothing, and done is final.
    #[test]
    fn random_interleavings_keep_the_invariants() {
        for seed in 1..=200u64 {
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let mut rnd = |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            // (state, version) in the store; each worker's last-written version, if any.
            let (mut state, mut version) = (ShardState::default(), 0u64);
            let mut held: Vec<Option<u64>> = vec![None; 4];
            let mut now = 0u64;
            let mut done_seen = false;
            for _ in 0..300 {
                let w = rnd(4) as usize;
                let ttl = Duration::from_millis(rnd(50));
                now += rnd(30);
                let cas = |expect: Option<u64>,
                           next: ShardState,
                           state: &mut ShardState,
                           version: &mut u64| {
                    if expect == Some(*version) {
                        *state = next;
                        *version += 1;
                        Some(*version)
                    } else {
                        None
                    }
                };
                match rnd(5) {
                    0 => {
                        if state.claimable(now, 3) {
                            let name = format!("w{w}");
                            held[w] = cas(
                                Some(version),
                                state.claimed(&name, now, ttl),
                                &mut state,
                                &mut version,
                            );
                        }
                    }
                    1 => {
                        let next = state.renewed(now, ttl);
                        let ok = cas(held[w], next, &mut state, &mut version);
                        held[w] = ok.or(held[w]);
                    }
                    2 => {
                        let next = state.finished();
                        if cas(held[w], next, &mut state, &mut version).is_some() {
                            done_seen = true;
                        }
                    }
                    3 => {
                        let next = state.released();
                        let _ = cas(held[w], next, &mut state, &mut version);
                    }
                    _ => {
                        let next = state.failed(1, 3);
                        let _ = cas(held[w], next, &mut state, &mut version);
                    }
                }
                // Only the worker holding the current version can have a live lease.
                let live: Vec<usize> = (0..4)
                    .filter(|&i| held[i] == Some(version) && state.phase_at(now) == Phase::Leased)
                    .collect();
                assert!(live.len() <= 1, "seed {seed}: two live leases {live:?}");
                if done_seen {
                    assert_eq!(state.phase, Phase::Done, "seed {seed}: done was undone");
                    assert!(
                        !state.claimable(u64::MAX, 3),
                        "seed {seed}: a done shard is claimable"
                    );
                }
            }
        }
    }
}
