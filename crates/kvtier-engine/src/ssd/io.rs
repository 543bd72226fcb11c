//! The I/O layer: segment files opened with `O_DIRECT` when the filesystem allows it,
//! positioned reads and writes, `fdatasync`, pre-allocation, and the fault-injection hook.
//!
//! Owns: [`SegFile`] and [`Faults`]. Every byte the SSD tier moves goes through here, so an
//! injected fault behaves exactly like a failing disk to the layers above.
//!
//! With `O_DIRECT` every offset, length and memory address must be 4 KiB aligned: callers pass
//! [`super::aligned::AlignedBuf`] slices or DRAM arena extents (page aligned, whole 4 KiB
//! blocks) and block-aligned offsets only (the segment log's records are 4 KiB aligned by
//! construction).

use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::aligned::{AlignedBuf, ALIGN};
use super::uring;
use crate::config::SsdIoBackend;

/// Most slices one `pwritev` takes (Linux's `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// Injected faults (tests): each counter is the number of upcoming operations of that kind
/// that fail with `EIO` (`u64::MAX` = all of them until reset).
#[derive(Debug, Default)]
pub(crate) struct Faults {
    pub write_errors: AtomicU64,
    pub sync_errors: AtomicU64,
}

impl Faults {
    fn take(counter: &AtomicU64) -> bool {
        counter
            .fetch_update(Relaxed, Relaxed, |n| match n {
                0 => None,
                u64::MAX => Some(u64::MAX),
                n => Some(n - 1),
            })
            .is_ok()
    }
}

fn injected() -> io::Error {
    io::Error::from_raw_os_error(rustix::io::Errno::IO.raw_os_error())
}

/// Whether `dir` accepts `O_DIRECT` with 4 KiB aligned I/O (probed with a scratch file).
pub(crate) fn probe_direct(dir: &Path) -> bool {
    let path = dir.join(".kvtier-direct-probe");
    let result = (|| -> io::Result<()> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc_o_direct() | o_nofollow())
            .open(&path)?;
        check_own_file(&f, &path)?;
        let mut buf = AlignedBuf::zeroed(ALIGN);
        buf.as_mut_slice()[0] = 0x5A;
        f.write_all_at(buf.as_slice(), 0)?;
        buf.as_mut_slice()[0] = 0;
        f.read_exact_at(buf.as_mut_slice(), 0)?;
        if buf.as_slice()[0] != 0x5A {
            return Err(io::Error::other("probe read back wrong data"));
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&path);
    result.is_ok()
}

fn libc_o_direct() -> i32 {
    rustix::fs::OFlags::DIRECT.bits() as i32
}

/// `O_NOFOLLOW`: every file of the directory is opened without following a symlink, so an
/// entry planted as a link to another file (`seg-000000.kvt -> /victim`) is an error, never
/// a write through to the victim.
fn o_nofollow() -> i32 {
    rustix::fs::OFlags::NOFOLLOW.bits() as i32
}

/// An opened file of the SSD directory must be a regular file owned by this process's uid.
fn check_own_file(file: &File, path: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = file.metadata()?;
    let uid = rustix::process::geteuid().as_raw();
    if !meta.file_type().is_file() || meta.uid() != uid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a regular file owned by uid {uid}; refusing to use it",
                path.display()
            ),
        ));
    }
    Ok(())
}

/// Create the SSD directory (mode 0700, parents included) if missing, then refuse it unless it
/// is a real directory (not a symlink) owned by this uid and not writable by group or others:
/// anyone who can write it could plant entries the tier would open. The check itself is
/// [`crate::private_dir::ensure_private_dir`], shared with `kvtier serve`'s socket directory.
pub(crate) fn ensure_private_dir(dir: &Path) -> io::Result<()> {
    crate::private_dir::ensure_private_dir(dir, 0o022)
        .map_err(|e| io::Error::new(e.kind(), format!("SSD directory {e}")))
}

/// One open segment file.
pub(crate) struct SegFile {
    file: File,
    faults: Arc<Faults>,
    backend: SsdIoBackend,
}

impl SegFile {
    /// Open (creating if `create`) a segment file, with `O_DIRECT` if `direct`.
    pub(crate) fn open(
        path: &Path,
        create: bool,
        direct: bool,
        faults: Arc<Faults>,
    ) -> io::Result<SegFile> {
        let mut o = OpenOptions::new();
        o.read(true).write(true).create(create).mode(0o600);
        let mut flags = o_nofollow();
        if direct {
            flags |= libc_o_direct();
        }
        o.custom_flags(flags);
        let file = o.open(path)?;
        check_own_file(&file, path)?;
        Ok(SegFile {
            file,
            faults,
            backend: SsdIoBackend::Posix,
        })
    }

