//! The embedded store: a [`kvtier_engine::Engine`] in this process behind the [`Store`] seam.
//!
//! Owns: the engine slot (`None` once closed), the composition of page-batch keys
//! (`prefix ++ page_key ++ suffix`), per-page rollback of puts, and the split of large batches
//! across copy threads. Used by embedded-mode clients and, directly, by `kvtier serve` for its
//! tenants and the cluster node's data port.
//!
//! Two ways in for a page batch, one page loop behind them (`PageBuffers`):
//! - [`Store::put_pages`] / [`Store::get_pages`]: buffers as caller pointers, each checked
//!   against the caller's [`RegionRegistry`] before the engine touches it (embedded clients);
//! - [`EmbeddedStore::put_checked_pages`] / [`EmbeddedStore::get_checked_pages`]: buffers
//!   `kvtier serve` already proved inside a session's mappings ([`CheckedBuffers`]); no
//!   registry is consulted, so a server page batch is bounds-checked once.
//!
//! Invariants:
//! - A page whose put fails leaves none of the components this call stored (they are removed
//!   before the page's result is reported); components that were already present stay.
//! - Closing takes the slot's write lock, so it waits for batches in flight (which hold the
//!   read lock) and every later call sees `None` and fails cleanly.
//! - Every caller buffer is proved inside live caller memory before the engine touches it:
//!   by the registry, or by the [`CheckedBuffers`] that carries it; either way the region's
//!   intact check is asked around the copy.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use kvtier_engine::{
    Engine, EngineConfig, EngineStats, PinnedObject, Placement, PutMeta, PutOutcome,
};
use kvtier_proto::query::compose_key;
use kvtier_proto::{ExistsV2Answer, ExistsV2Query};

use super::checked::CheckedBuffers;
use super::{check_page_shape, Store};
use crate::batch::{BatchResult, MemRef, PageBatch};
use crate::config::KvtierConfig;
use crate::error::ClientError;
use crate::memory::RegionRegistry;

/// A batch is split across copy threads only when each thread gets at least this many bytes:
/// below it, starting a thread costs more than it saves.
pub const PARALLEL_COPY_MIN_BYTES_PER_THREAD: usize = 8 << 20;

/// The embedded engine; `None` once closed. Shared with the metrics collector.
pub type EngineSlot = Arc<RwLock<Option<Engine>>>;

/// An engine in this process (see the module doc).
#[derive(Debug)]
pub struct EmbeddedStore {
    engine: EngineSlot,
    copy_threads: usize,
    rejected_buffers: AtomicU64,
    /// Checked batches refused whole for an inconsistent shape (a caller bug).
    rejected_batches: AtomicU64,
}

/// How a page batch's buffers become bytes: checked against a registry per copy, or proved
/// already ([`CheckedBuffers`]). Buffer `i * C + j` is component `j` of page `i`.
trait PageBuffers: Sync {
    /// Bytes of every buffer together (to decide on copy threads).
    fn total_bytes(&self) -> usize;

    /// Run `f` over buffer `index` with its region's intact check (asked by a put before it
    /// publishes); fails before `f` when the buffer is not (or no longer) caller memory.
    fn with_source<T>(
        &self,
        index: usize,
        f: impl FnOnce(&[u8], &dyn Fn() -> bool) -> T,
    ) -> Result<T, ClientError>;

    /// Run `f` over buffer `index` for writing; fails when it is not caller memory, or was
    /// revoked before or during the copy.
    fn with_destination<T>(
        &self,
        index: usize,
        f: impl FnOnce(&mut [u8]) -> T,
    ) -> Result<T, ClientError>;

    /// Store buffer `index` under `key` (put-if-absent).
    fn put(
        &self,
        engine: &Engine,
        key: &[u8],
        index: usize,
        meta: PutMeta,
    ) -> Result<PutOutcome, ClientError> {
        self.with_source(index, |src, intact| {
            engine.put_verified(key, src, meta, intact)
        })?
        .map_err(Into::into)
    }

