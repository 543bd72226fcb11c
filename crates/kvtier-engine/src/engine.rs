//! The engine: put / get / remove over the index, the DRAM tier and the eviction policy.
//!
//! Owns: the protocol that keeps the three consistent.
//! - A put allocates (evicting if needed), copies into its own blocks with no lock held, then
//!   publishes under the shard write lock. Until then nobody can see the object, so nothing is
//!   served that was not fully written. Losing a race to the same key frees the copy.
//! - Every index insert/unlink and the matching policy hook happen under the same shard write
//!   lock, so the policy tracks exactly the visible keys, and `objects` / `bytes_used` match
//!   the index whenever no operation is in flight.
//! - Eviction unlinks only objects whose `Arc` is held by the index alone (checked under the
//!   write lock), so it frees memory immediately and never under a reader. `remove` unlinks
//!   regardless; a reader's pin then keeps the memory until its copy ends.
//!
//! Lock order: index shard → policy → allocator (the allocator is taken last, also when an
//! object drops). No path takes a shard lock while holding the policy or allocator lock.
//!
//! With the SSD tier on (see the `ssd` module for its design): a put that misses DRAM also
//! checks SSD (put-if-absent across both tiers); a stored put is queued for its SSD copy
//! (write-through) and, in strict mode or with `ssd_copy_async = false`, waits for it; with
//! write-back, eviction copies its victims to SSD before unlinking them. A get that misses
//! DRAM reads from SSD into the destination and, with `auto_promote_on_read`, copies the
//! object back into DRAM. `contains`/`exists_v2`/`object_len` answer for both tiers;
//! `remove`/`clear` act on both. The SSD copy pipeline publishes a record only while the
//! DRAM index still holds the very object it copied (checked under that key's DRAM shard
//! lock), so a remove racing with a copy can never leave the object on SSD.

use std::sync::Arc;

use kvtier_proto::{ExistsV2Answer, ExistsV2Query, ProtoError};

use crate::config::{EngineConfig, SsdDurabilityMode, SsdWritePolicy};
use crate::dram::{DramAllocation, DramOptions, DramTier};
use crate::error::{EngineError, NoSpaceCause};
use crate::eviction::events::{Drained, EventKind, EventLog, HeldGroups, TierGroups};
use crate::eviction::{group_of, new_policy, EvictionPolicy, GroupChange, Victim};
use crate::index::Index;
use crate::object::{Location, Object, PinnedObject};
use crate::ssd::tier::{SsdRead, SsdTier};
use crate::ssd::{RecoveryProgress, RecoveryReport};
use crate::stats::{add, sub, Counters, EngineStats};

/// Extra facts about a put.
/// Where one object is stored (see [`Engine::placement`]): its length per tier, `None` where
/// the tier does not hold it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub key: Vec<u8>,
    pub dram_len: Option<u64>,
    pub ssd_len: Option<u64>,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct PutMeta {
    /// Depth of the page in its prefix chain (0 = first page), from SGLang `prefix_keys`;
    /// `None` when unknown.
    pub depth: Option<u32>,
}

/// What a successful put did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// The object is new and now visible.
    Stored,
    /// The key was already present; nothing was copied.
    AlreadyPresent,
}

/// A single-host tiered object store. `Send + Sync`; share it through an `Arc`.
pub struct Engine {
    config: EngineConfig,
    dram: DramTier,
    index: Arc<Index>,
    policy: Box<dyn EvictionPolicy>,
    counters: Arc<Counters>,
    ssd: Option<SsdTier>,
    promotions: std::sync::atomic::AtomicU64,
    events: Arc<EventLog>,
    evicted_groups: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Validate `config`, map (and pre-fault) the arena; with the SSD tier on, open its
    /// directory and rebuild its index (warm restart).
    pub fn open(config: EngineConfig) -> Result<Engine, EngineError> {
        Engine::open_with_progress(config, &mut |_| {})
    }

