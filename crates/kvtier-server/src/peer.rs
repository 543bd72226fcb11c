//! The peer data port of a cluster node (`kvtier serve --master ... --data-addr HOST:PORT`):
//! cluster clients on any host put and get objects of this node's store over TCP.
//!
//! - Authentication: a mutual challenge-response over the cluster token
//!   ([`kvtier_proto::peer`]): the node proves the token on the client's nonce and its own data
//!   address, then the client proves it on both nonces. Anything else is answered
//!   `UNAUTHORIZED`, logged with the peer's address (rate-limited: the first of a quiet
//!   period in full, then one summary line per interval by reason and source; issue 26),
//!   and the connection is closed; nothing is
//!   served before, and the token never crosses the wire.
//! - Resources: a connection must finish the handshake within [`HELLO_TIMEOUT`] (a reaper
//!   thread cuts it otherwise, however slowly it trickles bytes); at most
//!   [`MAX_UNAUTHENTICATED`] connections may be in the handshake (a new one cuts the oldest) and
//!   at most [`MAX_CONNECTIONS`] open in all (more are closed at accept), both lowered to fit
//!   the process's `RLIMIT_NOFILE` (a third of it open, an eighth handshaking); the accept loop backs
//!   off when the process or system is out of file descriptors (`EMFILE` / `ENFILE`) instead
//!   of spinning; each connection's entry in the registry (and its descriptor) is freed when
//!   its thread ends. Refusals are counted in `kvtier_data_port_refused_total{reason}`.
//! - Two threads per connection (clients keep a few pooled connections per node): a reader
//!   that serves requests in order and a writer that sends the replies in the same order, so
//!   clients may pipeline. The reader reads through a small buffer and hands the writer the
//!   replies of every request already received as one batch (before it would block on the
//!   socket), so a pipelined run of gets costs a few syscalls and thread wake-ups, not a few
//!   per object (up to `REPLIES_IN_FLIGHT` batches queued).
//! - A get is sent without a copy: the reader pins the object (the [`TenantStore`]'s
//!   [`Store::pin`]) and the writer sends the header and the pinned DRAM extents with vectored
//!   writes straight from the store, then drops the pin (so the memory cannot be evicted or
//!   reused while it is sent).
//! - Keys: the port serves the cluster namespace only ([`kvtier_proto::namespace`]): a get,
//!   put, remove, demote, clear prefix, UCX lease or reservation naming any key outside it (a
//!   local tenant's `tenant 0x1f key`, a raw key) is refused whole with
//!   `OUTSIDE_CLUSTER_NAMESPACE` before anything is touched, counted in
//!   `kvtier_data_port_outside_namespace_total{op}` and logged (at most one line per
//!   [`REFUSAL_LOG_PERIOD`], with the number not logged since). Listings (clear replies, the
//!   keys registered with the master) hold cluster keys only.
//! - Puts are put-if-absent in the node's store. Every key stored through this port is
//!   remembered in [`HeldKeys`], which the node agent reports to the master when it
//!   (re-)registers and checks against the store to report evictions.
//! - A frame that loses stream sync closes the connection; a bad body gets an error reply.
//! - Page bytes moved are counted per peer host in `kvtier_peer_transfer_bytes_total{peer,
//!   direction}` (`peer` = the client's IP address, `direction="in"` for puts received,
//!   `"out"` for gets sent), besides the port-wide [`DataPortCounters`]. One-sided UCX
//!   traffic counts there too: committed puts in, released leases out ([`crate::ucx_node`]).

