//! Attacks on the host's trust boundaries (docs/security.md, "Host"), each played against a
//! real `kvtier serve` process: the attacker fails, the server stays up, and a legitimate
//! client on the same server is served byte-exact.
#![allow(clippy::unwrap_used)]
#![allow(unsafe_code)] // test fixtures map shared memory and register raw regions

mod common;

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{object_bytes, wait_for, Memfd, Proc};
use kvtier_client::{Client, KvtierConfig, PageBatch};

/// A `kvtier serve` on a socket in `dir`, with extra flags.
fn serve(dir: &Path, extra: &[&str], envs: &[(&str, &str)]) -> (Proc, PathBuf) {
    let socket = dir.join("kvtier.sock");
    let mut args = vec![
        "serve",
        "--socket",
        socket.to_str().unwrap(),
        "--dram-capacity",
        "64MiB",
    ];
    args.extend_from_slice(extra);
    let server = Proc::spawn("kvtier serve", &args, envs);
    wait_for(Duration::from_secs(20), "the server socket", || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    (server, socket)
}

fn server_client(socket: &Path, tenant: &str) -> Client {
    Client::open(KvtierConfig {
        server_socket: Some(socket.display().to_string()),
        extra_backend_tag: (!tenant.is_empty()).then(|| tenant.to_string()),
        ..KvtierConfig::default()
    })
    .expect("open a server-mode client")
}

fn keys(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{prefix}-{i}").into_bytes())
        .collect()
}

fn batch(keys: &[Vec<u8>]) -> PageBatch<'_, Vec<u8>, [u8; 0]> {
    PageBatch {
        prefix: &[],
        page_keys: keys,
        suffixes: &[[]],
    }
}

const OBJECT: usize = 256 << 10;
const OBJECTS: usize = 16;

/// The legitimate client's round: put 16 distinct objects from its memfd pool, read them back
/// into a zeroed pool, compare every byte.
fn legit_round(client: &Client, pool: &mut Memfd, round: usize) {
    let names = keys(&format!("legit-r{round}"), OBJECTS);
    for (i, chunk) in pool.bytes().chunks_mut(OBJECT).enumerate() {
        chunk.copy_from_slice(&object_bytes((round * 1000 + i) as u64, OBJECT));
    }
    let put = client.put_pages(&batch(&names), &pool.refs(OBJECT), None);
    assert!(put.ok.iter().all(|&ok| ok), "legit put: {:?}", put.errors);
    pool.bytes().fill(0);
    let got = client.get_pages(&batch(&names), &pool.refs(OBJECT));
    assert!(got.ok.iter().all(|&ok| ok), "legit get: {:?}", got.errors);
    for (i, chunk) in pool.bytes().chunks(OBJECT).enumerate() {
        assert!(
            chunk == object_bytes((round * 1000 + i) as u64, OBJECT).as_slice(),
            "legit object {i} of round {round} is not byte-exact"
        );
    }
}

fn stats(socket: &Path) -> serde_json::Value {
    kvtier_server::cli::fetch_stats(socket).expect("stats")
}

/// The number of open connections, if the stats connection itself is admitted.
fn open_connections(socket: &Path) -> Option<u64> {
    kvtier_server::cli::fetch_stats(socket)
        .ok()
        .and_then(|doc| doc["server"]["connections"].as_u64())
}

