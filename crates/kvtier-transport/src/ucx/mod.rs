//! The UCX data plane (issue 17): cluster reads move one-sided (UCP get) from a node's
//! registered DRAM arena straight into the reader's buffer, and puts one-sided (UCP put) into
//! the node's put landing area, over whatever UCX selects to that
//! peer: RDMA (`rc_mlx5`, `dc_mlx5`, `rc_verbs`, `ud`) on a fabric, shared memory (`cma`,
//! `posix`, ...) on one host, or UCX's own TCP.
//!
//! Owns: [`UcxTransport`], a [`Transport`] that wraps kvtier's [`TcpTransport`], the per-peer
//! choice between the two ([`TransportChoice`], config `cluster_transport`), and the lease
//! protocol's client side ([`kvtier_proto::peer_ucx`]).
//!
//! Invariants:
//! - libucp is loaded at run time ([`ffi`]); without it (or with `cluster_transport = "tcp"`)
//!   every call goes to the TCP frames, and the reason is logged once.
//! - Issue 26: only transports that protect memory are loaded ([`lanes`]: RDMA RC/DC and
//!   cma, intersected with `UCX_TLS`, whatever `cluster_transport` says); where none is left
//!   this client creates no UCX worker (so opens no UCX socket), reads and writes over frames
//!   and says why (`unavailable`). A node's lease reply is checked before any read
//!   ([`check_lease_extents`]).
//! - Issue 26 §1: the client's UCX uses only the devices behind one interface
//!   ([`devices`]): that of its `node_address` when the config names one as an IP (the local
//!   node's data address), else the one it reaches its first master from.
//! - The node's worker address and remote key are asked for over an authenticated data-port
//!   connection only (the TCP transport's handshake proves the cluster token both ways).
//! - A read pins its objects on the node first (a lease), reads their extents, releases the
//!   lease, then verifies every object's end-to-end checksum trailer: bytes of an object the
//!   node evicted and reused can never be returned as a hit (the pin prevents the reuse; the
//!   checksum catches a lease that expired under a stalled reader).
//! - Any UCX failure falls back to the frames for the items concerned, logs the reason, and
//!   stops using UCX for that peer for [`RETRY_UCX_AFTER`]; a miss stays a miss.
//! - A put writes one-sided too (protocol in [`kvtier_proto::peer_ucx`]): `PeerUcxPutHello`
//!   once per peer gives the key of the node's landing area (held by a second endpoint to the
//!   same worker); then per chunk (at most `MAX_RESERVE_OBJECTS` objects and the smaller of
//!   `MAX_RESERVE_BYTES` and the node's per-connection share) Reserve, UCP put of each
//!   object's bytes and its 16-byte integrity trailer into its extent, flush, Commit, all on one
//!   held data-port connection (reservations belong to it). The node verifies the trailer on
//!   its own copy, so a torn or forged write is never stored. "Already present" is success
//!   (put-if-absent); refused reservations (full, too big), lapsed ones and ones whose bytes
//!   failed the node's check go over frames; a UCX failure aborts the chunk's reservations
//!   (best effort), sends the rest over frames, and the peer falls back as for reads.
//! - Removes, demotes and the other control calls use the frames.
//! - Caller memory the client registers (`Client::register_region*`: the SGLang adapter's
//!   host-pool buffers) is also registered with UCX here (`ucp_mem_map`); a transfer whose
//!   local buffer lies wholly inside one passes its memory handle (`UCP_OP_ATTR_FIELD_MEMH`,
//!   present in UCX 1.13), otherwise UCX registers the buffer itself (its registration cache).
//!   A refusal is logged with its reason and counted; the handle is unmapped on unregister or
//!   close, once no transfer in flight holds it (an `Arc`).
//! - `peer_transports` names the lanes UCX negotiated per endpoint (`ucp_ep_print_info`,
//!   captured in [`plane`]), not only `UCX_TLS` as set.
//! - `auto` keeps UCX for a peer only when those lanes read without the node's CPU (RDMA, or
//!   single-copy shared memory: [`auto_choice`]); where UCX would emulate one-sided reads
//!   (UCX 1.13 over `tcp`, or `posix` / `sysv` alone) it reads over frames and says why.

pub mod devices;
pub mod ffi;
pub mod lanes;
mod netif;
pub mod plane;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::auth::CHECKSUM_LEN;
use kvtier_proto::peer::peer_error_code;
use kvtier_proto::peer_ucx::{
    check_lease_extents, CommitItem, LeaseExtentError, LeaseItem, ReserveItem, UcxCommit,
    UcxCommitReply, UcxHello, UcxLanding, UcxLeaseReply, UcxLeaseRequest, UcxOffer, UcxRelease,
    UcxReserveReply, UcxReserveRequest, MAX_LEASE_OBJECTS, MAX_RESERVE_BYTES, MAX_RESERVE_OBJECTS,
};
use kvtier_proto::Opcode;
use parking_lot::Mutex;

use super::tcp::{ControlSession, TcpTransport};
use super::{GetItem, PutItem, Transport, TransportError};
use crate::names;
pub use plane::{Context, Endpoint, Registration, RemoteExtent, UcxError, Worker};

/// Test-only environment variable (not `KVTIER_*`: that prefix is the config's): caller
/// regions whose label contains its value are refused
/// registration with UCX (counted and logged like a real refusal).
pub const REFUSE_REGION_ENV: &str = "TEST_KVTIER_UCX_REFUSE_REGION";

/// Caller memory registered with UCX.
struct HostRegion {
    id: u64,
    registration: Arc<Registration>,
}

/// How long a peer whose UCX path failed is read over frames before UCX is tried again.
pub const RETRY_UCX_AFTER: Duration = Duration::from_secs(30);

/// Transports (the part of a lane before `/`) whose one-sided reads run in the network
/// adapter, not the node's CPU: InfiniBand / RoCE verbs and mlx5 (RC, DC, UD, GGA).
pub const RDMA_TRANSPORT_PREFIXES: [&str; 4] = ["rc_", "dc_", "ud_", "gga_"];

