//! Concurrency stress: several threads put/get/pin/remove on a small arena so eviction runs
//! constantly. Values are derived from their key, so every successful read verifies its bytes.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{engine, ssd_config, value_for, Rng, BS};
use kvtier_engine::{
    Engine, EngineError, EvictionPolicyKind, PutMeta, PutOutcome, SsdDurabilityMode, SsdWritePolicy,
};

const THREADS: u64 = 4;
const KEYS: u64 = 400;
const BLOCKS: usize = 64;
const RUN_FOR: Duration = Duration::from_millis(1300);

/// Length of key `k`'s value: 0 ..= 3 blocks, with odd sizes.
fn len_of(k: u64) -> usize {
    match k % 5 {
        0 => 0,
        1 => 1 + (k as usize * 37) % 100,
        2 => BS - 1 + (k as usize % 3),
        _ => (k as usize * 7919) % (3 * BS) + 1,
    }
}

fn key_of(k: u64) -> Vec<u8> {
    format!("stress/{k}").into_bytes()
}

#[test]
fn concurrent_mixed_workload_never_returns_wrong_bytes() {
    for policy in [EvictionPolicyKind::PrefixDepth, EvictionPolicyKind::Lru] {
        stress(policy);
    }
}

#[test]
fn concurrent_workload_with_ssd_never_returns_wrong_bytes() {
    let modes = [
        (SsdDurabilityMode::Relaxed, SsdWritePolicy::WriteThrough),
        (SsdDurabilityMode::Strict, SsdWritePolicy::WriteThrough),
        (SsdDurabilityMode::Relaxed, SsdWritePolicy::WriteBack),
    ];
    for (mode, write) in modes {
        let dir = tempfile::tempdir().unwrap();
        // 4 segments of 1 MiB: SSD reclaim runs too.
        let c = ssd_config(dir.path(), BLOCKS, 4, |c| {
            c.ssd_durability_mode = mode;
            c.ssd_write_policy = write;
            c.ssd_copy_queue_depth = 16;
        });
        let e = Arc::new(Engine::open(c.clone()).unwrap());
        let (ops, e) = run_workers(e, Duration::from_millis(700));
        e.flush().unwrap();
        e.verify_accounting().unwrap();
        let s = e.stats();
        assert_eq!(s.put_failures, 0, "{s:?}");
        assert_eq!(s.ssd_checksum_failures, 0, "{s:?}");
        assert!(s.ssd_hits > 0 && s.ssd_writes > 0, "{s:?}");
        eprintln!("{mode:?}/{write:?}: {ops} ops, {s:?}");
        drop(e);
        // What survives the restart is intact.
        let e = Engine::open(c).unwrap();
        let r = e.recovery_report().unwrap();
        assert!(r.used_checkpoint && r.torn + r.corrupt == 0, "{r:?}");
        for k in 0..KEYS {
            let key = key_of(k);
            if let Some(len) = e.object_len(&key) {
                let mut out = vec![0u8; len as usize];
                if e.get_into(&key, &mut out).is_ok() {
                    assert!(
                        out == value_for(&key, len_of(k)),
                        "wrong bytes for {k} after restart"
                    );
                }
            }
        }
    }
}

