//! The SSD tier through the public API: tiering, warm restart (checkpoint and scan),
//! removal that survives restart, corruption and truncation, faults, reclaim.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::{len_for, read, ssd_config, value_for, Rng};
use kvtier_engine::{
    fsck, Engine, EngineConfig, EngineError, PutMeta, PutOutcome, SsdDurabilityMode, SsdIoBackend,
    SsdWritePolicy,
};
use kvtier_proto::{ExistsV2Query, HitPolicy, KvComponents, PoolQuery};

fn key(k: u64) -> Vec<u8> {
    format!("ssd/{k}").into_bytes()
}

fn put_k(e: &Engine, k: u64) -> Result<PutOutcome, EngineError> {
    let key = key(k);
    let meta = PutMeta {
        depth: Some((k % 8) as u32),
    };
    e.put(&key, &value_for(&key, len_for(k)), meta)
}

fn assert_k(e: &Engine, k: u64) {
    let key = key(k);
    let got = read(e, &key);
    assert!(
        got.as_deref() == Some(&value_for(&key, len_for(k))[..]),
        "object {k} must read back exactly (got {:?} bytes)",
        got.map(|g| g.len())
    );
}

fn open(c: &EngineConfig) -> Engine {
    Engine::open(c.clone()).expect("open engine")
}

/// io_uring is used when asked for, unless this kernel refuses it (then posix, and the test
/// says so rather than passing silently on the wrong backend).
fn assert_backend(e: &Engine, backend: SsdIoBackend) {
    let uring = e.stats().ssd_io_uring;
    if backend == SsdIoBackend::IoUring && !uring {
        eprintln!("io_uring refused by this kernel: the io_uring case ran on posix");
        assert!(
            std::env::var_os("KVTIER_REQUIRE_IO_URING").is_none(),
            "KVTIER_REQUIRE_IO_URING is set but io_uring is unavailable"
        );
    } else {
        assert_eq!(uring, backend == SsdIoBackend::IoUring);
    }
}

fn strict(c: &mut EngineConfig) {
    c.ssd_durability_mode = SsdDurabilityMode::Strict;
}

fn segment_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kvt"))
        .collect();
    v.sort();
    v
}

#[test]
fn dram_misses_are_served_from_ssd_and_promoted() {
    dram_misses_scenario(SsdIoBackend::Posix);
}

#[test]
fn dram_misses_are_served_from_ssd_through_io_uring() {
    dram_misses_scenario(SsdIoBackend::IoUring);
}

fn dram_misses_scenario(backend: SsdIoBackend) {
    let dir = tempfile::tempdir().unwrap();
    // 16 DRAM blocks (64 KiB) against ~1.3 MB of objects: most live only on SSD.
    let c = ssd_config(dir.path(), 16, 16, |c| c.ssd_io_backend = backend);
    let e = open(&c);
    assert_backend(&e, backend);
    for k in 0..100 {
        assert_eq!(put_k(&e, k).unwrap(), PutOutcome::Stored);
    }
    e.flush().unwrap();
    let s = e.stats();
    assert!(s.ssd_enabled && s.evictions_capacity > 0, "{s:?}");
    assert_eq!(s.ssd_objects, 100, "{s:?}");
    e.check_invariants().unwrap(); // issue 16: SSD index / segment / pipeline invariants
    for k in 0..100 {
        assert!(e.contains(&key(k)));
        assert_eq!(e.object_len(&key(k)), Some(len_for(k) as u64));
        assert_eq!(put_k(&e, k).unwrap(), PutOutcome::AlreadyPresent);
        assert_k(&e, k);
    }
    let s = e.stats();
    assert!(s.ssd_hits > 0 && s.ssd_promotions > 0, "{s:?}");
    assert_eq!(s.ssd_checksum_failures, 0);
    assert_eq!(s.misses, 0);
    // A promoted object is now a DRAM hit.
    let before = e.stats().ssd_hits;
    assert_k(&e, 99);
    assert_k(&e, 99);
    assert!(e.stats().ssd_hits <= before + 1);
    // Size mismatch is checked before any SSD read.
    let mut wrong = vec![0xEE; len_for(3) + 1];
    assert!(matches!(
        e.get_into(&key(3), &mut wrong),
        Err(EngineError::SizeMismatch { .. })
    ));
    assert!(wrong.iter().all(|&b| b == 0xEE));
    // exists_v2 sees SSD objects.
    let q = ExistsV2Query {
        key_prefix: b"ssd/".to_vec(),
        page_keys: (0..5u64).map(|k| k.to_string().into_bytes()).collect(),
        kv: KvComponents::Suffixes(vec![Vec::new()]),
        pools: vec![PoolQuery {
            name: "p".into(),
            suffixes: vec![Vec::new()],
            policy: HitPolicy::AllPages,
        }],
    };
    assert_eq!(e.exists_v2(&q).unwrap().kv_hit_pages, 5);
    // A pin of an SSD-only object works too.
    let pin = e.pin(&key(0)).expect("pin");
    let mut out = vec![0u8; pin.len() as usize];
    pin.read_into(&mut out).unwrap();
    assert_eq!(out, value_for(&key(0), len_for(0)));
}

