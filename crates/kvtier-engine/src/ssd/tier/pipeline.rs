//! The copy pipeline: queued copy jobs ([`Job`], [`Ticket`]), batching, and `process`, which
//! writes a batch of records and publishes each one only while the DRAM index still holds the
//! very object it copied.
//!
//! Owns: the queue (`Shared::queue`) and how a record is laid out on disk ([`RecordShape`]).
//! Invariant: every job taken from the queue is completed exactly once (its ticket is
//! signalled with the outcome), also when the tier shuts down.

use super::*;

/// How one record goes to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RecordShape {
    /// A one-block head from the buffer, the payload's whole 4 KiB blocks straight from the
    /// DRAM extents, then (when the payload ends mid-block) a zero-padded tail block from the
    /// buffer. Requires the aligned layout and 4 KiB aligned DRAM extents.
    InPlace { tail: usize },
    /// The whole record (`rec_len` bytes) serialized into the buffer.
    Buffered { rec_len: usize },
}

impl RecordShape {
    pub(super) fn of(object: &Object, layout: RecordLayout) -> RecordShape {
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
    pub(super) fn buffered_len(&self) -> usize {
        match *self {
            RecordShape::InPlace { tail } => ALIGN + if tail > 0 { ALIGN } else { 0 },
            RecordShape::Buffered { rec_len } => rec_len,
        }
    }

    /// The record's bytes in file order: `mine` is its part of the batch buffer.
    pub(super) fn pieces<'a>(self, object: &'a Object, mine: &'a [u8]) -> Vec<&'a [u8]> {
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
    pub(super) done: Mutex<Option<Result<(), CopyError>>>,
    pub(super) cv: Condvar,
}

impl Ticket {
    pub(super) fn new() -> Arc<Ticket> {
        Arc::new(Ticket {
            done: Mutex::new(None),
            cv: Condvar::new(),
        })
    }
    pub(super) fn complete(&self, r: Result<(), CopyError>) {
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

pub(super) struct Job {
    pub(super) key: Arc<[u8]>,
    pub(super) object: Arc<Object>,
    pub(super) ticket: Option<Arc<Ticket>>,
    /// When it was queued (the copy lag in the stats is the age of the oldest job).
    pub(super) queued: Instant,
}

/// The copy queue: jobs waiting for a worker, and the condition its producers, workers and
/// waiters for progress wait on.
pub(super) struct CopyQueue {
    pub(super) queue: Mutex<QueueInner>,
    pub(super) changed: Condvar,
}

impl CopyQueue {
    pub(super) fn new() -> CopyQueue {
        CopyQueue {
            queue: Mutex::new(QueueInner {
                jobs: VecDeque::new(),
                running: 0,
                finished: 0,
                closed: false,
            }),
            changed: Condvar::new(),
        }
    }
}

pub(super) struct QueueInner {
    pub(super) jobs: VecDeque<Job>,
    /// Popped by a worker and not finished yet.
    pub(super) running: usize,
    /// Batches finished so far (progress marker for waiters).
    pub(super) finished: u64,
    pub(super) closed: bool,
}

impl Shared {
    // ---- copy pipeline ----

    pub(super) fn pop_batch(&self) -> Option<Vec<Job>> {
        let mut q = self.copies.queue.lock();
        loop {
            if !q.jobs.is_empty() {
                let mut batch = Vec::new();
                let mut bytes = 0usize;
                while let Some(j) = q.jobs.front() {
                    let len = j.object.len() as usize;
                    if !batch.is_empty()
                        && (batch.len() >= self.settings.batch_max_ops
                            || bytes + len > BATCH_MAX_BYTES)
                    {
                        break;
                    }
                    bytes += len;
                    batch.push(q.jobs.pop_front().expect("front exists"));
                }
                q.running += batch.len();
                self.copies.changed.notify_all();
                return Some(batch);
            }
            if q.closed {
                return None;
            }
            self.copies.changed.wait(&mut q);
        }
    }

    pub(super) fn finish_batch(&self, n: usize) {
        let mut q = self.copies.queue.lock();
        q.running -= n;
        q.finished += 1;
        self.copies.changed.notify_all();
    }

    /// Wait until at least one more batch finished, or nothing is pending.
    pub(super) fn wait_progress(&self) {
        let mut q = self.copies.queue.lock();
        let seen = q.finished;
        while q.finished == seen && (!q.jobs.is_empty() || q.running > 0) {
            self.copies.changed.wait(&mut q);
        }
    }

    pub(super) fn wait_idle(&self) {
        let mut q = self.copies.queue.lock();
        while !q.jobs.is_empty() || q.running > 0 {
            self.copies.changed.wait(&mut q);
        }
    }

    pub(super) fn complete(job: Job, r: Result<(), CopyError>) {
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
    pub(super) fn process(
        &self,
        jobs: Vec<Job>,
        buf: &mut AlignedBuf,
    ) -> Vec<(Job, Result<(), CopyError>)> {
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
        if self.settings.strict {
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
                loc: RecordLoc {
                    offset: off,
                    rec_len: layout.rec_len,
                    payload_offset: layout.payload_offset,
                    payload_len: job.object.len(),
                    seq,
                    depth: job.object.depth,
                },
            };
            let published = {
                let dram = self.dram_index.shard(&job.key).read();
                let current = dram
                    .get(&*job.key)
                    .is_some_and(|o| Arc::ptr_eq(o, &job.object));
                let mut shard = self.index.shard(&job.key).write();
                if current && !shard.contains_key(&*job.key) {
                    self.insert_indexed(&mut shard, &job.key, entry, job.object.depth);
                    let mut t = self.segments.table.lock();
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
            let mut t = self.segments.table.lock();
            for (_, seg, _) in &results {
                t.slots[*seg as usize].inflight -= 1;
            }
            // Reservations abandoned before writing still count as in flight until here.
        }
        self.segments.table_cv.notify_all();
        done.extend(results.into_iter().map(|(job, _, r)| (job, r)));
        done
    }
}