use std::collections::HashMap;
use std::io::{self, BufReader, IoSlice, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::server::TenantStore;
use kvtier_engine::PinnedObject;
use kvtier_proto::auth::{
    proof, verify, ObjectIntegrity, NONCE_LEN, PEER_CLIENT_LABEL, PEER_NODE_LABEL,
};
use kvtier_proto::frame::{FLAG_ERROR, FLAG_RESPONSE, HEADER_LEN};
use kvtier_proto::namespace;
use kvtier_proto::peer::MAX_CLEARED_KEYS;
use kvtier_proto::peer::{
    peer_error_code, PeerAuth, PeerChallenge, PeerGet, PeerHello, PeerPutMeta,
};
use kvtier_proto::peer_ucx::{UcxLeaseRequest, UcxReserveRequest};
use kvtier_proto::server::error_code;
use kvtier_proto::{
    encode_frame, read_frame_limited, BatchResult as WireResult, Decode, ErrorReply, FrameHeader,
    KeyBatch, Opcode, ProtoError,
};
use kvtier_rpc::{key_hash, KeyHash};
use kvtier_store::metrics::names;
use kvtier_store::store::Store;
use kvtier_transport::tcp::write_all_vectored;
use parking_lot::Mutex;

/// Largest body accepted before the handshake is done.
const PRE_HELLO_MAX_BODY: u32 = 4 << 10;
/// How long a connection may take to finish the handshake.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections in the handshake at once; a new one cuts the oldest.
pub const MAX_UNAUTHENTICATED: usize = 128;
/// Connections open at once (each authenticated one runs two threads); more are closed at
/// accept.
pub const MAX_CONNECTIONS: usize = 1024;
/// The caps in force for a process allowed `descriptors` open files: the constants, lowered so
/// that open connections (three descriptors each once authenticated: the socket, the writer's
/// clone, the registry's clone) cannot exhaust the process.
fn connection_caps(descriptors: Option<u64>) -> (usize, usize) {
    let Some(limit) = descriptors else {
        return (MAX_CONNECTIONS, MAX_UNAUTHENTICATED);
    };
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    (
        MAX_CONNECTIONS.min(limit / 3).max(4),
        MAX_UNAUTHENTICATED.min(limit / 8).max(2),
    )
}

/// How long the accept loop pauses when no file descriptor is left (`EMFILE` / `ENFILE`).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// How often the reaper looks for connections past their handshake deadline.
const REAPER_PERIOD: Duration = Duration::from_millis(100);
/// How long stopping the port waits for its connection threads to end (their sockets are cut
/// first, so they end within a read; a thread stuck beyond this is logged and left).
pub const STOP_WAIT: Duration = Duration::from_secs(5);

/// Remove up to [`MAX_CLEARED_KEYS`] of the cluster keys under `prefix` (a cluster prefix,
/// checked by the caller: [`namespace::is_cluster_prefix`]) from the store (any tier) and from
/// the held set; the keys removed, for the caller to forget at the master. Local tenants' keys
/// never start with a cluster prefix, so they are neither removed nor listed.
fn clear_prefix(shared: &PortShared, prefix: &[u8]) -> Vec<Vec<u8>> {
    let keys: Vec<Vec<u8>> =
        crate::node::cluster_keys_under(&shared.store, prefix, MAX_CLEARED_KEYS)
            .into_iter()
            .collect();
    for key in &keys {
        shared.held.remove(key);
    }
    shared.store.remove_keys(&keys);
    keys
}

/// A request named a key outside the cluster namespace: refused whole (issue 26).
#[derive(Debug, thiserror::Error)]
#[error(
    "{op}: key {key} is outside the cluster namespace; a node's data port serves cluster \
     objects only, never a local tenant's keys"
)]
pub struct OutsideClusterNamespace {
    pub op: &'static str,
    /// The key, escaped and cut to `SHOWN_KEY_BYTES`.
    pub key: String,
}

/// Bytes of a refused key shown in its error and log line.
const SHOWN_KEY_BYTES: usize = 64;

impl OutsideClusterNamespace {
    fn new(op: &'static str, key: &[u8]) -> Self {
        let shown = &key[..key.len().min(SHOWN_KEY_BYTES)];
        let more = if key.len() > SHOWN_KEY_BYTES {
            "..."
        } else {
            ""
        };
        OutsideClusterNamespace {
            op,
            key: format!("\"{}\"{more}", shown.escape_ascii()),
        }
    }
}

/// The first key of a request that is outside the cluster namespace, as its refusal.
fn outside_namespace<'k>(
    op: &'static str,
    mut keys: impl Iterator<Item = &'k [u8]>,
) -> Option<OutsideClusterNamespace> {
    keys.find(|k| !namespace::is_cluster_key(k))
        .map(|k| OutsideClusterNamespace::new(op, k))
}

/// The keys a data-port request names, checked against the cluster namespace before it is
/// served (`None`: nothing outside it, or a body the handler itself refuses as malformed).
fn refusal_of(op: Opcode, body: &[u8]) -> Option<OutsideClusterNamespace> {
    match op {
        Opcode::PeerPut => PeerPutMeta::split_body(body)
            .ok()
            .and_then(|(meta, _)| outside_namespace("put", std::iter::once(&meta.key[..]))),
        Opcode::PeerGet => PeerGet::decode(body)
            .ok()
            .and_then(|get| outside_namespace("get", std::iter::once(&get.key[..]))),
        Opcode::PeerRemove | Opcode::PeerDemote => {
            let name = if op == Opcode::PeerRemove {
                "remove"
            } else {
                "demote"
            };
            KeyBatch::decode(body)
                .ok()
                .and_then(|b| outside_namespace(name, b.keys.iter().map(Vec::as_slice)))
        }
        Opcode::PeerClear => KeyBatch::decode(body).ok().and_then(|b| {
            b.keys
                .iter()
                .find(|p| !namespace::is_cluster_prefix(p))
                .map(|p| OutsideClusterNamespace::new("clear", p))
        }),
        Opcode::PeerUcxLease => UcxLeaseRequest::decode(body)
            .ok()
            .and_then(|r| outside_namespace("ucx lease", r.objects.iter().map(|o| o.0.as_slice()))),
        Opcode::PeerUcxReserve => UcxReserveRequest::decode(body).ok().and_then(|r| {
            outside_namespace("ucx reserve", r.objects.iter().map(|o| o.0.as_slice()))
        }),
        _ => None,
    }
}

/// At most one log line per this long for refused keys (the counter counts every one).
pub const REFUSAL_LOG_PERIOD: Duration = Duration::from_secs(10);

/// Rate limit of the refused-key log lines.
#[derive(Default)]
struct RefusalLog {
    last: Option<Instant>,
    /// Refusals since the last line that had no line of their own.
    quiet: u64,
}

/// Keys this node stored for the cluster.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_fit_the_descriptor_limit() {
        assert_eq!(
            connection_caps(None),
            (MAX_CONNECTIONS, MAX_UNAUTHENTICATED)
        );
        assert_eq!(
            connection_caps(Some(1 << 20)),
            (MAX_CONNECTIONS, MAX_UNAUTHENTICATED)
        );
        assert_eq!(connection_caps(Some(256)), (85, 32));
        assert_eq!(connection_caps(Some(3)), (4, 2));
    }
}

