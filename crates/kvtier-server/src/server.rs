//! The server: a Unix-socket listener, one thread per connection, sessions, dispatch.
//!
//! Threads, not an async runtime: clients are a few long-lived connections per inference
//! process (one per calling thread), and every request is either a sub-microsecond index
//! lookup or a memcpy-bound page copy, so a blocking thread per connection gives the lowest
//! latency and keeps copies off any shared executor.
//!
//! Robustness rules:
//! - A frame whose header is bad in a way that loses stream sync (bad magic, unsupported
//!   version) gets an error reply and the connection is closed; every other bad frame
//!   (oversized body: skipped; unknown opcode; undecodable body; request before a session) gets
//!   an error reply and the connection stays open. Nothing a client sends can stop the server.
//! - A session's mappings are dropped when its last connection closes (a client killed with
//!   SIGKILL included); a request already running keeps its mapping alive until it finishes,
//!   and page puts are put-if-absent with per-page rollback, so nothing half-written is visible.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{self, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::net::Shutdown;
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvtier_client::metrics::{self as kvmetrics, names, Collector, Endpoint, Samples};
use kvtier_client::{BatchResult, Client, MemRef, PageBatch};
use kvtier_proto::frame::{
    FrameHeader, FLAG_ERROR, FLAG_RESPONSE, HEADER_LEN, MAX_FRAME_BODY, PROTOCOL_VERSION,
};
use kvtier_proto::server::{
    error_code, Count, InspectQuery, ObjectLens, OpenSession, PageIo, PageKeys, RegionGrant,
    RegisterRegion, SessionTicket, TextReply,
};
use kvtier_proto::{
    encode_frame, BatchResult as WireResult, Decode, Encode, ErrorReply, ExistsV2Query, Handshake,
    KeyBatch, Opcode, ProtoError,
};
use parking_lot::{Mutex, RwLock};
use serde_json::{json, Value};

use crate::config::ServerConfig;
use crate::shm::Mapping;

/// Largest body accepted before the handshake.
const PRE_HANDSHAKE_MAX_BODY: u32 = 4 << 10;
/// An oversized body up to this size is read and dropped to keep the stream in sync; larger
/// ones close the connection.
const MAX_SKIPPED_BODY: u32 = 1 << 30;
/// Most descriptors queued on one connection ahead of their `RegisterRegion` frames.
const MAX_QUEUED_FDS: usize = 8;

/// Errors starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] kvtier_client::ConfigError),
    #[error("cannot open the store: {0}")]
    Store(#[from] kvtier_client::ClientError),
    #[error("socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("socket {0} is in use by a running server")]
    InUse(PathBuf),
    #[error("socket group {0:?} not found in /etc/group")]
    UnknownGroup(String),
    #[error(transparent)]
    Metrics(#[from] kvtier_client::metrics::MetricsError),
}

/// A request failed as a whole: answered with an [`ErrorReply`].
#[derive(Debug)]
struct Refusal {
    code: u16,
    message: String,
}

impl Refusal {
    fn new(code: u16, message: impl Into<String>) -> Self {
        Refusal {
            code,
            message: message.into(),
        }
    }
}

impl From<ProtoError> for Refusal {
    fn from(e: ProtoError) -> Self {
        Refusal::new(error_code::MALFORMED, e.to_string())
    }
}

/// One tenant's store: an embedded client over its own engine.
struct Store {
    name: String,
    client: Arc<Client>,
}

#[derive(Default)]
struct SessionCounters {
    requests: AtomicU64,
    pages_put: AtomicU64,
    pages_got: AtomicU64,
    bytes_put: AtomicU64,
    bytes_got: AtomicU64,
    rejected_buffers: AtomicU64,
    refused_requests: AtomicU64,
}

/// A tenant's Prometheus counters (no-ops when the server publishes no metrics).
struct TenantMetrics {
    bytes_in: metrics::Counter,
    bytes_out: metrics::Counter,
    pages_put: metrics::Counter,
    pages_got: metrics::Counter,
}

impl TenantMetrics {
    fn new(tenant: &str) -> TenantMetrics {
        let tenant = if tenant.is_empty() {
            "default".to_string()
        } else {
            tenant.to_string()
        };
        let bytes = |direction: &'static str| metrics::counter!(names::TENANT_BYTES, "tenant" => tenant.clone(), "direction" => direction);
        let pages = |op: &'static str| metrics::counter!(names::TENANT_PAGES, "tenant" => tenant.clone(), "op" => op);
        TenantMetrics {
            bytes_in: bytes("in"),
            bytes_out: bytes("out"),
            pages_put: pages("put"),
            pages_got: pages("get"),
        }
    }
}

/// What one client process owns on the server.
struct Session {
    id: u64,
    token: u64,
    tenant: String,
    client_name: String,
    pid: i32,
    /// The uid that opened it; only that uid (or an operator) may join it.
    uid: u32,
    store: Arc<Store>,
    /// Key namespace of the tenant inside its store (`tenant 0x1f`).
    namespace: Vec<u8>,
    regions: RwLock<HashMap<u64, Arc<Mapping>>>,
    next_region: AtomicU64,
    mapped_bytes: AtomicU64,
    connections: AtomicUsize,
    counters: SessionCounters,
    metrics: TenantMetrics,
    started: Instant,
}

#[derive(Default)]
struct ServerCounters {
    connections_total: AtomicU64,
    connections_refused: AtomicU64,
    sessions_total: AtomicU64,
    malformed_frames: AtomicU64,
    refused_requests: AtomicU64,
    requests: AtomicU64,
    regions_mapped_total: AtomicU64,
    regions_unmapped_total: AtomicU64,
}

struct Shared {
    config: ServerConfig,
    main: Arc<Store>,
    partitions: BTreeMap<String, Arc<Store>>,
    sessions: Mutex<HashMap<u64, Arc<Session>>>,
    next_session: AtomicU64,
    conns: Mutex<HashMap<u64, UnixStream>>,
    next_conn: AtomicU64,
    open_conns: AtomicUsize,
    shutting_down: AtomicBool,
    counters: ServerCounters,
    started: Instant,
    live_mappings: Arc<AtomicU64>,
    /// Bytes reserved by every session's mappings (`max_mapped_bytes_total`).
    mapped_total: AtomicU64,
    /// Open connections per peer uid (`max_connections_per_uid`).
    connections_per_uid: Mutex<HashMap<u32, u64>>,
    metrics: Option<Arc<Endpoint>>,
    /// Issue 17: the cluster node's data plane, set once the node starts (`stats` "data_plane").
    data_plane: Mutex<Option<DataPlane>>,
}

/// Issue 17: a cluster node's data plane as `stats` reports it under "data_plane".
#[derive(Debug, Clone)]
pub enum DataPlane {
    /// UCX served (peers read the DRAM arena one-sided; frames stay the fallback). Weak: the
    /// cluster node owns the UCX plane and stops it before the server's store drops.
    Ucx(std::sync::Weak<crate::ucx_node::UcxNode>),
    /// TCP frames only, and why not UCX.
    Frames(String),
}

impl DataPlane {
    /// The "data_plane" object of the stats document.
    pub fn describe(&self) -> Value {
        match self {
            DataPlane::Ucx(node) => match node.upgrade() {
                Some(node) => {
                    let mut doc = node.describe();
                    doc["transport"] = json!("ucx");
                    doc
                }
                None => {
                    json!({ "enabled": false, "transport": "frames", "reason": "UCX plane stopped" })
                }
            },
            DataPlane::Frames(why) => {
                json!({ "enabled": false, "transport": "frames", "reason": why })
            }
        }
    }
}

impl Collector for Shared {
    fn collect(&self, out: &mut Samples) {
        let (sessions, mapped) = {
            let sessions = self.sessions.lock();
            let mapped: u64 = sessions
                .values()
                .map(|s| s.mapped_bytes.load(Ordering::Relaxed))
                .sum();
            (sessions.len(), mapped)
        };
        let c = &self.counters;
        out.gauge(
            names::SERVER_CONNECTIONS,
            &[],
            self.open_conns.load(Ordering::Relaxed) as f64,
        );
        out.gauge(names::SERVER_SESSIONS, &[], sessions as f64);
        out.gauge(names::SERVER_MAPPED_BYTES, &[], mapped as f64);
        out.counter(
            names::SERVER_REQUESTS,
            &[],
            c.requests.load(Ordering::Relaxed),
        );
        out.counter(
            names::SERVER_MALFORMED_FRAMES,
            &[],
            c.malformed_frames.load(Ordering::Relaxed),
        );
    }
}

/// A bound, not yet running server.
pub struct Server {
    shared: Arc<Shared>,
    listener: UnixListener,
}

/// Handle to a running server (the accept loop on its own thread).
pub struct RunningServer {
    shared: Arc<Shared>,
    accept: Option<JoinHandle<Vec<JoinHandle<()>>>>,
}

/// A session token from the kernel's CSPRNG (`getrandom`). No fallback: a session is refused
/// rather than given a guessable token.
fn random_token() -> io::Result<u64> {
    let mut bytes = [0u8; 8];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(u64::from_le_bytes(bytes))
}

/// Add `amount` to `counter` unless the sum would exceed `limit`; atomic, so concurrent
/// registrations cannot all pass a check made before any of them is counted.
fn reserve(counter: &AtomicU64, amount: u64, limit: u64) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            used.checked_add(amount).filter(|&total| total <= limit)
        })
        .is_ok()
}

