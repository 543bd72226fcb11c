//! Prometheus metrics: the process-wide recorder, the `/metrics` HTTP endpoint, scrape-time
//! collectors, and the name of every kvtier metric.
//!
//! Owns:
//! - the global [`metrics`] recorder (a `metrics-exporter-prometheus` recorder, installed once
//!   per process by the first [`serve`]); anything in the process that records through the
//!   `metrics` macros (`metrics::counter!(...)`) shows up on every kvtier endpoint;
//! - the endpoints ([`serve`], in `endpoint.rs`): a small HTTP/1.1 listener per address that
//!   answers `GET /metrics`, `/healthz` and `/readyz`, with a handler per connection, a
//!   whole-request deadline and a connection bound. It is kvtier's own rather than the
//!   exporter's `http-listener` (hyper + tokio) because an operator needs the bound address of
//!   `HOST:0`, a port in use must fail when the store opens (not later in a background task),
//!   and tier gauges are refreshed from the engines at scrape time, so a scrape is exact;
//! - the scrape-time [`Collector`]s (embedded clients, `kvtier serve`), whose samples are summed
//!   per label set, and [`engine_samples`], the one mapping of [`EngineStats`] to metrics;
//! - [`ClientMetrics`], the hot-path handles a `Client` (`kvtier-client`) records into
//!   (request latency per operation, page hits and misses per pool).
//!
//! Naming: `kvtier_<subsystem>_<what>_<unit>`, counters end in `_total`, sizes in `_bytes`,
//! durations in `_seconds`. Labels: `store` (an engine: `default` or the `extra_backend_tag` in
//! embedded mode; `main` / `tenant:<name>` in `kvtier serve`), `tier` (`dram`, `ssd`), `op`,
//! `pool`, `tenant`. A later `kvtier master` and the peer data path fit the same scheme: call
//! [`serve`] with the master's address and record `kvtier_master_*` metrics and
//! [`names::PEER_TRANSFER_BYTES`]`{peer, direction="in"|"out"}` with the `metrics` macros; a
//! component with a snapshot to publish registers a [`Collector`].

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use kvtier_engine::EngineStats;
use metrics::{Counter, Histogram, Label};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use parking_lot::{Mutex, RwLock};

mod endpoint;
pub use endpoint::{
    readiness, register_readiness, serve, Endpoint, Readiness, ReadyGate, MAX_CONNECTIONS,
    REQUEST_DEADLINE, RESPONSE_DEADLINE,
};

