//! kvtier's single-host store.
//!
//! Objects are byte strings under byte-string keys, stored in tiers behind one index:
//! - [`config`] — [`EngineConfig`] and its validation; [`limits`] — its bounds, cross-checked;
//! - [`error`] — [`EngineError`];
//! - [`stats`] — lock-free counters and the [`EngineStats`] snapshot;
//! - `dram` — the pre-faulted arena (one of three `unsafe` modules) and its block allocator;
//! - `index` — the sharded key → object map;
//! - `object` — stored objects and read pins ([`PinnedObject`]);
//! - [`eviction`] — the [`EvictionPolicy`] trait with [`Lru`] and [`PrefixDepth`];
//! - `ssd` — the SSD tier: segment log, copy pipeline, warm restart, [`fsck`]; `ssd/tier/` is
//!   split by owned state (index, segments, pipeline, read, reclaim, recovery);
//! - `engine` — [`Engine`], which ties them together;
//! - [`private_dir`] — the private-directory check of the SSD tier and `kvtier serve`.
//!
//! [`Engine::check_invariants`] and [`EvictionPolicy::check_invariants`] check the invariants
//! the module docs state (the model and stress tests call them).
//!
//! Guarantees: put-if-absent, nothing visible before it is fully written, a read either gets
//! the exact stored bytes or fails cleanly, and eviction never frees memory under a reader.
//!
//! Floor plan (issue 28 §3; README "Architecture"): builds on `kvtier-proto` only; `kvtier-store` wraps it
//! (`EmbeddedStore`), and through it `kvtier-client`, `kvtier serve` and the Python module.

// Every `unsafe` block lives in `dram/arena.rs`, `ssd/aligned.rs` and `ssd/uring.rs`, the three
// modules allowed to opt out (the workspace lints deny it too).
#![deny(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod config;
mod dram;
mod engine;
pub mod error;
pub mod eviction;
mod index;
pub mod limits;
mod object;
pub mod private_dir;
// Issue 27: progress lines of long start-up steps.
pub mod progress;
mod ssd;
pub mod stats;

pub use config::{
    EngineConfig, EvictionPolicyKind, SsdDurabilityMode, SsdIoBackend, SsdWritePolicy,
};
pub use dram::{Allocator, Extent};
pub use engine::{Engine, Placement, PutMeta, PutOutcome};
pub use error::{EngineError, NoSpaceCause};
pub use eviction::{EvictionPolicy, Lru, PrefixDepth};
pub use object::PinnedObject;
pub use ssd::{fsck, FsckReport, FsckSegment, RecoveryProgress, RecoveryReport, ScanCounts};
pub use stats::EngineStats;
