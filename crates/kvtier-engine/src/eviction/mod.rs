//! Eviction: which objects to drop when a put needs room.
//!
//! Owns: the [`EvictionPolicy`] trait, page groups ([`group_of`]) and the group recency
//! bookkeeping shared by the policies ([`GroupList`]), the two policies, [`Lru`] and
//! [`PrefixDepth`], and the engine's event log ([`events`]).
//!
//! **Page groups.** One SGLang page is several objects: with a DeepSeek-V4 `HostPoolGroup` a
//! page has SWA, compressed-KV, indexer and compressor-state components (and on MHA a K and a
//! V object, per TP rank). Losing any one component makes the page unrestorable while its
//! siblings keep their memory, so the policies rank and propose whole *groups*, and the
//! engine evicts a group all-or-nothing. The group of a key is derived from the key itself
//! ([`group_of`]), by the key's scheme (`kvtier_proto::keys::KeyScheme`, issue 28): an SGLang
//! key `[tag "/"] page_hash "@" fingerprint ... "." component` groups by tenant plus page hash,
//! shared by every component of that page in every pool; a vLLM block, an LMCache chunk (with
//! its legacy `.meta` sidecar) and any key of no known scheme are a group of their own. The
//! key, not a put-time field, carries the group so that every path (embedded, server,
//! promotion from SSD) agrees without extra plumbing.
//!
//! Contract with the engine (which makes the policy's key set equal to the index's):
//! - `on_insert` / `on_remove` are called while the engine holds the write lock of the key's
//!   index shard, so they are ordered exactly like the index mutations they mirror;
//! - `on_access` may be called without any index lock and may therefore name a key that was
//!   removed meanwhile: policies ignore unknown keys there;
//! - `candidates` proposes groups only; the engine decides (holding the write locks of every
//!   member's shard) whether a group can go, skipping groups with a member pinned by a
//!   reader. A policy never frees anything.
//!
//! Invariants of [`GroupList`]: every tracked key is a member of exactly the group
//! [`group_of`] names; a group is tracked iff it has at least one member; `len()` counts
//! members (objects), so it equals the index size at quiescence.
//!
//! Lock order: index shard(s) → policy → event log. The engine calls `candidates` holding no
//! index lock.

pub mod events;
mod invariants;
mod lru;
mod prefix_depth;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

pub use lru::Lru;
pub use prefix_depth::PrefixDepth;

use crate::config::EvictionPolicyKind;

/// The page group of `key`, as its key scheme names it (store namespace, then an SGLang
/// page's `[tag/]page_hash@`, an LMCache chunk, or the key itself). Defined with the rest of
/// the key schemes in `kvtier_proto::keys` (issues 16, 28).
pub use kvtier_proto::keys::group_of;

/// What an insert or remove did to the key's group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupChange {
    /// The key was the group's first member: the group now exists.
    Created,
    /// The group existed before and still exists.
    Unchanged,
    /// The key was the group's last member: the group is gone.
    Emptied,
    /// The key was not tracked (remove of an unknown key).
    Unknown,
}

/// One group a policy proposes for eviction.
#[derive(Clone, Debug)]
pub struct Victim {
    pub group: Arc<[u8]>,
    /// Member keys when the proposal was made (the engine re-reads them under the locks).
    pub members: Vec<Arc<[u8]>>,
    pub depth: Option<u32>,
    /// Only the group's superseded members go (see [`EvictionPolicy::on_demote`]); the page
    /// stays restorable as the inside of a longer prefix.
    pub partial: bool,
}

