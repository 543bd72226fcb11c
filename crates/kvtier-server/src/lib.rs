//! `kvtier serve`: the local cache server shared by every TP/DP rank on a host.
//!
//! - [`config`]: [`ServerConfig`] (TOML file, `KVTIER_SERVE_*` / `KVTIER_*` env, flags; strict).
//! - [`server`]: listener, sessions, dispatch of the wire protocol (`kvtier_proto`), split by
//!   the state each part owns (`connection`, `session`, `tenant`, `page_io`, `documents`).
//! - [`shm`]: client memfds mapped into the server, and [`fault_guard`]: the SIGBUS guard of
//!   unsealed ones — the crate's only `unsafe` (each opens with `#![allow(unsafe_code)]`
//!   under the workspace lints).
//! - [`cli`]: `serve`, `stat` and `inspect`, called by the `kvtier` binary (`kvtier bench
//!   server`, a `Client` driving this server, lives in `kvtier-cli`).
//! - [`node`], [`peer`], [`rereplicate`]: a cluster node's agent, data port, and the copy
//!   tasks of re-replication.
//!
//! Each tenant store (and the cluster node's store) is a
//! [`kvtier_store::store::EmbeddedStore`] reached directly ([`server::TenantStore`]), not
//! through a `Client`, so server mode has exactly the put/get/rollback/fold semantics of
//! embedded mode. A page buffer is bounds-checked once, against the session's mapping, and
//! handed to the store as [`kvtier_store::store::CheckedBuffers`]: no region registry.
//!
//! Floor plan (issue 28 §3; README "Architecture"): this crate builds on `kvtier-store` (the
//! stores, config, metrics), `kvtier-transport` (TCP frames and UCX for the data port and copy
//! tasks, the master link of the node agent), `kvtier-rpc` (the master's messages, the bounds
//! and key hash both ends share), `kvtier-events` and `kvtier-engine`. It depends on neither
//! `kvtier-client` (the callers' facade) nor `kvtier-master`.

#![deny(unsafe_op_in_unsafe_fn)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod cli;
pub mod config;
// Issue 30: the host KV-event stream (vLLM's ZMQ wire protocol).
pub mod events;
pub mod fault_guard;
// Issue 17: the UCX put landing area and its extent allocator.
pub mod landing;
pub mod limits; // issue 16: the crate's bounds, cross-checked
pub mod node;
pub mod peer;
pub mod rereplicate;
pub mod server;
pub mod shm;
// Issue 17: the node's side of the UCX data plane.
pub mod ucx_node;

pub use config::{ServerConfig, ServerSources};
pub use server::{RunningServer, Server, ServerError};
