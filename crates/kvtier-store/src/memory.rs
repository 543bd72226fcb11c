//! Caller memory: the registry of regions a client may read from and write to, and the only
//! place in this crate that turns a raw (pointer, length) into a slice.
//!
//! Invariant: a slice is made only for a range that lies wholly inside one registered region,
//! and a region is registered only through [`RegionRegistry::register`], whose caller promises
//! the memory stays mapped and valid until it is unregistered (or the registry is dropped).
//! SGLang host pools satisfy that: their buffers live as long as the pool, and the Python
//! adapter holds the pool for as long as the store is open.
// A named unsafe module (issue 16 lints): the registry reads and writes caller memory.
#![allow(unsafe_code)]

use parking_lot::RwLock;

use crate::error::ClientError;

/// Whether a region's memory is still the caller's: `false` once its owner revoked it (the
/// server's guard caught a fault on a truncated memfd and replaced the pages). Asked after
/// every copy; a copy that touched revoked memory fails instead of taking or giving bytes.
pub type RegionIntact = std::sync::Arc<dyn Fn() -> bool + Send + Sync>;

/// Identifies a registered region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionId(pub u64);

#[derive(Clone)]
struct Region {
    id: RegionId,
    start: usize,
    end: usize,
    label: String,
    intact: Option<RegionIntact>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.id)
            .field("start", &self.start)
            .field("end", &self.end)
            .field("label", &self.label)
            .field("checked", &self.intact.is_some())
            .finish()
    }
}

/// A snapshot of one region, for stats and logs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionInfo {
    pub id: RegionId,
    pub start: usize,
    pub len: usize,
    pub label: String,
}

/// Registered caller memory. Regions may overlap (two pools can expose views of one tensor);
/// a range is accepted when some region contains all of it.
#[derive(Debug, Default)]
pub struct RegionRegistry {
    regions: RwLock<Vec<Region>>,
    next_id: std::sync::atomic::AtomicU64,
}

