//! The v2 existence query: one request that answers "how many leading pages of this span can be
//! restored" for the KV anchor and every side pool at once.
//!
//! Keys are composed, never sent whole: the object key for page `i` and component suffix `s` is
//! `key_prefix ++ page_keys[i] ++ s`. That keeps the request small (page hashes once, suffixes
//! once per pool) and lets the evaluator look up only the pages still in play.
//!
//! Fold rules (the reference is SGLang's `HiCacheFile.batch_exists_v2`):
//! - KV hit = longest prefix of pages whose every KV component exists; a logical anchor (no KV
//!   bytes of its own) hits every page and lets the side pools decide.
//! - The restorable set starts as `{1..=kv_hit}` and every gating pool intersects it:
//!   `AllPages` keeps `{1..=b}` where `b` is the pool's own leading run; `TrailingPages{window}`
//!   keeps every `p` whose last `window` pages `[p-window, p)` all exist (so it may have holes).
//! - `BlockGroups{group_pages}` reports `group_pages * leading complete groups` as its own
//!   verdict and never gates the KV hit.
//! - Narrowing: a pool is asked only about pages that can still matter (those below the largest
//!   restorable prefix still in play), so a pool's reported boundary never exceeds that bound.
//! - The final KV hit is the largest restorable prefix, or 0.

/// How a pool's presence limits the usable prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HitPolicy {
    /// Every page in `[0, kv_hit)` must exist (e.g. compressed KV, indexer).
    AllPages,
    /// Only the last `window` pages of a prefix must exist (SWA, Mamba / compressor state).
    /// A window of 0 is treated as 1, as SGLang does.
    TrailingPages { window: u32 },
    /// Whole groups of `group_pages` pages from the span start; a verdict, never a gate.
    /// A group size of 0 is treated as 1.
    BlockGroups { group_pages: u32 },
}

impl HitPolicy {
    /// Whether this policy narrows the restorable set (BlockGroups only reports).
    pub fn gates(&self) -> bool {
        !matches!(self, HitPolicy::BlockGroups { .. })
    }
}

/// The KV anchor's components for every page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvComponents {
    /// The anchor owns page indices only (SGLang `LogicalHostPool`): every page counts as a hit.
    Logical,
    /// Every listed suffix must exist for a page to count (e.g. `_0_k`, `_0_v`).
    Suffixes(Vec<Vec<u8>>),
}

/// One side pool of the query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolQuery {
    /// The pool's name as SGLang spells it (`swa`, `deepseek_v4_c4`, ...).
    pub name: String,
    /// Component suffixes; a page exists in this pool when every suffix exists. An empty list
    /// means the pool has no objects, so no page of it exists.
    pub suffixes: Vec<Vec<u8>>,
    pub policy: HitPolicy,
}

/// A whole v2 existence query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExistsV2Query {
    pub key_prefix: Vec<u8>,
    pub page_keys: Vec<Vec<u8>>,
    pub kv: KvComponents,
    /// Pools in the order SGLang listed them; evaluation (and narrowing) follows this order.
    pub pools: Vec<PoolQuery>,
}

/// The answer to an [`ExistsV2Query`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExistsV2Answer {
    /// Largest restorable prefix, in pages.
    pub kv_hit_pages: u32,
    /// Each pool's own boundary, only for pools with a non-zero boundary. The KV anchor is
    /// listed under the name `kv` when its own prefix is non-zero.
    pub pool_hit_pages: Vec<(String, u32)>,
    /// Every restorable prefix length, ascending.
    pub restorable_prefix_pages: Vec<u32>,
}

impl ExistsV2Query {
    /// Compose the object key of page `page` with component `suffix` into `out` (cleared first).
    pub fn compose_key(&self, page: usize, suffix: &[u8], out: &mut Vec<u8>) {
        compose_key(&self.key_prefix, &self.page_keys[page], suffix, out);
    }
}

