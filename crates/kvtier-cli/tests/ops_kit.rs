//! The operator kit (issue 27 §3) against real processes:
//! - a real Prometheus (Debian's `prometheus`) scrapes a live `kvtier serve` (SSD tier on), a
//!   `kvtier master` with two nodes and a cluster client's own endpoint, with the alert rules
//!   of ops/prometheus/kvtier-alerts.yml loaded; while clients put and get, every query of the
//!   Grafana dashboard (ops/grafana/kvtier.json) returns data, every rule evaluates without
//!   error, and the rules an operator must hear trip when a stranger knocks on a data port
//!   and on the master (refused handshakes / RPCs) and when a node dies (node lost);
//!   `promtool check rules` passes;
//! - the systemd units (ops/systemd/) pass `systemd-analyze verify`, keep the hardening they
//!   promise and no secret on the command line, and their command lines start the real binary.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{free_port, start_master, wait_alive, wait_for, NodeOpts, Pool, Proc, TOKEN};
use kvtier_client::config::ConfigSources;
use kvtier_client::{Client, KvtierConfig};
use serde_json::{json, Map, Value};

const PROMETHEUS: &str = "/usr/bin/prometheus";
const PROMTOOL: &str = "/usr/bin/promtool";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Percent-encode a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `GET path` (HTTP/1.0: no chunking) at `addr`: status and body.
fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// Prometheus's answer to an instant query.
fn query(prom: &str, expr: &str) -> Value {
    let (status, body) = get(prom, &format!("/api/v1/query?query={}", encode(expr)))
        .unwrap_or_else(|| panic!("no answer from Prometheus for {expr}"));
    let doc: Value = serde_json::from_str(&body).unwrap_or(json!({ "raw": body }));
    assert_eq!(status, 200, "{expr}: {doc}");
    doc
}

/// Every PromQL expression of the dashboard, with Grafana's `$__rate_interval` made concrete.
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo().join("ops/grafana/kvtier.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    for panel in doc["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            out.push((
                format!("{} / {}", panel["title"], target["refId"]),
                expr.replace("$__rate_interval", "20s"),
            ));
        }
    }
    out
}

fn client_with(extra: Map<String, Value>) -> Client {
    Client::open(
        KvtierConfig::load(ConfigSources {
            env: Vec::new(),
            extra,
        })
        .unwrap(),
    )
    .unwrap()
}

