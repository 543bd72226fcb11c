//! `kvtier bench cluster`: remote set/get throughput of a cluster node over loopback TCP,
//! against the same run's raw TCP throughput (one stream, and as many streams as kvtier uses)
//! and, with `--mooncake`, against Mooncake Store over its TCP protocol
//! (scripts/bench_mooncake_store_tcp.sh) in the same run.
//!
//! - Topology: this process starts `kvtier master` and one `kvtier serve --master` node (its own
//!   executable, free loopback ports, a temp dir, a fresh token; both killed at the end, also on
//!   error) and opens a cluster-mode client with no node id, so the node is remote: every page
//!   byte of a set or get crosses a TCP connection to the node's data port.
//! - Client memory is one memfd mapping registered with the client (the host pool); a round
//!   puts a batch of fresh keys from one half and gets it back into the other half, then
//!   removes the keys. A set and a get each include their master round trips (place + commit,
//!   lookup): they are what a remote set or get costs.
//! - Raw baselines: plain `std::net::TcpStream` pairs in this process; the sender writes the
//!   same batch object by object, a receiver thread reads it into a preallocated buffer and
//!   acknowledges with one byte. Single stream (the target's reference), and N streams in
//!   parallel with N = the connections kvtier spreads that batch over (`connections_for`: at
//!   most cluster_connections_per_peer; one sender thread per stream, each taking the next
//!   object as it goes, as kvtier's connections do): the loopback's ceiling for that
//!   parallelism on this machine. Both run in every round, right before that round's set and
//!   get, so the machine's noise hits all. Figures are medians over the rounds.
//! - Every get is compared byte for byte with what was put, outside the timed part; each
//!   round's bytes differ, so a stale or misplaced object would show.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use kvtier_client::config::strict::parse_unsigned;
use kvtier_client::config::ConfigSources;
use kvtier_client::memory::StagingMap;
use kvtier_client::transport::tcp::{connections_for, write_all_vectored};
use kvtier_client::{BatchResult, Client, KvtierConfig, MemRef};
use serde_json::{json, Map};

use crate::bench::{bar, gbps, note, p50, TempDir};

/// The ratio to raw TCP that sizes from [`TARGET_MIN_SIZE`] up must reach.
const RAW_TARGET: f64 = 0.80;
const TARGET_MIN_SIZE: usize = 512 << 10;
/// kvtier / Mooncake (TCP) for set and get.
const MOONCAKE_TARGET: f64 = 2.0;
const WARMUP_ROUNDS: usize = 2;
const MOONCAKE_SCRIPT: &str = "scripts/bench_mooncake_store_tcp.sh";
const MOONCAKE_TIMEOUT: Duration = Duration::from_secs(600);
const LEASE_MS: u64 = 600;
/// Node capacity in batches of the largest size.
const NODE_BATCHES: u64 = 6;

/// Options of `kvtier bench cluster`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchClusterArgs {
    /// Object sizes, comma separated (512KiB, 1MiB, ... or bytes).
    #[arg(long, value_delimiter = ',', default_values_t = ["512KiB".to_string(), "1MiB".into(), "2MiB".into()])]
    sizes: Vec<String>,
    /// Objects per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Timed rounds per size (the median is reported), after 2 warm-up rounds.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// The client's cluster_connections_per_peer (a batch of at least 4 MiB per connection is
    /// spread over them; the config default is 4).
    #[arg(long, default_value_t = 4)]
    connections: u64,
    /// Also run Mooncake Store over TCP (scripts/bench_mooncake_store_tcp.sh) in this run and
    /// print kvtier/Mooncake ratios, if mooncake imports in --mooncake-venv.
    #[arg(long)]
    mooncake: bool,
    /// The Python venv with Mooncake (pip install mooncake-transfer-engine-non-cuda).
    #[arg(long, default_value = ".venv")]
    mooncake_venv: PathBuf,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
    /// Issue 17: compare data transports instead (tcp, ucx-tcp, ucx-shm, comma separated):
    /// set/get GB/s and node CPU per GB against raw TCP and memcpy (src/bench_ucx.rs).
    #[arg(long, value_delimiter = ',')]
    transport: Vec<String>,
}

