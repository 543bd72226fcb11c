//! A node stopped with SIGTERM leaves the cluster at once. Real processes: one `kvtier
//! master` with a 60 s node lease (so nothing but the node's leaving can explain a prompt
//! change), node A on 127.0.0.2 and node B on 127.0.0.3 with a strict write-through SSD tier,
//! a cluster client in this process.
//!
//! B gets SIGTERM: it exits with status 0 well inside its shutdown bound; straight after, the
//! master lists B as down and B's objects are misses (not errors, not waits for the lease),
//! while A keeps taking puts and serving gets. B restarted with the same SSD directory, id and
//! data address registers again and serves its objects byte-exact.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{cluster_client, start_master, wait_for, NodeOpts};
use kvtier_client::Client;

const LEN: usize = 64 << 10;
const OBJECTS: u64 = 24;

fn value(i: u64) -> Vec<u8> {
    common::object_bytes(i, LEN)
}

fn key(i: u64) -> Vec<u8> {
    format!("stop{i:04}").into_bytes()
}

fn alive(client: &Client) -> Vec<String> {
    let info = client.cluster().unwrap().cluster_info().unwrap();
    let mut ids: Vec<String> = info
        .nodes
        .iter()
        .filter(|n| n.alive)
        .map(|n| n.node_id.clone())
        .collect();
    ids.sort();
    ids
}

#[test]
fn a_node_stopped_with_sigterm_leaves_at_once_and_comes_back_with_its_ssd() {
    let dir = tempfile::tempdir().unwrap();
    let (master, _master) = start_master(60_000, &[]);
    let node_a = NodeOpts::new(dir.path(), &master, "node-a", "127.0.0.2");
    let mut node_b = NodeOpts::new(dir.path(), &master, "node-b", "127.0.0.3");
    node_b.ssd = true;
    let _a = node_a.spawn();
    let mut b = node_b.spawn();
    let on_b = cluster_client(&master, Some("node-b"));
    let on_a = cluster_client(&master, Some("node-a"));
    wait_for(Duration::from_secs(10), "both nodes registered", || {
        alive(&on_a) == ["node-a", "node-b"]
    });
    for i in 0..OBJECTS {
        on_b.put_slice(&key(i), &value(i), None)
            .unwrap_or_else(|e| panic!("put {i}: {e}"));
    }
    let keys: Vec<Vec<u8>> = (0..OBJECTS).map(key).collect();
    assert!(on_a.exists_keys(&keys).iter().all(|&e| e));

    // SIGTERM: a clean exit, and the master drops B at once (its lease has 60 s to run).
    let sent = Instant::now();
    b.terminate(Duration::from_secs(20));
    let exited = sent.elapsed();
    let status = b.child.wait().expect("reap node B");
    assert!(status.success(), "node B exited with {status}");
    assert!(
        exited < Duration::from_secs(10),
        "node B took {exited:?} to stop"
    );
    assert_eq!(alive(&on_a), ["node-a"], "B still listed after leaving");
    assert!(
        on_a.exists_keys(&keys).iter().all(|&e| !e),
        "B's objects still visible after it left"
    );
    let mut buf = vec![0u8; LEN];
    let started = Instant::now();
    assert!(
        on_a.get_into_slice(&key(0), &mut buf).is_err(),
        "a get of B's object hit"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "a miss on a departed node took {:?}",
        started.elapsed()
    );
    eprintln!("test: node B stopped in {exited:?} and left the directory");

    // A keeps working; new puts go to A (B is gone).
    let late = OBJECTS + 100;
    on_b.put_slice(&key(late), &value(late), None)
        .expect("a put while B is down");
    on_a.get_into_slice(&key(late), &mut buf)
        .expect("a get from A while B is down");
    assert!(buf == value(late));
    let holders = on_a.cluster().unwrap().where_is(&key(late)).unwrap();
    assert_eq!(holders, ["node-a"]);

    // B restarted with its SSD: registered again, its objects served byte-exact.
    let _b = node_b.spawn();
    wait_for(
        Duration::from_secs(10),
        "node B back with its objects",
        || on_a.exists_keys(&keys).iter().all(|&e| e),
    );
    for i in 0..OBJECTS {
        buf.fill(0);
        on_a.get_into_slice(&key(i), &mut buf)
            .unwrap_or_else(|e| panic!("get {i} after B's restart: {e}"));
        assert!(buf == value(i), "object {i} read back different bytes");
    }
}
