//! kvtier's client facade: the [`Client`] every front end in a caller's process uses (the
//! Python module `kvtier._native`, the CLI's benchmarks), and ranged gets for SGLang's direct
//! linker.
//!
//! - [`client`] is the [`Client`]: config, caller memory, metrics and one store (embedded,
//!   local server or cluster) behind the `Store` seam of `kvtier-store`.
//! - [`ranged`] (issue 18): byte ranges of stored objects copied into caller memory.
//!
//! Everything else is `kvtier-store`'s (config, memory, batches, metrics, the stores) and
//! `kvtier-transport`'s (TCP frames, UCX, the master link), re-exported here under the module
//! names front ends already use. This crate (and so the Python module) does not link
//! `kvtier-master` or `etcd-client`.
//!
//! Floor plan (issue 28 §3; README "Architecture"): `kvtier-py -> kvtier-client ->
//! kvtier-store -> kvtier-transport -> kvtier-rpc -> kvtier-proto`; `kvtier-server` builds on
//! `kvtier-store` and `kvtier-transport` directly, not on this crate.

pub mod client;
// Issue 18: ranged gets for SGLang's direct linker.
pub mod ranged;

pub use kvtier_store::{batch, cluster, config, error, memory, metrics, stats, store, transport};

/// The local-server store under its old module name (issue 16 renamed it).
pub use kvtier_store::store::local_server as remote;

pub use batch::{BatchResult, MemRef, PageBatch};
pub use client::Client;
pub use config::{ConfigError, ConfigSources, KvtierConfig};
pub use error::ClientError;