/// A child process this benchmark started, killed (by its own pid) when dropped.
struct Spawned {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Spawned {
    fn start(
        name: &'static str,
        dir: &Path,
        args: &[String],
        env: &[(&str, &str)],
    ) -> Result<Spawned, String> {
        let exe = std::env::current_exe().map_err(|e| format!("current executable: {e}"))?;
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out
            .try_clone()
            .map_err(|e| format!("{}: {e}", log.display()))?;
        let child = Command::new(exe)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start kvtier {name}: {e}"))?;
        Ok(Spawned { name, child, log })
    }

    /// Err with its log when the process has exited.
    fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                Err(format!(
                    "kvtier {} exited ({status}):\n{}",
                    self.name,
                    tail.join("\n")
                ))
            }
            Err(e) => Err(format!("kvtier {}: {e}", self.name)),
        }
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_loopback_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free loopback port: {e}"))
}

/// `kvtier master` plus one `kvtier serve --master` node, both child processes.
struct LocalCluster {
    master_addr: String,
    token: String,
    // Dropped (killed) node first, then the master.
    node: Spawned,
    master: Spawned,
}

impl LocalCluster {
    fn start(dir: &Path, node_capacity: u64) -> Result<LocalCluster, String> {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let token = format!("bench-{}-{nanos:x}", std::process::id());
        let master_addr = format!("127.0.0.1:{}", free_loopback_port()?);
        let mut master = Spawned::start(
            "master",
            dir,
            &[
                "master".into(),
                "--listen".into(),
                master_addr.clone(),
                // Heartbeats every 200 ms: the master sees the room freed by each round's
                // removes soon (see `wait_for_room`).
                "--lease-ms".into(),
                LEASE_MS.to_string(),
            ],
            &[("KVTIER_CLUSTER_TOKEN", &token)],
        )?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(&master_addr).is_err() {
            master.check_alive()?;
            if Instant::now() > deadline {
                return Err(format!("kvtier master did not listen on {master_addr}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let data_addr = format!("127.0.0.1:{}", free_loopback_port()?);
        let socket = dir.join("node.sock");
        let node = Spawned::start(
            "serve",
            dir,
            &[
                "serve".into(),
                "--socket".into(),
                socket.display().to_string(),
                "--dram-capacity".into(),
                format!("{}MiB", node_capacity >> 20),
                "--engine".into(),
                "dram_prefault=true".into(),
                "--master".into(),
                master_addr.clone(),
                "--data-addr".into(),
                data_addr,
                "--node-id".into(),
                "bench-node".into(),
            ],
            &[("KVTIER_CLUSTER_TOKEN", &token)],
        )?;
        Ok(LocalCluster {
            master_addr,
            token,
            node,
            master,
        })
    }

    /// A cluster client with no node id (so the node is remote), once the node is registered.
    fn client(&mut self, connections: u64) -> Result<Client, String> {
        let mut extra = Map::new();
        extra.insert("master_address".into(), json!(self.master_addr));
        extra.insert("cluster_connections_per_peer".into(), json!(connections));
        extra.insert("cluster_request_timeout_ms".into(), json!(10_000));
        // The token as a process would get it (issue 26: never in extra_config).
        let config = KvtierConfig::load(ConfigSources {
            env: vec![("KVTIER_CLUSTER_TOKEN".into(), self.token.clone())],
            extra,
        })
        .map_err(|e| e.to_string())?;
        let client = Client::open(config).map_err(|e| format!("cluster client: {e}"))?;
        let cluster = client
            .cluster()
            .ok_or("the client did not open in cluster mode")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let alive = cluster
                .cluster_info()
                .map(|info| info.nodes.iter().filter(|n| n.alive).count())
                .unwrap_or(0);
            if alive >= 1 {
                return Ok(client);
            }
            self.node.check_alive()?;
            self.master.check_alive()?;
            if Instant::now() > deadline {
                return Err("the node did not register with the master within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The raw baseline: one TCP stream in this process, a receiver thread reading into a
/// preallocated buffer.
struct RawTcp {
    tx: TcpStream,
    rx: Option<JoinHandle<io::Result<()>>>,
}

/// A raw message: `[total, object, flags]` (little-endian u64s), then `total` bytes, which the
/// receiver reads in `object`-sized reads at its running offset; with [`RAW_ACK`] it answers
/// one byte and starts again at offset 0.
const RAW_HEAD: usize = 24;
const RAW_ACK: u64 = 1;

fn raw_head(total: usize, object: usize, flags: u64) -> [u8; RAW_HEAD] {
    let mut head = [0u8; RAW_HEAD];
    head[..8].copy_from_slice(&(total as u64).to_le_bytes());
    head[8..16].copy_from_slice(&(object as u64).to_le_bytes());
    head[16..].copy_from_slice(&flags.to_le_bytes());
    head
}

impl RawTcp {
    fn start(capacity: usize) -> io::Result<RawTcp> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let tx = TcpStream::connect(listener.local_addr()?)?;
        tx.set_nodelay(true)?;
        let (mut rx, _) = listener.accept()?;
        rx.set_nodelay(true)?;
        let handle = std::thread::Builder::new()
            .name("kvtier-bench-raw-rx".into())
            .spawn(move || -> io::Result<()> {
                let mut buf = vec![1u8; capacity];
                let mut pos = 0usize;
                loop {
                    let mut head = [0u8; RAW_HEAD];
                    match rx.read_exact(&mut head) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                        Err(e) => return Err(e),
                    }
                    let field = |i: usize| {
                        u64::from_le_bytes(head[i * 8..(i + 1) * 8].try_into().unwrap_or_default())
                    };
                    let (total, object, flags) = (field(0) as usize, field(1) as usize, field(2));
                    let dst = buf
                        .get_mut(pos..pos + total)
                        .ok_or_else(|| io::Error::other("raw batch larger than the buffer"))?;
                    for chunk in dst.chunks_mut(object.max(1)) {
                        rx.read_exact(chunk)?;
                    }
                    pos += total;
                    if flags & RAW_ACK != 0 {
                        rx.write_all(&[1])?;
                        pos = 0;
                    }
                }
            })?;
        Ok(RawTcp {
            tx,
            rx: Some(handle),
        })
    }

    /// Move `data` (objects of `object` bytes) to the receiver; the time until its ack.
    fn send(&mut self, data: &[u8], object: usize) -> io::Result<Duration> {
        let t = Instant::now();
        self.tx.write_all(&raw_head(data.len(), object, RAW_ACK))?;
        for chunk in data.chunks(object.max(1)) {
            self.tx.write_all(chunk)?;
        }
        self.wait_ack()?;
        Ok(t.elapsed())
    }

    /// Send one object as its own message (no ack).
    fn send_object(&mut self, object: &[u8]) -> io::Result<()> {
        let head = raw_head(object.len(), object.len(), 0);
        write_all_vectored(
            &mut self.tx,
            &mut [IoSlice::new(&head), IoSlice::new(object)],
        )
    }

    /// Ask for the ack of everything sent and wait for it.
    fn finish(&mut self) -> io::Result<()> {
        self.tx.write_all(&raw_head(0, 0, RAW_ACK))?;
        self.wait_ack()
    }

    fn wait_ack(&mut self) -> io::Result<()> {
        let mut ack = [0u8; 1];
        self.tx.read_exact(&mut ack)
    }
}

/// The raw baseline over several streams in parallel.
struct RawStreams {
    streams: Vec<RawTcp>,
}

impl RawStreams {
    fn start(n: usize, capacity: usize) -> io::Result<RawStreams> {
        let streams = (0..n.max(1))
            .map(|_| RawTcp::start(capacity))
            .collect::<io::Result<_>>()?;
        Ok(RawStreams { streams })
    }

    /// Move `data` (objects of `object` bytes) over the first `n` streams, one sender thread
    /// each taking the next object as it goes (as kvtier's connections do, so a thread that
    /// starts late sends less); the time until every stream's ack.
    fn send(&mut self, data: &[u8], object: usize, n: usize) -> io::Result<Duration> {
        let n = n.clamp(1, self.streams.len());
        let objects: Vec<&[u8]> = data.chunks(object.max(1)).collect();
        let next = AtomicUsize::new(0);
        let run = |stream: &mut RawTcp| -> io::Result<()> {
            while let Some(o) = objects.get(next.fetch_add(1, Ordering::Relaxed)) {
                stream.send_object(o)?;
            }
            stream.finish()
        };
        let t = Instant::now();
        std::thread::scope(|scope| {
            let mut streams = self.streams.iter_mut().take(n);
            let first = streams.next();
            let handles: Vec<_> = streams.map(|s| scope.spawn(|| run(s))).collect();
            let mut result = first.map_or(Ok(()), run);
            for h in handles {
                let joined = h
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("raw sender thread panicked")));
                result = result.and(joined);
            }
            result
        })?;
        Ok(t.elapsed())
    }
}

/// How many connections the client spreads a batch of `bytes` over (the transport's own rule).
fn connections_used(connections: u64, batch: usize, bytes: usize) -> usize {
    connections_for(
        usize::try_from(connections).unwrap_or(usize::MAX),
        batch,
        bytes,
    )
}

impl Drop for RawTcp {
    fn drop(&mut self) {
        let _ = self.tx.shutdown(Shutdown::Both);
        if let Some(h) = self.rx.take() {
            let _ = h.join();
        }
    }
}

/// Fill `buf` with bytes unique to (`seed`, position).
fn pattern(buf: &mut [u8], seed: u64) {
    let mut chunks = buf.chunks_exact_mut(8);
    for (i, chunk) in chunks.by_ref().enumerate() {
        let v = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
        chunk.copy_from_slice(&v.to_le_bytes());
    }
    chunks.into_remainder().fill(seed as u8);
}

fn label(size: usize) -> String {
    if size >= 1 << 20 && size.is_multiple_of(1 << 20) {
        format!("{} MiB", size >> 20)
    } else if size.is_multiple_of(1024) {
        format!("{} KiB", size >> 10)
    } else {
        format!("{size} B")
    }
}

#[derive(serde::Serialize)]
struct Row {
    size_bytes: usize,
    size: String,
    set_gbps: f64,
    get_gbps: f64,
    raw_tcp_gbps: f64,
    /// Median of the per-round ratios to the same round's raw TCP send.
    set_vs_raw: f64,
    get_vs_raw: f64,
    /// Streams of the N-stream raw baseline (= connections kvtier used for the batch).
    raw_streams: usize,
    raw_n_gbps: f64,
    set_vs_raw_n: f64,
    get_vs_raw_n: f64,
    /// Whether the >= 0.80-of-raw target applies (objects of 512 KiB and more) and is met.
    raw_target: Option<bool>,
    mooncake_put_gbps: Option<f64>,
    mooncake_get_gbps: Option<f64>,
    set_vs_mooncake: Option<f64>,
    get_vs_mooncake: Option<f64>,
    mooncake_target: Option<bool>,
    /// Per round, in order (GB/s).
    rounds_set_gbps: Vec<f64>,
    rounds_get_gbps: Vec<f64>,
    rounds_raw_gbps: Vec<f64>,
    rounds_raw_n_gbps: Vec<f64>,
}

#[derive(serde::Serialize)]
struct Report {
    topology: String,
    batch: usize,
    rounds: usize,
    connections_per_peer: u64,
    mooncake: String,
    rows: Vec<Row>,
}

/// Mooncake's figures per size in KiB: (put, get) GB/s.
type MooncakeFigures = BTreeMap<u64, (f64, f64)>;

fn mooncake_script() -> Option<PathBuf> {
    let here = PathBuf::from(MOONCAKE_SCRIPT);
    if here.is_file() {
        return Some(here);
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(MOONCAKE_SCRIPT);
    repo.is_file().then_some(repo)
}

/// Run the Mooncake baseline; `Ok(Err(reason))` when it cannot run here (not installed).
fn run_mooncake(venv: &Path, dir: &Path) -> Result<Result<MooncakeFigures, String>, String> {
    let python = venv.join("bin/python");
    let importable = Command::new(&python)
        .args(["-c", "import mooncake.store"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !importable {
        return Ok(Err(format!(
            "mooncake does not import in {} (python3 -m venv V && V/bin/pip install \
             mooncake-transfer-engine-non-cuda, then --mooncake-venv V); skipped",
            python.display()
        )));
    }
    let Some(script) = mooncake_script() else {
        return Ok(Err(format!("{MOONCAKE_SCRIPT} not found; skipped")));
    };
    let out = dir.join("mooncake.json");
    let mut child = Command::new("bash")
        .arg(&script)
        .arg(venv)
        .arg("--json")
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::from(io::stderr()))
        .stderr(Stdio::from(io::stderr()))
        .spawn()
        .map_err(|e| format!("bash {}: {e}", script.display()))?;
    let deadline = Instant::now() + MOONCAKE_TIMEOUT;
    let status = loop {
        match child.try_wait().map_err(|e| e.to_string())? {
            Some(status) => break status,
            None if Instant::now() > deadline => {
                // SIGTERM, so that the script's trap stops the Mooncake processes it started.
                let _ = Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .status();
                let _ = child.wait();
                return Err(format!(
                    "{} did not finish in {} s",
                    script.display(),
                    MOONCAKE_TIMEOUT.as_secs()
                ));
            }
            None => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    if !status.success() {
        return Err(format!("{} failed ({status})", script.display()));
    }
    let text = std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut figures = MooncakeFigures::new();
    if let Some(sizes) = v.get("sizes").and_then(|s| s.as_object()) {
        for (kib, f) in sizes {
            let (Ok(kib), Some(put), Some(get)) = (
                kib.parse::<u64>(),
                f.get("put_gbps").and_then(|x| x.as_f64()),
                f.get("get_gbps").and_then(|x| x.as_f64()),
            ) else {
                continue;
            };
            figures.insert(kib, (put, get));
        }
    }
    Ok(Ok(figures))
}

fn median_gbps(bytes: usize, times: &[Duration]) -> f64 {
    gbps(bytes as u64, p50(times.to_vec()))
}

/// Median over rounds of throughput(`times`) / throughput(`raw`), i.e. raw time / time.
fn median_ratio(raw: &[Duration], times: &[Duration]) -> f64 {
    let mut r: Vec<f64> = raw
        .iter()
        .zip(times)
        .map(|(raw, t)| raw.as_secs_f64() / t.as_secs_f64().max(1e-12))
        .collect();
    r.sort_by(f64::total_cmp);
    r.get(r.len() / 2).copied().unwrap_or(0.0)
}

/// Err naming the first failures unless every object of the batch succeeded.
fn all_ok(what: &str, result: &BatchResult, batch: usize) -> Result<(), String> {
    let failed = batch.saturating_sub(result.succeeded());
    if failed == 0 {
        return Ok(());
    }
    Err(format!(
        "{what} of {batch} objects: {failed} failed: {:?}",
        result.errors.iter().take(3).collect::<Vec<_>>()
    ))
}

/// Wait (untimed) until the master's view of the node's free space fits `need` bytes: it
/// learns what the previous rounds' removes freed from the node's next heartbeat.
fn wait_for_room(client: &Client, need: u64) {
    let Some(cluster) = client.cluster() else {
        return;
    };
    let deadline = Instant::now() + Duration::from_millis(LEASE_MS * 5);
    while Instant::now() < deadline {
        let free = cluster
            .cluster_info()
            .map(|info| {
                info.nodes
                    .iter()
                    .filter(|n| n.alive)
                    .map(|n| n.free_bytes)
                    .max()
                    .unwrap_or(0)
            })
            .unwrap_or(0);
        if free >= need {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One size: `rounds` (+ warm-up) of raw send, kvtier set, kvtier get (verified), remove.
#[allow(clippy::too_many_arguments)]
fn measure_size(
    client: &Client,
    pool: &mut StagingMap,
    raw: &mut RawTcp,
    raw_n: &mut RawStreams,
    connections: u64,
    size: usize,
    batch: usize,
    rounds: usize,
    half: usize,
    json: bool,
) -> Result<Row, String> {
    let bytes = size * batch;
    let streams = connections_used(connections, batch, bytes);
    let mut src = vec![0u8; bytes];
    let mut check = vec![0u8; bytes];
    let bufs = |base: usize| -> Vec<MemRef> {
        (0..batch)
            .map(|i| MemRef {
                ptr: base + i * size,
                len: size,
            })
            .collect()
    };
    let (put_bufs, get_bufs) = (bufs(pool.addr()), bufs(pool.addr() + half));
    let total = rounds + WARMUP_ROUNDS;
    note(
        json,
        &format!(
            "{}: {total} rounds of {batch} objects (raw TCP x1 and x{streams}, set, get) ...",
            label(size)
        ),
    );
    let pb = bar(
        (total * bytes * 4) as u64,
        &format!("cluster {}", label(size)),
    );
    let (mut raw_t, mut raw_n_t, mut set_t, mut get_t) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..total {
        pattern(&mut src, ((round as u64) << 32) ^ size as u64);
        pool.write(0, &src).map_err(|e| e.to_string())?;
        let keys: Vec<String> = (0..batch)
            .map(|i| format!("bench-cluster/{size}/{round}/{i}"))
            .collect();

        wait_for_room(client, 2 * bytes as u64);
        let r = raw
            .send(&src, size)
            .map_err(|e| format!("raw TCP baseline: {e}"))?;
        pb.inc(bytes as u64);
        let rn = raw_n
            .send(&src, size, streams)
            .map_err(|e| format!("raw TCP x{streams} baseline: {e}"))?;
        pb.inc(bytes as u64);
        let t = Instant::now();
        let put = client.put_keys(&keys, &put_bufs, None);
        let s = t.elapsed();
        all_ok("set", &put, batch)?;
        pb.inc(bytes as u64);
        let t = Instant::now();
        let got = client.get_keys(&keys, &get_bufs);
        let g = t.elapsed();
        all_ok("get", &got, batch)?;
        pb.inc(bytes as u64);
        pool.read(half, &mut check).map_err(|e| e.to_string())?;
        if let Some(bad) = (0..batch).find(|&i| {
            let r = i * size..(i + 1) * size;
            check[r.clone()] != src[r]
        }) {
            return Err(format!(
                "get returned different bytes for {} (round {round})",
                keys[bad]
            ));
        }
        client.remove_keys(&keys);
        if round >= WARMUP_ROUNDS {
            raw_t.push(r);
            raw_n_t.push(rn);
            set_t.push(s);
            get_t.push(g);
        }
    }
    pb.finish_and_clear();
    let per_round =
        |v: &[Duration]| -> Vec<f64> { v.iter().map(|d| gbps(bytes as u64, *d)).collect() };
    let (set, get, raw) = (
        median_gbps(bytes, &set_t),
        median_gbps(bytes, &get_t),
        median_gbps(bytes, &raw_t),
    );
    // Ratios: the median of each round's ratio to the raw send of the same round (adjacent
    // in time), which drifting load disturbs less than a ratio of two medians.
    let (set_vs_raw, get_vs_raw) = (median_ratio(&raw_t, &set_t), median_ratio(&raw_t, &get_t));
    let (set_vs_raw_n, get_vs_raw_n) = (
        median_ratio(&raw_n_t, &set_t),
        median_ratio(&raw_n_t, &get_t),
    );
    Ok(Row {
        size_bytes: size,
        size: label(size),
        set_gbps: set,
        get_gbps: get,
        raw_tcp_gbps: raw,
        set_vs_raw,
        get_vs_raw,
        raw_streams: streams,
        raw_n_gbps: median_gbps(bytes, &raw_n_t),
        set_vs_raw_n,
        get_vs_raw_n,
        raw_target: (size >= TARGET_MIN_SIZE)
            .then_some(set_vs_raw >= RAW_TARGET && get_vs_raw >= RAW_TARGET),
        mooncake_put_gbps: None,
        mooncake_get_gbps: None,
        set_vs_mooncake: None,
        get_vs_mooncake: None,
        mooncake_target: None,
        rounds_set_gbps: per_round(&set_t),
        rounds_get_gbps: per_round(&get_t),
        rounds_raw_gbps: per_round(&raw_t),
        rounds_raw_n_gbps: per_round(&raw_n_t),
    })
}

fn verdict(pass: Option<bool>) -> &'static str {
    match pass {
        Some(true) => "ok",
        Some(false) => "MISS",
        None => "-",
    }
}

/// `kvtier bench cluster`.
pub(crate) fn run(args: BenchClusterArgs) -> Result<ExitCode, String> {
    let batch = args.batch.max(1);
    let rounds = args.rounds.max(1);
    let mut sizes = Vec::new();
    for s in &args.sizes {
        let n = parse_unsigned(s, true).map_err(|e| format!("--sizes: {e}"))?;
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n > 0 && n <= 64 << 20)
            .ok_or_else(|| format!("--sizes: {s} must be from 1 B to 64 MiB"))?;
        sizes.push(n);
    }
    let max = sizes
        .iter()
        .copied()
        .max()
        .ok_or("--sizes: no size given")?;
    if !args.transport.is_empty() {
        return crate::bench_ucx::run(&args.transport, &sizes, batch, rounds, args.json);
    }
    let half = max * batch;
    // Each round's keys are removed after it; room for a few batches all the same.
    let node_capacity = ((half as u64 * NODE_BATCHES).max(256 << 20)).next_multiple_of(1 << 20);

    let dir = TempDir::new(None, "cluster")?;
    let mut cluster = LocalCluster::start(&dir.path, node_capacity)?;
    note(
        args.json,
        "waiting for the node to register with the master ...",
    );
    let client = cluster.client(args.connections)?;
    let mut pool = StagingMap::create(2 * half, "bench-cluster-pool").map_err(|e| e.to_string())?;
    // Touch every page once, so no round pays for page faults.
    let zeros = vec![0u8; 2 * half];
    pool.write(0, &zeros).map_err(|e| e.to_string())?;
    let region = kvtier_client::client::register_own_memfd(&client, &pool, "bench pool")
        .map_err(|e| e.to_string())?;
    let mut raw = RawTcp::start(half).map_err(|e| format!("raw TCP baseline: {e}"))?;
    let max_streams = sizes
        .iter()
        .map(|&size| connections_used(args.connections, batch, size * batch))
        .max()
        .unwrap_or(1);
    let mut raw_n = RawStreams::start(max_streams, half)
        .map_err(|e| format!("raw TCP x{max_streams} baseline: {e}"))?;

    let mut rows = Vec::new();
    for &size in &sizes {
        let row = measure_size(
            &client,
            &mut pool,
            &mut raw,
            &mut raw_n,
            args.connections,
            size,
            batch,
            rounds,
            half,
            args.json,
        );
        match row {
            Ok(row) => {
                note(
                    args.json,
                    &format!(
                        "{}: set {:.2} GB/s, get {:.2} GB/s, raw TCP {:.2} GB/s (x{}: {:.2} GB/s)",
                        row.size,
                        row.set_gbps,
                        row.get_gbps,
                        row.raw_tcp_gbps,
                        row.raw_streams,
                        row.raw_n_gbps
                    ),
                );
                rows.push(row);
            }
            Err(e) => {
                // Name a child that died (its log tail) rather than only the symptom.
                let died = cluster
                    .node
                    .check_alive()
                    .and_then(|()| cluster.master.check_alive());
                return Err(match died {
                    Err(why) => format!("{e}\n{why}"),
                    Ok(()) => e,
                });
            }
        }
    }
    drop(raw);
    drop(raw_n);
    client.unregister_region(region);
    drop(client);
    drop(cluster);

    let mooncake = if args.mooncake {
        note(args.json, "Mooncake Store over TCP (same run) ...");
        match run_mooncake(&args.mooncake_venv, &dir.path)? {
            Ok(figures) => {
                for row in &mut rows {
                    if !row.size_bytes.is_multiple_of(1024) {
                        continue;
                    }
                    if let Some(&(put, get)) = figures.get(&((row.size_bytes as u64) >> 10)) {
                        row.mooncake_put_gbps = Some(put);
                        row.mooncake_get_gbps = Some(get);
                        row.set_vs_mooncake = Some(row.set_gbps / put);
                        row.get_vs_mooncake = Some(row.get_gbps / get);
                        row.mooncake_target = Some(
                            row.set_gbps / put >= MOONCAKE_TARGET
                                && row.get_gbps / get >= MOONCAKE_TARGET,
                        );
                    }
                }
                format!(
                    "ran {} ({} venv), same machine, after the kvtier rounds; set/mc and get/mc are \
                     ratios of medians (not of the same rounds)",
                    MOONCAKE_SCRIPT,
                    args.mooncake_venv.display()
                )
            }
            Err(reason) => reason,
        }
    } else {
        "not run (--mooncake)".to_string()
    };

    let report = Report {
        topology: "kvtier master + 1 kvtier serve node (child processes), cluster client \
                   without a node id: every page byte crosses loopback TCP"
            .into(),
        batch,
        rounds,
        connections_per_peer: args.connections,
        mooncake,
        rows,
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "kvtier bench cluster: {}; batch {}, median of {} rounds, {} connections per peer; \
         raw = one std TcpStream in this process, rawN = N streams in parallel (N = the \
         connections kvtier used), same bytes, same rounds; ratios = median of per-round \
         ratios; target on the single stream",
        report.topology, report.batch, report.rounds, report.connections_per_peer
    );
    println!(
        "{:<8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>8} {:>5} {:>3} {:>10} {:>9} {:>9}",
        "size",
        "set GB/s",
        "get GB/s",
        "raw GB/s",
        "set/raw",
        "get/raw",
        "target",
        "",
        "N",
        "rawN GB/s",
        "set/rawN",
        "get/rawN"
    );
    for r in &report.rows {
        println!(
            "{:<8} {:>9.2} {:>9.2} {:>9.2} {:>8.2} {:>8.2} {:>8} {:>5} {:>3} {:>10.2} {:>9.2} {:>9.2}",
            r.size,
            r.set_gbps,
            r.get_gbps,
            r.raw_tcp_gbps,
            r.set_vs_raw,
            r.get_vs_raw,
            if r.raw_target.is_some() {
                ">= 0.80"
            } else {
                "-"
            },
            verdict(r.raw_target),
            r.raw_streams,
            r.raw_n_gbps,
            r.set_vs_raw_n,
            r.get_vs_raw_n
        );
    }
    println!("mooncake: {}", report.mooncake);
    if report.rows.iter().any(|r| r.mooncake_put_gbps.is_some()) {
        println!(
            "{:<8} {:>9} {:>9} {:>8} {:>8} {:>8} {:>5}",
            "size", "mc put", "mc get", "set/mc", "get/mc", "target", ""
        );
        for r in &report.rows {
            if let (Some(put), Some(get), Some(sr), Some(gr)) = (
                r.mooncake_put_gbps,
                r.mooncake_get_gbps,
                r.set_vs_mooncake,
                r.get_vs_mooncake,
            ) {
                println!(
                    "{:<8} {:>9.2} {:>9.2} {:>8.2} {:>8.2} {:>8} {:>5}",
                    r.size,
                    put,
                    get,
                    sr,
                    gr,
                    ">= 2.00",
                    verdict(r.mooncake_target)
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
