//! The engine's event log: which page groups appeared in and left the DRAM tier, and why.
//!
//! Owns: [`EventLog`], a bounded ring of [`StoreEvent`]s that consumers drain (the Python
//! module turns them into SGLang `KVEventBatch`es), and its drop counter; and [`TierGroups`],
//! the per-group object counts of the SSD tier that turn its index changes into the same
//! kind of events (`SsdStored` / `SsdRemoved`, issue 30: the host stream names the medium).
//!
//! Events are per page group (see [`super::group_of`]), recorded by the engine under the
//! shard lock of the object whose insert or removal changed the group, so per group they are
//! in the order the index changed:
//! - `Stored` when a group's first object is published (its first component; the other
//!   components of the page normally follow in the same batch);
//! - `Evicted` / `Removed` when its last object leaves (capacity eviction / explicit remove);
//! - `Cleared` once for `clear()` (no per-group events then, on either tier);
//! - only once [`TierGroups::enable`] ran (the host stream of `kvtier serve`, and kvtier's
//!   vLLM tier when embedded with the SSD tier): `SsdStored` when a group's first object is published in the
//!   SSD index, `SsdRemoved` when its last leaves it (remove, segment reclaim, a record that
//!   failed its checksum). A demotion (write-back eviction) is thus `SsdStored` before
//!   `Evicted`, since the copy is published before DRAM drops the object.
//!
//! Invariants: sequence numbers are strictly increasing and gap-free as recorded; when the
//! ring is full the *oldest* event is dropped and counted, so a consumer that sees a gap in
//! `seq` knows exactly how many it missed. Recording is off (one relaxed load per call) until
//! [`EventLog::enable`] is called.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Why an event was recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// The group's first object became visible.
    Stored,
    /// The group's last object was evicted to make room.
    Evicted,
    /// The group's last object was removed explicitly.
    Removed,
    /// Every object was removed (`clear`); `group` is empty.
    Cleared,
    /// The group's first object was published in the SSD index.
    SsdStored,
    /// The group's last object left the SSD index.
    SsdRemoved,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Stored => "stored",
            EventKind::Evicted => "evicted",
            EventKind::Removed => "removed",
            EventKind::Cleared => "cleared",
            EventKind::SsdStored => "ssd_stored",
            EventKind::SsdRemoved => "ssd_removed",
        }
    }
}

/// One event of the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreEvent {
    /// Position in the log, from 0, without gaps as recorded.
    pub seq: u64,
    pub kind: EventKind,
    /// The page group (`[tag/]page_hash@`, or the whole key for keys without `@`).
    pub group: Arc<[u8]>,
    /// Prefix depth of the group when known.
    pub depth: Option<u32>,
}

#[derive(Debug, Default)]
struct Ring {
    events: VecDeque<StoreEvent>,
    capacity: usize,
    /// Room beyond `capacity` for seed events not drained yet ([`EventLog::record_seed`]):
    /// a seed is never dropped for want of room, and the room goes as it is drained.
    seed_allowance: usize,
    next_seq: u64,
    dropped: u64,
}

/// What [`EventLog::drain`] returns.
#[derive(Clone, Debug, Default)]
pub struct Drained {
    pub events: Vec<StoreEvent>,
    /// Events dropped (ring full) since the log was enabled, in total.
    pub dropped_total: u64,
    /// Events still in the ring after this drain.
    pub pending: usize,
}

/// A bounded event ring, off until enabled.
#[derive(Debug, Default)]
pub struct EventLog {
    enabled: AtomicBool,
    ring: Mutex<Ring>,
}

impl EventLog {
    /// Start recording into a ring of `capacity` events (at least 1). Calling it again
    /// changes the capacity, dropping (and counting) the oldest events that no longer fit.
    pub fn enable(&self, capacity: usize) {
        let mut ring = self.ring.lock();
        ring.capacity = capacity.max(1);
        while ring.events.len() > ring.capacity {
            ring.events.pop_front();
            ring.dropped += 1;
        }
        self.enabled.store(true, Ordering::Release);
    }

