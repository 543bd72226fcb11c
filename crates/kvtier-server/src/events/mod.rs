//! The host KV-event stream of `kvtier serve` (issue 30): what this host's stores hold, in
//! vLLM's KV-event wire protocol, for cache-aware routers.
//!
//! Owns: the producer thread that drains every store's engine event ring and publishes one
//! `KVEventBatch` per round, and the held set its snapshots answer from. The publisher (replay
//! ring, endpoints, snapshot requests) is the `kvtier-events` crate's [`Stream`], shared with
//! the cluster stream of `kvtier master`: a PUB socket sending `[topic, 8-byte big-endian sequence, msgpack
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

pub use kvtier_events::{encode, zmtp};
pub use kvtier_events::{parse_endpoint, EventsError, END_SEQ, SNAPSHOT};

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvtier_engine::eviction::events::EventKind;
use kvtier_events::{HeldSet, Stream, StreamConfig, TICK};
use kvtier_store::store::Store;
use serde_json::{json, Value};

use crate::server::TenantStore;
use encode::Event;

/// Engine events taken per drain call.
const DRAIN_BATCH: usize = 4096;

/// The stream's settings (validated from the `host_events_*` server keys).
#[derive(Clone, Debug)]
pub struct EventsConfig {
    /// The publisher's endpoints and bounds.
    pub stream: StreamConfig,
    pub interval: Duration,
    /// Capacity of each engine's event ring.
    pub engine_ring: usize,
    /// `ownership` of every event: `kvtier:<node>`.
    pub ownership: String,
}

/// What the stream has published as held: each stored group (with its store namespace, so
/// one page held by two tenants is two entries, as on the live stream) -> its name on the
/// stream.
struct HostHeld {
    groups: std::collections::HashMap<Box<[u8]>, encode::Mapped>,
    ownership: Arc<str>,
}

impl HeldSet for HostHeld {
    fn snapshot(&self, prefix: &[u8]) -> Vec<(Arc<str>, encode::Mapped)> {
        self.groups
            .iter()
            .filter(|(k, _)| encode::engine_key(k).starts_with(prefix))
            .map(|(_, m)| (Arc::clone(&self.ownership), *m))
            .collect()
    }
}

/// The running stream (see the module doc). [`HostEvents::stop`] ends its threads.
pub struct HostEvents {
    stream: Arc<Stream<HostHeld>>,
    engine_dropped: Arc<AtomicU64>,
    producer: Option<JoinHandle<()>>,
}

struct Producer {
    stream: Arc<Stream<HostHeld>>,
    engine_dropped: Arc<AtomicU64>,
    interval: Duration,
    engine_ring: usize,
    ownership: Arc<str>,
}

impl HostEvents {
    /// Bind the endpoints, turn on the engines' event rings and start publishing.
    pub fn start(
        config: EventsConfig,
        stores: Vec<Arc<TenantStore>>,
    ) -> Result<HostEvents, EventsError> {
        let ownership: Arc<str> = config.ownership.as_str().into();
        let stream = Arc::new(Stream::start(
            config.stream.clone(),
            HostHeld {
                groups: std::collections::HashMap::new(),
                ownership: Arc::clone(&ownership),
            },
        )?);
        for store in &stores {
            store.enable_events(config.engine_ring);
        }
        let engine_dropped = Arc::new(AtomicU64::new(0));
        let p = Producer {
            stream: Arc::clone(&stream),
            engine_dropped: Arc::clone(&engine_dropped),
            interval: config.interval,
            engine_ring: config.engine_ring,
            ownership,
        };
        let producer = kvtier_events::stream::spawn("kvtier-events", move || produce(&p, &stores))?;
        Ok(HostEvents {
            stream,
            engine_dropped,
            producer: Some(producer),
        })
    }

    /// The bound PUB address.
    pub fn endpoint(&self) -> SocketAddr {
        self.stream.endpoint()
    }

