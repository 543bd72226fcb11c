//! [`Client`]: the store as every front end sees it.
//!
//! A small owner (issue 16): the configuration, the registry of caller memory, the metrics,
//! and one store behind the [`Store`] seam ([`Stores`]: embedded, local server or cluster).
//! The client checks that it is open and that a page batch is well formed; its store is
//! [`Metered`] (issue 28: the one wrapper that times calls and counts pool lookups, the same
//! one `kvtier serve`'s stores use); what a call means is the store's (see [`crate::store`]). Every method
//! is safe to call from many threads at once and never panics on caller input: a bad buffer,
//! a size mismatch or a full store is a `false` for that item plus a reason in the result.
// A named unsafe module (issue 16 lints): registering caller memory is an unsafe contract.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use kvtier_engine::{PinnedObject, PutOutcome};
use kvtier_proto::{ExistsV2Answer, ExistsV2Query};

use crate::batch::{BatchResult, MemRef, PageBatch};
use crate::cluster::ClusterStore;
use crate::config::KvtierConfig;
use crate::error::ClientError;
use crate::memory::{RegionId, RegionInfo, RegionRegistry};
use crate::metrics::{self, Endpoint};
use crate::store::{
    check_page_shape, EmbeddedStore, LocalServerStore, Metered, Store, StoreMeter, Stores,
};

pub use crate::store::embedded::PARALLEL_COPY_MIN_BYTES_PER_THREAD;
pub use kvtier_store::stats::ClientStats;

