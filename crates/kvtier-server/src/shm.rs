//! Client shared memory mapped into the server: the only `unsafe` code of this crate.
//!
//! A [`Mapping`] is one `MAP_SHARED` mapping of `[fd_offset, fd_offset + len)` of a memfd a
//! client sent with `SCM_RIGHTS`, pre-faulted at registration (`MAP_POPULATE`), unmapped when
//! the last `Arc<Mapping>` goes (its session ended and no request still uses it).
//!
//! A mapping is a [`SharedRegion`]: every access names `(offset, len)` relative to the region
//! and is checked once, with overflow-safe arithmetic against the region's length, by
//! [`kvtier_store::store::CheckedBuffers::push`] before any pointer is formed, so the server
//! never touches memory outside what the client registered. The checked buffers hold an `Arc`
//! of the mapping, so it stays mapped until the last request using it has finished; the
//! embedded store (which owns put/get/rollback semantics) copies through them directly, and
//! no region registry holds the range (issue 16: one bounds check, not two).
//!
//! Only shared-memory files are accepted: `F_GET_SEALS` must succeed and the file system must
//! be tmpfs or hugetlbfs (a memfd is either), so a client cannot make server threads block in
//! page faults of a disk or FUSE file. Memfds that allow sealing are sealed against shrinking
//! and growing *before* their size is checked, so the checked size is final. Memfds that
//! cannot be sealed (SGLang's `ShmHostTensorAllocator` creates them without
//! `MFD_ALLOW_SEALING`) are entered in the SIGBUS guard ([`crate::fault_guard`]): if the client
//! truncates one, the server's fault on it revokes the region (its pages then fail) instead of
//! killing the server; stats report such regions as `sealed: false`.
//!
//! Issue 26: the server never commits memory on a client's behalf. A sparse memfd is not
//! pre-faulted, and each page buffer of a get or put is checked to have memory behind it
//! ([`Mapping::backed`], `mincore`) before the copy; a buffer over a hole fails its page. A
//! client punching a hole between that check and the copy makes the server allocate at most
//! the pages of that one batch, and never more than the bytes its uid may map.
//!
//! What the checks cannot cover: the bytes are shared with the client process, which may
//! write them while the server copies (it then gets torn bytes of its own pages, never another
//! client's).
// A named unsafe module (issue 16 lints): maps and unmaps client shared memory.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvtier_store::store::SharedRegion;
use rustix::fs::{fcntl_add_seals, fcntl_get_seals, fstat, fstatfs, FileType, SealFlags};

use crate::fault_guard::{self, Guard, GuardError};

/// `statfs` magic of tmpfs (memfds live on an internal tmpfs mount).
const TMPFS_MAGIC: i64 = 0x0102_1994;
/// `statfs` magic of hugetlbfs (`MFD_HUGETLB` memfds).
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

/// Why a region could not be mapped, or a range is not inside it.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("region length must be at least 1 byte")]
    Empty,
    #[error("the passed descriptor is not a regular shared-memory file (memfd or tmpfs)")]
    NotAFile,
    #[error("the passed descriptor is not a memfd ({0}); only tmpfs/hugetlbfs memory is mapped")]
    NotShared(&'static str),
    #[error(transparent)]
    Guard(#[from] GuardError),
    #[error("memfd range {offset}+{len} overflows")]
    Overflow { offset: u64, len: u64 },
    #[error("memfd is {size} bytes, smaller than the registered range {offset}+{len}")]
    TooShort { size: u64, offset: u64, len: u64 },
    #[error("cannot inspect the memfd: {0}")]
    Stat(#[source] std::io::Error),
    #[error("mmap of the memfd failed: {0}")]
    Map(#[source] std::io::Error),
    #[error(
        "buffer at offset {offset} of {len} bytes lies outside region {region} \
         ({label:?}, {region_len} bytes)"
    )]
    OutOfBounds {
        region: u64,
        label: String,
        region_len: usize,
        offset: u64,
        len: u64,
    },
}

/// One mapped client region.
pub struct Mapping {
    /// Start of the whole mapping (page aligned).
    base: usize,
    map_len: usize,
    /// Start of the region inside the mapping (`fd_offset` modulo the page size).
    data: usize,
    len: usize,
    sealed: bool,
    /// hugetlbfs memory is reserved at mmap, so touching it commits nothing new.
    hugetlb: bool,
    /// The SIGBUS guard of an unsealed mapping (dropped before the unmap).
    guard: Option<Guard>,
    label: String,
    region: u64,
    /// Server-wide count of live mappings (decremented after munmap).
    live: Arc<AtomicU64>,
}

// SAFETY: a Mapping is plain shared memory plus immutable metadata; every access goes through
// CheckedBuffers, which bounds-checks it and hands the bytes to the engine for one copy.
unsafe impl Send for Mapping {}
// SAFETY: see Send.
unsafe impl Sync for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("region", &self.region)
            .field("label", &self.label)
            .field("len", &self.len)
            .field("sealed", &self.sealed)
            .finish_non_exhaustive()
    }
}