/// Every metric name kvtier publishes.
pub mod names {
    /// Gauge `{store, tier}`: objects held.
    pub const OBJECTS: &str = "kvtier_objects";
    /// Gauge `{store, tier}`: logical bytes of the objects held.
    pub const STORED_BYTES: &str = "kvtier_stored_bytes";
    /// Gauge `{store, tier}`: bytes taken (DRAM blocks; SSD records with headers and padding).
    pub const ALLOCATED_BYTES: &str = "kvtier_allocated_bytes";
    /// Gauge `{store, tier}`: capacity.
    pub const CAPACITY_BYTES: &str = "kvtier_capacity_bytes";
    /// Counter `{store, tier}`: reads served (an SSD hit was a DRAM miss).
    pub const HITS: &str = "kvtier_hits_total";
    /// Counter `{store}`: reads of absent objects.
    pub const MISSES: &str = "kvtier_misses_total";
    /// Counter `{store}`: puts that stored a new object.
    pub const PUTS: &str = "kvtier_puts_total";
    /// Counter `{store}`: puts of a key already present (no copy).
    pub const DEDUP_SKIPS: &str = "kvtier_dedup_skips_total";
    /// Counter `{store}`: puts that failed (no space, too large, ...).
    pub const PUT_FAILURES: &str = "kvtier_put_failures_total";
    /// Counter `{store}`: reads refused because the destination size differed.
    pub const SIZE_MISMATCHES: &str = "kvtier_size_mismatches_total";
    /// Counter `{store, tier, reason}`: objects dropped; `reason` is `capacity` (made room) or
    /// `removed` (remove / clear).
    pub const EVICTIONS: &str = "kvtier_evictions_total";
    /// Counter `{store, tier}`: logical bytes evicted to make room.
    pub const EVICTED_BYTES: &str = "kvtier_evicted_bytes_total";
    /// Counter `{store}`: bytes copied into the store by puts.
    pub const BYTES_IN: &str = "kvtier_bytes_in_total";
    /// Counter `{store}`: bytes copied out of the store by reads.
    pub const BYTES_OUT: &str = "kvtier_bytes_out_total";
    /// Counter `{store, direction}`: SSD payload bytes written / read.
    pub const SSD_IO_BYTES: &str = "kvtier_ssd_io_bytes_total";
    /// Counter `{store, kind}`: SSD errors; `kind` is `read`, `write`, `checksum` or `enospc`.
    pub const SSD_ERRORS: &str = "kvtier_ssd_errors_total";
    /// Gauge `{store}`: 1 while the last SSD write or sync failed.
    pub const SSD_DEGRADED: &str = "kvtier_ssd_degraded";
    /// Counter `{store}`: copies to SSD that were not made.
    pub const SSD_COPIES_DROPPED: &str = "kvtier_ssd_copies_dropped_total";
    /// Gauge `{store}`: copies queued or being written.
    pub const SSD_COPY_QUEUE_DEPTH: &str = "kvtier_ssd_copy_queue_depth";
    /// Gauge `{store}`: age of the oldest copy still queued (0 when the queue is empty).
    pub const SSD_COPY_LAG: &str = "kvtier_ssd_copy_lag_seconds";
    /// Counter `{store}`: puts that waited for room in the copy queue.
    pub const SSD_QUEUE_FULL_WAITS: &str = "kvtier_ssd_queue_full_waits_total";
    /// Counter `{store}`: SSD hits copied back into DRAM.
    pub const SSD_PROMOTIONS: &str = "kvtier_ssd_promotions_total";
    /// Histogram `{op}`: latency of one store call (a whole batch).
    pub const REQUEST_DURATION: &str = "kvtier_request_duration_seconds";
    /// Counter `{pool, op}`: pages found; `op` is `get` (copied) or `exists` (existence
    /// queries, where SGLang decides what to prefetch).
    pub const POOL_HITS: &str = "kvtier_pool_hits_total";
    /// Counter `{pool, op}`: pages asked for and not found.
    pub const POOL_MISSES: &str = "kvtier_pool_misses_total";
    /// Gauge: kvtier serve's open connections / sessions.
    pub const SERVER_CONNECTIONS: &str = "kvtier_server_connections";
    pub const SERVER_SESSIONS: &str = "kvtier_server_sessions";
    /// Gauge: bytes of client memory kvtier serve has mapped.
    pub const SERVER_MAPPED_BYTES: &str = "kvtier_server_mapped_bytes";
    /// Counter: requests kvtier serve answered; malformed frames it got.
    pub const SERVER_REQUESTS: &str = "kvtier_server_requests_total";
    pub const SERVER_MALFORMED_FRAMES: &str = "kvtier_server_malformed_frames_total";
    /// Counter `{tenant, direction}`: page bytes moved for a tenant by kvtier serve.
    pub const TENANT_BYTES: &str = "kvtier_tenant_bytes_total";
    /// Counter `{tenant, op}`: pages a tenant stored (`put`) or read (`get`).
    pub const TENANT_PAGES: &str = "kvtier_tenant_pages_total";
    /// The peer data path's names (`PEER_TRANSFER_BYTES`, `PEER_TRANSPORT`) are declared by
    /// the transport that records them.
    pub use kvtier_transport::names::{PEER_TRANSFER_BYTES, PEER_TRANSPORT};
    /// Counter `{peer}`: objects a cluster client read whose bytes failed their end-to-end
    /// checksum (each a miss, never a hit).
    pub const CLUSTER_INTEGRITY_FAILURES: &str = "kvtier_cluster_integrity_failures_total";
    /// Counter `{reason}`: connections a node's data port refused or cut before they proved
    /// the cluster token (`unauthorized`, `hello_timeout`, `too_many_unauthenticated`,
    /// `too_many_connections`).
    pub const DATA_PORT_REFUSED: &str = "kvtier_data_port_refused_total";
    /// Counter `{op}`: requests a node's data port refused because they named a key (or a
    /// clear prefix) outside the cluster namespace, e.g. a local tenant's (issue 26).
    pub const DATA_PORT_OUTSIDE_NAMESPACE: &str = "kvtier_data_port_outside_namespace_total";
    /// Gauge: 1 when the scrape reached this `kvtier master`'s RPC port.
    pub const MASTER_UP: &str = "kvtier_master_up";
    /// Gauge: 1 while this master leads (single-master mode: always).
    pub const MASTER_IS_LEADER: &str = "kvtier_master_is_leader";
    /// Gauge: objects in the leader's key directory.
    pub const MASTER_OBJECTS: &str = "kvtier_master_objects";
    /// Gauge `{state}`: registered nodes, `alive` (lease current) or `down`.
    pub const MASTER_NODES: &str = "kvtier_master_nodes";
    /// Gauge: capacity / free bytes the live nodes reported, summed (the leader only).
    pub const MASTER_CLUSTER_CAPACITY_BYTES: &str = "kvtier_master_cluster_capacity_bytes";
    pub const MASTER_CLUSTER_FREE_BYTES: &str = "kvtier_master_cluster_free_bytes";
    /// Gauge: the lowest free / capacity ratio among the live nodes (the leader only).
    pub const MASTER_NODE_FREE_RATIO_MIN: &str = "kvtier_master_node_free_ratio_min";
    /// Gauge `{node}`: capacity / free bytes a node reported; published only with
    /// `kvtier master --metrics-node-ids` (node ids name data addresses).
    pub const MASTER_NODE_CAPACITY_BYTES: &str = "kvtier_master_node_capacity_bytes";
    pub const MASTER_NODE_FREE_BYTES: &str = "kvtier_master_node_free_bytes";
    /// Histogram `{rpc}`: latency of one master RPC as its handler saw it.
    pub const MASTER_RPC_DURATION: &str = "kvtier_master_rpc_duration_seconds";
    /// Counter `{outcome}`: re-replication copy tasks (one object each) of this master:
    /// `issued` (handed to a holder), `done` (the target committed as a replica), `failed`
    /// (timed out, or its holder or target was dropped; planned again while a holder is
    /// left), `dropped` (no live holder left, or the key was forgotten).
    pub const MASTER_REREPLICATION_TASKS: &str = "kvtier_master_rereplication_tasks_total";
    /// Gauge: re-replication tasks planned or handed out and not finished.
    pub const MASTER_REREPLICATION_IN_FLIGHT: &str = "kvtier_master_rereplication_in_flight";
    /// Gauge: under-replicated objects the last planning pass found no target node for.
    pub const MASTER_REREPLICATION_NO_TARGET: &str = "kvtier_master_rereplication_no_target";
    /// Counter `{outcome}`: re-replication copy tasks (one object each) a node got from the
    /// master: `received`, `done` (pushed to the target and committed), `failed`.
    pub const NODE_REREPLICATION_TASKS: &str = "kvtier_node_rereplication_tasks_total";
    /// Counter `{reason}`: a node's failed copy tasks: `not_held` (evicted since, or not in
    /// its store), `push` (the target refused or was unreachable), `commit` (the master did
    /// not commit it), `busy` (the worker was still on earlier tasks).
    pub const NODE_REREPLICATION_FAILURES: &str = "kvtier_node_rereplication_failures_total";
}

