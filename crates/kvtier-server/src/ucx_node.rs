//! A cluster node's side of the UCX data plane (issue 17): the node registers its DRAM arena
//! with UCX, runs a worker with a progress thread, hands its worker address and the arena's
//! remote key to authenticated peers, and pins objects for their one-sided reads (leases).
//!
//! Owns: the node's UCX context, worker, arena registration, progress thread and lease table.
//!
//! Invariants:
//! - Only the data port calls [`serve`], on connections that passed the cluster-token
//!   handshake: an unauthenticated process never learns the worker address or the key.
//! - A leased object is pinned ([`kvtier_client::Client::pin`]): its DRAM extents cannot be
//!   evicted or reused until the lease is released or expires ([`LEASE_TIME`]); at most
//!   [`MAX_LEASES`] leases are held (a new one beyond is refused, the reader uses frames), so
//!   a peer cannot pin the store full. Expired leases are dropped by the progress thread.
//! - A lease belongs to the data-port connection that took it: only that connection releases
//!   it, and its leases are dropped when it ends ([`UcxNode::release_connection`]), so a peer
//!   that dies holds nothing past its connection and cannot release another reader's pins.
//! - Only extents inside the registered arena are handed out; an object held elsewhere (read
//!   from the SSD tier for the pin) is answered `NotRemote` and read over frames.
//! - Peers only read: nothing writes into the arena from outside the engine.
//! - Drop order: the progress thread stops, the leases' pins drop, then the registration, then
//!   the worker and context (each handle holds what it needs alive).

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvtier_client::transport::ucx::{host_id, ucx_tls, Context, Registration, Worker};
use kvtier_client::Client;
use kvtier_engine::PinnedObject;
use kvtier_proto::frame::{FLAG_ERROR, FLAG_RESPONSE};
use kvtier_proto::peer_ucx::{
    LeaseItem, UcxHello, UcxLeaseReply, UcxLeaseRequest, UcxOffer, UcxRelease, MAX_LEASE_EXTENTS,
};
use kvtier_proto::server::error_code;
use kvtier_proto::{encode_frame, Decode, Encode, ErrorReply, Opcode};
use parking_lot::Mutex;

/// Leases held at once per node.
pub const MAX_LEASES: usize = 1024;
/// How long a lease pins its objects unless released first.
pub const LEASE_TIME: Duration = Duration::from_secs(5);
/// Error code of a lease refused because [`MAX_LEASES`] are held.
pub const LEASES_FULL: u16 = 40;
/// How long the progress thread sleeps on the worker's event descriptor at most.
const PROGRESS_WAIT: Duration = Duration::from_millis(100);

struct Lease {
    /// The data-port connection that took it.
    connection: u64,
    _pins: Vec<PinnedObject>,
    expires: Instant,
}

#[derive(Default)]
struct Leases {
    held: HashMap<u64, Lease>,
}

impl Leases {
    /// Remove the leases `drop_it` picks and hand them back, so their pins drop after the
    /// table's lock is released.
    fn take(&mut self, mut drop_it: impl FnMut(&Lease) -> bool) -> Vec<Lease> {
        let ids: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, lease)| drop_it(lease))
            .map(|(id, _)| *id)
            .collect();
        ids.iter().filter_map(|id| self.held.remove(id)).collect()
    }
}

/// Counters of the node's UCX plane.
#[derive(Debug, Default)]
pub struct UcxNodeCounters {
    pub leases: AtomicU64,
    pub leased_objects: AtomicU64,
    pub leased_bytes: AtomicU64,
    pub refused_full: AtomicU64,
    pub not_remote: AtomicU64,
}

