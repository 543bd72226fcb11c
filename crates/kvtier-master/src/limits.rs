//! Every bound of the master in one place, with the relations between them checked at
//! compile time (`const _: () = assert!(..)`), so changing one number cannot silently break
//! another part's assumption. The modules that enforce a bound re-export it under its old
//! path (`directory::MAX_REPLICAS`, `service::MAX_KEYS_PER_CALL`, `auth::MAX_RPCS_IN_FLIGHT`,
//! ...).

use std::time::Duration;

// --- the directory -------------------------------------------------------------------------

/// Most copies of one object the directory tracks (declared in `kvtier-rpc`: the clients
/// bound their placement rounds by it too).
pub const MAX_REPLICAS: usize = kvtier_rpc::MAX_REPLICAS;
/// Most nodes one master tracks (node indexes are `u16`, `u16::MAX` marks an unused slot).
pub const MAX_NODES: usize = (u16::MAX - 1) as usize;
/// Shards of the key directory (one bit each in a `u64` dirty mask).
pub const DIRECTORY_SHARDS: usize = 64;
/// Re-replication: most copy tasks in flight (planned or handed out) in the whole cluster.
pub const MAX_REPAIR_TASKS: usize = 4096;
/// Re-replication: most tasks in flight per source holder (two heartbeats' worth).
pub const MAX_REPAIR_TASKS_PER_SOURCE: usize = 2 * MAX_REPAIR_TASKS_PER_HEARTBEAT;
/// Re-replication: most tasks one heartbeat reply hands a holder. With heartbeats every
/// lease / 3 (1 s by default) this caps one holder at 256 objects copied per second.
pub const MAX_REPAIR_TASKS_PER_HEARTBEAT: usize = 256;
/// Re-replication: a task handed out and not done within this fails and is planned again.
pub const REPAIR_TASK_TIMEOUT: Duration = Duration::from_secs(20);
/// Re-replication: entries one planning tick scans at most (whole shards; at least one).
pub const MAX_REPAIR_SCAN_PER_TICK: usize = 1 << 18;
/// Re-replication: a tick stops after this many short entries whose holders were all at
/// their task limit (the rest waits for a later tick rather than being scanned in vain).
pub const MAX_REPAIR_DEFERRED_PER_TICK: usize = 4096;
/// Re-replication waits this many leases after the directory starts or is reset, so every
/// live node has re-registered before missing replicas count as lost.
pub const REPAIR_GRACE_LEASES: u32 = 2;

// --- the RPC service -----------------------------------------------------------------------

/// Most keys one RPC may carry (declared in `kvtier-rpc`: a node splits its calls by it).
pub const MAX_KEYS_PER_CALL: usize = kvtier_rpc::MAX_KEYS_PER_CALL;
/// Largest RPC message the master decodes (declared in `kvtier-rpc` for both ends).
pub const MAX_RPC_MESSAGE_BYTES: usize = kvtier_rpc::MAX_RPC_MESSAGE_BYTES;
/// How long one existence query may evaluate.
pub const EXISTS_DEADLINE: Duration = Duration::from_secs(2);
/// Existence queries evaluated at once (blocking threads).
pub const EXISTS_WORKERS: usize = 2;
/// Shortest node lease [`crate::MasterConfig::validate`] accepts (heartbeats go every
/// lease / 3; shorter would be a heartbeat storm and spurious expiries).
pub const MIN_LEASE: Duration = Duration::from_millis(100);

// --- authentication ------------------------------------------------------------------------

/// How far a proof's time may be from the master's clock, either way.
pub const FRESHNESS_WINDOW: Duration = Duration::from_secs(30);
/// Most nonces remembered (each for twice the window); a master seeing more fresh proofs than
/// this within a minute refuses further ones (`RESOURCE_EXHAUSTED`) rather than forget.
pub const MAX_REMEMBERED_NONCES: usize = 1 << 20;
/// RPCs running at once over every connection.
pub const MAX_RPCS_IN_FLIGHT: usize = 256;
/// RPCs running at once on one connection (tonic's per-connection limit; more wait).
pub const MAX_RPCS_PER_CONNECTION: usize = 32;

/// RPCs kept for node liveness (`Heartbeat`, `RegisterNode`, `AddNodeKeys`, `LeaveNode`)
/// on top of [`MAX_RPCS_IN_FLIGHT`]: when the shared slots are taken, these still run, so a
/// busy master never drops live nodes for missed heartbeats.
pub const RESERVED_NODE_RPCS: usize = 64;
/// How long a request's body may take to arrive in full. The admission slot is taken only
/// once it has (a stream whose body never comes holds nothing), and a body later than this
/// is answered `DEADLINE_EXCEEDED`.
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);
/// HTTP/2 streams one connection may have open at once (the RPCs beyond
/// [`MAX_RPCS_PER_CONNECTION`] wait for one of them).
pub const MAX_STREAMS_PER_CONNECTION: u32 = 64;
/// Largest HTTP/2 header list accepted (a credential header is about 150 bytes).
pub const MAX_HEADER_LIST_BYTES: u32 = 16 << 10;
/// HTTP/2 keepalive: a ping every this long on an idle connection ...
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// ... answered within this, or the connection is closed (a dead peer's slot is freed).
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

