//! Bodies of the local-server protocol (`kvtier serve`) beyond the generic batch messages:
//! sessions, shared-memory regions, page batches over composed keys, and text replies.
//!
//! A client process opens one *session* (its tenant, its registered regions, its accounting)
//! on its first connection and may attach more connections to it with the session's ticket;
//! regions registered through any of them belong to the session and are unmapped when its last
//! connection closes. Page bytes never travel in frames: a [`PageIo`] names each buffer as a
//! [`ShmRef`] (region, offset, length) inside memory the client registered with
//! `RegisterRegion`, whose memfd travels beside that frame as `SCM_RIGHTS` ancillary data.
//!
//! Wire forms (same primitives as [`crate::codec`]):
//! ```text
//! OpenSession   := str(tenant) str(client_name) (0x00 | 0x01 varint(session_id) varint(token))
//! SessionTicket := varint(session_id) varint(token)
//! RegisterRegion:= str(label) varint(fd_offset) varint(len)
//! RegionGrant   := varint(region)
//! ShmRef        := varint(region) varint(offset) varint(len)
//! PageKeys      := bytes(prefix) count(pages) bytes(page_key)* count(comps) bytes(suffix)*
//! PageIo        := PageKeys ShmRef*(pages*comps) (0x00 | 0x01 varint(depth)*pages)
//! Count         := varint(value)
//! ObjectLens    := count (0x00 | 0x01 varint(len))*
//! TextReply     := str(text)
//! InspectQuery  := count(keys) bytes(key)* (0x00 | 0x01 bytes(prefix)) varint(limit)
//! ```
//! The same invariants hold as for every other body: canonical, strict (trailing bytes, bad
//! tags and over-limit counts are errors), symmetric limits, allocation bounded by input size.

use crate::codec::{
    check_limit, longest, put_bytes, put_key_list, put_len, put_page_keys, put_varint,
    read_key_list, read_page_keys, Decode, Encode, Reader,
};
use crate::error::ProtoError;
use crate::limits::{
    MAX_KEYS_PER_BATCH, MAX_KEY_LEN, MAX_NAME_LEN, MAX_SUFFIXES_PER_POOL, MAX_TEXT_LEN,
};

/// Codes of [`crate::ErrorReply`] sent by `kvtier serve`.
pub mod error_code {
    /// The request body (or the frame) could not be decoded.
    pub const MALFORMED: u16 = 1;
    /// The opcode is unknown or not a request this server serves.
    pub const UNSUPPORTED: u16 = 2;
    /// The request needs a session (`OpenSession` first) or named an unknown one.
    pub const NO_SESSION: u16 = 3;
    /// The server refuses new clients (limit reached).
    pub const TOO_MANY_CLIENTS: u16 = 4;
    /// A region could not be registered (no fd, not shared memory, out of bounds, limits).
    pub const REGISTRATION: u16 = 5;
    /// The server is shutting down.
    pub const SHUTTING_DOWN: u16 = 6;
    /// The store failed in a way that is not a per-key result.
    pub const INTERNAL: u16 = 7;
    /// The protocol version of the handshake is not spoken here.
    pub const VERSION: u16 = 8;
}

const OPTION_NONE: u8 = 0;
const OPTION_SOME: u8 = 1;

/// Ticket of an open session: attach more connections with it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionTicket {
    pub session_id: u64,
    pub token: u64,
}

/// Open a session (`join: None`) or attach this connection to an existing one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenSession {
    /// Namespace for quotas and accounting; empty = the default tenant.
    pub tenant: String,
    pub client_name: String,
    pub join: Option<SessionTicket>,
}

/// Register `[fd_offset, fd_offset + len)` of the memfd sent with this frame.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RegisterRegion {
    pub label: String,
    pub fd_offset: u64,
    pub len: u64,
}

/// A region id: the reply to `RegisterRegion`, and the body of `UnregisterRegion`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionGrant {
    pub region: u64,
}

/// One buffer inside a registered region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShmRef {
    pub region: u64,
    pub offset: u64,
    pub len: u64,
}

/// `pages x components` composed keys: object `(i, j)` is `prefix ++ page_keys[i] ++
/// suffixes[j]` (see [`crate::query::compose_key`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageKeys {
    pub prefix: Vec<u8>,
    pub page_keys: Vec<Vec<u8>>,
    pub suffixes: Vec<Vec<u8>>,
}

