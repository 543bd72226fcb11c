//! `kvtier master --metrics-addr`: the master's Prometheus metrics.
//!
//! At scrape time a collector asks this master, over its own RPC port, for its node table and
//! directory size (the `Cluster` RPC, answered by followers too), so a scrape shows exactly
//! what the master holds at that moment (re-replication totals included: the reply carries the
//! directory's counters); the master's RPC handlers record their latency with the `metrics`
//! macros into the same registry. A follower publishes `kvtier_master_is_leader
//! 0` and no nodes: the leader's table is the cluster's.
//!
//! Node ids (issue 26): the endpoint answers anyone who reaches its port, and node ids
//! (`node-<data address>` by default) would tell a stranger where every data port is. So by
//! default the master publishes cluster totals only (`kvtier_master_nodes{state}`,
//! `kvtier_master_cluster_capacity_bytes`, `kvtier_master_cluster_free_bytes`,
//! `kvtier_master_node_free_ratio_min`); the per-node gauges labelled `node` are published only
//! when the operator asks with `--metrics-node-ids` (an endpoint only trusted scrapers reach).
//!
//! Readiness (issue 27, `/readyz`): the same RPC answers whether this master leads or follows
//! a known leader; a master whose RPC port does not answer, or that follows no known leader,
//! is not ready.

use std::sync::Arc;
use std::time::Duration;

use kvtier_client::cluster::master::{connect, MasterCredential};
use kvtier_client::metrics::{self, names, Collector, Endpoint, Readiness, Samples};
use kvtier_master::rpc::ClusterRequest;

/// Bound of the scrape's own RPC: a master too busy to answer shows as `kvtier_master_up 0`.
const SCRAPE_RPC_TIMEOUT: Duration = Duration::from_secs(2);

struct MasterCollector {
    /// `HOST:PORT` of this master's RPC port.
    address: String,
    /// The cluster token's proof (the scrape's RPC is authenticated like any other).
    credential: MasterCredential,
    /// Publish per-node gauges labelled with node ids (`--metrics-node-ids`).
    node_ids: bool,
}

impl MasterCollector {
    /// This master's `Cluster` reply, or `None` when its RPC port did not answer in time.
    fn cluster(&self) -> Option<kvtier_master::rpc::ClusterReply> {
        let (address, credential) = (self.address.clone(), self.credential.clone());
        // Issue 27: a runtime per scrape, dropped with it: the RPC connection closes when the
        // scrape ends. A kept runtime left the connection open but never polled, so a stopping
        // master waited on it (graceful HTTP/2 close) until the next scrape.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .ok()?;
        runtime.block_on(async move {
            let fetch = async {
                let mut client = connect(&address, credential, SCRAPE_RPC_TIMEOUT)
                    .await
                    .ok()?;
                client
                    .cluster(ClusterRequest::default())
                    .await
                    .ok()
                    .map(|r| r.into_inner())
            };
            tokio::time::timeout(SCRAPE_RPC_TIMEOUT, fetch)
                .await
                .ok()
                .flatten()
        })
    }
}

impl Readiness for MasterCollector {
    fn not_ready(&self) -> Option<String> {
        match self.cluster() {
            None => Some(format!(
                "the master's RPC port {} does not answer",
                self.address
            )),
            Some(r) if r.is_leader || !r.leader_address.is_empty() => None,
            Some(_) => Some("the master neither leads nor knows a leader".into()),
        }
    }
}

impl Collector for MasterCollector {
    fn collect(&self, out: &mut Samples) {
        let Some(reply) = self.cluster() else {
            out.gauge(names::MASTER_UP, &[], 0.0);
            return;
        };
        out.gauge(names::MASTER_UP, &[], 1.0);
        out.gauge(
            names::MASTER_IS_LEADER,
            &[],
            if reply.is_leader { 1.0 } else { 0.0 },
        );
        out.gauge(names::MASTER_OBJECTS, &[], reply.objects as f64);
        let alive = reply.nodes.iter().filter(|n| n.alive).count();
        out.gauge(names::MASTER_NODES, &[("state", "alive")], alive as f64);
        out.gauge(
            names::MASTER_NODES,
            &[("state", "down")],
            (reply.nodes.len() - alive) as f64,
        );
        if let Some(r) = &reply.rereplication {
            for (outcome, v) in [
                ("issued", r.issued),
                ("done", r.done),
                ("failed", r.failed),
                ("dropped", r.dropped),
            ] {
                out.counter(
                    names::MASTER_REREPLICATION_TASKS,
                    &[("outcome", outcome)],
                    v,
                );
            }
            out.gauge(
                names::MASTER_REREPLICATION_IN_FLIGHT,
                &[],
                r.in_flight as f64,
            );
            out.gauge(
                names::MASTER_REREPLICATION_NO_TARGET,
                &[],
                r.no_target as f64,
            );
        }
        let live = || reply.nodes.iter().filter(|n| n.alive);
        if reply.is_leader {
            let capacity: u64 = live().map(|n| n.capacity_bytes).sum();
            let free: u64 = live().map(|n| n.free_bytes).sum();
            out.gauge(names::MASTER_CLUSTER_CAPACITY_BYTES, &[], capacity as f64);
            out.gauge(names::MASTER_CLUSTER_FREE_BYTES, &[], free as f64);
            let min_ratio = live()
                .filter(|n| n.capacity_bytes > 0)
                .map(|n| n.free_bytes as f64 / n.capacity_bytes as f64)
                .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.min(r))));
            if let Some(r) = min_ratio {
                out.gauge(names::MASTER_NODE_FREE_RATIO_MIN, &[], r);
            }
        }
        if !self.node_ids {
            return;
        }
        for n in &reply.nodes {
            let node = [("node", n.node_id.as_str())];
            out.gauge(
                names::MASTER_NODE_CAPACITY_BYTES,
                &node,
                n.capacity_bytes as f64,
            );
            out.gauge(names::MASTER_NODE_FREE_BYTES, &node, n.free_bytes as f64);
        }
    }
}

/// A running master endpoint; keep it alive for the master's lifetime.
pub struct MasterMetrics {
    pub endpoint: Arc<Endpoint>,
    _collector: Arc<MasterCollector>,
}

/// Start the endpoint on `addr` for the master whose RPC port is `rpc` (an unspecified
/// address such as `0.0.0.0` is reached on loopback); `node_ids` publishes per-node gauges
/// labelled with node ids.
pub fn start(
    addr: &str,
    rpc: std::net::SocketAddr,
    token: Vec<u8>,
    node_ids: bool,
) -> Result<MasterMetrics, String> {
    let endpoint = metrics::serve(addr).map_err(|e| e.to_string())?;
    let mut target = rpc;
    if target.ip().is_unspecified() {
        target.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    let collector = Arc::new(MasterCollector {
        address: target.to_string(),
        credential: MasterCredential::new(token),
        node_ids,
    });
    let as_collector: Arc<dyn Collector> = Arc::clone(&collector) as Arc<dyn Collector>;
    metrics::register_collector(Arc::downgrade(&as_collector));
    let as_readiness: Arc<dyn Readiness> = Arc::clone(&collector) as Arc<dyn Readiness>;
    metrics::register_readiness(Arc::downgrade(&as_readiness));
    Ok(MasterMetrics {
        endpoint,
        _collector: collector,
    })
}
