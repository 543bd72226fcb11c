//! kvtier's KV-event streams (issue 30): what kvtier holds, published to cache-aware routers
//! in vLLM's KV-event wire protocol.
//!
//! Owns the parts both streams share: the bounded server side of ZMTP 3 ([`zmtp`]), the
//! mapping of kvtier keys to the engines' block hashes and the msgpack `KVEventBatch`
//! ([`encode`]), and the publisher with its replay ring and snapshot ([`stream`]). The
//! producers live with what they watch: the host stream of `kvtier serve` in
//! `kvtier-server` (its stores' engine event rings), the cluster stream of `kvtier master`
//! in `kvtier-master` (its directory, leader only).
//!
//! Floor plan (issue 28 §3; README "Architecture"): builds on `kvtier-proto` only, so `kvtier-server` and
//! `kvtier-master` share it without depending on each other.

pub mod encode;
pub mod stream;
pub mod zmtp;

pub use stream::{
    parse_endpoint, EventsError, HeldSet, Owned, Stream, StreamConfig, END_SEQ, MAX_BUFFER_BATCHES,
    MAX_SUBSCRIBERS, MAX_SUBSCRIBER_QUEUE, SNAPSHOT, TICK,
};
