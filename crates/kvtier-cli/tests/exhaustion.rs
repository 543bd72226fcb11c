//! Issue 26 §3, "nothing a stranger or one member can exhaust", played against real
//! processes (`kvtier master`, `kvtier serve` nodes and servers) run under a small
//! `RLIMIT_NOFILE` (`prlimit`), with their stderr in files so the log volume is measured:
//!
//! - strangers (no token) hold 1,100 idle or preface-only connections to the master from 20
//!   source addresses while a member opens 288 RPC streams whose bodies never come: a new
//!   client is served at once, the node's heartbeats keep it alive, a restarted node registers
//!   again, the withheld streams end at the body deadline, the strangers are cut at the
//!   handshake deadline, and the master's log stays a few lines;
//! - a refusal storm on a node's data port and on the local socket: a few log lines, exact
//!   counters;
//! - another uid exhausting its per-uid caps on the local socket (connections, passed
//!   descriptors): the server's own uid and a third uid still connect and are served, and the
//!   server stays below its descriptor limit;
//! - a get into every slot of a 1 GiB sparse memfd: every page fails, the memfd stays without
//!   memory and the server's resident memory does not grow.
#![allow(clippy::unwrap_used)]
#![allow(unsafe_code)] // fixtures send descriptors (SCM_RIGHTS) and map shared memory

mod common;

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{
    all_registered, cluster_client, free_port, object_bytes, wait_for, NodeOpts, Proc, TOKEN,
};
use kvtier_client::{Client, KvtierConfig, MemRef, PageBatch};

/// `sh -c` wrapper arguments that run the rest of the command line with stderr appended to
/// `log` and, with `nofile`, under that descriptor limit (soft and hard).
fn wrapper(log: &Path, nofile: Option<u64>) -> Vec<String> {
    let limit = nofile.map_or(String::new(), |n| format!("prlimit --nofile={n} "));
    vec![
        "sh".into(),
        "-c".into(),
        format!("exec {limit}\"$@\" 2>>'{}'", log.display()),
        "sh".into(),
    ]
}

/// `kvtier <args>` under [`wrapper`].
fn spawn_logged(
    name: &str,
    log: &Path,
    nofile: Option<u64>,
    args: &[&str],
    envs: &[(&str, &str)],
) -> Proc {
    let w = wrapper(log, nofile);
    let mut all: Vec<&str> = w[1..].iter().map(String::as_str).collect();
    all.push(env!("CARGO_BIN_EXE_kvtier"));
    all.extend_from_slice(args);
    Proc::spawn_program("sh", name, &all, envs)
}

/// Lines of `log` containing `needle`.
fn lines_with(log: &Path, needle: &str) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

// ------------------------------------------------------------------------------------ master

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// `count` stranger connections to `master` from 127.0.0.10-29, every other one sending the
/// HTTP/2 preface and nothing more.
async fn stranger_flood(master: &str, count: usize) -> Vec<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt;
    let target: std::net::SocketAddr = master.parse().unwrap();
    let mut held = Vec::new();
    for i in 0..count {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        let source: std::net::SocketAddr = format!("127.0.0.{}:0", 10 + i % 20).parse().unwrap();
        socket.bind(source).unwrap();
        let Ok(Ok(mut stream)) =
            tokio::time::timeout(Duration::from_secs(2), socket.connect(target)).await
        else {
            continue; // refused or backlog full: nothing held
        };
        if i % 2 == 1 {
            let _ = stream.write_all(PREFACE).await;
        }
        held.push(stream);
    }
    held
}

/// Whether the peer closed `stream` (EOF or reset) within `limit`.
async fn closed_within(stream: &mut tokio::net::TcpStream, limit: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue, // the server's SETTINGS / GOAWAY frames
            Err(_) => return false,
        }
    }
}

type Withheld = (
    h2::client::SendRequest<bytes::Bytes>,
    Vec<(h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>)>,
);