/// An attacker registers an unsealable memfd, stores pages from it, then truncates it while
/// (and before) the server copies its gets and puts. Without the guard the server died of
/// SIGBUS; now only the attacker's pages fail, nothing it half-wrote is stored, and a second
/// client is served byte-exact before, during and after.
#[test]
fn memfd_shrink_during_gets_and_puts_cannot_kill_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, socket) = serve(dir.path(), &[], &[]);
    let legit = server_client(&socket, "legit");
    let mut legit_pool = Memfd::new(OBJECT * OBJECTS, false);
    legit_pool.register(&legit);
    legit_round(&legit, &mut legit_pool, 0);

    let attacker = server_client(&socket, "evil");
    let mut evil_pool = Memfd::new(OBJECT * OBJECTS, false);
    for (i, chunk) in evil_pool.bytes().chunks_mut(OBJECT).enumerate() {
        chunk.copy_from_slice(&object_bytes(50_000 + i as u64, OBJECT));
    }
    evil_pool.register(&attacker);
    let stored = keys("evil-stored", OBJECTS);
    let put = attacker.put_pages(&batch(&stored), &evil_pool.refs(OBJECT), None);
    assert!(put.ok.iter().all(|&ok| ok), "{:?}", put.errors);

    // Shrink while the server copies: a thread truncates to zero and grows back, in a loop,
    // while the attacker puts and gets (this process never touches its own mapping again).
    let fd = evil_pool.fd.try_clone().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let shrinker = {
        let stop = std::sync::Arc::clone(&stop);
        let len = evil_pool.len as u64;
        std::thread::spawn(move || {
            let mut rounds = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && rounds < 200_000 {
                let _ = rustix::fs::ftruncate(&fd, 0);
                std::thread::yield_now();
                let _ = rustix::fs::ftruncate(&fd, len);
                rounds += 1;
            }
            let _ = rustix::fs::ftruncate(&fd, 0);
        })
    };
    for round in 0..20 {
        let names = keys(&format!("evil-r{round}"), OBJECTS);
        let _ = attacker.put_pages(&batch(&names), &evil_pool.refs(OBJECT), None);
        let _ = attacker.get_pages(&batch(&stored), &evil_pool.refs(OBJECT));
        if round % 5 == 0 {
            legit_round(&legit, &mut legit_pool, round + 1);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    shrinker.join().unwrap();
    // Now the memfd is empty for good: every further copy faults, deterministically.
    let late = keys("evil-late", OBJECTS);
    let put = attacker.put_pages(&batch(&late), &evil_pool.refs(OBJECT), None);
    assert!(
        put.ok.iter().all(|&ok| !ok),
        "a put from a truncated memfd succeeded"
    );
    let got = attacker.get_pages(&batch(&stored), &evil_pool.refs(OBJECT));
    assert!(
        got.ok.iter().all(|&ok| !ok),
        "a get into a truncated memfd succeeded"
    );
    assert!(
        // A shrunk memfd is revoked, or (issue 26) its pages are holes the server refuses to
        // fill on the client's behalf: either way the failure names the region's problem.
        got.errors
            .iter()
            .any(|e| e.contains("revoked") || e.contains("no memory behind them")),
        "the failure names the revoked region: {:?}",
        got.errors
    );
    assert!(server.running(), "kvtier serve died");
    // Nothing read from the revoked memory was stored.
    assert!(attacker.exists_keys(&late).iter().all(|&e| !e));
    let doc = stats(&socket);
    // Issue 26: holes of the shrunk memfd are refused (mincore) before any copy, so the server
    // may never take a fault to recover from; the counter exists and nothing died.
    assert!(
        doc["server"]["recovered_faults"].as_u64().is_some(),
        "{doc}"
    );
    let evil = doc["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["tenant"] == "evil")
        .expect("the attacker's session")
        .clone();
    // Revoked on a fault, or its holes refused before any copy (issue 26): either is counted.
    assert!(
        evil["revoked_regions"] == 1 || evil["rejected_buffers"].as_u64().unwrap_or(0) > 0,
        "{evil}"
    );
    // The legitimate client, on the same server, after all of it.
    legit_round(&legit, &mut legit_pool, 99);
    drop(attacker);
    drop(legit);
    assert!(server.running());
    server.terminate(Duration::from_secs(10));
}

/// A memfd that allows sealing is sealed by the server at registration: the attacker's shrink
/// itself fails (EPERM), and the pool keeps working.
#[test]
fn sealable_memfd_is_sealed_before_it_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, socket) = serve(dir.path(), &[], &[]);
    let client = server_client(&socket, "");
    let mut pool = Memfd::new(OBJECT * OBJECTS, true);
    pool.register(&client);
    let seals = rustix::fs::fcntl_get_seals(&pool.fd).unwrap();
    assert!(seals.contains(rustix::fs::SealFlags::SHRINK), "{seals:?}");
    assert!(
        rustix::fs::ftruncate(&pool.fd, 0).is_err(),
        "shrink allowed"
    );
    legit_round(&client, &mut pool, 0);
    assert!(server.running());
    let doc = stats(&socket);
    assert_eq!(doc["sessions"][0]["unsealed_regions"], 0, "{doc}");
}

/// Put `n` objects of `len` bytes (content `object_bytes(seed + i)`) under `names` through
/// `client`'s staging path, and return the pool for reading back.
fn put_objects(client: &Client, names: &[Vec<u8>], seed: u64, len: usize) {
    let mut pool = common::Pool::new(names.len(), len);
    for (i, chunk) in pool.bytes.chunks_mut(len).enumerate() {
        chunk.copy_from_slice(&object_bytes(seed + i as u64, len));
    }
    let _registered = pool.register(client);
    let put = client.put_keys(names, &pool.refs(), None);
    assert!(put.ok.iter().all(|&ok| ok), "{:?}", put.errors);
}

