"""Self-check of the SGLang fixtures against SGLang's own HiCacheFile backend.

If these pass, ``kvtier_dev.harness.pools`` builds pools whose pages round-trip through
the real controller code, and ``kvtier_dev.harness.flows`` drives a backend the way
SGLang 0.5.23 does.  The same flows are later run against kvtier's backend.
"""

from __future__ import annotations

import ctypes
import hashlib

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
)

import kvtier_dev.harness.flows as cf
import kvtier_dev.harness.pools as sp


def hashes(n, tag="span"):
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def file_backend(path, *, is_mla=False, record=True, cls=HiCacheFile):
    cfg = sp.make_storage_config(is_mla=is_mla, extra_config={"file_storage_path": path})
    backend = cls(cfg)
    return cf.RecordingBackend(backend) if record else backend


class ZeroCopyFile(HiCacheFile):
    """HiCacheFile plus batch_get_v1/batch_set_v1 through
    get_page_buffer_meta pointers (what a zero-copy backend does), so the
    fixtures' v1 path is exercised against the same reference store."""

    def _meta(self, host_indices, i):
        pool = self.mem_pool_host
        ps = pool.page_size
        return pool.get_page_buffer_meta(host_indices[i * ps : (i + 1) * ps]) or ([], [])

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        out = []
        for i, key in enumerate(keys):
            ptrs, sizes = self._meta(host_indices, i)
            data = b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))
            value = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if data
                else torch.empty(0, dtype=torch.uint8)
            )
            out.append(self.set(key, value))
        return out

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        out = []
        for i, key in enumerate(keys):
            ptrs, sizes = self._meta(host_indices, i)
            buf = torch.empty(sum(sizes), dtype=torch.uint8)
            if self.get(key, buf) is None:
                out.append(False)
                continue
            off = 0
            for p, s in zip(ptrs, sizes):
                ctypes.memmove(p, buf.data_ptr() + off, s)
                off += s
            out.append(True)
        return out


# ---------------------------------------------------------------------------
# Pools alone
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sp.MHA_LAYOUTS)
def test_mha_fill_read_zero_touch_exactly_those_pages(layout):
    pool = sp.build_mha_host_pool(layout, size_pages=8)
    assert pool.get_hybrid_pool_buffer()[0].data_ptr() == pool.kv_buffer[0].data_ptr()
    idx = sp.alloc_indices(pool, 3)
    assert idx.tolist() == list(range(3 * pool.page_size))
    sp.zero_pages(pool, idx)
    before = bytes(pool.kv_buffer.view(torch.uint8).numpy().tobytes())
    written = sp.fill_pages(pool, idx[pool.page_size :], seed=7)  # pages 1 and 2
    assert sp.read_pages(pool, idx[pool.page_size :]) == written
    assert sp.read_pages(pool, idx[: pool.page_size]) == [bytes(sp.page_nbytes(pool))]
    # zero-copy components hold exactly the same bytes as the flat data page
    for comps, flat in zip(sp.read_page_components(pool, idx[pool.page_size :]), written):
        assert sum(map(len, comps)) == len(flat) == sp.page_nbytes(pool)
        size = len(comps[0])
        chunks = sorted(flat[o : o + size] for o in range(0, len(flat), size))
        assert sorted(comps) == chunks
    after_fill = pool.kv_buffer.view(torch.uint8).numpy().tobytes()
    assert after_fill != before
    sp.zero_pages(pool, idx[pool.page_size :])
    assert pool.kv_buffer.view(torch.uint8).numpy().tobytes() == before
    assert sp.page_nbytes(pool) == sp.mha_page_bytes(16, 4, 2, 64)


def test_large_pages_are_configurable():
    pool = sp.build_mha_host_pool(
        "page_first", page_size=64, layer_num=8, head_num=4, head_dim=64, size_pages=4
    )
    assert sp.page_nbytes(pool) == 512 * 1024
    _, sizes = pool.get_page_buffer_meta(torch.arange(64))
    assert sizes == [256 * 1024, 256 * 1024]


