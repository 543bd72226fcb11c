//! kvtier's request model and its wire encoding.
//!
//! This crate owns the plain data types that every mode of kvtier speaks — the embedded engine
//! evaluates them directly, the local server and the cluster master receive them as frames —
//! so that a whole SGLang v2 existence query (every pool, every hit policy, narrowing) is one
//! value and therefore one round trip. It depends on nothing but `thiserror`.

pub mod query;

pub use query::{ExistsV2Answer, ExistsV2Query, HitPolicy, KvComponents, PoolQuery};
