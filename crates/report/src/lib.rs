//! `spotguard report`: what a job cost and what preemptions took, from its ledger of attempts.
//! Pure: attempts in, a [`Report`] out, rendered as a terminal table ([`Report::table`]), a
//! self-contained HTML page with a timeline ([`Report::html`]) or JSON (it is `Serialize`).

mod html;
mod prices;
mod table;

use std::time::SystemTime;

use serde::Serialize;
use spotguard_store::{Attempt, AttemptOutcome, parse_time};

pub use prices::{Price, Prices, PricesError};

/// Clouds bill at least this much of each machine (per-second billing with a 1-minute
/// minimum on AWS, GCP and Azure).
pub const MIN_BILLED_SECONDS: f64 = 60.0;

/// What the report needs besides the ledger.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub job: String,
    pub prices: Option<Prices>,
    pub currency: String,
    /// Mean time between preemptions, seconds, when given.
    pub mtbp: Option<f64>,
    /// Checkpoint cost, seconds, when given.
    pub checkpoint_cost: Option<f64>,
    /// Billed boot time per machine, seconds.
    pub boot: f64,
}

/// One attempt, as the report sees it.
#[derive(Clone, Debug, Serialize)]
pub struct AttemptRow {
    pub id: String,
    pub host: String,
    pub instance_type: Option<String>,
    pub zone: Option<String>,
    pub lifecycle: Option<String>,
    pub started: String,
    /// Seconds from the job's first start.
    pub start_offset: f64,
    pub outcome: AttemptOutcome,
    pub wall: f64,
    pub billable: f64,
    pub restore: f64,
    /// Work done that no checkpoint saved.
    pub lost: f64,
    /// After the command stopped: the final upload and commit.
    pub final_upload: f64,
    /// Wall less restore, lost work and the final upload.
    pub useful: f64,
    pub checkpoints: Vec<Tick>,
    pub notice: Option<NoticeRow>,
    pub idle: Vec<f64>,
    /// Spot (or on-demand, for an on-demand machine) cost of this attempt.
    pub cost: Option<f64>,
}

impl AttemptRow {
    /// `g5.xlarge (spot)`, else the host name.
    pub fn machine(&self) -> String {
        match (&self.instance_type, &self.lifecycle) {
            (Some(t), Some(l)) => format!("{t} ({l})"),
            (Some(t), None) => t.clone(),
            _ => self.host.clone(),
        }
    }

    pub fn outcome_name(&self) -> &'static str {
        match self.outcome {
            AttemptOutcome::Running => "running",
            AttemptOutcome::Completed => "completed",
            AttemptOutcome::Preempted => "preempted",
            AttemptOutcome::Failed => "failed",
            AttemptOutcome::Crashed => "crashed",
        }
    }
}

