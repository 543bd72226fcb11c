//! Issue 26 §2: local tenants and cluster namespaces are different bytes. Each attack is
//! played against real processes (a `kvtier master`, a `kvtier serve --master` node whose
//! local socket serves a credential-bound tenant `team-a`), and the store is shown intact and
//! legitimate clients served byte-exact afterwards (docs/security.md, "Tenants" and "End-to-end
//! integrity"):
//!
//! 1. a cluster member (it holds the token) over the node's data port cannot get, put, plant,
//!    remove, demote, clear or list the local tenant's keys, nor lease them over UCX; a node
//!    restarted with its SSD tier registers none of them with the master;
//! 2. a cluster client with `extra_backend_tag = "team-a"` clearing does not touch the local
//!    tenant `team-a`, and the local tenant's clear does not touch the cluster namespace;
//! 3. a local user without the token, as tenant `team-a` (or the empty tenant, naming the
//!    cluster key's bytes), cannot replace or plant a cluster object: readers get the right
//!    bytes or a clean miss; a session naming the cluster marker as its tenant is refused;
//! 4. forged bytes stored directly with a recomputed unkeyed trailer (BLAKE3 unkeyed, XXH3-128,
//!    keyed with another token) are a miss and counted; only a token holder's trailer passes.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{
    all_registered, cluster_config, free_port, metric_sum, object_bytes, spawn_master,
    test_transport, wait_for, Pool, Proc, TOKEN,
};
use kvtier_client::store::Store;
use kvtier_client::transport::tcp::{TcpTransport, TcpTransportConfig};
use kvtier_client::transport::{GetItem, PutItem, Transport, TransportError};
use kvtier_client::{Client, KvtierConfig};
use kvtier_master::rpc::*;
use kvtier_proto::auth::{ObjectIntegrity, CHECKSUM_LEN};
use kvtier_proto::namespace::{cluster_prefix, tenant_prefix};
use kvtier_proto::peer::peer_error_code::OUTSIDE_CLUSTER_NAMESPACE;
use kvtier_proto::peer_ucx::{UcxLeaseReply, UcxLeaseRequest};
use kvtier_proto::Opcode;

const TENANT: &str = "team-a";
const LEN: usize = 32 << 10;