/// A replacement policy for one tier. Implementations synchronize internally.
pub trait EvictionPolicy: Send + Sync {
    /// A new object became visible. `size` is its length in bytes; `depth` its page depth in
    /// its prefix chain (0 = first page), when known.
    fn on_insert(&self, key: &[u8], size: u64, depth: Option<u32>) -> GroupChange;
    /// The object was read (or re-put): its whole group becomes most recent. Unknown keys are
    /// ignored.
    fn on_access(&self, key: &[u8]);
    /// The object left the tier (evicted, removed, cleared).
    fn on_remove(&self, key: &[u8]) -> GroupChange;
    /// The caller says `key` is superseded state: a component only the last pages of a chain
    /// need (SGLang's SWA or Mamba state, `TRAILING_PAGES` pools) on a page that a longer,
    /// restorable chain now continues. A policy may drop such members before whole pages
    /// without breaking the group. Unknown keys are ignored; returns whether it was marked.
    /// A later access of the key clears the mark. Any call also tells the policy that the
    /// caller's chains end in window state (restorable only up to such an end).
    fn on_demote(&self, key: &[u8]) -> bool;
    /// Append to `out` the groups of the cold window — the groups ranked `skip .. skip +
    /// window` from least recently used — ordered best victim first. An empty result means no
    /// group is ranked at or beyond `skip`.
    fn candidates(&self, skip: usize, window: usize, out: &mut Vec<Victim>);
    /// The current members of `group` (empty when it is not tracked).
    fn members(&self, group: &[u8]) -> Vec<Arc<[u8]>>;
    /// The current superseded members of `group` (see [`Self::on_demote`]).
    fn demoted(&self, group: &[u8]) -> Vec<Arc<[u8]>>;
    /// Number of objects tracked.
    fn len(&self) -> usize;
    /// Number of groups tracked.
    fn groups(&self) -> usize;
    /// Whether no object is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Check the policy's own bookkeeping (for tests; issue 16): the invariants its docs
    /// state. A policy without checkable state keeps this default.
    fn check_invariants(&self) -> Result<(), String> {
        Ok(())
    }
}

/// Build the policy a config names.
pub fn new_policy(kind: EvictionPolicyKind) -> Box<dyn EvictionPolicy> {
    match kind {
        EvictionPolicyKind::Lru => Box::new(Lru::default()),
        EvictionPolicyKind::PrefixDepth => Box::new(PrefixDepth::default()),
    }
}

/// What a policy remembers about one group.
#[derive(Clone, Debug)]
pub struct GroupInfo {
    /// Logical clock of the last insert or access of any member; unique per group.
    pub tick: u64,
    /// Deepest known depth among the members (they normally agree: one page, one depth).
    pub depth: Option<u32>,
    /// A member was removed while others stayed (an explicit per-key remove): the rest of the
    /// page cannot be restored, so the group is proposed before any other in its window.
    pub broken: bool,
    pub members: Vec<Arc<[u8]>>,
    /// Members marked superseded (a subset of `members`); removing one does not break the
    /// group.
    pub demoted: Vec<Arc<[u8]>>,
}

impl GroupInfo {
    fn victim(&self, group: &Arc<[u8]>) -> Victim {
        Victim {
            group: Arc::clone(group),
            members: self.members.clone(),
            depth: self.depth,
            partial: false,
        }
    }

    /// The superseded members alone, when some but not all members are superseded.
    fn partial_victim(&self, group: &Arc<[u8]>) -> Option<Victim> {
        (!self.demoted.is_empty() && self.demoted.len() < self.members.len()).then(|| Victim {
            group: Arc::clone(group),
            members: self.demoted.clone(),
            depth: self.depth,
            partial: true,
        })
    }

    /// Every member is superseded state: nothing of the page is worth keeping.
    fn all_demoted(&self) -> bool {
        !self.members.is_empty() && self.demoted.len() == self.members.len()
    }
}

/// Groups ordered by recency: O(log n) touch, coldest-first iteration.
///
/// Invariant: `by_tick` and `groups` hold the same groups, `groups[g].tick` is the key of `g`
/// in `by_tick`, and `objects` is the total number of members. Every group with a
/// superseded member is in `superseded` (which may also hold stale entries, skipped when
/// read and dropped by `GroupList::compact_superseded`).
#[derive(Debug, Default)]
pub struct GroupList {
    groups: HashMap<Arc<[u8]>, GroupInfo, foldhash::fast::RandomState>,
    by_tick: BTreeMap<u64, Arc<[u8]>>,
    /// Groups with superseded members, oldest demotion first.
    superseded: VecDeque<Arc<[u8]>>,
    /// A demote hint arrived: the caller's chains carry window state at their ends, so a
    /// chain is restorable only up to an end (see the `prefix_depth` module).
    end_restorable: bool,
    objects: usize,
    clock: u64,
}

