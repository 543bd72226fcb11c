//! `kvtier._native.LinkerCore`: the moving parts of SGLang's direct linker (issue 18), under
//! the thin Python `kvtier.sglang_linker.KvtierLinker`.
//!
//! It owns two kvtier threads. The load thread runs one queued batch at a time, layer by
//! layer: for every layer it copies the byte ranges Python planned (one layer's rows of every
//! page) through a [`RangedReader`], and only after that layer's bytes are in place does it
//! report the layer (a Python callback that completes SGLang's `LayerWiseLoadCounter`). A
//! failure reports the failing layer with its error and stops the batch; every later layer
//! is then failed by the counter. The offload thread persists one tree node per job: it first
//! waits for the node's ready events (a Python callback), then asks which objects exist and
//! copies only the missing ones (a re-put of stored keys costs an existence check, no copy).
//!
//! Invariants: offload results are pushed in submission order (one thread, one FIFO), so
//! SGLang's positional pairing of offloads and results holds; every job submitted is counted
//! until its thread finished it, so `drain()` returns only when no copy touches device
//! memory any more; Python callbacks run with the GIL taken only for the call.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use kvtier_client::ranged::{put_gathered, RangeCopy, RangedReader};
use kvtier_client::{Client, MemRef};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::Store;

/// `(key, object_len, row, shape)`: one object of a load, the device row its page lands in,
/// and the index of its shape.
type LoadObject = (String, u64, usize, usize);
/// `(offset_in_object, base_ptr, row_stride, len)`: one piece of a layer of an object shape;
/// the piece of row `r` lands at `base_ptr + r * row_stride`.
type ShapePiece = (u64, usize, usize, usize);
/// `(key, [(ptr, len)])`: one object to offload, from these pieces in order.
type OffloadItem = (String, Vec<(usize, usize)>);

enum LoadJob {
    Batch {
        index: i64,
        objects: Vec<LoadObject>,
        shapes: Vec<Vec<Vec<ShapePiece>>>,
        layers: usize,
        report: Option<Py<PyAny>>,
    },
    Stop,
}

enum OffloadJob {
    Node {
        objects: Vec<OffloadItem>,
        ready: Option<Py<PyAny>>,
    },
    Stop,
}

/// Jobs submitted and not yet finished, with a condition to wait for zero.
#[derive(Default)]
struct InFlight {
    count: Mutex<usize>,
    idle: Condvar,
}

