//! The `serve`, `stat`, `inspect` and `bench server` subcommands (wired into the `kvtier`
//! binary).

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use kvtier_proto::frame::{FLAG_ERROR, PROTOCOL_VERSION};
use kvtier_proto::server::{InspectQuery, TextReply};
use kvtier_proto::{encode_frame, read_frame, Decode, ErrorReply, Handshake, Opcode};
use serde_json::{Map, Value};

use crate::config::{ServerConfig, ServerSources};
use crate::server::Server;

/// Every server key with its default, for `kvtier serve --help` (keys go in the --config file
/// at top level or in KVTIER_SERVE_<KEY>; docs/security.md says what each bound protects).
const SERVER_KEYS_HELP: &str = "\
Server keys (--config file top level, or KVTIER_SERVE_<KEY>), with defaults:
  socket                       $XDG_RUNTIME_DIR/kvtier.sock, else /tmp/kvtier-<uid>/kvtier.sock
                               (that directory created 0700 and refused if foreign)
  socket_mode                  \"0600\"     socket_group               none
  max_connections              1024       max_connections_per_uid    256 (by SO_PEERCRED uid)
                               (both 1..=1048576)
  handshake_timeout_ms         10000 (1..=3600000; a connection without a session by then is
                               closed)
  max_regions_per_client       4096 (1..=1048576)
  max_mapped_bytes_per_client  half of physical memory (reserved before mapping)
  max_mapped_bytes_total       physical memory (all sessions together)
  max_mapped_bytes_per_uid     half of physical memory (all sessions of one uid)
  prefault_regions             true (sparse memfds are never pre-faulted)
  tenant_dram_quota            none, e.g. a=8GiB,b=2GiB
  tenant_ssd_quota             none, e.g. a=64GiB (tenants with a DRAM partition)
  tenant_access                none, e.g. \"a=uid:1001 gid:2000,b=uid:1002\": a listed tenant is
                               opened only by those peers or an operator; unlisted tenants
                               are accounting labels
  operator_uids                none (operators: the server's uid, root, these): only they see
                               other tenants' sessions in Stats and may Inspect
  metrics_addr                 none
  host_events_endpoint         none: the host KV-event stream (vLLM's ZMQ PUB protocol), e.g.
                               tcp://127.0.0.1:5557 (an IP literal; it reveals keys: bind where
                               only trusted routers reach, see docs/security.md)
  host_events_replay_endpoint  none (ROUTER replay socket, vLLM's protocol)
  host_events_topic            \"\"        host_events_buffer_batches 10000 (1..=1048576)
  host_events_max_subscribers  64 per endpoint (1..=4096)
  host_events_subscriber_queue 1024 batches (1..=1048576; then the subscriber loses batches)
  host_events_interval_ms      50 (1..=60000)   host_events_engine_ring  1048576 events
  host_events_node             cluster node_id, else the host name (events' ownership)
Engine keys (e.g. ssd_storage_dir, default /var/tmp/kvtier-ssd-<uid>, created 0700) go in the
[engine] table, KVTIER_<KEY> or --engine KEY=VALUE. Threat model: docs/security.md.";

/// `kvtier serve`: run the local cache server until SIGTERM / SIGINT.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = SERVER_KEYS_HELP)]
pub struct ServeArgs {
    /// Unix socket path (default: $XDG_RUNTIME_DIR/kvtier.sock, else
    /// `/tmp/kvtier-<uid>/kvtier.sock` in a 0700 directory owned by this user).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// TOML file: server keys at top level, engine keys in an `[engine]` table.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Socket file mode, octal (default 0600).
    #[arg(long)]
    pub socket_mode: Option<String>,
    /// Group for the socket (name or gid), e.g. with --socket-mode 0660.
    #[arg(long)]
    pub socket_group: Option<String>,
    /// DRAM arena of the shared store (engine key dram_capacity_bytes), e.g. 8GiB.
    #[arg(long)]
    pub dram_capacity: Option<String>,
    /// A tenant's own DRAM partition, TENANT=SIZE (repeatable).
    #[arg(long = "tenant-quota", value_name = "TENANT=SIZE")]
    pub tenant_quota: Vec<String>,
    /// The SSD bound of a tenant's partition, TENANT=SIZE (repeatable; needs --tenant-quota).
    #[arg(long = "tenant-ssd-quota", value_name = "TENANT=SIZE")]
    pub tenant_ssd_quota: Vec<String>,
    /// Any engine key, KEY=VALUE (repeatable), e.g. --engine eviction_policy=lru.
    #[arg(long = "engine", value_name = "KEY=VALUE")]
    pub engine: Vec<String>,
    /// Cluster mode: the `kvtier master` address(es), host:port, comma-separated (engine key
    /// master_address). Needs --data-addr and a cluster_token (KVTIER_CLUSTER_TOKEN), which the
    /// node proves to the masters and to peers without sending it. Its data port cuts a
    /// connection that has not finished the handshake within 5 s, and keeps at most 1024
    /// connections open, 128 of them handshaking (fewer under a low RLIMIT_NOFILE).
    #[arg(long)]
    pub master: Option<String>,
    /// Cluster mode: the data port peers reach this node on, HOST:PORT (engine key
    /// node_address).
    #[arg(long)]
    pub data_addr: Option<String>,
    /// Cluster mode: the id this node registers under (default: node-HOST:PORT).
    #[arg(long)]
    pub node_id: Option<String>,
    /// Cluster mode: comma-separated tags this node registers with.
    #[arg(long)]
    pub node_tags: Option<String>,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: a free port, printed
    /// at startup).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
    /// Issue 30: publish this host's KV events (vLLM's ZMQ PUB protocol) at tcp://IP:PORT
    /// (server key host_events_endpoint; port 0: a free port, printed at startup).
    #[arg(long, value_name = "tcp://IP:PORT")]
    pub host_events_endpoint: Option<String>,
    /// Issue 30: the replay (ROUTER) endpoint of the host KV-event stream, tcp://IP:PORT.
    #[arg(long, value_name = "tcp://IP:PORT")]
    pub host_events_replay_endpoint: Option<String>,
    /// Seconds to wait for running requests at shutdown.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
}

/// `kvtier stat`: print a running server's live stats.
#[derive(Debug, Clone, clap::Args)]
pub struct StatArgs {
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// A cluster instead of one server: the `kvtier master` address(es), comma-separated
    /// (nodes, leases, leader, directory size as the leader sees them). Needs the cluster
    /// token: KVTIER_CLUSTER_TOKEN, or cluster_token in KVTIER_CONFIG_FILE.
    #[arg(long, conflicts_with = "socket")]
    pub master: Option<String>,
    /// Print the whole JSON document instead of the summary.
    #[arg(long)]
    pub json: bool,
}

/// `kvtier inspect`: which tiers of a running server hold a key, or every key under a prefix.
#[derive(Debug, Clone, clap::Args)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["key", "prefix"])))]
pub struct InspectArgs {
    /// Exact object keys, as the client named them (`<page_hash>@<fingerprint>...<pool>`).
    pub key: Vec<String>,
    /// List every object whose key starts with this (e.g. a page hash; "" lists the tenant).
    #[arg(long)]
    pub prefix: Option<String>,
    /// The tenant whose keys these are (the client's extra_backend_tag; default: none). With
    /// --master: the cluster namespace (cluster clients' extra_backend_tag).
    #[arg(long, default_value = "")]
    pub tenant: String,
    /// Send KEY and --prefix as stored, without the tenant namespace (e.g. --prefix "" over
    /// every tenant).
    #[arg(long, conflicts_with = "tenant")]
    pub raw: bool,
    /// At most this many keys per store under --prefix (the server caps it at 10000).
    #[arg(long, default_value_t = 1000)]
    pub limit: u64,
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// A cluster instead of one server: ask the `kvtier master` (comma-separated addresses)
    /// which nodes hold each KEY (exact keys only). Needs the cluster token:
    /// KVTIER_CLUSTER_TOKEN, or cluster_token in KVTIER_CONFIG_FILE.
    #[arg(long, conflicts_with = "socket")]
    pub master: Option<String>,
    /// Print the server's JSON document instead of the table.
    #[arg(long)]
    pub json: bool,
}

fn key_value(item: &str, what: &str) -> Result<(String, String), String> {
    item.split_once('=')
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .ok_or_else(|| format!("{what} {item:?} is not KEY=VALUE"))
}

/// Build the configuration of `kvtier serve` from its flags and the process environment.
pub fn serve_config(args: &ServeArgs) -> Result<ServerConfig, String> {
    let mut flags = Map::new();
    if let Some(socket) = &args.socket {
        flags.insert("socket".into(), Value::String(socket.display().to_string()));
    }
    if let Some(mode) = &args.socket_mode {
        flags.insert("socket_mode".into(), Value::String(mode.clone()));
    }
    if let Some(group) = &args.socket_group {
        flags.insert("socket_group".into(), Value::String(group.clone()));
    }
    if let Some(addr) = &args.metrics_addr {
        flags.insert("metrics_addr".into(), Value::String(addr.clone()));
    }
    if let Some(ep) = &args.host_events_endpoint {
        flags.insert("host_events_endpoint".into(), Value::String(ep.clone()));
    }
    if let Some(ep) = &args.host_events_replay_endpoint {
        flags.insert(
            "host_events_replay_endpoint".into(),
            Value::String(ep.clone()),
        );
    }
    if !args.tenant_quota.is_empty() {
        flags.insert(
            "tenant_dram_quota".into(),
            Value::String(args.tenant_quota.join(",")),
        );
    }
    if !args.tenant_ssd_quota.is_empty() {
        flags.insert(
            "tenant_ssd_quota".into(),
            Value::String(args.tenant_ssd_quota.join(",")),
        );
    }
    let mut engine_flags = Map::new();
    if let Some(size) = &args.dram_capacity {
        engine_flags.insert("dram_capacity_bytes".into(), Value::String(size.clone()));
    }
    for item in &args.engine {
        let (k, v) = key_value(item, "--engine")?;
        engine_flags.insert(k, Value::String(v));
    }
    for (key, value) in [
        ("master_address", &args.master),
        ("node_address", &args.data_addr),
        ("node_id", &args.node_id),
        ("node_tags", &args.node_tags),
    ] {
        if let Some(v) = value {
            engine_flags.insert(key.into(), Value::String(v.clone()));
        }
    }
    // Issue 26: `vars_os`, so a non-UTF-8 variable of another program cannot panic the server.
    let env = kvtier_store::config::process_env().map_err(|e| e.to_string())?;
    ServerConfig::load(ServerSources {
        file: args.config.clone(),
        env,
        flags,
        engine_flags,
    })
    .map_err(|e| e.to_string())
}

/// Bytes as the operator reads them: `64 GiB`, `23.5 GiB`, `512 MiB`, `4096 bytes`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "TiB"),
        (1 << 30, "GiB"),
        (1 << 20, "MiB"),
        (1 << 10, "KiB"),
    ];
    for (size, unit) in UNITS {
        if n >= size {
            let v = n as f64 / size as f64;
            return if n.is_multiple_of(size) {
                format!("{} {unit}", n / size)
            } else {
                format!("{v:.1} {unit}")
            };
        }
    }
    format!("{n} bytes")
}

/// `MemTotal` of /proc/meminfo, when it can be read.
fn mem_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = text
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib << 10)
}

