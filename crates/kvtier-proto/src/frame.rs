//! Length-prefixed binary frames: the unit every kvtier socket carries.
//!
//! A frame is a fixed [`HEADER_LEN`]-byte header followed by `body_len` body bytes. Header
//! fields, all little-endian:
//!
//! | offset | size | field                                   |
//! |-------:|-----:|-----------------------------------------|
//! | 0      | 4    | magic, [`MAGIC`] (`b"KVT1"`)            |
//! | 4      | 2    | protocol version, [`PROTOCOL_VERSION`]  |
//! | 6      | 2    | opcode ([`Opcode`] wire value)          |
//! | 8      | 8    | request id (echoed by the response)     |
//! | 16     | 4    | flags ([`FLAG_RESPONSE`], [`FLAG_ERROR`]) |
//! | 20     | 4    | body length in bytes                    |
//!
//! Invariants:
//! - A header is accepted only with the right magic, a supported version, no unknown flag bits
//!   and a body length within the limit in force ([`MAX_FRAME_BODY`] unless the caller passes a
//!   smaller one, e.g. before the handshake). Only then is memory reserved for the body.
//! - The opcode is *not* checked while decoding a header: a peer newer than us may send one we
//!   do not know, and reading its body anyway keeps the stream in sync so we can answer with an
//!   error reply. [`FrameHeader::opcode`] does the check.
//! - [`read_frame`] reads the body straight into the caller's buffer, reusing its allocation.
//! - Writers hold the same limits as readers, so a frame that is written can be read.

use std::io::{ErrorKind, Read, Write};

use crate::codec::Encode;
use crate::error::ProtoError;
pub use crate::limits::MAX_FRAME_BODY;
use crate::opcode::Opcode;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVT1";
/// The protocol version this build sends. 2: a batch result's items carry a typed failure
/// status and the count of left-out diagnostics is a number (issue 28).
pub const PROTOCOL_VERSION: u16 = 2;
/// The oldest protocol version this build accepts: version 1 peers cannot read a typed
/// status, so a mixed pair fails at the first frame with the version named.
pub const MIN_PROTOCOL_VERSION: u16 = 2;
/// Size of the fixed frame header in bytes.
pub const HEADER_LEN: usize = 24;

/// The frame answers the request with the same request id.
pub const FLAG_RESPONSE: u32 = 1 << 0;
/// The request failed; the body is an [`crate::ErrorReply`].
pub const FLAG_ERROR: u32 = 1 << 1;
/// Every flag bit with a meaning; any other bit set is rejected, so the rest stay free for
/// future versions.
pub const KNOWN_FLAGS: u32 = FLAG_RESPONSE | FLAG_ERROR;

/// Bodies up to this size are copied next to the header and sent in one write, so a small
/// request is one segment on the wire (two writes can stall ~40 ms on Nagle + delayed ACK).
const COALESCE_BODY_LEN: usize = 4 << 10;

/// A decoded, validated frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub version: u16,
    /// Raw opcode; see [`FrameHeader::opcode`] for the checked value.
    pub opcode: u16,
    pub request_id: u64,
    pub flags: u32,
    pub body_len: u32,
}

impl FrameHeader {
    /// A header at [`PROTOCOL_VERSION`].
    pub fn new(opcode: Opcode, request_id: u64, flags: u32, body_len: u32) -> Self {
        FrameHeader {
            version: PROTOCOL_VERSION,
            opcode: opcode.as_u16(),
            request_id,
            flags,
            body_len,
        }
    }

