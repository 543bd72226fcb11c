//! What a store's calls record in the process's metrics: latency per operation, page hits and
//! misses per pool, and (for an embedded store) the engine's stats at scrape time under the
//! store's `store` label.
//!
//! Owns: the hot-path handles ([`ClientMetrics`]) and the engine collector of one store. A
//! [`crate::Client`] owns one, and so does each store `kvtier serve` hosts (which reach the
//! [`super::EmbeddedStore`] without a `Client`), so both record exactly the same series.
//!
//! Invariant: when the process publishes no metrics ([`metrics::enabled`] is false at
//! creation) the meter is off: every method is a no-op and `timed` only runs the call.

use std::sync::Arc;
use std::time::Instant;

use kvtier_proto::{ExistsV2Answer, ExistsV2Query};

use super::embedded::EngineSlot;
use crate::batch::PageBatch;
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
