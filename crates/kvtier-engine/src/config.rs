//! Engine configuration and its validation.
//!
//! Owns: the knobs of one engine instance, which are also kvtier's user-facing engine keys
//! (issue 16: declared once, here; see [`EngineConfig`]), the strict deserializers every
//! kvtier schema parses values with ([`strict`]), and the rules that make a configuration
//! usable.
//! Invariant: an [`EngineConfig`] that passed [`EngineConfig::validate`] yields an arena of at
//! least one block, a block size the allocator and arena can address, and a power-of-two shard
//! count, so nothing downstream re-checks these.

use std::path::{Component, Path, PathBuf};

use crate::error::EngineError;

/// Smallest allowed allocator block: one 4 KiB page, so an arena block never splits a page.
pub const MIN_BLOCK_SIZE: u32 = 4 << 10;
/// Largest allowed allocator block: larger blocks waste too much on small side-pool objects.
pub const MAX_BLOCK_SIZE: u32 = 16 << 20;
/// Upper bound on index shards; the shard is taken from 16 hash bits (see `index.rs`).
pub const MAX_INDEX_SHARDS: usize = 1 << 16;
/// Range of `eviction_candidate_window` (issue 26: 2^31 aborted the server at its first put,
/// the window is scanned on every eviction).
pub const EVICTION_WINDOW_RANGE: (usize, usize) = (1, 1 << 16);
/// Range of `ssd_copy_queue_depth`, in objects.
pub const SSD_COPY_QUEUE_RANGE: (usize, usize) = (1, 1 << 20);
/// Range of `ssd_copy_batch_max_ops`, in records per write.
pub const SSD_COPY_BATCH_RANGE: (usize, usize) = (1, 1 << 12);
/// Range of `ssd_copy_worker_threads`.
pub const SSD_COPY_WORKERS_RANGE: (usize, usize) = (1, 64);

/// `value` in `lo..=hi`, else an error naming the key, the value and the range.
fn in_range(key: &'static str, value: usize, (lo, hi): (usize, usize)) -> Result<(), EngineError> {
    if (lo..=hi).contains(&value) {
        Ok(())
    } else {
        Err(invalid(
            key,
            format!("{value} is outside the range {lo}..={hi}"),
        ))
    }
}

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

/// Configuration of one [`crate::Engine`], and the one declaration of kvtier's engine keys.
///
/// Every field but `index_shards` is a user-facing key of the same name: its doc comment
/// here is the key's documentation, its `strict::*` deserializer the key's syntax, and
/// [`Default`] below its default. `kvtier_client::KvtierConfig` embeds this struct
/// (`#[serde(flatten)]`) instead of mirroring the keys, so an engine key is declared once and
/// reaches the engine without a field-by-field copy. Unknown keys are refused by the loaders
/// (`KvtierConfig::load_layered` names the key and its origin), not here: serde cannot deny
/// unknown fields of a flattened struct.
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default)]
pub struct EngineConfig {
    /// Size of the pre-faulted DRAM arena, in bytes; rounded down to whole blocks.
    #[serde(deserialize_with = "strict::size")]
    pub dram_capacity_bytes: u64,
    /// Allocation unit of the DRAM arena (a power of two from 4 KiB to 16 MiB); objects of
    /// any size are stored exactly.
    #[serde(deserialize_with = "strict::size")]
    pub dram_block_size: u32,
    /// Touch every arena page at start so the first puts do not pay page faults.
    #[serde(deserialize_with = "strict::boolean")]
    pub dram_prefault: bool,
    /// `prefix_depth` (evict the tail of a prefix chain before its head) or `lru`.
    pub eviction_policy: EvictionPolicyKind,
    /// How many of the coldest objects the eviction policy chooses among.
    #[serde(deserialize_with = "strict::count")]
    pub eviction_candidate_window: usize,

