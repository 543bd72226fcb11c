//! Cluster mode: objects live on the cluster's nodes (`kvtier serve --master`), the leading
//! `kvtier master` knows where, and page bytes move between this process and the nodes over
//! the [`Transport`] (TCP).
//!
//! - Put: one `PlacePuts` round trip claims every key (first writer wins; already stored keys
//!   are skipped) and places new ones (the local node first when it has room); the bytes go to
//!   the chosen nodes, in parallel per node; one `CommitPuts` makes them visible. A put is
//!   acknowledged only after the commit, so every node's exists/get sees it at once.
//! - Get: one `Lookup`; each object is read from the local node when it holds a copy, else
//!   from another; an unreachable node's replica is tried next. A node that answers "not
//!   found" (it evicted the object) is reported (`ReportDropped`), so the entry heals.
//! - Exists v2: one `ExistsV2` round trip; the master evaluates the whole query.
//! - Integrity: every object carries an end-to-end checksum trailer written by its first
//!   writer and checked by every reader ([`crate::transport::tcp`]); bytes that fail it are
//!   never a hit: the next replica is tried, the failure is counted in
//!   [`ClusterStore::integrity_failures`] and [`names::CLUSTER_INTEGRITY_FAILURES`]`{peer}`,
//!   and with no replica left the item fails as `ObjectError::Integrity`.
//! - Failures are per item: a dead node costs at most one request timeout, after which the
//!   transport fails it fast (marked down) and the master drops it when its lease lapses.

pub use kvtier_transport::master;
pub use kvtier_transport::master::ClusterError;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvtier_proto::peer::MAX_CLEARED_KEYS;
use kvtier_proto::query::compose_key;
use kvtier_proto::{Decode, Encode, ExistsV2Answer, ExistsV2Query};
use kvtier_rpc::{
    CommitPutsRequest, ExistsV2Request, ForgetRequest, LookupReply, LookupRequest, NodeInfo,
    NodeList, PlacePutsRequest, PlaceStatus, ReportDroppedRequest,
};
use parking_lot::RwLock;

use crate::batch::{BatchResult, MemRef};
use crate::config::KvtierConfig;
use crate::memory::RegionRegistry;
use crate::metrics::names;
use crate::transport::tcp::{TcpTransport, TcpTransportConfig};
use crate::transport::ucx::UcxTransport;
use crate::transport::{GetItem, PutItem, Transport, TransportError};
use master::MasterLink;

/// Issue 29 §3: why one object of a cluster put or get failed, typed. The texts say what
/// happened; [`ObjectError::is_infrastructure`] tells a cluster fault (no leader, a node
/// down, no room, a timeout: retry later or elsewhere) from the caller's own mistake.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ObjectError {
    /// No live node lists the object (a miss, not a fault).
    #[error("not found")]
    NotFound,
    /// Another writer claimed the key first and has not committed yet.
    #[error("another writer is storing this object right now")]
    Busy,
    /// No live node (with the required tags) has room for it.
    #[error("no room: no live node (with the required tags) has room")]
    NoRoom,
    /// The master could not be reached, no master leads, or it failed the call.
    #[error("master unavailable: {0}")]
    Master(String),
    /// A node could not be reached, is marked down, timed out or failed the transfer.
    #[error("node unavailable: {0}")]
    Node(String),
    /// The bytes reached no node, or the master did not commit them (claim lapsed).
    #[error("not stored: {0}")]
    NotStored(String),
    /// The master's reply did not match the request.
    #[error("kvtier master sent a malformed reply: {0}")]
    BadReply(String),
    /// The caller's input for this object (its buffer) was refused before any I/O.
    #[error("{0}")]
    Caller(String),
    /// Issue 28: the object is stored with another length than the caller's buffer (the
    /// caller's to fix).
    #[error("{0}")]
    WrongLength(String),
    /// Issue 28: every copy read failed its end-to-end checksum (forged, torn or another
    /// key's bytes): never a hit.
    #[error("integrity: {0}")]
    Integrity(String),
    /// The master refused the request itself (a bad key or size): the caller's to fix.
    #[error("refused by the master: {0}")]
    Refused(String),
}

impl ObjectError {
    /// A fault of the cluster (master, nodes, room, timeouts), not of the caller's request:
    /// the same call may succeed later.
    pub fn is_infrastructure(&self) -> bool {
        matches!(
            self,
            ObjectError::NoRoom
                | ObjectError::Master(_)
                | ObjectError::Node(_)
                | ObjectError::NotStored(_)
                | ObjectError::BadReply(_)
                | ObjectError::Integrity(_)
        )
    }

