//! Cluster faults with real processes: master failover through a real etcd under load, a
//! single master's restart, and a node's restart with its SSD tier.
//!
//! - `leader_failover_under_load`: etcd, three `kvtier master --etcd`, three nodes
//!   (127.0.0.2-4), replication 2 for the client's namespace. A thread puts and reads back
//!   while the leader is SIGKILLed; a follower takes over, puts and gets resume, every
//!   acknowledged object (before and after the kill) reads back byte-exact, and every node is
//!   registered with the new leader with its data address.
//! - `single_master_restart`: no etcd; the master is SIGKILLed and started again on the same
//!   address; the nodes re-register with their data addresses and their objects are visible
//!   and readable again.
//! - `node_restart_with_ssd`: a node with a strict write-through SSD tier is SIGKILLed and
//!   restarted with the same directory, data address and id; its objects are served again,
//!   also to the writer's client at once (its pooled connection to the dead process is
//!   retried on a fresh one).
//! - `node_restart_same_address_pooled_connection`: a DRAM node is SIGKILLed and restarted on
//!   the same data address; a client whose pooled connections point at the dead process gets
//!   and puts on its first try after the re-registration (no failed request, no peer-down
//!   gap).
//!
//! etcd is /usr/bin/etcd (Debian etcd-server, installed by scripts/setup.sh); without it the
//! failover test fails and says so.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{
    all_registered, cluster_of, leaders, spawn_master, start_master, wait_for, Etcd, NodeOpts,
    Nodes, Proc,
};
use kvtier_client::{Client, KvtierConfig};

/// The namespace the clients write in (`--replication ha=2`).
const NAMESPACE: &str = "ha";

fn client(masters: &str, node_id: Option<&str>) -> Client {
    Client::open(KvtierConfig {
        extra_backend_tag: Some(NAMESPACE.into()),
        cluster_master_retry_ms: 2000,
        ..common::cluster_config(masters, node_id)
    })
    .expect("open a cluster client")
}

fn value(i: u64, len: usize) -> Vec<u8> {
    common::object_bytes(i, len)
}

fn key(i: u64) -> Vec<u8> {
    format!("obj{i:06}").into_bytes()
}

/// Every object of `ids` reads back byte-exact; returns the ones that do not, with why.
fn unreadable(client: &Client, ids: &[u64], len: usize) -> Vec<(u64, String)> {
    let mut bad = Vec::new();
    let mut buf = vec![0u8; len];
    for &i in ids {
        buf.fill(0);
        match client.get_into_slice(&key(i), &mut buf) {
            Ok(()) if buf == value(i, len) => {}
            Ok(()) => bad.push((i, "other bytes".to_string())),
            Err(e) => bad.push((i, e.to_string())),
        }
    }
    bad
}

const NONE: Vec<(u64, String)> = Vec::new();

