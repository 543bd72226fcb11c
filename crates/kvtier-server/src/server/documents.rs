//! What the server reports: the `Stats` and `Inspect` JSON documents, the scrape-time
//! Prometheus samples of the server, and the cluster node's data plane as stats names it.
//!
//! Owns only [`DataPlane`]; everything else is read from the server's state at the moment of
//! the request (sessions, counters, the tenant stores' engines), so a document is a snapshot
//! and building one never changes what it describes.
//!
//! Invariants:
//! - The field names of both documents are an interface (`kvtier stat`, `kvtier inspect`, the
//!   Python client's `stats()` and tests read them): fields are added, never renamed.
//! - An `Inspect` reply lists at most [`INSPECT_MAX_KEYS`] keys per store.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use kvtier_proto::server::InspectQuery;
use kvtier_store::metrics::{names, Collector, Samples};
use kvtier_store::stats::ClientStats;
use kvtier_store::store::Store;
use serde_json::{json, Value};

use super::session::Session;
use super::Shared;

/// Issue 17: a cluster node's data plane as `stats` reports it under "data_plane".
#[derive(Debug, Clone)]
pub enum DataPlane {
    /// UCX served (peers read the DRAM arena one-sided; frames stay the fallback). Weak: the
    /// cluster node owns the UCX plane and stops it before the server's store drops.
    Ucx(std::sync::Weak<crate::ucx_node::UcxNode>),
    /// TCP frames only, and why not UCX.
    Frames(String),
}

impl DataPlane {
    /// The "data_plane" object of the stats document.
    pub fn describe(&self) -> Value {
        match self {
            DataPlane::Ucx(node) => match node.upgrade() {
                Some(node) => {
                    let mut doc = node.describe();
                    doc["transport"] = json!("ucx");
                    doc
                }
                None => {
                    json!({ "enabled": false, "transport": "frames", "reason": "UCX plane stopped" })
                }
            },
            DataPlane::Frames(why) => {
                json!({ "enabled": false, "transport": "frames", "reason": why })
            }
        }
    }
}

impl Collector for Shared {
    fn collect(&self, out: &mut Samples) {
        let (sessions, mapped) = {
            let sessions = self.sessions.table();
            let mapped: u64 = sessions
                .values()
                .map(|s| s.mapped_bytes.load(Ordering::Relaxed))
                .sum();
            (sessions.len(), mapped)
        };
        let c = &self.counters;
        out.gauge(
            names::SERVER_CONNECTIONS,
            &[],
            self.open_conns.load(Ordering::Relaxed) as f64,
        );
        out.gauge(names::SERVER_SESSIONS, &[], sessions as f64);
        out.gauge(names::SERVER_MAPPED_BYTES, &[], mapped as f64);
        out.counter(
            names::SERVER_REQUESTS,
            &[],
            c.requests.load(Ordering::Relaxed),
        );
        out.counter(
            names::SERVER_MALFORMED_FRAMES,
            &[],
            c.malformed_frames.load(Ordering::Relaxed),
        );
    }
}

/// Keys per store an `Inspect` reply lists at most (the reply is one JSON text frame).
pub(super) const INSPECT_MAX_KEYS: u64 = 10_000;

/// The reply of `Inspect`: per store, the placement of each asked key and of the keys under
/// the prefix (at most `limit`, capped at [`INSPECT_MAX_KEYS`]; `truncated` when more matched).
pub(super) fn inspect_document(shared: &Shared, query: &InspectQuery) -> Value {
    let limit = if query.limit == 0 {
        INSPECT_MAX_KEYS
    } else {
        query.limit.min(INSPECT_MAX_KEYS)
    } as usize;
    let placement = |p: &kvtier_engine::Placement| {
        json!({
            "key": String::from_utf8_lossy(&p.key),
            "dram_bytes": p.dram_len,
            "ssd_bytes": p.ssd_len,
        })
    };
    let mut stores = Vec::new();
    for store in shared.tenants.all() {
        let found = store
            .inner()
            .inspect(&query.keys, query.prefix.as_deref(), limit);
        let doc = found.map(|(keys, under, truncated)| {
            json!({
                "store": store.name(),
                "keys": keys.iter().map(placement).collect::<Vec<_>>(),
                "prefix": under.iter().map(placement).collect::<Vec<_>>(),
                "truncated": truncated,
            })
        });
        stores.push(doc.unwrap_or_else(|| json!({ "store": store.name(), "error": "no engine" })));
    }
    json!({
        "prefix": query.prefix.as_ref().map(|p| String::from_utf8_lossy(p).into_owned()),
        "limit": limit,
        "stores": stores,
    })
}

/// The reply of `Stats` (and of shutdown): the server's counters, each store's engine and
/// counters, every session; `you` names the asking session and its store.
/// The `server` section's per-uid usage, refusals and (issue 30) host KV-event stream (null
/// when off).
fn add_ledger_and_events(server: &mut Value, shared: &Shared) {
    server["host_events"] = shared
        .events
        .lock()
        .as_ref()
        .map_or(Value::Null, crate::events::HostEvents::stats);
    server["uids"] = shared.ledger.usage();
    server["refusals"] = json!(shared.ledger.refusals.totals());
    server["refusal_log_lines"] = json!(shared.ledger.refusals.lines());
}

