//! Plain throughput microbenchmark (no harness): `cargo bench -p kvtier-engine`.
//!
//! Measures put and get_into GB/s for page-sized objects on a pre-faulted arena, one thread
//! and two threads, with eviction running (the working set is twice the arena).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Instant;

use kvtier_engine::{Engine, EngineConfig, PutMeta};

fn run(obj: usize, threads: usize) {
    let capacity = 512usize << 20;
    let e = Arc::new(
        Engine::open(EngineConfig {
            dram_capacity_bytes: capacity as u64,
            ..EngineConfig::default()
        })
        .expect("open"),
    );
    let keys = 2 * capacity / obj;
    let per_thread = keys / threads;
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let e = Arc::clone(&e);
            s.spawn(move || {
                let value = vec![t as u8; obj];
                for i in 0..per_thread {
                    let key = format!("bench/{t}/{i}");
                    let meta = PutMeta {
                        depth: Some((i % 64) as u32),
                    };
                    e.put(key.as_bytes(), &value, meta).expect("put");
                }
            });
        }
    });
    let put_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let hits = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (e, hits) = (Arc::clone(&e), &hits);
            s.spawn(move || {
                let mut dst = vec![0u8; obj];
                let mut n = 0;
                for _ in 0..2 {
                    for i in 0..per_thread {
                        let key = format!("bench/{t}/{i}");
                        if e.get_into(key.as_bytes(), &mut dst).is_ok() {
                            n += 1;
                        }
                    }
                }
                hits.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            });
        }
    });
    let get_s = t0.elapsed().as_secs_f64();
    let put_gb = (per_thread * threads * obj) as f64 / 1e9;
    let get_gb = hits.into_inner() as f64 * obj as f64 / 1e9;
    let s = e.stats();
    println!(
        "obj {:>7} B x{threads}: put {:6.2} GB/s ({} evictions), get {:6.2} GB/s ({} hits)",
        obj,
        put_gb / put_s,
        s.evictions_capacity,
        get_gb / get_s,
        s.hits
    );
}

fn main() {
    for obj in [64 << 10, (64 << 10) + 100, 2 << 20] {
        for threads in [1, 2] {
            run(obj, threads);
        }
    }
}
