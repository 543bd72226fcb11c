//! The publisher of a KV-event stream: the replay ring of the last batches, the two TCP
//! endpoints ([`crate::zmtp`]) and the snapshot of what the stream has published as held.
//!
//! Owns: a PUB socket sending `[topic, 8-byte big-endian sequence, msgpack batch]` to every
//! SUB whose subscription prefixes the topic, and a ROUTER replay socket that answers
//! `[empty, 8-byte start sequence]` with every buffered batch from that sequence as
//! `[empty, topic, seq, batch]`, then the end marker `[empty, empty, -1 (8 bytes), empty]`,
//! exactly as vLLM's `ZmqEventPublisher` does; and the **snapshot** request `[empty,
//! "SNAPSHOT", prefix]`, answered with one batch `[empty, topic, seq, batch]` holding
//! `AllBlocksCleared` and a `BlockStored` for every held block in the prefix's scope (what
//! [`HeldSet::snapshot`] returns), then the end marker; `seq` is the last batch the snapshot
//! includes. What is "held" belongs to the stream's owner (the host stream's store groups,
//! the cluster stream's directory blocks): it changes only inside [`Stream::update`], under
//! the same lock as the sequence, so a snapshot is exactly "batches 0..=seq".
//!
//! Bounded everywhere a peer could make the process hold something: at most
//! `max_subscribers` connections per endpoint (more are closed at once and counted), a
//! handshake within 5 s, frames from peers of at most 1 KiB, at most 64 subscriptions per
//! subscriber, `subscriber_queue` batches queued per subscriber (a subscriber that falls
//! further behind loses batches, counted; it sees the gap in the sequence and replays),
//! writes that block 5 s close the subscriber, and the ring keeps `buffer_batches` batches.

use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde_json::{json, Map, Value};

use crate::encode::{self, Event, Holder};
use crate::zmtp;

/// The end-of-replay sequence (`-1` as 8 big-endian bytes).
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();
/// The verb of a snapshot request (see the module doc).
pub const SNAPSHOT: &[u8] = b"SNAPSHOT";
/// A peer has this long to finish the ZMTP handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// A write to a subscriber blocked this long closes it.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest frame a peer may send (subscriptions, replay requests).
const MAX_PEER_FRAME: usize = 1024;
/// Most frames in one message from a peer.
const MAX_PEER_PARTS: usize = 4;
/// Most subscriptions one subscriber may hold.
const MAX_SUBSCRIPTIONS: usize = 64;
/// How often blocked threads look at the stop flag.
pub const TICK: Duration = Duration::from_millis(50);

/// Why the stream could not start.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error("{key} {addr}: cannot bind: {source}")]
    Bind {
        key: &'static str,
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("KV events: {0}")]
    Io(#[from] io::Error),
}

/// Upper bounds of a stream's settings, checked where each producer's settings are read
/// (`kvtier serve`'s `host_events_*`, `kvtier master --events-*`).
pub const MAX_BUFFER_BATCHES: u64 = 1 << 20;
pub const MAX_SUBSCRIBERS: u64 = 4096;
pub const MAX_SUBSCRIBER_QUEUE: u64 = 1 << 20;

/// The publisher's settings.
#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// Who publishes, for logs (`kvtier serve`, `kvtier master`).
    pub name: &'static str,
    /// The setting names of the two endpoints, for errors.
    pub endpoint_key: &'static str,
    pub replay_key: &'static str,
    pub endpoint: SocketAddr,
    pub replay_endpoint: Option<SocketAddr>,
    pub topic: String,
    pub buffer_batches: usize,
    pub max_subscribers: usize,
    pub subscriber_queue: usize,
}

/// A stream endpoint setting that cannot be bound as given; names the setting and its value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("`{key}` {value:?} is not tcp://IP:PORT")]
    NotTcp { key: String, value: String },
    /// A host name (or anything but an IP literal and a port): nothing is resolved, so
    /// nothing listens on an interface the operator did not name.
    #[error(
        "`{key}` {value:?} is not tcp://IP:PORT with an IP address literal (e.g. tcp://127.0.0.1:5557)"
    )]
    NotIpLiteral { key: String, value: String },
}

