//! The peer data port of a cluster node (`kvtier serve --master ... --data-addr HOST:PORT`):
//! cluster clients on any host put and get objects of this node's store over TCP.
//!
//! - Authentication: the first frame must be `PeerHello` with the cluster token (compared in
//!   constant time). Anything else is answered `UNAUTHORIZED`, logged with the peer's address,
//!   and the connection is closed; nothing is served before.
//! - One thread per connection (clients keep a few pooled connections per node, like the
//!   Unix-socket server); requests are answered in order, so clients may pipeline.
//! - Puts are put-if-absent in the node's store. Every key stored through this port is
//!   remembered in [`HeldKeys`], which the node agent reports to the master when it
//!   (re-)registers and checks against the store to report evictions.
//! - A frame that loses stream sync closes the connection; a bad body gets an error reply.

use std::collections::HashSet;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

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

fn send_error(
    stream: &mut TcpStream,
    opcode: u16,
    request_id: u64,
    code: u16,
    message: String,
) -> io::Result<()> {
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
    stream.write_all(&frame)
}

fn send_ok(stream: &mut TcpStream, opcode: Opcode, request_id: u64, body: &[u8]) -> io::Result<()> {
    let header = FrameHeader::new(opcode, request_id, FLAG_RESPONSE, body.len() as u32).encode();
    if body.len() <= 64 << 10 {
        let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
        frame.extend_from_slice(&header);
        frame.extend_from_slice(body);
        stream.write_all(&frame)
    } else {
        stream.write_all(&header)?;
        stream.write_all(body)
    }
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
            send_ok(&mut stream, Opcode::PeerHello, header.request_id, &[])?;
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
    let mut out = Vec::new();
    loop {
        let header =
            match read_frame_limited(&mut stream, &mut body, kvtier_proto::frame::MAX_FRAME_BODY) {
                Ok(h) => h,
                Err(ProtoError::ConnectionClosed) => return Ok(()),
                Err(e) => return Err(proto_io(e)),
            };
        if shared.stopping.load(Ordering::Relaxed) {
            return Ok(());
        }
        let id = header.request_id;
        match header.opcode() {
            Ok(Opcode::PeerPut) => match PeerPutMeta::split_body(&body) {
                Ok((meta, value)) => match shared.store.put_slice(&meta.key, value, meta.depth) {
                    Ok(_) => {
                        shared.held.insert(&meta.key);
                        shared.counters.puts.fetch_add(1, Ordering::Relaxed);
                        shared
                            .counters
                            .bytes_in
                            .fetch_add(value.len() as u64, Ordering::Relaxed);
                        send_ok(&mut stream, Opcode::PeerPut, id, &[])?;
                    }
                    Err(e) => send_error(
                        &mut stream,
                        header.opcode,
                        id,
                        peer_error_code::STORE,
                        e.to_string(),
                    )?,
                },
                Err(e) => send_error(
                    &mut stream,
                    header.opcode,
                    id,
                    error_code::MALFORMED,
                    e.to_string(),
                )?,
            },
            Ok(Opcode::PeerGet) => match PeerGet::decode(&body) {
                Ok(get) => match shared.store.object_len(&get.key) {
                    None => {
                        shared.counters.misses.fetch_add(1, Ordering::Relaxed);
                        send_error(
                            &mut stream,
                            header.opcode,
                            id,
                            peer_error_code::NOT_FOUND,
                            "not found".into(),
                        )?
                    }
                    Some(len) if len != get.expected_len => send_error(
                        &mut stream,
                        header.opcode,
                        id,
                        peer_error_code::SIZE_MISMATCH,
                        format!("stored {len} bytes, buffer has {}", get.expected_len),
                    )?,
                    Some(len) => {
                        out.resize(len as usize, 0);
                        match shared.store.get_into_slice(&get.key, &mut out) {
                            Ok(()) => {
                                shared.counters.gets.fetch_add(1, Ordering::Relaxed);
                                shared.counters.bytes_out.fetch_add(len, Ordering::Relaxed);
                                send_ok(&mut stream, Opcode::PeerGet, id, &out)?;
                            }
                            // Evicted between the length check and the copy.
                            Err(_) => {
                                shared.counters.misses.fetch_add(1, Ordering::Relaxed);
                                send_error(
                                    &mut stream,
                                    header.opcode,
                                    id,
                                    peer_error_code::NOT_FOUND,
                                    "not found".into(),
                                )?
                            }
                        }
                    }
                },
                Err(e) => send_error(
                    &mut stream,
                    header.opcode,
                    id,
                    error_code::MALFORMED,
                    e.to_string(),
                )?,
            },
            Ok(Opcode::PeerRemove) => match KeyBatch::decode(&body) {
                Ok(batch) => {
                    let ok: Vec<bool> = batch
                        .keys
                        .iter()
                        .map(|k| {
                            shared.held.remove(k);
                            shared.store.remove_keys(&[k]) == 1
                        })
                        .collect();
                    let reply = WireResult { ok, errors: vec![] };
                    let mut frame = Vec::new();
                    encode_frame(&mut frame, Opcode::PeerRemove, id, FLAG_RESPONSE, &reply)
                        .map_err(io::Error::other)?;
                    stream.write_all(&frame)?;
                }
                Err(e) => send_error(
                    &mut stream,
                    header.opcode,
                    id,
                    error_code::MALFORMED,
                    e.to_string(),
                )?,
            },
            Ok(Opcode::Ping) => send_ok(&mut stream, Opcode::Ping, id, &[])?,
            _ => send_error(
                &mut stream,
                header.opcode,
                id,
                error_code::UNSUPPORTED,
                format!("opcode {} is not served on the data port", header.opcode),
            )?,
        }
        // Release a huge body's memory rather than keep it per connection.
        if body.capacity() > 8 << 20 {
            body = Vec::new();
        }
        if out.capacity() > 8 << 20 {
            out = Vec::new();
        }
    }
}