/// Largest frame-body buffer a connection keeps between requests; a larger one (after a big
/// frame) is released, so idle connections do not hold memory.
const KEPT_BUFFER_BYTES: usize = 1 << 20;

fn resolve_group(name: &str) -> Result<u32, ServerError> {
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(gid);
    }
    let text = std::fs::read_to_string("/etc/group").unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut parts = line.split(':');
            let group = parts.next()?;
            let _ = parts.next();
            let gid = parts.next()?.parse::<u32>().ok()?;
            (group == name).then_some(gid)
        })
        .next()
        .ok_or_else(|| ServerError::UnknownGroup(name.to_string()))
}

impl Server {
    /// Open the stores and bind the socket (mode and group applied before anyone can connect:
    /// the socket is created under a private umask).
    pub fn bind(config: ServerConfig) -> Result<Server, ServerError> {
        let path = config.socket.clone();
        let socket_err = |source| ServerError::Socket {
            path: path.clone(),
            source,
        };
        if config.settings.socket.is_none() {
            if let Some(dir) = path
                .parent()
                .filter(|d| *d == crate::config::private_runtime_dir())
            {
                crate::config::ensure_private_dir(dir).map_err(socket_err)?;
            }
        }
        if path.exists() {
            if UnixStream::connect(&path).is_ok() {
                return Err(ServerError::InUse(path));
            }
            std::fs::remove_file(&path).map_err(socket_err)?;
        }
        // Before the stores open, so that they record into the endpoint's registry.
        let metrics = match &config.settings.metrics_addr {
            Some(addr) => Some(kvmetrics::serve(addr)?),
            None => None,
        };
        // The node's own store is embedded here even when the settings name a master: cluster
        // mode is what this process serves to others (data port + node agent), not its store.
        let mut store_config = config.engine.clone();
        store_config.master_address = None;
        let main = Arc::new(Store {
            name: "main".into(),
            client: Arc::new(Client::open_as(store_config, "main")?),
        });
        let mut partitions = BTreeMap::new();
        for (tenant, quota) in &config.settings.tenant_dram_quota {
            let name = format!("tenant:{tenant}");
            let client = Client::open_as(config.partition_config(tenant, *quota), &name)?;
            partitions.insert(
                tenant.clone(),
                Arc::new(Store {
                    name,
                    client: Arc::new(client),
                }),
            );
        }
        let old_umask = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
        let bound = UnixListener::bind(&path);
        rustix::process::umask(old_umask);
        let listener = bound.map_err(socket_err)?;
        if let Some(group) = &config.settings.socket_group {
            let gid = resolve_group(group)?;
            rustix::fs::chown(&path, None, Some(rustix::process::Gid::from_raw(gid)))
                .map_err(|e| socket_err(e.into()))?;
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(config.socket_mode))
            .map_err(socket_err)?;
        Ok(Server {
            shared: Arc::new(Shared {
                config,
                main,
                partitions,
                sessions: Mutex::new(HashMap::new()),
                next_session: AtomicU64::new(1),
                conns: Mutex::new(HashMap::new()),
                next_conn: AtomicU64::new(1),
                open_conns: AtomicUsize::new(0),
                shutting_down: AtomicBool::new(false),
                counters: ServerCounters::default(),
                started: Instant::now(),
                live_mappings: Arc::new(AtomicU64::new(0)),
                mapped_total: AtomicU64::new(0),
                connections_per_uid: Mutex::new(HashMap::new()),
                metrics,
                data_plane: Mutex::new(None),
            }),
            listener,
        })
    }

    pub fn socket(&self) -> &Path {
        &self.shared.config.socket
    }