/// Shared-memory transports that read the node's memory in one copy without its worker
/// (kernel-assisted `cma`, `knem`; `xpmem` mappings). `posix` and `sysv` are not here:
/// UCX 1.13 selects them as RMA lanes only with bcopy, so a "one-sided" get over them is
/// emulated with active messages that the node's progress thread must copy out, 8 KiB
/// at a time (`ucp_ep_print_info`: `get[0]: 0..<bcopy>..(inf)` on the posix lane).
pub const SINGLE_COPY_SHM_TRANSPORTS: [&str; 3] = ["cma", "knem", "xpmem"];

/// `cluster_transport`: how a cluster client reads page bytes from a peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// UCX when it offers an RDMA or shared-memory transport to the peer, frames otherwise.
    #[default]
    Auto,
    /// kvtier's TCP frames only.
    Tcp,
    /// UCX whenever the peer offers it (frames only as the fallback after a failure).
    Ucx,
}

impl TransportChoice {
    pub const NAMES: [&'static str; 3] = ["auto", "tcp", "ucx"];

    pub fn parse(text: &str) -> Result<TransportChoice, String> {
        match text {
            "auto" => Ok(TransportChoice::Auto),
            "tcp" => Ok(TransportChoice::Tcp),
            "ucx" => Ok(TransportChoice::Ucx),
            other => Err(format!(
                "{other:?} is not a cluster transport (one of \"auto\", \"tcp\", \"ucx\")"
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Ucx => "ucx",
        }
    }
}

/// This host's identity for the same-host test: the kernel's boot id (empty if unreadable).
pub fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// RDMA devices this host has (`/sys/class/infiniband`), which UCX's verbs and mlx5
/// transports drive.
pub fn rdma_devices() -> Vec<String> {
    let mut devices: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|dir| {
            dir.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    devices.sort();
    devices
}

/// UCX's transport selection as the environment sets it (`UCX_TLS`; UCX reads it itself).
pub fn ucx_tls() -> String {
    std::env::var("UCX_TLS").unwrap_or_else(|_| "all".into())
}

/// Whether `auto` should try UCX with a peer with this offer at all (before connecting):
/// `Ok(())`, or `Err(why not)`. A peer on another host with no RDMA device here could only
/// be reached over UCX's TCP, which emulates one-sided reads and is slower than frames.
pub fn auto_worth_trying(offer: &UcxOffer, local_host: &str) -> Result<(), String> {
    let same_host = !local_host.is_empty() && offer.host == local_host;
    if same_host || !rdma_devices().is_empty() {
        return Ok(());
    }
    Err(
        "no RDMA device here and the peer is on another host: UCX would emulate one-sided \
         reads over TCP, slower than kvtier's frames"
            .into(),
    )
}

/// Whether `auto` keeps UCX for an endpoint whose negotiated lanes are `lanes` (as
/// [`parse_lanes`] gives them): `Ok(why)` when one of them reads without the node's CPU (an
/// RDMA transport, or single-copy shared memory), `Err(why not)` otherwise. Measured on
/// these machines (README's UCX section): reads UCX emulates (over `tcp`, or `posix` /
/// `sysv` alone) were 0.2-0.5x frames over TCP, and over shared memory 1.5x frames on a
/// quiet host but 0.1-0.7x with the cores oversubscribed, as the node's worker thread and
/// the reader then take turns on the CPU for every FIFO's worth of bytes.
pub fn auto_choice(lanes: &[String]) -> Result<String, String> {
    let transport = |lane: &str| lane.split('/').next().unwrap_or("").to_owned();
    if let Some(lane) = lanes.iter().find(|lane| {
        let t = transport(lane);
        RDMA_TRANSPORT_PREFIXES.iter().any(|p| t.starts_with(p))
    }) {
        return Ok(format!("UCX negotiated RDMA ({lane})"));
    }
    if let Some(lane) = lanes
        .iter()
        .find(|lane| SINGLE_COPY_SHM_TRANSPORTS.contains(&transport(lane).as_str()))
    {
        return Ok(format!("UCX negotiated single-copy shared memory ({lane})"));
    }
    Err(format!(
        "UCX negotiated only {lanes:?} with this peer: its one-sided reads would be emulated \
         through the node's CPU, which measured slower than kvtier's frames"
    ))
}

/// The transport in use for one peer, as stats report it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PeerTransport {
    pub peer: String,
    /// `"ucx"` or `"tcp"`.
    pub transport: &'static str,
    pub reason: String,
    /// How puts travel to the peer: `"ucx"` (one-sided into its landing area), `"tcp"` or
    /// `"not yet"` (no put since UCX was set up).
    pub puts: &'static str,
    /// Why puts travel as `puts` says (empty while that is `"ucx"`).
    pub puts_reason: String,
    /// The transports UCX negotiated for the read endpoint's lanes, as `transport/device`
    /// (`"tcp/lo"`, `"posix/memory"`, `"cma/memory"`, RDMA: `"rc_mlx5/mlx5_0:1"`), from
    /// `ucp_ep_print_info`; empty on frames.
    pub ucx_lanes: Vec<String>,
}

/// The `transport/device` of each lane in `ucp_ep_print_info`'s text, first seen first. Its
/// lane lines read like `lane[0]:  2:tcp/lo.0 md[2] ...` (the number before the colon is the
/// resource index, a `.N` suffix the device's path index).
pub fn parse_lanes(info: &str) -> Vec<String> {
    let mut lanes: Vec<String> = Vec::new();
    for line in info.lines().filter(|l| l.contains("lane[")) {
        let found = line.split_whitespace().find_map(|token| {
            let (index, resource) = token.split_once(':')?;
            (!index.is_empty()
                && index.chars().all(|c| c.is_ascii_digit())
                && resource.contains('/'))
            .then(|| {
                let resource = match resource.rsplit_once('.') {
                    Some((name, path)) if path.chars().all(|c| c.is_ascii_digit()) => name,
                    _ => resource,
                };
                resource.to_string()
            })
        });
        if let Some(lane) = found {
            if !lanes.contains(&lane) {
                lanes.push(lane);
            }
        }
    }
    lanes
}

enum PeerState {
    Ucx {
        endpoint: Arc<Mutex<Endpoint>>,
        reason: String,
        /// The node's worker address (a second endpoint for puts connects to it).
        worker_address: Arc<Vec<u8>>,
        /// The one-sided put path to this peer, set up on the first put.
        landing: Arc<Mutex<LandingState>>,
    },
    Frames {
        reason: String,
        /// When to ask the peer again (`None`: never, e.g. `cluster_transport = "tcp"`).
        retry_at: Option<Instant>,
    },
}

/// The put path to one UCX peer: an endpoint holding the key of the node's landing area.
enum LandingState {
    /// Not asked yet.
    Untried,
    Ready {
        endpoint: Arc<Mutex<Endpoint>>,
        landing: UcxLanding,
    },
    /// The node offers no landing area (or it could not be reached): puts use frames.
    Unavailable(String),
}

/// What the one-sided put path did with a batch: per item `Some(result)` when settled,
/// `None` for an item still to send over frames; `failure` when the UCX path failed (the
/// items from the failed chunk on are `None`).
struct PutOutcome {
    results: Vec<Option<Result<(), TransportError>>>,
    failure: Option<String>,
}

/// [`TcpTransport`] plus one-sided UCX reads and writes (see the module doc).
pub struct UcxTransport {
    tcp: TcpTransport,
    choice: TransportChoice,
    timeout: Duration,
    /// The client's worker, or why UCX is not used at all.
    worker: Result<Worker, String>,
    /// The worker's context (registers the caller's host memory).
    context: Option<Context>,
    /// Caller memory registered with UCX, by base address (see [`Self::register_host_region`]).
    host_regions: Mutex<BTreeMap<u64, HostRegion>>,
    registration_failures: AtomicU64,
    /// One-sided requests issued with a registered local buffer's memory handle.
    registered_transfers: AtomicU64,
    /// Test-only (`TEST_KVTIER_UCX_REFUSE_REGION`): regions whose label contains it are
    /// refused as UCX would refuse them, to exercise the failure path.
    refuse_label: Option<String>,
    host: String,
    peers: Mutex<HashMap<String, PeerState>>,
}

impl std::fmt::Debug for UcxTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxTransport")
            .field("tcp", &self.tcp)
            .field("choice", &self.choice)
            .field("ucx", &self.worker.is_ok())
            .finish_non_exhaustive()
    }
}

fn set_gauge(peer: &str, ucx: bool) {
    metrics::gauge!(names::PEER_TRANSPORT, "peer" => peer.to_string(), "transport" => "ucx")
        .set(if ucx { 1.0 } else { 0.0 });
    metrics::gauge!(names::PEER_TRANSPORT, "peer" => peer.to_string(), "transport" => "tcp")
        .set(if ucx { 0.0 } else { 1.0 });
}

impl UcxTransport {
    /// Wrap `tcp`; with `choice` other than `Tcp`, load UCX and create this client's worker
    /// on the devices behind the interface of `bind` (issue 26 §1: the client's address from
    /// [`devices::client_address`], or why there is none); a failure is logged with its
    /// reason and every read uses the frames.
    pub fn new(
        tcp: TcpTransport,
        choice: TransportChoice,
        timeout: Duration,
        bind: Result<std::net::IpAddr, String>,
    ) -> UcxTransport {
        let mut context = None;
        let worker = match choice {
            TransportChoice::Tcp => Err("cluster_transport = \"tcp\"".to_string()),
            _ => bind
                .map_err(|why| UcxError::NoDevice(format!("no address to bind UCX to: {why}")))
                .and_then(Context::bound_to)
                .and_then(|c| {
                    let worker = c.worker()?;
                    context = Some(c);
                    Ok(worker)
                })
                .map_err(|e| {
                    tracing::warn!(
                        reason = %e,
                        "kvtier: UCX data plane unavailable; cluster reads and writes use TCP frames"
                    );
                    e.to_string()
                }),
        };
        UcxTransport {
            tcp,
            choice,
            timeout,
            worker,
            context,
            host_regions: Mutex::new(BTreeMap::new()),
            registration_failures: AtomicU64::new(0),
            registered_transfers: AtomicU64::new(0),
            refuse_label: std::env::var(REFUSE_REGION_ENV)
                .ok()
                .filter(|l| !l.is_empty()),
            host: host_id(),
            peers: Mutex::new(HashMap::new()),
        }
    }

