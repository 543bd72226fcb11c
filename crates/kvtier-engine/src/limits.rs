//! The engine's configuration bounds gathered in one place, with the relations the code relies
//! on checked at compile time. The constants are declared next to the validation that
//! enforces them ([`crate::config`]) and re-exported here; the SSD tier's format bounds stay
//! with the format (`ssd/format.rs`), which is their only reader.

pub use crate::config::{MAX_BLOCK_SIZE, MAX_INDEX_SHARDS, MIN_BLOCK_SIZE};

/// The page size an arena block never splits (and the SSD tier's `O_DIRECT` alignment).
pub const PAGE: u32 = 4 << 10;

// The allocator splits and merges power-of-two blocks between these bounds.
const _: () = assert!(MIN_BLOCK_SIZE.is_power_of_two() && MAX_BLOCK_SIZE.is_power_of_two());
const _: () = assert!(MIN_BLOCK_SIZE <= MAX_BLOCK_SIZE);
// A block is whole pages: DRAM extents stay 4 KiB aligned, so the SSD tier can write a
// payload straight from them (its in-place record shape).
const _: () = assert!(MIN_BLOCK_SIZE.is_multiple_of(PAGE));
// The index takes the shard from 16 hash bits with a mask: a power of two within 2^16.
const _: () = assert!(MAX_INDEX_SHARDS.is_power_of_two() && MAX_INDEX_SHARDS <= 1 << 16);
// The longest key the protocol allows fits a record header's 32-bit key length field.
const _: () = assert!(kvtier_proto::limits::MAX_KEY_LEN <= u32::MAX as usize);