impl GroupList {
    fn next_tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn refresh(&mut self, group: &[u8]) {
        let tick = self.clock + 1;
        let Some(info) = self.groups.get_mut(group) else {
            return;
        };
        self.clock = tick;
        if let Some(g) = self.by_tick.remove(&info.tick) {
            self.by_tick.insert(tick, g);
        }
        info.tick = tick;
    }

    /// Track `key` in its group and make the group most recent (re-inserting a member only
    /// refreshes it).
    pub fn insert(&mut self, key: &[u8], depth: Option<u32>) -> GroupChange {
        let group = group_of(key);
        if let Some(info) = self.groups.get_mut(group) {
            if !info.members.iter().any(|m| &**m == key) {
                info.members.push(Arc::from(key));
                self.objects += 1;
            }
            info.depth = info.depth.max(depth);
            self.refresh(group);
            return GroupChange::Unchanged;
        }
        let tick = self.next_tick();
        let group: Arc<[u8]> = Arc::from(group);
        self.by_tick.insert(tick, Arc::clone(&group));
        self.groups.insert(
            group,
            GroupInfo {
                tick,
                depth,
                broken: false,
                members: vec![Arc::from(key)],
                demoted: Vec::new(),
            },
        );
        self.objects += 1;
        GroupChange::Created
    }

    /// Mark the group of `key` most recent and `key` no longer superseded (it was read, so
    /// a request restored up to its page); no-op for unknown keys.
    pub fn touch(&mut self, key: &[u8]) {
        let group = group_of(key);
        let Some(info) = self.groups.get_mut(group) else {
            return;
        };
        if !info.members.iter().any(|m| &**m == key) {
            return;
        }
        info.demoted.retain(|m| &**m != key);
        self.refresh(group);
    }

    /// Mark `key` superseded state (see [`EvictionPolicy::on_demote`]); false for unknown keys.
    /// Any call, even for an unknown key, marks the list `end_restorable`.
    pub fn demote(&mut self, key: &[u8]) -> bool {
        self.end_restorable = true;
        let Some(info) = self.groups.get_mut(group_of(key)) else {
            return false;
        };
        let Some(member) = info.members.iter().find(|m| &***m == key) else {
            return false;
        };
        if !info.demoted.iter().any(|m| &**m == key) {
            info.demoted.push(Arc::clone(member));
            if info.demoted.len() == 1 {
                self.superseded.push_back(Arc::from(group_of(key)));
                if self.superseded.len() > 2 * self.groups.len() + 64 {
                    self.compact_superseded();
                }
            }
        }
        true
    }

    /// Drop stale and repeated entries of the superseded queue, keeping the order.
    fn compact_superseded(&mut self) {
        let mut seen = HashSet::new();
        let groups = &self.groups;
        self.superseded.retain(|g| {
            groups.get(g).is_some_and(|i| !i.demoted.is_empty()) && seen.insert(Arc::clone(g))
        });
    }