    pub fn tcp(&self) -> &TcpTransport {
        &self.tcp
    }

    pub fn choice(&self) -> TransportChoice {
        self.choice
    }

    /// Why UCX is not used at all (`None`: it is available).
    pub fn unavailable(&self) -> Option<&str> {
        self.worker.as_ref().err().map(String::as_str)
    }

    /// UCX requests issued by this client and not yet released (0 when idle; a dead peer's
    /// requests are completed with an error or released by the forced close).
    pub fn outstanding_requests(&self) -> usize {
        self.worker.as_ref().map_or(0, Worker::outstanding)
    }

    /// Register caller memory (region `id` of the client's registry) with UCX, so one-sided
    /// reads into and writes from it pass its memory handle. Without UCX (or with
    /// `cluster_transport = "tcp"`) nothing is done; a refusal is logged with its reason and
    /// counted ([`Self::registration_failures`]), and the region is then used unregistered.
    ///
    /// The caller keeps the memory mapped until [`Self::unregister_host_region`] (the client's
    /// region registry contract).
    pub fn register_host_region(&self, id: u64, ptr: usize, len: usize, label: &str) {
        let Some(context) = &self.context else {
            return;
        };
        let refused = match &self.refuse_label {
            Some(marker) if label.contains(marker.as_str()) => Err(UcxError::Invalid(format!(
                "refused by {REFUSE_REGION_ENV} (test-only)"
            ))),
            _ => context.register(ptr as *mut u8, len),
        };
        match refused {
            Ok(registration) => {
                self.host_regions.lock().insert(
                    ptr as u64,
                    HostRegion {
                        id,
                        registration: Arc::new(registration),
                    },
                );
            }
            Err(e) => {
                self.registration_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    region = label,
                    bytes = len,
                    reason = %e,
                    "kvtier: cannot register this host region with UCX; transfers with it \
                     let UCX register the buffers itself"
                );
            }
        }
    }

    /// Drop region `id`'s UCX registration (unmapped once no transfer uses it).
    pub fn unregister_host_region(&self, id: u64) {
        self.host_regions.lock().retain(|_, r| r.id != id);
    }

