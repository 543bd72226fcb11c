//! The SSD tier: an append-only segment log below the DRAM arena.
//!
//! # Format
//! `ssd_storage_dir` holds `LOCK` (an exclusive `flock`: one engine per directory), the
//! segment files `seg-NNNNNN.kvt` (each exactly `ssd_segment_size_bytes`, at most
//! `ssd_capacity_bytes / ssd_segment_size_bytes` of them) and, after a clean `flush` or
//! close, `index.ckpt`. Block 0 of a segment is its header (id, size, *generation*, in-use
//! flag, CRC-32C); records follow back to back, each starting on a 4 KiB boundary and padded
//! to one, so every I/O is `O_DIRECT`-aligned. A record is a 64-byte header (magic, version,
//! flags, key length, prefix depth, payload length, sequence number, the segment generation
//! it was written in, payload offset, record length, payload CRC-32C, header CRC-32C over the
//! header and key), the key, and the payload; payloads of 16 KiB or more start on the
//! record's second block so a read can land straight in an aligned destination. The exact
//! byte layout is in `format.rs`. The index maps a key to (segment, generation, offset,
//! record length, payload offset, length). Padding is counted in `ssd_bytes_allocated`.
//!
//! # Write path and durability
//! Puts land in DRAM. With `write_through` every stored put is queued (bounded by
//! `ssd_copy_queue_depth`; a full queue makes the put wait) for `ssd_copy_worker_threads`
//! workers, each of which takes up to `ssd_copy_batch_max_ops` records (≤ 16 MiB), reserves
//! them contiguously in the active segment, copies the payloads from DRAM into one aligned
//! buffer, writes it with one `pwrite` and — in `strict` mode — one `fdatasync` per segment
//! touched (group commit). Only then is each record published in the SSD index; a record
//! whose object was removed from DRAM meanwhile is not published but overwritten with a dead
//! marker. With `write_back`, objects are copied (the same way, waited for) when DRAM evicts
//! them, then dropped from DRAM. `ssd_copy_async = false` makes a write-through put wait for
//! its copy; `strict` always does.
//!
//! What a crash can lose:
//! - **strict** (`write_through` only): a put that returned `Ok(Stored)` has its record on
//!   disk and `fdatasync`ed; it survives `kill -9` and power loss and reads back byte-exact
//!   after restart. A `remove` that returned has its dead marker synced: the object does not
//!   come back. A `clear` that returned has synced every segment header as free. A put that
//!   failed with `SsdWrite` was removed from DRAM too: it is neither served nor acknowledged.
//!   (A concurrent put of the same key that deduplicated against an in-flight strict put can
//!   see `AlreadyPresent` before that put is durable.)
//! - **relaxed**: records are written by the background workers and synced at least once a
//!   second (and by `flush` / close). `kill -9` of the process loses only the copies still
//!   queued (not yet written) — with `ssd_copy_async = false` none: a returned put is in
//!   the kernel (or on the device with `O_DIRECT`). Power loss or a kernel crash can
//!   additionally lose whatever was written in the last second before it, and a `remove` or
//!   `clear` from that second may be undone (the object comes back — intact, never wrong).
//! - In both modes a record is served only if its header and payload CRCs verify, its
//!   generation matches its segment and its key matches: a torn or corrupt record is a miss,
//!   never wrong bytes. DRAM contents are never persisted: after a restart everything is
//!   served from SSD.
//!
//! # Recovery
//! `Engine::open` locks the directory and reads every segment header. If `index.ckpt` exists,
//! verifies (CRC) and every segment it lists still carries the listed generation on disk —
//! and no unlisted segment is in use — the index is loaded from it without touching any
//! record. The checkpoint is deleted (directory synced) before the first SSD mutation after
//! it was written, so it never describes a state older than the segments. Otherwise every
//! in-use segment is scanned in 8 MiB reads on up to 4 threads (see `scan.rs`): records with
//! intact headers and payload CRCs of the segment's generation are kept, torn tails and
//! corrupt records are dropped and counted (warned once per segment), stale records of
//! older generations are ignored, and across segments the highest sequence number per key
//! wins. The figures are in [`RecoveryReport`] (`Engine::recovery_report`) and the stats;
//! [`crate::Engine::open_with_progress`] reports progress while it runs. Recovered segments
//! are sealed: new records go to free segments.
//!
//! # Reclaim
//! Space comes back one whole segment at a time. When a writer finds no free segment it
//! evicts one itself; in the background, when the share of segments in use reaches
//! `ssd_high_watermark` (rounded up), segments are evicted until it is at most
//! `ssd_low_watermark` (rounded down). The victim is a sealed segment with no write in
//! flight: an empty one if any (every object in it removed or superseded); otherwise, among
//! the coldest quarter of sealed segments by the last write or read of any of its objects,
//! with `prefix_depth` the one whose live objects have the greatest mean prefix depth (the
//! tails of chains go first, as in DRAM), with `lru` simply the coldest. Eviction drops the
//! segment's entries from the index, waits for its in-flight reads, bumps its generation and
//! writes a free header; the file is kept and reused (no first-touch cost of fresh space).
//! There is no compaction: a mostly-dead segment is simply the cheapest victim.
//!
//! # Faults
//! A failed write or sync sets `ssd_degraded` (cleared by the next successful one) and
//! counts `ssd_write_errors`; in strict mode the affected puts fail with `SsdWrite`, in relaxed
//! mode the copies are dropped (`ssd_copies_dropped`) and the objects stay in DRAM. A
//! segment file that cannot be created for lack of space (`ENOSPC`) caps the segment count
//! where it is (`ssd_enospc_errors`) and the tier carries on by recycling. Nothing panics.
//!
//! # I/O
//! Segment files are opened with `O_DIRECT` if a probe write in the directory succeeds,
//! else with buffered I/O and one warning (`ssd_direct_io = false` in the stats). New segment
//! files are pre-allocated with `fallocate`. Reads run on the caller's thread: a record is
//! read into a thread-local aligned bounce buffer, verified, and copied out; when the
//! destination is 4 KiB aligned and the payload is block-aligned in the record, one `preadv`
//! puts the payload straight into the destination (header and last partial block into the
//! bounce buffer) — on a failed verification the destination may then hold garbage, but the
//! read still reports a miss. The only `unsafe` code is the aligned buffer (`aligned.rs`) and
//! the `io_uring` submission (`uring.rs`).
//! `ssd_io_backend = "io_uring"` sends segment reads and writes through a per-thread ring
//! (`uring.rs`) instead of `preadv`/`pwritev`; `fdatasync` and `fallocate` stay syscalls.
//! Where the kernel refuses `io_uring` the tier falls back to posix with one warning.