    /// The bound address of the metrics endpoint (`metrics_addr`), if any.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.shared.metrics.as_ref().map(|e| e.addr())
    }

    /// Start accepting on a background thread.
    pub fn spawn(self) -> RunningServer {
        if self.shared.metrics.is_some() {
            let weak = Arc::downgrade(&self.shared);
            kvmetrics::register_collector(weak);
        }
        let shared = Arc::clone(&self.shared);
        let listener = self.listener;
        let accept = std::thread::Builder::new()
            .name("kvtier-accept".into())
            .spawn(move || accept_loop(&shared, listener))
            .ok();
        RunningServer {
            shared: self.shared,
            accept,
        }
    }
}

impl RunningServer {
    pub fn socket(&self) -> &Path {
        &self.shared.config.socket
    }

    /// The shared store (the one cluster peers are served from).
    pub fn main_store(&self) -> Arc<Client> {
        Arc::clone(&self.shared.main.client)
    }

    /// The bound address of the metrics endpoint (`metrics_addr`), if any.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.shared.metrics.as_ref().map(|e| e.addr())
    }

    /// Issue 17: name the cluster node's data plane in `stats` ("data_plane").
    pub fn set_data_plane(&self, plane: DataPlane) {
        *self.shared.data_plane.lock() = Some(plane);
    }

    /// The stats document `Stats` returns (without a requesting session).
    pub fn stats(&self) -> Value {
        stats_document(&self.shared, None)
    }

    /// Graceful shutdown: stop accepting, let running requests finish (their connections are
    /// shut down for reading, so each thread exits after its current reply), flush every store,
    /// remove the socket. Returns once every connection thread has ended (or `timeout` passed).
    pub fn shutdown(mut self, timeout: Duration) -> Value {
        self.shared.shutting_down.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = UnixStream::connect(&self.shared.config.socket);
        let workers = self
            .accept
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        for stream in self.shared.conns.lock().values() {
            let _ = stream.shutdown(Shutdown::Read);
        }
        let deadline = Instant::now() + timeout;
        for worker in workers {
            while !worker.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if worker.is_finished() {
                let _ = worker.join();
            }
        }
        let mut flush_errors = Vec::new();
        for store in std::iter::once(&self.shared.main).chain(self.shared.partitions.values()) {
            if let Err(e) = store.client.flush() {
                flush_errors.push(format!("{}: {e}", store.name));
            }
        }
        let _ = std::fs::remove_file(&self.shared.config.socket);
        let mut report = stats_document(&self.shared, None);
        report["shutdown"] = json!({ "flush_errors": flush_errors });
        report
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: UnixListener) -> Vec<JoinHandle<()>> {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    for stream in listener.incoming() {
        if shared.shutting_down.load(Ordering::SeqCst) {
            break;
        }
        workers.retain(|w| !w.is_finished());
        let Ok(stream) = stream else { continue };
        shared
            .counters
            .connections_total
            .fetch_add(1, Ordering::Relaxed);
        if shared.open_conns.load(Ordering::SeqCst) as u64 >= shared.config.settings.max_connections
        {
            refuse(shared, stream, "too many connections");
            continue;
        }
        let uid = rustix::net::sockopt::socket_peercred(&stream)
            .map(|c| c.uid.as_raw())
            .ok();
        let Some(uid) = uid else { continue };
        let admitted = {
            let mut per_uid = shared.connections_per_uid.lock();
            let open = per_uid.entry(uid).or_insert(0);
            if *open >= shared.config.settings.max_connections_per_uid {
                false
            } else {
                *open += 1;
                true
            }
        };
        if !admitted {
            let message = format!(
                "uid {uid} already has {} connections (max_connections_per_uid)",
                shared.config.settings.max_connections_per_uid
            );
            refuse(shared, stream, &message);
            continue;
        }
        let release_uid = move |shared: &Shared| {
            let mut per_uid = shared.connections_per_uid.lock();
            if let Some(open) = per_uid.get_mut(&uid) {
                *open -= 1;
                if *open == 0 {
                    per_uid.remove(&uid);
                }
            }
        };
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            shared.conns.lock().insert(id, clone);
        }
        shared.open_conns.fetch_add(1, Ordering::SeqCst);
        let worker_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name(format!("kvtier-conn-{id}"))
            .spawn(move || {
                if let Some(mut conn) = Connection::new(&worker_shared, stream) {
                    conn.run();
                    conn.close();
                }
                worker_shared.conns.lock().remove(&id);
                worker_shared.open_conns.fetch_sub(1, Ordering::SeqCst);
                release_uid(&worker_shared);
            });
        match spawned {
            Ok(handle) => workers.push(handle),
            Err(_) => {
                shared.conns.lock().remove(&id);
                shared.open_conns.fetch_sub(1, Ordering::SeqCst);
                release_uid(shared);
            }
        }
    }
    workers
}

/// Count a connection refused before its handshake and tell the peer why (best effort: it
/// may already be gone); dropping the stream closes it.
fn refuse(shared: &Shared, mut stream: UnixStream, message: &str) {
    shared
        .counters
        .connections_refused
        .fetch_add(1, Ordering::Relaxed);
    let _ = send_error(
        &mut stream,
        Opcode::Handshake,
        0,
        error_code::TOO_MANY_CLIENTS,
        message,
    );
}

fn send_error(
    stream: &mut UnixStream,
    opcode: Opcode,
    request_id: u64,
    code: u16,
    message: &str,
) -> io::Result<()> {
    let mut out = Vec::new();
    let mut message = message.to_string();
    message.truncate(kvtier_proto::limits::MAX_MESSAGE_LEN);
    while !message.is_char_boundary(message.len()) {
        message.pop();
    }
    let reply = ErrorReply { code, message };
    if encode_frame(
        &mut out,
        opcode,
        request_id,
        FLAG_RESPONSE | FLAG_ERROR,
        &reply,
    )
    .is_ok()
    {
        stream.write_all(&out)?;
    }
    Ok(())
}

/// A connection's reading side: `recvmsg`, queuing any descriptors that arrive.
struct FdReader {
    stream: UnixStream,
    fds: VecDeque<OwnedFd>,
    truncated_fds: bool,
    /// Until the connection has a session: when it must have one (`handshake_timeout_ms`).
    /// Every read waits at most until then, so a slow or silent peer is closed in time.
    deadline: Option<Instant>,
}

