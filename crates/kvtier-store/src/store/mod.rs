//! The store seam: one [`Store`] trait for page batches and whole-key calls, three
//! implementations, and the [`Stores`] enum a `Client` (kvtier-client) owns.
//!
//! - [`embedded::EmbeddedStore`]: an engine in this process, key composition, per-page
//!   rollback and the copy threads. `kvtier serve` hosts its tenants' stores and a cluster
//!   node's store with it directly, passing page buffers it proved inside a session's
//!   mappings as [`checked::CheckedBuffers`] (one bounds check, no registry).
//! - [`local_server::LocalServerStore`]: a session with a local `kvtier serve` (server mode).
//! - [`cluster`]: the trait over [`crate::cluster::ClusterStore`] (cluster mode); the cluster
//!   internals stay in `cluster/`.
//!
//! Beside them: [`checked`] (buffers proved by their owner, and the [`checked::SharedRegion`]
//! contract of server-mapped memory) and [`meter`] ([`Metered`]: the one wrapper that records
//! a store's calls in the metrics, for the `Client` and `kvtier serve`'s stores).
//!
//! Issue 28: the trait is each store's one API (the server and cluster stores have no
//! same-named calls of their own beside it), and what callers used to reach an embedded
//! engine for (recency hints, the page-group event log, group stats) are capabilities every
//! store answers ([`Store::touch_keys`], [`Store::enable_events`], ...; a store whose engine
//! is in another process answers that it has none).
//!
//! Contract every implementation keeps (the `Client` relies on it and adds nothing):
//! - Calls never panic on caller input; a bad buffer, a size mismatch or a full store is a
//!   `false` for that item, its typed failure ([`BatchResult::failure`], issue 28) and a
//!   reason in the [`BatchResult`]; a miss is typed too and carries no message.
//! - `put_pages`: `ok[i]` is true when every component of page `i` is visible (stored now or
//!   already). A page that fails leaves none of the components this call stored behind
//!   (per-page rollback). The cluster store's rollback is best effort across processes: see
//!   [`cluster::PAGE_ROLLBACK`].
//! - `get_pages`: `ok[i]` is true when every component of page `i` was copied; a miss is not an
//!   error message.
//! - Buffers are checked against the caller's [`RegionRegistry`] before a byte is touched
//!   (zero-copy buffers of the local-server store are checked by the server instead).
//!
//! The caller (the `Client`) has already checked the batch shape ([`check_page_shape`]:
//! buffers = pages x components, one depth per page) and that the client is open:
//! implementations index `buffers[i * C + j]` and `depths[i]` without checking again.
//!
//! Why an enum and not `Box<dyn Store>`: the page calls are generic over the key types (no
//! copy of SGLang's key lists), which a trait object cannot carry, and a `match` on three
//! variants costs nothing next to a page copy.

pub mod checked;
pub mod cluster;
pub mod embedded;
pub mod local_server;
pub mod meter;

use kvtier_engine::{EngineStats, PinnedObject, PutOutcome};
use kvtier_proto::{ExistsV2Answer, ExistsV2Query};

use crate::batch::{BatchResult, MemRef, PageBatch};
use crate::cluster::ClusterStore;
use crate::error::ClientError;
use crate::memory::RegionRegistry;

pub use checked::{CheckedBuffers, OutsideRegion, SharedRegion};
pub use embedded::EmbeddedStore;
/// The page groups an engine holds, `(DRAM, SSD)` ([`Store::held_groups`]).
pub use kvtier_engine::eviction::events::HeldGroups;
pub use local_server::LocalServerStore;
pub use meter::{Metered, StoreMeter};

/// Check a page batch's buffer count and depths against its shape (`pages x components`
/// buffers, one depth per page, at least one component when there are pages).
pub fn check_page_shape<K: AsRef<[u8]>, S: AsRef<[u8]>>(
    batch: &PageBatch<'_, K, S>,
    buffers: usize,
    depths: Option<&[u32]>,
) -> Result<(), String> {
    let (pages, comps) = (batch.pages(), batch.components());
    if comps == 0 && pages > 0 {
        return Err("a page batch needs at least one component suffix".into());
    }
    if buffers != pages * comps {
        return Err(format!(
            "{buffers} buffers for {pages} pages x {comps} components (want {})",
            pages * comps
        ));
    }
    if let Some(d) = depths {
        if d.len() != pages {
            return Err(format!("{} depths for {pages} pages", d.len()));
        }
    }
    Ok(())
}

