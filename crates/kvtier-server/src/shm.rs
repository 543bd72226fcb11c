//! Client shared memory mapped into the server: the only `unsafe` code of this crate.
//!
//! A [`Mapping`] is one `MAP_SHARED` mapping of `[fd_offset, fd_offset + len)` of a memfd a
//! client sent with `SCM_RIGHTS`, pre-faulted at registration (`MAP_POPULATE`), unmapped when
//! the last `Arc<Mapping>` goes (its session ended and no request still uses it).
//!
//! Every access names `(offset, len)` relative to the region and is checked with overflow-safe
//! arithmetic against the region's length before any pointer is formed, so the server never
//! touches memory outside what the client registered. To hand the bytes to the engine through
//! the embedded [`kvtier_client::Client`] (which owns put/get/rollback semantics), the mapping
//! registers its exact range in that client's region registry and unregisters it in `Drop`
//! *before* unmapping, so the registry never holds a range that is not mapped.
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
//! What the checks cannot cover: the bytes are shared with the client process, which may
//! write them while the server copies (it then gets torn bytes of its own pages, never another
//! client's).
// A named unsafe module (issue 16 lints): maps and unmaps client shared memory.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvtier_client::memory::RegionId;
use kvtier_client::{Client, MemRef};
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
    #[error("cannot register the mapping: {0}")]
    Register(String),
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
    /// The SIGBUS guard of an unsealed mapping (dropped before the unmap).
    guard: Option<Guard>,
    label: String,
    region: u64,
    /// The embedded client whose registry holds `[data, data+len)`, and the id there.
    registered: Option<(Arc<Client>, RegionId)>,
    /// Server-wide count of live mappings (decremented after munmap).
    live: Arc<AtomicU64>,
}

// SAFETY: a Mapping is plain shared memory plus immutable metadata; every access goes through
// bounds-checked methods that hand the bytes to the engine for one copy.
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
    /// `prefault`, and register it in `client`'s region registry. The descriptor is closed
    /// afterwards (the mapping keeps the memory alive). `live` counts mappings that exist.
    #[allow(clippy::too_many_arguments)]
    pub fn map(
        fd: OwnedFd,
        fd_offset: u64,
        len: u64,
        prefault: bool,
        label: &str,
        region: u64,
        client: &Arc<Client>,
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
            guard: None,
            label: label.to_string(),
            region,
            registered: None,
            live,
        };
        // An unsealed memfd can shrink under us, and a hugetlbfs page can fail to materialise
        // at its first fault (pool exhausted): either raises SIGBUS, so guard the whole mapping
        // before any access (MAP_POPULATE faults it in from the kernel, not from user space).
        if !sealed || hugetlb {
            mapping.guard = Some(fault_guard::guard(base, map_len)?);
        }
        let id = match &mapping.guard {
            // SAFETY: `[data, data+len)` is inside the mapping created above, which stays
            // mapped until Drop (revoked memory is replaced in place, and the check says so),
            // and Drop unregisters it from `client` before unmapping.
            Some(guard) => unsafe {
                client.register_region_checked(mapping.data, len, label, guard.intact_check())
            },
            // SAFETY: as above; a sealed memfd cannot lose pages, so no check is needed.
            None => unsafe { client.register_region(mapping.data, len, label) },
        }
        .map_err(|e| ShmError::Register(e.to_string()))?;
        mapping.registered = Some((Arc::clone(client), id));
        Ok(mapping)
    }

    pub fn len(&self) -> usize {
        self.len
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

    /// The buffer `(offset, len)` of this region as an address range the registered client
    /// accepts, after the bounds check.
    pub fn resolve(&self, offset: u64, len: u64) -> Result<MemRef, ShmError> {
        let out_of_bounds = || ShmError::OutOfBounds {
            region: self.region,
            label: self.label.clone(),
            region_len: self.len,
            offset,
            len,
        };
        let end = offset.checked_add(len).ok_or_else(out_of_bounds)?;
        if end > self.len as u64 {
            return Err(out_of_bounds());
        }
        // end <= self.len, so both fit usize and data + offset stays inside the mapping.
        let offset = usize::try_from(offset).map_err(|_| out_of_bounds())?;
        let len = usize::try_from(len).map_err(|_| out_of_bounds())?;
        Ok(MemRef {
            ptr: self.data + offset,
            len,
        })
    }
}

/// Register a memfd mapping this process owns (benchmarks, tests) with a client, zero copy in
/// server mode. The registration must end before `map` is dropped: callers unregister (or drop
/// the client) first.
pub fn register_own_memfd(
    client: &Client,
    map: &kvtier_client::memory::StagingMap,
    label: &str,
) -> Result<RegionId, kvtier_client::ClientError> {
    // SAFETY: `map` is a live shared mapping of exactly `map.len()` bytes at `map.addr()`,
    // which is `[0, len)` of `map.fd()`; the caller keeps it alive while registered.
    unsafe { client.register_memfd(map.addr(), map.len(), map.fd(), 0, label) }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Some((client, id)) = self.registered.take() {
            client.unregister_region(id);
        }
        // Unguard before unmapping, so the handler never sees a range that is not ours.
        drop(self.guard.take());
        // SAFETY: base/map_len are exactly what mmap returned; the range is no longer in any
        // registry or guard (above) and no request holds this Mapping (we are its last owner).
        let _ = unsafe { munmap(self.base as *mut c_void, self.map_len) };
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}
