//! `kvtier master`: the control plane of cluster mode.
//!
//! It owns the node registry (leases renewed by heartbeats), the key directory (which node
//! holds which object), placement and re-replication planning ([`directory`]), serves them
//! as tonic RPCs ([`service`], schema and stubs in the `kvtier-rpc` crate), and, with etcd
//! configured, elects one leader among several masters ([`election`]). Page bytes never pass through the master.
//!
//! # Why the directory is rebuilt from the nodes, not kept in etcd
//!
//! etcd decides only who leads (one lease and one key per master). The directory lives in the
//! leader's memory, and a master that becomes leader (or a single master that restarted)
//! starts from an empty one: every node's next heartbeat is answered `known = false`, and the
//! node registers again with its data address and every key it holds (peer-stored keys and,
//! after a node restart, what its SSD tier brought back). The reasons:
//!
//! - Cost per put. Keeping the directory in etcd would add a quorum-replicated, fsynced etcd
//!   write per committed object (per key of a batch: a page batch is pages x components keys)
//!   to every put, besides the one `CommitPuts` round trip it costs now.
//! - etcd's write rate. etcd is built for small amounts of control data; its own performance
//!   guide puts a whole cluster at tens of thousands of small writes per second and its
//!   database at a few GiB, well below a KV cache's churn of object puts and evictions.
//! - The node is the truth. A node holds the bytes; an entry in etcd could outlive them (a
//!   node that restarted without its SSD, an eviction not yet reported), while a rebuilt entry
//!   exists only because a live node just reported it.
//! - Rebuilding is cheap: `tests/rebuild_cost.rs` registers two nodes reporting the same 1 M
//!   keys (2 M replica entries) in about 0.6 s on a shared 2-core machine (about 300 ns per
//!   replica); registration carries about 74 bytes per key (1 M keys: about 74 MB), sent as a
//!   `RegisterNode` with the first 65,536 keys and `AddNodeKeys` calls with the rest, each
//!   within the 16 MiB RPC limit.
//!
//! What a failover (or a single master's restart) loses:
//!
//! - Nothing acknowledged that a live node still holds. A put is acknowledged only after
//!   `CommitPuts`, and only once its bytes are on the nodes, so every acknowledged object is
//!   on a node that reports it when it registers with the new leader. Objects whose only
//!   copies are on a node that is dead or not yet re-registered are misses until it registers.
//! - In-flight puts: a claim of the old leader is unknown to the new one (claim ids differ per
//!   leader term), so its commit is refused and the put fails, unless a node already reported
//!   the key; the caller (SGLang's HiCache) puts it again. Bytes written for a put that failed
//!   stay on the node and are listed at its next registration.
//! - Availability for about the etcd lease TTL plus one campaign poll (TTL / 4) plus a node
//!   heartbeat (lease / 3): in `tests/cluster_failover.rs` (TTL 2 s, node lease 1 s) a
//!   follower leads 2.3-2.6 s after the leader's SIGKILL and puts and gets succeed again
//!   50-150 ms later. Meanwhile calls retry for `cluster_master_retry_ms`, then fail.
//! - Replication of puts placed while only some nodes have re-registered: placement picks
//!   among the nodes registered then, so such a put can get fewer replicas than asked, until
//!   re-replication copies it after its start-up grace (see [`directory`]).
//! - Pending claims and free-space estimates (rebuilt from the next heartbeats).

//! # Floor plan
//!
//! [`directory`] (split by owned state: entries and claims, the node registry, re-replication,
//! and `check_invariants`), [`service`] (the RPC handlers and the process), [`auth`],
//! [`election`], [`events`] (the cluster KV-event stream for routers, issue 30; its
//! publisher is the `kvtier-events` crate), [`admission`] (connection caps and deadlines of the RPC port), [`limits`] (every bound, cross-checked at compile time) and
//! [`MasterConfig::validate`]. The generated stubs are the `kvtier-rpc` crate, re-exported as
//! [`rpc`]: clients depend on that crate, not on this one.
//!
//! Crates (issue 28 §3): this crate builds on `kvtier-rpc`, `kvtier-events` and `kvtier-proto`;
//! only the `kvtier` command (`kvtier-cli`) depends on it. The bounds and the key hash a node
//! shares with the master (`MAX_KEYS_PER_CALL`, `MAX_RPC_MESSAGE_BYTES`, [`directory::key_hash`],
//! [`directory::KeyHash`]) are declared in `kvtier-rpc` and re-exported here under their
//! old paths.

pub mod admission;
pub mod auth;
pub mod clock;
pub mod directory;
pub mod election;
pub mod events;
pub mod limits;
pub mod service;
mod validate;

/// The generated protobuf messages and tonic client/server of `kvtier.master.v1`, from the
/// `kvtier-rpc` crate (callers that only talk to a master depend on that crate alone).
pub use kvtier_rpc as rpc;

pub use clock::{Clock, ManualClock, SystemClock};
pub use directory::{Directory, NodeSpec};
pub use election::Leadership;
pub use service::{run, MasterConfig, MasterError};
pub use validate::MasterConfigError;
