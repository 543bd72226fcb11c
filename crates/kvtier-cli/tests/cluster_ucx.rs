#![allow(clippy::unwrap_used)]
//! The UCX data plane end to end (issue 17) with real processes: one `kvtier master`, two
//! `kvtier serve --master` nodes (127.0.0.2 and 127.0.0.3), and cluster clients with
//! `cluster_transport = "ucx"` reading one-sided from the other node's registered arena.
//!
//! Every scenario runs twice, UCX pinned to its TCP transport on loopback
//! (`UCX_TLS=tcp UCX_NET_DEVICES=lo`) and to shared memory (`UCX_TLS=posix,cma,self`), each in
//! a child process of this test binary: UCX reads those variables once per context, and the
//! nodes inherit them. Covered: byte-exact round trip with the transport reported as `ucx`,
//! a node killed mid-read (its objects fail cleanly, the other node's stay intact), and
//! eviction racing remote reads (a read is byte-exact or a miss, never other bytes).
//! `kvtier stat` names each node's data plane: UCX (with its `UCX_TLS`) or TCP frames and why.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{free_port, object_bytes, spawn_master, wait_for, Pool, Proc, TOKEN};
use kvtier_client::{Client, KvtierConfig};

const CHILD: &str = "TEST_CHILD_UCX_CLUSTER";
const TCP: &str = "tcp";
const SHM: &str = "posix,cma,self";

/// Run the ignored test `name` in a child process with UCX pinned to `tls` on loopback.
fn in_child(name: &str, tls: &str) {
    if let Err(reason) = kvtier_client::transport::ucx::ffi::Ucp::get() {
        eprintln!("SKIP: libucp is not available here: {reason}");
        return;
    }
    let started = Instant::now();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        .env("UCX_TLS", tls)
        .env("UCX_NET_DEVICES", "lo")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} with UCX_TLS={tls}:\n{text}"
    );
    eprintln!("{name} UCX_TLS={tls}: ok in {:?}", started.elapsed());
}

fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

struct Cluster {
    dir: tempfile::TempDir,
    master: String,
    _master_proc: Proc,
    /// (id, data address, process)
    nodes: Vec<(String, String, Proc)>,
}

fn spawn_node(
    dir: &std::path::Path,
    master: &str,
    id: &str,
    ip: &str,
    dram: &str,
) -> (String, String, Proc) {
    let data = format!("{ip}:{}", free_port(ip));
    let socket = dir.join(format!("{id}.sock"));
    let args = [
        "serve",
        "--socket",
        socket.to_str().unwrap(),
        "--dram-capacity",
        dram,
        "--engine",
        "dram_prefault=false",
        "--engine",
        "cluster_transport=ucx",
        "--master",
        master,
        "--data-addr",
        &data,
        "--node-id",
        id,
    ];
    // UCX_TLS / UCX_NET_DEVICES are inherited from this (child) process.
    let proc = Proc::spawn(id, &args, &[("KVTIER_CLUSTER_TOKEN", TOKEN)]);
    (id.to_string(), data, proc)
}

fn start_cluster(dram: &str) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let master_proc = spawn_master(&master, 1000, &[]);
    let nodes = vec![
        spawn_node(dir.path(), &master, "node-a", "127.0.0.2", dram),
        spawn_node(dir.path(), &master, "node-b", "127.0.0.3", dram),
    ];
    let cluster = Cluster {
        dir,
        master,
        _master_proc: master_proc,
        nodes,
    };
    let probe = client(&cluster, "");
    wait_for(Duration::from_secs(10), "both nodes registered", || {
        probe
            .cluster()
            .and_then(|c| c.cluster_info().ok())
            .is_some_and(|info| info.nodes.iter().filter(|n| n.alive).count() == 2)
    });
    cluster
}

fn client(cluster: &Cluster, node_id: &str) -> Client {
    Client::open(KvtierConfig {
        cluster_transport: "ucx".into(),
        cluster_request_timeout_ms: 1000,
        ..common::cluster_config(&cluster.master, (!node_id.is_empty()).then_some(node_id))
    })
    .expect("open a cluster client")
}

/// The transport `client` reports for `peer` (`None`: not read from yet).
fn transport_of(client: &Client, peer: &str) -> Option<(String, String)> {
    let stats = client.stats_json();
    stats["peer_transports"].as_array().and_then(|list| {
        list.iter().find(|p| p["peer"] == peer).map(|p| {
            (
                p["transport"].as_str().unwrap_or("").to_string(),
                p["reason"].as_str().unwrap_or("").to_string(),
            )
        })
    })
}

const OBJ: usize = 256 << 10;

fn keys(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{prefix}{i:05}").into_bytes())
        .collect()
}

fn put_objects(client: &Client, keys: &[Vec<u8>], seed: u64) {
    let mut pool = Pool::new(keys.len(), OBJ);
    for (i, chunk) in pool.bytes.chunks_mut(OBJ).enumerate() {
        chunk.copy_from_slice(&object_bytes(seed + i as u64, OBJ));
    }
    pool.register(client);
    let r = client.put_keys(keys, &pool.refs(), None);
    assert!(r.ok.iter().all(|&b| b), "{:?}", r.errors);
    drop(pool);
}