# ---------------------------------------------------------------------------
# MHA / MLA round trips
# ---------------------------------------------------------------------------


def test_mha_page_first_round_trip_legacy_two_batches(file_storage_dir):
    pool = sp.build_mha_host_pool("page_first", size_pages=300)
    backend = file_backend(file_storage_dir)
    cf.attach_backend(backend, pool)
    assert backend.methods() == [
        "register_mem_pool_host",
        "register_mem_host_pool_v2",
        "on_host_pools_registered",
    ]
    assert backend.calls[1].args["name"] == PoolName.KV

    n = cf.STORAGE_BATCH_SIZE + 2
    keys = hashes(n, "mha")
    prefix = hashes(3, "prefix")
    idx = sp.alloc_indices(pool, n)
    written = sp.fill_pages(pool, idx, seed=1)

    backend.reset()
    res = cf.backup_span(backend, pool, keys, {PoolName.KV: idx}, prefix_keys=prefix, use_v1=False)
    assert res.completed_pages == n
    sets = [c for c in backend.calls if c.method == "batch_set"]
    assert [len(c.args["keys"]) for c in sets] == [128, 2]
    assert set(sets[0].args["value_nbytes"]) == {sp.page_nbytes(pool)}
    assert "batch_set_v2" not in backend.methods()

    assert cf.query_span(backend, keys, pool).kv_hit_pages == n
    assert cf.query_span(backend, keys + hashes(1, "missing"), pool).kv_hit_pages == n

    sp.zero_pages(pool, idx)
    backend.reset()
    pre = cf.prefetch_span(
        backend,
        pool,
        keys,
        prefix_keys=prefix,
        use_v1=False,
        host_indices_per_pool={PoolName.KV: idx},
    )
    assert pre.hit_pages == n and pre.counts == {PoolName.KV: n}
    assert sp.read_pages(pool, idx) == written
    # one batch_exists for the whole span, then batch_get per 128-page batch
    assert backend.methods() == ["batch_exists", "batch_get", "batch_get"]
    assert len(backend.calls[0].args["keys"]) == n
    gets = [c for c in backend.calls if c.method == "batch_get"]
    assert [len(c.args["keys"]) for c in gets] == [128, 2]

    # into fresh host staging from the pool's own allocator
    pre2 = cf.prefetch_span(backend, pool, keys, prefix_keys=prefix, use_v1=False)
    assert pre2.counts[PoolName.KV] == n
    assert not torch.equal(pre2.host_indices[PoolName.KV], idx)
    assert sp.read_pages(pool, pre2.host_indices[PoolName.KV]) == written


def test_v1_batches_carry_prefix_keys(file_storage_dir):
    """v1 KV batches get extra_info.prefix_keys = chain before the batch; the
    legacy batch_set/batch_get path never sees extra_info at all."""
    pool = sp.build_mha_host_pool("page_first", size_pages=280)
    backend = file_backend(file_storage_dir, cls=ZeroCopyFile)
    cf.attach_backend(backend, pool)
    n = cf.STORAGE_BATCH_SIZE + 3
    keys, prefix = hashes(n, "v1"), hashes(2, "v1-prefix")
    idx = sp.alloc_indices(pool, n)
    written = sp.fill_pages(pool, idx, seed=9)
    backend.reset()
    assert (
        cf.backup_span(backend, pool, keys, {PoolName.KV: idx}, prefix_keys=prefix).completed_pages
        == n
    )
    sets = [c for c in backend.calls if c.method == "batch_set_v1"]
    assert [c.args["extra_info"]["prefix_keys"] for c in sets] == [prefix, prefix + keys[:128]]
    assert [c.args["n_host_indices"] for c in sets] == [128 * 16, 3 * 16]
    sp.zero_pages(pool, idx)
    backend.reset()
    pre = cf.prefetch_span(
        backend, pool, keys, prefix_keys=prefix, host_indices_per_pool={PoolName.KV: idx}
    )
    assert pre.counts[PoolName.KV] == n and sp.read_pages(pool, idx) == written
    assert backend.calls[0].method == "batch_exists"
    assert backend.calls[0].args["extra_info"]["prefix_keys"] == prefix
    gets = [c for c in backend.calls if c.method == "batch_get_v1"]
    assert [c.args["extra_info"]["prefix_keys"] for c in gets] == [prefix, prefix + keys[:128]]


