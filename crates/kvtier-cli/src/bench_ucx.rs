//! `kvtier bench cluster --transport tcp,ucx-tcp,ucx-shm` (issue 17): cluster set/get
//! throughput and the node's CPU per GB read, per data transport, against the same run's raw
//! TCP (one `std` stream over loopback) and memcpy of the same batch.
//!
//! - Per transport this process starts `kvtier master` and one `kvtier serve --master` node
//!   (child processes, free loopback ports, a temp dir, a fresh token) and opens a cluster
//!   client with no node id, so every byte crosses to the node: `tcp` = kvtier's frames
//!   (`cluster_transport = "tcp"`), `ucx-tcp` = UCX one-sided reads over UCX's TCP on
//!   loopback (`UCX_TLS=tcp UCX_NET_DEVICES=lo`), `ucx-shm` = over shared memory
//!   (`UCX_TLS=posix,cma,self`). UCX reads its variables once per context: they are set in
//!   this process (single-threaded then: the previous transport's client and processes are
//!   gone) before the client opens, and passed to the node.
//! - Sets travel one-sided too on the UCX transports (reserve in the node's put landing area,
//!   UCP put, commit); the transport of each direction is printed (`peer_transports`:
//!   `transport` for reads, `puts` for writes, and the lanes UCX negotiated).
//! - Node CPU: the node's utime + stime (`/proc/PID/stat`, 10 ms ticks: coarse for short
//!   runs) over the timed gets, per GB read.
//! - Issue 26: kvtier refuses UCX's emulated lanes (tcp, posix) unless the INSECURE test hook
//!   `TEST_INSECURE_UCX_EMULATED_RMA=1` is set (inherited by the node): without it `ucx-tcp`
//!   and `ucx-shm` measure the frames a UCX client falls back to, and say so.
//! - Every get is verified byte for byte outside the timed part; the transport in use is read
//!   back from the client's stats (`peer_transports`) and printed, so a silent fallback shows.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use kvtier_client::memory::StagingMap;
use kvtier_client::{Client, KvtierConfig, MemRef};

use crate::bench::{gbps, note, p50, TempDir};

/// Environment variables set for one transport.
type Vars = &'static [(&'static str, &'static str)];

/// One transport of the benchmark: name, `cluster_transport`, UCX variables.
const TRANSPORTS: [(&str, &str, Vars); 3] = [
    ("tcp", "tcp", &[]),
    (
        "ucx-tcp",
        "ucx",
        &[("UCX_TLS", "tcp"), ("UCX_NET_DEVICES", "lo")],
    ),
    ("ucx-shm", "ucx", &[("UCX_TLS", "posix,cma,self")]),
];

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(dir: &Path, name: &str, args: &[String], env: &[(&str, &str)]) -> Result<Proc, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).map_err(|e| e.to_string())?;
    let err = log.try_clone().map_err(|e| e.to_string())?;
    Command::new(exe)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .map(Proc)
        .map_err(|e| format!("cannot start kvtier {name}: {e}"))
}

fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| e.to_string())
}

/// The node's CPU time so far (utime + stime of `/proc/PID/stat`, at 100 ticks a second).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the line: 11 and 12 after the state field.
    (tick(11) + tick(12)) / 100.0
}

/// Raw TCP baseline: one loopback stream, `bytes` sent, one byte acknowledged.
fn raw_tcp(bytes: &[u8]) -> Result<Duration, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let len = bytes.len();
    let rx = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf)?;
        s.write_all(&[1])
    });
    let mut tx = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    let _ = tx.set_nodelay(true);
    let started = Instant::now();
    tx.write_all(bytes).map_err(|e| e.to_string())?;
    let mut ack = [0u8; 1];
    tx.read_exact(&mut ack).map_err(|e| e.to_string())?;
    let took = started.elapsed();
    rx.join()
        .map_err(|_| "raw receiver panicked".to_string())?
        .map_err(|e| e.to_string())?;
    Ok(took)
}

/// One row of the report.
#[derive(Debug, serde::Serialize)]
struct Row {
    transport: String,
    size: usize,
    set_gbps: f64,
    get_gbps: f64,
    node_cpu_s_per_gb_get: f64,
    raw_tcp_gbps: f64,
    memcpy_gbps: f64,
    peer_transport: String,
}

fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

