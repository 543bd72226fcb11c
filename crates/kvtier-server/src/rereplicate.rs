//! The node side of re-replication: copy tasks from the master's heartbeat replies are carried
//! out here, off the agent's heartbeat loop (a slow or dead target must never delay the
//! heartbeats that keep this node's lease).
//!
//! One worker thread per node takes a task (key hashes and a target node), maps the hashes to
//! the keys this node holds, reads each object from the store, pushes it to the target's data
//! port with the cluster token (the ordinary [`TcpTransport`] put, put-if-absent there), and
//! commits what arrived as extra replicas (`CommitPuts`, claim 0, `stored = [target]`). Copies
//! the master did not commit (the key was forgotten meanwhile) are removed from the target, so
//! its next registration does not bring them back.
//!
//! Failures are logged and counted, never fatal: a hash this node no longer holds (evicted
//! since), a target that refused or is unreachable, a commit that failed. They are also
//! reported in the node's next heartbeat ([`Rereplicator::take_failures`]), and the master
//! plans those tasks again at once (issue 29; before, only after its 20 s timeout).
//!
//! Hashes map to keys through [`HeldKeys`] (every key peers stored since start, by hash, kept
//! as they are stored), then through an index of what the store held at start. So an object
//! stored a moment before its copy task is found: `not_held` means not held (issue 29: an
//! index rebuilt at most every 5 s answered `not_held` for newer objects). Counters: [`names::NODE_REREPLICATION_TASKS`]
//! `{outcome="received"|"done"|"failed"}` per object and
//! [`names::NODE_REREPLICATION_FAILURES`]`{reason}`.
//!
//! Bounds: the master hands a node at most 256 objects per heartbeat and 512 in flight; the
//! worker queues at most [`QUEUED_REPLIES`] replies' tasks (more are refused as `busy`), reads
//! and pushes at most [`PUSH_BYTES`] of objects at a time, keeps at most
//! [`MAX_REPORTED_FAILURES`] failed hashes for the next heartbeat, and keeps the hash-to-key
//! index of the keys held at start only while tasks keep coming (about 100 bytes per object,
//! rebuilt at most every [`INDEX_REFRESH`] when a hash is not in it, freed after
//! [`INDEX_IDLE`] without tasks).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::server::TenantStore;
use kvtier_rpc::{key_hash, KeyHash};
use kvtier_rpc::{CommitPutsRequest, CopyFailure, CopyFailureReason, CopyTask, NodeList};
use kvtier_store::metrics::names;
use kvtier_store::store::Store;
use kvtier_transport::master::MasterLink;
use kvtier_transport::tcp::{TcpTransport, TcpTransportConfig};
use kvtier_transport::{PutItem, Transport};
use parking_lot::Mutex;

use crate::peer::HeldKeys;

/// Heartbeat replies' tasks waiting for the worker (the master keeps at most two replies'
/// worth in flight per node).
pub const QUEUED_REPLIES: usize = 2;
/// Most object bytes read and pushed in one transport call.
pub const PUSH_BYTES: usize = 32 << 20;
/// The hash-to-key index is rebuilt, when a hash is not in it, at most this often.
pub const INDEX_REFRESH: Duration = Duration::from_secs(5);
/// The index is freed after this long without tasks.
pub const INDEX_IDLE: Duration = Duration::from_secs(30);
/// Most failed hashes kept for the next heartbeat (the master reads 1,024; the rest lapse at
/// its task timeout).
pub const MAX_REPORTED_FAILURES: usize = 1024;

/// Failed copy tasks waiting for the next heartbeat.
#[derive(Debug, Default)]
struct Failures {
    list: Vec<CopyFailure>,
    hashes: usize,
}

impl Failures {
    fn add(&mut self, target: u32, reason: CopyFailureReason, hashes: Vec<KeyHash>) {
        let room = MAX_REPORTED_FAILURES.saturating_sub(self.hashes);
        let key_hashes: Vec<Vec<u8>> = hashes
            .into_iter()
            .take(room)
            .map(|h| h.to_bytes().to_vec())
            .collect();
        if key_hashes.is_empty() {
            return;
        }
        self.hashes += key_hashes.len();
        self.list.push(CopyFailure {
            target,
            key_hashes,
            reason: reason as i32,
        });
    }
}

