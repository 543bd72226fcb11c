//! Issue 26 §4 and issue 27 §2, against the real `kvtier` binary: the cluster token never comes
//! from a command line; defaults another user took fall back to private directories; a
//! non-UTF-8 environment and huge counts do not take the server down; kvtier's own variables
//! are not configuration keys; every configuration block of the README and docs is valid;
//! `kvtier config check` tells client files from server files and keys that do nothing where
//! they are given; `server_auto_start` gives the server the client's engine settings and a log.
//! Each attack is played against real processes, and a legitimate client is served after it.
#![allow(clippy::unwrap_used)]

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, wait_for, Proc};
use kvtier_client::config::ConfigSources;
use kvtier_client::{Client, KvtierConfig};
use serde_json::{json, Map, Value};

const BIN: &str = env!("CARGO_BIN_EXE_kvtier");

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// `kvtier ARGS` to completion (bounded: every case here exits by itself within seconds).
fn run(args: &[&str], env: &[(&OsStr, &OsStr)]) -> (i32, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn os(s: &str) -> &OsStr {
    OsStr::new(s)
}

/// A `kvtier serve` whose stderr goes to a file (read for what it said).
struct Serve {
    proc: Proc,
    log: PathBuf,
}

impl Serve {
    fn spawn(cmd: &mut Command, log: &Path, name: &str) -> Serve {
        let file = std::fs::File::create(log).unwrap();
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(file));
        Serve {
            proc: Proc {
                child: cmd.spawn().unwrap(),
                name: name.into(),
            },
            log: log.to_path_buf(),
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until `socket` accepts a connection (the server is up).
    fn wait_socket(&mut self, socket: &Path) {
        let start = Instant::now();
        while std::os::unix::net::UnixStream::connect(socket).is_err() {
            assert!(
                self.proc.running(),
                "kvtier serve exited: {}",
                self.stderr()
            );
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "kvtier serve did not listen: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn serve_cmd(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.arg("serve")
        .args([
            "--dram-capacity",
            "16MiB",
            "--engine",
            "dram_prefault=false",
        ])
        .args(args);
    cmd
}

/// A legitimate client's round trip through the store at `socket`.
fn round_trip(client: &Client, tag: u8) {
    let value: Vec<u8> = (0..8192u32).map(|i| (i as u8) ^ tag).collect();
    let key = format!("config-true-{tag}");
    client.put_slice(key.as_bytes(), &value, None).unwrap();
    let mut back = vec![0u8; value.len()];
    client.get_into_slice(key.as_bytes(), &mut back).unwrap();
    assert_eq!(back, value);
}

fn server_client(socket: &Path, server_uid: Option<u32>) -> Client {
    Client::open(KvtierConfig {
        server_socket: Some(socket.display().to_string()),
        server_uid: server_uid.map(|u| u.to_string()),
        ..KvtierConfig::default()
    })
    .unwrap()
}

/// Issue 26: another program's non-UTF-8 variable (and kvtier's own non-key variables, e.g.
/// `KVTIER_PYTHON` as `kvtier bench workload` tells users to export it) do not stop `kvtier
/// serve`; a kvtier key whose value is not UTF-8 is an error naming it, never a panic.
#[test]
fn serve_survives_a_non_utf8_environment_and_kvtier_own_variables() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let mut cmd = serve_cmd(&["--socket", socket.to_str().unwrap()]);
    cmd.env(
        OsStr::new("OTHER_PROGRAM_VAR"),
        OsStr::from_bytes(b"caf\xe9"),
    )
    .env("KVTIER_PYTHON", "/usr/bin/python3")
    .env("KVTIER_TEST_SOMETHING", "1")
    .env("KVTIER_LOG_FORMAT", "json");
    let mut serve = Serve::spawn(&mut cmd, &dir.path().join("serve.err"), "serve");
    serve.wait_socket(&socket);
    let client = server_client(&socket, None);
    round_trip(&client, 1);
    drop(client);
    serve.proc.terminate(Duration::from_secs(20));

    let value = OsStr::from_bytes(b"16Mi\xffB");
    for name in ["KVTIER_DRAM_CAPACITY_BYTES", "KVTIER_SERVE_MAX_CONNECTIONS"] {
        let (code, _, err) = run(
            &["serve", "--socket", socket.to_str().unwrap()],
            &[(os(name), value)],
        );
        assert_ne!(code, 0, "{err}");
        assert!(err.contains(name), "{err}");
        assert!(err.contains("not valid UTF-8"), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // `config check --env` reads the environment the same way.
    let file = dir.path().join("c.toml");
    std::fs::write(&file, "dram_capacity_bytes = \"16MiB\"\n").unwrap();
    let (code, _, err) = run(
        &["config", "check", "--env", file.to_str().unwrap()],
        &[
            (os("OTHER_PROGRAM_VAR"), OsStr::from_bytes(b"\xff")),
            (os("KVTIER_PYTHON"), os("/usr/bin/python3")),
        ],
    );
    assert_eq!(code, 0, "{err}");
}

/// Issue 26: every size-like and count-like key has a range; `eviction_candidate_window =
/// 2^31` (which aborted the server at its first put) is refused at start, naming key, value
/// and range.
#[test]
fn counts_and_sizes_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    for (flag, key, value, range) in [
        (
            "eviction_candidate_window=2147483648",
            "eviction_candidate_window",
            "2147483648",
            "1..=65536",
        ),
        (
            "kv_events_buffer=4294967296",
            "kv_events_buffer",
            "4294967296",
            "1..=16777216",
        ),
    ] {
        let started = Instant::now();
        let (code, _, err) = run(
            &[
                "serve",
                "--socket",
                socket.to_str().unwrap(),
                "--engine",
                flag,
            ],
            &[],
        );
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains(key) && err.contains(value) && err.contains(range),
            "{err}"
        );
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    let file = dir.path().join("serve.toml");
    std::fs::write(&file, "max_regions_per_client = 0\n").unwrap();
    let (code, _, err) = run(
        &[
            "config",
            "check",
            "--kind",
            "server",
            file.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("max_regions_per_client") && err.contains("1..=1048576"),
        "{err}"
    );
    // The server still starts with sane values and serves.
    let mut cmd = serve_cmd(&[
        "--socket",
        socket.to_str().unwrap(),
        "--engine",
        "eviction_candidate_window=65536",
    ]);
    let mut serve = Serve::spawn(&mut cmd, &dir.path().join("serve.err"), "serve");
    serve.wait_socket(&socket);
    round_trip(&server_client(&socket, None), 2);
    serve.proc.terminate(Duration::from_secs(20));
}

fn write_mode(path: &Path, text: &str, mode: u32) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, PermissionsExt::from_mode(mode)).unwrap();
}

/// Issue 26: the cluster token is never taken from a command line (`--engine`, extra_config)
/// and never echoed; a token file must be a private regular file of this user or root. With
/// a proper 0600 file a real master, node and cluster client work.
#[test]
fn cluster_token_never_from_a_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("node.sock");
    let data = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let (code, _, err) = run(
        &[
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--master",
            "127.0.0.1:9",
            "--data-addr",
            &data,
            "--engine",
            "cluster_token=s3cret-on-cmdline",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("KVTIER_CLUSTER_TOKEN") && err.contains("cluster_token_file"),
        "{err}"
    );
    assert!(
        !err.contains("s3cret-on-cmdline"),
        "the error echoed the secret: {err}"
    );
    // extra_config (SGLang's, on its command line) is refused the same way.
    let mut extra = Map::new();
    extra.insert("master_address".into(), json!("127.0.0.1:9"));
    extra.insert("cluster_token".into(), json!("s3cret"));
    let e = KvtierConfig::load(ConfigSources {
        env: Vec::new(),
        extra,
    })
    .unwrap_err();
    assert!(e.reason.contains("KVTIER_CLUSTER_TOKEN"), "{e}");

    // Token files that are not private: refused by the master, naming path and mode.
    let loose = dir.path().join("loose-token");
    write_mode(&loose, "file-secret\n", 0o644);
    let (code, _, err) = run(
        &["master", "--listen", "127.0.0.1:0"],
        &[(os("KVTIER_CLUSTER_TOKEN_FILE"), loose.as_os_str())],
    );
    assert_ne!(code, 0);
    assert!(
        err.contains(loose.to_str().unwrap()) && err.contains("0644"),
        "{err}"
    );
    let not_file = dir.path().join("token-dir");
    std::fs::create_dir(&not_file).unwrap();
    std::fs::set_permissions(&not_file, PermissionsExt::from_mode(0o700)).unwrap();
    let (code, _, err) = run(
        &["master", "--listen", "127.0.0.1:0"],
        &[(os("KVTIER_CLUSTER_TOKEN_FILE"), not_file.as_os_str())],
    );
    assert_ne!(code, 0);
    assert!(err.contains("not a regular file"), "{err}");
    if rustix::process::geteuid().is_root() {
        let foreign = dir.path().join("foreign-token");
        write_mode(&foreign, "file-secret\n", 0o600);
        std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
        let (code, _, err) = run(
            &["master", "--listen", "127.0.0.1:0"],
            &[(os("KVTIER_CLUSTER_TOKEN_FILE"), foreign.as_os_str())],
        );
        assert_ne!(code, 0);
        assert!(err.contains("uid 65534"), "{err}");
    }

    // A private token file: master, node and client all read it, and the cluster works.
    let token = dir.path().join("token");
    write_mode(&token, "file-secret\n", 0o600);
    let master_addr = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let token_env = [("KVTIER_CLUSTER_TOKEN_FILE", token.to_str().unwrap())];
    let _master = Proc::spawn(
        "master",
        &["master", "--listen", &master_addr, "--lease-ms", "1000"],
        &token_env,
    );
    let _node = Proc::spawn(
        "node",
        &[
            "serve",
            "--socket",
            socket.to_str().unwrap(),
            "--dram-capacity",
            "16MiB",
            "--engine",
            "dram_prefault=false",
            "--engine",
            "cluster_transport=tcp",
            "--master",
            &master_addr,
            "--data-addr",
            &data,
            "--node-id",
            "node-a",
        ],
        &token_env,
    );
    let mut extra = Map::new();
    extra.insert("master_address".into(), json!(master_addr));
    extra.insert("cluster_transport".into(), json!("tcp"));
    let config = KvtierConfig::load(ConfigSources {
        env: vec![(
            "KVTIER_CLUSTER_TOKEN_FILE".into(),
            token.display().to_string(),
        )],
        extra,
    })
    .unwrap();
    assert_eq!(config.cluster_token.as_deref(), Some("file-secret"));
    assert!(
        !config.to_toml().contains("file-secret"),
        "printed the token"
    );
    let client = Client::open(config).unwrap();
    let mut ok = false;
    let start = Instant::now();
    while !ok && start.elapsed() < Duration::from_secs(20) {
        let value = vec![7u8; 4096];
        ok = client.put_slice(b"token-file-key", &value, None).is_ok();
        if !ok {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    assert!(ok, "no put through the cluster");
    let mut back = vec![0u8; 4096];
    client.get_into_slice(b"token-file-key", &mut back).unwrap();
    assert_eq!(back, vec![7u8; 4096]);
}

/// Issue 26: another user who creates the default socket directory (`/tmp/kvtier-<uid>`)
/// and the default SSD directory (`/var/tmp/kvtier-ssd-<uid>`) first no longer stops `kvtier
/// serve`: it falls back to fresh private directories, says which, and serves; the planted
/// directories get nothing. An explicitly configured unsafe SSD directory stays an error
/// naming it. The server runs as uid 65533, the attacker as 65534.
#[test]
fn defaults_another_user_took_fall_back_to_private_directories() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to play two other uids");
        return;
    }
    use std::os::unix::process::CommandExt;
    const UID: u32 = 65533;
    const ATTACKER: u32 = 65534;
    let planted_socket_dir = PathBuf::from(format!("/tmp/kvtier-{UID}"));
    let planted_ssd_dir = PathBuf::from(format!("/var/tmp/kvtier-ssd-{UID}"));
    let cleanup = || {
        let _ = std::fs::remove_dir_all(&planted_socket_dir);
        let _ = std::fs::remove_dir_all(&planted_ssd_dir);
        for entry in std::fs::read_dir("/var/tmp").unwrap().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&format!("kvtier-ssd-{UID}-")) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    };
    cleanup();
    // The attacker plants both defaults, open to everyone, owned by itself.
    for planted in [&planted_socket_dir, &planted_ssd_dir] {
        let status = Command::new("mkdir")
            .args(["-m", "0777"])
            .arg(planted)
            .uid(ATTACKER)
            .gid(ATTACKER)
            .status()
            .unwrap();
        assert!(status.success());
        assert_eq!(std::fs::metadata(planted).unwrap().uid(), ATTACKER);
    }
    // A TMPDIR the server's uid can create its fresh directory in.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), PermissionsExt::from_mode(0o1777)).unwrap();
    let spawn = |extra: &[&str], log: &str| {
        let mut cmd = serve_cmd(&[
            "--engine",
            "ssd_enabled=true",
            "--engine",
            "ssd_capacity_bytes=16MiB",
            "--engine",
            "ssd_segment_size_bytes=1MiB",
        ]);
        cmd.args(extra)
            .env_remove("XDG_RUNTIME_DIR")
            .env_remove("XDG_STATE_HOME")
            .env_remove("HOME")
            .env("TMPDIR", tmp.path())
            .current_dir(tmp.path())
            .uid(UID)
            .gid(UID);
        Serve::spawn(&mut cmd, &tmp.path().join(log), "serve as 65533")
    };
    let mut serve = spawn(&[], "serve.err");
    // The fresh directory is the only `kvtier-65533-*` in TMPDIR.
    let mut found = None;
    wait_for(Duration::from_secs(30), "the fallback socket", || {
        assert!(
            serve.proc.running(),
            "kvtier serve exited: {}",
            serve.stderr()
        );
        found = std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .find(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("kvtier-{UID}-"))
            })
            .map(|e| e.path().join("kvtier.sock"));
        found.as_ref().is_some_and(|s| s.exists())
    });
    let socket = found.unwrap();
    serve.wait_socket(&socket);
    let said = serve.stderr();
    assert!(
        socket.starts_with(tmp.path()) && !socket.starts_with(&planted_socket_dir),
        "socket {}: {said}",
        socket.display()
    );
    assert!(
        said.contains("default socket directory cannot be used"),
        "{said}"
    );
    assert!(
        said.contains(socket.to_str().unwrap()),
        "the socket is not named: {said}"
    );
    assert!(
        said.contains("default SSD directory cannot be used"),
        "{said}"
    );
    assert!(
        said.contains(&format!("/var/tmp/kvtier-ssd-{UID}-")),
        "{said}"
    );
    let socket_dir = socket.parent().unwrap();
    let meta = std::fs::metadata(socket_dir).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o777), (UID, 0o700));
    // A legitimate client of that user's server is served (root may trust uid 65533).
    let client = server_client(&socket, Some(UID));
    round_trip(&client, 3);
    drop(client);
    serve.proc.terminate(Duration::from_secs(20));
    // The planted directories got nothing.
    for planted in [&planted_socket_dir, &planted_ssd_dir] {
        assert_eq!(
            std::fs::read_dir(planted).unwrap().count(),
            0,
            "{planted:?}"
        );
    }
    // Named explicitly, the attacker's SSD directory is an error naming it.
    let flag = format!("ssd_storage_dir={}", planted_ssd_dir.display());
    let sock_flag = tmp.path().join("explicit.sock");
    let mut bad = spawn(
        &["--socket", sock_flag.to_str().unwrap(), "--engine", &flag],
        "bad.err",
    );
    let start = Instant::now();
    while bad.proc.running() && start.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !bad.proc.running(),
        "served from the attacker's SSD directory"
    );
    let said = bad.stderr();
    assert!(said.contains(planted_ssd_dir.to_str().unwrap()), "{said}");
    cleanup();
}