    /// Drop every UCX registration of caller memory (the client closes).
    pub fn unregister_all_host_regions(&self) {
        self.host_regions.lock().clear();
    }

    /// Caller regions registered with UCX now.
    pub fn registered_regions(&self) -> usize {
        self.host_regions.lock().len()
    }

    /// Caller regions UCX refused to register.
    pub fn registration_failures(&self) -> u64 {
        self.registration_failures.load(Ordering::Relaxed)
    }

    /// One-sided requests issued with a registered buffer's memory handle.
    pub fn registered_transfers(&self) -> u64 {
        self.registered_transfers.load(Ordering::Relaxed)
    }

    /// The registration covering each local buffer (`None`: not in registered memory); empty
    /// when nothing is registered.
    fn locals<'b>(
        &self,
        buffers: impl Iterator<Item = &'b [u8]>,
    ) -> Vec<Option<Arc<Registration>>> {
        let regions = self.host_regions.lock();
        if regions.is_empty() {
            return Vec::new();
        }
        let locals: Vec<Option<Arc<Registration>>> = buffers
            .map(|b| {
                let addr = b.as_ptr() as u64;
                regions
                    .range(..=addr)
                    .next_back()
                    .filter(|(_, r)| r.registration.covers(addr, b.len() as u64))
                    .map(|(_, r)| Arc::clone(&r.registration))
            })
            .collect();
        let used = locals.iter().filter(|l| l.is_some()).count() as u64;
        self.registered_transfers.fetch_add(used, Ordering::Relaxed);
        locals
    }

    /// The transport of every peer read from so far.
    pub fn peer_transports(&self) -> Vec<PeerTransport> {
        let mut out: Vec<PeerTransport> = self
            .peers
            .lock()
            .iter()
            .map(|(peer, state)| match state {
                PeerState::Ucx {
                    reason,
                    landing,
                    endpoint,
                    ..
                } => {
                    // Never wait for a transfer in flight: no lanes this time.
                    let ucx_lanes = endpoint
                        .try_lock()
                        .map(|e| parse_lanes(&e.describe()))
                        .unwrap_or_default();
                    // Never wait here for a put path being set up (a network exchange).
                    let (puts, puts_reason) = match landing.try_lock().as_deref() {
                        Some(LandingState::Ready { .. }) => ("ucx", String::new()),
                        Some(LandingState::Untried) => ("not yet", String::new()),
                        Some(LandingState::Unavailable(why)) => ("tcp", why.clone()),
                        None => ("not yet", "being set up".to_string()),
                    };
                    PeerTransport {
                        peer: peer.clone(),
                        transport: "ucx",
                        reason: reason.clone(),
                        puts,
                        puts_reason,
                        ucx_lanes,
                    }
                }
                PeerState::Frames { reason, .. } => PeerTransport {
                    peer: peer.clone(),
                    transport: "tcp",
                    reason: reason.clone(),
                    puts: "tcp",
                    puts_reason: reason.clone(),
                    ucx_lanes: Vec::new(),
                },
            })
            .collect();
        out.sort_by(|a, b| a.peer.cmp(&b.peer));
        out
    }

    /// Stop using UCX for `peer` for a while, saying why.
    fn fall_back(&self, peer: &str, reason: String) {
        tracing::warn!(peer, reason = %reason, "kvtier: UCX transfer failed; using TCP frames for this peer");
        set_gauge(peer, false);
        self.peers.lock().insert(
            peer.to_string(),
            PeerState::Frames {
                reason: format!("UCX failed: {reason}"),
                retry_at: Some(Instant::now() + RETRY_UCX_AFTER),
            },
        );
    }

    /// The UCX endpoint to `peer`, set up on first use (hello over the authenticated frames,
    /// the choice, connect, unpack the key); `None`: read over frames.
    fn endpoint(&self, peer: &str) -> Option<Arc<Mutex<Endpoint>>> {
        self.ucx_peer(peer).map(|p| p.endpoint)
    }

    /// [`Self::endpoint`] with what the put path needs of the peer.
    fn ucx_peer(&self, peer: &str) -> Option<UcxPeer> {
        let worker = match &self.worker {
            Ok(w) => w,
            Err(reason) => {
                let mut peers = self.peers.lock();
                if !peers.contains_key(peer) {
                    set_gauge(peer, false);
                    peers.insert(
                        peer.to_string(),
                        PeerState::Frames {
                            reason: reason.clone(),
                            retry_at: None,
                        },
                    );
                }
                return None;
            }
        };
        match self.peers.lock().get(peer) {
            Some(PeerState::Ucx {
                endpoint,
                worker_address,
                landing,
                ..
            }) => {
                return Some(UcxPeer {
                    endpoint: Arc::clone(endpoint),
                    worker_address: Arc::clone(worker_address),
                    landing: Arc::clone(landing),
                })
            }
            Some(PeerState::Frames { retry_at, .. })
                if retry_at.is_none_or(|t| Instant::now() < t) =>
            {
                return None
            }
            _ => {}
        }
        let (state, found) = match self.connect(worker, peer) {
            Ok((endpoint, reason, worker_address)) => {
                tracing::info!(peer, reason = %reason, "kvtier: cluster reads and writes with this peer use UCX");
                let found = UcxPeer {
                    endpoint: Arc::new(Mutex::new(endpoint)),
                    worker_address: Arc::new(worker_address),
                    landing: Arc::new(Mutex::new(LandingState::Untried)),
                };
                (
                    PeerState::Ucx {
                        endpoint: Arc::clone(&found.endpoint),
                        reason,
                        worker_address: Arc::clone(&found.worker_address),
                        landing: Arc::clone(&found.landing),
                    },
                    Some(found),
                )
            }
            Err((reason, retry)) => {
                tracing::info!(peer, reason = %reason, "kvtier: cluster reads and writes with this peer use TCP frames");
                (
                    PeerState::Frames {
                        reason,
                        retry_at: retry.then(|| Instant::now() + RETRY_UCX_AFTER),
                    },
                    None,
                )
            }
        };
        set_gauge(peer, found.is_some());
        self.peers.lock().insert(peer.to_string(), state);
        found
    }

    /// Hello, choice and connect; `Err((why, retry later))`.
    fn connect(
        &self,
        worker: &Worker,
        peer: &str,
    ) -> Result<(Endpoint, String, Vec<u8>), (String, bool)> {
        let offer: UcxOffer = self
            .tcp
            .control(peer, Opcode::PeerUcxHello, &UcxHello)
            .map_err(|e| match e {
                TransportError::Refused { .. } => (format!("the node serves no UCX: {e}"), true),
                e => (format!("UCX hello failed: {e}"), true),
            })?;
        if self.choice != TransportChoice::Ucx {
            auto_worth_trying(&offer, &self.host).map_err(|why| (why, false))?;
        }
        let endpoint = worker
            .connect(&offer.worker_address)
            .map_err(|e| (e.to_string(), true))?;
        let reason = match self.choice {
            TransportChoice::Ucx => format!(
                "cluster_transport = \"ucx\" (node UCX_TLS {}, here {})",
                offer.transports,
                ucx_tls()
            ),
            // `auto` decides on what UCX negotiated for this peer, not on what it could offer.
            _ => auto_choice(&parse_lanes(&endpoint.describe())).map_err(|why| (why, false))?,
        };
        let reason = if endpoint.has_peer_failure_handling() {
            reason
        } else {
            format!("{reason}; no peer-failure handling on this endpoint (deadline only)")
        };
        Ok((endpoint, reason, offer.worker_address))
    }

    /// Read `items` over UCX: one result per item, `None` for an item to read over frames
    /// (not in the node's registered memory); `Err`: the UCX path failed, read all over frames.
    fn ucx_get(
        &self,
        peer: &str,
        endpoint: &Mutex<Endpoint>,
        items: &mut [GetItem<'_>],
    ) -> Result<Vec<Option<Result<(), TransportError>>>, String> {
        let mut results = Vec::with_capacity(items.len());
        for chunk in items.chunks_mut(MAX_LEASE_OBJECTS) {
            results.extend(self.ucx_get_chunk(peer, endpoint, chunk)?);
        }
        Ok(results)
    }

    fn ucx_get_chunk(
        &self,
        peer: &str,
        endpoint: &Mutex<Endpoint>,
        items: &mut [GetItem<'_>],
    ) -> Result<Vec<Option<Result<(), TransportError>>>, String> {
        let request = UcxLeaseRequest {
            objects: items
                .iter()
                .map(|i| (i.key.to_vec(), (i.dst.len() + CHECKSUM_LEN) as u64))
                .collect(),
        };
        // The node ties a lease to the connection that took it: the release rides on the same
        // one, and if that connection fails the node drops the lease itself.
        let mut session = self.tcp.session(peer).map_err(|e| format!("lease: {e}"))?;
        let lease: UcxLeaseReply = session
            .control(Opcode::PeerUcxLease, &request)
            .map_err(|e| format!("lease: {e}"))?;
        let lease_id = lease.lease_id;
        let release = move |session: &mut ControlSession<'_>| {
            let _: Result<kvtier_proto::peer_ucx::UcxHello, _> =
                session.control(Opcode::PeerUcxRelease, &UcxRelease { lease_id });
        };
        if lease.items.len() != items.len() {
            release(&mut session);
            return Err(format!(
                "lease answered {} objects for {}",
                lease.items.len(),
                items.len()
            ));
        }
        let mut trailers = vec![[0u8; CHECKSUM_LEN]; items.len()];
        let mut results: Vec<Option<Result<(), TransportError>>> = Vec::with_capacity(items.len());
        let mut extents: Vec<RemoteExtent> = Vec::new();
        let mut dsts: Vec<&mut [u8]> = Vec::new();
        // Issue 26: each leased extent comes with the key of its own registration.
        let mut keys: Vec<&[u8]> = Vec::new();
        let mut key_of: Vec<usize> = Vec::new();
        let mut bytes = 0u64;
        for ((item, leased), trailer) in items.iter_mut().zip(&lease.items).zip(&mut trailers) {
            match leased {
                LeaseItem::Extents {
                    extents: parts,
                    keys: part_keys,
                } => {
                    let object = (item.dst.len() + CHECKSUM_LEN) as u64;
                    let reads = match object_reads(parts, &mut *item.dst, &mut trailer[..]) {
                        Ok(reads) => reads,
                        Err(e) => {
                            release(&mut session);
                            return Err(format!("lease refused: {e}"));
                        }
                    };
                    bytes += object;
                    let first_key = keys.len();
                    keys.extend(part_keys.iter().map(Vec::as_slice));
                    for (part, extent, dst) in reads {
                        extents.push(extent);
                        dsts.push(dst);
                        key_of.push(first_key + part);
                    }
                    results.push(Some(Ok(())));
                }
                LeaseItem::NotFound => results.push(Some(Err(TransportError::NotFound {
                    peer: peer.to_string(),
                }))),
                LeaseItem::SizeMismatch => results.push(Some(Err(TransportError::SizeMismatch {
                    peer: peer.to_string(),
                    message: format!(
                        "stored length differs from {} bytes and its checksum",
                        item.dst.len()
                    ),
                }))),
                LeaseItem::NotRemote => results.push(None),
            }
        }
        let read = if extents.is_empty() {
            Ok(())
        } else {
            let locals = self.locals(dsts.iter().map(|d| &**d));
            endpoint
                .lock()
                .get_keyed(&keys, &key_of, &extents, &mut dsts, &locals, self.timeout)
        };
        drop(dsts);
        release(&mut session);
        read.map_err(|e| format!("one-sided read: {e}"))?;
        metrics::counter!(names::PEER_TRANSFER_BYTES, "peer" => peer.to_string(), "direction" => "in")
            .increment(bytes);
        for ((item, trailer), result) in items.iter().zip(&trailers).zip(results.iter_mut()) {
            if matches!(result, Some(Ok(())))
                && !self.tcp.integrity().verify(item.key, item.dst, trailer)
            {
                *result = Some(Err(TransportError::Integrity {
                    peer: peer.to_string(),
                    message: "the bytes read over UCX do not match their checksum".into(),
                }));
            }
        }
        Ok(results)
    }
}

