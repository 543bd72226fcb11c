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
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

/// Most copies of one object the directory tracks (declared once, in `kvtier-rpc`, for the
/// master and its callers).
pub const MAX_REPLICAS: usize = kvtier_rpc::MAX_REPLICAS;
/// Marks an unused replica slot.
const NO_NODE: u16 = u16::MAX;
/// Most nodes one master tracks (indexes are u16, one value reserved).
pub const MAX_NODES: usize = (u16::MAX - 1) as usize;
const SHARDS: usize = 64;
/// Every shard's bit in a dirty mask.
const ALL_SHARDS: u64 = u64::MAX;

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
/// Object size assumed for a target's room before any put was placed (then: the mean of the
/// sizes placed).
const DEFAULT_OBJECT_BYTES: u64 = 1 << 20;

/// The directory's name for a key: its 128-bit hash as two words (8-byte aligned, so a map
/// slot is 24 bytes; a `u128` would be 16-byte aligned and pad the slot to 32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyHash([u64; 2]);

impl std::hash::Hash for KeyHash {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Already uniform: the map takes the low word as it is.
        state.write_u64(self.0[0]);
    }
}

impl KeyHash {
    /// The wire form: the low word then the high word, little endian (16 bytes).
    pub fn to_bytes(self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.0[0].to_le_bytes());
        out[8..].copy_from_slice(&self.0[1].to_le_bytes());
        out
    }

    /// Parse [`to_bytes`](Self::to_bytes)' form; `None` unless exactly 16 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Option<KeyHash> {
        let bytes: &[u8; 16] = bytes.try_into().ok()?;
        let lo = u64::from_le_bytes(bytes[..8].try_into().ok()?);
        let hi = u64::from_le_bytes(bytes[8..].try_into().ok()?);
        Some(KeyHash([lo, hi]))
    }
}

/// Hash a whole object key.
pub fn key_hash(key: &[u8]) -> KeyHash {
    let h = xxhash_rust::xxh3::xxh3_128(key);
    KeyHash([h as u64, (h >> 64) as u64])
}

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

/// The node indexes holding one object (unused slots are [`NO_NODE`]) and how many copies its
/// namespace wants. 7 bytes, so a map slot stays 24 (the byte of `want` sits where the slot
/// had padding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Replicas {
    slots: [u16; MAX_REPLICAS],
    want: u8,
}

const _: () = assert!(std::mem::size_of::<(KeyHash, Replicas)>() == 24);

impl Replicas {
    fn empty(want: usize) -> Replicas {
        Replicas {
            slots: [NO_NODE; MAX_REPLICAS],
            want: want.clamp(1, MAX_REPLICAS) as u8,
        }
    }
    fn from_nodes(nodes: &[u16]) -> Replicas {
        let mut r = Replicas::empty(nodes.len());
        for (slot, node) in r.slots.iter_mut().zip(nodes) {
            *slot = *node;
        }
        r
    }
    fn nodes(&self) -> impl Iterator<Item = u16> + '_ {
        self.slots.iter().copied().filter(|&n| n != NO_NODE)
    }
    fn holds(&self, node: u16) -> bool {
        node != NO_NODE && self.slots.contains(&node)
    }
    fn live_count(&self, live: &[bool]) -> usize {
        self.nodes()
            .filter(|&n| live.get(usize::from(n)).copied().unwrap_or(false))
            .count()
    }
    fn want(&self) -> usize {
        usize::from(self.want)
    }
    /// Wants more live copies than it has, and has one to copy from.
    fn under_replicated(&self, live: &[bool]) -> bool {
        let have = self.live_count(live);
        have > 0 && have < self.want()
    }
    fn add(&mut self, node: u16) {
        if self.slots.contains(&node) {
            return;
        }
        if let Some(slot) = self.slots.iter_mut().find(|s| **s == NO_NODE) {
            *slot = node;
        }
    }
    /// Remove `node`; returns whether the entry is now empty.
    fn remove(&mut self, node: u16) -> bool {
        for slot in self.slots.iter_mut() {
            if *slot == node {
                *slot = NO_NODE;
            }
        }
        self.slots.iter().all(|&s| s == NO_NODE)
    }
}

/// Replication factor per namespace, as `kvtier master --replication NS=N` sets it: the
/// factor of a put comes from its request's namespace, that of an entry a registration
/// rebuilds from its key (`NS 0x1f rest`, the clients' namespacing; no 0x1f: namespace "").
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

/// Separates the namespace from the rest of a key.
const NAMESPACE_SEPARATOR: u8 = 0x1f;

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
        let namespace = match key.iter().position(|&b| b == NAMESPACE_SEPARATOR) {
            Some(at) => std::str::from_utf8(&key[..at]).unwrap_or(""),
            None => "",
        };
        self.for_namespace(namespace)
    }
}

