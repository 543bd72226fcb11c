//! The node registry: registration (and re-registration under the same index), heartbeats and
//! leases, leaving, and dropping a dead node's replicas from the entries.
//!
//! Owns: `Directory::nodes`. Invariants: node indexes are never reused (a node that
//! re-registers under its id gets its old index); at most [`MAX_NODES`] nodes.

use super::*;

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
    pub(super) last_heartbeat: Instant,
    /// Its last registration (commits of writes placed before it do not list it).
    pub(super) registered: Instant,
    /// Bytes placed on the node since its last report of free space.
    pub(super) placed_since_report: u64,
}

impl NodeState {
    /// Issue 27: time since the node was last heard from (registration or heartbeat), at
    /// `now` (the directory's clock).
    pub fn heard_ago(&self, now: Instant) -> std::time::Duration {
        now.saturating_duration_since(self.last_heartbeat)
    }

    /// Free space as the master estimates it: the last report less what was placed since.
    pub fn estimated_free(&self) -> u64 {
        self.spec
            .free_bytes
            .saturating_sub(self.placed_since_report)
    }
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

/// Counts a registration in progress (the planner waits: entries are rebuilt meanwhile).
pub(super) struct Registering<'a>(&'a AtomicUsize);

impl<'a> Registering<'a> {
    pub(super) fn start(count: &'a AtomicUsize) -> Registering<'a> {
        count.fetch_add(1, Ordering::SeqCst);
        Registering(count)
    }
}

impl Drop for Registering<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Directory {
    /// Register (or re-register) a node; its entries are rebuilt from `keys`, what it holds.
    pub fn register(&self, spec: NodeSpec, keys: &[Vec<u8>]) -> Result<u16, DirectoryError> {
        if spec.node_id.is_empty() || spec.node_id.len() > 256 {
            return Err(DirectoryError::BadNodeId);
        }
        let _registering = Registering::start(&self.registering);
        let index = {
            let mut nodes = self.nodes.write();
            let now = self.clock.now();
            match nodes.iter_mut().find(|n| n.spec.node_id == spec.node_id) {
                Some(node) => {
                    node.spec = spec;
                    node.alive = true;
                    node.last_heartbeat = now;
                    node.registered = now;
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
                        registered: now,
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
    pub(super) fn add_held_keys(&self, index: u16, keys: &[Vec<u8>], mut dirty: u64) {
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
                node.last_heartbeat = self.clock.now();
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
    pub(super) fn drop_nodes(&self, pick: impl Fn(&NodeState) -> bool) -> Vec<String> {
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

    /// Remove `index` from every entry; returns the shards where an entry lost it and still
    /// has copies (candidates for re-replication).
    pub(super) fn drop_node_entries(&self, index: u16) -> u64 {
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

    pub(super) fn live_mask(&self) -> Vec<bool> {
        self.nodes.read().iter().map(|n| n.alive).collect()
    }
}
