//! Per-peer transfer bytes (`kvtier_peer_transfer_bytes_total{peer, direction}`) with real
//! processes: a `kvtier master`, one `kvtier serve --master --metrics-addr` node, and a
//! cluster client in this process that is not on the node (no node id), so every byte crosses
//! TCP. The node's `/metrics` and the client's own endpoint are scraped over HTTP after a
//! remote put and after a remote get; each counter moves by exactly the page bytes moved,
//! over frames or (`TEST_CLUSTER_TRANSPORT=ucx`, scripts/test.sh) over one-sided UCX.
#![allow(clippy::unwrap_used)]

mod common;

use std::net::TcpStream;
use std::time::Duration;

use common::{free_port, metrics_text, spawn_master, wait_for, NodeOpts};
use kvtier_client::{Client, KvtierConfig};

const NAME: &str = "kvtier_peer_transfer_bytes_total";
const LIMIT: Duration = Duration::from_secs(20);

/// The counter's value for `peer` and `direction` (0 when not published yet).
fn transfer(addr: &str, peer: &str, direction: &str) -> u64 {
    let text = metrics_text(addr).expect("scrape");
    let want_peer = format!("peer=\"{peer}\"");
    let want_dir = format!("direction=\"{direction}\"");
    text.lines()
        .filter(|l| l.starts_with(&format!("{NAME}{{")))
        .filter(|l| l.contains(&want_peer) && l.contains(&want_dir))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

#[test]
fn peer_transfer_bytes_count_remote_puts_and_gets_on_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let node_metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let _master = spawn_master(&master, 3000, &[]);
    wait_for(LIMIT, "the master", || TcpStream::connect(&master).is_ok());
    let mut node = NodeOpts::new(dir.path(), &master, "node-m", "127.0.0.1");
    node.metrics_addr = Some(node_metrics.clone());
    let data = node.data.clone();
    let _node = node.spawn();
    wait_for(LIMIT, "the node's metrics endpoint", || {
        metrics_text(&node_metrics).is_some()
    });

    let client = Client::open(KvtierConfig {
        metrics_addr: Some("127.0.0.1:0".into()),
        cluster_request_timeout_ms: 2000,
        ..common::cluster_config(&master, None)
    })
    .expect("cluster client");
    let client_metrics = client.metrics_addr().expect("client endpoint").to_string();
    let cluster = client.cluster().expect("cluster mode");
    wait_for(LIMIT, "the node to register", || {
        cluster
            .cluster_info()
            .is_ok_and(|i| i.nodes.iter().any(|n| n.alive))
    });

    // Objects of a few sizes, one not a multiple of anything.
    let values: Vec<Vec<u8>> = [256 << 10, 256 << 10, 1 << 20, 100_003]
        .iter()
        .enumerate()
        .map(|(i, &len)| (0..len).map(|b| (b * 7 + i) as u8).collect())
        .collect();
    // Objects as stored: each with its end-to-end integrity trailer.
    let total: u64 = values
        .iter()
        .map(|v| (v.len() + kvtier_proto::auth::CHECKSUM_LEN) as u64)
        .sum();
    let keys: Vec<String> = (0..values.len()).map(|i| format!("pm/{i}")).collect();
    // The node sees this process by its IP; this process sees the node by its data address.
    let node_in = transfer(&node_metrics, "127.0.0.1", "in");
    let node_out = transfer(&node_metrics, "127.0.0.1", "out");

    for (k, v) in keys.iter().zip(&values) {
        client.put_slice(k.as_bytes(), v, None).expect("remote put");
    }
    assert_eq!(transfer(&node_metrics, "127.0.0.1", "in"), node_in + total);
    assert_eq!(transfer(&node_metrics, "127.0.0.1", "out"), node_out);
    assert_eq!(transfer(&client_metrics, &data, "out"), total);
    assert_eq!(transfer(&client_metrics, &data, "in"), 0);

    for (k, v) in keys.iter().zip(&values) {
        let mut dst = vec![0u8; v.len()];
        client
            .get_into_slice(k.as_bytes(), &mut dst)
            .expect("remote get");
        assert!(dst == *v, "{k}: different bytes");
    }
    // Under TEST_CLUSTER_TRANSPORT=ucx the bytes moved one-sided, and the node still
    // counted them (committed puts in, released leases out).
    common::assert_test_transport(&client, &data);
    // A put of a key already stored moves no page bytes (the master answers "present").
    client
        .put_slice(keys[0].as_bytes(), &values[0], None)
        .expect("second put");
    assert_eq!(
        transfer(&node_metrics, "127.0.0.1", "out"),
        node_out + total
    );
    assert_eq!(transfer(&node_metrics, "127.0.0.1", "in"), node_in + total);
    assert_eq!(transfer(&client_metrics, &data, "in"), total);
    assert_eq!(transfer(&client_metrics, &data, "out"), total);
    drop(client);
}
