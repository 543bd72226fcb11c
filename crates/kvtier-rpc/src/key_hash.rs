//! [`KeyHash`]: an object key's 128-bit XXH3 hash, the name the master's directory and the
//! re-replication copy tasks give a key on the wire (`CopyTask::key_hashes`, 16 bytes each).
//! The master indexes its directory by it; a node maps it back to the keys it holds. Both
//! compute it here, so they cannot disagree.

use std::hash::Hasher;

/// The directory's name for a key: its 128-bit hash as two words (8-byte aligned, so a map
/// slot is 24 bytes; a `u128` would be 16-byte aligned and pad the slot to 32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyHash([u64; 2]);

impl std::hash::Hash for KeyHash {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Already uniform: the map takes the low word as it is.
        state.write_u64(self.0[0]);
    }
}

impl KeyHash {
    /// The wire form: the low word then the high word, little endian (16 bytes).
    pub fn to_bytes(self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.0[0].to_le_bytes());
        out[8..].copy_from_slice(&self.0[1].to_le_bytes());
        out
    }

    /// The high word (the directory's shard is picked from its top bits; the map uses the
    /// low word).
    pub fn high(self) -> u64 {
        self.0[1]
    }

    /// Parse [`to_bytes`](Self::to_bytes)' form; `None` unless exactly 16 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Option<KeyHash> {
        let bytes: &[u8; 16] = bytes.try_into().ok()?;
        let lo = u64::from_le_bytes(bytes[..8].try_into().ok()?);
        let hi = u64::from_le_bytes(bytes[8..].try_into().ok()?);
        Some(KeyHash([lo, hi]))
    }
}

/// Hash a whole object key.
pub fn key_hash(key: &[u8]) -> KeyHash {
    let h = xxhash_rust::xxh3::xxh3_128(key);
    KeyHash([h as u64, (h >> 64) as u64])
}
