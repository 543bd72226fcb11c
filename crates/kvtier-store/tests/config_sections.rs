//! Issue 16: configuration by audience. The `[engine]`, `[server]`, `[cluster]` and `[events]`
//! sections, the flat keys they replace (still accepted), and the errors: a key given both
//! ways, an unknown key in each section, a bad value, each naming the spelling used. Also the
//! round trips the server and the Python module rely on (`to_toml` / `to_sectioned_toml`).
#![allow(clippy::unwrap_used)]

use kvtier_store::config::{sectioned_name, unsection, Origin, SECTIONS};
use kvtier_store::{ConfigError, ConfigSources, KvtierConfig};
use serde_json::{json, Map, Value};

fn extra(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => panic!("not an object"),
    }
}

/// The schema without the check that every key applies to the mode (issue 27): these tests
/// are about spellings, and give every section's keys in one configuration.
fn load_any(sources: ConfigSources) -> Result<KvtierConfig, ConfigError> {
    KvtierConfig::load_layered(Map::new(), Origin::Default, sources).map(|(c, _)| c)
}

fn load_extra(v: Value) -> Result<KvtierConfig, ConfigError> {
    load_any(ConfigSources {
        env: Vec::new(),
        extra: extra(v),
    })
}

fn load_file(text: &str) -> Result<KvtierConfig, ConfigError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvtier.toml");
    std::fs::write(&path, text).unwrap();
    load_any(ConfigSources {
        env: Vec::new(),
        extra: extra(json!({ "config_file": path.to_str().unwrap() })),
    })
}

const SECTIONED: &str = r#"
extra_backend_tag = "team-a"

[engine]
dram_capacity_bytes = "64MiB"
eviction_policy = "lru"
ssd_enabled = false

[server]
startup_timeout_ms = 1234
staging_bytes = "2MiB"

[cluster]
request_timeout_ms = 777
transport = "tcp"

[events]
subscriber = true
topic = "kv"
buffer = 99
"#;

const FLAT: &str = r#"
extra_backend_tag = "team-a"
dram_capacity_bytes = "64MiB"
eviction_policy = "lru"
ssd_enabled = false
server_startup_timeout_ms = 1234
server_staging_bytes = "2MiB"
cluster_request_timeout_ms = 777
cluster_transport = "tcp"
kv_events_subscriber = true
kv_events_topic = "kv"
kv_events_buffer = 99
"#;

#[test]
fn sectioned_and_flat_forms_give_the_same_config() {
    let sectioned = load_file(SECTIONED).unwrap();
    let flat = load_file(FLAT).unwrap();
    assert_eq!(sectioned, flat);
    assert_eq!(sectioned.engine.dram_capacity_bytes, 64 << 20);
    assert_eq!(sectioned.server_startup_timeout_ms, 1234);
    assert_eq!(sectioned.cluster_request_timeout_ms, 777);
    assert!(sectioned.kv_events_subscriber);
    assert_eq!(sectioned.kv_events_buffer, 99);
    assert_ne!(sectioned, KvtierConfig::default());
}

#[test]
fn extra_config_json_takes_sections_and_flat_keys_together() {
    // SGLang's extra_config: a flat dict, or nested dicts for sections.
    let c = load_extra(json!({
        "dram_capacity_bytes": "32MiB",
        "events": { "subscriber": "yes", "endpoint": "tcp://127.0.0.1:6000" },
        "cluster": { "transport": "tcp" },
    }))
    .unwrap();
    assert_eq!(c.engine.dram_capacity_bytes, 32 << 20);
    assert!(c.kv_events_subscriber);
    assert_eq!(c.kv_events_endpoint, "tcp://127.0.0.1:6000");
    // A later layer overrides an earlier one whatever the spelling: file sectioned, extra flat.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k.toml");
    std::fs::write(&path, "[events]\ntopic = \"from-file\"\n").unwrap();
    let c = KvtierConfig::load(ConfigSources {
        env: vec![("KVTIER_KV_EVENTS_BUFFER".into(), "5".into())],
        extra: extra(json!({
            "config_file": path.to_str().unwrap(),
            "kv_events_topic": "from-extra",
        })),
    })
    .unwrap();
    assert_eq!(c.kv_events_topic, "from-extra");
    assert_eq!(c.kv_events_buffer, 5);
}

#[test]
fn a_key_given_flat_and_in_its_section_names_both_spellings() {
    for (text, flat, sectioned) in [
        (
            "dram_capacity_bytes = \"64MiB\"\n[engine]\ndram_capacity_bytes = \"32MiB\"\n",
            "dram_capacity_bytes",
            "engine.dram_capacity_bytes",
        ),
        (
            "server_socket = \"/tmp/a.sock\"\n[server]\nsocket = \"/tmp/b.sock\"\n",
            "server_socket",
            "server.socket",
        ),
        (
            "cluster_token = \"a\"\n[cluster]\ntoken = \"b\"\n",
            "cluster_token",
            "cluster.token",
        ),
        (
            "kv_events_topic = \"a\"\n[events]\ntopic = \"b\"\n",
            "kv_events_topic",
            "events.topic",
        ),
    ] {
        let err = load_file(text).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("`{flat}`")) && msg.contains(&format!("`{sectioned}`")),
            "{msg}"
        );
    }
    let err = load_extra(json!({
        "kv_events_subscriber": true,
        "events": { "subscriber": false },
    }))
    .unwrap_err();
    assert_eq!(err.key, "events.subscriber");
    assert!(err.to_string().contains("`kv_events_subscriber`"), "{err}");
}

