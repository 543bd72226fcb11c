//! The SSD tier proper: its index, the segment table, the copy pipeline, reads, removal,
//! reclaim, flush and recovery. See the module docs of `ssd` for the design.
//!
//! Locks and their order (a thread holding one may only take those to its right):
//! `mutation` (read_recursive for every SSD mutation, write for `clear` and checkpoints) →
//! DRAM index shard → SSD index shard → segment table → slot generation lock.
//! Readers take an SSD shard (released at once) and then the slot generation lock (read) for
//! the duration of the `pread`; nothing waits while holding a slot generation lock except
//! for I/O, so recycling a segment waits only for in-flight reads of that segment.
//!
//! Split by the state each part owns (issue 16; issue 28 grouped `Shared` the same way):
//! this file holds [`SsdTier`], the `Shared` state with the groups that span parts
//! (`Settings`, the checkpoint's validity, the stop signal) and the calls that span parts
//! (submit, remove, clear, flush, stats); `index` the key -> record map; `segments` the
//! segment files, generations and table (`Segments`) and space reservation; `pipeline` the
//! copy queue (`CopyQueue`) and batch writes; `read` the read path and its bounce buffers;
//! `reclaim` segment eviction, its victim policy (`SegmentVictimPolicy`) and the background
//! thread; `recovery` opening the tier and rebuilding the index; `invariants` checks the
//! invariants the others state (tests only).

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::io::{self, IoSliceMut};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};

use super::aligned::{is_aligned, AlignedBuf, ALIGN};
use super::checkpoint::{self, Checkpoint, CkptEntry};
use super::format::{
    encode_dead, encode_head, finish_record, payload_crc, verify_record, verify_split, HeadFields,
    RecordLayout, RecordLoc, SegmentHeader, FIRST_RECORD,
};
use super::io::{self as sio, Faults, SegFile};
use super::scan::{scan_segment, ScannedRecord};
use super::uring;
use super::{RecoveryProgress, RecoveryReport};
use crate::config::{EngineConfig, EvictionPolicyKind, SsdDurabilityMode, SsdIoBackend};
use crate::error::EngineError;
use crate::eviction::events::TierGroups;
use crate::index::Index;
use crate::object::Object;
use crate::stats::EngineStats;

// Split by the state each part owns (issue 16): see each file's module doc.
mod index;
mod invariants;
mod pipeline;
mod read;
mod reclaim;
mod recovery;
mod segments;

use index::*;
use pipeline::*;
pub(crate) use pipeline::{CopyError, Ticket};
use reclaim::*;
use segments::*;

/// Cap on the bytes one worker batches into one write.
const BATCH_MAX_BYTES: usize = 16 << 20;
/// Relaxed mode syncs dirty segments at least this often.
const RELAXED_SYNC_EVERY: Duration = Duration::from_secs(1);
/// Thread-local bounce buffers above this size are not kept between reads.
const KEEP_BOUNCE_MAX: usize = 64 << 20;

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
    batches: AtomicU64,
    syncs: AtomicU64,
    checksum_failures: AtomicU64,
    read_errors: AtomicU64,
    write_errors: AtomicU64,
    enospc: AtomicU64,
    dropped: AtomicU64,
    queue_full_waits: AtomicU64,
    removed: AtomicU64,
    evicted_segments: AtomicU64,
    evicted_objects: AtomicU64,
    objects: AtomicU64,
    bytes_used: AtomicU64,
    bytes_allocated: AtomicU64,
}

fn inc(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Relaxed);
}
fn dec(c: &AtomicU64, n: u64) {
    c.fetch_sub(n, Relaxed);
}

/// The state the tier's threads share, grouped by the part that owns it (each group's type
/// lives in that part's file); what stays here spans parts: the indexes, the sequence and
/// access clocks, the mutation lock, counters and the recovery report.
struct Shared {
    /// Fixed at open.
    settings: Settings,
    /// `segments`: the segment files, their generations and the segment table.
    segments: Segments,
    /// `pipeline`: the copy queue.
    copies: CopyQueue,
    /// `reclaim`: which sealed segment to evict.
    victim: Box<dyn SegmentVictimPolicy>,
    /// Whether the index checkpoint on disk is current, and the lock that writes or deletes it.
    checkpoint: CheckpointState,
    /// Tells the background threads to stop.
    stop: StopSignal,
    index: SsdIndex,
    dram_index: Arc<Index>,
    /// Per-group counts of the index, for the engine's `SsdStored` / `SsdRemoved` events
    /// (off unless [`SsdTier::enable_group_events`] ran).
    groups: TierGroups,
    /// Sequence numbers: record and segment generations (monotonic across restarts).
    seq: AtomicU64,
    /// The access clock segments' `last_access` is read from.
    tick: AtomicU64,
    mutation: RwLock<()>,
    faults: Arc<Faults>,
    c: Counters,
    /// A write or sync failed and none has succeeded since.
    degraded: AtomicBool,
    recovery: RecoveryReport,
    /// The directory lock, held for the tier's life.
    _lock: std::fs::File,
}

