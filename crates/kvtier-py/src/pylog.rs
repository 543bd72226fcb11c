//! Rust `tracing` records into Python's `logging` (issue 27).
//!
//! Owns: the process's `tracing` subscriber when kvtier runs inside Python (SGLang, vLLM,
//! LMCache, an embedded `Store`), the bounded queue between the threads that log and the one
//! thread that hands records to Python, the level gate, and the count of records dropped.
//!
//! Why a queue and a thread: records come from threads that may never have held the GIL (SSD
//! writers, the cluster runtime, UCX progress) and from threads that hold it (a `Store` call
//! made before it released the GIL). Taking the GIL on the logging thread could deadlock with
//! a thread that holds the GIL and waits on it, and would stall an I/O thread behind Python;
//! so a record is formatted where it is emitted and offered to a bounded queue with
//! `try_send` (never blocking; a full queue drops the record and counts it), and the
//! `kvtier-pylog` thread drains the queue, taking the GIL briefly per batch.
//!
//! Logger names: `kvtier.<target>` with the crate prefix `kvtier_` dropped and `::` as `.`
//! (`kvtier_engine::ssd::tier::recovery` logs as `kvtier.engine.ssd.tier.recovery`); records
//! of other crates (`tonic`, `h2`) log under `kvtier.<their target>`. So
//! `logging.getLogger("kvtier")` configures them all.
//!
//! The level gate: a record below the effective level of the `kvtier` logger is dropped at
//! the call site for the cost of one atomic load (no formatting, no queue); the gate is read
//! from Python at import, when a `Store` is created and about once a second by the drain
//! thread. `RUST_LOG`, when set, filters as well (e.g. `RUST_LOG=error` silences warnings).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::RwLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::{EnvFilter, Layer};

/// Records waiting for the drain thread at most; more are dropped (and counted).
const QUEUE_RECORDS: usize = 4096;
/// Records handed to Python per GIL acquisition at most (keeps each hold short).
const BATCH_RECORDS: usize = 256;
/// How often the drain thread re-reads the `kvtier` logger's level while idle.
const GATE_REFRESH: Duration = Duration::from_secs(1);

/// Python's numeric level of the lowest record that passes (`logging.WARNING` until read).
static GATE: AtomicU8 = AtomicU8::new(30);
static DROPPED: AtomicU64 = AtomicU64::new(0);
static QUEUED: AtomicU64 = AtomicU64::new(0);
static HANDLED: AtomicU64 = AtomicU64::new(0);
/// The queue of this process. A process forked after import (vLLM's and SGLang's workers)
/// has the parent's sender but no drain thread: the first record it logs starts its own
/// (`pid` tells). Writers use `try_write` only, so a lock held across a fork cannot hang a
/// child; such a record is dropped and counted instead.
static CHANNEL: RwLock<Option<Channel>> = RwLock::new(None);

struct Channel {
    pid: u32,
    sender: SyncSender<Record>,
}

/// A new queue and its drain thread for this process (`None`: no thread could start).
fn start_channel() -> Option<Channel> {
    let (sender, receiver) = sync_channel(QUEUE_RECORDS);
    std::thread::Builder::new()
        .name("kvtier-pylog".into())
        .spawn(move || drain(receiver))
        .ok()?;
    Some(Channel {
        pid: std::process::id(),
        sender,
    })
}

/// Queue `record` for Python; false when it had to be dropped.
fn offer(record: Record) -> bool {
    let pid = std::process::id();
    let record = {
        let guard = CHANNEL.read().unwrap_or_else(|e| e.into_inner());
        match guard.as_ref() {
            Some(c) if c.pid == pid => return c.sender.try_send(record).is_ok(),
            Some(_) => record,
            None => return false,
        }
    };
    // Forked: this process needs its own drain thread.
    let Ok(mut guard) = CHANNEL.try_write() else {
        return false;
    };
    if guard.as_ref().is_none_or(|c| c.pid != pid) {
        *guard = start_channel();
    }
    guard
        .as_ref()
        .is_some_and(|c| c.sender.try_send(record).is_ok())
}

/// Python's level number for a tracing level.
fn py_level(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        Level::TRACE => 5,
    }
}

/// One record, formatted on the thread that emitted it.
struct Record {
    level: u8,
    target: &'static str,
    file: Option<&'static str>,
    line: Option<u32>,
    message: String,
    created: f64,
    thread: String,
}

/// `message key=value key=value`, like the text format of `kvtier serve`.
#[derive(Default)]
struct Message {
    message: String,
    fields: String,
}

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

/// The layer that queues records for Python.
struct PyLogLayer;

impl<S: Subscriber> Layer<S> for PyLogLayer {
    fn register_callsite(
        &self,
        _meta: &'static Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        // The gate moves with Python's configuration: ask `enabled` each time.
        tracing::subscriber::Interest::sometimes()
    }

