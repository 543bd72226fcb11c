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

/// Most keys one RPC may carry (the protocol's batch bound).
pub const MAX_KEYS_PER_CALL: usize = kvtier_proto::limits::MAX_KEYS_PER_BATCH;
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
// A full call of keys up to 128 bytes each on the wire (SGLang's page keys take about 74)
// fits in one message; callers with longer keys also split by bytes (a node's registration).
const _: () = assert!(MAX_KEYS_PER_CALL * 128 <= MAX_RPC_MESSAGE_BYTES);
// A task times out well after the heartbeat that hands it out (lease / 3 at the shortest lease).
const _: () = assert!(REPAIR_TASK_TIMEOUT.as_millis() > MIN_LEASE.as_millis());