    /// What this failure means for its item (issue 28; see [`crate::error::ItemFailure`]).
    pub fn item_failure(&self) -> kvtier_proto::ItemFailure {
        use kvtier_proto::ItemFailure;
        match self {
            ObjectError::NotFound => ItemFailure::Miss,
            ObjectError::Busy => ItemFailure::Busy,
            ObjectError::NoRoom => ItemFailure::NoRoom,
            ObjectError::Master(_)
            | ObjectError::Node(_)
            | ObjectError::NotStored(_)
            | ObjectError::BadReply(_) => ItemFailure::Unavailable,
            ObjectError::Caller(_) => ItemFailure::BadBuffer,
            ObjectError::WrongLength(_) => ItemFailure::WrongLength,
            ObjectError::Integrity(_) => ItemFailure::Integrity,
            ObjectError::Refused(_) => ItemFailure::Failed,
        }
    }
}

/// A master call's failure as an object's: the master refusing the request's content is the
/// caller's; anything else (unreachable, no leader, a timeout, overload) the cluster's.
fn master_error(e: &ClusterError) -> ObjectError {
    match e {
        ClusterError::Rpc {
            code: tonic::Code::InvalidArgument | tonic::Code::OutOfRange,
            ..
        } => ObjectError::Refused(e.to_string()),
        e => ObjectError::Master(e.to_string()),
    }
}

/// A node transfer's failure as an object's.
fn node_error(e: &TransportError) -> ObjectError {
    ObjectError::Node(e.to_string())
}

/// A failed read of one copy as the object's failure, typed (issue 28).
fn fetch_error(e: &TransportError) -> ObjectError {
    match e {
        // The node evicted it: a miss unless another copy answers.
        TransportError::NotFound { .. } => ObjectError::NotFound,
        // A wrong-sized buffer is the caller's.
        TransportError::SizeMismatch { .. } => ObjectError::WrongLength(e.to_string()),
        TransportError::Integrity { .. } => ObjectError::Integrity(e.to_string()),
        e => node_error(e),
    }
}

/// The cluster-mode store of one client.
#[derive(Debug)]
pub struct ClusterStore {
    runtime: tokio::runtime::Runtime,
    master: MasterLink,
    transport: Arc<dyn Transport>,
    /// Issue 17: the same transport, for its per-peer choice (stats).
    ucx: Arc<UcxTransport>,
    /// `NUL 'C' tag 0x1f` ([`kvtier_proto::namespace::cluster_prefix`]; the empty tag without
    /// `extra_backend_tag`): prefixed to every key. It is the cluster namespace, which no local
    /// tenant's keys can spell, and the only one nodes' data ports serve.
    namespace: Vec<u8>,
    namespace_name: String,
    node_id: String,
    node_address: Option<String>,
    required_tags: Vec<String>,
    cache_remote_fetches: bool,
    nodes: RwLock<HashMap<u32, NodeInfo>>,
    /// Objects read whose bytes failed their end-to-end checksum.
    integrity_failures: std::sync::atomic::AtomicU64,
}

/// One node's part of a put: (object index, its result) per object sent there.
type NodeOutcome = (u32, Vec<(usize, Result<(), ObjectError>)>);

/// Where one object of a get comes from.
struct Fetch {
    object: usize,
    candidates: Vec<u32>,
}

