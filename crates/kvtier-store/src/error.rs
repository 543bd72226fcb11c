//! The client's error type. Python maps it once, at the module boundary.
//!
//! Issue 28: every error says, typed, what it means for the one item it failed
//! ([`ClientError::item_failure`], a [`ItemFailure`]): the one mapping from a store's errors
//! to a batch item's outcome, used by every store when it fills a [`crate::BatchResult`],
//! and by the front ends (a miss is `False`, never an exception). Nothing decides on an
//! error's text.

use kvtier_engine::EngineError;
pub use kvtier_proto::ItemFailure;

use crate::config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(
        "buffer 0x{ptr:x}+{len} lies outside every registered memory region \
         (register the pool's buffers first)"
    )]
    OutsideRegisteredMemory { ptr: usize, len: usize },
    #[error(
        "buffer 0x{ptr:x}+{len} lies in a region its owner revoked (a memfd truncated after \
         registration); the page is refused"
    )]
    MemoryRevoked { ptr: usize, len: usize },
    #[error("invalid memory region 0x{ptr:x}+{len}: {reason}")]
    InvalidRegion {
        ptr: usize,
        len: usize,
        reason: &'static str,
    },
    #[error("malformed batch: {0}")]
    BatchShape(String),
    /// Issue 29 §3: one object's cluster put or get failed because of the cluster (no
    /// leader, a node down, no room, a timeout: [`ClientError::is_infrastructure`]) or
    /// because another writer holds its claim.
    #[error("object {key}: {error}")]
    Object {
        key: String,
        error: crate::cluster::ObjectError,
    },
    #[error("the store is closed")]
    Closed,
    #[error("kvtier server at {socket}: {reason}")]
    Server { socket: String, reason: String },
    #[error(transparent)]
    Cluster(#[from] crate::cluster::ClusterError),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    #[error("kvtier server refused the request (code {code}): {message}")]
    ServerRefused { code: u16, message: String },
    /// Issue 28: one item failed in a store of another process (a `kvtier serve` reply's
    /// status byte said why); `detail` is that store's message, for the log.
    #[error("{key}: {failure}{}", if detail.is_empty() { String::new() } else { format!(" ({detail})") })]
    Item {
        key: String,
        failure: ItemFailure,
        detail: String,
    },
}

impl ClientError {
    /// An object's failure, naming its key (lossy UTF-8; keys are bytes).
    pub fn object(key: &[u8], error: crate::cluster::ObjectError) -> ClientError {
        match error {
            // The caller's own input: still what it was.
            crate::cluster::ObjectError::Caller(reason) => ClientError::BatchShape(reason),
            error => ClientError::Object {
                key: String::from_utf8_lossy(key).into_owned(),
                error,
            },
        }
    }

    /// What this error means for the one item it failed (see the module doc).
    pub fn item_failure(&self) -> ItemFailure {
        match self {
            ClientError::Engine(e) => match e {
                EngineError::NotFound => ItemFailure::Miss,
                EngineError::SizeMismatch { .. } => ItemFailure::WrongLength,
                EngineError::NoSpace { .. } | EngineError::ObjectTooLarge { .. } => {
                    ItemFailure::NoRoom
                }
                EngineError::SourceRevoked => ItemFailure::BadBuffer,
                _ => ItemFailure::Failed,
            },
            ClientError::OutsideRegisteredMemory { .. }
            | ClientError::MemoryRevoked { .. }
            | ClientError::InvalidRegion { .. } => ItemFailure::BadBuffer,
            ClientError::Object { error, .. } => error.item_failure(),
            ClientError::Cluster(e) if e.is_infrastructure() => ItemFailure::Unavailable,
            // The server could not be reached or its connection broke mid-call.
            ClientError::Server { .. } => ItemFailure::Unavailable,
            ClientError::Item { failure, .. } => *failure,
            _ => ItemFailure::Failed,
        }
    }

    /// The store answered that it does not hold the object (an answer, not a fault).
    pub fn is_miss(&self) -> bool {
        self.item_failure() == ItemFailure::Miss
    }

    /// A fault of the infrastructure (cluster unavailable, no leader, a node down, no room,
    /// a timeout), not of the caller's request: the same call may succeed later.
    pub fn is_infrastructure(&self) -> bool {
        match self {
            ClientError::Object { error, .. } => error.is_infrastructure(),
            ClientError::Cluster(e) => e.is_infrastructure(),
            ClientError::Server { .. } => true,
            ClientError::Item { failure, .. } => {
                matches!(failure, ItemFailure::Unavailable | ItemFailure::NoRoom)
            }
            _ => false,
        }
    }

    /// Another writer holds the key's claim (retry shortly or treat as present).
    pub fn is_busy(&self) -> bool {
        matches!(
            self,
            ClientError::Object {
                error: crate::cluster::ObjectError::Busy,
                ..
            }
        )
    }
}
