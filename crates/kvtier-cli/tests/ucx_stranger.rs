#![allow(clippy::unwrap_used)]
//! Issue 26 §1: a stranger (no cluster token) against the UCX plane of real processes.
//!
//! The stranger ([`common::ucx::stranger_probe`], run in a child process of this test binary)
//! is a UCX peer of its own: it takes its worker address, puts a target's IP and port in it,
//! and with a remote key of its own memory (UCX's emulated lanes check none) reads a node's
//! ELF header (its address from `/proc/PID/maps`) and writes over it.
//!
//! - Positive control: a node started with the INSECURE test hook
//!   (`TEST_INSECURE_UCX_EMULATED_RMA=1`, UCX's tcp lane) listens on an extra UCX port and the
//!   stranger reads its memory through it: the probe works, and shows what the hook exposes.
//! - The default node (`cluster_transport = "ucx"`, `UCX_TLS=tcp`, no hook) refuses UCX: it
//!   listens on its `--data-addr` and nothing else (`/proc/PID/net/tcp`), the stranger aimed
//!   at that port reads and writes nothing, and a legitimate `cluster_transport = "ucx"`
//!   client (no hook either) opens no listening socket of its own and is served byte-exact
//!   over frames before and after the attack.
//! - The same across an interface: the nodes in one network namespace, the stranger and the
//!   legitimate client in another, joined by a veth pair this test creates and removes
//!   (skipped, saying so, without root / `ip netns`).
//!
//! Every child run is bounded ([`CHILD_LIMIT`]); every UCX transfer of the stranger by 2 s.

mod common;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::netns::TwoHosts;
use common::ucx::{
    assert_read_exact, exe_base, keys, listening_sockets, put_objects, stranger_probe,
    transport_of, ucx_client,
};
use common::{free_port, spawn_master, wait_for, Proc, TOKEN};

const CHILD: &str = "TEST_CHILD_UCX_STRANGER";
const HOOK: &str = kvtier_client::transport::ucx::lanes::INSECURE_EMULATED_RMA_ENV;
const CHILD_LIMIT: Duration = Duration::from_secs(60);
/// The stranger's per-transfer bound.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
const ELF: [u8; 4] = [0x7f, b'E', b'L', b'F'];

fn libucp() -> bool {
    match kvtier_client::transport::ucx::ffi::Ucp::get() {
        Ok(_) => true,
        Err(reason) => {
            eprintln!("SKIP: libucp is not available here: {reason}");
            false
        }
    }
}

