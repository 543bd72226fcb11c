//! Safe handles over the UCP calls of [`super::ffi`]: a context, a worker, endpoints to other
//! workers, registered memory and one-sided reads and writes (issue 17).
//!
//! Owns: the lifetimes of every UCX object kvtier creates, and the lock that serialises calls
//! into one worker.
//!
//! Invariants:
//! - Ownership follows UCP's rules by construction: a [`Worker`] holds an `Arc` of its
//!   context, every [`Endpoint`] an `Arc` of its worker, every [`Registration`] an `Arc` of its
//!   context; so a context outlives its workers and memory handles, and a worker its endpoints.
//!   An endpoint's remote key is destroyed before the endpoint is closed.
//! - Workers are created `UCS_THREAD_MODE_SERIALIZED`; every call into a worker or one of its
//!   endpoints holds that worker's `lock`, which is what makes the handles `Send + Sync`.
//! - A one-sided operation never outlives the call that started it: [`Endpoint::get`] and
//!   [`Endpoint::put`] progress the worker until every request they issued completed; on the
//!   deadline they close the endpoint by force (UCP completes the requests with an error) and
//!   keep progressing until the requests are released, so UCX never writes into a buffer the
//!   caller got back.
//! - Remote addresses and keys come from an authenticated peer, and a client reads only the
//!   extents a node leased to it. UCX does not bounds-check every transport (its TCP emulation
//!   of one-sided operations trusts the address: a read outside the registration can crash the
//!   target), which is why a node hands its key only to peers that proved the cluster token.
//!   The caller still verifies the bytes' end-to-end checksum.
//! - Issue 26: those emulated lanes serve any peer that reaches the worker, token or not, so
//!   [`Context::new`] never loads them: it sets UCP's `TLS` from [`super::lanes::plan`] (RDMA
//!   RC/DC and cma only, intersected with `UCX_TLS`) and creates nothing when no lane is left,
//!   unless the insecure test hook is on. [`Context::bound_to`] also sets `NET_DEVICES` to
//!   the devices behind one interface ([`super::devices`]), so UCX binds nowhere else.
//! - A local memory handle is passed to UCX ([`Endpoint::get_with`] / [`Endpoint::put_with`])
//!   only when it belongs to the worker's own context and covers the whole buffer; the
//!   caller's `Arc<Registration>` keeps it mapped until the transfer returned.
//! - [`Endpoint::describe`] captures `ucp_ep_print_info` through `open_memstream`; the
//!   buffer is freed once, after `fclose`.
//! - Peer failure: endpoints ask for `UCP_ERR_HANDLING_MODE_PEER` with an error callback that
//!   marks the endpoint failed (a flag the endpoint owns and outlives the callback's use:
//!   UCP calls it only from progress, under the worker's lock, while the endpoint is open).
//!   A failed endpoint issues nothing more; its outstanding requests complete with an error
//!   (or are released by the forced close). Every request issued and not yet freed is
//!   counted per worker ([`Worker::outstanding`]): after a peer dies it returns to 0 unless
//!   UCX kept a request past `CLOSE_BOUND`, which the count then shows.

#![allow(unsafe_code)]

use std::ffi::c_void;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::ffi::{self, Ucp};

/// Why a UCX call failed.
#[derive(Debug, thiserror::Error)]
pub enum UcxError {
    /// libucp cannot be loaded or used on this host.
    #[error("UCX is not available: {0}")]
    Unavailable(String),
    #[error("{call} failed: {text} (UCX status {status})")]
    Call {
        call: &'static str,
        status: i8,
        text: String,
    },
    #[error("a UCX transfer did not complete within {0:?}")]
    Timeout(Duration),
    #[error("the UCX endpoint was closed after an earlier failure")]
    Closed,
    #[error("UCX reported the peer failed (peer-failure handling)")]
    PeerFailed,
    #[error("{0}")]
    Invalid(String),
    /// kvtier's transport allow-list leaves no UCX lane here (see [`super::lanes`]).
    #[error("UCX refused: {0}")]
    NoProtectedLane(String),
    /// No UCX device behind the interface UCX may bind to (see [`super::devices`]).
    #[error("UCX refused: {0}")]
    NoDevice(String),
}

/// A `ucp_config_t` read from the environment; released on drop.
struct UcpConfig(ffi::Config, &'static Ucp);

impl UcpConfig {
    fn read(ucp: &'static Ucp) -> Result<UcpConfig, UcxError> {
        let mut raw: ffi::Config = std::ptr::null_mut();
        // SAFETY: null prefix and file name make UCP read the `UCX_*` environment; `raw` is
        // written on success and released once by `Drop`.
        let status = unsafe { (ucp.config_read)(std::ptr::null(), std::ptr::null(), &mut raw) };
        check(ucp, "ucp_config_read", status)?;
        Ok(UcpConfig(raw, ucp))
    }

    /// Set UCP variable `name` (without its `UCX_` prefix) to `value`.
    fn modify(&self, name: &str, value: &str) -> Result<(), UcxError> {
        let name_c = std::ffi::CString::new(name)
            .map_err(|_| UcxError::Invalid(format!("UCX variable name {name:?} has a NUL")))?;
        let value_c = std::ffi::CString::new(value)
            .map_err(|_| UcxError::Invalid(format!("UCX value {value:?} has a NUL")))?;
        // SAFETY: live configuration (owned by `self`); both strings are NUL-terminated and
        // outlive the call (UCP copies the value).
        let status = unsafe { (self.1.config_modify)(self.0, name_c.as_ptr(), value_c.as_ptr()) };
        check(self.1, "ucp_config_modify", status)
    }
}

impl Drop for UcpConfig {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `ucp_config_read` and is released once.
        unsafe { (self.1.config_release)(self.0) };
    }
}

