//! Engine configuration and its validation.
//!
//! Owns: the knobs of one engine instance and the rules that make a configuration usable.
//! Invariant: an [`EngineConfig`] that passed [`EngineConfig::validate`] yields an arena of at
//! least one block, a block size the allocator and arena can address, and a power-of-two shard
//! count, so nothing downstream re-checks these.

use std::path::PathBuf;

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

/// How durable an acknowledged SSD write is (see the `ssd` module docs for exactly what each
/// mode can lose in a crash). `"sync"` and `"async"` are accepted as aliases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SsdDurabilityMode {
    /// A put returns only once its SSD record is written and `fdatasync`ed (group commit).
    #[serde(alias = "sync")]
    Strict,
    /// SSD records are synced in the background (at least once a second) and on `flush`.
    #[default]
    #[serde(alias = "async")]
    Relaxed,
}

/// Which I/O backend the SSD tier uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SsdIoBackend {
    /// `pread`/`pwrite` with `O_DIRECT` where the filesystem allows it.
    #[default]
    Posix,
    /// `io_uring` (one ring per I/O thread); where the kernel refuses it the tier falls back
    /// to `Posix` with one warning (`ssd_io_uring = false` in the stats).
    #[serde(alias = "io-uring")]
    IoUring,
}

/// When objects are copied from DRAM to SSD.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SsdWritePolicy {
    /// Every stored put is copied to SSD (in the background or before the put returns).
    #[default]
    #[serde(alias = "write-through")]
    WriteThrough,
    /// Objects are copied to SSD when DRAM evicts them.
    #[serde(alias = "write-back")]
    WriteBack,
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

    // ---- SSD tier (off by default; names follow UMBP's) ----
    /// Enable the SSD tier below DRAM.
    pub ssd_enabled: bool,
    /// Directory of the segment files (created if missing; one engine per directory).
    pub ssd_storage_dir: PathBuf,
    /// Upper bound on the segment files' total size; holds `capacity / segment size` segments.
    pub ssd_capacity_bytes: u64,
    /// Size of one segment file; a multiple of 4 KiB, at least 64 KiB.
    pub ssd_segment_size_bytes: u64,
    /// Write-through copies run in the background (`true`) or before the put returns.
    /// `strict` durability always waits.
    pub ssd_copy_async: bool,
    /// Bound of the DRAM→SSD copy queue (objects); a full queue makes puts wait.
    pub ssd_copy_queue_depth: usize,
    /// Copy worker threads (each writes batches and, in strict mode, syncs them).
    pub ssd_copy_worker_threads: usize,
    /// Most records one worker writes (and syncs) as one batch.
    pub ssd_copy_batch_max_ops: usize,
    pub ssd_durability_mode: SsdDurabilityMode,
    pub ssd_io_backend: SsdIoBackend,
    /// A get served from SSD copies the object back into DRAM.
    pub auto_promote_on_read: bool,
    /// Fraction of segments in use above which background reclaim starts.
    pub ssd_high_watermark: f64,
    /// Fraction of segments in use that background reclaim brings usage down to.
    pub ssd_low_watermark: f64,
    pub ssd_write_policy: SsdWritePolicy,
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
            ssd_enabled: false,
            // Per user, created 0700 and checked at open (never a shared world-writable path).
            ssd_storage_dir: PathBuf::from(format!(
                "/var/tmp/kvtier-ssd-{}",
                rustix::process::geteuid().as_raw()
            )),
            ssd_capacity_bytes: 16 << 30,
            ssd_segment_size_bytes: 256 << 20,
            ssd_copy_async: true,
            ssd_copy_queue_depth: 256,
            ssd_copy_worker_threads: 2,
            ssd_copy_batch_max_ops: 32,
            ssd_durability_mode: SsdDurabilityMode::Relaxed,
            ssd_io_backend: SsdIoBackend::Posix,
            auto_promote_on_read: true,
            ssd_high_watermark: 0.9,
            ssd_low_watermark: 0.8,
            ssd_write_policy: SsdWritePolicy::WriteThrough,
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
        if self.ssd_enabled {
            self.validate_ssd()?;
        }
        Ok(())
    }

    /// Number of segment files the SSD tier may hold.
    pub fn ssd_segments(&self) -> u64 {
        self.ssd_capacity_bytes / self.ssd_segment_size_bytes.max(1)
    }

    fn validate_ssd(&self) -> Result<(), EngineError> {
        if self.ssd_storage_dir.as_os_str().is_empty() {
            return Err(invalid("ssd_storage_dir", "must not be empty".to_string()));
        }
        let seg = self.ssd_segment_size_bytes;
        if !seg.is_multiple_of(4096) || !(64 << 10..=4 << 30).contains(&seg) {
            return Err(invalid(
                "ssd_segment_size_bytes",
                format!("{seg} must be a multiple of 4096 in 64 KiB..=4 GiB"),
            ));
        }
        let n = self.ssd_segments();
        if !(2..=1 << 20).contains(&n) {
            return Err(invalid(
                "ssd_capacity_bytes",
                format!(
                    "{} holds {n} segments of {seg} bytes; need 2..=1048576",
                    self.ssd_capacity_bytes
                ),
            ));
        }
        if self.ssd_copy_queue_depth == 0 {
            return Err(invalid("ssd_copy_queue_depth", "must be at least 1".into()));
        }
        if !(1..=64).contains(&self.ssd_copy_worker_threads) {
            return Err(invalid(
                "ssd_copy_worker_threads",
                "must be in 1..=64".into(),
            ));
        }
        if self.ssd_copy_batch_max_ops == 0 {
            return Err(invalid(
                "ssd_copy_batch_max_ops",
                "must be at least 1".into(),
            ));
        }
        let (lo, hi) = (self.ssd_low_watermark, self.ssd_high_watermark);
        if !(hi > 0.0 && hi <= 1.0) {
            return Err(invalid(
                "ssd_high_watermark",
                format!("{hi} must be in (0, 1]"),
            ));
        }
        if !(lo > 0.0 && lo <= hi) {
            return Err(invalid(
                "ssd_low_watermark",
                format!("{lo} must be in (0, ssd_high_watermark]"),
            ));
        }
        if self.ssd_write_policy == SsdWritePolicy::WriteBack
            && self.ssd_durability_mode == SsdDurabilityMode::Strict
        {
            return Err(invalid(
                "ssd_write_policy",
                "write_back copies only on eviction, so it cannot give strict durability; \
                 use write_through with strict"
                    .into(),
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

    #[test]
    fn ssd_fields_validate_only_when_enabled_and_name_the_field() {
        let on = || EngineConfig {
            ssd_enabled: true,
            ssd_capacity_bytes: 8 << 20,
            ssd_segment_size_bytes: 1 << 20,
            ..EngineConfig::default()
        };
        on().validate().unwrap();
        let off = EngineConfig {
            ssd_segment_size_bytes: 3,
            ..EngineConfig::default()
        };
        off.validate().unwrap();
        let cases: Vec<(EngineConfig, &str)> = vec![
            (
                EngineConfig {
                    ssd_segment_size_bytes: 5000,
                    ..on()
                },
                "ssd_segment_size_bytes",
            ),
            (
                EngineConfig {
                    ssd_capacity_bytes: 1 << 20,
                    ..on()
                },
                "ssd_capacity_bytes",
            ),
            (
                EngineConfig {
                    ssd_copy_queue_depth: 0,
                    ..on()
                },
                "ssd_copy_queue_depth",
            ),
            (
                EngineConfig {
                    ssd_copy_worker_threads: 0,
                    ..on()
                },
                "ssd_copy_worker_threads",
            ),
            (
                EngineConfig {
                    ssd_copy_batch_max_ops: 0,
                    ..on()
                },
                "ssd_copy_batch_max_ops",
            ),
            (
                EngineConfig {
                    ssd_high_watermark: 1.5,
                    ..on()
                },
                "ssd_high_watermark",
            ),
            (
                EngineConfig {
                    ssd_low_watermark: 0.95,
                    ..on()
                },
                "ssd_low_watermark",
            ),
            (
                EngineConfig {
                    ssd_write_policy: SsdWritePolicy::WriteBack,
                    ssd_durability_mode: SsdDurabilityMode::Strict,
                    ..on()
                },
                "ssd_write_policy",
            ),
        ];
        for (c, key) in cases {
            assert_eq!(key_of(c), key);
        }
        EngineConfig {
            ssd_io_backend: SsdIoBackend::IoUring,
            ..on()
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn ssd_enums_take_snake_case_and_aliases() {
        #[derive(serde::Deserialize)]
        struct W {
            d: SsdDurabilityMode,
            b: SsdIoBackend,
            p: SsdWritePolicy,
        }
        let w: W = toml::from_str("d = \"sync\"\nb = \"io_uring\"\np = \"write_back\"").unwrap();
        assert_eq!(
            (w.d, w.b, w.p),
            (
                SsdDurabilityMode::Strict,
                SsdIoBackend::IoUring,
                SsdWritePolicy::WriteBack
            )
        );
        let w: W = toml::from_str("d = \"async\"\nb = \"posix\"\np = \"write_through\"").unwrap();
        assert_eq!(w.d, SsdDurabilityMode::Relaxed);
        let w: W = toml::from_str("d = \"strict\"\nb = \"posix\"\np = \"write_through\"").unwrap();
        assert_eq!(w.d, SsdDurabilityMode::Strict);
    }
}
