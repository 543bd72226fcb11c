"""pytest setup for kvtier's Python tests: CPU-only SGLang, fixture modules and
kvtier_dev (tools/python) importable, and a few shared fixtures."""

import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The harness and benchmarks (kvtier_dev) live in tools/python, outside the wheel (issue 16);
# PYTHONPATH carries it to the worker processes the tests start.
_TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "python")
_TOOLS = os.path.normpath(_TOOLS)
sys.path.insert(0, _TOOLS)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_TOOLS, os.environ.get("PYTHONPATH", "")) if p
)

import pytest  # noqa: E402


@pytest.fixture
def file_storage_dir(tmp_path, monkeypatch):
    """A fresh directory for SGLang's HiCacheFile; its env override
    SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR would win over extra_config."""
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    path = tmp_path / "hicache_file"
    path.mkdir()
    return str(path)
