//! The DRAM arena: one anonymous mapping, and the only `unsafe` code of the engine.
//!
//! Owns: the mapping, its base pointer, and the two copies (scatter in, gather out) between
//! caller buffers and block extents.
//!
//! Invariants this module checks itself:
//! - every extent copied lies inside the mapping (asserted before any pointer arithmetic);
//! - a copy never touches more bytes than its extents cover (asserted).
//!
//! Invariants it relies on (upheld by `dram/mod.rs` and `dram/allocator.rs`, the only callers,
//! since [`Arena::write`] and [`Arena::read`] are visible only inside `crate::dram`):
//! - the extents of live allocations are pairwise disjoint (the allocator never hands out a
//!   block twice before it is freed, and panics on a double free);
//! - bytes of an allocation are written only through `&mut DramAllocation` (before the object
//!   is published, so no reader exists), and read only through `&DramAllocation`; Rust's borrow
//!   rules then guarantee no write overlaps any other access to the same bytes.

#![allow(unsafe_code)]

use std::io;

use memmap2::MmapMut;

use super::allocator::Extent;

/// Bytes between the pre-fault touches: the smallest page size of the platforms we run on.
const PREFAULT_STRIDE: usize = 4096;
/// Bytes between looks at the clock for the pre-fault's progress line (a multiple of the
/// stride).
const PREFAULT_PROGRESS_EVERY: usize = 64 << 20;

/// One anonymous mapping divided into equal blocks.
pub(crate) struct Arena {
    /// Base of the mapping, taken once from `map` at creation; all accesses go through it so
    /// that no `&`/`&mut` reference to the whole mapping ever coexists with a copy.
    base: *mut u8,
    len: usize,
    block_size: usize,
    /// Keeps the mapping alive; never dereferenced after `base` was taken.
    _map: MmapMut,
}

// SAFETY: `Arena` is a pointer into a mapping it owns (kept alive by `_map`) and carries no
// thread-affine state. Concurrent use is sound because the only accesses are `write`/`read`,
// whose callers guarantee (see the module invariants) that a written extent is never accessed
// by anyone else at the same time.
unsafe impl Send for Arena {}
// SAFETY: as for `Send`: shared `&Arena` only allows `write`/`read`, each confined to extents
// the caller owns exclusively (write) or shares read-only (read).
unsafe impl Sync for Arena {}

impl Arena {
    /// Map `blocks * block_size` bytes of anonymous memory; with `prefault`, touch every page
    /// now so the first put into a block does not pay the page fault.
    pub(crate) fn new(blocks: u32, block_size: u32, prefault: bool) -> io::Result<Arena> {
        let block_size = block_size as usize;
        let len = (blocks as usize)
            .checked_mul(block_size)
            .ok_or_else(|| io::Error::other("arena length overflows usize"))?;
        let mut map = MmapMut::map_anon(len)?;
        let base = map.as_mut_ptr();
        if prefault {
            // Issue 27: a large arena takes seconds per GiB; say how far it got.
            let mut progress =
                crate::progress::Progress::new("pre-faulting the DRAM arena", len as u64);
            for offset in (0..len).step_by(PREFAULT_STRIDE) {
                if offset % PREFAULT_PROGRESS_EVERY == 0 {
                    progress.at(offset as u64);
                }
                // SAFETY: `offset < len`, so the byte is inside the mapping we just created
                // and own exclusively (no other reference to it exists yet). A volatile write
                // keeps the compiler from eliding the store of a zero into zeroed memory; the
                // write fault is what allocates the page.
                unsafe { base.add(offset).write_volatile(0) };
            }
            progress.done();
        }
        Ok(Arena {
            base,
            len,
            block_size,
            _map: map,
        })
    }

    /// Mapping length in bytes (whole blocks).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Base address of the mapping (issue 17: registered whole with an RDMA-capable
    /// transport, which only reads pinned extents of it).
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.base
    }

    /// Byte range of `extent`, asserted to lie inside the mapping.
    fn range(&self, extent: Extent) -> (usize, usize) {
        let start = extent.start as usize * self.block_size;
        let bytes = extent.count as usize * self.block_size;
        assert!(
            start <= self.len && bytes <= self.len - start,
            "extent {extent:?} outside arena of {} bytes",
            self.len
        );
        (start, bytes)
    }

    /// Scatter `src` over `extents` in order. The caller must own `extents` exclusively (it
    /// holds `&mut` on the allocation they belong to).
    pub(in crate::dram) fn write(&self, extents: &[Extent], src: &[u8]) {
        let mut done = 0usize;
        for &extent in extents {
            if done == src.len() {
                break;
            }
            let (start, bytes) = self.range(extent);
            let n = bytes.min(src.len() - done);
            // SAFETY: `[start, start + n)` lies inside the mapping (asserted by `range`, and
            // `n <= bytes`); `[done, done + n)` lies inside `src` (`n <= src.len() - done`).
            // `src` is a caller buffer, never part of the arena's owned extents, and the
            // extent is owned exclusively by the caller (module invariants), so the regions do
            // not overlap and no other thread accesses the destination during the copy.
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr().add(done), self.base.add(start), n);
            }
            done += n;
        }
        assert_eq!(done, src.len(), "extents too small for the object");
    }

    /// The first `n` bytes of `extent` as a slice, for handing to the kernel (O_DIRECT writes
    /// straight from DRAM). The caller must hold a shared borrow of the allocation the extent
    /// belongs to for as long as the slice lives (no writer can exist meanwhile).
    pub(in crate::dram) fn slice(&self, extent: Extent, n: usize) -> &[u8] {
        let (start, bytes) = self.range(extent);
        assert!(n <= bytes, "slice of {n} bytes from an extent of {bytes}");
        // SAFETY: `[start, start + n)` lies inside the mapping (asserted by `range` and
        // `n <= bytes`), which lives as long as `self`. The bytes were fully written before the
        // object was published and the caller's shared borrow of the owning allocation (module
        // invariants) excludes every writer while the returned slice lives.
        unsafe { std::slice::from_raw_parts(self.base.add(start), n) }
    }

    /// Gather `dst.len()` bytes from `extents` in order into `dst`. The caller must hold a
    /// shared borrow of the allocation the extents belong to (no writer can exist).
    pub(in crate::dram) fn read(&self, extents: &[Extent], dst: &mut [u8]) {
        let mut done = 0usize;
        for &extent in extents {
            if done == dst.len() {
                break;
            }
            let (start, bytes) = self.range(extent);
            let n = bytes.min(dst.len() - done);
            // SAFETY: the source `[start, start + n)` is inside the mapping (asserted by
            // `range`) and was fully written before the object was published; only shared
            // readers can reach it now (module invariants). The destination is `n` bytes
            // inside `dst` (`n <= dst.len() - done`), which we borrow mutably, so it cannot
            // overlap the arena extents that are owned by the allocation.
            unsafe {
                std::ptr::copy_nonoverlapping(self.base.add(start), dst.as_mut_ptr().add(done), n);
            }
            done += n;
        }
        assert_eq!(done, dst.len(), "extents too small for the object");
    }
}
