//! Proofs of the cluster credential, and the keyed end-to-end integrity trailer of cluster
//! objects ([`ObjectIntegrity`]).
//!
//! The cluster token never crosses the wire: every party proves it holds the token with an
//! HMAC-SHA-256 over fresh values, domain-separated by a label per use, so a proof made for one
//! purpose (a node's answer on its data port, a client's answer, a master RPC) is never valid
//! for another, and a proof seen on the network reveals nothing about the token.
//!
//! - Data ports ([`crate::peer`]): a mutual challenge-response. The client sends a random
//!   nonce; the node answers with its own nonce and `HMAC(token, PEER_NODE_LABEL, client nonce,
//!   node nonce)`; the client checks it *before* it proves anything itself (a fake node learns
//!   nothing), then answers `HMAC(token, PEER_CLIENT_LABEL, client nonce, node nonce)`.
//! - Master RPCs: each request carries [`RPC_AUTH_HEADER`] = `v1.<unix ms>.<nonce>.<mac>` with
//!   `mac = HMAC(token, MASTER_RPC_LABEL, rpc path, unix ms, nonce)`; the master checks the
//!   time window and refuses a nonce it saw within it (replay).
//!
//! Every part of a MAC input is length-prefixed, so no two different part lists hash alike.
//! MACs are compared in constant time (`hmac`'s `verify_slice`).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Length of a challenge nonce, bytes.
pub const NONCE_LEN: usize = 32;
/// Length of an HMAC-SHA-256 proof, bytes.
pub const PROOF_LEN: usize = 32;

/// Label of the proof a node's data port gives of the token (challenge from the client).
pub const PEER_NODE_LABEL: &[u8] = b"kvtier data port: node proof v1";
/// Label of the proof a data-port client gives of the token (challenge from the node).
pub const PEER_CLIENT_LABEL: &[u8] = b"kvtier data port: client proof v1";
/// Label of a master RPC's proof.
pub const MASTER_RPC_LABEL: &[u8] = b"kvtier master rpc v1";

/// gRPC metadata key of a master RPC's proof.
pub const RPC_AUTH_HEADER: &str = "kvtier-auth";
/// Nonce length of a master RPC proof, bytes.
pub const RPC_NONCE_LEN: usize = 16;

type HmacSha256 = Hmac<Sha256>;

fn keyed(token: &[u8], label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    let mut mac = match HmacSha256::new_from_slice(token) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC accepts keys of any length"),
    };
    for part in std::iter::once(label).chain(parts.iter().copied()) {
        mac.update(&(part.len() as u64).to_le_bytes());
        mac.update(part);
    }
    mac
}

/// `HMAC-SHA-256(token, label, parts...)`.
pub fn proof(token: &[u8], label: &[u8], parts: &[&[u8]]) -> [u8; PROOF_LEN] {
    keyed(token, label, parts).finalize().into_bytes().into()
}

/// Whether `candidate` is [`proof`]`(token, label, parts)` (constant time in its contents).
pub fn verify(token: &[u8], label: &[u8], parts: &[&[u8]], candidate: &[u8]) -> bool {
    keyed(token, label, parts).verify_slice(candidate).is_ok()
}

/// A fresh random nonce from the operating system.
pub fn nonce<const N: usize>() -> Result<[u8; N], getrandom::Error> {
    let mut out = [0u8; N];
    getrandom::fill(&mut out)?;
    Ok(out)
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

fn unhex<const N: usize>(text: &str) -> Option<[u8; N]> {
    let raw = text.as_bytes();
    if raw.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; N];
    for (i, pair) in raw.chunks_exact(2).enumerate() {
        out[i] = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(out)
}

/// The [`RPC_AUTH_HEADER`] value for one call of `path` (`/package.Service/Method`).
pub fn rpc_credential(
    token: &[u8],
    path: &str,
    unix_ms: u64,
    nonce: &[u8; RPC_NONCE_LEN],
) -> String {
    let mac = proof(
        token,
        MASTER_RPC_LABEL,
        &[path.as_bytes(), &unix_ms.to_le_bytes(), nonce],
    );
    format!("v1.{unix_ms}.{}.{}", hex(nonce), hex(&mac))
}

/// A parsed [`RPC_AUTH_HEADER`] value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RpcCredential {
    pub unix_ms: u64,
    pub nonce: [u8; RPC_NONCE_LEN],
    pub mac: [u8; PROOF_LEN],
}