pub struct Client {
    config: KvtierConfig,
    /// The store, recording its calls when the process publishes metrics.
    store: Metered<Stores>,
    regions: RegionRegistry,
    closed: AtomicBool,
    rejected_batches: AtomicU64,
    /// The endpoint this client's `metrics_addr` asked for.
    endpoint: Option<Arc<Endpoint>>,
    /// This store's part of `/readyz` (issue 27): not ready while it opens.
    _ready: Option<Arc<metrics::ReadyGate>>,
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
        let ready = config
            .metrics_addr
            .as_ref()
            .map(|_| metrics::ReadyGate::new("a kvtier store is opening"));
        let endpoint = match &config.metrics_addr {
            Some(addr) => Some(metrics::serve(addr)?),
            None => None,
        };
        let backend = if config.master_address.is_some() {
            Stores::Cluster(Box::new(ClusterStore::open(&config)?))
        } else if config.server_socket.is_some() {
            Stores::Server(Box::new(LocalServerStore::connect(&config)?))
        } else {
            Stores::Embedded(EmbeddedStore::from_config(&config)?)
        };
        let engine = match &backend {
            Stores::Embedded(embedded) => Some(embedded.slot()),
            Stores::Server(_) | Stores::Cluster(_) => None,
        };
        let meter = StoreMeter::new(store, engine);
        if let Some(gate) = &ready {
            gate.set_ready();
        }
        Ok(Client {
            config,
            store: Metered::new(backend, meter),
            regions: RegionRegistry::new(),
            closed: AtomicBool::new(false),
            rejected_batches: AtomicU64::new(0),
            endpoint,
            _ready: ready,
        })
    }

    /// The bound address of the metrics endpoint this client's `metrics_addr` started.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.endpoint.as_ref().map(|e| e.addr())
    }

    pub fn config(&self) -> &KvtierConfig {
        &self.config
    }

    /// The registry of caller memory every batch's buffers are checked against (also the
    /// issue 18 hook: `ranged` checks its destinations against it).
    pub fn region_registry(&self) -> &RegionRegistry {
        &self.regions
    }

    /// The store behind this client (unmetered: its own calls, not the `Store` ones).
    pub fn store(&self) -> &Stores {
        self.store.inner()
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
        let id = unsafe { self.regions.register(ptr, len, label) }?;
        self.register_with_ucx(id, ptr, len, label);
        Ok(id)
    }

    /// Issue 17: in cluster mode, also register the memory with UCX (one-sided transfers
    /// into and out of it pass its memory handle); a refusal is logged and counted there.
    fn register_with_ucx(&self, id: RegionId, ptr: usize, len: usize, label: &str) {
        if let Stores::Cluster(cluster) = self.store() {
            cluster.ucx().register_host_region(id.0, ptr, len, label);
        }
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
        if let Stores::Server(remote) = self.store() {
            // Issue 26: the server copies only into and out of memory that exists (it never
            // allocates a page on a client's behalf), so a sparse memfd is populated here, by
            // its owner, before the server maps it.
            // SAFETY: `[ptr, ptr + len)` is this caller's live shared mapping of the memfd
            // (the function's contract).
            unsafe { populate_if_sparse(ptr, len, fd) };
            if let Err(e) = remote.register_memfd(id, ptr, len, fd, fd_offset, label) {
                self.regions.unregister(id);
                return Err(e);
            }
        }
        self.register_with_ucx(id, ptr, len, label);
        Ok(id)
    }

    pub fn unregister_region(&self, id: RegionId) -> bool {
        if let Stores::Server(remote) = self.store() {
            remote.unregister(id);
        }
        if let Stores::Cluster(cluster) = self.store() {
            cluster.ucx().unregister_host_region(id.0);
        }
        self.regions.unregister(id)
    }

    /// `"embedded"`, `"server"` or `"cluster"`.
    pub fn mode(&self) -> &'static str {
        self.store.mode()
    }

    /// The cluster store (cluster mode only).
    pub fn cluster(&self) -> Option<&ClusterStore> {
        match self.store() {
            Stores::Cluster(c) => Some(c),
            _ => None,
        }
    }

    /// Regions the server maps directly (server mode; 0 in embedded mode).
    pub fn zero_copy_regions(&self) -> usize {
        match self.store() {
            Stores::Embedded(_) | Stores::Cluster(_) => 0,
            Stores::Server(remote) => remote.zero_copy_regions(),
        }
    }

    pub fn regions(&self) -> Vec<RegionInfo> {
        self.regions.regions()
    }

    fn ensure_open(&self) -> Result<(), ClientError> {
        if self.closed.load(Ordering::Acquire) {
            Err(ClientError::Closed)
        } else {
            Ok(())
        }
    }

    fn reject_batch(&self, items: usize, reason: String) -> BatchResult {
        self.rejected_batches.fetch_add(1, Ordering::Relaxed);
        BatchResult::all_failed(items, reason)
    }

    /// The shared frame of a page batch: open and shape checks, then the store's call.
    fn page_batch<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
        call: impl FnOnce() -> BatchResult,
    ) -> BatchResult {
        let pages = batch.pages();
        if let Err(e) = self.ensure_open() {
            return BatchResult::all_failed(pages, e.to_string());
        }
        if let Err(reason) = check_page_shape(batch, buffers.len(), depths) {
            return self.reject_batch(pages, reason);
        }
        call()
    }

    /// Put every component of every page; `ok[i]` is true when page `i` is fully stored
    /// (newly or already). Components this call stored for a page that then failed are removed
    /// again, so a failed page leaves nothing behind (the cluster store's form of that promise:
    /// [`crate::store::cluster::PAGE_ROLLBACK`]). The embedded store copies large batches on
    /// several threads (`copy_threads`), each taking a contiguous run of pages.
    pub fn put_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult {
        self.page_batch(batch, buffers, depths, || {
            self.store.put_pages(&self.regions, batch, buffers, depths)
        })
    }

    /// Get every component of every page into caller memory; `ok[i]` is true when all of page
    /// `i` was copied. A page stops at its first failing component.
    pub fn get_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &[MemRef],
    ) -> BatchResult {
        self.page_batch(batch, buffers, None, || {
            self.store.get_pages(&self.regions, batch, buffers)
        })
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
        self.store.put_slice(key, value, depth)
    }

    /// Copy an object into a slice the caller owns; its length must match exactly. A failure
    /// says what it means for the item, typed ([`ClientError::item_failure`]: a miss, a wrong
    /// length, an integrity failure, the store unreachable), in every mode.
    pub fn get_into_slice(&self, key: &[u8], dst: &mut [u8]) -> Result<(), ClientError> {
        self.ensure_open()?;
        self.store.get_into_slice(key, dst)
    }

    /// Embedded mode: pin `key` for reading its bytes in place ([`PinnedObject::slices`]),
    /// e.g. to send them to a socket without a copy. Counted like a get (latency, pool
    /// lookup, engine hit or miss); `None` when absent, closed, or in server or cluster mode
    /// (their objects are not in this process).
    pub fn pin(&self, key: &[u8]) -> Option<PinnedObject> {
        self.ensure_open().ok()?;
        self.store.pin(key)
    }

    pub fn object_len(&self, key: &[u8]) -> Option<u64> {
        self.store.object_len(key)
    }

    pub fn exists_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        if self.ensure_open().is_err() {
            return vec![false; keys.len()];
        }
        self.store.exists_keys(keys)
    }

    /// Number of leading pages whose every component exists.
    pub fn exists_pages_prefix<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize {
        if self.ensure_open().is_err() || batch.components() == 0 {
            return 0;
        }
        self.store.exists_pages_prefix(batch)
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
        self.store.demote_pages(batch)
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
        self.store.exists_v2(query)
    }

    pub fn remove_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        self.store.remove_keys(keys)
    }

    pub fn clear(&self) {
        self.store.clear();
    }

    /// Make every acknowledged put as durable as the configuration promises. The DRAM tier has
    /// nothing to flush; the SSD tier's copy pipeline drains here.
    pub fn flush(&self) -> Result<(), ClientError> {
        self.ensure_open()?;
        self.store.flush()
    }

    /// Close the store: later calls fail cleanly. Idempotent. In server mode this ends the
    /// session: the server unmaps this process's memory.
    pub fn close(&self) {
        if !self.closed.swap(true, Ordering::AcqRel) {
            self.store.close();
            if let Stores::Cluster(cluster) = self.store() {
                cluster.ucx().unregister_all_host_regions();
            }
            self.regions.clear();
        }
    }

    /// Refresh the recency of each key's page group (an eviction hint); how many keys were
    /// in DRAM (0 in server and cluster mode: the engine is elsewhere). Issue 28: these are
    /// capabilities of the store ([`Store::touch_keys`] ...), not a reach into its engine.
    pub fn touch_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        self.store.touch_keys(keys)
    }

    /// Refresh the recency of each page group (`[tag/]page_hash@`) in DRAM; how many were
    /// there (0 in server and cluster mode).
    pub fn touch_groups<K: AsRef<[u8]>>(&self, groups: &[K]) -> usize {
        self.store.touch_groups(groups)
    }

    /// Start recording page-group events into a ring of `capacity` (false in server and
    /// cluster mode: the events happen in another process's engine).
    pub fn enable_events(&self, capacity: usize) -> bool {
        self.store.enable_events(capacity)
    }

    /// [`Client::enable_events`], and with the SSD tier on also its `ssd_stored` /
    /// `ssd_removed` events (issue 30: the vLLM tier reports each block's medium).
    pub fn enable_media_events(&self, capacity: usize) -> bool {
        self.store.enable_media_events(capacity)
    }

    /// Where `key` is in this process's engine (`None` in server and cluster mode, or once
    /// closed).
    pub fn placement(&self, key: &[u8]) -> Option<kvtier_engine::Placement> {
        self.store.placement(key)
    }

    /// Take up to `max` of the oldest page-group events (`None` in server and cluster mode,
    /// or once closed).
    pub fn drain_events(&self, max: usize) -> Option<kvtier_engine::eviction::events::Drained> {
        self.store.drain_events(max)
    }

    /// `(groups evicted whole, groups tracked)` of the DRAM tier (`None` in server and
    /// cluster mode).
    pub fn group_stats(&self) -> Option<(u64, u64)> {
        self.store.group_stats()
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
        if let Stores::Cluster(cluster) = self.store() {
            map.insert(
                "peer_transports".into(),
                serde_json::to_value(cluster.peer_transports()).unwrap_or_default(),
            );
            map.insert(
                "ucx_outstanding_requests".into(),
                cluster.ucx_outstanding_requests().into(),
            );
            let ucx = cluster.ucx();
            map.insert(
                "ucx_registered_regions".into(),
                ucx.registered_regions().into(),
            );
            map.insert(
                "ucx_registration_failures".into(),
                ucx.registration_failures().into(),
            );
            map.insert(
                "ucx_registered_transfers".into(),
                ucx.registered_transfers().into(),
            );
            // Issue 26: why this client runs no UCX worker at all (null: it runs one).
            map.insert(
                "ucx_unavailable".into(),
                ucx.unavailable().map(str::to_string).into(),
            );
        }
        if let Stores::Server(remote) = self.store() {
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
            engine: self.store.engine_stats(),
            rejected_buffers: self.store.rejected_buffers(),
            rejected_batches: self.rejected_batches.load(Ordering::Relaxed),
            registered_regions: regions.len() as u64,
            registered_bytes: regions.iter().map(|r| r.len as u64).sum(),
        }
    }
}

