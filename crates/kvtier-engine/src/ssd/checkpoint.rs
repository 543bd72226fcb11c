//! The index checkpoint: a snapshot of the SSD index written by `flush` / clean close, so a
//! warm restart need not scan every segment.
//!
//! ```text
//! "KVTCKPT1" u32 version  u64 segment size  u64 next sequence number
//! u32 n_segments, then per segment in use: u32 id, u64 generation, u64 append offset
//! u64 n_entries, then per entry: u32 key length, key, u32 segment, u64 offset, u64 record
//!     length, u64 payload length, u32 payload offset, u64 sequence, u32 depth + 1 (0 = none)
//! u32 CRC-32C of everything before it
//! ```
//! Validity: the file is trusted only if its CRC verifies, its segment size matches, and
//! every segment it lists still carries, on disk, an in-use header of the listed generation
//! (a recycled or freed segment changes its generation). The engine deletes the checkpoint
//! (and syncs the directory) before the first SSD mutation after it was written, so an
//! existing checkpoint always describes the segments exactly; the generation check is the
//! second line of defence. Anything short of that falls back to a full scan.

use std::io;
use std::path::{Path, PathBuf};

use super::format::{crc32c, RecordLoc};

const MAGIC: &[u8; 8] = b"KVTCKPT1";
const VERSION: u32 = 1;

pub(crate) fn path(dir: &Path) -> PathBuf {
    dir.join("index.ckpt")
}

/// One index entry as checkpointed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CkptEntry {
    pub key: std::sync::Arc<[u8]>,
    pub seg: u32,
    pub loc: RecordLoc,
}

/// A decoded checkpoint.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Checkpoint {
    pub segment_size: u64,
    pub next_seq: u64,
    /// (id, generation, append offset) of every segment in use.
    pub segments: Vec<(u32, u64, u64)>,
    pub entries: Vec<CkptEntry>,
}

impl Checkpoint {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(64 + self.entries.len() * 96);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&self.segment_size.to_le_bytes());
        b.extend_from_slice(&self.next_seq.to_le_bytes());
        b.extend_from_slice(&(self.segments.len() as u32).to_le_bytes());
        for &(id, generation, end) in &self.segments {
            b.extend_from_slice(&id.to_le_bytes());
            b.extend_from_slice(&generation.to_le_bytes());
            b.extend_from_slice(&end.to_le_bytes());
        }
        b.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        for e in &self.entries {
            b.extend_from_slice(&(e.key.len() as u32).to_le_bytes());
            b.extend_from_slice(&e.key);
            let l = &e.loc;
            b.extend_from_slice(&e.seg.to_le_bytes());
            b.extend_from_slice(&l.offset.to_le_bytes());
            b.extend_from_slice(&l.rec_len.to_le_bytes());
            b.extend_from_slice(&l.payload_len.to_le_bytes());
            b.extend_from_slice(&l.payload_offset.to_le_bytes());
            b.extend_from_slice(&l.seq.to_le_bytes());
            b.extend_from_slice(&l.depth.map_or(0, |d| d.saturating_add(1)).to_le_bytes());
        }
        let crc = crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decode; `None` if the bytes are not an intact checkpoint.
    pub(crate) fn decode(b: &[u8]) -> Option<Checkpoint> {
        if b.len() < 36 || &b[0..8] != MAGIC {
            return None;
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32c(body) != u32::from_le_bytes(crc.try_into().ok()?) {
            return None;
        }
        let mut r = Reader { b: body, at: 8 };
        if r.u32()? != VERSION {
            return None;
        }
        let mut c = Checkpoint {
            segment_size: r.u64()?,
            next_seq: r.u64()?,
            ..Checkpoint::default()
        };
        for _ in 0..r.u32()? {
            c.segments.push((r.u32()?, r.u64()?, r.u64()?));
        }
        let n = r.u64()?;
        c.entries.reserve(n.min(1 << 24) as usize);
        for _ in 0..n {
            let klen = r.u32()? as usize;
            c.entries.push(CkptEntry {
                key: std::sync::Arc::from(r.bytes(klen)?),
                seg: r.u32()?,
                loc: RecordLoc {
                    offset: r.u64()?,
                    rec_len: r.u64()?,
                    payload_len: r.u64()?,
                    payload_offset: r.u32()?,
                    seq: r.u64()?,
                    depth: r.u32()?.checked_sub(1),
                },
            });
        }
        (r.at == body.len()).then_some(c)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let s = self.b.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(s)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.bytes(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.bytes(8)?.try_into().ok()?))
    }
}

/// Write atomically: temp file, fsync, rename, fsync the directory.
pub(crate) fn write(dir: &Path, c: &Checkpoint) -> io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = dir.join("index.ckpt.tmp");
    // A stale or planted temp entry (a symlink included) is removed, never written through.
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&tmp)?;
    f.write_all(&c.encode())?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path(dir))?;
    super::io::sync_dir(dir)
}

/// Read and decode `dir`'s checkpoint, if there is an intact one.
pub(crate) fn read(dir: &Path) -> Option<Checkpoint> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path(dir))
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.file_type().is_file() || meta.uid() != rustix::process::geteuid().as_raw() {
        tracing::warn!(
            "kvtier: the SSD checkpoint is not a regular file of ours; ignored (scan instead)"
        );
        return None;
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).ok()?;
    Checkpoint::decode(&bytes)
}

/// Delete the checkpoint durably (no-op if absent).
pub(crate) fn remove(dir: &Path) -> io::Result<()> {
    match std::fs::remove_file(path(dir)) {
        Ok(()) => super::io::sync_dir(dir),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_damage() {
        let c = Checkpoint {
            segment_size: 1 << 20,
            next_seq: 99,
            segments: vec![(0, 5, 8192), (3, 7, 4096)],
            entries: vec![CkptEntry {
                key: std::sync::Arc::from(&b"k1"[..]),
                seg: 0,
                loc: RecordLoc {
                    offset: 4096,
                    rec_len: 4096,
                    payload_len: 10,
                    payload_offset: 66,
                    seq: 6,
                    depth: Some(2),
                },
            }],
        };
        let b = c.encode();
        assert_eq!(Checkpoint::decode(&b).as_ref(), Some(&c));
        for spot in [0, 9, 20, b.len() / 2, b.len() - 1] {
            let mut bad = b.clone();
            bad[spot] ^= 4;
            assert!(Checkpoint::decode(&bad).is_none(), "flip at {spot}");
        }
        assert!(Checkpoint::decode(&b[..b.len() - 3]).is_none());
    }
}
