//! The host KV-event stream of `kvtier serve` (issue 30): what this host's stores hold, in
//! vLLM's KV-event wire protocol, for cache-aware routers.
//!
//! Owns: the producer thread that drains every store's engine event ring and publishes one
//! `KVEventBatch` per round ([`encode`]), the replay ring of the last batches, and the two TCP
//! endpoints ([`zmtp`]): a PUB socket sending `[topic, 8-byte big-endian sequence, msgpack
//! batch]` to every SUB whose subscription prefixes the topic, and a ROUTER replay socket that
//! answers `[empty, 8-byte start sequence]` with every buffered batch from that sequence as
//! `[empty, topic, seq, batch]`, then the end marker `[empty, empty, -1 (8 bytes), empty]`,
//! exactly as vLLM's `ZmqEventPublisher` does.
//!
//! **Snapshots for late joiners**: the replay socket also answers `[empty, "SNAPSHOT",
//! prefix]` with one batch `[empty, topic, seq, batch]` holding `AllBlocksCleared` and then a
//! `BlockStored` for every block the stream has published as held (and not removed since)
//! whose engine key starts with `prefix` (e.g. a vLLM namespace `vllm/<model>_<digest>/` or an
//! SGLang tag `tag/`; empty: everything), then the end marker. `seq` is the last batch the
//! snapshot includes: the router applies the snapshot, then live batches above `seq`
//! (replaying any it missed), instead of replaying from 0. vLLM's own publisher ignores such a
//! request (it is not a 3-frame replay request), so routers can tell the two apart.
//!
//! Off unless the operator names `host_events_endpoint` (an IP literal: nothing listens on an
//! interface the operator did not name). Bounded everywhere a peer could make the server hold
//! something: at most `host_events_max_subscribers` connections per endpoint (more are closed
//! at once and counted), a handshake within 5 s, frames from peers of at most 1 KiB, at most
//! 64 subscriptions per subscriber, `host_events_subscriber_queue` batches queued per
//! subscriber (a subscriber that falls further behind loses batches, counted; it sees the
//! gap in the sequence and replays), writes that block 5 s close the subscriber, and the
//! replay ring keeps `host_events_buffer_batches` batches.
//!
//! Sequence numbers start at 0 with each process and increase by one per batch; a restarted
//! server starts again at 0 (its stores are new too: a router that sees a sequence go back
//! drops what it credited to this stream). Events the engine ring dropped before the producer
//! took them (`engine_dropped`) are lost from the stream: the ring is sized so that it does
//! not happen at the drain interval; the counter says when it did.

pub mod encode;
pub mod zmtp;

use std::collections::VecDeque;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvtier_engine::eviction::events::EventKind;
use parking_lot::Mutex;
use serde_json::{json, Value};

use crate::server::TenantStore;
use encode::Event;

/// The end-of-replay sequence (`-1` as 8 big-endian bytes).
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();
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
/// Engine events taken per drain call.
const DRAIN_BATCH: usize = 4096;
/// How often blocked threads look at the stop flag.
const TICK: Duration = Duration::from_millis(50);

/// Why the stream could not start.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error("host_events_endpoint {addr}: cannot bind: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("host events: {0}")]
    Io(#[from] io::Error),
}

/// The stream's settings (validated from the `host_events_*` server keys).
#[derive(Clone, Debug)]
pub struct EventsConfig {
    pub endpoint: SocketAddr,
    pub replay_endpoint: Option<SocketAddr>,
    pub topic: String,
    pub buffer_batches: usize,
    pub max_subscribers: usize,
    pub subscriber_queue: usize,
    pub interval: Duration,
    /// Capacity of each engine's event ring.
    pub engine_ring: usize,
    /// `ownership` of every event: `kvtier:<node>`.
    pub ownership: String,
}