/// Every object under `names` reads back as `object_bytes(seed + i)`.
fn assert_objects(client: &Client, names: &[Vec<u8>], seed: u64, len: usize) {
    let pool = common::Pool::new(names.len(), len);
    let _registered = pool.register(client);
    let got = client.get_keys(names, &pool.refs());
    assert!(got.ok.iter().all(|&ok| ok), "{:?}", got.errors);
    for (i, chunk) in pool.bytes.chunks(len).enumerate() {
        assert!(
            chunk == object_bytes(seed + i as u64, len).as_slice(),
            "object {i} is not byte-exact"
        );
    }
}

/// `Clear` from one tenant removes that tenant's namespace only: the shared main store keeps
/// the other tenants' objects (the empty tenant's too), and a tenant with its own partition
/// is not reached by another tenant's clear, nor does its clear reach the main store.
#[test]
fn clear_removes_only_the_callers_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, socket) = serve(dir.path(), &["--tenant-quota", "part=8MiB"], &[]);
    let len = 64 << 10;
    let tenants = ["a", "b", "", "part"];
    let clients: Vec<Client> = tenants.iter().map(|t| server_client(&socket, t)).collect();
    let names = keys("page", 32);
    for (i, client) in clients.iter().enumerate() {
        put_objects(client, &names, 1000 * i as u64, len);
    }
    // The attacker (tenant "a") clears: only its own keys go.
    clients[0].clear();
    assert!(
        clients[0].exists_keys(&names).iter().all(|&e| !e),
        "a's keys survived its clear"
    );
    for (i, client) in clients.iter().enumerate().skip(1) {
        assert_objects(client, &names, 1000 * i as u64, len);
    }
    // The empty tenant's clear does not reach "b" or the partition either.
    clients[2].clear();
    assert!(clients[2].exists_keys(&names).iter().all(|&e| !e));
    assert_objects(&clients[1], &names, 1000, len);
    assert_objects(&clients[3], &names, 3000, len);
    // The partition tenant clears its partition; "b" in the main store is untouched.
    clients[3].clear();
    assert!(clients[3].exists_keys(&names).iter().all(|&e| !e));
    assert_objects(&clients[1], &names, 1000, len);
    // A cleared tenant stores again.
    put_objects(&clients[0], &names, 7000, len);
    assert_objects(&clients[0], &names, 7000, len);
    assert!(server.running());
}

/// On a cluster node, a cluster client without `extra_backend_tag` clearing the cluster
/// (SGLang's `/clear_hicache_storage_backend`) removes the untagged cluster namespace only:
/// the local-socket tenants sharing the node's store keep their objects byte-exact.
#[test]
fn cluster_clear_does_not_reach_local_tenants_of_a_node() {
    let dir = tempfile::tempdir().unwrap();
    let port = common::free_port("127.0.0.1");
    let master_addr = format!("127.0.0.1:{port}");
    let _master = common::spawn_master(&master_addr, 1000, &[]);
    let opts = common::NodeOpts::new(dir.path(), &master_addr, "node-a", "127.0.0.1");
    let _node = opts.spawn();
    let socket = dir.path().join("node-a.sock");
    wait_for(Duration::from_secs(20), "node registration", || {
        common::all_registered(&master_addr, &[("node-a".into(), opts.data.clone())])
    });
    let len = 32 << 10;
    let names = keys("page", 24);
    let local_default = server_client(&socket, "");
    let local_tenant = server_client(&socket, "t");
    put_objects(&local_default, &names, 100, len);
    put_objects(&local_tenant, &names, 200, len);
    let cluster = common::cluster_client(&master_addr, None);
    let cluster_names = keys("cluster-page", 24);
    put_objects(&cluster, &cluster_names, 300, len);
    assert_objects(&cluster, &cluster_names, 300, len);
    cluster.clear();
    assert!(cluster.exists_keys(&cluster_names).iter().all(|&e| !e));
    assert_objects(&local_default, &names, 100, len);
    assert_objects(&local_tenant, &names, 200, len);
}

/// Environment variable that turns this test binary into the rogue listener of
/// [`client_refuses_a_server_of_another_uid`] (run as another uid).
const ROGUE_ENV: &str = "KVTIER_TEST_ROGUE_SOCKET";

