//! Proofs of the cluster credential, and the keyed end-to-end integrity trailer of cluster
//! objects ([`ObjectIntegrity`]: GMAC as a universal hash of the value under a token-derived
//! key, then keyed BLAKE3 as a PRF over that hash, the object key and the length; the argument
//! why that is a MAC is on the type).
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

use aws_lc_rs::aead;
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

/// Context of the derivation of [`ObjectIntegrity`]'s hash key `K_g` (BLAKE3 `derive_key`):
/// the integrity keys are never the token itself, never each other, and never a key of any
/// other use of the token.
pub const OBJECT_INTEGRITY_HASH_CONTEXT: &str = "kvtier cluster object integrity v2: GHASH key";
/// Context of the derivation of [`ObjectIntegrity`]'s PRF key `K_f`.
pub const OBJECT_INTEGRITY_PRF_CONTEXT: &str = "kvtier cluster object integrity v2: PRF key";

/// Length of the integrity trailer stored after each cluster object: a 128-bit tag.
pub const CHECKSUM_LEN: usize = 16;

/// The one GCM nonce of the hash step. Reusing it is what makes the step a hash: safe only
/// because its output never leaves the process (see [`ObjectIntegrity`]).
const HASH_NONCE: [u8; aead::NONCE_LEN] = *b"kvtier-uhf-2";

/// The end-to-end integrity check of cluster objects, keyed with secrets derived from the
/// cluster token. Written by the first writer after the value and checked by every reader (and
/// by a node on a one-sided put) before the bytes count: only holders of the token can produce
/// a valid trailer, so bytes a node serves for another key, torn or rotted bytes, and bytes
/// forged by anyone without the token (a local user who reached the store, an on-path
/// attacker) are a miss, never a hit.
///
/// # Construction: a universal hash, then a PRF
///
/// With `K_g = derive_key(`[`OBJECT_INTEGRITY_HASH_CONTEXT`]`, token)` and
/// `K_f = derive_key(`[`OBJECT_INTEGRITY_PRF_CONTEXT`]`, token)`:
///
/// ```text
/// h       = GMAC(K_g, nonce = HASH_NONCE, aad = value)      // AES-256-GCM, empty plaintext
/// trailer = BLAKE3_keyed(K_f, len(key) || key || h || len(value))[..16]
/// ```
///
/// (lengths as u64 little-endian). The shape is that of AES-GCM-SIV's tag and of Wegman-Carter
/// / "UHF-then-PRF" MACs; the reason for it is speed: GMAC runs at the speed of the carry-less
/// multiplier (30 GB/s on 1 MiB here, against 10 GB/s for BLAKE3 keyed over the whole value),
/// and the PRF only ever sees tens of bytes.
///
/// Why it is a MAC:
/// - `h = GHASH_H(value) xor E_K(J0)` with `H = E_K(0^128)` secret (AES under `K_g`) and a
///   constant mask `E_K(J0)` (the nonce is fixed). GHASH evaluates a polynomial in `H` whose
///   coefficients are the value's 16-byte blocks followed by a block of the value's bit length,
///   so for two different values of at most `l` blocks, `h = h'` is a nonzero polynomial of
///   degree at most `l + 1` vanishing at `H`: probability at most `(l + 1) / 2^128` over the
///   key. `h` is an almost-universal hash of the value, nothing more.
/// - A fixed-nonce GMAC alone would NOT be a MAC: two revealed tags give `GHASH_H(a) xor
///   GHASH_H(b)`, a polynomial whose roots reveal `H`, and then forgeries are easy. Here `h`
///   never leaves the process; only PRF outputs are revealed, and a PRF output says nothing
///   about its input. `K_g` has no other use (no ciphertext or tag is ever made with it).
/// - Forging a trailer for `(key', value')` without the token therefore needs either a guess of
///   the 128-bit PRF output (2^-128 per try), breaking BLAKE3 as a PRF, or a PRF input equal to
///   one already sealed: the same key and length with `GHASH_H(value') = GHASH_H(value)` for
///   `value' != value`, which happens with probability at most `(l + 1) / 2^128` per pair
///   under the unknown `H`. Over `q` sealed objects of at most `l` blocks, about
///   `q * (l + 1) / 2^128` per forgery attempt (2 MiB objects, `q = 2^40`: about 2^-71). This
///   holds for values the attacker chose and saw sealed (an on-path observer of a member's
///   puts of pages it influenced): what it sees of `H` is only whether two PRF inputs were
///   equal, i.e. a GHASH collision it has to find first.
/// - Every part of the PRF input has a fixed length or a length prefix, so no two different
///   `(key, h, len)` inputs are the same bytes.
///
/// The computation needs the whole value (aws-lc-rs's safe API takes the AAD at once): every
/// path (TCP frames, UCX one-sided puts and reads, the node's check of a landed put) calls
/// [`ObjectIntegrity::trailer`] or [`ObjectIntegrity::verify`] on the whole value. Trailers are
/// compared in constant time.
#[derive(Clone)]
pub struct ObjectIntegrity {
    /// `K_g`: used only for [`HASH_NONCE`], an empty plaintext and the value as AAD.
    hash: std::sync::Arc<aead::LessSafeKey>,
    /// `K_f`, the BLAKE3 key of the PRF step.
    prf: [u8; 32],
}