fn check(ucp: &Ucp, call: &'static str, status: ffi::Status) -> Result<(), UcxError> {
    if status == ffi::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::Call {
            call,
            status,
            text: ucp.describe(status),
        })
    }
}

struct ContextRaw {
    ucp: &'static Ucp,
    raw: ffi::Context,
    /// The transport list the context was created with (kvtier's allow-list applied, or
    /// `UCX_TLS` as given under the insecure test hook).
    tls: String,
    /// The devices the context may use (`NET_DEVICES` as kvtier set it, or `UCX_NET_DEVICES`
    /// as the environment gives it for [`Context::new`]).
    devices: String,
}

// SAFETY: a UCP context is used from any thread once created (memory map/unmap and rkey pack
// are context-level calls documented as thread safe for `mt_workers_shared`, which is set);
// the pointer carries no thread affinity.
unsafe impl Send for ContextRaw {}
// SAFETY: as for `Send`.
unsafe impl Sync for ContextRaw {}

impl Drop for ContextRaw {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `ucp_init_version` and every worker and registration holds
        // an `Arc` of this context, so none is left when it drops.
        unsafe { (self.ucp.cleanup)(self.raw) };
    }
}

/// A UCP context with the RMA and wakeup features.
#[derive(Clone)]
pub struct Context(Arc<ContextRaw>);

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ucx::Context")
    }
}

impl Context {
    /// Load libucp (once per process) and create a context. UCX reads its own `UCX_*`
    /// environment variables here (`UCX_NET_DEVICES`, ...), but its transport list is kvtier's
    /// ([`super::lanes::plan`]: the operator's `UCX_TLS` intersected with the transports that
    /// protect memory, set with `ucp_config_modify` before `ucp_init`); where that leaves no
    /// UCX lane the error is [`UcxError::NoProtectedLane`] and nothing of UCX is created.
    ///
    /// Its devices are `UCX_NET_DEVICES` as the environment gives it (all by default): for
    /// tests and probes only. kvtier's node and client use [`Self::bound_to`].
    pub fn new() -> Result<Context, UcxError> {
        Self::create(None)
    }

    /// [`Self::new`] restricted to the devices behind the interface of `ip` (issue 26 §1:
    /// [`super::devices::plan`], intersected with `UCX_NET_DEVICES`, set with
    /// `ucp_config_modify("NET_DEVICES", ...)` before `ucp_init`): a node passes its
    /// `--data-addr`, a client [`super::devices::client_address`]. A wildcard, an address no
    /// interface holds, or no device left is [`UcxError::NoDevice`] and nothing of UCX is
    /// created.
    pub fn bound_to(ip: std::net::IpAddr) -> Result<Context, UcxError> {
        Self::create(Some(ip))
    }

    fn create(bind: Option<std::net::IpAddr>) -> Result<Context, UcxError> {
        let tls = super::lanes::plan().map_err(UcxError::NoProtectedLane)?;
        let devices = match bind {
            Some(ip) => Some(super::devices::plan(ip).map_err(UcxError::NoDevice)?),
            None => None,
        };
        let ucp = Ucp::get().map_err(UcxError::Unavailable)?;
        let config = UcpConfig::read(ucp)?;
        if let Some(tls) = &tls {
            config.modify("TLS", tls)?;
        }
        if let Some(devices) = &devices {
            config.modify("NET_DEVICES", devices)?;
        }
        let mut params: ffi::Params = ffi::zeroed();
        params.field_mask = ffi::UCP_PARAM_FIELD_FEATURES | ffi::UCP_PARAM_FIELD_MT_WORKERS_SHARED;
        params.features = ffi::UCP_FEATURE_RMA | ffi::UCP_FEATURE_WAKEUP;
        params.mt_workers_shared = 1;
        let mut raw: ffi::Context = std::ptr::null_mut();
        // SAFETY: `params` is a zero-initialised 1.13 `ucp_params_t` with the fields named in
        // its mask set; `config` is a live configuration from `ucp_config_read` (released by
        // its guard after the call; UCP copies what it needs); `raw` is written on success.
        let status = unsafe {
            (ucp.init_version)(
                ffi::API_MAJOR,
                ffi::API_MINOR,
                &params,
                config.0.cast_const(),
                &mut raw,
            )
        };
        check(ucp, "ucp_init", status)?;
        let tls = tls.unwrap_or_else(|| format!("{} (INSECURE test hook)", super::ucx_tls()));
        let devices = devices
            .unwrap_or_else(|| std::env::var("UCX_NET_DEVICES").unwrap_or_else(|_| "all".into()));
        Ok(Context(Arc::new(ContextRaw {
            ucp,
            raw,
            tls,
            devices,
        })))
    }

    /// The transports this context may use (`UCX_TLS` as kvtier set it).
    pub fn transports(&self) -> &str {
        &self.0.tls
    }