/// The cluster keys peers stored on this node since it started, by their directory hash
/// (issue 29: the re-replication worker maps a copy task's hashes to keys here, so an object
/// stored a moment ago is found at once; an index rebuilt from time to time answered
/// `not_held` for it).
#[derive(Debug, Default)]
pub struct HeldKeys {
    keys: Mutex<HashMap<KeyHash, Vec<u8>>>,
}

impl HeldKeys {
    fn insert(&self, key: &[u8]) {
        self.keys
            .lock()
            .entry(key_hash(key))
            .or_insert_with(|| key.to_vec());
    }

    fn remove(&self, key: &[u8]) {
        self.keys.lock().remove(&key_hash(key));
    }

    /// The key stored under `hash` since start, if any (the store may have dropped it since:
    /// the caller's read finds out).
    pub fn key_of(&self, hash: &KeyHash) -> Option<Vec<u8>> {
        self.keys.lock().get(hash).cloned()
    }

    /// Every key still in `store`.
    pub fn snapshot(&self, store: &TenantStore) -> Vec<Vec<u8>> {
        let keys: Vec<Vec<u8>> = self.keys.lock().values().cloned().collect();
        let present = store.exists_keys(&keys);
        keys.into_iter()
            .zip(present)
            .filter_map(|(k, p)| p.then_some(k))
            .collect()
    }

    /// Forget and return the keys the store no longer holds (evicted or removed).
    pub fn take_dropped(&self, store: &TenantStore) -> Vec<Vec<u8>> {
        let keys: Vec<Vec<u8>> = self.keys.lock().values().cloned().collect();
        let present = store.exists_keys(&keys);
        let dropped: Vec<Vec<u8>> = keys
            .into_iter()
            .zip(present)
            .filter_map(|(k, p)| (!p).then_some(k))
            .collect();
        let mut held = self.keys.lock();
        for k in &dropped {
            held.remove(&key_hash(k));
        }
        dropped
    }

    pub fn len(&self) -> usize {
        self.keys.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Counters of the data port.
#[derive(Debug, Default)]
pub struct DataPortCounters {
    pub connections: AtomicU64,
    pub refused_unauthorized: AtomicU64,
    /// Connections cut at the handshake deadline, or to make room for a newer handshake.
    pub hello_timeouts: AtomicU64,
    /// Connections closed at accept: the port was at [`MAX_CONNECTIONS`].
    pub refused_full: AtomicU64,
    pub puts: AtomicU64,
    pub gets: AtomicU64,
    pub misses: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    /// Requests refused whole for a key outside the cluster namespace.
    pub refused_outside_namespace: AtomicU64,
}

/// One open connection, as the registry holds it.
struct Connection {
    /// A clone of the socket, to cut it (handshake deadline, shutdown).
    stream: TcpStream,
    /// Until the handshake is done: when it must be.
    deadline: Option<Instant>,
}

/// The open connections, by id. An entry is removed by its connection's thread when it ends
/// ([`Registered`]), which closes the clone.
#[derive(Default)]
struct Connections {
    open: HashMap<u64, Connection>,
    next_id: u64,
}

impl Connections {
    fn unauthenticated(&self) -> usize {
        self.open.values().filter(|c| c.deadline.is_some()).count()
    }
}

struct PortShared {
    /// Connections open at once, and in the handshake at once ([`connection_caps`]).
    max_connections: usize,
    max_unauthenticated: usize,
    store: Arc<TenantStore>,
    token: Vec<u8>,
    /// The end-to-end integrity key (derived from `token`): checks one-sided puts' trailers.
    integrity: ObjectIntegrity,
    /// Rate limit of the refused-key log lines.
    refusal_log: Mutex<RefusalLog>,
    /// This port's address as peers dial it (bound into the handshake proofs).
    address: String,
    held: Arc<HeldKeys>,
    counters: DataPortCounters,
    stopping: AtomicBool,
    conns: Mutex<Connections>,
    /// Issue 17: the node's UCX data plane, when it serves one.
    ucx: Option<Arc<crate::ucx_node::UcxNode>>,
}

/// Removes a connection's registry entry when its thread ends, however it ends.
struct Registered<'a> {
    shared: &'a PortShared,
    id: u64,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.shared.conns.lock().open.remove(&self.id);
    }
}

fn count_refused(reason: &'static str) {
    metrics::counter!(names::DATA_PORT_REFUSED, "reason" => reason).increment(1);
}

/// Count and (rate-limited) log a request refused for a key outside the cluster namespace.
fn note_outside_namespace(shared: &PortShared, peer: &str, refusal: &OutsideClusterNamespace) {
    shared
        .counters
        .refused_outside_namespace
        .fetch_add(1, Ordering::Relaxed);
    metrics::counter!(names::DATA_PORT_OUTSIDE_NAMESPACE, "op" => refusal.op).increment(1);
    let mut log = shared.refusal_log.lock();
    let now = Instant::now();
    if log
        .last
        .is_some_and(|t| now.duration_since(t) < REFUSAL_LOG_PERIOD)
    {
        log.quiet += 1;
        return;
    }
    let quiet = std::mem::take(&mut log.quiet);
    log.last = Some(now);
    drop(log);
    if quiet > 0 {
        tracing::warn!(
            "kvtier serve: data port refused {peer}: {refusal} ({quiet} more such refusals \
             since the last line)"
        );
    } else {
        tracing::warn!("kvtier serve: data port refused {peer}: {refusal}");
    }
}

