//! Re-replication (see the module docs of `directory`): dirty shards, planning copy tasks
//! for under-replicated entries, handing them to holders in heartbeat replies, timeouts and
//! counters.
//!
//! Owns: `Directory::repair` ([`RepairState`]) and `Directory::counters`. Invariants: at most
//! [`MAX_REPAIR_TASKS`] tasks in flight, at most [`MAX_REPAIR_TASKS_PER_SOURCE`] per holder; a
//! task's source holds the entry and its target does not.

use super::*;

/// One copy task: `source` copies an object it holds to `target`.
#[derive(Clone, Copy, Debug)]
pub(super) struct RepairTask {
    pub(super) id: u64,
    pub(super) source: u16,
    pub(super) target: u16,
    /// Handed to the source in a heartbeat reply (else still queued for it).
    pub(super) handed: bool,
    /// When it was handed out (meaningful once `handed`): a target that registered again
    /// after it is not added on the source's commit.
    pub(super) handed_at: Instant,
    /// The task fails then (queued: it was never handed out; handed: not done in time).
    pub(super) deadline: Instant,
}

/// The re-replication planner's state (one mutex; taken before `nodes` and the shards, never
/// while a shard lock is held).
pub(super) struct RepairState {
    /// Shards to scan for under-replicated entries, one bit each.
    pub(super) dirty: u64,
    /// The shard the next tick starts at.
    pub(super) cursor: usize,
    pub(super) tasks: HashMap<KeyHash, RepairTask>,
    /// Per source, tasks not handed out yet (stale ids are skipped when handing out).
    pub(super) queued: HashMap<u16, VecDeque<(KeyHash, u64)>>,
    pub(super) per_source: HashMap<u16, usize>,
    pub(super) next_id: u64,
    /// No planning before this (the start-up grace).
    pub(super) not_before: Instant,
    pub(super) grace_over: bool,
    /// Entries the last tick found under-replicated with no target.
    pub(super) no_target: usize,
    /// Since when some entry had no target (rescanned after [`REPAIR_RETRY_STUCK`], or when a
    /// node registers).
    pub(super) stuck_since: Option<Instant>,
    /// Issue 29: targets a source could not push to (refused, unreachable), not chosen again
    /// until then (a live node whose data port is cut would otherwise get every re-plan).
    pub(super) avoid: HashMap<u16, Instant>,
}

/// Why a holder reports that a handed-out copy task failed ([`Directory::copy_failed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyFailureKind {
    /// The holder does not have the object (evicted since; its drop report follows).
    NotHeld,
    /// The target refused the object or could not be reached: it is avoided a while.
    Push,
    /// Pushed, but the commit failed.
    Commit,
}

/// How often entries that found no target are looked at again (a node may have room now).
pub(super) const REPAIR_RETRY_STUCK: Duration = Duration::from_secs(10);

impl RepairState {
    pub(super) fn new(not_before: Instant) -> RepairState {
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
            avoid: HashMap::new(),
        }
    }

    pub(super) fn source_load(&self, node: u16) -> usize {
        self.per_source.get(&node).copied().unwrap_or(0)
    }

    pub(super) fn add(&mut self, hash: KeyHash, source: u16, target: u16, deadline: Instant) {
        let id = self.next_id;
        self.next_id += 1;
        self.tasks.insert(
            hash,
            RepairTask {
                id,
                source,
                target,
                handed: false,
                handed_at: deadline,
                deadline,
            },
        );
        *self.per_source.entry(source).or_insert(0) += 1;
        self.queued.entry(source).or_default().push_back((hash, id));
    }

    pub(super) fn remove(&mut self, hash: KeyHash) -> Option<RepairTask> {
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
pub(super) struct RepairCounters {
    pub(super) issued: AtomicU64,
    pub(super) done: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) dropped: AtomicU64,
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

/// The target of one copy: live, not a holder, not `avoid`ed, room for `size` more bytes than
/// planned this tick, and every tag the live holders share; the most estimated free space wins.
pub(super) fn repair_target(
    nodes: &[NodeState],
    entry: &Replicas,
    live: &[bool],
    size: u64,
    planned: &[u64],
    avoid: &HashMap<u16, Instant>,
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
        .filter(|n| n.alive && !entry.holds(n.index) && !avoid.contains_key(&n.index))
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

impl Directory {
    /// Fail every task from or to `node` (it was dropped); their entries are scanned again.
    pub(super) fn cancel_node_tasks(&self, repair: &mut RepairState, node: u16) {
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
        repair.avoid.retain(|_, until| *until > now);
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
                    match repair_target(&nodes, entry, &live, size, &planned_bytes, &repair.avoid) {
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

    /// Issue 29: the live node `node_id` reports that its copy tasks of `hashes` to `target`
    /// failed; after [`CopyFailureKind::NotHeld`] it is no longer listed as their holder. Each such task still in flight fails now and its entry is planned again by the
    /// next tick (lease / 4), not after [`REPAIR_TASK_TIMEOUT`]; after a push failure the
    /// target is avoided for two leases. Only tasks handed to this node are touched (a node
    /// cannot fail another's). Returns how many tasks failed.
    pub fn copy_failed(
        &self,
        node_id: &str,
        target: u16,
        hashes: &[KeyHash],
        why: CopyFailureKind,
        now: Instant,
    ) -> usize {
        let Some(source) = self
            .nodes
            .read()
            .iter()
            .find(|n| n.alive && n.spec.node_id == node_id)
            .map(|n| n.index)
        else {
            return 0;
        };
        let mut repair = self.repair.lock();
        let mut failed = 0;
        for &hash in hashes {
            let ours = repair
                .tasks
                .get(&hash)
                .is_some_and(|t| t.handed && t.source == source && t.target == target);
            if ours && repair.remove(hash).is_some() {
                failed += 1;
                repair.dirty |= shard_bit(hash);
                if why == CopyFailureKind::NotHeld {
                    // The node is the truth: it does not hold the object, so it is no holder
                    // (found by the simulation, issue 29 §4: a listing left stale by a node
                    // that lost its disk between a write and its commit made every re-plan
                    // pick the same source, forever). The wanted factor stays: the copies
                    // left are copied from.
                    let mut shard = self.shard(hash).write();
                    if shard.get_mut(&hash).is_some_and(|e| e.remove(source)) {
                        shard.remove(&hash);
                    }
                }
            }
        }
        if failed > 0 {
            self.counters
                .failed
                .fetch_add(failed as u64, Ordering::Relaxed);
            if why == CopyFailureKind::Push {
                repair.avoid.insert(target, now + 2 * self.lease());
            }
        }
        failed
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
            task.handed_at = now;
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