/// What a node told the master about itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeSpec {
    pub node_id: String,
    pub data_address: String,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub tags: Vec<String>,
}

/// A node as the registry holds it.
#[derive(Clone, Debug)]
pub struct NodeState {
    pub index: u16,
    pub spec: NodeSpec,
    pub alive: bool,
    last_heartbeat: Instant,
    /// Bytes placed on the node since its last report of free space.
    placed_since_report: u64,
}

impl NodeState {
    /// Free space as the master estimates it: the last report less what was placed since.
    pub fn estimated_free(&self) -> u64 {
        self.spec
            .free_bytes
            .saturating_sub(self.placed_since_report)
    }
}

/// The outcome of claiming one key for a put.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// Write the bytes to these nodes, then commit.
    Write(Vec<u16>),
    /// Already visible: the first writer won.
    Present,
    /// Another writer holds an unexpired claim.
    Busy,
    /// No live node (with the tags asked for) can take it.
    NoSpace,
}

/// Why a request about a node was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DirectoryError {
    #[error("node index {0} is not registered")]
    UnknownNode(u16),
    #[error("node id must be 1 to 256 bytes")]
    BadNodeId,
    #[error("the registry is full ({MAX_NODES} nodes)")]
    TooManyNodes,
}

/// Placement inputs of one put batch.
#[derive(Clone, Debug, Default)]
pub struct PlaceRequest<'a> {
    pub client_node_id: &'a str,
    pub replication: usize,
    pub required_tags: &'a [String],
}

struct PendingClaim {
    claim: u64,
    deadline: Instant,
    /// The replication factor of the put's namespace.
    want: u8,
}

/// One copy task: `source` copies an object it holds to `target`.
#[derive(Clone, Copy, Debug)]
struct RepairTask {
    id: u64,
    source: u16,
    target: u16,
    /// Handed to the source in a heartbeat reply (else still queued for it).
    handed: bool,
    /// The task fails then (queued: it was never handed out; handed: not done in time).
    deadline: Instant,
}

/// The re-replication planner's state (one mutex; taken before `nodes` and the shards, never
/// while a shard lock is held).
struct RepairState {
    /// Shards to scan for under-replicated entries, one bit each.
    dirty: u64,
    /// The shard the next tick starts at.
    cursor: usize,
    tasks: HashMap<KeyHash, RepairTask>,
    /// Per source, tasks not handed out yet (stale ids are skipped when handing out).
    queued: HashMap<u16, VecDeque<(KeyHash, u64)>>,
    per_source: HashMap<u16, usize>,
    next_id: u64,
    /// No planning before this (the start-up grace).
    not_before: Instant,
    grace_over: bool,
    /// Entries the last tick found under-replicated with no target.
    no_target: usize,
    /// Since when some entry had no target (rescanned after [`REPAIR_RETRY_STUCK`], or when a
    /// node registers).
    stuck_since: Option<Instant>,
}

/// How often entries that found no target are looked at again (a node may have room now).
const REPAIR_RETRY_STUCK: Duration = Duration::from_secs(10);

impl RepairState {
    fn new(not_before: Instant) -> RepairState {
        RepairState {
            dirty: 0,
            cursor: 0,
            tasks: HashMap::new(),
            queued: HashMap::new(),
            per_source: HashMap::new(),
            next_id: 1,
            not_before,
            grace_over: false,
            no_target: 0,
            stuck_since: None,
        }
    }

    fn source_load(&self, node: u16) -> usize {
        self.per_source.get(&node).copied().unwrap_or(0)
    }

    fn add(&mut self, hash: KeyHash, source: u16, target: u16, deadline: Instant) {
        let id = self.next_id;
        self.next_id += 1;
        self.tasks.insert(
            hash,
            RepairTask {
                id,
                source,
                target,
                handed: false,
                deadline,
            },
        );
        *self.per_source.entry(source).or_insert(0) += 1;
        self.queued.entry(source).or_default().push_back((hash, id));
    }

    fn remove(&mut self, hash: KeyHash) -> Option<RepairTask> {
        let task = self.tasks.remove(&hash)?;
        if let Some(n) = self.per_source.get_mut(&task.source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_source.remove(&task.source);
            }
        }
        Some(task)
    }
}

/// Totals of the re-replication work since this master started (kept across leader terms).
#[derive(Debug, Default)]
struct RepairCounters {
    issued: AtomicU64,
    done: AtomicU64,
    failed: AtomicU64,
    dropped: AtomicU64,
}

