//! `kvtier serve`, `kvtier stat`, `kvtier inspect` and `kvtier bench server`: the local cache
//! server, its live stats, where its pages are, and its benchmark (all implemented in kvtier-server).

use std::process::ExitCode;

use crate::bench_server::BenchServerArgs;
use kvtier_server::cli::{InspectArgs, ServeArgs, StatArgs};

#[derive(clap::Subcommand)]
pub enum ServerCommand {
    /// Run the local cache server shared by every rank on this host (Unix socket + shared
    /// memory) until SIGTERM/SIGINT, then finish running requests, flush and exit.
    Serve(Box<ServeArgs>),
    /// Print a running server's live stats (sessions, mappings, stores), or with --master a
    /// cluster's (nodes, leases, leader, directory size).
    Stat(StatArgs),
    /// Which tiers (DRAM, SSD) of a running server hold a key, or every key under --prefix,
    /// with each object's pool and size, per store; with --master, which cluster nodes.
    Inspect(InspectArgs),
}

pub fn run(command: ServerCommand) -> Result<ExitCode, String> {
    let code = match command {
        ServerCommand::Serve(args) => kvtier_server::cli::serve_main(*args),
        ServerCommand::Stat(args) => match args.master.clone() {
            Some(masters) => crate::cluster_view::stat(&masters, &args),
            None => kvtier_server::cli::stat_main(args),
        },
        ServerCommand::Inspect(args) => match args.master.clone() {
            Some(masters) => crate::cluster_view::inspect(&masters, &args),
            None => kvtier_server::cli::inspect_main(args),
        },
    };
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(2)))
}

pub fn bench(args: BenchServerArgs) -> Result<ExitCode, String> {
    crate::bench_server::bench_server_main(args).map(|_| ExitCode::SUCCESS)
}
