"""KvtierStore on real SGLang 0.5.23 host pools built on CPU: construction, registration,
layouts, the key scheme, v1 and legacy paths, strict configuration, and failing closed.

Nothing here is mocked except where a test says so (to forge a misbehaving part)."""

import json
import logging

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvtier import _native
from kvtier.sglang import KvtierStore
from kvtier_dev.harness.pools import (
    alloc_indices,
    build_mha_host_pool,
    build_mla_host_pool,
    fill_pages,
    make_storage_config,
    read_page_components,
    read_pages,
    zero_pages,
)

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}
SMALL = {"dram_capacity_bytes": "64MiB"}


def extra(**kw):
    return {**DYNAMIC, **SMALL, "interface_v1": 1, **kw}


def make(host=None, *, v1=True, **kw):
    cfg_kw = {
        k: kw.pop(k)
        for k in list(kw)
        if k
        in (
            "tp_rank",
            "tp_size",
            "is_mla",
            "model_name",
            "pp_rank",
            "pp_size",
            "attn_cp_rank",
            "attn_cp_size",
        )
    }
    ec = extra(**kw)
    if not v1:
        ec.pop("interface_v1")
    store = KvtierStore(make_storage_config(extra_config=ec, **cfg_kw), {})
    if host is not None:
        store.register_mem_pool_host(host)
    return store


def keys_for(n, tag="h"):
    return [f"{tag}{i:04d}" for i in range(n)]


# ---------------------------------------------------------------- construction


def test_dynamic_factory_constructs_a_real_subclass():
    host = build_mha_host_pool()
    cfg = make_storage_config(extra_config=extra())
    backend = StorageBackendFactory.create_backend("dynamic", cfg, host)
    assert isinstance(backend, HiCacheStorage)
    assert isinstance(backend, KvtierStore)
    # The factory does not register the pool: the controller does, later.
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    idx = alloc_indices(host, 2)
    fill_pages(host, idx, 1)
    assert backend.batch_set_v1(keys_for(2), idx) == [True, True]
    backend.close()


def test_builtin_construction_registers_the_pool_at_once():
    host = build_mha_host_pool()
    store = KvtierStore(make_storage_config(extra_config=extra()), host)
    assert store.mem_pool_host is host
    idx = alloc_indices(host, 3)
    want = fill_pages(host, idx, 2)
    assert store.batch_set_v1(keys_for(3), idx) == [True] * 3
    zero_pages(host, idx)
    assert store.batch_get_v1(keys_for(3), idx) == [True] * 3
    assert read_pages(host, idx) == want


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head"])
def test_supported_layouts_round_trip_byte_exact(layout):
    host = build_mha_host_pool(layout=layout)
    store = make(host)
    idx = alloc_indices(host, 5)
    want = fill_pages(host, idx, 3)
    comps = read_page_components(host, idx)
    keys = keys_for(5)
    assert store.batch_set_v1(keys, idx) == [True] * 5
    zero_pages(host, idx)
    assert store.batch_exists(keys) == 5
    assert store.batch_get_v1(keys, idx) == [True] * 5
    assert read_pages(host, idx) == want
    assert read_page_components(host, idx) == comps


def test_layer_first_is_rejected_with_a_clear_error():
    host = build_mha_host_pool(layout="layer_first")
    store = make()
    with pytest.raises(ValueError, match=r"layer_first.*page_first|page_first.*layer_first"):
        store.register_mem_pool_host(host)


# ---------------------------------------------------------------- configuration


def test_unknown_key_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="dram_capcity_bytes"):
        KvtierStore(make_storage_config(extra_config=extra(dram_capcity_bytes=1)), {})


@pytest.mark.parametrize("value", ["maybe", 2, "", 0.5])
def test_booleans_are_strict(value):
    with pytest.raises(ValueError, match="dram_prefault"):
        KvtierStore(make_storage_config(extra_config=extra(dram_prefault=value)), {})


