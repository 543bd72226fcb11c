//! The cluster store's per-page promise (issue 16, `kvtier_client::store::cluster::
//! PAGE_ROLLBACK`), with real processes: one `kvtier master`, two `kvtier serve --master`
//! nodes of 64 MiB DRAM each on 127.0.0.2 / 127.0.0.3, a cluster client in this process.
//!
//! One page of a batch has a component larger than any node can hold (the master places it
//! nowhere) while its other component is placed, written and committed in the same batch.
//! After the put returns, no component of that page is left: not in the directory, not on
//! any node (the nodes' own object counts), not readable; a component that an earlier put
//! had already stored stays (it is not this call's to remove); every other page of the batch
//! is stored and reads back byte-exact.
#![allow(clippy::unwrap_used)]
#![allow(unsafe_code)] // registers raw test memory with the client

mod common;

use std::time::Duration;

use common::{cluster_client, metric_sum, start_master, wait_alive, wait_for, Nodes, TWO_NODES};
use kvtier_client::{MemRef, PageBatch};

const SMALL: usize = 64 << 10;
/// Larger than a node's whole DRAM tier (64 MiB): no node can take it.
const TOO_BIG: usize = 80 << 20;
const SUFFIXES: [&str; 2] = ["@fp.kv", "@fp.swa"];

fn objects_on(metrics: &[String]) -> f64 {
    metrics
        .iter()
        .map(|m| metric_sum(m, "kvtier_objects", &[("store", "main"), ("tier", "dram")]))
        .sum()
}

#[test]
fn a_page_with_a_component_no_node_takes_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (master, _master) = start_master(1000, &[]);
    let nodes = Nodes::start(dir.path(), &master, &TWO_NODES, true);
    let client = cluster_client(&master, None);
    wait_alive(&client, 2);
    let metrics = nodes.metrics();
    wait_for(Duration::from_secs(10), "node metrics", || {
        metrics.iter().all(|m| common::metrics_text(m).is_some())
    });

    // One memory block: pages p0..p3, two components each; p1's and p3's window state is
    // too big for any node.
    let sizes = [
        SMALL, SMALL, // p0
        SMALL, TOO_BIG, // p1
        SMALL, SMALL, // p2
        SMALL, TOO_BIG, // p3 (its kv component is stored beforehand)
    ];
    let total: usize = sizes.iter().sum();
    let mut memory = vec![0u8; total];
    for (i, b) in memory.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31) ^ (i >> 12) as u8;
    }
    // SAFETY: `memory` outlives every batch of this test and is not otherwise borrowed
    // while the client reads it.
    unsafe {
        client
            .register_region(memory.as_ptr() as usize, memory.len(), "pages")
            .unwrap();
    }
    let mut refs = Vec::new();
    let mut at = memory.as_ptr() as usize;
    for &len in &sizes {
        refs.push(MemRef { ptr: at, len });
        at += len;
    }

    // An earlier writer stored p3's kv component alone.
    let p3 = vec!["p3".to_string()];
    let kv_only = PageBatch {
        prefix: b"rb_",
        page_keys: &p3,
        suffixes: &SUFFIXES[..1],
    };
    let r = client.put_pages(&kv_only, &refs[6..7], None);
    assert_eq!(r.ok, vec![true], "{:?}", r.errors);
    assert_eq!(objects_on(&metrics), 1.0);

    let pages: Vec<String> = (0..4).map(|i| format!("p{i}")).collect();
    let batch = PageBatch {
        prefix: b"rb_",
        page_keys: &pages,
        suffixes: &SUFFIXES,
    };
    let r = client.put_pages(&batch, &refs, None);
    assert_eq!(r.ok, vec![true, false, true, false], "{:?}", r.errors);
    assert!(
        r.errors
            .iter()
            .any(|e| e.contains("p1") && e.contains("room")),
        "the failure names the page and the reason: {:?}",
        r.errors
    );

    // p1: nothing left anywhere. Its kv component was committed by this call, then rolled
    // back: the directory does not know it and no node holds it.
    let cluster = client.cluster().unwrap();
    for key in ["rb_p1@fp.kv", "rb_p1@fp.swa", "rb_p3@fp.swa"] {
        assert!(
            cluster.where_is(key.as_bytes()).unwrap().is_empty(),
            "{key}"
        );
    }
    assert_eq!(
        client.exists_keys(&["rb_p1@fp.kv", "rb_p1@fp.swa"]),
        vec![false, false]
    );
    // p0 and p2 (2 objects each) plus p3's earlier kv component: 5 objects on the nodes.
    assert_eq!(objects_on(&metrics), 5.0);
    // p3's kv component was not this call's: it stays.
    assert_eq!(client.exists_keys(&["rb_p3@fp.kv"]), vec![true]);
    let mut back = vec![0u8; SMALL];
    assert!(client.get_into_slice(b"rb_p1@fp.kv", &mut back).is_err());

    // The other pages are whole and byte-exact.
    let out = vec![0u8; 4 * SMALL];
    // SAFETY: as above, for `out`.
    unsafe {
        client
            .register_region(out.as_ptr() as usize, out.len(), "out")
            .unwrap();
    }
    let out_refs: Vec<MemRef> = (0..4)
        .map(|i| MemRef {
            ptr: out.as_ptr() as usize + i * SMALL,
            len: SMALL,
        })
        .collect();
    let good = vec!["p0".to_string(), "p2".to_string()];
    let read = PageBatch {
        prefix: b"rb_",
        page_keys: &good,
        suffixes: &SUFFIXES,
    };
    let r = client.get_pages(&read, &out_refs);
    assert_eq!(r.ok, vec![true, true], "{:?}", r.errors);
    let offset = |i: usize| sizes[..i].iter().sum::<usize>();
    for (slot, object) in [(0, 0), (1, 1), (2, 4), (3, 5)] {
        assert!(
            out[slot * SMALL..(slot + 1) * SMALL] == memory[offset(object)..offset(object) + SMALL],
            "object {object} differs"
        );
    }
    assert_eq!(client.exists_pages_prefix(&batch), 1);
}