/// Parse `tcp://IP:PORT` (an IP literal; port 0 picks a free one). `key` names the setting.
pub fn parse_endpoint(key: &str, text: &str) -> Result<SocketAddr, EndpointError> {
    let named = || (key.to_string(), text.to_string());
    let Some(rest) = text.strip_prefix("tcp://") else {
        let (key, value) = named();
        return Err(EndpointError::NotTcp { key, value });
    };
    rest.parse::<SocketAddr>().map_err(|_| {
        let (key, value) = named();
        EndpointError::NotIpLiteral { key, value }
    })
}

/// What a stream has published as held, owned by the stream's producer.
pub trait HeldSet: Send + 'static {
    /// Every held block whose scope starts with `prefix`, once per holder (ownership and
    /// medium) it is published under.
    fn snapshot(&self, prefix: &[u8]) -> Vec<(Holder, encode::Mapped)>;
}

/// One event of a batch with the holder (ownership, medium) it names.
pub type Owned = (Holder, Event);

#[derive(Default)]
struct Counters {
    published_batches: AtomicU64,
    published_stored: AtomicU64,
    published_removed: AtomicU64,
    published_cleared: AtomicU64,
    unmapped: AtomicU64,
    subscribers_total: AtomicU64,
    refused: AtomicU64,
    bad_peers: AtomicU64,
    subscriber_drops: AtomicU64,
    replays: AtomicU64,
    snapshots: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// A published batch (shared by the ring and every subscriber queue).
struct Published {
    seq: u64,
    payload: Vec<u8>,
}

struct Subscriber {
    id: u64,
    queue: SyncSender<Arc<Published>>,
}

struct Held<H> {
    set: H,
    /// Sequence of the last batch published (`None` before the first).
    last_seq: Option<u64>,
}

struct Inner<H> {
    config: StreamConfig,
    /// Updated with the sequence under one lock, so a snapshot is exactly "batches 0..=seq".
    held: Mutex<Held<H>>,
    stop: AtomicBool,
    ring: Mutex<VecDeque<Arc<Published>>>,
    subscribers: Mutex<Vec<Subscriber>>,
    next_sub: AtomicU64,
    open_subscribers: AtomicUsize,
    open_replays: AtomicUsize,
    next_seq: AtomicU64,
    counters: Counters,
}

/// The running stream (see the module doc). [`Stream::stop`] ends its threads.
pub struct Stream<H: HeldSet> {
    inner: Arc<Inner<H>>,
    endpoint: SocketAddr,
    replay_endpoint: Option<SocketAddr>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn bind(key: &'static str, addr: SocketAddr) -> Result<TcpListener, EventsError> {
    let l = TcpListener::bind(addr).map_err(|source| EventsError::Bind { key, addr, source })?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// A named thread.
pub fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name.into()).spawn(f)
}

impl<H: HeldSet> Stream<H> {
    /// Bind the endpoints and accept subscribers; nothing is published before the first
    /// [`Stream::update`] that returns events.
    pub fn start(config: StreamConfig, set: H) -> Result<Stream<H>, EventsError> {
        let pub_listener = bind(config.endpoint_key, config.endpoint)?;
        let endpoint = pub_listener.local_addr()?;
        let replay = match config.replay_endpoint {
            Some(addr) => Some(bind(config.replay_key, addr)?),
            None => None,
        };
        let replay_endpoint = replay.as_ref().map(TcpListener::local_addr).transpose()?;
        let inner = Arc::new(Inner {
            config,
            held: Mutex::new(Held {
                set,
                last_seq: None,
            }),
            stop: AtomicBool::new(false),
            ring: Mutex::new(VecDeque::new()),
            subscribers: Mutex::new(Vec::new()),
            next_sub: AtomicU64::new(0),
            open_subscribers: AtomicUsize::new(0),
            open_replays: AtomicUsize::new(0),
            next_seq: AtomicU64::new(0),
            counters: Counters::default(),
        });
        let mut threads = Vec::new();
        let i = Arc::clone(&inner);
        threads.push(spawn("kvtier-events-pub", move || {
            accept_loop(&i, &pub_listener, true)
        })?);
        if let Some(listener) = replay {
            let i = Arc::clone(&inner);
            threads.push(spawn("kvtier-events-replay", move || {
                accept_loop(&i, &listener, false)
            })?);
        }
        tracing::info!(
            "{}: KV events on tcp://{endpoint}{}",
            inner.config.name,
            replay_endpoint.map_or(String::new(), |a| format!(", replay on tcp://{a}"))
        );
        Ok(Stream {
            inner,
            endpoint,
            replay_endpoint,
            threads: Mutex::new(threads),
        })
    }