mod aligned;
mod checkpoint;
mod format;
mod fsck;
mod io;
mod scan;
pub(crate) mod tier;
mod uring;

use std::time::Duration;

pub use fsck::{fsck, FsckReport, FsckSegment};
pub use scan::ScanCounts;

/// Progress of a warm restart, reported while `Engine::open_with_progress` runs.
#[derive(Clone, Debug, Default)]
pub struct RecoveryProgress {
    pub segments_done: u64,
    pub segments_total: u64,
    pub bytes_scanned: u64,
    /// Records recovered so far (from the checkpoint and the scan).
    pub records: u64,
    pub elapsed: Duration,
    /// The index came from a valid checkpoint.
    pub from_checkpoint: bool,
}

/// What the last warm restart did.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RecoveryReport {
    pub used_checkpoint: bool,
    pub objects_from_checkpoint: u64,
    pub segments_scanned: u64,
    /// What the scan of the segments the checkpoint did not vouch for found (`removed`: dead
    /// markers seen, i.e. removed objects); flattened into the JSON report.
    #[serde(flatten)]
    pub scan: ScanCounts,
    /// Objects in the index after recovery.
    pub objects: u64,
    pub elapsed: Duration,
}

impl RecoveryReport {
    /// Scan throughput in GB/s (0 if nothing was scanned).
    pub fn scan_gb_per_s(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if self.scan.bytes_scanned == 0 || s == 0.0 {
            0.0
        } else {
            self.scan.bytes_scanned as f64 / s / 1e9
        }
    }
}
