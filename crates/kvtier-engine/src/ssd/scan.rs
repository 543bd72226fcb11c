//! Segment scanning: the one reader of whole segments, shared by warm restart and `fsck`.
//!
//! A scan walks a segment's 4 KiB blocks from the first record offset. At a block that holds
//! an intact current-generation header it verifies the payload CRC and steps over the whole
//! record; anywhere else it steps one block and looks again, so one damaged record never hides
//! the records after it. Classification:
//! - *good*: intact header of the segment's generation, payload CRC verified;
//! - *removed*: an intact dead marker of the segment's generation (skipped);
//! - *stale*: an intact header of an older generation (left in a recycled file; never served);
//! - *corrupt*: a damaged current-generation record (header CRC or payload CRC fails) that is
//!   followed by a good record later in the segment;
//! - *torn*: the same damage with no good record after it — the tail of a write cut short.
//!
//! Blocks that are not headers at all (zeros, payload bytes of stale records) are skipped
//! silently. The scan reads in large aligned chunks, so it runs at the disk's sequential speed.

use std::io;

use super::aligned::{AlignedBuf, ALIGN};
use super::format::{
    HeaderParse, RecordHeader, RecordLoc, SegmentHeader, FIRST_RECORD, HEADER_LEN,
};
use super::io::SegFile;

/// Read size of a scan: large enough for sequential disk speed.
const CHUNK: usize = 8 << 20;
/// Bytes read to parse a header with its key.
const HEADER_PROBE: usize = 64 << 10;

/// One good record found by a scan.
#[derive(Clone, Debug)]
pub(crate) struct ScannedRecord {
    pub key: Box<[u8]>,
    pub loc: RecordLoc,
}

/// What scans found, per class of the module docs: the one declaration of these counters,
/// shared by a segment's scan, [`crate::FsckReport`] (per segment and in total) and
/// [`crate::RecoveryReport`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ScanCounts {
    pub good: u64,
    pub torn: u64,
    pub corrupt: u64,
    pub stale: u64,
    pub removed: u64,
    pub bytes_scanned: u64,
}

impl ScanCounts {
    /// Add `other`'s counts to these.
    pub fn add(&mut self, other: &ScanCounts) {
        self.good += other.good;
        self.torn += other.torn;
        self.corrupt += other.corrupt;
        self.stale += other.stale;
        self.removed += other.removed;
        self.bytes_scanned += other.bytes_scanned;
    }
}

/// What a scan of one segment found.
#[derive(Debug, Default)]
pub(crate) struct SegmentScan {
    pub header: Option<SegmentHeader>,
    pub records: Vec<ScannedRecord>,
    pub counts: ScanCounts,
    /// End offset of the last current-generation item (where a writer could append).
    pub end: u64,
    /// Highest sequence number / generation in any intact header (also stale ones).
    pub max_seq: u64,
}

/// A window of the file held in an aligned buffer.
struct Window<'a> {
    file: &'a SegFile,
    buf: &'a mut AlignedBuf,
    start: u64,
    len: usize,
    limit: u64,
    read: u64,
}

impl Window<'_> {
    /// Bytes `[pos, pos + want)` clipped to the readable limit; reads a new chunk when the
    /// window does not cover them.
    fn get(&mut self, pos: u64, want: usize) -> io::Result<&[u8]> {
        let want = want.min((self.limit.saturating_sub(pos)) as usize);
        let end = pos + want as u64;
        if pos < self.start || end > self.start + self.len as u64 {
            let size = want.max(CHUNK).div_ceil(ALIGN) * ALIGN;
            let size = size.min((self.limit - pos).div_ceil(ALIGN as u64) as usize * ALIGN);
            self.buf.resize(size);
            let n = self.file.read_at(self.buf.as_mut_slice(), pos)?;
            self.read += n as u64;
            self.start = pos;
            self.len = n.min((self.limit - pos) as usize);
        }
        let off = (pos - self.start) as usize;
        let have = want.min(self.len.saturating_sub(off));
        Ok(&self.buf.as_slice()[off..off + have])
    }
}

/// Scan a segment file whose configured size is `seg_size`.
///
/// With `collect`, good records are returned in `records` (recovery); otherwise only counted
/// (fsck). A segment whose header is intact but marks it free is not scanned; one without an
/// intact header is scanned only to learn its highest sequence number (no record counts).
pub(crate) fn scan_segment(
    file: &SegFile,
    seg_size: u64,
    buf: &mut AlignedBuf,
    collect: bool,
    progress: &mut dyn FnMut(u64),
) -> io::Result<SegmentScan> {
    let file_len = file.len()?;
    let limit = file_len.min(seg_size);
    let mut out = SegmentScan {
        end: FIRST_RECORD,
        ..SegmentScan::default()
    };
    let mut w = Window {
        file,
        buf,
        start: 0,
        len: 0,
        limit,
        read: 0,
    };
    out.header = SegmentHeader::decode(w.get(0, ALIGN)?);
    let generation = match out.header {
        Some(h) if !h.in_use => return Ok(finish(out, &w)),
        Some(h) => Some(h.generation),
        None => None,
    };
    let mut pos = FIRST_RECORD;
    let mut pending_bad = 0u64;
    let mut reported = 0u64;
    while pos + HEADER_LEN as u64 <= limit {
        if w.read - reported >= CHUNK as u64 {
            progress(w.read - reported);
            reported = w.read;
        }
        let parsed = RecordHeader::parse(w.get(pos, HEADER_PROBE)?, limit - pos);
        match parsed {
            HeaderParse::Ok(h) => {
                out.max_seq = out.max_seq.max(h.seq).max(h.generation);
                if Some(h.generation) != generation {
                    out.counts.stale += u64::from(generation.is_some());
                    pos += ALIGN as u64;
                    continue;
                }
                if h.dead {
                    out.counts.removed += 1;
                    pos += h.rec_len;
                    out.end = pos;
                    continue;
                }
                let rec = w.get(pos, h.rec_len as usize)?;
                let po = h.payload_offset as usize;
                let payload_ok = rec.len() as u64 == h.rec_len
                    && super::format::crc32c(&rec[po..po + h.payload_len as usize])
                        == h.payload_crc;
                if payload_ok {
                    out.counts.corrupt += pending_bad;
                    pending_bad = 0;
                    out.counts.good += 1;
                    if collect {
                        out.records.push(ScannedRecord {
                            key: Box::from(&rec[HEADER_LEN..HEADER_LEN + h.key_len as usize]),
                            loc: RecordLoc {
                                offset: pos,
                                rec_len: h.rec_len,
                                payload_len: h.payload_len,
                                payload_offset: h.payload_offset,
                                seq: h.seq,
                                depth: h.depth,
                            },
                        });
                    }
                    pos += h.rec_len;
                    out.end = pos;
                } else {
                    // The header verified, so its length can be trusted to skip the record.
                    pending_bad += 1;
                    pos += h.rec_len;
                }
            }
            HeaderParse::Damaged => {
                if generation.is_some() {
                    pending_bad += 1;
                }
                pos += ALIGN as u64;
            }
            HeaderParse::NotAHeader => pos += ALIGN as u64,
        }
    }
    out.counts.torn += pending_bad;
    if generation.is_none() {
        out.counts.good = 0;
        out.records.clear();
    }
    progress(w.read - reported);
    Ok(finish(out, &w))
}

fn finish(mut out: SegmentScan, w: &Window<'_>) -> SegmentScan {
    out.counts.bytes_scanned = w.read;
    out
}
