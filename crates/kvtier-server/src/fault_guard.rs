//! Survive a client truncating a memfd the server has mapped: the SIGBUS guard.
//!
//! A client memfd that is not sealed against shrinking (SGLang's `ShmHostTensorAllocator`
//! creates its memfds without `MFD_ALLOW_SEALING`, so they cannot be sealed) can be truncated
//! by its owner at any time; the server's next access to a page beyond the new end raises
//! SIGBUS, whose default action would kill `kvtier serve` and every rank's cache with it.
//!
//! The guard is the technique Wayland compositors use for client `wl_shm` pools: every
//! unsealed mapping is entered in a fixed, lock-free table; a SIGBUS whose fault address lies
//! in a guarded mapping replaces that whole mapping (`MAP_FIXED`) with private anonymous zero
//! memory and marks its slot *revoked*, so the faulting copy resumes and finishes on zeros.
//! Every copy from or to client memory asks the region's intact check afterwards (see
//! [`kvtier_store::store::SharedRegion::intact`]): a put that read revoked memory is not stored, a
//! get that wrote into it fails, and later requests on the region fail before copying. The
//! fast path costs nothing (no extra syscall or copy per page); only the fault pays.
//!
//! A SIGBUS outside every guarded mapping is handed to the handler that was installed before
//! (Rust's runtime installs one for stack guard pages), or to the default action.
//!
//! Safety of the handler: it only reads atomics, calls `mmap` (a system call; the kernel makes
//! it safe to call from a handler) and stores an atomic. A slot is published (its `end`, then
//! its `start`) before the mapping is ever accessed, and cleared before the mapping is
//! unmapped, while no request can still use it (the last `Arc` of the mapping is being
//! dropped), so the handler never remaps an address range that is not a guarded mapping.
// A named unsafe module (issue 16 lints): a SIGBUS handler guarding copies from shared memory.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Most guarded (unsealed) mappings alive at once, server-wide. A registration beyond it is
/// refused with an error (the limits in [`crate::config`] keep real deployments far below).
pub const MAX_GUARDED_MAPPINGS: usize = 16_384;

/// A `start` value that reserves a slot while it is being filled (no mapping starts at 1).
const RESERVED: usize = 1;

struct Slot {
    start: AtomicUsize,
    end: AtomicUsize,
    revoked: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)] // used only to initialise the table
const EMPTY_SLOT: Slot = Slot {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    revoked: AtomicBool::new(false),
};

static TABLE: [Slot; MAX_GUARDED_MAPPINGS] = [EMPTY_SLOT; MAX_GUARDED_MAPPINGS];
/// Slots below this index may be in use (the handler scans no further).
static HIGH_WATER: AtomicUsize = AtomicUsize::new(0);
/// The SIGBUS action found when the guard was installed.
static PREVIOUS: OnceLock<PreviousAction> = OnceLock::new();
/// Faults the guard recovered from (for stats).
static RECOVERED: AtomicUsize = AtomicUsize::new(0);

struct PreviousAction(libc::sigaction);

// SAFETY: a plain C struct of function pointers and flags, written once before the handler
// can run and only read afterwards.
unsafe impl Sync for PreviousAction {}
// SAFETY: see Sync.
unsafe impl Send for PreviousAction {}

/// Why a mapping could not be guarded.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("cannot install the SIGBUS guard: {0}")]
    Install(#[source] std::io::Error),
    #[error(
        "{MAX_GUARDED_MAPPINGS} unsealed client mappings are already guarded; \
         unregister some, or send memfds that allow sealing"
    )]
    Full,
}

/// A guarded mapping's entry; cleared on drop.
#[derive(Debug)]
pub struct Guard {
    slot: usize,
}

impl Guard {
    /// Whether the mapping is still the client's memory (no fault replaced it).
    pub fn intact(&self) -> bool {
        !TABLE[self.slot].revoked.load(Ordering::Acquire)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let slot = &TABLE[self.slot];
        slot.start.store(0, Ordering::Release);
        slot.end.store(0, Ordering::Release);
        slot.revoked.store(false, Ordering::Release);
    }
}

/// Faults recovered from since the process started.
pub fn recovered_faults() -> usize {
    RECOVERED.load(Ordering::Relaxed)
}

/// Guard `[start, start + len)`, a whole `MAP_SHARED` mapping (page aligned) of an unsealed
/// client memfd. Must be called before the mapping is first accessed; the returned guard
/// must be dropped before the mapping is unmapped.
pub fn guard(start: usize, len: usize) -> Result<Guard, GuardError> {
    install()?;
    let end = start.checked_add(len).ok_or(GuardError::Full)?;
    for (index, slot) in TABLE.iter().enumerate() {
        if slot
            .start
            .compare_exchange(0, RESERVED, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            HIGH_WATER.fetch_max(index + 1, Ordering::AcqRel);
            slot.revoked.store(false, Ordering::Release);
            slot.end.store(end, Ordering::Release);
            slot.start.store(start, Ordering::Release);
            return Ok(Guard { slot: index });
        }
    }
    Err(GuardError::Full)
}

