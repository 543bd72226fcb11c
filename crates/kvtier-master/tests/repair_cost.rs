//! What re-replication planning costs the master: 1 M objects with replication 2 on two
//! nodes, a third node joins, one holder's lease lapses, so every object is short of a copy.
//! The first 40 planning ticks (the lease sweeper's) are timed while the surviving holder
//! "copies" (commits to the new node) each heartbeat's tasks as it gets them, the steady state
//! of a long repair. The figures are printed; the bounds are loose (a shared 2-core machine).
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvtier_master::directory::{
    key_hash, Directory, KeyHash, NodeSpec, ReplicationPolicy, MAX_REPAIR_SCAN_PER_TICK,
    MAX_REPAIR_TASKS_PER_HEARTBEAT, MAX_REPAIR_TASKS_PER_SOURCE,
};

fn spec(n: usize) -> NodeSpec {
    NodeSpec {
        node_id: format!("n{n}"),
        data_address: format!("127.0.0.1:{}", 9000 + n),
        capacity_bytes: 1 << 50,
        free_bytes: 1 << 50,
        tags: vec![],
    }
}

#[test]
fn planning_ticks_over_one_million_short_objects_stay_cheap() {
    const OBJECTS: usize = 1_000_000;
    let keys: Vec<Vec<u8>> = (0..OBJECTS)
        .map(|i| {
            let mut k = kvtier_proto::namespace::cluster_prefix("prod");
            k.extend_from_slice(format!("{i:064x}_k_dp0_tp0").as_bytes());
            k
        })
        .collect();
    let lease = Duration::from_millis(300);
    let d = Directory::with_replication(
        lease,
        Duration::from_secs(30),
        ReplicationPolicy {
            default: 1,
            namespaces: BTreeMap::from([("prod".to_string(), 2)]),
        },
    );
    let by_hash: std::collections::HashMap<KeyHash, usize> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (key_hash(k), i))
        .collect();
    d.register(spec(0), &keys).unwrap();
    d.register(spec(1), &keys).unwrap();
    d.register(spec(2), &[]).unwrap();
    std::thread::sleep(lease + Duration::from_millis(50));
    assert!(d.heartbeat("n0", 1 << 50));
    assert!(d.heartbeat("n2", 1 << 50));
    let started = Instant::now();
    assert_eq!(d.expire_nodes(Instant::now()), vec!["n1".to_string()]);
    let expire = started.elapsed();
    let mut now = Instant::now() + lease * 3; // past the grace
    let mut worst = Duration::ZERO;
    let mut total = Duration::ZERO;
    let mut ticks = 0usize;
    let mut copied = 0;
    // A bounded number of ticks is enough to see the steady cost; not the whole repair.
    while ticks < 40 {
        let t = Instant::now();
        let planned = d.plan_repairs(now);
        let took = t.elapsed();
        assert!(
            planned <= MAX_REPAIR_TASKS_PER_SOURCE,
            "one source: {planned}"
        );
        worst = worst.max(took);
        total += took;
        ticks += 1;
        for batch in d.take_repair_tasks("n0", MAX_REPAIR_TASKS_PER_HEARTBEAT, now) {
            assert_eq!(batch.target_node_id, "n2");
            for hash in &batch.hashes {
                assert!(d.commit(0, &keys[by_hash[hash]], &[batch.target]).unwrap());
                copied += 1;
            }
        }
        now += Duration::from_millis(75);
    }
    let stats = d.repair_stats();
    eprintln!(
        "repair: {OBJECTS} short objects; expire (drop one holder) {:.0} ms; {ticks} planning \
         ticks: mean {:.2} ms, worst {:.2} ms (scan bound {MAX_REPAIR_SCAN_PER_TICK} entries); \
         {copied} copies committed, {} in flight",
        expire.as_secs_f64() * 1e3,
        total.as_secs_f64() * 1e3 / ticks as f64,
        worst.as_secs_f64() * 1e3,
        stats.in_flight
    );
    assert_eq!(stats.done as usize, copied);
    assert_eq!(
        copied,
        ticks * MAX_REPAIR_TASKS_PER_HEARTBEAT,
        "one full reply per tick"
    );
    assert!(worst < Duration::from_secs(2), "a tick took {worst:?}");
    // Issue 16: the directory invariants hold at the end (after the timing).
    d.check_invariants().unwrap();
}
