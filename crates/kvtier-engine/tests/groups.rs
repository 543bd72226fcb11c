//! Page-group eviction, chain-tail-first order, pins, and the event log.
//!
//! Keys follow kvtier's scheme `page_hash@fingerprint.component`: one page = several objects
//! (a DeepSeek-V4-style page has SWA, compressed-KV and indexer components), and eviction must
//! take a page's components together.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeSet, HashMap};

use common::{engine, value_for, BS};
use kvtier_engine::eviction::events::EventKind;
use kvtier_engine::{Engine, EvictionPolicyKind, PutMeta};
use proptest::prelude::*;

use EvictionPolicyKind::{Lru, PrefixDepth};

/// Components of one page, with their sizes in blocks: three pools, three fingerprints.
const COMPONENTS: [(&str, usize); 3] = [("fa.swa", 1), ("fb.c4", 1), ("fc.c4_indexer", 1)];

fn page_keys(page: &str) -> Vec<String> {
    COMPONENTS
        .iter()
        .map(|(c, _)| format!("{page}@{c}"))
        .collect()
}

fn put_page(e: &Engine, page: &str, depth: u32) {
    for (key, (_, blocks)) in page_keys(page).iter().zip(COMPONENTS) {
        let v = value_for(key.as_bytes(), blocks * BS);
        e.put(key.as_bytes(), &v, PutMeta { depth: Some(depth) })
            .unwrap_or_else(|err| panic!("put {key}: {err}"));
    }
}

/// How many components of `page` are stored; panics if the page is partial.
fn page_state(e: &Engine, page: &str) -> bool {
    let present: Vec<bool> = page_keys(page)
        .iter()
        .map(|k| e.contains(k.as_bytes()))
        .collect();
    assert!(
        present.iter().all(|&p| p) || present.iter().all(|&p| !p),
        "page {page} is partial: {present:?}"
    );
    present[0]
}

fn read_page(e: &Engine, page: &str) {
    for (key, (_, blocks)) in page_keys(page).iter().zip(COMPONENTS) {
        let mut dst = vec![0u8; blocks * BS];
        e.get_into(key.as_bytes(), &mut dst).unwrap();
        assert_eq!(dst, value_for(key.as_bytes(), blocks * BS));
    }
}

#[test]
fn a_page_is_evicted_whole_under_both_policies() {
    for policy in [Lru, PrefixDepth] {
        // 12 blocks = 4 pages of 3 components.
        let e = engine(12, policy, 64);
        for p in 0..10 {
            put_page(&e, &format!("h{p}"), p);
            for q in 0..=p {
                page_state(&e, &format!("h{q}"));
            }
            e.verify_accounting().unwrap();
        }
        let stored: Vec<bool> = (0..10).map(|p| page_state(&e, &format!("h{p}"))).collect();
        assert_eq!(
            stored.iter().filter(|&&s| s).count(),
            4,
            "{policy:?}: {stored:?}"
        );
        let (groups_evicted, groups) = e.group_stats();
        assert_eq!((groups_evicted, groups), (6, 4), "{policy:?}");
        assert_eq!(
            e.stats().evictions_capacity,
            18,
            "{policy:?}: 6 pages x 3 objects"
        );
    }
}

/// Chain A (depths 0..4, 3 components per page) fills the arena; touching A in order (as a
/// prefetch does: head first) then storing chain B (2 pages) needs 2 pages of room.
fn chains(policy: EvictionPolicyKind) -> Vec<bool> {
    let e = engine(12, policy, 64);
    for d in 0..4 {
        put_page(&e, &format!("A{d}"), d);
    }
    for d in 0..4 {
        read_page(&e, &format!("A{d}"));
    }
    for d in 0..2 {
        put_page(&e, &format!("B{d}"), d);
    }
    e.verify_accounting().unwrap();
    assert!(page_state(&e, "B0") && page_state(&e, "B1"));
    (0..4).map(|d| page_state(&e, &format!("A{d}"))).collect()
}

