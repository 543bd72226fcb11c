//! `kvtier config check FILE`: validate a TOML configuration with kvtier's strict schema and
//! print the effective configuration (defaults filled in).
//!
//! A file with an `[engine]` table (or `--server`) is a `kvtier serve` configuration: server
//! keys at top level, engine keys in `[engine]`. Any other file is the embedded / SGLang
//! schema (`config_file`). Only the file and the defaults are read unless `--env` adds the
//! process's `KVTIER_*` variables, as a real start would.

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
    /// Check it as a `kvtier serve` file (the default when it has an [engine] table).
    #[arg(long)]
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
    let has_engine_table = read_toml(&args.file, &Origin::File(args.file.clone()))
        .is_ok_and(|t| t.contains_key(ENGINE_TABLE));
    let schema = if args.server || has_engine_table {
        Schema::Server
    } else {
        Schema::Client
    };
    let env: Vec<(String, String)> = if args.env {
        std::env::vars().collect()
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
    let text = toml::to_string_pretty(&without_nulls(&doc)).unwrap_or_default();
    Ok((text, doc))
}
