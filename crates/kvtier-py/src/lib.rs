//! `kvtier._native`: the Python face of [`kvtier_client::Client`].
//!
//! Every batch call extracts its arguments while holding the GIL, then releases it
//! (`Python::detach`) for the whole store operation, so SGLang's scheduler and I/O threads run
//! while pages move. Errors are mapped once here: configuration errors become `ValueError`
//! naming the key; per-item failures come back as `(ok_list, error_messages)` so that the
//! adapter can fail closed and log the reason. A miss is told from a failure by its type
//! (`ClientError::is_miss`, issue 28), in every mode: a bare `False` with no message.
//!
//! The wheel holds `python/kvtier` (the engine adapters and `kv_events`) and this module; the
//! test harness, benchmarks and demo live in `tools/python/kvtier_dev`, outside it.
//!
//! Floor plan (issue 28 §3; README "Architecture"): builds on the `kvtier-client` facade (with
//! `kvtier-engine` and `kvtier-proto` for their types); it links neither `kvtier-server` nor
//! `kvtier-master` (`cargo tree -p kvtier-py -e normal`).
// A named unsafe module (issue 16 lints): raw buffer addresses and fds from Python.
#![allow(unsafe_code)]

mod batch_queue; // issue 19
mod buffer_access;
mod keys; // issue 16: the key scheme
          // Issue 18: SGLang's direct linker (LinkerCore).
mod linker;
// Issue 27: Rust records into Python's `logging` (loggers under `kvtier`).
mod pylog;

use std::sync::Arc;

use kvtier_client::config::ConfigSources;
use kvtier_client::{BatchResult, Client, ClientError, KvtierConfig, MemRef, PageBatch};
use kvtier_proto::{ExistsV2Query, HitPolicy, KvComponents, PoolQuery};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use buffer_access::HeldBuffer;

type BatchReply = (Vec<bool>, Vec<String>);
/// `(kv_hit_pages, [(pool, boundary)], restorable_prefix_pages)`.
type ExistsV2Reply = (u32, Vec<(String, u32)>, Vec<u32>);

fn reply(r: BatchResult) -> BatchReply {
    let mut errors = r.errors;
    if r.suppressed_errors > 0 {
        errors.push(format!(
            "... and {} more distinct errors",
            r.suppressed_errors
        ));
    }
    (r.ok, errors)
}

// Issue 29 §3: the cluster's faults are told apart from the caller's (both stay
// RuntimeErrors for callers that catch that).
pyo3::create_exception!(
    kvtier,
    UnavailableError,
    PyRuntimeError,
    "The cluster could not serve the call (no master leads, a node is down or unreachable, no \
     node has room, a timeout); the same call may succeed later."
);
pyo3::create_exception!(
    kvtier,
    BusyError,
    PyRuntimeError,
    "Another writer is storing this object right now (its claim is not committed yet)."
);

/// One object's error text for a batch reply, naming the key once (issue 29: an object's
/// cluster error already names it, and says whether the cluster or the caller failed).
fn keyed_error(key: &str, e: &ClientError) -> String {
    match e {
        ClientError::Object { .. } => e.to_string(),
        e => format!("{key}: {e}"),
    }
}

