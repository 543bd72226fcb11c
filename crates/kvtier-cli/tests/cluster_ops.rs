//! The operator's view of a cluster: `kvtier stat --master`, `kvtier inspect --master` and
//! `kvtier master --metrics-addr`, against a real master and two real nodes on 127.0.0.2/3.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::Duration;

use common::{free_port, start_master, wait_alive, wait_for, NodeOpts, Pool, TOKEN};

fn kvtier(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .env("KVTIER_CLUSTER_TOKEN", TOKEN)
        .output()
        .expect("run kvtier");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn scrape(addr: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    body
}

/// The value of the sample `series` (name with labels, as rendered), if present.
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[test]
fn stat_inspect_and_metrics_show_the_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let metrics_addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let (master_addr, _master) = start_master(1000, &["--metrics-addr", &metrics_addr]);
    let node_a = NodeOpts::new(dir.path(), &master_addr, "node-a", "127.0.0.2");
    let node_b = NodeOpts::new(dir.path(), &master_addr, "node-b", "127.0.0.3");
    let _a = node_a.spawn();
    let mut b = node_b.spawn();

    let client = common::cluster_client(&master_addr, Some("node-a"));
    wait_alive(&client, 2);

    // Before any put: no objects; both nodes listed with their data addresses.
    let (code, out, err) = kvtier(&["stat", "--master", &master_addr, "--json"]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["objects"], 0, "{doc}");
    assert_eq!(doc["is_leader"], true);
    let addresses: Vec<&str> = doc["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["data_address"].as_str().unwrap())
        .collect();
    assert!(addresses.contains(&node_a.data.as_str()), "{doc}");
    assert!(addresses.contains(&node_b.data.as_str()), "{doc}");
    let body = scrape(&metrics_addr);
    assert_eq!(sample(&body, "kvtier_master_objects"), Some(0.0), "{body}");
    assert_eq!(
        sample(&body, "kvtier_master_is_leader"),
        Some(1.0),
        "{body}"
    );
    assert_eq!(
        sample(&body, "kvtier_master_nodes{state=\"alive\"}"),
        Some(2.0),
        "{body}"
    );

    // Put 8 objects through node A: the directory counts them, inspect names node A.
    let keys: Vec<Vec<u8>> = (0..8)
        .map(|i| format!("ops-key-{i}").into_bytes())
        .collect();
    let mut src = Pool::new(8, 64 << 10);
    src.fill(3);
    let _src_registered = src.register(&client);
    let put = client.put_keys(&keys, &src.refs(), None);
    assert!(put.ok.iter().all(|&ok| ok), "{:?}", put.errors);

    let (code, out, err) = kvtier(&["stat", "--master", &master_addr]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("8 objects in the directory"), "{out}");
    assert!(out.contains("node-a") && out.contains("node-b"), "{out}");

    let (code, out, err) = kvtier(&[
        "inspect",
        "--master",
        &master_addr,
        "ops-key-3",
        "never-stored",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["keys"][0]["nodes"][0]["node_id"], "node-a", "{doc}");
    assert_eq!(doc["keys"][1]["nodes"].as_array().map(Vec::len), Some(0));
    let (code, out, _) = kvtier(&["inspect", "--master", &master_addr, "never-stored"]);
    assert_eq!(code, 0);
    assert!(out.contains("never-stored: not in the cluster"), "{out}");

    let body = scrape(&metrics_addr);
    assert_eq!(sample(&body, "kvtier_master_objects"), Some(8.0), "{body}");
    // The put was one PlacePuts and one CommitPuts; their latencies are in the histogram.
    for rpc in ["place_puts", "commit_puts"] {
        let count = sample(
            &body,
            &format!("kvtier_master_rpc_duration_seconds_count{{rpc=\"{rpc}\"}}"),
        );
        assert!(count.is_some_and(|c| c >= 1.0), "{rpc}: {body}");
    }
    // Issue 26: node ids (and the data addresses in them) are not listed to a scraper unless
    // the operator asks (--metrics-node-ids); the cluster's totals are.
    for secret in [
        "node-a",
        "node-b",
        node_a.data.as_str(),
        node_b.data.as_str(),
    ] {
        assert!(!body.contains(secret), "{secret} listed: {body}");
    }
    assert!(
        sample(&body, "kvtier_master_cluster_capacity_bytes").is_some_and(|c| c > 0.0),
        "{body}"
    );

    // Node B dies: after its lease the gauges say so.
    b.kill();
    wait_for(
        Duration::from_secs(10),
        "node-b down in the metrics",
        || {
            sample(
                &scrape(&metrics_addr),
                "kvtier_master_nodes{state=\"alive\"}",
            ) == Some(1.0)
        },
    );

    // Clean failures: --prefix is refused by name, an unreachable master is an error.
    let (code, _, err) = kvtier(&["inspect", "--master", &master_addr, "--prefix", "ops"]);
    assert_eq!(code, 2);
    assert!(err.contains("--prefix needs --socket"), "{err}");
    let dead = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let (code, _, err) = kvtier(&["stat", "--master", &dead]);
    assert_eq!(code, 1);
    assert!(err.contains("kvtier stat:"), "{err}");
}

#[test]
fn master_metrics_port_in_use_fails_the_start() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let master_addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let (code, _, err) = kvtier(&["master", "--listen", &master_addr, "--metrics-addr", &addr]);
    assert_ne!(code, 0);
    assert!(err.contains("metrics_addr"), "{err}");
}
