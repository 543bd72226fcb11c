//! [`SsdTier::check_invariants`]: the invariants the other files of this module state in
//! prose, checked against the live state (issue 16). Test-only in spirit: it walks the whole
//! index and the segment table, so it is called from [`crate::Engine::check_invariants`]
//! (model, SSD and stress tests) and never from a release path.
//!
//! Checked (each names the file whose doc states it):
//! - `index`: every entry names a segment that holds records (active, sealed or evicting) of
//!   the entry's generation, which is the slot's current generation (table and slot lock
//!   agree), and a record that lies inside the written part of that segment.
//! - `segments`: a segment's `live_objects` / `live_bytes` / `depth_sum` are the count and
//!   sums of the index entries that point into it; the tier counters (`objects`,
//!   `bytes_used`, `bytes_allocated`) are the same sums over the whole index; every entry's
//!   key is in its segment's key list (except while the segment is being evicted, whose list
//!   the evictor took); at most one segment is active and `active` names it; free and
//!   missing segments hold nothing and have no write in flight; `write_off` stays within the
//!   segment.
//! - `pipeline` / `reclaim`: the copy queue never holds more than `queue_depth` jobs; with
//!   the pipeline idle no reservation is in flight; sequence numbers handed to records and
//!   generations are below the tier's next sequence number.
//!
//! Meaningful only at quiescence (as `Engine::verify_accounting`): `remove` unlinks an entry
//! before it unaccounts it, so a concurrent removal can be seen half done.

use std::collections::HashSet;

use super::*;

#[derive(Default, Clone, Copy)]
struct Sums {
    objects: u64,
    rec_bytes: u64,
    depth: u64,
}

impl SsdTier {
    /// Check the invariants listed in this file's module doc. `Err` names the first broken one.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let sh = &self.sh;
        // Lock order: mutation → SSD index shards → segment table → slot generation locks.
        let _m = sh.mutation.read_recursive();
        let shards: Vec<_> = sh.index.shards.iter().map(|s| s.read()).collect();
        let t = sh.segments.table.lock();
        let next_seq = sh.seq.load(Relaxed);
        if t.slots.len() != sh.settings.nseg as usize
            || sh.segments.slot_gens.len() != sh.settings.nseg as usize
        {
            return Err(format!(
                "ssd: {} slots / {} generation locks for {} segments",
                t.slots.len(),
                sh.segments.slot_gens.len(),
                sh.settings.nseg
            ));
        }
        let mut per_seg = vec![Sums::default(); t.slots.len()];
        let key_sets: Vec<Option<HashSet<&[u8]>>> = t
            .slots
            .iter()
            .map(|m| {
                (m.state != SegState::Evicting)
                    .then(|| m.keys.iter().map(|k| &**k).collect::<HashSet<&[u8]>>())
            })
            .collect();
        let (mut objects, mut payload, mut allocated) = (0u64, 0u64, 0u64);
        for shard in &shards {
            for (key, e) in shard.iter() {
                check_entry(key, e, &t, sh.settings.nseg, next_seq, &key_sets)?;
                let s = &mut per_seg[e.seg as usize];
                s.objects += 1;
                s.rec_bytes += e.loc.rec_len;
                s.depth += u64::from(e.loc.depth.unwrap_or(0));
                objects += 1;
                payload += e.loc.payload_len;
                allocated += e.loc.rec_len;
            }
        }
        let mut active = Vec::new();
        for (i, (m, s)) in t.slots.iter().zip(&per_seg).enumerate() {
            check_segment(i, m, s, sh, next_seq)?;
            if m.state == SegState::Active {
                active.push(i as u32);
            }
        }
        if active.len() > 1 || t.active.map(|a| vec![a]).unwrap_or_default() != active {
            return Err(format!(
                "ssd: active segment {:?} but segments {active:?} are in state Active",
                t.active
            ));
        }
        let inflight: u64 = t.slots.iter().map(|m| u64::from(m.inflight)).sum();
        drop(t);
        drop(shards);
        let c = (
            sh.c.objects.load(Relaxed),
            sh.c.bytes_used.load(Relaxed),
            sh.c.bytes_allocated.load(Relaxed),
        );
        if c != (objects, payload, allocated) {
            return Err(format!(
                "ssd: counters say {} objects / {} bytes used / {} allocated, the index {objects} \
                 / {payload} / {allocated}",
                c.0, c.1, c.2
            ));
        }
        let q = sh.copies.queue.lock();
        if q.jobs.len() > sh.settings.queue_depth {
            return Err(format!(
                "ssd: copy queue holds {} jobs, depth {}",
                q.jobs.len(),
                sh.settings.queue_depth
            ));
        }
        if q.jobs.is_empty() && q.running == 0 && inflight != 0 {
            return Err(format!(
                "ssd: pipeline idle but {inflight} reservations in flight"
            ));
        }
        Ok(())
    }
}