    /// Up to `limit` groups whose superseded members can go alone, oldest demotion first.
    pub fn superseded(&self, limit: usize) -> impl Iterator<Item = Victim> + '_ {
        let mut seen = HashSet::new();
        self.superseded
            .iter()
            .filter_map(move |g| {
                let (g, info) = self.groups.get_key_value(g)?;
                if !seen.insert(Arc::clone(g)) {
                    return None;
                }
                info.partial_victim(g)
            })
            .take(limit)
    }

    /// Stop tracking `key`.
    pub fn remove(&mut self, key: &[u8]) -> GroupChange {
        let group = group_of(key);
        let Some(info) = self.groups.get_mut(group) else {
            return GroupChange::Unknown;
        };
        let Some(pos) = info.members.iter().position(|m| &**m == key) else {
            return GroupChange::Unknown;
        };
        info.members.swap_remove(pos);
        self.objects -= 1;
        let superseded = match info.demoted.iter().position(|m| &**m == key) {
            Some(d) => {
                info.demoted.swap_remove(d);
                true
            }
            None => false,
        };
        if !info.members.is_empty() {
            // Dropping superseded state leaves the page whole for longer prefixes.
            info.broken |= !superseded;
            return GroupChange::Unchanged;
        }
        let tick = info.tick;
        self.groups.remove(group);
        self.by_tick.remove(&tick);
        GroupChange::Emptied
    }

    /// Members of `group` now.
    pub fn members(&self, group: &[u8]) -> Vec<Arc<[u8]>> {
        self.groups
            .get(group)
            .map(|g| g.members.clone())
            .unwrap_or_default()
    }

    /// Superseded members of `group` now.
    pub fn demoted(&self, group: &[u8]) -> Vec<Arc<[u8]>> {
        self.groups
            .get(group)
            .map(|g| g.demoted.clone())
            .unwrap_or_default()
    }

    /// Objects tracked.
    pub fn len(&self) -> usize {
        self.objects
    }

    pub fn is_empty(&self) -> bool {
        self.objects == 0
    }

    /// Whether a demote hint ever arrived (see the field).
    pub fn end_restorable(&self) -> bool {
        self.end_restorable
    }

    /// Groups tracked.
    pub fn group_count(&self) -> usize {
        self.groups.len()
    }

    /// Groups ranked `skip .. skip + window` from the coldest, coldest first.
    pub fn coldest(
        &self,
        skip: usize,
        window: usize,
    ) -> impl Iterator<Item = (&Arc<[u8]>, &GroupInfo)> + '_ {
        self.by_tick
            .values()
            .skip(skip)
            .take(window)
            .filter_map(|g| self.groups.get_key_value(g))
    }
}

/// The shared body of both policies: a [`GroupList`] behind a mutex plus an ordering of the
/// cold window. Implementing it implements [`EvictionPolicy`].
pub trait GroupPolicy: Send + Sync {
    fn list(&self) -> &parking_lot::Mutex<GroupList>;
    /// Append the groups ranked `skip .. skip + window` to `out`, best victim first.
    fn order(list: &GroupList, skip: usize, window: usize, out: &mut Vec<Victim>);
}

impl<P: GroupPolicy> EvictionPolicy for P {
    fn on_insert(&self, key: &[u8], _size: u64, depth: Option<u32>) -> GroupChange {
        self.list().lock().insert(key, depth)
    }

    fn on_access(&self, key: &[u8]) {
        self.list().lock().touch(key);
    }

    fn on_remove(&self, key: &[u8]) -> GroupChange {
        self.list().lock().remove(key)
    }

    fn on_demote(&self, key: &[u8]) -> bool {
        self.list().lock().demote(key)
    }

    fn candidates(&self, skip: usize, window: usize, out: &mut Vec<Victim>) {
        P::order(&self.list().lock(), skip, window, out);
    }

    fn members(&self, group: &[u8]) -> Vec<Arc<[u8]>> {
        self.list().lock().members(group)
    }

    fn demoted(&self, group: &[u8]) -> Vec<Arc<[u8]>> {
        self.list().lock().demoted(group)
    }

    fn len(&self) -> usize {
        self.list().lock().len()
    }

