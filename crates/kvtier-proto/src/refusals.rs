//! Rate-limited, aggregated logging of refused connections and requests (issue 26 §3).
//!
//! A port anyone can reach must not let anyone fill the disk through its log: one script
//! hammering a data port with bad handshakes wrote about 28 GiB of log lines a day when every
//! refusal was logged. A [`RefusalLog`] logs the first refusal of a quiet period in full, then
//! folds every further one into counts by `(reason, source)` and writes one summary line per
//! interval while refusals keep coming. So a storm costs at most two lines per interval,
//! whatever its rate, and the counts stay exact ([`RefusalLog::totals`]; callers also count
//! each refusal in their metrics).
//!
//! Bounded memory: at most [`MAX_DISTINCT`] `(reason, source)` pairs are kept per interval;
//! the rest are counted together as "other sources". The summary of the last interval is
//! written by a short-lived flusher thread (at most one at a time), so it does not wait for
//! the next refusal.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Distinct `(reason, source)` pairs one interval keeps; more are counted as other sources.
pub const MAX_DISTINCT: usize = 64;
/// Pairs named in one summary line (the largest counts first); the rest are summed.
pub const MAX_NAMED: usize = 8;
/// The default interval between summary lines.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

/// Where lines go (the process log, `tracing`, unless a test or an embedding process says otherwise).
pub type Sink = Arc<dyn Fn(&str) + Send + Sync>;

#[derive(Default)]
struct Window {
    /// When the current aggregation window began (`None`: quiet, the next refusal is logged
    /// in full).
    started: Option<Instant>,
    counts: BTreeMap<(String, String), u64>,
    /// Refusals of pairs beyond [`MAX_DISTINCT`].
    other: u64,
    /// Whether a flusher thread is waiting for this window's end.
    flusher: bool,
}

/// Refusal totals by reason, and the log throttle.
pub struct RefusalLog {
    /// The line prefix, e.g. `"kvtier master"`.
    who: &'static str,
    /// What is refused, e.g. `"connection"`.
    what: &'static str,
    interval: Duration,
    sink: Sink,
    window: Mutex<Window>,
    totals: Mutex<BTreeMap<String, u64>>,
    lines: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for RefusalLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RefusalLog")
            .field("who", &self.who)
            .field("what", &self.what)
            .finish_non_exhaustive()
    }
}

fn log_sink() -> Sink {
    Arc::new(|line: &str| tracing::warn!("{line}"))
}

impl RefusalLog {
    /// A log writing to the process log (`tracing`) every [`DEFAULT_INTERVAL`].
    pub fn new(who: &'static str, what: &'static str) -> Arc<RefusalLog> {
        RefusalLog::with_sink(who, what, DEFAULT_INTERVAL, log_sink())
    }

