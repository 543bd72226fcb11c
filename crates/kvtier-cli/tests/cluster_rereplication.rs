//! Re-replication with real processes: one `kvtier master --replication rr=2`, three `kvtier
//! serve --master` nodes on 127.0.0.2/3/4 (standing in for three hosts), a cluster client in
//! this process. Objects are written through node A (so A holds one copy of each, B or C the
//! other). A is SIGKILLed; once its lease lapses the master hands the surviving holders copy
//! tasks, and within a bound every object has two live copies again (checked through the
//! client's lookups and `kvtier inspect --master`). Then B, a second original holder, is
//! SIGKILLed: every object still reads back byte-exact (from C), and with no third node left
//! the master plans no further copies. The counters on the master's and the nodes' `/metrics`
//! match the copies made.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{free_port, metric_sum, spawn_master, wait_alive, wait_for, Nodes};
use kvtier_client::{Client, KvtierConfig};

const OBJECTS: usize = 48;
/// Three nodes on three loopback addresses, standing in for three hosts.
const THREE: [(&str, &str); 3] = [
    ("node-a", "127.0.0.2"),
    ("node-b", "127.0.0.3"),
    ("node-c", "127.0.0.4"),
];
const NAMESPACE: &str = "rr";
/// Node lease of the test's master.
const LEASE_MS: u64 = 1000;
/// From the kill until every object has two live copies again: the lease (1 s), a planning
/// tick (lease / 4), a heartbeat (lease / 3), the copies; generous for a loaded machine.
const REPAIR_BOUND: Duration = Duration::from_secs(20);

fn client(master: &str, node_id: Option<&str>) -> Client {
    Client::open(KvtierConfig {
        extra_backend_tag: Some(NAMESPACE.into()),
        ..common::cluster_config(master, node_id)
    })
    .expect("open a cluster client")
}

fn holders(client: &Client, key: &str) -> BTreeSet<String> {
    client
        .cluster()
        .unwrap()
        .where_is(key.as_bytes())
        .unwrap()
        .into_iter()
        .collect()
}

fn stat_json(master: &str) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["stat", "--master", master, "--json"])
        .env("KVTIER_CLUSTER_TOKEN", common::TOKEN)
        .output()
        .expect("run kvtier stat");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stat json")
}

