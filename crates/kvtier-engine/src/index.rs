//! The sharded index: key → `Arc<Object>`.
//!
//! Owns: which objects are visible. A key is in the index iff its object is fully written and
//! not yet evicted or removed.
//!
//! Sharding: the shard is picked from bits 32.. of a per-process seeded foldhash of the key. The maps inside
//! use the same hash function; hashbrown takes its bucket from the low bits and its tag from
//! the top 7, so the shard bits do not correlate with either within a shard.
//!
//! Locking: readers clone the `Arc` under the shard's read lock and copy after releasing it.
//! Anything that takes an object out (evict, remove, clear) holds the write lock, so "strong
//! count == 1 under the write lock" reliably means "no reader holds it".

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;

use parking_lot::RwLock;

use crate::object::Object;

pub(crate) type Hasher = foldhash::fast::RandomState;
pub(crate) type Shard = HashMap<Box<[u8]>, Arc<Object>, Hasher>;

pub(crate) struct Index {
    shards: Box<[RwLock<Shard>]>,
    mask: usize,
    hasher: Hasher,
}

impl Index {
    /// `shards` must be a power of two (validated by the config).
    pub(crate) fn new(shards: usize) -> Index {
        debug_assert!(shards.is_power_of_two());
        let hasher = Hasher::default();
        Index {
            shards: (0..shards)
                .map(|_| RwLock::new(HashMap::with_hasher(hasher.clone())))
                .collect(),
            mask: shards - 1,
            hasher,
        }
    }

    pub(crate) fn shard(&self, key: &[u8]) -> &RwLock<Shard> {
        let h = self.hasher.hash_one(key);
        &self.shards[((h >> 32) as usize) & self.mask]
    }

    pub(crate) fn shards(&self) -> &[RwLock<Shard>] {
        &self.shards
    }

    /// Clone the object's `Arc` (a pin) under the read lock.
    pub(crate) fn get(&self, key: &[u8]) -> Option<Arc<Object>> {
        self.shard(key).read().get(key).cloned()
    }

    pub(crate) fn contains(&self, key: &[u8]) -> bool {
        self.shard(key).read().contains_key(key)
    }
}
