//! Plain least-recently-used: the coldest object goes first.

use std::sync::Arc;

use parking_lot::Mutex;

use super::{EvictionPolicy, RecencyList};

/// Least-recently-used eviction.
#[derive(Debug, Default)]
pub struct Lru {
    list: Mutex<RecencyList>,
}

impl EvictionPolicy for Lru {
    fn on_insert(&self, key: &[u8], size: u64, depth: Option<u32>) {
        self.list.lock().insert(key, size, depth);
    }

    fn on_access(&self, key: &[u8]) {
        self.list.lock().touch(key);
    }

    fn on_remove(&self, key: &[u8]) {
        self.list.lock().remove(key);
    }

    fn candidates(&self, skip: usize, window: usize, out: &mut Vec<Arc<[u8]>>) {
        let list = self.list.lock();
        out.extend(list.coldest(skip, window).map(|(k, _)| Arc::clone(k)));
    }

    fn len(&self) -> usize {
        self.list.lock().len()
    }
}