/// Re-replication figures, as `Cluster` replies and the metrics report them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RepairStats {
    /// Copy tasks handed to holders in heartbeat replies.
    pub issued: u64,
    /// Tasks whose target was committed as a replica.
    pub done: u64,
    /// Handed-out tasks that timed out or whose holder or target was dropped (planned again
    /// while the object has a live holder).
    pub failed: u64,
    /// Handed-out tasks given up because no live holder of the object was left, or the key
    /// was forgotten.
    pub dropped: u64,
    /// Tasks planned or handed out and not finished.
    pub in_flight: u64,
    /// Under-replicated entries the last planning tick found no target for.
    pub no_target: u64,
}

/// The copy tasks of one heartbeat reply that go to one target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepairBatch {
    pub target: u16,
    pub target_node_id: String,
    pub target_address: String,
    pub hashes: Vec<KeyHash>,
}

/// Counts a registration in progress (the planner waits: entries are rebuilt meanwhile).
struct Registering<'a>(&'a AtomicUsize);

impl<'a> Registering<'a> {
    fn start(count: &'a AtomicUsize) -> Registering<'a> {
        count.fetch_add(1, Ordering::SeqCst);
        Registering(count)
    }
}

impl Drop for Registering<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
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
}

fn shard_index(hash: KeyHash) -> usize {
    // The high bits pick the shard; the map uses the low bits.
    (hash.0[1] >> 58) as usize % SHARDS
}

fn shard_bit(hash: KeyHash) -> u64 {
    1u64 << shard_index(hash)
}

