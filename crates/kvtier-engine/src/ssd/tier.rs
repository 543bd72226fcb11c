//! The SSD tier proper: its index, the segment table, the copy pipeline, reads, removal,
//! reclaim, flush and recovery. See the module docs of `ssd` for the design.
//!
//! Locks and their order (a thread holding one may only take those to its right):
//! `mutation` (read_recursive for every SSD mutation, write for `clear` and checkpoints) →
//! DRAM index shard → SSD index shard → segment table → slot generation lock.
//! Readers take an SSD shard (released at once) and then the slot generation lock (read) for
//! the duration of the `pread`; nothing waits while holding a slot generation lock except
//! for I/O, so recycling a segment waits only for in-flight reads of that segment.

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
    RecordLayout, SegmentHeader, FIRST_RECORD,
};
use super::io::{self as sio, Faults, SegFile};
use super::scan::{scan_segment, ScannedRecord};
use super::uring;
use super::{RecoveryProgress, RecoveryReport};
use crate::config::{EngineConfig, EvictionPolicyKind, SsdDurabilityMode, SsdIoBackend};
use crate::error::EngineError;
use crate::index::Index;
use crate::object::Object;
use crate::stats::EngineStats;

/// Cap on the bytes one worker batches into one write.
const BATCH_MAX_BYTES: usize = 16 << 20;
/// Relaxed mode syncs dirty segments at least this often.
const RELAXED_SYNC_EVERY: Duration = Duration::from_secs(1);
/// Thread-local bounce buffers above this size are not kept between reads.
const KEEP_BOUNCE_MAX: usize = 64 << 20;

/// Where one object's record lives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SsdEntry {
    pub seg: u32,
    pub generation: u64,
    pub offset: u64,
    pub rec_len: u64,
    pub payload_offset: u32,
    pub len: u64,
    pub seq: u64,
    pub depth: Option<u32>,
}

/// How one record goes to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RecordShape {
    /// A one-block head from the buffer, the payload's whole 4 KiB blocks straight from the
    /// DRAM extents, then (when the payload ends mid-block) a zero-padded tail block from the
    /// buffer. Requires the aligned layout and 4 KiB aligned DRAM extents.
    InPlace { tail: usize },
    /// The whole record (`rec_len` bytes) serialized into the buffer.
    Buffered { rec_len: usize },
}

impl RecordShape {
    fn of(object: &Object, layout: RecordLayout) -> RecordShape {
        let buffered = RecordShape::Buffered {
            rec_len: layout.rec_len as usize,
        };
        if layout.payload_offset as usize != ALIGN || object.len() == 0 {
            return buffered;
        }
        let mut slices = object.slices().peekable();
        while let Some(s) = slices.next() {
            let last = slices.peek().is_none();
            if !is_aligned(s.as_ptr() as usize) || (!last && s.len() % ALIGN != 0) {
                return buffered;
            }
        }
        RecordShape::InPlace {
            tail: (object.len() % ALIGN as u64) as usize,
        }
    }

    /// Bytes this record takes in the batch buffer.
    fn buffered_len(&self) -> usize {
        match *self {
            RecordShape::InPlace { tail } => ALIGN + if tail > 0 { ALIGN } else { 0 },
            RecordShape::Buffered { rec_len } => rec_len,
        }
    }

    /// The record's bytes in file order: `mine` is its part of the batch buffer.
    fn pieces<'a>(self, object: &'a Object, mine: &'a [u8]) -> Vec<&'a [u8]> {
        match self {
            RecordShape::Buffered { .. } => vec![mine],
            RecordShape::InPlace { tail } => {
                let mut v = Vec::with_capacity(4);
                v.push(&mine[..ALIGN]);
                let mut slices = object.slices().peekable();
                while let Some(s) = slices.next() {
                    let whole = if slices.peek().is_none() {
                        s.len() - tail
                    } else {
                        s.len()
                    };
                    if whole > 0 {
                        v.push(&s[..whole]);
                    }
                }
                if tail > 0 {
                    v.push(&mine[ALIGN..]);
                }
                v
            }
        }
    }
}

type Hasher = foldhash::fast::RandomState;
type Shard = HashMap<Arc<[u8]>, SsdEntry, Hasher>;

struct SsdIndex {
    shards: Box<[RwLock<Shard>]>,
    mask: usize,
    hasher: Hasher,
}

