//! The one error type of kvtier-proto.
//!
//! Every decoder, every encoder and the frame reader/writer report through [`ProtoError`]. Each
//! variant names *what* was being read (a `&'static str` chosen at the call site, such as
//! `"page key"`) so a log line says which field of which message was bad, not just "decode
//! failed". A peer that sends any of these is broken or hostile; the caller answers with an
//! error reply or drops the connection, and never acts on the partial value.

use std::io;

/// Everything that can go wrong while framing, encoding or decoding a kvtier message.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// The first four bytes of a frame are not [`crate::frame::MAGIC`].
    #[error("bad frame magic {found:02x?}, expected {expected:02x?}: not a kvtier peer, or the stream lost sync", expected = crate::frame::MAGIC)]
    BadMagic { found: [u8; 4] },

    /// The frame header carries a protocol version this build does not speak.
    #[error("unsupported protocol version {found}; this build speaks {min}..={max}")]
    UnsupportedVersion { found: u16, min: u16, max: u16 },

    /// An opcode that [`crate::opcode::Opcode`] does not define.
    #[error("unknown opcode {0}")]
    UnknownOpcode(u16),

    /// Frame flag bits that [`crate::frame::KNOWN_FLAGS`] does not define.
    #[error("unknown frame flag bits {bits:#010x}")]
    UnknownFlags { bits: u32 },

    /// A frame body longer than the limit in force (header decode, read or write).
    #[error("frame body of {len} bytes exceeds the limit of {max} bytes")]
    BodyTooLarge { len: u64, max: u32 },

    /// The input ended before `what` was complete.
    #[error("truncated input: {what} needs {needed} bytes but only {available} are left")]
    Truncated {
        what: &'static str,
        needed: u64,
        available: usize,
    },

    /// A complete message was decoded but bytes were left over in its body.
    #[error("{count} trailing bytes after a complete {what}")]
    TrailingBytes { what: &'static str, count: usize },

    /// A varint that is not in canonical (shortest) form or does not fit 64 bits.
    #[error("malformed varint in {what}: {reason}")]
    BadVarint {
        what: &'static str,
        reason: &'static str,
    },

    /// A count, length or value over a protocol limit (see [`crate::limits`]) or its type's range.
    #[error("{what} is {value}, over the limit of {limit}")]
    LimitExceeded {
        what: &'static str,
        value: u64,
        limit: u64,
    },

    /// An enum tag, option tag or boolean byte with no defined meaning.
    #[error("invalid tag byte {tag} for {what}")]
    InvalidTag { what: &'static str, tag: u8 },

    /// A string field that is not valid UTF-8.
    #[error("{what} is not valid UTF-8")]
    InvalidUtf8 { what: &'static str },

    /// Parallel lists of one batch whose lengths disagree (only an encoder can see this; the
    /// wire format sends the count once, so a decoded batch is always consistent).
    #[error("{what} has {found} entries where {expected} were expected")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        found: usize,
    },

    /// An [`crate::ExistsV2Answer`] that the fold could never have produced. Accepting it could
    /// make a client restore pages that are not there, so it fails closed instead.
    #[error("invalid exists-v2 answer: {0}")]
    InvalidAnswer(&'static str),

    /// The peer closed the stream cleanly on a frame boundary (zero header bytes read).
    #[error("peer closed the connection between frames")]
    ConnectionClosed,

    /// The underlying reader or writer failed.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
}
