//! Helpers shared by the cluster tests: child processes killed on drop, free ports, waiting,
//! host memory standing in for a pool, a `kvtier serve --master` node, a real etcd, scraping
//! a `/metrics` endpoint, a master's own view, a TCP proxy that can cut a link.
//!
//! Transport (issue 17): every cluster client opened with [`cluster_config`] reads page bytes
//! over the transport [`TRANSPORT_VAR`] names (`tcp`, `ucx`, `auto`; unset: the config's
//! default, `auto`, which on one host keeps kvtier's TCP frames), and nodes started with
//! [`NodeOpts`] get the same `cluster_transport`. scripts/test.sh runs the cluster tests once
//! as they are and once with `ucx`. UCX is pinned to its TCP transport on loopback
//! ([`UCX_PINNED`]) in this process and the nodes it starts, unless the caller pinned it
//! already (cluster_ucx.rs runs its children with shared memory): left alone, UCX's TCP also
//! opens connections on the host's other interfaces.
#![allow(dead_code)]
#![allow(unsafe_code)] // the shared-memory fixture maps and unmaps a memfd

pub mod netns;
pub mod ucx;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvtier_client::cluster::master::{connect, MasterCredential};
use kvtier_client::{Client, KvtierConfig, MemRef};
use kvtier_master::rpc::{ClusterReply, ClusterRequest};

pub const TOKEN: &str = "test-cluster-secret";

/// The environment variable naming the cluster transport of the tests' clients and nodes
/// (not `KVTIER_*`: kvtier reads that prefix as its own settings and refuses unknown keys).
pub const TRANSPORT_VAR: &str = "TEST_CLUSTER_TRANSPORT";

/// UCX's settings for every test process that has not pinned them itself: its TCP transport
/// over loopback (`auto` keeps frames between processes of one host, so `ucx` is how the
/// tests reach the UCX path here).
pub const UCX_PINNED: [(&str, &str); 2] = [("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")];

/// The `cluster_transport` [`TRANSPORT_VAR`] asks for (`None`: unset, the config default).
/// With `ucx`, libucp must load: a run that silently fell back to frames would test nothing.
pub fn test_transport() -> Option<String> {
    let value = std::env::var(TRANSPORT_VAR)
        .ok()
        .filter(|v| !v.is_empty())?;
    assert!(
        ["auto", "tcp", "ucx"].contains(&value.as_str()),
        "{TRANSPORT_VAR}={value:?}: use tcp, ucx or auto"
    );
    if value == "ucx" {
        if let Err(why) = kvtier_client::transport::ucx::ffi::Ucp::get() {
            panic!("{TRANSPORT_VAR}=ucx but libucp is not usable here: {why}");
        }
    }
    Some(value)
}

/// The transport `client` reads from the node at data address `peer` over, and why (`None`:
/// not read from yet), as its stats report it.
pub fn transport_to(client: &Client, peer: &str) -> Option<(String, String)> {
    let stats = client.stats_json();
    let list = stats["peer_transports"].as_array()?;
    let entry = list.iter().find(|p| p["peer"] == peer)?;
    Some((
        entry["transport"].as_str().unwrap_or("").to_string(),
        entry["reason"].as_str().unwrap_or("").to_string(),
    ))
}

/// After `client` read from the node at `peer`: the read went over the transport
/// [`TRANSPORT_VAR`] forces (`tcp` or `ucx`; nothing to check for `auto` or unset).
pub fn assert_test_transport(client: &Client, peer: &str) {
    let Some(wanted) = test_transport().filter(|t| t != "auto") else {
        return;
    };
    let (used, reason) = transport_to(client, peer).expect("the peer was read from");
    assert_eq!(used, wanted, "reads from {peer}: {reason}");
}

/// Pin UCX ([`UCX_PINNED`]) in this process, once, before any node or client starts: a UCX
/// context reads the variables when it is created, and nodes inherit them. A variable the
/// caller set already is kept (cluster_ucx.rs's children choose shared memory). Every path
/// that creates a UCX context here (a client, a node) calls this first, and the `Once` makes
/// the others wait, so no context reads the environment while it changes.
pub fn pin_ucx() {
    static PIN: std::sync::Once = std::sync::Once::new();
    PIN.call_once(|| {
        for (name, value) in UCX_PINNED {
            if std::env::var_os(name).is_none() {
                std::env::set_var(name, value);
            }
        }
    });
}

