"""pytest setup for kvtier's Python tests: CPU-only SGLang, fixture modules
importable, and a few shared fixtures."""

import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402


@pytest.fixture
def file_storage_dir(tmp_path, monkeypatch):
    """A fresh directory for SGLang's HiCacheFile; its env override
    SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR would win over extra_config."""
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    path = tmp_path / "hicache_file"
    path.mkdir()
    return str(path)
