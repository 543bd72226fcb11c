//! A cluster node's side of the UCX data plane (issue 17): the node runs a worker with a
//! progress thread, hands its worker address to authenticated peers, and pins objects for
//! their one-sided reads (leases), each leased extent registered with UCX for that lease only.
//!
//! Owns: the node's UCX context, worker, progress thread, lease table (with each lease's
//! registrations) and put landing area.
//!
//! Invariants:
//! - Only the data port calls [`serve`], on connections that passed the cluster-token
//!   handshake: an unauthenticated process never learns the worker address or the key.
//! - Issue 26: the context loads only transports that protect memory (RDMA RC/DC, cma:
//!   [`kvtier_transport::ucx::lanes`]); UCX's emulated lanes, which would serve a
//!   stranger's reads and writes without any key check, are never loaded, and without an RDMA
//!   lane [`UcxNode::start`] fails with the reason and the node serves frames only. The
//!   context uses only the devices behind the interface of the node's `--data-addr`
//!   ([`kvtier_transport::ucx::devices`]; a wildcard or no device left: frames).
//! - Issue 26: the arena is never registered as a whole. A lease registers each of its
//!   extents (whole DRAM blocks of one leased object: blocks are page multiples, so the
//!   registration's pages hold nothing else) for remote reads only, hands the packed keys to
//!   the lease's connection, and unmaps them when the lease ends, before its pins drop: a key
//!   reaches only what one lease pinned, for as long as it is pinned, never a local tenant's
//!   memory (the data port leases cluster keys only).
//! - A leased object is pinned ([`kvtier_store::store::Store::pin`]): its DRAM extents cannot be
//!   evicted or reused until the lease is released or expires ([`LEASE_TIME`]); at most
//!   [`MAX_LEASES`] leases are held (a new one beyond is refused, the reader uses frames), so
//!   a peer cannot pin the store full. Expired leases are dropped by the progress thread.
//! - A lease belongs to the data-port connection that took it: only that connection releases
//!   it, and its leases are dropped when it ends ([`UcxNode::release_connection`]), so a peer
//!   that dies holds nothing past its connection and cannot release another reader's pins.
//! - Only extents inside the registered arena are handed out; an object held elsewhere (read
//!   from the SSD tier for the pin) is answered `NotRemote` and read over frames.
//! - Peers only read the arena: nothing writes into it from outside the engine. One-sided
//!   puts land in a separate landing area ([`crate::landing`], `put_landing_mib`, registered
//!   writable): a peer reserves extents there, writes, and commits; the node copies each
//!   extent out, verifies its checksum trailer on that private copy and stores the copy
//!   put-if-absent, so bytes a peer rewrites after the commit never reach the store.
//! - A reservation belongs to the data-port connection that made it (only it commits or
//!   aborts it; [`UcxNode::release_connection`] frees them), expires after
//!   [`RESERVATION_TIME`], at most [`MAX_RESERVATIONS`] are held, and one connection holds at
//!   most half the landing area, so no peer can fill it for ever.
//! - Drop order: the progress thread stops, each lease's registrations are unmapped and then
//!   its pins drop, then the worker and context (each handle holds what it needs alive).

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::server::TenantStore;
use kvtier_engine::PinnedObject;
use kvtier_proto::auth::{ObjectIntegrity, CHECKSUM_LEN};
use kvtier_proto::frame::{FLAG_ERROR, FLAG_RESPONSE};
use kvtier_proto::peer_ucx::{
    CommitItem, LeaseItem, ReserveItem, UcxCommit, UcxCommitReply, UcxHello, UcxLanding,
    UcxLeaseReply, UcxLeaseRequest, UcxOffer, UcxRelease, UcxReserveReply, UcxReserveRequest,
    MAX_LEASE_EXTENTS,
};
use kvtier_store::store::Store;
use kvtier_transport::ucx::{host_id, Context, Registration, Worker};

use crate::landing::{Extents, LandingMemory};
use kvtier_proto::server::error_code;
use kvtier_proto::{encode_frame, Decode, Encode, ErrorReply, Opcode};
use parking_lot::Mutex;