/// A running data port.
pub struct DataPort {
    shared: Arc<PortShared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
    reaper: Option<JoinHandle<()>>,
}

impl DataPort {
    /// Bind `addr` and start serving `store` to peers presenting `token`.
    pub fn start(
        addr: SocketAddr,
        store: Arc<TenantStore>,
        token: Vec<u8>,
    ) -> io::Result<DataPort> {
        Self::start_with_ucx(addr, store, token, None)
    }

    /// [`Self::start`], also answering the UCX data plane's control requests with `ucx`
    /// (issue 17; `None`: they are refused `UNSUPPORTED` and peers read over frames).
    pub fn start_with_ucx(
        addr: SocketAddr,
        store: Arc<TenantStore>,
        token: Vec<u8>,
        ucx: Option<Arc<crate::ucx_node::UcxNode>>,
    ) -> io::Result<DataPort> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let descriptors = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
        let (max_connections, max_unauthenticated) = connection_caps(descriptors);
        let shared = Arc::new(PortShared {
            max_connections,
            max_unauthenticated,
            store,
            integrity: ObjectIntegrity::from_token(&token),
            refusal_log: Mutex::new(RefusalLog::default()),
            token,
            address: addr.to_string(),
            held: Arc::new(HeldKeys::default()),
            counters: DataPortCounters::default(),
            stopping: AtomicBool::new(false),
            conns: Mutex::new(Connections::default()),
            ucx,
        });
        let accept = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("kvtier-data-accept".into())
                .spawn(move || accept_loop(&shared, listener))?
        };
        let reaper = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("kvtier-data-reaper".into())
                .spawn(move || reap_handshakes(&shared))?
        };
        Ok(DataPort {
            shared,
            addr,
            accept: Some(accept),
            reaper: Some(reaper),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn held(&self) -> Arc<HeldKeys> {
        Arc::clone(&self.shared.held)
    }

    pub fn counters(&self) -> &DataPortCounters {
        &self.shared.counters
    }

    /// Connections open now (handshaking or authenticated).
    pub fn open_connections(&self) -> usize {
        self.shared.conns.lock().open.len()
    }

    /// Stop accepting and close every connection.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        if let Some(h) = self.reaper.take() {
            let _ = h.join();
        }
        for c in self.shared.conns.lock().open.values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        // Wait (bounded) for the connection threads: each holds the port's state, and with it
        // the UCX node, whose teardown must not race the process's exit (a node stopped by
        // SIGTERM aborted in UCX's atexit cleanup while a connection thread still held it).
        let deadline = Instant::now() + STOP_WAIT;
        while Arc::strong_count(&self.shared) > 1 {
            if Instant::now() >= deadline {
                tracing::warn!(
                    "kvtier serve: {} data-port connection thread(s) still running {:?} after stop",
                    Arc::strong_count(&self.shared) - 1,
                    STOP_WAIT
                );
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for DataPort {
    fn drop(&mut self) {
        if self.accept.is_some() {
            self.stop();
        }
    }
}

/// Whether an accept error means no file descriptor (or kernel memory) is left: the loop
/// must wait for connections to close rather than spin.
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(code) if code == rustix::io::Errno::MFILE.raw_os_error()
            || code == rustix::io::Errno::NFILE.raw_os_error()
            || code == rustix::io::Errno::NOBUFS.raw_os_error()
            || code == rustix::io::Errno::NOMEM.raw_os_error()
    )
}

fn accept_loop(shared: &Arc<PortShared>, listener: TcpListener) {
    let mut last_fd_warning: Option<Instant> = None;
    loop {
        let accepted = listener.accept();
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) if out_of_descriptors(&e) => {
                if last_fd_warning.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
                    tracing::warn!(
                        "kvtier serve: data port cannot accept ({e}); pausing accepts until \
                         connections close"
                    );
                    last_fd_warning = Some(Instant::now());
                }
                count_refused("out_of_descriptors");
                std::thread::sleep(ACCEPT_BACKOFF);
                continue;
            }
            // A connection reset before it was accepted, and the like.
            Err(_) => continue,
        };
        let _ = stream.set_nodelay(true);
        let Some(id) = register(shared, &stream) else {
            continue; // closed: `stream` drops here
        };
        shared.counters.connections.fetch_add(1, Ordering::Relaxed);
        let thread_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name("kvtier-data-conn".into())
            .spawn(move || {
                let _registered = Registered {
                    shared: &thread_shared,
                    id,
                };
                let peer = stream
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|_| "?".into());
                // A connection ending with an i/o error (peer gone, timeout) needs no log line.
                let _ = serve_connection(&thread_shared, id, stream, &peer);
            });
        if spawned.is_err() {
            // No thread: the closure (and `stream`) is gone; drop the entry too.
            shared.conns.lock().open.remove(&id);
        }
    }
}

