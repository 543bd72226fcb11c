//! Connection admission of the master's RPC port (issue 26 §3): what a stranger (anyone who
//! reaches the port) or one member can hold open.
//!
//! Owns the accept loop and the registry of open connections. Every accepted TCP connection is
//! *pending* until it carries its first RPC with a valid credential ([`crate::auth`] marks it
//! authenticated through the [`ConnInfo`] tonic puts in each request's extensions), then a
//! *member* connection. The bounds ([`crate::limits`], lowered to fit `RLIMIT_NOFILE`, whose
//! soft limit is raised to the hard one at start):
//!
//! - pending connections: at most [`MAX_PENDING`] in all and [`MAX_PENDING_PER_SOURCE`] per
//!   source address; each must authenticate within [`HANDSHAKE_DEADLINE`] of its accept
//!   (however slowly it trickles its HTTP/2 preface, settings or headers) or it is cut. A new
//!   connection that finds the pending slots full cuts the oldest pending one, not itself: a
//!   legitimate client authenticates in a round trip, so a flood must outpace that to starve
//!   it, where refusing the newest would lock every new client out while the flood lasts;
//! - all connections: at most [`MAX_CONNECTIONS`] and [`MAX_CONNECTIONS_PER_SOURCE`] per source;
//! - member connections with no RPC running for [`MEMBER_IDLE`] are cut (clients reconnect
//!   and retry; a node's heartbeats keep its connection busy);
//! - the accept loop backs off when the process is out of descriptors instead of spinning.
//!
//! Cutting is a `shutdown(2)` on a duplicate of the socket held in the registry: hyper's next
//! read ends, the connection task drops its [`Guarded`] stream, and that frees the entry.
//! Refusals and cuts are counted in `kvtier_master_connections_refused_total{reason}` and
//! logged through a [`RefusalLog`] (one line, then one summary per interval).

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Shutdown, SocketAddr};
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kvtier_proto::refusals::RefusalLog;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::Connected;

pub use crate::limits::{
    ACCEPT_BACKOFF, DESCRIPTORS_PER_CONNECTION, HANDSHAKE_DEADLINE, MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_SOURCE, MAX_PENDING, MAX_PENDING_PER_SOURCE, MEMBER_IDLE,
    RESERVED_DESCRIPTORS,
};

/// Counter of connections refused at accept or cut, labelled `reason`.
pub const CONNECTIONS_REFUSED: &str = "kvtier_master_connections_refused_total";

/// The caps in force (the constants, lowered to fit the descriptor limit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    pub connections: usize,
    pub per_source: usize,
    pub pending: usize,
    pub pending_per_source: usize,
}

impl Caps {
    /// The caps for a process allowed `descriptors` open files (`None`: unknown).
    pub fn for_descriptors(descriptors: Option<u64>) -> Caps {
        let budget = descriptors.map_or(usize::MAX, |d| {
            usize::try_from(d)
                .unwrap_or(usize::MAX)
                .saturating_sub(RESERVED_DESCRIPTORS)
                / DESCRIPTORS_PER_CONNECTION
        });
        let connections = MAX_CONNECTIONS.min(budget).max(8);
        let pending = MAX_PENDING.min(connections / 2).max(2);
        Caps {
            connections,
            per_source: MAX_CONNECTIONS_PER_SOURCE.min(connections / 4).max(2),
            pending,
            pending_per_source: MAX_PENDING_PER_SOURCE.min(pending / 4).max(1),
        }
    }
}

/// Raise the soft `RLIMIT_NOFILE` to the hard limit; the soft limit now in force (`None`:
/// unknown).
pub fn raise_descriptor_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        let _ = setrlimit(Resource::Nofile, raised);
    }
    getrlimit(Resource::Nofile).current
}

/// What one connection's RPCs report to the registry (shared with [`crate::auth`]).
#[derive(Debug, Default)]
pub struct ConnState {
    authenticated: AtomicBool,
    in_flight: AtomicUsize,
    /// Milliseconds since the admission's epoch of the last RPC's start or end.
    last_active_ms: AtomicU64,
}

/// The connect info tonic hands every request of a connection (request extensions).
#[derive(Clone, Debug)]
pub struct ConnInfo {
    pub remote: Option<SocketAddr>,
    id: u64,
    state: Arc<ConnState>,
    admission: Weak<Admission>,
}

impl ConnInfo {
    /// An authenticated RPC started on this connection: it is a member connection from now.
    pub fn rpc_started(&self) {
        if let Some(admission) = self.admission.upgrade() {
            self.state
                .last_active_ms
                .store(admission.now_ms(), Ordering::Relaxed);
            self.state.in_flight.fetch_add(1, Ordering::AcqRel);
            if !self.state.authenticated.swap(true, Ordering::AcqRel) {
                admission.promote(self.id);
            }
        }
    }