/// Leases held at once per node.
pub const MAX_LEASES: usize = 1024;
/// How long a lease pins its objects unless released first.
pub const LEASE_TIME: Duration = Duration::from_secs(5);
/// Error code of a lease refused because [`MAX_LEASES`] are held.
pub const LEASES_FULL: u16 = 40;
/// Put reservations held at once per node.
pub const MAX_RESERVATIONS: usize = 4096;
/// How long a put reservation lives unless committed or aborted first.
pub const RESERVATION_TIME: Duration = Duration::from_secs(5);
/// One connection holds at most `1 / CONNECTION_SHARE` of the landing area.
pub const CONNECTION_SHARE: u64 = 2;
/// Leases pin at most `1 / LEASE_NODE_SHARE` of the arena at once, whoever holds them: the
/// rest stays evictable, so members leasing everything cannot block puts (local tenants'
/// included) by pinning the store full (issue 26). Objects beyond are answered `NotRemote`
/// (read over frames).
pub const LEASE_NODE_SHARE: u64 = 2;
/// One data-port connection's leases pin at most `1 / LEASE_CONNECTION_SHARE` of the arena
/// (a reader's batch of up to `MAX_LEASE_OBJECTS` objects larger than that is partly read
/// over frames).
pub const LEASE_CONNECTION_SHARE: u64 = 4;
/// How long the progress thread sleeps on the worker's event descriptor at most.
const PROGRESS_WAIT: Duration = Duration::from_millis(100);

struct Lease {
    /// The data-port connection that took it.
    connection: u64,
    /// One registration per leased extent. Declared before the pins: unmapped first, so no
    /// key outlives the pin of the memory it reaches.
    registrations: Vec<Registration>,
    _pins: Vec<PinnedObject>,
    /// The pinned objects' bytes (trailers included): what the reader moves one-sided.
    bytes: u64,
    expires: Instant,
}

#[derive(Default)]
struct Leases {
    held: HashMap<u64, Lease>,
    /// Bytes pinned by held leases plus those set aside for leases being made, in all and per
    /// connection (bounded by [`LEASE_NODE_SHARE`] / [`LEASE_CONNECTION_SHARE`]).
    pinned: u64,
    pinned_per_connection: HashMap<u64, u64>,
}

impl Leases {
    /// Count `bytes` pinned (or set aside) for `connection`.
    fn add_pinned(&mut self, connection: u64, bytes: u64) {
        self.pinned += bytes;
        *self.pinned_per_connection.entry(connection).or_default() += bytes;
    }

    /// Stop counting `bytes` of `connection`'s.
    fn sub_pinned(&mut self, connection: u64, bytes: u64) {
        self.pinned = self.pinned.saturating_sub(bytes);
        if let Some(held) = self.pinned_per_connection.get_mut(&connection) {
            *held = held.saturating_sub(bytes);
            if *held == 0 {
                self.pinned_per_connection.remove(&connection);
            }
        }
    }

    /// Remove lease `id` (its pinned bytes no longer counted).
    fn remove(&mut self, id: u64) -> Option<Lease> {
        let lease = self.held.remove(&id)?;
        self.sub_pinned(lease.connection, lease.bytes);
        Some(lease)
    }

    /// Remove the leases `drop_it` picks and hand them back, so their pins drop after the
    /// table's lock is released.
    fn take(&mut self, mut drop_it: impl FnMut(&Lease) -> bool) -> Vec<Lease> {
        let ids: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, lease)| drop_it(lease))
            .map(|(id, _)| *id)
            .collect();
        ids.iter().filter_map(|id| self.remove(*id)).collect()
    }
}

struct Reservation {
    connection: u64,
    key: Vec<u8>,
    depth: Option<u32>,
    offset: u64,
    len: u64,
    taken: u64,
    expires: Instant,
}

/// The put landing area's bookkeeping.
struct Reservations {
    held: HashMap<u64, Reservation>,
    extents: Extents,
    /// Bytes (taken) each connection holds reserved.
    per_connection: HashMap<u64, u64>,
    next_id: u64,
}

impl Reservations {
    /// Forget `id`'s reservation (its extent stays out until [`Self::free`]).
    fn remove(&mut self, id: u64) -> Option<Reservation> {
        let r = self.held.remove(&id)?;
        if let Some(bytes) = self.per_connection.get_mut(&r.connection) {
            *bytes = bytes.saturating_sub(r.taken);
            if *bytes == 0 {
                self.per_connection.remove(&r.connection);
            }
        }
        Some(r)
    }

    fn free(&mut self, r: &Reservation) {
        self.extents.free(r.offset, r.taken);
    }

    /// Free every reservation `drop_it` picks; how many.
    fn drop_where(&mut self, mut drop_it: impl FnMut(&Reservation) -> bool) -> u64 {
        let ids: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, r)| drop_it(r))
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            if let Some(r) = self.remove(*id) {
                self.free(&r);
            }
        }
        ids.len() as u64
    }
}

