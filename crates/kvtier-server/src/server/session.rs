//! Sessions: what one client process owns on the server.
//!
//! Owns: a session's identity (id, unguessable token, tenant, the uid that opened it), its
//! mapped regions (client memfds, [`Mapping`]) with their byte accounting against the
//! per-client and server-wide limits, its request counters, and its end.
//!
//! Invariants:
//! - A mapping's bytes are reserved (session, then server) before the memfd is mapped, and
//!   given back when it is unregistered or the session ends, so concurrent registrations
//!   cannot all pass a limit checked before any of them is counted.
//! - A session ends when its last connection closes (a client killed with SIGKILL included):
//!   its mappings leave the table then, and each is unmapped once the last request still
//!   holding it (in a [`kvtier_store::store::CheckedBuffers`]) finishes.
//! - Import direction (issue 28): this module never names the server-wide state
//!   (`super::Shared`); the server's `mod.rs` owns a [`Sessions`] and lends what a session's
//!   calls need as an [`Env`]. The arrow points one way: `mod.rs` → `session`.
//! - Keys of a session live under its tenant's namespace (`tenant 0x1f`,
//!   [`kvtier_proto::namespace::tenant_prefix`]) inside its store: never in the cluster
//!   namespace a node's data port serves (those keys start with NUL, which no tenant name
//!   holds), so a local session cannot reach a cluster object and a cluster member cannot
//!   reach a session's.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvtier_proto::server::{error_code, RegisterRegion};
use kvtier_store::store::Store;
use parking_lot::{Mutex, MutexGuard, RwLock};

use super::ledger::{Kind, Ledger};
use super::refusal::Refusal;
use super::tenant::{TenantMetrics, TenantStore};
use crate::config::ServerSettings;
use crate::shm::Mapping;

/// Every session of the server and what they map together (the table, the ids, the bytes
/// mapped server-wide and the region counters of the stats document).
#[derive(Default)]
pub(super) struct Sessions {
    table: Mutex<HashMap<u64, Arc<Session>>>,
    next_id: AtomicU64,
    /// Sessions opened since start.
    pub(super) opened_total: AtomicU64,
    /// Bytes reserved by every session's mappings (`max_mapped_bytes_total`).
    pub(super) mapped_total: AtomicU64,
    /// Mappings alive (a mapping outlives its session while a request holds it).
    pub(super) live_mappings: Arc<AtomicU64>,
    pub(super) regions_mapped_total: AtomicU64,
    pub(super) regions_unmapped_total: AtomicU64,
}

impl Sessions {
    /// The table of open sessions, by id.
    pub(super) fn table(&self) -> MutexGuard<'_, HashMap<u64, Arc<Session>>> {
        self.table.lock()
    }
}

/// What a session's calls need of the server, lent by the owner of the server-wide state:
/// the session table and the caps on what one uid and the whole server may map.
#[derive(Clone, Copy)]
pub(super) struct Env<'a> {
    pub(super) sessions: &'a Sessions,
    pub(super) ledger: &'a Ledger,
    pub(super) settings: &'a ServerSettings,
}

#[derive(Default)]
pub(super) struct SessionCounters {
    pub(super) requests: AtomicU64,
    pub(super) pages_put: AtomicU64,
    pub(super) pages_got: AtomicU64,
    pub(super) bytes_put: AtomicU64,
    pub(super) bytes_got: AtomicU64,
    pub(super) rejected_buffers: AtomicU64,
    pub(super) refused_requests: AtomicU64,
}

/// What one client process owns on the server.
pub(super) struct Session {
    pub(super) id: u64,
    pub(super) token: u64,
    pub(super) tenant: String,
    pub(super) client_name: String,
    pub(super) pid: i32,
    /// The uid that opened it; only that uid (or an operator) may join it.
    pub(super) uid: u32,
    /// Whether `uid` is an operator's (fixed for the server's life: it depends on the
    /// configuration only).
    operator: bool,
    pub(super) store: Arc<TenantStore>,
    /// Whether `store` is this tenant's own partition (then it holds nothing of anyone else).
    own_partition: bool,
    /// Key namespace of the tenant inside its store (`tenant 0x1f`).
    pub(super) namespace: Vec<u8>,
    pub(super) regions: RwLock<HashMap<u64, Arc<Mapping>>>,
    next_region: AtomicU64,
    pub(super) mapped_bytes: AtomicU64,
    pub(super) connections: AtomicUsize,
    pub(super) counters: SessionCounters,
    pub(super) metrics: TenantMetrics,
    pub(super) started: Instant,
}