impl Read for FdReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(buf)];
        if let Some(deadline) = self.deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no session within handshake_timeout_ms",
                ));
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        let got = loop {
            match recvmsg(
                &self.stream,
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Ok(got) => break got,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        if got.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
            self.truncated_fds = true;
        }
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = message {
                for fd in fds {
                    if self.fds.len() < MAX_QUEUED_FDS {
                        self.fds.push_back(fd);
                    }
                }
            }
        }
        Ok(got.bytes)
    }
}

struct Connection<'a> {
    shared: &'a Arc<Shared>,
    reader: FdReader,
    writer: UnixStream,
    peer_pid: i32,
    /// `SO_PEERCRED` uid and gid of the peer (tenant binding, operator identity).
    peer_uid: u32,
    peer_gid: u32,
    handshaken: bool,
    session: Option<Arc<Session>>,
    body: Vec<u8>,
    out: Vec<u8>,
}

enum Next {
    Continue,
    Close,
}

impl<'a> Connection<'a> {
    /// `None` when the process is out of descriptors (the connection is then just closed).
    fn new(shared: &'a Arc<Shared>, stream: UnixStream) -> Option<Self> {
        let credentials = rustix::net::sockopt::socket_peercred(&stream).ok()?;
        let peer_pid = credentials.pid.as_raw_nonzero().get();
        let peer_uid = credentials.uid.as_raw();
        let peer_gid = credentials.gid.as_raw();
        let writer = stream.try_clone().ok()?;
        Some(Connection {
            shared,
            reader: FdReader {
                stream,
                fds: VecDeque::new(),
                truncated_fds: false,
                deadline: Some(
                    Instant::now()
                        + Duration::from_millis(shared.config.settings.handshake_timeout_ms),
                ),
            },
            writer,
            peer_pid,
            peer_uid,
            peer_gid,
            handshaken: false,
            session: None,
            body: Vec::new(),
            out: Vec::new(),
        })
    }

    fn run(&mut self) {
        while let Ok(Next::Continue) = self.serve_one() {
            if self.shared.shutting_down.load(Ordering::SeqCst) {
                // Replies already written; stop reading new requests.
                break;
            }
        }
    }

    fn close(&mut self) {
        if let Some(session) = self.session.take() {
            release_session(self.shared, &session);
        }
    }

    fn reply_error(
        &mut self,
        opcode: u16,
        request_id: u64,
        code: u16,
        message: &str,
    ) -> io::Result<()> {
        self.shared
            .counters
            .refused_requests
            .fetch_add(1, Ordering::Relaxed);
        if let Some(s) = &self.session {
            s.counters.refused_requests.fetch_add(1, Ordering::Relaxed);
        }
        let opcode = Opcode::try_from(opcode).unwrap_or(Opcode::Ping);
        send_error(&mut self.writer, opcode, request_id, code, message)
    }

