//! The tonic service of `kvtier master` and the process around it (lease sweeper, election).
//!
//! Every RPC but `Cluster` is refused with `FAILED_PRECONDITION` on a master that is not the
//! leader, so a client never reads or writes a follower's (empty) directory; clients find the
//! leader with `Cluster` on each configured master address.
//!
//! Trust: every RPC passed [`crate::auth`] (a fresh proof of the cluster token) before it
//! reaches a handler here. On top of that a node's identity is bound to its registration:
//! registering a live node id from another data address is refused (`ALREADY_EXISTS`: the
//! takeover of a live node), and each registration returns a fresh `node_secret` that the
//! node-only calls must carry (`Heartbeat`: answered `known = false` otherwise, so a forged
//! heartbeat never renews a lease; `LeaveNode` and a node's `ReportDropped`:
//! `PERMISSION_DENIED`). Work is bounded: messages up to [`MAX_RPC_MESSAGE_BYTES`], keys per
//! call, and the existence fold runs off the async workers within [`EXISTS_DEADLINE`].

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use kvtier_proto::{Decode, Encode, ExistsV2Query};
use tonic::{Request, Response, Status};

use crate::admission::{Admission, Caps};
use crate::auth::{Authenticated, RpcAuthenticator, MAX_RPCS_PER_CONNECTION};
use crate::directory::{
    Claim, CopyFailureKind, Directory, KeyHash, NodeSpec, NodeState, PlaceRequest,
    ReplicationPolicy, MAX_REPAIR_TASKS_PER_HEARTBEAT,
};
use crate::election::{campaign, ElectionConfig, Leadership};
use crate::events::ClusterEvents;
use crate::limits::{
    HANDSHAKE_DEADLINE, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, MAX_HEADER_LIST_BYTES,
    MAX_STREAMS_PER_CONNECTION,
};
use crate::rpc::master_server::{Master, MasterServer};
use crate::rpc::*;

// The bounds are declared in `crate::limits` (with their cross-checks).
pub use crate::limits::{
    EXISTS_DEADLINE, EXISTS_WORKERS, MAX_KEYS_PER_CALL, MAX_RPC_MESSAGE_BYTES,
};

/// Settings of one master process.
#[derive(Clone, Debug)]
pub struct MasterConfig {
    pub listen: SocketAddr,
    /// The address clients and nodes use for this master (default: `listen`).
    pub advertise: Option<String>,
    /// A node not heard from for this long is dropped.
    pub lease: Duration,
    /// A put claim not committed within this is released.
    pub claim_timeout: Duration,
    pub default_replication: usize,
    /// Replication factor per namespace (the client's `extra_backend_tag`).
    pub replication: BTreeMap<String, usize>,
    /// etcd endpoints; empty: single-master mode.
    pub etcd_endpoints: Vec<String>,
    pub election_key: String,
    pub election_ttl: Duration,
    /// The cluster token every RPC must prove (never empty: [`run`] refuses to start without).
    pub token: Vec<u8>,
    /// Issue 30: the cluster KV-event stream (off: `None`).
    pub events: Option<crate::events::ClusterEventsConfig>,
}

/// Issue 29: most failed-copy hashes read from one heartbeat (a node has at most
/// `MAX_REPAIR_TASKS_PER_SOURCE` tasks in flight; the rest are ignored and lapse).
const MAX_COPY_FAILURES_READ: usize = 1024;

