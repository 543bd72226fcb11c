//! The v2 fold against a model written straight from its definitions (quadratic, obviously
//! right), over random stores; and the largest query SGLang can send, answered in one linear
//! pass.
//!
//! The model restates `kvtier_proto::query`'s rules without any of the evaluator's machinery:
//! each pool's verdict is its own boundary over the whole span, the restorable set is every
//! prefix that every gating pool accepts, and the KV hit is its largest member.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::Instant;

use kvtier_proto::limits::{MAX_PAGES_PER_QUERY, MAX_POOLS};
use kvtier_proto::query::evaluate;
use kvtier_proto::{ExistsV2Answer, ExistsV2Query, HitPolicy, KvComponents, PoolQuery};
use proptest::collection::vec;
use proptest::prelude::*;

/// One pool of a generated store: its policy and, per page, whether it is present (`None`: the
/// client names no suffix for it).
#[derive(Clone, Debug)]
struct ModelPool {
    policy: HitPolicy,
    present: Option<Vec<bool>>,
}

#[derive(Clone, Debug)]
struct Case {
    /// `None`: a logical KV anchor.
    kv: Option<Vec<bool>>,
    pools: Vec<ModelPool>,
    pages: usize,
}

fn policy() -> impl Strategy<Value = HitPolicy> {
    prop_oneof![
        Just(HitPolicy::AllPages),
        prop_oneof![0..6u32, Just(u32::MAX)].prop_map(|window| HitPolicy::TrailingPages { window }),
        prop_oneof![0..6u32, Just(u32::MAX)]
            .prop_map(|group_pages| HitPolicy::BlockGroups { group_pages }),
    ]
}

/// Presence with long runs and scattered holes: mostly present, as a real cache is.
fn presence(pages: usize) -> impl Strategy<Value = Vec<bool>> {
    vec(prop_oneof![4 => Just(true), 1 => Just(false)], pages)
}

fn case() -> impl Strategy<Value = Case> {
    (0..24usize).prop_flat_map(|pages| {
        let pool = (policy(), prop::option::weighted(0.9, presence(pages)))
            .prop_map(|(policy, present)| ModelPool { policy, present });
        (
            prop::option::weighted(0.7, presence(pages)),
            vec(pool, 0..6),
        )
            .prop_map(move |(kv, pools)| Case { kv, pools, pages })
    })
}

fn leading_run(present: &[bool]) -> usize {
    present.iter().take_while(|&&p| p).count()
}

/// Whether prefix `p` is restorable for this pool alone.
fn pool_accepts(pool: &ModelPool, p: usize) -> bool {
    let Some(present) = &pool.present else {
        return !pool.policy.gates();
    };
    match pool.policy {
        HitPolicy::AllPages => p <= leading_run(present),
        HitPolicy::TrailingPages { window } => {
            let window = window.max(1) as usize;
            (p.saturating_sub(window)..p).all(|i| present[i])
        }
        HitPolicy::BlockGroups { .. } => true,
    }
}

/// The pool's own verdict over the whole span, or `None` for no verdict.
fn pool_verdict(pool: &ModelPool, pages: usize) -> Option<u32> {
    let present = pool.present.as_ref()?;
    let verdict = match pool.policy {
        HitPolicy::AllPages => leading_run(present),
        HitPolicy::TrailingPages { .. } => (1..=pages)
            .filter(|&p| pool_accepts(pool, p))
            .max()
            .unwrap_or(0),
        HitPolicy::BlockGroups { group_pages } => {
            let group = group_pages.max(1) as usize;
            let mut covered = 0;
            while covered + group <= pages && present[covered..covered + group].iter().all(|&x| x) {
                covered += group;
            }
            covered
        }
    };
    Some(verdict as u32)
}

fn model(case: &Case) -> ExistsV2Answer {
    if case.pages == 0 {
        return ExistsV2Answer::default();
    }
    let kv = case.kv.as_deref().map_or(case.pages, leading_run);
    let mut pool_hit_pages = vec![("kv".to_string(), kv as u32)];
    for (i, pool) in case.pools.iter().enumerate() {
        if let Some(verdict) = pool_verdict(pool, case.pages) {
            pool_hit_pages.push((format!("pool{i}"), verdict));
        }
    }
    let restorable: Vec<u32> = (1..=kv)
        .filter(|&p| case.pools.iter().all(|pool| pool_accepts(pool, p)))
        .map(|p| p as u32)
        .collect();
    ExistsV2Answer {
        kv_hit_pages: restorable.last().copied().unwrap_or(0),
        pool_hit_pages,
        restorable_prefix_pages: restorable,
    }
}