// --- connections (crate::admission) --------------------------------------------------------

/// Open connections in all (lowered to fit `RLIMIT_NOFILE`).
pub const MAX_CONNECTIONS: usize = 4096;
/// Open connections from one source address.
pub const MAX_CONNECTIONS_PER_SOURCE: usize = 512;
/// Connections that have not yet carried an authenticated RPC, in all; a new one past this
/// cuts the oldest.
pub const MAX_PENDING: usize = 256;
/// Unauthenticated connections from one source address; more are refused at accept.
pub const MAX_PENDING_PER_SOURCE: usize = 64;
/// A connection must carry an authenticated RPC within this of its accept, or it is cut
/// (however slowly it trickles its preface or headers).
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);
/// A member connection with no RPC running for this long is cut (clients reconnect).
pub const MEMBER_IDLE: Duration = Duration::from_secs(300);
/// Descriptors one connection holds (the socket and the registry's duplicate, to cut it).
pub const DESCRIPTORS_PER_CONNECTION: usize = 2;
/// Descriptors kept for everything else (listener, etcd, metrics endpoint, stdio).
pub const RESERVED_DESCRIPTORS: usize = 64;
/// How long the accept loop pauses when no descriptor is left.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

// --- cross-checks --------------------------------------------------------------------------

// The wanted factor is stored in one byte of an entry, and every entry has a holder.
const _: () = assert!(MAX_REPLICAS >= 1 && MAX_REPLICAS <= u8::MAX as usize);
// Node indexes fit in u16 with u16::MAX left free as the empty-slot marker.
const _: () = assert!(MAX_NODES < u16::MAX as usize);
// One dirty bit per shard in a u64; the shard is picked from the hash's top 6 bits.
const _: () = assert!(DIRECTORY_SHARDS == u64::BITS as usize);
// A heartbeat never hands a holder more than it may have in flight, nor than the cluster may.
const _: () = assert!(MAX_REPAIR_TASKS_PER_HEARTBEAT <= MAX_REPAIR_TASKS_PER_SOURCE);
const _: () = assert!(MAX_REPAIR_TASKS_PER_SOURCE <= MAX_REPAIR_TASKS);
// A tick scans at least as many entries as it may defer, and whole shards of a full batch.
const _: () = assert!(MAX_REPAIR_DEFERRED_PER_TICK <= MAX_REPAIR_SCAN_PER_TICK);
// One connection cannot take every RPC slot of the master.
const _: () = assert!(MAX_RPCS_PER_CONNECTION < MAX_RPCS_IN_FLIGHT);
// Pending connections are a part of the open ones, per source as in all.
const _: () = assert!(MAX_PENDING < MAX_CONNECTIONS);
const _: () = assert!(MAX_PENDING_PER_SOURCE < MAX_PENDING);
const _: () = assert!(MAX_CONNECTIONS_PER_SOURCE < MAX_CONNECTIONS);
// A connection's streams cover its RPC slots (the rest wait), and the streams of every
// connection a source may open cannot take the reserved node slots from other sources.
const _: () = assert!(MAX_STREAMS_PER_CONNECTION as usize >= MAX_RPCS_PER_CONNECTION);
// Unauthenticated connections are cut long before a member's idle ones.
const _: () = assert!(HANDSHAKE_DEADLINE.as_millis() < MEMBER_IDLE.as_millis());
// A keepalive ping is answered before the next one is due.
const _: () = assert!(KEEPALIVE_TIMEOUT.as_millis() < KEEPALIVE_INTERVAL.as_millis());
// A node's heartbeat (every lease / 3) never waits for a body deadline longer than a
// freshly proven credential stays fresh.
const _: () = assert!(BODY_DEADLINE.as_millis() < FRESHNESS_WINDOW.as_millis());
// The reserved node slots are a fraction of the shared ones.
const _: () = assert!(RESERVED_NODE_RPCS <= MAX_RPCS_IN_FLIGHT);
// A full call of keys up to 128 bytes each on the wire (SGLang's page keys take about 74)
// fits in one message; callers with longer keys also split by bytes (a node's registration).
const _: () = assert!(MAX_KEYS_PER_CALL * 128 <= MAX_RPC_MESSAGE_BYTES);
// A task times out well after the heartbeat that hands it out (lease / 3 at the shortest lease).
const _: () = assert!(REPAIR_TASK_TIMEOUT.as_millis() > MIN_LEASE.as_millis());
