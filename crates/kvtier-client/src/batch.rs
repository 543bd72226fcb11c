//! Batch shapes shared by every store call.
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

/// Most distinct error messages one batch result keeps; the rest are counted.
pub const MAX_ERRORS_PER_BATCH: usize = 8;

/// Per-item success plus the distinct reasons of the failures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchResult {
    pub ok: Vec<bool>,
    pub errors: Vec<String>,
    pub suppressed_errors: usize,
}

impl BatchResult {
    pub fn with_capacity(n: usize) -> Self {
        BatchResult {
            ok: Vec::with_capacity(n),
            errors: Vec::new(),
            suppressed_errors: 0,
        }
    }

    /// Every item failed for one reason.
    pub fn all_failed(n: usize, reason: impl Into<String>) -> Self {
        let mut r = BatchResult {
            ok: vec![false; n],
            ..Default::default()
        };
        r.note_error(reason.into());
        r
    }

    pub fn note_error(&mut self, message: String) {
        if self.errors.contains(&message) {
            return;
        }
        if self.errors.len() < MAX_ERRORS_PER_BATCH {
            self.errors.push(message);
        } else {
            self.suppressed_errors += 1;
        }
    }

    /// Append another result's items and errors (for batches split across threads).
    pub fn absorb(&mut self, other: BatchResult) {
        self.ok.extend(other.ok);
        self.suppressed_errors += other.suppressed_errors;
        for e in other.errors {
            self.note_error(e);
        }
    }

    pub fn succeeded(&self) -> usize {
        self.ok.iter().filter(|&&b| b).count()
    }
}
