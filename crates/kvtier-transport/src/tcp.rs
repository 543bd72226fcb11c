//! The TCP transport: KVT1 frames over pooled, authenticated connections.
//!
//! - Every connection opens with the data port's mutual challenge-response
//!   ([`kvtier_proto::peer`]): the node must prove the cluster token first (otherwise
//!   [`TransportError::NotAuthentic`], and nothing derived from the token was sent), then this
//!   side proves it (a refusal is [`TransportError::Unauthorized`]). The token is never sent.
//! - With `end_to_end_checksums` (cluster clients) every object put carries a 16-byte trailer,
//!   [`kvtier_proto::auth::ObjectIntegrity::trailer`] of its key and bytes (keyed with a
//!   secret derived from the cluster token), stored with it on the node; every get reads the
//!   trailer after the bytes and checks it: a mismatch fails that item
//!   ([`TransportError::Integrity`]), never a hit. Without it (a node copying stored objects,
//!   trailer included, to another node) the bytes go as they are.
//! - Up to `connections_per_peer` idle connections are kept per peer. A large batch is spread
//!   over several connections in parallel (each gets at least `MIN_BYTES_PER_CONNECTION`),
//!   all taking the next object from one queue as they go, so a connection whose thread
//!   starts late or runs slow takes fewer and they finish together. Each connection keeps a
//!   few requests ahead of the reply it reads (`MIN_IN_FLIGHT`, more for small objects, up to
//!   [`PIPELINE_WINDOW`]); get requests of a window go out in one write. A batch costs about
//!   one round trip plus the bytes.
//! - A pooled connection that fails the way one to a restarted node does (reset, EOF, broken
//!   pipe) before any reply is replaced once by a fresh connection and its unanswered
//!   requests are sent again (puts are put-if-absent, gets and removes idempotent); a
//!   timeout is never retried, so a dead or partitioned peer still fails within
//!   `request_timeout`.
//! - Get responses are read header first; only a body whose length equals the destination's
//!   is read, straight into the destination. Anything else fails that item closed (the body
//!   is drained so the stream stays in sync).
//! - Page bytes moved are counted per peer in [`names::PEER_TRANSFER_BYTES`] (`peer` = the
//!   node's data address; `direction="out"` for puts, `"in"` for gets), once per batch, as
//!   objects are stored (checksum trailers included, as the node counts them).
//! - Every socket has read/write timeouts (`request_timeout`); a peer that fails to connect or
//!   times out is marked down for `down_backoff`, during which calls to it fail at once, so a
//!   dead peer costs a caller one timeout, not one per call.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use kvtier_proto::auth::{
    proof, verify, ObjectIntegrity, CHECKSUM_LEN, NONCE_LEN, PEER_CLIENT_LABEL, PEER_NODE_LABEL,
};
use kvtier_proto::frame::{FrameHeader, FLAG_ERROR, HEADER_LEN};
use kvtier_proto::peer::{
    peer_error_code, PeerAuth, PeerChallenge, PeerGet, PeerHello, PeerPutMeta,
};
use kvtier_proto::{
    encode_frame, read_frame_limited, BatchResult as WireResult, Decode, Encode, ErrorReply,
    KeyBatch, Opcode, ProtoError,
};
use parking_lot::Mutex;

use super::{GetItem, PutItem, Transport, TransportError};
use crate::names;

/// Requests in flight on one connection.
pub const PIPELINE_WINDOW: usize = 32;
/// A batch is spread over several connections only when each gets at least this many bytes.
const MIN_BYTES_PER_CONNECTION: usize = 4 << 20;
/// How many connections a batch of `items` objects and `bytes` page bytes is spread over:
/// at most `connections_per_peer` and one per object, each with at least
/// `MIN_BYTES_PER_CONNECTION` (public so `kvtier bench cluster` sizes its raw baseline alike).
pub fn connections_for(connections_per_peer: usize, items: usize, bytes: usize) -> usize {
    connections_per_peer
        .min(items)
        .min((bytes / MIN_BYTES_PER_CONNECTION).max(1))
        .max(1)
}

/// Largest reply of a control exchange read (a `PeerClear` reply of the longest keys fits).
const MAX_KEY_REPLY: u32 = 40 << 20;

/// Largest error body read.
const MAX_ERROR_BODY: u32 = 64 << 10;

/// Largest handshake reply read (a [`PeerChallenge`] is under 100 bytes).
const MAX_CHALLENGE_BODY: u32 = 1 << 10;

/// Settings of a [`TcpTransport`].
#[derive(Clone)]
pub struct TcpTransportConfig {
    /// The cluster token, proven to each node (never sent).
    pub token: Vec<u8>,
    /// Append and verify the end-to-end checksum trailer of each object (see the module doc).
    pub end_to_end_checksums: bool,
    /// Name sent in the hello, for the peer's logs.
    pub name: String,
    pub connections_per_peer: usize,
    pub request_timeout: Duration,
    pub down_backoff: Duration,
}

