//! The names of the metrics the transports record. `kvtier_store::metrics::names` re-exports
//! them beside every other kvtier metric, so the one list stays complete.

/// Counter `{peer, direction}`: page bytes moved to / from a cluster peer (cluster mode).
pub const PEER_TRANSFER_BYTES: &str = "kvtier_peer_transfer_bytes_total";
/// Gauge `{peer, transport}` (issue 17): 1 for the data transport a cluster client uses to
/// read from that peer (`ucx` or `tcp`), 0 for the other.
pub const PEER_TRANSPORT: &str = "kvtier_peer_transport";
