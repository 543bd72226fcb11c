//! `kvtier serve`'s configuration: its own keys plus the engine's (kvtier's one schema).
//!
//! Sources, later ones winning: a TOML file (`--config`), `KVTIER_SERVE_*` environment
//! variables (server keys) and `KVTIER_*` ones (engine keys, as for every kvtier process),
//! then command-line flags. The file holds server keys at top level and engine keys in an
//! `[engine]` table:
//!
//! ```toml
//! socket = "/run/kvtier/kvtier.sock"
//! socket_mode = "0660"
//! socket_group = "sglang"
//! tenant_dram_quota = { team-a = "8GiB", team-b = "2GiB" }
//!
//! [engine]
//! dram_capacity_bytes = "32GiB"
//! ```
//!
//! Issue 16: the server's own keys may also sit in a `[server]` table, and the engine schema's
//! `[cluster]` / `[events]` sections (kvtier's configuration by audience, see
//! `kvtier_store::config::SECTIONS`) may be top-level tables here or nested in `[engine]`;
//! a key given both ways is an error naming both.
//!
//! Parsing is as strict as the client's: unknown keys, wrong types and out-of-range values are
//! a [`ConfigError`] naming the key and its origin.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvtier_store::config::{read_toml, strict, ConfigError, ConfigSources, Origin};
use kvtier_store::KvtierConfig;
use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Prefix of the server's own environment variables.
pub const SERVE_ENV_PREFIX: &str = "KVTIER_SERVE_";
/// The file table that holds engine keys.
pub const ENGINE_TABLE: &str = "engine";
/// The file table that may hold this server's own keys (else they are top-level).
pub const SERVER_TABLE: &str = "server";
/// Top-level file tables handed to the engine schema as its sections.
pub const ENGINE_SIDE_TABLES: &[&str] = &["cluster", "events"];
/// Upper bound of the server's connection and region counts (issue 26).
pub const MAX_COUNT: u64 = 1 << 20;
/// Upper bound of `handshake_timeout_ms` (one hour).
pub const MAX_HANDSHAKE_TIMEOUT_MS: u64 = 3_600_000;

