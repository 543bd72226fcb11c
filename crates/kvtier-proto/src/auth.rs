//! Proofs of the cluster credential, and the end-to-end object checksum of cluster mode.
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

/// The end-to-end checksum of a cluster object: XXH3-64 over the key's length, the key and the
/// value. Written by the client after the value (8 bytes, little endian) and checked by every
/// reader, so bytes a node serves for another key, torn bytes, or bytes changed at rest or in
/// flight are a miss, never a hit. Not a MAC: it does not stop a token holder who forges both.
pub fn object_checksum(key: &[u8], value: &[u8]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(&(key.len() as u64).to_le_bytes());
    hasher.update(key);
    hasher.update(value);
    hasher.digest()
}

/// Length of the checksum trailer stored after each cluster object.
pub const CHECKSUM_LEN: usize = 8;

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
    fn checksum_binds_key_and_value() {
        let c = object_checksum(b"k", b"value");
        assert_ne!(c, object_checksum(b"k", b"valuf"));
        assert_ne!(c, object_checksum(b"kv", b"alue"));
        assert_eq!(c, object_checksum(b"k", b"value"));
    }
}