    pub fn with_sink(
        who: &'static str,
        what: &'static str,
        interval: Duration,
        sink: Sink,
    ) -> Arc<RefusalLog> {
        Arc::new(RefusalLog {
            who,
            what,
            interval,
            sink,
            window: Mutex::new(Window::default()),
            totals: Mutex::new(BTreeMap::new()),
            lines: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn emit(&self, line: &str) {
        self.lines
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (self.sink)(line);
    }

    /// Lines written so far.
    pub fn lines(&self) -> u64 {
        self.lines.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Refusals so far, by reason.
    pub fn totals(&self) -> BTreeMap<String, u64> {
        self.totals.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Record one refusal of `source` (an address, `uid N`) for `reason` (a short fixed
    /// phrase); `detail` is written only when this refusal is logged in full.
    pub fn record(self: &Arc<Self>, reason: &str, source: &str, detail: &str) {
        if let Ok(mut totals) = self.totals.lock() {
            if let Some(n) = totals.get_mut(reason) {
                *n += 1;
            } else if totals.len() < MAX_DISTINCT {
                totals.insert(reason.to_string(), 1);
            } else {
                *totals.entry("other".to_string()).or_insert(0) += 1;
            }
        }
        let now = Instant::now();
        let Ok(mut window) = self.window.lock() else {
            return;
        };
        if window.started.is_some_and(|s| now >= s + self.interval) {
            self.summarize(&mut window, now);
        }
        match window.started {
            None => {
                window.started = Some(now);
                drop(window);
                let detail = if detail.is_empty() {
                    String::new()
                } else {
                    format!(": {detail}")
                };
                self.emit(&format!(
                    "{}: refused {} from {source} ({reason}){detail}; further refusals are \
                     summarized every {} s",
                    self.who,
                    self.what,
                    self.interval.as_secs_f64()
                ));
            }
            Some(_) => {
                let key = (reason.to_string(), source.to_string());
                if let Some(n) = window.counts.get_mut(&key) {
                    *n += 1;
                } else if window.counts.len() < MAX_DISTINCT {
                    window.counts.insert(key, 1);
                } else {
                    window.other += 1;
                }
                if !window.flusher {
                    window.flusher = true;
                    self.spawn_flusher();
                }
            }
        }
    }

    /// Write the summary of a window that has ended (and open the next one if it had
    /// refusals, so a continuing storm stays aggregated); a quiet window closes.
    fn summarize(&self, window: &mut Window, now: Instant) {
        let total: u64 = window.counts.values().sum::<u64>() + window.other;
        if total == 0 {
            window.started = None;
            return;
        }
        let mut pairs: Vec<_> = std::mem::take(&mut window.counts).into_iter().collect();
        pairs.sort_by_key(|p| std::cmp::Reverse(p.1));
        let mut named: Vec<String> = pairs
            .iter()
            .take(MAX_NAMED)
            .map(|((reason, source), n)| format!("{n} from {source} ({reason})"))
            .collect();
        let rest: u64 = pairs.iter().skip(MAX_NAMED).map(|(_, n)| n).sum::<u64>() + window.other;
        if rest > 0 {
            named.push(format!("{rest} from other sources"));
        }
        window.other = 0;
        let seconds = window
            .started
            .map_or(self.interval, |s| now.saturating_duration_since(s))
            .as_secs_f64();
        window.started = Some(now);
        self.emit(&format!(
            "{}: refused {total} more {}s in the last {seconds:.0} s: {}",
            self.who,
            self.what,
            named.join(", ")
        ));
    }

    /// Write the summary if the window has ended; the flusher calls it.
    pub fn flush(&self) {
        let now = Instant::now();
        if let Ok(mut window) = self.window.lock() {
            if window.started.is_some_and(|s| now >= s + self.interval) {
                self.summarize(&mut window, now);
            }
        }
    }

    fn spawn_flusher(self: &Arc<Self>) {
        let log = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("kvtier-refusal-log".into())
            .spawn(move || loop {
                let due = {
                    let Ok(window) = log.window.lock() else {
                        return;
                    };
                    window.started.map(|s| s + log.interval)
                };
                let Some(due) = due else { break };
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                let Ok(mut window) = log.window.lock() else {
                    return;
                };
                let now = Instant::now();
                if window.started.is_some_and(|s| now >= s + log.interval) {
                    let had = !window.counts.is_empty() || window.other > 0;
                    log.summarize(&mut window, now);
                    if !had {
                        // Quiet window: closed; the next refusal starts afresh.
                        window.flusher = false;
                        return;
                    }
                }
                if window.counts.is_empty() && window.other == 0 && window.started.is_none() {
                    window.flusher = false;
                    return;
                }
            });
        if spawned.is_err() {
            // No thread: the summary comes with the next refusal instead.
            if let Ok(mut window) = self.window.lock() {
                window.flusher = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex as StdMutex;

    fn collecting(interval: Duration) -> (Arc<RefusalLog>, Arc<StdMutex<Vec<String>>>) {
        let lines = Arc::new(StdMutex::new(Vec::new()));
        let sink_lines = Arc::clone(&lines);
        let log = RefusalLog::with_sink(
            "test",
            "connection",
            interval,
            Arc::new(move |l: &str| sink_lines.lock().unwrap().push(l.to_string())),
        );
        (log, lines)
    }

    #[test]
    fn a_storm_is_one_line_then_one_summary_per_interval() {
        let (log, lines) = collecting(Duration::from_millis(200));
        for i in 0..10_000u32 {
            let source = format!("10.0.0.{}", i % 300);
            log.record("wrong token", &source, "detail");
        }
        assert_eq!(
            lines.lock().unwrap().len(),
            1,
            "{:?}",
            lines.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(500));
        let got = lines.lock().unwrap().clone();
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[1].contains("refused 9999 more connections"), "{got:?}");
        assert!(got[1].contains("from other sources"), "{got:?}");
        assert_eq!(log.totals()["wrong token"], 10_000);
        // Quiet again: the next refusal is written in full.
        std::thread::sleep(Duration::from_millis(500));
        log.record("no hello", "10.0.0.1", "x");
        let got = lines.lock().unwrap().clone();
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(got[2].contains("no hello"), "{got:?}");
    }
}