#[test]
fn round_trip_over_ucx_tcp() {
    in_child("child_round_trip", TCP);
}

#[test]
fn round_trip_over_shared_memory() {
    in_child("child_round_trip", SHM);
}

#[test]
#[ignore = "run by round_trip_over_* in a child process"]
fn child_round_trip() {
    if !is_child() {
        return;
    }
    let cluster = start_cluster("64MiB");
    let prefill = client(&cluster, "node-a");
    let decode = client(&cluster, "node-b");
    let ks = keys("rt", 48);
    put_objects(&prefill, &ks, 1000);
    assert_eq!(
        prefill.cluster().unwrap().where_is(&ks[3]).unwrap(),
        vec!["node-a".to_string()]
    );
    // Read through node B's client: node A's extents, one-sided.
    let dst = Pool::new(ks.len(), OBJ);
    dst.register(&decode);
    let got = decode.get_keys(&ks, &dst.refs());
    assert!(got.ok.iter().all(|&b| b), "{:?}", got.errors);
    for (i, chunk) in dst.bytes.chunks(OBJ).enumerate() {
        assert!(
            chunk == object_bytes(1000 + i as u64, OBJ),
            "object {i} differs"
        );
    }
    let node_a = &cluster.nodes[0].1;
    let (transport, reason) = transport_of(&decode, node_a).expect("node A read from");
    assert_eq!(transport, "ucx", "{reason}");
    println!("node A read over {transport}: {reason}");
    // A miss stays a miss; a wrong length is refused, never a hit.
    let mut small = vec![0u8; OBJ];
    assert!(decode.get_into_slice(b"no-such-key", &mut small).is_err());
    let mut wrong = vec![0u8; OBJ - 8];
    assert!(decode.get_into_slice(&ks[0], &mut wrong).is_err());
    // Many small reads in one batch: every one byte-exact.
    let small_keys = keys("small", 300);
    let mut pool = Pool::new(small_keys.len(), 4096);
    pool.fill(5);
    pool.register(&prefill);
    assert!(prefill
        .put_keys(&small_keys, &pool.refs(), None)
        .ok
        .iter()
        .all(|&b| b));
    let back = Pool::new(small_keys.len(), 4096);
    back.register(&decode);
    let r = decode.get_keys(&small_keys, &back.refs());
    assert!(r.ok.iter().all(|&b| b), "{:?}", r.errors);
    assert!(back.bytes == pool.bytes);
    let (transport, _) = transport_of(&decode, node_a).unwrap();
    assert_eq!(transport, "ucx", "no fallback after the batches");
    drop(cluster.dir);
}

#[test]
fn node_kill_mid_read_over_ucx_tcp() {
    in_child("child_node_kill_mid_read", TCP);
}

#[test]
fn node_kill_mid_read_over_shared_memory() {
    in_child("child_node_kill_mid_read", SHM);
}