/// Issue 27: everything `kvtier serve` can check without opening a store, checked before the
/// DRAM arena is mapped and pre-faulted (which takes seconds per GiB): the cluster flags and
/// the DRAM the stores would map against the host's memory. Returns the data address.
pub fn check_serve_config(config: &ServerConfig) -> Result<Option<std::net::SocketAddr>, String> {
    let settings = &config.engine;
    let dram = settings.engine.dram_capacity_bytes;
    let partitions: u64 = config.settings.tenant_dram_quota.values().sum();
    if let Some(total) = mem_total() {
        if dram.saturating_add(partitions) > total {
            return Err(if partitions == 0 {
                format!(
                    "dram_capacity_bytes {} exceeds physical memory {}",
                    human_bytes(dram),
                    human_bytes(total)
                )
            } else {
                format!(
                    "dram_capacity_bytes {} plus tenant_dram_quota partitions {} exceed physical memory {}",
                    human_bytes(dram),
                    human_bytes(partitions),
                    human_bytes(total)
                )
            });
        }
    }
    check_cluster_settings(settings)
}

/// The cluster flags: none, or a master with a data address peers can reach.
fn check_cluster_settings(
    settings: &kvtier_store::KvtierConfig,
) -> Result<Option<std::net::SocketAddr>, String> {
    let masters = settings.master_addresses();
    if masters.is_empty() {
        return Ok(None);
    }
    let data = settings
        .node_address
        .as_deref()
        .ok_or("cluster mode (--master) needs --data-addr HOST:PORT")?;
    let addr: std::net::SocketAddr = data
        .parse()
        .map_err(|_| format!("--data-addr {data:?} is not IP:PORT"))?;
    if addr.ip().is_unspecified() {
        return Err(format!(
            "--data-addr {data}: give the address peers reach this node on, not a wildcard"
        ));
    }
    if settings.cluster_token.as_deref().is_none_or(str::is_empty) {
        return Err("cluster mode (--master) needs the cluster token: KVTIER_CLUSTER_TOKEN or cluster_token in the --config file".into());
    }
    Ok(Some(addr))
}

