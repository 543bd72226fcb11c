//! Progress of long start-up steps in the log (issue 27): DRAM pre-fault, SSD index recovery,
//! fsck. A step logs an `info` line every [`EVERY`] while it runs and one when it ends, only if
//! it ran that long: a short step (the usual small arena, a checkpoint restore) logs nothing,
//! so the startup summary stays the first line of a normal start.

use std::time::{Duration, Instant};

/// Time between progress lines.
pub const EVERY: Duration = Duration::from_secs(2);

/// One step's progress: `what`, its total units (bytes, segments).
pub struct Progress {
    what: &'static str,
    total: u64,
    started: Instant,
    next: Instant,
    logged: bool,
}

impl Progress {
    pub fn new(what: &'static str, total: u64) -> Progress {
        let started = Instant::now();
        Progress {
            what,
            total,
            started,
            next: started + EVERY,
            logged: false,
        }
    }

    /// `done` of `total` units so far; logs when the last line is [`EVERY`] old.
    pub fn at(&mut self, done: u64) {
        let now = Instant::now();
        if now < self.next {
            return;
        }
        self.next = now + EVERY;
        self.logged = true;
        let percent = if self.total == 0 {
            100.0
        } else {
            done as f64 * 100.0 / self.total as f64
        };
        tracing::info!(
            "kvtier: {}: {percent:.0}% ({done} of {}) after {:.1} s",
            self.what,
            self.total,
            now.duration_since(self.started).as_secs_f64()
        );
    }

    /// The step ended; logs its time if it ran long enough to log progress.
    pub fn done(&self) {
        if self.logged {
            tracing::info!(
                "kvtier: {}: done in {:.1} s",
                self.what,
                self.started.elapsed().as_secs_f64()
            );
        }
    }
}