    /// The header's wire form. Does not validate; [`write_frame`] and [`encode_frame`] do.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6..8].copy_from_slice(&self.opcode.to_le_bytes());
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..20].copy_from_slice(&self.flags.to_le_bytes());
        out[20..24].copy_from_slice(&self.body_len.to_le_bytes());
        out
    }

    /// Decode and validate the header at the front of `bytes` (bytes past [`HEADER_LEN`] are
    /// not looked at), with the body limit [`MAX_FRAME_BODY`].
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtoError> {
        Self::decode_with_limit(bytes, MAX_FRAME_BODY)
    }

    /// As [`FrameHeader::decode`], with a body limit of `max_body` (capped at
    /// [`MAX_FRAME_BODY`]).
    pub fn decode_with_limit(bytes: &[u8], max_body: u32) -> Result<Self, ProtoError> {
        let truncated = || ProtoError::Truncated {
            what: "frame header",
            needed: HEADER_LEN as u64,
            available: bytes.len(),
        };
        let (magic, rest) = bytes.split_first_chunk::<4>().ok_or_else(truncated)?;
        let (version, rest) = rest.split_first_chunk::<2>().ok_or_else(truncated)?;
        let (opcode, rest) = rest.split_first_chunk::<2>().ok_or_else(truncated)?;
        let (request_id, rest) = rest.split_first_chunk::<8>().ok_or_else(truncated)?;
        let (flags, rest) = rest.split_first_chunk::<4>().ok_or_else(truncated)?;
        let (body_len, _) = rest.split_first_chunk::<4>().ok_or_else(truncated)?;
        if *magic != MAGIC {
            return Err(ProtoError::BadMagic { found: *magic });
        }
        let header = FrameHeader {
            version: u16::from_le_bytes(*version),
            opcode: u16::from_le_bytes(*opcode),
            request_id: u64::from_le_bytes(*request_id),
            flags: u32::from_le_bytes(*flags),
            body_len: u32::from_le_bytes(*body_len),
        };
        header.validate(max_body)?;
        Ok(header)
    }

    /// The checked opcode.
    pub fn opcode(&self) -> Result<Opcode, ProtoError> {
        Opcode::try_from(self.opcode)
    }

    /// Whether this frame answers a request.
    pub fn is_response(&self) -> bool {
        self.flags & FLAG_RESPONSE != 0
    }

    /// Whether this frame reports a failed request (body: [`crate::ErrorReply`]).
    pub fn is_error(&self) -> bool {
        self.flags & FLAG_ERROR != 0
    }

    fn validate(&self, max_body: u32) -> Result<(), ProtoError> {
        if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&self.version) {
            return Err(ProtoError::UnsupportedVersion {
                found: self.version,
                min: MIN_PROTOCOL_VERSION,
                max: PROTOCOL_VERSION,
            });
        }
        check_flags(self.flags)?;
        check_body_len(u64::from(self.body_len), max_body)
    }
}

fn check_flags(flags: u32) -> Result<(), ProtoError> {
    let unknown = flags & !KNOWN_FLAGS;
    if unknown != 0 {
        return Err(ProtoError::UnknownFlags { bits: unknown });
    }
    Ok(())
}

fn check_body_len(len: u64, max_body: u32) -> Result<(), ProtoError> {
    let max = max_body.min(MAX_FRAME_BODY);
    if len > u64::from(max) {
        return Err(ProtoError::BodyTooLarge { len, max });
    }
    Ok(())
}

/// Read one frame with the body limit [`MAX_FRAME_BODY`]; see [`read_frame_limited`].
pub fn read_frame<R: Read + ?Sized>(
    reader: &mut R,
    body: &mut Vec<u8>,
) -> Result<FrameHeader, ProtoError> {
    read_frame_limited(reader, body, MAX_FRAME_BODY)
}

/// Read one frame: its header is returned, its body replaces the contents of `body` (whose
/// allocation is reused; it grows only when the body is larger than its capacity).
///
/// Memory for the body is reserved only after the header is validated, and only up to the
/// body's length, never more than `max_body` (capped at [`MAX_FRAME_BODY`]): the buffer's
/// capacity stays within the larger of its capacity on entry and that limit. A stream that ends before the first header byte
/// yields [`ProtoError::ConnectionClosed`]; one that ends inside a frame yields
/// [`ProtoError::Truncated`]. On error `body` holds no meaningful data.
pub fn read_frame_limited<R: Read + ?Sized>(
    reader: &mut R,
    body: &mut Vec<u8>,
    max_body: u32,
) -> Result<FrameHeader, ProtoError> {
    body.clear();
    let mut raw = [0u8; HEADER_LEN];
    let mut filled = 0;
    while filled < HEADER_LEN {
        match reader.read(&mut raw[filled..]) {
            Ok(0) if filled == 0 => return Err(ProtoError::ConnectionClosed),
            Ok(0) => {
                return Err(ProtoError::Truncated {
                    what: "frame header",
                    needed: HEADER_LEN as u64,
                    available: filled,
                })
            }
            Ok(read) => filled += read,
            Err(error) if error.kind() == ErrorKind::Interrupted => continue,
            Err(error) => return Err(error.into()),
        }
    }
    let header = FrameHeader::decode_with_limit(&raw, max_body)?;
    let len = header.body_len as usize;
    // Exact, not amortized: a reused buffer never grows past the largest body it has held.
    body.reserve_exact(len);
    // `take` bounds the read to this frame; read_to_end fills the reserved capacity directly
    // and retries on Interrupted.
    let read = Read::take(&mut *reader, u64::from(header.body_len)).read_to_end(body)?;
    if read < len {
        return Err(ProtoError::Truncated {
            what: "frame body",
            needed: u64::from(header.body_len),
            available: read,
        });
    }
    Ok(header)
}

