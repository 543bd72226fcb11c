//! Prefix-depth eviction: drop the tail of a prefix chain before its head.
//!
//! A request can only reuse page `d` of a chain if pages `0..d` are also cached, so the deep
//! pages are the least valuable: losing page 0 makes every later page useless, losing the last
//! page costs one page. Among the `window` least recently used objects, the policy therefore
//! proposes the greatest depth first, ties broken by recency (least recent first).
//!
//! Objects without a known depth count as depth 0: they are evicted after the deeper pages of
//! the window and, among depth-0 objects, in LRU order. With no depths at all the policy is
//! exactly LRU. The window keeps a hot deep page from being evicted before a cold head: only
//! objects already among the coldest compete.

use std::sync::Arc;

use parking_lot::Mutex;

use super::{EvictionPolicy, RecencyList};

/// Prefix-chain-aware eviction within a cold LRU window.
#[derive(Debug, Default)]
pub struct PrefixDepth {
    list: Mutex<RecencyList>,
}

impl EvictionPolicy for PrefixDepth {
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
        let mut picked: Vec<(u32, u64, &Arc<[u8]>)> = list
            .coldest(skip, window)
            .map(|(k, info)| (info.depth.unwrap_or(0), info.tick, k))
            .collect();
        // Deepest first; equal depth → least recent (smallest tick) first.
        picked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        out.extend(picked.into_iter().map(|(_, _, k)| Arc::clone(k)));
    }

    fn len(&self) -> usize {
        self.list.lock().len()
    }
}