/// The invariants of one index entry against the segment table.
fn check_entry(
    key: &[u8],
    e: &SsdEntry,
    t: &SegTable,
    nseg: u32,
    next_seq: u64,
    key_sets: &[Option<HashSet<&[u8]>>],
) -> Result<(), String> {
    let name = String::from_utf8_lossy(key);
    let Some(m) = t.slots.get(e.seg as usize) else {
        return Err(format!(
            "ssd: entry {name} names segment {} of {}",
            e.seg, nseg
        ));
    };
    if !matches!(
        m.state,
        SegState::Active | SegState::Sealed | SegState::Evicting
    ) {
        return Err(format!(
            "ssd: entry {name} names segment {} in state {:?}",
            e.seg, m.state
        ));
    }
    if e.generation != m.generation {
        return Err(format!(
            "ssd: entry {name} has generation {} but segment {} is at {}",
            e.generation, e.seg, m.generation
        ));
    }
    let end = e.loc.offset.checked_add(e.loc.rec_len);
    if e.loc.offset < FIRST_RECORD || end.is_none_or(|end| end > m.write_off) {
        return Err(format!(
            "ssd: entry {name} record [{}, +{}) outside segment {}'s written part \
             [{FIRST_RECORD}, {})",
            e.loc.offset, e.loc.rec_len, e.seg, m.write_off
        ));
    }
    if u64::from(e.loc.payload_offset)
        .checked_add(e.loc.payload_len)
        .is_none_or(|p| p > e.loc.rec_len)
    {
        return Err(format!(
            "ssd: entry {name} payload [{}, +{}) outside its record of {} bytes",
            e.loc.payload_offset, e.loc.payload_len, e.loc.rec_len
        ));
    }
    if e.loc.seq >= next_seq || e.generation >= next_seq {
        return Err(format!(
            "ssd: entry {name} seq {} / generation {} not below next seq {next_seq}",
            e.loc.seq, e.generation
        ));
    }
    if let Some(keys) = &key_sets[e.seg as usize] {
        if !keys.contains(key) {
            return Err(format!(
                "ssd: entry {name} missing from segment {}'s key list",
                e.seg
            ));
        }
    }
    Ok(())
}