/// Page batches and whole-key calls over one place objects live (see the module doc).
pub trait Store: Send + Sync {
    /// `"embedded"`, `"server"` or `"cluster"`.
    fn mode(&self) -> &'static str;

    /// Put every component of every page (put-if-absent, per-page rollback).
    fn put_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult;

    /// Get every component of every page into caller memory.
    fn get_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
    ) -> BatchResult;

    /// Store bytes the caller owns as a slice (the legacy tensor path).
    fn put_slice(
        &self,
        key: &[u8],
        value: &[u8],
        depth: Option<u32>,
    ) -> Result<PutOutcome, ClientError>;

    /// Copy an object into a slice; its length must match. A miss is `Engine(NotFound)`.
    fn get_into_slice(&self, key: &[u8], dst: &mut [u8]) -> Result<(), ClientError>;

    /// The object's length when known (`None` when absent or unknown).
    fn object_len(&self, key: &[u8]) -> Option<u64>;

    fn exists_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool>;

    /// Number of leading pages whose every component exists.
    fn exists_pages_prefix<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize;

    /// Mark every component of these pages superseded window state; how many were marked.
    fn demote_pages<K: AsRef<[u8]>, S: AsRef<[u8]>>(&self, batch: &PageBatch<'_, K, S>) -> usize;

    /// One whole v2 existence query (already checked with `check_work`).
    fn exists_v2(&self, query: &ExistsV2Query) -> ExistsV2Answer;

    /// Remove whole keys; how many were held.
    fn remove_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize;

    fn clear(&self);

    /// Make every acknowledged put as durable as the configuration promises.
    fn flush(&self) -> Result<(), ClientError>;

    /// Release the store (later calls fail or answer empty). Called once.
    fn close(&self);

    /// The engine's counters (embedded only; zero elsewhere).
    fn engine_stats(&self) -> EngineStats {
        EngineStats::default()
    }

    /// Buffers this store refused because they were outside registered memory.
    fn rejected_buffers(&self) -> u64 {
        0
    }

    /// Pin `key` for reading in place (embedded only).
    fn pin(&self, _key: &[u8]) -> Option<PinnedObject> {
        None
    }

    /// Refresh the recency of each key's page group in DRAM (an eviction hint); how many
    /// keys were in DRAM (0 where the engine is not in this process).
    fn touch_keys<K: AsRef<[u8]>>(&self, _keys: &[K]) -> usize {
        0
    }

    /// Refresh the recency of each page group (`[tag/]page_hash@`) in DRAM; how many were
    /// there (0 where the engine is not in this process).
    fn touch_groups<K: AsRef<[u8]>>(&self, _groups: &[K]) -> usize {
        0
    }

    /// Start recording page-group events into a ring of `capacity`; false where the engine
    /// is not in this process (its events happen elsewhere).
    fn enable_events(&self, _capacity: usize) -> bool {
        false
    }

    /// [`Store::enable_events`], and with the SSD tier on also its `SsdStored` /
    /// `SsdRemoved` events (issue 30: the KV-event streams name each block's medium).
    fn enable_media_events(&self, _capacity: usize) -> bool {
        false
    }

    /// Take up to `max` of the oldest page-group events (`None`: no engine here, or closed).
    fn drain_events(&self, _max: usize) -> Option<kvtier_engine::eviction::events::Drained> {
        None
    }

    /// Where `key` is in this process's engine, DRAM and SSD (`None`: no engine here).
    fn placement(&self, _key: &[u8]) -> Option<kvtier_engine::Placement> {
        None
    }

    /// The page groups this process's engine holds now, `(DRAM, SSD)`, for a consumer of its
    /// events that lost some (`None`: no engine here); see `Engine::held_groups`.
    fn held_groups(&self) -> Option<HeldGroups> {
        None
    }

    /// `(groups evicted whole, groups tracked)` of the DRAM tier (`None`: no engine here).
    fn group_stats(&self) -> Option<(u64, u64)> {
        None
    }
}

/// The one store a `Client` (kvtier-client) owns.
#[derive(Debug)]
pub enum Stores {
    Embedded(EmbeddedStore),
    Server(Box<LocalServerStore>),
    Cluster(Box<ClusterStore>),
}