/// Issue 27: the one startup line: mode, capacities, paths, transports, addresses.
fn summary_line(server: &Server, config: &ServerConfig) -> String {
    let e = &config.engine;
    let ssd = if e.engine.ssd_enabled {
        format!(
            "SSD {} in {}",
            human_bytes(e.engine.ssd_capacity_bytes),
            e.engine.ssd_storage_dir.display()
        )
    } else {
        "SSD off".to_string()
    };
    let mode = match e.master_addresses() {
        m if m.is_empty() => "local".to_string(),
        m => format!(
            "cluster node (masters {}, data {}, transport {})",
            m.join(","),
            e.node_address.as_deref().unwrap_or("?"),
            e.cluster_transport
        ),
    };
    let mut metrics = server.metrics_addr().map_or(String::new(), |a| {
        format!("; metrics on http://{a}/metrics")
    });
    if let Some((ep, replay)) = server.events_endpoints() {
        metrics.push_str(&format!("; KV events on tcp://{ep}"));
        if let Some(r) = replay {
            metrics.push_str(&format!(" (replay tcp://{r})"));
        }
    }
    format!(
        "kvtier serve: listening on {} (pid {}, mode {mode}, DRAM {}, {ssd}, {} tenant partitions){metrics}",
        server.socket().display(),
        std::process::id(),
        human_bytes(e.engine.dram_capacity_bytes),
        config.settings.tenant_dram_quota.len(),
    )
}

