//! The node agent of `kvtier serve --master`: keeps this node registered with the leading
//! master and its lease renewed.
//!
//! - Registration carries the data address (never a registration without one) and every key
//!   the node still holds (the first 65,536 in `RegisterNode`, the rest in `AddNodeKeys`
//!   calls, each within the master's message limit), so a master that restarted, or a new leader after a failover,
//!   rebuilds this node's part of the directory from it.
//! - Heartbeats every third of the lease report free space; a heartbeat answered
//!   `known = false` (new leader, master restart, lease lapsed during a partition) makes the
//!   agent register again at once.
//! - Every heartbeat also reports the keys the store dropped since (eviction, removal), so the
//!   directory stops pointing at them; a read in between fails cleanly and heals the entry.
//! - At start the agent lists what the store already holds (a warm restart brings the SSD
//!   tier's objects back), so a node that restarts with its SSD directory registers those
//!   objects and serves them again.
//! - A registration replaces the node's part of the directory with the keys it carries, so
//!   keys a peer stored (and a writer committed) between the snapshot and the master's
//!   handling of the registration would drop out; the agent checks after every registration
//!   and registers again while such keys appeared.
//! - A heartbeat reply may carry re-replication copy tasks (objects this node holds that lost
//!   a replica elsewhere); they go to the [`Rereplicator`] worker, so copying never delays a
//!   heartbeat.
//! - When the agent stops (SIGTERM / SIGINT of `kvtier serve`) the node leaves: the master
//!   drops it at once, as on a lapsed lease, instead of listing its objects until then.
//! - Issue 27: a credential the master refuses (Unauthenticated / PermissionDenied) is fatal:
//!   the agent stops and [`NodeAgent::fatal_error`] says why (`kvtier serve` exits 1). Other
//!   failures (name not resolved, connection refused, timeouts, no leader) are retried with
//!   exponential back-off (300 ms doubling to 10 s), each logged with what failed.
//! - Readiness (issue 27, `/readyz`): the node is ready while its last registration or
//!   heartbeat was answered; a failed call (the master gone, unreachable) or a reply that
//!   no longer knows the node makes it not ready until it registers again.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::server::TenantStore;
use kvtier_rpc::{
    AddNodeKeysRequest, HeartbeatRequest, LeaveNodeRequest, RegisterNodeRequest,
    ReportDroppedRequest,
};
use kvtier_store::metrics::ReadyGate;
use kvtier_store::store::Store;
use kvtier_transport::master::MasterLink;

use crate::peer::HeldKeys;
use crate::rereplicate::{Rereplicator, RereplicatorConfig};

/// What the agent registers.
#[derive(Clone, Debug)]
pub struct NodeAgentConfig {
    pub masters: Vec<String>,
    pub node_id: String,
    pub data_address: String,
    pub tags: Vec<String>,
    pub request_timeout: Duration,
    /// The cluster token: proven (never sent) to the masters and to other nodes' data ports.
    pub token: Vec<u8>,
}

/// A running agent; stops when dropped.
pub struct NodeAgent {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
    /// Issue 27: why the agent gave up for good (a refused credential).
    fatal: Arc<parking_lot::Mutex<Option<String>>>,
    /// The node's part of `/readyz`; unregistered when the agent is dropped.
    _ready: Arc<ReadyGate>,
}

impl NodeAgent {
    pub fn start(
        config: NodeAgentConfig,
        store: Arc<TenantStore>,
        held: Arc<HeldKeys>,
    ) -> std::io::Result<NodeAgent> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let fatal = Arc::new(parking_lot::Mutex::new(None));
        let fatal_out = Arc::clone(&fatal);
        let ready = ReadyGate::new("the cluster node has not registered with a master yet");
        let gate = Arc::clone(&ready);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let copier = Rereplicator::start(
            RereplicatorConfig {
                masters: config.masters.clone(),
                node_id: config.node_id.clone(),
                token: config.token.clone(),
                request_timeout: config.request_timeout,
            },
            Arc::clone(&store),
            Arc::clone(&held),
        )?;
        let handle = std::thread::Builder::new()
            .name("kvtier-node-agent".into())
            .spawn(move || {
                if let Err(why) =
                    runtime.block_on(agent_loop(config, store, held, &copier, flag, &gate))
                {
                    *fatal_out.lock() = Some(why);
                }
                gate.set_not_ready("the cluster node left the cluster");
                // The copy worker stops (and is joined) here, after the agent.
                drop(copier);
            })?;
        Ok(NodeAgent {
            stop,
            handle: Some(handle),
            fatal,
            _ready: ready,
        })
    }

    /// Issue 27: why the agent stopped for good, once it has (the master refused the
    /// cluster token); `None` while it runs or retries.
    pub fn fatal_error(&self) -> Option<String> {
        self.fatal.lock().clone()
    }
}