    /// The devices this context may use (`UCX_NET_DEVICES` as kvtier set it).
    pub fn devices(&self) -> &str {
        &self.0.devices
    }

    /// Register `len` bytes at `base` for remote access. The memory must stay mapped for as
    /// long as the registration lives (the caller's invariant: `Registration` is dropped
    /// before the memory is unmapped).
    pub fn register(&self, base: *mut u8, len: usize) -> Result<Registration, UcxError> {
        let mut params: ffi::MemMapParams = ffi::zeroed();
        params.field_mask =
            ffi::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | ffi::UCP_MEM_MAP_PARAM_FIELD_LENGTH;
        params.address = base.cast::<c_void>();
        params.length = len;
        self.map(&params)
    }

    /// [`Self::register`] with the remote access peers get: `remote_write = false` registers
    /// the memory for remote reads only (`UCP_MEM_MAP_PROT_REMOTE_READ`), so a transport that
    /// enforces memory protection (RDMA: the key's access flags) refuses a peer's write into
    /// it; `true` allows remote reads and writes (a put landing area). UCX's emulated
    /// one-sided operations over TCP and shared memory do not check it (see the module doc).
    pub fn register_prot(
        &self,
        base: *mut u8,
        len: usize,
        remote_write: bool,
    ) -> Result<Registration, UcxError> {
        let mut params: ffi::MemMapParams = ffi::zeroed();
        params.field_mask = ffi::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | ffi::UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | ffi::UCP_MEM_MAP_PARAM_FIELD_PROT;
        params.address = base.cast::<c_void>();
        params.length = len;
        params.prot = ffi::UCP_MEM_MAP_PROT_LOCAL_READ
            | ffi::UCP_MEM_MAP_PROT_LOCAL_WRITE
            | ffi::UCP_MEM_MAP_PROT_REMOTE_READ
            | if remote_write {
                ffi::UCP_MEM_MAP_PROT_REMOTE_WRITE
            } else {
                0
            };
        self.map(&params)
    }

    /// `ucp_mem_map` of `params` (address and length set; the caller's invariant as for
    /// [`Self::register`]).
    fn map(&self, params: &ffi::MemMapParams) -> Result<Registration, UcxError> {
        let ucp = self.0.ucp;
        let mut memh: ffi::MemH = std::ptr::null_mut();
        // SAFETY: the context is live (held by `self`); `params` is zero-initialised with the
        // masked fields set and names an address range the caller keeps mapped while the
        // registration lives; `memh` is written on success.
        let status = unsafe { (ucp.mem_map)(self.0.raw, params, &mut memh) };
        check(ucp, "ucp_mem_map", status)?;
        LIVE_REGISTRATIONS.fetch_add(1, Ordering::Relaxed);
        Ok(Registration {
            context: Arc::clone(&self.0),
            memh,
            base: params.address as u64,
            len: params.length as u64,
        })
    }

    /// A worker, serialised by its own lock.
    pub fn worker(&self) -> Result<Worker, UcxError> {
        let ucp = self.0.ucp;
        let mut params: ffi::WorkerParams = ffi::zeroed();
        params.field_mask = ffi::UCP_WORKER_PARAM_FIELD_THREAD_MODE;
        params.thread_mode = ffi::UCS_THREAD_MODE_SERIALIZED;
        let mut raw: ffi::Worker = std::ptr::null_mut();
        // SAFETY: live context; zero-initialised params with the masked field set; `raw` is
        // written on success.
        let status = unsafe { (ucp.worker_create)(self.0.raw, &params, &mut raw) };
        check(ucp, "ucp_worker_create", status)?;
        Ok(Worker(Arc::new(WorkerRaw {
            context: Arc::clone(&self.0),
            raw,
            lock: Mutex::new(()),
            outstanding: AtomicUsize::new(0),
        })))
    }
}

/// `ucp_mem_map` handles of this process not yet unmapped (all contexts).
static LIVE_REGISTRATIONS: AtomicUsize = AtomicUsize::new(0);

/// How many memory registrations of this process are mapped with UCX now: tests check that
/// unregistering caller memory, or closing the client, unmaps it.
pub fn live_registrations() -> usize {
    LIVE_REGISTRATIONS.load(Ordering::Relaxed)
}

/// Memory registered with a context; unregistered on drop.
pub struct Registration {
    context: Arc<ContextRaw>,
    memh: ffi::MemH,
    base: u64,
    len: u64,
}

// SAFETY: a memory handle is a context-level object (see `ContextRaw`); it is only passed to
// context-level calls (`ucp_rkey_pack`, `ucp_mem_unmap`).
unsafe impl Send for Registration {}
// SAFETY: as for `Send`; `&Registration` only packs keys.
unsafe impl Sync for Registration {}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .finish()
    }
}