def test_bad_size_names_the_key():
    with pytest.raises(ValueError, match="dram_capacity_bytes"):
        KvtierStore(make_storage_config(extra_config=extra(dram_capacity_bytes="lots")), {})


def test_environment_variables_are_read_and_checked(monkeypatch):
    monkeypatch.setenv("KVTIER_EVICTION_POLICY", "lru")
    store = KvtierStore(make_storage_config(extra_config=extra()), {})
    assert 'eviction_policy = "lru"' in store._store.config_toml()
    monkeypatch.setenv("KVTIER_EVICTION_POLICY", "random")
    with pytest.raises(ValueError, match="eviction_policy.*KVTIER_EVICTION_POLICY"):
        KvtierStore(make_storage_config(extra_config=extra()), {})
    monkeypatch.delenv("KVTIER_EVICTION_POLICY")
    monkeypatch.setenv("KVTIER_NO_SUCH_SETTING", "1")
    with pytest.raises(ValueError, match="no_such_setting"):
        KvtierStore(make_storage_config(extra_config=extra()), {})


def test_config_file_is_read(tmp_path):
    path = tmp_path / "kvtier.toml"
    path.write_text('dram_capacity_bytes = "32MiB"\neviction_policy = "lru"\n')
    toml = _native.Store.check_config(json.dumps({"config_file": str(path)}), False)
    assert "dram_capacity_bytes = 33554432" in toml and 'eviction_policy = "lru"' in toml


def test_sglang_controller_keys_are_not_kvtiers():
    # The controller pops these before the backend sees them, but a backend built directly
    # (or by an older controller) may still get them: they must not be "unknown keys".
    ec = extra(prefetch_threshold=256, hicache_storage_pass_prefix_keys=True)
    KvtierStore(make_storage_config(extra_config=ec), {}).close()


# ---------------------------------------------------------------- key scheme


def shared(a, b):
    """Make store b use store a's native store, as two ranks of one host do in server mode."""
    b._store = a._store
    return b


def test_mha_keys_are_per_tp_rank_and_mla_keys_are_shared():
    mha0, mha1 = build_mha_host_pool(), build_mha_host_pool()
    s0 = make(mha0, tp_rank=0, tp_size=2)
    s1 = make(mha1, tp_rank=1, tp_size=2)
    assert all(".tp0." in s for s in s0._anchor.suffixes)
    assert all(".tp1." in s for s in s1._anchor.suffixes)
    assert set(s0._anchor.suffixes).isdisjoint(s1._anchor.suffixes)

    mla0, mla1 = build_mla_host_pool(), build_mla_host_pool()
    m0 = make(mla0, tp_rank=0, tp_size=2, is_mla=True)
    m1 = shared(m0, make(tp_rank=1, tp_size=2, is_mla=True))
    m1.register_mem_pool_host(mla1)
    assert m0._anchor.suffixes == m1._anchor.suffixes
    assert not any(".tp" in s for s in m0._anchor.suffixes)
    # Rank 0 writes once; rank 1 reads the same object into its own pool.
    idx0, idx1 = alloc_indices(mla0, 3), alloc_indices(mla1, 3)
    want = fill_pages(mla0, idx0, 9)
    keys = keys_for(3)
    assert m0.batch_set_v1(keys, idx0) == [True] * 3
    objects = m0.get_stats()["objects"]
    assert m1.batch_exists(keys) == 3
    assert m1.batch_get_v1(keys, idx1) == [True] * 3
    assert read_pages(mla1, idx1) == want
    # MLA page = one object; MHA page = k + v.
    assert objects == 3
    assert len(s0._anchor.suffixes) == 2


def test_pp_and_cp_ranks_enter_the_key_only_when_used():
    host = build_mha_host_pool()
    plain = make(host)
    assert ".pp" not in plain._anchor.suffixes[0] and ".cp" not in plain._anchor.suffixes[0]
    pp = make(build_mha_host_pool(), pp_rank=1, pp_size=2)
    assert ".pp1." in pp._anchor.suffixes[0]
    cp = make(build_mha_host_pool(), attn_cp_rank=1, attn_cp_size=2)
    assert ".cp1." in cp._anchor.suffixes[0]


