//! kvtier's client layer: what every front end (the Python module, the CLI, later the server)
//! uses to reach a store.
//!
//! - [`config`] is the one configuration schema, fed by a TOML file, `KVTIER_*` environment
//!   variables and SGLang's `extra_config`, parsed strictly.
//! - [`memory`] owns the registry of caller memory regions and the only raw-pointer access in
//!   this crate: every (pointer, size) a caller hands in is checked against a registered region
//!   before a byte is touched.
//! - [`batch`] describes page batches (`prefix ++ page_key ++ suffix` keys) and their results.
//! - [`metrics`] owns the Prometheus side: the process's recorder, the `/metrics` endpoint and
//!   the name of every metric (embedded mode opts in with `metrics_addr`).
//! - [`store`] is the seam (issue 16): the [`store::Store`] trait for page batches and its three
//!   implementations: embedded (the engine in this process, also what `kvtier serve` hosts),
//!   local server ([`store::local_server`], a local `kvtier serve` selected by `server_socket`;
//!   [`remote`] is its old name) and cluster (over [`cluster::ClusterStore`]).
//! - [`client`] is the [`Client`]: config, caller memory, metrics and one store.
//!
//! Cluster mode ([`cluster`]) reaches the master through the stubs of `kvtier-rpc` only: this
//! crate (and so the Python module) does not link `kvtier-master` or `etcd-client`. Its data
//! plane is TCP frames or, per peer, UCX one-sided reads ([`transport`]).

pub mod batch;
pub mod client;
pub mod cluster;
pub mod config;
pub mod error;
pub mod memory;
pub mod metrics;
// Issue 18: ranged gets for SGLang's direct linker.
pub mod ranged;
pub mod store;
pub mod transport;

/// The local-server store under its old module name (issue 16 renamed it).
pub use store::local_server as remote;

pub use batch::{BatchResult, MemRef, PageBatch};
pub use client::Client;
pub use config::{ConfigError, ConfigSources, KvtierConfig};
pub use error::ClientError;