/// A node with a local socket, a metrics endpoint, an SSD tier, and `team-a` bound to this
/// process's uid (`tenant_access`), registered with a fresh master.
struct Node {
    _dir: tempfile::TempDir,
    master: String,
    _master: Proc,
    node: Proc,
    socket: PathBuf,
    data: String,
    metrics: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl Node {
    fn start() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
        let master_proc = spawn_master(&master, 60_000, &[]);
        let socket = dir.path().join("node-a.sock");
        let data = format!("127.0.0.2:{}", free_port("127.0.0.2"));
        let metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
        let ssd = dir.path().join("ssd");
        let mut args: Vec<String> = [
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram-capacity",
            "64MiB",
            "--engine",
            "dram_prefault=false",
            "--engine",
            "ssd_enabled=true",
            "--engine",
            "ssd_capacity_bytes=64MiB",
            "--engine",
            "ssd_segment_size_bytes=4MiB",
            "--engine",
            "ssd_durability_mode=strict",
            "--engine",
            "ssd_write_policy=write_through",
            "--master",
            &master,
            "--data-addr",
            &data,
            "--node-id",
            "node-a",
            "--metrics-addr",
            &metrics,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push("--engine".into());
        args.push(format!("ssd_storage_dir={}", ssd.display()));
        if let Some(t) = test_transport() {
            args.push("--engine".into());
            args.push(format!("cluster_transport={t}"));
        }
        let uid = std::fs::metadata("/proc/self").unwrap().uid();
        let env = vec![
            ("KVTIER_CLUSTER_TOKEN".to_string(), TOKEN.to_string()),
            (
                "KVTIER_SERVE_TENANT_ACCESS".to_string(),
                format!("{TENANT}=uid:{uid}"),
            ),
            ("UCX_TLS".to_string(), "tcp".to_string()),
            ("UCX_NET_DEVICES".to_string(), "lo".to_string()),
        ];
        let node = spawn_node(&args, &env, &socket, &master, &data);
        Node {
            _dir: dir,
            master,
            _master: master_proc,
            node,
            socket,
            data,
            metrics,
            args,
            env,
        }
    }

    /// Stop the node (SIGTERM: it flushes and leaves) and start it again on the same SSD.
    fn restart(&mut self) {
        self.node.terminate(Duration::from_secs(10));
        self.node = spawn_node(
            &self.args,
            &self.env,
            &self.socket,
            &self.master,
            &self.data,
        );
    }

    /// A local-socket client of `tenant` (no cluster token).
    fn local(&self, tenant: &str) -> Client {
        Client::open(KvtierConfig {
            server_socket: Some(self.socket.display().to_string()),
            extra_backend_tag: (!tenant.is_empty()).then(|| tenant.to_string()),
            ..KvtierConfig::default()
        })
        .expect("open a local client")
    }

    /// A cluster client in namespace `tag` (none: untagged), beside node-a or not.
    fn cluster(&self, tag: Option<&str>, beside: bool) -> Client {
        Client::open(KvtierConfig {
            extra_backend_tag: tag.map(String::from),
            ..cluster_config(&self.master, beside.then_some("node-a"))
        })
        .expect("open a cluster client")
    }

    fn refused_on_port(&self) -> f64 {
        metric_sum(
            &self.metrics,
            "kvtier_data_port_outside_namespace_total",
            &[],
        )
    }
}

/// Start `kvtier serve` with `args` and `env`; wait until it is registered and its socket
/// answers.
fn spawn_node(
    args: &[String],
    env: &[(String, String)],
    socket: &Path,
    master: &str,
    data: &str,
) -> Proc {
    let _ = std::fs::remove_file(socket);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let proc = Proc::spawn("node-a", &args, &env);
    wait_for(Duration::from_secs(20), "node-a registered", || {
        all_registered(master, &[("node-a".into(), data.to_string())])
    });
    wait_for(Duration::from_secs(10), "node-a's socket", || {
        std::os::unix::net::UnixStream::connect(socket).is_ok()
    });
    proc
}

fn names(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{prefix}-{i}").into_bytes())
        .collect()
}

/// Put `values` under `names` through `client` (any mode).
fn put(client: &Client, names: &[Vec<u8>], values: &[Vec<u8>]) {
    let len = values[0].len();
    let mut pool = Pool::new(names.len(), len);
    for (chunk, v) in pool.bytes.chunks_mut(len).zip(values) {
        chunk.copy_from_slice(v);
    }
    let _registered = pool.register(client);
    let put = client.put_keys(names, &pool.refs(), None);
    assert!(put.ok.iter().all(|&ok| ok), "{:?}", put.errors);
}

/// Read `names` through `client`: per name, the bytes of a hit (`None`: a miss).
fn get(client: &Client, names: &[Vec<u8>], len: usize) -> Vec<Option<Vec<u8>>> {
    let pool = Pool::new(names.len(), len);
    let _registered = pool.register(client);
    let got = client.get_keys(names, &pool.refs());
    got.ok
        .iter()
        .zip(pool.bytes.chunks(len))
        .map(|(&ok, bytes)| ok.then(|| bytes.to_vec()))
        .collect()
}

fn values(seed: u64, n: usize, len: usize) -> Vec<Vec<u8>> {
    (0..n as u64).map(|i| object_bytes(seed + i, len)).collect()
}

fn assert_exact(client: &Client, names: &[Vec<u8>], want: &[Vec<u8>], what: &str) {
    let got = get(client, names, want[0].len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.as_deref() == Some(&w[..]),
            "{what}: object {i} is not byte-exact"
        );
    }
}

/// A member of the cluster talking to the node's data port directly.
fn member() -> TcpTransport {
    TcpTransport::new(TcpTransportConfig {
        token: TOKEN.as_bytes().to_vec(),
        end_to_end_checksums: true,
        name: "member".into(),
        connections_per_peer: 1,
        request_timeout: Duration::from_secs(2),
        down_backoff: Duration::from_millis(100),
    })
}

fn outside(e: &TransportError) -> bool {
    matches!(e, TransportError::Refused { code, .. } if *code == OUTSIDE_CLUSTER_NAMESPACE)
}

/// The key a local session of `tenant` stores `name` under.
fn local_key(tenant: &str, name: &[u8]) -> Vec<u8> {
    [&tenant_prefix(tenant)[..], name].concat()
}