    /// Read and answer one frame.
    fn serve_one(&mut self) -> io::Result<Next> {
        let mut raw = [0u8; HEADER_LEN];
        let mut filled = 0;
        while filled < HEADER_LEN {
            match self.reader.read(&mut raw[filled..]) {
                Ok(0) => return Ok(Next::Close),
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let request_id = u64::from_le_bytes(raw[8..16].try_into().unwrap_or([0; 8]));
        let raw_opcode = u16::from_le_bytes([raw[6], raw[7]]);
        let limit = if self.handshaken {
            MAX_FRAME_BODY
        } else {
            PRE_HANDSHAKE_MAX_BODY
        };
        let header = match FrameHeader::decode_with_limit(&raw, limit) {
            Ok(header) => header,
            Err(ProtoError::BodyTooLarge { len, max }) => {
                self.shared
                    .counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
                let message = format!("frame body of {len} bytes exceeds the limit of {max}");
                if len > u64::from(MAX_SKIPPED_BODY) {
                    self.reply_error(raw_opcode, request_id, error_code::MALFORMED, &message)?;
                    return Ok(Next::Close);
                }
                // Skip the body to stay in sync, then answer.
                io::copy(&mut (&mut self.reader).take(len), &mut io::sink())?;
                self.reply_error(raw_opcode, request_id, error_code::MALFORMED, &message)?;
                return Ok(Next::Continue);
            }
            Err(ProtoError::UnknownFlags { bits }) => {
                // The length is still trustworthy: skip the body and answer.
                self.shared
                    .counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
                let len = u32::from_le_bytes(raw[20..24].try_into().unwrap_or([0; 4]));
                if len > limit {
                    self.reply_error(
                        raw_opcode,
                        request_id,
                        error_code::MALFORMED,
                        "oversized frame with unknown flags",
                    )?;
                    return Ok(Next::Close);
                }
                io::copy(
                    &mut (&mut self.reader).take(u64::from(len)),
                    &mut io::sink(),
                )?;
                self.reply_error(
                    raw_opcode,
                    request_id,
                    error_code::MALFORMED,
                    &format!("unknown frame flag bits {bits:#x}"),
                )?;
                return Ok(Next::Continue);
            }
            Err(e) => {
                // Bad magic or version: the stream cannot be trusted any more.
                self.shared
                    .counters
                    .malformed_frames
                    .fetch_add(1, Ordering::Relaxed);
                self.reply_error(
                    raw_opcode,
                    request_id,
                    error_code::MALFORMED,
                    &e.to_string(),
                )?;
                return Ok(Next::Close);
            }
        };
        self.body.clear();
        // Grow with what arrives, not with what the header claims.
        self.body
            .reserve((header.body_len as usize).min(KEPT_BUFFER_BYTES));
        let read = (&mut self.reader)
            .take(u64::from(header.body_len))
            .read_to_end(&mut self.body)?;
        if read < header.body_len as usize {
            return Ok(Next::Close);
        }
        if header.is_response() {
            self.shared
                .counters
                .malformed_frames
                .fetch_add(1, Ordering::Relaxed);
            self.reply_error(
                raw_opcode,
                request_id,
                error_code::MALFORMED,
                "a client sent a response frame",
            )?;
            return Ok(Next::Continue);
        }
        let opcode = match header.opcode() {
            Ok(op) => op,
            Err(e) => {
                self.reply_error(
                    raw_opcode,
                    request_id,
                    error_code::UNSUPPORTED,
                    &e.to_string(),
                )?;
                return Ok(Next::Continue);
            }
        };
        self.shared
            .counters
            .requests
            .fetch_add(1, Ordering::Relaxed);
        let mut body = std::mem::take(&mut self.body);
        let result = self.dispatch(opcode, &body);
        if body.capacity() > KEPT_BUFFER_BYTES {
            body = Vec::new();
        }
        self.body = body;
        match result {
            Ok(reply) => {
                self.out.clear();
                let written = encode_frame(
                    &mut self.out,
                    opcode,
                    request_id,
                    FLAG_RESPONSE,
                    &RawBody(&reply),
                );
                let sent = match written {
                    Ok(()) => self.writer.write_all(&self.out),
                    Err(e) => self.reply_error(
                        raw_opcode,
                        request_id,
                        error_code::INTERNAL,
                        &e.to_string(),
                    ),
                };
                if self.out.capacity() > KEPT_BUFFER_BYTES {
                    self.out = Vec::new();
                }
                sent?;
            }
            Err(refusal) => {
                if refusal.code == error_code::MALFORMED {
                    self.shared
                        .counters
                        .malformed_frames
                        .fetch_add(1, Ordering::Relaxed);
                }
                self.reply_error(raw_opcode, request_id, refusal.code, &refusal.message)?;
                if refusal.code == error_code::VERSION {
                    return Ok(Next::Close);
                }
            }
        }
        Ok(Next::Continue)
    }

    fn session(&self) -> Result<&Arc<Session>, Refusal> {
        self.session.as_ref().ok_or_else(|| {
            Refusal::new(error_code::NO_SESSION, "open a session first (OpenSession)")
        })
    }

    fn dispatch(&mut self, opcode: Opcode, body: &[u8]) -> Result<Vec<u8>, Refusal> {
        if !self.handshaken && opcode != Opcode::Handshake {
            return Err(Refusal::new(error_code::NO_SESSION, "handshake first"));
        }
        if self.shared.shutting_down.load(Ordering::SeqCst) {
            return Err(Refusal::new(
                error_code::SHUTTING_DOWN,
                "the server is shutting down",
            ));
        }
        if let Some(s) = &self.session {
            s.counters.requests.fetch_add(1, Ordering::Relaxed);
        }
        match opcode {
            Opcode::Handshake => {
                let hello = Handshake::decode(body)?;
                if hello.version < kvtier_proto::frame::MIN_PROTOCOL_VERSION {
                    return Err(Refusal::new(
                        error_code::VERSION,
                        format!("protocol version {} is not spoken here", hello.version),
                    ));
                }
                self.handshaken = true;
                encode(&Handshake {
                    version: PROTOCOL_VERSION.min(hello.version),
                    client_name: format!("kvtier-serve {}", env!("CARGO_PKG_VERSION")),
                })
            }
            Opcode::Ping => {
                if !body.is_empty() {
                    return Err(ProtoError::TrailingBytes {
                        what: "ping",
                        count: body.len(),
                    }
                    .into());
                }
                Ok(Vec::new())
            }
            Opcode::OpenSession => self.open_session(OpenSession::decode(body)?),
            Opcode::Stats => {
                let operator = self.shared.config.is_operator(self.peer_uid);
                let mut doc = stats_document(self.shared, self.session.as_deref());
                if !operator {
                    // Other tenants' sessions (their names, pids, traffic) are an operator's.
                    let own = self.session.as_ref().map(|s| s.tenant.clone());
                    if let Some(list) = doc["sessions"].as_array_mut() {
                        list.retain(|s| own.as_deref().is_some_and(|t| s["tenant"] == t));
                    }
                }
                encode(&TextReply {
                    text: doc.to_string(),
                })
            }
            Opcode::RegisterRegion => {
                let request = RegisterRegion::decode(body)?;
                self.register_region(request)
            }
            Opcode::UnregisterRegion => {
                let grant = RegionGrant::decode(body)?;
                let session = self.session()?;
                let removed = session.regions.write().remove(&grant.region);
                match removed {
                    Some(mapping) => {
                        let len = mapping.len() as u64;
                        session.mapped_bytes.fetch_sub(len, Ordering::AcqRel);
                        self.shared.mapped_total.fetch_sub(len, Ordering::AcqRel);
                        Ok(Vec::new())
                    }
                    None => Err(Refusal::new(
                        error_code::REGISTRATION,
                        format!("region {} is not registered in this session", grant.region),
                    )),
                }
            }
            Opcode::PutPages | Opcode::GetPages => {
                let io = PageIo::decode(body)?;
                let session = self.session()?;
                let result = page_io(session, &io, opcode == Opcode::PutPages);
                encode(&wire_result(result))
            }
            Opcode::ExistsPagesPrefix | Opcode::DemotePages => {
                let keys = PageKeys::decode(body)?;
                let session = self.session()?;
                let prefix = session.ns(&keys.prefix);
                let batch = PageBatch {
                    prefix: &prefix,
                    page_keys: &keys.page_keys,
                    suffixes: &keys.suffixes,
                };
                let client = &session.store.client;
                let value = if opcode == Opcode::DemotePages {
                    client.demote_pages(&batch)
                } else {
                    client.exists_pages_prefix(&batch)
                } as u64;
                encode(&Count { value })
            }
            Opcode::ExistsV2 => {
                let mut query = ExistsV2Query::decode(body)?;
                let session = self.session()?;
                query.key_prefix = session.ns(&query.key_prefix);
                encode(&session.store.client.exists_v2(&query))
            }
            Opcode::BatchExists => {
                let keys = KeyBatch::decode(body)?;
                let session = self.session()?;
                let keys: Vec<Vec<u8>> = keys.keys.iter().map(|k| session.ns(k)).collect();
                encode(&WireResult::flags(session.store.client.exists_keys(&keys)))
            }
            Opcode::ObjectLen => {
                let keys = KeyBatch::decode(body)?;
                let session = self.session()?;
                let lens = keys
                    .keys
                    .iter()
                    .map(|k| session.store.client.object_len(&session.ns(k)))
                    .collect();
                encode(&ObjectLens { lens })
            }
            Opcode::BatchDelete => {
                let keys = KeyBatch::decode(body)?;
                let session = self.session()?;
                let ok = keys
                    .keys
                    .iter()
                    .map(|k| session.store.client.remove_keys(&[session.ns(k)]) == 1)
                    .collect();
                encode(&WireResult::flags(ok))
            }
            Opcode::Clear => {
                empty(body, "clear")?;
                let session = self.session()?;
                clear_namespace(self.shared, session);
                Ok(Vec::new())
            }
            Opcode::PeerHello
            | Opcode::PeerPut
            | Opcode::PeerGet
            | Opcode::PeerRemove
            | Opcode::PeerDemote
            | Opcode::PeerClear
            // Issue 17: the UCX data plane's control messages.
            | Opcode::PeerUcxHello
            | Opcode::PeerUcxLease
            | Opcode::PeerUcxRelease
            | Opcode::PeerUcxPutHello
            | Opcode::PeerUcxReserve
            | Opcode::PeerUcxCommit
            | Opcode::PeerUcxAbort => Err(Refusal::new(
                error_code::UNSUPPORTED,
                "peer opcodes are served on the cluster data port, not the local socket",
            )),
            Opcode::Flush => {
                empty(body, "flush")?;
                let session = self.session()?;
                session
                    .store
                    .client
                    .flush()
                    .map_err(|e| Refusal::new(error_code::INTERNAL, e.to_string()))?;
                Ok(Vec::new())
            }
            Opcode::Inspect => {
                let query = InspectQuery::decode(body)?;
                if !self.shared.config.is_operator(self.peer_uid) {
                    return Err(Refusal::new(
                        error_code::REGISTRATION,
                        format!(
                            "Inspect lists every tenant's keys: only an operator (the server's \
                             uid, root or operator_uids) may ask; uid {} is not one",
                            self.peer_uid
                        ),
                    ));
                }
                encode(&TextReply {
                    text: inspect_document(self.shared, &query).to_string(),
                })
            }
            Opcode::BatchGet | Opcode::BatchPut => Err(Refusal::new(
                error_code::UNSUPPORTED,
                format!("{opcode:?} is not served by kvtier serve; use PutPages/GetPages"),
            )),
        }
    }

    fn open_session(&mut self, open: OpenSession) -> Result<Vec<u8>, Refusal> {
        if self.session.is_some() {
            return Err(Refusal::new(
                error_code::NO_SESSION,
                "this connection already belongs to a session",
            ));
        }
        let session = match open.join {
            Some(ticket) => {
                let sessions = self.shared.sessions.lock();
                let session = sessions
                    .get(&ticket.session_id)
                    .filter(|s| {
                        s.token == ticket.token
                            && (s.uid == self.peer_uid
                                || self.shared.config.is_operator(self.peer_uid))
                    })
                    .cloned()
                    .ok_or_else(|| {
                        Refusal::new(
                            error_code::NO_SESSION,
                            format!("no session {} with that token", ticket.session_id),
                        )
                    })?;
                session.connections.fetch_add(1, Ordering::SeqCst);
                session
            }
            None => {
                if !self
                    .shared
                    .config
                    .may_open_tenant(&open.tenant, self.peer_uid, self.peer_gid)
                {
                    return Err(Refusal::new(
                        error_code::NO_SESSION,
                        format!(
                            "tenant {:?} is bound to other credentials (tenant_access); \
                             uid {} gid {} may not open it",
                            open.tenant, self.peer_uid, self.peer_gid
                        ),
                    ));
                }
                if open.tenant.contains(['\0', '\x1f']) {
                    return Err(Refusal::new(
                        error_code::MALFORMED,
                        "tenant names may not contain NUL or 0x1f",
                    ));
                }
                let store = self
                    .shared
                    .partitions
                    .get(&open.tenant)
                    .unwrap_or(&self.shared.main)
                    .clone();
                let mut namespace = open.tenant.as_bytes().to_vec();
                namespace.push(0x1f);
                let token = random_token().map_err(|e| {
                    Refusal::new(
                        error_code::INTERNAL,
                        format!("no random session token (getrandom: {e})"),
                    )
                })?;
                let id = self.shared.next_session.fetch_add(1, Ordering::Relaxed);
                let metrics = TenantMetrics::new(&open.tenant);
                let session = Arc::new(Session {
                    id,
                    metrics,
                    token,
                    tenant: open.tenant,
                    client_name: open.client_name,
                    pid: self.peer_pid,
                    uid: self.peer_uid,
                    store,
                    namespace,
                    regions: RwLock::new(HashMap::new()),
                    next_region: AtomicU64::new(1),
                    mapped_bytes: AtomicU64::new(0),
                    connections: AtomicUsize::new(1),
                    counters: SessionCounters::default(),
                    started: Instant::now(),
                });
                self.shared.sessions.lock().insert(id, Arc::clone(&session));
                self.shared
                    .counters
                    .sessions_total
                    .fetch_add(1, Ordering::Relaxed);
                session
            }
        };
        let ticket = SessionTicket {
            session_id: session.id,
            token: session.token,
        };
        self.session = Some(session);
        // A connection with a session may idle (a client's keeper connection does).
        self.reader.deadline = None;
        let _ = self.reader.stream.set_read_timeout(None);
        encode(&ticket)
    }

    fn register_region(&mut self, request: RegisterRegion) -> Result<Vec<u8>, Refusal> {
        let fd = self.reader.fds.pop_front();
        let session = self.session()?.clone();
        let Some(fd) = fd else {
            let why = if self.reader.truncated_fds {
                "the descriptor was dropped (control message truncated)"
            } else {
                "no memfd came with the frame (send it as SCM_RIGHTS)"
            };
            return Err(Refusal::new(error_code::REGISTRATION, why));
        };
        let settings = &self.shared.config.settings;
        if session.regions.read().len() as u64 >= settings.max_regions_per_client {
            return Err(Refusal::new(
                error_code::REGISTRATION,
                format!(
                    "at most {} regions per client",
                    settings.max_regions_per_client
                ),
            ));
        }
        // Reserve first (atomically, session and server), map after: registrations running at
        // once cannot all pass a check made before any of them is counted.
        if !reserve(
            &session.mapped_bytes,
            request.len,
            settings.max_mapped_bytes_per_client,
        ) {
            return Err(Refusal::new(
                error_code::REGISTRATION,
                format!(
                    "mapping {} more bytes would exceed max_mapped_bytes_per_client ({})",
                    request.len, settings.max_mapped_bytes_per_client
                ),
            ));
        }
        if !reserve(
            &self.shared.mapped_total,
            request.len,
            settings.max_mapped_bytes_total,
        ) {
            session
                .mapped_bytes
                .fetch_sub(request.len, Ordering::AcqRel);
            return Err(Refusal::new(
                error_code::REGISTRATION,
                format!(
                    "mapping {} more bytes would exceed max_mapped_bytes_total ({})",
                    request.len, settings.max_mapped_bytes_total
                ),
            ));
        }
        let release = || {
            session
                .mapped_bytes
                .fetch_sub(request.len, Ordering::AcqRel);
            self.shared
                .mapped_total
                .fetch_sub(request.len, Ordering::AcqRel);
        };
        let region = session.next_region.fetch_add(1, Ordering::Relaxed);
        let mapping = Mapping::map(
            fd,
            request.fd_offset,
            request.len,
            settings.prefault_regions,
            &request.label,
            region,
            &session.store.client,
            Arc::clone(&self.shared.live_mappings),
        )
        .map_err(|e| {
            release();
            Refusal::new(error_code::REGISTRATION, e.to_string())
        })?;
        session.regions.write().insert(region, Arc::new(mapping));
        self.shared
            .counters
            .regions_mapped_total
            .fetch_add(1, Ordering::Relaxed);
        encode(&RegionGrant { region })
    }
}

fn release_session(shared: &Shared, session: &Arc<Session>) {
    if session.connections.fetch_sub(1, Ordering::SeqCst) == 1 {
        let mut sessions = shared.sessions.lock();
        // Re-check under the lock: a join may have raced in.
        if session.connections.load(Ordering::SeqCst) == 0 {
            sessions.remove(&session.id);
            let regions: Vec<_> = session.regions.write().drain().collect();
            shared
                .counters
                .regions_unmapped_total
                .fetch_add(regions.len() as u64, Ordering::Relaxed);
            let bytes: u64 = regions.iter().map(|(_, m)| m.len() as u64).sum();
            session.mapped_bytes.fetch_sub(bytes, Ordering::AcqRel);
            shared.mapped_total.fetch_sub(bytes, Ordering::AcqRel);
        }
    }
}

/// `Clear` from a session: only its tenant's namespace. A tenant with its own partition owns
/// that whole store (cleared at once, segment headers included); in the shared main store,
/// which also holds other tenants' objects and, on a cluster node, objects stored for other
/// hosts, only the keys under `tenant 0x1f` are removed.
fn clear_namespace(shared: &Shared, session: &Session) {
    let own_partition = shared
        .partitions
        .get(&session.tenant)
        .is_some_and(|p| Arc::ptr_eq(p, &session.store));
    if own_partition {
        session.store.client.clear();
    } else {
        session
            .store
            .client
            .with_engine(|engine| engine.remove_prefix(&session.namespace));
    }
}

impl Session {
    fn ns(&self, key: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.namespace.len() + key.len());
        out.extend_from_slice(&self.namespace);
        out.extend_from_slice(key);
        out
    }
}

fn empty(body: &[u8], what: &'static str) -> Result<(), Refusal> {
    if body.is_empty() {
        Ok(())
    } else {
        Err(ProtoError::TrailingBytes {
            what,
            count: body.len(),
        }
        .into())
    }
}

fn encode<M: Encode>(message: &M) -> Result<Vec<u8>, Refusal> {
    message
        .encode_to_vec()
        .map_err(|e| Refusal::new(error_code::INTERNAL, e.to_string()))
}

/// A body that is already encoded.
struct RawBody<'a>(&'a [u8]);

