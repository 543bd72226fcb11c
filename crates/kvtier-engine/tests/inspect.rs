//! `Engine::placement` and `Engine::inspect_prefix` (what `kvtier inspect` shows): which tier
//! holds each object, with an SSD tier under a DRAM tier smaller than the data.
#![allow(clippy::unwrap_used)]

mod common;

use common::{value_for, BS};
use kvtier_engine::{Engine, EngineConfig, PutMeta};

fn engine(dir: &std::path::Path) -> Engine {
    Engine::open(EngineConfig {
        dram_capacity_bytes: (4 * BS) as u64,
        dram_block_size: BS as u32,
        ssd_enabled: true,
        ssd_storage_dir: dir.to_path_buf(),
        ssd_segment_size_bytes: 1 << 20,
        ssd_capacity_bytes: 8 << 20,
        ..EngineConfig::default()
    })
    .expect("open engine")
}

#[test]
fn placement_names_the_tiers_holding_each_key() {
    let dir = tempfile::tempdir().unwrap();
    let e = engine(dir.path());
    for i in 0..8 {
        let key = format!("p{i}@fp.c4");
        e.put(
            key.as_bytes(),
            &value_for(key.as_bytes(), BS),
            PutMeta::default(),
        )
        .unwrap();
        e.flush().unwrap(); // the SSD copy is written before the next put can evict it
    }
    e.put(b"other", &[1u8; 100], PutMeta::default()).unwrap();
    e.flush().unwrap();
    let p = e.placement(b"p7@fp.c4");
    assert_eq!((p.dram_len, p.ssd_len), (Some(BS as u64), Some(BS as u64)));
    let p = e.placement(b"p0@fp.c4");
    assert_eq!(
        (p.dram_len, p.ssd_len),
        (None, Some(BS as u64)),
        "evicted from DRAM"
    );
    let p = e.placement(b"nope");
    assert_eq!((p.dram_len, p.ssd_len), (None, None));

    let (all, truncated) = e.inspect_prefix(b"p", 100);
    assert!(!truncated);
    let keys: Vec<_> = all
        .iter()
        .map(|p| String::from_utf8_lossy(&p.key))
        .collect();
    assert_eq!(
        keys,
        (0..8).map(|i| format!("p{i}@fp.c4")).collect::<Vec<_>>()
    );
    assert!(all.iter().all(|p| p.ssd_len == Some(BS as u64)));
    let in_dram = all.iter().filter(|p| p.dram_len.is_some()).count();
    assert!(
        (1..4).contains(&in_dram),
        "{in_dram} of 8 in a 4-block DRAM tier"
    );
    for p in &all {
        assert_eq!(
            p,
            &e.placement(&p.key),
            "inspect_prefix agrees with placement"
        );
    }
    let (some, truncated) = e.inspect_prefix(b"p", 3);
    assert!(truncated && some.len() == 3);
    let (none, truncated) = e.inspect_prefix(b"zz", 10);
    assert!(none.is_empty() && !truncated);
    // No side effects: inspecting counted no hit or miss.
    let s = e.stats();
    assert_eq!((s.hits, s.misses), (0, 0));
}
