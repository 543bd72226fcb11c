//! The SSD tier's index: key -> [`SsdEntry`] (where the object's current record lives), in
//! `RwLock` shards by key hash.
//!
//! Owns: the mapping from keys to records. Invariant: an entry names a record of its segment's
//! current generation that was fully written and synced as required by the durability mode
//! before it was published here; an entry is removed (or replaced) before its segment is
//! recycled.

use super::*;

/// Where one object's record lives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SsdEntry {
    pub seg: u32,
    pub generation: u64,
    pub loc: RecordLoc,
}

pub(super) type Hasher = foldhash::fast::RandomState;
pub(super) type Shard = HashMap<Arc<[u8]>, SsdEntry, Hasher>;

pub(super) struct SsdIndex {
    pub(super) shards: Box<[RwLock<Shard>]>,
    pub(super) mask: usize,
    pub(super) hasher: Hasher,
}

impl SsdIndex {
    pub(super) fn new(shards: usize) -> SsdIndex {
        let hasher = Hasher::default();
        SsdIndex {
            shards: (0..shards)
                .map(|_| RwLock::new(HashMap::with_hasher(hasher.clone())))
                .collect(),
            mask: shards - 1,
            hasher,
        }
    }
    pub(super) fn shard(&self, key: &[u8]) -> &RwLock<Shard> {
        let h = self.hasher.hash_one(key);
        &self.shards[((h >> 32) as usize) & self.mask]
    }
    pub(super) fn get(&self, key: &[u8]) -> Option<SsdEntry> {
        self.shard(key).read().get(key).copied()
    }
}
