//! Page-aligned heap buffers for O_DIRECT I/O — the SSD tier's only `unsafe` code.
//!
//! Owns: [`AlignedBuf`], a zero-initialised heap allocation whose address and capacity are
//! multiples of [`ALIGN`] (4 KiB), as `O_DIRECT` requires of the memory it reads into and
//! writes from. Everything else in `ssd/` uses it through safe slices.
//!
//! Invariants this module keeps itself:
//! - `ptr` is either dangling (capacity 0, never dereferenced) or the start of a live
//!   allocation of exactly `cap` bytes with layout `(cap, ALIGN)`, owned by this value;
//! - `len <= cap`, and every byte of `[0, cap)` was initialised (allocated zeroed).

#![allow(unsafe_code)]

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;

/// Alignment (and length granule) of direct I/O: one 4 KiB page.
pub(crate) const ALIGN: usize = 4096;

/// A growable, 4 KiB-aligned, zero-initialised byte buffer.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: `AlignedBuf` uniquely owns its allocation (like `Vec<u8>`); it has no shared or
// thread-affine state, so moving it to another thread or sharing `&AlignedBuf` is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: `&AlignedBuf` only exposes `&[u8]`, which is `Sync`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// An empty buffer that owns no memory.
    pub(crate) const fn new() -> AlignedBuf {
        AlignedBuf {
            ptr: NonNull::dangling(),
            len: 0,
            cap: 0,
        }
    }

    /// A zeroed buffer of `len` bytes (capacity rounded up to [`ALIGN`]).
    pub(crate) fn zeroed(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::new();
        b.resize(len);
        b
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Set the length to `len`, growing the capacity if needed. Bytes that were in the buffer
    /// keep their values when it does not grow; a grown buffer is zeroed (contents are not
    /// preserved across growth: callers refill it).
    pub(crate) fn resize(&mut self, len: usize) {
        if len > self.cap {
            let cap = len.div_ceil(ALIGN).max(1) * ALIGN;
            let layout = Layout::from_size_align(cap, ALIGN).expect("buffer layout");
            // SAFETY: `layout` has a non-zero size (cap >= ALIGN).
            let raw = unsafe { alloc_zeroed(layout) };
            let Some(ptr) = NonNull::new(raw) else {
                handle_alloc_error(layout)
            };
            self.free();
            self.ptr = ptr;
            self.cap = cap;
        }
        self.len = len;
    }

    fn free(&mut self) {
        if self.cap > 0 {
            let layout = Layout::from_size_align(self.cap, ALIGN).expect("buffer layout");
            // SAFETY: `ptr` came from `alloc_zeroed(layout)` with this exact layout (module
            // invariant) and is freed once: `cap` is reset right after.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
            self.cap = 0;
            self.len = 0;
            self.ptr = NonNull::dangling();
        }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `[ptr, ptr + len)` is inside our live, initialised allocation (`len <= cap`),
        // or `len == 0` with a dangling-but-aligned pointer, which `from_raw_parts` permits.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`; `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.free();
    }
}

/// Whether `p` is a multiple of [`ALIGN`].
pub(crate) fn is_aligned(p: usize) -> bool {
    p.is_multiple_of(ALIGN)
}

/// Round `n` up to a multiple of [`ALIGN`].
pub(crate) fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN as u64) * ALIGN as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_grow() {
        let mut b = AlignedBuf::zeroed(10);
        assert!(is_aligned(b.as_slice().as_ptr() as usize));
        assert_eq!(b.as_slice(), &[0; 10]);
        b.as_mut_slice()[3] = 7;
        b.resize(8);
        assert_eq!(b.as_slice()[3], 7, "shrinking keeps contents");
        b.resize(3 * ALIGN + 1);
        assert_eq!(b.len(), 3 * ALIGN + 1);
        assert!(is_aligned(b.as_slice().as_ptr() as usize));
        assert_eq!(AlignedBuf::new().as_slice(), &[] as &[u8]);
        assert_eq!(align_up(0), 0);
        assert_eq!(align_up(1), 4096);
        assert_eq!(align_up(4096), 4096);
    }
}
