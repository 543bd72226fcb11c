//! Issue 27 §1, an operator's first day, against the real `kvtier` binary (and a real etcd):
//!
//! - `serve_never_deletes_what_is_not_a_stale_socket`: `--socket` naming a regular file or a
//!   directory is an error naming the path and the file is kept; a stale socket is replaced;
//!   a live server's socket is refused (and that server keeps serving); at exit a server
//!   removes only the socket it created.
//! - `configuration_is_checked_before_the_arena_is_prefaulted`: a missing `--data-addr` and a
//!   DRAM arena larger than the host's memory are reported at once, with a large arena.
//! - `corrupt_ssd_record_is_logged_and_stat_shows_the_ssd_tier`: a damaged SSD record's
//!   warning reaches `kvtier serve`'s stderr (text with timestamp and level, and JSON with
//!   `--log-format json`), `RUST_LOG=error` silences it, and `kvtier stat` shows the SSD tier
//!   (objects, recovered, corrupt) after the warm restart.
//! - `wrong_token_is_fatal_and_refused_connections_back_off`: a node whose token the master
//!   refuses exits 1 with one clear error; a node whose master refuses connections keeps
//!   serving, says "refused" and retries with back-off, not 3 lines a second.
//! - `sigterm_leader_resigns_after_a_scrape`: a leader master whose /metrics was scraped exits
//!   within seconds of SIGTERM and a follower leads at once (etcd lease revoked).
//! - `fsck_of_a_directory_without_segments_is_an_error`.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{free_port, leaders, metrics_text, wait_for, Etcd, TOKEN};
use kvtier_engine::{Engine, EngineConfig, PutMeta};

/// A `kvtier` child whose stderr lines are collected; SIGKILLed when dropped.
struct Kvtier {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
}

impl Kvtier {
    fn spawn(args: &[&str], envs: &[(&str, &str)]) -> Kvtier {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier"));
        cmd.args(args)
            .env_remove("RUST_LOG")
            .env_remove("KVTIER_LOG_FORMAT")
            .env_remove("KVTIER_CLUSTER_TOKEN")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = Arc::clone(&stderr);
        let pipe = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                eprintln!("child: {line}");
                lines.lock().unwrap().push(line);
            }
        });
        Kvtier { child, stderr }
    }

    fn text(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    fn lines_with(&self, needle: &str) -> usize {
        self.stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .count()
    }

    fn wait_line(&self, needle: &str, limit: Duration) {
        wait_for(limit, needle, || self.lines_with(needle) > 0);
    }

    /// The exit status within `limit`, or None (still running).
    fn exit_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the reader thread take the last lines.
                std::thread::sleep(Duration::from_millis(100));
                return Some(status);
            }
            if start.elapsed() >= limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn sigterm(&self) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success());
    }
}