#[test]
#[ignore = "run by node_kill_mid_read_over_* in a child process"]
fn child_node_kill_mid_read() {
    if !is_child() {
        return;
    }
    let mut cluster = start_cluster("64MiB");
    let on_a = client(&cluster, "node-a");
    let on_b = client(&cluster, "node-b");
    let reader = Arc::new(client(&cluster, ""));
    let ka = keys("a", 96);
    let kb = keys("b", 32);
    put_objects(&on_a, &ka, 0);
    put_objects(&on_b, &kb, 5000);
    // A reader loops over node A's objects while node A is killed.
    let stop = Arc::new(AtomicBool::new(false));
    let reads = {
        let (reader, stop, ka) = (Arc::clone(&reader), Arc::clone(&stop), ka.clone());
        std::thread::spawn(move || {
            let dst = Pool::new(ka.len(), OBJ);
            dst.register(&reader);
            let mut rounds = 0u32;
            let mut failures = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let r = reader.get_keys(&ka, &dst.refs());
                assert!(
                    started.elapsed() < Duration::from_secs(8),
                    "a read of a dying node took {:?}",
                    started.elapsed()
                );
                for (i, ok) in r.ok.iter().enumerate() {
                    if *ok {
                        assert!(
                            dst.bytes[i * OBJ..(i + 1) * OBJ] == object_bytes(i as u64, OBJ)[..],
                            "object {i} read wrong bytes"
                        );
                    } else {
                        failures += 1;
                    }
                }
                rounds += 1;
            }
            (rounds, failures)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    cluster.nodes[0].2.kill();
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    let (rounds, failures) = reads.join().expect("reader thread");
    println!("{rounds} read rounds, {failures} failed reads");
    assert!(failures > 0, "reads of a killed node never failed");
    // Node B's objects are intact and read byte-exact.
    let dst = Pool::new(kb.len(), OBJ);
    dst.register(&reader);
    let r = reader.get_keys(&kb, &dst.refs());
    assert!(r.ok.iter().all(|&b| b), "{:?}", r.errors);
    for (i, chunk) in dst.bytes.chunks(OBJ).enumerate() {
        assert!(
            chunk == object_bytes(5000 + i as u64, OBJ),
            "node B object {i} differs"
        );
    }
}

#[test]
fn eviction_racing_reads_over_ucx_tcp() {
    in_child("child_eviction_racing_reads", TCP);
}

#[test]
fn eviction_racing_reads_over_shared_memory() {
    in_child("child_eviction_racing_reads", SHM);
}

#[test]
#[ignore = "run by eviction_racing_reads_over_* in a child process"]
fn child_eviction_racing_reads() {
    if !is_child() {
        return;
    }
    // 16 MiB nodes: 64 objects of 256 KiB fill one; the writer stores 4x that on node A
    // while a reader on node B's side reads the oldest ones again and again.
    let cluster = start_cluster("16MiB");
    let writer = client(&cluster, "node-a");
    let reader = client(&cluster, "node-b");
    let first = keys("ev", 48);
    put_objects(&writer, &first, 100);
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (stop, master) = (Arc::clone(&stop), cluster.master.clone());
        std::thread::spawn(move || {
            let writer = Client::open(KvtierConfig {
                cluster_transport: "ucx".into(),
                ..common::cluster_config(&master, Some("node-a"))
            })
            .unwrap();
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) && round < 16 {
                let ks = keys(&format!("churn{round}-"), 16);
                put_objects(&writer, &ks, 10_000 + round * 100);
                round += 1;
            }
            round
        })
    };
    let dst = Pool::new(first.len(), OBJ);
    dst.register(&reader);
    let (mut hits, mut misses) = (0u64, 0u64);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(6) && !churn.is_finished() {
        let r = reader.get_keys(&first, &dst.refs());
        for (i, ok) in r.ok.iter().enumerate() {
            if *ok {
                hits += 1;
                assert!(
                    dst.bytes[i * OBJ..(i + 1) * OBJ] == object_bytes(100 + i as u64, OBJ)[..],
                    "object {i}: a read racing eviction returned wrong bytes"
                );
            } else {
                misses += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = churn.join().unwrap();
    println!("{rounds} churn rounds; {hits} hits, {misses} misses");
    assert!(hits > 0, "no read hit at all");
    let node_a = &cluster.nodes[0].1;
    let (transport, reason) = transport_of(&reader, node_a).expect("node A read from");
    println!("node A read over {transport}: {reason}");
}

/// The real `kvtier stat` against a real node once its data plane is reported (the node
/// starts its cluster part after its socket listens): (human output, JSON document).
fn stat_with_data_plane(socket: &std::path::Path) -> (String, serde_json::Value) {
    let run = |json: bool| {
        let mut args = vec!["stat", "--socket", socket.to_str().unwrap()];
        if json {
            args.push("--json");
        }
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args(&args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mut human = String::new();
    wait_for(Duration::from_secs(10), "stat names the data plane", || {
        human = run(false);
        human.contains("data plane:")
    });
    let doc = serde_json::from_str(&run(true)).unwrap();
    (human, doc)
}

#[test]
fn stat_names_the_data_plane() {
    if let Err(reason) = kvtier_client::transport::ucx::ffi::Ucp::get() {
        eprintln!("SKIP: libucp is not available here: {reason}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let _master_proc = spawn_master(&master, 1000, &[]);
    let mut nodes = Vec::new();
    for (id, ip, transport) in [
        ("node-u", "127.0.0.2", "ucx"),
        ("node-t", "127.0.0.3", "tcp"),
    ] {
        let data = format!("{ip}:{}", free_port(ip));
        let socket = dir.path().join(format!("{id}.sock"));
        let engine = format!("cluster_transport={transport}");
        let args = [
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram-capacity",
            "16MiB",
            "--engine",
            "dram_prefault=false",
            "--engine",
            &engine,
            "--master",
            &master,
            "--data-addr",
            &data,
            "--node-id",
            id,
        ];
        let envs = [
            ("KVTIER_CLUSTER_TOKEN", TOKEN),
            ("UCX_TLS", TCP),
            ("UCX_NET_DEVICES", "lo"),
        ];
        let proc = Proc::spawn(id, &args, &envs);
        nodes.push((socket.clone(), proc));
    }
    let (human, doc) = stat_with_data_plane(&nodes[0].0);
    println!("ucx node: {human}");
    let line = human.lines().find(|l| l.contains("data plane:")).unwrap();
    assert!(line.contains("data plane: UCX (UCX_TLS tcp,"), "{human}");
    assert!(line.contains("16 MiB registered"), "{human}");
    let plane = &doc["data_plane"];
    assert_eq!(plane["transport"], "ucx", "{doc}");
    assert_eq!(plane["enabled"], true, "{doc}");
    assert_eq!(plane["ucx_tls"], TCP, "{doc}");
    assert_eq!(plane["leases_held"], 0, "{doc}");

    let (human, doc) = stat_with_data_plane(&nodes[1].0);
    println!("tcp node: {human}");
    assert!(
        human.contains("data plane: TCP frames (no UCX: cluster_transport = \"tcp\")"),
        "{human}"
    );
    assert_eq!(doc["data_plane"]["transport"], "frames", "{doc}");
    assert_eq!(doc["data_plane"]["enabled"], false, "{doc}");
}
