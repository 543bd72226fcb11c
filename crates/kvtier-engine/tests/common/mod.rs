//! Helpers shared by the integration tests.
#![allow(dead_code)]

use kvtier_engine::{Engine, EngineConfig, EvictionPolicyKind};

pub const BS: usize = 4096;

/// A small engine of `blocks` 4 KiB blocks.
pub fn engine(blocks: usize, policy: EvictionPolicyKind, window: usize) -> Engine {
    Engine::open(EngineConfig {
        dram_capacity_bytes: (blocks * BS) as u64,
        dram_block_size: BS as u32,
        eviction_policy: policy,
        eviction_candidate_window: window,
        index_shards: 4,
        prefault: true,
    })
    .expect("open engine")
}

/// Bytes derived from `key` and `len`, so any reader can verify what it got.
pub fn value_for(key: &[u8], len: usize) -> Vec<u8> {
    let mut h: u32 = 2166136261;
    for &b in key {
        h = (h ^ u32::from(b)).wrapping_mul(16777619);
    }
    (0..len)
        .map(|i| {
            let x = h ^ (i as u32).wrapping_mul(0x9E37_79B9);
            (x ^ (x >> 13)) as u8
        })
        .collect()
}

/// xorshift64*: a tiny deterministic RNG for the stress test.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
