//! Block allocator of the DRAM arena.
//!
//! Owns: which blocks are free. It is plain data (no `unsafe`, no locking of its own: the tier
//! wraps it in one mutex) so it can be tested in isolation.
//!
//! Policy: an object of `n` blocks gets, if any free extent is large enough, the smallest such
//! extent (best fit, lowest start on ties), split from its front. Otherwise it takes the
//! largest free extents whole until the rest fits one extent best-fit, which keeps the extent
//! count of a fragmented allocation near its minimum. Allocation therefore succeeds exactly
//! when `free_blocks() >= n`.
//!
//! Invariants (checked by [`Allocator::check`]): free extents are non-empty, inside the arena,
//! disjoint and never adjacent (freeing coalesces with both neighbours); the two indexes
//! (`by_start`, `by_size`) describe the same set; `free_blocks` is their total. Freeing a block
//! that is already free panics: that is a bug that would otherwise alias two objects.

use std::collections::{BTreeMap, BTreeSet};

/// A run of `count` blocks starting at block `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Extent {
    pub start: u32,
    pub count: u32,
}

impl Extent {
    fn end(&self) -> u32 {
        self.start + self.count
    }
}

/// Free-extent allocator over `total_blocks` blocks.
#[derive(Debug)]
pub struct Allocator {
    /// start → count.
    by_start: BTreeMap<u32, u32>,
    /// (count, start), for best fit.
    by_size: BTreeSet<(u32, u32)>,
    free_blocks: u64,
    total_blocks: u32,
}

impl Allocator {
    /// All `total_blocks` blocks free, as one extent.
    pub fn new(total_blocks: u32) -> Allocator {
        let mut a = Allocator {
            by_start: BTreeMap::new(),
            by_size: BTreeSet::new(),
            free_blocks: 0,
            total_blocks,
        };
        if total_blocks > 0 {
            a.insert_free(Extent {
                start: 0,
                count: total_blocks,
            });
        }
        a
    }

    pub fn total_blocks(&self) -> u32 {
        self.total_blocks
    }

    pub fn free_blocks(&self) -> u64 {
        self.free_blocks
    }

    /// Number of free extents (a fragmentation measure).
    pub fn free_extents(&self) -> usize {
        self.by_start.len()
    }

    /// Allocate `blocks` blocks, appending the extents to `out`. All or nothing: returns
    /// `false` and leaves `out` and the free set untouched when fewer blocks are free.
    pub fn allocate(&mut self, blocks: u32, out: &mut Vec<Extent>) -> bool {
        if u64::from(blocks) > self.free_blocks {
            return false;
        }
        let mut remaining = blocks;
        while remaining > 0 {
            let pick = match self.by_size.range((remaining, 0)..).next() {
                Some(&(count, start)) => Extent { start, count },
                // No single extent fits the rest: take the largest whole. It exists because
                // free_blocks >= remaining > 0.
                None => match self.by_size.last() {
                    Some(&(count, start)) => Extent { start, count },
                    None => unreachable!("free_blocks > 0 but no free extent"),
                },
            };
            self.remove_free(pick);
            let take = pick.count.min(remaining);
            if take < pick.count {
                self.insert_free(Extent {
                    start: pick.start + take,
                    count: pick.count - take,
                });
            }
            out.push(Extent {
                start: pick.start,
                count: take,
            });
            remaining -= take;
        }
        true
    }

    /// Return `extents` to the free set, coalescing with free neighbours.
    ///
    /// # Panics
    /// If an extent is empty, outside the arena, or overlaps a free block (double free).
    pub fn free(&mut self, extents: &[Extent]) {
        for &e in extents {
            assert!(
                e.count > 0
                    && e.start
                        .checked_add(e.count)
                        .is_some_and(|end| end <= self.total_blocks),
                "freeing invalid extent {e:?} (arena has {} blocks)",
                self.total_blocks
            );
            let mut merged = e;
            if let Some((&ps, &pc)) = self.by_start.range(..e.start).next_back() {
                let prev = Extent {
                    start: ps,
                    count: pc,
                };
                assert!(
                    prev.end() <= e.start,
                    "double free: {e:?} overlaps free {prev:?}"
                );
                if prev.end() == e.start {
                    self.remove_free(prev);
                    merged = Extent {
                        start: prev.start,
                        count: prev.count + merged.count,
                    };
                }
            }
            if let Some((&ns, &nc)) = self.by_start.range(e.start..).next() {
                let next = Extent {
                    start: ns,
                    count: nc,
                };
                assert!(
                    e.end() <= next.start,
                    "double free: {e:?} overlaps free {next:?}"
                );
                if e.end() == next.start {
                    self.remove_free(next);
                    merged.count += next.count;
                }
            }
            self.insert_free(merged);
        }
    }

    fn insert_free(&mut self, e: Extent) {
        self.by_start.insert(e.start, e.count);
        self.by_size.insert((e.count, e.start));
        self.free_blocks += u64::from(e.count);
    }

    fn remove_free(&mut self, e: Extent) {
        self.by_start.remove(&e.start);
        self.by_size.remove(&(e.count, e.start));
        self.free_blocks -= u64::from(e.count);
    }

