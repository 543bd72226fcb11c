//! The segment table: the state of every segment slot (missing, free, active, sealed,
//! evicting), its generation, append offset, live bytes and last access, and the writes that
//! change a segment's own header (activate, free) or mark a record dead.
//!
//! Owns: [`SegTable`] (behind `Shared::table`) and the space reservation of appends.
//! Invariants: a slot's generation only grows; only an `Active` segment receives appends and
//! its `write_off` only grows until it is sealed; `live` bytes are the sum of the records the
//! index points at in that segment (`account` / `unaccount`).

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SegState {
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

pub(super) struct SegMeta {
    pub(super) state: SegState,
    pub(super) generation: u64,
    pub(super) write_off: u64,
    /// Reserved records not yet published or abandoned.
    pub(super) inflight: u32,
    pub(super) live_objects: u64,
    pub(super) live_bytes: u64,
    pub(super) depth_sum: u64,
    pub(super) last_access: u64,
    /// Keys published into this segment (some may since have been removed).
    pub(super) keys: Vec<Arc<[u8]>>,
    pub(super) dirty: bool,
}

impl SegMeta {
    pub(super) fn new(state: SegState) -> SegMeta {
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

/// The segments: their files (opened on first use), the generation each slot's records
/// carry (held for reading across a `pread`, for writing while a slot is recycled), and the
/// table of their states, with the condition evictions wait on for in-flight I/O.
pub(super) struct Segments {
    pub(super) files: Vec<OnceLock<SegFile>>,
    pub(super) slot_gens: Vec<RwLock<u64>>,
    pub(super) table: Mutex<SegTable>,
    pub(super) table_cv: Condvar,
}

pub(super) struct SegTable {
    pub(super) slots: Vec<SegMeta>,
    pub(super) active: Option<u32>,
    /// Slots at or beyond this id are never created (lowered when the disk is full).
    pub(super) max_segments: u32,
}

impl SegTable {
    pub(super) fn in_use(&self) -> u64 {
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

impl Shared {
    /// Write a segment header in block 0 of `seg` with `generation`.
    pub(super) fn write_seg_header(
        &self,
        seg: u32,
        generation: u64,
        in_use: bool,
    ) -> io::Result<()> {
        let file = self
            .file(seg)
            .ok_or_else(|| io::Error::other("segment file missing"))?;
        let mut b = AlignedBuf::zeroed(ALIGN);
        SegmentHeader {
            id: seg,
            generation,
            segment_size: self.settings.seg_size,
            in_use,
        }
        .encode(b.as_mut_slice());
        let r = file.write_at(b.as_slice(), 0);
        self.note_write_result(&r);
        r
    }

    /// Reserve `len` bytes in the active segment, activating a free one when needed.
    /// `Ok(None)`: no free segment; the caller must evict one and retry.
    pub(super) fn reserve(&self, len: u64) -> Result<Option<(u32, u64, u64)>, io::Error> {
        let mut t = self.segments.table.lock();
        loop {
            if let Some(a) = t.active {
                let m = &mut t.slots[a as usize];
                if m.write_off + len <= self.settings.seg_size {
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
                    self.stop.changed.notify_all();
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
    pub(super) fn activate(&self, slot: u32, t: &mut SegTable) -> io::Result<()> {
        self.invalidate_checkpoint();
        let path = sio::segment_path(&self.settings.dir, slot);
        if self.file(slot).is_none() {
            let f = SegFile::open(&path, true, self.settings.direct, Arc::clone(&self.faults))?
                .with_backend(self.settings.io_backend);
            if let Err(e) = f.preallocate(self.settings.seg_size) {
                drop(f);
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
            sio::sync_dir(&self.settings.dir)?;
            let _ = self.segments.files[slot as usize].set(f);
        } else if let Some(f) = self.file(slot) {
            if f.len()? != self.settings.seg_size {
                f.preallocate(self.settings.seg_size)?;
            }
        }
        let generation = self.next_seq();
        {
            let mut g = self.segments.slot_gens[slot as usize].write();
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

    pub(super) fn account(&self, t: &mut SegTable, key: &Arc<[u8]>, e: &SsdEntry) {
        let m = &mut t.slots[e.seg as usize];
        m.live_objects += 1;
        m.live_bytes += e.loc.rec_len;
        m.depth_sum += u64::from(e.loc.depth.unwrap_or(0));
        m.keys.push(Arc::clone(key));
        inc(&self.c.objects, 1);
        inc(&self.c.bytes_used, e.loc.payload_len);
        inc(&self.c.bytes_allocated, e.loc.rec_len);
    }

    pub(super) fn unaccount(&self, e: &SsdEntry) {
        {
            let mut t = self.segments.table.lock();
            let m = &mut t.slots[e.seg as usize];
            if m.generation == e.generation {
                m.live_objects = m.live_objects.saturating_sub(1);
                m.live_bytes = m.live_bytes.saturating_sub(e.loc.rec_len);
                m.depth_sum = m
                    .depth_sum
                    .saturating_sub(u64::from(e.loc.depth.unwrap_or(0)));
            }
        }
        dec(&self.c.objects, 1);
        dec(&self.c.bytes_used, e.loc.payload_len);
        dec(&self.c.bytes_allocated, e.loc.rec_len);
    }

    /// Overwrite the first block of a record with a dead marker (if the segment still has
    /// the record's generation).
    pub(super) fn write_dead(&self, seg: u32, generation: u64, offset: u64, rec_len: u64) {
        let g = self.segments.slot_gens[seg as usize].read();
        if *g != generation {
            return;
        }
        let Some(file) = self.file(seg) else { return };
        let mut b = AlignedBuf::zeroed(ALIGN);
        encode_dead(b.as_mut_slice(), rec_len, self.next_seq(), generation);
        let r = file.write_at(b.as_slice(), offset);
        self.note_write_result(&r);
        drop(g);
        if self.settings.strict && r.is_ok() {
            let r = file.sync();
            inc(&self.c.syncs, 1);
            self.note_write_result(&r);
        } else {
            self.segments.table.lock().slots[seg as usize].dirty = true;
        }
    }

    /// fdatasync every dirty segment.
    pub(super) fn sync_dirty(&self) -> io::Result<()> {
        let dirty: Vec<u32> = {
            let mut t = self.segments.table.lock();
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
                    self.segments.table.lock().slots[seg as usize].dirty = true;
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}