impl Mapping {
    /// Map `[fd_offset, fd_offset + len)` of `fd` read-write and shared, pre-faulted when
    /// `prefault`. The descriptor is closed afterwards (the mapping keeps the memory alive).
    /// `live` counts mappings that exist.
    pub fn map(
        fd: OwnedFd,
        fd_offset: u64,
        len: u64,
        prefault: bool,
        label: &str,
        region: u64,
        live: Arc<AtomicU64>,
    ) -> Result<Mapping, ShmError> {
        if len == 0 {
            return Err(ShmError::Empty);
        }
        let overflow = ShmError::Overflow {
            offset: fd_offset,
            len,
        };
        let end = fd_offset.checked_add(len).ok_or(overflow)?;
        let stat = fstat(&fd).map_err(|e| ShmError::Stat(e.into()))?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
            return Err(ShmError::NotAFile);
        }
        let magic = fstatfs(&fd).map_err(|e| ShmError::Stat(e.into()))?.f_type as i64;
        if magic != TMPFS_MAGIC && magic != HUGETLBFS_MAGIC {
            return Err(ShmError::NotShared(
                "its file system is not tmpfs or hugetlbfs",
            ));
        }
        // Seal first, then check the size: once sealed, the size checked below is final.
        let seals = fcntl_get_seals(&fd)
            .map_err(|_| ShmError::NotShared("F_GET_SEALS is not supported on it"))?;
        let sealed = seals.contains(SealFlags::SHRINK)
            || (!seals.contains(SealFlags::SEAL)
                && fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).is_ok());
        let stat = fstat(&fd).map_err(|e| ShmError::Stat(e.into()))?;
        let size = u64::try_from(stat.st_size).unwrap_or(0);
        if size < end {
            return Err(ShmError::TooShort {
                size,
                offset: fd_offset,
                len,
            });
        }
        let page = rustix::param::page_size() as u64;
        let aligned = fd_offset - fd_offset % page;
        let data = usize::try_from(fd_offset - aligned).map_err(|_| ShmError::Overflow {
            offset: fd_offset,
            len,
        })?;
        let map_len = usize::try_from(end - aligned).map_err(|_| ShmError::Overflow {
            offset: fd_offset,
            len,
        })?;
        let len = map_len - data;
        // Pre-fault only memory the client has already allocated: populating a sparse memfd
        // would make the server commit (and be charged for) memory the client never touched.
        // hugetlbfs pages are reserved at mmap time, so prefaulting them commits nothing new.
        let hugetlb = magic == HUGETLBFS_MAGIC;
        let allocated = u64::try_from(stat.st_blocks)
            .unwrap_or(0)
            .saturating_mul(512);
        let mut flags = MapFlags::SHARED;
        if prefault && (hugetlb || allocated >= size) {
            flags |= MapFlags::POPULATE;
        }
        // SAFETY: a new mapping at a kernel-chosen address (null hint), so it aliases nothing
        // in this process; `aligned` is page aligned and `[aligned, end)` lies inside the file
        // (checked against fstat above).
        let base = unsafe {
            mmap(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                flags,
                &fd,
                aligned,
            )
        }
        .map_err(|e| ShmError::Map(e.into()))? as usize;
        live.fetch_add(1, Ordering::SeqCst);
        let mut mapping = Mapping {
            base,
            map_len,
            data: base + data,
            len,
            sealed,
            hugetlb,
            guard: None,
            label: label.to_string(),
            region,
            live,
        };
        // An unsealed memfd can shrink under us, and a hugetlbfs page can fail to materialise
        // at its first fault (pool exhausted): either raises SIGBUS, so guard the whole mapping
        // before any access (MAP_POPULATE faults it in from the kernel, not from user space).
        if !sealed || hugetlb {
            mapping.guard = Some(fault_guard::guard(base, map_len)?);
        }
        Ok(mapping)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether every page of `[offset, offset + len)` of the region (already bounds-checked
    /// by [`kvtier_store::store::CheckedBuffers::push`]) has memory behind it, so that the
    /// server's copy into (a get) or out of (a put) it commits nothing. A page of a tmpfs
    /// memfd that was never written (a hole of a sparse file, or punched) has none: touching
    /// it would allocate a page charged to the server (issue 26: a get into every slot of a
    /// 1 GiB sparse memfd grew the server by 1 GiB). `mincore` reports the file's pages in
    /// memory; a page swapped out also reads as absent (the page then fails: a miss, never a
    /// wrong byte). hugetlbfs pages are reserved at mmap and always count as backed.
    pub fn backed(&self, offset: u64, len: u64) -> bool {
        if self.hugetlb || len == 0 {
            return true;
        }
        let page = rustix::param::page_size();
        let (Ok(offset), Ok(len)) = (usize::try_from(offset), usize::try_from(len)) else {
            return false;
        };
        let Some(start) = self.data.checked_add(offset) else {
            return false;
        };
        let Some(end) = start.checked_add(len) else {
            return false;
        };
        if end > self.data + self.len {
            return false;
        }
        let mut at = start - start % page;
        let mut vec = [0u8; 1024];
        while at < end {
            let pages = ((end - at).div_ceil(page)).min(vec.len());
            // SAFETY: `[at, at + pages * page)` lies inside this mapping (`at` is page aligned
            // at or above `base`, and the last page holds `end - 1`, inside `[data, data +
            // len)`), which stays mapped while `self` lives; `vec` has room for `pages` bytes.
            let rc = unsafe { libc::mincore(at as *mut c_void, pages * page, vec.as_mut_ptr()) };
            if rc != 0 || vec[..pages].iter().any(|v| v & 1 == 0) {
                return false;
            }
            at += pages * page;
        }
        true
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn sealed(&self) -> bool {
        self.sealed
    }

    /// Whether the client revoked this region (truncated its unsealed memfd; the guard caught
    /// the fault). Its pages fail from then on.
    pub fn revoked(&self) -> bool {
        self.guard.as_ref().is_some_and(|g| !g.intact())
    }

    pub fn label(&self) -> &str {
        &self.label
    }
}

// SAFETY: `[data, data+len)` lies inside the mapping created in `map`, which stays mapped until
// `Drop` (that is, while any `Arc` of it, such as one held by CheckedBuffers, lives); a fault on
// an unsealed or hugetlbfs mapping replaces it in place with anonymous memory and the guard then
// reports it revoked (`intact` false); sealed tmpfs memory cannot lose pages. No Rust reference
// to the memory exists outside the copies CheckedBuffers makes.
unsafe impl SharedRegion for Mapping {
    fn span(&self) -> (usize, usize) {
        (self.data, self.len)
    }

    fn intact(&self) -> bool {
        !self.revoked()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Unguard before unmapping, so the handler never sees a range that is not ours.
        drop(self.guard.take());
        // SAFETY: base/map_len are exactly what mmap returned; the range is no longer guarded
        // (above) and no request holds this Mapping (we are its last owner).
        let _ = unsafe { munmap(self.base as *mut c_void, self.map_len) };
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}