@pytest.mark.parametrize(
    "other",
    [
        dict(model_name="other/model"),
        dict(dtype=torch.float16),
        dict(page_size=32),
        dict(layout="page_first_direct"),
        dict(tp_size=2),
        dict(pp_size=2),
    ],
    ids=lambda d: next(iter(d)),
)
def test_differently_configured_deployments_never_read_each_others_bytes(other):
    pool_kw = {k: other[k] for k in ("dtype", "page_size", "layout") if k in other}
    cfg_kw = {k: other[k] for k in ("model_name", "tp_size", "pp_size") if k in other}
    a_host, b_host = build_mha_host_pool(), build_mha_host_pool(**pool_kw)
    a = make(a_host)
    b = shared(a, make(**cfg_kw))
    b.register_mem_pool_host(b_host)
    keys = keys_for(2)
    assert a.batch_set_v1(keys, fill_and_index(a_host, 2)) == [True, True]
    assert b.batch_exists(keys) == 0
    idx = alloc_indices(b_host, 2)
    before = read_pages(b_host, idx)
    assert b.batch_get_v1(keys, idx) == [False, False]
    assert read_pages(b_host, idx) == before


def fill_and_index(host, n, seed=5):
    idx = alloc_indices(host, n)
    fill_pages(host, idx, seed)
    return idx


def test_extra_backend_tag_prefixes_every_key():
    host = build_mha_host_pool()
    a = make(host, extra_backend_tag="tenant-a")
    b = shared(a, make(extra_backend_tag="tenant-b"))
    b.register_mem_pool_host(build_mha_host_pool())
    keys = keys_for(2)
    assert a.batch_set_v1(keys, fill_and_index(host, 2)) == [True, True]
    assert a.batch_exists(keys) == 2
    assert b.batch_exists(keys) == 0
    suffix = a._anchor.suffixes[0]
    assert a._store.exists_keys([f"tenant-a/{keys[0]}{suffix}"]) == [True]
    assert a._store.exists_keys([f"{keys[0]}{suffix}"]) == [False]


# ---------------------------------------------------------------- v1 / legacy / exists


def test_batch_exists_counts_a_page_only_when_all_components_exist():
    host = build_mha_host_pool()
    store = make(host)
    keys = keys_for(4)
    assert store.batch_set_v1(keys, fill_and_index(host, 4)) == [True] * 4
    # Drop the V half of page 2: the prefix stops at 2.
    v_suffix = store._anchor.suffixes[1]
    assert store._store.remove_keys([f"{keys[2]}{v_suffix}"]) == 1
    assert store.batch_exists(keys) == 2
    assert store.exists(keys[1]) and not store.exists(keys[2])


def test_put_is_put_if_absent():
    host = build_mha_host_pool()
    store = make(host)
    keys = keys_for(2)
    idx = fill_and_index(host, 2, seed=1)
    first = read_pages(host, idx)
    assert store.batch_set_v1(keys, idx) == [True, True]
    fill_pages(host, idx, 2)  # different bytes under the same keys
    assert store.batch_set_v1(keys, idx) == [True, True]
    stats = store.get_stats()
    assert stats["dedup_skips"] == 4 and stats["puts"] == 4
    assert store.batch_get_v1(keys, idx) == [True, True]
    assert read_pages(host, idx) == first


def test_legacy_tensor_path_round_trips():
    host = build_mha_host_pool()
    store = make(host, v1=False)
    idx = fill_and_index(host, 3, seed=4)
    want = read_pages(host, idx)
    keys = keys_for(3)
    starts = idx[:: host.page_size].tolist()
    assert store.batch_set(keys, [host.get_data_page(s, flat=True) for s in starts]) is True
    assert store.batch_exists(keys) == 3
    dummies = [host.get_dummy_flat_data_page() for _ in keys]
    got = store.batch_get(keys, dummies)
    assert all(g is d for g, d in zip(got, dummies))
    assert [d.view(torch.uint8).numpy().tobytes() for d in dummies] == want
    missing = store.batch_get(["nope"], [host.get_dummy_flat_data_page()])
    assert missing == [None]
    assert store.get("nope", host.get_dummy_flat_data_page()) is None
    assert store.set("single", host.get_data_page(starts[0], flat=True)) is True
    assert store.exists("single")


