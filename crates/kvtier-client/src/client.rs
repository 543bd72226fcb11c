//! [`Client`]: the store as every front end sees it.
//!
//! It owns the mode's store (embedded: a [`kvtier_engine::Engine`] in this process; server
//! mode: a [`RemoteStore`] session with a local `kvtier serve`), the registry of caller memory,
//! and the key composition of page batches. Every method is safe to
//! call from many threads at once and never panics on caller input: a bad buffer, a size
//! mismatch or a full store is a `false` for that item plus a reason in the result.
// A named unsafe module (issue 16 lints): registering caller memory is an unsafe contract.
#![allow(unsafe_code)]

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::RwLock;

use kvtier_engine::{Engine, EngineError, EngineStats, PinnedObject, PutMeta, PutOutcome};
use kvtier_proto::query::compose_key;
use kvtier_proto::{ExistsV2Answer, ExistsV2Query};
use serde::Serialize;

use crate::batch::{BatchResult, MemRef, PageBatch};
use crate::cluster::ClusterStore;
use crate::config::KvtierConfig;
use crate::error::ClientError;
use crate::memory::{RegionId, RegionInfo, RegionRegistry};
use crate::metrics::{self, ClientMetrics, Collector, Endpoint, Lookup, Op, Samples};
use crate::remote::RemoteStore;

/// Counters the client keeps on top of the engine's.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClientStats {
    #[serde(flatten)]
    pub engine: EngineStats,
    /// Buffers refused because they were outside registered memory.
    pub rejected_buffers: u64,
    /// Batches refused whole because their shape was inconsistent.
    pub rejected_batches: u64,
    pub registered_regions: u64,
    pub registered_bytes: u64,
}

/// A batch is split across copy threads only when each thread gets at least this many bytes:
/// below it, starting a thread costs more than it saves.
pub const PARALLEL_COPY_MIN_BYTES_PER_THREAD: usize = 8 << 20;

/// The embedded engine; `None` once closed.
type EngineSlot = Arc<RwLock<Option<Engine>>>;

/// Where the objects live.
#[derive(Debug)]
enum Backend {
    Cluster(Box<ClusterStore>),
    /// `None` once closed: closing drops the engine (flushing the SSD tier and releasing its
    /// directory), after the batches in flight, which hold the read lock, are done.
    Embedded(EngineSlot),
    Server(Box<RemoteStore>),
}

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

/// A client's part in the process's metrics (present when the process publishes metrics).
struct ClientObservability {
    handles: ClientMetrics,
    /// The endpoint this client's `metrics_addr` asked for.
    endpoint: Option<Arc<Endpoint>>,
    /// Kept alive here; the metrics registry holds it weakly.
    _collector: Option<Arc<dyn Collector>>,
}

pub struct Client {
    config: KvtierConfig,
    copy_threads: usize,
    backend: Backend,
    regions: RegionRegistry,
    closed: AtomicBool,
    rejected_buffers: AtomicU64,
    rejected_batches: AtomicU64,
    metrics: Option<ClientObservability>,
}

impl Client {
    /// Open the store the configuration describes: embedded, server mode when
    /// `server_socket` is set, cluster mode when `master_address` is set (both connect right
    /// away, so a wrong socket or an unreachable master fails here). Its metrics
    /// carry `store="<extra_backend_tag>"` (`default` without a tag).
    pub fn open(config: KvtierConfig) -> Result<Client, ClientError> {
        let label = config
            .extra_backend_tag
            .clone()
            .unwrap_or_else(|| "default".into());
        Client::open_as(config, &label)
    }