/// The landing area: its memory, registration and bookkeeping.
struct Landing {
    reservations: Mutex<Reservations>,
    offer: UcxLanding,
    /// Reservations freed at expiry.
    expired: AtomicU64,
    // Field order: the registration drops before the memory it registers.
    _registration: Registration,
    memory: LandingMemory,
}

/// Counters of the node's UCX plane.
#[derive(Debug, Default)]
pub struct UcxNodeCounters {
    pub leases: AtomicU64,
    pub leased_objects: AtomicU64,
    pub leased_bytes: AtomicU64,
    pub refused_full: AtomicU64,
    /// Lease items answered `NotRemote` because the pinned-bytes bounds were reached.
    pub refused_pinned: AtomicU64,
    pub not_remote: AtomicU64,
    /// Put extents handed out.
    pub reservations: AtomicU64,
    /// Reserve items refused (full, too big).
    pub reservations_refused: AtomicU64,
    /// Objects stored through the landing area, and their bytes.
    pub ucx_puts: AtomicU64,
    pub ucx_put_bytes: AtomicU64,
    /// Bytes committed from the landing area (stored, present or refused): what
    /// `kvtier_peer_transfer_bytes_total{direction="in"}` counts of one-sided puts.
    pub landed_bytes: AtomicU64,
    /// Bytes of the leases peers released: what that metric counts `"out"` of one-sided reads.
    pub released_bytes: AtomicU64,
    /// Commits refused: the extent's bytes did not match their checksum.
    pub commits_refused_checksum: AtomicU64,
    /// Commits of ids that are not a live reservation of the committing connection.
    pub commits_unknown: AtomicU64,
    /// Bytes registered for leases in all (each lease's extents, unmapped when it ends).
    pub registered_bytes: AtomicU64,
    /// Leased extents UCX refused to register (the object is read over frames).
    pub registrations_refused: AtomicU64,
}

/// The node's UCX plane; stops when dropped.
pub struct UcxNode {
    offer: UcxOffer,
    /// The UCX devices the context may use (issue 26 §1: those behind `--data-addr`).
    devices: String,
    base: u64,
    len: u64,
    leases: Arc<Mutex<Leases>>,
    next_lease: AtomicU64,
    counters: UcxNodeCounters,
    stop: Arc<AtomicBool>,
    progress: Option<JoinHandle<()>>,
    landing: Option<Arc<Landing>>,
    worker: Worker,
    /// Registers each lease's extents.
    context: Context,
    /// Registrations UCX refused, logged rate-limited.
    registration_log: Arc<kvtier_proto::refusals::RefusalLog>,
}