#[test]
fn ssd_objects_pin_even_when_every_dram_block_is_pinned() {
    let dir = tempfile::tempdir().unwrap();
    let c = ssd_config(dir.path(), 16, 16, |_| {});
    let e = open(&c);
    for k in 0..100 {
        assert_eq!(put_k(&e, k).unwrap(), PutOutcome::Stored);
    }
    e.flush().unwrap();
    // Hold every pin: the SSD-only objects' reads fill DRAM with pinned copies, and the
    // pins after that find no block to evict. Each must still hand out its bytes.
    let pins: Vec<_> = (0..100)
        .map(|k| {
            e.pin(&key(k))
                .unwrap_or_else(|| panic!("pin of object {k}"))
        })
        .collect();
    for (k, pin) in pins.iter().enumerate() {
        let k = k as u64;
        let want = value_for(&key(k), len_for(k));
        let mut out = vec![0u8; pin.len() as usize];
        pin.read_into(&mut out).unwrap();
        assert!(out == want, "object {k} read through its pin");
        let gathered: Vec<u8> = pin.slices().flatten().copied().collect();
        assert!(gathered == want, "object {k} through its slices");
    }
    // A put now has nowhere to go (all pinned), and loses nothing.
    assert!(matches!(
        e.put(b"late", &[1u8; 8192], PutMeta::default()),
        Err(EngineError::NoSpace { .. })
    ));
    drop(pins);
    for k in 0..100 {
        assert_k(&e, k);
    }
}

#[test]
fn warm_restart_from_checkpoint_and_from_scan() {
    warm_restart_scenario(SsdIoBackend::Posix);
}

#[test]
fn warm_restart_through_io_uring() {
    warm_restart_scenario(SsdIoBackend::IoUring);
}

fn warm_restart_scenario(backend: SsdIoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let c = ssd_config(dir.path(), 16, 16, |c| c.ssd_io_backend = backend);
    {
        let e = open(&c);
        for k in 0..200 {
            put_k(&e, k).unwrap();
        }
        assert!(e.remove(&key(7)));
        e.close().unwrap();
    }
    assert!(dir.path().join("index.ckpt").exists());
    for round in 0..2 {
        if round == 1 {
            std::fs::remove_file(dir.path().join("index.ckpt")).unwrap();
        }
        let e = open(&c);
        assert_backend(&e, backend);
        let r = e.recovery_report().unwrap();
        assert_eq!(r.used_checkpoint, round == 0, "{r:?}");
        // Round 1 also finds the object put after round 0's restart.
        assert_eq!(r.objects, 199 + round, "{r:?}");
        assert_eq!((r.scan.torn, r.scan.corrupt), (0, 0), "{r:?}");
        if round == 1 {
            assert!(r.segments_scanned > 0 && r.scan.bytes_scanned > 0, "{r:?}");
            assert_eq!(r.scan.removed, 1, "{r:?}");
        }
        for k in (0..200).filter(|&k| k != 7) {
            assert_k(&e, k);
        }
        assert!(!e.contains(&key(7)), "a removed object came back");
        assert_eq!(e.stats().ssd_recovered_objects, 199 + round);
        // A new put after restart goes to a new segment and also survives.
        put_k(&e, 1000 + round).unwrap();
        drop(e);
    }
    let e = open(&c);
    assert_k(&e, 1000);
    assert_k(&e, 1001);
    // Clear empties both tiers, durably.
    e.clear();
    assert!(!e.contains(&key(1)));
    drop(e);
    std::fs::remove_file(dir.path().join("index.ckpt")).unwrap();
    let e = open(&c);
    assert_eq!(e.stats().ssd_objects, 0);
    assert!(!e.contains(&key(1)) && !e.contains(&key(1000)));
}

