//! Model check: random operation sequences against a `HashMap` model.
//!
//! Eviction may drop any object, so the model is "what the engine may hold": a get must return
//! the model's exact bytes or a miss, never other bytes, and the engine never holds a key the
//! model does not. After every step the accounting must balance.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::{engine, BS};
use kvtier_engine::{EngineError, EvictionPolicyKind, PutMeta, PutOutcome};
use proptest::prelude::*;

const KEYS: u8 = 12;
const BLOCKS: usize = 8;

#[derive(Clone, Debug)]
enum Op {
    Put {
        key: u8,
        len: usize,
        seed: u8,
        depth: Option<u32>,
    },
    Get {
        key: u8,
    },
    GetWrongLen {
        key: u8,
    },
    Remove {
        key: u8,
    },
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![
        0..=2usize,
        (BS - 2)..=(BS + 2),
        0..(3 * BS),
        // Occasionally larger than the whole arena.
        (BLOCKS * BS - 1)..=(BLOCKS * BS + 1),
    ];
    prop_oneof![
        6 => (0..KEYS, len, any::<u8>(), proptest::option::of(0..6u32))
            .prop_map(|(key, len, seed, depth)| Op::Put { key, len, seed, depth }),
        5 => (0..KEYS).prop_map(|key| Op::Get { key }),
        1 => (0..KEYS).prop_map(|key| Op::GetWrongLen { key }),
        2 => (0..KEYS).prop_map(|key| Op::Remove { key }),
        1 => Just(Op::Clear),
    ]
}

fn bytes(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn key(k: u8) -> Vec<u8> {
    format!("key-{k}").into_bytes()
}

fn run(ops: Vec<Op>, policy: EvictionPolicyKind) -> Result<(), TestCaseError> {
    let e = engine(BLOCKS, policy, 4);
    let mut model: HashMap<u8, Vec<u8>> = HashMap::new();
    for op in ops {
        match op {
            Op::Put {
                key: k,
                len,
                seed,
                depth,
            } => {
                let v = bytes(len, seed);
                match e.put(&key(k), &v, PutMeta { depth }) {
                    Ok(PutOutcome::Stored) => {
                        model.insert(k, v);
                    }
                    Ok(PutOutcome::AlreadyPresent) => {
                        prop_assert!(model.contains_key(&k), "dedup of a key never stored");
                    }
                    Err(EngineError::ObjectTooLarge { len: l, .. }) => {
                        prop_assert!(len > BLOCKS * BS);
                        prop_assert_eq!(l, len as u64);
                    }
                    Err(other) => return Err(TestCaseError::fail(format!("put: {other}"))),
                }
            }
            Op::Get { key: k } => {
                let want = model.get(&k);
                let len = want.map_or(0, Vec::len);
                let mut dst = vec![0u8; len];
                match e.get_into(&key(k), &mut dst) {
                    Ok(()) => prop_assert_eq!(Some(&dst), want, "wrong bytes for {}", k),
                    Err(EngineError::NotFound) => {}
                    Err(other) => return Err(TestCaseError::fail(format!("get: {other}"))),
                }
            }
            Op::GetWrongLen { key: k } => {
                let len = model.get(&k).map_or(1, |v| v.len() + 1);
                let mut dst = vec![0x5A; len];
                match e.get_into(&key(k), &mut dst) {
                    Err(EngineError::SizeMismatch { .. }) | Err(EngineError::NotFound) => {}
                    other => return Err(TestCaseError::fail(format!("wrong-len get: {other:?}"))),
                }
                prop_assert!(dst.iter().all(|&b| b == 0x5A));
            }
            Op::Remove { key: k } => {
                let had = e.remove(&key(k));
                if had {
                    prop_assert!(model.contains_key(&k));
                }
                model.remove(&k);
            }
            Op::Clear => {
                e.clear();
                model.clear();
            }
        }
        // The engine holds a subset of the model, with the model's lengths.
        let mut objects = 0;
        let mut bytes_used = 0;
        for k in 0..KEYS {
            if e.contains(&key(k)) {
                let v = model.get(&k);
                prop_assert!(v.is_some(), "engine holds {} the model dropped", k);
                let len = v.map_or(0, Vec::len) as u64;
                prop_assert_eq!(e.object_len(&key(k)), Some(len));
                objects += 1;
                bytes_used += len;
            }
        }
        let s = e.stats();
        prop_assert_eq!(s.objects, objects);
        prop_assert_eq!(s.bytes_used, bytes_used);
        prop_assert!(s.bytes_allocated <= s.capacity_bytes);
        if let Err(msg) = e.verify_accounting() {
            return Err(TestCaseError::fail(msg));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn prefix_depth_engine_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops, EvictionPolicyKind::PrefixDepth)?;
    }

    #[test]
    fn lru_engine_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(ops, EvictionPolicyKind::Lru)?;
    }
}