impl Default for TcpTransportConfig {
    fn default() -> Self {
        TcpTransportConfig {
            token: Vec::new(),
            end_to_end_checksums: true,
            name: "kvtier-client".into(),
            connections_per_peer: 4,
            request_timeout: Duration::from_secs(2),
            down_backoff: Duration::from_secs(1),
        }
    }
}

impl std::fmt::Debug for TcpTransportConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the token.
        f.debug_struct("TcpTransportConfig")
            .field("end_to_end_checksums", &self.end_to_end_checksums)
            .field("name", &self.name)
            .field("connections_per_peer", &self.connections_per_peer)
            .field("request_timeout", &self.request_timeout)
            .field("down_backoff", &self.down_backoff)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
pub struct TcpTransport {
    config: TcpTransportConfig,
    /// The end-to-end integrity key (derived from the token once).
    integrity: ObjectIntegrity,
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
    down_until: Mutex<HashMap<String, Instant>>,
}

/// Write every byte of `bufs` (vectored: one syscall for a header and its payload when the
/// socket takes them).
pub fn write_all_vectored(stream: &mut impl Write, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match stream.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Count `bytes` of page data moved to (`"out"`) or from (`"in"`) `peer`.
fn count_transfer(peer: &str, direction: &'static str, bytes: u64) {
    if bytes > 0 {
        metrics::counter!(names::PEER_TRANSFER_BYTES, "peer" => peer.to_string(), "direction" => direction)
            .increment(bytes);
    }
}

/// A frame written as header + small prefix, then the payload (no copy of it), vectored.
fn write_request(
    stream: &mut TcpStream,
    opcode: Opcode,
    request_id: u64,
    prefix: &[u8],
    payload: &[u8],
    trailer: &[u8],
) -> Result<(), ProtoError> {
    let body_len = prefix.len() + payload.len() + trailer.len();
    let body_len = u32::try_from(body_len).map_err(|_| ProtoError::BodyTooLarge {
        len: body_len as u64,
        max: kvtier_proto::frame::MAX_FRAME_BODY,
    })?;
    if body_len > kvtier_proto::frame::MAX_FRAME_BODY {
        return Err(ProtoError::BodyTooLarge {
            len: u64::from(body_len),
            max: kvtier_proto::frame::MAX_FRAME_BODY,
        });
    }
    let header = FrameHeader::new(opcode, request_id, 0, body_len).encode();
    let mut head = Vec::with_capacity(HEADER_LEN + prefix.len());
    head.extend_from_slice(&header);
    head.extend_from_slice(prefix);
    write_all_vectored(
        stream,
        &mut [
            IoSlice::new(&head),
            IoSlice::new(payload),
            IoSlice::new(trailer),
        ],
    )?;
    Ok(())
}

fn read_header(stream: &mut TcpStream) -> Result<FrameHeader, ProtoError> {
    let mut raw = [0u8; HEADER_LEN];
    stream.read_exact(&mut raw).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ProtoError::ConnectionClosed
        } else {
            ProtoError::Io(e)
        }
    })?;
    FrameHeader::decode(&raw)
}

