//! Helpers shared by the UCX cluster tests (`cluster_ucx.rs`, `cluster_ucx_netns.rs`): key
//! names, 256 KiB objects written through a registered pool, a cluster client with
//! `cluster_transport = "ucx"`, and what a client reports of its transport to a peer.

use kvtier_client::{BatchResult, Client, KvtierConfig};

use super::{object_bytes, Pool};

/// The objects' length in the UCX scenarios.
pub const OBJ: usize = 256 << 10;

/// `n` keys `prefix00000`, `prefix00001`, ...
pub fn keys(prefix: &str, n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| format!("{prefix}{i:05}").into_bytes())
        .collect()
}

/// Put `keys` through `client`, object `i` being `object_bytes(seed + i, len)`, from a
/// registered pool; the per-key report.
pub fn try_put_objects(client: &Client, keys: &[Vec<u8>], seed: u64, len: usize) -> BatchResult {
    let mut pool = Pool::new(keys.len(), len);
    for (i, chunk) in pool.bytes.chunks_mut(len).enumerate() {
        chunk.copy_from_slice(&object_bytes(seed + i as u64, len));
    }
    let registered = pool.register(client);
    let report = client.put_keys(keys, &pool.refs(), None);
    drop(registered);
    report
}

/// [`try_put_objects`] of [`OBJ`]-byte objects; every put must succeed.
pub fn put_objects(client: &Client, keys: &[Vec<u8>], seed: u64) {
    let r = try_put_objects(client, keys, seed, OBJ);
    assert!(r.ok.iter().all(|&b| b), "{:?}", r.errors);
}

/// Read `keys` through `client` (objects of `len` bytes) and assert every one byte-exact:
/// object `i` is `object_bytes(seed + i, len)`.
pub fn assert_read_exact(client: &Client, keys: &[Vec<u8>], seed: u64, len: usize) {
    let dst = Pool::new(keys.len(), len);
    let _dst_registered = dst.register(client);
    let got = client.get_keys(keys, &dst.refs());
    assert!(got.ok.iter().all(|&b| b), "{:?}", got.errors);
    for (i, chunk) in dst.bytes.chunks(len).enumerate() {
        assert!(
            chunk == object_bytes(seed + i as u64, len),
            "object {i} differs"
        );
    }
}

/// A cluster client with `cluster_transport = "ucx"` and a 1 s request deadline.
pub fn ucx_client(master: &str, node_id: Option<&str>) -> Client {
    Client::open(KvtierConfig {
        cluster_transport: "ucx".into(),
        cluster_request_timeout_ms: 1000,
        ..super::cluster_config(master, node_id)
    })
    .expect("open a cluster client")
}

/// What `client` reports of `peer` in `peer_transports` (`None`: not used yet).
pub fn peer_entry(client: &Client, peer: &str) -> Option<serde_json::Value> {
    let stats = client.stats_json();
    stats["peer_transports"]
        .as_array()
        .and_then(|list| list.iter().find(|p| p["peer"] == peer).cloned())
}

/// The (read) transport `client` reports for `peer` and why (`None`: not used yet).
pub fn transport_of(client: &Client, peer: &str) -> Option<(String, String)> {
    peer_entry(client, peer).map(|p| {
        (
            p["transport"].as_str().unwrap_or("").to_string(),
            p["reason"].as_str().unwrap_or("").to_string(),
        )
    })
}

/// How `client`'s puts travel to `peer` (`"ucx"`, `"tcp"`, `"not yet"`) and why.
pub fn puts_of(client: &Client, peer: &str) -> Option<(String, String)> {
    peer_entry(client, peer).map(|p| {
        (
            p["puts"].as_str().unwrap_or("").to_string(),
            p["puts_reason"].as_str().unwrap_or("").to_string(),
        )
    })
}