/// The rogue listener: binds the socket path, accepts one connection, and records how many
/// bytes and descriptors the client sent before hanging up (`bytes fds` in `<socket>.log`).
#[test]
fn rogue_listener_helper() {
    let Ok(path) = std::env::var(ROGUE_ENV) else {
        return; // an ordinary test run: nothing to do
    };
    use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    use std::io::IoSliceMut;
    use std::mem::MaybeUninit;
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    std::fs::write(format!("{path}.ready"), b"").unwrap();
    let (stream, _) = listener.accept().unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let (mut bytes, mut fds) = (0usize, 0usize);
    loop {
        let mut buf = [0u8; 4096];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut buf)];
        match recvmsg(&stream, &mut iov, &mut control, RecvFlags::empty()) {
            Ok(got) if got.bytes > 0 => {
                bytes += got.bytes;
                for message in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(received) = message {
                        fds += received.count();
                    }
                }
            }
            _ => break,
        }
    }
    std::fs::write(format!("{path}.log"), format!("{bytes} {fds}")).unwrap();
}

/// A process of another user listening on the configured socket path gets nothing: the client
/// checks the listener's uid (`SO_PEERCRED`) before its first byte, so no handshake and no
/// memfd reach it, and opening the store fails with the reason. The real server (same uid)
/// on another path serves the same client configuration.
#[test]
fn client_refuses_a_server_of_another_uid() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to run the rogue listener as another uid");
        return;
    }
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let socket = shared.join("kvtier.sock");
    let mut rogue = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "rogue_listener_helper",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(ROGUE_ENV, &socket)
        .uid(65534)
        .gid(65534)
        .spawn()
        .unwrap();
    wait_for(Duration::from_secs(20), "the rogue listener", || {
        shared.join("kvtier.sock.ready").exists()
    });
    let refused = Client::open(KvtierConfig {
        server_socket: Some(socket.display().to_string()),
        ..KvtierConfig::default()
    });
    let error = refused
        .err()
        .expect("a client accepted a server of uid 65534")
        .to_string();
    assert!(error.contains("uid 65534"), "{error}");
    let status = rogue.wait().unwrap();
    assert!(status.success());
    let log = std::fs::read_to_string(shared.join("kvtier.sock.log")).unwrap();
    assert_eq!(log, "0 0", "the rogue received bytes/descriptors: {log}");
    // The same configuration against the real server works and round-trips a memfd pool.
    let (mut server, real) = serve(dir.path(), &[], &[]);
    let client = server_client(&real, "");
    let mut pool = Memfd::new(OBJECT * OBJECTS, false);
    pool.register(&client);
    legit_round(&client, &mut pool, 0);
    assert!(server.running());
}

/// The per-user directory of the default socket is created 0700, and one another user
/// planted (owned by someone else, group/other accessible, or a symlink) is refused.
#[test]
fn default_socket_directory_is_private_and_checked() {
    use kvtier_server::config::ensure_private_dir;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let fresh = dir.path().join("fresh");
    ensure_private_dir(&fresh).unwrap();
    assert_eq!(std::fs::metadata(&fresh).unwrap().mode() & 0o777, 0o700);
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, PermissionsExt::from_mode(0o1777)).unwrap();
    assert!(ensure_private_dir(&open).is_err());
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&fresh, &link).unwrap();
    assert!(ensure_private_dir(&link).is_err());
    if rustix::process::geteuid().is_root() {
        let foreign = dir.path().join("foreign");
        std::fs::create_dir(&foreign).unwrap();
        std::fs::set_permissions(&foreign, PermissionsExt::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
        let error = ensure_private_dir(&foreign).unwrap_err().to_string();
        assert!(error.contains("65534"), "{error}");
    }
}

/// A raw protocol connection (what a hostile client can send).
struct Raw {
    stream: std::os::unix::net::UnixStream,
    next: u64,
    body: Vec<u8>,
}

impl Raw {
    fn connect(socket: &Path) -> Raw {
        let stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Raw {
            stream,
            next: 1,
            body: Vec::new(),
        }
    }

    fn call(
        &mut self,
        opcode: kvtier_proto::Opcode,
        message: &dyn kvtier_proto::Encode,
    ) -> Result<Vec<u8>, kvtier_proto::ErrorReply> {
        use std::io::Write;
        let mut out = Vec::new();
        kvtier_proto::encode_frame(&mut out, opcode, self.next, 0, message).unwrap();
        self.next += 1;
        self.stream.write_all(&out).unwrap();
        self.reply()
    }

    fn reply(&mut self) -> Result<Vec<u8>, kvtier_proto::ErrorReply> {
        use kvtier_proto::Decode;
        let header = kvtier_proto::read_frame(&mut self.stream, &mut self.body).unwrap();
        if header.flags & kvtier_proto::frame::FLAG_ERROR != 0 {
            Err(kvtier_proto::ErrorReply::decode(&self.body).unwrap())
        } else {
            Ok(self.body.clone())
        }
    }