    fn enabled(&self, meta: &Metadata<'_>, _ctx: Context<'_, S>) -> bool {
        py_level(meta.level()) >= GATE.load(Ordering::Relaxed)
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut text = Message::default();
        event.record(&mut text);
        text.message.push_str(&text.fields);
        let record = Record {
            level: py_level(meta.level()),
            target: meta.target(),
            file: meta.file(),
            line: meta.line(),
            message: text.message,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            thread: std::thread::current()
                .name()
                .unwrap_or("rust-thread")
                .to_string(),
        };
        if offer(record) {
            QUEUED.fetch_add(1, Ordering::Release);
        } else {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// `kvtier.<target>`: see the module docs.
fn logger_name(target: &str) -> String {
    let target = target.strip_prefix("kvtier_").unwrap_or(target);
    let target = target.strip_prefix("kvtier").unwrap_or(target);
    let target = target.replace("::", ".");
    let target = target.trim_matches('.');
    if target.is_empty() {
        "kvtier".to_string()
    } else {
        format!("kvtier.{target}")
    }
}

/// Read the effective level of the `kvtier` logger into the gate (GIL held).
fn refresh_gate(py: Python<'_>) -> PyResult<()> {
    let level: i64 = py
        .import("logging")?
        .call_method1("getLogger", ("kvtier",))?
        .call_method0("getEffectiveLevel")?
        .extract()?;
    // NOTSET (0) on an unconfigured root is impossible (root defaults to WARNING); clamp to
    // the levels tracing can produce.
    GATE.store(
        u8::try_from(level.clamp(1, 50)).unwrap_or(30),
        Ordering::Relaxed,
    );
    Ok(())
}

/// Hand one record to its logger (GIL held).
fn emit(py: Python<'_>, logging: &Bound<'_, PyAny>, record: &Record) -> PyResult<()> {
    let name = logger_name(record.target);
    let logger = logging.call_method1("getLogger", (name.as_str(),))?;
    if !logger
        .call_method1("isEnabledFor", (record.level,))?
        .extract::<bool>()?
    {
        return Ok(());
    }
    let rec = logger.call_method1(
        "makeRecord",
        (
            name.as_str(),
            record.level,
            record.file.unwrap_or("(rust)"),
            record.line.unwrap_or(0),
            record.message.as_str(),
            pyo3::types::PyTuple::empty(py),
            py.None(),
        ),
    )?;
    rec.setattr("created", record.created)?;
    rec.setattr("msecs", (record.created.fract() * 1000.0).floor())?;
    rec.setattr("threadName", record.thread.as_str())?;
    rec.setattr("rust_target", record.target)?;
    logger.call_method1("handle", (rec,))?;
    Ok(())
}

/// The drain thread: batches from the queue, each handed over under one short GIL hold.
fn drain(receiver: Receiver<Record>) {
    let mut last_refresh = Instant::now();
    loop {
        let first = match receiver.recv_timeout(GATE_REFRESH) {
            Ok(r) => Some(r),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let mut batch: Vec<Record> = first.into_iter().collect();
        while batch.len() < BATCH_RECORDS {
            match receiver.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => break,
            }
        }
        if batch.is_empty() && last_refresh.elapsed() < GATE_REFRESH {
            continue;
        }
        let count = batch.len() as u64;
        // `try_attach`: never during interpreter shutdown (the records are dropped then).
        let attached = Python::try_attach(|py| {
            if last_refresh.elapsed() >= GATE_REFRESH || batch.is_empty() {
                let _ = refresh_gate(py);
                last_refresh = Instant::now();
            }
            if let Ok(logging) = py.import("logging") {
                for record in &batch {
                    // A handler that raises is Python's to report (`handleError`); a record
                    // that cannot even be built is dropped rather than stopping the thread.
                    if emit(py, logging.as_any(), record).is_err() {
                        DROPPED.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
        if attached.is_none() {
            DROPPED.fetch_add(count, Ordering::Relaxed);
        }
        HANDLED.fetch_add(count, Ordering::Release);
    }
}

/// Install the subscriber and start the drain thread (at module import; idempotent). If the
/// process already has a global subscriber (another extension installed one), it keeps it.
pub fn install(py: Python<'_>) {
    {
        let mut guard = CHANNEL.write().unwrap_or_else(|e| e.into_inner());
        if guard.is_some() {
            return;
        }
        *guard = start_channel();
        if guard.is_none() {
            return;
        }
    }
    let _ = refresh_gate(py);
    // RUST_LOG narrows what reaches Python; an invalid value is ignored (Python's levels
    // still apply) rather than failing the import of the engine's module.
    let filter = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .and_then(|v| EnvFilter::builder().parse(v).ok());
    let subscriber = tracing_subscriber::registry().with(filter).with(PyLogLayer);
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// Re-read the `kvtier` logger's level now (e.g. after `logging.basicConfig`); also done
/// about once a second by the drain thread and whenever a `Store` is created.
#[pyfunction]
pub fn refresh_log_level(py: Python<'_>) -> PyResult<()> {
    refresh_gate(py)
}

/// Wait (GIL released) until every record queued so far has been handed to Python, or
/// `timeout_s` passed; returns whether it got there.
#[pyfunction]
#[pyo3(signature = (timeout_s = 2.0))]
pub fn flush_logs(py: Python<'_>, timeout_s: f64) -> bool {
    let target = QUEUED.load(Ordering::Acquire);
    let deadline = Instant::now() + Duration::from_secs_f64(timeout_s.clamp(0.0, 60.0));
    py.detach(|| {
        while HANDLED.load(Ordering::Acquire) < target {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    })
}

/// Records dropped since import: the queue was full (a burst faster than Python's handlers),
/// the interpreter was shutting down, or a record could not be built.
#[pyfunction]
pub fn log_records_dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logger_names_sit_under_kvtier() {
        assert_eq!(
            logger_name("kvtier_engine::ssd::tier::recovery"),
            "kvtier.engine.ssd.tier.recovery"
        );
        assert_eq!(logger_name("kvtier"), "kvtier");
        assert_eq!(logger_name("h2::codec"), "kvtier.h2.codec");
    }
}
