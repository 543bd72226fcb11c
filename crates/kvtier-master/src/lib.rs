//! `kvtier master`: the control plane of cluster mode.
//!
//! It owns the node registry (leases renewed by heartbeats), the key directory (which node
//! holds which object) and placement ([`directory`]), serves them as tonic RPCs ([`service`],
//! schema in `proto/kvtier_master.proto`), and, with etcd configured, elects one leader among
//! several masters ([`election`]). Page bytes never pass through the master.

pub mod directory;
pub mod election;
pub mod service;

/// The generated protobuf messages and tonic client/server of `kvtier.master.v1`.
pub mod rpc {
    tonic::include_proto!("kvtier.master.v1");
}

pub use directory::{Directory, NodeSpec};
pub use election::Leadership;
pub use service::{run, MasterConfig, MasterError};