impl ClusterStore {
    pub fn open(config: &KvtierConfig) -> Result<ClusterStore, ClusterError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kvtier-cluster")
            .enable_all()
            .build()
            .map_err(|e| ClusterError::Setup(format!("cannot start the RPC runtime: {e}")))?;
        let timeout = Duration::from_millis(config.cluster_request_timeout_ms);
        let tcp = TcpTransport::new(TcpTransportConfig {
            token: config
                .cluster_token
                .clone()
                .unwrap_or_default()
                .into_bytes(),
            end_to_end_checksums: true,
            name: format!("kvtier-client pid {}", std::process::id()),
            connections_per_peer: usize::try_from(config.cluster_connections_per_peer).unwrap_or(4),
            request_timeout: timeout,
            down_backoff: timeout,
        });
        // Issue 17: reads over UCX where `cluster_transport` picks it, frames otherwise.
        let choice = crate::transport::ucx::TransportChoice::parse(&config.cluster_transport)
            .map_err(ClusterError::Setup)?;
        // Issue 26 §1: the client's UCX binds only to the interface of its `node_address` or,
        // without one, the interface it reaches its master from.
        let bind = match choice {
            crate::transport::ucx::TransportChoice::Tcp => Err("no UCX".to_string()),
            _ => crate::transport::ucx::devices::client_address(
                config.node_address.as_deref(),
                &config.master_addresses(),
            ),
        };
        let transport = Arc::new(UcxTransport::new(tcp, choice, timeout, bind));
        let namespace = kvtier_proto::namespace::cluster_prefix(
            config.extra_backend_tag.as_deref().unwrap_or_default(),
        );
        let store = ClusterStore {
            runtime,
            master: MasterLink::new(
                config.master_addresses(),
                config
                    .cluster_token
                    .clone()
                    .unwrap_or_default()
                    .into_bytes(),
                timeout,
                Duration::from_millis(config.cluster_master_retry_ms),
            ),
            transport: Arc::clone(&transport) as Arc<dyn Transport>,
            ucx: transport,
            namespace,
            namespace_name: config.extra_backend_tag.clone().unwrap_or_default(),
            node_id: config.node_id.clone().unwrap_or_default(),
            node_address: config.node_address.clone(),
            required_tags: config.node_tag_list(),
            cache_remote_fetches: config.cache_remote_fetches,
            nodes: RwLock::new(HashMap::new()),
            integrity_failures: Default::default(),
        };
        // Fail at open when no master answers, as server mode fails on a wrong socket.
        store.cluster_info()?;
        Ok(store)
    }

    /// The leader's view: nodes, object count, leader address.
    pub fn cluster_info(&self) -> Result<kvtier_rpc::ClusterReply, ClusterError> {
        let reply =
            self.runtime.block_on(self.master.call(|mut c| async move {
                c.cluster(kvtier_rpc::ClusterRequest::default()).await
            }))?;
        self.learn_nodes(&reply.nodes);
        Ok(reply)
    }

    fn learn_nodes(&self, nodes: &[NodeInfo]) {
        if nodes.is_empty() {
            return;
        }
        let mut table = self.nodes.write();
        table.clear();
        for n in nodes {
            table.insert(n.index, n.clone());
        }
    }

    fn node_address_of(&self, index: u32) -> Option<String> {
        self.nodes
            .read()
            .get(&index)
            .filter(|n| n.alive)
            .map(|n| n.data_address.clone())
    }

    /// The master's index of this client's own node, if it is registered and alive.
    fn local_index(&self) -> Option<u32> {
        self.nodes
            .read()
            .values()
            .find(|n| {
                n.alive
                    && ((!self.node_id.is_empty() && n.node_id == self.node_id)
                        || self.node_address.as_deref() == Some(n.data_address.as_str()))
            })
            .map(|n| n.index)
    }

    fn local_node_id(&self) -> String {
        if !self.node_id.is_empty() {
            return self.node_id.clone();
        }
        let Some(address) = &self.node_address else {
            return String::new();
        };
        self.nodes
            .read()
            .values()
            .find(|n| &n.data_address == address)
            .map(|n| n.node_id.clone())
            .unwrap_or_default()
    }

    fn full_key(&self, prefix: &[u8], page_key: &[u8], suffix: &[u8]) -> Vec<u8> {
        let mut key = Vec::new();
        compose_key(prefix, page_key, suffix, &mut key);
        let mut out = Vec::with_capacity(self.namespace.len() + key.len());
        out.extend_from_slice(&self.namespace);
        out.extend_from_slice(&key);
        out
    }

    /// Compose `pages x components` namespaced keys.
    pub fn compose_keys<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        prefix: &[u8],
        page_keys: &[K],
        suffixes: &[S],
    ) -> Vec<Vec<u8>> {
        let mut keys = Vec::with_capacity(page_keys.len() * suffixes.len());
        for p in page_keys {
            for s in suffixes {
                keys.push(self.full_key(prefix, p.as_ref(), s.as_ref()));
            }
        }
        keys
    }

    /// Store objects (put-if-absent across the cluster); `Ok` per object once it is visible
    /// (stored now or already present).
    pub fn put_objects(
        &self,
        keys: &[Vec<u8>],
        values: &[Result<&[u8], String>],
        depths: &[Option<u32>],
    ) -> Vec<Result<(), ObjectError>> {
        self.put_objects_noting(keys, values, depths, &mut Vec::new())
    }

    /// [`put_objects`](Self::put_objects) that also sets `fresh[i]` for every object this call
    /// committed (not the ones already present): what a page rollback may remove (issue 16).
    pub fn put_objects_noting(
        &self,
        keys: &[Vec<u8>],
        values: &[Result<&[u8], String>],
        depths: &[Option<u32>],
        fresh: &mut Vec<bool>,
    ) -> Vec<Result<(), ObjectError>> {
        fresh.clear();
        fresh.resize(keys.len(), false);
        let mut out: Vec<Result<(), ObjectError>> = values
            .iter()
            .map(|v| {
                v.as_ref()
                    .map(|_| ())
                    .map_err(|e| ObjectError::Caller(e.clone()))
            })
            .collect();
        let wanted: Vec<usize> = (0..keys.len()).filter(|&i| values[i].is_ok()).collect();
        if wanted.is_empty() {
            return out;
        }
        let request = PlacePutsRequest {
            client_node_id: self.local_node_id(),
            namespace: self.namespace_name.clone(),
            keys: wanted.iter().map(|&i| keys[i].clone()).collect(),
            sizes: wanted
                .iter()
                .map(|&i| values[i].as_ref().map_or(0, |v| v.len() as u64))
                .collect(),
            required_tags: self.required_tags.clone(),
        };
        let placed = match self.runtime.block_on(self.master.call(|mut c| {
            let request = request.clone();
            async move { c.place_puts(request).await }
        })) {
            Ok(p) => p,
            Err(e) => {
                let error = master_error(&e);
                for &i in &wanted {
                    out[i] = Err(error.clone());
                }
                return out;
            }
        };
        if placed.placements.len() != wanted.len() {
            for &i in &wanted {
                out[i] = Err(ObjectError::BadReply(
                    "a different number of placements".into(),
                ));
            }
            return out;
        }
        self.learn_nodes(&placed.nodes);
        // Per node, the objects to write there.
        let mut per_node: HashMap<u32, Vec<usize>> = HashMap::new();
        let mut to_commit: Vec<usize> = Vec::new();
        for (slot, placement) in placed.placements.iter().enumerate() {
            let i = wanted[slot];
            match PlaceStatus::try_from(placement.status) {
                Ok(PlaceStatus::Write) => {
                    to_commit.push(slot);
                    for &n in &placement.nodes {
                        per_node.entry(n).or_default().push(i);
                    }
                }
                Ok(PlaceStatus::Present) => {}
                Ok(PlaceStatus::Busy) => out[i] = Err(ObjectError::Busy),
                Ok(PlaceStatus::NoSpace) => out[i] = Err(ObjectError::NoRoom),
                Err(_) => {
                    out[i] = Err(ObjectError::BadReply(format!(
                        "unknown placement status {}",
                        placement.status
                    )))
                }
            }
        }
        let (stored, write_errors) = self.write_to_nodes(keys, values, depths, &per_node);
        let commit = claim_commit(placed.claim, &to_commit, |slot| {
            let i = wanted[slot];
            (keys[i].clone(), stored.get(&i).cloned().unwrap_or_default())
        });
        if commit.keys.is_empty() {
            return out;
        }
        match self.runtime.block_on(self.master.call(|mut c| {
            let commit = commit.clone();
            async move { c.commit_puts(commit).await }
        })) {
            Ok(reply) if reply.committed.len() == to_commit.len() => {
                for (&slot, committed) in to_commit.iter().zip(reply.committed) {
                    let i = wanted[slot];
                    fresh[i] = committed;
                    if !committed {
                        out[i] = Err(match (stored.get(&i), write_errors.get(&i)) {
                            (Some(n), _) if !n.is_empty() => ObjectError::NotStored(
                                "the master did not commit the put (claim lapsed)".to_string(),
                            ),
                            // The node's own failure says what happened (down, timeout).
                            (_, Some(e)) => e.clone(),
                            _ => ObjectError::NotStored("no node stored the object".to_string()),
                        });
                    }
                }
            }
            Ok(_) => {
                for &slot in &to_commit {
                    out[wanted[slot]] = Err(ObjectError::BadReply(
                        "a different number of commits".into(),
                    ));
                }
            }
            Err(e) => {
                let error = master_error(&e);
                for &slot in &to_commit {
                    out[wanted[slot]] = Err(error.clone());
                }
            }
        }
        out
    }

    /// Write objects to their nodes (one thread per node when there are several); returns,
    /// per object, the nodes that stored it.
    fn write_to_nodes(
        &self,
        keys: &[Vec<u8>],
        values: &[Result<&[u8], String>],
        depths: &[Option<u32>],
        per_node: &HashMap<u32, Vec<usize>>,
    ) -> (HashMap<usize, Vec<u32>>, HashMap<usize, ObjectError>) {
        let run = |node: u32, objects: &[usize]| -> Vec<(usize, Result<(), ObjectError>)> {
            let Some(address) = self.node_address_of(node) else {
                return objects
                    .iter()
                    .map(|&i| {
                        (
                            i,
                            Err(ObjectError::Node(format!("node {node} is not live"))),
                        )
                    })
                    .collect();
            };
            let items: Vec<PutItem<'_>> = objects
                .iter()
                .map(|&i| PutItem {
                    key: &keys[i],
                    value: values[i].as_ref().map_or(&[][..], |v| v),
                    depth: depths.get(i).copied().flatten(),
                })
                .collect();
            let results = self.transport.put(&address, &items);
            objects
                .iter()
                .zip(results)
                .map(|(&i, r)| (i, r.map_err(|e| node_error(&e))))
                .collect()
        };
        let outcomes: Vec<NodeOutcome> = if per_node.len() <= 1 {
            per_node
                .iter()
                .map(|(&n, objs)| (n, run(n, objs)))
                .collect()
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = per_node
                    .iter()
                    .map(|(&n, objs)| (n, objs.len(), scope.spawn(move || run(n, objs))))
                    .collect();
                handles
                    .into_iter()
                    .map(|(n, _, h)| (n, h.join().unwrap_or_default()))
                    .collect()
            })
        };
        let mut stored: HashMap<usize, Vec<u32>> = HashMap::new();
        let mut errors: HashMap<usize, ObjectError> = HashMap::new();
        for (node, results) in outcomes {
            for (i, r) in results {
                match r {
                    Ok(()) => stored.entry(i).or_default().push(node),
                    Err(e) => {
                        errors.insert(i, e);
                    }
                }
            }
        }
        (stored, errors)
    }

    /// Read objects into their destinations; `Ok` per object copied whole.
    pub fn get_objects(
        &self,
        keys: &[Vec<u8>],
        dsts: Vec<Result<&mut [u8], String>>,
    ) -> Vec<Result<(), ObjectError>> {
        let mut out: Vec<Result<(), ObjectError>> = Vec::with_capacity(keys.len());
        let mut slots: Vec<Option<&mut [u8]>> = Vec::with_capacity(keys.len());
        for d in dsts {
            match d {
                Ok(d) => {
                    out.push(Err(ObjectError::NotFound));
                    slots.push(Some(d));
                }
                Err(e) => {
                    out.push(Err(ObjectError::Caller(e)));
                    slots.push(None);
                }
            }
        }
        let wanted: Vec<usize> = (0..keys.len()).filter(|&i| slots[i].is_some()).collect();
        if wanted.is_empty() {
            return out;
        }
        let reply = match self.lookup(wanted.iter().map(|&i| keys[i].clone()).collect()) {
            Ok(r) => r,
            Err(e) => {
                let error = master_error(&e);
                for &i in &wanted {
                    out[i] = Err(error.clone());
                }
                return out;
            }
        };
        let local = self.local_index();
        let mut fetches: Vec<Fetch> = Vec::new();
        for (slot, location) in reply.locations.into_iter().enumerate() {
            let mut candidates = location.nodes;
            if candidates.is_empty() {
                continue;
            }
            // Local copy first.
            if let Some(l) = local {
                if let Some(pos) = candidates.iter().position(|&n| n == l) {
                    candidates.swap(0, pos);
                }
            }
            fetches.push(Fetch {
                object: wanted[slot],
                candidates,
            });
        }
        let mut dropped: HashMap<u32, Vec<Vec<u8>>> = HashMap::new();
        let mut remote_hits: Vec<usize> = Vec::new();
        // Round r tries each object's r-th candidate.
        for round in 0..kvtier_rpc::MAX_REPLICAS {
            let mut per_node: HashMap<u32, Vec<usize>> = HashMap::new();
            for f in &fetches {
                if out[f.object].is_ok() {
                    continue;
                }
                if let Some(&n) = f.candidates.get(round) {
                    per_node.entry(n).or_default().push(f.object);
                }
            }
            if per_node.is_empty() {
                break;
            }
            for (node, objects) in per_node {
                let Some(address) = self.node_address_of(node) else {
                    continue;
                };
                let mut items: Vec<GetItem<'_>> = Vec::with_capacity(objects.len());
                let mut taken: Vec<(usize, &mut [u8])> = Vec::with_capacity(objects.len());
                for &i in &objects {
                    if let Some(d) = slots[i].take() {
                        taken.push((i, d));
                    }
                }
                for (i, d) in taken.iter_mut() {
                    items.push(GetItem {
                        key: &keys[*i],
                        dst: d,
                    });
                }
                let results = self.transport.get(&address, &mut items);
                drop(items);
                for ((i, d), r) in taken.into_iter().zip(results) {
                    match r {
                        Ok(()) => {
                            out[i] = Ok(());
                            if Some(node) != local {
                                remote_hits.push(i);
                            }
                        }
                        Err(e) => {
                            if matches!(e, TransportError::NotFound { .. }) {
                                dropped.entry(node).or_default().push(keys[i].clone());
                            }
                            if let TransportError::Integrity { peer, message } = &e {
                                self.note_integrity_failure(peer, message);
                            }
                            out[i] = Err(fetch_error(&e));
                        }
                    }
                    slots[i] = Some(d);
                }
            }
        }
        for (node, keys) in dropped {
            // Heal the directory: that node no longer holds these.
            let request = ReportDroppedRequest {
                node,
                keys,
                node_secret: Vec::new(),
            };
            let _ = self.runtime.block_on(self.master.call(|mut c| {
                let request = request.clone();
                async move { c.report_dropped(request).await }
            }));
        }
        if self.cache_remote_fetches && !remote_hits.is_empty() {
            if let Some(local) = local {
                self.cache_locally(local, keys, &remote_hits, &slots);
            }
        }
        out
    }

    /// Count and log a copy that failed its end-to-end checksum (a miss, never a hit).
    fn note_integrity_failure(&self, peer: &str, message: &str) {
        self.integrity_failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        metrics::counter!(names::CLUSTER_INTEGRITY_FAILURES, "peer" => peer.to_string())
            .increment(1);
        tracing::warn!(
            peer,
            reason = %message,
            "kvtier cluster: an object failed its checksum; a miss"
        );
    }

    /// Copy objects just fetched from other nodes into the local node, as extra replicas.
    fn cache_locally(
        &self,
        local: u32,
        keys: &[Vec<u8>],
        objects: &[usize],
        slots: &[Option<&mut [u8]>],
    ) {
        let Some(address) = self.node_address_of(local) else {
            return;
        };
        let items: Vec<PutItem<'_>> = objects
            .iter()
            .filter_map(|&i| {
                slots[i].as_deref().map(|d| PutItem {
                    key: &keys[i],
                    value: d,
                    depth: None,
                })
            })
            .collect();
        let results = self.transport.put(&address, &items);
        let stored: Vec<Vec<u8>> = items
            .iter()
            .zip(results)
            .filter_map(|(item, r)| r.is_ok().then(|| item.key.to_vec()))
            .collect();
        if stored.is_empty() {
            return;
        }
        // Claim 0 adds a replica to entries that exist; the node named by id as well, so a
        // master that numbered it otherwise (a takeover since) commits nothing.
        let target_node_id = self
            .nodes
            .read()
            .get(&local)
            .map(|n| n.node_id.clone())
            .unwrap_or_default();
        let commit = CommitPutsRequest {
            claim: 0,
            stored: stored
                .iter()
                .map(|_| NodeList { nodes: vec![local] })
                .collect(),
            keys: stored,
            target_node_id,
        };
        let _ = self.runtime.block_on(self.master.call(|mut c| {
            let commit = commit.clone();
            async move { c.commit_puts(commit).await }
        }));
    }

    /// Page batch over registered memory (the shared entry of the [`crate::store::Store`]
    /// page puts and gets).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn page_io<K: AsRef<[u8]>, S: AsRef<[u8]>>(
        &self,
        regions: &RegionRegistry,
        is_put: bool,
        prefix: &[u8],
        page_keys: &[K],
        suffixes: &[S],
        buffers: &[MemRef],
        depths: Option<&[u32]>,
    ) -> BatchResult {
        let comps = suffixes.len();
        let keys = self.compose_keys(prefix, page_keys, suffixes);
        let per_object = if is_put {
            let sources: Vec<Result<&[u8], String>> = regions
                .source_slices(buffers)
                .into_iter()
                .map(|r| r.map_err(|e| e.to_string()))
                .collect();
            let depths: Vec<Option<u32>> = (0..keys.len())
                .map(|o| depths.map(|d| d[o / comps.max(1)]))
                .collect();
            let mut fresh = Vec::new();
            let out = self.put_objects_noting(&keys, &sources, &depths, &mut fresh);
            // issue 16: a failed page leaves none of its components behind.
            self.roll_back_failed_pages(&keys, &out, &fresh, comps);
            out
        } else {
            let dsts: Vec<Result<&mut [u8], String>> = regions
                .destination_slices(buffers)
                .into_iter()
                .map(|r| r.map_err(|e| e.to_string()))
                .collect();
            self.get_objects(&keys, dsts)
        };
        let mut result = BatchResult::with_capacity(page_keys.len());
        for (page, chunk) in per_object.chunks(comps.max(1)).enumerate() {
            // A page fails as its first failing component (issue 28: typed).
            match chunk.iter().find_map(|r| r.as_ref().err()) {
                None => result.push_ok(),
                Some(e) => {
                    if is_put || *e != ObjectError::NotFound {
                        result.note_error(format!(
                            "{}: {e}",
                            String::from_utf8_lossy(page_keys[page].as_ref())
                        ));
                    }
                    result.push_failed(e.item_failure());
                }
            }
        }
        result
    }

    /// Whether each namespaced key is visible in the directory (live nodes only).
    pub fn exists_full_keys(&self, keys: &[Vec<u8>]) -> Result<Vec<bool>, ClusterError> {
        Ok(self
            .lookup(keys.to_vec())?
            .locations
            .iter()
            .map(|l| !l.nodes.is_empty())
            .collect())
    }

    /// One whole v2 existence query, evaluated by the master (the [`crate::store::Store`]
    /// call answers a miss when it fails).
    pub(crate) fn exists_v2_at_master(
        &self,
        query: &ExistsV2Query,
    ) -> Result<ExistsV2Answer, ClusterError> {
        let mut query = query.clone();
        let mut prefix = self.namespace.clone();
        prefix.extend_from_slice(&query.key_prefix);
        query.key_prefix = prefix;
        let request = ExistsV2Request {
            query: query
                .encode_to_vec()
                .map_err(|e| ClusterError::Setup(e.to_string()))?,
        };
        let reply = self.runtime.block_on(self.master.call(|mut c| {
            let request = request.clone();
            async move { c.exists_v2(request).await }
        }))?;
        ExistsV2Answer::decode(&reply.answer).map_err(|e| ClusterError::BadReply(e.to_string()))
    }

    /// Remove namespaced keys from the directory and from the nodes holding them; how many
    /// were held.
    pub fn remove_full_keys(&self, full: Vec<Vec<u8>>) -> Result<usize, ClusterError> {
        let request = ForgetRequest { keys: full.clone() };
        let reply = self.runtime.block_on(self.master.call(|mut c| {
            let request = request.clone();
            async move { c.forget(request).await }
        }))?;
        self.learn_nodes(&reply.nodes);
        let mut per_node: HashMap<u32, Vec<&[u8]>> = HashMap::new();
        let mut held = 0;
        for (key, holders) in full.iter().zip(&reply.held_by) {
            if !holders.nodes.is_empty() {
                held += 1;
            }
            for &n in &holders.nodes {
                per_node.entry(n).or_default().push(key);
            }
        }
        for (node, keys) in per_node {
            if let Some(address) = self.node_address_of(node) {
                if let Err(e) = self.transport.remove(&address, &keys) {
                    tracing::warn!(error = %e, "kvtier cluster: removing on a node failed");
                }
            }
        }
        Ok(held)
    }

    /// Mark namespaced keys superseded window state on every live node holding them (the
    /// eviction hint of `Client::demote_pages` (kvtier-client)): one directory
    /// lookup, then one request per holder. Returns how many copies were marked; a node that
    /// cannot be reached is logged and skipped (a hint, nothing is lost).
    pub fn demote_keys(&self, keys: &[Vec<u8>]) -> Result<usize, ClusterError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let reply = self.lookup(keys.to_vec())?;
        let mut per_node: HashMap<u32, Vec<&[u8]>> = HashMap::new();
        for (key, holders) in keys.iter().zip(&reply.locations) {
            for &n in &holders.nodes {
                per_node.entry(n).or_default().push(key);
            }
        }
        let mut marked = 0;
        for (node, keys) in per_node {
            let Some(address) = self.node_address_of(node) else {
                continue;
            };
            match self.transport.demote(&address, &keys) {
                Ok(ok) => marked += ok.iter().filter(|&&m| m).count(),
                Err(e) => {
                    tracing::warn!(error = %e, "kvtier cluster: demote hint to a node failed")
                }
            }
        }
        Ok(marked)
    }

    /// Remove every object of this client's namespace (without `extra_backend_tag`: the
    /// untagged namespace's objects) from every live node and from the directory. Each node removes up to
    /// `MAX_CLEARED_KEYS` keys per request and names them; they are forgotten at the master
    /// before the next request, so when this returns no node holds and no exists sees them.
    /// Objects on nodes that are down are forgotten with the lease (they are misses already).
    /// Returns how many objects were removed; the first node that failed is the error (the
    /// others are still cleared). The [`crate::store::Store`] call logs that error.
    pub(crate) fn clear_every_node(&self) -> Result<usize, ClusterError> {
        let info = self.cluster_info()?;
        if !info.is_leader {
            return Err(ClusterError::NoLeader {
                last: "the master that answered the node list does not lead".into(),
            });
        }
        let mut removed = 0;
        let mut first_failure = None;
        for node in info.nodes.iter().filter(|n| n.alive) {
            loop {
                let keys = match self
                    .transport
                    .clear_prefix(&node.data_address, &self.namespace)
                {
                    Ok(keys) => keys,
                    Err(source) => {
                        first_failure.get_or_insert(ClusterError::Node {
                            node: node.node_id.clone(),
                            source,
                        });
                        break;
                    }
                };
                let more = keys.len() >= MAX_CLEARED_KEYS;
                if !keys.is_empty() {
                    removed += keys.len();
                    let request = ForgetRequest { keys };
                    self.runtime.block_on(self.master.call(|mut c| {
                        let request = request.clone();
                        async move { c.forget(request).await }
                    }))?;
                }
                if !more {
                    break;
                }
            }
        }
        match first_failure {
            Some(e) => Err(e),
            None => Ok(removed),
        }
    }

    /// The ids of the live nodes holding `key` (a whole key, namespaced here).
    pub fn where_is(&self, key: &[u8]) -> Result<Vec<String>, ClusterError> {
        let reply = self.lookup(vec![self.namespaced(key)])?;
        let table = self.nodes.read();
        Ok(reply
            .locations
            .first()
            .map(|l| {
                l.nodes
                    .iter()
                    .filter_map(|n| table.get(n).map(|i| i.node_id.clone()))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Where the directory says each namespaced key is: one `Lookup` round trip, one location
    /// per key (checked), the reply's node addresses learned.
    fn lookup(&self, keys: Vec<Vec<u8>>) -> Result<LookupReply, ClusterError> {
        let count = keys.len();
        let lookup = LookupRequest { keys };
        let reply = self.runtime.block_on(self.master.call(|mut c| {
            let lookup = lookup.clone();
            async move { c.lookup(lookup).await }
        }))?;
        if reply.locations.len() != count {
            return Err(ClusterError::BadReply(format!(
                "{} locations for {count} keys",
                reply.locations.len()
            )));
        }
        self.learn_nodes(&reply.nodes);
        Ok(reply)
    }

    /// Objects this client read whose bytes failed their end-to-end checksum (each a miss).
    /// Issue 17: the data transport in use per peer read from (`peer_transports` in stats).
    pub fn peer_transports(&self) -> Vec<crate::transport::ucx::PeerTransport> {
        self.ucx.peer_transports()
    }

    /// UCX requests issued and not yet released (`ucx_outstanding_requests` in stats).
    pub fn ucx_outstanding_requests(&self) -> usize {
        self.ucx.outstanding_requests()
    }

    /// The UCX transport (host-memory registration, counters).
    pub fn ucx(&self) -> &UcxTransport {
        &self.ucx
    }

    pub fn integrity_failures(&self) -> u64 {
        self.integrity_failures
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The namespace of whole keys (single-key calls prefix it themselves).
    pub fn namespaced(&self, key: &[u8]) -> Vec<u8> {
        self.full_key(&[], key, &[])
    }
}

/// The commit of a placed write (`claim` from `PlacePuts`): per slot, its key and the node
/// indexes that now hold it (`of(slot)`).
fn claim_commit(
    claim: u64,
    slots: &[usize],
    of: impl Fn(usize) -> (Vec<u8>, Vec<u32>),
) -> CommitPutsRequest {
    let (keys, stored): (Vec<Vec<u8>>, Vec<NodeList>) = slots
        .iter()
        .map(|&slot| {
            let (key, nodes) = of(slot);
            (key, NodeList { nodes })
        })
        .unzip();
    CommitPutsRequest {
        claim,
        keys,
        stored,
        target_node_id: String::new(),
    }
}