/// Admit an accepted connection into the registry (under the caps), or refuse it (`None`).
fn register(shared: &PortShared, stream: &TcpStream) -> Option<u64> {
    let mut conns = shared.conns.lock();
    if conns.open.len() >= shared.max_connections {
        shared.counters.refused_full.fetch_add(1, Ordering::Relaxed);
        count_refused("too_many_connections");
        return None;
    }
    if conns.unauthenticated() >= shared.max_unauthenticated {
        // Cut the oldest handshake: a legitimate one takes a round trip or two, so a flood
        // must outpace that to starve it, where refusing the newest would starve every
        // legitimate connection for as long as the flood holds its slots.
        let oldest = conns
            .open
            .iter()
            .filter_map(|(id, c)| c.deadline.map(|d| (d, *id)))
            .min();
        if let Some((_, id)) = oldest {
            if let Some(c) = conns.open.remove(&id) {
                let _ = c.stream.shutdown(Shutdown::Both);
                shared
                    .counters
                    .hello_timeouts
                    .fetch_add(1, Ordering::Relaxed);
                count_refused("too_many_unauthenticated");
            }
        }
    }
    let clone = stream.try_clone().ok()?;
    let id = conns.next_id;
    conns.next_id += 1;
    conns.open.insert(
        id,
        Connection {
            stream: clone,
            deadline: Some(Instant::now() + HELLO_TIMEOUT),
        },
    );
    Some(id)
}

/// Cut connections past their handshake deadline (a peer trickling bytes would otherwise
/// reset a per-read timeout for ever).
fn reap_handshakes(shared: &PortShared) {
    while !shared.stopping.load(Ordering::SeqCst) {
        std::thread::sleep(REAPER_PERIOD);
        let now = Instant::now();
        let conns = shared.conns.lock();
        for c in conns.open.values() {
            if c.deadline.is_some_and(|d| d <= now) {
                // The connection's thread fails its read and removes the entry.
                let _ = c.stream.shutdown(Shutdown::Both);
            }
        }
    }
}

fn error_frame(opcode: u16, request_id: u64, code: u16, message: String) -> io::Result<Vec<u8>> {
    let reply = ErrorReply { code, message };
    let mut frame = Vec::new();
    let opcode = Opcode::try_from(opcode).unwrap_or(Opcode::Ping);
    encode_frame(
        &mut frame,
        opcode,
        request_id,
        FLAG_RESPONSE | FLAG_ERROR,
        &reply,
    )
    .map_err(io::Error::other)?;
    Ok(frame)
}

fn send_error(
    stream: &mut TcpStream,
    opcode: u16,
    request_id: u64,
    code: u16,
    message: String,
) -> io::Result<()> {
    stream.write_all(&error_frame(opcode, request_id, code, message)?)
}

fn proto_io(e: ProtoError) -> io::Error {
    match e {
        ProtoError::Io(e) => e,
        other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
    }
}

/// The data port's refusal log (one per process: every data port of it writes one stream).
fn refusal_log() -> &'static Arc<kvtier_proto::refusals::RefusalLog> {
    static LOG: std::sync::OnceLock<Arc<kvtier_proto::refusals::RefusalLog>> =
        std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        kvtier_proto::refusals::RefusalLog::new("kvtier serve: data port", "handshake")
    })
}

/// Why a handshake failed (logged, counted, answered `UNAUTHORIZED`).
fn refuse_handshake(
    shared: &PortShared,
    stream: &mut TcpStream,
    header: &FrameHeader,
    peer: &str,
    why: &str,
) {
    shared
        .counters
        .refused_unauthorized
        .fetch_add(1, Ordering::Relaxed);
    count_refused("unauthorized");
    // Issue 26: rate-limited and aggregated by reason and source address (one script's bad
    // handshakes once wrote 28 GiB of log a day); the counters above stay exact.
    let source = peer.rsplit_once(':').map_or(peer, |(host, _)| host);
    // A fixed reason (the peer names itself in `why`), so the aggregation stays bounded.
    let reason = if why == "not a hello" {
        "not a hello"
    } else {
        "cluster token not proven"
    };
    refusal_log().record(reason, source, why);
    let _ = send_error(
        stream,
        header.opcode,
        header.request_id,
        peer_error_code::UNAUTHORIZED,
        "the cluster token was not proven".into(),
    );
}

/// The node side of the challenge-response ([`kvtier_proto::peer`]); `Ok(false)`: refused.
fn handshake(
    shared: &PortShared,
    stream: &mut TcpStream,
    body: &mut Vec<u8>,
    peer: &str,
) -> io::Result<bool> {
    // Nothing large is read from an unauthenticated peer.
    let header = read_frame_limited(stream, body, PRE_HELLO_MAX_BODY).map_err(proto_io)?;
    let hello = match header.opcode() {
        Ok(Opcode::PeerHello) => PeerHello::decode(body).ok(),
        _ => None,
    };
    let Some(hello) = hello else {
        refuse_handshake(shared, stream, &header, peer, "not a hello");
        return Ok(false);
    };
    let node_nonce = kvtier_proto::auth::nonce::<NONCE_LEN>()
        .map_err(|e| io::Error::other(format!("no random bytes: {e}")))?;
    let address = shared.address.as_bytes();
    let challenge = PeerChallenge {
        nonce: node_nonce.to_vec(),
        proof: proof(
            &shared.token,
            PEER_NODE_LABEL,
            &[address, &hello.nonce, &node_nonce],
        )
        .to_vec(),
    };
    let mut frame = Vec::new();
    encode_frame(
        &mut frame,
        Opcode::PeerHello,
        header.request_id,
        FLAG_RESPONSE,
        &challenge,
    )
    .map_err(io::Error::other)?;
    stream.write_all(&frame)?;
    let header = read_frame_limited(stream, body, PRE_HELLO_MAX_BODY).map_err(proto_io)?;
    let auth = match header.opcode() {
        Ok(Opcode::PeerHello) => PeerAuth::decode(body).ok(),
        _ => None,
    };
    let proven = auth.is_some_and(|a| {
        verify(
            &shared.token,
            PEER_CLIENT_LABEL,
            &[address, &hello.nonce, &node_nonce],
            &a.proof,
        )
    });
    if !proven {
        let why = format!("{:?} did not prove the cluster token", hello.name);
        refuse_handshake(shared, stream, &header, peer, &why);
        return Ok(false);
    }
    let ok = FrameHeader::new(Opcode::PeerHello, header.request_id, FLAG_RESPONSE, 0);
    stream.write_all(&ok.encode())?;
    Ok(true)
}