fn map_error(e: ClientError) -> PyErr {
    match e {
        ClientError::Config(c) => PyValueError::new_err(c.to_string()),
        e if e.is_busy() => BusyError::new_err(e.to_string()),
        e if e.is_infrastructure() => UnavailableError::new_err(e.to_string()),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

fn parse_extra(extra_config_json: &str) -> PyResult<serde_json::Map<String, serde_json::Value>> {
    match serde_json::from_str::<serde_json::Value>(extra_config_json) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(serde_json::Value::Null) => Ok(Default::default()),
        Ok(_) => Err(PyValueError::new_err(
            "kvtier extra_config must be a JSON object",
        )),
        Err(e) => Err(PyValueError::new_err(format!(
            "kvtier extra_config is not JSON: {e}"
        ))),
    }
}

fn load_config(extra_config_json: &str, use_environment: bool) -> PyResult<KvtierConfig> {
    let extra = parse_extra(extra_config_json)?;
    let sources = if use_environment {
        ConfigSources::from_process(extra).map_err(|e| PyValueError::new_err(e.to_string()))?
    } else {
        ConfigSources {
            env: Vec::new(),
            extra,
        }
    };
    KvtierConfig::load(sources).map_err(|e| PyValueError::new_err(e.to_string()))
}

fn mem_refs(ptrs: &[usize], sizes: &[usize]) -> Result<Vec<MemRef>, String> {
    if ptrs.len() != sizes.len() {
        return Err(format!("{} pointers but {} sizes", ptrs.len(), sizes.len()));
    }
    Ok(ptrs
        .iter()
        .zip(sizes)
        .map(|(&ptr, &len)| MemRef { ptr, len })
        .collect())
}

/// Build a page batch and its buffers, or fail every page when the buffer lists disagree.
fn with_page_batch(
    prefix: &str,
    page_keys: &[String],
    suffixes: &[String],
    ptrs: &[usize],
    sizes: &[usize],
    call: impl FnOnce(&PageBatch<'_, String, String>, &[MemRef]) -> BatchResult,
) -> BatchReply {
    match mem_refs(ptrs, sizes) {
        Ok(bufs) => {
            let batch = PageBatch {
                prefix: prefix.as_bytes(),
                page_keys,
                suffixes,
            };
            reply(call(&batch, &bufs))
        }
        Err(e) => reply(BatchResult::all_failed(page_keys.len(), e)),
    }
}

fn hit_policy(name: &str, policy: &str, param: u32) -> PyResult<HitPolicy> {
    match policy {
        "all_pages" => Ok(HitPolicy::AllPages),
        "trailing_pages" => Ok(HitPolicy::TrailingPages { window: param }),
        "block_groups" => Ok(HitPolicy::BlockGroups { group_pages: param }),
        other => Err(PyValueError::new_err(format!(
            "pool {name}: unknown hit policy {other:?}"
        ))),
    }
}

fn bytes_list(v: Vec<String>) -> Vec<Vec<u8>> {
    v.into_iter().map(String::into_bytes).collect()
}

/// A kvtier store opened from SGLang's extra_config (JSON) plus `KVTIER_*` variables.
#[pyclass(frozen, module = "kvtier._native")]
struct Store {
    client: Arc<Client>,
}

#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (extra_config_json = "{}", use_environment = true))]
    fn new(py: Python<'_>, extra_config_json: &str, use_environment: bool) -> PyResult<Store> {
        let config = load_config(extra_config_json, use_environment)?;
        // Issue 27: open's warnings (corrupt SSD records, fallbacks) pass the gate the
        // `kvtier` logger's level sets now, not the one of a second ago.
        let _ = pylog::refresh_log_level(py);
        // Pre-faulting the arena takes a while for large capacities: do it without the GIL.
        let client = py.detach(|| Client::open(config)).map_err(map_error)?;
        Ok(Store {
            client: Arc::new(client),
        })
    }

    /// The effective configuration as TOML; raises ValueError naming a bad key.
    #[staticmethod]
    #[pyo3(signature = (extra_config_json = "{}", use_environment = true))]
    fn check_config(extra_config_json: &str, use_environment: bool) -> PyResult<String> {
        Ok(load_config(extra_config_json, use_environment)?.to_toml())
    }

    /// Every configuration key kvtier accepts.
    #[staticmethod]
    fn known_config_keys() -> Vec<String> {
        KvtierConfig::known_keys()
    }

    fn config_toml(&self) -> String {
        self.client.config().to_toml()
    }

    /// The KV-event settings (issue 16: read natively, not by re-parsing `config_toml()`):
    /// a dict of `publish_endpoint` (or None), `publish_topic`, `subscriber`, `endpoint`,
    /// `topic`, `buffer`.
    fn kv_events_settings<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.client.config();
        let d = PyDict::new(py);
        d.set_item("publish_endpoint", c.kv_events_publish_endpoint.clone())?;
        d.set_item("publish_topic", c.kv_events_publish_topic.clone())?;
        d.set_item("subscriber", c.kv_events_subscriber)?;
        d.set_item("endpoint", c.kv_events_endpoint.clone())?;
        d.set_item("topic", c.kv_events_topic.clone())?;
        d.set_item("buffer", c.kv_events_buffer)?;
        Ok(d)
    }

    /// Register `[ptr, ptr+size)` for zero-copy batches. The caller must keep that memory
    /// alive (hold the tensor) until `unregister_region` or `close`; kvtier's SGLang adapter
    /// holds every registered pool for the store's lifetime.
    fn register_region(&self, ptr: usize, size: usize, label: &str) -> PyResult<u64> {
        // SAFETY: the documented contract of this method: Python passes the storage extent of
        // a tensor it keeps alive until unregistering or closing the store.
        let id = unsafe { self.client.register_region(ptr, size, label) }.map_err(map_error)?;
        Ok(id.0)
    }

    /// Register `[ptr, ptr+size)`, which is `[fd_offset, fd_offset+size)` of the memfd `fd`
    /// (e.g. a host pool buffer from SGLang's `ShmHostTensorAllocator`). Server mode sends the
    /// memfd to the server once, which then copies pages straight into and out of this memory;
    /// embedded mode registers the range like `register_region`. Same lifetime contract as
    /// `register_region`; the descriptor is duplicated, the caller keeps its own.
    fn register_memfd(
        &self,
        py: Python<'_>,
        ptr: usize,
        size: usize,
        fd: i32,
        fd_offset: u64,
        label: &str,
    ) -> PyResult<u64> {
        if fd < 0 {
            return Err(PyValueError::new_err(format!(
                "invalid file descriptor {fd}"
            )));
        }
        // SAFETY: the caller passes a descriptor it keeps open for this call (it is duplicated
        // before use and never closed here).
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let client = &self.client;
        // SAFETY: the documented contract of this method, as for register_region.
        let id = py
            .detach(|| unsafe { client.register_memfd(ptr, size, fd, fd_offset, label) })
            .map_err(map_error)?;
        Ok(id.0)
    }

    /// `"embedded"` or `"server"`.
    #[getter]
    fn mode(&self) -> &'static str {
        self.client.mode()
    }

    /// Regions the server maps directly (0 in embedded mode).
    fn zero_copy_regions(&self) -> usize {
        self.client.zero_copy_regions()
    }

    fn unregister_region(&self, region_id: u64) -> bool {
        self.client
            .unregister_region(kvtier_client::memory::RegionId(region_id))
    }

    /// `[(id, start, size, label)]` of the registered regions.
    fn regions(&self) -> Vec<(u64, usize, usize, String)> {
        self.client
            .regions()
            .into_iter()
            .map(|r| (r.id.0, r.start, r.len, r.label))
            .collect()
    }

    /// Put `pages x components` objects from registered memory; one bool per page.
    #[pyo3(signature = (prefix, page_keys, suffixes, ptrs, sizes, depths = None))]
    #[allow(clippy::too_many_arguments)] // mirrors the Python call one to one
    fn put_pages(
        &self,
        py: Python<'_>,
        prefix: &str,
        page_keys: Vec<String>,
        suffixes: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        depths: Option<Vec<u32>>,
    ) -> BatchReply {
        let client = &self.client;
        py.detach(|| {
            with_page_batch(
                prefix,
                &page_keys,
                &suffixes,
                &ptrs,
                &sizes,
                |batch, bufs| client.put_pages(batch, bufs, depths.as_deref()),
            )
        })
    }

    /// Get `pages x components` objects into registered memory; one bool per page.
    fn get_pages(
        &self,
        py: Python<'_>,
        prefix: &str,
        page_keys: Vec<String>,
        suffixes: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> BatchReply {
        let client = &self.client;
        py.detach(|| {
            with_page_batch(
                prefix,
                &page_keys,
                &suffixes,
                &ptrs,
                &sizes,
                |batch, bufs| client.get_pages(batch, bufs),
            )
        })
    }

    /// Put whole keys from registered memory; one bool per key.
    #[pyo3(signature = (keys, ptrs, sizes, depths = None))]
    fn put_keys(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        depths: Option<Vec<u32>>,
    ) -> BatchReply {
        let client = &self.client;
        py.detach(|| match mem_refs(&ptrs, &sizes) {
            Ok(bufs) => reply(client.put_keys(&keys, &bufs, depths.as_deref())),
            Err(e) => reply(BatchResult::all_failed(keys.len(), e)),
        })
    }

    /// Get whole keys into registered memory; one bool per key.
    fn get_keys(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> BatchReply {
        let client = &self.client;
        py.detach(|| match mem_refs(&ptrs, &sizes) {
            Ok(bufs) => reply(client.get_keys(&keys, &bufs)),
            Err(e) => reply(BatchResult::all_failed(keys.len(), e)),
        })
    }

    /// Put objects from buffer-protocol objects (contiguous uint8 views); one bool per key.
    #[pyo3(signature = (keys, buffers, depths = None))]
    fn put_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffers: Vec<Bound<'_, PyAny>>,
        depths: Option<Vec<u32>>,
    ) -> PyResult<BatchReply> {
        if keys.len() != buffers.len() || depths.as_ref().is_some_and(|d| d.len() != keys.len()) {
            return Ok(reply(BatchResult::all_failed(
                keys.len(),
                format!(
                    "{} keys, {} buffers, {:?} depths",
                    keys.len(),
                    buffers.len(),
                    depths.as_ref().map(Vec::len)
                ),
            )));
        }
        let held = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| HeldBuffer::take(b, false, &format!("buffer {i}")))
            .collect::<PyResult<Vec<_>>>()?;
        let client = &self.client;
        Ok(py.detach(|| {
            let mut result = BatchResult::with_capacity(keys.len());
            for (i, (key, buf)) in keys.iter().zip(&held).enumerate() {
                let depth = depths.as_ref().map(|d| d[i]);
                match client.put_slice(key.as_bytes(), buf.as_bytes(), depth) {
                    Ok(_) => result.ok.push(true),
                    Err(e) => {
                        result.note_error(keyed_error(key, &e));
                        result.ok.push(false);
                    }
                }
            }
            reply(result)
        }))
    }

    /// Get objects into writable buffer-protocol objects; one bool per key.
    fn get_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffers: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<BatchReply> {
        if keys.len() != buffers.len() {
            return Ok(reply(BatchResult::all_failed(
                keys.len(),
                format!("{} keys but {} buffers", keys.len(), buffers.len()),
            )));
        }
        let held = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| HeldBuffer::take(b, true, &format!("buffer {i}")))
            .collect::<PyResult<Vec<_>>>()?;
        let client = &self.client;
        Ok(py.detach(|| {
            let mut result = BatchResult::with_capacity(keys.len());
            for (key, buf) in keys.iter().zip(&held) {
                match client.get_into_slice(key.as_bytes(), buf.as_bytes_mut()) {
                    Ok(()) => result.push_ok(),
                    // Issue 28: a miss (typed, in every mode) is the key's False, no message.
                    Err(e) if e.is_miss() => result.push_failed(e.item_failure()),
                    Err(e) => {
                        result.note_error(keyed_error(key, &e));
                        result.push_failed(e.item_failure());
                    }
                }
            }
            reply(result)
        }))
    }

    fn exists_keys(&self, py: Python<'_>, keys: Vec<String>) -> Vec<bool> {
        let client = &self.client;
        py.detach(|| client.exists_keys(&keys))
    }

    /// Leading pages whose every component exists.
    fn exists_pages_prefix(
        &self,
        py: Python<'_>,
        prefix: &str,
        page_keys: Vec<String>,
        suffixes: Vec<String>,
    ) -> usize {
        let client = &self.client;
        py.detach(|| {
            let batch = PageBatch {
                prefix: prefix.as_bytes(),
                page_keys: &page_keys,
                suffixes: &suffixes,
            };
            client.exists_pages_prefix(&batch)
        })
    }

    /// Eviction hint: every component of these pages is superseded window state (a longer
    /// restorable chain continues them). Returns how many stored objects were marked.
    fn demote_pages(
        &self,
        py: Python<'_>,
        prefix: &str,
        page_keys: Vec<String>,
        suffixes: Vec<String>,
    ) -> usize {
        let client = &self.client;
        py.detach(|| {
            let batch = PageBatch {
                prefix: prefix.as_bytes(),
                page_keys: &page_keys,
                suffixes: &suffixes,
            };
            client.demote_pages(&batch)
        })
    }

    /// One v2 existence query. `kv_suffixes=None` is a logical anchor. `pools` is a list of
    /// `(name, suffixes, policy, param)` with policy `all_pages`, `trailing_pages` (param =
    /// window) or `block_groups` (param = group pages). Returns
    /// `(kv_hit_pages, [(pool, boundary)], restorable_prefix_pages)`.
    fn exists_v2(
        &self,
        py: Python<'_>,
        prefix: &str,
        page_keys: Vec<String>,
        kv_suffixes: Option<Vec<String>>,
        pools: Vec<(String, Vec<String>, String, u32)>,
    ) -> PyResult<ExistsV2Reply> {
        let pools = pools
            .into_iter()
            .map(|(name, suffixes, policy, param)| {
                let policy = hit_policy(&name, &policy, param)?;
                Ok(PoolQuery {
                    name,
                    suffixes: bytes_list(suffixes),
                    policy,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let query = ExistsV2Query {
            key_prefix: prefix.as_bytes().to_vec(),
            page_keys: bytes_list(page_keys),
            kv: kv_suffixes.map_or(KvComponents::Logical, |s| {
                KvComponents::Suffixes(bytes_list(s))
            }),
            pools,
        };
        let client = &self.client;
        let answer = py.detach(|| client.exists_v2(&query));
        Ok((
            answer.kv_hit_pages,
            answer.pool_hit_pages,
            answer.restorable_prefix_pages,
        ))
    }

    fn object_len(&self, key: &str) -> Option<u64> {
        self.client.object_len(key.as_bytes())
    }

    fn remove_keys(&self, py: Python<'_>, keys: Vec<String>) -> usize {
        let client = &self.client;
        py.detach(|| client.remove_keys(&keys))
    }

    fn clear(&self, py: Python<'_>) {
        let client = &self.client;
        py.detach(|| client.clear())
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let client = &self.client;
        py.detach(|| client.flush()).map_err(map_error)
    }

    fn close(&self) {
        self.client.close()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.client.is_closed()
    }

    /// Start recording page-group events (embedded mode) into a ring of `capacity` events.
    /// Returns False in server mode (the events happen in the server's engine).
    fn enable_events(&self, capacity: usize) -> bool {
        self.client.enable_events(capacity)
    }

    /// `enable_events`, and with the SSD tier on also its `ssd_stored` / `ssd_removed` events
    /// (issue 30: the vLLM tier reports each block's medium). False in server mode.
    fn enable_media_events(&self, capacity: usize) -> bool {
        self.client.enable_media_events(capacity)
    }

    /// Where `key` is in this process's engine: `(dram bytes, ssd bytes)`, each None where
    /// absent; None in server mode. No stats or recency side effects.
    fn placement(&self, key: &str) -> Option<(Option<u64>, Option<u64>)> {
        self.client
            .placement(key.as_bytes())
            .map(|p| (p.dram_len, p.ssd_len))
    }

    /// Take up to `max` of the oldest events: `([(seq, kind, group, depth)], dropped_total,
    /// pending)`, `kind` one of `stored`, `evicted`, `removed`, `cleared` (and `ssd_stored`,
    /// `ssd_removed` after `enable_media_events`), `group` the page
    /// group (`[tag/]page_hash@`; bytes that are not UTF-8 are replaced). Empty in server
    /// mode.
    #[allow(clippy::type_complexity)] // the tuple is the Python-facing shape
    fn drain_events(
        &self,
        py: Python<'_>,
        max: usize,
    ) -> (Vec<(u64, &'static str, String, Option<u32>)>, u64, usize) {
        let client = &self.client;
        let drained = py.detach(|| client.drain_events(max));
        let Some(d) = drained else {
            return (Vec::new(), 0, 0);
        };
        let events = d
            .events
            .into_iter()
            .map(|ev| {
                (
                    ev.seq,
                    ev.kind.as_str(),
                    String::from_utf8_lossy(&ev.group).into_owned(),
                    ev.depth,
                )
            })
            .collect();
        (events, d.dropped_total, d.pending)
    }

    /// `(groups evicted whole, groups tracked)` of the DRAM tier (embedded mode; `None` in
    /// server mode).
    fn group_stats(&self) -> Option<(u64, u64)> {
        self.client.group_stats()
    }

    /// Refresh the recency of each key's page group (an eviction hint); returns how many keys
    /// were in DRAM (0 in server mode).
    fn touch_keys(&self, py: Python<'_>, keys: Vec<String>) -> usize {
        let client = &self.client;
        py.detach(|| client.touch_keys(&keys))
    }

    /// Refresh the recency of each page group (`[tag/]page_hash@`) in DRAM, an eviction hint
    /// for callers that know pages, not keys (SGLang's KV events); returns how many groups
    /// were in DRAM (0 in server mode).
    fn touch_groups(&self, py: Python<'_>, groups: Vec<String>) -> usize {
        let client = &self.client;
        py.detach(|| client.touch_groups(&groups))
    }

    /// Counters as a dict of int.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dict = PyDict::new(py);
        let client = &self.client;
        let stats = py.detach(|| client.stats_json());
        if let serde_json::Value::Object(map) = stats {
            for (k, v) in map {
                match v {
                    serde_json::Value::Number(n) => {
                        if let Some(u) = n.as_u64() {
                            dict.set_item(k, u)?;
                        } else if let Some(f) = n.as_f64() {
                            dict.set_item(k, f)?;
                        }
                    }
                    serde_json::Value::Bool(b) => dict.set_item(k, b)?,
                    serde_json::Value::String(s) => dict.set_item(k, s)?,
                    _ => {}
                }
            }
        }
        Ok(dict)
    }

    /// Issue 17: the client's whole stats document as JSON text. `stats()` keeps the scalar
    /// counters only; this one also carries the lists, e.g. `peer_transports` (the data
    /// transport in use per peer), so a Python caller can tell UCX reads from frames.
    fn stats_json(&self, py: Python<'_>) -> String {
        let client = &self.client;
        py.detach(|| client.stats_json()).to_string()
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Store>()?;
    keys::register(m)?; // issue 16
    m.add_class::<linker::LinkerCore>()?; // issue 18
    m.add_class::<batch_queue::BatchQueue>()?; // issue 19
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("UnavailableError", m.py().get_type::<UnavailableError>())?; // issue 29
    m.add("BusyError", m.py().get_type::<BusyError>())?; // issue 29
                                                         // Issue 27: Rust's records reach `logging` under `kvtier`.
    pylog::install(m.py());
    m.add_function(wrap_pyfunction!(pylog::refresh_log_level, m)?)?;
    m.add_function(wrap_pyfunction!(pylog::flush_logs, m)?)?;
    m.add_function(wrap_pyfunction!(pylog::log_records_dropped, m)?)?;
    Ok(())
}