/// A child process this test started; killed (by its own pid) when dropped.
pub struct Proc {
    pub child: Child,
    pub name: String,
}

impl Proc {
    pub fn spawn(name: &str, args: &[&str], envs: &[(&str, &str)]) -> Proc {
        Proc::spawn_program(env!("CARGO_BIN_EXE_kvtier"), name, args, envs)
    }

    pub fn spawn_program(program: &str, name: &str, args: &[&str], envs: &[(&str, &str)]) -> Proc {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        Proc {
            child: cmd
                .spawn()
                .unwrap_or_else(|e| panic!("spawn {program}: {e}")),
            name: name.to_string(),
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for the exit (SIGKILL after `limit`).
    pub fn terminate(&mut self, limit: Duration) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }

    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            eprintln!("test: stopping {}", self.name);
        }
        self.kill();
    }
}

pub fn free_port(ip: &str) -> u16 {
    TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn wait_for(limit: Duration, what: &str, mut ok: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Host memory standing in for a pool: `pages x comps` buffers of `len` bytes.
pub struct Pool {
    pub bytes: Vec<u8>,
    pub len: usize,
}

impl Pool {
    pub fn new(objects: usize, len: usize) -> Pool {
        Pool {
            bytes: vec![0u8; objects * len],
            len,
        }
    }
    pub fn fill(&mut self, seed: u8) {
        for (i, b) in self.bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(13) ^ seed;
        }
    }
    pub fn refs(&self) -> Vec<MemRef> {
        (0..self.bytes.len() / self.len)
            .map(|i| MemRef {
                ptr: self.bytes.as_ptr() as usize + i * self.len,
                len: self.len,
            })
            .collect()
    }
    /// Register the pool with `client` until the returned guard drops, which happens before
    /// the pool's memory is freed (the guard borrows it).
    pub fn register<'a>(&'a self, client: &'a Client) -> Registered<'a> {
        // SAFETY: the guard borrows the pool, so its memory stays allocated and is not
        // otherwise borrowed mutably until the guard unregisters it.
        let id = unsafe {
            client
                .register_region(self.bytes.as_ptr() as usize, self.bytes.len(), "test pool")
                .unwrap()
        };
        Registered {
            client,
            id,
            _pool: std::marker::PhantomData,
        }
    }
}

/// A [`Pool`]'s registration with one client; unregistered on drop.
#[must_use = "dropping it unregisters the pool at once"]
pub struct Registered<'a> {
    client: &'a Client,
    id: kvtier_client::memory::RegionId,
    _pool: std::marker::PhantomData<&'a Pool>,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.client.unregister_region(self.id);
    }
}

/// How to start one `kvtier serve --master` node.
#[derive(Clone, Debug)]
pub struct NodeOpts {
    pub id: String,
    /// IP:PORT of its data port.
    pub data: String,
    /// Comma-separated master addresses.
    pub masters: String,
    /// Where its socket (and SSD segments, with `ssd`) live.
    pub dir: PathBuf,
    /// SSD tier on, write-through, strict durability (an acknowledged put is synced).
    pub ssd: bool,
    /// `--metrics-addr` of the node, if any.
    pub metrics_addr: Option<String>,
    /// `--dram-capacity` (64MiB unless a test needs DRAM to fill).
    pub dram: &'static str,
}

impl NodeOpts {
    pub fn new(dir: &Path, masters: &str, id: &str, ip: &str) -> NodeOpts {
        NodeOpts {
            id: id.to_string(),
            data: format!("{ip}:{}", free_port(ip)),
            masters: masters.to_string(),
            dir: dir.to_path_buf(),
            ssd: false,
            metrics_addr: None,
            dram: "64MiB",
        }
    }

    pub fn spawn(&self) -> Proc {
        self.spawn_under(&[])
    }

