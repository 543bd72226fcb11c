//! The server: a Unix-socket listener, one thread per connection, sessions, dispatch.
//!
//! Threads, not an async runtime: clients are a few long-lived connections per inference
//! process (one per calling thread), and every request is either a sub-microsecond index
//! lookup or a memcpy-bound page copy, so a blocking thread per connection gives the lowest
//! latency and keeps copies off any shared executor.
//!
//! Split by the state each part owns (issue 16):
//! - this file: the listener, the accept loop and its admission limits (connections in all
//!   and per uid), the server-wide state every connection shares (`Shared`), bind and
//!   graceful shutdown;
//! - `connection`: one connection's socket, descriptors, handshake and dispatch;
//! - `session`: what one client process owns (regions, limits, counters, its end), and
//!   the table of every session (`session::Sessions`);
//! - `tenant`: the stores the server hosts (`main`, `tenant:<name>`), embedded engines
//!   reached directly, and their metrics;
//! - `page_io`: a page batch from a session's mappings into its tenant's store;
//! - `documents`: the `Stats` / `Inspect` documents and the server's Prometheus samples;
//! - `refusal`: a request refused as a whole, which sessions and connections both return
//!   (its own module, so `connection` and `session` do not import each other).
//!
//! Import direction (issue 28): this file owns `Shared` and imports the modules below it;
//! `session`, `tenant`, `ledger`, `refusal` and `page_io` never name `Shared` (a session's
//! calls get what they need as a `session::Env`). `connection` and `documents` read the
//! shared state and so import it; nothing here imports `connection` but this file.
//!
//! Invariants kept across them: nothing a client sends can stop the server (see
//! `connection`); a session's mappings are dropped when its last connection closes (a
//! client killed with SIGKILL included), while a request already running keeps its mapping
//! alive until it finishes; page puts are put-if-absent with per-page rollback, so nothing
//! half-written is visible; each page buffer is bounds-checked once, against the session's
//! mapping ([`kvtier_store::store::CheckedBuffers`]), never against a region registry.

mod connection;
mod documents;
mod ledger;
mod page_io;
mod refusal;
mod session;
mod tenant;

use std::collections::HashMap;
use std::io;
use std::net::Shutdown;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvtier_proto::server::error_code;
use kvtier_proto::Opcode;
use kvtier_store::metrics::{self as kvmetrics, Endpoint};
use kvtier_store::store::Store;
use parking_lot::Mutex;
use serde_json::{json, Value};

use crate::config::ServerConfig;
use connection::{send_error, Connection};
use documents::stats_document;
use session::Sessions;
use tenant::Tenants;

pub use documents::DataPlane;
pub use tenant::TenantStore;

