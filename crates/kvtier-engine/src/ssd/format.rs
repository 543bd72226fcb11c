//! The on-disk format: segment headers and records. Pure encode/decode, no I/O.
//!
//! ```text
//! segment file (ssd_segment_size_bytes, a multiple of 4 KiB):
//!   block 0        segment header (64 bytes used, rest zero)
//!   4096..         records, each starting on a 4 KiB boundary, back to back
//!
//! segment header (little endian)
//!   0  [8]  magic "KVTSEG\0\x01"     8 u32 format version (1)   12 u32 segment id
//!   16 u64  generation               24 u64 segment size        32 u32 state (0 free, 1 in use)
//!   36 u32  reserved                 40 u64 unix time of writing
//!   48 u32  CRC-32C of bytes 0..48
//!
//! record = 64-byte header ++ key ++ (zero pad) ++ payload ++ zero pad to 4 KiB
//!   0  u32 magic "KVTR" (live) or "KVTD" (dead marker written over a removed record)
//!   4  u16 version (1)       6  u16 flags (bit 0: dead)
//!   8  u32 key length        12 u32 prefix depth + 1 (0 = unknown)
//!   16 u64 payload length    24 u64 sequence number (global, increasing)
//!   32 u64 generation of the segment the record was written into
//!   40 u32 payload offset from the record start (64 + key length, or 4096 for payloads of
//!          16 KiB and more so that they can be read straight into an aligned buffer)
//!   44 u32 record length in 4 KiB blocks (header, key, payload and padding)
//!   48 u32 CRC-32C of the payload
//!   52 [8] reserved (zero)
//!   60 u32 CRC-32C of bytes 0..60 ++ key
//! ```
//! The header CRC covers the payload CRC, so together they check header, key and payload. A
//! record is *current* only if its generation equals its segment header's: records left in a
//! recycled file by an earlier generation are *stale* and never served.

use super::aligned::{align_up, ALIGN};

pub(crate) const SEGMENT_MAGIC: [u8; 8] = *b"KVTSEG\0\x01";
pub(crate) const FORMAT_VERSION: u32 = 1;
pub(crate) const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"KVTR");
pub(crate) const DEAD_MAGIC: u32 = u32::from_le_bytes(*b"KVTD");
pub(crate) const RECORD_VERSION: u16 = 1;
pub(crate) const FLAG_DEAD: u16 = 1;
pub(crate) const HEADER_LEN: usize = 64;
/// Where one record lives inside its segment and what its header says about it: the one
/// declaration shared by a scan's records, checkpoint entries and the tier's index entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordLoc {
    /// Offset of the record's header in the segment file.
    pub offset: u64,
    /// Whole record length (header, key, payload, padding), a multiple of 4 KiB.
    pub rec_len: u64,
    pub payload_len: u64,
    /// Payload offset from the record start.
    pub payload_offset: u32,
    pub seq: u64,
    pub depth: Option<u32>,
}

/// Payloads at least this large start on the record's second 4 KiB block.
pub(crate) const ALIGNED_PAYLOAD_MIN: u64 = 16 << 10;
/// Largest key a record may carry (keeps a header block readable in one 64 KiB read).
pub(crate) const MAX_KEY_LEN: usize = 60 << 10;
/// First record offset in a segment.
pub(crate) const FIRST_RECORD: u64 = ALIGN as u64;

pub(crate) fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

fn crc32c_parts(parts: &[&[u8]]) -> u32 {
    payload_crc(parts.iter().copied())
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// What a segment header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SegmentHeader {
    pub id: u32,
    pub generation: u64,
    pub segment_size: u64,
    /// false: free (its records are not to be recovered); true: in use.
    pub in_use: bool,
}

