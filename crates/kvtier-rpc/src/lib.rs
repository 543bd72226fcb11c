//! kvtier's control RPCs (`kvtier.master.v1`): the protobuf messages and the tonic client and
//! server stubs generated from `proto/kvtier_master.proto`, the bounds that both ends of
//! those RPCs must agree on ([`MAX_RPC_MESSAGE_BYTES`], [`MAX_KEYS_PER_CALL`],
//! [`MAX_REPLICAS`]) and [`KeyHash`], the name a copy task gives a key.
//!
//! This crate exists so that callers of the master link only the stubs and tonic, not the
//! master itself with its directory, election and `etcd-client`: `kvtier-transport` (the
//! master link), `kvtier-store` (the cluster store, and through it `kvtier-client` and the
//! Python module) and `kvtier-server` (a cluster node's agent and copy tasks). `kvtier-master`
//! re-exports it as `kvtier_master::rpc`.
//!
//! Invariants: nothing here holds state; the constants are the single declaration of each
//! bound (the master and its callers read them from here, never restate them).

/// The generated messages and stubs; code written by `tonic-prost-build`, not by hand.
#[allow(clippy::all, clippy::pedantic, clippy::unwrap_used, missing_docs)]
mod generated {
    tonic::include_proto!("kvtier.master.v1");
}

pub use generated::*;

mod key_hash;
pub use key_hash::{key_hash, KeyHash};

/// Most keys one RPC may carry (the protocol's batch bound): the master refuses more, a node
/// splits its key lists below it.
pub const MAX_KEYS_PER_CALL: usize = kvtier_proto::limits::MAX_KEYS_PER_BATCH;

/// Largest RPC message either end encodes or decodes: the master's decoding limit and the
/// client's. Registration and key lists are split into calls that stay below it.
pub const MAX_RPC_MESSAGE_BYTES: usize = 16 << 20;

/// Most copies of one object the master's directory tracks; a caller never asks for more
/// replicas, and never tries more placement rounds, than this.
pub const MAX_REPLICAS: usize = 3;