impl RegionRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Register `[start, start+len)`. Registering the same range twice returns the first id.
    ///
    /// # Safety
    /// The range must be one live allocation that stays mapped, readable and writable until
    /// [`unregister`](Self::unregister) is called for the returned id or the registry is
    /// dropped, and no Rust reference may alias it for that time.
    pub unsafe fn register(
        &self,
        start: usize,
        len: usize,
        label: &str,
    ) -> Result<RegionId, ClientError> {
        // SAFETY: forwarded contract.
        unsafe { self.register_checked(start, len, label, None) }
    }

    /// [`register`](Self::register) with an `intact` check asked after every copy from or to
    /// the region (see [`RegionIntact`]).
    ///
    /// # Safety
    /// As [`register`](Self::register), except that the memory may be revoked (replaced by
    /// other readable, writable memory of the same range) as long as `intact` says so from
    /// then on.
    pub unsafe fn register_checked(
        &self,
        start: usize,
        len: usize,
        label: &str,
        intact: Option<RegionIntact>,
    ) -> Result<RegionId, ClientError> {
        if start == 0 {
            return Err(ClientError::InvalidRegion {
                ptr: start,
                len,
                reason: "null pointer",
            });
        }
        if len == 0 {
            return Err(ClientError::InvalidRegion {
                ptr: start,
                len,
                reason: "zero length",
            });
        }
        let end = start.checked_add(len).ok_or(ClientError::InvalidRegion {
            ptr: start,
            len,
            reason: "range overflows the address space",
        })?;
        let mut regions = self.regions.write();
        if let Some(existing) = regions.iter().find(|r| r.start == start && r.end == end) {
            return Ok(existing.id);
        }
        let id = RegionId(
            self.next_id
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        );
        let at = regions.partition_point(|r| r.start <= start);
        regions.insert(
            at,
            Region {
                id,
                start,
                end,
                label: label.to_string(),
                intact,
            },
        );
        Ok(id)
    }

    pub fn unregister(&self, id: RegionId) -> bool {
        let mut regions = self.regions.write();
        let before = regions.len();
        regions.retain(|r| r.id != id);
        regions.len() != before
    }

    pub fn clear(&self) {
        self.regions.write().clear();
    }

    pub fn regions(&self) -> Vec<RegionInfo> {
        self.regions
            .read()
            .iter()
            .map(|r| RegionInfo {
                id: r.id,
                start: r.start,
                len: r.end - r.start,
                label: r.label.clone(),
            })
            .collect()
    }

    /// Whether `[ptr, ptr+len)` lies inside one registered region.
    pub fn contains(&self, ptr: usize, len: usize) -> bool {
        let Some(end) = ptr.checked_add(len) else {
            return false;
        };
        if ptr == 0 {
            return false;
        }
        let regions = self.regions.read();
        // Regions are sorted by start; only those starting at or before ptr can contain it.
        let upto = regions.partition_point(|r| r.start <= ptr);
        regions[..upto].iter().rev().any(|r| r.end >= end)
    }

    /// Run `f` over the caller bytes at `[ptr, ptr+len)` after checking they are registered.
    pub fn with_source<R>(
        &self,
        ptr: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, ClientError> {
        self.with_checked_source(ptr, len, |bytes, _| f(bytes))
    }

    /// [`with_source`](Self::with_source) that also hands `f` the region's intact check, for
    /// a consumer that must ask it after copying and before publishing the bytes (a put). The
    /// call fails before `f` runs when the region is already revoked.
    pub fn with_checked_source<R>(
        &self,
        ptr: usize,
        len: usize,
        f: impl FnOnce(&[u8], &dyn Fn() -> bool) -> R,
    ) -> Result<R, ClientError> {
        let intact = self.check(ptr, len)?;
        let intact: &dyn Fn() -> bool = match &intact {
            Some(check) => check.as_ref(),
            None => &|| true,
        };
        if !intact() {
            return Err(ClientError::MemoryRevoked { ptr, len });
        }
        if len == 0 {
            return Ok(f(&[], intact));
        }
        // SAFETY: check() proved the range lies inside a registered region, and register()'s
        // contract keeps that region mapped and readable while it is registered.
        let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
        Ok(f(bytes, intact))
    }

    /// Run `f` over the caller bytes at `[ptr, ptr+len)` for writing, after the same check.
    pub fn with_destination<R>(
        &self,
        ptr: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, ClientError> {
        let intact = self.check(ptr, len)?;
        let revoked = || intact.as_ref().is_some_and(|check| !check());
        if revoked() {
            return Err(ClientError::MemoryRevoked { ptr, len });
        }
        if len == 0 {
            return Ok(f(&mut []));
        }
        // SAFETY: check() proved the range lies inside a registered region; register()'s
        // contract keeps it mapped and writable and free of Rust aliases while registered.
        let bytes = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
        let result = f(bytes);
        // Bytes written into revoked memory never reached the caller.
        if revoked() {
            return Err(ClientError::MemoryRevoked { ptr, len });
        }
        Ok(result)
    }

    /// Checked shared views of many caller buffers at once (the cluster transport sends
    /// them). Each is checked as [`with_source`](Self::with_source) checks one.
    pub fn source_slices(&self, bufs: &[crate::batch::MemRef]) -> Vec<Result<&[u8], ClientError>> {
        bufs.iter()
            .map(|b| {
                self.check(b.ptr, b.len)?;
                if b.len == 0 {
                    return Ok(&[][..]);
                }
                // SAFETY: check() proved the range lies inside a registered region, which
                // register()'s contract keeps mapped and readable while registered.
                Ok(unsafe { std::slice::from_raw_parts(b.ptr as *const u8, b.len) })
            })
            .collect()
    }

    /// Checked exclusive views of many caller buffers at once (the cluster transport reads
    /// into them). A buffer that overlaps another one of the list is refused, so no two of
    /// the returned slices alias.
    // The slices borrow the caller's registered memory, not `self`; `self` only proves the
    // ranges are registered, so the `&self` to `&mut` shape is intended.
    #[allow(clippy::mut_from_ref)]
    pub fn destination_slices(
        &self,
        bufs: &[crate::batch::MemRef],
    ) -> Vec<Result<&mut [u8], ClientError>> {
        let mut order: Vec<usize> = (0..bufs.len()).filter(|&i| bufs[i].len > 0).collect();
        order.sort_by_key(|&i| bufs[i].ptr);
        let mut overlapping = vec![false; bufs.len()];
        let mut reach: Option<(usize, usize)> = None; // (end, index) of the farthest so far
        for &i in &order {
            let (start, end) = (bufs[i].ptr, bufs[i].ptr.saturating_add(bufs[i].len));
            if let Some((far_end, j)) = reach {
                if start < far_end {
                    overlapping[i] = true;
                    overlapping[j] = true;
                }
            }
            if reach.is_none_or(|(far_end, _)| end > far_end) {
                reach = Some((end, i));
            }
        }
        bufs.iter()
            .zip(overlapping)
            .map(|(b, overlaps)| {
                self.check(b.ptr, b.len)?;
                if overlaps {
                    return Err(ClientError::InvalidRegion {
                        ptr: b.ptr,
                        len: b.len,
                        reason: "overlaps another destination buffer of the same batch",
                    });
                }
                if b.len == 0 {
                    return Ok(&mut [][..]);
                }
                // SAFETY: check() proved the range lies inside a registered region, which
                // register()'s contract keeps mapped, writable and free of Rust aliases while
                // registered; the overlap check above makes the slices of this call disjoint.
                Ok(unsafe { std::slice::from_raw_parts_mut(b.ptr as *mut u8, b.len) })
            })
            .collect()
    }

    /// `Ok` when `[ptr, ptr+len)` lies inside a registered region, with that region's intact
    /// check if it has one. A zero-length range still has to point into registered memory: a
    /// stray pointer is a caller bug worth reporting even when nothing would be copied.
    fn check(&self, ptr: usize, len: usize) -> Result<Option<RegionIntact>, ClientError> {
        let outside = ClientError::OutsideRegisteredMemory { ptr, len };
        let Some(end) = ptr.checked_add(len) else {
            return Err(outside);
        };
        if ptr == 0 {
            return Err(outside);
        }
        let regions = self.regions.read();
        let upto = regions.partition_point(|r| r.start <= ptr);
        match regions[..upto].iter().rev().find(|r| r.end >= end) {
            Some(region) => Ok(region.intact.clone()),
            None => Err(outside),
        }
    }
}

/// A shared-memory staging window of the server mode: a sealed memfd this process creates,
/// maps, and registers with the server, through which pages of memory the server cannot map
/// (plain anonymous host pools, Python buffers of the legacy path) are copied.
///
/// Invariant: `ptr..ptr+len` is a `MAP_SHARED` mapping of `fd` owned by this value (unmapped in
/// `Drop`); every access is bounds-checked; the memfd is sealed against shrinking, so neither
/// side can ever fault on a truncated page.
#[derive(Debug)]
pub struct StagingMap {
    fd: std::os::fd::OwnedFd,
    ptr: usize,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; `&self` methods copy
// through bounds-checked ranges and `&mut self` methods hold exclusive access.
unsafe impl Send for StagingMap {}
// SAFETY: see Send; `&self` only reads the mapping.
unsafe impl Sync for StagingMap {}

impl StagingMap {
    /// Create, size, seal and map a new memfd of `len` bytes.
    pub fn create(len: usize, name: &str) -> std::io::Result<StagingMap> {
        Self::create_sealed(len, name, true)
    }

    /// As [`create`](Self::create) but without `MFD_ALLOW_SEALING`, like SGLang's shm host
    /// pools: for benchmarks and tests of the server's guarded (unsealed) path. Nothing in
    /// this process truncates it, so the invariant still holds here.
    pub fn create_unsealed(len: usize, name: &str) -> std::io::Result<StagingMap> {
        Self::create_sealed(len, name, false)
    }

    fn create_sealed(len: usize, name: &str, seal: bool) -> std::io::Result<StagingMap> {
        use rustix::fs::{fcntl_add_seals, ftruncate, memfd_create, MemfdFlags, SealFlags};
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        if len == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "empty staging ring",
            ));
        }
        let flags = if seal {
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING
        } else {
            MemfdFlags::CLOEXEC
        };
        let fd = memfd_create(name, flags)?;
        ftruncate(&fd, len as u64)?;
        if seal {
            fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
        }
        // SAFETY: a fresh shared mapping chosen by the kernel (null hint), of a memfd that is
        // exactly `len` bytes long and sealed against shrinking, so every page stays backed.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::POPULATE,
                &fd,
                0,
            )
        }?;
        Ok(StagingMap {
            fd,
            ptr: ptr as usize,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of the mapping in this process (for registering it as caller memory).
    pub fn addr(&self) -> usize {
        self.ptr
    }

    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), ClientError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(ClientError::InvalidRegion {
                ptr: offset,
                len,
                reason: "range outside the staging ring",
            }),
        }
    }

    /// Copy `src` into the ring at `offset`.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), ClientError> {
        self.check(offset, src.len())?;
        // SAFETY: check() keeps the range inside the live mapping; `&mut self` excludes other
        // accesses from this process, and the server only touches the ring during a request
        // this connection is waiting on.
        let dst =
            unsafe { std::slice::from_raw_parts_mut((self.ptr + offset) as *mut u8, src.len()) };
        dst.copy_from_slice(src);
        Ok(())
    }

    /// Copy ring bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), ClientError> {
        self.check(offset, dst.len())?;
        // SAFETY: as in write(); the range is inside the live mapping.
        let src =
            unsafe { std::slice::from_raw_parts((self.ptr + offset) as *const u8, dst.len()) };
        dst.copy_from_slice(src);
        Ok(())
    }
}