/// Issue 27: `server_auto_start` starts `kvtier serve` with the client's engine settings
/// (as `--engine` flags; no secret) and keeps its output in `server_log_file` (0600).
#[test]
fn auto_start_passes_engine_settings_and_keeps_a_log() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("auto.sock");
    let log = dir.path().join("auto-serve.log");
    let mut extra = Map::new();
    for (k, v) in [
        ("server_socket", json!(socket.display().to_string())),
        ("server_auto_start", json!(true)),
        ("server_bin", json!(BIN)),
        ("server_log_file", json!(log.display().to_string())),
        ("dram_capacity_bytes", json!("24MiB")),
        ("dram_prefault", json!(false)),
        ("eviction_policy", json!("lru")),
    ] {
        extra.insert(k.into(), v);
    }
    let config = KvtierConfig::load(ConfigSources {
        env: Vec::new(),
        extra,
    })
    .unwrap();
    let client = Client::open(config).unwrap();
    round_trip(&client, 4);
    // The server got the client's engine settings.
    let (code, stats, err) = run(
        &["stat", "--socket", socket.to_str().unwrap(), "--json"],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    let stats: Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(
        stats["stores"]["main"]["capacity_bytes"],
        json!(24u64 << 20),
        "{stats}"
    );
    // Its output is kept, in a private file.
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains(socket.to_str().unwrap()), "{text}");
    assert_eq!(std::fs::metadata(&log).unwrap().mode() & 0o777, 0o600);
    // Its command line: the engine flags, no secret.
    let pid = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let c = String::from_utf8_lossy(&c);
                c.contains("serve") && c.contains(socket.to_str().unwrap())
            })
        })
        .expect("the auto-started server's process");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(cmdline.contains("eviction_policy=lru"), "{cmdline}");
    assert!(!cmdline.contains("token"), "{cmdline}");
    drop(client);
    // Stop the server this test started (by its pid).
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    wait_for(
        Duration::from_secs(30),
        "the auto-started server to stop",
        || {
            !Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z "))
        },
    );
}

