//! `kvtier stat --master ADDR` and `kvtier inspect --master ADDR KEY...`: the cluster as the
//! leading master sees it (nodes, leases, leadership, directory size; which nodes hold a key).
//! Read-only RPCs (`Cluster`, `Lookup`): nothing is counted as a hit or a miss.

use std::time::Duration;

use kvtier_client::cluster::master::MasterLink;
use kvtier_master::rpc::{ClusterReply, ClusterRequest, LookupReply, LookupRequest, NodeInfo};
use kvtier_server::cli::{InspectArgs, StatArgs};
use serde_json::{json, Value};

/// How long one command looks for a leader (a failover in progress).
const LEADER_SEARCH: Duration = Duration::from_secs(5);
/// Bound of one RPC.
const RPC_TIMEOUT: Duration = Duration::from_secs(3);

/// The cluster token, read the ways a node reads it (`KVTIER_CLUSTER_TOKEN`, or
/// `cluster_token` in `KVTIER_CONFIG_FILE`); every master RPC must prove it.
pub fn cluster_token() -> Result<Vec<u8>, String> {
    // `load_layered`: the token's reader is not a store, so keys meant for a store or a node
    // in the same file are not this command's to judge.
    let sources = kvtier_client::config::ConfigSources::from_process(serde_json::Map::new())
        .map_err(|e| format!("reading the cluster token: {e}"))?;
    let (config, _) = kvtier_client::KvtierConfig::load_layered(
        serde_json::Map::new(),
        kvtier_client::config::Origin::Default,
        sources,
    )
    .map_err(|e| format!("reading the cluster token: {e}"))?;
    match config.cluster_token {
        Some(token) if !token.is_empty() => Ok(token.into_bytes()),
        _ => Err(
            "no cluster token: set KVTIER_CLUSTER_TOKEN, or KVTIER_CLUSTER_TOKEN_FILE (a file \
             of mode 0600), the token of the cluster's nodes"
                .into(),
        ),
    }
}

fn link(masters: &str) -> Result<(tokio::runtime::Runtime, MasterLink), String> {
    let addresses: Vec<String> = masters
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(String::from)
        .collect();
    if addresses.is_empty() {
        return Err(format!("--master {masters:?}: no address"));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    Ok((
        runtime,
        MasterLink::new(addresses, cluster_token()?, RPC_TIMEOUT, LEADER_SEARCH),
    ))
}

fn node_json(n: &NodeInfo) -> Value {
    json!({
        "node_id": n.node_id,
        "index": n.index,
        "data_address": n.data_address,
        "alive": n.alive,
        "capacity_bytes": n.capacity_bytes,
        "free_bytes": n.free_bytes,
        "tags": n.tags,
        "objects": n.objects,
        "heard_ms_ago": n.heard_ms_ago,
    })
}

fn cluster_json(leader: Option<String>, reply: &ClusterReply) -> Value {
    let r = reply.rereplication.unwrap_or_default();
    json!({
        "leader_address": reply.leader_address,
        "answered_by": leader,
        "is_leader": reply.is_leader,
        "objects": reply.objects,
        "nodes": reply.nodes.iter().map(node_json).collect::<Vec<_>>(),
        "rereplication": {
            "issued": r.issued,
            "done": r.done,
            "failed": r.failed,
            "dropped": r.dropped,
            "in_flight": r.in_flight,
            "no_target": r.no_target,
        },
    })
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

/// `kvtier stat --master ADDR[,ADDR...]`.
pub fn stat(masters: &str, args: &StatArgs) -> i32 {
    let result = link(masters).and_then(|(runtime, link)| {
        let reply = runtime
            .block_on(link.call(|mut c| async move {
                // Issue 27: per-node object counts too.
                c.cluster(ClusterRequest { node_objects: true }).await
            }))
            .map_err(|e| e.to_string())?;
        Ok(cluster_json(link.current_leader(), &reply))
    });
    let doc = match result {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kvtier stat: {e}");
            return 1;
        }
    };
    if args.json {
        kvtier_server::cli::print_json(&doc);
        return 0;
    }
    let nodes = doc["nodes"].as_array().cloned().unwrap_or_default();
    let alive = nodes.iter().filter(|n| n["alive"] == true).count();
    println!(
        "kvtier cluster: leader {}, {} objects in the directory, {} nodes ({} alive)",
        doc["leader_address"].as_str().unwrap_or("?"),
        doc["objects"],
        nodes.len(),
        alive
    );
    let r = &doc["rereplication"];
    println!(
        "re-replication: {} copy tasks in flight, {} issued, {} done, {} failed, {} dropped, \
         {} objects without a target",
        r["in_flight"], r["issued"], r["done"], r["failed"], r["dropped"], r["no_target"]
    );
    println!(
        "{:<20} {:>5} {:<24} {:>6} {:>9} {:>10} {:>10} {:>10}  tags",
        "node", "index", "data address", "alive", "heard", "objects", "cap GiB", "free GiB"
    );
    for n in &nodes {
        println!(
            "{:<20} {:>5} {:<24} {:>6} {:>8.1}s {:>10} {:>10.2} {:>10.2}  {}",
            n["node_id"].as_str().unwrap_or("?"),
            n["index"],
            n["data_address"].as_str().unwrap_or("?"),
            if n["alive"] == true { "yes" } else { "no" },
            n["heard_ms_ago"].as_u64().unwrap_or(0) as f64 / 1000.0,
            n["objects"],
            gib(n["capacity_bytes"].as_u64().unwrap_or(0)),
            gib(n["free_bytes"].as_u64().unwrap_or(0)),
            n["tags"]
                .as_array()
                .map(|t| t
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(","))
                .unwrap_or_default()
        );
    }
    0
}

fn inspect_json(keys: &[String], reply: &LookupReply) -> Value {
    let by_index = |i: u32| reply.nodes.iter().find(|n| n.index == i);
    let entries: Vec<Value> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let holders: Vec<Value> = reply
                .locations
                .get(i)
                .map(|l| {
                    l.nodes
                        .iter()
                        .map(|&n| match by_index(n) {
                            Some(info) => json!({
                                "node_id": info.node_id,
                                "data_address": info.data_address,
                                "alive": info.alive,
                            }),
                            None => json!({ "index": n }),
                        })
                        .collect()
                })
                .unwrap_or_default();
            json!({ "key": key, "nodes": holders })
        })
        .collect();
    json!({ "keys": entries })
}