    /// The bound replay address.
    pub fn replay_endpoint(&self) -> Option<SocketAddr> {
        self.stream.replay_endpoint()
    }

    /// The `host_events` object of the stats document.
    pub fn stats(&self) -> Value {
        let mut m = self.stream.stats();
        m.insert(
            "engine_dropped".into(),
            json!(self.engine_dropped.load(Ordering::Relaxed)),
        );
        Value::Object(m)
    }

    /// Publish what the engines still hold, stop every thread, close every connection.
    pub fn stop(mut self) {
        self.stream.request_stop();
        if let Some(p) = self.producer.take() {
            let _ = p.join();
        }
        self.stream.stop();
    }
}

impl Drop for HostEvents {
    fn drop(&mut self) {
        self.stream.request_stop();
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

/// Drain one store's engine ring into `events` and `changes` (bounded: at most the ring's
/// capacity, DRAIN_BATCH per call).
fn drain_store(
    p: &Producer,
    store: &TenantStore,
    seen: &mut u64,
    events: &mut Vec<Event>,
    changes: &mut Vec<Change>,
) {
    for _ in 0..=p.engine_ring / DRAIN_BATCH + 1 {
        let Some(d) = store.drain_events(DRAIN_BATCH) else {
            break;
        };
        for ev in &d.events {
            match ev.kind {
                EventKind::Cleared => {
                    events.push(Event::Cleared);
                    changes.push(None);
                }
                kind => match encode::map_group(&ev.group) {
                    Some(m) => {
                        let stored = kind == EventKind::Stored;
                        push(events, stored, m);
                        let key: Box<[u8]> = ev.group.as_ref().into();
                        changes.push(Some((key, stored.then_some(m))));
                    }
                    None => p.stream.count_unmapped(1),
                },
            }
        }
        if d.dropped_total > *seen {
            let lost = d.dropped_total - *seen;
            *seen = d.dropped_total;
            p.engine_dropped.fetch_add(lost, Ordering::Relaxed);
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

fn produce(p: &Producer, stores: &[Arc<TenantStore>]) {
    let mut dropped_seen = vec![0u64; stores.len()];
    loop {
        // Read the flag before draining, so the last round publishes what came before it.
        let stopping = p.stream.stopping();
        let mut events = Vec::new();
        // Changes to the held set, in order.
        let mut changes: Vec<Change> = Vec::new();
        for (store, seen) in stores.iter().zip(dropped_seen.iter_mut()) {
            drain_store(p, store, seen, &mut events, &mut changes);
        }
        if !events.is_empty() {
            p.stream.update(|held| {
                apply(held, changes);
                let owned = events
                    .into_iter()
                    .map(|e| (Arc::clone(&p.ownership), e))
                    .collect();
                (owned, ())
            });
        }
        if stopping {
            return;
        }
        // In ticks, so that a stop is seen within one tick whatever the interval.
        let wake = std::time::Instant::now() + p.interval;
        while !p.stream.stopping() {
            let left = wake.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(TICK));
        }
    }
}

/// One change of the held set: a group (as stored) with its name or removed (`None`
/// name); `None` is a clear.
type Change = Option<(Box<[u8]>, Option<encode::Mapped>)>;

fn apply(held: &mut HostHeld, changes: Vec<Change>) {
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
            stream: StreamConfig {
                name: "kvtier serve",
                endpoint_key: "host_events_endpoint",
                replay_key: "host_events_replay_endpoint",
                endpoint,
                replay_endpoint,
                topic: s.host_events_topic.clone(),
                buffer_batches: size(s.host_events_buffer_batches),
                max_subscribers: size(s.host_events_max_subscribers),
                subscriber_queue: size(s.host_events_subscriber_queue),
                medium: "CPU".into(),
            },
            interval: Duration::from_millis(s.host_events_interval_ms),
            engine_ring: size(s.host_events_engine_ring),
            ownership: format!("kvtier:{node}"),
        }))
    }
}