fn serve_connection(
    shared: &PortShared,
    id: u64,
    mut stream: TcpStream,
    peer: &str,
) -> io::Result<()> {
    let mut body = Vec::new();
    // Per read; the reaper enforces the whole handshake's deadline.
    stream.set_read_timeout(Some(HELLO_TIMEOUT))?;
    if !handshake(shared, &mut stream, &mut body, peer)? {
        return Ok(());
    }
    match shared.conns.lock().open.get_mut(&id) {
        Some(c) => c.deadline = None,
        // Cut meanwhile (deadline, room for a newer handshake).
        None => return Ok(()),
    }
    stream.set_read_timeout(None)?;
    let host = stream
        .peer_addr()
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|_| "?".into());
    // A client that stops reading must not keep the pinned objects of its queued replies
    // (memory eviction cannot free) for ever: a write that makes no progress this long fails
    // the connection, which drops them. Reads wait without limit (pooled connections idle).
    stream.set_write_timeout(Some(WRITE_STALL_LIMIT))?;
    let writer_stream = stream.try_clone()?;
    let (tx, rx) = mpsc::sync_channel::<Vec<Reply>>(REPLIES_IN_FLIGHT);
    let moved_out =
        metrics::counter!(names::PEER_TRANSFER_BYTES, "peer" => host.clone(), "direction" => "out");
    let ucx_moved_out = moved_out.clone();
    let writer = std::thread::Builder::new()
        .name("kvtier-data-tx".into())
        .spawn(move || write_replies(writer_stream, rx, moved_out))?;
    let mut replies = Replies {
        tx,
        pending: Vec::new(),
        pending_bytes: 0,
    };
    let moved_in =
        metrics::counter!(names::PEER_TRANSFER_BYTES, "peer" => host, "direction" => "in");
    let mut reader = BufReader::with_capacity(READ_BUFFER, stream);
    let served = serve_requests(
        shared,
        id,
        peer,
        &mut reader,
        &mut body,
        &mut replies,
        &moved_in,
        &ucx_moved_out,
    );
    // The UCX leases this connection took pin store memory: they end with it.
    if let Some(ucx) = &shared.ucx {
        ucx.release_connection(id);
    }
    // The writer ends once every queued reply is written (or the socket failed).
    drop(replies);
    let written = writer
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("data port writer panicked")));
    served.and(written)
}

/// How long a reply write may make no progress before the connection is dropped (clients
/// read replies as they come; their own request timeout is a few seconds).
const WRITE_STALL_LIMIT: Duration = Duration::from_secs(30);
/// Replies queued per connection: the reader looks up and pins the next objects while the
/// writer thread still sends the previous one.
const REPLIES_IN_FLIGHT: usize = 2;
/// Request bodies larger than this are freed rather than kept for the next request.
const MAX_KEPT_BUFFER: usize = 8 << 20;
/// Slices per `writev` (well under the kernel's `IOV_MAX` of 1024; a fragmented object or a
/// batch of many is sent in several calls).
const MAX_IOVECS: usize = 256;
/// The reader's buffer: room for many pipelined get requests, small enough that a put's
/// payload is read almost whole straight into its body (reads larger than the buffer bypass
/// it).
const READ_BUFFER: usize = 8 << 10;
/// A batch of replies is handed to the writer at this many replies or object bytes pinned,
/// even if more requests are buffered.
const MAX_BATCH_REPLIES: usize = 64;
const MAX_BATCH_BYTES: u64 = 4 << 20;

/// One response frame for a connection's writer thread.
enum Reply {
    /// A whole encoded frame (small replies, errors).
    Frame(Vec<u8>),
    /// A get's header and the pinned object, sent from the store's memory; the pin is dropped
    /// once the bytes are written.
    Object {
        header: [u8; HEADER_LEN],
        pin: PinnedObject,
    },
}

/// The reader's side of a connection's writer thread: replies are collected and handed over
/// as one batch by [`Replies::flush`].
struct Replies {
    tx: mpsc::SyncSender<Vec<Reply>>,
    pending: Vec<Reply>,
    /// Object bytes pinned by `pending`.
    pending_bytes: u64,
}

impl Replies {
    fn queue(&mut self, reply: Reply) -> io::Result<()> {
        if let Reply::Object { pin, .. } = &reply {
            self.pending_bytes += pin.len();
        }
        self.pending.push(reply);
        if self.pending.len() >= MAX_BATCH_REPLIES || self.pending_bytes >= MAX_BATCH_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    /// Hand the collected replies to the writer (blocks while `REPLIES_IN_FLIGHT` batches
    /// are queued).
    fn flush(&mut self) -> io::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.pending_bytes = 0;
        self.tx
            .send(std::mem::take(&mut self.pending))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "data port writer stopped"))
    }

    fn ok(&mut self, opcode: Opcode, request_id: u64) -> io::Result<()> {
        let header = FrameHeader::new(opcode, request_id, FLAG_RESPONSE, 0).encode();
        self.queue(Reply::Frame(header.to_vec()))
    }

    fn error(
        &mut self,
        opcode: u16,
        request_id: u64,
        code: u16,
        message: String,
    ) -> io::Result<()> {
        self.queue(Reply::Frame(error_frame(
            opcode, request_id, code, message,
        )?))
    }
}