/// A member's `conns` connections with `streams` RPC streams each: valid, fresh credentials,
/// request headers sent, bodies never.
async fn withhold_bodies(master: &str, conns: usize, streams: usize) -> Vec<Withheld> {
    let path = "/kvtier.master.v1.Master/Lookup";
    let mut out = Vec::new();
    for _ in 0..conns {
        let tcp = tokio::net::TcpStream::connect(master).await.unwrap();
        let (mut send, connection) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(connection);
        let mut open = Vec::new();
        for _ in 0..streams {
            send = send.ready().await.unwrap();
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64;
            let nonce =
                kvtier_proto::auth::nonce::<{ kvtier_proto::auth::RPC_NONCE_LEN }>().unwrap();
            let credential =
                kvtier_proto::auth::rpc_credential(TOKEN.as_bytes(), path, now, &nonce);
            let request = http::Request::builder()
                .method("POST")
                .uri(format!("http://{master}{path}"))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .header(kvtier_proto::auth::RPC_AUTH_HEADER, credential)
                .body(())
                .unwrap();
            let (response, body) = send.send_request(request, false).unwrap();
            open.push((response, body));
        }
        out.push((send, open));
    }
    out
}

/// Put `n` objects through a fresh cluster client of `master` and read them back byte-exact.
fn cluster_round(master: &str, prefix: &str, n: u64) {
    let client = cluster_client(master, None);
    let cluster = client.cluster().unwrap();
    let items: Vec<(Vec<u8>, Vec<u8>)> = (0..n)
        .map(|i| {
            (
                format!("{prefix}-{i}").into_bytes(),
                object_bytes(i + 77, 32 << 10),
            )
        })
        .collect();
    let keys: Vec<Vec<u8>> = items.iter().map(|(k, _)| cluster.namespaced(k)).collect();
    let values: Vec<Result<&[u8], String>> = items.iter().map(|(_, v)| Ok(&v[..])).collect();
    let put = cluster.put_objects(&keys, &values, &vec![None; keys.len()]);
    assert!(put.iter().all(|r| r.is_ok()), "{put:?}");
    let mut buffers: Vec<Vec<u8>> = items.iter().map(|(_, v)| vec![0u8; v.len()]).collect();
    let dsts: Vec<Result<&mut [u8], String>> = buffers.iter_mut().map(|b| Ok(&mut b[..])).collect();
    let got = cluster.get_objects(&keys, dsts);
    assert!(got.iter().all(|r| r.is_ok()), "{got:?}");
    for ((_, want), have) in items.iter().zip(&buffers) {
        assert!(want == have, "a hit with wrong bytes");
    }
}

