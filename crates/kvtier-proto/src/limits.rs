//! Protocol limits, shared by every encoder and decoder.
//!
//! Both sides enforce the same numbers: an encoder refuses to produce a message that the peer's
//! decoder would reject (so the sender gets the precise error, not an opaque reply), and a
//! decoder refuses anything larger before allocating for it. Changing a limit is a protocol
//! change: raise [`crate::frame::PROTOCOL_VERSION`] when one shrinks.

/// Largest frame body, in bytes. Bounds every allocation the frame reader makes for one frame.
/// 64 MiB holds a full batch of 2 MiB pages' metadata many times over; page bytes themselves
/// travel through shared memory or the peer data port, not inside control frames.
pub const MAX_FRAME_BODY: u32 = 64 << 20;

/// Longest object key, page key, key prefix or component suffix, in bytes. Every key that an
/// [`crate::ExistsV2Query`] can compose (`prefix ++ page_key ++ suffix`) also fits this limit,
/// so composed keys and batch keys obey one rule.
pub const MAX_KEY_LEN: usize = 4 << 10;

/// Most keys in one batch request ([`crate::KeyBatch`], [`crate::PutBatchHeader`]) and most
/// entries in one [`crate::BatchResult`] list.
pub const MAX_KEYS_PER_BATCH: usize = 65_536;

/// Most side pools in one existence query.
pub const MAX_POOLS: usize = 64;

/// Most pages in one existence query; also bounds every page count in its answer.
pub const MAX_PAGES_PER_QUERY: usize = 65_536;

/// Most presence lookups one existence query may cost: its pages times every component suffix
/// of the KV anchor and of its pools (each evaluated over the whole span). 8 Mi lookups take
/// well under a second on an in-memory index; a bigger query is refused with an error naming
/// this bound instead of holding a server or master worker.
pub const MAX_LOOKUPS_PER_QUERY: usize = 8 << 20;

// The largest query SGLang can send for a hybrid model (every page, every pool with one
// component, a K/V anchor) must fit the work bound.
const _: () = assert!(MAX_PAGES_PER_QUERY * (MAX_POOLS + 2) <= MAX_LOOKUPS_PER_QUERY);

/// Most component suffixes of one pool (or of the KV anchor).
pub const MAX_SUFFIXES_PER_POOL: usize = 256;

/// Longest pool name or client name, in bytes.
pub const MAX_NAME_LEN: usize = 256;

/// Longest error message, in bytes (in [`crate::ErrorReply`] and each [`crate::BatchResult`]
/// error).
pub const MAX_MESSAGE_LEN: usize = 4 << 10;

/// Longest text reply ([`crate::server::TextReply`], e.g. the JSON of `Stats`), in bytes.
pub const MAX_TEXT_LEN: usize = 4 << 20;
