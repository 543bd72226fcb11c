//! Bodies of the peer data port: what a cluster client sends a node (`kvtier serve --master`)
//! over TCP, and the error codes the node answers with.
//!
//! Every connection starts with a mutual challenge-response over the cluster token
//! ([`crate::auth`]); the token itself never crosses the wire, and nothing else is served
//! before both sides proved it:
//!
//! 1. client -> node: `PeerHello` frame, body [`PeerHello`] (a fresh client nonce, a name);
//! 2. node -> client: `PeerHello` response, body [`PeerChallenge`] (a fresh node nonce and the
//!    node's proof over its data address, as the master lists it and the client dialled it,
//!    and both nonces: a relay at another address cannot pass a real node's proof on). The client checks the proof before it sends anything
//!    derived from the token: a process that does not hold the token (a fake node, a
//!    redirected address) learns nothing and is refused;
//! 3. client -> node: a second `PeerHello` frame, body [`PeerAuth`] (the client's proof over
//!    both nonces, under another label); the node answers with an empty body, or
//!    `UNAUTHORIZED` and closes the connection.
//!
//! Page bytes travel inside frames, right after a small metadata prefix ([`PeerPutMeta`]) or as
//! the whole response body (`PeerGet`), so a reader can take them straight into the
//! destination buffer once it has checked the length. Cluster objects end with a 16-byte
//! integrity trailer keyed with the cluster token ([`crate::auth::ObjectIntegrity`]) that
//! every reader verifies; every key on the port is in the cluster namespace
//! ([`crate::namespace`]).
//!
//! Wire forms (same primitives as [`crate::codec`]):
//! ```text
//! PeerHello     := bytes(client_nonce) str(name)
//! PeerChallenge := bytes(node_nonce) bytes(node_proof)
//! PeerAuth      := bytes(client_proof)
//! PeerPutMeta   := bytes(key) (0x00 | 0x01 varint(depth))      ; the object's bytes follow
//! PeerGet       := bytes(key) varint(expected_len)
//! ```

use crate::auth::{NONCE_LEN, PROOF_LEN};
use crate::codec::{put_bytes, put_varint, Decode, Encode, Reader};
use crate::error::ProtoError;
use crate::limits::{MAX_KEY_LEN, MAX_NAME_LEN};

/// Longest cluster token accepted (configuration; the token itself never crosses the wire).
pub const MAX_TOKEN_LEN: usize = 1024;

/// Most keys one `PeerClear` reply lists: a reply of the longest keys stays within 36 MiB, well
/// inside one frame (typical keys of about 100 bytes: under 1 MiB).
pub const MAX_CLEARED_KEYS: usize = 8192;

const _: () = assert!(MAX_CLEARED_KEYS * (MAX_KEY_LEN + 8) <= 36 << 20);

/// Codes of [`crate::ErrorReply`] sent by a node's data port (beyond
/// [`crate::server::error_code`]).
pub mod peer_error_code {
    /// The peer did not prove the cluster token: the connection is closed.
    pub const UNAUTHORIZED: u16 = 20;
    /// The object is not stored on this node.
    pub const NOT_FOUND: u16 = 21;
    /// The object is stored with another length than the reader expects.
    pub const SIZE_MISMATCH: u16 = 22;
    /// The node's store refused the put (no space, bad key).
    pub const STORE: u16 = 23;
    /// A key (or clear prefix) outside the cluster namespace
    /// ([`crate::namespace::is_cluster_key`]): the data port serves no local tenant's keys.
    /// The whole request is refused, nothing is touched.
    pub const OUTSIDE_CLUSTER_NAMESPACE: u16 = 24;
}

/// The first frame on a peer connection: the client's challenge.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerHello {
    /// [`NONCE_LEN`] fresh random bytes.
    pub nonce: Vec<u8>,
    /// Free-form name of the connecting process, for logs.
    pub name: String,
}

/// The node's answer to [`PeerHello`]: its own challenge and its proof of the token.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerChallenge {
    /// [`NONCE_LEN`] fresh random bytes.
    pub nonce: Vec<u8>,
    /// `proof(token, PEER_NODE_LABEL, [node data address, client nonce, node nonce])`.
    pub proof: Vec<u8>,
}

/// The client's proof of the token, the second frame on a peer connection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerAuth {
    /// `proof(token, PEER_CLIENT_LABEL, [node data address, client nonce, node nonce])`.
    pub proof: Vec<u8>,
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

/// Read a field that must be exactly `len` bytes long.
fn read_exact_field(
    reader: &mut Reader<'_>,
    what: &'static str,
    len: usize,
) -> Result<Vec<u8>, ProtoError> {
    let bytes = reader.read_bytes(what, len)?;
    if bytes.len() != len {
        return Err(ProtoError::Truncated {
            what,
            needed: len as u64,
            available: bytes.len(),
        });
    }
    Ok(bytes.to_vec())
}

impl Encode for PeerHello {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "client nonce", &self.nonce, NONCE_LEN)?;
        put_bytes(out, "peer name", self.name.as_bytes(), MAX_NAME_LEN)
    }
}

impl Decode for PeerHello {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let nonce = read_exact_field(reader, "client nonce", NONCE_LEN)?;
        let name = reader.read_string("peer name", MAX_NAME_LEN)?;
        Ok(PeerHello { nonce, name })
    }
}

impl Encode for PeerChallenge {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "node nonce", &self.nonce, NONCE_LEN)?;
        put_bytes(out, "node proof", &self.proof, PROOF_LEN)
    }
}

impl Decode for PeerChallenge {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let nonce = read_exact_field(reader, "node nonce", NONCE_LEN)?;
        let proof = read_exact_field(reader, "node proof", PROOF_LEN)?;
        Ok(PeerChallenge { nonce, proof })
    }
}

impl Encode for PeerAuth {
    fn encode_fields(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        put_bytes(out, "client proof", &self.proof, PROOF_LEN)
    }
}

impl Decode for PeerAuth {
    fn read_from(reader: &mut Reader<'_>) -> Result<Self, ProtoError> {
        let proof = read_exact_field(reader, "client proof", PROOF_LEN)?;
        Ok(PeerAuth { proof })
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
            nonce: vec![1; NONCE_LEN],
            name: "client".into(),
        };
        assert_eq!(
            PeerHello::decode(&hello.encode_to_vec().unwrap()).unwrap(),
            hello
        );
        let short = PeerHello {
            nonce: vec![1; 8],
            name: String::new(),
        };
        assert!(PeerHello::decode(&short.encode_to_vec().unwrap()).is_err());
        let challenge = PeerChallenge {
            nonce: vec![2; NONCE_LEN],
            proof: vec![3; PROOF_LEN],
        };
        assert_eq!(
            PeerChallenge::decode(&challenge.encode_to_vec().unwrap()).unwrap(),
            challenge
        );
        let auth = PeerAuth {
            proof: vec![4; PROOF_LEN],
        };
        assert_eq!(
            PeerAuth::decode(&auth.encode_to_vec().unwrap()).unwrap(),
            auth
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
