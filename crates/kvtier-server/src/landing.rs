//! The put landing area of a node's UCX data plane (issue 17): memory peers write one-sided
//! puts into, separate from the engine's DRAM arena, and the extent allocator that hands it
//! out.
//!
//! Owns: the landing memory (one page-aligned, zeroed allocation of `put_landing_mib`) and
//! [`Extents`], a first-fit allocator over it with coalescing.
//!
//! Invariants:
//! - The memory is foreign-written: once registered with UCX, any peer holding its remote key
//!   may write any byte of it at any time (even an extent it does not hold). So it is never
//!   read through a Rust reference; [`LandingMemory::copy_out`] copies an extent with a raw
//!   copy into a buffer the node owns, and everything the node decides (checksum, store) is
//!   decided on that copy. Nothing stored ever points into the landing area.
//! - The allocation outlives every registration of it: [`crate::ucx_node::UcxNode`] drops the
//!   registration first (its field order).
//! - [`Extents`] hands out disjoint ranges, each a multiple of [`EXTENT_ALIGN`] at an aligned
//!   offset, and only ranges inside the area; `used` is the sum of the ranges out.
#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::BTreeMap;
use std::ptr::NonNull;

/// Alignment and rounding of extents (a cache line: peers' writes to neighbouring extents do
/// not share one).
pub const EXTENT_ALIGN: u64 = 64;
/// Alignment of the whole area (a page, as UCX registers whole pages).
const AREA_ALIGN: usize = 4096;

/// The landing memory; freed on drop.
pub struct LandingMemory {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the allocation is owned by this value and only accessed through raw copies
// (`copy_out`) and by UCX on the node's worker; no Rust reference into it is ever handed out.
unsafe impl Send for LandingMemory {}
// SAFETY: as for `Send`: `&LandingMemory` only copies bytes out with raw copies.
unsafe impl Sync for LandingMemory {}

impl std::fmt::Debug for LandingMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LandingMemory")
            .field("base", &self.ptr)
            .field("len", &self.layout.size())
            .finish()
    }
}

impl LandingMemory {
    /// `len` zeroed bytes (zeroed: a peer reading the area never sees old heap contents).
    pub fn new(len: usize) -> Result<LandingMemory, String> {
        if len == 0 {
            return Err("an empty landing area".into());
        }
        let layout = Layout::from_size_align(len, AREA_ALIGN)
            .map_err(|e| format!("landing area of {len} bytes: {e}"))?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| format!("cannot allocate a landing area of {len} bytes"))?;
        Ok(LandingMemory { ptr, layout })
    }

    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        self.layout.size() == 0
    }

    /// A private copy of `len` bytes at `offset`; `None` if the range is not inside the area.
    pub fn copy_out(&self, offset: u64, len: u64) -> Option<Vec<u8>> {
        let end = offset.checked_add(len)?;
        if end > self.len() as u64 {
            return None;
        }
        let len = usize::try_from(len).ok()?;
        let offset = usize::try_from(offset).ok()?;
        let mut copy = Vec::with_capacity(len);
        // SAFETY: `offset + len` is inside the allocation (checked above); `copy` has room for
        // `len` bytes and does not overlap it. A peer may write the source meanwhile: the copy
        // then holds some mix of bytes, which the caller's checksum check refuses.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), copy.as_mut_ptr(), len);
            copy.set_len(len);
        }
        Some(copy)
    }
}

impl Drop for LandingMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// First-fit allocator of aligned extents in `[0, size)` (offsets, not addresses).
#[derive(Debug)]
pub struct Extents {
    size: u64,
    /// Free ranges: offset -> length, disjoint and never adjacent (coalesced).
    free: BTreeMap<u64, u64>,
    used: u64,
}

impl Extents {
    pub fn new(size: u64) -> Extents {
        let size = size - size % EXTENT_ALIGN;
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
        }
        Extents {
            size,
            free,
            used: 0,
        }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes handed out (rounded up to [`EXTENT_ALIGN`] each).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// The length an extent of `len` bytes takes.
    pub fn rounded(len: u64) -> Option<u64> {
        len.checked_add(EXTENT_ALIGN - 1)
            .map(|l| l - l % EXTENT_ALIGN)
    }

    /// An extent of at least `len` bytes: `(offset, taken length)`; `None` when no free range
    /// is large enough.
    pub fn alloc(&mut self, len: u64) -> Option<(u64, u64)> {
        let need = Self::rounded(len.max(1))?;
        let (&offset, &free) = self.free.iter().find(|(_, &l)| l >= need)?;
        self.free.remove(&offset);
        if free > need {
            self.free.insert(offset + need, free - need);
        }
        self.used += need;
        Some((offset, need))
    }

    /// Return an extent [`Self::alloc`] handed out (`taken` as it returned it).
    pub fn free(&mut self, offset: u64, taken: u64) {
        let (mut start, mut len) = (offset, taken);
        if let Some((&prev, &prev_len)) = self.free.range(..offset).next_back() {
            if prev + prev_len == offset {
                self.free.remove(&prev);
                start = prev;
                len += prev_len;
            }
        }
        if let Some(next_len) = self.free.remove(&(offset + taken)) {
            len += next_len;
        }
        self.free.insert(start, len);
        self.used = self.used.saturating_sub(taken);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_are_disjoint_and_coalesce() {
        let mut extents = Extents::new(1000);
        assert_eq!(extents.size(), 960);
        let a = extents.alloc(100).unwrap();
        let b = extents.alloc(1).unwrap();
        let c = extents.alloc(64).unwrap();
        assert_eq!((a, b, c), ((0, 128), (128, 64), (192, 64)));
        assert_eq!(extents.used(), 256);
        assert!(extents.alloc(960).is_none());
        extents.free(b.0, b.1);
        assert_eq!(extents.alloc(64).unwrap(), (128, 64));
        extents.free(128, 64);
        extents.free(a.0, a.1);
        extents.free(c.0, c.1);
        assert_eq!(extents.used(), 0);
        // Everything coalesced back into one range.
        assert_eq!(extents.alloc(960).unwrap(), (0, 960));
        assert!(extents.alloc(1).is_none());
        assert!(Extents::rounded(u64::MAX).is_none());
    }

    #[test]
    fn memory_copies_only_inside() {
        let memory = LandingMemory::new(8192).unwrap();
        assert_eq!(memory.copy_out(0, 16).unwrap(), vec![0; 16]);
        assert!(memory.copy_out(8190, 3).is_none());
        assert!(memory.copy_out(u64::MAX, 2).is_none());
        assert!(LandingMemory::new(0).is_err());
    }
}