/// Forward one call to the variant's [`Store`] implementation.
macro_rules! forward {
    ($self:ident, $method:ident($($arg:expr),*)) => {
        match $self {
            Stores::Embedded(s) => Store::$method(s, $($arg),*),
            Stores::Server(s) => Store::$method(&**s, $($arg),*),
            Stores::Cluster(s) => Store::$method(&**s, $($arg),*),
        }
    };
}

impl Store for Stores {
    fn mode(&self) -> &'static str {
        forward!(self, mode())
    }

    fn put_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult {
        forward!(self, put_pages(regions, batch, buffers, depths))
    }

    fn get_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
    ) -> BatchResult {
        forward!(self, get_pages(regions, batch, buffers))
    }

    fn put_slice(
        &self,
        key: &[u8],
        value: &[u8],
        depth: Option<u32>,
    ) -> Result<PutOutcome, ClientError> {
        forward!(self, put_slice(key, value, depth))
    }

    fn get_into_slice(&self, key: &[u8], dst: &mut [u8]) -> Result<(), ClientError> {
        forward!(self, get_into_slice(key, dst))
    }

    fn object_len(&self, key: &[u8]) -> Option<u64> {
        forward!(self, object_len(key))
    }

    fn exists_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        forward!(self, exists_keys(keys))
    }

    fn exists_pages_prefix<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize {
        forward!(self, exists_pages_prefix(batch))
    }

    fn demote_pages<K: AsRef<[u8]>, S: AsRef<[u8]>>(&self, batch: &PageBatch<'_, K, S>) -> usize {
        forward!(self, demote_pages(batch))
    }

    fn exists_v2(&self, query: &ExistsV2Query) -> ExistsV2Answer {
        forward!(self, exists_v2(query))
    }

    fn remove_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        forward!(self, remove_keys(keys))
    }

    fn clear(&self) {
        forward!(self, clear())
    }

    fn flush(&self) -> Result<(), ClientError> {
        forward!(self, flush())
    }

    fn close(&self) {
        forward!(self, close())
    }

    fn engine_stats(&self) -> EngineStats {
        forward!(self, engine_stats())
    }

    fn rejected_buffers(&self) -> u64 {
        forward!(self, rejected_buffers())
    }

    fn pin(&self, key: &[u8]) -> Option<PinnedObject> {
        forward!(self, pin(key))
    }

    fn touch_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        forward!(self, touch_keys(keys))
    }

    fn touch_groups<K: AsRef<[u8]>>(&self, groups: &[K]) -> usize {
        forward!(self, touch_groups(groups))
    }

    fn enable_events(&self, capacity: usize) -> bool {
        forward!(self, enable_events(capacity))
    }

    fn enable_media_events(&self, capacity: usize) -> bool {
        forward!(self, enable_media_events(capacity))
    }

    fn drain_events(&self, max: usize) -> Option<kvtier_engine::eviction::events::Drained> {
        forward!(self, drain_events(max))
    }

    fn placement(&self, key: &[u8]) -> Option<kvtier_engine::Placement> {
        forward!(self, placement(key))
    }

    fn held_groups(&self) -> Option<HeldGroups> {
        forward!(self, held_groups())
    }

    fn group_stats(&self) -> Option<(u64, u64)> {
        forward!(self, group_stats())
    }
}

/// A page batch as the server protocol's [`kvtier_proto::server::PageKeys`].
pub(crate) fn page_keys_message<K: AsRef<[u8]>, S: AsRef<[u8]>>(
    batch: &PageBatch<'_, K, S>,
) -> kvtier_proto::server::PageKeys {
    kvtier_proto::server::PageKeys {
        prefix: batch.prefix.to_vec(),
        page_keys: batch
            .page_keys
            .iter()
            .map(|k| k.as_ref().to_vec())
            .collect(),
        suffixes: batch.suffixes.iter().map(|s| s.as_ref().to_vec()).collect(),
    }
}

/// Owned copies of whole keys (the wire and RPC calls take `Vec<u8>` keys).
pub(crate) fn owned_keys<K: AsRef<[u8]>>(keys: &[K]) -> Vec<Vec<u8>> {
    keys.iter().map(|k| k.as_ref().to_vec()).collect()
}
