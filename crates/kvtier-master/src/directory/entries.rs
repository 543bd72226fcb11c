//! The key directory proper: per-shard entries (key hash -> replica slots and wanted factor),
//! first-writer-wins claims, commits, lookups and forgetting keys, and placement of new puts.
//!
//! Owns: `Directory::shards` and `Directory::pending` (the claims), and the mean object size.
//! Invariants: an entry's slots name registered node indexes (at most [`MAX_REPLICAS`], no
//! duplicates, unused slots `NO_NODE`), an entry has at least one holder, a key is never both
//! visible and claimed by a different unexpired claim.

use super::*;

/// The node indexes holding one object (unused slots are [`NO_NODE`]) and how many copies its
/// namespace wants. 7 bytes, so a map slot stays 24 (the byte of `want` sits where the slot
/// had padding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Replicas {
    pub(super) slots: [u16; MAX_REPLICAS],
    pub(super) want: u8,
}

const _: () = assert!(std::mem::size_of::<(KeyHash, Replicas)>() == 24);

impl Replicas {
    pub(super) fn empty(want: usize) -> Replicas {
        Replicas {
            slots: [NO_NODE; MAX_REPLICAS],
            want: want.clamp(1, MAX_REPLICAS) as u8,
        }
    }
    pub(super) fn from_nodes(nodes: &[u16]) -> Replicas {
        let mut r = Replicas::empty(nodes.len());
        for (slot, node) in r.slots.iter_mut().zip(nodes) {
            *slot = *node;
        }
        r
    }
    pub(super) fn nodes(&self) -> impl Iterator<Item = u16> + '_ {
        self.slots.iter().copied().filter(|&n| n != NO_NODE)
    }
    pub(super) fn holds(&self, node: u16) -> bool {
        node != NO_NODE && self.slots.contains(&node)
    }
    pub(super) fn live_count(&self, live: &[bool]) -> usize {
        self.nodes()
            .filter(|&n| live.get(usize::from(n)).copied().unwrap_or(false))
            .count()
    }
    pub(super) fn want(&self) -> usize {
        usize::from(self.want)
    }
    /// Wants more live copies than it has, and has one to copy from.
    pub(super) fn under_replicated(&self, live: &[bool]) -> bool {
        let have = self.live_count(live);
        have > 0 && have < self.want()
    }
    pub(super) fn add(&mut self, node: u16) {
        if self.slots.contains(&node) {
            return;
        }
        if let Some(slot) = self.slots.iter_mut().find(|s| **s == NO_NODE) {
            *slot = node;
        }
    }
    /// Remove `node`; returns whether the entry is now empty.
    pub(super) fn remove(&mut self, node: u16) -> bool {
        for slot in self.slots.iter_mut() {
            if *slot == node {
                *slot = NO_NODE;
            }
        }
        self.slots.iter().all(|&s| s == NO_NODE)
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

/// Placement inputs of one put batch.
#[derive(Clone, Debug, Default)]
pub struct PlaceRequest<'a> {
    pub client_node_id: &'a str,
    pub replication: usize,
    pub required_tags: &'a [String],
}

pub(super) struct PendingClaim {
    pub(super) claim: u64,
    /// When it was placed (a node registered again after it is not taken as a holder).
    pub(super) issued: Instant,
    pub(super) deadline: Instant,
    /// The replication factor of the put's namespace.
    pub(super) want: u8,
}

/// The first claim id of a directory's life: the wall clock in ns, so the claims of a later
/// leader (or a restarted master) never repeat one a client still holds from an earlier one,
/// whose commit then cannot match a new claim (its node indexes may mean other nodes now).
pub(super) fn first_claim(clock: &dyn Clock) -> u64 {
    clock.unix_nanos().max(1)
}

