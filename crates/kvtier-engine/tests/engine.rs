//! Engine behaviour through the public API.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashSet;
use std::sync::mpsc;

use common::{engine, value_for, BS};
use kvtier_engine::{Engine, EngineConfig, EngineError, EvictionPolicyKind, PutMeta, PutOutcome};
use kvtier_proto::{ExistsV2Query, HitPolicy, KvComponents, PoolQuery};

use EvictionPolicyKind::{Lru, PrefixDepth};

fn put(e: &Engine, key: &str, len: usize) -> Result<PutOutcome, EngineError> {
    e.put(
        key.as_bytes(),
        &value_for(key.as_bytes(), len),
        PutMeta::default(),
    )
}

fn put_depth(e: &Engine, key: &str, len: usize, depth: u32) -> Result<PutOutcome, EngineError> {
    let meta = PutMeta { depth: Some(depth) };
    e.put(key.as_bytes(), &value_for(key.as_bytes(), len), meta)
}

fn get(e: &Engine, key: &str) -> Option<Vec<u8>> {
    let len = e.object_len(key.as_bytes())? as usize;
    let mut out = vec![0u8; len];
    e.get_into(key.as_bytes(), &mut out).ok()?;
    Some(out)
}

fn assert_intact(e: &Engine, key: &str, len: usize) {
    assert_eq!(
        get(e, key).as_deref(),
        Some(&value_for(key.as_bytes(), len)[..]),
        "{key} must read back exactly"
    );
}

#[test]
fn odd_sizes_round_trip_and_take_ceil_blocks() {
    let e = engine(32, Lru, 64);
    let sizes = [1, BS - 1, BS, BS + 1, BS * 7 / 2, 2 * BS + 17];
    for (i, &len) in sizes.iter().enumerate() {
        assert_eq!(put(&e, &format!("k{i}"), len).unwrap(), PutOutcome::Stored);
    }
    for (i, &len) in sizes.iter().enumerate() {
        assert_intact(&e, &format!("k{i}"), len);
        assert_eq!(e.object_len(format!("k{i}").as_bytes()), Some(len as u64));
    }
    let s = e.stats();
    let blocks: usize = sizes.iter().map(|l| l.div_ceil(BS)).sum();
    assert_eq!(s.objects, sizes.len() as u64);
    assert_eq!(s.bytes_used, sizes.iter().sum::<usize>() as u64);
    assert_eq!(s.bytes_allocated, (blocks * BS) as u64);
    assert_eq!(s.capacity_bytes, (32 * BS) as u64);
    assert_eq!(s.puts, sizes.len() as u64);
    assert_eq!(s.bytes_in, s.bytes_used);
    assert_eq!(s.hits, sizes.len() as u64);
    assert_eq!(s.bytes_out, s.bytes_used);
    assert_eq!(s.evictions_capacity, 0);
    e.verify_accounting().unwrap();
}

#[test]
fn put_if_absent_keeps_the_first_value_and_counts_dedup() {
    let e = engine(8, Lru, 64);
    let first = vec![1u8; 100];
    assert_eq!(
        e.put(b"k", &first, PutMeta::default()).unwrap(),
        PutOutcome::Stored
    );
    let second = vec![2u8; 300];
    assert_eq!(
        e.put(b"k", &second, PutMeta::default()).unwrap(),
        PutOutcome::AlreadyPresent
    );
    let mut out = vec![0u8; 100];
    e.get_into(b"k", &mut out).unwrap();
    assert_eq!(out, first);
    let s = e.stats();
    assert_eq!(
        (s.puts, s.dedup_skips, s.bytes_in, s.objects),
        (1, 1, 100, 1)
    );
    assert_eq!(
        s.bytes_allocated, BS as u64,
        "the duplicate allocated nothing"
    );
}

#[test]
fn size_mismatch_leaves_dst_untouched() {
    let e = engine(8, Lru, 64);
    put(&e, "k", 1000).unwrap();
    for len in [999, 1001, 0] {
        let mut dst = vec![0xEE; len];
        match e.get_into(b"k", &mut dst) {
            Err(EngineError::SizeMismatch { stored, requested }) => {
                assert_eq!((stored, requested), (1000, len as u64));
            }
            other => panic!("expected SizeMismatch, got {other:?}"),
        }
        assert!(dst.iter().all(|&b| b == 0xEE), "dst of {len} was written");
    }
    let s = e.stats();
    assert_eq!(
        (s.size_mismatches, s.hits, s.misses, s.bytes_out),
        (3, 0, 0, 0)
    );
}

