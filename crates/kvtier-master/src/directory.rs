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

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

/// Most copies of one object the directory tracks.
pub const MAX_REPLICAS: usize = 3;
/// Marks an unused replica slot.
const NO_NODE: u16 = u16::MAX;
/// Most nodes one master tracks (indexes are u16, one value reserved).
pub const MAX_NODES: usize = (u16::MAX - 1) as usize;
const SHARDS: usize = 64;

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

/// The node indexes holding one object (unused slots are [`NO_NODE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Replicas([u16; MAX_REPLICAS]);

impl Replicas {
    fn from_nodes(nodes: &[u16]) -> Replicas {
        let mut slots = [NO_NODE; MAX_REPLICAS];
        for (slot, node) in slots.iter_mut().zip(nodes) {
            *slot = *node;
        }
        Replicas(slots)
    }
    fn nodes(&self) -> impl Iterator<Item = u16> + '_ {
        self.0.iter().copied().filter(|&n| n != NO_NODE)
    }
    fn add(&mut self, node: u16) {
        if self.0.contains(&node) {
            return;
        }
        if let Some(slot) = self.0.iter_mut().find(|s| **s == NO_NODE) {
            *slot = node;
        }
    }
    /// Remove `node`; returns whether the entry is now empty.
    fn remove(&mut self, node: u16) -> bool {
        for slot in self.0.iter_mut() {
            if *slot == node {
                *slot = NO_NODE;
            }
        }
        self.0.iter().all(|&s| s == NO_NODE)
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
}

/// The node registry plus the key directory.
pub struct Directory {
    shards: Vec<RwLock<Shard>>,
    nodes: RwLock<Vec<NodeState>>,
    pending: Mutex<HashMap<KeyHash, PendingClaim>>,
    next_claim: Mutex<u64>,
    lease: Duration,
    claim_timeout: Duration,
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
        }
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    fn shard(&self, hash: KeyHash) -> &RwLock<Shard> {
        // The high bits pick the shard; the map uses the low bits.
        &self.shards[(hash.0[1] >> 58) as usize % SHARDS]
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
        self.drop_node_entries(index);
        for key in keys {
            let hash = key_hash(key);
            self.shard(hash)
                .write()
                .entry(hash)
                .or_insert(Replicas([NO_NODE; MAX_REPLICAS]))
                .add(index);
        }
        Ok(index)
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
    /// node ids that were dropped.
    pub fn expire_nodes(&self, now: Instant) -> Vec<String> {
        let expired: Vec<(u16, String)> = {
            let mut nodes = self.nodes.write();
            nodes
                .iter_mut()
                .filter(|n| n.alive && now.duration_since(n.last_heartbeat) > self.lease)
                .map(|n| {
                    n.alive = false;
                    (n.index, n.spec.node_id.clone())
                })
                .collect()
        };
        for (index, _) in &expired {
            self.drop_node_entries(*index);
        }
        expired.into_iter().map(|(_, id)| id).collect()
    }

    fn drop_node_entries(&self, index: u16) {
        for shard in &self.shards {
            shard.write().retain(|_, replicas| !replicas.remove(index));
        }
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

    /// Commit a claimed key as held by `stored` (empty: the write failed, release the claim).
    /// Claim 0 (never handed out) adds `stored` as replicas of an already visible key.
    /// Returns whether the key is visible now. A key whose claim lapsed and was taken by
    /// another writer is not committed by this one.
    pub fn commit(&self, claim: u64, key: &[u8], stored: &[u16]) -> Result<bool, DirectoryError> {
        let hash = key_hash(key);
        let live = self.live_mask();
        for &n in stored {
            if usize::from(n) >= live.len() {
                return Err(DirectoryError::UnknownNode(n));
            }
        }
        if claim == 0 {
            // An extra replica of a visible object (a client cached a remote fetch locally).
            let mut shard = self.shard(hash).write();
            let Some(entry) = shard.get_mut(&hash) else {
                return Ok(false);
            };
            for &n in stored.iter().filter(|&&n| live[usize::from(n)]) {
                entry.add(n);
            }
            return Ok(true);
        }
        let mut pending = self.pending.lock();
        match pending.get(&hash) {
            Some(p) if p.claim == claim => {
                pending.remove(&hash);
            }
            _ => return Ok(!self.locate_with(&live, hash).is_empty()),
        }
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
            .or_insert(Replicas([NO_NODE; MAX_REPLICAS]));
        for n in stored {
            entry.add(n);
        }
        Ok(true)
    }

    /// `node` no longer holds `keys` (eviction, removal, or a read found them missing).
    pub fn drop_keys<K: AsRef<[u8]>>(&self, node: u16, keys: &[K]) -> u64 {
        let mut removed = 0;
        for key in keys {
            let hash = key_hash(key.as_ref());
            let mut shard = self.shard(hash).write();
            if let Some(replicas) = shard.get_mut(&hash) {
                let before = replicas.nodes().count();
                let empty = replicas.remove(node);
                if replicas.nodes().count() < before {
                    removed += 1;
                }
                if empty {
                    shard.remove(&hash);
                }
            }
        }
        removed
    }

    /// Remove keys from the directory; returns the nodes that held each.
    pub fn forget<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<Vec<u16>> {
        keys.iter()
            .map(|k| {
                let hash = key_hash(k.as_ref());
                self.shard(hash)
                    .write()
                    .remove(&hash)
                    .map(|r| r.nodes().collect())
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Forget every node, entry and claim (a new leader starts from what nodes report).
    pub fn reset(&self) {
        for shard in &self.shards {
            *shard.write() = Shard::default();
        }
        self.nodes.write().clear();
        self.pending.lock().clear();
        *self.next_claim.lock() = first_claim();
    }

    /// Insert an entry directly (benchmarks and rebuilds).
    pub fn insert_hash(&self, hash: KeyHash, nodes: &[u16]) {
        self.shard(hash)
            .write()
            .insert(hash, Replicas::from_nodes(nodes));
    }
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
/// node first when it is live, matches the tags and has room; then the others with the most
/// estimated free space. Fewer than asked when fewer fit.
fn place(
    nodes: &[NodeState],
    request: &PlaceRequest<'_>,
    replication: usize,
    size: u64,
) -> Vec<u16> {
    let fits = |n: &NodeState| {
        n.alive
            && n.estimated_free() >= size
            && request
                .required_tags
                .iter()
                .all(|t| n.spec.tags.contains(t))
    };
    let mut chosen = Vec::with_capacity(replication);
    if let Some(local) = nodes
        .iter()
        .find(|n| !request.client_node_id.is_empty() && n.spec.node_id == request.client_node_id)
    {
        if fits(local) {
            chosen.push(local.index);
        }
    }
    let mut others: Vec<&NodeState> = nodes
        .iter()
        .filter(|n| fits(n) && !chosen.contains(&n.index))
        .collect();
    others.sort_by_key(|n| std::cmp::Reverse(n.estimated_free()));
    for n in others {
        if chosen.len() >= replication {
            break;
        }
        chosen.push(n.index);
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
}
