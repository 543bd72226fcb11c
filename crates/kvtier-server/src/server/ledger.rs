//! What each peer uid holds of the server (issue 26 §3): connections, descriptors passed to
//! the server and not yet consumed, and mapped bytes; the caps on them, sized from the
//! process's descriptor limit; and the share kept for operators.
//!
//! Owns: the per-uid usage table and the totals, the [`Caps`] in force, and the refusal log
//! of the local socket. The caps (see `crate::limits` for the constants and their checks):
//!
//! - the soft `RLIMIT_NOFILE` is raised to the hard limit at start; of it, a third is left to
//!   the cluster data port (which sizes its own caps to that third) and
//!   [`RESERVED_DESCRIPTORS`] to the stores, the listener and the metrics endpoint; half the
//!   rest pays for connections ([`DESCRIPTORS_PER_CONNECTION`] each) and half for descriptors
//!   clients pass (`SCM_RIGHTS`) ahead of their `RegisterRegion` frames;
//! - one uid (operators included) may hold at most a quarter of the connections and of the
//!   passed descriptors (and no more than `max_connections_per_uid`), and
//!   `max_mapped_bytes_per_uid`;
//! - every uid but an operator's (the server's own, root, `operator_uids`) together may use at
//!   most three quarters of each total: the rest is the operators' reserve, so a stranger
//!   uid can never lock out the server's own clients or `kvtier stat`.
//!
//! A passed descriptor is accounted before the kernel installs it: a connection reads with
//! room for one descriptor only while it holds a slot for it (taken when its session opens
//! and again after each descriptor arrives), so descriptors over the caps are dropped by the
//! kernel (`MSG_CTRUNC`) and never occupy the server's table, even for a moment.

use std::collections::HashMap;

use kvtier_proto::refusals::RefusalLog;
use parking_lot::Mutex;
use std::sync::Arc;

pub(crate) use crate::limits::{
    DESCRIPTORS_PER_CONNECTION, MAX_QUEUED_FDS, OPERATOR_RESERVE_DIVISOR, PER_UID_DIVISOR,
    RESERVED_DESCRIPTORS,
};

/// The caps in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Caps {
    /// The soft descriptor limit after raising (`None`: unknown).
    pub(crate) descriptors: Option<u64>,
    pub(crate) connections: u64,
    pub(crate) connections_per_uid: u64,
    pub(crate) passed_fds: u64,
    pub(crate) passed_fds_per_uid: u64,
    pub(crate) mapped_bytes: u64,
    pub(crate) mapped_bytes_per_uid: u64,
}

impl Caps {
    /// The caps for `descriptors` open files under the configured bounds.
    pub(crate) fn new(
        descriptors: Option<u64>,
        max_connections: u64,
        max_connections_per_uid: u64,
        max_mapped_bytes_total: u64,
        max_mapped_bytes_per_uid: u64,
    ) -> Caps {
        let budget = descriptors.map_or(u64::MAX / 4, |d| {
            (d - d / 3).saturating_sub(RESERVED_DESCRIPTORS)
        });
        // What the descriptors allow, before the configured bounds.
        let fd_connections = (budget / 2 / DESCRIPTORS_PER_CONNECTION).max(4);
        let connections = max_connections.min(fd_connections);
        let passed_fds = (budget / 2).clamp(4, connections.saturating_mul(MAX_QUEUED_FDS));
        Caps {
            descriptors,
            connections,
            connections_per_uid: max_connections_per_uid
                .min(fd_connections / PER_UID_DIVISOR)
                .max(1),
            passed_fds,
            passed_fds_per_uid: (passed_fds / PER_UID_DIVISOR).max(1),
            mapped_bytes: max_mapped_bytes_total,
            mapped_bytes_per_uid: max_mapped_bytes_per_uid.min(max_mapped_bytes_total),
        }
    }

    /// What every non-operator uid together may use of `total`.
    fn shared_part(total: u64) -> u64 {
        total - total / OPERATOR_RESERVE_DIVISOR
    }
}

