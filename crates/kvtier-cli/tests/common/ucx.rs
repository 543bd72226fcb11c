//! Helpers shared by the UCX cluster tests (`cluster_ucx.rs`, `cluster_ucx_netns.rs`): key
//! names, 256 KiB objects written through a registered pool, a cluster client with
//! `cluster_transport = "ucx"`, and what a client reports of its transport to a peer.
//! Issue 26: the TCP sockets a process listens on ([`listening_sockets`]) and the stranger
//! ([`stranger_probe`]): a UCX peer with no cluster token that crafts a worker address for a
//! target's port and tries one-sided reads and writes there.

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

/// The TCP addresses process `pid` listens on (IPv4 and IPv6): its socket descriptors
/// (`/proc/PID/fd`) matched by inode with the LISTEN rows of `/proc/PID/net/tcp{,6}`.
pub fn listening_sockets(pid: u32) -> Vec<std::net::SocketAddr> {
    let mut inodes = std::collections::HashSet::new();
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for entry in dir.flatten() {
            if let Ok(link) = std::fs::read_link(entry.path()) {
                let link = link.to_string_lossy().into_owned();
                if let Some(inode) = link
                    .strip_prefix("socket:[")
                    .and_then(|r| r.strip_suffix(']'))
                {
                    inodes.insert(inode.to_string());
                }
            }
        }
    }
    let mut found = Vec::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{file}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() < 10 || cols[3] != "0A" || !inodes.contains(cols[9]) {
                continue;
            }
            let Some((ip_hex, port_hex)) = cols[1].split_once(':') else {
                continue;
            };
            let Ok(port) = u16::from_str_radix(port_hex, 16) else {
                continue;
            };
            // The kernel prints the address as native-endian 32-bit words.
            let mut bytes = Vec::new();
            for word in 0..ip_hex.len() / 8 {
                let Ok(w) = u32::from_str_radix(&ip_hex[word * 8..word * 8 + 8], 16) else {
                    continue;
                };
                bytes.extend_from_slice(&w.to_ne_bytes());
            }
            let ip: std::net::IpAddr = if v6 {
                let Ok(b) = <[u8; 16]>::try_from(bytes.as_slice()) else {
                    continue;
                };
                std::net::Ipv6Addr::from(b).into()
            } else {
                let Ok(b) = <[u8; 4]>::try_from(bytes.as_slice()) else {
                    continue;
                };
                std::net::Ipv4Addr::from(b).into()
            };
            found.push(std::net::SocketAddr::new(ip, port));
        }
    }
    found.sort();
    found.dedup();
    found
}

/// What the stranger achieved against one target port.
#[derive(Debug)]
pub struct StrangerResult {
    pub target: std::net::SocketAddr,
    /// The bytes read, or why nothing was.
    pub read: Result<Vec<u8>, String>,
    /// Whether the write completed (UCX reported it in the peer's memory), or why not.
    pub wrote: Result<(), String>,
}