@pytest.mark.parametrize("use_v1", [False, True], ids=["legacy", "v1"])
@pytest.mark.parametrize("layout", sp.MHA_LAYOUTS)
def test_mha_layouts_round_trip(file_storage_dir, layout, use_v1):
    pool = sp.build_mha_host_pool(layout, size_pages=8)
    backend = file_backend(file_storage_dir, cls=ZeroCopyFile)
    cf.attach_backend(backend, pool)
    keys = hashes(3, f"mha-{layout}")
    idx = sp.alloc_indices(pool, 3)
    written = sp.fill_pages(pool, idx, seed=2)
    assert (
        cf.backup_span(backend, pool, keys, {PoolName.KV: idx}, use_v1=use_v1).completed_pages == 3
    )
    assert ("batch_set_v1" in backend.methods()) == use_v1
    sp.zero_pages(pool, idx)
    pre = cf.prefetch_span(
        backend, pool, keys, use_v1=use_v1, host_indices_per_pool={PoolName.KV: idx}
    )
    assert pre.counts[PoolName.KV] == 3
    assert sp.read_pages(pool, idx) == written


@pytest.mark.parametrize("use_v1", [False, True], ids=["legacy", "v1"])
@pytest.mark.parametrize("layout", sp.MLA_LAYOUTS)
def test_mla_round_trip(file_storage_dir, layout, use_v1):
    pool = sp.build_mla_host_pool(layout, size_pages=8)
    backend = file_backend(file_storage_dir, is_mla=True, cls=ZeroCopyFile)
    cf.attach_backend(backend, pool)
    keys = hashes(4, f"mla-{layout}")
    idx = sp.alloc_indices(pool, 4)
    written = sp.fill_pages(pool, idx, seed=3)
    assert sp.page_nbytes(pool) == sp.mla_page_bytes(16, 4)
    assert (
        cf.backup_span(backend, pool, keys, {PoolName.KV: idx}, use_v1=use_v1).completed_pages == 4
    )
    sp.zero_pages(pool, idx)
    other = sp.alloc_indices(pool, 4)
    pre = cf.prefetch_span(
        backend, pool, keys, use_v1=use_v1, host_indices_per_pool={PoolName.KV: other}
    )
    assert pre.counts[PoolName.KV] == 4
    assert sp.read_pages(pool, other) == written


def test_prefetch_stops_at_first_missing_page(file_storage_dir):
    pool = sp.build_mha_host_pool("page_first", size_pages=8)
    backend = file_backend(file_storage_dir)
    cf.attach_backend(backend, pool)
    keys = hashes(4, "gap")
    idx = sp.alloc_indices(pool, 2)
    sp.fill_pages(pool, idx, seed=4)
    cf.backup_span(backend, pool, keys[:2], {PoolName.KV: idx}, use_v1=False)
    assert cf.query_span(backend, keys, pool).kv_hit_pages == 2
    pre = cf.prefetch_span(backend, pool, keys, use_v1=False)
    assert pre.hit_pages == 2 and pre.counts[PoolName.KV] == 2


# ---------------------------------------------------------------------------
# DeepSeek-V4 group
# ---------------------------------------------------------------------------


def _dsv4_fill(stack, kv_idx, swa_idx, seed):
    """Fill every physical pool of the group for one span; returns
    {pool name: [page bytes]} (SWA-derived pools at the SWA indices)."""
    written = {}
    for s in stack.side_specs:
        idx = swa_idx if s.indices_from_pool == PoolName.SWA or s.name == PoolName.SWA else kv_idx
        written[s.name] = sp.fill_pages(s.host_pool, idx, seed)
    return written