    /// [`Engine::open`], calling `progress` while the SSD index is being recovered (about
    /// every 100 ms and once at the end; never when the SSD tier is off).
    pub fn open_with_progress(
        mut config: EngineConfig,
        progress: &mut dyn FnMut(&RecoveryProgress),
    ) -> Result<Engine, EngineError> {
        config.validate()?;
        // Issue 26: a default SSD directory another user took falls back to a private one.
        config.resolve_default_ssd_dir()?;
        // validate() bounds total_blocks by u32::MAX.
        let blocks =
            u32::try_from(config.total_blocks()).map_err(|_| EngineError::InvalidConfig {
                key: "dram_capacity_bytes",
                reason: "too many blocks".into(),
            })?;
        let options = DramOptions {
            prefault: config.dram_prefault,
            checksums: config.ssd_enabled,
        };
        let dram = DramTier::open(blocks, config.dram_block_size, options)
            .map_err(EngineError::ArenaMap)?;
        let index = Arc::new(Index::new(config.index_shards));
        let events = Arc::new(EventLog::default());
        let ssd = if config.ssd_enabled {
            let groups = TierGroups::new(Arc::clone(&events));
            Some(SsdTier::open(
                &config,
                Arc::clone(&index),
                groups,
                progress,
            )?)
        } else {
            None
        };
        Ok(Engine {
            index,
            policy: new_policy(config.eviction_policy),
            dram,
            counters: Arc::default(),
            ssd,
            promotions: Default::default(),
            events,
            evicted_groups: Default::default(),
            config,
        })
    }

    /// What the SSD tier's warm restart did at open (`None` without an SSD tier).
    pub fn recovery_report(&self) -> Option<RecoveryReport> {
        self.ssd.as_ref().map(|s| s.recovery_report().clone())
    }

    /// Make everything stored so far durable: wait for queued SSD copies, `fdatasync` every
    /// segment and write the SSD index checkpoint (so the next open need not scan). A no-op
    /// without an SSD tier.
    pub fn flush(&self) -> Result<(), EngineError> {
        match &self.ssd {
            Some(ssd) => ssd.flush(),
            None => Ok(()),
        }
    }

    /// Flush, then stop the SSD tier's threads. Dropping an engine does the same but can only
    /// log a failure.
    pub fn close(self) -> Result<(), EngineError> {
        let r = self.flush();
        drop(self);
        r
    }

    /// Test hook: make the next `writes` SSD writes and `syncs` SSD syncs fail with `EIO`
    /// (`u64::MAX` for all of them until called again with 0).
    #[doc(hidden)]
    pub fn inject_ssd_faults(&self, writes: u64, syncs: u64) {
        if let Some(ssd) = &self.ssd {
            ssd.inject_faults(writes, syncs);
        }
    }

    fn strict(&self) -> bool {
        self.config.ssd_durability_mode == SsdDurabilityMode::Strict
    }

    fn write_back(&self) -> bool {
        self.config.ssd_write_policy == SsdWritePolicy::WriteBack
    }

    /// The configuration this engine was opened with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Put-if-absent. An existing key is `Ok(AlreadyPresent)` with no copy (a dedup skip; it
    /// also counts as an access for recency). The object becomes visible only after its bytes
    /// are fully copied. Evicts cold objects to make room; `NoSpace` if nothing more can go
    /// (pinned, or the put's own group; the put fails and nothing else is lost).
    pub fn put(&self, key: &[u8], value: &[u8], meta: PutMeta) -> Result<PutOutcome, EngineError> {
        self.put_verified(key, value, meta, &|| true)
    }

    /// [`put`](Self::put) from memory that can be revoked while it is copied (a client's
    /// memfd mapping the server guards against truncation): `intact` is asked after the bytes
    /// are copied and before the object becomes visible; `false` fails the put with
    /// [`EngineError::SourceRevoked`] and stores nothing, so bytes read from revoked memory
    /// are never served.
    pub fn put_verified(
        &self,
        key: &[u8],
        value: &[u8],
        meta: PutMeta,
        intact: &dyn Fn() -> bool,
    ) -> Result<PutOutcome, EngineError> {
        let result = self.put_inner(key, value, meta, intact);
        if result.is_err() {
            add(&self.counters.put_failures, 1);
        }
        result
    }

