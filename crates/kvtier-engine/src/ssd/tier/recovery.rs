//! Opening the tier and recovery: lock the directory, open the segment files, rebuild the
//! index from a valid checkpoint plus a parallel scan of every segment it does not vouch for
//! (newest sequence number wins per key), and start the worker threads.
//!
//! Owns: nothing after open returns; its result is the [`Recovered`] state handed to
//! `Shared`. Invariant: only records of a segment's current generation with intact header and
//! payload CRC enter the index.

use super::*;

// ---- recovery ----

pub(super) struct Recovered {
    pub(super) entries: Vec<(Arc<[u8]>, SsdEntry)>,
    /// (segment, generation, append offset) of segments holding current records.
    pub(super) in_use: Vec<(u32, u64, u64)>,
    pub(super) next_seq: u64,
    pub(super) report: RecoveryReport,
}

/// Rebuild the index: from the checkpoint where it is valid, by scanning elsewhere.
pub(super) fn recover(
    dir: &Path,
    seg_size: u64,
    files: &[OnceLock<SegFile>],
    progress: &mut dyn FnMut(&RecoveryProgress),
) -> io::Result<Recovered> {
    let t0 = Instant::now();
    let mut report = RecoveryReport::default();
    let mut next_seq = 1u64;
    // Segment headers first: they decide what the checkpoint may vouch for.
    let mut headers: Vec<Option<SegmentHeader>> = vec![None; files.len()];
    let mut hb = AlignedBuf::zeroed(ALIGN);
    for (i, f) in files.iter().enumerate() {
        if let Some(f) = f.get() {
            let n = f.read_at(hb.as_mut_slice(), 0)?;
            headers[i] = SegmentHeader::decode(&hb.as_slice()[..n])
                .filter(|h| h.id == i as u32 && h.segment_size == seg_size);
            if let Some(h) = headers[i] {
                next_seq = next_seq.max(h.generation + 1);
            }
        }
    }
    let mut trusted = vec![false; files.len()];
    // Entries vouched for by the checkpoint (unique keys); merged with scans only if needed.
    let mut from_ckpt: Vec<(Arc<[u8]>, SsdEntry)> = Vec::new();
    let mut in_use: Vec<(u32, u64, u64)> = Vec::new();
    let ckpt = checkpoint::read(dir);
    let ckpt_ok = ckpt.as_ref().is_some_and(|c| {
        c.segment_size == seg_size
            && c.segments.iter().all(|&(id, g, _)| {
                headers
                    .get(id as usize)
                    .copied()
                    .flatten()
                    .is_some_and(|h| h.in_use && h.generation == g)
            })
            && headers.iter().enumerate().all(|(i, h)| {
                // Every in-use segment must be listed, else it was written after the checkpoint.
                !h.is_some_and(|h| h.in_use)
                    || c.segments.iter().any(|&(id, _, _)| id as usize == i)
            })
            // Every entry must describe a record inside its segment (a checkpoint is input:
            // one out of range is damage, and the segments are scanned instead).
            && c.entries.iter().all(|e| {
                e.loc.rec_len > 0
                    && e.loc.offset % ALIGN as u64 == 0
                    && e.loc.offset.checked_add(e.loc.rec_len).is_some_and(|end| end <= seg_size)
                    && u64::from(e.loc.payload_offset)
                        .checked_add(e.loc.payload_len)
                        .is_some_and(|end| end <= e.loc.rec_len)
            })
    });
    if let (Some(c), true) = (&ckpt, ckpt_ok) {
        report.used_checkpoint = true;
        next_seq = next_seq.max(c.next_seq);
        for &(id, g, end) in &c.segments {
            trusted[id as usize] = true;
            in_use.push((id, g, end));
        }
        from_ckpt.reserve(c.entries.len());
        let mut gen_of = vec![None; files.len()];
        for &(id, g, _) in &c.segments {
            gen_of[id as usize] = Some(g);
        }
        for e in &c.entries {
            let Some(generation) = gen_of.get(e.seg as usize).copied().flatten() else {
                continue;
            };
            from_ckpt.push((
                Arc::clone(&e.key),
                SsdEntry {
                    seg: e.seg,
                    generation,
                    loc: e.loc,
                },
            ));
        }
        report.objects_from_checkpoint = c.entries.len() as u64;
        progress(&RecoveryProgress {
            segments_done: 0,
            segments_total: 0,
            bytes_scanned: 0,
            records: from_ckpt.len() as u64,
            elapsed: t0.elapsed(),
            from_checkpoint: true,
        });
    } else if ckpt.is_some() || checkpoint::path(dir).exists() {
        tracing::warn!(dir = %dir.display(), "kvtier: SSD index checkpoint is stale or damaged; scanning segments");
        let _ = checkpoint::remove(dir);
    }

    // Scan every segment the checkpoint does not vouch for (in use, or without a header).
    let to_scan: Vec<u32> = (0..files.len() as u32)
        .filter(|&i| files[i as usize].get().is_some() && !trusted[i as usize])
        .filter(|&i| headers[i as usize].is_none_or(|h| h.in_use))
        .collect();
    let total = to_scan.len() as u64;
    let next = AtomicU64::new(0);
    let (tx, rx) = mpsc::channel::<ScanMsg>();
    // Twice the cores: a scanner alternates between waiting on a read and checksumming it, so
    // two per core keep both the disk queue and the CPU busy.
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .saturating_mul(2)
        .clamp(2, 8);
    let mut scans: Vec<(u32, crate::ssd::scan::SegmentScan)> = Vec::new();
    let mut first_err = None;
    std::thread::scope(|s| {
        for _ in 0..threads.min(to_scan.len()) {
            let tx = tx.clone();
            let (to_scan, next) = (&to_scan, &next);
            s.spawn(move || {
                let mut buf = AlignedBuf::new();
                loop {
                    let i = next.fetch_add(1, Relaxed) as usize;
                    let Some(&seg) = to_scan.get(i) else { break };
                    let Some(file) = files[seg as usize].get() else {
                        continue;
                    };
                    let r = scan_segment(file, seg_size, &mut buf, true, &mut |b| {
                        let _ = tx.send(ScanMsg::Bytes(b));
                    });
                    let _ = tx.send(ScanMsg::Done(seg, r));
                }
            });
        }
        drop(tx);
        let mut done = 0;
        let mut bytes = 0;
        let mut records = from_ckpt.len() as u64;
        let mut last = Instant::now();
        for msg in rx {
            match msg {
                ScanMsg::Bytes(b) => bytes += b,
                ScanMsg::Done(seg, r) => {
                    done += 1;
                    match r {
                        Ok(scan) => {
                            records += scan.counts.good;
                            scans.push((seg, scan));
                        }
                        Err(e) => {
                            first_err.get_or_insert(e);
                        }
                    }
                }
            }
            if last.elapsed() >= Duration::from_millis(100) || done == total {
                last = Instant::now();
                progress(&RecoveryProgress {
                    segments_done: done,
                    segments_total: total,
                    bytes_scanned: bytes,
                    records,
                    elapsed: t0.elapsed(),
                    from_checkpoint: report.used_checkpoint,
                });
            }
        }
    });
    if let Some(e) = first_err {
        return Err(e);
    }
    scans.sort_by_key(|(seg, _)| *seg);
    if scans.is_empty() {
        report.objects = from_ckpt.len() as u64;
        report.elapsed = t0.elapsed();
        return Ok(Recovered {
            entries: from_ckpt,
            in_use,
            next_seq,
            report,
        });
    }
    let mut best: HashMap<Arc<[u8]>, SsdEntry, Hasher> = HashMap::with_hasher(Hasher::default());
    best.reserve(from_ckpt.len());
    best.extend(from_ckpt);
    for (seg, scan) in scans {
        report.segments_scanned += 1;
        report.scan.add(&scan.counts);
        next_seq = next_seq.max(scan.max_seq + 1);
        if scan.counts.torn + scan.counts.corrupt > 0 {
            tracing::warn!(
                segment = seg,
                torn = scan.counts.torn,
                corrupt = scan.counts.corrupt,
                "kvtier: dropped damaged SSD records at recovery"
            );
        }
        let Some(h) = scan.header.filter(|h| h.in_use) else {
            continue;
        };
        in_use.push((seg, h.generation, scan.end));
        for r in scan.records {
            let ScannedRecord { key, loc } = r;
            let seq = loc.seq;
            let e = SsdEntry {
                seg,
                generation: h.generation,
                loc,
            };
            match best.get_mut(&*key) {
                Some(old) if old.loc.seq >= seq => {}
                Some(old) => *old = e,
                None => {
                    best.insert(Arc::from(key), e);
                }
            }
        }
    }
    report.objects = best.len() as u64;
    report.elapsed = t0.elapsed();
    Ok(Recovered {
        entries: best.into_iter().collect(),
        in_use,
        next_seq,
        report,
    })
}

