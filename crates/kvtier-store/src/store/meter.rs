//! What a store's calls record in the process's metrics: latency per operation, page hits and
//! misses per pool, and (for an embedded store) the engine's stats at scrape time under the
//! store's `store` label.
//!
//! Owns: the hot-path handles ([`ClientMetrics`]) and the engine collector of one store, and
//! [`Metered`], the one wrapper that records a store's calls (issue 28: there were two ways
//! of counting). A `kvtier_client::Client` holds a `Metered<Stores>`, and each store
//! `kvtier serve` hosts a `Metered<EmbeddedStore>` (reached without a `Client`; its page
//! batches come as [`CheckedBuffers`]), so both record exactly the same series through the
//! same code.
//!
//! Invariant: when the process publishes no metrics ([`metrics::enabled`] is false at
//! creation) the meter is off: every method is a no-op and `timed` only runs the call.

use std::sync::Arc;
use std::time::Instant;

use kvtier_proto::{ExistsV2Answer, ExistsV2Query};

use kvtier_engine::{EngineStats, PinnedObject, PutOutcome};

use super::checked::CheckedBuffers;
use super::embedded::{EmbeddedStore, EngineSlot};
use super::Store;
use crate::batch::{BatchResult, MemRef, PageBatch};
use crate::error::ClientError;
use crate::memory::RegionRegistry;
use crate::metrics::{self, ClientMetrics, Collector, Lookup, Op, Samples};

/// Publishes an embedded engine's stats at scrape time under its `store` label.
struct EngineCollector {
    store: String,
    engine: EngineSlot,
}

impl Collector for EngineCollector {
    fn collect(&self, out: &mut Samples) {
        if let Some(engine) = self.engine.read().as_ref() {
            metrics::engine_samples(&self.store, &engine.stats(), out);
        }
    }
}

/// One store's part in the process's metrics (see the module doc).
#[derive(Default)]
pub struct StoreMeter {
    handles: Option<ClientMetrics>,
    /// Kept alive here; the metrics registry holds it weakly.
    _collector: Option<Arc<dyn Collector>>,
}

impl std::fmt::Debug for StoreMeter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreMeter")
            .field("on", &self.is_on())
            .finish_non_exhaustive()
    }
}

impl StoreMeter {
    /// A meter that records when the process publishes metrics; `engine`, when given, is
    /// published at scrape time under `store` (its `store` label).
    pub fn new(store: &str, engine: Option<&EngineSlot>) -> StoreMeter {
        if !metrics::enabled() {
            return StoreMeter::default();
        }
        let collector = engine.map(|slot| {
            let c: Arc<dyn Collector> = Arc::new(EngineCollector {
                store: store.to_string(),
                engine: Arc::clone(slot),
            });
            metrics::register_collector(Arc::downgrade(&c));
            c
        });
        StoreMeter {
            handles: Some(ClientMetrics::new()),
            _collector: collector,
        }
    }

    pub fn is_on(&self) -> bool {
        self.handles.is_some()
    }

    /// Run `f`, timed as one call of `op`.
    pub fn timed<R>(&self, op: Op, f: impl FnOnce() -> R) -> R {
        match &self.handles {
            None => f(),
            Some(m) => {
                let start = Instant::now();
                let r = f();
                m.observe(op, start);
                r
            }
        }
    }

    fn count_pool(&self, pool: &str, lookup: Lookup, hits: usize, asked: usize) {
        if let Some(m) = &self.handles {
            m.pool(pool, lookup, hits as u64, asked.saturating_sub(hits) as u64);
        }
    }

    /// A single-key get (`get_into_slice`, `pin`) in its pool's lookup counters.
    pub fn count_get(&self, key: &[u8], hit: bool) {
        if self.is_on() {
            self.count_pool(metrics::pool_of(key), Lookup::Get, usize::from(hit), 1);
        }
    }

    /// A page batch's `hits` of its pages, as gets or existence checks.
    pub fn count_pages<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
        lookup: Lookup,
        hits: usize,
    ) {
        if self.is_on() {
            let pool = metrics::pool_of_batch(batch.page_keys, batch.suffixes);
            self.count_pool(pool, lookup, hits, batch.pages());
        }
    }

    /// Whole-key existence checks, each in its key's pool.
    pub fn count_exists_keys<K: AsRef<[u8]>>(&self, keys: &[K], found: &[bool]) {
        if self.is_on() {
            for (key, hit) in keys.iter().zip(found) {
                self.count_pool(
                    metrics::pool_of(key.as_ref()),
                    Lookup::Exists,
                    usize::from(*hit),
                    1,
                );
            }
        }
    }

    /// A v2 existence query: its pages per pool it asked about (`kv` and each side pool).
    pub fn count_exists_v2(&self, query: &ExistsV2Query, answer: &ExistsV2Answer) {
        if !self.is_on() {
            return;
        }
        let pages = query.page_keys.len();
        let hit_of = |name: &str| {
            answer
                .pool_hit_pages
                .iter()
                .find(|(n, _)| n == name)
                .map_or(0, |(_, h)| *h as usize)
        };
        if matches!(query.kv, kvtier_proto::query::KvComponents::Suffixes(_)) {
            self.count_pool("kv", Lookup::Exists, hit_of("kv"), pages);
        }
        for pool in &query.pools {
            let label = metrics::pool_label(&pool.name);
            self.count_pool(label, Lookup::Exists, hit_of(&pool.name), pages);
        }
    }
}