def _dsv4_zero(stack, kv_idx, swa_idx):
    for s in stack.side_specs:
        idx = swa_idx if s.indices_from_pool == PoolName.SWA or s.name == PoolName.SWA else kv_idx
        sp.zero_pages(s.host_pool, idx)


@pytest.fixture
def dsv4():
    return sp.build_dsv4_pool_group("page_first")


def test_dsv4_group_shape(dsv4):
    by_name = {s.name: s for s in dsv4.specs}
    assert type(dsv4.anchor).__name__ == "LogicalHostPool" and dsv4.anchor.kv_buffer is None
    assert by_name[PoolName.SWA].hit_policy == PoolHitPolicy.TRAILING_PAGES
    assert by_name[PoolName.SWA].window_pages == 1  # 128-token window, 256-token pages
    for name in (
        PoolName.DEEPSEEK_V4_C4,
        PoolName.DEEPSEEK_V4_C4_INDEXER,
        PoolName.DEEPSEEK_V4_C128,
    ):
        assert by_name[name].hit_policy == PoolHitPolicy.ALL_PAGES
        assert by_name[name].indices_from_pool == PoolName.KV
        assert type(by_name[name].host_pool).__name__ == "DeepSeekV4PagedHostPool"
    for name in (PoolName.DEEPSEEK_V4_C4_STATE, PoolName.DEEPSEEK_V4_C4_INDEXER_STATE):
        assert by_name[name].hit_policy == PoolHitPolicy.TRAILING_PAGES
        assert by_name[name].indices_from_pool == PoolName.SWA
        assert type(by_name[name].host_pool).__name__ == "DeepSeekV4StateHostPool"
    for s in dsv4.side_specs:
        assert s.page_size == 256 and s.page_bytes > 0
        assert s.host_pool.pin_memory is False
        assert {tuple(b.shape) for b in s.host_pool.get_hybrid_pool_buffer()}
    assert {e.name for e in dsv4.group.entries} == set(by_name)


@pytest.mark.parametrize("use_v1", [False, True], ids=["legacy", "v1"])
def test_dsv4_backup_query_prefetch_round_trip(file_storage_dir, dsv4, use_v1):
    backend = file_backend(file_storage_dir, is_mla=True, cls=ZeroCopyFile)
    cf.attach_backend(backend, dsv4)
    regs = [c for c in backend.calls if c.method == "register_mem_host_pool_v2"]
    assert backend.calls[0].args["pool"] == "LogicalHostPool"
    assert [c.args["name"] for c in regs] == [e.name for e in dsv4.group.entries]
    assert regs[0].args["name"] == PoolName.KV

    n = 4
    keys = hashes(n, "dsv4")
    prefix = hashes(2, "dsv4-prefix")
    kv_idx = sp.alloc_indices(dsv4.anchor, n)
    swa = dsv4.spec(PoolName.SWA)
    swa_idx = sp.alloc_indices(swa.host_pool, swa.window_pages)
    written = _dsv4_fill(dsv4, kv_idx, swa_idx, seed=11)

    backend.reset()
    res = cf.backup_span(
        backend,
        dsv4,
        keys,
        {PoolName.KV: kv_idx, PoolName.SWA: swa_idx},
        prefix_keys=prefix,
        use_v1=use_v1,
    )
    assert res.completed_pages == n
    methods = backend.methods()
    # side pools first, grouped by prefix chain, then KV (0-byte logical pages)
    kv_set = "batch_set_v1" if use_v1 else "batch_set"
    assert methods == ["batch_set_v2", "batch_set_v2", kv_set]
    groups = {
        tuple(t["name"] for t in c.args["transfers"]): c.args["extra_info"]["prefix_keys"]
        for c in backend.calls[:2]
    }
    trailing = tuple(s.name for s in dsv4.side_specs if s.is_trailing)
    derived = tuple(s.name for s in dsv4.side_specs if s.indices_from_pool == PoolName.KV)
    assert groups[trailing] == prefix + keys[:-1]
    assert groups[derived] == prefix
    if not use_v1:
        assert backend.calls[2].args["value_nbytes"] == [0] * n
    assert all(v == n for k, v in res.pool_hits.items() if k in derived)
    assert all(v == 1 for k, v in res.pool_hits.items() if k in trailing)

    q = cf.query_span(backend, keys, dsv4, prefix_keys=prefix)
    assert q.kv_hit_pages == n
    assert q.restorable_prefix_pages == [n]  # the 1-page SWA window ends at page n
    call = [c for c in backend.calls if c.method == "batch_exists_v2"][-1]
    tr = {t["name"]: t for t in call.args["transfers"]}
    assert tr[PoolName.SWA]["keys"] == [cf.PLACEHOLDER_KEY]
    assert tr[PoolName.DEEPSEEK_V4_C4]["keys"] is None
    assert tr[PoolName.DEEPSEEK_V4_C4_STATE]["indices_from_pool"] == PoolName.SWA

    _dsv4_zero(dsv4, kv_idx, swa_idx)
    backend.reset()
    pre = cf.prefetch_span(backend, dsv4, keys, prefix_keys=prefix, use_v1=use_v1)
    assert pre.hit_pages == n
    for s in dsv4.side_specs:
        expect = n if s.indices_from_pool == PoolName.KV else swa.window_pages
        assert pre.counts[s.name] == expect, s.name
        got = sp.read_pages(s.host_pool, pre.host_indices[s.name])
        want = written[s.name][-len(got) :] if s.is_trailing else written[s.name]
        assert got == want, s.name
    # staging came from the real allocators, not the backed-up indices
    assert not torch.equal(pre.host_indices[PoolName.KV], kv_idx)
    assert torch.equal(
        pre.host_indices[PoolName.DEEPSEEK_V4_C4_STATE], pre.host_indices[PoolName.SWA]
    )
    assert pre.key_ranges[PoolName.SWA] == keys[-1:]
    # KV batch (logical, 0 bytes) + KV-derived batch_get_v2, then trailing pools
    kv_get = "batch_get_v1" if use_v1 else "batch_get"
    assert backend.methods() == ["batch_exists_v2", kv_get, "batch_get_v2", "batch_get_v2"]