/// The master and one node run with 1,024 descriptors. 1,100 stranger connections (idle or
/// preface-only, 20 source addresses) and 288 member streams with withheld bodies are held
/// open; meanwhile a new client is served, the node stays alive through three leases, and a
/// restarted node registers. Then the strangers are cut at the handshake deadline, the
/// withheld streams end at the body deadline, and the logs stayed a few lines. A refusal storm
/// on the node's data port (300 bad handshakes) is a few lines too.
#[test]
fn master_serves_clients_and_nodes_under_connection_and_stream_floods() {
    let dir = tempfile::tempdir().unwrap();
    let master_log = dir.path().join("master.log");
    let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let _master_proc = spawn_logged(
        "master",
        &master_log,
        Some(1024),
        &["master", "--listen", &master, "--lease-ms", "1000"],
        &[("KVTIER_CLUSTER_TOKEN", TOKEN)],
    );
    wait_for(Duration::from_secs(20), "the master", || {
        common::cluster_of(&master).is_some()
    });
    let node_log = dir.path().join("node.log");
    let node_wrapper = wrapper(&node_log, None);
    let node_wrapper: Vec<&str> = node_wrapper.iter().map(String::as_str).collect();
    let opts = NodeOpts::new(dir.path(), &master, "node-a", "127.0.0.2");
    let expected = [("node-a".to_string(), opts.data.clone())];
    let mut node = opts.spawn_under(&node_wrapper);
    wait_for(Duration::from_secs(20), "node-a registered", || {
        all_registered(&master, &expected)
    });

    let rt = runtime();
    let flood_started = Instant::now();
    let mut strangers = rt.block_on(stranger_flood(&master, 1100));
    let withheld = rt.block_on(withhold_bodies(&master, 9, 32));
    eprintln!(
        "test: {} stranger connections and 288 withheld streams in {:?}",
        strangers.len(),
        flood_started.elapsed()
    );

    // A new client is served while all of it is held.
    let started = Instant::now();
    cluster_round(&master, "during-flood", 8);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a new client took {:?}",
        started.elapsed()
    );
    // Heartbeats keep the node alive (lease 1 s) ...
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            all_registered(&master, &expected),
            "node-a dropped during the flood"
        );
    }
    // ... and a restarted node registers again.
    node.kill();
    wait_for(
        Duration::from_secs(10),
        "the master to drop the killed node",
        || !all_registered(&master, &expected),
    );
    let restarted = Instant::now();
    node = opts.spawn_under(&node_wrapper);
    wait_for(
        Duration::from_secs(15),
        "the restarted node registered",
        || all_registered(&master, &expected),
    );
    eprintln!("test: node re-registered in {:?}", restarted.elapsed());
    cluster_round(&master, "after-restart", 4);

    // Every stranger connection is cut by the handshake deadline (5 s) plus slack.
    rt.block_on(async {
        let limit =
            (flood_started + Duration::from_secs(9)).saturating_duration_since(Instant::now());
        for s in &mut strangers {
            assert!(
                closed_within(s, limit.max(Duration::from_millis(100))).await,
                "a stranger connection outlived the handshake deadline"
            );
        }
    });
    // The withheld streams end at the body deadline (10 s), DEADLINE_EXCEEDED.
    let codes = rt.block_on(async {
        let mut codes = Vec::new();
        for (_send, open) in withheld {
            for (response, _body) in open {
                let reply = tokio::time::timeout(Duration::from_secs(15), response).await;
                let code = match reply {
                    Ok(Ok(r)) => r
                        .headers()
                        .get("grpc-status")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_string)
                        .unwrap_or_default(),
                    Ok(Err(e)) => format!("h2 error {e}"),
                    Err(_) => "no answer".into(),
                };
                codes.push(code);
            }
        }
        codes
    });
    let exceeded = codes.iter().filter(|c| *c == "4").count();
    assert_eq!(exceeded, codes.len(), "withheld streams ended as {codes:?}");
    cluster_round(&master, "after-flood", 4);

    // A refusal storm on the data port: 300 bad handshakes.
    for _ in 0..300 {
        let Ok(mut s) = std::net::TcpStream::connect(&opts.data) else {
            continue;
        };
        let garbage = kvtier_proto::FrameHeader::new(kvtier_proto::Opcode::Ping, 1, 0, 0).encode();
        let _ = s.write_all(&garbage);
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    }
    std::thread::sleep(Duration::from_millis(500));
    let master_lines = lines_with(&master_log, "refused");
    let node_lines = lines_with(&node_log, "data port: refused");
    eprintln!("test: master refusal lines: {master_lines:#?}\nnode: {node_lines:#?}");
    // One line in full, then one summary per 10 s interval (the test runs about 25 s).
    assert!(
        !master_lines.is_empty() && master_lines.len() <= 8,
        "{} master refusal lines",
        master_lines.len()
    );
    assert!(
        !node_lines.is_empty() && node_lines.len() <= 4,
        "{} data-port refusal lines",
        node_lines.len()
    );
    assert!(node.running());
}

// ------------------------------------------------------------------------------ local socket

/// A raw protocol connection to the local socket (what a hostile client can send).
struct Raw {
    stream: std::os::unix::net::UnixStream,
    next: u64,
    body: Vec<u8>,
}

type Reply = Result<Vec<u8>, String>;

impl Raw {
    fn connect(socket: &Path) -> std::io::Result<Raw> {
        let stream = std::os::unix::net::UnixStream::connect(socket)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(Raw {
            stream,
            next: 1,
            body: Vec::new(),
        })
    }