/// What the tier was opened with: geometry, durability, I/O and reclaim settings.
struct Settings {
    dir: PathBuf,
    seg_size: u64,
    nseg: u32,
    strict: bool,
    direct: bool,
    /// The backend segment files use (`posix` when `io_uring` was asked for but refused).
    io_backend: SsdIoBackend,
    /// Reclaim watermarks, as fractions of the segments.
    high: f64,
    low: f64,
    batch_max_ops: usize,
    queue_depth: usize,
}

/// The index checkpoint's validity: deleted before the first mutation that would make it
/// stale, written by `flush`.
struct CheckpointState {
    valid: AtomicBool,
    lock: Mutex<()>,
}

/// Set once at shutdown; the background thread waits on it between rounds.
struct StopSignal {
    flag: Mutex<bool>,
    changed: Condvar,
}

/// The SSD tier of one engine.
pub(crate) struct SsdTier {
    sh: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// Result of an SSD read.
pub(crate) enum SsdRead {
    Hit {
        depth: Option<u32>,
    },
    Miss,
    SizeMismatch {
        stored: u64,
    },
    /// The record failed verification or could not be read: a miss, counted.
    Failed,
}

impl Drop for SsdTier {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Shared {
    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Relaxed)
    }

    fn file(&self, seg: u32) -> Option<&SegFile> {
        self.segments.files[seg as usize].get()
    }

    /// Largest payload one record can carry.
    fn max_payload(&self) -> u64 {
        self.settings.seg_size - FIRST_RECORD - ALIGN as u64
    }

    fn note_write_result<T>(&self, r: &io::Result<T>) {
        match r {
            Ok(_) => self.degraded.store(false, Relaxed),
            Err(e) => {
                inc(&self.c.write_errors, 1);
                if !self.degraded.swap(true, Relaxed) {
                    tracing::warn!(dir = %self.settings.dir.display(), error = %e, "kvtier SSD tier degraded: write failed");
                }
            }
        }
    }

    /// Publish `key`'s record in its (locked) index shard and count it in its group.
    fn insert_indexed(
        &self,
        shard: &mut Shard,
        key: &Arc<[u8]>,
        entry: SsdEntry,
        depth: Option<u32>,
    ) {
        shard.insert(Arc::clone(key), entry);
        self.groups.added(key, depth);
    }

    /// Delete the checkpoint before the first mutation that would make it stale.
    fn invalidate_checkpoint(&self) {
        if !self.checkpoint.valid.load(Relaxed) {
            return;
        }
        let _g = self.checkpoint.lock.lock();
        if self.checkpoint.valid.load(Relaxed) {
            if let Err(e) = checkpoint::remove(&self.settings.dir) {
                tracing::warn!(error = %e, "kvtier: cannot delete the SSD index checkpoint");
            }
            self.checkpoint.valid.store(false, Relaxed);
        }
    }
}

impl SsdTier {
    pub(crate) fn recovery_report(&self) -> &RecoveryReport {
        &self.sh.recovery
    }

    pub(crate) fn contains(&self, key: &[u8]) -> bool {
        self.sh.index.shard(key).read().contains_key(key)
    }

    /// Up to `limit` keys starting with `prefix` and their lengths, in no particular order,
    /// and whether more matched (`kvtier inspect --prefix`; a full walk of the index).
    pub(crate) fn keys_with_prefix(
        &self,
        prefix: &[u8],
        limit: usize,
    ) -> (Vec<(Vec<u8>, u64)>, bool) {
        let mut out = Vec::new();
        for shard in self.sh.index.shards.iter() {
            for (key, e) in shard.read().iter() {
                if key.starts_with(prefix) {
                    if out.len() == limit {
                        return (out, true);
                    }
                    out.push((key.to_vec(), e.loc.payload_len));
                }
            }
        }
        (out, false)
    }

    pub(crate) fn len_of(&self, key: &[u8]) -> Option<u64> {
        self.sh.index.get(key).map(|e| e.loc.payload_len)
    }

