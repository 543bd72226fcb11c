//! `kvtier config check FILE`: validate a TOML configuration with kvtier's strict schema and
//! print the effective configuration (defaults filled in).
//!
//! Two kinds of file (issue 27): a client's (`config_file` / `KVTIER_CONFIG_FILE` of a store:
//! embedded, server mode or cluster mode) and `kvtier serve`'s (`--config`: server keys at top
//! level or in `[server]`, engine keys in `[engine]`). `--kind client|server` says which;
//! without it the kind is read from the keys (a `kvtier serve` key such as `socket_mode`, or a
//! client key such as `extra_backend_tag` / `[server] auto_start`), and a file that has both
//! is refused naming one of each. A key that does nothing in the file's kind and mode (an
//! engine key in a server-mode client, ...) is an error saying where it belongs. Only the file
//! and the defaults are read unless `--env` adds the process's `KVTIER_*` variables.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kvtier_client::config::{read_toml, ConfigError, ConfigSources, Origin, CONFIG_FILE_KEY};
use kvtier_client::KvtierConfig;
use kvtier_server::config::ENGINE_TABLE;
use kvtier_server::{ServerConfig, ServerSources};
use serde_json::{json, Map, Value};

/// `kvtier config ...`.
#[derive(clap::Subcommand)]
pub enum ConfigCommand {
    /// Validate a TOML config file with the same strict schema a store or server uses, and
    /// print the effective configuration. Exit status: 0 valid, 1 invalid (the error names
    /// the key), 2 other errors.
    Check(CheckArgs),
}

#[derive(clap::Args)]
pub struct CheckArgs {
    /// The TOML file.
    file: PathBuf,
    /// Which configuration FILE is: a store's (`client`: config_file / KVTIER_CONFIG_FILE)
    /// or `kvtier serve`'s (`server`: --config). Default: read from its keys.
    #[arg(long, value_enum)]
    kind: Option<Kind>,
    /// Same as --kind server.
    #[arg(long, conflicts_with = "kind")]
    server: bool,
    /// Also apply the KVTIER_* (and KVTIER_SERVE_*) environment variables of this shell.
    #[arg(long)]
    env: bool,
    /// Print {"ok", "schema", "config"} or {"ok": false, "key", "origin", "reason"} as JSON.
    #[arg(long)]
    json: bool,
}

/// Which schema a file is checked against.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Schema {
    Client,
    Server,
}

/// `--kind`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    Client,
    Server,
}

/// Keys of a client's `[server]` section that `kvtier serve`'s own `[server]` table lacks.
const CLIENT_SERVER_SECTION_ONLY: &[&str] = &[
    "auto_start",
    "bin",
    "uid",
    "startup_timeout_ms",
    "staging_bytes",
    "log_file",
];

/// The kind of `table` read from its keys: `Ok(None)` when nothing tells (engine keys only),
/// an error naming a client key and a server key when it has both.
fn infer_kind(table: &Map<String, Value>) -> Result<Option<Schema>, String> {
    let server_keys = kvtier_server::config::known_server_keys();
    let client_keys = KvtierConfig::known_keys();
    let mut server_evidence: Option<String> = None;
    let mut client_evidence: Option<String> = None;
    for (key, value) in table {
        if key == "metrics_addr" || key == ENGINE_TABLE {
            continue; // both kinds have them
        }
        if key == "server" {
            if let Value::Object(section) = value {
                for name in section.keys() {
                    if CLIENT_SERVER_SECTION_ONLY.contains(&name.as_str()) {
                        client_evidence.get_or_insert(format!("[server] {name}"));
                    } else if name != "socket" && server_keys.iter().any(|k| k == name) {
                        server_evidence.get_or_insert(format!("[server] {name}"));
                    }
                }
            }
        } else if server_keys.iter().any(|k| k == key) {
            server_evidence.get_or_insert(key.clone());
        } else if client_keys.iter().any(|k| k == key) {
            client_evidence.get_or_insert(key.clone());
        }
    }
    match (client_evidence, server_evidence) {
        (Some(c), Some(s)) => Err(format!(
            "it has a client key (`{c}`) and a `kvtier serve` key (`{s}`): a store's \
             configuration and the server's are separate files; pass --kind client or --kind \
             server to check it as one"
        )),
        (Some(_), None) => Ok(Some(Schema::Client)),
        (None, Some(_)) => Ok(Some(Schema::Server)),
        (None, None) => Ok(None),
    }
}

