//! Attacks on the cluster's trust boundaries, each played against real processes (a `kvtier
//! master`, `kvtier serve --master` nodes) with the cluster kept serving a legitimate client
//! byte-exact throughout (docs/security.md, "Cluster"):
//!
//! - master RPCs without a credential, with a wrong one, replayed, or moved to another RPC;
//!   `kvtier stat --master` and `kvtier master` without the token;
//! - a token holder taking over a live node id (registration from another address, forged
//!   heartbeats, leave and drop reports);
//! - a fake node at a real node's data address, and one registered under its own id: it never
//!   receives the token or anything derived from it, and its bytes are never hits;
//! - a node serving forged, torn or another key's bytes: a miss plus a counted integrity
//!   failure, the good replica read instead;
//! - file descriptor churn and silent connections on a data port of a node run with 256 file
//!   descriptors;
//! - oversized and crafted master requests.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    all_registered, cluster_client, cluster_of, free_port, object_bytes, spawn_master, wait_for,
    NodeOpts, Proc, TOKEN,
};
use kvtier_client::cluster::master::{connect, MasterCredential, MasterRpc};
use kvtier_client::store::Store;
use kvtier_client::{Client, KvtierConfig};
use kvtier_master::rpc::master_client::MasterClient;
use kvtier_master::rpc::*;
use kvtier_proto::auth::{
    rpc_credential, ObjectIntegrity, CHECKSUM_LEN, RPC_AUTH_HEADER, RPC_NONCE_LEN,
};
use tonic::Code;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// An authenticated RPC client of `master` proving `token`.
fn rpc(rt: &tokio::runtime::Runtime, master: &str, token: &[u8]) -> MasterRpc {
    rt.block_on(connect(
        master,
        MasterCredential::new(token.to_vec()),
        Duration::from_secs(2),
    ))
    .expect("connect to the master")
}

/// Put `objects` of `len` bytes under `prefix` through `client`; their keys and bytes.
fn put(client: &Client, prefix: &str, objects: u64, len: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    let cluster = client.cluster().expect("a cluster client");
    let items: Vec<(Vec<u8>, Vec<u8>)> = (0..objects)
        .map(|i| {
            (
                format!("{prefix}-{i:03}").into_bytes(),
                object_bytes(i + 1000 * prefix.len() as u64, len),
            )
        })
        .collect();
    let keys: Vec<Vec<u8>> = items.iter().map(|(k, _)| cluster.namespaced(k)).collect();
    let values: Vec<Result<&[u8], String>> = items.iter().map(|(_, v)| Ok(&v[..])).collect();
    let results = cluster.put_objects(&keys, &values, &vec![None; keys.len()]);
    assert!(results.iter().all(|r| r.is_ok()), "{results:?}");
    items
}

/// Read every object of `items` through `client`: per object, whether it was a hit, and each
/// hit's bytes compared with what was written.
fn get(client: &Client, items: &[(Vec<u8>, Vec<u8>)]) -> Vec<bool> {
    let cluster = client.cluster().expect("a cluster client");
    let keys: Vec<Vec<u8>> = items.iter().map(|(k, _)| cluster.namespaced(k)).collect();
    let mut buffers: Vec<Vec<u8>> = items.iter().map(|(_, v)| vec![0u8; v.len()]).collect();
    let dsts: Vec<Result<&mut [u8], String>> = buffers.iter_mut().map(|b| Ok(&mut b[..])).collect();
    let results = cluster.get_objects(&keys, dsts);
    results
        .iter()
        .zip(&buffers)
        .zip(items)
        .map(|((r, got), (key, want))| {
            if r.is_ok() {
                assert!(
                    got == want,
                    "{}: a hit with wrong bytes",
                    String::from_utf8_lossy(key)
                );
            }
            r.is_ok()
        })
        .collect()
}