/// Upper bounds of the `_seconds` histograms: 10 us to 10 s.
const DURATION_BUCKETS: [f64; 19] = [
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
];
/// Most distinct `pool` label values one process publishes; later ones count as `other`.
const MAX_POOL_LABELS: usize = 64;

/// Errors setting up metrics.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("metrics_addr {addr:?}: {reason}")]
    InvalidAddr { addr: String, reason: String },
    #[error("metrics_addr {addr}: cannot listen: {source}")]
    Bind {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error(
        "another metrics recorder is installed in this process; kvtier cannot publish its metrics"
    )]
    RecorderTaken,
}

/// Parse a metrics address: an IP address and a port (`127.0.0.1:9100`, `[::1]:9100`,
/// `0.0.0.0:0`), `localhost:PORT`, or a bare port (`9100`, `:9100`), which means loopback
/// (`127.0.0.1`): the endpoint listens beyond this host only where the operator names an
/// interface. Host names are not resolved (no DNS lookup at startup).
pub fn parse_addr(text: &str) -> Result<SocketAddr, String> {
    let t = text.trim();
    if let Ok(addr) = t.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let bare = t.strip_prefix(':').unwrap_or(t);
    if !bare.is_empty() && bare.bytes().all(|b| b.is_ascii_digit()) {
        let port: u16 = bare
            .parse()
            .map_err(|_| format!("{t:?}: the port must be a number from 0 to 65535"))?;
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    let (host, port) = t
        .rsplit_once(':')
        .ok_or_else(|| format!("{t:?} is not HOST:PORT (e.g. 127.0.0.1:9100)"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{t:?}: the port must be a number from 0 to 65535"))?;
    if host.eq_ignore_ascii_case("localhost") {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    Err(format!(
        "{t:?}: the host must be an IP address or localhost (e.g. 127.0.0.1:9100)"
    ))
}

/// A source of samples read at scrape time.
pub trait Collector: Send + Sync {
    fn collect(&self, out: &mut Samples);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
}

/// A metric name and its labels.
type Series = (&'static str, Vec<(&'static str, String)>);

/// Samples gathered for one scrape; equal (name, labels) from several collectors are summed.
#[derive(Default)]
pub struct Samples {
    values: BTreeMap<Series, (Kind, f64)>,
}

impl Samples {
    fn add(&mut self, kind: Kind, name: &'static str, labels: &[(&'static str, &str)], v: f64) {
        let labels = labels.iter().map(|(k, v)| (*k, v.to_string())).collect();
        let slot = self.values.entry((name, labels)).or_insert((kind, 0.0));
        slot.1 += v;
    }

    /// A cumulative count (published as a Prometheus counter).
    pub fn counter(&mut self, name: &'static str, labels: &[(&'static str, &str)], v: u64) {
        self.add(Kind::Counter, name, labels, v as f64);
    }

    /// A current value.
    pub fn gauge(&mut self, name: &'static str, labels: &[(&'static str, &str)], v: f64) {
        self.add(Kind::Gauge, name, labels, v);
    }

    fn publish(self) {
        for ((name, labels), (kind, v)) in self.values {
            let labels: Vec<Label> = labels.into_iter().map(|(k, v)| Label::new(k, v)).collect();
            match kind {
                Kind::Counter => metrics::counter!(name, labels).absolute(v as u64),
                Kind::Gauge => metrics::gauge!(name, labels).set(v),
            }
        }
    }
}