    /// Verify every invariant of the module docs.
    pub fn check(&self) -> Result<(), String> {
        if self.by_start.len() != self.by_size.len() {
            return Err(format!(
                "index sizes differ: {} by start, {} by size",
                self.by_start.len(),
                self.by_size.len()
            ));
        }
        let mut sum = 0u64;
        let mut prev_end: Option<u32> = None;
        for (&start, &count) in &self.by_start {
            let e = Extent { start, count };
            if count == 0 || u64::from(start) + u64::from(count) > u64::from(self.total_blocks) {
                return Err(format!("bad free extent {e:?}"));
            }
            if !self.by_size.contains(&(count, start)) {
                return Err(format!("{e:?} missing from the size index"));
            }
            if let Some(end) = prev_end {
                if start < end {
                    return Err(format!("{e:?} overlaps the previous free extent"));
                }
                if start == end {
                    return Err(format!(
                        "{e:?} is adjacent to the previous one (not coalesced)"
                    ));
                }
            }
            prev_end = Some(e.end());
            sum += u64::from(count);
        }
        if sum != self.free_blocks {
            return Err(format!(
                "free_blocks {} but extents total {sum}",
                self.free_blocks
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(a: &mut Allocator, n: u32) -> Vec<Extent> {
        let mut v = Vec::new();
        assert!(a.allocate(n, &mut v), "allocating {n} blocks");
        a.check().unwrap();
        assert_eq!(v.iter().map(|e| e.count).sum::<u32>(), n);
        v
    }

    #[test]
    fn contiguous_when_possible() {
        let mut a = Allocator::new(16);
        let x = alloc(&mut a, 3);
        assert_eq!(x, vec![Extent { start: 0, count: 3 }]);
        let y = alloc(&mut a, 5);
        assert_eq!(y, vec![Extent { start: 3, count: 5 }]);
        assert_eq!(a.free_blocks(), 8);
    }

    #[test]
    fn all_or_nothing() {
        let mut a = Allocator::new(4);
        let _x = alloc(&mut a, 3);
        let mut v = Vec::new();
        assert!(!a.allocate(2, &mut v));
        assert!(v.is_empty());
        assert_eq!(a.free_blocks(), 1);
        a.check().unwrap();
    }

    #[test]
    fn best_fit_picks_the_smallest_hole() {
        let mut a = Allocator::new(20);
        let blocks: Vec<_> = [4, 1, 2, 1, 6, 1]
            .iter()
            .map(|&n| alloc(&mut a, n))
            .collect();
        // Free the 4-, 2- and 6-block objects: holes of 4 at 0, 2 at 5, 6 at 8 (+ tail of 5).
        a.free(&blocks[0]);
        a.free(&blocks[2]);
        a.free(&blocks[4]);
        a.check().unwrap();
        assert_eq!(alloc(&mut a, 2), vec![Extent { start: 5, count: 2 }]);
        assert_eq!(alloc(&mut a, 3), vec![Extent { start: 0, count: 3 }]);
        assert_eq!(
            alloc(&mut a, 5),
            vec![Extent {
                start: 15,
                count: 5
            }]
        );
    }

    #[test]
    fn fragmented_falls_back_to_several_extents() {
        let mut a = Allocator::new(10);
        let singles: Vec<_> = (0..10).map(|_| alloc(&mut a, 1)).collect();
        // Free every other block: five 1-block holes, no two adjacent.
        for s in singles.iter().step_by(2) {
            a.free(s);
        }
        a.check().unwrap();
        assert_eq!(a.free_extents(), 5);
        let got = alloc(&mut a, 4);
        assert_eq!(got.len(), 4, "four separate extents: {got:?}");
        assert_eq!(a.free_blocks(), 1);
        let mut starts: Vec<u32> = got.iter().map(|e| e.start).collect();
        starts.sort();
        starts.dedup();
        assert_eq!(starts.len(), 4);
    }

    #[test]
    fn fallback_takes_largest_first() {
        let mut a = Allocator::new(12);
        let v: Vec<_> = [3, 1, 2, 1, 4, 1]
            .iter()
            .map(|&n| alloc(&mut a, n))
            .collect();
        a.free(&v[0]);
        a.free(&v[2]);
        a.free(&v[4]);
        // Holes 3, 2, 4 (9 free). 8 blocks: largest (4) whole, then 3, then 1 of the 2-hole.
        let got = alloc(&mut a, 8);
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0], Extent { start: 7, count: 4 });
        assert_eq!(got[1], Extent { start: 0, count: 3 });
        assert_eq!(got[2].count, 1);
    }

    #[test]
    fn coalescing_restores_one_extent() {
        let mut a = Allocator::new(32);
        let v: Vec<_> = (0..8).map(|i| alloc(&mut a, i % 3 + 1)).collect();
        let used: u32 = v.iter().flatten().map(|e| e.count).sum();
        assert_eq!(a.free_blocks(), u64::from(32 - used));
        // Free in a scrambled order; each step must stay coalesced.
        for i in [3, 0, 7, 5, 1, 6, 2, 4] {
            a.free(&v[i]);
            a.check().unwrap();
        }
        assert_eq!(a.free_extents(), 1);
        assert_eq!(a.free_blocks(), 32);
        assert_eq!(
            alloc(&mut a, 32),
            vec![Extent {
                start: 0,
                count: 32
            }]
        );
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = Allocator::new(8);
        let x = alloc(&mut a, 2);
        a.free(&x);
        a.free(&x);
    }

    #[test]
    fn zero_blocks_is_trivially_satisfied() {
        let mut a = Allocator::new(1);
        let mut v = Vec::new();
        assert!(a.allocate(0, &mut v));
        assert!(v.is_empty());
        assert_eq!(a.free_blocks(), 1);
    }
}
