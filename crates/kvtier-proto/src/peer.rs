//! Bodies of the peer data port: what a cluster client sends a node (`kvtier serve --master`)
//! over TCP, and the error codes the node answers with.
//!
//! Every connection starts with [`PeerHello`] carrying the cluster's shared secret; nothing
//! else is served before the node accepted it. Page bytes travel inside frames, right after a
//! small metadata prefix ([`PeerPutMeta`]) or as the whole response body (`PeerGet`), so a
//! reader can take them straight into the destination buffer once it has checked the length.
//!
//! Wire forms (same primitives as [`crate::codec`]):
//! ```text
//! PeerHello   := bytes(token) str(name)
//! PeerPutMeta := bytes(key) (0x00 | 0x01 varint(depth))      ; the object's bytes follow
//! PeerGet     := bytes(key) varint(expected_len)
//! ```

use crate::codec::{put_bytes, put_varint, Decode, Encode, Reader};
use crate::error::ProtoError;
use crate::limits::{MAX_KEY_LEN, MAX_NAME_LEN};

/// Longest cluster token accepted.
pub const MAX_TOKEN_LEN: usize = 1024;

/// Most keys one `PeerClear` reply lists: a reply of the longest keys stays within 36 MiB, well
/// inside one frame (typical keys of about 100 bytes: under 1 MiB).
pub const MAX_CLEARED_KEYS: usize = 8192;

const _: () = assert!(MAX_CLEARED_KEYS * (MAX_KEY_LEN + 8) <= 36 << 20);

/// Codes of [`crate::ErrorReply`] sent by a node's data port (beyond
/// [`crate::server::error_code`]).
pub mod peer_error_code {
    /// The cluster token is wrong (or missing): the connection is closed.
    pub const UNAUTHORIZED: u16 = 20;
    /// The object is not stored on this node.
    pub const NOT_FOUND: u16 = 21;
    /// The object is stored with another length than the reader expects.
    pub const SIZE_MISMATCH: u16 = 22;
    /// The node's store refused the put (no space, bad key).
    pub const STORE: u16 = 23;
}

/// The first frame on a peer connection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerHello {
    pub token: Vec<u8>,
    /// Free-form name of the connecting process, for logs.
    pub name: String,
}

/// The metadata in front of a `PeerPut` body's object bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerPutMeta {
    pub key: Vec<u8>,
    pub depth: Option<u32>,
}

/// Read one object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerGet {
    pub key: Vec<u8>,
    /// The length the reader's buffer has; a stored object of another length is refused.
    pub expected_len: u64,
}

impl Encode for PeerHello {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "cluster token", &self.token, MAX_TOKEN_LEN)?;
        put_bytes(out, "peer name", self.name.as_bytes(), MAX_NAME_LEN)
    }
}

impl Decode for PeerHello {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let token = reader.read_bytes("cluster token", MAX_TOKEN_LEN)?.to_vec();
        let name = reader.read_string("peer name", MAX_NAME_LEN)?;
        Ok(PeerHello { token, name })
    }
}

impl Encode for PeerPutMeta {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "key", &self.key, MAX_KEY_LEN)?;
        match self.depth {
            None => out.push(0),
            Some(depth) => {
                out.push(1);
                put_varint(out, u64::from(depth));
            }
        }
        Ok(())
    }
}

impl Decode for PeerPutMeta {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let key = reader.read_bytes("key", MAX_KEY_LEN)?.to_vec();
        let depth = match reader.read_u8("depth tag")? {
            0 => None,
            1 => Some(reader.read_u32("depth")?),
            tag => {
                return Err(ProtoError::InvalidTag {
                    what: "depth tag",
                    tag,
                })
            }
        };
        Ok(PeerPutMeta { key, depth })
    }
}

impl PeerPutMeta {
    /// Split a `PeerPut` body into its metadata and the object bytes after it.
    pub fn split_body(body: &[u8]) -> Result<(PeerPutMeta, &[u8]), ProtoError> {
        let mut reader = Reader::new(body);
        let meta = PeerPutMeta::read_from(&mut reader)?;
        let consumed = body.len() - reader.remaining();
        Ok((meta, &body[consumed..]))
    }
}

impl Encode for PeerGet {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "key", &self.key, MAX_KEY_LEN)?;
        put_varint(out, self.expected_len);
        Ok(())
    }
}

impl Decode for PeerGet {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let key = reader.read_bytes("key", MAX_KEY_LEN)?.to_vec();
        let expected_len = reader.read_varint("expected length")?;
        Ok(PeerGet { key, expected_len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_round_trip_and_reject_trailing_bytes() {
        let hello = PeerHello {
            token: b"secret".to_vec(),
            name: "client".into(),
        };
        assert_eq!(
            PeerHello::decode(&hello.encode_to_vec().unwrap()).unwrap(),
            hello
        );
        let get = PeerGet {
            key: b"k".to_vec(),
            expected_len: 1 << 20,
        };
        let mut bytes = get.encode_to_vec().unwrap();
        assert_eq!(PeerGet::decode(&bytes).unwrap(), get);
        bytes.push(0);
        assert!(PeerGet::decode(&bytes).is_err());
        let meta = PeerPutMeta {
            key: b"page".to_vec(),
            depth: Some(3),
        };
        let mut body = meta.encode_to_vec().unwrap();
        body.extend_from_slice(b"VALUE");
        let (back, value) = PeerPutMeta::split_body(&body).unwrap();
        assert_eq!((back, value), (meta, &b"VALUE"[..]));
        assert!(
            PeerPutMeta::split_body(&[0x05, b'a']).is_err(),
            "truncated key"
        );
        assert!(
            PeerPutMeta::split_body(&[0x01, b'a', 9]).is_err(),
            "bad depth tag"
        );
    }
}