fn drain(stream: &mut TcpStream, len: u64) -> io::Result<()> {
    let copied = io::copy(&mut Read::take(&mut *stream, len), &mut io::sink())?;
    if copied < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// Read the error body of a frame flagged [`FLAG_ERROR`].
fn read_error(stream: &mut TcpStream, header: &FrameHeader) -> Result<ErrorReply, ProtoError> {
    if header.body_len > MAX_ERROR_BODY {
        drain(stream, u64::from(header.body_len))?;
        return Ok(ErrorReply {
            code: 0,
            message: "oversized error reply".into(),
        });
    }
    let mut body = vec![0u8; header.body_len as usize];
    stream.read_exact(&mut body)?;
    ErrorReply::decode(&body)
}

/// An item failed in a way that leaves the stream usable, or broke the connection.
enum ItemFailure {
    Item(TransportError),
    Connection(TransportError),
}

/// Whether `e` is how a connection whose peer process closed it fails (reset, EOF, broken
/// pipe) — what a pooled connection to a node that restarted since shows on first use. Not a
/// timeout: a dead or partitioned peer must fail within the request timeout, not twice it.
fn is_stale(e: &TransportError) -> bool {
    matches!(e, TransportError::Io { source, .. } if matches!(
        source.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::NotConnected
    ))
}

impl TcpTransport {
    pub fn new(config: TcpTransportConfig) -> TcpTransport {
        TcpTransport {
            integrity: ObjectIntegrity::from_token(&config.token),
            config,
            idle: Mutex::new(HashMap::new()),
            down_until: Mutex::new(HashMap::new()),
        }
    }

    /// The end-to-end integrity trailer of cluster objects under this transport's token (the
    /// UCX plane seals and checks with it too).
    pub fn integrity(&self) -> &ObjectIntegrity {
        &self.integrity
    }

    fn io_error(peer: &str, source: io::Error) -> TransportError {
        // A socket read/write timeout surfaces as EAGAIN (WouldBlock) on Linux: say what it is.
        let source = match source.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => io::Error::new(
                io::ErrorKind::TimedOut,
                "no answer within the request timeout (cluster_request_timeout_ms)",
            ),
            _ => source,
        };
        TransportError::Io {
            peer: peer.to_string(),
            source,
        }
    }

    fn proto_error(peer: &str, e: ProtoError) -> TransportError {
        match e {
            ProtoError::Io(source) => Self::io_error(peer, source),
            ProtoError::ConnectionClosed => Self::io_error(
                peer,
                io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed"),
            ),
            source => TransportError::Protocol {
                peer: peer.to_string(),
                source,
            },
        }
    }

    /// Bytes of checksum trailer per object on the wire.
    fn trailer_len(&self) -> usize {
        if self.config.end_to_end_checksums {
            CHECKSUM_LEN
        } else {
            0
        }
    }

    fn check_down(&self, peer: &str) -> Result<(), TransportError> {
        let mut down = self.down_until.lock();
        if let Some(until) = down.get(peer) {
            let now = Instant::now();
            if *until > now {
                return Err(TransportError::PeerDown {
                    peer: peer.to_string(),
                    remaining_ms: (*until - now).as_millis() as u64,
                });
            }
            down.remove(peer);
        }
        Ok(())
    }

    /// Remember that `peer` failed: calls fail fast for `down_backoff`, its idle connections
    /// are dropped.
    pub fn mark_down(&self, peer: &str) {
        self.down_until
            .lock()
            .insert(peer.to_string(), Instant::now() + self.config.down_backoff);
        self.idle.lock().remove(peer);
    }

    fn resolve(peer: &str) -> Result<SocketAddr, TransportError> {
        peer.to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| TransportError::Connect {
                peer: peer.to_string(),
                source: io::Error::new(io::ErrorKind::InvalidInput, "not a host:port address"),
            })
    }

    fn connect(&self, peer: &str) -> Result<TcpStream, TransportError> {
        let addr = Self::resolve(peer)?;
        let timeout = self.config.request_timeout;
        let connect_err = |source| TransportError::Connect {
            peer: peer.to_string(),
            source,
        };
        let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(connect_err)?;
        stream.set_nodelay(true).map_err(connect_err)?;
        stream
            .set_read_timeout(Some(timeout))
            .map_err(connect_err)?;
        stream
            .set_write_timeout(Some(timeout))
            .map_err(connect_err)?;
        self.handshake(&mut stream, peer)?;
        Ok(stream)
    }

    /// The data port's mutual challenge-response on a fresh connection ([`kvtier_proto::peer`]).
    fn handshake(&self, stream: &mut TcpStream, peer: &str) -> Result<(), TransportError> {
        let token = &self.config.token;
        let client_nonce = kvtier_proto::auth::nonce::<NONCE_LEN>()
            .map_err(|e| Self::io_error(peer, io::Error::other(e.to_string())))?;
        let hello = PeerHello {
            nonce: client_nonce.to_vec(),
            name: self.config.name.clone(),
        };
        let mut frame = Vec::new();
        encode_frame(&mut frame, Opcode::PeerHello, 0, 0, &hello)
            .map_err(|e| Self::proto_error(peer, e))?;
        stream
            .write_all(&frame)
            .map_err(|e| Self::io_error(peer, e))?;
        let body = Self::handshake_reply(stream, peer)?;
        let challenge = PeerChallenge::decode(&body).map_err(|e| TransportError::NotAuthentic {
            peer: peer.to_string(),
            message: format!("malformed challenge: {e}"),
        })?;
        // The node proves the token before this side sends anything derived from it.
        // Bound to the address this side dialled (the node's data address as the master lists
        // it): a relay listening elsewhere cannot pass a real node's proof on.
        if !verify(
            token,
            PEER_NODE_LABEL,
            &[peer.as_bytes(), &client_nonce, &challenge.nonce],
            &challenge.proof,
        ) {
            tracing::warn!(
                peer,
                "kvtier: a data port failed to prove the cluster token"
            );
            return Err(TransportError::NotAuthentic {
                peer: peer.to_string(),
                message: "wrong proof".into(),
            });
        }
        let auth = PeerAuth {
            proof: proof(
                token,
                PEER_CLIENT_LABEL,
                &[peer.as_bytes(), &client_nonce, &challenge.nonce],
            )
            .to_vec(),
        };
        frame.clear();
        encode_frame(&mut frame, Opcode::PeerHello, 1, 0, &auth)
            .map_err(|e| Self::proto_error(peer, e))?;
        stream
            .write_all(&frame)
            .map_err(|e| Self::io_error(peer, e))?;
        Self::handshake_reply(stream, peer)?;
        Ok(())
    }

    /// The body of a handshake reply (small, bounded); an error reply is the node's refusal.
    fn handshake_reply(stream: &mut TcpStream, peer: &str) -> Result<Vec<u8>, TransportError> {
        let header = read_header(stream).map_err(|e| Self::proto_error(peer, e))?;
        if header.is_error() {
            let reply = read_error(stream, &header).map_err(|e| Self::proto_error(peer, e))?;
            if reply.code == peer_error_code::UNAUTHORIZED {
                return Err(TransportError::Unauthorized {
                    peer: peer.to_string(),
                    message: reply.message,
                });
            }
            return Err(TransportError::Refused {
                peer: peer.to_string(),
                code: reply.code,
                message: reply.message,
            });
        }
        if header.opcode != Opcode::PeerHello as u16 || header.body_len > MAX_CHALLENGE_BODY {
            return Err(TransportError::NotAuthentic {
                peer: peer.to_string(),
                message: format!(
                    "handshake reply of opcode {} and {} bytes",
                    header.opcode, header.body_len
                ),
            });
        }
        let mut body = vec![0u8; header.body_len as usize];
        stream
            .read_exact(&mut body)
            .map_err(|e| Self::io_error(peer, e))?;
        Ok(body)
    }

    /// A connection to `peer`: an idle pooled one (`true`) or a new one (`false`).
    fn checkout(&self, peer: &str) -> Result<(TcpStream, bool), TransportError> {
        self.check_down(peer)?;
        if let Some(stream) = self.idle.lock().get_mut(peer).and_then(Vec::pop) {
            return Ok((stream, true));
        }
        self.connect_or_mark_down(peer).map(|s| (s, false))
    }

    fn connect_or_mark_down(&self, peer: &str) -> Result<TcpStream, TransportError> {
        self.connect(peer).inspect_err(|e| {
            if e.is_unreachable() {
                self.mark_down(peer);
            }
        })
    }

    /// A pooled connection failed as one whose peer process went away since it was pooled
    /// (`stale`): drop the other idle connections to `peer` (from the same past) and open a
    /// fresh one for one retry.
    fn reconnect_stale(&self, peer: &str, reason: &str) -> Result<TcpStream, TransportError> {
        tracing::debug!(
            peer,
            reason,
            "kvtier: pooled peer connection was stale; retrying"
        );
        self.idle.lock().remove(peer);
        self.connect_or_mark_down(peer)
    }

    fn checkin(&self, peer: &str, stream: TcpStream) {
        let mut idle = self.idle.lock();
        let pool = idle.entry(peer.to_string()).or_default();
        if pool.len() < self.config.connections_per_peer {
            pool.push(stream);
        }
    }

    /// The header of reply `id` of a pipelined batch: out of order is a connection failure; an
    /// error reply is read whole and fails the item (the stream stays in sync).
    fn reply_header(
        stream: &mut TcpStream,
        peer: &str,
        id: u64,
    ) -> Result<FrameHeader, ItemFailure> {
        let header =
            read_header(stream).map_err(|e| ItemFailure::Connection(Self::proto_error(peer, e)))?;
        if header.request_id != id {
            return Err(ItemFailure::Connection(TransportError::OutOfOrder {
                peer: peer.to_string(),
                expected: id,
                found: header.request_id,
            }));
        }
        if header.is_error() {
            let reply = read_error(stream, &header)
                .map_err(|e| ItemFailure::Connection(Self::proto_error(peer, e)))?;
            let peer = peer.to_string();
            return Err(ItemFailure::Item(match reply.code {
                peer_error_code::NOT_FOUND => TransportError::NotFound { peer },
                peer_error_code::SIZE_MISMATCH => TransportError::SizeMismatch {
                    peer,
                    message: reply.message,
                },
                code => TransportError::Refused {
                    peer,
                    code,
                    message: reply.message,
                },
            }));
        }
        Ok(header)
    }

    /// One request/reply exchange of an encoded `frame` on `stream` (`PeerRemove`,
    /// `PeerDemote`, `PeerClear`): the reply decoded as `T`, or the node's error.
    fn exchange_on<T: Decode>(
        stream: &mut TcpStream,
        peer: &str,
        frame: &[u8],
    ) -> Result<T, TransportError> {
        stream
            .write_all(frame)
            .map_err(|e| Self::io_error(peer, e))?;
        let mut body = Vec::new();
        let header = read_frame_limited(stream, &mut body, MAX_KEY_REPLY)
            .map_err(|e| Self::proto_error(peer, e))?;
        if header.flags & FLAG_ERROR != 0 {
            let reply = ErrorReply::decode(&body).map_err(|e| Self::proto_error(peer, e))?;
            return Err(TransportError::Refused {
                peer: peer.to_string(),
                code: reply.code,
                message: reply.message,
            });
        }
        T::decode(&body).map_err(|e| Self::proto_error(peer, e))
    }

    /// One connection's share of a batch: items are taken from `queue` one at a time, so a
    /// connection that starts late or runs slow takes fewer. Up to [`MIN_IN_FLIGHT`] items
    /// (more while under [`WINDOW_BYTES`], at most [`PIPELINE_WINDOW`]) are requested ahead
    /// of the reply being read. A pooled connection that fails as a stale one ([`is_stale`])
    /// before any reply is replaced once by a fresh connection and its unanswered requests
    /// are sent again; any other connection failure marks the peer down and fails the
    /// requests in flight (this connection takes no more).
    fn work<T, X: Exchange<T>>(
        &self,
        peer: &str,
        x: &X,
        queue: &Mutex<impl Iterator<Item = (usize, T)>>,
    ) -> WorkerEnd {
        let mut end = WorkerEnd {
            results: Vec::new(),
            written: Vec::new(),
            stopped: None,
        };
        let (mut stream, mut pooled) = match self.checkout(peer) {
            Ok(s) => s,
            Err(e) => {
                end.stopped = Some(e);
                return end;
            }
        };
        let mut in_flight: VecDeque<(usize, T)> = VecDeque::new();
        let mut in_flight_bytes = 0usize;
        let mut replied = false;
        let mut resend = false;
        let mut queued = Vec::new();
        loop {
            let failure: Option<TransportError> = 'step: {
                let mut sent = Ok(());
                if std::mem::take(&mut resend) {
                    for (i, item) in &in_flight {
                        sent = x.send(&mut stream, &mut queued, *i as u64, item);
                        if sent.is_err() {
                            break;
                        }
                        // Also those whose first send failed part way (counted once).
                        end.written.push(*i);
                    }
                }
                while sent.is_ok()
                    && in_flight.len() < PIPELINE_WINDOW
                    && (in_flight.len() < MIN_IN_FLIGHT || in_flight_bytes < WINDOW_BYTES)
                {
                    let Some((i, item)) = queue.lock().next() else {
                        break;
                    };
                    in_flight_bytes += x.bytes(&item);
                    sent = x.send(&mut stream, &mut queued, i as u64, &item);
                    if sent.is_ok() {
                        end.written.push(i);
                    }
                    in_flight.push_back((i, item));
                }
                if let Err(e) = sent {
                    break 'step Some(e);
                }
                if !queued.is_empty() {
                    let written = stream.write_all(&queued);
                    queued.clear();
                    if let Err(e) = written {
                        break 'step Some(Self::io_error(peer, e));
                    }
                }
                let Some((i, mut item)) = in_flight.pop_front() else {
                    // The batch is done.
                    self.checkin(peer, stream);
                    return end;
                };
                match x.receive(&mut stream, i as u64, &mut item) {
                    Ok(()) => {
                        in_flight_bytes -= x.bytes(&item);
                        replied = true;
                        end.results.push((i, Ok(())));
                        None
                    }
                    Err(ItemFailure::Item(e)) => {
                        in_flight_bytes -= x.bytes(&item);
                        replied = true;
                        end.results.push((i, Err(e)));
                        None
                    }
                    Err(ItemFailure::Connection(e)) => {
                        in_flight.push_front((i, item));
                        Some(e)
                    }
                }
            };
            let Some(e) = failure else { continue };
            let e = if pooled && !replied && is_stale(&e) {
                match self.reconnect_stale(peer, &e.to_string()) {
                    Ok(fresh) => {
                        (stream, pooled, resend) = (fresh, false, true);
                        queued.clear();
                        continue;
                    }
                    Err(e) => e,
                }
            } else {
                tracing::warn!(peer, reason = %e, "kvtier: peer connection failed");
                self.mark_down(peer);
                e
            };
            let reason = e.to_string();
            let mut first = Some(e);
            for (i, _) in in_flight.drain(..) {
                let error = first
                    .take()
                    .unwrap_or_else(|| TransportError::BatchAborted {
                        reason: reason.clone(),
                    });
                end.results.push((i, Err(error)));
            }
            end.stopped = Some(first.unwrap_or(TransportError::BatchAborted { reason }));
            return end;
        }
    }

    /// Run a batch over up to `connections_per_peer` connections to `peer` in parallel (only
    /// as many as give each at least [`MIN_BYTES_PER_CONNECTION`] of the batch's `bytes`), all
    /// taking items from one queue ([`Self::work`]). One result per item, in order; and the
    /// items whose request was written whole.
    fn spread<T: Send, X: Exchange<T>>(
        &self,
        peer: &str,
        x: &X,
        items: Vec<T>,
        bytes: usize,
    ) -> (Vec<Result<(), TransportError>>, Vec<usize>) {
        let n = items.len();
        let conns = connections_for(self.config.connections_per_peer, n, bytes);
        let queue = Mutex::new(items.into_iter().enumerate());
        let ends: Vec<WorkerEnd> = if conns == 1 {
            vec![self.work(peer, x, &queue)]
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = (1..conns)
                    .map(|_| scope.spawn(|| self.work(peer, x, &queue)))
                    .collect();
                let mut ends = vec![self.work(peer, x, &queue)];
                for handle in handles {
                    ends.push(handle.join().unwrap_or_else(|_| WorkerEnd {
                        results: Vec::new(),
                        written: Vec::new(),
                        stopped: Some(Self::io_error(
                            peer,
                            io::Error::other("transfer thread panicked"),
                        )),
                    }));
                }
                ends
            })
        };
        let mut results: Vec<Option<Result<(), TransportError>>> = (0..n).map(|_| None).collect();
        let mut written = Vec::new();
        let mut stopped = Vec::new();
        for end in ends {
            for (i, r) in end.results {
                results[i] = Some(r);
            }
            written.extend(end.written);
            stopped.extend(end.stopped);
        }
        // Items no connection answered (every connection failed): the first failure for the
        // first of them, the rest aborted with its reason.
        let mut stopped = stopped.into_iter();
        let mut first = stopped.next();
        let reason = first.as_ref().map_or_else(
            || "no connection took the item".to_string(),
            |e| e.to_string(),
        );
        let results = results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(first
                        .take()
                        .unwrap_or_else(|| TransportError::BatchAborted {
                            reason: reason.clone(),
                        }))
                })
            })
            .collect();
        (results, written)
    }
}

