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

/// Why one item of a batch failed, typed (issue 28): what a store decided, carried as one
/// status byte per item where a batch result crosses a socket (see [`crate::codec`]) and
/// mapped once at each boundary (a store's own error into it, it into the front end's
/// answer: a miss is `False`, the others raise or are logged). Never recovered from a
/// message's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
pub enum ItemFailure {
    /// No more precise reason was given (an untyped failure; the message says it).
    #[error("failed")]
    Failed,
    /// The store does not hold the object: an answer, not a fault.
    #[error("not found")]
    Miss,
    /// The object is stored with another length than the caller's buffer.
    #[error("stored length differs from the buffer")]
    WrongLength,
    /// The bytes failed their end-to-end checksum (forged, torn or another key's): never a hit.
    #[error("failed its end-to-end checksum")]
    Integrity,
    /// The store could not be reached (connection lost, server or node down, no master, a
    /// timeout): the same call may succeed later.
    #[error("store unavailable")]
    Unavailable,
    /// The caller's buffer was refused before any copy (outside registered memory, revoked,
    /// no memory behind it).
    #[error("buffer refused")]
    BadBuffer,
    /// No room for the object (the store is full, or it is larger than the store).
    #[error("no room")]
    NoRoom,
    /// Another writer is storing the object right now.
    #[error("another writer is storing it")]
    Busy,
}

impl ItemFailure {
    /// The wire status byte of a failed item (`1` is an item that succeeded; `0` an untyped
    /// failure, which is also what a result of the older bool form says).
    pub fn code(self) -> u8 {
        match self {
            ItemFailure::Failed => 0,
            ItemFailure::Miss => 2,
            ItemFailure::WrongLength => 3,
            ItemFailure::Integrity => 4,
            ItemFailure::Unavailable => 5,
            ItemFailure::BadBuffer => 6,
            ItemFailure::NoRoom => 7,
            ItemFailure::Busy => 8,
        }
    }

    /// The failure a status byte names (`None`: the byte is `1`, success, or unknown).
    pub fn from_code(code: u8) -> Option<ItemFailure> {
        Some(match code {
            0 => ItemFailure::Failed,
            2 => ItemFailure::Miss,
            3 => ItemFailure::WrongLength,
            4 => ItemFailure::Integrity,
            5 => ItemFailure::Unavailable,
            6 => ItemFailure::BadBuffer,
            7 => ItemFailure::NoRoom,
            8 => ItemFailure::Busy,
            _ => return None,
        })
    }

    /// Every failure, for tests and documentation tables.
    pub const ALL: [ItemFailure; 8] = [
        ItemFailure::Failed,
        ItemFailure::Miss,
        ItemFailure::WrongLength,
        ItemFailure::Integrity,
        ItemFailure::Unavailable,
        ItemFailure::BadBuffer,
        ItemFailure::NoRoom,
        ItemFailure::Busy,
    ];
}

/// The per-key outcome of a batch call: the one result type of every store call (the client
/// re-exports it) and the wire reply of the batch opcodes (issue 16: there used to be two).
///
/// `ok` is parallel to the request's keys. `failures` says why each failed item failed
/// ([`Self::failure`]): parallel to `ok` (an ok item's entry means nothing), or empty when no
/// failure is typed. `errors` holds the distinct free-form diagnostics of the failed entries,
/// for logging only; it is not index-aligned with `ok` and may be shorter, and no decision
/// is taken on its text. [`Self::note_error`] keeps at most [`MAX_ERRORS_PER_BATCH`] of them
/// and counts the other distinct ones in `suppressed_errors`.
///
/// On the wire `suppressed_errors` is a number after the messages (protocol 2; see
/// [`crate::codec`]): nothing is parsed back out of a message's text.
#[derive(Clone, Debug, Default)]
pub struct BatchResult {
    pub ok: Vec<bool>,
    pub errors: Vec<String>,
    pub suppressed_errors: usize,
    pub failures: Vec<ItemFailure>,
}

/// Equal when every item's outcome ([`BatchResult::failure`]) and the diagnostics are: an
/// empty `failures` and one of untyped failures say the same.
impl PartialEq for BatchResult {
    fn eq(&self, other: &Self) -> bool {
        self.ok == other.ok
            && self.errors == other.errors
            && self.suppressed_errors == other.suppressed_errors
            && (0..self.ok.len()).all(|i| self.failure(i) == other.failure(i))
    }
}

impl Eq for BatchResult {}

impl BatchResult {
    pub fn with_capacity(n: usize) -> Self {
        BatchResult {
            ok: Vec::with_capacity(n),
            ..Default::default()
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

    /// Every item failed for one typed reason (`reason` says more, for the log).
    pub fn all_failed_as(n: usize, failure: ItemFailure, reason: impl Into<String>) -> Self {
        let mut r = BatchResult::all_failed(n, reason);
        if failure != ItemFailure::Failed {
            r.failures = vec![failure; n];
        }
        r
    }

    /// A result with no diagnostics (existence and removal replies).
    pub fn flags(ok: Vec<bool>) -> Self {
        BatchResult {
            ok,
            ..Default::default()
        }
    }

    /// Why item `i` failed; `None` when it succeeded (or is out of range).
    pub fn failure(&self, i: usize) -> Option<ItemFailure> {
        match self.ok.get(i) {
            Some(false) => Some(self.failures.get(i).copied().unwrap_or(ItemFailure::Failed)),
            _ => None,
        }
    }

    /// Append one item that succeeded.
    pub fn push_ok(&mut self) {
        self.ok.push(true);
        if !self.failures.is_empty() {
            self.failures.push(ItemFailure::Failed);
        }
    }

    /// Append one item that failed as `failure` (a miss carries no message: it is an answer).
    pub fn push_failed(&mut self, failure: ItemFailure) {
        self.typed();
        self.ok.push(false);
        self.failures.push(failure);
    }

    /// Mark item `i` failed as `failure`.
    pub fn set_failed(&mut self, i: usize, failure: ItemFailure) {
        if i < self.ok.len() {
            self.ok[i] = false;
            self.typed();
            self.failures[i] = failure;
        }
    }

    /// Make `failures` parallel to `ok` (filled with untyped failures).
    fn typed(&mut self) {
        self.failures.resize(self.ok.len(), ItemFailure::Failed);
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
        if !other.failures.is_empty() || !self.failures.is_empty() {
            let mine = self.ok.len();
            self.typed();
            self.failures.truncate(mine);
            let theirs = other.ok.len();
            self.failures
                .extend((0..theirs).map(|i| other.failure(i).unwrap_or(ItemFailure::Failed)));
        }
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