    fn put_inner(
        &self,
        key: &[u8],
        value: &[u8],
        meta: PutMeta,
        intact: &dyn Fn() -> bool,
    ) -> Result<PutOutcome, EngineError> {
        if key.is_empty() {
            return Err(EngineError::EmptyKey);
        }
        let len = value.len() as u64;
        if self.dram.blocks_for(len) > self.dram.total_blocks() {
            return Err(EngineError::ObjectTooLarge {
                len,
                capacity: self.dram.capacity_bytes(),
            });
        }
        if self.index.contains(key) {
            self.policy.on_access(key);
            add(&self.counters.dedup_skips, 1);
            return Ok(PutOutcome::AlreadyPresent);
        }
        if let Some(ssd) = &self.ssd {
            if ssd.contains(key) {
                add(&self.counters.dedup_skips, 1);
                return Ok(PutOutcome::AlreadyPresent);
            }
            if self.strict() && len > ssd.max_payload() {
                return Err(EngineError::ObjectTooLarge {
                    len,
                    capacity: ssd.max_payload(),
                });
            }
        }
        let mut allocation = self.allocate_evicting(len, group_of(key))?;
        allocation.write(value);
        if !intact() {
            // The allocation drops here, returning its blocks.
            return Err(EngineError::SourceRevoked);
        }
        let object = Arc::new(Object {
            location: Location::Dram(allocation),
            depth: meta.depth,
        });

        let mut shard = self.index.shard(key).write();
        if shard.contains_key(key) {
            drop(shard);
            // A concurrent put of the same key won; `object` drops here, freeing our blocks.
            drop(object);
            add(&self.counters.dedup_skips, 1);
            return Ok(PutOutcome::AlreadyPresent);
        }
        let copy = (self.ssd.is_some() && !self.write_back()).then(|| Arc::clone(&object));
        shard.insert(Box::from(key), object);
        self.inserted(key, len, meta.depth);
        add(&self.counters.objects, 1);
        add(&self.counters.bytes_used, len);
        drop(shard);
        if let (Some(ssd), Some(object)) = (&self.ssd, copy) {
            let wait = self.strict() || !self.config.ssd_copy_async;
            let weak = Arc::downgrade(&object);
            if let Some(ticket) = ssd.submit(key, object, wait) {
                if let Err(e) = ticket.wait() {
                    if self.strict() {
                        // Not durable, so not stored: take it out of DRAM again.
                        self.unlink_if(key, &weak);
                        return Err(e.into_engine(len, ssd.max_payload()));
                    }
                }
            }
        }
        add(&self.counters.puts, 1);
        add(&self.counters.bytes_in, len);
        Ok(PutOutcome::Stored)
    }

    /// Unlink `key` if the index still holds the object `weak` points to.
    fn unlink_if(&self, key: &[u8], weak: &std::sync::Weak<Object>) {
        let removed = {
            let mut shard = self.index.shard(key).write();
            let Some(target) = weak.upgrade() else { return };
            if !shard.get(key).is_some_and(|o| Arc::ptr_eq(o, &target)) {
                return;
            }
            let object = shard.remove(key);
            self.removed(key, EventKind::Removed);
            sub(&self.counters.objects, 1);
            sub(&self.counters.bytes_used, target.len());
            drop(target);
            object
        };
        drop(removed);
    }

    /// Allocate `len` bytes, evicting cold unpinned page groups until it fits. The group
    /// `own_group` (the page being written) is never a victim: evicting a page's first
    /// components to store its last would leave it incomplete.
    ///
    /// Each round asks the policy for one cold window. If the round evicted something, the
    /// next starts again from the coldest; if everything in it was pinned, the next looks at
    /// the following window. Running past the last object means everything is pinned.
    fn allocate_evicting(&self, len: u64, own_group: &[u8]) -> Result<DramAllocation, EngineError> {
        let needed_blocks = self.dram.blocks_for(len);
        let window = self.config.eviction_candidate_window;
        let mut skip = 0;
        // A pass that started while copies were pending may have skipped objects the queue
        // released since; NoSpace only after one whole pass that saw the queue empty.
        let mut idle_pass = false;
        let mut candidates = Vec::with_capacity(window);
        // What this pass could not evict, for the error (issue 28).
        let mut cause = NoSpaceCause::default();
        loop {
            if let Some(a) = self.dram.try_allocate(len) {
                return Ok(a);
            }
            candidates.clear();
            self.policy.candidates(skip, window, &mut candidates);
            if candidates.is_empty() {
                // Objects waiting for their SSD copy are pinned by the copy queue; each
                // finished batch releases some. Only when nothing is pending is it NoSpace.
                if let Some(ssd) = self.ssd.as_ref().filter(|s| s.pending() > 0) {
                    ssd.wait_progress();
                    skip = 0;
                    idle_pass = false;
                    cause = NoSpaceCause::default();
                    continue;
                }
                if !idle_pass && skip > 0 {
                    idle_pass = true;
                    skip = 0;
                    cause = NoSpaceCause::default();
                    continue;
                }
                return Err(EngineError::NoSpace { needed: len, cause });
            }
            if self.write_back() {
                self.copy_victims_to_ssd(&candidates, needed_blocks);
            }
            let mut evicted_any = false;
            for victim in &candidates {
                if &*victim.group == own_group {
                    if !victim.partial {
                        cause.own_group_objects = victim.members.len();
                    }
                } else if self.try_evict_group(victim) {
                    evicted_any = true;
                    if self.dram.free_blocks() >= needed_blocks {
                        break;
                    }
                } else if !victim.partial {
                    cause.pinned_groups += 1;
                }
            }
            skip = if evicted_any {
                idle_pass = false;
                cause = NoSpaceCause::default();
                0
            } else {
                // Partial victims are extra proposals, not ranks of the cold window.
                skip + candidates.iter().filter(|v| !v.partial).count()
            };
        }
    }

