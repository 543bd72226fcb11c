//! The metrics endpoints under attack and in their lifecycle (issue 26 §3, issue 27 §3), against
//! real `kvtier serve` and `kvtier master` processes:
//! - a client dribbling its request one byte a second holds no scrape up and is cut at the
//!   whole-request deadline (408); hundreds of idle connections do not lock a scraper out
//!   (the oldest are shed) and the process's threads stay bounded;
//! - a bare port binds loopback only, and no TCP listener exists unless one is configured;
//! - `/healthz` and `/readyz`: a node is not ready until it registers with its master, turns
//!   not ready when the master is gone and ready again when it is back; a master is ready
//!   when it leads; the master lists node ids only when the operator asks.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, spawn_master, wait_for, NodeOpts, Proc, TOKEN};

/// `GET path` at `addr`: the status code and body, or `None` while nothing answers.
fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// Start `kvtier serve` (16 MiB, no pre-fault) with `extra` flags; its socket in `dir`.
fn serve(dir: &std::path::Path, extra: &[&str]) -> Proc {
    let socket = dir.join("kvtier.sock");
    let mut args = vec![
        "serve",
        "--socket",
        socket.to_str().unwrap(),
        "--dram-capacity",
        "16MiB",
        "--engine",
        "dram_prefault=false",
    ];
    args.extend_from_slice(extra);
    Proc::spawn("kvtier serve", &args, &[])
}

fn wait_status(addr: &str, path: &str, status: u16, limit: Duration) -> String {
    let start = Instant::now();
    loop {
        let last = match http_get(addr, path) {
            Some((s, body)) if s == status => return body,
            other => other,
        };
        assert!(
            start.elapsed() < limit,
            "{path} at {addr} never answered {status}; last: {last:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of an unlabelled or labelled series as rendered (`name{a="b"}`).
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

fn threads_of(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// The local addresses (`IP:PORT`, hex as in /proc/net/tcp) of the TCP sockets process `pid`
/// listens on.
fn tcp_listeners(pid: u32) -> Vec<String> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let mut out = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address, state 0A = LISTEN, inode is field 9.
            if f.len() > 9 && f[3] == "0A" && inodes.iter().any(|i| i == f[9]) {
                out.push(f[1].to_string());
            }
        }
    }
    out
}

#[test]
fn a_dribbling_client_blocks_no_scrape_and_is_cut_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let _serve = serve(dir.path(), &["--metrics-addr", &addr]);
    wait_status(&addr, "/healthz", 200, Duration::from_secs(20));

    // Three attackers: a request line, then one header byte a second, never finishing.
    let attackers: Vec<_> = (0..3)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(&addr).unwrap();
                let start = Instant::now();
                s.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
                s.set_read_timeout(Some(Duration::from_millis(1000)))
                    .unwrap();
                let mut reply = Vec::new();
                let mut buf = [0u8; 512];
                // At most 15 s: the old endpoint never cut such a client.
                while start.elapsed() < Duration::from_secs(15) {
                    match s.read(&mut buf) {
                        Ok(0) => return (start.elapsed(), reply),
                        Ok(n) => reply.extend_from_slice(&buf[..n]),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            if s.write_all(b"X").is_err() {
                                return (start.elapsed(), reply);
                            }
                        }
                        Err(_) => return (start.elapsed(), reply),
                    }
                }
                (start.elapsed(), reply)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));

    // Meanwhile every scrape is answered at once.
    for i in 0..10 {
        let start = Instant::now();
        let (status, body) = http_get(&addr, "/metrics").unwrap();
        let took = start.elapsed();
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("kvtier_objects"), "{body}");
        assert!(
            took < Duration::from_millis(1500),
            "scrape {i} took {took:?} while clients dribbled"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    for a in attackers {
        let (held, reply) = a.join().unwrap();
        let reply = String::from_utf8_lossy(&reply);
        assert!(
            held >= Duration::from_secs(4) && held < Duration::from_secs(8),
            "a dribbling client was cut after {held:?} (deadline 5 s)"
        );
        assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    }
    let body = http_get(&addr, "/metrics").unwrap().1;
    assert_eq!(
        sample(
            &body,
            "kvtier_metrics_http_refused_total{reason=\"deadline\"}"
        ),
        Some(3.0),
        "{body}"
    );
}