/// One read of a leased object: the index of the extent it reads from (whose key it uses),
/// the remote range and the destination it fills.
type ObjectRead<'a> = (usize, RemoteExtent, &'a mut [u8]);

/// The one-sided reads of one leased object, each with the index of the extent it reads from
/// (whose key it uses): its extents (as the node answered them) split
/// over `dst` (the value) and then `trailer` (its checksum), in order. The extents are
/// checked first ([`check_lease_extents`]: none empty or wrapping, exactly the object's
/// length in all), so a hostile node's reply is refused with the sizes named, before any read
/// is issued, and the split always ends.
fn object_reads<'a>(
    parts: &[(u64, u64)],
    dst: &'a mut [u8],
    trailer: &'a mut [u8],
) -> Result<Vec<ObjectRead<'a>>, LeaseExtentError> {
    check_lease_extents(parts, (dst.len() + trailer.len()) as u64)?;
    let mut reads = Vec::new();
    let mut rest: &'a mut [u8] = dst;
    let mut tail: &'a mut [u8] = trailer;
    for (part, &(addr, len)) in parts.iter().enumerate() {
        let (mut addr, mut len) = (addr, len);
        while len > 0 {
            let target = if rest.is_empty() {
                &mut tail
            } else {
                &mut rest
            };
            // Checked above: the extents add up to `dst` plus `trailer`, so room is left.
            let n = (len as usize).min(target.len());
            if n == 0 {
                return Err(LeaseExtentError::SizeDiffers {
                    leased: len,
                    object: 0,
                });
            }
            let (head, after) = std::mem::take(target).split_at_mut(n);
            *target = after;
            reads.push((
                part,
                RemoteExtent {
                    remote: addr,
                    len: n,
                },
                head,
            ));
            addr += n as u64;
            len -= n as u64;
        }
    }
    Ok(reads)
}