impl SsdIndex {
    fn new(shards: usize) -> SsdIndex {
        let hasher = Hasher::default();
        SsdIndex {
            shards: (0..shards)
                .map(|_| RwLock::new(HashMap::with_hasher(hasher.clone())))
                .collect(),
            mask: shards - 1,
            hasher,
        }
    }
    fn shard(&self, key: &[u8]) -> &RwLock<Shard> {
        let h = self.hasher.hash_one(key);
        &self.shards[((h >> 32) as usize) & self.mask]
    }
    fn get(&self, key: &[u8]) -> Option<SsdEntry> {
        self.shard(key).read().get(key).copied()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SegState {
    /// No file yet.
    Missing,
    /// File exists; holds nothing live; may be activated.
    Free,
    /// Receiving appends.
    Active,
    /// Full; read-only until evicted.
    Sealed,
    /// Being evicted.
    Evicting,
}

struct SegMeta {
    state: SegState,
    generation: u64,
    write_off: u64,
    /// Reserved records not yet published or abandoned.
    inflight: u32,
    live_objects: u64,
    live_bytes: u64,
    depth_sum: u64,
    last_access: u64,
    /// Keys published into this segment (some may since have been removed).
    keys: Vec<Arc<[u8]>>,
    dirty: bool,
}

impl SegMeta {
    fn new(state: SegState) -> SegMeta {
        SegMeta {
            state,
            generation: 0,
            write_off: FIRST_RECORD,
            inflight: 0,
            live_objects: 0,
            live_bytes: 0,
            depth_sum: 0,
            last_access: 0,
            keys: Vec::new(),
            dirty: false,
        }
    }
}

struct SegTable {
    slots: Vec<SegMeta>,
    active: Option<u32>,
    /// Slots at or beyond this id are never created (lowered when the disk is full).
    max_segments: u32,
}

impl SegTable {
    fn in_use(&self) -> u64 {
        self.slots
            .iter()
            .filter(|m| {
                matches!(
                    m.state,
                    SegState::Active | SegState::Sealed | SegState::Evicting
                )
            })
            .count() as u64
    }
}

/// Outcome of one copy.
#[derive(Debug)]
pub(crate) enum CopyError {
    Io(io::Error),
    TooLarge,
    NoSpace,
}

impl CopyError {
    pub(crate) fn into_engine(self, len: u64, max: u64) -> EngineError {
        match self {
            CopyError::Io(e) => EngineError::SsdWrite(e),
            CopyError::TooLarge => EngineError::ObjectTooLarge { len, capacity: max },
            CopyError::NoSpace => EngineError::SsdWrite(io::Error::new(
                io::ErrorKind::StorageFull,
                "no SSD segment can be reclaimed",
            )),
        }
    }
}

/// Completion of a copy a caller waits for.
pub(crate) struct Ticket {
    done: Mutex<Option<Result<(), CopyError>>>,
    cv: Condvar,
}

impl Ticket {
    fn new() -> Arc<Ticket> {
        Arc::new(Ticket {
            done: Mutex::new(None),
            cv: Condvar::new(),
        })
    }
    fn complete(&self, r: Result<(), CopyError>) {
        *self.done.lock() = Some(r);
        self.cv.notify_all();
    }
    pub(crate) fn wait(&self) -> Result<(), CopyError> {
        let mut g = self.done.lock();
        loop {
            if let Some(r) = g.take() {
                return r;
            }
            self.cv.wait(&mut g);
        }
    }
}

struct Job {
    key: Arc<[u8]>,
    object: Arc<Object>,
    ticket: Option<Arc<Ticket>>,
    /// When it was queued (the copy lag in the stats is the age of the oldest job).
    queued: Instant,
}

struct QueueInner {
    jobs: VecDeque<Job>,
    /// Popped by a worker and not finished yet.
    running: usize,
    /// Batches finished so far (progress marker for waiters).
    finished: u64,
    closed: bool,
}

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

struct Shared {
    dir: PathBuf,
    seg_size: u64,
    nseg: u32,
    strict: bool,
    direct: bool,
    /// The backend segment files use (`posix` when `io_uring` was asked for but refused).
    io_backend: SsdIoBackend,
    policy: EvictionPolicyKind,
    high: f64,
    low: f64,
    batch_max_ops: usize,
    queue_depth: usize,
    files: Vec<OnceLock<SegFile>>,
    slot_gens: Vec<RwLock<u64>>,
    table: Mutex<SegTable>,
    table_cv: Condvar,
    index: SsdIndex,
    dram_index: Arc<Index>,
    queue: Mutex<QueueInner>,
    queue_cv: Condvar,
    seq: AtomicU64,
    tick: AtomicU64,
    mutation: RwLock<()>,
    ckpt_valid: AtomicBool,
    ckpt_lock: Mutex<()>,
    faults: Arc<Faults>,
    c: Counters,
    degraded: AtomicBool,
    shutdown: Mutex<bool>,
    shutdown_cv: Condvar,
    recovery: RecoveryReport,
    _lock: std::fs::File,
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

thread_local! {
    static BOUNCE: std::cell::RefCell<AlignedBuf> = const { std::cell::RefCell::new(AlignedBuf::new()) };
}

fn with_bounce<R>(len: usize, f: impl FnOnce(&mut AlignedBuf) -> R) -> R {
    if len > KEEP_BOUNCE_MAX {
        let mut b = AlignedBuf::zeroed(len);
        return f(&mut b);
    }
    BOUNCE.with(|b| {
        let mut b = b.borrow_mut();
        b.resize(len);
        f(&mut b)
    })
}

impl Shared {
    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Relaxed)
    }

    fn file(&self, seg: u32) -> Option<&SegFile> {
        self.files[seg as usize].get()
    }

    /// Largest payload one record can carry.
    fn max_payload(&self) -> u64 {
        self.seg_size - FIRST_RECORD - ALIGN as u64
    }

    fn note_write_result<T>(&self, r: &io::Result<T>) {
        match r {
            Ok(_) => self.degraded.store(false, Relaxed),
            Err(e) => {
                inc(&self.c.write_errors, 1);
                if !self.degraded.swap(true, Relaxed) {
                    tracing::warn!(dir = %self.dir.display(), error = %e, "kvtier SSD tier degraded: write failed");
                }
            }
        }
    }

    /// Delete the checkpoint before the first mutation that would make it stale.
    fn invalidate_checkpoint(&self) {
        if !self.ckpt_valid.load(Relaxed) {
            return;
        }
        let _g = self.ckpt_lock.lock();
        if self.ckpt_valid.load(Relaxed) {
            if let Err(e) = checkpoint::remove(&self.dir) {
                tracing::warn!(error = %e, "kvtier: cannot delete the SSD index checkpoint");
            }
            self.ckpt_valid.store(false, Relaxed);
        }
    }

    /// Write a segment header in block 0 of `seg` with `generation`.
    fn write_seg_header(&self, seg: u32, generation: u64, in_use: bool) -> io::Result<()> {
        let file = self
            .file(seg)
            .ok_or_else(|| io::Error::other("segment file missing"))?;
        let mut b = AlignedBuf::zeroed(ALIGN);
        SegmentHeader {
            id: seg,
            generation,
            segment_size: self.seg_size,
            in_use,
        }
        .encode(b.as_mut_slice());
        let r = file.write_at(b.as_slice(), 0);
        self.note_write_result(&r);
        r
    }

    /// Reserve `len` bytes in the active segment, activating a free one when needed.
    /// `Ok(None)`: no free segment; the caller must evict one and retry.
    fn reserve(&self, len: u64) -> Result<Option<(u32, u64, u64)>, io::Error> {
        let mut t = self.table.lock();
        loop {
            if let Some(a) = t.active {
                let m = &mut t.slots[a as usize];
                if m.write_off + len <= self.seg_size {
                    let off = m.write_off;
                    m.write_off += len;
                    m.inflight += 1;
                    m.dirty = true;
                    return Ok(Some((a, m.generation, off)));
                }
                m.state = SegState::Sealed;
                t.active = None;
            }
            let max = t.max_segments as usize;
            let pick = t.slots[..max]
                .iter()
                .position(|m| m.state == SegState::Free)
                .or_else(|| {
                    t.slots[..max]
                        .iter()
                        .position(|m| m.state == SegState::Missing)
                });
            let Some(slot) = pick else {
                return Ok(None);
            };
            match self.activate(slot as u32, &mut t) {
                Ok(()) => {
                    self.shutdown_cv.notify_all();
                }
                Err(e) if e.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()) => {
                    inc(&self.c.enospc, 1);
                    self.note_write_result::<()>(&Err(io::Error::from_raw_os_error(
                        rustix::io::Errno::NOSPC.raw_os_error(),
                    )));
                    // The filesystem holds no more segments: cap the tier where it is.
                    t.max_segments = slot as u32;
                    if t.slots[..slot].iter().all(|m| m.state == SegState::Missing) {
                        return Err(e);
                    }
                    tracing::warn!(
                        segments = slot,
                        "kvtier: SSD full, capping the segment count"
                    );
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Make `slot` the active segment: create its file if needed, bump its generation and
    /// write its header. Called with the table locked.
    fn activate(&self, slot: u32, t: &mut SegTable) -> io::Result<()> {
        self.invalidate_checkpoint();
        let path = sio::segment_path(&self.dir, slot);
        if self.file(slot).is_none() {
            let f = SegFile::open(&path, true, self.direct, Arc::clone(&self.faults))?
                .with_backend(self.io_backend);
            if let Err(e) = f.preallocate(self.seg_size) {
                drop(f);
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
            sio::sync_dir(&self.dir)?;
            let _ = self.files[slot as usize].set(f);
        } else if let Some(f) = self.file(slot) {
            if f.len()? != self.seg_size {
                f.preallocate(self.seg_size)?;
            }
        }
        let generation = self.next_seq();
        {
            let mut g = self.slot_gens[slot as usize].write();
            self.write_seg_header(slot, generation, true)?;
            *g = generation;
        }
        let m = &mut t.slots[slot as usize];
        *m = SegMeta::new(SegState::Active);
        m.generation = generation;
        m.dirty = true;
        m.last_access = self.tick.fetch_add(1, Relaxed);
        t.active = Some(slot);
        Ok(())
    }

    /// Pick and evict one sealed segment. Returns whether one was evicted.
    fn evict_one(&self) -> bool {
        let (victim, generation, keys) = {
            let mut t = self.table.lock();
            let Some(v) = self.pick_victim(&t) else {
                return false;
            };
            let m = &mut t.slots[v as usize];
            m.state = SegState::Evicting;
            let keys = std::mem::take(&mut m.keys);
            let generation = m.generation;
            while t.slots[v as usize].inflight > 0 {
                self.table_cv.wait(&mut t);
            }
            (v, generation, keys)
        };
        let mut n = 0;
        for key in &keys {
            let mut shard = self.index.shard(key).write();
            if let Some(e) = shard.get(&**key) {
                if e.seg == victim && e.generation == generation {
                    let e = *e;
                    shard.remove(&**key);
                    self.unaccount(&e);
                    n += 1;
                }
            }
        }
        self.invalidate_checkpoint();
        let new_gen = self.next_seq();
        {
            let mut g = self.slot_gens[victim as usize].write();
            // A failed header write leaves an in-use header: its records would be recovered
            // after a restart (they are intact), which is harmless for a cache.
            let _ = self.write_seg_header(victim, new_gen, false);
            *g = new_gen;
        }
        let mut t = self.table.lock();
        let m = &mut t.slots[victim as usize];
        *m = SegMeta::new(SegState::Free);
        m.generation = new_gen;
        drop(t);
        inc(&self.c.evicted_segments, 1);
        inc(&self.c.evicted_objects, n);
        true
    }

    /// The victim among sealed segments with no write in flight: an empty one if any, else
    /// among the coldest quarter (by last access) the one whose live objects are deepest in
    /// their prefix chains on average (`prefix_depth`), or simply the coldest (`lru`).
    fn pick_victim(&self, t: &SegTable) -> Option<u32> {
        let mut sealed: Vec<(u32, &SegMeta)> = t
            .slots
            .iter()
            .enumerate()
            .filter(|(_, m)| m.state == SegState::Sealed && m.inflight == 0)
            .map(|(i, m)| (i as u32, m))
            .collect();
        if let Some((i, _)) = sealed.iter().find(|(_, m)| m.live_objects == 0) {
            return Some(*i);
        }
        sealed.sort_by_key(|(_, m)| m.last_access);
        let window = sealed.len().div_ceil(4).max(1);
        let cold = &sealed[..window.min(sealed.len())];
        match self.policy {
            EvictionPolicyKind::Lru => cold.first().map(|(i, _)| *i),
            EvictionPolicyKind::PrefixDepth => cold
                .iter()
                .max_by(|(_, a), (_, b)| {
                    let da = a.depth_sum as f64 / a.live_objects.max(1) as f64;
                    let db = b.depth_sum as f64 / b.live_objects.max(1) as f64;
                    da.total_cmp(&db).then(b.last_access.cmp(&a.last_access))
                })
                .map(|(i, _)| *i),
        }
    }

    fn account(&self, t: &mut SegTable, key: &Arc<[u8]>, e: &SsdEntry) {
        let m = &mut t.slots[e.seg as usize];
        m.live_objects += 1;
        m.live_bytes += e.rec_len;
        m.depth_sum += u64::from(e.depth.unwrap_or(0));
        m.keys.push(Arc::clone(key));
        inc(&self.c.objects, 1);
        inc(&self.c.bytes_used, e.len);
        inc(&self.c.bytes_allocated, e.rec_len);
    }

    fn unaccount(&self, e: &SsdEntry) {
        {
            let mut t = self.table.lock();
            let m = &mut t.slots[e.seg as usize];
            if m.generation == e.generation {
                m.live_objects = m.live_objects.saturating_sub(1);
                m.live_bytes = m.live_bytes.saturating_sub(e.rec_len);
                m.depth_sum = m.depth_sum.saturating_sub(u64::from(e.depth.unwrap_or(0)));
            }
        }
        dec(&self.c.objects, 1);
        dec(&self.c.bytes_used, e.len);
        dec(&self.c.bytes_allocated, e.rec_len);
    }

    /// Overwrite the first block of a record with a dead marker (if the segment still has
    /// the record's generation).
    fn write_dead(&self, seg: u32, generation: u64, offset: u64, rec_len: u64) {
        let g = self.slot_gens[seg as usize].read();
        if *g != generation {
            return;
        }
        let Some(file) = self.file(seg) else { return };
        let mut b = AlignedBuf::zeroed(ALIGN);
        encode_dead(b.as_mut_slice(), rec_len, self.next_seq(), generation);
        let r = file.write_at(b.as_slice(), offset);
        self.note_write_result(&r);
        drop(g);
        if self.strict && r.is_ok() {
            let r = file.sync();
            inc(&self.c.syncs, 1);
            self.note_write_result(&r);
        } else {
            self.table.lock().slots[seg as usize].dirty = true;
        }
    }

    /// fdatasync every dirty segment.
    fn sync_dirty(&self) -> io::Result<()> {
        let dirty: Vec<u32> = {
            let mut t = self.table.lock();
            t.slots
                .iter_mut()
                .enumerate()
                .filter_map(|(i, m)| std::mem::take(&mut m.dirty).then_some(i as u32))
                .collect()
        };
        let mut first_err = None;
        for seg in dirty {
            if let Some(f) = self.file(seg) {
                let r = f.sync();
                inc(&self.c.syncs, 1);
                self.note_write_result(&r);
                if let Err(e) = r {
                    self.table.lock().slots[seg as usize].dirty = true;
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    // ---- copy pipeline ----

    fn pop_batch(&self) -> Option<Vec<Job>> {
        let mut q = self.queue.lock();
        loop {
            if !q.jobs.is_empty() {
                let mut batch = Vec::new();
                let mut bytes = 0usize;
                while let Some(j) = q.jobs.front() {
                    let len = j.object.len() as usize;
                    if !batch.is_empty()
                        && (batch.len() >= self.batch_max_ops || bytes + len > BATCH_MAX_BYTES)
                    {
                        break;
                    }
                    bytes += len;
                    batch.push(q.jobs.pop_front().expect("front exists"));
                }
                q.running += batch.len();
                self.queue_cv.notify_all();
                return Some(batch);
            }
            if q.closed {
                return None;
            }
            self.queue_cv.wait(&mut q);
        }
    }

    fn finish_batch(&self, n: usize) {
        let mut q = self.queue.lock();
        q.running -= n;
        q.finished += 1;
        self.queue_cv.notify_all();
    }

    /// Wait until at least one more batch finished, or nothing is pending.
    fn wait_progress(&self) {
        let mut q = self.queue.lock();
        let seen = q.finished;
        while q.finished == seen && (!q.jobs.is_empty() || q.running > 0) {
            self.queue_cv.wait(&mut q);
        }
    }

    fn wait_idle(&self) {
        let mut q = self.queue.lock();
        while !q.jobs.is_empty() || q.running > 0 {
            self.queue_cv.wait(&mut q);
        }
    }

    fn complete(job: Job, r: Result<(), CopyError>) {
        let Job { object, ticket, .. } = job;
        // Drop the object's reference before the waiter wakes: write-back eviction relies on
        // being the sole owner again once its copy completed.
        drop(object);
        if let Some(t) = ticket {
            t.complete(r);
        }
    }

    /// Write one batch; returns the jobs with their results, to be completed by the caller
    /// once the batch no longer counts as running.
    fn process(&self, jobs: Vec<Job>, buf: &mut AlignedBuf) -> Vec<(Job, Result<(), CopyError>)> {
        let _m = self.mutation.read_recursive();
        let mut done = Vec::with_capacity(jobs.len());
        let mut planned: Vec<(Job, u32, u64, u64, RecordLayout)> = Vec::with_capacity(jobs.len());
        for job in jobs {
            if self.index.shard(&job.key).read().contains_key(&*job.key) {
                done.push((job, Ok(())));
                continue;
            }
            let len = job.object.len();
            if len > self.max_payload() {
                inc(&self.c.dropped, 1);
                done.push((job, Err(CopyError::TooLarge)));
                continue;
            }
            let layout = RecordLayout::new(job.key.len(), len);
            let reserved = loop {
                match self.reserve(layout.rec_len) {
                    Ok(Some(r)) => break Ok(r),
                    Ok(None) => {
                        if !self.evict_one() {
                            break Err(CopyError::NoSpace);
                        }
                    }
                    Err(e) => break Err(CopyError::Io(e)),
                }
            };
            match reserved {
                Ok((seg, generation, off)) => planned.push((job, seg, generation, off, layout)),
                Err(e) => {
                    inc(&self.c.dropped, 1);
                    done.push((job, Err(e)));
                }
            }
        }
        if planned.is_empty() {
            return done;
        }
        self.invalidate_checkpoint();
        // Lay the records out in reservation order: heads, tails and records that cannot be
        // written from DRAM in place go into one aligned buffer; payload blocks that can are
        // handed to the kernel straight from the DRAM arena (one memcpy less per byte).
        let shapes: Vec<RecordShape> = planned
            .iter()
            .map(|p| RecordShape::of(&p.0.object, p.4))
            .collect();
        let total: usize = shapes.iter().map(RecordShape::buffered_len).sum();
        buf.resize(total);
        let mut at = 0usize;
        let mut seqs = Vec::with_capacity(planned.len());
        for ((job, _, generation, _, layout), shape) in planned.iter().zip(&shapes) {
            let seq = self.next_seq();
            seqs.push(seq);
            let len = job.object.len();
            let out = &mut buf.as_mut_slice()[at..at + shape.buffered_len()];
            match *shape {
                RecordShape::InPlace { tail, .. } => {
                    let fields = HeadFields {
                        key: &job.key,
                        payload_len: len,
                        depth: job.object.depth,
                        seq,
                        generation: *generation,
                        payload_crc: job
                            .object
                            .checksum()
                            .unwrap_or_else(|| payload_crc(job.object.slices())),
                    };
                    let (head, tail_block) = out.split_at_mut(ALIGN);
                    encode_head(head, &fields, *layout);
                    if tail > 0 {
                        let last = job.object.slices().last().unwrap_or_default();
                        tail_block[..tail].copy_from_slice(&last[last.len() - tail..]);
                        tail_block[tail..].fill(0);
                    }
                }
                RecordShape::Buffered { .. } => {
                    let po = layout.payload_offset as usize;
                    job.object.copy_to(&mut out[po..po + len as usize]);
                    finish_record(out, &job.key, len, job.object.depth, seq, *generation);
                }
            }
            at += shape.buffered_len();
        }
        // The pieces of every record, in file order.
        let buffered = buf.as_slice();
        let mut at = 0usize;
        let pieces: Vec<Vec<&[u8]>> = planned
            .iter()
            .zip(&shapes)
            .map(|(p, shape)| {
                let mine = &buffered[at..at + shape.buffered_len()];
                at += shape.buffered_len();
                shape.pieces(&p.0.object, mine)
            })
            .collect();
        // Write contiguous runs with one call each.
        let mut ok = vec![true; planned.len()];
        let mut i = 0;
        while i < planned.len() {
            let (seg, start) = (planned[i].1, planned[i].3);
            let mut j = i + 1;
            let mut end = start + planned[i].4.rec_len;
            while j < planned.len() && planned[j].1 == seg && planned[j].3 == end {
                end += planned[j].4.rec_len;
                j += 1;
            }
            let run: Vec<&[u8]> = pieces[i..j].iter().flatten().copied().collect();
            debug_assert_eq!(run.iter().map(|p| p.len() as u64).sum::<u64>(), end - start);
            let r = match self.file(seg) {
                Some(f) => f.write_parts_at(&run, start),
                None => Err(io::Error::other("segment file missing")),
            };
            self.note_write_result(&r);
            if r.is_err() {
                ok[i..j].iter_mut().for_each(|o| *o = false);
            } else {
                inc(&self.c.write_bytes, end - start);
            }
            i = j;
        }
        drop(pieces);
        inc(&self.c.batches, 1);
        if self.strict {
            let mut segs: Vec<u32> = planned
                .iter()
                .zip(&ok)
                .filter(|(_, ok)| **ok)
                .map(|(p, _)| p.1)
                .collect();
            segs.dedup();
            segs.sort_unstable();
            segs.dedup();
            for seg in segs {
                let r = self.file(seg).map_or(Ok(()), |f| f.sync());
                inc(&self.c.syncs, 1);
                self.note_write_result(&r);
                if r.is_err() {
                    for (p, o) in planned.iter().zip(ok.iter_mut()) {
                        if p.1 == seg {
                            *o = false;
                        }
                    }
                }
            }
        }
        // Publish, release the reservations, complete the waiters.
        let mut results = Vec::with_capacity(planned.len());
        for (((job, seg, generation, off, layout), ok), seq) in
            planned.into_iter().zip(ok).zip(seqs)
        {
            if !ok {
                inc(&self.c.dropped, 1);
                results.push((
                    job,
                    seg,
                    Err(CopyError::Io(io::Error::other("SSD write failed"))),
                ));
                continue;
            }
            inc(&self.c.writes, 1);
            let entry = SsdEntry {
                seg,
                generation,
                offset: off,
                rec_len: layout.rec_len,
                payload_offset: layout.payload_offset,
                len: job.object.len(),
                seq,
                depth: job.object.depth,
            };
            let published = {
                let dram = self.dram_index.shard(&job.key).read();
                let current = dram
                    .get(&*job.key)
                    .is_some_and(|o| Arc::ptr_eq(o, &job.object));
                let mut shard = self.index.shard(&job.key).write();
                if current && !shard.contains_key(&*job.key) {
                    shard.insert(Arc::clone(&job.key), entry);
                    let mut t = self.table.lock();
                    self.account(&mut t, &job.key, &entry);
                    t.slots[seg as usize].last_access = self.tick.fetch_add(1, Relaxed);
                    true
                } else {
                    false
                }
            };
            if !published {
                // Removed (or superseded) while being copied: make sure it never comes back.
                self.write_dead(seg, generation, off, layout.rec_len);
            }
            results.push((job, seg, Ok(())));
        }
        {
            let mut t = self.table.lock();
            for (_, seg, _) in &results {
                t.slots[*seg as usize].inflight -= 1;
            }
            // Reservations abandoned before writing still count as in flight until here.
        }
        self.table_cv.notify_all();
        done.extend(results.into_iter().map(|(job, _, r)| (job, r)));
        done
    }
}

impl SsdTier {
    /// Open (and recover) the SSD tier of `config`. `dram_index` is the engine's DRAM index,
    /// which the copy pipeline consults before publishing a record.
    pub(crate) fn open(
        config: &EngineConfig,
        dram_index: Arc<Index>,
        progress: &mut dyn FnMut(&RecoveryProgress),
    ) -> Result<SsdTier, EngineError> {
        let dir = config.ssd_storage_dir.clone();
        sio::ensure_private_dir(&dir).map_err(EngineError::SsdOpen)?;
        let lock = sio::lock_dir(&dir).map_err(EngineError::SsdOpen)?;
        let direct = sio::probe_direct(&dir);
        if !direct {
            tracing::warn!(dir = %dir.display(), "kvtier: O_DIRECT is not supported here; the SSD tier uses buffered I/O");
        }
        let io_backend = match config.ssd_io_backend {
            SsdIoBackend::IoUring => match uring::probe() {
                Ok(()) => SsdIoBackend::IoUring,
                Err(e) => {
                    tracing::warn!(error = %e, "kvtier: io_uring is not available here; the SSD tier uses preadv/pwritev");
                    SsdIoBackend::Posix
                }
            },
            SsdIoBackend::Posix => SsdIoBackend::Posix,
        };
        let seg_size = config.ssd_segment_size_bytes;
        let nseg = config.ssd_segments() as u32;
        let faults = Arc::new(Faults::default());
        let files: Vec<OnceLock<SegFile>> = (0..nseg).map(|_| OnceLock::new()).collect();
        for id in sio::list_segments(&dir).map_err(EngineError::SsdOpen)? {
            if id >= nseg {
                tracing::warn!(
                    segment = id,
                    "kvtier: segment beyond ssd_capacity_bytes ignored"
                );
                continue;
            }
            let f = SegFile::open(
                &sio::segment_path(&dir, id),
                false,
                direct,
                Arc::clone(&faults),
            )
            .map_err(EngineError::SsdOpen)?
            .with_backend(io_backend);
            let _ = files[id as usize].set(f);
        }
        let mut slots: Vec<SegMeta> = (0..nseg)
            .map(|i| {
                SegMeta::new(if files[i as usize].get().is_some() {
                    SegState::Free
                } else {
                    SegState::Missing
                })
            })
            .collect();

        let rec = recover(&dir, seg_size, &files, progress).map_err(EngineError::SsdOpen)?;
        let index = SsdIndex::new(config.index_shards.max(1));
        let sh_counters = Counters::default();
        let tick = AtomicU64::new(1);
        let mut gens = vec![0u64; nseg as usize];
        for (seg, generation, end) in &rec.in_use {
            let m = &mut slots[*seg as usize];
            m.state = SegState::Sealed;
            m.generation = *generation;
            m.write_off = *end;
            gens[*seg as usize] = *generation;
        }
        for (key, e) in rec.entries {
            let m = &mut slots[e.seg as usize];
            m.live_objects += 1;
            m.live_bytes += e.rec_len;
            m.depth_sum += u64::from(e.depth.unwrap_or(0));
            m.keys.push(Arc::clone(&key));
            m.last_access = tick.fetch_add(1, Relaxed);
            inc(&sh_counters.objects, 1);
            inc(&sh_counters.bytes_used, e.len);
            inc(&sh_counters.bytes_allocated, e.rec_len);
            index.shard(&key).write().insert(key, e);
        }
        // Recovered segments stay sealed even when nothing in them is live: their on-disk
        // header says "in use" until reclaim frees them (empty ones go first), so the next
        // checkpoint still lists every in-use segment.
        let report = rec.report;
        let sh = Arc::new(Shared {
            dir,
            seg_size,
            nseg,
            strict: config.ssd_durability_mode == SsdDurabilityMode::Strict,
            direct,
            io_backend,
            policy: config.eviction_policy,
            high: config.ssd_high_watermark,
            low: config.ssd_low_watermark,
            batch_max_ops: config.ssd_copy_batch_max_ops,
            queue_depth: config.ssd_copy_queue_depth,
            files,
            slot_gens: gens.into_iter().map(RwLock::new).collect(),
            table: Mutex::new(SegTable {
                slots,
                active: None,
                max_segments: nseg,
            }),
            table_cv: Condvar::new(),
            index,
            dram_index,
            queue: Mutex::new(QueueInner {
                jobs: VecDeque::new(),
                running: 0,
                finished: 0,
                closed: false,
            }),
            queue_cv: Condvar::new(),
            seq: AtomicU64::new(rec.next_seq),
            tick,
            mutation: RwLock::new(()),
            ckpt_valid: AtomicBool::new(report.used_checkpoint),
            ckpt_lock: Mutex::new(()),
            faults,
            c: sh_counters,
            degraded: AtomicBool::new(false),
            shutdown: Mutex::new(false),
            shutdown_cv: Condvar::new(),
            recovery: report,
            _lock: lock,
        });
        let mut threads = Vec::new();
        for i in 0..config.ssd_copy_worker_threads {
            let sh = Arc::clone(&sh);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvtier-ssd-copy-{i}"))
                    .spawn(move || {
                        let mut buf = AlignedBuf::new();
                        while let Some(batch) = sh.pop_batch() {
                            let n = batch.len();
                            let done = sh.process(batch, &mut buf);
                            // Release the objects first (write-back eviction and "wait for
                            // the queue, then evict" rely on it), then the batch, then wake
                            // the waiters.
                            let tickets: Vec<_> =
                                done.into_iter().map(|(job, r)| (job.ticket, r)).collect();
                            sh.finish_batch(n);
                            for (t, r) in tickets {
                                if let Some(t) = t {
                                    t.complete(r);
                                }
                            }
                        }
                    })
                    .map_err(EngineError::SsdOpen)?,
            );
        }
        let bg = Arc::clone(&sh);
        threads.push(
            std::thread::Builder::new()
                .name("kvtier-ssd-reclaim".into())
                .spawn(move || background(&bg))
                .map_err(EngineError::SsdOpen)?,
        );
        Ok(SsdTier {
            sh,
            threads: Mutex::new(threads),
        })
    }

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
                    out.push((key.to_vec(), e.len));
                }
            }
        }
        (out, false)
    }

    pub(crate) fn len_of(&self, key: &[u8]) -> Option<u64> {
        self.sh.index.get(key).map(|e| e.len)
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
        let mut q = self.sh.queue.lock();
        if q.jobs.len() >= self.sh.queue_depth {
            inc(&self.sh.c.queue_full_waits, 1);
            while q.jobs.len() >= self.sh.queue_depth && !q.closed {
                self.sh.queue_cv.wait(&mut q);
            }
        }
        if q.closed {
            drop(q);
            Shared::complete(job, Err(CopyError::NoSpace));
            return ticket;
        }
        q.jobs.push_back(job);
        drop(q);
        self.sh.queue_cv.notify_all();
        ticket
    }

    pub(crate) fn pending(&self) -> usize {
        let q = self.sh.queue.lock();
        q.jobs.len() + q.running
    }

    pub(crate) fn wait_progress(&self) {
        self.sh.wait_progress();
    }

    /// Read `key` into `dst` (whose length must match), verifying the record.
    pub(crate) fn read_into(&self, key: &[u8], dst: &mut [u8]) -> SsdRead {
        let sh = &self.sh;
        let Some(e) = sh.index.get(key) else {
            return SsdRead::Miss;
        };
        if dst.len() as u64 != e.len {
            return SsdRead::SizeMismatch { stored: e.len };
        }
        let verdict = {
            let g = sh.slot_gens[e.seg as usize].read();
            if *g != e.generation {
                return SsdRead::Miss;
            }
            let Some(file) = sh.file(e.seg) else {
                return SsdRead::Miss;
            };
            read_record(file, &e, key, dst)
        };
        match verdict {
            Ok(true) => {
                inc(&sh.c.hits, 1);
                inc(&sh.c.read_bytes, e.len);
                let mut t = sh.table.lock();
                let m = &mut t.slots[e.seg as usize];
                if m.generation == e.generation {
                    m.last_access = sh.tick.fetch_add(1, Relaxed);
                }
                SsdRead::Hit { depth: e.depth }
            }
            Ok(false) | Err(_) => {
                // A remove unlinks the entry before it overwrites the record's header, so a
                // record read as bad whose entry is gone was removed under this read: a miss,
                // not damage.
                let mut shard = sh.index.shard(key).write();
                if !shard.get(key).is_some_and(|x| {
                    x.seg == e.seg && x.offset == e.offset && x.generation == e.generation
                }) {
                    return SsdRead::Miss;
                }
                if verdict.is_ok() {
                    inc(&sh.c.checksum_failures, 1);
                    tracing::warn!(
                        seg = e.seg,
                        offset = e.offset,
                        "kvtier: SSD record failed its checksum; served as a miss"
                    );
                } else {
                    inc(&sh.c.read_errors, 1);
                }
                // Drop the entry so the damage costs one miss, not one per read.
                shard.remove(key);
                drop(shard);
                sh.unaccount(&e);
                SsdRead::Failed
            }
        }
    }

    /// Remove `key` from SSD: unlink it and overwrite its record header with a dead marker
    /// (synced in strict mode). Returns whether it was on SSD.
    pub(crate) fn remove(&self, key: &[u8]) -> bool {
        let sh = &self.sh;
        let _m = sh.mutation.read_recursive();
        let Some(e) = sh.index.shard(key).write().remove(key) else {
            return false;
        };
        sh.unaccount(&e);
        inc(&sh.c.removed, 1);
        sh.invalidate_checkpoint();
        sh.write_dead(e.seg, e.generation, e.offset, e.rec_len);
        true
    }

    /// Remove everything: every segment in use is marked free on disk (new generation).
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
        let mut t = sh.table.lock();
        let mut touched = Vec::new();
        for (i, m) in t.slots.iter_mut().enumerate() {
            if matches!(m.state, SegState::Active | SegState::Sealed) {
                let new_gen = sh.next_seq();
                let mut g = sh.slot_gens[i].write();
                let _ = sh.write_seg_header(i as u32, new_gen, false);
                *g = new_gen;
                *m = SegMeta::new(SegState::Free);
                m.generation = new_gen;
                touched.push(i as u32);
            }
        }
        t.active = None;
        drop(t);
        if sh.strict {
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
            segment_size: sh.seg_size,
            next_seq: sh.seq.load(Relaxed),
            ..Checkpoint::default()
        };
        {
            let t = sh.table.lock();
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
                    offset: e.offset,
                    rec_len: e.rec_len,
                    payload_len: e.len,
                    payload_offset: e.payload_offset,
                    seq: e.seq,
                    depth: e.depth,
                });
            }
        }
        let _g = sh.ckpt_lock.lock();
        checkpoint::write(&sh.dir, &c).map_err(EngineError::SsdWrite)?;
        sh.ckpt_valid.store(true, Relaxed);
        Ok(())
    }