impl RpcCredential {
    /// Parse a header value; `None` for anything malformed.
    pub fn parse(text: &str) -> Option<RpcCredential> {
        let mut parts = text.split('.');
        if parts.next()? != "v1" {
            return None;
        }
        let unix_ms = parts.next()?.parse().ok()?;
        let nonce = unhex(parts.next()?)?;
        let mac = unhex(parts.next()?)?;
        parts.next().is_none().then_some(RpcCredential {
            unix_ms,
            nonce,
            mac,
        })
    }

    /// Whether the MAC proves the token for a call of `path`.
    pub fn verify(&self, token: &[u8], path: &str) -> bool {
        verify(
            token,
            MASTER_RPC_LABEL,
            &[path.as_bytes(), &self.unix_ms.to_le_bytes(), &self.nonce],
            &self.mac,
        )
    }
}

/// Context of the key derivation of [`ObjectIntegrity`] (BLAKE3 `derive_key`): the integrity
/// key is never the token itself, and never a key of any other use of it.
pub const OBJECT_INTEGRITY_CONTEXT: &str = "kvtier cluster object integrity v1";

/// Length of the integrity trailer stored after each cluster object: a 128-bit tag.
pub const CHECKSUM_LEN: usize = 16;

/// The end-to-end integrity check of cluster objects, keyed with a secret derived from the
/// cluster token: the trailer is BLAKE3 in keyed mode, key = `derive_key(`
/// [`OBJECT_INTEGRITY_CONTEXT`]`, token)`, over the key's length, the key and the value,
/// truncated to [`CHECKSUM_LEN`] bytes. Written by the first writer after the value and checked
/// by every reader (and by a node on a one-sided put) before the bytes count: only holders of
/// the token can produce a valid trailer, so bytes a node serves for another key, torn or
/// rotted bytes, and bytes forged by anyone without the token (a local user who reached the
/// store, an on-path attacker) are a miss, never a hit.
///
/// [`ObjectIntegrity::sealer`] is the one computation every path uses (TCP frames, UCX
/// one-sided puts and reads, the node's check of a landed put): [`ObjectIntegrity::trailer`]
/// and [`ObjectIntegrity::verify`] run it over a whole value, a reader that receives the
/// value in pieces feeds them in order (hashing each piece while it is still in cache).
#[derive(Clone)]
pub struct ObjectIntegrity {
    key: [u8; 32],
}

impl std::fmt::Debug for ObjectIntegrity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.write_str("ObjectIntegrity")
    }
}

impl ObjectIntegrity {
    /// The integrity key of the cluster whose token is `token`.
    pub fn from_token(token: &[u8]) -> ObjectIntegrity {
        ObjectIntegrity {
            key: blake3::derive_key(OBJECT_INTEGRITY_CONTEXT, token),
        }
    }

    /// The trailer of the object `key` in the making: feed its value in order
    /// ([`Sealer::update`]), then [`Sealer::finish`] or [`Sealer::verify`].
    pub fn sealer(&self, key: &[u8]) -> Sealer {
        let mut hasher = blake3::Hasher::new_keyed(&self.key);
        hasher.update(&(key.len() as u64).to_le_bytes());
        hasher.update(key);
        Sealer(hasher)
    }

    /// The trailer of the object `key` holding `value`.
    pub fn trailer(&self, key: &[u8], value: &[u8]) -> [u8; CHECKSUM_LEN] {
        let mut sealer = self.sealer(key);
        sealer.update(value);
        sealer.finish()
    }