/// Settings of `kvtier serve` other than the engine's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSettings {
    /// Path of the Unix socket. Default: `$XDG_RUNTIME_DIR/kvtier.sock`, else
    /// `/tmp/kvtier-<uid>/kvtier.sock` (that directory created 0700 and checked).
    #[serde(deserialize_with = "strict::optional_string")]
    pub socket: Option<String>,
    /// File mode of the socket, octal (`"0600"`: only this user may connect).
    pub socket_mode: String,
    /// Group (name or numeric gid) given the socket, for `socket_mode = "0660"`.
    #[serde(deserialize_with = "strict::optional_string")]
    pub socket_group: Option<String>,
    /// Most connected clients (connections, all sessions together).
    #[serde(deserialize_with = "strict::count")]
    pub max_connections: u64,
    /// Most regions one session may register.
    #[serde(deserialize_with = "strict::count")]
    pub max_regions_per_client: u64,
    /// Most bytes one session may have mapped, reserved before a region is mapped (default:
    /// half of the host's physical memory).
    #[serde(deserialize_with = "strict::size")]
    pub max_mapped_bytes_per_client: u64,
    /// Most bytes all sessions together may have mapped (default: the host's physical
    /// memory).
    #[serde(deserialize_with = "strict::size")]
    pub max_mapped_bytes_total: u64,
    /// Most open connections of one peer uid (`SO_PEERCRED`), all its processes together.
    #[serde(deserialize_with = "strict::count")]
    pub max_connections_per_uid: u64,
    /// Issue 26: most bytes all sessions of one peer uid together may have mapped (default:
    /// half of the host's physical memory).
    #[serde(deserialize_with = "strict::size")]
    pub max_mapped_bytes_per_uid: u64,
    /// A connection that has not completed its handshake and opened (or joined) a session
    /// within this many milliseconds is closed.
    #[serde(deserialize_with = "strict::count")]
    pub handshake_timeout_ms: u64,
    /// Pre-fault client regions when they are registered (`MAP_POPULATE`).
    #[serde(deserialize_with = "strict::boolean")]
    pub prefault_regions: bool,
    /// Per-tenant DRAM quota: a tenant listed here gets its own arena of that size, which its
    /// objects can never exceed and no other tenant can evict. Tenants not listed share the
    /// engine's main arena. Env/flag form: `a=8GiB,b=2GiB`.
    #[serde(deserialize_with = "quota_map")]
    pub tenant_dram_quota: BTreeMap<String, u64>,
    /// Per-tenant SSD quota for tenants with a DRAM partition: the partition's segment log is
    /// bounded by it instead of the engine's `ssd_capacity_bytes`. Same forms as the DRAM one.
    #[serde(deserialize_with = "quota_map")]
    pub tenant_ssd_quota: BTreeMap<String, u64>,
    /// Tenants bound to credentials: a tenant listed here may be opened only by a peer whose
    /// `SO_PEERCRED` uid or gid is listed (`"uid:1001 gid:2000"`), or by an operator. Tenants
    /// not listed are accounting labels any connecting process may use. Env/flag form:
    /// `team-a=uid:1001 gid:2000,team-b=uid:1002`.
    #[serde(deserialize_with = "access_map")]
    pub tenant_access: BTreeMap<String, Vec<Principal>>,
    /// Uids besides the server's own and root that count as operators: they alone see every
    /// session in `Stats` and may `Inspect`, and may open any tenant. Comma-separated.
    #[serde(deserialize_with = "strict::optional_string")]
    pub operator_uids: Option<String>,
    /// Serve Prometheus metrics at `http://HOST:PORT/metrics` (port 0: a free port, printed
    /// at startup). When unset, the engine key `metrics_addr` (`KVTIER_METRICS_ADDR`, the
    /// `[engine]` table) is taken instead.
    #[serde(deserialize_with = "strict::optional_socket_addr")]
    pub metrics_addr: Option<String>,
    // Issue 30: the host KV-event stream (crate::events); off unless the endpoint is named.
    /// PUB endpoint of the host KV-event stream, `tcp://IP:PORT` (port 0: a free one).
    #[serde(deserialize_with = "strict::optional_string")]
    pub host_events_endpoint: Option<String>,
    /// ROUTER replay endpoint of the stream, `tcp://IP:PORT`.
    #[serde(deserialize_with = "strict::optional_string")]
    pub host_events_replay_endpoint: Option<String>,
    /// Topic frame of every batch.
    #[serde(deserialize_with = "strict::string")]
    pub host_events_topic: String,
    /// Batches kept for replay.
    #[serde(deserialize_with = "strict::count")]
    pub host_events_buffer_batches: u64,
    /// Most connections per endpoint (subscribers; replay clients).
    #[serde(deserialize_with = "strict::count")]
    pub host_events_max_subscribers: u64,
    /// Batches queued per subscriber before it loses batches (it then replays).
    #[serde(deserialize_with = "strict::count")]
    pub host_events_subscriber_queue: u64,
    /// Milliseconds between two batches (what the engines recorded meanwhile).
    #[serde(deserialize_with = "strict::count")]
    pub host_events_interval_ms: u64,
    /// Events each engine's ring holds between two drains.
    #[serde(deserialize_with = "strict::count")]
    pub host_events_engine_ring: u64,
    /// The node named in every event's `ownership` (`kvtier:<node>`); default: the cluster
    /// `node_id`, else the host name.
    #[serde(deserialize_with = "strict::optional_string")]
    pub host_events_node: Option<String>,
}

impl Default for ServerSettings {
    fn default() -> Self {
        ServerSettings {
            socket: None,
            socket_mode: "0600".into(),
            socket_group: None,
            max_connections: 1024,
            max_regions_per_client: 4096,
            max_mapped_bytes_per_client: physical_memory() / 2,
            max_mapped_bytes_total: physical_memory(),
            max_connections_per_uid: 256,
            max_mapped_bytes_per_uid: physical_memory() / 2,
            handshake_timeout_ms: 10_000,
            prefault_regions: true,
            tenant_dram_quota: BTreeMap::new(),
            tenant_ssd_quota: BTreeMap::new(),
            tenant_access: BTreeMap::new(),
            host_events_endpoint: None,
            host_events_replay_endpoint: None,
            host_events_topic: String::new(),
            host_events_buffer_batches: 10_000,
            host_events_max_subscribers: 64,
            host_events_subscriber_queue: 1024,
            host_events_interval_ms: 50,
            host_events_engine_ring: 1 << 20,
            host_events_node: None,
            operator_uids: None,
            metrics_addr: None,
        }
    }
}

/// The host's physical memory (`MemTotal`), the base of the default mapping limits; 64 GiB
/// when /proc/meminfo cannot be read.
pub fn physical_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("MemTotal:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
        })
        .map_or(64 << 30, |kib| kib << 10)
}

/// A peer identity a tenant is bound to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Principal {
    Uid(u32),
    Gid(u32),
}

impl Principal {
    fn parse(text: &str) -> Result<Principal, String> {
        let (kind, id) = text
            .split_once(':')
            .ok_or_else(|| format!("{text:?} is not uid:N or gid:N"))?;
        let id: u32 = id
            .parse()
            .map_err(|_| format!("{text:?}: {id:?} is not a numeric id"))?;
        match kind {
            "uid" => Ok(Principal::Uid(id)),
            "gid" => Ok(Principal::Gid(id)),
            _ => Err(format!("{text:?} is not uid:N or gid:N")),
        }
    }