#[test]
fn missing_key_is_not_found_and_a_miss() {
    let e = engine(8, Lru, 64);
    let mut dst = [7u8; 4];
    assert!(matches!(
        e.get_into(b"nope", &mut dst),
        Err(EngineError::NotFound)
    ));
    assert_eq!(dst, [7u8; 4]);
    assert!(e.pin(b"nope").is_none());
    assert_eq!(e.stats().misses, 2);
    assert_eq!(e.object_len(b"nope"), None);
}

#[test]
fn zero_length_object_is_stored_in_no_blocks() {
    let e = engine(2, Lru, 64);
    assert_eq!(
        e.put(b"z", &[], PutMeta::default()).unwrap(),
        PutOutcome::Stored
    );
    assert!(e.contains(b"z"));
    assert_eq!(e.object_len(b"z"), Some(0));
    e.get_into(b"z", &mut []).unwrap();
    assert!(matches!(
        e.get_into(b"z", &mut [0u8; 1]),
        Err(EngineError::SizeMismatch {
            stored: 0,
            requested: 1
        })
    ));
    let s = e.stats();
    assert_eq!(
        (s.objects, s.bytes_used, s.bytes_allocated, s.hits),
        (1, 0, 0, 1)
    );
    e.verify_accounting().unwrap();
}

#[test]
fn object_larger_than_the_arena_is_rejected() {
    let e = engine(4, Lru, 64);
    match put(&e, "big", 4 * BS + 1) {
        Err(EngineError::ObjectTooLarge { len, capacity }) => {
            assert_eq!((len, capacity), ((4 * BS + 1) as u64, (4 * BS) as u64));
        }
        other => panic!("expected ObjectTooLarge, got {other:?}"),
    }
    assert!(matches!(
        e.put(b"", b"x", PutMeta::default()),
        Err(EngineError::EmptyKey)
    ));
    assert_eq!(e.stats().put_failures, 2);
    // Exactly the arena fits.
    assert_eq!(put(&e, "whole", 4 * BS).unwrap(), PutOutcome::Stored);
    assert_intact(&e, "whole", 4 * BS);
}