/// Who opens a session.
pub(super) struct Opener {
    pub(super) tenant: String,
    pub(super) client_name: String,
    pub(super) pid: i32,
    pub(super) uid: u32,
    pub(super) operator: bool,
    /// The tenant's store, and whether it is the tenant's own partition.
    pub(super) store: Arc<TenantStore>,
    pub(super) own_partition: bool,
}

impl Session {
    /// A new session of `opener.tenant` over `store`, with one connection, entered in the
    /// server's table.
    pub(super) fn open(sessions: &Sessions, opener: Opener) -> Result<Arc<Session>, Refusal> {
        let namespace = kvtier_proto::namespace::tenant_prefix(&opener.tenant);
        let token = random_token().map_err(|e| {
            Refusal::new(
                error_code::INTERNAL,
                format!("no random session token (getrandom: {e})"),
            )
        })?;
        let id = sessions.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let session = Arc::new(Session {
            id,
            metrics: TenantMetrics::new(&opener.tenant),
            token,
            tenant: opener.tenant,
            client_name: opener.client_name,
            pid: opener.pid,
            uid: opener.uid,
            operator: opener.operator,
            store: opener.store,
            own_partition: opener.own_partition,
            namespace,
            regions: RwLock::new(HashMap::new()),
            next_region: AtomicU64::new(1),
            mapped_bytes: AtomicU64::new(0),
            connections: AtomicUsize::new(1),
            counters: SessionCounters::default(),
            started: Instant::now(),
        });
        sessions.table().insert(id, Arc::clone(&session));
        sessions.opened_total.fetch_add(1, Ordering::Relaxed);
        Ok(session)
    }

