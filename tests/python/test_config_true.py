"""Issue 26 §4 / issue 27 §2 through the Python entry points (``_native.Store``, the adapters).

- Every kvtier configuration in the README's and docs' examples (SGLang's extra_config, the
  linker's ``linker_extra_config``, vLLM's tier dict, LMCache's ``adapter_params`` and plugin
  ``config``) is parsed by ``Store.check_config``: the README's samples must be valid. (The TOML
  blocks are checked with ``kvtier config check`` in crates/kvtier-cli/tests/config_true.rs.)
- A non-UTF-8 environment variable of another program does not make ``Store()`` raise
  ``PanicException``; a ``KVTIER_*`` key whose value is not UTF-8 is a ``ValueError`` naming it.
- ``KVTIER_PYTHON`` (exported as ``kvtier bench workload`` says) is not a configuration key.
- The cluster token in extra_config (a command line) is refused, saying where to put it.
- A key that does nothing in the store's mode is a ``ValueError`` saying where it belongs.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from kvtier import _native
from kvtier.sglang import kvtier_extra_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Keys of the adapters themselves (not kvtier's schema) in the documented dicts.
VLLM_TIER_OWN = {"type", "module_path", "threads", "queue_capacity", "locality", "backpressure"}
LMCACHE_OWN = {"threads", "queue_capacity"}


def _json_after(text, flag):
    """Every JSON object given to ``flag '...'`` in ``text``."""
    out = []
    for m in re.finditer(re.escape(flag) + r"\s+'(\{.*?\})'", text, re.S):
        out.append(json.loads(m.group(1)))
    return out


def documented_configs():
    """``(where, kvtier dict)`` for every kvtier configuration the docs show."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.name
        for ec in _json_after(text, "--hicache-storage-backend-extra-config"):
            found.append((f"{name}: HiCache extra_config", kvtier_extra_config(ec)))
        for lc in _json_after(text, "--unified-cache-external-linker-config"):
            found.append((f"{name}: linker_extra_config", lc.get("linker_extra_config", {})))
        for kc in _json_after(text, "--kv-transfer-config"):
            extra = kc.get("kv_connector_extra_config", {})
            for tier in extra.get("secondary_tiers", []):
                own = {k: v for k, v in tier.items() if k not in VLLM_TIER_OWN}
                found.append((f"{name}: vLLM secondary tier", own))
        for m in re.finditer(r"```json\n(.*?)```", text, re.S):
            block = json.loads(m.group(1))
            if "adapter_params" in block:
                own = {k: v for k, v in block["adapter_params"].items() if k not in LMCACHE_OWN}
                found.append((f"{name}: LMCache adapter_params", own))
        for m in re.finditer(r"remote_storage_plugin\.kvtier\.config:\s*(\{.*?\})\n", text):
            found.append((f"{name}: LMCache plugin config", json.loads(m.group(1))))
        # The comment lines that say what to add to an extra_config.
        for m in re.finditer(r"#\s+(\"[a-z_]+\":.*)\n", text):
            snippet = json.loads("{" + m.group(1) + "}")
            own = kvtier_extra_config(snippet)
            found.append((f"{name}: extra_config addition {m.group(1)!r}", own))
    return found


def test_every_documented_config_is_valid(monkeypatch):
    # Clusters get the token from the environment (never from these dicts).
    for name in [k for k in os.environ if k.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVTIER_CLUSTER_TOKEN", "doc-check-token")
    found = documented_configs()
    kinds = {where.split(": ", 1)[1].split(" '")[0] for where, _ in found}
    # Each kind of example is present (a rewrite that drops one must update this test).
    for kind in (
        "HiCache extra_config",
        "linker_extra_config",
        "vLLM secondary tier",
        "LMCache adapter_params",
        "LMCache plugin config",
    ):
        assert kind in kinds, (kind, sorted(kinds))
    for where, cfg in found:
        assert "cluster_token" not in json.dumps(cfg), f"{where}: a token in a command line"
        try:
            _native.Store.check_config(json.dumps(cfg), True)
        except ValueError as e:
            pytest.fail(f"{where}: {cfg} is rejected: {e}")


def _run_python(code, env):
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        timeout=60,
    )


