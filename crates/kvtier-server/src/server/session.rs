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
use parking_lot::RwLock;

use super::ledger::Kind;
use super::refusal::Refusal;
use super::tenant::{TenantMetrics, TenantStore};
use super::Shared;
use crate::shm::Mapping;

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
    pub(super) store: Arc<TenantStore>,
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
}

impl Session {
    /// A new session of `opener.tenant` over `store`, with one connection, entered in the
    /// server's table.
    pub(super) fn open(
        shared: &Shared,
        opener: Opener,
        store: Arc<TenantStore>,
    ) -> Result<Arc<Session>, Refusal> {
        let namespace = kvtier_proto::namespace::tenant_prefix(&opener.tenant);
        let token = random_token().map_err(|e| {
            Refusal::new(
                error_code::INTERNAL,
                format!("no random session token (getrandom: {e})"),
            )
        })?;
        let id = shared.next_session.fetch_add(1, Ordering::Relaxed);
        let session = Arc::new(Session {
            id,
            metrics: TenantMetrics::new(&opener.tenant),
            token,
            tenant: opener.tenant,
            client_name: opener.client_name,
            pid: opener.pid,
            uid: opener.uid,
            store,
            namespace,
            regions: RwLock::new(HashMap::new()),
            next_region: AtomicU64::new(1),
            mapped_bytes: AtomicU64::new(0),
            connections: AtomicUsize::new(1),
            counters: SessionCounters::default(),
            started: Instant::now(),
        });
        shared.sessions.lock().insert(id, Arc::clone(&session));
        shared
            .counters
            .sessions_total
            .fetch_add(1, Ordering::Relaxed);
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
        shared: &Shared,
        fd: OwnedFd,
        request: &RegisterRegion,
    ) -> Result<u64, Refusal> {
        let settings = &shared.config.settings;
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
        if !reserve(
            &shared.mapped_total,
            request.len,
            settings.max_mapped_bytes_total,
        ) {
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
        let operator = shared.config.is_operator(self.uid);
        if let Err(refused) = shared
            .ledger
            .take(self.uid, operator, Kind::Mapped, request.len)
        {
            self.mapped_bytes.fetch_sub(request.len, Ordering::AcqRel);
            shared.mapped_total.fetch_sub(request.len, Ordering::AcqRel);
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
            Arc::clone(&shared.live_mappings),
        )
        .map_err(|e| {
            self.mapped_bytes.fetch_sub(request.len, Ordering::AcqRel);
            shared.mapped_total.fetch_sub(request.len, Ordering::AcqRel);
            shared
                .ledger
                .give(self.uid, operator, Kind::Mapped, request.len);
            Refusal::new(error_code::REGISTRATION, e.to_string())
        })?;
        self.regions.write().insert(region, Arc::new(mapping));
        shared
            .counters
            .regions_mapped_total
            .fetch_add(1, Ordering::Relaxed);
        Ok(region)
    }

    /// Unregister `region`; its memory is unmapped once no request holds it.
    pub(super) fn unmap_region(&self, shared: &Shared, region: u64) -> Result<(), Refusal> {
        let removed = self.regions.write().remove(&region);
        match removed {
            Some(mapping) => {
                let len = mapping.len() as u64;
                self.mapped_bytes.fetch_sub(len, Ordering::AcqRel);
                shared.mapped_total.fetch_sub(len, Ordering::AcqRel);
                let operator = shared.config.is_operator(self.uid);
                shared.ledger.give(self.uid, operator, Kind::Mapped, len);
                Ok(())
            }
            None => Err(Refusal::new(
                error_code::REGISTRATION,
                format!("region {region} is not registered in this session"),
            )),
        }
    }

    /// One connection of this session closed; the last one ends it.
    pub(super) fn release(self: &Arc<Self>, shared: &Shared) {
        if self.connections.fetch_sub(1, Ordering::SeqCst) == 1 {
            let mut sessions = shared.sessions.lock();
            // Re-check under the lock: a join may have raced in.
            if self.connections.load(Ordering::SeqCst) == 0 {
                sessions.remove(&self.id);
                let regions: Vec<_> = self.regions.write().drain().collect();
                shared
                    .counters
                    .regions_unmapped_total
                    .fetch_add(regions.len() as u64, Ordering::Relaxed);
                let bytes: u64 = regions.iter().map(|(_, m)| m.len() as u64).sum();
                self.mapped_bytes.fetch_sub(bytes, Ordering::AcqRel);
                shared.mapped_total.fetch_sub(bytes, Ordering::AcqRel);
                let operator = shared.config.is_operator(self.uid);
                shared.ledger.give(self.uid, operator, Kind::Mapped, bytes);
            }
        }
    }

    /// `Clear` from this session: only its tenant's namespace. A tenant with its own
    /// partition owns that whole store (cleared at once, segment headers included); in the
    /// shared main store, which also holds other tenants' objects and, on a cluster node,
    /// objects stored for other hosts, only the keys under `tenant 0x1f` are removed.
    pub(super) fn clear_namespace(&self, shared: &Shared) {
        if shared.tenants.is_partition_of(&self.tenant, &self.store) {
            self.store.clear();
        } else {
            self.store
                .with_engine(|engine| engine.remove_prefix(&self.namespace));
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