impl std::fmt::Debug for UcxNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxNode")
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl UcxNode {
    /// Register `store`'s DRAM arena and start the worker on the devices behind the interface
    /// of `data_ip` (the node's `--data-addr`; issue 26 §1); an error says why UCX is not
    /// served (libucp absent, no lane or device left, registration refused, no embedded
    /// engine).
    pub fn start(store: &TenantStore, data_ip: IpAddr) -> Result<UcxNode, String> {
        let landing_bytes = store.config().put_landing_mib << 20;
        Self::start_with_landing(store, landing_bytes, data_ip)
    }

    /// [`Self::start`] with a put landing area of `landing_bytes` (0: no one-sided puts).
    pub fn start_with_landing(
        store: &TenantStore,
        landing_bytes: u64,
        data_ip: IpAddr,
    ) -> Result<UcxNode, String> {
        let (base, len) = store
            .inner()
            .dram_memory()
            .ok_or("the node's store is not an embedded engine")?;
        let context = Context::bound_to(data_ip).map_err(|e| e.to_string())?;
        let worker = context.worker().map_err(|e| e.to_string())?;
        let offer = UcxOffer {
            worker_address: worker.address().map_err(|e| e.to_string())?,
            max_leases: MAX_LEASES as u64,
            lease_ms: LEASE_TIME.as_millis() as u64,
            transports: context.transports().to_string(),
            host: host_id(),
        };
        let devices = context.devices().to_string();
        let landing = landing_area(&context, landing_bytes)?;
        let leases = Arc::new(Mutex::new(Leases::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let progress = {
            let (worker, stop, leases) = (worker.clone(), Arc::clone(&stop), Arc::clone(&leases));
            let landing = landing.clone();
            std::thread::Builder::new()
                .name("kvtier-ucx-progress".into())
                .spawn(move || progress_loop(&worker, &stop, &leases, landing.as_deref()))
                .map_err(|e| format!("cannot start the UCX progress thread: {e}"))?
        };
        Ok(UcxNode {
            base: base as u64,
            len: len as u64,
            offer,
            devices,
            leases,
            next_lease: AtomicU64::new(1),
            counters: UcxNodeCounters::default(),
            stop,
            progress: Some(progress),
            landing,
            worker,
            context,
            registration_log: kvtier_proto::refusals::RefusalLog::new(
                "kvtier serve",
                "UCX lease registration",
            ),
        })
    }

    pub fn offer(&self) -> &UcxOffer {
        &self.offer
    }

    pub fn counters(&self) -> &UcxNodeCounters {
        &self.counters
    }

    /// Leases held now.
    pub fn leases_held(&self) -> usize {
        self.leases.lock().held.len()
    }

    /// Bytes the held leases pin now (at most `1 / LEASE_NODE_SHARE` of the arena).
    pub fn pinned_bytes(&self) -> u64 {
        self.leases.lock().pinned
    }

    /// The arena's registered length (the pinned-bytes bounds are shares of it).
    pub fn arena_len(&self) -> u64 {
        self.len
    }

    /// Put reservations held now.
    pub fn reservations_held(&self) -> usize {
        self.landing
            .as_ref()
            .map_or(0, |l| l.reservations.lock().held.len())
    }

    /// Bytes of the landing area reserved now.
    pub fn landing_used(&self) -> u64 {
        self.landing
            .as_ref()
            .map_or(0, |l| l.reservations.lock().extents.used())
    }

    /// What `kvtier stat` shows of the node's UCX plane.
    pub fn describe(&self) -> serde_json::Value {
        let c = &self.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut doc = self.describe_reads();
        doc["put_landing_bytes"] =
            serde_json::json!(self.landing.as_ref().map_or(0, |l| l.offer.size));
        doc["put_landing_used"] = serde_json::json!(self.landing_used());
        doc["reservations_held"] = serde_json::json!(self.reservations_held());
        doc["reservations_total"] = serde_json::json!(load(&c.reservations));
        doc["reservations_refused"] = serde_json::json!(load(&c.reservations_refused));
        doc["reservations_expired"] = serde_json::json!(self
            .landing
            .as_ref()
            .map_or(0, |l| l.expired.load(Ordering::Relaxed)));
        doc["ucx_puts"] = serde_json::json!(load(&c.ucx_puts));
        doc["ucx_put_bytes"] = serde_json::json!(load(&c.ucx_put_bytes));
        doc["landed_bytes_total"] = serde_json::json!(load(&c.landed_bytes));
        doc["commits_refused_checksum"] = serde_json::json!(load(&c.commits_refused_checksum));
        doc["commits_unknown"] = serde_json::json!(load(&c.commits_unknown));
        doc
    }

    fn describe_reads(&self) -> serde_json::Value {
        serde_json::json!({
            "enabled": true,
            "ucx_tls": self.offer.transports,
            "ucx_net_devices": self.devices,
            "arena_bytes": self.len,
            "registered_bytes": self.registered_bytes(),
            "registered_bytes_total": self.counters.registered_bytes.load(Ordering::Relaxed),
            "registrations_refused": self.counters.registrations_refused.load(Ordering::Relaxed),
            "leases_held": self.leases_held(),
            "leases_total": self.counters.leases.load(Ordering::Relaxed),
            "leased_bytes_total": self.counters.leased_bytes.load(Ordering::Relaxed),
            "released_bytes_total": self.counters.released_bytes.load(Ordering::Relaxed),
            "leases_refused_full": self.counters.refused_full.load(Ordering::Relaxed),
            "lease_items_refused_pinned": self.counters.refused_pinned.load(Ordering::Relaxed),
            "objects_not_remote": self.counters.not_remote.load(Ordering::Relaxed),
        })
    }

    /// Pin the requested objects for `connection`; `Err`: refused (the lease table is full).
    pub fn lease(
        &self,
        store: &TenantStore,
        connection: u64,
        request: &UcxLeaseRequest,
    ) -> Result<UcxLeaseReply, u16> {
        let wanted = request
            .objects
            .iter()
            .fold(0u64, |sum, (_, len)| sum.saturating_add(*len));
        let (expired, budget) = {
            let mut leases = self.leases.lock();
            let now = Instant::now();
            let expired = leases.take(|lease| lease.expires <= now);
            if leases.held.len() >= MAX_LEASES {
                self.counters.refused_full.fetch_add(1, Ordering::Relaxed);
                return Err(LEASES_FULL);
            }
            // Set aside what this request may pin, within both bounds, before pinning (the
            // pins are taken outside the lock; other connections see the room as taken).
            let node_room = (self.len / LEASE_NODE_SHARE).saturating_sub(leases.pinned);
            let held = leases
                .pinned_per_connection
                .get(&connection)
                .copied()
                .unwrap_or(0);
            let connection_room = (self.len / LEASE_CONNECTION_SHARE).saturating_sub(held);
            let budget = wanted.min(node_room).min(connection_room);
            leases.add_pinned(connection, budget);
            (expired, budget)
        };
        drop(expired);
        let (start, end) = (self.base, self.base + self.len);
        let mut pins = Vec::new();
        let mut registrations = Vec::new();
        let mut items = Vec::with_capacity(request.objects.len());
        let mut bytes = 0u64;
        for (key, expected) in &request.objects {
            if bytes.saturating_add(*expected) > budget {
                // Over the node's or this connection's pinned-bytes bound: over frames.
                self.counters.refused_pinned.fetch_add(1, Ordering::Relaxed);
                items.push(LeaseItem::NotRemote);
                continue;
            }
            let Some(pin) = store.pin(key) else {
                items.push(LeaseItem::NotFound);
                continue;
            };
            if pin.len() != *expected {
                items.push(LeaseItem::SizeMismatch);
                continue;
            }
            let extents: Vec<(u64, u64)> = pin
                .slices()
                .map(|s| (s.as_ptr() as u64, s.len() as u64))
                .collect();
            let inside = extents.len() <= MAX_LEASE_EXTENTS
                && extents
                    .iter()
                    .all(|&(a, l)| a >= start && l <= end.saturating_sub(a));
            if !inside {
                self.counters.not_remote.fetch_add(1, Ordering::Relaxed);
                items.push(LeaseItem::NotRemote);
                continue;
            }
            let Some((object_registrations, keys)) = self.register_extents(&extents) else {
                self.counters.not_remote.fetch_add(1, Ordering::Relaxed);
                items.push(LeaseItem::NotRemote);
                continue;
            };
            pin.count_read();
            bytes += pin.len();
            pins.push(pin);
            registrations.extend(object_registrations);
            items.push(LeaseItem::Extents { extents, keys });
        }
        let lease_id = self.next_lease.fetch_add(1, Ordering::Relaxed);
        self.counters.leases.fetch_add(1, Ordering::Relaxed);
        self.counters
            .leased_objects
            .fetch_add(pins.len() as u64, Ordering::Relaxed);
        self.counters
            .leased_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        let mut leases = self.leases.lock();
        // Only what was pinned stays counted (`bytes <= budget`: checked per object above).
        leases.sub_pinned(connection, budget - bytes);
        if !pins.is_empty() {
            leases.held.insert(
                lease_id,
                Lease {
                    connection,
                    registrations,
                    _pins: pins,
                    bytes,
                    expires: Instant::now() + LEASE_TIME,
                },
            );
        }
        drop(leases);
        Ok(UcxLeaseReply { lease_id, items })
    }

    /// Register each extent of one pinned object for remote reads (this lease only) and pack
    /// its key; `None` when UCX refuses one (logged; the object is read over frames).
    fn register_extents(
        &self,
        extents: &[(u64, u64)],
    ) -> Option<(Vec<Registration>, Vec<Vec<u8>>)> {
        let mut registrations = Vec::with_capacity(extents.len());
        let mut keys = Vec::with_capacity(extents.len());
        for &(addr, len) in extents {
            // The extent lies inside the arena (checked by the caller) and stays mapped while
            // the registration lives: the lease drops it before the pin.
            let registered = usize::try_from(len)
                .map_err(|e| e.to_string())
                .and_then(|len| {
                    self.context
                        .register_prot(addr as usize as *mut u8, len, false)
                        .map_err(|e| e.to_string())
                })
                .and_then(|r| r.pack_key().map(|key| (r, key)).map_err(|e| e.to_string()));
            match registered {
                Ok((registration, key)) => {
                    registrations.push(registration);
                    keys.push(key);
                }
                Err(e) => {
                    self.counters
                        .registrations_refused
                        .fetch_add(1, Ordering::Relaxed);
                    // Rate-limited: a registration limit reached would refuse every lease.
                    self.registration_log.record(
                        "refused a leased extent's registration",
                        "UCX",
                        &format!("{len} bytes at {addr:#x} ({e}); the object is read over frames"),
                    );
                    return None;
                }
            }
        }
        self.counters
            .registered_bytes
            .fetch_add(extents.iter().map(|e| e.1).sum::<u64>(), Ordering::Relaxed);
        Some((registrations, keys))
    }

    /// Bytes registered with UCX now for the held leases (what their keys reach in all).
    pub fn registered_bytes(&self) -> u64 {
        self.leases
            .lock()
            .held
            .values()
            .flat_map(|lease| lease.registrations.iter())
            .map(Registration::len)
            .sum()
    }

    /// Drop the pins of `connection`'s lease `lease_id` (unknown, expired or another
    /// connection's: nothing to do); the bytes it pinned, which the reader says it has read.
    pub fn release(&self, connection: u64, lease_id: u64) -> u64 {
        let lease = {
            let mut leases = self.leases.lock();
            match leases.held.get(&lease_id) {
                Some(lease) if lease.connection == connection => leases.remove(lease_id),
                _ => None,
            }
        };
        // The pins drop outside the lock.
        let bytes = lease.map_or(0, |lease| lease.bytes);
        self.counters
            .released_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        bytes
    }

    /// Drop every lease and free every put reservation `connection` still holds: called when
    /// that connection ends.
    pub fn release_connection(&self, connection: u64) {
        let leases = self
            .leases
            .lock()
            .take(|lease| lease.connection == connection);
        drop(leases);
        if let Some(landing) = &self.landing {
            landing
                .reservations
                .lock()
                .drop_where(|r| r.connection == connection);
        }
    }

    /// Reserve landing extents for `connection` (see [`kvtier_proto::peer_ucx`]).
    pub fn reserve(
        &self,
        store: &TenantStore,
        connection: u64,
        request: &UcxReserveRequest,
    ) -> UcxReserveReply {
        let Some(landing) = &self.landing else {
            return UcxReserveReply {
                items: vec![ReserveItem::TooBig; request.objects.len()],
            };
        };
        let base = landing.memory.base() as u64;
        let now = Instant::now();
        let mut table = landing.reservations.lock();
        let expired = table.drop_where(|r| r.expires <= now);
        landing.expired.fetch_add(expired, Ordering::Relaxed);
        let share = table.extents.size() / CONNECTION_SHARE;
        let mut items = Vec::with_capacity(request.objects.len());
        for (key, len, depth) in &request.objects {
            let item =
                if key.is_empty() || *len <= CHECKSUM_LEN as u64 || *len > table.extents.size() {
                    ReserveItem::TooBig
                } else if store.object_len(key).is_some() {
                    ReserveItem::Present
                } else {
                    let held = table.per_connection.get(&connection).copied().unwrap_or(0);
                    let fits = Extents::rounded(*len)
                        .is_some_and(|need| held.saturating_add(need) <= share);
                    match (fits && table.held.len() < MAX_RESERVATIONS)
                        .then(|| table.extents.alloc(*len))
                        .flatten()
                    {
                        Some((offset, taken)) => {
                            let id = table.next_id;
                            table.next_id += 1;
                            table.held.insert(
                                id,
                                Reservation {
                                    connection,
                                    key: key.clone(),
                                    depth: *depth,
                                    offset,
                                    len: *len,
                                    taken,
                                    expires: now + RESERVATION_TIME,
                                },
                            );
                            *table.per_connection.entry(connection).or_insert(0) += taken;
                            self.counters.reservations.fetch_add(1, Ordering::Relaxed);
                            ReserveItem::Extent {
                                id,
                                addr: base + offset,
                            }
                        }
                        None => ReserveItem::Full,
                    }
                };
            if matches!(item, ReserveItem::Full | ReserveItem::TooBig) {
                self.counters
                    .reservations_refused
                    .fetch_add(1, Ordering::Relaxed);
            }
            items.push(item);
        }
        UcxReserveReply { items }
    }

    /// Free `connection`'s reservations `ids` without storing (others' ids: nothing).
    pub fn abort(&self, connection: u64, ids: &[u64]) {
        if let Some(landing) = &self.landing {
            let mut table = landing.reservations.lock();
            for id in ids {
                if table
                    .held
                    .get(id)
                    .is_some_and(|r| r.connection == connection)
                {
                    if let Some(r) = table.remove(*id) {
                        table.free(&r);
                    }
                }
            }
        }
    }

    /// Verify and store `connection`'s reservations `ids`; `traffic.stored(key)` is called for
    /// each object the store now holds, and the bytes that landed are counted in.
    pub fn commit(
        &self,
        store: &TenantStore,
        connection: u64,
        ids: &[u64],
        traffic: &Traffic<'_>,
    ) -> UcxCommitReply {
        let Some(landing) = &self.landing else {
            return UcxCommitReply {
                items: vec![CommitItem::Unknown; ids.len()],
            };
        };
        let mut items = Vec::with_capacity(ids.len());
        for id in ids {
            let now = Instant::now();
            let reservation = {
                let mut table = landing.reservations.lock();
                match table.held.get(id) {
                    Some(r) if r.connection == connection && r.expires > now => table.remove(*id),
                    _ => None,
                }
            };
            let Some(r) = reservation else {
                self.counters
                    .commits_unknown
                    .fetch_add(1, Ordering::Relaxed);
                items.push(CommitItem::Unknown);
                continue;
            };
            // The extent is out of the table but still allocated: nobody else is handed it
            // while it is copied.
            let copy = landing.memory.copy_out(r.offset, r.len);
            landing.reservations.lock().free(&r);
            traffic.moved_in.increment(r.len);
            self.counters
                .landed_bytes
                .fetch_add(r.len, Ordering::Relaxed);
            let Some(copy) = copy else {
                items.push(CommitItem::Unknown);
                continue;
            };
            let body = copy.len() - CHECKSUM_LEN;
            if !traffic
                .integrity
                .verify(&r.key, &copy[..body], &copy[body..])
            {
                self.counters
                    .commits_refused_checksum
                    .fetch_add(1, Ordering::Relaxed);
                items.push(CommitItem::Checksum);
                continue;
            }
            items.push(match store.put_slice(&r.key, &copy, r.depth) {
                Ok(outcome) => {
                    (traffic.stored)(&r.key);
                    if outcome == kvtier_engine::PutOutcome::Stored {
                        self.counters.ucx_puts.fetch_add(1, Ordering::Relaxed);
                        self.counters
                            .ucx_put_bytes
                            .fetch_add(r.len, Ordering::Relaxed);
                        CommitItem::Stored
                    } else {
                        CommitItem::Present
                    }
                }
                Err(_) => CommitItem::StoreFailed,
            });
        }
        UcxCommitReply { items }
    }
}

/// The put landing area of `landing_bytes` (0: none), registered writable with `context`.
fn landing_area(context: &Context, landing_bytes: u64) -> Result<Option<Arc<Landing>>, String> {
    Ok(if landing_bytes == 0 {
        None
    } else {
        let len = usize::try_from(landing_bytes).map_err(|e| e.to_string())?;
        let memory = LandingMemory::new(len)?;
        let registration = context
            .register_prot(memory.base(), memory.len(), true)
            .map_err(|e| format!("cannot register the put landing area: {e}"))?;
        let extents = Extents::new(landing_bytes);
        let offer = UcxLanding {
            rkey: registration.pack_key().map_err(|e| e.to_string())?,
            size: extents.size(),
            max_connection_bytes: extents.size() / CONNECTION_SHARE,
            reservation_ms: RESERVATION_TIME.as_millis() as u64,
        };
        Some(Arc::new(Landing {
            reservations: Mutex::new(Reservations {
                held: HashMap::new(),
                extents,
                per_connection: HashMap::new(),
                next_id: 1,
            }),
            offer,
            expired: AtomicU64::new(0),
            _registration: registration,
            memory,
        }))
    })
}

impl Drop for UcxNode {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.worker.signal();
        if let Some(h) = self.progress.take() {
            let _ = h.join();
        }
        self.leases.lock().held.clear();
    }
}

fn progress_loop(
    worker: &Worker,
    stop: &AtomicBool,
    leases: &Mutex<Leases>,
    landing: Option<&Landing>,
) {
    let mut last_reap = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if let Err(e) = worker.progress_or_wait(PROGRESS_WAIT) {
            tracing::error!("kvtier serve: UCX progress failed ({e}); the UCX data plane stops");
            return;
        }
        if last_reap.elapsed() >= PROGRESS_WAIT {
            let now = Instant::now();
            let expired = leases.lock().take(|lease| lease.expires <= now);
            drop(expired);
            if let Some(landing) = landing {
                let expired = landing.reservations.lock().drop_where(|r| r.expires <= now);
                landing.expired.fetch_add(expired, Ordering::Relaxed);
            }
            last_reap = now;
        }
    }
}