    /// Spawn the node through `wrapper` (a command that runs the rest of its arguments, e.g.
    /// `["prlimit", "--nofile=256"]`); empty: directly.
    pub fn spawn_under(&self, wrapper: &[&str]) -> Proc {
        pin_ucx();
        let socket = self.dir.join(format!("{}.sock", self.id));
        let _ = std::fs::remove_file(&socket);
        let ssd_dir = self.dir.join(format!("{}-ssd", self.id));
        let ssd_dir_flag = format!("ssd_storage_dir={}", ssd_dir.display());
        let mut args: Vec<&str> = vec![
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram-capacity",
            self.dram,
            "--engine",
            "dram_prefault=false",
            "--master",
            &self.masters,
            "--data-addr",
            &self.data,
            "--node-id",
            &self.id,
        ];
        if self.ssd {
            args.extend([
                "--engine",
                "ssd_enabled=true",
                "--engine",
                &ssd_dir_flag,
                "--engine",
                "ssd_capacity_bytes=64MiB",
                "--engine",
                "ssd_segment_size_bytes=4MiB",
                "--engine",
                "ssd_durability_mode=strict",
                "--engine",
                "ssd_write_policy=write_through",
            ]);
        }
        if let Some(addr) = &self.metrics_addr {
            args.extend(["--metrics-addr", addr.as_str()]);
        }
        let transport_flag = test_transport().map(|t| format!("cluster_transport={t}"));
        if let Some(flag) = &transport_flag {
            args.extend(["--engine", flag.as_str()]);
        }
        let env = [("KVTIER_CLUSTER_TOKEN", TOKEN)];
        match wrapper.split_first() {
            None => Proc::spawn(&self.id, &args, &env),
            Some((program, rest)) => {
                let mut all: Vec<&str> = rest.to_vec();
                all.push(env!("CARGO_BIN_EXE_kvtier"));
                all.extend(args);
                Proc::spawn_program(program, &self.id, &all, &env)
            }
        }
    }
}

/// The usual two nodes, on two loopback addresses standing in for two hosts.
pub const TWO_NODES: [(&str, &str); 2] = [("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")];

/// Nodes started together: their options and processes, in the order asked for.
pub struct Nodes {
    pub opts: Vec<NodeOpts>,
    pub procs: Vec<Proc>,
}

impl Nodes {
    /// Start `(id, ip)` nodes of `masters` (comma separated), their sockets in `dir`; with
    /// `metrics`, each serves `/metrics` on a free loopback port.
    pub fn start(dir: &Path, masters: &str, nodes: &[(&str, &str)], metrics: bool) -> Nodes {
        let opts: Vec<NodeOpts> = nodes
            .iter()
            .map(|(id, ip)| {
                let mut o = NodeOpts::new(dir, masters, id, ip);
                if metrics {
                    o.metrics_addr = Some(format!("127.0.0.1:{}", free_port("127.0.0.1")));
                }
                o
            })
            .collect();
        let procs = opts.iter().map(NodeOpts::spawn).collect();
        Nodes { opts, procs }
    }

    /// The `/metrics` addresses (of nodes started with `metrics`).
    pub fn metrics(&self) -> Vec<String> {
        self.opts
            .iter()
            .filter_map(|o| o.metrics_addr.clone())
            .collect()
    }

    /// `(id, data address)` of every node, as [`all_registered`] expects them.
    pub fn expected(&self) -> Vec<(String, String)> {
        self.opts
            .iter()
            .map(|o| (o.id.clone(), o.data.clone()))
            .collect()
    }
}

/// Wait (10 s at most) until the master `client` talks to lists `count` live nodes.
pub fn wait_alive(client: &Client, count: usize) {
    wait_for(
        Duration::from_secs(10),
        &format!("{count} nodes registered"),
        || {
            client
                .cluster()
                .and_then(|c| c.cluster_info().ok())
                .is_some_and(|info| info.nodes.iter().filter(|n| n.alive).count() == count)
        },
    );
}

/// A single master (no etcd) on a free loopback port: its address and process.
pub fn start_master(lease_ms: u64, extra: &[&str]) -> (String, Proc) {
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let proc = spawn_master(&addr, lease_ms, extra);
    (addr, proc)
}

/// Start a single master (no etcd) on `addr`.
pub fn spawn_master(addr: &str, lease_ms: u64, extra: &[&str]) -> Proc {
    let lease = lease_ms.to_string();
    let mut args = vec!["master", "--listen", addr, "--lease-ms", &lease];
    args.extend_from_slice(extra);
    Proc::spawn(
        &format!("master {addr}"),
        &args,
        &[("KVTIER_CLUSTER_TOKEN", TOKEN)],
    )
}