    /// Send one request, with `fd` attached when given; its reply (`Err`: an error reply or
    /// a closed connection, described).
    fn call(
        &mut self,
        opcode: kvtier_proto::Opcode,
        message: &dyn kvtier_proto::Encode,
        fd: Option<&OwnedFd>,
    ) -> Reply {
        use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let mut out = Vec::new();
        kvtier_proto::encode_frame(&mut out, opcode, self.next, 0, message).unwrap();
        self.next += 1;
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds;
        if let Some(fd) = fd {
            fds = [fd.as_fd()];
            assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        }
        let sent = sendmsg(
            &self.stream,
            &[std::io::IoSlice::new(&out)],
            &mut control,
            SendFlags::NOSIGNAL,
        )
        .map_err(|e| format!("send: {e}"))
        .and_then(|n| {
            self.stream
                .write_all(&out[n..])
                .map_err(|e| format!("send: {e}"))
        });
        match (sent, self.reply()) {
            // A refusal the server sent at accept, before it closed.
            (Err(send), Err(reply)) if reply.starts_with("read:") => Err(send),
            (_, reply) => reply,
        }
    }

    fn reply(&mut self) -> Reply {
        use kvtier_proto::Decode;
        let header = kvtier_proto::read_frame(&mut self.stream, &mut self.body)
            .map_err(|e| format!("read: {e}"))?;
        if header.flags & kvtier_proto::frame::FLAG_ERROR != 0 {
            Err(kvtier_proto::ErrorReply::decode(&self.body)
                .map(|e| e.message)
                .unwrap_or_default())
        } else {
            Ok(self.body.clone())
        }
    }

    fn hello(&mut self) -> Reply {
        self.call(
            kvtier_proto::Opcode::Handshake,
            &kvtier_proto::Handshake {
                version: kvtier_proto::frame::PROTOCOL_VERSION,
                client_name: "raw".into(),
            },
            None,
        )
    }

    fn open(&mut self) -> Reply {
        self.call(
            kvtier_proto::Opcode::OpenSession,
            &kvtier_proto::server::OpenSession {
                tenant: String::new(),
                client_name: "raw".into(),
                join: None,
            },
            None,
        )
    }

    fn register(&mut self, fd: &OwnedFd, len: u64) -> Result<u64, String> {
        use kvtier_proto::Decode;
        let body = self.call(
            kvtier_proto::Opcode::RegisterRegion,
            &kvtier_proto::server::RegisterRegion {
                label: "raw".into(),
                fd_offset: 0,
                len,
            },
            Some(fd),
        )?;
        Ok(kvtier_proto::server::RegionGrant::decode(&body)
            .unwrap()
            .region)
    }
}

/// A memfd of `len` bytes, never written (sparse: no memory behind it).
fn sparse_memfd(len: u64) -> OwnedFd {
    let fd = rustix::fs::memfd_create("sparse", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&fd, len).unwrap();
    fd
}

/// A `kvtier serve` on `dir/kvtier.sock` with its stderr in `dir/serve.log`.
fn serve(
    dir: &Path,
    nofile: Option<u64>,
    extra: &[&str],
    envs: &[(&str, &str)],
) -> (Proc, PathBuf) {
    let socket = dir.join("kvtier.sock");
    let mut args = vec![
        "serve",
        "--socket",
        socket.to_str().unwrap(),
        "--dram-capacity",
        "64MiB",
    ];
    args.extend_from_slice(extra);
    let server = spawn_logged("kvtier serve", &dir.join("serve.log"), nofile, &args, envs);
    wait_for(Duration::from_secs(20), "the server socket", || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    (server, socket)
}

fn stats(socket: &Path) -> serde_json::Value {
    kvtier_server::cli::fetch_stats(socket).expect("stats")
}

/// The server's pid (from its stats: `Proc` runs it under `sh`/`prlimit`, which exec it).
fn server_pid(socket: &Path) -> u32 {
    stats(socket)["server"]["pid"].as_u64().unwrap() as u32
}

/// Resident memory of `pid` in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap()
        << 10
}

