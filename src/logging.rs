//! spotguard's own log lines, on stderr beside the command's output: each starts with
//! `[spotguard`, is written with one `write(2)` so it never splits mid-line, and carries no
//! secrets (metadata tokens and credentials are never passed to `tracing`).

use std::fmt;
use std::io::IsTerminal;

use clap::ValueEnum;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One readable line per event.
    Human,
    /// One JSON object per line, for log shippers.
    Json,
}

/// `verbosity`: 0 is info; each `-v` adds a level, each `-q` removes one.
pub fn init(format: LogFormat, verbosity: i8) {
    let level = match verbosity {
        i8::MIN..=-2 => "error",
        -1 => "warn",
        0 => "info",
        1 => "debug",
        2..=i8::MAX => "trace",
    };
    // Our crates at the chosen level; libraries (hyper, reqwest) only when they warn.
    let directives = std::env::var("SPOTGUARD_LOG").unwrap_or_else(|_| {
        format!(
            "warn,spotguard={level},spotguard_notice={level},spotguard_session={level},spotguard_supervise={level}"
        )
    });
    let filter = EnvFilter::try_new(&directives).unwrap_or_else(|_| EnvFilter::new("info"));
    let color = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(color && format == LogFormat::Human)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Human => builder.event_format(Human { color }).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// `[spotguard 2026-11-29T17:45:01Z WARN] message key=value`
struct Human {
    color: bool,
}

impl<S, N> FormatEvent<S, N> for Human
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now());
        let level = *event.metadata().level();
        let (name, color) = match level {
            Level::ERROR => ("ERROR", "31"),
            Level::WARN => ("WARN", "33"),
            Level::INFO => ("INFO", "32"),
            Level::DEBUG => ("DEBUG", "34"),
            Level::TRACE => ("TRACE", "35"),
        };
        if self.color {
            write!(
                writer,
                "\x1b[2m[spotguard {now}\x1b[0m \x1b[{color}m{name}\x1b[0m\x1b[2m]\x1b[0m "
            )?;
        } else {
            write!(writer, "[spotguard {now} {name}] ")?;
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}