#[test]
fn a_connection_flood_does_not_lock_out_scrapes_and_stays_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let serve = serve(dir.path(), &["--metrics-addr", &addr]);
    wait_status(&addr, "/healthz", 200, Duration::from_secs(20));
    let pid = serve.child.id();
    let before = threads_of(pid);

    // 300 connections that send nothing (5x the endpoint's bound).
    let idle: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let threads = threads_of(pid);
    assert!(
        threads <= before + 64 + 2,
        "{threads} threads with 300 idle connections (was {before}; bound 64 handlers)"
    );
    for _ in 0..5 {
        let start = Instant::now();
        let (status, _) = http_get(&addr, "/metrics").unwrap();
        assert_eq!(status, 200);
        assert!(start.elapsed() < Duration::from_millis(1500));
    }
    let body = http_get(&addr, "/metrics").unwrap().1;
    let shed = sample(&body, "kvtier_metrics_http_refused_total{reason=\"shed\"}").unwrap();
    assert!(shed >= 236.0, "shed {shed}: {body}");
    drop(idle);
    // The handlers go away with their connections.
    wait_for(Duration::from_secs(10), "handler threads to end", || {
        threads_of(pid) <= before + 2
    });
}

#[test]
fn a_bare_port_listens_on_loopback_and_nothing_listens_unless_asked() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port("127.0.0.1");
    let with = serve(dir.path(), &["--metrics-addr", &port.to_string()]);
    let addr = format!("127.0.0.1:{port}");
    wait_status(&addr, "/healthz", 200, Duration::from_secs(20));
    let listeners = tcp_listeners(with.child.id());
    assert_eq!(
        listeners,
        vec![format!("0100007F:{port:04X}")],
        "a bare port means 127.0.0.1 only"
    );
    drop(with);

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtier.sock");
    let mut without = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram-capacity",
            "16MiB",
            "--engine",
            "dram_prefault=false",
        ])
        .env_remove("KVTIER_SERVE_METRICS_ADDR")
        .env_remove("KVTIER_METRICS_ADDR")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(Duration::from_secs(20), "the socket", || socket.exists());
    let listeners = tcp_listeners(without.id());
    let _ = without.kill();
    let _ = without.wait();
    assert!(listeners.is_empty(), "unasked TCP listeners: {listeners:?}");
}