impl Registration {
    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `[addr, addr + len)` lies inside this registration.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.base + self.len)
    }

    /// The remote key a peer unpacks to reach this memory.
    pub fn pack_key(&self) -> Result<Vec<u8>, UcxError> {
        let ucp = self.context.ucp;
        let mut buffer: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: live context and memory handle; UCP allocates `buffer` of `size` bytes.
        let status =
            unsafe { (ucp.rkey_pack)(self.context.raw, self.memh, &mut buffer, &mut size) };
        check(ucp, "ucp_rkey_pack", status)?;
        // SAFETY: on success `buffer` points to `size` initialised bytes owned by UCP until
        // `ucp_rkey_buffer_release`, called right after the copy.
        let key = unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), size) }.to_vec();
        // SAFETY: `buffer` came from `ucp_rkey_pack` and is released once.
        unsafe { (ucp.rkey_buffer_release)(buffer) };
        Ok(key)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        // SAFETY: `memh` came from `ucp_mem_map` on this context, which is still alive.
        let _ = unsafe { (self.context.ucp.mem_unmap)(self.context.raw, self.memh) };
        LIVE_REGISTRATIONS.fetch_sub(1, Ordering::Relaxed);
    }
}

struct WorkerRaw {
    context: Arc<ContextRaw>,
    raw: ffi::Worker,
    /// Held for every call into the worker or its endpoints (SERIALIZED mode).
    lock: Mutex<()>,
    /// Requests issued on this worker's endpoints and not yet freed.
    outstanding: AtomicUsize,
}

// SAFETY: the worker is created in SERIALIZED mode, and every call into it or its endpoints
// holds `lock`, so calls from different threads never overlap.
unsafe impl Send for WorkerRaw {}
// SAFETY: as for `Send`.
unsafe impl Sync for WorkerRaw {}

impl Drop for WorkerRaw {
    fn drop(&mut self) {
        // SAFETY: every endpoint holds an `Arc` of this worker, so none is left; the context
        // outlives it (held in `context`).
        unsafe { (self.context.ucp.worker_destroy)(self.raw) };
    }
}

impl WorkerRaw {
    /// One progress call; the caller holds `lock`.
    fn progress_locked(&self) -> u32 {
        // SAFETY: live worker, serialised by the caller's lock.
        unsafe { (self.context.ucp.worker_progress)(self.raw) }
    }
}

/// A UCP worker.
#[derive(Clone)]
pub struct Worker(Arc<WorkerRaw>);

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ucx::Worker")
    }
}

extern "C" fn mark_ep_failed(arg: *mut c_void, _ep: ffi::Ep, status: ffi::Status) {
    if arg.is_null() {
        return;
    }
    // SAFETY: `arg` is `Arc::as_ptr` of the endpoint's `failed` flag; the endpoint holds that
    // `Arc` until after its forced close completed, and UCP calls this only from progress on
    // an open endpoint, so the flag is alive here.
    let failed = unsafe { &*arg.cast::<AtomicBool>() };
    failed.store(true, Ordering::Release);
    tracing::warn!(
        status,
        "kvtier: UCX peer failure on an endpoint; it is closed"
    );
}

impl Worker {
    /// This worker's address, for a peer's [`Worker::connect`].
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let ucp = self.0.context.ucp;
        let _guard = self.0.lock.lock();
        let mut address: *mut ffi::Address = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live worker under its lock; UCP allocates `address` of `len` bytes.
        let status = unsafe { (ucp.worker_get_address)(self.0.raw, &mut address, &mut len) };
        check(ucp, "ucp_worker_get_address", status)?;
        // SAFETY: on success `address` points to `len` bytes owned by UCP until released,
        // right after the copy.
        let bytes = unsafe { std::slice::from_raw_parts(address.cast::<u8>(), len) }.to_vec();
        // SAFETY: `address` came from `ucp_worker_get_address` of this worker; released once.
        unsafe { (ucp.worker_release_address)(self.0.raw, address) };
        Ok(bytes)
    }

    /// Requests issued on this worker's endpoints and not yet released.
    pub fn outstanding(&self) -> usize {
        self.0.outstanding.load(Ordering::Relaxed)
    }

    /// Progress once; how many events were handled.
    pub fn progress(&self) -> u32 {
        let _guard = self.0.lock.lock();
        self.0.progress_locked()
    }

    /// Progress until idle, then sleep on the worker's event descriptor until UCX has work
    /// (or `timeout` passed). For a node's progress thread: it costs no CPU while idle.
    pub fn progress_or_wait(&self, timeout: Duration) -> Result<(), UcxError> {
        let ucp = self.0.context.ucp;
        let fd = {
            let _guard = self.0.lock.lock();
            while self.0.progress_locked() > 0 {}
            let mut fd: std::ffi::c_int = -1;
            // SAFETY: live worker under its lock; `fd` is written on success.
            let status = unsafe { (ucp.worker_get_efd)(self.0.raw, &mut fd) };
            check(ucp, "ucp_worker_get_efd", status)?;
            // SAFETY: live worker under its lock.
            let armed = unsafe { (ucp.worker_arm)(self.0.raw) };
            if armed == ffi::UCS_ERR_BUSY {
                return Ok(()); // events arrived meanwhile: progress again
            }
            check(ucp, "ucp_worker_arm", armed)?;
            fd
        };
        // SAFETY: `fd` is the worker's event descriptor, owned by the worker, which `self`
        // keeps alive for the whole poll.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let mut fds = [rustix::event::PollFd::new(
            &borrowed,
            rustix::event::PollFlags::IN,
        )];
        let timeout = rustix::event::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: i64::from(timeout.subsec_nanos()),
        };
        // EINTR and the like: the caller loops anyway.
        let _ = rustix::event::poll(&mut fds, Some(&timeout));
        Ok(())
    }

    /// Wake a thread blocked in [`Self::progress_or_wait`].
    pub fn signal(&self) {
        // SAFETY: `ucp_worker_signal` is the one worker call documented as safe from any
        // thread without serialisation; the worker is live.
        let _ = unsafe { (self.0.context.ucp.worker_signal)(self.0.raw) };
    }

    /// An endpoint to the worker at `address` (from the peer's [`Worker::address`]). Peer
    /// failure handling (a dead peer fails requests rather than hanging them) is asked for
    /// first; UCX 1.13's shared-memory transports do not offer it, so an endpoint they alone
    /// reach is made without it (the transfer deadline still bounds every call).
    pub fn connect(&self, address: &[u8]) -> Result<Endpoint, UcxError> {
        match self.connect_with(address, true) {
            Err(UcxError::Call { .. }) => self.connect_with(address, false),
            other => other,
        }
    }

    fn connect_with(&self, address: &[u8], peer_failure: bool) -> Result<Endpoint, UcxError> {
        if address.is_empty() {
            return Err(UcxError::Invalid("empty UCX worker address".into()));
        }
        let ucp = self.0.context.ucp;
        let failed = Arc::new(AtomicBool::new(false));
        let mut params: ffi::EpParams = ffi::zeroed();
        params.field_mask = ffi::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
        params.address = address.as_ptr().cast::<ffi::Address>();
        if peer_failure {
            params.field_mask |=
                ffi::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | ffi::UCP_EP_PARAM_FIELD_ERR_HANDLER;
            params.err_mode = ffi::UCP_ERR_HANDLING_MODE_PEER;
            params.err_handler = ffi::ErrHandler {
                cb: Some(mark_ep_failed),
                arg: Arc::as_ptr(&failed).cast_mut().cast::<c_void>(),
            };
        }
        let _guard = self.0.lock.lock();
        let mut ep: ffi::Ep = std::ptr::null_mut();
        // SAFETY: live worker under its lock; `address` outlives the call (UCP copies what it
        // needs; a malformed address is rejected with a status, it came from an authenticated
        // peer); `ep` is written on success.
        let status = unsafe { (ucp.ep_create)(self.0.raw, &params, &mut ep) };
        check(ucp, "ucp_ep_create", status)?;
        Ok(Endpoint {
            worker: Arc::clone(&self.0),
            raw: ep,
            rkey: std::ptr::null_mut(),
            closed: false,
            failed,
            peer_failure,
        })
    }
}