#[test]
fn a_second_engine_cannot_open_the_same_directory() {
    let dir = tempfile::tempdir().unwrap();
    let c = ssd_config(dir.path(), 16, 4, |_| {});
    let _e = open(&c);
    match Engine::open(c) {
        Err(EngineError::SsdOpen(err)) => assert!(err.to_string().contains("in use"), "{err}"),
        other => panic!("expected SsdOpen, got {other:?}"),
    }
}

#[test]
fn strict_puts_are_on_disk_when_they_return() {
    let dir = tempfile::tempdir().unwrap();
    let c = ssd_config(dir.path(), 256, 8, strict);
    let e = open(&c);
    for k in 0..20 {
        put_k(&e, k).unwrap();
    }
    let s = e.stats();
    assert_eq!(s.ssd_objects, 20);
    assert!(s.ssd_syncs > 0 && s.ssd_copy_queue_depth == 0, "{s:?}");
    // Without flush or close: the on-disk records already verify.
    let report = fsck(dir.path()).unwrap();
    assert_eq!(report.counts.good, 20, "{report:?}");
    assert!(report.is_clean());
    std::mem::forget(e); // like a crash: no flush, no checkpoint
}

#[test]
fn corrupt_record_is_a_miss_and_the_rest_stays_readable() {
    corrupt_record_scenario(SsdIoBackend::Posix);
}

#[test]
fn corrupt_record_is_a_miss_through_io_uring() {
    corrupt_record_scenario(SsdIoBackend::IoUring);
}

fn corrupt_record_scenario(backend: SsdIoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let c = ssd_config(dir.path(), 16, 8, |c| {
        c.auto_promote_on_read = false;
        c.ssd_io_backend = backend;
    });
    let e = open(&c);
    for k in 0..30 {
        put_k(&e, k).unwrap();
    }
    e.close().unwrap();
    // Find each record (and the key it holds) by walking the first segment.
    let seg = &segment_files(dir.path())[0];
    let data = std::fs::read(seg).unwrap();
    let mut offsets = std::collections::HashMap::new();
    let mut pos = 4096;
    while pos + 64 <= data.len() && &data[pos..pos + 4] == b"KVTR" {
        let klen = u32::from_le_bytes(data[pos + 8..pos + 12].try_into().unwrap()) as usize;
        let k: u64 = std::str::from_utf8(&data[pos + 64 + 4..pos + 64 + klen])
            .unwrap()
            .parse()
            .unwrap();
        offsets.insert(k, pos);
        let blocks = u32::from_le_bytes(data[pos + 44..pos + 48].try_into().unwrap());
        pos += blocks as usize * 4096;
    }
    assert_eq!(offsets.len(), 30);
    let offsets: Vec<usize> = (0..30).map(|k| offsets[&k]).collect();
    let f = OpenOptions::new().write(true).open(seg).unwrap();
    // Payload flip in object 3, header flip (payload length field) in 10, key flip in 20.
    let flip = |at: usize| {
        let mut b = [0u8];
        std::fs::File::open(seg)
            .unwrap()
            .read_exact_at(&mut b, at as u64)
            .unwrap();
        b[0] ^= 0x40;
        f.write_all_at(&b, at as u64).unwrap();
    };
    let po = |i: usize| {
        u32::from_le_bytes(data[offsets[i] + 40..offsets[i] + 44].try_into().unwrap()) as usize
    };
    flip(offsets[3] + po(3) + 5);
    flip(offsets[10] + 17);
    flip(offsets[20] + 64);
    f.sync_all().unwrap();

    let report = fsck(dir.path()).unwrap();
    assert_eq!(
        (
            report.counts.good,
            report.counts.corrupt,
            report.counts.torn
        ),
        (27, 3, 0),
        "{report:?}"
    );

    // The checkpoint still vouches for the segment, so the reads themselves must catch it.
    let e = open(&c);
    assert!(e.recovery_report().unwrap().used_checkpoint);
    for k in 0..30u64 {
        let damaged = [3, 10, 20].contains(&k);
        let got = read(&e, &key(k));
        if damaged {
            assert!(got.is_none(), "corrupt record {k} was served");
        } else {
            assert_k(&e, k);
        }
    }
    let s = e.stats();
    assert_eq!(s.ssd_checksum_failures, 3, "{s:?}");
    assert!(!e.contains(&key(3)), "a failed record leaves the index");
    drop(e);

    // A scan drops them at recovery and counts them.
    std::fs::remove_file(dir.path().join("index.ckpt")).unwrap();
    let e = open(&c);
    let r = e.recovery_report().unwrap();
    assert_eq!((r.objects, r.scan.corrupt), (27, 3), "{r:?}");
    for k in (0..30).filter(|k| ![3, 10, 20].contains(k)) {
        assert_k(&e, k);
    }
}