/// The one mapping of an engine's stats to metrics, labelled `store`.
pub fn engine_samples(store: &str, s: &EngineStats, out: &mut Samples) {
    let dram = [("store", store), ("tier", "dram")];
    let ssd = [("store", store), ("tier", "ssd")];
    let st = [("store", store)];
    out.gauge(names::OBJECTS, &dram, s.objects as f64);
    out.gauge(names::STORED_BYTES, &dram, s.bytes_used as f64);
    out.gauge(names::ALLOCATED_BYTES, &dram, s.bytes_allocated as f64);
    out.gauge(names::CAPACITY_BYTES, &dram, s.capacity_bytes as f64);
    out.counter(names::HITS, &dram, s.hits.saturating_sub(s.ssd_hits));
    out.counter(names::MISSES, &st, s.misses);
    out.counter(names::PUTS, &st, s.puts);
    out.counter(names::DEDUP_SKIPS, &st, s.dedup_skips);
    out.counter(names::PUT_FAILURES, &st, s.put_failures);
    out.counter(names::SIZE_MISMATCHES, &st, s.size_mismatches);
    let reason = |tier: &'static str, reason: &'static str| {
        [("store", store), ("tier", tier), ("reason", reason)]
    };
    out.counter(
        names::EVICTIONS,
        &reason("dram", "capacity"),
        s.evictions_capacity,
    );
    out.counter(
        names::EVICTIONS,
        &reason("dram", "removed"),
        s.evictions_removed,
    );
    out.counter(
        names::EVICTIONS,
        &reason("dram", "superseded"),
        s.evictions_superseded,
    );
    out.counter(names::EVICTED_BYTES, &dram, s.evicted_bytes);
    out.counter(names::BYTES_IN, &st, s.bytes_in);
    out.counter(names::BYTES_OUT, &st, s.bytes_out);
    if !s.ssd_enabled {
        return;
    }
    out.gauge(names::OBJECTS, &ssd, s.ssd_objects as f64);
    out.gauge(names::STORED_BYTES, &ssd, s.ssd_bytes_used as f64);
    out.gauge(names::ALLOCATED_BYTES, &ssd, s.ssd_bytes_allocated as f64);
    out.gauge(names::CAPACITY_BYTES, &ssd, s.ssd_capacity_bytes as f64);
    out.counter(names::HITS, &ssd, s.ssd_hits);
    out.counter(
        names::EVICTIONS,
        &reason("ssd", "capacity"),
        s.ssd_evicted_objects,
    );
    out.counter(names::EVICTIONS, &reason("ssd", "removed"), s.ssd_removed);
    let io = |direction: &'static str| [("store", store), ("direction", direction)];
    out.counter(names::SSD_IO_BYTES, &io("write"), s.ssd_write_bytes);
    out.counter(names::SSD_IO_BYTES, &io("read"), s.ssd_read_bytes);
    for (kind, v) in [
        ("read", s.ssd_read_errors),
        ("write", s.ssd_write_errors),
        ("checksum", s.ssd_checksum_failures),
        ("enospc", s.ssd_enospc_errors),
    ] {
        out.counter(names::SSD_ERRORS, &[("store", store), ("kind", kind)], v);
    }
    out.gauge(
        names::SSD_DEGRADED,
        &st,
        f64::from(u8::from(s.ssd_degraded)),
    );
    out.counter(names::SSD_COPIES_DROPPED, &st, s.ssd_copies_dropped);
    out.gauge(
        names::SSD_COPY_QUEUE_DEPTH,
        &st,
        s.ssd_copy_queue_depth as f64,
    );
    out.gauge(names::SSD_COPY_LAG, &st, s.ssd_copy_lag_seconds);
    out.counter(names::SSD_QUEUE_FULL_WAITS, &st, s.ssd_queue_full_waits);
    out.counter(names::SSD_PROMOTIONS, &st, s.ssd_promotions);
}

