"""Issue 16: configuration by audience through the Python entry points.

SGLang's extra_config may group kvtier keys in ``engine`` / ``server`` / ``cluster`` /
``events`` dicts (the TOML sections) or keep them flat; a key given both ways, an unknown key in
a section and a bad value are ``ValueError``s naming the spelling used.
"""

import json
import tomllib

import pytest

from kvtier import _native
from kvtier.sglang import KvtierStore
from kvtier_dev.harness.pools import make_storage_config

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}


def extra(**kw):
    return {**DYNAMIC, "interface_v1": 1, **kw}


def check(cfg):
    return tomllib.loads(_native.Store.check_config(json.dumps(cfg), False))


def test_sections_and_flat_keys_give_the_same_config():
    sectioned = check(
        {
            "engine": {"dram_capacity_bytes": "32MiB", "eviction_policy": "lru"},
            "events": {"buffer": 77, "topic": "t"},
        }
    )
    flat = check(
        {
            "dram_capacity_bytes": "32MiB",
            "eviction_policy": "lru",
            "kv_events_buffer": 77,
            "kv_events_topic": "t",
        }
    )
    assert sectioned == flat
    assert sectioned["dram_capacity_bytes"] == 32 << 20
    assert sectioned["kv_events_buffer"] == 77


def test_sglang_store_takes_sections_and_its_rank_subdir_default_respects_them(tmp_path):
    ec = extra(
        engine={
            "dram_capacity_bytes": "64MiB",
            "eviction_policy": "lru",
            "ssd_enabled": True,
            "ssd_storage_dir": str(tmp_path),
            "ssd_storage_subdir": "mine",
            "ssd_segment_size_bytes": "1MiB",
            "ssd_capacity_bytes": "4MiB",
        },
        events={"buffer": 123},
    )
    store = KvtierStore(make_storage_config(extra_config=ec), {})
    try:
        cfg = tomllib.loads(store._store.config_toml())
        assert cfg["eviction_policy"] == "lru"
        assert cfg["ssd_storage_subdir"] == "mine"
        assert cfg["kv_events_buffer"] == 123
    finally:
        store.close()
    assert (tmp_path / "mine").is_dir()


def test_a_key_given_both_ways_names_both_spellings():
    ec = extra(dram_capacity_bytes="64MiB", engine={"dram_capacity_bytes": "32MiB"})
    with pytest.raises(ValueError, match=r"`dram_capacity_bytes`.*`engine\.dram_capacity_bytes`"):
        KvtierStore(make_storage_config(extra_config=ec), {})


@pytest.mark.parametrize("section", ["engine", "server", "cluster", "events"])
def test_unknown_key_in_a_section_is_named(section):
    with pytest.raises(ValueError, match=rf"{section}\.no_such_key"):
        check({section: {"no_such_key": 1}})


def test_bad_value_names_the_sectioned_key():
    with pytest.raises(ValueError, match=r"events\.subscriber"):
        check({"events": {"subscriber": "maybe"}})
    with pytest.raises(ValueError, match=r"engine\.dram_capacity_bytes"):
        KvtierStore(
            make_storage_config(extra_config=extra(engine={"dram_capacity_bytes": "lots"})), {}
        )


def test_sectioned_config_file(tmp_path):
    path = tmp_path / "kvtier.toml"
    path.write_text('[engine]\ndram_capacity_bytes = "32MiB"\n[events]\nbuffer = 5\n')
    cfg = check({"config_file": str(path)})
    assert cfg["dram_capacity_bytes"] == 32 << 20 and cfg["kv_events_buffer"] == 5