    /// Stop the worker threads after they drained the queue (idempotent).
    pub(crate) fn shutdown(&self) {
        {
            let mut q = self.sh.queue.lock();
            q.closed = true;
        }
        self.sh.queue_cv.notify_all();
        *self.sh.shutdown.lock() = true;
        self.sh.shutdown_cv.notify_all();
        for h in self.threads.lock().drain(..) {
            let _ = h.join();
        }
    }

    pub(crate) fn fill_stats(&self, s: &mut EngineStats) {
        let sh = &self.sh;
        let g = |c: &AtomicU64| c.load(Relaxed);
        s.ssd_enabled = true;
        s.ssd_direct_io = sh.direct;
        s.ssd_io_uring = sh.io_backend == SsdIoBackend::IoUring;
        s.ssd_degraded = sh.degraded.load(Relaxed);
        s.ssd_objects = g(&sh.c.objects);
        s.ssd_bytes_used = g(&sh.c.bytes_used);
        s.ssd_bytes_allocated = g(&sh.c.bytes_allocated);
        s.ssd_capacity_bytes = u64::from(sh.nseg) * sh.seg_size;
        s.ssd_segments_total = u64::from(sh.nseg);
        s.ssd_segments_in_use = sh.table.lock().in_use();
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
        s.ssd_recovery_torn = r.torn;
        s.ssd_recovery_corrupt = r.corrupt;
        s.ssd_recovery_stale = r.stale;
    }

