"""Every pool's own verdict, the KV pool through v2, in all three modes.

SGLang 0.5.23 heals its per-pool existence beliefs from ``extra_pool_hit_pages``
(``HybridCacheController._storage_hit_query`` -> ``UnifiedRadixCache.
_invalidate_absent_from_hit_query``), so each number must be that pool's own boundary over the
whole queried span, never one cut short by an earlier pool. The reference is SGLang's own
``HiCacheFile``, attached to the same real host pools and fed the same writes in each test.

The same tests run against an embedded store, a real ``kvtier serve`` (the store in another
process, over its Unix socket) and a real cluster (``kvtier master`` + one ``kvtier serve
--master`` node; the query is evaluated by the master). The pools are real SGLang pools on CPU:
the DeepSeek-V4 group (logical anchor + SWA, C4, C4 indexer, C4 / C4-indexer state, C128) and
MHA / MLA anchors. Nothing is mocked.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

import kvtier_dev.harness.flows as cf
import kvtier_dev.harness.pools as sp
from kvtier.sglang import KvtierStore

import test_cluster as tc
import test_server_mode as sm

kvtier_bin = sm.kvtier_bin

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}
KV, SWA, C4, IDX, C128 = (
    PoolName.KV,
    PoolName.SWA,
    PoolName.DEEPSEEK_V4_C4,
    PoolName.DEEPSEEK_V4_C4_INDEXER,
    PoolName.DEEPSEEK_V4_C128,
)
C4_STATE, IDX_STATE = PoolName.DEEPSEEK_V4_C4_STATE, PoolName.DEEPSEEK_V4_C4_INDEXER_STATE
ON_SWA_INDICES = (SWA, C4_STATE, IDX_STATE)


@pytest.fixture(scope="module", params=["embedded", "server", "cluster"])
def mode(request, tmp_path_factory):
    """The extra_config that puts a KvtierStore in this mode (the store processes live for the
    whole module; every test uses keys of its own)."""
    if request.param == "embedded":
        yield {"dram_capacity_bytes": "64MiB"}
        return
    binary = request.getfixturevalue("kvtier_bin")
    if request.param == "server":
        served = sm.Served(binary, tmp_path_factory.mktemp("serve"))
        yield {"server_socket": served.socket}
        served.stop()
        return
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVTIER_CLUSTER_TOKEN", tc.TOKEN)
        cluster = tc.Cluster(binary, tmp_path_factory.mktemp("cluster"))
        try:
            cluster.add_node("node-a", "127.0.0.1")
            cluster.master.wait_nodes(["node-a"])
            yield cluster.store_config("node-a")
        finally:
            cluster.stop()


def unique_keys(n, tag):
    run = uuid.uuid4().hex[:8]
    return [f"{tag}-{run}-{i:04d}" for i in range(n)]


def kvtier_store(mode, target=None, *, is_mla, interface_v1=True):
    ec = {**DYNAMIC, **mode}
    if interface_v1:
        ec["interface_v1"] = 1
    store = KvtierStore(sp.make_storage_config(is_mla=is_mla, extra_config=ec), {})
    if target is not None:
        cf.attach_backend(store, target)
    return store


def file_store(path, target, *, is_mla):
    store = HiCacheFile(
        sp.make_storage_config(is_mla=is_mla, extra_config={"file_storage_path": str(path)})
    )
    cf.attach_backend(store, target)
    return store


def answer(store, keys, transfers):
    r = store.batch_exists_v2(keys, transfers)
    return r.kv_hit_pages, dict(r.extra_pool_hit_pages), r.restorable_prefix_pages


# ---------------------------------------------------------------------------
# 1. Each pool's own verdict, against HiCacheFile
# ---------------------------------------------------------------------------


def dsv4_pool(stack, name):
    return stack.group.entry_map[name].host_pool


def write_present(backends, stack, name, keys, present, seed):
    """Store pool ``name`` at the page ordinals ``present`` of ``keys`` through every backend."""
    chosen = [keys[i] for i in present]
    if not chosen:
        return
    owner = dsv4_pool(stack, SWA) if name in ON_SWA_INDICES else stack.anchor
    idx = sp.alloc_indices(owner, len(chosen))
    if name != KV:
        sp.fill_pages(dsv4_pool(stack, name), idx, seed)
    for backend in backends:
        result = backend.batch_set_v2([PoolTransfer(name=name, host_indices=idx, keys=chosen)])
        assert result == {name: [True] * len(chosen)}, (type(backend).__name__, name)
    sp.free_indices(owner, idx)


# Six pages written; every pool complete except the holes listed (page ordinals missing), and
# the verdicts SGLang must see. Window of SWA and of its state pools: one page (the harness'
# 128-token window over 256-token pages).
HOLE_SHAPES = {
    # C4 misses page 3: C4 says 3, every other pool (the indexer after it included) says 6.
    "c4-gap": ({C4: [3]}, {C4: 3}, 3, [1, 2, 3]),
    # SWA misses its tail page: SWA says 5, C4 after it still 6.
    "swa-tail": ({SWA: [5]}, {SWA: 5}, 5, [1, 2, 3, 4, 5]),
    # The SWA-derived indexer state misses page 3: prefix 4 is not restorable, the pool's own
    # boundary is still 6.
    "state-hole": ({IDX_STATE: [3]}, {}, 6, [1, 2, 3, 5, 6]),
    # ALL_PAGES and TRAILING holes at once.
    "mixed": ({C128: [4], SWA: [1], C4_STATE: [2]}, {C128: 4}, 4, [1, 4]),
}


@pytest.mark.parametrize("shape", list(HOLE_SHAPES))
def test_every_pool_reports_its_own_boundary(mode, tmp_path, shape):
    holes, short, want_hit, want_restorable = HOLE_SHAPES[shape]
    stack = sp.build_dsv4_pool_group("page_first")
    kv = kvtier_store(mode, stack, is_mla=True)
    hicache = file_store(tmp_path, stack, is_mla=True)
    backends = (kv, hicache)
    keys = unique_keys(6, shape)
    pools = [KV] + [s.name for s in stack.specs if not s.is_anchor]
    for seed, name in enumerate(pools):
        write_present(
            backends, stack, name, keys, [i for i in range(6) if i not in holes.get(name, [])], seed
        )

    transfers = cf.build_prefetch_transfers(len(keys), stack.specs)
    assert {t.name for t in transfers} == set(pools) - {KV}
    hit, verdicts, restorable = answer(kv, keys, transfers)
    file_hit, file_verdicts, file_restorable = answer(hicache, keys, transfers)

    assert (hit, restorable) == (file_hit, file_restorable) == (want_hit, want_restorable)
    # HiCacheFile evaluates every pool over the whole span here (its KV run covers it), so
    # each of its numbers is the pool's own boundary: kvtier must say the same, pool by pool.
    assert verdicts == file_verdicts
    # ... and the hand-computed numbers: 6 everywhere but where a pool's own hole cuts it.
    for t in transfers:
        if t.hit_policy == PoolHitPolicy.TRAILING_PAGES and holes.get(t.name):
            # A one-page window: the largest prefix whose last page is present.
            want = max(p for p in range(1, 7) if p - 1 not in holes[t.name])
        else:
            want = short.get(t.name, 6)
        assert verdicts[t.name] == want, (t.name, verdicts)
    assert verdicts[KV] == 6
    kv.close()


def test_a_pool_holding_nothing_gets_a_verdict_of_zero(mode, tmp_path):
    """HiCacheFile stops evaluating once nothing is restorable and omits 0; kvtier evaluates
    every pool and says 0 for an empty one (omitting it would make SGLang assume the fold)."""
    stack = sp.build_dsv4_pool_group("page_first")
    kv = kvtier_store(mode, stack, is_mla=True)
    keys = unique_keys(4, "zero")
    for seed, spec in enumerate(s for s in stack.specs if not s.is_anchor):
        if spec.name != C4:
            write_present((kv,), stack, spec.name, keys, range(4), seed)
    transfers = cf.build_prefetch_transfers(len(keys), stack.specs)
    hit, verdicts, restorable = answer(kv, keys, transfers)
    assert (hit, restorable) == (0, [])
    assert verdicts[C4] == 0
    assert {name: verdicts[name] for name in verdicts if name != C4} == {
        name: 4 for name in verdicts if name != C4
    }
    kv.close()


# ---------------------------------------------------------------------------
# 2. The KV pool through v2: one set of objects for v1, v2 and the legacy path
# ---------------------------------------------------------------------------


def kv_transfer(idx, keys):
    return PoolTransfer(name=KV, host_indices=idx, keys=list(keys))


def flat_pages(pool, idx):
    return [
        bytes(pool.get_data_page(int(idx[i * pool.page_size]), flat=True).view(torch.uint8).numpy())
        for i in range(idx.numel() // pool.page_size)
    ]


def legacy_get(store, pool, keys):
    dummies = [pool.get_dummy_flat_data_page() for _ in keys]
    got = store.batch_get(list(keys), dummies)
    return [None if g is None else bytes(g.view(torch.uint8).numpy()) for g in got]


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_kv_through_v2_shares_objects_with_v1_and_legacy(mode, kind):
    build = sp.build_mha_host_pool if kind == "mha" else sp.build_mla_host_pool
    anchor = build("page_first", size_pages=32)
    is_mla = kind == "mla"
    store = kvtier_store(mode, anchor, is_mla=is_mla)
    assert store._anchor.zero_copy and store._anchor.flat_is_components
    n = 4
    idx = sp.alloc_indices(anchor, n)

    # v1 write -> v2 get, legacy get, exists every way
    a = unique_keys(n, f"{kind}-v1")
    want_a = sp.fill_pages(anchor, idx, 1)
    assert store.batch_set_v1(a, idx) == [True] * n
    sp.zero_pages(anchor, idx)
    assert store.batch_get_v2([kv_transfer(idx, a)]) == {KV: [True] * n}
    assert sp.read_pages(anchor, idx) == want_a
    assert legacy_get(store, anchor, a) == want_a
    assert store.batch_exists(a) == n
    assert answer(store, a, [])[:2] == (n, {KV: n})
    assert answer(store, a, [PoolTransfer(name=KV, keys=None)])[:2] == (n, {KV: n})

    # v2 write -> v1 get, legacy get, exists
    b = unique_keys(n, f"{kind}-v2")
    want_b = sp.fill_pages(anchor, idx, 2)
    assert store.batch_set_v2([kv_transfer(idx, b)]) == {KV: [True] * n}
    sp.zero_pages(anchor, idx)
    assert store.batch_get_v1(b, idx) == [True] * n
    assert sp.read_pages(anchor, idx) == want_b
    assert legacy_get(store, anchor, b) == want_b
    assert store.batch_exists(b) == n

    # legacy write -> v1 and v2 get, exists
    c = unique_keys(n, f"{kind}-legacy")
    want_c = sp.fill_pages(anchor, idx, 3)
    assert store.batch_set(
        c, [anchor.get_data_page(int(idx[i * anchor.page_size])) for i in range(n)]
    )
    sp.zero_pages(anchor, idx)
    assert store.batch_get_v1(c, idx) == [True] * n
    assert sp.read_pages(anchor, idx) == want_c
    sp.zero_pages(anchor, idx)
    assert store.batch_get_v2([kv_transfer(idx, c)]) == {KV: [True] * n}
    assert flat_pages(anchor, idx) == want_c
    assert answer(store, c, [])[0] == n

    # a page missing from the middle: every path agrees it is a miss
    holed = [a[0], "never-written-" + uuid.uuid4().hex, a[2]]
    assert store.batch_exists(holed) == 1
    assert answer(store, holed, [])[:2] == (1, {KV: 1})
    got = store.batch_get_v2([kv_transfer(idx[: 3 * anchor.page_size], holed)])
    assert got == {KV: [True, False, True]}
    assert legacy_get(store, anchor, holed)[1] is None
    store.close()


def test_a_legacy_only_store_reads_what_v1_wrote(mode):
    """A store started without ``interface_v1`` (SGLang then calls the legacy tensor path)
    counts and reads the zero-copy path's pages: the flat page is the same objects. In the
    server and cluster modes the two stores share one backend; embedded, one process does both."""
    if "server_socket" not in mode and "master_address" not in mode:
        pytest.skip("two embedded stores do not share memory; covered by the test above")
    anchor = sp.build_mha_host_pool("page_first", size_pages=16)
    writer = kvtier_store(mode, anchor, is_mla=False)
    reader = kvtier_store(mode, anchor, is_mla=False, interface_v1=False)
    n = 3
    idx = sp.alloc_indices(anchor, n)
    keys = unique_keys(n, "legacy-reader")
    want = sp.fill_pages(anchor, idx, 7)
    assert writer.batch_set_v1(keys, idx) == [True] * n
    assert reader.batch_exists(keys) == n
    assert legacy_get(reader, anchor, keys) == want
    writer.close()
    reader.close()


def test_logical_anchor_v2_kv_moves_nothing_and_hits(mode):
    stack = sp.build_dsv4_pool_group("page_first")
    store = kvtier_store(mode, stack, is_mla=True)
    keys = unique_keys(3, "logical")
    idx = sp.alloc_indices(stack.anchor, 3)
    before = dict(store.get_stats().store)
    assert store.batch_set_v2([kv_transfer(idx, keys)]) == {KV: [True] * 3}
    assert store.batch_get_v2([kv_transfer(idx, keys)]) == {KV: [True] * 3}
    after = dict(store.get_stats().store)
    for counter in ("puts", "bytes_in", "bytes_out"):
        assert after[counter] == before[counter], counter
    assert answer(store, keys, [PoolTransfer(name=KV, keys=None)]) == (3, {KV: 3}, [1, 2, 3])
    store.close()


class FailOneObject:
    """Forwards to the real native store, except that ``put_buffers`` refuses (does not store)
    the objects whose name contains ``refuse``: a forged partial failure, since a real one
    (a full store part way through a page) cannot be produced on demand."""

    def __init__(self, real, refuse):
        self._real, self._refuse = real, refuse

    def put_buffers(self, names, views, depths):
        keep = [i for i, n in enumerate(names) if self._refuse not in n]
        ok, errors = self._real.put_buffers(
            [names[i] for i in keep], [views[i] for i in keep], depths
        )
        result = [False] * len(names)
        for i, good in zip(keep, ok):
            result[i] = good
        return result, list(errors) + [f"{self._refuse}: refused by the test"]

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_a_legacy_page_that_fails_part_way_leaves_nothing_behind(mode):
    anchor = sp.build_mha_host_pool("page_first", size_pages=8)
    store = kvtier_store(mode, anchor, is_mla=False, interface_v1=False)
    keys = unique_keys(3, "partial")
    idx = sp.alloc_indices(anchor, 3)
    sp.fill_pages(anchor, idx, 9)
    v_suffix = store._anchor.suffixes[1]
    real = store._store
    store._store = FailOneObject(real, f"{keys[1]}{v_suffix}")
    pages = [anchor.get_data_page(int(idx[i * anchor.page_size])) for i in range(3)]
    assert store.batch_set(keys, pages) is False
    store._store = real
    assert store.batch_exists(keys) == 1
    k_of_page_1 = f"{store._prefix}{keys[1]}{store._anchor.suffixes[0]}"
    assert real.object_len(k_of_page_1) is None  # the K that was stored is gone again
    assert legacy_get(store, anchor, keys)[2] is not None  # page 2 was stored whole
    store.close()
