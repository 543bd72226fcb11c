//! `kvtier master`: run the cluster's control plane (implemented in kvtier-master).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use kvtier_master::{run, MasterConfig};

/// Run a master until SIGTERM/SIGINT. Without --etcd it is the single master of the cluster;
/// with --etcd several masters elect a leader and the others stand by. Every RPC must prove
/// the cluster token (never sent in clear), read like a node reads it: KVTIER_CLUSTER_TOKEN,
/// or cluster_token in the TOML file KVTIER_CONFIG_FILE names; the master does not start
/// without one.
#[derive(Debug, Clone, clap::Args)]
pub struct MasterArgs {
    /// RPC address to listen on.
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub listen: SocketAddr,
    /// Address clients and nodes reach this master on (default: --listen).
    #[arg(long)]
    pub advertise: Option<String>,
    /// etcd endpoints, comma-separated (e.g. http://127.0.0.1:2379): leader election.
    #[arg(long)]
    pub etcd: Option<String>,
    /// Node lease in ms: a node not heard from for this long is dropped.
    #[arg(long, default_value_t = 3000)]
    pub lease_ms: u64,
    /// etcd election lease in seconds (how fast a follower takes over a dead leader).
    #[arg(long, default_value_t = 2)]
    pub election_ttl_s: u64,
    /// Replication factor of namespaces not listed with --replication.
    #[arg(long, default_value_t = 1)]
    pub default_replication: usize,
    /// Replication factor of one namespace (the clients' extra_backend_tag), NS=N, repeatable.
    #[arg(long = "replication", value_name = "NS=N")]
    pub replication: Vec<String>,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: a free port, printed at
    /// startup): leadership, nodes, directory size, RPC latency.
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
    /// Label the per-node metrics with node ids (they name every node's data address):
    /// only for an endpoint that strangers cannot reach. Default: cluster totals only.
    #[arg(long)]
    pub metrics_node_ids: bool,
    /// Issue 30: publish the cluster KV-event stream (what the whole cluster holds, vLLM's
    /// KV-event wire protocol, while this master leads) on this PUB endpoint, tcp://IP:PORT
    /// with an IP literal (port 0: a free one, logged). Off by default; the stream reveals
    /// keys' block hashes and node ids: bind it only where routers, not strangers, connect.
    #[arg(long, value_name = "tcp://IP:PORT")]
    pub events_endpoint: Option<String>,
    /// The stream's ROUTER replay (and snapshot) endpoint, tcp://IP:PORT (needs
    /// --events-endpoint).
    #[arg(long, value_name = "tcp://IP:PORT")]
    pub events_replay_endpoint: Option<String>,
    /// Topic of every published batch.
    #[arg(long, default_value = "")]
    pub events_topic: String,
    /// Batches kept for replay (1..=1048576).
    #[arg(long, default_value_t = 10_000)]
    pub events_buffer_batches: usize,
    /// Subscribers (and replay peers) per endpoint (1..=4096).
    #[arg(long, default_value_t = 64)]
    pub events_max_subscribers: usize,
    /// Batches queued per subscriber before it loses some (1..=1048576).
    #[arg(long, default_value_t = 1024)]
    pub events_subscriber_queue: usize,
    /// Blocks the stream tracks, about 100 bytes each (1..=67108864); more are counted, not
    /// published.
    #[arg(long, default_value_t = 1 << 20)]
    pub events_max_blocks: usize,
}

