//! `kvtier bench ssd` and `kvtier bench recovery`.
//!
//! The raw baseline is measured by this process on the same filesystem as the engine, in the
//! same run: a pre-written file (recycled, like the engine's segments) written and read
//! sequentially with `O_DIRECT`, dd-style (one thread, 4 MiB blocks), and 2 MiB random
//! `O_DIRECT` reads for the latency baseline.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use kvtier_engine::{
    Engine, EngineConfig, PutMeta, RecoveryProgress, SsdDurabilityMode, SsdIoBackend,
};

const MIB: usize = 1 << 20;
const RAW_BLOCK: usize = 4 * MIB;

/// A 4 KiB-aligned window of a heap buffer (what `O_DIRECT` needs), without `unsafe`.
struct Aligned {
    buf: Vec<u8>,
    off: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let buf = vec![0u8; len + 4096];
        let off = buf.as_ptr().align_offset(4096);
        Aligned { buf, off, len }
    }
    fn get(&mut self) -> &mut [u8] {
        &mut self.buf[self.off..self.off + self.len]
    }
    /// A deliberately misaligned window (the bounce-buffer path).
    fn misaligned(&mut self) -> &mut [u8] {
        &mut self.buf[self.off + 64..self.off + 64 + self.len - 4096]
    }
}

fn o_direct() -> i32 {
    rustix::fs::OFlags::DIRECT.bits() as i32
}

