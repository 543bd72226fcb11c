//! Ranged gets: copy byte ranges of stored objects into caller memory, for SGLang's direct
//! linker (issue 18), which restores one layer's rows of many pages at a time.
//!
//! A [`RangedReader`] serves one load batch. Embedded mode pins each object once (the pin is
//! kept for the reader's life, so eviction cannot pull the bytes away between layers) and
//! copies exactly the asked ranges out of the pinned extents: no whole-page read. Server and
//! cluster modes have no in-process object to pin: the reader fetches each whole object once,
//! on its first range, into a private buffer, and copies every later range of it from there
//! (the object's bytes cross the socket or the network once per batch, not once per layer).
//!
//! Invariants: every destination is checked against the client's registered regions before a
//! byte is written (the same check as every other get); a range outside the object, or an
//! object whose length is not the one the caller expects, fails that call and writes nothing
//! for that range.

use std::collections::HashMap;

use kvtier_engine::PinnedObject;

use crate::client::Client;
use crate::error::ClientError;

/// One byte range of an object and where it goes.
#[derive(Clone, Copy, Debug)]
pub struct RangeCopy {
    /// Offset inside the stored object.
    pub offset: u64,
    /// Destination address (inside a registered region).
    pub dst: usize,
    /// Bytes to copy.
    pub len: usize,
}

enum Held {
    Pinned(PinnedObject),
    Fetched(Vec<u8>),
}

/// Copies byte ranges of objects for one load batch (see the module docs).
pub struct RangedReader<'c> {
    client: &'c Client,
    held: HashMap<Vec<u8>, Held>,
}

impl<'c> RangedReader<'c> {
    pub fn new(client: &'c Client) -> Self {
        RangedReader {
            client,
            held: HashMap::new(),
        }
    }

    /// Objects this reader holds (pinned or fetched).
    pub fn held_objects(&self) -> usize {
        self.held.len()
    }

    fn hold(&mut self, key: &[u8], expected_len: u64) -> Result<&Held, ClientError> {
        if !self.held.contains_key(key) {
            let held = match self.client.pin(key) {
                Some(pinned) => Held::Pinned(pinned),
                None if self.client.mode() == "embedded" => {
                    return Err(ClientError::Engine(kvtier_engine::EngineError::NotFound));
                }
                None => {
                    let len = usize::try_from(expected_len).map_err(|_| {
                        ClientError::BatchShape(format!("object length {expected_len} too large"))
                    })?;
                    let mut buf = vec![0u8; len];
                    self.client.get_into_slice(key, &mut buf)?;
                    Held::Fetched(buf)
                }
            };
            self.held.insert(key.to_vec(), held);
        }
        self.held
            .get(key)
            .ok_or_else(|| ClientError::BatchShape("object vanished from the reader".into()))
    }

    /// Copy `ranges` of object `key`, whose stored length must be `expected_len`.
    pub fn copy_ranges(
        &mut self,
        key: &[u8],
        expected_len: u64,
        ranges: &[RangeCopy],
    ) -> Result<(), ClientError> {
        let regions = self.client.region_registry();
        let held = self.hold(key, expected_len)?;
        let len = match held {
            Held::Pinned(p) => p.len(),
            Held::Fetched(b) => b.len() as u64,
        };
        if len != expected_len {
            return Err(ClientError::BatchShape(format!(
                "object is {len} bytes, the pool expects {expected_len}"
            )));
        }
        for r in ranges {
            let end = r.offset.checked_add(r.len as u64).filter(|&e| e <= len);
            if end.is_none() {
                return Err(ClientError::BatchShape(format!(
                    "range {}+{} outside an object of {len} bytes",
                    r.offset, r.len
                )));
            }
            regions.with_destination(r.dst, r.len, |dst| match held {
                Held::Fetched(buf) => {
                    let at = r.offset as usize;
                    dst.copy_from_slice(&buf[at..at + r.len]);
                }
                Held::Pinned(pinned) => copy_from_extents(pinned, r.offset, dst),
            })?;
        }
        Ok(())
    }
}

/// Copy `dst.len()` bytes starting at `offset` of a pinned object's extents into `dst`.
fn copy_from_extents(pinned: &PinnedObject, offset: u64, dst: &mut [u8]) {
    let mut skip = offset as usize;
    let mut written = 0usize;
    for slice in pinned.slices() {
        if written == dst.len() {
            break;
        }
        if skip >= slice.len() {
            skip -= slice.len();
            continue;
        }
        let take = (slice.len() - skip).min(dst.len() - written);
        dst[written..written + take].copy_from_slice(&slice[skip..skip + take]);
        written += take;
        skip = 0;
    }
}

/// Put one object assembled from several pieces of caller memory (a device page whose rows
/// live in one buffer per layer), in piece order. Each piece is checked against the
/// registered regions; the pieces are gathered into one private buffer first (one copy), so
/// the store never sees a half-assembled object.
pub fn put_gathered(
    client: &Client,
    key: &[u8],
    pieces: &[crate::batch::MemRef],
    depth: Option<u32>,
) -> Result<(), ClientError> {
    let total = pieces
        .iter()
        .try_fold(0usize, |acc, p| acc.checked_add(p.len))
        .ok_or_else(|| ClientError::BatchShape("object length overflows".into()))?;
    let mut buf = Vec::with_capacity(total);
    let regions = client.region_registry();
    for p in pieces {
        regions.with_source(p.ptr, p.len, |src| buf.extend_from_slice(src))?;
    }
    client.put_slice(key, &buf, depth).map(|_| ())
}
