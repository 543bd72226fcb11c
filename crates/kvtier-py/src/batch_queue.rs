//! `kvtier._native.BatchQueue` (issue 19): asynchronous batches on a kvtier store for engines
//! whose store plugins are submit-then-poll (vLLM's secondary tier, LMCache's native L2
//! adapter and its legacy remote connector).
//!
//! A submit call checks its arguments, queues one batch and returns a future id at once; a
//! fixed set of worker threads runs batches on the store without the GIL; each finished batch
//! becomes a completion `(id, ok, error, bools)` and the queue's eventfd is signalled.
//! `drain()` takes every completion and resets the eventfd, so a level-triggered `poll` on it
//! (LMCache's demultiplexer) wakes once per burst.
//!
//! Invariants:
//! - every accepted submit produces exactly one completion, also when the queue is full or
//!   closed (then at once, failed, naming the reason): callers never wait for a batch that was
//!   dropped;
//! - buffer-protocol exports taken at submit stay held until their batch has run (they are
//!   released on the worker, which attaches to the interpreter for that), so Python may not
//!   free or resize the memory of an in-flight batch;
//! - pointer batches (`submit_put_ptrs` / `submit_get_ptrs`) address only memory registered
//!   with the store (kvtier's region registry refuses anything else), whose owner keeps it
//!   alive as `Store.register_region` documents;
//! - `wait_idle` and `close` release the GIL while they wait (workers may need it to release
//!   buffers).

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvtier_client::{BatchResult, Client, MemRef};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use rustix::event::{eventfd, EventfdFlags};

use crate::buffer_access::HeldBuffer;
use crate::Store;

/// Why a batch failed as a whole (its completion's `error`).
#[derive(Debug, thiserror::Error)]
enum QueueError {
    #[error("kvtier batch queue full ({capacity} batches queued)")]
    Full { capacity: usize },
    #[error("kvtier batch queue closed")]
    Closed,
    #[error("batch shape: {0}")]
    Shape(String),
}

/// One queued batch.
enum Op {
    PutPtrs {
        keys: Vec<String>,
        bufs: Vec<MemRef>,
    },
    GetPtrs {
        keys: Vec<String>,
        bufs: Vec<MemRef>,
    },
    PutBuffers {
        keys: Vec<String>,
        held: Vec<HeldBuffer>,
    },
    GetBuffers {
        keys: Vec<String>,
        held: Vec<HeldBuffer>,
    },
    Exists {
        keys: Vec<String>,
    },
    Remove {
        keys: Vec<String>,
    },
}

/// `(future_id, ok, error, per-key bools)`: LMCache's native completion shape.
type Completion = (u64, bool, String, Option<Vec<bool>>);

#[derive(Default)]
struct State {
    queue: VecDeque<(u64, Op)>,
    running: usize,
    completions: Vec<Completion>,
    next_id: u64,
    closed: bool,
}

struct Shared {
    client: Arc<Client>,
    state: Mutex<State>,
    /// Signalled on submit and close.
    work: Condvar,
    /// Signalled whenever a batch finishes.
    done: Condvar,
    event: OwnedFd,
    capacity: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A worker never panics while holding the lock (it runs batches outside it); recover
        // the state anyway rather than poisoning every later call.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn signal(&self) {
        // A full eventfd counter (2^64-2 unread signals) cannot happen with drain() resetting
        // it; a failed write only delays the reader to its next poll timeout.
        let _ = rustix::io::write(&self.event, &1u64.to_ne_bytes());
    }

    fn complete(&self, state: &mut State, c: Completion) {
        state.completions.push(c);
        self.done.notify_all();
        self.signal();
    }
}

fn folded(id: u64, r: BatchResult) -> Completion {
    let mut errors = r.errors;
    if r.suppressed_errors > 0 {
        errors.push(format!(
            "... and {} more distinct errors",
            r.suppressed_errors
        ));
    }
    let ok = errors.is_empty() && r.ok.iter().all(|&b| b);
    (id, ok, errors.join("; "), Some(r.ok))
}

fn run(client: &Client, id: u64, op: Op) -> Completion {
    match op {
        Op::PutPtrs { keys, bufs } => folded(id, client.put_keys(&keys, &bufs, None)),
        Op::GetPtrs { keys, bufs } => folded(id, client.get_keys(&keys, &bufs)),
        Op::PutBuffers { keys, held } => {
            let mut r = BatchResult::with_capacity(keys.len());
            for (key, buf) in keys.iter().zip(&held) {
                match client.put_slice(key.as_bytes(), buf.as_bytes(), None) {
                    Ok(_) => r.ok.push(true),
                    Err(e) => {
                        r.note_error(format!("{key}: {e}"));
                        r.ok.push(false);
                    }
                }
            }
            drop(held); // releases the exports (attaches to the interpreter briefly)
            folded(id, r)
        }
        Op::GetBuffers { keys, held } => {
            let mut r = BatchResult::with_capacity(keys.len());
            for (key, buf) in keys.iter().zip(&held) {
                match client.get_into_slice(key.as_bytes(), buf.as_bytes_mut()) {
                    Ok(()) => r.push_ok(),
                    // A miss is an answer, not an error: the key's bool says it (issue 28:
                    // typed in every mode).
                    Err(e) if e.is_miss() => r.push_failed(e.item_failure()),
                    Err(e) => {
                        r.note_error(format!("{key}: {e}"));
                        r.push_failed(e.item_failure());
                    }
                }
            }
            drop(held);
            folded(id, r)
        }
        Op::Exists { keys } => (id, true, String::new(), Some(client.exists_keys(&keys))),
        Op::Remove { keys } => {
            // remove_keys counts removals; per key, report whether it is gone now.
            client.remove_keys(&keys);
            let gone = client.exists_keys(&keys).into_iter().map(|e| !e).collect();
            (id, true, String::new(), Some(gone))
        }
    }
}