/// A legitimate round through a server-mode client of `socket`: 8 objects of 64 KiB put from
/// a populated memfd pool, read back into it zeroed, compared byte for byte.
fn legit_round(socket: &Path, tenant: &str, as_other_uid: bool) -> Result<(), String> {
    let client = Client::open(KvtierConfig {
        server_socket: Some(socket.display().to_string()),
        extra_backend_tag: (!tenant.is_empty()).then(|| tenant.to_string()),
        server_uid: as_other_uid.then(|| "0".to_string()),
        ..KvtierConfig::default()
    })
    .map_err(|e| e.to_string())?;
    const LEN: usize = 64 << 10;
    let map =
        kvtier_client::memory::StagingMap::create(8 * LEN, "legit").map_err(|e| e.to_string())?;
    let region = kvtier_client::client::register_own_memfd(&client, &map, "legit")
        .map_err(|e| e.to_string())?;
    let names: Vec<Vec<u8>> = (0..8)
        .map(|i| format!("{tenant}-legit-{i}").into_bytes())
        .collect();
    let refs: Vec<MemRef> = (0..8)
        .map(|i| MemRef {
            ptr: map.addr() + i * LEN,
            len: LEN,
        })
        .collect();
    // SAFETY: the staging map is this process's own mapping of 8 * LEN bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(map.addr() as *mut u8, map.len()) };
    for (i, chunk) in bytes.chunks_mut(LEN).enumerate() {
        chunk.copy_from_slice(&object_bytes(i as u64 + 5, LEN));
    }
    let batch = PageBatch {
        prefix: &[][..],
        page_keys: &names,
        suffixes: &[[0u8; 0]],
    };
    let put = client.put_pages(&batch, &refs, None);
    if !put.ok.iter().all(|&ok| ok) {
        return Err(format!("put: {:?}", put.errors));
    }
    bytes.fill(0);
    let got = client.get_pages(&batch, &refs);
    if !got.ok.iter().all(|&ok| ok) {
        return Err(format!("get: {:?}", got.errors));
    }
    for (i, chunk) in bytes.chunks(LEN).enumerate() {
        if chunk != object_bytes(i as u64 + 5, LEN).as_slice() {
            return Err(format!("object {i} is not byte-exact"));
        }
    }
    client.unregister_region(region);
    Ok(())
}

/// Environment variables that turn this test binary into one of the other-uid helpers.
const HOG_ENV: &str = "KVTIER_TEST_HOG_SOCKET";
const GUEST_ENV: &str = "KVTIER_TEST_GUEST_SOCKET";

/// The hog (uid 65534): opens connections until refused (at most 64), and on each a session
/// and eight descriptors sent with pings; reports, then holds everything until told to stop.
#[test]
fn uid_hog_helper() {
    let Ok(path) = std::env::var(HOG_ENV) else {
        return; // an ordinary test run
    };
    let socket = PathBuf::from(&path);
    let mut held = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..64 {
        let Ok(mut raw) = Raw::connect(&socket) else {
            refused.push("connect failed".to_string());
            continue;
        };
        if let Err(e) = raw.hello().and_then(|_| raw.open()) {
            refused.push(e);
            continue;
        }
        for _ in 0..8 {
            let memfd = sparse_memfd(4096);
            let _ = raw.call(
                kvtier_proto::Opcode::Ping,
                &kvtier_client::remote::EmptyBody,
                Some(&memfd),
            );
        }
        held.push(raw);
    }
    let report = serde_json::json!({ "held": held.len(), "refused": refused });
    std::fs::write(format!("{path}.hog"), report.to_string()).unwrap();
    let done = PathBuf::from(format!("{path}.done"));
    let start = Instant::now();
    while !done.exists() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The guest (uid 65533): one legitimate round; reports the outcome.
#[test]
fn uid_guest_helper() {
    let Ok(path) = std::env::var(GUEST_ENV) else {
        return;
    };
    let outcome = legit_round(Path::new(&path), "guest", true);
    std::fs::write(
        format!("{path}.guest"),
        serde_json::json!({ "error": outcome.err() }).to_string(),
    )
    .unwrap();
}

fn run_helper_as(uid: u32, name: &str, env: &str, socket: &Path) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(env, socket)
        .uid(uid)
        .gid(uid)
        .spawn()
        .unwrap()
}

