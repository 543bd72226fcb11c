//! Logging of the `kvtier` binary (issue 27): the one place every subcommand installs its
//! `tracing` subscriber.
//!
//! Owns: the choice of format (text or JSON, `--log-format` or `KVTIER_LOG_FORMAT`), the filter
//! (`RUST_LOG`, default `info`) and the writer (stderr, so stdout stays the command's output:
//! `kvtier stat --json`, `fsck --json`). Without it every `tracing` record the engine, the
//! client and the server emit (torn or corrupt SSD records, a stale checkpoint, I/O fallbacks,
//! "SSD tier degraded", cluster failures) would be thrown away.
//!
//! Text lines carry an RFC 3339 UTC timestamp, the level and the target (the module that
//! logged, e.g. `kvtier_engine::ssd::tier::recovery`); JSON lines are one object per record
//! (`timestamp`, `level`, `target`, `fields.message` and the record's other fields).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How records are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per record: timestamp, level, target, message, fields.
    Text,
    /// One JSON object per line (for journald / log shippers).
    Json,
}

/// The environment variable that chooses the format when `--log-format` is not given.
pub const FORMAT_ENV: &str = "KVTIER_LOG_FORMAT";

/// What is logged when `RUST_LOG` is unset or empty.
pub const DEFAULT_FILTER: &str = "info";

/// Errors of [`init`]: a `RUST_LOG` or `KVTIER_LOG_FORMAT` that cannot be understood.
#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    #[error("RUST_LOG={value:?} is not a valid filter: {reason}")]
    Filter { value: String, reason: String },
    #[error("{FORMAT_ENV}={0:?}: expected \"text\" or \"json\"")]
    Format(String),
    #[error("cannot install the log subscriber: {0}")]
    Install(String),
}

/// The format: the flag, else `KVTIER_LOG_FORMAT`, else text.
fn resolve_format(flag: Option<LogFormat>) -> Result<LogFormat, LoggingError> {
    if let Some(f) = flag {
        return Ok(f);
    }
    match std::env::var_os(FORMAT_ENV) {
        None => Ok(LogFormat::Text),
        Some(v) => match v.to_str().map(str::trim) {
            Some("") | Some("text") => Ok(LogFormat::Text),
            Some("json") => Ok(LogFormat::Json),
            _ => Err(LoggingError::Format(v.to_string_lossy().into_owned())),
        },
    }
}

/// The filter: `RUST_LOG` when set and not empty (an invalid one is an error naming it, not a
/// silent fallback), else [`DEFAULT_FILTER`].
fn resolve_filter() -> Result<EnvFilter, LoggingError> {
    match std::env::var_os("RUST_LOG") {
        Some(v) if !v.is_empty() => {
            let value = v.to_string_lossy().into_owned();
            EnvFilter::builder()
                .parse(&value)
                .map_err(|e| LoggingError::Filter {
                    value,
                    reason: e.to_string(),
                })
        }
        _ => Ok(EnvFilter::new(DEFAULT_FILTER)),
    }
}

/// Install the process's subscriber (once, at the start of `main`).
pub fn init(flag: Option<LogFormat>) -> Result<(), LoggingError> {
    let format = resolve_format(flag)?;
    let filter = resolve_filter()?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(true);
    let installed = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .with_current_span(false)
            .with_span_list(false)
            .try_init(),
    };
    installed.map_err(|e| LoggingError::Install(e.to_string()))
}