    /// The bound PUB address.
    pub fn endpoint(&self) -> SocketAddr {
        self.endpoint
    }

    /// The bound replay address.
    pub fn replay_endpoint(&self) -> Option<SocketAddr> {
        self.replay_endpoint
    }

    /// Whether [`Stream::stop`] was asked.
    pub fn stopping(&self) -> bool {
        self.inner.stop.load(Ordering::SeqCst)
    }

    /// Change the held set and publish the events `f` returns as one batch (none when empty),
    /// both under the held set's lock: a snapshot sees the set and the sequence move together.
    pub fn update<R>(&self, f: impl FnOnce(&mut H) -> (Vec<Owned>, R)) -> R {
        let mut held = self.inner.held.lock();
        let (events, result) = f(&mut held.set);
        if events.is_empty() {
            return result;
        }
        let c = &self.inner.counters;
        for (_, e) in &events {
            match e {
                Event::Stored(b) => add(&c.published_stored, b.len() as u64),
                Event::Removed(b) => add(&c.published_removed, b.len() as u64),
                Event::Cleared => add(&c.published_cleared, 1),
            }
        }
        let owned: Vec<(&Holder, &Event)> = events.iter().map(|(h, e)| (h, e)).collect();
        let payload = encode::encode_owned(now_ts(), &owned);
        let seq = self.inner.next_seq.fetch_add(1, Ordering::SeqCst);
        held.last_seq = Some(seq);
        // Still under the lock: concurrent updates reach the ring and queues in order.
        send(&self.inner, Arc::new(Published { seq, payload }));
        drop(held);
        result
    }

    /// Count `n` keys no engine event names (never published).
    pub fn count_unmapped(&self, n: u64) {
        add(&self.inner.counters.unmapped, n);
    }

    /// The stream's counters (a JSON object the owner adds its own to).
    pub fn stats(&self) -> Map<String, Value> {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let v = json!({
            "endpoint": format!("tcp://{}", self.endpoint),
            "replay_endpoint": self.replay_endpoint.map(|a| format!("tcp://{a}")),
            "next_seq": self.inner.next_seq.load(Ordering::Relaxed),
            "buffered_batches": self.inner.ring.lock().len(),
            "published_batches": get(&c.published_batches),
            "published_stored": get(&c.published_stored),
            "published_removed": get(&c.published_removed),
            "published_cleared": get(&c.published_cleared),
            "unmapped": get(&c.unmapped),
            "subscribers": self.inner.open_subscribers.load(Ordering::Relaxed),
            "subscribers_total": get(&c.subscribers_total),
            "refused": get(&c.refused),
            "bad_peers": get(&c.bad_peers),
            "subscriber_drops": get(&c.subscriber_drops),
            "replays": get(&c.replays),
            "snapshots": get(&c.snapshots),
        });
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    /// Ask the threads to stop (they see it within one tick).
    pub fn request_stop(&self) {
        self.inner.stop.store(true, Ordering::SeqCst);
    }

    /// Stop every thread, close every connection (each sees the stop within one tick).
    pub fn stop(&self) {
        self.request_stop();
        let threads: Vec<JoinHandle<()>> = self.threads.lock().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }
}

impl<H: HeldSet> Drop for Stream<H> {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
    }
}

/// Seconds since the epoch (a batch's `ts`).
pub fn now_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Put a batch into the ring and every subscriber's queue.
fn send<H>(inner: &Inner<H>, batch: Arc<Published>) {
    {
        let mut ring = inner.ring.lock();
        if ring.len() >= inner.config.buffer_batches {
            ring.pop_front();
        }
        ring.push_back(Arc::clone(&batch));
    }
    add(&inner.counters.published_batches, 1);
    let mut subs = inner.subscribers.lock();
    subs.retain(|s| match s.queue.try_send(Arc::clone(&batch)) {
        Ok(()) => true,
        Err(TrySendError::Full(_)) => {
            add(&inner.counters.subscriber_drops, 1);
            true
        }
        Err(TrySendError::Disconnected(_)) => false,
    });
}

// ------------------------------------------------------------------ connections

fn accept_loop<H: HeldSet>(inner: &Arc<Inner<H>>, listener: &TcpListener, publisher: bool) {
    let open = if publisher {
        &inner.open_subscribers
    } else {
        &inner.open_replays
    };
    while !inner.stop.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(TICK);
                continue;
            }
            Err(e) => {
                tracing::warn!("{}: KV events accept failed: {e}", inner.config.name);
                std::thread::sleep(TICK);
                continue;
            }
        };
        // Reserve a slot before anything else: a peer beyond the bound is closed at once.
        if open.fetch_add(1, Ordering::SeqCst) >= inner.config.max_subscribers {
            open.fetch_sub(1, Ordering::SeqCst);
            add(&inner.counters.refused, 1);
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        }
        let i = Arc::clone(inner);
        let name = if publisher {
            "kvtier-events-sub"
        } else {
            "kvtier-events-rep"
        };
        let spawned = spawn(name, move || {
            let result = if publisher {
                serve_subscriber(&i, stream)
            } else {
                serve_replay(&i, stream)
            };
            if let Err(e) = result {
                add(&i.counters.bad_peers, 1);
                tracing::debug!("{}: KV events peer closed: {e}", i.config.name);
            }
            let open = if publisher {
                &i.open_subscribers
            } else {
                &i.open_replays
            };
            open.fetch_sub(1, Ordering::SeqCst);
        });
        if spawned.is_err() {
            open.fetch_sub(1, Ordering::SeqCst);
            add(&inner.counters.refused, 1);
        }
    }
}