/// The stranger: a UCX peer without the cluster token (its own context, which the caller
/// lets use UCX's tcp lane through the insecure test hook: an attacker runs any UCX it likes).
/// It takes its own worker address, puts each target's IP and port in place of its own, and
/// with a remote key of its own memory (UCX's emulated lanes check none) reads `len` bytes at
/// `read_at` and writes `len` bytes of 0x5a at `write_at` (if given), each bounded by
/// `timeout`. Needs `UCX_TLS=tcp` and `UCX_NET_DEVICES` set to one device.
pub fn stranger_probe(
    targets: &[std::net::SocketAddr],
    read_at: u64,
    write_at: Option<u64>,
    len: usize,
    timeout: std::time::Duration,
) -> Result<Vec<StrangerResult>, String> {
    use kvtier_client::transport::ucx::{Context, RemoteExtent};
    let context = Context::new().map_err(|e| format!("stranger context: {e}"))?;
    let worker = context.worker().map_err(|e| e.to_string())?;
    let own = worker.address().map_err(|e| e.to_string())?;
    let mine = listening_sockets(std::process::id());
    if std::env::var_os("TEST_STRANGER_DUMP").is_some() {
        let hex: String = own.iter().map(|b| format!("{b:02x}")).collect();
        println!("DUMP own address {hex} listening {mine:?}");
    }
    let [own_socket] = mine.as_slice() else {
        return Err(format!(
            "the stranger's worker should listen on one socket, not {mine:?}"
        ));
    };
    let std::net::IpAddr::V4(own_ip) = own_socket.ip() else {
        return Err(format!("not IPv4: {own_socket}"));
    };
    // The tcp interface address (the port, big-endian) ends UCX 1.13's packed address; the
    // last match, as the random UUID before it may hold the same two bytes.
    let port = own_socket.port().to_be_bytes();
    let port_at = own
        .windows(2)
        .rposition(|w| w == port)
        .ok_or_else(|| format!("own port {} not in the address", own_socket.port()))?;
    // UCX 1.13 packs a loopback device's address without its IP; another device's IP is in
    // it once (checked when a target needs it replaced).
    let ip_at = find_once(&own, &own_ip.octets());
    let mut bait = vec![0u8; len.max(8)];
    let registration = context
        .register(bait.as_mut_ptr(), bait.len())
        .map_err(|e| e.to_string())?;
    let key = registration.pack_key().map_err(|e| e.to_string())?;
    let mut results = Vec::new();
    for &target in targets {
        let std::net::IpAddr::V4(ip) = target.ip() else {
            continue;
        };
        let mut crafted = own.clone();
        // Bytes 1..9 are the worker's UUID (UCX 1.13 address header): another worker's, so
        // UCX does not take the target for this worker itself.
        for b in crafted.iter_mut().skip(1).take(8) {
            *b ^= 0x5a;
        }
        crafted[port_at..port_at + 2].copy_from_slice(&target.port().to_be_bytes());
        if ip != own_ip {
            let at = ip_at.ok_or_else(|| format!("own IP {own_ip} not once in the address"))?;
            crafted[at..at + 4].copy_from_slice(&ip.octets());
        }
        let attempt = |write: bool| -> Result<Vec<u8>, String> {
            let mut ep = worker.connect(&crafted).map_err(|e| e.to_string())?;
            ep.set_remote_key(&key).map_err(|e| e.to_string())?;
            let mut buf = vec![0u8; len];
            if write {
                let src = vec![0x5au8; len];
                let at = write_at.unwrap_or(read_at);
                ep.put(&[RemoteExtent { remote: at, len }], &[&src], timeout)
                    .map_err(|e| e.to_string())?;
            } else {
                ep.get(
                    &[RemoteExtent {
                        remote: read_at,
                        len,
                    }],
                    &mut [&mut buf[..]],
                    timeout,
                )
                .map_err(|e| e.to_string())?;
            }
            Ok(buf)
        };
        let read = attempt(false);
        let wrote = match write_at {
            Some(_) => attempt(true).map(|_| ()),
            None => Err("not tried".into()),
        };
        results.push(StrangerResult {
            target,
            read,
            wrote,
        });
    }
    drop(registration);
    Ok(results)
}

/// The offset of the one occurrence of `needle` in `hay` (`None`: absent or ambiguous).
fn find_once(hay: &[u8], needle: &[u8]) -> Option<usize> {
    let mut hits = hay
        .windows(needle.len())
        .enumerate()
        .filter(|(_, w)| *w == needle);
    let first = hits.next()?.0;
    hits.next().is_none().then_some(first)
}

/// The address of process `pid`'s executable's first mapping (its ELF header): memory the
/// stranger can name without the node's help.
pub fn exe_base(pid: u32) -> Option<u64> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let exe = exe.to_string_lossy().into_owned();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines().find_map(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        (cols.len() >= 6 && cols[2] == "00000000" && cols[5] == exe)
            .then(|| u64::from_str_radix(cols[0].split('-').next()?, 16).ok())
            .flatten()
    })
}