/// Parse `tcp://IP:PORT` (an IP literal; port 0 picks a free one). `key` names the setting.
pub fn parse_endpoint(key: &str, text: &str) -> Result<SocketAddr, String> {
    let rest = text
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("`{key}` {text:?} is not tcp://IP:PORT"))?;
    rest.parse::<SocketAddr>().map_err(|_| {
        format!("`{key}` {text:?} is not tcp://IP:PORT with an IP address literal (e.g. tcp://127.0.0.1:5557)")
    })
}

#[derive(Default)]
struct Counters {
    published_batches: AtomicU64,
    published_stored: AtomicU64,
    published_removed: AtomicU64,
    published_cleared: AtomicU64,
    unmapped: AtomicU64,
    engine_dropped: AtomicU64,
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

/// What the stream has published as held: each stored group (with its store namespace, so
/// one page held by two tenants is two entries, as on the live stream) -> its name on the
/// stream, and the last batch applied.
#[derive(Default)]
struct Held {
    groups: std::collections::HashMap<Box<[u8]>, encode::Mapped>,
    /// Sequence of the last batch applied (`None` before the first).
    last_seq: Option<u64>,
}

struct Inner {
    config: EventsConfig,
    /// Updated with the sequence under one lock, so a snapshot is exactly "batches 0..=seq".
    held: Mutex<Held>,
    stop: AtomicBool,
    ring: Mutex<VecDeque<Arc<Published>>>,
    subscribers: Mutex<Vec<Subscriber>>,
    next_sub: AtomicU64,
    open_subscribers: AtomicUsize,
    open_replays: AtomicUsize,
    next_seq: AtomicU64,
    counters: Counters,
}

/// The running stream (see the module doc). [`HostEvents::stop`] ends its threads.
pub struct HostEvents {
    inner: Arc<Inner>,
    endpoint: SocketAddr,
    replay_endpoint: Option<SocketAddr>,
    threads: Vec<JoinHandle<()>>,
}

fn bind(addr: SocketAddr) -> Result<TcpListener, EventsError> {
    let l = TcpListener::bind(addr).map_err(|source| EventsError::Bind { addr, source })?;
    l.set_nonblocking(true)?;
    Ok(l)
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name.into()).spawn(f)
}