    fn groups(&self) -> usize {
        self.list().lock().group_count()
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.list().lock().check_invariants()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(p: &dyn EvictionPolicy, skip: usize, window: usize) -> Vec<String> {
        let mut out = Vec::new();
        p.candidates(skip, window, &mut out);
        out.iter()
            .map(|v| String::from_utf8(v.group.to_vec()).unwrap())
            .collect()
    }

    #[test]
    fn group_of_is_tag_and_page_hash() {
        assert_eq!(group_of(b"t/abc@fp1.tp0.swa"), b"t/abc@");
        assert_eq!(group_of(b"abc@fp2.c4.c0"), b"abc@");
        assert_eq!(group_of(b"plain-key"), b"plain-key");
        assert_eq!(group_of(b"@x"), b"@x");
        // Issue 28: LMCache keys are one group per chunk, not one per model.
        assert_eq!(group_of(b"lmcache/m@0@0@0a"), b"lmcache/m@0@0@0a");
    }

    #[test]
    fn lru_orders_by_recency_and_ignores_unknown() {
        let p = Lru::default();
        for k in ["a", "b", "c", "d"] {
            assert_eq!(p.on_insert(k.as_bytes(), 1, None), GroupChange::Created);
        }
        p.on_access(b"a");
        p.on_access(b"zzz");
        assert_eq!(p.on_remove(b"c"), GroupChange::Emptied);
        assert_eq!(p.on_remove(b"nope"), GroupChange::Unknown);
        assert_eq!(keys(&p, 0, 10), ["b", "d", "a"]);
        assert_eq!(keys(&p, 0, 2), ["b", "d"]);
        assert_eq!(keys(&p, 2, 2), ["a"]);
        assert!(keys(&p, 3, 2).is_empty());
        assert_eq!(p.len(), 3);
    }

    #[test]
    fn components_of_a_page_form_one_group() {
        let p = Lru::default();
        assert_eq!(p.on_insert(b"h1@f.swa", 10, Some(2)), GroupChange::Created);
        assert_eq!(p.on_insert(b"h2@f.swa", 10, Some(3)), GroupChange::Created);
        assert_eq!(p.on_insert(b"h1@g.c4", 10, Some(2)), GroupChange::Unchanged);
        // Re-inserting a member refreshes it without counting it twice.
        assert_eq!(p.on_insert(b"h1@g.c4", 10, Some(2)), GroupChange::Unchanged);
        assert_eq!((p.len(), p.groups()), (3, 2));
        // Touching any member refreshes the whole group: h2 is now the coldest.
        let mut out = Vec::new();
        p.candidates(0, 10, &mut out);
        assert_eq!(&*out[0].group, b"h2@");
        assert_eq!(&*out[1].group, b"h1@");
        let mut members: Vec<_> = out[1].members.iter().map(|m| m.to_vec()).collect();
        members.sort();
        assert_eq!(members, [b"h1@f.swa".to_vec(), b"h1@g.c4".to_vec()]);
        // Removing one member leaves a broken group; removing the last empties it.
        assert_eq!(p.on_remove(b"h1@f.swa"), GroupChange::Unchanged);
        assert_eq!(p.on_remove(b"h1@g.c4"), GroupChange::Emptied);
        assert_eq!((p.len(), p.groups()), (1, 1));
        assert!(p.members(b"h1@").is_empty());
    }

    #[test]
    fn prefix_depth_prefers_deep_pages_within_the_window() {
        let p = PrefixDepth::default();
        // Inserted oldest first: chain pages 0..4, then an unknown-depth object.
        for d in 0..4u32 {
            p.on_insert(format!("p{d}").as_bytes(), 1, Some(d));
        }
        p.on_insert(b"u", 1, None);
        p.on_insert(b"q3", 1, Some(3));
        assert_eq!(keys(&p, 0, 10), ["p3", "q3", "p2", "p1", "p0", "u"]);
        // The window bounds the choice: only the 2 coldest are considered.
        assert_eq!(keys(&p, 0, 2), ["p1", "p0"]);
        // Touching p3 makes it more recent than q3, so the depth-3 tie now goes to q3.
        p.on_access(b"p3");
        assert_eq!(keys(&p, 0, 10), ["q3", "p3", "p2", "p1", "p0", "u"]);
    }

    #[test]
    fn the_cold_window_is_a_small_share_of_the_groups() {
        let p = PrefixDepth::default();
        for d in 0..10u32 {
            p.on_insert(format!("c{d}").as_bytes(), 1, Some(d));
        }
        // Chains restorable at every page (no window state): the whole window competes.
        assert_eq!(keys(&p, 0, 64).len(), 10);
        // Once a demote hint says chains end in window state, few groups: even a window of
        // 64 looks at the 2 coldest only, so the newest (and deepest) pages of the chain
        // being written are not proposed.
        assert!(!p.on_demote(b"unknown"));
        assert_eq!(keys(&p, 0, 64), ["c1", "c0"]);
        assert_eq!(keys(&p, 2, 64), ["c3", "c2"]);
        // Plain LRU has no cap: its window is the one asked for.
        let l = Lru::default();
        for d in 0..10u32 {
            l.on_insert(format!("c{d}").as_bytes(), 1, Some(d));
        }
        assert_eq!(keys(&l, 0, 64).len(), 10);
    }

    #[test]
    fn superseded_state_goes_first_and_alone() {
        let p = PrefixDepth::default();
        // Page a: KV-side component + window state; page b (hot) the same.
        p.on_insert(b"a@f.kv", 1, Some(0));
        p.on_insert(b"a@f.swa", 8, Some(0));
        p.on_insert(b"b@f.kv", 1, Some(0));
        p.on_insert(b"b@f.swa", 8, Some(0));
        assert!(p.on_demote(b"b@f.swa"));
        assert!(!p.on_demote(b"nope@f.swa"), "unknown keys are not marked");
        let mut out = Vec::new();
        p.candidates(0, 64, &mut out);
        // b's superseded state is proposed first although b is the hottest page.
        assert!(out[0].partial);
        assert_eq!(&*out[0].group, b"b@");
        assert_eq!(out[0].members.len(), 1);
        assert_eq!(&*out[0].members[0], b"b@f.swa");
        assert!(out[1..].iter().all(|v| !v.partial));
        // Dropping it leaves b whole (a broken b would go first): the colder a leads.
        assert_eq!(p.on_remove(b"b@f.swa"), GroupChange::Unchanged);
        let mut out = Vec::new();
        p.candidates(0, 64, &mut out);
        assert_eq!(&*out[0].group, b"a@");
        assert!(!out[0].partial);
        assert!(p.demoted(b"b@").is_empty());
        // A read of demoted state clears the mark; an unmarked group has no partial victim.
        assert!(p.on_demote(b"a@f.swa"));
        p.on_access(b"a@f.swa");
        let mut out = Vec::new();
        p.candidates(0, 64, &mut out);
        assert!(out.iter().all(|v| !v.partial));
        // A page whose every member is superseded goes whole, ahead of the others.
        assert!(p.on_demote(b"b@f.kv"));
        let mut out = Vec::new();
        p.candidates(0, 64, &mut out);
        assert_eq!(&*out[0].group, b"b@");
        assert!(!out[0].partial);
    }

    #[test]
    fn lru_ignores_the_demote_hint() {
        let l = Lru::default();
        l.on_insert(b"a@f.kv", 1, None);
        l.on_insert(b"b@f.kv", 1, None);
        l.on_insert(b"b@f.swa", 1, None);
        assert!(l.on_demote(b"b@f.swa"));
        let mut out = Vec::new();
        l.candidates(0, 64, &mut out);
        assert!(out.iter().all(|v| !v.partial));
        assert_eq!(&*out[0].group, b"a@");
    }

    #[test]
    fn the_superseded_queue_stays_bounded() {
        let p = PrefixDepth::default();
        p.on_insert(b"a@f.kv", 1, None);
        p.on_insert(b"a@f.swa", 1, None);
        // Demote, read (clears), demote again, many times: stale entries are compacted.
        for _ in 0..10_000 {
            assert!(p.on_demote(b"a@f.swa"));
            p.on_access(b"a@f.swa");
        }
        assert!(p.list().lock().superseded.len() <= 2 + 64);
        assert!(p.on_demote(b"a@f.swa"));
        let mut out = Vec::new();
        p.candidates(0, 64, &mut out);
        assert_eq!(out.iter().filter(|v| v.partial).count(), 1);
    }

    #[test]
    fn broken_groups_go_first() {
        for p in [
            Box::new(Lru::default()) as Box<dyn EvictionPolicy>,
            Box::new(PrefixDepth::default()),
        ] {
            p.on_insert(b"a@x.1", 1, Some(5));
            p.on_insert(b"b@x.1", 1, Some(0));
            p.on_insert(b"b@x.2", 1, Some(0));
            p.on_remove(b"b@x.2");
            assert_eq!(keys(&*p, 0, 10), ["b@", "a@"]);
        }
    }
}
