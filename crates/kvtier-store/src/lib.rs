//! kvtier's store layer: the [`store::Store`] seam and everything a store needs, for every
//! front end (the `Client` of `kvtier-client`, and `kvtier serve`, which hosts embedded stores
//! without a `Client`).
//!
//! - [`config`] is the one configuration schema ([`KvtierConfig`] and its sections), fed by a
//!   TOML file, `KVTIER_*` environment variables and SGLang's `extra_config`, parsed strictly.
//! - [`memory`] owns the registry of caller memory regions and the only raw-pointer access of
//!   the caller side: every (pointer, size) a caller hands in is checked against a registered
//!   region before a byte is touched.
//! - [`batch`] describes page batches (`prefix ++ page_key ++ suffix` keys) and their results.
//! - [`metrics`] owns the Prometheus side: the process's recorder, the `/metrics` endpoint and
//!   the name of every metric.
//! - [`store`] is the seam (issue 16): the [`store::Store`] trait for page batches and its three
//!   implementations: embedded (the engine in this process, also what `kvtier serve` hosts,
//!   with [`store::CheckedBuffers`]; every store's calls are recorded by [`store::Metered`]),
//!   local server ([`store::local_server`], a local `kvtier serve` selected by
//!   `server_socket`) and cluster (over [`cluster::ClusterStore`]).
//! - [`stats`]: the stats document every front end reports.
//!
//! Cluster mode ([`cluster`]) reaches the master and the nodes through `kvtier-transport`
//! (re-exported as [`transport`]): this crate does not link `kvtier-master` or `etcd-client`.
//!
//! Floor plan (issue 28 §3; README "Architecture"): this crate builds on `kvtier-engine`,
//! `kvtier-transport`, `kvtier-rpc` and `kvtier-proto`. `kvtier-client` (the `Client` facade
//! of the Python module) and `kvtier-server` (`kvtier serve` and the cluster node, which host
//! [`store::EmbeddedStore`]s without a `Client`) build on it.

pub mod batch;
pub mod cluster;
pub mod config;
pub mod error;
pub mod memory;
pub mod metrics;
pub mod stats;
pub mod store;

/// The data plane and the master link, under the module name they had in `kvtier-client`.
pub use kvtier_transport as transport;

pub use batch::{BatchResult, MemRef, PageBatch};
pub use config::{ConfigError, ConfigSources, KvtierConfig};
pub use error::ClientError;
