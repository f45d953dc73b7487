//! `spotguard report`: reads the job's ledger and prints (or writes) the report.

use tracing::error;

use spotguard_report::{Options, Price, Prices};

use crate::cli::ReportArgs;
use crate::{exit_code, store_or_exit};

pub(crate) async fn report(args: ReportArgs) -> u8 {
    let prices = match (&args.prices, args.price, args.on_demand_price) {
        (Some(path), _, _) => match Prices::from_file(path) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("spotguard: error: {e}");
                return exit_code::USAGE;
            }
        },
        (None, Some(spot), Some(on_demand)) if spot >= 0.0 && on_demand >= 0.0 => {
            Some(Prices::Flat(Price { spot, on_demand }))
        }
        (None, None, None) => None,
        (None, Some(_), Some(_)) => {
            eprintln!("spotguard: error: --price and --on-demand-price must be >= 0");
            return exit_code::USAGE;
        }
        (None, _, _) => {
            eprintln!("spotguard: error: --price and --on-demand-price go together");
            return exit_code::USAGE;
        }
    };
    let store = match store_or_exit(&args.store).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let job = store.job(&args.store.job);
    let attempts = match job.attempts().await {
        Ok(a) => a,
        Err(e) => {
            error!("{e}");
            return exit_code::SETUP_FAILED;
        }
    };
    if attempts.is_empty() {
        eprintln!(
            "spotguard: error: job {} in {} has no attempts recorded",
            args.store.job,
            store.url()
        );
        return exit_code::NOTHING_TO_RESUME;
    }
    let opts = Options {
        job: args.store.job.clone(),
        prices,
        currency: args.currency.clone(),
        mtbp: args.mtbp.map(|d| d.as_secs_f64()),
        checkpoint_cost: args.checkpoint_cost.map(|d| d.as_secs_f64()),
        boot: args.boot.as_secs_f64(),
    };
    let report = spotguard_report::build(&attempts, &opts, std::time::SystemTime::now());
    if let Some(path) = &args.html
        && let Err(e) = std::fs::write(path, report.html())
    {
        eprintln!("spotguard: error: cannot write {}: {e}", path.display());
        return exit_code::SETUP_FAILED;
    }
    if args.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&report).expect("reports serialize")
        );
    } else {
        outln!("{}", report.table().trim_end());
    }
    0
}