#[test]
fn a_member_cannot_reach_a_local_tenant_over_the_data_port() {
    let mut node = Node::start();
    let local = node.local(TENANT);
    let secret_names = names("secret", 8);
    let secrets = values(100, 8, LEN);
    put(&local, &secret_names, &secrets);
    let legit = node.cluster(Some(TENANT), true);
    let cluster_names = names("page", 8);
    let cluster_values = values(200, 8, LEN);
    put(&legit, &cluster_names, &cluster_values);

    let m = member();
    let peer = node.data.clone();
    let stored: Vec<Vec<u8>> = secret_names.iter().map(|n| local_key(TENANT, n)).collect();
    // Read: with and without room for a trailer.
    for extra in [0, CHECKSUM_LEN] {
        let mut dst = vec![0u8; LEN + extra];
        let r = m.get(
            &peer,
            &mut [GetItem {
                key: &stored[0],
                dst: &mut dst,
            }],
        );
        assert!(r[0].as_ref().is_err_and(outside), "{r:?}");
        assert!(dst.iter().all(|&b| b == 0), "local bytes were sent");
    }
    // Overwrite (after a remove) and plant (a new key the tenant would read as a hit).
    let forged = object_bytes(666, LEN);
    let planted = local_key(TENANT, b"secret-planted");
    for key in [&stored[1], &planted] {
        let r = m.put(
            &peer,
            &[PutItem {
                key,
                value: &forged,
                depth: None,
            }],
        );
        assert!(r[0].as_ref().is_err_and(outside), "{r:?}");
    }
    let e = m.remove(&peer, &[&stored[1][..]]).unwrap_err();
    assert!(outside(&e), "{e:?}");
    let e = m.demote(&peer, &[&stored[2][..]]).unwrap_err();
    assert!(outside(&e), "{e:?}");
    // Clear and list: the tenant's prefix, everything, the empty tenant's prefix.
    for prefix in [&tenant_prefix(TENANT)[..], b"", &tenant_prefix("")[..]] {
        let e = m.clear_prefix(&peer, prefix).unwrap_err();
        assert!(outside(&e), "clear {prefix:?}: {e:?}");
    }
    // UCX: a lease of the tenant's object (refused before the UCX plane is asked).
    let e = m
        .control::<UcxLeaseReply>(
            &peer,
            Opcode::PeerUcxLease,
            &UcxLeaseRequest {
                objects: vec![(stored[3].clone(), (LEN + CHECKSUM_LEN) as u64)],
            },
        )
        .unwrap_err();
    assert!(outside(&e), "{e:?}");
    // Every refusal counted by the node.
    wait_for(Duration::from_secs(5), "the refusals counted", || {
        node.refused_on_port() >= 10.0
    });
    assert_eq!(node.refused_on_port(), 10.0);

    // Intact: the tenant reads its objects byte-exact, nothing was planted, the cluster
    // client is served, and the member's own cluster clear lists only cluster keys.
    assert_exact(&local, &secret_names, &secrets, "local tenant");
    assert_eq!(get(&local, &[b"secret-planted".to_vec()], LEN), vec![None]);
    assert_exact(&legit, &cluster_names, &cluster_values, "cluster client");
    let cleared = m.clear_prefix(&peer, &cluster_prefix("other")).unwrap();
    assert!(cleared.is_empty(), "{cleared:?}");

    // Listing through the master: a node restarted on its SSD registers the cluster objects
    // it holds, never the local tenant's keys.
    drop(local);
    drop(legit);
    node.restart();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let rpc = rt
        .block_on(kvtier_client::cluster::master::connect(
            &node.master,
            kvtier_client::cluster::master::MasterCredential::new(TOKEN.as_bytes().to_vec()),
            Duration::from_secs(2),
        ))
        .unwrap();
    let cluster_keys: Vec<Vec<u8>> = cluster_names
        .iter()
        .map(|n| [&cluster_prefix(TENANT)[..], n].concat())
        .collect();
    let lookup = |keys: Vec<Vec<u8>>| -> Vec<usize> {
        rt.block_on(rpc.clone().lookup(LookupRequest { keys }))
            .unwrap()
            .into_inner()
            .locations
            .iter()
            .map(|l| l.nodes.len())
            .collect()
    };
    wait_for(
        Duration::from_secs(10),
        "the cluster objects re-registered",
        || lookup(cluster_keys.clone()).iter().all(|&n| n == 1),
    );
    assert!(
        lookup(stored.clone()).iter().all(|&n| n == 0),
        "a local tenant's key was registered with the master"
    );
    let local = node.local(TENANT);
    assert_exact(
        &local,
        &secret_names,
        &secrets,
        "local tenant after restart",
    );
    let legit = node.cluster(Some(TENANT), false);
    assert_exact(
        &legit,
        &cluster_names,
        &cluster_values,
        "cluster after restart",
    );
    assert!(node.node.running());
}