fn install() -> Result<(), GuardError> {
    static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
    let outcome = INSTALLED.get_or_init(|| {
        // SAFETY: sigaction with a zeroed struct filled as the C API expects; the handler is an
        // `extern "C"` function of the SA_SIGINFO signature. sigaction swaps the actions
        // atomically and returns the previous one, stored right after: a SIGBUS in that
        // instant finds PREVIOUS unset and takes the default action, as without the guard
        // (no guarded mapping exists yet at that point anyway).
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &action, &mut previous) != 0 {
                return Err(std::io::Error::last_os_error().to_string());
            }
            let _ = PREVIOUS.set(PreviousAction(previous));
        }
        Ok(())
    });
    outcome
        .clone()
        .map_err(|e| GuardError::Install(std::io::Error::other(e)))
}

extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let address = unsafe { (*info).si_addr() } as usize;
    let high = HIGH_WATER.load(Ordering::Acquire).min(MAX_GUARDED_MAPPINGS);
    for slot in &TABLE[..high] {
        let start = slot.start.load(Ordering::Acquire);
        if start <= RESERVED || address < start {
            continue;
        }
        let end = slot.end.load(Ordering::Acquire);
        if address >= end {
            continue;
        }
        // SAFETY: [start, end) is a live guarded mapping of this process (see the module
        // docs); replacing it with anonymous memory of the same range is what revoking means,
        // and every user of the mapping checks `revoked` after its copy. mmap is a plain
        // system call, safe in a signal handler; errno is saved and restored around it.
        let replaced = unsafe {
            let errno = *libc::__errno_location();
            let result = libc::mmap(
                start as *mut libc::c_void,
                end - start,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            );
            *libc::__errno_location() = errno;
            result != libc::MAP_FAILED
        };
        if replaced {
            slot.revoked.store(true, Ordering::Release);
            RECOVERED.fetch_add(1, Ordering::Relaxed);
            return;
        }
        break;
    }
    // Not a guarded mapping: whoever handled SIGBUS before us, else the default action.
    // SAFETY: the previous action is a valid sigaction the process installed; calling its
    // handler with the arguments we received is what the kernel would have done. Resetting
    // to SIG_DFL and returning re-runs the faulting instruction, which then kills the process
    // with SIGBUS as if no guard existed.
    unsafe {
        if let Some(PreviousAction(previous)) = PREVIOUS.get() {
            let handler = previous.sa_sigaction;
            if handler != libc::SIG_DFL && handler != libc::SIG_IGN {
                if previous.sa_flags & libc::SA_SIGINFO != 0 {
                    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                        std::mem::transmute(handler);
                    f(signal, info, context);
                } else {
                    let f: extern "C" fn(libc::c_int) = std::mem::transmute(handler);
                    f(signal);
                }
                return;
            }
        }
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &default, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    //! The recovery path itself, without the `mincore` refusal in front of it (which, in the
    //! server, usually stops a copy over a shrunk memfd's hole before any fault): a guarded
    //! mapping whose file is truncated faults on the next touch, and the guard turns that
    //! fault into zeros, a revoked slot and a counted recovery instead of a dead process.
    use super::*;

    const LEN: usize = 4 * 4096;

    #[test]
    fn a_fault_in_a_guarded_mapping_revokes_it_and_the_process_lives() {
        // SAFETY: a memfd of this test's own, mapped MAP_SHARED for LEN bytes, guarded before
        // its first access and unguarded (the Guard dropped) before munmap, as `guard` asks.
        unsafe {
            let fd = libc::memfd_create(c"fault_guard_test".as_ptr(), 0);
            assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
            assert_eq!(libc::ftruncate(fd, LEN as libc::off_t), 0);
            let base = libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            assert_ne!(base, libc::MAP_FAILED);
            let guard = guard(base as usize, LEN).expect("guard the mapping");
            let bytes = base as *mut u8;
            std::ptr::write_volatile(bytes.add(LEN - 1), 0xAB);
            assert!(guard.intact(), "no fault yet");
            let before = recovered_faults();

            // The owner shrinks the file under the mapping: the last page is now past its end.
            assert_eq!(libc::ftruncate(fd, 0), 0);
            let read = std::ptr::read_volatile(bytes.add(LEN - 1));

            assert_eq!(
                read, 0,
                "the faulting read resumes on the zero page that replaced it"
            );
            assert!(!guard.intact(), "the mapping is revoked");
            assert!(recovered_faults() > before, "the recovery is counted");
            // The whole mapping was replaced: another page reads zero without a fault.
            assert_eq!(std::ptr::read_volatile(bytes), 0);
            drop(guard);
            assert_eq!(libc::munmap(base, LEN), 0);
            libc::close(fd);
        }
    }
}