fn as_refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn node_args(socket: &str, master: &str, data: &str, id: &str) -> Vec<String> {
    [
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
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Run `cmd` (a child of this test binary, possibly under `ip netns exec`), bounded; its
/// output, after asserting it passed.
fn run_bounded(mut cmd: Command, what: &str) -> String {
    let started = Instant::now();
    let mut child = cmd
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
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = format!("{}{}", out.join().unwrap(), err.join().unwrap());
    let status = status.unwrap_or_else(|| panic!("{what} ran over {CHILD_LIMIT:?}:\n{text}"));
    assert!(
        status.success() && text.contains("1 passed"),
        "{what}:\n{text}"
    );
    eprintln!("{what}: ok in {:?}", started.elapsed());
    text
}

/// The child command running ignored test `name` of this binary, under `prefix` (e.g.
/// `ip netns exec NS`).
fn child_command(prefix: &[&str], name: &str) -> Command {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match prefix.split_first() {
        Some((program, args)) => {
            let mut c = Command::new(program);
            c.args(args).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    cmd.args([
        "--ignored",
        "--exact",
        name,
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD, "1");
    cmd
}

/// What the stranger did against one target: (target, bytes read or why not, written or why
/// not).
type Outcome = (SocketAddr, Result<Vec<u8>, String>, Result<(), String>);

/// Run the stranger in a child (`prefix`: its namespace) against `targets` with `device` as
/// its UCX device: per target, (what it read, whether it wrote).
fn run_stranger(
    prefix: &[&str],
    device: &str,
    targets: &[SocketAddr],
    read_at: u64,
    write_at: Option<u64>,
) -> Vec<Outcome> {
    let list: Vec<String> = targets.iter().map(|t| t.to_string()).collect();
    let mut cmd = child_command(prefix, "child_stranger");
    cmd.env(HOOK, "1")
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", device)
        .env("TEST_STRANGER_TARGETS", list.join(","))
        .env("TEST_STRANGER_READ", format!("{read_at:x}"))
        .env(
            "TEST_STRANGER_WRITE",
            write_at.map(|w| format!("{w:x}")).unwrap_or_default(),
        );
    let text = run_bounded(cmd, "the stranger");
    let mut results = Vec::new();
    for line in text
        .lines()
        .filter_map(|l| l.find("STRANGER ").map(|at| &l[at + "STRANGER ".len()..]))
    {
        let mut parts = line.splitn(3, ' ');
        let target: SocketAddr = parts.next().unwrap().parse().unwrap();
        let read = parts.next().unwrap();
        let wrote = parts.next().unwrap();
        let read = match read.strip_prefix("read=") {
            Some(hex) => Ok((0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).unwrap())
                .collect()),
            None => Err(read.to_string()),
        };
        let wrote = if wrote == "wrote" {
            Ok(())
        } else {
            Err(wrote.to_string())
        };
        results.push((target, read, wrote));
    }
    assert_eq!(results.len(), targets.len(), "{text}");
    for r in &results {
        eprintln!(
            "figures: stranger vs {}: read {:?}, write {:?}",
            r.0, r.1, r.2
        );
    }
    results
}

#[test]
#[ignore = "run by the tests of this file in a child process"]
fn child_stranger() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let targets: Vec<SocketAddr> = std::env::var("TEST_STRANGER_TARGETS")
        .unwrap()
        .split(',')
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().unwrap())
        .collect();
    let read_at = u64::from_str_radix(&std::env::var("TEST_STRANGER_READ").unwrap(), 16).unwrap();
    let write_at = std::env::var("TEST_STRANGER_WRITE")
        .ok()
        .filter(|w| !w.is_empty())
        .map(|w| u64::from_str_radix(&w, 16).unwrap());
    let results = stranger_probe(&targets, read_at, write_at, ELF.len(), PROBE_TIMEOUT).unwrap();
    for r in results {
        let read = match &r.read {
            Ok(bytes) => format!(
                "read={}",
                bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
            ),
            Err(e) => format!("failed:{}", e.replace(' ', "_")),
        };
        let wrote = match &r.wrote {
            Ok(()) => "wrote".to_string(),
            Err(e) => format!("failed:{}", e.replace(' ', "_")),
        };
        println!("STRANGER {} {read} {wrote}", r.target);
    }
}

/// The checks on a default node and its legitimate client after the stranger ran.
fn assert_default_node_safe(
    results: &[Outcome],
    default_ports: &[SocketAddr],
    control_ports: &[SocketAddr],
) {
    for (target, read, wrote) in results {
        if default_ports.contains(target) {
            assert!(
                read.is_err(),
                "the stranger read {read:?} from the default node at {target}"
            );
            assert!(
                wrote.is_err(),
                "the stranger wrote into the default node at {target}"
            );
        }
    }
    // The positive control: the hooked node's UCX port gave its ELF header away.
    assert!(
        results
            .iter()
            .any(|(t, read, _)| control_ports.contains(t) && read.as_deref() == Ok(&ELF[..])),
        "the probe read nothing from the INSECURE hooked node either (the probe itself is \
         broken?): {results:?}"
    );
}

#[test]
fn stranger_reads_and_writes_nothing_over_loopback() {
    if !libucp() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let master = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let _master = spawn_master(&master, 1000, &[]);
    let ucx_env = |hook: &'static str| {
        [
            ("KVTIER_CLUSTER_TOKEN", TOKEN),
            ("UCX_TLS", "tcp"),
            ("UCX_NET_DEVICES", "lo"),
            (HOOK, hook),
        ]
    };
    let data_d = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let data_h = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let sock = |id: &str| dir.path().join(format!("{id}.sock"));
    let args_d = node_args(sock("d").to_str().unwrap(), &master, &data_d, "node-d");
    let args_h = node_args(sock("h").to_str().unwrap(), &master, &data_h, "node-h");
    let node_d = Proc::spawn("node-d", &as_refs(&args_d), &ucx_env("0"));
    let node_h = Proc::spawn("node-h (INSECURE hook)", &as_refs(&args_h), &ucx_env("1"));
    // The legitimate client: cluster_transport = "ucx", this process (no hook).
    let client = ucx_client(&master, None);
    wait_for(Duration::from_secs(15), "both nodes registered", || {
        client
            .cluster()
            .and_then(|c| c.cluster_info().ok())
            .is_some_and(|info| info.nodes.iter().filter(|n| n.alive).count() == 2)
    });
    let ks = keys("s", 24);
    put_objects(&client, &ks, 900);
    assert_read_exact(&client, &ks, 900, common::ucx::OBJ);

    // The default node listens on its --data-addr only; the hooked one also on UCX's port.
    let data_d: SocketAddr = data_d.parse().unwrap();
    let data_h: SocketAddr = data_h.parse().unwrap();
    let pid_d = node_d.child.id();
    let pid_h = node_h.child.id();
    wait_for(Duration::from_secs(10), "the nodes' sockets", || {
        listening_sockets(pid_d).contains(&data_d) && listening_sockets(pid_h).len() > 1
    });
    assert_eq!(listening_sockets(pid_d), vec![data_d]);
    let control: Vec<SocketAddr> = listening_sockets(pid_h)
        .into_iter()
        .filter(|s| *s != data_h)
        .collect();
    eprintln!("figures: node-d listens on {data_d}; node-h (hook) also on {control:?}");
    // The legitimate UCX client opened no listening socket either.
    assert_eq!(
        listening_sockets(std::process::id()),
        Vec::<SocketAddr>::new()
    );

    // Each node's own ELF header (one binary, but mapped where ASLR put it).
    let base_d = exe_base(pid_d).expect("node-d's ELF header");
    let base_h = exe_base(pid_h).expect("node-h's ELF header");
    let results_d = run_stranger(&[], "lo", &[data_d], base_d, Some(base_d));
    let results_h = run_stranger(&[], "lo", &control, base_h, None);
    let all: Vec<_> = results_d.into_iter().chain(results_h).collect();
    assert_default_node_safe(&all, &[data_d], &control);

    // The default node still serves the legitimate client byte-exact, over frames, and says
    // why not UCX.
    assert_read_exact(&client, &ks, 900, common::ucx::OBJ);
    let (transport, reason) = transport_of(&client, &data_d.to_string()).unwrap_or_default();
    if !transport.is_empty() {
        assert_eq!(transport, "tcp", "{reason}");
        assert!(reason.contains("UCX refused"), "{reason}");
    }
    let stats = client.stats_json();
    assert!(
        stats["ucx_unavailable"]
            .as_str()
            .is_some_and(|r| r.contains("UCX refused")),
        "{stats}"
    );
    drop(node_h);
    drop(node_d);
}

/// Two network namespaces joined by a veth pair ("host A" with the nodes, "host B" with the
/// stranger and the legitimate client); removed on drop, with what runs inside (all of it
/// started by this test, killed by pid).
const IP_A: &str = "10.78.0.1";
const IP_B: &str = "10.78.0.2";

#[test]
#[ignore = "run by stranger_reads_and_writes_nothing_across_namespaces inside host B"]
fn child_legit() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let master = std::env::var("TEST_LEGIT_MASTER").unwrap();
    let client = ucx_client(&master, None);
    wait_for(Duration::from_secs(15), "both nodes registered", || {
        client
            .cluster()
            .and_then(|c| c.cluster_info().ok())
            .is_some_and(|info| info.nodes.iter().filter(|n| n.alive).count() == 2)
    });
    let ks = keys("n", 16);
    if std::env::var("TEST_LEGIT_PHASE").unwrap() == "put" {
        put_objects(&client, &ks, 4200);
    }
    assert_read_exact(&client, &ks, 4200, common::ucx::OBJ);
    let stats = client.stats_json();
    assert!(
        stats["ucx_unavailable"]
            .as_str()
            .is_some_and(|r| r.contains("UCX refused")),
        "{stats}"
    );
    // This UCX client listens on nothing.
    assert_eq!(
        listening_sockets(std::process::id()),
        Vec::<SocketAddr>::new()
    );
}

