//! The terminal rendering.

use std::fmt::Write as _;

use crate::{Report, duration, size};

impl Report {
    /// Plain-text tables for a terminal.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let t = &self.totals;
        let pct = |x: f64| {
            if t.wall > 0.0 {
                format!(" ({:.1}%)", x / t.wall * 100.0)
            } else {
                String::new()
            }
        };
        let _ = writeln!(
            o,
            "job {}: {} attempt(s), {} preemption(s), {} failure(s), {} crash(es); {}",
            self.job,
            t.attempts,
            t.preemptions,
            t.failures,
            t.crashes,
            if t.completed {
                "completed"
            } else {
                "not completed"
            }
        );
        let _ = writeln!(o);
        let rows: Vec<(&str, String)> = vec![
            ("wall time", duration(t.wall)),
            ("billable (estimate)", duration(t.billable)),
            (
                "useful work",
                format!("{}{}", duration(t.useful), pct(t.useful)),
            ),
            ("lost work", format!("{}{}", duration(t.lost), pct(t.lost))),
            (
                "restore",
                format!("{}{}", duration(t.restore), pct(t.restore)),
            ),
            (
                "final uploads",
                format!("{}{}", duration(t.final_upload), pct(t.final_upload)),
            ),
            (
                "background uploads",
                format!(
                    "{} (the command ran meanwhile)",
                    duration(t.background_upload)
                ),
            ),
            (
                "checkpoints",
                format!(
                    "{} committed, {} in all, {} each on average",
                    t.checkpoints,
                    size(t.checkpoint_bytes),
                    size(t.mean_checkpoint_bytes)
                ),
            ),
            (
                "cadence",
                t.cadence
                    .map_or("-".into(), |c| format!("one every {}", duration(c))),
            ),
            (
                "write time",
                t.write.map_or("not measured".into(), |w| {
                    format!("{} (median)", duration(w))
                }),
            ),
            (
                "notices made durable in time",
                format!("{} of {}", t.notices_durable_in_time, t.preemptions),
            ),
        ];
        for (k, v) in rows {
            let _ = writeln!(o, "  {k:<30} {v}");
        }
        if let Some(c) = &self.cost {
            let m = |x: f64| format!("{}{x:.2}", c.currency);
            let _ = writeln!(o, "\ncost");
            let _ = writeln!(o, "  {:<30} {}", "this job", m(c.total));
            let _ = writeln!(
                o,
                "  {:<30} {}",
                "same useful work on-demand",
                m(c.on_demand_equivalent)
            );
            let _ = writeln!(
                o,
                "  {:<30} {} ({:.0}%)",
                "saving",
                m(c.saving),
                c.saving_percent
            );
            let _ = writeln!(o, "  {:<30} {}", "of which lost work", m(c.lost));
            let _ = writeln!(
                o,
                "  {:<30} {}",
                "of which restore/upload/boot",
                m(c.overhead)
            );
        }
        let _ = writeln!(o, "\ncheckpoint interval (Young/Daly)");
        match (&self.advice, &self.advice_missing) {
            (Some(a), _) => {
                let _ = writeln!(
                    o,
                    "  C = {} ({}), M = {} ({})",
                    duration(a.checkpoint_cost),
                    a.checkpoint_cost_from,
                    duration(a.mtbp),
                    a.mtbp_from
                );
                let _ = writeln!(
                    o,
                    "  advised: one every {} (sqrt(2·C·M)), expected waste {:.1}%",
                    duration(a.interval),
                    a.waste_advised * 100.0
                );
                match (a.current_interval, a.waste_current) {
                    (Some(ci), Some(w)) => {
                        let _ = writeln!(
                            o,
                            "  current: one every {}, expected waste {:.1}%",
                            duration(ci),
                            w * 100.0
                        );
                    }
                    _ => {
                        let _ = writeln!(o, "  current: fewer than two checkpoints per attempt");
                    }
                }
            }
            (None, Some(why)) => {
                let _ = writeln!(o, "  none: {why}");
            }
            (None, None) => {}
        }
        let _ = writeln!(o, "\nattempts");
        let _ = writeln!(
            o,
            "  {:<20}  {:<10}  {:<18}  {:>8}  {:>8}  {:>8}  {:>5}  NOTICE",
            "STARTED", "OUTCOME", "MACHINE", "WALL", "RESTORE", "LOST", "CKPTS"
        );
        for r in &self.attempts {
            let notice = r.notice.as_ref().map_or(String::new(), |n| {
                format!(
                    "{}{}{}",
                    n.source,
                    n.warning
                        .map_or(String::new(), |w| format!(", {} warning", duration(w))),
                    match n.durable_in_time {
                        Some(true) => ", durable in time",
                        Some(false) => ", NOT durable in time",
                        None => "",
                    }
                )
            });
            let _ = writeln!(
                o,
                "  {:<20}  {:<10}  {:<18}  {:>8}  {:>8}  {:>8}  {:>5}  {}",
                short_time(&r.started),
                r.outcome_name(),
                r.machine(),
                duration(r.wall),
                duration(r.restore),
                duration(r.lost),
                r.checkpoints.len(),
                notice
            );
        }
        o
    }
}

/// `2026-01-01T00:00:00Z` whatever the fraction of a second recorded.
fn short_time(t: &str) -> String {
    match (t.get(..19), t.len() > 20) {
        (Some(head), true) => format!("{head}Z"),
        _ => t.to_owned(),
    }
}
