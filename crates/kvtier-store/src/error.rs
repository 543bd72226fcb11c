//! The client's error type. Python maps it once, at the module boundary.

use kvtier_engine::EngineError;

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

    /// A fault of the infrastructure (cluster unavailable, no leader, a node down, no room,
    /// a timeout), not of the caller's request: the same call may succeed later.
    pub fn is_infrastructure(&self) -> bool {
        match self {
            ClientError::Object { error, .. } => error.is_infrastructure(),
            ClientError::Cluster(e) => e.is_infrastructure(),
            ClientError::Server { .. } => true,
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