/// The length a node's landing area takes for `len` bytes (its extents are rounded to 64).
fn landing_len(len: u64) -> u64 {
    len.saturating_add(63) & !63
}

impl UcxTransport {
    /// The put path to `peer`, set up on first use (`PeerUcxPutHello` over the authenticated
    /// frames, a second endpoint holding the landing area's key); `None`: put over frames.
    fn landing(&self, peer: &str) -> Option<(Arc<Mutex<Endpoint>>, UcxLanding)> {
        let found = self.ucx_peer(peer)?;
        let worker = self.worker.as_ref().ok()?;
        // Held while the path is set up, so concurrent first puts ask the node once.
        let mut state = found.landing.lock();
        match &*state {
            LandingState::Ready { endpoint, landing } => {
                return Some((Arc::clone(endpoint), landing.clone()))
            }
            LandingState::Unavailable(_) => return None,
            LandingState::Untried => {}
        }
        let landing: UcxLanding = match self.tcp.control(peer, Opcode::PeerUcxPutHello, &UcxHello) {
            Ok(landing) => landing,
            Err(e @ TransportError::Refused { .. }) => {
                let reason = format!("the node offers no put landing area: {e}");
                tracing::info!(peer, reason = %reason, "kvtier: cluster writes to this peer use TCP frames");
                *state = LandingState::Unavailable(reason);
                return None;
            }
            // Unreachable now: the frames report it per item; asked again next time.
            Err(_) => return None,
        };
        let connected = worker
            .connect(&found.worker_address)
            .and_then(|mut endpoint| {
                endpoint.set_remote_key(&landing.rkey)?;
                Ok(endpoint)
            });
        match connected {
            Ok(endpoint) => {
                tracing::info!(
                    peer,
                    landing_bytes = landing.size,
                    "kvtier: cluster writes to this peer use UCX puts"
                );
                let endpoint = Arc::new(Mutex::new(endpoint));
                *state = LandingState::Ready {
                    endpoint: Arc::clone(&endpoint),
                    landing: landing.clone(),
                };
                Some((endpoint, landing))
            }
            Err(e) => {
                drop(state);
                self.fall_back(peer, format!("put endpoint: {e}"));
                None
            }
        }
    }