/// Run `kvtier serve`; returns the process exit code: 0 after a clean stop, 1 when the
/// server failed (a flush error, a credential the master refused), 2 on a configuration error.
pub fn serve_main(args: ServeArgs) -> i32 {
    let config = match serve_config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvtier serve: {e}");
            return 2;
        }
    };
    // Issue 27: every check that needs no store runs before the arena is pre-faulted.
    if let Err(e) = check_serve_config(&config) {
        eprintln!("kvtier serve: {e}");
        return 2;
    }
    let signals = match signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvtier serve: cannot install signal handlers: {e}");
            return 1;
        }
    };
    let cluster_settings = config.engine.clone();
    let summary_config = config.clone();
    let server = match Server::bind(config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvtier serve: {e}");
            return 1;
        }
    };
    tracing::info!("{}", summary_line(&server, &summary_config));
    let running = server.spawn();
    let cluster = match start_cluster_node(&cluster_settings, running.main_store()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvtier serve: {e}");
            running.shutdown(Duration::from_secs(1));
            return 1;
        }
    };
    if let Some(node) = &cluster {
        running.set_data_plane(node.data_plane.clone()); // issue 17
    }
    running.mark_ready(true); // issue 27: /readyz (a node: once registered, see node.rs)
    let (signal, fatal) = wait_for_stop(signals, cluster.as_ref());
    running.mark_ready(false);
    drop(cluster);
    match &fatal {
        Some(e) => eprintln!("kvtier serve: {e}; shutting down"),
        None => tracing::info!(
            "kvtier serve: signal {}; shutting down (finishing running requests, flushing)",
            signal.unwrap_or(0)
        ),
    }
    let report = running.shutdown(Duration::from_secs(args.shutdown_timeout));
    let errors = report["shutdown"]["flush_errors"]
        .as_array()
        .map_or(0, Vec::len);
    tracing::info!(
        "kvtier serve: stopped ({} requests served, {} sessions, {} flush errors)",
        report["server"]["requests"],
        report["server"]["sessions_total"],
        errors
    );
    i32::from(errors > 0 || fatal.is_some())
}

