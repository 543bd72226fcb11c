//! `kvtier`: operator commands.
//!
//! - `kvtier serve`, `kvtier stat [--json]`, `kvtier inspect KEY...|--prefix P [--json]`: the
//!   local server (see `serve.rs`; implemented in kvtier-server's `cli`).
//! - `kvtier config check FILE [--kind client|server] [--json]`: validate a config file, print the effective one
//!   (`config_check.rs`).
//! - `kvtier bench workload ARGS...`: the Python workload benchmark (`workload.rs`).
//! - `kvtier fsck DIR [--json]` — verify every segment of an SSD directory (read-only); exit
//!   status 0 when clean, 1 when torn or corrupt records were found, 2 on error.
//! - `kvtier bench ssd [--dir DIR] [--quick] [--json]` — engine SSD write/read throughput and
//!   DRAM-miss latency against a raw `O_DIRECT` baseline measured in the same run, same place.
//! - `kvtier bench recovery [--dir DIR] [--objects N] [--json]` — warm-restart time from the
//!   index checkpoint and by a full segment scan.
//! - `kvtier bench cluster [--sizes S,..] [--batch N] [--rounds N] [--mooncake] [--json]` —
//!   remote set/get through a cluster node over loopback TCP against the same run's raw TCP
//!   throughput and, with --mooncake, Mooncake Store's TCP protocol (`bench_cluster.rs`).
//! - `kvtier bench server`: batches through an in-process `kvtier serve` from a `Client`
//!   (`bench_server.rs`).
//!
//! Floor plan (issue 28 §3; README "Architecture"): the top crate, and the only one that
//! depends on `kvtier-master`; it also links `kvtier-server` and the `kvtier-client` facade.