/// A request parameter, with the local memory handle when there is one.
fn request_param(memh: Option<ffi::MemH>) -> ffi::RequestParam {
    let mut param: ffi::RequestParam = ffi::zeroed();
    if let Some(memh) = memh {
        param.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_MEMH;
        param.memh = memh;
    }
    param
}

/// One read or write of [`Endpoint::get`] / [`Endpoint::put`]: `len` bytes at the peer's
/// `remote` address.
#[derive(Clone, Copy, Debug)]
pub struct RemoteExtent {
    pub remote: u64,
    pub len: usize,
}

/// An endpoint to a peer worker, with (at most) one unpacked remote key.
pub struct Endpoint {
    worker: Arc<WorkerRaw>,
    raw: ffi::Ep,
    rkey: ffi::RKey,
    /// Closed by force after a failure: no further operation is issued.
    closed: bool,
    /// Set by UCP's error callback when the peer failed (see the module doc).
    failed: Arc<AtomicBool>,
    /// Whether the endpoint was created with peer-failure handling.
    peer_failure: bool,
}

// SAFETY: every call on the endpoint holds its worker's lock (see `WorkerRaw`).
unsafe impl Send for Endpoint {}
// SAFETY: as for `Send`; `&Endpoint` offers no call (operations take `&mut self`).
unsafe impl Sync for Endpoint {}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ucx::Endpoint")
            .field("closed", &self.closed)
            .finish()
    }
}

/// Remote keys unpacked on an endpoint for one call ([`Endpoint::get_keyed`]), destroyed
/// (under the worker's lock) when dropped. UCX releases a key without touching its endpoint,
/// so this is sound after a forced close too.
struct UnpackedKeys {
    worker: Arc<WorkerRaw>,
    keys: Vec<ffi::RKey>,
}

impl Drop for UnpackedKeys {
    fn drop(&mut self) {
        let _guard = self.worker.lock.lock();
        for key in self.keys.drain(..) {
            // SAFETY: each key came from `ucp_ep_rkey_unpack` and is destroyed once, after
            // every request that used it completed or was released (`Endpoint::run`).
            unsafe { (self.worker.context.ucp.rkey_destroy)(key) };
        }
    }
}

/// How long a forced close waits for the endpoint's requests to be released.
const CLOSE_BOUND: Duration = Duration::from_secs(1);

/// A request issued and not yet released.
struct Pending(*mut c_void);