fn setup(stream: &TcpStream) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))
}

/// Read one message (at most [`MAX_PEER_PARTS`] frames); commands come back as one frame.
fn read_message(s: &mut TcpStream) -> Result<Vec<zmtp::Frame>, zmtp::ZmtpError> {
    let mut parts = Vec::new();
    loop {
        let f = zmtp::read_frame(s, MAX_PEER_FRAME)?;
        let more = f.more && !f.command;
        parts.push(f);
        if !more {
            return Ok(parts);
        }
        if parts.len() >= MAX_PEER_PARTS {
            return Err(zmtp::ZmtpError::Protocol(format!(
                "a message of more than {MAX_PEER_PARTS} frames"
            )));
        }
    }
}

/// Wait up to [`TICK`] for a peer's next message: `Ok(true)` when a byte is there (the
/// message is then read with [`HANDSHAKE_TIMEOUT`]: a peer that stops mid-message is closed,
/// never left half-read), `Ok(false)` on a quiet tick, an error at EOF.
fn next_message_ready(s: &TcpStream) -> io::Result<bool> {
    s.set_read_timeout(Some(TICK))?;
    let mut b = [0u8; 1];
    let ready = match s.peek(&mut b) {
        Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
        Ok(_) => true,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            false
        }
        Err(e) => return Err(e),
    };
    s.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    Ok(ready)
}

/// One SUB peer: handshake, then a reader thread applying its subscriptions and this thread
/// writing the batches its queue receives.
fn serve_subscriber<H: HeldSet>(
    inner: &Arc<Inner<H>>,
    mut stream: TcpStream,
) -> Result<(), zmtp::ZmtpError> {
    setup(&stream)?;
    zmtp::handshake(&mut stream, "PUB", &["SUB", "XSUB"])?;
    add(&inner.counters.subscribers_total, 1);
    let subscriptions: Arc<Mutex<Vec<Vec<u8>>>> = Arc::new(Mutex::new(Vec::new()));
    let closed = Arc::new(AtomicBool::new(false));
    let (tx, rx) = sync_channel(inner.config.subscriber_queue);
    let id = inner.next_sub.fetch_add(1, Ordering::Relaxed);
    inner.subscribers.lock().push(Subscriber { id, queue: tx });
    let reader = {
        let mut rs = stream.try_clone()?;
        let subs = Arc::clone(&subscriptions);
        let closed = Arc::clone(&closed);
        let i = Arc::clone(inner);
        spawn("kvtier-events-sub-read", move || {
            read_subscriptions(&i, &mut rs, &subs, &closed)
        })?
    };
    let result = write_batches(inner, &mut stream, &rx, &subscriptions, &closed);
    closed.store(true, Ordering::SeqCst);
    inner.subscribers.lock().retain(|s| s.id != id);
    let _ = stream.shutdown(Shutdown::Both);
    let _ = reader.join();
    result
}