/// `kvtier serve` with 512 descriptors: uid 65534 opens connections until refused and sends
/// each eight descriptors. It gets its per-uid share (a quarter of what the descriptors
/// allow) and no more, its extra descriptors are dropped by the kernel, and meanwhile the
/// server's own uid and uid 65533 connect and are served byte-exact; the server stays well
/// below its descriptor limit.
#[test]
fn another_uid_cannot_exhaust_the_local_socket() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to run the helpers as other uids");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    let (mut server, socket) = serve(dir.path(), Some(512), &["--socket-mode", "0666"], &[]);
    let limits = stats(&socket)["server"]["limits"].clone();
    let per_uid = limits["connections_per_uid"].as_u64().unwrap();
    let fds_per_uid = limits["passed_fds_per_uid"].as_u64().unwrap();
    assert!(limits["descriptor_limit"] == 512, "{limits}");
    assert!(
        per_uid < limits["connections"].as_u64().unwrap(),
        "{limits}"
    );

    let mut hog = run_helper_as(65534, "uid_hog_helper", HOG_ENV, &socket);
    let hog_report = PathBuf::from(format!("{}.hog", socket.display()));
    wait_for(Duration::from_secs(60), "the hog's report", || {
        hog_report.exists()
    });
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&hog_report).unwrap()).unwrap();
    assert_eq!(report["held"].as_u64().unwrap(), per_uid, "{report}");
    let refused = report["refused"].as_array().unwrap();
    assert!(
        refused
            .iter()
            .all(|r| r.as_str().unwrap().contains("max_connections_per_uid")),
        "{report}"
    );
    // The hog's share, as the server accounts it.
    let doc = stats(&socket);
    let hog_use = doc["server"]["uids"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["uid"] == 65534)
        .cloned()
        .unwrap();
    assert_eq!(
        hog_use["connections"].as_u64().unwrap(),
        per_uid,
        "{hog_use}"
    );
    assert!(
        hog_use["passed_fds"].as_u64().unwrap() <= fds_per_uid,
        "{hog_use}"
    );
    // Everyone else is served meanwhile.
    legit_round(&socket, "owner", false).unwrap();
    let mut guest = run_helper_as(65533, "uid_guest_helper", GUEST_ENV, &socket);
    assert!(guest.wait().unwrap().success());
    let guest_report: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{}.guest", socket.display())).unwrap(),
    )
    .unwrap();
    assert!(guest_report["error"].is_null(), "{guest_report}");
    let pid = server_pid(&socket);
    let open_fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    assert!(
        open_fds < 400,
        "the server holds {open_fds} of its 512 descriptors"
    );
    eprintln!("test: server holds {open_fds} descriptors; hog {hog_use}");
    std::fs::write(format!("{}.done", socket.display()), b"").unwrap();
    assert!(hog.wait().unwrap().success());
    wait_for(
        Duration::from_secs(5),
        "the hog's descriptors given back",
        || {
            !stats(&socket)["server"]["uids"]
                .as_array()
                .unwrap()
                .iter()
                .any(|u| u["uid"] == 65534)
        },
    );
    assert!(server.running());
}