/// A master (lease `lease_ms`) on 127.0.0.1 and nodes `(id, ip)`, all registered.
fn cluster(lease_ms: u64, nodes: &[(&str, &str)]) -> (tempfile::TempDir, String, Proc, Vec<Proc>) {
    let dir = tempfile::tempdir().unwrap();
    let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let master_proc = spawn_master(&master, lease_ms, &[]);
    let mut procs = Vec::new();
    let mut expected = Vec::new();
    for (id, ip) in nodes {
        let opts = NodeOpts::new(dir.path(), &master, id, ip);
        procs.push(opts.spawn());
        expected.push((id.to_string(), opts.data.clone()));
    }
    wait_for(Duration::from_secs(15), "every node registered", || {
        all_registered(&master, &expected)
    });
    (dir, master, master_proc, procs)
}

fn data_address(master: &str, id: &str) -> String {
    cluster_of(master)
        .expect("the master answers")
        .nodes
        .into_iter()
        .find(|n| n.node_id == id && n.alive)
        .map(|n| n.data_address)
        .unwrap_or_else(|| panic!("{id} is not live"))
}

fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> Code {
    match r {
        Ok(reply) => panic!("the master answered {reply:?}"),
        Err(status) => status.code(),
    }
}

/// Every RPC of the master, called once through `client`; the status codes.
fn call_every_rpc<T>(rt: &tokio::runtime::Runtime, client: &mut MasterClient<T>) -> Vec<Code>
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    rt.block_on(async {
        vec![
            code(client.cluster(ClusterRequest::default()).await),
            code(
                client
                    .register_node(RegisterNodeRequest {
                        node_id: "node-a".into(),
                        data_address: "127.0.0.9:1".into(),
                        ..Default::default()
                    })
                    .await,
            ),
            code(
                client
                    .heartbeat(HeartbeatRequest {
                        node_id: "node-a".into(),
                        ..Default::default()
                    })
                    .await,
            ),
            code(
                client
                    .leave_node(LeaveNodeRequest {
                        node_id: "node-a".into(),
                        ..Default::default()
                    })
                    .await,
            ),
            code(
                client
                    .report_dropped(ReportDroppedRequest {
                        node: 0,
                        keys: vec![b"trust-000".to_vec()],
                        ..Default::default()
                    })
                    .await,
            ),
            code(
                client
                    .forget(ForgetRequest {
                        keys: vec![b"trust-000".to_vec()],
                    })
                    .await,
            ),
            code(
                client
                    .lookup(LookupRequest {
                        keys: vec![b"trust-000".to_vec()],
                    })
                    .await,
            ),
            code(
                client
                    .place_puts(PlacePutsRequest {
                        keys: vec![b"x".to_vec()],
                        sizes: vec![1],
                        ..Default::default()
                    })
                    .await,
            ),
            code(
                client
                    .commit_puts(CommitPutsRequest {
                        claim: 0,
                        keys: vec![b"trust-000".to_vec()],
                        stored: vec![NodeList { nodes: vec![0] }],
                        target_node_id: String::new(),
                    })
                    .await,
            ),
            code(client.exists_v2(ExistsV2Request { query: vec![] }).await),
        ]
    })
}

fn kvtier_stat(master: &str, token: Option<&str>) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"));
    cmd.args(["stat", "--master", master, "--json"])
        .env_remove("KVTIER_CLUSTER_TOKEN")
        .env_remove("KVTIER_CONFIG_FILE");
    if let Some(t) = token {
        cmd.env("KVTIER_CLUSTER_TOKEN", t);
    }
    cmd.output().expect("run kvtier stat")
}

