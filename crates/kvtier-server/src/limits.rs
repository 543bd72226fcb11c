//! The bounds of `kvtier serve` and of a cluster node gathered in one place, with the
//! relations between them (and with the master's and the protocol's) checked at compile time.
//! Each constant stays declared next to the code that enforces it and is re-exported here.

pub use crate::fault_guard::MAX_GUARDED_MAPPINGS;
pub use crate::peer::{HELLO_TIMEOUT, MAX_CONNECTIONS, MAX_UNAUTHENTICATED, STOP_WAIT};
use kvtier_proto::limits::{MAX_KEYS_PER_BATCH, MAX_KEY_LEN};
use kvtier_rpc::{MAX_KEYS_PER_CALL, MAX_RPC_MESSAGE_BYTES};

// --- the local socket's per-uid caps (issue 26 §3; `server::ledger`) ----------------------

/// Descriptors one local connection holds: its socket, the writer's clone, the registry's
/// clone (for shutdown), and one more a read may bring beyond its slot (closed at once; the
/// kernel rounds the control buffer up). Its slot for a passed descriptor is counted with
/// the passed ones.
pub const DESCRIPTORS_PER_CONNECTION: u64 = 4;
/// Most descriptors queued on one connection ahead of their `RegisterRegion` frames.
pub const MAX_QUEUED_FDS: u64 = 8;
/// Descriptors kept for the stores (SSD segment files), the listener, the metrics endpoint
/// and stdio, besides the third of the limit left to the cluster data port.
pub const RESERVED_DESCRIPTORS: u64 = 128;
/// One uid may hold at most 1/this of the connections and of the passed descriptors.
pub const PER_UID_DIVISOR: u64 = 4;
/// 1/this of each total is kept for operators (the server's uid, root, `operator_uids`).
pub const OPERATOR_RESERVE_DIVISOR: u64 = 4;

// Connections a uid may hold leave others their share, and the operators' reserve is not
// all of the total.
const _: () = assert!(PER_UID_DIVISOR >= 2 && OPERATOR_RESERVE_DIVISOR >= 2);
// The data port's caps are a third of the descriptor limit (peer::connection_caps), the
// local socket's what remains after the reserve.
const _: () = assert!(MAX_CONNECTIONS as u64 * 3 <= 1 << 20);
// A connection's queue fits what one uid may pass at the smallest limit the caps allow.
const _: () = assert!(MAX_QUEUED_FDS >= 1);

/// Most key bytes one registration call to the master carries (the node splits by count and
/// by bytes).
pub const NODE_KEY_BYTES_PER_CALL: usize = crate::node::KEY_BYTES_PER_CALL;

// Connections still in the handshake are a subset of the open ones.
const _: () = assert!(MAX_UNAUTHENTICATED <= MAX_CONNECTIONS);
// A node's registration call (its key bytes plus one more key of the longest kind, and about
// ten bytes of encoding per key) fits the master's message limit.
const _: () = assert!(
    NODE_KEY_BYTES_PER_CALL + MAX_KEY_LEN + 10 * MAX_KEYS_PER_CALL <= MAX_RPC_MESSAGE_BYTES
);
// The master takes as many keys per call as a batch on the wire may name.
const _: () = assert!(MAX_KEYS_PER_CALL <= MAX_KEYS_PER_BATCH);

// Issue 26: leases pin at most half the arena at once (the rest stays evictable for
// everyone's puts), one connection's leases a share no larger than that.
pub use crate::ucx_node::{LEASE_CONNECTION_SHARE, LEASE_NODE_SHARE};
const _: () = assert!(LEASE_NODE_SHARE >= 2);
const _: () = assert!(LEASE_CONNECTION_SHARE >= LEASE_NODE_SHARE);