    /// Write-back: copy enough of `candidates` (those not on SSD yet and not pinned) to SSD,
    /// and wait, so that evicting them loses nothing. A failed copy is counted by the tier;
    /// the object is evicted anyway.
    fn copy_victims_to_ssd(&self, candidates: &[Victim], needed_blocks: u64) {
        let Some(ssd) = &self.ssd else { return };
        let deficit = needed_blocks.saturating_sub(self.dram.free_blocks());
        let mut covered = 0;
        let mut tickets = Vec::new();
        for key in candidates.iter().flat_map(|v| &v.members) {
            if covered >= deficit {
                break;
            }
            let Some(object) = self.index.get(key) else {
                continue;
            };
            // The index and our clone: anything more is a reader, so it cannot go now.
            if Arc::strong_count(&object) > 2 {
                continue;
            }
            covered += object.dram_blocks();
            if !ssd.contains(key) && object.len() <= ssd.max_payload() {
                if let Some(t) = ssd.submit(key, object, true) {
                    tickets.push(t);
                }
            }
        }
        for t in tickets {
            let _ = t.wait();
        }
    }

    /// Evict every object of `victim`'s group (only its superseded members for a partial
    /// victim), or none of them: the write locks of all the
    /// members' shards are taken (in shard order, the order every multi-shard path uses), the
    /// member list is re-read from the policy under them, and the group goes only if no
    /// member is pinned by a reader. Returns whether it was evicted.
    ///
    /// A member put concurrently into a shard not locked here is retried with the new member
    /// list a few times; a group that keeps changing is skipped this round.
    fn try_evict_group(&self, victim: &Victim) -> bool {
        let mut members = victim.members.clone();
        for _attempt in 0..4 {
            if members.is_empty() {
                return false;
            }
            let mut shards: Vec<&parking_lot::RwLock<crate::index::Shard>> =
                members.iter().map(|k| self.index.shard(k)).collect();
            shards.sort_by_key(|s| *s as *const _ as usize);
            shards.dedup_by_key(|s| *s as *const _ as usize);
            let mut guards: Vec<_> = shards.iter().map(|s| s.write()).collect();
            let guard_of = |key: &[u8]| {
                let target = self.index.shard(key) as *const _ as usize;
                shards
                    .iter()
                    .position(|s| *s as *const _ as usize == target)
            };
            let current = if victim.partial {
                self.policy.demoted(&victim.group)
            } else {
                self.policy.members(&victim.group)
            };
            if current.iter().any(|k| guard_of(k).is_none()) {
                drop(guards);
                members = current;
                continue;
            }
            // All-or-nothing: a pinned member (a reader copies it) keeps the whole page.
            let pinned = current.iter().any(|k| {
                guard_of(k)
                    .and_then(|g| guards[g].get(&**k))
                    .is_none_or(|o| Arc::strong_count(o) != 1)
            });
            if pinned || current.is_empty() {
                return false;
            }
            let mut freed = Vec::with_capacity(current.len());
            for key in &current {
                let Some(g) = guard_of(key) else { continue };
                let Some(object) = guards[g].remove(&**key) else {
                    continue;
                };
                let change = self.policy.on_remove(key);
                if change == GroupChange::Emptied {
                    self.events
                        .record(EventKind::Evicted, group_of(key), victim.depth);
                }
                sub(&self.counters.objects, 1);
                sub(&self.counters.bytes_used, object.len());
                if victim.partial {
                    add(&self.counters.evictions_superseded, 1);
                } else {
                    add(&self.counters.evictions_capacity, 1);
                }
                add(&self.counters.evicted_bytes, object.len());
                freed.push(object);
            }
            drop(guards);
            if !victim.partial {
                self.evicted_groups
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            // Sole owners: dropping returns the blocks to the allocator now, outside the locks.
            drop(freed);
            return true;
        }
        false
    }

    /// Index insert bookkeeping (caller holds the key's shard write lock).
    fn inserted(&self, key: &[u8], len: u64, depth: Option<u32>) {
        if self.policy.on_insert(key, len, depth) == GroupChange::Created {
            self.events.record(EventKind::Stored, group_of(key), depth);
        }
    }

    /// Index unlink bookkeeping (caller holds the key's shard write lock).
    fn removed(&self, key: &[u8], kind: EventKind) {
        if self.policy.on_remove(key) == GroupChange::Emptied {
            self.events.record(kind, group_of(key), None);
        }
    }

    /// Start recording page-group events (stored / evicted / removed / cleared) into a ring
    /// of `capacity` events; see [`crate::eviction::events`]. Off by default.
    pub fn enable_events(&self, capacity: usize) {
        self.events.enable(capacity);
    }

    /// [`Engine::enable_events`], and with the SSD tier on also its `SsdStored` /
    /// `SsdRemoved` events (the groups on SSD now are recorded as `SsdStored` first), so a
    /// consumer can name each group's medium (the host KV-event stream, issue 30).
    pub fn enable_media_events(&self, capacity: usize) {
        self.events.enable(capacity);
        if let Some(ssd) = &self.ssd {
            ssd.enable_group_events();
        }
    }

    /// The page groups held now, per tier: `(DRAM, SSD)` (SSD only while media events are on).
    /// A consumer that lost events (the ring dropped them) re-reads its state from this; events
    /// recorded meanwhile follow in the ring, so applying them after it converges (per group,
    /// the last event wins). Walks every index shard: a recovery path, not a data path.
    pub fn held_groups(&self) -> HeldGroups {
        let mut dram: std::collections::HashSet<&[u8]> = std::collections::HashSet::new();
        let guards: Vec<_> = self.index.shards().iter().map(|s| s.read()).collect();
        for guard in &guards {
            dram.extend(guard.keys().map(|k| group_of(k)));
        }
        let dram = dram.into_iter().map(Arc::from).collect();
        drop(guards);
        let ssd = self
            .ssd
            .as_ref()
            .map(|s| s.held_groups())
            .unwrap_or_default();
        (dram, ssd)
    }

    /// Take up to `max` of the oldest recorded events.
    pub fn drain_events(&self, max: usize) -> Drained {
        self.events.drain(max)
    }

    /// Page groups evicted whole to make room (each counts its objects in
    /// `evictions_capacity`), and groups tracked now.
    pub fn group_stats(&self) -> (u64, u64) {
        (
            self.evicted_groups
                .load(std::sync::atomic::Ordering::Relaxed),
            self.policy.groups() as u64,
        )
    }

    /// Refresh the recency of `key`'s page group without reading it (a hint, e.g. from
    /// SGLang's KV events: the host cache dropped the page, so this copy is now the only
    /// one). Returns whether the key is in DRAM.
    pub fn touch(&self, key: &[u8]) -> bool {
        let present = self.index.contains(key);
        if present {
            self.policy.on_access(key);
        }
        present
    }

    /// Refresh the recency of the page group `group` (`[tag/]page_hash@`, see
    /// [`eviction::group_of`](crate::eviction::group_of)), for a caller that knows the page
    /// but not its objects' keys (SGLang's KV events name pages). Returns whether the group
    /// is in DRAM.
    pub fn touch_group(&self, group: &[u8]) -> bool {
        match self.policy.members(group).first() {
            Some(member) => {
                self.policy.on_access(member);
                true
            }
            None => false,
        }
    }

    /// Copy the whole object into `dst`. `dst.len()` must equal the stored length, else
    /// `SizeMismatch` and `dst` is untouched. A missing key is `NotFound`. Counts a hit (with
    /// `bytes_out`) or a miss; a size mismatch counts only `size_mismatches`.
    pub fn get_into(&self, key: &[u8], dst: &mut [u8]) -> Result<(), EngineError> {
        let Some(object) = self.index.get(key) else {
            return self.get_from_ssd(key, dst);
        };
        let stored = object.len();
        if dst.len() as u64 != stored {
            add(&self.counters.size_mismatches, 1);
            return Err(EngineError::SizeMismatch {
                stored,
                requested: dst.len() as u64,
            });
        }
        // The Arc pins the memory; no index lock is held during the copy.
        object.copy_to(dst);
        drop(object);
        self.policy.on_access(key);
        add(&self.counters.hits, 1);
        add(&self.counters.bytes_out, stored);
        Ok(())
    }

    /// DRAM missed: serve from SSD (and promote), or count the miss.
    fn get_from_ssd(&self, key: &[u8], dst: &mut [u8]) -> Result<(), EngineError> {
        let Some(ssd) = &self.ssd else {
            add(&self.counters.misses, 1);
            return Err(EngineError::NotFound);
        };
        match ssd.read_into(key, dst) {
            SsdRead::Hit { depth } => {
                add(&self.counters.hits, 1);
                add(&self.counters.bytes_out, dst.len() as u64);
                if self.config.auto_promote_on_read {
                    self.promote(key, dst, depth);
                }
                Ok(())
            }
            SsdRead::SizeMismatch { stored } => {
                add(&self.counters.size_mismatches, 1);
                Err(EngineError::SizeMismatch {
                    stored,
                    requested: dst.len() as u64,
                })
            }
            SsdRead::Miss | SsdRead::Failed => {
                add(&self.counters.misses, 1);
                Err(EngineError::NotFound)
            }
        }
    }

    /// Copy an object read from SSD back into DRAM (best effort; it is already on SSD, so
    /// it is not queued for a copy). Returns the DRAM object when it was inserted.
    fn promote(&self, key: &[u8], data: &[u8], depth: Option<u32>) -> Option<Arc<Object>> {
        let len = data.len() as u64;
        if self.index.contains(key) || self.dram.blocks_for(len) > self.dram.total_blocks() {
            return None;
        }
        let mut allocation = self.allocate_evicting(len, group_of(key)).ok()?;
        allocation.write(data);
        let object = Arc::new(Object {
            location: Location::Dram(allocation),
            depth,
        });
        let mut shard = self.index.shard(key).write();
        if shard.contains_key(key) {
            return None;
        }
        shard.insert(Box::from(key), Arc::clone(&object));
        self.inserted(key, len, depth);
        add(&self.counters.objects, 1);
        add(&self.counters.bytes_used, len);
        drop(shard);
        self.promotions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(object)
    }

    /// Issue 17: the DRAM arena's address range, `(base, len)`, for a node that registers it
    /// with an RDMA-capable transport (UCX) and lets authenticated peers read pinned objects'
    /// extents ([`PinnedObject::slices`]) in place. The range stays mapped while the engine or
    /// any pin lives; nothing may write to it from outside the engine.
    pub fn dram_memory(&self) -> (*mut u8, usize) {
        self.dram.memory()
    }

    /// Pin an object for reading outside the engine (e.g. straight into a client's shared
    /// memory). Counts a hit or a miss and refreshes recency; copies through the pin count
    /// `bytes_out`. While the pin lives the object's memory cannot be evicted.
    ///
    /// An object only on SSD is read into DRAM first (promoted with `auto_promote_on_read`,
    /// else held in a private DRAM allocation that the pin releases).
    pub fn pin(&self, key: &[u8]) -> Option<PinnedObject> {
        if let (None, Some(ssd)) = (self.index.get(key), &self.ssd) {
            let len = ssd.len_of(key)?;
            let mut data = vec![0u8; usize::try_from(len).ok()?];
            if self.get_from_ssd(key, &mut data).is_err() {
                return None;
            }
            let object = match self.index.get(key) {
                Some(o) => o,
                // In DRAM for the read when there is room; otherwise the bytes already read
                // serve this one pin (a full, pinned DRAM must not turn an SSD hit into a miss).
                None => match self.allocate_evicting(len, group_of(key)) {
                    Ok(mut allocation) => {
                        allocation.write(&data);
                        Arc::new(Object {
                            location: Location::Dram(allocation),
                            depth: None,
                        })
                    }
                    Err(_) => Arc::new(Object {
                        location: Location::Heap(data.into_boxed_slice()),
                        depth: None,
                    }),
                },
            };
            return Some(PinnedObject {
                object,
                counters: Arc::clone(&self.counters),
            });
        }
        match self.index.get(key) {
            Some(object) => {
                self.policy.on_access(key);
                add(&self.counters.hits, 1);
                Some(PinnedObject {
                    object,
                    counters: Arc::clone(&self.counters),
                })
            }
            None => {
                add(&self.counters.misses, 1);
                None
            }
        }
    }

    /// Mark `key` superseded state: a window-state component (SWA, Mamba state) of a page
    /// that a longer restorable chain now continues. The `prefix_depth` policy drops such
    /// objects before whole pages, alone, and from the first hint on treats chains as
    /// restorable only up to their ends (see `eviction::prefix_depth`); `lru` ignores both.
    /// False for a key not in DRAM. A later read of the key clears the mark.
    pub fn demote(&self, key: &[u8]) -> bool {
        // The policy tracks exactly the DRAM keys; it hears every hint, found or not, since
        // the hint also says the chains' shape.
        self.policy.on_demote(key)
    }

    /// Stored length of `key`, without stats or recency side effects.
    pub fn object_len(&self, key: &[u8]) -> Option<u64> {
        let dram = self.index.shard(key).read().get(key).map(|o| o.len());
        dram.or_else(|| self.ssd.as_ref().and_then(|s| s.len_of(key)))
    }

    /// Where `key` is stored: its length in DRAM and on SSD (`None` where absent). No stats
    /// or recency side effects (`kvtier inspect`).
    pub fn placement(&self, key: &[u8]) -> Placement {
        Placement {
            key: key.to_vec(),
            dram_len: self.index.shard(key).read().get(key).map(|o| o.len()),
            ssd_len: self.ssd.as_ref().and_then(|s| s.len_of(key)),
        }
    }

    /// The placements of up to `limit` keys starting with `prefix` in any tier, sorted by key,
    /// and whether more keys matched. Walks every index shard (an operator command, not a
    /// data path); no stats or recency side effects.
    pub fn inspect_prefix(&self, prefix: &[u8], limit: usize) -> (Vec<Placement>, bool) {
        let mut found: std::collections::BTreeMap<Vec<u8>, Placement> = Default::default();
        let mut truncated = false;
        'dram: for shard in self.index.shards() {
            for (key, object) in shard.read().iter() {
                if key.starts_with(prefix) {
                    if found.len() == limit {
                        truncated = true;
                        break 'dram;
                    }
                    found.insert(
                        key.to_vec(),
                        Placement {
                            key: key.to_vec(),
                            dram_len: Some(object.len()),
                            ssd_len: None,
                        },
                    );
                }
            }
        }
        if let Some(ssd) = &self.ssd {
            let (keys, more) = ssd.keys_with_prefix(prefix, limit);
            truncated |= more;
            for (key, len) in keys {
                if let Some(p) = found.get_mut(&key) {
                    p.ssd_len = Some(len);
                } else if found.len() < limit {
                    found.insert(
                        key.clone(),
                        Placement {
                            key,
                            dram_len: None,
                            ssd_len: Some(len),
                        },
                    );
                } else {
                    truncated = true;
                }
            }
        }
        (found.into_values().collect(), truncated)
    }

