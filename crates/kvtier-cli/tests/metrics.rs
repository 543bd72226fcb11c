//! `kvtier serve --metrics-addr`: a real server process on a free port, real clients over its
//! socket, and `/metrics` scraped over HTTP after every step, checking that each counter moved
//! by exactly what the step did. Also: a port in use and a bad address are clear errors.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kvtier_client::config::ConfigSources;
use kvtier_client::{Client, KvtierConfig};
use serde_json::{json, Map, Value};

/// A `kvtier serve` child, stopped with SIGTERM on drop.
struct Serve {
    child: Child,
    metrics: String,
    _dir: tempfile::TempDir,
    socket: String,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

fn serve(extra: &[&str]) -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtier.sock").display().to_string();
    let mut child = kvtier()
        .args([
            "serve",
            "--socket",
            &socket,
            "--dram-capacity",
            "16MiB",
            "--engine",
            "dram_prefault=false",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args(extra)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    // The start-up log may say other things first (the descriptor caps, a fallback notice).
    let first = lines
        .by_ref()
        .take(50)
        .map_while(Result::ok)
        .find(|line| line.contains("listening on"))
        .expect("kvtier serve never said it was listening");
    // Keep draining stderr so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let metrics = first
        .split("metrics on http://")
        .nth(1)
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics address in the startup line: {first}"))
        .to_string();
    assert!(
        !metrics.ends_with(":0"),
        "the bound port is reported: {first}"
    );
    Serve {
        child,
        metrics,
        _dir: dir,
        socket,
    }
}

fn http_get(addr: &str, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// `name{k="v",...}` (labels sorted) -> value.
fn scrape(addr: &str) -> BTreeMap<String, f64> {
    let (status, body) = http_get(addr, "/metrics");
    assert!(status.contains("200"), "{status}");
    let mut out = BTreeMap::new();
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let key = match series.split_once('{') {
            None => series.to_string(),
            Some((name, labels)) => {
                let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                labels.sort_unstable();
                format!("{name}{{{}}}", labels.join(","))
            }
        };
        out.insert(key, value.parse().unwrap());
    }
    out
}

fn get(m: &BTreeMap<String, f64>, key: &str) -> f64 {
    *m.get(key).unwrap_or_else(|| {
        let near: Vec<_> = m.keys().filter(|k| k.starts_with(&key[..8])).collect();
        panic!("{key} not scraped; have {near:?}")
    })
}

/// What moved between two scrapes.
fn delta(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, key: &str) -> f64 {
    get(after, key) - before.get(key).copied().unwrap_or(0.0)
}

fn client(socket: &str, tag: Option<&str>) -> Client {
    let mut extra = Map::new();
    extra.insert("server_socket".into(), json!(socket));
    if let Some(tag) = tag {
        extra.insert("extra_backend_tag".into(), json!(tag));
    }
    let config = KvtierConfig::load(ConfigSources {
        env: Vec::new(),
        extra,
    })
    .unwrap();
    Client::open(config).unwrap()
}

#[test]
fn serve_metrics_count_what_clients_do() {
    let server = serve(&["--tenant-quota", "team=4MiB"]);
    let addr = server.metrics.clone();
    let (status, _) = http_get(&addr, "/other");
    assert!(status.contains("404"), "{status}");

    let c = client(&server.socket, None);
    let m0 = scrape(&addr);
    assert_eq!(get(&m0, "kvtier_server_sessions"), 1.0);
    assert_eq!(
        get(&m0, r#"kvtier_capacity_bytes{store="main",tier="dram"}"#),
        16.0 * 1024.0 * 1024.0
    );

    // Three new side-pool objects, one put of a key already there.
    let keys: Vec<String> = (0..3)
        .map(|i| format!("h{i}@0123456789ab.tp0.swa.k"))
        .collect();
    for (i, k) in keys.iter().enumerate() {
        c.put_slice(k.as_bytes(), &vec![i as u8; 10_000], None)
            .unwrap();
    }
    c.put_slice(keys[0].as_bytes(), &[0u8; 10_000], None)
        .unwrap();
    let m1 = scrape(&addr);
    let main = |name: &str| format!(r#"{name}{{store="main"}}"#);
    let dram = |name: &str| format!(r#"{name}{{store="main",tier="dram"}}"#);
    assert_eq!(delta(&m0, &m1, &main("kvtier_puts_total")), 3.0);
    assert_eq!(delta(&m0, &m1, &main("kvtier_dedup_skips_total")), 1.0);
    assert_eq!(delta(&m0, &m1, &main("kvtier_bytes_in_total")), 30_000.0);
    assert_eq!(get(&m1, &dram("kvtier_objects")), 3.0);
    assert_eq!(get(&m1, &dram("kvtier_stored_bytes")), 30_000.0);
    assert_eq!(
        delta(
            &m0,
            &m1,
            r#"kvtier_tenant_pages_total{op="put",tenant="default"}"#
        ),
        4.0
    );
    assert_eq!(
        delta(
            &m0,
            &m1,
            r#"kvtier_tenant_bytes_total{direction="in",tenant="default"}"#
        ),
        40_000.0
    );
    assert_eq!(
        delta(
            &m0,
            &m1,
            r#"kvtier_request_duration_seconds_count{op="put"}"#
        ),
        4.0
    );

    // Two hits and one miss, counted for the engine and for the pool the keys name.
    let mut buf = vec![0u8; 10_000];
    c.get_into_slice(keys[1].as_bytes(), &mut buf).unwrap();
    assert_eq!(buf, vec![1u8; 10_000]);
    c.get_into_slice(keys[2].as_bytes(), &mut buf).unwrap();
    assert!(c
        .get_into_slice(b"h9@0123456789ab.tp0.swa.k", &mut buf)
        .is_err());
    let m2 = scrape(&addr);
    assert_eq!(delta(&m1, &m2, &dram("kvtier_hits_total")), 2.0);
    assert_eq!(delta(&m1, &m2, &main("kvtier_misses_total")), 1.0);
    assert_eq!(delta(&m1, &m2, &main("kvtier_bytes_out_total")), 20_000.0);
    assert_eq!(
        delta(&m1, &m2, r#"kvtier_pool_hits_total{op="get",pool="swa"}"#),
        2.0
    );
    assert_eq!(
        delta(&m1, &m2, r#"kvtier_pool_misses_total{op="get",pool="swa"}"#),
        1.0
    );
    assert_eq!(
        delta(
            &m1,
            &m2,
            r#"kvtier_tenant_bytes_total{direction="out",tenant="default"}"#
        ),
        20_000.0
    );
    assert_eq!(
        delta(
            &m1,
            &m2,
            r#"kvtier_request_duration_seconds_count{op="get"}"#
        ),
        3.0
    );
    // Histogram buckets are cumulative and end in +Inf == count.
    assert_eq!(
        get(
            &m2,
            r#"kvtier_request_duration_seconds_bucket{le="+Inf",op="get"}"#
        ),
        get(&m2, r#"kvtier_request_duration_seconds_count{op="get"}"#)
    );

    // A remove is an eviction with reason "removed"; capacity evictions did not move.
    assert_eq!(c.remove_keys(&[keys[0].as_bytes()]), 1);
    let m3 = scrape(&addr);
    let reason =
        |r: &str| format!(r#"kvtier_evictions_total{{reason="{r}",store="main",tier="dram"}}"#);
    assert_eq!(delta(&m2, &m3, &reason("removed")), 1.0);
    assert_eq!(delta(&m2, &m3, &reason("capacity")), 0.0);
    assert_eq!(get(&m3, &dram("kvtier_objects")), 2.0);

    // A tenant with its own partition is its own store.
    let t = client(&server.socket, Some("team"));
    t.put_slice(b"x@0123456789ab.kv", &[5u8; 4096], None)
        .unwrap();
    let m4 = scrape(&addr);
    assert_eq!(
        get(&m4, r#"kvtier_objects{store="tenant:team",tier="dram"}"#),
        1.0
    );
    assert_eq!(get(&m4, &dram("kvtier_objects")), 2.0);
    assert_eq!(
        delta(
            &m3,
            &m4,
            r#"kvtier_tenant_pages_total{op="put",tenant="team"}"#
        ),
        1.0
    );
    assert_eq!(get(&m4, "kvtier_server_sessions"), 2.0);
    assert!(get(&m4, "kvtier_server_requests_total") > get(&m0, "kvtier_server_requests_total"));

    // The same port again: the second server refuses to start, naming the address.
    let out = kvtier()
        .args([
            "serve",
            "--socket",
            &format!("{}.2", server.socket),
            "--engine",
            "dram_prefault=false",
            "--dram-capacity",
            "4MiB",
            "--metrics-addr",
            &addr,
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&addr) && err.contains("cannot listen"),
        "{err}"
    );
}

#[test]
fn bad_metrics_addr_is_a_config_error_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock").display().to_string();
    // "9100" alone is valid now: a bare port means 127.0.0.1 (issue 26).
    for bad in ["99999", "127.0.0.1:70000", "nowhere.invalid:9100"] {
        let out = kvtier()
            .args(["serve", "--socket", &socket, "--metrics-addr", bad])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(
            err.contains("`metrics_addr`") && err.contains("command line"),
            "{err}"
        );
    }
    let out = kvtier()
        .args(["serve", "--socket", &socket])
        .env("KVTIER_SERVE_METRICS_ADDR", "localhost")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("KVTIER_SERVE_METRICS_ADDR"), "{err}");
}

#[test]
fn stat_json_reads_a_running_server() {
    let server = serve(&[]);
    let out = kvtier()
        .args(["stat", "--socket", &server.socket, "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["server"]["socket"], json!(server.socket));
    assert_eq!(v["stores"]["main"]["capacity_bytes"], json!(16 << 20));
}
