//! The self-contained HTML page: a timeline (one lane per attempt: restoring, running,
//! stopping and uploading after a notice; notices, preemptions and checkpoint ticks) drawn as
//! inline SVG, and the report's tables. No script, no external resource: it opens offline.

use std::fmt::Write as _;

use crate::{Report, duration, size};
use spotguard_store::AttemptOutcome;

const LANE: f64 = 34.0;
const LABEL: f64 = 220.0;
const WIDTH: f64 = 1100.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Report {
    /// The whole page.
    pub fn html(&self) -> String {
        let mut o = String::new();
        let _ = write!(
            o,
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <title>spotguard report: {job}</title><style>{CSS}</style></head><body>\
             <h1>spotguard report: {job}</h1><p class=\"sub\">generated {gen}</p>",
            job = esc(&self.job),
            gen = esc(&self.generated),
        );
        o.push_str("<h2>Timeline</h2>");
        o.push_str(&self.timeline_svg());
        o.push_str("<h2>Summary</h2><pre>");
        o.push_str(&esc(&self.table()));
        o.push_str("</pre>");
        o.push_str(&self.attempts_table());
        o.push_str("</body></html>\n");
        o
    }

    fn attempts_table(&self) -> String {
        let mut o = String::from(
            "<h2>Attempts</h2><table><tr><th>started</th><th>outcome</th><th>machine</th>\
             <th>zone</th><th>wall</th><th>restore</th><th>lost</th><th>final upload</th>\
             <th>checkpoints</th><th>notice</th></tr>",
        );
        for r in &self.attempts {
            let _ = write!(
                o,
                "<tr><td>{}</td><td class=\"{}\">{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                esc(&r.started),
                r.outcome_name(),
                r.outcome_name(),
                esc(&r.machine()),
                esc(r.zone.as_deref().unwrap_or("")),
                duration(r.wall),
                duration(r.restore),
                duration(r.lost),
                duration(r.final_upload),
                r.checkpoints.len(),
                esc(&r
                    .notice
                    .as_ref()
                    .map(|n| n.source.clone())
                    .unwrap_or_default()),
            );
        }
        o.push_str("</table>");
        o
    }

    /// The timeline chart as inline SVG.
    pub fn timeline_svg(&self) -> String {
        let span = self
            .attempts
            .iter()
            .map(|r| r.start_offset + r.wall)
            .fold(1.0_f64, f64::max);
        let plot = WIDTH - LABEL - 20.0;
        let x = |t: f64| LABEL + t / span * plot;
        let height = 40.0 + LANE * self.attempts.len() as f64 + 50.0;
        let mut o = String::new();
        let _ = write!(
            o,
            "<svg id=\"timeline\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" \
             height=\"{height}\" viewBox=\"0 0 {WIDTH} {height}\" role=\"img\" \
             aria-label=\"timeline of the job's attempts\">"
        );
        // Axis: five ticks.
        for i in 0..=5 {
            let t = span * f64::from(i) / 5.0;
            let _ = write!(
                o,
                "<line x1=\"{0:.1}\" y1=\"24\" x2=\"{0:.1}\" y2=\"{1:.1}\" class=\"grid\"/>\
                 <text x=\"{0:.1}\" y=\"16\" class=\"axis\">{2}</text>",
                x(t),
                height - 46.0,
                duration(t)
            );
        }
        for (i, r) in self.attempts.iter().enumerate() {
            let y = 30.0 + LANE * i as f64;
            let h = LANE - 12.0;
            let _ = write!(
                o,
                "<g class=\"lane\" data-outcome=\"{}\"><text x=\"4\" y=\"{:.1}\" class=\"label\">{}</text>",
                r.outcome_name(),
                y + h * 0.7,
                esc(&format!(
                    "#{} {} · {}",
                    i + 1,
                    r.machine(),
                    r.outcome_name()
                ))
            );
            let t0 = r.start_offset;
            let notice_at = r.notice.as_ref().map(|n| n.at);
            let stop_end = (r.wall - r.final_upload).max(r.restore);
            let mut seg = |from: f64, to: f64, class: &str, title: String| {
                if to > from {
                    let _ = write!(
                        o,
                        "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{h:.1}\" class=\"{class}\"><title>{}</title></rect>",
                        x(t0 + from),
                        (x(t0 + to) - x(t0 + from)).max(1.0),
                        esc(&title)
                    );
                }
            };
            seg(
                0.0,
                r.restore,
                "restoring",
                format!("restoring {}", duration(r.restore)),
            );
            let run_end = notice_at.unwrap_or(stop_end).min(stop_end).max(r.restore);
            seg(
                r.restore,
                run_end,
                "running",
                format!("running {}", duration(run_end - r.restore)),
            );
            if notice_at.is_some() {
                seg(
                    run_end,
                    stop_end,
                    "stopping",
                    format!("stopping {}", duration(stop_end - run_end)),
                );
            }
            seg(
                stop_end,
                r.wall,
                "uploading",
                format!("final upload {}", duration(r.wall - stop_end)),
            );
            // Lost work: from the newest checkpoint taken to where the work stopped.
            let lost_end = notice_at.unwrap_or(stop_end);
            seg(
                (lost_end - r.lost).max(r.restore),
                lost_end,
                "lost",
                format!("lost work {}", duration(r.lost)),
            );
            for c in &r.checkpoints {
                let _ = write!(
                    o,
                    "<line x1=\"{0:.1}\" y1=\"{1:.1}\" x2=\"{0:.1}\" y2=\"{2:.1}\" class=\"ckpt\"><title>{3}</title></line>",
                    x(t0 + c.taken),
                    y - 3.0,
                    y + h + 3.0,
                    esc(&format!(
                        "checkpoint {}: {}, upload {}",
                        c.name,
                        size(c.bytes),
                        duration(c.upload)
                    ))
                );
            }
            for idle in &r.idle {
                let _ = write!(
                    o,
                    "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"4\" class=\"idle\"><title>idle watchdog fired</title></circle>",
                    x(t0 + idle),
                    y + h / 2.0
                );
            }
            if let Some(n) = &r.notice {
                let nx = x(t0 + n.at);
                let _ = write!(
                    o,
                    "<path d=\"M{nx:.1},{:.1} l-5,-8 h10 z\" class=\"notice\"><title>{}</title></path>",
                    y - 1.0,
                    esc(&format!(
                        "notice from {}{}",
                        n.source,
                        n.warning
                            .map_or(String::new(), |w| format!(", {} warning", duration(w)))
                    ))
                );
            }
            if r.outcome == AttemptOutcome::Preempted || r.outcome == AttemptOutcome::Crashed {
                let ex = x(t0 + r.wall);
                let _ = write!(
                    o,
                    "<text x=\"{:.1}\" y=\"{:.1}\" class=\"preempted\">✕</text>",
                    ex + 2.0,
                    y + h * 0.75
                );
            }
            o.push_str("</g>");
        }
        // Legend.
        let ly = height - 22.0;
        let mut lx = LABEL;
        for (class, name) in [
            ("restoring", "restoring"),
            ("running", "running"),
            ("stopping", "stopping after a notice"),
            ("uploading", "final upload"),
            ("lost", "lost work"),
        ] {
            let _ = write!(
                o,
                "<rect x=\"{lx:.1}\" y=\"{:.1}\" width=\"14\" height=\"10\" class=\"{class}\"/>\
                 <text x=\"{:.1}\" y=\"{ly:.1}\" class=\"legend\">{name}</text>",
                ly - 9.0,
                lx + 18.0
            );
            lx += 30.0 + 7.0 * name.len() as f64;
        }
        let _ = write!(
            o,
            "<line x1=\"{lx:.1}\" y1=\"{:.1}\" x2=\"{lx:.1}\" y2=\"{:.1}\" class=\"ckpt\"/>\
             <text x=\"{:.1}\" y=\"{ly:.1}\" class=\"legend\">checkpoint</text>\
             <text x=\"{:.1}\" y=\"{ly:.1}\" class=\"legend\">▼ notice  ✕ preempted  ● idle</text>",
            ly - 10.0,
            ly + 2.0,
            lx + 6.0,
            lx + 90.0
        );
        o.push_str("</svg>");
        o
    }
}

const CSS: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}\
h1{font-size:20px;margin:0}.sub{color:#666;margin-top:2px}h2{font-size:16px;margin-top:24px}\
pre{background:#f6f6f6;padding:12px;overflow:auto}table{border-collapse:collapse}\
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}\
.preempted{fill:#c62828;color:#c62828;font-weight:bold}.failed,.crashed{color:#c62828}\
.completed{color:#2e7d32}.grid{stroke:#eee}.axis{font-size:11px;fill:#666;text-anchor:middle}\
.label{font-size:12px;fill:#333}.legend{font-size:11px;fill:#444}\
rect.running{fill:#4caf50}rect.restoring{fill:#42a5f5}rect.stopping{fill:#ffa726}\
rect.uploading{fill:#ab47bc}rect.lost{fill:#ef9a9a}.ckpt{stroke:#111;stroke-width:2}.notice{fill:#e53935}\
.idle{fill:#fdd835;stroke:#555}";