#[test]
fn leader_failover_under_load() {
    const LEN: usize = 16 << 10;
    let etcd = Etcd::start();
    let dir = tempfile::tempdir().unwrap();
    let masters: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", common::free_port("127.0.0.1")))
        .collect();
    let mut master_procs: Vec<Proc> = masters
        .iter()
        .map(|addr| {
            spawn_master(
                addr,
                1000,
                &[
                    "--etcd",
                    &etcd.endpoint,
                    "--election-ttl-s",
                    "2",
                    "--replication",
                    "ha=2",
                ],
            )
        })
        .collect();
    let mut leader = Vec::new();
    wait_for(Duration::from_secs(15), "one master elected", || {
        leader = leaders(&masters);
        leader.len() == 1
    });
    let old_leader = leader[0];
    let master_list = masters.join(",");
    let three = [
        ("node-0", "127.0.0.2"),
        ("node-1", "127.0.0.3"),
        ("node-2", "127.0.0.4"),
    ];
    let nodes = Nodes::start(dir.path(), &master_list, &three, false);
    let expected = nodes.expected();
    wait_for(Duration::from_secs(10), "three nodes registered", || {
        all_registered(&masters[old_leader], &expected)
    });

    let client = client(&master_list, None);
    assert_eq!(client.mode(), "cluster");
    // (object id, put acknowledged at) and (read back byte-exact at).
    let acked: Mutex<Vec<(u64, Instant)>> = Mutex::new(Vec::new());
    let read_back: Mutex<Vec<Instant>> = Mutex::new(Vec::new());
    let failed_puts = Mutex::new(Vec::<String>::new());
    let wrong_bytes = Mutex::new(Vec::<u64>::new());
    let stop = AtomicBool::new(false);
    let (killed_at, takeover, resumed) = std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut buf = vec![0u8; LEN];
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                let v = value(i, LEN);
                match client.put_slice(&key(i), &v, None) {
                    Ok(_) => acked.lock().unwrap().push((i, Instant::now())),
                    Err(e) => {
                        failed_puts.lock().unwrap().push(e.to_string());
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                }
                buf.fill(0);
                match client.get_into_slice(&key(i), &mut buf) {
                    Ok(()) if buf == v => read_back.lock().unwrap().push(Instant::now()),
                    Ok(()) => wrong_bytes.lock().unwrap().push(i),
                    Err(_) => {}
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        std::thread::sleep(Duration::from_millis(1500));
        let before = acked.lock().unwrap().len();
        assert!(before > 20, "only {before} puts before the kill");

        master_procs[old_leader].kill();
        let killed_at = Instant::now();
        let others: Vec<String> = (0..masters.len())
            .filter(|&i| i != old_leader)
            .map(|i| masters[i].clone())
            .collect();
        let mut new_leader = Vec::new();
        wait_for(Duration::from_secs(10), "a follower to take over", || {
            new_leader = leaders(&others);
            !new_leader.is_empty()
        });
        let takeover = killed_at.elapsed();
        assert_eq!(new_leader.len(), 1, "two masters lead at once");
        wait_for(
            Duration::from_secs(10),
            "puts and gets to resume after the kill",
            || {
                read_back
                    .lock()
                    .unwrap()
                    .last()
                    .is_some_and(|&t| t > killed_at + takeover)
            },
        );
        let resumed = killed_at.elapsed();
        std::thread::sleep(Duration::from_millis(1000));
        stop.store(true, Ordering::SeqCst);
        (killed_at, takeover, resumed)
    });

    let acked = acked.into_inner().unwrap();
    let before: Vec<u64> = acked
        .iter()
        .filter(|(_, t)| *t < killed_at)
        .map(|(i, _)| *i)
        .collect();
    let after: Vec<u64> = acked
        .iter()
        .filter(|(_, t)| *t >= killed_at)
        .map(|(i, _)| *i)
        .collect();
    let failed = failed_puts.into_inner().unwrap();
    eprintln!(
        "failover: takeover {:.0} ms after SIGKILL of the leader, puts+gets resumed after \
         {:.0} ms; {} objects acknowledged before, {} after the kill, {} puts failed in \
         between (first: {:?})",
        takeover.as_secs_f64() * 1e3,
        resumed.as_secs_f64() * 1e3,
        before.len(),
        after.len(),
        failed.len(),
        failed.first()
    );
    assert!(
        takeover < Duration::from_secs(8),
        "takeover took {takeover:?}"
    );
    assert!(!after.is_empty(), "no put was acknowledged after the kill");
    assert!(
        wrong_bytes.into_inner().unwrap().is_empty(),
        "a read returned other bytes"
    );

    // The new leader knows every node under its data address.
    let new_leader = leaders(&masters);
    assert_eq!(new_leader.len(), 1);
    assert_ne!(new_leader[0], old_leader);
    wait_for(
        Duration::from_secs(5),
        "every node registered with the new leader with its data address",
        || all_registered(&masters[new_leader[0]], &expected),
    );

    // Nothing acknowledged is lost: every object reads back byte-exact, through a new client
    // too (a fresh view of the directory), and the objects put before the kill still have
    // both replicas (rebuilt from the nodes' reports).
    let all: Vec<u64> = acked.iter().map(|(i, _)| *i).collect();
    assert_eq!(unreadable(&client, &all, LEN), NONE);
    let fresh = self::client(&master_list, None);
    assert_eq!(unreadable(&fresh, &all, LEN), NONE);
    let cluster = fresh.cluster().unwrap();
    for &i in &before {
        let holders = cluster.where_is(&key(i)).unwrap();
        assert_eq!(holders.len(), 2, "object {i} is on {holders:?}");
    }
}

