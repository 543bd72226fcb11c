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
//! exactly LRU. Broken groups (a member removed) go first.
//!
//! **The cold window** keeps a hot deep page from being evicted before a cold head: only
//! groups already among the coldest compete. It is `eviction_candidate_window` groups. For
//! chains that end in window state (the caller sends demote hints: DeepSeek-V4 SWA, Mamba
//! state), it is also never more than 1/[`COLD_SHARE`] of the groups tracked (at least 2):
//! such a chain is restorable only up to an end, so evicting its deepest page loses the
//! whole chain, not one page, and when the cache holds only a few requests' pages a window
//! of 64 covers the request being written, whose just-stored tail is the deepest page.
//! Measured with `kvtier bench workload` (DeepSeek-V4 pools, 3 trace seeds): the fixed
//! 64-group window lost to LRU below ~12 % of the working set; the capped one is ahead at
//! every budget from 6 % to 48 % (README). Chains restorable at every page (MHA, MLA) keep
//! the whole window: there the deepest page costs one page.
//!
//! **Superseded state goes first**, from the whole list, oldest demotion first: members the
//! caller demoted (SWA / Mamba state of a page that a longer restorable chain now continues,
//! see [`super::EvictionPolicy::on_demote`]) are dropped alone. The page stays restorable as
//! the inside of the longer prefix without them, and on DeepSeek-V4 that state is ~8x the
//! bytes of the page's KV-side components. They are proposed before broken groups only in
//! the first window of a pass (`skip == 0`).

use parking_lot::Mutex;

use super::{GroupList, GroupPolicy, Victim};

/// The cold window covers at most this fraction (1/N) of the groups tracked.
pub const COLD_SHARE: usize = 24;

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
        let window = if list.end_restorable() {
            window.min((list.group_count() / COLD_SHARE).max(2))
        } else {
            window
        };
        if skip == 0 {
            out.extend(list.superseded(window));
        }
        let mut picked: Vec<(bool, u32, u64, Victim)> = list
            .coldest(skip, window)
            .map(|(g, info)| {
                (
                    info.broken || info.all_demoted(),
                    info.depth.unwrap_or(0),
                    info.tick,
                    info.victim(g),
                )
            })
            .collect();
        // Broken (or wholly superseded) first; then deepest first; equal depth → least
        // recent (smallest tick) first.
        picked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        out.extend(picked.into_iter().map(|(_, _, _, v)| v));
    }
}
