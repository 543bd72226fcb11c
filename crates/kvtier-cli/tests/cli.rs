//! The `kvtier` binary: fsck on a real SSD directory (clean and damaged), help everywhere.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use kvtier_engine::{Engine, EngineConfig, PutMeta};

fn kvtier(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .output()
        .expect("run kvtier")
}

#[test]
fn fsck_reports_clean_and_damaged_directories() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = EngineConfig {
        dram_capacity_bytes: 1 << 20,
        ssd_enabled: true,
        ssd_storage_dir: dir.path().to_path_buf(),
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
    let d = dir.path().to_str().unwrap();
    let out = kvtier(&["fsck", d, "--json"]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["good"], 10);
    assert_eq!(v["corrupt"], 0);
    let out = kvtier(&["fsck", d]);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("10 good"),
        "{out:?}"
    );

    // Flip a payload byte of the second record.
    let seg = dir.path().join("seg-000000.kvt");
    let mut data = std::fs::read(&seg).unwrap();
    data[4096 * 4 + 100] ^= 1;
    std::fs::write(&seg, &data).unwrap();
    let out = kvtier(&["fsck", d, "--json"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["good"].as_u64(), v["corrupt"].as_u64()),
        (Some(9), Some(1))
    );

    let out = kvtier(&["fsck", "/nonexistent/kvtier"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn every_subcommand_has_help() {
    for args in [
        &["--help"][..],
        &["fsck", "--help"],
        &["bench", "--help"],
        &["bench", "ssd", "--help"],
        &["bench", "recovery", "--help"],
        &["bench", "server", "--help"],
        &["bench", "workload", "--help"],
        &["config", "--help"],
        &["config", "check", "--help"],
        &["serve", "--help"],
        &["stat", "--help"],
    ] {
        let out = kvtier(args);
        assert!(out.status.success() && !out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn bench_recovery_runs_small() {
    let dir = tempfile::tempdir().unwrap();
    let out = kvtier(&[
        "bench",
        "recovery",
        "--objects",
        "2000",
        "--json",
        "--dir",
        dir.path().to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["objects"], 2000);
}

#[test]
fn config_check_prints_the_effective_config_or_names_the_bad_key() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        "dram_capacity_bytes = \"8MiB\"\nmetrics_addr = \"127.0.0.1:9100\"\n",
    )
    .unwrap();
    let out = kvtier(&["config", "check", good.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["schema"], "client");
    assert_eq!(v["config"]["dram_capacity_bytes"], 8 << 20);
    assert_eq!(
        v["config"]["dram_block_size"], 4096,
        "defaults are filled in"
    );
    let out = kvtier(&["config", "check", good.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("dram_capacity_bytes = 8388608"), "{text}");

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "dram_capcity = 3\n").unwrap();
    let out = kvtier(&["config", "check", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("`dram_capcity`"));
    std::fs::write(&bad, "metrics_addr = \"99999\"\n").unwrap();
    let out = kvtier(&["config", "check", bad.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["key"], "metrics_addr");

    let server = dir.path().join("serve.toml");
    std::fs::write(
        &server,
        "socket = \"/tmp/x.sock\"\n[engine]\ndram_capacity_bytes = \"8MiB\"\nbogus = 1\n",
    )
    .unwrap();
    let out = kvtier(&["config", "check", server.to_str().unwrap(), "--json"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["schema"].as_str(), v["key"].as_str()),
        (Some("server"), Some("bogus"))
    );
}

#[test]
fn bench_workload_without_python_is_a_clear_error() {
    let out = kvtier(&[
        "bench",
        "workload",
        "--python",
        "/nonexistent/python",
        "--quick",
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("needs a Python with kvtier installed"),
        "{err}"
    );
}