#[test]
fn single_master_restart() {
    const LEN: usize = 32 << 10;
    let dir = tempfile::tempdir().unwrap();
    let (master, mut master_proc) = start_master(1000, &["--replication", "ha=2"]);
    let two = [("node-0", "127.0.0.2"), ("node-1", "127.0.0.3")];
    let nodes = Nodes::start(dir.path(), &master, &two, false);
    let expected = nodes.expected();
    wait_for(Duration::from_secs(10), "two nodes registered", || {
        all_registered(&master, &expected)
    });
    let client = client(&master, Some("node-0"));
    let ids: Vec<u64> = (1..=24).collect();
    for &i in &ids {
        client.put_slice(&key(i), &value(i, LEN), None).unwrap();
    }
    assert_eq!(unreadable(&client, &ids, LEN), NONE);

    master_proc.kill();
    let killed_at = Instant::now();
    let _master_proc = spawn_master(&master, 1000, &["--replication", "ha=2"]);
    wait_for(
        Duration::from_secs(10),
        "both nodes re-registered with their data addresses",
        || all_registered(&master, &expected),
    );
    let registered = killed_at.elapsed();
    let keys: Vec<Vec<u8>> = ids.iter().map(|&i| key(i)).collect();
    wait_for(Duration::from_secs(5), "the objects visible again", || {
        client.exists_keys(&keys).iter().all(|&b| b)
    });
    let visible = killed_at.elapsed();
    eprintln!(
        "master restart: nodes re-registered {:.0} ms after the SIGKILL, objects visible \
         after {:.0} ms",
        registered.as_secs_f64() * 1e3,
        visible.as_secs_f64() * 1e3
    );
    assert_eq!(unreadable(&client, &ids, LEN), NONE);
    let reply = cluster_of(&master).unwrap();
    assert_eq!(reply.objects, ids.len() as u64, "{reply:?}");
    assert!(
        reply.nodes.iter().all(|n| !n.data_address.is_empty()),
        "{reply:?}"
    );
    // And the restarted master takes new puts.
    client.put_slice(&key(100), &value(100, LEN), None).unwrap();
    assert_eq!(unreadable(&client, &[100], LEN), NONE);
}

#[test]
fn node_restart_with_ssd() {
    const LEN: usize = 64 << 10;
    let dir = tempfile::tempdir().unwrap();
    let (master, _master_proc) = start_master(1000, &[]);
    let mut ssd_node = NodeOpts::new(dir.path(), &master, "node-ssd", "127.0.0.2");
    ssd_node.ssd = true;
    let other = NodeOpts::new(dir.path(), &master, "node-dram", "127.0.0.3");
    let mut ssd_proc = ssd_node.spawn();
    let _other_proc = other.spawn();
    let expected = vec![
        (ssd_node.id.clone(), ssd_node.data.clone()),
        (other.id.clone(), other.data.clone()),
    ];
    wait_for(Duration::from_secs(10), "two nodes registered", || {
        all_registered(&master, &expected)
    });
    // Local first: everything goes to the SSD node.
    let client = client(&master, Some("node-ssd"));
    let ids: Vec<u64> = (1..=32).collect();
    for &i in &ids {
        client.put_slice(&key(i), &value(i, LEN), None).unwrap();
    }
    let cluster = client.cluster().unwrap();
    for &i in &ids {
        assert_eq!(cluster.where_is(&key(i)).unwrap(), vec!["node-ssd"]);
    }

    // SIGKILL: strict durability means every acknowledged put is on disk.
    ssd_proc.kill();
    let keys: Vec<Vec<u8>> = ids.iter().map(|&i| key(i)).collect();
    wait_for(
        Duration::from_secs(5),
        "the dead node's objects dropped",
        || client.exists_keys(&keys).iter().all(|&b| !b),
    );
    let restarted_at = Instant::now();
    let _ssd_proc = ssd_node.spawn();
    wait_for(
        Duration::from_secs(10),
        "the restarted node's objects visible again",
        || client.exists_keys(&keys).iter().all(|&b| b),
    );
    let visible = restarted_at.elapsed();
    assert!(all_registered(&master, &expected));
    // A fresh client reads them at once.
    let fresh = self::client(&master, None);
    assert_eq!(unreadable(&fresh, &ids, LEN), NONE);
    // The old client's pooled connection to the dead process fails as a stale one (EOF) and
    // is retried on a fresh connection: the first read succeeds.
    assert_eq!(unreadable(&client, &ids, LEN), NONE);
    eprintln!(
        "node restart: {} SSD objects visible {:.0} ms after the restart, read byte-exact by \
         the writer's client after {:.0} ms",
        ids.len(),
        visible.as_secs_f64() * 1e3,
        restarted_at.elapsed().as_secs_f64() * 1e3
    );
    for &i in &ids {
        assert_eq!(cluster.where_is(&key(i)).unwrap(), vec!["node-ssd"]);
    }
}

