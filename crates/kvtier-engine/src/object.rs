//! Stored objects and read pins.
//!
//! Owns: [`Object`] (an object's length and where its bytes live) and [`PinnedObject`], the
//! handle a reader holds while copying.
//!
//! Invariant: an `Object` is immutable once published in the index; its bytes were fully
//! written before publication. Its memory is released when the last `Arc<Object>` drops —
//! the index holds one, each pin holds one — so unlinking an object that is being read never
//! frees memory under the copy.

use std::sync::Arc;

use crate::dram::DramAllocation;
use crate::error::EngineError;
use crate::stats::{add, Counters};

/// Where an object's bytes live.
pub(crate) enum Location {
    Dram(DramAllocation),
    /// Read from the SSD tier for one pin when DRAM could not take it (every block pinned):
    /// private to that pin, never in the index, freed when the pin drops.
    Heap(Box<[u8]>),
}

/// One stored object.
pub(crate) struct Object {
    pub(crate) location: Location,
    /// Prefix-chain depth given at put time; carried into the SSD record.
    pub(crate) depth: Option<u32>,
}

impl Object {
    pub(crate) fn len(&self) -> u64 {
        match &self.location {
            Location::Dram(a) => a.len(),
            Location::Heap(bytes) => bytes.len() as u64,
        }
    }

    /// DRAM blocks held (0 for objects in other tiers).
    pub(crate) fn dram_blocks(&self) -> u64 {
        match &self.location {
            Location::Dram(a) => a.blocks(),
            Location::Heap(_) => 0,
        }
    }

    /// CRC-32C of the bytes, when computed at put time.
    pub(crate) fn checksum(&self) -> Option<u32> {
        match &self.location {
            Location::Dram(a) => a.checksum(),
            // Checked against the SSD record when it was read.
            Location::Heap(_) => None,
        }
    }

    /// The object's bytes in place (DRAM extents, in order).
    pub(crate) fn slices(&self) -> impl Iterator<Item = &[u8]> + '_ {
        // One of the two is empty; no boxing on the get path.
        let (dram, heap) = match &self.location {
            Location::Dram(a) => (Some(a.slices()), None),
            Location::Heap(bytes) => (None, Some(&bytes[..]).filter(|b| !b.is_empty())),
        };
        dram.into_iter().flatten().chain(heap)
    }

    /// Copy the whole object into `dst`; the length must already have been checked.
    pub(crate) fn copy_to(&self, dst: &mut [u8]) {
        match &self.location {
            Location::Dram(a) => a.read(dst),
            Location::Heap(bytes) => dst.copy_from_slice(bytes),
        }
    }
}

/// A read pin: while it lives, the object's memory cannot be evicted or reused, even if the
/// object is removed from the index meanwhile. Drop it as soon as the copy is done: a pinned
/// object cannot make room for new puts.
pub struct PinnedObject {
    pub(crate) object: Arc<Object>,
    pub(crate) counters: Arc<Counters>,
}

impl PinnedObject {
    /// Stored length in bytes.
    pub fn len(&self) -> u64 {
        self.object.len()
    }

    /// Whether the object is empty (zero bytes).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy the whole object into `dst`, whose length must equal [`Self::len`]; otherwise
    /// `SizeMismatch` and `dst` is untouched. Counts `bytes_out` / `size_mismatches`.
    pub fn read_into(&self, dst: &mut [u8]) -> Result<(), EngineError> {
        let stored = self.len();
        if dst.len() as u64 != stored {
            add(&self.counters.size_mismatches, 1);
            return Err(EngineError::SizeMismatch {
                stored,
                requested: dst.len() as u64,
            });
        }
        self.object.copy_to(dst);
        add(&self.counters.bytes_out, stored);
        Ok(())
    }

    /// The object's bytes in place, read only: its DRAM extents in order (none for an empty
    /// object), for a caller that sends them without a copy (e.g. a vectored socket write).
    /// The slices borrow the pin, so they cannot outlive it. Counts nothing; a caller that
    /// hands the bytes out calls [`Self::count_read`] once.
    pub fn slices(&self) -> impl Iterator<Item = &[u8]> + '_ {
        self.object.slices()
    }

    /// Count the object as read out (`bytes_out`), as [`Self::read_into`] does, for a
    /// caller that used [`Self::slices`] instead.
    pub fn count_read(&self) {
        add(&self.counters.bytes_out, self.len());
    }
}

impl std::fmt::Debug for PinnedObject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedObject")
            .field("len", &self.len())
            .finish()
    }
}
