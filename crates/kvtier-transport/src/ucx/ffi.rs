//! The UCP calls kvtier uses, loaded from `libucp.so.0` at run time (issue 17).
//!
//! Owns: the `dlopen` of libucp (once per process, [`Ucp::get`]), the C declarations of the
//! handful of UCP entry points and parameter structs kvtier calls (copied from the UCX 1.13
//! headers, `ucp/api/ucp.h`; binaries built against them run unchanged on later 1.x, whose
//! structs only grow behind their `field_mask`), and the status-pointer helpers.
//!
//! Invariants:
//! - libucp is never linked: a host without UCX loads [`Ucp::get`] as an error naming why, and
//!   every caller falls back to kvtier's TCP frames. The library stays loaded for the process
//!   (the `Library` lives in a `OnceLock`), so every function pointer taken from it stays valid.
//! - Structs are `#[repr(C)]` copies of the 1.13 layouts; only fields named in a struct's
//!   `field_mask` are read by UCP, and every struct is zero-initialised ([`zeroed`]) first, as
//!   the C API expects.
//! - This module only declares and loads; the safe wrapper that upholds UCP's ownership rules
//!   (a worker outlives its endpoints, a context its memory handles) is `plane.rs`.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

/// `ucs_status_t`: a packed (one byte) signed enum.
pub type Status = i8;
pub const UCS_OK: Status = 0;
pub const UCS_INPROGRESS: Status = 1;
pub const UCS_ERR_BUSY: Status = -15;
/// `UCS_ERR_LAST`: pointers at or above `(uintptr_t)-100` are error statuses.
const UCS_ERR_LAST: isize = -100;

pub type Context = *mut c_void;
pub type Worker = *mut c_void;
pub type Ep = *mut c_void;
pub type MemH = *mut c_void;
pub type RKey = *mut c_void;
pub type Address = c_void;
/// `ucp_config_t *` (opaque).
pub type Config = *mut c_void;

/// The API version these declarations come from (`UCP_API_MAJOR` / `UCP_API_MINOR`).
pub const API_MAJOR: c_uint = 1;
pub const API_MINOR: c_uint = 13;

pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub const UCP_PARAM_FIELD_NAME: u64 = 1 << 8;
pub const UCP_FEATURE_RMA: u64 = 1 << 1;
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;

pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
/// `ucs_thread_mode_t`.
pub const UCS_THREAD_MODE_SINGLE: c_int = 0;
pub const UCS_THREAD_MODE_SERIALIZED: c_int = 1;

pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
/// `UCP_ERR_HANDLING_MODE_PEER`: requests complete (with an error) when the peer dies.
pub const UCP_ERR_HANDLING_MODE_PEER: c_int = 1;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

pub const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
/// Issue 17 (puts): `ucp_mem_map_params.prot` is read.
pub const UCP_MEM_MAP_PARAM_FIELD_PROT: u64 = 1 << 3;
/// `ucp_mem_map_prot` (1.13).
pub const UCP_MEM_MAP_PROT_LOCAL_READ: c_uint = 1 << 0;
pub const UCP_MEM_MAP_PROT_LOCAL_WRITE: c_uint = 1 << 1;
pub const UCP_MEM_MAP_PROT_REMOTE_READ: c_uint = 1 << 8;
pub const UCP_MEM_MAP_PROT_REMOTE_WRITE: c_uint = 1 << 9;

pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_OP_ATTR_FIELD_MEMH: u32 = 1 << 8;

/// `ucp_params_t` (1.13).
#[repr(C)]
pub struct Params {
    pub field_mask: u64,
    pub features: u64,
    pub request_size: usize,
    pub request_init: *mut c_void,
    pub request_cleanup: *mut c_void,
    pub tag_sender_mask: u64,
    pub mt_workers_shared: c_int,
    pub estimated_num_eps: usize,
    pub estimated_num_ppn: usize,
    pub name: *const c_char,
}

