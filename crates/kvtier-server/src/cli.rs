//! The `serve`, `stat` and `bench server` subcommands (wired into the `kvtier` binary).

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use kvtier_proto::frame::{FLAG_ERROR, PROTOCOL_VERSION};
use kvtier_proto::server::TextReply;
use kvtier_proto::{encode_frame, read_frame, Decode, ErrorReply, Handshake, Opcode};
use serde_json::{Map, Value};

use crate::config::{ServerConfig, ServerSources};
use crate::server::Server;

/// `kvtier serve`: run the local cache server until SIGTERM / SIGINT.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Unix socket path (default: $XDG_RUNTIME_DIR/kvtier.sock or /tmp/kvtier-<uid>.sock).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// TOML file: server keys at top level, engine keys in an [engine] table.
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
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: a free port, printed
    /// at startup).
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
    /// Seconds to wait for running requests at shutdown.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
}

/// `kvtier stat`: print a running server's live stats.
#[derive(Debug, Clone, clap::Args)]
pub struct StatArgs {
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Print the whole JSON document instead of the summary.
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
    ServerConfig::load(ServerSources {
        file: args.config.clone(),
        env: std::env::vars().collect(),
        flags,
        engine_flags,
    })
    .map_err(|e| e.to_string())
}

/// Run `kvtier serve`; returns the process exit code.
pub fn serve_main(args: ServeArgs) -> i32 {
    let config = match serve_config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvtier serve: {e}");
            return 2;
        }
    };
    let mut signals = match signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvtier serve: cannot install signal handlers: {e}");
            return 1;
        }
    };
    let capacity = config.engine.dram_capacity_bytes;
    let partitions = config.settings.tenant_dram_quota.len();
    let server = match Server::bind(config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kvtier serve: {e}");
            return 1;
        }
    };
    let metrics = server.metrics_addr().map_or(String::new(), |a| {
        format!("; metrics on http://{a}/metrics")
    });
    eprintln!(
        "kvtier serve: listening on {} (pid {}, DRAM {} MiB, {} tenant partitions){metrics}",
        server.socket().display(),
        std::process::id(),
        capacity >> 20,
        partitions
    );
    let running = server.spawn();
    let signal = signals.forever().next();
    eprintln!(
        "kvtier serve: signal {}; shutting down (finishing running requests, flushing)",
        signal.unwrap_or(0)
    );
    let report = running.shutdown(Duration::from_secs(args.shutdown_timeout));
    let errors = report["shutdown"]["flush_errors"]
        .as_array()
        .map_or(0, Vec::len);
    eprintln!(
        "kvtier serve: stopped ({} requests served, {} sessions, {} flush errors)",
        report["server"]["requests"], report["server"]["sessions_total"], errors
    );
    i32::from(errors > 0)
}

/// Fetch the stats document of the server at `socket`.
pub fn fetch_stats(socket: &std::path::Path) -> Result<Value, String> {
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
            client_name: "kvtier-stat".into(),
        },
    )?;
    let reply = call(Opcode::Stats, 2, &kvtier_client::remote::EmptyBody)?;
    let text = TextReply::decode(&reply).map_err(|e| e.to_string())?;
    serde_json::from_str(&text.text).map_err(|e| e.to_string())
}

/// Run `kvtier stat`; returns the exit code.
pub fn stat_main(args: StatArgs) -> i32 {
    let socket = match &args.socket {
        Some(s) => s.clone(),
        None => match serve_config(&ServeArgs {
            socket: None,
            config: None,
            socket_mode: None,
            socket_group: None,
            dram_capacity: None,
            tenant_quota: Vec::new(),
            tenant_ssd_quota: Vec::new(),
            engine: Vec::new(),
            metrics_addr: None,
            shutdown_timeout: 0,
        }) {
            Ok(c) => c.socket,
            Err(e) => {
                eprintln!("kvtier stat: {e}");
                return 2;
            }
        },
    };
    let doc = match fetch_stats(&socket) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kvtier stat: {e}");
            return 1;
        }
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&doc).unwrap_or_else(|_| doc.to_string())
        );
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
    if let Some(stores) = doc["stores"].as_object() {
        for (name, st) in stores {
            println!(
                "  store {name}: {} objects, {} / {} MiB used, hits {} misses {} evictions {}",
                st["objects"],
                st["bytes_used"].as_u64().unwrap_or(0) >> 20,
                st["capacity_bytes"].as_u64().unwrap_or(0) >> 20,
                st["hits"],
                st["misses"],
                st["evictions_capacity"]
            );
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