impl Drop for StagingMap {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly the mapping create() made, and no slice of it outlives a
        // method call.
        let _ = unsafe { rustix::mm::munmap(self.ptr as *mut std::ffi::c_void, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_must_lie_inside_one_region() {
        let mut a = vec![1u8; 4096];
        let mut b = vec![2u8; 4096];
        let reg = RegionRegistry::new();
        let (pa, pb) = (a.as_mut_ptr() as usize, b.as_mut_ptr() as usize);
        // SAFETY: both vectors outlive the registry uses below and are not otherwise borrowed.
        let ia = unsafe { reg.register(pa, a.len(), "a") }.unwrap();
        // SAFETY: as above.
        unsafe { reg.register(pb, b.len(), "b") }.unwrap();
        assert!(reg.contains(pa, 4096));
        assert!(reg.contains(pa + 100, 10));
        assert!(!reg.contains(pa + 4090, 10), "runs past the end");
        assert!(!reg.contains(pa.wrapping_sub(1), 2), "starts before");
        assert!(!reg.contains(usize::MAX - 2, 10), "overflow");
        assert!(!reg.contains(0, 1));
        assert_eq!(
            reg.with_source(pb + 1, 3, |s| s.to_vec()).unwrap(),
            vec![2, 2, 2]
        );
        reg.with_destination(pa, 2, |d| d.copy_from_slice(&[7, 8]))
            .unwrap();
        assert_eq!(&a[..3], &[7, 8, 1]);
        assert!(matches!(
            reg.with_source(pa + 4095, 2, |_| ()),
            Err(ClientError::OutsideRegisteredMemory { .. })
        ));
        assert!(reg.unregister(ia));
        assert!(!reg.contains(pa, 1));
        assert!(reg.contains(pb, 1));
    }

    #[test]
    fn invalid_regions_are_rejected_and_duplicates_dedup() {
        let reg = RegionRegistry::new();
        // SAFETY: these calls fail validation before anything is recorded.
        unsafe {
            assert!(reg.register(0, 10, "null").is_err());
            assert!(reg.register(16, 0, "empty").is_err());
            assert!(reg.register(usize::MAX - 1, 10, "wrap").is_err());
        }
        let mut v = vec![0u8; 64];
        let p = v.as_mut_ptr() as usize;
        // SAFETY: v outlives the registry.
        let (i1, i2) = unsafe {
            (
                reg.register(p, 64, "v").unwrap(),
                reg.register(p, 64, "v").unwrap(),
            )
        };
        assert_eq!(i1, i2);
        assert_eq!(reg.regions().len(), 1);
    }
}