/// Give every page of `[ptr, ptr + len)` memory if the memfd `fd` has holes (`st_blocks`
/// short of its size): `MADV_POPULATE_WRITE` (Linux 5.14+), else a read of one byte per page
/// (a read fault allocates a tmpfs page too). Best effort: pages left without memory fail at
/// the server with a message saying so.
///
/// # Safety
/// `[ptr, ptr + len)` must be a live shared mapping of `fd` in this process.
unsafe fn populate_if_sparse(ptr: usize, len: usize, fd: std::os::fd::BorrowedFd<'_>) {
    let Ok(stat) = rustix::fs::fstat(fd) else {
        return;
    };
    let allocated = u64::try_from(stat.st_blocks)
        .unwrap_or(0)
        .saturating_mul(512);
    if allocated >= u64::try_from(stat.st_size).unwrap_or(0) || len == 0 {
        return;
    }
    let page = rustix::param::page_size();
    let start = ptr - ptr % page;
    let end = ptr.saturating_add(len);
    // SAFETY: the range (rounded out to whole pages, which belong to the same mapping since
    // mappings are page granular) is the caller's live mapping; populating does not change
    // its contents.
    let advised = unsafe {
        rustix::mm::madvise(
            start as *mut std::ffi::c_void,
            end - start,
            rustix::mm::Advice::LinuxPopulateWrite,
        )
    };
    if advised.is_ok() {
        return;
    }
    let mut at = start.max(ptr);
    while at < end {
        // SAFETY: `at` lies inside the caller's live mapping; a volatile read of one byte
        // changes nothing and faults the page in.
        unsafe { std::ptr::read_volatile(at as *const u8) };
        at = (at - at % page) + page;
    }
}

/// Register a memfd mapping this process owns (benchmarks, tests) with a client, zero copy in
/// server mode. The registration must end before `map` is dropped: callers unregister (or drop
/// the client) first.
pub fn register_own_memfd(
    client: &Client,
    map: &crate::memory::StagingMap,
    label: &str,
) -> Result<RegionId, ClientError> {
    // SAFETY: `map` is a live shared mapping of exactly `map.len()` bytes at `map.addr()`,
    // which is `[0, len)` of `map.fd()`; the caller keeps it alive while registered.
    unsafe { client.register_memfd(map.addr(), map.len(), map.fd(), 0, label) }
}
