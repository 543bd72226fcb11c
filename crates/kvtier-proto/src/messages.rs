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

/// Most distinct error messages one batch result keeps; the rest are counted in
/// [`BatchResult::suppressed_errors`].
pub const MAX_ERRORS_PER_BATCH: usize = 8;

/// The per-key outcome of a batch call: the one result type of every store call (the client
/// re-exports it) and the wire reply of the batch opcodes (issue 16: there used to be two).
///
/// `ok` is parallel to the request's keys. `errors` holds the distinct free-form diagnostics
/// of the failed entries, for logging only; it is not index-aligned with `ok` and may be
/// shorter. [`Self::note_error`] keeps at most [`MAX_ERRORS_PER_BATCH`] of them and counts the
/// other distinct ones in `suppressed_errors`.
///
/// On the wire a non-zero `suppressed_errors` travels as one last error message
/// `... and N more distinct errors` (the form servers of this version always sent), which the
/// decoder folds back into the count; see [`crate::codec`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchResult {
    pub ok: Vec<bool>,
    pub errors: Vec<String>,
    pub suppressed_errors: usize,
}

impl BatchResult {
    pub fn with_capacity(n: usize) -> Self {
        BatchResult {
            ok: Vec::with_capacity(n),
            errors: Vec::new(),
            suppressed_errors: 0,
        }
    }

    /// Every item failed for one reason.
    pub fn all_failed(n: usize, reason: impl Into<String>) -> Self {
        let mut r = BatchResult {
            ok: vec![false; n],
            ..Default::default()
        };
        r.note_error(reason.into());
        r
    }

    /// A result with no diagnostics (existence and removal replies).
    pub fn flags(ok: Vec<bool>) -> Self {
        BatchResult {
            ok,
            ..Default::default()
        }
    }

    pub fn note_error(&mut self, message: String) {
        if self.errors.contains(&message) {
            return;
        }
        if self.errors.len() < MAX_ERRORS_PER_BATCH {
            self.errors.push(message);
        } else {
            self.suppressed_errors += 1;
        }
    }

    /// Append another result's items and errors (for batches split across threads or
    /// chunks, and for replies decoded from a peer).
    pub fn absorb(&mut self, other: BatchResult) {
        self.ok.extend(other.ok);
        self.suppressed_errors += other.suppressed_errors;
        for e in other.errors {
            self.note_error(e);
        }
    }

    pub fn succeeded(&self) -> usize {
        self.ok.iter().filter(|&&b| b).count()
    }

    /// Cut every error message to [`crate::limits::MAX_MESSAGE_LEN`] bytes (on a char
    /// boundary) so the result encodes: a server replies with messages it did not write
    /// (I/O errors, peer replies) and must not fail the whole reply over one long one.
    pub fn fit_messages(mut self) -> Self {
        for e in &mut self.errors {
            if e.len() > crate::limits::MAX_MESSAGE_LEN {
                let mut end = crate::limits::MAX_MESSAGE_LEN;
                while !e.is_char_boundary(end) {
                    end -= 1;
                }
                e.truncate(end);
            }
        }
        self
    }
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