fn check(args: &[&str], file_text: &str) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("k.toml");
    std::fs::write(&file, file_text).unwrap();
    let mut all: Vec<&str> = vec!["config", "check"];
    all.extend(args);
    all.push(file.to_str().unwrap());
    // `--env` checks see a cluster token, as a real cluster client would.
    let (code, _, err) = run(&all, &[(os("KVTIER_CLUSTER_TOKEN"), os("t"))]);
    (code, err)
}

/// Issue 27: `kvtier config check` tells a store's file from `kvtier serve`'s, or is told;
/// a key that does nothing where it is given is an error saying where it belongs.
#[test]
fn config_check_knows_client_from_server_and_misplaced_keys() {
    // Told apart by their keys.
    let (code, err) = check(
        &[],
        "socket_mode = \"0600\"\n[engine]\ndram_capacity_bytes = \"1GiB\"\n",
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("valid server configuration"), "{err}");
    let (code, err) = check(
        &[],
        "extra_backend_tag = \"a\"\n[engine]\ndram_capacity_bytes = \"1GiB\"\n",
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("valid client configuration"), "{err}");
    // Both kinds in one file.
    let (code, err) = check(&[], "extra_backend_tag = \"a\"\nsocket_mode = \"0600\"\n");
    assert_eq!(code, 1);
    assert!(
        err.contains("extra_backend_tag") && err.contains("socket_mode") && err.contains("--kind"),
        "{err}"
    );
    // Engine keys in a server-mode client: they belong in the server's [engine].
    let (code, err) = check(
        &["--kind", "client"],
        "dram_capacity_bytes = \"1GiB\"\n[server]\nsocket = \"/run/k.sock\"\n",
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("dram_capacity_bytes")
            && err.contains("[engine]")
            && err.contains("kvtier serve"),
        "{err}"
    );
    // ... unless the client starts the server with them.
    let (code, err) = check(
        &["--kind", "client"],
        "dram_capacity_bytes = \"1GiB\"\n[server]\nsocket = \"/run/k.sock\"\nauto_start = true\n",
    );
    assert_eq!(code, 0, "{err}");
    // Engine keys in a cluster client belong on the nodes. (Without --kind this file reads
    // as a node's `kvtier serve` file, where it is valid.)
    let (code, err) = check(
        &["--env"],
        "[engine]\nssd_enabled = true\n[cluster]\nmaster_address = \"10.0.0.1:7700\"\n",
    );
    assert_eq!(code, 0, "{err}");
    let (code, err) = check(
        &["--env", "--kind", "client"],
        "[engine]\nssd_enabled = true\n[cluster]\nmaster_address = \"10.0.0.1:7700\"\n",
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("ssd_enabled") && err.contains("nodes"),
        "{err}"
    );
    // Server-mode keys without a server, cluster keys without a master, node keys in a client.
    for (text, key) in [
        ("server_bin = \"/usr/bin/kvtier\"\n", "server_bin"),
        ("[cluster]\nnode_id = \"a\"\n", "node_id"),
        ("put_landing_mib = 8\n", "put_landing_mib"),
    ] {
        let (code, err) = check(&["--kind", "client"], text);
        assert_eq!(code, 1, "{text}");
        assert!(
            err.contains(key) && err.contains("does nothing here"),
            "{err}"
        );
    }
    // Client keys in kvtier serve's file.
    let (code, err) = check(
        &["--kind", "server"],
        "[engine]\nserver_auto_start = true\n",
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("server_auto_start") && err.contains("client"),
        "{err}"
    );
    let (code, err) = check(&["--kind", "server"], "extra_backend_tag = \"a\"\n");
    assert_eq!(code, 1);
    assert!(err.contains("a client key"), "{err}");
    let (code, err) = check(&["--kind", "server"], "dram_capacity_bytes = \"1GiB\"\n");
    assert_eq!(code, 1);
    assert!(err.contains("[engine]"), "{err}");
}