impl std::fmt::Debug for ObjectIntegrity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys.
        f.write_str("ObjectIntegrity")
    }
}

impl ObjectIntegrity {
    /// The integrity keys of the cluster whose token is `token`.
    pub fn from_token(token: &[u8]) -> ObjectIntegrity {
        let hash_key = blake3::derive_key(OBJECT_INTEGRITY_HASH_CONTEXT, token);
        // AES-256 takes any 32 bytes; aws-lc refuses a key only for a wrong length.
        let unbound = match aead::UnboundKey::new(&aead::AES_256_GCM, &hash_key) {
            Ok(key) => key,
            Err(_) => unreachable!("AES-256-GCM accepts every 32-byte key"),
        };
        ObjectIntegrity {
            hash: std::sync::Arc::new(aead::LessSafeKey::new(unbound)),
            prf: blake3::derive_key(OBJECT_INTEGRITY_PRF_CONTEXT, token),
        }
    }

    /// `h`: GMAC of `value` under `K_g` and the fixed nonce. `None` only where GCM refuses the
    /// AAD (over 2^61 bytes, beyond any object): the caller then fails closed.
    fn hash(&self, value: &[u8]) -> Option<[u8; 16]> {
        let nonce = aead::Nonce::assume_unique_for_key(HASH_NONCE);
        let tag = self
            .hash
            .seal_in_place_separate_tag(nonce, aead::Aad::from(value), &mut [])
            .ok()?;
        tag.as_ref().try_into().ok()
    }

    fn seal(&self, key: &[u8], value: &[u8]) -> Option<[u8; CHECKSUM_LEN]> {
        let h = self.hash(value)?;
        let mut prf = blake3::Hasher::new_keyed(&self.prf);
        prf.update(&(key.len() as u64).to_le_bytes());
        prf.update(key);
        prf.update(&h);
        prf.update(&(value.len() as u64).to_le_bytes());
        let mut out = [0u8; CHECKSUM_LEN];
        prf.finalize_xof().fill(&mut out);
        Some(out)
    }

    /// The trailer of the object `key` holding `value`. (For a value GCM cannot take, over
    /// 2^61 bytes, all zeros: [`Self::verify`] refuses every trailer of such a value.)
    pub fn trailer(&self, key: &[u8], value: &[u8]) -> [u8; CHECKSUM_LEN] {
        self.seal(key, value).unwrap_or([0; CHECKSUM_LEN])
    }

