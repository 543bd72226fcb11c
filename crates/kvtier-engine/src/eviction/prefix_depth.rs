//! Prefix-depth eviction: drop the tail of a prefix chain before its head.
//!
//! A request can only reuse page `d` of a chain if pages `0..d` are also cached, so the deep
//! pages are the least valuable: losing page 0 makes every later page useless, losing the last
//! page costs one page. Among the `window` least recently used page groups, the policy
//! therefore proposes the greatest depth first, ties broken by recency (least recent first).
//! A page is a group of objects (see the module `eviction`), so a page's components always go
//! together.
//!
//! Groups without a known depth count as depth 0: they are evicted after the deeper pages of
//! the window and, among depth-0 groups, in LRU order. With no depths at all the policy is
//! exactly LRU. The window keeps a hot deep page from being evicted before a cold head: only
//! groups already among the coldest compete. Broken groups (a member removed) go first.

use parking_lot::Mutex;

use super::{GroupList, GroupPolicy, Victim};

/// Prefix-chain-aware eviction of page groups within a cold LRU window.
#[derive(Debug, Default)]
pub struct PrefixDepth {
    list: Mutex<GroupList>,
}

impl GroupPolicy for PrefixDepth {
    fn list(&self) -> &Mutex<GroupList> {
        &self.list
    }

    fn order(list: &GroupList, skip: usize, window: usize, out: &mut Vec<Victim>) {
        let mut picked: Vec<(bool, u32, u64, Victim)> = list
            .coldest(skip, window)
            .map(|(g, info)| {
                (
                    info.broken,
                    info.depth.unwrap_or(0),
                    info.tick,
                    info.victim(g),
                )
            })
            .collect();
        // Broken first; then deepest first; equal depth → least recent (smallest tick) first.
        picked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        out.extend(picked.into_iter().map(|(_, _, _, v)| v));
    }
}