/// The node's UCX plane; stops when dropped.
pub struct UcxNode {
    offer: UcxOffer,
    base: u64,
    len: u64,
    leases: Arc<Mutex<Leases>>,
    next_lease: AtomicU64,
    counters: UcxNodeCounters,
    stop: Arc<AtomicBool>,
    progress: Option<JoinHandle<()>>,
    worker: Worker,
    // Dropped after the leases' pins (`leases` is only held by this struct and the progress
    // thread, joined in `drop`).
    _registration: Registration,
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
    /// Register `store`'s DRAM arena and start the worker; an error says why UCX is not
    /// served (libucp absent, registration refused, no embedded engine).
    pub fn start(store: &Client) -> Result<UcxNode, String> {
        let (base, len) = store
            .with_engine(|e| e.dram_memory())
            .ok_or("the node's store is not an embedded engine")?;
        let context = Context::new().map_err(|e| e.to_string())?;
        let worker = context.worker().map_err(|e| e.to_string())?;
        let registration = context
            .register(base, len)
            .map_err(|e| format!("cannot register the DRAM arena: {e}"))?;
        let offer = UcxOffer {
            worker_address: worker.address().map_err(|e| e.to_string())?,
            rkey: registration.pack_key().map_err(|e| e.to_string())?,
            max_leases: MAX_LEASES as u64,
            lease_ms: LEASE_TIME.as_millis() as u64,
            transports: ucx_tls(),
            host: host_id(),
        };
        let leases = Arc::new(Mutex::new(Leases::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let progress = {
            let (worker, stop, leases) = (worker.clone(), Arc::clone(&stop), Arc::clone(&leases));
            std::thread::Builder::new()
                .name("kvtier-ucx-progress".into())
                .spawn(move || progress_loop(&worker, &stop, &leases))
                .map_err(|e| format!("cannot start the UCX progress thread: {e}"))?
        };
        Ok(UcxNode {
            base: registration.base(),
            len: registration.len(),
            offer,
            leases,
            next_lease: AtomicU64::new(1),
            counters: UcxNodeCounters::default(),
            stop,
            progress: Some(progress),
            worker,
            _registration: registration,
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

    /// What `kvtier stat` shows of the node's UCX plane.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "enabled": true,
            "ucx_tls": self.offer.transports,
            "registered_bytes": self.len,
            "leases_held": self.leases_held(),
            "leases_total": self.counters.leases.load(Ordering::Relaxed),
            "leased_bytes_total": self.counters.leased_bytes.load(Ordering::Relaxed),
            "leases_refused_full": self.counters.refused_full.load(Ordering::Relaxed),
            "objects_not_remote": self.counters.not_remote.load(Ordering::Relaxed),
        })
    }

    /// Pin the requested objects for `connection`; `Err`: refused (the lease table is full).
    pub fn lease(
        &self,
        store: &Client,
        connection: u64,
        request: &UcxLeaseRequest,
    ) -> Result<UcxLeaseReply, u16> {
        let expired = {
            let mut leases = self.leases.lock();
            let now = Instant::now();
            let expired = leases.take(|lease| lease.expires <= now);
            if leases.held.len() >= MAX_LEASES {
                self.counters.refused_full.fetch_add(1, Ordering::Relaxed);
                return Err(LEASES_FULL);
            }
            expired
        };
        drop(expired);
        let (start, end) = (self.base, self.base + self.len);
        let mut pins = Vec::new();
        let mut items = Vec::with_capacity(request.objects.len());
        let mut bytes = 0u64;
        for (key, expected) in &request.objects {
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
            pin.count_read();
            bytes += pin.len();
            pins.push(pin);
            items.push(LeaseItem::Extents(extents));
        }
        let lease_id = self.next_lease.fetch_add(1, Ordering::Relaxed);
        self.counters.leases.fetch_add(1, Ordering::Relaxed);
        self.counters
            .leased_objects
            .fetch_add(pins.len() as u64, Ordering::Relaxed);
        self.counters
            .leased_bytes
            .fetch_add(bytes, Ordering::Relaxed);
        if !pins.is_empty() {
            self.leases.lock().held.insert(
                lease_id,
                Lease {
                    connection,
                    _pins: pins,
                    expires: Instant::now() + LEASE_TIME,
                },
            );
        }
        Ok(UcxLeaseReply { lease_id, items })
    }

    /// Drop the pins of `connection`'s lease `lease_id` (unknown, expired or another
    /// connection's: nothing to do).
    pub fn release(&self, connection: u64, lease_id: u64) {
        let lease = {
            let mut leases = self.leases.lock();
            match leases.held.get(&lease_id) {
                Some(lease) if lease.connection == connection => leases.held.remove(&lease_id),
                _ => None,
            }
        };
        drop(lease); // the pins drop outside the lock
    }

    /// Drop every lease `connection` still holds: called when that connection ends.
    pub fn release_connection(&self, connection: u64) {
        let leases = self
            .leases
            .lock()
            .take(|lease| lease.connection == connection);
        drop(leases);
    }
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

fn progress_loop(worker: &Worker, stop: &AtomicBool, leases: &Mutex<Leases>) {
    let mut last_reap = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        if let Err(e) = worker.progress_or_wait(PROGRESS_WAIT) {
            eprintln!("kvtier serve: UCX progress failed ({e}); the UCX data plane stops");
            return;
        }
        if last_reap.elapsed() >= PROGRESS_WAIT {
            let now = Instant::now();
            let expired = leases.lock().take(|lease| lease.expires <= now);
            drop(expired);
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

/// Answer one UCX control request of the authenticated data-port connection `connection`:
/// the whole reply frame (an error frame when the node serves no UCX or the body is malformed).
pub fn serve(
    node: Option<&UcxNode>,
    store: &Client,
    connection: u64,
    opcode: Opcode,
    id: u64,
    body: &[u8],
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
                node.release(connection, release.lease_id);
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
