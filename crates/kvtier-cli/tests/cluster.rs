//! Cluster mode end to end with real processes: one `kvtier master`, two `kvtier serve
//! --master` nodes on different loopback addresses (127.0.0.2 and 127.0.0.3 stand in for two
//! hosts), and cluster-mode clients in this process. Covers local-first placement, reads
//! from the other node byte-exact, first-writer-wins, exists_v2 in one round trip, a wrong
//! cluster token (the client cannot open), an unknown node id, and a node kill (its objects become misses, the rest
//! keeps working).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{start_master, wait_alive, wait_for, Nodes, Pool, Proc, TOKEN, TWO_NODES};
use kvtier_client::{Client, KvtierConfig, PageBatch};
use kvtier_proto::{ExistsV2Query, HitPolicy, KvComponents, PoolQuery};

struct Cluster {
    _dir: tempfile::TempDir,
    master_addr: String,
    _master: Proc,
    nodes: Nodes,
}

fn start_cluster(lease_ms: u64) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let (master_addr, master) = start_master(lease_ms, &[]);
    let nodes = Nodes::start(dir.path(), &master_addr, &TWO_NODES, false);
    let cluster = Cluster {
        _dir: dir,
        master_addr,
        _master: master,
        nodes,
    };
    wait_alive(&client(&cluster, "", TOKEN), 2);
    cluster
}

fn client(cluster: &Cluster, node_id: &str, token: &str) -> Client {
    Client::open(KvtierConfig {
        cluster_token: Some(token.to_string()),
        ..common::cluster_config(
            &cluster.master_addr,
            (!node_id.is_empty()).then_some(node_id),
        )
    })
    .expect("open a cluster client")
}

fn lookup_nodes(client: &Client, key: &[u8]) -> Vec<String> {
    let cluster = client.cluster().unwrap();
    let info = cluster.cluster_info().unwrap();
    let _ = info;
    cluster.where_is(key).unwrap()
}

#[test]
fn two_nodes_share_pages_and_survive_a_node_kill() {
    let mut cluster = start_cluster(1000);
    let prefill = client(&cluster, "node-a", TOKEN);
    let decode = client(&cluster, "node-b", TOKEN);
    assert_eq!(prefill.mode(), "cluster");

    // Prefill writes 16 pages x 2 components of 256 KiB through node A.
    let pages: Vec<String> = (0..16).map(|i| format!("hash{i:04}")).collect();
    let suffixes = ["_k", "_v"];
    let mut src = Pool::new(32, 256 << 10);
    src.fill(7);
    let _src_registered = src.register(&prefill);
    let batch = PageBatch {
        prefix: b"m1_",
        page_keys: &pages,
        suffixes: &suffixes,
    };
    let put = prefill.put_pages(&batch, &src.refs(), None);
    assert!(put.ok.iter().all(|&b| b), "{:?}", put.errors);
    // Local first: the prefill node holds them.
    assert_eq!(
        lookup_nodes(&prefill, b"m1_hash0003_k"),
        vec!["node-a".to_string()]
    );

    // Decode on node B sees them at once and reads them byte-exact.
    let query = ExistsV2Query {
        key_prefix: b"m1_".to_vec(),
        page_keys: pages.iter().map(|p| p.as_bytes().to_vec()).collect(),
        kv: KvComponents::Suffixes(vec![b"_k".to_vec(), b"_v".to_vec()]),
        pools: vec![PoolQuery {
            name: "swa".into(),
            suffixes: vec![b"_k".to_vec()],
            policy: HitPolicy::TrailingPages { window: 4 },
        }],
    };
    let answer = decode.exists_v2(&query);
    assert_eq!(answer.kv_hit_pages, 16, "{answer:?}");
    let dst = Pool::new(32, 256 << 10);
    let _dst_registered = dst.register(&decode);
    let got = decode.get_pages(&batch, &dst.refs());
    assert!(got.ok.iter().all(|&b| b), "{:?}", got.errors);
    assert!(dst.bytes == src.bytes, "decode read different bytes");
    common::assert_test_transport(&decode, &cluster.nodes.opts[0].data);

    // First writer wins: a second put of the same pages from node B changes nothing.
    let mut other = Pool::new(32, 256 << 10);
    other.fill(99);
    let _other_registered = other.register(&decode);
    let again = decode.put_pages(&batch, &other.refs(), None);
    assert!(again.ok.iter().all(|&b| b));
    let check = Pool::new(32, 256 << 10);
    let _check_registered = check.register(&decode);
    assert!(decode
        .get_pages(&batch, &check.refs())
        .ok
        .iter()
        .all(|&b| b));
    assert!(
        check.bytes == src.bytes,
        "a second writer overwrote the first"
    );

    // A client with a wrong token cannot even open: the master refuses its first RPC.
    let config = KvtierConfig {
        cluster_token: Some("wrong-token".into()),
        cluster_master_retry_ms: 1000,
        ..common::cluster_config(&cluster.master_addr, None)
    };
    match Client::open(config) {
        Ok(_) => panic!("a client with a wrong token opened"),
        Err(e) => assert!(e.to_string().contains("credential"), "{e}"),
    }
    let keys = [b"intruder-key".to_vec()];
    assert_eq!(decode.exists_keys(&keys), vec![false]);

    // An unknown node id still works (placement picks a live node).
    let stranger = client(&cluster, "no-such-node", TOKEN);
    let sbuf = Pool::new(1, 4096);
    let _sbuf_registered = sbuf.register(&stranger);
    assert_eq!(
        stranger.put_keys(&[b"stranger"], &sbuf.refs(), None).ok,
        vec![true]
    );

    // Kill node A: its pages become misses within the lease, node B keeps serving puts/gets.
    cluster.nodes.procs[0].kill();
    let started = Instant::now();
    let after = Pool::new(32, 256 << 10);
    let _after_registered = after.register(&decode);
    let r = decode.get_pages(&batch, &after.refs());
    assert!(r.ok.iter().all(|&b| !b), "pages of a dead node were served");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "a dead peer blocked {:?}",
        started.elapsed()
    );
    wait_for(
        Duration::from_secs(5),
        "node A dropped from the directory",
        || decode.exists_v2(&query).kv_hit_pages == 0,
    );
    let fresh: Vec<String> = (0..4).map(|i| format!("after{i}")).collect();
    let fresh_batch = PageBatch {
        prefix: b"m1_",
        page_keys: &fresh,
        suffixes: &suffixes,
    };
    let fb = Pool::new(8, 4096);
    let _fb_registered = fb.register(&prefill);
    let r = prefill.put_pages(&fresh_batch, &fb.refs(), None);
    assert!(
        r.ok.iter().all(|&b| b),
        "puts after a node death: {:?}",
        r.errors
    );
    assert_eq!(
        lookup_nodes(&prefill, b"m1_after0_k"),
        vec!["node-b".to_string()]
    );
}