    /// Whether a peer with `uid`/`gid` is this principal.
    pub fn matches(&self, uid: u32, gid: u32) -> bool {
        match *self {
            Principal::Uid(u) => u == uid,
            Principal::Gid(g) => g == gid,
        }
    }
}

fn access_map<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, Vec<Principal>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Text(String),
        Table(BTreeMap<String, String>),
    }
    let parse_list = |tenant: &str, list: &str| -> Result<Vec<Principal>, D::Error> {
        let principals = list
            .split_whitespace()
            .map(Principal::parse)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| de::Error::custom(format!("tenant {tenant}: {e}")))?;
        if principals.is_empty() {
            return Err(de::Error::custom(format!(
                "tenant {tenant}: no uid:N or gid:N given"
            )));
        }
        Ok(principals)
    };
    let mut out = BTreeMap::new();
    match Raw::deserialize(d)? {
        Raw::Table(table) => {
            for (tenant, list) in &table {
                out.insert(tenant.clone(), parse_list(tenant, list)?);
            }
        }
        Raw::Text(text) => {
            for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let (tenant, list) = item.split_once('=').ok_or_else(|| {
                    de::Error::custom(format!("{item:?} is not tenant=uid:N ..."))
                })?;
                out.insert(tenant.trim().to_string(), parse_list(tenant, list)?);
            }
        }
    }
    Ok(out)
}

fn quota_map<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Text(String),
        Table(BTreeMap<String, Value>),
    }
    let parse = |name: &str, v: &Value| -> Result<u64, D::Error> {
        match v {
            Value::Number(n) => n
                .as_u64()
                .ok_or_else(|| de::Error::custom(format!("quota of {name}: {n} is not a size"))),
            Value::String(s) => strict::parse_unsigned(s, true)
                .map_err(|e| de::Error::custom(format!("quota of {name}: {e}"))),
            other => Err(de::Error::custom(format!(
                "quota of {name}: {other} is not a size"
            ))),
        }
    };
    let mut out = BTreeMap::new();
    match Raw::deserialize(d)? {
        Raw::Table(table) => {
            for (name, v) in &table {
                out.insert(name.clone(), parse(name, v)?);
            }
        }
        Raw::Text(text) => {
            for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                let (name, size) = item
                    .split_once('=')
                    .ok_or_else(|| de::Error::custom(format!("{item:?} is not tenant=size")))?;
                out.insert(
                    name.trim().to_string(),
                    parse(name, &Value::String(size.trim().into()))?,
                );
            }
        }
    }
    Ok(out)
}

/// The whole configuration of one `kvtier serve`.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerConfig {
    pub settings: ServerSettings,
    pub engine: KvtierConfig,
    /// Resolved socket path.
    pub socket: PathBuf,
    /// Resolved socket mode bits.
    pub socket_mode: u32,
}

/// Raw inputs of [`ServerConfig::load`].
#[derive(Clone, Debug, Default)]
pub struct ServerSources {
    pub file: Option<PathBuf>,
    pub env: Vec<(String, String)>,
    /// Server keys from flags.
    pub flags: Map<String, Value>,
    /// Engine keys from flags (`--engine key=value`).
    pub engine_flags: Map<String, Value>,
}

/// The keys of [`ServerSettings`] (top level or `[server]` of `kvtier serve`'s file).
pub fn known_server_keys() -> Vec<String> {
    match serde_json::to_value(ServerSettings::default()) {
        Ok(Value::Object(map)) => map.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// The default socket: `$XDG_RUNTIME_DIR/kvtier.sock` (a per-user 0700 directory the login
/// manager creates), else `kvtier.sock` in [`private_runtime_dir`].
fn default_socket() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => Path::new(&dir).join("kvtier.sock"),
        _ => private_runtime_dir().join("kvtier.sock"),
    }
}

/// `/tmp/kvtier-<uid>`: the per-user directory of the default socket when there is no
/// `$XDG_RUNTIME_DIR`. [`ensure_private_dir`] creates it 0700 and refuses one another user
/// planted (its path is predictable, so it must be checked, not trusted).
pub fn private_runtime_dir() -> PathBuf {
    PathBuf::from(format!(
        "/tmp/kvtier-{}",
        rustix::process::geteuid().as_raw()
    ))
}