    /// That RPC ended.
    pub fn rpc_ended(&self) {
        self.state.in_flight.fetch_sub(1, Ordering::AcqRel);
        if let Some(admission) = self.admission.upgrade() {
            self.state
                .last_active_ms
                .store(admission.now_ms(), Ordering::Relaxed);
        }
    }
}

struct Entry {
    source: IpAddr,
    state: Arc<ConnState>,
    /// A duplicate of the socket, to cut the connection from outside.
    closer: std::net::TcpStream,
    /// `Some` while pending: when it must have authenticated.
    deadline: Option<Instant>,
    cut: bool,
}

#[derive(Default)]
struct SourceCount {
    open: usize,
    pending: usize,
}

#[derive(Default)]
struct Registry {
    open: HashMap<u64, Entry>,
    sources: HashMap<IpAddr, SourceCount>,
    pending: usize,
    next_id: u64,
}

impl Registry {
    fn cut(&mut self, id: u64) {
        if let Some(e) = self.open.get_mut(&id) {
            if !e.cut {
                e.cut = true;
                let _ = e.closer.shutdown(Shutdown::Both);
            }
        }
    }

    /// Cut the pending connection that was accepted first (its deadline is the earliest).
    fn cut_oldest_pending(&mut self) -> Option<IpAddr> {
        let (_, id, source) = self
            .open
            .iter()
            .filter(|(_, e)| !e.cut)
            .filter_map(|(id, e)| e.deadline.map(|d| (d, *id, e.source)))
            .min()?;
        self.cut(id);
        Some(source)
    }
}

/// The registry of open connections and its caps.
pub struct Admission {
    caps: Caps,
    registry: Mutex<Registry>,
    epoch: Instant,
    pub refusals: Arc<RefusalLog>,
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admission")
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}

/// A counted entry of the registry; dropping it (the connection ended) frees the slot.
struct Slot {
    admission: Arc<Admission>,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.admission.release(self.id);
    }
}

/// An admitted connection: the socket, its registry slot, its connect info.
pub struct Guarded {
    io: TcpStream,
    info: ConnInfo,
    _slot: Slot,
}

impl Connected for Guarded {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

fn count(reason: &'static str) {
    metrics::counter!(CONNECTIONS_REFUSED, "reason" => reason).increment(1);
}

impl Admission {
    pub fn new(caps: Caps) -> Arc<Admission> {
        Arc::new(Admission {
            caps,
            registry: Mutex::new(Registry::default()),
            epoch: Instant::now(),
            refusals: RefusalLog::new("kvtier master", "connection"),
        })
    }