    /// `key` under this session's namespace.
    pub(super) fn ns(&self, key: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.namespace.len() + key.len());
        out.extend_from_slice(&self.namespace);
        out.extend_from_slice(key);
        out
    }

    /// Map the memfd `fd` as `request` describes, within the session's and the server's
    /// limits; the new region's id.
    pub(super) fn map_region(
        &self,
        env: Env<'_>,
        fd: OwnedFd,
        request: &RegisterRegion,
    ) -> Result<u64, Refusal> {
        let settings = env.settings;
        let mapped_total = &env.sessions.mapped_total;
        if self.regions.read().len() as u64 >= settings.max_regions_per_client {
            return Err(Refusal::new(
                error_code::REGISTRATION,
                format!(
                    "at most {} regions per client",
                    settings.max_regions_per_client
                ),
            ));
        }
        // Reserve first (atomically, session and server), map after: registrations running at
        // once cannot all pass a check made before any of them is counted.
        if !reserve(
            &self.mapped_bytes,
            request.len,
            settings.max_mapped_bytes_per_client,
        ) {
            return Err(Refusal::new(
                error_code::REGISTRATION,
                format!(
                    "mapping {} more bytes would exceed max_mapped_bytes_per_client ({})",
                    request.len, settings.max_mapped_bytes_per_client
                ),
            ));
        }
        if !reserve(mapped_total, request.len, settings.max_mapped_bytes_total) {
            self.mapped_bytes.fetch_sub(request.len, Ordering::AcqRel);
            return Err(Refusal::new(
                error_code::REGISTRATION,
                format!(
                    "mapping {} more bytes would exceed max_mapped_bytes_total ({})",
                    request.len, settings.max_mapped_bytes_total
                ),
            ));
        }
        // Issue 26: all sessions of one uid together, and every other uid's leave the
        // operators a reserve.
        let operator = self.operator;
        if let Err(refused) = env
            .ledger
            .take(self.uid, operator, Kind::Mapped, request.len)
        {
            self.mapped_bytes.fetch_sub(request.len, Ordering::AcqRel);
            mapped_total.fetch_sub(request.len, Ordering::AcqRel);
            return Err(Refusal::new(
                error_code::REGISTRATION,
                format!(
                    "mapping {} more bytes refused: {}",
                    request.len, refused.message
                ),
            ));
        }
        let region = self.next_region.fetch_add(1, Ordering::Relaxed);
        let mapping = Mapping::map(
            fd,
            request.fd_offset,
            request.len,
            settings.prefault_regions,
            &request.label,
            region,
            Arc::clone(&env.sessions.live_mappings),
        )
        .map_err(|e| {
            self.mapped_bytes.fetch_sub(request.len, Ordering::AcqRel);
            mapped_total.fetch_sub(request.len, Ordering::AcqRel);
            env.ledger
                .give(self.uid, operator, Kind::Mapped, request.len);
            Refusal::new(error_code::REGISTRATION, e.to_string())
        })?;
        self.regions.write().insert(region, Arc::new(mapping));
        env.sessions
            .regions_mapped_total
            .fetch_add(1, Ordering::Relaxed);
        Ok(region)
    }

    /// Unregister `region`; its memory is unmapped once no request holds it.
    pub(super) fn unmap_region(&self, env: Env<'_>, region: u64) -> Result<(), Refusal> {
        let removed = self.regions.write().remove(&region);
        match removed {
            Some(mapping) => {
                let len = mapping.len() as u64;
                self.mapped_bytes.fetch_sub(len, Ordering::AcqRel);
                env.sessions.mapped_total.fetch_sub(len, Ordering::AcqRel);
                env.ledger.give(self.uid, self.operator, Kind::Mapped, len);
                Ok(())
            }
            None => Err(Refusal::new(
                error_code::REGISTRATION,
                format!("region {region} is not registered in this session"),
            )),
        }
    }

    /// One connection of this session closed; the last one ends it.
    pub(super) fn release(self: &Arc<Self>, env: Env<'_>) {
        if self.connections.fetch_sub(1, Ordering::SeqCst) == 1 {
            let mut sessions = env.sessions.table();
            // Re-check under the lock: a join may have raced in.
            if self.connections.load(Ordering::SeqCst) == 0 {
                sessions.remove(&self.id);
                let regions: Vec<_> = self.regions.write().drain().collect();
                env.sessions
                    .regions_unmapped_total
                    .fetch_add(regions.len() as u64, Ordering::Relaxed);
                let bytes: u64 = regions.iter().map(|(_, m)| m.len() as u64).sum();
                self.mapped_bytes.fetch_sub(bytes, Ordering::AcqRel);
                env.sessions.mapped_total.fetch_sub(bytes, Ordering::AcqRel);
                env.ledger
                    .give(self.uid, self.operator, Kind::Mapped, bytes);
            }
        }
    }

    /// `Clear` from this session: only its tenant's namespace. A tenant with its own
    /// partition owns that whole store (cleared at once, segment headers included); in the
    /// shared main store, which also holds other tenants' objects and, on a cluster node,
    /// objects stored for other hosts, only the keys under `tenant 0x1f` are removed.
    pub(super) fn clear_namespace(&self) {
        if self.own_partition {
            self.store.clear();
        } else {
            self.store.inner().remove_prefix(&self.namespace);
        }
    }
}

/// A session token from the kernel's CSPRNG (`getrandom`). No fallback: a session is refused
/// rather than given a guessable token.
fn random_token() -> io::Result<u64> {
    let mut bytes = [0u8; 8];
    let mut filled = 0;
    while filled < bytes.len() {
        match rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(u64::from_le_bytes(bytes))
}

/// Add `amount` to `counter` unless the sum would exceed `limit`; atomic, so concurrent
/// registrations cannot all pass a check made before any of them is counted.
fn reserve(counter: &AtomicU64, amount: u64, limit: u64) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            used.checked_add(amount).filter(|&total| total <= limit)
        })
        .is_ok()
}