    /// Write `items` one-sided into the node's landing area, in chunks a reservation allows.
    fn ucx_put(
        &self,
        peer: &str,
        endpoint: &Mutex<Endpoint>,
        landing: &UcxLanding,
        items: &[PutItem<'_>],
    ) -> PutOutcome {
        let mut results: Vec<Option<Result<(), TransportError>>> =
            (0..items.len()).map(|_| None).collect();
        // Reservations belong to the connection that made them: reserve, commit (or abort)
        // all ride on this one.
        let mut session = match self.tcp.session(peer) {
            Ok(session) => session,
            Err(e) => {
                return PutOutcome {
                    results,
                    failure: Some(format!("reserve: {e}")),
                }
            }
        };
        let budget = MAX_RESERVE_BYTES.min(landing.max_connection_bytes.max(1));
        let mut start = 0;
        while start < items.len() {
            let mut end = start;
            let mut bytes = 0u64;
            while end < items.len() && end - start < MAX_RESERVE_OBJECTS {
                let len = landing_len(items[end].value.len() as u64 + CHECKSUM_LEN as u64);
                if end > start && bytes.saturating_add(len) > budget {
                    break;
                }
                bytes = bytes.saturating_add(len);
                end += 1;
            }
            if let Err(reason) = self.ucx_put_chunk(
                peer,
                &mut session,
                endpoint,
                &items[start..end],
                &mut results[start..end],
            ) {
                return PutOutcome {
                    results,
                    failure: Some(reason),
                };
            }
            start = end;
        }
        PutOutcome {
            results,
            failure: None,
        }
    }

    /// Reserve, write, flush and commit one chunk; settled items get `Some`. `Err`: the UCX
    /// path failed (the chunk's reservations are aborted, best effort).
    fn ucx_put_chunk(
        &self,
        peer: &str,
        session: &mut ControlSession<'_>,
        endpoint: &Mutex<Endpoint>,
        items: &[PutItem<'_>],
        results: &mut [Option<Result<(), TransportError>>],
    ) -> Result<(), String> {
        // One object larger than a whole request can reserve goes over frames.
        let wanted: Vec<usize> = (0..items.len())
            .filter(|&i| (items[i].value.len() as u64 + CHECKSUM_LEN as u64) <= MAX_RESERVE_BYTES)
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        let request = UcxReserveRequest {
            objects: wanted
                .iter()
                .map(|&i| {
                    let item = &items[i];
                    (
                        item.key.to_vec(),
                        (item.value.len() + CHECKSUM_LEN) as u64,
                        item.depth,
                    )
                })
                .collect(),
        };
        let reply: UcxReserveReply = session
            .control(Opcode::PeerUcxReserve, &request)
            .map_err(|e| format!("reserve: {e}"))?;
        let reserved: Vec<u64> = reply
            .items
            .iter()
            .filter_map(|r| match r {
                ReserveItem::Extent { id, .. } => Some(*id),
                _ => None,
            })
            .collect();
        let abort = |session: &mut ControlSession<'_>| {
            if !reserved.is_empty() {
                let _: Result<UcxHello, _> = session.control(
                    Opcode::PeerUcxAbort,
                    &UcxCommit {
                        ids: reserved.clone(),
                    },
                );
            }
        };
        if reply.items.len() != wanted.len() {
            abort(session);
            return Err(format!(
                "reserve answered {} objects for {}",
                reply.items.len(),
                wanted.len()
            ));
        }
        // Each reserved object: its bytes, then its checksum trailer, at its extent.
        let mut trailers: Vec<[u8; CHECKSUM_LEN]> = Vec::with_capacity(reserved.len());
        let mut slots: Vec<(usize, u64, u64)> = Vec::with_capacity(reserved.len());
        for (&i, answer) in wanted.iter().zip(&reply.items) {
            match *answer {
                ReserveItem::Extent { id, addr } => {
                    let item = &items[i];
                    if addr
                        .checked_add((item.value.len() + CHECKSUM_LEN) as u64)
                        .is_none()
                    {
                        abort(session);
                        return Err(format!(
                            "reserve answered an extent at {addr:#x} that wraps"
                        ));
                    }
                    trailers.push(self.tcp.integrity().trailer(item.key, item.value));
                    slots.push((i, id, addr));
                }
                // No room now, or not storable there: over frames.
                ReserveItem::Full | ReserveItem::TooBig => {}
                // Put-if-absent: the node holds the key already.
                ReserveItem::Present => results[i] = Some(Ok(())),
            }
        }
        if slots.is_empty() {
            return Ok(());
        }
        let mut extents: Vec<RemoteExtent> = Vec::with_capacity(slots.len() * 2);
        let mut srcs: Vec<&[u8]> = Vec::with_capacity(slots.len() * 2);
        for (&(i, _, addr), trailer) in slots.iter().zip(&trailers) {
            let value = items[i].value;
            if !value.is_empty() {
                extents.push(RemoteExtent {
                    remote: addr,
                    len: value.len(),
                });
                srcs.push(value);
            }
            extents.push(RemoteExtent {
                remote: addr + value.len() as u64,
                len: CHECKSUM_LEN,
            });
            srcs.push(&trailer[..]);
        }
        let locals = self.locals(srcs.iter().copied());
        if let Err(e) = endpoint
            .lock()
            .put_with(&extents, &srcs, &locals, self.timeout)
        {
            abort(session);
            return Err(format!("one-sided write: {e}"));
        }
        let ids: Vec<u64> = slots.iter().map(|s| s.1).collect();
        let done: UcxCommitReply = session
            .control(Opcode::PeerUcxCommit, &UcxCommit { ids })
            .map_err(|e| format!("commit: {e}"))?;
        if done.items.len() != slots.len() {
            return Err(format!(
                "commit answered {} objects for {}",
                done.items.len(),
                slots.len()
            ));
        }
        let mut bytes = 0u64;
        for (&(i, _, _), outcome) in slots.iter().zip(&done.items) {
            results[i] = match outcome {
                CommitItem::Stored => {
                    bytes += (items[i].value.len() + CHECKSUM_LEN) as u64;
                    Some(Ok(()))
                }
                CommitItem::Present => Some(Ok(())),
                // The landing bytes did not verify, or the reservation lapsed: over frames.
                CommitItem::Checksum | CommitItem::Unknown => None,
                CommitItem::StoreFailed => Some(Err(TransportError::Refused {
                    peer: peer.to_string(),
                    code: peer_error_code::STORE,
                    message: "the node's store refused the object written over UCX".into(),
                })),
            };
        }
        metrics::counter!(names::PEER_TRANSFER_BYTES, "peer" => peer.to_string(), "direction" => "out")
            .increment(bytes);
        Ok(())
    }
}

/// A UCX peer's handles, cloned out of the peer table (used without holding its lock).
struct UcxPeer {
    endpoint: Arc<Mutex<Endpoint>>,
    worker_address: Arc<Vec<u8>>,
    landing: Arc<Mutex<LandingState>>,
}

/// Every item's result once the UCX and frame passes are done; an item neither pass answered
/// (a bug) fails instead of being dropped.
fn settle(results: Vec<Option<Result<(), TransportError>>>) -> Vec<Result<(), TransportError>> {
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(TransportError::BatchAborted {
                    reason: "no result".into(),
                })
            })
        })
        .collect()
}