    /// Open read-only (fsck, `O_DIRECT` if `direct`).
    pub(crate) fn open_read_only(path: &Path, direct: bool) -> io::Result<SegFile> {
        let mut o = OpenOptions::new();
        o.read(true);
        let mut flags = o_nofollow();
        if direct {
            flags |= libc_o_direct();
        }
        o.custom_flags(flags);
        Ok(SegFile {
            file: o.open(path)?,
            faults: Arc::default(),
            backend: SsdIoBackend::Posix,
        })
    }

    /// Move this file's reads and writes to `backend` (`posix` unless changed).
    pub(crate) fn with_backend(mut self, backend: SsdIoBackend) -> SegFile {
        self.backend = backend;
        self
    }

    fn pwritev(&self, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
        match self.backend {
            SsdIoBackend::Posix => Ok(rustix::io::pwritev(&self.file, bufs, offset)?),
            SsdIoBackend::IoUring => uring::pwritev(self.file.as_fd(), bufs, offset),
        }
    }

    fn preadv(&self, bufs: &mut [IoSliceMut<'_>], offset: u64) -> io::Result<usize> {
        match self.backend {
            SsdIoBackend::Posix => Ok(rustix::io::preadv(&self.file, bufs, offset)?),
            SsdIoBackend::IoUring => uring::preadv(self.file.as_fd(), bufs, offset),
        }
    }

    pub(crate) fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    /// Make the file exactly `size` bytes with its blocks allocated (`fallocate`, or a plain
    /// length change where the filesystem cannot pre-allocate).
    pub(crate) fn preallocate(&self, size: u64) -> io::Result<()> {
        if self.len()? > size {
            self.file.set_len(size)?;
        }
        match rustix::fs::fallocate(&self.file, rustix::fs::FallocateFlags::empty(), 0, size) {
            Ok(()) => Ok(()),
            Err(e) if e == rustix::io::Errno::NOSPC => Err(e.into()),
            Err(_) => self.file.set_len(size),
        }
    }

    /// Read into `buf` at `offset` until it is full or end of file; returns bytes read.
    pub(crate) fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            let rest = &mut [IoSliceMut::new(&mut buf[done..])];
            match self.preadv(rest, offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }

    /// Vectored read of exactly the total length of `bufs` at `offset`.
    pub(crate) fn read_vectored_exact(
        &self,
        bufs: &mut [IoSliceMut<'_>],
        offset: u64,
    ) -> io::Result<()> {
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        let got = self.preadv(bufs, offset)?;
        if got != want {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("short read: {got} of {want} bytes"),
            ));
        }
        Ok(())
    }

    /// Write all of `buf` at `offset` (subject to injected faults).
    pub(crate) fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if Faults::take(&self.faults.write_errors) {
            return Err(injected());
        }
        self.write_parts_unchecked(&[buf], offset)
    }

    /// Write all of `parts`, back to back, at `offset` with `pwritev` (subject to injected
    /// faults). Short writes are continued; at most [`IOV_MAX`] slices go in one call.
    pub(crate) fn write_parts_at(&self, parts: &[&[u8]], offset: u64) -> io::Result<()> {
        if Faults::take(&self.faults.write_errors) {
            return Err(injected());
        }
        self.write_parts_unchecked(parts, offset)
    }

    fn write_parts_unchecked(&self, parts: &[&[u8]], offset: u64) -> io::Result<()> {
        let mut at = offset;
        let mut first = 0; // index of the first part not fully written
        let mut skip = 0; // bytes of `parts[first]` already written
        while first < parts.len() {
            let end = parts.len().min(first + IOV_MAX);
            let iov: Vec<IoSlice<'_>> = std::iter::once(&parts[first][skip..])
                .chain(parts[first + 1..end].iter().copied())
                .map(IoSlice::new)
                .collect();
            let mut n = match self.pwritev(&iov, at) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            at += n as u64;
            while n > 0 {
                let left = parts[first].len() - skip;
                if n < left {
                    skip += n;
                    n = 0;
                } else {
                    n -= left;
                    first += 1;
                    skip = 0;
                }
            }
            while first < parts.len() && parts[first].len() == skip {
                first += 1;
                skip = 0;
            }
        }
        Ok(())
    }

    /// `fdatasync` (subject to injected faults).
    pub(crate) fn sync(&self) -> io::Result<()> {
        if Faults::take(&self.faults.sync_errors) {
            return Err(injected());
        }
        rustix::fs::fdatasync(&self.file)?;
        Ok(())
    }
}