    /// Whether events are being recorded.
    pub fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Record one event (no-op while disabled).
    pub fn record(&self, kind: EventKind, group: &[u8], depth: Option<u32>) {
        if !self.is_enabled() {
            return;
        }
        let mut ring = self.ring.lock();
        let seq = ring.next_seq;
        ring.next_seq += 1;
        if ring.events.len() >= ring.capacity + ring.seed_allowance {
            ring.events.pop_front();
            ring.dropped += 1;
        }
        ring.events.push_back(StoreEvent {
            seq,
            kind,
            group: Arc::from(group),
            depth,
        });
    }

    /// Record the state a consumer starts from (one event per group already present), as
    /// [`Self::record`] but never dropped for want of room: the ring grows by the seed until
    /// it is drained, so a seed larger than the ring (a warm SSD tier with more groups than
    /// the ring holds) reaches the consumer whole. Bounded by what the tier holds.
    pub fn record_seed(&self, kind: EventKind, groups: &[Arc<[u8]>]) {
        if !self.is_enabled() || groups.is_empty() {
            return;
        }
        let mut ring = self.ring.lock();
        ring.seed_allowance += groups.len();
        for group in groups {
            let seq = ring.next_seq;
            ring.next_seq += 1;
            ring.events.push_back(StoreEvent {
                seq,
                kind,
                group: Arc::clone(group),
                depth: None,
            });
        }
    }

    /// Take up to `max` of the oldest events.
    pub fn drain(&self, max: usize) -> Drained {
        let mut ring = self.ring.lock();
        let n = max.min(ring.events.len());
        ring.seed_allowance = ring.seed_allowance.saturating_sub(n);
        let events = ring.events.drain(..n).collect();
        Drained {
            events,
            dropped_total: ring.dropped,
            pending: ring.events.len(),
        }
    }
}

/// The page groups an engine holds, `(DRAM, SSD)` (`Engine::held_groups`).
pub type HeldGroups = (Vec<Arc<[u8]>>, Vec<Arc<[u8]>>);

/// Objects per page group of the SSD tier, so that its per-key index changes become per-group
/// events in the engine's [`EventLog`]. Off (no map, one relaxed load per change) until
/// [`TierGroups::enable`]; the SSD tier calls [`TierGroups::added`] / [`TierGroups::removed`]
/// under the key's SSD index shard lock, so per group the counts follow the index.
#[derive(Debug)]
pub struct TierGroups {
    log: Arc<EventLog>,
    on: AtomicBool,
    counts: Mutex<HashMap<Arc<[u8]>, u32>>,
}

impl TierGroups {
    pub fn new(log: Arc<EventLog>) -> TierGroups {
        TierGroups {
            log,
            on: AtomicBool::new(false),
            counts: Mutex::new(HashMap::new()),
        }
    }