/// How the worker reaches the others.
#[derive(Clone, Debug)]
pub struct RereplicatorConfig {
    pub masters: Vec<String>,
    pub node_id: String,
    pub token: Vec<u8>,
    pub request_timeout: Duration,
}

/// The running worker; stops when dropped.
pub struct Rereplicator {
    tx: Option<SyncSender<Vec<CopyTask>>>,
    failures: Arc<Mutex<Failures>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

fn count_tasks(outcome: &'static str, n: usize) {
    if n > 0 {
        metrics::counter!(names::NODE_REREPLICATION_TASKS, "outcome" => outcome)
            .increment(n as u64);
    }
}

fn count_failures(reason: &'static str, n: usize) {
    if n > 0 {
        count_tasks("failed", n);
        metrics::counter!(names::NODE_REREPLICATION_FAILURES, "reason" => reason)
            .increment(n as u64);
    }
}

impl Rereplicator {
    pub fn start(
        config: RereplicatorConfig,
        store: Arc<TenantStore>,
        held: Arc<HeldKeys>,
    ) -> std::io::Result<Rereplicator> {
        let (tx, rx) = mpsc::sync_channel(QUEUED_REPLIES);
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let failures = Arc::new(Mutex::new(Failures::default()));
        let reports = Arc::clone(&failures);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = std::thread::Builder::new()
            .name("kvtier-rereplicate".into())
            .spawn(move || {
                let mut worker = Worker::new(config, store, held, runtime, flag, reports);
                worker.run(rx);
            })?;
        Ok(Rereplicator {
            tx: Some(tx),
            failures,
            stop,
            handle: Some(handle),
        })
    }

    /// Queue one heartbeat reply's tasks; refused (counted `busy`, reported as failed) while
    /// the worker is behind.
    pub fn submit(&self, tasks: Vec<CopyTask>) {
        let objects: usize = tasks.iter().map(|t| t.key_hashes.len()).sum();
        if objects == 0 {
            return;
        }
        count_tasks("received", objects);
        let Some(tx) = &self.tx else { return };
        let refused = match tx.try_send(tasks) {
            Ok(()) => return,
            Err(TrySendError::Full(tasks)) => {
                tracing::warn!(
                    "kvtier serve: re-replication: {objects} copy tasks refused, the worker is \
                     still busy (the master plans them again)"
                );
                tasks
            }
            Err(TrySendError::Disconnected(tasks)) => tasks,
        };
        count_failures("busy", objects);
        let mut failures = self.failures.lock();
        for task in refused {
            let hashes = task
                .key_hashes
                .iter()
                .filter_map(|h| KeyHash::from_bytes(h))
                .collect();
            // Not the target's fault: no reason that makes the master avoid it.
            failures.add(task.target, CopyFailureReason::CopyFailureCommit, hashes);
        }
    }

    /// The copy tasks that failed since the last call, for the next heartbeat (issue 29: the
    /// master plans them again at once).
    pub fn take_failures(&self) -> Vec<CopyFailure> {
        let mut failures = self.failures.lock();
        failures.hashes = 0;
        std::mem::take(&mut failures.list)
    }
}

impl Drop for Rereplicator {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.tx.take();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

struct Worker {
    store: Arc<TenantStore>,
    held: Arc<HeldKeys>,
    runtime: tokio::runtime::Runtime,
    link: MasterLink,
    transport: TcpTransport,
    stop: Arc<AtomicBool>,
    failures: Arc<Mutex<Failures>>,
    /// Keys the store held at start (the rest are in `held`), by hash.
    index: HashMap<KeyHash, Vec<u8>>,
    index_built: Option<Instant>,
}

impl Worker {
    fn new(
        config: RereplicatorConfig,
        store: Arc<TenantStore>,
        held: Arc<HeldKeys>,
        runtime: tokio::runtime::Runtime,
        stop: Arc<AtomicBool>,
        failures: Arc<Mutex<Failures>>,
    ) -> Worker {
        let link = MasterLink::new(
            config.masters.clone(),
            config.token.clone(),
            config.request_timeout,
            // A commit may span a master failover: look for the leader a while.
            config.request_timeout * 2,
        );
        let transport = TcpTransport::new(TcpTransportConfig {
            token: config.token.clone(),
            // Stored objects already end with their checksum trailer: copied as they are.
            end_to_end_checksums: false,
            name: format!("kvtier node {} re-replication", config.node_id),
            connections_per_peer: 2,
            request_timeout: config.request_timeout,
            down_backoff: config.request_timeout,
        });
        Worker {
            store,
            held,
            runtime,
            link,
            transport,
            stop,
            failures,
            index: HashMap::new(),
            index_built: None,
        }
    }