struct Global {
    handle: PrometheusHandle,
    collectors: Mutex<Vec<Weak<dyn Collector>>>,
    endpoints: Mutex<HashMap<String, Arc<Endpoint>>>,
}

static GLOBAL: OnceLock<Option<Global>> = OnceLock::new();

fn global() -> Result<&'static Global, MetricsError> {
    GLOBAL
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &DURATION_BUCKETS)
                .ok()?
                .build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            Some(Global {
                handle,
                collectors: Mutex::new(Vec::new()),
                endpoints: Mutex::new(HashMap::new()),
            })
        })
        .as_ref()
        .ok_or(MetricsError::RecorderTaken)
}

/// Whether this process publishes metrics (an endpoint was started).
pub fn enabled() -> bool {
    matches!(GLOBAL.get(), Some(Some(_)))
}

/// Add a scrape-time collector; it is dropped from the list once `collector` is gone.
pub fn register_collector(collector: Weak<dyn Collector>) {
    if let Ok(g) = global() {
        g.collectors.lock().push(collector);
    }
}

/// Run every live collector and render the whole registry in the Prometheus text format.
pub fn render() -> Result<String, MetricsError> {
    let g = global()?;
    let live: Vec<Arc<dyn Collector>> = {
        let mut list = g.collectors.lock();
        list.retain(|c| c.strong_count() > 0);
        list.iter().filter_map(Weak::upgrade).collect()
    };
    let mut samples = Samples::default();
    for c in &live {
        c.collect(&mut samples);
    }
    samples.publish();
    g.handle.run_upkeep();
    Ok(g.handle.render())
}