#[test]
fn prefix_depth_evicts_the_tail_of_a_chain_first_whole_pages() {
    // The head of A stays restorable: pages 0 and 1 with every component.
    assert_eq!(chains(PrefixDepth), [true, true, false, false]);
    // LRU drops the head (touched first), leaving A's tail unrestorable but resident.
    assert_eq!(chains(Lru), [false, false, true, true]);
}

#[test]
fn a_pinned_component_keeps_its_whole_page() {
    for policy in [Lru, PrefixDepth] {
        let e = engine(6, policy, 64);
        put_page(&e, "p0", 0);
        put_page(&e, "p1", 0);
        // p0 is the coldest; a reader holds one of its components.
        let pin = e.pin(b"p0@fb.c4").unwrap();
        read_page(&e, "p1"); // p1 is now the most recent: p0 is the first candidate
        put_page(&e, "p2", 0);
        assert!(
            page_state(&e, "p0"),
            "{policy:?}: the pinned page stays whole"
        );
        assert!(
            !page_state(&e, "p1"),
            "{policy:?}: the next group went instead"
        );
        let mut dst = vec![0u8; BS];
        pin.read_into(&mut dst).unwrap();
        assert_eq!(dst, value_for(b"p0@fb.c4", BS));
        drop(pin);
        put_page(&e, "p3", 0);
        assert!(
            !page_state(&e, "p0"),
            "{policy:?}: unpinned, it is the coldest again"
        );
        e.verify_accounting().unwrap();
    }
}

#[test]
fn a_page_being_written_never_evicts_its_own_components() {
    // 2 pages and one block fit: the third page's second component needs room, and that
    // page is the deepest, so prefix-depth would pick its first component if it could.
    let e = engine(7, PrefixDepth, 64);
    put_page(&e, "a", 0);
    put_page(&e, "b", 1);
    put_page(&e, "c", 9);
    assert!(page_state(&e, "c"));
    assert!(page_state(&e, "a") && !page_state(&e, "b"));
}

#[test]
fn a_partly_removed_page_goes_first() {
    let e = engine(6, PrefixDepth, 64);
    put_page(&e, "a", 5);
    put_page(&e, "b", 0);
    assert!(e.remove(b"b@fa.swa"));
    // b is broken: the shallower b goes before the deep a.
    put_page(&e, "c", 0);
    assert!(page_state(&e, "a") && page_state(&e, "c"));
    assert!(!e.contains(b"b@fb.c4") && !e.contains(b"b@fc.c4_indexer"));
}

#[test]
fn events_follow_page_groups() {
    let e = engine(6, Lru, 64);
    put_page(&e, "before", 0); // not recorded: the log is off
    e.enable_events(64);
    put_page(&e, "p0", 0);
    put_page(&e, "p1", 1); // evicts "before" whole
    for k in page_keys("p0") {
        assert!(e.remove(k.as_bytes()));
    }
    e.clear();
    let d = e.drain_events(100);
    let got: Vec<(EventKind, String, Option<u32>)> = d
        .events
        .iter()
        .map(|ev| {
            (
                ev.kind,
                String::from_utf8_lossy(&ev.group).into_owned(),
                ev.depth,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (EventKind::Stored, "p0@".into(), Some(0)),
            (EventKind::Evicted, "before@".into(), Some(0)),
            (EventKind::Stored, "p1@".into(), Some(1)),
            (EventKind::Removed, "p0@".into(), None),
            (EventKind::Cleared, "".into(), None),
        ]
    );
    assert_eq!(
        d.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
    assert_eq!((d.dropped_total, d.pending), (0, 0));
    // A small ring drops the oldest and says how many.
    e.enable_events(2);
    for p in 0..4 {
        put_page(&e, &format!("q{p}"), 0);
    }
    let d = e.drain_events(100);
    assert!(d.dropped_total > 0);
    assert_eq!(d.events.len(), 2);
    assert_eq!(d.events[1].seq - d.events[0].seq, 1);
}

#[derive(Clone, Debug)]
enum Op {
    PutPage { page: u8, depth: u32 },
    GetPage { page: u8 },
    RemovePage { page: u8 },
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..10u8, 0..6u32).prop_map(|(page, depth)| Op::PutPage { page, depth }),
        4 => (0..10u8).prop_map(|page| Op::GetPage { page }),
        1 => (0..10u8).prop_map(|page| Op::RemovePage { page }),
        1 => Just(Op::Clear),
    ]
}