/// Write a batch of replies in order, vectored (`MAX_IOVECS` slices per call): frames as they
/// are, objects as their header and then the pinned extents, straight from the store. An
/// object's bytes are counted in `moved_out` once the call that wrote its last slice
/// succeeded.
fn write_batch(
    stream: &mut TcpStream,
    batch: &[Reply],
    moved_out: &metrics::Counter,
) -> io::Result<()> {
    let mut out = Gather {
        stream,
        moved_out,
        iov: Vec::with_capacity(MAX_IOVECS),
        ending: 0,
    };
    for reply in batch {
        match reply {
            Reply::Frame(frame) => out.push(frame)?,
            Reply::Object { header, pin } => {
                out.push(header)?;
                for slice in pin.slices() {
                    out.push(slice)?;
                }
                out.ending += pin.len();
            }
        }
    }
    out.write()
}

/// Slices gathered for `writev`.
struct Gather<'a, 's> {
    stream: &'s mut TcpStream,
    moved_out: &'s metrics::Counter,
    iov: Vec<IoSlice<'a>>,
    /// Object bytes whose last slice is in `iov`.
    ending: u64,
}

impl<'a> Gather<'a, '_> {
    fn push(&mut self, slice: &'a [u8]) -> io::Result<()> {
        if self.iov.len() == MAX_IOVECS {
            self.write()?;
        }
        self.iov.push(IoSlice::new(slice));
        Ok(())
    }

    fn write(&mut self) -> io::Result<()> {
        if !self.iov.is_empty() {
            write_all_vectored(self.stream, &mut self.iov)?;
            self.iov.clear();
        }
        self.moved_out.increment(std::mem::take(&mut self.ending));
        Ok(())
    }
}

fn write_replies(
    mut stream: TcpStream,
    rx: mpsc::Receiver<Vec<Reply>>,
    moved_out: metrics::Counter,
) -> io::Result<()> {
    for batch in rx {
        // The pins drop with the batch, once written.
        if let Err(e) = write_batch(&mut stream, &batch, &moved_out) {
            // Wake the reader too: this connection is done.
            let _ = stream.shutdown(Shutdown::Both);
            return Err(e);
        }
    }
    Ok(())
}

/// Whether `reader` holds a whole next frame already (reading it will not block).
fn frame_buffered(reader: &BufReader<TcpStream>) -> bool {
    let buffered = reader.buffer();
    buffered.len() >= HEADER_LEN
        && FrameHeader::decode(&buffered[..HEADER_LEN])
            .is_ok_and(|h| buffered.len() - HEADER_LEN >= h.body_len as usize)
}