/// A real etcd (the Debian etcd-server binary) on free loopback ports, data in a temp dir;
/// killed when dropped.
pub struct Etcd {
    pub endpoint: String,
    proc: Proc,
    /// Its command line, for [`Etcd::restart`] (same ports, same data).
    args: Vec<String>,
    client_port: u16,
    _dir: tempfile::TempDir,
}

pub const ETCD_BINARY: &str = "/usr/bin/etcd";

impl Etcd {
    pub fn start() -> Etcd {
        assert!(
            Path::new(ETCD_BINARY).exists(),
            "{ETCD_BINARY} is missing: run scripts/setup.sh (it installs etcd-server) — \
             the HA tests need a real etcd"
        );
        let dir = tempfile::tempdir().unwrap();
        let client_port = free_port("127.0.0.1");
        let mut peer_port = free_port("127.0.0.1");
        while peer_port == client_port {
            peer_port = free_port("127.0.0.1");
        }
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let cluster = format!("kvtier-test={peer_url}");
        let data_dir = dir.path().join("etcd");
        let args: Vec<String> = [
            "--name",
            "kvtier-test",
            "--data-dir",
            data_dir.to_str().unwrap(),
            "--listen-client-urls",
            &client_url,
            "--advertise-client-urls",
            &client_url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            &cluster,
            "--initial-cluster-state",
            "new",
            "--logger",
            "zap",
            "--log-level",
            "error",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        let proc = Etcd::spawn(&args);
        let etcd = Etcd {
            endpoint: client_url,
            proc,
            args,
            client_port,
            _dir: dir,
        };
        etcd.wait_ready();
        etcd
    }

    fn spawn(args: &[String]) -> Proc {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Proc::spawn_program(ETCD_BINARY, "etcd", &args, &[])
    }

    fn wait_ready(&self) {
        let port = self.client_port;
        wait_for(
            Duration::from_secs(10),
            "etcd to accept connections",
            || TcpStream::connect(("127.0.0.1", port)).is_ok(),
        );
    }

    /// SIGKILL etcd (its data stays for [`Etcd::restart`]).
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Start etcd again on the same ports with the same data (its leases come back re-armed)
    /// and wait until it accepts connections.
    pub fn restart(&mut self) {
        self.proc = Etcd::spawn(&self.args);
        self.wait_ready();
    }
}

/// The body of `GET /metrics` at `addr`, or None while nothing answers there.
pub fn metrics_text(addr: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_string())
}

/// The sum of the samples of metric `name` at `addr` whose labels include every `labels`
/// pair (0 when none is published yet).
pub fn metric_sum(addr: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = metrics_text(addr).expect("scrape /metrics");
    let wanted: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| wanted.iter().all(|w| l.contains(w.as_str())))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Ask one master directly for its `Cluster` view (`None`: it does not answer).
pub fn cluster_of(address: &str) -> Option<ClusterReply> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let call = async {
            let credential = MasterCredential::new(TOKEN.as_bytes().to_vec());
            let mut client = connect(address, credential, Duration::from_millis(500))
                .await
                .ok()?;
            client
                .cluster(ClusterRequest::default())
                .await
                .ok()
                .map(|r| r.into_inner())
        };
        tokio::time::timeout(Duration::from_millis(500), call)
            .await
            .ok()
            .flatten()
    })
}

/// The masters that answer as leader.
pub fn leaders(masters: &[String]) -> Vec<usize> {
    (0..masters.len())
        .filter(|&i| cluster_of(&masters[i]).is_some_and(|r| r.is_leader))
        .collect()
}

/// Every node of `expected` (id, data address) is alive at `master` under that address.
pub fn all_registered(master: &str, expected: &[(String, String)]) -> bool {
    let Some(reply) = cluster_of(master) else {
        return false;
    };
    reply.is_leader
        && expected.iter().all(|(id, data)| {
            reply
                .nodes
                .iter()
                .any(|n| &n.node_id == id && n.alive && &n.data_address == data)
        })
}