    /// [`open`](Self::open) with the `store` label its metrics carry (`kvtier serve` names its
    /// stores `main` and `tenant:<name>`). With `metrics_addr` set, the endpoint is started
    /// first, so an address in use fails the open. Whenever the process publishes metrics,
    /// this client records into them.
    pub fn open_as(config: KvtierConfig, store: &str) -> Result<Client, ClientError> {
        let endpoint = match &config.metrics_addr {
            Some(addr) => Some(metrics::serve(addr)?),
            None => None,
        };
        let backend = if config.master_address.is_some() {
            Backend::Cluster(Box::new(ClusterStore::open(&config)?))
        } else if config.server_socket.is_some() {
            Backend::Server(Box::new(RemoteStore::connect(&config)?))
        } else {
            Backend::Embedded(Arc::new(RwLock::new(Some(Engine::open(
                config.engine_config(),
            )?))))
        };
        let observability = metrics::enabled().then(|| {
            let collector: Option<Arc<dyn Collector>> = match &backend {
                Backend::Embedded(slot) => Some(Arc::new(EngineCollector {
                    store: store.to_string(),
                    engine: Arc::clone(slot),
                })),
                Backend::Server(_) | Backend::Cluster(_) => None,
            };
            if let Some(c) = &collector {
                metrics::register_collector(Arc::downgrade(c));
            }
            ClientObservability {
                handles: ClientMetrics::new(),
                endpoint,
                _collector: collector,
            }
        });
        let copy_threads = usize::try_from(config.copy_threads).unwrap_or(1).max(1);
        Ok(Client {
            config,
            copy_threads,
            backend,
            regions: RegionRegistry::new(),
            closed: AtomicBool::new(false),
            rejected_buffers: AtomicU64::new(0),
            rejected_batches: AtomicU64::new(0),
            metrics: observability,
        })
    }

