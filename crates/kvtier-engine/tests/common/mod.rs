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
        dram_prefault: true,
        ..EngineConfig::default()
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

/// An engine of `dram_blocks` 4 KiB DRAM blocks with the SSD tier on in `dir`
/// (1 MiB segments, `segments` of them), adjusted by `tweak`.
pub fn ssd_config(
    dir: &std::path::Path,
    dram_blocks: usize,
    segments: u64,
    tweak: impl FnOnce(&mut EngineConfig),
) -> EngineConfig {
    let mut c = EngineConfig {
        dram_capacity_bytes: (dram_blocks * BS) as u64,
        dram_block_size: BS as u32,
        eviction_candidate_window: 16,
        index_shards: 4,
        ssd_enabled: true,
        ssd_storage_dir: dir.to_path_buf(),
        ssd_segment_size_bytes: 1 << 20,
        ssd_capacity_bytes: segments << 20,
        ..EngineConfig::default()
    };
    tweak(&mut c);
    c
}

/// Length of the value of key number `k` (0 ..= ~40 KiB, odd sizes).
pub fn len_for(k: u64) -> usize {
    match k % 4 {
        0 => (k as usize * 37) % 300,
        1 => BS - 1 + (k as usize % 3),
        2 => 20_000 + (k as usize * 7919) % 20_000,
        _ => (k as usize * 7919) % (3 * BS) + 1,
    }
}

/// Read `key` back; `None` on a miss.
pub fn read(e: &Engine, key: &[u8]) -> Option<Vec<u8>> {
    let len = e.object_len(key)? as usize;
    let mut out = vec![0u8; len];
    e.get_into(key, &mut out).ok()?;
    Some(out)
}