impl SegmentHeader {
    /// Encode into the first 64 bytes of `block` (the rest is zeroed).
    pub(crate) fn encode(&self, block: &mut [u8]) {
        block.fill(0);
        block[0..8].copy_from_slice(&SEGMENT_MAGIC);
        block[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        block[12..16].copy_from_slice(&self.id.to_le_bytes());
        block[16..24].copy_from_slice(&self.generation.to_le_bytes());
        block[24..32].copy_from_slice(&self.segment_size.to_le_bytes());
        block[32..36].copy_from_slice(&u32::from(self.in_use).to_le_bytes());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        block[40..48].copy_from_slice(&now.to_le_bytes());
        let crc = crc32c(&block[0..48]);
        block[48..52].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decode and verify; `None` for anything that is not an intact header of this format.
    pub(crate) fn decode(block: &[u8]) -> Option<SegmentHeader> {
        if block.len() < 52 || block[0..8] != SEGMENT_MAGIC {
            return None;
        }
        if u32_at(block, 48) != crc32c(&block[0..48]) || u32_at(block, 8) != FORMAT_VERSION {
            return None;
        }
        Some(SegmentHeader {
            id: u32_at(block, 12),
            generation: u64_at(block, 16),
            segment_size: u64_at(block, 24),
            in_use: u32_at(block, 32) == 1,
        })
    }
}

/// Layout of one record, derived from its key and payload lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordLayout {
    pub payload_offset: u32,
    /// Whole record length in bytes (a multiple of 4 KiB).
    pub rec_len: u64,
}

impl RecordLayout {
    pub(crate) fn new(key_len: usize, payload_len: u64) -> RecordLayout {
        let inline = (HEADER_LEN + key_len) as u64;
        let payload_offset = if payload_len >= ALIGNED_PAYLOAD_MIN && inline <= ALIGN as u64 {
            ALIGN as u64
        } else {
            inline
        };
        RecordLayout {
            payload_offset: payload_offset as u32,
            rec_len: align_up(payload_offset + payload_len),
        }
    }
}

/// The fields of a record header (live or dead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordHeader {
    pub dead: bool,
    pub key_len: u32,
    pub depth: Option<u32>,
    pub payload_len: u64,
    pub seq: u64,
    pub generation: u64,
    pub payload_offset: u32,
    pub rec_len: u64,
    pub payload_crc: u32,
}

/// How a 4 KiB block at a record boundary parses.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HeaderParse {
    /// Intact header (CRC over header and key verified).
    Ok(RecordHeader),
    /// Record magic present but the header does not verify (or its lengths are impossible).
    Damaged,
    /// Not a record header at all (zeros, payload bytes, other data).
    NotAHeader,
}

impl RecordHeader {
    fn encode_fixed(&self, out: &mut [u8]) {
        out[..HEADER_LEN].fill(0);
        let magic = if self.dead { DEAD_MAGIC } else { RECORD_MAGIC };
        out[0..4].copy_from_slice(&magic.to_le_bytes());
        out[4..6].copy_from_slice(&RECORD_VERSION.to_le_bytes());
        let flags = if self.dead { FLAG_DEAD } else { 0 };
        out[6..8].copy_from_slice(&flags.to_le_bytes());
        out[8..12].copy_from_slice(&self.key_len.to_le_bytes());
        let depth = self.depth.map_or(0, |d| d.saturating_add(1));
        out[12..16].copy_from_slice(&depth.to_le_bytes());
        out[16..24].copy_from_slice(&self.payload_len.to_le_bytes());
        out[24..32].copy_from_slice(&self.seq.to_le_bytes());
        out[32..40].copy_from_slice(&self.generation.to_le_bytes());
        out[40..44].copy_from_slice(&self.payload_offset.to_le_bytes());
        let blocks = (self.rec_len / ALIGN as u64) as u32;
        out[44..48].copy_from_slice(&blocks.to_le_bytes());
        out[48..52].copy_from_slice(&self.payload_crc.to_le_bytes());
    }

    /// Parse the header at the start of `buf`, which must hold at least the header and the
    /// key (`HEADER_LEN + key_len` bytes; `Damaged` if it is shorter). `max_len` bounds the
    /// record length (bytes left in the segment).
    pub(crate) fn parse(buf: &[u8], max_len: u64) -> HeaderParse {
        if buf.len() < HEADER_LEN {
            return HeaderParse::NotAHeader;
        }
        let magic = u32_at(buf, 0);
        if magic != RECORD_MAGIC && magic != DEAD_MAGIC {
            return HeaderParse::NotAHeader;
        }
        let key_len = u32_at(buf, 8) as usize;
        if key_len > MAX_KEY_LEN || buf.len() < HEADER_LEN + key_len {
            return HeaderParse::Damaged;
        }
        let stored = u32_at(buf, 60);
        if stored != crc32c_parts(&[&buf[0..60], &buf[HEADER_LEN..HEADER_LEN + key_len]]) {
            return HeaderParse::Damaged;
        }
        let dead = magic == DEAD_MAGIC;
        if u16_at(buf, 4) != RECORD_VERSION || (u16_at(buf, 6) & FLAG_DEAD != 0) != dead {
            return HeaderParse::Damaged;
        }
        let depth_raw = u32_at(buf, 12);
        let h = RecordHeader {
            dead,
            key_len: key_len as u32,
            depth: depth_raw.checked_sub(1),
            payload_len: u64_at(buf, 16),
            seq: u64_at(buf, 24),
            generation: u64_at(buf, 32),
            payload_offset: u32_at(buf, 40),
            rec_len: u64::from(u32_at(buf, 44)) * ALIGN as u64,
            payload_crc: u32_at(buf, 48),
        };
        let body_end = u64::from(h.payload_offset).checked_add(h.payload_len);
        let sane = h.rec_len >= ALIGN as u64
            && h.rec_len <= max_len
            && (dead
                || (u64::from(h.payload_offset) >= (HEADER_LEN + key_len) as u64
                    && body_end.is_some_and(|e| e <= h.rec_len)));
        if !sane {
            return HeaderParse::Damaged;
        }
        HeaderParse::Ok(h)
    }
}