impl HostEvents {
    /// Bind the endpoints, turn on the engines' event rings and start publishing.
    pub fn start(
        config: EventsConfig,
        stores: Vec<Arc<TenantStore>>,
    ) -> Result<HostEvents, EventsError> {
        let pub_listener = bind(config.endpoint)?;
        let endpoint = pub_listener.local_addr()?;
        let replay = match config.replay_endpoint {
            Some(addr) => Some(bind(addr)?),
            None => None,
        };
        let replay_endpoint = replay.as_ref().map(TcpListener::local_addr).transpose()?;
        for store in &stores {
            store.with_engine(|e| e.enable_events(config.engine_ring));
        }
        let inner = Arc::new(Inner {
            config,
            held: Mutex::new(Held::default()),
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
        threads.push(spawn("kvtier-events", move || produce(&i, &stores))?);
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
            "kvtier serve: KV events on tcp://{endpoint}{}",
            replay_endpoint.map_or(String::new(), |a| format!(", replay on tcp://{a}"))
        );
        Ok(HostEvents {
            inner,
            endpoint,
            replay_endpoint,
            threads,
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

    /// The `host_events` object of the stats document.
    pub fn stats(&self) -> Value {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        json!({
            "endpoint": format!("tcp://{}", self.endpoint),
            "replay_endpoint": self.replay_endpoint.map(|a| format!("tcp://{a}")),
            "next_seq": self.inner.next_seq.load(Ordering::Relaxed),
            "buffered_batches": self.inner.ring.lock().len(),
            "published_batches": get(&c.published_batches),
            "published_stored": get(&c.published_stored),
            "published_removed": get(&c.published_removed),
            "published_cleared": get(&c.published_cleared),
            "unmapped": get(&c.unmapped),
            "engine_dropped": get(&c.engine_dropped),
            "subscribers": self.inner.open_subscribers.load(Ordering::Relaxed),
            "subscribers_total": get(&c.subscribers_total),
            "refused": get(&c.refused),
            "bad_peers": get(&c.bad_peers),
            "subscriber_drops": get(&c.subscriber_drops),
            "replays": get(&c.replays),
            "snapshots": get(&c.snapshots),
        })
    }

    /// Publish what the engines still hold, stop every thread, close every connection.
    pub fn stop(mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for HostEvents {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
    }
}

// ------------------------------------------------------------------ producer

/// Append `blocks` of one kind to `out`, merging with the last event of the same kind.
fn push(out: &mut Vec<Event>, stored: bool, m: encode::Mapped) {
    match (out.last_mut(), stored) {
        (Some(Event::Stored(v)), true) | (Some(Event::Removed(v)), false) => v.push(m),
        _ => out.push(if stored {
            Event::Stored(vec![m])
        } else {
            Event::Removed(vec![m])
        }),
    }
}

fn produce(inner: &Inner, stores: &[Arc<TenantStore>]) {
    let mut dropped_seen = vec![0u64; stores.len()];
    loop {
        // Read the flag before draining, so the last round publishes what came before it.
        let stopping = inner.stop.load(Ordering::SeqCst);
        let mut events = Vec::new();
        // Changes to the held set, in order (`None`: cleared).
        let mut changes: Vec<Change> = Vec::new();
        let c = &inner.counters;
        for (store, seen) in stores.iter().zip(dropped_seen.iter_mut()) {
            // Bounded: at most the ring's capacity, DRAIN_BATCH per call.
            for _ in 0..=inner.config.engine_ring / DRAIN_BATCH + 1 {
                let Some(d) = store.with_engine(|e| e.drain_events(DRAIN_BATCH)) else {
                    break;
                };
                for ev in &d.events {
                    match ev.kind {
                        EventKind::Cleared => {
                            events.push(Event::Cleared);
                            changes.push(None);
                            add(&c.published_cleared, 1);
                        }
                        kind => match encode::map_group(&ev.group) {
                            Some(m) => {
                                let stored = kind == EventKind::Stored;
                                push(&mut events, stored, m);
                                let key: Box<[u8]> = ev.group.as_ref().into();
                                changes.push(Some((key, stored.then_some(m))));
                                if stored {
                                    add(&c.published_stored, 1);
                                } else {
                                    add(&c.published_removed, 1);
                                }
                            }
                            None => add(&c.unmapped, 1),
                        },
                    }
                }
                if d.dropped_total > *seen {
                    let lost = d.dropped_total - *seen;
                    *seen = d.dropped_total;
                    add(&c.engine_dropped, lost);
                    tracing::warn!(
                        "kvtier serve: store {}: {lost} KV events dropped by the engine ring \
                         before the stream took them",
                        store.name()
                    );
                }
                if d.pending == 0 {
                    break;
                }
            }
        }
        if !events.is_empty() {
            publish(inner, &events, changes);
        }
        if stopping {
            return;
        }
        // In ticks, so that a stop is seen within one tick whatever the interval.
        let wake = std::time::Instant::now() + inner.config.interval;
        while !inner.stop.load(Ordering::SeqCst) {
            let left = wake.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(TICK));
        }
    }
}

fn now_ts() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One change of the held set: a group (as stored) with its name or removed (`None`
/// name); `None` is a clear.
type Change = Option<(Box<[u8]>, Option<encode::Mapped>)>;

fn publish(inner: &Inner, events: &[Event], changes: Vec<Change>) {
    let payload = encode::encode_batch(now_ts(), events, "CPU", &inner.config.ownership);
    // The held set and the sequence move together (see `Inner::held`).
    let mut held = inner.held.lock();
    for change in changes {
        match change {
            None => held.groups.clear(),
            Some((key, Some(m))) => {
                held.groups.insert(key, m);
            }
            Some((key, None)) => {
                held.groups.remove(&key);
            }
        }
    }
    let seq = inner.next_seq.fetch_add(1, Ordering::SeqCst);
    held.last_seq = Some(seq);
    drop(held);
    let batch = Arc::new(Published { seq, payload });
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

fn accept_loop(inner: &Arc<Inner>, listener: &TcpListener, publisher: bool) {
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
                tracing::warn!("kvtier serve: KV events accept failed: {e}");
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
                tracing::debug!("kvtier serve: KV events peer closed: {e}");
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
fn serve_subscriber(inner: &Arc<Inner>, mut stream: TcpStream) -> Result<(), zmtp::ZmtpError> {
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

fn read_subscriptions(
    inner: &Inner,
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
                tracing::debug!("kvtier serve: KV events subscriber: {e}");
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
                tracing::debug!("kvtier serve: KV events subscriber over {MAX_SUBSCRIPTIONS} subscriptions: closed");
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

fn write_batches(
    inner: &Inner,
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

/// The verb of a snapshot request (see the module doc).
pub const SNAPSHOT: &[u8] = b"SNAPSHOT";

/// Answer a snapshot request: one batch (cleared, then every held block under `prefix`) named
/// by the last sequence it includes, then the end marker; no batch before the first one.
fn send_snapshot(inner: &Inner, s: &mut TcpStream, prefix: &[u8]) -> io::Result<()> {
    let topic = inner.config.topic.as_bytes();
    let (mut blocks, last) = {
        let held = inner.held.lock();
        let blocks: Vec<encode::Mapped> = held
            .groups
            .iter()
            .filter(|(k, _)| encode::engine_key(k).starts_with(prefix))
            .map(|(_, m)| *m)
            .collect();
        (blocks, held.last_seq)
    };
    add(&inner.counters.snapshots, 1);
    if let Some(seq) = last {
        // Runs of one KV group (vLLM's group_idx) become one event each; a stable order.
        blocks.sort_by_key(|m| (m.group_idx, hash_order(m.hash)));
        let events = [Event::Cleared, Event::Stored(blocks)];
        let payload = encode::encode_batch(now_ts(), &events, "CPU", &inner.config.ownership);
        let seq = seq.to_be_bytes();
        s.write_all(&zmtp::encode_message(&[b"", topic, &seq, &payload]))?;
    }
    zmtp::write_message(s, &[b"", b"", &END_SEQ, b""])
}

fn hash_order(h: encode::BlockHash) -> (u8, u64) {
    match h {
        encode::BlockHash::Unsigned(v) => (0, v),
        encode::BlockHash::Signed(v) => (1, v as u64),
    }
}

/// One replay peer (DEALER / REQ): each request `[empty, start]` gets the buffered batches
/// from `start` and the end marker.
fn serve_replay(inner: &Inner, mut stream: TcpStream) -> Result<(), zmtp::ZmtpError> {
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

impl EventsConfig {
    /// The stream's settings from `kvtier serve`'s configuration, `None` when it is off.
    /// The endpoints were checked when the configuration loaded.
    pub fn from_server(
        config: &crate::config::ServerConfig,
    ) -> Result<Option<EventsConfig>, String> {
        let s = &config.settings;
        let Some(endpoint) = &s.host_events_endpoint else {
            return Ok(None);
        };
        let endpoint = parse_endpoint("host_events_endpoint", endpoint)?;
        let replay_endpoint = s
            .host_events_replay_endpoint
            .as_deref()
            .map(|t| parse_endpoint("host_events_replay_endpoint", t))
            .transpose()?;
        let node = s
            .host_events_node
            .clone()
            .or_else(|| config.engine.node_id.clone())
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_string())
            })
            .unwrap_or_else(|| "localhost".into());
        let size = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        Ok(Some(EventsConfig {
            endpoint,
            replay_endpoint,
            topic: s.host_events_topic.clone(),
            buffer_batches: size(s.host_events_buffer_batches),
            max_subscribers: size(s.host_events_max_subscribers),
            subscriber_queue: size(s.host_events_subscriber_queue),
            interval: Duration::from_millis(s.host_events_interval_ms),
            engine_ring: size(s.host_events_engine_ring),
            ownership: format!("kvtier:{node}"),
        }))
    }
}