#[test]
fn readiness_follows_the_stores_and_the_master() {
    let dir = tempfile::tempdir().unwrap();
    // A standalone server: ready once its stores are open (the endpoint comes up first; a
    // 1 GiB pre-faulted arena keeps it "opening" for a while).
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let socket = dir.path().join("big.sock");
    let mut big = Proc::spawn(
        "kvtier serve (1 GiB)",
        &[
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram-capacity",
            "1GiB",
            "--metrics-addr",
            &addr,
        ],
        &[],
    );
    let mut seen = Vec::new();
    let start = Instant::now();
    loop {
        if let Some((status, body)) = http_get(&addr, "/readyz") {
            if seen.last().map(|(s, _)| *s) != Some(status) {
                seen.push((status, body));
            }
            if status == 200 {
                break;
            }
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{seen:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(
        seen.len() >= 2 && seen[0].0 == 503 && seen[0].1.contains("opening its stores"),
        "not ready while the arena maps, then ready: {seen:?}"
    );
    big.terminate(Duration::from_secs(10));

    // A cluster node: not ready before its master exists, ready once registered.
    let master_addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let master_metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let mut node = NodeOpts::new(dir.path(), &master_addr, "node-r", "127.0.0.2");
    let node_metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    node.metrics_addr = Some(node_metrics.clone());
    let _node = node.spawn();
    wait_for(Duration::from_secs(20), "not ready: not registered", || {
        http_get(&node_metrics, "/readyz")
            .is_some_and(|(s, b)| s == 503 && b.contains("cannot register with the master"))
    });
    assert_eq!(http_get(&node_metrics, "/healthz").unwrap().0, 200);
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(http_get(&node_metrics, "/readyz").unwrap().0, 503);

    let mut master = spawn_master(
        &master_addr,
        1000,
        &["--metrics-addr", &master_metrics, "--metrics-node-ids"],
    );
    wait_status(&master_metrics, "/readyz", 200, Duration::from_secs(20));
    wait_status(&node_metrics, "/readyz", 200, Duration::from_secs(20));
    // Asked for (--metrics-node-ids), the master labels its per-node gauges with ids.
    wait_for(
        Duration::from_secs(10),
        "node-r in the master's metrics",
        || {
            http_get(&master_metrics, "/metrics").is_some_and(|(_, b)| {
                b.contains("kvtier_master_node_capacity_bytes{node=\"node-r\"}")
            })
        },
    );

    // The master dies: the node turns not ready; it comes back: ready again.
    master.kill();
    let body = wait_status(&node_metrics, "/readyz", 503, Duration::from_secs(20));
    assert!(body.contains("heartbeat to the master failed"), "{body}");
    let _master = spawn_master(&master_addr, 1000, &[]);
    wait_status(&node_metrics, "/readyz", 200, Duration::from_secs(20));

    // Unknown paths and methods are refused by name; the token is not needed to scrape, and
    // no scrape reveals it.
    let (status, body) = http_get(&node_metrics, "/nope").unwrap();
    assert_eq!(status, 404, "{body}");
    let metrics = http_get(&node_metrics, "/metrics").unwrap().1;
    assert!(!metrics.contains(TOKEN));
}

/// A request head over 8 KiB is refused (431) without waiting for the deadline.
#[test]
fn an_oversized_request_head_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let _serve = serve(dir.path(), &["--metrics-addr", &addr]);
    wait_status(&addr, "/healthz", 200, Duration::from_secs(20));
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let start = Instant::now();
    let mut head = b"GET /metrics HTTP/1.1\r\nX-Pad: ".to_vec();
    head.resize(9000, b'a');
    let _ = s.write_all(&head);
    let mut reply = String::new();
    let _ = BufReader::new(&s).read_line(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 431"), "{reply:?}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

/// With etcd, the leader and its follower are both ready (the follower knows the leader); a
/// master whose etcd does not answer neither leads nor knows a leader, so it is not ready
/// while it answers /healthz.
#[test]
fn masters_are_ready_when_leading_or_following_a_known_leader() {
    let etcd = common::Etcd::start();
    let mut masters = Vec::new();
    let mut endpoints = Vec::new();
    for _ in 0..2 {
        let addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
        let metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
        masters.push(spawn_master(
            &addr,
            1000,
            &["--etcd", &etcd.endpoint, "--metrics-addr", &metrics],
        ));
        endpoints.push(metrics);
    }
    for metrics in &endpoints {
        wait_status(metrics, "/readyz", 200, Duration::from_secs(30));
    }
    let leaders: usize = endpoints
        .iter()
        .map(|m| {
            let body = http_get(m, "/metrics").unwrap().1;
            sample(&body, "kvtier_master_is_leader").unwrap_or(0.0) as usize
        })
        .sum();
    assert_eq!(leaders, 1, "one leader, one ready follower");

    let lonely = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let lonely_metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let dead_etcd = format!("http://127.0.0.1:{}", free_port("127.0.0.1"));
    let mut proc = spawn_master(
        &lonely,
        1000,
        &["--etcd", &dead_etcd, "--metrics-addr", &lonely_metrics],
    );
    wait_status(&lonely_metrics, "/healthz", 200, Duration::from_secs(20));
    for _ in 0..10 {
        if !proc.running() {
            break; // a master that gives up on etcd is not ready either
        }
        if let Some((status, body)) = http_get(&lonely_metrics, "/readyz") {
            assert_eq!(status, 503, "{body}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