#[test]
fn invalid_config_names_the_field() {
    let bad = EngineConfig {
        dram_block_size: 3000,
        dram_capacity_bytes: 1 << 20,
        ..EngineConfig::default()
    };
    match Engine::open(bad) {
        Err(EngineError::InvalidConfig { key, reason }) => {
            assert_eq!(key, "dram_block_size");
            assert!(reason.contains("3000"), "{reason}");
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn capacity_eviction_follows_lru_order() {
    let e = engine(4, Lru, 64);
    for k in ["a", "b", "c", "d"] {
        put(&e, k, BS).unwrap();
    }
    assert_intact(&e, "a", BS); // a is now the most recent
    put(&e, "e", BS).unwrap(); // evicts b
    put(&e, "f", BS).unwrap(); // evicts c
    let present: Vec<bool> = ["a", "b", "c", "d", "e", "f"]
        .iter()
        .map(|k| e.contains(k.as_bytes()))
        .collect();
    assert_eq!(present, [true, false, false, true, true, true]);
    // A two-block put evicts the two coldest: d, then a.
    put(&e, "g", 2 * BS).unwrap();
    assert!(!e.contains(b"d") && !e.contains(b"a"));
    let s = e.stats();
    assert_eq!((s.evictions_capacity, s.evicted_bytes), (4, 4 * BS as u64));
    assert_eq!(s.objects, 3);
    e.verify_accounting().unwrap();
}

#[test]
fn contains_does_not_refresh_recency() {
    let e = engine(2, Lru, 64);
    put(&e, "a", BS).unwrap();
    put(&e, "b", BS).unwrap();
    assert!(e.contains(b"a"));
    assert_eq!(e.object_len(b"a"), Some(BS as u64));
    put(&e, "c", BS).unwrap();
    assert!(!e.contains(b"a"), "a stayed the coldest");
    let s = e.stats();
    assert_eq!((s.hits, s.misses), (0, 0));
}

/// Fill an 8-block arena with chain A (depths 0..8), then put chain B (depths 0..4).
fn chains(policy: EvictionPolicyKind) -> (Vec<bool>, Vec<bool>) {
    let e = engine(8, policy, 64);
    for d in 0..8 {
        put_depth(&e, &format!("A{d}"), BS, d).unwrap();
    }
    for d in 0..4 {
        put_depth(&e, &format!("B{d}"), BS, d).unwrap();
    }
    e.verify_accounting().unwrap();
    let a = (0..8)
        .map(|d| e.contains(format!("A{d}").as_bytes()))
        .collect();
    let b = (0..4)
        .map(|d| e.contains(format!("B{d}").as_bytes()))
        .collect();
    (a, b)
}

#[test]
fn prefix_depth_evicts_the_tail_of_a_chain_first() {
    let (a, b) = chains(PrefixDepth);
    assert_eq!(
        a,
        [true, true, true, true, false, false, false, false],
        "heads survive"
    );
    assert_eq!(b, [true; 4]);
    // Plain LRU would have dropped the heads instead.
    let (a, _) = chains(Lru);
    assert_eq!(a, [false, false, false, false, true, true, true, true]);
}

#[test]
fn prefix_depth_chooses_only_within_the_cold_window() {
    // Window 2: only the two coldest compete, so the deep page A7 (recent) survives.
    let e = engine(8, PrefixDepth, 2);
    for d in 0..8 {
        put_depth(&e, &format!("A{d}"), BS, d).unwrap();
    }
    put_depth(&e, "B0", BS, 0).unwrap();
    assert!(!e.contains(b"A1"), "deeper of the two coldest goes");
    assert!(e.contains(b"A0") && e.contains(b"A7"));
}

#[test]
fn unknown_depth_counts_as_depth_zero() {
    let e = engine(3, PrefixDepth, 64);
    put(&e, "u", BS).unwrap(); // coldest, no depth
    put_depth(&e, "h", BS, 0).unwrap();
    put_depth(&e, "t", BS, 5).unwrap();
    put(&e, "x", BS).unwrap(); // evicts the deep t
    assert!(!e.contains(b"t"));
    put(&e, "y", BS).unwrap(); // then LRU among depth 0: u
    assert!(!e.contains(b"u") && e.contains(b"h"));
}

#[test]
fn everything_pinned_is_no_space_and_loses_nothing() {
    let e = engine(2, Lru, 64);
    put(&e, "a", BS).unwrap();
    put(&e, "b", BS).unwrap();
    let (pinned_tx, pinned_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel::<&str>();
    std::thread::scope(|s| {
        let e = &e;
        s.spawn(move || {
            let mut pins = [Some(e.pin(b"a").unwrap()), Some(e.pin(b"b").unwrap())];
            pinned_tx.send(()).unwrap();
            while let Ok(which) = release_rx.recv() {
                pins[usize::from(which == "b")] = None;
            }
        });
        pinned_rx.recv().unwrap();
        match put(e, "c", BS) {
            Err(EngineError::NoSpace { needed, cause }) => {
                assert_eq!(needed, BS as u64);
                assert_eq!(cause.pinned_groups, 2, "{cause}");
            }
            other => panic!("expected NoSpace, got {other:?}"),
        }
        assert!(!e.contains(b"c"));
        assert_intact(e, "a", BS);
        assert_intact(e, "b", BS);
        assert_eq!(e.stats().put_failures, 1);
        e.verify_accounting().unwrap();
        // Release b's pin: now exactly b can go.
        release_tx.send("b").unwrap();
        let mut tries = 0;
        while put(e, "c", BS).is_err() {
            tries += 1;
            assert!(tries < 10_000, "pin was never released");
            std::thread::yield_now();
        }
        drop(release_tx);
    });
    assert!(e.contains(b"a") && !e.contains(b"b") && e.contains(b"c"));
    e.verify_accounting().unwrap();
}

#[test]
fn pinned_cold_window_moves_on_to_the_next_window() {
    // Window 1 and the coldest object pinned: eviction must look past it.
    let e = engine(3, Lru, 1);
    for k in ["a", "b", "c"] {
        put(&e, k, BS).unwrap();
    }
    let pin = e.pin(b"a").unwrap();
    // pin() refreshed a's recency; make it the coldest again by touching the others.
    assert_intact(&e, "b", BS);
    assert_intact(&e, "c", BS);
    put(&e, "d", BS).unwrap();
    assert!(e.contains(b"a"), "pinned object is never evicted");
    assert!(!e.contains(b"b"));
    drop(pin);
    e.verify_accounting().unwrap();
}

#[test]
fn remove_while_pinned_keeps_memory_until_the_read_ends() {
    let e = engine(4, Lru, 64);
    put(&e, "a", 3 * BS).unwrap();
    let pin = e.pin(b"a").unwrap();
    assert!(e.remove(b"a"));
    assert!(!e.contains(b"a") && !e.remove(b"a"));
    // The unlinked object is still readable through its pin, and still holds its blocks.
    let mut out = vec![0u8; 3 * BS];
    pin.read_into(&mut out).unwrap();
    assert_eq!(out, value_for(b"a", 3 * BS));
    assert_eq!(e.stats().bytes_allocated, (3 * BS) as u64);
    assert_eq!(e.stats().objects, 0);
    // So a 2-block put cannot fit (only 1 free block, nothing evictable).
    assert!(matches!(
        put(&e, "b", 2 * BS),
        Err(EngineError::NoSpace { .. })
    ));
    drop(pin);
    assert_eq!(e.stats().bytes_allocated, 0);
    put(&e, "b", 2 * BS).unwrap();
    e.verify_accounting().unwrap();
}

#[test]
fn pinned_read_checks_the_length() {
    let e = engine(2, Lru, 64);
    put(&e, "a", 10).unwrap();
    let pin = e.pin(b"a").unwrap();
    assert_eq!(pin.len(), 10);
    let mut dst = [9u8; 9];
    assert!(matches!(
        pin.read_into(&mut dst),
        Err(EngineError::SizeMismatch { .. })
    ));
    assert_eq!(dst, [9u8; 9]);
    assert_eq!(e.stats().size_mismatches, 1);
}

#[test]
fn remove_and_clear_release_everything() {
    let e = engine(16, Lru, 64);
    for i in 0..10 {
        put(&e, &format!("k{i}"), 1 + i * 1000).unwrap();
    }
    assert!(e.remove(b"k3"));
    assert!(!e.remove(b"k3"));
    assert!(!e.remove(b"never"));
    assert_eq!(e.stats().evictions_removed, 1);
    e.clear();
    let s = e.stats();
    assert_eq!((s.objects, s.bytes_used, s.bytes_allocated), (0, 0, 0));
    assert_eq!(s.evictions_removed, 10);
    assert!((0..10).all(|i| !e.contains(format!("k{i}").as_bytes())));
    e.verify_accounting().unwrap();
    // The whole arena is usable again, as one object.
    put(&e, "all", 16 * BS).unwrap();
    assert_intact(&e, "all", 16 * BS);
}

#[test]
fn fragmented_arena_stores_objects_across_extents() {
    let e = engine(8, Lru, 64);
    for i in 0..8 {
        put(&e, &format!("s{i}"), BS).unwrap();
    }
    for i in (0..8).step_by(2) {
        assert!(e.remove(format!("s{i}").as_bytes()));
    }
    // 4 free blocks, none adjacent: a 3.5-block object must scatter, without evicting.
    put(&e, "big", BS * 7 / 2).unwrap();
    assert_intact(&e, "big", BS * 7 / 2);
    for i in (1..8).step_by(2) {
        assert_intact(&e, &format!("s{i}"), BS);
    }
    assert_eq!(e.stats().evictions_capacity, 0);
    e.verify_accounting().unwrap();
}

#[test]
fn exists_v2_is_the_fold_over_contains() {
    let e = engine(64, Lru, 64);
    let mut stored = HashSet::new();
    let mut store = |k: String| {
        e.put(k.as_bytes(), b"x", PutMeta::default()).unwrap();
        stored.insert(k.into_bytes());
    };
    for i in 0..5 {
        store(format!("m/p{i}.k"));
        store(format!("m/p{i}.v"));
    }
    for i in [0, 1, 3] {
        store(format!("m/p{i}.swa"));
    }
    let q = ExistsV2Query {
        key_prefix: b"m/".to_vec(),
        page_keys: (0..6).map(|i| format!("p{i}").into_bytes()).collect(),
        kv: KvComponents::Suffixes(vec![b".k".to_vec(), b".v".to_vec()]),
        pools: vec![PoolQuery {
            name: "swa".into(),
            suffixes: vec![b".swa".to_vec()],
            policy: HitPolicy::TrailingPages { window: 1 },
        }],
    };
    let before = e.stats();
    let got = e.exists_v2(&q).unwrap();
    let want = kvtier_proto::query::evaluate(&q, |k| stored.contains(k)).unwrap();
    assert_eq!(got, want);
    assert_eq!(got.kv_hit_pages, 4);
    assert_eq!(got.restorable_prefix_pages, vec![1, 2, 4]);
    let after = e.stats();
    assert_eq!(
        (before.hits, before.misses),
        (after.hits, after.misses),
        "no stats side effects"
    );
}

#[test]
fn engine_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Engine>();
    check::<kvtier_engine::PinnedObject>();
}

/// Issue 28: every engine's real key shapes, 4x the arena's capacity, both policies: every
/// put is stored (eviction makes room one chunk/page group at a time), the newest keys are
/// found, and a key's own group is never split to store it. Before, LMCache keys
/// (`<model>@<kv_rank>@<group>@<hash>`) were one group per model and every put past the
/// first arena-full failed with "pinned by a reader".
#[test]
fn every_schemes_keys_fill_the_store_four_times() {
    let lmcache = |i: usize| format!("lmcache/Qwen/Qwen3-0.6B@0@0@{i:064x}");
    let legacy = |i: usize| format!("lmcache-v1/Qwen/Qwen3-0.6B@1@0@{i:064x}@bfloat16");
    let vllm = |i: usize| format!("vllm/Qwen_Qwen3-0.6B_0123456789abcdef/{i:064x}_g0");
    let sglang = |i: usize| format!("team/{i:064x}@0123456789ab.tp0.k");
    let schemes: [(&str, &dyn Fn(usize) -> String); 4] = [
        ("lmcache", &lmcache),
        ("lmcache-legacy", &legacy),
        ("vllm", &vllm),
        ("sglang", &sglang),
    ];
    for policy in [Lru, PrefixDepth] {
        for (name, key) in schemes {
            let blocks = 16;
            let e = engine(blocks, policy, 64);
            let total = 4 * blocks;
            for i in 0..total {
                let k = key(i);
                let out = put(&e, &k, BS);
                assert_eq!(
                    out.unwrap_or_else(|err| panic!("{name} {policy:?} put {i}: {err}")),
                    PutOutcome::Stored
                );
                if name == "lmcache-legacy" {
                    // The sidecar joins its chunk's group.
                    let meta = format!("{k}.meta");
                    e.put(meta.as_bytes(), b"meta", PutMeta::default()).unwrap();
                }
            }
            for i in total - 4..total {
                assert_intact(&e, &key(i), BS);
            }
            assert!(!e.contains(key(0).as_bytes()), "{name}: the oldest went");
            assert!(e.stats().evictions_capacity > 0);
            e.verify_accounting().unwrap();
        }
    }
}

/// The NoSpace error says what held the memory: here the put's own group (an SGLang page of
/// more components than the arena holds), not a reader's pin.
#[test]
fn no_space_names_the_own_group_not_a_pin() {
    let e = engine(4, Lru, 64);
    let mut failed = None;
    for c in 0..8 {
        if let Err(err) = put(&e, &format!("page@0123456789ab.tp0.c{c}"), BS) {
            failed = Some(err);
            break;
        }
    }
    match failed {
        Some(EngineError::NoSpace { cause, .. }) => {
            assert_eq!(cause.pinned_groups, 0, "{cause}");
            assert_eq!(cause.own_group_objects, 4, "{cause}");
            let text = cause.to_string();
            assert!(
                text.contains("own eviction group") && !text.contains("pinned"),
                "{text}"
            );
        }
        other => panic!("expected NoSpace, got {other:?}"),
    }
}
