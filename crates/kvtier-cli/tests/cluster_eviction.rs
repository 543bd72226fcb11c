//! A full cluster with real processes: one `kvtier master`, two `kvtier serve --master`
//! nodes of 64 MiB DRAM each on 127.0.0.2 / 127.0.0.3 (standing in for two hosts), cluster
//! clients in this process.
//!
//! - The eviction hint crosses the cluster: a client on neither node demotes the window-state
//!   component of pages held by both nodes; each node marks exactly its own copies, and under
//!   pressure drops exactly those first (`kvtier_evictions_total{reason="superseded"}`).
//! - A cluster whose nodes are all full keeps taking puts: the nodes evict their coldest
//!   objects (a cache, not a disk), every put is acknowledged, a read of an evicted object is
//!   a clean miss, every read that hits is byte-exact, and the directory heals to agree with
//!   the nodes.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{
    cluster_client, metric_sum, start_master, wait_alive, wait_for, Nodes, Pool, TWO_NODES,
};
use kvtier_client::{Client, PageBatch};

const OBJECT: usize = 256 << 10;
/// Each page: a full-attention component and a window-state one (grouped by the `@`).
const SUFFIXES: [&str; 2] = ["@fp.kv", "@fp.swa"];
/// Pages per chain (one chain per node): 8 MiB.
const CHAIN_PAGES: usize = 16;
/// Pages whose window state is demoted, per chain.
const DEMOTED: usize = 4;
/// Pressure: 150 MiB of new pages after the chains, more than both nodes hold (128 MiB).
const PRESSURE_PAGES: usize = 300;
const BATCH_PAGES: usize = 16;

fn pages(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}{i:05}")).collect()
}