/// `kvtier inspect --master ADDR KEY...`: which nodes the directory lists for each key.
pub fn inspect(masters: &str, args: &InspectArgs) -> i32 {
    if args.prefix.is_some() {
        // The directory keeps 128-bit key hashes, not keys: it cannot list a prefix.
        eprintln!(
            "kvtier inspect: --prefix needs --socket (a node's store); the master's directory \
             holds key hashes and answers exact keys only"
        );
        return 2;
    }
    let stored: Vec<Vec<u8>> = args
        .key
        .iter()
        .map(|k| {
            // The key as cluster clients of namespace `--tenant` (their extra_backend_tag;
            // none: the untagged namespace) store it.
            let mut out = Vec::new();
            if !args.raw {
                out.extend_from_slice(&kvtier_proto::namespace::cluster_prefix(&args.tenant));
            }
            out.extend_from_slice(k.as_bytes());
            out
        })
        .collect();
    let result = link(masters).and_then(|(runtime, link)| {
        let request = LookupRequest { keys: stored };
        runtime
            .block_on(link.call(|mut c| {
                let request = request.clone();
                async move { c.lookup(request).await }
            }))
            .map_err(|e| e.to_string())
    });
    let reply = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvtier inspect: {e}");
            return 1;
        }
    };
    let doc = inspect_json(&args.key, &reply);
    if args.json {
        kvtier_server::cli::print_json(&doc);
        return 0;
    }
    for entry in doc["keys"].as_array().cloned().unwrap_or_default() {
        let nodes: Vec<String> = entry["nodes"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|n| {
                format!(
                    "{} ({}{})",
                    n["node_id"].as_str().unwrap_or("?"),
                    n["data_address"].as_str().unwrap_or("?"),
                    if n["alive"] == false { ", down" } else { "" }
                )
            })
            .collect();
        let key = entry["key"].as_str().unwrap_or("?");
        if nodes.is_empty() {
            println!("{key}: not in the cluster");
        } else {
            println!("{key}: {}", nodes.join(", "));
        }
    }
    0
}