/// Store operations timed by [`names::REQUEST_DURATION`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Put,
    Get,
    Exists,
    ExistsV2,
    Remove,
    Clear,
    Flush,
}

impl Op {
    pub const ALL: [Op; 7] = [
        Op::Put,
        Op::Get,
        Op::Exists,
        Op::ExistsV2,
        Op::Remove,
        Op::Clear,
        Op::Flush,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::Get => "get",
            Op::Exists => "exists",
            Op::ExistsV2 => "exists_v2",
            Op::Remove => "remove",
            Op::Clear => "clear",
            Op::Flush => "flush",
        }
    }
}

/// Which lookups a pool counter belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    Get,
    Exists,
}

struct PoolCounters {
    get: (Counter, Counter),
    exists: (Counter, Counter),
}

impl PoolCounters {
    fn new(pool: &str) -> PoolCounters {
        let pair = |op: &'static str| {
            (
                metrics::counter!(names::POOL_HITS, "pool" => pool.to_string(), "op" => op),
                metrics::counter!(names::POOL_MISSES, "pool" => pool.to_string(), "op" => op),
            )
        };
        PoolCounters {
            get: pair("get"),
            exists: pair("exists"),
        }
    }
}

/// The hot-path handles one client records into (resolved once, so recording is an atomic add).
pub struct ClientMetrics {
    durations: [Histogram; Op::ALL.len()],
    pools: RwLock<HashMap<String, Arc<PoolCounters>>>,
}

impl std::fmt::Debug for ClientMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientMetrics").finish_non_exhaustive()
    }
}

impl Default for ClientMetrics {
    fn default() -> Self {
        ClientMetrics::new()
    }
}

impl ClientMetrics {
    pub fn new() -> ClientMetrics {
        ClientMetrics {
            durations: Op::ALL
                .map(|op| metrics::histogram!(names::REQUEST_DURATION, "op" => op.label())),
            pools: RwLock::new(HashMap::new()),
        }
    }

    /// Record one call of `op` that started at `start`.
    pub fn observe(&self, op: Op, start: Instant) {
        self.durations[op as usize].record(start.elapsed().as_secs_f64());
    }

    /// Count `hits` pages found and `misses` not found in `pool`.
    pub fn pool(&self, pool: &str, lookup: Lookup, hits: u64, misses: u64) {
        let found = self.pools.read().get(pool).cloned();
        let counters = match found {
            Some(c) => c,
            None => {
                let mut pools = self.pools.write();
                let name = if pools.len() >= MAX_POOL_LABELS && !pools.contains_key(pool) {
                    "other"
                } else {
                    pool
                };
                Arc::clone(
                    pools
                        .entry(name.to_string())
                        .or_insert_with(|| Arc::new(PoolCounters::new(name))),
                )
            }
        };
        let (h, m) = match lookup {
            Lookup::Get => &counters.get,
            Lookup::Exists => &counters.exists,
        };
        h.increment(hits);
        m.increment(misses);
    }
}