fn reply<M: Encode>(opcode: Opcode, id: u64, body: &M) -> io::Result<Vec<u8>> {
    let mut frame = Vec::new();
    encode_frame(&mut frame, opcode, id, FLAG_RESPONSE, body).map_err(io::Error::other)?;
    Ok(frame)
}

fn refuse(opcode: Opcode, id: u64, code: u16, message: String) -> io::Result<Vec<u8>> {
    let mut frame = Vec::new();
    encode_frame(
        &mut frame,
        opcode,
        id,
        FLAG_RESPONSE | FLAG_ERROR,
        &ErrorReply { code, message },
    )
    .map_err(io::Error::other)?;
    Ok(frame)
}

/// What a data-port connection is told of its UCX traffic, which its own frames never carry.
pub struct Traffic<'a> {
    /// Called for each object a commit stored.
    pub stored: &'a dyn Fn(&[u8]),
    /// Bytes a peer wrote one-sided and committed (trailers included).
    pub moved_in: &'a metrics::Counter,
    /// Bytes of the leases a peer released: its one-sided reads, which never touch this
    /// node's CPU, counted when the reader says it is done (a lapsed lease counts nothing).
    pub moved_out: &'a metrics::Counter,
    /// The cluster's end-to-end integrity key: a landed put's trailer is checked with it.
    pub integrity: &'a ObjectIntegrity,
}