/// The fenced blocks of `text` with their info string: `(lang, body)`.
fn fenced_blocks(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current: Option<(String, String)> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix("```") {
            match current.take() {
                Some(block) => out.push(block),
                None => current = Some((rest.trim().to_string(), String::new())),
            }
        } else if let Some((_, body)) = current.as_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    out
}

/// Issue 27: every TOML configuration block of README.md and docs/*.md is valid for the
/// parser it is meant for: each starts with `# kvtier-config: client` or `# kvtier-config:
/// server` (a block without the mark fails this test), and `kvtier config check --kind`
/// accepts it (with a cluster token in the environment, where clusters get it from).
/// The extra_config JSON blocks are checked by `tests/python/test_config_true.py`.
#[test]
fn every_config_block_in_the_docs_is_valid() {
    let root = repo_root();
    let mut files = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("docs")).unwrap().flatten() {
        if entry.path().extension().is_some_and(|e| e == "md") {
            files.push(entry.path());
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (i, (lang, body)) in fenced_blocks(&text).into_iter().enumerate() {
            if lang != "toml" {
                continue;
            }
            let first = body.lines().next().unwrap_or("");
            let kind = first
                .strip_prefix("# kvtier-config: ")
                .and_then(|rest| rest.split_whitespace().next())
                .unwrap_or_else(|| {
                    panic!(
                        "{} block {i}: a toml block must start with `# kvtier-config: client` or \
                         `server`: {first:?}",
                        file.display()
                    )
                });
            assert!(kind == "client" || kind == "server", "{kind}");
            let path = dir.path().join(format!("block-{checked}.toml"));
            std::fs::write(&path, &body).unwrap();
            let (code, out, err) = run(
                &[
                    "config",
                    "check",
                    "--kind",
                    kind,
                    "--env",
                    path.to_str().unwrap(),
                ],
                &[(os("KVTIER_CLUSTER_TOKEN"), os("doc-check-token"))],
            );
            assert_eq!(
                code,
                0,
                "{} block {i} ({kind}) is rejected: {err}\n{body}",
                file.display()
            );
            assert!(
                !out.contains("doc-check-token"),
                "config check printed the token"
            );
            checked += 1;
        }
    }
    assert!(checked >= 2, "only {checked} blocks found");
}