/// Issue 26: settle the default socket of `config` (no `socket` configured) before binding:
/// its directory [`private_runtime_dir`] is created 0700 and checked; when that fails (another
/// user created `/tmp/kvtier-<uid>` first, or a file or symlink is in the way) the socket
/// moves to `/run/user/<uid>` if that is this user's private directory, else to a fresh
/// `$TMPDIR/kvtier-<uid>-XXXXXXXX` (0700). Returns the notice saying where (for stderr), or
/// `None` when the default stands. A configured socket is left alone.
pub fn resolve_default_socket(
    config: &mut ServerConfig,
) -> Result<Option<String>, crate::server::ServerError> {
    if config.settings.socket.is_some() {
        return Ok(None);
    }
    let Some(dir) = config
        .socket
        .parent()
        .filter(|d| *d == private_runtime_dir())
        .map(Path::to_path_buf)
    else {
        return Ok(None);
    };
    let Err(problem) = ensure_private_dir(&dir) else {
        return Ok(None);
    };
    let uid = rustix::process::geteuid().as_raw();
    let run_user = PathBuf::from(format!("/run/user/{uid}"));
    let fallback = if run_user.is_dir() && ensure_private_dir(&run_user).is_ok() {
        run_user
    } else {
        kvtier_engine::private_dir::create_fresh_private_dir(
            &std::env::temp_dir(),
            &format!("kvtier-{uid}"),
        )
        .map_err(|source| crate::server::ServerError::Socket {
            path: config.socket.clone(),
            source,
        })?
    };
    config.socket = fallback.join("kvtier.sock");
    Ok(Some(format!(
        "the default socket directory cannot be used ({problem}); the socket is {} instead \
         (clients: server_socket = \"{}\"; set socket / --socket to choose one)",
        config.socket.display(),
        config.socket.display()
    )))
}

/// Create `dir` with mode 0700 if it is missing, then check it is a real directory (not a
/// symlink) owned by this uid and not accessible to group or others.
pub fn ensure_private_dir(dir: &Path) -> std::io::Result<()> {
    // Issue 16: the check is shared with the SSD tier's directory; 0o077 = no access at all.
    kvtier_engine::private_dir::ensure_private_dir(dir, 0o077)
}

