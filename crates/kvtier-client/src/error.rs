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