/// The invariants of segment `i` (its accounting against what the index points into it).
fn check_segment(
    i: usize,
    m: &SegMeta,
    s: &Sums,
    sh: &Shared,
    next_seq: u64,
) -> Result<(), String> {
    if (m.live_objects, m.live_bytes, m.depth_sum) != (s.objects, s.rec_bytes, s.depth) {
        return Err(format!(
            "ssd: segment {i} ({:?}) accounts {} objects / {} bytes / depth {} but the \
                 index points {} / {} / {} into it",
            m.state, m.live_objects, m.live_bytes, m.depth_sum, s.objects, s.rec_bytes, s.depth
        ));
    }
    if m.write_off < FIRST_RECORD || m.write_off > sh.settings.seg_size {
        return Err(format!(
            "ssd: segment {i} write offset {} outside [{FIRST_RECORD}, {}]",
            m.write_off, sh.settings.seg_size
        ));
    }
    match m.state {
        SegState::Active => {}
        SegState::Free | SegState::Missing => {
            if m.inflight != 0 || !m.keys.is_empty() {
                return Err(format!(
                    "ssd: {:?} segment {i} has {} writes in flight and {} keys",
                    m.state,
                    m.inflight,
                    m.keys.len()
                ));
            }
        }
        SegState::Sealed | SegState::Evicting => {}
    }
    if m.state != SegState::Missing && m.generation >= next_seq {
        return Err(format!(
            "ssd: segment {i} generation {} not below next seq {next_seq}",
            m.generation
        ));
    }
    // The evictor bumps the slot lock's generation before the table's (window).
    if m.state != SegState::Evicting {
        let g = *sh.segments.slot_gens[i].read();
        if g != m.generation {
            return Err(format!(
                "ssd: segment {i} generation {} in the table but {g} in its slot lock",
                m.generation
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::{Engine, PutMeta};

    fn engine(dir: &Path) -> Engine {
        let config = EngineConfig {
            dram_capacity_bytes: 16 * 4096,
            dram_block_size: 4096,
            index_shards: 4,
            ssd_enabled: true,
            ssd_storage_dir: dir.to_path_buf(),
            ssd_segment_size_bytes: 1 << 20,
            ssd_capacity_bytes: 4 << 20,
            ssd_copy_async: false,
            ..EngineConfig::default()
        };
        let e = Engine::open(config).unwrap();
        for k in 0..40u32 {
            let meta = PutMeta { depth: Some(k % 5) };
            e.put(
                format!("k/{k}").as_bytes(),
                &vec![k as u8; 3000 + k as usize],
                meta,
            )
            .unwrap();
        }
        e.flush().unwrap();
        e
    }

    /// The checker holds on a healthy tier and names each invariant a corruption breaks
    /// (so the model / stress tests that run it can fail).
    #[test]
    fn each_broken_invariant_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let e = engine(dir.path());
        let tier = e.ssd_tier().unwrap();
        let sh = &tier.sh;
        tier.check_invariants().unwrap();
        let seg = sh.index.get(b"k/7").unwrap().seg as usize;

        sh.segments.table.lock().slots[seg].live_bytes += 1;
        let err = tier.check_invariants().unwrap_err();
        assert!(
            err.contains(&format!("segment {seg}")) && err.contains("accounts"),
            "{err}"
        );
        sh.segments.table.lock().slots[seg].live_bytes -= 1;
        tier.check_invariants().unwrap();

        inc(&sh.c.bytes_used, 1);
        let err = tier.check_invariants().unwrap_err();
        assert!(err.contains("counters"), "{err}");
        dec(&sh.c.bytes_used, 1);

        let gen = sh.segments.table.lock().slots[seg].generation;
        sh.segments.table.lock().slots[seg].generation = gen + 1;
        let err = tier.check_invariants().unwrap_err();
        assert!(err.contains("has generation"), "{err}");
        sh.segments.table.lock().slots[seg].generation = gen;

        let key: Arc<[u8]> = Arc::from(&b"k/7"[..]);
        let keys = std::mem::take(&mut sh.segments.table.lock().slots[seg].keys);
        let err = tier.check_invariants().unwrap_err();
        assert!(err.contains("key list"), "{err}");
        sh.segments.table.lock().slots[seg].keys = keys;

        let e7 = sh.index.shard(&key).write().remove(&*key).unwrap();
        let err = tier.check_invariants().unwrap_err();
        assert!(err.contains("accounts"), "{err}");
        sh.index.shard(&key).write().insert(key, e7);

        let active = sh.segments.table.lock().active.take();
        let err = tier.check_invariants().unwrap_err();
        assert!(err.contains("active segment"), "{err}");
        sh.segments.table.lock().active = active;
        tier.check_invariants().unwrap();
    }
}