/// Block until SIGTERM / SIGINT, or until the node agent gives up for good (the master
/// refused the cluster token): `(signal, fatal error)`.
fn wait_for_stop(
    mut signals: signal_hook::iterator::Signals,
    cluster: Option<&ClusterNode>,
) -> (Option<i32>, Option<String>) {
    loop {
        if let Some(signal) = signals.pending().next() {
            return (Some(signal), None);
        }
        if let Some(e) = cluster.and_then(|c| c.agent.fatal_error()) {
            return (None, Some(e));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Fetch the stats document of the server at `socket`.
pub fn fetch_stats(socket: &std::path::Path) -> Result<Value, String> {
    fetch_json(
        socket,
        "kvtier-stat",
        Opcode::Stats,
        &kvtier_store::store::local_server::EmptyBody,
    )
}

/// Fetch the `Inspect` document of the server at `socket`.
pub fn fetch_inspect(socket: &std::path::Path, query: &InspectQuery) -> Result<Value, String> {
    fetch_json(socket, "kvtier-inspect", Opcode::Inspect, query)
}

/// Handshake, then one request whose reply is a JSON [`TextReply`].
fn fetch_json(
    socket: &std::path::Path,
    client_name: &str,
    opcode: Opcode,
    request: &dyn kvtier_proto::Encode,
) -> Result<Value, String> {
    let mut stream = UnixStream::connect(socket)
        .map_err(|e| format!("cannot connect to {}: {e}", socket.display()))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    let mut body = Vec::new();
    let mut call = |opcode: Opcode, id: u64, payload: &dyn kvtier_proto::Encode| {
        let mut out = Vec::new();
        encode_frame(&mut out, opcode, id, 0, payload).map_err(|e| e.to_string())?;
        std::io::Write::write_all(&mut stream, &out).map_err(|e| e.to_string())?;
        let header = read_frame(&mut stream, &mut body).map_err(|e| e.to_string())?;
        if header.flags & FLAG_ERROR != 0 {
            let reply = ErrorReply::decode(&body).map_err(|e| e.to_string())?;
            return Err(format!("server refused: {}", reply.message));
        }
        Ok(body.clone())
    };
    call(
        Opcode::Handshake,
        1,
        &Handshake {
            version: PROTOCOL_VERSION,
            client_name: client_name.into(),
        },
    )?;
    let reply = call(opcode, 2, request)?;
    let text = TextReply::decode(&reply).map_err(|e| e.to_string())?;
    serde_json::from_str(&text.text).map_err(|e| e.to_string())
}

/// The socket of `--socket`, or the default `kvtier serve` would use.
fn socket_or_default(socket: &Option<PathBuf>) -> Result<PathBuf, String> {
    match socket {
        Some(s) => Ok(s.clone()),
        None => serve_config(&ServeArgs {
            socket: None,
            config: None,
            socket_mode: None,
            socket_group: None,
            dram_capacity: None,
            tenant_quota: Vec::new(),
            tenant_ssd_quota: Vec::new(),
            engine: Vec::new(),
            master: None,
            data_addr: None,
            node_id: None,
            node_tags: None,
            metrics_addr: None,
            host_events_endpoint: None,
            host_events_replay_endpoint: None,
            shutdown_timeout: 0,
        })
        .map(|c| c.socket),
    }
}

/// Run `kvtier inspect`; returns the exit code: 0 when every asked key (or at least one key
/// under the prefix) is stored somewhere, 1 when nothing was found or the server failed, 2 on
/// a usage error.
pub fn inspect_main(args: InspectArgs) -> i32 {
    let socket = match socket_or_default(&args.socket) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvtier inspect: {e}");
            return 2;
        }
    };
    // The server stores a tenant's keys under `tenant 0x1f key`.
    let ns = |k: &str| {
        let mut out = Vec::new();
        if !args.raw {
            out.extend_from_slice(&kvtier_proto::namespace::tenant_prefix(&args.tenant));
        }
        out.extend_from_slice(k.as_bytes());
        out
    };
    let query = InspectQuery {
        keys: args.key.iter().map(|k| ns(k)).collect(),
        prefix: args.prefix.as_deref().map(ns),
        limit: args.limit,
    };
    let doc = match fetch_inspect(&socket, &query) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kvtier inspect: {e}");
            return 1;
        }
    };
    let stores = doc["stores"].as_array().cloned().unwrap_or_default();
    let held = |p: &Value| !p["dram_bytes"].is_null() || !p["ssd_bytes"].is_null();
    // Each asked key must be somewhere (in any store); a prefix must match something.
    let keys_found =
        (0..query.keys.len()).all(|i| stores.iter().any(|s| s["keys"].get(i).is_some_and(held)));
    let prefix_found = query.prefix.is_none()
        || stores
            .iter()
            .any(|s| s["prefix"].as_array().is_some_and(|l| !l.is_empty()));
    let code = i32::from(!(keys_found && prefix_found));
    if args.json {
        print_json(&doc);
        return code;
    }
    println!(
        "{:<10} {:<10} {:<8} {:>10} {:>10}  {:<16} key",
        "store", "tenant", "tiers", "dram_bytes", "ssd_bytes", "pool"
    );
    for s in &stores {
        let name = s["store"].as_str().unwrap_or("?");
        let asked = s["keys"].as_array().into_iter().flatten();
        let under = s["prefix"].as_array().into_iter().flatten();
        for p in asked.chain(under) {
            let stored = p["key"].as_str().unwrap_or("");
            // A node's cluster objects show as `cluster:TAG` (`cluster:` untagged).
            let (tenant, key) = match kvtier_proto::namespace::owner(stored.as_bytes()) {
                kvtier_proto::namespace::Owner::Tenant { tenant, key } => (
                    String::from_utf8_lossy(tenant).into_owned(),
                    String::from_utf8_lossy(key).into_owned(),
                ),
                kvtier_proto::namespace::Owner::Cluster { tag, key } => (
                    format!("cluster:{}", String::from_utf8_lossy(tag)),
                    String::from_utf8_lossy(key).into_owned(),
                ),
                kvtier_proto::namespace::Owner::Unknown => ("?".into(), stored.to_string()),
            };
            let tiers = match (p["dram_bytes"].is_null(), p["ssd_bytes"].is_null()) {
                (false, false) => "dram+ssd",
                (false, true) => "dram",
                (true, false) => "ssd",
                (true, true) => "-",
            };
            let bytes = |v: &Value| v.as_u64().map_or("-".to_string(), |n| n.to_string());
            println!(
                "{:<10} {:<10} {:<8} {:>10} {:>10}  {:<16} {}",
                name,
                if tenant.is_empty() { "-" } else { &tenant },
                tiers,
                bytes(&p["dram_bytes"]),
                bytes(&p["ssd_bytes"]),
                pool_of(&key),
                key
            );
        }
        if s["truncated"].as_bool() == Some(true) {
            println!("{name:<10} ... more keys under the prefix (raise --limit)");
        }
    }
    code
}

