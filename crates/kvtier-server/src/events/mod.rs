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
//! **Media**: a group in a store's DRAM tier is published with `medium` `CPU`, one in its SSD
//! tier with `STORAGE` (the engine's `SsdStored` / `SsdRemoved` events, turned on here with
//! `enable_media_events`); each (medium, group) is one residency. A write-back demotion is
//! `BlockStored` `STORAGE` then `BlockRemoved` `CPU` (the engine publishes the SSD copy before
//! DRAM drops the object), a write-through put `BlockStored` `CPU` then, once copied,
//! `BlockStored` `STORAGE`; a promotion on read adds `BlockStored` `CPU`. This is how vLLM's
//! tracker counts its tiers' residencies: a block is held while any of them is.
//!
//! Sequence numbers start at 0 with each process and increase by one per batch; a restarted
//! server starts again at 0 (its stores are new too: a router that sees a sequence go back
//! drops what it credited to this stream). Events the engine ring dropped before the producer
//! took them (`engine_dropped`) never reach the stream themselves: the ring is sized so that it
//! does not happen at the drain interval; the counter says when it did, and the stream then re-reads
//! what that store holds (`held_groups`) and publishes the difference, so a lost event never
//! leaves a block credited that is gone, nor a held block unannounced.

pub use kvtier_events::{encode, zmtp};
pub use kvtier_events::{parse_endpoint, EndpointError, EventsError, END_SEQ, SNAPSHOT};

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
use encode::{Event, Holder, Medium};

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

/// A held group: its store (index among the server's stores), the group as stored (with its
/// store namespace, so one page held by two tenants is two entries) and its medium.
type HeldKey = (usize, Box<[u8]>, Medium);

/// What the stream has published as held -> each group's name on the stream. Events are
/// derived from changes of this set, so the stream never says a block is stored twice on one
/// medium or removed when it never said it was stored (an engine event the ring lost).
struct HostHeld {
    groups: std::collections::HashMap<HeldKey, encode::Mapped>,
    ownership: Arc<str>,
}