def test_legacy_get_into_a_wrong_sized_tensor_fails_and_leaves_it_untouched():
    host = build_mha_host_pool()
    store = make(host, v1=False)
    idx = fill_and_index(host, 1)
    assert store.batch_set(["k"], [host.get_data_page(int(idx[0]), flat=True)])
    small = torch.full((10,), 7, dtype=torch.uint8)
    assert store.batch_get(["k"], [small]) == [None]
    assert torch.all(small == 7)


def test_depth_from_prefix_keys_keeps_chain_heads_under_pressure():
    # 8 pages of 32 KiB (k+v = 2 objects of 16 KiB) fill a 1 MiB arena 4 times over.
    host = build_mha_host_pool(size_pages=256)
    store = make(host, dram_capacity_bytes="1MiB", eviction_candidate_window=1024)
    chain = keys_for(64, "c")
    done = []
    for i in range(0, 64, 8):
        batch = chain[i : i + 8]
        info = HiCacheStorageExtraInfo(prefix_keys=list(done))
        assert store.batch_set_v1(batch, fill_and_index(host, 8, seed=i), info) == [True] * 8
        done += batch
    # The store holds 32 pages; prefix-depth eviction kept the head of the chain.
    assert store.batch_exists(chain) >= 16
    assert store.get_stats()["evictions_capacity"] > 0


def test_lru_would_have_lost_the_head():
    host = build_mha_host_pool(size_pages=256)
    store = make(host, dram_capacity_bytes="1MiB", eviction_policy="lru")
    chain = keys_for(64, "c")
    done = []
    for i in range(0, 64, 8):
        info = HiCacheStorageExtraInfo(prefix_keys=list(done))
        store.batch_set_v1(chain[i : i + 8], fill_and_index(host, 8, seed=i), info)
        done += chain[i : i + 8]
    assert store.batch_exists(chain) == 0


# ---------------------------------------------------------------- failing closed


def test_keys_and_host_indices_mismatch_fails_the_batch(caplog):
    host = build_mha_host_pool()
    store = make(host)
    idx = fill_and_index(host, 3)
    with caplog.at_level(logging.ERROR, logger="kvtier.sglang"):
        assert store.batch_set_v1(keys_for(2), idx) == [False, False]
    assert "host indices" in caplog.text
    assert store.get_stats()["objects"] == 0