    /// Whether `key` is stored (in DRAM or on SSD); no stats side effects, no recency change.
    pub fn contains(&self, key: &[u8]) -> bool {
        self.index.contains(key) || self.ssd.as_ref().is_some_and(|s| s.contains(key))
    }

    /// Unlink `key` from every tier. Returns whether it was present. A reader holding it
    /// keeps its memory until the read ends. Counts `evictions_removed` (DRAM) and
    /// `ssd_removed`. On SSD the record is overwritten with a dead marker (synced in strict
    /// mode), so a warm restart does not bring it back.
    pub fn remove(&self, key: &[u8]) -> bool {
        let in_dram = self.remove_dram(key);
        let on_ssd = self.ssd.as_ref().is_some_and(|s| s.remove(key));
        in_dram || on_ssd
    }

    fn remove_dram(&self, key: &[u8]) -> bool {
        let removed = {
            let mut shard = self.index.shard(key).write();
            let Some(object) = shard.remove(key) else {
                return false;
            };
            self.removed(key, EventKind::Removed);
            sub(&self.counters.objects, 1);
            sub(&self.counters.bytes_used, object.len());
            object
        };
        add(&self.counters.evictions_removed, 1);
        drop(removed);
        true
    }

    /// Unlink every object whose key starts with `prefix` from every tier (one tenant's
    /// namespace of a shared store); others are untouched. Returns how many keys were removed.
    /// Walks every index shard: an administrative call, not a data path. Puts running
    /// concurrently may land after their shard was walked.
    pub fn remove_prefix(&self, prefix: &[u8]) -> u64 {
        let mut keys: std::collections::BTreeSet<Vec<u8>> = Default::default();
        for shard in self.index.shards() {
            keys.extend(
                shard
                    .read()
                    .keys()
                    .filter(|k| k.starts_with(prefix))
                    .map(|k| k.to_vec()),
            );
        }
        if let Some(ssd) = &self.ssd {
            keys.extend(
                ssd.keys_with_prefix(prefix, usize::MAX)
                    .0
                    .into_iter()
                    .map(|(k, _)| k),
            );
        }
        keys.iter().filter(|k| self.remove(k)).count() as u64
    }

