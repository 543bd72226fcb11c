//! The stores `kvtier serve` hosts: `main` (the default tenant's, every tenant's without a
//! partition, and a cluster node's data port's) and one `tenant:<name>` per partition.
//!
//! Owns: each store's [`EmbeddedStore`] behind its [`Metered`] wrapper with a [`StoreMeter`]
//! (request latency, pool hits, the engine's series under `store="main"` /
//! `store="tenant:<name>"`), and the per-tenant Prometheus counters sessions record into
//! ([`TenantMetrics`]).
//!
//! Invariants:
//! - A store is an embedded engine reached directly, not through a `Client`: page batches
//!   arrive as [`CheckedBuffers`] the session proved inside its mappings, so no region
//!   registry is consulted and each buffer is bounds-checked once (issue 16).
//! - Every call records what a `Client` over the same store would record: the same
//!   [`Metered`] wrapper does it for both (issue 28), so metrics are those of embedded mode.
//! - The set of stores is fixed when the server binds; stores are dropped (and their engines
//!   flushed) when the last holder (server, data port, node agent) lets go.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvtier_store::metrics::names;
use kvtier_store::store::{EmbeddedStore, Metered, Store, StoreMeter};
use kvtier_store::{ClientError, KvtierConfig};

use crate::config::ServerConfig;

/// One store the server hosts (see the module doc): an embedded store behind the same
/// [`Metered`] wrapper a `Client` records through (issue 28: one way of counting). Its calls
/// are the [`Store`] trait's (through `Deref`), plus the checked page batches of
/// [`Metered<EmbeddedStore>`] and the embedded store's own ([`Metered::inner`]).
#[derive(Debug)]
pub struct TenantStore {
    name: String,
    config: KvtierConfig,
    store: Metered<EmbeddedStore>,
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
            store: Metered::new(store, meter),
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

    /// Buffers the store refused as outside registered memory (none reach it from the
    /// server: the session proved them) and batches refused for their shape.
    pub fn rejected(&self) -> (u64, u64) {
        let store = self.store.inner();
        (store.rejected_buffers(), store.rejected_batches())
    }
}

impl std::ops::Deref for TenantStore {
    type Target = Metered<EmbeddedStore>;

    fn deref(&self) -> &Metered<EmbeddedStore> {
        &self.store
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