#[test]
fn an_unknown_key_in_each_section_is_named() {
    for (section, _) in SECTIONS {
        let err = load_file(&format!("[{section}]\nbogus_key = 1\n")).unwrap_err();
        assert_eq!(err.key, format!("{section}.bogus_key"), "{err}");
        assert!(err.to_string().contains("unknown key"), "{err}");
        let err = load_extra(json!({ *section: { "nope": true } })).unwrap_err();
        assert_eq!(err.key, format!("{section}.nope"), "{err}");
        // A section must be a table.
        let err = load_extra(json!({ *section: 3 })).unwrap_err();
        assert_eq!(err.key, *section, "{err}");
    }
    // A flat key in the wrong section is unknown there, not silently accepted.
    let err = load_file("[events]\ndram_capacity_bytes = 1\n").unwrap_err();
    assert_eq!(err.key, "events.dram_capacity_bytes");
    // Unknown top-level keys are still refused and point at the sections.
    let err = load_extra(json!({ "nosuch": 1 })).unwrap_err();
    assert_eq!(err.key, "nosuch");
    assert!(err.to_string().contains("[events]"), "{err}");
}

#[test]
fn a_bad_value_names_the_key_as_spelled() {
    for (text, key) in [
        ("[engine]\nssd_enabled = \"maybe\"\n", "engine.ssd_enabled"),
        (
            "[engine]\ndram_capacity_bytes = \"lots\"\n",
            "engine.dram_capacity_bytes",
        ),
        ("[server]\nauto_start = 7\n", "server.auto_start"),
        (
            "[cluster]\nconnections_per_peer = -1\n",
            "cluster.connections_per_peer",
        ),
        ("[events]\nbuffer = \"x\"\n", "events.buffer"),
        // Range checks after parsing, too.
        ("[events]\nbuffer = 0\n", "events.buffer"),
        (
            "[cluster]\nrequest_timeout_ms = 0\n",
            "cluster.request_timeout_ms",
        ),
        ("[events]\nendpoint = \"http://x\"\n", "events.endpoint"),
        ("kv_events_buffer = 0\n", "kv_events_buffer"),
    ] {
        let err = load_file(text).unwrap_err();
        assert_eq!(err.key, key, "{text}: {err}");
        assert!(err.origin.contains("config file"), "{err}");
    }
}

#[test]
fn every_section_key_maps_to_a_known_flat_key_once() {
    let known = KvtierConfig::known_keys();
    let mut seen = std::collections::BTreeSet::new();
    for (section, keys) in SECTIONS {
        for (name, flat) in *keys {
            assert!(
                known.iter().any(|k| k == flat),
                "{section}.{name} -> {flat}"
            );
            assert!(seen.insert(*flat), "{flat} in two sections");
            assert_eq!(sectioned_name(flat).unwrap(), format!("{section}.{name}"));
        }
    }
    assert_eq!(sectioned_name("metrics_addr"), None);
    // unsection leaves flat keys alone and reports spellings.
    let (flat, spelled) = unsection(
        extra(json!({ "a": 1, "events": { "topic": "t" } })),
        &Origin::ExtraConfig,
    )
    .unwrap();
    assert_eq!(flat.get("kv_events_topic"), Some(&json!("t")));
    assert_eq!(spelled.get("kv_events_topic").unwrap(), "events.topic");
    assert_eq!(spelled.get("a").unwrap(), "a");
}

#[test]
fn effective_config_round_trips_flat_and_sectioned() {
    let c = load_file(SECTIONED).unwrap();
    // Flat TOML (`config_toml()`, `kvtier config check`): every key at top level.
    let flat = c.to_toml();
    assert!(flat.contains("eviction_policy = \"lru\""), "{flat}");
    assert!(!flat.contains("[engine]"), "{flat}");
    assert_eq!(load_file(&flat).unwrap(), c);
    // Sectioned TOML loads back to the same configuration.
    let sectioned = c.to_sectioned_toml();
    for (section, _) in SECTIONS {
        assert!(sectioned.contains(&format!("[{section}]")), "{sectioned}");
    }
    assert!(sectioned.contains("subscriber = true"), "{sectioned}");
    assert_eq!(load_file(&sectioned).unwrap(), c);
    // And through extra_config JSON, as the Python module passes it.
    let table: toml::Table = toml::from_str(&sectioned).unwrap();
    let json = serde_json::to_value(table).unwrap();
    assert_eq!(load_extra(json).unwrap(), c);
}