impl Default for MasterConfig {
    fn default() -> Self {
        MasterConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7700)),
            advertise: None,
            lease: Duration::from_secs(3),
            claim_timeout: Duration::from_secs(30),
            default_replication: 1,
            replication: BTreeMap::new(),
            etcd_endpoints: Vec::new(),
            election_key: "/kvtier/master/leader".into(),
            election_ttl: Duration::from_secs(2),
            token: Vec::new(),
            events: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MasterError {
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("rpc server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error(
        "no cluster token: set KVTIER_CLUSTER_TOKEN (or cluster_token in KVTIER_CONFIG_FILE), \
         the same token as the nodes'"
    )]
    NoToken,
    #[error("invalid master settings: {0}")]
    Config(#[from] crate::validate::MasterConfigError),
    #[error("cluster KV events: {0}")]
    Events(#[from] kvtier_events::EventsError),
}

/// Length of a node secret.
const NODE_SECRET_LEN: usize = 16;

fn secrets_equal(a: &[u8], b: &[u8]) -> bool {
    // Constant time in the contents.
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The state every RPC works on.
pub struct MasterService {
    directory: Arc<Directory>,
    leadership: Arc<Leadership>,
    config: MasterConfig,
    /// Node id -> the secret its last registration was given.
    node_secrets: Mutex<HashMap<String, Vec<u8>>>,
    /// Existence evaluations running at once.
    exists_slots: Arc<tokio::sync::Semaphore>,
    /// Issue 30: the cluster KV-event stream, told after each directory change.
    events: Option<Arc<ClusterEvents>>,
}

impl MasterService {
    pub fn new(
        config: MasterConfig,
        directory: Arc<Directory>,
        leadership: Arc<Leadership>,
    ) -> Self {
        MasterService {
            directory,
            leadership,
            config,
            node_secrets: Mutex::new(HashMap::new()),
            exists_slots: Arc::new(tokio::sync::Semaphore::new(EXISTS_WORKERS)),
            events: None,
        }
    }

    /// Publish the directory's changes on the cluster KV-event stream.
    pub fn with_events(mut self, events: Option<Arc<ClusterEvents>>) -> Self {
        self.events = events;
        self
    }

    /// Issue 30: `keys`' holders may have changed.
    fn events_touched(&self, keys: &[Vec<u8>]) {
        if let Some(e) = &self.events {
            e.touched(keys);
        }
    }

    /// Issue 30: a node dropped or re-registered.
    fn events_nodes_changed(&self) {
        if let Some(e) = &self.events {
            e.nodes_changed();
        }
    }

    /// Whether `secret` is the one node `node_id`'s last registration was given.
    fn node_secret_ok(&self, node_id: &str, secret: &[u8]) -> bool {
        self.node_secrets
            .lock()
            .get(node_id)
            .is_some_and(|s| secrets_equal(s, secret))
    }

    /// Issue 29: a heartbeat's reports of failed copy tasks (the node's own, its secret
    /// checked by the caller). At most [`MAX_COPY_FAILURES_READ`] hashes are read; malformed
    /// hashes and unknown targets are skipped (the task then lapses at its timeout).
    fn copy_failures(&self, node_id: &str, failures: &[CopyFailure]) {
        let now = self.directory.now();
        let mut budget = MAX_COPY_FAILURES_READ;
        let mut failed = 0usize;
        for f in failures {
            if budget == 0 {
                break;
            }
            let Ok(target) = u16::try_from(f.target) else {
                continue;
            };
            let kind = match CopyFailureReason::try_from(f.reason) {
                Ok(CopyFailureReason::CopyFailureNotHeld) => CopyFailureKind::NotHeld,
                Ok(CopyFailureReason::CopyFailurePush) => CopyFailureKind::Push,
                _ => CopyFailureKind::Commit,
            };
            let take = f.key_hashes.len().min(budget);
            budget -= take;
            let hashes: Vec<KeyHash> = f.key_hashes[..take]
                .iter()
                .filter_map(|h| KeyHash::from_bytes(h))
                .collect();
            failed += self
                .directory
                .copy_failed(node_id, target, &hashes, kind, now);
        }
        if failed > 0 {
            tracing::info!(
                "kvtier master: node {node_id:?} reported {failed} failed copy tasks; planning \
                 them again"
            );
        }
    }

    /// The id of the node registered under `index`.
    fn node_id_of(&self, index: u16) -> Option<String> {
        self.directory
            .nodes()
            .into_iter()
            .find(|n| n.index == index)
            .map(|n| n.spec.node_id)
    }

    fn lead(&self) -> Result<(), Status> {
        if self.leadership.is_leader_at(self.directory.now()) {
            Ok(())
        } else {
            Err(Status::failed_precondition(format!(
                "not the leader (leader: {:?})",
                self.leadership.leader_address()
            )))
        }
    }

    fn replication(&self, namespace: &str) -> usize {
        self.config
            .replication
            .get(namespace)
            .copied()
            .unwrap_or(self.config.default_replication)
    }
}

fn check_keys(keys: &[Vec<u8>]) -> Result<(), Status> {
    if keys.len() > MAX_KEYS_PER_CALL {
        return Err(Status::invalid_argument(format!(
            "{} keys in one call (most: {MAX_KEYS_PER_CALL})",
            keys.len()
        )));
    }
    if keys
        .iter()
        .any(|k| k.is_empty() || k.len() > kvtier_proto::limits::MAX_KEY_LEN)
    {
        return Err(Status::invalid_argument("a key is empty or too long"));
    }
    Ok(())
}

/// Issue 29 §4 (found by the simulation): a copy task handed out by an earlier leader names
/// its target by that leader's node index, which this leader may have given to another node.
/// A copy commit (claim 0) that says which node it meant is refused whole unless every index
/// it lists is that node here; the source then drops the copy, and this leader plans its own.
fn stale_copy_target(directory: &Directory, r: &CommitPutsRequest) -> bool {
    if r.claim != 0 || r.target_node_id.is_empty() {
        return false;
    }
    let nodes = directory.nodes();
    r.stored.iter().flat_map(|s| &s.nodes).any(|&n| {
        nodes
            .iter()
            .find(|x| u32::from(x.index) == n)
            .is_none_or(|x| x.spec.node_id != r.target_node_id)
    })
}

/// [`check_keys`], and every key is in the cluster namespace (`NUL 'C' tag 0x1f key`): a
/// write may only claim and commit cluster objects, as the nodes' data ports only store those.
/// Reads and node reports are not held to it (a node may still report keys of an older
/// format from its SSD; a lookup of one is a plain miss).
fn check_cluster_keys(keys: &[Vec<u8>]) -> Result<(), Status> {
    check_keys(keys)?;
    if let Some(key) = keys
        .iter()
        .find(|k| !kvtier_proto::namespace::is_cluster_key(k))
    {
        return Err(Status::invalid_argument(format!(
            "key {:?} is outside the cluster namespace (NUL 'C' tag 0x1f key)",
            String::from_utf8_lossy(&key[..key.len().min(64)])
        )));
    }
    Ok(())
}

/// The node table as replies carry it (`now`: the directory's clock).
pub fn node_infos(nodes: &[NodeState], now: Instant) -> Vec<NodeInfo> {
    nodes
        .iter()
        .map(|n| NodeInfo {
            node_id: n.spec.node_id.clone(),
            data_address: n.spec.data_address.clone(),
            capacity_bytes: n.spec.capacity_bytes,
            free_bytes: n.estimated_free(),
            tags: n.spec.tags.clone(),
            alive: n.alive,
            index: u32::from(n.index),
            heard_ms_ago: u64::try_from(n.heard_ago(now).as_millis()).unwrap_or(u64::MAX),
            objects: 0,
        })
        .collect()
}

fn node_list(nodes: Vec<u16>) -> NodeList {
    NodeList {
        nodes: nodes.into_iter().map(u32::from).collect(),
    }
}

fn node_index(raw: u32) -> Result<u16, Status> {
    u16::try_from(raw)
        .map_err(|_| Status::invalid_argument(format!("node index {raw} is out of range")))
}

/// Name of the master's RPC latency histogram (`kvtier_client::metrics::names` lists it too;
/// this crate sits below the client, so it records by name through the `metrics` facade,
/// a no-op unless the process installed a recorder with `--metrics-addr`).
const RPC_DURATION: &str = "kvtier_master_rpc_duration_seconds";

/// Records one RPC's latency, labelled `rpc`, when dropped (every return path counts).
struct RpcTimer {
    rpc: &'static str,
    start: std::time::Instant,
}

impl RpcTimer {
    fn start(rpc: &'static str) -> RpcTimer {
        RpcTimer {
            rpc,
            start: std::time::Instant::now(),
        }
    }
}

impl Drop for RpcTimer {
    fn drop(&mut self) {
        metrics::histogram!(RPC_DURATION, "rpc" => self.rpc).record(self.start.elapsed());
    }
}

#[tonic::async_trait]
impl Master for MasterService {
    async fn register_node(
        &self,
        request: Request<RegisterNodeRequest>,
    ) -> Result<Response<RegisterNodeReply>, Status> {
        let _timer = RpcTimer::start("register_node");
        self.lead()?;
        let r = request.into_inner();
        if r.data_address.parse::<SocketAddr>().is_err() {
            return Err(Status::invalid_argument(format!(
                "data_address {:?} is not host:port",
                r.data_address
            )));
        }
        check_keys(&r.keys)?;
        // A live node id keeps its address: another address is a takeover (or a second process
        // configured with the same id) until the node leaves or its lease lapses.
        let live = self
            .directory
            .nodes()
            .into_iter()
            .find(|n| n.alive && n.spec.node_id == r.node_id);
        if let Some(live) = &live {
            if live.spec.data_address != r.data_address {
                tracing::warn!(
                    "kvtier master: refused registering node {:?} at {} (live at {})",
                    r.node_id,
                    r.data_address,
                    live.spec.data_address
                );
                return Err(Status::already_exists(format!(
                    "node {:?} is live at {}; a registration from {} is refused until it \
                     leaves or its lease lapses",
                    r.node_id, live.spec.data_address, r.data_address
                )));
            }
        }
        let secret = kvtier_proto::auth::nonce::<NODE_SECRET_LEN>()
            .map_err(|e| Status::internal(format!("no random bytes: {e}")))?
            .to_vec();
        let spec = NodeSpec {
            node_id: r.node_id,
            data_address: r.data_address,
            capacity_bytes: r.capacity_bytes,
            free_bytes: r.free_bytes,
            tags: r.tags,
        };
        let id = spec.node_id.clone();
        let index = self
            .directory
            .register(spec, &r.keys)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        self.events_touched(&r.keys);
        if live.is_some() {
            // A re-registration drops what the node no longer lists.
            self.events_nodes_changed();
        }
        self.node_secrets.lock().insert(id.clone(), secret.clone());
        tracing::info!(
            "kvtier master: node {id:?} registered (index {index}, {} keys)",
            r.keys.len()
        );
        Ok(Response::new(RegisterNodeReply {
            index: u32::from(index),
            lease_ms: self.directory.lease().as_millis() as u64,
            node_secret: secret,
        }))
    }

    async fn add_node_keys(
        &self,
        request: Request<AddNodeKeysRequest>,
    ) -> Result<Response<AddNodeKeysReply>, Status> {
        let _timer = RpcTimer::start("add_node_keys");
        self.lead()?;
        let r = request.into_inner();
        check_keys(&r.keys)?;
        if !self.node_secret_ok(&r.node_id, &r.node_secret) {
            return Err(Status::permission_denied(format!(
                "node {:?}: only the node itself may add its keys (its registration's secret)",
                r.node_id
            )));
        }
        let index = self
            .directory
            .nodes()
            .into_iter()
            .find(|n| n.alive && n.spec.node_id == r.node_id)
            .map(|n| n.index)
            .ok_or_else(|| Status::failed_precondition("the node is not registered"))?;
        self.directory
            .add_keys(index, &r.keys)
            .map_err(|e| Status::failed_precondition(e.to_string()))?;
        self.events_touched(&r.keys);
        Ok(Response::new(AddNodeKeysReply {}))
    }

    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatReply>, Status> {
        let _timer = RpcTimer::start("heartbeat");
        self.lead()?;
        let r = request.into_inner();
        // A heartbeat without this registration's secret renews nothing: the node (if it is
        // the real one, after another registration took its secret) registers again.
        let known = self.node_secret_ok(&r.node_id, &r.node_secret)
            && self.directory.heartbeat(&r.node_id, r.free_bytes);
        if known {
            self.copy_failures(&r.node_id, &r.copy_failures);
        }
        let copy_tasks = if known {
            self.directory
                .take_repair_tasks(
                    &r.node_id,
                    MAX_REPAIR_TASKS_PER_HEARTBEAT,
                    self.directory.now(),
                )
                .into_iter()
                .map(|b| CopyTask {
                    target: u32::from(b.target),
                    target_node_id: b.target_node_id,
                    target_address: b.target_address,
                    key_hashes: b.hashes.iter().map(|h| h.to_bytes().to_vec()).collect(),
                })
                .collect()
        } else {
            Vec::new()
        };
        Ok(Response::new(HeartbeatReply { known, copy_tasks }))
    }

    async fn place_puts(
        &self,
        request: Request<PlacePutsRequest>,
    ) -> Result<Response<PlacePutsReply>, Status> {
        let _timer = RpcTimer::start("place_puts");
        self.lead()?;
        let r = request.into_inner();
        check_cluster_keys(&r.keys)?;
        if r.sizes.len() != r.keys.len() {
            return Err(Status::invalid_argument(format!(
                "{} sizes for {} keys",
                r.sizes.len(),
                r.keys.len()
            )));
        }
        let place = PlaceRequest {
            client_node_id: &r.client_node_id,
            replication: self.replication(&r.namespace),
            required_tags: &r.required_tags,
        };
        // Issue 29 (the chaos soak): right after a takeover no node has registered with this
        // leader yet; that is an unavailable cluster, not one without room.
        if !self.directory.nodes().iter().any(|n| n.alive) {
            return Err(Status::unavailable(
                "no live node is registered with this master (after a master takeover nodes \
                 register again within a heartbeat): try again shortly",
            ));
        }
        let keys: Vec<&[u8]> = r.keys.iter().map(Vec::as_slice).collect();
        let (claim, claims) = self.directory.claim(&place, &keys, &r.sizes);
        let placements = claims
            .into_iter()
            .map(|c| match c {
                Claim::Write(nodes) => Placement {
                    status: PlaceStatus::Write as i32,
                    nodes: nodes.into_iter().map(u32::from).collect(),
                },
                Claim::Present => Placement {
                    status: PlaceStatus::Present as i32,
                    nodes: Vec::new(),
                },
                Claim::Busy => Placement {
                    status: PlaceStatus::Busy as i32,
                    nodes: Vec::new(),
                },
                Claim::NoSpace => Placement {
                    status: PlaceStatus::NoSpace as i32,
                    nodes: Vec::new(),
                },
            })
            .collect();
        Ok(Response::new(PlacePutsReply {
            placements,
            nodes: node_infos(&self.directory.nodes(), self.directory.now()),
            claim,
        }))
    }

    async fn commit_puts(
        &self,
        request: Request<CommitPutsRequest>,
    ) -> Result<Response<CommitPutsReply>, Status> {
        let _timer = RpcTimer::start("commit_puts");
        self.lead()?;
        let r = request.into_inner();
        check_cluster_keys(&r.keys)?;
        if r.stored.len() != r.keys.len() {
            return Err(Status::invalid_argument("stored is not parallel to keys"));
        }
        if stale_copy_target(&self.directory, &r) {
            return Ok(Response::new(CommitPutsReply {
                committed: vec![false; r.keys.len()],
            }));
        }
        let mut committed = Vec::with_capacity(r.keys.len());
        for (key, stored) in r.keys.iter().zip(&r.stored) {
            let nodes = stored
                .nodes
                .iter()
                .map(|&n| node_index(n))
                .collect::<Result<Vec<u16>, Status>>()?;
            committed.push(self.directory.commit(r.claim, key, &nodes).map_err(|e| {
                match e {
                    // Node indexes are numbered per leader: a put placed by the previous one
                    // names nodes this one has not registered (issue 29, the chaos soak). An
                    // infrastructure event the caller retries, not its mistake.
                    crate::directory::DirectoryError::UnknownNode(_) => {
                        Status::unavailable(format!(
                            "{e} with this master (a master took over since the put was placed): \
                         place it again"
                        ))
                    }
                    e => Status::invalid_argument(e.to_string()),
                }
            })?);
        }
        self.events_touched(&r.keys);
        Ok(Response::new(CommitPutsReply { committed }))
    }

    async fn lookup(
        &self,
        request: Request<LookupRequest>,
    ) -> Result<Response<LookupReply>, Status> {
        let _timer = RpcTimer::start("lookup");
        self.lead()?;
        let r = request.into_inner();
        check_keys(&r.keys)?;
        let locations = self
            .directory
            .locate_many(&r.keys)
            .into_iter()
            .map(node_list)
            .collect();
        Ok(Response::new(LookupReply {
            locations,
            nodes: node_infos(&self.directory.nodes(), self.directory.now()),
        }))
    }

    async fn exists_v2(
        &self,
        request: Request<ExistsV2Request>,
    ) -> Result<Response<ExistsV2Reply>, Status> {
        let _timer = RpcTimer::start("exists_v2");
        self.lead()?;
        let r = request.into_inner();
        let query = ExistsV2Query::decode(&r.query)
            .map_err(|e| Status::invalid_argument(format!("exists query: {e}")))?;
        // Off the async workers (a large query over a large directory takes milliseconds), at
        // most EXISTS_WORKERS at once; a caller waits at most EXISTS_DEADLINE. An evaluation
        // past the deadline still finishes on its blocking thread (the fold is bounded) but
        // holds its slot meanwhile, so such queries cannot pile up.
        let slot = tokio::time::timeout(
            EXISTS_DEADLINE,
            Arc::clone(&self.exists_slots).acquire_owned(),
        )
        .await
        .map_err(|_| Status::resource_exhausted("existence queries are queued; retry"))?
        .map_err(|_| Status::internal("existence slots closed"))?;
        let directory = Arc::clone(&self.directory);
        let evaluation = tokio::task::spawn_blocking(move || {
            let answer = kvtier_proto::query::evaluate(&query, directory.exists_fn());
            drop(slot);
            answer
        });
        let answer = tokio::time::timeout(EXISTS_DEADLINE, evaluation)
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!(
                    "existence query not evaluated within {EXISTS_DEADLINE:?}"
                ))
            })?
            .map_err(|e| Status::internal(format!("existence evaluation failed: {e}")))?
            .map_err(|e| Status::invalid_argument(format!("exists query: {e}")))?;
        let answer = answer
            .encode_to_vec()
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(ExistsV2Reply { answer }))
    }

    async fn report_dropped(
        &self,
        request: Request<ReportDroppedRequest>,
    ) -> Result<Response<ReportDroppedReply>, Status> {
        let _timer = RpcTimer::start("report_dropped");
        self.lead()?;
        let r = request.into_inner();
        check_keys(&r.keys)?;
        let node = node_index(r.node)?;
        if !r.node_secret.is_empty() {
            let owner = self.node_id_of(node);
            if !owner.is_some_and(|id| self.node_secret_ok(&id, &r.node_secret)) {
                return Err(Status::permission_denied(format!(
                    "node {node}: the node secret is not this node's registration's"
                )));
            }
        }
        let removed = self.directory.drop_keys(node, &r.keys);
        self.events_touched(&r.keys);
        Ok(Response::new(ReportDroppedReply { removed }))
    }

    async fn leave_node(
        &self,
        request: Request<LeaveNodeRequest>,
    ) -> Result<Response<LeaveNodeReply>, Status> {
        let _timer = RpcTimer::start("leave_node");
        self.lead()?;
        let r = request.into_inner();
        if !self.node_secret_ok(&r.node_id, &r.node_secret) {
            return Err(Status::permission_denied(format!(
                "node {:?}: only the node itself may leave (its registration's secret)",
                r.node_id
            )));
        }
        let known = self.directory.leave(&r.node_id);
        if known {
            tracing::info!("kvtier master: node {:?} left", r.node_id);
            self.events_nodes_changed();
        }
        Ok(Response::new(LeaveNodeReply { known }))
    }

    async fn cluster(
        &self,
        request: Request<ClusterRequest>,
    ) -> Result<Response<ClusterReply>, Status> {
        let _timer = RpcTimer::start("cluster");
        let leader = self.leadership.is_leader_at(self.directory.now());
        let mut nodes = if leader {
            node_infos(&self.directory.nodes(), self.directory.now())
        } else {
            Vec::new()
        };
        if leader && request.get_ref().node_objects {
            // The scan can take milliseconds on a large directory: off the async workers.
            let directory = Arc::clone(&self.directory);
            let counts = tokio::task::spawn_blocking(move || directory.objects_per_node())
                .await
                .unwrap_or_default();
            for n in &mut nodes {
                let index = u16::try_from(n.index).unwrap_or(u16::MAX);
                n.objects = counts.get(&index).copied().unwrap_or(0);
            }
        }
        Ok(Response::new(ClusterReply {
            nodes,
            is_leader: leader,
            leader_address: self.leadership.leader_address(),
            objects: if leader {
                self.directory.len() as u64
            } else {
                0
            },
            rereplication: Some(rereplication_stats(&self.directory)),
        }))
    }

    async fn forget(
        &self,
        request: Request<ForgetRequest>,
    ) -> Result<Response<ForgetReply>, Status> {
        let _timer = RpcTimer::start("forget");
        self.lead()?;
        let r = request.into_inner();
        check_keys(&r.keys)?;
        let held_by = self
            .directory
            .forget(&r.keys)
            .into_iter()
            .map(node_list)
            .collect();
        self.events_touched(&r.keys);
        Ok(Response::new(ForgetReply {
            held_by,
            nodes: node_infos(&self.directory.nodes(), self.directory.now()),
        }))
    }
}