    fn run(&mut self, rx: Receiver<Vec<CopyTask>>) {
        let mut last_task = Instant::now();
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            match rx.recv_timeout(Duration::from_millis(500)) {
                Ok(tasks) => {
                    last_task = Instant::now();
                    for task in tasks {
                        if self.stop.load(Ordering::SeqCst) {
                            return;
                        }
                        self.copy(&task);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    if !self.index.is_empty() && last_task.elapsed() > INDEX_IDLE {
                        self.index = HashMap::new();
                        self.index_built = None;
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    /// Every cluster key the store lists, by hash (what it held at start is among them; what
    /// peers stored since is in `held` as well).
    fn rebuild_index(&mut self) {
        let mut index = HashMap::new();
        for key in crate::node::keys_in_store(&self.store) {
            index.entry(key_hash(&key)).or_insert(key);
        }
        self.index = index;
        self.index_built = Some(Instant::now());
    }

    /// Each hash's key: stored by a peer since start (`held`, always current), else held at
    /// start (the index; listed again after [`INDEX_REFRESH`] when a hash is in neither).
    fn resolve(&mut self, hashes: &[KeyHash]) -> Vec<Option<Vec<u8>>> {
        let mut keys: Vec<Option<Vec<u8>>> = hashes.iter().map(|h| self.held.key_of(h)).collect();
        let missing = |index: &HashMap<KeyHash, Vec<u8>>, keys: &[Option<Vec<u8>>]| {
            hashes
                .iter()
                .zip(keys)
                .any(|(h, k)| k.is_none() && !index.contains_key(h))
        };
        let stale = self
            .index_built
            .is_none_or(|t| t.elapsed() >= INDEX_REFRESH);
        if stale && missing(&self.index, &keys) {
            self.rebuild_index();
        }
        for (h, k) in hashes.iter().zip(keys.iter_mut()) {
            if k.is_none() {
                *k = self.index.get(h).cloned();
            }
        }
        keys
    }

    /// Carry out one task: read, push, commit. Never panics on a peer's or the store's fault.
    fn copy(&mut self, task: &CopyTask) {
        let hashes: Vec<KeyHash> = task
            .key_hashes
            .iter()
            .filter_map(|h| KeyHash::from_bytes(h))
            .collect();
        let malformed = task.key_hashes.len() - hashes.len();
        let mut not_held_hashes: Vec<KeyHash> = Vec::new();
        let mut keys: Vec<Vec<u8>> = Vec::with_capacity(hashes.len());
        for (hash, key) in hashes.iter().zip(self.resolve(&hashes)) {
            match key {
                Some(key) => keys.push(key),
                None => not_held_hashes.push(*hash),
            }
        }
        let mut not_held = malformed + not_held_hashes.len();
        let mut push_failed_hashes: Vec<KeyHash> = Vec::new();
        let mut push_failed = 0usize;
        let mut push_error: Option<String> = None;
        let mut pushed: Vec<Vec<u8>> = Vec::with_capacity(keys.len());
        let address = task.target_address.as_str();
        // Read up to PUSH_BYTES of objects, push them, repeat.
        let mut at = 0;
        while at < keys.len() {
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            let mut values: Vec<(usize, Vec<u8>)> = Vec::new();
            let mut bytes = 0usize;
            while at < keys.len() && (values.is_empty() || bytes < PUSH_BYTES) {
                let key = &keys[at];
                match self.read(key) {
                    Some(value) => {
                        bytes += value.len();
                        values.push((at, value));
                    }
                    None => {
                        not_held += 1;
                        not_held_hashes.push(key_hash(key));
                    }
                }
                at += 1;
            }
            let items: Vec<PutItem<'_>> = values
                .iter()
                .map(|(i, v)| PutItem {
                    key: &keys[*i],
                    value: v,
                    depth: None,
                })
                .collect();
            let results = self.transport.put(address, &items);
            for ((i, _), result) in values.iter().zip(results) {
                match result {
                    Ok(()) => pushed.push(keys[*i].clone()),
                    Err(e) => {
                        push_failed += 1;
                        push_failed_hashes.push(key_hash(&keys[*i]));
                        push_error.get_or_insert_with(|| e.to_string());
                    }
                }
            }
        }
        let (committed, commit_failed, commit_error, uncommitted) = self.commit(task, &pushed);
        {
            let mut failures = self.failures.lock();
            failures.add(
                task.target,
                CopyFailureReason::CopyFailureNotHeld,
                not_held_hashes,
            );
            failures.add(
                task.target,
                CopyFailureReason::CopyFailurePush,
                push_failed_hashes,
            );
            failures.add(
                task.target,
                CopyFailureReason::CopyFailureCommit,
                uncommitted,
            );
        }
        count_tasks("done", committed);
        count_failures("not_held", not_held);
        count_failures("push", push_failed);
        count_failures("commit", commit_failed);
        let copied = format!(
            "{committed} of {} objects copied to {} ({})",
            task.key_hashes.len(),
            task.target_node_id,
            task.target_address
        );
        log_copy(
            &copied,
            [not_held, push_failed, commit_failed],
            push_error,
            commit_error,
        );
    }

    /// One object's bytes, or `None` when the store no longer has it.
    fn read(&self, key: &[u8]) -> Option<Vec<u8>> {
        let len = usize::try_from(self.store.object_len(key)?).ok()?;
        let mut value = vec![0u8; len];
        // Evicted (or replaced by a different size) between the two calls: not held.
        self.store.get_into_slice(key, &mut value).ok()?;
        Some(value)
    }

    /// Commit `keys` as replicas on the task's target; (committed, not committed, why, the
    /// hashes to report as failed: those the commit call itself failed for).
    fn commit(
        &self,
        task: &CopyTask,
        keys: &[Vec<u8>],
    ) -> (usize, usize, Option<String>, Vec<KeyHash>) {
        if keys.is_empty() {
            return (0, 0, None, Vec::new());
        }
        let request = CommitPutsRequest {
            claim: 0,
            keys: keys.to_vec(),
            stored: keys
                .iter()
                .map(|_| NodeList {
                    nodes: vec![task.target],
                })
                .collect(),
            target_node_id: task.target_node_id.clone(),
        };
        let reply = self.runtime.block_on(self.link.call(|mut c| {
            let request = request.clone();
            async move { c.commit_puts(request).await }
        }));
        match reply {
            Ok(r) if r.committed.len() == keys.len() => {
                let orphans: Vec<&[u8]> = keys
                    .iter()
                    .zip(&r.committed)
                    .filter(|(_, ok)| !**ok)
                    .map(|(k, _)| k.as_slice())
                    .collect();
                if !orphans.is_empty() {
                    // Forgotten meanwhile: do not leave a copy the target would register.
                    let _ = self.transport.remove(&task.target_address, &orphans);
                }
                let failed = orphans.len();
                // Forgotten keys have no task left to plan again: nothing to report.
                (
                    keys.len() - failed,
                    failed,
                    (failed > 0).then(|| "no longer in the directory".to_string()),
                    Vec::new(),
                )
            }
            Ok(_) => (
                0,
                keys.len(),
                Some("the master answered a different number of commits".into()),
                keys.iter().map(|k| key_hash(k)).collect(),
            ),
            // The copies stay on the target; the master plans the task again, and the
            // target's next registration lists them.
            Err(e) => (
                0,
                keys.len(),
                Some(e.to_string()),
                keys.iter().map(|k| key_hash(k)).collect(),
            ),
        }
    }
}

/// One copy task's outcome in the log (levels, timestamps: the soak times copies from these):
/// `copied`, then the failures by kind (`[not held here, not stored there, not committed]`).
fn log_copy(
    copied: &str,
    [not_held, push_failed, commit_failed]: [usize; 3],
    push_error: Option<String>,
    commit_error: Option<String>,
) {
    if not_held + push_failed + commit_failed == 0 {
        tracing::info!("kvtier serve: re-replication: {copied}");
        return;
    }
    tracing::warn!(
        "kvtier serve: re-replication: {copied}; failed: {not_held} no longer held here, \
         {push_failed} not stored there{}, {commit_failed} not committed{}",
        push_error.map(|e| format!(" ({e})")).unwrap_or_default(),
        commit_error.map(|e| format!(" ({e})")).unwrap_or_default()
    );
}