/// Encode a whole live record into `out` (exactly `layout.rec_len` bytes, zero padded).
#[cfg(test)]
pub(crate) fn encode_record(
    out: &mut [u8],
    key: &[u8],
    payload: &[u8],
    depth: Option<u32>,
    seq: u64,
    generation: u64,
) -> RecordLayout {
    let layout = RecordLayout::new(key.len(), payload.len() as u64);
    let po = layout.payload_offset as usize;
    out[po..po + payload.len()].copy_from_slice(payload);
    finish_record(out, key, payload.len() as u64, depth, seq, generation)
}

/// Complete a record whose payload the caller already copied to its place in `out` (at the
/// layout's payload offset; `out` is exactly `rec_len` bytes): zero the gaps, write the key
/// and the header with both CRCs.
pub(crate) fn finish_record(
    out: &mut [u8],
    key: &[u8],
    payload_len: u64,
    depth: Option<u32>,
    seq: u64,
    generation: u64,
) -> RecordLayout {
    let layout = RecordLayout::new(key.len(), payload_len);
    assert_eq!(
        out.len() as u64,
        layout.rec_len,
        "record buffer of the wrong length"
    );
    let po = layout.payload_offset as usize;
    let end = po + payload_len as usize;
    out[end..].fill(0);
    let payload_crc = crc32c(&out[po..end]);
    let fields = HeadFields {
        key,
        payload_len,
        depth,
        seq,
        generation,
        payload_crc,
    };
    encode_head(&mut out[..po], &fields, layout);
    layout
}

/// What a record head holds besides its layout.
pub(crate) struct HeadFields<'a> {
    pub key: &'a [u8],
    pub payload_len: u64,
    pub depth: Option<u32>,
    pub seq: u64,
    pub generation: u64,
    /// CRC-32C of the payload (see [`payload_crc`]).
    pub payload_crc: u32,
}

/// CRC-32C of a payload given in pieces (DRAM extents, in order).
pub(crate) fn payload_crc<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    for p in pieces {
        d.update(p);
    }
    d.finalize() as u32
}

/// Encode the head of a live record, everything before its payload: header, key and zero
/// fill. `head` is exactly `layout.payload_offset` bytes; the payload is written separately
/// (straight from DRAM), so its CRC comes in `fields`.
pub(crate) fn encode_head(head: &mut [u8], fields: &HeadFields<'_>, layout: RecordLayout) {
    let key = fields.key;
    assert_eq!(
        head.len(),
        layout.payload_offset as usize,
        "record head of the wrong length"
    );
    head[HEADER_LEN..HEADER_LEN + key.len()].copy_from_slice(key);
    head[HEADER_LEN + key.len()..].fill(0);
    let h = RecordHeader {
        dead: false,
        key_len: key.len() as u32,
        depth: fields.depth,
        payload_len: fields.payload_len,
        seq: fields.seq,
        generation: fields.generation,
        payload_offset: layout.payload_offset,
        rec_len: layout.rec_len,
        payload_crc: fields.payload_crc,
    };
    h.encode_fixed(head);
    let crc = crc32c_parts(&[&head[0..60], key]);
    head[60..64].copy_from_slice(&crc.to_le_bytes());
}

/// Encode a dead marker for a record of `rec_len` bytes into a 4 KiB `block`.
pub(crate) fn encode_dead(block: &mut [u8], rec_len: u64, seq: u64, generation: u64) {
    block.fill(0);
    let h = RecordHeader {
        dead: true,
        key_len: 0,
        depth: None,
        payload_len: 0,
        seq,
        generation,
        payload_offset: HEADER_LEN as u32,
        rec_len,
        payload_crc: 0,
    };
    h.encode_fixed(block);
    let crc = crc32c(&block[0..60]);
    block[60..64].copy_from_slice(&crc.to_le_bytes());
}