fn client_in(cluster: &Cluster, node_id: &str, namespace: &str) -> Client {
    Client::open(KvtierConfig {
        extra_backend_tag: Some(namespace.to_string()),
        ..common::cluster_config(&cluster.master_addr, Some(node_id))
    })
    .expect("open a cluster client")
}

/// `clear()` in cluster mode: one namespace's objects leave every node and the directory
/// before it returns (more than one `PeerClear` page on node A), another namespace's stay
/// byte-exact, and a cleared key can be stored again with new bytes.
#[test]
fn clear_removes_one_namespace_from_every_node() {
    const SMALL: usize = 64;
    let cluster = start_cluster(1000);
    let t1_a = client_in(&cluster, "node-a", "t1");
    let t1_b = client_in(&cluster, "node-b", "t1");
    let t2_a = client_in(&cluster, "node-a", "t2");
    let many = kvtier_proto::peer::MAX_CLEARED_KEYS + 300;
    let keys_a: Vec<Vec<u8>> = (0..many).map(|i| format!("a{i:06}").into_bytes()).collect();
    let keys_b: Vec<Vec<u8>> = (0..40).map(|i| format!("b{i:06}").into_bytes()).collect();
    let keys_t2: Vec<Vec<u8>> = (0..40).map(|i| format!("c{i:06}").into_bytes()).collect();
    let mut src = Pool::new(512, SMALL);
    src.fill(3);
    let _src_registered = src.register(&t1_a);
    let _src_registered = src.register(&t1_b);
    let _src_registered = src.register(&t2_a);
    for (client, keys) in [(&t1_a, &keys_a), (&t1_b, &keys_b), (&t2_a, &keys_t2)] {
        for chunk in keys.chunks(512) {
            let r = client.put_keys(chunk, &src.refs()[..chunk.len()], None);
            assert!(r.ok.iter().all(|&b| b), "{:?}", r.errors);
        }
    }
    assert_eq!(lookup_nodes(&t1_b, b"b000003"), vec!["node-b".to_string()]);
    let held = |c: &Client, keys: &[Vec<u8>]| c.exists_keys(keys).iter().filter(|&&e| e).count();
    assert_eq!(held(&t1_b, &keys_a), many);

    t1_b.clear();
    assert_eq!(held(&t1_a, &keys_a), 0, "node A still lists t1 objects");
    assert_eq!(held(&t1_a, &keys_b), 0, "node B still lists t1 objects");
    let mut buf = vec![0u8; SMALL];
    assert!(t1_a.get_into_slice(b"a000001", &mut buf).is_err());
    assert!(t1_a.get_into_slice(b"b000001", &mut buf).is_err());
    // The other namespace, on the same node, is untouched.
    assert_eq!(held(&t2_a, &keys_t2), keys_t2.len());
    for (i, key) in keys_t2.iter().enumerate() {
        t2_a.get_into_slice(key, &mut buf)
            .expect("a t2 object after the clear");
        assert!(
            buf[..] == src.bytes[i * SMALL..(i + 1) * SMALL],
            "t2 object {i} changed"
        );
    }
    // A cleared key is free again: new bytes are stored and read back.
    let fresh = vec![0xA5u8; SMALL];
    t1_a.put_slice(b"a000001", &fresh, None)
        .expect("put after clear");
    t1_b.get_into_slice(b"a000001", &mut buf)
        .expect("get after clear");
    assert!(buf == fresh);
}
