//! [`GroupList::check_invariants`]: the invariants of the `eviction` module docs and of
//! [`GroupList`] as code, for the model and stress tests (through
//! [`super::EvictionPolicy::check_invariants`] and [`crate::Engine::check_invariants`]).

use std::collections::HashSet;

use super::{group_of, GroupList};

impl GroupList {
    /// Check the list's invariants; the first one broken is the error.
    ///
    /// - `by_tick` and `groups` hold the same groups, `groups[g].tick` is `g`'s key in
    ///   `by_tick`, and no tick is ahead of the clock;
    /// - a group is tracked iff it has a member; every member is in exactly the group
    ///   [`group_of`] names, once;
    /// - superseded members are members, and every group with one is in the superseded queue;
    /// - `objects` (what `len()` reports) is the number of members.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.by_tick.len() != self.groups.len() {
            return Err(format!(
                "{} groups but {} recency entries",
                self.groups.len(),
                self.by_tick.len()
            ));
        }
        let queued: HashSet<&[u8]> = self.superseded.iter().map(|g| &**g).collect();
        let mut members = 0usize;
        for (group, info) in &self.groups {
            if self.by_tick.get(&info.tick).map(|g| &**g) != Some(&**group) {
                return Err(format!(
                    "group {group:?}: tick {} not its recency key",
                    info.tick
                ));
            }
            if info.tick > self.clock {
                return Err(format!(
                    "group {group:?}: tick {} after the clock",
                    info.tick
                ));
            }
            if info.members.is_empty() {
                return Err(format!("group {group:?} is tracked with no member"));
            }
            for (i, m) in info.members.iter().enumerate() {
                if group_of(m) != &**group {
                    return Err(format!("member {m:?} filed under group {group:?}"));
                }
                if info.members[..i].contains(m) {
                    return Err(format!("member {m:?} tracked twice"));
                }
            }
            for d in &info.demoted {
                if !info.members.contains(d) {
                    return Err(format!("superseded {d:?} is not a member of {group:?}"));
                }
            }
            if !info.demoted.is_empty() && !queued.contains(&**group) {
                return Err(format!(
                    "group {group:?} has superseded members but is not queued"
                ));
            }
            members += info.members.len();
        }
        if members != self.objects {
            return Err(format!(
                "{members} members but the count says {}",
                self.objects
            ));
        }
        Ok(())
    }
}
