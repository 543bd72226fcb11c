//! `fsck`: verify every segment of an SSD directory without opening an engine.

use std::path::Path;

use super::aligned::AlignedBuf;
use super::io::{list_segments, probe_direct, segment_path, SegFile};
use super::scan::{scan_segment, ScanCounts};
use crate::error::EngineError;

/// Counts for one segment file.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FsckSegment {
    pub id: u32,
    pub path: String,
    pub file_len: u64,
    /// `in_use`, `free`, or `no_header` (never written, or its header is damaged).
    pub state: String,
    pub generation: Option<u64>,
    /// What the scan found (flattened into the JSON report).
    #[serde(flatten)]
    pub counts: ScanCounts,
    /// Offset after the last current-generation record.
    pub end: u64,
}

/// The result of [`fsck`].
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FsckReport {
    pub dir: String,
    pub segments: Vec<FsckSegment>,
    /// The sum over all segments (flattened into the JSON report).
    #[serde(flatten)]
    pub counts: ScanCounts,
    /// An `index.ckpt` is present (a clean shutdown left it).
    pub checkpoint_present: bool,
    pub elapsed_s: f64,
}

impl FsckReport {
    /// No torn or corrupt record anywhere.
    pub fn is_clean(&self) -> bool {
        self.counts.torn == 0 && self.counts.corrupt == 0
    }
}

/// Verify every segment of `dir`: read-only, safe while nothing writes the directory (a live
/// engine's in-flight writes may show up as torn records). Damaged files are reported, not
/// errors; only an unreadable directory or file is an `Err`.
pub fn fsck(dir: &Path) -> Result<FsckReport, EngineError> {
    let t0 = std::time::Instant::now();
    let direct = probe_direct(dir);
    let mut report = FsckReport {
        dir: dir.display().to_string(),
        checkpoint_present: super::checkpoint::path(dir).exists(),
        ..FsckReport::default()
    };
    let mut buf = AlignedBuf::new();
    let segments = list_segments(dir).map_err(EngineError::SsdOpen)?;
    // Issue 27: a long check shows in the log.
    let mut progress = crate::progress::Progress::new("fsck (segments)", segments.len() as u64);
    for (done, id) in segments.into_iter().enumerate() {
        progress.at(done as u64);
        let path = segment_path(dir, id);
        let file = SegFile::open_read_only(&path, direct)
            .or_else(|_| SegFile::open_read_only(&path, false))
            .map_err(EngineError::SsdOpen)?;
        let len = file.len().map_err(EngineError::SsdOpen)?;
        // The segment's own header says how large it is; a truncated file is scanned as is.
        let mut hb = AlignedBuf::zeroed(4096);
        let n = file
            .read_at(hb.as_mut_slice(), 0)
            .map_err(EngineError::SsdOpen)?;
        let seg_size = super::format::SegmentHeader::decode(&hb.as_slice()[..n])
            .map_or(len, |h| h.segment_size);
        let scan = scan_segment(&file, seg_size, &mut buf, false, &mut |_| {})
            .map_err(EngineError::SsdOpen)?;
        let state = match scan.header {
            Some(h) if h.in_use => "in_use",
            Some(_) => "free",
            None => "no_header",
        };
        let seg = FsckSegment {
            id,
            path: path.display().to_string(),
            file_len: len,
            state: state.to_string(),
            generation: scan.header.map(|h| h.generation),
            counts: scan.counts,
            end: scan.end,
        };
        report.counts.add(&seg.counts);
        report.segments.push(seg);
    }
    progress.done();
    report.elapsed_s = t0.elapsed().as_secs_f64();
    Ok(report)
}