/// Write one frame: a header for `opcode`, `request_id` and `flags`, then `body`.
///
/// Rejects unknown flag bits and bodies over [`MAX_FRAME_BODY`] before writing anything. Small
/// bodies go out in a single write together with the header.
pub fn write_frame<W: Write + ?Sized>(
    writer: &mut W,
    opcode: Opcode,
    request_id: u64,
    flags: u32,
    body: &[u8],
) -> Result<(), ProtoError> {
    check_flags(flags)?;
    check_body_len(body.len() as u64, MAX_FRAME_BODY)?;
    // check_body_len guarantees the length fits a u32.
    let body_len = u32::try_from(body.len()).unwrap_or(MAX_FRAME_BODY);
    let header = FrameHeader::new(opcode, request_id, flags, body_len).encode();
    if body.len() <= COALESCE_BODY_LEN {
        let mut frame = [0u8; HEADER_LEN + COALESCE_BODY_LEN];
        frame[..HEADER_LEN].copy_from_slice(&header);
        frame[HEADER_LEN..HEADER_LEN + body.len()].copy_from_slice(body);
        writer.write_all(&frame[..HEADER_LEN + body.len()])?;
    } else {
        writer.write_all(&header)?;
        writer.write_all(body)?;
    }
    Ok(())
}