#[derive(Default, Clone, Copy, Debug)]
struct Use {
    connections: u64,
    passed_fds: u64,
    mapped: u64,
}

#[derive(Default)]
struct Table {
    by_uid: HashMap<u32, Use>,
    /// Sums over every uid, and over the non-operator uids.
    all: Use,
    others: Use,
}

/// Which resource a refusal is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Connections,
    PassedFds,
    Mapped,
}

/// Why a uid was refused: the cap's name and value, for the error message.
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) reason: &'static str,
    pub(crate) message: String,
}

/// The per-uid usage and its caps.
pub(crate) struct Ledger {
    caps: Caps,
    table: Mutex<Table>,
    pub(crate) refusals: Arc<RefusalLog>,
}

impl Ledger {
    pub(crate) fn new(caps: Caps) -> Ledger {
        Ledger {
            caps,
            table: Mutex::new(Table::default()),
            refusals: RefusalLog::new("kvtier serve", "local connection"),
        }
    }

    pub(crate) fn caps(&self) -> Caps {
        self.caps
    }

    fn get(u: &Use, kind: Kind) -> u64 {
        match kind {
            Kind::Connections => u.connections,
            Kind::PassedFds => u.passed_fds,
            Kind::Mapped => u.mapped,
        }
    }

    fn get_mut(u: &mut Use, kind: Kind) -> &mut u64 {
        match kind {
            Kind::Connections => &mut u.connections,
            Kind::PassedFds => &mut u.passed_fds,
            Kind::Mapped => &mut u.mapped,
        }
    }

    fn limits(&self, kind: Kind) -> (u64, u64, &'static str, &'static str) {
        let c = &self.caps;
        match kind {
            Kind::Connections => (
                c.connections,
                c.connections_per_uid,
                "max_connections",
                "max_connections_per_uid",
            ),
            Kind::PassedFds => (
                c.passed_fds,
                c.passed_fds_per_uid,
                "passed descriptors (from RLIMIT_NOFILE)",
                "passed descriptors per uid (from RLIMIT_NOFILE)",
            ),
            Kind::Mapped => (
                c.mapped_bytes,
                c.mapped_bytes_per_uid,
                "max_mapped_bytes_total",
                "max_mapped_bytes_per_uid",
            ),
        }
    }

    /// Take `amount` of `kind` for `uid` (an operator's when `operator`), or say which cap
    /// refuses it.
    pub(crate) fn take(
        &self,
        uid: u32,
        operator: bool,
        kind: Kind,
        amount: u64,
    ) -> Result<(), Refused> {
        let (total_cap, uid_cap, total_name, uid_name) = self.limits(kind);
        let mut t = self.table.lock();
        let mine = t.by_uid.get(&uid).map_or(0, |u| Self::get(u, kind));
        let all = Self::get(&t.all, kind);
        let others = Self::get(&t.others, kind);
        let refuse = |reason: &'static str, message: String| Err(Refused { reason, message });
        if mine.saturating_add(amount) > uid_cap {
            return refuse(
                uid_name,
                format!("uid {uid} holds {mine} of {uid_cap} ({uid_name}); {amount} more refused"),
            );
        }
        if all.saturating_add(amount) > total_cap {
            return refuse(
                total_name,
                format!("the server holds {all} of {total_cap} ({total_name})"),
            );
        }
        if !operator && others.saturating_add(amount) > Caps::shared_part(total_cap) {
            return refuse(
                total_name,
                format!(
                    "other uids hold {others} of the {} they may share of {total_cap} \
                     ({total_name}; the rest is kept for operators)",
                    Caps::shared_part(total_cap)
                ),
            );
        }
        *Self::get_mut(t.by_uid.entry(uid).or_default(), kind) += amount;
        *Self::get_mut(&mut t.all, kind) += amount;
        if !operator {
            *Self::get_mut(&mut t.others, kind) += amount;
        }
        Ok(())
    }

