//! The key directory and the node registry: which live node holds which object.
//!
//! Memory per object is what the master's budget is about (target: at most 64 bytes with 1 M
//! objects), so an entry is not the key: it is the key's 128-bit XXH3 hash (16 bytes) mapped
//! to up to [`MAX_REPLICAS`] node indexes (2 bytes each). The hash is already uniform, so the
//! shard maps hash it with the identity. Two different keys collide with probability about
//! n^2 / 2^129 (1e-27 at 1 M objects); a collision would make one key look present, and the
//! read of it then fails closed on the node (which checks the real key), so it is never served
//! wrong bytes.
//!
//! Invariants:
//! - An entry is visible (exists / lookup) only after its put was committed, and only through
//!   nodes that are alive (lease not expired): a dead node's objects are misses at once, and
//!   [`Directory::expire_nodes`] removes them from the entries.
//! - First writer wins: a key that is visible or claimed by an unexpired claim cannot be
//!   claimed again. A claim not committed within its deadline lapses.
//! - Node indexes are never reused: a node that re-registers under its id gets its old index,
//!   and its entries are rebuilt from what it reports.
//! - A commit lists a node only if the node has not registered again since the write was
//!   placed (or the copy task handed out): a node that restarted without its disk in between
//!   acknowledged bytes it no longer holds (issue 29 §4, found by the simulation).
//! - An entry remembers its wanted replication factor (one byte that fits in the slot's
//!   padding, so the budget is unchanged): from the put's namespace at commit, from the key's
//!   namespace when a registration rebuilds it. Fewer live holders than wanted makes it
//!   under-replicated; [`Directory::plan_repairs`] hands surviving holders copy tasks (see
//!   "Re-replication" below).
//!
//! # Re-replication
//!
//! Triggers mark the directory's shards dirty: a node dropped (lease expiry), a node that
//! re-registered without some of its earlier keys (a restart without its SSD), a commit that
//! stored fewer copies than wanted, a node joining while some entry had no target, and the end
//! of the start-up grace ([`REPAIR_GRACE_LEASES`] leases after the directory starts or a new
//! leader resets it, so the nodes have re-registered and a rebuild in progress is not mistaken
//! for lost replicas). [`Directory::plan_repairs`] (the lease sweeper, every lease / 4) scans
//! dirty shards for entries with at least one and fewer than wanted live holders and plans one
//! copy task per entry: a surviving holder (the one with the fewest tasks) copies the object
//! to a target that is live, is not a holder, has room for an object of the mean put size and
//! carries every tag the surviving holders share (the entry does not keep the put's required
//! tags; the holders were placed with them, so this is the conservative reading). The holder
//! gets its tasks in heartbeat replies ([`Directory::take_repair_tasks`]); a task is done when
//! the holder commits the target as a replica (claim 0). Bounds: [`MAX_REPAIR_TASKS`] in flight,
//! [`MAX_REPAIR_TASKS_PER_SOURCE`] per holder, [`MAX_REPAIR_TASKS_PER_HEARTBEAT`] per reply,
//! [`MAX_REPAIR_SCAN_PER_TICK`] entries scanned per tick (and a tick ends after
//! [`MAX_REPAIR_DEFERRED_PER_TICK`] entries whose holders were all at their limit). A task not done within
//! [`REPAIR_TASK_TIMEOUT`] of being handed out, or whose holder or target was dropped, fails
//! and is planned again while a holder is left; an entry with no live holder is gone (nothing
//! can be copied). An eviction is the node's decision that the object is cold: it lowers the
//! entry's wanted factor to the copies left instead of making a new copy.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock::{Clock, SystemClock};

use parking_lot::{Mutex, RwLock};

// Split by the state each part owns (issue 16): see each file's module doc.
mod entries;
mod invariants;
mod nodes;
mod repair;

pub use entries::*;
pub use nodes::*;
pub use repair::*;

// The bounds are declared in `crate::limits` (with their cross-checks); re-exported here
// under their old paths.
pub use crate::limits::{
    MAX_NODES, MAX_REPAIR_DEFERRED_PER_TICK, MAX_REPAIR_SCAN_PER_TICK, MAX_REPAIR_TASKS,
    MAX_REPAIR_TASKS_PER_HEARTBEAT, MAX_REPAIR_TASKS_PER_SOURCE, MAX_REPLICAS, REPAIR_GRACE_LEASES,
    REPAIR_TASK_TIMEOUT,
};
/// Marks an unused replica slot.
const NO_NODE: u16 = u16::MAX;
const SHARDS: usize = crate::limits::DIRECTORY_SHARDS;
/// Every shard's bit in a dirty mask.
const ALL_SHARDS: u64 = u64::MAX;

/// Object size assumed for a target's room before any put was placed (then: the mean of the
/// sizes placed).
const DEFAULT_OBJECT_BYTES: u64 = 1 << 20;

// The key's hash is declared in `kvtier-rpc` (a node indexes its keys by it too).
pub use kvtier_rpc::{key_hash, KeyHash};

