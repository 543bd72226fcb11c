//! The v2 existence query: one request that answers "how many leading pages of this span can be
//! restored" for the KV anchor and every side pool at once.
//!
//! Keys are composed, never sent whole: the object key for page `i` and component suffix `s` is
//! `key_prefix ++ page_keys[i] ++ s`. That keeps the request small (page hashes once, suffixes
//! once per pool) and lets the evaluator compose each key into one reused buffer.
//!
//! Two results with two rules (the reference is SGLang's `HiCacheFile.batch_exists_v2`):
//! - **Verdicts.** Every pool (the KV anchor under the name `kv` included) reports its own
//!   boundary over the whole queried span, under its own policy alone: `AllPages` the first gap;
//!   `TrailingPages{window}` the largest `p` whose last `min(window, p)` pages `[p-window, p)` all
//!   exist; `BlockGroups{group_pages}` the pages its leading complete groups cover. A boundary of
//!   0 is reported as 0. SGLang heals its per-pool existence beliefs from these numbers, so a
//!   verdict cut short by another pool would make it forget pages that are there.
//!   A pool kvtier cannot compose keys for (no suffixes: the client does not know its objects)
//!   gets no verdict; a logical KV anchor (no bytes of its own) holds every page.
//! - **The fold.** The restorable set starts as `{1..=kv}` and every gating pool intersects it:
//!   `AllPages` keeps `{1..=b}`, `TrailingPages` keeps the `p` its window rule accepts (so the
//!   set may have holes), a pool without suffixes keeps nothing, and `BlockGroups` never gates.
//!   `kv_hit_pages` is the largest restorable prefix, or 0.
//!
//! Cost: every pool is one forward pass over the span (a sliding count of consecutive present
//! pages for the trailing rule), stopping early only where the pool's own verdict is already
//! known (a gap for `AllPages`, an incomplete group for `BlockGroups`), so one query costs at
//! most `pages x components` presence lookups. [`ExistsV2Query::check_work`] bounds that product
//! by [`MAX_LOOKUPS_PER_QUERY`]; the codec and [`evaluate`] refuse a query above it.

use crate::codec::check_limit;
use crate::error::ProtoError;
use crate::limits::{MAX_LOOKUPS_PER_QUERY, MAX_PAGES_PER_QUERY};

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
    /// means the client cannot name the pool's objects: no verdict, and a gating pool then
    /// restores nothing.
    pub suffixes: Vec<Vec<u8>>,
    pub policy: HitPolicy,
}

/// A whole v2 existence query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExistsV2Query {
    pub key_prefix: Vec<u8>,
    pub page_keys: Vec<Vec<u8>>,
    pub kv: KvComponents,
    /// Pools in the order SGLang listed them; verdicts are reported in this order.
    pub pools: Vec<PoolQuery>,
}

/// The answer to an [`ExistsV2Query`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExistsV2Answer {
    /// Largest restorable prefix, in pages.
    pub kv_hit_pages: u32,
    /// Each pool's own boundary over the whole span (0 included), in query order after the KV
    /// anchor, which is listed first under the name `kv`. Empty for an empty span; a pool
    /// without suffixes is absent (no verdict).
    pub pool_hit_pages: Vec<(String, u32)>,
    /// Every restorable prefix length, ascending.
    pub restorable_prefix_pages: Vec<u32>,
}

impl ExistsV2Query {
    /// Presence lookups evaluating this query may cost: pages x every component suffix (the KV
    /// anchor's and every pool's).
    pub fn lookups(&self) -> u64 {
        let kv = match &self.kv {
            KvComponents::Logical => 0,
            KvComponents::Suffixes(suffixes) => suffixes.len(),
        };
        let components: usize = kv + self.pools.iter().map(|p| p.suffixes.len()).sum::<usize>();
        (self.page_keys.len() as u64).saturating_mul(components as u64)
    }

    /// Refuse a query whose evaluation would cost more than [`MAX_LOOKUPS_PER_QUERY`] lookups
    /// (or that has more than [`MAX_PAGES_PER_QUERY`] pages), naming the bound.
    pub fn check_work(&self) -> Result<(), ProtoError> {
        check_limit(
            "page count",
            self.page_keys.len() as u64,
            MAX_PAGES_PER_QUERY as u64,
        )?;
        check_limit(
            "presence lookups of one exists query (pages x component suffixes)",
            self.lookups(),
            MAX_LOOKUPS_PER_QUERY as u64,
        )
    }