fn worker(shared: Arc<Shared>) {
    loop {
        let (id, op) = {
            let mut state = shared.lock();
            loop {
                if let Some(job) = state.queue.pop_front() {
                    state.running += 1;
                    break job;
                }
                if state.closed {
                    return;
                }
                state = shared.work.wait(state).unwrap_or_else(|e| e.into_inner());
            }
        };
        let completion = run(&shared.client, id, op);
        let mut state = shared.lock();
        state.running -= 1;
        shared.complete(&mut state, completion);
    }
}

/// Asynchronous batches on a [`Store`]: submit returns a future id; completions are drained
/// as `(id, ok, error, bools)` after the eventfd (`event_fd()`) becomes readable.
#[pyclass(frozen, module = "kvtier._native")]
pub struct BatchQueue {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl BatchQueue {
    fn submit(&self, op: Op, n: usize) -> u64 {
        let mut state = self.shared.lock();
        let id = state.next_id;
        state.next_id += 1;
        let refused = if state.closed {
            Some(QueueError::Closed)
        } else if state.queue.len() >= self.shared.capacity {
            Some(QueueError::Full {
                capacity: self.shared.capacity,
            })
        } else {
            None
        };
        match refused {
            Some(e) => {
                drop(op); // releases held exports now; the caller holds the GIL
                self.shared
                    .complete(&mut state, (id, false, e.to_string(), Some(vec![false; n])));
            }
            None => {
                state.queue.push_back((id, op));
                self.shared.work.notify_one();
            }
        }
        id
    }

    fn shape_failure(&self, n: usize, why: String) -> u64 {
        let mut state = self.shared.lock();
        let id = state.next_id;
        state.next_id += 1;
        let e = QueueError::Shape(why);
        self.shared
            .complete(&mut state, (id, false, e.to_string(), Some(vec![false; n])));
        id
    }

    fn ptr_batch(
        &self,
        keys: &[String],
        ptrs: &[usize],
        sizes: &[usize],
    ) -> Result<Vec<MemRef>, u64> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            let why = format!(
                "{} keys, {} pointers, {} sizes",
                keys.len(),
                ptrs.len(),
                sizes.len()
            );
            return Err(self.shape_failure(keys.len(), why));
        }
        Ok(ptrs
            .iter()
            .zip(sizes)
            .map(|(&ptr, &len)| MemRef { ptr, len })
            .collect())
    }

    fn held(
        &self,
        keys: &[String],
        buffers: &[Bound<'_, PyAny>],
        writable: bool,
    ) -> PyResult<Result<Vec<HeldBuffer>, u64>> {
        if keys.len() != buffers.len() {
            let why = format!("{} keys but {} buffers", keys.len(), buffers.len());
            return Ok(Err(self.shape_failure(keys.len(), why)));
        }
        let held = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| HeldBuffer::take(b, writable, &format!("buffer {i}")))
            .collect::<PyResult<Vec<_>>>();
        match held {
            Ok(h) => Ok(Ok(h)),
            Err(e) => Ok(Err(self.shape_failure(keys.len(), e.to_string()))),
        }
    }
}