/// A store whose every call is recorded by its [`StoreMeter`] (see the module doc): latency
/// per operation, and page or key lookups per pool for gets and existence checks.
#[derive(Debug)]
pub struct Metered<S> {
    store: S,
    meter: StoreMeter,
}

impl<S: Store> Metered<S> {
    pub fn new(store: S, meter: StoreMeter) -> Metered<S> {
        Metered { store, meter }
    }

    /// The store itself (its own capabilities: a server session's memfds, an embedded
    /// engine's inspection), unmetered.
    pub fn inner(&self) -> &S {
        &self.store
    }

    pub fn meter(&self) -> &StoreMeter {
        &self.meter
    }
}

impl Metered<EmbeddedStore> {
    /// [`EmbeddedStore::put_checked_pages`], timed as a put.
    pub fn put_checked_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &CheckedBuffers,
        depths: Option<&[u32]>,
    ) -> BatchResult {
        self.meter.timed(Op::Put, || {
            self.store.put_checked_pages(batch, buffers, depths)
        })
    }

    /// [`EmbeddedStore::get_checked_pages`], timed as a get, its pages counted.
    pub fn get_checked_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &CheckedBuffers,
    ) -> BatchResult {
        let result = self
            .meter
            .timed(Op::Get, || self.store.get_checked_pages(batch, buffers));
        self.meter
            .count_pages(batch, Lookup::Get, result.succeeded());
        result
    }
}

impl<T: Store> Store for Metered<T> {
    fn mode(&self) -> &'static str {
        self.store.mode()
    }

    fn put_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult {
        self.meter.timed(Op::Put, || {
            self.store.put_pages(regions, batch, buffers, depths)
        })
    }

    fn get_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
    ) -> BatchResult {
        let result = self
            .meter
            .timed(Op::Get, || self.store.get_pages(regions, batch, buffers));
        self.meter
            .count_pages(batch, Lookup::Get, result.succeeded());
        result
    }

    fn put_slice(
        &self,
        key: &[u8],
        value: &[u8],
        depth: Option<u32>,
    ) -> Result<PutOutcome, ClientError> {
        self.meter
            .timed(Op::Put, || self.store.put_slice(key, value, depth))
    }

    fn get_into_slice(&self, key: &[u8], dst: &mut [u8]) -> Result<(), ClientError> {
        let result = self
            .meter
            .timed(Op::Get, || self.store.get_into_slice(key, dst));
        self.meter.count_get(key, result.is_ok());
        result
    }

    fn object_len(&self, key: &[u8]) -> Option<u64> {
        self.store.object_len(key)
    }

    fn exists_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        let found = self
            .meter
            .timed(Op::Exists, || self.store.exists_keys(keys));
        self.meter.count_exists_keys(keys, &found);
        found
    }

    fn exists_pages_prefix<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize {
        let hit = self
            .meter
            .timed(Op::Exists, || self.store.exists_pages_prefix(batch));
        self.meter.count_pages(batch, Lookup::Exists, hit);
        hit
    }

    fn demote_pages<K: AsRef<[u8]>, S: AsRef<[u8]>>(&self, batch: &PageBatch<'_, K, S>) -> usize {
        self.store.demote_pages(batch)
    }

    fn exists_v2(&self, query: &ExistsV2Query) -> ExistsV2Answer {
        let answer = self
            .meter
            .timed(Op::ExistsV2, || self.store.exists_v2(query));
        self.meter.count_exists_v2(query, &answer);
        answer
    }

    fn remove_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        self.meter
            .timed(Op::Remove, || self.store.remove_keys(keys))
    }

    fn clear(&self) {
        self.meter.timed(Op::Clear, || self.store.clear());
    }

    fn flush(&self) -> Result<(), ClientError> {
        self.meter.timed(Op::Flush, || self.store.flush())
    }

    fn close(&self) {
        self.store.close();
    }

    fn engine_stats(&self) -> EngineStats {
        self.store.engine_stats()
    }

    fn rejected_buffers(&self) -> u64 {
        self.store.rejected_buffers()
    }

    /// Counted as a get (latency, pool lookup).
    fn pin(&self, key: &[u8]) -> Option<PinnedObject> {
        let pinned = self.meter.timed(Op::Get, || self.store.pin(key));
        self.meter.count_get(key, pinned.is_some());
        pinned
    }

    fn touch_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        self.store.touch_keys(keys)
    }

    fn touch_groups<K: AsRef<[u8]>>(&self, groups: &[K]) -> usize {
        self.store.touch_groups(groups)
    }

    fn enable_events(&self, capacity: usize) -> bool {
        self.store.enable_events(capacity)
    }

    fn enable_media_events(&self, capacity: usize) -> bool {
        self.store.enable_media_events(capacity)
    }

    fn drain_events(&self, max: usize) -> Option<kvtier_engine::eviction::events::Drained> {
        self.store.drain_events(max)
    }

    fn placement(&self, key: &[u8]) -> Option<kvtier_engine::Placement> {
        self.store.placement(key)
    }

    fn held_groups(&self) -> Option<super::HeldGroups> {
        self.store.held_groups()
    }

    fn group_stats(&self) -> Option<(u64, u64)> {
        self.store.group_stats()
    }
}
