//! The DRAM tier: a pre-faulted arena plus its block allocator.
//!
//! Owns: the arena memory and which blocks of it belong to which [`DramAllocation`].
//!
//! Invariants:
//! - a [`DramAllocation`] is the sole owner of its extents from `allocate` until its `Drop`,
//!   which returns them to the allocator; so a block is never in two live allocations;
//! - an allocation of `len` bytes holds exactly `ceil(len / block_size)` blocks (0 for an
//!   empty object), so the waste is under one block per object;
//! - bytes are written only through `&mut DramAllocation` and read through `&DramAllocation`.
//!
//! Every allocation keeps the tier's shared state alive (`Arc`), so memory a reader is still
//! copying stays mapped even if the engine itself is dropped meanwhile.

mod allocator;
mod arena;

use std::io;
use std::sync::Arc;

use parking_lot::Mutex;

pub use allocator::{Allocator, Extent};
use arena::Arena;

struct Shared {
    arena: Arena,
    allocator: Mutex<Allocator>,
    block_size: u64,
    checksums: bool,
}

/// How the DRAM tier is set up.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DramOptions {
    /// Touch every page at open so the first put into a block does not pay the page fault.
    pub prefault: bool,
    /// Compute each object's CRC-32C while it is copied in (while its bytes are in cache), so
    /// the SSD tier need not read the object again to checksum its record.
    pub checksums: bool,
}

/// Handle to the DRAM tier; cheap to share.
pub(crate) struct DramTier {
    shared: Arc<Shared>,
}

impl DramTier {
    /// Map `blocks` blocks of `block_size` bytes.
    pub(crate) fn open(blocks: u32, block_size: u32, options: DramOptions) -> io::Result<DramTier> {
        let arena = Arena::new(blocks, block_size, options.prefault)?;
        debug_assert_eq!(
            arena.len() as u64,
            u64::from(blocks) * u64::from(block_size)
        );
        Ok(DramTier {
            shared: Arc::new(Shared {
                arena,
                allocator: Mutex::new(Allocator::new(blocks)),
                block_size: u64::from(block_size),
                checksums: options.checksums,
            }),
        })
    }

    pub(crate) fn block_size(&self) -> u64 {
        self.shared.block_size
    }

    pub(crate) fn capacity_bytes(&self) -> u64 {
        self.shared.arena.len() as u64
    }

    /// The arena's base and length (issue 17).
    pub(crate) fn memory(&self) -> (*mut u8, usize) {
        (self.shared.arena.base_ptr(), self.shared.arena.len())
    }

    pub(crate) fn total_blocks(&self) -> u64 {
        u64::from(self.shared.allocator.lock().total_blocks())
    }

    /// Blocks an object of `len` bytes occupies.
    pub(crate) fn blocks_for(&self, len: u64) -> u64 {
        len.div_ceil(self.shared.block_size)
    }

    pub(crate) fn free_blocks(&self) -> u64 {
        self.shared.allocator.lock().free_blocks()
    }

    /// Reserve room for `len` bytes, or `None` when fewer blocks are free.
    pub(crate) fn try_allocate(&self, len: u64) -> Option<DramAllocation> {
        let blocks = u32::try_from(self.blocks_for(len)).ok()?;
        let mut extents = Vec::new();
        if blocks > 0 && !self.shared.allocator.lock().allocate(blocks, &mut extents) {
            return None;
        }
        Some(DramAllocation {
            shared: Arc::clone(&self.shared),
            extents: extents.into_boxed_slice(),
            len,
            checksum: None,
        })
    }

    /// Run the allocator's self-check and return (free blocks, total blocks).
    pub(crate) fn check_allocator(&self) -> Result<(u64, u64), String> {
        let a = self.shared.allocator.lock();
        a.check()?;
        Ok((a.free_blocks(), u64::from(a.total_blocks())))
    }
}

/// Exclusive ownership of the blocks that hold one object's bytes.
pub(crate) struct DramAllocation {
    shared: Arc<Shared>,
    extents: Box<[Extent]>,
    len: u64,
    /// CRC-32C of the bytes, when the tier computes checksums (set by `write`).
    checksum: Option<u32>,
}

impl DramAllocation {
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// Blocks held.
    pub(crate) fn blocks(&self) -> u64 {
        self.extents.iter().map(|e| u64::from(e.count)).sum()
    }