fn read_subscriptions<H: HeldSet>(
    inner: &Inner<H>,
    s: &mut TcpStream,
    subs: &Mutex<Vec<Vec<u8>>>,
    closed: &AtomicBool,
) {
    while !closed.load(Ordering::SeqCst) && !inner.stop.load(Ordering::SeqCst) {
        match next_message_ready(s) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(_) => break,
        }
        let parts = match read_message(s) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!("{}: KV events subscriber: {e}", inner.config.name);
                break;
            }
        };
        let Some(first) = parts.first() else { continue };
        let (subscribe, topic) = if first.command {
            match zmtp::parse_command(&first.body) {
                Ok((b"SUBSCRIBE", t)) => (true, t.to_vec()),
                Ok((b"CANCEL", t)) => (false, t.to_vec()),
                _ => continue, // PING and the like: nothing to do
            }
        } else {
            match first.body.split_first() {
                Some((1, t)) => (true, t.to_vec()),
                Some((0, t)) => (false, t.to_vec()),
                _ => continue, // XSUB's other messages: ignored
            }
        };
        let mut list = subs.lock();
        if subscribe {
            if list.len() >= MAX_SUBSCRIPTIONS {
                tracing::debug!(
                    "{}: KV events subscriber over {MAX_SUBSCRIPTIONS} subscriptions: closed",
                    inner.config.name
                );
                break;
            }
            list.push(topic);
        } else if let Some(at) = list.iter().position(|t| *t == topic) {
            list.remove(at);
        }
    }
    closed.store(true, Ordering::SeqCst);
    let _ = s.shutdown(Shutdown::Both);
}