impl InFlight {
    fn add(&self) {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    }
    fn done(&self) {
        let mut n = self.count.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.idle.notify_all();
        }
    }
    fn wait_idle(&self) {
        let mut n = self.count.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = self.idle.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[derive(Default)]
struct Counters {
    load_batches: AtomicU64,
    load_failures: AtomicU64,
    layers_loaded: AtomicU64,
    bytes_loaded: AtomicU64,
    offloads: AtomicU64,
    objects_written: AtomicU64,
    objects_skipped: AtomicU64,
    bytes_offloaded: AtomicU64,
}

/// Per load batch: layers landed, or the first failure; the forward waits on it without the
/// GIL (`wait_layer`), so a layer's completion never waits for Python.
#[derive(Default)]
struct Progress {
    batches: Mutex<HashMap<i64, BatchProgress>>,
    changed: Condvar,
}

struct BatchProgress {
    layers: usize,
    done: usize,
    failed: Option<String>,
}

impl Progress {
    fn layer_done(&self, index: i64, layer: usize, failure: Option<String>) {
        let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = batches.get_mut(&index) {
            match failure {
                Some(f) => {
                    b.failed.get_or_insert(f);
                }
                None => b.done = b.done.max(layer + 1),
            }
        }
        self.changed.notify_all();
    }

    /// Block until `pred` holds for batch `index` (or it is unknown); returns its state.
    fn wait(
        &self,
        index: i64,
        pred: impl Fn(&BatchProgress) -> bool,
    ) -> Option<(usize, Option<String>)> {
        let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match batches.get(&index) {
                None => return None,
                Some(b) if b.failed.is_some() || pred(b) => {
                    return Some((b.done, b.failed.clone()))
                }
                Some(_) => {}
            }
            batches = self
                .changed
                .wait(batches)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

struct Shared {
    progress: Progress,
    client: Arc<Client>,
    results: Mutex<VecDeque<bool>>,
    loads: InFlight,
    offloads: InFlight,
    counters: Counters,
}

/// See the module docs.
#[pyclass(frozen, module = "kvtier._native")]
pub(crate) struct LinkerCore {
    shared: Arc<Shared>,
    load_tx: Mutex<Option<Sender<LoadJob>>>,
    offload_tx: Mutex<Option<Sender<OffloadJob>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// The ranges of `object` for `layer`, or an error naming a row whose address overflows.
fn layer_ranges(
    shapes: &[Vec<Vec<ShapePiece>>],
    object: &LoadObject,
    layer: usize,
) -> Result<Vec<RangeCopy>, String> {
    let (key, _, row, shape) = object;
    let pieces = shapes
        .get(*shape)
        .ok_or_else(|| format!("object {key}: unknown shape {shape}"))?;
    let Some(pieces) = pieces.get(layer) else {
        return Ok(Vec::new());
    };
    pieces
        .iter()
        .map(|&(offset, base, stride, len)| {
            row.checked_mul(stride)
                .and_then(|at| at.checked_add(base))
                .map(|dst| RangeCopy { offset, dst, len })
                .ok_or_else(|| format!("object {key}: row {row} overflows the address space"))
        })
        .collect()
}

fn run_load(
    shared: &Shared,
    index: i64,
    objects: &[LoadObject],
    shapes: &[Vec<Vec<ShapePiece>>],
    layers: usize,
    report: Option<&Py<PyAny>>,
) {
    shared.counters.load_batches.fetch_add(1, Ordering::Relaxed);
    let mut reader = RangedReader::new(&shared.client);
    for layer in 0..layers {
        let mut failure = None;
        let mut bytes = 0u64;
        for object in objects {
            let copied = layer_ranges(shapes, object, layer).and_then(|copies| {
                reader
                    .copy_ranges(object.0.as_bytes(), object.1, &copies)
                    .map_err(|e| format!("object {}: {e}", object.0))?;
                Ok(copies.iter().map(|c| c.len as u64).sum::<u64>())
            });
            match copied {
                Ok(n) => bytes += n,
                Err(e) => {
                    failure = Some(format!("layer {layer}, {e}"));
                    break;
                }
            }
        }
        shared
            .counters
            .bytes_loaded
            .fetch_add(bytes, Ordering::Relaxed);
        let failed = failure.is_some();
        if failed {
            shared
                .counters
                .load_failures
                .fetch_add(1, Ordering::Relaxed);
        } else {
            shared
                .counters
                .layers_loaded
                .fetch_add(1, Ordering::Relaxed);
        }
        match report {
            Some(report) => Python::attach(|py| {
                if let Err(e) = report.call1(py, (index, layer, failure)) {
                    e.print(py);
                }
            }),
            // No GIL on this path: the forward waits on `progress` (wait_layer).
            None => shared.progress.layer_done(index, layer, failure),
        }
        if failed {
            return;
        }
    }
}

fn run_offload(shared: &Shared, objects: &[OffloadItem], ready: Option<&Py<PyAny>>) -> bool {
    shared.counters.offloads.fetch_add(1, Ordering::Relaxed);
    if let Some(ready) = ready {
        // The events say the forward finished writing these pages; reading before is a race.
        let waited = Python::attach(|py| match ready.call0(py) {
            Ok(_) => true,
            Err(e) => {
                e.print(py);
                false
            }
        });
        if !waited {
            return false;
        }
    }
    if objects.is_empty() {
        return true;
    }
    let keys: Vec<&[u8]> = objects.iter().map(|(k, _)| k.as_bytes()).collect();
    let exists = shared.client.exists_keys(&keys);
    let mut ok = true;
    for ((key, pieces), present) in objects.iter().zip(exists) {
        if present {
            shared
                .counters
                .objects_skipped
                .fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let refs: Vec<MemRef> = pieces
            .iter()
            .map(|&(ptr, len)| MemRef { ptr, len })
            .collect();
        let bytes: u64 = refs.iter().map(|r| r.len as u64).sum();
        let stored = if refs.len() == 1 {
            let r = shared.client.put_keys(&[key.as_bytes()], &refs, None);
            if r.ok.first().copied().unwrap_or(false) {
                Ok(())
            } else {
                Err(r.errors.join("; "))
            }
        } else {
            put_gathered(&shared.client, key.as_bytes(), &refs, None).map_err(|e| e.to_string())
        };
        match stored {
            Ok(()) => {
                shared
                    .counters
                    .objects_written
                    .fetch_add(1, Ordering::Relaxed);
                shared
                    .counters
                    .bytes_offloaded
                    .fetch_add(bytes, Ordering::Relaxed);
            }
            Err(e) => {
                eprintln!("kvtier linker: offload of {key} failed: {e}");
                ok = false;
            }
        }
    }
    ok
}

#[pymethods]
impl LinkerCore {
    #[new]
    fn new(store: &Bound<'_, Store>) -> PyResult<LinkerCore> {
        let shared = Arc::new(Shared {
            progress: Progress::default(),
            client: Arc::clone(&store.get().client),
            results: Mutex::new(VecDeque::new()),
            loads: InFlight::default(),
            offloads: InFlight::default(),
            counters: Counters::default(),
        });
        let (load_tx, load_rx) = channel::<LoadJob>();
        let (offload_tx, offload_rx) = channel::<OffloadJob>();
        let load_shared = Arc::clone(&shared);
        let load = std::thread::Builder::new()
            .name("kvtier-linker-load".into())
            .spawn(move || {
                while let Ok(LoadJob::Batch {
                    index,
                    objects,
                    shapes,
                    layers,
                    report,
                }) = load_rx.recv()
                {
                    run_load(
                        &load_shared,
                        index,
                        &objects,
                        &shapes,
                        layers,
                        report.as_ref(),
                    );
                    if let Some(report) = report {
                        Python::attach(|_py| drop(report));
                    }
                    load_shared.loads.done();
                }
            })
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start a load thread: {e}")))?;
        let offload_shared = Arc::clone(&shared);
        let offload = std::thread::Builder::new()
            .name("kvtier-linker-offload".into())
            .spawn(move || {
                while let Ok(OffloadJob::Node { objects, ready }) = offload_rx.recv() {
                    let ok = run_offload(&offload_shared, &objects, ready.as_ref());
                    if let Some(ready) = ready {
                        Python::attach(|_py| drop(ready));
                    }
                    offload_shared
                        .results
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push_back(ok);
                    offload_shared.offloads.done();
                }
            })
            .map_err(|e| PyRuntimeError::new_err(format!("cannot start an offload thread: {e}")))?;
        Ok(LinkerCore {
            shared,
            load_tx: Mutex::new(Some(load_tx)),
            offload_tx: Mutex::new(Some(offload_tx)),
            threads: Mutex::new(vec![load, offload]),
        })
    }

    /// Queue a load batch of `layers` layers: `objects` lists `(key, object_len, row, shape)`
    /// and `shapes[shape][layer]` the `(offset, base, row_stride, len)` pieces of that layer
    /// (a piece of row `r` lands at `base + r * row_stride`). `report(index, layer,
    /// error_or_None)` is called once per layer in order, after that layer's bytes of every
    /// object landed, and once with the error on the failing layer (the batch stops there).
    /// With `report=None` the layers are recorded natively instead, for `wait_layer` and
    /// `finish_batch` (no GIL on the completion path); `open_batch(index, layers)` first.
    fn submit_load(
        &self,
        index: i64,
        objects: Vec<LoadObject>,
        shapes: Vec<Vec<Vec<ShapePiece>>>,
        layers: usize,
        report: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let tx = self.load_tx.lock().unwrap_or_else(|e| e.into_inner());
        let tx = tx
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the linker is closed"))?;
        self.shared.loads.add();
        tx.send(LoadJob::Batch {
            index,
            objects,
            shapes,
            layers,
            report,
        })
        .map_err(|_| {
            self.shared.loads.done();
            PyRuntimeError::new_err("the load thread stopped")
        })
    }

    /// Queue one node's offload; its result is appended to the FIFO in call order.
    /// `ready()` (optional) is called first and must return once the pages are written.
    #[pyo3(signature = (objects, ready = None))]
    fn submit_offload(&self, objects: Vec<OffloadItem>, ready: Option<Py<PyAny>>) -> PyResult<()> {
        let tx = self.offload_tx.lock().unwrap_or_else(|e| e.into_inner());
        let tx = tx
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the linker is closed"))?;
        self.shared.offloads.add();
        tx.send(OffloadJob::Node { objects, ready }).map_err(|_| {
            self.shared.offloads.done();
            PyRuntimeError::new_err("the offload thread stopped")
        })
    }

    /// Register load batch `index` of `layers` layers for `wait_layer` / `finish_batch`.
    fn open_batch(&self, index: i64, layers: usize) {
        let mut batches = self
            .shared
            .progress
            .batches
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        batches.insert(
            index,
            BatchProgress {
                layers,
                done: 0,
                failed: None,
            },
        );
    }

    /// Fail batch `index` (its waiters return; `finish_batch` says False).
    fn fail_batch(&self, index: i64, error: String) {
        let progress = &self.shared.progress;
        let mut batches = progress.batches.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = batches.get_mut(&index) {
            b.failed.get_or_insert(error);
        }
        progress.changed.notify_all();
    }

    /// Block (without the GIL) until `layer` of batch `index` landed or the batch failed;
    /// returns at once for an unknown batch. True when the layer landed.
    fn wait_layer(&self, py: Python<'_>, index: i64, layer: usize) -> bool {
        let progress = &self.shared.progress;
        py.detach(|| progress.wait(index, |b| b.done > layer))
            .is_none_or(|(done, failed)| failed.is_none() && done > layer)
    }

    /// Wait until every layer of batch `index` landed or it failed, forget it, and say whether
    /// all landed (True for an unknown batch).
    fn finish_batch(&self, py: Python<'_>, index: i64) -> bool {
        let progress = &self.shared.progress;
        let state = py.detach(|| progress.wait(index, |b| b.done >= b.layers));
        progress
            .batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&index);
        state.is_none_or(|(_, failed)| failed.is_none())
    }

    /// Forget every batch (waiters return).
    fn reset_batches(&self) {
        let progress = &self.shared.progress;
        progress
            .batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        progress.changed.notify_all();
    }

    fn num_completed_offloads(&self) -> usize {
        self.shared
            .results
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// The oldest completed offload's result; False when none completed (fail closed).
    fn pop_completed_offload(&self) -> bool {
        self.shared
            .results
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
            .unwrap_or(false)
    }

    /// Wait until every submitted load and offload finished (results stay queued).
    fn drain(&self, py: Python<'_>) {
        let shared = &self.shared;
        py.detach(|| {
            shared.loads.wait_idle();
            shared.offloads.wait_idle();
        });
    }

    /// Drop completed results not yet popped.
    fn clear_results(&self) {
        self.shared
            .results
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Finish queued work, then stop both threads. Idempotent.
    fn close(&self, py: Python<'_>) {
        self.drain(py);
        if let Some(tx) = self
            .load_tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = tx.send(LoadJob::Stop);
        }
        if let Some(tx) = self
            .offload_tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = tx.send(OffloadJob::Stop);
        }
        let threads: Vec<JoinHandle<()>> = self
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        py.detach(|| {
            for t in threads {
                let _ = t.join();
            }
        });
    }

    /// Counters: load batches/failures, layers and bytes loaded, offloads, objects written
    /// and skipped (already stored), bytes offloaded.
    fn stats(&self) -> Vec<(&'static str, u64)> {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        vec![
            ("load_batches", get(&c.load_batches)),
            ("load_failures", get(&c.load_failures)),
            ("layers_loaded", get(&c.layers_loaded)),
            ("bytes_loaded", get(&c.bytes_loaded)),
            ("offloads", get(&c.offloads)),
            ("objects_written", get(&c.objects_written)),
            ("objects_skipped", get(&c.objects_skipped)),
            ("bytes_offloaded", get(&c.bytes_offloaded)),
        ]
    }
}