pub(super) fn stats_document(shared: &Shared, you: Option<&Session>) -> Value {
    let sessions = shared.sessions.table();
    let mut mapped_regions = 0usize;
    let mut mapped_bytes = 0u64;
    // Per store: the regions its sessions have mapped, and their bytes.
    let mut per_store: HashMap<String, (u64, u64)> = HashMap::new();
    let mut list = Vec::new();
    for s in sessions.values() {
        let regions = s.regions.read();
        mapped_regions += regions.len();
        mapped_bytes += s.mapped_bytes.load(Ordering::Relaxed);
        let entry = per_store.entry(s.store.name().to_string()).or_default();
        entry.0 += regions.len() as u64;
        entry.1 += regions.values().map(|m| m.len() as u64).sum::<u64>();
        let unsealed = regions.values().filter(|m| !m.sealed()).count();
        let revoked = regions.values().filter(|m| m.revoked()).count();
        let c = &s.counters;
        list.push(json!({
            "session": s.id,
            "tenant": s.tenant,
            "client_name": s.client_name,
            "pid": s.pid,
            "store": s.store.name(),
            "connections": s.connections.load(Ordering::Relaxed),
            "regions": regions.len(),
            "unsealed_regions": unsealed,
            "revoked_regions": revoked,
            "mapped_bytes": s.mapped_bytes.load(Ordering::Relaxed),
            "requests": c.requests.load(Ordering::Relaxed),
            "pages_put": c.pages_put.load(Ordering::Relaxed),
            "pages_got": c.pages_got.load(Ordering::Relaxed),
            "bytes_put": c.bytes_put.load(Ordering::Relaxed),
            "bytes_got": c.bytes_got.load(Ordering::Relaxed),
            "rejected_buffers": c.rejected_buffers.load(Ordering::Relaxed),
            "refused_requests": c.refused_requests.load(Ordering::Relaxed),
            "age_s": s.started.elapsed().as_secs_f64(),
        }));
    }
    drop(sessions);
    let mut stores = serde_json::Map::new();
    for store in shared.tenants.all() {
        let (registered_regions, registered_bytes) =
            per_store.get(store.name()).copied().unwrap_or_default();
        let (rejected_buffers, rejected_batches) = store.rejected();
        let stats = ClientStats {
            engine: store.engine_stats(),
            rejected_buffers,
            rejected_batches,
            registered_regions,
            registered_bytes,
        };
        stores.insert(
            store.name().to_string(),
            serde_json::to_value(stats).unwrap_or(Value::Null),
        );
    }
    let c = &shared.counters;
    let mut doc = json!({
        "server": {
            "version": env!("CARGO_PKG_VERSION"),
            "pid": std::process::id(),
            "socket": shared.config.socket.display().to_string(),
            "uptime_s": shared.started.elapsed().as_secs_f64(),
            "sessions": list.len(),
            "connections": shared.open_conns.load(Ordering::Relaxed),
            "connections_total": c.connections_total.load(Ordering::Relaxed),
            "connections_refused": c.connections_refused.load(Ordering::Relaxed),
            "sessions_total": shared.sessions.opened_total.load(Ordering::Relaxed),
            "requests": c.requests.load(Ordering::Relaxed),
            "malformed_frames": c.malformed_frames.load(Ordering::Relaxed),
            "refused_requests": c.refused_requests.load(Ordering::Relaxed),
            "mapped_regions": mapped_regions,
            "mapped_bytes": mapped_bytes,
            "live_mappings": shared.sessions.live_mappings.load(Ordering::SeqCst),
            "recovered_faults": crate::fault_guard::recovered_faults(),
            "regions_mapped_total": shared.sessions.regions_mapped_total.load(Ordering::Relaxed),
            "regions_unmapped_total": shared.sessions.regions_unmapped_total.load(Ordering::Relaxed),
            "shutting_down": shared.shutting_down.load(Ordering::Relaxed),
        },
        "stores": stores,
        "sessions": list,
    });
    // Issue 26: the caps in force, what each uid holds (operators only: the Stats handler
    // removes it for others) and the refusals by reason.
    let caps = shared.ledger.caps();
    doc["server"]["limits"] = json!({
        "descriptor_limit": caps.descriptors,
        "connections": caps.connections,
        "connections_per_uid": caps.connections_per_uid,
        "passed_fds": caps.passed_fds,
        "passed_fds_per_uid": caps.passed_fds_per_uid,
        "mapped_bytes": caps.mapped_bytes,
        "mapped_bytes_per_uid": caps.mapped_bytes_per_uid,
    });
    add_ledger_and_events(&mut doc["server"], shared);
    // Issue 17: a cluster node names its data plane (UCX or frames, and why).
    if let Some(plane) = shared.data_plane.lock().as_ref() {
        doc["data_plane"] = plane.describe();
    }
    if let Some(you) = you {
        doc["you"] = json!({ "session": you.id, "store": you.store.name(), "tenant": you.tenant });
        doc["you_engine_stats"] = doc["stores"][you.store.name()].clone();
    }
    doc
}