#[test]
fn clears_of_a_cluster_namespace_and_a_local_tenant_of_one_name_stay_apart() {
    let node = Node::start();
    let local = node.local(TENANT);
    let cluster = node.cluster(Some(TENANT), true);
    let untagged = node.cluster(None, false);
    let n = names("page", 16);
    let (local_v, cluster_v, untagged_v) = (
        values(1000, 16, LEN),
        values(2000, 16, LEN),
        values(3000, 16, LEN),
    );
    // The same page names in the tenant, the cluster namespace of the same name, and the
    // untagged cluster namespace: three different objects each.
    put(&local, &n, &local_v);
    put(&cluster, &n, &cluster_v);
    put(&untagged, &n, &untagged_v);
    assert_exact(&local, &n, &local_v, "local");
    assert_exact(&cluster, &n, &cluster_v, "cluster");

    // The cluster client's clear (SGLang's /clear_hicache_storage_backend) wipes its
    // namespace on every node, not the local tenant, not the untagged namespace.
    cluster.clear();
    assert!(cluster.exists_keys(&n).iter().all(|&e| !e));
    assert_exact(&local, &n, &local_v, "local after the cluster clear");
    assert_exact(
        &untagged,
        &n,
        &untagged_v,
        "untagged after the cluster clear",
    );

    // And the other way: the local tenant's clear leaves the cluster namespace alone.
    put(&cluster, &n, &cluster_v);
    local.clear();
    assert!(local.exists_keys(&n).iter().all(|&e| !e));
    assert_exact(&cluster, &n, &cluster_v, "cluster after the local clear");
    let reader = node.cluster(Some(TENANT), false);
    assert_exact(&reader, &n, &cluster_v, "cluster from a remote reader");
    // The untagged clear takes the untagged namespace only.
    untagged.clear();
    assert!(untagged.exists_keys(&n).iter().all(|&e| !e));
    assert_exact(&cluster, &n, &cluster_v, "cluster after the untagged clear");
    // The tenant stores again.
    put(&local, &n, &local_v);
    assert_exact(&local, &n, &local_v, "local after storing again");
}

/// A token holder asks the master to place and commit a local tenant's key: refused, naming
/// the key, so the directory never points readers at a key the data ports do not serve.
#[test]
fn the_master_places_and_commits_only_cluster_keys() {
    let node = Node::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut member = rt
        .block_on(kvtier_client::cluster::master::connect(
            &node.master,
            kvtier_client::cluster::master::MasterCredential::new(TOKEN.as_bytes().to_vec()),
            Duration::from_secs(2),
        ))
        .unwrap();
    let local = local_key(TENANT, b"secret-000");
    let refused = |status: tonic::Status| {
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains("outside the cluster namespace")
                && status.message().contains("secret-000"),
            "{status:?}"
        );
    };
    let place = rt.block_on(member.place_puts(PlacePutsRequest {
        client_node_id: "node-a".into(),
        keys: vec![local.clone()],
        sizes: vec![LEN as u64],
        ..Default::default()
    }));
    refused(place.unwrap_err());
    let commit = rt.block_on(member.commit_puts(CommitPutsRequest {
        claim: 0,
        keys: vec![local],
        stored: vec![NodeList { nodes: vec![0] }],
        target_node_id: String::new(),
    }));
    refused(commit.unwrap_err());
    // A cluster key is placed as before.
    let mut cluster_key = cluster_prefix(TENANT);
    cluster_key.extend_from_slice(b"page-000");
    let placed = rt
        .block_on(member.place_puts(PlacePutsRequest {
            client_node_id: "node-a".into(),
            keys: vec![cluster_key],
            sizes: vec![LEN as u64],
            ..Default::default()
        }))
        .unwrap()
        .into_inner();
    assert_eq!(placed.placements.len(), 1);
}