/// Verify a whole record image against what the index expects. `Ok` iff the header parses,
/// is live, belongs to `generation`, carries `key` and a payload of `payload_len` bytes whose
/// CRC matches.
pub(crate) fn verify_record(
    rec: &[u8],
    key: &[u8],
    payload_len: u64,
    generation: u64,
) -> Result<RecordHeader, ()> {
    let HeaderParse::Ok(h) = RecordHeader::parse(rec, rec.len() as u64) else {
        return Err(());
    };
    if h.dead || h.generation != generation || h.payload_len != payload_len {
        return Err(());
    }
    if &rec[HEADER_LEN..HEADER_LEN + h.key_len as usize] != key {
        return Err(());
    }
    let po = h.payload_offset as usize;
    if crc32c(&rec[po..po + payload_len as usize]) != h.payload_crc {
        return Err(());
    }
    Ok(h)
}

/// Check a header block (already read) and a payload split across `parts` (read straight into
/// the destination) against the index's expectations.
pub(crate) fn verify_split(
    header_block: &[u8],
    parts: &[&[u8]],
    key: &[u8],
    payload_len: u64,
    generation: u64,
) -> bool {
    let HeaderParse::Ok(h) = RecordHeader::parse(header_block, u64::MAX) else {
        return false;
    };
    !h.dead
        && h.generation == generation
        && h.payload_len == payload_len
        && &header_block[HEADER_LEN..HEADER_LEN + h.key_len as usize] == key
        && crc32c_parts(parts) == h.payload_crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_header_round_trips_and_detects_damage() {
        let h = SegmentHeader {
            id: 3,
            generation: 77,
            segment_size: 1 << 20,
            in_use: true,
        };
        let mut b = vec![0u8; ALIGN];
        h.encode(&mut b);
        assert_eq!(SegmentHeader::decode(&b), Some(h));
        b[20] ^= 1;
        assert_eq!(SegmentHeader::decode(&b), None);
        assert_eq!(SegmentHeader::decode(&[0u8; 64]), None);
    }

    #[test]
    fn layouts_are_aligned_and_large_payloads_start_on_a_block() {
        let l = RecordLayout::new(10, 0);
        assert_eq!((l.payload_offset, l.rec_len), (74, 4096));
        let l = RecordLayout::new(10, 4096 - 74);
        assert_eq!(l.rec_len, 4096);
        let l = RecordLayout::new(10, 4096 - 73);
        assert_eq!(l.rec_len, 8192);
        let l = RecordLayout::new(10, 2 << 20);
        assert_eq!((l.payload_offset, l.rec_len), (4096, (2 << 20) + 4096));
        let l = RecordLayout::new(5000, 2 << 20);
        assert_eq!(
            l.payload_offset, 5064,
            "a long key keeps the payload inline"
        );
    }

    #[test]
    fn records_round_trip_and_every_flip_is_detected() {
        for len in [0usize, 1, 100, 20_000] {
            let key = b"some/key";
            let payload: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            let layout = RecordLayout::new(key.len(), len as u64);
            let mut rec = vec![0xAAu8; layout.rec_len as usize];
            encode_record(&mut rec, key, &payload, Some(4), 9, 5);
            let h = verify_record(&rec, key, len as u64, 5).unwrap();
            assert_eq!((h.seq, h.generation, h.depth), (9, 5, Some(4)));
            let po = h.payload_offset as usize;
            assert_eq!(&rec[po..po + len], &payload[..]);
            assert!(verify_record(&rec, b"other/ke", len as u64, 5).is_err());
            assert!(
                verify_record(&rec, key, len as u64, 6).is_err(),
                "stale generation"
            );
            // Flip one bit in the header, the key and (if any) the payload.
            let mut spots = vec![1, 20, 50, 61, HEADER_LEN + 2];
            if len > 0 {
                spots.push(po + len / 2);
            }
            for spot in spots {
                let mut bad = rec.clone();
                bad[spot] ^= 0x10;
                assert!(
                    verify_record(&bad, key, len as u64, 5).is_err(),
                    "flip at {spot}"
                );
            }
        }
    }

    #[test]
    fn dead_markers_parse_as_dead() {
        let mut b = vec![0u8; ALIGN];
        encode_dead(&mut b, 3 * ALIGN as u64, 11, 2);
        match RecordHeader::parse(&b, 1 << 20) {
            HeaderParse::Ok(h) => {
                assert!(h.dead);
                assert_eq!((h.rec_len, h.seq, h.generation), (3 * 4096, 11, 2));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            RecordHeader::parse(&[0u8; 64], 4096),
            HeaderParse::NotAHeader
        );
        b[30] ^= 1;
        assert_eq!(RecordHeader::parse(&b, 1 << 20), HeaderParse::Damaged);
    }
}