impl Transport for UcxTransport {
    fn put(&self, peer: &str, items: &[PutItem<'_>]) -> Vec<Result<(), TransportError>> {
        if items.is_empty() {
            return Vec::new();
        }
        let Some((endpoint, landing)) = self.landing(peer) else {
            return self.tcp.put(peer, items);
        };
        let PutOutcome { results, failure } = self.ucx_put(peer, &endpoint, &landing, items);
        if let Some(reason) = failure {
            self.fall_back(peer, reason);
        }
        // Refused reservations, items never reserved and everything after a failure: frames.
        let frames: Vec<usize> = (0..items.len()).filter(|&i| results[i].is_none()).collect();
        let mut results = results;
        if !frames.is_empty() {
            let rest: Vec<PutItem<'_>> = frames.iter().map(|&i| items[i]).collect();
            for (i, r) in frames.into_iter().zip(self.tcp.put(peer, &rest)) {
                results[i] = Some(r);
            }
        }
        settle(results)
    }

    fn get(&self, peer: &str, items: &mut [GetItem<'_>]) -> Vec<Result<(), TransportError>> {
        if items.is_empty() {
            return Vec::new();
        }
        let Some(endpoint) = self.endpoint(peer) else {
            return self.tcp.get(peer, items);
        };
        match self.ucx_get(peer, &endpoint, items) {
            Ok(results) => {
                let frames: Vec<usize> =
                    (0..items.len()).filter(|&i| results[i].is_none()).collect();
                if frames.is_empty() {
                    return results.into_iter().flatten().collect();
                }
                // The objects not in registered memory: over frames.
                let mut rest: Vec<GetItem<'_>> = Vec::with_capacity(frames.len());
                let mut results = results;
                let mut slots: Vec<Option<&mut GetItem<'_>>> = items.iter_mut().map(Some).collect();
                for &i in &frames {
                    if let Some(item) = slots[i].take() {
                        rest.push(GetItem {
                            key: item.key,
                            dst: &mut *item.dst,
                        });
                    }
                }
                let framed = self.tcp.get(peer, &mut rest);
                for (i, r) in frames.into_iter().zip(framed) {
                    results[i] = Some(r);
                }
                settle(results)
            }
            Err(reason) => {
                self.fall_back(peer, reason);
                self.tcp.get(peer, items)
            }
        }
    }

    fn remove(&self, peer: &str, keys: &[&[u8]]) -> Result<Vec<bool>, TransportError> {
        self.tcp.remove(peer, keys)
    }

    fn demote(&self, peer: &str, keys: &[&[u8]]) -> Result<Vec<bool>, TransportError> {
        self.tcp.demote(peer, keys)
    }

    fn clear_prefix(&self, peer: &str, prefix: &[u8]) -> Result<Vec<Vec<u8>>, TransportError> {
        self.tcp.clear_prefix(peer, prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::{auto_choice, object_reads, parse_lanes};
    use kvtier_proto::peer_ucx::LeaseExtentError;

    #[test]
    fn hostile_lease_replies_are_refused_before_any_read() {
        let mut dst = vec![0u8; 16];
        let mut trailer = [0u8; 8];
        // A well-formed reply: split over the value, then the trailer.
        let reads = object_reads(&[(0x1000, 10), (0x8000, 14)], &mut dst, &mut trailer).unwrap();
        let shape: Vec<(usize, u64, usize, usize)> = reads
            .iter()
            .map(|(part, e, d)| (*part, e.remote, e.len, d.len()))
            .collect();
        // Each read names the extent (and so the key) it reads from.
        assert_eq!(
            shape,
            vec![(0, 0x1000, 10, 10), (1, 0x8000, 6, 6), (1, 0x8006, 8, 8)]
        );
        // What made a reader spin and abort: lengths that wrap to the object's size when
        // summed with `+`, an empty extent, a 2 GiB extent, an address that wraps.
        let hostile: [(&[(u64, u64)], LeaseExtentError); 4] = [
            (
                &[(0x1000, u64::MAX - 7), (0x2000, 32)],
                LeaseExtentError::Wraps {
                    index: 0,
                    addr: 0x1000,
                    len: u64::MAX - 7,
                },
            ),
            (
                &[(0x1000, 0), (0x2000, 24)],
                LeaseExtentError::Empty {
                    index: 0,
                    addr: 0x1000,
                    object: 24,
                },
            ),
            (
                &[(0x1000, 2 << 30)],
                LeaseExtentError::ExceedsObject {
                    index: 0,
                    len: 2 << 30,
                    object: 24,
                },
            ),
            (
                &[(u64::MAX - 8, 24)],
                LeaseExtentError::Wraps {
                    index: 0,
                    addr: u64::MAX - 8,
                    len: 24,
                },
            ),
        ];
        for (parts, expected) in hostile {
            let got = object_reads(parts, &mut dst, &mut trailer).map(|r| r.len());
            assert_eq!(got, Err(expected.clone()), "{parts:?}");
        }
    }

    fn lanes(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn auto_keeps_ucx_only_where_reads_skip_the_node_cpu() {
        // What UCX 1.13 negotiates here (tests pin these): emulated reads, frames win.
        for emulated in [
            lanes(&["tcp/lo"]),
            lanes(&["posix/memory"]),
            lanes(&["sysv/memory", "tcp/lo"]),
            lanes(&[]),
        ] {
            let why = auto_choice(&emulated).unwrap_err();
            assert!(why.contains("emulated"), "{emulated:?}: {why}");
        }
        // RDMA on a fabric, or a single-copy shared-memory lane.
        for (one_sided, named) in [
            (
                lanes(&["rc_mlx5/mlx5_0:1", "ud_mlx5/mlx5_0:1"]),
                "rc_mlx5/mlx5_0:1",
            ),
            (lanes(&["tcp/eth0", "dc_mlx5/mlx5_1:1"]), "dc_mlx5/mlx5_1:1"),
            (lanes(&["rc_verbs/mlx4_0:1"]), "rc_verbs/mlx4_0:1"),
            (lanes(&["posix/memory", "cma/memory"]), "cma/memory"),
            (lanes(&["xpmem/memory"]), "xpmem/memory"),
        ] {
            let why = auto_choice(&one_sided).unwrap();
            assert!(why.contains(named), "{one_sided:?}: {why}");
        }
        // A transport merely named like one is not taken for it.
        assert!(auto_choice(&lanes(&["cmax/memory", "tcp_rc/lo"])).is_err());
    }

    #[test]
    fn lanes_are_read_from_print_info() {
        let info = "#\n# UCP endpoint\n#\n#               peer: <no debug data>\n\
            #                 lane[0]:  2:tcp/lo.0 md[1]          -> md[1]/tcp/sysdev[255] rma_bw#0 am am_bw#0\n\
            #                 lane[1]:  0:posix/memory.0 md[0]  -> md[0]/posix/sysdev[255] rma_bw#1\n\
            #                 lane[2]:  3:tcp/lo.0 md[1]  -> md[1]/tcp/sysdev[255] wireup\n";
        assert_eq!(parse_lanes(info), vec!["tcp/lo", "posix/memory"]);
        assert!(parse_lanes("").is_empty());
        assert!(parse_lanes("lane[0]: garbage 1:2 :x/").is_empty());
    }
}
