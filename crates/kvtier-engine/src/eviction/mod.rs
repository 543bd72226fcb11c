//! Eviction: which object to drop when a put needs room.
//!
//! Owns: the [`EvictionPolicy`] trait, the recency bookkeeping shared by its implementations
//! ([`RecencyList`]), and the two policies, [`Lru`] and [`PrefixDepth`].
//!
//! Contract with the engine (which makes the policy's key set equal to the index's):
//! - `on_insert` / `on_remove` are called while the engine holds the write lock of the key's
//!   index shard, so they are ordered exactly like the index mutations they mirror;
//! - `on_access` may be called without any index lock and may therefore name a key that was
//!   removed meanwhile: policies ignore unknown keys there;
//! - `candidates` proposes keys only; the engine decides (under the shard lock) whether a
//!   candidate can go, skipping objects pinned by readers. A policy never frees anything.
//!
//! Lock order: index shard → policy. The engine calls `candidates` holding no index lock.

mod lru;
mod prefix_depth;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub use lru::Lru;
pub use prefix_depth::PrefixDepth;

use crate::config::EvictionPolicyKind;

/// A replacement policy for one tier. Implementations synchronize internally.
pub trait EvictionPolicy: Send + Sync {
    /// A new object became visible. `size` is its length in bytes; `depth` its page depth in
    /// its prefix chain (0 = first page), when known.
    fn on_insert(&self, key: &[u8], size: u64, depth: Option<u32>);
    /// The object was read (or re-put). Unknown keys are ignored.
    fn on_access(&self, key: &[u8]);
    /// The object left the tier (evicted, removed, cleared). Unknown keys are ignored.
    fn on_remove(&self, key: &[u8]);
    /// Append to `out` the keys of the cold window — the objects ranked `skip ..
    /// skip + window` from least recently used — ordered best victim first. An empty result
    /// means no object is ranked at or beyond `skip`.
    fn candidates(&self, skip: usize, window: usize, out: &mut Vec<Arc<[u8]>>);
    /// Number of objects tracked.
    fn len(&self) -> usize;
    /// Whether no object is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Build the policy a config names.
pub fn new_policy(kind: EvictionPolicyKind) -> Box<dyn EvictionPolicy> {
    match kind {
        EvictionPolicyKind::Lru => Box::new(Lru::default()),
        EvictionPolicyKind::PrefixDepth => Box::new(PrefixDepth::default()),
    }
}

/// What a policy remembers about one object.
#[derive(Clone, Copy, Debug)]
pub struct EntryInfo {
    /// Logical clock of the last insert or access; unique per entry.
    pub tick: u64,
    pub size: u64,
    pub depth: Option<u32>,
}

/// Objects ordered by recency: O(log n) touch, coldest-first iteration.
///
/// Invariant: `by_tick` and `entries` hold the same keys, and `entries[k].tick` is the key of
/// `k` in `by_tick`.
#[derive(Debug, Default)]
pub struct RecencyList {
    entries: HashMap<Arc<[u8]>, EntryInfo, foldhash::fast::RandomState>,
    by_tick: BTreeMap<u64, Arc<[u8]>>,
    clock: u64,
}

impl RecencyList {
    fn next_tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Track `key` as most recent (re-inserting an existing key refreshes it).
    pub fn insert(&mut self, key: &[u8], size: u64, depth: Option<u32>) {
        self.remove(key);
        let tick = self.next_tick();
        let key: Arc<[u8]> = Arc::from(key);
        self.by_tick.insert(tick, Arc::clone(&key));
        self.entries.insert(key, EntryInfo { tick, size, depth });
    }

    /// Mark `key` most recent; no-op for unknown keys.
    pub fn touch(&mut self, key: &[u8]) {
        let tick = self.clock + 1;
        let Some(info) = self.entries.get_mut(key) else {
            return;
        };
        self.clock = tick;
        if let Some(k) = self.by_tick.remove(&info.tick) {
            self.by_tick.insert(tick, k);
        }
        info.tick = tick;
    }

    pub fn remove(&mut self, key: &[u8]) {
        if let Some(info) = self.entries.remove(key) {
            self.by_tick.remove(&info.tick);
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries ranked `skip .. skip + window` from the coldest, coldest first.
    pub fn coldest(
        &self,
        skip: usize,
        window: usize,
    ) -> impl Iterator<Item = (&Arc<[u8]>, &EntryInfo)> + '_ {
        self.by_tick
            .values()
            .skip(skip)
            .take(window)
            .filter_map(|k| self.entries.get_key_value(k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(p: &dyn EvictionPolicy, skip: usize, window: usize) -> Vec<String> {
        let mut out = Vec::new();
        p.candidates(skip, window, &mut out);
        out.iter()
            .map(|k| String::from_utf8(k.to_vec()).unwrap())
            .collect()
    }

    #[test]
    fn lru_orders_by_recency_and_ignores_unknown() {
        let p = Lru::default();
        for k in ["a", "b", "c", "d"] {
            p.on_insert(k.as_bytes(), 1, None);
        }
        p.on_access(b"a");
        p.on_access(b"zzz");
        p.on_remove(b"c");
        p.on_remove(b"nope");
        assert_eq!(keys(&p, 0, 10), ["b", "d", "a"]);
        assert_eq!(keys(&p, 0, 2), ["b", "d"]);
        assert_eq!(keys(&p, 2, 2), ["a"]);
        assert!(keys(&p, 3, 2).is_empty());
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn prefix_depth_prefers_deep_pages_within_the_window() {
        let p = PrefixDepth::default();
        // Inserted oldest first: chain pages 0..4, then an unknown-depth object.
        for d in 0..4u32 {
            p.on_insert(format!("p{d}").as_bytes(), 1, Some(d));
        }
        p.on_insert(b"u", 1, None);
        p.on_insert(b"q3", 1, Some(3));
        assert_eq!(keys(&p, 0, 10), ["p3", "q3", "p2", "p1", "p0", "u"]);
        // The window bounds the choice: only the 2 coldest are considered.
        assert_eq!(keys(&p, 0, 2), ["p1", "p0"]);
        // Touching p3 makes it more recent than q3, so the depth-3 tie now goes to q3.
        p.on_access(b"p3");
        assert_eq!(keys(&p, 0, 10), ["q3", "p3", "p2", "p1", "p0", "u"]);
    }
}
