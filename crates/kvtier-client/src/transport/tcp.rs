//! The TCP transport: KVT1 frames over pooled, authenticated connections.
//!
//! - Every connection opens with `PeerHello` carrying the cluster token; a refusal is an
//!   [`TransportError::Unauthorized`] and the connection is dropped.
//! - Up to `connections_per_peer` idle connections are kept per peer. A large batch is split
//!   into contiguous runs, one per connection, sent in parallel; on each connection requests
//!   are pipelined (up to [`PIPELINE_WINDOW`] in flight), so a batch costs about one round
//!   trip plus the bytes.
//! - Get responses are read header first; only a body whose length equals the destination's
//!   is read, straight into the destination. Anything else fails that item closed (the body
//!   is drained so the stream stays in sync).
//! - Page bytes moved are counted per peer in [`names::PEER_TRANSFER_BYTES`] (`peer` = the
//!   node's data address; `direction="out"` for puts, `"in"` for gets), once per run.
//! - Every socket has read/write timeouts (`request_timeout`); a peer that fails to connect or
//!   times out is marked down for `down_backoff`, during which calls to it fail at once, so a
//!   dead peer costs a caller one timeout, not one per call.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use kvtier_proto::frame::{FrameHeader, FLAG_ERROR, HEADER_LEN};
use kvtier_proto::peer::{peer_error_code, PeerGet, PeerHello, PeerPutMeta};
use kvtier_proto::{
    encode_frame, read_frame_limited, BatchResult as WireResult, Decode, Encode, ErrorReply,
    KeyBatch, Opcode, ProtoError,
};
use parking_lot::Mutex;

use super::{GetItem, PutItem, Transport, TransportError};
use crate::metrics::names;

/// Requests in flight on one connection.
pub const PIPELINE_WINDOW: usize = 32;
/// A batch is spread over several connections only when each gets at least this many bytes.
const MIN_BYTES_PER_CONNECTION: usize = 4 << 20;
/// Largest error body read.
const MAX_ERROR_BODY: u32 = 64 << 10;

/// Settings of a [`TcpTransport`].
#[derive(Clone, Debug)]
pub struct TcpTransportConfig {
    pub token: Vec<u8>,
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
            name: "kvtier-client".into(),
            connections_per_peer: 2,
            request_timeout: Duration::from_secs(2),
            down_backoff: Duration::from_secs(1),
        }
    }
}