/// Random page operations: no page is ever partial, the event stream balances with what the
/// engine holds, and the accounting holds after every step.
fn run(ops: Vec<Op>, policy: EvictionPolicyKind) -> Result<(), TestCaseError> {
    let e = engine(10, policy, 4);
    e.enable_events(1 << 12);
    let mut live: BTreeSet<String> = BTreeSet::new();
    for op in ops {
        match op {
            Op::PutPage { page, depth } => put_page(&e, &format!("g{page}"), depth),
            Op::GetPage { page } => {
                let name = format!("g{page}");
                if page_state(&e, &name) {
                    read_page(&e, &name);
                }
            }
            Op::RemovePage { page } => {
                for k in page_keys(&format!("g{page}")) {
                    e.remove(k.as_bytes());
                }
            }
            Op::Clear => e.clear(),
        }
        for ev in e.drain_events(usize::MAX).events {
            let g = String::from_utf8_lossy(&ev.group)
                .trim_end_matches('@')
                .to_owned();
            match ev.kind {
                EventKind::Stored => prop_assert!(live.insert(g), "stored twice"),
                EventKind::Evicted | EventKind::Removed => {
                    prop_assert!(live.remove(&g), "left without being stored")
                }
                EventKind::Cleared => live.clear(),
                EventKind::SsdStored | EventKind::SsdRemoved => {
                    prop_assert!(false, "an SSD event without enable_media_events")
                }
            }
        }
        let mut resident: HashMap<String, bool> = HashMap::new();
        for p in 0..10u8 {
            let name = format!("g{p}");
            resident.insert(name.clone(), page_state(&e, &name));
        }
        let held: BTreeSet<String> = resident
            .into_iter()
            .filter(|(_, r)| *r)
            .map(|(n, _)| n)
            .collect();
        prop_assert_eq!(&held, &live, "events disagree with the store");
        if let Err(msg) = e.verify_accounting() {
            return Err(TestCaseError::fail(msg));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn prefix_depth_pages_stay_whole(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops, PrefixDepth)?;
    }

    #[test]
    fn lru_pages_stay_whole(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops, Lru)?;
    }
}

#[test]
fn touch_group_keeps_a_cold_page_like_a_read() {
    for policy in [Lru, PrefixDepth] {
        // 2 pages fit. p0 is the coldest; touching its group (not a member key) makes p1 the
        // victim of the third page, exactly as reading p0 would.
        let e = engine(6, policy, 64);
        put_page(&e, "p0", 0);
        put_page(&e, "p1", 0);
        assert!(e.touch_group(b"p0@"), "{policy:?}");
        assert!(!e.touch_group(b"nope@"), "{policy:?}: unknown group");
        assert!(
            !e.touch_group(b"p0"),
            "{policy:?}: a group name ends with @"
        );
        put_page(&e, "p2", 0);
        assert!(page_state(&e, "p0") && !page_state(&e, "p1"), "{policy:?}");
        // Without the touch the coldest goes, so the assertion above can fail.
        let e = engine(6, policy, 64);
        put_page(&e, "p0", 0);
        put_page(&e, "p1", 0);
        put_page(&e, "p2", 0);
        assert!(!page_state(&e, "p0") && page_state(&e, "p1"), "{policy:?}");
        e.verify_accounting().unwrap();
    }
}