/// Choose `replication` distinct live nodes for an object of `size` bytes: the writer's own
/// node first when it is live, matches the tags and has free room; then the others with the
/// most estimated free space. When fewer than asked have free room, nodes whose capacity holds
/// the object fill up the rest, the writer's node first, then the largest: every node is a
/// cache that evicts its coldest objects to take a put (and reports the drops), so a full
/// cluster keeps accepting writes. Fewer than asked only when fewer nodes match at all.
pub(super) fn place(
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

impl Directory {
    /// Live nodes holding `key`.
    pub fn locate(&self, key: &[u8]) -> Vec<u16> {
        let live = self.live_mask();
        self.locate_with(&live, key_hash(key))
    }

    pub(super) fn locate_with(&self, live: &[bool], hash: KeyHash) -> Vec<u16> {
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

    /// Live nodes of each key hash, in order (issue 30: the cluster KV-event stream re-checks
    /// the blocks it published when nodes drop; it keeps hashes, not keys).
    pub fn locate_hashes(&self, hashes: &[KeyHash]) -> Vec<Vec<u16>> {
        let live = self.live_mask();
        hashes.iter().map(|&h| self.locate_with(&live, h)).collect()
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
        let now = self.clock.now();
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
                    issued: now,
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
    pub(super) fn learn_object_size(&self, sizes: &[u64]) {
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

    pub(super) fn mean_object_bytes(&self) -> u64 {
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
        // Issue 29 §4 (found by the simulation): a node that registered again after the
        // write was placed (or the copy handed out) may have restarted without its disk
        // since it acknowledged the bytes; it is not added as a holder on the writer's word.
        // Its registration listed what it holds then.
        let (live, registered): (Vec<bool>, Vec<Instant>) = self
            .nodes
            .read()
            .iter()
            .map(|n| (n.alive, n.registered))
            .unzip();
        for &n in stored {
            if usize::from(n) >= live.len() {
                return Err(DirectoryError::UnknownNode(n));
            }
        }
        if claim == 0 {
            return Ok(self.commit_replica(hash, stored, &live, &registered));
        }
        Ok(self.commit_claim(claim, hash, stored, &live, &registered))
    }

    /// [`Self::commit`] of an extra replica of a visible object (claim 0: a copy task's
    /// target). The repair lock first: the task's handing time fences its target.
    fn commit_replica(
        &self,
        hash: KeyHash,
        stored: &[u16],
        live: &[bool],
        registered: &[Instant],
    ) -> bool {
        let mut repair = self.repair.lock();
        let task = repair.tasks.get(&hash).copied();
        let fenced = |n: u16| {
            task.is_some_and(|t| {
                t.target == n && t.handed && registered[usize::from(n)] > t.handed_at
            })
        };
        let short = {
            let mut shard = self.shard(hash).write();
            let Some(entry) = shard.get_mut(&hash) else {
                return false;
            };
            for &n in stored
                .iter()
                .filter(|&&n| live[usize::from(n)] && !fenced(n))
            {
                entry.add(n);
            }
            entry.under_replicated(live)
        };
        let finished = task.is_some_and(|t| {
            stored.contains(&t.target) && live[usize::from(t.target)] && !fenced(t.target)
        });
        if finished {
            repair.remove(hash);
            self.counters.done.fetch_add(1, Ordering::Relaxed);
            if short {
                // Wanted 3, had 1: the next copy.
                repair.dirty |= shard_bit(hash);
            }
        }
        true
    }

    /// [`Self::commit`] of a placed write (`claim` from `PlacePuts`): lists the live nodes it
    /// was stored on that did not register again since it was placed; whether it is visible.
    fn commit_claim(
        &self,
        claim: u64,
        hash: KeyHash,
        stored: &[u16],
        live: &[bool],
        registered: &[Instant],
    ) -> bool {
        let short = {
            let mut pending = self.pending.lock();
            let (want, issued) = match pending.get(&hash) {
                Some(p) if p.claim == claim => (p.want, p.issued),
                _ => return !self.locate_with(live, hash).is_empty(),
            };
            pending.remove(&hash);
            if stored.is_empty() {
                return false;
            }
            let stored: Vec<u16> = stored
                .iter()
                .copied()
                .filter(|&n| live[usize::from(n)] && registered[usize::from(n)] <= issued)
                .collect();
            if stored.is_empty() {
                // Every node it was written to is gone or registered again since: visible
                // only if a registration reported it.
                return !self.locate_with(live, hash).is_empty();
            }
            let mut shard = self.shard(hash).write();
            let entry = shard
                .entry(hash)
                .or_insert(Replicas::empty(usize::from(want)));
            entry.want = entry.want.max(want);
            for n in stored {
                entry.add(n);
            }
            entry.live_count(live) < entry.want()
        };
        if short {
            // Placed on fewer nodes than wanted (few had room, or a write failed).
            self.repair.lock().dirty |= shard_bit(hash);
        }
        true
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
}
