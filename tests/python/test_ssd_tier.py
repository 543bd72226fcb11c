"""The SSD tier through KvtierStore on real SGLang pools: warm restart after the store (the
inference process) goes away, one segment log per rank, strict SSD configuration, and a
corrupted segment read as a miss."""

import os

import pytest

from kvtier_dev.harness.pools import (
    alloc_indices,
    build_mha_host_pool,
    fill_pages,
    make_storage_config,
    read_pages,
    zero_pages,
)
from kvtier.sglang import KvtierStore, ssd_rank_subdir

DYNAMIC = {
    "backend_name": "kvtier",
    "module_path": "kvtier.sglang",
    "class_name": "KvtierStore",
    "interface_v1": 1,
}


def ssd_extra(path, **kw):
    return {
        **DYNAMIC,
        "dram_capacity_bytes": "32MiB",
        "ssd_enabled": True,
        "ssd_storage_dir": str(path),
        "ssd_capacity_bytes": "256MiB",
        "ssd_segment_size_bytes": "16MiB",
        "ssd_durability_mode": "strict",
        **kw,
    }


def open_store(host, extra, **cfg):
    return KvtierStore(make_storage_config(extra_config=extra, **cfg), host)


def keys(n, tag="p"):
    return [f"{tag}{i:04d}" for i in range(n)]


def test_pages_survive_a_restart_of_the_store(tmp_path):
    host = build_mha_host_pool(size_pages=64)
    store = open_store(host, ssd_extra(tmp_path))
    idx = alloc_indices(host, 6)
    want = fill_pages(host, idx, 11)
    assert store.batch_set_v1(keys(6), idx) == [True] * 6
    store.close()  # flushes the copy pipeline and syncs

    zero_pages(host, idx)
    again = open_store(host, ssd_extra(tmp_path))
    assert again.batch_exists(keys(6)) == 6
    assert again.batch_get_v1(keys(6), idx) == [True] * 6
    assert read_pages(host, idx) == want
    again.close()


def test_ssd_serves_pages_dram_evicted(tmp_path):
    # 16 pages of 32 KiB fill a 1 MiB DRAM arena twice over; the SSD keeps them all.
    host = build_mha_host_pool(size_pages=256)
    store = open_store(host, ssd_extra(tmp_path, dram_capacity_bytes="256KiB"))
    idx = alloc_indices(host, 64)
    want = fill_pages(host, idx, 5)
    for i in range(0, 64, 8):
        assert store.batch_set_v1(keys(64)[i : i + 8], idx[i * 16 : (i + 8) * 16]) == [True] * 8
    stats = store.get_stats()
    assert stats["evictions_capacity"] > 0
    zero_pages(host, idx)
    assert store.batch_exists(keys(64)) == 64
    assert store.batch_get_v1(keys(64), idx) == [True] * 64
    assert read_pages(host, idx) == want
    store.close()


def test_each_rank_gets_its_own_segment_directory(tmp_path):
    a = open_store(build_mha_host_pool(), ssd_extra(tmp_path), tp_rank=0, tp_size=2)
    b = open_store(build_mha_host_pool(), ssd_extra(tmp_path), tp_rank=1, tp_size=2)
    assert (tmp_path / "dp0_tp0").is_dir() and (tmp_path / "dp0_tp1").is_dir()
    cfg = make_storage_config(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2, dp_rank=2)
    assert ssd_rank_subdir(cfg) == "dp2_pp1_tp3"
    a.close()
    b.close()


@pytest.mark.parametrize(
    "key,value",
    [
        ("ssd_durability_mode", "eventually"),
        ("ssd_enabled", "maybe"),
        ("ssd_high_watermark", 2),
        ("ssd_capcity_bytes", 1),
    ],
)
def test_bad_ssd_settings_name_the_key(tmp_path, key, value):
    with pytest.raises(ValueError, match=key):
        open_store(None, {**ssd_extra(tmp_path), key: value})


def test_a_corrupted_segment_is_a_miss_never_wrong_bytes(tmp_path):
    host = build_mha_host_pool(size_pages=64)
    store = open_store(host, ssd_extra(tmp_path))
    idx = alloc_indices(host, 8)
    want = fill_pages(host, idx, 3)
    assert store.batch_set_v1(keys(8), idx) == [True] * 8
    store.close()
    # Flip bytes in the middle of every segment file's used part.
    seg_dir = tmp_path / "dp0_tp0"
    flipped = 0
    for name in sorted(os.listdir(seg_dir)):
        path = seg_dir / name
        if not path.is_file() or path.stat().st_size < 1 << 20:
            continue
        with open(path, "r+b") as f:
            f.seek(64 << 10)
            chunk = bytearray(f.read(4096))
            if any(chunk):
                f.seek(64 << 10)
                f.write(bytes(b ^ 0xFF for b in chunk))
                flipped += 1
    assert flipped > 0
    zero_pages(host, idx)
    again = open_store(host, ssd_extra(tmp_path))
    got = again.batch_get_v1(keys(8), idx)
    assert not all(got)
    pages = read_pages(host, idx)
    for i, ok in enumerate(got):
        if ok:
            assert pages[i] == want[i]
    again.close()