impl ServerConfig {
    pub fn load(sources: ServerSources) -> Result<ServerConfig, ConfigError> {
        let known = known_server_keys();
        let mut merged = Map::new();
        let mut origins: BTreeMap<String, Origin> = BTreeMap::new();
        let mut engine_base = Map::new();
        let mut engine_origin = Origin::Default;
        if let Some(path) = &sources.file {
            let origin = Origin::File(path.clone());
            let mut file = read_toml(path, &origin)?;
            // Issue 16: `[server]` holds this server's own keys (top-level keys still work);
            // `[cluster]` and `[events]` go to the engine schema like its `[engine.cluster]`.
            let own = file.remove(SERVER_TABLE);
            let mut moved = Vec::new();
            for section in ENGINE_SIDE_TABLES {
                if let Some(table) = file.remove(*section) {
                    moved.push((*section, table));
                }
            }
            for (key, value) in file {
                if key == ENGINE_TABLE {
                    match value {
                        Value::Object(table) => {
                            engine_base = table;
                            engine_origin = origin.clone();
                        }
                        other => {
                            return Err(ConfigError::new(
                                ENGINE_TABLE,
                                &origin,
                                format!("must be a table of engine keys, got {other}"),
                            ))
                        }
                    }
                    continue;
                }
                origins.insert(key.clone(), origin.clone());
                merged.insert(key, value);
            }
            for (section, table) in moved {
                if engine_base.contains_key(section) {
                    return Err(ConfigError::new(
                        section,
                        &origin,
                        format!(
                            "given twice, as `[{section}]` and as `[{ENGINE_TABLE}.{section}]`; keep one"
                        ),
                    ));
                }
                engine_base.insert(section.to_string(), table);
                engine_origin = origin.clone();
            }
            match own {
                None => {}
                Some(Value::Object(table)) => {
                    for (key, value) in table {
                        if merged.contains_key(&key) {
                            return Err(ConfigError::new(
                                format!("{SERVER_TABLE}.{key}"),
                                &origin,
                                format!(
                                    "given twice, as `{key}` and as `{SERVER_TABLE}.{key}`; keep one"
                                ),
                            ));
                        }
                        origins.insert(key.clone(), origin.clone());
                        merged.insert(key, value);
                    }
                }
                Some(other) => {
                    return Err(ConfigError::new(
                        SERVER_TABLE,
                        &origin,
                        format!("must be a table of server keys, got {other}"),
                    ))
                }
            }
        }
        for (name, value) in &sources.env {
            if let Some(rest) = name.strip_prefix(SERVE_ENV_PREFIX) {
                let key = rest.to_ascii_lowercase();
                origins.insert(key.clone(), Origin::Env(name.clone()));
                merged.insert(key, Value::String(value.clone()));
            }
        }
        for (key, value) in sources.flags {
            origins.insert(key.clone(), Origin::CommandLine);
            merged.insert(key, value);
        }
        let origin_of = |key: &str| origins.get(key).cloned().unwrap_or(Origin::Default);
        for key in merged.keys() {
            if !known.iter().any(|k| k == key) {
                // Issue 27: a key of the client schema is not unknown, it is misplaced.
                let engine_key = kvtier_store::config::SECTIONS.iter().any(|(s, keys)| {
                    *s == ENGINE_TABLE && keys.iter().any(|(_, f)| *f == key.as_str())
                });
                let reason = if engine_key {
                    format!("an engine key: in kvtier serve's file it goes in the [{ENGINE_TABLE}] table")
                } else if KvtierConfig::known_keys().iter().any(|k| k == key) {
                    "a client key: it belongs in a store's configuration (extra_config, \
                     config_file), not in kvtier serve's file"
                        .to_string()
                } else {
                    format!(
                        "unknown server key; known keys are: {} (engine keys go in [{ENGINE_TABLE}])",
                        known.join(", ")
                    )
                };
                return Err(ConfigError::new(key.clone(), &origin_of(key), reason));
            }
        }
        for (key, value) in &merged {
            let mut single = Map::new();
            single.insert(key.clone(), value.clone());
            if let Err(e) = serde_json::from_value::<ServerSettings>(Value::Object(single)) {
                return Err(ConfigError::new(
                    key.clone(),
                    &origin_of(key),
                    e.to_string(),
                ));
            }
        }
        let mut settings: ServerSettings = serde_json::from_value(Value::Object(merged))
            .map_err(|e| ConfigError::new("<server config>", &Origin::Default, e.to_string()))?;

        let socket_mode = u32::from_str_radix(settings.socket_mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777 && m & 0o600 == 0o600)
            .ok_or_else(|| {
                ConfigError::new(
                    "socket_mode",
                    &origin_of("socket_mode"),
                    format!(
                        "{:?} must be octal permission bits with owner read+write (e.g. \"0600\", \"0660\")",
                        settings.socket_mode
                    ),
                )
            })?;
        for (tenant, quota) in &settings.tenant_dram_quota {
            if tenant.is_empty() || !kvtier_proto::namespace::is_valid_name(tenant) {
                return Err(ConfigError::new(
                    "tenant_dram_quota",
                    &origin_of("tenant_dram_quota"),
                    format!("tenant name {tenant:?} must be 1 to 128 bytes without NUL or 0x1f"),
                ));
            }
            if *quota < 1 << 20 {
                return Err(ConfigError::new(
                    "tenant_dram_quota",
                    &origin_of("tenant_dram_quota"),
                    format!("quota of {tenant} ({quota} bytes) is below 1MiB"),
                ));
            }
        }
        for tenant in settings.tenant_ssd_quota.keys() {
            if !settings.tenant_dram_quota.contains_key(tenant) {
                return Err(ConfigError::new(
                    "tenant_ssd_quota",
                    &origin_of("tenant_ssd_quota"),
                    format!(
                        "tenant {tenant:?} has no tenant_dram_quota: SSD quotas apply to \
                         tenants with their own partition"
                    ),
                ));
            }
        }
        for (key, value) in [
            ("max_connections", settings.max_connections),
            ("max_connections_per_uid", settings.max_connections_per_uid),
            (
                "max_mapped_bytes_per_client",
                settings.max_mapped_bytes_per_client,
            ),
            ("max_mapped_bytes_total", settings.max_mapped_bytes_total),
            (
                "max_mapped_bytes_per_uid",
                settings.max_mapped_bytes_per_uid,
            ),
            ("handshake_timeout_ms", settings.handshake_timeout_ms),
        ] {
            if value == 0 {
                return Err(ConfigError::new(
                    key,
                    &origin_of(key),
                    "must be at least 1 (every bound is finite)",
                ));
            }
        }
        // Issue 26: counts have an upper bound too (documented in `kvtier serve --help`).
        for (key, value, hi) in [
            ("max_connections", settings.max_connections, MAX_COUNT),
            (
                "max_connections_per_uid",
                settings.max_connections_per_uid,
                MAX_COUNT,
            ),
            (
                "max_regions_per_client",
                settings.max_regions_per_client,
                MAX_COUNT,
            ),
            (
                "handshake_timeout_ms",
                settings.handshake_timeout_ms,
                MAX_HANDSHAKE_TIMEOUT_MS,
            ),
        ] {
            if !(1..=hi).contains(&value) {
                return Err(ConfigError::new(
                    key,
                    &origin_of(key),
                    format!("{value} is outside the range 1..={hi}"),
                ));
            }
        }
        check_host_events(&settings, &origin_of)?;
        check_operator_uids(&settings, &origin_of)?;
        // Engine keys: file [engine] < KVTIER_* env < --engine flags, parsed by kvtier's schema.
        let (mut engine, engine_origins) = KvtierConfig::load_layered(
            engine_base,
            engine_origin,
            ConfigSources {
                env: sources.env.clone(),
                extra: sources.engine_flags,
            },
        )?;
        // Issue 27: client keys in the server's own engine settings (its file, --engine
        // flags) do nothing; say where they go. A client's KVTIER_CONFIG_FILE the server
        // inherits is shared with clients, so its client keys are not the server's to refuse.
        let own: BTreeMap<String, Origin> = engine_origins
            .into_iter()
            .filter(|(_, origin)| {
                *origin == Origin::ExtraConfig
                    || sources
                        .file
                        .as_ref()
                        .is_some_and(|f| *origin == Origin::File(f.clone()))
            })
            .collect();
        engine.check_applicable(&own, kvtier_store::config::Role::Server)?;
        // The server is the store: it never runs in server mode itself.
        engine.server_socket = None;
        engine.server_auto_start = false;
        // One endpoint for the whole server, whichever schema named it.
        if settings.metrics_addr.is_none() {
            settings.metrics_addr = engine.metrics_addr.take();
        }
        engine.metrics_addr = None;
        let socket = settings
            .socket
            .as_ref()
            .map(PathBuf::from)
            .unwrap_or_else(default_socket);
        let config = ServerConfig {
            settings,
            engine,
            socket,
            socket_mode,
        };
        // A partition's SSD quota must still hold the segments the engine needs.
        for (tenant, dram) in &config.settings.tenant_dram_quota {
            if !config.settings.tenant_ssd_quota.contains_key(tenant) {
                continue;
            }
            if let Err(kvtier_engine::EngineError::InvalidConfig { key, reason }) =
                config.partition_config(tenant, *dram).engine.validate()
            {
                return Err(ConfigError::new(
                    "tenant_ssd_quota",
                    &origin_of("tenant_ssd_quota"),
                    format!("tenant {tenant:?}: {key}: {reason}"),
                ));
            }
        }
        Ok(config)
    }