/// `PeerRemove` / `PeerDemote` of whole keys: per key, whether it was held (and is now
/// removed or marked superseded).
fn remove_or_demote(shared: &PortShared, op: Opcode, keys: &[Vec<u8>]) -> Vec<bool> {
    keys.iter()
        .map(|k| {
            if op == Opcode::PeerRemove {
                shared.held.remove(k);
                return shared.store.remove_keys(&[k]) == 1;
            }
            let page = kvtier_store::PageBatch {
                prefix: &[],
                page_keys: &[k],
                suffixes: &[[0u8; 0]],
            };
            shared.store.demote_pages(&page) == 1
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn serve_requests(
    shared: &PortShared,
    connection: u64,
    peer: &str,
    stream: &mut BufReader<TcpStream>,
    body: &mut Vec<u8>,
    replies: &mut Replies,
    moved_in: &metrics::Counter,
    ucx_moved_out: &metrics::Counter,
) -> io::Result<()> {
    loop {
        // Before a read that may wait for the client, let the writer send what is answered.
        if !frame_buffered(stream) {
            replies.flush()?;
        }
        let header = match read_frame_limited(stream, body, kvtier_proto::frame::MAX_FRAME_BODY) {
            Ok(h) => h,
            Err(ProtoError::ConnectionClosed) => return Ok(()),
            Err(e) => return Err(proto_io(e)),
        };
        if shared.stopping.load(Ordering::Relaxed) {
            return Ok(());
        }
        let id = header.request_id;
        // Issue 26: a key outside the cluster namespace refuses the whole request.
        if let Some(refusal) = header.opcode().ok().and_then(|op| refusal_of(op, body)) {
            note_outside_namespace(shared, peer, &refusal);
            replies.error(
                header.opcode,
                id,
                peer_error_code::OUTSIDE_CLUSTER_NAMESPACE,
                refusal.to_string(),
            )?;
            if body.capacity() > MAX_KEPT_BUFFER {
                *body = Vec::new();
            }
            continue;
        }
        match header.opcode() {
            Ok(Opcode::PeerPut) => match PeerPutMeta::split_body(body) {
                Ok((meta, value)) => {
                    moved_in.increment(value.len() as u64);
                    match shared.store.put_slice(&meta.key, value, meta.depth) {
                        Ok(_) => {
                            shared.held.insert(&meta.key);
                            shared.counters.puts.fetch_add(1, Ordering::Relaxed);
                            shared
                                .counters
                                .bytes_in
                                .fetch_add(value.len() as u64, Ordering::Relaxed);
                            replies.ok(Opcode::PeerPut, id)?;
                        }
                        Err(e) => replies.error(
                            header.opcode,
                            id,
                            peer_error_code::STORE,
                            e.to_string(),
                        )?,
                    }
                }
                Err(e) => replies.error(header.opcode, id, error_code::MALFORMED, e.to_string())?,
            },
            Ok(Opcode::PeerGet) => match PeerGet::decode(body) {
                Ok(get) => match shared.store.object_len(&get.key) {
                    None => {
                        shared.counters.misses.fetch_add(1, Ordering::Relaxed);
                        replies.error(
                            header.opcode,
                            id,
                            peer_error_code::NOT_FOUND,
                            "not found".into(),
                        )?
                    }
                    Some(len) if len != get.expected_len => replies.error(
                        header.opcode,
                        id,
                        peer_error_code::SIZE_MISMATCH,
                        format!("stored {len} bytes, buffer has {}", get.expected_len),
                    )?,
                    // Stored through another way in (the local socket) and larger than one
                    // frame: a truncated length in the header would desync the stream.
                    Some(len) if len > u64::from(kvtier_proto::frame::MAX_FRAME_BODY) => replies
                        .error(
                            header.opcode,
                            id,
                            peer_error_code::SIZE_MISMATCH,
                            format!("stored {len} bytes, more than one frame carries"),
                        )?,
                    Some(len) => {
                        match shared.store.pin(&get.key).filter(|pin| pin.len() == len) {
                            Some(pin) => {
                                pin.count_read();
                                shared.counters.gets.fetch_add(1, Ordering::Relaxed);
                                shared.counters.bytes_out.fetch_add(len, Ordering::Relaxed);
                                let header = FrameHeader::new(
                                    Opcode::PeerGet,
                                    id,
                                    FLAG_RESPONSE,
                                    len as u32,
                                )
                                .encode();
                                replies.queue(Reply::Object { header, pin })?;
                            }
                            // Evicted (or replaced) between the length check and the pin.
                            None => {
                                shared.counters.misses.fetch_add(1, Ordering::Relaxed);
                                replies.error(
                                    header.opcode,
                                    id,
                                    peer_error_code::NOT_FOUND,
                                    "not found".into(),
                                )?
                            }
                        }
                    }
                },
                Err(e) => replies.error(header.opcode, id, error_code::MALFORMED, e.to_string())?,
            },
            Ok(op @ (Opcode::PeerRemove | Opcode::PeerDemote)) => match KeyBatch::decode(body) {
                Ok(batch) => {
                    let ok = remove_or_demote(shared, op, &batch.keys);
                    let reply = WireResult::flags(ok);
                    let mut frame = Vec::new();
                    encode_frame(&mut frame, op, id, FLAG_RESPONSE, &reply)
                        .map_err(io::Error::other)?;
                    replies.queue(Reply::Frame(frame))?;
                }
                Err(e) => replies.error(header.opcode, id, error_code::MALFORMED, e.to_string())?,
            },
            Ok(Opcode::PeerClear) => match KeyBatch::decode(body) {
                Ok(batch) if batch.keys.len() == 1 => {
                    let removed = clear_prefix(shared, &batch.keys[0]);
                    let mut frame = Vec::new();
                    encode_frame(
                        &mut frame,
                        Opcode::PeerClear,
                        id,
                        FLAG_RESPONSE,
                        &KeyBatch { keys: removed },
                    )
                    .map_err(io::Error::other)?;
                    replies.queue(Reply::Frame(frame))?;
                }
                Ok(batch) => replies.error(
                    header.opcode,
                    id,
                    error_code::MALFORMED,
                    format!("PeerClear takes one key prefix, not {}", batch.keys.len()),
                )?,
                Err(e) => replies.error(header.opcode, id, error_code::MALFORMED, e.to_string())?,
            },
            Ok(Opcode::Ping) => replies.ok(Opcode::Ping, id)?,
            // Issue 17: hello / lease / release of the UCX data plane.
            Ok(
                op @ (Opcode::PeerUcxHello
                | Opcode::PeerUcxLease
                | Opcode::PeerUcxRelease
                | Opcode::PeerUcxPutHello
                | Opcode::PeerUcxReserve
                | Opcode::PeerUcxCommit
                | Opcode::PeerUcxAbort),
            ) => {
                // A committed one-sided put is held like a framed one.
                let frame = crate::ucx_node::serve(
                    shared.ucx.as_deref(),
                    &shared.store,
                    connection,
                    op,
                    id,
                    body,
                    &crate::ucx_node::Traffic {
                        stored: &|key| shared.held.insert(key),
                        moved_in,
                        moved_out: ucx_moved_out,
                        integrity: &shared.integrity,
                    },
                )?;
                replies.queue(Reply::Frame(frame))?
            }
            _ => replies.error(
                header.opcode,
                id,
                error_code::UNSUPPORTED,
                format!("opcode {} is not served on the data port", header.opcode),
            )?,
        }
        // Release a huge body's memory rather than keep it per connection.
        if body.capacity() > MAX_KEPT_BUFFER {
            *body = Vec::new();
        }
    }
}
