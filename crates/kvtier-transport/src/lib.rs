//! kvtier's transports: how page bytes move between a cluster client (or a node's copy task)
//! and a node's data port, and how callers reach the leading master.
//!
//! - [`Transport`] is the seam: [`tcp::TcpTransport`] (kvtier's TCP frames, authenticated
//!   connections, the keyed integrity trailer checked on every read) and [`ucx::UcxTransport`]
//!   (issue 17: per peer UCX one-sided reads from a node's registered arena, TCP frames for
//!   the control path; `ucx/ffi.rs`, `ucx/netif.rs` and `ucx/plane.rs` are this crate's only
//!   `unsafe` modules). A transport moves whole objects and reports a result per object; it
//!   never decides placement (the master does) and never sees unregistered memory: callers
//!   hand it slices that the region registry has already bounds-checked.
//! - [`master`]: [`master::MasterLink`], the authenticated, failing-over connection to the
//!   leading master, and [`master::ClusterError`], the errors of that control path.
//! - [`names`]: the metric names recorded here (listed with every other in `kvtier-store`).
//!
//! Floor plan (issue 28 §3; README "Architecture"): this crate builds on `kvtier-proto` (frames,
//! peer protocol, credentials) and `kvtier-rpc` (the master's stubs) only. `kvtier-store` (the
//! cluster store, the config's transport choice) and `kvtier-server` (the data port, UCX
//! leases, copy tasks, the node agent) build on it; it knows nothing of stores or engines.

// The connection to the cluster's leading master (failover, per-call credentials).
pub mod master;
/// The metric names this crate records (listed with every other in `kvtier_store::metrics::names`).
pub mod names;
pub mod tcp;
// Issue 17: the UCX data plane (one-sided reads from a node's registered arena).
pub mod ucx;

use kvtier_proto::ProtoError;

/// One object to store on a peer.
#[derive(Clone, Copy, Debug)]
pub struct PutItem<'a> {
    pub key: &'a [u8],
    pub value: &'a [u8],
    pub depth: Option<u32>,
}

/// One object to read from a peer, straight into `dst` (whose length must match the stored
/// object's exactly).
#[derive(Debug)]
pub struct GetItem<'a> {
    pub key: &'a [u8],
    pub dst: &'a mut [u8],
}

/// Why one transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("peer {peer}: cannot connect: {source}")]
    Connect {
        peer: String,
        #[source]
        source: std::io::Error,
    },
    #[error("peer {peer}: {source}")]
    Io {
        peer: String,
        #[source]
        source: std::io::Error,
    },
    #[error("peer {peer} refused the cluster token: {message}")]
    Unauthorized { peer: String, message: String },
    /// The peer did not prove the cluster token in the data-port handshake: not a node of
    /// this cluster (a fake node, a redirected address). Nothing derived from the token was
    /// sent to it.
    #[error("peer {peer} did not prove the cluster token ({message}): not a node of this cluster")]
    NotAuthentic { peer: String, message: String },
    /// An object's bytes do not match its end-to-end checksum (forged, torn, or another key's):
    /// a miss, never a hit.
    #[error("peer {peer}: object failed its end-to-end checksum ({message})")]
    Integrity { peer: String, message: String },
    #[error("peer {peer} is marked down for {remaining_ms} ms more after a failure")]
    PeerDown { peer: String, remaining_ms: u64 },
    #[error("not found on peer {peer}")]
    NotFound { peer: String },
    #[error("peer {peer}: stored length differs from the buffer ({message})")]
    SizeMismatch { peer: String, message: String },
    #[error("peer {peer} refused (code {code}): {message}")]
    Refused {
        peer: String,
        code: u16,
        message: String,
    },
    #[error("peer {peer} answered request {found} where {expected} was due")]
    OutOfOrder {
        peer: String,
        expected: u64,
        found: u64,
    },
    #[error("peer {peer}: protocol error: {source}")]
    Protocol {
        peer: String,
        #[source]
        source: ProtoError,
    },
    /// The rest of a batch after its connection failed: the reason names the peer already.
    #[error("{reason} (the batch stopped there)")]
    BatchAborted { reason: String },
}

impl TransportError {
    /// A miss rather than a fault: the peer answered that it does not hold the object.
    pub fn is_not_found(&self) -> bool {
        matches!(self, TransportError::NotFound { .. })
    }

    /// The peer could not be reached (or stopped answering): its objects are unreachable.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            TransportError::Connect { .. }
                | TransportError::NotAuthentic { .. }
                | TransportError::Io { .. }
                | TransportError::PeerDown { .. }
                | TransportError::BatchAborted { .. }
        )
    }
}

/// Moves objects to and from peers, addressed by their data address (`host:port`).
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// Store every item on `peer` (put-if-absent there); one result per item, in order.
    fn put(&self, peer: &str, items: &[PutItem<'_>]) -> Vec<Result<(), TransportError>>;
    /// Read every item from `peer` into its destination; one result per item, in order. A
    /// failed item's destination may hold partial bytes and must not be used.
    fn get(&self, peer: &str, items: &mut [GetItem<'_>]) -> Vec<Result<(), TransportError>>;
    /// Remove keys on `peer`; whether each was present.
    fn remove(&self, peer: &str, keys: &[&[u8]]) -> Result<Vec<bool>, TransportError>;
    /// Mark keys on `peer` superseded window state (an eviction hint); whether each was
    /// stored there and marked.
    fn demote(&self, peer: &str, keys: &[&[u8]]) -> Result<Vec<bool>, TransportError>;
    /// Remove keys starting with `prefix` on `peer` (empty: every key), at most
    /// `kvtier_proto::peer::MAX_CLEARED_KEYS` per call; the keys removed (fewer than the
    /// most: none is left).
    fn clear_prefix(&self, peer: &str, prefix: &[u8]) -> Result<Vec<Vec<u8>>, TransportError>;
}