def test_pointer_outside_registered_memory_is_refused(caplog):
    host = build_mha_host_pool(size_pages=8)
    store = make(host)
    # Indices past the end of the pool make get_page_buffer_meta point outside its buffer.
    beyond = torch.arange(64 * 16, 66 * 16, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
        assert store.batch_set_v1(keys_for(2), beyond) == [False, False]
        assert store.batch_get_v1(keys_for(2), beyond) == [False, False]
    assert "outside every registered memory region" in caplog.text
    assert store.get_stats()["rejected_buffers"] >= 1
    # The store still works for good pages.
    idx = fill_and_index(host, 2)
    assert store.batch_set_v1(keys_for(2, "ok"), idx) == [True, True]


def test_size_mismatch_is_a_miss_and_the_destination_is_untouched(monkeypatch):
    host = build_mha_host_pool()
    store = make(host)
    keys = keys_for(2)
    idx = fill_and_index(host, 2)
    assert store.batch_set_v1(keys, idx) == [True, True]
    fill_pages(host, idx, 99)
    before = read_page_components(host, idx)
    real = host.get_page_buffer_meta

    def shrunken(indices):  # forge a pool whose page components shrank
        ptrs, sizes = real(indices)
        return ptrs, [s - 2 for s in sizes]

    monkeypatch.setattr(host, "get_page_buffer_meta", shrunken)
    assert store.batch_get_v1(keys, idx) == [False, False]
    monkeypatch.undo()
    assert read_page_components(host, idx) == before
    assert store.get_stats()["size_mismatches"] >= 1


def test_a_result_list_of_the_wrong_length_fails_closed(monkeypatch):
    host = build_mha_host_pool()
    store = make(host)
    idx = fill_and_index(host, 3)
    real_store = store._store

    class ShortReplies:  # forge a store whose reply drops an entry
        def __getattr__(self, name):
            return getattr(real_store, name)

        def put_pages(self, *a):
            ok, errs = real_store.put_pages(*a)
            return ok[:-1], errs

    store._store = ShortReplies()
    assert store.batch_set_v1(keys_for(3), idx) == [False] * 3


def test_unregistered_pool_in_v2_is_a_miss_not_an_exception():
    host = build_mha_host_pool()
    store = make(host)
    keys = keys_for(2)
    t = PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(32), keys=keys)
    assert store.batch_set_v2([t]) == {PoolName.SWA: [False, False]}
    assert store.batch_get_v2([t]) == {PoolName.SWA: [False, False]}
    assert store.batch_get_v2([]) == {}
    idx = fill_and_index(host, 2)
    store.batch_set_v1(keys, idx)
    res = store.batch_exists_v2(
        keys, [PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
    )
    assert res.kv_hit_pages == 0


def test_calls_before_registration_fail_cleanly():
    store = make()
    assert store.batch_set_v1(keys_for(1), torch.arange(16)) == [False]
    assert store.batch_get_v1(keys_for(1), torch.arange(16)) == [False]
    assert store.batch_exists(keys_for(1)) == 0


# ---------------------------------------------------------------- lifecycle and stats


def test_clear_flush_close_and_stats():
    host = build_mha_host_pool()
    store = make(host)
    keys = keys_for(4)
    idx = fill_and_index(host, 4)
    assert store.batch_set_v1(keys, idx) == [True] * 4
    assert store.batch_get_v1(keys, idx) == [True] * 4
    assert store.batch_get_v1(["cold"], idx[:16]) == [False]
    s = store.get_stats()
    page = sum(len(c) for c in read_page_components(host, idx[:16])[0])
    assert s["objects"] == 8 and s["puts"] == 8
    assert s["bytes_used"] == 4 * page and s["bytes_in"] == 4 * page and s["bytes_out"] == 4 * page
    assert s["hits"] == 8 and s["misses"] == 1
    assert s.backup_pgs == [4] and s.prefetch_pgs == [4]
    assert store.flush() is True
    assert store.clear() is True
    assert store.batch_exists(keys) == 0
    store.close()
    store.close()  # idempotent
    assert store.batch_set_v1(keys, idx) == [False] * 4
    assert store.batch_exists(keys) == 0


def test_split_heads_yield_one_object_pair_per_split_rank():
    # tp_size 2 on a tp_lcm_size 4 store: each rank's page holds the heads of 2 lcm ranks.
    host = build_mha_host_pool(layout="page_head", head_num=4)
    ec = extra()
    cfg = make_storage_config(
        tp_rank=1, tp_size=2, extra_config=ec, tp_lcm_size=4, should_split_heads=True
    )
    store = KvtierStore(cfg, host)
    suffixes = store._anchor.suffixes
    assert len(suffixes) == 4
    assert [s.split(".", 1)[1] for s in suffixes] == ["tp2.k", "tp2.v", "tp3.k", "tp3.v"]
    idx = fill_and_index(host, 3)
    want = read_pages(host, idx)
    keys = keys_for(3)
    assert store.batch_set_v1(keys, idx) == [True] * 3
    assert store.get_stats()["objects"] == 12
    zero_pages(host, idx)
    assert store.batch_get_v1(keys, idx) == [True] * 3
    assert read_pages(host, idx) == want
