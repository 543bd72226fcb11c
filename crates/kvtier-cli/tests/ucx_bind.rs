#![allow(clippy::unwrap_used)]
//! Issue 26 §1: kvtier's UCX binds only to the interface of the address the operator named
//! (a node's `--data-addr`; a client's route to its master), whatever `UCX_NET_DEVICES`
//! allows. Real processes in two network namespaces this test creates: "host A" has two
//! interfaces towards "host B" (veth pairs X and Y) besides its loopback; the master and a
//! node whose data address is on X run there. UCX runs over its tcp lane (the INSECURE test
//! hook: the only UCX lane that opens sockets, and so the one that would listen on every
//! interface), with `UCX_NET_DEVICES=all`: inside these namespaces "all" is lo, X and Y, all
//! made by this test.
//!
//! Checked (`/proc/PID/net/tcp`, the namespace of each process): the node listens on X's
//! address only (its data port and UCX's port), nothing on Y or loopback, while a client in
//! host B reads byte-exact over UCX through X; the client's own UCX listens only on its side
//! of X. Then a node whose operator's `UCX_NET_DEVICES` names only the other interface has no
//! UCX at all (empty intersection), says why in `kvtier stat`, opens no UCX socket, and is
//! read over frames.
//!
//! The namespaces (and with them the veth pairs) are removed when the test ends, also when it
//! fails ([`Hosts`]' drop kills the processes left inside: all started by this test). Without
//! root or `ip netns`, the test says so and skips. The child run is bounded by [`CHILD_LIMIT`].
//! Takes about 5 s.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::ucx::{keys, listening_sockets, put_objects, transport_of, ucx_client, OBJ};
use common::{object_bytes, wait_for, Pool, Proc, TOKEN};
use kvtier_client::transport::ucx::lanes::INSECURE_EMULATED_RMA_ENV;
use kvtier_client::Client;

const CHILD: &str = "TEST_CHILD_UCX_BIND";
/// A child run taking longer than this is killed and the test fails.
const CHILD_LIMIT: Duration = Duration::from_secs(90);
/// Interface X (the data address's) and Y (another one of host A's), each a veth pair.
const X_A: &str = "10.79.0.1";
const X_B: &str = "10.79.0.2";
const Y_A: &str = "10.79.1.1";
const Y_B: &str = "10.79.1.2";
/// The namespaces are private, so fixed ports cannot collide.
const MASTER_PORT: u16 = 7300;
const NODE_PORT: u16 = 7301;
const NODE_Y_PORT: u16 = 7302;

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two network namespaces joined by two veth pairs (X and Y); removed on drop.
struct Hosts {
    ns_a: String,
    ns_b: String,
    x_a: String,
    x_b: String,
    y_a: String,
    y_b: String,
}