/// Open a session of `tenant` on `socket` with raw frames: the server's refusal (`None`:
/// opened).
fn raw_open_session(socket: &Path, tenant: &str) -> Option<kvtier_proto::ErrorReply> {
    use kvtier_proto::Decode;
    use std::io::Write;
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut body = Vec::new();
    let mut call = |opcode: Opcode, id: u64, message: &dyn kvtier_proto::Encode| {
        let mut out = Vec::new();
        kvtier_proto::encode_frame(&mut out, opcode, id, 0, message).unwrap();
        stream.write_all(&out).unwrap();
        let header = kvtier_proto::read_frame(&mut stream, &mut body).unwrap();
        (header.flags & kvtier_proto::frame::FLAG_ERROR != 0)
            .then(|| kvtier_proto::ErrorReply::decode(&body).unwrap())
    };
    let hello = kvtier_proto::Handshake {
        version: kvtier_proto::frame::PROTOCOL_VERSION,
        client_name: "attacker".into(),
    };
    assert!(call(Opcode::Handshake, 1, &hello).is_none());
    let open = kvtier_proto::server::OpenSession {
        tenant: tenant.into(),
        client_name: "attacker".into(),
        join: None,
    };
    call(Opcode::OpenSession, 2, &open)
}

/// The trailer an attacker without the token could compute: every unkeyed or wrongly keyed
/// variant, 16 bytes as the reader expects.
fn forged_trailers(key: &[u8], value: &[u8]) -> Vec<(&'static str, [u8; CHECKSUM_LEN])> {
    let mut unkeyed = blake3::Hasher::new();
    unkeyed.update(&(key.len() as u64).to_le_bytes());
    unkeyed.update(key);
    unkeyed.update(value);
    let mut blake = [0u8; CHECKSUM_LEN];
    blake.copy_from_slice(&unkeyed.finalize().as_bytes()[..CHECKSUM_LEN]);
    let mut xxh = xxhash_rust::xxh3::Xxh3::new();
    xxh.update(&(key.len() as u64).to_le_bytes());
    xxh.update(key);
    xxh.update(value);
    vec![
        ("unkeyed BLAKE3", blake),
        ("XXH3-128", xxh.digest128().to_le_bytes()),
        (
            "the keyed trailer with another token",
            ObjectIntegrity::from_token(b"not-the-token").trailer(key, value),
        ),
    ]
}

#[test]
fn a_local_user_without_the_token_cannot_replace_or_plant_a_cluster_object() {
    let mut node = Node::start();
    let writer = node.cluster(Some(TENANT), true);
    let n = names("page", 12);
    let good = values(500, 12, LEN);
    put(&writer, &n, &good);

    // The attacker: local sessions without the token, as the tenant of the cluster
    // namespace's name and as the empty tenant naming the cluster key's very bytes. Each
    // removes the object and writes forged bytes followed by a recomputed trailer (the
    // length a cluster reader asks for), and plants objects under names never written.
    let full: Vec<Vec<u8>> = n
        .iter()
        .map(|k| [&cluster_prefix(TENANT)[..], k].concat())
        .collect();
    let attackers = [
        (node.local(TENANT), n.clone()),
        (node.local(""), full.clone()),
    ];
    for (attacker, targets) in &attackers {
        attacker.remove_keys(targets);
        let forged: Vec<Vec<u8>> = targets
            .iter()
            .zip(&full)
            .enumerate()
            .map(|(i, (_, key))| {
                let value = object_bytes(9000 + i as u64, LEN);
                let (_, trailer) = forged_trailers(key, &value)[i % 3];
                [value, trailer.to_vec()].concat()
            })
            .collect();
        put(attacker, targets, &forged);
        let planted: Vec<Vec<u8>> = targets
            .iter()
            .map(|t| [&t[..], b"-planted"].concat())
            .collect();
        put(attacker, &planted, &forged);
    }

    // Readers beside the node and elsewhere get the written bytes; planted names are misses.
    for beside in [true, false] {
        let reader = node.cluster(Some(TENANT), beside);
        assert_exact(&reader, &n, &good, "cluster reader");
        let planted: Vec<Vec<u8>> = n.iter().map(|k| [&k[..], b"-planted"].concat()).collect();
        assert!(
            get(&reader, &planted, LEN).iter().all(Option::is_none),
            "a planted object was a hit"
        );
        assert_eq!(reader.cluster().unwrap().integrity_failures(), 0);
    }
    // The attacker's writes landed in its own namespace only.
    assert!(attackers[0].0.exists_keys(&n).iter().all(|&e| e));
    // Nor can it name the cluster namespace as its tenant: a session whose tenant holds the
    // kind marker's NUL or the separator is refused at open (raw frames, past any client-side
    // check).
    for tenant in ["\0Cteam-a", "\0C", "team-a\x1f\0C"] {
        let refusal = raw_open_session(&node.socket, tenant);
        assert!(
            refusal
                .as_ref()
                .is_some_and(|r| r.code == kvtier_proto::server::error_code::MALFORMED
                    && r.message.contains("NUL or 0x1f")),
            "tenant {tenant:?}: {refusal:?}"
        );
    }
    assert!(raw_open_session(&node.socket, "another-tenant").is_none());
    assert!(node.node.running());
}

