//! `kvtier inspect` (and `kvtier stat --json`) against a real `kvtier serve` process with an
//! SSD tier under a DRAM tier smaller than the data, written by real clients of two tenants.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};

use kvtier_client::config::ConfigSources;
use kvtier_client::{Client, KvtierConfig};
use serde_json::{json, Map, Value};

struct Serve {
    child: Child,
    socket: String,
    _dir: tempfile::TempDir,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

fn kvtier(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .output()
        .unwrap()
}

fn serve() -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtier.sock").display().to_string();
    let ssd = dir.path().join("ssd").display().to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["serve", "--socket", &socket, "--dram-capacity", "256KiB"])
        .args([
            "--engine",
            "dram_prefault=false",
            "--engine",
            "ssd_enabled=true",
        ])
        .args(["--engine", &format!("ssd_storage_dir={ssd}")])
        .args(["--engine", "ssd_segment_size_bytes=1048576"])
        .args(["--engine", "ssd_capacity_bytes=16777216"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    // The start-up log may say other things first (the descriptor caps, a fallback notice).
    let listening = lines
        .by_ref()
        .take(50)
        .map_while(Result::ok)
        .any(|line| line.contains("listening on"));
    assert!(listening, "kvtier serve never said it was listening");
    std::thread::spawn(move || for _ in lines {});
    Serve {
        child,
        socket,
        _dir: dir,
    }
}

fn client(socket: &str, tag: Option<&str>) -> Client {
    let mut extra = Map::new();
    extra.insert("server_socket".into(), json!(socket));
    if let Some(tag) = tag {
        extra.insert("extra_backend_tag".into(), json!(tag));
    }
    Client::open(
        KvtierConfig::load(ConfigSources {
            env: Vec::new(),
            extra,
        })
        .unwrap(),
    )
    .unwrap()
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.code().is_some(),
        "killed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

#[test]
fn inspect_shows_tiers_pools_and_tenants() {
    let server = serve();
    let s = server.socket.as_str();
    let c = client(s, None);
    // 8 pages x 2 pools x 64 KiB = 1 MiB through a 256 KiB DRAM tier: the oldest pages are
    // on SSD only, the newest in both tiers.
    let key = |p: usize, pool: &str| format!("page{p}@fp01.{pool}");
    for p in 0..8 {
        for pool in ["c4", "swa"] {
            c.put_slice(key(p, pool).as_bytes(), &vec![p as u8; 64 << 10], None)
                .unwrap();
        }
        c.flush().unwrap();
    }
    let t = client(s, Some("team"));
    t.put_slice(b"page0@fp01.c4", &[9u8; 4096], None).unwrap();
    t.flush().unwrap();

    // One exact key: the newest page is in DRAM and on SSD.
    let out = kvtier(&["inspect", "--socket", s, "--json", &key(7, "c4")]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let doc = json_of(&out);
    let k = &doc["stores"][0]["keys"][0];
    assert_eq!(k["dram_bytes"], 64 << 10, "{doc}");
    assert_eq!(k["ssd_bytes"], 64 << 10, "{doc}");
    // The oldest page is on SSD only.
    let doc = json_of(&kvtier(&[
        "inspect",
        "--socket",
        s,
        "--json",
        &key(0, "swa"),
    ]));
    let k = &doc["stores"][0]["keys"][0];
    assert!(
        k["dram_bytes"].is_null() && k["ssd_bytes"] == 64 << 10,
        "{doc}"
    );

    // A prefix: every component of every page, sorted, both tiers accounted.
    let doc = json_of(&kvtier(&[
        "inspect", "--socket", s, "--json", "--prefix", "page",
    ]));
    let list = doc["stores"][0]["prefix"].as_array().unwrap().clone();
    assert_eq!(list.len(), 16, "{doc}");
    assert!(list.iter().all(|p| p["ssd_bytes"] == 64 << 10));
    let in_dram = list.iter().filter(|p| !p["dram_bytes"].is_null()).count();
    assert!(
        (1..=4).contains(&in_dram),
        "{in_dram} of 16 in a 256 KiB DRAM tier"
    );
    assert_eq!(doc["stores"][0]["truncated"], false);
    // --limit truncates and says so.
    let doc = json_of(&kvtier(&[
        "inspect", "--socket", s, "--json", "--prefix", "page", "--limit", "3",
    ]));
    assert_eq!(doc["stores"][0]["prefix"].as_array().unwrap().len(), 3);
    assert_eq!(doc["stores"][0]["truncated"], true);

    // Tenants are namespaces: team's page0 is a different object.
    let doc = json_of(&kvtier(&[
        "inspect",
        "--socket",
        s,
        "--json",
        "--tenant",
        "team",
        "page0@fp01.c4",
    ]));
    assert_eq!(doc["stores"][0]["keys"][0]["dram_bytes"], 4096, "{doc}");
    let doc = json_of(&kvtier(&[
        "inspect", "--socket", s, "--json", "--raw", "--prefix", "",
    ]));
    assert_eq!(doc["stores"][0]["prefix"].as_array().unwrap().len(), 17);

    // The table: pool and tiers per object.
    let out = kvtier(&["inspect", "--socket", s, "--prefix", "page7@"]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(rows.len(), 2, "{text}");
    for (row, pool) in rows.iter().zip(["c4", "swa"]) {
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "main",
                "-",
                "dram+ssd",
                "65536",
                "65536",
                pool,
                &key(7, pool)
            ],
            "{text}"
        );
    }

    // Nothing found: exit 1; no server: exit 1 with the socket named; no key: usage error.
    let out = kvtier(&["inspect", "--socket", s, "nope@x.c4"]);
    assert_eq!(out.status.code(), Some(1));
    let out = kvtier(&["inspect", "--socket", "/nonexistent/kvtier.sock", "k"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/kvtier.sock"));
    assert_eq!(kvtier(&["inspect", "--socket", s]).status.code(), Some(2));

    // stat --json reads the same server.
    let doc = json_of(&kvtier(&["stat", "--socket", s, "--json"]));
    assert_eq!(doc["stores"]["main"]["ssd_objects"], 17, "{doc}");
}