#[test]
fn master_rpcs_need_a_fresh_proof_of_the_token_and_live_nodes_keep_their_identity() {
    let (_dir, master, _master_proc, _nodes) =
        cluster(1000, &[("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")]);
    let node_a = data_address(&master, "node-a");
    let legit = cluster_client(&master, Some("node-a"));
    let items = put(&legit, "trust", 16, 64 << 10);
    let rt = runtime();

    // No credential at all: every RPC is refused before its handler runs.
    let mut anonymous = rt
        .block_on(MasterClient::connect(format!("http://{master}")))
        .unwrap();
    let codes = call_every_rpc(&rt, &mut anonymous);
    assert!(
        codes.iter().all(|&c| c == Code::Unauthenticated),
        "{codes:?}"
    );
    // A wrong token: the same.
    let mut wrong = rpc(&rt, &master, b"not-the-token");
    let codes = call_every_rpc(&rt, &mut wrong);
    assert!(
        codes.iter().all(|&c| c == Code::Unauthenticated),
        "{codes:?}"
    );

    // A captured proof: replayed on its own RPC, or moved to another one, is refused.
    let channel = rt
        .block_on(
            tonic::transport::Endpoint::from_shared(format!("http://{master}"))
                .unwrap()
                .connect(),
        )
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let captured = rpc_credential(
        TOKEN.as_bytes(),
        "/kvtier.master.v1.Master/Cluster",
        now,
        &[42; RPC_NONCE_LEN],
    );
    let fixed = captured.clone();
    let mut replayer = MasterClient::with_interceptor(channel, move |mut r: tonic::Request<()>| {
        r.metadata_mut()
            .insert(RPC_AUTH_HEADER, fixed.parse().unwrap());
        Ok(r)
    });
    rt.block_on(async {
        assert!(
            replayer.cluster(ClusterRequest::default()).await.is_ok(),
            "the original"
        );
        let again = replayer
            .cluster(ClusterRequest::default())
            .await
            .unwrap_err();
        assert_eq!(again.code(), Code::Unauthenticated);
        assert!(again.message().contains("replayed"), "{}", again.message());
        let moved = replayer
            .leave_node(LeaveNodeRequest {
                node_id: "node-a".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(moved.code(), Code::Unauthenticated);
    });

    // A token holder (a compromised client) tries to take node A over.
    let mut holder = rpc(&rt, &master, TOKEN.as_bytes());
    let index = cluster_of(&master)
        .unwrap()
        .nodes
        .iter()
        .find(|n| n.node_id == "node-a")
        .unwrap()
        .index;
    let dropped_key = legit.cluster().unwrap().namespaced(&items[0].0);
    rt.block_on(async {
        let takeover = holder
            .register_node(RegisterNodeRequest {
                node_id: "node-a".into(),
                data_address: "127.0.0.9:7999".into(),
                capacity_bytes: 1 << 40,
                free_bytes: 1 << 40,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(takeover.code(), Code::AlreadyExists, "{takeover:?}");
        // Heartbeats without the registration's secret renew nothing.
        let forged = holder
            .heartbeat(HeartbeatRequest {
                node_id: "node-a".into(),
                free_bytes: 0,
                node_secret: vec![0; 16],
                copy_failures: Vec::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!forged.known && forged.copy_tasks.is_empty());
        let leave = holder
            .leave_node(LeaveNodeRequest {
                node_id: "node-a".into(),
                node_secret: vec![1; 16],
            })
            .await
            .unwrap_err();
        assert_eq!(leave.code(), Code::PermissionDenied);
        let drop = holder
            .report_dropped(ReportDroppedRequest {
                node: index,
                keys: vec![dropped_key],
                node_secret: vec![2; 16],
            })
            .await
            .unwrap_err();
        assert_eq!(drop.code(), Code::PermissionDenied);
    });
    assert_eq!(data_address(&master, "node-a"), node_a, "node A moved");

    // The CLI reads the token like a node; without it (or with a wrong one) it gets nothing.
    let out = kvtier_stat(&master, None);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("KVTIER_CLUSTER_TOKEN"));
    let out = kvtier_stat(&master, Some("wrong"));
    assert!(!out.status.success());
    let out = kvtier_stat(&master, Some(TOKEN));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(&node_a));

    // A master without a token does not start.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["master", "--listen", "127.0.0.1:0"])
        .env_remove("KVTIER_CLUSTER_TOKEN")
        .env_remove("KVTIER_CONFIG_FILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cluster token"));

    // The cluster served on: every object byte-exact from another node, new puts too, and
    // both nodes live at their own addresses (heartbeats kept working).
    std::thread::sleep(Duration::from_millis(1500));
    let reader = cluster_client(&master, Some("node-b"));
    assert!(get(&reader, &items).iter().all(|&hit| hit));
    let more = put(&legit, "after", 4, 4096);
    assert!(get(&reader, &more).iter().all(|&hit| hit));
    assert_eq!(data_address(&master, "node-a"), node_a);
}

/// A process that listens and plays the data-port protocol without the token: answers each
/// hello with a random "proof" and records every byte it receives.
struct FakeNode {
    received: Arc<Mutex<Vec<Vec<u8>>>>,
    stop: Arc<AtomicBool>,
}

impl FakeNode {
    fn start(listener: TcpListener) -> FakeNode {
        listener.set_nonblocking(true).unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (Arc::clone(&received), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let Ok((mut conn, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let r = Arc::clone(&r);
                std::thread::spawn(move || {
                    let _ = conn.set_nonblocking(false);
                    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    let mut answered = false;
                    loop {
                        match conn.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                        if !answered && seen.len() >= kvtier_proto::frame::HEADER_LEN {
                            answered = true;
                            let challenge = kvtier_proto::peer::PeerChallenge {
                                nonce: object_bytes(1, 32),
                                proof: object_bytes(2, 32),
                            };
                            let mut frame = Vec::new();
                            kvtier_proto::encode_frame(
                                &mut frame,
                                kvtier_proto::Opcode::PeerHello,
                                0,
                                kvtier_proto::frame::FLAG_RESPONSE,
                                &challenge,
                            )
                            .unwrap();
                            let _ = conn.write_all(&frame);
                        }
                    }
                    r.lock().unwrap().push(seen);
                });
            }
        });
        FakeNode { received, stop }
    }

    /// Every connection's bytes so far.
    fn connections(&self) -> Vec<Vec<u8>> {
        self.received.lock().unwrap().clone()
    }
}

impl Drop for FakeNode {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The fake node got hellos and nothing else: no token, no proof, no request.
fn assert_learned_nothing(fake: &FakeNode) {
    wait_for(Duration::from_secs(5), "the fake node contacted", || {
        !fake.connections().is_empty()
    });
    // Connections record their bytes when the client closes them.
    std::thread::sleep(Duration::from_millis(300));
    let connections = fake.connections();
    assert!(!connections.is_empty(), "the fake node was never contacted");
    for bytes in &connections {
        assert!(
            !bytes.windows(TOKEN.len()).any(|w| w == TOKEN.as_bytes()),
            "the token crossed the wire"
        );
        let header = kvtier_proto::FrameHeader::decode(&bytes[..kvtier_proto::frame::HEADER_LEN])
            .expect("a frame");
        assert_eq!(header.opcode, kvtier_proto::Opcode::PeerHello as u16);
        assert_eq!(
            bytes.len(),
            kvtier_proto::frame::HEADER_LEN + header.body_len as usize,
            "the client sent more than its hello to a node that did not prove the token"
        );
    }
}

#[test]
fn a_fake_node_never_learns_the_token_and_its_bytes_are_never_hits() {
    // A long lease: a killed node stays listed while the fake answers at its address.
    let (_dir, master, _master_proc, mut nodes) =
        cluster(60_000, &[("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")]);
    let writer_b = cluster_client(&master, Some("node-b"));
    let on_b = put(&writer_b, "fake", 8, 32 << 10);
    let writer_a = cluster_client(&master, Some("node-a"));
    let on_a = put(&writer_a, "real", 8, 32 << 10);
    let reader = cluster_client(&master, None);
    assert!(get(&reader, &on_b).iter().all(|&hit| hit));

    // Node B dies; a process without the token takes its data address (a redirect).
    let b_address = data_address(&master, "node-b");
    nodes[1].kill();
    let listener = {
        let start = Instant::now();
        loop {
            match TcpListener::bind(&b_address) {
                Ok(l) => break l,
                Err(e) => {
                    assert!(start.elapsed() < Duration::from_secs(5), "bind: {e}");
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    };
    let fake = FakeNode::start(listener);
    let hits = get(&reader, &on_b);
    assert!(
        hits.iter().all(|&hit| !hit),
        "a fake node's reply was a hit"
    );
    // A put placed on the listed node fails there (never acknowledged as stored).
    let cluster = writer_b.cluster().unwrap();
    let key = cluster.namespaced(b"to-the-fake");
    let value = object_bytes(7, 4096);
    let r = cluster.put_objects(std::slice::from_ref(&key), &[Ok(&value[..])], &[None]);
    assert!(r[0].is_err(), "a put to the fake node was acknowledged");
    assert_learned_nothing(&fake);

    // A token holder registers a fake node of its own and lists it as a holder of node A's
    // objects; a reader co-located with it (tried first) refuses it and reads node A.
    let rogue = TcpListener::bind("127.0.0.5:0").unwrap();
    let rogue_address = rogue.local_addr().unwrap().to_string();
    let rogue_fake = FakeNode::start(rogue);
    let rt = runtime();
    let mut holder = rpc(&rt, &master, TOKEN.as_bytes());
    let index = rt
        .block_on(holder.register_node(RegisterNodeRequest {
            node_id: "node-f".into(),
            data_address: rogue_address,
            capacity_bytes: 1 << 30,
            free_bytes: 1 << 30,
            ..Default::default()
        }))
        .unwrap()
        .into_inner()
        .index;
    let keys: Vec<Vec<u8>> = on_a
        .iter()
        .map(|(k, _)| reader.cluster().unwrap().namespaced(k))
        .collect();
    let committed = rt
        .block_on(
            holder.commit_puts(CommitPutsRequest {
                claim: 0,
                stored: keys
                    .iter()
                    .map(|_| NodeList { nodes: vec![index] })
                    .collect(),
                keys,
                target_node_id: String::new(),
            }),
        )
        .unwrap()
        .into_inner()
        .committed;
    assert!(committed.iter().all(|&c| c));
    let beside_fake = cluster_client(&master, Some("node-f"));
    assert!(
        get(&beside_fake, &on_a).iter().all(|&hit| hit),
        "node A's replicas were not read after the fake was refused"
    );
    assert_learned_nothing(&rogue_fake);
    assert!(get(&reader, &on_a).iter().all(|&hit| hit));
}

#[test]
fn forged_torn_or_misplaced_bytes_are_a_miss_and_counted() {
    let (_dir, master, _master_proc, _nodes) = cluster(60_000, &[("node-a", "127.0.0.2")]);
    let writer = cluster_client(&master, Some("node-a"));
    let items = put(&writer, "sum", 4, 16 << 10);

    // A malicious node that holds the token: a real data port over a store the test tampers
    // with, registered under its own id.
    let store = Arc::new(
        kvtier_server::server::TenantStore::open(
            KvtierConfig {
                engine: kvtier_engine::EngineConfig {
                    dram_capacity_bytes: 64 << 20,
                    dram_prefault: false,
                    ..kvtier_engine::EngineConfig::default()
                },
                ..KvtierConfig::default()
            },
            "main",
        )
        .unwrap(),
    );
    let port = kvtier_server::peer::DataPort::start(
        "127.0.0.4:0".parse().unwrap(),
        Arc::clone(&store),
        TOKEN.as_bytes().to_vec(),
    )
    .unwrap();
    let rt = runtime();
    let mut holder = rpc(&rt, &master, TOKEN.as_bytes());
    let index = rt
        .block_on(holder.register_node(RegisterNodeRequest {
            node_id: "node-m".into(),
            data_address: port.local_addr().to_string(),
            capacity_bytes: 64 << 20,
            free_bytes: 64 << 20,
            ..Default::default()
        }))
        .unwrap()
        .into_inner()
        .index;
    let keys: Vec<Vec<u8>> = items
        .iter()
        .map(|(k, _)| writer.cluster().unwrap().namespaced(k))
        .collect();
    // The malicious node holds the token: it can seal, which the test uses for the copies
    // that stand for accidents (a torn or misplaced copy keeps a trailer made by a member).
    let seal = ObjectIntegrity::from_token(TOKEN.as_bytes());
    let object_checksum = |key: &[u8], value: &[u8]| seal.trailer(key, value);
    let stored = |key: &[u8], value: &[u8], sum: [u8; CHECKSUM_LEN]| {
        let mut bytes = value.to_vec();
        bytes.extend_from_slice(&sum);
        store.put_slice(key, &bytes, None).unwrap();
    };
    // Forged bytes under the original checksum (a flipped bit, as a torn or rotted copy).
    let mut flipped = items[0].1.clone();
    flipped[100] ^= 1;
    stored(&keys[0], &flipped, object_checksum(&keys[0], &items[0].1));
    // Another key's object, checksum and all (a misplaced or stale copy).
    stored(
        &keys[1],
        &items[2].1,
        object_checksum(&keys[2], &items[2].1),
    );
    // Forged bytes with a made-up checksum.
    stored(&keys[2], &object_bytes(77, 16 << 10), [0x5a; CHECKSUM_LEN]);
    // Object 3: a faithful copy (a hit from this node).
    stored(
        &keys[3],
        &items[3].1,
        object_checksum(&keys[3], &items[3].1),
    );
    let committed = rt
        .block_on(
            holder.commit_puts(CommitPutsRequest {
                claim: 0,
                stored: keys
                    .iter()
                    .map(|_| NodeList { nodes: vec![index] })
                    .collect(),
                keys: keys.clone(),
                target_node_id: String::new(),
            }),
        )
        .unwrap()
        .into_inner()
        .committed;
    assert!(committed.iter().all(|&c| c));

    // A reader beside the malicious node reads it first: three objects fail their checksum
    // (counted), the good replicas on node A are read instead, every hit byte-exact.
    let reader = cluster_client(&master, Some("node-m"));
    assert!(get(&reader, &items).iter().all(|&hit| hit));
    assert_eq!(reader.cluster().unwrap().integrity_failures(), 3);
    assert_eq!(port.counters().gets.load(Ordering::Relaxed), 4);

    // An object whose only copy is forged: a miss, never a hit.
    let cluster = reader.cluster().unwrap();
    let only = cluster.namespaced(b"only-forged");
    let place = rt
        .block_on(holder.place_puts(PlacePutsRequest {
            client_node_id: "node-m".into(),
            keys: vec![only.clone()],
            sizes: vec![4096],
            ..Default::default()
        }))
        .unwrap()
        .into_inner();
    stored(&only, &object_bytes(5, 4096), [42; CHECKSUM_LEN]);
    let committed = rt
        .block_on(holder.commit_puts(CommitPutsRequest {
            claim: place.claim,
            keys: vec![only.clone()],
            stored: vec![NodeList { nodes: vec![index] }],
            target_node_id: String::new(),
        }))
        .unwrap()
        .into_inner()
        .committed;
    assert_eq!(committed, vec![true]);
    let mut dst = vec![0u8; 4096];
    let r = cluster.get_objects(std::slice::from_ref(&only), vec![Ok(&mut dst[..])]);
    assert!(
        matches!(r[0], Err(kvtier_client::cluster::ObjectError::Integrity(_))),
        "forged bytes were a hit or failed otherwise: {:?}",
        r[0]
    );
    assert_eq!(cluster.integrity_failures(), 4);
    // Issue 28: through the Store API the failure arrives typed, as an integrity failure.
    let e = reader.get_into_slice(b"only-forged", &mut dst).unwrap_err();
    assert_eq!(
        e.item_failure(),
        kvtier_client::error::ItemFailure::Integrity,
        "{e:?}"
    );
    assert!(!e.is_miss(), "{e:?}");
    assert_eq!(cluster.integrity_failures(), 5);
    // The writer's node still serves everything byte-exact.
    let plain = cluster_client(&master, Some("node-a"));
    assert!(get(&plain, &items).iter().all(|&hit| hit));
    port.shutdown();
}

/// Whether the server closed `conn` (EOF or reset) rather than keeping it open.
fn closed_by_server(conn: &mut std::net::TcpStream) -> bool {
    let _ = conn.set_read_timeout(Some(Duration::from_millis(20)));
    let mut byte = [0u8; 64];
    loop {
        match conn.read(&mut byte) {
            Ok(0) => return true,
            Ok(_) => continue, // an error reply before the close
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                )
            }
        }
    }
}

/// CPU seconds (user + system) process `pid` used so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split(' ').collect();
    // utime and stime are fields 14 and 15 of the whole line (11 and 12 after the name).
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

#[test]
fn descriptor_churn_and_silent_connections_leave_a_node_serving() {
    let dir = tempfile::tempdir().unwrap();
    let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let _master_proc = spawn_master(&master, 1000, &[]);
    // The node runs with 256 file descriptors, as under `ulimit -n 256`.
    let opts = NodeOpts::new(dir.path(), &master, "node-a", "127.0.0.2");
    let mut node = opts.spawn_under(&["prlimit", "--nofile=256"]);
    wait_for(Duration::from_secs(15), "node registered", || {
        all_registered(&master, &[("node-a".into(), opts.data.clone())])
    });
    let writer = cluster_client(&master, Some("node-a"));
    let items = put(&writer, "churn", 8, 16 << 10);
    let started = Instant::now();

    // 1,200 connect + close cycles without a handshake, and 200 with a whole handshake and a
    // request (a client that reconnects), far more than the node's descriptors.
    for i in 0..1200 {
        let conn = std::net::TcpStream::connect(&opts.data).expect("connect");
        if i % 3 == 0 {
            let _ = (&conn).write_all(b"KVT1 garbage");
        }
        drop(conn);
    }
    for _ in 0..200 {
        let reader = kvtier_client::transport::tcp::TcpTransport::new(
            kvtier_client::transport::tcp::TcpTransportConfig {
                token: TOKEN.as_bytes().to_vec(),
                connections_per_peer: 1,
                ..Default::default()
            },
        );
        let key = writer.cluster().unwrap().namespaced(&items[0].0);
        let mut dst = vec![0u8; items[0].1.len()];
        let mut get = [kvtier_client::transport::GetItem {
            key: &key,
            dst: &mut dst,
        }];
        use kvtier_client::transport::Transport;
        let r = reader.get(&opts.data, &mut get);
        assert!(r[0].is_ok(), "{r:?}");
        assert!(dst == items[0].1);
    }
    assert!(node.running(), "the node died");
    // Every connection's state is gone once its thread ended.
    let fds = || {
        std::fs::read_dir(format!("/proc/{}/fd", node.child.id()))
            .unwrap()
            .count()
    };
    wait_for(
        Duration::from_secs(5),
        "the node's descriptors freed",
        || fds() < 100,
    );
    let fresh = cluster_client(&master, None);
    assert!(get(&fresh, &items).iter().all(|&hit| hit));

    // 600 silent connections: the node keeps serving a new legitimate client meanwhile...
    let mut silent: Vec<std::net::TcpStream> = (0..600)
        .map(|_| std::net::TcpStream::connect(&opts.data).expect("connect"))
        .collect();
    let during = cluster_client(&master, None);
    assert!(get(&during, &items).iter().all(|&hit| hit));
    let more = put(&during, "during", 4, 4096);
    assert!(get(&during, &more).iter().all(|&hit| hit));
    // ... cuts them all by the handshake deadline (5 s), and does not spin meanwhile.
    let cpu_before = cpu_seconds(node.child.id());
    wait_for(
        Duration::from_secs(8),
        "every silent connection cut",
        || silent.iter_mut().all(closed_by_server),
    );
    let cpu = cpu_seconds(node.child.id()) - cpu_before;
    assert!(cpu < 1.0, "the node burnt {cpu} s of CPU while flooded");
    assert!(node.running(), "the node died");
    let after = cluster_client(&master, None);
    assert!(get(&after, &items).iter().all(|&hit| hit));
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn oversized_and_crafted_master_requests_are_refused_and_the_master_serves_on() {
    let (_dir, master, mut master_proc, _nodes) = cluster(1000, &[("node-a", "127.0.0.2")]);
    let writer = cluster_client(&master, Some("node-a"));
    let items = put(&writer, "big", 4, 4096);
    let rt = runtime();
    let mut holder = rpc(&rt, &master, TOKEN.as_bytes());
    // A client without the usual size limit on what it sends: the master's limit decides.
    let channel = rt
        .block_on(
            tonic::transport::Endpoint::from_shared(format!("http://{master}"))
                .unwrap()
                .connect(),
        )
        .unwrap();
    let mut unlimited =
        MasterClient::with_interceptor(channel, MasterCredential::new(TOKEN.as_bytes().to_vec()))
            .max_encoding_message_size(usize::MAX);
    rt.block_on(async {
        // 21 MiB of 1-byte keys (about 7 M keys once decoded): refused by size, not decoded.
        let huge = LookupRequest {
            keys: vec![vec![b'k']; 7 << 20],
        };
        let refused = unlimited.lookup(huge).await.unwrap_err();
        assert_eq!(refused.code(), Code::OutOfRange, "{refused:?}");
        assert!(
            refused.message().contains("message length too large"),
            "{refused:?}"
        );
        // Within the size limit but over the key count.
        let many = LookupRequest {
            keys: vec![vec![b'k']; 70_000],
        };
        let refused = holder.lookup(many).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument);
        // Empty and oversized keys.
        for key in [vec![], vec![0u8; 8192]] {
            let refused = holder.forget(ForgetRequest { keys: vec![key] }).await;
            assert_eq!(refused.unwrap_err().code(), Code::InvalidArgument);
        }
        // A crafted existence query: garbage, then truncated varints.
        for query in [vec![0xff; 64], vec![0x80; 10], vec![]] {
            let refused = holder.exists_v2(ExistsV2Request { query }).await;
            assert_eq!(refused.unwrap_err().code(), Code::InvalidArgument);
        }
        // Mismatched lists and node indexes out of range.
        let refused = holder
            .commit_puts(CommitPutsRequest {
                claim: 1,
                keys: vec![b"a".to_vec(), b"b".to_vec()],
                stored: vec![],
                target_node_id: String::new(),
            })
            .await;
        assert_eq!(refused.unwrap_err().code(), Code::InvalidArgument);
        // A node index this master never registered (a put placed by an earlier leader): an
        // infrastructure event the caller retries, not its mistake (issue 29).
        let mut key = kvtier_proto::namespace::cluster_prefix("");
        key.extend_from_slice(b"stale-index");
        let refused = holder
            .commit_puts(CommitPutsRequest {
                claim: 1,
                keys: vec![key],
                stored: vec![NodeList { nodes: vec![500] }],
                target_node_id: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
        assert!(refused.message().contains("took over"), "{refused:?}");
        let refused = holder
            .report_dropped(ReportDroppedRequest {
                node: u32::MAX,
                keys: vec![b"a".to_vec()],
                ..Default::default()
            })
            .await;
        assert_eq!(refused.unwrap_err().code(), Code::InvalidArgument);
        // A registration whose address is not host:port.
        let refused = holder
            .register_node(RegisterNodeRequest {
                node_id: "node-x".into(),
                data_address: "not an address".into(),
                ..Default::default()
            })
            .await;
        assert_eq!(refused.unwrap_err().code(), Code::InvalidArgument);
    });
    assert!(master_proc.running(), "the master died");
    let reader = cluster_client(&master, None);
    assert!(get(&reader, &items).iter().all(|&hit| hit));
    let more = put(&writer, "after-big", 4, 4096);
    assert!(get(&reader, &more).iter().all(|&hit| hit));
}