impl Schema {
    fn name(self) -> &'static str {
        match self {
            Schema::Client => "client",
            Schema::Server => "server",
        }
    }
}

pub fn run(command: ConfigCommand) -> Result<ExitCode, String> {
    match command {
        ConfigCommand::Check(args) => check(&args),
    }
}

fn check(args: &CheckArgs) -> Result<ExitCode, String> {
    // An unreadable file is reported by the loader below, against `config_file`.
    let table = read_toml(&args.file, &Origin::File(args.file.clone())).unwrap_or_default();
    let told = match (args.kind, args.server) {
        (Some(Kind::Server), _) | (None, true) => Some(Schema::Server),
        (Some(Kind::Client), _) => Some(Schema::Client),
        (None, false) => None,
    };
    let schema = match told {
        Some(schema) => schema,
        None => match infer_kind(&table) {
            Ok(Some(schema)) => schema,
            // Only engine keys (or nothing): `kvtier serve`'s layout when in [engine].
            Ok(None) if table.contains_key(ENGINE_TABLE) => Schema::Server,
            Ok(None) => Schema::Client,
            Err(reason) => {
                if args.json {
                    print_json(
                        &json!({"ok": false, "key": "", "origin": args.file.display().to_string(), "reason": reason}),
                    )?;
                }
                eprintln!("kvtier config check: {}: {reason}", args.file.display());
                return Ok(ExitCode::from(1));
            }
        },
    };
    let env: Vec<(String, String)> = if args.env {
        match kvtier_client::config::process_env() {
            Ok(env) => env,
            Err(e) => {
                eprintln!("kvtier config check: {e}");
                return Ok(ExitCode::from(1));
            }
        }
    } else {
        Vec::new()
    };
    let effective = match schema {
        Schema::Client => client_config(&args.file, env),
        Schema::Server => server_config(&args.file, env),
    };
    match effective {
        Ok((toml_text, json_value)) => {
            if args.json {
                print_json(&json!({"ok": true, "schema": schema.name(), "config": json_value}))?;
            } else {
                eprintln!(
                    "kvtier config check: {} is a valid {} configuration; effective configuration:",
                    args.file.display(),
                    schema.name()
                );
                print!("{toml_text}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            if args.json {
                print_json(&json!({
                    "ok": false, "schema": schema.name(), "key": e.key,
                    "origin": e.origin, "reason": e.reason,
                }))?;
            }
            eprintln!("kvtier config check: {e}");
            Ok(ExitCode::from(1))
        }
    }
}

fn print_json(v: &Value) -> Result<(), String> {
    println!(
        "{}",
        serde_json::to_string_pretty(v).map_err(|e| e.to_string())?
    );
    Ok(())
}

fn to_json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// `v` without null members (unset optional keys), which TOML cannot express.
fn without_nulls(v: &Value) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn client_config(file: &Path, env: Vec<(String, String)>) -> Result<(String, Value), ConfigError> {
    let mut extra = Map::new();
    extra.insert(CONFIG_FILE_KEY.into(), json!(file.display().to_string()));
    let config = KvtierConfig::load(ConfigSources { env, extra })?;
    Ok((config.to_toml(), to_json(&config)))
}

fn server_config(file: &Path, env: Vec<(String, String)>) -> Result<(String, Value), ConfigError> {
    let config = ServerConfig::load(ServerSources {
        file: Some(file.to_path_buf()),
        env,
        ..Default::default()
    })?;
    let mut doc = to_json(&config.settings);
    doc["socket"] = json!(config.socket.display().to_string());
    doc[ENGINE_TABLE] = to_json(&config.engine);
    // Never print the cluster token (as the client kind's `to_toml`); issue 30's server-kind
    // README block found this path printing it.
    if let Some(engine) = doc[ENGINE_TABLE].as_object_mut() {
        engine.remove("cluster_token");
    }
    let text = toml::to_string_pretty(&without_nulls(&doc)).unwrap_or_default();
    Ok((text, doc))
}