impl PageKeys {
    /// Objects named: pages x components.
    pub fn objects(&self) -> usize {
        self.page_keys.len().saturating_mul(self.suffixes.len())
    }
}

/// A page batch with its buffers (`PutPages`, `GetPages`); buffer `i * C + j` belongs to
/// object `(i, j)`. `depths` (one per page) only means something for puts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageIo {
    pub keys: PageKeys,
    pub buffers: Vec<ShmRef>,
    pub depths: Option<Vec<u32>>,
}

/// A single number (the reply to `ExistsPagesPrefix`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count {
    pub value: u64,
}

/// Stored length per key (`None`: absent), the reply to `ObjectLen`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectLens {
    pub lens: Vec<Option<u64>>,
}

/// Free text (the JSON document of `Stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextReply {
    pub text: String,
}

/// The body of `Inspect`: exact keys to look up, and/or a prefix to enumerate (at most `limit`
/// keys per store).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InspectQuery {
    pub keys: Vec<Vec<u8>>,
    pub prefix: Option<Vec<u8>>,
    pub limit: u64,
}

// ---------------------------------------------------------------------------------------------

impl Encode for InspectQuery {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_key_list(
            out,
            "key count",
            "key",
            &self.keys,
            MAX_KEYS_PER_BATCH,
            MAX_KEY_LEN,
        )?;
        match &self.prefix {
            None => out.push(OPTION_NONE),
            Some(p) => {
                out.push(OPTION_SOME);
                put_bytes(out, "key prefix", p, MAX_KEY_LEN)?;
            }
        }
        put_varint(out, self.limit);
        Ok(())
    }
}

impl Decode for InspectQuery {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let keys = read_key_list(reader, "key count", "key", MAX_KEYS_PER_BATCH, MAX_KEY_LEN)?;
        let prefix = match reader.read_u8("prefix tag")? {
            OPTION_NONE => None,
            OPTION_SOME => Some(reader.read_bytes("key prefix", MAX_KEY_LEN)?.to_vec()),
            tag => {
                return Err(ProtoError::InvalidTag {
                    what: "prefix tag",
                    tag,
                })
            }
        };
        let limit = reader.read_varint("inspect limit")?;
        Ok(InspectQuery {
            keys,
            prefix,
            limit,
        })
    }
}

impl Encode for SessionTicket {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_varint(out, self.session_id);
        put_varint(out, self.token);
        Ok(())
    }
}

impl Decode for SessionTicket {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(SessionTicket {
            session_id: reader.read_varint("session id")?,
            token: reader.read_varint("session token")?,
        })
    }
}

impl Encode for OpenSession {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "tenant", self.tenant.as_bytes(), MAX_NAME_LEN)?;
        put_bytes(
            out,
            "client name",
            self.client_name.as_bytes(),
            MAX_NAME_LEN,
        )?;
        match &self.join {
            None => out.push(OPTION_NONE),
            Some(ticket) => {
                out.push(OPTION_SOME);
                ticket.encode_fields(out)?;
            }
        }
        Ok(())
    }
}

impl Decode for OpenSession {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let tenant = reader.read_string("tenant", MAX_NAME_LEN)?;
        let client_name = reader.read_string("client name", MAX_NAME_LEN)?;
        let join = match reader.read_u8("session join tag")? {
            OPTION_NONE => None,
            OPTION_SOME => Some(SessionTicket::read_from(reader)?),
            tag => {
                return Err(ProtoError::InvalidTag {
                    what: "session join tag",
                    tag,
                })
            }
        };
        Ok(OpenSession {
            tenant,
            client_name,
            join,
        })
    }
}

impl Encode for RegisterRegion {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "region label", self.label.as_bytes(), MAX_NAME_LEN)?;
        put_varint(out, self.fd_offset);
        put_varint(out, self.len);
        Ok(())
    }
}

impl Decode for RegisterRegion {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(RegisterRegion {
            label: reader.read_string("region label", MAX_NAME_LEN)?,
            fd_offset: reader.read_varint("region fd offset")?,
            len: reader.read_varint("region length")?,
        })
    }
}

impl Encode for RegionGrant {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_varint(out, self.region);
        Ok(())
    }
}

