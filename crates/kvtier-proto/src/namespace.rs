//! Who owns a stored key: the key namespaces of a node's store, declared once for the local
//! server, the cluster client, the node's data port, the master's directory and the CLI.
//!
//! A node's main store holds the objects of two kinds of owner side by side:
//!
//! - **local tenants** (sessions over the local socket, `extra_backend_tag` of a server-mode
//!   client): `tenant 0x1f key` ([`tenant_prefix`]). A tenant name is never empty-checked here
//!   (the untagged tenant is the empty name) but never contains NUL or 0x1f
//!   ([`is_valid_name`]), so such a key never starts with NUL;
//! - **the cluster** (objects cluster clients and re-replication store through the data
//!   port): `NUL 'C' tag 0x1f key` ([`cluster_prefix`]; the untagged namespace is the empty
//!   tag). The kind marker [`CLUSTER_MARK`] starts with NUL, which no tenant name can contain
//!   or spell, so no local session can name, read, overwrite, clear or list a cluster object,
//!   and the data port, which serves only keys that start with the marker
//!   ([`is_cluster_key`]), cannot reach a local tenant's.
//!
//! The separation is by construction (a prefix-free split), not by a check a caller might
//! forget: a session's keys are always `tenant_prefix(its tenant) ++ key`, a cluster client's
//! always `cluster_prefix(its tag) ++ key`.

/// Ends a tenant name or a cluster tag inside a stored key.
pub const SEPARATOR: u8 = 0x1f;

/// The kind marker every cluster key starts with. NUL first: a tenant name cannot contain it,
/// and a local key starts with its tenant's first byte (or with [`SEPARATOR`] for the empty
/// tenant), so no local key starts with this.
pub const CLUSTER_MARK: &[u8] = b"\0C";

/// Longest tenant name or cluster tag, in bytes (the configuration's rule).
pub const MAX_NAME_LEN: usize = 128;

/// Whether `name` may name a tenant or a cluster tag inside stored keys: no NUL (the cluster
/// kind marker's first byte) and no [`SEPARATOR`] (the name would end early). The empty name
/// is the untagged namespace; configuration refuses it where a name must be given.
pub fn is_valid_name(name: &str) -> bool {
    name.len() <= MAX_NAME_LEN && !name.bytes().any(|b| b == 0 || b == SEPARATOR)
}

/// The prefix of a local tenant's keys: `tenant 0x1f`.
pub fn tenant_prefix(tenant: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(tenant.len() + 1);
    out.extend_from_slice(tenant.as_bytes());
    out.push(SEPARATOR);
    out
}

/// The prefix of a cluster namespace's keys: `NUL 'C' tag 0x1f` (`tag` empty: the untagged
/// namespace of clients without `extra_backend_tag`).
pub fn cluster_prefix(tag: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(CLUSTER_MARK.len() + tag.len() + 1);
    out.extend_from_slice(CLUSTER_MARK);
    out.extend_from_slice(tag.as_bytes());
    out.push(SEPARATOR);
    out
}

/// Whether `key` is a cluster object's key: the kind marker, then a tag ended by the
/// separator. The data port serves no other key.
pub fn is_cluster_key(key: &[u8]) -> bool {
    key.strip_prefix(CLUSTER_MARK)
        .is_some_and(|rest| rest.contains(&SEPARATOR))
}

/// Whether `prefix` names a part of the cluster namespace (a `PeerClear` prefix): it starts
/// with the kind marker, so every key under it is a cluster key.
pub fn is_cluster_prefix(prefix: &[u8]) -> bool {
    prefix.starts_with(CLUSTER_MARK)
}

/// A stored key split by its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner<'a> {
    /// `tenant 0x1f key` of a local tenant.
    Tenant { tenant: &'a [u8], key: &'a [u8] },
    /// `NUL 'C' tag 0x1f key` of a cluster namespace.
    Cluster { tag: &'a [u8], key: &'a [u8] },
    /// Neither (a key stored raw by an embedded store, or damaged).
    Unknown,
}

/// Who owns `stored`.
pub fn owner(stored: &[u8]) -> Owner<'_> {
    if let Some(rest) = stored.strip_prefix(CLUSTER_MARK) {
        return match split_at_separator(rest) {
            Some((tag, key)) => Owner::Cluster { tag, key },
            None => Owner::Unknown,
        };
    }
    match split_at_separator(stored) {
        Some((tenant, key)) if !tenant.contains(&0) => Owner::Tenant { tenant, key },
        _ => Owner::Unknown,
    }
}

/// The cluster tag of a cluster key (`None`: not a cluster key): the master's directory takes a
/// rebuilt entry's replication factor from it.
pub fn cluster_tag(key: &[u8]) -> Option<&[u8]> {
    match owner(key) {
        Owner::Cluster { tag, .. } => Some(tag),
        _ => None,
    }
}

fn split_at_separator(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let at = bytes.iter().position(|&b| b == SEPARATOR)?;
    Some((&bytes[..at], &bytes[at + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn prefixes_split_back() {
        let mut k = cluster_prefix("team-a");
        k.extend_from_slice(b"page\x1fwith-sep");
        assert_eq!(
            owner(&k),
            Owner::Cluster {
                tag: b"team-a",
                key: b"page\x1fwith-sep"
            }
        );
        assert_eq!(cluster_tag(&k), Some(&b"team-a"[..]));
        let mut k = tenant_prefix("team-a");
        k.extend_from_slice(b"page");
        assert_eq!(
            owner(&k),
            Owner::Tenant {
                tenant: b"team-a",
                key: b"page"
            }
        );
        assert_eq!(cluster_tag(&k), None);
        let mut untagged = cluster_prefix("");
        untagged.extend_from_slice(b"p");
        assert!(is_cluster_key(&untagged));
        assert_eq!(cluster_tag(&untagged), Some(&b""[..]));
        assert!(!is_cluster_key(b"\0C-no-separator"));
        assert!(!is_cluster_key(b"team-a\x1fpage"));
        assert!(!is_cluster_key(b"\x1fpage"));
        assert!(is_cluster_prefix(&cluster_prefix("x")));
        assert!(!is_cluster_prefix(b""));
        assert!(!is_cluster_prefix(&tenant_prefix("x")));
        assert!(!is_valid_name("a\0C"));
        assert!(!is_valid_name("a\x1fb"));
        assert!(is_valid_name(""));
        assert!(!is_valid_name(&"x".repeat(129)));
    }

    proptest! {
        /// No tenant name a session may open, with any key, spells a cluster key; and no
        /// cluster key is a local tenant's.
        #[test]
        fn local_and_cluster_keys_never_meet(
            tenant in "[^\u{0}\u{1f}]{0,16}",
            tag in "[^\u{0}\u{1f}]{0,16}",
            key in proptest::collection::vec(any::<u8>(), 0..32),
        ) {
            prop_assume!(is_valid_name(&tenant) && is_valid_name(&tag));
            let mut local = tenant_prefix(&tenant);
            local.extend_from_slice(&key);
            let mut cluster = cluster_prefix(&tag);
            cluster.extend_from_slice(&key);
            prop_assert!(!is_cluster_key(&local));
            prop_assert!(!local.starts_with(CLUSTER_MARK));
            prop_assert!(is_cluster_key(&cluster));
            prop_assert!(!cluster.starts_with(&tenant_prefix(&tenant)));
            let is_tenant = matches!(owner(&local), Owner::Tenant { .. });
            prop_assert!(is_tenant);
        }
    }
}