    pub(crate) fn max_payload(&self) -> u64 {
        self.sh.max_payload()
    }

    /// Queue a copy of `object` (now visible in DRAM under `key`); with `wait`, block until
    /// it is written (and, in strict mode, synced). A full queue blocks either way.
    pub(crate) fn submit(
        &self,
        key: &[u8],
        object: Arc<Object>,
        wait: bool,
    ) -> Option<Arc<Ticket>> {
        let ticket = wait.then(Ticket::new);
        let job = Job {
            key: Arc::from(key),
            object,
            ticket: ticket.clone(),
            queued: Instant::now(),
        };
        let mut q = self.sh.copies.queue.lock();
        if q.jobs.len() >= self.sh.settings.queue_depth {
            inc(&self.sh.c.queue_full_waits, 1);
            while q.jobs.len() >= self.sh.settings.queue_depth && !q.closed {
                self.sh.copies.changed.wait(&mut q);
            }
        }
        if q.closed {
            drop(q);
            Shared::complete(job, Err(CopyError::NoSpace));
            return ticket;
        }
        q.jobs.push_back(job);
        drop(q);
        self.sh.copies.changed.notify_all();
        ticket
    }

    pub(crate) fn pending(&self) -> usize {
        let q = self.sh.copies.queue.lock();
        q.jobs.len() + q.running
    }

    pub(crate) fn wait_progress(&self) {
        self.sh.wait_progress();
    }

    /// Remove `key` from SSD: unlink it and overwrite its record header with a dead marker
    /// (synced in strict mode). Returns whether it was on SSD.
    pub(crate) fn remove(&self, key: &[u8]) -> bool {
        let sh = &self.sh;
        let _m = sh.mutation.read_recursive();
        let Some(e) = ({
            let mut shard = sh.index.shard(key).write();
            let e = shard.remove(key);
            if e.is_some() {
                sh.groups.removed(key);
            }
            e
        }) else {
            return false;
        };
        sh.unaccount(&e);
        inc(&sh.c.removed, 1);
        sh.invalidate_checkpoint();
        sh.write_dead(e.seg, e.generation, e.loc.offset, e.loc.rec_len);
        true
    }

    /// Start the per-group events (see [`TierGroups`]), seeded with what the index holds:
    /// every mutation waits meanwhile, so no change is counted twice or missed.
    pub(crate) fn enable_group_events(&self) {
        let sh = &self.sh;
        let _m = sh.mutation.write();
        let guards: Vec<_> = sh.index.shards.iter().map(|s| s.read()).collect();
        sh.groups
            .enable(guards.iter().flat_map(|g| g.keys().map(|k| &**k)));
    }

    /// The page groups the SSD index holds now, as the media events count them (empty while
    /// they are off).
    pub(crate) fn held_groups(&self) -> Vec<std::sync::Arc<[u8]>> {
        self.sh.groups.groups()
    }

    /// Remove everything: every segment in use is marked free on disk (new generation). The
    /// engine's one `Cleared` event is recorded here, with the index emptied and every
    /// mutation held off ([`TierGroups::reset_cleared`](crate::eviction::events::TierGroups::reset_cleared)).
    pub(crate) fn clear(&self) {
        let sh = &self.sh;
        let _m = sh.mutation.write();
        sh.invalidate_checkpoint();
        let mut n = 0;
        for shard in sh.index.shards.iter() {
            let mut s = shard.write();
            n += s.len() as u64;
            s.clear();
        }
        sh.groups.reset_cleared();
        let mut t = sh.segments.table.lock();
        let mut touched = Vec::new();
        for (i, m) in t.slots.iter_mut().enumerate() {
            if matches!(m.state, SegState::Active | SegState::Sealed) {
                let new_gen = sh.next_seq();
                let mut g = sh.segments.slot_gens[i].write();
                let _ = sh.write_seg_header(i as u32, new_gen, false);
                *g = new_gen;
                *m = SegMeta::new(SegState::Free);
                m.generation = new_gen;
                touched.push(i as u32);
            }
        }
        t.active = None;
        drop(t);
        if sh.settings.strict {
            for seg in touched {
                if let Some(f) = sh.file(seg) {
                    let r = f.sync();
                    inc(&sh.c.syncs, 1);
                    sh.note_write_result(&r);
                }
            }
        }
        inc(&sh.c.removed, n);
        sh.c.objects.store(0, Relaxed);
        sh.c.bytes_used.store(0, Relaxed);
        sh.c.bytes_allocated.store(0, Relaxed);
    }

