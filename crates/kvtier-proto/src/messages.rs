//! Request and reply bodies of the server and master protocol, other than the existence query
//! model (which lives in [`crate::query`]).
//!
//! These are plain data; their wire form is in [`crate::codec`]. Keys here are whole object
//! keys (already composed with [`crate::query::compose_key`]), so the server never has to know
//! a client's key scheme.

/// A list of whole object keys: the body of `BatchExists`, `BatchGet` and `BatchDelete`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyBatch {
    pub keys: Vec<Vec<u8>>,
}

/// The metadata of a put batch: which objects, how large, and (optionally) each one's depth in
/// its prefix chain, which prefix-aware eviction uses. The bytes themselves move out of band.
///
/// `sizes` and `depths` are parallel to `keys`. The wire form sends the count once, so a decoded
/// header always has equal lengths; an encoder given unequal lengths returns
/// [`crate::ProtoError::LengthMismatch`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PutBatchHeader {
    pub keys: Vec<Vec<u8>>,
    /// Object size in bytes, per key.
    pub sizes: Vec<u64>,
    /// Depth of each key in its prefix chain (0 = chain head), when the client knows it.
    pub depths: Option<Vec<u32>>,
}

/// The per-key outcome of a batch call.
///
/// `ok` is parallel to the request's keys. `errors` holds free-form diagnostics for the failed
/// entries, for logging only; it is not index-aligned with `ok` and may be shorter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchResult {
    pub ok: Vec<bool>,
    pub errors: Vec<String>,
}

/// The first frame each side sends: the protocol version it speaks and who it is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Handshake {
    pub version: u16,
    /// Free-form peer name for logs (`sglang-tp3`, `kvtier-serve`).
    pub client_name: String,
}

/// The body of a frame with [`crate::frame::FLAG_ERROR`] set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ErrorReply {
    /// Machine-readable code; its meanings belong to the server.
    pub code: u16,
    pub message: String,
}