#[allow(clippy::too_many_arguments)]
fn measure(
    transport: &str,
    choice: &str,
    ucx_env: &[(&str, &str)],
    sizes: &[usize],
    batch: usize,
    rounds: usize,
    json: bool,
) -> Result<Vec<Row>, String> {
    // UCX reads these once per context, at client open; nothing else runs UCX now.
    for var in ["UCX_TLS", "UCX_NET_DEVICES"] {
        std::env::remove_var(var);
    }
    for (k, v) in ucx_env {
        std::env::set_var(k, v);
    }
    let dir = TempDir::new(None, "cluster-ucx")?;
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let token = format!("bench-ucx-{}-{nanos:x}", std::process::id());
    let master_addr = format!("127.0.0.1:{}", free_port()?);
    let largest = sizes.iter().copied().max().unwrap_or(1 << 20);
    // Five batches: one data-port connection's leases pin at most a quarter of the arena
    // (issue 26, `LEASE_CONNECTION_SHARE`), and a whole batch is leased at once.
    let capacity_mib = ((largest * batch * 5) >> 20).max(64);
    let mut env: Vec<(&str, &str)> = vec![("KVTIER_CLUSTER_TOKEN", &token)];
    env.extend_from_slice(ucx_env);
    let _master = spawn(
        &dir.path,
        "master",
        &[
            "master".into(),
            "--listen".into(),
            master_addr.clone(),
            "--lease-ms".into(),
            "600".into(),
        ],
        &env,
    )?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(&master_addr).is_err() {
        if Instant::now() > deadline {
            return Err("kvtier master did not listen".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let data_addr = format!("127.0.0.1:{}", free_port()?);
    let node = spawn(
        &dir.path,
        "serve",
        &[
            "serve".into(),
            "--socket".into(),
            dir.path.join("node.sock").display().to_string(),
            "--dram-capacity".into(),
            format!("{capacity_mib}MiB"),
            "--engine".into(),
            "dram_prefault=true".into(),
            "--engine".into(),
            format!("cluster_transport={choice}"),
            "--master".into(),
            master_addr.clone(),
            "--data-addr".into(),
            data_addr.clone(),
            "--node-id".into(),
            "bench-node".into(),
        ],
        &env,
    )?;
    let client = Client::open(KvtierConfig {
        master_address: Some(master_addr.clone()),
        cluster_token: Some(token.clone()),
        cluster_request_timeout_ms: 10_000,
        cluster_transport: choice.into(),
        ..KvtierConfig::default()
    })
    .map_err(|e| format!("cluster client: {e}"))?;
    let cluster = client.cluster().ok_or("not in cluster mode")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster
        .cluster_info()
        .map(|i| i.nodes.iter().filter(|n| n.alive).count())
        .unwrap_or(0)
        == 0
    {
        if Instant::now() > deadline {
            return Err("the node did not register within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let half = largest * batch;
    let mut pool = StagingMap::create(2 * half, "bench-ucx-pool").map_err(|e| e.to_string())?;
    pool.write(0, &vec![0u8; 2 * half])
        .map_err(|e| e.to_string())?;
    let region = kvtier_client::client::register_own_memfd(&client, &pool, "bench pool")
        .map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    let mut round_id = 0u64;
    for &size in sizes {
        let bytes = size * batch;
        let mut src = vec![0u8; bytes];
        let (mut set_t, mut get_t, mut raw_t, mut copy_t) = (vec![], vec![], vec![], vec![]);
        let mut cpu = 0.0f64;
        // Touched once, so the memcpy baseline pays no page faults.
        let mut copy = vec![1u8; bytes];
        let src_refs: Vec<MemRef> = (0..batch)
            .map(|i| MemRef {
                ptr: pool.addr() + i * size,
                len: size,
            })
            .collect();
        let dst_refs: Vec<MemRef> = (0..batch)
            .map(|i| MemRef {
                ptr: pool.addr() + half + i * size,
                len: size,
            })
            .collect();
        note(
            json,
            &format!("{transport}: {size} B x {batch}, {rounds} rounds ..."),
        );
        for round in 0..rounds + 1 {
            round_id += 1;
            fill(&mut src, round_id);
            pool.write(0, &src).map_err(|e| e.to_string())?;
            let keys: Vec<String> = (0..batch).map(|i| format!("r{round_id}-{i}")).collect();
            raw_t.push(raw_tcp(&src)?);
            let started = Instant::now();
            copy.copy_from_slice(&src);
            copy_t.push(started.elapsed());
            std::hint::black_box(&copy);
            let started = Instant::now();
            let put = client.put_keys(&keys, &src_refs, None);
            let set = started.elapsed();
            if !put.ok.iter().all(|&b| b) {
                return Err(format!("{transport}: set failed: {:?}", put.errors));
            }
            let cpu0 = cpu_seconds(node.0.id());
            let started = Instant::now();
            let got = client.get_keys(&keys, &dst_refs);
            let get = started.elapsed();
            let cpu1 = cpu_seconds(node.0.id());
            if !got.ok.iter().all(|&b| b) {
                return Err(format!("{transport}: get failed: {:?}", got.errors));
            }
            let mut back = vec![0u8; bytes];
            pool.read(half, &mut back).map_err(|e| e.to_string())?;
            if back != src {
                return Err(format!("{transport}: a get returned other bytes"));
            }
            client.remove_keys(&keys);
            if round > 0 {
                set_t.push(set);
                get_t.push(get);
                cpu += cpu1 - cpu0;
            }
        }
        let peer_transport = client.stats_json()["peer_transports"]
            .as_array()
            .and_then(|l| l.first())
            .map(|p| {
                format!(
                    "get {} / set {} lanes {} ({})",
                    p["transport"], p["puts"], p["ucx_lanes"], p["reason"]
                )
            })
            .unwrap_or_else(|| "-".into());
        let total_gb = (bytes * rounds) as f64 / 1e9;
        rows.push(Row {
            transport: transport.into(),
            size,
            set_gbps: gbps(bytes as u64, p50(set_t)),
            get_gbps: gbps(bytes as u64, p50(get_t)),
            node_cpu_s_per_gb_get: cpu / total_gb.max(1e-12),
            raw_tcp_gbps: gbps(bytes as u64, p50(raw_t)),
            memcpy_gbps: gbps(bytes as u64, p50(copy_t)),
            peer_transport,
        });
    }
    client.unregister_region(region);
    drop(client);
    drop(node);
    Ok(rows)
}

/// Run the transports named (`tcp`, `ucx-tcp`, `ucx-shm`) and print the table.
pub(crate) fn run(
    names: &[String],
    sizes: &[usize],
    batch: usize,
    rounds: usize,
    json: bool,
) -> Result<std::process::ExitCode, String> {
    let mut rows = Vec::new();
    for name in names {
        let Some((transport, choice, env)) = TRANSPORTS.iter().find(|t| t.0 == name.as_str())
        else {
            return Err(format!(
                "--transport {name:?}: one of tcp, ucx-tcp, ucx-shm"
            ));
        };
        if *choice == "ucx" {
            if let Err(why) = kvtier_client::transport::ucx::ffi::Ucp::get() {
                return Err(format!("--transport {name}: {why}"));
            }
            if !kvtier_client::transport::ucx::lanes::insecure_hook() {
                eprintln!(
                    "kvtier bench cluster: --transport {name}: kvtier refuses UCX's emulated \
                     lanes (tcp, posix: any peer could read or write the processes' memory), so \
                     this measures what a `cluster_transport = \"ucx\"` client gets here \
                     (frames, see \"transport in use\"); {}=1 measures UCX itself \
                     (INSECURE: tests only)",
                    kvtier_client::transport::ucx::lanes::INSECURE_EMULATED_RMA_ENV
                );
            }
        }
        rows.extend(measure(
            transport,
            choice,
            env,
            sizes,
            batch,
            rounds.max(1),
            json,
        )?);
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&rows).map_err(|e| e.to_string())?
        );
        return Ok(std::process::ExitCode::SUCCESS);
    }
    println!(
        "kvtier bench cluster --transport: master + 1 node (child processes), client without \
         a node id; batch {batch}, median of {rounds} rounds; raw = one std TcpStream, memcpy = \
         one copy of the batch, same bytes, same rounds; node CPU over the timed gets"
    );
    println!(
        "{:<8} {:>8} {:>9} {:>9} {:>12} {:>9} {:>11}  transport in use",
        "transport", "size", "set GB/s", "get GB/s", "node CPU s/GB", "raw GB/s", "memcpy GB/s"
    );
    for r in &rows {
        println!(
            "{:<8} {:>8} {:>9.2} {:>9.2} {:>12.3} {:>9.2} {:>11.2}  {}",
            r.transport,
            format!("{}KiB", r.size >> 10),
            r.set_gbps,
            r.get_gbps,
            r.node_cpu_s_per_gb_get,
            r.raw_tcp_gbps,
            r.memcpy_gbps,
            r.peer_transport
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
