//! Prices per instance-hour: one pair for every machine, or a small file by instance type.

use std::path::Path;

/// Spot and on-demand price per instance-hour.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Price {
    pub spot: f64,
    pub on_demand: f64,
}

#[derive(Clone, Debug)]
pub enum Prices {
    /// The same for every attempt.
    Flat(Price),
    /// By instance type; `*` matches any.
    ByType(Vec<(String, Price)>),
}

#[derive(Debug, thiserror::Error)]
pub enum PricesError {
    #[error("cannot read prices file {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("prices file {path} line {line}: {reason}")]
    Line {
        path: String,
        line: usize,
        reason: String,
    },
}

impl Prices {
    /// Reads `INSTANCE_TYPE SPOT_PER_HOUR ON_DEMAND_PER_HOUR` lines (`#` starts a comment).
    pub fn from_file(path: &Path) -> Result<Prices, PricesError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| PricesError::Read {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        let mut out = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |reason: String| PricesError::Line {
                path: shown.clone(),
                line: i + 1,
                reason,
            };
            let f: Vec<&str> = line.split_whitespace().collect();
            let [ty, spot, od] = f[..] else {
                return Err(bad(format!(
                    "expected `TYPE SPOT ON_DEMAND`, got {} field(s)",
                    f.len()
                )));
            };
            let num = |v: &str, what: &str| {
                v.parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| bad(format!("{what} price {v:?} is not a number >= 0")))
            };
            out.push((
                ty.to_owned(),
                Price {
                    spot: num(spot, "spot")?,
                    on_demand: num(od, "on-demand")?,
                },
            ));
        }
        if out.is_empty() {
            return Err(PricesError::Read {
                path: shown,
                reason: "it lists no prices".into(),
            });
        }
        Ok(Prices::ByType(out))
    }

    /// The price for an attempt on `instance_type` (unknown: only `*` or a flat price).
    pub fn for_type(&self, instance_type: Option<&str>) -> Option<Price> {
        match self {
            Prices::Flat(p) => Some(*p),
            Prices::ByType(list) => list
                .iter()
                .find(|(t, _)| Some(t.as_str()) == instance_type)
                .or_else(|| list.iter().find(|(t, _)| t == "*"))
                .map(|(_, p)| *p),
        }
    }
}