/// The pool component of a kvtier key (`...@fingerprint[.tpN...].component`): the text after
/// the last `.` following the `@`, or `-` for a key outside kvtier's scheme.
fn pool_of(key: &str) -> &str {
    key.split_once('@')
        .and_then(|(_, rest)| rest.rsplit_once('.'))
        .map_or("-", |(_, pool)| pool)
}

/// Print a JSON document for scripts (pretty; compact if it cannot be pretty-printed).
pub fn print_json(doc: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(doc).unwrap_or_else(|_| doc.to_string())
    );
}

/// Issue 17: the `kvtier stat` line naming a cluster node's data plane.
fn data_plane_line(plane: &Value) -> String {
    if plane["transport"] == "ucx" {
        format!(
            "UCX (UCX_TLS {}, UCX_NET_DEVICES {}, {} KiB registered for leases, leases held {} / total {}, refused {}, objects not remote {}; TCP frames as fallback)",
            plane["ucx_tls"].as_str().unwrap_or("?"),
            plane["ucx_net_devices"].as_str().unwrap_or("?"),
            plane["registered_bytes"].as_u64().unwrap_or(0) >> 10,
            plane["leases_held"],
            plane["leases_total"],
            plane["leases_refused_full"],
            plane["objects_not_remote"]
        )
    } else {
        format!(
            "TCP frames (no UCX: {})",
            plane["reason"].as_str().unwrap_or("?")
        )
    }
}