    /// Copy the object `key` into buffer `index`.
    fn get(&self, engine: &Engine, key: &[u8], index: usize) -> Result<(), ClientError> {
        self.with_destination(index, |dst| engine.get_into(key, dst))?
            .map_err(Into::into)
    }
}

/// Caller pointers, each checked against the caller's registry when copied.
struct Registered<'a> {
    regions: &'a RegionRegistry,
    buffers: &'a [MemRef],
}

impl PageBuffers for Registered<'_> {
    fn total_bytes(&self) -> usize {
        self.buffers.iter().map(|b| b.len).sum()
    }

    fn with_source<T>(
        &self,
        index: usize,
        f: impl FnOnce(&[u8], &dyn Fn() -> bool) -> T,
    ) -> Result<T, ClientError> {
        let buf = self.buffers[index];
        self.regions.with_checked_source(buf.ptr, buf.len, f)
    }

    fn with_destination<T>(
        &self,
        index: usize,
        f: impl FnOnce(&mut [u8]) -> T,
    ) -> Result<T, ClientError> {
        let buf = self.buffers[index];
        self.regions.with_destination(buf.ptr, buf.len, f)
    }
}

impl PageBuffers for CheckedBuffers {
    fn total_bytes(&self) -> usize {
        CheckedBuffers::total_bytes(self)
    }

    fn with_source<T>(
        &self,
        index: usize,
        f: impl FnOnce(&[u8], &dyn Fn() -> bool) -> T,
    ) -> Result<T, ClientError> {
        CheckedBuffers::with_source(self, index, f)
    }

    fn with_destination<T>(
        &self,
        index: usize,
        f: impl FnOnce(&mut [u8]) -> T,
    ) -> Result<T, ClientError> {
        CheckedBuffers::with_destination(self, index, f)
    }
}

impl EmbeddedStore {
    /// Open the engine; `copy_threads` (at least 1) bounds the threads of one large batch.
    pub fn open(config: EngineConfig, copy_threads: usize) -> Result<EmbeddedStore, ClientError> {
        Ok(EmbeddedStore {
            engine: Arc::new(RwLock::new(Some(Engine::open(config)?))),
            copy_threads: copy_threads.max(1),
            rejected_buffers: AtomicU64::new(0),
            rejected_batches: AtomicU64::new(0),
        })
    }

    /// [`open`](Self::open) with the engine and copy threads `config` describes.
    pub fn from_config(config: &KvtierConfig) -> Result<EmbeddedStore, ClientError> {
        let copy_threads = usize::try_from(config.copy_threads).unwrap_or(1);
        EmbeddedStore::open(config.engine_config(), copy_threads)
    }

