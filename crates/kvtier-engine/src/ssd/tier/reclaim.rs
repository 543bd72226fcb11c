//! Reclaim: evicting whole segments when space runs low (on demand by a writer, or by the
//! background thread between the high and low watermarks) and the background thread itself
//! (relaxed-mode syncs, watermark reclaim).
//!
//! Owns: the victim choice (the cold window here, the pick behind [`SegmentVictimPolicy`]).
//! Invariant: a victim is a sealed segment with no write in flight;
//! its index entries are dropped and its in-flight reads drained before its generation is
//! bumped and its header rewritten free.

use super::*;

/// The reclaim / relaxed-sync thread.
pub(super) fn background(sh: &Shared) {
    let mut last_sync = Instant::now();
    loop {
        {
            let mut stop = sh.stop.flag.lock();
            if *stop {
                break;
            }
            sh.stop
                .changed
                .wait_for(&mut stop, Duration::from_millis(100));
            if *stop {
                break;
            }
        }
        {
            let _m = sh.mutation.read_recursive();
            let total = f64::from(sh.segments.table.lock().max_segments);
            let high = (sh.settings.high * total).ceil() as u64;
            let low = (sh.settings.low * total).floor() as u64;
            let used = sh.segments.table.lock().in_use();
            if used >= high.max(1) {
                let mut used = used;
                while used > low && sh.evict_one() {
                    used -= 1;
                }
            }
        }
        if !sh.settings.strict && last_sync.elapsed() >= RELAXED_SYNC_EVERY {
            let _ = sh.sync_dirty();
            last_sync = Instant::now();
        }
    }
}

impl Shared {
    /// Pick and evict one sealed segment. Returns whether one was evicted.
    pub(super) fn evict_one(&self) -> bool {
        let (victim, generation, keys) = {
            let mut t = self.segments.table.lock();
            let Some(v) = self.pick_victim(&t) else {
                return false;
            };
            let m = &mut t.slots[v as usize];
            m.state = SegState::Evicting;
            let keys = std::mem::take(&mut m.keys);
            let generation = m.generation;
            while t.slots[v as usize].inflight > 0 {
                self.segments.table_cv.wait(&mut t);
            }
            (v, generation, keys)
        };
        let mut n = 0;
        for key in &keys {
            let mut shard = self.index.shard(key).write();
            if let Some(e) = shard.get(&**key) {
                if e.seg == victim && e.generation == generation {
                    let e = *e;
                    shard.remove(&**key);
                    self.groups.removed(key);
                    self.unaccount(&e);
                    n += 1;
                }
            }
        }
        self.invalidate_checkpoint();
        let new_gen = self.next_seq();
        {
            let mut g = self.segments.slot_gens[victim as usize].write();
            // A failed header write leaves an in-use header: its records would be recovered
            // after a restart (they are intact), which is harmless for a cache.
            let _ = self.write_seg_header(victim, new_gen, false);
            *g = new_gen;
        }
        let mut t = self.segments.table.lock();
        let m = &mut t.slots[victim as usize];
        *m = SegMeta::new(SegState::Free);
        m.generation = new_gen;
        drop(t);
        inc(&self.c.evicted_segments, 1);
        inc(&self.c.evicted_objects, n);
        true
    }

    /// The victim among sealed segments with no write in flight: an empty one if any, else
    /// the policy's pick among the coldest quarter (by last access).
    pub(super) fn pick_victim(&self, t: &SegTable) -> Option<u32> {
        let mut sealed: Vec<(u32, &SegMeta)> = t
            .slots
            .iter()
            .enumerate()
            .filter(|(_, m)| m.state == SegState::Sealed && m.inflight == 0)
            .map(|(i, m)| (i as u32, m))
            .collect();
        if let Some((i, _)) = sealed.iter().find(|(_, m)| m.live_objects == 0) {
            return Some(*i);
        }
        sealed.sort_by_key(|(_, m)| m.last_access);
        let window = sealed.len().div_ceil(4).max(1);
        let cold = &sealed[..window.min(sealed.len())];
        let victim = self.victim.pick(cold);
        if let Some(v) = victim {
            debug_assert!(
                cold.iter().any(|(i, _)| *i == v),
                "victim {v} is not a candidate"
            );
        }
        victim
    }
}

/// Which sealed segment to evict, among candidates the reclaimer already narrowed to the
/// coldest (the segment-level counterpart of the DRAM tier's `EvictionPolicy`).
pub(super) trait SegmentVictimPolicy: Send + Sync {
    /// `cold`: sealed segments with live objects and no I/O in flight, coldest first (never
    /// empty when called by the reclaimer); the one to evict, or `None`.
    fn pick(&self, cold: &[(u32, &SegMeta)]) -> Option<u32>;
}

/// `lru`: the coldest segment.
struct ColdestSegment;

impl SegmentVictimPolicy for ColdestSegment {
    fn pick(&self, cold: &[(u32, &SegMeta)]) -> Option<u32> {
        cold.first().map(|(i, _)| *i)
    }
}

/// `prefix_depth`: the segment whose live objects are deepest in their prefix chains on
/// average (the least reusable pages), ties to the colder one.
struct DeepestPrefixes;

impl SegmentVictimPolicy for DeepestPrefixes {
    fn pick(&self, cold: &[(u32, &SegMeta)]) -> Option<u32> {
        cold.iter()
            .max_by(|(_, a), (_, b)| {
                let da = a.depth_sum as f64 / a.live_objects.max(1) as f64;
                let db = b.depth_sum as f64 / b.live_objects.max(1) as f64;
                da.total_cmp(&db).then(b.last_access.cmp(&a.last_access))
            })
            .map(|(i, _)| *i)
    }
}

/// The segment victim policy that goes with the engine's eviction policy.
pub(super) fn victim_policy(kind: EvictionPolicyKind) -> Box<dyn SegmentVictimPolicy> {
    match kind {
        EvictionPolicyKind::Lru => Box::new(ColdestSegment),
        EvictionPolicyKind::PrefixDepth => Box::new(DeepestPrefixes),
    }
}