    /// Whether the peer `uid` is an operator: the server's own uid, root, or `operator_uids`.
    pub fn is_operator(&self, uid: u32) -> bool {
        uid == 0
            || uid == rustix::process::geteuid().as_raw()
            || self.settings.operator_uids.as_deref().is_some_and(|list| {
                list.split(',')
                    .filter_map(|u| u.trim().parse::<u32>().ok())
                    .any(|u| u == uid)
            })
    }

    /// Whether the peer `uid`/`gid` may open `tenant`: any peer for a tenant not in
    /// `tenant_access`, else a listed principal or an operator.
    pub fn may_open_tenant(&self, tenant: &str, uid: u32, gid: u32) -> bool {
        match self.settings.tenant_access.get(tenant) {
            None => true,
            Some(principals) => {
                self.is_operator(uid) || principals.iter().any(|p| p.matches(uid, gid))
            }
        }
    }

    /// The engine configuration of tenant partition `tenant`: its quota as DRAM capacity and,
    /// when the SSD tier is on, its own segment directory `<subdir>/tenant-<name>`, bounded by
    /// its `tenant_ssd_quota` (else by the engine's `ssd_capacity_bytes`).
    pub fn partition_config(&self, tenant: &str, quota: u64) -> KvtierConfig {
        let mut config = self.engine.clone();
        config.master_address = None;
        config.engine.dram_capacity_bytes = quota.max(u64::from(config.engine.dram_block_size));
        let safe = !tenant.is_empty()
            && tenant != "."
            && tenant != ".."
            && tenant
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        let name = if safe {
            tenant.to_string()
        } else {
            tenant.bytes().map(|b| format!("{b:02x}")).collect()
        };
        if let Some(ssd_quota) = self.settings.tenant_ssd_quota.get(tenant) {
            config.engine.ssd_capacity_bytes = *ssd_quota;
        }
        let dir = format!("tenant-{name}");
        config.engine.ssd_storage_subdir = Some(match &self.engine.engine.ssd_storage_subdir {
            Some(sub) => format!("{sub}/{dir}"),
            None => dir,
        });
        config
    }
}

/// `operator_uids`: comma-separated numeric uids.
fn check_operator_uids(
    settings: &ServerSettings,
    origin_of: &dyn Fn(&str) -> Origin,
) -> Result<(), ConfigError> {
    if let Some(list) = &settings.operator_uids {
        if list
            .split(',')
            .map(str::trim)
            .any(|u| u.parse::<u32>().is_err())
        {
            return Err(ConfigError::new(
                "operator_uids",
                &origin_of("operator_uids"),
                format!("{list:?} must be comma-separated numeric uids"),
            ));
        }
    }
    Ok(())
}

