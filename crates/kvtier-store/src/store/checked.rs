//! Page buffers whose bounds were proved once, where the memory is owned: the entry of
//! `kvtier serve` into the embedded store (issue 16: one bounds check per buffer, not two).
//!
//! Owns: [`SharedRegion`], the contract of memory a server maps for a client (its mapping of a
//! client memfd), and [`CheckedBuffers`], the buffers of one page batch, each checked against
//! its region when it is pushed and carrying an `Arc` of that region for as long as the batch
//! lives. The type is the proof: a [`CheckedBuffers`] can only be built through
//! [`CheckedBuffers::push`], so the embedded store copies through it without consulting a
//! [`crate::memory::RegionRegistry`]; a caller with plain pointers (the Python module) has no
//! way to make one except by implementing the `unsafe` trait.
//!
//! Invariants:
//! - every buffer lies wholly inside the span of the region it names (checked with
//!   overflow-safe arithmetic in `push`, before any pointer is formed);
//! - the region stays alive (and so mapped, by [`SharedRegion`]'s contract) while the
//!   [`CheckedBuffers`] holding its `Arc` lives;
//! - every copy asks the region's `intact` check, as the registry path does: before a copy
//!   (a revoked region fails without copying), and after a copy into it (bytes written into
//!   revoked memory never reached the caller); a put gets the check to ask before it
//!   publishes.
// A named unsafe module (issue 16 lints): turns proved buffers into slices.
#![allow(unsafe_code)]

use std::sync::Arc;

use crate::error::ClientError;

/// Memory a server has mapped for a client and keeps mapped while any `Arc` of it lives.
///
/// # Safety
/// For as long as the value lives, implementors promise:
/// - [`span`](Self::span) returns the same `(start, len)` every time, with `start != 0` and
///   `start + len` not overflowing, and `[start, start + len)` is mapped readable and writable
///   in this process;
/// - no Rust reference aliases that memory except the slices [`CheckedBuffers`] hands out
///   for the length of one copy (other processes may write it; readers then see torn bytes of
///   that client's own pages, never another client's);
/// - the memory is replaced by other readable and writable memory of the same range (revoked)
///   only if [`intact`](Self::intact) returns `false` from then on.
pub unsafe trait SharedRegion: Send + Sync {
    /// `(start address, length)` of the memory.
    fn span(&self) -> (usize, usize);

    /// Whether the memory is still the client's (not revoked).
    fn intact(&self) -> bool;
}

/// A buffer that does not lie inside its region.
#[derive(Debug, thiserror::Error)]
#[error("buffer at offset {offset} of {len} bytes lies outside its region ({region_len} bytes)")]
pub struct OutsideRegion {
    pub offset: u64,
    pub len: u64,
    pub region_len: usize,
}

/// One proved buffer: an address range inside `held[region]`.
#[derive(Clone, Copy, Debug)]
struct Proved {
    ptr: usize,
    len: usize,
    region: usize,
}

/// The buffers of one page batch (`pages x components`, page-major, as [`crate::PageBatch`]
/// orders them), each proved to lie inside a region this value keeps alive.
#[derive(Default)]
pub struct CheckedBuffers {
    held: Vec<Arc<dyn SharedRegion>>,
    buffers: Vec<Proved>,
}

impl std::fmt::Debug for CheckedBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckedBuffers")
            .field("regions", &self.held.len())
            .field("buffers", &self.buffers)
            .finish()
    }
}

impl CheckedBuffers {
    pub fn with_capacity(buffers: usize) -> CheckedBuffers {
        CheckedBuffers {
            held: Vec::new(),
            buffers: Vec::with_capacity(buffers),
        }
    }