/// Run the mixed workload on `e` for `run_for`; returns the op count and the engine.
fn run_workers(e: Arc<Engine>, run_for: Duration) -> (u64, Arc<Engine>) {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (e, stop) = (Arc::clone(&e), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (t + 1));
                let mut buf = Vec::new();
                let mut ops = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let k = rng.below(KEYS);
                    let key = key_of(k);
                    let len = len_of(k);
                    match rng.below(100) {
                        0..=49 => {
                            buf.clear();
                            buf.resize(len, 0xCC);
                            match e.get_into(&key, &mut buf) {
                                Ok(()) => {
                                    assert!(buf == value_for(&key, len), "wrong bytes for {k}")
                                }
                                Err(EngineError::NotFound) => {}
                                Err(other) => panic!("get {k}: {other}"),
                            }
                        }
                        50..=84 => {
                            let meta = PutMeta {
                                depth: Some((k % 8) as u32),
                            };
                            match e.put(&key, &value_for(&key, len), meta) {
                                Ok(PutOutcome::Stored | PutOutcome::AlreadyPresent) => {}
                                Err(other) => panic!("put {k}: {other}"),
                            }
                        }
                        85..=92 => {
                            e.remove(&key);
                        }
                        _ => {
                            if let Some(pin) = e.pin(&key) {
                                let mut out = vec![0u8; pin.len() as usize];
                                pin.read_into(&mut out).unwrap();
                                assert!(out == value_for(&key, len), "wrong pinned bytes for {k}");
                            }
                        }
                    }
                    ops += 1;
                }
                ops
            })
        })
        .collect();
    while start.elapsed() < run_for && handles.iter().all(|h| !h.is_finished()) {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let mut ops = 0;
    for h in handles {
        ops += h.join().expect("worker panicked");
    }
    (ops, e)
}

fn stress(policy: EvictionPolicyKind) {
    let e = Arc::new(engine(BLOCKS, policy, 16));
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (e, stop, reads) = (Arc::clone(&e), Arc::clone(&stop), Arc::clone(&reads));
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (t + 1));
                let mut buf = Vec::new();
                let mut ops = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let k = rng.below(KEYS);
                    let key = key_of(k);
                    let len = len_of(k);
                    match rng.below(100) {
                        0..=44 => {
                            buf.clear();
                            buf.resize(len, 0xCC);
                            reads.fetch_add(1, Ordering::Relaxed);
                            match e.get_into(&key, &mut buf) {
                                Ok(()) => {
                                    assert!(buf == value_for(&key, len), "wrong bytes for {k}")
                                }
                                Err(EngineError::NotFound) => {}
                                Err(other) => panic!("get {k}: {other}"),
                            }
                        }
                        45..=79 => {
                            let meta = PutMeta {
                                depth: Some((k % 8) as u32),
                            };
                            match e.put(&key, &value_for(&key, len), meta) {
                                Ok(PutOutcome::Stored | PutOutcome::AlreadyPresent) => {}
                                Err(other) => panic!("put {k}: {other}"),
                            }
                        }
                        80..=89 => {
                            e.remove(&key);
                        }
                        _ => {
                            reads.fetch_add(1, Ordering::Relaxed);
                            if let Some(pin) = e.pin(&key) {
                                // Hold the pin across a remove and other work.
                                if rng.below(2) == 0 {
                                    e.remove(&key);
                                }
                                std::thread::yield_now();
                                let mut out = vec![0u8; pin.len() as usize];
                                pin.read_into(&mut out).unwrap();
                                assert!(out == value_for(&key, len), "wrong pinned bytes for {k}");
                            }
                        }
                    }
                    ops += 1;
                }
                ops
            })
        })
        .collect();
    // Stop on time, or early if a worker panicked.
    while start.elapsed() < RUN_FOR && handles.iter().all(|h| !h.is_finished()) {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let mut ops = 0;
    for h in handles {
        ops += h.join().expect("worker panicked");
    }

    e.verify_accounting().unwrap();
    let s = e.stats();
    assert_eq!(
        s.objects,
        s.puts - s.evictions_capacity - s.evictions_removed - s.evictions_superseded,
        "{s:?}"
    );
    assert_eq!(s.hits + s.misses, reads.load(Ordering::Relaxed), "{s:?}");
    assert_eq!(s.put_failures, 0, "{s:?}");
    assert!(
        s.evictions_capacity > 0,
        "the arena was meant to be under pressure: {s:?}"
    );
    assert!(s.hits > 0 && s.dedup_skips > 0, "{s:?}");
    // Nothing is pinned or in flight any more: every block is accounted for by the index.
    let blocks: u64 = (0..KEYS)
        .filter(|&k| e.contains(&key_of(k)))
        .map(|k| len_of(k).div_ceil(BS) as u64)
        .sum();
    assert_eq!(s.bytes_allocated, blocks * BS as u64);
    eprintln!("{policy:?}: {ops} ops, {s:?}");
}