#[test]
fn truncated_segments_lose_only_their_tail() {
    let mut rng = Rng(0xDEAD_BEEF);
    for round in 0..6 {
        let dir = tempfile::tempdir().unwrap();
        let c = ssd_config(dir.path(), 16, 8, |_| {});
        let e = open(&c);
        for k in 0..40 {
            put_k(&e, k).unwrap();
        }
        e.close().unwrap();
        std::fs::remove_file(dir.path().join("index.ckpt")).unwrap();
        let seg = segment_files(dir.path())[0].clone();
        // Find the end of the written records, cut somewhere inside them.
        let data = std::fs::read(&seg).unwrap();
        // (key, end offset) of each record, in file order (workers may interleave keys).
        let mut ends = Vec::new();
        let mut pos = 4096;
        while pos + 64 <= data.len() && &data[pos..pos + 4] == b"KVTR" {
            let klen = u32::from_le_bytes(data[pos + 8..pos + 12].try_into().unwrap()) as usize;
            let k: u64 = std::str::from_utf8(&data[pos + 64 + 4..pos + 64 + klen])
                .unwrap()
                .parse()
                .unwrap();
            let blocks = u32::from_le_bytes(data[pos + 44..pos + 48].try_into().unwrap());
            pos += blocks as usize * 4096;
            ends.push((k, pos));
        }
        let cut = 4096 + rng.below((pos - 4096) as u64) as usize;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&seg)
            .unwrap()
            .set_len(cut as u64)
            .unwrap();
        let kept: std::collections::HashSet<u64> = ends
            .iter()
            .filter(|&&(_, end)| end <= cut)
            .map(|&(k, _)| k)
            .collect();
        let whole = kept.len() as u64;
        let e = open(&c);
        let r = e.recovery_report().unwrap();
        assert_eq!(r.objects, whole, "round {round}, cut {cut}: {r:?}");
        assert!(r.scan.torn <= 1 && r.scan.corrupt == 0, "{r:?}");
        for k in 0..40u64 {
            if kept.contains(&k) {
                assert_k(&e, k);
            } else {
                assert!(read(&e, &key(k)).is_none(), "object {k} past the cut");
            }
        }
        // The tier keeps working on the truncated file after restart.
        for k in 100..140 {
            put_k(&e, k).unwrap();
        }
        e.flush().unwrap();
        for k in 100..140 {
            assert_k(&e, k);
        }
    }
}

#[test]
fn write_back_copies_on_eviction_only() {
    let dir = tempfile::tempdir().unwrap();
    let c = ssd_config(dir.path(), 16, 16, |c| {
        c.ssd_write_policy = SsdWritePolicy::WriteBack;
        c.ssd_copy_async = true;
    });
    let e = open(&c);
    put_k(&e, 0).unwrap();
    e.flush().unwrap();
    assert_eq!(e.stats().ssd_objects, 0, "nothing copied before eviction");
    for k in 1..80 {
        put_k(&e, k).unwrap();
    }
    let s = e.stats();
    assert!(s.evictions_capacity > 0 && s.ssd_objects > 0, "{s:?}");
    assert_eq!(
        s.ssd_objects + s.objects,
        80,
        "every object is in exactly one tier: {s:?}"
    );
    for k in 0..80 {
        assert_k(&e, k);
    }
    e.check_invariants().unwrap();
}

