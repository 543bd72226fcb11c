//! [`ClientStats`]: the stats document of a store as a front end reports it (`Client::stats`
//! in `kvtier-client`, the `stats` answer of `kvtier serve`), so both have one shape.

use kvtier_engine::EngineStats;
use serde::Serialize;

/// Counters the client keeps on top of the engine's.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ClientStats {
    #[serde(flatten)]
    pub engine: EngineStats,
    /// Buffers refused because they were outside registered memory.
    pub rejected_buffers: u64,
    /// Batches refused whole because their shape was inconsistent.
    pub rejected_batches: u64,
    pub registered_regions: u64,
    pub registered_bytes: u64,
}
