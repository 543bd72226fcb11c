//! The engine's error type. Every failure a caller can cause is a typed variant here, so the
//! layers above can turn it into a clean miss or `False` without parsing strings.

/// Errors of [`crate::Engine`] operations.
#[derive(thiserror::Error, Debug)]
pub enum EngineError {
    #[error("object not found")]
    NotFound,
    #[error("size mismatch: stored object is {stored} bytes, destination is {requested} bytes")]
    SizeMismatch { stored: u64, requested: u64 },
    #[error("empty key: object keys must be at least one byte")]
    EmptyKey,
    #[error("object of {len} bytes is larger than the whole DRAM arena ({capacity} bytes)")]
    ObjectTooLarge { len: u64, capacity: u64 },
    /// Nothing more could be evicted; `cause` says what held the memory (issue 28: it is not
    /// always a reader's pin).
    #[error("no space for {needed} bytes: {cause}")]
    NoSpace { needed: u64, cause: NoSpaceCause },
    #[error("invalid config `{key}`: {reason}")]
    InvalidConfig { key: &'static str, reason: String },
    #[error("cannot map the DRAM arena: {0}")]
    ArenaMap(#[source] std::io::Error),
    #[error("cannot open the SSD tier: {0}")]
    SsdOpen(#[source] std::io::Error),
    #[error("SSD write failed (the put was not stored): {0}")]
    SsdWrite(#[source] std::io::Error),
    #[error("the source memory was revoked during the copy (its owner truncated it); not stored")]
    SourceRevoked,
}

/// Why a put found nothing more to evict, counted over the last whole pass of the cold
/// windows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoSpaceCause {
    /// Page groups that could not go: a member pinned by a reader (or an SSD copy), or a
    /// group changing under concurrent puts.
    pub pinned_groups: usize,
    /// Objects of the put's own eviction group: a group goes whole, never to make room for
    /// one of its own members.
    pub own_group_objects: usize,
}

impl std::fmt::Display for NoSpaceCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let own = self.own_group_objects;
        match (self.pinned_groups, own) {
            (0, 0) => write!(
                f,
                "no object can be evicted (the memory is held by readers of removed objects)"
            ),
            (0, _) => write!(
                f,
                "every other object ({own}) is in the put's own eviction group, which is never \
                 split to store one of its members"
            ),
            (pinned, 0) => write!(
                f,
                "every remaining page group ({pinned}) is pinned by a reader or an SSD copy"
            ),
            (pinned, _) => write!(
                f,
                "{pinned} page groups are pinned by a reader or an SSD copy and {own} objects \
                 are in the put's own eviction group, which is never split"
            ),
        }
    }
}