/// Issue 30: with media events on, every group's events per medium alternate stored /
/// removed, a write-back demotion shows its SSD copy before the DRAM eviction, and what the
/// SSD holds at enable time (a warm restart) is reported first.
#[test]
fn media_events_follow_each_tier() {
    use kvtier_engine::eviction::events::EventKind;
    use std::collections::HashMap;
    let dir = tempfile::tempdir().unwrap();
    let c = ssd_config(dir.path(), 16, 16, |c| {
        c.ssd_write_policy = SsdWritePolicy::WriteBack;
    });
    let e = open(&c);
    e.enable_media_events(1 << 16);
    for k in 0..80 {
        put_k(&e, k).unwrap();
    }
    assert!(e.remove(&key(0)) || e.remove(&key(1)));
    let events = e.drain_events(usize::MAX).events;
    // group -> (in DRAM, on SSD) as the events say.
    let mut live: HashMap<Vec<u8>, (bool, bool)> = HashMap::new();
    let mut demoted = 0;
    for ev in &events {
        let s = live.entry(ev.group.to_vec()).or_default();
        match ev.kind {
            EventKind::Stored => assert!(!std::mem::replace(&mut s.0, true)),
            EventKind::Evicted => {
                assert!(std::mem::replace(&mut s.0, false));
                assert!(
                    s.1,
                    "write-back: the SSD copy is reported before the eviction"
                );
                demoted += 1;
            }
            EventKind::Removed => assert!(std::mem::replace(&mut s.0, false)),
            EventKind::SsdStored => assert!(!std::mem::replace(&mut s.1, true)),
            EventKind::SsdRemoved => assert!(std::mem::replace(&mut s.1, false)),
            EventKind::Cleared => unreachable!(),
        }
    }
    assert!(demoted > 0);
    for k in 0..80 {
        let s = live.get(&key(k)).copied().unwrap_or_default();
        let p = e.placement(&key(k));
        assert_eq!(s, (p.dram_len.is_some(), p.ssd_len.is_some()), "key {k}");
    }
    let on_ssd = live.values().filter(|s| s.1).count();
    e.flush().unwrap();
    drop(e);
    // A warm restart: what the SSD holds is reported when the events are turned on, all of
    // it even with a ring smaller than the tier's groups (the seed is never dropped).
    let e = open(&c);
    assert!(on_ssd > 8, "{on_ssd} groups on SSD");
    e.enable_media_events(8);
    let drained = e.drain_events(usize::MAX);
    assert_eq!(drained.dropped_total, 0);
    let again = drained.events;
    assert_eq!(again.len(), on_ssd);
    assert!(again.iter().all(|ev| ev.kind == EventKind::SsdStored));
    e.clear();
    let kinds: Vec<EventKind> = e.drain_events(16).events.iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        vec![EventKind::Cleared],
        "one clear covers both tiers"
    );
}

#[test]
fn write_errors_fail_strict_puts_and_drop_relaxed_copies() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(&ssd_config(dir.path(), 64, 8, strict));
    put_k(&e, 0).unwrap();
    e.inject_ssd_faults(u64::MAX, 0);
    match put_k(&e, 1) {
        Err(EngineError::SsdWrite(_)) => {}
        other => panic!("expected SsdWrite, got {other:?}"),
    }
    assert!(!e.contains(&key(1)), "a failed strict put is not stored");
    let s = e.stats();
    assert!(
        s.ssd_degraded && s.ssd_write_errors > 0 && s.put_failures == 1,
        "{s:?}"
    );
    e.inject_ssd_faults(0, 1);
    assert!(
        matches!(put_k(&e, 2), Err(EngineError::SsdWrite(_))),
        "sync failure fails too"
    );
    e.inject_ssd_faults(0, 0);
    put_k(&e, 3).unwrap();
    assert!(!e.stats().ssd_degraded, "a good write clears degraded");
    assert_k(&e, 0);
    assert_k(&e, 3);
    e.check_invariants().unwrap();
    drop(e);

    let dir = tempfile::tempdir().unwrap();
    let e = open(&ssd_config(dir.path(), 64, 8, |c| c.ssd_copy_async = false));
    e.inject_ssd_faults(u64::MAX, 0);
    assert_eq!(put_k(&e, 1).unwrap(), PutOutcome::Stored);
    let s = e.stats();
    assert!(
        s.ssd_degraded && s.ssd_copies_dropped == 1 && s.ssd_objects == 0,
        "{s:?}"
    );
    assert_k(&e, 1);
    e.inject_ssd_faults(0, 0);
}