/// A get into every 1 MiB slot of a 1 GiB sparse memfd (registered over the raw protocol, so
/// no client library populates it): every page fails naming the hole, the memfd still has no
/// memory, and the server's resident memory does not grow; a populated pool is served.
#[test]
fn a_get_into_a_sparse_memfd_commits_no_server_memory() {
    use kvtier_proto::Decode;
    let dir = tempfile::tempdir().unwrap();
    let (mut server, socket) = serve(dir.path(), None, &[], &[]);
    legit_round(&socket, "", false).unwrap();
    let pid = server_pid(&socket);
    let before = rss(pid);
    let mut raw = Raw::connect(&socket).unwrap();
    raw.hello().unwrap();
    raw.open().unwrap();
    const SLOT: u64 = 1 << 20;
    const SLOTS: u64 = 1024;
    let memfd = sparse_memfd(SLOT * SLOTS);
    let region = raw.register(&memfd, SLOT * SLOTS).unwrap();
    // The legit round stored "-legit-0..8" of tenant "" (the raw session's tenant too).
    let names: Vec<Vec<u8>> = (0..8).map(|i| format!("-legit-{i}").into_bytes()).collect();
    let mut failed = 0;
    for batch in 0..SLOTS / 8 {
        let io = kvtier_proto::server::PageIo {
            keys: kvtier_proto::server::PageKeys {
                prefix: Vec::new(),
                page_keys: names.clone(),
                suffixes: vec![Vec::new()],
            },
            buffers: (0..8)
                .map(|i| kvtier_proto::server::ShmRef {
                    region,
                    offset: (batch * 8 + i) * SLOT,
                    len: 64 << 10,
                })
                .collect(),
            depths: None,
        };
        let body = raw.call(kvtier_proto::Opcode::GetPages, &io, None).unwrap();
        let result = kvtier_proto::BatchResult::decode(&body).unwrap();
        failed += result.ok.iter().filter(|ok| !**ok).count();
        if batch == 0 {
            assert!(
                result
                    .errors
                    .iter()
                    .any(|e| e.contains("no memory behind them")),
                "{:?}",
                result.errors
            );
        }
    }
    assert_eq!(failed as u64, SLOTS, "pages served into holes");
    let blocks = rustix::fs::fstat(&memfd).unwrap().st_blocks;
    assert_eq!(
        blocks, 0,
        "the server gave the client's memfd {blocks} blocks"
    );
    let grown = rss(pid).saturating_sub(before);
    assert!(grown < 32 << 20, "the server grew by {} MiB", grown >> 20);
    legit_round(&socket, "", false).unwrap();
    assert!(server.running());
}

/// 2,000 connections over `max_connections_per_uid` (2): every one refused and counted, and
/// the server's log holds a few lines for all of them.
#[test]
fn a_local_refusal_storm_is_counted_exactly_and_logged_in_a_few_lines() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, socket) = serve(
        dir.path(),
        None,
        &[],
        &[("KVTIER_SERVE_MAX_CONNECTIONS_PER_UID", "3")],
    );
    wait_for(Duration::from_secs(5), "the probes to close", || {
        stats(&socket)["server"]["connections"] == 1
    });
    let held: Vec<Raw> = (0..2)
        .map(|_| {
            let mut raw = Raw::connect(&socket).unwrap();
            raw.hello().unwrap();
            raw
        })
        .collect();
    let before = stats(&socket)["server"]["connections_refused"]
        .as_u64()
        .unwrap();
    // Held: two here, and the stats probe below takes the third slot while it asks.
    let mut probe = None;
    wait_for(Duration::from_secs(5), "the third slot", || {
        let mut raw = Raw::connect(&socket).unwrap();
        let ok = raw.hello().is_ok();
        probe = ok.then_some(raw);
        ok
    });
    let mut refused = 0;
    for _ in 0..2000 {
        if let Ok(mut raw) = Raw::connect(&socket) {
            if raw.reply().is_err() {
                refused += 1;
            }
        }
    }
    assert_eq!(refused, 2000);
    drop(probe);
    let mut doc = serde_json::Value::Null;
    wait_for(Duration::from_secs(5), "a slot for the stats probe", || {
        match kvtier_server::cli::fetch_stats(&socket) {
            Ok(d) => {
                doc = d;
                true
            }
            Err(_) => false,
        }
    });
    // The storm, and the stats probes refused while the last connections closed.
    let counted = doc["server"]["connections_refused"].as_u64().unwrap() - before;
    assert!((2000..2100).contains(&counted), "{doc}");
    assert!(
        doc["server"]["refusals"]["max_connections_per_uid"]
            .as_u64()
            .unwrap()
            >= 2000,
        "{}",
        doc["server"]["refusals"]
    );
    let lines = lines_with(&dir.path().join("serve.log"), "refused local connection");
    assert!(!lines.is_empty() && lines.len() <= 3, "{lines:#?}");
    drop(held);
    assert!(server.running());
}