/// The pool a key component suffix belongs to (`kv`, a side pool's name, or `other`); works
/// on a suffix (`@fp.tp0.k`) or a whole key. The key scheme lives in `kvtier_proto::keys`
/// (issue 16); `pool_label` bounds a pool name to a label value.
pub use kvtier_proto::keys::{pool_label, pool_of};

/// The pool of a page batch: that of its suffixes when they agree (`mixed` when they do
/// not); for whole-key batches (empty suffixes), that of the first key.
pub fn pool_of_batch<'a, K: AsRef<[u8]>, S: AsRef<[u8]>>(
    page_keys: &'a [K],
    suffixes: &'a [S],
) -> &'a str {
    if suffixes.iter().all(|s| s.as_ref().is_empty()) {
        return page_keys.first().map_or("other", |k| pool_of(k.as_ref()));
    }
    let mut pools = suffixes.iter().map(|s| pool_of(s.as_ref()));
    let Some(first) = pools.next() else {
        return "other";
    };
    if pools.all(|p| p == first) {
        first
    } else {
        "mixed"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_follow_the_key_scheme() {
        for (key, pool) in [
            ("@0123456789ab.tp0.k", "kv"),
            ("tag/abc@0123456789ab.v", "kv"),
            ("abc@0123456789ab.kv", "kv"),
            ("abc@0123456789ab.tp1.pp2.page", "kv"),
            ("abc@0123456789ab.c3", "kv"),
            ("abc@0123456789ab.swa.k", "swa"),
            ("abc@0123456789ab.tp0.swa.page", "swa"),
            ("abc@0123456789ab.tp3.mamba.conv0", "mamba"),
            ("abc@0123456789ab.deepseek_v4_c4", "deepseek_v4_c4"),
            ("abc@0123456789ab.cp2.dcp2.indexer", "indexer"),
            ("plain-key", "other"),
            ("abc@nothex.k", "other"),
            ("abc@0123456789ab.tp0", "other"),
            ("abc@0123456789ab.we ird", "other"),
        ] {
            assert_eq!(pool_of(key.as_bytes()), pool, "{key}");
        }
        let none: [&str; 0] = [];
        assert_eq!(pool_of_batch(&["h"], &["@0a.k", "@0a.v"]), "kv");
        assert_eq!(pool_of_batch(&["h"], &["@0a.k", "@0a.swa.k"]), "mixed");
        assert_eq!(pool_of_batch(&["h@0a.swa"], &[""]), "swa");
        assert_eq!(pool_of_batch(&none, &[""]), "other");
        assert_eq!(pool_of_batch(&["h"], &none), "other");
    }

    #[test]
    fn addresses_are_checked() {
        assert_eq!(
            parse_addr("127.0.0.1:9100").unwrap(),
            "127.0.0.1:9100".parse().unwrap()
        );
        assert_eq!(parse_addr("[::1]:0").unwrap().port(), 0);
        assert_eq!(parse_addr("localhost:9100").unwrap().port(), 9100);
        // A bare port is loopback, never every interface.
        for port_only in ["9100", ":9100", " 9100 "] {
            assert_eq!(
                parse_addr(port_only).unwrap(),
                "127.0.0.1:9100".parse().unwrap()
            );
        }
        for bad in [
            "",
            "127.0.0.1",
            "127.0.0.1:65536",
            "127.0.0.1:x",
            "99999",
            ":",
            "host:9100",
        ] {
            assert!(parse_addr(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn samples_sum_per_label_set() {
        let mut s = Samples::default();
        s.counter(names::PUTS, &[("store", "a")], 2);
        s.counter(names::PUTS, &[("store", "a")], 3);
        s.counter(names::PUTS, &[("store", "b")], 1);
        let a = s.values[&(names::PUTS, vec![("store", "a".to_string())])];
        assert_eq!(a, (Kind::Counter, 5.0));
        assert_eq!(s.values.len(), 2);
    }
}