pub(super) enum ScanMsg {
    Bytes(u64),
    Done(u32, io::Result<crate::ssd::scan::SegmentScan>),
}

impl SsdTier {
    /// Open (and recover) the SSD tier of `config`. `dram_index` is the engine's DRAM index,
    /// which the copy pipeline consults before publishing a record.
    pub(crate) fn open(
        config: &EngineConfig,
        dram_index: Arc<Index>,
        groups: TierGroups,
        progress: &mut dyn FnMut(&RecoveryProgress),
    ) -> Result<SsdTier, EngineError> {
        let dir = config.ssd_dir();
        sio::ensure_private_dir(&dir).map_err(EngineError::SsdOpen)?;
        let lock = sio::lock_dir(&dir).map_err(EngineError::SsdOpen)?;
        let direct = sio::probe_direct(&dir);
        if !direct {
            tracing::warn!(dir = %dir.display(), "kvtier: O_DIRECT is not supported here; the SSD tier uses buffered I/O");
        }
        let io_backend = io_backend(config.ssd_io_backend);
        let seg_size = config.ssd_segment_size_bytes;
        let nseg = config.ssd_segments() as u32;
        let faults = Arc::new(Faults::default());
        let files = open_segment_files(&dir, nseg, direct, &faults, io_backend)?;
        let state = |i: u32| {
            files[i as usize]
                .get()
                .map_or(SegState::Missing, |_| SegState::Free)
        };
        let mut slots: Vec<SegMeta> = (0..nseg).map(|i| SegMeta::new(state(i))).collect();

        // Issue 27: a long scan shows in the log, besides the caller's own progress.
        let mut logged: Option<crate::progress::Progress> = None;
        let mut progress_and_log = |p: &RecoveryProgress| {
            let line = logged.get_or_insert_with(|| {
                crate::progress::Progress::new(
                    "recovering the SSD index (segments)",
                    p.segments_total,
                )
            });
            line.at(p.segments_done);
            progress(p);
        };
        let rec =
            recover(&dir, seg_size, &files, &mut progress_and_log).map_err(EngineError::SsdOpen)?;
        if let Some(line) = &logged {
            line.done();
        }
        let index = SsdIndex::new(config.index_shards.max(1));
        let sh_counters = Counters::default();
        let tick = AtomicU64::new(1);
        let mut gens = vec![0u64; nseg as usize];
        for (seg, generation, end) in &rec.in_use {
            let m = &mut slots[*seg as usize];
            m.state = SegState::Sealed;
            m.generation = *generation;
            m.write_off = *end;
            gens[*seg as usize] = *generation;
        }
        for (key, e) in rec.entries {
            let m = &mut slots[e.seg as usize];
            m.live_objects += 1;
            m.live_bytes += e.loc.rec_len;
            m.depth_sum += u64::from(e.loc.depth.unwrap_or(0));
            m.keys.push(Arc::clone(&key));
            m.last_access = tick.fetch_add(1, Relaxed);
            inc(&sh_counters.objects, 1);
            inc(&sh_counters.bytes_used, e.loc.payload_len);
            inc(&sh_counters.bytes_allocated, e.loc.rec_len);
            index.shard(&key).write().insert(key, e);
        }
        // Recovered segments stay sealed even when nothing in them is live: their on-disk
        // header says "in use" until reclaim frees them (empty ones go first), so the next
        // checkpoint still lists every in-use segment.
        let report = rec.report;
        let sh = Arc::new(Shared {
            settings: Settings {
                dir,
                seg_size,
                nseg,
                strict: config.ssd_durability_mode == SsdDurabilityMode::Strict,
                direct,
                io_backend,
                high: config.ssd_high_watermark,
                low: config.ssd_low_watermark,
                batch_max_ops: config.ssd_copy_batch_max_ops,
                queue_depth: config.ssd_copy_queue_depth,
            },
            segments: Segments {
                files,
                slot_gens: gens.into_iter().map(RwLock::new).collect(),
                table: Mutex::new(SegTable {
                    slots,
                    active: None,
                    max_segments: nseg,
                }),
                table_cv: Condvar::new(),
            },
            copies: CopyQueue::new(),
            victim: victim_policy(config.eviction_policy),
            checkpoint: CheckpointState {
                valid: AtomicBool::new(report.used_checkpoint),
                lock: Mutex::new(()),
            },
            stop: StopSignal {
                flag: Mutex::new(false),
                changed: Condvar::new(),
            },
            index,
            dram_index,
            groups,
            seq: AtomicU64::new(rec.next_seq),
            tick,
            mutation: RwLock::new(()),
            faults,
            c: sh_counters,
            degraded: AtomicBool::new(false),
            recovery: report,
            _lock: lock,
        });
        let mut threads = Vec::new();
        for i in 0..config.ssd_copy_worker_threads {
            let sh = Arc::clone(&sh);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvtier-ssd-copy-{i}"))
                    .spawn(move || {
                        let mut buf = AlignedBuf::new();
                        while let Some(batch) = sh.pop_batch() {
                            let n = batch.len();
                            let done = sh.process(batch, &mut buf);
                            // Release the objects first (write-back eviction and "wait for
                            // the queue, then evict" rely on it), then the batch, then wake
                            // the waiters.
                            let tickets: Vec<_> =
                                done.into_iter().map(|(job, r)| (job.ticket, r)).collect();
                            sh.finish_batch(n);
                            for (t, r) in tickets {
                                if let Some(t) = t {
                                    t.complete(r);
                                }
                            }
                        }
                    })
                    .map_err(EngineError::SsdOpen)?,
            );
        }
        let bg = Arc::clone(&sh);
        threads.push(
            std::thread::Builder::new()
                .name("kvtier-ssd-reclaim".into())
                .spawn(move || background(&bg))
                .map_err(EngineError::SsdOpen)?,
        );
        Ok(SsdTier {
            sh,
            threads: Mutex::new(threads),
        })
    }
}

