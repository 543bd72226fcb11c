//! Property tests of the body codec: round trips for every message, and robustness of every
//! decoder against random bytes, truncations and mutations of valid encodings.
//!
//! Beyond "never panics", the decoders are held to two stronger properties:
//! - canonical: whenever a decode succeeds, re-encoding gives back exactly the input bytes;
//! - bounded allocation: the decoded value holds at most a small constant times the input
//!   length in heap memory, whatever counts the input claims.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use kvtier_proto::query::evaluate;
use kvtier_proto::{
    BatchResult, Decode, Encode, ErrorReply, ExistsV2Answer, ExistsV2Query, Handshake, KeyBatch,
    PutBatchHeader,
};
use proptest::collection::vec;
use proptest::prelude::*;

/// Decode `bytes` as `T`; on success check canonical re-encoding and the allocation bound.
fn check_decode<T>(bytes: &[u8]) -> Result<Option<T>, TestCaseError>
where
    T: Decode + Encode + HeapFootprint + std::fmt::Debug,
{
    match T::decode(bytes) {
        Err(_) => Ok(None),
        Ok(value) => {
            let again = value
                .encode_to_vec()
                .map_err(|e| TestCaseError::fail(format!("decoded value must re-encode: {e}")))?;
            prop_assert_eq!(again.as_slice(), bytes, "encoding is canonical");
            prop_assert!(
                allocation_is_justified(value.heap_bytes(), bytes.len()),
                "{} heap bytes for {} input bytes",
                value.heap_bytes(),
                bytes.len()
            );
            Ok(Some(value))
        }
    }
}

#[derive(Clone, Debug)]
enum Mutation {
    Overwrite { at: usize, byte: u8 },
    Insert { at: usize, byte: u8 },
    Remove { at: usize },
    FlipBit { at: usize, bit: u8 },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Overwrite { at, byte }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert { at, byte }),
        any::<usize>().prop_map(|at| Mutation::Remove { at }),
        (any::<usize>(), 0..8u8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
    ]
}

fn apply(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let len = bytes.len();
    match *mutation {
        Mutation::Overwrite { at, byte } if len > 0 => bytes[at % len] = byte,
        Mutation::Insert { at, byte } => bytes.insert(at % (len + 1), byte),
        Mutation::Remove { at } if len > 0 => {
            bytes.remove(at % len);
        }
        Mutation::FlipBit { at, bit } if len > 0 => bytes[at % len] ^= 1 << bit,
        _ => {}
    }
}

macro_rules! codec_properties {
    ($module:ident, $ty:ty, $strategy:expr) => {
        mod $module {
            use super::*;

            proptest! {
                #[test]
                fn round_trips(value in $strategy) {
                    let bytes = value.encode_to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let decoded = <$ty>::decode(&bytes);
                    prop_assert_eq!(decoded.ok(), Some(value));
                }

                #[test]
                fn random_bytes_never_panic(bytes in vec(any::<u8>(), 0..256)) {
                    check_decode::<$ty>(&bytes)?;
                }

                #[test]
                fn every_strict_prefix_is_rejected(value in $strategy) {
                    let bytes = value.encode_to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    // The encoding is self-delimiting, so no strict prefix is a whole message.
                    for cut in 0..bytes.len() {
                        prop_assert!(<$ty>::decode(&bytes[..cut]).is_err(), "prefix of {} bytes decoded", cut);
                    }
                }

                #[test]
                fn trailing_bytes_are_rejected(value in $strategy, extra in vec(any::<u8>(), 1..8)) {
                    let mut bytes = value.encode_to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    bytes.extend_from_slice(&extra);
                    prop_assert!(<$ty>::decode(&bytes).is_err());
                }

                #[test]
                fn mutations_never_panic(value in $strategy, mutations in vec(mutation(), 1..4)) {
                    let mut bytes = value.encode_to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?;
                    for m in &mutations {
                        apply(&mut bytes, m);
                    }
                    check_decode::<$ty>(&bytes)?;
                }
            }
        }
    };
}

codec_properties!(exists_v2_query, ExistsV2Query, exists_query());
codec_properties!(exists_v2_answer, ExistsV2Answer, exists_answer());
codec_properties!(key_batch_body, KeyBatch, key_batch());
codec_properties!(put_batch_header_body, PutBatchHeader, put_batch_header());
codec_properties!(batch_result_body, BatchResult, batch_result());
codec_properties!(handshake_body, Handshake, handshake());
codec_properties!(error_reply_body, ErrorReply, error_reply());

/// Cheap deterministic presence oracle: roughly `percent`% of keys exist.
fn present(key: &[u8], seed: u64, percent: u64) -> bool {
    let mut hash = seed ^ 0xcbf2_9ce4_8422_2325;
    for &byte in key {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash % 100 < percent
}

proptest! {
    /// Every answer the real fold produces passes the answer decoder's invariants and survives
    /// the wire unchanged, so the server can never be rejected for telling the truth.
    #[test]
    fn fold_answers_survive_the_wire(
        query in exists_query(),
        seed in any::<u64>(),
        percent in prop_oneof![Just(100u64), 50..100u64],
    ) {
        let answer = evaluate(&query, |key| present(key, seed, percent))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let bytes = answer.encode_to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(ExistsV2Answer::decode(&bytes).ok(), Some(answer));
    }

    /// A query evaluated after a trip over the wire answers the same as the original.
    #[test]
    fn decoded_queries_evaluate_identically(query in exists_query(), seed in any::<u64>()) {
        let bytes = query.encode_to_vec().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let decoded = ExistsV2Query::decode(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(
            evaluate(&decoded, |k| present(k, seed, 80)).ok(),
            evaluate(&query, |k| present(k, seed, 80)).ok()
        );
    }
}