impl Encode for RawBody<'_> {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        out.extend_from_slice(self.0);
        Ok(())
    }
}

fn wire_result(result: BatchResult) -> WireResult {
    // One type since issue 16: the encoder carries `suppressed_errors`; only cut long messages.
    result.fit_messages()
}

/// Serve one page batch: check every buffer against the session's mappings, fail the pages
/// with a bad buffer (naming it), and run the rest through the tenant's store.
fn page_io(session: &Session, io: &PageIo, is_put: bool) -> BatchResult {
    let pages = io.keys.page_keys.len();
    let comps = io.keys.suffixes.len();
    let mut result = BatchResult {
        ok: vec![false; pages],
        ..Default::default()
    };
    if pages == 0 {
        return result;
    }
    if comps == 0 {
        result.note_error("a page batch needs at least one component suffix".into());
        return result;
    }
    let regions = session.regions.read();
    // Hold every mapping this request uses until it is done.
    let mut held: Vec<Arc<Mapping>> = Vec::new();
    let mut valid_pages: Vec<usize> = Vec::with_capacity(pages);
    let mut bufs: Vec<MemRef> = Vec::with_capacity(pages * comps);
    let mut page_bufs: Vec<MemRef> = Vec::with_capacity(comps);
    let mut bytes = 0u64;
    let mut page_bytes: Vec<u64> = Vec::with_capacity(pages);
    for i in 0..pages {
        page_bufs.clear();
        let mut error = None;
        for (j, r) in io.buffers[i * comps..(i + 1) * comps].iter().enumerate() {
            match regions.get(&r.region) {
                None => {
                    error = Some(format!(
                        "component {j}: region {} is not registered in this session",
                        r.region
                    ));
                    break;
                }
                Some(mapping) => match mapping.resolve(r.offset, r.len) {
                    Ok(m) => {
                        if !held.iter().any(|h| Arc::ptr_eq(h, mapping)) {
                            held.push(Arc::clone(mapping));
                        }
                        page_bufs.push(m);
                    }
                    Err(e) => {
                        error = Some(format!("component {j}: {e}"));
                        break;
                    }
                },
            }
        }
        match error {
            Some(e) => {
                session
                    .counters
                    .rejected_buffers
                    .fetch_add(1, Ordering::Relaxed);
                result.note_error(format!(
                    "{}: {e}",
                    String::from_utf8_lossy(&io.keys.page_keys[i])
                ));
            }
            None => {
                valid_pages.push(i);
                let n = page_bufs.iter().map(|b| b.len as u64).sum::<u64>();
                page_bytes.push(n);
                bytes += n;
                bufs.extend_from_slice(&page_bufs);
            }
        }
    }
    drop(regions);
    if valid_pages.is_empty() {
        return result;
    }
    let prefix = session.ns(&io.keys.prefix);
    let all_valid = valid_pages.len() == pages;
    let subset: Vec<&[u8]>;
    let page_keys: Vec<&[u8]> = if all_valid {
        io.keys.page_keys.iter().map(Vec::as_slice).collect()
    } else {
        subset = valid_pages
            .iter()
            .map(|&i| io.keys.page_keys[i].as_slice())
            .collect();
        subset
    };
    let batch = PageBatch {
        prefix: &prefix,
        page_keys: &page_keys,
        suffixes: &io.keys.suffixes,
    };
    let client = &session.store.client;
    let inner = if is_put {
        let depths: Option<Vec<u32>> = io
            .depths
            .as_ref()
            .map(|d| valid_pages.iter().map(|&i| d[i]).collect());
        client.put_pages(&batch, &bufs, depths.as_deref())
    } else {
        client.get_pages(&batch, &bufs)
    };
    drop(held);
    let done = inner.ok.iter().filter(|&&b| b).count() as u64;
    let done_bytes: u64 = inner
        .ok
        .iter()
        .zip(&page_bytes)
        .filter_map(|(ok, n)| ok.then_some(*n))
        .sum();
    let m = &session.metrics;
    if is_put {
        m.pages_put.increment(done);
        m.bytes_in.increment(done_bytes);
    } else {
        m.pages_got.increment(done);
        m.bytes_out.increment(done_bytes);
    }
    if is_put {
        session
            .counters
            .pages_put
            .fetch_add(done, Ordering::Relaxed);
        session
            .counters
            .bytes_put
            .fetch_add(bytes, Ordering::Relaxed);
    } else {
        session
            .counters
            .pages_got
            .fetch_add(done, Ordering::Relaxed);
        session
            .counters
            .bytes_got
            .fetch_add(bytes, Ordering::Relaxed);
    }
    for (slot, ok) in valid_pages.iter().zip(inner.ok) {
        result.ok[*slot] = ok;
    }
    for e in inner.errors {
        // Strip the tenant namespace from keys in messages.
        let e = match std::str::from_utf8(&session.namespace) {
            Ok(ns) if !ns.is_empty() => e.replacen(ns, "", 1),
            _ => e,
        };
        result.note_error(e);
    }
    result.suppressed_errors += inner.suppressed_errors;
    result
}