/// `fsync` a directory so that entries created or removed in it are durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Take an exclusive advisory lock on `dir/LOCK` (held while the returned file lives).
pub(crate) fn lock_dir(dir: &Path) -> io::Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(o_nofollow())
        .open(dir.join("LOCK"))?;
    check_own_file(&f, &dir.join("LOCK"))?;
    rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive).map_err(|e| {
        if e == rustix::io::Errno::WOULDBLOCK {
            io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{} is in use by another kvtier engine", dir.display()),
            )
        } else {
            e.into()
        }
    })?;
    Ok(f)
}

/// Path of segment `id` in `dir`.
pub(crate) fn segment_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("seg-{id:06}.kvt"))
}

/// Segment ids present in `dir`, ascending. A segment-named entry that is not a regular file
/// owned by this uid (a symlink, a device, another user's file) is foreign: it is skipped with
/// a warning and its directory entry removed (never what it points to), so the id can be
/// created afresh and nothing is ever written through it.
pub(crate) fn list_segments(dir: &Path) -> io::Result<Vec<u32>> {
    use std::os::unix::fs::MetadataExt;
    let uid = rustix::process::geteuid().as_raw();
    let mut ids = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(id) = name
            .strip_prefix("seg-")
            .and_then(|s| s.strip_suffix(".kvt"))
            .and_then(|s| s.parse::<u32>().ok())
        {
            let meta = std::fs::symlink_metadata(entry.path())?;
            if !meta.file_type().is_file() || meta.uid() != uid {
                tracing::warn!(
                    entry = %entry.path().display(),
                    owner = meta.uid(),
                    "kvtier: foreign entry in the SSD directory (not a regular file of ours): \
                     skipped and unlinked"
                );
                std::fs::remove_file(entry.path())?;
                continue;
            }
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn injected_faults_fail_then_clear() {
        let dir = tempfile::tempdir().unwrap();
        let faults = Arc::new(Faults::default());
        let direct = probe_direct(dir.path());
        let f = SegFile::open(&dir.path().join("x"), true, direct, Arc::clone(&faults)).unwrap();
        f.preallocate(64 << 10).unwrap();
        assert_eq!(f.len().unwrap(), 64 << 10);
        let buf = AlignedBuf::zeroed(ALIGN);
        faults.write_errors.store(2, Relaxed);
        assert!(f.write_at(buf.as_slice(), 0).is_err());
        assert!(f.write_at(buf.as_slice(), 0).is_err());
        f.write_at(buf.as_slice(), 0).unwrap();
        faults.sync_errors.store(1, Relaxed);
        assert!(f.sync().is_err());
        f.sync().unwrap();
    }

    #[test]
    fn vectored_writes_span_more_slices_than_one_call_takes() {
        let dir = tempfile::tempdir().unwrap();
        let direct = probe_direct(dir.path());
        let f = SegFile::open(&dir.path().join("v"), true, direct, Arc::default()).unwrap();
        // 2 x IOV_MAX + 3 blocks, each filled with its own index, plus empty slices between.
        let blocks = 2 * IOV_MAX + 3;
        let mut buf = AlignedBuf::zeroed(blocks * ALIGN);
        for (i, b) in buf.as_mut_slice().chunks_mut(ALIGN).enumerate() {
            b.fill((i % 251) as u8);
        }
        let mut parts: Vec<&[u8]> = Vec::new();
        for (i, b) in buf.as_slice().chunks(ALIGN).enumerate() {
            parts.push(b);
            if i % 100 == 0 {
                parts.push(&[]);
            }
        }
        f.write_parts_at(&parts, ALIGN as u64).unwrap();
        let mut back = AlignedBuf::zeroed(blocks * ALIGN);
        assert_eq!(
            f.read_at(back.as_mut_slice(), ALIGN as u64).unwrap(),
            blocks * ALIGN
        );
        assert!(
            back.as_slice() == buf.as_slice(),
            "every slice landed in order"
        );
        let faults = Arc::new(Faults::default());
        let g = SegFile::open(&dir.path().join("v"), false, direct, Arc::clone(&faults)).unwrap();
        faults.write_errors.store(1, Relaxed);
        assert!(
            g.write_parts_at(&parts, 0).is_err(),
            "injected faults apply"
        );
    }
}