/// Append a whole frame (header and the encoding of `message`) to `out`, ready for a single
/// `write_all`. On error `out` is left as it was.
pub fn encode_frame<M: Encode + ?Sized>(
    out: &mut Vec<u8>,
    opcode: Opcode,
    request_id: u64,
    flags: u32,
    message: &M,
) -> Result<(), ProtoError> {
    check_flags(flags)?;
    let start = out.len();
    out.extend_from_slice(&[0u8; HEADER_LEN]);
    if let Err(error) = message.encode(out) {
        out.truncate(start);
        return Err(error);
    }
    let body_len = out.len() - start - HEADER_LEN;
    if let Err(error) = check_body_len(body_len as u64, MAX_FRAME_BODY) {
        out.truncate(start);
        return Err(error);
    }
    let body_len = u32::try_from(body_len).unwrap_or(MAX_FRAME_BODY);
    let header = FrameHeader::new(opcode, request_id, flags, body_len).encode();
    out[start..start + HEADER_LEN].copy_from_slice(&header);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::Decode;
    use crate::messages::Handshake;
    use std::io::{self, Cursor};

    fn header_bytes(body_len: u32) -> [u8; HEADER_LEN] {
        FrameHeader::new(
            Opcode::ExistsV2,
            0x0102_0304_0506_0708,
            FLAG_RESPONSE,
            body_len,
        )
        .encode()
    }

    #[test]
    fn header_layout_is_little_endian() {
        let bytes = header_bytes(0x0a0b_0c0d);
        assert_eq!(&bytes[0..4], b"KVT1");
        assert_eq!(&bytes[4..6], &[2, 0]);
        assert_eq!(&bytes[6..8], &[3, 0]);
        assert_eq!(&bytes[8..16], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&bytes[16..20], &[1, 0, 0, 0]);
        assert_eq!(&bytes[20..24], &[0x0d, 0x0c, 0x0b, 0x0a]);
    }

    #[test]
    fn header_round_trips() {
        let header = FrameHeader::new(Opcode::BatchPut, u64::MAX, KNOWN_FLAGS, MAX_FRAME_BODY);
        let decoded = FrameHeader::decode(&header.encode()).unwrap();
        assert_eq!(decoded, header);
        assert_eq!(decoded.opcode().unwrap(), Opcode::BatchPut);
        assert!(decoded.is_response() && decoded.is_error());
    }

    #[test]
    fn header_bad_magic() {
        let mut bytes = header_bytes(0);
        bytes[0] = b'X';
        let err = FrameHeader::decode(&bytes).unwrap_err();
        assert!(
            matches!(err, ProtoError::BadMagic { found } if &found == b"XVT1"),
            "{err}"
        );
        assert!(err.to_string().contains("magic"));
    }

    #[test]
    fn header_unsupported_version() {
        for version in [
            0u16,
            MIN_PROTOCOL_VERSION - 1,
            PROTOCOL_VERSION + 1,
            u16::MAX,
        ] {
            let mut bytes = header_bytes(0);
            bytes[4..6].copy_from_slice(&version.to_le_bytes());
            let err = FrameHeader::decode(&bytes).unwrap_err();
            assert!(
                matches!(err, ProtoError::UnsupportedVersion { found, .. } if found == version),
                "{err}"
            );
        }
    }

    #[test]
    fn header_unknown_flags() {
        let mut bytes = header_bytes(0);
        bytes[16..20].copy_from_slice(&(FLAG_RESPONSE | 1 << 7).to_le_bytes());
        let err = FrameHeader::decode(&bytes).unwrap_err();
        assert!(
            matches!(err, ProtoError::UnknownFlags { bits: 0x80 }),
            "{err}"
        );
    }

    #[test]
    fn header_oversized_body() {
        let err = FrameHeader::decode(&header_bytes(MAX_FRAME_BODY + 1)).unwrap_err();
        assert!(
            matches!(err, ProtoError::BodyTooLarge { len, max } if len == u64::from(MAX_FRAME_BODY) + 1 && max == MAX_FRAME_BODY),
            "{err}"
        );
        let err = FrameHeader::decode_with_limit(&header_bytes(4097), 4096).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::BodyTooLarge {
                    len: 4097,
                    max: 4096
                }
            ),
            "{err}"
        );
        // A caller limit above the protocol limit is capped.
        assert!(FrameHeader::decode_with_limit(&header_bytes(u32::MAX), u32::MAX).is_err());
    }

    #[test]
    fn header_truncated_at_every_length() {
        let bytes = header_bytes(0);
        for len in 0..HEADER_LEN {
            let err = FrameHeader::decode(&bytes[..len]).unwrap_err();
            assert!(
                matches!(err, ProtoError::Truncated { what: "frame header", available, .. } if available == len),
                "{len}: {err}"
            );
        }
    }

    #[test]
    fn unknown_opcode_is_reported_but_the_header_decodes() {
        let mut bytes = header_bytes(0);
        bytes[6..8].copy_from_slice(&999u16.to_le_bytes());
        let header = FrameHeader::decode(&bytes).unwrap();
        assert!(matches!(
            header.opcode(),
            Err(ProtoError::UnknownOpcode(999))
        ));
    }

    #[test]
    fn frames_round_trip_over_a_stream_reusing_the_buffer() {
        let mut wire = Vec::new();
        let big = vec![0x5a; COALESCE_BODY_LEN + 1];
        write_frame(&mut wire, Opcode::Ping, 1, 0, b"").unwrap();
        write_frame(&mut wire, Opcode::BatchGet, 2, FLAG_RESPONSE, &big).unwrap();
        write_frame(&mut wire, Opcode::ExistsV2, 3, 0, b"abc").unwrap();

        let mut reader = Cursor::new(wire);
        let mut body = Vec::with_capacity(64 << 10);
        let allocation = body.as_ptr();
        let first = read_frame(&mut reader, &mut body).unwrap();
        assert_eq!(
            (first.opcode().unwrap(), first.request_id, first.body_len),
            (Opcode::Ping, 1, 0)
        );
        assert!(body.is_empty());
        let second = read_frame(&mut reader, &mut body).unwrap();
        assert_eq!(second.request_id, 2);
        assert!(second.is_response());
        assert_eq!(body, big);
        let third = read_frame(&mut reader, &mut body).unwrap();
        assert_eq!(third.opcode().unwrap(), Opcode::ExistsV2);
        assert_eq!(body, b"abc");
        assert_eq!(
            body.as_ptr(),
            allocation,
            "the caller's allocation is reused"
        );
        assert!(matches!(
            read_frame(&mut reader, &mut body),
            Err(ProtoError::ConnectionClosed)
        ));
    }

    #[test]
    fn stream_truncated_inside_header_or_body() {
        let mut wire = Vec::new();
        write_frame(&mut wire, Opcode::Ping, 1, 0, b"hello").unwrap();
        let mut body = Vec::new();
        let err = read_frame(&mut Cursor::new(&wire[..10]), &mut body).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::Truncated {
                    what: "frame header",
                    available: 10,
                    ..
                }
            ),
            "{err}"
        );
        let err = read_frame(&mut Cursor::new(&wire[..HEADER_LEN + 2]), &mut body).unwrap_err();
        assert!(
            matches!(
                err,
                ProtoError::Truncated {
                    what: "frame body",
                    needed: 5,
                    available: 2
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn oversized_body_is_rejected_before_reserving() {
        let wire = header_bytes(1 << 20);
        let mut body = Vec::new();
        let err = read_frame_limited(&mut Cursor::new(wire), &mut body, 1024).unwrap_err();
        assert!(matches!(err, ProtoError::BodyTooLarge { .. }), "{err}");
        assert_eq!(body.capacity(), 0, "nothing reserved for a rejected frame");
    }

    /// Yields at most `chunk` bytes per read and an `Interrupted` error between reads.
    struct Choppy {
        data: Cursor<Vec<u8>>,
        chunk: usize,
        interrupt: bool,
    }

    impl Read for Choppy {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.interrupt = !self.interrupt;
            if self.interrupt {
                return Err(io::Error::new(ErrorKind::Interrupted, "signal"));
            }
            let len = buf.len().min(self.chunk);
            self.data.read(&mut buf[..len])
        }
    }

    #[test]
    fn short_reads_and_interrupts_are_retried() {
        let mut wire = Vec::new();
        write_frame(&mut wire, Opcode::BatchExists, 9, 0, &[1, 2, 3, 4, 5, 6, 7]).unwrap();
        let mut reader = Choppy {
            data: Cursor::new(wire),
            chunk: 3,
            interrupt: false,
        };
        let mut body = Vec::new();
        let header = read_frame(&mut reader, &mut body).unwrap();
        assert_eq!(header.request_id, 9);
        assert_eq!(body, [1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn io_errors_surface_as_io() {
        struct Broken;
        impl Read for Broken {
            fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
                Err(io::Error::new(ErrorKind::ConnectionReset, "reset"))
            }
        }
        let err = read_frame(&mut Broken, &mut Vec::new()).unwrap_err();
        assert!(
            matches!(err, ProtoError::Io(ref e) if e.kind() == ErrorKind::ConnectionReset),
            "{err}"
        );
    }

    #[test]
    fn writer_enforces_limits_before_writing() {
        let mut wire = Vec::new();
        let err = write_frame(&mut wire, Opcode::Ping, 1, 1 << 9, b"").unwrap_err();
        assert!(
            matches!(err, ProtoError::UnknownFlags { bits: 0x200 }),
            "{err}"
        );
        // calloc'd, so this costs no page faults.
        let too_big = vec![0u8; MAX_FRAME_BODY as usize + 1];
        let err = write_frame(&mut wire, Opcode::Ping, 1, 0, &too_big).unwrap_err();
        assert!(matches!(err, ProtoError::BodyTooLarge { .. }), "{err}");
        assert!(wire.is_empty());
    }

    #[test]
    fn encode_frame_builds_one_readable_buffer() {
        let hello = Handshake {
            version: PROTOCOL_VERSION,
            client_name: "tp0".into(),
        };
        let mut out = b"prev".to_vec();
        encode_frame(&mut out, Opcode::Handshake, 42, 0, &hello).unwrap();
        let mut body = Vec::new();
        let header = read_frame(&mut Cursor::new(&out[4..]), &mut body).unwrap();
        assert_eq!(header.opcode().unwrap(), Opcode::Handshake);
        assert_eq!(header.request_id, 42);
        assert_eq!(Handshake::decode(&body).unwrap(), hello);

        let bad = Handshake {
            version: 1,
            client_name: "x".repeat(crate::limits::MAX_NAME_LEN + 1),
        };
        let before = out.clone();
        assert!(encode_frame(&mut out, Opcode::Handshake, 43, 0, &bad).is_err());
        assert!(encode_frame(&mut out, Opcode::Handshake, 43, 1 << 31, &hello).is_err());
        assert_eq!(
            out, before,
            "failed frame encodes leave the buffer as it was"
        );
    }
}
