//! The read path: look a key up in the SSD index, pin the segment generation for the
//! duration of the `pread`, verify the record, copy it out (directly, or through a per-thread
//! bounce buffer when the destination is not aligned for `O_DIRECT`).
//!
//! Owns: the per-thread bounce buffers. Invariant: a read either returns the exact stored
//! payload (header key and CRC checked) or reports a miss; it never returns bytes of a
//! recycled segment (the generation lock is held across the read).

use super::*;

thread_local! {
    pub(super) static BOUNCE: std::cell::RefCell<AlignedBuf> = const { std::cell::RefCell::new(AlignedBuf::new()) };
}

pub(super) fn with_bounce<R>(len: usize, f: impl FnOnce(&mut AlignedBuf) -> R) -> R {
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

/// Read and verify one record into `dst`. `Ok(false)`: read but failed verification.
pub(super) fn read_record(
    file: &SegFile,
    e: &SsdEntry,
    key: &[u8],
    dst: &mut [u8],
) -> io::Result<bool> {
    let len = dst.len();
    let body = len / ALIGN * ALIGN;
    if e.loc.payload_offset as usize == ALIGN && body > 0 && is_aligned(dst.as_ptr() as usize) {
        // Straight into the destination: header block and tail into a bounce buffer.
        let tail_len = e.loc.rec_len as usize - ALIGN - body;
        return with_bounce(ALIGN + tail_len, |b| {
            let (hdr, tail) = b.as_mut_slice().split_at_mut(ALIGN);
            let (dbody, drest) = dst.split_at_mut(body);
            file.read_vectored_exact(
                &mut [
                    IoSliceMut::new(hdr),
                    IoSliceMut::new(dbody),
                    IoSliceMut::new(tail),
                ],
                e.loc.offset,
            )?;
            let rest = len - body;
            if !verify_split(
                hdr,
                &[dbody, &tail[..rest]],
                key,
                e.loc.payload_len,
                e.generation,
            ) {
                return Ok(false);
            }
            drest.copy_from_slice(&tail[..rest]);
            Ok(true)
        });
    }
    with_bounce(e.loc.rec_len as usize, |b| {
        let n = file.read_at(b.as_mut_slice(), e.loc.offset)?;
        if n as u64 != e.loc.rec_len {
            return Ok(false);
        }
        match verify_record(b.as_slice(), key, e.loc.payload_len, e.generation) {
            Ok(h) => {
                let po = h.payload_offset as usize;
                dst.copy_from_slice(&b.as_slice()[po..po + len]);
                Ok(true)
            }
            Err(()) => Ok(false),
        }
    })
}

impl SsdTier {
    /// Read `key` into `dst` (whose length must match), verifying the record.
    pub(crate) fn read_into(&self, key: &[u8], dst: &mut [u8]) -> SsdRead {
        let sh = &self.sh;
        let Some(e) = sh.index.get(key) else {
            return SsdRead::Miss;
        };
        if dst.len() as u64 != e.loc.payload_len {
            return SsdRead::SizeMismatch {
                stored: e.loc.payload_len,
            };
        }
        let verdict = {
            let g = sh.segments.slot_gens[e.seg as usize].read();
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
                inc(&sh.c.read_bytes, e.loc.payload_len);
                let mut t = sh.segments.table.lock();
                let m = &mut t.slots[e.seg as usize];
                if m.generation == e.generation {
                    m.last_access = sh.tick.fetch_add(1, Relaxed);
                }
                SsdRead::Hit { depth: e.loc.depth }
            }
            Ok(false) | Err(_) => {
                // A remove unlinks the entry before it overwrites the record's header, so a
                // record read as bad whose entry is gone was removed under this read: a miss,
                // not damage.
                let mut shard = sh.index.shard(key).write();
                if !shard.get(key).is_some_and(|x| {
                    x.seg == e.seg && x.loc.offset == e.loc.offset && x.generation == e.generation
                }) {
                    return SsdRead::Miss;
                }
                if verdict.is_ok() {
                    inc(&sh.c.checksum_failures, 1);
                    tracing::warn!(
                        seg = e.seg,
                        offset = e.loc.offset,
                        "kvtier: SSD record failed its checksum; served as a miss"
                    );
                } else {
                    inc(&sh.c.read_errors, 1);
                }
                // Drop the entry so the damage costs one miss, not one per read.
                shard.remove(key);
                sh.groups.removed(key);
                drop(shard);
                sh.unaccount(&e);
                SsdRead::Failed
            }
        }
    }
}