/// Issue 30: the host KV-event stream's keys: bounds, endpoints (IP literals), and a replay
/// endpoint only with the stream it replays.
fn check_host_events(
    settings: &ServerSettings,
    origin_of: &dyn Fn(&str) -> Origin,
) -> Result<(), ConfigError> {
    for (key, value, hi) in [
        (
            "host_events_buffer_batches",
            settings.host_events_buffer_batches,
            kvtier_events::MAX_BUFFER_BATCHES,
        ),
        (
            "host_events_max_subscribers",
            settings.host_events_max_subscribers,
            kvtier_events::MAX_SUBSCRIBERS,
        ),
        (
            "host_events_subscriber_queue",
            settings.host_events_subscriber_queue,
            kvtier_events::MAX_SUBSCRIBER_QUEUE,
        ),
        (
            "host_events_interval_ms",
            settings.host_events_interval_ms,
            60_000,
        ),
        (
            "host_events_engine_ring",
            settings.host_events_engine_ring,
            1 << 26,
        ),
    ] {
        if !(1..=hi).contains(&value) {
            return Err(ConfigError::new(
                key,
                &origin_of(key),
                format!("{value} is outside the range 1..={hi}"),
            ));
        }
    }
    for key in ["host_events_endpoint", "host_events_replay_endpoint"] {
        let value = match key {
            "host_events_endpoint" => &settings.host_events_endpoint,
            _ => &settings.host_events_replay_endpoint,
        };
        if let Some(text) = value {
            crate::events::parse_endpoint(key, text)
                .map_err(|e| ConfigError::new(key, &origin_of(key), e.to_string()))?;
        }
    }
    if settings.host_events_replay_endpoint.is_some() && settings.host_events_endpoint.is_none() {
        return Err(ConfigError::new(
            "host_events_replay_endpoint",
            &origin_of("host_events_replay_endpoint"),
            "needs host_events_endpoint (the stream it replays)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    }

    #[test]
    fn tenant_ssd_quota_bounds_the_partition_and_needs_a_dram_partition() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        let dir = tempfile_dir();
        let ssd = [
            ("KVTIER_SSD_ENABLED", "true"),
            ("KVTIER_SSD_STORAGE_DIR", dir.as_str()),
            ("KVTIER_SSD_SEGMENT_SIZE_BYTES", "16MiB"),
            ("KVTIER_DRAM_CAPACITY_BYTES", "16MiB"),
            ("KVTIER_SERVE_TENANT_DRAM_QUOTA", "a=4MiB,b=4MiB"),
        ];
        let mut vars = ssd.to_vec();
        vars.push(("KVTIER_SERVE_TENANT_SSD_QUOTA", "a=64MiB"));
        let c = ServerConfig::load(ServerSources {
            env: env(&vars),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            c.partition_config("a", 4 << 20).engine.ssd_capacity_bytes,
            64 << 20
        );
        assert_eq!(
            c.partition_config("b", 4 << 20).engine.ssd_capacity_bytes,
            c.engine.engine.ssd_capacity_bytes
        );

        let mut vars = ssd.to_vec();
        vars.push(("KVTIER_SERVE_TENANT_SSD_QUOTA", "c=64MiB"));
        let e = ServerConfig::load(ServerSources {
            env: env(&vars),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.key, "tenant_ssd_quota");
        assert!(e.reason.contains("\"c\""), "{e}");

        // 16 MiB holds one 16 MiB segment; the engine needs at least two.
        let mut vars = ssd.to_vec();
        vars.push(("KVTIER_SERVE_TENANT_SSD_QUOTA", "a=16MiB"));
        let e = ServerConfig::load(ServerSources {
            env: env(&vars),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.key, "tenant_ssd_quota");
    }

    fn tempfile_dir() -> String {
        let dir = std::env::temp_dir().join(format!("kvtier-server-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.to_string_lossy().into_owned()
    }

    #[test]
    fn metrics_addr_comes_from_the_server_or_the_engine_keys() {
        let c = ServerConfig::load(ServerSources {
            env: env(&[("KVTIER_METRICS_ADDR", "127.0.0.1:0")]),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(c.settings.metrics_addr.as_deref(), Some("127.0.0.1:0"));
        assert_eq!(
            c.engine.metrics_addr, None,
            "the stores never bind their own"
        );
        let mut flags = Map::new();
        flags.insert("metrics_addr".into(), json!("127.0.0.1:9100"));
        let c = ServerConfig::load(ServerSources {
            env: env(&[("KVTIER_METRICS_ADDR", "127.0.0.1:0")]),
            flags,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(c.settings.metrics_addr.as_deref(), Some("127.0.0.1:9100"));
        let e = ServerConfig::load(ServerSources {
            env: env(&[("KVTIER_SERVE_METRICS_ADDR", "not-an-address")]),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.key, "metrics_addr");
        assert!(e.origin.contains("KVTIER_SERVE_METRICS_ADDR"), "{e}");
    }

    #[test]
    fn layers_and_strictness() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serve.toml");
        std::fs::write(
            &path,
            "socket = \"/tmp/x.sock\"\nsocket_mode = \"0660\"\ntenant_dram_quota = { a = \"4MiB\" }\n[engine]\ndram_capacity_bytes = \"8MiB\"\n",
        )
        .unwrap();
        let c = ServerConfig::load(ServerSources {
            file: Some(path.clone()),
            env: env(&[
                ("KVTIER_SERVE_MAX_CONNECTIONS", "7"),
                ("KVTIER_DRAM_CAPACITY_BYTES", "16MiB"),
                ("KVTIER_SERVER_SOCKET", "/ignored"),
            ]),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(c.socket, PathBuf::from("/tmp/x.sock"));
        assert_eq!(c.socket_mode, 0o660);
        assert_eq!(c.settings.max_connections, 7);
        assert_eq!(c.settings.tenant_dram_quota.get("a"), Some(&(4 << 20)));
        assert_eq!(
            c.engine.engine.dram_capacity_bytes,
            16 << 20,
            "env beats the file"
        );
        assert_eq!(c.engine.server_socket, None);

        let e = ServerConfig::load(ServerSources {
            env: env(&[("KVTIER_SERVE_SOCKET_MOD", "0600")]),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.key, "socket_mod");
        for bad in ["0400", "999", "rw"] {
            let mut flags = Map::new();
            flags.insert("socket_mode".into(), json!(bad));
            let e = ServerConfig::load(ServerSources {
                flags,
                ..Default::default()
            })
            .unwrap_err();
            assert_eq!(e.key, "socket_mode", "{bad}");
        }
        let e = ServerConfig::load(ServerSources {
            env: env(&[("KVTIER_SERVE_TENANT_DRAM_QUOTA", "a=lots")]),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.key, "tenant_dram_quota");
        let c = ServerConfig::load(ServerSources {
            env: env(&[("KVTIER_SERVE_TENANT_DRAM_QUOTA", "a=2MiB, b=3MiB")]),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(c.settings.tenant_dram_quota.len(), 2);
        let mut engine_flags = Map::new();
        engine_flags.insert("dram_capacity".into(), json!("1MiB"));
        let e = ServerConfig::load(ServerSources {
            engine_flags,
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.key, "dram_capacity");
    }

    /// Issue 16: a serve file in sections loads as its flat form; a key given both ways and
    /// an unknown key in a section are errors naming them.
    #[test]
    fn serve_file_sections() {
        let dir =
            std::env::temp_dir().join(format!("kvtier-serve-sections-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let load = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            ServerConfig::load(ServerSources {
                file: Some(path),
                ..Default::default()
            })
        };
        let sectioned = load(
            "s.toml",
            "[server]\nmax_connections = 7\n[engine]\ndram_capacity_bytes = \"16MiB\"\n\
             eviction_policy = \"lru\"\n[cluster]\nrequest_timeout_ms = 55\n\
             [events]\nbuffer = 9\n",
        )
        .unwrap();
        let flat = load(
            "f.toml",
            "max_connections = 7\n[engine]\ndram_capacity_bytes = \"16MiB\"\n\
             eviction_policy = \"lru\"\ncluster_request_timeout_ms = 55\nkv_events_buffer = 9\n",
        )
        .unwrap();
        assert_eq!(sectioned, flat);
        assert_eq!(sectioned.settings.max_connections, 7);
        assert_eq!(sectioned.engine.cluster_request_timeout_ms, 55);
        assert_eq!(sectioned.engine.kv_events_buffer, 9);

        let e = load(
            "twice.toml",
            "max_connections = 1\n[server]\nmax_connections = 2\n",
        )
        .unwrap_err();
        assert_eq!(e.key, "server.max_connections");
        assert!(e.reason.contains("`max_connections`"), "{e}");
        let e = load(
            "twice2.toml",
            "[cluster]\ntoken = \"a\"\n[engine.cluster]\ntoken = \"b\"\n",
        )
        .unwrap_err();
        assert_eq!(e.key, "cluster");
        let e = load(
            "twice3.toml",
            "[engine]\nkv_events_buffer = 1\n[events]\nbuffer = 2\n",
        )
        .unwrap_err();
        assert_eq!(e.key, "events.buffer", "{e}");
        let e = load("unknown.toml", "[server]\nnope = 1\n").unwrap_err();
        assert_eq!(e.key, "nope");
        let e = load("unknown2.toml", "[events]\nnope = 1\n").unwrap_err();
        assert_eq!(e.key, "events.nope");
        let e = load("bad.toml", "[cluster]\nrequest_timeout_ms = \"soon\"\n").unwrap_err();
        assert_eq!(e.key, "cluster.request_timeout_ms");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