    fn hello(&mut self) {
        self.call(
            kvtier_proto::Opcode::Handshake,
            &kvtier_proto::Handshake {
                version: kvtier_proto::frame::PROTOCOL_VERSION,
                client_name: "raw".into(),
            },
        )
        .unwrap();
    }

    fn open(
        &mut self,
        join: Option<kvtier_proto::server::SessionTicket>,
    ) -> kvtier_proto::server::SessionTicket {
        use kvtier_proto::Decode;
        let body = self
            .call(
                kvtier_proto::Opcode::OpenSession,
                &kvtier_proto::server::OpenSession {
                    tenant: String::new(),
                    client_name: "raw".into(),
                    join,
                },
            )
            .unwrap();
        kvtier_proto::server::SessionTicket::decode(&body).unwrap()
    }

    fn register(&mut self, fd: &OwnedFd, len: u64) -> Result<u64, kvtier_proto::ErrorReply> {
        use kvtier_proto::Decode;
        use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        use std::io::Write;
        let mut out = Vec::new();
        kvtier_proto::encode_frame(
            &mut out,
            kvtier_proto::Opcode::RegisterRegion,
            self.next,
            0,
            &kvtier_proto::server::RegisterRegion {
                label: "raw".into(),
                fd_offset: 0,
                len,
            },
        )
        .unwrap();
        self.next += 1;
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds = [fd.as_fd()];
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        let sent = sendmsg(
            &self.stream,
            &[std::io::IoSlice::new(&out)],
            &mut control,
            SendFlags::empty(),
        )
        .unwrap();
        self.stream.write_all(&out[sent..]).unwrap();
        self.reply().map(|b| {
            kvtier_proto::server::RegionGrant::decode(&b)
                .unwrap()
                .region
        })
    }

    /// Whether the server closed this connection (EOF or reset) within `limit`.
    fn closed_within(&mut self, limit: Duration) -> bool {
        use std::io::Read;
        self.stream.set_read_timeout(Some(limit)).unwrap();
        let mut byte = [0u8; 1];
        matches!(self.stream.read(&mut byte), Ok(0) | Err(_))
            && !matches!(
                self.stream.read(&mut byte),
                Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock
            )
    }
}

/// A memfd of `len` bytes, never written (sparse: no memory behind it).
fn sparse_memfd(len: u64) -> OwnedFd {
    let fd = rustix::fs::memfd_create("sparse", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    fd
}

/// Resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

/// A 3 GiB sparse memfd: refused outright under a 256 MiB per-client limit (checked before
/// anything is mapped), and under the default limits accepted but not pre-faulted, so the
/// server commits nothing on the client's behalf. The server keeps serving.
#[test]
fn sparse_big_memfd_is_refused_or_costs_the_server_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let limited = dir.path().join("limited");
    std::fs::create_dir(&limited).unwrap();
    let (mut server, socket) = serve(
        &limited,
        &[],
        &[("KVTIER_SERVE_MAX_MAPPED_BYTES_PER_CLIENT", "256MiB")],
    );
    let before = rss(server.child.id());
    let mut raw = Raw::connect(&socket);
    raw.hello();
    raw.open(None);
    let refused = raw.register(&sparse_memfd(3 << 30), 3 << 30).unwrap_err();
    assert!(
        refused.message.contains("max_mapped_bytes_per_client"),
        "{}",
        refused.message
    );
    assert!(rss(server.child.id()) < before + (64 << 20));
    let client = server_client(&socket, "");
    let mut pool = Memfd::new(OBJECT * OBJECTS, false);
    pool.register(&client);
    legit_round(&client, &mut pool, 0);

    let defaults = dir.path().join("defaults");
    std::fs::create_dir(&defaults).unwrap();
    let (mut server2, socket2) = serve(&defaults, &[], &[]);
    let before = rss(server2.child.id());
    let mut raw = Raw::connect(&socket2);
    raw.hello();
    raw.open(None);
    raw.register(&sparse_memfd(3 << 30), 3 << 30).unwrap();
    let grown = rss(server2.child.id()).saturating_sub(before);
    assert!(
        grown < 64 << 20,
        "the server committed {grown} bytes for a sparse memfd"
    );
    assert!(server.running() && server2.running());
}