    // ---- SSD tier (off by default; names follow UMBP's) ----
    /// Turn on the SSD tier (append-only segment log under `ssd_storage_dir`).
    #[serde(deserialize_with = "strict::boolean")]
    pub ssd_enabled: bool,
    /// Directory of the segment files (created 0700 if missing; one engine per directory).
    #[serde(
        deserialize_with = "strict::path",
        serialize_with = "strict::serialize_path"
    )]
    pub ssd_storage_dir: PathBuf,
    /// Sub-directory of `ssd_storage_dir` for this store (the segment directory is
    /// [`EngineConfig::ssd_dir`]). The SGLang adapter sets it from the DP/PP/TP ranks
    /// (`dp0_tp1`) when unset, so ranks never share one segment log.
    #[serde(deserialize_with = "strict::optional_string")]
    pub ssd_storage_subdir: Option<String>,
    /// Bound of the segment files' total size; holds `capacity / segment size` segments.
    #[serde(deserialize_with = "strict::size")]
    pub ssd_capacity_bytes: u64,
    /// Size of one segment file (the unit of space reclaim); a multiple of 4 KiB, at least
    /// 64 KiB.
    #[serde(deserialize_with = "strict::size")]
    pub ssd_segment_size_bytes: u64,
    /// Copy puts to SSD in the background (true) or before the put returns (false). `strict`
    /// durability always waits.
    #[serde(deserialize_with = "strict::boolean")]
    pub ssd_copy_async: bool,
    /// Bound of the DRAM-to-SSD copy queue, in objects; a full queue makes puts wait.
    #[serde(deserialize_with = "strict::count")]
    pub ssd_copy_queue_depth: usize,
    /// Copy-pipeline worker threads (each writes batches and, in strict mode, syncs them).
    #[serde(deserialize_with = "strict::count")]
    pub ssd_copy_worker_threads: usize,
    /// Most records one write (and one sync) of the copy pipeline carries.
    #[serde(deserialize_with = "strict::count")]
    pub ssd_copy_batch_max_ops: usize,
    /// `strict` (`sync`): a put returns once its record is on disk and synced; `relaxed`
    /// (`async`): records are written and synced in the background.
    pub ssd_durability_mode: SsdDurabilityMode,
    /// `posix` (pread/pwrite, O_DIRECT where the filesystem allows it) or `io_uring`.
    pub ssd_io_backend: SsdIoBackend,
    /// `write_through` (every put is copied to SSD) or `write_back` (on DRAM eviction).
    pub ssd_write_policy: SsdWritePolicy,
    /// Copy an object read from SSD back into DRAM.
    #[serde(deserialize_with = "strict::boolean")]
    pub auto_promote_on_read: bool,
    /// SSD fill fraction that starts background reclaim.
    #[serde(deserialize_with = "strict::fraction")]
    pub ssd_high_watermark: f64,
    /// SSD fill fraction background reclaim brings usage down to.
    #[serde(deserialize_with = "strict::fraction")]
    pub ssd_low_watermark: f64,

    // ---- internal (not a key) ----
    /// Number of index shards; a power of two. Tests and benchmarks set it; users do not.
    #[serde(skip)]
    pub index_shards: usize,
    /// Issue 26: `ssd_storage_dir` was configured (or already resolved), so it is used as
    /// given and an unsafe one is an error; when false and it is the default path,
    /// [`EngineConfig::resolve_default_ssd_dir`] may fall back to a private directory.
    #[serde(skip)]
    pub ssd_storage_dir_explicit: Provenance,
}

/// A provenance flag of a configuration: it says where a value came from, not what the
/// configuration is, so any two compare equal (a configuration printed and loaded back is the
/// same configuration).
#[derive(Clone, Copy, Debug, Default)]
pub struct Provenance(pub bool);