    /// Check `[offset, offset + len)` of `region` and append it: the one bounds check a
    /// buffer of a batch gets. The region is held until this value is dropped.
    pub fn push<R: SharedRegion + 'static>(
        &mut self,
        region: &Arc<R>,
        offset: u64,
        len: u64,
    ) -> Result<(), OutsideRegion> {
        let (start, region_len) = region.span();
        let outside = OutsideRegion {
            offset,
            len,
            region_len,
        };
        match offset.checked_add(len) {
            Some(end) if end <= region_len as u64 => {}
            _ => return Err(outside),
        }
        // end <= region_len, so both fit usize and start + offset + len stays inside the span.
        let (Ok(offset), Ok(len)) = (usize::try_from(offset), usize::try_from(len)) else {
            return Err(outside);
        };
        let data = Arc::as_ptr(region).cast::<()>();
        let index = match self
            .held
            .iter()
            .position(|h| std::ptr::eq(Arc::as_ptr(h).cast::<()>(), data))
        {
            Some(index) => index,
            None => {
                self.held.push(Arc::clone(region) as Arc<dyn SharedRegion>);
                self.held.len() - 1
            }
        };
        self.buffers.push(Proved {
            ptr: start + offset,
            len,
            region: index,
        });
        Ok(())
    }

    /// Number of buffers.
    pub fn len(&self) -> usize {
        self.buffers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    /// Keep the first `len` buffers (drop those of a page that failed part way).
    pub fn truncate(&mut self, len: usize) {
        self.buffers.truncate(len);
    }

    /// Bytes of every buffer together.
    pub fn total_bytes(&self) -> usize {
        self.buffers.iter().map(|b| b.len).sum()
    }

    /// Run `f` over the bytes of buffer `index` with its region's intact check (for a put, to
    /// ask after copying and before publishing). Fails before `f` runs when the region is
    /// already revoked. `index` is below [`len`](Self::len) (the store checked the shape).
    pub(crate) fn with_source<T>(
        &self,
        index: usize,
        f: impl FnOnce(&[u8], &dyn Fn() -> bool) -> T,
    ) -> Result<T, ClientError> {
        let b = self.buffers[index];
        let region = &self.held[b.region];
        let intact = || region.intact();
        if !intact() {
            return Err(ClientError::MemoryRevoked {
                ptr: b.ptr,
                len: b.len,
            });
        }
        if b.len == 0 {
            return Ok(f(&[], &intact));
        }
        // SAFETY: `push` proved [ptr, ptr+len) lies inside the region's span, and the region
        // (held in `self.held`) keeps it mapped and readable while `self` lives (SharedRegion).
        let bytes = unsafe { std::slice::from_raw_parts(b.ptr as *const u8, b.len) };
        Ok(f(bytes, &intact))
    }

    /// Run `f` over the bytes of buffer `index` for writing; fails when the region is revoked
    /// before or after the copy.
    pub(crate) fn with_destination<T>(
        &self,
        index: usize,
        f: impl FnOnce(&mut [u8]) -> T,
    ) -> Result<T, ClientError> {
        let b = self.buffers[index];
        let region = &self.held[b.region];
        let revoked = || ClientError::MemoryRevoked {
            ptr: b.ptr,
            len: b.len,
        };
        if !region.intact() {
            return Err(revoked());
        }
        if b.len == 0 {
            return Ok(f(&mut []));
        }
        // SAFETY: `push` proved [ptr, ptr+len) lies inside the region's span, which the held
        // region keeps mapped, writable and free of other Rust references (SharedRegion).
        let bytes = unsafe { std::slice::from_raw_parts_mut(b.ptr as *mut u8, b.len) };
        let result = f(bytes);
        // Bytes written into revoked memory never reached the caller.
        if !region.intact() {
            return Err(revoked());
        }
        Ok(result)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Heap memory standing in for a server's mapping of a client memfd.
    pub(crate) struct HeapRegion {
        ptr: *mut u8,
        len: usize,
        intact: AtomicBool,
    }

    // SAFETY: the allocation is owned by the value and only reached through raw pointers.
    unsafe impl Send for HeapRegion {}
    // SAFETY: see Send.
    unsafe impl Sync for HeapRegion {}

    impl HeapRegion {
        pub(crate) fn new(len: usize) -> Arc<HeapRegion> {
            let bytes: Box<[u8]> = vec![0u8; len].into_boxed_slice();
            Arc::new(HeapRegion {
                ptr: Box::into_raw(bytes).cast::<u8>(),
                len,
                intact: AtomicBool::new(true),
            })
        }

        pub(crate) fn fill(&self, offset: usize, bytes: &[u8]) {
            assert!(offset + bytes.len() <= self.len);
            // SAFETY: inside the allocation; tests write only while no copy runs.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset), bytes.len())
            }
        }

        pub(crate) fn read(&self, offset: usize, len: usize) -> Vec<u8> {
            assert!(offset + len <= self.len);
            // SAFETY: inside the allocation; tests read only while no copy runs.
            unsafe { std::slice::from_raw_parts(self.ptr.add(offset), len) }.to_vec()
        }

        pub(crate) fn revoke(&self) {
            self.intact.store(false, Ordering::Release);
        }
    }

    impl Drop for HeapRegion {
        fn drop(&mut self) {
            let slice = std::ptr::slice_from_raw_parts_mut(self.ptr, self.len);
            // SAFETY: made by Box::into_raw in `new`, freed once here.
            drop(unsafe { Box::from_raw(slice) });
        }
    }

    // SAFETY: the allocation lives as long as the value, never moves, and is reached only
    // through raw pointers; revocation is only ever reported, not performed.
    unsafe impl SharedRegion for HeapRegion {
        fn span(&self) -> (usize, usize) {
            (self.ptr as usize, self.len)
        }

        fn intact(&self) -> bool {
            self.intact.load(Ordering::Acquire)
        }
    }

    #[test]
    fn push_checks_bounds_with_overflow_safe_arithmetic() {
        let region = HeapRegion::new(4096);
        let mut bufs = CheckedBuffers::default();
        bufs.push(&region, 0, 4096).unwrap();
        bufs.push(&region, 4095, 1).unwrap();
        bufs.push(&region, 4096, 0).unwrap();
        for (offset, len) in [(4096, 1), (1, 4096), (u64::MAX, 2), (2, u64::MAX)] {
            let e = bufs.push(&region, offset, len).unwrap_err();
            assert_eq!((e.offset, e.len, e.region_len), (offset, len, 4096));
        }
        assert_eq!(bufs.len(), 3);
        assert_eq!(bufs.held.len(), 1, "one region is held once");
        assert_eq!(bufs.total_bytes(), 4097);
        bufs.truncate(1);
        assert_eq!(bufs.total_bytes(), 4096);
    }

    #[test]
    fn a_revoked_region_refuses_copies_both_ways() {
        let region = HeapRegion::new(64);
        let mut bufs = CheckedBuffers::default();
        bufs.push(&region, 8, 16).unwrap();
        assert!(bufs.with_source(0, |b, _| b.len()).is_ok());
        region.revoke();
        assert!(matches!(
            bufs.with_source(0, |_, _| ()),
            Err(ClientError::MemoryRevoked { .. })
        ));
        assert!(matches!(
            bufs.with_destination(0, |_| ()),
            Err(ClientError::MemoryRevoked { .. })
        ));
    }

    fn small_store() -> crate::store::EmbeddedStore {
        let config = kvtier_engine::EngineConfig {
            dram_capacity_bytes: 4 << 20,
            dram_prefault: false,
            ..kvtier_engine::EngineConfig::default()
        };
        crate::store::EmbeddedStore::open(config, 1).unwrap()
    }

    #[test]
    fn the_embedded_store_copies_proved_buffers_without_a_registry() {
        use crate::batch::PageBatch;
        use crate::store::Store;
        let store = small_store();
        let region = HeapRegion::new(8192);
        region.fill(0, &[1u8; 1024]);
        region.fill(1024, &[2u8; 1024]);
        let suffixes = [".k", ".v"];
        let page_keys = [b"p0".as_slice()];
        let batch = PageBatch {
            prefix: b"t\x1f",
            page_keys: &page_keys,
            suffixes: &suffixes,
        };
        let mut puts = CheckedBuffers::default();
        puts.push(&region, 0, 1024).unwrap();
        puts.push(&region, 1024, 1024).unwrap();
        let put = store.put_checked_pages(&batch, &puts, Some(&[1]));
        assert_eq!(put.ok, vec![true], "{:?}", put.errors);
        assert_eq!(store.rejected_buffers(), 0);

        let mut gets = CheckedBuffers::default();
        gets.push(&region, 4096, 1024).unwrap();
        gets.push(&region, 5120, 1024).unwrap();
        let got = store.get_checked_pages(&batch, &gets);
        assert_eq!(got.ok, vec![true], "{:?}", got.errors);
        assert_eq!(region.read(4096, 1024), vec![1u8; 1024]);
        assert_eq!(region.read(5120, 1024), vec![2u8; 1024]);

        // A shape that does not match the batch fails it whole and is counted.
        gets.truncate(1);
        assert_eq!(store.get_checked_pages(&batch, &gets).ok, vec![false]);
        assert_eq!(store.rejected_batches(), 1);
    }

    #[test]
    fn a_page_with_a_revoked_component_leaves_nothing_behind() {
        use crate::batch::PageBatch;
        use crate::store::Store;
        let store = small_store();
        let good = HeapRegion::new(4096);
        let revoked = HeapRegion::new(4096);
        let suffixes = [".k", ".v"];
        let page_keys = [b"p1".as_slice()];
        let batch = PageBatch {
            prefix: b"",
            page_keys: &page_keys,
            suffixes: &suffixes,
        };
        let mut bufs = CheckedBuffers::default();
        bufs.push(&good, 0, 512).unwrap();
        bufs.push(&revoked, 0, 512).unwrap();
        revoked.revoke();
        let put = store.put_checked_pages(&batch, &bufs, None);
        assert_eq!(put.ok, vec![false]);
        assert!(put.errors[0].contains("revoked"), "{:?}", put.errors);
        assert_eq!(store.exists_keys(&[b"p1.k", b"p1.v"]), vec![false, false]);
    }
}
