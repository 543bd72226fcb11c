//! kvtier's request model and its wire encoding.
//!
//! This crate owns the plain data types that every mode of kvtier speaks — the embedded engine
//! evaluates them directly, the local server and the cluster master receive them as frames —
//! so that a whole SGLang v2 existence query (every pool, every hit policy, every verdict) is one
//! value and therefore one round trip. Besides `thiserror` it uses `hmac`/`sha2`/`getrandom`
//! (credential proofs) and `blake3` (the keyed object integrity trailer) in [`auth`], and `blake2` (the key
//! fingerprint) in [`keys`].
//!
//! - [`auth`]: proofs of the cluster token (data ports, master RPCs), the keyed object
//!   integrity trailer.
//! - [`namespace`]: who owns a stored key (local tenants vs the cluster).
//! - [`keys`]: the object key scheme (compose, parse, pools, page groups; issue 16).
//! - [`query`]: the v2 existence query model and its fold.
//! - [`messages`]: the other request/reply bodies (batches, handshake, error reply).
//! - [`codec`]: the binary encoding of every body ([`Encode`] / [`Decode`]).
//! - [`frame`]: length-prefixed frames over any `Read` / `Write`.
//! - [`server`]: the local-server bodies (sessions, shm regions, page batches, stats).
//! - [`opcode`]: what a frame asks for.
//! - [`limits`]: the limits every encoder and decoder enforces.
//! - [`error`]: [`ProtoError`], the one error type.
//! - [`refusals`]: rate-limited, aggregated logs of refused connections (issue 26).
//!
//! Nothing here panics on peer input or uses `unsafe`.
//!
//! Floor plan (issue 28 §3; README "Architecture"): the bottom crate (no kvtier dependency); every other
//! kvtier crate builds on it.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod auth;
pub mod codec;
pub mod error;
pub mod frame;
pub mod keys;
pub mod limits;
pub mod messages;
pub mod namespace;
pub mod opcode;
pub mod peer;
// Issue 17: control bodies of the UCX data plane.
pub mod peer_ucx;
pub mod query;
// Issue 26: rate-limited, aggregated refusal logs.
pub mod refusals;
pub mod server;

pub use codec::{Decode, Encode, Reader};
pub use error::ProtoError;
pub use frame::{encode_frame, read_frame, read_frame_limited, write_frame, FrameHeader};
pub use messages::{
    BatchResult, ErrorReply, Handshake, ItemFailure, KeyBatch, PutBatchHeader, MAX_ERRORS_PER_BATCH,
};
pub use opcode::Opcode;
pub use query::{ExistsV2Answer, ExistsV2Query, HitPolicy, KvComponents, PoolQuery};