#[test]
fn forged_bytes_with_a_recomputed_unkeyed_trailer_are_rejected() {
    let node = Node::start();
    let writer = node.cluster(Some(TENANT), true);
    let n = names("sum", 6);
    let good = values(700, 6, LEN);
    put(&writer, &n, &good);
    let keys: Vec<Vec<u8>> = n
        .iter()
        .map(|k| writer.cluster().unwrap().namespaced(k))
        .collect();

    // A store the test writes into directly, served by a real data port registered as a
    // node (an attacker who reached a node's memory or disk, or an on-path rewriter).
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
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut holder = rt
        .block_on(kvtier_client::cluster::master::connect(
            &node.master,
            kvtier_client::cluster::master::MasterCredential::new(TOKEN.as_bytes().to_vec()),
            Duration::from_secs(2),
        ))
        .unwrap();
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
    let store_with = |key: &[u8], value: &[u8], trailer: &[u8]| {
        store
            .put_slice(key, &[value, trailer].concat(), None)
            .unwrap();
    };
    // Objects 0-2: forged bytes under each unkeyed trailer; 3-4: the right bytes under an
    // unkeyed trailer (a forger cannot even re-seal genuine bytes); 5: a token holder's copy.
    for (i, key) in keys.iter().enumerate() {
        match i {
            0..=2 => {
                let forged = object_bytes(4242 + i as u64, LEN);
                store_with(key, &forged, &forged_trailers(key, &forged)[i].1);
            }
            3 | 4 => store_with(key, &good[i], &forged_trailers(key, &good[i])[i - 3].1),
            _ => store_with(
                key,
                &good[i],
                &ObjectIntegrity::from_token(TOKEN.as_bytes()).trailer(key, &good[i]),
            ),
        }
    }
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

    // A reader beside the forger reads it first: five failures counted, node-a's copies read
    // instead, every hit byte-exact.
    let reader = node.cluster(Some(TENANT), false);
    let beside = Client::open(KvtierConfig {
        extra_backend_tag: Some(TENANT.into()),
        ..cluster_config(&node.master, Some("node-m"))
    })
    .unwrap();
    assert_exact(&beside, &n, &good, "reader beside the forger");
    assert_eq!(beside.cluster().unwrap().integrity_failures(), 5);
    assert_eq!(port.counters().gets.load(Ordering::Relaxed), 6);
    assert_exact(&reader, &n, &good, "reader elsewhere");

    // An object whose only copy is forged under an unkeyed trailer: a clean miss.
    let only = writer.cluster().unwrap().namespaced(b"only-forged");
    let place = rt
        .block_on(holder.place_puts(PlacePutsRequest {
            client_node_id: "node-m".into(),
            namespace: TENANT.into(),
            keys: vec![only.clone()],
            sizes: vec![(LEN + CHECKSUM_LEN) as u64],
            ..Default::default()
        }))
        .unwrap()
        .into_inner();
    let forged = object_bytes(31337, LEN);
    store_with(&only, &forged, &forged_trailers(&only, &forged)[0].1);
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
    assert_eq!(get(&beside, &[b"only-forged".to_vec()], LEN), vec![None]);
    assert_eq!(beside.cluster().unwrap().integrity_failures(), 6);
    assert_exact(&writer, &n, &good, "the writer");
    port.shutdown();
}