impl Decode for RegionGrant {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(RegionGrant {
            region: reader.read_varint("region id")?,
        })
    }
}

impl Encode for ShmRef {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_varint(out, self.region);
        put_varint(out, self.offset);
        put_varint(out, self.len);
        Ok(())
    }
}

impl Decode for ShmRef {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(ShmRef {
            region: reader.read_varint("buffer region")?,
            offset: reader.read_varint("buffer offset")?,
            len: reader.read_varint("buffer length")?,
        })
    }
}

fn check_page_keys(keys: &PageKeys) -> Result<(), ProtoError> {
    // Every composed key obeys the one key-length rule (only when there is a key to compose).
    if !keys.page_keys.is_empty() && !keys.suffixes.is_empty() {
        let composed = keys.prefix.len() + longest(&keys.page_keys) + longest(&keys.suffixes);
        check_limit("composed key length", composed as u64, MAX_KEY_LEN as u64)?;
    }
    check_limit(
        "objects in a page batch",
        keys.objects() as u64,
        MAX_KEYS_PER_BATCH as u64,
    )
}

impl Encode for PageKeys {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        check_page_keys(self)?;
        put_page_keys(out, &self.prefix, &self.page_keys, MAX_KEYS_PER_BATCH)?;
        put_key_list(
            out,
            "component count",
            "component suffix",
            &self.suffixes,
            MAX_SUFFIXES_PER_POOL,
            MAX_KEY_LEN,
        )
    }
}

impl Decode for PageKeys {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let (prefix, page_keys) = read_page_keys(reader, MAX_KEYS_PER_BATCH)?;
        let suffixes = read_key_list(
            reader,
            "component count",
            "component suffix",
            MAX_SUFFIXES_PER_POOL,
            MAX_KEY_LEN,
        )?;
        let keys = PageKeys {
            prefix,
            page_keys,
            suffixes,
        };
        check_page_keys(&keys)?;
        Ok(keys)
    }
}

impl Encode for PageIo {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        let objects = self.keys.objects();
        if self.buffers.len() != objects {
            return Err(ProtoError::LengthMismatch {
                what: "page buffers",
                expected: objects,
                found: self.buffers.len(),
            });
        }
        let pages = self.keys.page_keys.len();
        if let Some(depths) = &self.depths {
            if depths.len() != pages {
                return Err(ProtoError::LengthMismatch {
                    what: "page depths",
                    expected: pages,
                    found: depths.len(),
                });
            }
        }
        self.keys.encode_fields(out)?;
        for buffer in &self.buffers {
            buffer.encode_fields(out)?;
        }
        match &self.depths {
            None => out.push(OPTION_NONE),
            Some(depths) => {
                out.push(OPTION_SOME);
                for &depth in depths {
                    put_varint(out, u64::from(depth));
                }
            }
        }
        Ok(())
    }
}

/// Fail before reserving room for `count` items of at least `min_len` bytes each when the input
/// cannot hold them.
fn ensure_room(
    reader: &Reader<'_>,
    what: &'static str,
    count: usize,
    min_len: usize,
) -> Result<(), ProtoError> {
    let needed = (count as u64).saturating_mul(min_len as u64);
    if needed > reader.remaining() as u64 {
        return Err(ProtoError::Truncated {
            what,
            needed,
            available: reader.remaining(),
        });
    }
    Ok(())
}

impl Decode for PageIo {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let keys = PageKeys::read_from(reader)?;
        let objects = keys.objects();
        // Each buffer is at least three one-byte varints.
        ensure_room(reader, "page buffers", objects, 3)?;
        let mut buffers = Vec::with_capacity(objects);
        for _ in 0..objects {
            buffers.push(ShmRef::read_from(reader)?);
        }
        let pages = keys.page_keys.len();
        let depths = match reader.read_u8("page depths tag")? {
            OPTION_NONE => None,
            OPTION_SOME => {
                ensure_room(reader, "page depths", pages, 1)?;
                let mut depths = Vec::with_capacity(pages);
                for _ in 0..pages {
                    depths.push(reader.read_u32("page depth")?);
                }
                Some(depths)
            }
            tag => {
                return Err(ProtoError::InvalidTag {
                    what: "page depths tag",
                    tag,
                })
            }
        };
        Ok(PageIo {
            keys,
            buffers,
            depths,
        })
    }
}