#[test]
fn superseded_state_goes_alone_before_any_page() {
    let e = engine(9, PrefixDepth, 64);
    put_page(&e, "a", 2);
    put_page(&e, "b", 0);
    put_page(&e, "c", 1);
    // b's window state (its swa component) is superseded; b is neither coldest nor deepest.
    assert!(e.demote(b"b@fa.swa"));
    assert!(!e.demote(b"zz@fa.swa"), "a key not stored is not marked");
    // One block is needed: exactly b's superseded component goes, b's other components stay.
    let v = value_for(b"d@fa.swa", BS);
    e.put(b"d@fa.swa", &v, PutMeta { depth: Some(3) }).unwrap();
    assert!(!e.contains(b"b@fa.swa"));
    assert!(e.contains(b"b@fb.c4") && e.contains(b"b@fc.c4_indexer"));
    assert!(page_state(&e, "a") && page_state(&e, "c"));
    let s = e.stats();
    assert_eq!((s.evictions_superseded, s.evictions_capacity), (1, 0));
    e.verify_accounting().unwrap();
    // b is not broken by it (a broken page would go first): the next eviction follows
    // depth among the cold window (a and b), taking a.
    let v = value_for(b"d@fb.c4", BS);
    e.put(b"d@fb.c4", &v, PutMeta { depth: Some(3) }).unwrap();
    assert!(!page_state(&e, "a"));
    assert!(page_state(&e, "c") && e.contains(b"b@fb.c4") && e.contains(b"b@fc.c4_indexer"));
}

#[test]
fn lru_ignores_demote_and_reads_clear_it() {
    let e = engine(6, Lru, 64);
    put_page(&e, "a", 0);
    put_page(&e, "b", 0);
    assert!(e.demote(b"b@fa.swa"));
    put_page(&e, "c", 0);
    // Plain LRU: the coldest whole page a went, not b's superseded state.
    assert!(!page_state(&e, "a") && page_state(&e, "b"));
    assert_eq!(e.stats().evictions_superseded, 0);

    let e = engine(6, PrefixDepth, 64);
    put_page(&e, "a", 0);
    put_page(&e, "b", 0);
    assert!(e.demote(b"b@fa.swa"));
    // Reading it (a request restored up to b) clears the mark: b is whole and kept.
    read_page(&e, "b");
    put_page(&e, "c", 0);
    assert!(!page_state(&e, "a") && page_state(&e, "b"));
    assert_eq!(e.stats().evictions_superseded, 0);
}

/// Random puts, reads, demotes and removes: a page is only ever whole, or whole but for its
/// demoted window-state component; the accounting holds after every step.
fn run_with_demotes(ops: Vec<(u8, u8, u32)>) -> Result<(), TestCaseError> {
    let e = engine(10, PrefixDepth, 4);
    let mut demoted: BTreeSet<u8> = BTreeSet::new();
    for (kind, page, depth) in ops {
        let name = format!("g{page}");
        match kind % 4 {
            0 | 1 => {
                put_page(&e, &name, depth);
                demoted.remove(&page);
            }
            2 => {
                if e.demote(format!("{name}@fa.swa").as_bytes()) {
                    demoted.insert(page);
                }
            }
            _ => {
                for k in page_keys(&name) {
                    e.remove(k.as_bytes());
                }
                demoted.remove(&page);
            }
        }
        for p in 0..10u8 {
            let present: Vec<bool> = page_keys(&format!("g{p}"))
                .iter()
                .map(|k| e.contains(k.as_bytes()))
                .collect();
            let whole = present.iter().all(|&b| b) || present.iter().all(|&b| !b);
            let lost_state_only = !present[0] && present[1..].iter().all(|&b| b);
            prop_assert!(
                whole || (lost_state_only && demoted.contains(&p)),
                "page g{p} is partial: {present:?}"
            );
        }
        if let Err(msg) = e.verify_accounting() {
            return Err(TestCaseError::fail(msg));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn only_superseded_state_leaves_a_page_partial(
        ops in proptest::collection::vec((0..4u8, 0..10u8, 0..6u32), 1..80)
    ) {
        run_with_demotes(ops)?;
    }
}