    /// Test hook: make the next `writes` SSD writes and `syncs` syncs fail with EIO
    /// (`u64::MAX`: until reset with 0).
    pub(crate) fn inject_faults(&self, writes: u64, syncs: u64) {
        self.sh.faults.write_errors.store(writes, Relaxed);
        self.sh.faults.sync_errors.store(syncs, Relaxed);
    }
}

impl Drop for SsdTier {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Read and verify one record into `dst`. `Ok(false)`: read but failed verification.
fn read_record(file: &SegFile, e: &SsdEntry, key: &[u8], dst: &mut [u8]) -> io::Result<bool> {
    let len = dst.len();
    let body = len / ALIGN * ALIGN;
    if e.payload_offset as usize == ALIGN && body > 0 && is_aligned(dst.as_ptr() as usize) {
        // Straight into the destination: header block and tail into a bounce buffer.
        let tail_len = e.rec_len as usize - ALIGN - body;
        return with_bounce(ALIGN + tail_len, |b| {
            let (hdr, tail) = b.as_mut_slice().split_at_mut(ALIGN);
            let (dbody, drest) = dst.split_at_mut(body);
            file.read_vectored_exact(
                &mut [
                    IoSliceMut::new(hdr),
                    IoSliceMut::new(dbody),
                    IoSliceMut::new(tail),
                ],
                e.offset,
            )?;
            let rest = len - body;
            if !verify_split(hdr, &[dbody, &tail[..rest]], key, e.len, e.generation) {
                return Ok(false);
            }
            drest.copy_from_slice(&tail[..rest]);
            Ok(true)
        });
    }
    with_bounce(e.rec_len as usize, |b| {
        let n = file.read_at(b.as_mut_slice(), e.offset)?;
        if n as u64 != e.rec_len {
            return Ok(false);
        }
        match verify_record(b.as_slice(), key, e.len, e.generation) {
            Ok(h) => {
                let po = h.payload_offset as usize;
                dst.copy_from_slice(&b.as_slice()[po..po + len]);
                Ok(true)
            }
            Err(()) => Ok(false),
        }
    })
}

/// The reclaim / relaxed-sync thread.
fn background(sh: &Shared) {
    let mut last_sync = Instant::now();
    loop {
        {
            let mut stop = sh.shutdown.lock();
            if *stop {
                break;
            }
            sh.shutdown_cv
                .wait_for(&mut stop, Duration::from_millis(100));
            if *stop {
                break;
            }
        }
        {
            let _m = sh.mutation.read_recursive();
            let total = f64::from(sh.table.lock().max_segments);
            let high = (sh.high * total).ceil() as u64;
            let low = (sh.low * total).floor() as u64;
            let used = sh.table.lock().in_use();
            if used >= high.max(1) {
                let mut used = used;
                while used > low && sh.evict_one() {
                    used -= 1;
                }
            }
        }
        if !sh.strict && last_sync.elapsed() >= RELAXED_SYNC_EVERY {
            let _ = sh.sync_dirty();
            last_sync = Instant::now();
        }
    }
}

// ---- recovery ----

struct Recovered {
    entries: Vec<(Arc<[u8]>, SsdEntry)>,
    /// (segment, generation, append offset) of segments holding current records.
    in_use: Vec<(u32, u64, u64)>,
    next_seq: u64,
    report: RecoveryReport,
}

/// Rebuild the index: from the checkpoint where it is valid, by scanning elsewhere.
fn recover(
    dir: &Path,
    seg_size: u64,
    files: &[OnceLock<SegFile>],
    progress: &mut dyn FnMut(&RecoveryProgress),
) -> io::Result<Recovered> {
    let t0 = Instant::now();
    let mut report = RecoveryReport::default();
    let mut next_seq = 1u64;
    // Segment headers first: they decide what the checkpoint may vouch for.
    let mut headers: Vec<Option<SegmentHeader>> = vec![None; files.len()];
    let mut hb = AlignedBuf::zeroed(ALIGN);
    for (i, f) in files.iter().enumerate() {
        if let Some(f) = f.get() {
            let n = f.read_at(hb.as_mut_slice(), 0)?;
            headers[i] = SegmentHeader::decode(&hb.as_slice()[..n])
                .filter(|h| h.id == i as u32 && h.segment_size == seg_size);
            if let Some(h) = headers[i] {
                next_seq = next_seq.max(h.generation + 1);
            }
        }
    }
    let mut trusted = vec![false; files.len()];
    // Entries vouched for by the checkpoint (unique keys); merged with scans only if needed.
    let mut from_ckpt: Vec<(Arc<[u8]>, SsdEntry)> = Vec::new();
    let mut in_use: Vec<(u32, u64, u64)> = Vec::new();
    let ckpt = checkpoint::read(dir);
    let ckpt_ok = ckpt.as_ref().is_some_and(|c| {
        c.segment_size == seg_size
            && c.segments.iter().all(|&(id, g, _)| {
                headers
                    .get(id as usize)
                    .copied()
                    .flatten()
                    .is_some_and(|h| h.in_use && h.generation == g)
            })
            && headers.iter().enumerate().all(|(i, h)| {
                // Every in-use segment must be listed, else it was written after the checkpoint.
                !h.is_some_and(|h| h.in_use)
                    || c.segments.iter().any(|&(id, _, _)| id as usize == i)
            })
            // Every entry must describe a record inside its segment (a checkpoint is input:
            // one out of range is damage, and the segments are scanned instead).
            && c.entries.iter().all(|e| {
                e.rec_len > 0
                    && e.offset % ALIGN as u64 == 0
                    && e.offset.checked_add(e.rec_len).is_some_and(|end| end <= seg_size)
                    && u64::from(e.payload_offset)
                        .checked_add(e.payload_len)
                        .is_some_and(|end| end <= e.rec_len)
            })
    });
    if let (Some(c), true) = (&ckpt, ckpt_ok) {
        report.used_checkpoint = true;
        next_seq = next_seq.max(c.next_seq);
        for &(id, g, end) in &c.segments {
            trusted[id as usize] = true;
            in_use.push((id, g, end));
        }
        from_ckpt.reserve(c.entries.len());
        let mut gen_of = vec![None; files.len()];
        for &(id, g, _) in &c.segments {
            gen_of[id as usize] = Some(g);
        }
        for e in &c.entries {
            let Some(generation) = gen_of.get(e.seg as usize).copied().flatten() else {
                continue;
            };
            from_ckpt.push((
                Arc::clone(&e.key),
                SsdEntry {
                    seg: e.seg,
                    generation,
                    offset: e.offset,
                    rec_len: e.rec_len,
                    payload_offset: e.payload_offset,
                    len: e.payload_len,
                    seq: e.seq,
                    depth: e.depth,
                },
            ));
        }
        report.objects_from_checkpoint = c.entries.len() as u64;
        progress(&RecoveryProgress {
            segments_done: 0,
            segments_total: 0,
            bytes_scanned: 0,
            records: from_ckpt.len() as u64,
            elapsed: t0.elapsed(),
            from_checkpoint: true,
        });
    } else if ckpt.is_some() || checkpoint::path(dir).exists() {
        tracing::warn!(dir = %dir.display(), "kvtier: SSD index checkpoint is stale or damaged; scanning segments");
        let _ = checkpoint::remove(dir);
    }

    // Scan every segment the checkpoint does not vouch for (in use, or without a header).
    let to_scan: Vec<u32> = (0..files.len() as u32)
        .filter(|&i| files[i as usize].get().is_some() && !trusted[i as usize])
        .filter(|&i| headers[i as usize].is_none_or(|h| h.in_use))
        .collect();
    let total = to_scan.len() as u64;
    let next = AtomicU64::new(0);
    let (tx, rx) = mpsc::channel::<ScanMsg>();
    // Twice the cores: a scanner alternates between waiting on a read and checksumming it, so
    // two per core keep both the disk queue and the CPU busy.
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .saturating_mul(2)
        .clamp(2, 8);
    let mut scans: Vec<(u32, super::scan::SegmentScan)> = Vec::new();
    let mut first_err = None;
    std::thread::scope(|s| {
        for _ in 0..threads.min(to_scan.len()) {
            let tx = tx.clone();
            let (to_scan, next) = (&to_scan, &next);
            s.spawn(move || {
                let mut buf = AlignedBuf::new();
                loop {
                    let i = next.fetch_add(1, Relaxed) as usize;
                    let Some(&seg) = to_scan.get(i) else { break };
                    let Some(file) = files[seg as usize].get() else {
                        continue;
                    };
                    let r = scan_segment(file, seg_size, &mut buf, true, &mut |b| {
                        let _ = tx.send(ScanMsg::Bytes(b));
                    });
                    let _ = tx.send(ScanMsg::Done(seg, r));
                }
            });
        }
        drop(tx);
        let mut done = 0;
        let mut bytes = 0;
        let mut records = from_ckpt.len() as u64;
        let mut last = Instant::now();
        for msg in rx {
            match msg {
                ScanMsg::Bytes(b) => bytes += b,
                ScanMsg::Done(seg, r) => {
                    done += 1;
                    match r {
                        Ok(scan) => {
                            records += scan.good;
                            scans.push((seg, scan));
                        }
                        Err(e) => {
                            first_err.get_or_insert(e);
                        }
                    }
                }
            }
            if last.elapsed() >= Duration::from_millis(100) || done == total {
                last = Instant::now();
                progress(&RecoveryProgress {
                    segments_done: done,
                    segments_total: total,
                    bytes_scanned: bytes,
                    records,
                    elapsed: t0.elapsed(),
                    from_checkpoint: report.used_checkpoint,
                });
            }
        }
    });
    if let Some(e) = first_err {
        return Err(e);
    }
    scans.sort_by_key(|(seg, _)| *seg);
    if scans.is_empty() {
        report.objects = from_ckpt.len() as u64;
        report.elapsed = t0.elapsed();
        return Ok(Recovered {
            entries: from_ckpt,
            in_use,
            next_seq,
            report,
        });
    }
    let mut best: HashMap<Arc<[u8]>, SsdEntry, Hasher> = HashMap::with_hasher(Hasher::default());
    best.reserve(from_ckpt.len());
    best.extend(from_ckpt);
    for (seg, scan) in scans {
        report.segments_scanned += 1;
        report.bytes_scanned += scan.bytes_scanned;
        report.torn += scan.torn;
        report.corrupt += scan.corrupt;
        report.stale += scan.stale;
        report.removed += scan.removed;
        next_seq = next_seq.max(scan.max_seq + 1);
        if scan.torn + scan.corrupt > 0 {
            tracing::warn!(
                segment = seg,
                torn = scan.torn,
                corrupt = scan.corrupt,
                "kvtier: dropped damaged SSD records at recovery"
            );
        }
        let Some(h) = scan.header.filter(|h| h.in_use) else {
            continue;
        };
        in_use.push((seg, h.generation, scan.end));
        for r in scan.records {
            let ScannedRecord {
                key,
                offset,
                rec_len,
                payload_len,
                payload_offset,
                seq,
                depth,
            } = r;
            let e = SsdEntry {
                seg,
                generation: h.generation,
                offset,
                rec_len,
                payload_offset,
                len: payload_len,
                seq,
                depth,
            };
            match best.get_mut(&*key) {
                Some(old) if old.seq >= seq => {}
                Some(old) => *old = e,
                None => {
                    best.insert(Arc::from(key), e);
                }
            }
        }
    }
    report.objects = best.len() as u64;
    report.elapsed = t0.elapsed();
    Ok(Recovered {
        entries: best.into_iter().collect(),
        in_use,
        next_seq,
        report,
    })
}

enum ScanMsg {
    Bytes(u64),
    Done(u32, io::Result<super::scan::SegmentScan>),
}