/// The query and the store the case describes.
fn build(case: &Case) -> (ExistsV2Query, HashSet<Vec<u8>>) {
    let mut stored = HashSet::new();
    let mut add = |page: usize, suffix: &str| {
        stored.insert(format!("m/page{page}{suffix}").into_bytes());
    };
    if let Some(kv) = &case.kv {
        for (page, _) in kv.iter().enumerate().filter(|(_, &p)| p) {
            add(page, ".k");
            add(page, ".v");
        }
    }
    let mut pools = Vec::new();
    for (i, pool) in case.pools.iter().enumerate() {
        let suffix = format!(".pool{i}");
        if let Some(present) = &pool.present {
            for (page, _) in present.iter().enumerate().filter(|(_, &p)| p) {
                add(page, &suffix);
            }
        }
        pools.push(PoolQuery {
            name: format!("pool{i}"),
            suffixes: if pool.present.is_some() {
                vec![suffix.into_bytes()]
            } else {
                Vec::new()
            },
            policy: pool.policy,
        });
    }
    let query = ExistsV2Query {
        key_prefix: b"m/".to_vec(),
        page_keys: (0..case.pages)
            .map(|i| format!("page{i}").into_bytes())
            .collect(),
        kv: match case.kv {
            Some(_) => KvComponents::Suffixes(vec![b".k".to_vec(), b".v".to_vec()]),
            None => KvComponents::Logical,
        },
        pools,
    };
    (query, stored)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_linear_fold_answers_as_the_model(case in case()) {
        let (query, stored) = build(&case);
        let mut lookups = 0u64;
        let got = evaluate(&query, |k| {
            lookups += 1;
            stored.contains(k)
        })
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(&got, &model(&case));
        prop_assert!(got.check_invariants(case.pages).is_ok());
        prop_assert!(lookups <= query.lookups(), "{} lookups, bound {}", lookups, query.lookups());
    }
}

/// The largest query SGLang can send for a hybrid model: 65,536 pages, 64 pools (half of them
/// trailing with a 65,536-page window), every page present but one hole per pool. One linear
/// pass per pool answers it; the old per-candidate window rescan took over a second per pool.
#[test]
fn the_largest_query_is_answered_in_one_pass_per_pool() {
    let pages = MAX_PAGES_PER_QUERY;
    // The engine's index hashes keys with foldhash; so does this stand-in.
    let mut stored: HashSet<Vec<u8>, foldhash::fast::RandomState> =
        HashSet::with_capacity_and_hasher(pages * (MAX_POOLS + 2), Default::default());
    let mut pools = Vec::new();
    for pool in 0..MAX_POOLS {
        let suffix = format!(".p{pool}");
        let hole = pages - 1 - pool * 997;
        for page in (0..pages).filter(|&p| p != hole) {
            stored.insert(format!("big/{page:08x}{suffix}").into_bytes());
        }
        let policy = if pool % 2 == 0 {
            HitPolicy::AllPages
        } else {
            HitPolicy::TrailingPages {
                window: pages as u32,
            }
        };
        pools.push(PoolQuery {
            name: format!("pool{pool}"),
            suffixes: vec![suffix.into_bytes()],
            policy,
        });
    }
    for page in 0..pages {
        stored.insert(format!("big/{page:08x}.k").into_bytes());
        stored.insert(format!("big/{page:08x}.v").into_bytes());
    }
    let query = ExistsV2Query {
        key_prefix: b"big/".to_vec(),
        page_keys: (0..pages)
            .map(|p| format!("{p:08x}").into_bytes())
            .collect(),
        kv: KvComponents::Suffixes(vec![b".k".to_vec(), b".v".to_vec()]),
        pools,
    };
    assert!(query.check_work().is_ok());
    let mut lookups = 0u64;
    let started = Instant::now();
    let answer = evaluate(&query, |k| {
        lookups += 1;
        stored.contains(k)
    })
    .expect("within the work bound");
    let elapsed = started.elapsed();
    let started_free = Instant::now();
    let free = evaluate(&query, |k| !k.is_empty()).expect("within the bound");
    println!(
        "fold alone (an oracle that costs nothing): {:.0} ms, hit {}",
        started_free.elapsed().as_secs_f64() * 1e3,
        free.kv_hit_pages
    );
    println!(
        "65536 pages x 64 pools: {lookups} lookups in {:.0} ms",
        elapsed.as_secs_f64() * 1e3
    );
    assert!(lookups <= query.lookups());
    // Pool 63's hole is the lowest: prefixes up to it are restorable.
    let lowest_hole = pages - 1 - (MAX_POOLS - 1) * 997;
    assert_eq!(answer.kv_hit_pages as usize, lowest_hole);
    assert_eq!(answer.pool_hit_pages.len(), MAX_POOLS + 1);
    for (pool, (name, verdict)) in answer.pool_hit_pages.iter().skip(1).enumerate() {
        assert_eq!(name, &format!("pool{pool}"));
        // A full-span window needs every page: the hole leaves no restorable prefix past it.
        assert_eq!(*verdict as usize, pages - 1 - pool * 997, "{name}");
    }
    if !cfg!(debug_assertions) {
        // Not a benchmark (the figure is printed above): a bound ten times the target that only
        // a return of the quadratic window rescan (minutes here) can break on a noisy machine.
        assert!(elapsed.as_secs_f64() < 10.0, "took {elapsed:?}");
    }
}