#[test]
fn objects_that_lost_a_replica_get_it_back_and_survive_a_second_failure() {
    let dir = tempfile::tempdir().unwrap();
    let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let master_metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let replication = format!("{NAMESPACE}=2");
    let _master = spawn_master(
        &master,
        LEASE_MS,
        &[
            "--replication",
            &replication,
            "--metrics-addr",
            &master_metrics,
        ],
    );
    wait_for(Duration::from_secs(10), "the master", || {
        TcpStream::connect(&master).is_ok()
    });
    let Nodes { opts, mut procs } = Nodes::start(dir.path(), &master, &THREE, true);
    let writer = client(&master, Some("node-a"));
    wait_alive(&writer, 3);

    // Objects of different sizes, written through node A: A holds one copy of each.
    let keys: Vec<String> = (0..OBJECTS).map(|i| format!("rr-obj-{i:03}")).collect();
    let values: Vec<Vec<u8>> = (0..OBJECTS)
        .map(|i| {
            (0..(48 << 10) + i * 1013)
                .map(|b| (b as u8).wrapping_mul(31) ^ (i as u8))
                .collect()
        })
        .collect();
    for (k, v) in keys.iter().zip(&values) {
        writer.put_slice(k.as_bytes(), v, None).expect("put");
    }
    let mut second_on_b = 0;
    for k in &keys {
        let h = holders(&writer, k);
        assert_eq!(h.len(), 2, "{k}: {h:?}");
        assert!(h.contains("node-a"), "{k}: {h:?}");
        second_on_b += usize::from(h.contains("node-b"));
    }
    eprintln!(
        "test: {OBJECTS} objects on node-a and node-b ({second_on_b}) or node-c ({})",
        OBJECTS - second_on_b
    );
    assert!(
        second_on_b > 0 && second_on_b < OBJECTS,
        "placement spreads the second copies over B and C"
    );

    // A dies. Within the bound every object has two live copies again: B and C.
    procs[0].kill();
    let killed = Instant::now();
    let reader = client(&master, None);
    let both: BTreeSet<String> = ["node-b".to_string(), "node-c".to_string()].into();
    wait_for(REPAIR_BOUND, "every object on two live nodes again", || {
        keys.iter().all(|k| holders(&reader, k) == both)
    });
    let took = killed.elapsed();
    eprintln!(
        "test: node-a SIGKILLed; every object had 2 live copies again after {:.2} s (lease {} ms)",
        took.as_secs_f64(),
        LEASE_MS
    );
    // The operator's view agrees: `kvtier inspect --master` names B and C for each key.
    let mut args = vec![
        "inspect".to_string(),
        "--master".into(),
        master.clone(),
        "--tenant".into(),
        NAMESPACE.into(),
        "--json".into(),
    ];
    args.extend(keys.iter().cloned());
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(&args)
        .env("KVTIER_CLUSTER_TOKEN", common::TOKEN)
        .output()
        .expect("run kvtier inspect");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for entry in doc["keys"].as_array().unwrap() {
        let ids: BTreeSet<String> = entry["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["alive"] == true)
            .map(|n| n["node_id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(ids, both, "{entry}");
    }
    // One copy task per object, each done once; nothing left in flight.
    wait_for(
        Duration::from_secs(5),
        "the master's tasks all done",
        || {
            metric_sum(
                &master_metrics,
                "kvtier_master_rereplication_in_flight",
                &[],
            ) == 0.0
        },
    );
    let issued = metric_sum(
        &master_metrics,
        "kvtier_master_rereplication_tasks_total",
        &[("outcome", "issued")],
    );
    let done = metric_sum(
        &master_metrics,
        "kvtier_master_rereplication_tasks_total",
        &[("outcome", "done")],
    );
    assert_eq!(done, OBJECTS as f64, "master done");
    assert!(issued >= done, "issued {issued} < done {done}");
    let node_done: f64 = opts[1..]
        .iter()
        .map(|o| {
            metric_sum(
                o.metrics_addr.as_ref().unwrap(),
                "kvtier_node_rereplication_tasks_total",
                &[("outcome", "done")],
            )
        })
        .sum();
    assert_eq!(node_done, OBJECTS as f64, "copies committed by B and C");
    let stat = stat_json(&master);
    assert_eq!(stat["rereplication"]["done"], OBJECTS as u64, "{stat}");

    // B, a second original holder, dies: every object still reads byte-exact, from C.
    procs[1].kill();
    let after = client(&master, None);
    for (k, v) in keys.iter().zip(&values) {
        let mut dst = vec![0u8; v.len()];
        after
            .get_into_slice(k.as_bytes(), &mut dst)
            .unwrap_or_else(|e| panic!("{k} after the second kill: {e}"));
        assert!(dst == *v, "{k}: different bytes");
    }
    // Once B's lease lapses C is the only holder and the only live node: there is nowhere to
    // copy to, and no task is planned.
    wait_for(Duration::from_secs(10), "node-b dropped", || {
        keys.iter()
            .all(|k| holders(&after, k) == BTreeSet::from(["node-c".to_string()]))
    });
    std::thread::sleep(Duration::from_millis(3 * LEASE_MS));
    let stat = stat_json(&master);
    assert_eq!(stat["rereplication"]["in_flight"], 0, "{stat}");
    assert_eq!(stat["rereplication"]["done"], OBJECTS as u64, "{stat}");
    for (k, v) in keys.iter().zip(&values) {
        let mut dst = vec![0u8; v.len()];
        after
            .get_into_slice(k.as_bytes(), &mut dst)
            .expect("read from C");
        assert!(dst == *v, "{k}: different bytes");
    }
}

/// Issue 29 (found by the chaos soak): nodes with a write-through SSD tier whose DRAM is full.
/// A node used to report DRAM's free space alone, so once DRAM filled (its steady state: DRAM
/// caches the SSD) every node looked full and re-replication found no target for any object.
/// The nodes now report what they can hold without evicting (their SSD's room): after node
/// A's death every object has two live copies again, though each node's DRAM is full.
#[test]
fn nodes_with_full_dram_and_ssd_room_take_repairs() {
    let dir = tempfile::tempdir().unwrap();
    let (master, _master) = common::start_master(LEASE_MS, &["--replication", "rr=2"]);
    wait_for(Duration::from_secs(10), "the master", || {
        TcpStream::connect(&master).is_ok()
    });
    let mut procs: Vec<common::Proc> = THREE
        .iter()
        .map(|(id, ip)| {
            let mut o = common::NodeOpts::new(dir.path(), &master, id, ip);
            o.ssd = true;
            o.dram = "8MiB";
            o.spawn()
        })
        .collect();
    let writer = client(&master, Some("node-a"));
    wait_alive(&writer, 3);
    // 40 objects of 512 KiB through node A: 20 MiB on A, more than its DRAM (8 MiB), and
    // beyond B's or C's DRAM too; every object is on two SSD tiers (64 MiB each).
    let keys: Vec<String> = (0..40).map(|i| format!("full-dram-{i:03}")).collect();
    let values: Vec<Vec<u8>> = (0..40u8)
        .map(|i| (0..512 << 10).map(|b: u32| (b as u8) ^ i).collect())
        .collect();
    for (k, v) in keys.iter().zip(&values) {
        writer.put_slice(k.as_bytes(), v, None).expect("put");
    }
    for k in &keys {
        assert_eq!(holders(&writer, k).len(), 2, "{k}");
    }
    let stat = stat_json(&master);
    eprintln!("test: nodes before the kill: {}", stat["nodes"]);
    procs[0].kill();
    let reader = client(&master, None);
    let both: BTreeSet<String> = ["node-b".to_string(), "node-c".to_string()].into();
    wait_for(REPAIR_BOUND, "every object on two live nodes again", || {
        keys.iter().all(|k| holders(&reader, k) == both)
    });
    for (k, v) in keys.iter().zip(&values) {
        let mut dst = vec![0u8; v.len()];
        reader
            .get_into_slice(k.as_bytes(), &mut dst)
            .unwrap_or_else(|e| panic!("{k}: {e}"));
        assert!(dst == *v, "{k}: different bytes");
    }
}
