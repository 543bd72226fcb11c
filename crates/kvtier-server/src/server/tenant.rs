//! The stores `kvtier serve` hosts: `main` (the default tenant's, every tenant's without a
//! partition, and a cluster node's data port's) and one `tenant:<name>` per partition.
//!
//! Owns: each store's [`EmbeddedStore`] and its [`StoreMeter`] (request latency, pool hits,
//! the engine's series under `store="main"` / `store="tenant:<name>"`), and the per-tenant
//! Prometheus counters sessions record into ([`TenantMetrics`]).
//!
//! Invariants:
//! - A store is an embedded engine reached directly, not through a `Client`: page batches
//!   arrive as [`CheckedBuffers`] the session proved inside its mappings, so no region
//!   registry is consulted and each buffer is bounds-checked once (issue 16).
//! - Every call records what a `Client` over the same store would record (same ops, same pool
//!   counts, same engine collector), so metrics are those of embedded mode.
//! - The set of stores is fixed when the server binds; stores are dropped (and their engines
//!   flushed) when the last holder (server, data port, node agent) lets go.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvtier_engine::{Engine, EngineStats, PinnedObject, PutOutcome};
use kvtier_proto::{ExistsV2Answer, ExistsV2Query};
use kvtier_store::metrics::{names, Lookup, Op};
use kvtier_store::store::{CheckedBuffers, EmbeddedStore, Store, StoreMeter};
use kvtier_store::{BatchResult, ClientError, KvtierConfig, PageBatch};

use crate::config::ServerConfig;

/// One store the server hosts (see the module doc).
#[derive(Debug)]
pub struct TenantStore {
    name: String,
    config: KvtierConfig,
    store: EmbeddedStore,
    meter: StoreMeter,
}

impl TenantStore {
    /// Open an embedded engine as `config` describes (its `master_address` is ignored: a
    /// node's own store is local) whose metrics carry `store="<name>"`.
    pub fn open(config: KvtierConfig, name: &str) -> Result<TenantStore, ClientError> {
        let store = EmbeddedStore::from_config(&config)?;
        let meter = StoreMeter::new(name, Some(store.slot()));
        Ok(TenantStore {
            name: name.to_string(),
            config,
            store,
            meter,
        })
    }

    /// `main` or `tenant:<name>`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The configuration the store was opened with.
    pub fn config(&self) -> &KvtierConfig {
        &self.config
    }

    /// Put pages from buffers the caller proved (see [`EmbeddedStore::put_checked_pages`]).
    pub fn put_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
        &self,
        batch: &PageBatch<'_, K, S>,
        buffers: &CheckedBuffers,
        depths: Option<&[u32]>,
    ) -> BatchResult {
        self.meter.timed(Op::Put, || {
            self.store.put_checked_pages(batch, buffers, depths)
        })
    }

    /// Get pages into buffers the caller proved (see [`EmbeddedStore::get_checked_pages`]).
    pub fn get_pages<K: AsRef<[u8]> + Sync, S: AsRef<[u8]> + Sync>(
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

    /// Store bytes as one object (put-if-absent): a peer's put.
    pub fn put_slice(
        &self,
        key: &[u8],
        value: &[u8],
        depth: Option<u32>,
    ) -> Result<PutOutcome, ClientError> {
        self.meter
            .timed(Op::Put, || self.store.put_slice(key, value, depth))
    }

    /// Copy an object into `dst`, whose length must match. A miss is `Engine(NotFound)`.
    pub fn get_into_slice(&self, key: &[u8], dst: &mut [u8]) -> Result<(), ClientError> {
        let result = self
            .meter
            .timed(Op::Get, || self.store.get_into_slice(key, dst));
        self.meter.count_get(key, result.is_ok());
        result
    }

    /// Pin `key` to read its bytes in place (a peer's get; UCX leases); counted as a get.
    pub fn pin(&self, key: &[u8]) -> Option<PinnedObject> {
        let pinned = self.meter.timed(Op::Get, || self.store.pin(key));
        self.meter.count_get(key, pinned.is_some());
        pinned
    }

    pub fn object_len(&self, key: &[u8]) -> Option<u64> {
        self.store.object_len(key)
    }

    pub fn exists_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<bool> {
        let found = self
            .meter
            .timed(Op::Exists, || self.store.exists_keys(keys));
        self.meter.count_exists_keys(keys, &found);
        found
    }

    /// Number of leading pages whose every component exists.
    pub fn exists_pages_prefix<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize {
        let hit = self
            .meter
            .timed(Op::Exists, || self.store.exists_pages_prefix(batch));
        self.meter.count_pages(batch, Lookup::Exists, hit);
        hit
    }

    /// Mark these pages' components superseded window state; how many were marked.
    pub fn demote_pages<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        batch: &PageBatch<'_, K, S>,
    ) -> usize {
        self.store.demote_pages(batch)
    }

    /// One whole v2 existence query (decoding checked its work bound).
    pub fn exists_v2(&self, query: &ExistsV2Query) -> ExistsV2Answer {
        let answer = self
            .meter
            .timed(Op::ExistsV2, || self.store.exists_v2(query));
        self.meter.count_exists_v2(query, &answer);
        answer
    }

    /// Remove whole keys; how many were held.
    pub fn remove_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        self.meter
            .timed(Op::Remove, || self.store.remove_keys(keys))
    }

    pub fn clear(&self) {
        self.meter.timed(Op::Clear, || self.store.clear());
    }

    pub fn flush(&self) -> Result<(), ClientError> {
        self.meter.timed(Op::Flush, || self.store.flush())
    }

    /// Run `f` on the engine (`None` once closed).
    pub fn with_engine<R>(&self, f: impl FnOnce(&Engine) -> R) -> Option<R> {
        self.store.with_engine(f)
    }

    pub fn engine_stats(&self) -> EngineStats {
        self.store.engine_stats()
    }

    /// Buffers the store refused as outside registered memory (none reach it from the
    /// server: the session proved them) and batches refused for their shape.
    pub fn rejected(&self) -> (u64, u64) {
        (self.store.rejected_buffers(), self.store.rejected_batches())
    }
}