impl Drop for Kvtier {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kvtier serve` flags for a small DRAM-only server on `socket`.
fn small_serve(socket: &str) -> Vec<String> {
    [
        "serve",
        "--socket",
        socket,
        "--dram-capacity",
        "1MiB",
        "--engine",
        "dram_prefault=false",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run_serve(args: &[String], envs: &[(&str, &str)]) -> Kvtier {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Kvtier::spawn(&args, envs)
}

#[test]
fn serve_never_deletes_what_is_not_a_stale_socket() {
    let dir = tempfile::tempdir().unwrap();

    // A regular file (the typo `--socket /etc/kvtier.toml`): kept, the error names it.
    let file = dir.path().join("kvtier.toml");
    std::fs::write(&file, "precious = true\n").unwrap();
    let path = file.to_str().unwrap();
    let mut serve = run_serve(&small_serve(path), &[]);
    let status = serve
        .exit_within(Duration::from_secs(20))
        .expect("serve exits");
    assert!(!status.success(), "{status:?}");
    let err = serve.text();
    assert!(err.contains(path) && err.contains("regular file"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "precious = true\n");

    // A directory: kept too.
    let sub = dir.path().join("a-directory");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("inside"), "x").unwrap();
    let mut serve = run_serve(&small_serve(sub.to_str().unwrap()), &[]);
    let status = serve
        .exit_within(Duration::from_secs(20))
        .expect("serve exits");
    assert!(!status.success());
    assert!(
        serve.text().contains(sub.to_str().unwrap()),
        "{}",
        serve.text()
    );
    assert!(sub.join("inside").exists());

    // A stale socket (its server is gone: connecting is refused) is replaced.
    let socket = dir.path().join("kvtier.sock");
    let socket_str = socket.to_str().unwrap().to_string();
    drop(UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let mut live = run_serve(&small_serve(&socket_str), &[]);
    live.wait_line("listening on", Duration::from_secs(20));
    assert!(UnixStream::connect(&socket).is_ok());

    // A live server's socket is refused, and that server keeps serving.
    let mut second = run_serve(&small_serve(&socket_str), &[]);
    let status = second
        .exit_within(Duration::from_secs(20))
        .expect("second serve exits");
    assert!(!status.success());
    let err = second.text();
    assert!(err.contains(&socket_str) && err.contains("in use"), "{err}");
    assert!(
        UnixStream::connect(&socket).is_ok(),
        "the first server stopped serving"
    );

    // At exit the server removes only its own socket: here someone put a file in its place.
    std::fs::remove_file(&socket).unwrap();
    std::fs::write(&socket, "not yours").unwrap();
    live.sigterm();
    let status = live.exit_within(Duration::from_secs(20)).expect("stops");
    assert!(status.success(), "{status:?} {}", live.text());
    assert_eq!(std::fs::read_to_string(&socket).unwrap(), "not yours");

    // And a clean run removes the socket it created.
    std::fs::remove_file(&socket).unwrap();
    let mut clean = run_serve(&small_serve(&socket_str), &[]);
    clean.wait_line("listening on", Duration::from_secs(20));
    clean.sigterm();
    assert!(clean
        .exit_within(Duration::from_secs(20))
        .unwrap()
        .success());
    assert!(!socket.exists());
}

fn mem_total() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .unwrap()
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kib << 10
}

#[test]
fn configuration_is_checked_before_the_arena_is_prefaulted() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    // Half of the host's memory, pre-faulted: seconds of work if it came first.
    let large = format!("{}", (mem_total() / 2) & !((1 << 20) - 1));
    let mut serve = Kvtier::spawn(
        &[
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram-capacity",
            &large,
            "--master",
            "127.0.0.1:7700",
        ],
        &[("KVTIER_CLUSTER_TOKEN", TOKEN)],
    );
    let start = Instant::now();
    let status = serve
        .exit_within(Duration::from_secs(30))
        .expect("serve exits");
    let took = start.elapsed();
    assert_eq!(status.code(), Some(2), "{}", serve.text());
    assert!(serve.text().contains("--data-addr"), "{}", serve.text());
    assert!(took < Duration::from_secs(2), "reported after {took:?}");
    assert!(!socket.exists());

    // An arena larger than the host's memory: the error names both sizes.
    let huge = format!("{}", mem_total() * 2);
    let mut serve = Kvtier::spawn(
        &[
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram-capacity",
            &huge,
        ],
        &[],
    );
    let start = Instant::now();
    let status = serve.exit_within(Duration::from_secs(30)).unwrap();
    assert_eq!(status.code(), Some(2), "{}", serve.text());
    let err = serve.text();
    assert!(
        err.contains("dram_capacity_bytes") && err.contains("exceeds physical memory"),
        "{err}"
    );
    assert!(err.contains("GiB"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

/// An SSD directory of 10 objects whose second record's payload has a flipped byte and no
/// index checkpoint (so the next open scans the segment and finds it).
fn damaged_ssd_dir(dir: &Path) {
    let cfg = EngineConfig {
        dram_capacity_bytes: 1 << 20,
        ssd_enabled: true,
        ssd_storage_dir: dir.to_path_buf(),
        ssd_segment_size_bytes: 1 << 20,
        ssd_capacity_bytes: 4 << 20,
        ..EngineConfig::default()
    };
    let e = Engine::open(cfg).unwrap();
    for i in 0..10 {
        e.put(
            format!("k{i}").as_bytes(),
            &vec![i as u8; 10_000],
            PutMeta::default(),
        )
        .unwrap();
    }
    e.close().unwrap();
    let seg = dir.join("seg-000000.kvt");
    let mut data = std::fs::read(&seg).unwrap();
    data[4096 * 4 + 100] ^= 1;
    std::fs::write(&seg, &data).unwrap();
    std::fs::remove_file(dir.join("index.ckpt")).unwrap();
}

fn ssd_serve(socket: &Path, ssd: &Path) -> Vec<String> {
    let mut args = small_serve(socket.to_str().unwrap());
    for flag in [
        "ssd_enabled=true".to_string(),
        format!("ssd_storage_dir={}", ssd.display()),
        "ssd_segment_size_bytes=1048576".to_string(),
        "ssd_capacity_bytes=4194304".to_string(),
    ] {
        args.push("--engine".into());
        args.push(flag);
    }
    args
}

const DAMAGED: &str = "dropped damaged SSD records";

#[test]
fn corrupt_ssd_record_is_logged_and_stat_shows_the_ssd_tier() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");

    // Text: timestamp, level, the warning and its fields, on stderr.
    let ssd = dir.path().join("ssd-text");
    damaged_ssd_dir(&ssd);
    let mut serve = run_serve(&ssd_serve(&socket, &ssd), &[]);
    serve.wait_line("listening on", Duration::from_secs(20));
    let line = serve
        .stderr
        .lock()
        .unwrap()
        .iter()
        .find(|l| l.contains(DAMAGED))
        .cloned()
        .unwrap_or_else(|| panic!("no warning on stderr:\n{}", serve.text()));
    assert!(
        line.contains("WARN") && line.contains("corrupt=1"),
        "{line}"
    );
    assert!(line.starts_with("20"), "no timestamp: {line}");
    // The startup summary names the mode, the capacities and the paths.
    let summary = serve.text();
    assert!(
        summary.contains("mode local")
            && summary.contains("DRAM 1 MiB")
            && summary.contains(&format!("SSD 4 MiB in {}", ssd.display())),
        "{summary}"
    );

    // `kvtier stat`: the warm restart's objects are on SSD, not "0 objects".
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["stat", "--socket", socket.to_str().unwrap()])
        .output()
        .unwrap();
    let stat = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{out:?}");
    assert!(
        stat.contains("SSD 9 objects") && stat.contains("recovered 9 objects (0 torn, 1 corrupt"),
        "{stat}"
    );
    serve.sigterm();
    assert!(serve
        .exit_within(Duration::from_secs(20))
        .unwrap()
        .success());

    // JSON lines with --log-format json.
    let ssd = dir.path().join("ssd-json");
    damaged_ssd_dir(&ssd);
    let mut args = ssd_serve(&socket, &ssd);
    args.insert(0, "--log-format=json".into());
    let mut serve = run_serve(&args, &[]);
    serve.wait_line("listening on", Duration::from_secs(20));
    let line = serve
        .stderr
        .lock()
        .unwrap()
        .iter()
        .find(|l| l.contains(DAMAGED))
        .cloned()
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["level"], "WARN", "{line}");
    assert_eq!(v["fields"]["corrupt"], 1, "{line}");
    assert!(v["timestamp"].is_string());
    serve.sigterm();
    assert!(serve
        .exit_within(Duration::from_secs(20))
        .unwrap()
        .success());

    // RUST_LOG=error: the warning is filtered out (and the info summary too).
    let ssd = dir.path().join("ssd-quiet");
    damaged_ssd_dir(&ssd);
    let mut serve = run_serve(&ssd_serve(&socket, &ssd), &[("RUST_LOG", "error")]);
    wait_for(Duration::from_secs(20), "the quiet server's socket", || {
        UnixStream::connect(&socket).is_ok()
    });
    serve.sigterm();
    assert!(serve
        .exit_within(Duration::from_secs(20))
        .unwrap()
        .success());
    assert_eq!(serve.lines_with(DAMAGED), 0, "{}", serve.text());
    assert_eq!(serve.lines_with("listening on"), 0, "{}", serve.text());

    // An invalid RUST_LOG is an error naming it, not silence.
    let mut serve = run_serve(
        &small_serve(socket.to_str().unwrap()),
        &[("RUST_LOG", "=[")],
    );
    let status = serve.exit_within(Duration::from_secs(10)).unwrap();
    assert_eq!(status.code(), Some(2));
    assert!(serve.text().contains("RUST_LOG"), "{}", serve.text());
}

fn node_args(socket: &Path, master: &str, data: &str) -> Vec<String> {
    let mut args = small_serve(socket.to_str().unwrap());
    args.extend(
        ["--master", master, "--data-addr", data, "--node-id", "n1"]
            .iter()
            .map(|s| s.to_string()),
    );
    args.extend(["--engine".into(), "cluster_transport=tcp".into()]);
    args
}

#[test]
fn wrong_token_is_fatal_and_refused_connections_back_off() {
    let dir = tempfile::tempdir().unwrap();
    let (master, _master) = common::start_master(1000, &[]);
    wait_for(Duration::from_secs(15), "the master answers", || {
        common::cluster_of(&master).is_some()
    });

    // A token the master refuses: one clear error, exit 1, within seconds.
    let data = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let mut node = run_serve(
        &node_args(&dir.path().join("a.sock"), &master, &data),
        &[("KVTIER_CLUSTER_TOKEN", "not-the-cluster-token")],
    );
    let status = node
        .exit_within(Duration::from_secs(15))
        .unwrap_or_else(|| panic!("still running with a refused token:\n{}", node.text()));
    assert_eq!(status.code(), Some(1), "{}", node.text());
    let err = node.text();
    assert!(
        err.contains("refused this node's cluster token") && err.contains("Unauthenticated"),
        "{err}"
    );
    assert!(node.lines_with("cannot register") == 0, "{err}");

    // A master address nobody listens on: the node serves its socket, says the connection
    // was refused, and backs off (300 ms doubling: about 5 attempts in 5 s, not 16).
    let nobody = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let socket = dir.path().join("b.sock");
    let data = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let node = run_serve(
        &node_args(&socket, &nobody, &data),
        &[("KVTIER_CLUSTER_TOKEN", TOKEN)],
    );
    node.wait_line("cannot register", Duration::from_secs(20));
    let first = Instant::now();
    std::thread::sleep(Duration::from_secs(5));
    let attempts = node.lines_with("cannot register");
    assert!(
        (2..=6).contains(&attempts),
        "{attempts} attempts in {:?}:\n{}",
        first.elapsed(),
        node.text()
    );
    assert!(
        node.text().to_lowercase().contains("connection refused"),
        "{}",
        node.text()
    );
    assert!(
        UnixStream::connect(&socket).is_ok(),
        "the node stopped serving"
    );
    node.sigterm();
    let mut node = node;
    let status = node.exit_within(Duration::from_secs(20)).unwrap();
    assert!(status.success(), "{status:?}");
}

#[test]
fn sigterm_leader_resigns_after_a_scrape() {
    let etcd = Etcd::start();
    let masters: Vec<String> = (0..2)
        .map(|_| format!("127.0.0.1:{}", free_port("127.0.0.1")))
        .collect();
    let metrics: Vec<String> = (0..2)
        .map(|_| format!("127.0.0.1:{}", free_port("127.0.0.1")))
        .collect();
    let mut procs: Vec<Kvtier> = (0..2)
        .map(|i| {
            Kvtier::spawn(
                &[
                    "master",
                    "--listen",
                    &masters[i],
                    "--etcd",
                    &etcd.endpoint,
                    "--election-ttl-s",
                    "2",
                    "--metrics-addr",
                    &metrics[i],
                ],
                &[("KVTIER_CLUSTER_TOKEN", TOKEN)],
            )
        })
        .collect();
    let mut leader = Vec::new();
    wait_for(Duration::from_secs(15), "one master elected", || {
        leader = leaders(&masters);
        leader.len() == 1
    });
    let old = leader[0];
    let follower = 1 - old;
    // Scrape the leader (its collector opens an RPC connection to itself) and the follower.
    for m in &metrics {
        let text = metrics_text(m).expect("scrape");
        assert!(text.contains("kvtier_master_is_leader"), "{text}");
    }
    let stopped = Instant::now();
    procs[old].sigterm();
    let status = procs[old]
        .exit_within(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the leader did not exit:\n{}", procs[old].text()));
    let exited = stopped.elapsed();
    assert!(status.success(), "{status:?}");
    assert!(exited < Duration::from_secs(4), "exited after {exited:?}");
    assert!(
        procs[old].text().contains("resigned leadership"),
        "{}",
        procs[old].text()
    );
    wait_for(Duration::from_secs(3), "the follower leads", || {
        leaders(&masters) == vec![follower]
    });
    let took_over = stopped.elapsed();
    eprintln!("test: leader exited {exited:?} after SIGTERM; follower led {took_over:?} after");
    // Well inside the 2 s election TTL after the exit: the key went with the revoked lease.
    assert!(
        took_over < exited + Duration::from_millis(1500),
        "{took_over:?}"
    );
    procs[follower].sigterm();
    assert!(procs[follower]
        .exit_within(Duration::from_secs(10))
        .unwrap()
        .success());
}

#[test]
fn fsck_of_a_directory_without_segments_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["fsck", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no segment files") && err.contains(dir.path().to_str().unwrap()),
        "{err}"
    );
    // The store directory one level down is named.
    damaged_ssd_dir(&dir.path().join("main"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["fsck", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("main"),
        "{out:?}"
    );
}