#[test]
fn stranger_reads_and_writes_nothing_across_namespaces() {
    if !libucp() {
        return;
    }
    let hosts = match TwoHosts::create("str", IP_A, IP_B) {
        Ok(h) => h,
        Err(reason) => {
            eprintln!("SKIP: needs network namespaces (root and iproute2): {reason}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let kvtier = env!("CARGO_BIN_EXE_kvtier");
    let master = format!("{IP_A}:7200");
    let data_d: SocketAddr = format!("{IP_A}:7201").parse().unwrap();
    let data_h: SocketAddr = format!("{IP_A}:7202").parse().unwrap();
    let in_a = |name: &str, args: &[String], hook: &str| {
        let mut full: Vec<&str> = vec!["netns", "exec", &hosts.ns_a, kvtier];
        full.extend(args.iter().map(String::as_str));
        // `ip netns exec` execs the program: the pid is the kvtier process itself.
        Proc::spawn_program(
            "ip",
            name,
            &full,
            &[
                ("KVTIER_CLUSTER_TOKEN", TOKEN),
                ("UCX_TLS", "tcp"),
                ("UCX_NET_DEVICES", &hosts.veth_a),
                (HOOK, hook),
            ],
        )
    };
    let master_args: Vec<String> = ["master", "--listen", &master, "--lease-ms", "1000"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let _master = in_a("master (host A)", &master_args, "0");
    let sock = |id: &str| dir.path().join(format!("{id}.sock"));
    let node_d = in_a(
        "node-d (host A)",
        &node_args(
            sock("d").to_str().unwrap(),
            &master,
            &data_d.to_string(),
            "node-d",
        ),
        "0",
    );
    let node_h = in_a(
        "node-h (host A, INSECURE hook)",
        &node_args(
            sock("h").to_str().unwrap(),
            &master,
            &data_h.to_string(),
            "node-h",
        ),
        "1",
    );
    let in_b = ["ip", "netns", "exec", hosts.ns_b.as_str()];
    let legit = |phase: &str| {
        let mut cmd = child_command(&in_b, "child_legit");
        cmd.env_remove(HOOK)
            .env("UCX_TLS", "tcp")
            .env("UCX_NET_DEVICES", &hosts.veth_b)
            .env("TEST_LEGIT_MASTER", &master)
            .env("TEST_LEGIT_PHASE", phase);
        run_bounded(cmd, &format!("the legitimate client in host B ({phase})"));
    };
    legit("put");

    let (pid_d, pid_h) = (node_d.child.id(), node_h.child.id());
    wait_for(Duration::from_secs(10), "the nodes' sockets", || {
        listening_sockets(pid_d).contains(&data_d) && listening_sockets(pid_h).len() > 1
    });
    assert_eq!(listening_sockets(pid_d), vec![data_d]);
    let control: Vec<SocketAddr> = listening_sockets(pid_h)
        .into_iter()
        .filter(|s| *s != data_h)
        .collect();
    eprintln!("figures: host A node-d listens on {data_d}; node-h (hook) also on {control:?}");
    let base_d = exe_base(pid_d).expect("node-d's ELF header");
    let base_h = exe_base(pid_h).expect("node-h's ELF header");
    let results_d = run_stranger(&in_b, &hosts.veth_b, &[data_d], base_d, Some(base_d));
    let results_h = run_stranger(&in_b, &hosts.veth_b, &control, base_h, None);
    let all: Vec<_> = results_d.into_iter().chain(results_h).collect();
    assert_default_node_safe(&all, &[data_d], &control);
    legit("read");
    drop(node_h);
    drop(node_d);
    drop(hosts);
}