impl PartialEq for Provenance {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            dram_capacity_bytes: 2 << 30,
            // Small blocks keep the waste under 4 KiB per object whatever the page sizes of
            // the registered pools; extents keep large objects contiguous all the same.
            dram_block_size: 4 << 10,
            dram_prefault: true,
            eviction_policy: EvictionPolicyKind::PrefixDepth,
            eviction_candidate_window: 64,
            ssd_enabled: false,
            // Per user, created 0700 and checked at open (never a shared world-writable path).
            ssd_storage_dir: default_ssd_storage_dir(),
            ssd_storage_subdir: None,
            ssd_capacity_bytes: 16 << 30,
            ssd_segment_size_bytes: 256 << 20,
            ssd_copy_async: true,
            ssd_copy_queue_depth: 256,
            ssd_copy_worker_threads: 2,
            ssd_copy_batch_max_ops: 32,
            ssd_durability_mode: SsdDurabilityMode::Relaxed,
            ssd_io_backend: SsdIoBackend::Posix,
            ssd_write_policy: SsdWritePolicy::WriteThrough,
            auto_promote_on_read: true,
            ssd_high_watermark: 0.9,
            ssd_low_watermark: 0.8,
            index_shards: 64,
            ssd_storage_dir_explicit: Provenance(false),
        }
    }
}