def _base_env():
    env = {k.encode(): v.encode() for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return env


OPEN_STORE = (
    "import json\n"
    "from kvtier import _native\n"
    "try:\n"
    "    s = _native.Store(json.dumps({'dram_capacity_bytes': '8MiB', 'dram_prefault': False}))\n"
    "    print('OPENED', s.mode)\n"
    "except ValueError as e:\n"
    "    print('VALUEERROR', e)\n"
)


def test_a_non_utf8_environment_does_not_panic_the_store():
    env = _base_env()
    env[b"OTHER_PROGRAM_VAR"] = b"caf\xe9"
    env[b"KVTIER_PYTHON"] = sys.executable.encode()
    env[b"KVTIER_TEST_HOOK"] = b"1"
    out = _run_python(OPEN_STORE, env)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    assert b"OPENED embedded" in out.stdout, out.stdout + out.stderr
    assert b"PanicException" not in out.stderr

    env = _base_env()
    env[b"KVTIER_EVICTION_POLICY"] = b"l\xffru"
    out = _run_python(OPEN_STORE, env)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    text = out.stdout.decode()
    assert text.startswith("VALUEERROR"), text + out.stderr.decode(errors="replace")
    assert "KVTIER_EVICTION_POLICY" in text and "not valid UTF-8" in text, text


def test_kvtier_python_is_not_a_config_key(monkeypatch):
    monkeypatch.setenv("KVTIER_PYTHON", sys.executable)
    monkeypatch.setenv("KVTIER_VENV", ".venv")
    store = _native.Store(json.dumps({"dram_capacity_bytes": "8MiB", "dram_prefault": False}))
    assert store.mode == "embedded"
    store.close()


def test_the_cluster_token_is_refused_in_extra_config():
    cfg = {"master_address": "127.0.0.1:9", "cluster_token": "s3cret"}
    with pytest.raises(ValueError) as e:
        _native.Store.check_config(json.dumps(cfg), False)
    assert "KVTIER_CLUSTER_TOKEN" in str(e.value) and "cluster_token_file" in str(e.value)
    assert "s3cret" not in str(e.value)
    # In the sectioned spelling too.
    cfg = {"cluster": {"master_address": "127.0.0.1:9", "token": "s3cret"}}
    with pytest.raises(ValueError, match="cluster.token"):
        _native.Store.check_config(json.dumps(cfg), False)


def test_a_token_file_must_be_private(tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("from-a-file\n")
    token.chmod(0o644)
    monkeypatch.setenv("KVTIER_CLUSTER_TOKEN_FILE", str(token))
    cfg = json.dumps({"master_address": "127.0.0.1:9"})
    with pytest.raises(ValueError, match="0644"):
        _native.Store.check_config(cfg, True)
    token.chmod(0o600)
    text = _native.Store.check_config(cfg, True)
    assert "from-a-file" not in text  # never printed
    assert "cluster_token_file" in text


def test_a_key_that_does_nothing_in_the_mode_says_where_it_belongs(monkeypatch):
    monkeypatch.setenv("KVTIER_CLUSTER_TOKEN", "t")
    with pytest.raises(ValueError, match=r"dram_capacity_bytes.*\[engine\]"):
        _native.Store.check_config(
            json.dumps({"server_socket": "/run/k.sock", "dram_capacity_bytes": "1GiB"}), False
        )
    with pytest.raises(ValueError, match=r"ssd_enabled.*nodes"):
        _native.Store.check_config(
            json.dumps({"master_address": "127.0.0.1:9", "ssd_enabled": True}), True
        )
    with pytest.raises(ValueError, match=r"server_bin.*server_socket"):
        _native.Store.check_config(json.dumps({"server_bin": "/usr/bin/kvtier"}), False)
    # With server_auto_start the engine keys are the started server's: accepted.
    _native.Store.check_config(
        json.dumps(
            {
                "server_socket": "/run/k.sock",
                "server_auto_start": True,
                "dram_capacity_bytes": "1GiB",
            }
        ),
        False,
    )


def test_bounded_counts_are_refused_naming_key_value_and_range():
    with pytest.raises(ValueError, match=r"eviction_candidate_window.*2147483648.*1\.\.=65536"):
        _native.Store.check_config(json.dumps({"eviction_candidate_window": 2**31}), False)