pub(crate) fn bar(len: u64, what: &str) -> ProgressBar {
    if !crate::interactive() {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template("{msg:>24} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b.set_message(what.to_string());
    b
}

pub(crate) fn note(json: bool, msg: &str) {
    if !json && !crate::interactive() {
        eprintln!("{msg}");
    }
}

pub(crate) struct TempDir {
    pub(crate) path: PathBuf,
    remove: bool,
}

impl TempDir {
    pub(crate) fn new(dir: Option<PathBuf>, name: &str) -> Result<TempDir, String> {
        let (path, remove) = match dir {
            Some(d) => (
                d.join(format!("kvtier-bench-{name}-{}", std::process::id())),
                true,
            ),
            None => (
                std::env::temp_dir().join(format!("kvtier-bench-{name}-{}", std::process::id())),
                true,
            ),
        };
        std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(TempDir { path, remove })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

pub(crate) fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

pub(crate) fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Raw sequential O_DIRECT write then read of `volume` bytes in `path` (written once first
/// so that, like recycled segments, the blocks are not fresh).
fn raw_seq(path: &Path, volume: usize) -> Result<(f64, f64), String> {
    let err = |e: std::io::Error| format!("raw baseline: {e}");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(o_direct())
        .open(path)
        .map_err(err)?;
    let mut buf = Aligned::new(RAW_BLOCK);
    buf.get()
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8);
    let write_pass = |f: &File, buf: &mut Aligned| -> Result<Duration, String> {
        let t0 = Instant::now();
        for off in (0..volume).step_by(RAW_BLOCK) {
            f.write_all_at(buf.get(), off as u64).map_err(err)?;
        }
        f.sync_data().map_err(err)?;
        Ok(t0.elapsed())
    };
    write_pass(&f, &mut buf)?; // warm: allocate the blocks once
    let w = write_pass(&f, &mut buf)?;
    let t0 = Instant::now();
    for off in (0..volume).step_by(RAW_BLOCK) {
        f.read_exact_at(buf.get(), off as u64).map_err(err)?;
    }
    let r = t0.elapsed();
    Ok((gbps(volume as u64, w), gbps(volume as u64, r)))
}

/// p50 of random 2 MiB O_DIRECT reads from the raw file.
fn raw_p50(path: &Path, volume: usize, n: usize) -> Result<Duration, String> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(o_direct())
        .open(path)
        .map_err(|e| e.to_string())?;
    let mut buf = Aligned::new(2 * MIB);
    let slots = volume / (2 * MIB);
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let off = (rng as usize % slots) * 2 * MIB;
        let t0 = Instant::now();
        f.read_exact_at(buf.get(), off as u64)
            .map_err(|e| e.to_string())?;
        times.push(t0.elapsed());
    }
    Ok(p50(times))
}

fn engine_config(dir: &Path, volume: usize, strict: bool, io_uring: bool) -> EngineConfig {
    let seg = 64 * MIB as u64;
    let segments = ((volume as u64 * 5 / 4) / seg + 2).max(4);
    EngineConfig {
        dram_capacity_bytes: 64 * MIB as u64,
        ssd_enabled: true,
        ssd_storage_dir: dir.to_path_buf(),
        ssd_segment_size_bytes: seg,
        ssd_capacity_bytes: segments * seg,
        ssd_durability_mode: if strict {
            SsdDurabilityMode::Strict
        } else {
            SsdDurabilityMode::Relaxed
        },
        ssd_high_watermark: 1.0,
        ssd_low_watermark: 0.95,
        auto_promote_on_read: false,
        ssd_io_backend: if io_uring {
            SsdIoBackend::IoUring
        } else {
            SsdIoBackend::Posix
        },
        ..EngineConfig::default()
    }
}

fn key(size: usize, i: usize) -> Vec<u8> {
    format!("bench/{size}/{i}").into_bytes()
}

#[derive(serde::Serialize)]
struct Row {
    test: String,
    engine: f64,
    raw: f64,
    ratio: f64,
    target: String,
    pass: bool,
}

#[derive(serde::Serialize)]
struct SsdReport {
    dir: String,
    direct_io: bool,
    io_uring: bool,
    volume_bytes_per_size: usize,
    engine_readers: usize,
    rows: Vec<Row>,
}

/// `kvtier bench ssd`.
pub(crate) fn ssd(
    dir: Option<PathBuf>,
    quick: bool,
    io_uring: bool,
    json: bool,
) -> Result<ExitCode, String> {
    let volume = if quick { 256 * MIB } else { 1024 * MIB };
    let base = TempDir::new(dir, "ssd")?;
    let raw_path = base.path.join("raw.bin");

    let mut rows = Vec::new();
    let mut direct = false;
    let mut uring = false;
    let readers = 2;
    let sizes: &[usize] = &[256 << 10, MIB, 2 * MIB];
    for &size in sizes {
        let n = volume / size;
        let sdir = base.path.join(format!("ssd-{size}"));
        let cfg = engine_config(&sdir, volume, false, io_uring);
        let value: Vec<u8> = (0..size).map(|i| (i * 31 + 7) as u8).collect();
        // The raw baseline is taken again for every size, just before the engine's runs: this
        // machine's disk throughput drifts by 2x over minutes, so a baseline from the start of
        // the run would compare the engine with a different disk.
        note(
            json,
            &format!("raw O_DIRECT baseline ({} KiB row) ...", size >> 10),
        );
        let (raw_w, raw_r) = raw_seq(&raw_path, volume)?;
        let raw_lat = if size == 2 * MIB {
            Some(raw_p50(&raw_path, volume, if quick { 100 } else { 300 })?)
        } else {
            None
        };
        let _ = std::fs::remove_file(&raw_path);
        // Warm pass: every segment written once, then freed (recycled from now on).
        {
            let e = Engine::open(cfg.clone()).map_err(|e| e.to_string())?;
            direct = e.stats().ssd_direct_io;
            uring = e.stats().ssd_io_uring;
            for i in 0..n {
                e.put(&key(size, i), &value, PutMeta::default())
                    .map_err(|e| e.to_string())?;
            }
            e.flush().map_err(|e| e.to_string())?;
            e.clear();
            e.close().map_err(|e| e.to_string())?;
        }
        note(json, &format!("engine write {} KiB ...", size >> 10));
        let e = Engine::open(cfg.clone()).map_err(|e| e.to_string())?;
        let pb = bar(volume as u64, &format!("write {} KiB", size >> 10));
        let t0 = Instant::now();
        for i in 0..n {
            e.put(&key(size, i), &value, PutMeta::default())
                .map_err(|e| e.to_string())?;
            pb.inc(size as u64);
        }
        e.flush().map_err(|e| e.to_string())?;
        let w = t0.elapsed();
        pb.finish_and_clear();
        let s = e.stats();
        if s.ssd_objects != n as u64 {
            return Err(format!("only {} of {n} objects reached SSD", s.ssd_objects));
        }
        e.close().map_err(|e| e.to_string())?;

        // Cold reads: a fresh engine (empty DRAM, no promotion), `readers` threads.
        note(json, &format!("engine read {} KiB ...", size >> 10));
        let e = Arc::new(Engine::open(cfg.clone()).map_err(|e| e.to_string())?);
        let pb = bar(volume as u64, &format!("read {} KiB", size >> 10));
        let t0 = Instant::now();
        let bad = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..readers {
                let (e, pb, bad, value) = (&e, &pb, &bad, &value);
                s.spawn(move || {
                    let mut buf = Aligned::new(size + 4096);
                    for i in (t..n).step_by(readers) {
                        let dst = &mut buf.get()[..size];
                        if e.get_into(&key(size, i), dst).is_err() || dst != &value[..] {
                            bad.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        pb.inc(size as u64);
                    }
                });
            }
        });
        let r = t0.elapsed();
        pb.finish_and_clear();
        if bad.into_inner() > 0 {
            return Err("engine read returned misses or wrong bytes".into());
        }
        let label = if size >= MIB {
            format!("{} MiB", size / MIB)
        } else {
            format!("{} KiB", size >> 10)
        };
        let (ew, er) = (gbps(volume as u64, w), gbps(volume as u64, r));
        rows.push(Row {
            test: format!("seq write {label} (GB/s)"),
            engine: ew,
            raw: raw_w,
            ratio: ew / raw_w,
            target: ">= 0.70".into(),
            pass: ew / raw_w >= 0.70,
        });
        rows.push(Row {
            test: format!("seq read {label} (GB/s)"),
            engine: er,
            raw: raw_r,
            ratio: er / raw_r,
            target: ">= 0.80".into(),
            pass: er / raw_r >= 0.80,
        });
        if let Some(raw_lat) = raw_lat {
            // DRAM-miss SSD hits, one at a time, random keys: aligned and misaligned dst.
            let iters = if quick { 100 } else { 300 };
            let mut buf = Aligned::new(size + 4096);
            for (name, aligned) in [("aligned dst", true), ("unaligned dst", false)] {
                let mut times = Vec::with_capacity(iters);
                let mut rng = 0x9E37_79B9_7F4A_7C15u64;
                for _ in 0..iters {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let i = rng as usize % n;
                    let dst: &mut [u8] = if aligned {
                        &mut buf.get()[..size]
                    } else {
                        &mut buf.misaligned()[..size]
                    };
                    let t0 = Instant::now();
                    e.get_into(&key(size, i), dst).map_err(|e| e.to_string())?;
                    times.push(t0.elapsed());
                }
                let p = p50(times).as_secs_f64() * 1e3;
                let raw_ms = raw_lat.as_secs_f64() * 1e3;
                rows.push(Row {
                    test: format!("2 MiB DRAM-miss hit p50, {name} (ms)"),
                    engine: p,
                    raw: raw_ms,
                    ratio: p / raw_ms,
                    target: "<= 2.00".into(),
                    pass: p / raw_ms <= 2.0,
                });
            }
        }
        drop(e);
        let _ = std::fs::remove_dir_all(&sdir);
    }
    let report = SsdReport {
        dir: base.path.display().to_string(),
        direct_io: direct,
        io_uring: uring,
        volume_bytes_per_size: volume,
        engine_readers: readers,
        rows,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "kvtier bench ssd: {} (O_DIRECT {}, engine I/O {}), {} MiB per size; raw = dd-style \
             O_DIRECT, 1 thread, 4 MiB blocks, taken before each size (latency: 2 MiB reads); \
             engine reads: {readers} threads",
            report.dir,
            if direct { "on" } else { "off" },
            if uring { "io_uring" } else { "posix" },
            volume / MIB
        );
        println!(
            "{:<40} {:>9} {:>9} {:>7} {:>8} {:>5}",
            "test", "engine", "raw", "ratio", "target", ""
        );
        for r in &report.rows {
            println!(
                "{:<40} {:>9.3} {:>9.3} {:>7.2} {:>8} {:>5}",
                r.test,
                r.engine,
                r.raw,
                r.ratio,
                r.target,
                if r.pass { "ok" } else { "MISS" }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(serde::Serialize)]
struct RecoveryBench {
    objects: u64,
    segment_bytes: u64,
    write_s: f64,
    checkpoint_open_s: f64,
    scan_open_s: f64,
    scan_bytes: u64,
    scan_gb_per_s: f64,
    large_scan_bytes: u64,
    large_scan_gb_per_s: f64,
}

fn open_with_bar(cfg: &EngineConfig, label: &str) -> Result<(Engine, Duration), String> {
    let pb = if crate::interactive() {
        let b = ProgressBar::new(0);
        b.set_style(
            ProgressStyle::with_template("{msg:>18} [{bar:40}] {pos}/{len} segments {prefix}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_message(label.to_string());
        b
    } else {
        ProgressBar::hidden()
    };
    let interactive = crate::interactive();
    let mut last_line = Instant::now();
    let t0 = Instant::now();
    let e = Engine::open_with_progress(cfg.clone(), &mut |p: &RecoveryProgress| {
        let rate = p.records as f64 / p.elapsed.as_secs_f64().max(1e-9);
        if interactive {
            pb.set_length(p.segments_total);
            pb.set_position(p.segments_done);
            pb.set_prefix(format!("{} records, {rate:.0} records/s", p.records));
        } else if last_line.elapsed() >= Duration::from_secs(1)
            || p.segments_done == p.segments_total
        {
            last_line = Instant::now();
            eprintln!(
                "{label}: {}/{} segments, {} records, {:.0} records/s, {:.2} GB scanned",
                p.segments_done,
                p.segments_total,
                p.records,
                rate,
                p.bytes_scanned as f64 / 1e9
            );
        }
    })
    .map_err(|e| e.to_string())?;
    let d = t0.elapsed();
    pb.finish_and_clear();
    Ok((e, d))
}

/// `kvtier bench recovery`.
pub(crate) fn recovery(dir: Option<PathBuf>, objects: u64, json: bool) -> Result<ExitCode, String> {
    let base = TempDir::new(dir, "recovery")?;
    let seg = 256 * MIB as u64;
    let bytes = objects * 4096;
    let cfg = EngineConfig {
        dram_capacity_bytes: 64 * MIB as u64,
        index_shards: 256,
        ssd_enabled: true,
        ssd_storage_dir: base.path.join("small"),
        ssd_segment_size_bytes: seg,
        ssd_capacity_bytes: (bytes / seg + 2).max(2) * seg,
        ssd_copy_queue_depth: 4096,
        ssd_copy_batch_max_ops: 256,
        ssd_high_watermark: 1.0,
        ssd_low_watermark: 1.0,
        ..EngineConfig::default()
    };
    note(json, &format!("writing {objects} objects ..."));
    let t0 = Instant::now();
    {
        let e = Engine::open(cfg.clone()).map_err(|e| e.to_string())?;
        let pb = bar(objects, "put");
        for i in 0..objects {
            e.put(
                format!("recovery/{i:016x}").as_bytes(),
                &[],
                PutMeta::default(),
            )
            .map_err(|e| e.to_string())?;
            if i % 4096 == 0 {
                pb.set_position(i);
            }
        }
        pb.finish_and_clear();
        e.close().map_err(|e| e.to_string())?;
    }
    let write_s = t0.elapsed().as_secs_f64();
    let (e, ckpt) = open_with_bar(&cfg, "checkpoint")?;
    let r = e.recovery_report().unwrap_or_default();
    if !r.used_checkpoint || r.objects != objects {
        return Err(format!("checkpoint open recovered {r:?}"));
    }
    // Leave without rewriting the checkpoint, then scan.
    drop(e);
    let _ = std::fs::remove_file(cfg.ssd_storage_dir.join("index.ckpt"));
    let (e, scan) = open_with_bar(&cfg, "scan")?;
    let rs = e.recovery_report().unwrap_or_default();
    if rs.used_checkpoint || rs.objects != objects {
        return Err(format!("scan open recovered {rs:?}"));
    }
    drop(e);
    let _ = std::fs::remove_dir_all(&cfg.ssd_storage_dir);

    // Scan speed on large records (the common case of 256 KiB+ KV pages).
    let large_cfg = EngineConfig {
        ssd_storage_dir: base.path.join("large"),
        ssd_capacity_bytes: 8 * seg,
        ..cfg.clone()
    };
    {
        let e = Engine::open(large_cfg.clone()).map_err(|e| e.to_string())?;
        let v = vec![7u8; 256 << 10];
        // 1.5 GB for a full run, proportionally less (at least 16 MiB) for small ones.
        let volume = (objects as usize * 1536).clamp(16 * MIB, 6 * seg as usize);
        for i in 0..volume / v.len() {
            e.put(format!("large/{i}").as_bytes(), &v, PutMeta::default())
                .map_err(|e| e.to_string())?;
        }
        e.close().map_err(|e| e.to_string())?;
    }
    let _ = std::fs::remove_file(large_cfg.ssd_storage_dir.join("index.ckpt"));
    let (e, _) = open_with_bar(&large_cfg, "scan large")?;
    let rl = e.recovery_report().unwrap_or_default();
    drop(e);

    let out = RecoveryBench {
        objects,
        segment_bytes: seg,
        write_s,
        checkpoint_open_s: ckpt.as_secs_f64(),
        scan_open_s: scan.as_secs_f64(),
        scan_bytes: rs.scan.bytes_scanned,
        scan_gb_per_s: rs.scan_gb_per_s(),
        large_scan_bytes: rl.scan.bytes_scanned,
        large_scan_gb_per_s: rl.scan_gb_per_s(),
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "kvtier bench recovery: {} objects (4 KiB records, {} MiB segments), written in {:.1} s",
            out.objects,
            seg >> 20,
            out.write_s
        );
        println!(
            "  open from checkpoint: {:.2} s (target <= 2 s for 1 M objects)",
            out.checkpoint_open_s
        );
        println!(
            "  open by full scan:    {:.2} s, {:.2} GB scanned at {:.2} GB/s",
            out.scan_open_s,
            out.scan_bytes as f64 / 1e9,
            out.scan_gb_per_s
        );
        println!(
            "  scan of 256 KiB records: {:.2} GB at {:.2} GB/s (target >= 1 GB/s)",
            out.large_scan_bytes as f64 / 1e9,
            out.large_scan_gb_per_s
        );
    }
    Ok(ExitCode::SUCCESS)
}