#[test]
fn node_restart_same_address_pooled_connection() {
    const LEN: usize = 64 << 10;
    let dir = tempfile::tempdir().unwrap();
    let (master, _master_proc) = start_master(500, &[]);
    let node = NodeOpts::new(dir.path(), &master, "node-a", "127.0.0.2");
    let expected = vec![(node.id.clone(), node.data.clone())];
    let mut node_proc = node.spawn();
    wait_for(Duration::from_secs(10), "the node registered", || {
        all_registered(&master, &expected)
    });
    // No node id: every get and put goes over the node's data port.
    let old = client(&master, None);
    for i in 1..=4 {
        old.put_slice(&key(i), &value(i, LEN), None).unwrap();
    }
    assert_eq!(unreadable(&old, &[1, 2, 3, 4], LEN), NONE);
    let node_alive = |alive: bool| {
        cluster_of(&master).is_some_and(|r| {
            r.nodes
                .iter()
                .any(|n| n.node_id == node.id && n.alive == alive)
        })
    };

    // Restart 1: the old client's first request afterwards is a get.
    node_proc.kill();
    wait_for(
        Duration::from_secs(5),
        "the master to see the node down",
        || node_alive(false),
    );
    node_proc = node.spawn();
    wait_for(Duration::from_secs(10), "the node re-registered", || {
        all_registered(&master, &expected)
    });
    // A DRAM node comes back empty: another client stores what the old one will read.
    let other = client(&master, None);
    for i in 11..=14 {
        other.put_slice(&key(i), &value(i, LEN), None).unwrap();
    }
    let first = Instant::now();
    assert_eq!(
        unreadable(&old, &[11], LEN),
        NONE,
        "first get after the restart"
    );
    let first_get = first.elapsed();
    assert_eq!(unreadable(&old, &[12, 13, 14], LEN), NONE);

    // Restart 2: the old client's first request afterwards is a put.
    node_proc.kill();
    wait_for(
        Duration::from_secs(5),
        "the master to see the node down",
        || node_alive(false),
    );
    let _node_proc = node.spawn();
    wait_for(Duration::from_secs(10), "the node re-registered", || {
        all_registered(&master, &expected)
    });
    let first = Instant::now();
    old.put_slice(&key(21), &value(21, LEN), None)
        .expect("first put after the restart");
    let first_put = first.elapsed();
    assert_eq!(unreadable(&other, &[21], LEN), NONE);
    assert_eq!(unreadable(&old, &[21], LEN), NONE);
    eprintln!(
        "node restart on the same address: the old client's first get took {:.1} ms, its \
         first put {:.1} ms",
        first_get.as_secs_f64() * 1e3,
        first_put.as_secs_f64() * 1e3
    );
}