    /// Whether `trailer` is [`Self::trailer`]`(key, value)` (compared in constant time).
    pub fn verify(&self, key: &[u8], value: &[u8], trailer: &[u8]) -> bool {
        let mut sealer = self.sealer(key);
        sealer.update(value);
        sealer.verify(trailer)
    }
}

/// One object's integrity trailer being computed ([`ObjectIntegrity::sealer`]).
pub struct Sealer(blake3::Hasher);

impl Sealer {
    /// The next bytes of the value.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The trailer of the bytes fed so far.
    pub fn finish(&self) -> [u8; CHECKSUM_LEN] {
        let mut out = [0u8; CHECKSUM_LEN];
        self.0.finalize_xof().fill(&mut out);
        out
    }

    /// Whether `trailer` is the trailer of the bytes fed so far (constant time in its
    /// contents).
    pub fn verify(&self, trailer: &[u8]) -> bool {
        trailer.len() == CHECKSUM_LEN
            && self
                .finish()
                .iter()
                .zip(trailer)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_are_bound_to_token_label_and_parts() {
        let p = proof(b"secret", PEER_NODE_LABEL, &[b"a", b"b"]);
        assert!(verify(b"secret", PEER_NODE_LABEL, &[b"a", b"b"], &p));
        assert!(!verify(b"secret2", PEER_NODE_LABEL, &[b"a", b"b"], &p));
        assert!(!verify(b"secret", PEER_CLIENT_LABEL, &[b"a", b"b"], &p));
        // Length prefixes: moving a byte between parts changes the proof.
        assert!(!verify(b"secret", PEER_NODE_LABEL, &[b"ab", b""], &p));
        assert!(!verify(b"secret", PEER_NODE_LABEL, &[b"a", b"b"], &p[..31]));
    }

    #[test]
    fn rpc_credentials_round_trip_and_bind_the_path() {
        let nonce = [7u8; RPC_NONCE_LEN];
        let text = rpc_credential(b"tok", "/kvtier.master.v1.Master/Heartbeat", 1234, &nonce);
        let cred = RpcCredential::parse(&text).unwrap();
        assert_eq!((cred.unix_ms, cred.nonce), (1234, nonce));
        assert!(cred.verify(b"tok", "/kvtier.master.v1.Master/Heartbeat"));
        assert!(!cred.verify(b"tok", "/kvtier.master.v1.Master/LeaveNode"));
        assert!(!cred.verify(b"other", "/kvtier.master.v1.Master/Heartbeat"));
        assert!(RpcCredential::parse("v1.1.00.00").is_none());
        assert!(RpcCredential::parse(&format!("{text}.x")).is_none());
        assert!(RpcCredential::parse(&text.replace("v1", "v2")).is_none());
    }

    #[test]
    fn trailer_binds_token_key_and_value() {
        let seal = ObjectIntegrity::from_token(b"tok");
        let t = seal.trailer(b"k", b"value");
        assert!(seal.verify(b"k", b"value", &t));
        assert!(!seal.verify(b"k", b"valuf", &t));
        assert!(!seal.verify(b"kv", b"alue", &t));
        assert!(!seal.verify(b"k", b"value", &t[..CHECKSUM_LEN - 1]));
        // Another token (anyone without this one) cannot produce it.
        let other = ObjectIntegrity::from_token(b"tok2");
        assert_ne!(other.trailer(b"k", b"value"), t);
        assert!(!other.verify(b"k", b"value", &t));
        // The key is derived, not the token: an unkeyed hash of the same input differs.
        let mut plain = blake3::Hasher::new();
        plain.update(&1u64.to_le_bytes());
        plain.update(b"k");
        plain.update(b"value");
        assert_ne!(&plain.finalize().as_bytes()[..CHECKSUM_LEN], &t[..]);
        assert_eq!(format!("{seal:?}"), "ObjectIntegrity");
        // Fed in pieces: the same trailer.
        let mut pieces = seal.sealer(b"k");
        pieces.update(b"val");
        pieces.update(b"");
        pieces.update(b"ue");
        assert_eq!(pieces.finish(), t);
        assert!(pieces.verify(&t));
    }
}