#[pymethods]
impl BatchQueue {
    /// `threads` workers run batches on `store`; at most `capacity` batches wait (more fail
    /// at once with a "queue full" completion).
    #[new]
    #[pyo3(signature = (store, threads = 2, capacity = 1024))]
    fn new(store: &Bound<'_, Store>, threads: usize, capacity: usize) -> PyResult<BatchQueue> {
        if threads == 0 || threads > 64 {
            return Err(PyValueError::new_err(format!(
                "BatchQueue threads must be 1..=64, got {threads}"
            )));
        }
        if capacity == 0 {
            return Err(PyValueError::new_err(
                "BatchQueue capacity must be at least 1",
            ));
        }
        let event = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
            .map_err(|e| PyRuntimeError::new_err(format!("eventfd: {e}")))?;
        let shared = Arc::new(Shared {
            client: Arc::clone(&store.get().client),
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            done: Condvar::new(),
            event,
            capacity,
        });
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let s = Arc::clone(&shared);
            let h = std::thread::Builder::new()
                .name(format!("kvtier-batch-{i}"))
                .spawn(move || worker(s))
                .map_err(|e| PyRuntimeError::new_err(format!("spawning a batch thread: {e}")))?;
            handles.push(h);
        }
        Ok(BatchQueue {
            shared,
            threads: Mutex::new(handles),
        })
    }

    /// The eventfd that becomes readable when completions are waiting.
    fn event_fd(&self) -> i32 {
        self.shared.event.as_raw_fd()
    }

    /// Put keys from registered memory (`Store.register_region`), one `(ptr, size)` per key.
    fn submit_put_ptrs(&self, keys: Vec<String>, ptrs: Vec<usize>, sizes: Vec<usize>) -> u64 {
        match self.ptr_batch(&keys, &ptrs, &sizes) {
            Ok(bufs) => {
                let n = keys.len();
                self.submit(Op::PutPtrs { keys, bufs }, n)
            }
            Err(id) => id,
        }
    }

    /// Get keys into registered memory; a key's bool is False when it is absent or failed.
    fn submit_get_ptrs(&self, keys: Vec<String>, ptrs: Vec<usize>, sizes: Vec<usize>) -> u64 {
        match self.ptr_batch(&keys, &ptrs, &sizes) {
            Ok(bufs) => {
                let n = keys.len();
                self.submit(Op::GetPtrs { keys, bufs }, n)
            }
            Err(id) => id,
        }
    }

    /// Put keys from C-contiguous buffer-protocol objects (held until the batch ran).
    fn submit_put(&self, keys: Vec<String>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<u64> {
        Ok(match self.held(&keys, &buffers, false)? {
            Ok(held) => {
                let n = keys.len();
                self.submit(Op::PutBuffers { keys, held }, n)
            }
            Err(id) => id,
        })
    }

    /// Get keys into writable C-contiguous buffers whose sizes equal the objects'.
    fn submit_get(&self, keys: Vec<String>, buffers: Vec<Bound<'_, PyAny>>) -> PyResult<u64> {
        Ok(match self.held(&keys, &buffers, true)? {
            Ok(held) => {
                let n = keys.len();
                self.submit(Op::GetBuffers { keys, held }, n)
            }
            Err(id) => id,
        })
    }

    fn submit_exists(&self, keys: Vec<String>) -> u64 {
        let n = keys.len();
        self.submit(Op::Exists { keys }, n)
    }

    fn submit_remove(&self, keys: Vec<String>) -> u64 {
        let n = keys.len();
        self.submit(Op::Remove { keys }, n)
    }

    /// Every completion so far, oldest first; resets the eventfd.
    fn drain(&self) -> Vec<Completion> {
        let mut state = self.shared.lock();
        let mut counter = [0u8; 8];
        // EAGAIN when nothing was signalled: nothing to reset.
        let _ = rustix::io::read(&self.shared.event, &mut counter);
        std::mem::take(&mut state.completions)
    }

    /// Batches queued or running.
    fn pending(&self) -> usize {
        let state = self.shared.lock();
        state.queue.len() + state.running
    }

    /// Wait (without the GIL) until no batch is queued or running; False on timeout.
    #[pyo3(signature = (timeout_s = 60.0))]
    fn wait_idle(&self, py: Python<'_>, timeout_s: f64) -> bool {
        let shared = &self.shared;
        let timeout = Duration::from_secs_f64(timeout_s.clamp(0.0, 86_400.0));
        py.detach(|| {
            let deadline = Instant::now() + timeout;
            let mut state = shared.lock();
            while !state.queue.is_empty() || state.running > 0 {
                let now = Instant::now();
                if now >= deadline {
                    return false;
                }
                state = shared
                    .done
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            true
        })
    }

    /// Finish running batches, fail queued ones (each gets its completion), stop the workers.
    fn close(&self, py: Python<'_>) {
        let failed: Vec<(u64, Op)> = {
            let mut state = self.shared.lock();
            if state.closed {
                return;
            }
            state.closed = true;
            let queued: Vec<_> = state.queue.drain(..).collect();
            for (id, op) in &queued {
                let n = match op {
                    Op::PutPtrs { keys, .. }
                    | Op::GetPtrs { keys, .. }
                    | Op::PutBuffers { keys, .. }
                    | Op::GetBuffers { keys, .. }
                    | Op::Exists { keys }
                    | Op::Remove { keys } => keys.len(),
                };
                let c = (
                    *id,
                    false,
                    QueueError::Closed.to_string(),
                    Some(vec![false; n]),
                );
                self.shared.complete(&mut state, c);
            }
            self.shared.work.notify_all();
            queued
        };
        drop(failed); // releases held exports with the GIL held
        let handles = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        py.detach(|| {
            for h in handles {
                // A panicked worker has nothing left to clean up.
                let _ = h.join();
            }
        });
    }

    #[getter]
    fn closed(&self) -> bool {
        self.shared.lock().closed
    }
}

impl Drop for BatchQueue {
    fn drop(&mut self) {
        // Without close(): stop the workers after the queued batches (they hold what they
        // need); do not join, the interpreter may be holding the GIL they want.
        let mut state = self.shared.lock();
        state.closed = true;
        self.shared.work.notify_all();
    }
}