/// Twelve connections of one session register 64 MiB each at the same instant under a
/// 256 MiB per-client limit: exactly four are granted (the limit is reserved atomically
/// before mapping, not checked before and counted after), and the server-wide cap holds
/// across sessions.
#[test]
fn concurrent_registrations_cannot_exceed_the_limits() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, socket) = serve(
        dir.path(),
        &[],
        &[
            ("KVTIER_SERVE_MAX_MAPPED_BYTES_PER_CLIENT", "256MiB"),
            ("KVTIER_SERVE_MAX_MAPPED_BYTES_TOTAL", "384MiB"),
        ],
    );
    let region: u64 = 64 << 20;
    let mut keeper = Raw::connect(&socket);
    keeper.hello();
    let ticket = keeper.open(None);
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(12));
    let threads: Vec<_> = (0..12)
        .map(|_| {
            let socket = socket.clone();
            let barrier = std::sync::Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut raw = Raw::connect(&socket);
                raw.hello();
                raw.open(Some(ticket));
                let fd = sparse_memfd(region);
                barrier.wait();
                let granted = raw.register(&fd, region).is_ok();
                (granted, raw)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect::<Vec<_>>();
    let granted = threads.iter().filter(|(g, _)| *g).count();
    assert_eq!(
        granted, 4,
        "{granted} of 12 concurrent 64 MiB registrations granted"
    );
    let doc = stats(&socket);
    assert_eq!(doc["server"]["mapped_bytes"], 256u64 << 20, "{doc}");
    // A second session: the server-wide 384 MiB leaves it 128 MiB.
    let mut other = Raw::connect(&socket);
    other.hello();
    other.open(None);
    assert!(other.register(&sparse_memfd(region), region).is_ok());
    assert!(other.register(&sparse_memfd(region), region).is_ok());
    let refused = other.register(&sparse_memfd(region), region).unwrap_err();
    assert!(
        refused.message.contains("max_mapped_bytes_total"),
        "{}",
        refused.message
    );
    // Closing the first session returns its reservation.
    drop(threads);
    drop(keeper);
    wait_for(Duration::from_secs(10), "the session's release", || {
        stats(&socket)["server"]["mapped_bytes"] == 128u64 << 20
    });
    assert!(other.register(&sparse_memfd(region), region).is_ok());
    assert!(server.running());
}

/// Connections that never complete a handshake and a session (silent, or trickling a byte at
/// a time) are closed after `handshake_timeout_ms`; a session's idle keeper connection is
/// not, and the legitimate client works throughout.
#[test]
fn idle_connections_without_a_session_time_out() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let (mut server, socket) = serve(
        dir.path(),
        &[],
        &[("KVTIER_SERVE_HANDSHAKE_TIMEOUT_MS", "500")],
    );
    let client = server_client(&socket, "");
    let mut pool = Memfd::new(OBJECT * OBJECTS, false);
    pool.register(&client);
    let mut silent: Vec<Raw> = (0..16).map(|_| Raw::connect(&socket)).collect();
    let mut handshaken = Raw::connect(&socket);
    handshaken.hello();
    let mut trickle = Raw::connect(&socket);
    let header = kvtier_proto::FrameHeader::new(kvtier_proto::Opcode::Handshake, 1, 0, 64).encode();
    let started = std::time::Instant::now();
    let mut trickle_closed = false;
    for byte in header.iter() {
        if trickle.stream.write_all(&[*byte]).is_err() {
            trickle_closed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        trickle_closed || trickle.closed_within(Duration::from_secs(2)),
        "a trickling connection outlived the handshake deadline"
    );
    assert!(started.elapsed() < Duration::from_secs(4));
    for raw in &mut silent {
        assert!(
            raw.closed_within(Duration::from_secs(2)),
            "a silent connection stayed open"
        );
    }
    assert!(
        handshaken.closed_within(Duration::from_secs(2)),
        "handshake without a session stayed"
    );
    wait_for(Duration::from_secs(5), "connections released", || {
        open_connections(&socket).is_some_and(|n| n < 6)
    });
    // The legitimate client's session connections idled past the deadline and still work.
    legit_round(&client, &mut pool, 1);
    assert!(server.running());
}

/// One uid may hold at most `max_connections_per_uid` connections; the next is refused with
/// an error naming the limit, and closing some lets new ones in.
#[test]
fn connections_per_uid_are_capped() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, socket) = serve(
        dir.path(),
        &[],
        &[("KVTIER_SERVE_MAX_CONNECTIONS_PER_UID", "8")],
    );
    // The readiness probes of serve() are gone once only the stats connection is open.
    wait_for(
        Duration::from_secs(5),
        "the probe connections to close",
        || open_connections(&socket) == Some(1),
    );
    let mut held: Vec<Raw> = (0..8)
        .map(|_| {
            let mut raw = Raw::connect(&socket);
            raw.hello();
            raw
        })
        .collect();
    let mut extra = Raw::connect(&socket);
    let refused = extra.reply().unwrap_err();
    assert!(
        refused.message.contains("max_connections_per_uid"),
        "{}",
        refused.message
    );
    held.truncate(2);
    wait_for(
        Duration::from_secs(5),
        "the closed connections to be released",
        || open_connections(&socket).is_some_and(|n| n <= 3),
    );
    let client = server_client(&socket, "");
    let mut pool = Memfd::new(OBJECT * OBJECTS, false);
    pool.register(&client);
    legit_round(&client, &mut pool, 0);
    assert!(server.running());
}