/// A checkpoint on the timeline.
#[derive(Clone, Debug, Serialize)]
pub struct Tick {
    pub name: String,
    /// Seconds from the attempt's start: taken (written), committed.
    pub taken: f64,
    pub committed: f64,
    pub bytes: u64,
    pub upload: f64,
    pub write: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct NoticeRow {
    pub source: String,
    /// Seconds from the attempt's start.
    pub at: f64,
    pub warning: Option<f64>,
    pub stop: Option<f64>,
    pub upload: Option<f64>,
    pub durable_in_time: Option<bool>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Totals {
    pub attempts: usize,
    pub preemptions: usize,
    pub failures: usize,
    pub crashes: usize,
    pub completed: bool,
    pub wall: f64,
    pub billable: f64,
    pub restore: f64,
    pub lost: f64,
    pub final_upload: f64,
    /// Background upload time (the command kept running meanwhile).
    pub background_upload: f64,
    pub useful: f64,
    pub checkpoints: usize,
    pub checkpoint_bytes: u64,
    pub mean_checkpoint_bytes: u64,
    /// Median time between checkpoints within an attempt.
    pub cadence: Option<f64>,
    /// Median time writing one took.
    pub write: Option<f64>,
    pub notices_durable_in_time: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct Cost {
    pub currency: String,
    /// What the job cost.
    pub total: f64,
    /// What the useful work would have cost on on-demand machines.
    pub on_demand_equivalent: f64,
    pub saving: f64,
    pub saving_percent: f64,
    /// Priced at what was paid: the lost work, and restore + final upload + boot.
    pub lost: f64,
    pub overhead: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Advice {
    /// C: seconds a checkpoint costs the command, and where that came from.
    pub checkpoint_cost: f64,
    pub checkpoint_cost_from: &'static str,
    /// M: mean time between preemptions, and where that came from.
    pub mtbp: f64,
    pub mtbp_from: &'static str,
    /// sqrt(2·C·M).
    pub interval: f64,
    pub current_interval: Option<f64>,
    /// Expected fraction of run time wasted (checkpointing + re-doing lost work).
    pub waste_current: Option<f64>,
    pub waste_advised: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub job: String,
    pub generated: String,
    pub attempts: Vec<AttemptRow>,
    pub totals: Totals,
    pub cost: Option<Cost>,
    pub advice: Option<Advice>,
    /// Why there is no advice, when there is none.
    pub advice_missing: Option<String>,
}

fn secs_between(from: SystemTime, to: SystemTime) -> f64 {
    to.duration_since(from).map_or(0.0, |d| d.as_secs_f64())
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Young/Daly: the expected fraction of time wasted at interval `t` with checkpoint cost `c`
/// and mean time between preemptions `m`: checkpointing (c/t) plus half an interval re-done
/// per preemption (t/2m).
pub fn waste(t: f64, c: f64, m: f64) -> f64 {
    c / t + t / (2.0 * m)
}

/// The report of `attempts` (oldest first), as of `now`.
pub fn build(attempts: &[Attempt], opts: &Options, now: SystemTime) -> Report {
    let origin = attempts
        .iter()
        .filter_map(|a| parse_time(&a.started))
        .min()
        .unwrap_or(now);
    let mut rows = Vec::new();
    let mut t = Totals {
        attempts: attempts.len(),
        ..Totals::default()
    };
    let mut cost_total = 0.0;
    let mut od_total = 0.0;
    let mut lost_cost = 0.0;
    let mut overhead_cost = 0.0;
    let mut priced = true;
    let mut intervals = Vec::new();
    let mut writes = Vec::new();
    for a in attempts {
        let Some(started) = parse_time(&a.started) else {
            continue;
        };
        let outcome = a.effective_outcome();
        let end = match &a.ended {
            Some(e) => parse_time(e).unwrap_or(started),
            None if outcome == AttemptOutcome::Running => now,
            None => parse_time(&a.updated).unwrap_or(started),
        };
        // The recorded wall time is exact; times in older records have whole seconds.
        let wall = match (&a.ended, a.wall_seconds) {
            (Some(_), Some(w)) => w,
            _ => secs_between(started, end),
        };
        let restore = a.restore_seconds.unwrap_or(0.0);
        let lost = match (outcome, a.time_lost_seconds) {
            (AttemptOutcome::Completed | AttemptOutcome::Running, _) => 0.0,
            (_, Some(l)) => l,
            // A crash recorded no end: lost since the newest checkpoint, up to the last sign
            // of life.
            (_, None) => a.lost_until(end),
        };
        let final_upload = a
            .final_upload_seconds
            .or(a.notice.as_ref().and_then(|n| n.upload_seconds))
            .unwrap_or(0.0);
        let useful = (wall - restore - lost - final_upload).max(0.0);
        let billable = (wall + opts.boot).max(MIN_BILLED_SECONDS);
        let checkpoints: Vec<Tick> = a
            .checkpoints
            .iter()
            .filter_map(|c| {
                let committed = parse_time(&c.committed)?;
                let taken = c.taken_at().unwrap_or(committed);
                Some(Tick {
                    name: c.name.clone(),
                    taken: secs_between(started, taken),
                    committed: secs_between(started, committed),
                    bytes: c.bytes,
                    upload: c.upload_seconds,
                    write: c.write_seconds,
                })
            })
            .collect();
        intervals.extend(checkpoints.windows(2).map(|w| w[1].taken - w[0].taken));
        writes.extend(checkpoints.iter().filter_map(|c| c.write));
        let notice = a.notice.as_ref().map(|n| NoticeRow {
            source: n.source.clone(),
            at: parse_time(&n.received).map_or(wall, |r| secs_between(started, r)),
            warning: n.warning_seconds,
            stop: n.stop_seconds,
            upload: n.upload_seconds,
            durable_in_time: n.durable_in_time,
        });
        let idle = a
            .idle
            .iter()
            .filter_map(|i| parse_time(&i.fired).map(|f| secs_between(started, f)))
            .collect();
        let price = opts
            .prices
            .as_ref()
            .and_then(|p| p.for_type(a.instance.instance_type.as_deref()));
        let cost = price.map(|p| {
            let on_demand_machine = a.instance.lifecycle.as_deref() == Some("on-demand");
            let rate = if on_demand_machine {
                p.on_demand
            } else {
                p.spot
            };
            let h = |s: f64| s / 3600.0;
            od_total += h(useful) * p.on_demand;
            lost_cost += h(lost) * rate;
            overhead_cost += h(restore + final_upload + opts.boot) * rate;
            h(billable) * rate
        });
        match cost {
            Some(c) => cost_total += c,
            None => priced = false,
        }
        match outcome {
            AttemptOutcome::Preempted => t.preemptions += 1,
            AttemptOutcome::Failed => t.failures += 1,
            AttemptOutcome::Crashed => t.crashes += 1,
            AttemptOutcome::Completed => t.completed = true,
            AttemptOutcome::Running => {}
        }
        t.wall += wall;
        t.billable += billable;
        t.restore += restore;
        t.lost += lost;
        t.final_upload += final_upload;
        t.useful += useful;
        t.background_upload += checkpoints.iter().map(|c| c.upload).sum::<f64>();
        t.checkpoints += checkpoints.len();
        t.checkpoint_bytes += checkpoints.iter().map(|c| c.bytes).sum::<u64>();
        t.notices_durable_in_time +=
            usize::from(notice.as_ref().and_then(|n| n.durable_in_time) == Some(true));
        rows.push(AttemptRow {
            id: a.id.clone(),
            host: a.instance.hostname.clone(),
            instance_type: a.instance.instance_type.clone(),
            zone: a.instance.zone.clone(),
            lifecycle: a.instance.lifecycle.clone(),
            started: a.started.clone(),
            start_offset: secs_between(origin, started),
            outcome,
            wall,
            billable,
            restore,
            lost,
            final_upload,
            useful,
            checkpoints,
            notice,
            idle,
            cost,
        });
    }
    if t.checkpoints > 0 {
        t.mean_checkpoint_bytes = t.checkpoint_bytes / t.checkpoints as u64;
    }
    t.cadence = median(intervals);
    t.write = median(writes);

    let cost = (priced && !rows.is_empty() && opts.prices.is_some()).then(|| Cost {
        currency: opts.currency.clone(),
        total: cost_total,
        on_demand_equivalent: od_total,
        saving: od_total - cost_total,
        saving_percent: if od_total > 0.0 {
            (od_total - cost_total) / od_total * 100.0
        } else {
            0.0
        },
        lost: lost_cost,
        overhead: overhead_cost,
    });

    let c = opts.checkpoint_cost.map(|c| (c, "given")).or_else(|| {
        t.write
            .filter(|w| *w > 0.0)
            .map(|w| (w, "measured write time"))
    });
    let m = opts
        .mtbp
        .map(|m| (m, "given"))
        .or_else(|| (t.preemptions > 0).then(|| (t.wall / t.preemptions as f64, "observed")));
    let (advice, advice_missing) = match (c, m) {
        (Some((c, cf)), Some((m, mf))) if c > 0.0 && m > 0.0 => {
            let interval = (2.0 * c * m).sqrt();
            (
                Some(Advice {
                    checkpoint_cost: c,
                    checkpoint_cost_from: cf,
                    mtbp: m,
                    mtbp_from: mf,
                    interval,
                    current_interval: t.cadence,
                    waste_current: t.cadence.filter(|x| *x > 0.0).map(|x| waste(x, c, m)),
                    waste_advised: waste(interval, c, m),
                }),
                None,
            )
        }
        (None, _) => (
            None,
            Some("no checkpoint write time was measured: give --checkpoint-cost".into()),
        ),
        _ => (
            None,
            Some("no preemption yet: give --mtbp (mean time between preemptions)".into()),
        ),
    };
    Report {
        job: opts.job.clone(),
        generated: humantime::format_rfc3339_seconds(now).to_string(),
        attempts: rows,
        totals: t,
        cost,
        advice,
        advice_missing,
    }
}

/// `1h02m`, `3m05s`, `42s`, `0.4s`.
pub fn duration(secs: f64) -> String {
    if secs < 10.0 {
        return format!("{secs:.1}s");
    }
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// `1.5 GiB`.
pub fn size(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_loses_the_work_since_its_newest_checkpoint_up_to_its_last_heartbeat() {
        // Heartbeat stopped at 400 s (an hour ago); the only checkpoint was taken at 100 s.
        let a: Attempt = serde_json::from_value(serde_json::json!({
            "format": 1, "id": "1", "instance": {"hostname": "h"},
            "started": "2026-01-01T00:00:00Z", "updated": "2026-01-01T00:06:40Z",
            "ended": null, "outcome": "running", "exit_status": null, "resumed_from": null,
            "last_committed": null, "notice": null, "time_lost_seconds": null,
            "checkpoints": [{"seq": 1, "name": "c", "committed": "2026-01-01T00:01:50Z",
                             "bytes": 1, "sent_bytes": 1, "upload_seconds": 10.0}],
        }))
        .expect("record");
        let now = humantime::parse_rfc3339("2026-01-01T01:00:00Z").expect("now");
        let r = build(&[a], &Options::default(), now);
        assert_eq!(r.totals.crashes, 1);
        assert!((r.attempts[0].wall - 400.0).abs() < 1e-9);
        assert!((r.totals.lost - 300.0).abs() < 1e-9, "{}", r.totals.lost);
        assert!(r.cost.is_none() && r.advice.is_none());
        assert!(r.advice_missing.is_some());
    }

    #[test]
    fn young_daly_minimises_the_waste() {
        let (c, m) = (30.0, 5050.0);
        let best = (2.0_f64 * c * m).sqrt();
        for t in [best * 0.5, best * 0.9, best * 1.1, best * 2.0] {
            assert!(waste(t, c, m) > waste(best, c, m));
        }
    }
}
