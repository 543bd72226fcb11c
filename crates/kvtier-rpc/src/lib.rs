//! kvtier's control RPCs (`kvtier.master.v1`): the protobuf messages and the tonic client and
//! server stubs generated from `proto/kvtier_master.proto`, and the bounds that both ends of
//! those RPCs must agree on.
//!
//! This crate exists so that callers of the master (the client library and through it the
//! Python module) link only the stubs and tonic, not the master itself with its directory,
//! election and `etcd-client`. `kvtier-master` re-exports it as `kvtier_master::rpc`.
//!
//! Invariants: nothing here holds state; the constants are the single declaration of each
//! bound (the master and its callers read them from here, never restate them).

/// The generated messages and stubs; code written by `tonic-prost-build`, not by hand.
#[allow(clippy::all, clippy::pedantic, clippy::unwrap_used, missing_docs)]
mod generated {
    tonic::include_proto!("kvtier.master.v1");
}

pub use generated::*;

/// Largest RPC message either end encodes or decodes: the master's decoding limit and the
/// client's. Registration and key lists are split into calls that stay below it.
pub const MAX_RPC_MESSAGE_BYTES: usize = 16 << 20;

/// Most copies of one object the master's directory tracks; a caller never asks for more
/// replicas, and never tries more placement rounds, than this.
pub const MAX_REPLICAS: usize = 3;
