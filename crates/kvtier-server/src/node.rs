//! The node agent of `kvtier serve --master`: keeps this node registered with the leading
//! master and its lease renewed.
//!
//! - Registration carries the data address (never a registration without one) and every key
//!   the node still holds, so a master that restarted, or a new leader after a failover,
//!   rebuilds this node's part of the directory from it.
//! - Heartbeats every third of the lease report free space; a heartbeat answered
//!   `known = false` (new leader, master restart, lease lapsed during a partition) makes the
//!   agent register again at once.
//! - Every heartbeat also reports the keys the store dropped since (eviction, removal), so the
//!   directory stops pointing at them; a read in between fails cleanly and heals the entry.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use kvtier_client::cluster::master::MasterLink;
use kvtier_client::Client;
use kvtier_master::rpc::{HeartbeatRequest, RegisterNodeRequest, ReportDroppedRequest};

use crate::peer::HeldKeys;

/// What the agent registers.
#[derive(Clone, Debug)]
pub struct NodeAgentConfig {
    pub masters: Vec<String>,
    pub node_id: String,
    pub data_address: String,
    pub tags: Vec<String>,
    pub request_timeout: Duration,
}

/// A running agent; stops when dropped.
pub struct NodeAgent {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl NodeAgent {
    pub fn start(
        config: NodeAgentConfig,
        store: Arc<Client>,
        held: Arc<HeldKeys>,
    ) -> std::io::Result<NodeAgent> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = std::thread::Builder::new()
            .name("kvtier-node-agent".into())
            .spawn(move || runtime.block_on(agent_loop(config, store, held, flag)))?;
        Ok(NodeAgent {
            stop,
            handle: Some(handle),
        })
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn free_bytes(store: &Client) -> (u64, u64) {
    let stats = store.stats().engine;
    (
        stats.capacity_bytes,
        stats.capacity_bytes.saturating_sub(stats.bytes_allocated),
    )
}

async fn sleep_unless_stopped(total: Duration, stop: &AtomicBool) -> bool {
    let step = Duration::from_millis(50);
    let mut slept = Duration::ZERO;
    while slept < total {
        if stop.load(Ordering::SeqCst) {
            return false;
        }
        tokio::time::sleep(step.min(total - slept)).await;
        slept += step;
    }
    !stop.load(Ordering::SeqCst)
}

async fn agent_loop(
    config: NodeAgentConfig,
    store: Arc<Client>,
    held: Arc<HeldKeys>,
    stop: Arc<AtomicBool>,
) {
    // One attempt per call: the loop below does the retrying.
    let link = MasterLink::new(
        config.masters.clone(),
        config.request_timeout,
        Duration::from_millis(1),
    );
    let mut registered_once = false;
    while !stop.load(Ordering::SeqCst) {
        let (capacity, free) = free_bytes(&store);
        let request = RegisterNodeRequest {
            node_id: config.node_id.clone(),
            data_address: config.data_address.clone(),
            capacity_bytes: capacity,
            free_bytes: free,
            tags: config.tags.clone(),
            keys: held.snapshot(&store),
        };
        let keys = request.keys.len();
        let reply = match link
            .call(|mut c| {
                let request = request.clone();
                async move { c.register_node(request).await }
            })
            .await
        {
            Ok(r) => r,
            Err(e) => {
                eprintln!("kvtier serve: cannot register with the master: {e}");
                if !sleep_unless_stopped(Duration::from_millis(300), &stop).await {
                    return;
                }
                continue;
            }
        };
        eprintln!(
            "kvtier serve: {} node {:?} (index {}, data {}, {} keys) with master {}",
            if registered_once {
                "re-registered"
            } else {
                "registered"
            },
            config.node_id,
            reply.index,
            config.data_address,
            keys,
            link.current_leader().unwrap_or_default()
        );
        registered_once = true;
        let every = Duration::from_millis((reply.lease_ms / 3).max(50));
        loop {
            if !sleep_unless_stopped(every, &stop).await {
                return;
            }
            let (_, free) = free_bytes(&store);
            let heartbeat = HeartbeatRequest {
                node_id: config.node_id.clone(),
                free_bytes: free,
            };
            match link
                .call(|mut c| {
                    let heartbeat = heartbeat.clone();
                    async move { c.heartbeat(heartbeat).await }
                })
                .await
            {
                Ok(r) if r.known => {}
                Ok(_) => break, // register again
                Err(e) => {
                    eprintln!("kvtier serve: heartbeat failed: {e}");
                    continue;
                }
            }
            let dropped = held.take_dropped(&store);
            if !dropped.is_empty() {
                let report = ReportDroppedRequest {
                    node: reply.index,
                    keys: dropped,
                };
                if let Err(e) = link
                    .call(|mut c| {
                        let report = report.clone();
                        async move { c.report_dropped(report).await }
                    })
                    .await
                {
                    eprintln!("kvtier serve: reporting dropped keys failed: {e}");
                }
            }
        }
    }
}