/// `ucp_worker_params_t` (1.13); `ucs_cpu_set_t` is 1024 bits.
#[repr(C)]
pub struct WorkerParams {
    pub field_mask: u64,
    pub thread_mode: c_int,
    pub cpu_mask: [u64; 16],
    pub events: c_uint,
    pub user_data: *mut c_void,
    pub event_fd: c_int,
    pub flags: u64,
    pub name: *const c_char,
    pub am_alignment: usize,
    pub client_id: u64,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub struct SockAddr {
    pub addr: *const c_void,
    pub addrlen: u32,
}

/// `ucp_err_handler_cb_t`.
pub type ErrHandlerCb = extern "C" fn(arg: *mut c_void, ep: Ep, status: Status);

/// `ucp_err_handler_t`.
#[repr(C)]
pub struct ErrHandler {
    pub cb: Option<ErrHandlerCb>,
    pub arg: *mut c_void,
}

/// `ucp_ep_params_t` (1.13).
#[repr(C)]
pub struct EpParams {
    pub field_mask: u64,
    pub address: *const Address,
    pub err_mode: c_int,
    pub err_handler: ErrHandler,
    pub user_data: *mut c_void,
    pub flags: c_uint,
    pub sockaddr: SockAddr,
    pub conn_request: *mut c_void,
    pub name: *const c_char,
    pub local_sockaddr: SockAddr,
}

/// `ucp_mem_map_params_t` (1.13).
#[repr(C)]
pub struct MemMapParams {
    pub field_mask: u64,
    pub address: *mut c_void,
    pub length: usize,
    pub flags: c_uint,
    pub prot: c_uint,
    pub memory_type: c_int,
}

/// `ucp_request_param_t` (1.13).
#[repr(C)]
pub struct RequestParam {
    pub op_attr_mask: u32,
    pub flags: u32,
    pub request: *mut c_void,
    pub cb: *mut c_void,
    pub datatype: u64,
    pub user_data: *mut c_void,
    pub reply_buffer: *mut c_void,
    pub memory_type: c_int,
    pub recv_info: *mut c_void,
    pub memh: MemH,
}

/// A zero-initialised parameter struct, as the C API expects before `field_mask` is set.
pub fn zeroed<T: Plain>() -> T {
    // SAFETY: `Plain` is implemented only for the `#[repr(C)]` structs above, whose fields are
    // integers, raw pointers and `Option<extern fn>`, all valid when every byte is zero.
    unsafe { std::mem::zeroed() }
}

/// Structs for which all-zero bytes are a valid value.
pub trait Plain {}
impl Plain for Params {}
impl Plain for WorkerParams {}
impl Plain for EpParams {}
impl Plain for MemMapParams {}
impl Plain for RequestParam {}

/// What a `ucs_status_ptr_t` holds.
pub enum StatusPtr {
    /// Done at once (`UCS_OK`).
    Done,
    /// A request to progress and then free.
    Request(*mut c_void),
    /// Failed at once.
    Error(Status),
}

impl StatusPtr {
    pub fn from_raw(ptr: *mut c_void) -> StatusPtr {
        let raw = ptr as isize;
        if ptr.is_null() {
            StatusPtr::Done
        } else if (ptr as usize) >= (UCS_ERR_LAST as usize) {
            StatusPtr::Error(raw as Status)
        } else {
            StatusPtr::Request(ptr)
        }
    }
}

/// The entry points, resolved once.
#[allow(clippy::type_complexity)]
pub struct Ucp {
    _lib: libloading::Library,
    pub init_version:
        unsafe extern "C" fn(c_uint, c_uint, *const Params, *const c_void, *mut Context) -> Status,
    pub cleanup: unsafe extern "C" fn(Context),
    /// `ucp_config_read(env_prefix, filename, &config)`.
    pub config_read: unsafe extern "C" fn(*const c_char, *const c_char, *mut Config) -> Status,
    /// `ucp_config_modify(config, name, value)`.
    pub config_modify: unsafe extern "C" fn(Config, *const c_char, *const c_char) -> Status,
    pub config_release: unsafe extern "C" fn(Config),
    pub worker_create: unsafe extern "C" fn(Context, *const WorkerParams, *mut Worker) -> Status,
    pub worker_destroy: unsafe extern "C" fn(Worker),
    pub worker_get_address: unsafe extern "C" fn(Worker, *mut *mut Address, *mut usize) -> Status,
    pub worker_release_address: unsafe extern "C" fn(Worker, *mut Address),
    pub worker_progress: unsafe extern "C" fn(Worker) -> c_uint,
    pub worker_get_efd: unsafe extern "C" fn(Worker, *mut c_int) -> Status,
    pub worker_arm: unsafe extern "C" fn(Worker) -> Status,
    pub worker_signal: unsafe extern "C" fn(Worker) -> Status,
    pub ep_create: unsafe extern "C" fn(Worker, *const EpParams, *mut Ep) -> Status,
    pub ep_close_nbx: unsafe extern "C" fn(Ep, *const RequestParam) -> *mut c_void,
    pub mem_map: unsafe extern "C" fn(Context, *const MemMapParams, *mut MemH) -> Status,
    pub mem_unmap: unsafe extern "C" fn(Context, MemH) -> Status,
    pub rkey_pack: unsafe extern "C" fn(Context, MemH, *mut *mut c_void, *mut usize) -> Status,
    pub rkey_buffer_release: unsafe extern "C" fn(*mut c_void),
    pub ep_rkey_unpack: unsafe extern "C" fn(Ep, *const c_void, *mut RKey) -> Status,
    pub rkey_destroy: unsafe extern "C" fn(RKey),
    pub get_nbx:
        unsafe extern "C" fn(Ep, *mut c_void, usize, u64, RKey, *const RequestParam) -> *mut c_void,
    pub put_nbx: unsafe extern "C" fn(
        Ep,
        *const c_void,
        usize,
        u64,
        RKey,
        *const RequestParam,
    ) -> *mut c_void,
    pub ep_flush_nbx: unsafe extern "C" fn(Ep, *const RequestParam) -> *mut c_void,
    pub request_check_status: unsafe extern "C" fn(*mut c_void) -> Status,
    pub request_free: unsafe extern "C" fn(*mut c_void),
    pub status_string: unsafe extern "C" fn(Status) -> *const c_char,
    /// `ucp_ep_print_info`: the endpoint's lanes (transport/device each) to a `FILE*`.
    pub ep_print_info: unsafe extern "C" fn(Ep, *mut c_void),
}

// The C library's memory streams, to capture `ucp_ep_print_info` (std links libc already).
extern "C" {
    /// `open_memstream(3)`: a `FILE*` writing into a malloc'd buffer.
    pub fn open_memstream(buffer: *mut *mut c_char, size: *mut usize) -> *mut c_void;
    /// `fclose(3)`.
    pub fn fclose(stream: *mut c_void) -> c_int;
    /// `free(3)`.
    pub fn free(ptr: *mut c_void);
}

/// Library names tried, in order.
const LIBRARY_NAMES: [&str; 2] = ["libucp.so.0", "libucp.so"];

static UCP: OnceLock<Result<Ucp, String>> = OnceLock::new();

impl Ucp {
    /// The loaded library, or why it cannot be used (absent, too old, a symbol missing).
    pub fn get() -> Result<&'static Ucp, String> {
        UCP.get_or_init(Ucp::load).as_ref().map_err(Clone::clone)
    }