/// How many items a connection keeps requested ahead of the reply it reads: at least this
/// many, so the node always has the next object to send while the previous one drains, ...
const MIN_IN_FLIGHT: usize = 2;
/// ... and more while their bytes stay under this (small objects), up to [`PIPELINE_WINDOW`].
/// A small window keeps the batch in the shared queue, so connections finish together.
const WINDOW_BYTES: usize = 1 << 20;

/// What one connection of [`TcpTransport::spread`] did.
struct WorkerEnd {
    results: Vec<(usize, Result<(), TransportError>)>,
    /// Items whose request was written whole (at least once).
    written: Vec<usize>,
    /// Why it stopped before the batch was done (it took no further items).
    stopped: Option<TransportError>,
}

/// One kind of pipelined request, for [`TcpTransport::spread`].
trait Exchange<T>: Sync {
    /// Page bytes of `item`, for the in-flight window.
    fn bytes(&self, item: &T) -> usize;
    /// Send request `id` for `item`: append a small frame to `queued` (written in one call
    /// with the others before the next reply is awaited), or write `queued` and then the
    /// frame to `stream`.
    fn send(
        &self,
        stream: &mut TcpStream,
        queued: &mut Vec<u8>,
        id: u64,
        item: &T,
    ) -> Result<(), TransportError>;
    /// Read the reply to request `id` (for `item`).
    fn receive(&self, stream: &mut TcpStream, id: u64, item: &mut T) -> Result<(), ItemFailure>;
}

