//! [`MasterConfig::validate`]: the master's own check of its settings, so every front end
//! (the `kvtier master` command, tests, embedders) gets the same refusals with the same
//! reasons, and [`crate::run`] never starts on settings its parts would misread.
//!
//! Invariant: a config that passed `validate` has replication factors within
//! 1..=[`MAX_REPLICAS`], a lease of at least [`MIN_LEASE`], a nonzero claim timeout and an
//! election TTL of at least one second.

use std::time::Duration;

use crate::limits::{MAX_REPLICAS, MIN_LEASE};
use crate::service::MasterConfig;

/// Why a [`MasterConfig`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MasterConfigError {
    #[error("default replication {0} must be from 1 to {MAX_REPLICAS}")]
    DefaultReplication(usize),
    #[error("replication {factor} of namespace {namespace:?} must be from 1 to {MAX_REPLICAS}")]
    Replication { namespace: String, factor: usize },
    #[error("node lease {0:?} is shorter than {MIN_LEASE:?}")]
    LeaseTooShort(Duration),
    #[error("the claim timeout must be more than zero")]
    ZeroClaimTimeout,
    #[error("the election TTL {0:?} is shorter than one second (etcd leases are whole seconds)")]
    ElectionTtlTooShort(Duration),
}

impl MasterConfig {
    /// Check the settings; the first one out of bounds is the error.
    pub fn validate(&self) -> Result<(), MasterConfigError> {
        let factor_ok = |n: usize| (1..=MAX_REPLICAS).contains(&n);
        if !factor_ok(self.default_replication) {
            return Err(MasterConfigError::DefaultReplication(
                self.default_replication,
            ));
        }
        if let Some((namespace, &factor)) = self.replication.iter().find(|(_, &n)| !factor_ok(n)) {
            return Err(MasterConfigError::Replication {
                namespace: namespace.clone(),
                factor,
            });
        }
        if self.lease < MIN_LEASE {
            return Err(MasterConfigError::LeaseTooShort(self.lease));
        }
        if self.claim_timeout.is_zero() {
            return Err(MasterConfigError::ZeroClaimTimeout);
        }
        if self.election_ttl < Duration::from_secs(1) {
            return Err(MasterConfigError::ElectionTtlTooShort(self.election_ttl));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_pass_and_each_bound_is_named() {
        MasterConfig::default().validate().unwrap();
        let c = MasterConfig {
            default_replication: MAX_REPLICAS + 1,
            ..MasterConfig::default()
        };
        assert_eq!(
            c.validate(),
            Err(MasterConfigError::DefaultReplication(MAX_REPLICAS + 1))
        );
        let mut c = MasterConfig::default();
        c.replication.insert("ns".into(), 0);
        assert!(matches!(
            c.validate(),
            Err(MasterConfigError::Replication { factor: 0, .. })
        ));
        let c = MasterConfig {
            lease: Duration::from_millis(10),
            ..MasterConfig::default()
        };
        assert!(matches!(
            c.validate(),
            Err(MasterConfigError::LeaseTooShort(_))
        ));
    }
}