/// Sixteen connections each send a 48 MiB frame, then idle: the server releases each
/// connection's frame buffer after the request instead of keeping 16 x 48 MiB.
#[test]
fn large_frames_do_not_leave_idle_connections_holding_memory() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let (mut server, socket) = serve(dir.path(), &[], &[]);
    let before = rss(server.child.id());
    let big = vec![0x41u8; 48 << 20];
    let mut conns = Vec::new();
    for _ in 0..16 {
        let mut raw = Raw::connect(&socket);
        raw.hello();
        raw.open(None);
        let header = kvtier_proto::FrameHeader::new(
            kvtier_proto::Opcode::BatchExists,
            99,
            0,
            big.len() as u32,
        )
        .encode();
        raw.stream.write_all(&header).unwrap();
        raw.stream.write_all(&big).unwrap();
        // An undecodable body: refused, connection kept.
        assert!(raw.reply().is_err());
        conns.push(raw);
    }
    let grown = rss(server.child.id()).saturating_sub(before);
    assert!(
        grown < 128 << 20,
        "16 idle connections keep {} MiB after 48 MiB frames",
        grown >> 20
    );
    let client = server_client(&socket, "");
    let mut pool = Memfd::new(OBJECT * OBJECTS, false);
    pool.register(&client);
    legit_round(&client, &mut pool, 0);
    assert!(server.running());
}

/// Environment variable that turns this test binary into the impersonating client of
/// [`tenants_are_bound_to_credentials_and_listings_to_operators`].
const IMPERSONATE_ENV: &str = "KVTIER_TEST_IMPERSONATE_SOCKET";

/// The impersonator (run as uid 65534): tries to open the bound tenant, then opens its own
/// tenant and asks for `Stats` and `Inspect`; writes what it got to `<socket>.report`.
#[test]
fn impersonation_helper() {
    let Ok(path) = std::env::var(IMPERSONATE_ENV) else {
        return; // an ordinary test run: nothing to do
    };
    let socket = PathBuf::from(&path);
    let mut report = serde_json::Map::new();
    let bound = Client::open(KvtierConfig {
        server_socket: Some(path.clone()),
        extra_backend_tag: Some("secret".into()),
        server_uid: Some("0".into()),
        ..KvtierConfig::default()
    });
    report.insert(
        "bound_tenant".into(),
        serde_json::json!(bound.err().map(|e| e.to_string())),
    );
    let own = server_client_as_other_user(&socket);
    // Stats on a session of its own (tenant ""), as the guest sees them.
    let mut raw = Raw::connect(&socket);
    raw.hello();
    raw.open(None);
    let body = raw
        .call(
            kvtier_proto::Opcode::Stats,
            &kvtier_client::remote::EmptyBody,
        )
        .unwrap();
    let text = <kvtier_proto::server::TextReply as kvtier_proto::Decode>::decode(&body).unwrap();
    let stats: serde_json::Value = serde_json::from_str(&text.text).unwrap();
    report.insert("stats".into(), stats);
    drop(own);
    let inspect = kvtier_server::cli::fetch_inspect(
        &socket,
        &kvtier_proto::server::InspectQuery {
            keys: Vec::new(),
            prefix: Some(Vec::new()),
            limit: 100,
        },
    );
    report.insert("inspect".into(), serde_json::json!(inspect.err()));
    std::fs::write(
        format!("{path}.report"),
        serde_json::Value::Object(report).to_string(),
    )
    .unwrap();
}

fn server_client_as_other_user(socket: &Path) -> Client {
    Client::open(KvtierConfig {
        server_socket: Some(socket.display().to_string()),
        extra_backend_tag: Some("guest".into()),
        // The server runs as root; this process is uid 65534.
        server_uid: Some("0".into()),
        ..KvtierConfig::default()
    })
    .expect("open the guest tenant")
}

