//! The master's source of time (issue 29 §4): every decision of the directory, the leases,
//! re-replication, the election and the RPC handlers reads the time from a [`Clock`], never
//! from `Instant::now()` directly, so the deterministic simulation
//! (`tests/sim.rs`, see `docs/simulation.md`) drives the very same code under a simulated
//! clock it advances itself. The process uses [`SystemClock`].
//!
//! Owns: nothing but the time. [`ManualClock`] is the simulation's (and unit tests') clock:
//! it starts at an `Instant` taken once and moves only when told, so two runs of one seed see
//! the same durations everywhere.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Where the master reads the time.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The monotonic time now (leases, deadlines, fencing).
    fn now(&self) -> Instant;
    /// Wall-clock nanoseconds since the Unix epoch (only where ids must not repeat across
    /// processes: the first claim id of a directory).
    fn unix_nanos(&self) -> u64;
}

/// The real clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn unix_nanos(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX / 2))
    }
}

/// A clock that moves only when [`advance_to`](ManualClock::advance_to) says (never back).
#[derive(Debug)]
pub struct ManualClock {
    base: Instant,
    /// Nanoseconds since `base`.
    offset: AtomicU64,
}

/// The wall time a [`ManualClock`] reports at its start (2026-01-01T00:00:00Z): fixed, so
/// claim ids repeat exactly between runs of one seed.
const MANUAL_UNIX_BASE_NS: u64 = 1_767_225_600_000_000_000;

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl ManualClock {
    pub fn new() -> ManualClock {
        ManualClock {
            base: Instant::now(),
            offset: AtomicU64::new(0),
        }
    }

    /// Time since the clock started.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.offset.load(Ordering::Acquire))
    }

    /// The instant `at` after the start.
    pub fn at(&self, at: Duration) -> Instant {
        self.base + at
    }

    /// Move to `at` after the start; a time earlier than now is ignored (time never goes back).
    pub fn advance_to(&self, at: Duration) {
        let ns = u64::try_from(at.as_nanos()).unwrap_or(u64::MAX);
        self.offset.fetch_max(ns, Ordering::AcqRel);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + self.elapsed()
    }
    fn unix_nanos(&self) -> u64 {
        MANUAL_UNIX_BASE_NS + self.offset.load(Ordering::Acquire)
    }
}
