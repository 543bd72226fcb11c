//! The bounds of `kvtier serve` and of a cluster node gathered in one place, with the
//! relations between them (and with the master's and the protocol's) checked at compile time.
//! Each constant stays declared next to the code that enforces it and is re-exported here.

pub use crate::fault_guard::MAX_GUARDED_MAPPINGS;
pub use crate::peer::{HELLO_TIMEOUT, MAX_CONNECTIONS, MAX_UNAUTHENTICATED};
use kvtier_master::limits::{MAX_KEYS_PER_CALL, MAX_RPC_MESSAGE_BYTES};
use kvtier_proto::limits::{MAX_KEYS_PER_BATCH, MAX_KEY_LEN};

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