/// Issue 27: kvtier's own non-configuration variables are declared once
/// (`NON_CONFIG_ENV`): every `KVTIER_*` variable the repository reads or sets (Rust
/// `var`/`var_os`/`.env`, Python `os.environ`/`setenv`, shell `$KVTIER_...`) is either a
/// key's variable (`KVTIER_<KEY>`, `KVTIER_SERVE_<KEY>`, `KVTIER_CONFIG_FILE`) or declared.
#[test]
fn non_config_variables_are_declared_once() {
    let root = repo_root();
    let client_keys = KvtierConfig::known_keys();
    let server_keys = kvtier_server::config::known_server_keys();
    let is_key_var = |name: &str| {
        if name == "KVTIER_CONFIG_FILE" {
            return true;
        }
        if let Some(k) = name.strip_prefix("KVTIER_SERVE_") {
            return server_keys.iter().any(|s| s.eq_ignore_ascii_case(k));
        }
        name.strip_prefix("KVTIER_")
            .is_some_and(|k| client_keys.iter().any(|s| s.eq_ignore_ascii_case(k)))
    };
    let mut seen = Vec::new();
    let mut stack = vec![
        root.join("crates"),
        root.join("python"),
        root.join("tools"),
        root.join("scripts"),
        root.join("tests"),
    ];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            if !matches!(ext, "rs" | "py" | "sh") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            for (at, _) in text.match_indices("KVTIER_") {
                let name: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                let before = &text[..at];
                let reads = before.ends_with("var(\"")
                    || before.ends_with("var_os(\"")
                    || before.ends_with(".env(\"")
                    || before.ends_with("environ[\"")
                    || before.ends_with("environ.get(\"")
                    || before.ends_with("getenv(\"")
                    || before.ends_with("setenv(\"")
                    || before.ends_with("${")
                    || (before.ends_with('$') && ext == "sh");
                if reads && name.len() > "KVTIER_".len() && !name.ends_with('_') {
                    seen.push((name, path.clone()));
                }
            }
        }
    }
    assert!(
        seen.iter().any(|(n, _)| n == "KVTIER_PYTHON"),
        "the scan found no KVTIER_PYTHON read: {seen:?}"
    );
    // Names tests set on purpose to show an unknown key is refused.
    const DELIBERATELY_UNKNOWN: &[&str] = &["KVTIER_NO_SUCH_SETTING"];
    for (name, path) in &seen {
        assert!(
            is_key_var(name)
                || kvtier_client::config::is_non_config_env(name)
                || DELIBERATELY_UNKNOWN.contains(&name.as_str()),
            "{name} (in {}) is neither a configuration key's variable nor declared in \
             NON_CONFIG_ENV (crates/kvtier-store/src/config.rs)",
            path.display()
        );
    }
    // And declared ones are skipped by the loader.
    for name in kvtier_client::config::NON_CONFIG_ENV {
        KvtierConfig::load(ConfigSources {
            env: vec![(name.to_string(), "x".into())],
            extra: Map::new(),
        })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}
