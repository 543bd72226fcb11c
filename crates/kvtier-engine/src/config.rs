//! Engine configuration and its validation.
//!
//! Owns: the knobs of one engine instance and the rules that make a configuration usable.
//! Invariant: an [`EngineConfig`] that passed [`EngineConfig::validate`] yields an arena of at
//! least one block, a block size the allocator and arena can address, and a power-of-two shard
//! count, so nothing downstream re-checks these.

use crate::error::EngineError;

/// Smallest allowed allocator block: one 4 KiB page, so an arena block never splits a page.
pub const MIN_BLOCK_SIZE: u32 = 4 << 10;
/// Largest allowed allocator block: larger blocks waste too much on small side-pool objects.
pub const MAX_BLOCK_SIZE: u32 = 16 << 20;
/// Upper bound on index shards; the shard is taken from 16 hash bits (see `index.rs`).
pub const MAX_INDEX_SHARDS: usize = 1 << 16;

/// Which eviction policy orders the DRAM tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionPolicyKind {
    /// Among the coldest window, evict the deepest page of a prefix chain first.
    PrefixDepth,
    /// Plain least-recently-used.
    Lru,
}

/// Configuration of one [`crate::Engine`]. Deserializes from a partial table (missing fields
/// take their defaults), e.g. the `[engine]` section of a server's TOML.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Size of the one DRAM arena; rounded down to whole blocks.
    pub dram_capacity_bytes: u64,
    /// Allocator page size; a power of two in 4 KiB ..= 16 MiB.
    pub dram_block_size: u32,
    pub eviction_policy: EvictionPolicyKind,
    /// How many of the coldest objects the policy chooses a victim among.
    pub eviction_candidate_window: usize,
    /// Number of index shards; a power of two.
    pub index_shards: usize,
    /// Touch every arena page at open so the hot path never pays first-touch faults.
    pub prefault: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            dram_capacity_bytes: 2 << 30,
            // Small blocks keep the waste under 4 KiB per object whatever the page sizes of
            // the registered pools; extents keep large objects contiguous all the same.
            dram_block_size: 4 << 10,
            eviction_policy: EvictionPolicyKind::PrefixDepth,
            eviction_candidate_window: 64,
            index_shards: 64,
            prefault: true,
        }
    }
}

impl EngineConfig {
    /// Number of whole blocks the arena will hold.
    pub fn total_blocks(&self) -> u64 {
        self.dram_capacity_bytes / u64::from(self.dram_block_size.max(1))
    }

    /// Check every field; the error names the offending field.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bs = self.dram_block_size;
        if !bs.is_power_of_two() || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&bs) {
            return Err(invalid(
                "dram_block_size",
                format!("{bs} must be a power of two in {MIN_BLOCK_SIZE}..={MAX_BLOCK_SIZE} bytes"),
            ));
        }
        let blocks = self.total_blocks();
        if blocks == 0 {
            return Err(invalid(
                "dram_capacity_bytes",
                format!(
                    "{} holds no whole block of {bs} bytes",
                    self.dram_capacity_bytes
                ),
            ));
        }
        // Extents address blocks with u32; the arena length must also fit the address space.
        if blocks > u64::from(u32::MAX) || usize::try_from(blocks * u64::from(bs)).is_err() {
            return Err(invalid(
                "dram_capacity_bytes",
                format!(
                    "{} is too large ({blocks} blocks of {bs} bytes)",
                    self.dram_capacity_bytes
                ),
            ));
        }
        if self.eviction_candidate_window == 0 {
            return Err(invalid(
                "eviction_candidate_window",
                "must be at least 1".to_string(),
            ));
        }
        let shards = self.index_shards;
        if !shards.is_power_of_two() || shards > MAX_INDEX_SHARDS {
            return Err(invalid(
                "index_shards",
                format!("{shards} must be a power of two in 1..={MAX_INDEX_SHARDS}"),
            ));
        }
        Ok(())
    }
}

fn invalid(key: &'static str, reason: String) -> EngineError {
    EngineError::InvalidConfig { key, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(c: EngineConfig) -> &'static str {
        match c.validate() {
            Err(EngineError::InvalidConfig { key, .. }) => key,
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }

    #[test]
    fn default_is_valid() {
        EngineConfig::default().validate().unwrap();
    }

    #[test]
    fn each_bad_field_is_named() {
        let d = EngineConfig::default;
        for bs in [0, 1000, 2048, 65535, 32 << 20] {
            let c = EngineConfig {
                dram_block_size: bs,
                ..d()
            };
            assert_eq!(key_of(c), "dram_block_size", "block size {bs}");
        }
        let c = EngineConfig {
            dram_capacity_bytes: 1000,
            ..d()
        };
        assert_eq!(key_of(c), "dram_capacity_bytes");
        let c = EngineConfig {
            eviction_candidate_window: 0,
            ..d()
        };
        assert_eq!(key_of(c), "eviction_candidate_window");
        for shards in [0, 3, 1 << 17] {
            let c = EngineConfig {
                index_shards: shards,
                ..d()
            };
            assert_eq!(key_of(c), "index_shards", "shards {shards}");
        }
    }
}