#[derive(Debug)]
pub struct TcpTransport {
    config: TcpTransportConfig,
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
) -> Result<(), ProtoError> {
    let body_len = prefix.len() + payload.len();
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
    write_all_vectored(stream, &mut [IoSlice::new(&head), IoSlice::new(payload)])?;
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

impl TcpTransport {
    pub fn new(config: TcpTransportConfig) -> TcpTransport {
        TcpTransport {
            config,
            idle: Mutex::new(HashMap::new()),
            down_until: Mutex::new(HashMap::new()),
        }
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
        let hello = PeerHello {
            token: self.config.token.clone(),
            name: self.config.name.clone(),
        };
        let mut frame = Vec::new();
        encode_frame(&mut frame, Opcode::PeerHello, 0, 0, &hello)
            .map_err(|e| Self::proto_error(peer, e))?;
        stream
            .write_all(&frame)
            .map_err(|e| Self::io_error(peer, e))?;
        let header = read_header(&mut stream).map_err(|e| Self::proto_error(peer, e))?;
        if header.is_error() {
            let reply = read_error(&mut stream, &header).map_err(|e| Self::proto_error(peer, e))?;
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
        drain(&mut stream, u64::from(header.body_len)).map_err(|e| Self::io_error(peer, e))?;
        Ok(stream)
    }

    fn checkout(&self, peer: &str) -> Result<TcpStream, TransportError> {
        self.check_down(peer)?;
        if let Some(stream) = self.idle.lock().get_mut(peer).and_then(Vec::pop) {
            return Ok(stream);
        }
        match self.connect(peer) {
            Ok(stream) => Ok(stream),
            Err(e) => {
                if e.is_unreachable() {
                    self.mark_down(peer);
                }
                Err(e)
            }
        }
    }

    fn checkin(&self, peer: &str, stream: TcpStream) {
        let mut idle = self.idle.lock();
        let pool = idle.entry(peer.to_string()).or_default();
        if pool.len() < self.config.connections_per_peer {
            pool.push(stream);
        }
    }

    /// Split `n` items of `sizes` into contiguous runs, one per connection to use.
    fn runs(&self, sizes: impl Iterator<Item = usize>, n: usize) -> Vec<std::ops::Range<usize>> {
        let sizes: Vec<usize> = sizes.collect();
        let total: usize = sizes.iter().sum();
        let conns = self
            .config
            .connections_per_peer
            .min(n)
            .min((total / MIN_BYTES_PER_CONNECTION).max(1))
            .max(1);
        if conns == 1 {
            return std::iter::once(0..n).collect();
        }
        let target = total.div_ceil(conns);
        let mut runs = Vec::with_capacity(conns);
        let (mut start, mut acc) = (0, 0);
        for (i, size) in sizes.iter().enumerate() {
            acc += size;
            if acc >= target && runs.len() + 1 < conns {
                runs.push(start..i + 1);
                start = i + 1;
                acc = 0;
            }
        }
        if start < n {
            runs.push(start..n);
        }
        runs
    }

    /// Run `items` over one connection with a pipelined window. `send(stream, i)` writes
    /// request `i`; `receive(stream, i)` reads its response.
    /// The header of reply `i` of a pipelined batch: out of order is a connection failure; an
    /// error reply is read whole and returned as `Err` (an item failure the caller names).
    fn reply_header(
        stream: &mut TcpStream,
        peer: &str,
        i: usize,
    ) -> Result<Result<FrameHeader, ErrorReply>, ItemFailure> {
        let header =
            read_header(stream).map_err(|e| ItemFailure::Connection(Self::proto_error(peer, e)))?;
        if header.request_id != i as u64 {
            return Err(ItemFailure::Connection(TransportError::OutOfOrder {
                peer: peer.to_string(),
                expected: i as u64,
                found: header.request_id,
            }));
        }
        if header.is_error() {
            return read_error(stream, &header)
                .map(Err)
                .map_err(|e| ItemFailure::Connection(Self::proto_error(peer, e)));
        }
        Ok(Ok(header))
    }

    fn pipeline(
        &self,
        peer: &str,
        count: usize,
        mut send: impl FnMut(&mut TcpStream, usize) -> Result<(), TransportError>,
        mut receive: impl FnMut(&mut TcpStream, usize) -> Result<(), ItemFailure>,
    ) -> Vec<Result<(), TransportError>> {
        let mut results: Vec<Result<(), TransportError>> = Vec::with_capacity(count);
        let mut stream = match self.checkout(peer) {
            Ok(s) => s,
            Err(e) => {
                let message = e.to_string();
                results.push(Err(e));
                for _ in 1..count {
                    results.push(Err(TransportError::BatchAborted {
                        reason: message.clone(),
                    }));
                }
                return results;
            }
        };
        let mut sent = 0;
        let mut broken: Option<String> = None;
        while results.len() < count {
            while broken.is_none() && sent < count && sent - results.len() < PIPELINE_WINDOW {
                if let Err(e) = send(&mut stream, sent) {
                    broken = Some(e.to_string());
                    break;
                }
                sent += 1;
            }
            if broken.is_some() {
                break;
            }
            let i = results.len();
            match receive(&mut stream, i) {
                Ok(()) => results.push(Ok(())),
                Err(ItemFailure::Item(e)) => results.push(Err(e)),
                Err(ItemFailure::Connection(e)) => {
                    broken = Some(e.to_string());
                    results.push(Err(e));
                    break;
                }
            }
        }
        match broken {
            None => self.checkin(peer, stream),
            Some(reason) => {
                tracing::warn!(peer, reason = %reason, "kvtier: peer connection failed");
                self.mark_down(peer);
                while results.len() < count {
                    results.push(Err(TransportError::BatchAborted {
                        reason: reason.clone(),
                    }));
                }
            }
        }
        results
    }

    fn put_run(&self, peer: &str, items: &[PutItem<'_>]) -> Vec<Result<(), TransportError>> {
        let mut meta = Vec::new();
        let mut sent = 0u64;
        let results = self.pipeline(
            peer,
            items.len(),
            |stream, i| {
                meta.clear();
                PeerPutMeta {
                    key: items[i].key.to_vec(),
                    depth: items[i].depth,
                }
                .encode(&mut meta)
                .map_err(|e| Self::proto_error(peer, e))?;
                write_request(stream, Opcode::PeerPut, i as u64, &meta, items[i].value)
                    .map_err(|e| Self::proto_error(peer, e))?;
                sent += items[i].value.len() as u64;
                Ok(())
            },
            |stream, i| {
                let header = match Self::reply_header(stream, peer, i)? {
                    Ok(header) => header,
                    Err(reply) => {
                        return Err(ItemFailure::Item(TransportError::Refused {
                            peer: peer.to_string(),
                            code: reply.code,
                            message: reply.message,
                        }))
                    }
                };
                drain(stream, u64::from(header.body_len))
                    .map_err(|e| ItemFailure::Connection(Self::io_error(peer, e)))
            },
        );
        count_transfer(peer, "out", sent);
        results
    }

    fn get_run(&self, peer: &str, items: &mut [GetItem<'_>]) -> Vec<Result<(), TransportError>> {
        let requests: Vec<Vec<u8>> = items
            .iter()
            .map(|item| {
                PeerGet {
                    key: item.key.to_vec(),
                    expected_len: item.dst.len() as u64,
                }
                .encode_to_vec()
                .unwrap_or_default()
            })
            .collect();
        let mut received = 0u64;
        let results = self.pipeline(
            peer,
            items.len(),
            |stream, i| {
                write_request(stream, Opcode::PeerGet, i as u64, &requests[i], &[])
                    .map_err(|e| Self::proto_error(peer, e))
            },
            |stream, i| {
                let header = match Self::reply_header(stream, peer, i)? {
                    Ok(header) => header,
                    Err(reply) => {
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
                };
                let dst = &mut *items[i].dst;
                if header.body_len as usize != dst.len() {
                    drain(stream, u64::from(header.body_len))
                        .map_err(|e| ItemFailure::Connection(Self::io_error(peer, e)))?;
                    return Err(ItemFailure::Item(TransportError::SizeMismatch {
                        peer: peer.to_string(),
                        message: format!(
                            "{} bytes sent for a {}-byte buffer",
                            header.body_len,
                            dst.len()
                        ),
                    }));
                }
                stream
                    .read_exact(dst)
                    .map_err(|e| ItemFailure::Connection(Self::io_error(peer, e)))?;
                received += dst.len() as u64;
                Ok(())
            },
        );
        count_transfer(peer, "in", received);
        results
    }
}

impl Transport for TcpTransport {
    fn put(&self, peer: &str, items: &[PutItem<'_>]) -> Vec<Result<(), TransportError>> {
        if items.is_empty() {
            return Vec::new();
        }
        let runs = self.runs(items.iter().map(|i| i.value.len()), items.len());
        if runs.len() == 1 {
            return self.put_run(peer, items);
        }
        std::thread::scope(|scope| {
            let handles: Vec<_> = runs
                .iter()
                .skip(1)
                .map(|r| {
                    let slice = &items[r.clone()];
                    scope.spawn(move || self.put_run(peer, slice))
                })
                .collect();
            let mut out = self.put_run(peer, &items[runs[0].clone()]);
            for (handle, run) in handles.into_iter().zip(runs.iter().skip(1)) {
                out.extend(handle.join().unwrap_or_else(|_| {
                    run.clone()
                        .map(|_| {
                            Err(Self::io_error(
                                peer,
                                io::Error::other("transfer thread panicked"),
                            ))
                        })
                        .collect()
                }));
            }
            out
        })
    }

    fn get(&self, peer: &str, items: &mut [GetItem<'_>]) -> Vec<Result<(), TransportError>> {
        if items.is_empty() {
            return Vec::new();
        }
        let n = items.len();
        let runs = self.runs(items.iter().map(|i| i.dst.len()), n);
        if runs.len() == 1 {
            return self.get_run(peer, items);
        }
        // Disjoint mutable runs of the batch, one per connection.
        let mut parts: Vec<&mut [GetItem<'_>]> = Vec::with_capacity(runs.len());
        let mut rest = items;
        for run in &runs {
            let (head, tail) = rest.split_at_mut(run.len());
            parts.push(head);
            rest = tail;
        }
        std::thread::scope(|scope| {
            let mut iter = parts.into_iter();
            let first = iter.next();
            let handles: Vec<_> = iter
                .map(|part| {
                    let len = part.len();
                    (len, scope.spawn(move || self.get_run(peer, part)))
                })
                .collect();
            let mut out = first.map(|p| self.get_run(peer, p)).unwrap_or_default();
            for (len, handle) in handles {
                out.extend(handle.join().unwrap_or_else(|_| {
                    (0..len)
                        .map(|_| {
                            Err(Self::io_error(
                                peer,
                                io::Error::other("transfer thread panicked"),
                            ))
                        })
                        .collect()
                }));
            }
            out
        })
    }

    fn remove(&self, peer: &str, keys: &[&[u8]]) -> Result<Vec<bool>, TransportError> {
        self.key_batch(peer, Opcode::PeerRemove, keys)
    }

    fn demote(&self, peer: &str, keys: &[&[u8]]) -> Result<Vec<bool>, TransportError> {
        self.key_batch(peer, Opcode::PeerDemote, keys)
    }
}

impl TcpTransport {
    /// One request of a whole-key batch (`PeerRemove`, `PeerDemote`): whether each key was
    /// acted on.
    fn key_batch(
        &self,
        peer: &str,
        opcode: Opcode,
        keys: &[&[u8]],
    ) -> Result<Vec<bool>, TransportError> {
        let mut stream = self.checkout(peer)?;
        let batch = KeyBatch {
            keys: keys.iter().map(|k| k.to_vec()).collect(),
        };
        let mut frame = Vec::new();
        encode_frame(&mut frame, opcode, 1, 0, &batch).map_err(|e| Self::proto_error(peer, e))?;
        stream
            .write_all(&frame)
            .map_err(|e| Self::io_error(peer, e))?;
        let mut body = Vec::new();
        let header = read_frame_limited(&mut stream, &mut body, 16 << 20)
            .map_err(|e| Self::proto_error(peer, e))?;
        if header.flags & FLAG_ERROR != 0 {
            let reply = ErrorReply::decode(&body).map_err(|e| Self::proto_error(peer, e))?;
            return Err(TransportError::Refused {
                peer: peer.to_string(),
                code: reply.code,
                message: reply.message,
            });
        }
        let result = WireResult::decode(&body).map_err(|e| Self::proto_error(peer, e))?;
        self.checkin(peer, stream);
        Ok(result.ok)
    }
}