/// Issue 30: the cluster KV-event stream's settings from the flags (`None`: off).
fn events_config(
    args: &MasterArgs,
) -> Result<Option<kvtier_master::events::ClusterEventsConfig>, String> {
    let Some(endpoint) = &args.events_endpoint else {
        if args.events_replay_endpoint.is_some() {
            return Err("--events-replay-endpoint needs --events-endpoint".into());
        }
        return Ok(None);
    };
    for (flag, value, hi) in [
        (
            "--events-buffer-batches",
            args.events_buffer_batches,
            kvtier_events::MAX_BUFFER_BATCHES as usize,
        ),
        (
            "--events-max-subscribers",
            args.events_max_subscribers,
            kvtier_events::MAX_SUBSCRIBERS as usize,
        ),
        (
            "--events-subscriber-queue",
            args.events_subscriber_queue,
            kvtier_events::MAX_SUBSCRIBER_QUEUE as usize,
        ),
        ("--events-max-blocks", args.events_max_blocks, 1 << 26),
    ] {
        if !(1..=hi).contains(&value) {
            return Err(format!("{flag} {value} is outside the range 1..={hi}"));
        }
    }
    let parse =
        |key: &str, text: &str| kvtier_events::parse_endpoint(key, text).map_err(|e| e.to_string());
    Ok(Some(kvtier_master::events::ClusterEventsConfig {
        stream: kvtier_events::StreamConfig {
            name: "kvtier master",
            endpoint_key: "--events-endpoint",
            replay_key: "--events-replay-endpoint",
            endpoint: parse("--events-endpoint", endpoint)?,
            replay_endpoint: args
                .events_replay_endpoint
                .as_deref()
                .map(|t| parse("--events-replay-endpoint", t))
                .transpose()?,
            topic: args.events_topic.clone(),
            buffer_batches: args.events_buffer_batches,
            max_subscribers: args.events_max_subscribers,
            subscriber_queue: args.events_subscriber_queue,
        },
        max_blocks: args.events_max_blocks,
    }))
}

/// `--replication NS=N` items as a map.
fn replication_factors(items: &[String]) -> Result<BTreeMap<String, usize>, String> {
    let mut replication = BTreeMap::new();
    for item in items {
        let (ns, n) = item
            .split_once('=')
            .ok_or_else(|| format!("--replication {item:?} is not NS=N"))?;
        let n: usize = n
            .trim()
            .parse()
            .map_err(|_| format!("--replication {item:?}: N is not a number"))?;
        replication.insert(ns.trim().to_string(), n);
    }
    Ok(replication)
}

pub fn master(args: MasterArgs) -> Result<ExitCode, String> {
    let replication = replication_factors(&args.replication)?;
    let events = events_config(&args)?;
    let token = crate::cluster_view::cluster_token()?;
    let config = MasterConfig {
        events,
        token: token.clone(),
        listen: args.listen,
        advertise: args.advertise,
        lease: Duration::from_millis(args.lease_ms),
        default_replication: args.default_replication,
        replication,
        etcd_endpoints: args
            .etcd
            .iter()
            .flat_map(|e| e.split(','))
            .map(|e| e.trim().to_string())
            .filter(|e| !e.is_empty())
            .collect(),
        election_ttl: Duration::from_secs(args.election_ttl_s.max(1)),
        ..MasterConfig::default()
    };
    // The bounds (replication factors, lease) are the master's own check (issue 16).
    config.validate().map_err(|e| e.to_string())?;
    // Started before the RPC port binds, so an address in use fails the start.
    let _metrics = match &args.metrics_addr {
        Some(addr) => {
            let m = crate::master_metrics::start(
                addr,
                args.listen,
                token.clone(),
                args.metrics_node_ids,
            )
            .map_err(|e| format!("metrics_addr {addr}: {e}"))?;
            tracing::info!("kvtier master: metrics at {}", m.endpoint.url());
            Some(m)
        }
        None => None,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let result = runtime.block_on(run(config, async {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(_) => return std::future::pending().await,
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("kvtier master: signal; resigning and shutting down");
    }));
    // Issue 27: tasks still running (a connection past the grace, a directory scan) do not
    // hold the exit.
    runtime.shutdown_timeout(Duration::from_secs(1));
    result.map_err(|e| e.to_string())?;
    Ok(ExitCode::SUCCESS)
}