    /// Drain the copy queue, sync every segment, write the index checkpoint.
    pub(crate) fn flush(&self) -> Result<(), EngineError> {
        let sh = &self.sh;
        sh.wait_idle();
        let _m = sh.mutation.write();
        sh.sync_dirty().map_err(EngineError::SsdWrite)?;
        let mut c = Checkpoint {
            segment_size: sh.settings.seg_size,
            next_seq: sh.seq.load(Relaxed),
            ..Checkpoint::default()
        };
        {
            let t = sh.segments.table.lock();
            for (i, m) in t.slots.iter().enumerate() {
                if matches!(
                    m.state,
                    SegState::Active | SegState::Sealed | SegState::Evicting
                ) {
                    c.segments.push((i as u32, m.generation, m.write_off));
                }
            }
        }
        for shard in sh.index.shards.iter() {
            for (k, e) in shard.read().iter() {
                c.entries.push(CkptEntry {
                    key: Arc::clone(k),
                    seg: e.seg,
                    loc: e.loc,
                });
            }
        }
        let _g = sh.checkpoint.lock.lock();
        checkpoint::write(&sh.settings.dir, &c).map_err(EngineError::SsdWrite)?;
        sh.checkpoint.valid.store(true, Relaxed);
        Ok(())
    }

    /// Stop the worker threads after they drained the queue (idempotent).
    pub(crate) fn shutdown(&self) {
        {
            let mut q = self.sh.copies.queue.lock();
            q.closed = true;
        }
        self.sh.copies.changed.notify_all();
        *self.sh.stop.flag.lock() = true;
        self.sh.stop.changed.notify_all();
        for h in self.threads.lock().drain(..) {
            let _ = h.join();
        }
    }

    pub(crate) fn fill_stats(&self, s: &mut EngineStats) {
        let sh = &self.sh;
        let g = |c: &AtomicU64| c.load(Relaxed);
        s.ssd_enabled = true;
        s.ssd_direct_io = sh.settings.direct;
        s.ssd_io_uring = sh.settings.io_backend == SsdIoBackend::IoUring;
        s.ssd_degraded = sh.degraded.load(Relaxed);
        s.ssd_objects = g(&sh.c.objects);
        s.ssd_bytes_used = g(&sh.c.bytes_used);
        s.ssd_bytes_allocated = g(&sh.c.bytes_allocated);
        s.ssd_capacity_bytes = u64::from(sh.settings.nseg) * sh.settings.seg_size;
        s.ssd_segments_total = u64::from(sh.settings.nseg);
        s.ssd_segments_in_use = sh.segments.table.lock().in_use();
        s.ssd_hits = g(&sh.c.hits);
        s.ssd_read_bytes = g(&sh.c.read_bytes);
        s.ssd_writes = g(&sh.c.writes);
        s.ssd_write_bytes = g(&sh.c.write_bytes);
        s.ssd_write_batches = g(&sh.c.batches);
        s.ssd_syncs = g(&sh.c.syncs);
        s.ssd_checksum_failures = g(&sh.c.checksum_failures);
        s.ssd_read_errors = g(&sh.c.read_errors);
        s.ssd_write_errors = g(&sh.c.write_errors);
        s.ssd_enospc_errors = g(&sh.c.enospc);
        s.ssd_copies_dropped = g(&sh.c.dropped);
        s.ssd_copy_queue_depth = self.pending() as u64;
        s.ssd_copy_lag_seconds = sh
            .copies
            .queue
            .lock()
            .jobs
            .front()
            .map_or(0.0, |j| j.queued.elapsed().as_secs_f64());
        s.ssd_queue_full_waits = g(&sh.c.queue_full_waits);
        s.ssd_removed = g(&sh.c.removed);
        s.ssd_evicted_segments = g(&sh.c.evicted_segments);
        s.ssd_evicted_objects = g(&sh.c.evicted_objects);
        let r = &sh.recovery;
        s.ssd_recovered_objects = r.objects;
        s.ssd_recovery_torn = r.scan.torn;
        s.ssd_recovery_corrupt = r.scan.corrupt;
        s.ssd_recovery_stale = r.scan.stale;
    }

    /// Test hook: make the next `writes` SSD writes and `syncs` syncs fail with EIO
    /// (`u64::MAX`: until reset with 0).
    pub(crate) fn inject_faults(&self, writes: u64, syncs: u64) {
        self.sh.faults.write_errors.store(writes, Relaxed);
        self.sh.faults.sync_errors.store(syncs, Relaxed);
    }
}