#[test]
fn disk_full_caps_the_tier_without_failing() {
    // A 3 MiB tmpfs against a 16 MiB tier: the 3rd segment file cannot be created.
    let mnt = tempfile::tempdir().unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=3m", "tmpfs"])
        .arg(mnt.path())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIP disk_full_caps_the_tier_without_failing: cannot mount a tmpfs (not root?)");
        return;
    }
    // A fresh tmpfs is mode 1777; the tier refuses a directory others may write.
    std::fs::set_permissions(
        mnt.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let result = std::panic::catch_unwind(|| {
        let c = ssd_config(mnt.path(), 16, 16, |c| c.ssd_copy_async = false);
        let e = open(&c);
        for k in 0..300 {
            put_k(&e, k).unwrap();
        }
        let s = e.stats();
        assert!(
            s.ssd_enospc_errors > 0 && s.ssd_evicted_segments > 0,
            "{s:?}"
        );
        assert!(s.ssd_segments_in_use <= 3, "{s:?}");
        // The newest objects are still readable, none is wrong.
        for k in 0..300 {
            if let Some(v) = read(&e, &key(k)) {
                assert_eq!(v, value_for(&key(k), len_for(k)));
            }
        }
        assert_k(&e, 299);
        e.check_invariants().unwrap();
    });
    let _ = std::process::Command::new("umount")
        .arg(mnt.path())
        .status();
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
}

#[test]
fn reclaim_evicts_whole_segments_and_never_serves_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let c = ssd_config(dir.path(), 16, 4, |c| c.ssd_copy_async = false);
    let e = open(&c);
    for k in 0..400 {
        put_k(&e, k).unwrap();
    }
    e.flush().unwrap();
    let s = e.stats();
    assert!(
        s.ssd_evicted_segments > 0 && s.ssd_evicted_objects > 0,
        "{s:?}"
    );
    assert!(s.ssd_bytes_allocated <= s.ssd_capacity_bytes, "{s:?}");
    let mut present = 0;
    for k in 0..400 {
        if let Some(v) = read(&e, &key(k)) {
            assert_eq!(v, value_for(&key(k), len_for(k)), "object {k}");
            present += 1;
        }
    }
    assert!(present > 50, "{present} objects left");
    assert_k(&e, 399);
    e.check_invariants().unwrap();
    drop(e);
    // What survives a restart is exactly what was indexed, and is intact.
    std::fs::remove_file(dir.path().join("index.ckpt")).unwrap();
    let e = open(&c);
    let r = e.recovery_report().unwrap();
    assert_eq!((r.scan.torn, r.scan.corrupt), (0, 0), "{r:?}");
    for k in 0..400 {
        if let Some(v) = read(&e, &key(k)) {
            assert_eq!(v, value_for(&key(k), len_for(k)));
        }
    }
}

#[test]
fn fsck_reports_segments() {
    let dir = tempfile::tempdir().unwrap();
    let c = ssd_config(dir.path(), 16, 8, |_| {});
    let e = open(&c);
    for k in 0..50 {
        put_k(&e, k).unwrap();
    }
    e.remove(&key(1));
    e.close().unwrap();
    let r = fsck(dir.path()).unwrap();
    assert_eq!(
        (
            r.counts.good,
            r.counts.removed,
            r.counts.torn,
            r.counts.corrupt
        ),
        (49, 1, 0, 0),
        "{r:?}"
    );
    assert!(r.checkpoint_present);
    assert!(r
        .segments
        .iter()
        .any(|s| s.state == "in_use" && s.counts.good > 0));
    assert!(fsck(&dir.path().join("missing")).is_err());
}