mod bench;
mod bench_cluster;
/// `kvtier bench server` (it lived in kvtier-server before the store/transport split).
mod bench_server;
/// Issue 17: `kvtier bench cluster --transport`.
mod bench_ucx;
mod cluster_view;
mod config_check;
/// Issue 27: the tracing subscriber every subcommand installs.
mod logging;
mod master;
mod master_metrics;
mod serve;
mod workload;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kvtier",
    version,
    about = "kvtier: tiered KV-cache page store tools"
)]
struct Cli {
    /// Log format on stderr: text lines (timestamp, level, target, message) or one JSON object
    /// per line (default: $KVTIER_LOG_FORMAT, else text). RUST_LOG filters (default: info).
    #[arg(long, global = true, value_enum)]
    log_format: Option<logging::LogFormat>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Verify every segment file of an SSD tier directory and count good, torn, corrupt,
    /// stale and removed records. Read-only. Exit status: 0 clean, 1 damage found, 2 error.
    Fsck {
        /// The SSD tier directory (`ssd_storage_dir`).
        dir: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Configuration files.
    Config {
        #[command(subcommand)]
        what: config_check::ConfigCommand,
    },
    #[command(flatten)]
    Server(serve::ServerCommand),
    /// Run a cluster master (node registry, key directory, placement; etcd leader election
    /// with --etcd) until SIGTERM/SIGINT. Every RPC must prove the cluster token, read from
    /// KVTIER_CLUSTER_TOKEN or cluster_token in KVTIER_CONFIG_FILE (required; never sent).
    /// Limits: 16 MiB per message, 65,536 keys per call, 256 RPCs in flight (32 per
    /// connection), existence queries within 2 s.
    Master(master::MasterArgs),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Batch get/set through `kvtier serve` with shared memory vs same-run memcpy and memfd
    /// copy; batch_exists_v2 (128 pages x 4 pools) round-trip latency.
    Server(bench_server::BenchServerArgs),
    /// Multi-turn chat workload through the real SGLang backend under a DRAM budget:
    /// prefix_depth vs lru eviction (runs `python -m kvtier_dev.bench workload ARGS...`).
    Workload(workload::WorkloadArgs),
    /// SSD tier throughput (256 KiB - 2 MiB objects) and 2 MiB DRAM-miss latency, each
    /// against a raw O_DIRECT baseline measured in the same run on the same filesystem.
    Ssd {
        /// Directory to benchmark in (default: a fresh directory under the temp dir). Needs
        /// about 1.3 GiB free (320 MiB with --quick).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Smaller volumes (about 10 s instead of about a minute).
        #[arg(long)]
        quick: bool,
        /// The engine's I/O backend (`ssd_io_backend`); the raw baseline is always pread/pwrite.
        #[arg(long, default_value = "posix", value_parser = ["posix", "io_uring"])]
        io_backend: String,
        /// Print the results as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Warm-restart time: open from the index checkpoint, and by scanning every segment.
    Recovery {
        /// Directory to benchmark in (default: a fresh directory under the temp dir). Needs
        /// 4 KiB per object.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Number of (empty) objects to recover.
        #[arg(long, default_value_t = 1_000_000)]
        objects: u64,
        /// Print the results as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remote set/get through a cluster node (master + node started here, client not
    /// co-located: every byte over loopback TCP) vs the same run's raw single-stream TCP,
    /// and optionally Mooncake Store over TCP in the same run.
    Cluster(bench_cluster::BenchClusterArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = logging::init(cli.log_format) {
        eprintln!("kvtier: {e}");
        return ExitCode::from(2);
    }
    let result = match cli.command {
        Command::Fsck { dir, json } => fsck(&dir, json),
        Command::Bench { what } => match what {
            BenchCommand::Ssd {
                dir,
                quick,
                io_backend,
                json,
            } => bench::ssd(dir, quick, io_backend == "io_uring", json),
            BenchCommand::Recovery { dir, objects, json } => bench::recovery(dir, objects, json),
            BenchCommand::Server(args) => serve::bench(args),
            BenchCommand::Workload(args) => workload::run(args),
            BenchCommand::Cluster(args) => bench_cluster::run(args),
        },
        Command::Config { what } => config_check::run(what),
        Command::Server(command) => serve::run(command),
        Command::Master(args) => master::master(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvtier: {e}");
            ExitCode::from(2)
        }
    }
}

fn fsck(dir: &std::path::Path, json: bool) -> Result<ExitCode, String> {
    let r = kvtier_engine::fsck(dir).map_err(|e| format!("fsck {}: {e}", dir.display()))?;
    // Issue 27: nothing checked is not "clean": a wrong directory must not pass.
    if r.segments.is_empty() {
        let below = store_dirs_below(dir);
        return Err(if below.is_empty() {
            format!(
                "fsck {}: no segment files (seg-NNNNNN.kvt) here: not an SSD tier directory, \
                 or one never written to",
                dir.display()
            )
        } else {
            format!(
                "fsck {}: no segment files here; these directories below it hold some: {}",
                dir.display(),
                below.join(", ")
            )
        });
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "{:>8} {:>9} {:>12} {:>8} {:>6} {:>8} {:>6} {:>8}",
            "segment", "state", "generation", "good", "torn", "corrupt", "stale", "removed"
        );
        for s in &r.segments {
            println!(
                "{:>8} {:>9} {:>12} {:>8} {:>6} {:>8} {:>6} {:>8}",
                s.id,
                s.state,
                s.generation.map_or("-".into(), |g| g.to_string()),
                s.counts.good,
                s.counts.torn,
                s.counts.corrupt,
                s.counts.stale,
                s.counts.removed
            );
        }
        println!(
            "total: {} segments, {} good, {} torn, {} corrupt, {} stale, {} removed; \
             {:.1} MB scanned in {:.2} s; checkpoint {}",
            r.segments.len(),
            r.counts.good,
            r.counts.torn,
            r.counts.corrupt,
            r.counts.stale,
            r.counts.removed,
            r.counts.bytes_scanned as f64 / 1e6,
            r.elapsed_s,
            if r.checkpoint_present {
                "present"
            } else {
                "absent"
            }
        );
    }
    Ok(if r.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Sub-directories of `dir` (one level) holding segment files: the per-store directories
/// under an `ssd_storage_dir`, which is what `fsck` wants.
fn store_dirs_below(dir: &std::path::Path) -> Vec<String> {
    let is_segment = |name: &str| name.starts_with("seg-") && name.ends_with(".kvt");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<String> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| {
            std::fs::read_dir(e.path()).is_ok_and(|inner| {
                inner
                    .flatten()
                    .any(|f| f.file_name().to_str().is_some_and(is_segment))
            })
        })
        .map(|e| e.path().display().to_string())
        .collect();
    found.sort();
    found.truncate(16);
    found
}

/// Whether progress bars may be drawn.
pub(crate) fn interactive() -> bool {
    std::io::stderr().is_terminal()
}