/// `prefix ++ page_key ++ suffix` into `out` (cleared first). The one definition of a kvtier
/// object key, shared by every batch call so that puts and lookups always agree.
pub fn compose_key(prefix: &[u8], page_key: &[u8], suffix: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(prefix.len() + page_key.len() + suffix.len());
    out.extend_from_slice(prefix);
    out.extend_from_slice(page_key);
    out.extend_from_slice(suffix);
}

/// Evaluate a query against any presence oracle. The engine calls this with its index; a
/// remote evaluator calls it with its directory. `exists(key)` must be side-effect free.
pub fn evaluate(query: &ExistsV2Query, mut exists: impl FnMut(&[u8]) -> bool) -> ExistsV2Answer {
    let pages = query.page_keys.len();
    let mut key = Vec::new();
    let mut page_has = |page: usize, suffixes: &[Vec<u8>], key: &mut Vec<u8>| -> bool {
        !suffixes.is_empty()
            && suffixes.iter().all(|s| {
                query.compose_key(page, s, key);
                exists(key)
            })
    };

    let kv_pages = match &query.kv {
        KvComponents::Logical => pages,
        KvComponents::Suffixes(suffixes) => (0..pages)
            .find(|&i| !page_has(i, suffixes, &mut key))
            .unwrap_or(pages),
    };
    let mut answer = ExistsV2Answer::default();
    if kv_pages > 0 {
        answer
            .pool_hit_pages
            .push(("kv".to_string(), kv_pages as u32));
    }
    // restorable[p] for p in 1..=kv_pages.
    let mut restorable: Vec<bool> = vec![true; kv_pages + 1];
    if let Some(r) = restorable.first_mut() {
        *r = false;
    }
    let mut largest = kv_pages;

    for pool in &query.pools {
        if largest == 0 {
            break;
        }
        // Presence is looked up lazily and at most once per page.
        let mut present: Vec<Option<bool>> = vec![None; largest];
        let mut has = |i: usize, key: &mut Vec<u8>| -> bool {
            *present[i].get_or_insert_with(|| page_has(i, &pool.suffixes, key))
        };
        let boundary = match pool.policy {
            HitPolicy::AllPages => {
                let b = (0..largest).find(|&i| !has(i, &mut key)).unwrap_or(largest);
                for r in restorable.iter_mut().skip(b + 1) {
                    *r = false;
                }
                b
            }
            HitPolicy::TrailingPages { window } => {
                let window = window.max(1) as usize;
                let mut best = 0;
                // Walk from the longest candidate down; each check only needs the window.
                for p in (1..=largest).rev() {
                    if !restorable[p] {
                        continue;
                    }
                    let ok = (p.saturating_sub(window)..p).all(|i| has(i, &mut key));
                    if ok {
                        best = best.max(p);
                    } else {
                        restorable[p] = false;
                    }
                }
                best
            }
            HitPolicy::BlockGroups { group_pages } => {
                let group = group_pages.max(1) as usize;
                let mut covered = 0;
                while covered + group <= largest
                    && (covered..covered + group).all(|i| has(i, &mut key))
                {
                    covered += group;
                }
                covered
            }
        };
        if boundary > 0 {
            answer
                .pool_hit_pages
                .push((pool.name.clone(), boundary as u32));
        }
        if pool.policy.gates() {
            largest = (1..=largest).rev().find(|&p| restorable[p]).unwrap_or(0);
        }
    }

    answer.restorable_prefix_pages = (1..=largest)
        .filter(|&p| restorable[p])
        .map(|p| p as u32)
        .collect();
    answer.kv_hit_pages = largest as u32;
    answer
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn query(pages: usize, pools: Vec<PoolQuery>) -> ExistsV2Query {
        ExistsV2Query {
            key_prefix: b"t/".to_vec(),
            page_keys: (0..pages).map(|i| format!("p{i}").into_bytes()).collect(),
            kv: KvComponents::Suffixes(vec![b".k".to_vec(), b".v".to_vec()]),
            pools,
        }
    }

    fn store(entries: &[&str]) -> HashSet<Vec<u8>> {
        entries.iter().map(|e| e.as_bytes().to_vec()).collect()
    }

    fn pool(name: &str, policy: HitPolicy) -> PoolQuery {
        PoolQuery {
            name: name.into(),
            suffixes: vec![format!(".{name}").into_bytes()],
            policy,
        }
    }

    #[test]
    fn kv_prefix_needs_every_component() {
        let s = store(&["t/p0.k", "t/p0.v", "t/p1.k", "t/p2.k", "t/p2.v"]);
        let a = evaluate(&query(3, vec![]), |k| s.contains(k));
        assert_eq!(a.kv_hit_pages, 1);
        assert_eq!(a.restorable_prefix_pages, vec![1]);
        assert_eq!(a.pool_hit_pages, vec![("kv".to_string(), 1)]);
    }

    #[test]
    fn trailing_state_with_holes() {
        let mut e = vec![];
        for i in 0..5 {
            e.push(format!("t/p{i}.k"));
            e.push(format!("t/p{i}.v"));
        }
        // State exists at pages 1 and 3 (prefixes 2 and 4), not at 2 (prefix 3).
        e.push("t/p1.st".into());
        e.push("t/p3.st".into());
        let s: HashSet<Vec<u8>> = e.iter().map(|x| x.as_bytes().to_vec()).collect();
        let q = query(5, vec![pool("st", HitPolicy::TrailingPages { window: 1 })]);
        let a = evaluate(&q, |k| s.contains(k));
        assert_eq!(a.restorable_prefix_pages, vec![2, 4]);
        assert_eq!(a.kv_hit_pages, 4);
    }

    #[test]
    fn block_groups_report_but_never_gate() {
        let mut e = vec![];
        for i in 0..6 {
            e.push(format!("t/p{i}.k"));
            e.push(format!("t/p{i}.v"));
        }
        for i in [0, 1, 2, 3, 5] {
            e.push(format!("t/p{i}.bg"));
        }
        let s: HashSet<Vec<u8>> = e.iter().map(|x| x.as_bytes().to_vec()).collect();
        let q = query(
            6,
            vec![pool("bg", HitPolicy::BlockGroups { group_pages: 2 })],
        );
        let a = evaluate(&q, |k| s.contains(k));
        assert_eq!(a.kv_hit_pages, 6);
        assert!(a.pool_hit_pages.contains(&("bg".to_string(), 4)));
    }

    #[test]
    fn logical_anchor_lets_side_pools_decide() {
        let s = store(&["t/p0.swa", "t/p1.swa", "t/p0.c4", "t/p1.c4", "t/p2.c4"]);
        let mut q = query(
            3,
            vec![
                pool("c4", HitPolicy::AllPages),
                pool("swa", HitPolicy::TrailingPages { window: 2 }),
            ],
        );
        q.kv = KvComponents::Logical;
        let a = evaluate(&q, |k| s.contains(k));
        assert_eq!(a.kv_hit_pages, 2);
        assert_eq!(a.restorable_prefix_pages, vec![1, 2]);
    }

    #[test]
    fn narrowing_skips_pages_out_of_play() {
        let mut e = vec![];
        for i in 0..8 {
            e.push(format!("t/p{i}.k"));
            e.push(format!("t/p{i}.v"));
            e.push(format!("t/p{i}.b"));
        }
        e.push("t/p0.a".into());
        e.push("t/p1.a".into());
        let s: HashSet<Vec<u8>> = e.iter().map(|x| x.as_bytes().to_vec()).collect();
        let q = query(
            8,
            vec![
                pool("a", HitPolicy::AllPages),
                pool("b", HitPolicy::AllPages),
            ],
        );
        let mut asked_b = 0;
        let a = evaluate(&q, |k| {
            if k.ends_with(b".b") {
                asked_b += 1;
            }
            s.contains(k)
        });
        assert_eq!(a.kv_hit_pages, 2);
        assert_eq!(
            asked_b, 2,
            "pool b is asked only about the 2 pages still in play"
        );
    }
}