/// The bytes of object `i` of a page: distinct per page and component.
fn fill(pool: &mut Pool, seed: u64) {
    for (n, chunk) in pool.bytes.chunks_mut(8).enumerate() {
        let v = (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ n as u64).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn superseded(metrics: &str) -> f64 {
    metric_sum(
        metrics,
        "kvtier_evictions_total",
        &[("tier", "dram"), ("reason", "superseded")],
    )
}

/// Write `pages` through `writer` in one batch of `pages x SUFFIXES` objects, seeded by `seed`.
fn put(writer: &Client, prefix: &[u8], pages: &[String], seed: u64) -> Pool {
    let mut src = Pool::new(pages.len() * SUFFIXES.len(), OBJECT);
    fill(&mut src, seed);
    let registered = src.register(writer);
    let batch = PageBatch {
        prefix,
        page_keys: pages,
        suffixes: &SUFFIXES,
    };
    let r = writer.put_pages(&batch, &src.refs(), None);
    assert!(
        r.ok.iter().all(|&b| b),
        "a put to a full cluster failed: {:?}",
        r.errors
    );
    drop(registered);
    src
}

#[test]
fn a_full_cluster_takes_puts_and_evicts_the_demoted_state_first() {
    let dir = tempfile::tempdir().unwrap();
    let (master, _master) = start_master(1000, &[]);
    let nodes = Nodes::start(dir.path(), &master, &TWO_NODES, true);
    let on_a = cluster_client(&master, Some("node-a"));
    let on_b = cluster_client(&master, Some("node-b"));
    let elsewhere = cluster_client(&master, None);
    wait_alive(&elsewhere, 2);
    let metrics = nodes.metrics();

    // One chain per node (local-first placement), 8 MiB each.
    let chain_a = pages("a", 0..CHAIN_PAGES);
    let chain_b = pages("b", 0..CHAIN_PAGES);
    put(&on_a, b"m_", &chain_a, 1);
    put(&on_b, b"m_", &chain_b, 2);
    let holder = |key: &str| {
        elsewhere
            .cluster()
            .unwrap()
            .where_is(key.as_bytes())
            .unwrap()
    };
    assert_eq!(holder("m_a00003@fp.swa"), vec!["node-a".to_string()]);
    assert_eq!(holder("m_b00003@fp.swa"), vec!["node-b".to_string()]);

    // The hint from a client on neither node: the window state of the chains' first pages
    // (plus pages stored nowhere, which count nothing). Each node marks its own copies.
    let mut hinted: Vec<String> = chain_a[..DEMOTED].to_vec();
    hinted.extend_from_slice(&chain_b[..DEMOTED]);
    hinted.extend(pages("nowhere", 0..3));
    let hint = PageBatch {
        prefix: b"m_",
        page_keys: &hinted,
        suffixes: &SUFFIXES[1..],
    };
    assert_eq!(elsewhere.demote_pages(&hint), 2 * DEMOTED);
    for m in &metrics {
        assert_eq!(superseded(m), 0.0, "nothing evicted yet");
    }

    // Pressure: more than both nodes hold, written through both nodes in turn. Every put is
    // acknowledged (the nodes evict to take them).
    let pressure = pages("p", 0..PRESSURE_PAGES);
    let mut written: Vec<(Vec<String>, Pool)> = Vec::new();
    for (n, chunk) in pressure.chunks(BATCH_PAGES).enumerate() {
        let writer = if n % 2 == 0 { &on_a } else { &on_b };
        let src = put(writer, b"m_", chunk, 100 + n as u64);
        written.push((chunk.to_vec(), src));
    }
    for (m, o) in metrics.iter().zip(&nodes.opts) {
        assert_eq!(
            superseded(m),
            DEMOTED as f64,
            "{}: exactly its demoted objects went as superseded state",
            o.id
        );
        let capacity = metric_sum(
            m,
            "kvtier_evictions_total",
            &[("tier", "dram"), ("reason", "capacity")],
        );
        assert!(capacity > 0.0, "{}: the pressure evicted whole pages", o.id);
    }

    // Reads (one result per page): a hit is byte-exact, an evicted page a clean miss; the
    // newest batch is held.
    let page_bytes = OBJECT * SUFFIXES.len();
    let mut hits = 0usize;
    let mut held_pages: Vec<bool> = Vec::new();
    for (i, (chunk, src)) in written.iter().enumerate() {
        let dst = Pool::new(chunk.len() * SUFFIXES.len(), OBJECT);
        let _dst_registered = dst.register(&elsewhere);
        let batch = PageBatch {
            prefix: b"m_",
            page_keys: chunk,
            suffixes: &SUFFIXES,
        };
        let got = elsewhere.get_pages(&batch, &dst.refs());
        assert_eq!(got.ok.len(), chunk.len());
        for (j, ok) in got.ok.iter().enumerate() {
            let range = j * page_bytes..(j + 1) * page_bytes;
            if *ok {
                hits += 1;
                assert!(
                    dst.bytes[range.clone()] == src.bytes[range],
                    "page {j} of batch {i} read back different bytes"
                );
            }
        }
        held_pages.extend(&got.ok);
        if i + 1 == written.len() {
            assert!(got.ok.iter().all(|&b| b), "the newest batch was evicted");
        }
    }
    let held = 128 << 20;
    assert!(
        hits * page_bytes <= held && hits * page_bytes >= held / 2,
        "{hits} pages of {page_bytes} B held by two 64 MiB nodes"
    );

    // The directory heals: a page exists (every component) exactly when it reads.
    let keys: Vec<Vec<u8>> = pressure
        .iter()
        .flat_map(|p| {
            SUFFIXES
                .iter()
                .map(move |s| format!("m_{p}{s}").into_bytes())
        })
        .collect();
    wait_for(
        Duration::from_secs(10),
        "the directory agrees with the nodes",
        || {
            let exists = elsewhere.exists_keys(&keys);
            let pages: Vec<bool> = exists
                .chunks(SUFFIXES.len())
                .map(|c| c.iter().all(|&e| e))
                .collect();
            pages == held_pages
        },
    );
}
