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
    #[error("no space for {needed} bytes: every remaining object is pinned by a reader")]
    NoSpace { needed: u64 },
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