/// Keys per store an `Inspect` reply lists at most (the reply is one JSON text frame).
const INSPECT_MAX_KEYS: u64 = 10_000;

/// The reply of `Inspect`: per store, the placement of each asked key and of the keys under
/// the prefix (at most `limit`, capped at [`INSPECT_MAX_KEYS`]; `truncated` when more matched).
fn inspect_document(shared: &Shared, query: &InspectQuery) -> Value {
    let limit = if query.limit == 0 {
        INSPECT_MAX_KEYS
    } else {
        query.limit.min(INSPECT_MAX_KEYS)
    } as usize;
    let placement = |p: &kvtier_engine::Placement| {
        json!({
            "key": String::from_utf8_lossy(&p.key),
            "dram_bytes": p.dram_len,
            "ssd_bytes": p.ssd_len,
        })
    };
    let mut stores = Vec::new();
    for store in std::iter::once(&shared.main).chain(shared.partitions.values()) {
        let doc = store.client.with_engine(|e| {
            let keys: Vec<Value> = query
                .keys
                .iter()
                .map(|k| placement(&e.placement(k)))
                .collect();
            let (under, truncated) = match &query.prefix {
                Some(prefix) => e.inspect_prefix(prefix, limit),
                None => (Vec::new(), false),
            };
            json!({
                "store": store.name,
                "keys": keys,
                "prefix": under.iter().map(placement).collect::<Vec<_>>(),
                "truncated": truncated,
            })
        });
        stores.push(doc.unwrap_or_else(|| json!({ "store": store.name, "error": "no engine" })));
    }
    json!({
        "prefix": query.prefix.as_ref().map(|p| String::from_utf8_lossy(p).into_owned()),
        "limit": limit,
        "stores": stores,
    })
}

