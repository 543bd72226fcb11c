//! Engine counters. Owns the atomics every operation bumps and the [`EngineStats`] snapshot.
//!
//! All counters are relaxed atomics: they are monitoring figures, never used to decide
//! correctness, so the hot path takes no lock and no fence for them. A snapshot taken while
//! operations run is therefore approximate (each counter is exact, their sum at one instant is
//! not); at quiescence `objects`/`bytes_used` equal what the index holds.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A point-in-time copy of the engine's counters.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct EngineStats {
    /// Objects visible in the index.
    pub objects: u64,
    /// Logical bytes of the visible objects.
    pub bytes_used: u64,
    /// Blocks in use × block size (includes objects unlinked but still pinned by a reader).
    pub bytes_allocated: u64,
    /// Arena size (whole blocks).
    pub capacity_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    /// Puts that stored a new object.
    pub puts: u64,
    /// Puts whose key was already present (no copy made).
    pub dedup_skips: u64,
    /// Puts that failed (empty key, too large, no space).
    pub put_failures: u64,
    /// Objects evicted to make room.
    pub evictions_capacity: u64,
    /// Objects dropped by `remove` or `clear`.
    pub evictions_removed: u64,
    /// Superseded window-state objects dropped to make room while their page stayed
    /// (see `Engine::demote`).
    pub evictions_superseded: u64,
    /// Logical bytes of the objects evicted to make room.
    pub evicted_bytes: u64,
    /// Bytes copied in by stored puts.
    pub bytes_in: u64,
    /// Bytes copied out by reads.
    pub bytes_out: u64,
    /// Reads refused because the destination length differed from the stored length.
    pub size_mismatches: u64,

    // ---- SSD tier (all zero / false when it is off) ----
    pub ssd_enabled: bool,
    /// Segment files are opened with `O_DIRECT` (false: buffered fallback, warned once).
    pub ssd_direct_io: bool,
    /// Segment I/O goes through `io_uring` (`ssd_io_backend = "io_uring"` and the kernel
    /// allows it; false: `preadv`/`pwritev`).
    pub ssd_io_uring: bool,
    /// The most recent SSD write or sync failed (cleared by the next successful one).
    pub ssd_degraded: bool,
    /// Objects indexed on SSD (some may also be in DRAM).
    pub ssd_objects: u64,
    /// Logical bytes of the objects on SSD.
    pub ssd_bytes_used: u64,
    /// Record bytes (header, key, payload, 4 KiB padding) of the objects on SSD.
    pub ssd_bytes_allocated: u64,
    pub ssd_capacity_bytes: u64,
    pub ssd_segments_total: u64,
    /// Segments holding records (active or sealed).
    pub ssd_segments_in_use: u64,
    /// Gets served from SSD (DRAM misses that hit SSD; also counted in `hits`).
    pub ssd_hits: u64,
    pub ssd_read_bytes: u64,
    /// Records written to SSD.
    pub ssd_writes: u64,
    pub ssd_write_bytes: u64,
    /// Write batches (one or more records per write call).
    pub ssd_write_batches: u64,
    /// `fdatasync` calls.
    pub ssd_syncs: u64,
    /// SSD reads whose record failed verification (served as a miss).
    pub ssd_checksum_failures: u64,
    pub ssd_read_errors: u64,
    pub ssd_write_errors: u64,
    /// Segment files that could not be created for lack of space.
    pub ssd_enospc_errors: u64,
    /// Copies to SSD that were not made (write error, no space, too large in relaxed mode).
    pub ssd_copies_dropped: u64,
    /// Copies queued or being written right now.
    pub ssd_copy_queue_depth: u64,
    /// Age of the oldest copy still waiting in the queue, in seconds (0 when it is empty): how
    /// far the SSD copy pipeline lags behind the puts.
    pub ssd_copy_lag_seconds: f64,
    /// Puts that waited for room in the copy queue.
    pub ssd_queue_full_waits: u64,
    /// Objects copied back into DRAM by reads.
    pub ssd_promotions: u64,
    /// Objects removed from SSD by `remove` / `clear`.
    pub ssd_removed: u64,
    pub ssd_evicted_segments: u64,
    pub ssd_evicted_objects: u64,
    /// What the last open recovered, and what it dropped.
    pub ssd_recovered_objects: u64,
    pub ssd_recovery_torn: u64,
    pub ssd_recovery_corrupt: u64,
    pub ssd_recovery_stale: u64,
}

/// The live counters; shared by the engine and its pinned objects.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub objects: AtomicU64,
    pub bytes_used: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub puts: AtomicU64,
    pub dedup_skips: AtomicU64,
    pub put_failures: AtomicU64,
    pub evictions_capacity: AtomicU64,
    pub evictions_removed: AtomicU64,
    pub evictions_superseded: AtomicU64,
    pub evicted_bytes: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub size_mismatches: AtomicU64,
}

/// `counter += n`, relaxed.
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Relaxed);
}

/// `counter -= n`, relaxed.
pub(crate) fn sub(counter: &AtomicU64, n: u64) {
    counter.fetch_sub(n, Relaxed);
}

impl Counters {
    /// Snapshot every counter; the allocator-derived fields are filled by the engine.
    pub fn snapshot(&self) -> EngineStats {
        let g = |c: &AtomicU64| c.load(Relaxed);
        EngineStats {
            objects: g(&self.objects),
            bytes_used: g(&self.bytes_used),
            bytes_allocated: 0,
            capacity_bytes: 0,
            hits: g(&self.hits),
            misses: g(&self.misses),
            puts: g(&self.puts),
            dedup_skips: g(&self.dedup_skips),
            put_failures: g(&self.put_failures),
            evictions_capacity: g(&self.evictions_capacity),
            evictions_removed: g(&self.evictions_removed),
            evictions_superseded: g(&self.evictions_superseded),
            evicted_bytes: g(&self.evicted_bytes),
            bytes_in: g(&self.bytes_in),
            bytes_out: g(&self.bytes_out),
            size_mismatches: g(&self.size_mismatches),
            ..EngineStats::default()
        }
    }
}