struct PutExchange<'p> {
    peer: &'p str,
    /// Append the end-to-end integrity trailer made with this key.
    checksums: Option<&'p ObjectIntegrity>,
}

impl<'a> Exchange<&'a PutItem<'a>> for PutExchange<'_> {
    fn bytes(&self, item: &&'a PutItem<'a>) -> usize {
        item.value.len()
    }

    fn send(
        &self,
        stream: &mut TcpStream,
        queued: &mut Vec<u8>,
        id: u64,
        item: &&'a PutItem<'a>,
    ) -> Result<(), TransportError> {
        let peer = self.peer;
        if !queued.is_empty() {
            stream
                .write_all(queued)
                .map_err(|e| TcpTransport::io_error(peer, e))?;
            queued.clear();
        }
        let meta = PeerPutMeta {
            key: item.key.to_vec(),
            depth: item.depth,
        }
        .encode_to_vec()
        .map_err(|e| TcpTransport::proto_error(peer, e))?;
        let trailer = self
            .checksums
            .map(|seal| seal.trailer(item.key, item.value));
        let trailer: &[u8] = trailer.as_ref().map_or(&[], |t| &t[..]);
        // The payload goes out from the caller's memory (vectored, no copy).
        write_request(stream, Opcode::PeerPut, id, &meta, item.value, trailer)
            .map_err(|e| TcpTransport::proto_error(peer, e))
    }