/// Issue 27: the SSD line of a store in `kvtier stat`.
fn ssd_line(st: &Value) -> String {
    let n = |k: &str| st[k].as_u64().unwrap_or(0);
    format!(
        "SSD {} objects, {} / {} used, {} hits; at open recovered {} objects ({} torn, {} corrupt records dropped){}",
        n("ssd_objects"),
        human_bytes(n("ssd_bytes_allocated")),
        human_bytes(n("ssd_capacity_bytes")),
        n("ssd_hits"),
        n("ssd_recovered_objects"),
        n("ssd_recovery_torn"),
        n("ssd_recovery_corrupt"),
        if st["ssd_degraded"] == true {
            "; DEGRADED (writes failed: see the server's log)"
        } else {
            ""
        }
    )
}

/// Run `kvtier stat`; returns the exit code.
pub fn stat_main(args: StatArgs) -> i32 {
    let socket = match socket_or_default(&args.socket) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvtier stat: {e}");
            return 2;
        }
    };
    let doc = match fetch_stats(&socket) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kvtier stat: {e}");
            return 1;
        }
    };
    if args.json {
        print_json(&doc);
        return 0;
    }
    let s = &doc["server"];
    println!(
        "kvtier serve {} pid {} on {} up {:.0}s",
        s["version"].as_str().unwrap_or("?"),
        s["pid"],
        s["socket"].as_str().unwrap_or("?"),
        s["uptime_s"].as_f64().unwrap_or(0.0)
    );
    println!(
        "  sessions {}  connections {}  requests {}  malformed frames {}  mapped {} regions / {} MiB",
        s["sessions"],
        s["connections"],
        s["requests"],
        s["malformed_frames"],
        s["mapped_regions"],
        s["mapped_bytes"].as_u64().unwrap_or(0) >> 20
    );
    if let Some(plane) = doc.get("data_plane") {
        println!("  data plane: {}", data_plane_line(plane)); // issue 17
    }
    if let Some(stores) = doc["stores"].as_object() {
        for (name, st) in stores {
            println!(
                "  store {name}: DRAM {} objects, {} / {} MiB used, hits {} misses {} evictions {}",
                st["objects"],
                st["bytes_used"].as_u64().unwrap_or(0) >> 20,
                st["capacity_bytes"].as_u64().unwrap_or(0) >> 20,
                st["hits"],
                st["misses"],
                st["evictions_capacity"]
            );
            // Issue 27: the SSD tier (a warm restart's objects live there, not in DRAM).
            if st["ssd_enabled"] == true {
                println!("    {}", ssd_line(st));
            }
        }
    }
    if let Some(list) = doc["sessions"].as_array() {
        for c in list {
            println!(
                "  session {} tenant {:?} pid {} ({}): {} conns, {} regions ({} MiB), put {} pages / get {} pages, rejected buffers {}",
                c["session"],
                c["tenant"].as_str().unwrap_or(""),
                c["pid"],
                c["client_name"].as_str().unwrap_or(""),
                c["connections"],
                c["regions"],
                c["mapped_bytes"].as_u64().unwrap_or(0) >> 20,
                c["pages_put"],
                c["pages_got"],
                c["rejected_buffers"]
            );
        }
    }
    0
}

