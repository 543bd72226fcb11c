//! The peer data port of a cluster node (`kvtier serve --master ... --data-addr HOST:PORT`):
//! cluster clients on any host put and get objects of this node's store over TCP.
//!
//! - Authentication: the first frame must be `PeerHello` with the cluster token (compared in
//!   constant time). Anything else is answered `UNAUTHORIZED`, logged with the peer's address,
//!   and the connection is closed; nothing is served before.
//! - Two threads per connection (clients keep a few pooled connections per node): a reader
//!   that serves requests in order and a writer that sends the replies in the same order, so
//!   clients may pipeline and a get's copy out of the store overlaps the send of the previous
//!   object (up to `REPLIES_IN_FLIGHT` replies queued).
//! - Puts are put-if-absent in the node's store. Every key stored through this port is
//!   remembered in [`HeldKeys`], which the node agent reports to the master when it
//!   (re-)registers and checks against the store to report evictions.
//! - A frame that loses stream sync closes the connection; a bad body gets an error reply.
//! - Page bytes moved are counted per peer host in `kvtier_peer_transfer_bytes_total{peer,
//!   direction}` (`peer` = the client's IP address, `direction="in"` for puts received,
//!   `"out"` for gets sent), besides the port-wide [`DataPortCounters`].

use std::collections::HashSet;
use std::io::{self, IoSlice, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use kvtier_client::metrics::names;
use kvtier_client::transport::tcp::write_all_vectored;
use kvtier_client::Client;
use kvtier_proto::frame::{FLAG_ERROR, FLAG_RESPONSE, HEADER_LEN};
use kvtier_proto::peer::{peer_error_code, PeerGet, PeerHello, PeerPutMeta};
use kvtier_proto::server::error_code;
use kvtier_proto::{
    encode_frame, read_frame_limited, BatchResult as WireResult, Decode, ErrorReply, FrameHeader,
    KeyBatch, Opcode, ProtoError,
};
use parking_lot::Mutex;

/// Largest body accepted before the hello.
const PRE_HELLO_MAX_BODY: u32 = 4 << 10;

/// Keys this node stored for the cluster.
#[derive(Debug, Default)]
pub struct HeldKeys {
    keys: Mutex<HashSet<Vec<u8>>>,
}

impl HeldKeys {
    fn insert(&self, key: &[u8]) {
        let mut keys = self.keys.lock();
        if !keys.contains(key) {
            keys.insert(key.to_vec());
        }
    }

    fn remove(&self, key: &[u8]) {
        self.keys.lock().remove(key);
    }

    /// Every key still in `store`.
    pub fn snapshot(&self, store: &Client) -> Vec<Vec<u8>> {
        let keys: Vec<Vec<u8>> = self.keys.lock().iter().cloned().collect();
        let present = store.exists_keys(&keys);
        keys.into_iter()
            .zip(present)
            .filter_map(|(k, p)| p.then_some(k))
            .collect()
    }

    /// Forget and return the keys the store no longer holds (evicted or removed).
    pub fn take_dropped(&self, store: &Client) -> Vec<Vec<u8>> {
        let keys: Vec<Vec<u8>> = self.keys.lock().iter().cloned().collect();
        let present = store.exists_keys(&keys);
        let dropped: Vec<Vec<u8>> = keys
            .into_iter()
            .zip(present)
            .filter_map(|(k, p)| (!p).then_some(k))
            .collect();
        let mut held = self.keys.lock();
        for k in &dropped {
            held.remove(k);
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
    pub puts: AtomicU64,
    pub gets: AtomicU64,
    pub misses: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
}

struct PortShared {
    store: Arc<Client>,
    token: Vec<u8>,
    held: Arc<HeldKeys>,
    counters: DataPortCounters,
    stopping: AtomicBool,
    conns: Mutex<Vec<TcpStream>>,
}

/// A running data port.
pub struct DataPort {
    shared: Arc<PortShared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

fn tokens_equal(a: &[u8], b: &[u8]) -> bool {
    // Constant time in the contents (the length of the secret is not a secret worth hiding).
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl DataPort {
    /// Bind `addr` and start serving `store` to peers presenting `token`.
    pub fn start(addr: SocketAddr, store: Arc<Client>, token: Vec<u8>) -> io::Result<DataPort> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(PortShared {
            store,
            token,
            held: Arc::new(HeldKeys::default()),
            counters: DataPortCounters::default(),
            stopping: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
        });
        let accept = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("kvtier-data-accept".into())
                .spawn(move || accept_loop(&shared, listener))?
        };
        Ok(DataPort {
            shared,
            addr,
            accept: Some(accept),
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
        for c in self.shared.conns.lock().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
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

fn accept_loop(shared: &Arc<PortShared>, listener: TcpListener) {
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else { continue };
        let _ = stream.set_nodelay(true);
        if let Ok(clone) = stream.try_clone() {
            let mut conns = shared.conns.lock();
            conns.retain(|c| c.peer_addr().is_ok());
            conns.push(clone);
        }
        shared.counters.connections.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::clone(shared);
        let _ = std::thread::Builder::new()
            .name("kvtier-data-conn".into())
            .spawn(move || {
                let peer = stream
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|_| "?".into());
                // A connection ending with an i/o error (peer gone, timeout) needs no log line.
                let _ = serve_connection(&shared, stream, &peer);
            });
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

fn serve_connection(shared: &PortShared, mut stream: TcpStream, peer: &str) -> io::Result<()> {
    let mut body = Vec::new();
    // The hello, with a small body limit: nothing large is read from an unauthenticated peer.
    let header =
        read_frame_limited(&mut stream, &mut body, PRE_HELLO_MAX_BODY).map_err(proto_io)?;
    let hello = match header.opcode() {
        Ok(Opcode::PeerHello) => PeerHello::decode(&body).ok(),
        _ => None,
    };
    match hello {
        Some(h) if tokens_equal(&h.token, &shared.token) => {
            let ok = FrameHeader::new(Opcode::PeerHello, header.request_id, FLAG_RESPONSE, 0);
            stream.write_all(&ok.encode())?;
        }
        other => {
            shared
                .counters
                .refused_unauthorized
                .fetch_add(1, Ordering::Relaxed);
            let name = other.map(|h| h.name).unwrap_or_default();
            eprintln!("kvtier serve: data port refused {peer} ({name:?}): wrong cluster token");
            let _ = send_error(
                &mut stream,
                header.opcode,
                header.request_id,
                peer_error_code::UNAUTHORIZED,
                "wrong cluster token".into(),
            );
            return Ok(());
        }
    }
    let host = stream
        .peer_addr()
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|_| "?".into());
    let writer_stream = stream.try_clone()?;
    let (tx, rx) = mpsc::sync_channel::<Reply>(REPLIES_IN_FLIGHT);
    let (spare_tx, spare_rx) = mpsc::sync_channel::<Vec<u8>>(REPLIES_IN_FLIGHT + 2);
    let moved_out =
        metrics::counter!(names::PEER_TRANSFER_BYTES, "peer" => host.clone(), "direction" => "out");
    let writer = std::thread::Builder::new()
        .name("kvtier-data-tx".into())
        .spawn(move || write_replies(writer_stream, rx, spare_tx, moved_out))?;
    let replies = Replies {
        tx,
        spare: spare_rx,
    };
    let moved_in =
        metrics::counter!(names::PEER_TRANSFER_BYTES, "peer" => host, "direction" => "in");
    let served = serve_requests(shared, &mut stream, &mut body, &replies, &moved_in);
    // The writer ends once every queued reply is written (or the socket failed).
    drop(replies);
    let written = writer
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("data port writer panicked")));
    served.and(written)
}

/// Replies queued per connection: the reader copies the next object out of the store while
/// the writer thread still sends the previous one.
const REPLIES_IN_FLIGHT: usize = 2;
/// Reply buffers larger than this are freed rather than kept for the next get.
const MAX_KEPT_BUFFER: usize = 8 << 20;

/// One response frame for a connection's writer thread.
enum Reply {
    /// A whole encoded frame (small replies, errors).
    Frame(Vec<u8>),
    /// A get's header and the object bytes (the buffer goes back to the reader afterwards).
    Object {
        header: [u8; HEADER_LEN],
        body: Vec<u8>,
    },
}

/// The reader's side of a connection's writer thread.
struct Replies {
    tx: mpsc::SyncSender<Reply>,
    spare: mpsc::Receiver<Vec<u8>>,
}

impl Replies {
    fn queue(&self, reply: Reply) -> io::Result<()> {
        self.tx
            .send(reply)
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "data port writer stopped"))
    }

    fn ok(&self, opcode: Opcode, request_id: u64) -> io::Result<()> {
        let header = FrameHeader::new(opcode, request_id, FLAG_RESPONSE, 0).encode();
        self.queue(Reply::Frame(header.to_vec()))
    }

    fn error(&self, opcode: u16, request_id: u64, code: u16, message: String) -> io::Result<()> {
        self.queue(Reply::Frame(error_frame(
            opcode, request_id, code, message,
        )?))
    }

    /// A buffer of exactly `len` bytes for an object (a returned one when there is).
    fn buffer(&self, len: usize) -> Vec<u8> {
        let mut buf = self.spare.try_recv().unwrap_or_default();
        // Only a change of size touches the bytes; a same-size buffer is overwritten whole.
        buf.resize(len, 0);
        buf
    }
}

fn write_replies(
    mut stream: TcpStream,
    rx: mpsc::Receiver<Reply>,
    spare: mpsc::SyncSender<Vec<u8>>,
    moved_out: metrics::Counter,
) -> io::Result<()> {
    let mut send = |reply: Reply| -> io::Result<()> {
        match reply {
            Reply::Frame(frame) => stream.write_all(&frame),
            Reply::Object { header, body } => {
                write_all_vectored(
                    &mut stream,
                    &mut [IoSlice::new(&header), IoSlice::new(&body)],
                )?;
                moved_out.increment(body.len() as u64);
                if body.capacity() <= MAX_KEPT_BUFFER {
                    let _ = spare.try_send(body);
                }
                Ok(())
            }
        }
    };
    for reply in rx {
        if let Err(e) = send(reply) {
            // Wake the reader too: this connection is done.
            let _ = stream.shutdown(Shutdown::Both);
            return Err(e);
        }
    }
    Ok(())
}

fn serve_requests(
    shared: &PortShared,
    stream: &mut TcpStream,
    body: &mut Vec<u8>,
    replies: &Replies,
    moved_in: &metrics::Counter,
) -> io::Result<()> {
    loop {
        let header = match read_frame_limited(stream, body, kvtier_proto::frame::MAX_FRAME_BODY) {
            Ok(h) => h,
            Err(ProtoError::ConnectionClosed) => return Ok(()),
            Err(e) => return Err(proto_io(e)),
        };
        if shared.stopping.load(Ordering::Relaxed) {
            return Ok(());
        }
        let id = header.request_id;
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
                    Some(len) => {
                        let mut out = replies.buffer(len as usize);
                        match shared.store.get_into_slice(&get.key, &mut out) {
                            Ok(()) => {
                                shared.counters.gets.fetch_add(1, Ordering::Relaxed);
                                shared.counters.bytes_out.fetch_add(len, Ordering::Relaxed);
                                let header = FrameHeader::new(
                                    Opcode::PeerGet,
                                    id,
                                    FLAG_RESPONSE,
                                    len as u32,
                                )
                                .encode();
                                replies.queue(Reply::Object { header, body: out })?;
                            }
                            // Evicted between the length check and the copy.
                            Err(_) => {
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
                    let ok: Vec<bool> = if op == Opcode::PeerRemove {
                        batch
                            .keys
                            .iter()
                            .map(|k| {
                                shared.held.remove(k);
                                shared.store.remove_keys(&[k]) == 1
                            })
                            .collect()
                    } else {
                        // A node's store is embedded; the hint marks its engine's objects.
                        shared
                            .store
                            .with_engine(|engine| {
                                batch.keys.iter().map(|k| engine.demote(k)).collect()
                            })
                            .unwrap_or_else(|| vec![false; batch.keys.len()])
                    };
                    let reply = WireResult { ok, errors: vec![] };
                    let mut frame = Vec::new();
                    encode_frame(&mut frame, op, id, FLAG_RESPONSE, &reply)
                        .map_err(io::Error::other)?;
                    replies.queue(Reply::Frame(frame))?;
                }
                Err(e) => replies.error(header.opcode, id, error_code::MALFORMED, e.to_string())?,
            },
            Ok(Opcode::Ping) => replies.ok(Opcode::Ping, id)?,
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