    /// Put every component of every page from buffers proved by their owner (put-if-absent,
    /// per-page rollback, copy threads as [`Store::put_pages`]); no registry is consulted.
    /// `buffers` holds `pages x components` buffers in page order; another count fails the
    /// whole batch.
    pub fn put_checked_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &CheckedBuffers,
        depths: Option<&[u32]>,
    ) -> BatchResult {
        match self.refuse_shape(batch, buffers, depths) {
            Some(refused) => refused,
            None => self.put_with(buffers, batch, depths),
        }
    }

    /// Get every component of every page into buffers proved by their owner (see
    /// [`put_checked_pages`](Self::put_checked_pages)).
    pub fn get_checked_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &CheckedBuffers,
    ) -> BatchResult {
        match self.refuse_shape(batch, buffers, None) {
            Some(refused) => refused,
            None => self.get_with(buffers, batch),
        }
    }

    /// The whole batch failed (and counted) when its buffers or depths do not match its shape.
    fn refuse_shape<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &CheckedBuffers,
        depths: Option<&[u32]>,
    ) -> Option<BatchResult> {
        let reason = check_page_shape(batch, buffers.len(), depths).err()?;
        self.rejected_batches.fetch_add(1, Ordering::Relaxed);
        Some(BatchResult::all_failed(batch.pages(), reason))
    }

    /// Checked batches refused whole because their shape was inconsistent.
    pub fn rejected_batches(&self) -> u64 {
        self.rejected_batches.load(Ordering::Relaxed)
    }

    fn put_with<B: PageBuffers, K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        buffers: &B,
        batch: &PageBatch<'_, K, S>,
        depths: Option<&[u32]>,
    ) -> BatchResult {
        self.page_batch(batch, buffers.total_bytes(), |engine, range| {
            self.put_page_range(engine, buffers, batch, depths, range)
        })
    }

    fn get_with<B: PageBuffers, K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        buffers: &B,
        batch: &PageBatch<'_, K, S>,
    ) -> BatchResult {
        self.page_batch(batch, buffers.total_bytes(), |engine, range| {
            self.get_page_range(engine, buffers, batch, range)
        })
    }

    /// The engine slot (for scrape-time collectors).
    pub fn slot(&self) -> &EngineSlot {
        &self.engine
    }

    /// Run `f` on the engine (`None` once closed). Private (issue 28): what callers need of
    /// the engine is a capability of the store ([`Store`]) or a call below.
    fn with_engine<R>(&self, f: impl FnOnce(&Engine) -> R) -> Option<R> {
        self.engine.read().as_ref().map(f)
    }

    /// Remove every object whose key starts with `prefix`; how many (0 once closed).
    pub fn remove_prefix(&self, prefix: &[u8]) -> u64 {
        self.with_engine(|e| e.remove_prefix(prefix)).unwrap_or(0)
    }

    /// Where each of `keys` is, and up to `limit` objects under `prefix` with whether more
    /// were left out (`None` once closed): the `Inspect` document's part of one store.
    pub fn inspect(
        &self,
        keys: &[Vec<u8>],
        prefix: Option<&[u8]>,
        limit: usize,
    ) -> Option<(Vec<Placement>, Vec<Placement>, bool)> {
        self.with_engine(|e| {
            let placed = keys.iter().map(|k| e.placement(k)).collect();
            let (under, truncated) = match prefix {
                Some(prefix) => e.inspect_prefix(prefix, limit),
                None => (Vec::new(), false),
            };
            (placed, under, truncated)
        })
    }

    /// The DRAM arena's base and length (a node's UCX registration of it); `None` once closed.
    pub fn dram_memory(&self) -> Option<(*mut u8, usize)> {
        self.with_engine(Engine::dram_memory)
    }

    fn note(&self, result: &mut BatchResult, key: &[u8], err: &ClientError) {
        if matches!(err, ClientError::OutsideRegisteredMemory { .. }) {
            self.rejected_buffers.fetch_add(1, Ordering::Relaxed);
        }
        result.note_error(format!("{}: {err}", String::from_utf8_lossy(key)));
    }

    /// Run `range_op` over the batch's pages on the open engine (split across copy threads).
    fn page_batch<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
        bytes: usize,
        range_op: impl Fn(&Engine, Range<usize>) -> BatchResult + Sync,
    ) -> BatchResult {
        let guard = self.engine.read();
        let Some(engine) = guard.as_ref() else {
            return BatchResult::all_failed(batch.pages(), ClientError::Closed.to_string());
        };
        self.split_pages(batch.pages(), bytes, |range| range_op(engine, range))
    }

    fn put_page_range<B: PageBuffers, K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        engine: &Engine,
        buffers: &B,
        batch: &PageBatch<'_, K, S>,
        depths: Option<&[u32]>,
        range: Range<usize>,
    ) -> BatchResult {
        let comps = batch.components();
        let mut result = BatchResult::with_capacity(range.len());
        let mut key = Vec::new();
        let mut stored_now: Vec<Vec<u8>> = Vec::new();
        for i in range {
            let page_key = batch.page_keys[i].as_ref();
            let meta = PutMeta {
                depth: depths.map(|d| d[i]),
            };
            stored_now.clear();
            let mut failed = None;
            for (j, suffix) in batch.suffixes.iter().enumerate() {
                compose_key(batch.prefix, page_key, suffix.as_ref(), &mut key);
                match buffers.put(engine, &key, i * comps + j, meta) {
                    Ok(PutOutcome::Stored) => stored_now.push(key.clone()),
                    Ok(PutOutcome::AlreadyPresent) => {}
                    Err(err) => {
                        self.note(&mut result, &key, &err);
                        failed = Some(err.item_failure());
                        break;
                    }
                }
            }
            match failed {
                None => result.push_ok(),
                Some(failure) => {
                    for k in &stored_now {
                        engine.remove(k);
                    }
                    result.push_failed(failure);
                }
            }
        }
        result
    }

    fn get_page_range<B: PageBuffers, K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        engine: &Engine,
        buffers: &B,
        batch: &PageBatch<'_, K, S>,
        range: Range<usize>,
    ) -> BatchResult {
        let comps = batch.components();
        let mut result = BatchResult::with_capacity(range.len());
        let mut key = Vec::new();
        for i in range {
            let page_key = batch.page_keys[i].as_ref();
            let failed = batch.suffixes.iter().enumerate().find_map(|(j, suffix)| {
                compose_key(batch.prefix, page_key, suffix.as_ref(), &mut key);
                buffers.get(engine, &key, i * comps + j).err()
            });
            match failed {
                None => result.push_ok(),
                Some(err) => {
                    // A miss is the normal answer for a cold page; only real problems are
                    // noted (issue 28: the page's failure says which, typed).
                    if !err.is_miss() {
                        self.note(&mut result, &key, &err);
                    }
                    result.push_failed(err.item_failure());
                }
            }
        }
        result
    }

    /// Run `work` over `pages` pages: inline for small batches, else over contiguous page
    /// ranges on up to `copy_threads` threads (this one included). Results keep page order.
    fn split_pages(
        &self,
        pages: usize,
        bytes: usize,
        work: impl Fn(Range<usize>) -> BatchResult + Sync,
    ) -> BatchResult {
        let by_bytes = bytes / PARALLEL_COPY_MIN_BYTES_PER_THREAD;
        let threads = self.copy_threads.min(pages).min(by_bytes.max(1));
        if threads <= 1 {
            return work(0..pages);
        }
        let chunk = pages.div_ceil(threads);
        let ranges: Vec<Range<usize>> = (0..pages)
            .step_by(chunk)
            .map(|start| start..(start + chunk).min(pages))
            .collect();
        let parts: Vec<BatchResult> = std::thread::scope(|scope| {
            let work = &work;
            let handles: Vec<_> = ranges[1..]
                .iter()
                .map(|r| {
                    let r = r.clone();
                    scope.spawn(move || work(r))
                })
                .collect();
            let mut parts = vec![work(ranges[0].clone())];
            for (handle, range) in handles.into_iter().zip(&ranges[1..]) {
                // A panic in a copy thread is a bug; report those pages as failed, not a crash.
                parts.push(handle.join().unwrap_or_else(|_| {
                    BatchResult::all_failed(range.len(), "internal error: copy thread panicked")
                }));
            }
            parts
        });
        let mut merged = BatchResult::with_capacity(pages);
        for part in parts {
            merged.absorb(part);
        }
        merged
    }
}