/// Errors starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Config(#[from] kvtier_store::ConfigError),
    #[error("cannot open the store: {0}")]
    Store(#[from] kvtier_store::ClientError),
    #[error("socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("socket {0} is in use by a running server")]
    InUse(PathBuf),
    /// Issue 27: `--socket` names something that is not a socket; it is never deleted.
    #[error("socket {path}: {what} ({bytes} bytes) is there; refusing to replace it (only a stale socket is replaced): choose another --socket or remove it yourself")]
    NotASocket {
        path: PathBuf,
        what: &'static str,
        bytes: u64,
    },
    #[error("socket group {0:?} not found in /etc/group")]
    UnknownGroup(String),
    #[error(transparent)]
    Metrics(#[from] kvtier_store::metrics::MetricsError),
    /// Issue 30: the host KV-event stream could not start (its endpoint named).
    #[error(transparent)]
    Events(#[from] crate::events::EventsError),
    #[error(transparent)]
    EventsConfig(crate::events::EndpointError),
}

/// Counter of local connections refused at accept, labelled `reason` (the cap's name).
pub const LOCAL_REFUSED: &str = "kvtier_server_connections_refused_total";

/// Server-wide counters (the `server` object of the stats document).
#[derive(Default)]
struct ServerCounters {
    connections_total: AtomicU64,
    connections_refused: AtomicU64,
    malformed_frames: AtomicU64,
    refused_requests: AtomicU64,
    requests: AtomicU64,
}

/// The server-wide state every connection thread shares.
struct Shared {
    config: ServerConfig,
    /// The stores sessions (and a cluster node's data port) use; fixed at bind.
    tenants: Tenants,
    /// Every session, and what they map together.
    sessions: Sessions,
    conns: Mutex<HashMap<u64, UnixStream>>,
    next_conn: AtomicU64,
    open_conns: AtomicUsize,
    shutting_down: AtomicBool,
    counters: ServerCounters,
    started: Instant,
    metrics: Option<Arc<Endpoint>>,
    /// Issue 17: the cluster node's data plane, set once the node starts (`stats` "data_plane").
    data_plane: Mutex<Option<DataPlane>>,
    /// Issue 27: (device, inode) of the socket this process bound: the only file at the
    /// path that shutdown removes.
    socket_inode: Option<(u64, u64)>,
    /// Issue 26: what each peer uid holds (connections, passed descriptors, mapped bytes)
    /// and the caps on it.
    ledger: ledger::Ledger,
    /// This server's part of `/readyz` (issue 27): ready once the stores are open and it
    /// accepts; a cluster node's registration is the node agent's own readiness.
    ready: Arc<kvmetrics::ReadyGate>,
    /// Issue 30: the host KV-event stream, when `host_events_endpoint` is set.
    events: Mutex<Option<crate::events::HostEvents>>,
}

impl Shared {
    /// What a session's calls need of the server (see [`session::Env`]).
    fn session_env(&self) -> session::Env<'_> {
        session::Env {
            sessions: &self.sessions,
            ledger: &self.ledger,
            settings: &self.config.settings,
        }
    }
}

/// Issue 26: every cap on what one uid may hold, sized from the descriptor limit (raised to
/// the hard limit first), and said in the log.
fn uid_caps(settings: &crate::config::ServerSettings) -> ledger::Caps {
    let caps = ledger::Caps::new(
        ledger::raise_descriptor_limit(),
        settings.max_connections,
        settings.max_connections_per_uid,
        settings.max_mapped_bytes_total,
        settings.max_mapped_bytes_per_uid,
    );
    tracing::info!(
        "kvtier serve: descriptor limit {}: at most {} connections ({} per uid), {} passed \
         descriptors ({} per uid); a quarter of each is kept for operators",
        caps.descriptors
            .map_or_else(|| "unknown".to_string(), |d| d.to_string()),
        caps.connections,
        caps.connections_per_uid,
        caps.passed_fds,
        caps.passed_fds_per_uid
    );
    caps
}

/// Issue 30: the host KV-event stream over every store, when `host_events_endpoint` is set.
fn start_host_events(
    config: &ServerConfig,
    tenants: &Tenants,
) -> Result<Option<crate::events::HostEvents>, ServerError> {
    let Some(events) =
        crate::events::EventsConfig::from_server(config).map_err(ServerError::EventsConfig)?
    else {
        return Ok(None);
    };
    Ok(Some(crate::events::HostEvents::start(
        events,
        tenants.all().cloned().collect(),
    )?))
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
    /// Issue 27: the listening socket, to wake the accept loop at shutdown even when the
    /// path no longer leads to it (removed or replaced by someone else).
    waker: Option<UnixListener>,
}

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
    pub fn bind(mut config: ServerConfig) -> Result<Server, ServerError> {
        // Issue 26: defaults another user made unusable fall back to private directories
        // (said on stderr); configured paths are used as given, their problems are errors.
        if let Some(notice) = crate::config::resolve_default_socket(&mut config)? {
            tracing::warn!("{notice}");
        }
        if let Some(notice) = config
            .engine
            .engine
            .resolve_default_ssd_dir()
            .map_err(kvtier_store::ClientError::from)?
        {
            tracing::warn!("{notice}");
        }
        let path = config.socket.clone();
        let socket_err = |source| ServerError::Socket {
            path: path.clone(),
            source,
        };
        // Issue 27: only a stale socket (nobody listening) is replaced; a file, a directory or
        // a live server's socket at the path is an error naming it.
        replace_stale_socket(&path)?;
        // Before the stores open, so that they record into the endpoint's registry (and
        // `/readyz` says "not ready" while the arena maps and the SSD tier recovers).
        let ready = kvmetrics::ReadyGate::new(
            "kvtier serve is opening its stores (mapping the DRAM arena, recovering the SSD tier)",
        );
        let metrics = match &config.settings.metrics_addr {
            Some(addr) => Some(kvmetrics::serve(addr)?),
            None => None,
        };
        // The node's own store is embedded here even when the settings name a master: cluster
        // mode is what this process serves to others (data port + node agent), not its store.
        let tenants = Tenants::open(&config)?;
        let events = start_host_events(&config, &tenants)?;
        ready.set_not_ready("kvtier serve has opened its stores and is not accepting yet");
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
        let socket_inode = socket_identity(&path);
        let caps = uid_caps(&config.settings);
        Ok(Server {
            shared: Arc::new(Shared {
                config,
                tenants,
                sessions: Sessions::default(),
                conns: Mutex::new(HashMap::new()),
                next_conn: AtomicU64::new(1),
                open_conns: AtomicUsize::new(0),
                shutting_down: AtomicBool::new(false),
                counters: ServerCounters::default(),
                started: Instant::now(),
                metrics,
                data_plane: Mutex::new(None),
                socket_inode,
                ledger: ledger::Ledger::new(caps),
                ready,
                events: Mutex::new(events),
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

    /// Issue 30: the bound endpoints of the host KV-event stream (PUB, replay), if on.
    pub fn events_endpoints(&self) -> Option<(std::net::SocketAddr, Option<std::net::SocketAddr>)> {
        self.shared
            .events
            .lock()
            .as_ref()
            .map(|e| (e.endpoint(), e.replay_endpoint()))
    }

    /// Start accepting on a background thread.
    pub fn spawn(self) -> RunningServer {
        if self.shared.metrics.is_some() {
            let weak = Arc::downgrade(&self.shared);
            kvmetrics::register_collector(weak);
        }
        let shared = Arc::clone(&self.shared);
        let waker = self.listener.try_clone().ok();
        let listener = self.listener;
        let accept = std::thread::Builder::new()
            .name("kvtier-accept".into())
            .spawn(move || accept_loop(&shared, listener))
            .ok();
        if accept.is_some() {
            if self.shared.config.engine.master_addresses().is_empty() {
                self.shared.ready.set_ready();
            } else {
                self.shared
                    .ready
                    .set_not_ready("kvtier serve is starting its cluster node");
            }
        }
        RunningServer {
            shared: self.shared,
            accept,
            waker,
        }
    }
}

impl RunningServer {
    pub fn socket(&self) -> &Path {
        &self.shared.config.socket
    }

    /// The shared store (the one cluster peers are served from).
    pub fn main_store(&self) -> Arc<TenantStore> {
        Arc::clone(&self.shared.tenants.main)
    }

    /// The bound address of the metrics endpoint (`metrics_addr`), if any.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.shared.metrics.as_ref().map(|e| e.addr())
    }

    /// Issue 27: this server's part of `/readyz`. `kvtier serve` marks it ready once its
    /// cluster node runs (from then on the node agent's registration decides) and not ready
    /// when a signal arrives, before the node leaves the cluster.
    pub fn mark_ready(&self, ready: bool) {
        if ready {
            self.shared.ready.set_ready();
        } else {
            self.shared
                .ready
                .set_not_ready("kvtier serve is shutting down");
        }
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
        self.shared
            .ready
            .set_not_ready("kvtier serve is shutting down");
        self.shared.shutting_down.store(true, Ordering::SeqCst);
        // Wake the accept loop: shutting the listening socket down fails its accept (Linux),
        // whatever is at the path now; connecting is the fallback.
        if let Some(listener) = &self.waker {
            let _ = rustix::net::shutdown(listener, rustix::net::Shutdown::Both);
        }
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
        // Issue 30: the stream's last batch (what the stores recorded until now), then its end.
        if let Some(events) = self.shared.events.lock().take() {
            events.stop();
        }
        let mut flush_errors = Vec::new();
        for store in self.shared.tenants.all() {
            if let Err(e) = store.flush() {
                flush_errors.push(format!("{}: {e}", store.name()));
            }
        }
        // Issue 27: only our own socket (another server may have replaced it since).
        let path = &self.shared.config.socket;
        if self.shared.socket_inode.is_some() && socket_identity(path) == self.shared.socket_inode {
            let _ = std::fs::remove_file(path);
        }
        let mut report = stats_document(&self.shared, None);
        report["shutdown"] = json!({ "flush_errors": flush_errors });
        report
    }
}

/// (device, inode) of the socket at `path`, if a socket is there.
fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::symlink_metadata(path).ok()?;
    meta.file_type()
        .is_socket()
        .then(|| (meta.dev(), meta.ino()))
}

/// Make `path` free for `bind`: nothing there, or a stale socket (connecting is refused:
/// its server is gone), which is removed. A live server's socket is [`ServerError::InUse`];
/// anything else (a regular file, a directory, a symlink, a socket we cannot probe) is
/// [`ServerError::NotASocket`] / [`ServerError::Socket`] and is left untouched.
fn replace_stale_socket(path: &Path) -> Result<(), ServerError> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(ServerError::Socket {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let kind = meta.file_type();
    if !kind.is_socket() {
        let what = if kind.is_dir() {
            "a directory"
        } else if kind.is_symlink() {
            "a symbolic link"
        } else if kind.is_file() {
            "a regular file"
        } else {
            "not a socket"
        };
        return Err(ServerError::NotASocket {
            path: path.to_path_buf(),
            what,
            bytes: meta.len(),
        });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(ServerError::InUse(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            tracing::info!(socket = %path.display(), "kvtier serve: replacing a stale socket (nobody listens on it)");
            std::fs::remove_file(path).map_err(|source| ServerError::Socket {
                path: path.to_path_buf(),
                source,
            })
        }
        Err(source) => Err(ServerError::Socket {
            path: path.to_path_buf(),
            source: io::Error::new(
                source.kind(),
                format!("a socket is there and probing it failed ({source}); not replacing it"),
            ),
        }),
    }
}

/// Whether an accept error means no descriptor (or kernel memory) is left: the loop must
/// wait for connections to close rather than spin.
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(code) if code == rustix::io::Errno::MFILE.raw_os_error()
            || code == rustix::io::Errno::NFILE.raw_os_error()
            || code == rustix::io::Errno::NOBUFS.raw_os_error()
            || code == rustix::io::Errno::NOMEM.raw_os_error()
    )
}

fn accept_loop(shared: &Arc<Shared>, listener: UnixListener) -> Vec<JoinHandle<()>> {
    let mut workers: Vec<JoinHandle<()>> = Vec::new();
    for stream in listener.incoming() {
        if shared.shutting_down.load(Ordering::SeqCst) {
            break;
        }
        workers.retain(|w| !w.is_finished());
        let stream = match stream {
            Ok(stream) => stream,
            Err(e) if out_of_descriptors(&e) => {
                shared
                    .ledger
                    .refusals
                    .record("out of descriptors", "accept", &e.to_string());
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            Err(_) => continue,
        };
        shared
            .counters
            .connections_total
            .fetch_add(1, Ordering::Relaxed);
        let uid = rustix::net::sockopt::socket_peercred(&stream)
            .map(|c| c.uid.as_raw())
            .ok();
        let Some(uid) = uid else { continue };
        let operator = shared.config.is_operator(uid);
        // Issue 26: per uid, and every other uid's connections leave the operators a reserve.
        if let Err(refused) = shared
            .ledger
            .take(uid, operator, ledger::Kind::Connections, 1)
        {
            refuse(shared, stream, uid, refused.reason, &refused.message);
            continue;
        }
        let release_uid = move |shared: &Shared| {
            shared
                .ledger
                .give(uid, operator, ledger::Kind::Connections, 1);
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
/// Logged through the refusal log: one line, then one summary per interval (issue 26).
fn refuse(shared: &Shared, mut stream: UnixStream, uid: u32, reason: &str, message: &str) {
    shared
        .counters
        .connections_refused
        .fetch_add(1, Ordering::Relaxed);
    metrics::counter!(LOCAL_REFUSED, "reason" => reason.to_string()).increment(1);
    shared
        .ledger
        .refusals
        .record(reason, &format!("uid {uid}"), message);
    let _ = send_error(
        &mut stream,
        Opcode::Handshake,
        0,
        error_code::TOO_MANY_CLIENTS,
        message,
    );
}