    /// Unlink every object from every tier (each DRAM object counts in `evictions_removed`,
    /// each SSD object in `ssd_removed`; every SSD segment is marked free on disk). Puts running concurrently
    /// may land after their shard was cleared.
    pub fn clear(&self) {
        for shard in self.index.shards() {
            let drained: Vec<_> = {
                let mut map = shard.write();
                let drained: Vec<_> = map.drain().collect();
                for (key, object) in &drained {
                    self.policy.on_remove(key);
                    sub(&self.counters.objects, 1);
                    sub(&self.counters.bytes_used, object.len());
                }
                drained
            };
            add(&self.counters.evictions_removed, drained.len() as u64);
            // Objects (and their blocks) are released here, outside the shard lock.
            drop(drained);
        }
        // With the SSD tier, `Cleared` is recorded inside its clear, under its mutation lock:
        // a write-through copy racing the clear then cannot leave an `SsdStored` after it
        // for a key the clear wiped.
        match &self.ssd {
            Some(ssd) => ssd.clear(),
            None => self.events.record(EventKind::Cleared, b"", None),
        }
    }

    /// Evaluate a v2 existence query against this engine's index (no side effects). Fails only
    /// for a query over the work bound ([`ExistsV2Query::check_work`]).
    pub fn exists_v2(&self, query: &ExistsV2Query) -> Result<ExistsV2Answer, ProtoError> {
        kvtier_proto::query::evaluate(query, |k| self.contains(k))
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.counters.snapshot();
        let total = self.dram.total_blocks();
        let free = self.dram.free_blocks();
        s.capacity_bytes = self.dram.capacity_bytes();
        s.bytes_allocated = (total - free) * self.dram.block_size();
        if let Some(ssd) = &self.ssd {
            ssd.fill_stats(&mut s);
            s.ssd_promotions = self.promotions.load(std::sync::atomic::Ordering::Relaxed);
        }
        s
    }