impl Encode for Count {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_varint(out, self.value);
        Ok(())
    }
}

impl Decode for Count {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(Count {
            value: reader.read_varint("count")?,
        })
    }
}

impl Encode for ObjectLens {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_len(out, "length count", self.lens.len(), MAX_KEYS_PER_BATCH)?;
        for len in &self.lens {
            match len {
                None => out.push(OPTION_NONE),
                Some(len) => {
                    out.push(OPTION_SOME);
                    put_varint(out, *len);
                }
            }
        }
        Ok(())
    }
}

impl Decode for ObjectLens {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let count = reader.read_count("length count", MAX_KEYS_PER_BATCH, 1)?;
        let mut lens = Vec::with_capacity(count);
        for _ in 0..count {
            lens.push(match reader.read_u8("length tag")? {
                OPTION_NONE => None,
                OPTION_SOME => Some(reader.read_varint("object length")?),
                tag => {
                    return Err(ProtoError::InvalidTag {
                        what: "length tag",
                        tag,
                    })
                }
            });
        }
        Ok(ObjectLens { lens })
    }
}

impl Encode for TextReply {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "text", self.text.as_bytes(), MAX_TEXT_LEN)
    }
}

impl Decode for TextReply {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        Ok(TextReply {
            text: reader.read_string("text", MAX_TEXT_LEN)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inspect_query_round_trips_and_rejects_bad_bodies() {
        for q in [
            InspectQuery {
                keys: vec![b"a@fp.c4".to_vec(), b"b".to_vec()],
                prefix: None,
                limit: 0,
            },
            InspectQuery {
                keys: Vec::new(),
                prefix: Some(b"tenant/".to_vec()),
                limit: 1000,
            },
        ] {
            let bytes = q.encode_to_vec().unwrap();
            assert_eq!(InspectQuery::decode(&bytes).unwrap(), q);
            // Every strict prefix of the body is short; one more byte is trailing.
            for cut in 0..bytes.len() {
                assert!(InspectQuery::decode(&bytes[..cut]).is_err(), "cut {cut}");
            }
            let mut long = bytes.clone();
            long.push(0);
            assert!(InspectQuery::decode(&long).is_err());
        }
        // A bad prefix tag is named.
        let bytes = [0x00, 0x07, 0x00];
        assert!(matches!(
            InspectQuery::decode(&bytes),
            Err(ProtoError::InvalidTag {
                what: "prefix tag",
                tag: 7
            })
        ));
        let long_key = InspectQuery {
            keys: vec![vec![b'x'; MAX_KEY_LEN + 1]],
            ..Default::default()
        };
        assert!(long_key.encode_to_vec().is_err());
    }

    #[test]
    fn page_io_round_trips_and_checks_shape() {
        let io = PageIo {
            keys: PageKeys {
                prefix: b"t/".to_vec(),
                page_keys: vec![b"a".to_vec(), b"b".to_vec()],
                suffixes: vec![b".k".to_vec(), b".v".to_vec()],
            },
            buffers: (0..4)
                .map(|i| ShmRef {
                    region: 1,
                    offset: i * 4096,
                    len: 4096,
                })
                .collect(),
            depths: Some(vec![3, 4]),
        };
        let bytes = io.encode_to_vec().unwrap();
        assert_eq!(PageIo::decode(&bytes).unwrap(), io);
        let mut short = io.clone();
        short.buffers.pop();
        assert!(matches!(
            short.encode_to_vec(),
            Err(ProtoError::LengthMismatch { .. })
        ));
        let mut long_key = io;
        long_key.keys.prefix = vec![b'x'; MAX_KEY_LEN];
        assert!(matches!(
            long_key.encode_to_vec(),
            Err(ProtoError::LimitExceeded { .. })
        ));
    }

    #[test]
    fn huge_claimed_counts_fail_before_allocating() {
        // 60000 pages x 1 suffix claimed, but no buffers follow.
        let mut bytes = vec![0u8]; // empty prefix
        put_varint(&mut bytes, 60_000);
        bytes.extend(std::iter::repeat_n(0u8, 60_000)); // empty page keys
        put_varint(&mut bytes, 1);
        bytes.push(0); // empty suffix
        let err = PageIo::decode(&bytes).unwrap_err();
        assert!(matches!(err, ProtoError::Truncated { .. }), "{err}");
    }
}
