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

use std::sync::Arc;

use kvtier_proto::{ExistsV2Answer, ExistsV2Query};

use crate::config::EngineConfig;
use crate::dram::{DramAllocation, DramTier};
use crate::error::EngineError;
use crate::eviction::{new_policy, EvictionPolicy};
use crate::index::Index;
use crate::object::{Location, Object, PinnedObject};
use crate::stats::{add, sub, Counters, EngineStats};

/// Extra facts about a put.
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
    index: Index,
    policy: Box<dyn EvictionPolicy>,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Validate `config`, map (and pre-fault) the arena.
    pub fn open(config: EngineConfig) -> Result<Engine, EngineError> {
        config.validate()?;
        // validate() bounds total_blocks by u32::MAX.
        let blocks =
            u32::try_from(config.total_blocks()).map_err(|_| EngineError::InvalidConfig {
                key: "dram_capacity_bytes",
                reason: "too many blocks".into(),
            })?;
        let dram = DramTier::open(blocks, config.dram_block_size, config.prefault)
            .map_err(EngineError::ArenaMap)?;
        Ok(Engine {
            index: Index::new(config.index_shards),
            policy: new_policy(config.eviction_policy),
            dram,
            counters: Arc::default(),
            config,
        })
    }

    /// The configuration this engine was opened with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Put-if-absent. An existing key is `Ok(AlreadyPresent)` with no copy (a dedup skip; it
    /// also counts as an access for recency). The object becomes visible only after its bytes
    /// are fully copied. Evicts cold objects to make room; `NoSpace` if every object that could
    /// go is pinned (the put fails and nothing else is lost).
    pub fn put(&self, key: &[u8], value: &[u8], meta: PutMeta) -> Result<PutOutcome, EngineError> {
        let result = self.put_inner(key, value, meta);
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
        let mut allocation = self.allocate_evicting(len)?;
        allocation.write(value);
        let object = Arc::new(Object {
            location: Location::Dram(allocation),
        });

        let mut shard = self.index.shard(key).write();
        if shard.contains_key(key) {
            drop(shard);
            // A concurrent put of the same key won; `object` drops here, freeing our blocks.
            drop(object);
            add(&self.counters.dedup_skips, 1);
            return Ok(PutOutcome::AlreadyPresent);
        }
        shard.insert(Box::from(key), object);
        self.policy.on_insert(key, len, meta.depth);
        add(&self.counters.objects, 1);
        add(&self.counters.bytes_used, len);
        drop(shard);
        add(&self.counters.puts, 1);
        add(&self.counters.bytes_in, len);
        Ok(PutOutcome::Stored)
    }

    /// Allocate `len` bytes, evicting cold unpinned objects until it fits.
    ///
    /// Each round asks the policy for one cold window. If the round evicted something, the
    /// next starts again from the coldest; if everything in it was pinned, the next looks at
    /// the following window. Running past the last object means everything is pinned.
    fn allocate_evicting(&self, len: u64) -> Result<DramAllocation, EngineError> {
        let needed_blocks = self.dram.blocks_for(len);
        let window = self.config.eviction_candidate_window;
        let mut skip = 0;
        let mut candidates = Vec::with_capacity(window);
        loop {
            if let Some(a) = self.dram.try_allocate(len) {
                return Ok(a);
            }
            candidates.clear();
            self.policy.candidates(skip, window, &mut candidates);
            if candidates.is_empty() {
                return Err(EngineError::NoSpace { needed: len });
            }
            let mut evicted_any = false;
            for key in &candidates {
                if self.try_evict(key) {
                    evicted_any = true;
                    if self.dram.free_blocks() >= needed_blocks {
                        break;
                    }
                }
            }
            skip = if evicted_any {
                0
            } else {
                skip + candidates.len()
            };
        }
    }

    /// Evict `key` if only the index holds it. Returns whether it was evicted.
    fn try_evict(&self, key: &[u8]) -> bool {
        let victim = {
            let mut shard = self.index.shard(key).write();
            match shard.get(key) {
                Some(o) if Arc::strong_count(o) == 1 => {}
                _ => return false,
            }
            let Some(victim) = shard.remove(key) else {
                return false;
            };
            self.policy.on_remove(key);
            sub(&self.counters.objects, 1);
            sub(&self.counters.bytes_used, victim.len());
            victim
        };
        add(&self.counters.evictions_capacity, 1);
        add(&self.counters.evicted_bytes, victim.len());
        // Sole owner: dropping returns the blocks to the allocator now.
        drop(victim);
        true
    }

    /// Copy the whole object into `dst`. `dst.len()` must equal the stored length, else
    /// `SizeMismatch` and `dst` is untouched. A missing key is `NotFound`. Counts a hit (with
    /// `bytes_out`) or a miss; a size mismatch counts only `size_mismatches`.
    pub fn get_into(&self, key: &[u8], dst: &mut [u8]) -> Result<(), EngineError> {
        let Some(object) = self.index.get(key) else {
            add(&self.counters.misses, 1);
            return Err(EngineError::NotFound);
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

    /// Pin an object for reading outside the engine (e.g. straight into a client's shared
    /// memory). Counts a hit or a miss and refreshes recency; copies through the pin count
    /// `bytes_out`. While the pin lives the object's memory cannot be evicted.
    pub fn pin(&self, key: &[u8]) -> Option<PinnedObject> {
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

    /// Stored length of `key`, without stats or recency side effects.
    pub fn object_len(&self, key: &[u8]) -> Option<u64> {
        self.index.shard(key).read().get(key).map(|o| o.len())
    }

    /// Whether `key` is stored; no stats side effects, no recency change.
    pub fn contains(&self, key: &[u8]) -> bool {
        self.index.contains(key)
    }

    /// Unlink `key`. Returns whether it was present. A reader holding it keeps its memory
    /// until the read ends. Counts `evictions_removed`.
    pub fn remove(&self, key: &[u8]) -> bool {
        let removed = {
            let mut shard = self.index.shard(key).write();
            let Some(object) = shard.remove(key) else {
                return false;
            };
            self.policy.on_remove(key);
            sub(&self.counters.objects, 1);
            sub(&self.counters.bytes_used, object.len());
            object
        };
        add(&self.counters.evictions_removed, 1);
        drop(removed);
        true
    }

    /// Unlink every object (each counts in `evictions_removed`). Puts running concurrently
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
    }

    /// Evaluate a v2 existence query against this engine's index (no side effects).
    pub fn exists_v2(&self, query: &ExistsV2Query) -> ExistsV2Answer {
        kvtier_proto::query::evaluate(query, |k| self.contains(k))
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.counters.snapshot();
        let total = self.dram.total_blocks();
        let free = self.dram.free_blocks();
        s.capacity_bytes = self.dram.capacity_bytes();
        s.bytes_allocated = (total - free) * self.dram.block_size();
        s
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