/// The default `ssd_storage_dir`: `/var/tmp/kvtier-ssd-<uid>` (per user, created 0700 and
/// checked at open; [`EngineConfig::resolve_default_ssd_dir`] falls back when another user
/// took it).
pub fn default_ssd_storage_dir() -> PathBuf {
    PathBuf::from(format!(
        "/var/tmp/kvtier-ssd-{}",
        rustix::process::geteuid().as_raw()
    ))
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
        in_range(
            "eviction_candidate_window",
            self.eviction_candidate_window,
            EVICTION_WINDOW_RANGE,
        )?;
        let shards = self.index_shards;
        if !shards.is_power_of_two() || shards > MAX_INDEX_SHARDS {
            return Err(invalid(
                "index_shards",
                format!("{shards} must be a power of two in 1..={MAX_INDEX_SHARDS}"),
            ));
        }
        // Checked even with the tier off, so a bad value is refused before anyone enables it.
        if let Some(sub) = &self.ssd_storage_subdir {
            let path = Path::new(sub);
            let escapes = sub.is_empty()
                || path.is_absolute()
                || path
                    .components()
                    .any(|c| !matches!(c, Component::Normal(_)));
            if escapes {
                return Err(invalid(
                    "ssd_storage_subdir",
                    format!("{sub:?} must be a relative path without '..'"),
                ));
            }
        }
        if self.ssd_enabled {
            self.validate_ssd()?;
        }
        Ok(())
    }

    /// The segment directory: `ssd_storage_dir`, joined with `ssd_storage_subdir` when set.
    pub fn ssd_dir(&self) -> PathBuf {
        match &self.ssd_storage_subdir {
            Some(sub) => self.ssd_storage_dir.join(sub),
            None => self.ssd_storage_dir.clone(),
        }
    }

    /// Issue 26: with the SSD tier on and `ssd_storage_dir` left at its default, make sure
    /// the default directory is this user's private directory; when it cannot be (another user
    /// created `/var/tmp/kvtier-ssd-<uid>` first, a file is in the way, ...), switch to the
    /// user's state directory (`$XDG_STATE_HOME/kvtier/ssd` or `~/.local/state/kvtier/ssd`),
    /// else to a fresh `/var/tmp/kvtier-ssd-<uid>-XXXXXXXX` (0700). Returns the notice saying
    /// which (also logged), or `None` when nothing changed. A configured directory is never
    /// replaced: its problems are errors naming it, at open. Runs once per configuration.
    pub fn resolve_default_ssd_dir(&mut self) -> Result<Option<String>, EngineError> {
        if !self.ssd_enabled
            || self.ssd_storage_dir_explicit.0
            || self.ssd_storage_dir != default_ssd_storage_dir()
        {
            return Ok(None);
        }
        self.ssd_storage_dir_explicit = Provenance(true);
        let default = self.ssd_storage_dir.clone();
        let Err(problem) = crate::private_dir::ensure_private_dir(&default, 0o022) else {
            return Ok(None);
        };
        let state = crate::private_dir::user_state_dir("ssd")
            .filter(|dir| crate::private_dir::ensure_private_dir(dir, 0o022).is_ok());
        let fallback = match state {
            Some(dir) => dir,
            None => {
                let uid = rustix::process::geteuid().as_raw();
                let parent = default.parent().unwrap_or(Path::new("/var/tmp"));
                crate::private_dir::create_fresh_private_dir(parent, &format!("kvtier-ssd-{uid}"))
                    .map_err(EngineError::SsdOpen)?
            }
        };
        let notice = format!(
            "the default SSD directory cannot be used ({problem}); using {} instead (set \
             ssd_storage_dir to choose one)",
            fallback.display()
        );
        tracing::warn!("kvtier: {notice}");
        self.ssd_storage_dir = fallback;
        Ok(Some(notice))
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
        in_range(
            "ssd_copy_queue_depth",
            self.ssd_copy_queue_depth,
            SSD_COPY_QUEUE_RANGE,
        )?;
        in_range(
            "ssd_copy_worker_threads",
            self.ssd_copy_worker_threads,
            SSD_COPY_WORKERS_RANGE,
        )?;
        in_range(
            "ssd_copy_batch_max_ops",
            self.ssd_copy_batch_max_ops,
            SSD_COPY_BATCH_RANGE,
        )?;
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

/// Strict deserializers shared by every key of every kvtier schema (this crate's
/// [`EngineConfig`], `kvtier_client::KvtierConfig`, `kvtier serve`'s settings): they accept a
/// typed value or its string form (environment variables are always strings) and nothing
/// else.
pub mod strict {
    use serde::de::{self, Deserializer, Visitor};
    use serde::Serializer;
    use std::fmt;
    use std::path::{Path, PathBuf};

    pub fn boolean<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = bool;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a boolean (true/false, 1/0, yes/no, on/off)")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<bool, E> {
                Ok(v)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<bool, E> {
                match v {
                    0 => Ok(false),
                    1 => Ok(true),
                    _ => Err(E::custom(format!("{v} is not a boolean (use 0 or 1)"))),
                }
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<bool, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("{v} is not a boolean")))
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
                match v.trim().to_ascii_lowercase().as_str() {
                    "1" | "true" | "yes" | "on" => Ok(true),
                    "0" | "false" | "no" | "off" => Ok(false),
                    _ => Err(E::custom(format!(
                        "{v:?} is not a boolean (true/false, 1/0, yes/no, on/off)"
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }

    pub fn string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        match optional_string(d)? {
            Some(s) => Ok(s),
            None => Err(de::Error::custom("expected a string")),
        }
    }

    /// A number from 0.0 to 1.0 (a float, an integer 0/1, or its string form).
    pub fn fraction<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = f64;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a fraction from 0.0 to 1.0")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<f64, E> {
                if (0.0..=1.0).contains(&v) {
                    Ok(v)
                } else {
                    Err(E::custom(format!("{v} is not a fraction from 0.0 to 1.0")))
                }
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<f64, E> {
                self.visit_f64(v as f64)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<f64, E> {
                self.visit_f64(v as f64)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<f64, E> {
                let f: f64 = v
                    .trim()
                    .parse()
                    .map_err(|_| E::custom(format!("{v:?} is not a number")))?;
                self.visit_f64(f)
            }
        }
        d.deserialize_any(V)
    }

    /// A byte size: integer, or a string with an optional KiB/MiB/GiB/TiB suffix, in the
    /// field's own integer type (`u64`, `u32`, `usize`).
    pub fn size<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<T, D::Error> {
        narrow(d.deserialize_any(Unsigned { sizes: true })?)
    }

    /// A plain non-negative count, in the field's own integer type.
    pub fn count<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<T, D::Error> {
        narrow(d.deserialize_any(Unsigned { sizes: false })?)
    }

    fn narrow<T: TryFrom<u64>, E: de::Error>(v: u64) -> Result<T, E> {
        T::try_from(v).map_err(|_| E::custom(format!("{v} is too large for this key")))
    }

    /// A filesystem path, given as a string.
    pub fn path<'de, D: Deserializer<'de>>(d: D) -> Result<PathBuf, D::Error> {
        string(d).map(PathBuf::from)
    }

    /// A path as its string form (lossy for non-UTF-8 paths, so printing the effective
    /// configuration never fails).
    pub fn serialize_path<S: Serializer>(path: &Path, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&path.to_string_lossy())
    }

    pub fn optional_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Option<String>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Some(v.to_string()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
        }
        d.deserialize_any(V)
    }

    struct Unsigned {
        sizes: bool,
    }

    impl Visitor<'_> for Unsigned {
        type Value = u64;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            if self.sizes {
                f.write_str("a byte size (integer, or a string like \"512MiB\")")
            } else {
                f.write_str("a non-negative integer")
            }
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::custom(format!("{v} is negative")))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<u64, E> {
            Err(E::custom(format!("{v} is not an integer")))
        }
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<u64, E> {
            Err(E::custom(format!("{v} is not a number")))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
            parse_unsigned(v, self.sizes).map_err(E::custom)
        }
    }

    pub fn parse_unsigned(text: &str, sizes: bool) -> Result<u64, String> {
        let t = text.trim();
        let (digits, multiplier) = if sizes {
            const UNITS: [(&str, u64); 5] = [
                ("KiB", 1 << 10),
                ("MiB", 1 << 20),
                ("GiB", 1 << 30),
                ("TiB", 1 << 40),
                ("B", 1),
            ];
            UNITS
                .iter()
                .find_map(|(suffix, m)| t.strip_suffix(suffix).map(|d| (d.trim(), *m)))
                .unwrap_or((t, 1))
        } else {
            (t, 1)
        };
        let n: u64 = digits.parse().map_err(|_| {
            if sizes {
                format!("{text:?} is not a byte size (integer with optional KiB/MiB/GiB/TiB)")
            } else {
                format!("{text:?} is not a non-negative integer")
            }
        })?;
        n.checked_mul(multiplier)
            .ok_or_else(|| format!("{text:?} overflows 64 bits"))
    }
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
        for window in [0, (1 << 16) + 1, 1 << 31] {
            let c = EngineConfig {
                eviction_candidate_window: window,
                ..d()
            };
            assert_eq!(key_of(c), "eviction_candidate_window", "{window}");
        }
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

    /// The keys parse strictly from a partial table (the rest default); sizes and counts land
    /// in the fields' own integer types, refusing what does not fit.
    #[test]
    fn keys_parse_strictly_into_the_engine_types() {
        let c: EngineConfig = toml::from_str(
            "dram_block_size = \"64KiB\"\ndram_prefault = \"no\"\n\
             ssd_copy_queue_depth = \"12\"\nssd_storage_dir = \"/x\"\n\
             ssd_storage_subdir = \"dp0_tp1\"\nssd_high_watermark = \"0.5\"",
        )
        .unwrap();
        assert_eq!(c.dram_block_size, 64 << 10);
        assert!(!c.dram_prefault);
        assert_eq!(c.ssd_copy_queue_depth, 12);
        assert_eq!(c.ssd_dir(), PathBuf::from("/x/dp0_tp1"));
        assert_eq!(c.index_shards, EngineConfig::default().index_shards);
        for bad in [
            "dram_block_size = \"8GiB\"",
            "dram_prefault = \"maybe\"",
            "ssd_copy_queue_depth = -1",
            "ssd_high_watermark = 2.0",
            "ssd_storage_dir = 5",
            "eviction_policy = \"fifo\"",
        ] {
            assert!(toml::from_str::<EngineConfig>(bad).is_err(), "{bad}");
        }
        for sub in ["../up", "/abs", "", "a/../b"] {
            let c = EngineConfig {
                ssd_storage_subdir: Some(sub.into()),
                ..EngineConfig::default()
            };
            assert_eq!(key_of(c), "ssd_storage_subdir", "{sub:?}");
        }
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