    /// The bound address of the metrics endpoint this client's `metrics_addr` started.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics.as_ref()?.endpoint.as_ref().map(|e| e.addr())
    }

    /// Time `f` as one call of `op` when metrics are on.
    fn timed<R>(&self, op: Op, f: impl FnOnce() -> R) -> R {
        match &self.metrics {
            None => f(),
            Some(m) => {
                let start = Instant::now();
                let r = f();
                m.handles.observe(op, start);
                r
            }
        }
    }

    /// Count pool lookups when metrics are on.
    /// A single-key get (`get_into_slice`, `pin`) in its pool's lookup counters.
    fn count_one_get(&self, key: &[u8], hit: bool) {
        if self.metrics.is_some() {
            self.count_pool(metrics::pool_of(key), Lookup::Get, usize::from(hit), 1);
        }
    }

    fn count_pool(&self, pool: &str, lookup: Lookup, hits: usize, asked: usize) {
        if let Some(m) = &self.metrics {
            m.handles
                .pool(pool, lookup, hits as u64, asked.saturating_sub(hits) as u64);
        }
    }

    pub fn config(&self) -> &KvtierConfig {
        &self.config
    }

    /// Register caller memory that later batches may read or write.
    ///
    /// # Safety
    /// See [`RegionRegistry::register`]: the range must stay valid until unregistered or until
    /// this client is dropped.
    pub unsafe fn register_region(
        &self,
        ptr: usize,
        len: usize,
        label: &str,
    ) -> Result<RegionId, ClientError> {
        // SAFETY: forwarded contract, see the function docs.
        unsafe { self.regions.register(ptr, len, label) }
    }

    /// [`register_region`](Self::register_region) of memory its owner can revoke (a server's
    /// mapping of a client memfd that is not sealed against shrinking): `intact` is asked after
    /// every copy, and a copy that touched revoked memory fails (a put stores nothing).
    ///
    /// # Safety
    /// As [`RegionRegistry::register_checked`].
    pub unsafe fn register_region_checked(
        &self,
        ptr: usize,
        len: usize,
        label: &str,
        intact: crate::memory::RegionIntact,
    ) -> Result<RegionId, ClientError> {
        // SAFETY: forwarded contract, see the function docs.
        unsafe { self.regions.register_checked(ptr, len, label, Some(intact)) }
    }

    /// Register caller memory that is `[fd_offset, fd_offset+len)` of the memfd `fd`. Server
    /// mode passes the memfd to the server, which then copies pages straight between its tiers
    /// and this memory (zero copy); embedded mode just registers the range.
    ///
    /// # Safety
    /// As [`register_region`](Self::register_region); and the memfd range must be exactly the
    /// memory mapped at `ptr`.
    pub unsafe fn register_memfd(
        &self,
        ptr: usize,
        len: usize,
        fd: std::os::fd::BorrowedFd<'_>,
        fd_offset: u64,
        label: &str,
    ) -> Result<RegionId, ClientError> {
        // SAFETY: forwarded contract, see the function docs.
        let id = unsafe { self.regions.register(ptr, len, label) }?;
        if let Backend::Server(remote) = &self.backend {
            if let Err(e) = remote.register_memfd(id, ptr, len, fd, fd_offset, label) {
                self.regions.unregister(id);
                return Err(e);
            }
        }
        Ok(id)
    }

    pub fn unregister_region(&self, id: RegionId) -> bool {
        if let Backend::Server(remote) = &self.backend {
            remote.unregister(id);
        }
        self.regions.unregister(id)
    }

    /// `"embedded"`, `"server"` or `"cluster"`.
    pub fn mode(&self) -> &'static str {
        match self.backend {
            Backend::Embedded(_) => "embedded",
            Backend::Server(_) => "server",
            Backend::Cluster(_) => "cluster",
        }
    }

    /// The cluster store (cluster mode only).
    pub fn cluster(&self) -> Option<&ClusterStore> {
        match &self.backend {
            Backend::Cluster(c) => Some(c),
            _ => None,
        }
    }

    /// Regions the server maps directly (server mode; 0 in embedded mode).
    pub fn zero_copy_regions(&self) -> usize {
        match &self.backend {
            Backend::Embedded(_) | Backend::Cluster(_) => 0,
            Backend::Server(remote) => remote.zero_copy_regions(),
        }
    }

    pub fn regions(&self) -> Vec<RegionInfo> {
        self.regions.regions()
    }

    /// Issue 18 hook: the region registry, for `ranged` (destination checks of ranged gets).
    pub(crate) fn region_registry(&self) -> &RegionRegistry {
        &self.regions
    }

    fn ensure_open(&self) -> Result<(), ClientError> {
        if self.closed.load(Ordering::Acquire) {
            Err(ClientError::Closed)
        } else {
            Ok(())
        }
    }

    /// Check a page batch's buffers and depths against its shape.
    fn check_page_shape<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> Result<(), String> {
        let (pages, comps) = (batch.pages(), batch.components());
        if comps == 0 && pages > 0 {
            return Err("a page batch needs at least one component suffix".into());
        }
        if buffers.len() != pages * comps {
            return Err(format!(
                "{} buffers for {pages} pages x {comps} components (want {})",
                buffers.len(),
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

    fn reject_batch(&self, items: usize, reason: String) -> BatchResult {
        self.rejected_batches.fetch_add(1, Ordering::Relaxed);
        BatchResult::all_failed(items, reason)
    }

    fn note(&self, result: &mut BatchResult, key: &[u8], err: &ClientError) {
        if matches!(err, ClientError::OutsideRegisteredMemory { .. }) {
            self.rejected_buffers.fetch_add(1, Ordering::Relaxed);
        }
        result.note_error(format!("{}: {err}", String::from_utf8_lossy(key)));
    }

    /// Store one object from caller memory (put-if-absent).
    fn put_one(
        engine: &Engine,
        regions: &RegionRegistry,
        key: &[u8],
        buf: MemRef,
        depth: Option<u32>,
    ) -> Result<PutOutcome, ClientError> {
        let meta = PutMeta { depth };
        regions
            .with_checked_source(buf.ptr, buf.len, |src, intact| {
                engine.put_verified(key, src, meta, intact)
            })?
            .map_err(Into::into)
    }

    fn get_one(
        engine: &Engine,
        regions: &RegionRegistry,
        key: &[u8],
        buf: MemRef,
    ) -> Result<(), ClientError> {
        regions
            .with_destination(buf.ptr, buf.len, |dst| engine.get_into(key, dst))?
            .map_err(Into::into)
    }

    /// The shared frame of a page batch: open and shape checks, then the server's one round
    /// trip, or `range_op` over page ranges of the embedded engine (split across copy threads).
    fn page_batch<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
        is_put: bool,
        range_op: impl Fn(&Engine, Range<usize>) -> BatchResult + Sync,
    ) -> BatchResult {
        let pages = batch.pages();
        if let Err(e) = self.ensure_open() {
            return BatchResult::all_failed(pages, e.to_string());
        }
        if let Err(reason) = self.check_page_shape(batch, buffers, depths) {
            return self.reject_batch(pages, reason);
        }
        let guard = match &self.backend {
            Backend::Embedded(slot) => slot.read(),
            Backend::Server(remote) => {
                return remote.page_io(
                    &self.regions,
                    is_put,
                    batch.prefix,
                    batch.page_keys,
                    batch.suffixes,
                    buffers,
                    depths,
                )
            }
            Backend::Cluster(cluster) => {
                return cluster.page_io(
                    &self.regions,
                    is_put,
                    batch.prefix,
                    batch.page_keys,
                    batch.suffixes,
                    buffers,
                    depths,
                )
            }
        };
        let Some(engine) = guard.as_ref() else {
            return BatchResult::all_failed(pages, ClientError::Closed.to_string());
        };
        self.split_pages(batch, buffers, |range| range_op(engine, range))
    }

    /// Put every component of every page; `ok[i]` is true when page `i` is fully stored
    /// (newly or already). Components this call stored for a page that then failed are removed
    /// again, so a failed page leaves nothing behind. Large batches are copied by several
    /// threads (`copy_threads`), each taking a contiguous run of pages.
    pub fn put_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult {
        self.timed(Op::Put, || {
            self.page_batch(batch, buffers, depths, true, |engine, range| {
                self.put_page_range(engine, batch, buffers, depths, range)
            })
        })
    }

    fn put_page_range<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        engine: &Engine,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
        range: Range<usize>,
    ) -> BatchResult {
        let comps = batch.components();
        let mut result = BatchResult::with_capacity(range.len());
        let mut key = Vec::new();
        let mut stored_now: Vec<Vec<u8>> = Vec::new();
        for i in range {
            let page_key = batch.page_keys[i].as_ref();
            let depth = depths.map(|d| d[i]);
            stored_now.clear();
            let mut page_ok = true;
            for (j, suffix) in batch.suffixes.iter().enumerate() {
                compose_key(batch.prefix, page_key, suffix.as_ref(), &mut key);
                match Self::put_one(engine, &self.regions, &key, buffers[i * comps + j], depth) {
                    Ok(PutOutcome::Stored) => stored_now.push(key.clone()),
                    Ok(PutOutcome::AlreadyPresent) => {}
                    Err(err) => {
                        self.note(&mut result, &key, &err);
                        page_ok = false;
                        break;
                    }
                }
            }
            if !page_ok {
                for k in &stored_now {
                    engine.remove(k);
                }
            }
            result.ok.push(page_ok);
        }
        result
    }

    /// Get every component of every page into caller memory; `ok[i]` is true when all of page
    /// `i` was copied. A page stops at its first failing component.
    pub fn get_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
    ) -> BatchResult {
        let result = self.timed(Op::Get, || {
            self.page_batch(batch, buffers, None, false, |engine, range| {
                self.get_page_range(engine, batch, buffers, range)
            })
        });
        if self.metrics.is_some() {
            let pool = metrics::pool_of_batch(batch.page_keys, batch.suffixes);
            self.count_pool(pool, Lookup::Get, result.succeeded(), batch.pages());
        }
        result
    }

    fn get_page_range<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        engine: &Engine,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        range: Range<usize>,
    ) -> BatchResult {
        let comps = batch.components();
        let mut result = BatchResult::with_capacity(range.len());
        let mut key = Vec::new();
        for i in range {
            let page_key = batch.page_keys[i].as_ref();
            let mut page_ok = true;
            for (j, suffix) in batch.suffixes.iter().enumerate() {
                compose_key(batch.prefix, page_key, suffix.as_ref(), &mut key);
                if let Err(err) = Self::get_one(engine, &self.regions, &key, buffers[i * comps + j])
                {
                    // A miss is the normal answer for a cold page; only real problems are noted.
                    if !matches!(err, ClientError::Engine(EngineError::NotFound)) {
                        self.note(&mut result, &key, &err);
                    }
                    page_ok = false;
                    break;
                }
            }
            result.ok.push(page_ok);
        }
        result
    }

    /// Run `work` over the batch's pages: inline for small batches, else over contiguous page
    /// ranges on up to `copy_threads` threads (this one included). Results keep page order.
    fn split_pages<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        work: impl Fn(Range<usize>) -> BatchResult + Sync,
    ) -> BatchResult {
        let pages = batch.pages();
        let bytes: usize = buffers.iter().map(|b| b.len).sum();
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

    /// Put whole keys from caller memory, one buffer per key.
    pub fn put_keys<K: AsRef<[u8]> + Sync>(
        &self,
        keys: &[K],
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult {
        let batch = PageBatch {
            prefix: &[],
            page_keys: keys,
            suffixes: &[[0u8; 0]],
        };
        self.put_pages(&batch, buffers, depths)
    }

    /// Get whole keys into caller memory, one buffer per key.
    pub fn get_keys<K: AsRef<[u8]> + Sync>(&self, keys: &[K], buffers: &[MemRef]) -> BatchResult {
        let batch = PageBatch {
            prefix: &[],
            page_keys: keys,
            suffixes: &[[0u8; 0]],
        };
        self.get_pages(&batch, buffers)
    }

    /// Store bytes the caller owns as a slice (the legacy tensor path).
    pub fn put_slice(
        &self,
        key: &[u8],
        value: &[u8],
        depth: Option<u32>,
    ) -> Result<PutOutcome, ClientError> {
        self.ensure_open()?;
        self.timed(Op::Put, || match &self.backend {
            Backend::Cluster(cluster) => {
                let keys = [cluster.namespaced(key)];
                match cluster.put_objects(&keys, &[Ok(value)], &[depth]).remove(0) {
                    Ok(()) => Ok(PutOutcome::Stored),
                    Err(reason) => Err(ClientError::BatchShape(reason)),
                }
            }
            Backend::Embedded(slot) => {
                let guard = slot.read();
                let engine = guard.as_ref().ok_or(ClientError::Closed)?;
                Ok(engine.put(key, value, PutMeta { depth })?)
            }
            // The server does not say whether the key was new; both count as stored.
            Backend::Server(remote) => remote
                .put_slice(key, value, depth)
                .map(|()| PutOutcome::Stored),
        })
    }

    /// Copy an object into a slice the caller owns; its length must match exactly.
    pub fn get_into_slice(&self, key: &[u8], dst: &mut [u8]) -> Result<(), ClientError> {
        self.ensure_open()?;
        let result = self.timed(Op::Get, || match &self.backend {
            Backend::Cluster(cluster) => {
                let keys = [cluster.namespaced(key)];
                match cluster.get_objects(&keys, vec![Ok(dst)]).remove(0) {
                    Ok(()) => Ok(()),
                    Err(reason) if reason == "not found" => {
                        Err(ClientError::Engine(EngineError::NotFound))
                    }
                    Err(reason) => Err(ClientError::BatchShape(reason)),
                }
            }
            Backend::Embedded(slot) => {
                let guard = slot.read();
                let engine = guard.as_ref().ok_or(ClientError::Closed)?;
                Ok(engine.get_into(key, dst)?)
            }
            Backend::Server(remote) => match remote.get_into_slice(key, dst)? {
                true => Ok(()),
                false => Err(ClientError::Engine(EngineError::NotFound)),
            },
        });
        self.count_one_get(key, result.is_ok());
        result
    }

    /// Embedded mode: pin `key` for reading its bytes in place ([`PinnedObject::slices`]),
    /// e.g. to send them to a socket without a copy. Counted like a get (latency, pool
    /// lookup, engine hit or miss); `None` when absent, closed, or in server or cluster mode
    /// (their objects are not in this process).
    pub fn pin(&self, key: &[u8]) -> Option<PinnedObject> {
        self.ensure_open().ok()?;
        let pinned = self.timed(Op::Get, || match &self.backend {
            Backend::Embedded(slot) => slot.read().as_ref().and_then(|e| e.pin(key)),
            Backend::Server(_) | Backend::Cluster(_) => None,
        });
        self.count_one_get(key, pinned.is_some());
        pinned
    }

    pub fn object_len(&self, key: &[u8]) -> Option<u64> {
        match &self.backend {
            Backend::Embedded(slot) => slot.read().as_ref().and_then(|e| e.object_len(key)),
            Backend::Server(remote) => remote.object_len(key).ok().flatten(),
            // The directory does not keep sizes (its per-object budget); unknown here.
            Backend::Cluster(_) => None,
        }
    }

    pub fn exists_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        if self.ensure_open().is_err() {
            return vec![false; keys.len()];
        }
        let found = self.timed(Op::Exists, || match &self.backend {
            Backend::Embedded(slot) => match slot.read().as_ref() {
                Some(engine) => keys.iter().map(|k| engine.contains(k.as_ref())).collect(),
                None => vec![false; keys.len()],
            },
            Backend::Server(remote) => {
                let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.as_ref().to_vec()).collect();
                remote
                    .exists_keys(&keys)
                    .unwrap_or_else(|_| vec![false; keys.len()])
            }
            Backend::Cluster(cluster) => {
                let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.as_ref().to_vec()).collect();
                cluster.exists_keys(&keys).unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "kvtier cluster: exists failed");
                    vec![false; keys.len()]
                })
            }
        });
        if self.metrics.is_some() {
            for (key, hit) in keys.iter().zip(&found) {
                self.count_pool(
                    metrics::pool_of(key.as_ref()),
                    Lookup::Exists,
                    usize::from(*hit),
                    1,
                );
            }
        }
        found
    }

    /// Number of leading pages whose every component exists.
    pub fn exists_pages_prefix<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize {
        let hit = self.timed(Op::Exists, || self.exists_pages_prefix_inner(batch));
        if self.metrics.is_some() {
            let pool = metrics::pool_of_batch(batch.page_keys, batch.suffixes);
            self.count_pool(pool, Lookup::Exists, hit, batch.pages());
        }
        hit
    }

    fn exists_pages_prefix_inner<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize {
        if self.ensure_open().is_err() || batch.components() == 0 {
            return 0;
        }
        let guard = match &self.backend {
            Backend::Embedded(slot) => slot.read(),
            Backend::Server(remote) => {
                let keys = page_keys_message(batch);
                return remote.exists_pages_prefix(keys).unwrap_or(0);
            }
            Backend::Cluster(cluster) => {
                let keys = cluster.compose_keys(batch.prefix, batch.page_keys, batch.suffixes);
                // compose_keys already namespaced them; look them up as whole keys.
                let found = cluster.exists_full_keys(&keys).unwrap_or_default();
                let comps = batch.components();
                return found
                    .chunks(comps)
                    .position(|page| !page.iter().all(|&b| b))
                    .unwrap_or(found.len() / comps);
            }
        };
        let Some(engine) = guard.as_ref() else {
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

    /// Mark every component of these pages superseded window state, an eviction hint: the
    /// caller stored a longer restorable chain that continues them, so their SWA / Mamba
    /// state is needed only by a request that ends exactly there (see `Engine::demote`).
    /// Returns how many stored objects were marked; keys not stored are skipped. A failure
    /// to deliver the hint (server or node down) is logged and counts 0: nothing is lost. In
    /// cluster mode the hint goes to every live node the directory names for each object.
    pub fn demote_pages<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize {
        if self.ensure_open().is_err() || batch.components() == 0 {
            return 0;
        }
        let guard = match &self.backend {
            Backend::Embedded(slot) => slot.read(),
            Backend::Server(remote) => {
                let keys = page_keys_message(batch);
                return remote.demote_pages(keys).unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "kvtier: demote hint not delivered");
                    0
                });
            }
            Backend::Cluster(cluster) => {
                let keys = cluster.compose_keys(batch.prefix, batch.page_keys, batch.suffixes);
                return cluster.demote_keys(&keys).unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "kvtier: demote hint not delivered");
                    0
                });
            }
        };
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

    /// One whole v2 existence query (see `kvtier_proto::query`).
    pub fn exists_v2(&self, query: &ExistsV2Query) -> ExistsV2Answer {
        if self.ensure_open().is_err() {
            return ExistsV2Answer::default();
        }
        // Every mode refuses the same queries: the server and the master would refuse this one
        // at decode, so the embedded store refuses it here with the same error.
        if let Err(error) = query.check_work() {
            tracing::warn!(%error, "kvtier: exists_v2 query refused; reporting a miss");
            return ExistsV2Answer::default();
        }
        let answer = self.timed(Op::ExistsV2, || match &self.backend {
            Backend::Embedded(slot) => slot
                .read()
                .as_ref()
                .and_then(|e| e.exists_v2(query).ok())
                .unwrap_or_default(),
            Backend::Server(remote) => remote.exists_v2(query).unwrap_or_default(),
            Backend::Cluster(cluster) => cluster.exists_v2(query).unwrap_or_else(|e| {
                tracing::warn!(error = %e, "kvtier cluster: exists_v2 failed");
                ExistsV2Answer::default()
            }),
        });
        if self.metrics.is_some() {
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
        answer
    }

    pub fn remove_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        self.timed(Op::Remove, || self.remove_keys_inner(keys))
    }

    fn remove_keys_inner<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        match &self.backend {
            Backend::Embedded(slot) => match slot.read().as_ref() {
                Some(engine) => keys.iter().filter(|k| engine.remove(k.as_ref())).count(),
                None => 0,
            },
            Backend::Server(remote) => {
                let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.as_ref().to_vec()).collect();
                remote.remove_keys(&keys).unwrap_or(0)
            }
            Backend::Cluster(cluster) => {
                let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.as_ref().to_vec()).collect();
                cluster.remove_keys(&keys).unwrap_or(0)
            }
        }
    }

    pub fn clear(&self) {
        self.timed(Op::Clear, || self.clear_inner());
    }

    fn clear_inner(&self) {
        match &self.backend {
            Backend::Embedded(slot) => {
                if let Some(engine) = slot.read().as_ref() {
                    engine.clear();
                }
            }
            Backend::Server(remote) => {
                let _ = remote.clear();
            }
            Backend::Cluster(cluster) => {
                if let Err(e) = cluster.clear() {
                    tracing::warn!(error = %e, "kvtier cluster: clear did not reach every node");
                }
            }
        }
    }

    /// Make every acknowledged put as durable as the configuration promises. The DRAM tier has
    /// nothing to flush; the SSD tier's copy pipeline drains here.
    pub fn flush(&self) -> Result<(), ClientError> {
        self.ensure_open()?;
        self.timed(Op::Flush, || match &self.backend {
            Backend::Embedded(slot) => match slot.read().as_ref() {
                Some(engine) => Ok(engine.flush()?),
                None => Err(ClientError::Closed),
            },
            Backend::Server(remote) => remote.flush(),
            // Nodes own their durability; an acknowledged put is already visible.
            Backend::Cluster(_) => Ok(()),
        })
    }

    /// Close the store: later calls fail cleanly. Idempotent. In server mode this ends the
    /// session: the server unmaps this process's memory.
    pub fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            match &self.backend {
                Backend::Server(remote) => remote.close(),
                Backend::Cluster(_) => {}
                Backend::Embedded(slot) => {
                    // Waits for batches in flight; dropping flushes the SSD tier and frees
                    // its directory for the next store.
                    if let Some(engine) = slot.write().take() {
                        if let Err(e) = engine.close() {
                            tracing::warn!(error = %e, "kvtier: flushing the store at close failed");
                        }
                    }
                }
            }
            self.regions.clear();
        }
    }

    /// Run `f` on the engine of embedded mode (`None` in server mode or once closed).
    pub fn with_engine<R>(&self, f: impl FnOnce(&Engine) -> R) -> Option<R> {
        match &self.backend {
            Backend::Embedded(slot) => slot.read().as_ref().map(f),
            Backend::Server(_) | Backend::Cluster(_) => None,
        }
    }

    /// [`stats`](Self::stats) as JSON; in server mode the engine figures are the server's for
    /// this client's tenant, plus `server_*` and this client's zero-copy/staged byte counts.
    pub fn stats_json(&self) -> serde_json::Value {
        let mut map = match serde_json::to_value(self.stats()) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => serde_json::Map::new(),
        };
        map.insert("mode".into(), self.mode().into());
        if let Some(addr) = self.metrics_addr() {
            map.insert("metrics_addr".into(), addr.to_string().into());
        }
        // Issue 17: the data transport per cluster peer.
        if let Backend::Cluster(cluster) = &self.backend {
            map.insert(
                "peer_transports".into(),
                serde_json::to_value(cluster.peer_transports()).unwrap_or_default(),
            );
        }
        if let Backend::Server(remote) = &self.backend {
            map.extend(remote.local_stats());
            if let Ok(server) = remote.server_stats() {
                if let Some(serde_json::Value::Object(engine)) = server.get("you_engine_stats") {
                    map.extend(engine.clone());
                }
                if let Some(serde_json::Value::Object(summary)) = server.get("server") {
                    for (k, v) in summary {
                        map.insert(format!("server_{k}"), v.clone());
                    }
                }
            }
        }
        serde_json::Value::Object(map)
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub fn stats(&self) -> ClientStats {
        let regions = self.regions.regions();
        ClientStats {
            engine: match &self.backend {
                Backend::Embedded(slot) => {
                    slot.read().as_ref().map(Engine::stats).unwrap_or_default()
                }
                Backend::Server(_) | Backend::Cluster(_) => EngineStats::default(),
            },
            rejected_buffers: self.rejected_buffers.load(Ordering::Relaxed),
            rejected_batches: self.rejected_batches.load(Ordering::Relaxed),
            registered_regions: regions.len() as u64,
            registered_bytes: regions.iter().map(|r| r.len as u64).sum(),
        }
    }
}

/// A page batch as the server protocol's [`kvtier_proto::server::PageKeys`].
fn page_keys_message<K: AsRef<[u8]>, S: AsRef<[u8]>>(
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