    /// Whether `trailer` is [`Self::trailer`]`(key, value)` (compared in constant time).
    pub fn verify(&self, key: &[u8], value: &[u8], trailer: &[u8]) -> bool {
        self.seal(key, value).is_some_and(|expected| {
            aws_lc_rs::constant_time::verify_slices_are_equal(&expected, trailer).is_ok()
        })
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
        // Deterministic: another instance from the same token (another process) agrees.
        assert_eq!(
            ObjectIntegrity::from_token(b"tok").trailer(b"k", b"value"),
            t
        );
        assert!(!seal.verify(b"k", b"valuf", &t));
        assert!(!seal.verify(b"kv", b"alue", &t));
        assert!(!seal.verify(b"k", b"value", &t[..CHECKSUM_LEN - 1]));
        assert!(!seal.verify(b"k", b"value", &[t.as_slice(), &[0]].concat()));
        // Another token (anyone without this one) cannot produce it.
        let other = ObjectIntegrity::from_token(b"tok2");
        assert_ne!(other.trailer(b"k", b"value"), t);
        assert!(!other.verify(b"k", b"value", &t));
        // The keys are derived, not the token: unkeyed hashes of the same input differ.
        let mut plain = blake3::Hasher::new();
        plain.update(&1u64.to_le_bytes());
        plain.update(b"k");
        plain.update(b"value");
        assert_ne!(&plain.finalize().as_bytes()[..CHECKSUM_LEN], &t[..]);
        assert_eq!(format!("{seal:?}"), "ObjectIntegrity");
        // Empty values and keys are sealed too (GHASH of no block is its length block).
        let empty = seal.trailer(b"", b"");
        assert!(seal.verify(b"", b"", &empty));
        assert!(!seal.verify(b"", b"\0", &empty));
        assert!(!seal.verify(b"\0", b"", &empty));
    }

    /// Over page-sized values: a trailer made with another token, for another key, for a value
    /// one bit off anywhere, or for a value of another length (zeros appended: the same GHASH
    /// blocks once padded, told apart by the length block) never verifies.
    #[test]
    fn trailer_refuses_another_token_key_bit_or_length() {
        let seal = ObjectIntegrity::from_token(b"cluster token");
        let other = ObjectIntegrity::from_token(b"cluster token ");
        let key = b"\0Cprod\x1fpage-0001";
        for len in [1usize, 15, 16, 17, 4096, 65536 + 3] {
            let value: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
            let t = seal.trailer(key, &value);
            assert!(seal.verify(key, &value, &t), "{len}");
            assert!(
                !seal.verify(key, &value, &other.trailer(key, &value)),
                "{len}"
            );
            assert!(!other.verify(key, &value, &t), "{len}");
            assert!(!seal.verify(b"\0Cprod\x1fpage-0002", &value, &t), "{len}");
            assert!(!seal.verify(&key[..key.len() - 1], &value, &t), "{len}");
            for bit in [0, 7, 8 * len / 2 + 3, 8 * len - 1] {
                let mut flipped = value.clone();
                flipped[bit / 8] ^= 1 << (bit % 8);
                assert!(!seal.verify(key, &flipped, &t), "{len} bit {bit}");
                assert_ne!(seal.trailer(key, &flipped), t, "{len} bit {bit}");
            }
            let mut longer = value.clone();
            longer.push(0);
            assert!(!seal.verify(key, &longer, &t), "{len}");
            let padded = [value.as_slice(), &vec![0; 16 - len % 16]].concat();
            assert!(!seal.verify(key, &padded, &t), "{len} padded");
            assert!(!seal.verify(key, &value[..len - 1], &t), "{len}");
            // A flipped bit in the trailer itself.
            let mut bad = t;
            bad[CHECKSUM_LEN - 1] ^= 0x80;
            assert!(!seal.verify(key, &value, &bad), "{len}");
        }
    }

    /// The hash step alone is GMAC under a fixed nonce; the trailer is not that tag (nor the
    /// v1 trailer, BLAKE3 keyed over the whole object), so the GHASH output is never revealed.
    #[test]
    fn trailer_is_not_the_gmac_tag_nor_the_v1_trailer() {
        let seal = ObjectIntegrity::from_token(b"tok");
        let value = vec![9u8; 4096];
        let t = seal.trailer(b"k", &value);
        let h = seal.hash(&value).unwrap();
        assert_ne!(h, t);
        let v1_key = blake3::derive_key("kvtier cluster object integrity v1", b"tok");
        let mut v1 = blake3::Hasher::new_keyed(&v1_key);
        v1.update(&1u64.to_le_bytes());
        v1.update(b"k");
        v1.update(&value);
        assert_ne!(&v1.finalize().as_bytes()[..CHECKSUM_LEN], &t[..]);
    }
}