    /// Compose the object key of page `page` with component `suffix` into `out` (cleared first).
    pub fn compose_key(&self, page: usize, suffix: &[u8], out: &mut Vec<u8>) {
        compose_key(&self.key_prefix, &self.page_keys[page], suffix, out);
    }
}

/// `prefix ++ page_key ++ suffix` into `out` (cleared first). The one definition of a kvtier
/// object key, shared by every batch call so that puts and lookups always agree.
pub fn compose_key(prefix: &[u8], page_key: &[u8], suffix: &[u8], out: &mut Vec<u8>) {
    crate::keys::compose(prefix, page_key, suffix, out)
}

/// Evaluate a query against any presence oracle. The engine calls this with its index; the
/// master calls it with its directory. `exists(key)` must be side-effect free. Fails only when
/// the query is over the work bound ([`ExistsV2Query::check_work`]).
pub fn evaluate(
    query: &ExistsV2Query,
    exists: impl FnMut(&[u8]) -> bool,
) -> Result<ExistsV2Answer, ProtoError> {
    query.check_work()?;
    let pages = query.page_keys.len();
    let mut answer = ExistsV2Answer::default();
    if pages == 0 {
        return Ok(answer);
    }
    let mut probe = Probe {
        query,
        exists,
        key: Vec::new(),
    };
    let kv = match &query.kv {
        KvComponents::Logical => pages,
        KvComponents::Suffixes(suffixes) => probe.leading_run(suffixes, 1),
    };
    answer.pool_hit_pages.push(("kv".to_string(), kv as u32));
    // restorable[p] for the prefix of p pages; index 0 (the empty prefix) is never restorable.
    let mut restorable = vec![false; pages + 1];
    for flag in restorable.iter_mut().take(kv + 1).skip(1) {
        *flag = true;
    }
    let mut largest = kv;

    for pool in &query.pools {
        let suffixes = &pool.suffixes;
        if suffixes.is_empty() {
            // No objects to ask about: no verdict, and nothing of a gating pool is restorable.
            if pool.policy.gates() {
                restorable.fill(false);
                largest = 0;
            }
            continue;
        }
        let boundary = match pool.policy {
            HitPolicy::AllPages => {
                let boundary = probe.leading_run(suffixes, 1);
                for flag in restorable.iter_mut().skip(boundary + 1) {
                    *flag = false;
                }
                boundary
            }
            HitPolicy::TrailingPages { window } => {
                // A window past the span is the span: the rule then asks for every page.
                let window = (window.max(1) as usize).min(pages);
                // One pass: `run` counts consecutive present pages ending at `page`, and the
                // prefix through it is restorable for this pool iff the run covers the window.
                let mut run = 0;
                let mut boundary = 0;
                for (page, flag) in restorable.iter_mut().skip(1).enumerate() {
                    let prefix = page + 1;
                    run = if probe.page_has(page, suffixes) {
                        run + 1
                    } else {
                        0
                    };
                    if run >= window.min(prefix) {
                        boundary = prefix;
                    } else {
                        *flag = false;
                    }
                }
                boundary
            }
            HitPolicy::BlockGroups { group_pages } => {
                probe.leading_run(suffixes, group_pages.max(1) as usize)
            }
        };
        answer
            .pool_hit_pages
            .push((pool.name.clone(), boundary as u32));
        if pool.policy.gates() {
            largest = (1..=largest).rev().find(|&p| restorable[p]).unwrap_or(0);
        }
    }

    answer.restorable_prefix_pages = (1..=largest)
        .filter(|&p| restorable[p])
        .map(|p| p as u32)
        .collect();
    answer.kv_hit_pages = largest as u32;
    debug_assert!(answer.check_invariants(pages).is_ok());
    Ok(answer)
}

/// Presence of whole pages of one query, composing each key into one reused buffer.
struct Probe<'q, F> {
    query: &'q ExistsV2Query,
    exists: F,
    key: Vec<u8>,
}

impl<F: FnMut(&[u8]) -> bool> Probe<'_, F> {
    /// Whether page `page` has every component in `suffixes` (callers never pass an empty list).
    fn page_has(&mut self, page: usize, suffixes: &[Vec<u8>]) -> bool {
        suffixes.iter().all(|suffix| {
            self.query.compose_key(page, suffix, &mut self.key);
            (self.exists)(&self.key)
        })
    }

    /// Pages covered by the leading complete groups of `group` pages (a group of 1 is the
    /// leading run of present pages); stops at the first missing page.
    fn leading_run(&mut self, suffixes: &[Vec<u8>], group: usize) -> usize {
        let pages = self.query.page_keys.len();
        let mut covered = 0;
        while covered + group <= pages
            && (covered..covered + group).all(|i| self.page_has(i, suffixes))
        {
            covered += group;
        }
        covered
    }
}