impl Hosts {
    fn create() -> Result<Hosts, String> {
        let pid = std::process::id();
        let hosts = Hosts {
            ns_a: format!("kvtier-bind-a-{pid}"),
            ns_b: format!("kvtier-bind-b-{pid}"),
            // Interface names are at most 15 bytes; pids at most 7 digits.
            x_a: format!("kvbxa{pid}"),
            x_b: format!("kvbxb{pid}"),
            y_a: format!("kvbya{pid}"),
            y_b: format!("kvbyb{pid}"),
        };
        // From here on a failure drops `hosts`, which removes whatever was made.
        ip(&["netns", "add", &hosts.ns_a])?;
        ip(&["netns", "add", &hosts.ns_b])?;
        for (a, b, ip_a, ip_b) in [
            (&hosts.x_a, &hosts.x_b, X_A, X_B),
            (&hosts.y_a, &hosts.y_b, Y_A, Y_B),
        ] {
            ip(&["link", "add", a, "type", "veth", "peer", "name", b])?;
            ip(&["link", "set", a, "netns", &hosts.ns_a])?;
            ip(&["link", "set", b, "netns", &hosts.ns_b])?;
            for (ns, dev, addr) in [(&hosts.ns_a, a, ip_a), (&hosts.ns_b, b, ip_b)] {
                let cidr = format!("{addr}/24");
                ip(&["-n", ns, "addr", "add", &cidr, "dev", dev])?;
                ip(&["-n", ns, "link", "set", dev, "up"])?;
            }
        }
        for ns in [&hosts.ns_a, &hosts.ns_b] {
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in [&self.ns_a, &self.ns_b] {
            // Processes left inside (a child killed on its deadline leaves its nodes): all
            // were started by this test; killed by pid.
            if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            let _ = ip(&["netns", "del", ns]);
        }
        // Only if one never reached a namespace (deleting a namespace deletes its ends).
        for dev in [&self.x_a, &self.y_a] {
            let _ = Command::new("ip")
                .args(["link", "del", dev])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The addresses `pid` listens on, logged.
fn listening(pid: u32, who: &str) -> Vec<SocketAddr> {
    let found = listening_sockets(pid);
    eprintln!("{who} (pid {pid}) listens on {found:?}");
    found
}

#[test]
fn ucx_listens_only_on_the_data_address_interface() {
    if let Err(reason) = kvtier_client::transport::ucx::ffi::Ucp::get() {
        eprintln!("SKIP: libucp is not available here: {reason}");
        return;
    }
    let hosts = match Hosts::create() {
        Ok(h) => h,
        Err(reason) => {
            eprintln!("SKIP: this test needs network namespaces (root and iproute2): {reason}");
            return;
        }
    };
    let started = Instant::now();
    let name = "child_ucx_bind";
    let mut child = Command::new("ip")
        .args(["netns", "exec", &hosts.ns_b])
        .arg(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
        // INSECURE test hook: UCX's tcp lane (refused by default) is the one that listens.
        .env(INSECURE_EMULATED_RMA_ENV, "1")
        .env("TEST_NS_A", &hosts.ns_a)
        .env("TEST_X_A", &hosts.x_a)
        .env("TEST_Y_A", &hosts.y_a)
        .env("TEST_X_B", &hosts.x_b)
        .env("UCX_TLS", "tcp")
        // Every interface of these namespaces (lo, X, Y: all this test's): kvtier must narrow it.
        .env("UCX_NET_DEVICES", "all")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let drain = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > CHILD_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    drop(hosts); // kills what the child left behind, so the pipes close
    let text = format!("{}{}", out.join().unwrap(), err.join().unwrap());
    let status = status.unwrap_or_else(|| panic!("{name} ran over {CHILD_LIMIT:?}:\n{text}"));
    assert!(
        status.success() && text.contains("1 passed"),
        "{name} across namespaces:\n{text}"
    );
    for line in text.lines().filter(|l| l.contains("listens on")) {
        eprintln!("{line}");
    }
    eprintln!("{name}: ok in {:?}", started.elapsed());
}

fn child_env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by the parent test"))
}

/// Start `kvtier` with `args` in host A (`ip netns exec` execs it: the pid is kvtier's).
fn in_a(name: &str, args: &[&str], envs: &[(&str, &str)]) -> Proc {
    let ns_a = child_env("TEST_NS_A");
    let mut full = vec!["netns", "exec", ns_a.as_str(), env!("CARGO_BIN_EXE_kvtier")];
    full.extend_from_slice(args);
    let mut all = vec![("KVTIER_CLUSTER_TOKEN", TOKEN)];
    all.extend_from_slice(envs);
    Proc::spawn_program("ip", name, &full, &all)
}

fn node_args<'a>(socket: &'a str, master: &'a str, data: &'a str, id: &'a str) -> Vec<&'a str> {
    vec![
        "serve",
        "--socket",
        socket,
        "--dram-capacity",
        "32MiB",
        "--engine",
        "dram_prefault=false",
        "--engine",
        "cluster_transport=ucx",
        "--master",
        master,
        "--data-addr",
        data,
        "--node-id",
        id,
    ]
}

/// `kvtier stat --json` of the node at `socket` (its data plane), once it answers.
fn data_plane(socket: &str) -> serde_json::Value {
    let mut plane = serde_json::Value::Null;
    wait_for(Duration::from_secs(10), "kvtier stat of the node", || {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args(["stat", "--socket", socket, "--json"])
            .output()
            .unwrap();
        match serde_json::from_slice::<serde_json::Value>(&out.stdout) {
            Ok(doc) if doc.get("data_plane").is_some() => {
                plane = doc["data_plane"].clone();
                true
            }
            _ => false,
        }
    });
    plane
}

#[test]
#[ignore = "run by ucx_listens_only_on_the_data_address_interface inside a namespace"]
fn child_ucx_bind() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let (x_a, y_a, x_b) = (
        child_env("TEST_X_A"),
        child_env("TEST_Y_A"),
        child_env("TEST_X_B"),
    );
    let dir = tempfile::tempdir().unwrap();
    let master = format!("{X_A}:{MASTER_PORT}");
    let _master = in_a(
        "master (host A)",
        &["master", "--listen", &master, "--lease-ms", "1000"],
        &[],
    );
    let sock = dir.path().join("x.sock");
    let sock = sock.to_str().unwrap();
    let data = format!("{X_A}:{NODE_PORT}");
    let node = in_a(
        "node-x (host A)",
        &node_args(sock, &master, &data, "node-x"),
        &[],
    );
    let node_pid = node.child.id();

    // The node's data plane: UCX over its data address's interface only.
    let plane = data_plane(sock);
    assert_eq!(plane["transport"], "ucx", "{plane}");
    assert_eq!(plane["ucx_net_devices"], x_a.as_str(), "{plane}");

    // A client in host B reads through X over UCX, byte-exact.
    let mut client: Option<Client> = None;
    wait_for(Duration::from_secs(15), "the node registered", || {
        if client.is_none() {
            client = Client::open(common::cluster_config(&master, None)).ok();
        }
        client
            .as_ref()
            .and_then(|c| c.cluster())
            .and_then(|c| c.cluster_info().ok())
            .is_some_and(|info| info.nodes.iter().filter(|n| n.alive).count() == 1)
    });
    drop(client);
    let reader = ucx_client(&master, None);
    let ks = keys("bind", 16);
    put_objects(&reader, &ks, 11);
    let dst = Pool::new(ks.len(), OBJ);
    let registered = dst.register(&reader);
    let got = reader.get_keys(&ks, &dst.refs());
    assert!(got.ok.iter().all(|&b| b), "{:?}", got.errors);
    for (i, chunk) in dst.bytes.chunks(OBJ).enumerate() {
        assert!(
            chunk == object_bytes(11 + i as u64, OBJ),
            "object {i} differs"
        );
    }
    let (transport, reason) = transport_of(&reader, &data).expect("the node was read from");
    assert_eq!(transport, "ucx", "{reason}");
    let lanes = reader.stats_json()["peer_transports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["peer"] == data.as_str())
        .map(|p| p["ucx_lanes"].clone())
        .unwrap();
    assert!(
        lanes
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l.as_str().is_some_and(|l| l.ends_with(&format!("/{x_b}")))),
        "the reader's lanes use only its end of X ({x_b}): {lanes}"
    );

    // What the node listens on: its data port and UCX's port, all on X; nothing on Y, on
    // loopback or on a wildcard.
    let x: IpAddr = X_A.parse().unwrap();
    let node_listens = listening(node_pid, "node-x");
    assert!(
        node_listens.iter().all(|a| a.ip() == x),
        "node-x listens beyond {X_A} (its --data-addr): {node_listens:?}"
    );
    assert!(
        node_listens.len() >= 2 && node_listens.contains(&data.parse().unwrap()),
        "node-x should listen on its data port and UCX's port on {X_A}: {node_listens:?}"
    );
    // The client's UCX, on its route to the master (X): only its end of X.
    let x_b_ip: IpAddr = X_B.parse().unwrap();
    let client_listens = listening(std::process::id(), "the reader");
    assert!(
        !client_listens.is_empty() && client_listens.iter().all(|a| a.ip() == x_b_ip),
        "the reader's UCX should listen on {X_B} only: {client_listens:?}"
    );
    drop(registered);
    drop(reader);

    // An operator whose UCX_NET_DEVICES names only the other interface: the intersection with
    // the data address's interface (Y) is empty, so no UCX at all, the reason in `stat`, no
    // UCX socket, and peers read over frames.
    let sock_y = dir.path().join("y.sock");
    let sock_y = sock_y.to_str().unwrap();
    let data_y = format!("{Y_A}:{NODE_Y_PORT}");
    let node_y = in_a(
        "node-y (host A)",
        &node_args(sock_y, &master, &data_y, "node-y"),
        &[("UCX_NET_DEVICES", &x_a)],
    );
    let plane = data_plane(sock_y);
    assert_eq!(plane["transport"], "frames", "{plane}");
    let why = plane["reason"].as_str().unwrap_or_default();
    assert!(
        why.contains(&format!("UCX_NET_DEVICES={x_a}")) && why.contains(&y_a),
        "{why}"
    );
    let y: SocketAddr = data_y.parse().unwrap();
    assert_eq!(listening(node_y.child.id(), "node-y"), vec![y]);
    let reader = ucx_client(&master, Some("node-y"));
    wait_for(Duration::from_secs(15), "node-y registered", || {
        reader
            .cluster()
            .and_then(|c| c.cluster_info().ok())
            .is_some_and(|info| info.nodes.iter().filter(|n| n.alive).count() == 2)
    });
    let ks = keys("frames", 4);
    put_objects(&reader, &ks, 23);
    assert_eq!(
        reader.cluster().unwrap().where_is(&ks[0]).unwrap(),
        vec!["node-y".to_string()]
    );
    let dst = Pool::new(ks.len(), OBJ);
    let _registered = dst.register(&reader);
    let got = reader.get_keys(&ks, &dst.refs());
    assert!(got.ok.iter().all(|&b| b), "{:?}", got.errors);
    for (i, chunk) in dst.bytes.chunks(OBJ).enumerate() {
        assert!(
            chunk == object_bytes(23 + i as u64, OBJ),
            "object {i} differs"
        );
    }
    let (transport, reason) = transport_of(&reader, &data_y).expect("node-y was read from");
    assert_eq!(transport, "tcp", "{reason}");
    eprintln!("node-y: frames ({reason})");
}