/// A TCP proxy in front of `target` whose link the test can cut: while cut, no byte moves in
/// either direction and new connections wait (a partition, not a refusal: the other side
/// sees silence, as when a switch drops packets). Stops when dropped.
pub struct Proxy {
    pub addr: String,
    cut: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    pub fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let cut = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s, target) = (Arc::clone(&cut), Arc::clone(&stop), target.to_string());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let (c, s, target) = (Arc::clone(&c), Arc::clone(&s), target.clone());
                std::thread::spawn(move || {
                    while c.load(Ordering::SeqCst) && !s.load(Ordering::SeqCst) {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    let Ok(server) = TcpStream::connect(&target) else {
                        return;
                    };
                    let _ = client.set_nonblocking(false);
                    let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone())
                    else {
                        return;
                    };
                    let (c2, s2) = (Arc::clone(&c), Arc::clone(&s));
                    std::thread::spawn(move || pump(client2, server2, &c2, &s2));
                    pump(server, client, &c, &s);
                });
            }
        });
        Proxy { addr, cut, stop }
    }

    /// Stop every byte on the link (both directions).
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }

    /// Let bytes flow again.
    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Copy `from` to `to` while the proxy runs; while it is cut, read nothing (bytes wait in
/// the kernel's buffers, as they would behind a partition).
fn pump(mut from: TcpStream, mut to: TcpStream, cut: &AtomicBool, stop: &AtomicBool) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
    let mut buf = vec![0u8; 64 << 10];
    while !stop.load(Ordering::SeqCst) {
        if cut.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// The config of a cluster-mode client of `masters` (comma separated) on node `node_id` (none:
/// not co-located with any node): the test token, a 500 ms request bound, 5 s of retrying
/// while no master leads, and the transport [`TRANSPORT_VAR`] names.
pub fn cluster_config(masters: &str, node_id: Option<&str>) -> KvtierConfig {
    pin_ucx();
    let defaults = KvtierConfig::default();
    KvtierConfig {
        master_address: Some(masters.to_string()),
        node_id: node_id.map(String::from),
        cluster_token: Some(TOKEN.into()),
        cluster_request_timeout_ms: 500,
        cluster_master_retry_ms: 5000,
        cluster_transport: test_transport().unwrap_or(defaults.cluster_transport),
        ..defaults
    }
}

/// A client opened with [`cluster_config`].
pub fn cluster_client(masters: &str, node_id: Option<&str>) -> Client {
    Client::open(cluster_config(masters, node_id)).expect("open a cluster client")
}

/// The bytes of test object `i`: `len` bytes, distinct per object (xorshift from `i`).
pub fn object_bytes(i: u64, len: usize) -> Vec<u8> {
    let mut state = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A memfd mapped in this process, standing in for SGLang's shm host pool
/// (`ShmHostTensorAllocator`: no `MFD_ALLOW_SEALING`) unless `sealable`.
pub struct Memfd {
    pub fd: OwnedFd,
    pub ptr: *mut u8,
    pub len: usize,
}

impl Memfd {
    pub fn new(len: usize, sealable: bool) -> Memfd {
        use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        let mut flags = MemfdFlags::CLOEXEC;
        if sealable {
            flags |= MemfdFlags::ALLOW_SEALING;
        }
        let fd = memfd_create("attack-pool", flags).unwrap();
        ftruncate(&fd, len as u64).unwrap();
        // SAFETY: a fresh shared mapping of a memfd of exactly `len` bytes.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .unwrap() as *mut u8;
        Memfd { fd, ptr, len }
    }

    /// The mapping's bytes (only while the memfd has its full size).
    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping lives as long as self; the tests call this only while the memfd
        // is at its full size, from one thread.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The mapping's address.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    pub fn refs(&self, object: usize) -> Vec<MemRef> {
        (0..self.len / object)
            .map(|i| MemRef {
                ptr: self.ptr as usize + i * object,
                len: object,
            })
            .collect()
    }

    pub fn register(&self, client: &Client) {
        // SAFETY: the mapping outlives the client (dropped after it in every test) and is
        // `[0, len)` of `fd`.
        unsafe {
            client
                .register_memfd(self.ptr as usize, self.len, self.fd.as_fd(), 0, "pool")
                .unwrap();
        }
    }
}

impl Drop for Memfd {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in new().
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}