    fn load() -> Result<Ucp, String> {
        let mut last = String::new();
        for name in LIBRARY_NAMES {
            // SAFETY: loading libucp runs its constructors (UCS global init), which have no
            // preconditions on the caller; it is the library kvtier means to use.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => return Ucp::resolve(lib).map_err(|e| format!("{name}: {e}")),
                Err(e) => last = format!("cannot load {name}: {e}"),
            }
        }
        Err(last)
    }

    fn resolve(lib: libloading::Library) -> Result<Ucp, String> {
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the symbol is looked up by its C name and given the signature the
                // UCX 1.13 header declares for it (see the field types of `Ucp`); the pointer
                // is copied out and stays valid because `lib` is kept in the same struct for
                // the life of the process.
                let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("symbol {} missing: {e}", $name))?;
                *s
            }};
        }
        Ok(Ucp {
            init_version: sym!("ucp_init_version"),
            cleanup: sym!("ucp_cleanup"),
            config_read: sym!("ucp_config_read"),
            config_modify: sym!("ucp_config_modify"),
            config_release: sym!("ucp_config_release"),
            worker_create: sym!("ucp_worker_create"),
            worker_destroy: sym!("ucp_worker_destroy"),
            worker_get_address: sym!("ucp_worker_get_address"),
            worker_release_address: sym!("ucp_worker_release_address"),
            worker_progress: sym!("ucp_worker_progress"),
            worker_get_efd: sym!("ucp_worker_get_efd"),
            worker_arm: sym!("ucp_worker_arm"),
            worker_signal: sym!("ucp_worker_signal"),
            ep_create: sym!("ucp_ep_create"),
            ep_close_nbx: sym!("ucp_ep_close_nbx"),
            mem_map: sym!("ucp_mem_map"),
            mem_unmap: sym!("ucp_mem_unmap"),
            rkey_pack: sym!("ucp_rkey_pack"),
            rkey_buffer_release: sym!("ucp_rkey_buffer_release"),
            ep_rkey_unpack: sym!("ucp_ep_rkey_unpack"),
            rkey_destroy: sym!("ucp_rkey_destroy"),
            get_nbx: sym!("ucp_get_nbx"),
            put_nbx: sym!("ucp_put_nbx"),
            ep_flush_nbx: sym!("ucp_ep_flush_nbx"),
            request_check_status: sym!("ucp_request_check_status"),
            request_free: sym!("ucp_request_free"),
            status_string: sym!("ucs_status_string"),
            ep_print_info: sym!("ucp_ep_print_info"),
            _lib: lib,
        })
    }

    /// UCX's text for `status`.
    pub fn describe(&self, status: Status) -> String {
        // SAFETY: `ucs_status_string` accepts any status value and returns a pointer to a
        // static NUL-terminated string (or "unknown"); it is never null.
        let text = unsafe { (self.status_string)(status) };
        if text.is_null() {
            return format!("UCX status {status}");
        }
        // SAFETY: non-null, NUL-terminated, static (see above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}