/// Answer one UCX control request of the authenticated data-port connection `connection`:
/// the whole reply frame (an error frame when the node serves no UCX or the body is malformed).
pub fn serve(
    node: Option<&UcxNode>,
    store: &TenantStore,
    connection: u64,
    opcode: Opcode,
    id: u64,
    body: &[u8],
    traffic: &Traffic<'_>,
) -> io::Result<Vec<u8>> {
    let Some(node) = node else {
        return refuse(
            opcode,
            id,
            error_code::UNSUPPORTED,
            "this node serves no UCX data plane".into(),
        );
    };
    match opcode {
        Opcode::PeerUcxHello => match UcxHello::decode(body) {
            Ok(_) => reply(opcode, id, node.offer()),
            Err(e) => refuse(opcode, id, error_code::MALFORMED, e.to_string()),
        },
        Opcode::PeerUcxLease => match UcxLeaseRequest::decode(body) {
            Ok(request) => match node.lease(store, connection, &request) {
                Ok(lease) => reply(opcode, id, &lease),
                Err(code) => refuse(
                    opcode,
                    id,
                    code,
                    format!("{MAX_LEASES} UCX leases are held; read over frames"),
                ),
            },
            Err(e) => refuse(opcode, id, error_code::MALFORMED, e.to_string()),
        },
        Opcode::PeerUcxRelease => match UcxRelease::decode(body) {
            Ok(release) => {
                traffic
                    .moved_out
                    .increment(node.release(connection, release.lease_id));
                reply(opcode, id, &UcxHello)
            }
            Err(e) => refuse(opcode, id, error_code::MALFORMED, e.to_string()),
        },
        Opcode::PeerUcxPutHello => match (&node.landing, UcxHello::decode(body)) {
            (Some(landing), Ok(_)) => reply(opcode, id, &landing.offer),
            (None, Ok(_)) => refuse(
                opcode,
                id,
                error_code::UNSUPPORTED,
                "this node has no put landing area (put_landing_mib = 0)".into(),
            ),
            (_, Err(e)) => refuse(opcode, id, error_code::MALFORMED, e.to_string()),
        },
        Opcode::PeerUcxReserve => match UcxReserveRequest::decode(body) {
            Ok(request) => reply(opcode, id, &node.reserve(store, connection, &request)),
            Err(e) => refuse(opcode, id, error_code::MALFORMED, e.to_string()),
        },
        Opcode::PeerUcxCommit => match UcxCommit::decode(body) {
            Ok(commit) => reply(
                opcode,
                id,
                &node.commit(store, connection, &commit.ids, traffic),
            ),
            Err(e) => refuse(opcode, id, error_code::MALFORMED, e.to_string()),
        },
        Opcode::PeerUcxAbort => match UcxCommit::decode(body) {
            Ok(abort) => {
                node.abort(connection, &abort.ids);
                reply(opcode, id, &UcxHello)
            }
            Err(e) => refuse(opcode, id, error_code::MALFORMED, e.to_string()),
        },
        _ => refuse(
            opcode,
            id,
            error_code::UNSUPPORTED,
            "not a UCX control request".into(),
        ),
    }
}