def test_dsv4_trailing_state_hole(file_storage_dir, dsv4):
    """State exists for prefixes 2 and 4 but not 3: nodes [0,1] and [2,3]
    were backed up separately with a 1-page SWA window each."""
    backend = file_backend(file_storage_dir, is_mla=True)
    cf.attach_backend(backend, dsv4)
    keys = hashes(4, "hole")
    swa = dsv4.spec(PoolName.SWA)
    node_written = []
    for lo, hi in ((0, 2), (2, 4)):
        kv_idx = sp.alloc_indices(dsv4.anchor, hi - lo)
        swa_idx = sp.alloc_indices(swa.host_pool, 1)
        node_written.append(_dsv4_fill(dsv4, kv_idx, swa_idx, seed=100 + lo))
        res = cf.backup_span(
            backend,
            dsv4,
            keys[lo:hi],
            {PoolName.KV: kv_idx, PoolName.SWA: swa_idx},
            prefix_keys=keys[:lo],
            use_v1=False,
        )
        assert res.completed_pages == hi - lo

    q = cf.query_span(backend, keys, dsv4, prefix_keys=[])
    assert q.kv_hit_pages == 4
    assert q.restorable_prefix_pages == [2, 4]
    assert q.extra_pool_hit_pages[PoolName.SWA] == 4
    assert q.extra_pool_hit_pages[PoolName.DEEPSEEK_V4_C4] == 4

    q3 = cf.query_span(backend, keys[:3], dsv4, prefix_keys=[])
    assert q3.restorable_prefix_pages == [2] and q3.kv_hit_pages == 2

    # prefetch of 3 pages falls back to the restorable prefix 2
    pre = cf.prefetch_span(backend, dsv4, keys[:3], prefix_keys=[], use_v1=False)
    assert pre.hit_pages == 2
    assert pre.counts[PoolName.KV] == 2 and pre.counts[PoolName.SWA] == 1
    assert pre.key_ranges[PoolName.SWA] == [keys[1]]
    for name in (PoolName.SWA, PoolName.DEEPSEEK_V4_C4_STATE):
        pool = dsv4.spec(name).host_pool
        assert sp.read_pages(pool, pre.host_indices[name]) == node_written[0][name][-1:]
    c4 = dsv4.spec(PoolName.DEEPSEEK_V4_C4).host_pool
    assert (
        sp.read_pages(c4, pre.host_indices[PoolName.KV]) == node_written[0][PoolName.DEEPSEEK_V4_C4]
    )

    # and of all 4 pages: window from node 2, compressed from both nodes
    pre4 = cf.prefetch_span(backend, dsv4, keys, prefix_keys=[], use_v1=False)
    assert pre4.hit_pages == 4 and pre4.counts[PoolName.SWA] == 1
    assert sp.read_pages(c4, pre4.host_indices[PoolName.KV]) == (
        node_written[0][PoolName.DEEPSEEK_V4_C4] + node_written[1][PoolName.DEEPSEEK_V4_C4]
    )
    state = dsv4.spec(PoolName.DEEPSEEK_V4_C4_INDEXER_STATE).host_pool
    assert (
        sp.read_pages(state, pre4.host_indices[PoolName.DEEPSEEK_V4_C4_INDEXER_STATE])
        == (node_written[1][PoolName.DEEPSEEK_V4_C4_INDEXER_STATE])
    )