/// A hasher for keys that are already uniform hashes: it passes the low 64 bits through.
#[derive(Default)]
struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Not reached for KeyHash (it writes one u64); fold other input in anyway.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = self.0.rotate_left(5) ^ u64::from_le_bytes(word);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

type Shard = HashMap<KeyHash, Replicas, BuildHasherDefault<IdentityHasher>>;

/// Replication factor per namespace, as `kvtier master --replication NS=N` sets it: the
/// factor of a put comes from its request's namespace, that of an entry a registration
/// rebuilds from its key's cluster tag ([`kvtier_proto::namespace::cluster_tag`]: `NUL 'C' NS
/// 0x1f rest`, the clients' namespacing; a key outside the cluster namespace: namespace "").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicationPolicy {
    pub default: usize,
    pub namespaces: std::collections::BTreeMap<String, usize>,
}

impl Default for ReplicationPolicy {
    fn default() -> Self {
        ReplicationPolicy {
            default: 1,
            namespaces: Default::default(),
        }
    }
}

impl ReplicationPolicy {
    pub fn for_namespace(&self, namespace: &str) -> usize {
        self.namespaces
            .get(namespace)
            .copied()
            .unwrap_or(self.default)
            .clamp(1, MAX_REPLICAS)
    }

    /// The factor of a whole (namespaced) key.
    pub fn for_key(&self, key: &[u8]) -> usize {
        if self.namespaces.is_empty() {
            return self.default.clamp(1, MAX_REPLICAS);
        }
        let namespace = kvtier_proto::namespace::cluster_tag(key)
            .and_then(|tag| std::str::from_utf8(tag).ok())
            .unwrap_or("");
        self.for_namespace(namespace)
    }
}

/// The node registry plus the key directory.
pub struct Directory {
    shards: Vec<RwLock<Shard>>,
    nodes: RwLock<Vec<NodeState>>,
    pending: Mutex<HashMap<KeyHash, PendingClaim>>,
    next_claim: Mutex<u64>,
    lease: Duration,
    claim_timeout: Duration,
    policy: RwLock<ReplicationPolicy>,
    repair: Mutex<RepairState>,
    counters: RepairCounters,
    registering: AtomicUsize,
    /// Mean size of the objects placed (0: none yet), the room a repair target must have.
    mean_object_bytes: AtomicU64,
    /// Issue 29: every time the directory reads (the simulation's clock in `tests/sim.rs`).
    clock: Arc<dyn Clock>,
}

fn shard_index(hash: KeyHash) -> usize {
    // The high bits pick the shard; the map uses the low bits.
    (hash.high() >> 58) as usize % SHARDS
}

fn shard_bit(hash: KeyHash) -> u64 {
    1u64 << shard_index(hash)
}

impl Directory {
    pub fn new(lease: Duration, claim_timeout: Duration) -> Directory {
        Directory::with_clock(
            lease,
            claim_timeout,
            ReplicationPolicy::default(),
            Arc::new(SystemClock),
        )
    }