fn stats_document(shared: &Shared, you: Option<&Session>) -> Value {
    let sessions = shared.sessions.lock();
    let mut mapped_regions = 0usize;
    let mut mapped_bytes = 0u64;
    let mut list = Vec::new();
    for s in sessions.values() {
        let regions = s.regions.read();
        mapped_regions += regions.len();
        mapped_bytes += s.mapped_bytes.load(Ordering::Relaxed);
        let unsealed = regions.values().filter(|m| !m.sealed()).count();
        let revoked = regions.values().filter(|m| m.revoked()).count();
        let c = &s.counters;
        list.push(json!({
            "session": s.id,
            "tenant": s.tenant,
            "client_name": s.client_name,
            "pid": s.pid,
            "store": s.store.name,
            "connections": s.connections.load(Ordering::Relaxed),
            "regions": regions.len(),
            "unsealed_regions": unsealed,
            "revoked_regions": revoked,
            "mapped_bytes": s.mapped_bytes.load(Ordering::Relaxed),
            "requests": c.requests.load(Ordering::Relaxed),
            "pages_put": c.pages_put.load(Ordering::Relaxed),
            "pages_got": c.pages_got.load(Ordering::Relaxed),
            "bytes_put": c.bytes_put.load(Ordering::Relaxed),
            "bytes_got": c.bytes_got.load(Ordering::Relaxed),
            "rejected_buffers": c.rejected_buffers.load(Ordering::Relaxed),
            "refused_requests": c.refused_requests.load(Ordering::Relaxed),
            "age_s": s.started.elapsed().as_secs_f64(),
        }));
    }
    drop(sessions);
    let mut stores = serde_json::Map::new();
    for store in std::iter::once(&shared.main).chain(shared.partitions.values()) {
        stores.insert(
            store.name.clone(),
            serde_json::to_value(store.client.stats()).unwrap_or(Value::Null),
        );
    }
    let c = &shared.counters;
    let mut doc = json!({
        "server": {
            "version": env!("CARGO_PKG_VERSION"),
            "pid": std::process::id(),
            "socket": shared.config.socket.display().to_string(),
            "uptime_s": shared.started.elapsed().as_secs_f64(),
            "sessions": list.len(),
            "connections": shared.open_conns.load(Ordering::Relaxed),
            "connections_total": c.connections_total.load(Ordering::Relaxed),
            "connections_refused": c.connections_refused.load(Ordering::Relaxed),
            "sessions_total": c.sessions_total.load(Ordering::Relaxed),
            "requests": c.requests.load(Ordering::Relaxed),
            "malformed_frames": c.malformed_frames.load(Ordering::Relaxed),
            "refused_requests": c.refused_requests.load(Ordering::Relaxed),
            "mapped_regions": mapped_regions,
            "mapped_bytes": mapped_bytes,
            "live_mappings": shared.live_mappings.load(Ordering::SeqCst),
            "recovered_faults": crate::fault_guard::recovered_faults(),
            "regions_mapped_total": c.regions_mapped_total.load(Ordering::Relaxed),
            "regions_unmapped_total": c.regions_unmapped_total.load(Ordering::Relaxed),
            "shutting_down": shared.shutting_down.load(Ordering::Relaxed),
        },
        "stores": stores,
        "sessions": list,
    });
    // Issue 17: a cluster node names its data plane (UCX or frames, and why).
    if let Some(plane) = shared.data_plane.lock().as_ref() {
        doc["data_plane"] = plane.describe();
    }
    if let Some(you) = you {
        doc["you"] = json!({ "session": you.id, "store": you.store.name, "tenant": you.tenant });
        doc["you_engine_stats"] = doc["stores"][you.store.name.as_str()].clone();
    }
    doc
}