impl Directory {
    pub fn new(lease: Duration, claim_timeout: Duration) -> Directory {
        Directory {
            shards: (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect(),
            nodes: RwLock::new(Vec::new()),
            pending: Mutex::new(HashMap::new()),
            next_claim: Mutex::new(first_claim()),
            lease,
            claim_timeout,
            policy: RwLock::new(ReplicationPolicy::default()),
            repair: Mutex::new(RepairState::new(
                Instant::now() + lease * REPAIR_GRACE_LEASES,
            )),
            counters: RepairCounters::default(),
            registering: AtomicUsize::new(0),
            mean_object_bytes: AtomicU64::new(0),
        }
    }

    /// A directory whose registrations rebuild entries with `policy`'s factors.
    pub fn with_replication(
        lease: Duration,
        claim_timeout: Duration,
        policy: ReplicationPolicy,
    ) -> Directory {
        let d = Directory::new(lease, claim_timeout);
        *d.policy.write() = policy;
        d
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

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Register (or re-register) a node; its entries are rebuilt from `keys`, what it holds.
    pub fn register(&self, spec: NodeSpec, keys: &[Vec<u8>]) -> Result<u16, DirectoryError> {
        if spec.node_id.is_empty() || spec.node_id.len() > 256 {
            return Err(DirectoryError::BadNodeId);
        }
        let _registering = Registering::start(&self.registering);
        let index = {
            let mut nodes = self.nodes.write();
            let now = Instant::now();
            match nodes.iter_mut().find(|n| n.spec.node_id == spec.node_id) {
                Some(node) => {
                    node.spec = spec;
                    node.alive = true;
                    node.last_heartbeat = now;
                    node.placed_since_report = 0;
                    node.index
                }
                None => {
                    if nodes.len() >= MAX_NODES {
                        return Err(DirectoryError::TooManyNodes);
                    }
                    let index = nodes.len() as u16;
                    nodes.push(NodeState {
                        index,
                        spec,
                        alive: true,
                        last_heartbeat: now,
                        placed_since_report: 0,
                    });
                    index
                }
            }
        };
        // Entries this node no longer reports may now be short of copies.
        let dirty = self.drop_node_entries(index);
        self.add_held_keys(index, keys, dirty);
        Ok(index)
    }

    /// More keys registered node `index` holds (the rest of a registration too large for one
    /// message).
    pub fn add_keys(&self, index: u16, keys: &[Vec<u8>]) -> Result<(), DirectoryError> {
        if !self
            .nodes
            .read()
            .iter()
            .any(|n| n.index == index && n.alive)
        {
            return Err(DirectoryError::UnknownNode(index));
        }
        let _registering = Registering::start(&self.registering);
        self.add_held_keys(index, keys, 0);
        Ok(())
    }

    /// Add `index` to the entries of `keys`; mark short entries (and the shards in `dirty`)
    /// for re-replication.
    fn add_held_keys(&self, index: u16, keys: &[Vec<u8>], mut dirty: u64) {
        let policy = self.policy.read().clone();
        for key in keys {
            let hash = key_hash(key);
            let want = policy.for_key(key);
            let mut shard = self.shard(hash).write();
            let entry = shard.entry(hash).or_insert(Replicas::empty(want));
            entry.add(index);
            if entry.nodes().count() < entry.want() {
                dirty |= shard_bit(hash);
            }
        }
        let mut repair = self.repair.lock();
        repair.dirty |= dirty;
        // A node (back) in the registry may be the target entries had none for.
        if repair.stuck_since.take().is_some() {
            repair.dirty = ALL_SHARDS;
        }
    }

    /// Renew a node's lease; `false` when the node is unknown (it must register again).
    pub fn heartbeat(&self, node_id: &str, free_bytes: u64) -> bool {
        let mut nodes = self.nodes.write();
        match nodes
            .iter_mut()
            .find(|n| n.spec.node_id == node_id && n.alive)
        {
            Some(node) => {
                node.last_heartbeat = Instant::now();
                node.spec.free_bytes = free_bytes;
                node.placed_since_report = 0;
                true
            }
            None => false,
        }
    }

    /// Mark nodes whose lease lapsed as dead and remove them from every entry. Returns the
    /// node ids that were dropped. Entries left with fewer copies than wanted are marked for
    /// re-replication, and copy tasks from or to a dropped node fail (they are planned again).
    pub fn expire_nodes(&self, now: Instant) -> Vec<String> {
        self.drop_nodes(|n| now.duration_since(n.last_heartbeat) > self.lease)
    }

    /// The live node `node_id` leaves (it is shutting down): it is dropped at once, exactly as
    /// if its lease had lapsed, so its objects are misses (or come from a replica) without
    /// waiting out the lease. Whether such a node was registered.
    pub fn leave(&self, node_id: &str) -> bool {
        !self.drop_nodes(|n| n.spec.node_id == node_id).is_empty()
    }

    /// Drop the live nodes `pick` selects: mark them dead, remove them from every entry, mark
    /// entries left short for re-replication and fail their copy tasks. Their ids.
    fn drop_nodes(&self, pick: impl Fn(&NodeState) -> bool) -> Vec<String> {
        let expired: Vec<(u16, String)> = {
            let mut nodes = self.nodes.write();
            nodes
                .iter_mut()
                .filter(|n| n.alive && pick(n))
                .map(|n| {
                    n.alive = false;
                    (n.index, n.spec.node_id.clone())
                })
                .collect()
        };
        let mut dirty = 0;
        for (index, _) in &expired {
            dirty |= self.drop_node_entries(*index);
        }
        if !expired.is_empty() {
            let mut repair = self.repair.lock();
            repair.dirty |= dirty;
            for (index, _) in &expired {
                self.cancel_node_tasks(&mut repair, *index);
            }
        }
        expired.into_iter().map(|(_, id)| id).collect()
    }

    /// Fail every task from or to `node` (it was dropped); their entries are scanned again.
    fn cancel_node_tasks(&self, repair: &mut RepairState, node: u16) {
        let hit: Vec<KeyHash> = repair
            .tasks
            .iter()
            .filter(|(_, t)| t.source == node || t.target == node)
            .map(|(h, _)| *h)
            .collect();
        for hash in hit {
            if let Some(task) = repair.remove(hash) {
                if task.handed {
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                }
                repair.dirty |= shard_bit(hash);
            }
        }
        repair.queued.remove(&node);
    }

    /// Remove `index` from every entry; returns the shards where an entry lost it and still
    /// has copies (candidates for re-replication).
    fn drop_node_entries(&self, index: u16) -> u64 {
        let mut dirty = 0u64;
        for (s, shard) in self.shards.iter().enumerate() {
            let mut lost = false;
            shard.write().retain(|_, replicas| {
                if !replicas.holds(index) {
                    return true;
                }
                let empty = replicas.remove(index);
                lost |= !empty;
                !empty
            });
            if lost {
                dirty |= 1u64 << s;
            }
        }
        dirty
    }

    /// A snapshot of every node.
    pub fn nodes(&self) -> Vec<NodeState> {
        self.nodes.read().clone()
    }

    fn live_mask(&self) -> Vec<bool> {
        self.nodes.read().iter().map(|n| n.alive).collect()
    }

    /// Live nodes holding `key`.
    pub fn locate(&self, key: &[u8]) -> Vec<u16> {
        let live = self.live_mask();
        self.locate_with(&live, key_hash(key))
    }

    fn locate_with(&self, live: &[bool], hash: KeyHash) -> Vec<u16> {
        match self.shard(hash).read().get(&hash) {
            Some(replicas) => replicas
                .nodes()
                .filter(|&n| live.get(usize::from(n)).copied().unwrap_or(false))
                .collect(),
            None => Vec::new(),
        }
    }

    /// Live nodes of each key, in order.
    pub fn locate_many<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<Vec<u16>> {
        let live = self.live_mask();
        keys.iter()
            .map(|k| self.locate_with(&live, key_hash(k.as_ref())))
            .collect()
    }

    /// An existence check over the live directory, for [`kvtier_proto::query::evaluate`].
    pub fn exists_fn(&self) -> impl FnMut(&[u8]) -> bool + '_ {
        let live = self.live_mask();
        move |key| !self.locate_with(&live, key_hash(key)).is_empty()
    }

    /// Claim every key for one put batch and choose nodes for the new ones. Returns the claim
    /// id (commit with it) and one [`Claim`] per key.
    pub fn claim(
        &self,
        request: &PlaceRequest<'_>,
        keys: &[&[u8]],
        sizes: &[u64],
    ) -> (u64, Vec<Claim>) {
        let now = Instant::now();
        let claim = {
            let mut next = self.next_claim.lock();
            let claim = *next;
            *next += 1;
            claim
        };
        let replication = request.replication.clamp(1, MAX_REPLICAS);
        self.learn_object_size(sizes);
        let mut nodes = self.nodes.write();
        let live: Vec<bool> = nodes.iter().map(|n| n.alive).collect();
        let mut pending = self.pending.lock();
        let mut out = Vec::with_capacity(keys.len());
        for (key, &size) in keys.iter().zip(sizes) {
            let hash = key_hash(key);
            if !self.locate_with(&live, hash).is_empty() {
                out.push(Claim::Present);
                continue;
            }
            if let Some(p) = pending.get(&hash) {
                if p.deadline > now {
                    out.push(Claim::Busy);
                    continue;
                }
            }
            let chosen = place(&nodes, request, replication, size);
            if chosen.is_empty() {
                out.push(Claim::NoSpace);
                continue;
            }
            for &n in &chosen {
                let node = &mut nodes[usize::from(n)];
                node.placed_since_report = node.placed_since_report.saturating_add(size);
            }
            pending.insert(
                hash,
                PendingClaim {
                    claim,
                    deadline: now + self.claim_timeout,
                    want: replication as u8,
                },
            );
            out.push(Claim::Write(chosen));
        }
        // Lapsed claims of writers that never came back.
        if pending.len() > 4096 {
            pending.retain(|_, p| p.deadline > now);
        }
        (claim, out)
    }

    /// Fold a put batch's sizes into the mean object size (an exponential average).
    fn learn_object_size(&self, sizes: &[u64]) {
        if sizes.is_empty() {
            return;
        }
        let batch = sizes.iter().sum::<u64>() / sizes.len() as u64;
        let old = self.mean_object_bytes.load(Ordering::Relaxed);
        let new = if old == 0 {
            batch
        } else {
            (old.saturating_mul(7) / 8).saturating_add(batch / 8)
        };
        self.mean_object_bytes.store(new.max(1), Ordering::Relaxed);
    }

    fn mean_object_bytes(&self) -> u64 {
        match self.mean_object_bytes.load(Ordering::Relaxed) {
            0 => DEFAULT_OBJECT_BYTES,
            n => n,
        }
    }

    /// Commit a claimed key as held by `stored` (empty: the write failed, release the claim).
    /// Claim 0 (never handed out) adds `stored` as replicas of an already visible key (a
    /// client caching a remote fetch, or a holder finishing a copy task). Returns whether the
    /// key is visible now. A key whose claim lapsed and was taken by another writer is not
    /// committed by this one.
    pub fn commit(&self, claim: u64, key: &[u8], stored: &[u16]) -> Result<bool, DirectoryError> {
        let hash = key_hash(key);
        let live = self.live_mask();
        for &n in stored {
            if usize::from(n) >= live.len() {
                return Err(DirectoryError::UnknownNode(n));
            }
        }
        if claim == 0 {
            // An extra replica of a visible object.
            let short = {
                let mut shard = self.shard(hash).write();
                let Some(entry) = shard.get_mut(&hash) else {
                    return Ok(false);
                };
                for &n in stored.iter().filter(|&&n| live[usize::from(n)]) {
                    entry.add(n);
                }
                entry.under_replicated(&live)
            };
            let mut repair = self.repair.lock();
            let finished = repair
                .tasks
                .get(&hash)
                .is_some_and(|t| stored.contains(&t.target) && live[usize::from(t.target)]);
            if finished {
                repair.remove(hash);
                self.counters.done.fetch_add(1, Ordering::Relaxed);
                if short {
                    // Wanted 3, had 1: the next copy.
                    repair.dirty |= shard_bit(hash);
                }
            }
            return Ok(true);
        }
        let short = {
            let mut pending = self.pending.lock();
            let want = match pending.get(&hash) {
                Some(p) if p.claim == claim => p.want,
                _ => return Ok(!self.locate_with(&live, hash).is_empty()),
            };
            pending.remove(&hash);
            let stored: Vec<u16> = stored
                .iter()
                .copied()
                .filter(|&n| live[usize::from(n)])
                .collect();
            if stored.is_empty() {
                return Ok(false);
            }
            let mut shard = self.shard(hash).write();
            let entry = shard
                .entry(hash)
                .or_insert(Replicas::empty(usize::from(want)));
            entry.want = entry.want.max(want);
            for n in stored {
                entry.add(n);
            }
            entry.live_count(&live) < entry.want()
        };
        if short {
            // Placed on fewer nodes than wanted (few had room, or a write failed).
            self.repair.lock().dirty |= shard_bit(hash);
        }
        Ok(true)
    }

    /// `node` no longer holds `keys` (eviction, removal, or a read found them missing). The
    /// entry's wanted factor drops to the copies left: an eviction is not re-replicated.
    pub fn drop_keys<K: AsRef<[u8]>>(&self, node: u16, keys: &[K]) -> u64 {
        let mut removed = 0;
        for key in keys {
            let hash = key_hash(key.as_ref());
            let mut shard = self.shard(hash).write();
            if let Some(replicas) = shard.get_mut(&hash) {
                let before = replicas.nodes().count();
                let empty = replicas.remove(node);
                let after = replicas.nodes().count();
                if after < before {
                    removed += 1;
                    replicas.want = replicas.want.min(after.max(1) as u8);
                }
                if empty {
                    shard.remove(&hash);
                }
            }
        }
        removed
    }

    /// Remove keys from the directory; returns the nodes that held each. Copy tasks of those
    /// keys are dropped.
    pub fn forget<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<Vec<u16>> {
        let hashes: Vec<KeyHash> = keys.iter().map(|k| key_hash(k.as_ref())).collect();
        let held = hashes
            .iter()
            .map(|&hash| {
                self.shard(hash)
                    .write()
                    .remove(&hash)
                    .map(|r| r.nodes().collect())
                    .unwrap_or_default()
            })
            .collect();
        let mut repair = self.repair.lock();
        if !repair.tasks.is_empty() {
            for hash in hashes {
                if let Some(task) = repair.remove(hash) {
                    if task.handed {
                        self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        held
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
        *self.next_claim.lock() = first_claim();
        *repair = RepairState::new(Instant::now() + self.lease * REPAIR_GRACE_LEASES);
    }

    /// Insert an entry directly (benchmarks and rebuilds); it wants as many copies as listed.
    pub fn insert_hash(&self, hash: KeyHash, nodes: &[u16]) {
        self.shard(hash)
            .write()
            .insert(hash, Replicas::from_nodes(nodes));
    }

    /// Plan copy tasks for under-replicated entries of dirty shards (the lease sweeper calls
    /// this every tick); returns how many were planned. Tasks that lapsed fail first. See the
    /// module docs for the rules and bounds.
    pub fn plan_repairs(&self, now: Instant) -> usize {
        if self.registering.load(Ordering::SeqCst) > 0 {
            return 0; // entries are being rebuilt; the next tick sees them whole
        }
        let mut repair = self.repair.lock();
        if now < repair.not_before {
            return 0;
        }
        if !repair.grace_over {
            // Entries whose other holders never registered again are short now.
            repair.grace_over = true;
            repair.dirty = ALL_SHARDS;
        }
        if repair
            .stuck_since
            .is_some_and(|t| now.duration_since(t) >= REPAIR_RETRY_STUCK)
        {
            repair.stuck_since = None;
            repair.dirty = ALL_SHARDS;
        }
        let nodes = self.nodes();
        let live: Vec<bool> = nodes.iter().map(|n| n.alive).collect();
        let lapsed: Vec<KeyHash> = repair
            .tasks
            .iter()
            .filter(|(_, t)| t.deadline <= now)
            .map(|(h, _)| *h)
            .collect();
        for hash in lapsed {
            let Some(task) = repair.remove(hash) else {
                continue;
            };
            let has_holder = self
                .shard(hash)
                .read()
                .get(&hash)
                .is_some_and(|e| e.live_count(&live) > 0);
            if has_holder {
                if task.handed {
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                }
                repair.dirty |= shard_bit(hash);
            } else if task.handed {
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        if repair.dirty == 0 || repair.tasks.len() >= MAX_REPAIR_TASKS {
            return 0;
        }
        if live.iter().filter(|&&alive| alive).count() < 2 {
            // Nowhere to copy to; a node that registers marks everything again.
            repair.dirty = 0;
            repair.stuck_since.get_or_insert(now);
            return 0;
        }
        let size = self.mean_object_bytes();
        let mut planned_bytes = vec![0u64; nodes.len()];
        let (mut planned, mut scanned, mut no_target) = (0usize, 0usize, 0usize);
        let (mut visited, mut deferred) = (0, 0usize);
        while repair.dirty != 0
            && visited < SHARDS
            && scanned < MAX_REPAIR_SCAN_PER_TICK
            && deferred < MAX_REPAIR_DEFERRED_PER_TICK
            && repair.tasks.len() < MAX_REPAIR_TASKS
        {
            let s = repair.cursor;
            repair.cursor = (s + 1) % SHARDS;
            visited += 1;
            if repair.dirty & (1u64 << s) == 0 {
                continue;
            }
            let mut complete = true;
            {
                let shard = self.shards[s].read();
                for (&hash, entry) in shard.iter() {
                    scanned += 1;
                    if !entry.under_replicated(&live) || repair.tasks.contains_key(&hash) {
                        continue;
                    }
                    if repair.tasks.len() >= MAX_REPAIR_TASKS {
                        complete = false;
                        break;
                    }
                    let source = entry
                        .nodes()
                        .filter(|&n| live.get(usize::from(n)).copied().unwrap_or(false))
                        .filter(|&n| repair.source_load(n) < MAX_REPAIR_TASKS_PER_SOURCE)
                        .min_by_key(|&n| repair.source_load(n));
                    let Some(source) = source else {
                        // Its holders are busy: a later tick.
                        complete = false;
                        deferred += 1;
                        if deferred >= MAX_REPAIR_DEFERRED_PER_TICK {
                            break;
                        }
                        continue;
                    };
                    match repair_target(&nodes, entry, &live, size, &planned_bytes) {
                        Some(target) => {
                            planned_bytes[usize::from(target)] += size;
                            repair.add(hash, source, target, now + REPAIR_TASK_TIMEOUT);
                            planned += 1;
                        }
                        None => no_target += 1,
                    }
                }
            }
            if complete {
                repair.dirty &= !(1u64 << s);
            }
        }
        if no_target > 0 {
            repair.stuck_since.get_or_insert(now);
        }
        repair.no_target = no_target;
        drop(repair);
        if planned > 0 {
            // The targets' room is spoken for until they report free space again.
            let mut table = self.nodes.write();
            for (i, bytes) in planned_bytes.into_iter().enumerate() {
                if let Some(node) = table.get_mut(i) {
                    node.placed_since_report = node.placed_since_report.saturating_add(bytes);
                }
            }
        }
        planned
    }

    /// Hand the live node `node_id` up to `max` of its queued copy tasks, grouped by target;
    /// each must be done within [`REPAIR_TASK_TIMEOUT`] from `now`.
    pub fn take_repair_tasks(&self, node_id: &str, max: usize, now: Instant) -> Vec<RepairBatch> {
        let mut repair = self.repair.lock();
        if repair.queued.is_empty() {
            return Vec::new();
        }
        let nodes = self.nodes.read();
        let Some(source) = nodes
            .iter()
            .find(|n| n.alive && n.spec.node_id == node_id)
            .map(|n| n.index)
        else {
            return Vec::new();
        };
        let RepairState { queued, tasks, .. } = &mut *repair;
        let Some(queue) = queued.get_mut(&source) else {
            return Vec::new();
        };
        let mut out: Vec<RepairBatch> = Vec::new();
        let mut handed = 0usize;
        while handed < max {
            let Some((hash, id)) = queue.pop_front() else {
                break;
            };
            let Some(task) = tasks.get_mut(&hash) else {
                continue;
            };
            if task.id != id || task.handed || task.source != source {
                continue;
            }
            let Some(target) = nodes.get(usize::from(task.target)).filter(|n| n.alive) else {
                continue; // dropped meanwhile; the task lapses
            };
            task.handed = true;
            task.deadline = now + REPAIR_TASK_TIMEOUT;
            handed += 1;
            match out.iter_mut().find(|b| b.target == task.target) {
                Some(batch) => batch.hashes.push(hash),
                None => out.push(RepairBatch {
                    target: task.target,
                    target_node_id: target.spec.node_id.clone(),
                    target_address: target.spec.data_address.clone(),
                    hashes: vec![hash],
                }),
            }
        }
        if queue.is_empty() {
            queued.remove(&source);
        }
        self.counters
            .issued
            .fetch_add(handed as u64, Ordering::Relaxed);
        out
    }

    /// The re-replication totals and what is in flight now.
    pub fn repair_stats(&self) -> RepairStats {
        let (in_flight, no_target) = {
            let repair = self.repair.lock();
            (repair.tasks.len() as u64, repair.no_target as u64)
        };
        RepairStats {
            issued: self.counters.issued.load(Ordering::Relaxed),
            done: self.counters.done.load(Ordering::Relaxed),
            failed: self.counters.failed.load(Ordering::Relaxed),
            dropped: self.counters.dropped.load(Ordering::Relaxed),
            in_flight,
            no_target,
        }
    }

    /// Entries with fewer live copies than wanted (and at least one): a full scan, for tests
    /// and operators, not a data path.
    pub fn under_replicated(&self) -> usize {
        let live = self.live_mask();
        self.shards
            .iter()
            .map(|s| {
                s.read()
                    .values()
                    .filter(|e| e.under_replicated(&live))
                    .count()
            })
            .sum()
    }
}

/// The target of one copy: live, not a holder, room for `size` more bytes than planned this
/// tick, and every tag the live holders share; the most estimated free space wins.
fn repair_target(
    nodes: &[NodeState],
    entry: &Replicas,
    live: &[bool],
    size: u64,
    planned: &[u64],
) -> Option<u16> {
    let holders: Vec<&NodeState> = entry
        .nodes()
        .filter(|&n| live.get(usize::from(n)).copied().unwrap_or(false))
        .filter_map(|n| nodes.get(usize::from(n)))
        .collect();
    let first = holders.first()?;
    let shared: Vec<&String> = first
        .spec
        .tags
        .iter()
        .filter(|t| holders.iter().all(|h| h.spec.tags.contains(t)))
        .collect();
    nodes
        .iter()
        .filter(|n| n.alive && !entry.holds(n.index))
        .filter(|n| {
            n.estimated_free()
                .saturating_sub(planned.get(usize::from(n.index)).copied().unwrap_or(0))
                >= size
        })
        .filter(|n| shared.iter().all(|t| n.spec.tags.contains(t)))
        .max_by_key(|n| {
            (
                n.estimated_free()
                    .saturating_sub(planned.get(usize::from(n.index)).copied().unwrap_or(0)),
                std::cmp::Reverse(n.index),
            )
        })
        .map(|n| n.index)
}

/// The first claim id of a directory's life: the wall clock in ns, so the claims of a later
/// leader (or a restarted master) never repeat one a client still holds from an earlier one,
/// whose commit then cannot match a new claim (its node indexes may mean other nodes now).
fn first_claim() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX / 2))
        .max(1)
}

/// Choose `replication` distinct live nodes for an object of `size` bytes: the writer's own
/// node first when it is live, matches the tags and has free room; then the others with the
/// most estimated free space. When fewer than asked have free room, nodes whose capacity holds
/// the object fill up the rest, the writer's node first, then the largest: every node is a
/// cache that evicts its coldest objects to take a put (and reports the drops), so a full
/// cluster keeps accepting writes. Fewer than asked only when fewer nodes match at all.
fn place(
    nodes: &[NodeState],
    request: &PlaceRequest<'_>,
    replication: usize,
    size: u64,
) -> Vec<u16> {
    let eligible = |n: &NodeState| {
        n.alive
            && n.spec.capacity_bytes >= size
            && request
                .required_tags
                .iter()
                .all(|t| n.spec.tags.contains(t))
    };
    let has_room = |n: &NodeState| eligible(n) && n.estimated_free() >= size;
    let local = nodes
        .iter()
        .find(|n| !request.client_node_id.is_empty() && n.spec.node_id == request.client_node_id);
    let mut chosen = Vec::with_capacity(replication);
    if let Some(local) = local.filter(|n| has_room(n)) {
        chosen.push(local.index);
    }
    let mut free: Vec<&NodeState> = nodes
        .iter()
        .filter(|n| has_room(n) && !chosen.contains(&n.index))
        .collect();
    free.sort_by_key(|n| std::cmp::Reverse(n.estimated_free()));
    chosen.extend(
        free.iter()
            .map(|n| n.index)
            .take(replication.saturating_sub(chosen.len())),
    );
    if chosen.len() < replication {
        // Not enough free room: nodes that evict to take it.
        if let Some(local) = local.filter(|n| eligible(n) && !chosen.contains(&n.index)) {
            chosen.push(local.index);
        }
        let mut full: Vec<&NodeState> = nodes
            .iter()
            .filter(|n| eligible(n) && !chosen.contains(&n.index))
            .collect();
        full.sort_by_key(|n| std::cmp::Reverse(n.spec.capacity_bytes));
        chosen.extend(full.iter().map(|n| n.index));
    }
    chosen.truncate(replication);
    chosen
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
    }

    #[test]
    fn rebuilt_entries_take_the_key_namespace_factor_after_the_grace() {
        let policy = ReplicationPolicy {
            default: 1,
            namespaces: [("prod".to_string(), 2)].into_iter().collect(),
        };
        assert_eq!(policy.for_key(b"prod\x1fpage_k"), 2);
        assert_eq!(policy.for_key(b"dev\x1fpage_k"), 1);
        assert_eq!(policy.for_key(b"page_k"), 1);
        let d =
            Directory::with_replication(Duration::from_millis(200), Duration::from_secs(5), policy);
        let keys = vec![
            b"prod\x1fk1".to_vec(),
            b"dev\x1fk2".to_vec(),
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
        assert_eq!(all_hashes(&batches), vec![key_hash(b"prod\x1fk1")]);
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
    }

    #[test]
    fn key_hashes_round_trip_their_wire_form() {
        let h = key_hash(b"some key");
        assert_eq!(KeyHash::from_bytes(&h.to_bytes()), Some(h));
        assert_eq!(KeyHash::from_bytes(&[0u8; 15]), None);
    }
}