/// Every store of the server: `main` and the partitions (fixed at bind).
pub(super) struct Tenants {
    pub(super) main: Arc<TenantStore>,
    partitions: BTreeMap<String, Arc<TenantStore>>,
}

impl Tenants {
    /// Open `main` and one partition per `tenant_dram_quota` entry.
    pub(super) fn open(config: &ServerConfig) -> Result<Tenants, ClientError> {
        let main = Arc::new(TenantStore::open(config.engine.clone(), "main")?);
        let mut partitions = BTreeMap::new();
        for (tenant, quota) in &config.settings.tenant_dram_quota {
            let name = format!("tenant:{tenant}");
            let store = TenantStore::open(config.partition_config(tenant, *quota), &name)?;
            partitions.insert(tenant.clone(), Arc::new(store));
        }
        Ok(Tenants { main, partitions })
    }

    /// The store a session of `tenant` uses: its partition, else `main`.
    pub(super) fn for_tenant(&self, tenant: &str) -> &Arc<TenantStore> {
        self.partitions.get(tenant).unwrap_or(&self.main)
    }

    /// Whether `store` is `tenant`'s own partition (it then holds nothing of anyone else).
    pub(super) fn is_partition_of(&self, tenant: &str, store: &Arc<TenantStore>) -> bool {
        self.partitions
            .get(tenant)
            .is_some_and(|p| Arc::ptr_eq(p, store))
    }

    /// `main`, then the partitions in tenant order.
    pub(super) fn all(&self) -> impl Iterator<Item = &Arc<TenantStore>> {
        std::iter::once(&self.main).chain(self.partitions.values())
    }
}

/// A tenant's Prometheus counters (no-ops when the server publishes no metrics).
pub(super) struct TenantMetrics {
    pub(super) bytes_in: metrics::Counter,
    pub(super) bytes_out: metrics::Counter,
    pub(super) pages_put: metrics::Counter,
    pub(super) pages_got: metrics::Counter,
}

impl TenantMetrics {
    pub(super) fn new(tenant: &str) -> TenantMetrics {
        let tenant = if tenant.is_empty() {
            "default".to_string()
        } else {
            tenant.to_string()
        };
        let bytes = |direction: &'static str| metrics::counter!(names::TENANT_BYTES, "tenant" => tenant.clone(), "direction" => direction);
        let pages = |op: &'static str| metrics::counter!(names::TENANT_PAGES, "tenant" => tenant.clone(), "op" => op);
        TenantMetrics {
            bytes_in: bytes("in"),
            bytes_out: bytes("out"),
            pages_put: pages("put"),
            pages_got: pages("get"),
        }
    }
}
