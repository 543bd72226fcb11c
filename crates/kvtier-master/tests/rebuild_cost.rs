//! What a new leader pays to rebuild the directory from the nodes' registrations: two nodes
//! each report the same 1 M keys (replication 2, 2 M replica entries over 1 M objects). The
//! figure backs the choice (crate docs) of rebuilding from node reports over keeping the
//! directory in etcd. The bound is loose (a shared 2-core machine); the time is printed.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use kvtier_master::directory::{Directory, NodeSpec};

#[test]
fn rebuilding_one_million_objects_from_two_nodes() {
    const OBJECTS: usize = 1_000_000;
    let keys: Vec<Vec<u8>> = (0..OBJECTS)
        .map(|i| {
            // A realistic SGLang key: a 64-hex-digit page hash plus a pool suffix.
            let mut key = format!("{i:064x}").into_bytes();
            key.extend_from_slice(b"_k_dp0_tp0");
            key
        })
        .collect();
    let directory = Directory::new(Duration::from_secs(60), Duration::from_secs(30));
    let started = Instant::now();
    for n in 0..2 {
        let spec = NodeSpec {
            node_id: format!("n{n}"),
            data_address: format!("127.0.0.1:{}", 9000 + n),
            capacity_bytes: 1 << 40,
            free_bytes: 1 << 40,
            tags: vec![],
        };
        directory.register(spec, &keys).expect("register");
    }
    let took = started.elapsed();
    assert_eq!(directory.len(), OBJECTS);
    assert_eq!(directory.locate(&keys[OBJECTS / 2]), vec![0, 1]);
    eprintln!(
        "rebuild: {OBJECTS} objects x 2 replicas registered in {:.0} ms ({:.0} ns per replica)",
        took.as_secs_f64() * 1e3,
        took.as_secs_f64() * 1e9 / (2 * OBJECTS) as f64
    );
    assert!(took < Duration::from_secs(20), "rebuild took {took:?}");
}
