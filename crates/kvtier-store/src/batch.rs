//! Batch shapes shared by every store call. The result type, [`BatchResult`], is
//! `kvtier_proto`'s (re-exported here): the same value is a store call's result and a batch
//! opcode's reply.
//!
//! A page batch names `pages × components` objects without building their keys in the caller:
//! object `(page i, component j)` has key `prefix ++ page_keys[i] ++ suffixes[j]` (see
//! `kvtier_proto::query::compose_key`) and, when memory is involved, buffer `i * C + j`.

/// One caller buffer: an address and a length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemRef {
    pub ptr: usize,
    pub len: usize,
}

/// `pages × components` objects sharing one key prefix.
#[derive(Clone, Copy, Debug)]
pub struct PageBatch<'a, K: AsRef<[u8]>, S: AsRef<[u8]>> {
    pub prefix: &'a [u8],
    pub page_keys: &'a [K],
    pub suffixes: &'a [S],
}

impl<K: AsRef<[u8]>, S: AsRef<[u8]>> PageBatch<'_, K, S> {
    pub fn pages(&self) -> usize {
        self.page_keys.len()
    }

    pub fn components(&self) -> usize {
        self.suffixes.len()
    }
}

// Issue 16: one result type for store calls and wire replies, defined with its wire form.
pub use kvtier_proto::{BatchResult, MAX_ERRORS_PER_BATCH};