    /// Give back `amount` of `kind` taken for `uid`.
    pub(crate) fn give(&self, uid: u32, operator: bool, kind: Kind, amount: u64) {
        let mut t = self.table.lock();
        if let Some(u) = t.by_uid.get_mut(&uid) {
            let v = Self::get_mut(u, kind);
            *v = v.saturating_sub(amount);
            if u.connections == 0 && u.passed_fds == 0 && u.mapped == 0 {
                t.by_uid.remove(&uid);
            }
        }
        let v = Self::get_mut(&mut t.all, kind);
        *v = v.saturating_sub(amount);
        if !operator {
            let v = Self::get_mut(&mut t.others, kind);
            *v = v.saturating_sub(amount);
        }
    }

    /// Usage of every uid (the stats document, operators only).
    pub(crate) fn usage(&self) -> serde_json::Value {
        let t = self.table.lock();
        let mut uids: Vec<_> = t.by_uid.iter().collect();
        uids.sort_by_key(|(uid, _)| **uid);
        serde_json::Value::Array(
            uids.into_iter()
                .map(|(uid, u)| {
                    serde_json::json!({
                        "uid": uid,
                        "connections": u.connections,
                        "passed_fds": u.passed_fds,
                        "mapped_bytes": u.mapped,
                    })
                })
                .collect(),
        )
    }
}

/// Raise the soft `RLIMIT_NOFILE` to the hard limit; the soft limit now in force.
pub(crate) fn raise_descriptor_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: limit.maximum,
                maximum: limit.maximum,
            },
        );
    }
    getrlimit(Resource::Nofile).current
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_fit_the_descriptor_limit() {
        let caps = Caps::new(Some(1024), 1024, 256, 1 << 30, 1 << 29);
        let used = caps.connections * DESCRIPTORS_PER_CONNECTION + caps.passed_fds;
        assert!(used + RESERVED_DESCRIPTORS + 1024 / 3 <= 1024, "{caps:?}");
        assert!(caps.connections_per_uid * PER_UID_DIVISOR <= caps.connections);
        // A configured total alone does not shrink what one uid may hold.
        let small = Caps::new(Some(1 << 20), 8, 256, 1 << 30, 1 << 29);
        assert_eq!((small.connections, small.connections_per_uid), (8, 256));
        let roomy = Caps::new(Some(1 << 20), 1024, 256, 1 << 30, 1 << 29);
        assert_eq!(roomy.connections, 1024);
        assert_eq!(roomy.connections_per_uid, 256);
    }

    #[test]
    fn operators_keep_a_reserve_and_one_uid_its_share() {
        let ledger = Ledger::new(Caps::new(Some(1 << 20), 16, 4, 1000, 500));
        // One uid: a quarter of the connections.
        for _ in 0..4 {
            ledger.take(7, false, Kind::Connections, 1).unwrap();
        }
        assert!(ledger.take(7, false, Kind::Connections, 1).is_err());
        for uid in 8..10 {
            for _ in 0..4 {
                ledger.take(uid, false, Kind::Connections, 1).unwrap();
            }
        }
        // Twelve of sixteen: the other uids' share is gone, the operators' is not.
        let refused = ledger.take(10, false, Kind::Connections, 1).unwrap_err();
        assert!(refused.message.contains("operators"), "{}", refused.message);
        for _ in 0..4 {
            ledger.take(0, true, Kind::Connections, 1).unwrap();
        }
        assert!(ledger.take(0, true, Kind::Connections, 1).is_err());
        ledger.give(7, false, Kind::Connections, 1);
        ledger.take(10, false, Kind::Connections, 1).unwrap();
        // Mapped bytes: per uid, then the shared part.
        assert!(ledger.take(7, false, Kind::Mapped, 501).is_err());
        ledger.take(7, false, Kind::Mapped, 500).unwrap();
        assert!(ledger.take(8, false, Kind::Mapped, 300).is_err());
        ledger.take(0, true, Kind::Mapped, 500).unwrap();
    }
}