    fn receive(
        &self,
        stream: &mut TcpStream,
        id: u64,
        _item: &mut &'a PutItem<'a>,
    ) -> Result<(), ItemFailure> {
        let peer = self.peer;
        let header = TcpTransport::reply_header(stream, peer, id)?;
        drain(stream, u64::from(header.body_len))
            .map_err(|e| ItemFailure::Connection(TcpTransport::io_error(peer, e)))
    }
}

struct GetExchange<'p> {
    peer: &'p str,
    /// Expect the end-to-end integrity trailer and verify it with this key.
    checksums: Option<&'p ObjectIntegrity>,
    /// Page bytes read into destinations.
    received: std::sync::atomic::AtomicU64,
}

impl<'a, 'b> Exchange<&'a mut GetItem<'b>> for GetExchange<'_> {
    fn bytes(&self, item: &&'a mut GetItem<'b>) -> usize {
        item.dst.len()
    }

    fn send(
        &self,
        _stream: &mut TcpStream,
        queued: &mut Vec<u8>,
        id: u64,
        item: &&'a mut GetItem<'b>,
    ) -> Result<(), TransportError> {
        // A get request is small: queued, so the requests of a window go out in one write.
        let trailer = if self.checksums.is_some() {
            CHECKSUM_LEN
        } else {
            0
        };
        let request = PeerGet {
            key: item.key.to_vec(),
            expected_len: (item.dst.len() + trailer) as u64,
        }
        .encode_to_vec()
        .map_err(|e| TcpTransport::proto_error(self.peer, e))?;
        let header = FrameHeader::new(Opcode::PeerGet, id, 0, request.len() as u32);
        queued.extend_from_slice(&header.encode());
        queued.extend_from_slice(&request);
        Ok(())
    }

    fn receive(
        &self,
        stream: &mut TcpStream,
        id: u64,
        item: &mut &'a mut GetItem<'b>,
    ) -> Result<(), ItemFailure> {
        let peer = self.peer;
        let header = TcpTransport::reply_header(stream, peer, id)?;
        let dst = &mut *item.dst;
        let trailer = if self.checksums.is_some() {
            CHECKSUM_LEN
        } else {
            0
        };
        if header.body_len as usize != dst.len() + trailer {
            drain(stream, u64::from(header.body_len))
                .map_err(|e| ItemFailure::Connection(TcpTransport::io_error(peer, e)))?;
            return Err(ItemFailure::Item(TransportError::SizeMismatch {
                peer: peer.to_string(),
                message: format!(
                    "{} bytes sent for a {}-byte buffer{}",
                    header.body_len,
                    dst.len(),
                    if self.checksums.is_some() {
                        " and its checksum"
                    } else {
                        ""
                    }
                ),
            }));
        }
        let read = |stream: &mut TcpStream, into: &mut [u8]| {
            stream
                .read_exact(into)
                .map_err(|e| ItemFailure::Connection(TcpTransport::io_error(peer, e)))
        };
        // Straight into the destination, then the trailer, checked over the whole value.
        read(stream, dst)?;
        if let Some(seal) = self.checksums {
            let mut stored = [0u8; CHECKSUM_LEN];
            read(stream, &mut stored)?;
            if !seal.verify(item.key, dst, &stored) {
                // The destination holds bytes that are not the object's (or were not sealed by
                // a holder of the cluster token): the caller treats the item as a miss and
                // never uses them.
                return Err(ItemFailure::Item(TransportError::Integrity {
                    peer: peer.to_string(),
                    message: format!(
                        "the {}-byte object's integrity trailer does not match",
                        dst.len()
                    ),
                }));
            }
        }
        self.received
            .fetch_add(header.body_len as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

impl Transport for TcpTransport {
    fn put(&self, peer: &str, items: &[PutItem<'_>]) -> Vec<Result<(), TransportError>> {
        if items.is_empty() {
            return Vec::new();
        }
        let bytes = items.iter().map(|i| i.value.len()).sum();
        let (results, written) = self.spread(
            peer,
            &PutExchange {
                peer,
                checksums: self.config.end_to_end_checksums.then_some(&self.integrity),
            },
            items.iter().collect(),
            bytes,
        );
        // Bytes written to a socket (a request sent again after a stale connection counts once).
        let mut counted = vec![false; items.len()];
        let sent = written
            .into_iter()
            .filter(|&i| !std::mem::replace(&mut counted[i], true))
            .map(|i| (items[i].value.len() + self.trailer_len()) as u64)
            .sum();
        count_transfer(peer, "out", sent);
        results
    }

    fn get(&self, peer: &str, items: &mut [GetItem<'_>]) -> Vec<Result<(), TransportError>> {
        if items.is_empty() {
            return Vec::new();
        }
        let bytes = items.iter().map(|i| i.dst.len()).sum();
        let x = GetExchange {
            peer,
            checksums: self.config.end_to_end_checksums.then_some(&self.integrity),
            received: Default::default(),
        };
        let (results, _) = self.spread(peer, &x, items.iter_mut().collect(), bytes);
        count_transfer(peer, "in", x.received.into_inner());
        results
    }

    fn remove(&self, peer: &str, keys: &[&[u8]]) -> Result<Vec<bool>, TransportError> {
        Ok(self
            .request::<WireResult>(peer, Opcode::PeerRemove, keys)?
            .ok)
    }

    fn demote(&self, peer: &str, keys: &[&[u8]]) -> Result<Vec<bool>, TransportError> {
        Ok(self
            .request::<WireResult>(peer, Opcode::PeerDemote, keys)?
            .ok)
    }

    fn clear_prefix(&self, peer: &str, prefix: &[u8]) -> Result<Vec<Vec<u8>>, TransportError> {
        Ok(self
            .request::<KeyBatch>(peer, Opcode::PeerClear, &[prefix])?
            .keys)
    }
}

impl TcpTransport {
    /// One request of a small control exchange whose body is a [`KeyBatch`] of `keys` (every
    /// such opcode is idempotent, so a stale pooled connection is retried once on a fresh one).
    fn request<T: Decode>(
        &self,
        peer: &str,
        opcode: Opcode,
        keys: &[&[u8]],
    ) -> Result<T, TransportError> {
        let body = KeyBatch {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        };
        self.control(peer, opcode, &body)
    }

    /// One request/reply of a small control exchange with any body (issue 17: the UCX data
    /// plane's hello rides on the authenticated pooled connections). Only for requests that are
    /// harmless when sent again: a stale pooled connection is retried once on a fresh one. A
    /// node's error reply is [`TransportError::Refused`] with its code.
    pub fn control<T: Decode>(
        &self,
        peer: &str,
        opcode: Opcode,
        body: &impl Encode,
    ) -> Result<T, TransportError> {
        self.session(peer)?.control(opcode, body)
    }

    /// Hold one connection to `peer` for several control exchanges: state a node keeps per
    /// connection (a UCX lease) is released on the connection that took it, and freed by the
    /// node if that connection ends first.
    pub fn session<'a>(&'a self, peer: &'a str) -> Result<ControlSession<'a>, TransportError> {
        let (stream, pooled) = self.checkout(peer)?;
        Ok(ControlSession {
            transport: self,
            peer,
            stream: Some(stream),
            pooled,
        })
    }
}

/// One connection to a peer held for a sequence of control exchanges
/// ([`TcpTransport::session`]); back to the pool when dropped, unless an exchange failed.
pub struct ControlSession<'a> {
    transport: &'a TcpTransport,
    peer: &'a str,
    /// `None` once an exchange failed: the connection is dropped, not pooled.
    stream: Option<TcpStream>,
    /// Taken from the pool and not yet answered on: a stale failure may be retried once.
    pooled: bool,
}

impl ControlSession<'_> {
    /// One request/reply on this session's connection (see [`TcpTransport::control`]).
    pub fn control<T: Decode>(
        &mut self,
        opcode: Opcode,
        body: &impl Encode,
    ) -> Result<T, TransportError> {
        let peer = self.peer;
        let mut frame = Vec::new();
        encode_frame(&mut frame, opcode, 1, 0, body)
            .map_err(|e| TcpTransport::proto_error(peer, e))?;
        loop {
            let Some(stream) = self.stream.as_mut() else {
                return Err(TransportError::Io {
                    peer: peer.to_string(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::NotConnected,
                        "this session's connection failed earlier",
                    ),
                });
            };
            match TcpTransport::exchange_on::<T>(stream, peer, &frame) {
                Ok(reply) => {
                    self.pooled = false;
                    return Ok(reply);
                }
                // Stale before any reply: the request did not reach a live process.
                Err(e) if self.pooled && is_stale(&e) => {
                    self.stream = None;
                    self.pooled = false;
                    self.stream = Some(self.transport.reconnect_stale(peer, &e.to_string())?);
                }
                Err(e) => {
                    self.stream = None;
                    return Err(e);
                }
            }
        }
    }
}

impl Drop for ControlSession<'_> {
    fn drop(&mut self) {
        if let Some(stream) = self.stream.take() {
            self.transport.checkin(self.peer, stream);
        }
    }
}