impl Endpoint {
    /// Unpack the peer's packed remote key (replacing any earlier one).
    pub fn set_remote_key(&mut self, packed: &[u8]) -> Result<(), UcxError> {
        if self.closed {
            return Err(UcxError::Closed);
        }
        if packed.is_empty() {
            return Err(UcxError::Invalid("empty UCX remote key".into()));
        }
        let ucp = self.worker.context.ucp;
        let _guard = self.worker.lock.lock();
        let mut rkey: ffi::RKey = std::ptr::null_mut();
        // SAFETY: live endpoint under its worker's lock; `packed` is a buffer UCP only reads
        // (a malformed one is rejected with a status); `rkey` is written on success.
        let status = unsafe { (ucp.ep_rkey_unpack)(self.raw, packed.as_ptr().cast(), &mut rkey) };
        check(ucp, "ucp_ep_rkey_unpack", status)?;
        if !self.rkey.is_null() {
            // SAFETY: the previous key came from `ucp_ep_rkey_unpack` on this endpoint.
            unsafe { (ucp.rkey_destroy)(self.rkey) };
        }
        self.rkey = rkey;
        Ok(())
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Whether UCP reported the peer failed.
    pub fn peer_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Whether the endpoint has peer-failure handling (UCX 1.13's shared-memory transports
    /// alone do not offer it).
    pub fn has_peer_failure_handling(&self) -> bool {
        self.peer_failure
    }

    /// Read each extent into the matching destination (same lengths), one-sided; all are
    /// issued, then the worker is progressed until every one completed or `timeout` passed.
    pub fn get(
        &mut self,
        extents: &[RemoteExtent],
        dsts: &mut [&mut [u8]],
        timeout: Duration,
    ) -> Result<(), UcxError> {
        self.get_with(extents, dsts, &[], timeout)
    }

    /// [`Self::get`] passing, per destination, the registration it lies in (`locals` empty:
    /// none; an entry `None`: not registered). UCX then uses that memory handle rather than
    /// looking the buffer up (or registering it) itself (`UCP_OP_ATTR_FIELD_MEMH`).
    pub fn get_with(
        &mut self,
        extents: &[RemoteExtent],
        dsts: &mut [&mut [u8]],
        locals: &[Option<Arc<Registration>>],
        timeout: Duration,
    ) -> Result<(), UcxError> {
        let rkey = self.rkey;
        if rkey.is_null() {
            return Err(UcxError::Invalid("no remote key set".into()));
        }
        self.issue_gets(extents, dsts, locals, timeout, |_| rkey)
    }

    /// [`Self::get_with`] with a remote key per read (issue 26: a node registers each leased
    /// extent on its own): `keys` are packed keys, unpacked on this endpoint for this call only
    /// and destroyed before it returns; `key_of[i]` is the index in `keys` of `extents[i]`'s.
    pub fn get_keyed(
        &mut self,
        keys: &[&[u8]],
        key_of: &[usize],
        extents: &[RemoteExtent],
        dsts: &mut [&mut [u8]],
        locals: &[Option<Arc<Registration>>],
        timeout: Duration,
    ) -> Result<(), UcxError> {
        if extents.len() != key_of.len() || key_of.iter().any(|&k| k >= keys.len()) {
            return Err(UcxError::Invalid("extents and keys differ".into()));
        }
        let unpacked = self.unpack_keys(keys)?;
        let rkeys = &unpacked.keys;
        // `rkeys` were unpacked on this endpoint and are destroyed only after the reads
        // returned (by `unpacked`'s drop).
        self.issue_gets(extents, dsts, locals, timeout, |i| rkeys[key_of[i]])
    }

    /// The reads of [`Self::get_with`] / [`Self::get_keyed`]: `extents[i]` into `dsts[i]` with
    /// the remote key `key_for(i)`, a live key of this endpoint for the whole call.
    fn issue_gets(
        &mut self,
        extents: &[RemoteExtent],
        dsts: &mut [&mut [u8]],
        locals: &[Option<Arc<Registration>>],
        timeout: Duration,
        key_for: impl Fn(usize) -> ffi::RKey,
    ) -> Result<(), UcxError> {
        if extents.len() != dsts.len()
            || extents
                .iter()
                .zip(dsts.iter())
                .any(|(e, d)| e.len != d.len())
        {
            return Err(UcxError::Invalid("extents and destinations differ".into()));
        }
        let memhs = self.memhs(locals, dsts.iter().map(|d| (d.as_ptr() as u64, d.len())))?;
        let ucp = self.worker.context.ucp;
        let raw = self.raw;
        self.run(timeout, |issue| {
            for (i, ((extent, dst), memh)) in
                extents.iter().zip(dsts.iter_mut()).zip(&memhs).enumerate()
            {
                let param = request_param(*memh);
                // SAFETY: live endpoint and key (`key_for`'s contract) under the worker's lock
                // (held by `run`); `dst` is valid for `extent.len` bytes and stays borrowed
                // until `run` returned, which is after every request completed or was
                // released; a memory handle passed covers `dst` and belongs to this worker's
                // context (`memhs`).
                let ptr = unsafe {
                    (ucp.get_nbx)(
                        raw,
                        dst.as_mut_ptr().cast(),
                        extent.len,
                        extent.remote,
                        key_for(i),
                        &param,
                    )
                };
                issue(ptr)?;
            }
            Ok(())
        })
    }

    /// Unpack `packed` keys on this endpoint (under the worker's lock); destroyed when the
    /// returned guard drops.
    fn unpack_keys(&self, packed: &[&[u8]]) -> Result<UnpackedKeys, UcxError> {
        if self.closed {
            return Err(UcxError::Closed);
        }
        let ucp = self.worker.context.ucp;
        let mut unpacked = UnpackedKeys {
            worker: Arc::clone(&self.worker),
            keys: Vec::with_capacity(packed.len()),
        };
        let _guard = self.worker.lock.lock();
        for key in packed {
            if key.is_empty() {
                return Err(UcxError::Invalid("empty UCX remote key".into()));
            }
            let mut rkey: ffi::RKey = std::ptr::null_mut();
            // SAFETY: live endpoint under its worker's lock; `key` is a buffer UCP only reads
            // (a malformed one is rejected with a status); `rkey` is written on success.
            let status = unsafe { (ucp.ep_rkey_unpack)(self.raw, key.as_ptr().cast(), &mut rkey) };
            check(ucp, "ucp_ep_rkey_unpack", status)?;
            unpacked.keys.push(rkey);
        }
        Ok(unpacked)
    }

    /// Write each source to the matching extent, one-sided (see [`Self::get`]); completed
    /// means the bytes are in the peer's memory (the endpoint is flushed).
    pub fn put(
        &mut self,
        extents: &[RemoteExtent],
        srcs: &[&[u8]],
        timeout: Duration,
    ) -> Result<(), UcxError> {
        self.put_with(extents, srcs, &[], timeout)
    }

    /// [`Self::put`] with the sources' registrations (see [`Self::get_with`]).
    pub fn put_with(
        &mut self,
        extents: &[RemoteExtent],
        srcs: &[&[u8]],
        locals: &[Option<Arc<Registration>>],
        timeout: Duration,
    ) -> Result<(), UcxError> {
        if extents.len() != srcs.len()
            || extents
                .iter()
                .zip(srcs.iter())
                .any(|(e, s)| e.len != s.len())
        {
            return Err(UcxError::Invalid("extents and sources differ".into()));
        }
        let memhs = self.memhs(locals, srcs.iter().map(|s| (s.as_ptr() as u64, s.len())))?;
        let ucp = self.worker.context.ucp;
        let raw = self.raw;
        let rkey = self.rkey;
        if rkey.is_null() {
            return Err(UcxError::Invalid("no remote key set".into()));
        }
        self.run(timeout, |issue| {
            for ((extent, src), memh) in extents.iter().zip(srcs.iter()).zip(&memhs) {
                let param = request_param(*memh);
                // SAFETY: as in `get_with`; `src` is only read, borrowed until `run` returned.
                let ptr = unsafe {
                    (ucp.put_nbx)(
                        raw,
                        src.as_ptr().cast(),
                        extent.len,
                        extent.remote,
                        rkey,
                        &param,
                    )
                };
                issue(ptr)?;
            }
            let param: ffi::RequestParam = ffi::zeroed();
            // SAFETY: live endpoint under the lock; the flush completes after the puts.
            let ptr = unsafe { (ucp.ep_flush_nbx)(raw, &param) };
            issue(ptr)
        })
    }

    /// The memory handle to pass for each local buffer `(address, len)`: `None` unless
    /// `locals` names a registration of this worker's context that covers the whole buffer
    /// (anything else would let UCX use a handle for memory it does not describe).
    fn memhs(
        &self,
        locals: &[Option<Arc<Registration>>],
        buffers: impl ExactSizeIterator<Item = (u64, usize)>,
    ) -> Result<Vec<Option<ffi::MemH>>, UcxError> {
        if locals.is_empty() {
            return Ok(vec![None; buffers.len()]);
        }
        if locals.len() != buffers.len() {
            return Err(UcxError::Invalid("registrations and buffers differ".into()));
        }
        Ok(buffers
            .zip(locals)
            .map(|((addr, len), local)| {
                local.as_ref().and_then(|r| {
                    (Arc::ptr_eq(&r.context, &self.worker.context) && r.covers(addr, len as u64))
                        .then_some(r.memh)
                })
            })
            .collect())
    }

    /// UCX's description of this endpoint (`ucp_ep_print_info`): its lanes, each with the
    /// transport and device UCX chose for it. Empty when it cannot be captured.
    pub fn describe(&self) -> String {
        if self.closed {
            return String::new();
        }
        let ucp = self.worker.context.ucp;
        let _guard = self.worker.lock.lock();
        let mut buffer: *mut std::ffi::c_char = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: `open_memstream` allocates a growing buffer it reports through `buffer` and
        // `size` (both outlive the stream: locals of this frame, read after `fclose`).
        let stream = unsafe { ffi::open_memstream(&mut buffer, &mut size) };
        if stream.is_null() {
            return String::new();
        }
        // SAFETY: live endpoint under its worker's lock; `stream` is a valid open FILE.
        unsafe { (ucp.ep_print_info)(self.raw, stream) };
        // SAFETY: `stream` came from `open_memstream` and is closed once; afterwards `buffer`
        // holds `size` bytes plus a NUL, owned by this function.
        let closed = unsafe { ffi::fclose(stream) };
        if buffer.is_null() {
            return String::new();
        }
        let text = if closed == 0 {
            // SAFETY: `buffer` holds `size` initialised bytes (see above).
            String::from_utf8_lossy(unsafe {
                std::slice::from_raw_parts(buffer.cast::<u8>(), size)
            })
            .into_owned()
        } else {
            String::new()
        };
        // SAFETY: `buffer` was allocated by `open_memstream` with malloc; freed once.
        unsafe { ffi::free(buffer.cast()) };
        text
    }

    /// Issue requests with `start` (under the worker's lock), then progress until they all
    /// completed. On an error or the deadline the endpoint is closed by force and the worker
    /// progressed until every request is released, so none outlives this call.
    fn run(
        &mut self,
        timeout: Duration,
        start: impl FnOnce(&mut dyn FnMut(*mut c_void) -> Result<(), UcxError>) -> Result<(), UcxError>,
    ) -> Result<(), UcxError> {
        if self.closed {
            return Err(UcxError::Closed);
        }
        let ucp = self.worker.context.ucp;
        let worker = Arc::clone(&self.worker);
        let _guard = worker.lock.lock();
        if self.peer_failed() {
            self.close_locked(&worker, &mut Vec::new());
            return Err(UcxError::PeerFailed);
        }
        let mut pending: Vec<Pending> = Vec::new();
        let mut failure: Option<UcxError> = None;
        let started = start(&mut |ptr| match ffi::StatusPtr::from_raw(ptr) {
            ffi::StatusPtr::Done => Ok(()),
            ffi::StatusPtr::Request(r) => {
                worker.outstanding.fetch_add(1, Ordering::Relaxed);
                pending.push(Pending(r));
                Ok(())
            }
            ffi::StatusPtr::Error(status) => Err(UcxError::Call {
                call: "ucp_get_nbx/ucp_put_nbx",
                status,
                text: ucp.describe(status),
            }),
        });
        if let Err(e) = started {
            failure = Some(e);
        }
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        while failure.is_none() && !pending.is_empty() {
            worker.progress_locked();
            let mut i = 0;
            while i < pending.len() {
                // SAFETY: a request returned by an nbx call and not yet freed.
                let status = unsafe { (ucp.request_check_status)(pending[i].0) };
                if status == ffi::UCS_INPROGRESS {
                    i += 1;
                    continue;
                }
                let done = pending.swap_remove(i);
                // SAFETY: the request completed; freed once.
                unsafe { (ucp.request_free)(done.0) };
                worker.outstanding.fetch_sub(1, Ordering::Relaxed);
                if status != ffi::UCS_OK && failure.is_none() {
                    failure = Some(UcxError::Call {
                        call: "one-sided transfer",
                        status,
                        text: ucp.describe(status),
                    });
                }
            }
            spins = spins.wrapping_add(1);
            if failure.is_none() && !pending.is_empty() && self.peer_failed() {
                failure = Some(UcxError::PeerFailed);
            }
            if spins & 255 == 0 && Instant::now() >= deadline && !pending.is_empty() {
                failure = Some(UcxError::Timeout(timeout));
            }
        }
        let Some(failure) = failure else {
            return Ok(());
        };
        self.close_locked(&worker, &mut pending);
        Err(failure)
    }

    /// Destroy the key and close the endpoint by force (under the worker's lock), then
    /// progress until `pending` and the close completed and release them.
    fn close_locked(&mut self, worker: &WorkerRaw, pending: &mut Vec<Pending>) {
        if self.closed {
            return;
        }
        self.closed = true;
        let ucp = worker.context.ucp;
        let mut param: ffi::RequestParam = ffi::zeroed();
        param.op_attr_mask = ffi::UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = ffi::UCP_EP_CLOSE_FLAG_FORCE;
        // SAFETY: live endpoint under the worker's lock; a forced close completes the
        // endpoint's outstanding requests with an error.
        let close = unsafe { (ucp.ep_close_nbx)(self.raw, &param) };
        if let ffi::StatusPtr::Request(r) = ffi::StatusPtr::from_raw(close) {
            worker.outstanding.fetch_add(1, Ordering::Relaxed);
            pending.push(Pending(r));
        }
        // Bounded: a forced close does not wait for the peer, but UCX 1.13 does not always
        // complete requests of an endpoint without peer-failure handling (shared memory to a
        // dead process); give up on them after `CLOSE_BOUND` rather than hang. They are then
        // leaked (never freed twice); their peer is gone, so no byte can arrive for them.
        let bound = Instant::now() + CLOSE_BOUND;
        while !pending.is_empty() && Instant::now() < bound {
            worker.progress_locked();
            pending.retain(|p| {
                // SAFETY: a request not yet freed.
                let status = unsafe { (ucp.request_check_status)(p.0) };
                if status == ffi::UCS_INPROGRESS {
                    return true;
                }
                // SAFETY: completed; freed once.
                unsafe { (ucp.request_free)(p.0) };
                worker.outstanding.fetch_sub(1, Ordering::Relaxed);
                false
            });
        }
        if !self.rkey.is_null() {
            // SAFETY: the key came from `ucp_ep_rkey_unpack` on this endpoint; destroyed once.
            unsafe { (ucp.rkey_destroy)(self.rkey) };
            self.rkey = std::ptr::null_mut();
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let worker = Arc::clone(&self.worker);
        let _guard = worker.lock.lock();
        if !self.rkey.is_null() && !self.closed {
            // SAFETY: destroyed before its endpoint closes, once.
            unsafe { (worker.context.ucp.rkey_destroy)(self.rkey) };
            self.rkey = std::ptr::null_mut();
        }
        self.close_locked(&worker, &mut Vec::new());
    }
}