impl Store for EmbeddedStore {
    fn mode(&self) -> &'static str {
        "embedded"
    }

    fn put_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult {
        self.put_with(&Registered { regions, buffers }, batch, depths)
    }

    fn get_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        regions: &RegionRegistry,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
    ) -> BatchResult {
        self.get_with(&Registered { regions, buffers }, batch)
    }

    fn put_slice(
        &self,
        key: &[u8],
        value: &[u8],
        depth: Option<u32>,
    ) -> Result<PutOutcome, ClientError> {
        let guard = self.engine.read();
        let engine = guard.as_ref().ok_or(ClientError::Closed)?;
        Ok(engine.put(key, value, PutMeta { depth })?)
    }

    fn get_into_slice(&self, key: &[u8], dst: &mut [u8]) -> Result<(), ClientError> {
        let guard = self.engine.read();
        let engine = guard.as_ref().ok_or(ClientError::Closed)?;
        Ok(engine.get_into(key, dst)?)
    }

    fn object_len(&self, key: &[u8]) -> Option<u64> {
        self.engine.read().as_ref().and_then(|e| e.object_len(key))
    }

    fn exists_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        match self.engine.read().as_ref() {
            Some(engine) => keys.iter().map(|k| engine.contains(k.as_ref())).collect(),
            None => vec![false; keys.len()],
        }
    }

    fn exists_pages_prefix<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize {
        let guard = self.engine.read();
        // No components: no page is stored (not every page, as `all` of nothing would say).
        let (Some(engine), 1..) = (guard.as_ref(), batch.components()) else {
            return 0;
        };
        let mut key = Vec::new();
        batch
            .page_keys
            .iter()
            .position(|page_key| {
                !batch.suffixes.iter().all(|s| {
                    compose_key(batch.prefix, page_key.as_ref(), s.as_ref(), &mut key);
                    engine.contains(&key)
                })
            })
            .unwrap_or(batch.pages())
    }

    fn demote_pages<K: AsRef<[u8]>, S: AsRef<[u8]>>(&self, batch: &PageBatch<'_, K, S>) -> usize {
        let guard = self.engine.read();
        let Some(engine) = guard.as_ref() else {
            return 0;
        };
        let mut key = Vec::new();
        let mut marked = 0;
        for page_key in batch.page_keys {
            for suffix in batch.suffixes {
                compose_key(batch.prefix, page_key.as_ref(), suffix.as_ref(), &mut key);
                marked += usize::from(engine.demote(&key));
            }
        }
        marked
    }

    fn exists_v2(&self, query: &ExistsV2Query) -> ExistsV2Answer {
        self.engine
            .read()
            .as_ref()
            .and_then(|e| e.exists_v2(query).ok())
            .unwrap_or_default()
    }

    fn remove_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        match self.engine.read().as_ref() {
            Some(engine) => keys.iter().filter(|k| engine.remove(k.as_ref())).count(),
            None => 0,
        }
    }

    fn clear(&self) {
        if let Some(engine) = self.engine.read().as_ref() {
            engine.clear();
        }
    }

    fn flush(&self) -> Result<(), ClientError> {
        match self.engine.read().as_ref() {
            Some(engine) => Ok(engine.flush()?),
            None => Err(ClientError::Closed),
        }
    }

    fn close(&self) {
        // Waits for batches in flight; dropping flushes the SSD tier and frees its directory
        // for the next store.
        if let Some(engine) = self.engine.write().take() {
            if let Err(e) = engine.close() {
                tracing::warn!(error = %e, "kvtier: flushing the store at close failed");
            }
        }
    }

    fn engine_stats(&self) -> EngineStats {
        self.engine
            .read()
            .as_ref()
            .map(Engine::stats)
            .unwrap_or_default()
    }

    fn rejected_buffers(&self) -> u64 {
        self.rejected_buffers.load(Ordering::Relaxed)
    }

    fn pin(&self, key: &[u8]) -> Option<PinnedObject> {
        self.engine.read().as_ref().and_then(|e| e.pin(key))
    }

    fn touch_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        self.with_engine(|e| keys.iter().filter(|k| e.touch(k.as_ref())).count())
            .unwrap_or(0)
    }

    fn touch_groups<K: AsRef<[u8]>>(&self, groups: &[K]) -> usize {
        self.with_engine(|e| groups.iter().filter(|g| e.touch_group(g.as_ref())).count())
            .unwrap_or(0)
    }

    fn enable_events(&self, capacity: usize) -> bool {
        self.with_engine(|e| e.enable_events(capacity)).is_some()
    }

    fn enable_media_events(&self, capacity: usize) -> bool {
        self.with_engine(|e| e.enable_media_events(capacity))
            .is_some()
    }

    fn drain_events(&self, max: usize) -> Option<kvtier_engine::eviction::events::Drained> {
        self.with_engine(|e| e.drain_events(max))
    }

    fn placement(&self, key: &[u8]) -> Option<kvtier_engine::Placement> {
        self.with_engine(|e| e.placement(key))
    }

    fn held_groups(&self) -> Option<super::HeldGroups> {
        self.with_engine(Engine::held_groups)
    }

    fn group_stats(&self) -> Option<(u64, u64)> {
        self.with_engine(Engine::group_stats)
    }
}