def test_dsv4_mid_tree_short_span_sends_empty_batch_get_v2(file_storage_dir, dsv4):
    """A mid-tree span shorter than the SWA window has no trailing transfer;
    the controller still calls batch_get_v2([]) for the (empty) trailing step."""
    import dataclasses

    specs = [dataclasses.replace(s, window_pages=2) if s.is_trailing else s for s in dsv4.specs]
    backend = file_backend(file_storage_dir, is_mla=True)
    cf.attach_backend(backend, dsv4)
    keys = hashes(1, "short")
    kv_idx = sp.alloc_indices(dsv4.anchor, 1)
    sp.fill_pages(dsv4.spec(PoolName.DEEPSEEK_V4_C4).host_pool, kv_idx, seed=5)
    cf.backup_span(
        backend,
        dsv4,
        keys,
        {PoolName.KV: kv_idx},
        prefix_keys=["p"],
        use_v1=False,
        pool_specs=specs,
    )
    backend.reset()
    pre = cf.prefetch_span(
        backend, dsv4, keys, prefix_keys=None, use_v1=False, pool_specs=specs, at_root=False
    )
    assert pre.counts[PoolName.DEEPSEEK_V4_C4] == 1
    last = backend.calls[-1]
    assert last.method == "batch_get_v2" and last.args["transfers"] == []


def test_factory_backend_and_failure_injector(file_storage_dir, monkeypatch):
    """Backends made by the real StorageBackendFactory; with SGLang's failure
    injector at probability 1 every call fails cleanly and the flows report
    nothing done instead of raising."""
    pool = sp.build_mha_host_pool("page_first", size_pages=8)
    cfg = sp.make_storage_config(extra_config={"file_storage_path": file_storage_dir})
    backend = cf.create_backend("file", cfg, pool)
    assert type(backend).__name__ == "HiCacheFile"
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "1")
    failing = cf.create_backend("file", cfg, pool)
    assert type(failing).__name__ == "HiCacheStorageFailureInjector"
    cf.attach_backend(failing, pool)
    keys = hashes(2, "fail")
    idx = sp.alloc_indices(pool, 2)
    sp.fill_pages(pool, idx, seed=1)
    assert (
        cf.backup_span(failing, pool, keys, {PoolName.KV: idx}, use_v1=False).completed_pages == 0
    )
    assert cf.backup_span(failing, pool, keys, {PoolName.KV: idx}, use_v1=True).completed_pages == 0
    assert cf.query_span(failing, keys, pool).kv_hit_pages == 0
    assert cf.prefetch_span(failing, pool, keys, use_v1=False).counts == {}