    /// Check every invariant this module's docs state that can be checked from outside an
    /// operation: [`Self::verify_accounting`] (allocator, blocks, counters, the policy
    /// tracking exactly the index) and the policy's own bookkeeping
    /// ([`EvictionPolicy::check_invariants`]) and, with the SSD tier on, the tier's index,
    /// segment table and pipeline (`ssd::tier::invariants`). Quiescence only, as for
    /// `verify_accounting`.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.verify_accounting()?;
        self.policy
            .check_invariants()
            .map_err(|e| format!("eviction policy: {e}"))?;
        match &self.ssd {
            Some(ssd) => ssd.check_invariants(),
            None => Ok(()),
        }
    }

    /// The SSD tier, for the unit tests of its invariant checker (which break its state).
    #[cfg(test)]
    pub(crate) fn ssd_tier(&self) -> Option<&SsdTier> {
        self.ssd.as_ref()
    }

    /// Check the engine's accounting: allocator invariants, free + used blocks == capacity,
    /// `objects` / `bytes_used` equal to the index, policy tracking exactly the index.
    ///
    /// Meaningful only at quiescence: an in-flight put or a pin on a removed object holds
    /// blocks that no indexed object accounts for. Locks every shard while it runs.
    pub fn verify_accounting(&self) -> Result<(), String> {
        let guards: Vec<_> = self.index.shards().iter().map(|s| s.read()).collect();
        let (mut objects, mut bytes, mut blocks) = (0u64, 0u64, 0u64);
        for g in &guards {
            for object in g.values() {
                objects += 1;
                bytes += object.len();
                blocks += object.dram_blocks();
                let expect = self.dram.blocks_for(object.len());
                if object.dram_blocks() != expect {
                    return Err(format!(
                        "object of {} bytes holds {} blocks, expected {expect}",
                        object.len(),
                        object.dram_blocks()
                    ));
                }
            }
        }
        let (free, total) = self.dram.check_allocator()?;
        if free + blocks != total {
            return Err(format!(
                "free {free} + used {blocks} blocks != capacity {total}"
            ));
        }
        let s = self.counters.snapshot();
        if s.objects != objects || s.bytes_used != bytes {
            return Err(format!(
                "stats say {} objects / {} bytes, index holds {objects} / {bytes}",
                s.objects, s.bytes_used
            ));
        }
        let tracked = self.policy.len() as u64;
        if tracked != objects {
            return Err(format!(
                "policy tracks {tracked} objects, index holds {objects}"
            ));
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Some(ssd) = &self.ssd {
            if let Err(e) = ssd.flush() {
                tracing::warn!(error = %e, "kvtier: flushing the SSD tier at close failed");
            }
            ssd.shutdown();
        }
    }
}