fn write_batches<H: HeldSet>(
    inner: &Inner<H>,
    s: &mut TcpStream,
    rx: &Receiver<Arc<Published>>,
    subs: &Mutex<Vec<Vec<u8>>>,
    closed: &AtomicBool,
) -> Result<(), zmtp::ZmtpError> {
    let topic = inner.config.topic.as_bytes();
    while !closed.load(Ordering::SeqCst) {
        let batch = match rx.recv_timeout(TICK) {
            Ok(b) => b,
            Err(RecvTimeoutError::Timeout) => {
                if inner.stop.load(Ordering::SeqCst) {
                    return Ok(());
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return Ok(()),
        };
        if !subs.lock().iter().any(|p| topic.starts_with(p)) {
            continue;
        }
        let seq = batch.seq.to_be_bytes();
        zmtp::write_message(s, &[topic, &seq, &batch.payload])?;
    }
    Ok(())
}

/// Answer a snapshot request: one batch (cleared, then every held block under `prefix`) named
/// by the last sequence it includes, then the end marker; no batch before the first one.
fn send_snapshot<H: HeldSet>(inner: &Inner<H>, s: &mut TcpStream, prefix: &[u8]) -> io::Result<()> {
    let topic = inner.config.topic.as_bytes();
    let (blocks, last) = {
        let held = inner.held.lock();
        (held.set.snapshot(prefix), held.last_seq)
    };
    add(&inner.counters.snapshots, 1);
    if let Some(seq) = last {
        let payload = snapshot_batch(blocks);
        let seq = seq.to_be_bytes();
        s.write_all(&zmtp::encode_message(&[b"", topic, &seq, &payload]))?;
    }
    zmtp::write_message(s, &[b"", b"", &END_SEQ, b""])
}

/// `AllBlocksCleared`, then the blocks as `BlockStored` events, one per run of one holder
/// and KV group (vLLM's `group_idx`), in a stable order.
fn snapshot_batch(mut blocks: Vec<(Holder, encode::Mapped)>) -> Vec<u8> {
    blocks.sort_by(|a, b| {
        (&a.0, a.1.group_idx, hash_order(a.1.hash)).cmp(&(
            &b.0,
            b.1.group_idx,
            hash_order(b.1.hash),
        ))
    });
    let cleared = Event::Cleared;
    let nobody = Holder::new("".into(), None);
    let mut events: Vec<(Holder, Event)> = Vec::new();
    for (holder, m) in blocks {
        match events.last_mut() {
            Some((h, Event::Stored(v))) if *h == holder => v.push(m),
            _ => events.push((holder, Event::Stored(vec![m]))),
        }
    }
    let mut owned: Vec<(&Holder, &Event)> = vec![(&nobody, &cleared)];
    owned.extend(events.iter().map(|(h, e)| (h, e)));
    encode::encode_owned(now_ts(), &owned)
}

fn hash_order(h: encode::BlockHash) -> (u8, u64) {
    match h {
        encode::BlockHash::Unsigned(v) => (0, v),
        encode::BlockHash::Signed(v) => (1, v as u64),
    }
}

/// One replay peer (DEALER / REQ): each request `[empty, start]` gets the buffered batches
/// from `start` and the end marker.
fn serve_replay<H: HeldSet>(
    inner: &Inner<H>,
    mut stream: TcpStream,
) -> Result<(), zmtp::ZmtpError> {
    setup(&stream)?;
    zmtp::handshake(&mut stream, "ROUTER", &["DEALER", "REQ"])?;
    let topic = inner.config.topic.as_bytes();
    while !inner.stop.load(Ordering::SeqCst) {
        match next_message_ready(&stream) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let parts = read_message(&mut stream)?;
        if parts.first().is_some_and(|f| f.command) {
            continue; // PING and the like
        }
        if let [empty, verb, prefix] = &parts[..] {
            if empty.body.is_empty() && verb.body == SNAPSHOT {
                send_snapshot(inner, &mut stream, &prefix.body)?;
                continue;
            }
        }
        let start: [u8; 8] = match &parts[..] {
            [empty, start] if empty.body.is_empty() => match start.body[..].try_into() {
                Ok(b) => b,
                Err(_) => continue, // as vLLM: an invalid request is ignored
            },
            _ => continue,
        };
        let start = u64::from_be_bytes(start);
        add(&inner.counters.replays, 1);
        let batches: Vec<Arc<Published>> = inner
            .ring
            .lock()
            .iter()
            .filter(|b| b.seq >= start)
            .cloned()
            .collect();
        for b in batches {
            let seq = b.seq.to_be_bytes();
            stream.write_all(&zmtp::encode_message(&[b"", topic, &seq, &b.payload]))?;
        }
        zmtp::write_message(&mut stream, &[b"", b"", &END_SEQ, b""])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::{BlockHash, Mapped};

    fn count(hay: &[u8], needle: &[u8]) -> usize {
        hay.windows(needle.len()).filter(|w| *w == needle).count()
    }

    #[test]
    fn endpoints_are_tcp_ip_literals_and_errors_name_key_and_value() {
        assert_eq!(
            parse_endpoint("k", "tcp://127.0.0.1:0").unwrap(),
            "127.0.0.1:0".parse::<SocketAddr>().unwrap()
        );
        let e = parse_endpoint("host_events_endpoint", "127.0.0.1:5557").unwrap_err();
        assert!(matches!(e, EndpointError::NotTcp { .. }));
        let e = parse_endpoint("--events-endpoint", "tcp://localhost:5557").unwrap_err();
        assert_eq!(
            e,
            EndpointError::NotIpLiteral {
                key: "--events-endpoint".into(),
                value: "tcp://localhost:5557".into()
            }
        );
        let text = e.to_string();
        assert!(text.contains("--events-endpoint") && text.contains("localhost:5557"));
    }

    #[test]
    fn a_snapshot_is_a_reset_then_one_event_per_owner_and_group() {
        let m = |v, g| Mapped {
            hash: BlockHash::Unsigned(v),
            group_idx: Some(g),
        };
        let (a, b) = (
            Holder::new("kvtier:a".into(), Some(encode::Medium::Dram)),
            Holder::new("kvtier:a,b".into(), Some(encode::Medium::Dram)),
        );
        let blocks = vec![
            (b.clone(), m(3, 0)),
            (a.clone(), m(2, 1)),
            (a.clone(), m(1, 0)),
            (a.clone(), m(4, 0)),
        ];
        let batch = snapshot_batch(blocks);
        // [ts, [cleared, a/g0 (1, 4), a/g1 (2), a,b/g0 (3)]]
        assert_eq!(&batch[..2], &[0x92, 0xcb]);
        assert_eq!(batch[10], 0x94, "four events");
        assert_eq!(count(&batch, b"AllBlocksCleared"), 1);
        assert_eq!(count(&batch, b"BlockStored"), 3);
        assert_eq!(count(&batch, b"kvtier:a,b"), 1);
        assert_eq!(count(&batch, b"kvtier:a"), 3);
    }
}