fn rereplication_stats(directory: &Directory) -> RereplicationStats {
    let s = directory.repair_stats();
    RereplicationStats {
        issued: s.issued,
        done: s.done,
        failed: s.failed,
        dropped: s.dropped,
        in_flight: s.in_flight,
        no_target: s.no_target,
    }
}

/// What one tick of the lease sweeper did.
#[derive(Debug, Default)]
pub struct SweepReport {
    /// Nodes dropped because their lease lapsed.
    pub dropped: Vec<String>,
    /// Copy tasks planned (`None`: not the leader, nothing planned).
    pub planned: Option<usize>,
}

/// One tick of the lease sweeper (every lease / 4 in [`run`]; the simulation calls it on its
/// own schedule): drop nodes whose lease lapsed, and, on the leader, plan re-replication.
pub fn sweep(directory: &Directory, leadership: &Leadership) -> SweepReport {
    let now = directory.now();
    let dropped = directory.expire_nodes(now);
    let planned = leadership
        .is_leader_at(now)
        .then(|| directory.plan_repairs(now));
    SweepReport { dropped, planned }
}

/// Run a master until `shutdown` resolves: the RPC server, the lease sweeper, and (with etcd
/// endpoints) the leader campaign.
pub async fn run(
    config: MasterConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), MasterError> {
    if config.token.is_empty() {
        return Err(MasterError::NoToken);
    }
    config.validate()?;
    let advertise = config
        .advertise
        .clone()
        .unwrap_or_else(|| config.listen.to_string());
    let directory = Arc::new(Directory::with_replication(
        config.lease,
        config.claim_timeout,
        ReplicationPolicy {
            default: config.default_replication,
            namespaces: config.replication.clone(),
        },
    ));
    let leadership = Arc::new(if config.etcd_endpoints.is_empty() {
        Leadership::single(&advertise)
    } else {
        Leadership::default()
    });
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| MasterError::Listen {
            addr: config.listen,
            source,
        })?;
    let events = start_events(&config, &directory, &leadership)?;
    let sweeper = spawn_sweeper(
        Arc::clone(&directory),
        Arc::clone(&leadership),
        config.lease,
        events.clone(),
    );
    let election = (!config.etcd_endpoints.is_empty()).then(|| {
        tokio::spawn(campaign(
            ElectionConfig {
                endpoints: config.etcd_endpoints.clone(),
                key: config.election_key.clone(),
                ttl: config.election_ttl,
                advertise: advertise.clone(),
            },
            Arc::clone(&leadership),
            Arc::clone(&directory),
        ))
    });
    tracing::info!(
        "kvtier master: serving on {} (advertised {advertise}; {})",
        config.listen,
        if config.etcd_endpoints.is_empty() {
            "single master".to_string()
        } else {
            format!("etcd election on {:?}", config.etcd_endpoints)
        }
    );
    let config_endpoints = config.etcd_endpoints.clone();
    let resigning = Arc::clone(&leadership);
    let authenticator = Arc::new(RpcAuthenticator::new(config.token.clone()));
    let service = MasterService::new(config, directory, leadership).with_events(events.clone());
    // Issue 26: our own accept loop (connection caps per source and in all, a deadline to
    // authenticate, idle members cut) sized from the descriptor limit, raised first.
    let descriptors = crate::admission::raise_descriptor_limit();
    let admission = Admission::new(Caps::for_descriptors(descriptors));
    let caps = admission.caps();
    tracing::info!(
        "kvtier master: descriptor limit {}: at most {} connections ({} per source), {} \
         unauthenticated ({} per source, {} s to authenticate)",
        descriptors.map_or_else(|| "unknown".to_string(), |d| d.to_string()),
        caps.connections,
        caps.per_source,
        caps.pending,
        caps.pending_per_source,
        HANDSHAKE_DEADLINE.as_secs()
    );
    let refusals = Arc::clone(&admission.refusals);
    let (incoming, reaper) = crate::admission::incoming(listener, admission);
    // Issue 27: the server's own shutdown starts only once leadership is resigned, and its
    // graceful part (running RPCs finish, connections close) is bounded: an open connection
    // (a metrics scraper's, a node's stream) must not keep a stopped master alive, nor keep
    // its election key from a follower.
    let (begin_stop, stop_begun) = tokio::sync::oneshot::channel::<()>();
    let serve = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(MAX_RPCS_PER_CONNECTION)
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_max_header_list_size(MAX_HEADER_LIST_BYTES)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .add_service(
            Authenticated::new(
                MasterServer::new(service).max_decoding_message_size(MAX_RPC_MESSAGE_BYTES),
                authenticator,
            )
            .with_refusal_log(refusals),
        )
        .serve_with_incoming_shutdown(incoming, async {
            let _ = stop_begun.await;
        });
    tokio::pin!(serve);
    tokio::pin!(shutdown);
    let mut election = election;
    let result = tokio::select! {
        r = &mut serve => r,
        () = &mut shutdown => {
            if let Some(task) = election.take() {
                task.abort();
                let _ = task.await;
                crate::election::resign(&config_endpoints, &resigning).await;
            }
            let _ = begin_stop.send(());
            match tokio::time::timeout(SHUTDOWN_GRACE, &mut serve).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(
                        "kvtier master: connections still open {} s after the stop; closing them",
                        SHUTDOWN_GRACE.as_secs()
                    );
                    Ok(())
                }
            }
        }
    };
    reaper.abort();
    sweeper.abort();
    if let Some(e) = election {
        e.abort();
    }
    if let Some(e) = events {
        let _ = tokio::task::spawn_blocking(move || e.stop()).await;
    }
    tracing::info!("kvtier master: stopped");
    result.map_err(MasterError::from)
}

