//! The `io_uring` I/O backend (`ssd_io_backend = "io_uring"`), the second of the two: the
//! segment log's positioned vectored reads and writes go through a ring instead of
//! `preadv`/`pwritev`.
//!
//! Owns: one ring per thread (made on the thread's first I/O, kept for its life) and the only
//! `unsafe` of the SSD tier besides `aligned.rs`.
//!
//! Invariant this module keeps: every entry pushed onto a ring is completed before the call
//! that pushed it returns, so the buffers an entry points to (borrowed by that call) outlive
//! the kernel's use of them. When the kernel refuses the submission itself, the ring is
//! dropped with the entry still unsubmitted, so it can never run later on stale buffers.

#![allow(unsafe_code)]

use std::cell::RefCell;
use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd};

use io_uring::{opcode, types, IoUring};

/// Entries per ring: each call has one entry in flight.
const RING_ENTRIES: u32 = 8;

thread_local! {
    static RING: RefCell<Option<IoUring>> = const { RefCell::new(None) };
}

/// Whether this process may use `io_uring` (kernels and sandboxes can forbid it).
pub(crate) fn probe() -> io::Result<()> {
    IoUring::new(RING_ENTRIES).map(drop)
}

/// `pwritev` through the ring: bytes written (maybe fewer than asked; the caller continues).
pub(crate) fn pwritev(fd: BorrowedFd<'_>, bufs: &[IoSlice<'_>], offset: u64) -> io::Result<usize> {
    let len = iov_count(bufs.len())?;
    let entry = opcode::Writev::new(types::Fd(fd.as_raw_fd()), bufs.as_ptr().cast(), len)
        .offset(offset)
        .build();
    // SAFETY: `IoSlice` is ABI-compatible with `struct iovec` (documented by std on Unix);
    // `bufs` and the memory its slices point to are borrowed for this whole call, and
    // `run_one` returns only after the entry completed (module invariant).
    unsafe { run_one(&entry) }
}

/// `preadv` through the ring: bytes read (fewer than asked only at end of file).
pub(crate) fn preadv(
    fd: BorrowedFd<'_>,
    bufs: &mut [IoSliceMut<'_>],
    offset: u64,
) -> io::Result<usize> {
    let len = iov_count(bufs.len())?;
    let entry = opcode::Readv::new(types::Fd(fd.as_raw_fd()), bufs.as_mut_ptr().cast(), len)
        .offset(offset)
        .build();
    // SAFETY: as for `pwritev`; the slices are borrowed mutably for this call, so nothing
    // else reads or writes them while the kernel fills them.
    unsafe { run_one(&entry) }
}

/// Submission errors after which the entry may still be pending: wait again.
fn retryable(e: &io::Error) -> bool {
    use rustix::io::Errno;
    matches!(
        Errno::from_io_error(e),
        Some(Errno::INTR | Errno::AGAIN | Errno::BUSY)
    )
}

fn iov_count(n: usize) -> io::Result<u32> {
    u32::try_from(n).map_err(|_| io::Error::other("too many I/O slices for one io_uring entry"))
}

/// Push `entry`, submit it and wait for its completion.
///
/// # Safety
/// Every buffer `entry` points to must stay valid (and, for reads, unaliased) until this
/// function returns.
unsafe fn run_one(entry: &io_uring::squeue::Entry) -> io::Result<usize> {
    RING.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(IoUring::new(RING_ENTRIES)?);
        }
        let Some(ring) = slot.as_mut() else {
            return Err(io::Error::other("io_uring ring missing"));
        };
        // SAFETY: the caller keeps the buffers valid until we return, and we return only
        // after this entry's completion was reaped, or after dropping the ring with the entry
        // never submitted.
        if unsafe { ring.submission().push(entry) }.is_err() {
            return Err(io::Error::other("io_uring submission queue is full"));
        }
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if retryable(&e) => {}
                Err(e) => {
                    // The kernel took nothing: drop the ring so the entry is never submitted.
                    *slot = None;
                    return Err(e);
                }
            }
            if let Some(cqe) = ring.completion().next() {
                let res = cqe.result();
                return if res < 0 {
                    Err(io::Error::from_raw_os_error(-res))
                } else {
                    Ok(res as usize)
                };
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn vectored_round_trip_through_the_ring() {
        if probe().is_err() {
            eprintln!("io_uring is not available here; nothing to test");
            return;
        }
        let file = tempfile::tempfile().unwrap();
        let (a, b) = (vec![1u8; 3000], vec![2u8; 5000]);
        let n = pwritev(file.as_fd(), &[IoSlice::new(&a), IoSlice::new(&b)], 100).unwrap();
        assert_eq!(n, 8000);
        let (mut x, mut y) = (vec![0u8; 3000], vec![0u8; 6000]);
        let got = preadv(
            file.as_fd(),
            &mut [IoSliceMut::new(&mut x), IoSliceMut::new(&mut y)],
            100,
        )
        .unwrap();
        assert_eq!(got, 8000, "short at end of file");
        assert_eq!(x, a);
        assert_eq!(&y[..5000], &b[..]);
        // An error from the kernel comes back as an io::Error (EBADF on a read-only fd).
        let ro = std::fs::File::open("/proc/self/status").unwrap();
        assert!(pwritev(ro.as_fd(), &[IoSlice::new(&a)], 0).is_err());
    }
}