/// The I/O backend to use: `io_uring` if asked for and the kernel allows it, else
/// preadv/pwritev (said in the log).
fn io_backend(asked: SsdIoBackend) -> SsdIoBackend {
    match asked {
        SsdIoBackend::IoUring => match uring::probe() {
            Ok(()) => SsdIoBackend::IoUring,
            Err(e) => {
                tracing::warn!(error = %e, "kvtier: io_uring is not available here; the SSD tier uses preadv/pwritev");
                SsdIoBackend::Posix
            }
        },
        SsdIoBackend::Posix => SsdIoBackend::Posix,
    }
}

/// Open the segment files found in `dir`, one slot per segment (empty where no file exists
/// yet); files beyond `nseg` are logged and ignored.
fn open_segment_files(
    dir: &Path,
    nseg: u32,
    direct: bool,
    faults: &Arc<Faults>,
    backend: SsdIoBackend,
) -> Result<Vec<OnceLock<SegFile>>, EngineError> {
    let files: Vec<OnceLock<SegFile>> = (0..nseg).map(|_| OnceLock::new()).collect();
    for id in sio::list_segments(dir).map_err(EngineError::SsdOpen)? {
        if id >= nseg {
            tracing::warn!(
                segment = id,
                "kvtier: segment beyond ssd_capacity_bytes ignored"
            );
            continue;
        }
        let f = SegFile::open(
            &sio::segment_path(dir, id),
            false,
            direct,
            Arc::clone(faults),
        )
        .map_err(EngineError::SsdOpen)?
        .with_backend(backend);
        let _ = files[id as usize].set(f);
    }
    Ok(files)
}