impl ExistsV2Answer {
    /// The shape [`evaluate`] guarantees for a span of `pages` pages: every count within the
    /// span, restorable prefixes strictly ascending from 1, `kv_hit_pages` their largest (0 when
    /// there is none) and never past the KV verdict, the KV verdict listed first.
    pub fn check_invariants(&self, pages: usize) -> Result<(), &'static str> {
        let within = |n: u32| n as usize <= pages;
        if !within(self.kv_hit_pages) || !self.pool_hit_pages.iter().all(|(_, n)| within(*n)) {
            return Err("a page count past the queried span");
        }
        if !self.restorable_prefix_pages.windows(2).all(|w| w[0] < w[1])
            || self
                .restorable_prefix_pages
                .first()
                .is_some_and(|&p| p == 0)
        {
            return Err("restorable prefixes not strictly ascending from 1");
        }
        if self.restorable_prefix_pages.last().copied().unwrap_or(0) != self.kv_hit_pages {
            return Err("kv hit is not the largest restorable prefix");
        }
        match self.pool_hit_pages.first() {
            None if pages == 0 => Ok(()),
            Some((name, kv)) if name == "kv" && self.kv_hit_pages <= *kv => Ok(()),
            _ => Err("the KV verdict is not first or is below the kv hit"),
        }
    }
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

    fn pool(name: &str, policy: HitPolicy) -> PoolQuery {
        PoolQuery {
            name: name.into(),
            suffixes: vec![format!(".{name}").into_bytes()],
            policy,
        }
    }

    /// A store holding KV for `kv` pages and each `(pool, pages present)`.
    fn store(kv: std::ops::Range<usize>, pools: &[(&str, &[usize])]) -> HashSet<Vec<u8>> {
        let mut keys = HashSet::new();
        for i in kv {
            keys.insert(format!("t/p{i}.k").into_bytes());
            keys.insert(format!("t/p{i}.v").into_bytes());
        }
        for (name, pages) in pools {
            for i in pages.iter() {
                keys.insert(format!("t/p{i}.{name}").into_bytes());
            }
        }
        keys
    }

    fn run(q: &ExistsV2Query, s: &HashSet<Vec<u8>>) -> ExistsV2Answer {
        evaluate(q, |k| s.contains(k)).expect("within the work bound")
    }

    fn verdicts(a: &ExistsV2Answer) -> Vec<(&str, u32)> {
        a.pool_hit_pages
            .iter()
            .map(|(n, p)| (n.as_str(), *p))
            .collect()
    }

    #[test]
    fn kv_prefix_needs_every_component() {
        let mut s = store(0..1, &[]);
        s.insert(b"t/p1.k".to_vec());
        s.insert(b"t/p2.k".to_vec());
        s.insert(b"t/p2.v".to_vec());
        let a = run(&query(3, vec![]), &s);
        assert_eq!(a.kv_hit_pages, 1);
        assert_eq!(a.restorable_prefix_pages, vec![1]);
        assert_eq!(verdicts(&a), vec![("kv", 1)]);
    }

    #[test]
    fn trailing_state_with_holes() {
        // State exists at pages 1 and 3 (prefixes 2 and 4), not at 2 (prefix 3).
        let s = store(0..5, &[("st", &[1, 3])]);
        let q = query(5, vec![pool("st", HitPolicy::TrailingPages { window: 1 })]);
        let a = run(&q, &s);
        assert_eq!(a.restorable_prefix_pages, vec![2, 4]);
        assert_eq!(a.kv_hit_pages, 4);
        assert_eq!(verdicts(&a), vec![("kv", 5), ("st", 4)]);
    }

    #[test]
    fn block_groups_report_but_never_gate() {
        let s = store(0..6, &[("bg", &[0, 1, 2, 3, 5])]);
        let q = query(
            6,
            vec![pool("bg", HitPolicy::BlockGroups { group_pages: 2 })],
        );
        let a = run(&q, &s);
        assert_eq!(a.kv_hit_pages, 6);
        assert_eq!(verdicts(&a), vec![("kv", 6), ("bg", 4)]);
    }

    #[test]
    fn logical_anchor_lets_side_pools_decide() {
        let s = store(0..0, &[("swa", &[0, 1]), ("c4", &[0, 1, 2])]);
        let mut q = query(
            3,
            vec![
                pool("c4", HitPolicy::AllPages),
                pool("swa", HitPolicy::TrailingPages { window: 2 }),
            ],
        );
        q.kv = KvComponents::Logical;
        let a = run(&q, &s);
        assert_eq!(a.kv_hit_pages, 2);
        assert_eq!(a.restorable_prefix_pages, vec![1, 2]);
        assert_eq!(verdicts(&a), vec![("kv", 3), ("c4", 3), ("swa", 2)]);
    }

    /// The shapes: a pool after a gating pool still reports its own whole boundary.
    #[test]
    fn every_pool_reports_its_own_boundary_not_the_folded_cut() {
        let all: &[usize] = &[0, 1, 2, 3, 4, 5];
        // C4 misses page 3; the indexer is complete.
        let s = store(0..6, &[("c4", &[0, 1, 2, 4, 5]), ("idx", all)]);
        let q = query(
            6,
            vec![
                pool("c4", HitPolicy::AllPages),
                pool("idx", HitPolicy::AllPages),
            ],
        );
        let a = run(&q, &s);
        assert_eq!(verdicts(&a), vec![("kv", 6), ("c4", 3), ("idx", 6)]);
        assert_eq!(a.kv_hit_pages, 3);
        // SWA misses its last page; C4 (after it) is complete.
        let s = store(0..6, &[("swa", &[0, 1, 2, 3, 4]), ("c4", all)]);
        let q = query(
            6,
            vec![
                pool("swa", HitPolicy::TrailingPages { window: 2 }),
                pool("c4", HitPolicy::AllPages),
            ],
        );
        let a = run(&q, &s);
        assert_eq!(verdicts(&a), vec![("kv", 6), ("swa", 5), ("c4", 6)]);
        assert_eq!((a.kv_hit_pages, a.restorable_prefix_pages.len()), (5, 5));
        // Once the fold reaches 0 every later pool still gets its verdict, 0 included.
        let s = store(0..6, &[("idx", all)]);
        let q = query(
            6,
            vec![
                pool("c4", HitPolicy::AllPages),
                pool("idx", HitPolicy::AllPages),
                pool("st", HitPolicy::TrailingPages { window: 1 }),
            ],
        );
        let a = run(&q, &s);
        assert_eq!(
            verdicts(&a),
            vec![("kv", 6), ("c4", 0), ("idx", 6), ("st", 0)]
        );
        assert_eq!(a.kv_hit_pages, 0);
        assert!(a.restorable_prefix_pages.is_empty());
    }

    #[test]
    fn a_pool_without_suffixes_has_no_verdict() {
        let s = store(0..4, &[]);
        let mut unknown = pool("unknown", HitPolicy::AllPages);
        unknown.suffixes.clear();
        let mut groups = pool("groups", HitPolicy::BlockGroups { group_pages: 2 });
        groups.suffixes.clear();
        let a = run(&query(4, vec![groups.clone()]), &s);
        assert_eq!((a.kv_hit_pages, verdicts(&a)), (4, vec![("kv", 4)]));
        let a = run(&query(4, vec![unknown, groups]), &s);
        assert_eq!((a.kv_hit_pages, verdicts(&a)), (0, vec![("kv", 4)]));
    }

    #[test]
    fn a_window_past_the_span_asks_for_every_page() {
        let s = store(0..4, &[("swa", &[0, 1, 2, 3])]);
        let q = query(
            4,
            vec![pool("swa", HitPolicy::TrailingPages { window: u32::MAX })],
        );
        let a = run(&q, &s);
        assert_eq!(a.restorable_prefix_pages, vec![1, 2, 3, 4]);
        let s = store(0..4, &[("swa", &[1, 2, 3])]);
        let a = run(&q, &s);
        assert!(a.restorable_prefix_pages.is_empty());
        assert_eq!(verdicts(&a), vec![("kv", 4), ("swa", 0)]);
    }

    #[test]
    fn queries_over_the_work_bound_are_refused_by_name() {
        let mut q = query(MAX_PAGES_PER_QUERY, vec![]);
        q.pools = (0..2)
            .map(|i| PoolQuery {
                name: format!("wide{i}"),
                suffixes: (0..64).map(|s| format!(".{s}").into_bytes()).collect(),
                policy: HitPolicy::AllPages,
            })
            .collect();
        let error = evaluate(&q, |_| true).expect_err("over the bound");
        assert!(error.to_string().contains("presence lookups"), "{error}");
        assert!(q.check_work().is_err());
        q.pools.truncate(0);
        assert!(q.check_work().is_ok());
    }
}