    #[cfg(test)]
    pub(crate) fn extents(&self) -> &[Extent] {
        &self.extents
    }

    /// Fill the allocation with `src`, whose length must be the allocation's.
    pub(crate) fn write(&mut self, src: &[u8]) {
        assert_eq!(src.len() as u64, self.len, "write of the wrong length");
        // The checksum pass reads `src` into cache just before the copy reads it again.
        self.checksum = self.shared.checksums.then(|| crc_fast::crc32_iscsi(src));
        self.shared.arena.write(&self.extents, src);
    }

    /// CRC-32C of the bytes, if the tier computes checksums.
    pub(crate) fn checksum(&self) -> Option<u32> {
        self.checksum
    }

    /// The object's bytes in place, one slice per extent, in order (empty objects: none).
    /// Every slice starts on a block boundary of the arena, which is page aligned.
    pub(crate) fn slices(&self) -> impl Iterator<Item = &[u8]> + '_ {
        let block = self.shared.block_size;
        let mut left = self.len;
        self.extents.iter().map_while(move |&extent| {
            if left == 0 {
                return None;
            }
            let n = (u64::from(extent.count) * block).min(left);
            left -= n;
            Some(self.shared.arena.slice(extent, n as usize))
        })
    }

    /// Copy the whole object into `dst`, whose length must be the allocation's.
    pub(crate) fn read(&self, dst: &mut [u8]) {
        assert_eq!(dst.len() as u64, self.len, "read of the wrong length");
        self.shared.arena.read(&self.extents, dst);
    }
}

impl Drop for DramAllocation {
    fn drop(&mut self) {
        if !self.extents.is_empty() {
            self.shared.allocator.lock().free(&self.extents);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u32 = 4096;
    const OPTS: DramOptions = DramOptions {
        prefault: false,
        checksums: true,
    };

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn odd_sizes_round_trip_exactly() {
        let tier = DramTier::open(64, BS, OPTS).unwrap();
        let b = BS as usize;
        let sizes = [1, b - 1, b, b + 1, b * 7 / 2, 0, 3 * b];
        let mut live = Vec::new();
        for (i, &len) in sizes.iter().enumerate() {
            let data = pattern(len, i as u8);
            let mut a = tier.try_allocate(len as u64).unwrap();
            assert_eq!(
                a.blocks(),
                (len as u64).div_ceil(u64::from(BS)),
                "len {len}"
            );
            a.write(&data);
            live.push((a, data));
        }
        for (a, data) in &live {
            let mut out = vec![0xAA; data.len()];
            a.read(&mut out);
            assert_eq!(&out, data);
        }
        let used: u64 = live.iter().map(|(a, _)| a.blocks()).sum();
        assert_eq!(tier.free_blocks() + used, 64);
        drop(live);
        assert_eq!(tier.free_blocks(), 64);
    }

    #[test]
    fn scattered_allocation_round_trips() {
        let tier = DramTier::open(8, BS, OPTS).unwrap();
        let singles: Vec<_> = (0..8)
            .map(|i| {
                let mut a = tier.try_allocate(1).unwrap();
                a.write(&[i]);
                a
            })
            .collect();
        // Free blocks 0, 2, 4, 6 → a 3.5-block object must span several extents.
        let mut keep = Vec::new();
        for (i, a) in singles.into_iter().enumerate() {
            if i % 2 == 1 {
                keep.push(a);
            }
        }
        let len = BS as usize * 7 / 2;
        let data = pattern(len, 9);
        let mut a = tier.try_allocate(len as u64).unwrap();
        assert_eq!(a.extents().len(), 4);
        a.write(&data);
        let mut out = vec![0; len];
        a.read(&mut out);
        assert_eq!(out, data);
        // The odd singles were not disturbed.
        for (j, k) in keep.iter().enumerate() {
            let mut b = [0u8];
            k.read(&mut b);
            assert_eq!(b[0] as usize, 2 * j + 1);
        }
        assert_eq!(a.checksum(), Some(crc_fast::crc32_iscsi(&data)));
        let joined: Vec<u8> = a.slices().flatten().copied().collect();
        assert_eq!(joined, data, "slices cover the object exactly, in order");
        assert_eq!(a.slices().count(), 4);
        assert!(a
            .slices()
            .all(|s| (s.as_ptr() as usize).is_multiple_of(BS as usize)));
        assert!(tier.try_allocate(1).is_none(), "arena is full");
    }
}