/// The cluster part of a node: its data port and its agent (dropped = stopped).
pub struct ClusterNode {
    pub agent: crate::node::NodeAgent,
    pub port: crate::peer::DataPort,
    /// Issue 17: what `stats` names as the node's data plane.
    pub data_plane: crate::server::DataPlane,
}

/// Issue 17: the node's UCX data plane unless `cluster_transport = "tcp"`; a node that
/// cannot serve it says why and serves frames only (`Err(why)`).
/// Issue 26 §1: UCX uses only the devices behind the interface of `data` (`--data-addr`).
fn start_ucx_node(
    settings: &kvtier_store::KvtierConfig,
    store: &crate::server::TenantStore,
    data: std::net::SocketAddr,
) -> Result<std::sync::Arc<crate::ucx_node::UcxNode>, String> {
    if settings.cluster_transport == "tcp" {
        return Err("cluster_transport = \"tcp\"".into());
    }
    match crate::ucx_node::UcxNode::start(store, data.ip()) {
        Ok(node) => {
            tracing::info!(
                "kvtier serve: UCX data plane on (UCX_TLS {}, UCX_NET_DEVICES {}, arena of {} MiB, each leased extent registered for its lease only)",
                node.offer().transports,
                node.describe()["ucx_net_devices"].as_str().unwrap_or(""),
                node.arena_len() >> 20
            );
            Ok(std::sync::Arc::new(node))
        }
        Err(why) => {
            tracing::info!("kvtier serve: no UCX data plane ({why}); peers read over TCP frames");
            Err(why)
        }
    }
}

/// Start the data port and the node agent when the settings name a master.
pub fn start_cluster_node(
    settings: &kvtier_store::KvtierConfig,
    store: std::sync::Arc<crate::server::TenantStore>,
) -> Result<Option<ClusterNode>, String> {
    let masters = settings.master_addresses();
    let Some(addr) = check_cluster_settings(settings)? else {
        return Ok(None);
    };
    let data = settings.node_address.as_deref().unwrap_or_default();
    let token = settings
        .cluster_token
        .clone()
        .unwrap_or_default()
        .into_bytes();
    let ucx = start_ucx_node(settings, &store, addr);
    let data_plane = match &ucx {
        Ok(node) => crate::server::DataPlane::Ucx(std::sync::Arc::downgrade(node)),
        Err(why) => crate::server::DataPlane::Frames(why.clone()),
    };
    let port = crate::peer::DataPort::start_with_ucx(
        addr,
        std::sync::Arc::clone(&store),
        token.clone(),
        ucx.ok(),
    )
    .map_err(|e| format!("cannot bind the data port {data}: {e}"))?;
    let data_address = port.local_addr().to_string();
    let node_id = settings
        .node_id
        .clone()
        .unwrap_or_else(|| format!("node-{data_address}"));
    tracing::info!(
        "kvtier serve: cluster node {node_id:?}, data port {data_address}, masters {masters:?}"
    );
    let agent = crate::node::NodeAgent::start(
        crate::node::NodeAgentConfig {
            masters,
            node_id,
            data_address,
            tags: settings.node_tag_list(),
            request_timeout: Duration::from_millis(settings.cluster_request_timeout_ms),
            token,
        },
        store,
        port.held(),
    )
    .map_err(|e| format!("cannot start the node agent: {e}"))?;
    Ok(Some(ClusterNode {
        agent,
        port,
        data_plane,
    }))
}