    /// Start counting, seeded with the keys present now (the caller holds off every
    /// mutation while it runs); each group present is recorded as `SsdStored`, as a seed
    /// ([`EventLog::record_seed`]): however many groups the tier holds, none is dropped.
    pub fn enable<'a>(&self, present: impl IntoIterator<Item = &'a [u8]>) {
        let mut counts = self.counts.lock();
        counts.clear();
        let mut seed = Vec::new();
        for key in present {
            let group = super::group_of(key);
            match counts.get_mut(group) {
                Some(n) => *n += 1,
                None => {
                    let group: Arc<[u8]> = Arc::from(group);
                    seed.push(Arc::clone(&group));
                    counts.insert(group, 1);
                }
            }
        }
        self.log.record_seed(EventKind::SsdStored, &seed);
        self.on.store(true, Ordering::Release);
    }

    /// The groups on SSD now (empty while counting is off: then no SSD residency is ever
    /// published either).
    pub fn groups(&self) -> Vec<Arc<[u8]>> {
        if !self.on.load(Ordering::Acquire) {
            return Vec::new();
        }
        self.counts.lock().keys().cloned().collect()
    }

    /// `key` was published in the SSD index.
    pub fn added(&self, key: &[u8], depth: Option<u32>) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let group = super::group_of(key);
        let mut counts = self.counts.lock();
        match counts.get_mut(group) {
            Some(n) => *n += 1,
            None => {
                counts.insert(Arc::from(group), 1);
                self.log.record(EventKind::SsdStored, group, depth);
            }
        }
    }

    /// `key` left the SSD index (a key never counted, e.g. removed while counting started,
    /// changes nothing).
    pub fn removed(&self, key: &[u8]) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let group = super::group_of(key);
        let mut counts = self.counts.lock();
        let Some(n) = counts.get_mut(group) else {
            return;
        };
        *n -= 1;
        if *n == 0 {
            counts.remove(group);
            self.log.record(EventKind::SsdRemoved, group, None);
        }
    }

    /// Every key left (`clear`): forget the counts and record the one `Cleared` event that
    /// covers both tiers. The SSD tier calls it with its index emptied and every mutation held
    /// off, so an `SsdStored` recorded before it was wiped with the index and one recorded
    /// after it is of a key the index holds (never a group credited forever).
    pub fn reset_cleared(&self) {
        self.counts.lock().clear();
        self.log.record(EventKind::Cleared, b"", None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_records_nothing() {
        let log = EventLog::default();
        log.record(EventKind::Stored, b"a@", None);
        assert!(log.drain(10).events.is_empty());
    }

    #[test]
    fn full_ring_drops_the_oldest_and_counts() {
        let log = EventLog::default();
        log.enable(3);
        for i in 0..5u32 {
            log.record(EventKind::Stored, format!("g{i}").as_bytes(), Some(i));
        }
        let d = log.drain(2);
        assert_eq!(d.events.iter().map(|e| e.seq).collect::<Vec<_>>(), [2, 3]);
        assert_eq!((d.dropped_total, d.pending), (2, 1));
        let d = log.drain(10);
        assert_eq!(d.events.len(), 1);
        assert_eq!(&*d.events[0].group, b"g4");
        assert_eq!(d.events[0].depth, Some(4));
        // Shrinking keeps the newest.
        for i in 0..3u32 {
            log.record(EventKind::Evicted, format!("h{i}").as_bytes(), None);
        }
        log.enable(1);
        let d = log.drain(10);
        assert_eq!(d.events.iter().map(|e| e.seq).collect::<Vec<_>>(), [7]);
        assert_eq!(d.dropped_total, 4);
    }

    #[test]
    fn a_seed_larger_than_the_ring_is_kept_until_drained() {
        let log = EventLog::default();
        log.enable(2);
        let seed: Vec<Arc<[u8]>> = (0..5)
            .map(|i| Arc::from(format!("s{i}").as_bytes()))
            .collect();
        log.record_seed(EventKind::SsdStored, &seed);
        log.record(EventKind::Stored, b"after", None);
        let d = log.drain(3);
        assert_eq!((d.dropped_total, d.pending), (0, 3));
        assert_eq!(
            d.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        let d = log.drain(10);
        assert_eq!(d.events.len(), 3);
        assert_eq!(&*d.events[2].group, b"after");
        // Drained: the ring is its own size again and drops the oldest.
        for i in 0..3u32 {
            log.record(EventKind::Stored, format!("g{i}").as_bytes(), None);
        }
        let d = log.drain(10);
        assert_eq!((d.events.len(), d.dropped_total), (2, 1));
    }

    #[test]
    fn tier_groups_record_first_and_last_object_of_a_group() {
        let log = Arc::new(EventLog::default());
        log.enable(16);
        let t = TierGroups::new(Arc::clone(&log));
        t.added(b"p@x.k", None); // off: nothing
        t.enable([&b"p@x.k"[..], b"p@x.v"]);
        t.added(b"q@x.k", Some(2));
        t.added(b"q@x.v", None);
        t.removed(b"p@x.k");
        t.removed(b"p@x.v");
        t.removed(b"never@x.k");
        t.reset_cleared();
        t.removed(b"q@x.k");
        let got: Vec<(EventKind, Vec<u8>)> = log
            .drain(16)
            .events
            .into_iter()
            .map(|e| (e.kind, e.group.to_vec()))
            .collect();
        assert_eq!(
            got,
            vec![
                (EventKind::SsdStored, b"p@".to_vec()),
                (EventKind::SsdStored, b"q@".to_vec()),
                (EventKind::SsdRemoved, b"p@".to_vec()),
                (EventKind::Cleared, Vec::new()),
            ]
        );
    }
}