/// `tenant_access` binds tenant "secret" to uid 4242: a process of uid 65534 cannot open it
/// (impersonation), sees only its own tenant's sessions in `Stats`, and is refused `Inspect`
/// (other tenants' keys); the server's own uid (an operator) sees everything, and the bound
/// tenant's objects stay byte-exact.
#[test]
fn tenants_are_bound_to_credentials_and_listings_to_operators() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to run the impersonator as another uid");
        return;
    }
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let (mut server, socket) = serve(
        &shared,
        &["--socket-mode", "0666"],
        &[("KVTIER_SERVE_TENANT_ACCESS", "secret=uid:4242")],
    );
    // The operator (root) stores objects in the bound tenant.
    let owner = server_client(&socket, "secret");
    let names = keys("secret-page", 8);
    put_objects(&owner, &names, 500, 16 << 10);
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "impersonation_helper",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(IMPERSONATE_ENV, &socket)
        .uid(65534)
        .gid(65534)
        .status()
        .unwrap();
    assert!(status.success());
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(shared.join("kvtier.sock.report")).unwrap())
            .unwrap();
    let bound = report["bound_tenant"]
        .as_str()
        .expect("opening 'secret' was refused");
    assert!(bound.contains("tenant_access"), "{bound}");
    let sessions = report["stats"]["sessions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(!sessions.is_empty(), "{report}");
    assert!(
        sessions.iter().all(|s| s["tenant"] == ""),
        "the guest saw other tenants' sessions: {sessions:?}"
    );
    let inspect = report["inspect"].as_str().expect("Inspect was refused");
    assert!(inspect.contains("operator"), "{inspect}");
    // The operator sees the bound tenant's session and keys.
    let doc = stats(&socket);
    assert!(doc["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["tenant"] == "secret"));
    let listed = kvtier_server::cli::fetch_inspect(
        &socket,
        &kvtier_proto::server::InspectQuery {
            keys: Vec::new(),
            prefix: Some(b"secret\x1f".to_vec()),
            limit: 100,
        },
    )
    .unwrap();
    assert_eq!(listed["stores"][0]["prefix"].as_array().unwrap().len(), 8);
    assert_objects(&owner, &names, 500, 16 << 10);
    assert!(server.running());
}

/// A planted symlink `seg-000000.kvt -> victim` (and a planted checkpoint temp link) in the SSD
/// directory: kvtier never writes through it (the victim keeps its bytes and size), skips
/// and unlinks the entry with a warning, and the store starts and serves. A group- or
/// other-writable SSD directory, or one owned by another uid, is refused at start.
#[test]
fn planted_symlink_in_the_ssd_directory_is_never_followed() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let ssd = dir.path().join("ssd");
    std::fs::create_dir(&ssd).unwrap();
    std::fs::set_permissions(&ssd, PermissionsExt::from_mode(0o700)).unwrap();
    let victim = dir.path().join("victim.txt");
    std::fs::write(&victim, b"precious bytes").unwrap();
    std::os::unix::fs::symlink(&victim, ssd.join("seg-000000.kvt")).unwrap();
    std::os::unix::fs::symlink(&victim, ssd.join("index.ckpt.tmp")).unwrap();
    let ssd_flag = format!("ssd_storage_dir={}", ssd.display());
    let engine = [
        "--engine",
        "ssd_enabled=true",
        "--engine",
        ssd_flag.as_str(),
        "--engine",
        "ssd_capacity_bytes=64MiB",
        "--engine",
        "ssd_segment_size_bytes=4MiB",
        "--engine",
        "ssd_copy_async=false",
    ];
    let (mut server, socket) = serve(dir.path(), &engine, &[]);
    let client = server_client(&socket, "");
    let names = keys("ssd-page", 24);
    put_objects(&client, &names, 900, 64 << 10);
    client.flush().unwrap();
    assert_objects(&client, &names, 900, 64 << 10);
    drop(client);
    server.terminate(Duration::from_secs(10));
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious bytes");
    let segment = std::fs::symlink_metadata(ssd.join("seg-000000.kvt")).unwrap();
    assert!(
        segment.file_type().is_file(),
        "segment 0 is a file of ours again"
    );
    assert_eq!(segment.mode() & 0o777, 0o600);

    // Directories others could write to, or owned by another uid, are refused at start.
    std::fs::set_permissions(&ssd, PermissionsExt::from_mode(0o777)).unwrap();
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "serve",
            "--socket",
            dir.path().join("x.sock").to_str().unwrap(),
        ])
        .args(engine)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("group or others may write it"), "{stderr}");
    if rustix::process::geteuid().is_root() {
        std::fs::set_permissions(&ssd, PermissionsExt::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&ssd, Some(65534), Some(65534)).unwrap();
        let refused = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args([
                "serve",
                "--socket",
                dir.path().join("y.sock").to_str().unwrap(),
            ])
            .args(engine)
            .output()
            .unwrap();
        assert!(!refused.status.success());
        assert!(String::from_utf8_lossy(&refused.stderr).contains("owned by uid 65534"));
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious bytes");
}