#[test]
fn prometheus_scrapes_the_dashboard_and_evaluates_the_rules() {
    for tool in [PROMETHEUS, PROMTOOL] {
        assert!(
            Path::new(tool).exists(),
            "{tool} is missing: scripts/setup.sh installs Debian's prometheus package"
        );
    }
    let rules = repo().join("ops/prometheus/kvtier-alerts.yml");
    let check = Command::new(PROMTOOL)
        .args(["check", "rules"])
        .arg(&rules)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "promtool check rules: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let dir = tempfile::tempdir().unwrap();

    // A single-host kvtier serve with an SSD tier and a small DRAM arena (so it evicts).
    let serve_metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let socket = dir.path().join("serve.sock");
    let ssd = dir.path().join("serve-ssd");
    let ssd_flag = format!("ssd_storage_dir={}", ssd.display());
    let _serve = Proc::spawn(
        "kvtier serve",
        &[
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram-capacity",
            "4MiB",
            "--engine",
            "dram_prefault=false",
            "--engine",
            "ssd_enabled=true",
            "--engine",
            &ssd_flag,
            "--engine",
            "ssd_capacity_bytes=64MiB",
            "--engine",
            "ssd_segment_size_bytes=4MiB",
            "--metrics-addr",
            &serve_metrics,
        ],
        &[],
    );
    // A master and two nodes, each with its endpoint.
    let master_metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let (master_addr, _master) = start_master(1000, &["--metrics-addr", &master_metrics]);
    let mut opts = Vec::new();
    let mut nodes = Vec::new();
    for (id, ip) in common::TWO_NODES {
        let mut o = NodeOpts::new(dir.path(), &master_addr, id, ip);
        o.metrics_addr = Some(format!("127.0.0.1:{}", free_port("127.0.0.1")));
        nodes.push(o.spawn());
        opts.push(o);
    }
    // The cluster client publishes its own metrics (peer transports) from this process.
    let mut config = common::cluster_config(&master_addr, None);
    config.metrics_addr = Some("127.0.0.1:0".into());
    let cluster = Arc::new(Client::open(config).unwrap());
    let client_metrics = cluster.metrics_addr().unwrap().to_string();
    wait_alive(&cluster, 2);
    wait_for(Duration::from_secs(20), "kvtier serve", || {
        get(&serve_metrics, "/readyz").is_some_and(|(s, _)| s == 200)
    });
    let local = Arc::new(client_with(
        [("server_socket".to_string(), json!(socket.to_str().unwrap()))]
            .into_iter()
            .collect(),
    ));

    // Clients keep working while Prometheus watches: puts (more than DRAM holds, so the
    // server evicts to SSD), hits and misses, through kvtier serve and through the cluster.
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (stop, local, cluster) = (Arc::clone(&stop), Arc::clone(&local), Arc::clone(&cluster));
        std::thread::spawn(move || {
            let value = vec![7u8; 64 << 10];
            let mut buf = vec![0u8; 64 << 10];
            let mut pool = Pool::new(4, 64 << 10);
            pool.fill(1);
            let _registered = pool.register(&cluster);
            let mut round = 0u64;
            let start = Instant::now();
            while !stop.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(120) {
                let key = format!("h{}@0123456789ab.tp0.k", round % 200);
                let _ = local.put_slice(key.as_bytes(), &value, None);
                let _ = local.get_into_slice(key.as_bytes(), &mut buf);
                let _ = local.get_into_slice(b"never@0123456789ab.tp0.k", &mut buf);
                let keys: Vec<String> = (0..4)
                    .map(|i| format!("c{}@0123456789ab.tp0.v", (round * 4 + i) % 64))
                    .collect();
                let _ = cluster.put_keys(&keys, &pool.refs(), None);
                let _ = cluster.get_keys(&keys, &pool.refs());
                round += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };

    // Strangers: a data-port connection that sends no hello, an RPC with the wrong token.
    // Once now (the counters appear) and once after Prometheus has scraped them (an
    // increase it can see).
    let knock = |data: &str| {
        let mut s = TcpStream::connect(data).unwrap();
        let mut frame = Vec::new();
        kvtier_proto::encode_frame(
            &mut frame,
            kvtier_proto::Opcode::Ping,
            1,
            0,
            &kvtier_client::remote::EmptyBody,
        )
        .unwrap();
        s.write_all(&frame).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.read(&mut [0u8; 256]);
        let mut wrong = common::cluster_config(&master_addr, None);
        wrong.cluster_token = Some("not-the-token".into());
        wrong.cluster_master_retry_ms = 200;
        assert!(
            Client::open(wrong).is_err(),
            "a client with the wrong token is refused by the master"
        );
    };
    knock(&opts[0].data);

    // Prometheus: scrape every second, evaluate the rules every second.
    let prom = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {rules}\n\
         scrape_configs:\n\
         \x20 - job_name: kvtier-serve\n    static_configs:\n      - targets: ['{serve_metrics}']\n\
         \x20 - job_name: kvtier-master\n    static_configs:\n      - targets: ['{master_metrics}']\n\
         \x20 - job_name: kvtier-node\n    static_configs:\n      - targets: ['{a}', '{b}']\n\
         \x20 - job_name: kvtier-client\n    static_configs:\n      - targets: ['{client_metrics}']\n",
        rules = rules.canonicalize().unwrap().display(),
        a = opts[0].metrics_addr.as_deref().unwrap(),
        b = opts[1].metrics_addr.as_deref().unwrap(),
    );
    let config_path = dir.path().join("prometheus.yml");
    std::fs::write(&config_path, config).unwrap();
    let _prometheus = Proc::spawn_program(
        PROMETHEUS,
        "prometheus",
        &[
            &format!("--config.file={}", config_path.display()),
            &format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()),
            &format!("--web.listen-address={prom}"),
            "--log.level=warn",
        ],
        &[],
    );
    wait_for(Duration::from_secs(30), "Prometheus ready", || {
        get(&prom, "/-/ready").is_some_and(|(s, _)| s == 200)
    });
    wait_for(Duration::from_secs(20), "every target up", || {
        let r = query(&prom, "sum(up)");
        r["data"]["result"][0]["value"][1] == "5"
    });

    // Every dashboard query returns data (rates need a few scrapes: retry for a while).
    let queries = dashboard_queries();
    assert!(queries.len() >= 25, "{} queries", queries.len());
    let start = Instant::now();
    let mut empty: BTreeSet<String> = queries.iter().map(|(name, _)| name.clone()).collect();
    while !empty.is_empty() && start.elapsed() < Duration::from_secs(40) {
        for (name, expr) in &queries {
            if !empty.contains(name) {
                continue;
            }
            let doc = query(&prom, expr);
            assert_eq!(doc["status"], "success", "{name}: {expr}: {doc}");
            let has_data = doc["data"]["result"]
                .as_array()
                .is_some_and(|r| !r.is_empty());
            if has_data {
                empty.remove(name);
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let missing: Vec<_> = queries
        .iter()
        .filter(|(name, _)| empty.contains(name))
        .collect();
    assert!(
        missing.is_empty(),
        "dashboard queries with no data: {missing:#?}"
    );

    // Strangers knock again; a node dies: the node-lost rule's expression holds (pending
    // for its `for`), the refusal rules fire.
    knock(&opts[0].data);
    nodes.remove(1).kill();
    stop.store(true, Ordering::SeqCst);
    traffic.join().unwrap();
    let alerts = |prom: &str| -> Vec<(String, String)> {
        let (_, body) = get(prom, "/api/v1/alerts").unwrap();
        let doc: Value = serde_json::from_str(&body).unwrap();
        doc["data"]["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                (
                    a["labels"]["alertname"].as_str().unwrap().to_string(),
                    a["state"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    wait_for(
        Duration::from_secs(30),
        "the alerts an operator must hear",
        || {
            let active: BTreeSet<String> = alerts(&prom).into_iter().map(|(n, _)| n).collect();
            [
                "KvtierNodeLost",
                "KvtierDataPortRefusedHandshakes",
                "KvtierMasterRefusedRpcs",
            ]
            .iter()
            .all(|a| active.contains(*a))
        },
    );
    let active = alerts(&prom);
    for quiet in [
        "KvtierMasterWithoutLeader",
        "KvtierSsdDegraded",
        "KvtierSsdCorruptRecords",
    ] {
        assert!(
            !active.iter().any(|(n, _)| n == quiet),
            "{quiet} is active in a healthy cluster: {active:?}"
        );
    }

    // Every rule evaluated, without error.
    let (_, body) = get(&prom, "/api/v1/rules").unwrap();
    let doc: Value = serde_json::from_str(&body).unwrap();
    let rules: Vec<&Value> = doc["data"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap())
        .collect();
    assert!(rules.len() >= 15, "{} rules loaded", rules.len());
    for rule in rules {
        assert_eq!(rule["health"], "ok", "{rule}");
        assert!(
            rule["lastError"].as_str().unwrap_or("").is_empty(),
            "{rule}"
        );
        assert!(
            !rule["lastEvaluation"]
                .as_str()
                .unwrap_or("0001")
                .starts_with("0001"),
            "never evaluated: {rule}"
        );
    }
}

/// `Key=value` lines of a unit's section-less view (comments dropped).
fn unit_lines(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

#[test]
fn systemd_units_verify_and_start_the_real_binary() {
    let Ok(version) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!(
            "SKIP systemd_units_verify: systemd-analyze is not installed here (Debian: the \
             systemd package)"
        );
        return;
    };
    assert!(version.status.success());
    let bin = env!("CARGO_BIN_EXE_kvtier");
    let dir = tempfile::tempdir().unwrap();
    for unit in ["kvtier-serve.service", "kvtier-master.service"] {
        let text = std::fs::read_to_string(repo().join("ops/systemd").join(unit)).unwrap();
        let lines = unit_lines(&text);
        let has = |k: &str, v: &str| lines.iter().any(|(a, b)| a == k && b == v);
        for (k, v) in [
            ("NoNewPrivileges", "yes"),
            ("PrivateTmp", "yes"),
            ("ProtectSystem", "strict"),
            ("ProtectHome", "yes"),
            ("LimitNOFILE", "65536"),
            ("KillSignal", "SIGTERM"),
        ] {
            assert!(has(k, v), "{unit}: {k}={v} missing");
        }
        let exec = lines
            .iter()
            .find(|(k, _)| k == "ExecStart")
            .map(|(_, v)| v.clone())
            .unwrap();
        assert!(
            !exec.to_lowercase().contains("token") && !text.contains(TOKEN),
            "{unit}: a secret on the command line: {exec}"
        );
        assert!(
            lines.iter().any(|(k, _)| k == "EnvironmentFile"),
            "{unit}: the token comes from a 0600 EnvironmentFile"
        );
        if unit == "kvtier-serve.service" {
            assert!(has("RuntimeDirectory", "kvtier"));
            assert!(has("StateDirectory", "kvtier"));
            assert!(exec.contains("--socket /run/kvtier/kvtier.sock"), "{exec}");
        }
        let local = dir.path().join(unit);
        std::fs::write(&local, text.replace("/usr/local/bin/kvtier", bin)).unwrap();
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(&local)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && stderr.trim().is_empty(),
            "systemd-analyze verify {unit}: {stderr}"
        );
        let out = Command::new("systemd-analyze")
            .args(["security", "--offline=true"])
            .arg(&local)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let score: f64 = text
            .lines()
            .find_map(|l| l.split("Overall exposure level for ").nth(1))
            .and_then(|l| l.split(':').nth(1))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no exposure score: {text}"));
        assert!(score <= 4.0, "{unit}: exposure {score} (want <= 4.0, 'OK')");
    }

    // The units' command lines start the real binary (paths, group and ports made local).
    let group = String::from_utf8(Command::new("id").arg("-gn").output().unwrap().stdout)
        .unwrap()
        .trim()
        .to_string();
    let run = dir.path().join("run");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::create_dir_all(&state).unwrap();
    for (unit, var) in [
        ("kvtier-serve.service", "SERVE_ARGS"),
        ("kvtier-master.service", "MASTER_ARGS"),
    ] {
        let text = std::fs::read_to_string(repo().join("ops/systemd").join(unit)).unwrap();
        let lines = unit_lines(&text);
        let default_args = lines
            .iter()
            .find_map(|(k, v)| {
                (k == "Environment")
                    .then(|| v.trim_matches('"').strip_prefix(&format!("{var}=")))
                    .flatten()
            })
            .unwrap()
            .to_string();
        let exec = lines
            .iter()
            .find(|(k, _)| k == "ExecStart")
            .map(|(_, v)| v.clone())
            .unwrap();
        let metrics = format!("127.0.0.1:{}", free_port("127.0.0.1"));
        let listen = format!("127.0.0.1:{}", free_port("127.0.0.1"));
        let command = exec
            .replace(&format!("${var}"), &default_args)
            .replace("/run/kvtier", run.to_str().unwrap())
            .replace("/var/lib/kvtier", state.to_str().unwrap())
            .replace("--socket-group kvtier", &format!("--socket-group {group}"))
            .replace(
                "--dram-capacity 8GiB",
                "--dram-capacity 16MiB --engine dram_prefault=false",
            )
            .replace("127.0.0.1:9464", &metrics)
            .replace("127.0.0.1:9465", &metrics)
            .replace("127.0.0.1:7700", &listen);
        let mut words = command.split_whitespace();
        assert_eq!(words.next(), Some("/usr/local/bin/kvtier"), "{command}");
        let args: Vec<&str> = words.collect();
        let mut proc = Proc::spawn(unit, &args, &[("KVTIER_CLUSTER_TOKEN", TOKEN)]);
        wait_for(Duration::from_secs(30), &format!("{unit} ready"), || {
            assert!(proc.running(), "{unit} exited: {command}");
            get(&metrics, "/readyz").is_some_and(|(s, _)| s == 200)
        });
        proc.terminate(Duration::from_secs(20));
    }
}
