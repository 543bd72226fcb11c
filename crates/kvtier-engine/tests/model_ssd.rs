//! Model check with the SSD tier on, including warm restarts (with and without the
//! checkpoint): random operations against a `HashMap` model. Every object read back must be
//! the model's exact bytes; as long as the SSD tier has evicted no segment, every object in
//! the model must also be present (DRAM evictions only move objects to SSD).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;

use common::{read, ssd_config, BS};
use kvtier_engine::{Engine, EngineConfig, PutMeta, PutOutcome, SsdDurabilityMode};
use proptest::prelude::*;

const KEYS: u8 = 12;

#[derive(Clone, Debug)]
enum Op {
    Put { key: u8, len: usize, seed: u8 },
    Get { key: u8 },
    Remove { key: u8 },
    Clear,
    Flush,
    Reopen { drop_checkpoint: bool },
}

fn op() -> impl Strategy<Value = Op> {
    let len = prop_oneof![
        0..=2usize,
        (BS - 2)..=(BS + 2),
        0..(3 * BS),
        (16usize << 10)..(20usize << 10)
    ];
    prop_oneof![
        6 => (0..KEYS, len, any::<u8>()).prop_map(|(key, len, seed)| Op::Put { key, len, seed }),
        5 => (0..KEYS).prop_map(|key| Op::Get { key }),
        2 => (0..KEYS).prop_map(|key| Op::Remove { key }),
        1 => Just(Op::Clear),
        1 => Just(Op::Flush),
        2 => any::<bool>().prop_map(|drop_checkpoint| Op::Reopen { drop_checkpoint }),
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

fn run(ops: Vec<Op>, mode: SsdDurabilityMode) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let config: EngineConfig = ssd_config(dir.path(), 8, 32, |c| {
        c.ssd_durability_mode = mode;
        c.eviction_candidate_window = 4;
    });
    let mut e = Some(Engine::open(config.clone()).unwrap());
    let mut model: HashMap<u8, Vec<u8>> = HashMap::new();
    let mut ssd_evicted = 0;
    for op in ops {
        let eng = e.as_ref().unwrap();
        match op {
            Op::Put { key: k, len, seed } => {
                let v = bytes(len, seed);
                match eng.put(
                    &key(k),
                    &v,
                    PutMeta {
                        depth: Some(u32::from(k % 4)),
                    },
                ) {
                    Ok(PutOutcome::Stored) => {
                        prop_assert!(
                            !model.contains_key(&k) || ssd_evicted > 0,
                            "stored over a present key {}",
                            k
                        );
                        model.insert(k, v);
                    }
                    Ok(PutOutcome::AlreadyPresent) => {
                        prop_assert!(model.contains_key(&k), "dedup of a key never stored");
                    }
                    Err(other) => return Err(TestCaseError::fail(format!("put: {other}"))),
                }
            }
            Op::Get { key: k } => {
                if let Some(got) = read(eng, &key(k)) {
                    prop_assert_eq!(Some(&got), model.get(&k), "wrong bytes for {}", k);
                }
            }
            Op::Remove { key: k } => {
                let had = eng.remove(&key(k));
                if had {
                    prop_assert!(model.contains_key(&k));
                }
                model.remove(&k);
            }
            Op::Clear => {
                eng.clear();
                model.clear();
            }
            Op::Flush => eng.flush().unwrap(),
            Op::Reopen { drop_checkpoint } => {
                ssd_evicted += eng.stats().ssd_evicted_segments;
                drop(e.take());
                if drop_checkpoint {
                    let _ = std::fs::remove_file(dir.path().join("index.ckpt"));
                }
                e = Some(Engine::open(config.clone()).unwrap());
                let r = e.as_ref().unwrap().recovery_report().unwrap();
                prop_assert_eq!((r.torn, r.corrupt), (0, 0));
                prop_assert_eq!(r.used_checkpoint, !drop_checkpoint);
            }
        }
        let eng = e.as_ref().unwrap();
        let evicted_now = ssd_evicted + eng.stats().ssd_evicted_segments;
        eng.flush().unwrap();
        for k in 0..KEYS {
            let got = read(eng, &key(k));
            match (&got, model.get(&k)) {
                (Some(g), Some(m)) => prop_assert_eq!(g, m, "wrong bytes for {}", k),
                (Some(_), None) => return Err(TestCaseError::fail(format!("{k} should be gone"))),
                (None, Some(_)) if evicted_now == 0 => {
                    return Err(TestCaseError::fail(format!(
                        "{k} lost without SSD eviction"
                    )))
                }
                _ => {}
            }
            if got.is_none() {
                // Only SSD eviction may lose an object; keep the model in step.
                model.remove(&k);
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn strict_ssd_engine_matches_model_across_restarts(ops in proptest::collection::vec(op(), 1..40)) {
        run(ops, SsdDurabilityMode::Strict)?;
    }

    #[test]
    fn relaxed_ssd_engine_matches_model_across_restarts(ops in proptest::collection::vec(op(), 1..40)) {
        run(ops, SsdDurabilityMode::Relaxed)?;
    }
}
