//! A leader cut off from etcd steps down before anyone else leads. Real processes: a real
//! etcd, master A reaching it only through a TCP proxy the test controls, master B reaching
//! it directly, one node, a cluster client in this process.
//!
//! While A leads, the proxy stops every byte between A and etcd (a partition: silence, not a
//! refusal). A fences itself by time (it counts as leader only until its last answered
//! keep-alive's send time plus the TTL), so sampled every 50 ms there is never more than one
//! leader; B takes over once A's etcd lease lapses, the node re-registers with B, every
//! acknowledged object reads back byte-exact, and puts work again. When the link heals, A
//! stays a follower and names B as the leader.
//!
//! etcd is /usr/bin/etcd (Debian etcd-server, installed by scripts/setup.sh).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{
    all_registered, cluster_client, cluster_of, free_port, leaders, spawn_master, wait_for, Etcd,
    NodeOpts, Proxy,
};

const LEN: usize = 16 << 10;
const OBJECTS: u64 = 32;
/// The masters' `--election-ttl-s`.
const TTL: Duration = Duration::from_secs(2);

fn value(i: u64) -> Vec<u8> {
    common::object_bytes(i, LEN)
}

fn key(i: u64) -> Vec<u8> {
    format!("part{i:04}").into_bytes()
}

fn master(addr: &str, etcd: &str) -> common::Proc {
    spawn_master(addr, 1000, &["--etcd", etcd, "--election-ttl-s", "2"])
}

#[test]
fn a_leader_cut_off_from_etcd_steps_down_before_a_follower_leads() {
    let etcd = Etcd::start();
    let target = etcd.endpoint.trim_start_matches("http://").to_string();
    let proxy = Proxy::start(&target);
    let a = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let b = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let _a = master(&a, &format!("http://{}", proxy.addr));
    wait_for(Duration::from_secs(15), "master A elected", || {
        cluster_of(&a).is_some_and(|r| r.is_leader)
    });
    let _b = master(&b, &etcd.endpoint);
    wait_for(Duration::from_secs(10), "master B following A", || {
        cluster_of(&b).is_some_and(|r| !r.is_leader && r.leader_address == a)
    });
    let masters = vec![a.clone(), b.clone()];
    let master_list = masters.join(",");
    let dir = tempfile::tempdir().unwrap();
    let node = NodeOpts::new(dir.path(), &master_list, "node-p", "127.0.0.2");
    let _node = node.spawn();
    let expected = vec![(node.id.clone(), node.data.clone())];
    wait_for(
        Duration::from_secs(10),
        "the node registered with A",
        || all_registered(&a, &expected),
    );
    let client = cluster_client(&master_list, None);
    for i in 0..OBJECTS {
        client
            .put_slice(&key(i), &value(i), None)
            .unwrap_or_else(|e| panic!("put {i}: {e}"));
    }

    // Partition A from etcd; sample both masters until B leads with the node registered.
    proxy.cut();
    let cut_at = Instant::now();
    let mut a_stepped_down = None;
    let mut b_leads = None;
    while b_leads.is_none() || !all_registered(&b, &expected) {
        assert!(
            cut_at.elapsed() < Duration::from_secs(20),
            "no takeover 20 s after the partition (A stepped down: {a_stepped_down:?})"
        );
        let now = leaders(&masters);
        assert!(
            now.len() <= 1,
            "two leaders at once, {:?} after the cut",
            cut_at.elapsed()
        );
        if !now.contains(&0) && a_stepped_down.is_none() {
            a_stepped_down = Some(cut_at.elapsed());
        }
        if now.contains(&1) && b_leads.is_none() {
            b_leads = Some(cut_at.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (stepped, led) = (a_stepped_down.unwrap(), b_leads.unwrap());
    eprintln!("test: A stepped down {stepped:?} after the cut, B led at {led:?}");
    assert!(
        stepped <= led,
        "B led ({led:?}) before A stepped down ({stepped:?})"
    );
    // A's fence is its last answered keep-alive plus the TTL; keep-alives go every TTL / 4.
    assert!(
        stepped <= TTL + Duration::from_millis(500),
        "A kept leading {stepped:?} without etcd"
    );

    // Service resumes on B: acknowledged objects read back, new puts work.
    let mut buf = vec![0u8; LEN];
    for i in 0..OBJECTS {
        client
            .get_into_slice(&key(i), &mut buf)
            .unwrap_or_else(|e| panic!("get {i} after the takeover: {e}"));
        assert!(buf == value(i), "object {i} read back different bytes");
    }
    let late = OBJECTS + 1;
    client
        .put_slice(&key(late), &value(late), None)
        .expect("a put after the takeover");

    // The link heals: A stays a follower and names B.
    proxy.heal();
    wait_for(Duration::from_secs(10), "A following B", || {
        cluster_of(&a).is_some_and(|r| !r.is_leader && r.leader_address == b)
    });
    assert_eq!(leaders(&masters), vec![1]);
}