    pub fn caps(&self) -> Caps {
        self.caps
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Connections open now (pending, members).
    pub fn open(&self) -> (usize, usize) {
        let r = self.registry.lock();
        (r.pending, r.open.len() - r.pending)
    }

    fn refuse(&self, reason: &'static str, source: IpAddr) {
        count(reason);
        self.refusals.record(reason, &source.to_string(), "");
    }

    /// Admit `stream` from `remote` (cutting the oldest pending connection if the pending
    /// slots are full), or refuse it (`None`: dropping the stream closes it).
    fn admit(self: &Arc<Self>, stream: TcpStream, remote: SocketAddr) -> Option<Guarded> {
        let source = remote.ip();
        let closer = match stream.as_fd().try_clone_to_owned() {
            Ok(fd) => std::net::TcpStream::from(fd),
            Err(_) => {
                self.refuse("out of descriptors", source);
                return None;
            }
        };
        let mut r = self.registry.lock();
        let (open_here, pending_here) = r
            .sources
            .get(&source)
            .map_or((0, 0), |c| (c.open, c.pending));
        if pending_here >= self.caps.pending_per_source {
            drop(r);
            self.refuse(
                "too many unauthenticated connections from this source",
                source,
            );
            return None;
        }
        if open_here >= self.caps.per_source {
            drop(r);
            self.refuse("too many connections from this source", source);
            return None;
        }
        let live = r.open.values().filter(|e| !e.cut).count();
        let live_pending = r
            .open
            .values()
            .filter(|e| !e.cut && e.deadline.is_some())
            .count();
        if live >= self.caps.connections || live_pending >= self.caps.pending {
            match r.cut_oldest_pending() {
                Some(cut) => {
                    count("evicted unauthenticated");
                    self.refusals
                        .record("evicted unauthenticated", &cut.to_string(), "");
                }
                None => {
                    drop(r);
                    self.refuse("too many connections", source);
                    return None;
                }
            }
        }
        let id = r.next_id;
        r.next_id += 1;
        let state = Arc::new(ConnState::default());
        r.open.insert(
            id,
            Entry {
                source,
                state: Arc::clone(&state),
                closer,
                deadline: Some(Instant::now() + HANDSHAKE_DEADLINE),
                cut: false,
            },
        );
        let counts = r.sources.entry(source).or_default();
        counts.open += 1;
        counts.pending += 1;
        r.pending += 1;
        drop(r);
        Some(Guarded {
            io: stream,
            info: ConnInfo {
                remote: Some(remote),
                id,
                state,
                admission: Arc::downgrade(self),
            },
            _slot: Slot {
                admission: Arc::clone(self),
                id,
            },
        })
    }

    /// The connection authenticated: no longer pending.
    fn promote(&self, id: u64) {
        let mut r = self.registry.lock();
        let Some(entry) = r.open.get_mut(&id) else {
            return;
        };
        if entry.deadline.take().is_some() {
            let source = entry.source;
            r.pending -= 1;
            if let Some(c) = r.sources.get_mut(&source) {
                c.pending -= 1;
            }
        }
    }

    fn release(&self, id: u64) {
        let mut r = self.registry.lock();
        let Some(entry) = r.open.remove(&id) else {
            return;
        };
        let pending = entry.deadline.is_some();
        if pending {
            r.pending -= 1;
        }
        let gone = r.sources.get_mut(&entry.source).is_some_and(|c| {
            c.open -= 1;
            if pending {
                c.pending -= 1;
            }
            c.open == 0
        });
        if gone {
            r.sources.remove(&entry.source);
        }
    }

    /// Cut pending connections past their deadline and idle member connections.
    fn reap(&self) {
        let now = Instant::now();
        let now_ms = self.now_ms();
        let idle_ms = MEMBER_IDLE.as_millis() as u64;
        let mut late = Vec::new();
        let mut idle = Vec::new();
        let mut r = self.registry.lock();
        for (id, e) in &r.open {
            if e.cut {
                continue;
            }
            match e.deadline {
                Some(d) if d <= now => late.push((*id, e.source)),
                Some(_) => {}
                None => {
                    if e.state.in_flight.load(Ordering::Acquire) == 0
                        && now_ms.saturating_sub(e.state.last_active_ms.load(Ordering::Relaxed))
                            >= idle_ms
                    {
                        idle.push(*id);
                    }
                }
            }
        }
        for (id, _) in &late {
            r.cut(*id);
        }
        for id in &idle {
            r.cut(*id);
        }
        drop(r);
        for (_, source) in late {
            self.refuse("no authenticated RPC within the deadline", source);
        }
    }
}

/// Whether an accept error means no descriptor (or kernel memory) is left.
fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(code) if code == rustix::io::Errno::MFILE.raw_os_error()
            || code == rustix::io::Errno::NFILE.raw_os_error()
            || code == rustix::io::Errno::NOBUFS.raw_os_error()
            || code == rustix::io::Errno::NOMEM.raw_os_error()
    )
}

/// The stream of admitted connections for `serve_with_incoming`, and the reaper task (abort
/// it when the server ends).
pub fn incoming(
    listener: TcpListener,
    admission: Arc<Admission>,
) -> (
    impl tokio_stream::Stream<Item = Result<Guarded, io::Error>>,
    tokio::task::JoinHandle<()>,
) {
    let reaper = {
        let admission = Arc::clone(&admission);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            loop {
                tick.tick().await;
                admission.reap();
            }
        })
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Guarded, io::Error>>(16);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = tx.closed() => return,
            };
            match accepted {
                Ok((stream, remote)) => {
                    // Accepted sockets do not get the builder's TCP_NODELAY: without it a
                    // reply written in several pieces waits on Nagle and delayed ACKs.
                    let _ = stream.set_nodelay(true);
                    if let Some(guarded) = admission.admit(stream, remote) {
                        if tx.send(Ok(guarded)).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) if out_of_descriptors(&e) => {
                    count("out of descriptors");
                    admission
                        .refusals
                        .record("out of descriptors", "accept", &e.to_string());
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
                // A connection reset before it was accepted, and the like.
                Err(_) => {}
            }
        }
    });
    (tokio_stream::wrappers::ReceiverStream::new(rx), reaper)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_fit_the_descriptor_limit() {
        let big = Caps::for_descriptors(Some(1 << 20));
        assert_eq!(big.connections, MAX_CONNECTIONS);
        assert_eq!(big.pending, MAX_PENDING);
        let small = Caps::for_descriptors(Some(1024));
        assert!(small.connections * DESCRIPTORS_PER_CONNECTION + RESERVED_DESCRIPTORS <= 1024);
        assert!(small.pending < small.connections);
        assert!(small.per_source < small.connections);
        assert!(small.pending_per_source < small.pending);
    }
}