/// Issue 30: start the cluster KV-event stream when the operator named its endpoint.
fn start_events(
    config: &MasterConfig,
    directory: &Arc<Directory>,
    leadership: &Arc<Leadership>,
) -> Result<Option<Arc<ClusterEvents>>, MasterError> {
    let Some(c) = &config.events else {
        return Ok(None);
    };
    let events = ClusterEvents::start(c.clone(), Arc::clone(directory), Arc::clone(leadership))?;
    tracing::info!(
        "kvtier master: cluster KV events on tcp://{}{} (published while leading)",
        events.endpoint(),
        events
            .replay_endpoint()
            .map_or(String::new(), |a| format!(", replay on tcp://{a}"))
    );
    Ok(Some(events))
}

/// The lease sweeper: expire nodes, and (leader only) plan re-replication.
fn spawn_sweeper(
    directory: Arc<Directory>,
    leadership: Arc<Leadership>,
    lease: Duration,
    events: Option<Arc<ClusterEvents>>,
) -> tokio::task::JoinHandle<()> {
    let every = (lease / 4).max(Duration::from_millis(50));
    tokio::spawn(async move {
        let mut reported_no_target = 0;
        loop {
            tokio::time::sleep(every).await;
            // The scan can take milliseconds on a large directory: off the async workers.
            let (d, l) = (Arc::clone(&directory), Arc::clone(&leadership));
            let Ok(report) = tokio::task::spawn_blocking(move || sweep(&d, &l)).await else {
                continue;
            };
            if !report.dropped.is_empty() {
                if let Some(e) = &events {
                    e.nodes_changed();
                }
            }
            for node in report.dropped {
                tracing::warn!("kvtier master: node {node:?} dropped (lease expired)");
            }
            let Some(planned) = report.planned else {
                continue;
            };
            let stats = directory.repair_stats();
            if planned > 0 {
                tracing::info!(
                    "kvtier master: re-replication: {planned} copy tasks planned \
                     ({} in flight)",
                    stats.in_flight
                );
            }
            if stats.no_target != reported_no_target {
                reported_no_target = stats.no_target;
                if stats.no_target > 0 {
                    tracing::warn!(
                        "kvtier master: re-replication: {} under-replicated objects have \
                         no target node (live, not a holder, room, the holders' tags)",
                        stats.no_target
                    );
                }
            }
        }
    })
}

/// Issue 27: how long a stopping master lets running RPCs finish and connections close.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);
