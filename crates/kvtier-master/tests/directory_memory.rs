//! The master's metadata budget: at most 64 bytes of memory per object with 1 M objects,
//! measured as the growth of this process's resident set while the directory fills.
//! (Its own test binary, so no other test allocates meanwhile.)
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvtier_master::directory::{key_hash, Directory, NodeSpec};

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .expect("rss field")
        .parse()
        .expect("number");
    pages * 4096
}

#[test]
fn one_million_objects_cost_at_most_64_bytes_each() {
    const OBJECTS: u64 = 1_000_000;
    let directory = Directory::new(Duration::from_secs(60), Duration::from_secs(30));
    for n in 0..2 {
        let spec = NodeSpec {
            node_id: format!("n{n}"),
            data_address: format!("127.0.0.1:{}", 9000 + n),
            capacity_bytes: 1 << 40,
            free_bytes: 1 << 40,
            tags: vec![],
        };
        directory.register(spec, &[]).expect("register");
    }
    let before = resident_bytes();
    let mut key = Vec::with_capacity(96);
    for i in 0..OBJECTS {
        key.clear();
        // A realistic SGLang key: a 64-hex-digit page hash plus a pool suffix.
        key.extend_from_slice(format!("{i:064x}").as_bytes());
        key.extend_from_slice(b"_k_dp0_tp0");
        directory.insert_hash(key_hash(&key), &[(i % 2) as u16]);
    }
    let after = resident_bytes();
    assert_eq!(directory.len() as u64, OBJECTS);
    let per_object = (after.saturating_sub(before)) as f64 / OBJECTS as f64;
    println!("directory: {OBJECTS} objects, {per_object:.1} bytes of resident memory per object");
    assert!(
        per_object <= 64.0,
        "{per_object:.1} bytes per object is over the budget of 64"
    );
    // The directory answers for what it holds.
    assert_eq!(
        directory.locate(format!("{:064x}_k_dp0_tp0", 7).as_bytes()),
        vec![1]
    );
}
