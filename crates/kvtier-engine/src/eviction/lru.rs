//! Plain least-recently-used over page groups: the coldest group goes first.

use parking_lot::Mutex;

use super::{GroupList, GroupPolicy, Victim};

/// Least-recently-used eviction of whole page groups.
#[derive(Debug, Default)]
pub struct Lru {
    list: Mutex<GroupList>,
}

impl GroupPolicy for Lru {
    fn list(&self) -> &Mutex<GroupList> {
        &self.list
    }

    /// Broken groups first, then coldest first.
    fn order(list: &GroupList, skip: usize, window: usize, out: &mut Vec<Victim>) {
        let mut picked: Vec<(bool, u64, Victim)> = list
            .coldest(skip, window)
            .map(|(g, info)| (info.broken, info.tick, info.victim(g)))
            .collect();
        picked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        out.extend(picked.into_iter().map(|(_, _, v)| v));
    }
}