impl HeldSet for HostHeld {
    fn snapshot(&self, prefix: &[u8]) -> Vec<(Holder, encode::Mapped)> {
        self.groups
            .iter()
            .filter(|((_, k, _), _)| encode::engine_key(k).starts_with(prefix))
            .map(|((_, _, medium), m)| {
                (Holder::new(Arc::clone(&self.ownership), Some(*medium)), *m)
            })
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
            store.enable_media_events(config.engine_ring);
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

/// Append a block of one kind and medium to `out`, merging with the last event of the same
/// kind and medium.
fn push(out: &mut Vec<(Option<Medium>, Event)>, medium: Medium, stored: bool, m: encode::Mapped) {
    match (out.last_mut(), stored) {
        (Some((Some(md), Event::Stored(v))), true)
        | (Some((Some(md), Event::Removed(v))), false)
            if *md == medium =>
        {
            v.push(m)
        }
        _ => out.push((
            Some(medium),
            if stored {
                Event::Stored(vec![m])
            } else {
                Event::Removed(vec![m])
            },
        )),
    }
}

/// The medium an engine event is about and whether it stored (`None` for a clear).
fn medium_of(kind: EventKind) -> Option<(Medium, bool)> {
    match kind {
        EventKind::Stored => Some((Medium::Dram, true)),
        EventKind::Evicted | EventKind::Removed => Some((Medium::Dram, false)),
        EventKind::SsdStored => Some((Medium::Ssd, true)),
        EventKind::SsdRemoved => Some((Medium::Ssd, false)),
        EventKind::Cleared => None,
    }
}

/// Drain store number `index`'s engine ring into `changes` (bounded: at most the ring's
/// capacity, DRAIN_BATCH per call).
fn drain_store(
    p: &Producer,
    store: &TenantStore,
    index: usize,
    seen: &mut u64,
    changes: &mut Vec<Change>,
) {
    for _ in 0..=p.engine_ring / DRAIN_BATCH + 1 {
        let Some(d) = store.drain_events(DRAIN_BATCH) else {
            break;
        };
        for ev in &d.events {
            match medium_of(ev.kind) {
                None => changes.push(Change::Cleared(index)),
                Some((medium, stored)) => match encode::map_group(&ev.group) {
                    Some(m) => {
                        let key = (index, ev.group.as_ref().into(), medium);
                        changes.push(if stored {
                            Change::Held(key, m)
                        } else {
                            Change::Gone(key)
                        });
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
                 before the stream took them; re-reading what it holds",
                store.name()
            );
            // What the store holds now replaces what the lost events would have said; the
            // events still in the ring follow it (per group the last one wins).
            if let Some(groups) = store.held_groups() {
                changes.push(Change::Resync(index, groups));
            }
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
        // Changes to the held set, in order.
        let mut changes: Vec<Change> = Vec::new();
        for (index, (store, seen)) in stores.iter().zip(dropped_seen.iter_mut()).enumerate() {
            drain_store(p, store, index, seen, &mut changes);
        }
        if !changes.is_empty() {
            p.stream.update(|held| {
                let owned = apply(held, changes)
                    .into_iter()
                    .map(|(medium, e)| (Holder::new(Arc::clone(&p.ownership), medium), e))
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

/// One change of the held set, in the engine's order.
enum Change {
    /// The group is held (on the key's medium) under this name.
    Held(HeldKey, encode::Mapped),
    /// The group left the key's medium.
    Gone(HeldKey),
    /// Store number `.0` was cleared (every group, every medium).
    Cleared(usize),
    /// Store number `.0` holds exactly these groups `(DRAM, SSD)` now: its engine ring lost
    /// events, so the held set is re-read instead of trusted.
    Resync(usize, kvtier_store::store::HeldGroups),
}

/// Apply `changes` to the held set; the events are what changed. A clear is
/// `AllBlocksCleared` when the cleared store held everything the stream holds, else a
/// `BlockRemoved` of each of its groups (the other stores' blocks are still held).
fn apply(held: &mut HostHeld, changes: Vec<Change>) -> Vec<(Option<Medium>, Event)> {
    let mut out = Vec::new();
    for change in changes {
        match change {
            Change::Held(key, m) => {
                let medium = key.2;
                if held.groups.insert(key, m).is_none() {
                    push(&mut out, medium, true, m);
                }
            }
            Change::Gone(key) => {
                let medium = key.2;
                if let Some(m) = held.groups.remove(&key) {
                    push(&mut out, medium, false, m);
                }
            }
            Change::Resync(store, (dram, ssd)) => resync(held, store, dram, ssd, &mut out),
            Change::Cleared(store) => {
                if held.groups.keys().all(|k| k.0 == store) {
                    held.groups.clear();
                    out.push((None, Event::Cleared));
                    continue;
                }
                remove_where(held, &mut out, |k| k.0 == store);
            }
        }
    }
    out
}

/// Remove every held residency `gone` selects, publishing a `BlockRemoved` for each (grouped
/// by medium).
fn remove_where(
    held: &mut HostHeld,
    out: &mut Vec<(Option<Medium>, Event)>,
    gone: impl Fn(&HeldKey) -> bool,
) {
    let mut keys: Vec<HeldKey> = held.groups.keys().filter(|k| gone(k)).cloned().collect();
    keys.sort_by_key(|k| k.2);
    for key in keys {
        let medium = key.2;
        if let Some(m) = held.groups.remove(&key) {
            push(out, medium, false, m);
        }
    }
}

/// Make store `store`'s part of the held set what it holds now: a `BlockRemoved` for each
/// residency it lost, a `BlockStored` for each one the stream did not know (removals first,
/// so a block moved between media while events were lost is shown stored on its medium
/// last). Groups no key scheme maps are left out, as in live events.
fn resync(
    held: &mut HostHeld,
    store: usize,
    dram: Vec<Arc<[u8]>>,
    ssd: Vec<Arc<[u8]>>,
    out: &mut Vec<(Option<Medium>, Event)>,
) {
    let now: std::collections::HashSet<HeldKey> = dram
        .iter()
        .map(|g| (store, Box::<[u8]>::from(&g[..]), Medium::Dram))
        .chain(
            ssd.iter()
                .map(|g| (store, Box::<[u8]>::from(&g[..]), Medium::Ssd)),
        )
        .collect();
    remove_where(held, out, |k| k.0 == store && !now.contains(k));
    let mut new: Vec<HeldKey> = now
        .into_iter()
        .filter(|k| !held.groups.contains_key(k))
        .collect();
    new.sort_by_key(|k| k.2);
    for key in new {
        let medium = key.2;
        if let Some(m) = encode::map_group(&key.1) {
            held.groups.insert(key, m);
            push(out, medium, true, m);
        }
    }
}

impl EventsConfig {
    /// The stream's settings from `kvtier serve`'s configuration, `None` when it is off.
    /// The endpoints were checked when the configuration loaded; the error names the key
    /// and value all the same.
    pub fn from_server(
        config: &crate::config::ServerConfig,
    ) -> Result<Option<EventsConfig>, EndpointError> {
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
            },
            interval: Duration::from_millis(s.host_events_interval_ms),
            engine_ring: size(s.host_events_engine_ring),
            ownership: format!("kvtier:{node}"),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use encode::{BlockHash, Mapped};

    fn m(v: i64) -> Mapped {
        Mapped {
            hash: BlockHash::Signed(v),
            group_idx: None,
        }
    }

    fn key(store: usize, group: &str, medium: Medium) -> HeldKey {
        (store, group.as_bytes().into(), medium)
    }

    /// After a ring loss the store's part of the held set becomes what the store holds:
    /// residencies it lost are removed, ones the stream never heard of are stored, the other
    /// stores' are untouched, and events applied after the resync go on from it.
    #[test]
    fn a_resync_publishes_the_difference_with_what_the_store_holds() {
        let g = |i: u8| format!("{:02x}00000000000000aa@", i);
        let mapped = |i: u8| encode::map_group(g(i).as_bytes()).unwrap();
        let arc = |i: u8| Arc::<[u8]>::from(g(i).as_bytes());
        let mut held = HostHeld {
            groups: std::collections::HashMap::new(),
            ownership: "kvtier:n".into(),
        };
        apply(
            &mut held,
            vec![
                Change::Held(key(0, &g(1), Medium::Dram), mapped(1)), // stale: gone since
                Change::Held(key(0, &g(2), Medium::Dram), mapped(2)), // still held
                Change::Held(key(1, &g(1), Medium::Dram), mapped(1)), // another store's
            ],
        );
        let out = apply(
            &mut held,
            vec![
                // The store holds 2 in DRAM, 1 on SSD and 3 in DRAM; its events said otherwise.
                Change::Resync(0, (vec![arc(2), arc(3)], vec![arc(1)])),
                Change::Gone(key(0, &g(3), Medium::Dram)),
            ],
        );
        assert_eq!(
            out,
            vec![
                (Some(Medium::Dram), Event::Removed(vec![mapped(1)])),
                (Some(Medium::Dram), Event::Stored(vec![mapped(3)])),
                (Some(Medium::Ssd), Event::Stored(vec![mapped(1)])),
                (Some(Medium::Dram), Event::Removed(vec![mapped(3)])),
            ]
        );
        let mut now: Vec<_> = held.groups.keys().cloned().collect();
        now.sort();
        assert_eq!(
            now,
            vec![
                key(0, &g(1), Medium::Ssd),
                key(0, &g(2), Medium::Dram),
                key(1, &g(1), Medium::Dram),
            ]
        );
    }

    #[test]
    fn events_follow_the_held_set_and_a_store_clear_spares_the_others() {
        let mut held = HostHeld {
            groups: std::collections::HashMap::new(),
            ownership: "kvtier:n".into(),
        };
        let out = apply(
            &mut held,
            vec![
                Change::Held(key(0, "a@", Medium::Dram), m(1)),
                Change::Held(key(0, "a@", Medium::Ssd), m(1)),
                Change::Held(key(0, "a@", Medium::Dram), m(1)), // a lost removal: no repeat
                Change::Gone(key(0, "never@", Medium::Dram)),   // never held: nothing
                Change::Held(key(1, "b@", Medium::Dram), m(2)),
                Change::Gone(key(0, "a@", Medium::Dram)),
            ],
        );
        assert_eq!(
            out,
            vec![
                (Some(Medium::Dram), Event::Stored(vec![m(1)])),
                (Some(Medium::Ssd), Event::Stored(vec![m(1)])),
                (Some(Medium::Dram), Event::Stored(vec![m(2)])),
                (Some(Medium::Dram), Event::Removed(vec![m(1)])),
            ]
        );
        // Store 0 cleared while store 1 holds a block: removals of store 0's, no reset.
        let out = apply(&mut held, vec![Change::Cleared(0)]);
        assert_eq!(out, vec![(Some(Medium::Ssd), Event::Removed(vec![m(1)]))]);
        // Store 1 holds everything left: its clear is the reset.
        let out = apply(&mut held, vec![Change::Cleared(1)]);
        assert_eq!(out, vec![(None, Event::Cleared)]);
        assert!(held.groups.is_empty());
    }
}