/// First and largest wait between failed registrations (doubling in between).
const RETRY_FIRST: Duration = Duration::from_millis(300);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// The wait after the `failures`-th failure in a row: 300 ms, 600 ms, ... capped at 10 s.
fn backoff(failures: u32) -> Duration {
    RETRY_FIRST
        .saturating_mul(1u32 << failures.saturating_sub(1).min(10))
        .min(RETRY_MAX)
}

/// The fatal error of a refused credential, or `None` for a failure worth retrying.
fn refused(e: &kvtier_transport::master::ClusterError, masters: &[String]) -> Option<String> {
    e.is_credential_refused().then(|| {
        format!(
            "the master refused this node's cluster token ({e}); check KVTIER_CLUSTER_TOKEN / \
             cluster_token against the masters' ({})",
            masters.join(",")
        )
    })
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The node's capacity and free space as the master plans with them: what the node can hold
/// without evicting. With an SSD tier that is the SSD's (every object reaches it; DRAM is its
/// cache, full in steady state), otherwise DRAM's. Issue 29: reporting DRAM alone made a
/// node with a write-through SSD look full once its DRAM was, and re-replication found no
/// target for thousands of objects though the SSD tiers had room.
fn free_bytes(store: &TenantStore) -> (u64, u64) {
    let stats = store.engine_stats();
    if stats.ssd_enabled && stats.ssd_capacity_bytes > 0 {
        (
            stats.ssd_capacity_bytes,
            stats
                .ssd_capacity_bytes
                .saturating_sub(stats.ssd_bytes_allocated),
        )
    } else {
        (
            stats.capacity_bytes,
            stats.capacity_bytes.saturating_sub(stats.bytes_allocated),
        )
    }
}

/// Tell the master this node is going (one attempt per master, each bounded by the request
/// timeout): its objects become misses at once instead of after the lease, and the master
/// stops placing puts here. A failure only means the lease does it later.
async fn leave(link: &MasterLink, node_id: &str, node_secret: &[u8]) {
    let request = LeaveNodeRequest {
        node_id: node_id.to_string(),
        node_secret: node_secret.to_vec(),
    };
    match link
        .call(|mut c| {
            let request = request.clone();
            async move { c.leave_node(request).await }
        })
        .await
    {
        Ok(_) => tracing::info!("kvtier serve: node {node_id:?} left the cluster"),
        Err(e) => tracing::warn!(
            "kvtier serve: could not leave the cluster ({e}); the master drops this node when \
             its lease lapses"
        ),
    }
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

/// Most keys one registration carries (the master refuses more).
const MAX_REGISTERED_KEYS: usize = 16 << 20;
/// Most keys, and most key bytes, one master call carries (the master's per-call key limit, and
/// well inside its 16 MiB message limit with the encoding's few bytes per key).
const KEYS_PER_CALL: usize = kvtier_rpc::MAX_KEYS_PER_CALL;
pub(crate) const KEY_BYTES_PER_CALL: usize = 8 << 20;

/// `keys` cut into runs a master call carries.
fn in_calls(mut keys: Vec<Vec<u8>>) -> Vec<Vec<Vec<u8>>> {
    let mut calls = Vec::new();
    while !keys.is_empty() {
        let mut bytes = 0;
        let take = keys
            .iter()
            .take(KEYS_PER_CALL)
            .take_while(|k| {
                bytes += k.len() + 8;
                bytes <= KEY_BYTES_PER_CALL
            })
            .count()
            .max(1);
        let rest = keys.split_off(take);
        calls.push(keys);
        keys = rest;
    }
    calls
}

/// Registrations in a row while keys keep arriving during them (then the next heartbeat
/// cycle carries on).
const MAX_REREGISTER_ROUNDS: usize = 4;

/// Every cluster key the store holds now, in any tier (embedded stores only; empty otherwise).
/// Only the cluster namespace ([`kvtier_proto::namespace::CLUSTER_MARK`]): the local tenants'
/// keys sharing the store are never registered with the master, copied, cleared or listed
/// for the cluster.
pub(crate) fn keys_in_store(store: &TenantStore) -> HashSet<Vec<u8>> {
    cluster_keys_under(
        store,
        kvtier_proto::namespace::CLUSTER_MARK,
        MAX_REGISTERED_KEYS,
    )
}

/// Up to `limit` cluster keys the store holds under `prefix` (a cluster prefix), any tier.
pub(crate) fn cluster_keys_under(
    store: &TenantStore,
    prefix: &[u8],
    limit: usize,
) -> HashSet<Vec<u8>> {
    store
        .inner()
        .inspect(&[], Some(prefix), limit)
        .map(|(_, under, _)| {
            under
                .into_iter()
                .map(|p| p.key)
                .filter(|k| kvtier_proto::namespace::is_cluster_key(k))
                .collect()
        })
        .unwrap_or_default()
}

/// The keys the node holds for the cluster: what peers stored since start plus what the store
/// held at start and still holds.
fn held_now(
    store: &TenantStore,
    held: &HeldKeys,
    recovered: &mut HashSet<Vec<u8>>,
) -> Vec<Vec<u8>> {
    let mut keys = held.snapshot(store);
    if !recovered.is_empty() {
        let list: Vec<Vec<u8>> = recovered.iter().cloned().collect();
        let present = store.exists_keys(&list);
        let mut seen: HashSet<&[u8]> = keys.iter().map(Vec::as_slice).collect();
        let mut extra = Vec::new();
        for (key, present) in list.iter().zip(present) {
            if !present {
                recovered.remove(key);
            } else if seen.insert(key.as_slice()) {
                extra.push(key.clone());
            }
        }
        keys.extend(extra);
    }
    keys.truncate(MAX_REGISTERED_KEYS);
    keys
}

/// Recovered keys the store no longer holds (forgotten here, reported to the master).
fn recovered_dropped(store: &TenantStore, recovered: &mut HashSet<Vec<u8>>) -> Vec<Vec<u8>> {
    if recovered.is_empty() {
        return Vec::new();
    }
    let list: Vec<Vec<u8>> = recovered.iter().cloned().collect();
    let present = store.exists_keys(&list);
    let dropped: Vec<Vec<u8>> = list
        .into_iter()
        .zip(present)
        .filter_map(|(k, p)| (!p).then_some(k))
        .collect();
    for key in &dropped {
        recovered.remove(key);
    }
    dropped
}

async fn agent_loop(
    config: NodeAgentConfig,
    store: Arc<TenantStore>,
    held: Arc<HeldKeys>,
    copier: &Rereplicator,
    stop: Arc<AtomicBool>,
    ready: &ReadyGate,
) -> Result<(), String> {
    // One attempt per call: the loop below does the retrying.
    let link = MasterLink::new(
        config.masters.clone(),
        config.token.clone(),
        config.request_timeout,
        Duration::from_millis(1),
    );
    let mut registered_once = false;
    // What the store held before any peer wrote to it: a warm restart's SSD contents.
    let mut recovered = keys_in_store(&store);
    if !recovered.is_empty() {
        tracing::info!(
            "kvtier serve: node {:?} holds {} objects from before its start",
            config.node_id,
            recovered.len()
        );
    }
    let mut rounds = 0usize;
    let mut failures = 0u32;
    while !stop.load(Ordering::SeqCst) {
        let (capacity, free) = free_bytes(&store);
        let all_keys = held_now(&store, &held, &mut recovered);
        let keys = all_keys.len();
        let sent: HashSet<Vec<u8>> = all_keys.iter().cloned().collect();
        let mut calls = in_calls(all_keys).into_iter();
        let request = RegisterNodeRequest {
            node_id: config.node_id.clone(),
            data_address: config.data_address.clone(),
            capacity_bytes: capacity,
            free_bytes: free,
            tags: config.tags.clone(),
            keys: calls.next().unwrap_or_default(),
        };
        let reply = match link
            .call(|mut c| {
                let request = request.clone();
                async move { c.register_node(request).await }
            })
            .await
        {
            Ok(r) => r,
            Err(e) => {
                ready.set_not_ready(&format!("cannot register with the master: {e}"));
                if let Some(why) = refused(&e, &config.masters) {
                    return Err(why);
                }
                failures += 1;
                let wait = backoff(failures);
                tracing::warn!(
                    "kvtier serve: cannot register with the master (attempt {failures}; next in {:.1} s): {e}",
                    wait.as_secs_f64()
                );
                if !sleep_unless_stopped(wait, &stop).await {
                    return Ok(());
                }
                continue;
            }
        };
        failures = 0;
        // The rest of the keys, in calls the master accepts; a failure means registering again.
        let mut complete = true;
        for chunk in calls {
            let add = AddNodeKeysRequest {
                node_id: config.node_id.clone(),
                node_secret: reply.node_secret.clone(),
                keys: chunk,
            };
            if let Err(e) = link
                .call(|mut c| {
                    let add = add.clone();
                    async move { c.add_node_keys(add).await }
                })
                .await
            {
                if let Some(why) = refused(&e, &config.masters) {
                    return Err(why);
                }
                tracing::warn!("kvtier serve: registering the held keys failed: {e}");
                complete = false;
                break;
            }
        }
        if !complete {
            if !sleep_unless_stopped(RETRY_FIRST, &stop).await {
                return Ok(());
            }
            continue;
        }
        tracing::info!(
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
        ready.set_ready();
        // Keys stored while the registration was on its way are not in it: register again.
        rounds += 1;
        if rounds < MAX_REREGISTER_ROUNDS {
            let arrived = held.snapshot(&store).iter().any(|k| !sent.contains(k));
            if arrived {
                continue;
            }
        }
        rounds = 0;
        let every = Duration::from_millis((reply.lease_ms / 3).max(50));
        loop {
            if !sleep_unless_stopped(every, &stop).await {
                leave(&link, &config.node_id, &reply.node_secret).await;
                return Ok(());
            }
            let (_, free) = free_bytes(&store);
            let heartbeat = HeartbeatRequest {
                node_id: config.node_id.clone(),
                free_bytes: free,
                node_secret: reply.node_secret.clone(),
                // Issue 29: planned again at once. Lost if this heartbeat fails: those
                // tasks lapse at the master's timeout instead.
                copy_failures: copier.take_failures(),
            };
            match link
                .call(|mut c| {
                    let heartbeat = heartbeat.clone();
                    async move { c.heartbeat(heartbeat).await }
                })
                .await
            {
                Ok(r) if r.known => {
                    ready.set_ready();
                    copier.submit(r.copy_tasks);
                }
                Ok(_) => {
                    ready.set_not_ready("the master no longer knows this node (registering again)");
                    break; // register again
                }
                Err(e) => {
                    ready.set_not_ready(&format!("heartbeat to the master failed: {e}"));
                    if let Some(why) = refused(&e, &config.masters) {
                        return Err(why);
                    }
                    tracing::warn!("kvtier serve: heartbeat failed: {e}");
                    continue;
                }
            }
            let mut dropped = held.take_dropped(&store);
            dropped.extend(recovered_dropped(&store, &mut recovered));
            for chunk in in_calls(dropped) {
                let report = ReportDroppedRequest {
                    node: reply.index,
                    keys: chunk,
                    node_secret: reply.node_secret.clone(),
                };
                if let Err(e) = link
                    .call(|mut c| {
                        let report = report.clone();
                        async move { c.report_dropped(report).await }
                    })
                    .await
                {
                    tracing::warn!("kvtier serve: reporting dropped keys failed: {e}");
                    break;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_backs_off_to_a_cap() {
        assert_eq!(backoff(1), Duration::from_millis(300));
        assert_eq!(backoff(2), Duration::from_millis(600));
        assert_eq!(backoff(5), Duration::from_millis(4800));
        assert_eq!(backoff(6), Duration::from_millis(9600));
        assert_eq!(backoff(7), RETRY_MAX);
        assert_eq!(backoff(1000), RETRY_MAX);
    }

    #[test]
    fn keys_are_cut_into_calls_the_master_accepts() {
        assert!(in_calls(Vec::new()).is_empty());
        let small: Vec<Vec<u8>> = (0..KEYS_PER_CALL + 5).map(|i| vec![i as u8; 10]).collect();
        let calls = in_calls(small.clone());
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].len(), KEYS_PER_CALL);
        assert_eq!(calls.concat(), small);
        let long: Vec<Vec<u8>> = (0..5000).map(|_| vec![7u8; 4096]).collect();
        let calls = in_calls(long);
        assert!(calls
            .iter()
            .all(|c| c.iter().map(|k| k.len() + 8).sum::<usize>() <= KEY_BYTES_PER_CALL));
        assert_eq!(calls.iter().map(Vec::len).sum::<usize>(), 5000);
    }
}