    /// A directory reading the time from `clock` (issue 29: the simulation's).
    pub fn with_clock(
        lease: Duration,
        claim_timeout: Duration,
        policy: ReplicationPolicy,
        clock: Arc<dyn Clock>,
    ) -> Directory {
        let now = clock.now();
        Directory {
            shards: (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect(),
            nodes: RwLock::new(Vec::new()),
            pending: Mutex::new(HashMap::new()),
            next_claim: Mutex::new(first_claim(&*clock)),
            lease,
            claim_timeout,
            policy: RwLock::new(policy),
            repair: Mutex::new(RepairState::new(now + lease * REPAIR_GRACE_LEASES)),
            counters: RepairCounters::default(),
            registering: AtomicUsize::new(0),
            mean_object_bytes: AtomicU64::new(0),
            clock,
        }
    }

    /// The time now, as the directory's clock tells it.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// The directory's clock (the service and the election read the same).
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// A directory whose registrations rebuild entries with `policy`'s factors.
    pub fn with_replication(
        lease: Duration,
        claim_timeout: Duration,
        policy: ReplicationPolicy,
    ) -> Directory {
        Directory::with_clock(lease, claim_timeout, policy, Arc::new(SystemClock))
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The replication factor of a put's namespace.
    pub fn replication_of(&self, namespace: &str) -> usize {
        self.policy.read().for_namespace(namespace)
    }

    fn shard(&self, hash: KeyHash) -> &RwLock<Shard> {
        &self.shards[shard_index(hash)]
    }

    /// Objects in the directory.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().len()).sum()
    }

    /// Issue 27: objects listed per node index (one pass over the directory, shard by shard
    /// under its read lock; for `kvtier stat`, not for every scrape).
    pub fn objects_per_node(&self) -> HashMap<u16, u64> {
        let mut counts: HashMap<u16, u64> = HashMap::new();
        for shard in &self.shards {
            for replicas in shard.read().values() {
                for node in replicas.nodes() {
                    *counts.entry(node).or_default() += 1;
                }
            }
        }
        counts
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forget every node, entry and claim (a new leader starts from what nodes report). The
    /// re-replication planner starts over after its grace; its counters are kept.
    pub fn reset(&self) {
        let mut repair = self.repair.lock();
        for shard in &self.shards {
            *shard.write() = Shard::default();
        }
        self.nodes.write().clear();
        self.pending.lock().clear();
        *self.next_claim.lock() = first_claim(&*self.clock);
        *repair = RepairState::new(self.clock.now() + self.lease * REPAIR_GRACE_LEASES);
    }

    /// Insert an entry directly (benchmarks and rebuilds); it wants as many copies as listed.
    pub fn insert_hash(&self, hash: KeyHash, nodes: &[u16]) {
        self.shard(hash)
            .write()
            .insert(hash, Replicas::from_nodes(nodes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: &str, free: u64, tags: &[&str]) -> NodeSpec {
        NodeSpec {
            node_id: id.into(),
            data_address: format!("{id}:1"),
            capacity_bytes: free,
            free_bytes: free,
            tags: tags.iter().map(|t| t.to_string()).collect(),
        }
    }

    fn dir() -> Directory {
        Directory::new(Duration::from_millis(200), Duration::from_secs(5))
    }

    fn put(d: &Directory, req: &PlaceRequest<'_>, key: &[u8], size: u64) -> Claim {
        let (claim, mut out) = d.claim(req, &[key], &[size]);
        let c = out.remove(0);
        if let Claim::Write(nodes) = &c {
            assert!(d.commit(claim, key, nodes).unwrap());
        }
        d.check_invariants().unwrap();
        c
    }

    #[test]
    fn local_first_then_most_free_and_tags() {
        let d = dir();
        let a = d.register(spec("a", 100, &["ssd"]), &[]).unwrap();
        let b = d.register(spec("b", 1000, &[]), &[]).unwrap();
        let req = PlaceRequest {
            client_node_id: "a",
            replication: 1,
            required_tags: &[],
        };
        assert_eq!(put(&d, &req, b"k1", 10), Claim::Write(vec![a]));
        // No room locally: the node with the most space.
        assert_eq!(put(&d, &req, b"k2", 500), Claim::Write(vec![b]));
        let tags = vec!["ssd".to_string()];
        let req = PlaceRequest {
            client_node_id: "b",
            replication: 1,
            required_tags: &tags,
        };
        assert_eq!(put(&d, &req, b"k3", 10), Claim::Write(vec![a]));
        assert_eq!(put(&d, &req, b"k4", 1000), Claim::NoSpace);
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    #[test]
    fn a_node_that_leaves_is_dropped_at_once() {
        let d = dir();
        let a = d.register(spec("a", GIB, &[]), &[]).unwrap();
        let b = d.register(spec("b", GIB, &[]), &[]).unwrap();
        let req = PlaceRequest {
            client_node_id: "a",
            replication: 2,
            required_tags: &[],
        };
        assert!(matches!(put(&d, &req, b"both", 10), Claim::Write(n) if n == vec![a, b]));
        assert!(d.leave("a"));
        assert!(!d.leave("a"), "already gone");
        assert!(!d.leave("no-such-node"));
        assert_eq!(d.locate(b"both"), vec![b]);
        assert!(!d.heartbeat("a", GIB), "it must register again");
        assert_eq!(d.under_replicated(), 1);
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    #[test]
    fn full_nodes_evict_to_take_puts_local_first() {
        let d = dir();
        let full = |id: &str, capacity: u64, free: u64| NodeSpec {
            capacity_bytes: capacity,
            ..spec(id, free, &[])
        };
        let a = d.register(full("a", 1000, 0), &[]).unwrap();
        let b = d.register(full("b", 4000, 0), &[]).unwrap();
        let c = d.register(full("c", 2000, 300), &[]).unwrap();
        let req = |client, replication| PlaceRequest {
            client_node_id: client,
            replication,
            required_tags: &[],
        };
        // Free room first, wherever it is.
        assert_eq!(put(&d, &req("a", 1), b"k1", 200), Claim::Write(vec![c]));
        // c's room is spoken for: the writer's own node evicts to take it.
        assert_eq!(put(&d, &req("a", 1), b"k2", 200), Claim::Write(vec![a]));
        // No local node: the largest.
        assert_eq!(put(&d, &req("", 1), b"k3", 200), Claim::Write(vec![b]));
        assert_eq!(
            put(&d, &req("a", 3), b"k4", 10),
            Claim::Write(vec![c, a, b])
        );
        // Larger than every node's capacity: nowhere.
        assert_eq!(put(&d, &req("a", 1), b"k5", 5000), Claim::NoSpace);
        // Too large for a, not for b.
        assert_eq!(put(&d, &req("a", 1), b"k6", 3000), Claim::Write(vec![b]));
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    #[test]
    fn first_writer_wins_and_claims_are_exclusive() {
        let d = dir();
        d.register(spec("a", 1000, &[]), &[]).unwrap();
        let req = PlaceRequest {
            client_node_id: "a",
            replication: 1,
            required_tags: &[],
        };
        let (c1, out1) = d.claim(&req, &[b"k"], &[1]);
        assert!(matches!(out1[0], Claim::Write(_)));
        let (_, out2) = d.claim(&req, &[b"k"], &[1]);
        assert_eq!(out2[0], Claim::Busy);
        assert!(d.commit(c1, b"k", &[0]).unwrap());
        let (_, out3) = d.claim(&req, &[b"k"], &[1]);
        assert_eq!(out3[0], Claim::Present);
        // A failed write releases the claim.
        let (c4, _) = d.claim(&req, &[b"j"], &[1]);
        assert!(!d.commit(c4, b"j", &[]).unwrap());
        assert!(d.locate(b"j").is_empty());
        let (_, out5) = d.claim(&req, &[b"j"], &[1]);
        assert!(matches!(out5[0], Claim::Write(_)));
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    #[test]
    fn replicas_are_distinct_and_dead_nodes_are_misses() {
        let d = dir();
        d.register(spec("a", 1000, &[]), &[]).unwrap();
        d.register(spec("b", 1000, &[]), &[]).unwrap();
        let req = PlaceRequest {
            client_node_id: "a",
            replication: 2,
            required_tags: &[],
        };
        assert_eq!(put(&d, &req, b"k", 1), Claim::Write(vec![0, 1]));
        assert_eq!(d.locate(b"k"), vec![0, 1]);
        std::thread::sleep(Duration::from_millis(250));
        assert!(d.heartbeat("b", 1000));
        assert_eq!(d.expire_nodes(Instant::now()), vec!["a".to_string()]);
        assert_eq!(d.locate(b"k"), vec![1]);
        assert!(!d.heartbeat("a", 1000), "a dead node must register again");
        assert_eq!(d.drop_keys(1, &[b"k"]), 1);
        assert!(d.locate(b"k").is_empty());
        assert!(d.is_empty());
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    #[test]
    fn reregistration_rebuilds_a_nodes_entries() {
        let d = dir();
        let a = d
            .register(spec("a", 1000, &[]), &[b"x".to_vec(), b"y".to_vec()])
            .unwrap();
        assert_eq!(d.locate(b"x"), vec![a]);
        let again = d.register(spec("a", 1000, &[]), &[b"y".to_vec()]).unwrap();
        assert_eq!(again, a, "a node keeps its index");
        assert!(d.locate(b"x").is_empty());
        assert_eq!(d.locate(b"y"), vec![a]);
        assert!(d.commit(99, b"z", &[7]).is_err(), "unknown node index");
        // Claim 0 adds a replica to a visible entry only.
        let b = d.register(spec("b", 1000, &[]), &[]).unwrap();
        assert!(d.commit(0, b"y", &[b]).unwrap());
        assert_eq!(d.locate(b"y"), vec![a, b]);
        assert!(!d.commit(0, b"never-put", &[b]).unwrap());
        assert!(d.locate(b"never-put").is_empty());
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    // Re-replication.

    const GIB: u64 = 1 << 30;

    /// Past the start-up grace of a directory made by `dir()` (lease 200 ms).
    fn after_grace() -> Instant {
        Instant::now() + Duration::from_secs(1)
    }

    fn req(client: &str, replication: usize) -> PlaceRequest<'_> {
        PlaceRequest {
            client_node_id: client,
            replication,
            required_tags: &[],
        }
    }

    /// Let the lease of every node but `keep` lapse, and drop them.
    fn drop_all_but(d: &Directory, keep: &[&str]) -> Vec<String> {
        std::thread::sleep(Duration::from_millis(250));
        for id in keep {
            let free = d
                .nodes()
                .iter()
                .find(|n| n.spec.node_id == *id)
                .map(|n| n.spec.free_bytes)
                .unwrap();
            assert!(d.heartbeat(id, free));
        }
        d.expire_nodes(Instant::now())
    }

    fn all_hashes(batches: &[RepairBatch]) -> Vec<KeyHash> {
        batches.iter().flat_map(|b| b.hashes.clone()).collect()
    }

    #[test]
    fn a_dropped_node_leaves_tasks_for_a_survivor_to_copy_elsewhere() {
        let d = dir();
        let a = d.register(spec("a", GIB, &[]), &[]).unwrap();
        let b = d.register(spec("b", GIB, &[]), &[]).unwrap();
        let c = d.register(spec("c", GIB, &[]), &[]).unwrap();
        let keys: Vec<Vec<u8>> = (0..6).map(|i| format!("k{i}").into_bytes()).collect();
        for k in &keys {
            assert!(matches!(put(&d, &req("a", 2), k, 1000), Claim::Write(n) if n[0] == a));
        }
        // Replication 1: lost with its only node, no task.
        assert_eq!(
            put(&d, &req("a", 1), b"single", 1000),
            Claim::Write(vec![a])
        );
        assert_eq!(d.under_replicated(), 0);
        assert_eq!(d.plan_repairs(after_grace()), 0, "nothing short of copies");

        assert_eq!(drop_all_but(&d, &["b", "c"]), vec!["a".to_string()]);
        assert_eq!(d.under_replicated(), keys.len());
        assert!(d.locate(b"single").is_empty());
        let now = after_grace();
        assert_eq!(d.plan_repairs(now), keys.len());
        assert_eq!(
            d.plan_repairs(now),
            0,
            "tasks in flight are not planned twice"
        );
        assert!(d.take_repair_tasks("a", 100, now).is_empty(), "a is dead");

        let mut handed = Vec::new();
        for (holder, other) in [("b", c), ("c", b)] {
            let batches = d.take_repair_tasks(holder, 100, now);
            for batch in &batches {
                assert_eq!(batch.target, other, "the target is the live non-holder");
                assert_eq!(
                    batch.target_address,
                    format!("{}:1", d.nodes()[usize::from(other)].spec.node_id)
                );
            }
            handed.extend(all_hashes(&batches).into_iter().map(|h| (h, other)));
        }
        assert_eq!(handed.len(), keys.len());
        assert!(d.take_repair_tasks("b", 100, now).is_empty(), "handed once");
        assert_eq!(d.repair_stats().issued, keys.len() as u64);
        assert_eq!(d.repair_stats().in_flight, keys.len() as u64);

        // The holders commit the copies (claim 0, stored = the target).
        for k in &keys {
            let (_, target) = handed.iter().find(|(h, _)| *h == key_hash(k)).unwrap();
            assert!(d.commit(0, k, &[*target]).unwrap());
            let mut holders = d.locate(k);
            holders.sort();
            assert_eq!(holders, vec![b, c]);
        }
        let stats = d.repair_stats();
        assert_eq!(
            (stats.done, stats.failed, stats.in_flight),
            (keys.len() as u64, 0, 0)
        );
        assert_eq!(d.under_replicated(), 0);
        assert_eq!(d.plan_repairs(now), 0);
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    #[test]
    fn no_task_without_a_target_or_a_holder() {
        let d = dir();
        d.register(spec("a", GIB, &[]), &[]).unwrap();
        d.register(spec("b", GIB, &[]), &[]).unwrap();
        d.register(spec("full", 0, &[]), &[]).unwrap();
        assert_eq!(put(&d, &req("a", 2), b"k", 1000), Claim::Write(vec![0, 1]));
        // Two nodes left and one holds it: the other has no room.
        drop_all_but(&d, &["b", "full"]);
        assert_eq!(d.under_replicated(), 1);
        let now = after_grace();
        assert_eq!(d.plan_repairs(now), 0);
        assert_eq!(d.repair_stats().no_target, 1);
        // A tagged holder: a target must carry its tags too.
        d.register(spec("untagged", GIB, &[]), &[]).unwrap();
        d.register(spec("t1", GIB, &["ssd"]), &[]).unwrap();
        let tags = vec!["ssd".to_string()];
        let tagged = PlaceRequest {
            client_node_id: "t1",
            replication: 2,
            required_tags: &tags,
        };
        assert_eq!(put(&d, &tagged, b"tagged", 1000), Claim::Write(vec![4]));
        // A node that joins is the target the entry lacked (the registration marks it).
        assert_eq!(d.plan_repairs(now), 1, "k: b -> untagged");
        let batches = d.take_repair_tasks("b", 100, now);
        assert_eq!(batches[0].target_node_id, "untagged");
        assert!(
            d.take_repair_tasks("t1", 100, now).is_empty(),
            "no ssd node to copy to"
        );
        assert_eq!(d.repair_stats().no_target, 1);
        // The last holder of k dies before the copy: the entry is gone, so is the task.
        let dropped = drop_all_but(&d, &["full", "untagged", "t1"]);
        assert_eq!(dropped, vec!["b".to_string()]);
        assert!(d.locate(b"k").is_empty());
        assert_eq!(d.repair_stats().in_flight, 0);
        assert_eq!(d.repair_stats().failed, 1, "handed out, holder dropped");
        assert_eq!(d.plan_repairs(now), 0);
        assert_eq!(
            d.under_replicated(),
            1,
            "only the tagged object, which has no target"
        );
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    /// Issue 29 (the chaos soak): when every candidate is full, a node whose capacity holds
    /// the object takes the copy (it evicts, as for puts), a bounded share of it per tick.
    #[test]
    fn full_nodes_take_repairs_within_a_share_of_their_capacity() {
        let d = dir();
        let full = |id: &str| NodeSpec {
            capacity_bytes: 4000,
            ..spec(id, 0, &[])
        };
        for id in ["a", "b", "c"] {
            d.register(full(id), &[]).unwrap();
        }
        assert!(matches!(put(&d, &req("a", 2), b"k1", 600), Claim::Write(_)));
        assert!(matches!(put(&d, &req("a", 2), b"k2", 600), Claim::Write(_)));
        // Both on the writer's node a and one other; that other one dies.
        let ids = ["a", "b", "c"];
        let holders = d.locate(b"k1");
        assert_eq!(holders, d.locate(b"k2"));
        assert!(holders.contains(&0), "{holders:?}");
        let other = holders.iter().copied().find(|&n| n != 0).unwrap();
        let keep: Vec<&str> = ids
            .iter()
            .enumerate()
            .filter(|&(i, _)| i as u16 != other)
            .map(|(_, id)| *id)
            .collect();
        drop_all_but(&d, &keep);
        assert_eq!(d.under_replicated(), 2);
        let now = after_grace();
        // The one full candidate left takes k1 (600 bytes within a quarter of its 4000);
        // k2 as well would pass the quarter (1200 > 1000): it waits for a later tick.
        assert_eq!(d.plan_repairs(now), 1, "{:?}", d.repair_stats());
        assert_eq!(d.repair_stats().no_target, 1);
        d.check_invariants().unwrap();
    }

    #[test]
    fn lapsed_tasks_and_dropped_targets_are_planned_again() {
        let d = dir();
        for id in ["a", "b", "c", "d"] {
            d.register(spec(id, GIB, &[]), &[]).unwrap();
        }
        assert!(matches!(put(&d, &req("a", 2), b"k", 1000), Claim::Write(_)));
        drop_all_but(&d, &["b", "c", "d"]);
        let holder = d.locate(b"k")[0];
        let holder_id = d.nodes()[usize::from(holder)].spec.node_id.clone();
        let now = after_grace();
        assert_eq!(d.plan_repairs(now), 1);
        let first = d.take_repair_tasks(&holder_id, 10, now);
        assert_eq!(all_hashes(&first), vec![key_hash(b"k")]);
        // Not committed within the timeout: failed, planned again.
        let later = now + REPAIR_TASK_TIMEOUT + Duration::from_millis(1);
        assert_eq!(d.plan_repairs(later), 1);
        assert_eq!(d.repair_stats().failed, 1);
        let second = d.take_repair_tasks(&holder_id, 10, later);
        assert_eq!(second.len(), 1);
        // The target dies: the task fails at once and goes to the one node left.
        let target = second[0].target_node_id.clone();
        let keep: Vec<&str> = ["b", "c", "d"]
            .into_iter()
            .filter(|id| *id != target)
            .collect();
        assert_eq!(drop_all_but(&d, &keep), vec![target.clone()]);
        assert_eq!(d.repair_stats().failed, 2);
        let later = later + Duration::from_millis(1);
        assert_eq!(d.plan_repairs(later), 1);
        let third = d.take_repair_tasks(&holder_id, 10, later);
        assert_ne!(third[0].target_node_id, target);
        assert_ne!(third[0].target, holder);
        // A commit by the stale target does not finish the live task (and adds nothing).
        assert!(d.commit(0, b"k", &[second[0].target]).unwrap());
        assert_eq!(d.repair_stats().in_flight, 1);
        assert!(d.commit(0, b"k", &[third[0].target]).unwrap());
        assert_eq!(d.repair_stats().done, 1);
        assert_eq!(d.locate(b"k").len(), 2);
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    #[test]
    fn the_work_is_bounded_per_source_and_per_heartbeat() {
        let d = dir();
        d.register(spec("a", 1 << 40, &[]), &[]).unwrap();
        d.register(spec("b", 1 << 40, &[]), &[]).unwrap();
        let n = MAX_REPAIR_TASKS_PER_SOURCE + 88;
        let keys: Vec<Vec<u8>> = (0..n).map(|i| format!("bulk{i}").into_bytes()).collect();
        for k in &keys {
            assert!(matches!(put(&d, &req("a", 2), k, 1000), Claim::Write(_)));
        }
        d.register(spec("c", 1 << 40, &[]), &[]).unwrap();
        drop_all_but(&d, &["b", "c"]);
        let now = after_grace();
        // b is the only source: at most its share in flight.
        assert_eq!(d.plan_repairs(now), MAX_REPAIR_TASKS_PER_SOURCE);
        for _ in 0..MAX_REPAIR_TASKS_PER_SOURCE / MAX_REPAIR_TASKS_PER_HEARTBEAT {
            let batch = all_hashes(&d.take_repair_tasks("b", MAX_REPAIR_TASKS_PER_HEARTBEAT, now));
            assert_eq!(batch.len(), MAX_REPAIR_TASKS_PER_HEARTBEAT);
            for hash in batch {
                let key = keys.iter().find(|k| key_hash(k) == hash).unwrap();
                assert!(d.commit(0, key, &[2]).unwrap());
            }
        }
        assert!(d
            .take_repair_tasks("b", MAX_REPAIR_TASKS_PER_HEARTBEAT, now)
            .is_empty());
        assert_eq!(
            d.plan_repairs(now),
            88,
            "the rest once the first ones are done"
        );
        assert_eq!(d.repair_stats().done, MAX_REPAIR_TASKS_PER_SOURCE as u64);
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    #[test]
    fn rebuilt_entries_take_the_key_namespace_factor_after_the_grace() {
        let policy = ReplicationPolicy {
            default: 1,
            namespaces: [("prod".to_string(), 2)].into_iter().collect(),
        };
        let key = |tag: &str| {
            let mut k = kvtier_proto::namespace::cluster_prefix(tag);
            k.extend_from_slice(b"page_k");
            k
        };
        assert_eq!(policy.for_key(&key("prod")), 2);
        assert_eq!(policy.for_key(&key("dev")), 1);
        assert_eq!(policy.for_key(&key("")), 1);
        assert_eq!(policy.for_key(b"page_k"), 1);
        // A local tenant's key (never registered by a node) names no cluster namespace.
        assert_eq!(policy.for_key(b"prod\x1fpage_k"), 1);
        let d =
            Directory::with_replication(Duration::from_millis(200), Duration::from_secs(5), policy);
        let keys = vec![
            [&key("prod")[..], b"1"].concat(),
            [&key("dev")[..], b"2"].concat(),
            b"k3".to_vec(),
        ];
        d.register(spec("a", GIB, &[]), &keys).unwrap();
        d.register(spec("b", GIB, &[]), &[]).unwrap();
        assert_eq!(d.under_replicated(), 1, "prod wants 2");
        // During the grace a rebuild in progress is not taken for lost copies.
        assert_eq!(d.plan_repairs(Instant::now()), 0);
        let now = after_grace();
        assert_eq!(d.plan_repairs(now), 1);
        let batches = d.take_repair_tasks("a", 10, now);
        assert_eq!(all_hashes(&batches), vec![key_hash(&keys[0])]);
        // A reset (new leader term) starts a new grace and forgets the tasks.
        d.reset();
        assert_eq!(d.repair_stats().in_flight, 0);
        assert_eq!(d.repair_stats().issued, 1, "counters outlive a term");
    }

    #[test]
    fn short_commits_are_repaired_and_evictions_are_not() {
        let d = dir();
        let a = d.register(spec("a", GIB, &[]), &[]).unwrap();
        d.register(spec("b", GIB, &[]), &[]).unwrap();
        d.register(spec("c", GIB, &[]), &[]).unwrap();
        // Placed on two nodes, but only the write to a succeeded.
        let (claim, out) = d.claim(&req("a", 2), &[b"short"], &[1000]);
        assert!(matches!(&out[0], Claim::Write(n) if n.len() == 2));
        assert!(d.commit(claim, b"short", &[a]).unwrap());
        // Two copies, then one was evicted: the node chose to drop it.
        assert!(matches!(
            put(&d, &req("a", 2), b"evicted", 1000),
            Claim::Write(_)
        ));
        assert_eq!(d.drop_keys(a, &[b"evicted"]), 1);
        assert_eq!(d.under_replicated(), 1);
        let now = after_grace();
        assert_eq!(d.plan_repairs(now), 1);
        assert_eq!(
            all_hashes(&d.take_repair_tasks("a", 10, now)),
            vec![key_hash(b"short")]
        );
        // A forgotten key's task is dropped.
        d.forget(&[b"short"]);
        let stats = d.repair_stats();
        assert_eq!((stats.in_flight, stats.dropped), (0, 1));
        assert!(
            !d.commit(0, b"short", &[1]).unwrap(),
            "nothing to add a copy to"
        );
        // Issue 16: the directory invariants hold after every scenario.
        d.check_invariants().unwrap();
    }

    /// Issue 29: a failed copy task reported by its holder is planned again by the next tick
    /// (not after REPAIR_TASK_TIMEOUT); after a push failure, elsewhere. Another node cannot
    /// fail a task that is not its own.
    #[test]
    fn a_reported_failure_is_planned_again_at_once_avoiding_a_refusing_target() {
        let d = dir();
        let a = d.register(spec("a", GIB, &[]), &[]).unwrap();
        let b = d.register(spec("b", GIB, &[]), &[]).unwrap();
        d.register(spec("c", 2 * GIB, &[]), &[]).unwrap();
        // Copies on a and b (c stays free: register it last with the most room).
        let (claim, out) = d.claim(&req("a", 2), &[b"k"], &[1000]);
        assert!(matches!(&out[0], Claim::Write(_)));
        assert!(d.commit(claim, b"k", &[a]).unwrap());
        let now = after_grace();
        assert_eq!(d.plan_repairs(now), 1);
        let batches = d.take_repair_tasks("a", 10, now);
        assert_eq!(all_hashes(&batches), vec![key_hash(b"k")]);
        let first = batches[0].target;
        assert_ne!(first, b, "the most free space: c");
        // Not b's task: nothing happens.
        let h = [key_hash(b"k")];
        assert_eq!(d.copy_failed("b", first, &h, CopyFailureKind::Push, now), 0);
        assert_eq!(d.repair_stats().in_flight, 1);
        // a's push to c failed: failed now, planned again at once, to b this time.
        assert_eq!(d.copy_failed("a", first, &h, CopyFailureKind::Push, now), 1);
        let stats = d.repair_stats();
        assert_eq!((stats.in_flight, stats.failed), (0, 1));
        assert_eq!(d.plan_repairs(now), 1, "planned again by the next tick");
        let again = d.take_repair_tasks("a", 10, now);
        assert_eq!(again[0].target, b, "the refusing target is avoided");
        // A failure for a task already gone counts nothing.
        assert_eq!(d.copy_failed("a", first, &h, CopyFailureKind::Push, now), 0);
        // After two leases c may be chosen again.
        assert_eq!(
            d.copy_failed("a", b, &h, CopyFailureKind::Commit, now),
            1,
            "a commit failure does not avoid the target"
        );
        let later = now + Duration::from_secs(1);
        assert_eq!(d.plan_repairs(later), 1);
        assert_eq!(d.take_repair_tasks("a", 10, later)[0].target, first);
        d.check_invariants().unwrap();
    }

    /// Issue 29 §4 (found by the simulation): a holder that reports a task as not held is no
    /// longer listed, so the next plan copies from a holder that has the object instead of
    /// handing the same source the same task forever.
    #[test]
    fn a_not_held_report_unlists_the_source() {
        let d = dir();
        let a = d.register(spec("a", GIB, &[]), &[]).unwrap();
        let b = d.register(spec("b", GIB, &[]), &[]).unwrap();
        d.register(spec("c", GIB, &[]), &[]).unwrap();
        let (claim, _) = d.claim(&req("a", 3), &[b"k"], &[1000]);
        assert!(d.commit(claim, b"k", &[a, b]).unwrap());
        let now = after_grace();
        assert_eq!(d.plan_repairs(now), 1);
        // The source is the holder with the fewest tasks: a (the lower index on a tie).
        let batches = d.take_repair_tasks("a", 10, now);
        assert_eq!(all_hashes(&batches), vec![key_hash(b"k")]);
        let h = [key_hash(b"k")];
        let target = batches[0].target;
        assert_eq!(
            d.copy_failed("a", target, &h, CopyFailureKind::NotHeld, now),
            1
        );
        assert_eq!(d.locate(b"k"), vec![b], "a said it does not hold k");
        assert_eq!(d.plan_repairs(now), 1, "still wants 3: copied from b");
        assert_eq!(all_hashes(&d.take_repair_tasks("b", 10, now)), h.to_vec());
        d.check_invariants().unwrap();
    }

    /// Issue 29 §4 (found by the simulation): a node that registers again between a write's
    /// placement and its commit (or between a copy task's handing and the copy's commit) may
    /// have lost the bytes with its disk; the commit does not list it.
    #[test]
    fn commits_do_not_list_a_node_that_registered_again_since() {
        let d = dir();
        let a = d.register(spec("a", GIB, &[]), &[]).unwrap();
        let b = d.register(spec("b", GIB, &[]), &[]).unwrap();
        let (claim, out) = d.claim(&req("a", 2), &[b"k"], &[1000]);
        assert_eq!(out[0], Claim::Write(vec![a, b]));
        std::thread::sleep(Duration::from_millis(2));
        // b restarts without its disk and registers again, empty.
        assert_eq!(d.register(spec("b", GIB, &[]), &[]).unwrap(), b);
        assert!(d.commit(claim, b"k", &[a, b]).unwrap());
        assert_eq!(
            d.locate(b"k"),
            vec![a],
            "b is not taken on the writer's word"
        );
        // Only b was written: the put is not visible.
        let (claim, _) = d.claim(&req("b", 1), &[b"j"], &[1000]);
        std::thread::sleep(Duration::from_millis(2));
        d.register(spec("b", GIB, &[]), &[]).unwrap();
        assert!(!d.commit(claim, b"j", &[b]).unwrap());
        assert!(d.locate(b"j").is_empty());
        // A copy task's target that registers again before the copy's commit.
        let c = d.register(spec("c", GIB, &[]), &[]).unwrap();
        let now = after_grace();
        assert_eq!(d.plan_repairs(now), 1, "k wants 2, has 1");
        let batches = d.take_repair_tasks("a", 10, d.now());
        let target = batches[0].target;
        assert!(target == b || target == c);
        std::thread::sleep(Duration::from_millis(2));
        let id = d.nodes()[usize::from(target)].spec.node_id.clone();
        d.register(spec(&id, GIB, &[]), &[]).unwrap();
        assert!(d.commit(0, b"k", &[target]).unwrap());
        assert_eq!(
            d.locate(b"k"),
            vec![a],
            "the re-registered target is not listed"
        );
        assert_eq!(d.repair_stats().done, 0);
        d.check_invariants().unwrap();
    }

    #[test]
    fn key_hashes_round_trip_their_wire_form() {
        let h = key_hash(b"some key");
        assert_eq!(KeyHash::from_bytes(&h.to_bytes()), Some(h));
        assert_eq!(KeyHash::from_bytes(&[0u8; 15]), None);
    }
}
